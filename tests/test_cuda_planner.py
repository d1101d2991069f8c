"""The CUDA planner (native/cuda/planner.cpp) on described devices, built by the host compiler alone
(native/cuda/build_planner.sh): no GPU and no nvcc. Every plan's properties (a legal kernel, it fits the device,
split grids only where the unsplit one leaves SMs idle), the exact H200 choices in one golden table
(tests/data/cuda_plans_h200.tsv), the choice table of docs/CUDA.md, and each rule's edges."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from w4pack.native import cuda

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "data" / "cuda_plans_h200.tsv"

# switches the native planner reads at each call (A/B runs, tests); the build's own variables are left alone
_BUILD_VARS = {"W4P_CUDA_ARCHS", "W4P_CUDA_FORCE", "W4P_CUDA_OUT", "W4P_CUDA_DEFINES", "W4P_CUDA_DEBUG"}


@pytest.fixture(autouse=True)
def _no_planner_switches(monkeypatch):
    """Each test starts from the planner's own choices, whatever the shell or an earlier test left set."""
    for var in [v for v in os.environ if v.startswith("W4P_CUDA_") and v not in _BUILD_VARS]:
        monkeypatch.delenv(var)


# (multiprocessors, compute capability, shared memory per SM / per block / reserved)
H200 = (132, 90, 233472, 232448, 1024)
A100 = (108, 80, 167936, 166912, 1024)

_PLANNER: list = []


@pytest.fixture(scope="module", autouse=True)
def _planner_library(tmp_path_factory):
    """The host-only planner library, built from the worktree's sources once for this module."""
    if not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no C++ compiler: install g++ or clang++, or set CXX")
    import cffi

    out = tmp_path_factory.mktemp("planner") / "libw4p_cuda_plan.so"
    subprocess.run(["bash", str(ROOT / "native" / "cuda" / "build_planner.sh"), str(out)], check=True)
    ffi = cffi.FFI()
    ffi.cdef(cuda.cuda_cdef(cuda.header_path().read_text()))
    _PLANNER[:] = [(ffi, ffi.dlopen(str(out)))]
    yield
    _PLANNER.clear()


