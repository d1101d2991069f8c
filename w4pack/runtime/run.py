"""Run a packed checkpoint: generate text from a prompt, or measure perplexity over a text file.

Both take a folder (loaded with ``load_model`` and the tokenizer stored beside the weights) or an already
loaded (model, tokenizer) pair, so tests and tools can reuse one model. Timings: ``prefill_s`` is the time to the
first new token, ``tokens_per_s`` the decode rate over the remaining tokens (what a user feels while reading).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

from ..errors import BadInputError
from .decode import decode_mode

__all__ = ["generate", "perplexity", "dequantized_model"]


def completion_text(tok: Any, prompt_ids: list[int], new: list[int]) -> str:
    """The text the new tokens add to the prompt's. Decoding them alone loses what joins them to the prompt: a
    SentencePiece tokenizer (Llama 2, Mistral) drops the leading space of the first token it decodes, so "w5 w6"
    continued by " w16" would read "w5 w6w16". Decoded with the prompt, the prompt's text is cut off instead."""
    head = tok.decode(prompt_ids, skip_special_tokens=True)
    full = tok.decode(prompt_ids + new, skip_special_tokens=True)
    return full[len(head):] if full.startswith(head) else tok.decode(new, skip_special_tokens=True)


class _Clock:
    """A transformers streamer that timestamps every new token (the first put() is the prompt) and, given
    ``on_text``, passes the decoded text on as it grows (word by word, as transformers' TextStreamer cuts it).
    The stream decodes prompt and completion together and drops the prompt's text, for completion_text's reason."""

    def __init__(self, tok: Any = None, on_text: Callable[[str], None] | None = None,
                 prompt_ids: list[int] | None = None) -> None:
        self.times: list[float] = []
        self._prompt_seen = False
        self._text = None
        if on_text is not None:
            from transformers import TextStreamer

            skip = [len(tok.decode(prompt_ids or [], skip_special_tokens=True))]  # prompt characters still to drop

            class _Text(TextStreamer):
                def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                    cut = min(skip[0], len(text))
                    skip[0] -= cut
                    if text[cut:]:
                        on_text(text[cut:])

            self._text = _Text(tok, skip_prompt=False, skip_special_tokens=True)

    def put(self, value: Any) -> None:
        if self._text is not None:
            self._text.put(value)
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        if self._text is not None:
            self._text.end()


#: a context manager factory shown around loading a model (the CLI's "loading PATH ... 3s" on a terminal)
Status = Callable[[], AbstractContextManager[Any]]


def _load(target: Any, device: str, precision: str, dtype: Any, threads: int | None,
          compile: bool | None = False, status: Status | None = None,
          engine: str | None = None) -> tuple[Any, Any, str]:
    if isinstance(target, (str, os.PathLike)):
        from .loading import check_listed_files, load_model, load_tokenizer

        path = str(target)
        with (status or nullcontext)():
            check_listed_files(path)  # (a tokenizer file the folder lost is named before the model loads)
            model = load_model(path, device=device, dtype=dtype, precision=precision, threads=threads,
                               compile=compile, engine=engine)
            return model, load_tokenizer(path), path
    model, tok = target
    return model, tok, str(getattr(model, "w4pack_path", "<model>"))


def _model_precision(model: Any, asked: str) -> str:
    """The CPU path the model's W4Linear modules use ("float" for a model without any)."""
    from .torch_module import W4Linear

    found = {m.precision for m in model.modules() if isinstance(m, W4Linear)}
    if not found:
        return "float"
    return found.pop() if len(found) == 1 else asked


def lean_loop_facts(model: Any) -> dict[str, Any]:
    """{"attention": how the lean CUDA loop attended, "folded": its projections that took the norms and residual
    adds into their kernels} where that loop answered the last call, else {}: the kernel gives way to matmul,
    and the fold to separate kernels, on models they do not run, and users comparing speeds need to see which."""
    from .lean import LEAN  # (torch: only where a model was loaded)

    lean = getattr(model, "_w4pack_lean", None)
    attn = getattr(lean, "attn", None)
    if not isinstance(attn, str) or decode_mode(model).split(" (")[0] != LEAN:  # ("lean (eager step: ...)" too)
        return {}
    return {"attention": attn, "folded": int(lean.folded)}


def _check_token_ids(ids: Any, model: Any, path: str) -> None:
    """Token ids past the model's embedding table mean the tokenizer belongs to another model (a different
    vocabulary): one line that says so, instead of torch's "index out of range in self" from deep in the forward."""
    emb = model.get_input_embeddings()
    rows = getattr(emb, "num_embeddings", None) or getattr(model.config, "vocab_size", None)
    if rows is None or ids.numel() == 0:
        return
    top = int(ids.max())
    if top >= int(rows):
        raise BadInputError(f"the tokenizer gives token id {top}, but the model's vocabulary has {int(rows)} tokens: "
                            "the tokenizer files belong to another model", file=path)


