"""Mixture-of-experts names: per-expert checkpoint layers, transformers' module paths, GGUF's stacked tensors.

Why one table: quantized MoE checkpoints (GPTQ, AWQ, compressed-tensors) and w4pack folders store every expert's
projections as separate 2-D layers under the Hub spelling (``model.layers.N.block_sparse_moe.experts.E.w1`` for
Mixtral, ``model.layers.N.mlp.experts.E.gate_proj`` for Qwen2-MoE / Qwen3-MoE / OLMoE). transformers 5 builds these
models with one fused experts module per block (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
[E, H, I]) and renames some paths at load (Mixtral's ``block_sparse_moe`` is ``mlp``). GGUF stacks every expert of
a block into one 3-D tensor (``blk.N.ffn_gate_exps.weight``, shape [E, I, H] in row-major order). This module
answers, without torch: which role (gate, up, down) a per-expert layer plays, where transformers keeps it, and how
GGUF's stacked tensors split into (and stack back from) per-expert layers. See docs/MOE.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["ExpertName", "split_expert_name", "module_path_candidates", "ROLE_OF_LEAF", "LEAVES_BY_STYLE",
           "GGUF_STACKED", "GGUF_MOE_BLOCK", "gguf_expert_leaf_style", "split_stacked", "stack_experts",
           "stacked_gguf_name", "parse_stacked_gguf_name", "per_expert_hf_names", "expert_layer_names",
           "MODULE_RENAMES", "plan_gguf_stacks"]

#: per-expert leaf name -> role in the gated MLP (gate_up: w4pack's own --fuse gate-up of one expert)
ROLE_OF_LEAF: dict[str, str] = {"w1": "gate", "w3": "up", "w2": "down",
                                "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                                "gate_up_proj": "gate_up"}
#: spelling style -> the (gate, up, down) leaves of one expert
LEAVES_BY_STYLE: dict[str, tuple[str, str, str]] = {"mixtral": ("w1", "w3", "w2"),
                                                    "proj": ("gate_proj", "up_proj", "down_proj")}

_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<index>\d+)\.(?P<leaf>w1|w2|w3|gate_proj|up_proj|down_proj|"
                     r"gate_up_proj)(?P<tail>\.[a-z_]+)?$")

#: checkpoint spelling -> transformers module spelling, as transformers renames at load (conversion_mapping.py)
MODULE_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.block_sparse_moe(?=\.|$)"), ".mlp"),
)


@dataclass(frozen=True)
class ExpertName:
    """One per-expert name split up: ``<block>.experts.<index>.<leaf><tail>``."""

    block: str  #: the MoE block's path in the checkpoint (``model.layers.0.block_sparse_moe``)
    index: int
    leaf: str  #: w1 / w3 / w2 or gate_proj / up_proj / down_proj (gate_up_proj when fused)
    tail: str  #: "" for a layer name, ".weight" etc. for a tensor name

    @property
    def role(self) -> str:
        return ROLE_OF_LEAF[self.leaf]

    @property
    def experts_path(self) -> str:
        return f"{self.block}.experts"


def split_expert_name(name: str) -> ExpertName | None:
    """The parts of a per-expert layer or tensor name, or None for anything else."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    return ExpertName(m.group("block"), int(m.group("index")), m.group("leaf"), m.group("tail") or "")


def module_path_candidates(path: str) -> list[str]:
    """``path`` as the checkpoint spells it, then as transformers may spell it (``block_sparse_moe`` -> ``mlp``).

    The caller takes the first one the model has: older transformers keep the checkpoint spelling."""
    out = [path]
    for pat, repl in MODULE_RENAMES:
        alt = pat.sub(repl, path)
        if alt not in out:
            out.append(alt)
    return out


def expert_layer_names(block: str, num_experts: int, style: str) -> list[str]:
    """Every per-expert layer name of one block in checkpoint order (expert-major, gate, up, down)."""
    leaves = LEAVES_BY_STYLE[style]
    return [f"{block}.experts.{e}.{leaf}" for e in range(num_experts) for leaf in leaves]


