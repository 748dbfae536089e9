"""What every benchmark part records and prints: the machine's CPU beside its runs, and its JSON on stdout (and in
--out). Standard library only."""

from __future__ import annotations

import json
from pathlib import Path


def cpu_model() -> str | None:
    """This machine's CPU, stored with the runs: `--only` measures a part again, maybe on another machine than the
    rest of latest.json."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        return None


def print_json(doc: dict, out: str | None) -> None:
    """A part's figures and raw runs, printed, and written to `out` when given."""
    text = json.dumps(doc, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
