"""Load a packed checkpoint into a transformers model whose linear layers are ``W4Linear``.

``load_model(path)`` builds the model from config.json on the *meta* device (no memory, no random init), swaps in
``W4Linear`` (or a ``W4FusedLinear`` plus ``W4SliceLinear`` views for fused projections) where the manifest says,
then streams every tensor in from the memory-mapped shards one at a time: quantized layers are copied as packed
bytes, pass-through tensors are converted to the model dtype one by one, so no full float copy of the weights is
ever built. Non-persistent buffers (rotary frequencies) are computed on the target device, and output embeddings
are tied when the config says so and the checkpoint holds no separate head. A layer whose manifest entry has
``"role": "embedding"`` becomes a ``W4Embedding`` (rows dequantized as they are looked up) and a head tied to it a
``W4TiedHead`` over the same packed buffers.

``register_transformers()`` makes ``AutoModelForCausalLM.from_pretrained(folder)`` work on a w4pack folder by
registering the quantization method "w4pack" with transformers (where the installed version allows it); an
installed w4pack does this in every process (``_w4pack_autoregister``), because transformers only warns about an
unknown quant_method and then loads random weights. Either way the model's ``save_pretrained`` writes the packed
folder back (``w4pack.runtime.saving``).
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ..store.checkpoint import MANIFEST_NAME, Checkpoint, open_checkpoint
from ..errors import BadInputError, UnsupportedError
from .saving import attach_save_pretrained

__all__ = ["load_model", "register_transformers", "install_transformers_hook", "resolve_dtype",
           "swap_in_packed_layers", "expand_experts", "load_tokenizer", "check_device"]

_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


def check_device(device: Any) -> str:
    """``device`` as "cpu", "cuda" or "cuda:N", the devices w4pack's kernels run on; anything else is a usage error
    (exit 2) here, before torch turns it into a RuntimeError."""
    if type(device).__name__ == "device" and type(device).__module__ == "torch":  # a torch.device, torch unimported
        device = "cpu" if device.type == "cpu" else str(device)
    if isinstance(device, str) and device == "cpu:0":  # (torch's name for the CPU device: torch.device("cpu", 0))
        return "cpu"
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise BadInputError(f"device must be cpu, cuda or cuda:N (N a GPU index), got {device!r}")
    return device


def resolve_dtype(dtype: Any, device: str, config: dict[str, Any] | None = None) -> Any:
    """torch dtype from a torch dtype, a name ("float16", "bf16", ...) or None (cpu: float32, cuda: fp16/bf16)."""
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):  # (the kernels' activation dtypes)
            raise BadInputError(f"dtype {dtype} is not one the packed layers run in (use float16, bfloat16 or "
                                "float32)")
        return dtype
    names = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float": torch.float32}
    if dtype is None or dtype == "auto":
        if str(device).startswith("cuda"):
            want = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
            return torch.bfloat16 if want == "bfloat16" else torch.float16
        return torch.float32
    if isinstance(dtype, str) and dtype.lower() in names:
        return names[dtype.lower()]
    raise BadInputError(f"unknown dtype {dtype!r} (use float16, bfloat16 or float32)")


def _np_to_torch(arr: np.ndarray, dtype_name: str) -> Any:
    """A stored tensor (bf16 as uint16 bits) as a torch tensor of its own dtype (one copy off the mmap)."""
    import torch

    a = np.array(arr, copy=True)
    if dtype_name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _build_config(ckpt: Checkpoint) -> Any:
    from transformers import AutoConfig

    cfg = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise BadInputError("config.json has no model_type; cannot build the model",
                            file=str(ckpt.path / "config.json"))
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except ValueError as exc:
        raise UnsupportedError(f"transformers cannot build model_type {model_type!r}: {exc}",
                               file=str(ckpt.path / "config.json")) from None


def _model_path(model: Any, name: str) -> str:
    """``name`` (a module path as the checkpoint spells it) as this model spells it.

    transformers renames some paths at load (Mixtral's ``block_sparse_moe`` is ``mlp`` in transformers 5); the
    first spelling whose parent module exists wins, so older transformers keep the checkpoint's own."""
    from ..formats._experts import module_path_candidates

    cands = module_path_candidates(name)
    for cand in cands:
        parent = cand.rpartition(".")[0]
        try:
            if parent:
                model.get_submodule(parent)
            return cand
        except AttributeError:
            continue
    return name


def _set_module(model: Any, name: str, new: Any) -> None:
    parent_name, _, attr = _model_path(model, name).rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def expand_experts(model: Any, names: list[str]) -> dict[str, Any]:
    """Replace each fused experts module that ``names`` address per expert by a ``W4Experts``.

    ``names``: layer, fused-part and pass-through names of the checkpoint. Per-expert names
    (``<block>.experts.<e>.<leaf>``) whose experts module is transformers 5's fused one (3-D ``gate_up_proj``)
    get a W4Experts with one meta ``nn.Linear`` per expert and projection at the checkpoint's names, which the
    ordinary swap and pass-through loading then fill. Returns {experts path in the model: W4Experts}.
    """
    from ..formats._experts import LEAVES_BY_STYLE, split_expert_name
    from .torch_module import W4Experts

    done: dict[str, Any] = {}
    for name in names:
        ex = split_expert_name(name)
        if ex is None:
            continue
        path = _model_path(model, ex.experts_path + ".x").rpartition(".")[0]
        if path in done:
            continue
        try:
            old = model.get_submodule(path)
        except AttributeError:
            continue  # reported as a layer the model does not have by the swap
        if isinstance(old, W4Experts) or getattr(old, "gate_up_proj", None) is None:
            continue  # already expanded, or per-expert modules of their own (older transformers)
        style = "mixtral" if ex.leaf in ("w1", "w2", "w3") else "proj"
        try:
            new = W4Experts.replacing(old, LEAVES_BY_STYLE[style])
        except UnsupportedError as exc:
            raise UnsupportedError(f"{exc} (module {path})", tensor=name) from None
        _set_module(model, path, new)
        done[path] = new
    return done


def _linear_at(model: Any, name: str, ckpt_path: Path) -> Any:
    from torch import nn

    return _module_at(model, name, ckpt_path, nn.Linear, "a layer", "layer", "a Linear")


def _module_at(model: Any, name: str, ckpt_path: Path, cls: type, named: str, kind: str, wanted: str) -> Any:
    """The model's module at manifest name ``name``, which must be a ``cls`` (or a subclass): the messages name
    the manifest entry as ``named``/``kind`` and the module it must be as ``wanted``."""
    try:
        old = model.get_submodule(_model_path(model, name))
    except AttributeError:
        raise BadInputError(f"the manifest names {named} the model does not have", file=str(ckpt_path),
                            tensor=name) from None
    if not isinstance(old, cls):
        raise UnsupportedError(f"manifest {kind} is a {type(old).__name__} in the model, not {wanted}",
                               file=str(ckpt_path), tensor=name)
    return old


def _match_bias(packed: Any, parts: list[tuple[str, bool, int, int]], ckpt: Checkpoint, name: str) -> Any:
    """``packed`` fitted to the model's bias-or-not, given per part (Linear name, has a bias, rows lo, hi).

    AutoGPTQ saves an all-zero ``bias`` for every bias-free Linear (Llama has none): a zero bias where the model has
    none changes nothing and is dropped. A non-zero one, or a bias the model needs and the checkpoint lacks, would
    change the model's output and is refused naming the layer.
    """
    from ..core.dtypes import dtype_name_of, to_float64
    from ..core.layout import PackedLayer

    has = "bias" in packed.tensors
    tname = packed.meta.get("tensors", {}).get("bias", f"{name}.bias")
    where = str(ckpt.path / ckpt.weight_map[tname]) if tname in ckpt.weight_map else str(ckpt.path)
    if not has:
        for part, wants, _lo, _hi in parts:
            if wants:
                raise BadInputError("the model's Linear has a bias but the packed layer has none (a checkpoint "
                                    "for another architecture or config?)", file=str(ckpt.path), tensor=part)
        return packed
    if all(wants for _p, wants, _lo, _hi in parts):
        return packed
    arr = np.asarray(packed.tensors["bias"])
    bias = to_float64(arr, packed.meta.get("bias_dtype") or dtype_name_of(arr))
    for part, wants, lo, hi in parts:
        if not wants and np.any(bias[lo:hi] != 0):
            raise BadInputError(f"the packed layer has a non-zero bias for {part}, whose Linear in this model has no "
                                "bias (check config.json, e.g. attention_bias / mlp_bias)", file=where, tensor=tname)
    if any(wants for _p, wants, _lo, _hi in parts):
        return packed  # a fused layer whose other parts need the bias: the zero rows are harmless
    meta = dict(packed.meta)
    meta.pop("bias_dtype", None)
    meta["tensors"] = {k: v for k, v in meta.get("tensors", {}).items() if k != "bias"}
    return PackedLayer(meta=meta, tensors={k: v for k, v in packed.tensors.items() if k != "bias"},
                       source=dict(packed.source))


def _addressed_names(ckpt: Checkpoint) -> list[str]:
    """Every module or tensor name the checkpoint fills: layers, fused parts, pass-through tensors."""
    fused = ckpt.manifest.get("fused") or {}
    return list(ckpt.layers) + [p["name"] for parts in fused.values() for p in parts] + list(ckpt.passthrough)


def _holds_plain_weight(model: Any, name: str) -> bool:
    """True when the module at ``name`` is no ``nn.Linear`` but keeps a matrix as its only parameter
    ``weight`` (transformers 5's MoE routers)."""
    from torch import nn

    try:
        mod = model.get_submodule(_model_path(model, name))
    except AttributeError:
        return False
    if isinstance(mod, nn.Linear):
        return False
    w = mod._parameters.get("weight")
    return w is not None and w.dim() == 2 and set(mod._parameters) == {"weight"}


def _fill_dequantized(model: Any, name: str, packed: Any, ckpt_path: Path, device: Any) -> bool:
    """A packed layer whose module is not an ``nn.Linear`` but holds the matrix as a plain ``weight`` parameter
    (transformers 5's MoE routers: ``MixtralTopKRouter`` calls ``F.linear(x, self.weight)`` inside its own
    routing code) gets its exactly dequantized weights; the router is [E, H], small beside the experts.
    Returns False for anything else (the Linear path then checks and reports it)."""
    import torch
    from torch import nn

    if not _holds_plain_weight(model, name):
        return False
    mod = model.get_submodule(_model_path(model, name))
    w = mod._parameters["weight"]
    n, k = packed.meta["shape"]
    if tuple(w.shape) != (n, k):
        raise BadInputError(f"packed shape [{n}, {k}] does not match the model's weight {list(w.shape)}",
                            file=str(ckpt_path), tensor=name)
    if "bias" in packed.tensors:
        raise UnsupportedError(f"the packed layer has a bias but the model's {type(mod).__name__} has none",
                               file=str(ckpt_path), tensor=name)
    from ..core.layout import unpack

    dense = torch.from_numpy(unpack(packed).dequantize(np.float32))
    mod._parameters["weight"] = nn.Parameter(dense.to(dtype=w.dtype, device=device), requires_grad=False)
    mod.w4pack_dequantized = True
    return True


def _is_embedding(packed_or_meta: Any) -> bool:
    meta = getattr(packed_or_meta, "meta", packed_or_meta)
    return meta.get("role") == "embedding"


def _embedding_at(model: Any, name: str, ckpt_path: Path) -> Any:
    """The model's embedding module that a packed embedding replaces (an ``nn.Embedding`` or a subclass)."""
    from torch import nn

    return _module_at(model, name, ckpt_path, nn.Embedding, "an embedding", "embedding", "an Embedding")


def _swap_embedding(model: Any, name: str, packed: Any, ckpt_path: Path, device: Any, precision: str,
                    threads: int | None) -> Any:
    """A packed embedding in place of the model's ``nn.Embedding``: a ``W4Embedding``. A subclass that does more
    than look up (e.g. scales the rows) keeps its own forward and gets the exactly dequantized weight instead."""
    from torch import nn

    from .torch_module import W4Embedding

    old = _embedding_at(model, name, ckpt_path)
    if type(old) is not nn.Embedding:
        _fill_dequantized(model, name, packed, ckpt_path, device)
        return old
    try:
        mod = W4Embedding.replacing(old, packed, device=device, precision=precision, threads=threads, name=name)
    except UnsupportedError as exc:
        raise BadInputError(exc.message, file=str(ckpt_path), tensor=name) from None
    _set_module(model, name, mod)
    return mod


def _tie_packed_head(model: Any, config: Any, *, skeleton: bool = False) -> Any:
    """When the config ties the head to the input embedding and that is a ``W4Embedding``, the head becomes a
    ``W4TiedHead`` over its buffers (returned; None otherwise). ``skeleton``: the head may be unfilled (meta)
    anyway, as under transformers' loader; otherwise only a head the checkpoint left unfilled is replaced."""
    from torch import nn

    from .torch_module import W4Embedding, W4TiedHead

    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_cfg, "tie_word_embeddings", False):
        return None
    in_emb, out_emb = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(in_emb, W4Embedding) or not isinstance(out_emb, nn.Linear):
        return None
    if not (skeleton or out_emb.weight.is_meta) or out_emb.bias is not None:
        return None
    if (out_emb.out_features, out_emb.in_features) != (in_emb.num_embeddings, in_emb.embedding_dim):
        return None
    head = W4TiedHead(in_emb)
    name = next(n for n, m in model.named_modules() if m is out_emb)
    _set_module(model, name, head)
    return head


