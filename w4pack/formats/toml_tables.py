"""GPTQ-for-LLaMa "observer" quant tables (TOML + NumPy), read with the user's base weights, and written back.

The tables (``reference/formats-gptq.md`` §8) hold, per decoder Linear, ``scale`` float32 [N, G], ``zero``
float32 integer-valued [N, G] (omitted when ``sym``: then 2^(wbits-1)), ``group_ids`` int32 [K] (GPTQ's g_idx,
omitted when groupsize <= 0), ``wbits`` and ``groupsize``, but no integer weights. Two variants exist:

* ``quant.toml`` keyed by layer name, arrays in ``<layer>.{scale,zero,group_ids}.npy`` beside it (triton HEAD);
* ``decoder-N.toml`` (also ``decoder.N.toml``), arrays as inline flattened lists plus ``*_shape`` (April 2023).

Codes come from the base weights the user names: ``q = clamp(round(w / s) + z, 0, 2^b - 1)`` per column's group.
The quotient is taken in float64, i.e. the exactly rounded real quotient: a float32 division can land on a
.5 tie that the real quotient is not on and round the other way (the fixtures' truth shows such cases).

The writer emits ``quant.toml`` + ``.npy`` tables (or the inline variant) and, by default, a ``model.safetensors``
holding weights from which the reader rebuilds exactly the source's codes (fp16 where that is exact, else fp32) plus
the pass-through tensors, so the folder is complete for a C++/SIMD runtime and reads back without ``--base``.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..store.atomic import AtomicFolder, check_output
from ..core.canonical import CanonicalLayer, default_g_idx
from ..store.checkpoint import parse_size
from ..core.dtypes import FLOAT_DTYPES, from_float32, to_float32
from ..errors import BadInputError, UnsupportedError
from ..store.folder import brief, copy_side_files, is_json_int, read_json as _read_json, side_files, write_json
from ..store import open_tensors
from ..store.names import INDEX_NAME, SIDE_FILES
from ..store.shards import ShardWriter
from ..store.tables import (QUANT_TOML, append_text, has_table_documents, npy_beside, read_npy, read_toml,
                            table_documents, write_npy)
from .base import Capabilities, Format, HubFiles, Source, TensorData

__all__ = ["TomlTablesFormat", "TomlTablesSource", "LayerTable", "parse_table", "rtn_codes", "dump_toml"]

_ROW_CHUNK = 512
_INDEX_RE = re.compile(r"\.(\d+)\.")


def rtn_codes(weight: np.ndarray, weight_dtype: str, scales: np.ndarray, scale_dtype: str, zeros: np.ndarray,
              g_idx: np.ndarray, bits: int) -> np.ndarray:
    """q = clamp(round(w / s[:, g]) + z[:, g], 0, 2^bits - 1) with a float64 quotient, row chunk by row chunk."""
    n, _k = weight.shape
    qmax = float((1 << bits) - 1)
    s64 = to_float32(np.asarray(scales), scale_dtype).astype(np.float64)
    z64 = zeros.astype(np.float64)
    out = np.empty(weight.shape, dtype=np.uint8)
    for r0 in range(0, n, _ROW_CHUNK):
        r1 = min(n, r0 + _ROW_CHUNK)
        w = to_float32(np.asarray(weight[r0:r1]), weight_dtype).astype(np.float64)
        q = np.rint(w / s64[r0:r1][:, g_idx]) + z64[r0:r1][:, g_idx]
        np.clip(q, 0.0, qmax, out=q)
        out[r0:r1] = q.astype(np.uint8)
    return out


# ---------------------------------------------------------------------------------------------
# TOML writing (the observer's documents use only strings, ints, floats, bools and flat lists)
# ---------------------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if not math.isfinite(f):
            raise BadInputError(f"cannot write a non-finite number {f} to TOML")
        return repr(f)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON escapes are valid TOML escapes
    if isinstance(v, (list, tuple)):
        return "[ " + " ".join(_toml_value(x) + "," for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def dump_toml(tables: dict[str, dict[str, Any]]) -> str:
    """A TOML document of top-level tables keyed by (quoted) layer names."""
    parts = []
    for key, table in tables.items():
        lines = [f"[{json.dumps(key)}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
#: how deep layer tables may nest ([model.layers.0.self_attn.q_proj] is 5): deeper is a hostile document
MAX_TABLE_DEPTH = 64


def _flatten_tables(doc: dict[str, Any], document: Path) -> dict[str, dict[str, Any]]:
    """Layer tables by full name; unquoted keys (``[model.layers.0.q]``) nest, so walk down to ``wbits``.

    A quoted and a dotted header (``["model.layers.0.q"]`` and ``[model.layers.0.q]``) are two valid TOML tables
    with one full name: which one quantizes the layer cannot be told, so that is refused as a layer given twice.
    The walk keeps its own stack: a document nesting tables thousands deep is one error, not a RecursionError."""
    out: dict[str, dict[str, Any]] = {}
    stack: list[tuple[str, Iterator[tuple[str, Any]]]] = [("", iter(doc.items()))]
    while stack:  # depth first, in document order: the order the reader lists the layers in
        prefix, items = stack[-1]
        for key, val in items:
            if not isinstance(val, dict):
                continue
            name = f"{prefix}.{key}" if prefix else key
            if "wbits" in val:
                if name in out:
                    raise BadInputError("layer has two tables in this document (a quoted and a dotted header "
                                        "naming it); which one holds cannot be told", file=str(document),
                                        tensor=name if len(name) <= 200 else brief(name, 200))
                out[name] = val
            elif len(stack) >= MAX_TABLE_DEPTH:
                raise BadInputError(f"tables nested more than {MAX_TABLE_DEPTH} levels deep (under {brief(name)}); "
                                    "layer tables are a few levels deep", file=str(document))
            else:
                stack.append((name, iter(val.items())))
                break
        else:
            stack.pop()
    return out


@dataclass(frozen=True)
class LayerTable:
    """One layer's table with its settings checked (types first: ``bool("false")`` would be True): what the
    observer wrote, parsed once when the tables are opened, before any array or weight is read."""

    name: str
    document: Path
    bits: int
    groupsize: int
    sym: bool
    perchannel: bool | None
    scale_dtype: str | None
    entries: dict[str, Any]  # the raw keys: scale/zero/group_ids as a .npy name or an inline list, <key>_shape

    @property
    def group_size(self) -> int:
        """The canonical group size: -1 for one group per row (groupsize <= 0)."""
        return self.groupsize if self.groupsize > 0 else -1

    def groups(self, k: int) -> int:
        return 1 if self.groupsize <= 0 else -(-k // self.groupsize)

    def bad(self, msg: str) -> BadInputError:
        return BadInputError(msg, file=str(self.document), tensor=self.name)


def parse_table(name: str, table: dict[str, Any], document: Path) -> LayerTable:
    """A layer table as read from ``document``; BadInputError (or UnsupportedError for a bit width) naming the
    document and layer."""
    def bad(msg: str) -> BadInputError:
        return BadInputError(msg, file=str(document), tensor=name)

    bits, gsz = table.get("wbits"), table.get("groupsize", -1)
    if not is_json_int(bits) or not is_json_int(gsz):
        raise bad(f"wbits and groupsize must be integers, got {brief(bits)}, {brief(gsz)}")
    for flag in ("sym", "perchannel"):
        if flag in table and not isinstance(table[flag], bool):
            raise bad(f"{flag} must be true or false, got {brief(table[flag])}")
    if bits not in (2, 3, 4, 8):
        raise UnsupportedError(f"{bits}-bit tables are not supported (2, 3, 4 or 8)", file=str(document), tensor=name)
    want = table.get("scale_dtype")
    return LayerTable(name=name, document=document, bits=bits, groupsize=gsz, sym=table.get("sym", False),
                      perchannel=table.get("perchannel"),
                      scale_dtype=want if isinstance(want, str) and want in FLOAT_DTYPES else None,
                      entries=table)


#: a decoder layer's index in a transformers tensor name
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


class TomlTablesSource(Source):
    """Quant tables + base weights -> canonical layers (codes rebuilt per layer, streaming)."""

    def __init__(self, path: Path, base: Path | str | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise BadInputError("does not exist", file=str(self.path))
        self.folder, files, variant = table_documents(self.path)
        self.tables = _read_tables(files)
        self.base_path = _base_path(self.path, self.folder, base)
        self.base = open_tensors(self.base_path)
        for name in self.tables:
            if f"{name}.weight" not in self.base:
                self.base.close()
                raise BadInputError("quant table layer has no weight in the base model", file=str(self.base_path),
                                    tensor=f"{name}.weight")
        bfolder = self.base_path if self.base_path.is_dir() else None
        self.config: dict[str, Any] = {}
        if bfolder is not None and (bfolder / "config.json").is_file():
            doc = _read_json(bfolder / "config.json")
            if isinstance(doc, dict):
                self.config = {k: v for k, v in doc.items() if k != "quantization_config"}
        n_layers = self.config.get("num_hidden_layers")
        if not isinstance(n_layers, int):  # no config beside the base: count the decoder layers its weights have
            found = {int(m.group(1)) for t in self.base.names() if (m := _LAYER_INDEX.search(t))}
            n_layers = max(found) + 1 if found else None
        if variant == "decoder-N.toml" and isinstance(n_layers, int) and len(files) != n_layers:
            self.base.close()
            raise BadInputError(f"{len(files)} decoder-N.toml document(s) for a model of {n_layers} decoder layers "
                                f"(the base's num_hidden_layers): decoder-{len(files)}.toml and after are missing, "
                                "and their layers would silently stay unquantized", file=str(self.folder))
        self._side = [] if bfolder is None else side_files(bfolder, SIDE_FILES)
        owned = {f"{n}.{s}" for n in self.tables for s in ("weight", "bias")}
        self._passthrough = [t for t in self.base.names() if t not in owned]
        bits = sorted({t.bits for t in self.tables.values()})
        self.info: dict[str, Any] = {
            # (the base as a resolved path: never mistaken for a Hub id on a model card)
            "format": "toml", "version": variant, "base_model": str(Path(self.base_path).resolve()),
            "notes": [f"codes rebuilt from the base weights: q = clamp(round(w/s)+z, 0, 2^b-1), float64 quotient; "
                      f"wbits {bits}"],
            "quirks": [],
        }
        self._rounded_note = False
        if bfolder is None or self.base_path.resolve() != self.folder.resolve():
            self.info["notes"].append("with the original (pre-GPTQ) weights these are round-to-nearest codes on "
                                      "GPTQ's grid, not GPTQ's error-compensated codes")

    @property
    def table_file(self) -> dict[str, Path]:
        """The document each layer's table is in."""
        return {name: t.document for name, t in self.tables.items()}

    def layer_names(self) -> list[str]:
        return list(self.tables)

    def passthrough_names(self) -> list[str]:
        return list(self._passthrough)

    def read_tensor(self, name: str) -> TensorData:
        dt, _ = self.base.info(name)
        return TensorData(self.base.read_copy(name), dt)

    def side_files(self) -> list[Path]:
        return list(self._side)

    def close(self) -> None:
        self.base.close()

    # -- one layer ---------------------------------------------------------------------------
    def _array(self, t: LayerTable, key: str, ndims: tuple[int, ...]) -> tuple[np.ndarray, str] | None:
        """The table's ``key`` array and where it came from (`` in <file>.npy`` or ``""``): a .npy file inside the
        folder, or an inline list with ``<key>_shape``. Its dimension count must be one of ``ndims``: shapes are
        indexed before they are compared, and a 0-d array has no first dimension."""
        val = t.entries.get(key)
        if val is None:
            return None
        if isinstance(val, str):
            return self._npy_array(t, key, val, ndims)
        if isinstance(val, list):
            return self._inline_array(t, key, val, ndims), ""
        raise t.bad(f"{key} must be a .npy file name or an inline list, got {type(val).__name__}")

    def _npy_array(self, t: LayerTable, key: str, val: str, ndims: tuple[int, ...]) -> tuple[np.ndarray, str]:
        try:
            p = npy_beside(self.folder, val, key)
        except BadInputError as exc:
            raise t.bad(exc.message) from None
        arr = read_npy(p, t.name)
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "fiu":
            got = arr.dtype if isinstance(arr, np.ndarray) else type(arr)
            raise BadInputError(f"{key} must be a numeric array, got {got}",
                                file=str(p), tensor=t.name)
        if arr.ndim not in ndims:
            raise BadInputError(f"{key} must be a {_ranks(ndims)} array, got shape {list(arr.shape)}", file=str(p),
                                tensor=t.name)
        return arr, f" in {p.name}"

    def _inline_array(self, t: LayerTable, key: str, val: list[Any], ndims: tuple[int, ...]) -> np.ndarray:
        shape = t.entries.get(f"{key}_shape")
        if shape is not None and not (isinstance(shape, list) and all(is_json_int(d) and d >= 0 for d in shape)):
            raise t.bad(f"{key}_shape must be a list of non-negative integers, got {brief(shape)}")
        try:
            arr = np.asarray(val)
            if arr.dtype.kind not in "fiu" or arr.ndim != 1:
                raise ValueError("not a flat list of numbers")
            if shape is not None:
                arr = arr.reshape(shape)
            if key == "scale" and arr.dtype.kind == "f":
                arr = self._float32_scales(arr)
        except (ValueError, TypeError) as exc:
            raise t.bad(f"inline {key} list does not fit {key}_shape {brief(shape)}: {exc}") from None
        if arr.ndim not in ndims:
            raise t.bad(f"inline {key} must be {_ranks(ndims)}, got {key}_shape {list(arr.shape)}")
        return arr

    def _float32_scales(self, arr: np.ndarray) -> np.ndarray:
        """Decimal text of float32 scales: the nearest float32 is the value meant (noted once per source)."""
        a32 = arr.astype(np.float32)
        if not np.array_equal(a32.astype(np.float64), arr) and not self._rounded_note:
            self._rounded_note = True
            self.info["notes"].append("inline scales were not exact float32 decimals; rounded to the nearest float32")
        return a32

    def read_layer(self, name: str) -> CanonicalLayer:
        if name not in self.tables:
            raise BadInputError("not a layer of these quant tables", file=str(self.path), tensor=name)
        t = self.tables[name]
        wname = f"{name}.weight"
        wdt, wshape = self.base.info(wname)
        if wdt not in FLOAT_DTYPES or len(wshape) != 2:
            raise BadInputError(f"base weight must be a 2-D fp16/bf16/fp32 tensor, got {wdt} {list(wshape)}",
                                file=self.base.file_of(wname), tensor=wname)
        if 0 in wshape:  # the tables' arrays would be empty too, and their range checks have nothing to take
            raise BadInputError(f"base weight is empty (shape {list(wshape)}): a quantized layer has rows and "
                                "columns", file=self.base.file_of(wname), tensor=wname)
        n, k = wshape
        scale, sdt = self._scales(t, n, k)
        zero_mode, zeros = self._zeros(t, n, t.groups(k))
        g_idx = self._group_ids(t, k)
        weight = self.base.read_copy(wname)
        if not np.all(np.isfinite(to_float32(np.asarray(weight), wdt))):
            raise BadInputError("base weight holds NaN or infinity", file=self.base.file_of(wname), tensor=wname)
        zq = zeros if zeros is not None else np.full((n, t.groups(k)), 1 << (t.bits - 1), dtype=np.int32)
        codes = rtn_codes(weight, wdt, scale, sdt, zq, g_idx, t.bits)
        layer = CanonicalLayer(codes=codes, scales=scale, bits=t.bits, group_size=t.group_size,
                               zero_mode=zero_mode, zeros=zeros, g_idx=g_idx, scale_dtype=sdt, name=name,
                               source={"format": "toml", "version": self.info["version"]})
        self._bias(layer, f"{name}.bias")
        try:
            return layer.validate()
        except BadInputError as exc:
            raise t.bad(exc.message) from None

    def _per_row(self, t: LayerTable, arr: np.ndarray, n: int) -> np.ndarray:
        """[N, G] from a 1-D array (one group) or one row shared by every row (``perchannel = false``)."""
        if arr.ndim == 1:
            arr = arr.reshape(-1, 1)
        if arr.shape[0] == 1 and n > 1 and t.perchannel is False:
            arr = np.repeat(arr, n, axis=0)
        return arr

    def _scales(self, t: LayerTable, n: int, k: int) -> tuple[np.ndarray, str]:
        got = self._array(t, "scale", (1, 2))
        if got is None:
            raise t.bad("table has no scale")
        scale, s_in = got
        scale = self._per_row(t, scale, n)
        ng = t.groups(k)
        if scale.shape != (n, ng):
            raise t.bad(f"scale shape {list(scale.shape)}{s_in} != [{n}, {ng}] for base weight [{n}, {k}], "
                        f"groupsize {t.groupsize}")
        scale, sdt = self._scale_array(scale, t.scale_dtype, t.bad)
        s32 = to_float32(scale, sdt)
        bad = ~(np.isfinite(s32) & (s32 > 0))  # GPTQ's quantizer makes every scale positive and finite
        if np.any(bad):
            row, grp = (int(i) for i in np.argwhere(bad)[0])
            where = t.entries.get("scale")
            file = str(npy_beside(self.folder, where, "scale")) if isinstance(where, str) else str(t.document)
            raise BadInputError(f"scale [{row}, {grp}] is {float(s32[row, grp])} ({int(bad.sum())} of {bad.size} "
                                "not positive and finite): GPTQ scales are always > 0", file=file, tensor=t.name)
        return scale, sdt

    def _zeros(self, t: LayerTable, n: int, ng: int) -> tuple[str, np.ndarray | None]:
        """(zero mode, integer zeros [N, G] or None): symmetric tables may omit them (2^(b-1) implied)."""
        got = self._array(t, "zero", (1, 2))
        if got is None:
            if not t.sym:
                raise t.bad("asymmetric table (sym = false) has no zero")
            return "none", None
        zero, z_in = got
        zero = self._per_row(t, zero, n)
        if zero.shape != (n, ng):
            raise t.bad(f"zero shape {list(zero.shape)}{z_in} != scale shape [{n}, {ng}]")
        zf = zero.astype(np.float64)
        if not np.all(np.isfinite(zf)) or np.any(zf != np.rint(zf)):
            raise t.bad("zero holds values that are not integers")
        if zf.min() < 0 or zf.max() > (1 << t.bits):
            raise t.bad(f"zero values {int(zf.min())}..{int(zf.max())} outside 0..{1 << t.bits}")
        zeros = zf.astype(np.int32)
        if t.sym and np.all(zeros == (1 << (t.bits - 1))):
            return "none", None
        return "int", zeros

    def _group_ids(self, t: LayerTable, k: int) -> np.ndarray:
        got = self._array(t, "group_ids", (1,))
        if got is None:
            return default_g_idx(k, t.group_size)
        gids, g_in = got
        ng = t.groups(k)
        if gids.dtype.kind not in "iu" and not (np.all(np.isfinite(gids)) and np.all(gids == np.rint(gids))):
            raise t.bad("group_ids are not integers")
        if gids.shape != (k,):
            raise t.bad(f"group_ids shape {list(gids.shape)}{g_in} != [{k}] (in_features of the base weight)")
        if k and (int(gids.min()) < 0 or int(gids.max()) >= ng):
            raise t.bad(f"group_ids must lie in 0..{ng - 1}, got {int(gids.min())}..{int(gids.max())}")
        return gids.astype(np.int32)

    def _bias(self, layer: CanonicalLayer, bname: str) -> None:
        if bname not in self.base:
            return
        bdt, _bshape = self.base.info(bname)
        if bdt not in FLOAT_DTYPES:
            raise BadInputError(f"bias must be a float tensor, got {bdt}", file=self.base.file_of(bname), tensor=bname)
        layer.bias, layer.bias_dtype = np.array(self.base.read_copy(bname)), bdt

    @staticmethod
    def _scale_array(scale: np.ndarray, want: str | None, bad: Any) -> tuple[np.ndarray, str]:
        """Scales in their stored dtype; float32 narrowed back to ``want`` (the table's ``scale_dtype``) when it is
        exact."""
        if scale.dtype == np.float16:
            arr, sdt = scale, "float16"
        elif scale.dtype == np.float32:
            arr, sdt = scale, "float32"
        elif scale.dtype.kind == "f":
            arr = scale.astype(np.float32)
            if not np.array_equal(arr.astype(scale.dtype), scale, equal_nan=True):
                raise bad(f"{scale.dtype} scales do not fit float32 exactly")
            sdt = "float32"
        else:
            raise bad(f"scale must be a float array, got {scale.dtype}")
        if want is not None and want != sdt:
            narrowed = from_float32(to_float32(arr, sdt), want)
            if not np.array_equal(to_float32(narrowed, want), to_float32(arr, sdt)):
                raise bad(f"scale_dtype = {want!r} but the scales are not exactly {want} values")
            arr, sdt = narrowed, want
        return np.ascontiguousarray(arr), sdt


