#!/usr/bin/env python3
"""Perplexity of a GGUF's weights as gguf-py dequantizes them, in transformers' float model: the reference for
``w4pack run FOLDER --perplexity TEXT`` on the folder converted from that GGUF.

    python tools/ppl_gguf_reference.py MODEL.gguf FOLDER TEXT [--window N]

transformers' own GGUF reader (``load_gguf_checkpoint``: gguf-py's dequantization, its own tensor names and
rotary un-permutation) fills a float32 model built from FOLDER's config.json; FOLDER's tokenizer and w4pack's
window loop (``w4pack.runtime.run.perplexity``) score the text, so the two figures differ only by the weights'
path (packed kernels vs float matmuls of the dequantized weights). Prints the JSON of ``perplexity``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("folder")
    ap.add_argument("text")
    ap.add_argument("--window", type=int, default=None)
    a = ap.parse_args()

    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from w4pack.runtime.run import perplexity

    cfg = json.loads((Path(a.folder) / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cls = getattr(transformers, cfg["architectures"][0])
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = cls(config).float().eval()
    ck = load_gguf_checkpoint(a.gguf, return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(v).float() for k, v in ck["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    tok = transformers.AutoTokenizer.from_pretrained(a.folder)
    print(json.dumps(perplexity((model, tok), a.text, window=a.window), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
