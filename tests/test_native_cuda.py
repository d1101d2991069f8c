"""CUDA GEMM (w4pack.native.cuda, native/cuda/): the library builds, loads and resolves its ABI everywhere;
on a GPU (``gpu`` marker) the kernels match the float64 reference for every option, write every output,
repeat bit for bit and run under CUDA graph capture."""
from __future__ import annotations

import shutil
import zlib

import numpy as np
import pytest

from w4pack.canonical import CanonicalLayer, default_g_idx
from w4pack.dtypes import from_float32, to_float64
from w4pack.layout import pack
from w4pack.native import cuda

# -- everywhere (CI has nvcc but no GPU) -------------------------------------------------------------------


# switches the native planner reads at each call (A/B runs, tests); the build's own variables are left alone
_BUILD_VARS = {"W4P_CUDA_ARCHS", "W4P_CUDA_FORCE", "W4P_CUDA_OUT", "W4P_CUDA_DEFINES", "W4P_CUDA_DEBUG"}


@pytest.fixture(autouse=True)
def _no_planner_switches(monkeypatch):
    """Each test starts from the planner's own choices, whatever the shell or an earlier test left set."""
    import os

    for var in [v for v in os.environ if v.startswith("W4P_CUDA_") and v not in _BUILD_VARS]:
        monkeypatch.delenv(var)


def _lib_or_skip():
    if not cuda.library_path().exists():
        if shutil.which("nvcc"):
            pytest.fail(f"nvcc is installed but {cuda.library_path()} is missing: `make cuda` must build it")
        pytest.skip("no nvcc and no prebuilt libw4p_cuda.so")
    return cuda._load()


def test_header_declares_the_cuda_entry_points():
    names = cuda.entry_points()
    assert names == ["w4p_cuda_abi_version", "w4p_cuda_last_error", "w4p_cuda_device_count", "w4p_cuda_plan",
                     "w4p_cuda_plan_for", "w4p_cuda_plan_describe", "w4p_cuda_plan_describe_for", "w4p_cuda_gemm",
                     "w4p_cuda_dequantize"]


def test_library_loads_and_resolves_every_entry_point():
    ffi, lib = _lib_or_skip()
    for name in cuda.entry_points():
        assert getattr(lib, name) is not None  # raises AttributeError on an undefined symbol
    assert lib.w4p_cuda_abi_version() == 1


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


# The planner for described devices runs without a GPU: the per-shape choice and every forced kernel's
# feasibility are checked in CI. (multiprocessors, compute capability, shared memory per SM / per block / reserved)
H200 = (132, 90, 233472, 232448, 1024)
A100 = (108, 80, 167936, 166912, 1024)


def _plan_for(lib, ffi, dev, m, n, k, bits=4, gs=128, act=0, aligned=1, kernel="auto", splits=0):
    ko, so, wb = ffi.new("int *"), ffi.new("int *"), ffi.new("size_t *")
    rc = lib.w4p_cuda_plan_for(*dev, m, n, k, bits, gs, act, aligned, cuda.KERNELS[kernel], splits, ko, so, wb)
    return rc, ko[0], so[0], wb[0]


def test_plan_for_described_devices_auto(monkeypatch):
    ffi, lib = _lib_or_skip()
    k = cuda.KERNELS

    def auto(dev, m, n, kk, **kw):
        rc, kind, _, ws = _plan_for(lib, ffi, dev, m, n, kk, **kw)
        assert rc == 0, ffi.string(lib.w4p_cuda_last_error()).decode()
        assert ws >= 64 * 1024  # the tile counters at least
        return kind

    # H200 (sm_90): gemv at M = 1 where its whole-stripe blocks fill their rounds (test_plan_for_gemv), bulk up to
    # M = 4 everywhere else (up to 8 on large layers), stream otherwise up to 8, then wgmma_ws; tiled beyond
    # (Python takes the dense path from DENSE_MIN_M on)
    for n, kk in ((28672, 8192), (8192, 28672), (4096, 4096), (11008, 4096), (196, 576)):
        for m in (1, 2, 4):
            assert auto(H200, m, n, kk) == (k["gemv"] if (m, n) == (1, 11008) else k["bulk"]), (m, n, kk)
    # bulk up to M = 8 on layers of 2^25 weights or more and on those of one-stripe units (at most 264 stripes),
    # the stream kernel from M = 5 on the other ones
    for n, kk in ((28672, 8192), (8192, 28672), (11008, 4096), (4096, 11008), (12288, 4096), (4096, 4096),
                  (4224, 2048), (196, 576)):
        for m in (5, 7, 8):
            assert auto(H200, m, n, kk) == k["bulk"], (m, n, kk)
    assert auto(H200, 5, 4240, 4096) == k["stream"]  # 265 stripes
    assert auto(H200, 8, 6144, 4096) == k["stream"]
    assert auto(H200, 8, 4096, 4096, bits=8) == k["stream"]
    # the warp-specialized wgmma kernel from M = 9: up to 32 on every layer, up to 128 on layers of 2^25
    # weights or more, up to 256 on layers of 2^26 or more, and up to 512 on layers of 2^24 or more where its
    # blocks fit in one wave (past 256 only with the last 128-token tile more than half full)
    assert auto(H200, 8, 8192, 28672, gs=48) == k["wgmma_ws"]  # a group size the bulk kernel does not take
    assert auto(H200, 9, 28672, 8192) == k["wgmma_ws"]
    assert auto(H200, 9, 4096, 4096) == k["wgmma_ws"]
    assert auto(H200, 16, 4096, 4096) == k["wgmma_ws"]
    assert auto(H200, 32, 4096, 4096) == k["wgmma_ws"]
    for m in (33, 64, 128, 129, 256, 321, 384, 449, 512):
        assert auto(H200, m, 4096, 4096) == k["wgmma_ws"], m  # 32 row tiles x ceil(m / 128)
    for m in (257, 320, 385, 448):
        assert auto(H200, m, 4096, 4096) == k["tiled"], m
    assert auto(H200, 513, 4096, 4096) == k["wgmma_ws"]  # 110 blocks of 192 rows: one wave
    assert auto(H200, 33, 2048, 4096) == k["tiled"]  # 2^23 weights
    assert auto(H200, 512, 4096, 11008) == k["wgmma_ws"]  # 128 tiles
    assert auto(H200, 384, 12288, 4096) == k["wgmma_ws"]  # 192 blocks of 192 rows (wgmma_ss's 144 fill 55%)
    assert auto(H200, 64, 28672, 8192) == k["wgmma_ws"]
    assert auto(H200, 256, 8192, 28672) == k["wgmma_ws"]
    assert auto(H200, 300, 8192, 28672) == k["wgmma_ws"]  # 129 blocks of 192 rows (wgmma_ss: 96 x 4 splits)
    assert auto(H200, 128, 11008, 4096) == k["wgmma_ws"]  # 2^25 weights or more: up to M = 128
    assert auto(H200, 129, 11008, 4096) == k["wgmma_ws"]  # 116 blocks of 192 rows
    assert auto(H200, 16, 4096, 4096, gs=-1) == k["wgmma_ws"]  # per-channel
    assert auto(H200, 16, 4096, 4096, gs=32) == k["wgmma_ws"]
    assert auto(H200, 16, 4096, 4096, bits=8) == k["stream"]  # 4-bit only
    # wgmma_ws in 256-row blocks where that grid fills the waves (test_plan_for_wgmma_ws_256_row_blocks), over
    # wgmma_ss and the dense path: 112 row blocks from M = 65 to 1024
    for m in (65, 100, 128, 200, 256, 257, 512, 513, 640, 768, 769, 896, 1024):  # (M = 513-768: 192 rows)
        assert auto(H200, m, 28672, 8192) == k["wgmma_ws"], m
        assert auto(H200, m, 28672, 8192, gs=-1) == k["wgmma_ws"], m
        assert auto(H200, m, 28672, 8192, gs=32) == k["wgmma_ws"], m
        assert auto(H200, m, 28672, 8192, bits=8) not in (k["wgmma_ss"], k["wgmma_ws"]), m
    assert auto(H200, 1025, 28672, 8192) == k["tiled"]
    assert auto(H200, 64, 28672, 8192) == k["wgmma_ws"]
    for m, n, kk in ((384, 11008, 4096), (512, 8192, 28672), (256, 8192, 28672)):
        assert auto(H200, m, n, kk) == k["wgmma_ws"], (m, n, kk)
    assert auto(H200, 512, 11008, 4096) == k["wgmma_ws"]  # 232 blocks of 192 rows (wgmma_ss: 172, 65%)
    # M = 1024 on the 7B shapes: the 256-token tile (test_plan_for_wgmma_ws_256_token_tile), ahead of the dense path
    # on 4096x11008 too (344 blocks: three waves against the 128-token tile's 344 of 256 rows); without it the
    # 256-row grids that fill 97% of their waves, and the dense path for 4096x11008 (87%)
    for n, kk in ((4096, 4096), (4096, 11008), (12288, 4096), (11008, 4096)):
        assert auto(H200, 1024, n, kk) == k["wgmma_ws"], (n, kk)
    monkeypatch.setenv("W4P_CUDA_WS_TOK", "128")
    for n, kk in ((4096, 4096), (4096, 11008), (12288, 4096)):
        assert auto(H200, 1024, n, kk) == k["wgmma_ws"], (n, kk)
    assert auto(H200, 1024, 11008, 4096) == k["tiled"]
    monkeypatch.delenv("W4P_CUDA_WS_TOK")
    assert auto(A100, 128, 28672, 8192) == k["tiled"]

    assert auto(A100, 32, 4096, 4096) == k["stream"]
    assert auto(A100, 64, 28672, 8192) == k["tiled"]
    # A100 (sm_80): no bulk kernel; ring on the 70B shapes at M = 1
    assert auto(A100, 1, 28672, 8192) == k["ring"]
    assert auto(A100, 1, 4096, 4096) == k["stream"]


def test_plan_for_wgmma_ss_ranges(monkeypatch):
    ffi, lib = _lib_or_skip()
    k = cuda.KERNELS

    def auto(dev, m, n, kk, **kw):
        rc, kind, _, _ = _plan_for(lib, ffi, dev, m, n, kk, **kw)
        assert rc == 0, ffi.string(lib.w4p_cuda_last_error()).decode()
        return kind

    # in wgmma_ws's range from M = 65, the wgmma_ss kernel where its 256-row x 128-token blocks fill half the SMs
    # unsplit (group sizes of whole K tiles), unless wgmma_ws's 256-row blocks fill the waves (here turned off)
    monkeypatch.setenv("W4P_CUDA_WS_RS", "1")
    for m in (65, 100, 128, 200, 256):
        assert auto(H200, m, 28672, 8192) == k["wgmma_ss"], m  # 112 row blocks
        assert auto(H200, m, 28672, 8192, gs=-1) == k["wgmma_ss"], m
        assert auto(H200, m, 28672, 8192, gs=32) == k["wgmma_ws"], m  # two groups per K tile
        assert auto(H200, m, 28672, 8192, bits=8) != k["wgmma_ss"], m
    # M = 257-512: wgmma_ss where its blocks fill the waves (80% unsplit, or 90% with 4 splits of 64+ K tiles)
    for m, n, kk, splits in ((257, 28672, 8192, 1), (512, 28672, 8192, 1), (384, 11008, 4096, 1),
                             (300, 8192, 28672, 4), (512, 8192, 28672, 1)):
        rc, kind, got, _ = _plan_for(lib, ffi, H200, m, n, kk)
        assert rc == 0 and kind == k["wgmma_ss"] and got == splits, (m, n, kk, kind, got)
    assert auto(H200, 513, 28672, 8192) == k["tiled"]
    # in the dense path's range from M = 160 (86 and 96 blocks)
    for m in (160, 192, 256):
        assert auto(H200, m, 11008, 4096) == k["wgmma_ss"], m
        assert auto(H200, m, 12288, 4096) == k["wgmma_ss"], m
    monkeypatch.delenv("W4P_CUDA_WS_RS")
    assert auto(H200, 300, 8192, 28672) == k["wgmma_ws"]  # 96 blocks of 256 rows: 73%; 129 of 192 rows: 98%
    # where wgmma_ss would run unsplit, wgmma_ws's 256-row blocks (the same tiles) where they run unsplit too
    # (192-row blocks turned off: they take these layers at these M, test_plan_for_wgmma_ws_192_row_blocks)
    monkeypatch.setenv("W4P_CUDA_WS_ROWS", "256")
    for m in (160, 192, 256):
        for n in (11008, 12288):
            got = _describe_for(lib, ffi, H200, m, n, 4096)
            assert (got["kernel"], got.get("rows"), got["splits"]) == ("wgmma_ws", "256", "1"), (m, n, got)
        assert auto(H200, m, 4096, 11008) == k["wgmma_ws"], m  # 16 wgmma_ss blocks x 2; 64 wgmma_ws tiles
    assert auto(H200, 159, 11008, 4096) == k["tiled"]
    assert auto(H200, 128, 11008, 4096) == k["wgmma_ws"]  # 43 blocks: would need a split
    assert auto(H200, 256, 8192, 28672) == k["wgmma_ws"]  # 32 row blocks x 2
    monkeypatch.delenv("W4P_CUDA_WS_ROWS")
    assert _describe_for(lib, ffi, H200, 159, 11008, 4096).get("rows") == "192"


