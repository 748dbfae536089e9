"""optim.name, optim.kwargs, optim.schedule and Task.configure_optimizer: function level, one process, no Ray."""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
import torch

from conftest import REPO, read_jsonl
from stride.trainers import config as config_module
from stride.trainers import optim as optim_module
from stride.errors import ConfigError
from stride.trainers.config_reader import load_config
from stride.trainers.models import MLP
from stride.trainers.optim import build_optimizer, build_scheduler, check_optimizer
from stride.trainers.schedules import SCHEDULES, cosine_factor
from stride.trainers.task import Task

TABULAR = REPO / "trainers/configs/tabular_mlp.yaml"

USER_OPTIM = '''
import torch


class Shrink(torch.optim.Optimizer):
    """p <- p - lr * grad, then p <- p * shrink: a user's own optimizer with a keyword of its own."""

    def __init__(self, params, lr=1e-3, shrink=1.0):
        super().__init__(params, dict(lr=lr, weight_decay=0.0, shrink=shrink))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"]).mul_(group["shrink"])


not_an_optimizer = 3
'''


def cfg_of(*overrides: str):
    return load_config(TABULAR, list(overrides))


def old_lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Stride's schedule before optim.schedule existed, verbatim: the default must stay bitwise equal to it."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A user's working directory holding my_optim.py; sys.path and the imported module are put back afterwards."""
    (tmp_path / "my_optim.py").write_text(USER_OPTIM)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("my_optim", None)


def lrs_seen(cfg, total_steps: int, steps: int) -> list[float]:
    """The lr of each of the first `steps` optimizer steps, as the loop's scheduler sets it."""
    model = MLP(4, [8], 3)
    optimizer = build_optimizer(cfg, model, world_size=1)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


# ---- schedules ----

def test_config_and_step_name_the_same_schedules_and_optimizers():
    assert set(config_module.SCHEDULES) == set(SCHEDULES)
    assert set(config_module.BUILTIN_OPTIMIZERS) == set(optim_module.BUILTIN_OPTIMIZERS)


def test_a_schedule_added_to_the_registry_is_accepted_by_the_config_and_drives_the_optimizer(monkeypatch):
    """A new built-in schedule is one function under @builtin in trainers/schedules.py: the config's schema takes its
    name (it validates against the registry), the driver's check calls it, and the scheduler follows it."""
    from stride.trainers import schedules

    for registry in (schedules.SCHEDULES, schedules.DESCRIPTIONS):
        monkeypatch.setitem(registry, "halving", None)  # removed again after the test

    @schedules.builtin("halving", "half the peak lr after the warm-up")
    def halving_factor(step, warmup_steps, total_steps, min_lr_ratio, decay_fraction):
        return (step + 1) / warmup_steps if step < warmup_steps else 0.5

    cfg = cfg_of("optim.schedule=halving", "optim.lr=0.01", "optim.warmup_steps=2")
    check_optimizer(cfg)
    assert lrs_seen(cfg, total_steps=10, steps=6) == pytest.approx([0.005, 0.01, 0.005, 0.005, 0.005, 0.005])
    with pytest.raises(ConfigError, match=r"is neither cosine, linear, constant, wsd, inverse_sqrt, halving nor "):
        cfg_of("optim.schedule=doubling")


def test_the_default_schedule_is_the_old_cosine_bitwise():
    cfg = cfg_of()
    assert cfg.optim.schedule == "cosine"
    for warmup, total, floor in ((0, 1, 0.0), (1, 1, 0.1), (5, 40, 0.05), (10, 110, 0.1), (50, 30, 0.3), (3, 1000, 1.0)):
        for s in range(total + 20):
            assert cosine_factor(s, warmup, total, floor) == old_lr_factor(s, warmup, total, floor), (warmup, total, floor, s)
    c = cfg.optim
    expected = [c.lr * old_lr_factor(s, c.warmup_steps, 60, c.min_lr_ratio) for s in range(60)]
    assert lrs_seen(cfg, 60, 60) == expected  # ==: bitwise, not approximately


