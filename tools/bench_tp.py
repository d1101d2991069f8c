#!/usr/bin/env python3
"""Tensor-parallel packed layers across processes (torch.distributed): exactness and per-layer time, N ranks vs 1.

A Llama decoder block's projections at a given shape: q/k/v and gate/up column-parallel, o and down row-parallel
with an all-reduce after each, group 128, integer zeros, and the down projection act-order (its rank slices are
regrouped with padding inputs, docs/SERVING.md). Every rank builds the same full packed layers from one seed and
cuts its share with the functions the vLLM plugin uses (``w4pack.tp``); rank 0 also runs the unsharded layers.

Checks (every run): the all-reduced output of each row-parallel layer and the gathered output of each column-
parallel layer equal the unsharded result within the kernels' tolerance (fp16 on CUDA, fp32 exact on CPU), and
20 repeats are bit-identical. Timing (``--time``): per layer, median over CUDA-graph replays of the layer alone
(N ranks: the GEMM plus its all-reduce; and the all-reduce alone, for its share), against the same layer
unsharded on one GPU.

    torchrun --nproc-per-node 2 tools/bench_tp.py --shape 70b --time                 # GPUs, NCCL
    python -m torch.distributed.run --nproc-per-node 2 tools/bench_tp.py --device cpu --shape tiny   # gloo
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: hidden, intermediate, heads, kv heads, head dim
SHAPES = {"70b": (8192, 28672, 64, 8, 128), "7b": (4096, 11008, 32, 32, 128), "tiny": (256, 576, 4, 2, 64)}
GROUP = 128
WARM_REPLAYS = 20  # untimed graph replays before each timing


def random_packed(n: int, k: int, seed: int, act_order: bool = False) -> Any:
    """A valid layout-v1 layer made directly in packed form: random code words, scales, zero points (and a
    random column permutation): no numpy packing of billions of codes."""
    from w4pack.layout import PackedLayer, padded_shape

    rng = np.random.default_rng(seed)
    np_, kp = padded_shape(n, k)
    assert (np_, kp) == (n, k), "bench shapes are tile multiples"
    g = -(-k // GROUP)
    qweight = rng.integers(-2**31, 2**31, size=(n // 16, k // 64 * 128), dtype=np.int64).astype(np.int32)
    scales = (rng.random((g, n), dtype=np.float32) * 2e-3 + 1e-3).astype(np.float16)
    zeros = rng.integers(5, 11, size=(g, n)).astype(np.uint8)
    meta = {"bits": 4, "storage_bits": 4, "group_size": GROUP, "zero_mode": "int", "shape": [n, k],
            "padded_shape": [n, k], "num_groups": g, "padded_groups": g, "scale_dtype": "float16",
            "act_order": act_order, "bias_dtype": None}
    tensors = {"qweight": qweight, "scales": scales, "zeros": zeros}
    if act_order:
        tensors["perm"] = rng.permutation(k).astype(np.int32)
    return PackedLayer(meta=meta, tensors=tensors)


def build(shape: str) -> dict[str, tuple[str, Any]]:
    """name -> (kind, full packed layer)."""
    hidden, inter, heads, kv, hd = SHAPES[shape]
    return {
        "qkv": ("column", random_packed((heads + 2 * kv) * hd, hidden, 1)),
        "o": ("row", random_packed(hidden, heads * hd, 2)),
        "gate_up": ("column", random_packed(2 * inter, hidden, 3)),
        "down": ("row", random_packed(hidden, inter, 4, act_order=True)),
    }


def rank_modules(layers: dict[str, tuple[str, Any]], rank: int, size: int, device: Any) -> dict[str, Any]:
    from w4pack.torch_module import W4Linear
    from w4pack.tp import column_parallel, row_parallel

    out = {}
    for name, (kind, packed) in layers.items():
        if kind == "column":
            mod, pad = W4Linear.from_packed(column_parallel(packed, size, rank, name), device=device), 0
        else:
            shard = row_parallel(packed, size, rank, name)
            mod, pad = W4Linear.from_packed(shard.packed, device=device), shard.input_pad
        out[name] = (kind, mod, pad)
    return out


def run_layer(torch: Any, dist: Any, kind: str, mod: Any, pad: int, x: torch.Tensor, size: int) -> Any:
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    y = mod(x)
    if kind == "row" and size > 1:
        dist.all_reduce(y)
    return y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="70b")
    ap.add_argument("--ms", default="1,16,64,256", help="token counts M")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--time", action="store_true", help="also time each layer (CUDA graphs on GPUs)")
    ap.add_argument("--repeats", type=int, default=20, help="repeats that must be bit-identical")
    ap.add_argument("--json", type=Path, help="rank 0 writes the results here")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_tp: no CUDA device (--device cpu runs the ranks on gloo)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.float16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
    if size > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    hidden, inter, heads, kv, hd = SHAPES[args.shape]
    layers = build(args.shape)
    mine = rank_modules(layers, rank, size, device)
    full = rank_modules(layers, 0, 1, device) if rank == 0 else None
    for _, mod, _ in list(mine.values()) + (list(full.values()) if full else []):
        mod.prepare(device, dtype)
    ms = [int(v) for v in args.ms.split(",")]
    results, failures = [], []
    tol = 2e-2 if args.device == "cuda" else 1e-4
    for m in ms:
        gen = torch.Generator().manual_seed(m)
        for name, (kind, mod, pad) in mine.items():
            k_full = layers[name][1].meta["shape"][1]
            x_full = torch.randn(m, k_full, generator=gen).to(device, dtype)
            per = k_full // size
            x = x_full[:, rank * per:(rank + 1) * per].contiguous() if kind == "row" else x_full
            y = run_layer(torch, dist, kind, mod, pad, x, size)
            for _ in range(args.repeats):
                again = run_layer(torch, dist, kind, mod, pad, x, size)
                if not torch.equal(again, y):
                    failures.append(f"{name} M={m}: repeats differ")
                    break
            if kind == "column" and size > 1:
                parts = [torch.empty_like(y) for _ in range(size)]
                dist.all_gather(parts, y.contiguous())
                y = torch.cat(parts, dim=-1)
            if rank == 0:
                ref = full[name][1](x_full)
                err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
                if not err <= tol:
                    failures.append(f"{name} M={m}: relative error {err:.2e} > {tol:g}")
                row = {"layer": name, "m": m, "rel_err": err}
                if args.time:
                    row.update(_times(torch, dist, args, mine[name], full[name], x, x_full, size))
                results.append(row)
            elif args.time:
                _times(torch, dist, args, mine[name], None, x, None, size)
    if rank == 0:
        _report(results, failures, args, size)
        if args.json:
            args.json.write_text(json.dumps({"size": size, "shape": args.shape, "rows": results,
                                             "failures": failures}, indent=2))
    if size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 1 if failures else 0


def _graph_time(torch: Any, fn: Any, device: Any, reps: int = 50) -> float:
    """Median µs of one replay of ``fn`` captured in a CUDA graph (wall time per call on CPU)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    # untimed replays first, as bench_gpu's time_graph does (a layer timed right after other work ran slower
    # through its whole measurement: journal 2026-cuda section 18); a count, not a time, since the graph may
    # hold a collective and every rank must replay it as often
    for _ in range(WARM_REPLAYS):
        g.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in zip(starts, ends))


