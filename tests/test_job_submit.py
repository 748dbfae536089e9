"""`ray job submit` to a head from ray_cluster.local (the session's shared head, tests/shared_ray.py): refused without
the token or with a wrong one; what a checkout uploads; the README's job command, from the README's own project
folder, uploads neither data nor runs and passes every check a job's driver makes; an init.from inside the job's
copy of the working dir is refused. A job that runs with the token (its logs, the uploaded project folder) is
tests/test_user_task.py::test_ray_job_submit_of_the_project_folder."""

from __future__ import annotations

import json
import re
import shlex
import sys
from zipfile import ZipFile

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


def readme_block(language: str, first_line: str) -> str:
    """The README's code block in `language` that starts with `first_line`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return next(b for b in blocks if b.startswith(first_line))


def readme_job_command(config: str) -> list[str]:
    """The README's `ray job submit` command that trains `config`, as words (continuation lines joined)."""
    lines = [ln for b in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
             for ln in b.replace("\\\n", " ").splitlines()]
    return shlex.split(next(ln for ln in lines if "ray job submit" in ln and f"--config {config}" in ln),
                       comments=True)


def in_a_job(monkeypatch, copy) -> None:
    """This process as a job's driver sees itself: in Ray's copy of the uploaded working dir, with Ray's job config."""
    monkeypatch.chdir(copy)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_1.zip"}}))


def test_the_readmes_job_command_uploads_no_data_or_runs_and_passes_the_jobs_checks(tmp_path, monkeypatch):
    """The README's job command, run as written from the README's project folder (my_task.py, my.yaml, data/):
    what Ray uploads (its own packaging function with the command's runtime env) holds the code and the YAML but not
    data/ or runs/, and the job's driver, in its copy of that upload, loads the config, reads the data and opens the
    run folder in the user's folder. Without the command's absolute run.storage_path it would be refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray._private.runtime_env.packaging import create_package
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args

    from stride.errors import UsageError
    from stride.trainers.launch import lifecycle
    from stride.trainers.config_reader import load_config
    from stride.trainers.launch.checks import prepare

    project = tmp_path / "my_project"
    project.mkdir()
    (project / "my_task.py").write_text(readme_block("python", "# my_task.py"))
    (project / "my.yaml").write_text(readme_block("yaml", "# my.yaml"))
    for split, rows in (("train", 512), ("val", 128)):
        (project / "data" / split).mkdir(parents=True)
        x = [i / rows for i in range(rows)]
        pq.write_table(pa.table({"x": x, "y": [2 * v for v in x]}), project / "data" / split / "part-0.parquet")
    (project / "runs" / "earlier").mkdir(parents=True)
    (project / "runs" / "earlier" / "summary.json").write_text("{}")

    words = readme_job_command("my.yaml")
    words = [w.replace("$PWD", str(project)) for w in words]  # what the user's shell does
    ray_args, entrypoint = words[:words.index("--")], words[words.index("--") + 1:]
    option = lambda name: ray_args[ray_args.index(name) + 1] if name in ray_args else None  # noqa: E731
    runtime_env = parse_runtime_env_args(runtime_env_json=option("--runtime-env-json"),
                                         working_dir=option("--working-dir"))
    assert runtime_env["working_dir"] == "."
    create_package(str(project), tmp_path / "package.zip", include_gitignore=True,
                   excludes=runtime_env.get("excludes", []))
    uploaded = set(ZipFile(tmp_path / "package.zip").namelist())
    assert {"my_task.py", "my.yaml"} <= uploaded, uploaded
    assert not any(n.startswith(("data/", "runs/")) for n in uploaded), uploaded

    copy = tmp_path / "ray" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    ZipFile(tmp_path / "package.zip").extractall(copy)
    in_a_job(monkeypatch, copy)
    assert entrypoint[:5] == ["python", "-m", "stride", "--config", "my.yaml"], entrypoint
    with pytest.raises(UsageError, match=r"^run\.storage_path \(\./runs\) is relative in a Ray job"):
        lifecycle.check_storage(load_config("my.yaml"))  # the command's overrides are what makes it work
    cfg = load_config("my.yaml", entrypoint[5:])
    try:
        task, specs = prepare(cfg)  # the task from the job's copy, the data where it is
    finally:
        sys.modules.pop("my_task", None)
    assert specs["train"].num_rows == 512 and specs["val"].num_rows == 128
    with lifecycle.open_run(cfg, task, "test"):
        pass
    assert cfg.run_dir == project / "runs" / "my_regression" and cfg.run_dir.is_dir()


def test_an_init_from_in_the_jobs_copy_of_the_working_dir_is_refused(tmp_path, monkeypatch):
    """A relative init.from in a job resolves into Ray's temporary copy of the upload: the run would record a path
    deleted with the job (and a trainable_only run read its base from there again). Refused in one line naming
    init.from; an absolute path elsewhere or a URI is the fix, and outside a job the same relative path is fine."""
    from stride.errors import UsageError
    from stride.trainers.launch import lifecycle
    from stride.trainers.config_reader import load_config

    copy = tmp_path / "working_dir_files" / "_ray_pkg_1"
    copy.mkdir(parents=True)
    storage = f"run.storage_path={tmp_path / 'runs'}"
    monkeypatch.chdir(copy)
    lifecycle.check_job_storage(load_config(None, [storage, "init.from=base.safetensors"]))  # not in a job
    in_a_job(monkeypatch, copy)
    with pytest.raises(UsageError) as e:
        lifecycle.check_job_storage(load_config(None, [storage, "init.from=base.safetensors"]))
    assert str(e.value) == (f"init.from ({copy / 'base.safetensors'}) is in the job's temporary copy of --working-dir, "
                            f"which is deleted with the job, so the run would record (and a trainable_only run read "
                            f"again) a path that is gone; set init.from=<an absolute path on shared storage, or a URI "
                            f"such as s3://bucket/model>")
    for source in (tmp_path / "shared" / "base.safetensors", "s3://bucket/base.safetensors"):
        lifecycle.check_job_storage(load_config(None, [storage, f"init.from={source}"]))


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
