"""Data step of the Hugging Face causal LM example: text rows from local Python source, and a BPE tokenizer.

    python prepare.py                       # -> data/train, data/val (Parquet), data/tokenizer.json
    python prepare.py --max-chars 20000000 --vocab-size 4096 --out /path/to/data

Nothing is downloaded: the text is the running Python's standard library (.py files, test folders left out),
cut into rows of about --chunk-chars characters at line ends. A file goes wholly to train or to val (by a hash
of its path), so validation text is unseen. The byte-level BPE tokenizer is trained with Hugging Face
`tokenizers` on the training rows only and saved beside the splits as tokenizer.json.
Columns: sample_id (int64, unique per row) and text (string).
"""

from __future__ import annotations

import argparse
import sysconfig
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def source_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def chunks(text: str, size: int) -> list[str]:
    """Rows of about `size` characters, cut at line ends; the short tail of a file is dropped."""
    rows, row = [], ""
    for line in text.splitlines(keepends=True):
        row += line
        if len(row) >= size:
            rows.append(row[: 2 * size])
            row = ""
    return rows


def train_tokenizer(rows: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(rows, trainer=trainer)
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data"))
    ap.add_argument("--max-chars", type=int, default=1_500_000, help="characters of source text to use")
    ap.add_argument("--chunk-chars", type=int, default=256, help="characters per row (the task keeps its first model.context tokens)")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--val-percent", type=int, default=10)
    a = ap.parse_args()

    splits: dict[str, list[str]] = {"train": [], "val": []}
    total = 0
    for path in source_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        split = "val" if zlib.crc32(path.name.encode()) % 100 < a.val_percent else "train"
        splits[split] += chunks(text, a.chunk_chars)
        total += len(text)
        if total >= a.max_chars:
            break
    first_id = 0
    for split, rows in splits.items():
        (a.out / split).mkdir(parents=True, exist_ok=True)
        table = pa.table({"sample_id": pa.array(range(first_id, first_id + len(rows)), pa.int64()),
                          "text": pa.array(rows, pa.string())})
        pq.write_table(table, a.out / split / "part-0.parquet")
        first_id += len(rows)
        print(f"{split}: {len(rows)} rows -> {a.out / split}")
    tok = train_tokenizer(splits["train"], a.vocab_size)
    tok.save(str(a.out / "tokenizer.json"))
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {a.out / 'tokenizer.json'}")


if __name__ == "__main__":
    main()
