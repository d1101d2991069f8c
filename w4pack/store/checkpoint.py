"""Packed checkpoint I/O: an atomic, streaming writer and a checking, memory-mapped reader.

A checkpoint is a Hugging Face model folder (see docs/FORMAT.md):

    config.json                          with quantization_config {quant_method: "w4pack", ...}
    model-0000k-of-0000n.safetensors     shards: packed layers + pass-through tensors
    model.safetensors.index.json         tensor -> shard
    w4pack.json                          the manifest (schemas/manifest.schema.json), written last
    tokenizer files, generation_config.json, ...   copied side files

The writer holds no shard in memory: the shards are written by the one streaming shard writer
(store.shards.ShardStream: tensors straight into the shard file behind a reserved header area padded with
spaces; each finished shard fsynced and checksummed in the background while the next one is written). The
index and the manifest, which checksums every other file, come last and a temporary sibling folder is
renamed into place, so an interrupted run leaves nothing that looks complete.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .._version import __version__
from .atomic import check_output, is_disk_full, make_temp_dir, move_into_place, write_failure
from ..core.canonical import CanonicalLayer
from ..core.dtypes import FLOAT_DTYPES, dtype_name_of
from ..errors import BadInputError, IOFailure
from .folder import brief, is_json_int, member as _safe_member, read_json as _read_json, read_side_json, side_file
from ..core.layout import LAYOUT_NAME, LAYOUT_VERSION, TILE_K, TILE_N, PackedLayer, pack, tensor_suffixes, unpack
from ..progress import Progress
from .shards import ShardStream
from .names import CARD_NAME, CONFIG_NAME, INCOMPLETE_MARKER, INDEX_NAME, MANIFEST_NAME, SIDE_FILES, shard_names
from ..core.arch import MAX_DECODER_LAYERS, architecture_problem, needed_linears
from ..core import compact as _compact
from .tensors import TensorStore
from ..schema import load_schema, validate_manifest, validate_quantization_config

__all__ = [
    "MANIFEST_NAME",
    "INDEX_NAME",
    "FORMAT_VERSION",
    "INCOMPLETE_MARKER",
    "CheckpointWriter",
    "Checkpoint",
    "open_checkpoint",
    "validate_checkpoint",
    "parse_size",
    "check_layer_name",
    "config_problem",
    "source_note",
]

DEFAULT_MAX_SHARD = 2 * 1024**3
#: the manifest format written (docs/FORMAT.md §5); readers take 1 (shards checksummed) and 2 (every file)
FORMAT_VERSION = 2
#: header area reserved at the start of a shard before its first tensor (grown from shard to shard)
_HEADER_RESERVE = 4096
#: bytes a header entry takes at most beyond its tensor name (dtype, a 2-D shape, two offsets, JSON)
HEADER_ENTRY_BYTES = 120
_RESERVED = {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, INCOMPLETE_MARKER, CARD_NAME}  # CARD_NAME: push rewrites it


#: the largest size parse_size accepts: safetensors offsets are unsigned 64-bit
_MAX_SIZE = 2**63 - 1
_UNITS = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "B": 1}


def parse_size(text: str | int, what: str = "size") -> int:
    """'2GB', '500MB', '1.5GiB', '10MiB' or an integer number of bytes. Anything else (inf, nan, a negative size,
    more than 63 bits) is a usage error naming the text, never an OverflowError out of int(float(...))."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise BadInputError(f"cannot read {what} {text!r} (use e.g. 2GB, 500MB, 64MiB)")
    value: int | float = text if isinstance(text, int) else -1
    if isinstance(text, str):
        s = text.strip().upper().replace(" ", "")
        suffix = next((u for u in _UNITS if s.endswith(u)), "")
        number, mult = s[: len(s) - len(suffix)], _UNITS.get(suffix, 1)
        try:
            value = int(number) * mult if number.isdigit() else float(number) * mult
        except ValueError:
            raise BadInputError(f"cannot read {what} {text!r} (use e.g. 2GB, 500MB, 64MiB)") from None
    if (isinstance(value, float) and not math.isfinite(value)) or not 0 <= value <= _MAX_SIZE:
        raise BadInputError(f"{what} {text!r} is not a byte count from 0 to 2**63-1 (use e.g. 2GB, 500MB, 64MiB)")
    return int(value)


def check_layer_name(name: str, file: str | None = None) -> None:
    """Refuse a layer name the manifest schema would reject, when the layer is added: otherwise the whole model is
    written first and the conversion fails at the very end, naming a manifest that was never written."""
    rule = load_schema("manifest")["$defs"]["module_name"]  # cached; the schema stays the one definition
    if not isinstance(name, str) or len(name) > rule["maxLength"] or not re.fullmatch(rule["pattern"], name):
        raise BadInputError("layer name cannot be stored in a w4pack manifest: it must be ASCII letters, digits, "
                            "'_', '.' and '-', not start with '.' or '-', and be at most "
                            f"{rule['maxLength']} characters", file=file,
                            tensor=repr(name) if isinstance(name, str) and not name.isprintable() else str(name))


def config_problem(config: dict[str, Any]) -> str | None:
    """What is wrong with the keys of config.json that loaders act on before any weight, or None:
    ``architectures`` (vLLM and w4pack's summary take the first class name of the list), ``model_type``
    (transformers' AutoConfig key) and ``num_hidden_layers`` (a loader builds that many decoder layers).
    ``"architectures": true`` used to end inspect and validate in "unexpected TypeError" and would stop vLLM
    before the first layer; ``"num_hidden_layers": 1000000000`` made the architecture check take gigabytes. The
    model's sizes (_SIZE_KEYS), where present, are positive integers, and the key/value heads divide the heads."""
    arch = config.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) and a for a in arch)):
        return f"architectures must be a list of model class names, got {brief(arch)}"
    mtype = config.get("model_type")
    if mtype is not None and not isinstance(mtype, str):
        return f"model_type must be a string, got {brief(mtype)}"
    for key in _SIZE_KEYS:
        v = config.get(key)
        if v is not None and not (is_json_int(v) and v > 0):
            return f"{key} must be a positive integer, got {brief(v)}"
    layers = config.get("num_hidden_layers")
    if layers is not None and layers > MAX_DECODER_LAYERS:
        return (f"num_hidden_layers {layers} is more than any model has (at most {MAX_DECODER_LAYERS}); a loader "
                "would build that many decoder layers")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        return (f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv} (each key/value head "
                "serves a whole number of query heads)")
    return None


