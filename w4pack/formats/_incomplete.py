"""Why a folder whose tensor names look quantized was recognised by no format.

Detection reads a layer's tensors (GPTQ: qweight beside scales; AWQ: qweight, qzeros, scales; llm-awq's dumps:
qweight, scales, scaled_zeros; compressed-tensors: weight_packed). A checkpoint that lost or renamed one of them is
then recognised by none, and "unknown format" (exit 3) would send the user to --from for a file that is simply
damaged. When the names clearly belong to a quantized layout, the damaged layer is bad input (exit 2), named with
what it has and what it lacks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ..errors import BadInputError, UnsupportedError

__all__ = ["raise_incomplete_quantized", "missing_member", "raise_float_only"]

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


def missing_member(names: Iterable[str]) -> tuple[str, str] | None:
    """(layer, what it has and lacks) for the first layer whose tensor names belong to a quantized family but lack
    a required one, or None. Detection asks about a folder no format recognised; convert about the tensors a
    reader carries as pass-through (the parts of a layer that lost its qweight would otherwise be copied as
    float tensors, and the layer silently dropped)."""
    layers = _layers(names)
    for fam, members, own, required in _FAMILIES:
        shared = set(members) - own
        orphan = any(leaves & shared and leaves <= shared | {"bias"} for leaves in layers.values())
        if not orphan and not any(own & leaves for leaves in layers.values()):
            continue  # no name belongs to this family alone: "scales" or "weight_scale" beside a weight is not
            # enough; a layer of nothing but them is (no layout keeps scales without the weights they scale)
        for mod in sorted(layers):
            leaves = layers[mod]
            has = [m for m in members if m in leaves]
            if not has or ("weight" in leaves and not own & leaves):
                continue  # a plain weight with a scale beside it is another layout (MLX, FP8), not this one
            missing = [m for m in required if m not in leaves]
            if missing:
                others = sorted(leaves - set(members) - {"bias"})
                extra = f" (it also holds {', '.join(_full(mod, o) for o in others[:4])})" if others else ""
                return mod, (f"layer {mod or '(top level)'} has {', '.join(has)} but no {', '.join(missing)}: a damaged {fam} "
                             f"checkpoint{extra}")
    return None


def _problem(file: str, names: dict[str, tuple[int, ...]]) -> BadInputError | None:
    """A layer of ``file`` missing a required tensor; or, when every layer whose names look quantized is complete,
    the first GPTQ/AWQ one (whose shapes then fit neither layout)."""
    found = missing_member(names)
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
    from ..store.tensors import pickle_names, safetensors_names

    for file, names in {**safetensors_names(path), **pickle_names(path)}.items():
        err = _problem(file, names)
        if err is not None:
            raise err


#: the tensor leaves of an unquantized model: a folder whose every tensor is one of these has no quantized layer
_FLOAT_LEAVES = frozenset({"weight", "bias", "inv_freq"})


def raise_float_only(path: Path) -> None:
    """Raise "unsupported" saying so when ``path`` holds only plain float tensors (``*.weight``, ``*.bias``): an
    unquantized model, which w4pack does not quantize; --from, which the generic answer suggests, cannot help."""
    from ..store.tensors import safetensors_names

    files = safetensors_names(path)
    names = [n for per_file in files.values() for n in per_file]
    if names and all(n.rpartition(".")[2] in _FLOAT_LEAVES for n in names):
        raise UnsupportedError("no quantized layers: every tensor is a plain float weight (an unquantized model); "
                               "w4pack converts checkpoints that are already quantized (by GPTQ or AWQ tools, "
                               "llm-compressor, llama.cpp): quantize the model first", file=str(path))
