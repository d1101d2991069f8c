"""Test-only round-to-nearest quantizer: float weights -> canonical layers, group-wise, sym or asym.

Why: the model tests need quantized checkpoints of real transformers architectures without a calibration
library. RTN is enough: the tests compare the packed model with a float model holding the *same* dequantized
weights, so quantization quality does not matter, only that the codes, scales and zeros are valid.

Also here: ``MemorySource`` (a ``Source`` over in-memory canonical layers and tensors, so the format writers can
write a GPTQ/AWQ checkpoint from it) and ``quantize_model`` (every nn.Linear of a transformers model except the
output head).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from w4pack.canonical import CanonicalLayer
from w4pack.dtypes import from_float32, to_float32
from w4pack.formats.base import Source, TensorData

__all__ = ["rtn_quantize", "MemorySource", "quantize_model", "tensor_to_numpy"]


def rtn_quantize(w: np.ndarray, *, bits: int = 4, group_size: int = 32, sym: bool = True,
                 scale_dtype: str = "float16", float_min: bool = False, act_order: bool = False,
                 bias: np.ndarray | None = None, seed: int = 0, name: str = "") -> CanonicalLayer:
    """Quantize float weights [N, K] group-wise to a validated CanonicalLayer.

    sym: zero_mode "none", s = max|w| / (2**(b-1) - 1); asym: zero_mode "int" (min/max range, integer zero);
    float_min: zero_mode "float" (W = s*q + m, the GGUF Q4_1 form). act_order assigns groups to a random
    permutation of the columns (as GPTQ's desc_act does), so g_idx is not k // group_size.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    g = -(-k // gs)
    if act_order:
        order = np.random.default_rng(seed).permutation(k)
        g_idx = np.empty(k, dtype=np.int32)
        g_idx[order] = (np.arange(k) // gs).astype(np.int32)
    else:
        g_idx = (np.arange(k) // gs).astype(np.int32)
    qmax = (1 << bits) - 1
    scales = np.zeros((n, g), dtype=np.float32)
    zeros = np.zeros((n, g), dtype=np.int32)
    mins = np.zeros((n, g), dtype=np.float32)
    codes = np.zeros((n, k), dtype=np.uint8)
    for gi in range(g):
        cols = np.nonzero(g_idx == gi)[0]
        wg = w[:, cols]
        if sym:
            half = 1 << (bits - 1)
            s = np.abs(wg).max(axis=1) / max(half - 1, 1)
            s = np.where(s == 0, 1.0, s)
            s = to_float32(from_float32(s, scale_dtype), scale_dtype)
            q = np.clip(np.rint(wg / s[:, None]) + half, 0, qmax)
        else:
            lo, hi = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
            s = (hi - lo) / qmax
            s = np.where(s == 0, 1.0, s)
            s = to_float32(from_float32(s, scale_dtype), scale_dtype)
            if float_min:
                m = to_float32(from_float32(lo, scale_dtype), scale_dtype)
                q = np.clip(np.rint((wg - m[:, None]) / s[:, None]), 0, qmax)
                mins[:, gi] = m
            else:
                z = np.clip(np.rint(-lo / s), 0, qmax)
                q = np.clip(np.rint(wg / s[:, None]) + z[:, None], 0, qmax)
                zeros[:, gi] = z
        scales[:, gi] = s
        codes[:, cols] = q.astype(np.uint8)
    zero_mode = "none" if sym else ("float" if float_min else "int")
    zarr = None if sym else (from_float32(mins, scale_dtype) if float_min else zeros)
    bias_arr = None if bias is None else from_float32(np.asarray(bias, dtype=np.float32), scale_dtype)
    layer = CanonicalLayer(codes=codes, scales=from_float32(scales, scale_dtype), bits=bits, group_size=group_size,
                           zero_mode=zero_mode, zeros=zarr, g_idx=g_idx, scale_dtype=scale_dtype, bias=bias_arr,
                           bias_dtype=None if bias is None else scale_dtype, name=name)
    return layer.validate()


def tensor_to_numpy(t: Any) -> tuple[np.ndarray, str]:
    """A torch tensor as (numpy array, dtype name), bf16 as uint16 bits."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy(), "bfloat16"
    if t.dtype == torch.float16:
        return t.numpy().copy(), "float16"
    return t.float().numpy().copy(), "float32"


class MemorySource(Source):
    """A Source over canonical layers and pass-through tensors held in memory (test checkpoints)."""

    def __init__(self, config: dict[str, Any], layers: dict[str, CanonicalLayer],
                 tensors: dict[str, tuple[np.ndarray, str]], side_files: list[Path] | None = None):
        self.config = dict(config)
        self.info = {"format": "rtn-test", "notes": ["round-to-nearest test quantization"]}
        self.path = Path("<memory>")
        self._layers = layers
        self._tensors = tensors
        self._side = list(side_files or [])

    def layer_names(self) -> list[str]:
        return list(self._layers)

    def read_layer(self, name: str) -> CanonicalLayer:
        return self._layers[name].replace(name=name)

    def passthrough_names(self) -> list[str]:
        return list(self._tensors)

    def read_tensor(self, name: str) -> TensorData:
        arr, dt = self._tensors[name]
        return TensorData(arr, dt)

    def side_files(self) -> list[Path]:
        return self._side


def quantize_model(model: Any, *, bits: int = 4, group_size: int = 32, sym: bool = True,
                   scale_dtype: str = "float16", act_order: bool = False, float_min: bool = False,
                   skip: tuple[str, ...] = ("lm_head",), seed: int = 0, perm_seed: int | None = None
                   ) -> tuple[dict[str, CanonicalLayer], dict[str, tuple[np.ndarray, str]]]:
    """RTN-quantize every nn.Linear of ``model`` (except names in ``skip``): (layers, pass-through tensors).

    Tied output embeddings are left out of the tensors (the config's tie_word_embeddings restores them).
    With act_order, each layer gets its own column permutation unless ``perm_seed`` is given, which makes every
    layer of the same input width share one (as fusable q/k/v must).
    """
    import torch

    layers: dict[str, CanonicalLayer] = {}
    quantized_params: set[str] = set()
    for i, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in skip:
            bias = None if mod.bias is None else mod.bias.detach().float().numpy()
            layers[name] = rtn_quantize(mod.weight.detach().float().numpy(), bits=bits, group_size=group_size,
                                        sym=sym, scale_dtype=scale_dtype, act_order=act_order,
                                        float_min=float_min, bias=bias,
                                        seed=seed + i if perm_seed is None else perm_seed, name=name)
            quantized_params.update({f"{name}.weight", f"{name}.bias"})
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    seen: set[int] = set()
    for pname, p in model.state_dict(keep_vars=True).items():
        if pname in quantized_params or id(p) in seen:
            continue
        if pname in _non_persistent(model):
            continue
        seen.add(id(p))
        tensors[pname] = tensor_to_numpy(p)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        tensors.pop("lm_head.weight", None)
    return layers, tensors


def _non_persistent(model: Any) -> set[str]:
    out = set()
    for mname, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            out.add(f"{mname}.{b}" if mname else b)
    return out


def write_random_llama_gptq(folder: Path, *, seed: int, std: float, side_files: list[Path] | None = None,
                            model_type: str = "llama", **config: Any) -> dict[str, CanonicalLayer]:
    """A causal LM (LlamaForCausalLM unless ``model_type`` names another) with random N(0, std) matrices,
    RTN-quantized (``quantize_model`` options in ``config`` under the keys bits, group_size, sym, act_order) and
    written as a GPTQ checkpoint at ``folder``; returns its layers. The rest of ``config`` goes to its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from w4pack.formats import get_format

    quant = {k: config.pop(k) for k in ("bits", "group_size", "sym", "act_order") if k in config}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    layers, tensors = quantize_model(model, **quant)
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    get_format("gptq").write(MemorySource(cfg, layers, tensors, side_files), folder)
    return layers
