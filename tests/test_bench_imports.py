"""benchmarks/ import only Stride's public names, and have no import cycle (issue 43, item 6). Static: every
benchmarks/*.py is parsed with `ast`, nothing is imported or run.

The public surface is:
* `stride` itself: the names of stride/__init__.py's `_PUBLIC` (Task, Callback, Sink, fit, ...);
* the loop's `Trainer`, `WorkerEnv` and `RunPlan` (stride.trainers.loop);
* the `__all__` of the checkpoint, step and format modules (stride.trainers.run.checkpointing, stride.trainers.step,
  stride.datasets.formats), read from their source.

A module imported whole (`from stride.trainers.run import checkpointing`) may be used only through those names
(`checkpointing.read_meta`). `NOT_YET_PUBLIC` lists what the benchmarks still reach beyond that surface, each with
why: it may only shrink (an entry no benchmark uses any more fails too), and anything new outside the surface fails
naming its file, line and name.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

BENCH = REPO / "benchmarks"
# Stride's subpackages are the repository's top-level folders (stride/__init__.py extends its __path__).
TOP = {"trainers", "datasets", "tune", "ray_cluster"}
LOOP = {"Trainer", "WorkerEnv", "RunPlan"}
ALL_MODULES = ("stride.trainers.run.checkpointing", "stride.trainers.step", "stride.datasets.formats")

# (benchmark file, module, name) -> why it is still imported. Measuring the library's internals directly (the
# stream, FSDP, the blocks, init.from's loader, a local Ray head) needs a public home for each in a module outside
# this change; until then they are listed here, and only here.
NOT_YET_PUBLIC = {
    ("blocks_bench.py", "stride.trainers", "blocks"): "train.activation_checkpointing/train.compile, as the loop applies them",
    ("blocks_bench.py", "stride.trainers.optim", "build_optimizer"): "the config's optimizer, without a Trainer's data",
    ("blocks_bench.py", "stride.trainers.tasks", "make_task"): "the task of a config, without a Trainer's data",
    ("bucketing_bench.py", "stride.datasets.splits", "DataSpec"): "the stream's input, measured directly",
    ("bucketing_bench.py", "stride.datasets.splits", "open_split"): "the stream's input, measured directly",
    ("bucketing_bench.py", "stride.datasets.bucketing", "Padding"): "length bucketing's padding, measured directly",
    ("bucketing_bench.py", "stride.datasets.mixing", "order_for"): "the data order, measured directly",
    ("bucketing_bench.py", "stride.datasets.stream", "TrainStream"): "the stream, measured directly",
    ("checkpoint_bench.py", "stride.trainers", "fsdp"): "FSDP sharding and the rank-0 gather it compares DCP with",
    ("checkpoint_bench.py", "stride.trainers.models", "CharGPT"): "the model checkpointed",
    ("commands_bench.py", "stride.trainers.config_reader", "from_dict"): "the hand-written predict loop's config",
    ("commands_bench.py", "stride.trainers.tasks", "make_task"): "the hand-written predict loop's task",
    ("commands_bench.py", "stride.ray_cluster", "local"): "a local Ray head on free ports, stopped by pid",
    ("file_read_bench.py", "stride.datasets.splits", "DataSpec"): "the stream's input, measured directly",
    ("file_read_bench.py", "stride.datasets.splits", "open_split"): "the stream's input, measured directly",
    ("file_read_bench.py", "stride.datasets.mixing", "order_for"): "the data order, measured directly",
    ("file_read_bench.py", "stride.datasets.stream", "TrainStream"): "the stream, measured directly",
    ("finetune_bench.py", "stride.datasets.splits", "DataSpec"): "a RunPlan's train spec",
    ("finetune_bench.py", "stride.trainers.loop", "plan_run"): "a RunPlan as the launchers build it (init.from's digest)",
    ("finetune_bench.py", "stride.trainers", "fsdp"): "each rank's local parameter bytes",
    ("finetune_bench.py", "stride.trainers", "pretrained"): "init.from's loader, measured directly",
    ("finetune_bench.py", "stride.trainers.tasks", "make_task"): "the task of a config, without a Trainer",
    ("gpu.py", "stride.trainers", "blocks"): "train.compile/activation checkpointing; torch alone (no pydantic)",
    ("gpu.py", "stride.trainers.models", "CharGPT"): "the model; torch alone (no pydantic)",
    ("gpu.py", "stride.trainers.telemetry", "peak_table"): "the GPU peak table of MFU; torch alone",
    ("lock_bench.py", "stride.trainers.run", "lock"): "the run lock's fence and heartbeat, measured directly",
    ("preemption_bench.py", "stride.ray_cluster", "local"): "a two-node local Ray cluster, stopped by pid",
    ("ray_bench.py", "stride.datasets.order", "Order"): "the data order, measured directly",
    ("ray_bench.py", "stride.datasets.frame", "column_to_numpy"): "the stream's column conversion",
    ("ray_bench.py", "stride.datasets.stream", "READ_THREADS"): "the stream's read threads",
    ("ray_bench.py", "stride.datasets.stream", "TrainStream"): "the stream, measured directly",
    ("ray_bench.py", "stride.datasets.splits", "cache_folder"): "the driver's layout cache",
    ("ray_bench.py", "stride.datasets.splits", "open_split"): "the driver's data check",
    ("ray_bench.py", "stride.trainers.launch.checks", "prepare"): "the driver's pre-flight check, measured",
    ("ray_bench.py", "stride.trainers.launch.ray", "build_trainer"): "Stride's TorchTrainer, in the bench's Ray",
    ("ray_bench.py", "stride.ray_cluster.connect", "init_ray"): "one Ray for several measurements",
    ("ray_bench.py", "stride.ray_cluster.connect", "quiet_ray_env"): "one Ray for several measurements",
    ("stream_memory.py", "stride.datasets.splits", "read_layouts"): "the JSON Lines index made before the runs",
    ("stream_memory.py", "stride.datasets.splits", "resolve_files"): "the JSON Lines index made before the runs",
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
    surface = {"stride": set(_literal(REPO / "stride" / "__init__.py", "_PUBLIC")), "stride.trainers.loop": LOOP}
    for module in ALL_MODULES:
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
    found, used = [], set()
    for path in bench_files():
        for line, module, name in stride_uses(path):
            if name in surface.get(module, ()):
                continue
            used.add((path.name, module, name))
            if (path.name, module, name) not in NOT_YET_PUBLIC:
                found.append(f"benchmarks/{path.name}:{line}: {module}.{name} is not public")
    assert not found, "\n".join(found)
    gone = sorted(set(NOT_YET_PUBLIC) - used)
    assert not gone, f"no benchmark imports these any more; remove them from NOT_YET_PUBLIC: {gone}"


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
    f.write_text("import stride\nfrom stride import Task\nfrom stride.trainers.loop import Trainer, plan_run\n"
                 "def g():\n    from stride.trainers.run import checkpointing\n"
                 "    return checkpointing.read_meta, checkpointing.STATE, stride.fit, stride.hidden\n"
                 "import stride.trainers.fsdp\n")
    surface = public_surface()
    bad = [(line, m, n) for line, m, n in stride_uses(f) if n not in surface.get(m, ())]
    assert bad == [(3, "stride.trainers.loop", "plan_run"), (7, "stride.trainers", "fsdp"),
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
