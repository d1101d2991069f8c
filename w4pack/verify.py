"""verify: prove a packed checkpoint is intact, identical to its source, and computes what it should.

Four checks, each optional beyond the first:

(a) structure  — manifest schema, config, index, shard headers and shapes, sha256 of every shard;
(b) exactness  — with ``against``: every layer unpacked equals the source's canonical layer bit for
                 bit (codes, scales, zeros, g_idx, bias), and the pass-through tensors are the same bytes;
                 a fused layer (manifest ``fused``) is compared part by part, each part against its rows;
(c) numerics   — every layer's native GEMM on fresh random activations (several M) against a float64
                 reference built from the canonical float64 dequantization; tolerance per precision;
(d) quantization error — with ``base`` (the original fp16 model): ‖W_deq − W‖ / ‖W‖ per layer.

Layers stream one at a time; the float64 reference is built in row chunks, so memory stays bounded.
"""
from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .core.arch import architecture_problem
from .core.dtypes import FLOAT_DTYPES, to_float32
from .core.layout import group_structure
from .core.canonical import CanonicalLayer
from .store.checkpoint import Checkpoint
from .core.dtypes import to_float64
from .errors import BadInputError, UnsupportedError, W4PackError
from .progress import Progress
from .store import open_tensors
from .store.names import INDEX_NAME
from .store.safetensors import SourceChanged

__all__ = ["verify", "VerifyReport", "LayerCheck", "TOLERANCE", "DEFAULT_MS"]

#: relative error ‖y − y_ref‖ / ‖y_ref‖ allowed per precision (fp32 activations and output). Measured:
#: exact ~1e-7 .. 4e-7, fast ~3e-3 .. 6e-3 (int8 activations per block; docs/CPU.md).
#: relative error allowed against the precision's own reference: float64 dequantized weights times the
#: activations (exact), or times the activations rounded to int8 per block exactly as the fast path defines
#: it (fast; see docs/CPU.md). Both are kernel-correctness bounds, not statistics.
TOLERANCE = {"exact": 1e-5, "fast": 1e-5}
#: the fast path against the unrounded float64 reference: a sanity bound (typical 0.6 %, docs/CPU.md)
FAST_FLOAT_BOUND = 5e-2
#: the CUDA kernels take fp16/bf16 activations and write fp16/bf16: activations are rounded to fp16
#: (the reference uses the rounded values) and the output rounding allows this much
CUDA_TOLERANCE = 2e-3
#: activation rows tried per layer
DEFAULT_MS = (1, 4, 17)
_ROW_CHUNK = 1024


@dataclass
class LayerCheck:
    """The outcome of every check on one layer."""

    name: str
    shape: list[int]
    kind: str
    exact: bool | None = None           # None: no --against
    gemm_error: float | None = None     # worst relative error over the M tried
    gemm_tolerance: float | None = None
    float_error: float | None = None    # fast precision: error against the unrounded float64 reference
    quant_error: float | None = None    # ‖W_deq − W‖/‖W‖ against --base
    quant_max_abs: float | None = None
    #: a fused layer with --against: one entry per part (name, rows, exact, differences)
    parts: list[dict[str, Any]] | None = None
    #: --against: the source stores the same weights in another representation (e.g. a symmetric layer as
    #: integer zero points of 2^(bits-1)): how the fields differ; the layer still counts as identical
    representation: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def severity(self) -> float:
        """Sort key, larger is worse: failures first, then GEMM error relative to its tolerance."""
        s = 0.0
        if self.problems:
            s += 1e9
        if self.gemm_error is not None and self.gemm_tolerance:
            s += self.gemm_error / self.gemm_tolerance
        return s