# -------------------------------------------------------------------------------------------------
# GGUF: blk.N.ffn_{gate,up,down}_exps.weight [E, rows, cols] <-> per-expert 2-D layers
# -------------------------------------------------------------------------------------------------
#: GGUF stacked-expert tensor kind -> role
GGUF_STACKED: dict[str, str] = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_ROLE_INDEX = {"gate": 0, "up": 1, "down": 2}
#: GGUF arch -> (MoE block's sub-path in transformers' checkpoint spelling, leaf style)
GGUF_MOE_BLOCK: dict[str, tuple[str, str]] = {
    "llama": ("block_sparse_moe", "mixtral"),  # llama.cpp writes Mixtral as arch "llama" with expert_count
    "mixtral": ("block_sparse_moe", "mixtral"),
    "qwen2moe": ("mlp", "proj"),
    "qwen3moe": ("mlp", "proj"),
    "olmoe": ("mlp", "proj"),
}
_GGUF_STACKED_NAME = re.compile(r"^blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight$")


def gguf_expert_leaf_style(arch: str) -> tuple[str, str] | None:
    return GGUF_MOE_BLOCK.get(arch)


def parse_stacked_gguf_name(name: str) -> tuple[int, str] | None:
    """(block number, role) of a GGUF stacked-experts tensor name, or None."""
    m = _GGUF_STACKED_NAME.match(name)
    return None if m is None else (int(m.group(1)), GGUF_STACKED[m.group(2)])


def stacked_gguf_name(block: int, role: str) -> str:
    kind = next(k for k, r in GGUF_STACKED.items() if r == role)
    return f"blk.{block}.{kind}.weight"


def per_expert_hf_names(arch: str, block: int, role: str, num_experts: int) -> list[str] | None:
    """The transformers (checkpoint-spelling) layer names of one GGUF stacked tensor's experts, in order."""
    spec = GGUF_MOE_BLOCK.get(arch)
    if spec is None:
        return None
    sub, style = spec
    leaf = LEAVES_BY_STYLE[style][_ROLE_INDEX[role]]
    return [f"model.layers.{block}.{sub}.experts.{e}.{leaf}" for e in range(num_experts)]


def split_stacked(arr: np.ndarray) -> list[np.ndarray]:
    """Per-expert views of a stacked tensor whose first axis is the expert (3-D values or 3-D raw blocks).

    GGUF stores ``[E, rows, cols]`` row-major with each expert's rows contiguous, and a quantized type's blocks
    never cross a row, so expert ``e``'s bytes are exactly ``arr[e]``: the split is lossless for every type."""
    if arr.ndim < 2:
        raise ValueError(f"a stacked experts tensor needs an expert axis, got shape {list(arr.shape)}")
    return [arr[e] for e in range(arr.shape[0])]


def stack_experts(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The inverse of ``split_stacked``: per-expert arrays of one shape and dtype -> [E, ...]."""
    if not parts:
        raise ValueError("no experts to stack")
    first = parts[0]
    for i, p in enumerate(parts[1:], 1):
        if p.shape != first.shape or p.dtype != first.dtype:
            raise ValueError(f"expert {i} is {list(p.shape)} {p.dtype}, expert 0 is {list(first.shape)} "
                             f"{first.dtype}: experts of one tensor must match")
    return np.stack([np.asarray(p) for p in parts], axis=0)


_LAYER_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(block_sparse_moe|mlp)$")


def plan_gguf_stacks(layer_names: Sequence[str]) -> dict[str, list[str]]:
    """{GGUF stacked tensor name: per-expert layer names in expert order} for a writer; every expert 0..E-1 of a
    block and role must be present (a stacked tensor has no holes), else ValueError naming the first gap."""
    groups: dict[str, dict[int, str]] = {}
    for name in layer_names:
        ex = split_expert_name(name)
        if ex is None or ex.tail or ex.role == "gate_up":
            continue
        m = _LAYER_BLOCK.match(ex.block)
        if m is None:
            continue
        groups.setdefault(stacked_gguf_name(int(m.group(1)), ex.role), {})[ex.index] = name
    out: dict[str, list[str]] = {}
    for gname, by_index in groups.items():
        missing = [e for e in range(max(by_index) + 1) if e not in by_index]
        if missing:
            raise ValueError(f"{gname}: expert {missing[0]} is missing; GGUF stacks every expert of a block")
        out[gname] = [by_index[e] for e in range(len(by_index))]
    return out
