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
