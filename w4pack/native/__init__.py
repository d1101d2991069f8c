"""Native W4A16 GEMM: ``gemm(x, packed)`` on CPU (numpy / torch CPU) or CUDA (torch CUDA tensors).

CPU work goes to the cffi extension ``w4pack._w4p_cpu`` (run-time SIMD dispatch: AVX-512/VNNI, AVX2,
NEON, scalar; $W4PACK_ISA forces a path). CUDA tensors go to ``w4pack.native.cuda``, imported only
when a CUDA tensor arrives.
"""
from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from ..core.layout import PackedLayer
from .cpu import CpuPackedLinear, default_threads, isa_info

__all__ = ["gemm", "CpuPackedLinear", "isa_info", "default_threads", "cpu_linear"]

_CACHE_ATTR = "_w4p_cpu_linear"


def cpu_linear(packed: PackedLayer | CpuPackedLinear, threads: int | None = None) -> CpuPackedLinear:
    """The CPU-repacked form of ``packed``, built once and kept on the PackedLayer for later calls."""
    if isinstance(packed, CpuPackedLinear):
        return packed
    cached = packed.__dict__.get(_CACHE_ATTR)
    if cached is not None and cached[0] is packed.tensors.get("qweight"):
        return cached[1]
    lin = CpuPackedLinear(packed, threads=threads)
    packed.__dict__[_CACHE_ATTR] = (packed.tensors.get("qweight"), lin)
    return lin


def _is_torch_cuda(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and getattr(getattr(x, "device", None), "type", None) == "cuda"


def gemm(x: Any, packed: PackedLayer | CpuPackedLinear, bias: Any = None, precision: str = "exact",
         threads: int | None = None, out_dtype: Any = None) -> Any:
    """y = x · Wᵀ (+ bias) for activations x [..., K] and a layer in layout v1.

    x: numpy float16 / float32 / uint16 (bfloat16 bits) or a torch tensor (CPU or CUDA). The output has
    x's dtype unless ``out_dtype`` says otherwise, and the same kind (numpy / torch, same device).
    bias: None -> the layer's own bias if it has one; False -> none; else an array of N values.
    precision: "exact" (fp32 dequantize + fp32 accumulate) or "fast" (int8 activations, integer dots).
    threads (CPU): None -> $W4PACK_THREADS or all cores.
    """
    if _is_torch_cuda(x):
        try:
            from . import cuda  # noqa: PLC0415 - optional, written separately
        except ImportError:
            raise UnsupportedError("CUDA path not available") from None
        layer = packed if isinstance(packed, PackedLayer) else None
        if layer is None:
            raise UnsupportedError("a CpuPackedLinear cannot run on CUDA; pass the PackedLayer")
        return cuda.gemm(x, layer, bias=bias, precision=precision, out_dtype=out_dtype)
    return cpu_linear(packed).forward(x, precision=precision, bias=bias, out_dtype=out_dtype, threads=threads)
