"""CUDA library (w4pack.native.cuda, native/cuda/): it builds, loads and resolves its ABI everywhere (CI has nvcc
but no GPU). The planner's tests: test_cuda_planner.py; the kernels' (GPU): test_cuda_kernels.py."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from w4pack.native import cuda


def _lib_or_skip():
    if not cuda.library_path().exists():
        if shutil.which("nvcc") and os.environ.get("W4PACK_BUILD_CUDA") == "1":
            pytest.fail(f"W4PACK_BUILD_CUDA=1 and nvcc is installed but {cuda.library_path()} is missing: "
                        "`make cuda` must build it")
        pytest.skip("the CUDA library is not built: `make cuda` (needs nvcc, ~7 min) or W4PACK_BUILD_CUDA=1 make "
                    "test builds it (built automatically only where a GPU is visible)")
    return cuda._load()


def test_header_declares_the_cuda_entry_points():
    names = cuda.entry_points()
    assert names == ["w4p_cuda_abi_version", "w4p_cuda_last_error", "w4p_cuda_device_count", "w4p_cuda_plan",
                     "w4p_cuda_plan_for", "w4p_cuda_plan_describe", "w4p_cuda_plan_describe_for", "w4p_cuda_gemm",
                     "w4p_cuda_gemm_row", "w4p_cuda_dequantize", "w4p_cuda_decode_attention_workspace",
                     "w4p_cuda_decode_attention"]


def test_library_loads_and_resolves_every_entry_point():
    ffi, lib = _lib_or_skip()
    for name in cuda.entry_points():
        assert getattr(lib, name) is not None  # raises AttributeError on an undefined symbol
    assert lib.w4p_cuda_abi_version() == cuda.CUDA_ABI == 6


def test_a_library_missing_a_declared_entry_point_is_refused_at_load(tmp_path, monkeypatch):
    # a build of another revision with the same ABI version: refused with the name it lacks, not an
    # AttributeError at the first call
    _lib_or_skip()
    text = cuda.header_path().read_text().replace("int w4p_cuda_abi_version(void);",
                                                  "int w4p_cuda_abi_version(void);\nint w4p_cuda_not_built(void);")
    header = tmp_path / "w4pack.h"
    header.write_text(text)
    monkeypatch.setattr(cuda, "header_path", lambda: header)
    monkeypatch.setattr(cuda, "_state", {})
    with pytest.raises(cuda.UnsupportedError, match="has no w4p_cuda_not_built .rebuild with `make cuda`"):
        cuda._load()


def test_device_count_reports_cleanly():
    ffi, lib = _lib_or_skip()
    count = ffi.new("int *")
    rc = lib.w4p_cuda_device_count(count)
    if rc == 0:
        assert count[0] >= 1
        return
    assert rc == lib.W4P_ENODEVICE
    assert ffi.string(lib.w4p_cuda_last_error()).decode().startswith("no CUDA device")
    assert not cuda.available()
    assert cuda.unavailable_reason().startswith("no CUDA device")


def test_bad_arguments_come_back_as_codes():
    ffi, lib = _lib_or_skip()
    rc = lib.w4p_cuda_gemm(0, ffi.NULL, 1, 0, 16, 64, ffi.NULL, 64, ffi.NULL, 16, ffi.NULL, 4, 128, 0,
                           ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, 0, 0, 0)
    assert rc == lib.W4P_EINVAL
    assert "bad shape" in ffi.string(lib.w4p_cuda_last_error()).decode()
    rc = lib.w4p_cuda_gemm(0, ffi.NULL, 3, 1, 16, 64, ffi.NULL, 64, ffi.NULL, 16, ffi.NULL, 4, 128, 0,
                           ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, 0, 0, 0)
    assert rc == lib.W4P_EUNSUPPORTED
    one = ffi.new("char[16]")

    def row(prologue, norm_weight, eps):
        return lib.w4p_cuda_gemm_row(0, ffi.NULL, 1, 16, 64, one, one, ffi.NULL, 4, 128, 0, ffi.NULL, ffi.NULL,
                                     ffi.NULL, ffi.NULL, ffi.NULL, prologue, norm_weight, eps, ffi.NULL, 0)

    last = lambda: ffi.string(lib.w4p_cuda_last_error()).decode()  # noqa: E731
    assert row(lib.W4P_ROW_RMSNORM, ffi.NULL, 1e-6) == lib.W4P_EINVAL and "norm_weight is required" in last()
    assert row(lib.W4P_ROW_RMSNORM, one, float("nan")) == lib.W4P_EINVAL and "norm_eps" in last()
    assert row(3, ffi.NULL, 0.0) == lib.W4P_EINVAL and "prologue 3" in last()
    assert row(lib.W4P_ROW_RESIDUAL | 3, ffi.NULL, 0.0) == lib.W4P_EINVAL and "prologue 11" in last()
    assert row(lib.W4P_ROW_RESIDUAL | lib.W4P_ROW_SWIGLU, ffi.NULL, 0.0) == lib.W4P_EINVAL
    assert "needs the residual as bias" in last()
    assert (lib.W4P_ROW_PLAIN, lib.W4P_ROW_RMSNORM, lib.W4P_ROW_SWIGLU) == tuple(cuda.PROLOGUES.values())
    assert lib.W4P_ROW_RESIDUAL == cuda._ROW_RESIDUAL

    def attn(dtype=1, heads=8, kv=2, d=64, cos=one, sin=one, splits=2, ws=one, ws_bytes=1 << 20):
        return lib.w4p_cuda_decode_attention(0, ffi.NULL, dtype, heads, kv, d, one, cos, sin,
                                             ffi.cast("int64_t *", one), one, one, 16, 0.125, one, splits, ws,
                                             ws_bytes)

    assert attn(dtype=3) == lib.W4P_EUNSUPPORTED and "fp16 or bf16" in last()
    assert attn(heads=7) == lib.W4P_EINVAL and "multiple of kv_heads" in last()
    assert attn(heads=18) == lib.W4P_EUNSUPPORTED and "at most 8" in last()
    assert attn(d=96) == lib.W4P_EUNSUPPORTED and "head_dim 96" in last()
    assert attn(splits=65) == lib.W4P_EINVAL and "splits 65" in last()
    assert attn(sin=ffi.NULL) == lib.W4P_EINVAL and "both or neither" in last()
    need = lib.w4p_cuda_decode_attention_workspace(8, 2, 64, 2)
    assert need == 256 + 2 * 2 * 4 * 66 * 4 and lib.w4p_cuda_decode_attention_workspace(8, 2, 64, 1) == 0
    assert attn(ws_bytes=need - 1) == lib.W4P_EINVAL and f"{need} needed" in last()


def test_library_plans_as_the_host_planner(monkeypatch):
    # the planner compiled into the library (nvcc's host compiler) gives the golden H200 plans, as the host-only
    # build of tests/test_cuda_planner.py does
    import importlib.util
    import os
    from pathlib import Path

    ffi, lib = _lib_or_skip()
    for var in [v for v in os.environ if v.startswith("W4P_CUDA_")]:
        monkeypatch.delenv(var)
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("cuda_plans", root / "tools" / "cuda_plans.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    want = (root / "tests" / "data" / "cuda_plans_h200.tsv").read_text().splitlines()
    assert tool.golden_rows(ffi, lib) == want



# The build options CUDA.md offers for A/Bs, built only on demand (W4PACK_CUDA_OPTIONS=1: `make test-cuda-options`,
# which CI runs; ~2.5 min of nvcc): compiled for the architecture they are measured on, so one that no longer
# builds or spills registers fails before a GPU call is spent.
# (source, define, the fewest kernels it must hold)
OPTION_BUILDS = [("kernel_gemv.cu", d, 54) for d in ("-DW4P_GV_STAGES=3", "-DW4P_GV_RING=4", "-DW4P_GV_PROBE=1",
                                                     "-DW4P_GV_PROBE=4", "-DW4P_GV_PAR=0", "-DW4P_GV_PAR=1")]
OPTION_BUILDS += [("kernel_wgmma_ws.cu", "-DW4P_WS_GRP=1", 72)]
# sources whose default build spills somewhere (the bf16 and fp16 stream-K 256-row wgmma_ws kernels): there an
# option may spill where the default does, no more; the others' options may not spill at all
SPILLING_DEFAULTS = ("kernel_wgmma_ws.cu",)


@pytest.fixture(scope="module")
def option_builds(tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """ptxas's report of every option's build and of SPILLING_DEFAULTS' default builds (define ""), run side by
    side: each is one core's work for 20-60 s."""
    if os.environ.get("W4PACK_CUDA_OPTIONS") != "1":
        pytest.skip("the CUDA build options compile on demand (~2.5 min of nvcc): make test-cuda-options")
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc is not installed")
    native = Path(__file__).resolve().parent.parent / "native"
    out = tmp_path_factory.mktemp("options")
    builds = [(src, d) for src, d, _ in OPTION_BUILDS]
    builds += [(src, "") for src in SPILLING_DEFAULTS]
    builds.sort(key=lambda b: "wgmma" not in b[0])  # the longest builds first

    def build(i: int, src: str, define: str) -> subprocess.CompletedProcess:
        return subprocess.run([nvcc, "-O3", "-std=c++17", "-c", "-diag-suppress", "177", *([define] if define else []),
                               "-gencode=arch=compute_90a,code=sm_90a", f"-I{native}", "-Xptxas", "-v",
                               str(native / "cuda" / src), "-o", str(out / f"{i}.o")],
                              capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = {key: pool.submit(build, i, *key) for i, key in enumerate(builds)}
        return {key: f.result() for key, f in futures.items()}


def spilling_kernels(report: str) -> dict[str, str]:
    """ptxas -v: each kernel that spills, with its spill line (names without the anonymous namespace's per-build
    hash)."""
    spills, kernel = {}, None
    for line in report.splitlines():
        if "Compiling entry function" in line:
            kernel = re.sub(r"_GLOBAL__N__[a-z0-9_]*_cu_[0-9a-f]*_[0-9]*", "", line.split("'")[1])
        elif "spill" in line and "0 bytes spill stores, 0 bytes spill loads" not in line:
            spills[kernel] = line.strip()
    return spills


@pytest.mark.parametrize("src,define,kernels", OPTION_BUILDS)
def test_the_kernels_build_options_compile_without_new_spills(src, define, kernels, option_builds):
    r = option_builds[(src, define)]
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("Compiling entry function") >= kernels, r.stderr[-2000:]
    default = {}
    if src in SPILLING_DEFAULTS:
        base = option_builds[(src, "")]
        assert base.returncode == 0, base.stderr[-2000:]
        default = spilling_kernels(base.stderr)
    new = {k: v for k, v in spilling_kernels(r.stderr).items() if default.get(k) != v}
    assert not new, list(new.items())[:4]

