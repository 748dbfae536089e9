"""Stride's errors and their exit codes, in one place for every command and launcher.

Each error's message is the one line the user sees ("stride: error: <message>"): what was wrong, the value, the
fix. `exit_code(e)` maps any exception to the process's exit code: 2 for a problem the user can fix before or
without training (config, data, resources, usage), 1 for a run that failed. Standard library only, so the data and
cluster layers import it without importing trainers/ (or torch).
"""

from __future__ import annotations

from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# An error line quotes at most this much of a bad value: a value can be megabytes (a YAML alias expanded).
MAX_QUOTED_CHARS = 200


def quote(value: Any) -> str:
    """repr(value) for an error line, cut to MAX_QUOTED_CHARS."""
    text = repr(value)
    return text if len(text) <= MAX_QUOTED_CHARS else f"{text[:MAX_QUOTED_CHARS]}... ({len(text)} characters)"


class StrideError(Exception):
    """Base of Stride's errors; `exit_code` is the process's exit code when it ends a command."""

    exit_code = EXIT_USAGE


class UsageError(StrideError):
    """A command used in a way that cannot work here (resources, paths, the run folder): exit 2."""


class ConfigError(StrideError, ValueError):
    """A config value the user can fix: exit 2."""


class DataError(StrideError, ValueError):
    """Input data the user can fix: exit 2."""


class UnsafeCheckpointError(StrideError, ValueError):
    """A checkpoint file that holds more than tensors, plain values and DCP's own metadata: refused, never
    unpickled (it could run code). Exit 2."""


class ExportError(StrideError, ValueError):
    """export: an argument the user can fix (exit 2)."""


class RunFolderError(UsageError):
    """A symlink (or another non-regular file) where Stride writes or reads in a run folder, or a symlinked
    checkpoint folder: refused, never followed. The message names the path."""


class CheckpointFormatError(UsageError):
    """A checkpoint in a format this version no longer reads (the single-file state.pt from before DCP): refused by
    name, never skipped for an older checkpoint or a fresh start (exit 2). Not a ValueError: the checks that pass
    over an unreadable meta.json must not pass over this one."""


class RunLockedError(UsageError):
    """Another live run holds the run folder (exit 2, one line naming the folder and the holder)."""


class TrainingError(StrideError, RuntimeError):
    """A run that cannot go on (exit 1); the message is one line saying why and what to change."""

    exit_code = EXIT_FAILED


class RunLockLostError(TrainingError):
    """This run no longer holds its run folder: another run took it over, or the driver's heartbeat stopped (exit 1)."""


class CheckpointWriteError(TrainingError):
    """Storage stayed broken through every retry, or failed in a way no retry mends. `reason`: what the storage said;
    the message: the one line for the user (the checkpoint that failed, the last complete one, what to do)."""

    def __init__(self, message: str, reason: str = "", errno: int | None = None):
        super().__init__(message)
        self.reason, self.errno = reason or message, errno

    def __reduce__(self):  # Ray re-raises a worker's exception on the driver: keep reason and errno through pickle
        return type(self), (str(self), self.reason, self.errno)


def one_line(e: BaseException) -> str:
    """The line a command ends with after `e`: its message on one line (the type's name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


def exit_code(e: BaseException) -> int:
    """The exit code a command ends with after `e`: its own for Stride's errors, 1 for anything else."""
    return e.exit_code if isinstance(e, StrideError) else EXIT_FAILED
