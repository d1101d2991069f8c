#!/usr/bin/env python3
"""Speedup plot and KERNELS.md table from the JSON lines that `tools/bench_gpu.py --json` writes.

Every kernel is drawn as its speedup over the faster of the two cuBLAS fp16 layouts measured in the same run
(the bench's baseline), against M on a log axis, one panel per weight shape. Peers missing from a run
(gemlite without its wheel, Marlin where no build is importable) are simply absent from their panels.

Usage: python tools/plot_bench.py RESULTS.jsonl [--png OUT.png] [--markdown]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable

# JSON key of each kernel's time per call (µs), in legend order; cuBLAS is the baseline, not a line
KERNELS = [("w4pack", "w4pack_us"), ("Marlin", "marlin_us"), ("tinygemm (torch int4)", "tinygemm_us"),
           ("gemlite", "gemlite_us")]


class BenchDataError(ValueError):
    """The JSON lines hold nothing a plot or table can be made of."""


def read_records(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The last run's header (or {}) and its gemm records; the last record wins for a repeated (K, N, M).

    bench_gpu.py appends to its file, so a run header starts a new run and drops what came before it.
    """
    head: dict[str, Any] = {}
    rows: dict[tuple[int, int, int], dict[str, Any]] = {}
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchDataError(f"{path}:{no}: not a JSON line ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise BenchDataError(f"{path}:{no}: a JSON {type(rec).__name__}, not a record (an object)")
        if rec.get("kind") == "run":
            head, rows = rec, {}
        elif rec.get("kind") == "gemm":
            try:
                rec = {**rec, "K": int(rec["K"]), "N": int(rec["N"]), "M": int(rec["M"])}
                rows[(rec["K"], rec["N"], rec["M"])] = rec
            except (KeyError, TypeError, ValueError):
                raise BenchDataError(f"{path}:{no}: gemm record without integer K, N and M") from None
    if not rows:
        raise BenchDataError(f"{path}: no gemm records (write them with tools/bench_gpu.py --json {path})")
    return head, [rows[k] for k in sorted(rows)]


def baseline_us(rec: dict[str, Any]) -> float | None:
    """The faster cuBLAS fp16 layout of the record, or None where neither was measured."""
    ts = [t for t in (rec.get("cublas_mm_us"), rec.get("cublas_linear_us")) if _valid(t)]
    return min(ts) if ts else None


def speedup(rec: dict[str, Any], key: str) -> float | None:
    base, t = baseline_us(rec), rec.get(key)
    return base / t if base is not None and _valid(t) else None


def _valid(t: Any) -> bool:
    return isinstance(t, (int, float)) and math.isfinite(t) and t > 0


def by_shape(rows: Iterable[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["K"], r["N"]), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r["M"])
    return out


def plot(head: dict[str, Any], rows: list[dict[str, Any]], png: Path) -> None:
    """One panel per shape; needs matplotlib (`pip install 'w4pack[bench]'`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = by_shape(rows)
    cols = min(3, len(shapes))
    nrows = math.ceil(len(shapes) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False, sharey=True)
    for ax, ((k, n), recs) in zip(axes.flat, shapes.items()):
        for label, key in KERNELS:
            pts = [(r["M"], s) for r in recs if (s := speedup(r, key)) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=label)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--", label="cuBLAS fp16")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{k}×{n} (K×N)", fontsize=10)
        ax.set_xlabel("M (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("speedup over cuBLAS fp16")
    for ax in list(axes.flat)[len(shapes):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    title = " · ".join(str(head[k]) for k in ("gpu", "date") if head.get(k))
    fig.suptitle(title or "w4pack GEMM against cuBLAS fp16", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def markdown(head: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The KERNELS.md table: w4pack's speedup per shape and M, the µs at M = 1, and the best peer per cell."""
    shapes = by_shape(rows)
    ms = sorted({r["M"] for r in rows})
    out = []
    if head:
        out.append(f"{head.get('gpu', '?')}, {head.get('date', '?')}, `{head.get('command', 'tools/bench_gpu.py')}`")
        out.append("")
    out.append("| shape (K×N) | " + " | ".join(f"M = {m}" for m in ms) + " |")
    out.append("|---|" + "---|" * len(ms))
    for (k, n), recs in shapes.items():
        at = {r["M"]: r for r in recs}
        cells = []
        for m in ms:
            r = at.get(m)
            s = speedup(r, "w4pack_us") if r else None
            if s is None:
                cells.append("")
                continue
            peers = [(speedup(r, key), label) for label, key in KERNELS[1:]]
            peers = [p for p in peers if p[0] is not None]
            cell = f"{s:.2f}x"
            if m == 1:
                cell += f" ({r['w4pack_us']:.1f} µs)"
            if peers:
                ps, pl = max(peers)
                cell += f" ({pl.split(' ')[0]} {ps:.2f}x)"
            cells.append(cell)
        out.append(f"| {k}×{n} | " + " | ".join(cells) + " |")
    geo = []
    for m in ms:
        ss = [s for recs in shapes.values() for r in recs if r["M"] == m and (s := speedup(r, "w4pack_us"))]
        geo.append(f"{math.exp(sum(map(math.log, ss)) / len(ss)):.2f}x" if ss else "")
    out.append("| geo-mean | " + " | ".join(geo) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="JSON lines from tools/bench_gpu.py --json")
    ap.add_argument("--png", type=Path, default=None, help="write the speedup plot here")
    ap.add_argument("--markdown", action="store_true", help="print the KERNELS.md table")
    a = ap.parse_args(argv)
    try:
        head, rows = read_records(a.results)
    except (OSError, BenchDataError) as exc:
        print(f"plot_bench: error: {exc}", file=sys.stderr)
        return 2
    if a.png:
        try:
            plot(head, rows, a.png)
        except ImportError:
            print("plot_bench: error: the plot needs matplotlib: pip install 'w4pack[bench]'", file=sys.stderr)
            return 3
        print(f"wrote {a.png}")
    if a.markdown or not a.png:
        print(markdown(head, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
