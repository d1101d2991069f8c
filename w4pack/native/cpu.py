"""cffi binding of the native CPU W4A16 GEMM (``w4pack._w4p_cpu``) and ``CpuPackedLinear``.

A ``CpuPackedLinear`` repacks one layer once into the CPU tile layout (2 MiB pages) and then runs
``y = x · Wᵀ (+ bias)`` for numpy arrays and torch CPU tensors without copying contiguous inputs.
The kernel releases the GIL while it runs.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import BadInputError, UnsupportedError, W4PackError
from ..core.layout import PackedLayer, padded_shape, storage_bits_for, words_per_tile_lane

try:
    from .._w4p_cpu import ffi, lib
except ImportError as _exc:  # pragma: no cover - only without a build
    ffi = lib = None
    _IMPORT_ERROR: Exception | None = _exc
else:
    _IMPORT_ERROR = None

__all__ = ["CpuPackedLinear", "isa_info", "available", "ISA_CODES", "PRECISIONS", "default_threads",
           "check_environment", "check_rc"]

#: instruction-set path name -> W4P_ISA_* code ("avx512" means "with VNNI where present")
ISA_CODES = {"scalar": 1, "avx2": 2, "avx512novnni": 4, "avx512vnni": 8, "neon": 16, "amx": 32}
PRECISIONS = {"exact": 0, "fast": 1}
_DT = {"float16": 1, "bfloat16": 2, "float32": 3}
_ZERO = {"none": 0, "int": 1, "float": 2}


def _lib() -> Any:
    if lib is None:
        raise UnsupportedError(f"the native CPU module is not built ({_IMPORT_ERROR}); run `make native`")
    return lib


def available() -> bool:
    """True when the CPU extension is importable."""
    return lib is not None


def check_rc(rc: int, what: str) -> None:
    """Raise the extension's last error for a non-zero return code (-2 memory, -3 unsupported, else input)."""
    if rc == 0:
        return
    msg = ffi.string(lib.w4p_last_error()).decode("utf-8", "replace")
    if rc == -2:
        raise MemoryError(f"{what}: {msg}")
    if rc == -3:
        raise UnsupportedError(f"{what}: {msg}")
    raise BadInputError(f"{what}: {msg}")


def _available_names() -> list[str]:
    bits = _lib().w4p_cpu_isa_available()
    return [name for name, code in ISA_CODES.items() if bits & code]


def resolve_isa(isa: str | None = None) -> int:
    """W4P_ISA_* code for a path name, refusing unavailable paths. None or "auto" gives 0: the C
    dispatcher then reads $W4PACK_ISA on every call (and refuses a forced path it cannot run)."""
    name = isa
    if name is None or name == "auto":
        return 0
    bits = _lib().w4p_cpu_isa_available()
    if name == "avx512":
        name = "avx512vnni" if bits & ISA_CODES["avx512vnni"] else "avx512novnni"
    code = ISA_CODES.get(name)
    if code is None:
        raise BadInputError(f"unknown instruction-set path {name!r} (known: avx512, {', '.join(ISA_CODES)})")
    if not bits & code:
        raise UnsupportedError(f"instruction-set path {name!r} is not available on this CPU "
                               f"(available: {', '.join(_available_names())})")
    return code


def isa_info() -> dict[str, Any]:
    """Which CPU paths exist here, which one runs by default, and whether $W4PACK_ISA forces one."""
    L = _lib()
    sel = L.w4p_cpu_isa_selected()
    return {
        "available": _available_names(),
        "selected": ffi.string(L.w4p_cpu_isa_name(sel)).decode(),
        "forced": os.environ.get("W4PACK_ISA") or None,
        "abi_version": L.w4p_abi_version(),
    }


_DEFAULT_THREADS: list[int] = []


def default_threads() -> int:
    """$W4PACK_THREADS, else every core this process may run on (users); tests pass threads=1.
    Read once per process (it is on the per-call path)."""
    if _DEFAULT_THREADS:
        return _DEFAULT_THREADS[0]
    _DEFAULT_THREADS.append(_default_threads())
    return _DEFAULT_THREADS[0]


