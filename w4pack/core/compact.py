"""Compact storage of a packed layer (docs/LAYOUT.md §8): on disk only, expanded bit-exactly on read.

A layer read from a GGUF K-quant has float32 scales (and minima) that are exact products ``d·L`` of an fp16
super-block factor and a small integer, and codes of 2, 3, 5 or 6 bits in 4- or 8-bit fields; an IQ4 layer's
8-bit codes take only the 16 values of its codebook. Stored as they run (the layout's runtime form), a Q4_K
layer takes 1.33× its GGUF bytes, a Q6_K layer 1.52× and an IQ4_XS layer 1.94×. The compact form stores what
the GGUF stores: the fp16 factors, the integers at their own width, the codes densely bit-packed, and codebook
codes as their 4-bit index into the codebook the manifest lists.
``expand`` rebuilds the runtime tensors (``qweight``, ``scales``, ``mins``) exactly, so every consumer past the
storage layer (kernels, loader, tensor-parallel slicing, the vLLM plugin) sees the layer it always saw.

Pure numpy, no file access: the storage layer (store/checkpoint.py) reads and writes the tensors.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import BadInputError

__all__ = ["COMPACT_SUFFIXES", "CODEBOOK_MAX", "real_fields", "check_codebook", "stored_suffixes", "expected_shapes",
           "pack_bits", "unpack_bits", "compact", "expand", "super_split", "super_scales", "check_storage"]

#: tensors that replace ``qweight`` / ``scales`` / ``mins`` in the compact form
COMPACT_SUFFIXES = ("qdense", "qindex", "scales_d", "scales_q", "mins_d", "mins_q")
_DENSE_BITS = (2, 3, 5, 6)
#: at most this many codebook entries: an index is 4 bits
CODEBOOK_MAX = 16


def _spans(bits: int) -> list[tuple[int, int, int]]:
    """(value i of 8, byte j of ``bits``, bit offset of the value's bit 0 in byte j, negative when the value
    started in byte j-1): every (value, byte) pair that shares bits, for pack_bits / unpack_bits."""
    out = []
    for i in range(8):
        start, end = bits * i, bits * i + bits - 1
        for j in range(start // 8, end // 8 + 1):
            out.append((i, j, start - 8 * j))
    return out


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values [..., F] (F % 8 == 0, each < 2**bits) -> uint8 [..., F·bits/8]: value i at bits
    bits·i … bits·i+bits−1 of the little-endian bit stream of the row (LSB first). Byte-wise over groups of 8
    values (``bits`` bytes each), so memory stays a small multiple of the codes' own bytes."""
    v = np.asarray(values, dtype=np.uint8)
    lead, f = v.shape[:-1], v.shape[-1]
    assert f % 8 == 0, f
    g = v.reshape(*lead, f // 8, 8)
    out = np.zeros((*lead, f // 8, bits), dtype=np.uint8)
    for i, j, off in _spans(bits):
        out[..., j] |= (g[..., i] << np.uint8(off)) if off >= 0 else (g[..., i] >> np.uint8(-off))
    return out.reshape(*lead, f // 8 * bits)


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_bits``: uint8 [..., F·bits/8] -> uint8 values [..., F]."""
    p = np.asarray(packed, dtype=np.uint8)
    lead, nb = p.shape[:-1], p.shape[-1]
    assert nb % bits == 0, (nb, bits)
    g = p.reshape(*lead, nb // bits, bits)
    out = np.zeros((*lead, nb // bits, 8), dtype=np.uint8)
    for i, j, off in _spans(bits):
        out[..., i] |= (g[..., j] >> np.uint8(off)) if off >= 0 else (g[..., j] << np.uint8(-off))
    out &= np.uint8((1 << bits) - 1)
    return out.reshape(*lead, nb // bits * 8)


def _fields(qweight: np.ndarray, storage_bits: int) -> np.ndarray:
    """int32 qweight [S, W] -> its storage fields [S, F] in little-endian field order (nibbles low first)."""
    by = np.ascontiguousarray(qweight).astype("<i4", copy=False).view(np.uint8)
    if storage_bits == 8:
        return by
    return np.stack([by & 15, by >> 4], axis=-1).reshape(by.shape[0], -1)


def _qweight(fields: np.ndarray, storage_bits: int) -> np.ndarray:
    if storage_bits == 4:
        f = fields.reshape(fields.shape[0], -1, 2)
        fields = f[..., 0] | (f[..., 1] << 4)
    return np.ascontiguousarray(fields).view("<i4").astype(np.int32, copy=False)


def _field_masks(meta: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(bool [16·Kp] real in a full stripe, bool [16·Kp] real in the last stripe) of an 8-bit ``qweight``'s
    storage fields in ``_fields`` order. Padding (LAYOUT.md §3.2) lies only in columns k' ≥ K and, as
    Np = 16·ceil(N/16), in rows of the last stripe; every other stripe's mask is the first.

    Field f of a stripe is byte f of its words: f = 1024·kb + 32·lane + 8·j + elem (§3.3 with storage_bits 8,
    word 256·kb + 8·lane + 2·j + elem div 4, byte elem mod 4), lane = 4·gid + tid, elem = 4·kh + 2·rh + e, at
    row 16·nb + 8·rh + gid and column 64·kb + 16·j + 8·kh + 2·tid + e."""
    n, k = meta["shape"]
    np_, kp = meta["padded_shape"]
    # axes in field order: kb, gid, tid, j, kh, rh, e
    kb, gid, tid, j, kh, rh, e = np.ix_(np.arange(kp // 64), np.arange(8), np.arange(4), np.arange(4),
                                        np.arange(2), np.arange(2), np.arange(2))
    full = (kp // 64, 8, 4, 4, 2, 2, 2)
    col = np.broadcast_to(64 * kb + 16 * j + 8 * kh + 2 * tid + e, full).reshape(-1)
    row = np.broadcast_to(8 * rh + gid, full).reshape(-1)
    cols_ok = col < k
    return cols_ok, cols_ok & (np_ - 16 + row < n)


def real_fields(meta: dict[str, Any]) -> np.ndarray:
    """bool [Np/16, 16·Kp]: which storage fields of an 8-bit ``qweight`` (in ``_fields`` order) hold a real code
    (row n < N, packed column k' < K); the rest are padding (LAYOUT.md §3.2)."""
    cols_ok, last = _field_masks(meta)
    out = np.repeat(cols_ok[None, :], meta["padded_shape"][0] // 16, axis=0)
    out[-1] = last
    return out


def _padding(arr: np.ndarray, meta: dict[str, Any], value: int | None = None) -> bool:
    """Whether any padding field of ``arr`` [Np/16, 16·Kp] (fields in ``_fields`` order) is non-zero; with
    ``value``, set every padding field to it instead (in place) and return False. Touches only the padding."""
    cols_ok, last = _field_masks(meta)
    pad_cols = np.flatnonzero(~cols_ok)
    pad_last = np.flatnonzero(~last)
    if value is not None:
        arr[:-1, pad_cols] = value
        arr[-1, pad_last] = value
        return False
    return bool(arr[:-1, pad_cols].any() or arr[-1, pad_last].any())


def check_codebook(meta: dict[str, Any]) -> str | None:
    """Why the layer's ``storage.codebook`` is not a usable codebook for it, or None (also None without one)."""
    st = meta.get("storage") or {}
    if "codebook" not in st:
        return None
    cb = st["codebook"]
    if meta["storage_bits"] != 8:
        return (f"storage.codebook on a layer with storage_bits {meta['storage_bits']} (only 8-bit fields are "
                "stored as codebook indices)")
    if st.get("dense_codes"):
        return "storage.codebook and storage.dense_codes together (both replace qweight)"
    if not isinstance(cb, list) or not 1 <= len(cb) <= CODEBOOK_MAX:
        return f"storage.codebook must list 1 to {CODEBOOK_MAX} codes"
    top = (1 << meta["bits"]) - 1
    for v in cb:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
            return f"storage.codebook entry {v!r} is not one of the layer's {meta['bits']}-bit codes 0..{top}"
    if len(set(cb)) != len(cb):
        return "storage.codebook lists a code twice"
    return None


def stored_suffixes(meta: dict[str, Any], runtime: list[str]) -> list[str]:
    """The tensor suffixes a layer stores, from its runtime suffixes (layout.tensor_suffixes) and ``storage``."""
    st = meta.get("storage") or {}
    out: list[str] = []
    for s in runtime:
        if s == "qweight" and st.get("dense_codes"):
            out.append("qdense")
        elif s == "qweight" and "codebook" in st:
            out.append("qindex")
        elif s in ("scales", "mins") and s in st:
            out += [f"{s}_d", f"{s}_q"]
        else:
            out.append(s)
    return out


def expected_shapes(meta: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, numpy dtype) of each compact tensor the layer's ``storage`` names (LAYOUT.md §8)."""
    st = meta.get("storage") or {}
    np_, kp = meta["padded_shape"]
    gp = meta["padded_groups"]
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    if st.get("dense_codes"):
        out["qdense"] = ((np_ // 16, 2 * kp * meta["bits"]), np.dtype(np.uint8))
    if "codebook" in st:  # 16·Kp fields per stripe, 4 bits each
        out["qindex"] = ((np_ // 16, 8 * kp), np.dtype(np.uint8))
    for s in ("scales", "mins"):
        if s in st:
            spec = st[s]
            out[f"{s}_d"] = ((gp // spec["super_groups"], np_), np.dtype(np.float16))
            out[f"{s}_q"] = ((gp, np_ * spec["bits"] // 8), np.dtype(np.uint8))
    return out


def check_storage(meta: dict[str, Any]) -> str | None:
    """Why the layer's ``storage`` contradicts the rest of its entry, or None."""
    st = meta.get("storage")
    if st is None:
        return None
    if st.get("dense_codes") and meta["bits"] not in _DENSE_BITS:
        return f"dense_codes on a {meta['bits']}-bit layer (only 2-, 3-, 5- and 6-bit codes are stored densely)"
    why = check_codebook(meta)
    if why:
        return why
    for s in ("scales", "mins"):
        if s not in st:
            continue
        if s == "mins" and meta["zero_mode"] != "float":
            return "storage.mins on a layer without float minima"
        if meta["scale_dtype"] != "float32":
            return f"storage.{s} on a layer with {meta['scale_dtype']} scales (only float32 ones are products)"
        sg = st[s]["super_groups"]
        if meta["group_size"] == -1 or meta["padded_groups"] % sg or meta["num_groups"] % sg:
            # S | G too: a factor row shared by real and padded groups would have to be zero as padding (expand)
            # and non-zero for its real groups (LAYOUT.md §8); the writer never splits a super-block so
            return (f"storage.{s}.super_groups {sg} does not divide the layer's {meta['num_groups']} groups "
                    f"({meta['padded_groups']} padded)")
    return None


def super_scales(vals: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
    """fp16 ``d`` [...] and integers ``L`` [..., G] in lo..hi with d·L == vals exactly, per super-block, or None.

    ``vals`` (float64, [..., G]) are the exact products of a super-block. The first candidate that fits wins,
    scanning from the extreme sub-scale down: the group of largest magnitude takes the widest integer (negative
    first), which is what llama.cpp's reference quantizers write (Q4_K: largest scale 63; Q6_K: -128), so those
    blocks come back byte for byte; other blocks come back with the same values."""
    lead, gsz = vals.shape[:-1], vals.shape[-1]
    v = vals.reshape(-1, gsz)
    ext = np.take_along_axis(v, np.abs(v).argmax(axis=-1)[:, None], axis=-1)[:, 0]
    d = np.zeros(ext.shape, dtype=np.float16)
    # an all-zero super-block: d = +0, and a negative zero product needs a negative integer
    neg0 = np.signbit(v)
    L = np.where(neg0, -1 if lo < 0 else 0, 0).astype(np.int64)
    done = ext == 0
    if (done[:, None] & neg0).any() and lo >= 0:
        return None
    todo = np.flatnonzero(~done)  # each candidate is tried on the blocks still open, so cost falls as they close
    cands = sorted((c for c in range(lo, hi + 1) if c), key=lambda c: (-abs(c), c))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for c in cands:
            if todo.size == 0:
                break
            e, vv, nz = ext[todo], v[todo], neg0[todo]
            dc = (e / c).astype(np.float16)
            d64 = dc.astype(np.float64)
            q = np.rint(np.where(d64[:, None] != 0, vv / d64[:, None], np.nan)) + 0.0  # integers: no -0
            prod = d64[:, None] * q
            ok = np.isfinite(d64) & (d64 * c == e) & np.all(
                np.isfinite(q) & (q >= lo) & (q <= hi) & (prod == vv)
                & (np.signbit(prod) == nz), axis=-1)  # the same zeros too, not just equal values
            hit = todo[ok]
            d[hit] = dc[ok]
            L[hit] = q[ok].astype(np.int64)
            todo = todo[~ok]
    if todo.size:
        return None
    return d.reshape(lead), L.reshape(*lead, gsz)


def super_split(vals: np.ndarray, lo: int, hi: int, per: int, n: int, g: int
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """Group-major float32 parameters [Gp, Np] -> (fp16 d [Gp/per, Np], integers L [Gp, Np]) with d·L equal to
    every value bit for bit (signed zeros included) in the real rows n < N and groups < G, zeros in the padding;
    None when the values are not such products."""
    gp, np_ = vals.shape
    real = vals[:g, :n].astype(np.float64).T.reshape(n, g // per, per)
    got = super_scales(real, lo, hi)
    if got is None:
        return None
    d, L = got
    dd = np.zeros((gp // per, np_), dtype=np.float16)
    dd[:g // per, :n] = d.T
    LL = np.zeros((gp, np_), dtype=np.int64)
    LL[:g, :n] = L.reshape(n, g).T
    return dd, LL


def _codebook_indices(meta: dict[str, Any], qweight: np.ndarray, cb: list[int]) -> np.ndarray | None:
    """``qindex`` of an 8-bit ``qweight`` under codebook ``cb`` (LAYOUT.md §8), or None where that would not
    expand back to exactly ``qweight``: a real field whose code is not in ``cb``, or padding that is not zero."""
    if check_codebook(dict(meta, storage={"codebook": cb})) is not None:
        return None
    fields = _fields(qweight, 8)
    if _padding(fields, meta):
        return None
    lut = np.full(256, 255, dtype=np.uint8)
    lut[np.asarray(cb, dtype=np.int64)] = np.arange(len(cb), dtype=np.uint8)
    idx = lut[fields]
    _padding(idx, meta, 0)
    if int(idx.max(initial=0)) == 255:
        return None
    return pack_bits(idx, 4)


def compact(meta: dict[str, Any], tensors: dict[str, np.ndarray], spec: dict[str, Any]
            ) -> tuple[dict[str, Any] | None, dict[str, np.ndarray]]:
    """Runtime tensors -> (the ``storage`` entry, tensors with the compact ones in place of what they replace).

    ``spec``: ``{"dense_codes": bool, "codebook": [codes], "scales": {"super_groups", "bits", "offset"},
    "mins": {...}}`` (any part may be absent; the codebook only for 8-bit fields and only without dense codes).
    A part that does not fit the layer exactly (parameters that are not such products, codes outside the
    codebook) is left in the runtime form; the result expands back to exactly ``tensors``."""
    out = dict(tensors)
    st: dict[str, Any] = {}
    n, _k = meta["shape"]
    g = meta["num_groups"]
    fields = _fields(tensors["qweight"], meta["storage_bits"]) if spec.get("dense_codes") and \
        meta["bits"] in _DENSE_BITS else None
    # a field past the code range (a PackedLayer not made by layout.pack) would lose its high bits: stays as is
    if fields is not None and int(fields.max(initial=0)) < 1 << meta["bits"]:
        out.pop("qweight")
        out["qdense"] = pack_bits(fields, meta["bits"])
        st["dense_codes"] = True
    cb = spec.get("codebook")
    if cb is not None and not st.get("dense_codes"):
        got = _codebook_indices(meta, tensors["qweight"], [int(v) for v in cb])
        if got is not None:
            out.pop("qweight")
            out["qindex"] = got
            st["codebook"] = [int(v) for v in cb]
    for s in ("scales", "mins"):
        sp = spec.get(s)
        if sp is None or s not in tensors or meta["scale_dtype"] != "float32" or meta["group_size"] == -1:
            continue
        per, bits, off = int(sp["super_groups"]), int(sp["bits"]), int(sp["offset"])
        if meta["padded_groups"] % per or g % per:
            continue
        vals = np.asarray(tensors[s], dtype=np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            got = super_split(vals if s == "scales" else -vals, off, off + (1 << bits) - 1, per, n, g)
        if got is None:
            continue
        d, L = got
        u = (L - off).astype(np.uint8)
        u[g:, :] = 0
        u[:, n:] = 0
        out.pop(s)
        out[f"{s}_d"], out[f"{s}_q"] = d, pack_bits(u, bits)
        st[s] = {"super_groups": per, "bits": bits, "offset": off}
    return (st or None), out


def _codebook_expand(meta: dict[str, Any], qindex: np.ndarray, cb: list[int], label: str) -> np.ndarray:
    """``qindex`` -> the runtime 8-bit ``qweight``: real field = cb[index], padding field = 0. Refuses an index
    past the codebook and a non-zero index in the padding (as §3.2 refuses non-zero padding)."""
    idx = unpack_bits(qindex, 4)
    if _padding(idx, meta):
        raise BadInputError("padding (rows past the layer's shape, columns past its in_features) holds a "
                            "non-zero codebook index", tensor=label)
    top = int(idx.max(initial=0))
    if top >= len(cb):
        raise BadInputError(f"codebook index {top} past the manifest's {len(cb)}-entry codebook", tensor=label)
    fields = np.asarray(cb, dtype=np.uint8)[idx]
    _padding(fields, meta, 0)
    return _qweight(fields, 8)


def expand(meta: dict[str, Any], tensors: dict[str, np.ndarray], name: str = "") -> dict[str, np.ndarray]:
    """Compact tensors -> the runtime ones (``qweight``, ``scales``, ``mins``), bit-exactly; other tensors are
    passed on. Refuses (naming the tensor) a wrong shape or dtype, a non-finite factor, padding that is not
    zero, a codebook index past the codebook and a codebook unfit for the layer (naming the layer). Sub-scales
    and dense codes cannot be out of range: their stored width is their range."""
    st = meta.get("storage") or {}
    if not st:
        return tensors
    why = check_codebook(meta)
    if why:
        raise BadInputError(why, tensor=name or None)
    out = {k: v for k, v in tensors.items() if k not in COMPACT_SUFFIXES}
    want = expected_shapes(meta)
    n, _k = meta["shape"]
    g = meta["num_groups"]

    def tname(s: str) -> str:
        return f"{name}.{s}" if name else s

    for s, (shape, dt) in want.items():
        if s not in tensors:
            raise BadInputError("compact tensor is missing", tensor=tname(s))
        a = tensors[s]
        if tuple(a.shape) != shape or a.dtype != dt:
            raise BadInputError(f"{a.dtype} {list(a.shape)} contradicts the manifest's storage (expected {dt} "
                                f"{list(shape)})", tensor=tname(s))
    if st.get("dense_codes"):
        fields = unpack_bits(tensors["qdense"], meta["bits"])
        out["qweight"] = _qweight(fields, meta["storage_bits"])
    if "codebook" in st:
        out["qweight"] = _codebook_expand(meta, tensors["qindex"], st["codebook"], tname("qindex"))
    for s in ("scales", "mins"):
        if s not in st:
            continue
        spec = st[s]
        per, off = spec["super_groups"], spec["offset"]
        d = np.asarray(tensors[f"{s}_d"])
        if not np.all(np.isfinite(d)):
            raise BadInputError("super-block factor is NaN or infinite", tensor=tname(f"{s}_d"))
        u = unpack_bits(tensors[f"{s}_q"], spec["bits"])
        gd = g // per
        if np.any(d[gd:].view(np.uint16)) or np.any(d[:, n:].view(np.uint16)):
            raise BadInputError("padding (rows past the layer's shape, groups past its groups) is not zero",
                                tensor=tname(f"{s}_d"))
        if np.any(u[g:]) or np.any(u[:, n:]):
            raise BadInputError("padding (rows past the layer's shape, groups past its groups) is not zero",
                                tensor=tname(f"{s}_q"))
        full = np.repeat(d.astype(np.float32), per, axis=0) * (u.astype(np.float32) + np.float32(off))
        if s == "mins":
            full = -full
        full[g:] = 0
        full[:, n:] = 0
        out[s] = full
    return out
