"""CUDA W4A16 GEMM: ``CudaPackedLinear`` and ``gemm`` over ``libw4p_cuda.so`` (cffi ABI mode, ``ffi.dlopen``).

The library is built by ``native/cuda/build.sh`` (``make cuda``) into ``w4pack/_lib``; its ABI is the
CUDA section of ``native/w4pack.h`` (a copy sits beside the library), parsed here so it is declared once.
A layer is uploaded once per device; every call runs on torch's current stream, so it works under
CUDA graph capture. Activations are fp16 or bf16; scales, zero points, float minima and bias are
converted once per activation dtype (exact when the checkpoint stores that dtype).
"""
from __future__ import annotations

import functools
import os
import re
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadInputError, UnsupportedError, W4PackError
from ..layout import PackedLayer, padded_shape

__all__ = ["CudaPackedLinear", "gemm", "gemm_cuda", "available", "unavailable_reason", "library_path",
           "header_path", "entry_points", "CudaKernelError", "KERNELS", "CUDA_ABI",
           "PROLOGUES", "decode_attention"]

_HERE = Path(__file__).resolve().parent
_LIBDIR = _HERE.parent / "_lib"
#: kernel choice names -> W4P_CUDA_KERNEL_* (probes are diagnostics for tools/bench_gpu.py); "bulk" (sm_90, M <= 16,
#: auto's choice up to M = 4 there, up to 8 on layers of 2^25 weights or more: docs/journal/2026-cuda.md; ``splits`` forces
#: its stages); "ring" (M <= 8,
#: the default there) streams the weights stream-K over warps through per-warp cp.async rings (``splits``
#: forces its units of work per warp); "wgmma_ws" (sm_90a, 4-bit: wgmma fed by a TMA producer warp; auto's
#: choice on compute capability 9.0 from M = 9 where measured ahead: docs/journal/2026-cuda.md;
#: ``splits`` forces its split-K count); "wgmma" (sm_90a, 4-bit, one-pass cp.async pipeline: auto's choice in
#: the same range only where the driver lacks the TMA encoder); "wgmma_ss" (sm_90a, 4-bit, group sizes that are
#: multiples of 64 or per channel: the tokens as wgmma's A operand, the weights dequantized into shared memory as
#: its B operand, 256 rows per block); "gemv" (M = 1 to 8, 4-bit, sm_80+: blocks own whole stripes, plain 16-byte
#: weight loads; auto's choice on compute capability 9.0 at M = 1, and at M = 2-8 where its staged rows fit as
#: many blocks per SM as at M = 1); "dense" is the
#: large-M path: dequantize to a temporary fp16/bf16 matrix with w4p_cuda_dequantize, then torch's GEMM (cuBLAS)
KERNELS = {"auto": 0, "stream": 1, "tiled": 2, "ring": 3, "bulk": 4, "wgmma": 5, "wgmma_ws": 6, "wgmma_ss": 7, "gemv": 8,
           "dense": -1, "probe_load": 10,
           "probe_dequant": 11, "probe_bulk": 12, "probe_ws": 13, "probe_ss": 14}
#: from this many rows on, "auto" takes the dense path unless the native plan picks a wgmma kernel (sm_90, up to
#: M = 1024 where measured ahead on an H200, docs/journal/2026-cuda.md): below it
#: the stream kernel (weights read once, split-K), above it dequantize + cuBLAS beats the mma.sync tiled kernel
DENSE_MIN_M = 33
#: the library's ABI version this module speaks (w4p_cuda_abi_version; 2 added w4p_cuda_gemm_row, 3 a prefetch
#: range to it, 4 took that out again, 5 added w4p_cuda_decode_attention, 6 W4P_ROW_RESIDUAL)
CUDA_ABI = 6
#: forward_row's prologues: what the gemv kernel applies to the row while staging it (W4P_ROW_*)
PROLOGUES = {"plain": 0, "rmsnorm": 1, "swiglu": 2}
_ROW_RESIDUAL = 8  # W4P_ROW_RESIDUAL: the bias input is a residual, added after the product's rounding
_DT = {"float16": 1, "bfloat16": 2}
_ZERO = {"none": 0, "int": 1, "float": 2}
_W4P_ENODEVICE = -4


