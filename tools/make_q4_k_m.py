#!/usr/bin/env python3
"""Requantize a GGUF into llama.cpp's Q4_K_M mix (gguf-py quantizes neither Q4_K nor Q6_K; this does).

    python tools/make_q4_k_m.py SRC.gguf OUT.gguf

Every weight is dequantized with gguf-py and quantized again by llama.cpp's Q4_K_M recipe
(``llama_tensor_get_type``): Q6_K for the head (or, with tied embeddings, the token embedding), for ``attn_v`` and
``ffn_down`` of the layers ``use_more_bits`` picks (the first and last eighth, and every third between), Q4_K for
the rest; a tensor whose row length is not a multiple of 256 takes llama.cpp's fallback (Q4_K -> Q5_0,
Q6_K -> Q8_0), as in every Q4_K_M file of a model with such widths (SmolLM2-135M: hidden size 576). Norms stay F32.

The K-quant blocks follow the form of llama.cpp's reference quantizers (the largest sub-scale of a super-block
at the end of its range: 63 for Q4_K, -128 for Q6_K); the per-group fit is a plain min/max (Q4_K) or max-abs
(Q6_K) one, not llama.cpp's iterative search, so the weights are a little less accurate than llama-quantize's.
Blocks are written by w4pack.formats.gguf_quants.encode from the integer codes and sub-scales chosen here, and
checked against gguf-py's dequantization of the written file.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from w4pack.core.canonical import CanonicalLayer  # noqa: E402
from w4pack.formats import gguf_quants  # noqa: E402

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> Q4_K bytes: per 32 weights a scale and minimum, each 6 bits times the fp16 d / dmin."""
    n, k = w.shape
    x = w.reshape(n, k // QK_K, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15
    mins = -lo
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(mins.max(-1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.rint(np.where(d[..., None] > 0, scale / d[..., None], 0)), 0, 63)
        mn = np.clip(np.rint(np.where(dmin[..., None] > 0, mins / dmin[..., None], 0)), 0, 63)
    s = d[..., None] * sc
    m = dmin[..., None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(np.where(s[..., None] > 0, (x + m[..., None]) / s[..., None], 0)), 0, 15)
    layer = CanonicalLayer(codes=q.astype(np.uint8).reshape(n, k), scales=s.reshape(n, -1).astype(np.float32),
                           bits=4, group_size=32, zero_mode="float", zeros=(-m).reshape(n, -1).astype(np.float32),
                           scale_dtype="float32")
    return gguf_quants.encode("Q4_K", layer)


def q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> Q6_K bytes: per 16 weights an int8 scale times the super-block's fp16 d, codes −32..31."""
    n, k = w.shape
    x = w.reshape(n, k // QK_K, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    top = scale.max(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(top > 0, -128 / top, 0)
        d = _f16(np.where(iscale != 0, 1 / iscale, 0))
        sc = np.clip(np.rint(iscale[..., None] * scale), -128, 127)
        s = d[..., None] * sc
        q = np.clip(np.rint(np.where(s[..., None] != 0, x / s[..., None], 0)), -32, 31) + 32
    layer = CanonicalLayer(codes=q.astype(np.uint8).reshape(n, k), scales=s.reshape(n, -1).astype(np.float32),
                           bits=6, group_size=16, zero_mode="none", scale_dtype="float32")
    return gguf_quants.encode("Q6_K", layer)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp: the layers that get the larger type in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def target_type(name: str, n_layer: int, has_output: bool) -> Q:
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return Q.F32
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return Q.Q6_K
    if ".attn_v." in name or ".ffn_down." in name:
        return Q.Q6_K if use_more_bits(int(name.split(".")[1]), n_layer) else Q.Q4_K
    return Q.Q4_K


def quantize(w: np.ndarray, qt: Q) -> tuple[np.ndarray, Q]:
    """(bytes, type) of a 2-D float32 weight, with llama.cpp's fallback for rows not a multiple of 256."""
    if w.shape[1] % QK_K:
        qt = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[qt]
    if qt == Q.Q4_K:
        return q4_k(w), qt
    if qt == Q.Q6_K:
        return q6_k(w), qt
    return gguf.quants.quantize(w, qt), qt


def main(src: str, out: str) -> int:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    n_layer = int(r.fields[f"{arch}.block_count"].contents())
    names = [t.name for t in r.tensors]
    has_output = "output.weight" in names
    w = gguf.GGUFWriter(out, arch=arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        val = f.contents()
        if f.name == "general.file_type":
            val = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, val, f.types[0], sub_type=sub)
    counts: dict[str, int] = {}
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        qt = target_type(t.name, n_layer, has_output)
        if qt == Q.F32 or x.ndim != 2:
            w.add_tensor(t.name, x)
            counts["F32"] = counts.get("F32", 0) + 1
            continue
        raw, qt = quantize(x, qt)
        back = gguf.quants.dequantize(raw, qt)
        err = float(np.sqrt(np.mean((back - x) ** 2)) / (np.sqrt(np.mean(x ** 2)) + 1e-30))
        if not err < 0.2:
            raise SystemExit(f"{t.name}: {qt.name} relative RMS error {err:.3f}: the quantizer is wrong")
        w.add_tensor(t.name, raw, raw_dtype=qt)
        counts[qt.name] = counts.get(qt.name, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out}: {Path(out).stat().st_size} bytes; tensors by type: {dict(sorted(counts.items()))}")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="the GGUF to re-quantize")
    ap.add_argument("out", help="the Q4_K_M GGUF to write")
    args = ap.parse_args()
    if not Path(args.src).is_file():
        ap.error(f"{args.src}: no such file")
    raise SystemExit(main(args.src, args.out))
