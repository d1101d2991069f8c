"""Which linear layers and other tensors a model needs, from its ``config.json`` alone (no transformers, no
weights).

Why: a packed checkpoint's manifest lists the layers it holds; a layer entry that went missing (or one that
belongs to another model) is otherwise found only when the runtime builds the model and a ``Linear`` stays
empty. ``validate`` checks the manifest against this table so the folder is refused up front, naming the layer.

The same holds for the tensors that are not linear layers (token embedding, RMSNorm weights): a source without
``model.norm.weight`` converts, and the runtime then builds the norm with its initial weights, silently.

The table covers the decoder-only families whose module names w4pack knows (the same families as the GGUF
name table); another ``model_type`` is not guessed at: the check is skipped and says so.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["DECODER_LINEARS", "DECODER_NORMS", "MAX_DECODER_LAYERS", "needed_linears", "needed_tensors",
           "tensor_problem", "architecture_problem"]

#: model_type -> the Linear modules of one decoder layer (under ``model.layers.<i>.``) and their shape rule:
#: "q" [heads*head_dim, hidden], "kv" [kv_heads*head_dim, hidden], "o" [hidden, heads*head_dim],
#: "up" [intermediate, hidden], "down" [hidden, intermediate]
_LLAMA_BLOCK: tuple[tuple[str, str], ...] = (
    ("self_attn.q_proj", "q"), ("self_attn.k_proj", "kv"), ("self_attn.v_proj", "kv"), ("self_attn.o_proj", "o"),
    ("mlp.gate_proj", "up"), ("mlp.up_proj", "up"), ("mlp.down_proj", "down"),
)
DECODER_LINEARS: dict[str, tuple[tuple[str, str], ...]] = {
    "llama": _LLAMA_BLOCK, "mistral": _LLAMA_BLOCK, "qwen2": _LLAMA_BLOCK, "qwen3": _LLAMA_BLOCK,
}
#: model_type -> the RMSNorm weights of one decoder layer (under ``model.layers.<i>.``) and their size: "hidden"
#: or "head" (qwen3 normalises each head's queries and keys)
_LLAMA_NORMS: tuple[tuple[str, str], ...] = (("input_layernorm", "hidden"), ("post_attention_layernorm", "hidden"))
DECODER_NORMS: dict[str, tuple[tuple[str, str], ...]] = {
    "llama": _LLAMA_NORMS, "mistral": _LLAMA_NORMS, "qwen2": _LLAMA_NORMS,
    "qwen3": _LLAMA_NORMS + (("self_attn.q_norm", "head"), ("self_attn.k_norm", "head")),
}
#: head_dim when config.json has none (transformers' defaults; others use hidden_size // num_attention_heads)
_HEAD_DIM = {"qwen3": 128}
#: config keys the shapes need
_NEEDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
#: more decoder layers than any model has (the largest have a few hundred): the tables below list every layer's
#: modules, so a config claiming 10^9 layers would take gigabytes to describe before the first missing one is named
MAX_DECODER_LAYERS = 1 << 16


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _sizes(config: dict[str, Any]) -> tuple[str, dict[str, int]] | str:
    """(model_type, sizes) of a config the tables cover, or why not."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in DECODER_LINEARS:
        return f"model_type {model_type!r} is not one w4pack knows the layers of"
    missing = [k for k in _NEEDS if _int(config.get(k)) is None]
    if missing:
        return f"config.json lacks {', '.join(missing)}"
    if config["num_hidden_layers"] > MAX_DECODER_LAYERS:  # config_problem refuses such a config by name
        return f"num_hidden_layers {config['num_hidden_layers']} is more than {MAX_DECODER_LAYERS}"
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return model_type, {"layers": config["num_hidden_layers"], "hidden": hidden, "inter": config["intermediate_size"],
                        "heads": heads, "kv": _int(config.get("num_key_value_heads")) or heads,
                        "head": _int(config.get("head_dim")) or _HEAD_DIM.get(model_type) or hidden // heads}


def needed_tensors(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...] | None], str]:
    """(required, why): ``{tensor: shape}`` of every tensor the model needs besides its Linear weights (those are
    ``needed_linears``): the token embedding (``None`` shape without a vocab_size), each decoder layer's RMSNorm
    weights and the final norm. A packed embedding (a layer of role "embedding") stands for
    ``model.embed_tokens.weight``. ({}, the reason) when the model type or a size is unknown."""
    got = _sizes(config)
    if isinstance(got, str):
        return {}, got
    model_type, sz = got
    vocab = _int(config.get("vocab_size"))
    required: dict[str, tuple[int, ...] | None] = {
        "model.embed_tokens.weight": None if vocab is None else (vocab, sz["hidden"])}
    for i in range(sz["layers"]):
        for mod, size in DECODER_NORMS[model_type]:
            required[f"model.layers.{i}.{mod}.weight"] = (sz[size],)
    required["model.norm.weight"] = (sz["hidden"],)
    return required, ""


