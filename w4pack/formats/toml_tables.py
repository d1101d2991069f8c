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
from pathlib import Path
from typing import Any

import numpy as np

from ..store.atomic import AtomicFolder, check_output
from ..core.canonical import CanonicalLayer, default_g_idx
from ..store.checkpoint import parse_size
from ..core.dtypes import FLOAT_DTYPES, to_float32
from ..errors import BadInputError, UnsupportedError
from ..store.folder import brief, copy_side_files, is_json_int, read_json as _read_json, side_files, write_json
from ..store import open_tensors
from ..store.names import INDEX_NAME, SIDE_FILES
from ..store.shards import ShardWriter
from ..store.tables import read_npy, read_toml
from .base import Capabilities, Format, HubFiles, Source, TensorData

__all__ = ["TomlTablesFormat", "TomlTablesSource", "rtn_codes", "dump_toml"]

QUANT_TOML = "quant.toml"
_DECODER_RE = re.compile(r"^decoder[-.](\d+)\.toml$")
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
def _flatten_tables(doc: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Layer tables by full name; unquoted keys (``[model.layers.0.q]``) nest, so walk down to ``wbits``."""
    out: dict[str, dict[str, Any]] = {}
    for key, val in doc.items():
        if not isinstance(val, dict):
            continue
        name = f"{prefix}.{key}" if prefix else key
        if "wbits" in val:
            out[name] = val
        else:
            out.update(_flatten_tables(val, name))
    return out


def _table_files(path: Path) -> tuple[Path, list[Path], str]:
    """(folder, TOML files in order, variant) of a table export."""
    if path.is_file():
        folder = path.parent
        files = [path]
    else:
        folder = path
        if (path / QUANT_TOML).is_file():
            files = [path / QUANT_TOML]
        else:
            found = [(int(m.group(1)), p) for p in path.iterdir() if (m := _DECODER_RE.match(p.name)) and p.is_file()]
            files = [p for _i, p in sorted(found)]
    if not files:
        raise BadInputError(f"no {QUANT_TOML} or decoder-N.toml quant tables here", file=str(path))
    variant = QUANT_TOML if files[0].name == QUANT_TOML else "decoder-N.toml"
    return folder, files, variant


class TomlTablesSource(Source):
    """Quant tables + base weights -> canonical layers (codes rebuilt per layer, streaming)."""

    def __init__(self, path: Path, base: Path | str | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise BadInputError("does not exist", file=str(self.path))
        self.folder, files, variant = _table_files(self.path)
        self.tables: dict[str, dict[str, Any]] = {}
        self.table_file: dict[str, Path] = {}
        for f in files:
            doc = read_toml(f)
            for name, table in _flatten_tables(doc).items():
                if name in self.tables:
                    raise BadInputError(f"layer appears twice (also in {self.table_file[name].name})", file=str(f),
                                        tensor=name)
                self.tables[name] = table
                self.table_file[name] = f
        if not self.tables:
            raise BadInputError("the quant tables name no layers (no table with wbits)", file=str(files[0]))
        if base is None:
            if any(self.folder.glob("*.safetensors")):
                base = self.folder
            else:
                raise BadInputError("TOML quant tables hold no weights; name the fp16/bf16/fp32 base model with "
                                    "--base (base=...)", file=str(self.path))
        self.base_path = Path(base)
        if not self.base_path.exists():
            raise BadInputError("base model does not exist", file=str(self.base_path))
        if self.base_path.is_dir() and not ((self.base_path / INDEX_NAME).is_file()
                                            or any(self.base_path.glob("*.safetensors"))):
            raise BadInputError("base model folder holds no .safetensors weights", file=str(self.base_path))
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
        self._side = [] if bfolder is None else side_files(bfolder, SIDE_FILES)
        owned = {f"{n}.{s}" for n in self.tables for s in ("weight", "bias")}
        self._passthrough = [t for t in self.base.names() if t not in owned]
        bits = sorted({int(t.get("wbits", 0)) for t in self.tables.values() if isinstance(t.get("wbits"), int)})
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
    def _array(self, name: str, table: dict[str, Any], key: str,
               ndims: tuple[int, ...]) -> tuple[np.ndarray, str] | None:
        """The table's ``key`` array and where it came from (`` in <file>.npy`` or ``""``): a .npy file inside the
        folder, or an inline list with ``<key>_shape``. Its dimension count must be one of ``ndims``: shapes are
        indexed before they are compared, and a 0-d array has no first dimension."""
        tfile = str(self.table_file[name])
        val = table.get(key)
        if val is None:
            return None
        want = " or ".join(f"{d}-D" for d in ndims)
        if isinstance(val, str):
            rel = Path(val)
            p = (self.folder / rel)
            if rel.is_absolute() or ".." in rel.parts or not p.resolve().is_relative_to(self.folder.resolve()):
                raise BadInputError(f"{key} path {val!r} escapes the table folder", file=tfile, tensor=name)
            if not p.is_file():
                raise BadInputError(f"{key} file {val!r} is missing", file=tfile, tensor=name)
            arr = read_npy(p, name)
            if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "fiu":
                raise BadInputError(f"{key} must be a numeric array, got {getattr(arr, 'dtype', type(arr))}",
                                    file=str(p), tensor=name)
            if arr.ndim not in ndims:
                raise BadInputError(f"{key} must be a {want} array, got shape {list(arr.shape)}", file=str(p),
                                    tensor=name)
            return arr, f" in {p.name}"
        if isinstance(val, list):
            shape = table.get(f"{key}_shape")
            if shape is not None and not (isinstance(shape, list) and all(is_json_int(d) and d >= 0 for d in shape)):
                raise BadInputError(f"{key}_shape must be a list of non-negative integers, got {brief(shape)}",
                                    file=tfile, tensor=name)
            try:
                arr = np.asarray(val)
                if arr.dtype.kind not in "fiu" or arr.ndim != 1:
                    raise ValueError("not a flat list of numbers")
                if shape is not None:
                    arr = arr.reshape(shape)
                if key == "scale" and arr.dtype.kind == "f":
                    # decimal text of float32 scales: the nearest float32 is the value meant
                    a32 = arr.astype(np.float32)
                    if not np.array_equal(a32.astype(np.float64), arr) and not self._rounded_note:
                        self._rounded_note = True
                        self.info["notes"].append("inline scales were not exact float32 decimals; rounded to the "
                                                  "nearest float32")
                    arr = a32
            except (ValueError, TypeError) as exc:
                raise BadInputError(f"inline {key} list does not fit {key}_shape {brief(shape)}: {exc}", file=tfile,
                                    tensor=name) from None
            if arr.ndim not in ndims:
                raise BadInputError(f"inline {key} must be {want}, got {key}_shape {list(arr.shape)}", file=tfile,
                                    tensor=name)
            return arr, ""
        raise BadInputError(f"{key} must be a .npy file name or an inline list, got {type(val).__name__}", file=tfile,
                            tensor=name)

    def read_layer(self, name: str) -> CanonicalLayer:
        if name not in self.tables:
            raise BadInputError("not a layer of these quant tables", file=str(self.path), tensor=name)
        t = self.tables[name]
        tfile = str(self.table_file[name])

        def bad(msg: str) -> BadInputError:
            return BadInputError(msg, file=tfile, tensor=name)

        bits, gsz = t.get("wbits"), t.get("groupsize", -1)
        if not is_json_int(bits) or not is_json_int(gsz):
            raise bad(f"wbits and groupsize must be integers, got {brief(bits)}, {brief(gsz)}")
        for flag in ("sym", "perchannel"):  # bool("false") would be True
            if flag in t and not isinstance(t[flag], bool):
                raise bad(f"{flag} must be true or false, got {brief(t[flag])}")
        if bits not in (2, 3, 4, 8):
            raise UnsupportedError(f"{bits}-bit tables are not supported (2, 3, 4 or 8)", file=tfile, tensor=name)
        wname = f"{name}.weight"
        wdt, wshape = self.base.info(wname)
        if wdt not in FLOAT_DTYPES or len(wshape) != 2:
            raise BadInputError(f"base weight must be a 2-D fp16/bf16/fp32 tensor, got {wdt} {list(wshape)}",
                                file=self.base.file_of(wname), tensor=wname)
        n, k = wshape
        ng = 1 if gsz <= 0 else -(-k // gsz)
        got = self._array(name, t, "scale", (1, 2))
        if got is None:
            raise bad("table has no scale")
        scale, s_in = got
        if scale.ndim == 1:
            scale = scale.reshape(-1, 1)
        if scale.shape[0] == 1 and n > 1 and t.get("perchannel") is False:
            scale = np.repeat(scale, n, axis=0)
        if scale.shape != (n, ng):
            raise bad(f"scale shape {list(scale.shape)}{s_in} != [{n}, {ng}] for base weight [{n}, {k}], "
                      f"groupsize {gsz}")
        scale, sdt = self._scale_array(scale, t, bad)
        s32 = to_float32(scale, sdt)
        if not np.all(np.isfinite(s32)) or np.any(s32 == 0):
            raise bad("scale holds zero, NaN or infinity")
        got = self._array(name, t, "zero", (1, 2))
        zero, z_in = got if got is not None else (None, "")
        sym = t.get("sym", False)
        if zero is None:
            if not sym:
                raise bad("asymmetric table (sym = false) has no zero")
            zero_mode, zeros = "none", None
        else:
            if zero.ndim == 1:
                zero = zero.reshape(-1, 1)
            if zero.shape[0] == 1 and n > 1 and t.get("perchannel") is False:
                zero = np.repeat(zero, n, axis=0)
            if zero.shape != (n, ng):
                raise bad(f"zero shape {list(zero.shape)}{z_in} != scale shape [{n}, {ng}]")
            zf = zero.astype(np.float64)
            if not np.all(np.isfinite(zf)) or np.any(zf != np.rint(zf)):
                raise bad("zero holds values that are not integers")
            if zf.min() < 0 or zf.max() > (1 << bits):
                raise bad(f"zero values {int(zf.min())}..{int(zf.max())} outside 0..{1 << bits}")
            zeros = zf.astype(np.int32)
            zero_mode = "int"
            if sym and np.all(zeros == (1 << (bits - 1))):
                zero_mode, zeros = "none", None
        got = self._array(name, t, "group_ids", (1,))
        if got is None:
            g_idx = default_g_idx(k, gsz if gsz > 0 else -1)
        else:
            gids, g_in = got
            if gids.dtype.kind not in "iu" and not (np.all(np.isfinite(gids)) and np.all(gids == np.rint(gids))):
                raise bad("group_ids are not integers")
            if gids.shape != (k,):
                raise bad(f"group_ids shape {list(gids.shape)}{g_in} != [{k}] (in_features of the base weight)")
            if k and (int(gids.min()) < 0 or int(gids.max()) >= ng):
                raise bad(f"group_ids must lie in 0..{ng - 1}, got {int(gids.min())}..{int(gids.max())}")
            g_idx = gids.astype(np.int32)
        weight = self.base.read_copy(wname)
        if not np.all(np.isfinite(to_float32(np.asarray(weight), wdt))):
            raise BadInputError("base weight holds NaN or infinity", file=self.base.file_of(wname), tensor=wname)
        zq = zeros if zeros is not None else np.full((n, ng), 1 << (bits - 1), dtype=np.int32)
        codes = rtn_codes(weight, wdt, scale, sdt, zq, g_idx, bits)
        layer = CanonicalLayer(codes=codes, scales=scale, bits=bits, group_size=gsz if gsz > 0 else -1,
                               zero_mode=zero_mode, zeros=zeros, g_idx=g_idx, scale_dtype=sdt, name=name,
                               source={"format": "toml", "version": self.info["version"]})
        bname = f"{name}.bias"
        if bname in self.base:
            bdt, bshape = self.base.info(bname)
            if bdt not in FLOAT_DTYPES:
                raise BadInputError(f"bias must be a float tensor, got {bdt}", file=self.base.file_of(bname),
                                    tensor=bname)
            layer.bias, layer.bias_dtype = np.array(self.base.read_copy(bname)), bdt
        try:
            return layer.validate()
        except BadInputError as exc:
            raise BadInputError(exc.message, file=tfile, tensor=name) from None

    @staticmethod
    def _scale_array(scale: np.ndarray, table: dict[str, Any], bad: Any) -> tuple[np.ndarray, str]:
        """Scales in their stored dtype; float32 narrowed back to ``scale_dtype`` when the table records it (exact)."""
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
        want = table.get("scale_dtype")
        if isinstance(want, str) and want != sdt and want in FLOAT_DTYPES:
            from ..core.dtypes import from_float32

            narrowed = from_float32(to_float32(arr, sdt), want)
            if not np.array_equal(to_float32(narrowed, want), to_float32(arr, sdt)):
                raise bad(f"scale_dtype = {want!r} but the scales are not exactly {want} values")
            arr, sdt = narrowed, want
        return np.ascontiguousarray(arr), sdt


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
    def check(self, layer: CanonicalLayer) -> str | None:
        reason = super().check(layer)
        if reason and layer.zero_mode == "float":
            reason += " (the tables store integer zeros; way out: --to w4pack)"
        return reason


class TomlTablesFormat(Format):
    name = "toml"
    description = "GPTQ-for-LLaMa observer quant tables (quant.toml + .npy, or decoder-N.toml) + base weights"
    capabilities = TomlCapabilities(bits=(2, 3, 4, 8), zero_modes=("none", "int"), act_order=True)
    takes_base = True
    hub_files = (HubFiles("*.toml", ("*.toml", "*.npy")),)

    @classmethod
    def detect(cls, path: Path) -> bool:
        path = Path(path)
        if path.is_file():
            return path.name == QUANT_TOML or bool(_DECODER_RE.match(path.name))
        if not path.is_dir():
            return False
        return (path / QUANT_TOML).is_file() or any(_DECODER_RE.match(p.name) for p in path.iterdir())

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
        from ..progress import Progress

        if variant not in ("quant.toml", "decoder"):
            raise UnsupportedError(f"unknown TOML variant {variant!r} (quant.toml or decoder)")
        check_output(Path(out), force)  # (an existing output first, as every writer: --dry-run predicts this order)
        problems = cls.check_writable(source)
        names = source.layer_names()
        if variant == "decoder":
            for name in names:
                if not _INDEX_RE.search(name):
                    problems.append(f"{name}: the decoder-N.toml variant needs a layer index in the name "
                                    "(way out: variant quant.toml)")
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise UnsupportedError(f"cannot write TOML tables: {problems[0]}{more}", file=str(source.path))
        passthrough = source.passthrough_names()
        started: set[str] = set()  # the TOML documents begun (each layer's table is appended as it is made)
        max_bytes = parse_size(max_shard_size)
        with AtomicFolder(out, force=force) as tmp, \
                (ShardWriter(tmp, max_bytes) if weights else contextlib.nullcontext()) as shards:
            with Progress(len(names) + len(passthrough), "writing tables", enabled=show_progress) as bar:
                for name in names:
                    layer = source.read_layer(name).replace(name=name)
                    doc_name = QUANT_TOML
                    if variant == "decoder":
                        doc_name = f"decoder-{int(_INDEX_RE.search(name).group(1))}.toml"
                    # appended at once: the decoder variant's inline lists are tens of MB per layer as text,
                    # so keeping the documents until the end grew memory with the model
                    text = dump_toml({name: _layer_table(layer, tmp, inline=variant == "decoder")})
                    with open(tmp / doc_name, "a", encoding="utf-8") as fh:
                        fh.write(("\n" if doc_name in started else "") + text)
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
            if shards is not None:
                shards.finish()
                config = {k: v for k, v in (source.config or {}).items() if k != "quantization_config"}
                if config:
                    write_json(tmp / "config.json", config)
                copy_side_files(source.side_files(), tmp)
        return Path(out)


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
            np.save(folder / fname, np.ascontiguousarray(arr), allow_pickle=False)
            table[key] = fname
        if key == "scale":
            table["wbits"] = layer.bits
            table["groupsize"] = layer.group_size if layer.group_size > 0 else -1
    table["sym"] = layer.zero_mode == "none"
    table["perchannel"] = True
    if layer.scale_dtype != "float32":
        table["scale_dtype"] = layer.scale_dtype
    return table