# warmup_steps=4, total_steps=20, min_lr_ratio=0.1, decay_fraction=0.25: the factor at 0-based optimizer steps.
SCHEDULE_POINTS = {
    "cosine": {4: 1.0, 12: 0.1 + 0.9 * 0.5, 19: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)), 20: 0.1, 99: 0.1},
    "linear": {4: 1.0, 5: 1 - 0.9 / 16, 12: 0.55, 19: 0.1 + 0.9 / 16, 20: 0.1, 99: 0.1},
    "constant": {4: 1.0, 5: 1.0, 19: 1.0, 99: 1.0},
    # the decay covers the last round(0.25 x 20) = 5 steps: 15..19
    "wsd": {4: 1.0, 10: 1.0, 14: 1.0, 15: 1.0, 16: 0.1 + 0.9 * 4 / 5, 19: 0.1 + 0.9 / 5, 20: 0.1, 99: 0.1},
    # sqrt(warmup / n) at the n-th step (n = step + 1), floored at min_lr_ratio
    "inverse_sqrt": {4: math.sqrt(4 / 5), 15: 0.5, 99: math.sqrt(4 / 100), 399: 0.1, 5000: 0.1},
}


@pytest.mark.parametrize("name", sorted(SCHEDULE_POINTS))
def test_each_schedule_follows_its_formula(name):
    factor = SCHEDULES[name]
    warm = [factor(s, 4, 20, 0.1, 0.25) for s in range(4)]
    assert warm == [0.25, 0.5, 0.75, 1.0]  # the same linear warm-up for every schedule, its last step at the peak
    for s, expected in SCHEDULE_POINTS[name].items():
        assert factor(s, 4, 20, 0.1, 0.25) == pytest.approx(expected, abs=1e-12), s
    after = [factor(s, 4, 20, 0.1, 0.25) for s in range(3, 40)]
    assert all(a >= b for a, b in zip(after, after[1:]))  # never rises after the warm-up
    assert factor(0, 0, 20, 0.1, 0.25) > 0  # no warm-up: no division by zero, a positive first lr