def generate(target: Any, prompt: str, *, device: str = "cpu", max_new_tokens: int = 32,
             precision: str = "exact", temperature: float = 0.0, seed: int | None = None, dtype: Any = None,
             chat: bool = False, threads: int | None = None, top_p: float | None = None,
             compile: bool | None = None, on_text: Callable[[str], None] | None = None,
             loading: Status | None = None, engine: str | None = None) -> dict[str, Any]:
    """Greedy (temperature 0) or sampled continuation of ``prompt``; returns text, token ids and timings.

    ``target``: a w4pack folder or a (model, tokenizer) pair. ``chat`` wraps the prompt in the tokenizer's chat
    template (instruct models). ``seed`` makes sampling repeatable. ``compile`` and ``engine`` choose how
    ``generate`` decodes, as ``load_model`` takes them: by default w4pack's lean loop (on CUDA one graph per
    token; the first call pays its compile), True transformers' compiled step alone, False its eager generate.
    ``on_text`` receives the completion piece by piece while it is generated (the CLI streams it); ``loading``
    is entered while a folder is loaded.
    """
    import torch

    if max_new_tokens < 1:
        raise BadInputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise BadInputError(f"temperature must be >= 0, got {temperature}")
    t0 = time.perf_counter()
    model, tok, path = _load(target, device, precision, dtype, threads, compile, loading, engine)
    load_s = time.perf_counter() - t0
    dev = next(model.parameters()).device
    if chat:
        if not getattr(tok, "chat_template", None):
            raise BadInputError("the tokenizer has no chat template; run without --chat", file=path)
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tok(prompt, return_tensors="pt")
    if enc["input_ids"].numel() == 0:  # an empty prompt with a tokenizer that adds no BOS
        raise BadInputError("the prompt gives no tokens: give some text to continue (--prompt)")
    _check_token_ids(enc["input_ids"], model, path)
    enc = {k: v.to(dev) for k, v in enc.items()}
    n_prompt = int(enc["input_ids"].shape[1])
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "pad_token_id": tok.pad_token_id
                              if tok.pad_token_id is not None else tok.eos_token_id}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=float(temperature), top_k=0)
        if top_p is not None:
            kwargs["top_p"] = float(top_p)
        if seed is not None:
            torch.manual_seed(seed)
            if dev.type == "cuda":
                torch.cuda.manual_seed_all(seed)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    prompt_ids = enc["input_ids"][0].tolist()
    clock = _Clock(tok, on_text, prompt_ids)
    with torch.inference_mode():
        t1 = time.perf_counter()
        out = model.generate(**enc, streamer=clock, **kwargs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
    new = out[0, n_prompt:].tolist()
    n_new = len(new)
    prefill_s = (clock.times[0] - t1) if clock.times else (t2 - t1)
    decode_s = (clock.times[-1] - clock.times[0]) if len(clock.times) > 1 else 0.0
    return {
        "path": path,
        "device": str(dev),
        "precision": _model_precision(model, precision),
        "decode": decode_mode(model),
        **lean_loop_facts(model),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "prompt": prompt,
        "chat": chat,
        "completion": completion_text(tok, prompt_ids, new),
        "prompt_tokens": n_prompt,
        "new_tokens": n_new,
        "token_ids": new,
        "sampling": {"temperature": temperature, "seed": seed} if temperature > 0 else "greedy",
        "load_s": round(load_s, 3),
        "prefill_s": round(prefill_s, 4),
        "generate_s": round(t2 - t1, 4),
        "tokens_per_s": round((n_new - 1) / decode_s, 2) if decode_s > 0 else None,
        "overall_tokens_per_s": round(n_new / (t2 - t1), 2) if t2 > t1 else None,
    }


def _context_of(folder: Path) -> int | None:
    """config.json's max_position_embeddings, or None (no such file or key: the loader says what is wrong)."""
    from ..store.folder import is_json_int, read_json

    try:
        ctx = read_json(folder / "config.json").get("max_position_embeddings")
    except (BadInputError, AttributeError):
        return None
    return ctx if is_json_int(ctx) and ctx > 0 else None


def _check_window(window: int | None, ctx: int | None, path: Any) -> None:
    """A window past the model's context would score positions it never saw in training (rotary positions beyond
    max_position_embeddings): a number, but not the model's perplexity."""
    if window is not None and isinstance(ctx, int) and window > ctx:
        raise BadInputError(f"window {window} is longer than the model's context (max_position_embeddings {ctx}); "
                            f"give --window {ctx} or less", file=str(path))


def perplexity(target: Any, text_file: str | os.PathLike[str] | None = None, *, text: str | None = None,
               device: str = "cpu", precision: str = "exact", dtype: Any = None, window: int | None = None,
               threads: int | None = None, loading: Status | None = None,
               show_progress: bool | None = None) -> dict[str, Any]:
    """Perplexity of the model over a text: exp(mean next-token NLL) over non-overlapping windows.

    ``window`` tokens per forward pass (default: the model's context, at most 1024). Every token after the
    first of each window is scored, so the figure depends on the window; compare models at the same window.
    ``loading`` is entered while a folder is loaded; a bar counts the windows (stderr, on a terminal).
    """
    import torch

    from ..progress import Progress

    if text is None:
        if text_file is None:
            raise BadInputError("perplexity needs a text file")
        p = Path(text_file)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInputError(f"cannot read the text: {exc}", file=str(p)) from None
    if window is not None:
        try:
            window = int(window)  # (as before: "512" from a script's argument list is 512)
        except (TypeError, ValueError):
            raise BadInputError(f"window must be a whole number of tokens, got {window!r}") from None
        if window < 2:
            raise BadInputError(f"window must be at least 2 tokens, got {window}")
    if isinstance(target, (str, os.PathLike)):  # (the window checked before the model loads, from config.json)
        _check_window(window, _context_of(Path(target)), Path(target))
    t0 = time.perf_counter()
    model, tok, path = _load(target, device, precision, dtype, threads, status=loading)  # one forward per window
    load_s = time.perf_counter() - t0
    dev = next(model.parameters()).device
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    if ids.numel() < 2:
        raise BadInputError("the text has fewer than two tokens", file=str(text_file) if text_file else None)
    _check_token_ids(ids, model, path)
    ctx = getattr(model.config, "max_position_embeddings", None)
    _check_window(window, ctx, path)
    win = int(window or min(ctx or 1024, 1024))
    nll_sum, count = 0.0, 0
    t1 = time.perf_counter()
    starts = [s for s in range(0, ids.numel() - 1, win) if min(win, ids.numel() - s) >= 2]
    with torch.inference_mode(), Progress(len(starts), "scoring windows", enabled=show_progress) as bar:
        for start in starts:
            chunk = ids[start:start + win].unsqueeze(0).to(dev)
            logits = model(chunk).logits.float()
            lp = torch.log_softmax(logits[0, :-1], dim=-1)
            tgt = chunk[0, 1:]
            nll_sum += float(-lp.gather(1, tgt.unsqueeze(1)).sum())
            count += int(tgt.numel())
            bar.update()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t2 = time.perf_counter()
    mean = nll_sum / count
    return {
        "path": path,
        "device": str(dev),
        "precision": _model_precision(model, precision),
        "decode": decode_mode(model),
        "text_tokens": int(ids.numel()),
        "scored_tokens": count,
        "window": win,
        "nll": round(mean, 6),
        "perplexity": round(math.exp(mean), 6),
        "load_s": round(load_s, 3),
        "seconds": round(t2 - t1, 3),
        "tokens_per_s": round(count / (t2 - t1), 1) if t2 > t1 else None,
    }


def dequantized_model(model: Any, dtype: Any = None) -> Any:
    """Replace every W4Linear of a loaded model by an nn.Linear holding its exact dequantized weights.

    The float reference for tests and ``w4pack run --compare``: same architecture, same weights, transformers'
    own float matmuls. Works in place and returns the model.
    """
    import torch
    from torch import nn

    from .torch_module import W4Embedding, W4FusedLinear, W4Linear, W4SliceLinear, W4TiedHead

    first = next((p for p in model.parameters()), None)
    dt = dtype or (first.dtype if first is not None else torch.float32)
    # a packed embedding becomes an nn.Embedding of its dequantized rows, and a head tied to it an nn.Linear
    # sharing that weight (as transformers ties them)
    embeddings = {}
    for name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, W4Embedding)]:
        mod.dtype = dt
        embeddings[id(mod)] = emb = mod.dequantized_embedding()
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, emb)
    for name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, W4TiedHead)]:
        emb = embeddings[id(mod.embedding)]
        lin = nn.Linear(mod.in_features, mod.out_features, bias=False, device=emb.weight.device, dtype=dt)
        lin.weight = emb.weight
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, lin)
    names = [(n, m) for n, m in model.named_modules() if isinstance(m, (W4Linear, W4SliceLinear))]
    for name, mod in names:
        if isinstance(mod, W4FusedLinear):
            continue
        w = mod.dequantize(torch.float64 if dt == torch.float64 else torch.float32)
        src = mod.fused if isinstance(mod, W4SliceLinear) else mod
        bias = src.bias_tensor(torch.float32)
        if isinstance(mod, W4SliceLinear) and bias is not None:
            lo, hi = src.parts[mod.index]["rows"]
            bias = bias[lo:hi]
        lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=src.qweight.device, dtype=dt)
        with torch.no_grad():
            lin.weight.copy_(w.to(dt))
            if bias is not None:
                lin.bias.copy_(bias.to(dt))
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, lin)
    for name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, W4FusedLinear)]:
        parent_name, _, attr = name.rpartition(".")
        delattr(model.get_submodule(parent_name) if parent_name else model, attr)
    model.requires_grad_(False)
    # the model is float now: its save_pretrained is transformers' own again, not the packed folder's copy
    model.__dict__.pop("save_pretrained", None)
    return model
