#!/usr/bin/env python3
"""CPU benchmark of the w4pack W4A16 GEMM against torch's int4 kernel, dense torch matmul and the
machine's read bandwidth, in one run, on cold weights.

Cold weights: every timed call uses the next of several copies of the layer, rotating over at least
--cold-mib (default 512 MiB, 16x the 32 MiB L3), so M = 1 numbers are DRAM numbers. Each sample is
one pass over the copies; the reported value is the median of the samples. Shared machines: each
sample records the CPU time other processes used meanwhile (/proc/stat minus our own); samples with
more than --max-foreign cores of foreign load are re-taken for up to --budget seconds, and a row that
never got 3 clean samples is marked '*' (median of all samples, treat with care).

Shapes are K x N (in_features x out_features), e.g. 4096x11008 = Llama-2-7B gate/up projection.

    python tools/bench_cpu.py                                  # 4096x11008, M = 1, 16, 64, 1 thread
    python tools/bench_cpu.py --shapes 4096x4096,4096x11008,11008x4096 --ms 1,4,16,64 --threads 1,2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from w4pack.canonical import CanonicalLayer  # noqa: E402
from w4pack.layout import pack  # noqa: E402
from w4pack.native.cpu import CpuPackedLinear, ffi, isa_info, lib  # noqa: E402

GROUP = 128


# ---- foreign-load accounting -------------------------------------------------------------------
def _busy_jiffies() -> int:
    with open("/proc/stat") as fh:
        vals = [int(v) for v in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals[:8]) - idle


def _own_jiffies() -> int:
    with open("/proc/self/stat") as fh:
        parts = fh.read().rsplit(")", 1)[1].split()
    return int(parts[11]) + int(parts[12])  # utime + stime (all threads)


HZ = os.sysconf("SC_CLK_TCK")


def sample(fn: Callable[[], None]) -> tuple[float, float]:
    """(seconds, foreign load in cores) for one call of fn."""
    b0, o0 = _busy_jiffies(), _own_jiffies()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    foreign = max(0, (_busy_jiffies() - b0) - (_own_jiffies() - o0)) / HZ
    return dt, foreign / dt if dt > 0 else 0.0


def measure(run_pass: Callable[[], None], calls: int, samples: int, max_foreign: float,
            budget: float) -> dict[str, Any]:
    """Median seconds per call over clean samples (each sample = one pass of `calls` calls)."""
    run_pass()  # warm-up: page faults, thread pool, caches of the activations
    clean: list[float] = []
    every: list[float] = []
    loads: list[float] = []
    clean_loads: list[float] = []
    t_end = time.perf_counter() + budget
    while len(clean) < samples and (time.perf_counter() < t_end or len(every) < samples):
        dt, load = sample(run_pass)
        every.append(dt / calls)
        loads.append(load)
        if load <= max_foreign:
            clean.append(dt / calls)
            clean_loads.append(load)
    noisy = len(clean) < 3
    vals, val_loads = (every, loads) if noisy else (clean, clean_loads)
    # (the foreign load of the samples the median is taken over)
    return {"seconds": float(np.median(vals)), "clean": len(clean), "samples": len(every),
            "foreign": float(np.median(val_loads)), "noisy": noisy}


# ---- the contenders ----------------------------------------------------------------------------
def make_layer(n: int, k: int, seed: int = 0) -> CanonicalLayer:
    rng = np.random.default_rng(seed)
    g = -(-k // GROUP)
    return CanonicalLayer(codes=rng.integers(0, 16, (n, k), dtype=np.uint8),
                          scales=(rng.random((n, g)) * 0.02 + 0.001).astype(np.float16), bits=4,
                          group_size=GROUP, zero_mode="int", zeros=rng.integers(0, 16, (n, g)).astype(np.int32))


def torch_bf16(x: np.ndarray) -> Any:
    """The activations as a torch bfloat16 tensor (how bf16 reaches the kernels), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)