class CudaKernelError(W4PackError, RuntimeError):
    """The CUDA library refused or failed a call (its own message is included)."""

    exit_code = 4


def library_path() -> Path:
    return _LIBDIR / "libw4p_cuda.so"


def header_path() -> Path:
    """The ABI header: the repository's native/w4pack.h when present, else the copy beside the library."""
    repo = _HERE.parent.parent / "native" / "w4pack.h"
    return repo if repo.exists() else _LIBDIR / "w4pack.h"


def cuda_cdef(text: str) -> str:
    """The CUDA section of the header (plus its integer #defines) as a cffi cdef."""
    m = re.search(r"W4P_CUDA_BEGIN.*?\*/(.*?)/\*\s*W4P_CUDA_END", text, flags=re.S)
    if not m:
        raise UnsupportedError(f"{header_path()}: no W4P_CUDA_BEGIN/W4P_CUDA_END section")
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    defines = [ln.strip() for ln in text.splitlines() if re.match(r"\s*#define\s+W4P_E\w+\s+-?\d+\s*$", ln)]
    defines += [ln.strip() for ln in text.splitlines() if re.match(r"\s*#define\s+W4P_DT_\w+\s+-?\d+\s*$", ln)]
    lines = [ln for ln in body.splitlines() if ln.strip()]
    return "\n".join(defines + lines)


def entry_points(text: str | None = None) -> list[str]:
    """Names of the functions the CUDA section declares."""
    cdef = cuda_cdef(text if text is not None else header_path().read_text())
    return re.findall(r"\b(w4p_cuda_\w+)\s*\(", cdef)


_lock = threading.Lock()
_state: dict[str, Any] = {}


def _ptr(ffi: Any, tensor: Any) -> Any:
    """A torch tensor's device address as the void * the entry points take (NULL for None)."""
    return ffi.NULL if tensor is None else ffi.cast("void *", tensor.data_ptr())


def _load() -> tuple[Any, Any]:
    """(ffi, lib), loaded once; raises UnsupportedError with the reason when the library is missing."""
    with _lock:
        if "lib" in _state:
            return _state["ffi"], _state["lib"]
        if "error" in _state:
            raise UnsupportedError(_state["error"])
        path = library_path()
        try:
            from cffi import FFI

            if not path.exists():
                raise OSError(f"{path} is not built (run `make cuda`; it needs nvcc)")
            ffi = FFI()
            ffi.cdef(cuda_cdef(header_path().read_text()))
            lib = ffi.dlopen(str(path))
            if lib.w4p_cuda_abi_version() != CUDA_ABI:
                raise OSError(f"{path}: ABI version {lib.w4p_cuda_abi_version()} != {CUDA_ABI} "
                              "(rebuild with `make cuda`)")
            for name in entry_points():  # (a build of another revision of the same version lacks some)
                if not hasattr(lib, name):
                    raise OSError(f"{path} has no {name} (rebuild with `make cuda`)")
        except (OSError, ImportError, AttributeError) as exc:
            _state["error"] = f"CUDA library unavailable: {exc}"
            raise UnsupportedError(_state["error"]) from None
        _state["ffi"], _state["lib"] = ffi, lib
        return ffi, lib


def unavailable_reason() -> str:
    """Why the CUDA path cannot run here ("" when it can): no library, no driver/device, or no torch CUDA."""
    try:
        ffi, lib = _load()
    except UnsupportedError as exc:
        return exc.message
    count = ffi.new("int *")
    if lib.w4p_cuda_device_count(count) != 0:
        return ffi.string(lib.w4p_cuda_last_error()).decode()
    try:
        import torch
    except ImportError:
        return "torch is not installed (the CUDA path takes torch CUDA tensors)"
    if not torch.cuda.is_available():
        return "no CUDA device: torch sees none"
    return ""


