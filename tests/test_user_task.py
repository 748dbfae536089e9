"""A user's own task, in a project folder outside Stride's packages (tests/user_project: signal_task.py, a 1-D CNN
over a fixed-length float signal; make_data.py; signal.yaml), through every way Stride runs it: 2 Ray workers
(`python -m stride`, MLflow) on the session's shared head, torchrun DDP and FSDP, bf16/fp16 on CPU, gradient
accumulation, one run stopped four ways (SIGTERM, Ctrl-C, a SIGKILLed driver, a killed worker) that each time resumes
exactly, a 2-rank checkpoint resumed by 1 process (torchrun), and `ray job submit` of the folder to a token-auth head. A Tune
sweep over the task's own field is tests/test_tune.py's killed-and-resumed sweep; SLURM's stride.sbatch from the
project folder is in tests/test_slurm.py.

Each test copies the project into a temporary folder and runs from there (the task module is found in the working
directory, as a user's is); nothing is written into the repository. The module itself asserts that `import
datasets` is Hugging Face's in every process that imports it: Stride must never shadow it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from cluster_fixtures import RAY, clean_env
from conftest import (PYTHON, REPO, descendants, kill_pids, read_jsonl, run_cli, run_cli_forked, run_torchrun_cases,
                      torchrun_case, torchrun_launcher, wait_for_step)
from runs import OVERLAY
from runs import losses as train_losses

PROJECT = Path(__file__).resolve().parent / "user_project"
TASK = "signal_task:SignalTask"
TORCHRUN_PY = str(REPO / "trainers" / "torchrun.py")
FACTS = {"num_classes": 4, "signal_length": 64}
# The model of signal.yaml (channels 16, depth 3, 4 classes): stem 16*7+16, 3 blocks of 16*16*3+16, head 16*4+4.
PARAM_BYTES = (16 * 7 + 16 + 3 * (16 * 16 * 3 + 16) + 16 * 4 + 4) * 4

# The shared 2-worker Ray run, also the uninterrupted reference of the run stopped four ways: about twenty seconds
# of training (10 ms steps), so that each stop lands, and each periodic checkpoint's background write completes,
# long before the end even on a loaded machine (300 steps once ended 1.5 s after step 110).
RAY_STEPS = 1000
# The run cut after 10 steps on 2 workers and resumed on 1 (test_two_worker_checkpoint_resumes_on_one_worker_...).
ELASTIC = ["checkpoint.every_steps=10", "train.log_every_steps=2", "train.eval_every_steps=100"]
RAY_ARGS = [f"train.max_steps={RAY_STEPS}", "train.batch_size_per_worker=128", "checkpoint.every_steps=100",
            "train.log_every_steps=10", "train.eval_every_steps=100", "optim.schedule=signal_task:half_by_the_end"]


# ---- helpers ------------------------------------------------------------------------------------------------

def copy_project(dst: Path) -> Path:
    """The user's folder, as a user has it: the three files, then `python make_data.py` run there."""
    shutil.copytree(PROJECT, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "runs", "data"))
    r = subprocess.run([PYTHON, "make_data.py"], cwd=dst, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return dst


def stride(project: Path, *overrides: str, env: dict | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    """`python -m stride --config signal.yaml ...` from the user's folder (on the Ray cluster env names; without
    RAY_ADDRESS, an embedded local Ray)."""
    return run_cli(["-m", "stride", "--config", "signal.yaml", *overrides], cwd=project, env=env, timeout=timeout)


def print_config(project: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m stride --config signal.yaml --print-config ...` from the user's folder, in a forked child: it
    resolves the config and exits, no Ray."""
    return run_cli_forked(["-m", "stride", "--config", "signal.yaml", "--print-config", *overrides], cwd=project,
                          timeout=120)


def start_stride(project: Path, *overrides: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "stride", "--config", "signal.yaml", *overrides], cwd=project,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def torchrun(project: Path, nproc: int, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """trainers/torchrun.py from the user's folder: under torch.distributed.run with nproc > 1, else one process
    (no launcher, no process group) forked from the fork server."""
    if nproc > 1:
        r = subprocess.run([*torchrun_launcher(nproc), TORCHRUN_PY, "--config", "signal.yaml", *overrides],
                           cwd=project, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), capture_output=True,
                           text=True, timeout=400)
    else:
        r = run_cli_forked([TORCHRUN_PY, "--config", "signal.yaml", *overrides], cwd=project, env=env, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def evals(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r]


def assert_reports_accuracy(run_dir: Path, s: dict) -> None:
    """The task's own metric: val_accuracy in every evaluation line of metrics.jsonl and in summary.json."""
    lines = evals(run_dir)
    assert lines and all("val_accuracy" in r and 0.0 <= r["val_accuracy"] <= 1.0 for r in lines), lines
    assert s["val_accuracy"] == lines[-1]["val_accuracy"] and s["global_step"] == lines[-1]["step"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return copy_project(tmp_path_factory.mktemp("user") / "signal_project")


# ---- fast: the project's own files, config resolution (no Ray, no training) --------------------------------

def test_make_data_writes_signal_rows_with_unique_ids(project):
    import pyarrow as pa
    import pyarrow.parquet as pq

    train, val = (pq.read_table(project / "data" / split) for split in ("train", "val"))
    assert train.num_rows == 2048 and val.num_rows == 512
    t = train.schema.field("signal").type
    assert pa.types.is_fixed_size_list(t) and t.list_size == 64 and t.value_type == pa.float32()
    assert train.schema.field("sample_id").type == "int64" and train.schema.field("target").type == "int64"
    ids = train.column("sample_id").to_pylist() + val.column("sample_id").to_pylist()
    assert len(set(ids)) == len(ids)
    assert set(train.column("target").to_pylist()) == {0, 1, 2, 3}


def test_config_takes_the_tasks_fields_and_refuses_unknown_ones(project):
    r = print_config(project, "model.channels=8")
    assert r.returncode == 0, r.stderr[-2000:]
    model = yaml.safe_load(r.stdout)["model"]
    assert model == {"name": TASK, "channels": 8, "depth": 3, "dropout": 0.0, "max_shift": 8, "notes_path": None}
    r = print_config(project, "model.chanels=8")
    assert r.returncode == 2
    assert f"unknown key 'model.chanels' for model.name {TASK}" in r.stderr and "channels" in r.stderr, r.stderr
    r = print_config(project, "model.channels=1")  # the task's own pydantic bound
    assert r.returncode == 2 and "model.channels" in r.stderr, r.stderr


# ---- 1. two Ray workers, MLflow ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_run(project, shared_ray_head):
    (project / "notes.txt").write_text("a file the task reads, named relative to the project folder")
    # model.notes_path is relative to where the user runs Stride (the project); Ray's workers run in another folder.
    r = stride(project, "run.name=ray2", "model.notes_path=notes.txt", *RAY_ARGS, env=shared_ray_head.env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not shared_ray_head.wait_idle()
    return {"dir": project / "runs" / "ray2", "stdout": r.stdout, "project": project}


@pytest.mark.slow
def test_two_ray_workers_train_the_users_task(ray_run):
    run, s = ray_run["dir"], summary(ray_run["dir"])
    assert s["status"] == "completed" and s["global_step"] == RAY_STEPS and s["world_size"] == 2
    assert s["strategy"] == "ddp" and s["task"] == TASK and s["facts"] == FACTS and s["restarts"] == 0
    assert s["config"]["model"]["channels"] == 16
    assert s["config"]["model"]["notes_path"] == str(ray_run["project"] / "notes.txt")  # resolved on the driver
    losses = train_losses(run)
    assert sorted(losses) == list(range(10, RAY_STEPS + 1, 10))
    assert losses[RAY_STEPS] < 0.5 * losses[10]  # the loss falls
    assert s["val_loss"] < 0.5 * s["initial_val_loss"]
    assert_reports_accuracy(run, s)
    assert s["val_accuracy"] > 0.9  # 4 classes: chance is 0.25
    assert f"val_accuracy {s['val_accuracy']:.4f}" in ray_run["stdout"]  # the driver's final line names it
    assert s["param_checksums"][0] == s["param_checksums"][1]  # DDP replicas hold identical weights
    assert s["param_bytes_per_worker"] == [PARAM_BYTES, PARAM_BYTES]
    # optim.schedule from the project's own module, on every worker: lr 3e-3 x its multiplier at each logged step.
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run / "metrics.jsonl") if "lr" in r}
    assert lrs and all(lr == pytest.approx(3e-3 * (1 - 0.5 * step / RAY_STEPS)) for step, lr in lrs.items()), lrs


@pytest.mark.slow
def test_mlflow_run_records_the_tasks_fields_and_metric(ray_run, project):
    from mlflow.tracking import MlflowClient

    s = summary(ray_run["dir"])
    client = MlflowClient(f"sqlite:///{project / 'runs' / 'mlflow.db'}")  # tracking.mlflow_uri null: the default
    run = client.get_run(s["mlflow_run_id"])
    params = run.data.params
    assert params["model.name"] == TASK and params["model.channels"] == "16" and params["model.depth"] == "3"
    assert params["model.max_shift"] == "8"
    assert run.data.metrics["val_accuracy"] == pytest.approx(s["val_accuracy"])
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "ray2"


# ---- 2, 5. torchrun, 2 processes: DDP and FSDP ----------------------------------------------------------------

@pytest.fixture(scope="module")
def torchrun_runs(project, tmp_path_factory):
    """The user's task under ONE torchrun launch of 2 ranks (tests/torchrun_cases.py), each case a run of its own:
    DDP, FSDP, DDP with activation checkpointing, compiled with activation checkpointing, bf16, fp16, and the first
    10 steps of the run that resumes on one worker (with the sample log). A test
    reads its run with case_run(), which fails that test alone if its case failed."""
    storage = tmp_path_factory.mktemp("torchrun")
    common = ["--config", "signal.yaml", f"run.storage_path={storage}", *OVERLAY, "train.log_every_steps=1"]
    short = ["train.max_steps=10", "train.eval_every_steps=10"]
    cases = {"ddp": [], "fsdp": ["train.strategy=fsdp"], "ddp_ac": ["train.activation_checkpointing=true"],
             "compiled": ["train.compile=model", "train.activation_checkpointing=true"],
             "bf16": ["train.precision=bf16", *short], "fp16": ["train.precision=fp16", *short],
             "elastic": [*ELASTIC, "train.batch_size_per_worker=64", "train.max_steps=10"]}
    env = {"elastic": {"STRIDE_SAMPLE_LOG": str(storage / "samples")}}
    r, ranks = run_torchrun_cases([{"label": name, "args": [*common, f"run.name={name}", *extra], "env": env.get(name, {})}
                                   for name, extra in cases.items()], tmp_path_factory.mktemp("torchrun_cases"), project)
    return {"dir": storage, "launch": r, "ranks": ranks}


def case_run(torchrun_runs: dict, label: str) -> tuple[Path, str]:
    """The run folder of one case of the batch, once both ranks ran it to exit 0; and rank 0's output of it."""
    return torchrun_runs["dir"] / label, torchrun_case(torchrun_runs, label)


@pytest.mark.slow
def test_torchrun_ddp_reports_the_tasks_metric(torchrun_runs):
    run, _ = case_run(torchrun_runs, "ddp")
    s = summary(run)
    assert s["status"] == "completed" and s["global_step"] == 40 and s["world_size"] == 2
    assert s["strategy"] == "ddp" and s["runtime"] == "torchrun" and s["task"] == TASK and s["facts"] == FACTS
    assert_reports_accuracy(run, s)
    assert [r["step"] for r in evals(run)] == [20, 40]
    assert s["val_loss"] < s["initial_val_loss"] - 0.3 and s["val_accuracy"] > 0.5
    assert s["param_checksums"][0] == s["param_checksums"][1]
    # tracking.mlflow=false: no MLflow run, no store created
    assert s["mlflow_run_id"] is None and not (torchrun_runs["dir"] / "mlflow.db").exists()


@pytest.mark.slow
def test_fsdp_shards_the_users_blocks(torchrun_runs):
    (run, _), (ddp_run, _) = case_run(torchrun_runs, "fsdp"), case_run(torchrun_runs, "ddp")
    s, ddp = summary(run), summary(ddp_run)
    assert s["status"] == "completed" and s["strategy"] == "fsdp" and s["world_size"] == 2 and s["global_step"] == 40
    assert s["val_loss"] < s["initial_val_loss"] - 0.3
    assert_reports_accuracy(run, s)
    assert ddp["param_bytes_per_worker"] == [PARAM_BYTES, PARAM_BYTES]
    sharded = s["param_bytes_per_worker"]
    assert sum(sharded) == PARAM_BYTES and all(abs(b - PARAM_BYTES / 2) <= 0.02 * PARAM_BYTES for b in sharded), sharded
    assert s["param_checksums"][0] == s["param_checksums"][1]  # both ranks sum the same full parameters
    # Same data, seed and init: the strategies differ only by the order of float reductions.
    a, b = train_losses(ddp_run), train_losses(run)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), step


@pytest.mark.slow
def test_export_of_the_users_fsdp_checkpoint_loads_into_the_users_model(torchrun_runs, project, tmp_path):
    """trainers/commands/export.py on the user's 2-rank FSDP run: one safetensors file that the user's own model (built by
    their task) loads with load_state_dict, equal to the run's final weights."""
    (run, _), out = case_run(torchrun_runs, "fsdp"), tmp_path / "signal.safetensors"
    r = run_cli_forked(["-m", "stride", "export", str(run), str(out)], cwd=project)
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary(run)
    # In the user's folder, as their own code would: the task builds the model, which loads the file.
    probe = subprocess.run([PYTHON, "-c", "import json; from safetensors.torch import load_file; "
                            "from stride.trainers.config_reader import from_dict; from stride.trainers.tasks import make_task; "
                            f"s = json.load(open({str(run / 'summary.json')!r})); "
                            "model = make_task(from_dict(s['config']), s['facts']).build_model(); "
                            f"model.load_state_dict(load_file({str(out)!r})); "
                            "print(float(sum(p.detach().double().sum() for p in model.parameters())))"],
                           cwd=project, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert float(probe.stdout.strip().splitlines()[-1]) == pytest.approx(s["param_checksums"][0], rel=1e-12)


@pytest.mark.slow
def test_activation_checkpointing_of_the_users_blocks_under_ddp_is_bitwise_neutral(torchrun_runs, project):
    """The user's task names no blocks: Stride finds its repeated conv blocks (Task.blocks' default) and recomputes
    their activations; DDP's losses are bitwise the run's that kept them."""
    (ac_run, _), (ddp_run, _) = case_run(torchrun_runs, "ddp_ac"), case_run(torchrun_runs, "ddp")
    s = summary(ac_run)
    assert s["status"] == "completed" and s["strategy"] == "ddp"
    # The switch reached the model: the run checkpointed all 3 blocks, the one it is compared with none (else the
    # equality below would compare one way of computing the gradients with itself).
    assert s["activation_checkpointed_blocks"] == 3
    assert summary(ddp_run)["activation_checkpointed_blocks"] == 0
    assert train_losses(ac_run) == train_losses(ddp_run)
    assert s["param_checksums"] == summary(ddp_run)["param_checksums"]
    # And checkpointing those blocks recomputes them: the user's model, built by their task from the run's config
    # (in their folder, as the run did), with the loop's checkpoint_activations on Task.blocks: in one training step
    # the backward pass enters every block's modules again (pre-hooks count the calls: the recomputation stops once
    # it has what the backward needs, so a module may be entered without returning).
    probe = subprocess.run([PYTHON, "-c", "import json, torch; from stride.trainers import blocks; "
                            "from stride.trainers.config_reader import from_dict; from stride.trainers.tasks import make_task; "
                            f"s = json.load(open({str(ac_run / 'summary.json')!r})); "
                            "cfg = from_dict(s['config']); task = make_task(cfg, s['facts']); "
                            "model = task.build_model(); units = task.blocks(model); "
                            "blocks.checkpoint_activations(units, cfg.train.activation_checkpointing_every); "
                            "calls = [0] * len(units); [m.register_forward_pre_hook("
                            "lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)) "
                            "for i, u in enumerate(units) for m in u.modules() if m is not u]; "
                            "loss = model(torch.randn(8, s['facts']['signal_length'])).sum(); forward = list(calls); "
                            "loss.backward(); print(json.dumps([forward, [c - f for c, f in zip(calls, forward)]]))"],
                           cwd=project, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    forward, again = json.loads(probe.stdout.strip().splitlines()[-1])
    assert len(forward) == 3 and all(f > 0 for f in forward) and all(a > 0 for a in again), probe.stdout


@pytest.mark.slow
def test_compile_and_activation_checkpointing_of_the_users_blocks_train_like_eager(torchrun_runs):
    """2 DDP processes with train.compile=model and activation checkpointing on the user's task: the model and the
    loss compile as one function around its 3 checkpointed blocks, and the training is torchrun's eager DDP run, up to
    the rounding of inductor's fused kernels. (The loop's guarantee: the Ray launcher runs the same loop.)"""
    (run, out), (ddp_run, _) = case_run(torchrun_runs, "compiled"), case_run(torchrun_runs, "ddp")
    assert "torch.compile (mode default)" in out and "activation checkpointing: 3 of 3 blocks" in out, out[-3000:]
    s = summary(run)
    assert s["compiled_modules"] == 1 and s["activation_checkpointed_blocks"] == 3, s
    got, eager = train_losses(run), train_losses(ddp_run)
    assert sorted(got) == sorted(eager) == list(range(1, 41))
    for step in eager:
        assert got[step] == pytest.approx(eager[step], rel=1e-4, abs=1e-6), step


# ---- 3. mixed precision on CPU ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cpu_gives_finite_losses(torchrun_runs, precision):
    run, _ = case_run(torchrun_runs, precision)
    s = summary(run)
    assert s["status"] == "completed" and s["precision"] == precision and s["global_step"] == 10
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 11)) and all(math.isfinite(v) for v in losses.values()), losses
    assert math.isfinite(s["val_loss"]) and s["val_loss"] < s["initial_val_loss"]
    assert_reports_accuracy(run, s)


# ---- 4. gradient accumulation -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_accumulating_two_micro_batches_equals_one_batch_twice_as_big(project, tmp_path):
    """One process: 2 micro-batches of 16 per step, against 1 batch of 32. The rows of a step are the same (the
    order cuts the same permutation), the augmentation draws the same shifts (np.random, reseeded per step), so
    the runs differ only by float rounding."""
    common = [f"run.storage_path={tmp_path}", *OVERLAY, "model.dropout=0.0", "train.max_steps=20",
              "train.log_every_steps=1", "train.eval_every_steps=20", "scaling.num_workers=1"]
    torchrun(project, 1, "run.name=accum", "train.batch_size_per_worker=16", "train.grad_accum_steps=2", *common)
    torchrun(project, 1, "run.name=big", "train.batch_size_per_worker=32", "train.grad_accum_steps=1", *common)
    accum, big = train_losses(tmp_path / "accum"), train_losses(tmp_path / "big")
    assert sorted(accum) == sorted(big) == list(range(1, 21))
    for step in big:
        assert accum[step] == pytest.approx(big[step], rel=1e-4, abs=1e-6), (step, accum[step], big[step])
    assert big[20] < big[1]
    sa, sb = summary(tmp_path / "accum"), summary(tmp_path / "big")
    assert sa["samples_seen"] == sb["samples_seen"] == 20 * 32
    assert sa["val_loss"] == pytest.approx(sb["val_loss"], rel=1e-4)
    assert sa["val_accuracy"] == pytest.approx(sb["val_accuracy"], abs=2 / 512)  # at most a sample or two flips


# ---- 6. every way a Ray run stops, then resumes: one run, bitwise the uninterrupted one ----------------------

def _stop_at(proc: subprocess.Popen, metrics: Path, step: int, signum: int) -> str:
    """Once metrics.jsonl shows `step`, send the driver `signum`; returns its output when it has exited."""
    wait_for_step(metrics, step, proc)
    proc.send_signal(signum)
    return proc.communicate(timeout=180)[0]


def _kill_driver_after_checkpoint(proc: subprocess.Popen, run: Path, after: int) -> str:
    """SIGKILL the driver once a periodic checkpoint past step `after` has landed (written in the background)."""
    from stride.trainers.run import checkpointing

    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        newest = checkpointing.newest_complete(run)
        if newest is not None and checkpointing.read_meta(newest)["step"] > after:
            break
        time.sleep(0.05)
    tree = descendants(proc.pid)
    proc.kill()
    proc.wait()
    kill_pids(tree)  # anything the driver itself started; the head removes the dead job's actors
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        return "(output not readable: a process still holds the pipe)"


@pytest.mark.slow
def test_sigterm_sigint_driver_sigkill_and_a_killed_worker_each_resume_exactly(project, ray_run, ray_cluster,
                                                                                  shared_ray_head):
    """One run of the user's task on 2 Ray workers is stopped four ways, and each time the same command carries on
    from where it stopped: SIGTERM (checkpoint now, exit 143), Ctrl-C (checkpoint at the next step, exit 130), a
    SIGKILLed driver (from the last periodic checkpoint), and a killed worker with scaling.max_failures=1 (Ray
    restarts the group from the last checkpoint, the run completes). Every logged loss, the evaluations after the
    last resume and the final weights are bitwise the uninterrupted run's, in one MLflow run."""
    from stride.trainers.run import checkpointing

    run, metrics = project / "runs" / "stopped", project / "runs" / "stopped" / "metrics.jsonl"
    args = ["run.name=stopped", *RAY_ARGS]

    proc = start_stride(project, *args, env=ray_cluster)
    out = _stop_at(proc, metrics, 130, signal.SIGTERM)
    assert proc.returncode == 143, out[-3000:]
    s = summary(run)
    assert s["status"] == "interrupted" and 130 <= s["global_step"] < RAY_STEPS, out[-3000:]
    term_step, mlflow_run_id = s["global_step"], s["mlflow_run_id"]

    proc = start_stride(project, *args, env=ray_cluster)
    out = _stop_at(proc, metrics, term_step + 150, signal.SIGINT)
    assert proc.returncode == 130 and "received SIGINT: checkpointing at the next step" in out, out[-3000:]
    assert f"at step {term_step}" in out  # resumed from SIGTERM's checkpoint
    s = summary(run)
    assert s["status"] == "interrupted" and s["global_step"] >= term_step + 150 and s["restarts"] == 1
    int_step = s["global_step"]
    assert checkpointing.read_meta(checkpointing.newest_complete(run))["step"] == int_step

    proc = start_stride(project, *args, env=ray_cluster)
    out = _kill_driver_after_checkpoint(proc, run, int_step)
    killed_at = checkpointing.read_meta(checkpointing.newest_complete(run))["step"]
    assert killed_at % 100 == 0 and int_step < killed_at < RAY_STEPS - 300, out[-3000:]
    assert summary(run)["global_step"] == int_step  # the killed driver wrote no summary
    assert not shared_ray_head.wait_idle(), "the killed driver's job left actors on the cluster"

    proc = start_stride(project, *args, "scaling.max_failures=1", env=ray_cluster)
    wait_for_step(metrics, killed_at + 100, proc)
    workers = [p for h in shared_ray_head.head.pids() for p in descendants(h) if "RayTrainWorker" in _cmdline(p)]
    assert workers, "no Ray Train worker process found"
    os.kill(workers[-1], signal.SIGKILL)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    assert f"resuming stopped from checkpoint_{killed_at:08d} (step {killed_at})" in out and f"at step {killed_at}" in out

    # Two starts from a checkpoint in this last run: the driver's resume, then Ray's restart of the worker group
    # (from the step-killed_at checkpoint or a newer one, depending on which Ray had registered when the worker died).
    starts = re.findall(r"resumed from \S+ at step (\d+) .*restart (\d+)", out)
    assert len(starts) == 2 and int(starts[0][0]) == killed_at and int(starts[1][0]) >= killed_at, starts
    s, ref = summary(run), summary(ray_run["dir"])
    assert s["status"] == "completed" and s["global_step"] == RAY_STEPS
    assert s["restarts"] == int(starts[1][1]) and s["restarts"] in (3, 4)  # TERM, INT, KILL resumes + the restart
    assert s["mlflow_run_id"] == mlflow_run_id  # one MLflow run throughout, not one per resume, and it goes to the end
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'runs' / 'mlflow.db'}")
    named = client.search_runs([client.get_experiment_by_name("signal").experiment_id], "tags.`mlflow.runName` = 'stopped'")
    assert [r.info.run_id for r in named] == [mlflow_run_id]
    assert max(m.step for m in client.get_metric_history(mlflow_run_id, "train_loss")) == RAY_STEPS
    assert s["samples_seen"] == ref["samples_seen"]
    losses, expected = train_losses(run), train_losses(ray_run["dir"])
    assert set(losses) == set(expected) | {term_step, int_step}  # the stop steps are logged too
    assert {k: losses[k] for k in expected} == expected  # bitwise, every logged step
    assert [(e["step"], e["val_loss"], e["val_accuracy"]) for e in evals(run) if e["step"] > killed_at] == \
           [(e["step"], e["val_loss"], e["val_accuracy"]) for e in evals(ray_run["dir"]) if e["step"] > killed_at]
    assert s["param_checksums"] == ref["param_checksums"] and s["val_accuracy"] == ref["val_accuracy"]


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ") + open(f"/proc/{pid}/comm").read()
    except OSError:
        return ""


# ---- 7. a 2-worker checkpoint resumed by 1 worker ---------------------------------------------------------------

@pytest.mark.slow
def test_two_worker_checkpoint_resumes_on_one_worker_without_losing_samples(project, torchrun_runs):
    """torchrun, 2 ranks x 64 rows for 10 steps (a case of the batch), then the same run in 1 process x 128 rows (the
    same global batch) to the end of the epoch: every training row is seen exactly once in epoch 0
    (STRIDE_SAMPLE_LOG). The resharding is the loop's, the same under Ray (whose resume at another world size is the
    FSDP torchrun-to-Ray case and the elastic job's)."""
    run, _ = case_run(torchrun_runs, "elastic")
    storage, log = torchrun_runs["dir"], torchrun_runs["dir"] / "samples"
    rows = 2048
    per_epoch = rows // 128
    first = train_losses(run)
    r = torchrun(project, 1, f"run.storage_path={storage}", "run.name=elastic", *OVERLAY, *ELASTIC,
                 "train.batch_size_per_worker=128", f"train.max_steps={per_epoch}", env={"STRIDE_SAMPLE_LOG": str(log)})
    assert "(step 10)" in r.stdout and "at step 10" in r.stdout
    s = summary(run)
    assert s["status"] == "completed" and s["restarts"] == 1 and s["world_size"] == 1
    assert s["global_step"] == per_epoch and s["samples_seen"] == per_epoch * 128
    seen = [(r["micro_step"], r["world_size"], i) for f in log.glob("rank*.jsonl") for r in read_jsonl(f)
            for i in r["sample_ids"]]
    assert {w for m, w, _ in seen if m < 10} == {2} and {w for m, w, _ in seen if m >= 10} == {1}
    ids = [i for m, _, i in seen if m < per_epoch]
    assert len(ids) == len(set(ids)) == rows and set(ids) == set(range(rows))  # none twice, none skipped
    losses = train_losses(run)
    assert {k: losses[k] for k in first} == first and max(losses) == per_epoch  # continued, not restarted
    assert losses[per_epoch] < first[2]


# ---- 9. `ray job submit --working-dir .` of the user's folder to a token-auth head ------------------------------

@pytest.fixture(scope="module")
def head(shared_ray_head):  # the session's token-auth head from ray_cluster.local (2 CPUs)
    return shared_ray_head.head


@pytest.mark.slow
def test_ray_job_submit_of_the_project_folder(head, tmp_path, ray_cluster):
    project = copy_project(tmp_path / "signal_project")
    storage = tmp_path / "job_runs"
    env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head.token_path))
    r = subprocess.run([RAY, "job", "submit", "--address", head.dashboard_url, "--working-dir", ".",
                        "--submission-id", "user-signal", "--",
                        "python", "-m", "stride", "--config", "signal.yaml", f"run.storage_path={storage}",
                        "train.max_steps=20", "train.eval_every_steps=10"],
                       cwd=project, env=env, capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Job 'user-signal' succeeded" in out, out[-4000:]
    assert "[stride rank 0]" in out and "val_accuracy" in out, out[-3000:]
    logs = subprocess.run([RAY, "job", "logs", "user-signal", "--address", head.dashboard_url], env=env,
                          capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0, logs.stderr[-2000:]
    assert "[stride rank 0]" in logs.stdout and "step 20/20" in logs.stdout, logs.stdout[-3000:]
    assert "Found multiple active Ray instances" not in logs.stdout  # the head's processes know their cluster
    s = summary(storage / "signal")
    assert s["status"] == "completed" and s["global_step"] == 20 and s["world_size"] == 2 and s["task"] == TASK
    assert_reports_accuracy(storage / "signal", s)
    assert s["val_loss"] < s["initial_val_loss"]
    # What was uploaded is the user's folder: the task module beside its YAML.
    packages = [p for p in (head.temp_dir / "ray" / "session_latest" / "runtime_resources" / "working_dir_files").iterdir()
                if (p / "signal_task.py").exists()]
    assert packages and (packages[0] / "signal.yaml").exists()