#: the sizes of config.json a loader builds the model from: each a positive integer where present (a 0 divides by
#: zero in the loader, a "2" or 2.5 is refused by transformers' own config classes)
_SIZE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def quantization_config_for(layers: dict[str, dict[str, Any]], source: dict[str, Any],
                            fused: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``quantization_config``, derived from the manifest (its most common bits, group size and zero
    mode, act-order anywhere, the source format and the fused table): written by the writer, checked by
    ``Checkpoint.check_quantization_config``."""
    qc: dict[str, Any] = {"quant_method": "w4pack", "layout": LAYOUT_NAME, "layout_version": LAYOUT_VERSION,
                          "format_version": FORMAT_VERSION, "manifest": MANIFEST_NAME}
    metas = list(layers.values())
    if metas:
        for key in ("bits", "group_size", "zero_mode"):
            qc[key] = Counter(m[key] for m in metas).most_common(1)[0][0]
        qc["act_order"] = any(m["act_order"] for m in metas)
    else:
        qc.update(bits=4, group_size=128, zero_mode="none", act_order=False)
    if source.get("format"):
        qc["source_format"] = str(source["format"])
    if fused:
        qc["fused"] = fused
    return qc


class CheckpointWriter:
    """Stream layers and tensors into a new checkpoint folder; ``close()`` makes it appear atomically.

    Example::

        with CheckpointWriter("out/", config=hf_config, source={"format": "gptq"}) as w:
            w.add_layer("model.layers.0.mlp.down_proj", canonical_layer)
            w.add_tensor("model.embed_tokens.weight", emb, "float16")
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, force: bool = False,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD, config: dict[str, Any] | None = None,
                 source: dict[str, Any] | None = None, show_progress: bool | None = None,
                 header_hint: int | None = None, label: str | None = None, check_architecture: bool = False,
                 card: Callable[[Path, str], str] | None = None):
        """``header_hint``: bytes of header to reserve in each shard (e.g. from ``header_bytes_hint``), so
        that shards need no rewrite; without it the reservation starts small and grows. ``check_architecture``:
        before anything is moved into place, refuse what validate's architecture check would (convert asks, so it
        never writes what validate refuses; a caller assembling a partial folder on purpose does not);
        ``label``: what that error names (the source being converted; default the output's config.json);
        ``card``: makes the model card (README.md) from the finished folder's JSON files and the output's name,
        written before the folder moves into place."""
        self.target = Path(out_dir).absolute()
        self.card = card
        self.force = force
        self.max_shard = parse_size(max_shard_size, "max shard size")
        if self.max_shard < 1024:
            raise BadInputError(f"max shard size {self.max_shard} bytes is too small")
        self.config = dict(config or {})
        self.source = dict(source or {})
        self.label = label
        self._check_arch = check_architecture
        check_output(self.target, force)
        problem = config_problem(self.config)  # what the reader would refuse is not written
        if problem:
            raise BadInputError(f"config.json: {problem}", file=label or str(self.target / CONFIG_NAME))
        parent = self.target.parent
        tmp = None
        try:
            parent.mkdir(parents=True, exist_ok=True)
            tmp = make_temp_dir(self.target)
            (tmp / INCOMPLETE_MARKER).write_text("w4pack is writing this folder; it is not complete\n")
        except BaseException as exc:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise write_failure(exc, parent, "cannot create a folder next to the output") from None
            raise
        self.tmp: Path = tmp
        # tensors go straight into the shard being built, after a reserved header area padded with spaces;
        # a background thread fsyncs and checksums each finished shard (store.shards.ShardStream)
        self._stream = ShardStream(tmp, self.max_shard, output=self.target, pad=True, seal=True,
                                   reserve=max(_HEADER_RESERVE, int(header_hint or 0)), temp="shard-{:05d}.partial")
        self.peak_layer_bytes = 0
        self.layers: dict[str, dict[str, Any]] = {}
        self.passthrough: list[str] = []
        self._shapes: dict[str, tuple[int, ...]] = {}  # pass-through tensor -> shape, for the architecture check
        self.side_files: list[str] = []
        self.fused: dict[str, Any] = {}
        self._closed = False
        self.show_progress = show_progress

    # -- adding content ------------------------------------------------------------------------
    def _queue(self, items: list[tuple[str, np.ndarray, str | None]]) -> None:
        self.peak_layer_bytes = max(self.peak_layer_bytes, sum(a.nbytes for _n, a, _d in items))
        self._stream.add(items)

    def add_tensor_span(self, name: str, path: str | os.PathLike[str], offset: int, nbytes: int, st_dtype: str,
                        shape: list[int] | tuple[int, ...]) -> None:
        """Pass through a tensor stored verbatim at ``offset`` of a file (a safetensors shard of the source):
        its bytes are copied in the kernel, never through memory."""
        self._stream.add_span(name, path, offset, nbytes, st_dtype, shape)
        self.passthrough.append(name)
        self._shapes[name] = tuple(shape)

    def add_layer(self, name: str, layer: CanonicalLayer | PackedLayer,
                  source: dict[str, Any] | None = None, storage: dict[str, Any] | None = None) -> dict[str, Any]:
        """Pack (if canonical) and queue one quantized layer; returns its manifest entry. ``storage``: the compact
        form to store it in where it fits exactly (docs/LAYOUT.md §8, core.compact), e.g. a K-quant's."""
        check_layer_name(name)
        packed = pack(layer.replace(name=name)) if isinstance(layer, CanonicalLayer) else layer
        meta = dict(packed.meta)
        meta.pop("storage", None)
        arrays = packed.tensors
        if storage:
            st, arrays = _compact.compact(meta, packed.tensors, storage)
            if st:
                meta["storage"] = st
        tensors = {}
        items = []
        runtime = tensor_suffixes(meta["zero_mode"], meta["act_order"]) + (["bias"] if "bias" in arrays else [])
        for suffix in _compact.stored_suffixes(meta, runtime):
            tname = f"{name}.{suffix}"
            arr = arrays[suffix]
            dname = None
            if suffix in ("scales", "mins"):
                dname = meta["scale_dtype"]
            elif suffix in ("scales_d", "mins_d"):
                dname = "float16"
            elif suffix == "bias":
                dname = meta.get("bias_dtype") or dtype_name_of(arr)
            items.append((tname, arr, dname))
            tensors[suffix] = tname
        self._queue(items)
        meta.pop("bias_dtype", None) if meta.get("bias_dtype") is None else None
        meta["tensors"] = tensors
        src = dict(source if source is not None else packed.source)
        if src:
            meta["source"] = _clean_source(src)
        self.layers[name] = meta
        return meta

    def add_tensor(self, name: str, arr: np.ndarray, dtype_name: str | None = None) -> None:
        """Queue an unquantized tensor, passed through untouched (bf16 as uint16 with dtype_name='bfloat16')."""
        arr = np.asarray(arr)
        self._queue([(name, arr, dtype_name)])
        self.passthrough.append(name)
        self._shapes[name] = tuple(arr.shape)

    def add_side_file(self, src: str | os.PathLike[str], name: str | None = None) -> None:
        """Copy a file (tokenizer, generation config, ...) into the folder: a regular file inside its folder only
        (see folder.side_file), under a plain name that cannot overwrite the checkpoint's own files."""
        src = Path(src)
        name = name or src.name
        if name in _RESERVED or "/" in name or name.startswith(".") or name.endswith(".safetensors"):
            raise BadInputError(f"refusing side file name {name!r}", file=str(src))
        real = side_file(src)
        if name.endswith(".json"):
            read_side_json(real)  # malformed JSON is the source's fault: refused now, not at load
        try:
            shutil.copyfile(real, self.tmp / name)
        except OSError as exc:
            if is_disk_full(exc):
                raise write_failure(exc, self.target / name) from None
            raise IOFailure(f"cannot copy side file: {exc.strerror}", file=str(src)) from None
        if name not in self.side_files:
            self.side_files.append(name)

    def copy_side_files_from(self, folder: str | os.PathLike[str]) -> None:
        """The SIDE_FILES present in ``folder`` (links are followed only inside it: see folder.side_file)."""
        for name in SIDE_FILES:
            p = Path(folder) / name
            if p.is_file():
                self.add_side_file(p)

    # -- finishing -----------------------------------------------------------------------------
    def quantization_config(self) -> dict[str, Any]:
        return quantization_config_for(self.layers, self.source, self.fused)

    def manifest(self, shard_names: list[str], shard_info: list[tuple[int, str]],
                 files: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The manifest document; ``files`` checksums config.json, the index and the side files."""
        doc: dict[str, Any] = {
            "format": "w4pack",
            "format_version": FORMAT_VERSION,
            "layout": {"name": LAYOUT_NAME, "version": LAYOUT_VERSION, "tile": [TILE_N, TILE_K]},
            "created_by": f"w4pack {__version__}",
            "shards": [{"file": n, "sha256": sha, "size": size} for n, (size, sha) in zip(shard_names, shard_info)],
            "files": list(files or []),
            "layers": self.layers,
            "passthrough": self.passthrough,
            "side_files": self.side_files,
        }
        if self.source:
            doc["source"] = _clean_source(self.source)
        if self.fused:
            doc["fused"] = self.fused
        return doc

    def close(self) -> Path:
        """Finish: shards, config.json, index, manifest (last), then rename into place. On any failure, an interrupt
        included, the temporary folder is removed (abort) before the error goes on."""
        if self._closed:
            return self.target
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        return self.target

    def _finish(self) -> None:
        shards = self._stream.close()
        names = shard_names(len(shards), single=False)
        weight_map: dict[str, str] = {}
        # what validate would refuse is not written: the layers and tensors config.json's architecture needs
        problem = self._check_arch and architecture_problem(self.config, self.layers, self.fused,
                                                                   set(self.passthrough), self._shapes.get)
        if problem:
            raise BadInputError(problem[1], file=self.label or str(self.target / CONFIG_NAME), tensor=problem[0])
        config = dict(self.config)
        config["quantization_config"] = self.quantization_config()
        # checked before anything is written (add_layer checks names): a failure here is a bug, and names the output
        validate_quantization_config(config["quantization_config"], file=str(self.target / CONFIG_NAME))
        for shard, fname in zip(shards, names):
            weight_map.update((t, fname) for t in shard.names)
        # total_size is the tensor data, as in Hugging Face's indexes (not the shard files with their headers)
        index = {"metadata": {"total_size": sum(sh.data_bytes for sh in shards), "format": "w4pack"},
                 "weight_map": dict(sorted(weight_map.items()))}
        # the manifest checksums the final bytes of every other file (config.json with its quantization_config)
        docs = [(CONFIG_NAME, _json_bytes(config)), (INDEX_NAME, _json_bytes(index))]
        files = [{"file": f, "sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)} for f, raw in docs]
        for name in self.side_files:
            try:
                size, sha = _sha256_file(self.tmp / name)
            except OSError as exc:
                raise write_failure(exc, self.target / name) from None
            files.append({"file": name, "sha256": sha, "size": size})
        manifest = self.manifest(names, [(sh.size, sh.sha256) for sh in shards], files)
        validate_manifest(manifest, file=str(self.target))
        docs.append((MANIFEST_NAME, _json_bytes(manifest)))
        try:
            for shard, fname in zip(shards, names):
                os.replace(shard.path, self.tmp / fname)
            for fname, raw in docs:
                try:
                    _write_bytes(self.tmp / fname, raw)
                except OSError as exc:
                    raise write_failure(exc, self.target / fname) from None
            if self.card is not None:  # not checksummed: a card describes the model and is meant to be edited
                try:
                    _write_bytes(self.tmp / CARD_NAME, self.card(self.tmp, self.target.name).encode("utf-8"))
                except OSError as exc:
                    raise write_failure(exc, self.target / CARD_NAME) from None
            os.unlink(self.tmp / INCOMPLETE_MARKER)
            _fsync_dir(self.tmp)
            move_into_place(self.tmp, self.target, self.force)
            self._closed = True
            _fsync_dir(self.target.parent)
        except IOFailure:
            raise
        except OSError as exc:
            raise write_failure(exc, self.target, "cannot finish the checkpoint") from None

    def abort(self) -> None:
        """Remove the temporary folder (whatever was written); safe to call more than once, and never raises."""
        if self._closed:
            return
        self._closed = True
        self._stream.abort()  # let background fsyncs finish before the folder goes
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()  # aborts on failure
        else:
            self.abort()


def _json_bytes(doc: Any) -> bytes:
    """A JSON document as written (indented, final newline): the bytes the manifest checksums."""
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def _write_bytes(path: Path, raw: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(raw)
        fh.flush()
        os.fsync(fh.fileno())


def _sha256_file(path: Path, on_chunk: Any = None) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in 8 MiB chunks; ``on_chunk(nbytes)`` after each (progress)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(8 << 20), b""):
            h.update(chunk)
            size += len(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return size, h.hexdigest()


#: in the order written (a set's order varies from run to run with the string hash seed)
_SOURCE_KEYS = ("format", "version", "path", "bits", "notes", "quirks", "base_model")


def _clean_source(src: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"format": _text(src.get("format") or "unknown")}
    for key in _SOURCE_KEYS[1:]:
        if key in src and src[key] is not None:
            val = src[key]
            out[key] = ([_text(v) for v in val] if key in ("notes", "quirks")
                        else int(val) if key == "bits" else _text(val))
    extra = {k: v for k, v in src.items() if k not in _SOURCE_KEYS}
    if extra:
        out.setdefault("notes", []).extend(_text(f"{k}={v}") for k, v in sorted(extra.items()))
    return out


def source_note(source: dict[str, Any], key: str) -> str | None:
    """The value of a manifest source's ``key=value`` note (_clean_source writes the keys it has no field for
    so), or None."""
    for note in source.get("notes") or []:
        if isinstance(note, str) and note.startswith(f"{key}="):
            return note.split("=", 1)[1] or None
    return None


def _text(value: Any) -> str:
    """``str(value)`` as Unicode text: a path of non-UTF-8 bytes (the base model of TOML tables) reaches Python as
    lone surrogates (PEP 383), which JSON can only spell as an escape strict parsers refuse; such a character is
    written as its escape sequence (``\\udcff``) instead."""
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------

class Checkpoint:
    """An opened w4pack checkpoint. Structure is checked on open; data is memory-mapped on demand."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        root = self.path
        if not os.path.lexists(root):
            raise BadInputError("does not exist", file=str(root))
        if not root.is_dir():
            raise BadInputError("not a folder (a w4pack checkpoint is a model folder)", file=str(root))
        if (root / INCOMPLETE_MARKER).exists():
            raise BadInputError("folder is an unfinished write (interrupted conversion); convert again",
                                file=str(root))
        # (the three documents everything else is checked against: a symbolic link out of the folder would make
        # another folder's file this checkpoint's, FORMAT rule 1, the same rule as for shards and side files)
        for doc in (MANIFEST_NAME, CONFIG_NAME, INDEX_NAME):
            _safe_member(root, doc, "file", str(root / doc))
        mpath = root / MANIFEST_NAME
        if not mpath.is_file():
            raise BadInputError(f"no {MANIFEST_NAME}: not a w4pack checkpoint (or an unfinished write)", file=str(root))
        self.manifest: dict[str, Any] = _read_json(mpath)
        validate_manifest(self.manifest, file=str(mpath))
        self.format_version: int = self.manifest["format_version"]
        #: things a reader should know but that do not make the folder invalid (an older manifest, an unchecked
        #: architecture); validate prints them
        self.warnings: list[str] = []
        #: the non-shard files the manifest checksums (format version 2): name -> {"file", "sha256", "size"}
        self.files: dict[str, dict[str, Any]] = self._covered_files(str(mpath))
        self.config: dict[str, Any] = _read_json(root / CONFIG_NAME)
        if not isinstance(self.config, dict) or "quantization_config" not in self.config:
            raise BadInputError("config.json has no quantization_config", file=str(root / CONFIG_NAME))
        validate_quantization_config(self.config["quantization_config"], file=str(root / CONFIG_NAME))
        problem = config_problem(self.config)
        if problem:
            raise BadInputError(problem, file=str(root / CONFIG_NAME))
        ipath = root / INDEX_NAME
        index = _read_json(ipath)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise BadInputError("index has no weight_map object", file=str(ipath))
        #: the index's metadata.total_size (the tensors' data bytes, FORMAT section 4), checked by check_total_size
        self.index_total = (index.get("metadata") or {}).get("total_size") \
            if isinstance(index.get("metadata"), dict) else None
        self.weight_map: dict[str, str] = {}
        for tname, fname in index["weight_map"].items():
            _safe_member(root, fname, f"shard of tensor {tname}", str(ipath))
            self.weight_map[tname] = fname
        shard_files = {s["file"] for s in self.manifest["shards"]}
        for s in self.manifest["shards"]:
            p = _safe_member(root, s["file"], "shard", str(mpath))
            if not p.is_file():
                raise BadInputError("shard named in the manifest is not a regular file" if os.path.lexists(p)
                                    else "shard named in the manifest is missing", file=str(p))
        named = set(self.weight_map.values())
        stray = named - shard_files
        if stray:
            raise BadInputError(f"index names shard {sorted(stray)[0]!r} that the manifest does not checksum",
                                file=str(ipath))
        unnamed = shard_files - named
        if unnamed:  # (its tensors would be no one's: every tensor of every shard is listed, FORMAT section 4)
            raise BadInputError(f"shard {sorted(unnamed)[0]!r} of the manifest holds no tensor of the index",
                                file=str(ipath))
        for name, meta in self.manifest["layers"].items():
            for suffix, tname in meta["tensors"].items():
                if tname not in self.weight_map:
                    raise BadInputError("tensor of a quantized layer is missing from the index", file=str(ipath),
                                        tensor=tname)
            _check_layer_meta(name, meta, str(mpath))
        for tname in self.manifest["passthrough"]:
            if tname not in self.weight_map:
                raise BadInputError("pass-through tensor is missing from the index", file=str(ipath), tensor=tname)
        self.store = TensorStore(root)
        self.store.add_index(root, self.weight_map)

    def _covered_files(self, mfile: str) -> dict[str, dict[str, Any]]:
        """Version 2: every file entry is listed once, config.json, the index and each side file among them. Version 1 covered only the shards: still read, with a warning."""
        if self.format_version < 2:
            self.warnings.append(
                f"{MANIFEST_NAME} is format version {self.format_version}: only the shards are checksummed, not "
                f"{CONFIG_NAME}, the index or the side files; convert the folder again (w4pack convert "
                f"{self.path} NEW) to write a version {FORMAT_VERSION} manifest that covers them")
            return {}
        files: dict[str, dict[str, Any]] = {}
        shards = {s["file"] for s in self.manifest["shards"]}
        for entry in self.manifest["files"]:
            name = entry["file"]  # a plain name (the schema's filename); links are checked where it is read
            if name in files or name in shards or name in (MANIFEST_NAME, CARD_NAME):
                raise BadInputError(f"manifest lists {name!r} twice or as a file it cannot checksum", file=mfile)
            files[name] = entry
        for name in (CONFIG_NAME, INDEX_NAME, *self.manifest.get("side_files", [])):
            if name not in files:
                raise BadInputError(f"manifest does not checksum {name} (format version 2 covers config.json, "
                                    "the index and every side file)", file=mfile)
        return files

    # -- access --------------------------------------------------------------------------------
    @property
    def layers(self) -> list[str]:
        """Names of the quantized layers (module paths)."""
        return list(self.manifest["layers"])

    @property
    def passthrough(self) -> list[str]:
        return list(self.manifest["passthrough"])

    def raw(self, tname: str) -> np.ndarray:
        """A stored tensor as a read-only memory-mapped array (bf16 as uint16 bits)."""
        if tname not in self.weight_map:
            raise BadInputError("no such tensor in this checkpoint", file=str(self.path), tensor=tname)
        return self.store.get(tname)

    def dtype_name(self, tname: str) -> str:
        return self.store.info(tname)[0]

    def tensor(self, tname: str) -> np.ndarray:
        """A pass-through tensor (or any stored tensor) as stored."""
        self.release_pages()
        return self.raw(tname)

    def release_pages(self) -> None:
        """Drop the shards' mapped pages from our address space (safetensors_io.release_mapped). Called before
        each layer or pass-through tensor is read, so reading a whole checkpoint keeps resident memory at about
        one layer rather than the model; arrays returned earlier stay valid (their pages fault back in)."""
        self.store.release_all()

    def packed(self, name: str) -> PackedLayer:
        if name not in self.manifest["layers"]:
            raise BadInputError("no such quantized layer", file=str(self.path), tensor=name)
        self.release_pages()
        meta = dict(self.manifest["layers"][name])
        tensors = {}
        for suffix, tname in meta["tensors"].items():
            arr = self.raw(tname)
            fdt = self.dtype_name(tname)
            want = {"scales": meta["scale_dtype"], "mins": meta["scale_dtype"]}.get(suffix)
            if suffix == "bias":
                _check_bias_dtype(fdt, meta.get("bias_dtype"), self.path / self.weight_map[tname], tname)
                want = meta["bias_dtype"] = fdt
            if want is not None and fdt != want:
                raise BadInputError(f"stored as {fdt} but the manifest says {want}",
                                    file=str(self.path / self.weight_map[tname]), tensor=tname)
            if suffix == "perm":  # checked here, where file and tensor are known: every runtime gathers by it
                _check_perm(arr, self.path / self.weight_map[tname], tname)
            tensors[suffix] = arr
        if meta.get("storage"):
            # the compact form on disk becomes the runtime tensors here, so nothing past this reader sees it
            tnames = meta["tensors"]
            first = tnames.get("qdense") or tnames.get("qindex") or next(iter(tnames.values()))
            try:
                tensors = _compact.expand(meta, tensors, name)
            except BadInputError as exc:
                if exc.file is None:
                    exc.file = str(self.path / self.weight_map.get(exc.tensor or "", self.weight_map.get(first, "")))
                    exc.args = (exc.one_line(),)
                raise
            meta.pop("storage")
            meta["tensors"] = {s: meta["tensors"].get(s, f"{name}.{s}") for s in tensors}
        return PackedLayer(meta=meta, tensors=tensors, source=dict(meta.get("source", {})))

    def layer(self, name: str) -> CanonicalLayer:
        """The canonical layer: codes in the original column order, true shape, act-order undone."""
        packed = self.packed(name)
        try:
            return unpack(packed, name=name)
        except BadInputError as exc:
            if exc.file is None:
                tname = exc.tensor if exc.tensor in self.weight_map else packed.meta["tensors"].get("qweight", name)
                exc.file = str(self.path / self.weight_map.get(tname, ""))
                exc.args = (exc.one_line(),)
            raise

    def dequantize(self, name: str, dtype: type = np.float32) -> np.ndarray:
        """float32 (or ``dtype`` float64) [N, K] weights in the original input-channel order."""
        return self.layer(name).dequantize(dtype)

    def check_shards(self) -> None:
        """Open every shard header: each tensor the index lists is in its shard, and each tensor a shard holds is
        listed, in that shard (FORMAT section 4). A tensor the index does not list is read by no one, or, where a
        loader globs the shards, by some: a second copy of a listed tensor would be one loader's and not
        another's."""
        self.store.check_index()
        for path, tname in self.store.unlisted():
            raise BadInputError("tensor is in the shard but not in the index (every tensor of a shard is listed; "
                                "convert the folder again)", file=path, tensor=tname)

    def check_structure(self) -> None:
        """Open every shard header and check every tensor's shape and dtype (no data read); then that the folder,
        the index, the fused table and the architecture agree with the manifest (``check_contents``)."""
        self.check_shards()
        for name in self.layers:
            self.packed_shapes_ok(name)
        self.check_contents()

    def check_contents(self) -> list[str]:
        """The folder holds only listed files, every indexed tensor belongs to a layer or is a pass-through, the
        fused table is consistent, and the layers are those config.json's architecture needs. Returns the names
        of the checks that ran ("architecture" is skipped, with a warning, for a model type w4pack does not
        know)."""
        self.check_listing()
        self.check_json_files()
        self.check_index_coverage()
        self.check_fused()
        self.check_quantization_config()
        checks = ["listing", "json", "fused"] + (["architecture"] if self.check_architecture() else [])
        self.check_total_size()
        return checks

    def check_total_size(self) -> None:
        """The index's metadata.total_size, where given, is the shards' tensor data bytes (FORMAT section 4): tools
        size downloads and memory by it. Checked last: a folder whose tensors were removed also has a stale one,
        and what is missing says more than the sum."""
        if self.index_total is None:
            return
        self.store.check_index()  # (opens every shard header, once)
        data = sum(end - begin for f in self.store.safetensors_files()
                   for _dt, _shape, begin, end in f.entries.values())
        if self.index_total != data:
            raise BadInputError(f"metadata.total_size is {brief(self.index_total)}, but the shards hold {data} bytes "
                                "of tensor data", file=str(self.path / INDEX_NAME))

    def check_quantization_config(self) -> None:
        """config.json's quantization_config says what the manifest implies (version 2: the writer derived it from
        the manifest); a re-signed edit of it would tell transformers and vLLM another story than the layers."""
        if self.format_version < 2:
            return
        want = quantization_config_for(self.manifest["layers"], self.manifest.get("source") or {},
                                       self.manifest.get("fused") or {})
        have = self.config.get("quantization_config") or {}
        for key, value in want.items():
            if have.get(key) != value:
                raise BadInputError(f"quantization_config.{key} is {have.get(key)!r} but the manifest implies "
                                    f"{value!r}", file=str(self.path / CONFIG_NAME))

    def listed_files(self) -> set[str]:
        """Every file the manifest accounts for: itself, the shards and (version 2) its ``files``; version 1
        named config.json, the index and the side files without checksums."""
        names = {MANIFEST_NAME} | {s["file"] for s in self.manifest["shards"]}
        if self.format_version >= 2:
            return names | set(self.files)
        return names | {CONFIG_NAME, INDEX_NAME} | set(self.manifest.get("side_files", []))

    def check_listing(self) -> None:
        """No file in the folder beyond what the manifest lists, the model card (README.md, written by push) and
        hidden entries (never uploaded, never loaded): a stray shard or tokenizer file would be picked up by
        tools that glob the folder while no checksum covers it. Sub-folders are not the model's (no loader
        reads them; an owner may keep e.g. the original weights there) and are left alone."""
        listed = self.listed_files() | {CARD_NAME}
        try:
            entries = sorted(os.listdir(self.path))
        except OSError as exc:
            raise BadInputError(f"cannot list the folder: {exc.strerror}", file=str(self.path)) from None
        for entry in entries:
            if entry not in listed and not entry.startswith(".") and not (self.path / entry).is_dir():
                raise BadInputError(f"not listed in {MANIFEST_NAME}: a checkpoint folder holds only the files its "
                                    "manifest lists (remove it, or convert again to include it)",
                                    file=str(self.path / entry))

    def check_json_files(self) -> None:
        """Every JSON file the manifest lists parses to an object (config.json and the index were parsed on open):
        a checksum only says the bytes are the ones signed, and a truncated generation_config.json re-signed into
        the manifest would pass every checksum and fail in the loader."""
        names = set(self.files) if self.format_version >= 2 else set(self.manifest.get("side_files", []))
        for name in sorted(names - {CONFIG_NAME, INDEX_NAME}):
            if name.endswith(".json"):
                read_side_json(_safe_member(self.path, name, "listed file", str(self.path / MANIFEST_NAME)))

    def check_index_coverage(self) -> None:
        """Every tensor of the index is a layer's or a pass-through (a layer entry removed from the manifest
        leaves its tensors behind)."""
        owned = set(self.manifest["passthrough"])
        for meta in self.manifest["layers"].values():
            owned.update(meta["tensors"].values())
        for tname in self.weight_map:
            if tname not in owned:
                raise BadInputError(f"indexed tensor belongs to no layer of {MANIFEST_NAME} and is not a "
                                    "pass-through tensor (a layer entry missing from the manifest?)",
                                    file=str(self.path / INDEX_NAME), tensor=tname)

    def check_fused(self) -> None:
        """The fused table: each fused module is a layer; its parts are not layers, belong to one fusion only and
        tile the layer's rows in order; config.json's copy is the same table."""
        mfile = str(self.path / MANIFEST_NAME)
        fused = self.manifest.get("fused") or {}
        qc = self.config["quantization_config"]
        if (qc.get("fused") or {}) != fused:
            raise BadInputError(f"quantization_config.fused disagrees with the fused table of {MANIFEST_NAME}",
                                file=str(self.path / CONFIG_NAME))
        layers = self.manifest["layers"]
        seen: set[str] = set()
        for name, parts in fused.items():
            if name not in layers:
                raise BadInputError("fused module is not a layer of the manifest", file=mfile, tensor=name)
            if not parts:
                raise BadInputError("fused module has no parts", file=mfile, tensor=name)
            end = 0
            for part in parts:
                pname, (lo, hi) = part["name"], part["rows"]
                if pname in layers or pname in fused or pname in seen:
                    raise BadInputError(f"fused part of {name} is also a layer or part of another fusion",
                                        file=mfile, tensor=pname)
                seen.add(pname)
                if lo != end or hi <= lo:
                    raise BadInputError(f"fused part rows [{lo}, {hi}) do not follow the previous part's end {end}",
                                        file=mfile, tensor=pname)
                end = hi
            rows = layers[name]["shape"][0]
            if end != rows:
                raise BadInputError(f"fused parts cover rows [0, {end}) of the layer's {rows}", file=mfile,
                                    tensor=name)

    def check_architecture(self) -> bool:
        """The manifest's layers (fused parts by their own names) plus the float linears are exactly the Linear
        modules config.json's model needs, with their shapes, and the embedding and norm weights it needs are there
        (core.arch.needed_tensors). False (and a warning) when the model type or its
        sizes are unknown."""
        _required, _optional, why = needed_linears(self.config)
        if why:
            self.warnings.append(f"layers not checked against the architecture: {why}")
            return False
        mfile, cfile = str(self.path / MANIFEST_NAME), str(self.path / CONFIG_NAME)
        floats = set(self.manifest["passthrough"]) & set(self.weight_map)
        problem = architecture_problem(self.config, self.manifest["layers"], self.manifest.get("fused") or {},
                                       floats, lambda t: tuple(self.store.info(t)[1]))
        if problem:
            tensor, message, in_manifest = problem
            raise BadInputError(message, file=mfile if in_manifest else cfile, tensor=tensor)
        return True

    def packed_shapes_ok(self, name: str) -> None:
        from ..core.layout import words_per_tile_lane
        from ..core.dtypes import FLOAT_DTYPES
        meta = self.manifest["layers"][name]
        np_, kp = meta["padded_shape"]
        n, k = meta["shape"]
        gp = meta["padded_groups"]
        sd = FLOAT_DTYPES[meta["scale_dtype"]]
        expect = {
            "qweight": ((np_ // TILE_N, kp // TILE_K * 32 * words_per_tile_lane(meta["storage_bits"])), np.dtype(np.int32)),
            "scales": ((gp, np_), sd),
            "zeros": ((gp, np_), np.dtype(np.uint8 if meta["storage_bits"] == 4 else np.uint16)),
            "mins": ((gp, np_), sd),
            "perm": ((k,), np.dtype(np.int32)),
            **_compact.expected_shapes(meta),
        }
        for suffix, tname in meta["tensors"].items():
            fname = self.weight_map[tname]
            if not self.store.in_file(tname):
                raise BadInputError("tensor is missing from its shard", file=str(self.path / fname), tensor=tname)
            dt, shape = self.store.info(tname)
            if suffix == "bias":
                if shape != (n,):
                    raise BadInputError(f"shape {list(shape)} contradicts the manifest (expected [{n}])",
                                        file=str(self.path / fname), tensor=tname)
                _check_bias_dtype(dt, meta.get("bias_dtype"), self.path / fname, tname)
                continue
            want_shape, want_dt = expect[suffix]
            if shape != want_shape:
                raise BadInputError(f"shape {list(shape)} contradicts the manifest (expected {list(want_shape)})",
                                    file=str(self.path / fname), tensor=tname)
            stored = self.store.storage_dtype(tname)
            if stored != want_dt:
                raise BadInputError(f"dtype {dt} contradicts the manifest", file=str(self.path / fname), tensor=tname)

    def verify_checksums(self, show_progress: bool | None = None) -> None:
        """Size and sha256 of every file the manifest covers: config.json, the index and the side files first
        (small; version 2), then the shards."""
        entries = [(e, "file") for e in self.files.values()] + [(s, "shard") for s in self.manifest["shards"]]
        total = sum(e["size"] for e, _k in entries)
        with Progress(total // (1 << 20) or 1, "checksums", " MiB", enabled=show_progress) as bar:
            done = [0]

            def tick(n: int) -> None:
                before = done[0] >> 20
                done[0] += n
                bar.update((done[0] >> 20) - before)

            for e, kind in entries:
                p = _safe_member(self.path, e["file"], kind, str(self.path / MANIFEST_NAME))
                try:
                    size = p.stat().st_size
                    if size == e["size"]:
                        size, sha = _sha256_file(p, tick)
                except FileNotFoundError:
                    raise BadInputError(f"{kind} named in the manifest is missing", file=str(p)) from None
                except OSError as exc:
                    raise BadInputError(f"cannot read: {exc.strerror}", file=str(p)) from None
                if size != e["size"]:
                    raise BadInputError(f"size {size} != {e['size']} recorded in the manifest (truncated or altered)",
                                        file=str(p))
                if sha != e["sha256"]:
                    raise BadInputError(f"sha256 differs from the manifest: the {kind} is corrupted or altered",
                                        file=str(p))

    def summary(self) -> dict[str, Any]:
        layers = self.manifest["layers"]
        kinds = Counter((m["bits"], m["group_size"], m["zero_mode"], m["act_order"]) for m in layers.values())
        qbytes = 0
        for m in layers.values():
            for tname in m["tensors"].values():
                _dt, shape = self.store.info(tname)
                qbytes += int(np.prod(shape)) * self.store.storage_dtype(tname).itemsize if shape else 0
        return {
            "path": str(self.path),
            "format_version": self.manifest["format_version"],
            "layout": self.manifest["layout"],
            "source": self.manifest.get("source"),
            "architecture": (self.config.get("architectures") or [None])[0],
            "model_type": self.config.get("model_type"),
            "quantization_config": self.config["quantization_config"],
            "num_layers": len(layers),
            "num_passthrough": len(self.manifest["passthrough"]),
            "shards": [{"file": s["file"], "size": s["size"]} for s in self.manifest["shards"]],
            "total_size": sum(s["size"] for s in self.manifest["shards"]),
            "quantized_bytes": qbytes,
            "layer_kinds": [
                {"bits": b, "group_size": g, "zero_mode": z, "act_order": a, "count": c}
                for (b, g, z, a), c in sorted(kinds.items(), key=lambda kv: -kv[1])
            ],
            "side_files": self.manifest.get("side_files", []),
            "files": sorted(self.files),
            "warnings": list(self.warnings),
        }

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_layer_meta(name: str, meta: dict[str, Any], file: str) -> None:
    from ..core.layout import padded_shape, storage_bits_for
    n, k = meta["shape"]
    if tuple(meta["padded_shape"]) != padded_shape(n, k):
        raise BadInputError(f"padded_shape {meta['padded_shape']} contradicts shape {meta['shape']}", file=file,
                            tensor=name)
    if meta["storage_bits"] != storage_bits_for(meta["bits"]):
        raise BadInputError("storage_bits contradicts bits", file=file, tensor=name)
    gs = meta["group_size"]
    kp = meta["padded_shape"][1]
    g = 1 if gs == -1 else -(-k // gs)
    gp = 1 if gs == -1 else -(-kp // gs)
    if meta["num_groups"] != g or meta["padded_groups"] != gp:
        raise BadInputError(f"num_groups/padded_groups {meta['num_groups']}/{meta['padded_groups']} contradict "
                            f"K={k}, group_size={gs} (expected {g}/{gp})", file=file, tensor=name)
    why = _compact.check_storage(meta)
    if why:
        raise BadInputError(why, file=file, tensor=name)
    want = set(_compact.stored_suffixes(meta, tensor_suffixes(meta["zero_mode"], meta["act_order"])))
    have = set(meta["tensors"]) - {"bias"}
    if want != have:
        raise BadInputError(f"tensors {sorted(have)} do not match zero_mode/act_order (expected {sorted(want)})",
                            file=file, tensor=name)


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a w4pack checkpoint folder, checking manifest, config, index and shard names.

    Example::

        ckpt = w4pack.open_checkpoint("llama-w4/")
        for name in ckpt.layers:
            w = ckpt.dequantize(name)        # float32 [N, K]
    """
    return Checkpoint(path)


def validate_checkpoint(path: str | os.PathLike[str], *, checksums: bool = True,
                        deep: bool = False, show_progress: bool | None = None) -> dict[str, Any]:
    """Schema, index, shard headers, shapes and (by default) sha256 of every shard.

    ``deep=True`` also unpacks every layer (code ranges, permutations). Raises BadInputError on the
    first problem; returns the checkpoint summary when all is well.
    """
    with open_checkpoint(path) as ck:
        ck.check_shards()
        for name in ck.layers:
            ck.packed_shapes_ok(name)
        contents = ck.check_contents()
        if checksums:
            ck.verify_checksums(show_progress=show_progress)
        if deep:
            for name in ck.layers:
                ck.layer(name)
        out = ck.summary()
        out["checks"] = ["schema", "index", "headers", "shapes"] + contents + (["sha256"] if checksums else []) + \
            (["unpack"] if deep else [])
        return out


def _check_bias_dtype(stored: str, declared: str | None, file: Path, tname: str) -> None:
    """A bias is stored as a float dtype, the manifest's ``bias_dtype`` where it names one (FORMAT section 3: a
    reader that meets a bias without it takes the stored dtype)."""
    if stored not in FLOAT_DTYPES:
        raise BadInputError(f"dtype {stored} is not a float dtype (a bias is {', '.join(FLOAT_DTYPES)})",
                            file=str(file), tensor=tname)
    if declared is not None and stored != declared:
        raise BadInputError(f"stored as {stored} but the manifest says {declared}", file=str(file), tensor=tname)


def _check_perm(arr: np.ndarray, file: Path, tname: str) -> None:
    """An act-order permutation must hold each of 0..K-1 once (a damaged one would gather the wrong columns, or
    read outside the activations in a native kernel)."""
    k = arr.shape[0] if arr.ndim == 1 else -1
    if k < 0 or arr.dtype.kind not in "iu":
        return  # the layer's own shape and dtype checks name what is wrong
    if k and (int(arr.min()) < 0 or int(arr.max()) >= k or np.bincount(arr, minlength=k).max() != 1):
        seen = np.zeros(k, dtype=bool)
        for i, v in enumerate(arr.tolist()):
            if not 0 <= v < k or seen[v]:
                raise BadInputError(f"not a permutation of 0..{k - 1}: entry {i} = {v}"
                                    + (" repeats an earlier one" if 0 <= v < k else " is out of range"),
                                    file=str(file), tensor=tname)
            seen[v] = True

