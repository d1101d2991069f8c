"""The fused-MoE method that serves packed experts: create → load → process → apply, with no vLLM import.

vLLM builds one ``RoutedExperts`` layer per MoE block and loads each expert's gate (``w1``), up (``w3``) and down
(``w2``) projections into stacked parameters ``w13_*`` and ``w2_*``. This method registers one placeholder per
packed tensor name under those stems (``w13_qweight``, ``w2_scales``, …), so vLLM's expert mapping hands each
checkpoint tensor to our loader with its expert id and shard id; nothing is stacked or cut at load.

* **process**: per expert, the rank's share is cut by ``w4pack.tp`` exactly as for dense layers (gate and up are
  column-parallel over the intermediate rows, down is row-parallel over the intermediate channels), gate and up
  stacked into one packed layer where their structure along K allows.
* **apply**: vLLM's router has chosen ``topk_ids``/``topk_weights``; each expert runs on the tokens routed to it,
  ``down(act(gate(x)) · up(x)) · weight`` summed per token, in expert order. The engine all-reduces the ranks'
  sums afterwards. While a CUDA graph is being captured no host sync is allowed, so there every expert runs on
  every token with its routing weight (zero where not chosen): the same sum, more work. Traced by
  ``torch.compile`` (vLLM-CPU calls the MoE block without its own opaque op, and compiles with ``fullgraph``),
  the routed loop is the custom op ``w4pack::moe_experts``: one opaque node, since the loop's shapes depend on
  the routing.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import BadInputError, UnsupportedError
from ..runtime.tp import column_slice, row_parallel, stack_blockers, stack_rows
from .method import (_check_native, _device_of, _stored_dtype, _threads, linear_modules, packed_part,
                     precision_from_env)
from .plan import LayerPart

__all__ = ["MoEPlan", "PackedMoEMethod", "plan_for_layer"]

#: the engine's shard ids: gate, up (both into w13) and down (w2)
SHARDS = ("w1", "w3", "w2")
_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
}


# Engine MoE layers by handle, so the custom op (which takes only tensors and scalars) can find their experts.
_LAYERS: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)


@dataclass
class MoEPlan:
    """The packed layers behind one engine MoE block: ``experts[e][shard]`` for shard ids w1, w3, w2."""

    prefix: str
    experts: list[dict[str, LayerPart]]

    def suffixes(self, stem: str) -> list[str]:
        """The packed tensor names the experts store for ``w13`` (gate and up) or ``w2`` (down)."""
        shards = ("w1", "w3") if stem == "w13" else ("w2",)
        out: list[str] = []
        for parts in self.experts:
            for s in shards:
                for suffix in parts[s].meta["tensors"]:
                    if suffix != "bias" and suffix not in out:
                        out.append(suffix)
        return out


def plan_for_layer(checkpoint: Any, layer: nn.Module, prefix: str) -> MoEPlan | None:
    """The ``MoEPlan`` of engine ``RoutedExperts`` layer ``prefix`` (None when its experts are stored float).

    Expert parallelism and EPLB are refused first: there the engine counts physical experts (redundant copies
    included) and places them by rank, which the checkpoint's per-expert layers say nothing about. The plan
    covers the checkpoint's (logical) experts."""
    cfg = layer.moe_config
    par = cfg.moe_parallel_config
    leaves = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
    logical = int(getattr(cfg, "num_logical_experts", None) or layer.global_num_experts)
    plan = checkpoint.moe_plan(prefix, leaves, logical)
    if plan is not None and (par.use_ep or getattr(par, "enable_eplb", False)
                             or int(layer.global_num_experts) != logical):
        raise UnsupportedError("expert parallelism or EPLB (each rank holding some experts, or redundant copies) "
                               "on packed experts; serve them with tensor parallelism", tensor=prefix)
    return plan