@dataclass
class VerifyReport:
    path: str
    against: str | None
    base: str | None
    device: str
    precision: str
    ms: list[int]
    seed: int
    structure_ok: bool = True
    structure_error: str | None = None
    checks: list[str] = field(default_factory=list)
    layers: list[LayerCheck] = field(default_factory=list)
    passthrough: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed_layers(self) -> list[LayerCheck]:
        return [c for c in self.layers if not c.ok]

    @property
    def ok(self) -> bool:
        return self.structure_ok and not self.problems and not self.failed_layers

    def sorted_layers(self) -> list[LayerCheck]:
        """Worst first: failures, then by quantization error (with --base) or GEMM error."""
        if self.base:
            return sorted(self.layers, key=lambda c: (not c.problems, -(c.quant_error or 0.0), -c.severity()))
        return sorted(self.layers, key=lambda c: -c.severity())

    def summary(self) -> str:
        n = len(self.layers)
        bad = len(self.failed_layers)
        parts = [f"{'OK' if self.ok else 'FAILED'}: {n} layer{'' if n == 1 else 's'}, {bad} failed"]
        parts.append("structure " + ("ok" if self.structure_ok else f"FAILED ({self.structure_error})"))
        parts.append(f"seed {self.seed}")  # printed so that a failure can be rerun with --seed
        if self.against:
            same = sum(1 for c in self.layers if c.exact)
            fused = [p for c in self.layers for p in (c.parts or [])]
            of_parts = (f" ({sum(1 for p in fused if p['exact'])}/{len(fused)} fused parts)" if fused else "")
            parts.append(f"{same}/{n} bit-identical{of_parts} to {self.against}")
            other = [c for c in self.layers if c.representation]
            if other:
                parts.append(f"{len(other)} of them stored differently with the same weights (first: "
                             f"{other[0].name}: {other[0].representation})")
            if self.passthrough:
                pt = self.passthrough
                parts.append(f"pass-through {pt.get('identical', 0)}/{pt.get('total', 0)} identical")
        errs = [c for c in self.layers if c.gemm_error is not None]
        if errs:
            worst = max(errs, key=lambda c: c.gemm_error)
            parts.append(f"worst {self.precision} GEMM error {worst.gemm_error:.2e} (tolerance "
                         f"{worst.gemm_tolerance:.0e}) at {worst.name}")
            fl = [c.float_error for c in self.layers if c.float_error is not None]
            if fl:
                parts.append(f"fast vs float64 worst {max(fl):.2e} (int8 activation rounding; bound "
                             f"{FAST_FLOAT_BOUND:.0e})")
        qs = [c for c in self.layers if c.quant_error is not None]
        if qs:
            worst_q = max(qs, key=lambda c: c.quant_error)
            mean_q = float(np.mean([c.quant_error for c in qs]))
            parts.append(f"quantization error mean {mean_q:.3e}, worst {worst_q.quant_error:.3e} at {worst_q.name}")
        if self.problems:  # what fails beyond the layers: counted, so "0 failed" above does not read as a pass
            more = f" (and {len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
            parts.append(f"{len(self.problems)} other problem{'' if len(self.problems) == 1 else 's'}: "
                         + "; ".join(self.problems[:3]) + more)
        return "; ".join(parts) + f" ({self.seconds:.1f} s)"

    def table(self, limit: int | None = None) -> str:
        """Per-layer table, worst first."""
        rows = self.sorted_layers()
        if limit is not None:
            rows = rows[:limit]
        head = ["status", "layer", "shape", "kind"]
        if self.against:
            head.append("exact")
        head.append(f"gemm err ({self.precision})")
        fast = any(c.float_error is not None for c in rows)
        if fast:
            head.append("vs float")
        if self.base:
            head += ["quant err", "max |dW|"]
        lines = [head]
        for c in rows:
            row = ["ok" if c.ok else "FAIL", c.name, "x".join(str(v) for v in c.shape), c.kind]
            if self.against:
                row.append("-" if c.exact is None else ("same" if c.exact else "DIFF"))
            row.append("-" if c.gemm_error is None else f"{c.gemm_error:.2e}")
            if fast:
                row.append("-" if c.float_error is None else f"{c.float_error:.2e}")
            if self.base:
                row += ["-" if c.quant_error is None else f"{c.quant_error:.3e}",
                        "-" if c.quant_max_abs is None else f"{c.quant_max_abs:.3e}"]
            lines.append(row)
        widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
        out = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in lines]
        for c in rows:
            for p in c.problems:
                out.append(f"  {c.name}: {p}")
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["layers"] = [dict(asdict(c), ok=c.ok) for c in self.sorted_layers()]
        d["tolerance"] = TOLERANCE[self.precision] if self.device == "cpu" else max(TOLERANCE[self.precision],
                                                                                  CUDA_TOLERANCE)
        d["summary"] = self.summary()
        return d


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _kind(meta: dict[str, Any]) -> str:
    gs = meta["group_size"]
    return (f"b{meta['bits']} g{'ch' if gs == -1 else gs} {meta['zero_mode']}"
            + (" act" if meta.get("act_order") else ""))


def _row_chunks(layer: CanonicalLayer) -> Iterator[tuple[int, int, np.ndarray]]:
    """(n0, n1, float64 dequantized rows) in chunks, so a 28672-row layer never needs one big array."""
    n = layer.out_features
    for n0 in range(0, n, _ROW_CHUNK):
        n1 = min(n, n0 + _ROW_CHUNK)
        sub = layer.replace(codes=layer.codes[n0:n1], scales=layer.scales[n0:n1],
                            zeros=None if layer.zeros is None else layer.zeros[n0:n1], bias=None)
        yield n0, n1, sub.dequantize(np.float64)


