"""Data step of the image classifier example: small synthetic images stored as PNG bytes in Parquet.

    python prepare.py                       # -> data/train/part-0.parquet, data/val/part-0.parquet
    python prepare.py --train 20000 --size 48 --out /path/to/data

Each image is a circle, a square or a triangle (label 0, 1, 2) of random colour, size and position on a random
background, with pixel noise, drawn with Pillow. Columns: sample_id (int64, unique per row), image (binary: the
PNG file's bytes, as an image data set exported to Parquet usually stores them) and label (int64).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

CLASSES = ("circle", "square", "triangle")


def draw(label: int, size: int, rng: np.random.Generator) -> bytes:
    background = tuple(int(v) for v in rng.integers(0, 256, 3))
    colour = tuple(int(v) for v in rng.integers(0, 256, 3))
    while sum(abs(a - b) for a, b in zip(colour, background)) < 150:  # keep the shape visible
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
    img = Image.new("RGB", (size, size), background)
    d = ImageDraw.Draw(img)
    r = rng.uniform(0.18, 0.38) * size  # half the shape's extent
    cx, cy = rng.uniform(r + 1, size - r - 1, 2)
    if CLASSES[label] == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif CLASSES[label] == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    pixels = np.asarray(img, np.float32) + rng.normal(0, 12, (size, size, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_split(out: Path, n: int, first_id: int, size: int, rng: np.random.Generator) -> None:
    labels = rng.integers(0, len(CLASSES), n)
    table = pa.table({"sample_id": pa.array(np.arange(first_id, first_id + n), pa.int64()),
                      "image": pa.array([draw(int(k), size, rng) for k in labels], pa.binary()),
                      "label": pa.array(labels, pa.int64())})
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "part-0.parquet")
    print(f"{out}: {n} images ({size}x{size} PNG), classes {dict(enumerate(CLASSES))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data"))
    ap.add_argument("--train", type=int, default=4000, help="training images")
    ap.add_argument("--val", type=int, default=1000, help="validation images")
    ap.add_argument("--size", type=int, default=32, help="image side in pixels")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    write_split(a.out / "train", a.train, 0, a.size, rng)
    write_split(a.out / "val", a.val, a.train, a.size, rng)


if __name__ == "__main__":
    main()
