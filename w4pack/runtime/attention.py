"""One decode token's attention as one op: ``w4pack::decode_attention``.

Why: in a batch-1 decode step a llama layer's attention is six small kernels (rotary, two cache writes, two
batched products, a softmax) around a few hundred KB of keys and values. The op rotates the token's query and
key, stores its key and value in the cache and attends to the positions written so far, in one CUDA launch
(``w4p_cuda_decode_attention``). The position is a device tensor, so a captured graph serves every position.

``reference`` is the same arithmetic in torch (fp32 scores and softmax over a masked cache, one rounding at the
end): the op's implementation where the kernel does not run (CPU, float32, unsupported shapes) and the tests'
yardstick for the kernel.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["decode_attention", "reference", "kernel_reason", "HEAD_DIMS", "MAX_GROUP"]

#: the head sizes and query heads per kv head the CUDA kernel takes
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 8


@functools.lru_cache(maxsize=None)
def kernel_reason(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    """Why the CUDA kernel cannot run this attention ("" when it can); asked once per shape (the op asks it every
    call, and the library's device query is not free)."""
    if device.type != "cuda":
        return f"the decode attention kernel runs on CUDA devices, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the decode attention kernel takes float16 or bfloat16, not {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"head size {head_dim}: the decode attention kernel takes {', '.join(map(str, HEAD_DIMS))}"
    if kv_heads < 1 or heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return (f"{heads} query heads over {kv_heads} kv heads: the decode attention kernel takes up to "
                f"{MAX_GROUP} query heads per kv head")
    from ..native import cuda

    why = cuda.unavailable_reason()
    if not why and torch.cuda.get_device_capability(device) < (8, 0):
        why = "the decode attention kernel needs compute capability 8.0 or newer"
    return why


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """x [heads, D] by one position's cos/sin [D] in ``acc`` (transformers' x·cos + rotate_half(x)·sin)."""
    half = x.shape[-1] // 2
    xf = x.to(acc)
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return xf * cos.to(acc) + rot * sin.to(acc)


def reference(qkv: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], pos: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
              scaling: float) -> torch.Tensor:
    """The op's arithmetic in torch (any device and float dtype; fp32 or wider); stores the key and value in the
    caches and returns the output [heads * D]. Reads the position without a host sync (a mask, not a slice)."""
    _, max_len, d = k_cache.shape
    g = heads // kv_heads
    acc = torch.promote_types(qkv.dtype, torch.float32)
    x = qkv.reshape(heads + 2 * kv_heads, d)
    p = pos.reshape(1).to(torch.long)
    qk = x[:heads + kv_heads]
    if cos is not None:
        qk = _rotate(qk, cos.index_select(0, p)[0], sin.index_select(0, p)[0], acc).to(qkv.dtype)
    k_cache.index_copy_(1, p, qk[heads:].unsqueeze(1))
    v_cache.index_copy_(1, p, x[heads + kv_heads:].unsqueeze(1))
    q = qk[:heads].to(acc).view(kv_heads, g, d)
    s = torch.matmul(q, k_cache.to(acc).transpose(1, 2)) * scaling  # [KVH, G, max_len]
    s = s.masked_fill(torch.arange(max_len, device=s.device) > p, float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), v_cache.to(acc))
    return o.reshape(heads * d).to(qkv.dtype)


@torch.library.custom_op("w4pack::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(qkv: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], pos: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                     scaling: float) -> torch.Tensor:
    """The token's attention output [heads * D]; writes its key and value at ``pos`` of the caches.
    qkv: [heads + 2 kv_heads] * D (queries, keys, values, before rotary when cos/sin are given); cos/sin: the
    rotary tables [max_len, D] or None; pos: int64 [1]; caches [kv_heads, max_len, D]."""
    d = k_cache.shape[-1]
    if kernel_reason(qkv.device, qkv.dtype, heads, kv_heads, d):
        return reference(qkv, cos, sin, pos, k_cache, v_cache, heads, kv_heads, scaling)
    from ..native import cuda

    return cuda.decode_attention(qkv, cos, sin, pos, k_cache, v_cache, heads, kv_heads, scaling)


@decode_attention.register_fake
def _decode_attention_fake(qkv: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                           pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                           kv_heads: int, scaling: float) -> torch.Tensor:
    return qkv.new_empty((heads * k_cache.shape[-1],))