def test_plan_for_without_tma_falls_back_to_wgmma(monkeypatch):
    # a driver without the TMA encoder (simulated): auto takes the one-pass wgmma kernel in wgmma_ws's range
    ffi, lib = _lib_or_skip()
    k = cuda.KERNELS
    monkeypatch.setenv("W4P_CUDA_NO_TMA", "1")
    for m, n, kk in ((9, 4096, 4096), (16, 28672, 8192), (128, 11008, 4096), (256, 8192, 28672), (128, 28672, 8192)):
        rc, kind, _, _ = _plan_for(lib, ffi, H200, m, n, kk)
        assert rc == 0 and kind == k["wgmma"], (m, n, kk, kind)
    assert _plan_for(lib, ffi, H200, 192, 11008, 4096)[1] == k["tiled"]  # wgmma_ss's dense-path range: unchanged
    assert _plan_for(lib, ffi, H200, 5, 6144, 4096)[1] == k["stream"]  # below the range: unchanged
    assert _plan_for(lib, ffi, H200, 16, 4096, 4096, kernel="wgmma_ws")[1] == k["wgmma_ws"]  # forced: as asked
    monkeypatch.delenv("W4P_CUDA_NO_TMA")
    assert _plan_for(lib, ffi, H200, 16, 28672, 8192)[1] == k["wgmma_ws"]


def test_plan_for_wgmma_ws_splits():
    # split-K for the warp-specialized kernel (an H200 has 132 SMs, 2 blocks each up to the 64-token tile):
    # enough splits for every block slot where the grid leaves more than half of them idle, at least 16 K tiles
    # per split; two splits (summed in a cluster) where the unsplit grid fills half the slots and two still fit;
    # from the 64-token tile, fewer splits whose clusters fit in one wave where the shorter K range is worth less
    # than the workspace sums it saves
    ffi, lib = _lib_or_skip()
    k = cuda.KERNELS
    for m, n, kk, want in ((32, 12288, 4096, 2), (64, 11008, 4096, 2),                        # 96, 86 tiles
                           (20, 28672, 4096, 1),                                              # 224 tiles
                           (32, 4096, 4096, 4), (64, 4096, 11008, 7), (48, 8192, 28672, 4),   # 32, 32, 64 tiles
                           (128, 4096, 11008, 3),               # one block per SM: 3 cluster splits fit
                           (128, 4096, 4096, 3), (64, 8192, 28672, 4),  # 4096-K; 448 K tiles: 4 via workspace
                           (100, 11008, 4096, 2),   # 58 tiles of 192 rows (86 of 128 rows unsplit)
                           (16, 12288, 4096, 2), (9, 11008, 4096, 3)):                        # 16-token tile
        rc, kind, splits, _ = _plan_for(lib, ffi, H200, m, n, kk)
        assert rc == 0 and kind == k["wgmma_ws"] and splits == want, (m, n, kk, kind, splits)
    assert _plan_for(lib, ffi, H200, 32, 12288, 4096, kernel="wgmma_ws", splits=3)[2] == 3  # forced: as asked
    assert _plan_for(lib, ffi, A100, 32, 12288, 4096, kernel="wgmma_ws")[0] == lib.W4P_EUNSUPPORTED


def test_plan_describes_cluster_sums(monkeypatch):
    # wgmma_ws / wgmma_ss with 2-8 splits sum them in a cluster (the workspace still holds the partials: the
    # launch falls back on it where the device holds fewer clusters than blocks); W4P_CUDA_CLUSTER=0 turns it off
    ffi, lib = _lib_or_skip()
    def sums(*args, **kw):
        got = _describe_for(lib, ffi, H200, *args, **kw)
        return got["splits"], got.get("sum")

    assert sums(64, 11008, 4096) == ("2", "cluster")
    assert sums(128, 4096, 4096, kernel="wgmma_ss", splits=8) == ("8", "cluster")
    assert sums(128, 4096, 4096, kernel="wgmma_ss", splits=9) == ("9", "workspace")
    assert sums(128, 4096, 4096, kernel="wgmma", splits=4) == ("4", "workspace")
    assert sums(128, 4096, 4096, kernel="wgmma_ss", splits=1) == ("1", None)
    monkeypatch.setenv("W4P_CUDA_CLUSTER", "0")
    assert sums(128, 4096, 4096, kernel="wgmma_ss", splits=8) == ("8", "workspace")
    assert _plan_for(lib, ffi, H200, 64, 11008, 4096)[2] == 1  # no cluster: unsplit


