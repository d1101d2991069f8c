#!/usr/bin/env python3
"""Decode tokens/s of a whole model through transformers: W4Linear (native kernels) against the float model.

Shapes: ``smollm2`` (SmolLM2-135M: hidden 576, 30 layers, 9/3 heads, vocab 49152), ``llama2-7b`` (hidden 4096, 32
layers, 32 heads, intermediate 11008, vocab 32000), ``llama3-8b`` (the same with 8 kv heads for the 32, intermediate
14336, vocab 128256: grouped-query attention at 7B-class size) and ``qwen3-0.6b`` (Qwen3-0.6B: hidden 1024, 28
layers, 16/8 heads of 128 with q/k norms, intermediate 3072, vocab 151936), with random weights: the float model is
built first and timed, then every Linear except the head is swapped for a W4Linear of the same shape (random 4-bit
codes, group 128 or 32, integer zeros; one random layer per shape, copied per module so each layer reads its own
weights) and timed again with the same embeddings, norms and inputs.

Method: ``generate`` with greedy decoding, ``min_new_tokens = max_new_tokens``, prompt of ``--prompt`` random
tokens (16; longer prompts time the attention over a longer cache); the
decode rate is batch x (N - 1) / (t(N tokens) - t(1 token)), each time the median of ``--repeats`` runs after a
warm-up, so prefill is excluded. Three modes per model: transformers' ``eager`` (one Python pass per token,
every kernel launched from Python) and ``compiled`` (``cache_implementation="static"``: transformers compiles
the decode step with torch.compile, mode reduce-overhead, i.e. CUDA graphs; what ``w4pack run`` and
``load_model`` use on CUDA by default), and w4pack's ``lean`` loop (``w4pack.runtime.lean_cuda`` on CUDA: the
whole step, head and argmax included, one CUDA graph per token; ``load_model(engine="lean")``) and
``lean_fused`` (the same loop with its step compiled by Inductor before the capture, the loop's default;
``lean`` sets $W4PACK_LEAN_FUSE=0). The
lean modes run batch 1 only; other batches are skipped for them. ``auto`` is what ``load_model`` installs by
default (``w4pack.runtime.decode.use_decode``: the fused lean loop where it runs, the compiled step for the other
batches); its rows name the engine that answered. The warm-up of the compiled modes includes their compile for
each batch, the lean modes' their graph capture. The lean loop's attention follows $W4PACK_LEAN_ATTN (``matmul``,
``sdpa`` or ``kernel``) and its folding $W4PACK_LEAN_FOLD; its rows name the attention it ran (``attn``) and the
projections that folded (``folded``). ``--variants`` times such settings against each other in one process: every
installed mode once per variant, the variants in turn for ``--rounds`` rounds, so drift between calls or machines
does not enter the comparison (rows carry ``variant`` and ``round``).

    python tools/bench_run.py --device cuda --shapes llama2-7b --batches 1,16,64 \
        --modes eager,compiled,lean,lean_fused,auto
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, group_size=32),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False, group_size=128),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, group_size=128),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, group_size=128),
}


def _random_packed(n: int, k: int, group_size: int, seed: int) -> Any:
    from w4pack.canonical import CanonicalLayer
    from w4pack.layout import pack

    rng = np.random.default_rng(seed)
    g = -(-k // group_size)
    layer = CanonicalLayer(codes=rng.integers(0, 16, (n, k), dtype=np.uint8),
                           scales=(rng.random((n, g), dtype=np.float32) * 0.002 + 0.001).astype(np.float16),
                           bits=4, group_size=group_size, zero_mode="int",
                           zeros=rng.integers(6, 10, (n, g)).astype(np.int32), scale_dtype="float16")
    return pack(layer)


def build_float(shape: str, device: str, dtype: Any) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {k: v for k, v in SHAPES[shape].items() if k != "group_size"}
    cfg = AutoConfig.for_model(spec.pop("model_type", "llama"), **spec, max_position_embeddings=4096,
                               eos_token_id=None, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


def swap_to_w4(model: Any, shape: str, device: str, precision: str) -> int:
    import torch
    from torch import nn

    from w4pack.torch_module import W4Linear

    gs = SHAPES[shape]["group_size"]
    cache: dict[tuple[int, int], Any] = {}
    count = 0
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or name.endswith("lm_head"):
            continue
        key = (mod.out_features, mod.in_features)
        if key not in cache:
            cache[key] = _random_packed(*key, gs, seed=len(cache))
        w4 = W4Linear.from_packed(cache[key], device=device, precision=precision)
        w4.prepare(device, next(model.parameters()).dtype)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, w4)
        count += 1
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return count


#: modes that install w4pack's lean loop (the second with its step compiled by Inductor)
LEAN_MODES = ("lean", "lean_fused")
#: load_model's default decode path (installed on the model, as the lean modes are)
AUTO = "auto"
#: modes whose generate is installed on the model (``lean_mode``) and whose rows name the engine that answered
INSTALLED = (*LEAN_MODES, AUTO)
MODES = ("eager", "compiled", *INSTALLED)


def _extra(mode: str) -> dict[str, Any]:
    """generate's arguments for a mode (the lean loop and the default path are installed on the model instead:
    ``lean_mode``)."""
    if mode == "compiled":
        return {"cache_implementation": "static"}
    return {} if mode in INSTALLED else {"disable_compile": True}


class lean_mode:
    """``with lean_mode(model, mode):`` the model's generate is w4pack's lean loop (the lean modes) or
    ``load_model``'s default path (``auto``) while inside."""

    def __init__(self, model: Any, mode: str):
        self.model, self.on, self.fuse, self.auto = model, mode in LEAN_MODES, mode == "lean_fused", mode == AUTO

    def __enter__(self) -> "lean_mode":
        if self.auto:
            from w4pack.runtime.decode import use_decode

            use_decode(self.model, next(self.model.parameters()).device, None)
        if self.on:
            from w4pack.runtime.lean import use_lean_decode
            from w4pack.runtime.lean_cuda import FUSE_ENV

            with environment({FUSE_ENV: "1" if self.fuse else "0"}):
                got = use_lean_decode(self.model)
            if got != "lean":
                raise SystemExit(f"the lean loop does not run this model: {got}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on or self.auto:  # (remove_decode undoes either)
            import gc

            import torch

            from w4pack.runtime.decode import remove_decode

            remove_decode(self.model)
            gc.collect()  # the loop's graphs, caches and stacked weights
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def decode_rate(model: Any, batch: int, new_tokens: int, repeats: int, mode: str = "eager",
                prompt: int = 16) -> dict[str, Any]:
    import torch

    from w4pack.runtime.decode import decode_mode

    dev = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=dev)
    # the static cache of the longest run is made first; shorter runs reuse it (same shapes: no recompile)
    extra = _extra(mode)

    def timed(n: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    for n in (new_tokens, new_tokens, 1):  # warm-up: compile, record the graphs, replay
        timed(n)
    warm = time.perf_counter() - t0
    t1 = statistics.median(timed(1) for _ in range(repeats))
    tn = statistics.median(timed(new_tokens) for _ in range(repeats))
    rate = batch * (new_tokens - 1) / max(tn - t1, 1e-9)
    lean = getattr(model, "_w4pack_lean", None) if mode in INSTALLED else None
    return {"mode": mode, "decode": decode_mode(model) if mode in INSTALLED else mode,
            **({"attn": lean.attn, "folded": lean.folded} if hasattr(lean, "attn") else {}), "batch": batch,
            "prompt": prompt, "new_tokens": new_tokens, "warmup_s": round(warm, 1),
            "prefill_s": round(t1, 4), "total_s": round(tn, 4), "decode_tokens_per_s": round(rate, 1),
            "ms_per_step": round((tn - t1) / (new_tokens - 1) * 1000, 3)}


def profile_steps(model: Any, batch: int, new_tokens: int, mode: str, top: int = 15, prompt: int = 16) -> str:
    """Where a decode step's time goes: GPU kernel time per step by kernel (torch.profiler), against wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    dev = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=dev)
    extra = _extra(mode)

    def gen(n: int) -> None:
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
        torch.cuda.synchronize(dev)

    gen(new_tokens)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        gen(new_tokens)
        wall = time.perf_counter() - t0
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)]
    rows = [e for e in rows if getattr(e, "self_device_time_total", 0) > 0]
    rows.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / 1000.0
    lines = [f"{mode} batch {batch}: {new_tokens} tokens in {wall * 1000:.1f} ms wall, GPU kernels {total:.1f} ms "
             f"({total / new_tokens:.3f} ms/token)", f"{'kernel':<72} {'calls':>7} {'ms':>9} {'share':>6}"]
    for e in rows[:top]:
        ms = e.self_device_time_total / 1000.0
        lines.append(f"{e.key[:72]:<72} {e.count:>7} {ms:>9.2f} {ms / total:>6.1%}")
    return "\n".join(lines)


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    """``--variants``: ``base;VAR=VALUE,VAR=VALUE;...`` as (name, environment) pairs; "base" sets nothing."""
    out = []
    for item in (part.strip() for part in text.split(";")):
        if not item:
            continue
        env: dict[str, str] = {}
        if item != "base":
            for pair in item.split(","):
                var, sep, value = pair.partition("=")
                if not sep or not var.strip():
                    raise ValueError(f"--variants: {pair!r} is not VAR=VALUE")
                env[var.strip()] = value.strip()
        out.append((item, env))
    return out


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``with environment(env):`` the variables set (the lean loop reads its options when installed), then
    restored."""
    saved = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def table(results: list[dict[str, Any]]) -> str:
    """Medians side by side: each W4 rate against the float model's in the same mode and against compiled fp."""
    lines = [f"{'shape':<10} {'batch':>5} {'mode':<13} {'float tok/s':>12} {'w4 tok/s':>10} {'w4/float':>9} "
             f"{'w4/float compiled':>18} {'w4 ms/step':>11}"]
    for row in results:
        fl = {(r["mode"], r["batch"], r.get("variant"), r.get("round")): r for r in row["float"]}
        for r in row["w4"]:
            f = fl.get((r["mode"], r["batch"], r.get("variant"), r.get("round")))
            fc = fl.get(("compiled", r["batch"], None, None))
            ratio = f"{r['decode_tokens_per_s'] / f['decode_tokens_per_s']:.2f}x" if f else "-"
            ratio_c = f"{r['decode_tokens_per_s'] / fc['decode_tokens_per_s']:.2f}x" if fc else "-"
            mode = f"auto/{r['decode'].split()[0]}" if r["mode"] == AUTO else r["mode"]  # the engine that answered
            if r.get("attn"):
                mode += f":{r['attn']}"  # (the lean CUDA loop's attention)
            if r.get("variant"):
                mode += f" [{r['variant']}] #{r['round']}"
            lines.append(f"{row['shape']:<10} {r['batch']:>5} {mode:<13} "
                         f"{f['decode_tokens_per_s'] if f else '-':>12} {r['decode_tokens_per_s']:>10} {ratio:>9} "
                         f"{ratio_c:>18} {r['ms_per_step']:>11}")
    return "\n".join(lines)


def _batches(batches: list[int], mode: str) -> list[int]:
    """The batch sizes a mode runs: the lean loop decodes one sequence (others would time transformers)."""
    if mode not in LEAN_MODES:
        return batches
    skipped = [b for b in batches if b != 1]
    if skipped:
        print(f"lean mode: batch 1 only, skipping batches {skipped}", flush=True)
    return [b for b in batches if b == 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="smollm2,llama2-7b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--modes", default="eager,compiled,lean,lean_fused",
                    help="eager, compiled, lean, lean_fused and/or auto (comma-separated; the lean modes run batch 1 "
                         "only; auto is load_model's default)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before the timed decode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precision", default="exact", choices=["exact", "fast"])
    ap.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: after timing, profile one decode of each model at the first batch size (kernels)")
    ap.add_argument("--profile-top", type=int, default=15, help="kernels listed per profile (by GPU time)")
    ap.add_argument("--variants", default="",
                    help="environment variants of the installed modes (lean, lean_fused, auto), ';'-separated, each "
                         "'base' or VAR=VALUE[,VAR=VALUE], e.g. 'base;W4PACK_LEAN_ATTN=sdpa;W4PACK_LEAN_FOLD=0': "
                         "those modes are timed once per variant, in turn, --rounds times (an A/B in one process)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the variants in turn (with --variants)")
    args = ap.parse_args()
    try:
        variants = parse_variants(args.variants)
    except ValueError as exc:
        ap.error(str(exc))
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_run: no CUDA device (--device cpu times the CPU)", file=sys.stderr)
        return 2
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        ap.error(f"--modes takes {', '.join(MODES)}")
    if args.prompt < 1 or args.new_tokens < 2:
        ap.error("--prompt takes at least 1 token, --new-tokens at least 2")
    torch._dynamo.config.cache_size_limit = 64  # one compiled step per model, batch and mode
    results = []
    for shape in args.shapes.split(","):
        model = build_float(shape, args.device, dtype)
        row: dict[str, Any] = {"shape": shape, "device": args.device, "dtype": str(dtype), "float": [], "w4": []}
        batches = [int(x) for x in args.batches.split(",")]

        def measure(which: str) -> None:
            """Every mode and batch of the model as it is now (float, then with its layers swapped to W4)."""
            for mode in modes:
                runs = [(name, env, r + 1) for r in range(max(1, args.rounds)) for name, env in variants] \
                    if variants and mode in INSTALLED else [("", {}, 0)]
                for i, (name, env, rnd) in enumerate(runs):
                    with environment(env), lean_mode(model, mode):
                        for b in _batches(batches, mode):
                            got = decode_rate(model, b, args.new_tokens, args.repeats, mode, args.prompt)
                            row[which].append({**got, **({"variant": name, "round": rnd} if name else {})})
                            print(json.dumps({"shape": shape, "model": which, **row[which][-1]}), flush=True)
                        if args.profile and args.device.startswith("cuda") and i == len(runs) - 1:
                            first = 1 if mode in LEAN_MODES else batches[0]
                            split = profile_steps(model, first, args.new_tokens, mode, args.profile_top,
                                                  args.prompt)
                            print(f"{which} model, {split}", flush=True)

        measure("float")
        row["w4_layers"] = swap_to_w4(model, shape, args.device, args.precision)
        torch._dynamo.reset()
        measure("w4")
        results.append(row)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(table(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
