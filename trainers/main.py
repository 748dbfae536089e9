"""Stride's training driver: one command for a laptop, a Ray cluster or SLURM.

    python -m stride --config my_task.yaml [section.field=value ...]       (installed Stride, any folder)
    python trainers/main.py --config trainers/configs/char_gpt.yaml [section.field=value ...]
    python trainers/main.py --config trainers/configs/tabular_mlp.yaml scaling.num_workers=2 train.max_steps=300
    python trainers/main.py --config trainers/configs/char_gpt.yaml --print-config

On a cluster (RAY_ADDRESS set, or inside `ray job submit`) it joins that cluster; otherwise it starts an
embedded local Ray with token authentication and the dashboard on 127.0.0.1.

    RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=... ray job submit --address http://127.0.0.1:8265 --working-dir . \\
        --runtime-env-json '{"excludes": ["/data/", "/runs/"]}' -- python -m stride --config my_task.yaml \\
        run.storage_path=/mnt/shared/runs

(the job runs in Ray's temporary copy of the upload: results and data go by absolute paths, lifecycle.py).

Exit codes: 0 success; 2 a problem you can fix (config, data, resources; one line on stderr); 1 training failed.
Results: <run.storage_path>/<run.name>/{summary.json, metrics.jsonl, checkpoint_*}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if not __package__:  # run as a file from a checkout: import Stride as the `stride` package (stride/_checkout.py)
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "stride" / "_checkout.py"))

from stride.cli import ArgumentParser, error_line  # noqa: E402
from stride.errors import StrideError  # noqa: E402
from stride.ray_cluster.connect import init_ray, quiet_ray_env
from stride.errors import UsageError
from stride.trainers.launch import lifecycle  # noqa: E402
from stride.trainers.run import lock as runlock
from stride.trainers.config import SECTIONS, Config
from stride.trainers.config_reader import apply_overrides, build_config, load_config, section_keys, to_yaml
from stride.errors import EXIT_FAILED, EXIT_OK
from stride.trainers.launch.ray import train_on_ray
from stride.trainers.launch.lifecycle import install_signal_handlers
from stride.trainers.launch.stop_channel import StopChannel
from stride.trainers.launch.checks import prepare


def parse_args(argv: list[str] | None):
    sections = "\n".join(f"  {name:<11} {', '.join(section_keys(cls))}" for name, cls in SECTIONS.items())
    ap = ArgumentParser(
        prog="python trainers/main.py",
        description="Train a model with Stride (Ray Train + Ray Data).",
        epilog=f"Overrides are section.field=value (values parsed as YAML). Sections and fields:\n{sections}\n\n"
               "Full table with descriptions: docs/configuration.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=False, help="YAML config (e.g. trainers/configs/char_gpt.yaml)")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    ap.add_argument("overrides", nargs="*", metavar="section.field=value")
    return ap.parse_args(argv)


def fit(config: str | os.PathLike | dict | Config, overrides: list[str] = (), *, progress_bar: bool = False) -> dict:
    """Train a config on Ray (RAY_ADDRESS, or an embedded local Ray) and return its summary, as `python -m stride`
    does: `config` is a YAML path, a dict of sections or a Config; `overrides` are section.field=value strings.
    Writes <run.storage_path>/<run.name>/summary.json. Raises ConfigError, DataError or UsageError for a problem
    the user can fix (before Ray starts); a failed training run returns status "failed" with its error."""
    return _train(_resolve(config, list(overrides)), progress_bar)[1]


def _resolve(config, overrides: list[str]) -> Config:
    if isinstance(config, (Config, dict)):
        raw = config.to_dict() if isinstance(config, Config) else config
        return build_config(apply_overrides(raw, overrides), origin="config")
    return load_config(config, overrides)


def _train(cfg: Config, progress_bar: bool) -> tuple[int, dict]:
    t_start = time.time()
    task, specs = prepare(cfg)  # check the data before writing anything: a bad path leaves no run folder behind
    code, signals = EXIT_OK, []

    def train(token: str | None) -> dict:
        nonlocal code, signals
        quiet_ray_env()
        init_ray()
        # After ray.init: Ray's core installs its own SIGTERM handler (which aborts); ours must replace it.
        channel = StopChannel(f"stride-stop-{token}")  # the stop request reaches workers on every node
        signals = install_signal_handlers(cfg.run_dir, also=channel.post)
        try:
            code, summary = train_on_ray(cfg, specs, task.facts, progress_bar=progress_bar, run_lock_token=token,
                                         stop_channel=channel.name)
        finally:
            channel.close()  # now, not by Ray's teardown of the driver (which logs its own failures to stderr)
        return summary

    # The lock is held from before the resume check to after the summary: nothing of this run touches the folder
    # without it.
    summary = lifecycle.train_and_record(cfg, lifecycle.take_run(cfg, task, runlock.launcher_instance()), train,
                                         t_start=t_start, runtime="ray")
    if signals and summary.get("status") in ("preempted", "interrupted"):
        code = 128 + signals[-1]
    if summary["status"] == "failed":  # a completed run whose summary the storage refused
        code = code or EXIT_FAILED
    return code, summary


def main(argv: list[str] | None = None) -> int:
    from stride.trainers.launch.torchrun import under_torchrun

    if under_torchrun():  # `torchrun ... -m stride train`: the gang is torchrun's (trainers/torchrun.py), not Ray's
        from stride.trainers.launch import torchrun

        return torchrun.main(argv)
    args = parse_args(argv)
    try:
        if args.config is None and not args.overrides:
            raise UsageError("--config is required; e.g. --config trainers/configs/char_gpt.yaml")
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return EXIT_OK
        code, summary = _train(cfg, progress_bar=sys.stdout.isatty())
    except StrideError as e:
        error_line(e)
        return e.exit_code
    lifecycle.report_paths(cfg, cfg.run_dir, summary)
    return code


if __name__ == "__main__":
    sys.exit(main())
