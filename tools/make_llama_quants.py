#!/usr/bin/env python3
"""GGUF files quantized by llama.cpp's own quantizer, as test data for the K-quant readers.

    python tools/make_llama_quants.py [--out tests/data/llama_quantize] [--types Q4_K_M,Q2_K,...]
                                      [--moe-types Q4_K_M,...]

A tiny llama (seeded random weights; every matrix width a multiple of 256, so llama.cpp's recipes choose their
K-quants and never the fallbacks that a 576-wide model like SmolLM2 takes) is written as an all-float32 GGUF with
gguf-py, then quantized by llama.cpp (``llama_model_quantize`` from llama-cpp-python) to each type. The float32
file is not kept: it is a pure function of ``SEED`` and regenerated on every run.

A tiny Mixtral (``tiny-moe-<TYPE>.gguf``) is made the same way: GGUF architecture ``llama`` with
``llama.expert_count``, as llama.cpp's converter writes Mixtral, so that llama.cpp's recipes quantize the stacked 3-D
expert tensors ``ffn_{gate,up,down}_exps`` as they do in the Mixtral files people download (the router
``ffn_gate_inp`` stays F32, as llama.cpp never quantizes it). It has its own seed, so the dense files do not change.

Needs llama-cpp-python (``import llama_cpp``) and gguf; the tests read the committed outputs with neither
llama_cpp nor this script.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "llama_quantize"

SEED = 33
#: the tiny model: hidden 256 (head_dim 64, 4 query heads sharing 2 key/value heads), intermediate 256, two layers
#: (llama.cpp's _M recipes give the last layer's attn_v and ffn_down the larger type), vocabulary 128: about 0.85 M
#: weights, so each file is 0.4-0.7 MB
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB, CONTEXT = 256, 256, 2, 4, 2, 128, 256
HEAD_DIM = HIDDEN // HEADS
EPS = 1e-5

#: the llama.cpp file types made, in order (name -> LLAMA_FTYPE_MOSTLY_<name>)
#: (Q5_0 and Q5_1 are left out: gguf-py quantizes those itself, so the other tests already have them, and the set
#: stays under 5 MB)
TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL")

MOE_SEED = 34
#: the tiny Mixtral: the dense model's attention, embedding and head, and in each of its two layers 4 experts
#: (top-2) with an intermediate size of 256 instead of the dense MLP: about 2 M weights. Every expert matrix is
#: 256 wide in both directions, so all of them get K-quants (ffn_down's rows are the expert width).
EXPERTS, EXPERTS_USED = 4, 2
#: the llama.cpp file types made of the tiny Mixtral
MOE_TYPES = ("Q4_K_M",)


def tiny_llama_tensors(seed: int = SEED, experts: int = 0) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array of the tiny llama (q/k rows in GGUF's rotary order: random weights, so
    the permutation changes nothing statistically). Norm weights near 1, matrices N(0, 0.02) with a few larger
    outliers per row, as trained weights have, so that the quantizers' scale searches have something to do.

    With ``experts`` > 0 each layer's MLP is a Mixtral MoE block instead: the router ``ffn_gate_inp`` [E, H]
    (N(0, 0.1), so that the top-2 choice is decisive rather than a near tie) and the stacked experts
    ``ffn_{gate,up,down}_exps`` [E, rows, cols], each expert drawn like a dense matrix."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        w = rng.normal(0.0, 0.02, (rows, cols))
        idx = rng.integers(0, cols, (rows, 2))
        np.put_along_axis(w, idx, rng.normal(0.0, 0.08, (rows, 2)), axis=1)
        return w.astype(np.float32)

    def norm() -> np.ndarray:
        return rng.normal(1.0, 0.1, HIDDEN).astype(np.float32)

    t: dict[str, np.ndarray] = {"token_embd.weight": mat(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = norm()
        t[b + "attn_q.weight"] = mat(HEADS * HEAD_DIM, HIDDEN)
        t[b + "attn_k.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        t[b + "attn_v.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        t[b + "attn_output.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        t[b + "ffn_norm.weight"] = norm()
        if experts:
            t[b + "ffn_gate_inp.weight"] = rng.normal(0.0, 0.1, (experts, HIDDEN)).astype(np.float32)
            t[b + "ffn_gate_exps.weight"] = np.stack([mat(INTERMEDIATE, HIDDEN) for _ in range(experts)])
            t[b + "ffn_up_exps.weight"] = np.stack([mat(INTERMEDIATE, HIDDEN) for _ in range(experts)])
            t[b + "ffn_down_exps.weight"] = np.stack([mat(HIDDEN, INTERMEDIATE) for _ in range(experts)])
            continue
        t[b + "ffn_gate.weight"] = mat(INTERMEDIATE, HIDDEN)
        t[b + "ffn_up.weight"] = mat(INTERMEDIATE, HIDDEN)
        t[b + "ffn_down.weight"] = mat(HIDDEN, INTERMEDIATE)
    t["output_norm.weight"] = norm()
    t["output.weight"] = mat(VOCAB, HIDDEN)
    return t


def write_tiny_f32(path: Path, seed: int = SEED, experts: int = 0) -> None:
    """The tiny llama (with ``experts``: the tiny Mixtral) as an all-float32 GGUF with the metadata llama.cpp's
    loader and w4pack's reader need."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name(f"w4pack tiny mixtral seed {seed}" if experts else f"w4pack tiny llama seed {seed}")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(EXPERTS_USED)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_file_type(0)  # LLAMA_FTYPE_ALL_F32
    for name, arr in tiny_llama_tensors(seed, experts).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_QUIET = None


