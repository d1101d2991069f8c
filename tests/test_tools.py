"""The GPU tools' behaviour on a machine without a CUDA device (their GPU runs are measured, not tested)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cuda_present() -> bool:
    from w4pack.native import cuda

    return cuda.available()


@pytest.mark.skipif(_cuda_present(), reason="a CUDA device is present")
def test_profile_gpu_without_a_device_says_so():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_gpu.py"), "--shape", "256x128", "--m", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    # "no CUDA device: ..." here; "CUDA library unavailable: ..." where nvcc did not build the library
    assert len(lines) == 1 and lines[0].startswith("profile_gpu: "), r.stderr
    assert "Traceback" not in r.stderr


def test_bench_gpu_floors_need_no_device():
    # the two floors per shape (bytes at the measured read stream, FLOPs at cuBLAS's rate), as in
    # ../shared/reference/gpu-anchors.md: 27.0 us of bytes for a 70B layer at M = 1, 91.0 us of FLOPs at M = 128
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--floors", "--shapes",
                        "8192x28672,4096x4096", "--ms", "1,128"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("| 8192") or
            line.startswith("| 4096")}
    assert "**27.0** / 0.7" in rows["8192×28672"] and "29.0 / **91.0**" in rows["8192×28672"], r.stdout
    assert "**1.9** / 0.1" in rows["4096×4096"] and "2.4 / **6.5**" in rows["4096×4096"], r.stdout


def test_bench_gpu_tables_print_the_binding_floor(capsys):
    # the end-of-run tables from recorded rows (their GPU measurement is not testable here)
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    rows = [{"M": m, "w4pack_us": us, "cublas_mm_us": 117.0, "cublas_linear_us": 111.0, "tinygemm_us": 63.0,
             "gemlite_us": None, "w4pack_gbs": 2400.0, "plan": {"kernel": 4, "splits": 5}} for m, us in ((1, 50.0),
                                                                                                      (128, 130.0))]
    bench_gpu.print_tables("head", [(8192, 28672, rows)])
    out = capsys.readouterr().out.splitlines()
    assert "| 1 | 50.0 | 111.0 | 63.0 | - | 2.22x | 1.76x | - | 2400 | 53% | 27.0 | 4/5 |" in out
    assert any(line.startswith("| 128 | 130.0 |") and "| 91.0 |" in line for line in out)
    assert "  M=1: 2.22x" in out
