"""Layout v1 ("w4pack-tiles"): the numpy reference pack/unpack, i.e. the executable spec of docs/LAYOUT.md.

The weight matrix W [N, K] is the *A operand* of the tensor-core instruction (rows = output features),
so one layout feeds mma.sync.m16n8k16 (sm_80+) and wgmma m64nNk16 with A from registers (sm_90): a
warpgroup's A slice is four 16-row warp fragments of exactly this shape.

* N is padded to a multiple of 16 (tile rows), K to a multiple of 64 (tile columns).
* A tile is 16 rows × 64 columns. Tiles of one 16-row stripe are contiguous along K, so a stripe
  streams like a copy (GEMV) and a 64-row wgmma block is four consecutive stripes.
* Inside a tile, lane ``l`` of a warp loads one 16-byte vector: four 32-bit words, word ``j`` holding
  the eight values that lane owns in the m16n8k16 A fragment of the k16 slice ``j``.
* Inside a word, the eight 4-bit values sit at nibble positions [0, 4, 1, 5, 2, 6, 3, 7] (fragment
  element e goes to nibble NIBBLE_POS[e]), so ``(w >> 4i) & 0x000f000f`` yields the fp16 pair i with one
  lop3 and the 0x6400 bias trick.
* 5-, 6- and 8-bit layers use the same tiles with two words per k16 slice (eight bytes in fragment order).
* Act-order: the stored permutation ``perm`` sorts K by group; packed column k' holds original column
  perm[k'], and the kernel reads activations as x[:, perm].
* Scales, integer zeros and float minima are stored [Gp, Np] (group-major, N contiguous): a 16-row
  stripe's parameters for one group are 16 consecutive values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import fastpath
from .canonical import CanonicalLayer, default_g_idx
from .dtypes import FLOAT_DTYPES
from ..errors import BadInputError, UnsupportedError

__all__ = [
    "LAYOUT_NAME",
    "LAYOUT_VERSION",
    "TILE_N",
    "TILE_K",
    "NIBBLE_POS",
    "PackedLayer",
    "pack",
    "unpack",
    "padded_shape",
    "storage_bits_for",
    "tensor_suffixes",
    "group_structure",
    "pack_with_qweight",
]

LAYOUT_NAME = "w4pack-tiles"
LAYOUT_VERSION = 1
TILE_N = 16
TILE_K = 64
WARP = 32
#: nibble position of fragment element e (0..7) inside a 32-bit word
NIBBLE_POS = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.int64)


def storage_bits_for(bits: int) -> int:
    """2-, 3- and 4-bit codes are stored as 4-bit, 5-, 6- and 8-bit as 8-bit (widened losslessly: the code
    is unchanged, and the implicit symmetric zero stays 2**(bits-1) of the source width)."""
    if bits in (2, 3, 4):
        return 4
    if bits in (5, 6, 8):
        return 8
    raise UnsupportedError(f"{bits}-bit layers are not supported (2, 3, 4, 5, 6 and 8 are)")


def padded_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K


def words_per_tile_lane(storage_bits: int) -> int:
    """32-bit words one lane owns in a 16×64 tile: 4 for 4-bit (one 16-byte load), 8 for 8-bit."""
    return 4 if storage_bits == 4 else 8


def tensor_suffixes(zero_mode: str, act_order: bool) -> list[str]:
    out = ["qweight", "scales"]
    if zero_mode == "int":
        out.append("zeros")
    elif zero_mode == "float":
        out.append("mins")
    if act_order:
        out.append("perm")
    return out


@dataclass
class PackedLayer:
    """A layer in layout v1: tensors keyed by suffix (qweight, scales, zeros|mins, perm, bias) + metadata."""

    meta: dict[str, Any]
    tensors: dict[str, np.ndarray]
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.meta["shape"])  # type: ignore[return-value]

    @property
    def padded(self) -> tuple[int, int]:
        return tuple(self.meta["padded_shape"])  # type: ignore[return-value]


def group_structure(layer: CanonicalLayer) -> tuple[np.ndarray | None, int]:
    """Return (perm or None, effective group size). Refuse g_idx that are not permuted contiguous groups."""
    k = layer.in_features
    gs = layer.group_size
    if gs == -1:
        return None, -1
    if gs % 16:
        raise UnsupportedError(f"group size {gs} is not a multiple of 16; layout v1 needs whole k16 slices per group",
                               tensor=layer.name or None)
    trivial = default_g_idx(k, gs)
    if np.array_equal(layer.g_idx, trivial):
        return None, gs
    perm = np.argsort(layer.g_idx, kind="stable").astype(np.int32)
    if not np.array_equal(layer.g_idx[perm], trivial):
        # the values are well defined (W = s[g_idx[k]]·(q − z)), but this layout stores groups of group_size
        # packed columns: unsupported (exit 3), not a damaged file
        raise UnsupportedError(f"g_idx contradicts group_size {gs}: its groups are not exactly {gs} columns each "
                               "(last group may be short), so sorting K cannot give contiguous groups, which the "
                               "packed layout needs (docs/LAYOUT.md section 3.1)", tensor=layer.name or None)
    return perm, gs


def pack(layer: CanonicalLayer) -> PackedLayer:
    """Canonical layer → layout v1 tensors. Lossless: ``unpack(pack(x))`` equals ``x`` bit for bit.

    The qweight words come from the registered ``"pack"`` fast path where there is one (same bytes),
    else from the numpy interleave below, which is the spec."""
    fast = fastpath.get("pack")
    # the fast packer finds the largest code in its own pass
    layer.validate(check_codes=fast is None)
    qweight = None
    if fast is not None:
        perm, _gs = group_structure(layer)
        qweight = fast(layer.codes, perm, storage_bits_for(layer.bits), layer.bits, layer.name)
        if qweight is None:
            layer.validate()
    return pack_with_qweight(layer, qweight)


def pack_with_qweight(layer: CanonicalLayer, qweight: np.ndarray | None) -> PackedLayer:
    """pack() given the layer's layout v1 qweight words, computed elsewhere from the same codes (a reader
    packing from its own storage; the layer's codes may then be a placeholder of the right shape); None
    packs the codes here with numpy. The caller has validated the layer."""
    n, k = layer.codes.shape
    np_, kp = padded_shape(n, k)
    sbits = storage_bits_for(layer.bits)
    perm, gs = group_structure(layer)
    g = layer.num_groups
    gp = 1 if gs == -1 else -(-kp // gs)

    if qweight is None:
        codes = layer.codes if perm is None else np.take(layer.codes, perm, axis=1)
        padded = np.zeros((np_, kp), dtype=np.uint8)
        padded[:n, :k] = codes
        qweight = _interleave(padded, sbits)

    def param(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
        out = np.zeros((gp, np_), dtype=dtype)
        out[:g, :n] = arr.T
        return out

    tensors: dict[str, np.ndarray] = {"qweight": qweight, "scales": param(layer.scales, layer.scales.dtype)}
    if layer.zero_mode == "int":
        tensors["zeros"] = param(layer.zeros.astype(np.int64), np.dtype(np.uint8 if sbits == 4 else np.uint16))
    elif layer.zero_mode == "float":
        tensors["mins"] = param(layer.zeros, layer.zeros.dtype)
    if perm is not None:
        tensors["perm"] = perm
    if layer.bias is not None:
        tensors["bias"] = layer.bias
    meta = {
        "bits": layer.bits,
        "storage_bits": sbits,
        "group_size": layer.group_size,
        "zero_mode": layer.zero_mode,
        "shape": [n, k],
        "padded_shape": [np_, kp],
        "num_groups": g,
        "padded_groups": gp,
        "scale_dtype": layer.scale_dtype,
        "act_order": perm is not None,
        "bias_dtype": layer.bias_dtype if layer.bias is not None else None,
    }
    if layer.role != "linear":  # absent means a linear layer (docs/FORMAT.md §5)
        meta["role"] = layer.role
    return PackedLayer(meta=meta, tensors=tensors, source=dict(layer.source))


def unpack(packed: PackedLayer, name: str = "") -> CanonicalLayer:
    """Layout v1 tensors → canonical layer (act-order undone, padding dropped), checking every shape."""
    m = packed.meta
    t = packed.tensors
    n, k = m["shape"]
    np_, kp = m["padded_shape"]
    sbits, gs, g, gp = m["storage_bits"], m["group_size"], m["num_groups"], m["padded_groups"]
    if (np_, kp) != padded_shape(n, k):
        raise BadInputError(f"padded shape {[np_, kp]} does not match shape {[n, k]} (expected "
                            f"{list(padded_shape(n, k))})", tensor=name or None)
    if sbits != storage_bits_for(m["bits"]):
        raise BadInputError(f"storage_bits {sbits} is wrong for {m['bits']}-bit codes", tensor=name or None)
    expect_gp = 1 if gs == -1 else -(-kp // gs)
    expect_g = 1 if gs == -1 else -(-k // gs)
    if gp != expect_gp or g != expect_g:
        raise BadInputError(f"group counts {g}/{gp} do not match K={k}, group_size={gs}", tensor=name or None)
    wpl = words_per_tile_lane(sbits)
    _expect(t, "qweight", (np_ // TILE_N, kp // TILE_K * WARP * wpl), np.dtype(np.int32), name)
    sdt = FLOAT_DTYPES[m["scale_dtype"]]
    _expect(t, "scales", (gp, np_), sdt, name)
    full = _deinterleave(t["qweight"], np_, kp, sbits)
    _check_pad(full, n, k, f"{name}.qweight" if name else "qweight")
    codes = full[:n, :k]
    _check_pad(t["scales"], g, n, f"{name}.scales" if name else "scales")
    scales = np.ascontiguousarray(t["scales"][:g, :n].T)
    zeros = None
    if m["zero_mode"] == "int":
        _expect(t, "zeros", (gp, np_), np.dtype(np.uint8 if sbits == 4 else np.uint16), name)
        _check_pad(t["zeros"], g, n, f"{name}.zeros" if name else "zeros")
        zeros = np.ascontiguousarray(t["zeros"][:g, :n].T).astype(np.int32)
    elif m["zero_mode"] == "float":
        _expect(t, "mins", (gp, np_), sdt, name)
        _check_pad(t["mins"], g, n, f"{name}.mins" if name else "mins")
        zeros = np.ascontiguousarray(t["mins"][:g, :n].T)
    g_idx = default_g_idx(k, gs)
    if m["act_order"]:
        _expect(t, "perm", (k,), np.dtype(np.int32), name)
        perm = np.asarray(t["perm"])
        if not np.array_equal(np.sort(perm), np.arange(k, dtype=np.int32)):
            raise BadInputError("perm is not a permutation of 0..K-1", tensor=f"{name}.perm" if name else "perm")
        codes = np.take(codes, np.argsort(perm).astype(np.int32), axis=1)
        orig_g = np.empty_like(g_idx)
        orig_g[perm] = g_idx
        g_idx = orig_g
    bias = None
    if "bias" in t:
        bias_dtype = m.get("bias_dtype") or "float16"
        if not isinstance(bias_dtype, str) or bias_dtype not in FLOAT_DTYPES:
            raise BadInputError(f"bias_dtype {str(bias_dtype)[:40]!r} is not a float dtype",
                                tensor=f"{name}.bias" if name else "bias")
        _expect(t, "bias", (n,), FLOAT_DTYPES[bias_dtype], name)
        bias = np.array(t["bias"])
    layer = CanonicalLayer(
        codes=np.ascontiguousarray(codes), scales=scales, bits=m["bits"], group_size=gs,
        zero_mode=m["zero_mode"], zeros=zeros, g_idx=g_idx, scale_dtype=m["scale_dtype"],
        bias=bias, bias_dtype=m.get("bias_dtype") if bias is not None else None,
        source=dict(packed.source), name=name, role=m.get("role", "linear"),
    )
    if int(codes.max(initial=0)) > (1 << m["bits"]) - 1:
        raise BadInputError(f"packed codes exceed the {m['bits']}-bit range", tensor=f"{name}.qweight")
    # the rest of the invariants (zero points in range, finite scales and minima, the bias); the codes were
    # checked just above
    names = m.get("tensors") or {}
    return layer.validate(check_codes=False, tensors={"scales": names.get("scales"), "bias": names.get("bias"),
                                                      "zeros": names.get("zeros") or names.get("mins")})


def _check_pad(arr: np.ndarray, rows: int, cols: int, label: str) -> None:
    """Padding must be zero (section 3.2): a non-zero pad most often means a recorded shape that is too small,
    which would otherwise drop real rows or columns without a word."""
    a = np.asarray(arr)
    if a.dtype.kind == "f":  # compared bit for bit: -0.0 is not the +0 the spec asks for, at any width
        a = a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
    if a[rows:].any() or a[:rows, cols:].any():
        raise BadInputError(f"padding past the recorded shape holds non-zero values (rows from {rows} or "
                            f"columns from {cols}); the manifest's shape may be wrong", tensor=label)


def _expect(t: dict[str, np.ndarray], key: str, shape: tuple[int, ...], dtype: np.dtype, name: str) -> None:
    label = f"{name}.{key}" if name else key
    if key not in t:
        raise BadInputError("tensor is missing", tensor=label)
    arr = t[key]
    if tuple(arr.shape) != tuple(shape):
        raise BadInputError(f"shape {list(arr.shape)} != expected {list(shape)}", tensor=label)
    if arr.dtype != dtype:
        raise BadInputError(f"dtype {arr.dtype} != expected {dtype}", tensor=label)


def _split_axes(np_: int, kp: int) -> tuple[int, ...]:
    # n = nb*16 + rh*8 + gid ; k = kb*64 + j*16 + kh*8 + tid*2 + e
    return (np_ // TILE_N, 2, 8, kp // TILE_K, 4, 2, 4, 2)


# (nb, rh, gid, kb, j, kh, tid, e) -> (nb, kb, gid, tid, j, kh, rh, e): lane = gid*4 + tid, elem = 4*kh + 2*rh + e
_TO_TILES = (0, 3, 2, 6, 4, 5, 1, 7)
_FROM_TILES = tuple(int(i) for i in np.argsort(_TO_TILES))


def _interleave(codes: np.ndarray, sbits: int) -> np.ndarray:
    np_, kp = codes.shape
    t = np.ascontiguousarray(codes.reshape(_split_axes(np_, kp)).transpose(_TO_TILES))
    t = t.reshape(np_ // TILE_N, kp // TILE_K, WARP, 4, 8)
    if sbits == 4:
        # byte b of the little-endian word holds nibble positions 2b (low) and 2b+1 (high);
        # position p holds element INV[p] where NIBBLE_POS[INV[p]] = p
        inv = np.argsort(NIBBLE_POS)
        out = np.empty(t.shape[:-1] + (4,), dtype=np.uint8)
        for b in range(4):
            out[..., b] = t[..., inv[2 * b]] | (t[..., inv[2 * b + 1]] << np.uint8(4))
    else:
        out = t  # bytes already in fragment order: word w = elements 4w..4w+3, byte i = element 4w+i
    return np.ascontiguousarray(out).reshape(np_ // TILE_N, -1).view("<i4")


def _deinterleave(qweight: np.ndarray, np_: int, kp: int, sbits: int) -> np.ndarray:
    raw = np.ascontiguousarray(qweight).astype("<i4", copy=False).view(np.uint8)
    if sbits == 4:
        b = raw.reshape(np_ // TILE_N, kp // TILE_K, WARP, 4, 4)
        t = np.empty(b.shape[:-1] + (8,), dtype=np.uint8)
        for p in range(8):
            byte = b[..., p // 2]
            t[..., int(np.argsort(NIBBLE_POS)[p])] = (byte >> np.uint8(4)) if p % 2 else (byte & np.uint8(0xF))
    else:
        t = raw.reshape(np_ // TILE_N, kp // TILE_K, WARP, 4, 8)
    t = t.reshape(np_ // TILE_N, kp // TILE_K, 8, 4, 4, 2, 2, 2)
    return np.ascontiguousarray(t.transpose(_FROM_TILES)).reshape(np_, kp)
