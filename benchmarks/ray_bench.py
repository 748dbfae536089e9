"""The Ray side of `benchmarks/run.py` that needs its own driver: ingest and 1-vs-2-worker scaling.

    python benchmarks/ray_bench.py <spec.json> <result.json>

Started by run.py as one subprocess (its own process tree, an embedded Ray like `trainers/main.py` starts:
stride.ray_cluster.connect.init_ray), so several measurements share one `ray.init()`:

* ingest: the driver checks each Parquet set against its task (stride.trainers.launch.ray.prepare: the task's inspect,
  the columns it reads); then ONE Ray Train worker takes turns, `passes` times, between (a) Stride's streaming path
  end to end from the files, the one the loop uses (datasets/stream.py TrainStream: row groups in the epoch's
  order, shuffled in windows, read ahead by READ_THREADS threads, cut into micro-batches of numpy arrays) and (b)
  pyarrow reading the same files in that same process (pq.read_table of each file, the columns as numpy arrays, no
  shuffle) with as many threads: Ray sets OMP_NUM_THREADS=1 in its workers, which Arrow's pool follows, so the pool
  is set to READ_THREADS. Same process, same CPU reservation, side by side, nothing pre-loaded. (The task's
  per-batch transform is not part of either.) A JSON Lines set is read the same way, its baseline being
  pyarrow.json.read_json of each file (the task's columns, in the split's types, as Stride's reader parses them);
  its layout (the line index, datasets/index.py) is made on the driver by `prepare`, before any timing, as the
  Parquet footers are read there.
* scaling: fits of Stride's own trainer (stride.trainers.launch.ray.build_trainer, the real loop) with 1 and 2 workers
  at the same per-worker batch, alternating within each repetition; benchmarks/run.py reads each run's
  metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
sys.path.insert(0, str(REPO))


def ingest_loop(config: dict) -> dict:
    """Runs on the single Ray Train worker: alternate the two readers, `passes` times, per data set."""
    import pyarrow as pa
    import pyarrow.json as pj
    import pyarrow.parquet as pq
    import torch

    from stride.datasets.order import Order
    from stride.datasets.frame import column_to_numpy
    from stride.datasets.stream import READ_THREADS, TrainStream

    pa.set_cpu_count(READ_THREADS)  # pyarrow gets the stream's threads (the worker's OMP_NUM_THREADS=1 gave it one)

    def stride_path(spec, cfg) -> int:  # one epoch of the loop's stream, one worker
        order = Order(tuple(n for _, _, n in spec.blocks), 0, cfg["batch"], cfg["window"])
        stream = TrainStream(spec, order, 0, 1, 0, cfg["read_ahead"], end_micro_step=order.micro_steps_per_epoch)
        try:
            return sum(len(stream.next()) for _ in range(order.micro_steps_per_epoch))
        finally:
            stream.close()

    def read_file(spec, f: str) -> pa.Table:
        if spec.layouts[0].format == "jsonl":  # the task's columns only, in the types Stride's reader gives them
            schema = pa.schema([spec.layouts[0].schema.field(c) for c in spec.columns])
            return pj.read_json(f, parse_options=pj.ParseOptions(explicit_schema=schema,
                                                                 unexpected_field_behavior="ignore"))
        return pq.read_table(f, columns=list(spec.columns))

    def pyarrow_path(spec, cfg) -> int:
        rows = 0
        for f in spec.files:
            table = read_file(spec, f)
            rows += len([column_to_numpy(table.column(c)) for c in table.column_names][0])
        return rows

    out: dict = {"threads": {"torch": torch.get_num_threads(), "pyarrow": pa.cpu_count(),
                             "pyarrow_io": pa.io_thread_count(),  # Arrow's I/O pool: the same for both sides
                             "stream_read_threads": READ_THREADS, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
                 "sets": {}}
    for name, spec in config["specs"].items():
        runs: dict[str, list[float]] = {"stride": [], "pyarrow": []}
        rows = {}
        for p in range(config["passes"]):
            # Alternate which reader goes first (a warm cache, a quiet moment).
            order = [("stride", stride_path), ("pyarrow", pyarrow_path)][::1 if p % 2 == 0 else -1]
            for label, fn in order:
                t0 = time.perf_counter()
                rows[label] = fn(spec, config["settings"][name])
                runs[label].append(time.perf_counter() - t0)
        out["sets"][name] = {"rows": rows, "seconds": runs}
    return out


def ingest(spec: dict, storage: Path) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from stride.datasets.splits import cache_folder, open_split
    from stride import load_config
    from stride.trainers.launch.checks import prepare

    specs, settings, driver = {}, {}, {}
    for name, d in spec["ingest_sets"].items():
        cfg = load_config(d["config"], d["overrides"])
        # Not timed with the readers: the files' layouts (Parquet footers; a text file's line index, made and cached
        # here), then the task's checks and the columns it reads, as the driver does.
        t0 = time.perf_counter()
        open_split(cfg.data, "train", cache_folder(cfg))
        t1 = time.perf_counter()
        specs[name] = prepare(cfg)[1]["train"]
        driver[name] = {"layout_s": t1 - t0, "prepare_s": time.perf_counter() - t1}
        settings[name] = {"batch": cfg.train.batch_size_per_worker, "window": cfg.data.shuffle_window_rows,
                          "read_ahead": cfg.data.read_ahead_windows}  # each set read as its own config reads it
    trainer = TorchTrainer(
        ingest_loop,
        train_loop_config={"specs": specs, "passes": spec["passes"], "settings": settings},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1.0}),
        run_config=RunConfig(name="ingest", storage_path=str(storage)),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    out = dict(result.return_value)
    out["fit_s"] = time.perf_counter() - t0
    for name, s in specs.items():
        out["sets"][name]["files"] = [str(f) for f in s.files]
        out["sets"][name]["format"] = s.layouts[0].format
        out["sets"][name]["driver"] = driver[name]
    return out


def scaling(spec: dict, storage: Path) -> dict:
    from stride import load_config
    from stride.trainers.launch.ray import build_trainer
    from stride.trainers.launch.checks import prepare

    base = load_config(spec["config"], spec["overrides"])
    task, all_specs = prepare(base)
    specs = {"train": all_specs["train"]}
    runs = []
    for rep in range(spec["reps"]):
        workers_list = spec["workers"]
        for workers in (workers_list if rep % 2 == 0 else workers_list[::-1]):
            name = f"scale_w{workers}_r{rep}"
            cfg = load_config(spec["config"], spec["overrides"] + [
                f"run.name={name}", f"run.storage_path={storage}", f"scaling.num_workers={workers}"])
            trainer, plan, _ = build_trainer(cfg, specs, task.facts)
            t0 = time.perf_counter()
            result = trainer.fit()
            runs.append({"rep": rep, "workers": workers, "fit_s": time.perf_counter() - t0,
                         "run_dir": plan.run_dir, "summary": result.return_value,
                         "loadavg": os.getloadavg()})
    return {"runs": runs}


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(argv) != 2:
        print("usage: python benchmarks/ray_bench.py <spec.json> <result.json> (benchmarks/run.py writes the spec)",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    out_path = Path(argv[1])
    storage = Path(spec["storage"])
    storage.mkdir(parents=True, exist_ok=True)

    from stride.ray_cluster.connect import init_ray, quiet_ray_env

    quiet_ray_env()
    t0 = time.perf_counter()
    init_ray(log_to_driver=spec.get("log_to_driver", True))
    out: dict = {"ray_init_s": time.perf_counter() - t0}
    if spec.get("ingest_sets"):
        out["ingest"] = ingest(spec, storage / "ingest")
    if spec.get("scaling"):  # absent: `run.py --only ingest`
        out["scaling"] = scaling(spec["scaling"], storage / "scaling")
    out_path.write_text(json.dumps(out, indent=1, default=str))
    import ray

    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
