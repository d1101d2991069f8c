"""compressed-tensors ``pack-quantized`` (llm-compressor, vLLM): reader and writer.

On disk, per quantized Linear ``<m>`` (facts: reference/formats-awq-ct-gguf.md §4):

* ``<m>.weight_packed``     int32 [N, ceil(K·b/32)]: signed codes + 2**(b-1), a dense little-endian bit stream per
  row (4-bit: nibble i of word c is column 8c+i; no interleave).
* ``<m>.weight_scale``      bf16/fp16/fp32: group [N, K/G], channel [N, 1], tensor [1].
* ``<m>.weight_shape``      int64 [2] = [N, K] (the only exact record of K for channel/tensor).
* ``<m>.weight_zero_point`` asymmetric only: int32 [ceil(N·b/32), G], signed zeros + 2**(b-1) packed along N (the
  last word padded); tensor strategy and files older than 0.9.4 keep it unpacked with the scale's shape.
* ``<m>.weight_g_idx``      int32 [K] in older files with ``actorder: "group"``.

Symmetric layers have no zero point: the implicit unsigned zero is 2**(b-1), i.e. canonical zero mode "none".
Unsigned codes and zeros are exactly the canonical ones, so reading and writing are lossless.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..store.atomic import AtomicFolder
from ..core.canonical import CanonicalLayer
from ..store.checkpoint import parse_size
from ..core.dtypes import FLOAT_DTYPES
from ..errors import BadInputError, UnsupportedError
from ..store.folder import brief, copy_side_files, is_json_int, read_json, side_files, write_json
from ..store import open_tensors
from ..store.names import SIDE_FILES
from ..store.shards import ShardWriter
from ._patterns import backtracking
from .base import WAY_OUT, Capabilities, Format, Source, TensorData

__all__ = ["CompressedTensorsFormat", "CompressedTensorsSource", "pack_rows", "unpack_rows"]

#: the compressed-tensors release whose on-disk format this module writes (and was checked against)
CT_FORMAT_VERSION = "0.20.1"
_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_STRATEGIES = ("group", "channel", "tensor")


# ---------------------------------------------------------------------------------------------
# bit streams
# ---------------------------------------------------------------------------------------------
def unpack_rows(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Unsigned b-bit values [R, count] from int32 rows [R, W] holding a dense little-endian bit stream."""
    u = np.ascontiguousarray(words).astype("<u4", copy=False)
    byts = u.view(np.uint8).reshape(u.shape[0], -1)
    if bits == 8:
        return byts[:, :count].copy()
    if bits == 4:
        out = np.empty((byts.shape[0], byts.shape[1], 2), dtype=np.uint8)
        np.bitwise_and(byts, 15, out=out[:, :, 0])
        np.right_shift(byts, 4, out=out[:, :, 1])
        return out.reshape(byts.shape[0], -1)[:, :count].copy()
    stream = np.unpackbits(byts, axis=1, bitorder="little")[:, : count * bits]
    weights = (1 << np.arange(bits, dtype=np.uint16)).astype(np.uint16)
    return (stream.reshape(u.shape[0], count, bits).astype(np.uint16) @ weights).astype(np.uint8)