def test_plan_for_wgmma_ws_256_row_blocks(monkeypatch):
    # the 128-token tile in 256-row blocks where that grid, split in two at most, fills 84% of the waves it
    # takes (90% past M = 512): layers of 2^25 weights or more up to M = 1024, of 2^24 or more from M = 769;
    # W4P_CUDA_WS_RS=1|2 forces
    ffi, lib = _lib_or_skip()
    monkeypatch.setenv("W4P_CUDA_WS_SK", "0")  # the plain grid (stream-K's rule: test_plan_for_wgmma_ws_stream_k)
    monkeypatch.setenv("W4P_CUDA_WS_TOK", "128")  # the 128-token tile's rules (the 256-token tile's: its own test)

    def ws(m, n, kk, **kw):
        got = _describe_for(lib, ffi, H200, m, n, kk, **kw)
        return got["kernel"], got.get("rows"), got["splits"], got["tiles"]

    for m in (65, 128, 256, 512, 896, 1024):  # 112 row blocks: 85% of 132 SMs (99% at M = 896, 97% at 1024)
        assert ws(m, 28672, 8192) == ("wgmma_ws", "256", "1", str(112 * -(-m // 128))), m
    for m in (640, 768):  # 85%: past M = 512 only from 90% (192-row blocks there: 750 and 900, 95% and 97%)
        assert ws(m, 28672, 8192)[1] == "192", m
    assert ws(1024, 8192, 28672) == ("wgmma_ws", "256", "1", "256")  # 97%
    assert ws(256, 8192, 28672) == ("wgmma_ws", "256", "2", "64")  # 32 row blocks x 2 token tiles, 2 splits
    assert ws(512, 8192, 28672) == ("wgmma_ws", "256", "1", "128")
    assert ws(128, 8192, 28672)[1] is None  # 4 splits
    assert ws(384, 8192, 28672)[1] == "192"  # 96 blocks: 73%; 129 of 192 rows: 98%
    assert ws(384, 11008, 4096) == ("wgmma_ws", "256", "1", "129")  # 43 row blocks x 3: 98%
    assert ws(512, 11008, 4096)[1] == "192"  # 172 blocks: 65%; 232 of 192 rows: 88% of two waves
    assert ws(1024, 11008, 4096)[1] is None  # 344 blocks: 87%
    assert ws(1024, 12288, 4096) == ("wgmma_ws", "256", "1", "384")  # 97%
    assert ws(1024, 4096, 11008) == ("wgmma_ws", "256", "1", "128")  # 97%
    assert ws(896, 4096, 11008)[1] is None  # 112 blocks: 85%
    assert ws(1024, 4096, 4096) == ("wgmma_ws", "256", "1", "128")  # 2^24 weights, from M = 769
    assert ws(768, 4096, 4096)[1] == "192"  # 132 blocks of 192 rows
    assert ws(1024, 2048, 4096)[1] is None  # 2^23 weights
    assert ws(512, 4096, 11008) == ("wgmma_ws", "256", "2", "64")
    assert ws(512, 4096, 4096)[1] is None  # 2^24 weights
    assert ws(2048, 28672, 8192)[1] is None  # past M = 1024: the dense path
    assert ws(64, 28672, 8192)[1] is None  # the 64-token tile keeps 128-row blocks
    assert ws(128, 28672, 8192, kernel="wgmma_ws") == ("wgmma_ws", "256", "1", "112")  # forced kernel: same rule
    assert ws(128, 28672, 8192, gs=32) == ("wgmma_ws", "256", "1", "112")
    monkeypatch.setenv("W4P_CUDA_WS_RS", "1")
    assert ws(128, 28672, 8192)[1] is None
    monkeypatch.setenv("W4P_CUDA_WS_RS", "2")
    assert ws(100, 4096, 4096, kernel="wgmma_ws")[1] == "256"
    assert ws(64, 4096, 4096, kernel="wgmma_ws")[1] is None  # only the 128-token tile has them


def test_plan_for_wgmma_ws_192_row_blocks(monkeypatch):
    # the 128-token tile in 192-row blocks (three consumer warpgroups) up to M = 1024 on layers of 2^24 weights or
    # more, where a wave model ranks their grid at least 5% ahead of the 128- and 256-row grids (unsplit, split in
    # two within one wave, or stream-K), in two splits themselves up to M = 128 where exactly two fill one wave;
    # W4P_CUDA_WS_ROWS=128|192|256 forces the rows
    ffi, lib = _lib_or_skip()
    monkeypatch.setenv("W4P_CUDA_WS_TOK", "128")  # the 128-token tile's rules (the 256-token tile's: its own test)

    def ws(m, n, kk, **kw):
        got = _describe_for(lib, ffi, H200, m, n, kk, **kw)
        return got["kernel"], got.get("rows"), got.get("splits"), got["tiles"], "stream-k" in got

    for m in (129, 192, 256):  # one wave of 116 / 128 blocks against 86 / 96 of 256 rows, 172 / 192 of 128
        assert ws(m, 11008, 4096) == ("wgmma_ws", "192", "1", "116", False), m
        assert ws(m, 12288, 4096) == ("wgmma_ws", "192", "1", "128", False), m
    assert ws(512, 11008, 4096) == ("wgmma_ws", "192", "1", "232", False)  # 2 waves against 3 and 2 of 256 rows
    assert ws(384, 12288, 4096) == ("wgmma_ws", "192", "1", "192", False)
    assert ws(512, 12288, 4096) == ("wgmma_ws", "192", "1", "256", False)
    assert ws(384, 8192, 28672) == ("wgmma_ws", "192", "1", "129", False)
    assert ws(384, 11008, 4096)[1] == "256"  # 129 blocks of 256 rows: one wave
    for m in (65, 100, 128):  # two splits of 58 / 64 tiles in one wave against 86 / 96 blocks of 128 rows
        assert ws(m, 11008, 4096)[1:4] == ("192", "2", "58"), m
        assert ws(m, 12288, 4096)[1:4] == ("192", "2", "64"), m
    assert ws(128, 4096, 4096)[1] is None and ws(128, 4096, 11008)[1] is None  # 128 rows split fit better
    for m in (129, 256, 512):  # stream-K ahead
        assert ws(m, 28672, 8192)[1:] == ("256", None, "224" if m <= 256 else "448", True), m
    assert ws(256, 8192, 28672)[1:3] == ("256", "2")  # 64 blocks of 256 rows, two splits in one wave
    assert ws(256, 4096, 11008)[1:3] == (None, "2")  # 64 of 128 rows, two splits in one wave
    assert ws(256, 4096, 4096)[1] is None
    assert ws(1024, 12288, 4096)[1] == "256"  # 512 blocks of 192 rows: four waves against three of 256 rows
    for m in (513, 640, 704, 768):  # one or two waves where 256 rows take two or more, 128 rows more
        assert ws(m, 4096, 4096)[1] == ws(m, 4096, 11008)[1] == ws(m, 28672, 8192)[1] == "192", m
    assert ws(704, 12288, 4096)[1] == "192" and ws(640, 12288, 4096)[1] == "256"
    assert ws(896, 11008, 4096)[1] != "192" and ws(1025, 4096, 4096)[0] != "wgmma_ws"
    assert ws(64, 12288, 4096)[1] is None  # the 64-token tile
    assert ws(256, 6144, 2048)[1] is None  # 2^23.6 weights
    assert ws(256, 11008, 4096, kernel="wgmma_ws")[1] == "192"  # forced kernel: same rule
    monkeypatch.setenv("W4P_CUDA_WS_ROWS", "128")
    assert ws(256, 11008, 4096)[1] is None
    monkeypatch.setenv("W4P_CUDA_WS_ROWS", "256")
    assert ws(256, 11008, 4096)[1] == "256"
    monkeypatch.setenv("W4P_CUDA_WS_ROWS", "192")
    assert ws(100, 600, 1000, kernel="wgmma_ws")[1:4] == ("192", "1", "4")  # 600 rows: 4 blocks
    assert ws(64, 600, 1000, kernel="wgmma_ws")[1] is None  # only the 128-token tile has them
    # a forced height keeps its own rule for auto's kernel choice and turns the others off: 4096x11008 at M = 150
    # (dense before 192-row blocks) stays wgmma_ws with 192 rows forced, goes dense with 256 or 128 rows forced
    assert ws(150, 11008, 4096)[:2] == ("wgmma_ws", "192")
    for rows, want in (("256", "dense"), ("128", "dense")):
        monkeypatch.setenv("W4P_CUDA_WS_ROWS", rows)
        assert _describe_for(lib, ffi, H200, 150, 11008, 4096)["kernel"] in (want, "tiled"), rows


def test_plan_for_wgmma_ws_256_token_tile(monkeypatch):
    # the 256-token tile (128-row blocks) at M = 192-1024 on layers of 2^24 weights or more, where its last token tile
    # is at least three quarters full and the wave model ranks its grid 5% ahead of the 128-token tile's (0.89 of a
    # 256-row wave; two splits in one wave 0.89 x (1/2 + 8 / K tiles)); W4P_CUDA_WS_TOK=256 forces it from M = 129,
    # =128 turns it off, and so does a forced block height
    ffi, lib = _lib_or_skip()

    def ws(m, n, kk, **kw):
        got = _describe_for(lib, ffi, H200, m, n, kk, **kw)
        return got["kernel"], got.get("tokens"), got.get("splits"), got["tiles"]

    # M = 1024 on the six Llama shapes: one wave where 256-row blocks take one, three where they take three, ...
    for n, kk, tiles in ((4096, 4096, 128), (11008, 4096, 344), (4096, 11008, 128), (12288, 4096, 384),
                         (28672, 8192, 896), (8192, 28672, 256)):
        assert ws(1024, n, kk) == ("wgmma_ws", "256", "1", str(tiles)), (n, kk)
        assert ws(960, n, kk)[1] == "256" and ws(959, n, kk)[1] is None, (n, kk)  # 3/4 of the last tile
    for m in (192, 224, 256):  # 224 blocks in two waves against stream-K's 1.95
        assert ws(m, 28672, 8192) == ("wgmma_ws", "256", "1", "224"), m
        assert ws(m, 8192, 28672) == ("wgmma_ws", "256", "2", "64"), m  # two splits of K = 28672 in one wave
    assert ws(191, 28672, 8192)[1] is None and ws(129, 8192, 28672)[1] is None
    for m in (448, 512):
        assert ws(m, 8192, 28672) == ("wgmma_ws", "256", "1", "128"), m  # one wave against 256 rows' one
        assert ws(m, 4096, 11008) == ("wgmma_ws", "256", "2", "64"), m  # K = 11008: the split's sum pays
        assert ws(m, 4096, 4096)[1] is None, m  # K = 4096: it does not
    assert ws(512, 28672, 8192)[1] is None  # 4 waves against stream-K's 3.64: under 5%
    for m in (704, 768):  # 258 blocks: two waves against 256 rows' two of 1.0
        assert ws(m, 11008, 4096)[1] == "256", m
    assert ws(768, 4096, 4096)[1] is None and ws(768, 12288, 4096)[1] is None  # 192-row blocks fit better
    assert ws(256, 11008, 4096)[1] is None  # 192-row blocks: one wave of 0.79
    assert ws(1024, 6144, 2048)[1] is None  # 2^23.6 weights
    assert ws(1025, 4096, 4096)[0] != "wgmma_ws"
    assert ws(1024, 4096, 4096, kernel="wgmma_ws")[1] == "256"  # forced kernel: same rule
    assert ws(1024, 4096, 4096, kernel="wgmma_ws", splits=3)[1:3] == ("256", "3")
    monkeypatch.setenv("W4P_CUDA_WS_TOK", "128")
    assert ws(1024, 4096, 4096)[1] is None
    monkeypatch.setenv("W4P_CUDA_WS_TOK", "256")
    assert ws(129, 4096, 4096, kernel="wgmma_ws")[1] == "256"
    assert ws(128, 4096, 4096, kernel="wgmma_ws")[1] is None
    monkeypatch.setenv("W4P_CUDA_WS_ROWS", "256")
    assert ws(1024, 4096, 4096) == ("wgmma_ws", None, "1", "128")


def test_plan_for_wgmma_ws_stream_k(monkeypatch):
    # the 256-row blocks as stream-K: one block per SM (never more than the tiles' stages), each taking an equal run
    # of stages; partial tiles sum through two workspace tiles per block. W4P_CUDA_WS_SK=0|1 forces it; forced
    # splits and the copies-only probe keep the plain grid
    ffi, lib = _lib_or_skip()
    monkeypatch.setenv("W4P_CUDA_WS_TOK", "128")  # the 128-token tile's rules (the 256-token tile's: its own test)
    monkeypatch.setenv("W4P_CUDA_WS_SK", "1")
    got = _describe_for(lib, ffi, H200, 256, 28672, 8192)
    assert (got["kernel"], got["stream-k"], got["rows"], got["tiles"]) == ("wgmma_ws", "132", "256", "224"), got
    assert int(got["workspace"]) == 64 * 1024 + 2 * 132 * 128 * 256 * 4
    rc, kind, splits, ws = _plan_for(lib, ffi, H200, 256, 28672, 8192)
    assert (rc, kind, splits, ws) == (0, cuda.KERNELS["wgmma_ws"], 1, 64 * 1024 + 2 * 132 * 128 * 256 * 4)
    # fewer stages than SMs: one block per stage (every block's run holds at least one)
    monkeypatch.setenv("W4P_CUDA_WS_RS", "2")
    got = _describe_for(lib, ffi, H200, 100, 600, 1000, kernel="wgmma_ws")
    assert (got["stream-k"], got["tiles"]) == ("24", "3"), got  # 3 row blocks x 8 stages of two K tiles
    assert "stream-k" not in _describe_for(lib, ffi, H200, 100, 600, 1000, kernel="wgmma_ws", splits=2)
    assert "stream-k" not in _describe_for(lib, ffi, H200, 100, 600, 1000, kernel="probe_ws")
    monkeypatch.setenv("W4P_CUDA_WS_RS", "1")
    assert "stream-k" not in _describe_for(lib, ffi, H200, 256, 28672, 8192, kernel="wgmma_ws")  # 128-row blocks
    monkeypatch.setenv("W4P_CUDA_WS_SK", "0")
    monkeypatch.delenv("W4P_CUDA_WS_RS")
    got = _describe_for(lib, ffi, H200, 256, 28672, 8192)
    assert "stream-k" not in got and got["rows"] == "256", got
    # auto's rule: where the plain 256-row grid fills less than 90% of its waves and holds at least a tile per SM
    monkeypatch.delenv("W4P_CUDA_WS_SK")
    for m in (256, 384, 512):  # 224 / 336 / 448 tiles on 132 SMs: 85% of 2 / 3 / 4 waves
        got = _describe_for(lib, ffi, H200, m, 28672, 8192)
        assert (got["kernel"], got.get("stream-k"), got["rows"]) == ("wgmma_ws", "132", "256"), (m, got)
    assert "stream-k" not in _describe_for(lib, ffi, H200, 128, 28672, 8192)  # 112 tiles: runs under a tile
    assert "stream-k" not in _describe_for(lib, ffi, H200, 1024, 28672, 8192)  # 896 tiles: 97%
    assert "stream-k" not in _describe_for(lib, ffi, H200, 256, 11008, 4096)  # 86 tiles
    assert "stream-k" not in _describe_for(lib, ffi, H200, 256, 8192, 28672)  # 64 tiles x 2 splits
    assert "stream-k" not in _describe_for(lib, ffi, H200, 256, 28672, 8192, kernel="wgmma_ws", splits=2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128, -1])
def test_plan_for_every_forced_kernel(bits, gs):
    ffi, lib = _lib_or_skip()
    for act in (0, 1):
        for m in (1, 5, 8, 13, 16):
            rc, kind, stages, _ = _plan_for(lib, ffi, H200, m, 28672, 8192, bits, gs, act, kernel="bulk")
            assert rc == 0 and kind == cuda.KERNELS["bulk"] and 2 <= stages <= 8, (m, act, rc, stages)
            rc, *_ = _plan_for(lib, ffi, H200, m, 196, 576, bits, gs, act, kernel="stream")
            assert rc == 0
            if m <= 8:
                rc, kind, *_ = _plan_for(lib, ffi, A100, m, 28672, 8192, bits, gs, act, kernel="ring")
                assert rc == 0 and kind == cuda.KERNELS["ring"]
        for m in (1, 100, 3000):
            rc, kind, *_ = _plan_for(lib, ffi, A100, m, 4096, 4096, bits, gs, act, kernel="tiled")
            assert rc == 0 and kind == cuda.KERNELS["tiled"]
            rc, kind, *_ = _plan_for(lib, ffi, H200, m, 8192, 28672, bits, gs, act, kernel="wgmma_ws")
            assert (rc == lib.W4P_EUNSUPPORTED) if bits == 8 else (rc == 0 and kind == cuda.KERNELS["wgmma_ws"])
            # wgmma_ss: 4-bit, group sizes of whole K tiles; 32 row blocks x ceil(m / 64 or 128) token blocks, split
            # to about one block per SM
            rc, kind, got, _ = _plan_for(lib, ffi, H200, m, 8192, 28672, bits, gs, act, kernel="wgmma_ss")
            if bits == 8 or gs == 32:
                assert rc == lib.W4P_EUNSUPPORTED
            else:
                assert rc == 0 and kind == cuda.KERNELS["wgmma_ss"] and got == {1: 4, 100: 4, 3000: 1}[m], (m, got)
            assert _plan_for(lib, ffi, A100, m, 8192, 28672, bits, gs, act, kernel="wgmma_ss")[0] == lib.W4P_EUNSUPPORTED
            for splits in (0, 1, 3):
                rc, kind, got, _ = _plan_for(lib, ffi, H200, m, 8192, 28672, bits, gs, act, kernel="wgmma",
                                             splits=splits)
                if bits == 8:  # 4-bit storage only
                    assert rc == lib.W4P_EUNSUPPORTED
                else:
                    assert rc == 0 and kind == cuda.KERNELS["wgmma"], (m, splits, rc)
                    # auto: 64 row tiles x ceil(m / 64 or 128) token tiles, split until two blocks per SM
                    assert got == (splits or {1: 4, 100: 4, 3000: 1}[m]), (m, got)


def test_plan_for_probes_plan_as_their_kernels():
    # the copies-only probes take their kernel's plan, and its errors (not the stream kernel's)
    ffi, lib = _lib_or_skip()
    k = cuda.KERNELS
    for probe, kind in (("probe_bulk", "bulk"), ("probe_ws", "wgmma_ws"), ("probe_ss", "wgmma_ss")):
        rc, got, splits, _ = _plan_for(lib, ffi, H200, 4 if probe == "probe_bulk" else 128, 28672, 8192, kernel=probe)
        assert rc == 0 and got == k[kind], (probe, rc, got)
    assert _plan_for(lib, ffi, H200, 128, 28672, 8192, gs=48, kernel="probe_ws")[1] == k["wgmma_ws"]
    rc, *_ = _plan_for(lib, ffi, H200, 128, 28672, 8192, gs=48, kernel="probe_ss")
    assert rc == lib.W4P_EUNSUPPORTED and "wgmma_ss" in ffi.string(lib.w4p_cuda_last_error()).decode()


def _describe_for(lib, ffi, dev, m, n, k, bits=4, gs=128, kernel="auto", splits=0) -> dict[str, str]:
    buf = ffi.new("char[256]")
    rc = lib.w4p_cuda_plan_describe_for(*dev, m, n, k, bits, gs, 0, 1, cuda.KERNELS[kernel], splits, buf, 256)
    assert rc == 0, ffi.string(lib.w4p_cuda_last_error()).decode()
    name, *fields = ffi.string(buf).decode().split()
    return {"kernel": name, **dict(f.split("=", 1) for f in fields)}


def test_plan_for_gemv(monkeypatch):
    # the gemv kernel: M = 1, 4-bit, group sizes that are multiples of 32 or per channel, compute capability 8.0+;
    # "auto" takes it on compute capability 9.0 where its blocks of whole stripes (396 on an H200: three per SM)
    # fill their rounds: 1.5 rounds or more, 85% full on average (stripes >= 0.85 x rounds x blocks), stripes of
    # at most 96 tiles (as measured)
    ffi, lib = _lib_or_skip()

    def auto(m, n, kk, dev=H200, **kw):
        return _describe_for(lib, ffi, dev, m, n, kk, **kw)

    for n, kk in ((11008, 4096), (12288, 4096)):  # 688 and 768 stripes of 64 tiles
        d = auto(1, n, kk)
        assert d["kernel"] == "gemv" and d["blocks"] == "396" and d["stripes"] == str(n // 16), d
        assert d["smem"] == str(1024 + 64 * 128), d  # two 8 x 16 float sums, the activations in fragment order
        assert auto(2, n, kk)["kernel"] == "bulk"
        assert auto(1, n, kk, gs=32)["kernel"] == "gemv" and auto(1, n, kk, gs=-1)["kernel"] == "gemv"
        assert auto(1, n, kk, gs=48)["kernel"] != "gemv"
        assert auto(1, n, kk, bits=8)["kernel"] != "gemv"
        assert auto(1, n, kk, dev=A100)["kernel"] != "gemv"  # measured on sm_90 only
        monkeypatch.setenv("W4P_CUDA_GEMV", "0")
        assert auto(1, n, kk)["kernel"] == "bulk"
        monkeypatch.delenv("W4P_CUDA_GEMV")
    # 256 or 512 stripes for 396 blocks (a second round 30% full), or stripes of 128 tiles: the bulk kernel
    for n, kk in ((4096, 4096), (8192, 28672), (4096, 11008), (28672, 8192), (6336, 4096)):
        assert auto(1, n, kk)["kernel"] == "bulk", (n, kk)
    # the edges: two rounds 85% full (673 and 674 stripes), stripes of 96 and 97 tiles
    assert auto(1, 673 * 16, 4096)["kernel"] == "bulk" and auto(1, 674 * 16, 4096)["kernel"] == "gemv"
    assert auto(1, 11008, 6144)["kernel"] == "gemv" and auto(1, 11008, 6208)["kernel"] == "bulk"
    # forced: any 4-bit layer at M = 1 that fits, on compute capability 8.0 and newer; one block per stripe at most
    d = _describe_for(lib, ffi, A100, 1, 196, 576, kernel="gemv")
    assert d["kernel"] == "gemv" and d["blocks"] == "13" and d["smem"] == str(1024 + 9 * 128), d
    assert _describe_for(lib, ffi, H200, 1, 28672, 8192, kernel="gemv")["blocks"] == "396"
    for m, n, kk, kw, dev in ((2, 4096, 4096, {}, H200), (1, 4096, 4096, {"bits": 8}, H200),
                              (1, 4096, 4096, {"gs": 16}, H200), (1, 4096, 4096, {}, (80, 75, 65536, 65536, 0)),
                              (1, 4096, 2 ** 17, {}, H200)):
        rc = _plan_for(lib, ffi, dev, m, n, kk, kernel="gemv", **kw)[0]
        assert rc != 0 and "gemv kernel takes M = 1" in ffi.string(lib.w4p_cuda_last_error()).decode(), (m, kk, kw)


def test_plan_for_bulk_unit_granule_and_stages(monkeypatch):
    # the bulk kernel's unit (tiles per copy run), stream-K granule and stages, as measured best on an H200
    ffi, lib = _lib_or_skip()
    for var in ("W4P_CUDA_BULK_CT", "W4P_CUDA_BULK_GRANULE", "W4P_CUDA_BULK_QS"):
        monkeypatch.delenv(var, raising=False)

    def bulk(m, n, kk, stripes=4, **kw):
        d = _describe_for(lib, ffi, H200, m, n, kk, kernel="bulk", **kw)
        assert d["kernel"] == "bulk" and d["stripes"] == str(stripes), d
        return int(d["unit"]), int(d["granule"]), int(d["stages"])

    # 2^26 weights or more: units of 16 tiles, two stages, stream-K over single tiles, up to M = 8
    for m in (1, 4, 8):
        assert bulk(m, 28672, 8192) == (16, 1, 2)
        assert bulk(m, 8192, 28672) == (16, 1, 2)
    # smaller layers: the unit that gives the busiest of 264 blocks the fewest tiles (ceil(units / 264) whole
    # units; 12 before 16 before 8), whole units per block
    assert bulk(5, 8192, 2048) == (16, 16, 2)  # 8: 16 tiles, 12: 24, 16: 16
    assert bulk(3, 11008, 4096) == (12, 12, 2)  # a tie at 48 tiles
    assert bulk(3, 4096, 11008) == (12, 12, 2)
    assert bulk(2, 12288, 4096) == (16, 16, 2)  # 12: 60 tiles, 8 and 16: 48
    # group 32 at M = 8: two 16-tile stages (57472 bytes each) would not fit a block's share; 12 tiles do
    assert bulk(7, 28672, 8192, gs=32) == (16, 1, 2)
    assert bulk(8, 28672, 8192, gs=32) == (12, 1, 2)
    # M > 8 and 8-bit layers: units of 8 tiles and as many stages as fit two blocks per SM (113 KiB each)
    assert bulk(12, 28672, 8192) == (8, 1, 3)  # 29888-byte stages at M = 12
    assert bulk(1, 4096, 4096, bits=8) == (8, 8, 3)  # 34832-byte stages
    assert bulk(5, 8192, 2048, splits=5) == (16, 16, 5)  # forced stages
    # at most one stripe per block (256 stripes, 264 blocks), under 2^25 weights, M <= 8: units of one stripe
    # and 32 tiles, each block owning a whole stripe (granule = its 64 tiles), two stages
    for m in (1, 2, 4, 8):
        assert bulk(m, 4096, 4096, stripes=1) == (32, 64, 2)
    assert bulk(8, 4096, 4096, gs=32, stripes=1)[2] == 2
    assert bulk(12, 4096, 4096)[0] == 8  # M > 8: four-stripe units
    assert bulk(1, 4224, 4096, stripes=1) == (32, 64, 2)  # 264 stripes
    assert bulk(1, 4240, 4096)[0] == 12  # 265 stripes: four-stripe units (12 balances them best)
    assert bulk(1, 4096, 11008)[0] == 12  # 2^25 weights or more: four-stripe units
    assert bulk(1, 196, 576, stripes=1) == (32, 9, 2)  # K shorter than a unit: one 9-tile chunk per stripe
    assert bulk(1, 4096, 4096, stripes=1, splits=3) == (32, 64, 3)
    assert bulk(1, 4096, 4096, bits=8)[0] == 8  # 8-bit layers: four-stripe units
    # one-stripe units only where two of their stages fit a block's half of the SM: on a device with 164 KiB per
    # SM up to M = 4 at group 128 (M = 8 would need 107936 bytes); with 100 KiB (compute capability 12.0) never
    # (50368 bytes at M = 1). Elsewhere four-stripe units, and auto keeps the stream kernel at M = 5-8 on
    # 4096x4096 instead of failing
    mid, small = (132, 90, 167936, 166912, 1024), (170, 120, 102400, 101376, 1024)
    for dev, m, gs, stripes in ((mid, 1, 128, "1"), (mid, 4, 128, "1"), (mid, 8, 128, "4"), (mid, 8, 32, "4"),
                                (small, 1, 128, "4"), (small, 1, 32, "4"), (small, 4, -1, "4"), (small, 8, 128, "4")):
        d = _describe_for(lib, ffi, dev, m, 4096, 4096, kernel="bulk", gs=gs)
        assert d["stripes"] == stripes, (dev, m, gs, d)
        if stripes == "1":
            assert int(d["smem"]) <= dev[2] // 2 - dev[4], (dev, m, gs, d)
        want = "bulk" if m <= 4 or stripes == "1" else "stream"
        assert _describe_for(lib, ffi, dev, m, 4096, 4096, gs=gs)["kernel"] == want, (dev, m, gs)
    # the switches for sweeps and tests
    for ct in ("8", "12", "16"):
        monkeypatch.setenv("W4P_CUDA_BULK_CT", ct)
        assert bulk(1, 11008, 4096)[0] == int(ct)
        assert bulk(1, 4096, 4096, bits=8)[0] == 8  # 8-bit layers keep 8 tiles
        assert bulk(12, 4096, 4096)[0] == 8  # so does M > 8
    assert bulk(1, 11008, 4096)[2] == 2
    monkeypatch.setenv("W4P_CUDA_BULK_CT", "8")
    assert bulk(1, 11008, 4096)[2] == 6  # units of 8: as many 18448-byte stages as fit
    monkeypatch.setenv("W4P_CUDA_BULK_CT", "9")  # not a unit size: ignored
    assert bulk(1, 11008, 4096)[0] == 12
    monkeypatch.setenv("W4P_CUDA_BULK_GRANULE", "tile")
    assert bulk(1, 11008, 4096)[1] == 1
    monkeypatch.setenv("W4P_CUDA_BULK_GRANULE", "unit")
    assert bulk(1, 28672, 8192)[1] == 16
    monkeypatch.setenv("W4P_CUDA_BULK_GRANULE", "quad")
    assert bulk(1, 28672, 8192)[1] == 128
    monkeypatch.setenv("W4P_CUDA_BULK_CT", "12")  # a forced four-stripe unit size takes four-stripe units
    assert bulk(1, 4096, 4096) == (12, 64, 2)
    assert bulk(7, 4096, 4096) == (12, 64, 2)
    monkeypatch.delenv("W4P_CUDA_BULK_CT")
    monkeypatch.delenv("W4P_CUDA_BULK_GRANULE")
    monkeypatch.setenv("W4P_CUDA_BULK_QS", "1")  # one-stripe units forced: any 4-bit layer up to M = 8
    assert bulk(8, 28672, 8192, stripes=1) == (32, 128, 2)
    assert bulk(12, 28672, 8192)[0] == 8  # M > 8: four stripes
    assert bulk(1, 4096, 4096, bits=8)[0] == 8
    monkeypatch.setenv("W4P_CUDA_BULK_QS", "4")
    assert bulk(1, 4096, 4096) == (16, 16, 2)
    assert bulk(6, 4096, 4096) == (16, 16, 2)
    # other kernels describe themselves too
    assert _describe_for(lib, ffi, H200, 16, 4096, 4096)["kernel"] == "wgmma_ws"
    assert _describe_for(lib, ffi, A100, 1, 28672, 8192)["kernel"] == "ring"


def test_plan_for_workspace_holds_gathered_activations():
    # act-order or unaligned rows (every kernel but stream) and K % 64 (wgmma, bulk) gather x first: m * Kp
    # halves of workspace after the tile counters (and the split partials after those)
    ffi, lib = _lib_or_skip()
    counters = 64 * 1024
    for kernel in ("wgmma", "tiled", "ring", "bulk"):
        for m, k, act, aligned, splits in ((65, 576, 1, 1, 2), (7, 8192, 1, 1, 0), (1, 600, 0, 1, 0),
                                           (40, 4096, 0, 0, 3)):
            if (kernel in ("ring", "bulk") and m > 8) or (kernel in ("tiled", "ring") and not act and aligned):
                continue
            rc, kind, s, ws = _plan_for(lib, ffi, H200, m, 28672 if m < 64 else 4096, k, 4, 64, act, aligned,
                                        kernel=kernel, splits=splits)
            assert rc == 0 and kind == cuda.KERNELS[kernel], (kernel, m, rc)
            kp = -(-k // 64) * 64
            assert ws >= counters + m * kp * 2, (kernel, m, k, ws)


def test_plan_for_refusals():
    ffi, lib = _lib_or_skip()
    msg = lambda: ffi.string(lib.w4p_cuda_last_error()).decode()  # noqa: E731
    assert _plan_for(lib, ffi, A100, 1, 4096, 4096, kernel="bulk")[0] == lib.W4P_EUNSUPPORTED
    assert "9.0" in msg()
    assert _plan_for(lib, ffi, H200, 17, 4096, 4096, kernel="bulk")[0] == lib.W4P_EUNSUPPORTED
    assert _plan_for(lib, ffi, H200, 9, 4096, 4096, kernel="ring")[0] == lib.W4P_EUNSUPPORTED
    assert _plan_for(lib, ffi, H200, 1, 4096, 4096, gs=48, kernel="stream")[0] == lib.W4P_EUNSUPPORTED
    assert _plan_for(lib, ffi, H200, 1, 4096, 4096, gs=48)[1] == cuda.KERNELS["tiled"]  # auto: odd group size
    assert _plan_for(lib, ffi, H200, 1, 4096, 4096, gs=40)[0] == lib.W4P_EINVAL
    assert _plan_for(lib, ffi, A100, 128, 4096, 4096, kernel="wgmma")[0] == lib.W4P_EUNSUPPORTED  # sm_90a only
    assert _plan_for(lib, ffi, H200, 128, 4096, 4096, gs=48, kernel="wgmma")[1] == cuda.KERNELS["wgmma"]
    assert _plan_for(lib, ffi, (0, 90, 1, 1, 0), 1, 64, 64)[0] == lib.W4P_EINVAL
    assert "bad device description" in msg()


# -- helpers -----------------------------------------------------------------------------------------------


def random_layer(rng: np.random.Generator, n: int, k: int, bits: int = 4, gs: int = 128, zero_mode: str = "none",
                 act_order: bool = False, scale_dtype: str = "float16", bias: bool = False) -> CanonicalLayer:
    """A layer with random codes, positive scales and (for int / float zero modes) random zero points."""
    g = 1 if gs == -1 else -(-k // gs)
    codes = rng.integers(0, 1 << bits, size=(n, k), dtype=np.uint8)
    s32 = (rng.uniform(0.5, 1.5, size=(n, g)) * (0.02 if bits == 4 else 0.002)).astype(np.float32)
    scales = s32.astype(np.float16) if scale_dtype == "float16" else (
        from_float32(s32, "bfloat16") if scale_dtype == "bfloat16" else s32)
    zeros = None
    if zero_mode == "int":
        zeros = rng.integers(0, (1 << bits) + 1, size=(n, g)).astype(np.int32)
    elif zero_mode == "float":
        m32 = (rng.uniform(-1, 1, size=(n, g)) * (0.1 if bits == 4 else 0.2)).astype(np.float32)
        zeros = m32.astype(np.float16) if scale_dtype == "float16" else (
            from_float32(m32, "bfloat16") if scale_dtype == "bfloat16" else m32)
    g_idx = default_g_idx(k, gs)
    if act_order and gs != -1:
        g_idx = g_idx[rng.permutation(k)].astype(np.int32)
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    return CanonicalLayer(codes=codes, scales=scales, bits=bits, group_size=gs, zero_mode=zero_mode, zeros=zeros,
                          g_idx=g_idx, scale_dtype=scale_dtype, bias=b).validate()


def reference(layer: CanonicalLayer, x64: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    y = x64 @ layer.dequantize(np.float64).T
    if bias is not None:
        y = y + bias
    return y


def rel_err(y, ref: np.ndarray) -> float:
    y64 = y.double().cpu().numpy()
    assert np.isfinite(y64).all(), "non-finite or unwritten outputs"
    return float(np.linalg.norm(y64 - ref) / np.linalg.norm(ref))


def tolerance(dtype_name: str) -> float:
    # fp16: weights rounded once to fp16 (2^-11) and fp16 output; bf16 rounds to 2^-8, so its output alone is ~1e-3
    return 1e-3 if dtype_name == "float16" else 8e-3


def run_case(torch, rng, layer: CanonicalLayer, m: int, dtype_name: str, kernel: str = "auto", splits: int = 0,
             lin=None, bias: bool = True):
    tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
    lin = lin or cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(m, layer.in_features, device="cuda").to(tdt)
    out = torch.full((m, layer.out_features), float("nan"), dtype=tdt, device="cuda")  # poisoned
    lin.forward(x, out=out, kernel=kernel, splits=splits)
    torch.cuda.synchronize()
    b = to_float64(layer.bias, layer.bias_dtype) if (layer.bias is not None and bias) else None
    return rel_err(out, reference(layer, x.double().cpu().numpy(), b))


# -- GPU ---------------------------------------------------------------------------------------------------

def bulk_ok() -> bool:
    """The bulk kernel needs the bulk copy engine (compute capability 9.0+)."""
    import torch

    return torch.cuda.get_device_capability() >= (9, 0)


BULK_CASES = ((1, "bulk"), (8, "bulk"), (13, "bulk"), (16, "bulk"))

OPTIONS = [
    (bits, zm, gs, act)
    for bits in (4, 8)
    for zm in ("none", "int", "float")
    for gs in (32, 64, 128, -1)
    for act in (False, True)
    if not (act and gs == -1)
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits,zero_mode,gs,act_order", OPTIONS)
def test_every_option_matches_float64(dtype_name, bits, zero_mode, gs, act_order):
    import torch

    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, bits, zero_mode, gs, act_order)).encode()))
    layer = random_layer(rng, 196, 576, bits=bits, gs=gs, zero_mode=zero_mode, act_order=act_order,
                         scale_dtype=dtype_name, bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    cases = ((1, "stream"), (7, "auto"), (19, "stream"), (40, "stream"), (3, "tiled"), (67, "tiled"), (200, "auto"),
             (1, "ring"), (5, "ring"), (8, "ring")) + (BULK_CASES if bulk_ok() else ())
    for m, kernel in cases + (((1, "gemv"), (1, "auto")) if bits == 4 and gemv_ok() else ()):
        err = run_case(torch, rng, layer, m, dtype_name, kernel=kernel, lin=lin)
        assert err <= tolerance(dtype_name), (m, kernel, err)


@pytest.mark.gpu
def test_odd_shapes_all_small_m():
    import torch

    rng = np.random.default_rng(1)
    layer = random_layer(rng, 196, 576, gs=64, zero_mode="int", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m in range(1, 68):
        for kernel in ("stream", "tiled") + (("ring",) if m <= 8 else ()) + (("bulk",) if m <= 16 and bulk_ok() else ()):
            assert run_case(torch, rng, layer, m, "float16", kernel=kernel, lin=lin) <= 1e-3, (m, kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs", [(10, 100, 32), (33, 1000, 128), (130, 4104, -1), (1, 64, 64)])
def test_padded_and_unaligned_shapes(n, k, gs):
    import torch

    rng = np.random.default_rng(n * k)
    layer = random_layer(rng, n, k, gs=gs, zero_mode="float", act_order=gs != -1, scale_dtype="float32")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    # fp32 scales and minima are rounded to fp16 for fp16 activations (docs/CUDA.md); with a handful of outputs
    # that can cancel, the error is measured against the scale of the sums, |x| . |W|^T
    w64 = layer.dequantize(np.float64)
    for m in (1, 9, 130):
        for kernel in ("stream", "tiled", "auto") + (("ring",) if m <= 8 else ()) + (("bulk",) if m <= 16 and bulk_ok() else ()):
            x = torch.randn(m, k, device="cuda").half()
            out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
            lin.forward(x, out=out, kernel=kernel)
            x64 = x.double().cpu().numpy()
            y64 = out.double().cpu().numpy()
            assert np.isfinite(y64).all()
            err = np.linalg.norm(y64 - x64 @ w64.T) / np.linalg.norm(np.abs(x64) @ np.abs(w64).T)
            assert err <= 1e-3, (m, kernel, err)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64, 100])
def test_forced_splits(splits):
    import torch

    rng = np.random.default_rng(splits)
    layer = random_layer(rng, 256, 4096, gs=128)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    # for the ring kernel splits is the units (K tiles of 4 stripes) per warp, KT = 64 here: 1..7 share every
    # quad among warps, 64 gives whole quads, 100 ranges with a whole quad between two shared ones
    for m, kernel in ((1, "stream"), (24, "stream"), (96, "tiled"), (1, "ring"), (8, "ring"), (3, "ring")):
        assert run_case(torch, rng, layer, m, "float16", kernel=kernel, splits=splits, lin=lin) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(256, 4096), (4096, 4096), (1000, 9000), (2048, 512), (64, 28672)])
@pytest.mark.parametrize("stages", [0, 2, 3, 5])
def test_bulk_kernel_ranges_and_stages(n, k, stages, monkeypatch):
    # stream-K over one block per SM: these shapes give quads shared by up to 8 blocks, ranges that span
    # several quads, a K that is not a multiple of the unit, and a grid smaller than the GPU
    import torch

    if not bulk_ok():
        pytest.skip("the bulk kernel needs compute capability 9.0")
    if stages == 5:  # five stages fit one block's shared memory with units of 8 tiles only (up to M = 16)
        monkeypatch.setenv("W4P_CUDA_BULK_CT", "8")
    rng = np.random.default_rng(n + k + stages)
    layer = random_layer(rng, n, k, gs=128, zero_mode="int", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m in (1, 6, 11, 16):
        assert lin.plan(m, kernel="bulk", splits=stages)["kernel"] == cuda.KERNELS["bulk"]
        assert run_case(torch, rng, layer, m, "float16", kernel="bulk", splits=stages, lin=lin) <= 1e-3, m


@pytest.mark.gpu
@pytest.mark.parametrize("ct", ["8", "12", "16"])
@pytest.mark.parametrize("dtype_name,zero_mode,gs,act_order", [("float16", "int", 128, False),
                                                               ("bfloat16", "float", 32, True),
                                                               ("float16", "none", 64, False),
                                                               ("bfloat16", "int", 96, True),
                                                               ("float16", "float", -1, False)])
def test_bulk_kernel_unit_sizes_and_granules(ct, dtype_name, zero_mode, gs, act_order, monkeypatch):
    # every unit size on every option, stream-K over single tiles and over whole units: K not a multiple of the
    # unit (units of 12 tiles straddle groups of 128 and 96), quads shared by several blocks, ranges that start
    # and end inside units, forced stage counts
    import torch

    if not bulk_ok():
        pytest.skip("the bulk kernel needs compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_BULK_CT", ct)
    rng = np.random.default_rng(zlib.crc32(repr((ct, dtype_name, zero_mode, gs, act_order)).encode()))
    for n, k in ((1000, 9000), (196, 576), (4096, 2880)):
        layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                             bias=True)
        for granule in ("tile", "unit"):
            monkeypatch.setenv("W4P_CUDA_BULK_GRANULE", granule)
            lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))  # (a layer caches its plans)
            for m, stages in ((1, 0), (2, 0), (3, 3), (5, 0), (8, 0), (1, 2)):
                detail = lin.plan(m, kernel="bulk", splits=stages)["detail"]
                assert f"unit={ct} " in detail and (" granule=1 " in detail) == (granule == "tile"), detail
                err = run_case(torch, rng, layer, m, dtype_name, kernel="bulk", splits=stages, lin=lin)
                assert err <= tolerance(dtype_name), (n, k, granule, m, stages, err)


