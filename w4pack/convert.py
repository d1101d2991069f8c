"""convert: any supported source → w4pack (or another format), streaming, atomic, with a plan for --dry-run."""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

from .store.checkpoint import config_problem, parse_size
from .errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNSUPPORTED, BadInputError, W4PackError, W4PackWarning
from .formats import get_format
from .formats import embeddings
from .sources import open_source, source_format as _source_format
from .formats.base import Format, Source
from .formats._incomplete import missing_member
from .store.folder import read_side_json
from .store.sizes import tensor_bytes
from .store.names import is_side_file
from .core.arch import architecture_problem, tensor_problem
from .core.layout import group_structure

__all__ = ["convert", "plan", "source_problems"]


#: the smallest --max-shard-size: a shard holds at least its header and one tensor (CheckpointWriter, GPTQ)
MIN_SHARD_SIZE = 1024


def _check_request(src: str | Path, dst: str | Path | None, *, src_format: str | None, to: str, force: bool,
                   max_shard_size: int | str, options: dict[str, Any]) -> list[str]:
    """The checks a conversion makes before it reads a layer, shared by convert and plan (--dry-run) so that a dry
    run refuses what the real run refuses. Pops ``fuse`` from ``options``; returns the fusion kinds."""
    from .fuse import parse_fuse

    base = options.get("base")
    target = get_format(to)
    if dst is not None:
        _refuse_overlap(src, dst, force)
        if base is not None:
            _refuse_overlap(base, dst, force, "base model")
        _refuse_unwritable_path(Path(dst), target)
    size = parse_size(max_shard_size, "--max-shard-size")  # a bad size is a usage error before anything is read
    from .native.cpu import threads_from_env

    threads_from_env()  # (the packers' thread count: a bad $W4PACK_THREADS is refused here, not at the first layer)
    if not target.single_file and size < MIN_SHARD_SIZE:  # one output file (GGUF): the size does not apply
        raise BadInputError(f"--max-shard-size {max_shard_size!r} is below the minimum, {MIN_SHARD_SIZE} bytes "
                            "(1KiB)")
    fuse = parse_fuse(options.pop("fuse", None))
    if fuse and not target.stores_fused:
        raise BadInputError(f"--fuse applies to w4pack output only, not {to}: drop --fuse, or convert with "
                            "--to w4pack")
    if base is not None:
        fmt = _source_format(src, src_format)
        if not get_format(fmt).takes_base:
            raise BadInputError(f"--base is only for TOML quant-table sources (their codes are rebuilt from the base "
                                f"weights), and this is a {fmt} checkpoint: drop --base", file=str(src))
    return fuse


