"""Built-in tasks and how `model.name` finds a task: a built-in name, or "<module>:<Class>" of a user's own
(`optim.name` finds a user's optimizer class the same way: load_class).

The user's module is imported from the working directory or PYTHONPATH. The driver passes its working directory
to every worker as STRIDE_TASK_PATH; those folders are appended to sys.path (never prepended: a user's folder must
not hide an installed package). Training trusts the working directory because the user named model.name in their
own config; commands that read a run folder someone else may have written (generate.py) turn that off
(`user_code.without_working_directory()`) and import a user's module only with the user's consent (`consent`).
"""

from __future__ import annotations


from stride.errors import ConfigError
from stride.user_code import load_class

__all__ = ["make_task", "task_class"]

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


def make_task(cfg, facts: dict | None = None):
    """The task of a resolved config, with the facts its `inspect` found (the driver passes them on)."""
    return task_class(cfg.model.name)(cfg.model, cfg.data, facts)