def gemv_ok() -> bool:
    """The gemv kernel runs mma.sync: compute capability 8.0 and newer."""
    import torch

    return torch.cuda.get_device_capability() >= (8, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 32, True), ("float", 64, False),
                                                    ("none", -1, False), ("int", 96, False), ("float", 32, True),
                                                    ("int", 128, True), ("none", 32, False)])
def test_gemv_kernel(dtype_name, zero_mode, gs, act_order):
    # whole stripes per block, summed in warp order: odd shapes (rows past N, K past the last full tile, fewer tiles
    # than a step, a stripe count under and over the grid), bias, an unaligned activation row (staged element by
    # element), the float64 reference, repeats and graph replays bit-identical (auto's choice: test_plan_for_gemv)
    import torch

    if not gemv_ok():
        pytest.skip("the gemv kernel needs compute capability 8.0")
    rng = np.random.default_rng(zlib.crc32(repr(("gemv", dtype_name, zero_mode, gs, act_order)).encode()))
    tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
    for n, k in ((196, 576), (600, 1000), (17, 64), (4100, 2880), (9000, 4160), (40, 12000)):
        layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                             bias=True)
        lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
        detail = lin.plan(1, kernel="gemv")["detail"]
        assert detail.startswith("gemv ") and f" stripes={-(-n // 16)} " in detail, detail
        err = run_case(torch, rng, layer, 1, dtype_name, kernel="gemv", lin=lin)
        assert err <= tolerance(dtype_name), (n, k, err)
        wide = torch.randn(1, k + 3, device="cuda").to(tdt)
        x = wide[:, 3:]  # 6 bytes past a 16-byte boundary
        ref = reference(layer, x.double().cpu().numpy(), to_float64(layer.bias, layer.bias_dtype))
        out = torch.full((1, n), float("nan"), dtype=tdt, device="cuda")
        lin.forward(x, out=out, kernel="gemv")
        assert rel_err(out, ref) <= tolerance(dtype_name), (n, k)
        _repeats_and_replays(torch, lin, torch.randn(1, k, device="cuda").to(tdt), 3, 2, kernel="gemv")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name,zero_mode,gs,act_order", [("float16", "int", 128, False),
                                                               ("bfloat16", "float", 32, True),
                                                               ("float16", "none", -1, False),
                                                               ("bfloat16", "int", 96, False),
                                                               ("float16", "int", 64, True)])