def plan(src: str | Path, dst: str | Path | None = None, *, src_format: str | None = None, to: str = "w4pack",
         force: bool = False, max_shard_size: int | str = "2GB", source_options: dict[str, Any] | None = None,
         **options: Any) -> dict[str, Any]:
    """What convert would do, without writing: layers (after --fuse), their kinds, pass-through tensors, side files,
    and the problems the real run would stop at with the exit code it would give (``exit_code``: that of the first
    problem, 0 when none). Usage mistakes raise exactly as convert raises them; with ``dst``, an existing DST
    without ``force`` is an ``output_problems`` entry (the real run refuses it)."""
    from .store.atomic import check_output
    from .fuse import FusedSource, for_target as unfused_for

    options = dict(options)
    float_embeddings = bool(options.pop("float_embeddings", False))
    fuse = _check_request(src, dst, src_format=src_format, to=to, force=force, max_shard_size=max_shard_size,
                          options=options)
    read_opts = {k: v for k, v in options.items() if k in ("base",)}
    read_opts.update(source_options or {})
    target = get_format(to)
    _refuse_writer_options(target, options)
    before: list[tuple[str, int]] = []  # convert's own checks, then the output, then the layers (the run's order)
    output: list[tuple[str, int]] = []
    after: list[tuple[str, int]] = []
    exists = dst is not None and os.path.lexists(dst)
    if dst is not None:
        try:
            check_output(Path(dst), force, target.file_magic)
        except W4PackError as exc:
            output.append((f"{exc.one_line()} (the real run refuses it)", exc.exit_code))
    with open_source(src, src_format, **read_opts) as source:
        n_source = len(source.layer_names())
        fusing = FusedSource(source, fuse) if fuse else None
        source = unfused_for(embeddings.for_target(fusing or source, target, keep_packed=not float_embeddings),
                             target)
        names = source.layer_names()
        before.extend((exc.one_line(), exc.exit_code) for exc in source_problems(target, source, str(src)))
        own_check = target.own_layer_checks
        layers: list[dict[str, Any]] = []

        def describe(name: str, layer: Any) -> None:
            """List a layer read, and what the real run would refuse about it."""
            layers.append({"name": name, "shape": [layer.out_features, layer.in_features], "bits": layer.bits,
                           "group_size": layer.group_size, "zero_mode": layer.zero_mode,
                           "act_order": bool(layer.act_order), "scale_dtype": layer.scale_dtype})
            reason = None if own_check else target.capabilities.check(layer)
            if reason:
                after.append((f"{name}: {to} cannot express {reason}", EXIT_UNSUPPORTED))
            elif target.name == "w4pack":
                try:  # what packing refuses (a group size, g_idx that are not permuted groups), as the writer would
                    group_structure(layer)
                except W4PackError as exc:
                    after.append((f"{name}: {exc.message}", exc.exit_code))

        unfused: set[str] = set()  # planned fusions that would not be made (parts that cannot be fused or read)
        complete = True  # every layer read: the architecture check below needs them all
        for name in names:
            try:
                layer = source.read_layer(name)
            except W4PackError as exc:  # e.g. parts that cannot be fused: the real run stops at this layer
                where = ", ".join(w for w in (exc.file, exc.tensor and f"tensor {exc.tensor}") if w)
                after.append((f"{name}: {exc.message}" + (f" ({where})" if where else ""), exc.exit_code))
                complete = False
                if fusing is not None and name in fusing.plan:
                    # the group stays its parts: listed (and checked) unfused, not dropped from the listing and
                    # the counts; a part that cannot be read is the error above (the real run stops at it)
                    unfused.add(name)
                    for part in fusing.plan[name]:
                        try:
                            describe(part, fusing.inner.read_layer(part))
                        except W4PackError:
                            pass
                continue
            describe(name, layer)
        if own_check:
            after.extend((p, EXIT_UNSUPPORTED) for p in target.check_writable(source))
        if not target.single_file:  # the writers copy the side files, refusing a JSON one that is not an object
            for side in source.side_files():
                if is_side_file(side.name) and side.name.endswith(".json"):
                    try:
                        read_side_json(side)
                    except W4PackError as exc:
                        after.append((exc.one_line(), exc.exit_code))
        if target.name == "w4pack" and complete:
            # the writer's last check (CheckpointWriter: what validate would refuse is not written)
            emb = set(source.embedding_names())
            metas = {m["name"]: {"shape": m["shape"], "role": "embedding" if m["name"] in emb else "linear"}
                     for m in layers}
            found = architecture_problem(source.config or {}, metas, source.fused_layers(),
                                         set(source.passthrough_names()), lambda t: cheap_shape(source, t))
            text = found and BadInputError(found[1], file=str(src), tensor=found[0]).one_line()
            if text and all(text != t for t, _ in before):
                after.append((text, EXIT_BAD_INPUT))
        problems = before + output + after
        return {
            "source": str(src),
            "source_format": source.info.get("format"),
            "source_info": source.info,
            "target_format": to,
            "destination": None if dst is None else str(dst),
            "destination_exists": exists,
            "force": force,
            "max_shard_size": None if target.single_file else parse_size(max_shard_size, "--max-shard-size"),
            "layers": layers,
            "source_layers": n_source,
            "fused": {k: v for k, v in fusing.plan.items() if k not in unfused} if fusing is not None else {},
            "passthrough": source.passthrough_names(),
            "side_files": [p.name for p in source.side_files()],
            "problems": [text for text, _ in before + after],  # what stops the conversion itself
            "output_problems": [text for text, _ in output],  # what stops writing DST (it exists, no --force)
            "exit_code": problems[0][1] if problems else EXIT_OK,
        }


def source_problems(target: type[Format], source: Source, label: str) -> list[W4PackError]:
    """What stops convert before anything is written, in the order it reports them: a quantized layer missing a
    tensor or holding its qweight under another name (its other tensors left as pass-through), the target's own
    objections, then a tensor config.json's architecture needs besides its linears (an embedding, a norm) that the
    source lacks: the output would load with that tensor at its initial value, and validate refuses such a packed
    folder. ``verify --against`` asks too, so it refuses a source as convert would."""
    problems: list[W4PackError] = []
    bad_config = config_problem(source.config or {})  # every writer copies config.json; the packed reader refuses it
    if bad_config:
        # (a GGUF file's config is made from its metadata: llama.block_count is num_hidden_layers)
        where = "the config its metadata gives" if Path(label).suffix.lower() == ".gguf" else "config.json"
        problems.append(BadInputError(f"{where}: {bad_config}", file=label))
    orphan = missing_member(source.passthrough_names(), source.tensor_info)
    if orphan:  # a layer that lost its qweight: its other tensors would be carried as floats, the layer dropped
        problems.append(BadInputError(orphan[1], file=label))
    problems.extend(target.source_problems(source, label))
    embedded = "model.embed_tokens" in source.embedding_names()
    found = tensor_problem(source.config or {}, set(source.passthrough_names()),
                           lambda t: cheap_shape(source, t), embedded)
    if found:
        problems.append(BadInputError(found[1], file=label, tensor=found[0]))
    return problems