def _ranks(ndims: tuple[int, ...]) -> str:
    return " or ".join(f"{d}-D" for d in ndims)


def _read_tables(files: list[Path]) -> dict[str, LayerTable]:
    """Every layer table of the documents, parsed; a layer in two documents is refused."""
    tables: dict[str, LayerTable] = {}
    for f in files:
        for name, raw in _flatten_tables(read_toml(f), f).items():
            if name in tables:
                raise BadInputError(f"layer appears twice (also in {tables[name].document.name})", file=str(f),
                                    tensor=name)
            tables[name] = parse_table(name, raw, f)
    if not tables:
        raise BadInputError("the quant tables name no layers (no table with wbits)", file=str(files[0]))
    return tables


def _base_path(path: Path, folder: Path, base: Path | str | None) -> Path:
    """The base model the codes are rebuilt from: ``base``, else the weights beside the tables."""
    if base is None:
        if any(folder.glob("*.safetensors")):
            base = folder
        else:
            raise BadInputError("TOML quant tables hold no weights: name the fp16/bf16/fp32 base model their codes "
                                "are rebuilt from with --base PATH (base=PATH in Python)", file=str(path))
    base_path = Path(base)
    if not base_path.exists():
        raise BadInputError("base model does not exist", file=str(base_path))
    if base_path.is_dir() and not ((base_path / INDEX_NAME).is_file() or any(base_path.glob("*.safetensors"))):
        raise BadInputError("base model folder holds no .safetensors weights", file=str(base_path))
    return base_path


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def _table_weight(layer: CanonicalLayer) -> tuple[np.ndarray, str]:
    """Weights the reader turns back into exactly ``layer.codes``: fp16 when that is exact, else fp32."""
    w64 = layer.dequantize(np.float64)
    zq = layer.zero_points()
    for dt, npdt in (("float16", np.float16), ("float32", np.float32)):
        with np.errstate(over="ignore"):
            w = w64.astype(npdt)
        if not np.all(np.isfinite(w)):
            continue
        if np.array_equal(rtn_codes(w, dt, layer.scales, layer.scale_dtype, zq, layer.g_idx, layer.bits),
                          layer.codes):
            return w, dt
    raise UnsupportedError("no fp16/fp32 weight reproduces these codes under the table formula "
                           "(scales too small or too large)", tensor=layer.name)


