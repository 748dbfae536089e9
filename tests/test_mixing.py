"""Several sources mixed by weight (datasets/mixing.py), as functions and streams: the realised shares, each batch in
proportion, the streamed rows equal to the reference at any world size and after a resume, and each source's rows
each seen once per pass over it."""

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runs import OVERLAY
from stride.datasets.mixing import MixedOrder, MixSource, order_for
from stride.datasets.splits import DataSpec, open_split
from stride.datasets.stream import TrainStream

# Three sources of 700, 300 and 1200 rows, row groups of 37 / 50 / 64: blocks straddle windows.
SIZES, GROUPS, WEIGHTS = (700, 300, 1200), (37, 50, 64), (0.5, 0.3, 0.2)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """A spec of the three sources' blocks, one after another, with sample ids that say the source (s * 10000 + i)."""
    base = tmp_path_factory.mktemp("mix")
    layouts, blocks, sources = [], [], []
    for s, (n, group, w) in enumerate(zip(SIZES, GROUPS, WEIGHTS)):
        pq.write_table(pa.table({"x": np.arange(n, dtype=np.float32), "sample_id": s * 10000 + np.arange(n)}),
                       base / f"s{s}.parquet", row_group_size=group)

        class Data:
            train_path = str(base / f"s{s}.parquet")

        split = open_split(Data, "train")
        sources.append(MixSource(f"src{s}", len(blocks), len(split.blocks), w))
        blocks += [(f + len(layouts), p, rows) for f, p, rows in split.blocks]
        layouts += split.layouts
    return DataSpec(("x", "sample_id"), True, sum(SIZES), tuple(layouts), tuple(blocks), "train",
                    sources=tuple(sources))


def order_of(spec, G=20, window=128, seed=3):
    order = order_for(spec, seed, G, window)
    assert isinstance(order, MixedOrder)
    return order


def streamed(spec, order, world_size, start, steps):
    streams = [TrainStream(spec, order, r, world_size, start, read_ahead=2, end_micro_step=start + steps)
               for r in range(world_size)]
    try:
        return [np.concatenate([s.next().sample_id for s in streams]) for _ in range(steps)]
    finally:
        for s in streams:
            s.close()


