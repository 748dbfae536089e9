"""What every benchmark part records and prints: the run header beside its runs (when, on what machine, at what
commit, under what load), whether a stored figure is older than the code it measures, and a part's JSON on stdout
(and in --out). Standard library only (tests/test_bench.py loads this file by path).

    with run_header(mode) as header: ...      # header: started, machine, commit, dirty, loads, duration_s
    stale_reason(header, paths, repo)        # None: the figure measured the code at HEAD; else why it is stale
    stale_parts(headers, PARTS, repo)        # the same for every benchmark part (benchmarks/figures.py PARTS)
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIRTY_PATHS_KEPT = 50  # a header lists at most this many uncommitted paths (and how many there were)


def cpu_model() -> str | None:
    """This machine's CPU, stored with the runs: `--only` measures a part again, maybe on another machine than the
    rest of latest.json."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        return None


def machine() -> dict:
    """The machine the figures were measured on (a ratio is this machine's): CPUs, memory, Python and the versions of
    torch, Ray and pyarrow (from their installed metadata: nothing is imported)."""
    info = {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(), "hostname": socket.gethostname()}
    try:
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, ValueError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torch", "ray", "pyarrow"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            pass
    return info


def git(*args: str, repo: Path = REPO) -> subprocess.CompletedProcess | None:
    """`git -C repo args`, or None where git or the repository is missing."""
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def commit(repo: Path = REPO) -> dict:
    """The checkout's commit (git rev-parse HEAD) and its uncommitted paths (git status: modified, staged and
    untracked; ignored files are not code). {commit: None} outside a git checkout."""
    head = git("rev-parse", "HEAD", repo=repo)
    if head is None or head.returncode != 0:
        return {"commit": None, "dirty": None, "dirty_paths": []}
    status = git("status", "--porcelain", "--untracked-files=all", repo=repo)
    # porcelain v1: "XY path" or "XY old -> new"; the path as git quotes it
    paths = sorted({ln[3:].split(" -> ")[-1].strip('"') for ln in (status.stdout if status else "").splitlines()
                    if len(ln) > 3})
    out = {"commit": head.stdout.strip(), "dirty": bool(paths) if status and status.returncode == 0 else None,
           "dirty_paths": paths[:DIRTY_PATHS_KEPT]}
    if len(paths) > DIRTY_PATHS_KEPT:
        out["dirty_paths_total"] = len(paths)
    return out


@contextmanager
def run_header(mode: str | None = None, repo: Path = REPO):
    """The header of one measurement: every part of `make bench` (and `--only`) records one around its runs, and
    the whole run one around all of them. Filled in on entry (started, mode, machine, commit, dirty paths, load
    average) and on exit (load average at the end, duration), also when the part fails."""
    header = {"started": datetime.now().isoformat(timespec="seconds"), "mode": mode, "machine": machine(),
              **commit(repo), "loadavg_start": list(os.getloadavg())}
    t0 = time.perf_counter()
    try:
        yield header
    finally:
        header["loadavg_end"] = list(os.getloadavg())
        header["duration_s"] = time.perf_counter() - t0


def _under(path: str, paths: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths)


def stale_reason(header: dict | None, paths: list[str], repo: Path = REPO, _cache: dict | None = None) -> str | None:
    """None when a figure measured the code HEAD has at `paths` (the files or folders its benchmark part measures);
    else why it is stale: no run header, no commit, a commit that is not an ancestor of HEAD, uncommitted changes
    to those paths when it was measured, or changes to them since its commit (git diff <commit> HEAD -- paths).
    Committed content only: this checkout's own uncommitted changes are not looked at."""
    if not header:
        return "unknown: measured before run headers were recorded"
    sha = header.get("commit")
    if not sha:
        return "unknown commit"
    dirty = [p for p in header.get("dirty_paths") or [] if _under(p, paths)]
    if dirty:
        return f"measured with uncommitted changes to {', '.join(dirty[:3])}{' ...' if len(dirty) > 3 else ''}"
    if header.get("dirty_paths_total"):
        return "measured with more uncommitted changes than the header lists"
    key = (sha, tuple(paths))
    if _cache is not None and key in _cache:
        return _cache[key]
    ancestor = git("merge-base", "--is-ancestor", sha, "HEAD", repo=repo)
    if ancestor is None:
        reason = "not checked: no git"
    elif ancestor.returncode != 0:
        reason = f"its commit {sha[:10]} is not an ancestor of HEAD"
    else:
        diff = git("diff", "--quiet", sha, "HEAD", "--", *paths, repo=repo)
        reason = None if diff is not None and diff.returncode == 0 else "the code it measures changed since"
    if _cache is not None:
        _cache[key] = reason
    return reason


def stale_parts(headers: dict, parts: dict, repo: Path = REPO) -> dict:
    """{part: stale_reason of its run header (None: current)}; `headers`: {part: header or None}, `parts`: {part:
    {"paths": [...]}} (benchmarks/figures.py PARTS)."""
    cache: dict = {}
    return {part: stale_reason(h, parts[part]["paths"], repo, cache) for part, h in headers.items()}


def changed_since(sha: str, paths: list[str], repo: Path = REPO) -> list[str]:
    """The files under `paths` that changed between `sha` and HEAD (what makes a figure stale)."""
    diff = git("diff", "--name-only", sha, "HEAD", "--", *paths, repo=repo)
    return diff.stdout.split() if diff is not None and diff.returncode == 0 else []


def print_json(doc: dict, out: str | None) -> None:
    """A part's figures and raw runs, printed, and written to `out` when given."""
    text = json.dumps(doc, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
