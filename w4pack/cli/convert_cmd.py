"""w4pack convert: any supported source → w4pack (default) or another format."""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import click

from ..convert import MIN_SHARD_SIZE
from ..errors import BadInputError, W4PackWarning
from . import FORMAT_NAMES, SourcePath, check_format_name, detect_source, emit_json, plural, say_plan_error, settle
from .extras import needs_extras


@click.command()
@click.argument("src", type=SourcePath(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--from", "src_format", default=None, metavar="FMT",
              help=f"Source format when detection cannot tell: {FORMAT_NAMES} (default: detected).")
@click.option("--to", "to", default=None, metavar="FMT",
              help=f"Target format: {FORMAT_NAMES} (default: w4pack). With gguf, DST is one file (e.g. model.gguf), "
                   "not a folder.")
@click.option("--base", type=click.Path(path_type=Path), default=None,
              help="fp16/bf16/fp32 base model (folder or .safetensors): only for TOML+NumPy quant-table "
                   "sources, whose codes are rebuilt from it.")
@click.option("--max-shard-size", default="2GB", show_default=True,
              help=f"Largest shard: plain bytes or a size in KB/MB/GB (powers of 1000) or KiB/MiB/GiB (powers of "
                   f"1024), e.g. 500MB, 1.5GiB; at least {MIN_SHARD_SIZE} bytes. Ignored for --to gguf (one file).")
@click.option("--fuse", "fuse", default=None, metavar="KINDS",
              help="Fuse projections into one packed layer: qkv, gate-up or qkv,gate-up (w4pack output only).")
@click.option("--float-embeddings", is_flag=True,
              help="Dequantize a quantized token embedding exactly to float32 instead of keeping it packed (for "
                   "loaders that read only float embeddings; the folder grows by the table's float size).")
@click.option("--expanded", is_flag=True,
              help="w4pack output only: store every layer in the runtime form (float32 scales, codes in their 4/8-bit "
                   "fields) instead of the compact form kept for GGUF K-quant, 5-bit and IQ4 layers (docs/LAYOUT.md "
                   "section 8); the folder grows, loading skips the expansion.")
@click.option("--force", is_flag=True,
              help="Replace DST if it is an earlier output: a checkpoint folder (with --to gguf, a GGUF file); "
                   "never other files or folders.")
@click.option("--dry-run", is_flag=True,
              help="Print what would be converted (layers after --fuse) and every problem the real run would stop "
                   "at; write nothing. Exits with the code the real run would give.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@needs_extras("convert")
def convert(src: Path, dst: Path, src_format: str | None, to: str | None, base: Path | None, max_shard_size: str,
            fuse: str | None, float_embeddings: bool, expanded: bool, force: bool, dry_run: bool, as_json: bool) -> int:
    """Convert the checkpoint SRC into DST, losslessly.

    SRC is a folder or file in any supported format (detected; --from names it) or hf://owner/name[@rev][/file].
    Streams layer by layer; DST appears only when complete and is never replaced without --force. A layer the
    target cannot hold exactly stops the conversion before anything is written.

    \b
    Examples:
      w4pack convert ./llama-gptq ./llama-w4              GPTQ (or AWQ, ...) folder -> packed w4pack folder
      w4pack convert model.Q4_0.gguf ./model-w4           a GGUF file -> packed folder (tokenizer exported)
      w4pack convert ./llama-w4 ./llama-ct --to compressed-tensors
      w4pack convert ./llama-w4 out.gguf --to gguf        one GGUF file
      w4pack convert ./llama-gptq ./llama-w4 --dry-run    what would be written, and what would stop it

    Exit 0 ok, 2 bad input or usage (one line naming the file and tensor), 3 unsupported input (a layer the
    target cannot hold, a source no reader recognises; the line says a way out), 4 I/O failure or DST exists without
    --force, 130 interrupted.
    """
    from ..convert import convert as do_convert, plan

    src_format = check_format_name(src_format, "--from")
    to = check_format_name(to, "--to") or _default_target(dst)
    if expanded and to != "w4pack":  # (the Python API lets other writers ignore it; the flag is w4pack's alone)
        raise BadInputError(f"--expanded applies to w4pack output only, not {to}: drop --expanded, or convert with "
                            "--to w4pack")
    src_format = src_format or detect_source(src)
    opts: dict[str, Any] = {"base": base} if base is not None else {}
    if fuse:
        opts["fuse"] = fuse
    if float_embeddings:
        opts["float_embeddings"] = True
    if expanded:
        opts["expanded"] = True
    if dry_run:
        doc = plan(src, dst, src_format=src_format, to=to, force=force, max_shard_size=max_shard_size, **opts)
        if as_json:
            emit_json(doc)
        else:
            _print_plan(src, dst, to, doc)
        say_plan_error(src, doc, "in the JSON's problems" if as_json else "listed above")
        return int(doc["exit_code"])
    before = _identity(dst)
    held: list[warnings.WarningMessage] = []
    try:
        try:
            with warnings.catch_warnings(record=True) as held:  # w4pack's: said below from the summary's "warnings"
                result = do_convert(src, dst, src_format=src_format, to=to, force=force,
                                    max_shard_size=max_shard_size, **opts)
        except BaseException:  # no summary: what w4pack said before the error goes out before it
            for msg in dict.fromkeys(str(w.message) for w in held if issubclass(w.category, W4PackWarning)):
                click.echo(f"warning: {msg}", err=True)
            raise
        finally:  # the others as if not held (shown under W4PACK_DEBUG=1, dropped otherwise)
            for w in held:
                if not issubclass(w.category, W4PackWarning):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    except KeyboardInterrupt:
        if not _committed(dst, before):
            raise
        settle()  # Ctrl-C after the output was moved into place (while the summary was computed): a success
        _say_done_without_summary(src, dst, src_format, to, as_json)
        return 0
    settle()  # the output is in place: a Ctrl-C from here on cannot make this run "interrupted"
    for msg in result.get("warnings", []):
        click.echo(f"warning: {msg}", err=True)
    if as_json:
        emit_json(result)
    else:
        click.echo(f"converted {plural(result['layers'], 'layer')} ({result['source_format']} -> {to}), "
                   f"{result['passthrough']} pass-through tensors, {result['bytes'] / 1e6:.1f} MB in "
                   f"{result['seconds']:.2f}s -> {result['output']}")
    return 0


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path`` itself, None when there is nothing there."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _committed(dst: Path, before: tuple[int, int] | None) -> bool:
    """Whether this run's output was moved into place: writers finish in a temporary sibling renamed to DST (an
    exchange with --force), so DST then is another file or folder than before the run. A rename interrupted
    before it happened, or undone, leaves DST as it was (or absent)."""
    now = _identity(dst)
    return now is not None and now != before


def _say_done_without_summary(src: Path, dst: Path, src_format: str | None, to: str, as_json: bool) -> None:
    """The outcome of a conversion whose complete output was in place when Ctrl-C came, before the summary (sizes,
    time) was computed: success, with what is known."""
    if as_json:
        emit_json({"source": str(src), "source_format": src_format, "output": str(dst.absolute()), "format": to,
                   "summary": None, "note": "interrupted after the output was complete; no summary computed"})
    else:
        click.echo(f"converted {src} ({src_format or 'detected'} -> {to}) -> {dst.absolute()} (Ctrl-C came after "
                   "the output was complete; no summary computed)")


def _default_target(dst: Path) -> str:
    """w4pack, the default target, writes a folder: a DST named like a GGUF file without --to gguf is almost
    certainly a missing --to, and a folder called model.gguf is not what was asked for (exit 2, nothing written)."""
    if dst.suffix.lower() == ".gguf":
        raise BadInputError(f"{dst} is named like a GGUF file, but the default output is a w4pack folder: add --to "
                            "gguf for a GGUF file, or --to w4pack for a folder of that name")
    return "w4pack"


def _print_plan(src: Path, dst: Path, to: str, doc: dict[str, Any]) -> None:
    """The dry run as text: what the real run would write, then what would stop it."""
    fused = doc["fused"]
    of_source = (f" ({doc['source_layers']} in the source, {sum(len(p) for p in fused.values())} of them fused "
                 f"into {len(fused)})" if fused else "")
    counts = (f"{plural(len(doc['layers']), 'quantized layer')}{of_source}, "
              f"{plural(len(doc['passthrough']), 'pass-through tensor')}")
    click.echo(f"{src} ({doc['source_format']}) -> {dst} ({to}): {counts}, side files: "
               f"{', '.join(doc['side_files']) or 'none'}")
    for note in doc["source_info"].get("notes", []):
        click.echo(f"  note: {note}")
    if doc["destination_exists"] and doc["force"] and not doc["output_problems"]:
        click.echo(f"  note: {dst} exists; --force replaces it")
    for line in group_problems(doc["problems"]):
        click.echo(f"  cannot convert: {line}")
    for p in doc["output_problems"]:
        click.echo(f"  cannot write: {p}")
    if doc["exit_code"]:
        click.echo(f"dry run: the conversion would fail (exit {doc['exit_code']}); nothing was written")
    else:
        click.echo("dry run: the conversion would succeed; nothing was written")


#: "model.layers.3.mlp.up_proj: reason": a problem about one layer (the formats' and convert's own wording)
_LAYER_PROBLEM = re.compile(r"^([A-Za-z_][\w.]*): (.+)$", re.S)


def group_problems(problems: list[str], examples: int = 3) -> list[str]:
    """One line per distinct reason: a refusal that holds for 210 layers is one line with the count and a few
    layer names, not 210 lines. Problems not about a layer are kept as they are, in order."""
    order: list[str] = []
    layers: dict[str, list[str]] = {}
    for p in problems:
        m = _LAYER_PROBLEM.match(p)
        key = m.group(2) if m else p
        if key not in layers:
            order.append(key)
            layers[key] = []
        if m:
            layers[key].append(m.group(1))
    out = []
    for reason in order:
        names = layers[reason]
        if not names:
            out.append(reason)
        elif len(names) == 1:
            out.append(f"{names[0]}: {reason}")
        else:
            shown = ", ".join(names[:examples]) + (f" and {len(names) - examples} more" if len(names) > examples
                                                   else "")
            out.append(f"{len(names)} layers ({shown}): {reason}")
    return out
