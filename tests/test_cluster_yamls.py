"""Every cluster config in the repo passes Ray's own checks and starts Ray the safe way; the KubeRay job names
the same entrypoint and Ray version as the rest of the project."""

from __future__ import annotations

import configparser
import copy
import json
import os
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster_fixtures import REPO
from stride.ray_cluster import updown

RAY_UP_CONFIGS = sorted({REPO / "cluster.yaml", *(p for p in (REPO / "ray_cluster").glob("*.yaml")
                                                   if "kuberay" not in p.name)})
KUBERAY = REPO / "ray_cluster" / "kuberay-rayjob.yaml"
DEFAULT_JOB = "python trainers/main.py --config trainers/configs/char_gpt.yaml"
# Where each cluster file sends runs, and the setup.cfg extras its nodes install for that (issue 44).
RUNS_BUCKET = {"aws.yaml": ("s3", ["s3"]), "gcp.yaml": ("gs", ["gcs"]), "kuberay-rayjob.yaml": ("s3", ["s3", "gcs"])}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def install_requires() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return [line.strip() for line in cfg["options"]["install_requires"].splitlines() if line.strip()]


def extra_requires(extra: str) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return [line.strip() for line in cfg["options.extras_require"][extra].splitlines()
            if line.strip() and not line.strip().startswith("#")]


def ray_version() -> str:
    (ray_req,) = [r for r in install_requires() if r.startswith("ray[")]
    return ray_req.split("==")[1]


