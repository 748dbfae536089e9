"""`stride` is the one name Stride installs: the repo's folders are its subpackages, and Hugging Face `datasets`
(installed in the test venv) stays importable beside it."""

import subprocess

from conftest import PYTHON, REPO


def _python(code: str, cwd) -> str:
    r = subprocess.run([PYTHON, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_only_stride_is_installed_and_datasets_is_hugging_faces(tmp_path):
    out = _python("""
import importlib.util, datasets, stride, stride.datasets, stride.trainers.loop
print({n: importlib.util.find_spec(n) is not None for n in ('trainers', 'tune', 'ray_cluster')})
print(datasets.__file__)
print(hasattr(datasets, 'load_dataset'), stride.datasets.__file__)
print(sorted(stride.__all__))
""", cwd=tmp_path)  # a user's folder: not the checkout
    found, hf_file, checks, public = out.splitlines()
    assert found == "{'trainers': False, 'tune': False, 'ray_cluster': False}"
    assert "site-packages" in hf_file and not hf_file.startswith(str(REPO / "datasets"))
    assert checks == f"True {REPO}/datasets/__init__.py"
    for name in ("Task", "DataSplit", "DataError", "Config", "load_config", "fit"):
        assert f"'{name}'" in public


def test_the_public_api_resolves():
    import stride
    from stride.trainers.task import Task

    assert stride.Task is Task and stride.DataError.__name__ == "DataError"
    assert callable(stride.fit) and callable(stride.load_config)


def test_main_runs_as_a_script_without_stride_installed():
    # `ray job submit --working-dir .` runs `python trainers/main.py` on nodes where Stride is not installed:
    # the script finds the checkout's stride package itself, without putting the repo root on sys.path.
    code = f"""
import runpy, sys
sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]
sys.path = [p for p in sys.path if p not in ('', {str(REPO)!r}) and 'editable' not in p]
sys.argv = ['trainers/main.py', '--config', 'trainers/configs/char_gpt.yaml', '--print-config']
try:
    runpy.run_path('trainers/main.py', run_name='__main__')
except SystemExit as e:
    assert e.code in (0, None), e.code
import stride.trainers
print('FOUND', stride.trainers.__file__, stride._CHECKOUT_ROOT, {str(REPO)!r} in sys.path)
"""
    r = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"FOUND {REPO}/trainers/__init__.py {REPO} False" in r.stdout
    assert "model:" in r.stdout  # the resolved config was printed


def test_the_data_and_cluster_layers_import_nothing_of_trainers():
    """datasets/ and ray_cluster/ sit under trainers/: they take Stride's errors from stride/errors.py and the user's
    module path from stride/user_code.py. The SLURM launcher's `run-dir` is the exception: it resolves a user's
    training config to the run folder, as the driver will."""
    import re

    offenders = []
    for path in sorted([*(REPO / "datasets").rglob("*.py"), *(REPO / "ray_cluster").rglob("*.py")]):
        if path.relative_to(REPO).as_posix() == "ray_cluster/slurm/launch.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*(from|import)\s+stride\.trainers\b", line):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == []


def test_a_regular_install_carries_every_subpackage():
    """setup.cfg lists packages one by one (package_dir maps the repo's folders under `stride`): a folder with an
    __init__.py that is not listed is missing from a wheel, and so from `pip install .` on a cluster's nodes, while
    the editable install of a checkout still finds it."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    mapped = {line.split("=")[0].strip(): line.split("=")[1].strip()
              for line in cfg["options"]["package_dir"].strip().splitlines()}
    found = {top + "." + ".".join(init.parent.relative_to(REPO / folder).parts) if init.parent != REPO / folder else top
             for top, folder in mapped.items() for init in (REPO / folder).rglob("__init__.py")
             if "__pycache__" not in init.parts and "user_project" not in init.parts}
    assert found - listed == set(), f"not in setup.cfg's packages: {sorted(found - listed)}"
