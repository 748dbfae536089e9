"""The Ray side of `benchmarks/run.py` that needs its own driver: ingest and 1-vs-2-worker scaling.

    python benchmarks/ray_bench.py <spec.json> <result.json>

Started by run.py as one subprocess (its own process tree, an embedded Ray like `trainers/main.py` starts:
stride.ray_cluster.connect.init_ray), so several measurements share one `ray.init()` and one Ray Data read:

* ingest: the driver checks each Parquet set against its task (stride.trainers.driver.prepare: the task's inspect,
  the columns it reads) and reads it with Stride's own `stride.trainers.driver.read_datasets`; then ONE worker (a
  TorchTrainer with the DataConfig Stride's build_trainer uses: datasets_to_split=[], preserve_order) takes turns,
  `passes` times, between (a) Stride's worker-side path, the same calls as trainers/ray_worker.py
  train_loop_per_worker.load_split (get_dataset_shard -> iter_batches(batch_size=None, batch_format="pyarrow",
  prefetch_batches=2) -> pa.concat_tables -> datasets.parquet.table_to_columns), (b) pyarrow reading the same
  files in that same process (datasets.parquet.read_local -> table_to_columns, the torchrun path) and (c) a torch
  DataLoader over the same files (one file per item, num_workers=0, each file through table_to_columns, then the
  columns concatenated and put in sample_id order). Same process, same CPU reservation, side by side: the ratio
  is not skewed by where each reader runs. (The task's per-batch transform is not part of any of the three.)
* scaling: fits of Stride's own trainer (stride.trainers.driver.build_trainer, the real loop) with 1 (and, with
  "workers": [1, 2], 2) workers at the same per-worker batch, alternating, on the data read once; throughput from
  each run's metrics.jsonl.
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
    """Runs on the single Ray Train worker: alternate the three readers, `passes` times, per data set."""
    import pyarrow as pa
    import ray.train
    import torch

    from stride.datasets.parquet import Columns, read_local, table_to_columns

    class Files(torch.utils.data.Dataset):
        def __init__(self, spec):
            self.spec = spec

        def __len__(self):
            return len(self.spec.files)

        def __getitem__(self, i):
            import pyarrow.parquet as pq

            t = pq.read_table(self.spec.files[i], columns=list(self.spec.columns))
            c = table_to_columns(t, self.spec)
            return c.data, c.sample_id

    def collate(items):
        return items

    def stride_path(name, spec):  # == trainers/ray_worker.py train_loop_per_worker.load_split
        shard = ray.train.get_dataset_shard(name)
        batches = [b for b in shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2)]
        table = pa.concat_tables(batches)
        return table_to_columns(table, spec)

    def pyarrow_path(name, spec):
        return table_to_columns(read_local(spec), spec)

    def dataloader_path(name, spec):
        import numpy as np

        parts = list(torch.utils.data.DataLoader(Files(spec), batch_size=None, num_workers=0, collate_fn=None))
        ids = np.concatenate([p[1] for p in parts])
        order = np.argsort(ids, kind="stable")
        return Columns({c: np.concatenate([p[0][c] for p in parts])[order] for c in parts[0][0]}, ids[order])

    out: dict = {"threads": {"torch": torch.get_num_threads(), "pyarrow": pa.cpu_count(),
                             "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}}
    for name, spec in config["specs"].items():
        runs: dict[str, list[float]] = {"stride": [], "pyarrow": [], "dataloader": []}
        for p in range(config["passes"]):
            # Rotate the order so that no reader always goes first (a warm cache, a quiet moment).
            order = [("stride", stride_path), ("pyarrow", pyarrow_path), ("dataloader", dataloader_path)]
            order = order[p % 3:] + order[:p % 3]
            for label, fn in order:
                t0 = time.perf_counter()
                result = fn(name, spec)
                dt = time.perf_counter() - t0
                n = len(result)
                assert n == spec.num_rows, f"{label} read {n} rows of {spec.num_rows}"
                runs[label].append(dt)
                del result
        out[name] = {"rows": spec.num_rows, "seconds": runs}
    return out


def ingest(spec: dict, storage: Path, cache: dict) -> dict:
    import ray.data
    from ray.train import DataConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from stride.trainers.config import load_config
    from stride.trainers.driver import prepare, read_datasets

    specs, driver_read_s = {}, {}
    datasets = {}
    for name, d in spec["ingest_sets"].items():
        cfg = load_config(d["config"], d["overrides"])
        specs[name] = prepare(cfg)[1]["train"]  # the task's checks and the columns it reads, as the driver does
        driver_read_s[name] = []
        for _ in range(d.get("reads", 1)):  # the driver's read, as trainers/main.py does it before the gang starts
            t0 = time.perf_counter()
            datasets[name] = read_datasets({"train": specs[name]})["train"]
            driver_read_s[name].append(time.perf_counter() - t0)
        cache[specs[name]] = datasets[name]  # the scaling fits reuse the default job's data (one read)
    trainer = TorchTrainer(
        ingest_loop,
        train_loop_config={"specs": specs, "passes": spec["passes"]},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1.0}),
        run_config=RunConfig(name="ingest", storage_path=str(storage)),
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=[], execution_options=ray.data.ExecutionOptions(preserve_order=True)),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    out = dict(result.return_value)
    out["fit_s"] = time.perf_counter() - t0
    out["driver_read_s"] = driver_read_s
    out["files"] = {name: [str(f) for f in s.files] for name, s in specs.items()}
    return out


def scaling(spec: dict, storage: Path, cache: dict) -> dict:
    from stride.trainers.config import load_config
    from stride.trainers.driver import build_trainer, prepare, read_datasets

    base = load_config(spec["config"], spec["overrides"])
    task, all_specs = prepare(base)
    specs = {"train": all_specs["train"]}
    datasets = {"train": cache[specs["train"]]} if specs["train"] in cache else read_datasets(specs)
    runs = []
    for rep in range(spec["reps"]):
        workers_list = spec.get("workers", [1, 2])
        for workers in (workers_list if rep % 2 == 0 else workers_list[::-1]):
            name = f"scale_w{workers}_r{rep}"
            cfg = load_config(spec["config"], spec["overrides"] + [
                f"run.name={name}", f"run.storage_path={storage}", f"scaling.num_workers={workers}"])
            trainer, plan, _ = build_trainer(cfg, specs, task.facts, datasets)
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
    cache: dict = {}
    if spec.get("ingest_sets"):
        out["ingest"] = ingest(spec, storage / "ingest", cache)
    out["scaling"] = scaling(spec["scaling"], storage / "scaling", cache)
    out_path.write_text(json.dumps(out, indent=1, default=str))
    import ray

    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