class _BaseWeights:
    """Original weights of the unquantized model: a .safetensors file or a folder (index or shards)."""

    def __init__(self, path: str | os.PathLike[str]):
        p = Path(path)
        if not p.exists():
            raise BadInputError("base model does not exist", file=str(p))
        if p.is_dir() and not ((p / INDEX_NAME).is_file() or any(p.glob("*.safetensors"))):
            raise BadInputError("base model holds no .safetensors weights", file=str(p))
        self.path = p
        self.store = open_tensors(p, pickles="none")

    def require_any(self, shapes: dict[str, tuple[int, int]], fused: dict[str, list[tuple[str, int, int]]]) -> None:
        """Refuse a base that holds the float weight of no layer at all, or none of the layer's shape (a quantized
        checkpoint, another model): that is the wrong --base (bad input, exit 2), not every layer failing
        verification (exit 1)."""
        wanted = [(m, (hi - lo, k) if m != name else (n, k)) for name, (n, k) in shapes.items()
                  for m, lo, hi in [(name, 0, n), *(fused.get(name) or [])]]
        held = [(m, shape, self.store.info(f"{m}.weight")[1]) for m, shape in wanted if f"{m}.weight" in self.store]
        if wanted and not held:
            raise BadInputError(f"base model holds no float weight of the checkpoint's quantized layers (no "
                                f"{wanted[0][0]}.weight, ...): --base takes the original unquantized model",
                                file=str(self.path))
        if held and not any(tuple(got) == want for _m, want, got in held):
            m, want, got = held[0]
            raise BadInputError(f"base model's weights are not this model's: no layer's has its shape ({m}.weight is "
                                f"{list(got)}, the checkpoint's layer {list(want)}): --base takes the original "
                                "unquantized model of this checkpoint", file=str(self.path))

    def weight(self, layer: str) -> tuple[np.ndarray, str] | None:
        name = f"{layer}.weight"
        if name not in self.store:
            return None
        return self.store.get(name), self.store.info(name)[0]

    def rows(self, name: str, parts: list[tuple[str, int, int]] | None, n: int, k: int
             ) -> tuple[Callable[[int, int], np.ndarray] | None, str | None]:
        """(rows(n0, n1) -> float64 original weight rows, problem). A fused layer's rows come from its parts'
        weights: the base model has q_proj, k_proj and v_proj, not qkv_proj."""
        own = self.weight(name)
        pieces: list[tuple[int, int, np.ndarray, str]] = []
        if own is not None or not parts:
            if own is None:
                return None, "no weight for this layer in the base model"
            if tuple(own[0].shape) != (n, k):
                return None, f"base weight has shape {list(own[0].shape)}, expected {[n, k]}"
            pieces.append((0, n, *own))
        else:
            for part, lo, hi in parts:
                w = self.weight(part)
                if w is None:
                    return None, f"no weight for part {part} in the base model"
                if tuple(w[0].shape) != (hi - lo, k):
                    return None, f"base weight of part {part} has shape {list(w[0].shape)}, expected {[hi - lo, k]}"
                pieces.append((lo, hi, *w))

        def rows(n0: int, n1: int) -> np.ndarray:
            out = [to_float64(np.asarray(a[max(n0, lo) - lo:min(n1, hi) - lo]), dt)
                   for lo, hi, a, dt in pieces if lo < n1 and hi > n0]
            return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

        return rows, None

    def close(self) -> None:
        self.store.close()


def _open_against(against: str | os.PathLike[str], base: str | os.PathLike[str] | None, src_format: str | None) -> Any:
    """Open the --against source as convert opens SRC: a local path or an ``hf://owner/name[@rev][/file]`` spec
    (downloaded first, so its format is detected on the local copy, not on a path that does not exist)."""
    from .formats import get_format
    from .sources import is_hub_spec, open_source, source_format

    fmt = src_format
    if fmt is None and (base is not None or not is_hub_spec(against)):
        # the format decides whether base goes along (TOML tables need it)
        fmt = source_format(against)
    opts: dict[str, Any] = {}
    if base is not None and fmt is not None and get_format(fmt).takes_base:
        opts["base"] = base  # quant tables hold no codes: they are rebuilt from the base weights
    return open_source(against, fmt, **opts)


def _refuse_as_convert(source: Any, against: str | os.PathLike[str]) -> None:
    """Raise what convert would stop this source at before reading a layer (no quantized layers, unsupported, 3; a
    layer missing a tensor or a norm the architecture needs, 2): a source convert refuses is not a difference in
    the packed checkpoint (exit 1), and verify --against exits as convert would."""
    from .convert import source_problems
    from .formats import get_format

    problems = source_problems(get_format("w4pack"), source, str(against))
    if problems:
        raise problems[0]


