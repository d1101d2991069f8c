#!/usr/bin/env python3
"""GPU benchmark of the w4pack CUDA GEMM against cuBLAS fp16, torch tinygemm (bf16) and, when importable,
Marlin / gemlite, on Llama-2 7B and 70B layer shapes, group size 128.

Method (docs/journal/2026-cuda.md, section 6): weights are L2-cold (each kernel rotates through enough weight copies to pass
~4x the 60 MB L2); one CUDA graph holds one call per copy and is replayed; each replay is timed with
CUDA events; the reported time per call is the median over replays divided by the copies. Achieved
GB/s counts the bytes a call must move (int4 weights + scales [+ zeros] + activations in + outputs out).

Usage: python tools/bench_gpu.py [--quick | --ms 1,4,16] [--sweep] [--shapes KxN,...] [--json OUT.jsonl]
       python tools/bench_gpu.py --floors [--shapes ...] [--ms ...]   (the bytes and FLOPs floors; no GPU)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from w4pack.layout import LAYOUT_NAME, LAYOUT_VERSION, PackedLayer  # noqa: E402
from w4pack.native import cuda as w4cuda  # noqa: E402

# planner switches the native side reads at each plan (W4P_CUDA_*), set for a block and restored after
from bench_run import environment as planner_switches  # noqa: E402

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 12288), (8192, 28672), (28672, 8192)]  # K x N
MS = [1, 4, 8, 16, 32, 64, 128, 256, 1024]
GS = 128
L2_PASS_BYTES = 240e6
WARM_S = 0.02  # seconds of untimed graph replays before each measurement (time_graph)
READ_BW_REF = 4494.0  # GB/s, best read stream measured on this H200 (gpu-baseline.md)
FLOPS_REF = 661e12    # FLOP/s, cuBLAS fp16 dense GEMM measured on this H200 (gpu-baseline.md; datasheet ~990)
# the floors' references in use: the H200's above, or those given or measured on another GPU (set_reference)
REF = {"read_gbs": READ_BW_REF, "flops": FLOPS_REF, "source": "the H200's (gpu-baseline.md)"}


def set_reference(read_gbs: float, flops: float, source: str) -> None:
    """The read stream (GB/s) and fp16 GEMM rate (FLOP/s) the floors and "% read BW" are taken against."""
    REF.update(read_gbs=float(read_gbs), flops=float(flops), source=source)


def measure_reference(bw: dict[str, float]) -> tuple[float, float]:
    """This GPU's own references, at no extra read: the best read stream of the run's load-only probes (w4pack's
    loads of a 0.5 GB layer, read_bandwidth) and cuBLAS's fp16 rate on 8192^3."""
    read_gbs = max(bw["probe_load_gbs"], bw["probe_bulk_gbs"])
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    c = torch.empty(n, n, device="cuda", dtype=torch.float16)
    t_mm = time_graph(lambda i: torch.mm(a, b, out=c), 1, replays=10)
    del a, b, c
    return read_gbs, 2.0 * n**3 / (t_mm * 1e-6)


_STREAM: list = []


def time_graph(calls, copies: int, replays: int = 15) -> float:
    """Median microseconds per call: one graph with one call per weight copy, replayed and event-timed."""
    if not _STREAM:
        _STREAM.append(torch.cuda.Stream())
    s = _STREAM[0]
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            calls(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            calls(i)
    g.replay()
    torch.cuda.synchronize()
    # untimed replays first: without them a 70B-shaped layer timed right after another workload (a peer's GEMV)
    # ran slower through its whole measurement, and at its usual speed in the next (journal 2026-cuda section 18)
    t_end = time.perf_counter() + WARM_S
    while time.perf_counter() < t_end:
        g.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / copies)
    del g
    return statistics.median(times)


def n_copies(bytes_per_copy: float) -> int:
    return max(1, min(64, math.ceil(L2_PASS_BYTES / bytes_per_copy)))


