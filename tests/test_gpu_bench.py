"""benchmarks/gpu.py: the GPU benchmark's logic on CPU (no timed assertions), its options, and one real GPU run.

The benchmark must run on GPU machines that have torch but no Ray or pydantic, so the CPU runs here block both.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import pytest
import torch

from conftest import PYTHON, REPO

GPU_PY = "benchmarks/gpu.py"


def run_gpu_py(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run gpu.py the way a bare GPU machine would: pydantic, ray and yaml cannot be imported."""
    code = ("import runpy, sys\n"
            "sys.modules['pydantic'] = None; sys.modules['ray'] = None; sys.modules['yaml'] = None\n"
            f"sys.argv = [{GPU_PY!r}] + {args!r}\n"
            f"runpy.run_path({GPU_PY!r}, run_name='__main__')\n")
    # One thread: this machine is shared, and OpenMP spinning under contention makes tiny steps take seconds.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([PYTHON, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def load_gpu_py() -> dict:
    """gpu.py's namespace, run in this process. It puts the repository root on sys.path (to import Stride from a
    checkout): undone here, so the repository's datasets/ never hides Hugging Face `datasets` in later tests."""
    saved = list(sys.path)
    try:
        return runpy.run_path(str(REPO / GPU_PY), run_name="gpu_bench")
    finally:
        sys.path[:] = saved


def check_loop(fig: dict, steps_timed: int | None = None) -> None:
    assert fig["tokens_per_second"] > 0 and fig["tokens_per_second_per_gpu"] > 0
    assert 0 < fig["step_ms_median"] <= fig["step_ms_p90"] <= fig["step_ms_max"]
    if steps_timed is not None:  # every turn's steps, pooled
        assert fig["steps_timed"] == steps_timed
    # MFU is a number, or null with the reason said
    assert (fig["mfu"] is not None and fig["mfu"] > 0 and fig["mfu_reason"] is None) or \
           (fig["mfu"] is None and fig["mfu_reason"])
    assert 0 < fig["last_loss"] < 10  # random bytes: about ln(256) = 5.5


def test_cpu_tiny_without_ray_or_pydantic(tmp_path):
    out = tmp_path / "gpu-cpu.json"
    r = run_gpu_py(["--device", "cpu", "--shapes", "tiny", "--modes", "fp32,bf16,fp16", "--compile", "off",
                    "--steps", "3", "--warmup", "1", "--reps", "2", "--out", str(out), "--profile",
                    str(tmp_path / "traces")])
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["device"] == {"type": "cpu", "name": "cpu", "world_size": 1, "capability": None}
    assert "6*N + 12*layers*width*context" in rep["flops_per_token_formula"]
    assert rep["settings"]["allow_tf32"] is False
    measured = {(x["mode"], x["compile"]) for x in rep["results"]}
    skipped = {(x["mode"], x["compile"]) for x in rep["skipped"]}
    # fp16 either runs on this torch's CPU or is skipped with a reason, never a crash
    assert {("fp32", False), ("bf16", False)} <= measured
    assert ("fp16", False) in measured | skipped
    assert all(x["reason"] for x in rep["skipped"])
    for res in rep["results"]:
        assert (res["layers"], res["width"], res["heads"], res["context"], res["batch_per_gpu"]) == (2, 64, 2, 32, 4)
        assert res["flops_per_token"] > 6 * 100_000  # ~118k parameters
        check_loop(res["stride"], steps_timed=6)
        # nanoGPT's loop is the judged reference; the first figures' minimal loop is measured beside it
        assert res["judged_reference"] == "nanogpt" and set(res["references"]) == {"nanogpt", "minimal"}
        assert res["reference"] == res["references"]["nanogpt"]
        for name, fig in res["references"].items():
            check_loop(fig, steps_timed=6)
            ratio = res["stride"]["tokens_per_second"] / fig["tokens_per_second"]
            assert res["stride_over"][name] == pytest.approx(ratio)
        assert res["stride_over_reference"] == res["stride_over"]["nanogpt"]
        assert res["stride"]["mfu"] is None and "--peak-flops" in res["stride"]["mfu_reason"]  # no CPU peak known
        assert res["stride"]["sm_clock_mhz_mean"] is None  # no GPU to sample
        traces = {p.name for p in (tmp_path / "traces").iterdir()}
        for loop in ("stride", "nanogpt", "minimal"):
            assert f"tiny-{res['mode']}-compile_off-ac_off-rank0-{loop}.json" in traces
    # goals are judged only on a GPU
    assert [g["met"] for g in rep["goals"]] == [None, None]
    # one table on stdout, a row per measured or skipped combination
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["shape", "mode", "compile"] and "Stride/ref" in lines[0]
    assert len(lines) == 2 + len(rep["results"]) + len(rep["skipped"]) + 1  # header, rule, rows, "wrote ..."