def check_threads(threads: Any) -> None:
    """A threads argument of the Python API: None or a whole number >= 1, refused at the call (as the CLI refuses
    it) rather than at the first GEMM, where a verify would report it as every layer failing."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or int(threads) < 1:
        raise BadInputError(f"threads must be a whole number >= 1 (or None: every core), got {threads!r}")


def threads_from_env() -> int | None:
    """$W4PACK_THREADS as a thread count (None when unset or empty); anything but a whole number >= 1 is refused
    (0 or a negative count used to mean one thread silently)."""
    env = os.environ.get("W4PACK_THREADS")
    if not env:
        return None
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value < 1:
        raise BadInputError(f"W4PACK_THREADS={env!r} is not a thread count: set a whole number >= 1, or unset it "
                            "to use every core")
    return value


def _allowed_isa_names() -> list[str]:
    """The $W4PACK_ISA values the C dispatcher accepts on this CPU (cpu_dispatch.c, w4p_cpu_isa_selected)."""
    names = ["auto", *_available_names()]
    if "avx512novnni" in names:
        names.insert(names.index("avx512novnni"), "avx512")
    return names


def check_environment(*, threads_from_env: bool = True) -> None:
    """Refuse a $W4PACK_ISA or $W4PACK_THREADS the kernels cannot use, once and up front (a usage error, exit 2):
    read on every GEMM call, a bad value otherwise fails each layer with the same message. $W4PACK_THREADS is
    checked only when it is used (``threads_from_env``: no explicit thread count)."""
    force = os.environ.get("W4PACK_ISA")
    if force:
        allowed = _allowed_isa_names()
        if force not in allowed:
            raise BadInputError(f"W4PACK_ISA={force!r} is not an instruction-set path this CPU can run: set one of "
                                f"{', '.join(allowed)}, or unset it")
    if threads_from_env:
        _env_threads()


_env_threads = threads_from_env  # check_environment's keyword hides the name there


def _default_threads() -> int:
    env = threads_from_env()
    if env is not None:
        return env
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------
# array plumbing: numpy arrays and torch CPU tensors, bf16 as uint16 bits / torch.bfloat16
# ---------------------------------------------------------------------------------------------
def _is_torch(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "data_ptr")


_TORCH: dict[str, Any] = {}


def _torch_tables() -> dict[str, Any]:
    """torch dtype <-> name tables, built once (this is on the per-call path)."""
    if not _TORCH:
        import torch

        _TORCH["torch"] = torch
        _TORCH["names"] = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
        _TORCH["dtypes"] = {v: k for k, v in _TORCH["names"].items()}
    return _TORCH


def _torch_dtype_name(t: Any) -> str:
    name = _torch_tables()["names"].get(t.dtype)
    if name is None:
        raise BadInputError(f"activations must be float16, bfloat16 or float32, got {t.dtype}")
    return name


_NP_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.uint16): "bfloat16"}
_NP_OUT = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16), "float32": np.dtype(np.float32)}


def _np_ptr(a: np.ndarray) -> Any:
    """Address of a numpy array's first element (ffi.from_buffer is ~10x cheaper than .ctypes)."""
    if a.flags.c_contiguous:
        return ffi.from_buffer(a)
    return ffi.cast("void *", a.ctypes.data)


def _np_dtype_name(a: np.ndarray, what: str) -> str:
    name = _NP_NAMES.get(a.dtype)
    if name is not None:
        return name
    raise BadInputError(f"{what} must be float16, float32 or bfloat16 (as uint16 bits), got {a.dtype}")