def available() -> bool:
    """True when the library loads and a CUDA device is usable; see unavailable_reason() otherwise."""
    return unavailable_reason() == ""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        ffi, lib = _load()
        msg = ffi.string(lib.w4p_cuda_last_error()).decode()
        if rc == _W4P_ENODEVICE:
            raise UnsupportedError(f"{what}: {msg}")
        raise CudaKernelError(f"{what}: {msg} (code {rc})")


# -- workspace: one zero-filled buffer per device; the kernels leave its counters at zero ------------------
# One per device, not per stream: graph capture (torch.cuda.graph, torch.compile's cudagraph trees, vLLM) runs
# and warms up on streams of its own, and a buffer first allocated there would live in the graph's private pool
# past the graph's outputs. ``CudaPackedLinear.reserve_workspace`` sizes it before any capture. The price: w4pack
# GEMMs on one device must not run concurrently on two streams (they may alternate freely).
_workspaces: dict[int, Any] = {}
_attn_workspaces: dict[int, Any] = {}  # the decode attention's own (its partial results would upset GEMM counters)
_retired: list[Any] = []  # outgrown buffers stay allocated: a captured graph may still point at one


def _workspace(torch: Any, device: Any, need: int, pool: dict[int, Any] = _workspaces) -> Any:
    ws = pool.get(device.index)
    if ws is not None and ws.numel() >= need:
        return ws
    if torch.cuda.is_current_stream_capturing():
        # growing now would allocate from the graph's pool: a zeroed buffer of the graph's own (the memset is
        # captured with the GEMM, so every replay starts from zero counters)
        return torch.zeros(max(need, 1), dtype=torch.uint8, device=device)
    size = max(need, 1 << 20, 0 if ws is None else min(2 * ws.numel(), need * 2))
    if ws is not None:
        _retired.append(ws)
    ws = torch.zeros(size, dtype=torch.uint8, device=device)
    pool[device.index] = ws
    return ws


def _torch_dtype_name(torch: Any, dt: Any) -> str:
    if dt == torch.float16:
        return "float16"
    if dt == torch.bfloat16:
        return "bfloat16"
    raise UnsupportedError(f"CUDA GEMM takes float16 or bfloat16 activations, got {dt}")


def _to_torch(torch: Any, arr: np.ndarray, dtype_name: str | None = None) -> Any:
    """numpy -> torch (bf16 held as uint16 bits becomes torch.bfloat16)."""
    arr = np.ascontiguousarray(arr)
    if dtype_name == "bfloat16" or (dtype_name is None and arr.dtype == np.uint16):
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if arr.dtype == np.uint16:
        arr = arr.astype(np.int32)
    return torch.from_numpy(arr)


