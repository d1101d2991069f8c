"""The linear method that serves packed layers: create → load → process → apply, with no vLLM import.

vLLM's ``LinearMethodBase`` is mixed in by ``w4pack.vllm.plugin``; keeping the work here lets the tests drive
the same code on CPU and CUDA tensors where vLLM is not installed (the GPU machine has none).

* **create**: one placeholder parameter per packed tensor the checkpoint stores for the layer (``qweight``,
  ``scales``, ``zeros``/``mins``, ``perm``; or their compact forms, docs/LAYOUT.md §8, expanded at process). Each has its own ``weight_loader``, so the engine hands it the
  *full, unsharded* checkpoint tensor (for merged layers once per part, with the part's shard id).
* **process**: the rank's share is cut from the full packed layers by ``w4pack.tp`` (column-parallel: the
  rank's output rows of each part; row-parallel: the rank's input channels, regrouped) and the parts are
  stacked into one packed layer where their structure along K allows (one GEMM), else kept apart.
  The placeholders are removed; the packed weights live in ``W4Linear`` modules under ``layer.w4pack``.
* **apply**: the ``w4pack::linear`` custom op (through ``W4Linear.forward``), so ``torch.compile`` sees one
  opaque node and CUDA graphs capture the kernel launch; the engine's bias is added after.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import BadInputError, UnsupportedError
from ..core.compact import expand
from ..core.layout import PackedLayer
from ..runtime.torch_module import PRECISIONS, W4Embedding, W4Linear
from ..runtime.tp import column_slice, row_parallel, stack_blockers, stack_rows
from .plan import LayerPart, LayerPlan

__all__ = ["PackedLinearMethod", "TiedHeadMethod", "is_qkv", "layer_partition", "precision_from_env"]

#: stored dtype of each packed tensor, by the manifest's names
_SCALE_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def precision_from_env() -> str:
    """``$W4PACK_PRECISION`` (``exact``, the default, or ``fast``): the CPU GEMM's path, as ``run --precision``."""
    value = os.environ.get("W4PACK_PRECISION", "exact")
    if value not in PRECISIONS:
        raise BadInputError(f"W4PACK_PRECISION={value!r} is not one of {', '.join(PRECISIONS)}")
    return value


def layer_partition(layer: nn.Module) -> tuple[str, int, int]:
    """(kind, tp_rank, tp_size) of an engine layer; kind is column, row, replicated or vocab (a token embedding or
    output head split by vocabulary rows, each rank's share padded to the engine's partition size)."""
    names = {c.__name__ for c in type(layer).__mro__}
    rank, size = int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))
    if "VocabParallelEmbedding" in names:
        return "vocab", rank, size
    if "RowParallelLinear" in names:
        return "row", rank, size
    if "ColumnParallelLinear" in names:
        return "column", rank, size
    if "ReplicatedLinear" in names:
        return "replicated", 0, 1
    raise UnsupportedError(f"w4pack cannot serve a {type(layer).__name__} layer (column-parallel, row-parallel "
                           "and replicated linear layers, token embeddings and output heads are supported)",
                           tensor=getattr(layer, "prefix", None))


def _stored_dtype(suffix: str, meta: dict[str, Any]) -> torch.dtype:
    if suffix in ("scales", "mins"):
        return _SCALE_TORCH[meta["scale_dtype"]]
    if suffix == "zeros":
        return torch.uint8 if meta["storage_bits"] == 4 else torch.uint16
    if suffix in ("scales_d", "mins_d"):  # the compact storage (docs/LAYOUT.md §8)
        return torch.float16
    if suffix in ("qdense", "qindex", "scales_q", "mins_q"):
        return torch.uint8
    return torch.int32  # qweight, perm


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A loaded checkpoint tensor as the numpy array layout.py expects (bf16 and uint16 as uint16 bits)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.bfloat16, torch.uint16):
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    return t.numpy().copy()


