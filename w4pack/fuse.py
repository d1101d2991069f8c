"""Fused projections: pack q/k/v (and gate/up) of one block into one layer at convert time.

Why: at batch 1 each projection is a separate, latency-bound GEMM over the same input; one fused GEMM reads the
input once and launches once. Fusing stacks the layers along N (output rows), which is lossless only when they
share the group structure along K: same bits, group size, zero mode, scale dtype, input width and, with
act-order, the same column permutation (g_idx). Otherwise the fusion is refused with the reason.

The manifest records ``fused: {fused_name: [{"name": part, "rows": [start, end]}, ...]}`` (rows in the fused
layer's output), and the loader puts ``W4SliceLinear`` views at the part names, so model code is unchanged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .core.canonical import CanonicalLayer
from .errors import BadInputError, UnsupportedError
from .formats.base import Format, Source, TensorData

__all__ = ["FUSIONS", "parse_fuse", "plan_fusion", "fuse_layers", "FusedSource", "fusion_blockers", "split_fused",
           "UnfusedSource", "for_target"]

#: fusion kind -> (parts in order, fused module name)
FUSIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "qkv": (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    "gate-up": (("gate_proj", "up_proj"), "gate_up_proj"),
}


def parse_fuse(spec: str | Iterable[str] | None) -> list[str]:
    """'qkv,gate-up' (or a list) -> ['qkv', 'gate-up']; unknown kinds are bad input."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    kinds = []
    for raw in items:
        k = raw.strip().lower().replace("_", "-")
        if not k:
            continue
        if k == "gateup":
            k = "gate-up"
        if k not in FUSIONS:
            raise BadInputError(f"unknown fusion {raw!r} (known: {', '.join(FUSIONS)})")
        if k not in kinds:
            kinds.append(k)
    return kinds


def plan_fusion(layer_names: list[str], kinds: list[str]) -> dict[str, list[str]]:
    """{fused name: [part names]} for every block that has all the parts of a requested fusion."""
    present = set(layer_names)
    out: dict[str, list[str]] = {}
    for kind in kinds:
        parts, fused_leaf = FUSIONS[kind]
        for name in layer_names:
            prefix, _, leaf = name.rpartition(".")
            if leaf != parts[0]:
                continue
            full = [f"{prefix}.{p}" if prefix else p for p in parts]
            if all(p in present for p in full):
                fused = f"{prefix}.{fused_leaf}" if prefix else fused_leaf
                if fused in present:
                    raise UnsupportedError("the checkpoint already has a layer with the fused name",
                                           tensor=fused)
                out[fused] = full
    return out


def fusion_blockers(layers: list[CanonicalLayer]) -> list[str]:
    """Why these layers cannot be stacked along N (empty when they can)."""
    first = layers[0]
    why = []
    for other in layers[1:]:
        for attr in ("bits", "group_size", "zero_mode", "scale_dtype", "in_features"):
            a, b = getattr(first, attr), getattr(other, attr)
            if a != b:
                why.append(f"{attr} differs ({first.name}: {a}, {other.name}: {b})")
        # g_idx differs whenever the group sizes do (k // group_size): that is the group_size line above, and
        # only with the same groups is a different column order the reason (it was given for any K-quant mix)
        if first.in_features == other.in_features and first.group_size == other.group_size and \
                not np.array_equal(first.g_idx, other.g_idx):
            if first.act_order and other.act_order:
                order = f"act-order permutations differ ({first.name} vs {other.name})"
            else:
                ordered, plain = (first, other) if first.act_order else (other, first)
                order = f"{ordered.name} has act-order and {plain.name} has not"
            why.append(f"{order}: their groups along K are different column sets, so one packed layer cannot serve "
                       "both")
        if (first.bias is None) != (other.bias is None):
            why.append(f"only some parts have a bias ({first.name}: {first.bias is not None}, "
                       f"{other.name}: {other.bias is not None})")
        elif first.bias is not None and first.bias_dtype != other.bias_dtype:
            why.append(f"bias dtypes differ ({first.bias_dtype} vs {other.bias_dtype})")
    return why


def fuse_layers(name: str, layers: list[CanonicalLayer], file: str | None = None,
                way_out: str = "") -> tuple[CanonicalLayer, list[dict[str, Any]]]:
    """Stack layers along N into one canonical layer; returns it and the parts' row ranges. A refusal names
    ``file`` (the source) and ends with ``way_out`` when given."""
    why = fusion_blockers(layers)
    if why:
        raise UnsupportedError(f"cannot fuse {', '.join(l.name for l in layers)}: " + "; ".join(why) + way_out,
                               file=file, tensor=name)
    first = layers[0]
    rows, start = [], 0
    for l in layers:
        rows.append({"name": l.name, "rows": [start, start + l.out_features]})
        start += l.out_features
    zeros = None
    if first.zero_mode == "int":
        zeros = np.concatenate([l.zeros.astype(np.int32) for l in layers], axis=0)
    elif first.zero_mode == "float":
        zeros = np.concatenate([l.zeros for l in layers], axis=0)
    bias = None if first.bias is None else np.concatenate([l.bias for l in layers], axis=0)
    notes = []
    for l in layers:
        notes.extend(l.source.get("notes", []) if isinstance(l.source, dict) else [])
    source = dict(first.source) if isinstance(first.source, dict) else {}
    fused = CanonicalLayer(
        codes=np.concatenate([l.codes for l in layers], axis=0), scales=np.concatenate([l.scales for l in layers]),
        bits=first.bits, group_size=first.group_size, zero_mode=first.zero_mode, zeros=zeros,
        g_idx=first.g_idx.copy(), scale_dtype=first.scale_dtype, bias=bias, bias_dtype=first.bias_dtype,
        source=source, name=name,
    )
    return fused.validate(), rows


