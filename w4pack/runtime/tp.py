"""Tensor-parallel slices of packed layers: what one rank of a serving engine holds, made from the full layer.

Why a module of its own: a serving engine (vLLM) splits each linear layer across ``tp`` ranks, column-parallel
(each rank computes some output rows) or row-parallel (each rank multiplies its share of the input channels and
the ranks' outputs are summed). Both cuts are made here, exactly, from the checkpoint's full layer, so every rank
runs the same native GEMM on a layout-v1 layer of its own and no float weights ever exist.

* **Column slices** take whole 16-row stripes when the cut falls on a stripe boundary (a copy of the rows of
  ``qweight`` and of the parameter columns) and otherwise unpack, cut and pack again.
* **Row slices** keep the rank's input channels ``[start, stop)`` in their groups. Without act-order and with the
  cut on group and 64-column tile boundaries that is an ordinary layer made of the source's bytes. Otherwise
  (act-order scatters a group's channels across ranks; ``K / tp`` need not be a multiple of the group size) the rank's channels of one source group are split
  into groups of a new size ``g'`` (a multiple of 16, at most the source's) that repeat the source group's scale
  and zero point, and a group's last, short chunk is filled up with *padding inputs*: extra input channels past
  the rank's own that the caller feeds as zeros (``Shard.input_pad``). Their codes never reach an output, so the
  rank's product is exactly the sum over its own channels. ``g'`` is chosen to minimise the bytes a GEMM reads.

The result is always a plain layout-v1 ``PackedLayer``: the layout and both kernels are unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..core.canonical import CanonicalLayer
from ..errors import UnsupportedError
from ..core.layout import TILE_K, TILE_N, PackedLayer, pack, padded_shape, unpack

__all__ = ["Shard", "column_slice", "row_slice", "stack_rows", "stack_blockers", "column_parallel",
           "row_parallel"]

_STRUCTURE_KEYS = ("bits", "storage_bits", "group_size", "zero_mode", "scale_dtype", "act_order", "padded_groups",
                   "num_groups")


@dataclass
class Shard:
    """One rank's part of a layer: ``packed`` runs on inputs ``[x_local, zeros(input_pad)]``."""

    packed: PackedLayer
    in_features: int

    @property
    def input_pad(self) -> int:
        """Zero input channels to append to the rank's activations before the GEMM."""
        return int(self.packed.meta["shape"][1]) - self.in_features

    @property
    def out_features(self) -> int:
        return int(self.packed.meta["shape"][0])


def _meta(packed: PackedLayer) -> dict:
    return {k: v for k, v in packed.meta.items() if k not in ("tensors", "source")}


def _canonical(packed: PackedLayer, name: str) -> CanonicalLayer:
    return unpack(PackedLayer(meta=_meta(packed), tensors=packed.tensors), name=name)


def _repack(layer: CanonicalLayer, like: PackedLayer) -> PackedLayer:
    out = pack(layer)
    out.source = dict(like.source)
    return out