def _lib_or_skip():
    """(ffi, lib) of the host-only planner library"""
    return _PLANNER[0]


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

    # H200 (sm_90): gemv at M = 1 where its whole-stripe blocks fill their rounds and at M = 2-8 where the staged
    # rows leave its blocks per SM (test_plan_for_gemv; two rows of K = 28672 do not), bulk up to M = 4 everywhere
    # else (up to 8 on large layers), stream otherwise up to 8, then wgmma_ws; tiled beyond (Python takes the dense
    # path from DENSE_MIN_M on)
    for n, kk in ((28672, 8192), (8192, 28672), (4096, 4096), (11008, 4096), (196, 576)):
        for m in (1, 2, 4):
            gemv = n != 196 and (m == 1 or kk < 28672)
            assert auto(H200, m, n, kk) == (k["gemv"] if gemv else k["bulk"]), (m, n, kk)
    # without the gemv kernel: bulk up to M = 8 on layers of 2^25 weights or more and on those of one-stripe units
    # (at most 264 stripes), the stream kernel from M = 5 on the other ones
    monkeypatch.setenv("W4P_CUDA_GEMV", "0")
    for n, kk in ((28672, 8192), (8192, 28672), (11008, 4096), (4096, 11008), (12288, 4096), (4096, 4096),
                  (4224, 2048), (196, 576)):
        for m in (5, 7, 8):
            assert auto(H200, m, n, kk) == k["bulk"], (m, n, kk)
    assert auto(H200, 5, 4240, 4096) == k["stream"]  # 265 stripes
    assert auto(H200, 8, 6144, 4096) == k["stream"]
    assert auto(H200, 8, 4096, 4096, bits=8) == k["stream"]
    monkeypatch.delenv("W4P_CUDA_GEMV")
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
    assert _plan_for(lib, ffi, H200, 5, 6144, 4096)[1] == k["gemv"]  # below the range: unchanged
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
    # the gemv kernel: M = 1 to 8, 4-bit, group sizes that are multiples of 32 or per channel, compute capability 8.0+;
    # "auto" takes it on compute capability 9.0 at M = 1 from 0.24 stripes per SM (32 on an H200) and, on layers of
    # 2^25 weights or more, where its rounds of blocks (264 on an H200: two per SM) are 60% full (stripes >= 0.6 x
    # rounds x blocks), however long the stripes; at M = 2 from 0.24 stripes per SM, at M = 3-8 from 0.85, and on
    # those layers at M = 2-8 where its rounds are 70% full
    ffi, lib = _lib_or_skip()

    def auto(m, n, kk, dev=H200, **kw):
        return _describe_for(lib, ffi, dev, m, n, kk, **kw)

    for n, kk in ((11008, 4096), (12288, 4096)):  # 688 and 768 stripes of 64 tiles
        d = auto(1, n, kk)
        assert d["kernel"] == "gemv" and d["blocks"] == "264" and d["stripes"] == str(n // 16), d
        assert auto(1, n, kk, gs=32)["kernel"] == "gemv" and auto(1, n, kk, gs=-1)["kernel"] == "gemv"
        assert auto(1, n, kk, gs=48)["kernel"] != "gemv"
        assert auto(1, n, kk, bits=8)["kernel"] != "gemv"
        assert auto(1, n, kk, dev=A100)["kernel"] != "gemv"  # measured on sm_90 only
        monkeypatch.setenv("W4P_CUDA_GEMV", "0")
        assert auto(1, n, kk)["kernel"] == "bulk"
        monkeypatch.delenv("W4P_CUDA_GEMV")
    # one round 97% full, long stripes (172 and 448 tiles) included; four rounds 85% full; small layers of fewer
    # stripes than blocks (128, 192, 396) where every SM gets one: gemv
    for n, kk in ((4096, 4096), (4096, 11008), (28672, 8192), (8192, 28672), (22016, 4096), (14336, 4096),
                  (2048, 8192), (3072, 8192), (6336, 4096)):
        assert auto(1, n, kk)["kernel"] == "gemv", (n, kk)
    # 32 and 64 stripes for 132 SMs: gemv at M = 1 and 2, bulk from M = 3; 2^26 weights in two rounds 61% full:
    # gemv at M = 1, bulk from M = 2
    for n, kk in ((512, 4096), (1024, 4096), (1024, 8192), (1024, 14336), (1024, 2048)):
        assert auto(1, n, kk)["kernel"] == "gemv" and auto(2, n, kk)["kernel"] == "gemv", (n, kk)
        assert auto(3, n, kk)["kernel"] == "bulk", (n, kk)
    assert auto(1, 5120, 13824)["kernel"] == "gemv" and auto(2, 5120, 13824)["kernel"] == "bulk"
    # the edges at M = 1: 0.24 x 132 SMs (31 and 32 stripes); two rounds 60% full on 2^25 weights or more (316 and
    # 317 stripes), not below 2^25
    assert auto(1, 31 * 16, 4096)["kernel"] == "bulk" and auto(1, 32 * 16, 4096)["kernel"] == "gemv"
    assert auto(1, 316 * 16, 8192)["kernel"] == "bulk" and auto(1, 317 * 16, 8192)["kernel"] == "gemv"
    assert auto(1, 316 * 16, 4096)["kernel"] == "gemv"  # (2^24.3 weights)
    # at M = 2: 31 and 32 stripes again; two rounds 70% full (369 and 370 stripes)
    assert auto(2, 31 * 16, 4096)["kernel"] == "bulk" and auto(2, 32 * 16, 4096)["kernel"] == "gemv"
    assert auto(2, 369 * 16, 8192)["kernel"] == "bulk" and auto(2, 370 * 16, 8192)["kernel"] == "gemv"
    # and at M = 3: 0.85 x 132 SMs (112 and 113 stripes)
    assert auto(3, 112 * 16, 4096)["kernel"] == "bulk" and auto(3, 113 * 16, 4096)["kernel"] == "gemv"
    # forced: any 4-bit layer at M = 1 that fits, on compute capability 8.0 and newer; one block per stripe at most
    d = _describe_for(lib, ffi, A100, 1, 196, 576, kernel="gemv")
    assert d["kernel"] == "gemv" and d["blocks"] == "13" and d["smem"] == str(2048 + 9 * 128), d
    assert _describe_for(lib, ffi, H200, 1, 28672, 8192, kernel="gemv")["blocks"] == "264"
    # several tokens: the rows staged one after the other, the stripe sums per token; the blocks per SM that hold it
    d = _describe_for(lib, ffi, H200, 8, 4096, 4096, kernel="gemv")
    assert d["blocks"] == "256" and d["smem"] == str(8 * (2048 + 64 * 128 + 16)), d  # (two per SM: 256 stripes)
    d = _describe_for(lib, ffi, H200, 8, 28672, 11008, kernel="gemv")
    assert d["blocks"] == "132" and d["smem"] == str(8 * (2048 + 172 * 128 + 16)), d  # (one per SM; rows padded)
    assert _describe_for(lib, ffi, H200, 3, 8192, 28672, kernel="gemv")["blocks"] == "132"
    # auto at M = 2-8: where it takes gemv at M = 1 and where the rows leave the blocks per SM it has at M = 1
    # (two: M * (K * 2 + 2064) bytes up to 115200 on an H200)
    for n, kk in ((4096, 4096), (11008, 4096), (12288, 4096), (14336, 4096), (4224, 2048)):
        for m in (2, 3, 5, 8):
            assert auto(m, n, kk)["kernel"] == "gemv", (m, n, kk)
    for m, want in ((2, "gemv"), (4, "gemv"), (5, "bulk"), (8, "bulk")):  # K = 11008: two blocks up to M = 4
        assert auto(m, 4096, 11008)["kernel"] == want, m
    for m, want in ((2, "gemv"), (3, "gemv"), (4, "bulk"), (6, "bulk")):  # K = 14336: up to M = 3
        assert auto(m, 4096, 14336)["kernel"] == want, m
    for n in (28672, 8192):  # K = 8192: two blocks up to M = 6
        for m, want in ((2, "gemv"), (4, "gemv"), (6, "gemv"), (7, "bulk"), (8, "bulk")):
            assert auto(m, n, 8192)["kernel"] == want, (m, n)
    for m in (2, 4, 8):  # K = 28672: one block per SM from M = 2
        assert auto(m, 8192, 28672)["kernel"] == "bulk", m
    assert auto(4, 1024, 4096)["kernel"] == "bulk"  # 64 stripes: gemv at M = 1 and 2 only
    assert auto(4, 4096, 4096, gs=48)["kernel"] != "gemv" and auto(4, 4096, 4096, dev=A100)["kernel"] != "gemv"
    assert auto(9, 4096, 4096)["kernel"] == "wgmma_ws"
    monkeypatch.setenv("W4P_CUDA_GEMV", "0")
    assert auto(4, 4096, 4096)["kernel"] == "bulk"
    monkeypatch.delenv("W4P_CUDA_GEMV")
    rc = _plan_for(lib, ffi, H200, 4, 8192, 28672, kernel="gemv")[0]  # 4 rows of 28672 do not fit a block
    assert rc != 0 and "K up to 27840 at this M" in ffi.string(lib.w4p_cuda_last_error()).decode()
    for m, n, kk, kw, dev in ((9, 4096, 4096, {}, H200), (1, 4096, 4096, {"bits": 8}, H200),
                              (1, 4096, 4096, {"gs": 16}, H200), (1, 4096, 4096, {}, (80, 75, 65536, 65536, 0)),
                              (1, 4096, 2 ** 17, {}, H200)):
        rc = _plan_for(lib, ffi, dev, m, n, kk, kernel="gemv", **kw)[0]
        assert rc != 0 and "gemv kernel takes M <= 8" in ffi.string(lib.w4p_cuda_last_error()).decode(), (m, kk, kw)


def test_plan_for_gemv_names_no_variant():
    # one gemv kernel: the plan's description is its grid, stripes, shared memory and workspace, with no variant
    # detail, forced or taken by "auto": two blocks of 16 warps per SM, shared memory for two 16 x 16 float sums
    # and the activations in fragment order (64 K tiles of 128 bytes)
    ffi, lib = _lib_or_skip()
    want = {"kernel": "gemv", "blocks": "264", "stripes": "688", "smem": str(2048 + 64 * 128), "workspace": "65536"}
    assert _describe_for(lib, ffi, H200, 1, 11008, 4096) == want
    assert _describe_for(lib, ffi, H200, 1, 11008, 4096, kernel="gemv") == want
    assert _describe_for(lib, ffi, A100, 1, 196, 576, kernel="gemv") == {
        "kernel": "gemv", "blocks": "13", "stripes": "13", "smem": str(2048 + 9 * 128), "workspace": "65536"}


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
        want = "gemv" if dev == mid else want  # (sm_90: 256 stripes fill the gemv kernel's round, two blocks per SM)
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


# -- every plan's properties, the golden H200 table, the rules table -------------------------------------------

def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuda_plans", ROOT / "tools" / "cuda_plans.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


L40S = (142, 89, 102400, 101376, 1024)
SM86 = (84, 86, 102400, 101376, 1024)


@pytest.mark.parametrize("dev", [H200, A100, L40S, SM86], ids=["H200", "A100", "L40S", "sm86"])
def test_every_auto_plan_is_legal_fits_and_fills_the_waves(dev):
    ffi, lib = _lib_or_skip()
    tool = _tool()
    sms, cc, _, smem_block, _ = dev
    for n, kk in tool.SHAPES:
        for bits, gs in tool.VARIANTS:
            for m in tool.MS:
                d = _describe_for(lib, ffi, dev, m, n, kk, bits, gs)
                rc, kind, splits, ws = _plan_for(lib, ffi, dev, m, n, kk, bits, gs)
                where = (dev, m, n, kk, bits, gs, d)
                name = d["kernel"]
                assert rc == 0 and cuda.KERNELS[name] == kind, where
                # a kernel this device, layer and M may take
                assert name in ("stream", "tiled", "ring", "bulk", "gemv", "wgmma", "wgmma_ws", "wgmma_ss"), where
                if name in ("wgmma", "wgmma_ws", "wgmma_ss"):
                    assert cc == 90 and bits == 4, where
                if name == "wgmma_ss":
                    assert gs == -1 or gs % 64 == 0, where
                if name == "bulk":
                    assert cc >= 90 and m <= 16 and (gs == -1 or gs % 32 == 0), where
                if name == "ring":
                    assert m <= 8 and (gs == -1 or gs % 32 == 0), where
                if name == "gemv":
                    assert m <= 8 and bits == 4 and cc >= 80, where
                if name == "stream":
                    assert gs == -1 or gs % 32 == 0, where
                # it fits: a block's shared memory (opt-in), the workspace's counters. (A "tiled" plan from
                # DENSE_MIN_M on runs as the dense path; the 8-bit tiled kernel's 112 KiB exceed 99 KiB devices.)
                if not (name == "tiled" and m >= cuda.DENSE_MIN_M):
                    assert int(d["smem"]) <= smem_block, where
                assert int(d["workspace"]) == ws >= 64 * 1024, where
                # the grid fills the waves: K is split only where the unsplit grid holds fewer than two blocks per
                # SM; stream-K runs one block per SM, each at least one tile
                if "stream-k" in d:
                    assert int(d["stream-k"]) == sms <= int(d["tiles"]), where
                elif int(d.get("splits", 1)) > 1:
                    assert int(d["tiles"]) < 2 * sms and splits == int(d["splits"]), where
                if name == "bulk":
                    assert int(d["blocks"]) <= 2 * sms, where
                if name == "gemv":
                    assert int(d["blocks"]) <= 3 * sms, where


def test_golden_h200_plans():
    # the exact H200 choices: tools/cuda_plans.py golden writes the table (regenerate it only with a measured change)
    ffi, lib = _lib_or_skip()
    tool = _tool()
    want = GOLDEN.read_text().splitlines()
    got = tool.golden_rows(ffi, lib)
    assert got[0] == want[0]
    diff = [(w, g) for w, g in zip(want[1:], got[1:]) if w != g]
    assert len(got) == len(want) and not diff, diff[:10]


def _size_class(n: int, k: int) -> str:
    w = (-(-n // 16) * 16) * (-(-k // 64) * 64)
    return "S" if w < 2 ** 24 else "M" if w < 2 ** 25 else "L" if w < 2 ** 26 else "XL"


def test_auto_rules_table_matches_the_planner():
    # planner_rules.h's AUTO_RULES (printed in docs/CUDA.md) holds for every golden shape at each row's M range
    ffi, lib = _lib_or_skip()
    tool = _tool()
    rules = tool.auto_rules()
    assert len(rules) >= 15
    for dev in (H200, A100, L40S, SM86):
        cc = dev[1]
        for n, kk in tool.SHAPES:
            size = _size_class(n, kk)
            for m in sorted(set(tool.MS) | {3000}):
                row = [r for r in rules if r[0] <= cc <= r[1] and r[2] <= m <= r[3] and size in r[4]]
                assert len(row) == 1, (dev, m, n, kk, row)
                name = _describe_for(lib, ffi, dev, m, n, kk)["kernel"]
                name = "dense" if name == "tiled" or (m >= cuda.DENSE_MIN_M and not name.startswith("wgmma")) else name
                assert name in row[0][5], (dev, m, n, kk, name, row[0])


def test_docs_show_the_planner_choice_tables():
    ffi, lib = _lib_or_skip()
    tool, docs = _tool(), (ROOT / "docs" / "CUDA.md").read_text()
    assert tool.choice_table(ffi, lib) in docs, "docs/CUDA.md: paste `python tools/cuda_plans.py table`"
    assert tool.rules_table() in docs, "docs/CUDA.md: paste `python tools/cuda_plans.py rules`"