def _slice_rows(layer: CanonicalLayer, lo: int, hi: int, name: str) -> CanonicalLayer:
    """Rows [lo, hi) of a layer: one part of a fused layer (g_idx, hence act-order, is shared by the parts)."""
    return layer.replace(codes=layer.codes[lo:hi], scales=layer.scales[lo:hi],
                         zeros=None if layer.zeros is None else layer.zeros[lo:hi],
                         bias=None if layer.bias is None else layer.bias[lo:hi], name=name)


def _fused_map(fused: Any) -> dict[str, list[tuple[str, int, int]]]:
    """A manifest's ``fused`` as {fused layer: [(part, lo, hi), ...]} (the schema has checked the types)."""
    return {name: [(p["name"], int(p["rows"][0]), int(p["rows"][1])) for p in parts]
            for name, parts in (fused or {}).items()}


def _tiling_problem(parts: list[tuple[str, int, int]], n: int) -> str | None:
    """Why the parts' rows do not cover [0, n) in order, one after the other (None when they do)."""
    at = 0
    for part, lo, hi in parts:
        if lo != at or hi <= lo:
            return f"fused part {part} has rows [{lo}, {hi}), expected to start at {at} and be non-empty"
        at = hi
    return None if at == n else f"fused parts cover rows [0, {at}) of the layer's {n}"


class _SourceLayers:
    """The --against source's layers by unfused module name: a layer of its own, or rows of one of its fused
    layers (a fused w4pack source), so that either side of the comparison may be fused."""

    def __init__(self, source: Any):
        self.source = source
        self.names = frozenset(source.layer_names())
        self.fused = {f: parts for f, parts in _fused_map(getattr(source, "fused", None)).items() if f in self.names}
        self.part_of = {part: (f, lo, hi) for f, parts in self.fused.items() for part, lo, hi in parts}
        self._last: tuple[str, CanonicalLayer] | None = None  # parts of one fused layer are read one after another
        #: [out, in] of every source layer read so far: the architecture check convert's writer makes
        self.shapes: dict[str, tuple[int, int]] = {}

    def has(self, name: str) -> bool:
        return name in self.names or name in self.part_of

    def _read_layer(self, name: str) -> CanonicalLayer:
        layer = self.source.read_layer(name)
        group_structure(layer)  # what packing refuses, convert refuses: so does verify --against (2 or 3, not 1)
        self.shapes[name] = (layer.out_features, layer.in_features)
        return layer

    def read(self, name: str) -> CanonicalLayer:
        if name in self.names:
            return self._read_layer(name)
        f, lo, hi = self.part_of[name]
        if self._last is None or self._last[0] != f:
            self._last = (f, self._read_layer(f))
        return _slice_rows(self._last[1], lo, hi, name)

    def architecture_problem(self) -> tuple[str, str, bool] | None:
        """What convert's writer would refuse about these layers (core.arch), once every one has been read."""
        if set(self.shapes) != self.names:
            return None  # a layer the packed checkpoint lacks: reported as a difference already
        emb = set(self.source.embedding_names())
        metas = {n: {"shape": list(s), "role": "embedding" if n in emb else "linear"} for n, s in self.shapes.items()}
        fused = getattr(self.source, "fused", None) or {}
        from .convert import cheap_shape

        return architecture_problem(self.source.config or {}, metas, fused if isinstance(fused, dict) else {},
                                    set(self.source.passthrough_names()), lambda t: cheap_shape(self.source, t))

    def dense(self, name: str) -> tuple[np.ndarray, str] | None:
        """(array, dtype name) of the source's pass-through ``<name>.weight``: where a format that cannot hold a
        packed embedding carries it dequantized (formats/embeddings.py); None when the source has none."""
        tname = f"{name}.weight"
        if tname not in set(self.source.passthrough_names()):
            return None
        t = self.source.read_tensor(tname)
        return np.asarray(t.array), t.dtype

    def units(self) -> dict[str, list[str]]:
        """{source layer: the unfused modules it holds}."""
        return {s: [p for p, _, _ in self.fused[s]] if s in self.fused else [s] for s in self.names}