def swap_in_packed_layers(model: Any, ckpt: Checkpoint, *, device: Any, precision: str = "exact",
                          threads: int | None = None) -> dict[str, Any]:
    """Replace the model's nn.Linear modules named in the manifest by W4Linear filled from ``ckpt``.

    Returns {layer name: module}. Fused layers become a W4FusedLinear on the parent plus W4SliceLinear views
    at the original names, so the model's forward is unchanged.
    """
    from .torch_module import W4FusedLinear, W4Linear, W4SliceLinear

    fused: dict[str, list[dict[str, Any]]] = ckpt.manifest.get("fused") or {}
    expand_experts(model, _addressed_names(ckpt))
    out: dict[str, Any] = {}
    for name in ckpt.layers:
        packed = ckpt.packed(name)
        n, k = packed.meta["shape"]
        if _is_embedding(packed):
            out[name] = _swap_embedding(model, name, packed, ckpt.path, device, precision, threads)
            continue
        if name not in fused and _fill_dequantized(model, name, packed, ckpt.path, device):
            continue
        if name in fused:
            parts = fused[name]
            for p in parts:
                old = _linear_at(model, p["name"], ckpt.path)
                lo, hi = p["rows"]
                if (old.out_features, old.in_features) != (hi - lo, k):
                    raise BadInputError(f"fused part rows {lo}:{hi} x {k} do not match the model's "
                                        f"[{old.out_features}, {old.in_features}]", file=str(ckpt.path),
                                        tensor=p["name"])
            packed = _match_bias(packed, [(p["name"], _linear_at(model, p["name"], ckpt.path).bias is not None,
                                           *p["rows"]) for p in parts], ckpt, name)
            parent_name, _, attr = _model_path(model, name).rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if attr in parent._modules or hasattr(parent, attr):
                raise UnsupportedError(f"the model already has a module {attr!r} here; cannot place the fused layer",
                                       file=str(ckpt.path), tensor=name)
            mod = W4FusedLinear(packed.meta, parts, has_bias="bias" in packed.tensors, device="meta",
                                precision=precision, threads=threads, name=name)
            mod.load_packed(packed, device=device)
            setattr(parent, attr, mod)
            for i, p in enumerate(parts):
                _set_module(model, p["name"], W4SliceLinear(mod, i))
            out[name] = mod
            continue
        old = _linear_at(model, name, ckpt.path)
        if (old.out_features, old.in_features) != (n, k):
            raise BadInputError(f"packed shape [{n}, {k}] does not match the model's Linear "
                                f"[{old.out_features}, {old.in_features}]", file=str(ckpt.path), tensor=name)
        packed = _match_bias(packed, [(name, old.bias is not None, 0, n)], ckpt, name)
        mod = W4Linear.from_packed(packed, device=device, precision=precision, threads=threads, name=name)
        _set_module(model, name, mod)
        out[name] = mod
    return out


