"""GGUF K-quant and 5-bit blocks ↔ the canonical form, bit-exactly, in pure numpy (no file access).

Each type below is an affine map of integer codes per group, so it is one canonical layer; the super-block's
fp16 ``d``/``dmin`` times a small integer sub-scale is exact in float32 (an fp16 has an 11-bit significand, the
sub-scales at most 8 bits), so the canonical scales are those products and nothing is rounded:

=======  =====  =========  ======  =====  =========  ============================================================
type     block  bytes      bits    group  zero mode  weight
=======  =====  =========  ======  =====  =========  ============================================================
Q2_K     256    84         2       16     float      d·sc·q − dmin·m        (sc, m: 4 bits)
Q3_K     256    110        3       16     none       d·(sc − 32)·(q − 4)    (sc: 6 bits; the scale may be negative)
Q4_K     256    144        4       32     float      d·sc·q − dmin·m        (sc, m: 6 bits)
Q5_K     256    176        5       32     float      d·sc·q − dmin·m        (sc, m: 6 bits)
Q6_K     256    210        6       16     none       d·sc·(q − 32)          (sc: int8)
Q5_0     32     22         5       32     none       d·(q − 16)             (scale stays fp16)
Q5_1     32     24         5       32     float      d·q + m                (scale and minimum stay fp16)
IQ4_NL   32     18         8       32     none       d·kv[q]                (code kv[q] + 128: the 4-bit index is
IQ4_XS   256    136        8       32     none       d·(ls − 32)·kv[q]       widened to its 8-bit codebook value;
                                                                            on disk it stays the 4-bit index)
=======  =====  =========  ======  =====  =========  ============================================================

A float-minimum layer's minimum is ``−dmin·m`` (canonical ``W = s·q + m``). llama.cpp and gguf-py compute
``(d·sc)·q − dmin·m`` in float32, which rounds once; the canonical float64 dequantization is the exact value,
and rounded to float32 it equals theirs bit for bit (the tests check both on every type).

Facts from ggml's block structs (ggml-common.h) and gguf-py's dequantizers; code written here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.canonical import CanonicalLayer
from ..core.compact import super_scales
from ..errors import BadInputError

__all__ = ["BlockType", "TYPES", "QK_K", "IQ4_NL_VALUES", "IQ4_CODEBOOK", "decode", "encode", "super_scales",
           "is_packable", "why_not_packable", "STORAGE", "storage_spec", "source_type"]

QK_K = 256
#: IQ4_NL / IQ4_XS codebook (ggml's kvalues_iq4nl)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)


@dataclass(frozen=True)
class BlockType:
    """How one GGUF block type maps onto a canonical layer."""

    name: str
    block: int  # weights per block along K
    nbytes: int  # bytes per block
    bits: int  # canonical code width
    group: int  # canonical group size
    zero_mode: str
    scale_dtype: str


TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q2_K", QK_K, 84, 2, 16, "float", "float32"),
    BlockType("Q3_K", QK_K, 110, 3, 16, "none", "float32"),
    BlockType("Q4_K", QK_K, 144, 4, 32, "float", "float32"),
    BlockType("Q5_K", QK_K, 176, 5, 32, "float", "float32"),
    BlockType("Q6_K", QK_K, 210, 6, 16, "none", "float32"),
    BlockType("Q5_0", 32, 22, 5, 32, "none", "float16"),
    BlockType("Q5_1", 32, 24, 5, 32, "float", "float16"),
    BlockType("IQ4_NL", 32, 18, 8, 32, "none", "float16"),
    BlockType("IQ4_XS", QK_K, 136, 8, 32, "none", "float32"),
)}

def _sub(per: int, bits: int, offset: int) -> dict[str, int]:
    return {"super_groups": per, "bits": bits, "offset": offset}


#: the 8-bit codes an IQ4 layer's 4-bit indices stand for (kvalues_iq4nl + 128), in index order
IQ4_CODEBOOK: list[int] = [int(v) + 128 for v in IQ4_NL_VALUES]

#: the compact storage (docs/LAYOUT.md §8) of each type's layers: what the block itself stores, so that a packed
#: folder is no larger than the GGUF (codes at their own width or as 4-bit codebook indices, fp16 d/dmin per 256
#: weights times the sub-scales)
STORAGE: dict[str, dict] = {
    "Q2_K": {"dense_codes": True, "scales": _sub(16, 4, 0), "mins": _sub(16, 4, 0)},
    "Q3_K": {"dense_codes": True, "scales": _sub(16, 6, -32)},
    "Q4_K": {"scales": _sub(8, 6, 0), "mins": _sub(8, 6, 0)},
    "Q5_K": {"dense_codes": True, "scales": _sub(8, 6, 0), "mins": _sub(8, 6, 0)},
    "Q6_K": {"dense_codes": True, "scales": _sub(16, 8, -128)},
    "Q5_0": {"dense_codes": True},
    "Q5_1": {"dense_codes": True},
    "IQ4_NL": {"codebook": IQ4_CODEBOOK},
    "IQ4_XS": {"codebook": IQ4_CODEBOOK, "scales": _sub(8, 6, -32)},
}


def source_type(source: dict | None) -> str | None:
    """The type a layer was read from: ``gguf_type`` of a GGUF source, or the ``gguf_type=...`` note a w4pack
    manifest keeps of it; None for other sources and types this module does not decode."""
    src = source or {}
    if src.get("format") != "gguf":
        return None
    qt = src.get("gguf_type")
    for note in src.get("notes") or []:
        if isinstance(note, str) and note.startswith("gguf_type="):
            qt = note[len("gguf_type="):]
    return str(qt) if qt is not None and is_packable(str(qt)) else None


def storage_spec(source: dict | None) -> dict | None:
    """The compact storage for a layer of this source (None: the runtime form, nothing to gain)."""
    qt = source_type(source)
    return STORAGE.get(qt) if qt is not None else None


#: types the canonical form cannot hold exactly, with the reason (said once per tensor when refusing to pack)
_NOT_AFFINE = {
    "IQ1_S": "grid-codebook quantization (vectors of a lattice, not an affine map of integer codes)",
    "IQ1_M": "grid-codebook quantization (vectors of a lattice, not an affine map of integer codes)",
    "IQ2_XXS": "grid-codebook quantization (vectors of a lattice, not an affine map of integer codes)",
    "IQ2_XS": "grid-codebook quantization (vectors of a lattice, not an affine map of integer codes)",
    "IQ2_S": "grid-codebook quantization (vectors of a lattice, not an affine map of integer codes)",
    "IQ3_XXS": "grid-codebook quantization (vectors of a lattice, not an affine map of integer codes)",
    "IQ3_S": "grid-codebook quantization (vectors of a lattice, not an affine map of integer codes)",
    "TQ1_0": "ternary base-3 packing with a per-256 scale (codes are not stored as bit fields)",
    "TQ2_0": "ternary packing with a per-256 scale",
    "MXFP4": "FP4 (E2M1) codes with a power-of-two block scale: not an affine map of integer codes",
    "NVFP4": "FP4 (E2M1) codes with an FP8 block scale: not an affine map of integer codes",
    "Q8_1": "an intermediate activation type, never a weight",
    "Q8_K": "an intermediate activation type, never a weight",
}


def is_packable(qtype: str) -> bool:
    return qtype in TYPES


def why_not_packable(qtype: str) -> str:
    """One line: why a tensor of this type is not packed (for notes and refusals)."""
    return _NOT_AFFINE.get(qtype, f"no exact canonical form for {qtype} is known to w4pack")


# ---------------------------------------------------------------------------------------------
# small helpers (all vectorized over [..., blocks, bytes])
# ---------------------------------------------------------------------------------------------
def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian bytes -> float16 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float16)


def _halves(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: byte j = element j (low nibble), element j + 16 (high nibble)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bitplanes(src: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """[..., c, L] -> [..., c, len(shifts), L]: field i of every byte, fields outermost (ggml's chunk order)."""
    sh = np.array(shifts, dtype=np.uint8).reshape(len(shifts), 1)
    return (src[..., None, :] >> sh) & np.uint8(mask)


def _scale_min_k4(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins ([..., 8] each, uint8).

    j < 4:  sc = b[j] & 63,                       m = b[j+4] & 63
    j >= 4: sc = (b[j+4] & 15) | (b[j-4] >> 6) << 4,  m = (b[j+4] >> 4) | (b[j] >> 6) << 4
    """
    b = sc12
    lo_s, lo_m, mix = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo_s & 63, (mix & 15) | ((lo_s >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_m & 63, (mix >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc, mn


def _scales_q3k(sc12: np.ndarray) -> np.ndarray:
    """Q3_K: 12 bytes -> sixteen 6-bit scales (uint8, still offset by 32).

    low 4 bits of scale j: nibble j // 8 of byte j % 8; high 2 bits: bits 2·(j // 4) of byte 8 + j % 4.
    """
    low = np.concatenate([sc12[..., 0:8] & 15, sc12[..., 0:8] >> 4], axis=-1)
    high = _bitplanes(sc12[..., 8:12], [0, 2, 4, 6], 3).reshape(sc12.shape[:-1] + (16,))
    return low | (high << 4)


def _blocks(raw: np.ndarray, bt: BlockType, n: int, k: int) -> np.ndarray:
    if k % bt.block:
        raise BadInputError(f"{bt.name} rows need in_features % {bt.block} == 0, got {k}")
    raw = np.asarray(raw, dtype=np.uint8)
    want = (n, k // bt.block * bt.nbytes)
    if raw.shape != want:
        raise BadInputError(f"{bt.name} data shape {list(raw.shape)} != {list(want)} for a [{n}, {k}] weight")
    return raw.reshape(n, k // bt.block, bt.nbytes)


# ---------------------------------------------------------------------------------------------
# per type: blocks [n, nb, bytes] -> (codes [n, nb, block], scales [n, nb, groups], minima or None)
# ---------------------------------------------------------------------------------------------
def _q2_k(b: np.ndarray):
    sc16, qs, d, dmin = b[..., 0:16], b[..., 16:80], _f16(b[..., 80:82]), _f16(b[..., 82:84])
    codes = _bitplanes(qs.reshape(qs.shape[:-1] + (2, 32)), [0, 2, 4, 6], 3)
    s = d.astype(np.float32)[..., None] * (sc16 & 15).astype(np.float32)
    m = -(dmin.astype(np.float32)[..., None] * (sc16 >> 4).astype(np.float32))
    return codes, s, m


def _q3_k(b: np.ndarray):
    hmask, qs, sc12, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    low = _bitplanes(qs.reshape(qs.shape[:-1] + (2, 32)), [0, 2, 4, 6], 3)
    high = _bitplanes(hmask, list(range(8)), 1)
    codes = low.reshape(low.shape[:-3] + (QK_K,)) | (high.reshape(high.shape[:-2] + (QK_K,)) << 2)
    s = d.astype(np.float32)[..., None] * (_scales_q3k(sc12).astype(np.float32) - 32)
    return codes, s, None


def _q4_k(b: np.ndarray):
    d, dmin, sc12, qs = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16], b[..., 16:144]
    q = qs.reshape(qs.shape[:-1] + (4, 32))
    codes = np.stack([q & 15, q >> 4], axis=-2)
    sc, mn = _scale_min_k4(sc12)
    s = d.astype(np.float32)[..., None] * sc.astype(np.float32)
    m = -(dmin.astype(np.float32)[..., None] * mn.astype(np.float32))
    return codes, s, m


def _q5_k(b: np.ndarray):
    d, dmin, sc12, qh, qs = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16], b[..., 16:48], b[..., 48:176]
    q = qs.reshape(qs.shape[:-1] + (4, 32))
    low = np.stack([q & 15, q >> 4], axis=-2).reshape(q.shape[:-2] + (QK_K,))
    high = _bitplanes(qh, list(range(8)), 1).reshape(qh.shape[:-1] + (QK_K,))
    sc, mn = _scale_min_k4(sc12)
    s = d.astype(np.float32)[..., None] * sc.astype(np.float32)
    m = -(dmin.astype(np.float32)[..., None] * mn.astype(np.float32))
    return low | (high << 4), s, m


def _q6_k(b: np.ndarray):
    ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    q = ql.reshape(ql.shape[:-1] + (2, 64))
    low = np.stack([q & 15, q >> 4], axis=-2).reshape(q.shape[:-2] + (QK_K,))
    high = _bitplanes(qh.reshape(qh.shape[:-1] + (2, 32)), [0, 2, 4, 6], 3).reshape(qh.shape[:-1] + (QK_K,))
    s = d.astype(np.float32)[..., None] * sc.view(np.int8).astype(np.float32)
    return low | (high << 4), s, None


def _q5_0(b: np.ndarray):
    d, qh, qs = _f16(b[..., 0:2]), b[..., 2:6], b[..., 6:22]
    high = _bitplanes(qh, list(range(8)), 1)  # [..., 4 bytes, 8 bits]: element 8·byte + bit
    high = np.swapaxes(high, -1, -2).reshape(qh.shape[:-1] + (32,))
    return _halves(qs) | (high << 4), d[..., None], None


def _q5_1(b: np.ndarray):
    d, m, qh, qs = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:8], b[..., 8:24]
    high = np.swapaxes(_bitplanes(qh, list(range(8)), 1), -1, -2).reshape(qh.shape[:-1] + (32,))
    return _halves(qs) | (high << 4), d[..., None], m[..., None]


def _iq4_nl(b: np.ndarray):
    d, qs = _f16(b[..., 0:2]), b[..., 2:18]
    codes = (IQ4_NL_VALUES[_halves(qs)] + 128).astype(np.uint8)
    return codes, d[..., None], None


def _iq4_xs(b: np.ndarray):
    d, sh, sl, qs = _f16(b[..., 0:2]), b[..., 2:4], b[..., 4:8], b[..., 8:136]
    # scale j: low nibble j % 2 of byte j // 2; high 2 bits at 2·j of the little-endian u16 scales_h
    low = np.stack([sl & 15, sl >> 4], axis=-1).reshape(sl.shape[:-1] + (8,))
    h16 = sh[..., 0].astype(np.uint16) | (sh[..., 1].astype(np.uint16) << 8)
    high = ((h16[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    ls = (low | (high << 4)).astype(np.float32) - 32
    q = qs.reshape(qs.shape[:-1] + (8, 16))
    idx = np.concatenate([q & 15, q >> 4], axis=-1).reshape(qs.shape[:-1] + (QK_K,))
    codes = (IQ4_NL_VALUES[idx] + 128).astype(np.uint8)
    return codes, d.astype(np.float32)[..., None] * ls, None


_DECODE = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q5_0": _q5_0,
           "Q5_1": _q5_1, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def decode(qtype: str, raw: np.ndarray, n: int, k: int) -> CanonicalLayer:
    """uint8 [N, K/block·bytes] of one GGUF tensor (numpy order: rows = out_features) → canonical layer.

    The layer is validated by the caller (non-finite fp16 d/dmin give non-finite scales, refused there)."""
    bt = TYPES[qtype]
    b = _blocks(raw, bt, n, k)
    with np.errstate(over="ignore", invalid="ignore"):
        codes, s, m = _DECODE[qtype](b)
    g = k // bt.group
    sdt = np.float16 if bt.scale_dtype == "float16" else np.float32
    return CanonicalLayer(
        codes=np.ascontiguousarray(codes, dtype=np.uint8).reshape(n, k),
        scales=np.ascontiguousarray(s, dtype=sdt).reshape(n, g), bits=bt.bits, group_size=bt.group,
        zero_mode=bt.zero_mode, zeros=None if m is None else np.ascontiguousarray(m, dtype=sdt).reshape(n, g),
        scale_dtype=bt.scale_dtype)


# ---------------------------------------------------------------------------------------------
# canonical -> blocks (GGUF written back in the type the layer was read from)
# ---------------------------------------------------------------------------------------------
def _join(fields: np.ndarray, shifts: list[int]) -> np.ndarray:
    """Inverse of ``_bitplanes``: [..., len(shifts), L] fields -> [..., L] bytes."""
    out = np.zeros(fields.shape[:-2] + fields.shape[-1:], dtype=np.uint8)
    for i, sh in enumerate(shifts):
        out |= (fields[..., i, :].astype(np.uint8) << np.uint8(sh))
    return out


def _h(x: np.ndarray) -> np.ndarray:
    """fp16 values [...] -> [..., 2] little-endian bytes."""
    return np.ascontiguousarray(np.asarray(x, dtype="<f2"))[..., None].view(np.uint8)


def encode(qtype: str, layer: CanonicalLayer) -> np.ndarray:
    """uint8 [N, K/block·bytes] of ``layer`` as GGUF ``qtype`` blocks; UnsupportedError with the reason when the
    layer's values are not exactly such blocks."""
    from ..core.dtypes import to_float64
    from ..errors import UnsupportedError

    bt = TYPES[qtype]
    n, k = layer.codes.shape

    def no(why: str) -> UnsupportedError:
        return UnsupportedError(f"not expressible as GGUF {qtype}: {why}", tensor=layer.name or None)

    zero_mode = layer.zero_mode
    if zero_mode == "int" and np.all(layer.zeros == (1 << (layer.bits - 1))):
        zero_mode = "none"
    if (layer.bits, layer.group_size, zero_mode) != (bt.bits, bt.group, bt.zero_mode):
        raise no(f"{layer.bits}-bit, group {layer.group_size}, zero {zero_mode} (needs {bt.bits}-bit, group "
                 f"{bt.group}, zero {bt.zero_mode})")
    if k % bt.block:
        raise no(f"in_features {k} is not a multiple of {bt.block}")
    if layer.act_order:
        raise no("act-order (permuted g_idx)")
    nb, per = k // bt.block, bt.block // bt.group
    c = layer.codes.reshape(n, nb, bt.block)
    s = to_float64(layer.scales, layer.scale_dtype).reshape(n, nb, per)
    m = None if zero_mode != "float" else to_float64(layer.zeros, layer.scale_dtype).reshape(n, nb, per)

    def halves(x: np.ndarray) -> np.ndarray:
        h = x.astype(np.float16)
        if not np.array_equal(h.astype(np.float64), x):
            raise no("parameters that are not fp16 values")
        return h

    def sup(vals: np.ndarray, lo: int, hi: int, what: str) -> tuple[np.ndarray, np.ndarray]:
        got = super_scales(vals, lo, hi)
        if got is None:
            raise no(f"{what} that are not an fp16 times integers in {lo}..{hi} per {bt.block} weights")
        return got

    if qtype in ("Q5_0", "Q5_1", "IQ4_NL"):
        d = halves(s[..., 0])
        if qtype == "IQ4_NL":
            lut = np.full(256, 255, dtype=np.uint8)
            lut[(IQ4_NL_VALUES + 128).astype(np.int64)] = np.arange(16, dtype=np.uint8)
            idx = lut[c]
            if (idx == 255).any():
                raise no("codes outside the IQ4_NL codebook")
            return np.concatenate([_h(d), idx[..., :16] | (idx[..., 16:] << 4)], axis=-1).reshape(n, -1)
        qs = (c[..., :16] & 15) | ((c[..., 16:] & 15) << 4)
        hb = ((c >> 4) & 1).reshape(n, nb, 4, 8)
        qh = _join(np.swapaxes(hb, -1, -2), list(range(8)))
        parts = [_h(d)] + ([_h(halves(m[..., 0]))] if qtype == "Q5_1" else []) + [qh, qs]
        return np.concatenate(parts, axis=-1).reshape(n, -1)
    if qtype in ("Q4_K", "Q5_K"):
        d, sc = sup(s, 0, 63, "scales")
        dmin, mn = sup(-m, 0, 63, "minima")
        sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
        b12 = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                              (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)
        q = c.reshape(n, nb, 4, 2, 32) & 15
        qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, nb, 128)
        parts = [_h(d), _h(dmin), b12]
        if qtype == "Q5_K":
            parts.append(_join(((c >> 4) & 1).reshape(n, nb, 8, 32), list(range(8))))
        return np.concatenate(parts + [qs], axis=-1).reshape(n, -1)
    if qtype == "Q6_K":
        d, sc = sup(s, -128, 127, "scales")
        low = (c & 15).reshape(n, nb, 2, 2, 64)
        ql = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(n, nb, 128)
        qh = _join((c >> 4).reshape(n, nb, 2, 4, 32), [0, 2, 4, 6]).reshape(n, nb, 64)
        return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _h(d)], axis=-1).reshape(n, -1)
    if qtype == "Q3_K":
        d, sc = sup(s, -32, 31, "scales")
        u = (sc + 32).astype(np.uint8)
        b12 = np.concatenate([(u[..., :8] & 15) | ((u[..., 8:] & 15) << 4),
                              _join((u >> 4).reshape(n, nb, 4, 4), [0, 2, 4, 6])], axis=-1)
        hmask = _join(((c >> 2) & 1).reshape(n, nb, 8, 32), list(range(8)))
        qs = _join((c & 3).reshape(n, nb, 2, 4, 32), [0, 2, 4, 6]).reshape(n, nb, 64)
        return np.concatenate([hmask, qs, b12, _h(d)], axis=-1).reshape(n, -1)
    if qtype == "Q2_K":
        d, sc = sup(s, 0, 15, "scales")
        dmin, mn = sup(-m, 0, 15, "minima")
        b16 = sc.astype(np.uint8) | (mn.astype(np.uint8) << 4)
        qs = _join(c.reshape(n, nb, 2, 4, 32), [0, 2, 4, 6]).reshape(n, nb, 64)
        return np.concatenate([b16, qs, _h(d), _h(dmin)], axis=-1).reshape(n, -1)
    if qtype == "IQ4_XS":
        d, ls = sup(s, -32, 31, "scales")
        u = (ls + 32).astype(np.uint16)
        sh = np.zeros((n, nb), dtype=np.uint16)
        for j in range(8):
            sh |= ((u[..., j] >> 4) & 3) << np.uint16(2 * j)
        sl = ((u[..., 0::2] & 15) | ((u[..., 1::2] & 15) << 4)).astype(np.uint8)
        lut = np.full(256, 255, dtype=np.uint8)
        lut[(IQ4_NL_VALUES + 128).astype(np.int64)] = np.arange(16, dtype=np.uint8)
        idx = lut[c].reshape(n, nb, 8, 32)
        if (idx == 255).any():
            raise no("codes outside the IQ4_NL codebook")
        qs = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(n, nb, 128)
        shb = np.ascontiguousarray(sh.astype("<u2"))[..., None].view(np.uint8)
        return np.concatenate([_h(d), shb, sl, qs], axis=-1).reshape(n, -1)
    raise no("no encoder")
