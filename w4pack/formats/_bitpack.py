"""LSB-first bit streams in int32 words, the packing GPTQ uses for qweight (along K) and qzeros (along N).

Values of ``bits`` bits are concatenated low bit first, 32 bits per little-endian word. For 2, 4 and 8
bits a word holds a whole number of values; 3-bit values run across words, 32 values per 3 words (the
"10-1-10-1-10" pattern). One routine per direction covers every width, so the reader and the writer
cannot disagree on the bit order.

The core works on streams along the *last* axis, where for 2/4/8 bits the little-endian words are
just bytes holding 8/bits values each: a byte-wise split is several times faster than word shifts,
and it makes qweight [K*b/32, N] -> codes [N, K] a transpose of 4-byte words, not of 1-byte codes.
"""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["STREAM_BITS", "words_for", "pack_last", "unpack_last", "pack_rows", "unpack_rows", "pack_cols",
           "unpack_cols"]

STREAM_BITS = (2, 3, 4, 8)
_LE_U32 = np.dtype("<u4")


def _check_bits(bits: int) -> None:
    if bits not in STREAM_BITS:
        raise ValueError(f"bit width {bits} is not one of {STREAM_BITS}")


def words_for(count: int, bits: int) -> int:
    """Number of int32 words holding ``count`` values; raises when the stream does not end on a word."""
    _check_bits(bits)
    if (count * bits) % 32:
        raise ValueError(f"{count} values of {bits} bits do not fill whole 32-bit words")
    return count * bits // 32


def _as_le_words(words: np.ndarray) -> np.ndarray:
    """Contiguous little-endian uint32 words (a view when the input already is, as on x86/ARM hosts)."""
    w = np.asarray(words)
    if w.dtype.kind not in "iu" or w.dtype.itemsize != 4:
        raise ValueError(f"expected 32-bit words, got {w.dtype}")
    if not w.dtype.isnative:
        w = w.astype(w.dtype.newbyteorder("="))
    w = np.ascontiguousarray(w).view(np.uint32)
    return w if sys.byteorder == "little" else w.astype(_LE_U32)


def unpack_last(words: np.ndarray, bits: int) -> np.ndarray:
    """32-bit words [..., W] holding a stream along the last axis -> uint8 values [..., W*32/bits]."""
    _check_bits(bits)
    w = _as_le_words(words)
    lead, nw = w.shape[:-1], w.shape[-1]
    if 8 % bits == 0:
        by = w.view(np.uint8).reshape(*lead, nw * 4)
        if bits == 8:
            return by.copy()
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        out = np.empty(by.shape + (per,), dtype=np.uint8)
        for j in range(per):
            out[..., j] = (by >> np.uint8(bits * j)) & mask
        return out.reshape(*lead, nw * 4 * per)
    # 3 bits: 3 words carry 32 values; value j sits at stream bits [3j, 3j+3)
    if nw % bits:
        raise ValueError(f"{nw} words of a {bits}-bit stream do not hold whole 32-value blocks")
    blk = w.reshape(*lead, nw // bits, bits)
    mask32 = np.uint32((1 << bits) - 1)
    out = np.empty(blk.shape[:-1] + (32,), dtype=np.uint8)
    for j in range(32):
        wi, s = divmod(bits * j, 32)
        v = blk[..., wi] >> np.uint32(s)
        if s + bits > 32:
            v = v | (blk[..., wi + 1] << np.uint32(32 - s))
        out[..., j] = v & mask32
    return out.reshape(*lead, nw // bits * 32)


def pack_last(values: np.ndarray, bits: int) -> np.ndarray:
    """uint values [..., L] (each < 2**bits) -> int32 words [..., L*bits/32], stream along the last axis."""
    _check_bits(bits)
    v = np.ascontiguousarray(values)
    lead, length = v.shape[:-1], v.shape[-1]
    nwords = words_for(length, bits)
    if 8 % bits == 0:
        v8 = v.astype(np.uint8, copy=False)
        if bits == 8:
            by = v8
        else:
            per = 8 // bits
            grp = v8.reshape(*lead, length // per, per)
            by = grp[..., 0].copy()
            for j in range(1, per):
                by |= grp[..., j] << np.uint8(bits * j)
        return np.ascontiguousarray(by).view(_LE_U32).reshape(*lead, nwords).astype(np.uint32).view(np.int32)
    blocks = v.astype(np.uint32).reshape(*lead, length // 32, 32)
    out = np.zeros(blocks.shape[:-1] + (bits,), dtype=np.uint32)
    for j in range(32):
        wi, s = divmod(bits * j, 32)
        out[..., wi] |= blocks[..., j] << np.uint32(s)  # bits shifted past 31 fall off (mod 2**32)
        if s + bits > 32:
            out[..., wi + 1] |= blocks[..., j] >> np.uint32(32 - s)
    return out.reshape(*lead, nwords).view(np.int32)


def unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """Words [R, C] packed along axis 0 -> values [R*32/bits, C]."""
    return np.ascontiguousarray(unpack_last(np.ascontiguousarray(np.asarray(words).T), bits).T)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """Values [L, C] -> int32 words [L*bits/32, C] packed along axis 0."""
    return np.ascontiguousarray(pack_last(np.ascontiguousarray(np.asarray(values).T), bits).T)


def unpack_cols(words: np.ndarray, bits: int) -> np.ndarray:
    """Words [R, C] packed along axis 1 -> values [R, C*32/bits]."""
    return unpack_last(words, bits)


def pack_cols(values: np.ndarray, bits: int) -> np.ndarray:
    """Values [R, L] -> int32 words [R, L*bits/32] packed along axis 1."""
    return pack_last(values, bits)
