"""GGUF (llama.cpp) tensor names <-> Hugging Face transformers names, per architecture.

llama.cpp renames every tensor (``blk.N.attn_q.weight``); a converted checkpoint must use the transformers names
(``model.layers.N.self_attn.q_proj.weight``) so that the folder loads as a normal model. The table covers the
decoder-only architectures w4pack converts; anything else is refused rather than guessed.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["ARCHS", "gguf_to_hf", "hf_to_gguf", "is_linear", "is_embedding", "is_row_vector", "permutes_qk",
           "build_config", "config_to_metadata"]

#: GGUF architecture -> (transformers model_type, class name, whether llama.cpp permuted q/k rows for rotary)
ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", False),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
}
#: llama.cpp writes Mixtral as arch "llama" with llama.expert_count
MIXTRAL = ("mixtral", "MixtralForCausalLM")

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: mixture-of-experts block tensors (the per-expert stacked ones are split by _experts.py); "{moe}" is the MoE
#: block's sub-path: "block_sparse_moe" (Mixtral, arch llama) or "mlp" (Qwen-MoE)
_MOE_BLOCK = {
    "ffn_gate_inp": "{moe}.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: block tensors that llama.cpp stores 1-D ([N]) where transformers has a one-row matrix ([1, N]): Qwen2-MoE's
#: shared-expert gate is ``nn.Linear(hidden, 1)`` (weight [1, H]) and llama.cpp's converter writes it as
#: {n_embd}. The reader gives it transformers' shape and the writer llama.cpp's: the values are the same.
_ROW_VECTORS = frozenset({"ffn_gate_inp_shexp"})
_BLOCK_REV = {v: k for k, v in _BLOCK.items()}
_GLOBAL_REV = {v: k for k, v in _GLOBAL.items()}
_GGUF_BLK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GGUF_GLOBAL = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")
_HF_BLK = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_LINEAR_SUFFIXES = ("_proj", "lm_head")


def _moe_sub(arch: str | None) -> str:
    from ._experts import GGUF_MOE_BLOCK

    return GGUF_MOE_BLOCK.get(arch or "", ("mlp", "proj"))[0]


def gguf_to_hf(name: str, arch: str | None = None) -> str | None:
    """The transformers name of a GGUF tensor, or None when the table does not know it (``arch`` places the
    MoE router: Mixtral's ``block_sparse_moe.gate``, Qwen-MoE's ``mlp.gate``)."""
    m = _GGUF_BLK.match(name)
    if m:
        sub = _BLOCK.get(m.group(2))
        if sub is None and m.group(2) in _MOE_BLOCK:
            sub = _MOE_BLOCK[m.group(2)].format(moe=_moe_sub(arch))
        return None if sub is None else f"model.layers.{m.group(1)}.{sub}.{m.group(3)}"
    m = _GGUF_GLOBAL.match(name)
    if m and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    return None


def hf_to_gguf(name: str) -> str | None:
    """The GGUF name of a transformers tensor, or None when the table does not know it."""
    m = _HF_BLK.match(name)
    if m:
        sub = _BLOCK_REV.get(m.group(2))
        if sub is None:
            sub = next((g for g, h in _MOE_BLOCK.items()
                        if m.group(2) in {h.format(moe="mlp"), h.format(moe="block_sparse_moe")}), None)
        return None if sub is None else f"blk.{m.group(1)}.{sub}.{m.group(3)}"
    mod, _, kind = name.rpartition(".")
    if kind in ("weight", "bias") and mod in _GLOBAL_REV:
        return f"{_GLOBAL_REV[mod]}.{kind}"
    return None


def is_row_vector(gguf_name: str) -> bool:
    """True for a GGUF weight stored 1-D whose transformers parameter is [1, N] (``_ROW_VECTORS``)."""
    m = _GGUF_BLK.match(gguf_name)
    return m is not None and m.group(2) in _ROW_VECTORS and m.group(3) == "weight"


def is_linear(hf_module: str) -> bool:
    """True for the projection modules a quantized GGUF tensor can become a w4pack layer of."""
    return hf_module.endswith(_LINEAR_SUFFIXES)


def is_embedding(hf_module: str) -> bool:
    return hf_module.endswith("embed_tokens")


def permutes_qk(arch: str) -> bool:
    return ARCHS[arch][2]


def _f32(x: Any) -> float:
    """A GGUF float32 as the shortest decimal that reads back to it (9.99999974e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(x)))