class TomlCapabilities(Capabilities):
    def limit(self, layer: CanonicalLayer) -> str | None:
        reason = super().limit(layer)
        if reason and layer.zero_mode == "float":
            reason += " (the tables store integer zeros)"
        return reason

    def check(self, layer: CanonicalLayer) -> str | None:
        reason = super().check(layer)
        if reason is None and not np.all(to_float32(layer.scales, layer.scale_dtype) > 0):
            # the reader refuses them: GPTQ's quantizer makes every scale positive (a GGUF block's may not be)
            reason = "scales that are not all positive (the tables hold GPTQ scales, always > 0; way out: --to w4pack)"
        return reason


class TomlTablesFormat(Format):
    name = "toml"
    write_options = frozenset({"variant", "weights"})
    description = "GPTQ-for-LLaMa observer quant tables (quant.toml + .npy, or decoder-N.toml) + base weights"
    capabilities = TomlCapabilities(bits=(2, 3, 4, 8), zero_modes=("none", "int"), act_order=True)
    takes_base = True
    hub_files = (HubFiles("*.toml", ("*.toml", "*.npy")),)

    @classmethod
    def detect(cls, path: Path) -> bool:
        return has_table_documents(Path(path))

    @classmethod
    def open(cls, path: Path, **options: Any) -> Source:
        return TomlTablesSource(Path(path), base=options.get("base"))

    @classmethod
    def write(cls, source: Source, out: Path, *, force: bool = False, variant: str = "quant.toml",
              weights: bool = True, max_shard_size: int | str = "5GB", show_progress: bool | None = None,
              **options: Any) -> Path:
        """Write quant tables for ``source``; with ``weights`` also the weights + pass-through tensors they need.

        ``variant``: "quant.toml" (tables in .npy files) or "decoder" (decoder-N.toml with inline lists, grouped by
        the layer index in ``layers.N.``). Every layer is checked before anything is written.
        """
        if variant not in ("quant.toml", "decoder"):
            raise UnsupportedError(f"unknown TOML variant {variant!r} (quant.toml or decoder)")
        check_output(Path(out), force)  # (an existing output first, as every writer: --dry-run predicts this order)
        problems = cls.check_writable(source) + _variant_problems(source.layer_names(), variant)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise UnsupportedError(f"cannot write TOML tables: {problems[0]}{more}", file=str(source.path))
        with AtomicFolder(out, force=force) as tmp, \
                (ShardWriter(tmp, parse_size(max_shard_size)) if weights else contextlib.nullcontext()) as shards:
            _write_tables(source, tmp, variant, shards, show_progress)
            if shards is not None:
                shards.finish()
                config = {k: v for k, v in (source.config or {}).items() if k != "quantization_config"}
                if config:
                    write_json(tmp / "config.json", config)
                copy_side_files(source.side_files(), tmp)
        return Path(out)