def _dtype_name(spec: Any) -> str:
    """Normalise an output dtype given as a name, a numpy dtype or a torch dtype."""
    if isinstance(spec, str):
        name = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32",
                "float": "float32"}.get(spec, spec)
        if name in _DT:
            return name
    else:
        if type(spec).__module__.startswith("torch"):
            name = _torch_tables()["names"].get(spec)
            if name is not None:
                return name
        try:
            d = np.dtype(spec)
            return {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
                    np.dtype(np.uint16): "bfloat16"}[d]
        except (TypeError, KeyError):
            pass
    raise BadInputError(f"output dtype must be float16, bfloat16 or float32, got {spec!r}")


class _Operand:
    """A [M, K] view of an activation array: pointer, row stride, dtype, and how to shape the output."""

    def __init__(self, x: Any, k: int):
        self.torch = _is_torch(x)
        if self.torch:
            if x.device.type != "cpu":
                raise BadInputError(f"CpuPackedLinear takes CPU tensors, got one on {x.device}")
            self.dtype = _torch_dtype_name(x)
            if x.dim() == 0 or x.shape[-1] != k:
                raise BadInputError(f"activations have shape {list(x.shape)}; the last dimension must be K={k}")
            self.lead = tuple(x.shape[:-1])
            x2 = x.reshape(-1, k) if x.dim() != 2 else x
            if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
                x2 = x2.contiguous()
            self.m = int(x2.shape[0])
            self.ld = int(x2.stride(0)) if self.m > 1 else k
            self.keep = x2
            self.ptr = ffi.cast("void *", x2.data_ptr())
        else:
            a = x if isinstance(x, np.ndarray) else np.asarray(x)
            self.dtype = _np_dtype_name(a, "activations")
            if a.ndim == 0 or a.shape[-1] != k:
                raise BadInputError(f"activations have shape {list(a.shape)}; the last dimension must be K={k}")
            self.lead = tuple(a.shape[:-1])
            a2 = a.reshape(-1, k) if a.ndim != 2 else a
            item = a2.itemsize
            if a2.strides[1] != item or (a2.shape[0] > 1 and (a2.strides[0] % item or a2.strides[0] < k * item)):
                a2 = np.ascontiguousarray(a2)
            self.m = int(a2.shape[0])
            self.ld = int(a2.strides[0] // item) if self.m > 1 else k
            self.keep = a2
            self.ptr = _np_ptr(a2)
        if self.m < 1:
            raise BadInputError("activations hold no rows (M = 0)")

    def new_output(self, n: int, dtype: str) -> tuple[Any, Any]:
        if self.torch:
            tables = _torch_tables()
            y = tables["torch"].empty((self.m, n), dtype=tables["dtypes"][dtype])
            return y, ffi.cast("void *", y.data_ptr())
        y = np.empty((self.m, n), dtype=_NP_OUT[dtype])
        return y, ffi.from_buffer(y)

    def shape_output(self, y: Any, n: int) -> Any:
        return y if self.lead == (self.m,) else y.reshape(self.lead + (n,))


def _bias_operand(bias: Any, n: int) -> tuple[Any, Any, int]:
    """(keep-alive, pointer, dtype code) for a bias vector of N values."""
    if _is_torch(bias):
        name = _torch_dtype_name(bias)
        b = bias.detach().to("cpu").contiguous().reshape(-1)
        if b.numel() != n:
            raise BadInputError(f"bias has {b.numel()} values, expected N={n}")
        return b, ffi.cast("void *", b.data_ptr()), _DT[name]
    b = np.ascontiguousarray(np.asarray(bias)).reshape(-1)
    name = _np_dtype_name(b, "bias")
    if b.size != n:
        raise BadInputError(f"bias has {b.size} values, expected N={n}")
    return b, ffi.from_buffer(b), _DT[name]


def _expect(t: dict[str, np.ndarray], key: str, shape: tuple[int, ...], dtype: np.dtype, name: str) -> np.ndarray:
    label = f"{name}.{key}" if name else key
    if key not in t:
        raise BadInputError("tensor is missing", tensor=label)
    arr = np.asarray(t[key])
    if tuple(arr.shape) != tuple(shape) or arr.dtype != dtype:
        raise BadInputError(f"shape {list(arr.shape)} / dtype {arr.dtype} != expected {list(shape)} / {dtype}",
                            tensor=label)
    return np.ascontiguousarray(arr)


class CpuPackedLinear:
    """One packed layer repacked for the CPU kernels; ``forward`` runs the GEMM as often as needed.

    Example::

        lin = CpuPackedLinear(ckpt.packed("model.layers.0.mlp.down_proj"))
        y = lin.forward(x_fp16, precision="fast")      # numpy or torch CPU, [..., K] -> [..., N]
    """

    def __init__(self, packed: PackedLayer, threads: int | None = None, name: str = ""):
        L = _lib()
        m = packed.meta
        self.name = name
        try:
            n, k = (int(v) for v in m["shape"])
            np_, kp = (int(v) for v in m["padded_shape"])
            bits, sbits, gs = int(m["bits"]), int(m["storage_bits"]), int(m["group_size"])
            gp, zero_mode, scale_dtype = int(m["padded_groups"]), str(m["zero_mode"]), str(m["scale_dtype"])
            act_order = bool(m.get("act_order", False))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInputError(f"packed layer metadata is incomplete: {exc}", tensor=name or None) from None
        if (np_, kp) != padded_shape(n, k):
            raise BadInputError(f"padded shape {[np_, kp]} does not match shape {[n, k]}", tensor=name or None)
        if sbits != storage_bits_for(bits):
            raise BadInputError(f"storage_bits {sbits} is wrong for {bits}-bit codes", tensor=name or None)
        if zero_mode not in _ZERO or scale_dtype not in _DT:
            raise BadInputError(f"zero mode {zero_mode!r} / scale dtype {scale_dtype!r} unknown", tensor=name or None)
        t = packed.tensors
        sdt = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16), "float32": np.dtype(np.float32)}
        qweight = _expect(t, "qweight", (np_ // 16, kp // 64 * 32 * words_per_tile_lane(sbits)),
                          np.dtype(np.int32), name)
        scales = _expect(t, "scales", (gp, np_), sdt[scale_dtype], name)
        keep = [qweight, scales]
        desc = ffi.new("w4p_packed_desc *")
        desc.n, desc.k, desc.np, desc.kp = n, k, np_, kp
        desc.bits, desc.storage_bits, desc.group_size, desc.padded_groups = bits, sbits, gs, gp
        desc.zero_mode, desc.scale_dtype = _ZERO[zero_mode], _DT[scale_dtype]
        desc.qweight = ffi.cast("const int32_t *", qweight.ctypes.data)
        desc.scales = ffi.cast("const void *", scales.ctypes.data)
        if zero_mode == "int":
            zeros = _expect(t, "zeros", (gp, np_), np.dtype(np.uint8 if sbits == 4 else np.uint16), name)
            keep.append(zeros)
            desc.zeros = ffi.cast("const void *", zeros.ctypes.data)
        elif zero_mode == "float":
            mins = _expect(t, "mins", (gp, np_), sdt[scale_dtype], name)
            keep.append(mins)
            desc.mins = ffi.cast("const void *", mins.ctypes.data)
        if act_order:
            perm = _expect(t, "perm", (k,), np.dtype(np.int32), name)
            keep.append(perm)
            desc.perm = ffi.cast("const int32_t *", perm.ctypes.data)
        out = ffi.new("w4p_cpu_layer **")
        try:
            check_rc(L.w4p_cpu_layer_create(desc, out), f"repacking layer {name or ''}".strip())
        except W4PackError as exc:
            exc.tensor = exc.tensor or name or None
            raise
        self._layer = ffi.gc(out[0], L.w4p_cpu_layer_free)
        del keep
        self.out_features, self.in_features = n, k
        self.meta = dict(m)
        self.threads = threads
        self.bias = t.get("bias")
        self._own_bias = None if self.bias is None else _bias_operand(self.bias, n)
        self.nbytes = int(L.w4p_cpu_layer_bytes(self._layer))

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def codes(self) -> np.ndarray:
        """The codes as the CPU layout holds them, [Np, Kp] in packed (act-order) K order (tests)."""
        np_, kp = (int(v) for v in self.meta["padded_shape"])
        out = np.empty((np_, kp), dtype=np.uint8)
        check_rc(lib.w4p_cpu_layer_codes(self._layer, ffi.cast("uint8_t *", out.ctypes.data)), "codes")
        return out

    def forward(self, x: Any, precision: str = "exact", bias: Any = None, out_dtype: Any = None,
                threads: int | None = None, isa: str | None = None) -> Any:
        """y = x · Wᵀ + bias for x [..., K] (numpy fp16/fp32/bf16-as-uint16, or torch CPU tensor).

        bias: None uses the layer's own bias (if it has one), False none, an array or tensor of N values
        that bias instead. out_dtype defaults to the activations' dtype. precision: "exact" or "fast".
        threads: defaults to the constructor's value, then $W4PACK_THREADS, then all cores.
        isa: force an instruction-set path ("scalar", "avx2", "avx512", ...); default $W4PACK_ISA or auto.
        """
        if precision not in PRECISIONS:
            raise BadInputError(f"precision must be 'exact' or 'fast', got {precision!r}")
        op = _Operand(x, self.in_features)
        odt = op.dtype if out_dtype is None else _dtype_name(out_dtype)
        n = self.out_features
        if bias is None and self._own_bias is not None:
            bkeep, bptr, bdt = self._own_bias
        elif bias is False or bias is None:
            bkeep, bptr, bdt = None, ffi.NULL, 0
        else:
            bkeep, bptr, bdt = _bias_operand(bias, n)
        nthreads = threads if threads is not None else (self.threads if self.threads is not None else default_threads())
        if int(nthreads) < 1:
            raise BadInputError(f"threads must be >= 1, got {nthreads}")
        isa_code = resolve_isa(isa)
        y, yptr = op.new_output(n, odt)
        rc = lib.w4p_cpu_gemm(self._layer, op.ptr, _DT[op.dtype], op.m, op.ld, yptr, _DT[odt], n,
                              bptr, bdt, PRECISIONS[precision], isa_code, int(nthreads))
        del bkeep
        check_rc(rc, f"gemm {self.name}".strip())
        return op.shape_output(y, n)

    __call__ = forward


def fast_block(packed: PackedLayer) -> int:
    """Activation block of the fast path: the largest of 128/64/32/16 dividing the group size and Kp."""
    kp = packed.meta["padded_shape"][1]
    gs = kp if packed.meta["group_size"] == -1 else packed.meta["group_size"]
    return next(b for b in (128, 64, 32, 16) if gs % b == 0 and kp % b == 0)


def fast_rounded_activations(x: np.ndarray, packed: PackedLayer) -> np.ndarray:
    """The activations as the fast path sees them, float64 [M, K] in the original column order.

    Per row and per block of ``fast_block`` packed columns: a = rint(x·(127/amax)) in fp32, clipped to
    ±127, and x ≈ a·(amax/127). ``fast`` GEMM results equal these values times the dequantized weights
    (up to float32 accumulation), which is what ``w4pack verify --precision fast`` checks.
    """
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    kp = packed.meta["padded_shape"][1]
    perm = packed.tensors.get("perm")
    order = np.arange(k) if perm is None else np.asarray(perm)
    xp = np.zeros((m, kp), dtype=np.float32)
    xp[:, :k] = x[:, order]
    ab = fast_block(packed)
    blocks = xp.reshape(m, kp // ab, ab)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    a = np.clip(np.rint((blocks * inv).astype(np.float32)), -127, 127)
    xq = (a * (amax / np.float32(127.0)).astype(np.float32).astype(np.float64)).reshape(m, kp)[:, :k]
    out = np.empty((m, k))
    out[:, order] = xq
    return out
