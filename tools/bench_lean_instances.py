#!/usr/bin/env python3
"""Step time of several lean CUDA loops built over one W4 model, timed in turn: where a step's spread comes from.

The lean W4 step's time has moved from one build of the loop to the next on one machine, more than the fp16
step's (docs/journal/2026-cuda.md, section 11). Each ``GraphDecoder`` stacks its own q/k/v and gate/up
weights (new allocations) and compiles and captures its own step; this tool builds the listed loops over one
model, keeps them all, and times each in turn for ``--rounds`` rounds: a spread that follows the instance (the
same loop fast or slow in every round) points at what differs between builds (placement, the compiled step),
one that follows the round at the machine. ``--profile`` then lists each loop's kernels (GPU time per step), so
the kernel whose time moved is named.

Each timing replays the captured step ``--steps`` times from position 16 (the graphs only: no host loop, no
sampling), between two CUDA events; the cell is the median of ``--repeats`` such runs, in ms per step.

Loops (``--loops``, comma-separated; each ``base`` or settings joined by ``+``): ``fuse=0|1`` (Inductor before
the capture; default 1), ``attn=matmul|sdpa|kernel``, ``fold=0|1`` (default 1), e.g.
``base,base,base,fuse=0,fold=0+attn=sdpa``.

    python tools/bench_lean_instances.py --shape llama2-7b --loops base,base,base,fold=0 --profile
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"{value!r} is not 0 or 1")
    return value == "1"


#: the GraphDecoder keyword each setting sets, and how its value is read
SETTINGS = {"fuse": _flag, "attn": str, "fold": _flag}


def parse_loops(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``--loops`` as (name, GraphDecoder keywords) pairs."""
    loops = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        kw: dict[str, Any] = {}
        if item != "base":
            for part in item.split("+"):
                key, eq, value = part.partition("=")
                if not eq or key not in SETTINGS:
                    raise ValueError(f"--loops: {part!r} is not one of {', '.join(k + '=...' for k in SETTINGS)}")
                try:
                    kw[key] = SETTINGS[key](value)
                except ValueError as exc:
                    raise ValueError(f"--loops: {part!r}: {exc}") from None
        loops.append((item, kw))
    if not loops:
        raise ValueError("--loops names no loop")
    return loops


def _replay(dec: Any, steps: int) -> None:
    dec.pos = 16
    dec.pos_t.fill_(16)
    for _ in range(steps):
        dec.launch()


def time_step(torch: Any, dec: Any, steps: int) -> float:
    """ms per step of ``steps`` graph replays (after a short warm replay)."""
    _replay(dec, 4)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _replay(dec, steps)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def profile_step(torch: Any, dec: Any, steps: int, top: int) -> list[tuple[str, float, float]]:
    """(kernel, calls a step, us a step) of the ``top`` kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    _replay(dec, 4)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _replay(dec, steps)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    rows.sort(key=lambda e: -e.self_device_time_total)
    return [(e.key, e.count / steps, e.self_device_time_total / steps) for e in rows[:top]]


def main() -> int:
    import bench_run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(bench_run.SHAPES))
    ap.add_argument("--loops", default="base,base,base", help="the loops to build (see the module's help)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64,
                    help="graph replays per timing (from position 16, inside the first attention bucket)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per cell (median)")
    ap.add_argument("--profile", action="store_true", help="then list each loop's kernels (us per step)")
    ap.add_argument("--profile-top", type=int, default=14)
    args = ap.parse_args()
    try:
        loops = parse_loops(args.loops)
    except ValueError as exc:
        ap.error(str(exc))
    from w4pack.runtime.lean_cuda import BUCKET

    if not 1 <= args.steps <= BUCKET - 16 - 4:  # (a replay past the bucket would capture a graph while timed)
        ap.error(f"--steps takes 1 to {BUCKET - 20}")
    import torch

    from w4pack.native import cuda

    if not torch.cuda.is_available() or not cuda.available():
        why = "no CUDA device" if not torch.cuda.is_available() else cuda.unavailable_reason()
        print(f"bench_lean_instances: {why}", file=sys.stderr)
        return 2
    from w4pack.runtime.lean_cuda import GraphDecoder

    model = bench_run.build_float(args.shape, "cuda", torch.float16)
    bench_run.swap_to_w4(model, args.shape, "cuda", "exact")
    print(f"{torch.cuda.get_device_name()}, {args.shape}, {args.steps} replays a timing, median of {args.repeats}",
          flush=True)
    decs = []
    with torch.inference_mode():
        for i, (name, kw) in enumerate(loops):
            dec = GraphDecoder(model, **kw)
            dec._reserve(16 + args.steps + 8)
            decs.append(dec)
            _replay(dec, 1)  # compile and capture now, not inside the first timing
            print(f"loop {i} ({name}): fuse={dec.fuse} attn={dec.attn} folded={dec.folded} captures={dec.captures}"
                  f"{' note=' + dec.note if dec.note else ''}",
                  flush=True)
        cells: list[list[float]] = [[] for _ in decs]
        for r in range(args.rounds):
            for i, dec in enumerate(decs):
                cells[i].append(statistics.median(time_step(torch, dec, args.steps) for _ in range(args.repeats)))
            print(f"round {r + 1}: " + "  ".join(f"{i}: {c[-1]:.3f}" for i, c in enumerate(cells)), flush=True)
        print("\n| loop | settings | ms a step, each round | median |\n|---|---|---|---|")
        for i, ((name, _), c) in enumerate(zip(loops, cells)):
            print(f"| {i} | {name} | {' / '.join(f'{v:.3f}' for v in c)} | {statistics.median(c):.3f} |")
        if args.profile:
            for i, ((name, _), dec) in enumerate(zip(loops, decs)):
                print(f"\nloop {i} ({name}): kernels, us a step (calls a step)")
                for key, calls, us in profile_step(torch, dec, args.steps, args.profile_top):
                    print(f"  {us:9.1f}  ({calls:5.1f})  {key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