def _variant_problems(names: list[str], variant: str) -> list[str]:
    """The decoder-N.toml variant groups layers by their block index: a name without one has no document."""
    if variant != "decoder":
        return []
    return [f"{name}: the decoder-N.toml variant needs a layer index in the name (way out: variant quant.toml)"
            for name in names if not _INDEX_RE.search(name)]


def _write_tables(source: Source, tmp: Path, variant: str, shards: ShardWriter | None,
                  show_progress: bool | None) -> None:
    """Each layer's table (appended to its document as it is made: the decoder variant's inline lists are tens of
    MB of text per layer, so holding the documents grew memory with the model), and with ``shards`` the weights
    that rebuild its codes, then the pass-through tensors."""
    from ..progress import Progress

    names, passthrough = source.layer_names(), source.passthrough_names()
    started: set[str] = set()  # the TOML documents begun
    with Progress(len(names) + len(passthrough), "writing tables", enabled=show_progress) as bar:
        for name in names:
            layer = source.read_layer(name).replace(name=name)
            doc_name = QUANT_TOML
            if variant == "decoder":
                doc_name = f"decoder-{int(_INDEX_RE.search(name).group(1))}.toml"  # type: ignore[union-attr]
            text = dump_toml({name: _layer_table(layer, tmp, inline=variant == "decoder")})
            append_text(tmp / doc_name, ("\n" if doc_name in started else "") + text)
            started.add(doc_name)
            if shards is not None:
                w, wdt = _table_weight(layer)
                shards.add(f"{name}.weight", w, wdt)
                if layer.bias is not None:
                    shards.add(f"{name}.bias", layer.bias, layer.bias_dtype)
            bar.update()
        if shards is not None:
            for tname in passthrough:
                t = source.read_tensor(tname)
                shards.add(tname, t.array, t.dtype)
                bar.update()


