"""One rule for a service a test needs (SLURM, sshd, Prometheus) or a power of root it uses (mounting a tmpfs as a
full disk, chown to another user) that this machine does not give:

    from services import unavailable
    unavailable(f"sshd did not start: {log}")                        # CI=true: the test fails; else it skips
    unavailable("prometheus is not installed", required=False)       # an optional package: skips everywhere

Under CI (CI=true, as `.ci/run` runs `make test`), tests/setup_services.sh has just installed the services the
suite requires (openssh-server, rsync, slurm-wlm, munge): one that is missing, crashes or does not start there is
a failure, never a skip that would hide it. CI runs as root (setup_services installs with apt-get), so a tmpfs
that cannot be mounted or a chown refused there is a failure too. Outside CI the test skips and says why.
Prometheus is optional (setup_services installs it only where apt has it): its absence skips everywhere, but an
installed Prometheus that does not start fails under CI like the others.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def unavailable(reason: str, *, required: bool = True) -> NoReturn:
    """Fail the test with `reason` under CI=true (unless the service is optional and absent), else skip it."""
    if required and in_ci():
        pytest.fail(f"{reason} [CI=true: make test runs as root and installs the services; this must work there]",
                    pytrace=False)
    pytest.skip(reason)
