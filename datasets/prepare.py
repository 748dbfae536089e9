"""Build Stride's data sets as sharded Parquet. Nothing is downloaded.

    python datasets/prepare.py pystdlib --out data/pystdlib
    python datasets/prepare.py tabular --out data/tabular --rows 20000 --features 16 --classes 4 --seed 0
    python datasets/prepare.py text --input my_corpus/ --out data/mytext --tokenizer bpe --vocab-size 4096

pystdlib: the running Python's standard library `.py` files (test folders left out) as bytes (vocab 256),
cut into fixed-length sequences, split into train/val by file, `tokens` (fixed-size list of uint8) + `sample_id`.
tabular: a synthetic classification task that is not linearly separable (classes are unions of Gaussian
clusters, plus distractor features), numeric `f0..fN`, `label`, `sample_id`.
text: your own .txt / .jsonl files (a folder, searched recursively, or a glob), read and tokenised in parallel by
Ray Data (an embedded local Ray, or the cluster at RAY_ADDRESS: its nodes must see the input paths), with the
byte tokenizer (ids 0-255, uint8) or a byte-level BPE trained here on the training files (`out/tokenizer.json`,
uint16). A .txt file is one document, a .jsonl line one document (its --text-field). Each split's documents are
joined in file order (a newline after each byte document, <|endoftext|> after each BPE one) and cut into rows of
--seq-len tokens. Files go wholly to train or val by a hash of their path (as pystdlib); a single input file is
split instead by its last --val-fraction (of its lines for .jsonl, of its text for .txt). The same input gives
the same rows, ids and tokenizer on every run. char_gpt finds out/tokenizer.json and generates with it.
An existing output folder is never overwritten: the data are written next to it and renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file from a checkout: import Stride as the `stride` package (stride/_checkout.py)
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "stride" / "_checkout.py"))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from stride.cli import ArgumentParser, error_line  # noqa: E402

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if any(part in SKIP_DIRS or part.startswith("test") for part in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        files.append(p)
    return files


def unit_hash(name: str) -> float:
    """A name's place in [0, 1): sha256, so stable across machines and Python builds."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") / 2**64


def split_of(name: str, val_fraction: float) -> str:
    """Deterministic train/val assignment by file name (stable across machines and Python builds)."""
    return "val" if unit_hash(name) < val_fraction else "train"


ROW_GROUP_ROWS = 4096


def write_shards(table: pa.Table, out: Path, num_shards: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, table.num_rows, num_shards + 1).astype(int)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        # Row groups are the blocks the training order permutes and a worker reads at a time (datasets/order.py):
        # many small ones mix better and keep a worker's memory to its shuffle window.
        pq.write_table(table.slice(lo, hi - lo), out / f"part-{i:04d}.parquet", row_group_size=ROW_GROUP_ROWS)


def build_pystdlib(out: Path, seq_len: int, val_fraction: float, shards: int, root: Path | None = None) -> dict:
    chunks: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    base = Path(root or sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(base):
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        n = len(data) // seq_len
        if n:
            chunks[split_of(path.relative_to(base).as_posix(), val_fraction)].append(data[: n * seq_len].reshape(n, seq_len))
    counts, next_id = {}, 0
    for split, parts in chunks.items():
        tokens = np.concatenate(parts) if parts else np.zeros((0, seq_len), np.uint8)
        ids = np.arange(next_id, next_id + len(tokens), dtype=np.int64)
        next_id += len(tokens)
        col = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1), pa.uint8()), seq_len)
        write_shards(pa.table({"tokens": col, "sample_id": ids}), out / split, shards)
        counts[split] = len(tokens)
    return counts