class PackedLinearMethod:
    """Serve one engine linear layer from the packed layers of a ``LayerPlan``."""

    def __init__(self, plan: LayerPlan, *, precision: str | None = None, threads: int | None = None):
        self.plan = plan
        self.precision = precision or precision_from_env()
        self.threads = threads

    # -- create ----------------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra: Any) -> None:
        kind, rank, size = layer_partition(layer)
        full = _full_sizes(layer, kind, size, output_partition_sizes)
        self._split_stored_merge(full)
        self._check_shapes(input_size, full)
        device = torch.empty(0).device
        _check_native(device, self.plan.prefix)
        layer.w4pack_loaded = {}
        first = {s: p.meta for p in reversed(self.plan.parts) for s in p.meta["tensors"]}
        for suffix in self.plan.suffixes():
            param = nn.Parameter(torch.empty(0, dtype=_stored_dtype(suffix, first[suffix])), requires_grad=False)
            param.weight_loader = self._loader(layer, suffix)
            layer.register_parameter(suffix, param)
        layer.w4pack_params = self.plan.suffixes()

    def _split_stored_merge(self, full: list[int]) -> None:
        """A checkpoint that stores a merged layer itself (Phi-3's qkv_proj, gate_up_proj) holds the engine's parts
        (unsharded rows ``full``) in order: cut it so, as a --fuse'd layer's table does, and each rank takes its
        share of every part."""
        parts = self.plan.parts
        if len(parts) == 1 and not parts[0].sub_rows and len(full) > 1 and sum(full) == parts[0].shape[0]:
            bounds = np.cumsum([0] + full)
            parts[0].sub_rows = [(f"{parts[0].name}[{i}]", int(bounds[i]), int(bounds[i + 1]))
                                 for i in range(len(full))]

    def _check_shapes(self, input_size: int, full: list[int]) -> None:
        """The checkpoint's layers must have the shapes the engine's model builds (``full``: each part's unsharded
        rows); say which does not."""
        parts = self.plan.parts
        rows: list[tuple[str, int]] = []
        for p in parts:
            rows += [(n, hi - lo) for n, lo, hi in p.sub_rows] if p.sub_rows else [(p.name, p.shape[0])]
        for p in parts:
            if p.shape[1] != input_size:
                raise BadInputError(f"the checkpoint's layer takes {p.shape[1]} inputs, the model's "
                                    f"{self.plan.prefix} takes {input_size}", tensor=p.name)
        if len(full) != len(rows) or any(a != n for a, (_, n) in zip(full, rows)):
            raise BadInputError(f"the checkpoint's output rows {[n for _, n in rows]} do not match the model's "
                                f"{full} for {self.plan.prefix}", tensor=rows[0][0])

    def _loader(self, layer: nn.Module, suffix: str) -> Any:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            if shard_id is None:
                shard_id = getattr(loaded, "shard_id", None)
            want = _stored_dtype(suffix, self._part(shard_id).meta)
            if loaded.dtype != want:
                raise BadInputError(f"stored as {loaded.dtype}, the manifest says {want}",
                                    tensor=f"{self._part(shard_id).name}.{suffix}")
            layer.w4pack_loaded.setdefault(shard_id, {})[suffix] = loaded.detach().to("cpu", copy=True)
        return load

    def _part(self, shard_id: Any) -> LayerPart:
        for p in self.plan.parts:
            if p.shard == shard_id or len(self.plan.parts) == 1:
                return p
        raise BadInputError(f"the engine loaded shard {shard_id!r}, which the plan does not have",
                            tensor=self.plan.prefix)

    # -- process ---------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        kind, rank, size = layer_partition(layer)
        device = _device_of(layer)
        loaded = getattr(layer, "w4pack_loaded", {})
        own_bias = bool(getattr(layer, "has_bias", False))  # vLLM loads and adds the checkpoint's bias itself
        full: list[tuple[LayerPart, PackedLayer]] = []
        for p in self.plan.parts:
            tensors = loaded.get(p.shard if len(self.plan.parts) > 1 else next(iter(loaded), None)) or {}
            packed = packed_part(p, tensors)
            if p.extra_bias is not None and not own_bias:
                packed.tensors["bias"] = np.asarray(p.extra_bias)
                packed.meta["bias_dtype"] = p.meta.get("bias_dtype")
            full.append((p, packed))
        for suffix in getattr(layer, "w4pack_params", []):
            if suffix in layer._parameters:
                del layer._parameters[suffix]
        layer.w4pack_loaded = None

        pad = out_pad = 0
        if kind == "vocab":
            (p, packed), = full
            lo, hi, out_pad = _vocab_rows(layer, p)
            pieces = [column_slice(packed, lo, hi, name=p.name) if (lo, hi) != (0, p.shape[0]) else packed]
        elif kind == "row":
            (p, packed), = full
            shard = row_parallel(packed, size, rank, name=p.name)
            if rank == 0 and p.extra_bias is not None and not own_bias:  # the engine adds a bias once, after the sum: so do we
                shard.packed.tensors["bias"] = np.asarray(p.extra_bias)
                shard.packed.meta["bias_dtype"] = p.meta.get("bias_dtype")
            pieces, pad = [shard.packed], shard.input_pad
        else:
            pieces = []
            for p, packed in full:
                for lo, hi in _rank_rows(layer, kind, rank, size, p, len(pieces)):
                    pieces.append(column_slice(packed, lo, hi, name=p.name)
                                  if (lo, hi) != (0, p.shape[0]) else packed)
            _even_out_biases(pieces)
            if len(pieces) > 1 and not stack_blockers(pieces):
                pieces = [stack_rows(pieces, name=self.plan.prefix)]
        threads = self.threads if self.threads is not None else _threads()
        dtype = getattr(layer, "params_dtype", torch.float16)
        if kind == "vocab" and self.plan.parts[0].meta.get("role") == "embedding":
            emb = W4Embedding(pieces[0].meta, dtype=dtype, device="meta", precision=self.precision, threads=threads)
            emb.load_packed(pieces[0], device=device)
            emb.serves_head = bool(getattr(layer, "w4pack_serves_head", False))
            mods = [emb.prepare(device, dtype)]
        else:
            mods = linear_modules(pieces, device, dtype, self.precision, threads)
        layer.w4pack = nn.ModuleList(mods)
        layer.w4pack_input_pad = pad
        layer.w4pack_output_pad = out_pad

    # -- apply -----------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        pad = layer.w4pack_input_pad
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        mods = layer.w4pack
        if len(mods) == 1:
            y = mods[0].linear(x)
        else:
            y = torch.cat([m.linear(x) for m in mods], dim=-1)
        out_pad = getattr(layer, "w4pack_output_pad", 0)
        if out_pad:  # the engine's vocabulary padding: logits it cuts off before sampling
            y = torch.nn.functional.pad(y, (0, out_pad))
        if bias is not None:
            y = y + bias
        return y

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows of a packed token embedding (the rank's vocabulary share; the engine masks other ranks' ids)."""
        return layer.w4pack[0](ids)

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        """A config that ties the head (``tie_word_embeddings``) while the checkpoint stores a packed head of its
        own: the head stays the checkpoint's, as in ``w4pack run`` (vLLM's default would share a float
        ``weight`` that a packed embedding does not have)."""
        return layer


class TiedHeadMethod:
    """The output head of a model whose head is tied to a packed token embedding: the logits are the native GEMM
    over the embedding's own packed weights (no second copy). Nothing is loaded for the head itself."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def create_weights(self, layer: nn.Module, *args: Any, **extra: Any) -> None:
        layer.w4pack_tied = None

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        ours, theirs = layer.shard_indices, embed_tokens.shard_indices
        if (ours.org_vocab_start_index, ours.org_vocab_end_index, layer.num_embeddings_per_partition) != \
                (theirs.org_vocab_start_index, theirs.org_vocab_end_index, embed_tokens.num_embeddings_per_partition):
            raise UnsupportedError("the output head is tied to the packed token embedding but the engine splits "
                                   "their vocabularies differently", tensor=self.prefix)
        layer.w4pack_tied = embed_tokens
        embed_tokens.w4pack_serves_head = True
        return layer

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "w4pack_tied", None) is None:
            raise BadInputError("the checkpoint has no output head of its own (packed or float), and the model "
                                "does not tie it to the token embedding", tensor=self.prefix)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return PackedLinearMethod.apply(self, layer.w4pack_tied, x, bias)  # type: ignore[arg-type]


