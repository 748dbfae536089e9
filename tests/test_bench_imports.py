"""benchmarks/ import only Stride's public names, and have no import cycle (issue 43, item 6). Static: every
benchmarks/*.py is parsed with `ast`, nothing is imported or run.

The public surface is:
* `stride` itself: the names of stride/__init__.py's `_PUBLIC` (Task, Callback, Sink, fit, ...);
* the `__all__` of each module of PUBLIC_MODULES, read from its source. Each is there for a reason of its own: a
  benchmark measures that part of the library directly (the stream, FSDP, the run lock, init.from's loader) or builds
  what the launchers build (a RunPlan, a task, the driver's checks, Stride's TorchTrainer, a local Ray head), and its
  `__all__` names what it offers for that.

A module imported whole (`from stride.trainers.run import checkpointing`) may be used only through those names
(`checkpointing.read_meta`). Anything outside the surface fails, naming its file, line and name: a new need is met by
a public name (an `__all__` entry, with its module here and why), never by an exception list.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

BENCH = REPO / "benchmarks"
# Stride's subpackages are the repository's top-level folders (stride/__init__.py extends its __path__).
TOP = {"trainers", "datasets", "tune", "ray_cluster"}

# module -> why its __all__ is public.
PUBLIC_MODULES = {
    "stride.trainers.loop": "Trainer, WorkerEnv and RunPlan: the loop as the launchers build it (plan_run)",
    "stride.trainers.step": "the optimizer step and evaluation both launchers run",
    "stride.trainers.run.checkpointing": "the checkpoint format: find, verify, read and load checkpoints",
    "stride.trainers.run.lock": "the run lock and the fence every worker checks before it writes",
    "stride.trainers.tasks": "the task of a config (model.name), without a Trainer",
    "stride.trainers.config_reader": "a Config from a YAML file and overrides, or from a run's summary",
    "stride.trainers.optim": "the config's optimizer and schedule, without a Trainer's data",
    "stride.trainers.models": "the built-in models: plain nn.Modules, torch alone",
    "stride.trainers.blocks": "train.activation_checkpointing and train.compile on a task's blocks; torch alone",
    "stride.trainers.telemetry": "the GPU peak table behind MFU; torch alone",
    "stride.trainers.fsdp": "FSDP2 sharding, each rank's parameter bytes, and the earlier format's rank-0 gather",
    "stride.trainers.pretrained": "init.from's loader, as a worker runs it",
    "stride.trainers.launch.checks": "the driver's checks before a run: the task and its data specs (prepare)",
    "stride.trainers.launch.ray": "Stride's TorchTrainer for a config (build_trainer), in a caller's own Ray",
    "stride.datasets.formats": "the input formats and their file layouts",
    "stride.datasets.splits": "a split's files, layouts and spec: the stream's input",
    "stride.datasets.order": "the deterministic sample order",
    "stride.datasets.mixing": "the order a spec is read in (several sources mixed, lengths bucketed)",
    "stride.datasets.bucketing": "length bucketing's padding",
    "stride.datasets.stream": "the stream each worker reads its batches from",
    "stride.datasets.frame": "a batch's columns, converted as the stream converts them",
    "stride.ray_cluster.connect": "Ray started or joined as Stride's driver does it",
    "stride.ray_cluster.local": "a local Ray head (and worker nodes) with token auth, stopped by pid",
    "stride.ray_cluster.node": "the process table (live processes, their start times), as the cluster tools read it",
}


def _module_file(module: str) -> Path:
    parts = module.split(".")
    root = REPO / parts[1] if len(parts) > 1 and parts[1] in TOP else REPO / "stride"
    rest = parts[2:] if len(parts) > 1 and parts[1] in TOP else parts[1:]
    base = root.joinpath(*rest)
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _literal(path: Path, name: str):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.relative_to(REPO)} has no literal {name}")


def public_surface() -> dict[str, set[str]]:
    """module -> the names of it a benchmark may import."""
    surface = {"stride": set(_literal(REPO / "stride" / "__init__.py", "_PUBLIC"))}
    for module in PUBLIC_MODULES:
        surface[module] = set(_literal(_module_file(module), "__all__"))
    return surface


def stride_uses(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every Stride name `path` imports, and of every attribute it reads of a public module
    it imported whole (`checkpointing.read_meta`), wherever the import is (functions too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    surface = public_surface()
    uses, whole = [], {}  # whole: local name -> a public module imported whole
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "stride":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in surface:  # a public module imported whole: checked where it is used
                    whole[alias.asname or alias.name] = full
                else:
                    uses.append((node.lineno, node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "stride":
                    continue
                if alias.name in surface and (alias.asname or alias.name == "stride"):
                    whole[alias.asname or alias.name] = alias.name
                else:  # `import stride.trainers.x`: the module itself, reached by its dotted name
                    module, _, name = alias.name.rpartition(".")
                    uses.append((node.lineno, module, name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in whole:
            uses.append((node.lineno, whole[node.value.id], node.attr))
    return uses


def bench_files() -> list[Path]:
    files = sorted(BENCH.glob("*.py"))
    assert len(files) > 10, files
    return files


def test_benchmarks_import_only_strides_public_names():
    surface = public_surface()
    found = [f"benchmarks/{path.name}:{line}: {module}.{name} is not public"
             for path in bench_files() for line, module, name in stride_uses(path)
             if name not in surface.get(module, ())]
    assert not found, "\n".join(found)


def test_the_public_surface_exists():
    """Every name of the surface is defined (or imported) at the top of its module: an __all__ that names nothing
    would let anything through."""
    for module, names in public_surface().items():
        if module == "stride":
            continue
        tree = ast.parse(_module_file(module).read_text())
        defined = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.ImportFrom):
                defined.update(a.asname or a.name for a in node.names)
        assert names <= defined, f"{module}: {sorted(names - defined)} in the public surface but not defined"


def test_the_checker_sees_private_names(tmp_path):
    """The checker itself: a private name, a public module's private attribute and a whole-module import are caught;
    public names pass."""
    f = tmp_path / "b.py"
    f.write_text("import stride\nfrom stride import Task\nfrom stride.trainers.loop import Trainer, to_device\n"
                 "def g():\n    from stride.trainers.run import checkpointing\n"
                 "    return checkpointing.read_meta, checkpointing.STATE, stride.fit, stride.hidden\n"
                 "import stride.trainers.policies\n")
    surface = public_surface()
    bad = [(line, m, n) for line, m, n in stride_uses(f) if n not in surface.get(m, ())]
    assert bad == [(3, "stride.trainers.loop", "to_device"), (7, "stride.trainers", "policies"),
                   (6, "stride.trainers.run.checkpointing", "STATE"), (6, "stride", "hidden")], bad


def _bench_imports(path: Path) -> set[str]:
    """The benchmark modules `path` imports (benchmarks.x, or a sibling imported by its bare name)."""
    siblings = {p.stem for p in BENCH.glob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "benchmarks" and len(parts) > 1:
                out.add(parts[1])
            elif parts[0] == "benchmarks":
                out.update(a.name for a in node.names if a.name in siblings)
            elif parts[0] in siblings:
                out.add(parts[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "benchmarks" and len(parts) > 1:
                    out.add(parts[1])
                elif parts[0] in siblings:
                    out.add(parts[0])
    return out & siblings - {path.stem}


def test_benchmarks_have_no_import_cycle():
    graph = {p.stem: _bench_imports(p) for p in bench_files()}
    done, path = set(), []

    def visit(node: str) -> None:
        if node in path:
            cycle = path[path.index(node):] + [node]
            raise AssertionError("benchmarks import each other in a circle: " + " -> ".join(f"{n}.py" for n in cycle))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert "procs" in graph and not graph["procs"], "benchmarks/procs.py imports no benchmark"