def build_config(arch: str, meta: dict[str, Any], *, has_output: bool,
                 vocab_hint: int | None) -> tuple[dict[str, Any], list[str]]:
    """config.json for ``arch`` from GGUF metadata; returns (config, missing keys). Empty config when incomplete."""
    model_type, cls, _perm = ARCHS[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    need = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count"]
    missing = [f"{arch}.{k}" for k in need if get(k) is None]
    if missing:
        return {}, missing
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    vocab = get("vocab_size")
    if vocab is None:
        toks = meta.get("tokenizer.ggml.tokens")
        vocab = len(toks) if toks is not None else vocab_hint
    theta = _f32(get("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if vocab is not None:
        cfg["vocab_size"] = int(vocab)
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        factor = get("rope.scaling.factor")
        rp = {"rope_type": str(scaling), "rope_theta": theta}
        if factor is not None:
            rp["factor"] = _f32(factor)
        orig = get("rope.scaling.original_context_length")
        if orig is not None:
            rp["original_max_position_embeddings"] = int(orig)
        cfg["rope_parameters"] = rp
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = int(v)
    if arch in ("qwen2", "qwen2moe"):
        cfg["attention_bias"] = True
        cfg["qkv_bias"] = True
    experts = get("expert_count")
    if experts:
        if arch == "llama":
            cfg["model_type"], cfg["architectures"] = MIXTRAL[0], [MIXTRAL[1]]
            cfg["num_local_experts"] = int(experts)
        else:
            cfg["num_experts"] = int(experts)
            cfg["moe_intermediate_size"] = int(get("expert_feed_forward_length", cfg["intermediate_size"]))
            cfg["norm_topk_prob"] = arch == "qwen3moe"  # llama.cpp: qwen3moe renormalises, qwen2moe does not
            cfg["decoder_sparse_step"] = 1
            cfg["mlp_only_layers"] = []
        cfg["num_experts_per_tok"] = int(get("expert_used_count", 2))
        shared = get("expert_shared_feed_forward_length")
        if shared:
            cfg["shared_expert_intermediate_size"] = int(shared)
    return cfg, []


def config_to_metadata(cfg: dict[str, Any]) -> tuple[str, dict[str, tuple[str, Any]]] | None:
    """(arch, {gguf key: (kind, value)}) for a transformers config, or None when the model type is not known."""
    model_type = cfg.get("model_type")
    arch = "llama" if model_type == MIXTRAL[0] else \
        next((a for a, (mt, _c, _p) in ARCHS.items() if mt == model_type), None)
    if arch is None:
        return None
    out: dict[str, tuple[str, Any]] = {}

    def put(key: str, kind: str, hf: str, default: Any = None) -> None:
        v = cfg.get(hf, default)
        if v is not None:
            out[f"{arch}.{key}"] = (kind, v)

    put("block_count", "u32", "num_hidden_layers")
    put("context_length", "u32", "max_position_embeddings")
    put("embedding_length", "u32", "hidden_size")
    put("feed_forward_length", "u32", "intermediate_size")
    put("attention.head_count", "u32", "num_attention_heads")
    put("attention.head_count_kv", "u32", "num_key_value_heads", cfg.get("num_attention_heads"))
    put("attention.layer_norm_rms_epsilon", "f32", "rms_norm_eps")
    put("vocab_size", "u32", "vocab_size")
    put("expert_count", "u32", "num_local_experts" if model_type == MIXTRAL[0] else "num_experts")
    put("expert_used_count", "u32", "num_experts_per_tok")
    if model_type != MIXTRAL[0]:
        put("expert_feed_forward_length", "u32", "moe_intermediate_size")
    put("expert_shared_feed_forward_length", "u32", "shared_expert_intermediate_size")
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
    if head_dim:
        out[f"{arch}.rope.dimension_count"] = ("u32", int(head_dim))
        if not cfg.get("hidden_size") or not heads or int(head_dim) != int(cfg["hidden_size"]) // int(heads):
            out[f"{arch}.attention.key_length"] = ("u32", int(head_dim))
            out[f"{arch}.attention.value_length"] = ("u32", int(head_dim))
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    if theta is not None:
        out[f"{arch}.rope.freq_base"] = ("f32", float(theta))
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        v = cfg.get(hf)
        if isinstance(v, int):
            out[f"tokenizer.ggml.{key}"] = ("u32", v)
    return arch, out
