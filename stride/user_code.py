"""Where a user's own modules (tasks, callbacks, sinks, optimizers, schedules: "<module>:<Class>" in a config) are
found, and how they are imported (load_class: one line naming the config key for anything that goes wrong).

The driver's working directory, then STRIDE_TASK_PATH: the driver passes its folders to every worker (Ray's, on any
node) in that variable, and they are appended to sys.path (never prepended: a user's folder must not hide an
installed package). Commands that read a run folder someone else may have written (generate) turn the
working directory off (`without_working_directory()`). Standard library only: the cluster layer
(ray_cluster/connect.py) passes the path to its workers without importing trainers/.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback

from stride.errors import ConfigError

TASK_PATH_ENV = "STRIDE_TASK_PATH"
_search_working_directory = True


@contextlib.contextmanager
def without_working_directory():
    """A user's module may not come from the working directory while this lasts (training: it may; generate: no, a
    module planted beside a run folder must not be found by accident). Scoped, so that a command called in-process
    leaves the search as it found it."""
    global _search_working_directory
    before, _search_working_directory = _search_working_directory, False
    try:
        yield
    finally:
        _search_working_directory = before


def searches_working_directory() -> bool:
    return _search_working_directory


def task_search_path() -> list[str]:
    """Folders a user's module may live in: STRIDE_TASK_PATH (set by the driver for its workers), then the working
    directory."""
    extra = [p for p in os.environ.get(TASK_PATH_ENV, "").split(os.pathsep) if p]
    return extra + ([os.getcwd()] if _search_working_directory else [])


def load_class(key: str, name: str, spec: str, user: bool = True):
    """The attribute `spec` ("<module>:<Class>") names, for the config key `key` whose value is `name`: a user's
    module (`user`) is looked for in task_search_path() too. Raises ConfigError (one line, exit 2) naming `key`."""
    module_name, _, class_name = spec.partition(":")
    if user:  # a user's module: from the working directory or STRIDE_TASK_PATH
        for folder in task_search_path():
            if folder not in sys.path:
                sys.path.append(folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            where = f"the working directory ({os.getcwd()}) or " if searches_working_directory() else ""
            raise ConfigError(f"{key} ({name}): module {module_name} is not importable; put {module_name}.py in "
                              f"{where}a folder on PYTHONPATH") from None
        raise ConfigError(f"{key} ({name}): importing {module_name} failed: {_where(e)}; install the missing "
                          f"module or fix the import") from None
    except SystemExit as e:  # else the driver would exit with the module's code, 0 included, having trained nothing
        raise ConfigError(f"{key} ({name}): module {module_name} called sys.exit({e.code!r}) while being "
                          f"imported{_where_raised(e)}; keep sys.exit under `if __name__ == \"__main__\":`") from None
    except KeyboardInterrupt as e:
        raise ConfigError(f"{key} ({name}): module {module_name} raised KeyboardInterrupt while being "
                          f"imported{_where_raised(e)} (Ctrl-C, or the module raises it); fix the module") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed to import: one line naming where
        raise ConfigError(f"{key} ({name}): importing {module_name} failed: {_where(e)}; fix the module") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"{key} ({name}): module {module_name} has no {class_name}; "
                          f"name a class defined in {getattr(module, '__file__', module_name)}")
    return cls



def _where_raised(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""



def _where(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}{_where_raised(e)}"