def _quiet_llama_log() -> None:
    """Drop llama.cpp's per-tensor log lines (hundreds per file); failures still come back as a status."""
    global _QUIET
    import llama_cpp

    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))


_FTYPE = "LLAMA_FTYPE_MOSTLY_"


def ftype_value(name: str) -> int:
    """llama.cpp's ``LLAMA_FTYPE_MOSTLY_<name>``. ValueError naming the known types for a name it lacks, so that
    the tools can refuse a typo before they build (minutes) or write anything."""
    import llama_cpp

    value = getattr(llama_cpp, _FTYPE + name, None)
    if not isinstance(value, int):
        known = sorted(k[len(_FTYPE):] for k in dir(llama_cpp) if k.startswith(_FTYPE))
        raise ValueError(f"unknown llama.cpp file type {name!r} (known: {', '.join(known)})")
    return value


def check_ftypes(ap: argparse.ArgumentParser, names: list[str]) -> None:
    """Exit 2 (argparse's usage error) for a file type llama.cpp lacks, or without llama-cpp-python."""
    try:
        for name in names:
            ftype_value(name)
    except ImportError:
        ap.error("needs llama-cpp-python (pip install llama-cpp-python)")
    except ValueError as exc:
        ap.error(str(exc))


def llama_quantize(src: Path, dst: Path, ftype: str, threads: int = 1, quiet: bool = True) -> None:
    """llama.cpp's own quantizer (what ``llama-quantize SRC DST FTYPE`` runs): default parameters, no imatrix."""
    import llama_cpp

    if quiet:
        _quiet_llama_log()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_value(ftype)
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise SystemExit(f"llama_model_quantize {src} -> {dst} ({ftype}) failed with status {rc}")


def llama_cpp_version() -> str:
    """llama-cpp-python's version and the bundled libllama's, for the provenance note."""
    import llama_cpp

    lib = llama_cpp.llama_version() if callable(getattr(llama_cpp, "llama_version", None)) else b"?"
    return f"llama-cpp-python {llama_cpp.__version__} (libllama {lib.decode() if isinstance(lib, bytes) else lib})"


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def make(out: Path, types: list[str], seed: int = SEED, moe: bool = False) -> list[Path]:
    """Write ``tiny-<TYPE>.gguf`` (with ``moe``: ``tiny-moe-<TYPE>.gguf``, the tiny Mixtral) for each type into
    out (each written beside its place, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    stem = "tiny-moe" if moe else "tiny"
    with tempfile.TemporaryDirectory(prefix="w4pack-llamaq-") as tmp:
        src = Path(tmp) / f"{stem}-F32.gguf"
        write_tiny_f32(src, seed, EXPERTS if moe else 0)
        for ft in types:
            dst = out / f"{stem}-{ft}.gguf"
            part = dst.with_name(dst.name + ".partial")  # beside its place, so the rename cannot cross devices
            try:
                llama_quantize(src, part, ft)
                part.replace(dst)
            finally:
                part.unlink(missing_ok=True)  # a failed run leaves nothing half written in the data folder
            made.append(dst)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated llama.cpp file types")
    ap.add_argument("--moe-types", default=",".join(MOE_TYPES),
                    help="comma-separated llama.cpp file types of the tiny Mixtral (empty: none)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--moe-seed", type=int, default=MOE_SEED)
    a = ap.parse_args(argv)

    def listed(text: str) -> list[str]:
        return [t.strip() for t in text.split(",") if t.strip()]

    types, moe_types = listed(a.types), listed(a.moe_types)
    check_ftypes(ap, types + moe_types)
    if a.out.exists() and not a.out.is_dir():
        ap.error(f"--out {a.out} is a file, not a folder")
    print(llama_cpp_version())
    made = make(a.out, types, a.seed) + make(a.out, moe_types, a.moe_seed, moe=True)
    for p in made:
        print(f"{p}: {p.stat().st_size} bytes; tensors by type: {tensor_types(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