def _load_passthrough(model: Any, ckpt: Checkpoint, device: Any) -> list[str]:
    """Stream the unquantized tensors into the model's (meta) parameters and buffers; returns unused names."""
    from torch import nn

    unused = []
    for tname in ckpt.passthrough:
        mod_name, _, pname = _model_path(model, tname).rpartition(".")
        try:
            mod = model.get_submodule(mod_name) if mod_name else model
        except AttributeError:
            unused.append(tname)
            continue
        cur = mod._parameters.get(pname) if pname in mod._parameters else mod._buffers.get(pname)
        if cur is None:
            unused.append(tname)
            continue
        t = _np_to_torch(ckpt.raw(tname), ckpt.dtype_name(tname))
        if tuple(t.shape) != tuple(cur.shape):
            raise BadInputError(f"shape {list(t.shape)} != the model's {list(cur.shape)}",
                                file=str(ckpt.path / ckpt.weight_map[tname]), tensor=tname)
        # the skeleton was built in the model dtype, with any module transformers keeps in fp32 already so
        t = t.to(device=device, dtype=cur.dtype)
        if pname in mod._parameters:
            mod._parameters[pname] = nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[pname] = t
    return unused


def _tie_embeddings(model: Any, config: Any) -> None:
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_cfg, "tie_word_embeddings", False):
        return
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    if out_emb is None or in_emb is None or not hasattr(out_emb, "weight"):
        return
    if out_emb.weight.is_meta and not in_emb.weight.is_meta:
        out_emb.weight = in_emb.weight


