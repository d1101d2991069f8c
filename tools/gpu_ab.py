#!/usr/bin/env python3
"""A/B of CUDA library builds on one GPU: ``tools/bench_gpu.py`` run once per library and round, the libraries in
rotated order each round, then one table of the w4pack medians side by side with cuBLAS fp16.

Why a driver: a build option or a branch changes ``libw4p_cuda.so`` only, and the library is loaded once per
process, so each build runs in its own process with its copy installed at ``w4pack/_lib``. Rotating the order
keeps the GPU's drift between calls (clocks, temperature) out of the comparison; every round of every library
is printed, so the spread is visible beside the difference.

    W4P_CUDA_DEFINES=-DW4P_GV_STAGES=3 W4P_CUDA_OUT=$PWD/ab/s3/libw4p_cuda.so bash native/cuda/build.sh
    python tools/gpu_ab.py main=ab/main/libw4p_cuda.so s3=ab/s3/libw4p_cuda.so --rounds 3 -- --ms 1 --no-gemlite

The library installed before the run is put back afterwards (none stays where none was). ``--json OUT`` keeps
every record, tagged with ``lib`` and ``round``.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBDIR = ROOT / "w4pack" / "_lib"
LIB = LIBDIR / "libw4p_cuda.so"


def parse_libs(specs: list[str]) -> dict[str, Path]:
    libs: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"gpu_ab: {spec!r}: write each library as NAME=PATH")
        if name in libs:
            raise SystemExit(f"gpu_ab: {name!r} is named twice")
        p = Path(path)
        if not p.is_file():
            raise SystemExit(f"gpu_ab: {p}: no such library")
        libs[name] = p
    if len(libs) < 2:
        raise SystemExit("gpu_ab: name at least two libraries to compare")
    return libs


def run_one(lib: Path, bench_args: list[str], timeout: float) -> list[dict]:
    """One bench process (``lib`` is installed at LIB by the caller); its JSON records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.jsonl"
        cmd = [sys.executable, str(ROOT / "tools" / "bench_gpu.py"), *bench_args, "--json", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"gpu_ab: bench_gpu.py failed with {lib} (exit {proc.returncode})")
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def table(records: list[dict], names: list[str]) -> str:
    """Markdown: per shape and M, each library's rounds and median, cuBLAS's median; the geo-mean speedups."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    for r in records:
        if r.get("kind") != "gemm":
            continue
        key = (r["K"], r["N"], r["M"])
        c = cells.setdefault(key, {})
        c.setdefault(r["lib"], []).append(r["w4pack_us"])
        c.setdefault("cublas", []).append(min(r["cublas_mm_us"], r["cublas_linear_us"]))
    head = "| K×N, M | " + " | ".join(names) + " | cuBLAS | " + " | ".join(f"{n}/{names[0]}" for n in names[1:]) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    logs: dict[str, list[float]] = {n: [] for n in names}
    for (k, n, m), c in sorted(cells.items(), key=lambda kv: (kv[0][2], kv[0][0] * kv[0][1], kv[0][0])):
        cub = statistics.median(c["cublas"])
        meds = {}
        row = [f"{k}×{n}, {m}"]
        for name in names:
            ts = c.get(name, [])
            if not ts:
                row.append("—")
                continue
            meds[name] = statistics.median(ts)
            logs[name].append(math.log(cub / meds[name]))
            row.append(" / ".join(f"{t:.1f}" for t in ts) + f" (**{meds[name]:.1f}**)")
        row.append(f"{cub:.1f}")
        base = meds.get(names[0])
        row += [f"{meds[n] / base:.3f}" if base and n in meds else "—" for n in names[1:]]
        lines.append("| " + " | ".join(row) + " |")
    geo = ", ".join(f"{n} {math.exp(statistics.mean(v)):.3f}x" for n, v in logs.items() if v)
    lines.append("")
    lines.append(f"geo-mean speedup over cuBLAS fp16 (medians): {geo}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Arguments after -- go to tools/bench_gpu.py (e.g. --ms 1 --no-gemlite).")
    ap.add_argument("libs", nargs="+", help="NAME=PATH of each libw4p_cuda.so; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; library order rotated each round")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed one bench process")
    ap.add_argument("--json", type=Path, default=None, help="write every record here, tagged lib and round")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    libs = parse_libs(args.libs)
    names = list(libs)
    saved = None
    if LIB.exists():
        saved = Path(tempfile.mkdtemp()) / LIB.name
        shutil.copyfile(LIB, saved)
    LIBDIR.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    try:
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                shutil.copyfile(libs[name], LIB)
                recs = run_one(libs[name], bench_args, args.timeout)
                for r in recs:
                    r["lib"], r["round"] = name, rnd + 1
                records += recs
                print(f"round {rnd + 1}: {name} done ({sum(r.get('kind') == 'gemm' for r in recs)} points)",
                      flush=True)
    finally:
        if saved is not None:
            shutil.copyfile(saved, LIB)
        else:  # none was installed: none stays
            LIB.unlink(missing_ok=True)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in records))
    gpu = next((r.get("gpu") for r in records if r.get("kind") == "run"), "?")
    print(f"GPU {gpu}; {args.rounds} rounds, order rotated; bench_gpu.py {' '.join(bench_args)}")
    print(table(records, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
