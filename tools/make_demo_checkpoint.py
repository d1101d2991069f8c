"""Write a small random-weight Llama as a 4-bit GPTQ checkpoint: the peer input of `make demo` and the README.

Round-to-nearest quantization (4-bit, group 64, asymmetric integer zero points) of random float weights shaped
like a tiny two-block Llama, written by w4pack's GPTQ writer (v1 packing, byte-identical to the peers' packers:
what AutoGPTQ and GPTQModel write). A character-level tokenizer goes beside it when the `tokenizers` package is
installed (the `[hf]` extra), so `w4pack run` can generate from it. Not a trained model: its text is noise; its
job is to exercise convert, verify, run and export end to end on any machine in seconds.

    python tools/make_demo_checkpoint.py out/demo/source-gptq [--seed 0] [--force]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from w4pack.canonical import CanonicalLayer  # noqa: E402
from w4pack.dtypes import from_float32  # noqa: E402
from w4pack.formats import get_format  # noqa: E402
from w4pack.formats.base import Source, TensorData  # noqa: E402
from w4pack.errors import W4PackError  # noqa: E402

HIDDEN, INTER, LAYERS = 256, 704, 2
VOCAB = 100  # the character tokenizer: 4 special tokens, 95 printable ASCII characters, newline
PROJ = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
        "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}


def rtn(w: np.ndarray, bits: int = 4, group: int = 64) -> CanonicalLayer:
    """Asymmetric round-to-nearest per group of `group` input columns, zero points in 1..15 (GPTQ v1 stores
    zero - 1, so a zero point of 0 would not round-trip through the peers' v1 readers)."""
    n, k = w.shape
    g = -(-k // group)
    pad = np.pad(w, ((0, 0), (0, g * group - k)), mode="edge").reshape(n, g, group)
    lo, hi = np.minimum(pad.min(-1), 0), np.maximum(pad.max(-1), 0)
    qmax = (1 << bits) - 1
    scale = from_float32(np.maximum(hi - lo, 1e-5) / qmax, "float16")
    s = scale.astype(np.float32)
    zero = np.clip(np.round(-lo / s), 1, qmax).astype(np.int32)
    q = np.clip(np.round(pad / s[..., None]) + zero[..., None], 0, qmax).reshape(n, -1)[:, :k]
    return CanonicalLayer(codes=q.astype(np.uint8), scales=scale, bits=bits, group_size=group, zero_mode="int",
                          zeros=zero, scale_dtype="float16")


def config() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
            "num_key_value_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "torch_dtype": "float16", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}


def char_tokenizer(folder: Path) -> list[Path]:
    """tokenizer.json + tokenizer_config.json of a character-level tokenizer (ids < VOCAB); [] without the
    `tokenizers` package."""
    try:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return []
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    assert len(vocab) == VOCAB
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True}, indent=2) + "\n")
    return [folder / "tokenizer.json", folder / "tokenizer_config.json"]


class RandomLlama(Source):
    """The random model as a Source, layer by layer, so the GPTQ writer streams it like any other."""

    def __init__(self, seed: int, side: list[Path]):
        self.config = config()
        self.info = {"format": "rtn-demo", "notes": ["random weights, round-to-nearest 4-bit"]}
        self.path = Path("<random llama>")
        rng = np.random.default_rng(seed)
        self._layers: dict[str, np.ndarray] = {}
        self._tensors: dict[str, np.ndarray] = {}
        for i in range(LAYERS):
            for proj, (n, k) in PROJ.items():
                self._layers[f"model.layers.{i}.{proj}"] = rng.standard_normal((n, k)).astype(np.float32) / 16
            self._tensors[f"model.layers.{i}.input_layernorm.weight"] = np.ones(HIDDEN, np.float16)
            self._tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float16)
        self._tensors["model.embed_tokens.weight"] = (rng.standard_normal((VOCAB, HIDDEN)) / 16).astype(np.float16)
        self._tensors["model.norm.weight"] = np.ones(HIDDEN, np.float16)
        self._tensors["lm_head.weight"] = (rng.standard_normal((VOCAB, HIDDEN)) / 16).astype(np.float16)
        self._side = side

    def layer_names(self) -> list[str]:
        return list(self._layers)

    def read_layer(self, name: str) -> CanonicalLayer:
        return rtn(self._layers[name]).replace(name=name).validate()

    def passthrough_names(self) -> list[str]:
        return list(self._tensors)

    def read_tensor(self, name: str) -> TensorData:
        return TensorData(self._tensors[name], "float16")

    def side_files(self) -> list[Path]:
        return list(self._side)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    tok_dir = Path(tempfile.mkdtemp(prefix="w4pack-demo-tok-"))
    try:
        get_format("gptq").write(RandomLlama(args.seed, char_tokenizer(tok_dir)), args.out, force=args.force)
    except W4PackError as exc:  # (an existing output without --force: 4, as the w4pack commands exit)
        print(f"make_demo_checkpoint: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
