"""Stride's loop without Ray, under torchrun (the launcher itself: trainers/launch/torchrun.py).

    torchrun --nproc-per-node 2 trainers/torchrun.py --config trainers/configs/char_gpt.yaml [section.field=value ...]
    torchrun --nproc-per-node 2 -m stride.trainers.torchrun --config my.yaml
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as a file from a checkout: import Stride as the `stride` package (stride/_checkout.py)
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "stride" / "_checkout.py"))

if __name__ == "__main__":
    from stride.trainers.launch.torchrun import main

    code = main()
    # Everything is written and the process group destroyed: leave without the interpreter's finalization, where a
    # gloo thread torn down unjoined still aborted a finished 2-rank run now and then under load ("terminate called
    # without an active exception", SIGABRT; seen in 2 of about 20 test-suite runs here after the gc.collect above).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
