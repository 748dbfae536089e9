"""How a test starts a run: one argument builder, one launcher façade, one reader of the losses.

    from runs import OVERLAY, launch, losses, tiny

    args = tiny(tmp_path, tabular_data, 20, "checkpoint.every_steps=10")   # tabular_mlp, 20 steps, the overlay
    assert launch.in_process(args) == 0                                      # or forked / torchrun / ray
    assert losses(tmp_path / "r")[20] < losses(tmp_path / "r")[1]

`tiny` builds the command line of a small run; `OVERLAY` (tests/overlay.yaml as overrides: MLflow off) goes into
every test run's command line, by `tiny` or spliced into a hand-made one (`*OVERLAY`), before the test's own
overrides, so that a test about MLflow turns it back on with `tracking.mlflow=true`. The launcher façade starts a
run the four ways the suite does (docs/testing.md, "How the suite stays cheap"): in this process, in a child forked
from the fork server, under torchrun, and on the session's shared Ray head."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from conftest import PYTHON, REPO, run_cli, run_cli_forked, torchrun_launcher

TABULAR = str(REPO / "trainers" / "configs" / "tabular_mlp.yaml")
TORCHRUN_PY = str(REPO / "trainers" / "torchrun.py")


def _overlay(path: Path = Path(__file__).with_name("overlay.yaml")) -> tuple[str, ...]:
    """tests/overlay.yaml ({section: {key: value}}) as `section.key=value` overrides (values written as JSON, which
    the config's YAML reads back as the same value)."""
    return tuple(f"{section}.{key}={json.dumps(value)}" for section, body in yaml.safe_load(path.read_text()).items()
                 for key, value in body.items())


OVERLAY = _overlay()


def tiny(storage, data=None, steps=None, *extra: str, name: str | None = "r", config: str = TABULAR) -> list[str]:
    """The command line of a small run: `config`, the data set at `data` (its train/ and val/ splits), runs under
    `storage` as run `name`, `steps` optimizer steps (train.epochs=null), the test overlay, then `extra`
    overrides (later ones win). A None leaves that part to the config."""
    args = ["--config", str(config)]
    if data is not None:
        args += [f"data.train_path={data}/train", f"data.val_path={data}/val"]
    args.append(f"run.storage_path={storage}")
    if name is not None:
        args.append(f"run.name={name}")
    if steps is not None:
        args += ["train.epochs=null", f"train.max_steps={steps}"]
    return [*args, *OVERLAY, *extra]


def losses(run_dir) -> dict[int, float]:
    """train_loss by step, from the run's metrics.jsonl (a step logged twice, by a resumed run, keeps the last)."""
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train_loss"] for r in map(json.loads, filter(str.strip, lines)) if "train_loss" in r}


class launch:  # noqa: N801 - a namespace: launch.forked(...), launch.torchrun(...)
    """The four ways a test starts a run, each given the run's arguments (`tiny(...)`, or a config and overrides).
    `entry` is what runs them: trainers/torchrun.py (the loop without Ray), or `-m stride` (the driver; on Ray)."""

    @staticmethod
    def in_process(args: list[str]) -> int:
        """The loop in this process (trainers/torchrun.py's main, no process group): its exit code; capsys and
        monkeypatch see it."""
        from stride.trainers.launch.torchrun import main

        return main(list(args))

    @staticmethod
    def forked(args: list[str], *, entry: tuple[str, ...] = (TORCHRUN_PY,), cwd=REPO, env: dict | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
        """One process forked from the fork server (conftest.run_cli_forked): a command's own output and exit."""
        return run_cli_forked([*entry, *args], cwd=cwd, env=env, timeout=timeout)

    @staticmethod
    def torchrun(args: list[str], *, nproc: int = 2, entry: tuple[str, ...] = (TORCHRUN_PY,), cwd=REPO,
                 env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        """`nproc` ranks under torch.distributed.run (conftest.torchrun_launcher), `env` added to this process's."""
        return subprocess.run([*torchrun_launcher(nproc), *entry, *args], cwd=cwd, capture_output=True, text=True,
                              env=dict(os.environ, **(env or {})), timeout=timeout)

    @staticmethod
    def ray(args: list[str], ray_env: dict, *, entry: tuple[str, ...] = ("-m", "stride"), cwd=REPO,
            timeout: float = 600) -> subprocess.CompletedProcess:
        """`python -m stride` on the session's shared head: `ray_env` is the `ray_cluster` fixture's client
        environment (RAY_ADDRESS and the token); without RAY_ADDRESS, an embedded local Ray."""
        return run_cli([*entry, *args], cwd=cwd, env=ray_env, timeout=timeout)


def files_under(folder) -> list[Path]:
    """Every file below `folder` (none when it does not exist): what a run left on a node's disk."""
    return [p for p in Path(folder).rglob("*") if p.is_file()] if Path(folder).exists() else []


__all__ = ["OVERLAY", "PYTHON", "TABULAR", "TORCHRUN_PY", "files_under", "launch", "losses", "tiny"]
