"""Readers and writers of external checkpoint formats, one module per family, behind one interface.

``REGISTRY`` maps a format name to its class; ``detect(path)`` names the format of a checkpoint.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ..errors import BadInputError, UnsupportedError, W4PackError
from ..store.folder import read_json
from ..store.names import MANIFEST_NAME, WEIGHT_SUFFIXES
from .base import Capabilities, Format, HubFiles, Source, TensorData

__all__ = ["REGISTRY", "get_format", "detect", "open_source", "check_read_options", "refuse_a_shard", "hub_files",
           "Format", "Source", "Capabilities", "TensorData", "HubFiles"]

#: format name -> "module:Class"; modules are imported on first use so a broken optional
#: dependency of one format does not break the others.
_KNOWN = {
    "w4pack": "w4pack.formats.w4pack:W4PackFormat",
    "gptq": "w4pack.formats.gptq:GPTQFormat",
    "gptq-v2": "w4pack.formats.gptq:GPTQv2Format",
    "awq": "w4pack.formats.awq:AWQFormat",
    "toml": "w4pack.formats.toml_tables:TomlTablesFormat",
    "compressed-tensors": "w4pack.formats.compressed_tensors:CompressedTensorsFormat",
    "gguf": "w4pack.formats.gguf:GGUFFormat",
}
#: detection order: most specific first
_DETECT_ORDER = ("w4pack", "gguf", "compressed-tensors", "awq", "toml", "gptq")

REGISTRY: dict[str, type[Format]] = {}


def _available() -> dict[str, type[Format]]:
    for name, ref in _KNOWN.items():
        if name in REGISTRY:
            continue
        mod, cls = ref.split(":")
        try:
            REGISTRY[name] = getattr(importlib.import_module(mod), cls)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("w4pack.formats."):
                continue  # format not implemented in this build
            raise
    return REGISTRY


def get_format(name: str) -> type[Format]:
    """The format class of ``name``, in any case (``--to GPTQ`` is ``gptq``)."""
    formats = _available()
    key = name.lower() if isinstance(name, str) else name
    if key not in formats:
        raise UnsupportedError(f"unknown format {name!r}; known: {', '.join(sorted(formats))}")
    return formats[key]


def detect(path: str | Path) -> str:
    """The format of a local checkpoint. When no format recognises it and one of its safetensors files does not
    open (truncated, a broken header), that file's error is raised (bad input, exit 2): "unknown format"
    (exit 3) would send the user to --from for a file that no format can read."""
    p = Path(path)
    if not p.exists():
        raise BadInputError("does not exist", file=str(p))
    refuse_a_shard(p)
    formats = _available()
    for name in _DETECT_ORDER:
        if name in formats and formats[name].detect(p):
            return name
    _raise_broken_file(p)
    from ..store.gguffile import folder_not_file_hint
    from ..store.tables import tables_below_hint

    # the checkpoint a user meant may lie one step away: the GGUF file in the folder, the tables in its sub-folder
    hint = (folder_not_file_hint(p) or tables_below_hint(p)) if p.is_dir() else ""
    declared = _declared_method(p)
    if declared is None:
        from ._incomplete import raise_float_only, raise_incomplete_quantized

        raise_incomplete_quantized(p)
        if not hint:  # base weights beside quant tables are float too, and not the mistake
            raise_float_only(p)
    elif not hint and declared.strip().lower() not in _READ_METHODS:
        from ..store.folder import brief

        cfg = (p if p.is_dir() else p.parent) / "config.json"
        raise UnsupportedError(f"quant_method {brief(declared)} is not a method w4pack reads; if the tensors are "
                               f"one of {', '.join(sorted(formats))}, name it with --from", file=str(cfg))
    elif not hint:
        _raise_reader_error(p, formats.get(_METHOD_FORMAT.get(declared.strip().lower(), declared.strip().lower())))
    raise UnsupportedError("cannot tell which format this is" + (hint or "; name it with --from "
                           f"({', '.join(sorted(formats))})"), file=str(p))


#: the quant_method values of the configs the readers take (a folder declaring another is a method w4pack does not
#: read; one declaring these that no reader recognised is a damaged checkpoint of that format, or a variant)
_READ_METHODS = ("gptq", "awq", "llm-awq", "compressed-tensors", "w4pack")

#: the reader of each of those methods, where its name differs
_METHOD_FORMAT = {"llm-awq": "awq"}


def _raise_reader_error(p: Path, fmt: type[Format] | None) -> None:
    """A folder whose config.json declares a method a reader takes, refused by that reader's detection (a mistyped
    field, a lost tensor, another file's contradicting quant_method): the reader's own error when it opens the
    folder names what is wrong (bad input, exit 2; or what it cannot read, 3) where "cannot tell which format"
    would send the user to --from."""
    if fmt is None:
        return
    try:
        with fmt.open(p):
            pass
    except (BadInputError, UnsupportedError):
        raise
    except W4PackError:
        return


#: JSON files whose content decides which format a folder is: when one is malformed, detection fails because of it
_DETECT_JSON = ("config.json", "quantize_config.json", "quant_config.json")


def _raise_broken_file(p: Path) -> None:
    """Raise the error of the file that made detection fail, if one is broken: a malformed JSON file that decides
    the format, else the first safetensors file whose header does not read."""
    from ..store.folder import read_json
    from ..store.tensors import first_unreadable

    if p.is_dir():
        for name in _DETECT_JSON:
            if (p / name).is_file() and not isinstance(read_json(p / name), dict):  # read_json: malformed
                raise BadInputError("not a JSON object", file=str(p / name))
    broken = first_unreadable(p)
    if broken is not None:
        raise broken


def _declared_method(p: Path) -> str | None:
    """The quant_method a folder's config.json declares (a method w4pack does not read is "unsupported", exit 3,
    whatever its tensors look like), or None."""
    from ..store.folder import read_json

    cfg = (p if p.is_dir() else p.parent) / "config.json"
    if not cfg.is_file():
        return None
    doc = read_json(cfg)
    q = (doc.get("quantization_config") or doc.get("compression_config")) if isinstance(doc, dict) else None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if isinstance(q, dict) and "quant_method" in q and not (isinstance(method, str) and method.strip()):
        from ..errors import BadInputError
        from ..store.folder import brief

        key = "quantization_config" if doc.get("quantization_config") else "compression_config"
        raise BadInputError(f"{key}.quant_method is {brief(method)}, not the name of a method", file=str(cfg))
    return str(method) if method else None


def refuse_a_shard(path: str | Path) -> None:
    """A weights file that an index beside it lists with other shards is part of a checkpoint, not one: read alone
    it lacks the layers' other tensors ("has scales but no qweight") or the configs' context ("cannot tell which
    format"), which sends the user after damage that is not there. Bad input (exit 2) saying to pass the folder."""
    p = Path(path)
    if not p.is_file() or not p.name.endswith(WEIGHT_SUFFIXES):
        return
    index_suffixes = tuple(f"{s}.index.json" for s in WEIGHT_SUFFIXES)
    for index in sorted(p.parent.glob("*.index.json")):
        if not index.name.endswith(index_suffixes) or not index.is_file():
            continue
        try:
            doc = read_json(index)
        except BadInputError:
            continue  # a broken index is the folder's error, reported when the folder is opened
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        shards = {f for f in wmap.values() if isinstance(f, str)} if isinstance(wmap, dict) else set()
        if p.name in shards and len(shards) > 1:
            raise BadInputError(f"one of the {len(shards)} shards that {index.name} lists, not a whole checkpoint: "
                                f"pass the folder {p.parent}", file=str(p))
    manifest = p.parent / MANIFEST_NAME  # a packed folder's shards, one or many: its layers' meaning is the manifest's
    if manifest.is_file():
        try:
            doc = read_json(manifest)
        except BadInputError:
            return  # a broken manifest is the folder's error, reported when the folder is opened
        listed = doc.get("shards") if isinstance(doc, dict) else None
        names = {e.get("file") for e in listed if isinstance(e, dict)} if isinstance(listed, list) else set()
        if p.name in names:
            raise BadInputError(f"a shard of the packed checkpoint whose manifest {manifest.name} lists it, not a "
                                f"checkpoint by itself: pass the folder {p.parent}", file=str(p))


def hub_files() -> list[HubFiles]:
    """What the readers need from a Hub repository, as the formats declare it (w4pack.hub fetches it)."""
    return list(dict.fromkeys(k for fmt in _available().values() for k in fmt.hub_files))


def open_source(path: str | Path, fmt: str | None = None, **options: object) -> Source:
    """Open a local checkpoint; ``hf://`` specs are opened above the readers, by w4pack.sources.open_source."""
    if str(path).startswith("hf:/"):
        raise UnsupportedError("w4pack.formats.open_source opens local paths; open hf:// sources with "
                               "w4pack.sources.open_source", file=str(path))
    if fmt is not None:
        refuse_a_shard(path)  # (detect does it otherwise)
    name = fmt or detect(path)
    f = get_format(name)
    check_read_options(f, options, path)
    return f.open(Path(path), **options)


def check_read_options(f: type[Format], options: dict[str, Any], path: str | Path) -> None:
    """Refuse an option the reader does not take (a misspelt or misplaced one), rather than drop it; ``base`` is
    the readers' own check (a quant-table reader takes it, the others say why not)."""
    extra = sorted(k for k in options if k != "base" and f.read_options is not None and k not in f.read_options)
    if extra:
        takes = ", ".join(sorted(f.read_options or ())) or "none"
        raise BadInputError(f"the {f.name} reader takes no option {', '.join(extra)} (it takes: {takes})",
                            file=str(path))