class CudaPackedLinear:
    """One packed layer on one CUDA device; ``forward(x)`` = x · Wᵀ (+ bias) on the current stream."""

    def __init__(self, packed: PackedLayer, device: Any = None, dtypes: tuple[str, ...] | None = None):
        import torch

        _, self._lib_handle = _load()
        reason = unavailable_reason()
        if reason:
            raise UnsupportedError(reason)
        dev = torch.device(device if device is not None else "cuda")
        if dev.type != "cuda":
            raise BadInputError(f"CudaPackedLinear needs a cuda device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        m, t = packed.meta, packed.tensors
        self.n, self.k = (int(v) for v in m["shape"])
        self.np_, self.kp = padded_shape(self.n, self.k)
        if tuple(m["padded_shape"]) != (self.np_, self.kp):
            raise BadInputError(f"padded shape {m['padded_shape']} does not match shape {m['shape']}")
        self.storage_bits = int(m["storage_bits"])
        self.group_size = int(m["group_size"])
        self.zero_mode = str(m["zero_mode"])
        self.scale_dtype = str(m["scale_dtype"])
        wpl = 4 if self.storage_bits == 4 else 8
        qw = np.ascontiguousarray(t["qweight"])
        if qw.dtype != np.int32 or qw.shape != (self.np_ // 16, self.kp // 64 * 32 * wpl):
            raise BadInputError(f"qweight {qw.dtype} {list(qw.shape)} does not match the layout", tensor="qweight")
        self.qweight = torch.from_numpy(qw).to(dev)
        # parameters in their stored dtypes; converted per activation dtype on first use (on the device)
        self._src: dict[str, Any] = {"scales": _to_torch(torch, t["scales"], self.scale_dtype).to(dev)}
        implicit = 1 << (int(m["bits"]) - 1)
        if self.zero_mode == "none" and implicit != (8 if self.storage_bits == 4 else 128):
            # the kernels' symmetric path takes the zero of the storage width (8 or 128); a narrower source
            # width (2/3-bit codes in 4-bit fields, 5/6-bit in 8-bit fields) has zero 2**(bits-1), so it runs
            # as integer zero points of that value (exact in fp16/bf16)
            self.zero_mode = "int"
            gp = int(m["padded_groups"])
            self._src["zeros"] = torch.full((gp, self.np_), implicit, dtype=torch.int32, device=dev)
        elif self.zero_mode == "int":
            self._src["zeros"] = _to_torch(torch, np.asarray(t["zeros"]).astype(np.int32)).to(dev)
        elif self.zero_mode == "float":
            self._src["mins"] = _to_torch(torch, t["mins"], self.scale_dtype).to(dev)
        if "bias" in t:
            self._src["bias"] = _to_torch(torch, t["bias"], m.get("bias_dtype") or None).to(dev)
        self.perm = torch.from_numpy(np.ascontiguousarray(t["perm"], dtype=np.int32)).to(dev) if "perm" in t else None
        self._by_dtype: dict[str, dict[str, Any]] = {}
        self._plans: dict[tuple[int, str, bool, int, int], tuple[int, int, int]] = {}
        self._row_ok: bool | None = None  # row_ok, asked once
        default = dtypes if dtypes is not None else (
            ("bfloat16",) if self.scale_dtype == "bfloat16" else ("float16",))
        for name in default:
            self.prepare(name)

    @property
    def out_features(self) -> int:
        return self.n

    @property
    def in_features(self) -> int:
        return self.k

    def prepare(self, dtype_name: str) -> dict[str, Any]:
        """Device copies of scales / zeros / mins / bias in ``dtype_name`` (done once; capture-safe after)."""
        import torch

        got = self._by_dtype.get(dtype_name)
        if got is not None:
            return got
        if dtype_name not in _DT:
            raise UnsupportedError(f"CUDA GEMM takes float16 or bfloat16 activations, not {dtype_name}")
        tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
        got = {k: v.to(tdt).contiguous() for k, v in self._src.items()}
        self._by_dtype[dtype_name] = got
        return got

    def _plan(self, m: int, dtype_name: str, aligned: bool, kernel: int, splits: int) -> tuple[int, int, int]:
        key = (m, dtype_name, aligned, kernel, splits)
        got = self._plans.get(key)
        if got is None:
            ffi, lib = _load()
            ko, so, wb = ffi.new("int *"), ffi.new("int *"), ffi.new("size_t *")
            _check(lib.w4p_cuda_plan(self.device.index, m, self.n, self.k, self.storage_bits, self.group_size,
                                     int(self.perm is not None), int(aligned), kernel, splits, ko, so, wb), "plan")
            got = (ko[0], so[0], wb[0])
            self._plans[key] = got
        return got

    def reserve_workspace(self, max_m: int = 512) -> int:
        """Allocate the device's workspace for every automatic plan up to ``max_m`` rows now, so that calls made
        later inside a CUDA graph capture (or its warm-up) allocate nothing; returns its size in bytes."""
        import torch

        need = 0
        for dtype_name in self._by_dtype or {"float16": None}:
            for m in range(1, max_m + 1):
                for aligned in (True, False):
                    need = max(need, self._plan(m, dtype_name, aligned, KERNELS["auto"], 0)[2])
        return int(_workspace(torch, self.device, need).numel())

    def plan(self, m: int, dtype: str = "float16", kernel: str = "auto", splits: int = 0) -> dict[str, Any]:
        """The kernel, split count and workspace bytes a call with ``m`` rows would use (kernel -1: dense), and
        the native planner's one-line description of its choices ("detail", for logs and benchmarks)."""
        if self._use_dense(m, kernel):
            return {"kernel": -1, "splits": 1, "workspace_bytes": 0, "detail": "dense (dequantize + torch GEMM)"}
        k, s, w = self._plan(m, dtype, True, KERNELS[kernel], splits)
        ffi, lib = _load()
        buf = ffi.new("char[256]")
        _check(lib.w4p_cuda_plan_describe(self.device.index, m, self.n, self.k, self.storage_bits, self.group_size,
                                          int(self.perm is not None), 1, KERNELS[kernel], splits, buf, 256), "plan")
        return {"kernel": k, "splits": s, "workspace_bytes": w, "detail": ffi.string(buf).decode()}

    def _use_dense(self, m: int, kernel: str) -> bool:
        if kernel == "dense":
            return True
        if kernel != "auto" or m < DENSE_MIN_M:
            return False
        # the native plan's automatic choice: where it picks a one-pass kernel (wgmma, sm_90) that beats
        # dequantize + cuBLAS, keep it; where it falls back on the tiled kernel, the dense path is faster
        return self._plan(m, "float16", True, KERNELS["auto"], 0)[0] == KERNELS["tiled"]

    def _layer_args(self, ffi: Any, params: dict[str, Any]) -> tuple[Any, ...]:
        """qweight, storage_bits, group_size, zero_mode, scales, zeros, mins, perm: the layer's arguments, in the
        order every GEMM and dequantize entry point takes them."""
        return (ffi.cast("int32_t *", self.qweight.data_ptr()), self.storage_bits, self.group_size,
                _ZERO[self.zero_mode], _ptr(ffi, params["scales"]), _ptr(ffi, params.get("zeros")),
                _ptr(ffi, params.get("mins")),
                ffi.NULL if self.perm is None else ffi.cast("int32_t *", self.perm.data_ptr()))

    def dequantize(self, dtype: Any = None) -> Any:
        """The dense weight W [N, K] (original column order) in fp16/bf16 on the device, freshly computed."""
        import torch

        dtype = dtype or torch.float16
        dtype_name = _torch_dtype_name(torch, dtype)
        params = self.prepare(dtype_name)
        w = torch.empty((self.n, self.k), dtype=dtype, device=self.device)
        ffi, lib = _load()
        stream = torch.cuda.current_stream(self.device)
        rc = lib.w4p_cuda_dequantize(
            self.device.index, ffi.cast("void *", stream.cuda_stream), _DT[dtype_name], self.n, self.k,
            *self._layer_args(ffi, params), _ptr(ffi, w), w.stride(0))
        _check(rc, "w4p_cuda_dequantize")
        return w

    def forward(self, x: Any, bias: Any = None, out: Any = None, kernel: str = "auto", splits: int = 0) -> Any:
        """y[..., N] = x[..., K] · Wᵀ (+ bias). bias: None -> the layer's own, False -> none, else [N] values.
        out: optional preallocated [..., N] output (contiguous rows). kernel/splits: overrides for tests and
        benchmarks (auto by default)."""
        import torch

        if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
            raise BadInputError("CudaPackedLinear.forward takes a torch CUDA tensor")
        if x.device != self.device:
            raise BadInputError(f"x is on {x.device}, the layer on {self.device}")
        dtype_name = _torch_dtype_name(torch, x.dtype)
        if x.shape[-1] != self.k:
            raise BadInputError(f"x has {x.shape[-1]} features, the layer takes {self.k}")
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, self.k)
        if x2.shape[0] > 0 and (x2.stride(1) != 1 or x2.stride(0) < self.k):
            x2 = x2.contiguous()
        m = int(x2.shape[0])
        if out is None:
            y = torch.empty((m, self.n), dtype=x.dtype, device=x.device)
        else:
            if out.dtype != x.dtype or out.device != x.device or tuple(out.shape) != lead + (self.n,):
                raise BadInputError(f"out must be {x.dtype} {list(lead + (self.n,))} on {x.device}")
            y = out.reshape(-1, self.n)
            if y.stride(1) != 1:
                raise BadInputError("out rows must be contiguous")
        if m == 0:
            return y.reshape(*lead, self.n)
        params = self.prepare(dtype_name)
        b = params.get("bias") if bias is None else None
        if bias is not None and bias is not False:
            b = torch.as_tensor(bias, device=x.device).to(x.dtype).contiguous()
            if tuple(b.shape) != (self.n,):
                raise BadInputError(f"bias has shape {list(b.shape)}, expected [{self.n}]")
        if self._use_dense(m, kernel):
            # large M is bound by arithmetic: one pass to dequantize, then the dense tensor-core GEMM
            w = self.dequantize(x.dtype)
            if b is None:
                torch.mm(x2, w.t(), out=y)
            else:
                torch.addmm(b, x2, w.t(), out=y)
            return y.reshape(*lead, self.n)
        aligned = x2.data_ptr() % 16 == 0 and x2.stride(0) % 8 == 0
        kcode = KERNELS[kernel]
        _, _, need = self._plan(m, dtype_name, aligned, kcode, splits)
        stream = torch.cuda.current_stream(self.device)
        ws = _workspace(torch, self.device, need)
        ffi, lib = _load()
        rc = lib.w4p_cuda_gemm(
            self.device.index, ffi.cast("void *", stream.cuda_stream), _DT[dtype_name], m, self.n, self.k,
            _ptr(ffi, x2), x2.stride(0), _ptr(ffi, y), y.stride(0), *self._layer_args(ffi, params),
            _ptr(ffi, b), _ptr(ffi, ws), ws.numel(), kcode, splits)
        _check(rc, "w4p_cuda_gemm")
        return y.reshape(*lead, self.n)

    __call__ = forward

    def row_ok(self) -> bool:
        """Whether ``forward_row`` runs this layer: the gemv kernel takes it (4-bit storage, its group sizes,
        compute capability 8.0 or newer), asked of the planner once."""
        if self._row_ok is None:
            try:
                self._plan(1, "float16", True, KERNELS["gemv"], 0)
                self._row_ok = True
            except W4PackError:
                self._row_ok = False
        return self._row_ok

    def forward_row(self, x: Any, prologue: str = "plain", norm_weight: Any = None, eps: float = 0.0,
                    residual: Any = None, out: Any = None) -> Any:
        """y[1, N] = f(x) · Wᵀ + residual for one row, one gemv launch, with f applied while the kernel stages x
        (``PROLOGUES``): "rmsnorm", transformers' RMSNorm (x / sqrt(mean(x²) + eps) in fp32, rounded to x's
        dtype, times ``norm_weight``, rounded); "swiglu", x = [gate | up] of 2K values and f = silu(gate) · up
        (silu in fp32, rounded, times up, rounded); "plain", f = identity. The layer's own bias, if any, is
        summed before the product's rounding; residual (N values, in a decoder layer the residual stream) is
        added after it, rounding as the unfolded layer's ``residual + proj(x)`` does (with an own bias too, the
        add is a second kernel). y (``out``) must alias neither x nor residual. Why: at M = 1 every gemv block
        stages the whole row, so the decoder layer's norm, activation and residual add cost no kernel of their
        own. ``row_ok`` first."""
        import torch

        if prologue not in PROLOGUES:
            raise BadInputError(f"prologue {prologue!r}: one of {', '.join(PROLOGUES)}")
        if not isinstance(x, torch.Tensor) or x.device != self.device:
            raise BadInputError(f"x must be a torch tensor on {self.device}")
        dtype_name = _torch_dtype_name(torch, x.dtype)
        width = 2 * self.k if prologue == "swiglu" else self.k
        if x.numel() != width or x.shape[-1] != width:
            raise BadInputError(f"forward_row ({prologue}) takes one row of {width} features, got {list(x.shape)}")
        nw = None
        if prologue == "rmsnorm":
            if norm_weight is None or tuple(norm_weight.shape) != (self.k,) or norm_weight.dtype != x.dtype or \
                    norm_weight.device != x.device:
                raise BadInputError(f"norm_weight must be {x.dtype} [{self.k}] on {x.device}")
            nw = norm_weight.contiguous()
        lead = tuple(x.shape[:-1])
        x1 = x.reshape(width).contiguous()
        params = self.prepare(dtype_name)
        b, flags = params.get("bias"), 0
        if residual is not None:
            if residual.numel() != self.n or residual.dtype != x.dtype or residual.device != x.device:
                raise BadInputError(f"residual must be {x.dtype} with {self.n} values on {x.device}")
            if b is not None:  # (one bias input: the own bias takes it, the residual a kernel of its own)
                y = self.forward_row(x, prologue, norm_weight, eps, out=out)
                return y.add_(residual.reshape(y.shape))
            b, flags = residual.reshape(self.n).contiguous(), _ROW_RESIDUAL
        if out is None:
            y = torch.empty(self.n, dtype=x.dtype, device=x.device)
        else:
            if out.dtype != x.dtype or out.device != x.device or out.numel() != self.n or not out.is_contiguous():
                raise BadInputError(f"out must be contiguous {x.dtype} with {self.n} values on {x.device}")
            y = out.view(self.n)
        _, _, need = self._plan(1, dtype_name, True, KERNELS["gemv"], 0)
        stream = torch.cuda.current_stream(self.device)
        ws = _workspace(torch, self.device, need)
        ffi, lib = _load()
        rc = lib.w4p_cuda_gemm_row(
            self.device.index, ffi.cast("void *", stream.cuda_stream), _DT[dtype_name], self.n, self.k,
            _ptr(ffi, x1), _ptr(ffi, y), *self._layer_args(ffi, params), _ptr(ffi, b), PROLOGUES[prologue] | flags,
            _ptr(ffi, nw), float(eps), _ptr(ffi, ws), ws.numel())
        _check(rc, "w4p_cuda_gemm_row")
        return y.reshape(*lead, self.n)


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).multi_processor_count)