@pytest.mark.parametrize("name", sorted(SCHEDULE_POINTS))
def test_the_scheduler_drives_the_optimizer_with_the_configured_schedule(name):
    cfg = cfg_of(f"optim.schedule={name}", "optim.lr=0.01", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1",
                 "optim.decay_fraction=0.25")
    seen = lrs_seen(cfg, total_steps=20, steps=20)
    assert seen == [0.01 * SCHEDULES[name](s, 4, 20, 0.1, 0.25) for s in range(20)]
    assert seen[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    for s, expected in SCHEDULE_POINTS[name].items():
        if s < 20:
            assert seen[s] == pytest.approx(0.01 * expected), s


def test_wsd_decays_over_its_fraction_and_never_inside_the_warm_up():
    f = SCHEDULES["wsd"]
    assert [f(s, 0, 10, 0.0, 0.3) for s in range(10)] == pytest.approx([1] * 7 + [1, 2 / 3, 1 / 3])
    assert [f(s, 0, 10, 0.0, 1.0) for s in range(10)] == pytest.approx([1 - s / 10 for s in range(10)])  # all decay
    assert [f(s, 8, 10, 0.0, 0.5) for s in range(8, 10)] == pytest.approx([1.0, 0.5])  # starts after the warm-up
    assert f(0, 0, 1000, 0.2, 0.0001) == 1.0 and f(999, 0, 1000, 0.2, 0.0001) == 1.0  # at least one decay step
    assert f(1000, 0, 1000, 0.2, 0.0001) == pytest.approx(0.2)


# ---- optimizers ----

@pytest.mark.parametrize("name, cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                                       ("sgd", torch.optim.SGD), ("adafactor", torch.optim.Adafactor)])
def test_each_builtin_optimizer_builds_and_steps(name, cls):
    cfg = cfg_of(f"optim.name={name}", "optim.weight_decay=0.05")
    torch.manual_seed(0)
    model = MLP(4, [8], 3)
    optimizer = build_optimizer(cfg, model, world_size=1)
    assert type(optimizer) is cls
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0  # none on biases and norms
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(16, 4)).logsumexp(-1).mean().backward()
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    check_optimizer(cfg)


def test_betas_and_momentum_still_reach_the_builtins_and_kwargs_override_them():
    model = MLP(4, [8], 3)
    assert build_optimizer(cfg_of("optim.betas=[0.8, 0.9]"), model, 1).defaults["betas"] == (0.8, 0.9)
    assert build_optimizer(cfg_of("optim.name=adam", "optim.betas=[0.7, 0.9]"), model, 1).defaults["betas"] == (0.7, 0.9)
    assert build_optimizer(cfg_of("optim.name=sgd", "optim.momentum=0.5"), model, 1).defaults["momentum"] == 0.5
    sgd = build_optimizer(cfg_of("optim.name=sgd", "optim.kwargs={momentum: 0.3, nesterov: true}"), model, 1)
    assert sgd.defaults["momentum"] == 0.3 and sgd.defaults["nesterov"] is True
    adamw = build_optimizer(cfg_of("optim.kwargs={betas: [0.5, 0.6], eps: 1.0e-6, amsgrad: true}"), model, 1)
    assert tuple(adamw.defaults["betas"]) == (0.5, 0.6) and adamw.defaults["eps"] == 1e-6 and adamw.defaults["amsgrad"]
    adafactor = build_optimizer(cfg_of("optim.name=adafactor", "optim.kwargs={beta2_decay: -0.5}"), model, 1)
    assert adafactor.defaults["beta2_decay"] == -0.5


def test_a_torch_optim_class_by_module_and_name():
    cfg = cfg_of("optim.name=torch.optim:RAdam", "optim.kwargs={decoupled_weight_decay: true}", "optim.lr=0.02")
    check_optimizer(cfg)
    optimizer = build_optimizer(cfg, MLP(4, [8], 3), world_size=1)
    assert type(optimizer) is torch.optim.RAdam and optimizer.defaults["decoupled_weight_decay"] is True
    assert [g["lr"] for g in optimizer.param_groups] == [0.02, 0.02]


def test_a_users_own_optimizer_class_from_the_working_directory(user_folder):
    cfg = cfg_of("optim.name=my_optim:Shrink", "optim.kwargs={shrink: 0.5}", "optim.lr=0.1", "optim.warmup_steps=0",
                 "optim.schedule=constant")
    check_optimizer(cfg)
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    optimizer = build_optimizer(cfg, model, world_size=1)
    assert type(optimizer).__module__ == "my_optim" and optimizer.defaults["shrink"] == 0.5
    model(torch.ones(1, 3)).sum().backward()  # grad 1 everywhere
    optimizer.step()
    assert torch.equal(model.weight, torch.full((1, 3), (1.0 - 0.1) * 0.5))  # the kwargs reached its step


@pytest.mark.parametrize("overrides, says", [
    (["optim.name=adam2"], ["optim.name ('adam2')", "adamw, adam, sgd, adafactor", "optim.name=torch.optim:RAdam"]),
    (['optim.name=":RAdam"'], ["optim.name (':RAdam')", "<module>:<Class>"]),
    (["optim.schedule=step"], ["optim.schedule ('step')", "wsd, inverse_sqrt", "<module>:<function>"]),
    (["optim.decay_fraction=0"], ["optim.decay_fraction (0)", "greater than 0"]),
    (["optim.decay_fraction=1.5"], ["optim.decay_fraction (1.5)", "less than or equal to 1"]),
    (["optim.kwargs={lr: 0.1}"], ["optim.kwargs", "sets lr", "use optim.lr"]),
    (["optim.kwargs={weight_decay: 0.1}"], ["optim.kwargs", "sets weight_decay", "optim.weight_decay"]),
    (["optim.kwargs=[1]"], ["optim.kwargs ([1])", "dictionary"]),
])
def test_bad_optimizer_settings_are_refused_by_the_config(overrides, says):
    with pytest.raises(ConfigError) as e:
        cfg_of(*overrides)
    assert all(s in str(e.value) for s in says) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, says", [
    (["optim.name=no_such_optim_module:Lion"], ["optim.name (no_such_optim_module:Lion)", "is not importable",
                                                "put no_such_optim_module.py in the working directory"]),
    (["optim.name=torch.optim:Nope"], ["optim.name (torch.optim:Nope)", "module torch.optim has no Nope"]),
    (["optim.name=torch.nn:Linear"], ["optim.name (torch.nn:Linear) is not a torch.optim.Optimizer subclass",
                                      "torch.optim:RAdam"]),
    (["optim.name=my_optim:not_an_optimizer"], ["optim.name (my_optim:not_an_optimizer) is not a torch.optim.Optimizer"]),
    (["optim.name=broken_optim:X"], ["optim.name (broken_optim:X)", "importing broken_optim failed: ZeroDivisionError"]),
    (["optim.kwargs={foo: 1}"], ["optim.kwargs ({'foo': 1})", "adamw refused it", "unexpected keyword argument 'foo'",
                                 "fix optim.kwargs"]),
    (["optim.name=sgd", "optim.kwargs={nesterov: true, momentum: 0}"], ["optim.kwargs", "sgd refused it", "Nesterov"]),
    (["optim.kwargs={betas: [2.0, 0.9]}"], ["optim.kwargs", "Invalid beta parameter"]),
    (["optim.name=my_optim:Shrink", "optim.kwargs={shrink: abc}"], ["optim.kwargs ({'shrink': 'abc'})",
                                                                    "my_optim:Shrink refused it", "TypeError"]),
])
def test_bad_optimizers_are_refused_on_the_driver(user_folder, overrides, says):
    (user_folder / "broken_optim.py").write_text("x = 1 / 0\n")
    cfg = cfg_of(*overrides)  # the config's form is fine; the driver's check builds the optimizer once
    with pytest.raises(ConfigError) as e:
        check_optimizer(cfg)
    assert all(s in str(e.value) for s in says) and "\n" not in str(e.value), str(e.value)
    sys.modules.pop("broken_optim", None)


