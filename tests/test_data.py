"""Prepared data sets and Parquet inspection: the shapes the loop relies on, and clear errors for bad inputs."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, run_cli, run_cli_forked
from stride.errors import DataError
from stride.datasets.frame import Columns
from stride.datasets.stream import eval_stream
from stride.datasets.prepare import stdlib_files
from stride.trainers.config_reader import load_config
from stride.trainers.launch.checks import prepare


def cfg_for(train, val, *extra, base="tabular_mlp.yaml"):
    return load_config(REPO / "trainers/configs" / base, [f"data.train_path={train}", f"data.val_path={val}", *extra])


def concat_columns(parts: list[Columns]) -> Columns:
    """A split's evaluation batches as one set of columns, in order."""
    return Columns({k: np.concatenate([p.data[k] for p in parts]) for k in parts[0].data},
                   np.concatenate([p.sample_id for p in parts]))


def rows_of(task, spec):
    """What the loop feeds the model: the split's columns, through the task's transform."""
    columns = concat_columns(list(eval_stream(spec, 0, 1, spec.num_rows)))
    return columns, task.transform(columns.data)


def test_pystdlib_shape_split_and_ids(text_data):
    files = stdlib_files()
    assert files and not any("/test/" in str(f) or "/tests/" in str(f) for f in files)
    train = pq.ParquetDataset(text_data / "train").read()
    val = pq.ParquetDataset(text_data / "val").read()
    assert len(list((text_data / "train").glob("*.parquet"))) > 1  # sharded
    t = train.schema.field("tokens").type
    assert pa.types.is_fixed_size_list(t) and pa.types.is_integer(t.value_type)
    ids = np.concatenate([train["sample_id"].to_numpy(), val["sample_id"].to_numpy()])
    assert len(np.unique(ids)) == len(ids)
    assert 0 < val.num_rows < 0.1 * train.num_rows
    # Byte-level: one uint8 token per byte (char_gpt's vocab of 256), each row a run of the standard library's own
    # bytes, unchanged (the first and the last row of the training split here).
    assert t.value_type == pa.uint8()
    sources = [f.read_bytes() for f in files]
    for row in (train["tokens"][0], train["tokens"][-1]):
        row = bytes(row.as_py())
        assert any(row in source for source in sources), row[:80]


def test_pystdlib_is_deterministic(tmp_path, text_data):
    r = run_cli(["datasets/prepare.py", "pystdlib", "--out", str(tmp_path / "again")], timeout=120)
    assert r.returncode == 0, r.stderr
    a = pq.ParquetDataset(text_data / "val").read()
    b = pq.ParquetDataset(tmp_path / "again" / "val").read()
    assert a.equals(b)


def test_prepare_never_overwrites(tmp_path):
    out = tmp_path / "t"
    assert run_cli_forked(["datasets/prepare.py", "tabular", "--out", str(out), "--rows", "200"]).returncode == 0
    before = sorted(p.stat().st_mtime_ns for p in out.rglob("*.parquet"))
    r = run_cli_forked(["datasets/prepare.py", "tabular", "--out", str(out), "--rows", "200"])
    assert r.returncode != 0 and "already exists" in r.stderr
    assert sorted(p.stat().st_mtime_ns for p in out.rglob("*.parquet")) == before


def test_prepare_force_replaces_only_a_prepared_set(tmp_path):
    """--force rebuilds a folder prepare.py wrote; a folder with anything else in it (a user's home, their own data)
    is refused, exit 2, with every file left as it was."""
    out = tmp_path / "t"
    assert run_cli_forked(["datasets/prepare.py", "tabular", "--out", str(out), "--rows", "200"]).returncode == 0
    r = run_cli_forked(["datasets/prepare.py", "tabular", "--out", str(out), "--rows", "300", "--force"])
    assert r.returncode == 0, r.stderr
    assert sum(pq.read_metadata(p).num_rows for p in out.rglob("*.parquet")) == 300
    for planted in (out / "notes.txt", out / "train" / "mine.csv"):
        planted.write_text("mine")
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        r = run_cli_forked(["datasets/prepare.py", "tabular", "--out", str(out), "--rows", "200", "--force"])
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("stride: error: --out"), r.stderr
        assert planted.name in r.stderr and "did not write" in r.stderr and "Traceback" not in r.stderr
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
        planted.unlink()
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    r = run_cli_forked(["datasets/prepare.py", "tabular", "--out", str(home), "--rows", "200", "--force"])
    assert r.returncode == 2 and (home / "thesis.tex").read_text() == "years of work"


