"""The package's floors, read from its imports (every `import`, at module level or inside a function): no cycle, and
the lower floors (ray_cluster/, datasets/, trainers/run/) never reach up into how a run is launched
(trainers/launch/) or what a command does with it (trainers/commands/)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGES = ("trainers", "datasets", "tune", "ray_cluster")
LOWER = ("stride.ray_cluster", "stride.datasets", "stride.trainers.run")
UPPER = ("stride.trainers.launch", "stride.trainers.commands")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "stride":
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["stride", *parts])


def modules() -> dict[str, Path]:
    files = [p for pkg in (*PACKAGES, "stride") for p in (REPO / pkg).rglob("*.py")
             if "__pycache__" not in p.parts and "configs" not in p.parts]
    return {module_name(p): p for p in files}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The Stride modules `path` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("stride"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("stride")}
    return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for name in sorted(g):
        if name not in index:
            visit(name)
    return found


def test_the_import_graph_has_no_cycle():
    g = graph()
    assert len(g) > 80 and g["stride.trainers.loop"]  # the walk sees the package and its imports
    assert cycles(g) == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_lower_floors_never_import_launch_or_commands():
    wrong = [f"{name} imports {dep}" for name, deps in graph().items() if name.startswith(LOWER)
             for dep in sorted(deps) if dep.startswith(UPPER)]
    assert wrong == []