def copies_for(nbytes: int, cold_bytes: int) -> int:
    return max(2, -(-cold_bytes // max(nbytes, 1)))


def bench_w4pack(layer: CanonicalLayer, ms: list[int], threads: int, cold: int, args: argparse.Namespace) -> list[dict]:
    packed = pack(layer)
    t0 = time.perf_counter()
    first = CpuPackedLinear(packed, threads=threads)
    repack_s = time.perf_counter() - t0
    lins = [first] + [CpuPackedLinear(packed, threads=threads) for _ in range(copies_for(first.nbytes, cold) - 1)]
    rows = []
    k = layer.in_features
    # on AMX, exact takes its activations as bf16 pieces (fp16: two, bf16: one, fp32: three) and fast runs int8
    # tiles; beside each, the same call on the AVX-512 VNNI kernel (what runs where AMX is missing)
    amx = "amx" in isa_info()["available"]
    variants = [("fast", "float16", None), ("exact", "float16", None)]
    if amx:
        variants += [("fast", "float16", "avx512vnni"), ("exact", "float16", "avx512vnni"),
                     ("exact", "bfloat16", None), ("exact", "float32", None), ("exact", "float32", "avx512vnni")]
    for m in ms:
        x16 = np.random.default_rng(m).standard_normal((m, k)).astype(np.float16)
        for prec, dt, isa in variants:
            x = x16.astype(np.float32) if dt == "float32" else (
                torch_bf16(x16) if dt == "bfloat16" else x16)
            if x is None:
                continue

            def run_pass() -> None:
                for lin in lins:
                    lin.forward(x, precision=prec, isa=isa)
            r = measure(run_pass, len(lins), args.samples, args.max_foreign, args.budget)
            act = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dt]
            # the AMX kernels' row thresholds (w4p_amx_min_rows, w4p_cpu_internal.h)
            tiles_from = 16 if prec == "fast" or dt == "float32" else 8
            path = f", {isa} kernel" if isa else (", amx" if amx and m >= tiles_from else "")
            rows.append(dict(r, impl=f"w4pack {prec}{path} ({act} act.)", m=m, bytes=first.nbytes,
                             copies=len(lins), baseline=prec == "fast" and isa is None and dt == "float16"))
    del lins
    rows.append({"impl": "w4pack repack at load", "m": None, "seconds": repack_s, "bytes": first.nbytes,
                 "note": "one-off"})
    return rows


def bench_torch(layer: CanonicalLayer, ms: list[int], threads: int, cold: int, args: argparse.Namespace) -> list[dict]:
    try:
        import torch
    except ImportError:
        return [{"impl": "torch (not installed)", "m": None, "seconds": float("nan"), "bytes": 0}]

    torch.set_num_threads(threads)
    n, k = layer.codes.shape
    rows = []
    # torch int4 (tinygemm CPU): w = (q - 8) * scale + zero, zero = (8 - z) * scale; bf16 activations
    try:
        s = layer.scales.astype(np.float32)
        z = layer.zeros.astype(np.float32)
        sz = np.stack([s.T, ((8.0 - z) * s).T], axis=-1)  # [K/G, N, 2]
        scale_zero = torch.from_numpy(np.ascontiguousarray(sz)).to(torch.bfloat16)
        qw = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(layer.codes.astype(np.int32)), 1)
        nbytes = qw.numel() * qw.element_size() + scale_zero.numel() * 2
        mats = [(qw.clone(), scale_zero.clone()) for _ in range(copies_for(nbytes, cold))]
        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16)

            def run_pass() -> None:
                for w, sz_ in mats:
                    torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, GROUP, sz_)
            r = measure(run_pass, len(mats), args.samples, args.max_foreign, args.budget)
            rows.append(dict(r, impl="torch int4 _weight_int4pack_mm_for_cpu (bf16 act.)", m=m, bytes=nbytes,
                             copies=len(mats)))
        del mats
    except (RuntimeError, AttributeError) as exc:
        rows.append({"impl": "torch int4", "m": None, "seconds": float("nan"), "bytes": 0, "note": str(exc)[:80]})
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        w = torch.from_numpy(layer.dequantize(np.float32)).to(dt)
        nbytes = w.numel() * w.element_size()
        mats = [w.clone() for _ in range(copies_for(nbytes, cold))]
        del w
        for m in ms:
            x = torch.randn(m, k, dtype=dt)

            def run_pass() -> None:
                for w_ in mats:
                    torch.matmul(x, w_.t())
            r = measure(run_pass, len(mats), args.samples, args.max_foreign, args.budget)
            rows.append(dict(r, impl=f"torch {name} matmul (dense)", m=m, bytes=nbytes, copies=len(mats)))
        del mats
    return rows


