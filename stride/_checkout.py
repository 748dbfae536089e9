"""Run Stride's scripts from a checkout that is not installed (`python trainers/main.py` in a Ray job's working
directory, on nodes without Stride): register this folder as the `stride` package without putting the repository
root on sys.path (its `datasets/` would hide Hugging Face `datasets`). The scripts run this file by path."""

import importlib.util
import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
_script_dir = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else None
if sys.path and _script_dir is not None and Path(sys.path[0] or ".").resolve() == _script_dir:
    sys.path.pop(0)  # `python trainers/main.py` put trainers/ itself on the path: its modules are not top-level
if "stride" not in sys.modules and importlib.util.find_spec("stride") is None:
    _spec = importlib.util.spec_from_file_location("stride", _here / "__init__.py", submodule_search_locations=[str(_here)])
    _module = importlib.util.module_from_spec(_spec)
    _module._CHECKOUT_ROOT = str(_here.parent)  # the Ray workers this process starts need it on PYTHONPATH
    sys.modules["stride"] = _module
    _spec.loader.exec_module(_module)
