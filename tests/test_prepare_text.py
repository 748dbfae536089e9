"""`prepare.py text`: a user's .txt/.jsonl files -> tokenised Parquet rows (bytes or a locally trained BPE), and
char_gpt training and generating on them with that tokenizer.

The pure functions (file listing, split, reading, tokenising, packing) run here without Ray, through
build_text(engine="local"), which applies the same per-batch functions Ray Data maps. Everything that runs
prepare.py's Ray Data path (an embedded Ray) is marked slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, run_cli, run_cli_forked
from runs import OVERLAY
from stride.datasets import prepare as P
from stride.errors import DataError
from stride.trainers.config_reader import load_config
from stride.trainers.launch.checks import prepare as inspect_data

WORDS = ("the", "model", "reads", "text", "and", "learns", "which", "token", "comes", "next", "héllo", "wörld",
         "données", "ÿ", "✓", "数据", "def", "return", "(x)", "\t", "  ")


def write_corpus(root: Path, seed: int = 0) -> Path:
    """Nine .txt files (some nested) and one .jsonl, plus files that are not text input (left out)."""
    rng = np.random.default_rng(seed)

    def text(n):
        words = rng.choice(len(WORDS), size=n)
        lines = [" ".join(WORDS[w] for w in words[i:i + 12]) for i in range(0, n, 12)]
        return "\n".join(lines) + "\n"

    for i in range(9):
        p = root / ("sub" if i % 3 == 0 else "") / f"doc{i}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"file {i}\n" + text(900))
    with open(root / "notes.jsonl", "w") as f:
        for i in range(120):
            f.write(json.dumps({"id": i, "text": f"note {i}: " + text(int(rng.integers(5, 60)))}) + "\n")
            if i == 50:
                f.write("\n")  # blank lines are skipped
    (root / "README.md").write_text("not input")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("hidden folders are left out")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def build(tmp_path: Path, corpus: Path, name: str, tokenizer: str = "bytes", **kw) -> tuple[Path, dict]:
    """build_text without Ray, into a fresh folder."""
    args = dict(vocab_size=300, seq_len=33, val_fraction=0.2, shards=3, text_field="text") | kw
    out = tmp_path / name
    out.mkdir()
    return out, P.build_text(out, str(corpus), tokenizer, engine="local", **args)


def read(out: Path, split: str) -> pa.Table:
    return pq.ParquetDataset(out / split).read()


def same_data(a: Path, b: Path) -> bool:
    names = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    return names(a) == names(b) and all(
        read(a, s).equals(read(b, s)) for s in ("train", "val")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names(a) if not n.endswith(".parquet"))


def split_texts(corpus: Path, val_fraction: float = 0.2) -> dict[str, list[str]]:
    """Each split's documents in corpus order, as the spec says they are."""
    files, names = P.text_files(str(corpus))
    out: dict[str, list[str]] = {"train": [], "val": []}
    for f, split in zip(files, P.assign_splits(names, val_fraction)):
        out[split] += [t for _, t in P.read_documents(f, "text")]
    return out


# ---- pure functions: no Ray ----


def test_input_files_are_sorted_text_files_named_relative_to_the_input(corpus):
    files, names = P.text_files(str(corpus))
    assert names == sorted(names) and "notes.jsonl" in names and "sub/doc0.txt" in names
    assert not any(n.endswith(".md") or n.startswith(".hidden") for n in names)
    assert all(Path(f).is_absolute() and Path(f).is_file() for f in files) and len(files) == 10
    # A glob names files relative to its fixed prefix: the same names, the same split.
    _, glob_names = P.text_files(str(corpus) + "/**/*.txt")
    assert glob_names == [n for n in names if n.endswith(".txt")]
    assert P.text_files(str(corpus / "notes.jsonl"))[1] == ["notes.jsonl"]