def test_bulk_kernel_single_stripes(dtype_name, zero_mode, gs, act_order, monkeypatch):
    # units of one stripe (eight warps share its K range and sum in warp order): the planner's choice on small
    # layers, forced (W4P_CUDA_BULK_QS=1) on 6000 x 2048 (375 stripes: four-stripe units otherwise) and on
    # 1000 x 9000; granules of single tiles, whole units and whole stripes (stripes then shared by several
    # blocks, or not at all), M up to 8, repeated calls bit-identical
    import torch

    if not bulk_ok():
        pytest.skip("the bulk kernel needs compute capability 9.0")
    for var in ("W4P_CUDA_BULK_CT", "W4P_CUDA_BULK_GRANULE"):
        monkeypatch.delenv(var, raising=False)
    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, zero_mode, gs, act_order)).encode()))
    for n, k, forced in ((196, 4160, False), (4096, 2880, False), (1000, 9000, True), (6000, 2048, True)):
        layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                             bias=True)
        if forced:
            monkeypatch.setenv("W4P_CUDA_BULK_QS", "1")
        else:
            monkeypatch.delenv("W4P_CUDA_BULK_QS", raising=False)
        for granule in ("tile", "unit", "quad", None):
            if granule:
                monkeypatch.setenv("W4P_CUDA_BULK_GRANULE", granule)
            else:
                monkeypatch.delenv("W4P_CUDA_BULK_GRANULE", raising=False)
            lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
            for m, stages in ((1, 0), (2, 3), (4, 2), (3, 0)) + (((8, 0), (6, 4)) if forced else ()):
                detail = lin.plan(m, kernel="bulk", splits=stages)["detail"]
                assert " stripes=1 " in detail and "unit=32 " in detail, detail
                err = run_case(torch, rng, layer, m, dtype_name, kernel="bulk", splits=stages, lin=lin)
                assert err <= tolerance(dtype_name), (n, k, granule, m, stages, err)
            tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
            x = torch.randn(3, k, device="cuda").to(tdt)
            first = lin.forward(x, kernel="bulk")
            for _ in range(5):
                assert torch.equal(lin.forward(x, kernel="bulk"), first)
            assert " stripes=1 " in lin.plan(3, kernel="auto")["detail"] or forced


