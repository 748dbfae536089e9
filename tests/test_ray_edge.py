"""Ray's private names stay behind ray_cluster/ray_edge.py: the pinned Ray still has each one where Stride looks,
and no other module of Stride's reaches into Ray's private modules."""

from __future__ import annotations

import ast

from conftest import REPO

PRIVATE = ("._private", "._internal", "._raylet")
PACKAGES = ("trainers", "datasets", "tune", "ray_cluster", "stride", "benchmarks")


def test_the_pinned_ray_has_every_private_name_stride_uses():
    from stride.ray_cluster import ray_edge

    assert ray_edge.contract_problems() == []


def test_a_moved_name_is_named_in_one_line(monkeypatch):
    from stride.ray_cluster import ray_edge

    monkeypatch.setattr(ray_edge, "PRIVATE_NAMES", (*ray_edge.PRIVATE_NAMES, ("ray._private.ray_logging", "gone"),
                                                    ("ray._private.no_such_module", "x")))
    problems = ray_edge.contract_problems()
    assert problems[0].endswith("ray._private.ray_logging has no gone; ray_cluster/ray_edge.py uses it"), problems
    assert "module ray._private.no_such_module is gone" in problems[1] and len(problems) == 2


def private_ray_imports(path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                  if n.split(".")[0] == "ray" and any(p in n for p in PRIVATE)]
    return found


def test_no_module_but_the_edge_imports_a_private_ray_name():
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if p != REPO / "ray_cluster" / "ray_edge.py"]
    assert files and [f for p in files for f in private_ray_imports(p)] == []
    assert private_ray_imports(REPO / "ray_cluster" / "ray_edge.py")  # the check sees imports inside functions