def test_tabular_inspect_infers_features_and_classes(tabular_data):
    cfg = cfg_for(tabular_data / "train", tabular_data / "val")
    task, specs = prepare(cfg)
    assert task.facts["num_classes"] == 4 and task.facts["label_column"] == "label"
    assert "sample_id" not in task.facts["feature_columns"] and len(task.facts["feature_columns"]) == 16
    columns, batch = rows_of(task, specs["train"])
    assert batch["x"].dtype == np.float32 and batch["x"].shape == (specs["train"].num_rows, 16)
    assert batch["y"].dtype == np.int64
    assert len(np.unique(columns.sample_id)) == len(columns) == specs["train"].num_rows  # every row once
    assert task.build_model()(__import__("torch").from_numpy(batch["x"][:3])).shape == (3, 4)


def test_sample_id_is_optional(tmp_path):
    d = tmp_path / "noid"
    d.mkdir()
    pq.write_table(pa.table({"a": [1.0, 2.0, 3.0, 4.0], "label": [0, 1, 0, 1]}), d / "x.parquet")
    cfg = cfg_for(d, d, "train.batch_size_per_worker=2")
    _, specs = prepare(cfg)
    assert not specs["train"].has_sample_id
    ids = concat_columns(list(eval_stream(specs["train"], 0, 1, 10))).sample_id
    assert ids.tolist() == [0, 1, 2, 3]  # the row's place in file order


def _write(d, **cols):
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), d / "part-0.parquet")
    return d


@pytest.mark.parametrize("case, expect", [
    ("missing", "does not exist"),
    ("empty", "empty folder"),
    ("non_parquet", "holds notes.txt, whose extension is not a data format Stride reads (.csv, .json, .jsonl, .ndjson, .parquet, .pq)"),
    ("corrupt", "not a readable Parquet file"),
    ("no_label", "model.label_column (label) is not a column"),
    ("bad_features", "model.feature_columns (['nope'])"),
    ("string_feature", "not numeric"),
    ("labels_out_of_range", "model.num_classes (2)"),
    ("negative_labels", "has negative labels in data.train_path (min -1); labels must be 0..num_classes-1: relabel them"),
])
def test_bad_inputs_are_usage_errors(tmp_path, case, expect):
    extra = []
    d = tmp_path / case
    if case == "empty":
        d.mkdir()
    elif case == "non_parquet":
        _write(d, a=[1.0], label=[0])
        (d / "notes.txt").write_text("hello")
    elif case == "corrupt":
        _write(d, a=[1.0], label=[0])
        (d / "part-1.parquet").write_bytes(b"PAR1 this is not parquet")
    elif case == "no_label":
        _write(d, a=[1.0], y=[0])
    elif case == "bad_features":
        _write(d, a=[1.0], label=[0])
        extra = ["model.feature_columns=[nope]"]
    elif case == "string_feature":
        _write(d, a=[1.0], s=["x"], label=[0])
        extra = ["model.feature_columns=[a, s]"]
    elif case == "negative_labels":  # the fix is to relabel: no model.num_classes value fixes a negative label
        _write(d, a=[1.0, 2.0, 3.0], label=[-1, 0, 1])
        extra = ["model.num_classes=2"]
    elif case == "labels_out_of_range":
        _write(d, a=[1.0, 2.0, 3.0], label=[0, 1, 5])
        extra = ["model.num_classes=2"]
    cfg = cfg_for(d, d, *extra)
    with pytest.raises(DataError) as e:
        prepare(cfg)
    assert expect in str(e.value) and "\n" not in str(e.value)
    if case == "negative_labels":
        assert "set model.num_classes" not in str(e.value)


