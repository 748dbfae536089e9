"""Data step of the audio-clips example: WAV files and JSON Lines manifests, as a speech or audio project holds them.

    python prepare.py                  # -> data/audio/clip_00000.wav ..., data/train.jsonl, data/val.jsonl
    python prepare.py --clips 2000 --out /path/to/data

Each clip is 16-bit mono PCM at 8 kHz, 0.1 to 0.5 s long (lengths vary 5x), a tone of one of four pitches (the
label) under noise. Each manifest line names its clip by a path relative to the manifest's folder:
{"path": "audio/clip_00017.wav", "label": 2, "duration": 0.31}. Nothing is converted: Stride reads the manifests as
they are and the clips' bytes by reference (the task's file_columns).
"""

from __future__ import annotations

import argparse
import io
import json
import wave
from pathlib import Path

import numpy as np

RATE = 8000
PITCHES = (220.0, 330.0, 495.0, 742.5)  # Hz, one per label


def clip(rng: np.random.Generator, label: int) -> tuple[bytes, float]:
    """A WAV file's bytes and its duration in seconds."""
    duration = float(rng.uniform(0.1, 0.5))
    t = np.arange(int(duration * RATE)) / RATE
    signal = 0.5 * np.sin(2 * np.pi * PITCHES[label] * t + rng.uniform(0, 2 * np.pi)) + 0.3 * rng.standard_normal(len(t))
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.tobytes())
    return out.getvalue(), round(duration, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data"))
    ap.add_argument("--clips", type=int, default=2000)
    ap.add_argument("--val-fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    (a.out / "audio").mkdir(parents=True, exist_ok=True)
    n_val = int(a.clips * a.val_fraction)
    manifests = {"train": open(a.out / "train.jsonl", "w"), "val": open(a.out / "val.jsonl", "w")}
    try:
        for i in range(a.clips):
            label = int(rng.integers(len(PITCHES)))
            data, duration = clip(rng, label)
            name = f"audio/clip_{i:05d}.wav"
            (a.out / name).write_bytes(data)
            split = "val" if i < n_val else "train"
            manifests[split].write(json.dumps({"path": name, "label": label, "duration": duration}) + "\n")
    finally:
        for f in manifests.values():
            f.close()
    print(f"wrote {a.clips} clips under {a.out / 'audio'}, {a.out / 'train.jsonl'} and {a.out / 'val.jsonl'}")


if __name__ == "__main__":
    main()
