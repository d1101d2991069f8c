"""The lean CPU decode loop: a llama-family step of our own around the native kernels, batch 1.

Why: at batch 1 on a small model the native GEMMs take a few milliseconds per token, but transformers' step around
them (module calls, the dynamic cache, sdpa, the generate loop's processors and stopping criteria) costs as much
again or more. This loop runs the same arithmetic with the fewest Python and torch calls per token:

* each projection is one prebound native call into buffers allocated once (no wrapper, no argument checks per call);
  q/k/v and gate/up run as one stacked GEMM each (the packed layers are stacked along N when their group structure
  matches, losslessly: each output row is computed by the same tile code as before);
* the KV cache is a preallocated float tensor per layer, attention at one query is two small matmuls and a softmax;
* the rotary tables are computed once for every position (only for RoPE types whose angles depend on the position
  alone);
* greedy and sampled selection follow transformers' processors (temperature, top-k, top-p, then one multinomial
  draw), so a seeded run draws the same tokens.

What it runs: float32 models whose decoder layers are llama's (llama, mistral without a sliding window, qwen2 and qwen3
without sliding layers): RMSNorm, rotary attention with grouped KV heads (qwen3: each query and key head RMS-normalized
before the rotary), a gated SiLU MLP. ``LeanDecoder.build`` raises ``NotLean`` with the reason for anything else;
``use_lean_decode`` then leaves transformers' generate in place and records the reason (``decode_mode``). A ``generate``
call that asks for something the loop does not do (batch > 1, beams, a padding mask, output scores, other processors) is
answered by transformers' generate, and the reason is recorded the same way.

The model walk (``walk``: the checks and their reasons), the llama arithmetic of the prompt pass and the token
selection (``LoopBase``), the layer stacking and the ``generate`` wrapper are shared with the CUDA-graph loop
(``w4pack.runtime.lean_cuda``), which ``use_lean_decode`` picks for a model on CUDA.
"""
from __future__ import annotations

import copy
import gc
import threading
from typing import Any

import torch
from torch import nn


__all__ = ["LeanDecoder", "NotLean", "use_lean_decode", "remove_lean_decode", "LEAN", "stack_packed", "walk"]