def _gemm_runner(device: str, threads: int | None) -> Any:
    """prepare(packed, name) -> run(x float32 [M, K], precision) -> float32 numpy [M, N] on the device."""
    if device == "cpu":
        from .native.cpu import CpuPackedLinear, available, check_environment

        if not available():
            raise UnsupportedError("the native CPU module is not built (run `make native`)")
        # a bad $W4PACK_ISA / $W4PACK_THREADS is a usage error (exit 2), not every layer's GEMM failing (exit 1)
        check_environment(threads_from_env=threads is None)

        def prepare_cpu(packed: Any, name: str) -> Any:
            lin = CpuPackedLinear(packed, threads=threads, name=name)  # repacked once per layer
            bias = packed.tensors.get("bias")
            return lambda x, precision: lin.forward(x, precision=precision, out_dtype="float32",
                                                    bias=False if bias is None else bias)

        return prepare_cpu
    if device == "cuda":
        why = None
        if importlib.util.find_spec("w4pack.native.cuda") is None:
            why = "w4pack.native.cuda is not part of this build"
        else:
            try:
                import torch

                if not torch.cuda.is_available():
                    why = "torch sees no CUDA device"
            except ImportError:
                why = "torch is not installed"
        if why:
            raise UnsupportedError(f"CUDA verification is not available: {why}")
        import torch

        from .native import gemm

        def prepare_cuda(packed: Any, name: str) -> Any:
            b = packed.tensors.get("bias")
            if b is not None:
                dt = packed.meta.get("bias_dtype") or "float16"
                b = torch.from_numpy(np.ascontiguousarray(b)).to("cuda")
                b = b.view(torch.bfloat16) if dt == "bfloat16" else b

            def run(x: np.ndarray, precision: str) -> np.ndarray:
                y = gemm(torch.from_numpy(x.astype(np.float16)).to("cuda"), packed, bias=False if b is None else b,
                         precision=precision, out_dtype=torch.float32)
                torch.cuda.synchronize()
                return y.float().cpu().numpy()

            return run

        return prepare_cuda
    raise BadInputError(f"device must be 'cpu' or 'cuda', got {device!r}")


