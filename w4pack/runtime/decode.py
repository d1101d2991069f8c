"""How a loaded model decodes on CUDA: w4pack's lean CUDA-graph loop where it runs, transformers' static cache
with its compiled step under it, or eager.

At batch 1 a decode step is a few hundred small kernels; launched one by one from Python they take longer than
the weights take to read. transformers' static-cache path compiles the step (``torch.compile``, mode
``reduce-overhead``: CUDA graphs), which removes most of that wall but leaves its per-token Python loop between
replays; w4pack's lean loop (``w4pack.runtime.lean_cuda``) replays the whole step, head and token choice
included, as one graph. So the CUDA default is the lean loop for what it runs (llama-family models, batch 1),
layered over the compiled step, which answers every other call. W4Linear's op is capturable (its GEMM
workspace is reserved when the layer is prepared, outside any graph pool).

Compiling can still fail on a given machine (no working Triton, an unsupported attention kernel, memory for the
graphs). The first such failure switches the model to eager decoding for good, with one warning that says why,
and the same call is answered eagerly.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from ..errors import W4PackError

COMPILED = "compiled"
EAGER = "eager"
#: decode engines ``load_model(engine=...)`` / ``w4pack run --engine`` take ("auto": the device's default)
ENGINES = ("auto", "lean", COMPILED, EAGER)
ENV = "W4PACK_COMPILE"
LEAN_ENV = "W4PACK_LEAN"
_OFF = ("0", "false", "no", "off")


def resolve_engine(engine: str | None, compile: bool | None) -> bool | None | str:
    """``compile`` as the rest of this module reads it (None: the device's default, True, False), or "lean".

    ``engine``: "auto" (or None: ``use_decode``'s default), "lean" (w4pack's lean loop alone: the CPU loop, on
    CUDA the CUDA-graph loop, transformers' eager generate for what it does not run), "compiled" (= ``compile=
    True``) or "eager" (= ``compile=False``). Giving both ``engine`` and ``compile`` is an error unless they
    agree."""
    from ..errors import BadInputError

    if engine is None or engine == "auto":
        return compile
    if engine not in ENGINES:
        raise BadInputError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    want: bool | str = {"lean": "lean", COMPILED: True, EAGER: False}[engine]
    if compile is not None and compile is not want:
        raise BadInputError(f"engine={engine!r} contradicts compile={compile}")
    return want


def compile_wanted(device: Any, compile: bool | None) -> bool:
    """The decode mode a load asks for: an explicit ``compile`` wins, then $W4PACK_COMPILE (0/1), then CUDA."""
    if compile is not None:
        return bool(compile)
    if os.environ.get(ENV, "").strip().lower() in _OFF:
        return False
    return str(device).startswith("cuda")  # transformers compiles the step on accelerators only


def lean_wanted(compile: bool | None) -> bool:
    """Whether a load decodes through the lean loop (``w4pack.runtime.lean``): yes unless ``compile`` is given
    (False: transformers' eager generate, True: its compiled step) or $W4PACK_LEAN is 0."""
    if compile is not None:
        return False
    return os.environ.get(LEAN_ENV, "").strip().lower() not in _OFF


def decode_mode(model: Any) -> str:
    """"lean", "compiled" or "eager", followed for the last call by why a faster mode did not answer it:
    "compiled (the lean loop decodes one sequence ...)" (the loop declined, the compiled step ran), "eager
    (RuntimeError: ...)" (the compile failed)."""
    return getattr(model, "w4pack_decode", EAGER)


def fallback_mode(model: Any) -> str:
    """The mode of what answers a call the lean loop declines: the compiled step if it is installed and has not
    failed, else eager."""
    return COMPILED if getattr(model, "_w4pack_compiled", False) else EAGER


def use_decode(model: Any, device: Any, chosen: bool | None | str) -> str:
    """Install the decode path ``resolve_engine``'s answer asks for on a loaded model; returns ``decode_mode``.

    The default (``chosen`` None) is the lean loop over the compiled step on CUDA, and the lean loop over
    transformers' eager generate on the CPU (where transformers compiles nothing). $W4PACK_LEAN=0 and
    $W4PACK_COMPILE=0 remove one layer each."""
    from .lean import use_lean_decode

    if chosen == "lean":
        return use_lean_decode(model)
    if compile_wanted(device, chosen):  # type: ignore[arg-type]
        use_compiled_decode(model)
    if chosen is None and lean_wanted(None):
        use_lean_decode(model)
    return decode_mode(model)


def use_compiled_decode(model: Any) -> None:
    """Decode ``model`` through the static cache and transformers' compiled step, falling back to eager once.

    Sets the generation config's ``cache_implementation`` to "static" (so a plain ``model.generate(...)`` takes
    the compiled path) and wraps ``generate`` on the instance for the fallback. A call that passes its own
    ``cache_implementation``, ``past_key_values`` or ``disable_compile`` is left as asked.
    """
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is None or getattr(model, "_w4pack_generate", None) is not None:
        return
    gen_cfg.cache_implementation = "static"
    model.w4pack_decode = COMPILED
    model._w4pack_compiled = True
    inner = model.generate
    model._w4pack_generate = inner

    def generate(*args: Any, **kwargs: Any) -> Any:
        if not model._w4pack_compiled:
            return inner(*args, **kwargs)
        try:
            return inner(*args, **kwargs)
        except (W4PackError, KeyboardInterrupt, TypeError, ValueError):
            raise  # bad arguments or bad input: eager would refuse them the same way
        except Exception as exc:  # noqa: BLE001 - any failure of the compiled step: retry eagerly, then decide
            reason = _one_line(exc)
            _to_eager(model, reason)
            warnings.warn(f"the compiled decode step failed ({reason}); decoding eagerly from now on "
                          f"(set {ENV}=0 or pass --eager to skip the attempt)", RuntimeWarning, stacklevel=2)
            return inner(*args, **kwargs)

    model.generate = generate


def remove_decode(model: Any) -> None:
    """Undo ``use_decode``: transformers' own generate and generation config again, the lean loop's graphs and
    caches released. For benchmarks that time several decode modes on one model."""
    from .lean import remove_lean_decode

    remove_lean_decode(model)
    inner = getattr(model, "_w4pack_generate", None)
    if inner is not None:
        restore_generate(model, inner)
        gen_cfg = model.generation_config
        gen_cfg.cache_implementation = None
        gen_cfg.disable_compile = False
    for attr in ("_w4pack_generate", "_w4pack_compiled", "w4pack_decode"):
        model.__dict__.pop(attr, None)


def restore_generate(model: Any, inner: Any) -> None:
    """``model.generate`` is ``inner`` again: the class's method when a wrapper replaced it, else the wrapper it
    was layered over."""
    model.__dict__.pop("generate", None)
    if model.generate != inner:
        model.generate = inner


def _to_eager(model: Any, reason: str) -> None:
    gen_cfg = model.generation_config
    gen_cfg.cache_implementation = None
    gen_cfg.disable_compile = True
    model._w4pack_compiled = False
    model.w4pack_decode = f"{EAGER} ({reason})"


def _one_line(exc: BaseException) -> str:
    """The root cause in one line: dynamo wraps a backend's error in BackendCompilerFailed."""
    for _ in range(8):
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    text = str(exc).strip().splitlines()
    head = text[0] if text else ""
    head = head[:200] + ("..." if len(head) > 200 else "")
    return f"{type(exc).__name__}: {head}" if head else type(exc).__name__
