"""Why a folder whose tensor names look quantized was recognised by no format.

Detection reads a layer's tensors (GPTQ: qweight beside scales; AWQ: qweight, qzeros, scales; llm-awq's dumps:
qweight, scales, scaled_zeros; compressed-tensors: weight_packed). A checkpoint that lost or renamed one of them is
then recognised by none, and "unknown format" (exit 3) would send the user to --from for a file that is simply
damaged. When the names clearly belong to a quantized layout, the damaged layer is bad input (exit 2), named with
what it has and what it lacks.

Names alone do not decide a layer that kept nothing but ``scales`` beside a renamed qweight (a symmetric AWQ-Marlin
layer has no qzeros): other layouts keep ``scales`` beside tensors of their own (AQLM: ``codes``, ``codebooks``).
There the unknown tensor's dtype and shape decide: an integer tensor shaped as the packed weights of a GPTQ or AWQ
layer with those scales (``_qweight_fits``) is that layer's qweight under another name; anything else stays unknown.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping

from ..errors import BadInputError, UnsupportedError

__all__ = ["raise_incomplete_quantized", "missing_member", "raise_float_only", "disguised_qweight"]

#: a tensor's (dtype name, shape) by its full name, or None where it is not known without reading the tensor
TensorInfo = Callable[[str], "tuple[str, tuple[int, ...]] | None"]

#: a family of per-layer tensor suffixes: (name, members, members that only this family uses, required members)
_FAMILIES: tuple[tuple[str, tuple[str, ...], frozenset[str], tuple[str, ...]], ...] = (
    ("GPTQ/AWQ", ("qweight", "qzeros", "scales", "g_idx", "scaled_zeros"),
     frozenset({"qweight", "qzeros", "g_idx", "scaled_zeros"}), ("qweight", "scales")),
    ("compressed-tensors", ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
     frozenset({"weight_packed", "weight_shape"}), ("weight_packed", "weight_scale")),
)


def _full(mod: str, leaf: str) -> str:
    """The tensor name of ``leaf`` in module ``mod`` ("" for a name without a dot: just the leaf)."""
    return f"{mod}.{leaf}" if mod else leaf


def _layers(names: Iterable[str]) -> dict[str, set[str]]:
    """Module prefix -> the suffixes (after the last dot) of its tensors."""
    out: dict[str, set[str]] = {}
    for n in names:
        mod, _, leaf = n.rpartition(".")
        out.setdefault(mod, set()).add(leaf)
    return out


_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32"})


def _qweight_fits(q: tuple[str, tuple[int, ...]], scales: tuple[int, ...],
                  zeros: tuple[str, tuple[int, ...]] | None, g_idx: tuple[int, ...] | None) -> list[str]:
    """The GPTQ/AWQ layouts (as the readers take them) in which a tensor of dtype and shape ``q`` is the qweight of
    a layer with these 2-D ``scales`` [a, b] (and, where the layer kept them, this qzeros and g_idx):

    * GPTQ: int32 [in*bits/32, b] (bits 2, 3, 4, 8), a groups of at least one input channel, qzeros [a, ...];
      with g_idx [in], its rows are in*bits/32 exactly;
    * AWQ GEMM: int32 [in, b/8], qzeros (if kept) [a, b/8];
    * AWQ Marlin: int32 [in/16, 2*b], no qzeros (symmetric);
    * AWQ GEMV: int32 [a, in/8] beside qzeros [a, b/8] (which it needs);
    * AWQ GEMVFast: int16 [b/4, in] (in % 64 == 0) beside float zeros shaped as the scales (which it needs)."""
    dt, shape = q
    if len(shape) != 2 or len(scales) != 2 or 0 in shape or 0 in scales:
        return []
    r, c = shape
    a, b = scales
    zdt, zs = zeros if zeros is not None else ("", None)
    int_zeros = zs is not None and zdt in ("int32", "uint32") and len(zs) == 2
    fits = []
    if dt in ("int32", "uint32"):
        if c == b and (zs is None or (int_zeros and zs[0] == a)) and (
                any(r * 32 == g_idx[0] * bits for bits in (2, 3, 4, 8)) if g_idx is not None and len(g_idx) == 1
                else a <= 16 * r):
            fits.append("GPTQ")
        if g_idx is None and dt == "int32":
            if 8 * c == b and a <= r and (zs is None or (int_zeros and zs == (a, c))):
                fits.append("AWQ GEMM")
            if c == 2 * b and a <= 16 * r and zs is None:
                fits.append("AWQ Marlin")
            if int_zeros and r == a == zs[0] and b == 8 * zs[1]:
                fits.append("AWQ GEMV")
    elif dt == "int16" and g_idx is None and zs is not None and zdt in _FLOAT_DTYPES and zs == scales:
        if 4 * r == b and c % 64 == 0:
            fits.append("AWQ GEMVFast")
    return fits


def disguised_qweight(mod: str, leaves: set[str], info: TensorInfo) -> tuple[str, str] | None:
    """(the unknown tensor, what it is shaped as) where module ``mod`` holds float ``scales`` but no qweight, and
    exactly one of its tensors outside the GPTQ/AWQ names (and bias) is shaped as the qweight of a GPTQ or AWQ layer
    with those scales (``_qweight_fits``): the layer's packed weights under an unexpected name. None otherwise: a
    layout that keeps scales beside tensors of its own (AQLM: int16 codes [out, in/8, books], float16 codebooks,
    scales [out, 1, 1, 1]) has no such tensor, and stays unknown."""
    if "qweight" in leaves or "scales" not in leaves or "weight" in leaves:
        return None
    sinfo = info(_full(mod, "scales"))
    if sinfo is None or sinfo[0] not in _FLOAT_DTYPES or len(sinfo[1]) != 2:
        return None
    zname = "qzeros" if "qzeros" in leaves else "scaled_zeros" if "scaled_zeros" in leaves else None
    zeros = info(_full(mod, zname)) if zname else None
    if zname and zeros is None:
        return None
    g = info(_full(mod, "g_idx")) if "g_idx" in leaves else None
    if "g_idx" in leaves and g is None:
        return None
    found = []
    for leaf in sorted(leaves - set(_FAMILIES[0][1]) - {"bias"}):
        q = info(_full(mod, leaf))
        fits = _qweight_fits(q, sinfo[1], zeros, None if g is None else g[1]) if q is not None else []
        if fits:
            found.append((leaf, q, fits))
    if len(found) != 1:
        return None  # none, or several that would do: not this rule's to guess which
    leaf, (dt, shape), fits = found[0]
    return _full(mod, leaf), (f"{_full(mod, leaf)}, {dt} {list(shape)}, is shaped as the {' or '.join(fits)} qweight "
                              f"of scales {list(sinfo[1])}")


def missing_member(names: Iterable[str], info: TensorInfo | None = None) -> tuple[str, str] | None:
    """(layer, what it has and lacks) for the first layer whose tensor names belong to a quantized family but lack
    a required one, or None. Detection asks about a folder no format recognised; convert about the tensors a
    reader carries as pass-through (the parts of a layer that lost its qweight would otherwise be copied as
    float tensors, and the layer silently dropped). With ``info`` (a tensor's dtype and shape) a layer of scales
    beside one unknown tensor shaped as its qweight (``disguised_qweight``) is damaged too, and the tensor named."""
    layers = _layers(names)
    disguised: dict[str, tuple[str, str]] = {}
    if info is not None:
        for mod, leaves in layers.items():
            found = disguised_qweight(mod, leaves, info)
            if found is not None:
                disguised[mod] = found
    for fam, members, own, required in _FAMILIES:
        shared = set(members) - own
        orphan = any(leaves & shared and leaves <= shared | {"bias"} for leaves in layers.values())
        # scales (and other GPTQ/AWQ names that are not the family's own) beside one tensor shaped as its qweight
        lone = [] if fam != "GPTQ/AWQ" else sorted(
            m for m in disguised if len(layers[m] - set(members) - {"bias"}) == 1)
        mods = sorted(layers)
        if not orphan and not any(own & leaves for leaves in layers.values()):
            if not lone:
                continue  # no name belongs to this family alone: "scales" or "weight_scale" beside a weight is not
                # enough; a layer of nothing but them is (no layout keeps scales without the weights they scale)
            mods = lone  # only those layers: another's scales beside tensors of its own may be another layout
        for mod in mods:
            leaves = layers[mod]
            has = [m for m in members if m in leaves]
            if not has or ("weight" in leaves and not own & leaves):
                continue  # a plain weight with a scale beside it is another layout (MLX, FP8), not this one
            missing = [m for m in required if m not in leaves]
            if missing and fam == "GPTQ/AWQ" and mod in disguised and "qweight" in missing:
                return mod, (f"layer {mod or '(top level)'} has {', '.join(has)} but no {', '.join(missing)}: its "
                             f"packed weights are missing or under an unexpected name ({disguised[mod][1]}): a "
                             f"damaged {fam} checkpoint")
            if missing:
                others = sorted(leaves - set(members) - {"bias"})
                extra = f" (it also holds {', '.join(_full(mod, o) for o in others[:4])})" if others else ""
                return mod, (f"layer {mod or '(top level)'} has {', '.join(has)} but no {', '.join(missing)}: a damaged {fam} "
                             f"checkpoint{extra}")
    return None


def _problem(file: str, infos: Mapping[str, tuple[str, tuple[int, ...]]]) -> BadInputError | None:
    """A layer of ``file`` missing a required tensor (or holding its qweight under another name); or, when every
    layer whose names look quantized is complete, the first GPTQ/AWQ one (whose shapes then fit neither layout)."""
    names = {n: shape for n, (_dt, shape) in infos.items()}
    found = missing_member(names, infos.get)
    if found is not None:
        return BadInputError(found[1], file=file)
    for mod, leaves in sorted(_layers(names).items()):
        if "qweight" in leaves and "scales" in leaves:
            desc = ", ".join(f"{m} {list(names[_full(mod, m)])}" for m in _FAMILIES[0][1] if m in leaves)
            return BadInputError(f"layer {mod or '(top level)'} has {desc}, shapes that fit neither GPTQ (qweight packs rows, as many "
                                 "columns as scales) nor AWQ (qweight packs columns)", file=file)
    return None


def raise_incomplete_quantized(path: Path) -> None:
    """Raise bad input for the first weights file at ``path`` (safetensors, then torch pickles: llm-awq's dumps)
    holding a damaged quantized layer, if any."""
    from ..store.tensors import pickle_infos, safetensors_infos

    for file, infos in {**safetensors_infos(path), **pickle_infos(path)}.items():
        err = _problem(file, infos)
        if err is not None:
            raise err


#: the tensor leaves of an unquantized model: a folder whose every tensor is one of these has no quantized layer
_FLOAT_LEAVES = frozenset({"weight", "bias", "inv_freq"})


def raise_float_only(path: Path) -> None:
    """Raise "unsupported" saying so when ``path`` holds only plain float tensors (``*.weight``, ``*.bias``): an
    unquantized model, which w4pack does not quantize; --from, which the generic answer suggests, cannot help."""
    from ..store.tensors import safetensors_infos

    names = [n for per_file in safetensors_infos(path).values() for n in per_file]
    if names and all(n.rpartition(".")[2] in _FLOAT_LEAVES for n in names):
        raise UnsupportedError("no quantized layers: every tensor is a plain float weight (an unquantized model); "
                               "w4pack converts checkpoints that are already quantized (by GPTQ or AWQ tools, "
                               "llm-compressor, llama.cpp): quantize the model first", file=str(path))