def tensor_problem(config: dict[str, Any], names: set[str], shape_of: Callable[[str], tuple[int, ...] | None],
                   embedding: bool) -> tuple[str, str] | None:
    """(tensor, what is wrong) for the first tensor of ``needed_tensors`` that ``names`` (the float tensors a
    checkpoint holds) lacks or holds in another shape (``shape_of``: None when it cannot tell cheaply), or None.
    ``embedding``: the token embedding is held packed (a layer of role "embedding")."""
    required, why = needed_tensors(config)
    if why:
        return None  # needed_linears' check says so (a warning in validate)
    mtype = config.get("model_type")
    for name, want in required.items():
        if name == "model.embed_tokens.weight" and embedding:
            continue  # its shape is checked with the layers
        if name not in names:
            return name, (f"the {mtype} model of config.json needs this tensor, which the checkpoint does not hold "
                          "(a damaged or partial checkpoint)")
        have = shape_of(name) if want is not None else None
        if have is not None and tuple(have) != want:
            return name, f"tensor is {list(have)} but the {mtype} model of config.json needs {list(want)}"
    return None


def needed_linears(config: dict[str, Any]) -> tuple[dict[str, tuple[int, int] | None], dict[str, tuple[int, int]
                                                                                                  | None], str]:
    """(required, optional, why) for a transformers ``config``: ``{module: [out, in]}`` of every Linear the model
    builds (``None`` where a size is unknown), the ones it may hold but does not need (a tied ``lm_head``), and
    an empty ``why``. When the model type is not in the table or the config lacks a size, ({}, {}, the reason)."""
    got = _sizes(config)
    if isinstance(got, str):
        return {}, {}, got
    model_type, sz = got
    block = DECODER_LINEARS[model_type]
    layers, hidden, inter, heads = sz["layers"], sz["hidden"], sz["inter"], sz["heads"]
    kv, head_dim = sz["kv"], sz["head"]
    shapes = {"q": (heads * head_dim, hidden), "kv": (kv * head_dim, hidden), "o": (hidden, heads * head_dim),
              "up": (inter, hidden), "down": (hidden, inter)}
    required: dict[str, tuple[int, int] | None] = {
        f"model.layers.{i}.{mod}": shapes[rule] for i in range(layers) for mod, rule in block}
    vocab = _int(config.get("vocab_size"))
    head = None if vocab is None else (vocab, hidden)
    optional: dict[str, tuple[int, int] | None] = {}
    # transformers' default for these families is an untied lm_head
    (optional if config.get("tie_word_embeddings") is True else required)["lm_head"] = head
    return required, optional, ""


def architecture_problem(config: dict[str, Any], layers: dict[str, dict[str, Any]],
                         fused: dict[str, list[dict[str, Any]]], floats: set[str],
                         shape_of: Callable[[str], tuple[int, ...] | None]) -> tuple[str, str, bool] | None:
    """(tensor, what is wrong, whether the packed layers are at fault rather than config.json) for the first way
    a checkpoint differs from what config.json's model needs, or None. ``layers``: manifest entries (``shape``,
    ``role``) by name; ``fused``: the manifest's fused table; ``floats``: the float tensors it holds, ``shape_of``
    gives their shapes. Both validate (on a folder) and the w4pack writer (before anything is moved into place)
    ask, so convert never writes what validate refuses. The caller checks ``needed_linears``' reason first."""
    required, optional, why = needed_linears(config)
    if why:
        return None
    mtype, count = config.get("model_type"), config.get("num_hidden_layers")
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    held: dict[str, tuple[int, int]] = {}
    for name, meta in layers.items():
        n, k = meta["shape"]
        if meta.get("role") == "embedding":  # a packed token embedding (FORMAT.md §5): [vocab, hidden]
            if name != "model.embed_tokens":
                return name, (f"the checkpoint has an embedding that a {mtype} model does not have (its token "
                              "embedding is model.embed_tokens)"), True
            if isinstance(vocab, int) and isinstance(hidden, int) and (n, k) != (vocab, hidden):
                return name, f"embedding is {[n, k]} but the {mtype} model of config.json needs {[vocab, hidden]}", True
            continue
        for part in fused.get(name, [{"name": name, "rows": [0, n]}]):
            lo, hi = part["rows"]
            held[part["name"]] = (hi - lo, k)
    for name in held:
        if name not in required and name not in optional:
            return name, (f"the checkpoint has a layer that a {mtype} model with {count} decoder layer{'' if count == 1 else 's'} does "
                          "not have (see config.json)"), True
    for name, want in {**required, **optional}.items():
        if name in held:
            have: tuple[int, ...] | None = held[name]
        elif f"{name}.weight" in floats:
            have = shape_of(f"{name}.weight")
        elif name in required:
            return name, (f"the {mtype} model of config.json needs this linear layer, which the checkpoint holds "
                          "neither packed (quantized layers) nor as a float weight"), True
        else:
            continue
        if want is not None and have is not None and tuple(have) != tuple(want):
            return name, f"layer is {list(have)} but the {mtype} model of config.json needs {list(want)}", name in held
    embedded = layers.get("model.embed_tokens", {}).get("role") == "embedding"
    found = tensor_problem(config, floats, shape_of, embedded)
    return None if found is None else (found[0], found[1], True)