class FusedSource(Source):
    """A Source that presents fused layers in place of their parts (one fused layer in memory at a time)."""

    def __init__(self, inner: Source, kinds: list[str]):
        self.inner = inner
        self.config = inner.config
        self.info = dict(inner.info)
        self.path = getattr(inner, "path", Path("."))
        self.plan = plan_fusion(inner.layer_names(), kinds)
        self.kinds = kinds
        self._part_of = {p: fused for fused, parts in self.plan.items() for p in parts}
        # fusions the source already has (a fused w4pack checkpoint) stay recorded
        self.fused: dict[str, list[dict[str, Any]]] = inner.fused_layers()
        if self.plan:
            self.info["notes"] = list(self.info.get("notes", [])) + [
                f"fused {len(self.plan)} projection group(s): {', '.join(kinds)}"]

    def layer_names(self) -> list[str]:
        out, seen = [], set()
        for name in self.inner.layer_names():
            target = self._part_of.get(name, name)
            if target not in seen:
                seen.add(target)
                out.append(target)
        return out

    def read_layer(self, name: str) -> CanonicalLayer:
        if name not in self.plan:
            return self.inner.read_layer(name)
        parts = [self.inner.read_layer(p).replace(name=p) for p in self.plan[name]]
        leaf = name.rpartition(".")[2]
        kind = next((k for k, (_parts, fused) in FUSIONS.items() if fused == leaf), None)
        way_out = f" (convert without --fuse {kind}: the layers stay separate)" if kind else ""
        layer, rows = fuse_layers(name, parts, str(self.path), way_out)
        self.fused[name] = rows
        return layer

    def embedding_names(self) -> list[str]:
        return self.inner.embedding_names()  # never fused: they pass through under their own names

    def passthrough_names(self) -> list[str]:
        return self.inner.passthrough_names()

    def read_tensor(self, name: str) -> TensorData:
        return self.inner.read_tensor(name)

    def side_files(self) -> list[Path]:
        return self.inner.side_files()

    def fused_layers(self) -> dict[str, list[dict[str, Any]]]:
        return dict(self.fused)

    def close(self) -> None:
        self.inner.close()


def split_fused(layer: CanonicalLayer, part: str, rows: list[int]) -> CanonicalLayer:
    """Part ``part`` of a fused layer: its rows ``[start, end)`` of codes, scales, zero points and bias (the columns'
    group structure is shared by every part, so it is the fused layer's)."""
    a, b = int(rows[0]), int(rows[1])
    if not 0 <= a < b <= layer.out_features:
        raise BadInputError(f"fused part {part} has rows [{a}, {b}) outside the fused layer's {layer.out_features}",
                            tensor=layer.name or None)
    return layer.replace(codes=layer.codes[a:b].copy(), scales=layer.scales[a:b].copy(),
                         zeros=None if layer.zeros is None else layer.zeros[a:b].copy(),
                         bias=None if layer.bias is None else layer.bias[a:b].copy(),
                         g_idx=None if layer.g_idx is None else layer.g_idx.copy(), name=part).validate()


class UnfusedSource(Source):
    """A fused source (a ``--fuse``d w4pack checkpoint) as its original layers, for a format that stores no fusion:
    its loaders build q/k/v and gate/up, and a ``qkv_proj`` the model lacks would not load. One fused layer is held
    at a time (its parts are read one after the other)."""

    def __init__(self, inner: Source):
        self.inner = inner
        self.config = inner.config
        self.path = getattr(inner, "path", Path("."))
        self.fused = inner.fused_layers()
        self._of = {p["name"]: (fused, p["rows"]) for fused, parts in self.fused.items() for p in parts}
        self._held: tuple[str, CanonicalLayer] | None = None
        self.info = dict(inner.info)
        self.info["notes"] = list(inner.info.get("notes") or []) + [
            f"{len(self.fused)} fused layer(s) written as their {len(self._of)} parts"]

    def layer_names(self) -> list[str]:
        out: list[str] = []
        for name in self.inner.layer_names():
            out.extend([p["name"] for p in self.fused[name]] if name in self.fused else [name])
        return out

    def read_layer(self, name: str) -> CanonicalLayer:
        if name not in self._of:
            return self.inner.read_layer(name)
        fused, rows = self._of[name]
        if self._held is None or self._held[0] != fused:
            self._held = (fused, self.inner.read_layer(fused).replace(name=fused))
        return split_fused(self._held[1], name, rows)

    def embedding_names(self) -> list[str]:
        return self.inner.embedding_names()

    def passthrough_names(self) -> list[str]:
        return self.inner.passthrough_names()

    def read_tensor(self, name: str) -> TensorData:
        return self.inner.read_tensor(name)

    def tensor_span(self, name: str) -> Any:
        return self.inner.tensor_span(name)

    def side_files(self) -> list[Path]:
        return self.inner.side_files()

    def close(self) -> None:
        self._held = None
        self.inner.close()


def for_target(source: Source, target: type[Format]) -> Source:
    """``source`` as ``target`` can write it: unchanged when the format stores fusions or there are none."""
    if target.stores_fused or not source.fused_layers():
        return source
    return UnfusedSource(source)