def packed_part(part: LayerPart, tensors: dict[str, torch.Tensor]) -> PackedLayer:
    """One checkpoint layer as the engine loaded it, in the runtime form (compact storage expanded exactly as the
    storage layer expands it), without a bias: the engine's own bias parameter carries the checkpoint's."""
    missing = [s for s in part.meta["tensors"] if s != "bias" and s not in tensors]
    if missing:
        raise BadInputError("the engine loaded no data for this tensor", tensor=f"{part.name}.{missing[0]}")
    arrays = {s: _to_numpy(t) for s, t in tensors.items()}
    meta = {k: v for k, v in part.meta.items() if k not in ("tensors", "storage")}
    if part.meta.get("storage"):
        arrays = expand(part.meta, arrays, part.name)
    meta["bias_dtype"] = None
    return PackedLayer(meta=meta, tensors=arrays)


def linear_modules(pieces: list[PackedLayer], device: torch.device, dtype: torch.dtype, precision: str,
                   threads: int) -> list[W4Linear]:
    """A ``W4Linear`` per packed piece; on CUDA prepared now for the model dtype, so that graph capture
    allocates nothing."""
    mods = [W4Linear.from_packed(pc, device=device, precision=precision, threads=threads) for pc in pieces]
    if device.type == "cuda":
        for m in mods:
            m.prepare(device, dtype if dtype in (torch.float16, torch.bfloat16) else None)
    return mods