# ---------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------
def verify(path: str | os.PathLike[str], *, against: str | os.PathLike[str] | None = None,
           base: str | os.PathLike[str] | None = None, device: str = "cpu", precision: str = "exact",
           threads: int | None = None, ms: tuple[int, ...] = DEFAULT_MS, seed: int | None = None,
           src_format: str | None = None, show_progress: bool | None = None) -> VerifyReport:
    """Run the checks on the packed checkpoint at ``path``; never raises for a failed check (see
    ``report.ok``), only for unusable input (not a readable w4pack folder, unreadable source: W4PackError).

    Example::

        from w4pack.verify import verify

        rep = verify("llama-w4/", against="llama-gptq/")
        print(rep.table()); assert rep.ok
    """
    if precision not in TOLERANCE:
        raise BadInputError(f"precision must be 'exact' or 'fast', got {precision!r}")
    from .native.cpu import check_threads

    check_threads(threads)
    if src_format is not None and against is None:
        raise BadInputError("src_format names the format of against=, which is not given")
    if not ms or any(int(m) < 1 for m in ms):
        raise BadInputError(f"activation rows must be >= 1, got {list(ms)}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        # numpy's generator takes only non-negative integers (its own ValueError read as a bug in w4pack)
        raise BadInputError(f"seed must be a whole number >= 0, got {seed!r}")
    t0 = time.perf_counter()
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    root = Path(path)
    runner = _gemm_runner(device, threads)
    report = VerifyReport(path=str(root), against=None if against is None else str(against),
                          base=None if base is None else str(base), device=device, precision=precision,
                          ms=[int(m) for m in ms], seed=seed)
    # a folder that cannot be read as a checkpoint (malformed or missing manifest, config or index, an index that
    # points outside the folder, a truncated shard) is bad input, as in validate: the W4PackError propagates
    # (exit 2, one line on stderr). Only checks that ran and found a difference make a failed report (exit 1).
    ck = Checkpoint(root)
    source = None
    base_w = None
    try:
        report.checks.append("structure")
        ck.check_structure()
        try:
            ck.verify_checksums(show_progress=show_progress)
        except BadInputError as exc:  # readable but not the recorded bytes: keep going, the layer checks name it
            report.structure_ok, report.structure_error = False, exc.one_line()
        fused = _fused_map(ck.manifest.get("fused"))
        for name in sorted(set(fused) - set(ck.layers)):
            report.problems.append(f"fused layer {name} of the manifest is not one of its layers")
        src_layers = None
        if against is not None:
            report.checks.append("exact")
            source = _open_against(against, base, src_format)
            _refuse_as_convert(source, against)
            src_layers = _SourceLayers(source)
            # what the packed checkpoint holds, by unfused module: its layers and the parts of its fused layers
            held = set(ck.layers) | {part for f in ck.layers for part, _, _ in fused.get(f, [])}
            for sname, modules in sorted(src_layers.units().items()):
                if sname in held:
                    continue
                for missing in modules:
                    if missing not in held and not _held_dequantized(ck, source, missing):
                        report.problems.append(f"layer {missing} of the source is missing from the packed checkpoint")
        report.checks.append(f"gemm-{precision}-{device}")
        if base is not None:
            report.checks.append("quant-error")
            base_w = _BaseWeights(base)
            base_w.require_any({name: tuple(int(v) for v in ck.manifest["layers"][name]["shape"])  # type: ignore[misc]
                                for name in ck.layers}, fused)
        rng = np.random.default_rng(seed)
        tol = TOLERANCE[precision] if device == "cpu" else max(TOLERANCE[precision], CUDA_TOLERANCE)
        with Progress(len(ck.layers), "verify", enabled=show_progress) as bar:
            for name in ck.layers:
                report.layers.append(_check_layer(ck, name, src_layers, base_w, runner, precision, tol, ms, rng,
                                                  fp16_inputs=device == "cuda", parts=fused.get(name)))
                bar.update()
        if source is not None:
            found = src_layers.architecture_problem() if src_layers is not None else None
            if found:  # convert refuses this source (its writer checks the architecture): so does verify
                raise BadInputError(found[1], file=str(against), tensor=found[0])
            report.passthrough = _compare_passthrough(ck, source, report.problems)
            _compare_model_files(ck, source, report.problems)
    finally:
        ck.close()
        if source is not None:
            source.close()
        if base_w is not None:
            base_w.close()
        report.seconds = time.perf_counter() - t0
    return report


def _differences(layer: CanonicalLayer, source: _SourceLayers, name: str,
                 check: LayerCheck | None = None) -> list[str]:
    """How the packed layer differs from the source's; none when the fields differ but every weight and the bias
    are the same (another representation of one layer: the difference is noted on ``check``). A source layer
    that cannot be read raises its own error (bad input, exit 2, naming the source file): the source is what is
    wrong, not the packed checkpoint, and a failed report (exit 1) would say the conversion was."""
    other = source.read(name)
    diffs = layer.differences(other)
    if diffs and same_weights(layer, other):
        if check is not None:
            check.representation = "; ".join(diffs[:3])
        return []
    return diffs


def same_weights(a: CanonicalLayer, b: CanonicalLayer, rows: int = 1024) -> bool:
    """Whether two layers compute the same thing: equal dequantized weights (float64, exact for every
    representation the layout has) and equal biases, compared a block of rows at a time."""
    if (a.out_features, a.in_features) != (b.out_features, b.in_features):
        return False
    if (a.bias is None) != (b.bias is None):
        return False
    if a.bias is not None and not np.array_equal(to_float64(a.bias, a.bias_dtype or "float16"),
                                                 to_float64(b.bias, b.bias_dtype or "float16")):
        return False
    for n0 in range(0, a.out_features, rows):
        n1 = min(n0 + rows, a.out_features)
        if not np.array_equal(_slice_rows(a, n0, n1, "").dequantize(np.float64),
                              _slice_rows(b, n0, n1, "").dequantize(np.float64)):
            return False
    return True


def _check_exact(check: LayerCheck, layer: CanonicalLayer, source: _SourceLayers,
                 parts: list[tuple[str, int, int]] | None) -> None:
    """Bit-exactness against the source: the layer itself, or (fused, the source unfused) each part against the
    rows the manifest gives it, reported per part."""
    name = check.name
    if source.has(name) or not parts:
        if not source.has(name) and layer.role == "embedding" and (dense := source.dense(name)) is not None:
            # the source holds the embedding dequantized: it must be exactly the float32 values of the layer
            arr, dtype = dense
            mine = layer.dequantize(np.float32)
            check.exact = dtype == "float32" and arr.shape == mine.shape and \
                np.array_equal(np.ascontiguousarray(arr).view(np.uint32), mine.view(np.uint32))
            if not check.exact:
                check.problems.append(f"differs from the source's dequantized {name}.weight ({dtype})")
            return
        if not source.has(name):
            check.exact = False
            check.problems.append("not in the source checkpoint")
            return
        diffs = _differences(layer, source, name, check)
        check.exact = not diffs
        if diffs:
            check.problems.append("differs from the source: " + "; ".join(diffs[:4]))
        return
    check.parts = []
    for part, lo, hi in parts:
        if not source.has(part):
            diffs = ["not in the source checkpoint"]
            check.problems.append(f"part {part} (rows {lo}:{hi}) is not in the source checkpoint")
        else:
            diffs = _differences(_slice_rows(layer, lo, hi, part), source, part)
            if diffs:
                check.problems.append(f"part {part} (rows {lo}:{hi}) differs from the source: " + "; ".join(diffs[:4]))
        check.parts.append({"name": part, "rows": [lo, hi], "exact": not diffs, "differences": diffs})
    check.exact = all(p["exact"] for p in check.parts)


def _check_layer(ck: Checkpoint, name: str, source: _SourceLayers | None, base_w: _BaseWeights | None,
                 runner: Any, precision: str, tol: float, ms: tuple[int, ...], rng: np.random.Generator,
                 fp16_inputs: bool = False, parts: list[tuple[str, int, int]] | None = None) -> LayerCheck:
    meta = ck.manifest["layers"][name]
    check = LayerCheck(name=name, shape=list(meta["shape"]), kind=_kind(meta))
    try:
        packed = ck.packed(name)
        layer = ck.layer(name)
    except SourceChanged:
        raise  # a shard rewritten under us says nothing about the checkpoint's contents: exit 4, not a failed check
    except W4PackError as exc:
        check.problems.append(f"cannot unpack: {exc.one_line()}")
        return check
    tiling = _tiling_problem(parts, layer.out_features) if parts else None
    if tiling:  # the manifest's part rows must cover the layer, or the loader would build wrong slices
        check.problems.append(tiling)
        parts = None
    if source is not None:
        _check_exact(check, layer, source, parts)
    # numerics: native GEMM vs float64 reference, fresh non-zero activations for every M
    n, k = layer.out_features, layer.in_features
    x_all = rng.standard_normal((sum(ms), k)).astype(np.float32)
    x_all[x_all == 0] = 1.0
    if fp16_inputs:  # CUDA takes fp16 activations: the reference uses the same rounded values
        x_all = x_all.astype(np.float16).astype(np.float32)
    try:
        run = runner(packed, name)
        ys = []
        at = 0
        for m in ms:
            ys.append(run(x_all[at:at + m], precision))
            at += m
        y = np.concatenate(ys, axis=0).astype(np.float64)
        ref = np.empty((x_all.shape[0], n))
        x64 = x_all.astype(np.float64)
        wsq = 0.0
        dsq = 0.0
        dmax = 0.0
        orig = None
        if base_w is not None:
            orig, why = base_w.rows(name, parts, n, k)
            if why:
                check.problems.append(why)
        for n0, n1, w in _row_chunks(layer):
            ref[:, n0:n1] = x64 @ w.T
            if layer.bias is not None:
                ref[:, n0:n1] += to_float64(layer.bias[n0:n1], layer.bias_dtype or "float16")
            if orig is not None:
                w0 = orig(n0, n1)
                d = w - w0
                wsq += float(np.sum(w0 * w0))
                dsq += float(np.sum(d * d))
                dmax = max(dmax, float(np.max(np.abs(d))))
        if orig is not None:
            check.quant_error = float(np.sqrt(dsq / wsq)) if wsq > 0 else float(np.sqrt(dsq))
            check.quant_max_abs = dmax
        fast_ref = None
        if precision == "fast" and not fp16_inputs:
            from .native.cpu import fast_rounded_activations

            xr = fast_rounded_activations(x_all, packed)
            fast_ref = np.empty_like(ref)
            for n0, n1, w in _row_chunks(layer):
                fast_ref[:, n0:n1] = xr @ w.T
                if layer.bias is not None:
                    fast_ref[:, n0:n1] += to_float64(layer.bias[n0:n1], layer.bias_dtype or "float16")
            fe = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-300))
            check.float_error = fe
            if not fe <= FAST_FLOAT_BOUND:
                check.problems.append(f"fast GEMM error against the float reference {fe:.2e} exceeds "
                                      f"{FAST_FLOAT_BOUND:.0e}")
            ref = fast_ref
        worst = 0.0
        at = 0
        for m in ms:
            r, yy = ref[at:at + m], y[at:at + m]
            denom = np.linalg.norm(r)
            e = float(np.linalg.norm(yy - r) / denom) if denom > 0 else float(np.linalg.norm(yy))
            if not np.all(np.isfinite(yy)):
                e = float("inf")
            worst = max(worst, e)
            at += m
        check.gemm_error, check.gemm_tolerance = worst, tol
        if not worst <= tol:
            check.problems.append(f"{precision} GEMM error {worst:.2e} exceeds {tol:.0e}")
    except W4PackError as exc:
        check.problems.append(f"GEMM failed: {exc.one_line()}")
    except MemoryError as exc:
        check.problems.append(f"GEMM failed: out of memory ({exc})")
    return check


