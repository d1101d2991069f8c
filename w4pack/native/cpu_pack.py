"""The native conversion helpers (native/cpu_pack.c), registered as fast paths of core (w4pack.fastpath).

Each is bit-identical to its numpy spec (layout.pack's interleave, the GPTQ bit stream) and declines
(returns None) for arrays it cannot walk, so the numpy code runs instead. Little-endian hosts only;
``$W4PACK_NO_NATIVE_PACK`` turns them off.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ..core import fastpath
from ..errors import BadInputError
from ..core.layout import TILE_K, TILE_N, WARP, padded_shape, words_per_tile_lane
from ..core.scratch import ScratchPool, take
from .cpu import check_rc, default_threads

try:
    from .._w4p_cpu import ffi, lib as _cpu_lib
except ImportError:  # pragma: no cover - only without a build
    ffi = _cpu_lib = None

__all__ = ["lib", "pack_codes", "gptq_unpack_codes", "gptq_pack_layout_v1", "register"]


def _conversion_lib() -> Any:
    """The CPU extension's lib when it has the conversion entry points (little-endian hosts), else None."""
    if _cpu_lib is None or sys.byteorder != "little" or os.environ.get("W4PACK_NO_NATIVE_PACK"):
        return None
    return _cpu_lib if hasattr(_cpu_lib, "w4p_pack_layout_v1") else None


#: the lib with the conversion entry points, or None (then nothing is registered)
lib = _conversion_lib()


def pack_codes(codes: np.ndarray, perm: np.ndarray | None, sbits: int, bits: int | None = None,
               name: str = "") -> np.ndarray | None:
    """Pad, permute and interleave in one native pass (bit-identical to layout's numpy path), or None
    when the array is not row-contiguous. Codes above 2**bits - 1 (bits defaults to sbits) raise
    BadInputError like CanonicalLayer.validate."""
    if lib is None or codes.ndim != 2 or codes.strides[1] != 1 or codes.strides[0] < codes.shape[1]:
        return None  # e.g. a column-strided or row-reversed view: the numpy path handles any layout
    n, k = codes.shape
    np_, kp = padded_shape(n, k)
    out = take((np_ // TILE_N, kp // TILE_K * WARP * words_per_tile_lane(sbits)), "<i4")
    p = ffi.NULL
    if perm is not None:
        perm = np.ascontiguousarray(perm, dtype=np.int32)
        p = ffi.from_buffer("int32_t[]", perm)
    src = ffi.cast("const uint8_t *", codes.__array_interface__["data"][0])
    seen = ffi.new("int32_t *")
    rc = lib.w4p_pack_layout_v1(src, codes.strides[0], n, k, p, sbits,
                                ffi.from_buffer("int32_t[]", out), seen, default_threads())
    check_rc(rc, "pack")
    qmax = (1 << (bits or sbits)) - 1
    if seen[0] > qmax:
        raise BadInputError(f"codes exceed {qmax}, the largest {bits or sbits}-bit value (max {seen[0]})",
                            tensor=name or None)
    return out


def _word_rows(w: np.ndarray) -> bool:
    """True for a 2-D array of native 4-byte integers with contiguous rows the C code can walk."""
    return (w.ndim == 2 and w.dtype.kind in "iu" and w.dtype.itemsize == 4 and w.dtype.isnative
            and w.strides[1] == 4 and w.strides[0] % 4 == 0)


def gptq_unpack_codes(words: np.ndarray, bits: int, pool: ScratchPool | None = None) -> np.ndarray | None:
    """GPTQ qweight [K*b/32, N] -> codes uint8 [N, K] (transpose + split) for 4 and 8 bits, else None."""
    w = np.asarray(words)
    if lib is None or bits not in (4, 8) or not _word_rows(w) or 0 in w.shape:
        return None
    rows, n = w.shape
    k = rows * 32 // bits
    out = pool.take((n, k), np.uint8) if pool is not None else np.empty((n, k), dtype=np.uint8)
    src = ffi.cast("const int32_t *", w.__array_interface__["data"][0])
    check_rc(lib.w4p_gptq_unpack_codes(src, w.strides[0] // 4, rows, n, bits, ffi.from_buffer("uint8_t[]", out), k,
                                       default_threads()), "GPTQ qweight unpack")
    return out


def gptq_pack_layout_v1(words: np.ndarray, n: int, k: int, perm: np.ndarray | None, name: str = "") -> np.ndarray:
    """4-bit GPTQ qweight [K/8, N] straight into layout v1 words: the bytes of layout.pack of its codes."""
    if not _word_rows(words):
        words = np.ascontiguousarray(words, dtype=np.int32)
    np_, kp = padded_shape(n, k)
    out = take((np_ // TILE_N, kp // TILE_K * WARP * 4), "<i4")
    p = ffi.NULL
    if perm is not None:
        perm = np.ascontiguousarray(perm, dtype=np.int32)
        p = ffi.from_buffer("int32_t[]", perm)
    src = ffi.cast("const int32_t *", words.__array_interface__["data"][0])
    rc = lib.w4p_gptq_pack_layout_v1(src, words.strides[0] // 4, n, k, p, ffi.from_buffer("int32_t[]", out),
                                     default_threads())
    check_rc(rc, f"pack {name}")
    return out


def register() -> None:
    """Offer these to core as fast paths (nothing when the extension or its entry points are missing)."""
    if lib is None:
        return
    fastpath.register("pack", pack_codes)
    fastpath.register("gptq_unpack", gptq_unpack_codes)
    if hasattr(lib, "w4p_gptq_pack_layout_v1"):
        fastpath.register("gptq_pack", gptq_pack_layout_v1)


register()
