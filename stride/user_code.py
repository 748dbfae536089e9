"""Where a user's own modules (tasks, callbacks, optimizers: "<module>:<Class>" in a config) are found.

The driver's working directory, then STRIDE_TASK_PATH: the driver passes its folders to every worker (Ray's, on any
node) in that variable, and they are appended to sys.path (never prepended: a user's folder must not hide an
installed package). Commands that read a run folder someone else may have written (generate) turn the
working directory off (`search_working_directory(False)`). Standard library only: the cluster layer
(ray_cluster/connect.py) passes the path to its workers without importing trainers/.
"""

from __future__ import annotations

import os

TASK_PATH_ENV = "STRIDE_TASK_PATH"
_search_working_directory = True


def search_working_directory(on: bool) -> None:
    """Whether a user's module may come from the working directory (training: yes; generate.py: no, a module
    planted beside a run folder must not be found by accident)."""
    global _search_working_directory
    _search_working_directory = on


def searches_working_directory() -> bool:
    return _search_working_directory


def task_search_path() -> list[str]:
    """Folders a user's module may live in: STRIDE_TASK_PATH (set by the driver for its workers), then the working
    directory."""
    extra = [p for p in os.environ.get(TASK_PATH_ENV, "").split(os.pathsep) if p]
    return extra + ([os.getcwd()] if _search_working_directory else [])