LEAN = "lean"
#: model types whose decoder layer is llama's (checked module by module as well)
_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
#: generation options the loop implements; any other option that differs from its default goes to transformers
_OPTIONS = {"max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
            "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "transformers_version", "_from_model_config"}


class NotLean(Exception):
    """The model or the call is not one the lean loop runs; the message says why (one line)."""


# -- stacking packed layers --------------------------------------------------------------------------
def stack_packed(layers: list[Any]) -> Any:
    """PackedLayers stacked along N as one layer, or None when they cannot be stacked losslessly.

    Layout v1 keeps 16 output rows per stripe (``qweight`` rows) and one column per output row in scales, zeros
    and minima, so layers whose N is a multiple of 16 and whose group structure along K is the same (bits, group
    size, zero mode, scale dtype, K and the act-order permutation) stack by concatenation, with no repacking.
    """
    import numpy as np

    from ..core.layout import PackedLayer

    first = layers[0].meta
    keys = ("bits", "storage_bits", "group_size", "zero_mode", "scale_dtype", "padded_groups")
    k = int(first["shape"][1])
    for lay in layers:
        m = lay.meta
        if any(m.get(key) != first.get(key) for key in keys) or int(m["shape"][1]) != k:
            return None
        if int(m["shape"][0]) % 16 or int(m["padded_shape"][0]) != int(m["shape"][0]):
            return None
        if bool(m.get("act_order")) != bool(first.get("act_order")):
            return None
        if m.get("act_order") and not np.array_equal(lay.tensors["perm"], layers[0].tensors["perm"]):
            return None
    has_bias = ["bias" in lay.tensors for lay in layers]
    if any(has_bias) and not all(has_bias):
        return None
    if all(has_bias) and len({np.asarray(lay.tensors["bias"]).dtype for lay in layers}) != 1:
        return None
    tensors = {"qweight": np.concatenate([np.asarray(lay.tensors["qweight"]) for lay in layers], axis=0)}
    for suffix in ("scales", "zeros", "mins"):
        if suffix in layers[0].tensors:
            tensors[suffix] = np.concatenate([np.asarray(lay.tensors[suffix]) for lay in layers], axis=1)
    if first.get("act_order"):
        tensors["perm"] = np.asarray(layers[0].tensors["perm"])
    if all(has_bias):
        tensors["bias"] = np.concatenate([np.asarray(lay.tensors["bias"]).reshape(-1) for lay in layers])
    n = sum(int(lay.meta["shape"][0]) for lay in layers)
    meta = dict(first)
    meta["shape"] = [n, k]
    meta["padded_shape"] = [n, int(first["padded_shape"][1])]
    return PackedLayer(meta=meta, tensors=tensors)


# -- one projection --------------------------------------------------------------------------------
class _Proj:
    """y = x·Wᵀ (+ bias) for the rows of several model projections, as native "parts" writing consecutive
    columns of y: one fused packed layer, one stacked layer, or one part per module (when they cannot be
    stacked, e.g. act-order layers with their own permutations). A module without a native kernel (a float
    nn.Linear) makes the projection a plain module call. Decode (one row) writes into a buffer allocated once."""

    MAX_PARTS = 3

    def __init__(self, mods: list[nn.Module], stack: bool):
        from ..native import cpu as ncpu
        from .torch_module import W4FusedLinear, W4Linear, W4SliceLinear, W4TiedHead

        self.calls: list[nn.Module] = []
        self.sizes = [int(getattr(m, "out_features", 0) or m.weight.shape[0]) for m in mods]
        self.out_features = sum(self.sizes)
        first = mods[0]
        self.in_features = int(getattr(first, "in_features", 0) or first.weight.shape[1])
        owners: list[Any] = []
        packed = None
        if all(isinstance(m, W4SliceLinear) for m in mods) and len({id(m.fused) for m in mods}) == 1:
            fused = mods[0].fused
            rows = [tuple(fused.parts[m.index]["rows"]) for m in mods]
            if rows[0][0] == 0 and rows[-1][1] == fused.out_features and all(
                    a[1] == b[0] for a, b in zip(rows, rows[1:])):
                owners = [fused]
        elif len(mods) == 1 and isinstance(first, W4TiedHead):
            owners = [first.embedding]
        elif all(type(m) is W4Linear for m in mods):
            if stack and len(mods) > 1 and len({(m.precision, m.threads) for m in mods}) == 1:
                packed = stack_packed([m.packed_layer() for m in mods])
            if packed is None and len(mods) <= self.MAX_PARTS:
                owners = list(mods)
        if packed is not None:
            settings = {(first.precision, first.threads)}
        else:
            settings = {(o.precision, o.threads) for o in owners}
        if len(settings) != 1:
            self.calls = list(mods)
            self.kernels: list[Any] = []
            return
        self.precision, threads = settings.pop()
        if packed is not None:
            self.kernels = [ncpu.CpuPackedLinear(packed, threads=first.threads)]
            for m in mods:  # the stacked kernel replaces theirs; transformers' path rebuilds them on demand
                m._prepared.clear()
        else:
            self.kernels = [o._kernel(torch.device("cpu")) for o in owners]
        self.threads = int(threads if threads is not None else ncpu.default_threads())
        self.lib, self.ffi = ncpu.lib, ncpu.ffi
        self.prec_code = ncpu.PRECISIONS[self.precision]
        self.check_rc = ncpu.check_rc
        self.y1 = torch.empty(1, self.out_features)
        base = self.ffi.cast("char *", self.y1.data_ptr())
        # (layer, n, column offset, bias keep-alive, bias pointer, bias dtype) per part
        self.parts = []
        col = 0
        for kern in self.kernels:
            own = kern._own_bias
            keep, bptr, bdt = own if own is not None else (None, ncpu.ffi.NULL, 0)
            self.parts.append((kern._layer, kern.out_features, col, keep, bptr, bdt))
            col += kern.out_features
        self.y1_ptrs = [base + 4 * c for (_l, _n, c, _k, _b, _d) in self.parts]

    @property
    def native(self) -> bool:
        return bool(self.kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N]; for M = 1 the result is the shared buffer."""
        if not self.kernels:
            return torch.cat([m(x) for m in self.calls], dim=-1) if len(self.calls) > 1 else self.calls[0](x)
        m = x.shape[0]
        if m == 1:
            y, ptrs = self.y1, self.y1_ptrs
        else:
            y = torch.empty(m, self.out_features)
            base = self.ffi.cast("char *", y.data_ptr())
            ptrs = [base + 4 * c for (_l, _n, c, _k, _b, _d) in self.parts]
        xp = self.ffi.cast("void *", x.data_ptr())
        for (layer, n, _c, _k, bptr, bdt), yp in zip(self.parts, ptrs):
            rc = self.lib.w4p_cpu_gemm(layer, xp, 3, m, self.in_features, yp, 3, self.out_features, bptr, bdt,
                                       self.prec_code, 0, self.threads)
            if rc:
                self.check_rc(rc, "gemm")
        return y


def _rms(norm: nn.Module) -> tuple[torch.Tensor, float]:
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    if not isinstance(w, torch.Tensor) or eps is None or "RMSNorm" not in type(norm).__name__:
        raise NotLean(f"{type(norm).__name__} is not an RMSNorm")
    if type(norm).__name__.startswith(("Gemma",)):
        raise NotLean(f"{type(norm).__name__} scales by 1 + weight")
    return w.detach(), float(eps)


class LayerSpec:
    """The modules and constants of one llama decoder layer, as found in the model (nothing built yet)."""

    __slots__ = ("ln1", "eps1", "ln2", "eps2", "qkv", "o", "gate_up", "down", "act", "qn", "kn")

    def __init__(self, ln1: tuple[torch.Tensor, float], ln2: tuple[torch.Tensor, float], qkv: list[nn.Module],
                 o: nn.Module, gate_up: list[nn.Module], down: nn.Module, act: Any,
                 qn: tuple[torch.Tensor, float] | None = None, kn: tuple[torch.Tensor, float] | None = None):
        (self.ln1, self.eps1), (self.ln2, self.eps2) = ln1, ln2
        self.qkv, self.o, self.gate_up, self.down, self.act = qkv, o, gate_up, down, act
        self.qn, self.kn = qn, kn  # qwen3's per-head query / key RMSNorms (weight [head_dim], eps), or None


class ModelSpec:
    """What a lean loop needs from a llama-family model, device and dtype aside: the embedding, the layers'
    modules, the final norm, the head, the rotary module and the attention dimensions."""

    embed: nn.Module
    norm_w: torch.Tensor
    norm_eps: float
    head: nn.Module
    rot: nn.Module
    layers: list[LayerSpec]
    head_dim: int
    n_heads: int
    n_kv: int
    scaling: float
    hidden: int


def walk(model: nn.Module) -> ModelSpec:
    """The model's llama structure, or NotLean with the reason (architecture only: the device and dtype are the
    caller's to check). Shared by the CPU loop and the CUDA graph loop (``lean_cuda``)."""
    cfg = model.config
    mtype = getattr(cfg, "model_type", "")
    if mtype not in _FAMILY:
        raise NotLean(f"model type {mtype!r} is not one the lean loop runs ({', '.join(_FAMILY)})")
    if getattr(cfg, "sliding_window", None) and (getattr(cfg, "use_sliding_window", True)
                                                  or mtype not in ("qwen2", "qwen3")):
        if mtype == "mistral" or any(t == "sliding_attention" for t in getattr(cfg, "layer_types", None) or []):
            raise NotLean("sliding-window attention")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        raise NotLean("pretraining_tp > 1")
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(base, "embed_tokens") or not hasattr(base, "norm"):
        raise NotLean(f"{type(model).__name__} has no model.layers / embed_tokens / norm")
    spec = ModelSpec()
    spec.embed = base.embed_tokens
    spec.norm_w, spec.norm_eps = _rms(base.norm)
    head = getattr(model, "lm_head", None)
    if head is None:
        raise NotLean("no lm_head")
    spec.head = head
    rot = getattr(base, "rotary_emb", None)
    rope_type = str(getattr(rot, "rope_type", ""))
    if rot is None or "dynamic" in rope_type or rope_type == "longrope":
        raise NotLean(f"rotary embedding {rope_type or 'missing'}: angles change with the sequence length")
    spec.rot = rot
    spec.layers = []
    for i, dl in enumerate(layers):
        attn, mlp = getattr(dl, "self_attn", None), getattr(dl, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in names) or not all(
                hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise NotLean(f"layer {i} is not a llama decoder layer (self_attn q/k/v/o, mlp gate/up/down)")
        qn = kn = None
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            if not all(hasattr(attn, n) for n in ("q_norm", "k_norm")):
                raise NotLean(f"layer {i} normalizes only one of its queries and keys")
            qn, kn = _rms(attn.q_norm), _rms(attn.k_norm)
            if qn[0].dim() != 1 or kn[0].dim() != 1 or qn[0].numel() != kn[0].numel() or \
                    qn[0].numel() != int(attn.head_dim):
                raise NotLean(f"layer {i}: q/k norms of {qn[0].numel()}/{kn[0].numel()} values on heads of "
                              f"{int(attn.head_dim)}")
        if getattr(attn, "sliding_window", None):
            raise NotLean("sliding-window attention")
        extra = {n for n, _ in dl.named_children()} - {"self_attn", "mlp", "input_layernorm",
                                                       "post_attention_layernorm"}
        if extra:
            raise NotLean(f"decoder layer {i} has extra modules {sorted(extra)}")
        spec.layers.append(LayerSpec(_rms(dl.input_layernorm), _rms(dl.post_attention_layernorm),
                                     [attn.q_proj, attn.k_proj, attn.v_proj], attn.o_proj,
                                     [mlp.gate_proj, mlp.up_proj], mlp.down_proj, mlp.act_fn, qn, kn))
    if not spec.layers:
        raise NotLean("the model has no decoder layers")
    attn0 = layers[0].self_attn
    spec.head_dim = int(attn0.head_dim)
    spec.n_heads = int(cfg.num_attention_heads)
    spec.n_kv = int(getattr(cfg, "num_key_value_heads", None) or spec.n_heads)
    spec.scaling = float(attn0.scaling)
    spec.hidden = int(cfg.hidden_size)
    if spec.n_heads % spec.n_kv:
        raise NotLean("attention heads are not a multiple of the KV heads")
    buf = next(iter(rot.buffers()), None)
    dev = buf.device if buf is not None else torch.device("cpu")
    with torch.inference_mode():  # both loops read head_dim cos/sin values per position
        rot_dim = int(rot(torch.empty(1, device=dev), torch.zeros(1, 1, dtype=torch.long, device=dev))[0].shape[-1])
    if rot_dim != spec.head_dim:
        raise NotLean(f"rotary embedding of {rot_dim} dimensions on heads of {spec.head_dim}")
    return spec


def _out_features(mod: nn.Module) -> int:
    return int(getattr(mod, "out_features", 0) or mod.weight.shape[0])


class _Layer:
    """One layer as a loop runs it: norms, projections (callables x [M, K] -> [M, N]), activation, KV cache."""

    __slots__ = ("ln1", "eps1", "qkv", "o", "ln2", "eps2", "gate_up", "down", "act", "k", "v", "qn", "kn")


class LoopBase:
    """The llama arithmetic shared by the CPU loop and the CUDA graph loop: RMSNorm, rotary embedding, the
    prompt's forward pass over the KV cache, and transformers' token selection. Subclasses build ``layers``
    (``_Layer`` with projection callables), ``head``, the caches ``L.k``/``L.v`` [KVH, max_len, D] and the
    rotary tables ``cos``/``sin`` [max_len, D], all in ``dtype``."""

    layers: list[_Layer]
    head: Any
    cos: torch.Tensor
    sin: torch.Tensor
    dtype: torch.dtype = torch.float32

    def _init_spec(self, spec: ModelSpec) -> None:
        self.embed = spec.embed
        self.norm_w, self.norm_eps = spec.norm_w, spec.norm_eps
        self.rot = spec.rot
        self.head_dim, self.n_heads, self.n_kv = spec.head_dim, spec.n_heads, spec.n_kv
        self.scaling, self.hidden = spec.scaling, spec.hidden
        self.max_len = 0
        self.pos = 0

    def _check_widths(self, qkv_sizes: list[int]) -> None:
        q_n, kv_n = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if qkv_sizes != [q_n, kv_n, kv_n]:
            raise NotLean(f"q/k/v widths {qkv_sizes} do not match the heads")

    def _rope_tables(self, size: int, device: Any = "cpu") -> None:
        """cos/sin [size, head_dim] from the model's own rotary module, in the loop's dtype (as transformers'
        rotary module returns them for hidden states of that dtype)."""
        pos = torch.arange(size, device=device).unsqueeze(0)
        dummy = torch.empty(1, dtype=self.dtype, device=device)
        with torch.inference_mode():
            cos, sin = self.rot(dummy, pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    # -- the arithmetic ------------------------------------------------------------------------------
    @staticmethod
    def _norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' RMSNorm: in float32, back to the input dtype, then times the weight."""
        x = h.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + eps)).to(h.dtype)

    def _qk(self, L: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The projected queries and keys of ``qkv`` [M, ...] as heads [M, heads + kv heads, D]: each head
        normalized first where the model has q/k norms (qwen3), then rotated."""
        m, nh, d = qkv.shape[0], self.n_heads, self.head_dim
        qk = qkv[:, :(nh + self.n_kv) * d].view(m, nh + self.n_kv, d)
        if L.qn is not None:
            qk = torch.cat((self._norm(qk[:, :nh], *L.qn), self._norm(qk[:, nh:], *L.kn)), dim=1)
        return self._rope(qk, cos, sin)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [M, heads, D]; cos/sin [M, 1, D]: x·cos + rotate_half(x)·sin, as transformers computes it."""
        half = self.head_dim // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rot * sin)

    @staticmethod
    def _softmax(s: torch.Tensor) -> torch.Tensor:
        """Attention weights as transformers' eager attention computes them: softmax in float32, then the
        scores' dtype (no-ops for a float32 model)."""
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(s.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the tokens ``ids`` [M] from the current position (eagerly: the prompt, or one token of a loop
        without a faster step); returns the last position's logits [vocab]."""
        m = int(ids.shape[0])
        p0 = self.pos
        self._reserve(p0 + m)
        h = self.embed(ids.view(1, m))[0].to(self.dtype).contiguous()  # [M, H]
        cos = self.cos[p0:p0 + m].unsqueeze(1)
        sin = self.sin[p0:p0 + m].unsqueeze(1)
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        g = nh // nkv
        qn, kvn = nh * d, nkv * d
        t = p0 + m
        mask = None
        if m > 1:
            key_pos = torch.arange(t, device=h.device)
            q_pos = torch.arange(p0, t, device=h.device)
            mask = (key_pos[None, :] > q_pos[:, None])  # [M, T]: True where the key is in the future
        for L in self.layers:
            x = self._norm(h, L.ln1, L.eps1)
            qkv = L.qkv(x)
            qk = self._qk(L, qkv, cos, sin)
            L.k[:, p0:t].copy_(qk[:, nh:].transpose(0, 1))
            L.v[:, p0:t].copy_(qkv[:, qn + kvn:].view(m, nkv, d).transpose(0, 1))
            kc, vc = L.k[:, :t], L.v[:, :t]
            if m == 1:
                q = qk[0, :nh].view(nkv, g, d)
                s = torch.matmul(q, kc.transpose(1, 2)) * self.scaling  # [KVH, G, T]
                o = torch.matmul(self._softmax(s), vc).reshape(1, qn)
            else:
                q = qk[:, :nh].reshape(m, nkv, g, d).permute(1, 2, 0, 3)  # [KVH, G, M, D]
                s = torch.matmul(q, kc.unsqueeze(1).transpose(2, 3)) * self.scaling  # [KVH, G, M, T]
                s = s.masked_fill(mask, float("-inf"))
                o = torch.matmul(self._softmax(s), vc.unsqueeze(1))  # [KVH, G, M, D]
                o = o.permute(2, 0, 1, 3).reshape(m, qn)
            h = h + L.o(o)
            x = self._norm(h, L.ln2, L.eps2)
            gu = L.gate_up(x)
            inter = gu.shape[-1] // 2
            a = (L.act(gu[:, :inter]) * gu[:, inter:])
            h = h + L.down(a)
        self.pos = t
        last = self._norm(h[-1:], self.norm_w, self.norm_eps)
        return self.head(last)[0].clone()  # a packed head writes into a buffer the next call reuses

    @staticmethod
    def _limits(cfg: Any, t_in: int) -> tuple[int, list[int], int]:
        """(new tokens at most, end-of-sequence ids, new tokens before an end may be chosen) of ``cfg``."""
        new_max = cfg.max_new_tokens if cfg.max_new_tokens is not None else cfg.max_length - t_in
        eos = cfg.eos_token_id
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else sorted({int(e) for e in eos}))
        return int(new_max), eos_ids, int(cfg.min_new_tokens or 0) if eos_ids else 0

    @staticmethod
    def _suppress(logits: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
        """transformers' MinNewTokensLengthLogitsProcessor: the end ids' scores set to -inf (on a copy)."""
        out = logits.clone()
        ids = [e for e in eos_ids if 0 <= e < out.shape[-1]]
        if ids:
            out[ids] = -float("inf")
        return out

    @staticmethod
    def _pick(logits: torch.Tensor, cfg: Any) -> int:
        """transformers' selection: argmax, or temperature -> top-k -> top-p -> softmax -> one multinomial draw."""
        scores = logits.to(torch.float32).unsqueeze(0)
        if not cfg.do_sample:
            return int(torch.argmax(scores, dim=-1))
        if cfg.temperature is not None and cfg.temperature != 1.0:
            scores = scores / cfg.temperature
        if cfg.top_k is not None and cfg.top_k != 0:
            k = min(max(int(cfg.top_k), 1), scores.shape[-1])
            kth = torch.topk(scores, k)[0][..., -1, None]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if cfg.top_p is not None and cfg.top_p < 1.0:
            sorted_logits, sorted_idx = torch.sort(scores, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = cum <= (1 - cfg.top_p)
            remove[..., -1:] = 0
            scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1)[0, 0])


class LeanDecoder(LoopBase):
    """The lean CPU decode loop of one loaded model (batch 1); ``generate`` mirrors transformers' greedy/sampled
    generate for the options in ``_OPTIONS``."""

    def __init__(self, model: nn.Module):
        self.model = model
        first = next(model.parameters(), None)
        spec = walk(model)
        if first is None or first.dtype != torch.float32 or first.device.type != "cpu":
            raise NotLean("the lean loop runs float32 models on the CPU")
        self._init_spec(spec)
        self.head = _Proj([spec.head], stack=False)
        self.layers: list[_Layer] = []
        for ls in spec.layers:
            L = _Layer()
            L.ln1, L.eps1, L.ln2, L.eps2 = ls.ln1, ls.eps1, ls.ln2, ls.eps2
            L.qn = None if ls.qn is None else (ls.qn[0].contiguous(), ls.qn[1])
            L.kn = None if ls.kn is None else (ls.kn[0].contiguous(), ls.kn[1])
            L.qkv = _Proj(ls.qkv, stack=True)
            L.o = _Proj([ls.o], stack=False)
            L.gate_up = _Proj(ls.gate_up, stack=True)
            L.down = _Proj([ls.down], stack=False)
            L.act = ls.act
            self.layers.append(L)
        self._check_widths(self.layers[0].qkv.sizes)
        self.vocab = int(self.head.out_features)
        self.inter = self.layers[0].gate_up.out_features // 2
        # one native call per token when every projection is a native kernel of one precision and thread count
        projs = [p for L in self.layers for p in (L.qkv, L.o, L.gate_up, L.down)]
        self.native = bool(projs) and all(p.native for p in projs) and len(
            {(p.precision, p.threads) for p in projs}) == 1 and all(
            type(L.act).__name__ == "SiLUActivation" or getattr(L.act, "__name__", "") == "silu"
            for L in self.layers)
        self._desc: Any = None
        self._rows: dict[int, torch.Tensor] = {}
        self.signature = signature(model)

    # -- state -------------------------------------------------------------------------------------
    def _reserve(self, total: int) -> None:
        """KV cache and rotary tables for at least ``total`` positions, kept for later calls that fit. The cache
        grows geometrically and keeps what it holds (the positions before ``self.pos``)."""
        if total <= self.max_len:
            return
        size = max(total, 256, 2 * self.max_len)
        size = (size + 255) // 256 * 256
        keep = min(self.pos, self.max_len)
        for L in self.layers:
            k = torch.zeros(self.n_kv, size, self.head_dim)
            v = torch.zeros(self.n_kv, size, self.head_dim)
            if keep:
                k[:, :keep].copy_(L.k[:, :keep])
                v[:, :keep].copy_(L.v[:, :keep])
            L.k, L.v = k, v
        self._rope_tables(size)  # [size, head_dim]
        self.max_len = size
        if self.native:
            self._describe()

    def _describe(self) -> None:
        """The native step's descriptors (rebuilt whenever the cache is reallocated)."""
        p0 = self.layers[0].qkv
        ffi = p0.ffi
        dims = ffi.new("w4p_llama_dims *")
        dims.hidden, dims.n_heads, dims.n_kv, dims.head_dim = self.hidden, self.n_heads, self.n_kv, self.head_dim
        dims.inter, dims.max_len, dims.scaling = self.inter, self.max_len, self.scaling
        dims.precision, dims.isa, dims.threads = p0.prec_code, 0, p0.threads
        self.norm_w = self.norm_w.contiguous()
        dims.final_norm = ffi.cast("const float *", self.norm_w.data_ptr())
        dims.final_eps = self.norm_eps
        arr = ffi.new("w4p_llama_layer[]", len(self.layers))
        for i, L in enumerate(self.layers):
            d = arr[i]
            for name in ("qkv", "o", "gate_up", "down"):
                proj = getattr(L, name)
                for j, (layer, _n, _c, _k, bptr, bdt) in enumerate(proj.parts):
                    getattr(d, name)[j] = layer
                    getattr(d, name + "_bias")[j] = bptr
                    getattr(d, name + "_bias_dtype")[j] = bdt
            L.ln1, L.ln2 = L.ln1.contiguous(), L.ln2.contiguous()
            d.ln1 = ffi.cast("const float *", L.ln1.data_ptr())
            d.ln2 = ffi.cast("const float *", L.ln2.data_ptr())
            d.eps1, d.eps2 = L.eps1, L.eps2
            if L.qn is not None:
                d.q_norm = ffi.cast("const float *", L.qn[0].data_ptr())
                d.k_norm = ffi.cast("const float *", L.kn[0].data_ptr())
                d.q_eps, d.k_eps = L.qn[1], L.kn[1]
            d.k_cache = ffi.cast("float *", L.k.data_ptr())
            d.v_cache = ffi.cast("float *", L.v.data_ptr())
        self._desc = (dims, arr, ffi.cast("const float *", self.cos.data_ptr()),
                      ffi.cast("const float *", self.sin.data_ptr()))

    def step(self, token: int) -> torch.Tensor:
        """One token at the current position (the native step where available); the logits [vocab]."""
        if not self.native:
            return self.forward(torch.tensor([token]))
        p0 = self.layers[0].qkv
        pos = self.pos
        self._reserve(pos + 1)
        dims, arr, cos, sin = self._desc
        row = self._rows.get(token)
        if row is None:
            row = self.embed(torch.tensor([[token]]))[0].to(torch.float32).contiguous()  # [1, H]
            if len(self._rows) < 8192:  # a packed embedding dequantizes a row in ~0.4 ms: once per token id
                self._rows[token] = row
        h = row.clone()
        d = self.head_dim
        rc = p0.lib.w4p_llama_decode(dims, arr, len(self.layers), p0.ffi.cast("float *", h.data_ptr()), pos,
                                     cos + pos * d, sin + pos * d)
        if rc:
            p0.check_rc(rc, "decode step")
        self.pos = pos + 1
        return self.head(h)[0].clone()  # h holds the final norm's output; the head's buffer is reused

    # -- generation --------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, cfg: Any, streamer: Any = None) -> torch.Tensor:
        """Greedy or sampled continuation of ``input_ids`` [1, T] under generation config ``cfg`` (already
        checked by ``plan``); returns [1, T + new] like transformers."""
        ids = input_ids[0].to(torch.long)
        t_in = int(ids.shape[0])
        new_max, eos_ids, min_new = self._limits(cfg, t_in)
        eos_set = set(eos_ids)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        out = [int(v) for v in ids.tolist()]
        self.pos = 0
        if new_max > 0:
            self._reserve(t_in + min(new_max, 1024))  # longer runs grow the cache as they go
            logits = self.forward(ids)
            for i in range(new_max):
                tok = self._pick(self._suppress(logits, eos_ids) if i < min_new else logits, cfg)
                out.append(tok)
                if streamer is not None:
                    streamer.put(torch.tensor([tok]))
                if tok in eos_set or i == new_max - 1:
                    break
                logits = self.step(tok)
        if streamer is not None:
            streamer.end()
        return torch.tensor([out], dtype=input_ids.dtype)



def signature(model: nn.Module) -> tuple[Any, ...]:
    """What the loop was built from: every module object and the address and version of its first tensor, with the
    model's dtype and device. ``generate`` rebuilds the loop when this changed (layers swapped, weights moved or
    replaced, as ``dequantized_model`` or ``.to()`` do)."""
    from .torch_module import tensor_version

    out: list[Any] = []
    for mod in model.modules():
        t = next(iter(mod._buffers.values()), None) if mod._buffers else None
        if t is None:
            t = next(iter(mod._parameters.values()), None) if mod._parameters else None
        # (the version counter: load_state_dict copies new weights into the same storage)
        out.append((id(mod), None if t is None else (t.data_ptr(), tensor_version(t), t.dtype, t.device.type)))
    return tuple(out)


def plan(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any, Any]:
    """(input_ids, generation config, streamer) when the lean loop can answer this generate call; else NotLean."""
    kw = dict(kwargs)
    streamer = kw.pop("streamer", None)
    ids = kw.pop("input_ids", None)
    if args:
        if ids is not None or len(args) > 1:
            raise NotLean("positional arguments besides the input ids")
        ids = args[0]
    if ids is None:
        ids = kw.pop("inputs", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise NotLean("the lean loop decodes one sequence (input_ids [1, T])")
    mask = kw.pop("attention_mask", None)
    if mask is not None and not bool((mask == 1).all()):
        raise NotLean("an attention mask with padding")
    gen = kw.pop("generation_config", None)
    cfg = copy.deepcopy(gen if gen is not None else model.generation_config)
    for key, value in kw.items():
        if key not in _OPTIONS:
            raise NotLean(f"generate option {key!r}")
        setattr(cfg, key, value)
    from transformers import GenerationConfig

    default = GenerationConfig()
    for key, value in cfg.to_dict().items():
        if key in _OPTIONS or key.startswith("_") or key in ("cache_implementation", "compile_config",
                                                              "disable_compile", "generation_kwargs"):
            continue
        want = getattr(default, key, value)
        if want != value and not (value in (None, False) and want in (None, False)):
            raise NotLean(f"generation option {key}={value!r}")
    if cfg.max_new_tokens is None and cfg.max_length is None:
        raise NotLean("no max_new_tokens or max_length")
    # what transformers' generate samples with where the call and the model's config leave a value unset (its
    # global defaults: top_k 50, not "no top-k"); the loop reads None as "not applied"
    fill = getattr(GenerationConfig, "_get_default_generation_params", None)
    fallback = fill() if callable(fill) else {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
    for key in ("temperature", "top_k", "top_p"):
        if getattr(cfg, key, None) is None and fallback.get(key) is not None:
            setattr(cfg, key, fallback[key])
    return ids, cfg, streamer


def build_engine(model: nn.Module) -> "LoopBase":
    """The lean loop for the model's device: the native CPU loop, or on CUDA the CUDA-graph loop
    (``w4pack.runtime.lean_cuda``); NotLean with the reason when the model is not one it runs."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        from .lean_cuda import GraphDecoder

        return GraphDecoder(model)
    return LeanDecoder(model)


def _built(model: nn.Module) -> "LoopBase":
    """``build_engine``, with running out of memory for the loop's stacked layers as one more reason not to run
    it: the model stays usable through what answers generate without the loop."""
    try:
        return build_engine(model)
    except torch.OutOfMemoryError as exc:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the half-built stacked layers
        first = str(exc).strip().splitlines()
        raise NotLean(f"no memory for the loop's stacked layers: {first[0][:160] if first else 'out of memory'}")


def use_lean_decode(model: nn.Module) -> str:
    """Answer ``model.generate`` with the lean loop where it can (batch 1, llama family; the CPU loop or, for a
    model on CUDA, the CUDA-graph loop); returns the decode mode ("lean", or "eager (why not)").

    Installed over ``use_compiled_decode``'s wrapper, the calls the loop declines go to the compiled step
    ("compiled (why not lean)")."""
    from .decode import fallback_mode

    if getattr(model, "_w4pack_lean", None) is not None:
        return model.w4pack_decode
    try:
        engine = _built(model)
    except NotLean as exc:
        model.w4pack_decode = f"{fallback_mode(model)} ({exc})"
        return model.w4pack_decode
    inner = model.generate
    model._w4pack_lean_inner = inner
    model._w4pack_lean = engine
    model.w4pack_decode = LEAN

    busy = threading.Lock()

    def generate(*args: Any, **kwargs: Any) -> Any:
        nonlocal engine
        if not busy.acquire(blocking=False):  # one loop state per model: a concurrent call goes to transformers
            model.w4pack_decode = f"{fallback_mode(model)} (another generate call on this model is running)"
            return inner(*args, **kwargs)
        try:
            return lean_call(args, kwargs)
        finally:
            busy.release()

    def lean_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        nonlocal engine
        try:
            if signature(model) != engine.signature:
                engine = model._w4pack_lean = _built(model)
            ids, cfg, streamer = plan(model, args, kwargs)
        except NotLean as exc:
            model.w4pack_decode = f"{fallback_mode(model)} ({exc})"
            return inner(*args, **kwargs)
        model.w4pack_decode = LEAN
        gc_was = gc.isenabled()
        gc.disable()  # a collection over a loaded model's objects costs more than a decode step
        try:
            with torch.inference_mode():
                return engine.generate(ids, cfg, streamer)
        finally:
            if getattr(engine, "note", ""):
                model.w4pack_decode = f"{LEAN} ({engine.note})"
            if gc_was:
                gc.enable()

    model.generate = generate
    return LEAN


def remove_lean_decode(model: nn.Module) -> None:
    """Undo ``use_lean_decode``: what answered ``generate`` before it again (transformers' generate, or the
    compiled step's wrapper), the loop (its caches, graphs and stacked weights) released. For benchmarks that
    time several decode modes on one model."""
    from .decode import COMPILED, fallback_mode, restore_generate

    inner = getattr(model, "_w4pack_lean_inner", None)
    if inner is None or getattr(model, "_w4pack_lean", None) is None:
        return
    restore_generate(model, inner)
    for attr in ("_w4pack_lean_inner", "_w4pack_lean"):
        model.__dict__.pop(attr, None)
    if fallback_mode(model) == COMPILED:
        model.w4pack_decode = COMPILED
    elif getattr(model, "_w4pack_generate", None) is None:
        model.__dict__.pop("w4pack_decode", None)
