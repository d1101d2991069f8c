#!/usr/bin/env python3
"""How fast this GPU reads a buffer of a layer's size, and how the order of the requests changes that.

Builds tools/read_order/read_order.cu with nvcc for this GPU once (under build/read_order/), then for each layer
(K×N as in tools/bench_gpu.py; the buffer is the layer's int4 codes, K·N/2 bytes) times, with graph replays over
copies rotated past L2 as the benchmark does:

* the plain read: consecutive threads on consecutive 16 bytes, the grid striding over the buffer (best of 2, 4
  or 8 loads in flight and 2, 4 or 8 blocks of 256 threads per SM);
* the layout's 512-byte tiles, one 16-byte load per lane, in four orders (best of 2, 4 or 8 tiles in flight and
  2-8 blocks of 8 warps per SM): units of consecutive tiles dealt to the warps in turn, single tiles dealt in
  turn, whole 16-row stripes per block (the gemv kernel's order), one contiguous range per warp (the stream-K
  order of the bulk and ring kernels);
* w4pack's own M = 1 call ("auto") and, on sm_90, the bulk kernel's copies alone (`probe_bulk`).

It prints medians in µs and each one's ratio to the plain read. docs/journal/2026-cuda.md section 7 (seventeenth session)
quotes these measurements. On the GPU machine:

    python tools/read_order.py [--shapes 8192x28672,4096x4096] [--json out/read_order.jsonl]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tools" / "read_order" / "read_order.cu"
SHAPES = "4096x4096,4096x11008,11008x4096,4096x12288,8192x28672,28672x8192"
ORDERS = ("units dealt in turn", "tiles dealt in turn", "whole stripes per block", "one range per warp")


def nvcc() -> str:
    found = os.environ.get("NVCC") or shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))),
                                                                   None)
    if not found:
        raise SystemExit("read_order: nvcc not found (set NVCC): it builds the probe kernels")
    return found


def build(cc: str) -> Path:
    """The probes for compute capability cc ("90"), rebuilt when the source is newer."""
    out = ROOT / "build" / "read_order" / f"read_order_sm{cc}.so"
    if out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"building {out.name} ...", file=sys.stderr, flush=True)
    subprocess.run([nvcc(), "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
                    f"-gencode=arch=compute_{cc},code=sm_{cc}", str(SOURCE), "-o", str(out)], check=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma list of KxN (default: the six Llama shapes)")
    ap.add_argument("--json", type=Path, default=None, help="append one JSON line per shape")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("read_order: torch is not installed (pip install torch)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("read_order: no CUDA device", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_gpu as bench  # noqa: E402  (the benchmark's weight copies and timing)
    major, minor = torch.cuda.get_device_capability()
    lib = ctypes.CDLL(str(build(f"{major}{minor}")))
    lib.ro_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(4, dtype=torch.int32, device="cuda")

    def best(bufs, variants, n, kt, per_sm, threads):
        res = []
        for v in variants:
            for bps in per_sm:
                def call(i, v=v, bps=bps):
                    rc = lib.ro_launch(v, bufs[i].data_ptr(), n, kt, out.data_ptr(), sms * bps, threads,
                                       torch.cuda.current_stream().cuda_stream)
                    if rc != 0:
                        raise RuntimeError(f"ro_launch({v}) failed: cudaError {rc}")
                res.append((bench.time_graph(call, len(bufs)), v, bps))
        return min(res)

    print("| K×N | MB | plain read µs (GB/s) | " + " | ".join(ORDERS) + " | w4pack M = 1 | bulk copies only |")
    print("|---|---|---|" + "---|" * (len(ORDERS) + 2))
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.lower().split("x"))
        kt, ns = -(-k // 64), -(-n // 16)
        tiles, nbytes = kt * ns, kt * ns * 512
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_() for _ in range(bench.n_copies(nbytes))]
        plain = best(bufs, (0, 1, 2), nbytes // 16, 0, (2, 4, 8), 256)
        orders = [best(bufs, (10 + 4 * o, 11 + 4 * o, 12 + 4 * o), tiles, kt, (2, 3, 4, 6, 8), 256)
                  for o in range(len(ORDERS))]
        del bufs
        torch.cuda.empty_cache()
        lins = bench.w4_copies(bench.random_packed(k, n), bench.n_copies(nbytes * 1.03))
        w4 = bench.measure_w4(lins, k, n, 1)
        probe = bench.measure_w4(lins, k, n, 1, "probe_bulk") if (major, minor) >= (9, 0) else None
        del lins
        torch.cuda.empty_cache()
        t0 = plain[0]
        cells = [f"{t:.2f} ({t / t0:.2f}x)" for t, _, _ in orders]
        cells += [f"{w4:.2f} ({w4 / t0:.2f}x)", "-" if probe is None else f"{probe:.2f} ({probe / t0:.2f}x)"]
        print(f"| {k}×{n} | {nbytes / 1e6:.1f} | {t0:.2f} ({nbytes / t0 / 1e3:.0f}) | " + " | ".join(cells) + " |",
              flush=True)
        if args.json:
            rec = {"k": k, "n": n, "bytes": nbytes, "plain_us": t0, "plain_variant": plain[1:],
                   "orders": {name: {"us": t, "in_flight": (2, 4, 8)[(v - 10) % 4], "blocks_per_sm": b}
                              for name, (t, v, b) in zip(ORDERS, orders)},
                   "w4pack_m1_us": w4, "probe_bulk_us": probe}
            with args.json.open("a") as f:
                f.write(json.dumps(rec) + "\n")
    print("\nratios: each time over the plain read's; medians of graph replays, weights rotated past L2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