def test_peak_flops_flag_gives_mfu(tmp_path):
    out = tmp_path / "g.json"
    r = run_gpu_py(["--device", "cpu", "--modes", "fp32", "--compile", "off", "--steps", "2", "--warmup", "1",
                    "--peak-flops", "1e12", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["peak_flops"]["source"] == "--peak-flops"
    res = rep["results"][0]
    for loop in ("stride", "reference"):
        fig = res[loop]
        assert fig["mfu"] == pytest.approx(fig["tokens_per_second_per_gpu"] * res["flops_per_token"] / 1e12)


@pytest.mark.slow
def test_cpu_compile_path(tmp_path):
    """torch.compile of both loops (a fresh dynamo cache each), on CPU where a C++ compiler is present."""
    out = tmp_path / "g.json"
    r = run_gpu_py(["--device", "cpu", "--modes", "fp32", "--compile", "on", "--steps", "2", "--warmup", "1",
                    "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    if rep["skipped"]:
        assert "C++ compiler" in rep["skipped"][0]["reason"]
    else:
        (res,) = rep["results"]
        assert res["compile"] is True
        check_loop(res["stride"])
        for fig in res["references"].values():
            check_loop(fig)


def test_bad_option_one_line_exit_2():
    r = run_gpu_py(["--device", "cpu", "--shapes", "S,XL"], timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("benchmarks/gpu.py: error: --shapes (S,XL) must be a comma-separated list of "
                                "S, M, L, tiny; use e.g. --shapes S,M")


@pytest.mark.parametrize("args, says", [
    (["--modes", "fp8"], "--modes (fp8) must be"),
    (["--compile", "maybe"], "--compile (maybe) must be"),
    (["--steps", "0"], "--steps (0) must be"),
    (["--steps", "x"], "argument --steps: invalid int value"),
    (["--warmup", "-1"], "--warmup (-1) must be"),
    (["--device", "tpu"], "--device (tpu) must be"),
    (["--peak-flops", "-1"], "--peak-flops (-1) must be"),
    (["--reps", "0"], "--reps (0) must be"),
    (["--reference", "llmc"], "--reference (llmc) must be"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_in_process(args, says, capsys):
    gpu = load_gpu_py()
    assert gpu["main"](["--device", "cpu", *args] if "--device" not in args else args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("benchmarks/gpu.py: error: ") and says in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_gpu_says_use_cpu():
    r = run_gpu_py([], timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("benchmarks/gpu.py: error: --device (cuda) needs a CUDA GPU but "
                                "torch.cuda.is_available() is False; use --device cpu")


def test_peak_table_and_slug():
    gpu = load_gpu_py()
    expect = {"NVIDIA H100 80GB HBM3": ("H100 SXM", 989e12), "NVIDIA H100 PCIe": ("H100 PCIe", 756e12),
              "NVIDIA H100 NVL": ("H100 NVL", 835e12), "NVIDIA H200": ("H200", 989e12),
              "NVIDIA A100-SXM4-80GB": ("A100", 312e12), "NVIDIA A100 80GB PCIe": ("A100", 312e12),
              "NVIDIA L4": ("L4", 121e12), "NVIDIA L40S": ("L40S", 362e12), "NVIDIA A10G": ("A10G/A10", 125e12)}
    for name, (label, bf16) in expect.items():
        source, peaks = gpu["peak_table"](name, None)
        assert source == f"table: {label}" and peaks["bf16"] == bf16, name
    assert gpu["peak_table"]("Tesla T4", None)[1]["bf16"] is None  # no bf16 tensor cores: MFU null, with a reason
    assert gpu["peak_table"]("Some Future GPU", None) == (None, {})
    assert gpu["peak_table"]("NVIDIA H100 80GB HBM3", 5e14)[1] == {k: 5e14 for k in ("bf16", "fp16", "tf32", "fp32")}
    assert gpu["slug"]("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    # MFU = tokens/s per GPU x FLOPs per token / peak; global tokens/s from the slowest rank
    per_rank = [{"flops_per_token": 1e9, "stride": {"step_s_median": s, "step_s_p90": s, "step_s_max": s,
                                                    "step_s_mean": s, "steps_timed": 1, "resident_memory_gb": 1.0,
                                                    "step_peak_memory_gb": 1.0, "sm_clock_mhz_mean": None,
                                                    "power_w_mean": None, "power_w_max": None, "last_loss": 5.5}}
                for s in (0.1, 0.2)]
    fig = gpu["summarize"]("stride", per_rank, (2, 64, 2, 1000, 10), 2, 1e15, None)
    assert fig["tokens_per_second_per_gpu"] == pytest.approx(50_000)
    assert fig["tokens_per_second"] == pytest.approx(100_000)
    assert fig["mfu"] == pytest.approx(0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_small_bf16(tmp_path):
    out = tmp_path / "gpu.json"
    r = run_gpu_py(["--shapes", "S", "--modes", "bf16", "--compile", "off", "--ac", "off", "--steps", "5",
                    "--warmup", "2", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["device"]["type"] == "cuda"
    if rep["skipped"]:  # a pre-Ampere GPU has no bf16: skipped with the reason
        assert "bf16" in rep["skipped"][0]["reason"]
        return
    (res,) = rep["results"]
    check_loop(res["stride"])
    for fig in res["references"].values():
        check_loop(fig)
    assert res["stride"]["resident_memory_gb"] > 0 and res["reference"]["resident_memory_gb"] > 0
    assert res["stride"]["step_peak_memory_gb"] > 0 and res["reference"]["step_peak_memory_gb"] > 0
    assert res["params"] == pytest.approx(10.9e6, rel=0.05)