def cheap_shape(source: Source, name: str) -> tuple[int, ...] | None:
    """A pass-through tensor's shape when it costs no more than reading a norm: from where its bytes lie, else by
    reading a 1-D tensor (norm weights are small); None for a large tensor the writer will read anyway."""
    shape = source.tensor_shape(name)
    if shape is not None:
        return shape
    parts = name.split(".")
    if len(parts) > 1 and "norm" in parts[-2]:
        return tuple(source.read_tensor(name).array.shape)
    return None


def _refuse_writer_options(target: type[Format], options: dict[str, Any]) -> None:
    """A writer that declares its options (the w4pack writer takes none) refuses any other: a mistake (a reader
    option belongs in source_options), refused rather than dropped."""
    if target.write_options is None:
        return
    extra = sorted(k for k in options if k != "base" and k not in target.write_options)
    if extra:
        takes = ", ".join(sorted(target.write_options)) or "none"
        raise BadInputError(f"the {target.name} writer takes no option {', '.join(extra)} (it takes: {takes}); "
                            "options for the reader go in source_options=")


def _refuse_unwritable_path(dst: Path, target: type[Format]) -> None:
    """Refuse, as a bad argument (exit 2) before anything is read, an output path that can never be written: an
    existing folder where the target is one file (--force would not help: the writer refuses to replace a folder
    with a file), or a path below a file (``notes.txt/out``: no folder can be made there). Left to the writer,
    these were "output already exists; replace it with --force" and "cannot create a folder next to the
    output: File exists" (exit 4)."""
    if target.single_file and dst.is_dir():
        raise BadInputError(f"is an existing folder, and {target.name.upper()} output is a single file: give a file "
                            f"path (e.g. {dst / ('model.' + target.name)}), not a folder", file=str(dst))
    from .store.atomic import refuse_path_below_file

    refuse_path_below_file(dst)


def _refuse_overlap(src: str | Path, dst: str | Path, force: bool, what: str = "source") -> None:
    """Refuse an output that is the source or holds it: with --force the source would be deleted when the output is
    moved into place. An output folder inside the source folder is fine, new or (with --force) replaced: readers
    take only the plain files of a folder's top level, never a subfolder. An existing file inside it is refused
    with --force, since it may be one the source is read from."""
    if str(src).startswith("hf:/") or not os.path.lexists(src):
        return  # a Hub source is downloaded to a cache; a missing source is reported by open_source
    s, d = Path(src).resolve(), Path(dst).resolve()
    same = d == s or (d.exists() and os.path.samefile(d, s))
    if same or s.is_relative_to(d):
        raise BadInputError(f"the output {'is' if same else 'contains'} the {what} {str(src)!r}: converting would "
                            f"replace it; choose another output", file=str(dst))
    if force and d.is_relative_to(s) and os.path.lexists(dst) and not Path(dst).is_dir():
        raise BadInputError(f"the output lies inside the {what} folder {str(src)!r} and exists: --force would replace "
                            "part of the source; choose another output", file=str(dst))


class GrowthWarning(W4PackWarning):
    """A conversion wrote markedly more bytes than the source holds (tensors carried unquantized, wider scales)."""


#: growth worth a warning: more than this share of the source's tensor bytes... Lossless repacks grow a little
#: for layout alone (a zero point stored for a symmetric source, g_idx, per-channel copies of a per-tensor scale):
#: at most about 3% on a real model (a GGUF Q8_0 or Q4_0 into GPTQ: one stored zero per 34 or 18 bytes), so 5%
#: leaves them quiet; what the warning is for is far above it (a float32 scale in place of a float16 one per 32
#: 4-bit weights +11%, the runtime form of K-quants +37% or more, a dequantized tensor x4 or x8 its packed size).
GROWTH_SHARE = 0.05
#: ...and more than this many bytes: on test-size tensors the same layout overheads reach 8% (a few KB)
GROWTH_MIN_BYTES = 64 << 10


def growth_is_notable(src_bytes: int, out_bytes: int) -> bool:
    """Whether an output's tensor bytes grew enough over the source's to warn about (GROWTH_SHARE and
    GROWTH_MIN_BYTES, both exceeded): growth from layout alone is expected and says nothing."""
    grown = out_bytes - src_bytes
    return grown > GROWTH_MIN_BYTES and grown > GROWTH_SHARE * src_bytes


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 10_000_000 else f"{n / 1e6:.3f} MB"


