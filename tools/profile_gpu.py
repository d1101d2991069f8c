#!/usr/bin/env python3
"""One w4pack CUDA GEMM configuration, called a few times, for a profiler to attach to.

The ncu figures in docs/journal/2026-cuda.md come from runs such as

    ncu --clock-control none -k regex:wgmma_ws -s 2 -c 1 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats python tools/profile_gpu.py --shape 8192x28672 --m 16 --kernel wgmma_ws

(`-s 2 -c 1` skips the two warm-up calls and profiles the third). With `--section SourceCounters` the report
also holds warp samples per SASS instruction: tools/ncu_stalls.py ranks them. The layer is random, with int zero
points, group size 128 and fp16 activations, like the benchmark's. Exit status 2 without a CUDA device.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192x28672", help="KxN of the layer (default 8192x28672)")
    ap.add_argument("--m", type=int, default=16, help="tokens (default 16)")
    ap.add_argument("--kernel", default="auto", help="a w4pack.native.cuda.KERNELS name (default auto)")
    ap.add_argument("--splits", type=int, default=0, help="forced split count / stages (0: the planner's)")
    ap.add_argument("--calls", type=int, default=3, help="calls to make (default 3)")
    ap.add_argument("--zero-mode", default="int", choices=("none", "int", "float"))
    args = ap.parse_args()

    import numpy as np
    import torch

    from w4pack.canonical import CanonicalLayer
    from w4pack.layout import pack
    from w4pack.native import cuda as w4cuda

    if not torch.cuda.is_available() or not w4cuda.available():
        print(f"profile_gpu: {w4cuda.unavailable_reason() or 'no CUDA device (torch sees none)'}", file=sys.stderr)
        return 2
    if args.kernel not in w4cuda.KERNELS:
        print(f"profile_gpu: unknown kernel {args.kernel!r} (one of {', '.join(w4cuda.KERNELS)})", file=sys.stderr)
        return 2
    try:
        k, n = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        print(f"profile_gpu: --shape takes KxN, got {args.shape!r}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    g = -(-k // 128)
    zeros = None
    if args.zero_mode == "int":
        zeros = rng.integers(0, 17, size=(n, g)).astype(np.int32)
    elif args.zero_mode == "float":
        zeros = rng.uniform(-0.1, 0.1, size=(n, g)).astype(np.float16)
    layer = CanonicalLayer(codes=rng.integers(0, 16, size=(n, k), dtype=np.uint8),
                           scales=rng.uniform(0.005, 0.02, size=(n, g)).astype(np.float16), bits=4, group_size=128,
                           zero_mode=args.zero_mode, zeros=zeros).validate()
    lin = w4cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(args.m, k, device="cuda", dtype=torch.float16)
    print(f"profile_gpu: {k}x{n} M={args.m} kernel={args.kernel} plan={lin.plan(args.m)}", flush=True)
    for _ in range(args.calls):
        lin.forward(x, kernel=args.kernel, splits=args.splits)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