def _times(torch: Any, dist: Any, args: Any, mine: Any, full: Any, x: Any, x_full: Any, size: int) -> dict:
    kind, mod, pad = mine
    device = x.device
    out: dict[str, float] = {}
    if size > 1:
        dist.barrier()
    out["tp_us"] = _graph_time(torch, lambda: run_layer(torch, dist, kind, mod, pad, x, size), device)
    if kind == "row" and size > 1:
        buf = torch.empty(x.shape[0], mod.out_features, device=device, dtype=x.dtype)
        out["allreduce_us"] = _graph_time(torch, lambda: dist.all_reduce(buf), device)
    if full is not None:
        out["one_us"] = _graph_time(torch, lambda: full[1](x_full), device)
    return out


def _report(results: list[dict], failures: list[str], args: Any, size: int) -> None:
    print(f"{size} rank(s), {args.device}, shape {args.shape}, group {GROUP}, int zeros, down act-order")
    for f in failures:
        print("FAIL", f)
    if args.time:
        print("| layer | M | 1 rank µs | N ranks µs (with all-reduce) | speed-up | all-reduce µs | share |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            ar = r.get("allreduce_us")
            ar_us = "" if ar is None else f"{ar:.1f}"
            share = "" if ar is None else f"{ar / r['tp_us']:.0%}"
            print(f"| {r['layer']} | {r['m']} | {r['one_us']:.1f} | {r['tp_us']:.1f} | "
                  f"{r['one_us'] / r['tp_us']:.2f}x | {ar_us} | {share} |")
    worst = max((r["rel_err"] for r in results), default=0.0)
    print(f"{'exact' if not failures else 'MISMATCH'}: {len(results)} layer x M cases, worst relative error "
          f"{worst:.2e}, {args.repeats} repeats bit-identical" + ("" if not failures else f"; {len(failures)} failed"))


if __name__ == "__main__":
    sys.exit(main())