def test_text_context_longer_than_rows_is_a_usage_error(text_data):
    cfg = cfg_for(text_data / "train", text_data / "val", "model.context=4096", base="char_gpt.yaml")
    with pytest.raises(DataError, match=r"model.context \(4096\)"):
        prepare(cfg)


def test_missing_data_path_exits_2_before_ray_starts(tmp_path):
    r = run_cli_forked(["trainers/main.py", "--config", "trainers/configs/tabular_mlp.yaml",
                        f"data.train_path={tmp_path}/nope", f"run.storage_path={tmp_path}/runs"], timeout=60)
    assert r.returncode == 2 and "data.train_path" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "runs" / "tabular_mlp").exists()  # checked before anything is written


def test_duplicate_sample_ids_are_refused_and_unique_ones_cost_no_read(tmp_path, monkeypatch):
    import stride.datasets.splits as P

    d = tmp_path / "ok"
    d.mkdir()
    for i in range(3):  # consecutive ids, row groups of 100: the footers prove them unique
        pq.write_table(pa.table({"a": np.zeros(300), "label": np.zeros(300, np.int64),
                                 "sample_id": np.arange(i * 300, (i + 1) * 300)}), d / f"p{i}.parquet",
                       row_group_size=100)
    read, batches = [], P.DataSplit.batches
    monkeypatch.setattr(P.DataSplit, "batches", lambda self, columns=None, rows=65536: read.append(columns) or
                        batches(self, columns, rows))
    prepare(cfg_for(d, d, "train.batch_size_per_worker=2"))
    assert [P.SAMPLE_ID] not in read  # no id column was read to check it
    monkeypatch.undo()

    dup = tmp_path / "dup"
    dup.mkdir()
    ids = np.arange(500)
    ids[400] = 7  # one duplicate, out of order: the footers cannot tell, the column is read
    pq.write_table(pa.table({"a": np.zeros(500), "label": np.zeros(500, np.int64), "sample_id": ids}),
                   dup / "p.parquet", row_group_size=100)
    with pytest.raises(DataError, match=r"data.train_path: sample_id 7 appears 2 times; make sample_id unique"):
        prepare(cfg_for(dup, d, "train.batch_size_per_worker=2"))