def wgmma_ok() -> bool:
    """The wgmma kernel is built for sm_90a: compute capability 9.0 exactly."""
    import torch

    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 32, False),
                                                    ("int", -1, False), ("none", 128, True), ("int", 96, False),
                                                    ("float", 16, True), ("int", 192, False),
                                                    ("none", 48, False)])
@pytest.mark.parametrize("kernel", ["wgmma", "wgmma_ws"])
def test_wgmma_kernel(dtype_name, zero_mode, gs, act_order, kernel):
    # weights scaled in the activation dtype before the MMA (one more rounding than the other kernels): the
    # same tolerances hold for a K of a few hundred
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, zero_mode, gs, act_order)).encode()))
    layer = random_layer(rng, 196, 576, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    # splits: split-K count (0: enough blocks for every SM; K = 576 is 9 tiles, so 1 here), tiles of 64 tokens up
    # to M = 64, else 128
    for m, splits in ((1, 0), (17, 0), (64, 0), (128, 0), (129, 0), (300, 0), (65, 2), (40, 3), (200, 9), (5, 4)):
        plan = lin.plan(m, kernel=kernel, splits=splits)
        assert plan["kernel"] == cuda.KERNELS[kernel]
        assert plan["splits"] == (splits or 1)
        err = run_case(torch, rng, layer, m, dtype_name, kernel=kernel, splits=splits, lin=lin)
        assert err <= tolerance(dtype_name), (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("int", 128, False), ("float", 32, True), ("none", -1, False),
                                                    ("int", 48, False)])
@pytest.mark.parametrize("variant", [("W4P_CUDA_WGMMA_AS", "1"), ("W4P_CUDA_WGMMA_KP", "2")])
def test_wgmma_kernel_variants(dtype_name, zero_mode, gs, act_order, variant, monkeypatch):
    # the tuning variants (A through shared memory; two K tiles per step), read by the planner at each call
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    monkeypatch.setenv(*variant)
    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, zero_mode, gs, act_order, variant)).encode()))
    layer = random_layer(rng, 196, 576, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    for m, splits in ((1, 0), (33, 0), (64, 2), (17, 5), (90, 0), (130, 3)):
        err = run_case(torch, rng, layer, m, dtype_name, kernel="wgmma", splits=splits, lin=lin)
        assert err <= tolerance(dtype_name), (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs", [(200, 600, 128), (64, 100, 32), (1000, 1000, -1), (136, 4160, 64)])
@pytest.mark.parametrize("kernel", ["wgmma", "wgmma_ws"])
def test_wgmma_kernel_ragged_shapes(n, k, gs, kernel):
    # K not a multiple of 64 (the activations gathered and zero-padded to whole tiles, the padded tail's own
    # group), N not a multiple of the 128-row block, and forced split counts over short K ranges
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    rng = np.random.default_rng(n * 7 + k)
    layer = random_layer(rng, n, k, gs=gs, zero_mode="int", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m, splits in ((1, 0), (40, 0), (64, 2), (129, 0), (70, 3)):
        err = run_case(torch, rng, layer, m, "float16", kernel=kernel, splits=splits, lin=lin)
        assert err <= 1e-3, (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 128, False),
                                                    ("int", -1, False), ("float", 192, True), ("int", 256, False)])
def test_wgmma_ss_kernel(dtype_name, zero_mode, gs, act_order):
    # the tokens as A, the weights dequantized into shared memory as B (group sizes of whole K tiles): 64-token
    # blocks up to M = 64, else 128; N = 196 leaves most of the 256-row block empty; K = 576 and 9 tiles make the
    # 64-token blocks' two-tile stages end on a single tile; forced splits over short K ranges
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma_ss kernel needs compute capability 9.0")
    rng = np.random.default_rng(zlib.crc32(repr(("ss", dtype_name, zero_mode, gs, act_order)).encode()))
    layer = random_layer(rng, 196, 576, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    for m, splits in ((1, 0), (17, 0), (64, 0), (65, 0), (128, 0), (129, 0), (300, 0), (65, 2), (40, 3), (200, 9),
                      (5, 4)):
        plan = lin.plan(m, kernel="wgmma_ss", splits=splits)
        assert plan["kernel"] == cuda.KERNELS["wgmma_ss"]
        assert plan["splits"] == (splits or 1)
        err = run_case(torch, rng, layer, m, dtype_name, kernel="wgmma_ss", splits=splits, lin=lin)
        assert err <= tolerance(dtype_name), (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs,bias", [(200, 600, 128, True), (64, 100, 64, True), (1000, 1000, -1, True),
                                         (272, 4160, 64, True), (4096, 2048, 128, True), (199, 640, 128, False),
                                         (130, 40, -1, True)])
def test_wgmma_ss_kernel_ragged_and_large(n, k, gs, bias):
    # K not a multiple of 64 (zero-filled by TMA), N not a multiple of the 256-row block, a row tile of one
    # stripe (272 = 256 + 16), whole blocks (4096 rows), an odd N without bias (the last row's unpaired store),
    # a single K tile (K = 40: the 64-token tile's two-tile code box reaches past K); an output with an odd row
    # stride (unpaired stores throughout) must hold the same values
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma_ss kernel needs compute capability 9.0")
    rng = np.random.default_rng(n * 11 + k)
    layer = random_layer(rng, n, k, gs=gs, zero_mode="int", bias=bias)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m, splits in ((1, 0), (40, 0), (64, 2), (129, 0), (70, 3), (256, 0), (513, 0)):
        err = run_case(torch, rng, layer, m, "float16", kernel="wgmma_ss", splits=splits, lin=lin)
        assert err <= 1e-3, (m, splits, err)
    x = torch.randn(200, k, device="cuda", dtype=torch.float16)
    first = lin.forward(x, kernel="wgmma_ss")
    for _ in range(20):
        assert torch.equal(lin.forward(x, kernel="wgmma_ss"), first)
    wide = torch.full((200, n + 1), float("nan"), dtype=torch.float16, device="cuda")
    lin.forward(x, kernel="wgmma_ss", out=wide[:, :n])
    assert torch.equal(wide[:, :n], first) and torch.isnan(wide[:, n]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tok", ["64", "128"])
def test_wgmma_ss_token_tiles_forced(tok, monkeypatch):
    # W4P_CUDA_SS_TOK forces the token tile: 128 at small M (one warpgroup's tokens all past M), 64 at large M
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma_ss kernel needs compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_SS_TOK", tok)
    rng = np.random.default_rng(int(tok))
    layer = random_layer(rng, 600, 1280, gs=128, zero_mode="float", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=("bfloat16",))
    # 3 row blocks x 2 token blocks of 64 at M = 100, or x 1 of 128
    assert " tiles=%d " % (6 if tok == "64" else 3) in lin.plan(100, kernel="wgmma_ss")["detail"]
    for m, splits in ((3, 0), (64, 0), (100, 2), (257, 0)):
        err = run_case(torch, rng, layer, m, "bfloat16", kernel="wgmma_ss", splits=splits, lin=lin)
        assert err <= tolerance("bfloat16"), (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["wgmma_ws", "wgmma_ss"])
def test_split_sums_in_a_cluster_match_the_workspace(kernel, monkeypatch):
    # up to 8 splits of a tile are launched as one cluster and summed in shared memory; W4P_CUDA_CLUSTER=0 (or
    # more than 8 splits) sums them through the workspace. Both add the same fp32 partials in split order, so the
    # outputs must be bit-identical; odd N (row quads past N), tokens past M, bias
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    rng = np.random.default_rng(7 if kernel == "wgmma_ws" else 8)
    layer = random_layer(rng, 1002, 2560, gs=128, zero_mode="int", bias=True)
    packed = pack(layer)
    in_cluster = cuda.CudaPackedLinear(packed, "cuda")
    monkeypatch.setenv("W4P_CUDA_CLUSTER", "0")
    via_workspace = cuda.CudaPackedLinear(packed, "cuda")
    for m in (1, 70, 200):
        x = torch.randn(m, 2560, device="cuda", dtype=torch.float16)
        for splits in (2, 3, 5, 8):
            monkeypatch.setenv("W4P_CUDA_CLUSTER", "0")
            assert "sum=workspace" in via_workspace.plan(m, kernel=kernel, splits=splits)["detail"]
            want = via_workspace.forward(x, kernel=kernel, splits=splits)
            monkeypatch.delenv("W4P_CUDA_CLUSTER")
            plan = in_cluster.plan(m, kernel=kernel, splits=splits)
            assert "sum=cluster" in plan["detail"] and plan["splits"] == splits, plan
            got = in_cluster.forward(x, kernel=kernel, splits=splits)
            assert torch.equal(got, want), (m, splits)
            for _ in range(3):
                assert torch.equal(in_cluster.forward(x, kernel=kernel, splits=splits), got)
        assert "sum=workspace" in in_cluster.plan(m, kernel=kernel, splits=9)["detail"]
        assert run_case(torch, rng, layer, m, "float16", kernel=kernel, splits=5, lin=in_cluster) <= 1e-3


def _repeats_and_replays(torch, lin, x, repeats: int, replays: int, **kw):
    """The call on x, then `repeats` more and `replays` replays of it captured in a CUDA graph (output poisoned before
    each), all bit-identical to the first."""
    first = lin.forward(x, **kw)
    for _ in range(repeats):
        assert torch.equal(lin.forward(x, **kw), first)
    if not replays:
        return
    out = torch.empty_like(first)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin.forward(x, out=out, **kw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        lin.forward(x, out=out, **kw)
    for _ in range(replays):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


def _row_blocks(monkeypatch, env, markers, dtype_name, zero_mode, gs, act_order, cases, replays):
    """wgmma_ws forced by the switches `env` to the blocks whose plan says each of `markers`, on 600 rows past the last
    block's end and K = 1000 (not a multiple of 64), against the float64 reference for each (M, splits) case; then
    repeats and graph replays."""
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    rng = np.random.default_rng(zlib.crc32(repr((markers, env, dtype_name, zero_mode, gs, act_order)).encode()))
    layer = random_layer(rng, 600, 1000, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    for m, splits in cases:
        plan = lin.plan(m, dtype_name, kernel="wgmma_ws", splits=splits)
        assert all(w in plan["detail"] for w in markers) and plan["splits"] == (splits or plan["splits"]), plan
        err = run_case(torch, rng, layer, m, dtype_name, kernel="wgmma_ws", splits=splits, lin=lin)
        assert err <= tolerance(dtype_name), (m, splits, err)
    x = torch.randn(150, 1000, device="cuda", dtype=getattr(torch, dtype_name))
    _repeats_and_replays(torch, lin, x, 5, replays, kernel="wgmma_ws", splits=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 32, False),
                                                    ("int", -1, False), ("float", 16, True), ("int", 192, False),
                                                    ("none", 48, False)])
def test_wgmma_ws_256_row_blocks(dtype_name, zero_mode, gs, act_order, monkeypatch):
    # W4P_CUDA_WS_RS=2: the 128-token tile in 256-row blocks (a warp's two stripes 128 rows apart, the producer
    # warpgroup's registers handed to the consumers); N past the last block's rows, K not a multiple of 64, unsplit
    # and with splits summed in a cluster (2-8) and through the workspace (9); repeated calls bit-identical
    _row_blocks(monkeypatch, {"W4P_CUDA_WS_RS": "2"}, ("rows=256",), dtype_name, zero_mode, gs, act_order,
                ((65, 0), (128, 0), (200, 2), (300, 3), (129, 9), (97, 5)), replays=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 32, False),
                                                    ("int", -1, False), ("float", 16, True), ("none", 48, False)])