def test_the_driver_checks_the_optimizer_before_reading_the_data(monkeypatch):
    """checks.prepare (Ray's driver and torchrun's) refuses a bad optimizer before the data is inspected."""
    from stride.trainers.launch import checks

    monkeypatch.setattr(checks, "inspect", lambda *a: pytest.fail("the data was read before the optimizer check"))
    with pytest.raises(ConfigError, match=r"optim.kwargs \(\{'foo': 1\}\)"):
        checks.prepare(cfg_of("optim.kwargs={foo: 1}"))


# ---- Task.configure_optimizer ----

class OwnOptimizer(Task):
    """A task whose optimizer is its own: SGD over Stride's groups, with a momentum the config does not set."""

    def configure_optimizer(self, model, param_groups):
        self.groups_given = param_groups
        return torch.optim.SGD(param_groups, momentum=0.25)


class ReturnsNone(Task):
    def configure_optimizer(self, model, param_groups):
        return None


class ReturnsJunk(Task):
    def configure_optimizer(self, model, param_groups):
        return [p for g in param_groups for p in g["params"]]


def test_configure_optimizer_gets_strides_groups_and_the_schedule_drives_it():
    cfg = cfg_of("optim.lr=0.01", "optim.weight_decay=0.1", "optim.warmup_steps=2", "optim.schedule=constant")
    task = OwnOptimizer(Task.Config())
    model = MLP(4, [8], 3)
    optimizer = build_optimizer(cfg, model, 1, task)
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.25
    assert [(g["lr"], g["weight_decay"]) for g in task.groups_given] == [(0.01, 0.1), (0.01, 0.0)]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    scheduler = build_scheduler(cfg, optimizer, 10)
    seen = []
    for _ in range(4):
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert seen == [[0.005, 0.005], [0.01, 0.01], [0.01, 0.01], [0.01, 0.01]]


def test_configure_optimizer_none_lets_stride_build_it_and_anything_else_is_refused():
    cfg = cfg_of("optim.name=adam")
    assert type(build_optimizer(cfg, MLP(4, [8], 3), 1, ReturnsNone(Task.Config()))) is torch.optim.Adam
    with pytest.raises(TypeError, match="ReturnsJunk.configure_optimizer returned list, not a torch.optim.Optimizer"):
        build_optimizer(cfg, MLP(4, [8], 3), 1, ReturnsJunk(Task.Config()))
    assert Task.configure_optimizer(Task(Task.Config()), MLP(4, [8], 3), []) is None  # the default: Stride builds it


# ---- a run: the schedule and the optimizer's state resume exactly ----

def test_a_non_default_optimizer_and_schedule_resume_bitwise(tmp_path, tabular_data):
    """RAdam (torch.optim:RAdam, with kwargs) under wsd, resumed from step 10 into the decay (it starts at step 15):
    the losses, the logged lrs and the final weights equal the uninterrupted run's."""
    from runs import losses as _losses
    from test_checkpoints import _args

    from stride.trainers.launch.torchrun import main as torchrun_main

    extra = ("optim.name=torch.optim:RAdam", "optim.kwargs={decoupled_weight_decay: true}", "optim.schedule=wsd",
             "optim.decay_fraction=0.5", "optim.warmup_steps=3", "optim.min_lr_ratio=0.2", "checkpoint.keep_last=5")
    assert torchrun_main(_args(tmp_path, tabular_data, "full", 30, *extra)) == 0
    assert torchrun_main(_args(tmp_path, tabular_data, "cut", 30, *extra)) == 0
    run = tmp_path / "cut"
    for later in ("checkpoint_00000020", "checkpoint_00000030"):  # as if it had been killed after step 10's
        shutil.rmtree(run / later)
    (run / "summary.json").unlink()
    assert torchrun_main(_args(tmp_path, tabular_data, "cut", 30, *extra)) == 0

    def lrs(folder):
        return {r["step"]: r["lr"] for r in read_jsonl(folder / "metrics.jsonl") if "lr" in r}

    full = lrs(tmp_path / "full")
    assert lrs(run) == full and _losses(run) == _losses(tmp_path / "full")
    lr = load_config(TABULAR, []).optim.lr
    # the lr logged at step n is the one the scheduler set for the step after it
    assert full == {n: lr * SCHEDULES["wsd"](n, 3, 30, 0.2, 0.5) for n in full}
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in (run, tmp_path / "full")]
    assert summaries[0]["restarts"] == 1 and summaries[1]["restarts"] == 0  # it did resume, from step 10
    assert summaries[0]["param_checksums"] == summaries[1]["param_checksums"]


