#!/usr/bin/env python3
"""End-to-end CPU decode, side by side: w4pack's lean loop (exact and fast), transformers' own generate over the
same packed model, the float model (every packed layer dequantized into nn.Linear), and llama.cpp (through
llama-cpp-python) on the GGUF that w4pack writes from the same packed folder. Same prompt, same number of new
tokens (greedy, end-of-text ignored), same thread count.

Each engine's figure is the median over --reps runs, the runs taken in turn (engine A, B, C, A, B, C, ...) so a
machine whose load changes hurts every engine alike. Per run: decode tokens/s = (new tokens - 1) / time from the
first new token to the last, and ms/step = the median interval between consecutive tokens. llama.cpp is skipped
with the reason when ``llama_cpp`` cannot be imported (pip install llama-cpp-python: a long source build).

    python tools/bench_cpu_decode.py                              # SmolLM2-135M (tools/get_smollm2.py), 2 threads
    python tools/bench_cpu_decode.py --model out/packed --threads 1 --tokens 32 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

# as `w4pack run` does: torch's spinning threads hurt. llama.cpp runs in a child process without it: ggml's own
# OpenMP barriers slept under PASSIVE and it decoded at half its speed (49 against 100 tok/s on SmolLM2)
# (set in main(), never in the child, which imports this module too)
_OUR_OMP_POLICY = "OMP_WAIT_POLICY" not in os.environ

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def smollm2_packed(cache: Path) -> Path:
    """The demo's model: SmolLM2-135M's GGUF converted with `w4pack convert` (kept under ``cache``)."""
    from get_smollm2 import smollm2_gguf

    from w4pack.convert import convert

    out = cache / "smollm2-w4"
    if not (out / "w4pack.json").is_file():
        convert(smollm2_gguf(), out)
    return out


class _Clock:
    """A streamer that timestamps every new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.first = True

    def put(self, value: Any) -> None:
        if self.first:
            self.first = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _figures(times: list[float]) -> dict[str, float]:
    steps = [b - a for a, b in zip(times, times[1:])]
    return {"tokens_per_s": (len(times) - 1) / (times[-1] - times[0]),
            "ms_per_step": statistics.median(steps) * 1e3, "new_tokens": len(times)}


def transformers_runner(model: Any, ids: Any, tokens: int) -> Callable[[], dict[str, float]]:
    import torch

    kw = dict(max_new_tokens=tokens, do_sample=False, temperature=None, top_p=None,
              top_k=None, eos_token_id=-1, pad_token_id=0)

    def run() -> dict[str, float]:
        clock = _Clock()
        with torch.inference_mode():
            model.generate(ids, streamer=clock, **kw)
        return _figures(clock.times)

    return run


def llama_cpp_runner(gguf: Path, prompt: str, tokens: int, threads: int,
                     extra_bufts: bool) -> Callable[[], dict[str, float]]:
    """llama.cpp in a child process of its own (the environment the user gave, not this process's OpenMP
    policy), kept alive across runs; each run() asks it for one decode and reads back its figures."""
    import subprocess

    env = dict(os.environ)
    if _OUR_OMP_POLICY:
        env.pop("OMP_WAIT_POLICY", None)
    argv = [sys.executable, str(Path(__file__).resolve()), "--llama-child", str(gguf), "--threads", str(threads),
            "--tokens", str(tokens), "--prompt", prompt] + (["--llama-extra-bufts"] if extra_bufts else [])
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run() -> dict[str, float]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("run\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp child process exited ({child.wait()})")
        return json.loads(line)

    return run