def test_frame_hands_the_task_the_same_values_as_pyarrow():
    """What a transform gets must be each column's own values, whatever its type (nulls, lists, strings, booleans),
    after slicing, gathering and concatenating; and a window's Arrow gather (stream.cut_window) must agree."""
    from stride.datasets.order import Order
    from stride.datasets.stream import cut_window
    from stride.datasets.frame import Frame
    from stride.datasets.frame import column_to_numpy

    n = 50
    table = pa.table({
        "a": pa.array(np.arange(n, dtype=np.float32)),
        "b": pa.array(np.arange(n, dtype=np.float32) * -2),
        "k": pa.array(np.arange(n, dtype=np.int64) * 3),
        "nulls": pa.array([None if i % 7 == 0 else float(i) for i in range(n)], pa.float32()),
        "flag": pa.array([i % 2 == 0 for i in range(n)]),
        "vec": pa.array([[i, i + 1, i + 2] for i in range(n)], pa.list_(pa.int32(), 3)),
        "text": pa.array([f"row {i}" for i in range(n)]),
    })
    names = table.column_names
    frame = Frame.from_table(table, names, np.arange(n, dtype=np.int64))
    index = np.random.default_rng(0).permutation(n)[:30]
    got = Frame.concat([frame.slice(0, 20), frame.slice(20, n)]).take(index).columns(5, 25)
    assert list(got.sample_id) == list(index[5:25])
    for c in names:
        want = column_to_numpy(table.column(c))[index[5:25]]
        assert got.data[c].dtype == want.dtype and got.data[c].shape == want.shape, c
        assert np.array_equal(got.data[c], want, equal_nan=want.dtype.kind == "f"), c

    # The same rows gathered by a window's cut over both blocks (positions 5..44 of it, as a rank keeps them).
    plan = Order((20, 30), seed=3, global_micro_batch=10, window_rows=50).epoch(0)
    blocks = [table.slice(0, 20).append_column("sample_id", pa.array(np.arange(20))),
              table.slice(20, 30).append_column("sample_id", pa.array(np.arange(20, 50)))]
    blocks = [blocks[b] for b in plan.blocks]
    positions = np.arange(5, 45)
    cut = cut_window(plan, 0, positions, blocks).columns()
    rows = np.concatenate([[np.arange(20), np.arange(20, 50)][b] for b in plan.blocks])  # file order -> sequence
    want_ids = rows[plan.window_permutation(0)[positions]]
    assert list(cut.sample_id) == list(want_ids)
    for c in names:
        want = column_to_numpy(table.column(c))[want_ids]
        assert cut.data[c].dtype == want.dtype, c
        assert np.array_equal(cut.data[c], want, equal_nan=want.dtype.kind == "f"), c

    # Parts typed differently (nulls in one of them only, an empty one): concatenated column by column.
    clean, holes = table.slice(0, 25), table.slice(25, 25)
    holes = holes.set_column(0, "a", pa.array([None] + list(range(26, 50)), pa.float32()))
    holes = holes.set_column(2, "k", pa.array([None] + list(range(1, 25)), pa.int64()))
    frames = [Frame.from_table(t, names, np.arange(len(t), dtype=np.int64)) for t in (clean, holes, table.slice(0, 0))]
    got = Frame.concat(frames).columns()
    for c in names:
        want = np.concatenate([column_to_numpy(t.column(c)) for t in (clean, holes)])
        assert np.array_equal(got.data[c], want, equal_nan=want.dtype.kind == "f"), c
    assert np.isnan(got.data["a"][25]) and got.data["k"].dtype == np.float64 and np.isnan(got.data["k"][25])


def test_micro_batches_of_a_window_are_its_consecutive_slices():
    """The stream's micro-batches (Frame.batches) hold the same values as slicing every column, for columns of any
    shape and type, and for a frame without task columns (a task that reads only sample ids)."""
    from stride.datasets.frame import Frame

    n, per = 24, 6
    table = pa.table({"x": pa.array(np.arange(n, dtype=np.float32)),
                      "vec": pa.array([[i, -i] for i in range(n)], pa.list_(pa.int64(), 2)),
                      "text": pa.array([f"row {i}" for i in range(n)])})
    frame = Frame.from_table(table, table.column_names, np.arange(100, 100 + n, dtype=np.int64))
    batches = list(frame.batches(per))
    assert len(batches) == n // per
    for b, got in enumerate(batches):
        want = frame.columns(b * per, (b + 1) * per)
        assert list(got.sample_id) == list(want.sample_id) and list(got.data) == list(want.data)
        for c in want.data:
            assert got.data[c].shape == want.data[c].shape and np.array_equal(got.data[c], want.data[c]), c
    ids_only = [b.sample_id.tolist() for b in Frame((), (), np.arange(n, dtype=np.int64)).batches(per)]
    assert ids_only == [list(range(lo, lo + per)) for lo in range(0, n, per)]


def test_a_column_a_transform_passes_through_becomes_a_tensor_of_its_own():
    """Window columns are read-only views of Arrow memory; the tensor the loop makes of one is a writable copy."""
    import warnings

    import torch

    from stride.trainers.loop import to_device

    col = pa.array(np.arange(4, dtype=np.float32)).to_numpy()
    assert not col.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about (and aliases) a non-writable array
        t = to_device({"y": col}, torch.device("cpu"), "mlp")["y"]
    t += 1
    assert col.tolist() == [0, 1, 2, 3] and t.tolist() == [1, 2, 3, 4]
