"""A mixture of two sources, with a list of validation sources, trains on 2 Ray workers: the product's main path.

Under torchrun each rank loads the YAML itself; on Ray the workers rebuild the driver's config from its dict, and
there every mixture once failed ("data.train and data.train_path are both set"). tests/test_mixing.py proves the
mixture's order under torchrun; this run proves the Ray workers deal the same rows and report every source.
"""

import json

import pytest

from conftest import read_jsonl, run_cli
from test_mixing import RUN, global_batches, regression_mix  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

STEPS = 12


def test_a_mixture_with_validation_sources_trains_on_two_ray_workers(regression_mix, shared_ray_head, tmp_path):
    from stride.datasets.mixing import MixedOrder
    from stride.datasets.splits import open_split
    from stride.trainers.config_reader import build_config

    project, mix = regression_mix
    log = tmp_path / "samples"
    r = run_cli(["-m", "stride", "--config", "regression.yaml", *RUN, *mix, f"run.storage_path={tmp_path}",
                 f"train.max_steps={STEPS}", "scaling.num_workers=2"],
                env={**shared_ray_head.env(), "PYTHONPATH": str(project), "STRIDE_SAMPLE_LOG": str(log)}, cwd=project)
    assert not shared_ray_head.wait_idle()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "regression"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["global_step"] == STEPS
    assert summary["config"]["data"]["train_path"] is None  # the built-in data set's default never reached a worker

    # The Ray workers deal the mixture's order, as the torchrun ranks do (tests/test_mixing.py).
    cfg = build_config({"data": {"train": [{"name": "a", "path": str(project / "a" / "train"), "weight": 0.7},
                                           {"name": "b", "path": str(project / "b" / "train.jsonl"), "weight": 0.3}]}})
    split = open_split(cfg.data, "train")
    order = MixedOrder(tuple(n for _, _, n in split.blocks), 0, 20, 256, sources=tuple(src for src, _ in split.sources))
    batches = global_batches(log)
    assert sorted(batches) == list(range(STEPS))
    assert all(batches[m] == [order.rows(m, 0, 1).tolist()] for m in range(STEPS))

    lines = list(read_jsonl(run / "metrics.jsonl"))
    evals = [x for x in lines if "val_loss" in x]
    assert evals and all({"val_loss/a", "val_loss/b", "val_abs_error/a", "val_abs_error/b"} <= set(x) for x in evals)
    last = [x for x in lines if "samples_seen/a" in x][-1]
    assert last["samples_seen/a"] + last["samples_seen/b"] == STEPS * 20
