"""w4pack convert: any supported source → w4pack (default) or another format."""
from __future__ import annotations

from pathlib import Path

import click

from . import check_format_name, detect_source, emit_json


@click.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--from", "src_format", default=None, help="Source format (default: detected).")
@click.option("--to", "to", default="w4pack", show_default=True,
              help="Target format: w4pack, gptq, gptq-v2, awq, toml, compressed-tensors, gguf.")
@click.option("--base", type=click.Path(path_type=Path), default=None,
              help="fp16/bf16/fp32 base model folder (needed by TOML+NumPy quant tables).")
@click.option("--max-shard-size", default="2GB", show_default=True, help="Largest shard, e.g. 2GB, 500MB.")
@click.option("--fuse", "fuse", default=None, metavar="KINDS",
              help="Fuse projections into one packed layer: qkv, gate-up or qkv,gate-up (w4pack output).")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--dry-run", is_flag=True, help="Print what would be converted; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def convert(src: Path, dst: Path, src_format: str | None, to: str, base: Path | None, max_shard_size: str,
            fuse: str | None, force: bool, dry_run: bool, as_json: bool) -> None:
    """Convert the checkpoint SRC into DST, losslessly.

    Streams layer by layer; DST appears only when complete and is never replaced without --force.
    """
    from ..convert import convert as do_convert, plan

    check_format_name(src_format, "--from")
    check_format_name(to, "--to")
    src_format = src_format or detect_source(src)
    opts = {"base": base} if base is not None else {}
    if dry_run:
        doc = plan(src, src_format=src_format, to=to, **opts)
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"{src} ({doc['source_format']}) -> {dst} ({to}): {len(doc['layers'])} quantized layers, "
                       f"{len(doc['passthrough'])} pass-through tensors, side files: "
                       f"{', '.join(doc['side_files']) or 'none'}")
            for p in doc["problems"]:
                click.echo(f"  cannot convert: {p}")
            for note in doc["source_info"].get("notes", []):
                click.echo(f"  note: {note}")
        return
    if fuse:
        opts["fuse"] = fuse
    result = do_convert(src, dst, src_format=src_format, to=to, force=force, max_shard_size=max_shard_size, **opts)
    if as_json:
        emit_json(result)
    else:
        click.echo(f"converted {result['layers']} layers ({result['source_format']} -> {to}), "
                   f"{result['passthrough']} pass-through tensors, {result['bytes'] / 1e6:.1f} MB in "
                   f"{result['seconds']:.2f}s -> {result['output']}")
