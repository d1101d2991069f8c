#!/usr/bin/env python3
"""One layer's w4pack call timed on fewer SMs than the GPU has: how much each SM can stream.

A GPU with more memory bandwidth per SM (an H200 against an H100: 4.0 against 3.0 TB/s on the same 132 SMs) asks
each SM for more bytes per second. Holding some SMs idle asks the same of the rest on the GPU at hand: on an H100,
99 SMs at its full read rate is an H200's rate per SM. Where a kernel's time stays level as SMs are taken away,
its SMs keep up; where it grows, the kernel's own rate per SM (its bytes in flight, its instructions) is the
limit, and the SM count at the knee says at what rate.

tools/sm_limit/sm_hold.cu (built with nvcc for this GPU once, under build/sm_limit/) launches one block per held
SM that asks for all of the SM's shared memory and spins until released, so no other block can run there. The
layer is timed as tools/bench_gpu.py times it (weight copies past L2, one CUDA graph of one call per copy,
event-timed replays) on another stream while the SMs are held. On the GPU machine:

    python tools/sm_limit.py [--shape 8192x28672] [--m 1] [--sms all,110,99,88] [--json out/sm_limit.jsonl]

It prints the median µs per call for each SM count, the GB/s of the call's bytes and the GB/s per SM in use.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tools" / "sm_limit" / "sm_hold.cu"


def parse_shape(text: str) -> tuple[int, int]:
    k, sep, n = text.lower().partition("x")
    if not sep or not k.isdigit() or not n.isdigit() or int(k) < 1 or int(n) < 1:
        raise ValueError(f"--shape: {text!r}; write KxN, e.g. 8192x28672")
    return int(k), int(n)


def parse_sms(text: str, total: int) -> list[int]:
    """SM counts to run on: 'all' or numbers from 1 to the GPU's count, each once, in the order given."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        v = total if part == "all" else int(part) if part.isdigit() else 0
        if not 1 <= v <= total:
            raise ValueError(f"--sms: {part!r}; give 'all' or SM counts from 1 to {total}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError("--sms: give at least one SM count")
    return out


def nvcc() -> str:
    found = os.environ.get("NVCC") or shutil.which("nvcc") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))),
                                                                   None)
    if not found:
        raise SystemExit("sm_limit: nvcc not found (set NVCC): it builds the SM-holding kernel")
    return found


def build(cc: str) -> Path:
    """The holding kernel for compute capability cc ("90"), rebuilt when the source is newer."""
    out = ROOT / "build" / "sm_limit" / f"sm_hold_sm{cc}.so"
    if out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"building {out.name} ...", file=sys.stderr, flush=True)
    subprocess.run([nvcc(), "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
                    f"-gencode=arch=compute_{cc},code=sm_{cc}", str(SOURCE), "-o", str(out)], check=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192x28672", help="KxN of the layer (default 8192x28672)")
    ap.add_argument("--m", type=int, default=1, help="tokens (default 1)")
    ap.add_argument("--sms", default="all,120,110,99,88", help="SM counts to run on ('all' or numbers)")
    ap.add_argument("--kernel", default="auto", help="the w4pack kernel (default: the planner's)")
    ap.add_argument("--replays", type=int, default=15, help="timed graph replays per SM count")
    ap.add_argument("--tag", default="", help="a name for this run's rows (e.g. the library's)")
    ap.add_argument("--json", type=Path, default=None, help="append one JSON line per SM count")
    args = ap.parse_args()
    try:
        k, n = parse_shape(args.shape)
        if args.m < 1 or args.replays < 1:
            raise ValueError("--m and --replays: give 1 or more")
    except ValueError as exc:
        print(f"sm_limit: {exc}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("sm_limit: torch is not installed (pip install torch)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sm_limit: no CUDA device", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        sms_list = parse_sms(args.sms, total)
    except ValueError as exc:
        print(f"sm_limit: {exc}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_gpu as bench  # noqa: E402  (the benchmark's weight copies)

    major, minor = torch.cuda.get_device_capability()
    lib = ctypes.CDLL(str(build(f"{major}{minor}")))
    lib.smh_hold.argtypes = [ctypes.c_int, ctypes.c_uint64]
    lib.smh_started.argtypes = [ctypes.c_int]

    copies = bench.n_copies(k * n / 2)
    lins = bench.w4_copies(bench.random_packed(k, n), copies)
    x = torch.randn(args.m, k, device="cuda", dtype=torch.float16)
    ys = [torch.empty(args.m, n, device="cuda", dtype=torch.float16) for _ in range(2)]
    s, hs = torch.cuda.Stream(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # (the plans made and the kernels loaded before the capture)
        for i in range(copies):
            lins[i].forward(x, out=ys[i & 1], kernel=args.kernel)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(copies):
            lins[i].forward(x, out=ys[i & 1], kernel=args.kernel)
    torch.cuda.synchronize()
    plan = lins[0].plan(args.m, kernel=args.kernel)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(args.replays + 3)]  # (made before any SM is held: nothing below allocates)
    nbytes = bench.w4_bytes(k, n, args.m)
    gpu = torch.cuda.get_device_name(0)
    print(f"GPU {gpu} ({total} SMs); {k}x{n} M={args.m}, plan: {plan['detail']} {args.tag}".rstrip())
    print("| SMs | µs per call | GB/s | GB/s per SM |")
    print("|---|---|---|---|")
    for sms in sms_list:
        held = total - sms
        if held:
            e = lib.smh_hold(held, hs.cuda_stream)
            if e:
                print(f"sm_limit: holding {held} SMs failed (CUDA error {e})", file=sys.stderr)
                return 1
            end = time.perf_counter() + 5.0
            while lib.smh_started(held) < held and time.perf_counter() < end:
                time.sleep(0.0005)
            started = lib.smh_started(held)
        times = []
        try:
            if held and started < held:
                print(f"sm_limit: only {started} of {held} holding blocks started", file=sys.stderr)
                return 1
            with torch.cuda.stream(s):
                for j, (a, b) in enumerate(events):  # (three untimed replays first)
                    a.record(s)
                    g.replay()
                    b.record(s)
                    b.synchronize()
                    if j >= 3:
                        times.append(a.elapsed_time(b) * 1000.0 / copies)
        finally:
            if held:
                lib.smh_release()
                hs.synchronize()
        us = statistics.median(times)
        gbs = nbytes / (us * 1e-6) / 1e9
        print(f"| {sms} | {us:.1f} | {gbs:.0f} | {gbs / sms:.1f} |", flush=True)
        if args.json:
            rec = {"kind": "sm_limit", "gpu": gpu, "sms_total": total, "sms": sms, "K": k, "N": n, "M": args.m,
                   "kernel": args.kernel, "tag": args.tag, "us": us, "gbs": gbs, "times_us": times,
                   "plan": plan}
            with args.json.open("a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