def llama_child(gguf: Path, prompt: str, tokens: int, threads: int, extra_bufts: bool) -> int:
    """The child side: load the GGUF once, then one greedy decode per "run" line on stdin, figures on stdout."""
    import numpy as np
    import llama_cpp
    import llama_cpp.llama as llama_mod
    from llama_cpp import Llama

    if not extra_bufts:
        # llama.cpp's extra CPU buffer types include the AMX matmul, which crashes (SIGSEGV in
        # ggml_backend_amx_mul_mat) on VMs that report AMX; Llama() exposes no switch, so patch its defaults
        base = llama_cpp.llama_model_default_params

        def params() -> Any:
            p = base()
            p.use_extra_bufts = False
            return p

        llama_mod.llama_cpp.llama_model_default_params = params

    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, n_batch=512,
                logits_all=False, verbose=False)
    prompt_ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False)
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        llm.reset()
        llm.eval(prompt_ids)
        times = []
        for _ in range(tokens):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # greedy, end-of-text ignored
            times.append(time.perf_counter())
            llm.eval([tok])
        print(json.dumps(_figures(times)), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="packed w4pack folder (default: SmolLM2-135M, fetched and converted)")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache" / "bench_cpu_decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--engines", default="lean-exact,lean-fast,transformers-exact,transformers-fast,float,llama.cpp")
    ap.add_argument("--llama-extra-bufts", action="store_true",
                    help="let llama.cpp use its extra CPU buffer types (AMX, weight repacking); off by default "
                         "because its AMX path crashes on VMs that report AMX")
    ap.add_argument("--json", type=Path, help="write the table and every run here")
    ap.add_argument("--llama-child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.reps < 1:
        ap.error("--tokens must be at least 2 (a rate needs two tokens) and --reps at least 1")
    if args.llama_child:
        return llama_child(args.llama_child, args.prompt, args.tokens, args.threads, args.llama_extra_bufts)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch

    from w4pack.loading import load_model
    from w4pack.runtime.decode import decode_mode
    from w4pack.runtime.loading import load_tokenizer
    from w4pack.runtime.run import dequantized_model

    args.cache.mkdir(parents=True, exist_ok=True)
    packed = args.model or smollm2_packed(args.cache)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(packed)
    ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    runners: dict[str, Callable[[], dict[str, float]]] = {}
    notes: dict[str, str] = {}
    for name in wanted:
        if name.startswith(("lean-", "transformers-")):
            engine, precision = name.split("-", 1)
            model = load_model(packed, precision=precision, threads=args.threads,
                               compile=None if engine == "lean" else False)
            mode = decode_mode(model)
            if (engine == "lean") != (mode == "lean"):
                notes[name] = f"decode mode is {mode!r}"
            runners[name] = transformers_runner(model, ids, args.tokens)
        elif name == "float":
            model = dequantized_model(load_model(packed, threads=args.threads, compile=False))
            runners[name] = transformers_runner(model, ids, args.tokens)
        elif name == "llama.cpp":
            try:
                import llama_cpp  # noqa: F401
            except ImportError as exc:
                notes[name] = f"skipped: llama_cpp is not importable ({exc}); pip install llama-cpp-python"
                continue
            gguf = args.cache / f"{Path(packed).name}.gguf"
            src = Path(packed) / "w4pack.json"
            if not gguf.is_file() or gguf.stat().st_mtime < src.stat().st_mtime:
                from w4pack.convert import convert

                convert(packed, gguf, to="gguf")
            runners[name] = llama_cpp_runner(gguf, args.prompt, args.tokens, args.threads, args.llama_extra_bufts)
            if not args.llama_extra_bufts:
                notes[name] = "extra buffer types (AMX, repack) off"
        else:
            ap.error(f"unknown engine {name!r}")
    for run in runners.values():  # warm-up: first-touch of weights and caches
        run()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(args.reps):
        for name, run in runners.items():
            runs[name].append(run())
    table = []
    for name in wanted:
        if name not in runs:
            table.append({"engine": name, "note": notes.get(name, "")})
            continue
        r = runs[name]
        table.append({"engine": name, "tokens_per_s": statistics.median(x["tokens_per_s"] for x in r),
                      "ms_per_step": statistics.median(x["ms_per_step"] for x in r),
                      "new_tokens": r[0]["new_tokens"], "note": notes.get(name, "")})
    print(f"model {packed}, {args.threads} threads, {args.tokens} new tokens, prompt {ids.shape[1]} tokens, "
          f"median of {args.reps} runs taken in turn")
    print(f"{'engine':22s} {'tok/s':>8s} {'ms/step':>8s}  note")
    for row in table:
        if "tokens_per_s" in row:
            print(f"{row['engine']:22s} {row['tokens_per_s']:8.1f} {row['ms_per_step']:8.2f}  {row['note']}")
        else:
            print(f"{row['engine']:22s} {'-':>8s} {'-':>8s}  {row['note']}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(packed), "threads": args.threads, "tokens": args.tokens,
                                         "prompt": args.prompt, "table": table, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
