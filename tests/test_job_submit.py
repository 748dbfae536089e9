"""`ray job submit` of a Stride job to a head from ray_cluster.local (the session's shared head,
tests/shared_ray.py): runs with the token, refused without."""

from __future__ import annotations

import json

import pytest

from cluster_fixtures import RAY, REPO, TINY_JOB, clean_env, cluster_tabular_data, run  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def head(shared_ray_head):
    return shared_ray_head.head


def submit_env(head, **extra):
    # Only .rayignore decides what is uploaded here (not .gitignore, not Ray's own default excludes).
    return clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head.token_path),
                     RAY_RUNTIME_ENV_IGNORE_GITIGNORE="1", RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES="", **extra)


def test_job_with_the_token_succeeds_and_logs_stride_progress(head, cluster_tabular_data, tmp_path, ray_cluster):  # noqa: F811
    data = cluster_tabular_data
    result = run([RAY, "job", "submit", "--address", head.dashboard_url, "--working-dir", str(REPO),
                  "--submission-id", "stride-tiny", "--",
                  "python", "trainers/main.py", "--config", "trainers/configs/tabular_mlp.yaml",
                  f"data.train_path={data / 'train'}", f"data.val_path={data / 'val'}", *TINY_JOB,
                  f"run.storage_path={tmp_path / 'runs'}"], env=submit_env(head), timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Job 'stride-tiny' succeeded" in output, output[-4000:]

    logs = run([RAY, "job", "logs", "stride-tiny", "--address", head.dashboard_url], env=submit_env(head), timeout=60)
    assert logs.returncode == 0, logs.stderr[-2000:]
    assert "[stride rank 0]" in logs.stdout and "step 20/20" in logs.stdout, logs.stdout[-3000:]
    assert "Found multiple active Ray instances" not in logs.stdout  # the head's processes know their cluster
    summary = json.loads((tmp_path / "runs" / "tabular_mlp" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 20

    # The uploaded working dir, unpacked on the head: the code without data/, runs/ or .venv/.
    (package,) = [p for p in (head.temp_dir / "ray" / "session_latest" / "runtime_resources" / "working_dir_files").iterdir()
                  if (p / "trainers" / "main.py").exists()]
    assert (package / "trainers" / "main.py").exists()
    for excluded in ("data", "runs", ".venv", ".git"):
        assert not (package / excluded).exists(), f"{excluded}/ was uploaded with the job"


def test_submission_without_the_token_is_refused(head):
    result = run([RAY, "job", "submit", "--address", head.dashboard_url, "--", "echo", "should-not-run"],
                 env=clean_env(HOME=str(head.temp_dir)), timeout=120)  # HOME: no ~/.ray/auth_token to fall back on
    assert result.returncode != 0
    assert "Authentication required" in result.stdout + result.stderr


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
