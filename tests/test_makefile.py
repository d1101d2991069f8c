"""The Makefile builds the CUDA library only where it can run, or when asked (`make cuda`, W4PACK_BUILD_CUDA=1).

`make -n` prints the commands a target would run without running them (recursive `$(MAKE)` lines excepted,
which recurse with -n too), so these tests see the build decision without building anything.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make not installed (apt-get install make)")


def _dry_run(target: str, gpu_visible: str, build_cuda: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("W4PACK_BUILD_CUDA", "MAKEFLAGS", "MAKELEVEL")}
    if build_cuda is not None:
        env["W4PACK_BUILD_CUDA"] = build_cuda
    proc = subprocess.run(["make", "-n", "--no-print-directory", target, "NVCC=/bin/true",
                           f"GPU_VISIBLE={gpu_visible}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("target", ["demo", "test"])
def test_no_cuda_build_without_a_gpu(target: str) -> None:
    out = _dry_run(target, "", None)
    assert "build.sh" not in out
    assert "no GPU visible (make cuda or W4PACK_BUILD_CUDA=1 builds it" in out


@pytest.mark.parametrize("target", ["demo", "test"])
def test_cuda_built_where_a_gpu_is_visible(target: str) -> None:
    assert "native/cuda/build.sh" in _dry_run(target, "1", None)


def test_cuda_built_when_asked() -> None:
    assert "native/cuda/build.sh" in _dry_run("test", "", "1")
    assert "native/cuda/build.sh" in _dry_run("cuda", "", None)
    assert "build.sh" not in _dry_run("test", "1", "0")


def test_ci_asks_for_the_cuda_build() -> None:
    """CI has nvcc and no GPU: it must still compile the library, so .ci/run asks for it."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "W4PACK_BUILD_CUDA=1 make test" in ci