def _materialize_buffers(model: Any, device: Any) -> None:
    """Non-persistent buffers (rotary inv_freq, ...) are not in checkpoints: compute them on ``device``."""
    import torch

    for mname, mod in model.named_modules():
        meta_bufs = [b for b in getattr(mod, "_non_persistent_buffers_set", ())
                     if mod._buffers.get(b) is not None and mod._buffers[b].is_meta]
        if not meta_bufs:
            continue
        for b in meta_bufs:
            mod._buffers[b] = torch.empty_like(mod._buffers[b], device=device)
        init = getattr(model, "_init_weights", None)
        if init is None:
            raise UnsupportedError(f"cannot compute the buffers {meta_bufs} of {mname}")
        # transformers' init functions skip tensors flagged as initialized: protect the loaded weights
        for t in list(mod.parameters(recurse=False)) + [b for n, b in mod.named_buffers(recurse=False)
                                                         if n not in meta_bufs]:
            t._is_hf_initialized = True
        try:
            from transformers.initialization import guard_torch_init_functions
        except ImportError:  # older transformers: plain call
            guard_torch_init_functions = None
        with torch.no_grad():
            if guard_torch_init_functions is not None:
                with guard_torch_init_functions():
                    init(mod)
            else:
                init(mod)


def _leftover_meta(model: Any) -> list[str]:
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    names += [n for n, b in model.named_buffers(remove_duplicate=False) if b is not None and b.is_meta]
    return names


