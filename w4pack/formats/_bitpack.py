"""LSB-first bit streams in int32 words, the packing GPTQ uses for qweight (along K) and qzeros (along N).

Values of ``bits`` bits are concatenated low bit first, 32 bits per little-endian word, along one axis.
For 2, 4 and 8 bits a word holds a whole number of values; 3-bit values run across words, 32 values
per 3 words (the "10-1-10-1-10" pattern). One routine per direction covers every width, so the
reader and the writer cannot disagree on the bit order.
"""
from __future__ import annotations

import numpy as np

__all__ = ["STREAM_BITS", "pack_rows", "unpack_rows", "pack_cols", "unpack_cols", "words_for"]

STREAM_BITS = (2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in STREAM_BITS:
        raise ValueError(f"bit width {bits} is not one of {STREAM_BITS}")


def words_for(count: int, bits: int) -> int:
    """Number of int32 words holding ``count`` values; raises when the stream does not end on a word."""
    _check_bits(bits)
    if (count * bits) % 32:
        raise ValueError(f"{count} values of {bits} bits do not fill whole 32-bit words")
    return count * bits // 32


def unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """int32/uint32 words [R, C] packed along axis 0 -> uint8 values [R*32/bits, C]."""
    _check_bits(bits)
    w = np.ascontiguousarray(words).view(np.uint32)
    if w.ndim != 2:
        raise ValueError("expected a 2-D array of words")
    rows, cols = w.shape
    mask = np.uint32((1 << bits) - 1)
    if 32 % bits == 0:
        per = 32 // bits
        out = np.empty((rows, per, cols), dtype=np.uint8)
        for j in range(per):
            out[:, j, :] = (w >> np.uint32(bits * j)) & mask
        return out.reshape(rows * per, cols)
    # 3 bits: 3 words carry 32 values; value j sits at stream bits [3j, 3j+3)
    if rows % bits:
        raise ValueError(f"{rows} rows of {bits}-bit words do not hold whole 32-value blocks")
    blk = w.reshape(rows // bits, bits, cols)
    out = np.empty((rows // bits, 32, cols), dtype=np.uint8)
    for j in range(32):
        off = bits * j
        wi, s = divmod(off, 32)
        v = blk[:, wi, :] >> np.uint32(s)
        if s + bits > 32:
            v = v | (blk[:, wi + 1, :] << np.uint32(32 - s))
        out[:, j, :] = v & mask
    return out.reshape(rows // bits * 32, cols)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """uint values [L, C] (each < 2**bits) -> int32 words [L*bits/32, C] packed along axis 0."""
    _check_bits(bits)
    v = np.asarray(values)
    if v.ndim != 2:
        raise ValueError("expected a 2-D array of values")
    length, cols = v.shape
    nwords = words_for(length, bits)
    v32 = v.astype(np.uint32, copy=False)
    if 32 % bits == 0:
        per = 32 // bits
        blocks = v32.reshape(nwords, per, cols)
        out = np.zeros((nwords, cols), dtype=np.uint32)
        for j in range(per):
            out |= blocks[:, j, :] << np.uint32(bits * j)
        return out.view(np.int32)
    if length % 32:
        raise ValueError(f"{length} values of {bits} bits do not fill whole 32-value blocks")
    blocks = v32.reshape(length // 32, 32, cols)
    out = np.zeros((length // 32, bits, cols), dtype=np.uint32)
    for j in range(32):
        off = bits * j
        wi, s = divmod(off, 32)
        out[:, wi, :] |= blocks[:, j, :] << np.uint32(s)  # bits shifted past 31 fall off (mod 2**32)
        if s + bits > 32:
            out[:, wi + 1, :] |= blocks[:, j, :] >> np.uint32(32 - s)
    return out.reshape(nwords, cols).view(np.int32)


def unpack_cols(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [R, C] packed along axis 1 -> uint8 values [R, C*32/bits]."""
    return np.ascontiguousarray(unpack_rows(np.ascontiguousarray(np.asarray(words).T), bits).T)


def pack_cols(values: np.ndarray, bits: int) -> np.ndarray:
    """uint values [R, L] -> int32 words [R, L*bits/32] packed along axis 1."""
    return np.ascontiguousarray(pack_rows(np.ascontiguousarray(np.asarray(values).T), bits).T)