def _held_dequantized(ck: Checkpoint, source: Any, name: str) -> bool:
    """True when ``name`` is a packed embedding of the source that ``ck`` holds as the float tensor ``name.weight``
    (written by a version or a format that dequantized it)."""
    return f"{name}.weight" in ck.passthrough and name in source.embedding_names()


#: config.json keys the converter writes itself (the packed layout's own, and the writing library's stamps)
_OWN_CONFIG_KEYS = frozenset({"quantization_config", "transformers_version", "_name_or_path", "torch_dtype", "dtype"})


def _compare_model_files(ck: Checkpoint, source: Any, problems: list[str]) -> None:
    """The files besides the weights that define the model must say what the source's say: config.json (every key
    but those the converter writes itself), and the generation config and tokenizer files the source has. A
    manifest re-signed after an edit passes its own checksums; against the source the edit still shows."""
    from .store.folder import read_json, read_side_json

    cfg = ck.config
    for key, value in sorted((source.config or {}).items()):
        if key in _OWN_CONFIG_KEYS:
            continue
        if key not in cfg:
            problems.append(f"config.json lacks the source's {key!r}")
        elif cfg[key] != value:
            problems.append(f"config.json's {key!r} is {cfg[key]!r}, the source's {value!r}")
    for side in source.side_files():
        side = Path(side)
        mine = Path(ck.path) / side.name
        if not mine.is_file():
            if side.name == "generation_config.json" or side.name.startswith(("tokenizer", "special_tokens")):
                problems.append(f"{side.name} of the source is missing from the packed checkpoint")
            continue
        if side.suffix == ".json":  # (the source's as convert reads it: a file convert refuses is bad input here too)
            same = read_side_json(side) == read_json(mine)
        else:
            same = side.read_bytes() == mine.read_bytes()
        if not same:
            problems.append(f"{side.name} differs from the source's")