#: blocks per multiprocessor the decode attention's launch aims at in all (default 2), for the bench's A/B
ATTN_BLOCKS_ENV = "W4PACK_ATTN_BLOCKS"


def attention_splits(device: Any, kv_heads: int) -> int:
    """Blocks per kv head for the decode attention: about two blocks per multiprocessor in all
    ($W4PACK_ATTN_BLOCKS sets how many), so a long context's keys spread over the whole GPU; a short context
    runs on fewer (the kernel gives every split at least a tile of keys)."""
    per_sm = _blocks_per_sm(os.environ.get(ATTN_BLOCKS_ENV, ""))
    return max(1, min(64, -(-per_sm * _multiprocessors(device.index) // kv_heads)))


@functools.lru_cache(maxsize=8)
def _blocks_per_sm(text: str) -> int:
    if not text.strip():
        return 2
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 16:
        raise BadInputError(f"{ATTN_BLOCKS_ENV}={text!r}: give the decode attention's blocks per multiprocessor, "
                            f"1 to 16")
    return n


def decode_attention(qkv: Any, cos: Any, sin: Any, pos: Any, k_cache: Any, v_cache: Any, heads: int, kv_heads: int,
                     scaling: float, splits: int = 0) -> Any:
    """One token's attention through ``w4p_cuda_decode_attention`` (``w4pack.runtime.attention`` says what it
    computes); returns [heads * head_dim]. splits: blocks per kv head (0: ``attention_splits``). The workspace
    is one per device, as the GEMMs' is: calls on one device must not run concurrently on two streams."""
    import torch

    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise BadInputError(f"the caches must be [kv_heads, max_len, head_dim] alike, got {list(k_cache.shape)} "
                            f"and {list(v_cache.shape)}")
    kvh, max_len, d = (int(n) for n in k_cache.shape)
    dev, dt = qkv.device, qkv.dtype
    if kvh != kv_heads or qkv.numel() != (heads + 2 * kv_heads) * d:
        raise BadInputError(f"qkv of {qkv.numel()} values and caches {list(k_cache.shape)} do not fit {heads} heads "
                            f"over {kv_heads} kv heads")
    tensors = {"qkv": qkv, "k_cache": k_cache, "v_cache": v_cache}
    if cos is not None or sin is not None:
        if cos is None or sin is None or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d or \
                cos.shape[0] < max_len:
            raise BadInputError(f"cos and sin must both be [max_len, {d}] (max_len >= {max_len})")
        tensors.update(cos=cos, sin=sin)
    for name, t in tensors.items():
        if t.device != dev or t.dtype != dt or not t.is_contiguous():
            raise BadInputError(f"{name} must be contiguous {dt} on {dev}")
    if pos.device != dev or pos.dtype != torch.int64 or pos.numel() != 1:
        raise BadInputError(f"pos must be one int64 on {dev}")
    splits = splits or attention_splits(dev, kv_heads)
    ffi, lib = _load()
    need = lib.w4p_cuda_decode_attention_workspace(heads, kv_heads, d, splits)
    ws = _workspace(torch, dev, need, _attn_workspaces) if need else None
    out = torch.empty(heads * d, dtype=dt, device=dev)
    stream = torch.cuda.current_stream(dev)
    rc = lib.w4p_cuda_decode_attention(
        dev.index, ffi.cast("void *", stream.cuda_stream), _DT[_torch_dtype_name(torch, dt)], heads, kv_heads, d,
        _ptr(ffi, qkv), _ptr(ffi, cos), _ptr(ffi, sin), ffi.cast("int64_t *", pos.data_ptr()), _ptr(ffi, k_cache),
        _ptr(ffi, v_cache), max_len, float(scaling), _ptr(ffi, out), splits, _ptr(ffi, ws),
        0 if ws is None else ws.numel())
    _check(rc, "w4p_cuda_decode_attention")
    return out


_layers: dict[tuple[int, str], tuple[weakref.ref, CudaPackedLinear]] = {}


def _layer_for(packed: PackedLayer, device: Any) -> CudaPackedLinear:
    key = (id(packed), str(device))
    hit = _layers.get(key)
    if hit is not None and hit[0]() is packed:
        return hit[1]
    lin = CudaPackedLinear(packed, device)
    _layers[key] = (weakref.ref(packed, lambda _r, k=key: _layers.pop(k, None)), lin)
    return lin


def gemm(x: Any, packed: PackedLayer, bias: Any = None, precision: str = "exact", out_dtype: Any = None) -> Any:
    """y = x · Wᵀ (+ bias) for a torch CUDA tensor x; the layer is uploaded once per device and cached.
    precision is accepted for symmetry with the CPU path (the CUDA kernel has one: fp32 accumulation)."""
    if precision not in ("exact", "fast"):
        raise BadInputError(f"precision must be 'exact' or 'fast', got {precision!r}")
    y = _layer_for(packed, x.device).forward(x, bias=bias)
    if out_dtype is not None and out_dtype != y.dtype:
        y = y.to(out_dtype)
    return y


def gemm_cuda(x: Any, packed: PackedLayer, bias: Any = None) -> Any:
    """Shorthand for ``gemm(x, packed, bias)``."""
    return gemm(x, packed, bias=bias)
