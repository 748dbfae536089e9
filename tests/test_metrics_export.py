"""Stride's per-rank gauges on Ray's Prometheus endpoint, the Grafana dashboard's queries, and a real Prometheus.

The session's shared head (tests/shared_ray.py: ray_cluster.local, token auth, a --metrics-export-port of its own);
one Stride job of 2 workers (the text model with train.peak_flops, so every CPU gauge including tokens and MFU) joins
it through RAY_ADDRESS and the head's token. The test scrapes http://127.0.0.1:<metrics port>/metrics every second
while the job trains, then stops the job with SIGTERM (checkpoint, exit 143) once every expected series was seen, so
it does not depend on how fast this machine trains. (Not SIGINT: Ray Train's fit() replaces the driver's SIGINT
handler with its own, which aborts the run without Stride's checkpoint and exits 1.) That a tabular job on CPU has no
tokens or MFU figure is the loop's doing, proven in one process (tests/test_loop.py); the gauges record only the
figures a log step has (trainers/telemetry.Gauges).

How Ray 2.60 exports a `ray.util.metrics.Gauge("stride_x", tag_keys=("run", "rank"))`: as `ray_stride_x` with
the labels run and rank plus Component, NodeAddress, SessionName, Version, WorkerId and otel_scope_*. A worker
sends what it recorded to its node's agent every metrics_report_interval_ms (10 s), so a value appears up to
~10 s after it is recorded; a gauge not recorded again is dropped 2 intervals (20 s) after its last report
(a finished or dead worker's series vanish then too). So the scrape happens while the job runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster_fixtures import PYTHON, REPO, clean_env, free_ports, short_tmp
from services import unavailable
from stride.ray_cluster import local

pytestmark = pytest.mark.slow

DASHBOARD = REPO / "ray_cluster" / "grafana" / "stride.json"
RANKS = {"0", "1"}

# The names Prometheus sees (trainers/telemetry.py records them without the `ray_` prefix).
SAMPLES = "ray_stride_samples_per_second"
TOKENS = "ray_stride_tokens_per_second"
STEP_TIME = "ray_stride_step_time_seconds"
DATA_WAIT = "ray_stride_data_wait_seconds"
DATA_WAIT_FRACTION = "ray_stride_data_wait_fraction"
CKPT_BLOCKED = "ray_stride_checkpoint_blocked_seconds"
LOSS = "ray_stride_train_loss"
LR = "ray_stride_learning_rate"
MFU = "ray_stride_mfu"
GPU_MEMORY = "ray_stride_gpu_memory_bytes"
GOODPUT = "ray_stride_goodput"
ALL = {SAMPLES, TOKENS, STEP_TIME, DATA_WAIT, DATA_WAIT_FRACTION, CKPT_BLOCKED, LOSS, LR, MFU, GPU_MEMORY, GOODPUT}
ON_EVERY_RUN = {SAMPLES, STEP_TIME, DATA_WAIT, DATA_WAIT_FRACTION, CKPT_BLOCKED, LOSS, LR, GOODPUT}

# MFU on CPU needs train.peak_flops. 1e11 FLOP/s is above what a tiny model reaches on one CPU thread (a few
# GFLOP/s), so the MFU lands in (0, 1].
PEAK_FLOPS = 1e11

# ---- Prometheus text format ------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(2) or "")}
        samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def test_parse_prometheus():
    text = ('# HELP ray_x desc\n# TYPE ray_x gauge\nray_x{rank="0",run="a \\"b\\"",WorkerId="f0"} 1.5\n'
            'ray_y 2 1700000000000\nray_z{le="+Inf"} NaN\n')
    (x, y, z) = parse_prometheus(text)
    assert x == ("ray_x", {"rank": "0", "run": 'a "b"', "WorkerId": "f0"}, 1.5)
    assert y == ("ray_y", {}, 2.0) and z[0] == "ray_z" and math.isnan(z[2])


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


# ---- a head, and Stride jobs scraped while they train -------------------------------------------------


@pytest.fixture(scope="module")
def head(shared_ray_head) -> local.Head:
    """The session's shared head (tests/shared_ray.py): it exports on a --metrics-export-port of its own."""
    return shared_ray_head.head


