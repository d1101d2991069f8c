"""Float dtypes by name, with bfloat16 carried as raw uint16 bit patterns.

numpy has no bfloat16. Rather than add a dependency, w4pack keeps bf16 data as uint16 arrays whose
bits are the bf16 values, together with the dtype name "bfloat16". Conversions to float32 are exact
(bf16 is the top half of an fp32), conversions back round to nearest even.
"""
from __future__ import annotations

import numpy as np

__all__ = ["FLOAT_DTYPES", "storage_dtype", "to_float32", "to_float64", "from_float32", "dtype_name_of"]

#: dtype name -> numpy storage dtype
FLOAT_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
}


def storage_dtype(name: str) -> np.dtype:
    try:
        return FLOAT_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown float dtype {name!r} (expected one of {sorted(FLOAT_DTYPES)})") from None


def dtype_name_of(arr: np.ndarray) -> str:
    """Name of a float array's dtype; uint16 is taken to be bfloat16 bits."""
    if arr.dtype == np.float16:
        return "float16"
    if arr.dtype == np.float32:
        return "float32"
    if arr.dtype == np.uint16:
        return "bfloat16"
    raise ValueError(f"not a float16/bfloat16/float32 array: {arr.dtype}")


def to_float32(arr: np.ndarray, name: str) -> np.ndarray:
    """Exact widening of fp16/bf16/fp32 data to float32."""
    if name == "bfloat16":
        if arr.dtype != np.uint16:
            raise ValueError(f"bfloat16 data must be held as uint16 bits, got {arr.dtype}")
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(arr, dtype=np.float32)


def to_float64(arr: np.ndarray, name: str) -> np.ndarray:
    return to_float32(arr, name).astype(np.float64)


def from_float32(arr: np.ndarray, name: str) -> np.ndarray:
    """Round float32 data to the named dtype (round to nearest even; NaN stays NaN)."""
    arr = np.asarray(arr, dtype=np.float32)
    if name == "bfloat16":
        bits = arr.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = rounded.astype(np.uint16)
        nan = np.isnan(arr)
        if nan.any():
            out[nan] = 0x7FC0
        return out
    return arr.astype(storage_dtype(name))
