"""The Task contract without a training: how model.name finds a task, its config keys, the defaults of its hooks,
and a user's task end to end in one process (torchrun launcher, no Ray)."""

import json
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, read_jsonl
from stride.errors import ConfigError
from stride.trainers.config_reader import load_config
from stride.trainers.task import Task, repeated_blocks
from stride.trainers.tasks import task_class

TASK = '''
import numpy as np, torch
from stride import Task

SEEN = []  # (self.training, rows) of every transform call, for the test


class Line(Task):
    class Config(Task.Config):
        hidden: int = 8
    columns = ("x", "y")
    metric_names = ("abs_err",)

    def inspect(self, train, val):
        return {"scale": float(np.abs(train.read(["y"]).column("y").to_numpy()).max())}

    def transform(self, batch):
        SEEN.append((self.training, len(batch["x"])))
        return {"x": batch["x"].astype(np.float32)[:, None], "y": (batch["y"] / self.facts["scale"]).astype(np.float32)}

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(1, self.config.hidden), torch.nn.Tanh(), torch.nn.Linear(self.config.hidden, 1))

    def loss(self, model, batch):
        return torch.nn.functional.smooth_l1_loss(model(batch["x"]).squeeze(-1), batch["y"])

    def metrics(self, model, batch):
        return {"abs_err": (model(batch["x"]).squeeze(-1) - batch["y"]).abs()}
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project folder: their task module and data, nothing of Stride's."""
    (tmp_path / "line_task.py").write_text(TASK)
    rng = np.random.default_rng(0)
    for split, n in (("train", 2048), ("val", 256)):
        (tmp_path / split).mkdir()
        x = rng.uniform(-2, 2, n)
        pq.write_table(pa.table({"x": x, "y": 3 * x + 1, "sample_id": np.arange(n)}), tmp_path / split / "p.parquet")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name, says", [
    ("gpt", "neither a built-in task (char_gpt, mlp) nor \"<module>:<Class>\""),
    ("no_such_module:T", "module no_such_module is not importable; put no_such_module.py in the working directory"),
    ("line_task:Nope", "module line_task has no Nope"),
    ("line_task:np", "np is not a stride.Task subclass"),
    ("broken_task:T", "importing broken_task failed: ZeroDivisionError"),
])
def test_model_name_errors_say_what_to_fix(project, name, says):
    (project / "broken_task.py").write_text("x = 1 / 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.name={name}"])
    assert says in str(e.value) and "\n" not in str(e.value) and f"model.name ({name})" in str(e.value)


def test_a_user_task_config_adds_its_own_validated_keys(project):
    cfg = load_config(None, ["model.name=line_task:Line", "model.hidden=16"])
    assert cfg.model.hidden == 16 and cfg.to_dict()["model"] == {"name": "line_task:Line", "hidden": 16}
    with pytest.raises(ConfigError, match=r"unknown key 'model.hiden' for model.name line_task:Line; did you mean hidden"):
        load_config(None, ["model.name=line_task:Line", "model.hiden=16"])
    with pytest.raises(ConfigError, match=r"model.hidden \('wide'\)"):
        load_config(None, ["model.name=line_task:Line", "model.hidden=wide"])
    # The built-ins' keys are theirs alone: an mlp key under char_gpt is unknown.
    with pytest.raises(ConfigError, match="unknown key 'model.hidden_sizes' for model.name char_gpt"):
        load_config(REPO / "trainers/configs/char_gpt.yaml", ["model.hidden_sizes=[8]"])


def test_the_built_ins_are_tasks_like_any_other():
    for name in ("char_gpt", "mlp"):
        assert issubclass(task_class(name), Task)


def test_default_blocks_are_the_repeated_layers_and_leave_the_root_something():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(3))
            self.head = torch.nn.Linear(8, 2)

    net = Net()
    assert repeated_blocks(net) == list(net.layers)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert repeated_blocks(mlp) == [mlp[0], mlp[2]]  # every parameter is in a Linear: the last stays with the root
    assert repeated_blocks(torch.nn.Linear(2, 2)) == []


def test_default_flops_are_six_times_the_parameters():
    model = torch.nn.Linear(10, 10)
    assert Task(Task.Config()).flops_per_sample(model) == 6 * 110


def test_a_user_task_trains_in_one_process_and_reports_its_metric(project):
    (project / "line.yaml").write_text(textwrap.dedent("""\
        # A user's task in their own folder.   Launch: python -m stride --config line.yaml
        run: {name: line, storage_path: ./runs}
        data: {train_path: train, val_path: val}
        model: {name: "line_task:Line", hidden: 16}
        train: {batch_size_per_worker: 64, max_steps: 120, log_every_steps: 40, eval_every_steps: 60}
        optim: {lr: 0.02, warmup_steps: 5}
        checkpoint: {every_steps: 60}
        tracking: {mlflow: false}
        """))
    from stride.trainers.launch.torchrun import main as torchrun_main

    assert torchrun_main(["--config", "line.yaml"]) == 0
    import line_task

    # transform's self.training: True for the 120 training batches, False for validation's (256 rows in batches of
    # 64, before training and at steps 60 and 120).
    assert line_task.SEEN.count((True, 64)) == 120 and line_task.SEEN.count((False, 64)) == 3 * 4
    assert line_task.SEEN[:4] == [(False, 64)] * 4
    s = json.loads((project / "runs/line/summary.json").read_text())
    assert s["task"] == "line_task:Line" and s["facts"] == {"scale": pytest.approx(7.0, abs=0.01)}
    assert s["val_loss"] < 0.05 * s["initial_val_loss"] and s["val_abs_err"] < 0.1
    evals = [x for x in read_jsonl(project / "runs/line/metrics.jsonl") if "val_loss" in x]
    assert [e["step"] for e in evals] == [60, 120] and all("val_abs_err" in e for e in evals)
