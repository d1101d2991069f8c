"""w4pack verify: structure, bit-exactness against the source, GEMM numerics, quantization error."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import EXIT_OK, EXIT_VERIFY, BadInputError
from ..verify import CUDA_TOLERANCE, FAST_FLOAT_BOUND, TOLERANCE
from . import FORMAT_NAMES, check_format_name, detect_source, emit_json, require_packed
from .extras import needs_extras


@click.command()
@click.argument("packed", type=click.Path(path_type=Path))
@click.option("--against", "against", default=None, metavar="SRC",
              help="Source checkpoint (any supported format; a path or hf://owner/name[@rev][/file], as convert "
                   "takes): every layer must unpack to the same bits, a fused layer part by part; pass-through "
                   "tensors, config.json, the generation config and the tokenizer files must equal the source's.")
@click.option("--from", "src_format", default=None, metavar="FMT",
              help=f"Format of --against when detection cannot tell: {FORMAT_NAMES}.")
@click.option("--base", type=click.Path(path_type=Path), default=None,
              help="Original fp16 model (folder or .safetensors): report each layer's quantization error. Also the "
                   "base model that a TOML quant-table --against source needs (as convert --base).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the GEMM check runs.")
@click.option("--precision", type=click.Choice(["exact", "fast"]), default="exact", show_default=True,
              help=f"exact: fp32 dequantize + fp32 accumulate, relative error <= {TOLERANCE['exact']:.0e} against "
                   f"float64. fast: activations rounded to int8 per block; <= {TOLERANCE['fast']:.0e} against a "
                   f"float64 reference on the same rounded activations, and <= {FAST_FLOAT_BOUND:.0e} against the "
                   f"unrounded float64 reference. --device cuda: {CUDA_TOLERANCE:.0e} (fp16 activations).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads (default: $W4PACK_THREADS, else all cores).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Seed of the random activations (default: a fresh one; the summary line prints it, so a failure "
                   "reruns with --seed).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Show only the N worst layers in the table (--json lists every layer).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@needs_extras("verify")
def verify(packed: Path, against: str | None, src_format: str | None, base: Path | None, device: str,
           precision: str, threads: int | None, seed: int | None, limit: int | None, as_json: bool) -> int:
    """Verify PACKED: checksums and structure, bit-exactness against --against, the native GEMM on
    random activations against a float64 reference, and with --base the quantization error.

    Prints a per-layer table (worst first) and a summary line. Exit 0 when every check passes, 1 when
    any fails (a layer differs, numerics out of tolerance, a shard's checksum), 2 for bad input or usage (a folder
    that cannot be read as a checkpoint, a bad $W4PACK_ISA or $W4PACK_THREADS: one line on stderr, as validate),
    3 when --device cuda is not available.
    """
    from ..verify import verify as run_verify

    require_packed(packed, "verify")
    src_format = check_format_name(src_format, "--from")
    if src_format is not None and against is None:
        raise BadInputError("--from names the format of --against, which is not given")
    if against is not None and src_format is None:
        src_format = detect_source(against)
    report = run_verify(packed, against=against, base=base, device=device, precision=precision,
                        threads=threads, seed=seed, src_format=src_format)
    if as_json:
        emit_json(report.to_dict())
    else:
        if report.layers:
            click.echo(report.table(limit=limit))
        for p in report.problems:
            click.echo(f"problem: {p}")
        click.echo(f"verify {packed}: {report.summary()}")
    return EXIT_OK if report.ok else EXIT_VERIFY