def column_slice(packed: PackedLayer, start: int, stop: int, name: str = "") -> PackedLayer:
    """Output rows ``[start, stop)`` of a packed layer (the bias's too), as a packed layer of its own."""
    n, k = (int(v) for v in packed.meta["shape"])
    if not 0 <= start < stop <= n:
        raise UnsupportedError(f"row range {start}:{stop} is not inside the layer's {n} output rows",
                               tensor=name or None)
    t = packed.tensors
    if start % TILE_N == 0 and (stop % TILE_N == 0 or stop == n):
        # whole stripes: the slice's bytes are the source's, rows of qweight and columns of the parameters
        rows = stop - start
        np_new = padded_shape(rows, k)[0]
        tensors = {"qweight": np.ascontiguousarray(t["qweight"][start // TILE_N:(start + np_new) // TILE_N])}
        for suffix in ("scales", "zeros", "mins"):
            if suffix in t:
                tensors[suffix] = np.ascontiguousarray(t[suffix][:, start:start + np_new])
        if "perm" in t:
            tensors["perm"] = np.array(t["perm"])
        if "bias" in t:
            tensors["bias"] = np.array(t["bias"][start:stop])
        meta = _meta(packed)
        meta["shape"] = [rows, k]
        meta["padded_shape"] = [np_new, int(packed.meta["padded_shape"][1])]
        return PackedLayer(meta=meta, tensors=tensors, source=dict(packed.source))
    layer = _canonical(packed, name)
    part = layer.replace(
        codes=np.ascontiguousarray(layer.codes[start:stop]), scales=np.ascontiguousarray(layer.scales[start:stop]),
        zeros=None if layer.zeros is None else np.ascontiguousarray(layer.zeros[start:stop]),
        bias=None if layer.bias is None else np.array(layer.bias[start:stop]))
    return _repack(part, packed)


def stack_blockers(layers: Sequence[PackedLayer]) -> list[str]:
    """Why these layers cannot be one packed layer stacked along N (empty when they can): they must share
    the whole structure along K, act-order permutation included."""
    first = layers[0].meta
    why = []
    for other in layers[1:]:
        m = other.meta
        if m["shape"][1] != first["shape"][1]:
            why.append(f"input widths differ ({first['shape'][1]} vs {m['shape'][1]})")
            continue
        for key in _STRUCTURE_KEYS:
            if m.get(key) != first.get(key):
                why.append(f"{key} differs ({first.get(key)!r} vs {m.get(key)!r})")
        if first.get("act_order") and m.get("act_order") and \
                not np.array_equal(layers[0].tensors["perm"], other.tensors["perm"]):
            why.append("act-order permutations differ")
        if ("bias" in layers[0].tensors) != ("bias" in other.tensors):
            why.append("only some layers have a bias")
        elif "bias" in other.tensors and first.get("bias_dtype") != m.get("bias_dtype"):
            why.append("bias dtypes differ")
    return why


def stack_rows(layers: Sequence[PackedLayer], name: str = "") -> PackedLayer:
    """Layers stacked along N into one (the rows of the first, then the second, ...): one GEMM for several
    projections of the same input. Refused (UnsupportedError) when ``stack_blockers`` finds a reason."""
    if not layers:
        raise ValueError("stack_rows needs at least one layer")
    if len(layers) == 1:
        return layers[0]
    why = stack_blockers(layers)
    if why:
        raise UnsupportedError("cannot stack these layers into one: " + "; ".join(why), tensor=name or None)
    n_total = sum(int(p.meta["shape"][0]) for p in layers)
    k = int(layers[0].meta["shape"][1])
    if all(int(p.meta["shape"][0]) % TILE_N == 0 for p in layers[:-1]):
        # every part but the last fills whole stripes: the stacked bytes are the parts' bytes, concatenated
        tensors = {"qweight": np.concatenate([p.tensors["qweight"] for p in layers], axis=0)}
        for suffix in ("scales", "zeros", "mins"):
            if suffix in layers[0].tensors:
                tensors[suffix] = np.concatenate([p.tensors[suffix] for p in layers], axis=1)
        if "perm" in layers[0].tensors:
            tensors["perm"] = np.array(layers[0].tensors["perm"])
        if "bias" in layers[0].tensors:
            tensors["bias"] = np.concatenate([np.asarray(p.tensors["bias"]) for p in layers])
        meta = _meta(layers[0])
        meta["shape"] = [n_total, k]
        meta["padded_shape"] = list(padded_shape(n_total, k))
        return PackedLayer(meta=meta, tensors=tensors, source=dict(layers[0].source))
    parts = [_canonical(p, name) for p in layers]
    first = parts[0]
    zeros = None
    if first.zero_mode == "int":
        zeros = np.concatenate([p.zeros.astype(np.int32) for p in parts], axis=0)
    elif first.zero_mode == "float":
        zeros = np.concatenate([p.zeros for p in parts], axis=0)
    bias = None if first.bias is None else np.concatenate([p.bias for p in parts])
    stacked = first.replace(codes=np.concatenate([p.codes for p in parts], axis=0),
                            scales=np.concatenate([p.scales for p in parts], axis=0), zeros=zeros, bias=bias,
                            name=name)
    return _repack(stacked, layers[0])


def _regroup_size(counts: np.ndarray, group_size: int, param_bytes: float, code_bytes: float) -> int:
    """The new group size g' (a multiple of 16, at most ``group_size``) whose layer reads the fewest bytes
    per output row: codes of real and padding channels plus one set of parameters per group."""
    best, best_cost = group_size, None
    for g in range(16, group_size + 1, 16):
        chunks = -(-counts // g)
        k_ext = int((chunks * g).sum()) - (int(chunks[-1] * g - counts[-1]))  # the last chunk may stay short
        cost = k_ext * code_bytes + int(chunks.sum()) * param_bytes
        if best_cost is None or cost < best_cost or (cost == best_cost and g > best):
            best, best_cost = g, cost
    return best


def row_slice(packed: PackedLayer, start: int, stop: int, name: str = "") -> Shard:
    """Input channels ``[start, stop)`` of a packed layer (original channel order) as a rank's shard.

    The shard's bias is dropped: in a row-parallel layer the bias is added once, after the ranks' sum."""
    n, k = (int(v) for v in packed.meta["shape"])
    if not 0 <= start < stop <= k:
        raise UnsupportedError(f"input range {start}:{stop} is not inside the layer's {k} input channels",
                               tensor=name or None)
    fast = _aligned_row_slice(packed, start, stop)
    if fast is not None:
        return Shard(fast, stop - start)
    layer = _canonical(packed, name)
    width = stop - start
    codes = layer.codes[:, start:stop]
    g_idx = layer.g_idx[start:stop]
    if layer.group_size == -1:
        part = layer.replace(codes=np.ascontiguousarray(codes), g_idx=np.zeros(width, dtype=np.int32), bias=None,
                             bias_dtype=None)
        return Shard(_repack(part, packed), width)
    groups, counts = np.unique(g_idx, return_counts=True)
    sbytes = np.dtype(layer.scales.dtype).itemsize
    param_bytes = sbytes * (1 if layer.zero_mode == "none" else 2)
    gsize = _regroup_size(counts, layer.group_size, param_bytes, int(packed.meta["storage_bits"]) / 8)
    order = np.argsort(g_idx, kind="stable")  # the rank's channels, grouped by source group
    chunk_src: list[int] = []        # source group of each new group
    new_g = np.empty(width, dtype=np.int32)
    pad_groups: list[int] = []       # new group of each padding channel
    pos = 0
    for gi, (g, c) in enumerate(zip(groups.tolist(), counts.tolist())):
        chunks = -(-c // gsize)
        members = order[pos:pos + c]
        pos += c
        base = len(chunk_src)
        new_g[members] = base + np.arange(c, dtype=np.int32) // gsize
        chunk_src.extend([g] * chunks)
        fill = chunks * gsize - c
        if fill and gi < len(groups) - 1:  # the layer's last group may stay short
            pad_groups.extend([base + chunks - 1] * fill)
    n_pad = len(pad_groups)
    src = np.asarray(chunk_src, dtype=np.int64)
    scales = np.ascontiguousarray(layer.scales[:, src])
    zeros = None if layer.zeros is None else np.ascontiguousarray(layer.zeros[:, src])
    full_codes = np.empty((n, width + n_pad), dtype=np.uint8)
    full_codes[:, :width] = codes
    if n_pad:
        pg = np.asarray(pad_groups, dtype=np.int64)
        # padding channels see zero inputs; still give them codes that dequantize to zero where one exists
        if layer.zero_mode == "none":
            full_codes[:, width:] = 1 << (layer.bits - 1)
        elif layer.zero_mode == "int":
            z = zeros[:, pg].astype(np.int64)
            full_codes[:, width:] = np.where(z <= (1 << layer.bits) - 1, z, 0).astype(np.uint8)
        else:
            full_codes[:, width:] = 0
        new_g = np.concatenate([new_g, np.asarray(pad_groups, dtype=np.int32)])
    part = CanonicalLayer(codes=full_codes, scales=scales, bits=layer.bits, group_size=gsize,
                          zero_mode=layer.zero_mode, zeros=zeros, g_idx=new_g, scale_dtype=layer.scale_dtype,
                          source=dict(layer.source), name=name)
    return Shard(_repack(part, packed), width)


def _aligned_row_slice(packed: PackedLayer, start: int, stop: int) -> PackedLayer | None:
    """Whole 64-column tiles and whole groups of a layer without act-order: the slice's bytes are the source's
    (tile columns of ``qweight``, group rows of the parameters); None when the cut is not so aligned."""
    m = packed.meta
    k, gs = int(m["shape"][1]), int(m["group_size"])
    if m.get("act_order") or gs == -1 or start % TILE_K or (stop % TILE_K and stop != k):
        return None
    if start % gs or (stop % gs and stop != k):
        return None
    t = packed.tensors
    words = t["qweight"].shape[1] // (int(m["padded_shape"][1]) // TILE_K)  # per stripe and tile
    kp_new = padded_shape(1, stop - start)[1]
    tensors = {"qweight": np.ascontiguousarray(t["qweight"][:, start // TILE_K * words:
                                                            (start + kp_new) // TILE_K * words])}
    g0, g_new = start // gs, -(-(stop - start) // gs)
    gp_new = -(-kp_new // gs)
    for suffix in ("scales", "zeros", "mins"):
        if suffix in t:
            arr = np.zeros((gp_new,) + t[suffix].shape[1:], dtype=t[suffix].dtype)
            arr[:g_new] = t[suffix][g0:g0 + g_new]
            tensors[suffix] = arr
    meta = _meta(packed)
    meta.update(shape=[int(m["shape"][0]), stop - start], padded_shape=[int(m["padded_shape"][0]), kp_new],
                num_groups=g_new, padded_groups=gp_new, bias_dtype=None)
    return PackedLayer(meta=meta, tensors=tensors, source=dict(packed.source))


def _even_split(total: int, tp_size: int, rank: int, what: str, name: str) -> tuple[int, int]:
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise UnsupportedError(f"rank {rank} is not one of {tp_size} tensor-parallel ranks", tensor=name or None)
    if total % tp_size:
        raise UnsupportedError(f"{what} {total} cannot be split evenly across tensor-parallel size {tp_size}",
                               tensor=name or None)
    per = total // tp_size
    return rank * per, (rank + 1) * per


def column_parallel(packed: PackedLayer, tp_size: int, rank: int, name: str = "") -> PackedLayer:
    """Rank ``rank``'s output rows of a column-parallel layer split evenly ``tp_size`` ways."""
    lo, hi = _even_split(int(packed.meta["shape"][0]), tp_size, rank, "out_features", name)
    return packed if (lo, hi) == (0, int(packed.meta["shape"][0])) else column_slice(packed, lo, hi, name)


def row_parallel(packed: PackedLayer, tp_size: int, rank: int, name: str = "") -> Shard:
    """Rank ``rank``'s input channels of a row-parallel layer split evenly ``tp_size`` ways (bias dropped)."""
    k = int(packed.meta["shape"][1])
    lo, hi = _even_split(k, tp_size, rank, "in_features", name)
    if tp_size == 1:
        tensors = {s: a for s, a in packed.tensors.items() if s != "bias"}
        meta = _meta(packed)
        meta["bias_dtype"] = None
        return Shard(PackedLayer(meta=meta, tensors=tensors, source=dict(packed.source)), k)
    return row_slice(packed, lo, hi, name)
