"""The canonical unpacked layer: the one in-memory form every reader produces and every writer takes.

All formats meet here, so a conversion is read → canonical → write, and every check compares canonical
layers. ``dequantize`` is the numeric reference for everything downstream (kernels, verify, run).

Conventions (N = out_features, K = in_features, G = number of groups along K):

* ``codes``  uint8 [N, K], values in 0 .. 2**bits - 1, in the *original* input-channel order.
* ``scales`` [N, G] in the dtype the source stored (float16, float32, or bfloat16 held as uint16 bits).
* ``zero_mode``:
  - ``"none"``  symmetric; the zero point is implicitly 2**(bits-1);  W = s * (q - 2**(bits-1))
  - ``"int"``   ``zeros`` integer [N, G] in 0 .. 2**bits (2**bits only appears when a peer's reader decodes it so);
                W = s * (q - z)
  - ``"float"`` ``zeros`` holds a float minimum m [N, G] in the scale dtype;  W = s * q + m
* ``g_idx`` int32 [K]: the group of each input column (act-order makes it a permutation of groups).
* ``group_size`` the number of columns per group, or -1 for one group per row (per-channel).
* ``role`` ``"linear"`` (multiplied: y = x·Wᵀ) or ``"embedding"`` (looked up: row t of W is token t's vector); the
  weights and their dequantization are the same, only the module that runs them differs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dtypes import FLOAT_DTYPES, to_float32, to_float64
from ..errors import BadInputError

__all__ = ["CanonicalLayer", "ZERO_MODES", "ROLES", "SUPPORTED_BITS", "default_g_idx", "dequantize"]

ZERO_MODES = ("none", "int", "float")
ROLES = ("linear", "embedding")
#: source code widths; 2-4 are stored in 4-bit fields, 5, 6 and 8 in 8-bit fields (docs/LAYOUT.md §5)
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
_F32_MAX = float(np.finfo(np.float32).max)


def default_g_idx(in_features: int, group_size: int) -> np.ndarray:
    """g_idx of a layer without act-order: column k belongs to group k // group_size."""
    if group_size == -1:
        return np.zeros(in_features, dtype=np.int32)
    return (np.arange(in_features, dtype=np.int64) // group_size).astype(np.int32)


@dataclass
class CanonicalLayer:
    """One quantized linear layer, unpacked. See the module docstring for the exact conventions."""

    codes: np.ndarray
    scales: np.ndarray
    bits: int
    group_size: int
    zero_mode: str = "none"
    zeros: np.ndarray | None = None
    g_idx: np.ndarray | None = None
    scale_dtype: str = "float16"
    bias: np.ndarray | None = None
    bias_dtype: str | None = None
    source: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    role: str = "linear"

    def __post_init__(self) -> None:
        if self.g_idx is None and isinstance(self.codes, np.ndarray) and self.codes.ndim == 2:
            self.g_idx = default_g_idx(self.codes.shape[1], self.group_size)
        if self.bias is not None and self.bias_dtype is None and isinstance(self.bias, np.ndarray):
            # uint16 bias data is bf16 bits (see dtypes.py)
            self.bias_dtype = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
                               np.dtype(np.uint16): "bfloat16"}.get(self.bias.dtype)

    # -- shape helpers -------------------------------------------------------------------------
    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1])

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[1])

    @property
    def act_order(self) -> bool:
        """True when g_idx is not the trivial k // group_size."""
        assert self.g_idx is not None
        return not np.array_equal(self.g_idx, default_g_idx(self.in_features, self.group_size))

    def replace(self, **changes: Any) -> "CanonicalLayer":
        return dataclasses.replace(self, **changes)

    # -- validation ----------------------------------------------------------------------------
    def validate(self, *, check_codes: bool = True, tensors: dict[str, str] | None = None) -> "CanonicalLayer":
        """Check every invariant; raise BadInputError naming the layer and the broken rule.

        ``check_codes=False`` skips only the scan of every code for the bit range, for callers that
        guarantee it otherwise (codes split out of a ``bits``-wide stream, or the native packer, which
        checks the range in the same pass). ``tensors``: the stored tensor that holds each field ("scales",
        "zeros", "bias"), so that a broken value is named by the tensor that holds it, not only the layer."""

        def bad(msg: str, field: str | None = None) -> BadInputError:
            where = (tensors or {}).get(field or "")
            return BadInputError(msg, tensor=where or self.name or None)

        if self.role not in ROLES:
            raise bad(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role == "embedding" and self.bias is not None:
            raise bad("an embedding has no bias")
        if self.bits not in SUPPORTED_BITS:
            raise bad(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if not isinstance(self.codes, np.ndarray) or self.codes.dtype != np.uint8 or self.codes.ndim != 2:
            raise bad(f"codes must be a uint8 [N, K] array, got {getattr(self.codes, 'dtype', type(self.codes))} "
                      f"{getattr(self.codes, 'shape', '')}")
        n, k = self.codes.shape
        if n < 1 or k < 1:
            raise bad(f"empty weight shape [{n}, {k}]")
        qmax = (1 << self.bits) - 1
        if check_codes and self.codes.size and int(self.codes.max()) > qmax:
            raise bad(f"codes exceed {qmax}, the largest {self.bits}-bit value (max {int(self.codes.max())})")
        if self.group_size != -1 and self.group_size < 1:
            raise bad(f"group_size must be positive or -1, got {self.group_size}")
        expected_g = 1 if self.group_size == -1 else -(-k // self.group_size)
        if self.scale_dtype not in FLOAT_DTYPES:
            raise bad(f"scale_dtype must be one of {sorted(FLOAT_DTYPES)}, got {self.scale_dtype!r}")
        if not isinstance(self.scales, np.ndarray) or self.scales.dtype != FLOAT_DTYPES[self.scale_dtype]:
            raise bad(f"scales must be stored as {FLOAT_DTYPES[self.scale_dtype]} for {self.scale_dtype}, "
                      f"got {getattr(self.scales, 'dtype', type(self.scales))}")
        if self.scales.shape != (n, expected_g):
            raise bad(f"scales shape {list(self.scales.shape)} != [N, G] = [{n}, {expected_g}] "
                      f"for K={k}, group_size={self.group_size}")
        s32 = to_float32(self.scales, self.scale_dtype)
        if not np.all(np.isfinite(s32)):
            raise bad("scales contain NaN or infinity", "scales")
        if self.g_idx is None or not isinstance(self.g_idx, np.ndarray) or self.g_idx.shape != (k,):
            raise bad(f"g_idx must be an int32 array of shape [{k}]")
        if self.g_idx.dtype != np.int32:
            raise bad(f"g_idx must be int32, got {self.g_idx.dtype}")
        if k and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= expected_g):
            raise bad(f"g_idx values must lie in 0..{expected_g - 1}, got {int(self.g_idx.min())}..{int(self.g_idx.max())}")
        if self.zero_mode not in ZERO_MODES:
            raise bad(f"zero_mode must be one of {ZERO_MODES}, got {self.zero_mode!r}")
        if self.zero_mode == "none":
            if self.zeros is not None:
                raise bad("zero_mode 'none' (symmetric) must not carry zeros")
        elif self.zeros is None or not isinstance(self.zeros, np.ndarray) or self.zeros.shape != (n, expected_g):
            raise bad(f"zero_mode {self.zero_mode!r} needs zeros of shape [{n}, {expected_g}], "
                      f"got {None if self.zeros is None else list(self.zeros.shape)}")
        elif self.zero_mode == "int":
            if self.zeros.dtype.kind not in "iu":
                raise bad(f"integer zeros must have an integer dtype, got {self.zeros.dtype}")
            lo, hi = int(self.zeros.min()), int(self.zeros.max())
            if lo < 0 or hi > (1 << self.bits):
                raise bad(f"integer zeros must lie in 0..{1 << self.bits}, got {lo}..{hi}", "zeros")
        else:  # float minimum
            if self.zeros.dtype != FLOAT_DTYPES[self.scale_dtype]:
                raise bad(f"float minima must share the scale dtype {self.scale_dtype}, got {self.zeros.dtype}")
            if not np.all(np.isfinite(to_float32(self.zeros, self.scale_dtype))):
                raise bad("float minima contain NaN or infinity", "zeros")
        self._check_range(s32, bad)
        if self.bias is not None:
            if self.bias_dtype is None and isinstance(self.bias, np.ndarray):
                self.bias_dtype = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
                                   np.dtype(np.uint16): "bfloat16"}.get(self.bias.dtype)
            if self.bias_dtype not in FLOAT_DTYPES or self.bias.dtype != FLOAT_DTYPES[self.bias_dtype]:
                raise bad(f"bias must be stored as its dtype {self.bias_dtype}, got {self.bias.dtype}")
            if self.bias.shape != (n,):
                raise bad(f"bias shape {list(self.bias.shape)} != [N] = [{n}]")
            if not np.all(np.isfinite(to_float32(self.bias, self.bias_dtype))):
                raise bad("bias contains NaN or infinity", "bias")
        return self

    def _check_range(self, s32: np.ndarray, bad: Any) -> None:
        """Refuse scales so large that the layer's products overflow float32 on inputs of unit size: finite in
        their own dtype (bf16 reaches 3.4e38) but a damaged value, not a trained model's (whose weights are at
        most a few units), and every GEMM of the layer would return infinities."""
        if not s32.size:
            return
        smax = float(np.max(np.abs(s32)))
        span = float(1 << self.bits)  # |q - z| <= 2^bits, zeros included
        mmax = 0.0
        if self.zero_mode == "float":
            mmax = float(np.max(np.abs(to_float32(self.zeros, self.scale_dtype))))
        bound = (smax * span + mmax) * float(self.codes.shape[1])
        if bound > _F32_MAX:
            big = "scale" if smax * span >= mmax else "float minimum"
            val = smax if big == "scale" else mmax
            raise bad(f"a {big} of {val:.3g}: with {self.codes.shape[1]} inputs the layer's products overflow "
                      f"float32 (trained models' weights are a few units); the checkpoint is damaged")

    # -- numerics ------------------------------------------------------------------------------
    def dequantize(self, dtype: type = np.float32) -> np.ndarray:
        """The reference: float [N, K] in the original column order. float64 is for tests."""
        return dequantize(self, dtype)

    def zero_points(self) -> np.ndarray:
        """Integer zero points [N, G] as int32 (the implicit 2**(bits-1) for 'none')."""
        if self.zero_mode == "int":
            return self.zeros.astype(np.int32)
        if self.zero_mode == "none":
            return np.full(self.scales.shape, 1 << (self.bits - 1), dtype=np.int32)
        raise ValueError("a float-minimum layer has no integer zero points")

    def equals(self, other: "CanonicalLayer") -> bool:
        """Bit-exact equality of everything that defines the weights (source notes and names aside)."""
        return not self.differences(other)

    def differences(self, other: "CanonicalLayer") -> list[str]:
        out = []
        for attr in ("bits", "group_size", "zero_mode", "scale_dtype", "role"):
            if getattr(self, attr) != getattr(other, attr):
                out.append(f"{attr}: {getattr(self, attr)!r} != {getattr(other, attr)!r}")
        for attr in ("codes", "scales", "zeros", "g_idx", "bias"):
            a, b = getattr(self, attr), getattr(other, attr)
            if a is None and b is None:
                continue
            if a is None or b is None:
                out.append(f"{attr}: present in one layer only")
                continue
            if a.shape != b.shape:
                out.append(f"{attr}: shape {list(a.shape)} != {list(b.shape)}")
                continue
            if attr == "zeros" and self.zero_mode == "int":
                neq = int(np.count_nonzero(a.astype(np.int64) != b.astype(np.int64)))
            else:
                neq = int(np.count_nonzero(np.asarray(a).view(np.uint8).reshape(a.shape + (-1,))
                                           != np.asarray(b).view(np.uint8).reshape(b.shape + (-1,)))
                          ) if a.dtype == b.dtype else -1
            if neq:
                out.append(f"{attr}: {neq if neq > 0 else 'dtype'} mismatches"
                           + ("" if neq > 0 else f" ({a.dtype} vs {b.dtype})"))
        return out


def _products_exact(scales: np.ndarray, bits: int) -> bool:
    """Every s·q (q < 2^bits) exact in float32: each float32 scale is zero or a normal number whose significand
    ends in ``bits`` zero bits, so the product's significand fits 24 bits."""
    u = np.ascontiguousarray(scales, dtype=np.float32).view(np.uint32)
    mag = u & np.uint32(0x7FFFFFFF)
    normal = (mag == 0) | ((mag >> np.uint32(23)) != 0)
    return bool(np.all(normal & ((u & np.uint32((1 << bits) - 1)) == 0)))


def dequantize(layer: CanonicalLayer, dtype: type = np.float32) -> np.ndarray:
    """W[n,k] = s[n,g[k]]·(q[n,k] − z[n,g[k]])  or  s[n,g[k]]·q[n,k] + m[n,g[k]]  (zero_mode 'float').

    In float32, the float64 values rounded once (docs/LAYOUT.md §1): float32 arithmetic gives that except for the
    sum of a float-minimum layer whose float32 scales make s·q round too, so that one goes by float64 (K-quant
    scales do not: their products are exact, and they stay in float32, half the memory)."""
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise BadInputError(f"dequantize gives float32 or float64 weights, not {np.dtype(dtype)}",
                            tensor=layer.name or None)
    wide = np.dtype(dtype) == np.float64 or (layer.zero_mode == "float" and layer.scale_dtype == "float32"
                                             and not _products_exact(layer.scales, layer.bits))
    conv = to_float64 if wide else to_float32
    s = conv(layer.scales, layer.scale_dtype)[:, layer.g_idx]
    q = layer.codes.astype(np.float64 if wide else dtype)
    if layer.zero_mode == "float":
        m = conv(layer.zeros, layer.scale_dtype)[:, layer.g_idx]
        return (s * q + m).astype(dtype)
    z = layer.zero_points()[:, layer.g_idx].astype(dtype)
    return (s * (q - z)).astype(dtype)
