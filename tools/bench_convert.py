"""Conversion benchmark: a 7B-shaped GPTQ checkpoint → w4pack, against a plain copy of the same bytes.

Generates Llama-2-7B-shaped GPTQ checkpoints (kept with --keep, else deleted at the end) with 2 and 32 decoder
layers: 4-bit, group 128, symmetric v1 zeros, random codes and scales, fp16 embeddings / norms / lm_head passed
through, sharded at 2 GB with an index like real ones. Then it times, several runs each, medians:

* a plain copy of the source folder (shutil.copy2 = in-kernel copy on Linux, plus fsync of every file,
  as convert fsyncs its output), page cache warm; and cold when ``drop_caches`` is writable;
* ``w4pack convert`` GPTQ→w4pack in a child process: wall time, GB of source per second, ratio to the
  copy, and the child's peak RSS (``os.wait4`` rusage, i.e. RUSAGE_CHILDREN of that one child).

Copy and convert runs alternate, so on a shared machine both see the same background load.

Usage::

    python tools/bench_convert.py                       # 2 and 32 layers, act-order off, 3 runs
    python tools/bench_convert.py --act-order --runs 5 --layers 2
    python tools/bench_convert.py --work /tmp/bench --keep   # keep the generated sources
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

HIDDEN, INTER, VOCAB, GROUP, BITS = 4096, 11008, 32000, 128, 4
#: (module, N = out_features, K = in_features) of one Llama decoder layer
PROJ = [("self_attn.q_proj", HIDDEN, HIDDEN), ("self_attn.k_proj", HIDDEN, HIDDEN),
        ("self_attn.v_proj", HIDDEN, HIDDEN), ("self_attn.o_proj", HIDDEN, HIDDEN),
        ("mlp.gate_proj", INTER, HIDDEN), ("mlp.up_proj", INTER, HIDDEN), ("mlp.down_proj", HIDDEN, INTER)]
SHARD = 2 * 1000**3
ROOT = Path(__file__).resolve().parent.parent


def _tensors(layers: int, act_order: bool) -> Iterator[tuple[str, str, tuple[int, ...], Any]]:
    """(name, safetensors dtype, shape, maker(rng) -> bytes-like) in checkpoint order."""
    def rand_words(shape: tuple[int, ...]) -> Any:
        return lambda rng: rng.bytes(int(np.prod(shape)) * 4)

    def fp16(shape: tuple[int, ...], lo: float, hi: float) -> Any:
        return lambda rng: rng.uniform(lo, hi, size=shape).astype("<f2")

    yield "model.embed_tokens.weight", "F16", (VOCAB, HIDDEN), fp16((VOCAB, HIDDEN), -0.05, 0.05)
    for i in range(layers):
        pre = f"model.layers.{i}"
        for mod, n, k in PROJ:
            g = k // GROUP
            name = f"{pre}.{mod}"
            yield f"{name}.qweight", "I32", (k * BITS // 32, n), rand_words((k * BITS // 32, n))
            # v1 symmetric: every zero field holds 2**(b-1) - 1 = 7
            yield f"{name}.qzeros", "I32", (g, n * BITS // 32), \
                (lambda gg, nn: lambda rng: np.full((gg, nn * BITS // 32), 0x77777777, "<u4"))(g, n)
            yield f"{name}.scales", "F16", (g, n), fp16((g, n), 1e-3, 2e-2)

            def gidx(rng: Any, k: int = k) -> np.ndarray:
                base = (np.arange(k) // GROUP).astype("<i4")
                return rng.permutation(base) if act_order else base
            yield f"{name}.g_idx", "I32", (k,), gidx
        yield f"{pre}.input_layernorm.weight", "F16", (HIDDEN,), fp16((HIDDEN,), 0.5, 1.5)
        yield f"{pre}.post_attention_layernorm.weight", "F16", (HIDDEN,), fp16((HIDDEN,), 0.5, 1.5)
    yield "model.norm.weight", "F16", (HIDDEN,), fp16((HIDDEN,), 0.5, 1.5)
    yield "lm_head.weight", "F16", (VOCAB, HIDDEN), fp16((VOCAB, HIDDEN), -0.05, 0.05)


def generate(out: Path, layers: int, act_order: bool, seed: int = 0) -> None:
    """Write the GPTQ folder tensor by tensor (memory: one tensor), atomically via a temp sibling."""
    size = {"F16": 2, "I32": 4}
    items = list(_tensors(layers, act_order))
    shards: list[list[tuple[str, str, tuple[int, ...], Any]]] = [[]]
    acc = 0
    for it in items:
        nb = int(np.prod(it[2])) * size[it[1]]
        if shards[-1] and acc + nb > SHARD:
            shards.append([])
            acc = 0
        shards[-1].append(it)
        acc += nb
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for si, items in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, dt, shape, _m in items:
            nb = int(np.prod(shape)) * size[dt]
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fname
        total += off
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(tmp / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for _n, _dt, _s, make in items:
                data = make(rng)
                fh.write(data if isinstance(data, (bytes, bytearray)) else
                         memoryview(np.ascontiguousarray(data)).cast("B"))
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    qc = {"bits": BITS, "group_size": GROUP, "desc_act": act_order, "sym": True, "quant_method": "gptq",
          "checkpoint_format": "gptq", "true_sequential": True}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_attention_heads": 32, "num_key_value_heads": 32,
              "num_hidden_layers": layers, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
              "quantization_config": qc}
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "quantize_config.json").write_text(json.dumps(qc, indent=1))
    os.replace(tmp, out)


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def warm(p: Path) -> None:
    """Read every file once so the page cache holds the source (the 'warm' condition)."""
    for f in sorted(p.iterdir()):
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


def plain_copy(src: Path, dst: Path) -> float:
    """shutil copy of the folder plus fsync of every file (convert's output is durable too); seconds."""
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    dt = time.perf_counter() - t0
    shutil.rmtree(dst)
    return dt


def run_convert(src: Path, dst: Path, tree: Path = ROOT) -> tuple[float, float]:
    """w4pack convert (of the package in ``tree``) in a child; returns (seconds, peak RSS of that child in MB)."""
    shutil.rmtree(dst, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "w4pack", "convert", str(src.absolute()), str(dst.absolute()),
                          "--force"], cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _pid, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    err = p.stderr.read().decode() if p.stderr else ""
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"convert failed ({p.returncode}): {err.strip()}")
    shutil.rmtree(dst)
    return dt, ru.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench_convert")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    ap.add_argument("--act-order", action="store_true", help="g_idx a random permutation of the groups")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="also time with the page cache dropped (root only)")
    ap.add_argument("--keep", action="store_true", help="keep the generated sources (default: delete at the end)")
    ap.add_argument("--no-copy", action="store_true", help="skip the plain-copy baseline")
    ap.add_argument("--tree", type=Path, default=ROOT,
                    help="run the w4pack package of this source tree (e.g. an older `git archive`), for before/after")
    args = ap.parse_args()
    args.work = args.work.absolute()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    rss: dict[int, float] = {}
    for layers in args.layers:
        src = args.work / f"llama7b-gptq-{layers}L{'-act' if args.act_order else ''}"
        if not src.exists():
            t0 = time.perf_counter()
            # in a child of its own: the convert children are forked from this process, and a child's peak RSS
            # counts what it inherits, so this process must not grow by the generator's memory
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                pool.apply(generate, (src, layers, args.act_order))
            print(f"generated {src} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        gb = folder_bytes(src) / 1e9
        dst_copy, dst_conv = args.work / "copy-out", args.work / "conv-out"
        copy, conv = [], []
        for _ in range(args.runs):  # alternate, so that both see the same load on a shared machine
            warm(src)
            if not args.no_copy:
                copy.append(plain_copy(src, dst_copy))
            conv.append(run_convert(src, dst_conv, args.tree))
        c_med = statistics.median(copy) if copy else float("nan")
        v_med = statistics.median(t for t, _ in conv)
        peak = max(r for _, r in conv)
        rss[layers] = peak
        row = {"layers": layers, "act_order": args.act_order, "gb": gb, "copy_s": c_med, "copy_gbs": gb / c_med,
               "convert_s": v_med, "convert_gbs": gb / v_med, "ratio": c_med / v_med, "peak_rss_mb": peak,
               "convert_runs": [round(t, 2) for t, _ in conv], "copy_runs": [round(t, 2) for t in copy]}
        if args.cold:
            if drop_caches():
                row["copy_cold_s"] = plain_copy(src, dst_copy)
                drop_caches()
                row["convert_cold_s"] = run_convert(src, dst_conv, args.tree)[0]
            else:
                row["cold"] = "drop_caches not writable"
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(f"\n7B-shaped GPTQ -> w4pack, {'act-order' if args.act_order else 'no act-order'}, "
          f"median of {args.runs} runs, page cache warm")
    print("| layers | source GB | copy s | copy GB/s | convert s | convert GB/s | convert/copy | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['gb']:.2f} | {r['copy_s']:.2f} | {r['copy_gbs']:.2f} | {r['convert_s']:.2f} | "
              f"{r['convert_gbs']:.2f} | {r['ratio'] * 100:.0f}% | {r['peak_rss_mb']:.0f} |")
        if "copy_cold_s" in r:
            print(f"|   cold | | {r['copy_cold_s']:.2f} | {r['gb'] / r['copy_cold_s']:.2f} | {r['convert_cold_s']:.2f} |"
                  f" {r['gb'] / r['convert_cold_s']:.2f} | {r['copy_cold_s'] / r['convert_cold_s'] * 100:.0f}% | |")
    if len(rss) >= 2:
        lo, hi = min(rss), max(rss)
        print(f"\npeak RSS {hi}L / {lo}L = {rss[hi] / rss[lo]:.3f}")
    if not args.keep:
        for layers in args.layers:
            shutil.rmtree(args.work / f"llama7b-gptq-{layers}L{'-act' if args.act_order else ''}", ignore_errors=True)


if __name__ == "__main__":
    main()