def test_wgmma_ws_192_row_blocks(dtype_name, zero_mode, gs, act_order, monkeypatch):
    # W4P_CUDA_WS_ROWS=192: the 128-token tile in 192-row blocks (three consumer warpgroups, 13 warps); 600 rows
    # end 24 rows into the fourth block, K = 1000 is not a multiple of 64; unsplit and with splits summed in a
    # cluster (2-8) and through the workspace (9); repeated calls and a graph replay bit-identical
    _row_blocks(monkeypatch, {"W4P_CUDA_WS_ROWS": "192"}, ("rows=192",), dtype_name, zero_mode, gs, act_order,
                ((65, 0), (128, 0), (256, 1), (200, 2), (300, 3), (129, 9), (97, 5)), replays=1)


@pytest.mark.gpu
@pytest.mark.parametrize("ks", ["1", "2"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 32, False),
                                                    ("int", -1, False), ("float", 16, True), ("none", 48, False)])
def test_wgmma_ws_256_token_tile(ks, dtype_name, zero_mode, gs, act_order, monkeypatch):
    # W4P_CUDA_WS_TOK=256: 128-row blocks of 256 tokens (one m64n256 wgmma per slice, the producer warpgroup's
    # registers handed to the consumers), one or two K tiles a stage; tokens past M in the last tile, 600 rows end
    # 88 rows into the fifth block, K = 1000 not a multiple of 64; unsplit and with splits summed in a cluster (2-8)
    # and through the workspace (9); repeated calls and a graph replay bit-identical
    smem = {"1": "smem=229376", "2": "smem=190464"}[ks]  # five stages of one K tile, or two of two
    _row_blocks(monkeypatch, {"W4P_CUDA_WS_TOK": "256", "W4P_CUDA_WS_TOK_KS": ks}, ("tokens=256", smem), dtype_name,
                zero_mode, gs, act_order, ((129, 0), (256, 0), (300, 1), (513, 0), (257, 2), (400, 3), (200, 9),
                                           (600, 5)), replays=1)


@pytest.mark.gpu
@pytest.mark.parametrize("env,m,splits", [({}, 129, 0), ({}, 300, 3), ({"W4P_CUDA_WS_TOK": "256"}, 257, 0),
                                          ({"W4P_CUDA_WS_TOK": "256"}, 600, 2), ({"W4P_CUDA_WS_ROWS": "192"}, 300, 0),
                                          ({"W4P_CUDA_WS_ROWS": "256"}, 129, 9)])
def test_wgmma_ws_last_token_tile_box(env, m, splits, monkeypatch):
    # a last token tile that ends past M is copied as one box of its rows (8 to 128, a power of two), and the tile's
    # other rows keep what the stage held before: here the infinities and NaNs of the call before, which must reach
    # no stored output (1, 44, 1, 88, 44 and 1 rows of 128, 128, 256, 256, 128 and 128 tokens)
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    rng = np.random.default_rng(zlib.crc32(repr(("tail", env, m)).encode()))
    layer = random_layer(rng, 600, 1000, gs=64, zero_mode="int", scale_dtype="float16", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=("float16",))
    bad = torch.full((768, 1000), float("nan"), device="cuda", dtype=torch.float16)
    bad[::3] = float("inf")
    for _ in range(3):  # non-finite rows in the stages: 270, 135, 216 or 162 blocks, more than an H200's SMs
        lin.forward(bad, kernel="wgmma_ws", splits=9)
    err = run_case(torch, rng, layer, m, "float16", kernel="wgmma_ws", splits=splits, lin=lin)
    assert err <= tolerance("float16"), err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name,zero_mode,gs,act_order,n,k,ms", [
    ("float16", "none", 128, False, 600, 1000, (65, 128, 300)),      # 8 stages a tile, 1-8 blocks a tile
    ("bfloat16", "int", 64, True, 1000, 1000, (97, 256)),
    ("float16", "float", 32, False, 16384, 512, (600,)),            # runs of whole tiles between partial ends
    ("float16", "int", -1, False, 4000, 3000, (129, 1000)),         # stages ending mid-tile (47 K tiles)
    ("bfloat16", "none", 48, False, 2000, 2000, (200,)),
])
def test_wgmma_ws_stream_k(dtype_name, zero_mode, gs, act_order, n, k, ms, monkeypatch):
    # W4P_CUDA_WS_SK=1: the 256-row blocks as stream-K (runs of stages across tiles, the partial tiles summed in
    # block order); poisoned outputs fully written, tokens and rows past the ends, bias; repeated calls and graph
    # replays bit-identical
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_WS_RS", "2")
    monkeypatch.setenv("W4P_CUDA_WS_SK", "1")
    rng = np.random.default_rng(zlib.crc32(repr(("sk", dtype_name, zero_mode, gs, n, k)).encode()))
    layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    for m in ms:
        plan = lin.plan(m, dtype_name, kernel="wgmma_ws")
        assert "stream-k=" in plan["detail"] and "rows=256" in plan["detail"], plan
        err = run_case(torch, rng, layer, m, dtype_name, kernel="wgmma_ws", lin=lin)
        assert err <= tolerance(dtype_name), (m, err)
    x = torch.randn(ms[-1], k, device="cuda", dtype=getattr(torch, dtype_name))
    _repeats_and_replays(torch, lin, x, 20, 3, kernel="wgmma_ws")


@pytest.mark.gpu
def test_wgmma_ws_stream_k_by_auto_and_its_workspace_fallback(monkeypatch):
    # auto takes stream-K on a layer whose 256-row grid leaves SMs idle (28672 rows: 224 tiles at M = 256 on an
    # H200's 132 SMs); a caller's workspace too small for its slots gets the plain grid instead, bit for bit
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_WS_TOK", "128")  # (the 256-token tile's rule takes this layer at M = 256)
    rng = np.random.default_rng(29)
    layer = random_layer(rng, 28672, 1216, gs=64, zero_mode="int", bias=True)  # 2^25.06 weights
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(256, 1216, device="cuda", dtype=torch.float16)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert "stream-k=132" in lin.plan(256)["detail"], lin.plan(256)
    got = lin.forward(x)
    monkeypatch.setenv("W4P_CUDA_WS_SK", "0")
    lin._plans.clear()
    plain_plan = lin.plan(256)
    assert "stream-k" not in plain_plan["detail"], plain_plan
    want = lin.forward(x)
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err <= 1e-3, err
    monkeypatch.delenv("W4P_CUDA_WS_SK")
    lin._plans.clear()
    small = torch.zeros(plain_plan["workspace_bytes"], dtype=torch.uint8, device="cuda")
    monkeypatch.setattr(cuda, "_workspace", lambda *args: small)
    assert torch.equal(lin.forward(x), want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,sk,ms", [("128", "0", (16, 40, 64, 200)), ("256", "0", (100, 256)),
                                        ("256", "1", (100, 300)), ("192", "0", (100, 256))])
def test_wgmma_ws_output_staging(rows, sk, ms, monkeypatch):
    # wgmma_ws stages its output tile in shared memory and writes y in 16-byte runs where y allows (a row stride that
    # is a multiple of 8 elements, a 16-byte aligned start), else element by element: the same bits either way, all
    # of y written (a ragged last run of rows, tokens past M) and nothing outside it
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_WS_ROWS", rows)
    monkeypatch.setenv("W4P_CUDA_WS_SK", sk)
    rng = np.random.default_rng(zlib.crc32(repr(("staging", rows, sk)).encode()))
    n, k = 1003, 1000
    layer = random_layer(rng, n, k, gs=128, zero_mode="int", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    splits = 0 if sk == "1" else 1
    for m in ms:
        plan = lin.plan(m, kernel="wgmma_ws", splits=splits)
        tiled = m > 64 and rows != "128"  # (the smaller token tiles keep 128-row blocks, which print no rows=)
        assert (f"rows={rows}" in plan["detail"] if tiled else "rows=" not in plan["detail"]), plan
        assert ("stream-k" in plan["detail"]) == (sk == "1"), plan
        assert plan["splits"] == 1, plan
        err = run_case(torch, rng, layer, m, "float16", kernel="wgmma_ws", splits=splits, lin=lin)
        assert err <= 1e-3, (m, err)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        runs = torch.full((m, 1008), float("nan"), dtype=torch.float16, device="cuda")  # 16-byte runs
        lin.forward(x, out=runs[:, :n], kernel="wgmma_ws", splits=splits)
        odd = torch.full((m, n + 2), float("nan"), dtype=torch.float16, device="cuda")  # misaligned, odd stride
        lin.forward(x, out=odd[:, 1:n + 1], kernel="wgmma_ws", splits=splits)
        torch.cuda.synchronize()
        assert not torch.isnan(runs[:, :n]).any() and torch.isnan(runs[:, n:]).all()
        assert torch.isnan(odd[:, 0]).all() and torch.isnan(odd[:, n + 1]).all()
        assert torch.equal(odd[:, 1:n + 1], runs[:, :n]), m


PDL_CHAIN = (  # (M, kernel, splits, env, a word of its plan): every sm_90 kernel path, launched with programmatic
    # dependent launch: the bulk kernel's split sums through the workspace and its one-stripe units, wgmma_ws's
    # cluster and workspace split sums, wgmma_ss, stream-K, the plain grid, the gemv kernel (its activations staged
    # after the wait)
    (1, "gemv", 0, {}, "gemv"),
    (1, "bulk", 0, {"W4P_CUDA_BULK_QS": "4"}, "stripes=4"), (8, "bulk", 0, {"W4P_CUDA_BULK_QS": "1"}, "stripes=1"),
    (16, "wgmma_ws", 3, {}, "sum=cluster"), (64, "wgmma_ws", 2, {"W4P_CUDA_CLUSTER": "0"}, "sum=workspace"),
    (128, "wgmma_ss", 0, {}, "wgmma_ss"), (200, "wgmma_ws", 0, {"W4P_CUDA_WS_RS": "2", "W4P_CUDA_WS_SK": "1"},
                                           "stream-k="),
    (300, "wgmma_ws", 0, {"W4P_CUDA_WS_RS": "1"}, "splits=1"), (150, "wgmma_ws", 0, {"W4P_CUDA_WS_ROWS": "192"},
                                                                "rows=192"))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "2"])
