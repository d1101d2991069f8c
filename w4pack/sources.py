"""Conversion sources, opened above the readers: a local path, or an ``hf://owner/name[@rev][/path]`` spec
that w4pack.hub downloads (only what a source needs, cached by commit) before a reader opens the copy."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from .errors import BadInputError
from .formats import detect, get_format
from .formats.base import Source

__all__ = ["is_hub_spec", "local_path", "source_format", "open_source"]


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
        return get_format(fmt or detect(src)).open(Path(src), **options)
    from .hub import card_metadata, parse_hub_spec

    local = local_path(src)
    source = get_format(fmt or detect(local)).open(local, **options)
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