def build_tabular(out: Path, rows: int, features: int, classes: int, seed: int, val_fraction: float, shards: int) -> dict:
    rng = np.random.default_rng(seed)
    informative = min(features, 8)
    # Each class is a union of 3 Gaussian clusters scattered in the informative subspace: no single
    # hyperplane separates a class, yet an MLP can reach high accuracy. The rest are noise features
    # on different scales (so standardisation matters), one of them constant.
    clusters_per_class = 3
    centers = rng.normal(0.0, 2.2, size=(classes * clusters_per_class, informative))
    cluster = rng.integers(0, classes * clusters_per_class, size=rows)
    label = (cluster % classes).astype(np.int64)
    x = np.empty((rows, features), dtype=np.float32)
    x[:, :informative] = centers[cluster] + rng.normal(0.0, 1.1, size=(rows, informative))
    if features > informative:
        scales = rng.uniform(0.5, 50.0, size=features - informative)
        x[:, informative:] = rng.normal(0.0, 1.0, size=(rows, features - informative)) * scales
        x[:, -1] = 3.0
    # A fixed random rotation mixes informative and noise dimensions (still learnable).
    q, _ = np.linalg.qr(rng.normal(size=(informative, informative)))
    x[:, :informative] = x[:, :informative] @ q.astype(np.float32)
    is_val = rng.random(rows) < val_fraction
    counts = {}
    for split, mask in (("train", ~is_val), ("val", is_val)):
        cols = {f"f{i}": x[mask, i] for i in range(features)}
        cols["label"] = label[mask]
        cols["sample_id"] = np.flatnonzero(mask).astype(np.int64)
        write_shards(pa.table(cols), out / split, shards)
        counts[split] = int(mask.sum())
    return counts


class PrepareError(Exception):
    """A problem the user can fix: one line on stderr, exit 2."""


PREPARED_ENTRIES = {"train", "val", "tokenizer.json"}  # what this script writes into --out