def random_packed(k: int, n: int, gs: int = GS, zero_mode: str = "none") -> PackedLayer:
    """A valid packed layer with random codes (every int32 pattern is a valid set of 4-bit codes)."""
    rng = np.random.default_rng(k * 7 + n)
    np_, kp = -(-n // 16) * 16, -(-k // 64) * 64
    gp = -(-kp // gs)
    g = -(-k // gs)
    meta = {"bits": 4, "storage_bits": 4, "group_size": gs, "zero_mode": zero_mode, "shape": [n, k],
            "padded_shape": [np_, kp], "num_groups": g, "padded_groups": gp, "scale_dtype": "float16",
            "act_order": False, "bias_dtype": None, "layout": LAYOUT_NAME, "layout_version": LAYOUT_VERSION}
    qw = rng.integers(-2**31, 2**31, size=(np_ // 16, kp // 64 * 128), dtype=np.int64).astype(np.int32)
    tensors = {"qweight": qw, "scales": (rng.uniform(0.5, 1.5, size=(gp, np_)) * 0.01).astype(np.float16)}
    if zero_mode == "int":
        tensors["zeros"] = rng.integers(0, 16, size=(gp, np_), dtype=np.uint8)
    return PackedLayer(meta=meta, tensors=tensors)


def w4_copies(packed: PackedLayer, copies: int) -> list[w4cuda.CudaPackedLinear]:
    base = w4cuda.CudaPackedLinear(packed, "cuda", dtypes=("float16",))
    out = [base]
    for _ in range(copies - 1):
        c = copy.copy(base)
        c.qweight = base.qweight.clone()
        c._by_dtype = {d: {kk: vv.clone() for kk, vv in p.items()} for d, p in base._by_dtype.items()}
        out.append(c)
    return out


def w4_bytes(k: int, n: int, m: int, zero_mode: str = "none") -> float:
    zeros = n * math.ceil(k / GS) if zero_mode == "int" else 0  # one byte per group and column
    return k * n / 2 + 2 * n * math.ceil(k / GS) + zeros + 2 * m * k + 2 * m * n


def floors_us(k: int, n: int, m: int, zero_mode: str = "none") -> tuple[float, float]:
    """The two floors of one call (us): its bytes at the measured read stream, its FLOPs at cuBLAS's rate."""
    return w4_bytes(k, n, m, zero_mode) / (REF["read_gbs"] * 1e9) * 1e6, 2.0 * m * k * n / REF["flops"] * 1e6


_READ_KERNEL: list = []


def read_floor_us(nbytes: float) -> tuple[float, str]:
    """The fastest graph-replayed, L2-cold read of `nbytes` that a plain Triton streaming kernel reaches here
    (int32 words summed per program; best over block size, blocks per program and warps), with its
    configuration. On a layer-sized buffer this, not the large-buffer read stream, is what an M = 1 kernel
    can at best take, launch gaps and ramp included."""
    import triton
    import triton.language as tl

    if not _READ_KERNEL:
        @triton.jit
        def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PER: tl.constexpr):
            pid = tl.program_id(0)
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            base = pid.to(tl.int64) * BLOCK * PER
            for i in tl.range(0, PER, num_stages=3):
                offs = base + i * BLOCK + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
            tl.store(out_ptr + pid, tl.sum(acc, 0))

        _READ_KERNEL.append(_read)
    read = _READ_KERNEL[0]
    n = int(nbytes // 4)
    copies = n_copies(nbytes)
    xs = [torch.randint(-1000, 1000, (n,), device="cuda", dtype=torch.int32) for _ in range(copies)]
    best = (float("inf"), "")
    for block in (1024, 2048, 4096):
        for per in (1, 2, 4, 8):
            for warps in (4, 8):
                grid = triton.cdiv(n, block * per)
                out = torch.empty(grid, device="cuda", dtype=torch.int32)
                t = time_graph(lambda i: read[(grid,)](xs[i], out, n, BLOCK=block, PER=per, num_warps=warps), copies)
                if t < best[0]:
                    best = (t, f"block {block} x {per}, {warps} warps")
    del xs
    return best


def print_read_floors(shapes) -> None:
    """Per shape: the M = 1 bytes, the plain read kernel's best time for them and w4pack's M = 1 time."""
    print("| K×N | M = 1 bytes (MB) | plain read (us) | read GB/s | w4pack M = 1 (us) | w4pack / read | read config |")
    print("|---|---|---|---|---|---|---|")
    for k, n in shapes:
        nb = w4_bytes(k, n, 1)
        t, cfg = read_floor_us(nb)
        lins = w4_copies(random_packed(k, n), n_copies(k * n / 2 * 1.03))
        t_w4 = measure_w4(lins, k, n, 1)
        del lins
        print(f"| {k}×{n} | {nb / 1e6:.1f} | {t:.2f} | {nb / t / 1e3:.0f} | {t_w4:.1f} | {t_w4 / t:.2f} | {cfg} |",
              flush=True)


def print_floors(shapes, ms, zero_mode: str = "none") -> None:
    """Markdown table of both floors per shape and M (no GPU needed): the larger one bounds any kernel."""
    zeros = f" + 8-bit zero points per {GS}" if zero_mode == "int" else ""
    print(f"Floors (us): bytes (int4 weights + fp16 scales per {GS}{zeros} + x in + y out) at {REF['read_gbs']:.0f} "
          f"GB/s / FLOPs at {REF['flops'] / 1e12:.0f} TFLOP/s ({REF['source']}); the larger one in bold")
    print("| K×N | " + " | ".join(f"M = {m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    for k, n in shapes:
        cells = []
        for m in ms:
            b, f = floors_us(k, n, m, zero_mode)
            cells.append(f"**{b:.1f}** / {f:.1f}" if b >= f else f"{b:.1f} / **{f:.1f}**")
        print(f"| {k}×{n} | " + " | ".join(cells) + " |")


def measure_w4(lins, k, n, m, kernel="auto", splits=0) -> float:
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    ys = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(2)]
    return time_graph(lambda i: lins[i].forward(x, out=ys[i & 1], kernel=kernel, splits=splits), len(lins))


def measure_w4_env(lins, k, n, m, kernel: str, splits: int, env: dict[str, str]) -> float:
    """measure_w4 under planner switches: the layers' cached plans are dropped before and after, so neither the
    switched call nor the next one runs a stale plan."""
    try:
        with planner_switches(env):
            for lin in lins:
                lin._plans.clear()
            return measure_w4(lins, k, n, m, kernel, splits)
    finally:
        for lin in lins:
            lin._plans.clear()


def measure_cublas(k, n, m) -> tuple[float, float]:
    copies = n_copies(2 * k * n)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(copies)]
    wts = [w.t().contiguous() for w in ws]  # [K, N] for x @ W
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    t_mm = time_graph(lambda i: torch.matmul(x, wts[i]), copies)
    t_lin = time_graph(lambda i: F.linear(x, ws[i]), copies)
    del ws, wts
    return t_mm, t_lin


def measure_tinygemm(k, n, m) -> float | None:
    try:
        copies = n_copies(k * n / 2)
        inner = 8
        packs, szs = [], []
        for _ in range(copies):
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            packs.append(torch._convert_weight_to_int4pack(w, inner))
            sz = torch.rand(k // GS, n, 2, device="cuda", dtype=torch.bfloat16)
            szs.append(sz)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t = time_graph(lambda i: torch._weight_int4pack_mm(x, packs[i], GS, szs[i]), copies)
        del packs, szs
        return t
    except Exception as exc:  # noqa: BLE001 - a peer missing in this torch build is reported, not fatal
        print(f"tinygemm unavailable: {exc}", file=sys.stderr)
        return None


_GEMLITE: dict = {}


def measure_gemlite(k, n, m) -> float | None:
    """gemlite (Triton) A16W4 with group 128 and asymmetric fp16 zeros, its h100 autotune table loaded; None if
    gemlite is not importable or fails on this shape. Its first call per shape autotunes where the table has
    no entry; a run stops trying gemlite once that takes over GEMLITE_BUDGET_S in total."""
    if _GEMLITE.get("off"):
        return None
    try:
        import gemlite
        from gemlite.core import DType, GemLiteLinearTriton
    except Exception as exc:  # noqa: BLE001 - absent peer: reported once
        _GEMLITE["off"] = True
        print(f"gemlite unavailable: {exc}", file=sys.stderr)
        return None
    try:
        if "init" not in _GEMLITE:
            cfg = Path(gemlite.__file__).parent / "configs" / "h100.json"
            GemLiteLinearTriton.load_config(str(cfg))
            _GEMLITE["init"] = True
            _GEMLITE["spent"] = 0.0
        copies = n_copies(k * n / 2)
        lins = []
        for _ in range(copies):
            lin = GemLiteLinearTriton(4, group_size=GS, in_features=k, out_features=n, input_dtype=DType.FP16,
                                      output_dtype=DType.FP16)
            wq = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
            sc = (torch.rand(n, k // GS, device="cuda", dtype=torch.float16) + 0.5) * 0.01
            zr = torch.randint(0, 16, (n, k // GS), device="cuda").to(torch.float16)
            lin.pack(wq, sc, zr, None)
            lins.append(lin)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        t0 = time.time()
        lins[0](x)
        torch.cuda.synchronize()
        _GEMLITE["spent"] += time.time() - t0
        t = time_graph(lambda i: lins[i](x), copies)
        if _GEMLITE["spent"] > _GEMLITE.get("budget", GEMLITE_BUDGET_S):
            _GEMLITE["off"] = True
            print(f"gemlite: autotuning took {_GEMLITE['spent']:.0f} s; not timed further in this run", file=sys.stderr)
        del lins
        return t
    except Exception as exc:  # noqa: BLE001 - a peer failing on one shape is reported, not fatal
        print(f"gemlite failed at {k}x{n} M={m}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


GEMLITE_BUDGET_S = 240.0


def read_bandwidth() -> dict[str, float]:
    """Device-to-device copy (read + write counted) and the w4pack probes over a 0.5 GB layer."""
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t_end = time.time() + 0.5  # let clocks ramp up before the first measurement
    while time.time() < t_end:
        b.copy_(a)
    torch.cuda.synchronize()
    t = time_graph(lambda i: b.copy_(a), 1, replays=20)
    copy_gbs = 2 * a.numel() / (t * 1e-6) / 1e9
    del a, b
    packed = random_packed(16384, 65536)
    lin = w4cuda.CudaPackedLinear(packed, "cuda", dtypes=("float16",))
    x = torch.randn(1, 16384, device="cuda", dtype=torch.float16)
    y = torch.empty(1, 65536, device="cuda", dtype=torch.float16)
    qbytes = lin.qweight.numel() * 4
    res = {"copy_rw_gbs": copy_gbs}
    for probe in ("probe_load", "probe_dequant", "probe_bulk", "auto", "stream", "ring", "bulk"):
        t = time_graph(lambda i: lin.forward(x, out=y, kernel=probe), 1, replays=10)
        res[f"{probe}_gbs"] = qbytes / (t * 1e-6) / 1e9
        res[f"{probe}_us"] = t
    return res


SMOKE_SWITCHES = {"tile": ("W4P_CUDA_BULK_GRANULE", "tile"), "quads": ("W4P_CUDA_BULK_QS", "4"),
                  "single": ("W4P_CUDA_BULK_QS", "1"), "rows256": ("W4P_CUDA_WS_RS", "2"),
                  "rows192": ("W4P_CUDA_WS_ROWS", "192"), "tok256": ("W4P_CUDA_WS_TOK", "256")}


def smoke() -> int:
    """A few small calls of every kernel path against the float64 reference (for compute-sanitizer runs)."""
    from w4pack.canonical import CanonicalLayer, default_g_idx
    from w4pack.layout import pack

    rng = np.random.default_rng(0)
    worst = 0.0
    sm90a = torch.cuda.get_device_capability() == (9, 0)

    def off(y, ref: np.ndarray, what: str) -> bool:
        """Whether y misses the float64 reference (reported); the worst error so far is kept."""
        nonlocal worst
        err = float(np.linalg.norm(y.double().cpu().numpy() - ref) / np.linalg.norm(ref))
        worst = max(worst, err)
        if not err <= 1e-3:
            print(f"smoke FAILED: {what}: rel err {err:.2e}")
        return not err <= 1e-3

    # the last layer for the wgmma_ws, wgmma_ss and bulk kernels: K = 2048 makes every token tile refill its stages (K = 576
    # refills only the 128-token tile's), which is what racecheck has to see
    for bits, zm, gs, k in ((4, "int", 64, 576), (8, "float", 32, 576), (4, "none", -1, 576), (4, "int", 128, 2048)):
        if k != 576 and not sm90a:
            continue
        n = 196
        g = 1 if gs == -1 else -(-k // gs)
        zeros = None
        if zm == "int":
            zeros = rng.integers(0, (1 << bits) + 1, size=(n, g)).astype(np.int32)
        elif zm == "float":
            zeros = rng.uniform(-0.1, 0.1, size=(n, g)).astype(np.float16)
        g_idx = default_g_idx(k, gs)
        if gs != -1:
            g_idx = g_idx[rng.permutation(k)].astype(np.int32)
        layer = CanonicalLayer(codes=rng.integers(0, 1 << bits, size=(n, k), dtype=np.uint8),
                               scales=rng.uniform(0.005, 0.02, size=(n, g)).astype(np.float16), bits=bits,
                               group_size=gs, zero_mode=zm, zeros=zeros, g_idx=g_idx,
                               bias=rng.standard_normal(n).astype(np.float16)).validate()
        lin = w4cuda.CudaPackedLinear(pack(layer), "cuda")
        w64 = layer.dequantize(np.float64)
        if k != 576:
            calls = ((12, "wgmma_ws", 1), (20, "wgmma_ws", 1), (40, "wgmma_ws", 1), (150, "wgmma_ws", 1),
                     (300, "wgmma_ws:tok256", 1), (129, "wgmma_ws", 1),
                     (1, "bulk", 0), (4, "bulk", 0), (1, "bulk:tile", 0), (6, "bulk:tile", 2), (1, "bulk:quads", 0),
                     (4, "bulk:quads", 0), (8, "bulk:single", 3), (12, "wgmma_ss", 1), (100, "wgmma_ss", 1),
                     (150, "wgmma_ss", 2), (300, "wgmma_ss", 1), (1, "gemv", 0), (5, "gemv", 0), (8, "gemv", 0))
            # bulk: units of one stripe, each block owning whole stripes; ":tile": stream-K over single tiles
            # (W4P_CUDA_BULK_GRANULE; stripes shared by several blocks); ":quads": four-stripe units (the planner's
            # unit size), shared quads; ":single": one-stripe units forced (W4P_CUDA_BULK_QS)
        else:
            calls = ((1, "stream", 0), (5, "stream", 3), (24, "stream", 0), (1, "ring", 0), (7, "ring", 3),
                     (3, "ring", 1), (40, "tiled", 0), (130, "tiled", 2), (70, "dense", 0))
            if sm90a and bits == 4:
                calls += ((1, "wgmma", 0), (150, "wgmma", 0), (70, "wgmma", 3), (20, "wgmma", 2), (1, "wgmma_ws", 0),
                          (150, "wgmma_ws", 0), (70, "wgmma_ws", 3), (12, "wgmma_ws", 0), (20, "wgmma_ws", 3),
                          (20, "wgmma_ws", 9), (12, "auto", 0), (150, "wgmma_ws:rows256", 0),
                          (70, "wgmma_ws:rows256", 3), (130, "wgmma_ws:rows256", 9), (150, "wgmma_ws:rows192", 0),
                          (70, "wgmma_ws:rows192", 3), (130, "wgmma_ws:rows192", 9), (300, "wgmma_ws:tok256", 0),
                          (257, "wgmma_ws:tok256", 3), (200, "wgmma_ws:tok256", 9))
                # splits summed in a cluster (2-8) and through the workspace (9); ":rows256" / ":rows192": wgmma_ws
                # in 256-row blocks (W4P_CUDA_WS_RS) or 192-row blocks (W4P_CUDA_WS_ROWS); ":tok256": the 256-token
                # tile (W4P_CUDA_WS_TOK). M = 150 and 300 (and 129 and 300 with K = 2048): a last token tile copied
                # as a smaller box
                if gs % 64 == 0 or gs == -1:
                    calls += ((1, "wgmma_ss", 0), (150, "wgmma_ss", 0), (70, "wgmma_ss", 3), (70, "wgmma_ss", 9))
            if torch.cuda.get_device_capability() >= (9, 0):
                calls += ((1, "bulk", 0), (13, "bulk", 2), (6, "bulk", 3))
            if bits == 4 and torch.cuda.get_device_capability() >= (8, 0):
                calls += ((1, "gemv", 0), (3, "gemv", 0))  # (13 stripes, 13 blocks: one step of 9 tiles each)
        for m, kernel, splits in calls:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            if ":" in kernel:
                var, val = SMOKE_SWITCHES[kernel.split(":")[1]]
                with planner_switches({var: val}):  # a fresh layer: a layer caches its plans
                    y = w4cuda.CudaPackedLinear(pack(layer), "cuda").forward(x, kernel=kernel.split(":")[0],
                                                                             splits=splits)
            else:
                y = lin.forward(x, kernel=kernel, splits=splits)
            ref = x.double().cpu().numpy() @ w64.T + layer.bias.astype(np.float64)
            if off(y, ref, f"bits={bits} zero={zm} gs={gs} M={m} {kernel}"):
                return 1
        if bits == 4 and torch.cuda.get_device_capability() >= (8, 0):
            # the gemv kernel's row prologues (w4p_cuda_gemm_row): the norm's block reduction shares memory
            res = torch.randn(n, device="cuda", dtype=torch.float16)
            nw = (torch.rand(k, device="cuda") + 0.5).half()
            for prologue in ("rmsnorm", "swiglu"):
                x = torch.randn(1, 2 * k if prologue == "swiglu" else k, device="cuda", dtype=torch.float16)
                if prologue == "rmsnorm":
                    x32 = x.float()
                    xf = nw * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).half()
                    y = lin.forward_row(x, "rmsnorm", nw, 1e-5, residual=res)
                else:
                    xf = F.silu(x[:, :k]) * x[:, k:]
                    y = lin.forward_row(x, "swiglu", residual=res)
                ref = xf.double().cpu().numpy() @ w64.T + layer.bias.astype(np.float64) + res.double().cpu().numpy()
                if off(y, ref, f"zero={zm} gs={gs} gemv {prologue}"):
                    return 1
    if torch.cuda.get_device_capability() >= (8, 0):
        # the gemv kernel with several stripes per block (its stripe sums' two buffers reused), 1 and 8 tokens
        n, k = 16 * 700, 256
        layer = CanonicalLayer(codes=rng.integers(0, 16, size=(n, k), dtype=np.uint8),
                               scales=rng.uniform(0.005, 0.02, size=(n, 2)).astype(np.float16), bits=4,
                               group_size=128, zero_mode="none", g_idx=default_g_idx(k, 128)).validate()
        lin = w4cuda.CudaPackedLinear(pack(layer), "cuda")
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            y = lin.forward(x, kernel="gemv")
            if off(y, x.double().cpu().numpy() @ layer.dequantize(np.float64).T, f"gemv M={m} N={n}"):
                return 1
    torch.cuda.synchronize()
    print(f"smoke ok (worst relative error {worst:.2e})")
    return 0


def print_tables(head: str, tables) -> None:
    """The run's markdown tables (one per shape) and the geometric means; tables: [(K, N, rows)]."""
    print()
    print(head)
    print(f"Time per call (us, L2-cold, graph replay median); speedup over the faster cuBLAS fp16 layout; "
          f"w4pack GB/s and % of the {REF['read_gbs']:.0f} GB/s read stream; floor: the larger of the bytes at that "
          f"stream and the FLOPs at {REF['flops'] / 1e12:.0f} TFLOP/s (`--floors`), references {REF['source']}")
    pdl = os.environ.get("W4P_CUDA_PDL", "1")
    print("w4pack's sm_90 kernels " + ("run with programmatic dependent launch: a call's set-up overlaps the "
          "previous call's tail in these back-to-back graphs (W4P_CUDA_PDL=0 turns it off)" if pdl != "0" else
          "launched plainly (W4P_CUDA_PDL=0)"))
    geo: dict[int, list[float]] = {}
    for k, n, rows in tables:
        print(f"\nK={k} N={n}")
        print("| M | w4pack | cuBLAS fp16 | tinygemm bf16 | gemlite fp16 | w4pack x | tinygemm x | gemlite x | "
              "w4pack GB/s | % read BW | floor us | plan |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            best = min(r["cublas_mm_us"], r["cublas_linear_us"])
            tg = r["tinygemm_us"]
            gl = r["gemlite_us"]
            sp = best / r["w4pack_us"]
            geo.setdefault(r["M"], []).append(sp)
            floor = max(floors_us(k, n, r["M"], r.get("zero_mode", "none")))
            print(f"| {r['M']} | {r['w4pack_us']:.1f} | {best:.1f} | {'-' if tg is None else f'{tg:.1f}'} | "
                  f"{'-' if gl is None else f'{gl:.1f}'} | "
                  f"{sp:.2f}x | {'-' if tg is None else f'{best / tg:.2f}x'} | {'-' if gl is None else f'{best / gl:.2f}x'} | "
                  f"{r['w4pack_gbs']:.0f} | "
                  f"{100 * r['w4pack_gbs'] / REF['read_gbs']:.0f}% | {floor:.1f} | "
                  f"{r['plan']['kernel']}/{r['plan']['splits']} |")
    print("\nGeometric-mean speedup of w4pack over cuBLAS fp16 across shapes")
    for m, v in geo.items():
        print(f"  M={m}: {math.exp(sum(map(math.log, v)) / len(v)):.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M in 1, 16, 64, 256 only")
    ap.add_argument("--sweep", action="store_true", help="also time forced kernels / split counts")
    ap.add_argument("--variants", action="store_true",
                    help="with --sweep: also the wgmma kernel's tuning variants (W4P_CUDA_WGMMA_KP / _AS)")
    ap.add_argument("--json", type=Path, default=None, help="append one JSON line per measurement")
    ap.add_argument("--plot", type=Path, default=None,
                    help="write the speedup-over-cuBLAS plot (PNG) from this run's records (tools/plot_bench.py)")
    ap.add_argument("--shapes", default="", help="comma list of KxN (default: the six Llama shapes)")
    ap.add_argument("--ms", default="", help="comma list of M (e.g. 1,4,16: the decode regime only)")
    ap.add_argument("--also", default="", help="comma list of kernels timed forced beside auto at every point "
                    "(e.g. gemv,bulk: an A/B of auto's choice); a point a kernel does not take is skipped with the "
                    "reason")
    ap.add_argument("--zeros", choices=("none", "int"), default="none",
                    help="w4pack's layers with integer zero points (AWQ, asymmetric GPTQ) instead of symmetric ones")
    ap.add_argument("--no-gemlite", action="store_true", help="leave gemlite out (its autotuning takes minutes)")
    ap.add_argument("--gemlite-budget", type=float, default=GEMLITE_BUDGET_S,
                    help="seconds of gemlite autotuning after which it is left out of the rest of the run")
    ap.add_argument("--smoke", action="store_true", help="only run a few small checked calls of every kernel")
    ap.add_argument("--floors", action="store_true", help="only print the bytes and FLOPs floors per shape (no GPU)")
    ap.add_argument("--read-bw", type=float, default=None, metavar="GBS",
                    help="the read stream (GB/s) for the floors and %% read BW (default: the H200's 4494 on an H200 "
                    "and with --floors, else measured on this GPU: a plain read of 1 GiB)")
    ap.add_argument("--tflops", type=float, default=None,
                    help="the fp16 GEMM rate (TFLOP/s) for the FLOPs floor (default: the H200's 661 on an H200 and "
                    "with --floors, else cuBLAS's 8192^3 measured on this GPU)")
    ap.add_argument("--read-floor", action="store_true",
                    help="only time a plain Triton read of each shape's M = 1 bytes against w4pack at M = 1")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s] or SHAPES
    ms = [int(v) for v in args.ms.split(",") if v] or ([1, 16, 64, 256] if args.quick else MS)
    also = [v for v in args.also.split(",") if v]
    given = "given (--read-bw / --tflops)"
    if args.read_bw is not None or args.tflops is not None:
        set_reference(args.read_bw or READ_BW_REF, (args.tflops or FLOPS_REF / 1e12) * 1e12, given)
    if args.floors:
        print_floors(shapes, ms, args.zeros)
        return 0
    if not w4cuda.available():
        print(f"w4pack CUDA unavailable: {w4cuda.unavailable_reason()}", file=sys.stderr)
        return 2
    if args.smoke:
        return smoke()
    if args.read_floor:
        print_read_floors(shapes)
        return 0
    if args.no_gemlite:
        _GEMLITE["off"] = True
    _GEMLITE["budget"] = args.gemlite_budget
    props = torch.cuda.get_device_properties(0)
    head = (f"GPU {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, layout {LAYOUT_NAME} v{LAYOUT_VERSION}"
            + (", integer zero points" if args.zeros == "int" else ""))
    print(head, flush=True)
    if args.plot and not args.json:
        args.json = args.plot.with_suffix(".jsonl")
    jf = args.json.open("a") if args.json else None

    def emit(rec: dict) -> None:
        if jf:
            jf.write(json.dumps(rec) + "\n")
            jf.flush()

    emit({"kind": "run", "gpu": props.name, "date": time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
          "torch": torch.__version__, "command": "python tools/bench_gpu.py " + " ".join(sys.argv[1:]),
          "reference": dict(REF)})
    bw = read_bandwidth()
    emit({"kind": "bandwidth", **bw})
    print("bandwidth: torch uint8 copy_ (read+write, not a ceiling) {copy_rw_gbs:.0f} GB/s; w4pack layout load-only {probe_load_gbs:.0f} GB/s, "
          "load+dequant {probe_dequant_gbs:.0f} GB/s, bulk copies only {probe_bulk_gbs:.0f} GB/s, full GEMV (M=1) auto {auto_gbs:.0f} / stream {stream_gbs:.0f} / "
          "ring {ring_gbs:.0f} / bulk {bulk_gbs:.0f} GB/s of qweight".format(**bw),
          flush=True)
    if "H200" not in props.name and (args.read_bw is None or args.tflops is None):
        read_gbs, flops = measure_reference(bw)  # (another GPU: the H200's references would misstate its floors)
        set_reference(args.read_bw or read_gbs, args.tflops * 1e12 if args.tflops else flops,
                      "measured on this GPU (the load-only probes above, cuBLAS fp16 8192^3)"
                      if args.read_bw is None and args.tflops is None else "measured and given")
        print(f"references for the floors: read {REF['read_gbs']:.0f} GB/s, fp16 {REF['flops'] / 1e12:.0f} TFLOP/s "
              f"({REF['source']})", flush=True)
        emit({"kind": "reference", **REF})

    try:
        import marlin  # noqa: F401
        print("marlin importable but not wired in this script", file=sys.stderr)
    except ImportError:
        pass

    tables = []
    for k, n in shapes:
        packed = random_packed(k, n, zero_mode=args.zeros)
        lins = w4_copies(packed, n_copies(k * n / 2 * 1.03))
        rows = []
        for m in ms:
            t_w4 = measure_w4(lins, k, n, m)
            plan = lins[0].plan(m)
            t_mm, t_lin = measure_cublas(k, n, m)
            t_tg = measure_tinygemm(k, n, m)
            t_gl = measure_gemlite(k, n, m)
            best = min(t_mm, t_lin)
            gbs = w4_bytes(k, n, m, args.zeros) / (t_w4 * 1e-6) / 1e9
            rec = {"kind": "gemm", "K": k, "N": n, "M": m, "zero_mode": args.zeros, "w4pack_us": t_w4,
                   "cublas_mm_us": t_mm, "cublas_linear_us": t_lin, "tinygemm_us": t_tg, "gemlite_us": t_gl,
                   "w4pack_gbs": gbs, "plan": plan}
            sweep = {}
            for kern in also:  # forced beside auto (--also), where the kernel takes this point
                try:
                    sweep[kern] = measure_w4(lins, k, n, m, kern)
                except Exception as exc:  # noqa: BLE001 - a kernel that does not take this M or K
                    print(f"{kern} at {k}x{n} M={m}: {exc}", file=sys.stderr)
            if args.sweep:
                if m == 1:  # the gemv kernel forced, also where "auto" takes bulk (its rule against bulk's)
                    sweep["gemv"] = measure_w4(lins, k, n, m, "gemv")
                if m <= 16:  # the block-split stream kernel against the ring and bulk kernels
                    sweep["stream"] = measure_w4(lins, k, n, m, "stream")
                    sweep["probe_bulk"] = measure_w4(lins, k, n, m, "probe_bulk")
                    for ns in (0, 3, 4, 6):
                        try:
                            sweep[f"bulk_ns{ns}"] = measure_w4(lins, k, n, m, "bulk", ns)
                        except Exception as exc:  # noqa: BLE001 - a stage count that does not fit
                            print(f"bulk ns={ns}: {exc}", file=sys.stderr)
                if torch.cuda.get_device_capability() == (9, 0):  # the warp-specialized wgmma kernel, every M
                    try:
                        sweep["wgmma_ws"] = measure_w4(lins, k, n, m, "wgmma_ws")
                        for sp in (1, 2, 4):  # forced split-K counts against the planner's choice
                            sweep[f"ws_s{sp}"] = measure_w4(lins, k, n, m, "wgmma_ws", sp)
                        if m > 64:  # the 128-token tile's block heights, unsplit (W4P_CUDA_WS_ROWS)
                            for height in ("128", "192", "256"):
                                sweep[f"ws_rows{height}"] = measure_w4_env(lins, k, n, m, "wgmma_ws", 1,
                                                                           {"W4P_CUDA_WS_ROWS": height})
                    except Exception as exc:  # noqa: BLE001 - a driver without the TMA encoder
                        print(f"wgmma_ws: {exc}", file=sys.stderr)
                if m <= 8:
                    sweep["ring"] = measure_w4(lins, k, n, m, "ring")
                elif m <= 64:
                    for sp in (1, 2, 4, 8, 16, 32):
                        sweep[f"stream_s{sp}"] = measure_w4(lins, k, n, m, "stream", sp)
                if m >= 16:
                    if torch.cuda.get_device_capability() == (9, 0):
                        sweep["wgmma"] = measure_w4(lins, k, n, m, "wgmma")
                        # tuning switches read by the native planner at each call (--variants)
                        for name, var, value in (("wgmma_kp2", "W4P_CUDA_WGMMA_KP", "2"),
                                                 ("wgmma_as", "W4P_CUDA_WGMMA_AS", "1")):
                            if not args.variants or (name == "wgmma_as" and m > 64):
                                continue
                            sweep[name] = measure_w4_env(lins, k, n, m, "wgmma", 0, {var: value})
                    sweep["tiled"] = measure_w4(lins, k, n, m, "tiled")
                    sweep["dense"] = measure_w4(lins, k, n, m, "dense")
                    if m <= 128:
                        sweep["stream"] = measure_w4(lins, k, n, m, "stream")
            if sweep:
                rec["sweep"] = sweep
            emit(rec)
            rows.append(rec)
            extra = " ".join(f"{a}={b:.1f}" for a, b in sweep.items())
            print(f"  {k}x{n} M={m}: w4pack {t_w4:.1f} us ({plan['kernel']}/{plan['splits']}) cublas {best:.1f} "
                  f"tinygemm {t_tg if t_tg is None else round(t_tg, 1)} gemlite {t_gl if t_gl is None else round(t_gl, 1)} {extra}", flush=True)
        tables.append((k, n, rows))
        del lins
        torch.cuda.empty_cache()

    print_tables(head, tables)
    if args.plot:
        if jf:
            jf.close()
        import plot_bench
        run_head, recs = plot_bench.read_records(args.json)
        try:
            plot_bench.plot(run_head, recs, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install 'w4pack[bench]'); the records are in "
                  f"{args.json}: python tools/plot_bench.py {args.json} --png {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