def test_split_is_by_file_deterministic_and_never_leaves_a_split_empty():
    names = [f"f{i}.txt" for i in range(50)]
    splits = P.assign_splits(names, 0.2)
    assert splits == P.assign_splits(names, 0.2) == [P.split_of(n, 0.2) for n in names]
    assert 0 < splits.count("val") < 25
    assert P.assign_splits(["a.txt", "b.txt"], 0.01).count("val") == 1  # the hash alone put none in val
    assert P.assign_splits(["a.txt", "b.txt"], 0.99).count("train") == 1
    assert P.assign_splits(["a.txt", "b.txt"], 0.0) == ["train", "train"]
    # One file: its tail goes to val (lines of a .jsonl, text cut at a line break for a .txt).
    docs = [(i, f"line {i}") for i in range(10)]
    assert [s for _, _, s in P.split_single_file(docs, 0.2)] == ["train"] * 8 + ["val"] * 2
    (_, head, s1), (_, tail, s2) = P.split_single_file([(0, "a\nb\nc\nd\ne\n")], 0.3)
    assert (s1, s2) == ("train", "val") and head + tail == "a\nb\nc\nd\ne\n" and head.endswith("\n") and tail


def test_jsonl_lines_take_the_text_field_and_bad_lines_are_named(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "one"}\n\n{"text": "two", "x": 1}\n')
    assert P.read_documents(str(p), "text") == [(1, "one"), (3, "two")]
    p.write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(P.PrepareError, match=r"a\.jsonl:2: no 'text' field \(found \['body'\]\); pass --text-field"):
        P.read_documents(str(p), "text")
    p.write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(P.PrepareError, match=r"a\.jsonl:2: not a JSON line"):
        P.read_documents(str(p), "text")
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(P.PrepareError, match="not UTF-8"):
        P.read_documents(str(p), "text")


def test_bytes_rows_are_the_split_texts_in_file_order(tmp_path, corpus):
    out, counts = build(tmp_path, corpus, "bytes")
    texts = split_texts(corpus)
    assert counts["vocab_size"] == 256 and not (out / "tokenizer.json").exists()
    next_id = 0
    for split in ("train", "val"):
        t = read(out, split)
        typ = t.schema.field("tokens").type
        assert pa.types.is_fixed_size_list(typ) and typ.value_type == pa.uint8() and typ.list_size == 33
        assert t.schema.field("sample_id").type == pa.int64()
        assert t["sample_id"].to_pylist() == list(range(next_id, next_id + t.num_rows))  # in file order
        next_id += t.num_rows
        stream = "".join(d if d.endswith("\n") else d + "\n" for d in texts[split]).encode()
        assert t.num_rows == len(stream) // 33 == counts[split] > 0
        assert np.asarray(t["tokens"].combine_chunks().flatten()).tobytes() == stream[: t.num_rows * 33]
    assert len(list((out / "train").glob("*.parquet"))) == 3


def test_bpe_rows_tokenizer_round_trip_and_determinism(tmp_path, corpus):
    out, counts = build(tmp_path, corpus, "bpe", "bpe")
    again, _ = build(tmp_path, corpus, "bpe_again", "bpe")
    assert same_data(out, again)  # same rows, ids and tokenizer.json
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == counts["vocab_size"] == 300 and tok.token_to_id(P.EOS) == 0
    texts = split_texts(corpus)
    for sample in (texts["train"][0], texts["val"][-1], "héllo wörld ✓ 数据\n\tdef f(x):  return x\r\n"):
        assert tok.decode(tok.encode(sample).ids) == sample
    t = read(out, "train")
    assert t.schema.field("tokens").type.value_type == pa.uint16() and t.num_rows == counts["train"]
    ids = np.asarray(t["tokens"].combine_chunks().flatten())
    assert ids.max() < 300
    # The train rows are the train documents' ids, each document followed by <|endoftext|>.
    expect = np.concatenate([np.array(tok.encode(d).ids + [0]) for d in texts["train"]])[: ids.size]
    assert np.array_equal(ids, expect)
    assert tok.decode(ids[:200].tolist()) in "".join(texts["train"])
    assert read(out, "val").num_rows == counts["val"] > 0
    # Trained on the training documents only, in corpus order.
    assert P.train_bpe(texts["train"], 300).to_str() == (out / "tokenizer.json").read_text()
    assert P.train_bpe(texts["train"] + texts["val"], 300).to_str() != (out / "tokenizer.json").read_text()


