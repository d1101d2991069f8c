"""convert: any supported source → w4pack (or another format), streaming, atomic, with a plan for --dry-run."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .errors import BadInputError, UnsupportedError
from .formats import get_format, open_source

__all__ = ["convert", "plan"]


def plan(src: str | Path, *, src_format: str | None = None, to: str = "w4pack", **options: Any) -> dict[str, Any]:
    """What convert would do, without writing: layers, their kinds, pass-through tensors, side files."""
    with open_source(src, src_format, **options) as source:
        layers = []
        target = get_format(to)
        problems = []
        for name in source.layer_names():
            layer = source.read_layer(name)
            layers.append({"name": name, "shape": [layer.out_features, layer.in_features], "bits": layer.bits,
                           "group_size": layer.group_size, "zero_mode": layer.zero_mode,
                           "act_order": bool(layer.act_order), "scale_dtype": layer.scale_dtype})
            reason = target.capabilities.check(layer)
            if reason:
                problems.append(f"{name}: {to} cannot express {reason}")
        return {
            "source": str(src),
            "source_format": source.info.get("format"),
            "source_info": source.info,
            "target_format": to,
            "layers": layers,
            "passthrough": source.passthrough_names(),
            "side_files": [p.name for p in source.side_files()],
            "problems": problems,
        }


def _refuse_overlap(src: str | Path, dst: str | Path, force: bool, what: str = "source") -> None:
    """Refuse an output that is the source or holds it: with --force the source would be deleted when the output is
    moved into place. A new output folder inside the source folder is fine (nothing of the source is touched); an
    existing path inside it is refused with --force, which would replace part of the source."""
    if str(src).startswith("hf:/") or not os.path.lexists(src):
        return  # a Hub source is downloaded to a cache; a missing source is reported by open_source
    s, d = Path(src).resolve(), Path(dst).resolve()
    same = d == s or (d.exists() and os.path.samefile(d, s))
    if same or s.is_relative_to(d):
        raise BadInputError(f"the output {'is' if same else 'contains'} the {what} {str(src)!r}: converting would "
                            f"replace it; choose another output", file=str(dst))
    if force and d.is_relative_to(s) and os.path.lexists(dst):
        raise BadInputError(f"the output lies inside the {what} folder {str(src)!r} and exists: --force would replace "
                            "part of the source; choose another output", file=str(dst))


def convert(src: str | Path, dst: str | Path, *, src_format: str | None = None, to: str = "w4pack",
            force: bool = False, show_progress: bool | None = None, max_shard_size: int | str = "2GB",
            **options: Any) -> dict[str, Any]:
    """Convert ``src`` into ``dst`` in format ``to``; returns a summary (layers, bytes, seconds).

    Example::

        w4pack.convert("llama-gptq/", "llama-w4/")
    """
    t0 = time.perf_counter()
    from .checkpoint import check_layer_name, parse_size
    from .fuse import FusedSource, parse_fuse

    _refuse_overlap(src, dst, force)
    if options.get("base") is not None:
        _refuse_overlap(options["base"], dst, force, "base model")
    parse_size(max_shard_size, "--max-shard-size")  # a bad size is a usage error before anything is read
    fuse = parse_fuse(options.pop("fuse", None))
    if fuse and to != "w4pack":
        raise UnsupportedError(f"--fuse applies to w4pack output only, not {to}")
    read_opts = {k: v for k, v in options.items() if k in ("base",)}
    write_opts = {k: v for k, v in options.items() if k not in ("base",)}
    with open_source(src, src_format, **read_opts) as source:
        if fuse:
            source = FusedSource(source, fuse)
        target = get_format(to)
        if not source.layer_names() and to == "w4pack":
            raise UnsupportedError("the source holds no quantized layers", file=str(src))
        if to == "w4pack":
            for name in source.layer_names():  # before anything is written, not at the end (the writer checks too)
                check_layer_name(name, str(src))
            out = target.write(source, Path(dst), force=force, max_shard_size=max_shard_size,
                               show_progress=show_progress)
        else:
            out = target.write(source, Path(dst), force=force, max_shard_size=max_shard_size,
                               show_progress=show_progress, **write_opts)
        n_layers = len(source.layer_names())
        fused = dict(getattr(source, "fused", {}) or {})
        n_pass = len(source.passthrough_names())
        info = dict(source.info)
    out_path = Path(out)  # a folder, or one file for single-file formats (GGUF)
    size = out_path.stat().st_size if out_path.is_file() else \
        sum(p.stat().st_size for p in out_path.iterdir() if p.is_file())
    seconds = time.perf_counter() - t0
    result = {"source": str(src), "source_format": info.get("format"), "output": str(out), "format": to,
              "layers": n_layers, "passthrough": n_pass, "bytes": size, "seconds": round(seconds, 3),
              "notes": info.get("notes", [])}
    if fuse:
        result["fused"] = fused
    return result
