"""`ray job submit` to a head from ray_cluster.local (the session's shared head, tests/shared_ray.py): refused without
the token or with a wrong one; what a checkout uploads. A job that runs with the token (its logs, the uploaded
project folder) is tests/test_user_task.py::test_ray_job_submit_of_the_project_folder."""

from __future__ import annotations

import pytest

from cluster_fixtures import RAY, REPO, clean_env, run


@pytest.fixture(scope="module")
def head(shared_ray_head):
    return shared_ray_head.head


def submit_env(head):
    return clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head.token_path))


def test_the_checkouts_rayignore_keeps_data_runs_and_the_venv_out_of_an_uploaded_working_dir(tmp_path):
    """`ray job submit --working-dir .` from a Stride checkout uploads the code, not data/, runs/, .venv/ or .git/:
    Ray's own packaging function (what the CLI zips) over a folder holding the checkout's .rayignore. Only .rayignore
    decides here: no .gitignore and none of Ray's default excludes. A submitted job's run, its logs and its upload
    of a project folder are test_user_task.py::test_ray_job_submit_of_the_project_folder."""
    from zipfile import ZipFile

    from ray._private.runtime_env.packaging import create_package

    folder = tmp_path / "checkout"
    for name in ("trainers/main.py", "data/tabular/train/part-0.parquet", "runs/r/summary.json", ".venv/bin/python",
                 ".git/HEAD", "stride.egg-info/PKG-INFO", "trainers/__pycache__/main.cpython-311.pyc"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    (folder / ".rayignore").write_text((REPO / ".rayignore").read_text())
    create_package(str(folder), tmp_path / "package.zip", include_gitignore=False, excludes=[])
    uploaded = set(ZipFile(tmp_path / "package.zip").namelist())
    assert "trainers/main.py" in uploaded, uploaded
    for excluded in ("data/", "runs/", ".venv/", ".git/", "stride.egg-info/", "trainers/__pycache__/"):
        assert not any(n.startswith(excluded) for n in uploaded), f"{excluded} would be uploaded with the job"


@pytest.mark.slow
def test_submission_without_the_token_is_refused(head):
    result = run([RAY, "job", "submit", "--address", head.dashboard_url, "--", "echo", "should-not-run"],
                 env=clean_env(HOME=str(head.temp_dir)), timeout=120)  # HOME: no ~/.ray/auth_token to fall back on
    assert result.returncode != 0
    assert "Authentication required" in result.stdout + result.stderr


@pytest.mark.slow
def test_submission_with_a_wrong_token_is_refused(head, tmp_path):
    wrong = tmp_path / "token"
    wrong.write_text("not-the-clusters-token")
    wrong.chmod(0o600)
    result = run([RAY, "job", "submit", "--address", head.dashboard_url, "--", "echo", "should-not-run"],
                 env=clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(wrong)), timeout=120)
    assert result.returncode != 0
    assert "Invalid authentication token" in result.stdout + result.stderr
    listed = run([RAY, "job", "list", "--address", head.dashboard_url], env=submit_env(head), timeout=60)
    assert "should-not-run" not in listed.stdout
