"""Which linear layers a model needs, from its ``config.json`` alone (no transformers, no weights).

Why: a packed checkpoint's manifest lists the layers it holds; a layer entry that went missing (or one that
belongs to another model) is otherwise found only when the runtime builds the model and a ``Linear`` stays
empty. ``validate`` checks the manifest against this table so the folder is refused up front, naming the layer.

The table covers the decoder-only families whose module names w4pack knows (the same families as the GGUF
name table); another ``model_type`` is not guessed at: the check is skipped and says so.
"""
from __future__ import annotations

from typing import Any

__all__ = ["DECODER_LINEARS", "needed_linears"]

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
#: head_dim when config.json has none (transformers' defaults; others use hidden_size // num_attention_heads)
_HEAD_DIM = {"qwen3": 128}
#: config keys the shapes need
_NEEDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def needed_linears(config: dict[str, Any]) -> tuple[dict[str, tuple[int, int] | None], dict[str, tuple[int, int]
                                                                                                  | None], str]:
    """(required, optional, why) for a transformers ``config``: ``{module: [out, in]}`` of every Linear the model
    builds (``None`` where a size is unknown), the ones it may hold but does not need (a tied ``lm_head``), and
    an empty ``why``. When the model type is not in the table or the config lacks a size, ({}, {}, the reason)."""
    model_type = config.get("model_type")
    block = DECODER_LINEARS.get(model_type) if isinstance(model_type, str) else None
    if block is None:
        return {}, {}, f"model_type {model_type!r} is not one w4pack knows the layers of"
    missing = [k for k in _NEEDS if _int(config.get(k)) is None]
    if missing:
        return {}, {}, f"config.json lacks {', '.join(missing)}"
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    inter, heads = config["intermediate_size"], config["num_attention_heads"]
    kv = _int(config.get("num_key_value_heads")) or heads
    head_dim = _int(config.get("head_dim")) or _HEAD_DIM.get(model_type) or hidden // heads
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