def load_model(path: str | os.PathLike[str], device: Any = "cpu", dtype: Any = None, precision: str = "exact",
               threads: int | None = None, attn_implementation: str | None = None,
               compile: bool | None = None, engine: str | None = None) -> Any:
    """A transformers causal LM whose quantized layers run w4pack's native kernels.

    ``device``: "cpu" or "cuda[:i]"; ``dtype``: activations and unquantized weights (float32, float16 or
    bfloat16; default float32 on CPU, float16 on CUDA); ``precision``: the CPU kernel path ("exact" fp32
    dequantize or "fast" int8 activations). Peak memory: the packed layers plus the unquantized tensors in
    ``dtype``, built one tensor at a time. ``generate`` decodes through w4pack's lean loop where it runs
    (llama-family models, batch 1: ``w4pack.runtime.lean`` on the CPU, its CUDA-graph form
    ``w4pack.runtime.lean_cuda`` on CUDA); other calls go on CUDA to transformers' static cache and compiled
    step (a failure falls back to eager with a warning: ``w4pack.runtime.decode``), on the CPU to
    transformers' eager generate. ``compile``: True for the compiled step alone, False for eager alone;
    $W4PACK_LEAN=0 and $W4PACK_COMPILE=0 drop the lean loop or the compiled step from the default. ``engine``:
    "auto" (the default above), "lean" (the lean loop alone), "compiled" or "eager"; ``decode_mode(model)``
    says which answered the last call and why a faster one did not.

    Example::

        model = w4pack.load_model("smollm2-w4/", device="cpu")
        out = model.generate(**tok("Hello", return_tensors="pt"), max_new_tokens=20)
    """
    _require_hf()
    import torch
    from transformers import AutoModelForCausalLM

    from .decode import resolve_engine, use_decode
    from .torch_module import PRECISIONS, W4Linear

    if precision not in PRECISIONS:
        raise BadInputError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    from ..native.cpu import check_threads

    check_threads(threads)
    chosen = resolve_engine(engine, compile)
    dev = torch.device(check_device(device))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"device {dev} was asked for but torch sees no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UnsupportedError(f"device {dev} was asked for but torch sees {torch.cuda.device_count()} CUDA "
                               "device(s); use cuda or cuda:N with N below that")
    _refuse_unpacked(Path(path))
    with open_checkpoint(path) as ckpt:
        torch_dtype = resolve_dtype(dtype, str(dev), ckpt.config)
        config = _build_config(ckpt)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        swap_in_packed_layers(model, ckpt, device=dev, precision=precision, threads=threads)
        unused = _load_passthrough(model, ckpt, dev)
        _tie_packed_head(model, config)
        _tie_embeddings(model, config)
        _materialize_buffers(model, dev)
        missing = _leftover_meta(model)
        if missing:
            raise BadInputError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs, first "
                                f"{missing[0]}", file=str(ckpt.path), tensor=missing[0])
        if unused:
            warnings.warn(f"{len(unused)} pass-through tensor(s) of {ckpt.path} are not used by the model "
                          f"(first: {unused[0]})", stacklevel=2)
        gen_path = ckpt.path / "generation_config.json"
        if gen_path.is_file() and getattr(model, "generation_config", None) is not None:
            from transformers import GenerationConfig

            try:
                model.generation_config = GenerationConfig.from_pretrained(str(ckpt.path))
            except (OSError, ValueError):
                pass
        # build the native kernels now (CPU repack, CUDA uploads): the first token is not charged for it and
        # CUDA graph capture never meets an upload
        for mod in model.modules():
            if isinstance(mod, W4Linear):
                mod.prepare(dev, torch_dtype)
        model.w4pack_path = str(ckpt.path)
        model.w4pack_quantization = dict(ckpt.config["quantization_config"])
    attach_save_pretrained(model)
    use_decode(model, dev, chosen)
    model.eval()
    model.requires_grad_(False)
    return model


