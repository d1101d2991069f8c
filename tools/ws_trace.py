#!/usr/bin/env python3
"""Where a wgmma_ws call's time goes, block by block: a timeline from a diagnostics build of the CUDA library.

`nvcc -DW4P_WS_TRACE` makes thread 0 of every wgmma_ws block record `%globaltimer` and `clock64` at its start,
at the end of each main loop (or stream-K segment) and at the end of each epilogue (docs/journal/2026-cuda.md section 7
quotes such traces: the output stores and stream-K's partial sums were found this way). This script builds that
library once (sm_90a only, under build/ws_trace/), runs each configuration through it after warm-up calls on
other weight copies, and prints per configuration: the graph-replayed time of the ordinary library, the plan,
and for the traced call the blocks' start, main-loop and epilogue times. On the GPU machine:

    python tools/ws_trace.py --configs "4096x11008:256;8192x28672:256:W4P_CUDA_WS_SK=0" --save out/

A configuration is KxN:M[:ENV=VALUE,...] (K×N as in tools/bench_gpu.py; the variables are set for that
configuration only). `--summarize FILE.npy` prints the summary of a saved trace and needs no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EVENTS = 15  # events per block in the library's record (WS_TRACE_EVENTS)


class ConfigError(ValueError):
    """A --configs entry that is not KxN:M[:ENV=VALUE,...]."""


def parse_config(text: str) -> tuple[int, int, int, dict[str, str]]:
    """(K, N, M, environment) from "KxN:M[:ENV=VALUE,...]"."""
    parts = text.strip().split(":")
    try:
        k, n = (int(v) for v in parts[0].lower().split("x"))
        m = int(parts[1])
    except (ValueError, IndexError):
        raise ConfigError(f"{text!r}: expected KxN:M[:ENV=VALUE,...]") from None
    env: dict[str, str] = {}
    for item in (parts[2].split(",") if len(parts) > 2 and parts[2] else []):
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("W4P_"):
            raise ConfigError(f"{text!r}: {item!r} is not W4P_...=VALUE")
        env[key] = value
    if len(parts) > 3 or min(k, n, m) <= 0:
        raise ConfigError(f"{text!r}: expected KxN:M[:ENV=VALUE,...] with positive sizes")
    return k, n, m, env


def _range(v: np.ndarray) -> dict[str, float]:
    return {"min": float(v.min()), "median": float(np.median(v)), "max": float(v.max())}


def summarize(trace: np.ndarray) -> dict:
    """Per-block timeline statistics (µs from the first block's start) of a [blocks][32] uint64 record: start
    times, the end of each main loop / segment (odd events) and of each epilogue (even events), each epilogue's
    duration, the last event per block (the call's end), and the clock the blocks ran at."""
    tr = np.asarray(trace, dtype=np.uint64)
    tr = tr[tr[:, 31] != 0].astype(np.int64)  # blocks that ran (word 31: SM | 1 << 32)
    if len(tr) == 0:
        raise ValueError("no block recorded an event (was the call a wgmma_ws call?)")
    t0 = tr[:, 0].min()
    out: dict = {"blocks": int(len(tr)), "sms": int(len(np.unique(tr[:, 31] & 0xFFFF))),
                 "start_us": _range((tr[:, 0] - t0) / 1e3), "events": {}, "epilogue_us": {}}
    last_g = np.zeros(len(tr), dtype=np.int64)
    last_c = np.zeros(len(tr), dtype=np.int64)
    for ev in range(1, EVENTS):
        seen = tr[:, 2 * ev] != 0
        if not seen.any():
            continue
        out["events"][ev] = _range((tr[seen, 2 * ev] - t0) / 1e3)
        last_g = np.where(seen, tr[:, 2 * ev], last_g)
        last_c = np.where(seen, tr[:, 2 * ev + 1], last_c)
        both = seen & (tr[:, 2 * ev - 2] != 0)
        if ev % 2 == 0 and both.any():
            out["epilogue_us"][ev // 2] = _range((tr[both, 2 * ev] - tr[both, 2 * ev - 2]) / 1e3)
    ran = last_g != 0
    if ran.any():
        out["end_us"] = _range((last_g[ran] - t0) / 1e3)
        span_ns = (last_g[ran] - tr[ran, 0]).astype(np.float64)
        cycles = (last_c[ran] - tr[ran, 1]).astype(np.float64)
        ok = span_ns > 0
        if ok.any():
            out["clock_mhz"] = float(np.median(cycles[ok] / span_ns[ok] * 1e3))
    return out


def format_summary(s: dict) -> str:
    def r(v: dict) -> str:
        return f"{v['min']:.2f}–{v['max']:.2f} (median {v['median']:.2f})"

    lines = [f"  blocks {s['blocks']} on {s['sms']} SMs; start {r(s['start_us'])} µs"]
    for ev, v in s["events"].items():
        kind = "main loop / segment" if ev % 2 else "epilogue"
        lines.append(f"  event {ev} ({kind} {(ev + 1) // 2} ends): {r(v)} µs")
    for seg, v in s["epilogue_us"].items():
        lines.append(f"  epilogue {seg} takes {r(v)} µs")
    if "end_us" in s:
        lines.append(f"  blocks end {r(s['end_us'])} µs" +
                     (f"; clock about {s['clock_mhz']:.0f} MHz" if "clock_mhz" in s else ""))
    return "\n".join(lines)


def build_traced_library(out_dir: Path) -> Path:
    """The CUDA library built with -DW4P_WS_TRACE for sm_90a by native/cuda/build.sh (its flags; rebuilt only
    when a source is newer)."""
    lib = out_dir / "libw4p_cuda_trace.so"
    env = {**os.environ, "W4P_CUDA_ARCHS": "90a", "W4P_CUDA_OUT": str(lib), "W4P_CUDA_DEFINES": "-DW4P_WS_TRACE"}
    print("building the traced library if needed (sm_90a, a few minutes) ...", file=sys.stderr, flush=True)
    subprocess.run(["bash", str(ROOT / "native" / "cuda" / "build.sh")], check=True, env=env)
    return lib


def run(configs: list[tuple[int, int, int, dict[str, str]]], save: Path | None, as_json: bool,
        library: Path | None = None) -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_gpu as bench  # noqa: E402  (torch, the device, the benchmark's weight copies and timing)
    import torch

    from w4pack.native import cuda as w4c

    ffi, lib = w4c._load()
    ffi.cdef("int w4p_cuda_ws_trace(void *host, size_t bytes, int clear);")
    traced = ffi.dlopen(str(library or build_traced_library(ROOT / "build" / "ws_trace")))
    base_env = {k: v for k, v in os.environ.items() if k.startswith("W4P_CUDA_")}
    results = []
    try:
        for i, (k, n, m, env) in enumerate(configs):
            for key in [key for key in os.environ if key.startswith("W4P_CUDA_")]:
                del os.environ[key]
            os.environ.update(base_env)
            os.environ.update(env)
            w4c._state["lib"] = lib
            lins = bench.w4_copies(bench.random_packed(k, n), bench.n_copies(k * n / 2 * 1.03))
            t_us = bench.measure_w4(lins, k, n, m, kernel="wgmma_ws")
            detail = lins[0].plan(m, kernel="wgmma_ws")["detail"]
            w4c._state["lib"] = traced
            for lin in lins:
                lin._plans.clear()
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            for j in range(3):  # warm-up on other copies: the traced call reads cold weights like the benchmark
                lins[j % len(lins)].forward(x, kernel="wgmma_ws")
            torch.cuda.synchronize()
            traced.w4p_cuda_ws_trace(ffi.NULL, 0, 1)
            lins[-1].forward(x, kernel="wgmma_ws")
            torch.cuda.synchronize()
            buf = np.zeros((8192, 32), dtype=np.uint64)
            rc = traced.w4p_cuda_ws_trace(ffi.cast("void *", buf.ctypes.data), buf.nbytes, 0)
            if rc != 0:
                raise RuntimeError(f"reading the trace failed (cudaError {rc})")
            s = summarize(buf)
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                np.save(save / f"ws_trace_{i}.npy", buf[buf[:, 31] != 0])
            results.append({"K": k, "N": n, "M": m, "env": env, "graph_us": t_us, "plan": detail, "trace": s})
            if not as_json:
                print(f"{k}x{n} M={m} {env or ''}: {t_us:.1f} µs per call (graph replays); {detail}")
                print(format_summary(s), flush=True)
            del lins
            torch.cuda.empty_cache()
    finally:
        w4c._state["lib"] = lib
    if as_json:
        print(json.dumps(results, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="4096x11008:256;8192x28672:128",
                    help='";"-separated KxN:M[:ENV=VALUE,...] (default: %(default)s)')
    ap.add_argument("--save", type=Path, default=None, help="directory for each traced call's record (.npy)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--summarize", type=Path, default=None, help="summarize a saved record (.npy); no GPU needed")
    ap.add_argument("--library", type=Path, default=None,
                    help="a library already built with -DW4P_WS_TRACE (default: build it under build/ws_trace/)")
    args = ap.parse_args(argv)
    if args.summarize is not None:
        try:
            s = summarize(np.load(args.summarize))
        except (OSError, ValueError) as e:
            print(f"ws_trace: {args.summarize}: {e}", file=sys.stderr)
            return 2
        print(json.dumps(s, indent=1) if args.json else format_summary(s))
        return 0
    try:
        configs = [parse_config(c) for c in args.configs.split(";") if c.strip()]
    except ConfigError as e:
        print(f"ws_trace: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from w4pack.native import cuda as w4cuda

    reason = w4cuda.unavailable_reason()
    if reason:
        print(f"ws_trace: {reason}", file=sys.stderr)
        return 2
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        print("ws_trace: wgmma_ws needs a device of compute capability 9.0", file=sys.stderr)
        return 2
    return run(configs, args.save, args.json, args.library)


if __name__ == "__main__":
    sys.exit(main())
