#!/usr/bin/env python3
"""One decode token's attention, per layer, against the peers and the memory floor, by cache length.

Why: the lean loop's step attends once a layer (``w4pack::decode_attention``: rotary, cache write and attention in
one launch), and at long contexts that call's read of the keys and values, not the packed GEMMs, grows with every
token. ``tools/bench_run.py`` sees it only inside whole steps; this times the call alone, so a change to the
kernel is measured in minutes, and two CUDA libraries are compared by running this once with each.

Methods, each timed as ``--layers`` calls on distinct caches captured in one CUDA graph (the caches stay cold in
L2 as in a model's step), the cell the median of ``--repeats`` replays, in µs a call:

* ``kernel``: w4pack's op through ``w4pack.native.cuda.decode_attention`` (its rotary and cache write included);
* ``matmul``: the lean loop's matmul attention: two batched products around a float32 softmax over the keys (no
  rotary, no cache write: less work than the kernel does);
* ``sdpa``: torch's ``scaled_dot_product_attention`` over the same keys (its flash or memory-efficient kernel,
  the fused peer; no rotary, no cache write);
* ``floor``: the keys' and values' bytes at the device-to-device copy rate measured in the same run.

    python tools/bench_attention.py --shapes llama2-7b,llama3-8b --lengths 16,512,1500,4000 --rounds 2
    W4PACK_ATTN_BLOCKS=4 python tools/bench_attention.py ...   # another split count, the same table
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

#: (query heads, kv heads, head size) of the models whose attention the lean loop runs
SHAPES = {
    "llama2-7b": (32, 32, 128),
    "llama3-8b": (32, 8, 128),
    "llama2-70b": (64, 8, 128),
    "smollm2": (9, 3, 64),
}
METHODS = ("kernel", "matmul", "sdpa")


def parse_lengths(text: str) -> list[int]:
    """``--lengths``: cache lengths (keys attended, the new token's included), each at least 1."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--lengths: {item!r} is not a whole number of keys >= 1")
        out.append(int(item))
    if not out:
        raise ValueError("--lengths names no length")
    return out


def floor_us(bytes_read: int, gbps: float) -> float:
    """µs to read ``bytes_read`` at ``gbps`` GB/s."""
    return bytes_read / (gbps * 1e3)


def kv_bytes(kv_heads: int, head_dim: int, length: int, itemsize: int = 2) -> int:
    """Bytes of keys and values one call reads at ``length`` keys."""
    return 2 * kv_heads * length * head_dim * itemsize


def copy_gbps(torch: Any, repeats: int) -> float:
    """The device-to-device copy rate (read + write bytes / time) of 1 GiB: the read floor's yardstick."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times[1:])
    del src, dst
    return 2 * (1 << 30) / (ms * 1e6)


def build_calls(torch: Any, shape: tuple[int, int, int], length: int, layers: int,
                dtype: Any) -> dict[str, list[Callable[[], Any]]]:
    """Each method's calls, one a layer, on per-layer caches of ``length`` keys (random, not zeros)."""
    from w4pack.native import cuda

    heads, kvh, d = shape
    g = heads // kvh
    max_len = max(length, 16)
    F = torch.nn.functional
    pos = torch.tensor([length - 1], dtype=torch.int64, device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(max_len, device="cuda", dtype=torch.float32), inv)
    cos = torch.cat((ang, ang), -1).cos().to(dtype).contiguous()
    sin = torch.cat((ang, ang), -1).sin().to(dtype).contiguous()
    scaling = d ** -0.5
    calls: dict[str, list[Callable[[], Any]]] = {m: [] for m in METHODS}
    for _ in range(layers):
        k = torch.randn(kvh, max_len, d, device="cuda", dtype=dtype)
        v = torch.randn(kvh, max_len, d, device="cuda", dtype=dtype)
        qkv = torch.randn((heads + 2 * kvh) * d, device="cuda", dtype=dtype)
        calls["kernel"].append(lambda qkv=qkv, k=k, v=v: cuda.decode_attention(qkv, cos, sin, pos, k, v, heads, kvh,
                                                                              scaling))
        q = qkv[:heads * d].view(kvh, g, d)
        ks, vs = k[:, :length], v[:, :length]

        def matmul(q=q, ks=ks, vs=vs) -> Any:
            s = torch.matmul(q, ks.transpose(1, 2)).float() * scaling
            return torch.matmul(s.softmax(-1).to(dtype), vs)

        calls["matmul"].append(matmul)
        q4, k4, v4 = q.reshape(1, heads, 1, d), ks.unsqueeze(0), vs.unsqueeze(0)
        calls["sdpa"].append(lambda q4=q4, k4=k4, v4=v4: F.scaled_dot_product_attention(q4, k4, v4, scale=scaling,
                                                                                        enable_gqa=True))
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--lengths", default="16,512,1500,4000", help="keys attended (the new token's included)")
    ap.add_argument("--layers", type=int, default=32, help="calls a graph, each on its own caches")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    ap.add_argument("--rounds", type=int, default=2, help="the methods in turn, this many times (drift shows)")
    ap.add_argument("--repeats", type=int, default=20, help="graph replays a cell (median)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: {', '.join(bad) or 'none given'}; choose from {', '.join(SHAPES)}")
    try:
        lengths = parse_lengths(args.lengths)
    except ValueError as exc:
        ap.error(str(exc))
    if args.layers < 1 or args.rounds < 1 or args.repeats < 1:
        ap.error("--layers, --rounds and --repeats take 1 or more")
    import torch

    from w4pack.native import cuda
    from w4pack.runtime.attention import kernel_reason

    if not torch.cuda.is_available() or not cuda.available():
        why = "no CUDA device" if not torch.cuda.is_available() else cuda.unavailable_reason()
        print(f"bench_attention: {why}", file=sys.stderr)
        return 2
    import bench_gpu  # (its graph timing: the calls captured in one graph, event-timed replays)

    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    gbps = copy_gbps(torch, 5)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, {args.layers} calls a graph, median of {args.repeats} "
          f"replays; copy rate {gbps:.0f} GB/s; splits a kv head: "
          + ", ".join(f"{s} {cuda.attention_splits(dev, SHAPES[s][1])}" for s in shapes), flush=True)
    rows = []
    with torch.inference_mode():
        for name in shapes:
            heads, kvh, d = SHAPES[name]
            why = kernel_reason(dev, dtype, heads, kvh, d)
            for length in lengths:
                calls = build_calls(torch, SHAPES[name], length, args.layers, dtype)
                if why:
                    del calls["kernel"]
                cells: dict[str, list[float]] = {m: [] for m in calls}
                for _ in range(args.rounds):
                    for m, fns in calls.items():
                        cells[m].append(bench_gpu.time_graph(lambda i, fns=fns: fns[i](), len(fns), args.repeats))
                fl = floor_us(kv_bytes(kvh, d, length), gbps)
                row = {"shape": name, "heads": heads, "kv_heads": kvh, "head_dim": d, "length": length,
                       "floor_us": round(fl, 2), **{f"{m}_us": [round(v, 2) for v in c] for m, c in cells.items()}}
                rows.append(row)
                del calls
                torch.cuda.empty_cache()
    print(f"\n| shape | keys | floor µs | " + " | ".join(f"{m} µs" for m in METHODS)
          + " | kernel / floor | sdpa / kernel |")
    print("|---|---|---|" + "---|" * len(METHODS) + "---|---|")
    for r in rows:
        med = {m: statistics.median(r[f"{m}_us"]) for m in METHODS if f"{m}_us" in r}
        each = " | ".join(" / ".join(f"{v:.1f}" for v in r[f"{m}_us"]) if f"{m}_us" in r else "-" for m in METHODS)
        ratio = f"{med['kernel'] / r['floor_us']:.2f}x" if "kernel" in med else "-"
        vs = f"{med['sdpa'] / med['kernel']:.2f}x" if "kernel" in med and math.isfinite(med["sdpa"]) else "-"
        print(f"| {r['shape']} | {r['length']} | {r['floor_us']:.1f} | {each} | {ratio} | {vs} |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": round(gbps, 1),
                                         "dtype": args.dtype, "layers": args.layers, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
