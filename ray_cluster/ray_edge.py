"""Every private name of Ray that Stride uses, in one place.

Ray's public API does not cover a few things Stride needs: quieting Ray Train's per-report log lines, filtering and
routing the worker output Ray prints on the driver, passing an environment variable through Ray Train's controller,
re-reading the auth mode after Ray was imported, and the node provider `ray down` uses. Each is one function here,
and PRIVATE_NAMES lists what they reach into, so that `contract_problems()` (tests/test_ray_edge.py) fails a test
with one line naming what moved when Ray is upgraded, rather than a user's run. Ray is pinned (setup.cfg); a
private name is checked against that version.

Standard library only at import time: the cluster layer imports this without importing Ray.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

# (module, attribute): what the functions below use.
PRIVATE_NAMES = (
    ("ray.train.v2._internal.execution.context", "logger"),
    ("ray.train.v2._internal.execution.context", "get_train_context"),
    ("ray.train.v2._internal.execution.storage", "logger"),
    ("ray.train.v2._internal.constants", "ENV_VARS_TO_PROPAGATE"),
    ("ray._private.ray_logging", "global_worker_stdstream_dispatcher"),
    ("ray._raylet", "Config"),
    ("ray.autoscaler._private.providers", "_get_node_provider"),
)
DISPATCHER_NAMES = ("add_handler", "remove_handler", "handlers", "_lock")
RAY_PRINT_LOGS = "ray_print_logs"  # the dispatcher's handler that prints worker output on the driver


def contract_problems() -> list[str]:
    """One line per private name the installed Ray no longer has where Stride looks for it (empty: all there)."""
    import ray

    problems = []
    for module, name in PRIVATE_NAMES:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError as e:
            problems.append(f"ray {ray.__version__}: module {module} is gone ({e}); ray_cluster/ray_edge.py uses {name} "
                            f"from it")
            continue
        if not found:
            problems.append(f"ray {ray.__version__}: {module} has no {name}; ray_cluster/ray_edge.py uses it")
    dispatcher = stdstream_dispatcher()
    for attr in DISPATCHER_NAMES:
        if dispatcher is not None and not hasattr(dispatcher, attr):
            problems.append(f"ray {ray.__version__}: the worker stdstream dispatcher has no {attr}; "
                            f"ray_cluster/ray_edge.py uses it")
    return problems


def quiet_train_loggers() -> None:
    """Ray Train logs one INFO line per report and per checkpoint (loggers named after their files); Stride's say
    more. A checkpoint whose write failed (a full disk) fails Ray's upload thread, which logs the traceback and
    raises it into the training thread: it ends the run in the driver's one line, not in 40 more lines beside it."""
    from ray.train.v2._internal.execution import context, storage

    context.logger.setLevel(logging.WARNING)
    storage.logger.setLevel(logging.WARNING)
    context.logger.addFilter(lambda record: record.exc_info is None)


def preemption_info():
    """This worker's copy of Ray Train's preemption notice (Ray 2.60: its PreemptionWatcher sees a node of the gang
    drained with reason preemption and gives every worker the notice, mark_preempt), with preempted_node_ids and
    deadline_ms; None without one. An attribute read: no barrier, unlike ray.train.get_preemption_info(), so the
    loop asks it at every step and agrees with one all-reduce."""
    from ray.train.v2._internal.execution import context

    try:
        return context.get_train_context().preemption_context.preemption_info
    except AttributeError:  # a Ray without the watcher
        return None


def stdstream_dispatcher() -> Any | None:
    """The dispatcher through which Ray prints its workers' output on the driver (handlers by name; Ray 2.60's own
    is "ray_print_logs"), or None in a Ray without it."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    return global_worker_stdstream_dispatcher


def route_worker_output(name: str, handler: Callable[[dict], None], replace: str | None = None) -> None:
    """Send the workers' output lines ({"lines", "pid", "actor_name", ...}) to `handler`, instead of the handler
    named `replace` when given."""
    dispatcher = stdstream_dispatcher()
    if dispatcher is None:
        return
    if replace:
        dispatcher.remove_handler(replace)
    dispatcher.add_handler(name, handler)


def filter_worker_output(keep: Callable[[str], bool]) -> None:
    """Drop the worker output lines `keep` refuses from what Ray prints on the driver (its RAY_PRINT_LOGS handler);
    every other line is printed as before. Once per handler, however often it is called."""
    dispatcher = stdstream_dispatcher()
    if dispatcher is None:
        return

    def wrap(handler):
        def drop(data):
            lines = [ln for ln in data.get("lines", ()) if keep(ln)]
            if lines:
                handler(dict(data, lines=lines))
        drop.stride_filter = True
        return drop

    with dispatcher._lock:
        dispatcher.handlers = [(name, wrap(h) if name == RAY_PRINT_LOGS and not getattr(h, "stride_filter", False)
                                else h) for name, h in dispatcher.handlers]


def propagate_env_var(name: str) -> None:
    """Have Ray Train's controller copy `name` from the driver's environment to itself and to every worker (Ray 2.60
    keeps the list in ENV_VARS_TO_PROPAGATE); nothing in a Ray without it."""
    try:
        from ray.train.v2._internal import constants

        constants.ENV_VARS_TO_PROPAGATE.add(name)
    except (ImportError, AttributeError):
        pass


def reread_auth_mode() -> None:
    """Ray reads RAY_AUTH_MODE when it is imported: read it again, for a process that set it afterwards."""
    from ray._raylet import Config

    Config.initialize("")


def node_provider(provider: dict, cluster_name: str):
    """The autoscaler's node provider for a cluster YAML's `provider` section, as `ray down` gets it."""
    from ray.autoscaler._private.providers import _get_node_provider

    return _get_node_provider(provider, cluster_name)