@contextlib.contextmanager
def _notices() -> Iterator[list[str]]:
    """The text of each w4pack warning issued inside (once each, in order): ``convert``'s summary carries them
    for scripts, which see no stderr. Every warning caught is issued again on the way out, as if not caught."""
    texts: list[str] = []
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", W4PackWarning)
            yield texts
    finally:  # (also when the conversion fails: what was said before the error still counts)
        for w in caught:
            if issubclass(w.category, W4PackWarning):  # ("always" caught each repeat: said once, as before)
                if str(w.message) in texts:
                    continue
                texts.append(str(w.message))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def convert(src: str | Path, dst: str | Path, *, src_format: str | None = None, to: str = "w4pack",
            force: bool = False, show_progress: bool | None = None, max_shard_size: int | str = "2GB",
            source_options: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """Convert ``src`` into ``dst`` in format ``to``; returns a summary (layers, bytes, seconds).

    ``options`` go to the writer of ``to`` (``version`` for AWQ, ``variant`` for TOML, ...), except ``base``,
    ``fuse`` and ``float_embeddings`` (True: a quantized token embedding is dequantized exactly to float32
    instead of kept packed, for loaders that take no packed embedding, e.g. vLLM); ``source_options`` go to the reader (``v1_zeros="carry"`` for GPTQ v1, ...). An option the
    w4pack writer does not take is refused rather than dropped.

    Example::

        from w4pack.convert import convert
        convert("llama-gptq/", "llama-w4/")
        convert("llama-gptq-v1/", "llama-w4/", source_options={"v1_zeros": "carry"})
    """
    t0 = time.perf_counter()
    from .fuse import FusedSource, for_target as unfused_for
    from .progress import step

    options = dict(options)
    float_embeddings = bool(options.pop("float_embeddings", False))
    fuse = _check_request(src, dst, src_format=src_format, to=to, force=force, max_shard_size=max_shard_size,
                          options=options)
    read_opts = {k: v for k, v in options.items() if k in ("base",)}
    read_opts.update(source_options or {})
    write_opts = {k: v for k, v in options.items() if k not in ("base",)}
    target = get_format(to)
    _refuse_writer_options(target, options)
    with _notices() as notices:  # the readers' and writers' warnings, for the summary as well
        with step(f"reading {src}", False if str(src).startswith("hf:") else show_progress):
            source = open_source(src, src_format, **read_opts)
        with source:
            if fuse:
                source = FusedSource(source, fuse)
            source = unfused_for(embeddings.for_target(source, target, keep_packed=not float_embeddings), target)
            problems = source_problems(target, source, str(src))  # before anything is written, not at the end
            if problems:
                raise problems[0]
            if force or not os.path.lexists(dst):
                # side files are built once per source (a GGUF's tokenizer export takes seconds): announced here
                # rather than left as a silent tail after the writer's progress bar
                with step("preparing side files (config, tokenizer)", show_progress):
                    source.side_files()
            out = target.write(source, Path(dst), force=force, max_shard_size=max_shard_size,
                               show_progress=show_progress, **write_opts)
            n_layers = len(source.layer_names())
            fused = source.fused_layers()
            n_pass = len(source.passthrough_names())
            info = dict(source.info)
    out_path = Path(out)  # a folder, or one file for single-file formats (GGUF)
    size = out_path.stat().st_size if out_path.is_file() else \
        sum(p.stat().st_size for p in out_path.iterdir() if p.is_file())
    seconds = time.perf_counter() - t0
    result = {"source": str(src), "source_format": info.get("format"), "output": str(out), "format": to,
              "layers": n_layers, "passthrough": n_pass, "bytes": size, "seconds": round(seconds, 3),
              "notes": info.get("notes", [])}
    src_size = tensor_bytes(src)
    base = read_opts.get("base")
    if src_size is not None and base is not None:  # TOML tables: the codes come from the base weights
        src_size += tensor_bytes(base) or 0
    out_size = tensor_bytes(out_path)
    if src_size and out_size is not None:
        result["source_tensor_bytes"], result["tensor_bytes"] = src_size, out_size
        if growth_is_notable(src_size, out_size):  # (so the ratio below reads x1.05 or more, never x1.00)
            msg = (f"{out}: the output's tensors ({_mb(out_size)}) are larger than those of the source {src} "
                   f"({_mb(src_size)}, x{out_size / max(src_size, 1):.2f}); see the notes for tensors "
                   "carried unquantized or widened")
            notices.append(msg)
            warnings.warn(msg, GrowthWarning, stacklevel=2)
    if notices:
        result["warnings"] = notices
    if fuse:
        result["fused"] = fused
    return result
