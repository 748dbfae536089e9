"""The docs name what the code has: every file README.md's Layout table names exists where it says."""

import re

from conftest import REPO


def layout_rows() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+/)`[^|]* \| (.*) \|$", text, re.M)


def test_every_file_the_readmes_layout_names_exists():
    rows = layout_rows()
    assert {"stride/", "trainers/", "datasets/", "tune/", "ray_cluster/"} <= {folder for folder, _ in rows}
    named = [(folder, name) for folder, cell in rows for name in re.findall(r"`([\w./-]+\.py|[\w-]+/)`", cell)]
    assert len(named) > 40
    missing = [folder + name for folder, name in named
               if not (REPO / folder / name).exists() and not any((REPO / folder).glob(f"*/{name}"))]
    assert not missing, f"README.md's Layout names files that are gone: {missing}"