class PackedMoEMethod:
    """Serve one engine ``RoutedExperts`` layer from the packed per-expert layers of a ``MoEPlan``."""

    def __init__(self, plan: MoEPlan, *, precision: str | None = None, threads: int | None = None):
        self.plan = plan
        self.precision = precision or precision_from_env()
        self.threads = threads

    # -- create ----------------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any) -> None:
        cfg = layer.moe_config
        par = cfg.moe_parallel_config
        prefix = self.plan.prefix
        if par.use_ep or num_experts != len(self.plan.experts):
            raise UnsupportedError("expert parallelism (each rank holding some experts) on packed experts; serve "
                                   "them with tensor parallelism", tensor=prefix)
        act = getattr(cfg.activation, "value", cfg.activation)
        if act not in _ACTIVATIONS or cfg.swiglu_limit is not None:
            raise UnsupportedError(f"experts with activation {act!r}; packed experts run gated "
                                   f"{', '.join(_ACTIVATIONS)}", tensor=prefix)
        if cfg.has_bias or getattr(layer, "apply_router_weight_on_input", False):
            raise UnsupportedError("experts with biases or router weights applied to their inputs", tensor=prefix)
        inter = intermediate_size_per_partition * par.tp_size
        for e, parts in enumerate(self.plan.experts):
            for s, want in (("w1", [inter, hidden_size]), ("w3", [inter, hidden_size]), ("w2", [hidden_size, inter])):
                if list(parts[s].shape) != want:
                    raise BadInputError(f"the checkpoint's expert layer is {list(parts[s].shape)}, the model's "
                                        f"expert {e} needs {want}", tensor=parts[s].name)
        _check_native(torch.empty(0).device, prefix)
        layer.w4pack_loaded = {}
        layer.w4pack_params = []
        for stem in ("w13", "w2"):
            for suffix in self.plan.suffixes(stem):
                param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
                param.weight_loader = self._loader(layer, suffix)
                layer.register_parameter(f"{stem}_{suffix}", param)
                layer.w4pack_params.append(f"{stem}_{suffix}")

    def _loader(self, layer: nn.Module, suffix: str) -> Any:
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str = "", shard_id: str = "",
                 expert_id: int = -1, return_success: bool = False) -> bool | None:
            if shard_id not in SHARDS or not 0 <= int(expert_id) < len(self.plan.experts):
                raise BadInputError(f"the engine loaded expert {expert_id} shard {shard_id!r}, which the "
                                    "checkpoint does not have", tensor=self.plan.prefix)
            part = self.plan.experts[int(expert_id)][shard_id]
            want = _stored_dtype(suffix, part.meta)
            if loaded_weight.dtype != want:
                raise BadInputError(f"stored as {loaded_weight.dtype}, the manifest says {want}",
                                    tensor=f"{part.name}.{suffix}")
            layer.w4pack_loaded.setdefault((int(expert_id), shard_id), {})[suffix] = \
                loaded_weight.detach().to("cpu", copy=True)
            return True if return_success else None
        return load

    # -- process ---------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        par = layer.moe_config.moe_parallel_config
        rank, size = int(par.tp_rank), int(par.tp_size)
        device = _device_of(layer)
        loaded = layer.w4pack_loaded
        threads = self.threads if self.threads is not None else _threads()
        dtype = getattr(layer, "params_dtype", torch.float16)
        w13, w2, pads = [], [], []
        for e, parts in enumerate(self.plan.experts):
            full = {s: packed_part(parts[s], loaded.get((e, s)) or {}) for s in SHARDS}
            inter = parts["w1"].shape[0]
            lo, hi = rank * inter // size, (rank + 1) * inter // size
            pieces = [column_slice(full[s], lo, hi, name=parts[s].name) if size > 1 else full[s]
                      for s in ("w1", "w3")]
            if not stack_blockers(pieces):
                pieces = [stack_rows(pieces, name=f"{self.plan.prefix}.{e}")]
            shard = row_parallel(full["w2"], size, rank, name=parts["w2"].name)
            mods = linear_modules(pieces + [shard.packed], device, dtype, self.precision, threads)
            w13.append(nn.ModuleList(mods[:-1]))
            w2.append(mods[-1])
            pads.append(int(shard.input_pad))
        for name in layer.w4pack_params:
            del layer._parameters[name]
        layer.w4pack_loaded = None
        layer.w4pack_w13 = nn.ModuleList(w13)
        layer.w4pack_w2 = nn.ModuleList(w2)
        layer.w4pack_w2_pad = pads
        layer.w4pack_act = _ACTIVATIONS[getattr(layer.moe_config.activation, "value", layer.moe_config.activation)]
        layer.w4pack_handle = next(_NEXT_HANDLE)
        _LAYERS[layer.w4pack_handle] = layer

    # -- apply -----------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts: Any = None, shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # traced graphs see one opaque node: the routed loop reads the routing on the host (data-dependent
            # shapes, which a fullgraph trace refuses)
            return torch.ops.w4pack.moe_experts(x, topk_weights, topk_ids, layer.w4pack_handle)
        return _routed(layer, x, topk_weights, topk_ids)

    @staticmethod
    def _expert(layer: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        mods = layer.w4pack_w13[e]
        h = mods[0].linear(x) if len(mods) == 1 else torch.cat([m.linear(x) for m in mods], dim=-1)
        gate, up = h.chunk(2, dim=-1)
        a = layer.w4pack_act(gate) * up
        pad = layer.w4pack_w2_pad[e]
        if pad:
            a = torch.nn.functional.pad(a, (0, pad))
        return layer.w4pack_w2[e].linear(a)


def _routed(layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Σ over each token's chosen experts of weight · expert(x), each expert run once on the tokens routed to it.

    The weighted sum is formed in float32 and rounded to the model's dtype once, as vLLM's own MoE kernels do
    (summed in fp16 or bf16, each of top-k additions would round)."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return acc.to(x.dtype)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        for e in range(len(layer.w4pack_w2)):  # no host sync: every expert, weighted (0 where not chosen)
            weight = (topk_weights.float() * (topk_ids == e)).sum(dim=-1, keepdim=True)
            acc += PackedMoEMethod._expert(layer, e, x).float() * weight
        return acc.to(x.dtype)
    for e in torch.unique(topk_ids).tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        y = PackedMoEMethod._expert(layer, int(e), x[rows])
        acc.index_add_(0, rows, y.float() * topk_weights[rows, slot].unsqueeze(-1).float())
    return acc.to(x.dtype)


@torch.library.custom_op("w4pack::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    handle: int) -> torch.Tensor:
    """The routed experts of engine MoE layer ``handle`` on ``x`` (``_routed``), as one opaque node."""
    layer = _LAYERS.get(handle)
    if layer is None:
        raise RuntimeError(f"w4pack::moe_experts: MoE layer {handle} no longer exists")
    return _routed(layer, x, topk_weights, topk_ids)


@_moe_experts_op.register_fake
def _moe_experts_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      handle: int) -> torch.Tensor:
    return torch.empty_like(x)
