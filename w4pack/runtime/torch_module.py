"""``W4Linear``: a torch ``nn.Module`` holding one packed layer and running it with the native GEMM.

Why a module and a custom op: transformers' model code calls ``self.q_proj(x)``; swapping the ``nn.Linear``
for ``W4Linear`` runs the packed weights with no change to the model's code. The GEMM is registered as the torch
custom op ``w4pack::linear`` (``torch.library.custom_op`` with a fake implementation) so ``torch.compile`` traces
through it as one opaque node and CUDA graphs capture the kernel launch (the kernels use the current stream).

Storage: the packed tensors are *buffers* (so ``.to(device)`` and ``state_dict`` carry them) named after the
checkpoint suffixes (``qweight``, ``scales``, ``zeros``/``mins``, ``perm``, ``bias``). Float tensors are kept as
their raw bit patterns in integer buffers (``scales_bits`` etc. hold fp16/bf16 as int16, fp32 as int32), so
``model.half()`` or ``model.to(torch.bfloat16)`` can never round a scale: the kernels see exactly the bits the
checkpoint stores. The native kernels prepare their own form of the weights (the CPU repacks into its tiles once)
on first use on each device; that prepared form is cached and rebuilt when the buffers move.

The dequantized float path (``dequantize()``) exists for references and tests; ``forward`` never uses it.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

from ..core.canonical import CanonicalLayer
from ..core.dtypes import FLOAT_DTYPES
from ..errors import BadInputError, UnsupportedError
from ..core.layout import PackedLayer, pack, tensor_suffixes, unpack

__all__ = ["W4Linear", "W4FusedLinear", "W4SliceLinear", "W4Experts", "W4Expert", "W4Embedding", "W4TiedHead",
           "PRECISIONS"]

PRECISIONS = ("exact", "fast")

#: float dtype name -> integer torch dtype of the same width (the bits are stored, not the values)
_BITS_DTYPE = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32}
_NP_BITS_DTYPE = {"float16": np.int16, "bfloat16": np.int16, "float32": np.int32}
#: float dtype name -> torch float dtype (for dequantize and for handing float views to the kernels)
TORCH_FLOAT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# Modules by handle, so the custom op (which takes only tensors and scalars) can find the prepared kernel.
_HANDLES: "weakref.WeakValueDictionary[int, W4Linear]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)
_LOCK = threading.Lock()


def _float_suffixes(meta: dict[str, Any]) -> dict[str, str]:
    """Suffix -> float dtype name for the tensors stored as bit patterns."""
    out = {"scales": meta["scale_dtype"]}
    if meta["zero_mode"] == "float":
        out["mins"] = meta["scale_dtype"]
    if meta.get("bias_dtype"):
        out["bias"] = meta["bias_dtype"]
    return out


def _buffer_specs(meta: dict[str, Any], has_bias: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and torch dtype of every buffer of a layer with this manifest entry."""
    from ..core.layout import TILE_K, TILE_N, WARP, words_per_tile_lane

    n, k = meta["shape"]
    np_, kp = meta["padded_shape"]
    gp = meta["padded_groups"]
    sbits = meta["storage_bits"]
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "qweight": ((np_ // TILE_N, kp // TILE_K * WARP * words_per_tile_lane(sbits)), torch.int32),
        "scales": ((gp, np_), _BITS_DTYPE[meta["scale_dtype"]]),
    }
    if meta["zero_mode"] == "int":
        specs["zeros"] = ((gp, np_), torch.uint8 if sbits == 4 else torch.int16)
    elif meta["zero_mode"] == "float":
        specs["mins"] = ((gp, np_), _BITS_DTYPE[meta["scale_dtype"]])
    if meta["act_order"]:
        specs["perm"] = ((k,), torch.int32)
    if has_bias:
        specs["bias"] = ((n,), _BITS_DTYPE[meta.get("bias_dtype") or "float16"])
    return specs


def _to_bits_tensor(arr: np.ndarray, suffix: str, meta: dict[str, Any]) -> torch.Tensor:
    """A numpy tensor of a packed layer as the integer buffer W4Linear keeps (bit patterns for floats)."""
    a = np.ascontiguousarray(arr)
    fl = _float_suffixes(meta)
    if suffix in fl:
        a = a.view(_NP_BITS_DTYPE[fl[suffix]])
    elif suffix == "zeros" and a.dtype == np.uint16:
        a = a.view(np.int16)
    return torch.from_numpy(np.array(a, copy=True))


def _from_bits_array(t: torch.Tensor, suffix: str, meta: dict[str, Any]) -> np.ndarray:
    """Inverse of ``_to_bits_tensor``: the numpy array layout.py expects (bf16 as uint16)."""
    a = t.detach().cpu().numpy()
    fl = _float_suffixes(meta)
    if suffix in fl:
        return a.view(FLOAT_DTYPES[fl[suffix]])
    if suffix == "zeros" and a.dtype == np.int16:
        return a.view(np.uint16)
    return a


class W4Linear(nn.Module):
    """A linear layer whose weights are one packed w4pack layer; ``forward`` runs the native GEMM.

    Build it with ``W4Linear.from_packed(packed)`` (from a checkpoint), ``W4Linear.from_canonical(layer)``, or
    ``W4Linear(meta, device="meta")`` for an empty skeleton that a loader fills. ``precision`` picks the CPU path:
    ``"exact"`` (fp32 dequantize, for verification) or ``"fast"`` (int8 activations); CUDA has one path.

    ``name`` (``layer_name``) is the layer's name in its checkpoint; the loader passes it, and a manifest entry's
    tensor names give it when not passed (None for a layer packed in memory). The errors a layer raises for a
    wrong precision, an input of the wrong width or dtype start with it ("layer model.layers.3.mlp.up_proj:
    input has ..."), so a user running a whole model can tell which layer refused; they stay ``ValueError``s.
    """

    def __init__(self, meta: dict[str, Any], *, has_bias: bool | None = None, device: Any = None,
                 precision: str = "exact", threads: int | None = None, persistent: bool = True,
                 name: str | None = None):
        super().__init__()
        self.layer_name = name if name is not None else _name_from_meta(meta)
        # "storage" describes the on-disk form; the module holds the runtime tensors that form expands to
        self.meta = {k: v for k, v in meta.items() if k not in ("tensors", "source", "storage")}
        if has_bias is None:
            has_bias = "bias" in (meta.get("tensors") or {})
        if has_bias and not self.meta.get("bias_dtype"):
            self.meta["bias_dtype"] = "float16"
        if not has_bias:
            self.meta.pop("bias_dtype", None)
        self.out_features, self.in_features = (int(v) for v in self.meta["shape"])
        if precision not in PRECISIONS:
            raise ValueError(f"{self._where()}precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.threads = threads
        for suffix, (shape, dt) in _buffer_specs(self.meta, has_bias).items():
            self.register_buffer(suffix, torch.empty(shape, dtype=dt, device=device), persistent=persistent)
        self._prepared: dict[tuple[str, int], Any] = {}
        self._register()

    def _where(self) -> str:
        """"layer NAME: " to start a message about this layer with; "" where its name is not known."""
        name = self.__dict__.get("layer_name")
        return f"layer {name}: " if name else ""

    @contextlib.contextmanager
    def _naming_errors(self) -> Iterator[None]:
        """The kernels' bad-input errors (an activation dtype they do not take, a precision set after building)
        with this layer's name in front: they know the shapes, not which of a model's layers they serve."""
        try:
            yield
        except BadInputError as exc:
            where = self._where()
            if where and not exc.message.startswith(where):
                exc.message = where + exc.message
                exc.args = (exc.one_line(),)
            raise

    def _register(self) -> None:
        """A fresh handle: the custom op finds this module (and its prepared kernels) by it."""
        with _LOCK:
            self.handle = next(_NEXT_HANDLE)
            _HANDLES[self.handle] = self

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy / pickle: the copy has its own buffers, so it needs its own handle and kernels
        super().__setstate__(state)
        self._prepared = {}
        self._register()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["_prepared"] = {}  # native kernel objects are not copyable; rebuilt on first use
        return state

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_packed(cls, packed: PackedLayer, *, device: Any = None, precision: str = "exact",
                    threads: int | None = None, name: str | None = None) -> "W4Linear":
        """Copy one packed layer (numpy, e.g. memory-mapped from a checkpoint) into a new module; ``name``: the
        layer's name (else its manifest entry's, if it has one), for the module's errors."""
        meta = dict(packed.meta)
        has_bias = "bias" in packed.tensors
        if has_bias and not meta.get("bias_dtype"):
            from ..core.dtypes import dtype_name_of

            meta["bias_dtype"] = dtype_name_of(np.asarray(packed.tensors["bias"]))
        mod = cls(meta, has_bias=has_bias, device="meta", precision=precision, threads=threads, name=name)
        mod.load_packed(packed, device=device)
        return mod

    @classmethod
    def from_canonical(cls, layer: CanonicalLayer, **kwargs: Any) -> "W4Linear":
        """Pack a canonical layer (layout v1) and wrap it."""
        return cls.from_packed(pack(layer), **kwargs)

    def load_packed(self, packed: PackedLayer, device: Any = None) -> None:
        """Fill the buffers from a packed layer's tensors (one copy each; no float weights are built)."""
        suffixes = tensor_suffixes(self.meta["zero_mode"], self.meta["act_order"])
        if "bias" in self._buffers:
            suffixes = suffixes + ["bias"]
        for suffix in suffixes:
            name = self.__dict__.get("layer_name")  # (absent from a module pickled before it had one)
            tensor = f"{name}.{suffix}" if name else suffix
            if suffix not in packed.tensors:
                raise UnsupportedError("packed layer lacks a tensor this module needs", tensor=tensor)
            t = _to_bits_tensor(packed.tensors[suffix], suffix, self.meta)
            want = self._buffers[suffix]
            if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
                raise UnsupportedError(f"packed tensor {list(t.shape)} {t.dtype} does not match the module's "
                                       f"{list(want.shape)} {want.dtype}", tensor=tensor)
            self._buffers[suffix] = t.to(device) if device is not None else t
        self._prepared.clear()

    def packed_layer(self) -> PackedLayer:
        """The module's weights as a numpy PackedLayer (copied to host memory): the layout's tensors only, not
        other buffers a subclass keeps (``W4Embedding``'s dtype marker)."""
        suffixes = tensor_suffixes(self.meta["zero_mode"], self.meta["act_order"])
        if "bias" in self._buffers:
            suffixes = suffixes + ["bias"]
        tensors = {suffix: _from_bits_array(self._buffers[suffix], suffix, self.meta) for suffix in suffixes}
        return PackedLayer(meta=dict(self.meta), tensors=tensors)

    # -- numerics --------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Float weights [N, K] in the original column order (the reference; forward never uses it)."""
        w = unpack(self.packed_layer()).dequantize(np.float64 if dtype == torch.float64 else np.float32)
        return torch.from_numpy(w).to(dtype)

    def bias_tensor(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        if "bias" not in self._buffers:
            return None
        return self._buffers["bias"].view(TORCH_FLOAT[self.meta["bias_dtype"]]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T (+ bias) with the native GEMM (``forward`` of a linear layer; a tied head's too)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self._where()}input has {x.shape[-1]} features, the layer expects {self.in_features}")
        if torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled()):
            # traced graphs (torch.compile, torch.export) see one opaque custom-op node; the op also carries the
            # gradient with respect to x (the packed weights are frozen: no gradient of their own)
            return torch.ops.w4pack.linear(x, self.qweight, self.handle, self.out_features, self.precision)
        # eager: the same kernel without the dispatcher round trip (~50 us a call, 10+ ms per decoded token
        # on a 30-layer model); CUDA graph capture records the kernel launch either way
        return self._run(x, self.precision)

    def grad_input(self, grad_out: torch.Tensor) -> torch.Tensor:
        """dL/dx = dL/dy @ W for y = x @ W.T (+ bias): the layer dequantized on each call, in float32, then the
        gradient's dtype. For training what sits around frozen 4-bit layers (adapters, prompts); not fast."""
        w = self.dequantize(torch.float32).to(grad_out.device)
        return (grad_out.to(torch.float32) @ w).to(grad_out.dtype)

    def fold_ok(self, device: Any, dtype: torch.dtype) -> bool:
        """Whether ``fold`` runs on ``device`` for ``dtype`` activations: CUDA, fp16/bf16 and a layer the gemv
        kernel takes (the norm and SwiGLU are applied in its staging, the residual in its epilogue). Asked
        eagerly, before any trace or capture."""
        dev = _normalize_device(device)
        if dev.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            return False
        return bool(self._kernel(dev).row_ok())

    def fold(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
        """One row (M = 1) through one kernel with its decoder-layer neighbours folded in: y = f(x) @ W.T (+ bias)
        + residual, f = RMSNorm with ``norm_weight`` (transformers' arithmetic), or with ``swiglu`` silu(gate) *
        up of x = [gate | up] (2 in_features values), else nothing. The residual (None: nothing) is added after
        the product's rounding, rounding as the unfolded layer's add does. Only where
        ``fold_ok``; a decode step calls it to spare the norm, activation and residual-add kernels of each
        layer."""
        if torch.compiler.is_compiling():
            return torch.ops.w4pack.linear_fold(x, self.qweight, self.handle, self.out_features, norm_weight,
                                                float(eps), residual, bool(swiglu))
        return self._run_fold(x, norm_weight, eps, residual, swiglu)

    def _run_fold(self, x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                  residual: torch.Tensor | None, swiglu: bool = False) -> torch.Tensor:
        prologue = "rmsnorm" if norm_weight is not None else "swiglu" if swiglu else "plain"
        with self._naming_errors():
            return self._kernel(x.device).forward_row(x, prologue, norm_weight, eps, residual=residual)

    # -- kernels ---------------------------------------------------------------------------------
    def _kernel(self, device: torch.device) -> Any:
        """The native kernel object for ``device``, built on first use and after the buffers moved."""
        device = _normalize_device(device)
        # (the versions: load_state_dict and copy_ write new weights into the same storage, which a key of the
        # address alone would keep serving from the kernel built for the old ones)
        key = (str(device), self.qweight.data_ptr(), tuple(tensor_version(b) for b in self._buffers.values()))
        k = self._prepared.get(key)
        if k is None:
            if self.qweight.device != device:
                raise RuntimeError(f"W4Linear weights are on {self.qweight.device} but the input is on {device}; "
                                   "move the module with .to(device)")
            self._prepared.clear()
            k = _build_kernel(self, device)
            self._prepared[key] = k
        return k

    def prepare(self, device: Any = None, dtype: torch.dtype | None = None) -> "W4Linear":
        """Build the native kernel now (CPU repack / CUDA parameter copies and workspace): call it before CUDA
        graph capture or ``torch.compile(mode="reduce-overhead")``, whose warm-up must allocate nothing that
        outlives a call."""
        dev = _normalize_device(device) if device is not None else self.qweight.device
        kernel = self._kernel(dev)
        if dev.type == "cuda":
            if dtype is not None:
                kernel.prepare(_cuda_dtype_name(dtype, self.meta["scale_dtype"]))
            kernel.reserve_workspace()
        return self

    def _run(self, x: torch.Tensor, precision: str) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.numel() == 0:  # no rows: an empty result, as nn.Linear gives (the kernels take M >= 1)
            return x.new_empty((*lead, self.out_features))
        kernel = self._kernel(x.device)
        x2 = x.reshape(-1, self.in_features)
        with self._naming_errors():
            if x.device.type == "cpu":
                y = kernel.forward(x2.contiguous(), precision=precision)
            else:
                # the CUDA kernels take fp16/bf16 activations: fp32 models run the GEMM in the scale dtype's
                # 16-bit type (fp16 unless the checkpoint stores bf16 scales) and get fp32 back
                half = TORCH_FLOAT[_cuda_dtype_name(x.dtype, self.meta["scale_dtype"])]
                y = kernel.forward(x2.to(half).contiguous())
        y = y.to(dtype=x.dtype)
        return y.reshape(*lead, self.out_features)

    def _apply(self, fn: Any, recurse: bool = True) -> "W4Linear":  # noqa: D401 - torch hook
        out = super()._apply(fn, recurse)
        self._prepared.clear()
        return out

    def extra_repr(self) -> str:
        m = self.meta
        parts = [f"in_features={self.in_features}", f"out_features={self.out_features}", f"bits={m['bits']}",
                 f"group_size={m['group_size']}", f"zero_mode={m['zero_mode']}", f"scale_dtype={m['scale_dtype']}"]
        if m.get("act_order"):
            parts.append("act_order=True")
        parts.append(f"bias={'bias' in self._buffers}")
        parts.append(f"precision={self.precision}")
        return ", ".join(parts)


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write), -1 for an inference tensor (none kept)."""
    return -1 if t.is_inference() else t._version


def _name_from_meta(meta: dict[str, Any]) -> str | None:
    """The layer's name from a manifest entry's tensor names ("model.layers.0.mlp.up_proj.qweight"), or None."""
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        return None
    first = tensors.get("qweight") or next(iter(tensors.values()))
    if not isinstance(first, str):
        return None
    return first.rpartition(".")[0] or None


def _normalize_device(device: Any) -> torch.device:
    """'cuda' -> 'cuda:<current>', so a kernel prepared at load is found again by the inputs' device."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _cuda_dtype_name(dtype: torch.dtype, scale_dtype: str) -> str:
    if dtype == torch.float16:
        return "float16"
    if dtype == torch.bfloat16:
        return "bfloat16"
    return "bfloat16" if scale_dtype == "bfloat16" else "float16"


def _build_kernel(mod: W4Linear, device: torch.device) -> Any:
    """Prepare the native kernel for this module's weights on ``device`` (both add the packed bias)."""
    if device.type == "cpu":
        from ..native.cpu import CpuPackedLinear

        return CpuPackedLinear(mod.packed_layer(), threads=mod.threads)
    if device.type == "cuda":
        from ..native.cuda import CudaPackedLinear

        kernel = CudaPackedLinear(mod.packed_layer(), device)
        # the kernel reads qweight/perm in layout v1 as uploaded; share the module's device buffers instead
        # of keeping a second copy of the largest tensor on the GPU
        for attr in ("qweight", "perm"):
            mine, theirs = mod._buffers.get(attr), getattr(kernel, attr, None)
            if mine is not None and isinstance(theirs, torch.Tensor) and mine.device == theirs.device \
                    and mine.dtype == theirs.dtype and mine.shape == theirs.shape and mine.is_contiguous():
                setattr(kernel, attr, mine)
        return kernel
    raise UnsupportedError(f"W4Linear runs on cpu and cuda devices, not {device.type}")


# -- the custom op -------------------------------------------------------------------------------
@torch.library.custom_op("w4pack::linear", mutates_args=())
def _w4_linear_op(x: torch.Tensor, qweight: torch.Tensor, handle: int, out_features: int,
                  precision: str) -> torch.Tensor:
    """y = x @ W.T (+ bias) with W the packed layer of module ``handle``; runs the native kernel."""
    mod = _HANDLES.get(handle)
    if mod is None:
        raise RuntimeError(f"w4pack::linear: module {handle} no longer exists")
    return mod._run(x, precision)


@_w4_linear_op.register_fake
def _w4_linear_fake(x: torch.Tensor, qweight: torch.Tensor, handle: int, out_features: int,
                    precision: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("w4pack::linear_grad_input", mutates_args=())
def _w4_grad_op(grad_out: torch.Tensor, qweight: torch.Tensor, handle: int, in_features: int) -> torch.Tensor:
    """dL/dx of ``w4pack::linear`` (``W4Linear.grad_input``)."""
    mod = _HANDLES.get(handle)
    if mod is None:
        raise RuntimeError(f"w4pack::linear_grad_input: module {handle} no longer exists")
    return mod.grad_input(grad_out)


@_w4_grad_op.register_fake
def _w4_grad_fake(grad_out: torch.Tensor, qweight: torch.Tensor, handle: int, in_features: int) -> torch.Tensor:
    return grad_out.new_empty((*grad_out.shape[:-1], in_features))


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _x, qweight, handle, _n, _precision = inputs
    ctx.qweight, ctx.handle = qweight, handle
    ctx.in_features = _HANDLES[handle].in_features if handle in _HANDLES else int(_x.shape[-1])


def _linear_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    gx = torch.ops.w4pack.linear_grad_input(grad_out, ctx.qweight, ctx.handle, ctx.in_features)
    return gx, None, None, None, None


_w4_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


# (typing.Optional: the schema inference of older torch releases, e.g. vLLM's, reads no PEP 604 unions)
@torch.library.custom_op("w4pack::linear_fold", mutates_args=())
def _w4_fold_op(x: torch.Tensor, qweight: torch.Tensor, handle: int, out_features: int,
                norm_weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor],
                swiglu: bool) -> torch.Tensor:
    """y = f(x) @ W.T (+ bias) + residual in one kernel launch (``W4Linear.fold``)."""
    mod = _HANDLES.get(handle)
    if mod is None:
        raise RuntimeError(f"w4pack::linear_fold: module {handle} no longer exists")
    return mod._run_fold(x, norm_weight, eps, residual, swiglu)


@_w4_fold_op.register_fake
def _w4_fold_fake(x: torch.Tensor, qweight: torch.Tensor, handle: int, out_features: int,
                  norm_weight: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor],
                  swiglu: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


# -- fused projections -----------------------------------------------------------------------------
class W4FusedLinear(W4Linear):
    """One packed layer holding several projections stacked along N (q/k/v or gate/up).

    The model keeps calling ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``: those are ``W4SliceLinear`` views that
    share this module. The first view called with a given input runs the one fused GEMM; the others return
    their rows of the same output (eager mode). Under ``torch.compile`` each view runs the op and slices, and
    the compiler sees identical calls.
    """

    def __init__(self, meta: dict[str, Any], parts: list[dict[str, Any]], **kwargs: Any):
        super().__init__(meta, **kwargs)
        self.parts = [{"name": p["name"], "rows": [int(p["rows"][0]), int(p["rows"][1])]} for p in parts]
        self._cache: tuple[Any, Any, torch.Tensor, set[int]] | None = None  # (x, version or copy, out, served)

    def slice_forward(self, x: torch.Tensor, index: int) -> torch.Tensor:
        lo, hi = self.parts[index]["rows"]
        if torch.compiler.is_compiling():
            return self.forward(x)[..., lo:hi]
        c = self._cache
        # the same input, unchanged since the first view's call: its version counter tells. An inference tensor
        # keeps none: on the CPU a copy of it is kept and compared (x.mul_(2) between q_proj(x) and k_proj(x)
        # would otherwise give k from the old x); on CUDA the comparison would synchronize with the device at
        # every layer and cannot run in a graph capture, so there the same tensor object is taken as unchanged
        if c is not None and c[0] is x and index not in c[3] and (
                torch.equal(c[1], x) if isinstance(c[1], torch.Tensor) else c[1] == tensor_version(x)):
            mark, out, served = c[1], c[2], c[3]
        else:
            out, served = self.forward(x), set()
            mark = x.clone() if x.is_inference() and x.device.type == "cpu" else tensor_version(x)
        served.add(index)
        self._cache = None if len(served) == len(self.parts) else (x, mark, out, served)
        return out[..., lo:hi]

    def extra_repr(self) -> str:
        return super().extra_repr() + ", parts=" + "/".join(p["name"].rsplit(".", 1)[-1] for p in self.parts)


class W4SliceLinear(nn.Module):
    """The rows [start, end) of a ``W4FusedLinear``; stands in for one of the fused projections."""

    def __init__(self, fused: W4FusedLinear, index: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a child: the fused module is owned by the parent
        self.index = index
        lo, hi = fused.parts[index]["rows"]
        self.in_features = fused.in_features
        self.out_features = hi - lo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.slice_forward(x, self.index)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        lo, hi = self.fused.parts[self.index]["rows"]
        return self.fused.dequantize(dtype)[lo:hi]

    def extra_repr(self) -> str:
        lo, hi = self.fused.parts[self.index]["rows"]
        return f"rows={lo}:{hi} of {self.fused.parts[self.index]['name'].rsplit('.', 1)[0]}.<fused>"


# -- mixture of experts ----------------------------------------------------------------------------
class W4Expert(nn.Module):
    """One expert's gated MLP, ``down(act(gate(x)) * up(x))``, whose projections are children named as the
    checkpoint names them (``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj``), so the loader fills
    ``<experts>.<e>.<leaf>`` like any other Linear (packed, fused or float)."""

    def __init__(self, leaves: tuple[str, str, str], act_fn: Any, hidden_dim: int, intermediate_dim: int,
                 dtype: torch.dtype, device: Any = "meta"):
        super().__init__()
        self.leaves = leaves
        object.__setattr__(self, "act_fn", act_fn)  # shared with the W4Experts; not a child per expert
        gate, up, down = leaves
        self.add_module(gate, nn.Linear(hidden_dim, intermediate_dim, bias=False, device=device, dtype=dtype))
        self.add_module(up, nn.Linear(hidden_dim, intermediate_dim, bias=False, device=device, dtype=dtype))
        self.add_module(down, nn.Linear(intermediate_dim, hidden_dim, bias=False, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, leaf) for leaf in self.leaves)
        return down(self.act_fn(gate(x)) * up(x))


class W4Experts(nn.Module):
    """Stands in for transformers' fused experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]).

    transformers 5 keeps a MoE block's experts as two 3-D parameters; a quantized checkpoint holds one 2-D layer
    per expert and projection. This module holds one ``W4Expert`` per expert (children ``"0"``, ``"1"``, ... so
    ``mlp.experts.3.w1`` is a module path) and keeps the original call signature ``(hidden_states, top_k_index,
    top_k_weights)``: the router, top-k selection and weight normalisation stay transformers' own code in the
    parent block. Tokens are dispatched per expert exactly as transformers' eager experts loop does (same
    order of accumulation), each expert running its packed layers with the native GEMM.
    """

    def __init__(self, num_experts: int, leaves: tuple[str, str, str], act_fn: Any, hidden_dim: int,
                 intermediate_dim: int, dtype: torch.dtype, device: Any = "meta"):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.act_fn = act_fn
        for e in range(num_experts):
            self.add_module(str(e), W4Expert(leaves, act_fn, hidden_dim, intermediate_dim, dtype, device))

    @classmethod
    def replacing(cls, old: nn.Module, leaves: tuple[str, str, str]) -> "W4Experts":
        """A W4Experts of the same sizes, activation and dtype as transformers' fused experts module ``old``;
        refuses a layout this module does not reproduce (biases, transposed or interleaved gate/up, no gate)."""
        gu, dn = getattr(old, "gate_up_proj", None), getattr(old, "down_proj", None)
        if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3 or dn.dim() != 3:
            raise UnsupportedError(f"{type(old).__name__} is not a fused experts module (3-D gate_up_proj and "
                                   "down_proj)")
        for attr, want in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                           ("has_gate", True), ("has_post_expert_norm", False)):
            if getattr(old, attr, want) != want:
                raise UnsupportedError(f"{type(old).__name__} has {attr}={not want}; w4pack runs gated, "
                                       "concatenated, bias-free experts only")
        e, two_i, h = (int(v) for v in gu.shape)
        if tuple(dn.shape) != (e, h, two_i // 2) or two_i % 2:
            raise UnsupportedError(f"{type(old).__name__}: gate_up_proj {list(gu.shape)} and down_proj "
                                   f"{list(dn.shape)} are not [E, 2I, H] and [E, H, I]")
        act = getattr(old, "act_fn", None)
        if act is None:
            raise UnsupportedError(f"{type(old).__name__} has no act_fn")
        return cls(e, leaves, act, h, two_i // 2, gu.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for idx in hit.flatten().tolist():
            if idx == self.num_experts:  # transformers' marker for an expert of another rank
                continue
            top_k_pos, token_idx = torch.where(mask[idx])
            out = self._modules[str(idx)](hidden_states[token_idx])
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, " \
               f"intermediate_dim={self.intermediate_dim}"


# -- token embeddings ------------------------------------------------------------------------------
def _row_index(meta: dict[str, Any], perm: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each weight of a row sits in layout v1 (docs/LAYOUT.md §2), for the 16 rows of a tile stripe.

    Returns (word [16, K] int64: the int32 word of the stripe holding row r's column c, shift [16, K] int32: the
    bit offset of its code in that word, group [K] int64: its column's group), columns in the original order. Row
    r of the matrix is word ``(r // 16) * words_per_stripe + word[r % 16]`` of the flattened ``qweight``."""
    from ..core.layout import NIBBLE_POS, TILE_K, WARP, words_per_tile_lane

    k = int(meta["shape"][1])
    sbits = int(meta["storage_bits"])
    kp = int(meta["padded_shape"][1])
    col = np.arange(kp, dtype=np.int64)  # packed column k' = kb*64 + j*16 + kh*8 + tid*2 + e
    kb, j, kh, tid, e = col // TILE_K, col % TILE_K // 16, col % 16 // 8, col % 8 // 2, col % 2
    r16 = np.arange(16, dtype=np.int64)[:, None]  # row in the stripe = rh*8 + gid
    rh, gid = r16 // 8, r16 % 8
    lane = gid * 4 + tid
    elem = 4 * kh + 2 * rh + e  # the lane's fragment element (0..7) of the k16 slice j
    if sbits == 4:  # word (kb, lane, j), nibble NIBBLE_POS[elem]
        word = (kb * WARP + lane) * 4 + j
        shift = 4 * NIBBLE_POS[elem]
    else:  # 8 bytes per (kb, lane, j) in fragment order, two little-endian words
        byte = ((kb * WARP + lane) * 4 + j) * 8 + elem
        word, shift = byte // 4, 8 * (byte % 4)
    assert int(word.max()) < kp // TILE_K * WARP * words_per_tile_lane(sbits)
    gs = int(meta["group_size"])
    group = np.zeros(kp, dtype=np.int64) if gs == -1 else col // gs  # packed columns are grouped contiguously
    pos = np.arange(k, dtype=np.int64) if perm is None else np.argsort(perm).astype(np.int64)  # original c -> k'
    return np.ascontiguousarray(word[:, pos]), np.ascontiguousarray(shift[:, pos].astype(np.int32)), group[pos]


class W4Embedding(W4Linear):
    """A token embedding kept packed: ``forward(ids)`` gathers rows and dequantizes only those.

    Why: a GGUF stores its embedding quantized (often the model's largest tensor); widening it to float32 would
    double the folder and the memory. The rows come straight out of the layout v1 ``qweight`` (no second copy of
    the codes: a [16, K] table says where each code of a stripe's rows sits), with the canonical dequantization
    in float32 (``s·(q − z)`` or ``s·q + m``, rounded exactly as ``canonical.dequantize`` rounds them),
    then cast to the model's dtype, as a float embedding loaded from the same weights would be. Pure torch ops,
    so CPU, CUDA and ``torch.compile`` share it.

    A head tied to it (``tie_word_embeddings``) is a ``W4TiedHead`` running this module's GEMM over the same
    buffers; its native kernel is prepared only then.
    """

    def __init__(self, meta: dict[str, Any], *, dtype: torch.dtype = torch.float32, padding_idx: int | None = None,
                 **kwargs: Any):
        kwargs["has_bias"] = False
        super().__init__(meta, **kwargs)
        self.num_embeddings, self.embedding_dim = self.out_features, self.in_features
        self.padding_idx = padding_idx
        # the output dtype, held as an empty float buffer so that model.half() / .to(dtype) change it too
        self.register_buffer("out_dtype", torch.empty(0, dtype=dtype, device=kwargs.get("device")),
                             persistent=False)
        self.serves_head = False
        self._rows: dict[str, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def replacing(cls, old: nn.Embedding, packed: PackedLayer, *, device: Any = None, precision: str = "exact",
                  threads: int | None = None, name: str | None = None) -> "W4Embedding":
        """The packed ``packed`` in place of ``old`` (its dtype and padding index; shapes must match)."""
        n, k = packed.meta["shape"]
        if (old.num_embeddings, old.embedding_dim) != (n, k):
            raise UnsupportedError(f"packed shape [{n}, {k}] does not match the model's embedding "
                                   f"[{old.num_embeddings}, {old.embedding_dim}]", tensor=name)
        mod = cls(packed.meta, dtype=old.weight.dtype, padding_idx=old.padding_idx, device="meta",
                  precision=precision, threads=threads, name=name)
        mod.load_packed(packed, device=device)
        return mod

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows ``forward`` returns (the model's)."""
        return self._buffers["out_dtype"].dtype

    @dtype.setter
    def dtype(self, value: torch.dtype) -> None:
        self._buffers["out_dtype"] = torch.empty(0, dtype=value, device=self._buffers["out_dtype"].device)

    def load_packed(self, packed: PackedLayer, device: Any = None) -> None:
        super().load_packed(packed, device)
        where = self.qweight.device
        self._buffers["out_dtype"] = torch.empty(0, dtype=self.dtype, device=where)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        key = str(device)
        t = self._rows.get(key)
        if t is None:
            perm = self._buffers["perm"].cpu().numpy() if "perm" in self._buffers else None
            word, shift, group = _row_index(self.meta, perm)
            t = tuple(torch.from_numpy(a).to(device) for a in (word, shift, group))
            self._rows = {key: t}
        return t

    def prepare(self, device: Any = None, dtype: torch.dtype | None = None) -> "W4Embedding":
        """Builds the lookup tables; the GEMM kernel only when a tied head runs on these weights."""
        if dtype is not None:
            self.dtype = dtype
        dev = _normalize_device(device) if device is not None else self.qweight.device
        self._tables(dev)
        if self.serves_head:
            super().prepare(dev, dtype)
        return self

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized rows ``ids`` ([..., K], float32 values of ``canonical.dequantize`` cast to ``dtype``)."""
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"{self._where()}embedding indices must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).to(device=self.qweight.device, dtype=torch.int64)
        if flat.device.type == "cpu" and flat.numel() and not torch.compiler.is_compiling():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise IndexError(f"{self._where()}token id {lo if lo < 0 else hi} is out of range for an "
                                 f"embedding of {self.num_embeddings} rows")
        word, shift, group = self._tables(flat.device)
        m = self.meta
        stripe_words = self.qweight.shape[1]
        sub = flat % 16
        words = self.qweight.reshape(-1)[(flat // 16 * stripe_words)[:, None] + word[sub]]
        mask = 0xF if m["storage_bits"] == 4 else 0xFF
        q = ((words >> shift[sub]) & mask).to(torch.float32)
        fdt = TORCH_FLOAT[m["scale_dtype"]]
        s = self.scales.view(fdt)[:, flat].t().to(torch.float32)[:, group]
        if m["zero_mode"] == "float":
            mins = self._buffers["mins"].view(fdt)[:, flat].t()[:, group]
            if m["scale_dtype"] == "float32":  # s·q may round in float32: the sum rounds once, as canonical's
                w = (s.double() * q.double() + mins.double()).to(torch.float32)
            else:
                w = s * q + mins.to(torch.float32)
        else:
            if m["zero_mode"] == "int":  # 8-bit storage keeps zeros as int16 bits of uint16 values
                z = (self._buffers["zeros"][:, flat].t().to(torch.int32) & 0xFFFF).to(torch.float32)[:, group]
            else:
                z = float(1 << (int(m["bits"]) - 1))
            w = s * (q - z)
        return w.to(dtype).reshape(*ids.shape, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids, self.dtype)

    def dequantized_embedding(self) -> nn.Embedding:
        """An ``nn.Embedding`` holding every row dequantized (the float reference, ``w4pack run --compare``)."""
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx,
                           device=self.qweight.device, dtype=self.dtype)
        with torch.no_grad():
            emb.weight.copy_(self.rows(torch.arange(self.num_embeddings, device=self.qweight.device), self.dtype))
        return emb

    def _apply(self, fn: Any, recurse: bool = True) -> "W4Embedding":  # noqa: D401 - torch hook
        out = super()._apply(fn, recurse)
        self._rows = {}
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, " + \
            ", ".join(p for p in super().extra_repr().split(", ")[2:] if not p.startswith(("bias=", "precision=")))


class W4TiedHead(nn.Module):
    """The output head tied to a packed ``W4Embedding``: y = x @ Eᵀ with the native GEMM over the embedding's own
    buffers (no second copy of the weights)."""

    def __init__(self, embedding: W4Embedding):
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # not a child: the model owns the embedding
        embedding.serves_head = True
        self.in_features, self.out_features = embedding.in_features, embedding.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding.linear(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tied to the packed embedding"
