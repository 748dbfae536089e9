"""The repo's `datasets/` shares its name with Hugging Face `datasets`: Stride must import its own."""

import subprocess

from conftest import PYTHON, REPO


def test_datasets_resolves_to_repo():
    import stride.datasets

    assert getattr(datasets, "STRIDE_DATASETS", False)
    assert REPO / "datasets" / "__init__.py" == __import__("pathlib").Path(datasets.__file__).resolve()


def test_main_runs_as_a_script_without_stride_installed():
    # `ray job submit --working-dir .` runs `python trainers/main.py` on nodes where Stride is not installed:
    # the script must put the repo root on the path itself. Drop every other route to the repo first.
    code = f"""
import runpy, sys
sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]
sys.path = [p for p in sys.path if p not in ('', {str(REPO)!r}) and 'editable' not in p]
sys.argv = ['trainers/main.py', '--config', 'trainers/configs/char_gpt.yaml', '--print-config']
try:
    runpy.run_path('trainers/main.py', run_name='__main__')
except SystemExit as e:
    assert e.code in (0, None), e.code
import trainers, datasets
print('FOUND', trainers.__file__, datasets.__file__)
"""
    r = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"FOUND {REPO}/trainers/__init__.py {REPO}/datasets/__init__.py" in r.stdout
    assert "model:" in r.stdout  # the resolved config was printed