def test_the_realised_shares_are_the_weights_over_10000_samples_and_in_every_batch(mixture):
    order = order_of(mixture, G=20)
    counts = order.before(np.arange(0, 501))  # 500 batches: 10,000 samples
    shares = counts[:, -1] / 10_000
    assert np.abs(shares - np.array(WEIGHTS)).max() <= 0.01 * np.array(WEIGHTS).min()
    per_batch = np.diff(counts, axis=1)
    assert (per_batch >= 0).all() and (per_batch.sum(axis=0) == 20).all()
    # every prefix holds every source's share to within the number of sources
    assert np.abs(counts - np.array(WEIGHTS)[:, None] * np.arange(501) * 20).max() <= len(WEIGHTS)
    assert order.source_counts(500) == {"src0": counts[0, -1], "src1": counts[1, -1], "src2": counts[2, -1]}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_streamed_batches_are_the_reference_at_any_world_size(mixture, world_size):
    order = order_of(mixture)
    steps = order.micro_steps_per_epoch + 15  # into the second epoch
    got = streamed(mixture, order, world_size, 0, steps)
    sample_ids = np.concatenate([10000 * s + np.arange(n) for s, n in enumerate(SIZES)])
    for m in range(steps):
        expect = sample_ids[order.rows(m, 0, 1)]
        np.testing.assert_array_equal(got[m], expect)
        for s in range(3):  # each batch in proportion: the counts the mixture dealt
            a = order.before(np.array([m, m + 1]))
            assert int((got[m] // 10000 == s).sum()) == a[s, 1] - a[s, 0]


def test_a_resume_mid_epoch_continues_the_same_sequence(mixture):
    order = order_of(mixture)
    whole = streamed(mixture, order_of(mixture), 2, 0, 90)
    resumed = streamed(mixture, order, 4, 57, 33)  # and at another world size
    assert all(np.array_equal(a, b) for a, b in zip(whole[57:], resumed))


def test_each_source_row_is_seen_once_per_pass_over_its_source(mixture):
    order = order_of(mixture, G=20, window=128)
    ids = np.concatenate(streamed(mixture, order, 2, 0, 3 * order.micro_steps_per_epoch))
    per_source = {s: ids[ids // 10000 == s] % 10000 for s in range(3)}
    for s, rows in per_source.items():
        n = SIZES[s]
        full = len(rows) // n
        assert full >= 1, (s, len(rows))
        for p in range(full):  # pass p over source s holds each of its rows exactly once
            assert sorted(rows[p * n:(p + 1) * n].tolist()) == list(range(n))
        assert max(Counter(rows.tolist()).values()) <= full + 1


def test_the_order_depends_on_the_seed_and_not_on_the_sources_order_of_reading(mixture):
    a, b = order_of(mixture, seed=3), order_of(mixture, seed=4)
    assert not np.array_equal(a.rows(0, 0, 1), b.rows(0, 0, 1))
    import pickle

    again = pickle.loads(pickle.dumps(a))  # what Ray Data's tasks get
    assert np.array_equal(again.rows(7, 0, 1), a.rows(7, 0, 1)) and again.epoch(0).window_pieces(1) == a.epoch(0).window_pieces(1)


# ---- end to end: two sources (Parquet and JSON Lines) under torchrun, killed and resized ----------------------

STEPS = 24
# A constant lr after the warm-up: the cut run's legs have other train.max_steps than the uninterrupted run, and a
# decaying schedule would give them other learning rates (the weights are compared).
RUN = [*OVERLAY, f"train.max_steps={STEPS}", "train.log_every_steps=1", "train.eval_every_steps=12",
       "checkpoint.every_steps=6", "checkpoint.keep_last=10", "train.batch_size_per_worker=10",
       "data.shuffle_window_rows=256", "optim.schedule=constant"]


@pytest.fixture(scope="module")
def regression_mix(tmp_path_factory):
    """examples/regression with two sources: its own Parquet data (weight 0.7) and another seed's as JSON Lines."""
    import json
    import shutil
    import subprocess

    from conftest import PYTHON, REPO

    dst = tmp_path_factory.mktemp("mix_e2e") / "regression"
    shutil.copytree(REPO / "examples" / "regression", dst, ignore=shutil.ignore_patterns("data", "runs", "__pycache__"))
    for seed, out in ((0, "a"), (1, "b")):
        subprocess.run([PYTHON, "prepare.py", "--rows", "1500", "--seed", str(seed), "--out", out], cwd=dst, check=True,
                       capture_output=True, timeout=120)
    for split in ("train", "val"):  # source b as JSON Lines, without its sample_id column
        table = pq.read_table(dst / "b" / split)
        rows = table.drop(["sample_id"]).to_pylist()
        shutil.rmtree(dst / "b" / split)
        (dst / "b" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mix = ["data.train=[{name: a, path: a/train, weight: 0.7}, {name: b, path: b/train.jsonl, weight: 0.3}]",
           "data.val=[{name: a, path: a/val}, {name: b, path: b/val.jsonl}]"]
    # The mixture replaces the YAML's single paths: setting both data.train and data.train_path is refused.
    text = (dst / "regression.yaml").read_text()
    (dst / "regression.yaml").write_text(text.replace("  train_path: data/train\n", "").replace("  val_path: data/val\n", ""))
    return dst, mix


def torchrun(project, nproc, *args, log=None, popen=False):
    """trainers/torchrun.py from the project: `nproc` ranks under torchrun, or one process forked from the fork
    server (no launcher, no process group)."""
    import os
    import subprocess

    from conftest import REPO, run_cli_forked, torchrun_launcher

    args = [str(REPO / "trainers" / "torchrun.py"), "--config", "regression.yaml", *args]
    if nproc == 1 and not popen:
        r = run_cli_forked(args, cwd=project, env={"PYTHONPATH": str(project), "STRIDE_SAMPLE_LOG": str(log)},
                           timeout=400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r
    cmd = [*torchrun_launcher(nproc), *args]
    env = dict(os.environ, PYTHONPATH=str(project), STRIDE_SAMPLE_LOG=str(log))
    if popen:
        return subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def global_batches(log_dir):
    """micro-step -> the global micro-batch's sample ids (ranks in order), from the newest attempt of each step."""
    import json

    seen = {}
    for f in sorted(log_dir.glob("*")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            seen.setdefault(r["micro_step"], {})[(r["world_size"], r["rank"])] = r["sample_ids"]
    out = {}
    for m, parts in seen.items():
        for world in sorted({w for w, _ in parts}, reverse=True):
            ranks = [parts.get((world, r)) for r in range(world)]
            if all(x is not None for x in ranks):
                out.setdefault(m, []).append(sum(ranks, []))
    return out


@pytest.mark.slow
def test_a_killed_and_resized_mixture_trains_every_micro_step_as_the_uninterrupted_run(regression_mix, tmp_path):
    import json
    import time

    import torch

    from conftest import descendants, kill_pids, read_jsonl
    from stride.trainers.run import checkpointing

    project, mix = regression_mix
    cut_log = tmp_path / "cut_log"
    run = tmp_path / "cut" / "regression"
    # A long run, SIGKILLed (the launcher and both ranks) once a checkpoint has landed: wherever it then is.
    proc = torchrun(project, 2, *RUN, *mix, f"run.storage_path={tmp_path}/cut", "train.max_steps=100000",
                    log=cut_log, popen=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if checkpointing.newest_complete(run) is not None:
                break
        except OSError:  # the run is writing or pruning a checkpoint as we look
            pass
        time.sleep(0.05)
    tree = [proc.pid, *descendants(proc.pid)]  # torchrun's workers run in sessions of their own
    kill_pids(tree)
    proc.wait()
    k = checkpointing.read_meta(checkpointing.newest_complete(run))["step"]
    end = k + 12
    # 2 -> 1 worker (the same global micro-batch: 20 rows) for 6 steps, then 1 -> 2 for 6 more.
    torchrun(project, 1, *RUN, *mix, f"run.storage_path={tmp_path}/cut", "train.batch_size_per_worker=20",
             f"train.max_steps={k + 6}", log=cut_log)
    torchrun(project, 2, *RUN, *mix, f"run.storage_path={tmp_path}/cut", f"train.max_steps={end}", log=cut_log)
    # The uninterrupted run: one process, the same global micro-batch (20 rows), to the same step.
    torchrun(project, 1, *RUN, *mix, f"run.storage_path={tmp_path}/full", "train.batch_size_per_worker=20",
             f"train.max_steps={end}", log=tmp_path / "full_log")

    # The uninterrupted run's global batches are the order's (test_streamed_batches_are_the_reference_at_any_world_size
    # holds the streams to it): a mixture numbers its rows in order, sources one after another.
    from stride.datasets.mixing import MixedOrder
    from stride.trainers.config_reader import build_config

    cfg = build_config({"data": {"train": [{"name": "a", "path": str(project / "a" / "train"), "weight": 0.7},
                                           {"name": "b", "path": str(project / "b" / "train.jsonl"), "weight": 0.3}]}})
    split = open_split(cfg.data, "train")
    order = MixedOrder(tuple(n for _, _, n in split.blocks), 0, 20, 256, sources=tuple(src for src, _ in split.sources))
    cut = global_batches(cut_log)
    assert set(range(end)) <= set(cut)
    for m in range(end):
        assert all(batch == order.rows(m, 0, 1).tolist() for batch in cut[m]), m  # every attempt: the same rows
    assert any(len(cut[m]) > 1 for m in cut)  # the resumed runs ran again what the killed one had done
    full = global_batches(tmp_path / "full_log")
    assert sorted(full) == list(range(end)) and all(full[m] == [order.rows(m, 0, 1).tolist()] for m in full)

    # The weights: the uninterrupted run's, to float rounding (2 ranks' mean of 10-row means against one 20-row mean:
    # seen within 1e-7 after 72 steps; a resume that drops the optimizer's state fails here).
    cut_ckpt, full_ckpt = (checkpointing.newest_complete(tmp_path / name / "regression") for name in ("cut", "full"))
    assert checkpointing.read_meta(cut_ckpt)["step"] == checkpointing.read_meta(full_ckpt)["step"] == end
    cut_w, full_w = checkpointing.load_model_state(cut_ckpt), checkpointing.load_model_state(full_ckpt)
    assert sorted(cut_w) == sorted(full_w)
    for name in full_w:
        torch.testing.assert_close(cut_w[name], full_w[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    summary = json.loads((run / "summary.json").read_text())
    lines = list(read_jsonl(run / "metrics.jsonl"))
    evals = [x for x in lines if "val_loss" in x]
    assert evals and all({"val_loss/a", "val_loss/b", "val_abs_error/a", "val_abs_error/b"} <= set(x) for x in evals)
    assert summary["global_step"] == end
    last = [x for x in lines if "samples_seen/a" in x][-1]
    assert last["step"] == end and last["samples_seen/a"] + last["samples_seen/b"] == end * 20
    assert abs(last["samples_seen/a"] - 0.7 * end * 20) <= 1


@pytest.mark.parametrize("data, message", [
    ({"train": [{"name": "a", "path": "x", "weight": -0.5}]}, r"data.train\[0\].weight \(-0.5\) must be greater than"),
    ({"train": [{"name": "a", "path": "x", "weight": 0}, {"name": "b", "path": "y", "weight": 0}]},
     r"data.train: every weight is 0; give at least one source a weight above 0"),
    ({"train": [{"name": "a", "path": "x"}], "train_path": "z"}, r"data.train and data.train_path are both set"),
    ({"val": [{"name": "a", "path": "x"}], "val_path": "z"}, r"data.val and data.val_path are both set"),
    ({"train": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}, r"data.train: the name 'a' is used twice"),
    ({"train": [{"name": "a", "path": "x", "wieght": 1}]}, r"data.train\[0\].wieght is not a key of a data.train entry"),
])
def test_a_bad_mixture_config_is_one_line_naming_the_entry(data, message):
    from stride.errors import ConfigError
    from stride.trainers.config_reader import build_config

    with pytest.raises(ConfigError, match=message) as e:
        build_config({"data": data})
    assert "\n" not in str(e.value)


def test_sources_without_the_tasks_columns_are_refused_naming_the_source_and_column(tmp_path):
    from stride.datasets.splits import inspect
    from stride.errors import DataError
    from stride.trainers.config_reader import build_config

    pq.write_table(pa.table({"x": [1.0, 2.0], "label": [0, 1]}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text('{"x": 1.5, "target": 0}\n')

    class Task:
        columns, facts = ("x", "label"), {}

        def inspect(self, train, val):
            return {}

    cfg = build_config({"run": {"storage_path": str(tmp_path / "runs")}, "data": {"train": [
        {"name": "speech", "path": str(tmp_path / "a.parquet")}, {"name": "music", "path": str(tmp_path / "b.jsonl")}]},
        "model": {"name": "mlp"}})
    with pytest.raises(DataError, match=r"data.train \(music\): no column 'label', which model.name \(mlp\) reads "
                                        r"\(columns: \['x', 'target'\]\)"):
        inspect(cfg, Task())
    assert cfg.data.val_path is None  # the default val_path is the built-in set's, not the mixture's