@pytest.fixture(scope="module")
def data():
    out = short_tmp("stm-data-")
    subprocess.run([PYTHON, "datasets/prepare.py", "pystdlib", "--out", str(out / "text")], cwd=REPO, check=True,
                   capture_output=True)
    yield out
    shutil.rmtree(out, ignore_errors=True)


@dataclass
class Prometheus:
    url: str | None = None
    why_not: str = ""


@pytest.fixture(scope="module")
def prometheus(head):
    """A real Prometheus scraping the head's metrics port every second, running while the jobs train (so the
    last test can query what it stored). Prometheus(url=None, why_not=...) where it cannot run."""
    binary = shutil.which("prometheus")
    if binary is None:
        yield Prometheus(why_not="the prometheus binary is not installed (tests/setup_services.sh installs "
                                 "Debian's prometheus package when run as root with apt-get)")
        return
    root = short_tmp("stm-prom-")
    (port,) = free_ports(1)
    (root / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: ray\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{head.ports['metrics_export']}']\n")
    log = open(root / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    result = Prometheus(url=url)
    while True:
        try:
            http_get(f"{url}/-/ready", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                result = Prometheus(why_not="prometheus did not start: " + (root / "prometheus.log").read_text()[-1500:])
                break
            time.sleep(0.5)
    yield result
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    log.close()
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class Scraped:
    run: str
    values: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)  # (metric, rank) -> {scrape: value}
    extra_labels: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)  # every ray_stride_* name of this run on the endpoint
    first_log_s: float | None = None  # after the job started: rank 0's first log step (metrics.jsonl)
    first_seen_s: float | None = None  # after the job started: the first stride series on the endpoint
    started: float = 0.0
    ended: float = 0.0
    returncode: int | None = None
    output: str = ""
    summary: dict = field(default_factory=dict)

    def ranks(self, metric: str) -> set[str]:
        return {rank for (name, rank) in self.values if name == metric}

    def all_values(self, metric: str) -> list[float]:
        return [v for (name, _), vs in self.values.items() if name == metric for v in vs.values()]


def train_and_scrape(head: local.Head, run: str, storage: Path, args: list[str], want: set[str],
                     timeout: float = 420) -> Scraped:
    """Run a 2-worker Stride job on the head; scrape its metrics every second until every metric in `want`
    has been seen for both ranks, then SIGTERM the driver (checkpoint, exit 143) and keep scraping until it exits."""
    out = Scraped(run)
    log_path = storage / f"{run}.log"
    metrics_jsonl = storage / run / "metrics.jsonl"
    endpoint = f"http://127.0.0.1:{head.ports['metrics_export']}/metrics"
    with open(log_path, "w") as log:
        out.started = time.time()
        proc = subprocess.Popen([PYTHON, "trainers/main.py", *args, f"run.name={run}", f"run.storage_path={storage}",
                                 "scaling.num_workers=2", "train.epochs=null", "train.max_steps=1000000"],
                                cwd=REPO, env=clean_env(**head.client_env()), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        interrupted_at = None
        scrape = 0
        try:
            while True:
                scrape += 1
                now = time.time() - out.started
                if out.first_log_s is None and metrics_jsonl.exists() and '"train_loss"' in metrics_jsonl.read_text():
                    out.first_log_s = now
                try:
                    samples = parse_prometheus(http_get(endpoint))
                except OSError:
                    samples = []
                for name, labels, value in samples:
                    if name.startswith("ray_stride_") and labels.get("run") == run:
                        out.names.add(name)
                        out.values.setdefault((name, labels["rank"]), {})[scrape] = value
                        out.extra_labels |= set(labels) - {"run", "rank"}
                        if out.first_seen_s is None:
                            out.first_seen_s = now
                if proc.poll() is not None:
                    break
                if interrupted_at is None and all(out.ranks(m) >= RANKS for m in want):
                    interrupted_at = time.time()
                    proc.send_signal(signal.SIGTERM)  # stride checkpoints at the next step and exits 143
                if now > timeout or (interrupted_at and time.time() - interrupted_at > 180):
                    break
                time.sleep(1)
        finally:
            if proc.poll() is None:  # only on failure: end the job's driver (its session) by pid
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    out.ended = time.time()
    out.returncode = proc.returncode
    out.output = log_path.read_text()
    summary = storage / run / "summary.json"
    out.summary = json.loads(summary.read_text()) if summary.exists() else {}
    return out


def text_args(data: Path) -> list[str]:
    return ["--config", "trainers/configs/char_gpt.yaml", f"data.train_path={data / 'text' / 'train'}",
            f"data.val_path={data / 'text' / 'val'}", "model.n_layers=1", "model.width=32", "model.n_heads=2",
            "model.context=32", "train.batch_size_per_worker=8", "train.log_every_steps=2",
            "train.eval_every_steps=null", "checkpoint.every_steps=20", "checkpoint.keep_last=1",
            f"train.peak_flops={PEAK_FLOPS}"]


@pytest.fixture(scope="module")
def storage():
    folder = short_tmp("stm-runs-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def text_run(head, data, storage, prometheus, shared_ray_head) -> Scraped:
    run = train_and_scrape(head, "metrics-gpt", storage, text_args(data), want=ON_EVERY_RUN | {TOKENS, MFU})
    assert not shared_ray_head.wait_idle()
    return run


def check_run(run: Scraped, want: set[str]) -> None:
    context = f"job output:\n{run.output[-4000:]}"
    assert run.returncode == 143 and run.summary.get("status") in ("interrupted", "preempted"), context
    missing = {m: sorted(RANKS - run.ranks(m)) for m in want if not run.ranks(m) >= RANKS}
    assert not missing, f"not exported for ranks {missing}; seen {sorted(run.names)}\n{context}"
    assert run.first_seen_s is not None and run.first_log_s is not None
    # A value reaches the endpoint within one report interval (10 s) of being recorded (plus scrape slack).
    assert run.first_seen_s - run.first_log_s < 30, (run.first_log_s, run.first_seen_s)
    print(f"{run.run}: first log step {run.first_log_s:.0f} s after the start, first series on the endpoint "
          f"{run.first_seen_s - run.first_log_s:.1f} s later")
    assert {"Component", "WorkerId"} <= run.extra_labels  # Ray's own labels: aggregate `by (run, rank)`
    for metric in want:
        values = run.all_values(metric)
        assert all(math.isfinite(v) for v in values), (metric, values)
    assert all(v > 0 for v in run.all_values(SAMPLES))
    assert all(v > 0 for v in run.all_values(STEP_TIME))
    assert all(v >= 0 for v in run.all_values(DATA_WAIT))
    assert all(0 <= v <= 1 for v in run.all_values(DATA_WAIT_FRACTION))
    assert all(0 < v < 1 for v in run.all_values(GOODPUT))
    assert all(v > 0 for v in run.all_values(CKPT_BLOCKED))
    assert all(v > 0 for v in run.all_values(LOSS))
    assert all(v > 0 for v in run.all_values(LR))


def test_text_job_with_peak_flops_exports_tokens_and_mfu(text_run):
    check_run(text_run, ON_EVERY_RUN | {TOKENS, MFU})
    assert GPU_MEMORY not in text_run.names
    assert all(0 < v <= 1 for v in text_run.all_values(MFU)), text_run.all_values(MFU)
    assert all(v > 0 for v in text_run.all_values(TOKENS))
    # tokens/s = samples/s x context (32) in every rank's report (a worker exports all its gauges together)
    for rank in RANKS:
        tokens, samples = text_run.values[(TOKENS, rank)], text_run.values[(SAMPLES, rank)]
        both = tokens.keys() & samples.keys()
        assert both and all(tokens[k] == pytest.approx(32 * samples[k], rel=1e-6) for k in both)


def test_ray_writes_prometheus_service_discovery_for_the_head(head):
    """Prometheus can find every node's metrics port from the file Ray writes on the head (README.md, "Prometheus and Grafana")."""
    sd = json.loads((head.temp_dir / "ray" / "prom_metrics_service_discovery.json").read_text())
    targets = [t for group in sd for t in group["targets"]]
    assert any(t.endswith(f":{head.ports['metrics_export']}") for t in targets), sd


# ---- the Grafana dashboard ---------------------------------------------------------------------------


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    return exprs + [variables["run"]["query"]]


def test_dashboard_is_importable_json():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36 and "id" not in board
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["type"] == "query"
    assert variables["run"]["query"].startswith("label_values(ray_stride_") and variables["run"]["multi"]
    assert variables["run"]["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert set(p["gridPos"]) == {"x", "y", "w", "h"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and 'run=~"$run"' in t["expr"]
            assert t["expr"].count("(") == t["expr"].count(")")
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for word in ("samples", "tokens", "step time", "data wait", "mfu", "loss", "learning rate", "checkpoint",
                 "gpu memory", "straggler", "goodput"):
        assert word in titles
    used = {n for q in dashboard_queries() for n in re.findall(r"\bray_stride_[a-z_]+\b", q)}
    assert used == ALL


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool (from the prometheus package) parses every panel query, as a recording rule."""
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool is not installed (tests/setup_services.sh installs Debian's prometheus package as root)",
                    required=False)  # optional: apt may have no prometheus
    exprs = [q for q in dashboard_queries() if not q.startswith("label_values(")]
    rules = {"groups": [{"name": "stride", "rules": [{"record": f"stride:panel_{i}", "expr": e.replace("$run", ".+")}
                                                      for i, e in enumerate(exprs)]}]}
    (tmp_path / "rules.yml").write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert result.returncode == 0 and f"{len(exprs)} rules found" in result.stdout, result.stdout + result.stderr


def test_dashboard_uses_only_exported_names(text_run):
    """Every name in the dashboard's queries is one the scrapes found (GPU memory only exists on GPU runs:
    it follows the same naming rule as the rest, checked against trainers/telemetry.py)."""
    from stride.trainers import telemetry

    found = text_run.names
    used = {n for q in dashboard_queries() for n in re.findall(r"\bray_stride_[a-z_]+\b", q)}
    assert used - {GPU_MEMORY} <= found, sorted(used - found)
    recorded = {"ray_" + name for name, _ in telemetry.GAUGES.values()}
    assert found <= recorded and used == recorded


# ---- a real Prometheus -------------------------------------------------------------------------------


def prom_query_range(url: str, expr: str, start: float, end: float) -> list[dict]:
    query = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"})
    try:
        body = json.loads(http_get(f"{url}/api/v1/query_range?{query}", timeout=30))
    except urllib.error.HTTPError as e:
        raise AssertionError(f"Prometheus refused {expr}: {e.read().decode()[:500]}") from None
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_stores_stride_metrics_and_runs_every_dashboard_query(prometheus, head, request):
    if prometheus.url is None:
        unavailable(prometheus.why_not, required=shutil.which("prometheus") is not None)  # installed: must start
    text_run = request.getfixturevalue("text_run")
    targets = json.loads(http_get(f"{prometheus.url}/api/v1/targets"))["data"]["activeTargets"]
    assert [t["scrapeUrl"] for t in targets] == [f"http://127.0.0.1:{head.ports['metrics_export']}/metrics"], targets

    start, end = text_run.started, text_run.ended + 5
    loss = prom_query_range(prometheus.url, f'{LOSS}{{run="metrics-gpt"}}', start, end)
    assert {s["metric"]["rank"] for s in loss} == RANKS
    assert all(0 < float(v) < math.inf for s in loss for _, v in s["values"])

    runs = "metrics-gpt"
    for expr in dashboard_queries():
        if expr.startswith("label_values("):  # Grafana's variable query: the label's values over the range
            metric = re.match(r"label_values\((\w+), run\)", expr).group(1)
            found = {s["metric"]["run"] for s in prom_query_range(prometheus.url, metric, start, end)}
            assert "metrics-gpt" in found, found
            continue
        result = prom_query_range(prometheus.url, expr.replace("$run", runs), start, end)
        if GPU_MEMORY in expr:
            assert result == []  # CPU only here
            continue
        assert result, f"no data for {expr}"
        values = [float(v) for s in result for _, v in s["values"]]
        assert all(math.isfinite(v) for v in values), expr
        if "quantile" in expr:  # the straggler ratio: slowest / median rank >= 1
            assert all(v >= 1 - 1e-9 for v in values), values
