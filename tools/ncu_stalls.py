#!/usr/bin/env python3
"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

A kernel's ncu summary says how often warps stall and why; this says on which instructions. It reads the CSV
that ncu writes for the source page of a report taken with the source counters, e.g. (on the GPU machine):

    W4P_CUDA_WS_RS=2 ncu --clock-control none -k regex:wgmma_ws -s 2 -c 1 --section SourceCounters \\
        --import-source no -o ws python tools/profile_gpu.py --shape 8192x28672 --m 1024 --kernel wgmma_ws
    ncu --import ws.ncu-rep --page source --print-source sass --csv > ws_sass.csv

and prints the instructions holding the most warp samples, with their three leading stall reasons, and the
share of samples per opcode (docs/journal/2026-cuda.md section 7 quotes such tables). Needs no GPU.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


class SourcePageError(ValueError):
    """The file is not an ncu source-page CSV with warp stall samples."""


def read_source_page(path: Path) -> tuple[str, list[dict[str, str]]]:
    """The kernel's name and one dict per SASS instruction (ncu writes a kernel line, then a header)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise SourcePageError(f"cannot read it: {e.strerror or e}") from e
    except (UnicodeDecodeError, csv.Error) as e:
        raise SourcePageError(f"not a CSV file ({e})") from e
    head = next((i for i, r in enumerate(rows) if SAMPLES in r and "Source" in r), None)
    if head is None:
        raise SourcePageError(f"no '{SAMPLES}' column: export the source page of a report taken with "
                              "--section SourceCounters (ncu --import R --page source --print-source sass --csv)")
    kernel = next((r[1] for r in rows[:head] if len(r) > 1 and r[0] == "Kernel Name"), "?")
    names = rows[head]
    return kernel, [dict(zip(names, r)) for r in rows[head + 1:] if len(r) == len(names)]


def _int(v: str | None) -> int:
    try:
        return int(str(v).replace(",", ""))
    except ValueError:
        return 0


def opcode(source: str) -> str:
    """'@!P0 BRA 0x...' -> 'BRA'; 'HGMMA.64x128x16.F32 ...' -> 'HGMMA'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarize(instrs: list[dict[str, str]], top: int) -> dict:
    reasons = [k for k in (instrs[0] if instrs else {}) if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_int(i.get(SAMPLES)) for i in instrs)
    if total == 0:
        raise SourcePageError("no warp samples in it (was the report taken with --section SourceCounters?)")
    ranked = sorted(instrs, key=lambda i: -_int(i.get(SAMPLES)))[:top]
    lines = []
    for i in ranked:
        why = sorted(((_int(i.get(r)), r[len("stall_"):]) for r in reasons), reverse=True)[:3]
        lines.append({"address": i.get("Address", ""), "sass": " ".join(i.get("Source", "").split()),
                      "share": _int(i.get(SAMPLES)) / total, "executed": _int(i.get(EXECUTED)),
                      "reasons": {name: n for n, name in why if n}})
    by_op: dict[str, int] = {}
    for i in instrs:
        op = opcode(i.get("Source", ""))
        by_op[op] = by_op.get(op, 0) + _int(i.get(SAMPLES))
    ops = sorted(((n / total, op) for op, n in by_op.items() if n), reverse=True)
    return {"samples": total, "top": lines, "opcodes": [{"opcode": op, "share": s} for s, op in ops]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--top", type=int, default=20, help="instructions to list (default 20)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = ap.parse_args(argv)
    try:
        kernel, instrs = read_source_page(args.csv)
        s = summarize(instrs, max(args.top, 0))
    except SourcePageError as e:
        print(f"ncu_stalls: {args.csv}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"kernel": kernel, **s}))
        return 0
    print(f"{kernel}\n{s['samples']} warp samples\n")
    print("| share | address | SASS | executed | leading stall reasons (samples) |")
    print("|---|---|---|---|---|")
    for t in s["top"]:
        why = ", ".join(f"{k} {v}" for k, v in t["reasons"].items())
        print(f"| {100 * t['share']:.1f}% | {t['address'][-6:]} | `{t['sass'][:70]}` | {t['executed']} | {why} |")
    print("\n| opcode | share of samples |\n|---|---|")
    for o in s["opcodes"]:
        if o["share"] >= 0.005:
            print(f"| {o['opcode']} | {100 * o['share']:.1f}% |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader left early (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