def torch_version() -> str:
    return re.search(r"^TORCH_VERSION \?= (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)


def test_the_repo_has_the_cluster_configs():
    names = {p.relative_to(REPO).as_posix() for p in RAY_UP_CONFIGS}
    assert {"cluster.yaml", "ray_cluster/aws.yaml", "ray_cluster/gcp.yaml"} <= names
    assert KUBERAY.exists()


@pytest.mark.parametrize("path", RAY_UP_CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_config_passes_rays_schema_as_ray_up_checks_it(path):
    raw = load(path)
    with open(Path(ray.autoscaler.__file__).parent / "ray-schema.json") as f:
        jsonschema.validate(raw, json.load(f))  # catches top-level typos before defaults hide them
    validate_config(prepare_config(copy.deepcopy(raw)))  # what `ray up` runs before touching any node


@pytest.mark.parametrize("path", RAY_UP_CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_node_installs_stride_deps_pinned_like_setup_cfg(path):
    prepared = prepare_config(copy.deepcopy(load(path)))
    wanted = [r for r in install_requires() if not r.startswith("torch")]
    for kind in ("head_setup_commands", "worker_setup_commands"):
        commands = prepared[kind]
        torch_at = [i for i, c in enumerate(commands) if f"torch=={torch_version()}" in c]
        ray_at = [i for i, c in enumerate(commands) if "ray[train,tune,data,default]" in c]
        assert torch_at and ray_at and torch_at[0] < ray_at[0], f"{kind}: torch=={torch_version()} must come first"
        words = shlex.split(commands[ray_at[0]])
        for requirement in wanted:
            assert requirement in words, f"{kind} does not install {requirement} (setup.cfg)"


@pytest.mark.parametrize("path", RAY_UP_CONFIGS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_nodes_start_ray_with_token_auth_and_never_run_ray_stop(path):
    config = load(path)
    stop = "python3 ~/stride_ray/node.py stop /tmp/stride-cluster"
    for kind in ("head_start_ray_commands", "worker_start_ray_commands"):
        commands = config[kind]
        assert commands[0] == stop, kind
        start = " ".join(commands[1:])
        assert "RAY_AUTH_MODE=token" in start and 'RAY_AUTH_TOKEN_PATH="$HOME/stride_ray/auth_token"' in start
        assert "node.py start /tmp/stride-cluster -- ray start" in start
        assert "--temp-dir=/tmp/stride-cluster/ray" in start
    assert "--dashboard-host 127.0.0.1" in " ".join(config["head_start_ray_commands"])
    assert "--ray-client-server-port=" in " ".join(config["head_start_ray_commands"])
    every_command = [c for key, value in config.items() if key.endswith("_commands") for c in value]
    assert not [c for c in every_command if re.search(r"(^|[;&|]\s*)ray (stop|down)\b", c)], "a bare ray stop/down"
    mounts = config["file_mounts"]
    assert (REPO / mounts["~/stride_ray/node.py"]).resolve() == REPO / "ray_cluster" / "node.py"
    assert mounts["~/stride_ray/auth_token"].startswith("~/.stride/tokens/")
    assert updown.stop_commands(config) == (stop, stop)  # what `updown down` runs on each node


def test_on_premise_config_marks_the_fields_to_edit():
    text = (REPO / "cluster.yaml").read_text()
    config = load(REPO / "cluster.yaml")
    assert config["provider"]["type"] == "local"
    assert config["provider"]["worker_ips"] == []  # present even when empty: ray up needs it
    for field in ("head_ip:", "worker_ips:", "ssh_user:", "ssh_private_key:"):
        (line,) = [ln for ln in text.splitlines() if ln.strip().startswith(field)]
        assert "# EDIT" in line, line
    assert text.index("ssh_private_key:") < text.index("file_mounts:")  # at the top, before the machinery


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_cloud_configs_have_a_cpu_head_and_autoscaling_gpu_workers(name):
    config = prepare_config(copy.deepcopy(load(REPO / "ray_cluster" / name)))
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    (worker,) = [t for key, t in types.items() if key != config["head_node_type"]]
    assert not head["resources"].get("GPU")
    assert worker["max_workers"] > worker["min_workers"] >= 1
    node_config = json.dumps(worker["node_config"])
    if name == "gcp.yaml":
        assert worker["resources"]["GPU"] >= 1 and "TERMINATE" in node_config
    else:
        assert re.search(r'"InstanceType": "(g|p)\d', node_config)


def test_safe_down_refuses_cloud_configs_and_names_ray_down():
    with pytest.raises(updown.UpDownError, match="ray down"):
        updown.down(str(REPO / "ray_cluster" / "aws.yaml"))


def test_up_makes_a_private_token_file_and_refuses_a_readable_one(tmp_path):
    token = tmp_path / "tokens" / "stride"
    config = {"file_mounts": {updown.TOKEN_MOUNT: str(token)}}
    assert updown.ensure_token(config) == token
    assert oct(token.stat().st_mode & 0o777) == "0o600" and len(token.read_text()) >= 32
    first = token.read_text()
    assert updown.ensure_token(config) == token and token.read_text() == first  # kept: nodes already have it
    os.chmod(token, 0o644)
    with pytest.raises(updown.UpDownError, match="chmod 600"):
        updown.ensure_token(config)


def test_kuberay_job_runs_the_default_entrypoint_on_the_projects_ray():
    job = load(KUBERAY)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["entrypoint"].startswith(DEFAULT_JOB + " ")  # and settings for the cluster (runs: a bucket)
    assert (REPO / "trainers/configs/char_gpt.yaml").exists()
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray_version() == "2.60.0"
    assert cluster["authOptions"]["mode"] == "token"
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = [c["image"] for g in groups for c in g["template"]["spec"]["containers"]]
    assert images and all(re.fullmatch(rf"rayproject/ray:{re.escape(ray_version())}(-py311)?(-gpu)?", i) for i in images)
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert f"torch=={torch_version()}" in runtime_env["pip"]
    assert runtime_env["env_vars"]["STRIDE_SHARED_FS"] == "1"


def test_rayignore_keeps_data_runs_and_venv_out_of_job_uploads():
    patterns = (REPO / ".rayignore").read_text().split()
    assert {"data/", "runs/", ".venv/", ".git/"} <= set(patterns)


def runs_uris(name: str) -> list[str]:
    """The run.storage_path of the job each file runs: KubeRay's entrypoint; the `ray job submit` command in the
    header comment of a `ray up` config (those files have no other place for a job's settings)."""
    if name == "kuberay-rayjob.yaml":
        words = shlex.split(load(KUBERAY)["spec"]["entrypoint"])
        assert " ".join(words[:4]) == DEFAULT_JOB
        return [w.split("=", 1)[1] for w in words[4:] if w.startswith("run.storage_path=")]
    text = (REPO / "ray_cluster" / name).read_text()
    return re.findall(rf"-- {re.escape(DEFAULT_JOB)} \\\n#\s+(?:\S+=\S+ )*\\?\n?#?\s*run\.storage_path=(\S+)\n", text)


@pytest.mark.parametrize("name", sorted(RUNS_BUCKET))
def test_runs_go_to_a_bucket_the_nodes_can_reach(name):
    scheme, extras = RUNS_BUCKET[name]
    text = (REPO / "ray_cluster" / name).read_text()
    (uri,) = runs_uris(name)
    assert re.fullmatch(rf"{scheme}://YOUR-BUCKET/[a-z0-9-]+", uri), uri  # a placeholder that names no real bucket
    # every mention of run.storage_path names that bucket (no shared or mounted folder left over)
    assert set(re.findall(r"run\.storage_path[=:]\s*(\S+)", text)) == {uri}
    # the nodes install the extras that reach it, pinned like setup.cfg
    wanted = [r for extra in extras for r in extra_requires(extra)]
    assert wanted
    if name == "kuberay-rayjob.yaml":
        pip = yaml.safe_load(load(KUBERAY)["spec"]["runtimeEnvYAML"])["pip"]
        assert set(wanted) <= set(pip)
    else:
        prepared = prepare_config(copy.deepcopy(load(REPO / "ray_cluster" / name)))
        for kind in ("head_setup_commands", "worker_setup_commands"):
            (ray_line,) = [c for c in prepared[kind] if "ray[train,tune,data,default]" in c]
            assert set(wanted) <= set(shlex.split(ray_line)), kind
    # and the file names the identity the nodes need for it, where it goes
    identity = {"aws.yaml": ["IamInstanceProfile", "s3:PutObject", "s3:ListBucket", "iam:PassRole"],
                "gcp.yaml": ["serviceAccounts:", "roles/storage.objectAdmin"],
                "kuberay-rayjob.yaml": ["serviceAccountName: stride-runs", "eks.amazonaws.com/role-arn",
                                        "roles/storage.objectAdmin", "workloadIdentityPools"]}[name]
    assert all(word in text for word in identity), identity


def job_overrides(name: str) -> list[str]:
    """The settings each file's job passes after the default command (KubeRay's entrypoint; the header's command)."""
    if name == "kuberay-rayjob.yaml":
        return shlex.split(load(KUBERAY)["spec"]["entrypoint"])[4:]
    text = (REPO / "ray_cluster" / name).read_text()
    start = text.index(f"-- {DEFAULT_JOB}") + len(f"-- {DEFAULT_JOB}")
    lines = []
    for line in text[start:].splitlines()[1:]:
        lines.append(line.lstrip("#").strip().rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(lines).split()


@pytest.mark.parametrize("name", sorted(RUNS_BUCKET))
def test_each_files_job_passes_strides_checks_on_a_bucket(name):
    """The job as written gets past the config and the trackers' checks (a bucket cannot hold MLflow's default store:
    the job must say where MLflow is, or turn it off), and keeps its data off local paths unless the file shares a
    filesystem."""
    from stride.trainers import sinks
    from stride.trainers.config_reader import load_config

    # The placeholder is upper case so that it names no real bucket, and so Stride refuses it until it is edited.
    edited = [o.replace("YOUR-BUCKET", "my-bucket") for o in job_overrides(name)]
    cfg = load_config(str(REPO / "trainers/configs/char_gpt.yaml"), edited)
    sinks.preflight(cfg)
    shared = "STRIDE_SHARED_FS" in (REPO / "ray_cluster" / name).read_text()
    assert shared or all("://" in p for p in (cfg.data.train_path, cfg.data.val_path)), name