def _require_hf() -> None:
    """One clear line instead of an import traceback when the optional dependencies are missing."""
    import importlib.util

    for mod, extra in (("torch", "torch"), ("transformers", "hf")):
        if importlib.util.find_spec(mod) is None:
            raise UnsupportedError(f"running a model needs {mod}: pip install 'w4pack[{extra}]'")


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer stored beside the weights (tokenizer.json etc., copied by convert)."""
    _require_hf()
    from transformers import AutoTokenizer

    check_listed_files(path)  # (transformers would say it found no tokenizer, or take another file, naming none)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        folder = Path(path)
        if not any(folder.glob("tokenizer*")) and _gguf_without_tokenizer(folder):
            # transformers' guesses (sentencepiece, tiktoken) say nothing useful here
            raise BadInputError("no tokenizer: the GGUF this folder was converted from has none in its metadata; "
                                "convert a GGUF that embeds one (llama.cpp's converters write it) or the original "
                                "model's folder", file=str(path)) from None
        why = " ".join(str(exc).split())  # transformers' messages span lines; the CLI prints one
        raise BadInputError(f"no usable tokenizer in the folder; put the original model's tokenizer files "
                            f"(tokenizer.json, tokenizer_config.json) beside the source's weights and convert again "
                            f"(convert copies and checksums them; a file copied into a packed folder makes it "
                            f"invalid) ({why})", file=str(path)) from None


def _refuse_unpacked(path: Path) -> None:
    """A GPTQ, AWQ, compressed-tensors or GGUF checkpoint given to load_model: say which, and that it is converted
    first ("no w4pack.json" is true, but not what to do)."""
    if (path / MANIFEST_NAME).is_file() or not os.path.lexists(path):
        return  # (open_checkpoint names what is wrong)
    from ..errors import W4PackError
    from ..formats import detect

    try:
        found = detect(path)
    except W4PackError:
        return
    if found and found != "w4pack":
        raise BadInputError(f"a {found} checkpoint, not a packed w4pack folder; convert it first: w4pack convert "
                            f"{path} OUT_DIR (or w4pack.convert), then load OUT_DIR", file=str(path))


def check_listed_files(path: str | os.PathLike[str]) -> None:
    """Refuse a folder that lost a file its manifest lists (a tokenizer file, the generation config), naming it:
    a stat per file, where loading the model and then the tokenizer would end in transformers' own words."""
    gone = _listed_but_missing(Path(path))
    if gone:
        raise BadInputError(f"file is missing, though {MANIFEST_NAME} lists it (the folder lost it after it was "
                            "written): convert or download the checkpoint again", file=str(Path(path) / gone[0]))


def _listed_but_missing(folder: Path) -> list[str]:
    """The files a w4pack manifest lists beside the shards (config, index, tokenizer and other side files) that the
    folder no longer holds; [] for any other folder or an unreadable manifest (validate names what is wrong)."""
    import json

    try:
        doc = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
        names = [e["file"] for e in doc.get("files") or []] + list(doc.get("side_files") or [])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted({n for n in names if isinstance(n, str) and "/" not in n and not os.path.lexists(folder / n)})