def test_dependent_launches_wait_for_the_previous_kernel(pdl, monkeypatch):
    # With programmatic dependent launch a kernel starts while the one before it on the stream still runs. Calls
    # that read the previous call's output, or overwrite the buffer the previous call read, must see exactly what
    # they see with plain launches. The graph replays queue every call before any completes (eager calls may not:
    # Python's launch overhead can outlast a kernel)
    import torch

    if not wgmma_ok():
        pytest.skip("programmatic dependent launch is used by the sm_90 kernels")
    rng = np.random.default_rng(zlib.crc32(repr(("pdl", pdl)).encode()))
    n = k = 1536
    lins = [cuda.CudaPackedLinear(pack(random_layer(rng, n, k, gs=128, zero_mode="int", bias=True)), "cuda")
            for _ in range(2)]
    for m, kernel, splits, env, word in PDL_CHAIN:
        for other in PDL_CHAIN:  # only this entry's switches
            for key in other[3]:
                monkeypatch.delenv(key, raising=False)
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        x = (torch.randn(m, k, device="cuda") * 0.1).half()

        def chain(b, sync=False):
            # (input, output) per call: each reads the last call's output; after the second a plain torch kernel
            # (which does not trigger the next launch) rescales its output; the fifth overwrites the buffer the
            # fourth read, the sixth the first call's input
            for i, (src, dst) in enumerate(((0, 1), (1, 2), (2, 3), (3, 4), (4, 3), (3, 0))):
                lins[i % 2].forward(b[src], out=b[dst], kernel=kernel, splits=splits)
                if i == 1:
                    b[dst].mul_(0.01)
                if sync:
                    torch.cuda.synchronize()

        def fresh():
            return [x.clone()] + [torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
                                  for _ in range(4)]

        monkeypatch.setenv("W4P_CUDA_PDL", "0")
        ref = fresh()
        chain(ref, sync=True)  # one call at a time, plain launches
        assert all(torch.isfinite(r).all() for r in ref), (m, kernel)

        monkeypatch.setenv("W4P_CUDA_PDL", pdl)
        plan = lins[0].plan(m, kernel=kernel, splits=splits)
        assert plan["kernel"] == cuda.KERNELS[kernel] and word in plan["detail"], (m, plan)
        bufs = fresh()
        chain(bufs)
        torch.cuda.synchronize()
        for i in range(5):
            assert torch.equal(bufs[i], ref[i]), (m, kernel, i)

        bufs = fresh()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain(fresh())  # warm-up on the capture stream: its workspace is allocated outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            chain(bufs)
        for _ in range(2):
            for i in range(1, 5):
                bufs[i].fill_(float("nan"))
            bufs[0].copy_(x)
            g.replay()
            torch.cuda.synchronize()
            for i in range(5):
                assert torch.equal(bufs[i], ref[i]), ("graph", m, kernel, i)
        for key in env:
            monkeypatch.delenv(key)


@pytest.mark.gpu
def test_wgmma_kernel_large_and_repeatable():
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    rng = np.random.default_rng(17)
    layer = random_layer(rng, 1000, 4096, gs=128, zero_mode="int")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for kernel in ("wgmma", "wgmma_ws"):
        for m in (64, 256, 1000):
            assert run_case(torch, rng, layer, m, "float16", kernel=kernel, lin=lin) <= 1e-3, (kernel, m)
        x = torch.randn(200, 4096, device="cuda", dtype=torch.float16)
        first = lin.forward(x, kernel=kernel)
        for _ in range(5):
            assert torch.equal(lin.forward(x, kernel=kernel), first)


@pytest.mark.gpu
def test_large_shapes():
    import torch

    rng = np.random.default_rng(7)
    layer = random_layer(rng, 4096, 4096, gs=128, zero_mode="int")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m in (1, 16, 64, 300, 2048):
        assert run_case(torch, rng, layer, m, "float16", lin=lin) <= 1e-3, m
    assert run_case(torch, rng, layer, 1000, "bfloat16", lin=lin) <= 8e-3


@pytest.mark.gpu
def test_strided_input_and_explicit_bias():
    import torch

    rng = np.random.default_rng(3)
    layer = random_layer(rng, 96, 512, gs=128)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    wide = torch.randn(20, 520, device="cuda", dtype=torch.float16)
    x = wide[:, 3:515]  # row stride 520, not 16-byte aligned
    bias = torch.randn(96, device="cuda", dtype=torch.float16)
    y = lin.forward(x, bias=bias)
    ref = reference(layer, x.double().cpu().numpy(), bias.double().cpu().numpy())
    assert rel_err(y, ref) <= 1e-3
    # M <= 8 on unaligned rows: the ring kernel gathers them first
    assert rel_err(lin.forward(x[:7], bias=bias, kernel="ring"), ref[:7]) <= 1e-3
    if bulk_ok():
        assert rel_err(lin.forward(x[:13], bias=bias, kernel="bulk"), ref[:13]) <= 1e-3
    y3 = lin.forward(x.reshape(4, 5, 512), bias=False)
    assert y3.shape == (4, 5, 96)
    assert rel_err(y3.reshape(20, 96), reference(layer, x.double().cpu().numpy(), None)) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,kernel", [(1, "stream"), (16, "stream"), (64, "tiled"), (1024, "tiled"), (256, "dense"),
                                      (1, "ring"), (8, "ring"), (4, "ring"), (1, "bulk"), (16, "bulk")])
def test_repeated_calls_are_bit_identical(m, kernel):
    import torch

    if kernel == "bulk" and not bulk_ok():
        pytest.skip("the bulk kernel needs compute capability 9.0")

    rng = np.random.default_rng(m)
    layer = random_layer(rng, 1024, 4096, gs=128, zero_mode="int")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
    if kernel != "bulk":  # (for the bulk kernel, splits are its stages; 1024 rows always share quads)
        assert lin.plan(m, kernel=kernel)["splits"] > 1 or m >= 256  # the split-K reduction is exercised
    first = lin.forward(x, kernel=kernel)
    for _ in range(20):
        assert torch.equal(lin.forward(x, kernel=kernel), first)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    import torch

    rng = np.random.default_rng(11)
    layer = random_layer(rng, 512, 2048, gs=64, zero_mode="float", act_order=True, bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m, kernel in ((1, "auto"), (24, "auto"), (48, "tiled"), (48, "auto"), (256, "auto"), (7, "ring"),
                      (2, "ring"), (1, "stream")) + (((1, "bulk"), (13, "bulk")) if bulk_ok() else ()):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
        eager = lin.forward(x, kernel=kernel)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lin.forward(x, kernel=kernel)  # warm-up on the capture stream (workspace allocated outside the capture)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = lin.forward(x, kernel=kernel)
        g.replay()
        torch.cuda.synchronize()
        dense = lin.plan(m, kernel=kernel)["kernel"] == cuda.KERNELS["dense"]

        def same(a, b):  # our kernels: bit-identical; the dense path's GEMM is cuBLAS's (may pick another algorithm)
            return torch.equal(a, b) if not dense else rel_err(a, b.double().cpu().numpy()) <= 1e-3

        assert same(y, eager), (m, kernel)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert same(y, lin.forward(x, kernel=kernel)), (m, kernel)


@pytest.mark.gpu
def test_auto_plan_per_shape():
    # small M: the ring kernel on 70B-sized layers, the stream kernel on small ones, dense from DENSE_MIN_M
    import torch

    ffi, lib = cuda._load()
    ko, so, wb = ffi.new("int *"), ffi.new("int *"), ffi.new("size_t *")

    def auto(m, n, k):
        assert lib.w4p_cuda_plan(0, m, n, k, 4, 128, 0, 1, 0, 0, ko, so, wb) == 0
        return ko[0]

    # sm_90+: the bulk kernel up to M = 4 on every shape, to 8 on layers of 2^25 weights or more and on those
    # of one-stripe units (at most two stripes per SM); otherwise (and before sm_90) ring / stream as measured
    m1 = cuda.KERNELS["bulk"] if bulk_ok() else None
    assert auto(1, 28672, 8192) == (m1 or cuda.KERNELS["ring"])
    assert auto(1, 4096, 4096) == (m1 or cuda.KERNELS["stream"])
    assert auto(2, 4096, 4096) == (m1 or cuda.KERNELS["stream"])
    assert auto(4, 28672, 8192) == (m1 or cuda.KERNELS["ring"])
    assert auto(4, 4096, 4096) == (m1 or cuda.KERNELS["stream"])
    assert auto(7, 8192, 28672) == (m1 or cuda.KERNELS["ring"])
    assert auto(8, 8192, 28672) == (m1 or cuda.KERNELS["ring"])
    one_stripe = bulk_ok() and torch.cuda.get_device_properties(0).multi_processor_count * 2 >= 256
    assert auto(5, 4096, 4096) == (m1 if one_stripe else cuda.KERNELS["stream"])
    assert auto(5, 6144, 4096) == cuda.KERNELS["stream"]
    # sm_90: the warp-specialized wgmma kernel from M = 9 (to 32 on every layer, to 256 on large ones), else
    # tiled (-> dense)
    wg = cuda.KERNELS["wgmma_ws"] if wgmma_ok() else None
    assert auto(9, 28672, 8192) == (wg or cuda.KERNELS["stream"])
    assert auto(9, 4096, 4096) == (wg or cuda.KERNELS["stream"])
    assert auto(16, 11008, 4096) == (wg or cuda.KERNELS["stream"])
    assert auto(17, 4096, 4096) == (wg or cuda.KERNELS["stream"])
    # sm_90: wgmma_ws in 256-row blocks from M = 65 where they fill the waves (112 row blocks here; H200: 85%)
    # or run unsplit where wgmma_ss would; wgmma_ss where it splits
    ss = cuda.KERNELS["wgmma_ss"] if wgmma_ok() else None
    assert auto(200, 28672, 8192) == (wg or cuda.KERNELS["tiled"])
    assert auto(100, 28672, 8192) == (wg or cuda.KERNELS["tiled"])
    assert auto(200, 8192, 28672) == (wg or cuda.KERNELS["tiled"])
    assert auto(257, 28672, 8192) == (wg or cuda.KERNELS["tiled"])
    # 300 tokens on 8192 rows: 129 blocks of 192 rows (one wave on 132 SMs), else wgmma_ss's 4 splits of 96 blocks
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert auto(300, 8192, 28672) == ((wg if sms == 132 else ss) or cuda.KERNELS["tiled"])
    assert auto(1025, 28672, 8192) == cuda.KERNELS["tiled"]
    lin = cuda.CudaPackedLinear(pack(random_layer(np.random.default_rng(3), 4096, 4096, gs=128)), "cuda")
    assert lin.plan(64)["kernel"] == (wg or -1)  # 2^24 weights: wgmma_ws while its blocks fit in one wave
    assert lin.plan(300)["kernel"] == -1  # the last token tile less than half full: dense
    assert lin.plan(32)["kernel"] == (wg or cuda.KERNELS["stream"])
    small = cuda.CudaPackedLinear(pack(random_layer(np.random.default_rng(4), 2048, 4096, gs=128)), "cuda")
    assert small.plan(64)["kernel"] == -1  # 2^23 weights: dense from M = 33


@pytest.mark.gpu
def test_auto_without_tma_runs_the_wgmma_kernel(monkeypatch):
    # the fallback a driver without the TMA encoder gets, simulated: same numbers through the one-pass kernel
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    rng = np.random.default_rng(11)
    layer = random_layer(rng, 196, 576, gs=64, bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(16, 576, device="cuda", dtype=torch.float16)
    ref = reference(layer, x.double().cpu().numpy(), to_float64(layer.bias, "float16"))
    assert lin.plan(16)["kernel"] == cuda.KERNELS["wgmma_ws"]
    assert rel_err(lin.forward(x), ref) <= 1e-3
    monkeypatch.setenv("W4P_CUDA_NO_TMA", "1")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")  # (a layer caches its plans)
    assert lin.plan(16)["kernel"] == cuda.KERNELS["wgmma"]
    assert rel_err(lin.forward(x), ref) <= 1e-3


@pytest.mark.gpu
def test_gemm_entry_and_errors():
    import torch

    from w4pack.errors import BadInputError, UnsupportedError

    rng = np.random.default_rng(5)
    layer = random_layer(rng, 64, 256, gs=64, bias=True)
    packed = pack(layer)
    x = torch.randn(3, 256, device="cuda", dtype=torch.float16)
    y = cuda.gemm_cuda(x, packed)
    ref = reference(layer, x.double().cpu().numpy(), to_float64(layer.bias, "float16"))
    assert rel_err(y, ref) <= 1e-3
    with pytest.raises(UnsupportedError):
        cuda.gemm_cuda(x.float(), packed)
    with pytest.raises(BadInputError):
        cuda.gemm_cuda(x[:, :128], packed)
    with pytest.raises(cuda.CudaKernelError, match="ring kernel takes M <= 8"):
        cuda.CudaPackedLinear(packed, "cuda").forward(torch.randn(9, 256, device="cuda", dtype=torch.float16),
                                                      kernel="ring")
    with pytest.raises(cuda.CudaKernelError, match="gemv kernel takes M = 1"):
        cuda.CudaPackedLinear(packed, "cuda").forward(torch.randn(2, 256, device="cuda", dtype=torch.float16),
                                                      kernel="gemv")
    with pytest.raises(cuda.CudaKernelError, match="bulk kernel needs"):
        cuda.CudaPackedLinear(packed, "cuda").forward(torch.randn(17, 256, device="cuda", dtype=torch.float16),
                                                      kernel="bulk")