def test_a_schedule_of_the_users_own(tmp_path, monkeypatch):
    """optim.schedule: "<module>:<function>" found as optim.name's classes are; a name that is no function, a
    function that fails or returns no multiplier, is refused on the driver in one line naming optim.schedule."""
    (tmp_path / "my_schedules.py").write_text(
        "def halves(step, warmup_steps, total_steps, min_lr_ratio, decay_fraction):\n"
        "    return 0.5 ** (step // 10)\n"
        "def broken(step, *rest):\n    return 1 / (step - 50) if step == 50 else 1.0\n"
        "def nan(step, *rest):\n    return float('nan')\n"
        "class NotAFunction:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(REPO / "trainers/configs/tabular_mlp.yaml", ["optim.schedule=my_schedules:halves",
                                                                  "optim.warmup_steps=0", "optim.lr=0.1"])
    check_optimizer(cfg)
    model = MLP(4, [8], 2)
    optimizer = build_optimizer(cfg, model, 1)
    scheduler = build_scheduler(cfg, optimizer, 100)
    seen = []
    for _ in range(25):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == [0.1 * 0.5 ** (s // 10) for s in range(25)]
    for name, why in [("NotAFunction", "is not a function"), ("broken", "failed at step 50 of 100 (ZeroDivisionError"),
                      ("nan", "returned nan at step 0 of 100"), ("missing", "module my_schedules has no missing")]:
        bad = load_config(REPO / "trainers/configs/tabular_mlp.yaml", [f"optim.schedule=my_schedules:{name}"])
        with pytest.raises(ConfigError, match=r"optim\.schedule") as e:
            check_optimizer(bad)
        assert why in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"optim.schedule \('step'\)"):
        load_config(REPO / "trainers/configs/tabular_mlp.yaml", ["optim.schedule=step"])


# ---- optim.implementation (issue 45: the GPU step) -----------------------------------------------------------


def _steps(overrides: list[str], n: int = 20) -> tuple[list[float], torch.optim.Optimizer, torch.nn.Module]:
    """n AdamW steps of a small MLP on fixed data with the config's optimizer: the losses, the optimizer, the model."""
    cfg = load_config(None, ["model.name=mlp", *overrides])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = optim_module.build_optimizer(cfg, model, 1)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    losses = []
    for _ in range(n):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt, model


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "adafactor"])
def test_auto_picks_foreach_on_the_cpu_and_fused_only_on_cuda(name):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert optim_module.implementation(name, "auto", cpu) == "foreach"
    assert optim_module.implementation(name, "auto", cuda) == ("foreach" if name == "adafactor" else "fused")
    _, opt, _ = _steps([f"optim.name={name}"], n=1)
    assert opt.defaults["foreach"] is True and not opt.defaults.get("fused")


def test_auto_on_the_cpu_trains_bitwise_as_the_earlier_default_and_each_kernel_closely():
    """auto (foreach on the CPU) against for_loop, torch's CPU default that Stride used before: the same losses and
    weights bit for bit; fused (one kernel) within float tolerance."""
    auto, _, m_auto = _steps([])
    loop, _, m_loop = _steps(["optim.implementation=for_loop"])
    fused, opt_fused, _ = _steps(["optim.implementation=fused"])
    assert auto == loop
    assert all(torch.equal(a, b) for a, b in zip(m_auto.parameters(), m_loop.parameters()))
    assert opt_fused.defaults["fused"] is True
    assert fused == pytest.approx(loop, rel=1e-5)


def test_optim_kwargs_win_over_the_implementation():
    _, opt, _ = _steps(["optim.implementation=fused", "optim.kwargs={foreach: true, fused: false}"], n=1)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


@pytest.mark.parametrize("overrides, words", [
    (["optim.name=adafactor", "optim.implementation=fused"], "optim.name adafactor has foreach, for_loop"),
    (["optim.name=torch.optim:RAdam", "optim.implementation=foreach"], "only its own"),
])
def test_an_implementation_the_optimizer_lacks_is_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        optim_module.check_optimizer(load_config(None, ["model.name=mlp", *overrides]))
    assert str(e.value).startswith("optim.implementation (") and words in str(e.value) and "\n" not in str(e.value)