def check_out(out: Path, force: bool) -> None:
    """--out must not exist, or (with --force) hold a data set this script wrote: --force never deletes anything
    else a user pointed it at by mistake."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise PrepareError(f"--out ({out}) already exists; remove it or pass --force to rebuild")
    foreign = ([out.name] if out.is_symlink() or not out.is_dir() else
               [p.name for p in out.iterdir() if p.name not in PREPARED_ENTRIES or p.is_symlink()] +
               [f"{p.parent.name}/{p.name}" for split in ("train", "val") if (out / split).is_dir()
                for p in (out / split).iterdir() if not (p.is_file() and p.suffix == ".parquet")])
    if foreign:
        raise PrepareError(f"--out ({out}) holds {sorted(foreign)[0]}, which datasets/prepare.py did not write; "
                           f"--force only replaces a prepared data set: choose another --out")


def publish(build, out: Path, force: bool) -> dict:
    """Write into a fresh sibling folder, then rename into place: a failed build never leaves half a data set."""
    check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        counts = build(tmp)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's folder is private (0700); the data set is not
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return counts


# ---- text: the user's .txt / .jsonl files, tokenised by Ray Data ----

TEXT_SUFFIXES = (".txt", ".jsonl")
EOS = "<|endoftext|>"  # BPE's document separator, token id 0
MIN_BPE_VOCAB = 257  # the 256 byte symbols + <|endoftext|>
MAX_BPE_VOCAB = 65536  # ids stored as uint16
DOC_SCHEMA = pa.schema([("file_idx", pa.int64()), ("doc_idx", pa.int64()), ("split", pa.string()),
                        ("text", pa.large_string()), ("error", pa.string())])
IDS_SCHEMA = pa.schema([("file_idx", pa.int64()), ("doc_idx", pa.int64()), ("split", pa.string()),
                        ("ids", pa.large_binary()), ("error", pa.string())])


def text_files(spec: str) -> tuple[list[str], list[str]]:
    """--input (a folder, searched recursively for .txt/.jsonl; a glob; one file) -> (absolute paths, names), sorted by
    name. A name is the path relative to the folder (or to the glob's fixed prefix): what the split hashes, so the
    split survives moving the corpus."""
    import glob

    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        root = path
        found = [p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        if not found:
            raise PrepareError(f"--input ({spec}) holds no .txt or .jsonl files; point it at a folder of text files")
    elif path.is_file():
        root, found = path.parent, [path]
    else:
        found = [Path(f) for f in glob.glob(os.path.expanduser(spec), recursive=True) if os.path.isfile(f)]
        if not found:
            raise PrepareError(f"--input ({spec}) matches no files; give a folder, a file or a glob of .txt/.jsonl files")
        fixed = os.path.expanduser(spec).split("*")[0].split("?")[0].split("[")[0]
        root = Path(fixed if fixed.endswith(os.sep) or not fixed else os.path.dirname(fixed) or ".")
    bad = [p for p in found if p.suffix not in TEXT_SUFFIXES]
    if bad:
        raise PrepareError(f"--input ({spec}) matches {bad[0]}, neither .txt nor .jsonl; narrow the glob to text files")
    root = Path(os.path.abspath(root))
    named = sorted((Path(os.path.abspath(p)).relative_to(root).as_posix(), os.path.abspath(p)) for p in found)
    return [f for _, f in named], [n for n, _ in named]


def assign_splits(names: list[str], val_fraction: float) -> list[str]:
    """Each file's split (split_of, as pystdlib). With two files or more and --val-fraction > 0 neither split is left
    empty: the file of lowest hash goes to val (highest to train) when the hash put none there."""
    splits = [split_of(n, val_fraction) for n in names]
    if val_fraction > 0 and len(names) >= 2:
        hashes = [unit_hash(n) for n in names]
        if "val" not in splits:
            splits[int(np.argmin(hashes))] = "val"
        if "train" not in splits:
            splits[int(np.argmax(hashes))] = "train"
    return splits


def read_documents(path: str, text_field: str) -> list[tuple[int, str]]:
    """One file -> [(doc_idx, text)]: a .txt file is one document (0); a .jsonl line is one (its 1-based line number),
    blank lines skipped. Raises PrepareError naming the file (and line) for text that cannot be read."""
    import json

    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text (byte {e.start}); convert it to UTF-8") from None
    if not path.endswith(".jsonl"):
        return [(0, text)]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise PrepareError(f"{path}:{n}: not a JSON line ({e.msg}); fix the line or remove it") from None
        if not isinstance(row, dict) or text_field not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise PrepareError(f"{path}:{n}: no '{text_field}' field (found {keys}); pass --text-field <key>")
        if not isinstance(row[text_field], str):
            raise PrepareError(f"{path}:{n}: '{text_field}' is {type(row[text_field]).__name__}, not a string")
        docs.append((n, row[text_field]))
    return docs


def split_single_file(docs: list[tuple[int, str]], val_fraction: float) -> list[tuple[int, str, str]]:
    """The only input file's documents -> (doc_idx, text, split): its last val_fraction of documents go to val, or,
    for one document, its last val_fraction of text (cut after a line break where there is one)."""
    if val_fraction <= 0 or not docs:
        return [(i, t, "train") for i, t in docs]
    if len(docs) >= 2:
        n_val = min(len(docs) - 1, max(1, round(val_fraction * len(docs))))
        return [(i, t, "val" if k >= len(docs) - n_val else "train") for k, (i, t) in enumerate(docs)]
    i, text = docs[0]
    cut = int(len(text) * (1 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    return [(2 * i, text[:cut], "train"), (2 * i + 1, text[cut:], "val")]


def read_batch(batch: pa.Table, text_field: str, single: bool, val_fraction: float) -> pa.Table:
    """Ray Data map_batches: rows of files (file_idx, path, split) -> rows of documents (DOC_SCHEMA). A file that
    cannot be read gives one row with `error` set (the driver reports the first, in file order), never an exception
    in a worker."""
    cols: dict[str, list] = {name: [] for name in DOC_SCHEMA.names}

    def add(f, d, split, text, error=None):
        for k, v in zip(DOC_SCHEMA.names, (f, d, split, text, error)):
            cols[k].append(v)

    for f, path, split in zip(*(batch.column(c).to_pylist() for c in ("file_idx", "path", "split"))):
        try:
            docs = read_documents(path, text_field)
        except PrepareError as e:
            add(f, -1, "", "", str(e))
            continue
        if single:
            for d, text, doc_split in split_single_file(docs, val_fraction):
                add(f, d, doc_split, text)
        else:
            for d, text in docs:
                add(f, d, split, text)
    return pa.table(cols, schema=DOC_SCHEMA)


_TOKENIZERS: dict[str, object] = {}


def load_tokenizer(tokenizer_json: str):
    from tokenizers import Tokenizer

    key = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = Tokenizer.from_str(tokenizer_json)
    return _TOKENIZERS[key]


def encode_documents(texts: list[str], tokenizer_json: str | None) -> list[np.ndarray]:
    """Each document's ids with its separator: bytes (uint8) plus a newline unless it ends with one; or the BPE's
    ids (uint16) plus <|endoftext|>."""
    if tokenizer_json is None:
        return [np.frombuffer((t if t.endswith("\n") else t + "\n").encode(), np.uint8) for t in texts]
    tok = load_tokenizer(tokenizer_json)
    eos = tok.token_to_id(EOS)
    return [np.array(e.ids + [eos], np.uint16) for e in tok.encode_batch(texts)]


def encode_batch(batch: pa.Table, tokenizer_json: str | None) -> pa.Table:
    """Ray Data map_batches: documents (DOC_SCHEMA) -> their ids as bytes (IDS_SCHEMA); error rows pass through."""
    texts = batch.column("text").to_pylist()
    errors = batch.column("error").to_pylist()
    ok = [i for i, e in enumerate(errors) if e is None and texts[i]]
    ids = [b""] * len(texts)
    for i, arr in zip(ok, encode_documents([texts[i] for i in ok], tokenizer_json)):
        ids[i] = arr.tobytes()
    return pa.table({"file_idx": batch.column("file_idx"), "doc_idx": batch.column("doc_idx"),
                     "split": batch.column("split"), "ids": pa.array(ids, pa.large_binary()),
                     "error": batch.column("error")}).cast(IDS_SCHEMA)


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE (Hugging Face tokenizers) of at most vocab_size tokens: <|endoftext|> (id 0), the 256 byte
    symbols, then merges learnt from `texts`. Lossless: decode(encode(t)) == t. Deterministic for the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def sorted_rows(table: pa.Table) -> pa.Table:
    """Rows in corpus order (file, then document), whatever order Ray Data returned them in. Raises the first error."""
    order = np.lexsort((table.column("doc_idx").to_numpy(), table.column("file_idx").to_numpy()))
    table = table.take(order)
    errors = [e for e in table.column("error").to_pylist() if e is not None]
    if errors:
        raise PrepareError(errors[0])
    return table


def pack(chunks: list[np.ndarray], seq_len: int, dtype) -> np.ndarray:
    """Concatenated ids cut into rows of seq_len; the short tail is dropped."""
    ids = np.concatenate(chunks).astype(dtype, copy=False) if chunks else np.zeros(0, dtype)
    n = len(ids) // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


def run_pipeline(files: list[str], splits: list[str], text_field: str, val_fraction: float, stage, engine: str):
    """read_batch (then `stage`, when given, on its output) over every file: on Ray Data (engine "ray": parallel,
    on the cluster at RAY_ADDRESS when set) or in this process ("local": the same functions, for tests).
    Returns one table of the results, in any order."""
    rows = [{"file_idx": i, "path": f, "split": s} for i, (f, s) in enumerate(zip(files, splits))]
    read_kw = dict(text_field=text_field, single=len(files) == 1, val_fraction=val_fraction)
    if engine == "local":
        out = read_batch(pa.Table.from_pylist(rows), **read_kw)
        return stage[0](out, **stage[1]) if stage else out
    import ray

    ds = ray.data.from_items(rows, override_num_blocks=min(len(rows), 200))
    ds = ds.map_batches(read_batch, batch_size=1, batch_format="pyarrow", fn_kwargs=read_kw)
    if stage:
        ds = ds.map_batches(stage[0], batch_size=64, batch_format="pyarrow", fn_kwargs=stage[1])
    schema = IDS_SCHEMA if stage else DOC_SCHEMA
    blocks = [b.cast(schema) for b in ray.get(ds.to_arrow_refs()) if b.num_rows]
    return pa.concat_tables(blocks) if blocks else schema.empty_table()


def build_text(out: Path, input_spec: str, tokenizer: str, vocab_size: int, seq_len: int, val_fraction: float,
               shards: int, text_field: str, engine: str = "ray") -> dict:
    files, names = text_files(input_spec)
    splits = assign_splits(names, val_fraction)
    tokenizer_json = None
    if tokenizer == "bpe":  # learnt from the training documents only, in corpus order
        docs = sorted_rows(run_pipeline(files, splits, text_field, val_fraction, None, engine))
        train_texts = [t for t, s in zip(docs.column("text").to_pylist(), docs.column("split").to_pylist())
                       if s == "train" and t]
        if not train_texts:
            raise PrepareError(f"--input ({input_spec}) holds no training text; give files with text in them")
        tok = train_bpe(train_texts, vocab_size)
        del docs, train_texts
        tokenizer_json = tok.to_str()
    table = sorted_rows(run_pipeline(files, splits, text_field, val_fraction,
                                     (encode_batch, {"tokenizer_json": tokenizer_json}), engine))
    dtype, arrow_type = (np.uint8, pa.uint8()) if tokenizer_json is None else (np.uint16, pa.uint16())
    chunks: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for split, blob in zip(table.column("split").to_pylist(), table.column("ids").to_pylist()):
        if blob:
            chunks[split].append(np.frombuffer(blob, dtype))
    train_tokens = sum(len(c) for c in chunks["train"])
    if train_tokens < seq_len:
        what = "no text" if not train_tokens else f"only {train_tokens} tokens of training text"
        raise PrepareError(f"--input ({input_spec}) holds {what}, fewer than one row of --seq-len {seq_len}; "
                           f"give more text or a smaller --seq-len")
    counts, next_id = {"files": len(files), "tokens": 0}, 0
    for split in ("train", "val"):
        tokens = pack(chunks[split], seq_len, dtype)
        ids = np.arange(next_id, next_id + len(tokens), dtype=np.int64)
        next_id += len(tokens)
        col = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1), arrow_type), seq_len)
        write_shards(pa.table({"tokens": col, "sample_id": ids}), out / split, max(1, min(shards, len(tokens))))
        counts[split] = len(tokens)
        counts["tokens"] += int(sum(len(c) for c in chunks[split]))
    counts["vocab_size"] = 256
    if tokenizer_json is not None:
        (out / "tokenizer.json").write_text(tokenizer_json)
        counts["vocab_size"] = load_tokenizer(tokenizer_json).get_vocab_size()
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python datasets/prepare.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    a = sub.add_parser("pystdlib", help="byte-level text corpus from the Python standard library")
    a.add_argument("--out", type=Path, default=Path("data/pystdlib"))
    a.add_argument("--seq-len", type=int, default=129, help="tokens per row (model.context + 1)")
    a.add_argument("--val-fraction", type=float, default=0.03)
    a.add_argument("--shards", type=int, default=8)
    b = sub.add_parser("tabular", help="synthetic, not linearly separable classification set")
    b.add_argument("--out", type=Path, default=Path("data/tabular"))
    b.add_argument("--rows", type=int, default=20000)
    b.add_argument("--features", type=int, default=16)
    b.add_argument("--classes", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--val-fraction", type=float, default=0.1)
    b.add_argument("--shards", type=int, default=4)
    c = sub.add_parser("text", help="your .txt/.jsonl files, tokenised (bytes or a BPE trained here) by Ray Data")
    c.add_argument("--input", required=True, help="a folder (searched recursively), a file or a glob of .txt/.jsonl")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes",
                   help="bytes: ids 0-255 (model.vocab_size=256); bpe: byte-level BPE trained on the training files")
    c.add_argument("--vocab-size", type=int, default=None, help="BPE tokens, 257-65536 (default 4096)")
    c.add_argument("--seq-len", type=int, default=129, help="tokens per row (model.context + 1)")
    c.add_argument("--val-fraction", type=float, default=0.05)
    c.add_argument("--shards", type=int, default=8)
    c.add_argument("--text-field", default="text", help="the key holding the text in each .jsonl line")
    for p in (a, b, c):
        p.add_argument("--force", action="store_true", help="rebuild an existing --out folder")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        if args.kind == "pystdlib":
            counts = publish(lambda d: build_pystdlib(d, args.seq_len, args.val_fraction, args.shards), args.out, args.force)
        elif args.kind == "tabular":
            if args.features < 2 or args.classes < 2 or args.rows < 10:
                ap.error("tabular needs --features >= 2, --classes >= 2 and --rows >= 10")
            counts = publish(lambda d: build_tabular(d, args.rows, args.features, args.classes, args.seed,
                                                     args.val_fraction, args.shards), args.out, args.force)
        else:
            counts = prepare_text(args)
    except PrepareError as e:
        error_line(e)
        return 2
    extra = ""
    if args.kind == "text":
        extra = (f" ({counts['files']} files, {counts['tokens']} tokens, vocab {counts['vocab_size']}"
                 f"{', tokenizer ' + str(args.out / 'tokenizer.json') if args.tokenizer == 'bpe' else ''}; "
                 f"train with model.vocab_size={counts['vocab_size']} model.context<={args.seq_len - 1}) "
                 f"in {time.time() - t0:.1f} s")
    print(f"wrote {args.out}: {counts['train']} train rows, {counts['val']} val rows{extra}")
    return 0


def prepare_text(args) -> dict:
    """Check the arguments (one line each, before Ray starts), then build on Ray Data."""
    if args.seq_len < 2:
        raise PrepareError(f"--seq-len ({args.seq_len}) must be at least 2 (model.context + 1)")
    if not 0 <= args.val_fraction < 1:
        raise PrepareError(f"--val-fraction ({args.val_fraction}) must be in [0, 1)")
    if args.shards < 1:
        raise PrepareError(f"--shards ({args.shards}) must be at least 1")
    if not args.text_field:
        raise PrepareError("--text-field must name a key of the .jsonl lines, e.g. --text-field text")
    if args.tokenizer == "bytes" and args.vocab_size not in (None, 256):
        raise PrepareError(f"--vocab-size ({args.vocab_size}) is for --tokenizer bpe; bytes have 256 ids")
    vocab = args.vocab_size if args.vocab_size is not None else 4096
    if args.tokenizer == "bpe" and not MIN_BPE_VOCAB <= vocab <= MAX_BPE_VOCAB:
        raise PrepareError(f"--vocab-size ({vocab}) must be {MIN_BPE_VOCAB}-{MAX_BPE_VOCAB} for bpe (256 bytes + "
                           f"{EOS}, ids as uint16); use e.g. --vocab-size 4096")
    text_files(args.input)  # no files: say so before starting Ray
    check_out(args.out, args.force)
    from stride.ray_cluster.connect import init_ray, quiet_ray_env
    from stride.errors import UsageError

    quiet_ray_env()
    try:
        embedded = init_ray()
    except UsageError as e:
        raise PrepareError(str(e)) from None
    import ray
    from ray.data import DataContext

    import logging

    logging.getLogger("ray.data").setLevel(logging.ERROR)  # no per-dataset INFO lines, no progress-bar notice
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False
    try:
        return publish(lambda d: build_text(d, args.input, args.tokenizer, vocab, args.seq_len, args.val_fraction,
                                            args.shards, args.text_field), args.out, args.force)
    finally:
        if embedded:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
