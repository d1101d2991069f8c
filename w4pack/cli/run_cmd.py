"""w4pack run: generate from a prompt, or measure perplexity over a text file, with the native kernels."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Iterator

import click

# torch's OpenMP threads spin after each op by default; between our kernels' own thread pool and those spinning
# threads a small machine runs decode several times slower (measured 2-4x on 2 cores). Passive waiting fixes it;
# it only takes effect when set before torch loads, which is the case here (torch is imported by run()).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import emit_json, plural, require_packed
from .extras import needs_extras


#: options that only one mode reads: given to the other, they would be dropped without a word
_GENERATE_ONLY = ("max_new_tokens", "temperature", "seed", "chat", "eager", "engine")
_PERPLEXITY_ONLY = ("window",)


def _refuse_other_mode(ctx: click.Context, *, perplexity: bool) -> None:
    """A usage error naming the options given on the command line that the chosen mode ignores."""
    from ..errors import BadInputError

    unused = _GENERATE_ONLY if perplexity else _PERPLEXITY_ONLY
    given = [p for p in ctx.command.params if p.name in unused
             and ctx.get_parameter_source(p.name) not in (None, click.core.ParameterSource.DEFAULT)]
    if given:
        opts = ", ".join(p.opts[0] for p in given)
        mode, other = ("--perplexity", "generation (--prompt)") if perplexity else ("--prompt", "--perplexity")
        raise BadInputError(f"{opts} {'applies' if len(given) == 1 else 'apply'} to {other} only, not {mode}")


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Text to continue (or to answer, with --chat).")
@click.option("--perplexity", "ppl_file", type=click.Path(path_type=Path), default=None,
              help="Measure perplexity over this UTF-8 text file instead of generating.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1, 1 << 16),
              help="Most tokens to generate (fewer when the model ends the text).")
@click.option("--precision", type=click.Choice(["exact", "fast"]), default="exact", show_default=True,
              help="CPU kernel path: exact (fp32 dequantize) or fast (int8 activations: ~0.6% relative error per "
                   "layer, more with outlier channels; docs/CPU.md).")
@click.option("--dtype", default=None, help="Activation dtype: float32, float16, bfloat16 (default: float32 on "
                                            "CPU; on CUDA bfloat16 when config.json's dtype or torch_dtype is "
                                            "bfloat16, else float16).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0, None),
              help="0 is greedy; above 0 samples.")
@click.option("--seed", default=None, type=int, help="Seed for sampling (repeatable output).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--threads", default=None, type=click.IntRange(1, 1024),
              help="CPU kernel threads (default: $W4PACK_THREADS, else every core the process may use).")
@click.option("--window", default=None, type=click.IntRange(2, 1 << 20),
              help="Perplexity window in tokens (default: model context, at most 1024).")
@click.option("--eager", is_flag=True,
              help="Decode with transformers' own eager generate instead of w4pack's lean decode loop and, on "
                   "CUDA, transformers' compiled step (both spend tens of seconds compiling on their first CUDA "
                   "run). $W4PACK_LEAN=0 and $W4PACK_COMPILE=0 drop one of the two.")
@click.option("--engine", type=click.Choice(["auto", "lean", "compiled", "eager"]), default="auto",
              show_default=True,
              help="How generate decodes: auto (w4pack's lean loop where it runs: llama-family models, batch 1, "
                   "on CUDA one CUDA graph per token; other calls: on CUDA transformers' compiled step, on the "
                   "CPU its eager generate), lean (the lean loop alone), compiled or eager (transformers').")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@needs_extras("run", torch="hf")
def run(path: Path, prompt: str | None, ppl_file: Path | None, device: str, max_new_tokens: int, precision: str,
        dtype: str | None, temperature: float, seed: int | None, chat: bool, threads: int | None,
        window: int | None, eager: bool, engine: str, as_json: bool) -> None:
    """Load the packed checkpoint PATH and generate from --prompt, or score --perplexity FILE.

    The tokenizer comes from PATH; quantized layers run w4pack's kernels (CPU or CUDA). Reports tokens/s.
    Needs torch and transformers (pip install 'w4pack[hf]'). Sets OMP_WAIT_POLICY=PASSIVE unless already set.

    Exit 0 ok, 2 bad input or usage (one line naming the file), 3 unsupported (a model w4pack cannot build, no
    CUDA device, torch or transformers missing), 4 I/O or CUDA kernel failure, 130 interrupted.
    """
    from ..errors import BadInputError
    from ..progress import step
    from ..runtime.loading import check_device
    from ..runtime.run import generate, perplexity

    if (prompt is None) == (ppl_file is None):
        raise BadInputError("give exactly one of --prompt TEXT or --perplexity FILE")
    if eager and engine not in ("auto", "eager"):
        raise BadInputError(f"--eager contradicts --engine {engine}")
    _refuse_other_mode(click.get_current_context(), perplexity=ppl_file is not None)
    if seed is not None and temperature == 0 and prompt is not None:  # not an error: greedy output is the same
        click.echo("warning: --seed has no effect with greedy decoding (--temperature 0); give --temperature above 0 "
                   "to sample", err=True)
    require_packed(path, "run")
    device = check_device(device)  # a usage error now, not torch's RuntimeError after the model is read
    if device == "cpu":  # likewise a bad $W4PACK_ISA / $W4PACK_THREADS, before the model is read
        from ..native.cpu import check_environment

        check_environment(threads_from_env=threads is None)
    loading = functools.partial(step, f"loading {path}", None, True)  # "loading PATH ... 3s" on a terminal
    if ppl_file is not None:
        doc = perplexity(path, ppl_file, device=device, precision=precision, dtype=dtype, window=window,
                         threads=threads, loading=loading)
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"perplexity {doc['perplexity']:.4f} over {plural(doc['scored_tokens'], 'token')} "
                       f"(window {doc['window']}) on {doc['device']}, {doc['tokens_per_s']} tokens/s")
        return
    on_text = None
    started: list[bool] = []  # stdout stays empty until the model has loaded (an error leaves it empty)

    def begin() -> None:
        if not started:
            started.append(True)
            if not chat:
                click.echo(prompt, nl=False)

    @contextlib.contextmanager
    def loading_then_prompt() -> Iterator[None]:
        with loading():
            yield
        if not as_json:
            begin()
            sys.stdout.flush()

    if not as_json:  # the completion appears piece by piece (whole words) while it is generated
        def on_text(text: str) -> None:
            begin()
            click.echo(text, nl=False)
            sys.stdout.flush()

    doc = generate(path, prompt, device=device, max_new_tokens=max_new_tokens, precision=precision,
                   temperature=temperature, seed=seed, dtype=dtype, chat=chat, threads=threads,
                   compile=False if eager else None, on_text=on_text, loading=loading_then_prompt,
                   engine=engine)
    if as_json:
        emit_json(doc)
    else:
        begin()
        click.echo("")
        rate = f"{doc['tokens_per_s']} tokens/s" if doc["tokens_per_s"] is not None else "n/a tokens/s"
        mode = f"{doc['precision']}, {doc['decode']}"
        if "attention" in doc:
            mode += f", {doc['attention']} attention"
        if doc.get("folded"):
            mode += f", {doc['folded']} projections folded"
        click.echo(f"[{doc['new_tokens']} tokens on {doc['device']} ({mode}): {rate} decode, "
                   f"first token {doc['prefill_s'] * 1000:.0f} ms, load {doc['load_s']:.2f} s]", err=True)
