"""Conversion sources, opened above the readers: a local path, or an ``hf://owner/name[@rev][/path]`` spec
that w4pack.hub downloads (only what a source needs, cached by commit) before a reader opens the copy."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from .errors import BadInputError, UnsupportedError, W4PackError
from .formats import check_read_options, detect, get_format, refuse_a_shard
from .formats.base import Source

__all__ = ["is_hub_spec", "local_path", "source_format", "open_source", "wrong_from"]


def is_hub_spec(src: str | Path) -> bool:
    return str(src).startswith("hf:/")  # hf:/ too: a Path collapses the // of hf://


def local_path(src: str | Path) -> Path:
    """The local file or folder of a source: the path itself, or the download of an hf:// spec."""
    if is_hub_spec(src):
        from .hub import resolve_source

        return resolve_source(str(src))
    return Path(src)


def source_format(src: str | Path, fmt: str | None = None) -> str:
    """The source's format as open_source will take it: ``fmt``, else detected (an hf:// source on its download)."""
    return fmt or detect(local_path(src))


def open_source(src: str | Path, fmt: str | None = None, **options: Any) -> Source:
    """Open a path or an hf:// spec for reading; a Hub source records its origin (spec, base model and license
    from the source's card) in ``info`` for the manifest and model card."""
    if not is_hub_spec(src):
        return _open_as(fmt, Path(src), options)
    from .hub import card_metadata, parse_hub_spec

    local = local_path(src)
    source = _open_as(fmt, local, options)
    repo_id, rev, _sub = parse_hub_spec(str(src))
    meta: dict[str, Any] = {}
    with contextlib.suppress(BadInputError):
        meta = card_metadata(local if local.is_dir() else local.parent)
    info = source.info
    info["path"] = f"hf://{repo_id}" + (f"@{rev}" if rev else "")  # not the local cache path
    base = meta.get("base_model")
    if isinstance(base, list):
        base = base[0] if base else None
    info.setdefault("base_model", base or repo_id)
    if meta.get("license") and "license" not in info:
        info["license"] = str(meta["license"])
    return source


#: names of one family: the reader of either takes both (GPTQ v1/v2 are told apart by the tensors)
_SAME_FAMILY = ({"gptq", "gptq-v2"},)


def _open_as(fmt: str | None, path: Path, options: dict[str, Any]) -> Source:
    """The reader of ``fmt`` (else the detected format) on ``path``. When a named format's reader refuses the
    input and detection recognises it as another format, the error says so: "header length exceeds the file" is
    what the safetensors reader of --from awq says about a GGUF file, and the mistake to fix is the --from. A
    named reader that opens the input but finds none of its layers there (the GPTQ reader on a compressed-tensors
    folder: every tensor a pass-through) is the same mistake."""
    if fmt is not None:
        refuse_a_shard(path)  # (detect does it otherwise: a named reader would misreport the missing tensors)
    name = fmt or detect(path)
    check_read_options(get_format(name), options, path)
    try:
        source = get_format(name).open(path, **options)
    except W4PackError as exc:
        wrong = wrong_from(exc, path, get_format(name).name) if fmt is not None else None
        if wrong is not None:
            raise wrong from exc
        raise
    if fmt is not None and not source.layer_names():
        none = UnsupportedError(f"the {get_format(name).name} reader finds no quantized layers here", file=str(path))
        wrong = wrong_from(none, path, get_format(name).name)
        if wrong is not None:
            source.close()
            raise wrong
    return source


def wrong_from(exc: W4PackError, path: str | Path, named: str) -> BadInputError | None:
    """The reader's refusal ``exc`` as a wrong --from, when detection finds a format other than ``named``: the
    reader's line + "(detected format: gguf; drop --from awq, or pass --from gguf)", bad usage (exit 2) whatever
    the named reader's own code (a w4pack folder read --from gptq is "unsupported" to the GPTQ reader). None when
    detection agrees, finds nothing, or the failure is not about the input (I/O, exit 4)."""
    if not isinstance(exc, (BadInputError, UnsupportedError)):
        return None
    try:
        found = detect(Path(path))
    except W4PackError:
        return None
    if found == named or any({found, named} <= fam for fam in _SAME_FAMILY):
        return None
    return BadInputError(f"{exc.message} (detected format: {found}; drop --from {named}, or pass --from {found})",
                         file=exc.file, tensor=exc.tensor)