def _unpack_rows_legacy(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Older compressed-tensors for odd widths: 32 // b whole values per word, the top bits unused."""
    per = 32 // bits
    u = np.ascontiguousarray(words).astype("<u4", copy=False).astype(np.uint64)
    shifts = (np.arange(per, dtype=np.uint64) * bits)
    vals = (u[:, :, None] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(u.shape[0], -1)[:, :count].astype(np.uint8)


def pack_rows(vals: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, ceil(C·b/32)] dense bit stream of unsigned b-bit values [R, C] (inverse of unpack_rows)."""
    vals = np.ascontiguousarray(vals, dtype=np.uint8)
    r, c = vals.shape
    nwords = -(-c * bits // 32)
    if bits in (4, 8):
        per_word = 32 // bits
        padded = np.zeros((r, nwords * per_word), dtype=np.uint8)
        padded[:, :c] = vals
        if bits == 4:
            byts = (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)
        else:
            byts = padded
    else:
        bitarr = ((vals[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(r, c * bits)
        full = np.zeros((r, nwords * 32), dtype=np.uint8)
        full[:, : c * bits] = bitarr
        byts = np.packbits(full, axis=1, bitorder="little")
    return np.ascontiguousarray(byts).view("<u4").astype(np.int32, copy=False).reshape(r, nwords)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def _matches(name: str, target: str) -> bool:
    """compressed-tensors target/ignore matching: 're:<regex>', an exact module name, or a class name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target == name:
        return True
    # a class name ("Linear"): every module we see with packed weights is a Linear
    return "." not in target and target[:1].isupper() and target.endswith("Linear")


def _check_patterns(targets: list[str], key: str, label: str) -> None:
    """Every ``re:`` target must compile: a broken pattern is the config's fault, not a crash at match time. And it
    must match in time: Python's engine backtracks, so ``re:(.*.*)*!`` takes minutes on one module name and a few
    dozen bytes of config.json would hang every command (see _patterns.backtracking)."""
    for t in targets:
        if t.startswith("re:"):
            try:
                re.compile(t[3:])
            except re.error as exc:
                raise BadInputError(f"{key}: {brief(t)} is not a valid regular expression ({exc})",
                                    file=label) from None
            risk = backtracking(t[3:])
            if risk:
                raise BadInputError(f"{key}: {brief(t)} {risk}: matching it against a module name can take "
                                    "exponential time; write the pattern without it", file=label)


def _check_weights(w: dict[str, Any], key: str, label: str) -> None:
    """Types of the weight arguments read_layer relies on; int()/bool() would turn "x" into a crash, 128.5 into 128
    and "false" into True."""
    if "num_bits" in w and not is_json_int(w["num_bits"]):
        raise BadInputError(f"{key}.num_bits must be an integer, got {brief(w['num_bits'])}", file=label)
    if "symmetric" in w and not isinstance(w["symmetric"], bool):
        raise BadInputError(f"{key}.symmetric must be true or false, got {brief(w['symmetric'])}", file=label)
    gs = w.get("group_size")
    if gs is not None and (not is_json_int(gs) or gs == 0 or gs < -1):
        raise BadInputError(f"{key}.group_size must be a positive integer, -1 or null, got {brief(gs)}", file=label)
    if w.get("strategy") is not None and not isinstance(w["strategy"], str):
        raise BadInputError(f"{key}.strategy must be a string, got {brief(w['strategy'])}", file=label)
    if w.get("type") is not None and not isinstance(w["type"], str):
        raise BadInputError(f"{key}.type must be a string, got {brief(w['type'])}", file=label)


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight arguments (its ``weights``), types checked when the config is parsed."""

    group: str
    targets: tuple[str, ...]
    type: str
    bits: int
    symmetric: bool
    #: "group", "channel" or "tensor" as the config says (or implies by a group size); checked per layer
    strategy: str
    group_size: int | None
    format: str

    @classmethod
    def parse(cls, gname: str, targets: list[str], w: dict[str, Any], fmt: str) -> "WeightScheme":
        """The defaults and spellings of compressed-tensors' own QuantizationArgs: 8 bits, int, symmetric; a
        missing strategy is group for a positive group size, channel for -1, tensor without one; strategy and type
        in any case."""
        gs = w.get("group_size")
        strategy = w.get("strategy") or ("tensor" if gs is None else "channel" if gs == -1 else "group")
        return cls(group=gname, targets=tuple(targets), type=str(w.get("type") or "int").lower(),
                   bits=int(w.get("num_bits", 8)), symmetric=bool(w.get("symmetric", True)),
                   strategy=str(strategy).lower(), group_size=gs, format=fmt)


@dataclass(frozen=True)
class CTConfig:
    """config.json's quantization_config (or compression_config) of a compressed-tensors checkpoint, parsed once
    before any tensor is read: the weight schemes of its config_groups with their targets, the ignore list, the
    checkpoint format. ``present``: False when the folder has none (schemes are then inferred per layer)."""

    present: bool
    schemes: tuple[WeightScheme, ...] = ()
    ignore: tuple[str, ...] = ()
    version: str | None = None
    #: the file errors about the config name
    file: str = ""

    @classmethod
    def parse(cls, q: dict[str, Any] | None, label: str) -> "CTConfig":
        if q is None:
            return cls(present=False, file=label)
        qm = q.get("quant_method")
        if qm not in (None, "compressed-tensors", "sparseml"):
            raise UnsupportedError(f"quant_method is {qm!r}, not compressed-tensors", file=label)
        fmt = q.get("format") or "pack-quantized"
        if q.get("quantization_status") not in (None, "compressed"):
            raise UnsupportedError(f"quantization_status {q.get('quantization_status')!r}: weights are not stored "
                                   "compressed", file=label)
        schemes = _parse_groups(q.get("config_groups") or {}, fmt, label)
        ign = q.get("ignore") or []
        ignore = [ign] if isinstance(ign, str) else ign
        if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
            raise BadInputError(f"ignore must be a list of module names or re: patterns, got {brief(ign)}",
                                file=label)
        _check_patterns(ignore, "ignore", label)
        if q.get("sparsity_config"):
            sc = q["sparsity_config"]
            if isinstance(sc, dict) and sc.get("format") not in (None, "dense"):
                raise UnsupportedError(f"sparse compression {sc.get('format')!r} is not supported", file=label)
        version = q.get("version")
        return cls(present=True, schemes=tuple(schemes), ignore=tuple(ignore),
                   version=None if version is None else str(version), file=label)

    def scheme(self, name: str) -> WeightScheme | None:
        """The scheme of the config group that claims module ``name``; None without a config."""
        if not self.present:
            return None
        if any(_matches(name, t) for t in self.ignore):
            raise BadInputError("module is listed in ignore but stores packed weights", file=self.file, tensor=name)
        # compressed-tensors prefers exact names over regexes over class names
        for kind in ("exact", "re", "class"):
            for sch in self.schemes:
                for t in sch.targets:
                    k = "re" if t.startswith("re:") else ("exact" if t == name else "class")
                    if k == kind and _matches(name, t):
                        return sch
        raise BadInputError("no config group targets this module", file=self.file, tensor=name)


def _parse_groups(groups: Any, fmt: str, label: str) -> list[WeightScheme]:
    """The weight schemes of ``config_groups`` (activation-only groups store nothing for weights: skipped)."""
    if not isinstance(groups, dict):
        raise BadInputError("config_groups is not an object", file=label)
    out = []
    for gname, g in groups.items():
        if not isinstance(g, dict):
            raise BadInputError(f"config group {gname!r} is not an object", file=label)
        targets = g.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise BadInputError(f"config_groups.{gname}.targets must be a list of strings, got {brief(targets)}",
                                file=label)
        _check_patterns(targets, f"config_groups.{gname}.targets", label)
        weights = g.get("weights")
        if not isinstance(weights, dict):
            continue
        _check_weights(weights, f"config_groups.{gname}.weights", label)
        out.append(WeightScheme.parse(gname, list(targets), weights, str(g.get("format") or fmt)))
    return out


class _Layout(NamedTuple):
    """How one layer is stored, from its scheme or (without a config) its tensors: ``bits`` None = infer."""

    bits: int | None
    sym: bool
    strategy: str
    group_size: int | None


class CompressedTensorsSource(Source):
    """A compressed-tensors model folder (config.json + safetensors shards) or a bare .safetensors file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.notes: list[str] = []
        self.folder = self.path if self.path.is_dir() else self.path.parent
        self.config: dict[str, Any] = {}
        qcfg: dict[str, Any] | None = None
        cfg_path = self.folder / "config.json"
        if self.path.is_dir() and cfg_path.is_file():
            cfg = read_json(cfg_path)
            if not isinstance(cfg, dict):
                raise BadInputError("config.json is not a JSON object", file=str(cfg_path))
            qcfg = cfg.get("quantization_config") or cfg.get("compression_config")
            if qcfg is not None and not isinstance(qcfg, dict):
                raise BadInputError(f"quantization_config is a {type(qcfg).__name__}, not an object",
                                    file=str(cfg_path))
            self.config = {k: v for k, v in cfg.items() if k not in ("quantization_config", "compression_config")}
        self.qcfg = qcfg if isinstance(qcfg, dict) else None
        self._cfg_label = str(cfg_path)
        self.store = open_tensors(self.path, pickles="none")
        self.tensor_file: dict[str, Path] = {t: Path(f) for t, f in self.store.where.items()}
        self.cfg = CTConfig.parse(self.qcfg, self._cfg_label)
        if not self.cfg.present:
            self.notes.append("no quantization_config: schemes inferred from tensor shapes")
        # modules with packed weights, in file order
        self._layers: list[str] = []
        seen = set()
        for t in self.tensor_file:
            if t.endswith(".weight_packed"):
                m = t[: -len(".weight_packed")]
                if m not in seen:
                    seen.add(m)
                    self._layers.append(m)
        if not self._layers:
            raise UnsupportedError("no weight_packed tensors: not a pack-quantized compressed-tensors checkpoint",
                                   file=str(self.path))
        owned = set()
        for m in self._layers:
            for s in _SUFFIXES + ("bias",):
                owned.add(f"{m}.{s}")
            if f"{m}.weight" in self.tensor_file:
                raise BadInputError("module holds both weight and weight_packed",
                                    file=str(self.tensor_file[m + ".weight"]), tensor=f"{m}.weight")
        self._passthrough = [t for t in self.tensor_file if t not in owned]
        self.info = {"format": "compressed-tensors", "version": self.cfg.version, "notes": self.notes}

    # -- tensors -------------------------------------------------------------------------------
    def _get(self, tname: str) -> np.ndarray:
        return self.store.get(tname)

    def _dtype(self, tname: str) -> str:
        return self.store.info(tname)[0]

    def _label(self, tname: str) -> str:
        return str(self.tensor_file.get(tname, self.path))

    # -- Source --------------------------------------------------------------------------------
    def layer_names(self) -> list[str]:
        return list(self._layers)

    def passthrough_names(self) -> list[str]:
        return list(self._passthrough)

    def _release_pages(self) -> None:
        """Before each layer or tensor: the shards' pages read so far leave our resident memory."""
        self.store.release_all()

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self.tensor_file:
            raise BadInputError("no such tensor", file=str(self.path), tensor=name)
        return tuple(self.store.info(name)[1])

    def read_tensor(self, name: str) -> TensorData:
        if name not in self.tensor_file:
            raise BadInputError("no such tensor", file=str(self.path), tensor=name)
        self._release_pages()
        return TensorData(self._get(name), self._dtype(name))

    def side_files(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        return side_files(self.path, SIDE_FILES)

    def close(self) -> None:
        self.store.close()

    def _zero_points(self, zp_name: str, strategy: str, bits: int, n: int, ng: int) -> tuple[np.ndarray, str | None]:
        """Unsigned zero points [N, G] (signed + 2**(b-1)) from the packed or the older unpacked form."""
        zp = self._get(zp_name)
        label = self._label(zp_name)
        packed_shape = (-(-n * bits // 32), ng)
        legacy_shape = (-(-n // (32 // bits)), ng)  # whole values per word, as the codes of older files (3-bit)
        if strategy != "tensor" and zp.dtype == np.int32 and zp.shape != (n, ng):
            if zp.shape == packed_shape:
                return unpack_rows(np.ascontiguousarray(zp.T), bits, n).T.copy(), None
            if zp.shape == legacy_shape:
                return _unpack_rows_legacy(np.ascontiguousarray(zp.T), bits, n).T.copy(), None
        if not (zp.size == n * ng or (strategy == "tensor" and zp.size == 1)):
            raise BadInputError(f"weight_zero_point shape {list(zp.shape)} {zp.dtype} fits neither packed "
                                f"{list(packed_shape)} nor unpacked [{n}, {ng}]", file=label, tensor=zp_name)
        # unpacked (tensor strategy, or files older than 0.9.4): signed values in the scale's shape
        zvals = np.asarray(zp)
        if zvals.dtype.kind == "f" or zvals.dtype == np.uint16:  # float or bf16-bits zero points
            raw = zvals.astype(np.float32) if zvals.dtype.kind == "f" else \
                (zvals.astype(np.uint32) << 16).view(np.float32)
            if not np.all(raw == np.round(raw)):
                raise BadInputError("zero points are not integers", file=label, tensor=zp_name)
            zvals = raw
        zs = zvals.astype(np.int64).reshape(-1)
        zs = np.broadcast_to(zs.reshape(1, 1), (n, 1)) if strategy == "tensor" else zs.reshape(n, ng)
        zeros = zs + (1 << (bits - 1))
        if int(zeros.min()) < 0 or int(zeros.max()) > (1 << bits) - 1:
            raise BadInputError(f"zero points outside the signed {bits}-bit range", file=label, tensor=zp_name)
        return zeros.astype(np.uint8), "unpacked weight_zero_point"

    def read_layer(self, name: str) -> CanonicalLayer:
        if name not in self._layers:
            raise BadInputError("no such quantized layer", file=str(self.path), tensor=name)
        self._release_pages()
        tp, ts = f"{name}.weight_packed", f"{name}.weight_scale"
        if ts not in self.tensor_file:
            raise BadInputError("tensor is missing", file=self._label(tp), tensor=ts)
        packed = self._get(tp)
        if packed.dtype != np.int32 or packed.ndim != 2:
            raise BadInputError(f"weight_packed must be int32 [N, words], got {packed.dtype} {list(packed.shape)}",
                                file=self._label(tp), tensor=tp)
        n, words = packed.shape
        sdt = self._dtype(ts)
        if sdt not in FLOAT_DTYPES:
            raise UnsupportedError(f"weight_scale dtype {sdt} (expected bfloat16, float16 or float32)",
                                   file=self._label(ts), tensor=ts)
        scale = self._get(ts)
        scheme = self.cfg.scheme(name)
        if scheme is not None and scheme.format and scheme.format != "pack-quantized":
            raise UnsupportedError(f"format {scheme.format!r}: only pack-quantized int weights are supported",
                                   file=self.cfg.file, tensor=name)
        k = self._stated_in_features(name, n)
        zp_name = f"{name}.weight_zero_point"
        lay = self._layout(name, scheme, scale, zp_name in self.tensor_file)
        notes: dict[str, Any] = {}
        bits, k = self._bits_and_k(name, lay, k, words, notes)
        codes = self._codes(tp, packed, bits, k, notes)
        scales, group_size = self._scales(ts, scale, lay, n, k)
        zero_mode, zeros = "none", None
        if zp_name in self.tensor_file:
            zero_mode, zeros = self._zeros(zp_name, lay, bits, n, scales.shape[1], notes)
        g_idx = self._g_idx(f"{name}.weight_g_idx", k, group_size, scales.shape[1])
        bias = bias_dtype = None
        if f"{name}.bias" in self.tensor_file:
            bias_dtype = self._dtype(f"{name}.bias")
            bias = np.array(self._get(f"{name}.bias"))
        source = {"format": "compressed-tensors", "strategy": lay.strategy, "symmetric": lay.sym}
        if notes:
            source.update(notes)
        layer = CanonicalLayer(codes=codes, scales=scales, bits=bits, group_size=group_size, zero_mode=zero_mode,
                               zeros=zeros, g_idx=g_idx, scale_dtype=sdt, bias=bias, bias_dtype=bias_dtype,
                               source=source, name=name)
        try:
            return layer.validate()
        except BadInputError as exc:
            raise BadInputError(exc.message, file=self._label(tp), tensor=name) from None

    def _stated_in_features(self, name: str, n: int) -> int | None:
        """K from weight_shape, the only exact record of it (None when the tensor is absent)."""
        tsh = f"{name}.weight_shape"
        if tsh not in self.tensor_file:
            return None
        shp = self._get(tsh)
        if shp.size != 2 or shp.dtype.kind not in "iu":
            raise BadInputError(f"weight_shape must hold two integers, got {shp.dtype} {list(shp.shape)}",
                                file=self._label(tsh), tensor=tsh)
        n_s, k = (int(x) for x in np.asarray(shp).reshape(-1))
        if n_s != n:
            raise BadInputError(f"weight_shape says {n_s} rows but weight_packed has {n}", file=self._label(tsh),
                                tensor=tsh)
        return k

    def _layout(self, name: str, scheme: WeightScheme | None, scale: np.ndarray, has_zp: bool) -> _Layout:
        """The scheme's layout, or without a config the one the tensors show (a zero point: asymmetric)."""
        if scheme is None:
            strategy = "tensor" if scale.size == 1 and scale.ndim <= 1 else ("channel" if scale.shape[-1] == 1
                                                                                else "group")
            return _Layout(bits=None, sym=not has_zp, strategy=strategy, group_size=None)
        if scheme.type != "int":
            raise UnsupportedError(f"weight type {scheme.type!r}: only int is supported", file=self.cfg.file,
                                   tensor=name)
        if scheme.strategy not in _STRATEGIES:
            raise UnsupportedError(f"strategy {scheme.strategy!r} (supported: {', '.join(_STRATEGIES)})",
                                   file=self.cfg.file, tensor=name)
        if not scheme.symmetric and not has_zp:
            raise BadInputError("asymmetric scheme but weight_zero_point is missing",
                                file=self._label(f"{name}.weight_packed"), tensor=f"{name}.weight_zero_point")
        return _Layout(bits=scheme.bits, sym=scheme.symmetric, strategy=scheme.strategy, group_size=scheme.group_size)

    def _bits_and_k(self, name: str, lay: _Layout, k: int | None, words: int,
                    notes: dict[str, Any]) -> tuple[int, int]:
        """(bits, K): K from weight_shape, else the group count or the packed width; bits from the scheme, else the
        packed width."""
        tp, tsh = f"{name}.weight_packed", f"{name}.weight_shape"
        bits = lay.bits
        if k is None:
            if lay.strategy == "group" and lay.group_size:
                k = int(self._get(f"{name}.weight_scale").shape[-1]) * int(lay.group_size)
            elif bits is not None and (words * 32) % bits == 0:
                k = words * 32 // bits
                notes["quirk"] = "no weight_shape: in_features taken from the packed width"
            else:
                raise BadInputError("weight_shape is missing and in_features cannot be derived",
                                    file=self._label(tp), tensor=tsh)
        if bits is None:  # infer from the packed width
            cands = [b for b in (4, 8, 2, 3) if -(-k * b // 32) == words]
            if not cands:
                raise BadInputError(f"weight_packed width {words} fits no bit width for in_features {k}",
                                    file=self._label(tp), tensor=tp)
            bits = cands[0]
        if bits not in (2, 3, 4, 8):
            raise UnsupportedError(f"{bits}-bit weights (supported: 2, 3, 4, 8)", file=self._label(tp), tensor=name)
        if k < 1:
            raise BadInputError(f"in_features {k} must be positive", file=self._label(tsh), tensor=tsh)
        return bits, k

    def _codes(self, tp: str, packed: np.ndarray, bits: int, k: int, notes: dict[str, Any]) -> np.ndarray:
        """codes [N, K] from the dense bit stream, or the older whole-values-per-word packing (3-bit)."""
        words = packed.shape[1]
        dense = -(-k * bits // 32)
        legacy = -(-k // (32 // bits))
        if words == dense:
            return unpack_rows(packed, bits, k)
        if words == legacy:
            notes["quirk"] = f"older packing: {32 // bits} whole values per int32"
            return _unpack_rows_legacy(packed, bits, k)
        raise BadInputError(f"weight_packed has {words} words per row; {k} {bits}-bit values need {dense}",
                            file=self._label(tp), tensor=tp)

    def _scales(self, ts: str, scale: np.ndarray, lay: _Layout, n: int, k: int) -> tuple[np.ndarray, int]:
        """(scales [N, G], group size) for the tensor, channel or group strategy."""
        if lay.strategy == "tensor":
            if scale.size != 1:
                raise BadInputError(f"tensor strategy needs one scale, got shape {list(scale.shape)}",
                                    file=self._label(ts), tensor=ts)
            return np.broadcast_to(np.asarray(scale).reshape(1, 1), (n, 1)).copy(), -1
        if scale.ndim != 2 or scale.shape[0] != n or scale.shape[1] < 1:
            raise BadInputError(f"weight_scale shape {list(scale.shape)} is not [{n} rows, groups]",
                                file=self._label(ts), tensor=ts)
        g = int(scale.shape[1])
        if lay.strategy == "channel":
            if g != 1:
                raise BadInputError(f"channel strategy needs weight_scale [N, 1], got {list(scale.shape)}",
                                    file=self._label(ts), tensor=ts)
            return np.array(scale), -1
        gs_cfg = lay.group_size
        if gs_cfg:
            group_size = int(gs_cfg)
        elif k % g == 0:
            group_size = k // g
        else:
            raise BadInputError(f"cannot infer the group size: {k} columns, {g} groups", file=self._label(ts),
                                tensor=ts)
        if group_size == k and g == 1 and gs_cfg in (None, -1):
            group_size = -1
        if group_size != -1 and -(-k // group_size) != g:
            raise BadInputError(f"weight_scale has {g} groups; {k} columns in groups of {group_size} need "
                                f"{-(-k // group_size)}", file=self._label(ts), tensor=ts)
        return np.array(scale), group_size

    def _zeros(self, zp_name: str, lay: _Layout, bits: int, n: int, ng: int,
               notes: dict[str, Any]) -> tuple[str, np.ndarray | None]:
        """(zero mode, zeros): a symmetric scheme's stored zero points must all be the implicit 2**(b-1)."""
        zeros, quirk = self._zero_points(zp_name, lay.strategy, bits, n, ng)
        if quirk:
            notes["quirk"] = quirk
        if not lay.sym:
            return "int", zeros
        if np.any(zeros != 1 << (bits - 1)):
            raise BadInputError("symmetric scheme but weight_zero_point holds nonzero zero points",
                                file=self._label(zp_name), tensor=zp_name)
        return "none", None

    def _g_idx(self, gi_name: str, k: int, group_size: int, ng: int) -> np.ndarray | None:
        """weight_g_idx of older act-order files, checked against K and the groups."""
        if gi_name not in self.tensor_file:
            return None
        gi = self._get(gi_name)
        if gi.shape != (k,) or gi.dtype.kind not in "iu":
            raise BadInputError(f"weight_g_idx must be int [{k}], got {gi.dtype} {list(gi.shape)}",
                                file=self._label(gi_name), tensor=gi_name)
        if group_size == -1 and np.any(np.asarray(gi) != 0):
            raise BadInputError("weight_g_idx names groups but the layer has one", file=self._label(gi_name),
                                tensor=gi_name)
        g_idx = np.asarray(gi).astype(np.int32)
        if g_idx.size and (int(g_idx.min()) < 0 or int(g_idx.max()) >= ng):
            raise BadInputError(f"weight_g_idx values outside 0..{ng - 1}", file=self._label(gi_name), tensor=gi_name)
        return g_idx


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def _strategy_hint(layer: CanonicalLayer) -> str | None:
    src = layer.source or {}
    if src.get("strategy"):
        return str(src["strategy"])
    for note in src.get("notes") or []:
        if isinstance(note, str) and note.startswith("strategy="):
            return note.split("=", 1)[1]
    return None


_Items = list[tuple[str, np.ndarray, str | None]]


def _unwritable(source: Source, name: str) -> bool:
    try:
        _layer_tensors(name, source.read_layer(name))
    except UnsupportedError:
        return True
    return False


def _layer_tensors(name: str, layer: CanonicalLayer) -> tuple[tuple[Any, ...], _Items]:
    """(scheme key, [(tensor name, array, dtype name)]) of one layer, or UnsupportedError."""
    reason = CompressedTensorsFormat.capabilities.check(layer)
    if reason:
        raise UnsupportedError(f"compressed-tensors cannot express {reason}", tensor=name)
    n, k, b = layer.out_features, layer.in_features, layer.bits
    sym = layer.zero_mode == "none"
    if not sym and int(layer.zeros.max()) > (1 << b) - 1:
        raise UnsupportedError(f"zero point {1 << b} does not fit the signed {b}-bit range of compressed-tensors "
                               f"(way out: {WAY_OUT})", tensor=name)
    if layer.group_size == -1:
        strategy = "channel"
        if _strategy_hint(layer) == "tensor" and np.all(layer.scales == layer.scales.reshape(-1)[0]) and \
                (sym or np.all(layer.zeros == layer.zeros.reshape(-1)[0])):
            strategy = "tensor"
        gs = None
    else:
        if k % layer.group_size:
            raise UnsupportedError(f"group size {layer.group_size} does not divide in_features {k} "
                                   "(compressed-tensors requires whole groups)", tensor=name)
        strategy, gs = "group", layer.group_size
    items: list[tuple[str, np.ndarray, str | None]] = [
        (f"{name}.weight_packed", pack_rows(layer.codes, b), None),
    ]
    if strategy == "tensor":
        items.append((f"{name}.weight_scale", np.ascontiguousarray(layer.scales.reshape(-1)[:1]), layer.scale_dtype))
    else:
        items.append((f"{name}.weight_scale", np.ascontiguousarray(layer.scales), layer.scale_dtype))
    items.append((f"{name}.weight_shape", np.array([n, k], dtype=np.int64), None))
    if not sym:
        if strategy == "tensor":
            signed = (layer.zeros.reshape(-1)[:1].astype(np.int16) - (1 << (b - 1))).astype(np.int8)
            items.append((f"{name}.weight_zero_point", signed, None))
        else:
            zp = pack_rows(np.ascontiguousarray(layer.zeros.astype(np.uint8).T), b).T
            items.append((f"{name}.weight_zero_point", np.ascontiguousarray(zp), None))
    if layer.bias is not None:
        items.append((f"{name}.bias", np.ascontiguousarray(layer.bias), layer.bias_dtype))
    return (b, sym, strategy, gs), items


def build_quantization_config(schemes: dict[str, tuple[Any, ...]], ignore: list[str]) -> dict[str, Any]:
    """config.json quantization_config for layers {module: (bits, sym, strategy, group_size)}.

    One scheme: targets ["Linear"] plus an ignore list of every unquantized module that has a 2-D weight (so a
    tied lm_head or a kept-in-fp16 projection is not expected to be packed). Several: explicit module names.
    """
    by_key: dict[tuple[Any, ...], list[str]] = {}
    for name, key in schemes.items():
        by_key.setdefault(key, []).append(name)
    groups: dict[str, Any] = {}
    for i, ((bits, sym, strategy, gs), names) in enumerate(sorted(by_key.items(), key=lambda kv: str(kv[0]))):
        groups[f"group_{i}"] = {
            "targets": ["Linear"] if len(by_key) == 1 else sorted(names),
            "weights": {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
                        "group_size": gs, "dynamic": False, "actorder": None, "observer": "minmax",
                        "observer_kwargs": {}},
            "input_activations": None, "output_activations": None, "format": "pack-quantized",
        }
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "version": CT_FORMAT_VERSION, "config_groups": groups, "ignore": sorted(ignore),
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}}


class CompressedTensorsFormat(Format):
    name = "compressed-tensors"
    write_options: frozenset[str] = frozenset()
    read_options: frozenset[str] = frozenset()
    description = "compressed-tensors pack-quantized (llm-compressor / vLLM)"
    capabilities = Capabilities(bits=(2, 3, 4, 8), zero_modes=("none", "int"), act_order=False,
                                notes=["group strategy needs group_size dividing in_features",
                                       "act-order (weight_g_idx) is read but not written: compressed-tensors 0.20 "
                                       "removed it"])

    @classmethod
    def detect(cls, path: Path) -> bool:
        p = Path(path)
        if p.is_dir():
            cfg = p / "config.json"
            if cfg.is_file():
                try:
                    doc = read_json(cfg)
                except BadInputError:
                    return False
                q = (doc.get("quantization_config") or doc.get("compression_config")) if isinstance(doc, dict) else None
                if isinstance(q, dict):
                    return q.get("quant_method") == "compressed-tensors"
            files = sorted(p.glob("*.safetensors"))[:1]
        elif p.suffix == ".safetensors":
            files = [p]
        else:
            return False
        for f in files:
            try:
                with open_tensors(f) as st:
                    return any(t.endswith(".weight_packed") for t in st.names())
            except (BadInputError, UnsupportedError):
                return False
        return False

    @classmethod
    def open(cls, path: Path, **options: Any) -> Source:
        return CompressedTensorsSource(Path(path))

    own_layer_checks = True

    @classmethod
    def check_writable(cls, source: Source) -> list[str]:
        problems = []
        for name in source.layer_names():
            try:
                _layer_tensors(name, source.read_layer(name))
            except UnsupportedError as exc:
                problems.append(f"{name}: {exc.message}")
        return problems

    @classmethod
    def write(cls, source: Source, out: Path, *, force: bool = False, max_shard_size: int | str = "5GB",
              show_progress: bool | None = None, **options: Any) -> Path:
        """Write ``source`` as a pack-quantized folder: config.json, model(-k-of-n).safetensors, side files."""
        from ..progress import Progress

        names = source.layer_names()
        passthrough = source.passthrough_names()
        quantized = set(names)
        schemes: dict[str, tuple[Any, ...]] = {}
        ignore: set[str] = set()
        with AtomicFolder(out, force=force) as tmp:
            with ShardWriter(tmp, parse_size(max_shard_size)) as shards, \
                    Progress(len(names) + len(passthrough), "writing", enabled=show_progress) as bar:
                for i, name in enumerate(names):
                    try:
                        key, items = _layer_tensors(name, source.read_layer(name))
                    except UnsupportedError as exc:  # said once, with how many other layers share the fate
                        rest = sum(1 for n in names[i + 1:] if _unwritable(source, n))
                        more = f" (and {rest} more layer(s))" if rest else ""
                        where = getattr(source, "path", None)
                        raise UnsupportedError(f"cannot write compressed-tensors: {name}: {exc.message}{more}",
                                               file=str(where) if where else None) from None
                    schemes[name] = key
                    shards.add_group(items)
                    bar.update()
                for t in passthrough:
                    td = source.read_tensor(t)
                    if t.endswith(".weight") and td.array.ndim == 2 and t[: -len(".weight")] not in quantized:
                        ignore.add(t[: -len(".weight")])
                    shards.add(t, td.array, td.dtype)
                    bar.update()
                shards.finish()
            if "lm_head" not in quantized:
                ignore.add("lm_head")
            config = dict(source.config)
            config["quantization_config"] = build_quantization_config(schemes, sorted(ignore))
            write_json(tmp / "config.json", config)
            copy_side_files(source.side_files(), tmp)
        return Path(out)
