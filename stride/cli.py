"""The command-line parser every Stride command shares: a usage mistake is one line and exit 2.

argparse prints the whole usage block and then the error; in a job log or a CI step that is three lines or more,
and the one that matters is last. Standard library only, so the data and cluster layers import it without
importing trainers/ (or torch).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, NoReturn

from stride.errors import EXIT_USAGE, StrideError, exit_code, one_line



# The command as the user typed it (`stride sweep`), set by the `stride` dispatcher (stride/commands.py): a
# command's usage and errors name it rather than the script that implements it (`python tune/main.py`).
COMMAND: str | None = None


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors are one line, "<prog>: error: <message>; see <prog> --help", exit 2.
    Subparsers made through add_subparsers are of this class too (argparse uses the parent's class)."""

    def __init__(self, *args, **kwargs):
        global COMMAND
        if COMMAND is not None and "prog" in kwargs:  # the command's own parser, not a subparser argparse makes
            kwargs["prog"], COMMAND = COMMAND, None
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} --help\n")


def error_line(message: object) -> None:
    """Print "stride: error: <message>" as one write(2): the ranks of a torchrun gang share one stderr, and print()
    writes the text and its newline separately, so two ranks' lines could run together into one. Under torchrun the
    line also goes to the rank's error file, which torchrun's failure report shows in place of "To enable traceback
    see: ..." (record_for_torchrun)."""
    text = f"stride: error: {message}\n"
    record_for_torchrun(text.strip())
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a file (pytest's capture): one write() is enough
        sys.stderr.write(text)
        return
    sys.stderr.flush()
    data = text.encode("utf-8", "replace")
    while data:
        data = data[os.write(fd, data):]


def record_for_torchrun(line: str) -> None:
    """Write `line` to the error file torchrun gives each rank (TORCHELASTIC_ERROR_FILE), in the format of torch's own
    @record (torch.distributed.elastic.multiprocessing.errors): when the rank exits non-zero, torchrun's
    ChildFailedError report names the line as the failure's cause. Nothing outside torchrun."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the report then says what it says without the file; the line is on stderr anyway
        pass


def reports_errors(main: Callable[..., int]) -> Callable[..., int]:
    """A command's `main`: a StrideError it raises ends it with the error's one line on stderr and its exit code (2
    for what the user can fix, 1 for a failed run). The one place every command turns an error into its end."""
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except StrideError as e:
            error_line(one_line(e))
            return exit_code(e)
    return run
