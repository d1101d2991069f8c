"""w4pack inspect: what a checkpoint holds (any supported format)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from ..store.checkpoint import open_checkpoint
from ..errors import BadInputError, W4PackError
from ..formats import refuse_a_shard
from ..sources import wrong_from
from . import FORMAT_NAMES, SourcePath, check_format_name, detect_source, emit_json, plural, say_plan_error
from .extras import needs_extras


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _open_packed(path: Path, src_format: str | None) -> Any:
    """The packed checkpoint at ``path``, its structure checked. With --from w4pack on another format's checkpoint
    the refusal ("no w4pack.json") names the detected format, as every other wrong --from does (exit 2)."""
    refuse_a_shard(path)  # (--from w4pack skips detection, which says so otherwise)
    try:
        ck = open_checkpoint(path)
    except W4PackError as exc:
        wrong = wrong_from(exc, path, "w4pack") if src_format else None
        if wrong is not None:
            raise wrong from exc
        raise
    try:
        ck.check_structure()
    except BaseException:
        ck.close()
        raise
    return ck


def natural_key(name: str) -> list[Any]:
    """Sort key that orders model.layers.2 before model.layers.10 (digit runs compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def source_label(fmt: str | None, version: Any) -> str:
    """How a source format and its recorded version read: "gguf (file format version 3)", "gptq v1", "awq gemm"."""
    fmt = fmt or "unknown format"
    v = None if version is None else str(version)
    if not v or v.lower() == fmt.lower():
        return fmt
    if v.isdigit():
        return f"{fmt} (file format version {v})"
    return f"{fmt} {v}"


@click.command()
@click.argument("path", type=SourcePath(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option("--layers", "show_layers", is_flag=True, help="List every quantized layer.")
@click.option("--from", "src_format", default=None, metavar="FMT",
              help=f"Source format when detection cannot tell: {FORMAT_NAMES} (default: detected).")
@click.option("--base", type=click.Path(path_type=Path), default=None,
              help="fp16/bf16/fp32 base model folder or file (needed by TOML+NumPy quant tables, as convert --base).")
@needs_extras("inspect")
def inspect(path: Path, as_json: bool, show_layers: bool, src_format: str | None, base: Path | None) -> int:
    """Show what the checkpoint PATH holds: layout, layers by kind, shards, source.

    PATH is a w4pack checkpoint folder, or a source in any supported format (shown as convert would read it,
    with the same --from and --base).

    A source with layers that convert would stop at (unreadable, or not representable) lists each problem and
    exits as convert would.

    Exit 0 ok, 2 bad input or usage (one line naming the file and tensor), 3 unsupported input or a missing
    optional package, 4 I/O or network failure.
    """
    src_format = check_format_name(src_format, "--from")
    fmt = src_format or detect_source(path)
    if fmt == "w4pack" and base is not None:
        raise BadInputError("--base is only for TOML+NumPy quant tables; a w4pack checkpoint holds its codes")
    if fmt != "w4pack":
        from ..convert import plan

        doc = plan(path, src_format=fmt, **({"base": base} if base is not None else {}))
        if as_json:
            emit_json(doc)
            say_plan_error(path, doc)
            return int(doc["exit_code"])
        n_bad = doc["source_layers"] - len(doc["layers"])
        click.echo(f"{path}: {source_label(fmt or doc['source_format'], doc['source_info'].get('version'))} "
                   "checkpoint")
        click.echo(f"  quantized layers: {len(doc['layers'])}"
                   + (f" readable, {n_bad} not (below)" if n_bad else "")
                   + f"   pass-through tensors: {len(doc['passthrough'])}")
        layers = sorted(doc["layers"], key=lambda m: natural_key(m["name"]))
        for layer in layers if show_layers else layers[:10]:
            click.echo(f"  {layer['name']}: {layer['shape'][0]}x{layer['shape'][1]} {layer['bits']}-bit "
                       f"{_group_label(layer['group_size'])} zero={layer['zero_mode']}"
                       f"{' act-order' if layer['act_order'] else ''}")
        if not show_layers and len(layers) > 10:
            click.echo(f"  ... {len(layers) - 10} more (--layers lists all)")
        for note in doc["source_info"].get("notes", []) + doc["source_info"].get("quirks", []):
            click.echo(f"  note: {note}")
        for problem in doc["problems"]:
            click.echo(f"  problem: {problem}")
        say_plan_error(path, doc, "listed above")
        return int(doc["exit_code"])
    with _open_packed(path, src_format) as ck:
        s = ck.summary()
        if show_layers or as_json:
            s["layers"] = {n: {k: v for k, v in m.items() if k != "tensors"} for n, m in ck.manifest["layers"].items()}
        if as_json:
            emit_json({"source_format": "w4pack", **s})  # PATH's format, the key a source's document has too
            return 0
        lay = s["layout"]
        click.echo(f"{path}: w4pack checkpoint, layout {lay['name']} v{lay['version']}")
        if s["source"]:
            click.echo(f"  source: {source_label(s['source'].get('format'), s['source'].get('version'))}")
        if s["architecture"]:
            click.echo(f"  model: {s['architecture']} ({s['model_type']})")
        click.echo(f"  quantized layers: {s['num_layers']}   pass-through tensors: {s['num_passthrough']}")
        for kind in s["layer_kinds"]:
            g = _group_label(kind["group_size"], "group ")
            click.echo(f"    {kind['count']:5d} x {kind['bits']}-bit, {g}, zero {kind['zero_mode']}"
                       + (", act-order" if kind["act_order"] else ""))
        click.echo(f"  {plural(len(s['shards']), 'shard')}, {_human(s['total_size'])} "
                   f"({_human(s['quantized_bytes'])} in quantized layers)")
        compact = sum(1 for m in ck.manifest["layers"].values() if m.get("storage"))
        if compact:
            click.echo(f"  {plural(compact, 'layer')} stored compact on disk (as the source's blocks: "
                       "docs/LAYOUT.md §8), expanded exactly when read")
        if s["side_files"]:
            click.echo(f"  side files: {', '.join(s['side_files'])}")
        if show_layers:
            for n in sorted(s["layers"], key=natural_key):
                m = s["layers"][n]
                padded = (f" (padded to {m['padded_shape'][0]}x{m['padded_shape'][1]})"
                          if list(m["padded_shape"]) != list(m["shape"]) else "")
                click.echo(f"    {n}: {m['shape'][0]}x{m['shape'][1]}{padded} {m['bits']}-bit "
                           f"{_group_label(m['group_size'])} {m['zero_mode']} {m['scale_dtype']}"
                           f"{' act-order' if m['act_order'] else ''}")


def _group_label(group_size: int, prefix: str = "g") -> str:
    """"g128" (or "group 128"), and "per-channel" for -1, the manifest's value for one group per row."""
    return "per-channel" if group_size == -1 else f"{prefix}{group_size}"
