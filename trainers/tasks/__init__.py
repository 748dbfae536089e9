"""Built-in tasks and how `model.name` finds a task: a built-in name, or "<module>:<Class>" of a user's own
(`optim.name` finds a user's optimizer class the same way: load_class).

The user's module is imported from the working directory or PYTHONPATH. The driver passes its working directory
to every worker as STRIDE_TASK_PATH; those folders are appended to sys.path (never prepended: a user's folder must
not hide an installed package). Training trusts the working directory because the user named model.name in their
own config; commands that read a run folder someone else may have written (generate.py) turn that off
(`search_working_directory(False)`) and import a user's module only with the user's consent (`consent`).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from stride.errors import ConfigError
from stride.user_code import searches_working_directory, task_search_path

# The registry of built-in names: the only place besides the tasks themselves that names them.
BUILTIN = {
    "char_gpt": "stride.trainers.tasks.char_gpt:CharGPTTask",
    "mlp": "stride.trainers.tasks.mlp:MLPTask",
}
DEFAULT = "char_gpt"
def consent(name: str, named: str | None, trust_remote_code: bool, origin: str) -> None:
    """Refuse (ConfigError) to import the task `name` that a run folder's `origin` (its summary.json) names, unless it
    is built in, the user named the same task (`--task`), or passed --trust-remote-code: importing a module runs it."""
    if named is not None and named != name:
        raise ConfigError(f"--task ({named[:200]}) is not the task {origin} names, model.name ({name[:200]}); pass "
                          f"--task {name[:200]} if you trust that module, or the run folder that trained {named[:200]}")
    if name in BUILTIN or named == name or trust_remote_code:
        return
    raise ConfigError(f"{origin} names model.name ({name[:200]}), a module of your own that importing would run; "
                      f"pass --task {name[:200]} (found in the working directory or on PYTHONPATH) if you trust it, or "
                      f"--trust-remote-code")


def task_class(name: str):
    """`model.name` -> the Task subclass. Raises ConfigError (one line, exit 2) naming what to fix."""
    from stride.trainers.task import Task

    spec = BUILTIN.get(name, name)
    module_name, colon, class_name = spec.partition(":")
    if not colon or not module_name or not class_name:
        raise ConfigError(f"model.name ({name}) is neither a built-in task ({', '.join(BUILTIN)}) nor "
                          f"\"<module>:<Class>\"; use e.g. model.name=my_task:MyTask (my_task.py in the working "
                          f"directory or on PYTHONPATH)")
    cls = load_class("model.name", name, spec, user=name not in BUILTIN)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"model.name ({name}): {class_name} is not a stride.Task subclass; "
                          f"define it as class {class_name}(stride.Task)")
    if not (isinstance(cls.Config, type) and issubclass(cls.Config, Task.Config)):
        raise ConfigError(f"model.name ({name}): {class_name}.Config must subclass stride.Task.Config")
    return cls


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


def make_task(cfg, facts: dict | None = None):
    """The task of a resolved config, with the facts its `inspect` found (the driver passes them on)."""
    return task_class(cfg.model.name)(cfg.model, cfg.data, facts)