def bench_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    buf = np.ones(args.bw_mib << 20, dtype=np.uint8)
    ptr = ffi.from_buffer(buf)

    def run_pass() -> None:
        lib.w4p_cpu_read_stream(ptr, buf.nbytes)
    r = measure(run_pass, 1, max(args.samples, 5), args.max_foreign, args.budget)
    r["gbps"] = buf.nbytes / r["seconds"] / 1e9
    return r


def shapes_arg(text: str) -> list[tuple[str, tuple[int, int]]]:
    """--shapes "4096x11008,11008x4096": each as written and as (K, N)."""
    out = []
    for shape in text.split(","):
        parts = shape.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{shape!r} is not KxN (positive integers, e.g. 4096x11008)")
        out.append((shape, (int(parts[0]), int(parts[1]))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x11008", type=shapes_arg, help="comma-separated KxN")
    ap.add_argument("--ms", default="1,16,64", help="activation rows")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--cold-mib", type=int, default=512, help="bytes of weight copies to rotate over")
    ap.add_argument("--bw-mib", type=int, default=1024, help="buffer of the read-bandwidth stream")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--budget", type=float, default=8.0, help="seconds per row to find clean samples")
    ap.add_argument("--max-foreign", type=float, default=0.25, help="foreign load (cores) a clean sample allows")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write every row to this JSON file")
    args = ap.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    cold = args.cold_mib << 20
    ms = [int(v) for v in args.ms.split(",")]
    info = isa_info()
    print(f"w4pack CPU bench: isa {info['selected']} (available {', '.join(info['available'])}), "
          f"{os.cpu_count()} CPUs, cold rotation over >= {args.cold_mib} MiB", flush=True)
    bw = bench_bandwidth(args)
    print(f"read bandwidth (1 thread, {args.bw_mib} MiB stream): {bw['gbps']:.1f} GB/s"
          f"{' *' if bw['noisy'] else ''} (foreign load {bw['foreign']:.2f} cores)\n", flush=True)
    results: list[dict[str, Any]] = []
    for shape, (k, n) in args.shapes:
        layer = make_layer(n, k)
        for threads in (int(t) for t in args.threads.split(",")):
            rows = bench_w4pack(layer, ms, threads, cold, args)
            if not args.no_torch:
                rows += bench_torch(layer, ms, threads, cold, args)
            for r in rows:
                r.update(shape=shape, threads=threads)
            results += rows
            print_table(shape, threads, rows, ms, bw["gbps"], k, n)
    if args.json:
        args.json.write_text(json.dumps({"bandwidth": bw, "rows": results}, indent=2))


def print_table(shape: str, threads: int, rows: list[dict], ms: list[int], bw: float, k: int, n: int) -> None:
    print(f"== K x N = {shape}, {threads} thread(s); int4 G{GROUP} weight bytes / time; "
          f"ratio = this row's time / w4pack fast ==")
    hdr = f"{'implementation':<52} {'M':>3} {'median us':>11} {'GB/s':>7} {'GOP/s':>7} {'ratio':>7} {'foreign':>8}"
    print(hdr)
    print("-" * len(hdr))
    fast = {r["m"]: r["seconds"] for r in rows if r.get("baseline")}  # the default path (AMX where present)
    w4_bytes = next(r["bytes"] for r in rows if r.get("baseline"))
    for m in ms:
        limit = w4_bytes / (bw * 1e9)
        print(f"{'bandwidth limit (w4pack bytes / read stream)':<52} {m:>3} {limit * 1e6:>11.0f} {bw:>7.1f} "
              f"{2 * m * k * n / limit / 1e9:>7.0f} {limit / fast[m]:>7.2f} {'':>8}")
        for r in rows:
            if r["m"] != m:
                continue
            t = r["seconds"]
            mark = "*" if r.get("noisy") else " "
            print(f"{r['impl']:<52} {m:>3} {t * 1e6:>10.0f}{mark} {r['bytes'] / t / 1e9:>7.1f} "
                  f"{2 * m * k * n / t / 1e9:>7.0f} {t / fast[m]:>7.2f} {r.get('foreign', 0):>8.2f}")
    for r in rows:
        if r["m"] is None:
            print(f"{r['impl']:<52} {'':>3} {r['seconds'] * 1e6:>11.0f} {r['bytes'] / r['seconds'] / 1e9:>7.1f}"
                  f"   {r.get('note', '')}")
    print(flush=True)


if __name__ == "__main__":
    main()