def test_jsonl_field_and_empty_input_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("x" * 100)
    (src / "b.jsonl").write_text('{"text": "fine"}\n{"content": "no text key"}\n')
    with pytest.raises(P.PrepareError, match=r"b\.jsonl:2: no 'text' field"):
        build(tmp_path, src, "o1")
    (src / "b.jsonl").write_text('{"content": "fine"}\n')
    with pytest.raises(P.PrepareError, match="no 'text' field"):
        build(tmp_path, src, "o2")
    build(tmp_path, src, "o3", text_field="content", seq_len=8)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("")
    with pytest.raises(P.PrepareError, match="holds no text"):
        build(tmp_path, empty, "o4")
    with pytest.raises(P.PrepareError, match="no training text"):
        build(tmp_path, empty, "o5", tokenizer="bpe")
    with pytest.raises(P.PrepareError, match="fewer than one row of --seq-len 1000"):
        build(tmp_path, src, "o6", text_field="content", seq_len=1000)


@pytest.mark.parametrize("args, message", [
    (["--input", "{tmp}/nothing/*.txt"], "matches no files"),
    (["--input", "{tmp}/src", "--seq-len", "1"], "--seq-len (1) must be at least 2"),
    (["--input", "{tmp}/src", "--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size (100) must be 257-65536"),
    (["--input", "{tmp}/src", "--vocab-size", "1000"], "is for --tokenizer bpe"),
    (["--input", "{tmp}/src", "--val-fraction", "1"], "--val-fraction (1.0) must be in [0, 1)"),
    (["--input", "{tmp}/src/a.md"], "neither .txt nor .jsonl"),
    (["--input", "{tmp}/nosuch"], "matches no files"),
    (["--input", "{tmp}/empty_dir"], "holds no .txt or .jsonl files"),
    (["--input", "{tmp}/src", "--out", "{tmp}/existing"], "already exists"),
])
def test_bad_arguments_exit_2_with_one_line_before_ray_starts(tmp_path, args, message):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text")
    (tmp_path / "src" / "a.md").write_text("not text input")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "keep").write_text("mine")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    r = run_cli_forked(["datasets/prepare.py", "text", *args], timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("stride: error: ") and message in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and (tmp_path / "existing" / "keep").read_text() == "mine"


def test_char_gpt_finds_the_tokenizer_and_checks_vocab_size(tmp_path, corpus):
    out, counts = build(tmp_path, corpus, "bpe", "bpe")
    paths = [f"data.train_path={out}/train", f"data.val_path={out}/val", "model.context=32"]
    cfg = load_config(REPO / "trainers/configs/char_gpt.yaml", paths)
    with pytest.raises(DataError, match=r"model\.vocab_size \(256\) is smaller than the 300 tokens .* use model\.vocab_size=300"):
        inspect_data(cfg)
    task, _ = inspect_data(load_config(REPO / "trainers/configs/char_gpt.yaml", [*paths, "model.vocab_size=300"]))
    f = task.facts
    assert f["tokenizer"] == (out / "tokenizer.json").read_text() and f["tokenizer_vocab_size"] == 300
    assert len(f["tokenizer_sha256"]) == 64
    # Generation encodes the prompt and decodes with the tokenizer (an untrained model: any text after it).
    import torch

    from stride.trainers.tasks import make_task

    rebuilt = make_task(load_config(REPO / "trainers/configs/char_gpt.yaml", [*paths, "model.vocab_size=300"]),
                        json.loads(json.dumps(f)))  # as generate.py gets them from summary.json
    torch.manual_seed(0)
    text = rebuilt.generate(rebuilt.build_model().eval(), "the model ", 10, 0.8)
    assert text.startswith("the model ") and len(text) > len("the model ")
    # Without tokenizer.json, uint16 ids beyond model.vocab_size are found from the Parquet footers.
    (out / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"token ids reach \d+ but model\.vocab_size is 256 and no tokenizer\.json"):
        inspect_data(cfg)


def test_char_gpt_on_bytes_is_unchanged(tmp_path, corpus):
    out, _ = build(tmp_path, corpus, "bytes")
    cfg = load_config(REPO / "trainers/configs/char_gpt.yaml",
                      [f"data.train_path={out}/train", f"data.val_path={out}/val", "model.context=32"])
    task, _ = inspect_data(cfg)
    assert task.facts == {} and task.tokenizer is None
    import torch

    torch.manual_seed(0)
    assert task.generate(task.build_model().eval(), "def ", 5, 0.8).startswith("def ")


# ---- prepare.py on Ray Data ----


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory, corpus, shared_ray_head) -> Path:
    """prepare.py on Ray Data (the shared head)."""
    out = tmp_path_factory.mktemp("prepared") / "bpe"
    r = run_cli(["datasets/prepare.py", "text", "--input", str(corpus), "--out", str(out), "--tokenizer", "bpe",
                 "--vocab-size", "300", "--seq-len", "33", "--val-fraction", "0.2", "--shards", "3"], timeout=300,
                env=shared_ray_head.env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert not shared_ray_head.wait_idle()
    assert "train rows" in r.stdout and "model.vocab_size=300" in r.stdout, r.stdout
    return out


@pytest.mark.slow
def test_ray_prepare_matches_the_local_functions(tmp_path, corpus, bpe_data):
    """What Ray Data wrote is, shard for shard and row for row, what the local functions write from the same corpus:
    the local path's output is a function of the corpus and the options, so the Ray path's is too (a second Ray run
    for determinism alone would prove no more than this equality)."""
    local, _ = build(tmp_path, corpus, "local", tokenizer="bpe")
    assert same_data(bpe_data, local)


@pytest.mark.slow
def test_ray_prepare_of_a_bad_jsonl_line_ends_in_one_line_and_writes_nothing(tmp_path, corpus, ray_cluster):
    """The line is found by a Ray Data task: its error reaches the command as one line, exit 2. (The bytes tokenizer
    on Ray is the BPE run's encode step without a tokenizer: its output is the local path's, tested above.)"""
    bad = tmp_path / "bad"
    shutil.copytree(corpus, bad)
    with open(bad / "notes.jsonl", "a") as f:
        f.write('{"id": 999}\n')
    r = run_cli(["datasets/prepare.py", "text", "--input", str(bad), "--out", str(tmp_path / "out")], timeout=300,
                env=ray_cluster)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("stride: error:")]
    assert len(errors) == 1 and "notes.jsonl:122: no 'text' field" in errors[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.slow
def test_char_gpt_trains_on_bpe_data_and_generates_text(tmp_path, bpe_data):
    """prepare (BPE, on Ray Data) -> char_gpt under torchrun.py (one process) -> generate.py with only the run folder."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(bpe_data / "tokenizer.json")).get_vocab_size()
    assert vocab == 300
    data = tmp_path / "data"
    shutil.copytree(bpe_data, data)
    r = run_cli_forked([str(REPO / "trainers" / "torchrun.py"), "--config", str(REPO / "trainers/configs/char_gpt.yaml"),
                 f"data.train_path={data}/train", f"data.val_path={data}/val", f"run.storage_path={tmp_path}/runs",
                 "run.name=bpe", *OVERLAY, f"model.vocab_size={vocab}", "model.context=32",
                 "model.n_layers=1", "model.width=32", "model.n_heads=2", "train.max_steps=30",
                 "train.batch_size_per_worker=16", "train.eval_every_steps=30", "train.log_every_steps=10",
                 "checkpoint.every_steps=30", "optim.warmup_steps=5"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "bpe"
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "completed" and s["facts"]["tokenizer_vocab_size"] == 300
    assert s["val_loss"] < s["initial_val_loss"], s
    shutil.rmtree(data)  # generation needs only the run folder: the tokenizer travels in the facts
    g = run_cli_forked(["-m", "stride", "generate", "--run", str(run), "--prompt", "the model ", "--tokens", "40"],
                timeout=120)
    assert g.returncode == 0, g.stderr[-3000:]
    assert g.stdout.startswith("the model ") and len(g.stdout) > len("the model ") + 20, g.stdout
