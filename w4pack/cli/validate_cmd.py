"""w4pack validate: is this folder a complete, uncorrupted w4pack checkpoint?"""
from __future__ import annotations

from pathlib import Path

import click

from ..store.checkpoint import validate_checkpoint
from . import emit_json, plural, require_packed


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option("--no-checksums", is_flag=True, help="Skip the size and sha256 of every covered file: shards, config, index, side files.")
@click.option("--deep", is_flag=True, help="Also unpack every layer and check code ranges and permutations.")
def validate(path: Path, as_json: bool, no_checksums: bool, deep: bool) -> None:
    """Check PATH against the schema, its index, shard headers, shapes and checksums.

    Also: the folder holds only files the manifest lists, the fused table is consistent, and the layers are
    the ones config.json's architecture needs. Exits 0 when valid (warnings, e.g. an older manifest, on
    stderr); 2 with one line naming the file and tensor when not.
    """
    require_packed(path, "validate")
    report = validate_checkpoint(path, checksums=not no_checksums, deep=deep)
    for line in report["warnings"]:  # an older manifest, an architecture w4pack cannot check: still valid
        click.echo(f"warning: {path}: {line}", err=True)
    if as_json:
        emit_json({"valid": True, **report})
    else:
        click.echo(f"{path}: valid w4pack checkpoint ({plural(report['num_layers'], 'quantized layer')}, "
                   f"{plural(len(report['shards']), 'shard')}; checked {', '.join(report['checks'])})")
