"""Stride: your own model, data and loss, trained the same way on a laptop, a Ray cluster or SLURM.

    from stride import Task          # the contract a model, its data columns and its loss are written against
    from stride import Callback      # code at fixed points of the loop (docs/callbacks.md)
    stride.fit(config)               # train a config (a path, a dict or a Config) on Ray, as `python -m stride` does

The subpackages are the repository's top-level folders: `stride.trainers` (trainers/), `stride.datasets`
(datasets/), `stride.tune` (tune/) and `stride.ray_cluster` (ray_cluster/). setup.cfg's package_dir maps them
when Stride is installed; from a checkout that is not installed, this package finds them beside itself. Nothing
else is put on sys.path, so the repository's `datasets/` never hides Hugging Face `datasets`.

Imports here are lazy: `import stride.trainers.step` must work with torch alone (benchmarks/gpu.py on a GPU
machine without Ray or pydantic).
"""

from __future__ import annotations

import os as _os
import sys as _sys


def _started_as_stride_module() -> bool:
    """Whether this interpreter was started as `python -m stride...` (stride, stride.trainers.eval, ...)."""
    argv = getattr(_sys, "orig_argv", [])
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1].split(".")[0] == "stride"
        if arg.startswith("-m"):
            return arg[2:].split(".")[0] == "stride"
    return False


# `python -m` puts the working directory first on sys.path, ahead of the standard library and every installed
# package: a numpy.py or argparse.py beside a run folder someone else wrote would be imported by the command that
# reads it. This runs before Stride imports anything else (the `stride` executable and the scripts never have
# the working directory there; a user's own modules are found through stride/user_code.py, appended).
if _started_as_stride_module() and _sys.path and _sys.path[0] in ("", _os.getcwd()):
    del _sys.path[0]

from pathlib import Path  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "trainers" / "__init__.py").is_file() and str(_ROOT) not in __path__:
    __path__.append(str(_ROOT))  # a checkout: stride.trainers is <repo>/trainers

__version__ = "0.2.0"

_PUBLIC = {
    "Task": "stride.trainers.task",
    "Callback": "stride.trainers.callbacks.base",
    "Sink": "stride.trainers.sinks.base",
    "LossOutput": "stride.trainers.step",
    "DataSplit": "stride.datasets.splits",
    "DataError": "stride.errors",
    "Config": "stride.trainers.config",
    "load_config": "stride.trainers.config_reader",
    "fit": "stride.trainers.main",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'stride' has no attribute {name!r}")