def _gguf_without_tokenizer(folder: Path) -> bool:
    """The folder's manifest says it came from a GGUF whose metadata held no tokenizer."""
    import json

    try:
        notes = json.loads((folder / "w4pack.json").read_text())["source"]["notes"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return any(isinstance(n, str) and n.startswith("no tokenizer in the GGUF metadata") for n in notes)


# -------------------------------------------------------------------------------------------------
# transformers integration: AutoModelForCausalLM.from_pretrained(folder) on a w4pack folder
# -------------------------------------------------------------------------------------------------
_REGISTERED = False


def register_transformers() -> bool:
    """Register quant_method "w4pack" with transformers; returns False when this version has no hook for it.

    After this, ``AutoModelForCausalLM.from_pretrained(folder)`` builds the model, swaps in W4Linear and loads
    the packed layers through the same code as ``load_model`` (called by ``import w4pack`` when transformers is
    already imported, and by ``load_model``'s callers when they want the Auto classes).
    """
    global _REGISTERED
    if _REGISTERED:
        return True
    try:
        from transformers.quantizers.auto import register_quantization_config, register_quantizer
        from transformers.quantizers.base import HfQuantizer
        from transformers.utils.quantization_config import QuantizationConfigMixin
    except ImportError:
        return False
    from transformers.quantizers import auto as qauto

    if "w4pack" in getattr(qauto, "AUTO_QUANTIZER_MAPPING", {}):
        _REGISTERED = True
        return True

    class W4PackConfig(QuantizationConfigMixin):
        """quantization_config of a w4pack folder (the per-layer truth is in the manifest it names).

        ``precision`` ("exact" or "fast", the CPU GEMM path) is a loading attribute: passing
        ``quantization_config=W4PackConfig(precision="fast")`` to ``from_pretrained`` overrides the folder's.
        """

        def __init__(self, precision: str = "exact", **kwargs: Any):
            self.quant_method = "w4pack"
            self.precision = precision
            for k, v in kwargs.items():
                setattr(self, k, v)
            self.post_init()

        def post_init(self) -> None:
            from .torch_module import PRECISIONS

            if self.precision not in PRECISIONS:
                raise ValueError(f"w4pack: precision must be one of {PRECISIONS}, got {self.precision!r}")

        def get_loading_attributes(self) -> dict[str, Any]:
            return {"precision": self.precision}

        def to_dict(self) -> dict[str, Any]:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    class W4PackHfQuantizer(HfQuantizer):
        """Swaps in W4Linear before weights load and fills them from the manifest's packed layers."""

        requires_calibration = True

        def __init__(self, quantization_config: Any, **kwargs: Any):
            super().__init__(quantization_config, **kwargs)
            self._folder: Path | None = None

        def validate_environment(self, *args: Any, **kwargs: Any) -> None:
            dm = kwargs.get("device_map")
            if isinstance(dm, dict) and len(set(dm.values())) > 1:
                raise ValueError("w4pack models load onto one device; pass device_map=None or one device")

        def update_dtype(self, dtype: Any) -> Any:
            import torch

            if isinstance(dtype, torch.dtype):
                resolve_dtype(dtype, "cpu")  # (refused here, at load, not by the first forward)
            return dtype

        def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
            files = kwargs.get("checkpoint_files") or []
            if not files:
                raise ValueError("w4pack: transformers passed no checkpoint files")
            self._folder = Path(files[0]).parent
            from ..formats._experts import module_path_candidates  # transformers reports renamed keys

            with open_checkpoint(self._folder) as ckpt:
                # skeleton W4Linear modules on meta whose buffers are non-persistent, so transformers neither
                # loads the packed tensors (casting them) nor reports them missing; they are filled afterwards
                _swap_skeleton(model, ckpt)
                names = list(ckpt.manifest["layers"])
            # packed tensors are ours to load: keep transformers from reporting them
            pats = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
            model._keys_to_ignore_on_load_unexpected = pats | {_re_escape(c) for n in names
                                                               for c in module_path_candidates(n)}
            return model

        def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
            import torch

            assert self._folder is not None
            dev = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
            precision = getattr(self.quantization_config, "precision", "exact")
            with open_checkpoint(self._folder) as ckpt:
                _fill_skeleton(model, ckpt, dev, precision)
                model.w4pack_quantization = dict(ckpt.config["quantization_config"])
            _materialize_buffers(model, dev)
            model.w4pack_path = str(self._folder)
            attach_save_pretrained(model)
            return model

        def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
            return False

        @property
        def is_trainable(self) -> bool:
            return False

        @property
        def is_compileable(self) -> bool:
            return True

    register_quantization_config("w4pack")(W4PackConfig)
    register_quantizer("w4pack")(W4PackHfQuantizer)
    # transformers copies "loading attributes" from the quantization_config passed to from_pretrained onto the
    # folder's only for the config classes in this tuple (read at call time): precision is one
    kinds = getattr(qauto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if isinstance(kinds, tuple) and W4PackConfig not in kinds:
        qauto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*kinds, W4PackConfig)
    _REGISTERED = True
    return True


def __getattr__(name: str) -> Any:
    """``W4PackConfig`` (the transformers quantization config class) on first use: it needs transformers."""
    if name == "W4PackConfig":
        _require_hf()
        if not register_transformers():
            raise UnsupportedError("this transformers version has no quantizer registry; upgrade transformers")
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

        return AUTO_QUANTIZATION_CONFIG_MAPPING["w4pack"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _re_escape(name: str) -> str:
    import re

    return "^" + re.escape(name) + r"\.(qweight|scales|zeros|mins|perm|bias)$"


def _swap_skeleton(model: Any, ckpt: Checkpoint) -> None:
    """Meta-device W4Linear modules in place of the manifest's Linear layers (no data yet)."""
    from .torch_module import W4FusedLinear, W4Linear, W4SliceLinear

    fused = ckpt.manifest.get("fused") or {}
    expand_experts(model, _addressed_names(ckpt))
    from torch import nn

    from .torch_module import W4Embedding

    for name, meta in ckpt.manifest["layers"].items():
        has_bias = "bias" in meta["tensors"]
        if _is_embedding(meta):
            old = _embedding_at(model, name, ckpt.path)
            if type(old) is nn.Embedding:
                _set_module(model, name, W4Embedding(meta, dtype=old.weight.dtype, padding_idx=old.padding_idx,
                                                     device="meta", persistent=False, name=name))
            continue  # a subclass gets its dequantized weight after loading (_fill_skeleton)
        if name not in fused and _holds_plain_weight(model, name):
            continue  # a quantized router: dequantized into its weight after loading (_fill_skeleton)
        if name in fused:
            for p in fused[name]:
                _linear_at(model, p["name"], ckpt.path)
            mod = W4FusedLinear(meta, fused[name], has_bias=has_bias, device="meta", persistent=False, name=name)
            _set_module(model, name, mod)
            for i, p in enumerate(fused[name]):
                _set_module(model, p["name"], W4SliceLinear(mod, i))
        else:
            _linear_at(model, name, ckpt.path)
            _set_module(model, name, W4Linear(meta, has_bias=has_bias, device="meta", persistent=False, name=name))
    if _tie_packed_head(model, model.config, skeleton=True) is not None:
        # the head now runs on the packed embedding: transformers must not tie (or report) float weights there
        tied = getattr(model, "all_tied_weights_keys", None)
        if isinstance(tied, dict):
            for key in [k for k, v in tied.items() if _is_under(model, k) or _is_under(model, v)]:
                tied.pop(key)


def _is_under(model: Any, tensor: str) -> bool:
    """True when ``tensor`` (a parameter path) belongs to a module w4pack replaced (no such parameter any more)."""
    from .torch_module import W4Embedding, W4TiedHead

    try:
        return isinstance(model.get_submodule(tensor.rpartition(".")[0]), (W4Embedding, W4TiedHead))
    except AttributeError:
        return False


def _fill_skeleton(model: Any, ckpt: Checkpoint, device: Any, precision: str) -> None:
    from .torch_module import W4Embedding

    for name in ckpt.layers:
        mod = model.get_submodule(_model_path(model, name))
        if not isinstance(mod, W4Embedding) and _fill_dequantized(model, name, ckpt.packed(name), ckpt.path, device):
            continue
        mod = model.get_submodule(_model_path(model, name))
        mod.precision = precision
        mod.load_packed(ckpt.packed(name), device=device)
        mod._non_persistent_buffers_set.clear()  # the skeleton hid them from transformers' loader
        mod.prepare(device)


def install_transformers_hook() -> None:
    """Register now if transformers' quantizer registry is loaded, else as soon as it is.

    The finder lives in the top-level module ``_w4pack_autoregister`` (shipped beside the package), which the
    installed ``w4pack-autoregister.pth`` also loads at interpreter start, so ``from_pretrained`` works on a packed
    folder even where nobody imported w4pack; calling this again is harmless.
    """
    try:
        from _w4pack_autoregister import install
    except ImportError:  # a copy of the package without its hook module: register now if transformers is loaded
        import sys

        if "transformers.quantizers.auto" in sys.modules:
            register_transformers()
        return
    install()
