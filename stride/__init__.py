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

from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "trainers" / "__init__.py").is_file() and str(_ROOT) not in __path__:
    __path__.append(str(_ROOT))  # a checkout: stride.trainers is <repo>/trainers

__version__ = "0.2.0"

_PUBLIC = {
    "Task": "stride.trainers.task",
    "Callback": "stride.trainers.callbacks",
    "LossOutput": "stride.trainers.step",
    "DataSplit": "stride.datasets.splits",
    "DataError": "stride.datasets.splits",
    "Config": "stride.trainers.config",
    "load_config": "stride.trainers.config",
    "fit": "stride.trainers.main",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'stride' has no attribute {name!r}")