def _full_sizes(layer: nn.Module, kind: str, tp_size: int, partition_sizes: list[int]) -> list[int]:
    """The unsharded output rows of each part the engine expects (k/v of a QKV layer may be replicated; a
    vocabulary layer's partitions are padded, its checkpoint rows are the vocabulary)."""
    if kind == "vocab":
        return [int(layer.org_vocab_size)]
    if kind != "column":
        return [int(s) for s in partition_sizes]
    reps = _kv_replicas(layer)
    out = []
    for i, s in enumerate(partition_sizes):
        r = reps if (reps > 1 and i > 0 and is_qkv(layer)) else 1
        out.append(int(s) * tp_size // r)
    return out


def is_qkv(layer: nn.Module) -> bool:
    """A vLLM QKVParallelLinear: its parts are q/k/v (shard ids "q", "k", "v") and k/v may be replicated."""
    return any(c.__name__ == "QKVParallelLinear" for c in type(layer).__mro__)


def _kv_replicas(layer: nn.Module) -> int:
    return int(getattr(layer, "num_kv_head_replicas", 1) or 1)


def _rank_rows(layer: nn.Module, kind: str, rank: int, size: int, part: LayerPart,
               first_index: int) -> list[tuple[int, int]]:
    """Row ranges of ``part`` (in its own rows) that this rank computes, in the engine's output order."""
    subs = part.sub_rows or [(part.name, 0, part.shape[0])]
    if kind == "replicated" or size == 1:
        return [(0, part.shape[0])]
    sizes = list(layer.output_partition_sizes)
    reps = _kv_replicas(layer) if is_qkv(layer) else 1
    out = []
    for j, (_, lo, _hi) in enumerate(subs):
        idx = first_index + j
        per = int(sizes[idx])
        r = rank // reps if (is_qkv(layer) and idx > 0) else rank
        out.append((lo + r * per, lo + (r + 1) * per))
    return out


def _vocab_rows(layer: nn.Module, part: LayerPart) -> tuple[int, int, int]:
    """(first row, end row, padding) of the vocabulary share this rank serves: vLLM pads each rank's share of
    an embedding or head to its partition size and trims the padded logits before sampling."""
    if int(getattr(layer, "num_added_embeddings", 0) or 0):
        raise UnsupportedError("a vocabulary with added (LoRA) tokens on a packed embedding or head",
                               tensor=part.name)
    idx = layer.shard_indices
    lo, hi = int(idx.org_vocab_start_index), int(idx.org_vocab_end_index)
    if hi <= lo:
        raise UnsupportedError(f"tensor-parallel size {int(getattr(layer, 'tp_size', 1))} leaves this rank none "
                               f"of the {part.shape[0]} vocabulary rows", tensor=part.name)
    return lo, hi, int(layer.num_embeddings_per_partition) - (hi - lo)


def _even_out_biases(pieces: list[PackedLayer]) -> None:
    """Give zero biases to the parts without one when another part carries its own, so they still stack."""
    with_bias = [p for p in pieces if "bias" in p.tensors]
    if not with_bias or len(with_bias) == len(pieces):
        return
    dt = with_bias[0].meta.get("bias_dtype")
    arr_dt = np.asarray(with_bias[0].tensors["bias"]).dtype
    for p in pieces:
        if "bias" not in p.tensors:
            p.tensors["bias"] = np.zeros(int(p.meta["shape"][0]), dtype=arr_dt)
            p.meta["bias_dtype"] = dt


def _device_of(layer: nn.Module) -> torch.device:
    for t in list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False)):
        return t.device
    return torch.empty(0).device


def _threads() -> int:
    """$W4PACK_THREADS, else the threads the engine gave this worker (vLLM binds one OpenMP thread per core)."""
    from ..native.cpu import threads_from_env

    return threads_from_env() or torch.get_num_threads()


def _check_native(device: torch.device, prefix: str) -> None:
    """Refuse up front, before any weight is read, when the kernel for the engine's device is missing."""
    if device.type == "cuda":
        from ..native import cuda

        if not cuda.available():
            raise UnsupportedError(f"the w4pack CUDA library is not usable: {cuda.unavailable_reason()}; build it "
                                   "with `make cuda` (or install a w4pack wheel that ships it)", tensor=prefix)
    elif device.type == "cpu":
        from ..native import cpu

        if not cpu.available():
            raise UnsupportedError("the w4pack CPU extension is not built; reinstall w4pack (pip install .)",
                                   tensor=prefix)
        cpu.check_environment()
        _allow_amx()
    else:
        raise UnsupportedError(f"w4pack serves packed layers on cpu and cuda devices, not {device.type}",
                               tensor=prefix)


def _allow_amx() -> None:
    """Ask Linux for the AMX tile state on behalf of vLLM-CPU's attention kernels.

    Those kernels use AMX on CPUs that have it but never request it: oneDNN does, the first time vLLM's own
    float GEMMs run. A model whose every linear layer, embedding and head is packed runs no oneDNN GEMM, and its
    first attention call died of SIGILL (bfloat16). The request is per process and idempotent."""
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init is not None:
        init()