def _how_it_differs(a: np.ndarray, a_dtype: str, b: np.ndarray, b_dtype: str) -> str:
    """Why two pass-through tensors are not the same bytes, as one phrase: a writer that widens a tensor (GGUF keeps
    norms as F32) leaves the values as they were, which is another finding than changed values."""
    if a.shape != b.shape:
        return f"shape {list(a.shape)}, the source's {list(b.shape)}"
    if a_dtype != b_dtype:
        floats = a_dtype in FLOAT_DTYPES and b_dtype in FLOAT_DTYPES
        said = f"stored as {a_dtype}, the source's as {b_dtype}"
        if not floats:
            return said
        if np.array_equal(to_float32(a, a_dtype), to_float32(b, b_dtype)):
            return said + ": the same values in another dtype"
        return said + ", and the values differ"
    return "different values"


def _compare_passthrough(ck: Checkpoint, source: Any, problems: list[str]) -> dict[str, Any]:
    """Pass-through tensors must be the source's bytes, dtype and shape, unchanged."""
    # a packed embedding that the source carries dequantized is compared with the layers (_check_exact)
    embedded = {f"{n}.weight" for n, m in ck.manifest["layers"].items() if m.get("role") == "embedding"}
    src = [t for t in source.passthrough_names() if t not in embedded or t in ck.passthrough]
    mine = set(ck.passthrough)
    identical = 0
    for tname in src:
        if tname not in mine:
            problems.append(f"pass-through tensor {tname} of the source is missing")
            continue
        t = source.read_tensor(tname)
        a, b = np.asarray(ck.raw(tname)), np.asarray(t.array)
        same = (ck.dtype_name(tname) == t.dtype and a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize
                and np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))
        if not same:
            problems.append(f"pass-through tensor {tname} differs from the source: "
                            + _how_it_differs(a, ck.dtype_name(tname), b, t.dtype))
        else:
            identical += 1
    for tname in sorted(mine - set(src)):  # a packed embedding of the source that this folder holds dequantized
        name = tname[: -len(".weight")]
        if tname.endswith(".weight") and _held_dequantized(ck, source, name):
            a = np.asarray(ck.raw(tname))
            b = source.read_layer(name).dequantize(np.float32)
            if ck.dtype_name(tname) == "float32" and a.shape == b.shape and \
                    np.array_equal(np.ascontiguousarray(a).view(np.uint32), b.view(np.uint32)):
                identical += 1
            else:
                problems.append(f"pass-through tensor {tname} differs from the source's packed embedding {name}")
            src.append(tname)
    extra = sorted(mine - set(src))
    for tname in extra[:5]:
        problems.append(f"pass-through tensor {tname} is not in the source")
    return {"total": len(src), "identical": identical, "extra": len(extra)}