def _npy_name(name: str, key: str) -> str:
    safe = name.replace("/", "_").replace("\\", "_")
    return f"{safe}.{key}.npy"


def _layer_table(layer: CanonicalLayer, folder: Path, inline: bool) -> dict[str, Any]:
    """The observer's keys for one layer (plus ``scale_dtype`` so a round trip restores fp16/bf16 scales)."""
    scale = to_float32(layer.scales, layer.scale_dtype)
    zero = None if layer.zero_mode == "none" else layer.zeros.astype(np.float32)
    gids = layer.g_idx.astype(np.int32) if layer.group_size > 0 else None
    table: dict[str, Any] = {}
    arrays = (("zero", zero), ("scale", scale), ("group_ids", gids))
    for key, arr in arrays:
        if arr is None:
            continue
        if inline:
            vals = arr.ravel().tolist() if key != "zero" else [int(v) for v in arr.ravel()]
            table[key] = vals
            table[f"{key}_shape"] = list(arr.shape)
        else:
            fname = _npy_name(layer.name, key)
            write_npy(folder / fname, arr)
            table[key] = fname
        if key == "scale":
            table["wbits"] = layer.bits
            table["groupsize"] = layer.group_size if layer.group_size > 0 else -1
    table["sym"] = layer.zero_mode == "none"
    table["perchannel"] = True
    if layer.scale_dtype != "float32":
        table["scale_dtype"] = layer.scale_dtype
    return table
