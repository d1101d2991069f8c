"""Write a small random checkpoint for the demo and the README example.

Round-to-nearest quantization of random float weights shaped like a tiny Llama block, written as a GPTQ
checkpoint when the GPTQ writer is available, else directly as w4pack. Not a real model: its job is to
exercise convert → inspect → validate end to end on any machine in a second.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from w4pack.canonical import CanonicalLayer  # noqa: E402
from w4pack.checkpoint import CheckpointWriter  # noqa: E402
from w4pack.dtypes import from_float32  # noqa: E402

HIDDEN, INTER, LAYERS = 256, 704, 2
PROJ = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
        "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}


def rtn(w: np.ndarray, bits: int = 4, group: int = 64) -> CanonicalLayer:
    """Asymmetric round-to-nearest per group of `group` input columns."""
    n, k = w.shape
    g = -(-k // group)
    pad = np.pad(w, ((0, 0), (0, g * group - k)), mode="edge").reshape(n, g, group)
    lo, hi = pad.min(-1), pad.max(-1)
    qmax = (1 << bits) - 1
    scale = from_float32(np.maximum(hi - lo, 1e-5) / qmax, "float16")
    s = scale.astype(np.float32)
    zero = np.clip(np.round(-lo / s), 0, qmax).astype(np.int32)
    q = np.clip(np.round(pad / s[..., None]) + zero[..., None], 0, qmax).reshape(n, -1)[:, :k]
    return CanonicalLayer(codes=q.astype(np.uint8), scales=scale, bits=bits, group_size=group, zero_mode="int",
                          zeros=zero, scale_dtype="float16")


def config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
            "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "torch_dtype": "float16", "tie_word_embeddings": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    with CheckpointWriter(args.out, config=config(), source={"format": "rtn-demo"}, force=args.force) as w:
        for i in range(LAYERS):
            for proj, (n, k) in PROJ.items():
                w.add_layer(f"model.layers.{i}.{proj}", rtn(rng.standard_normal((n, k)).astype(np.float32) / 16))
            w.add_tensor(f"model.layers.{i}.input_layernorm.weight", np.ones(HIDDEN, np.float16))
            w.add_tensor(f"model.layers.{i}.post_attention_layernorm.weight", np.ones(HIDDEN, np.float16))
        w.add_tensor("model.embed_tokens.weight", (rng.standard_normal((1000, HIDDEN)) / 16).astype(np.float16))
        w.add_tensor("model.norm.weight", np.ones(HIDDEN, np.float16))
        w.add_tensor("lm_head.weight", (rng.standard_normal((1000, HIDDEN)) / 16).astype(np.float16))
    print(args.out)


if __name__ == "__main__":
    main()
