"""torch.save files (.pt / .bin): loaded only with ``torch.load(weights_only=True)``.

A pickle that would run code is refused by torch; anything but a mapping of names to tensors of a dtype
w4pack knows is refused here, with one line naming the file (and the tensor).

The file is memory-mapped by torch (bounded memory for multi-GB dumps), so a file truncated while we read it
would be SIGBUS wherever a mapped tensor is touched. ``read_tensor`` therefore checks, before and after copying
one tensor out of the map into memory of our own, that the file is still the one loaded (size, mtime, inode),
and raises ``SourceChanged`` (exit 4) otherwise; callers never hold views of the map. What remains is a
truncation during the copy of one tensor itself (milliseconds); safetensors sources have no such window.
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import BadInputError, UnsupportedError
from .folder import brief
from .names import tensor_name_problem
from .safetensors import SourceChanged

__all__ = ["TORCH_DTYPES", "StateDict", "load_state_dict", "dtype_name", "to_numpy", "read_tensor"]

#: torch dtype name -> w4pack dtype name
TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64",
                "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
                "bool": "bool"}


def dtype_name(t: Any) -> str:
    return TORCH_DTYPES[str(t.dtype).removeprefix("torch.")]


def to_numpy(t: Any) -> np.ndarray:
    """A CPU tensor as numpy; bfloat16 as uint16 bits (see w4pack.dtypes)."""
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class StateDict(dict):
    """Name -> tensor of one torch file, with the identity of the file when it was loaded (see read_tensor)."""

    path: str
    identity: tuple[int, int, int, int]


def _identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_unchanged(sd: StateDict, tensor: str | None = None) -> None:
    """SourceChanged when the file is no longer the one loaded (truncated, rewritten or replaced)."""
    try:
        now = _identity(sd.path)
    except OSError:
        raise SourceChanged(sd.path, "it is gone", tensor=tensor) from None
    if now != sd.identity:
        detail = (f"{sd.identity[2]} bytes when loaded, {now[2]} now" if now[2] != sd.identity[2]
                  else "modified or replaced since it was loaded")
        raise SourceChanged(sd.path, detail, tensor=tensor)


def read_tensor(sd: StateDict, name: str) -> np.ndarray:
    """One tensor as a numpy array of our own (bf16 as uint16 bits), copied out of torch's map of the file only
    while the file is unchanged (checked before and after the copy)."""
    import torch

    check_unchanged(sd, name)
    t = sd[name].detach()
    copy = torch.empty(t.shape, dtype=t.dtype)
    copy.copy_(t)
    check_unchanged(sd, name)
    return to_numpy(copy)


def _overlaps_itself(t: Any) -> bool:
    """Whether two elements of ``t`` are one element of its storage (a stride of 0 from ``expand``, or strides
    that interleave). A pickle holds storages, not tensors: such a view of a few stored bytes can claim a
    terabyte (``zeros(1).expand(2**20, 2**20)``), which a reader would allocate when it copies the tensor out. No
    checkpoint writer saves one; contiguous, transposed and sliced views pass (dimensions sorted by stride must
    each step past the extent of the smaller ones)."""
    extent = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride < extent:
            return True
        extent = stride * size
    return False


def _storage_elements(t: Any) -> int:
    """Elements of ``t``'s dtype its storage holds."""
    return t.untyped_storage().nbytes() // max(1, t.element_size())


def load_state_dict(path: Path) -> StateDict:
    """Name -> tensor from a torch.save file, memory-mapped when the file allows. A checkpoint that wraps
    its tensors one level down (``state_dict`` / ``model`` / ``module``) is unwrapped."""
    label = str(path)
    try:
        import torch
    except ImportError:
        raise UnsupportedError("reading .pt/.bin checkpoints needs torch (pip install 'w4pack[torch]')",
                               file=label) from None
    if not Path(path).is_file():
        raise BadInputError("file does not exist" if not os.path.lexists(path) else
                            "not a regular file (a FIFO, device, socket or broken link cannot be read as a torch file)",
                            file=label)
    before = _identity(label)
    try:
        # torch warns on stderr about a pickle protocol it did not write or a beta tensor layout before it refuses
        # or loads such a file; the one line below (or the layout check) already says what matters
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc) and "zip" not in str(exc):
                    raise
                obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every failure of a hostile/truncated pickle is bad input
        text = " ".join(str(exc).split())
        if "weights_only" in text or "Weights only load failed" in text or "Unsupported global" in text:
            hint = re.search(r"Unsupported global: ([^ ]+)", text)
            what = f" (it references {hint.group(1)})" if hint else ""
            raise BadInputError(f"not loadable with torch.load(weights_only=True){what}; refusing to unpickle "
                                "anything but tensors", file=label) from None
        raise BadInputError(f"cannot read as a torch.save file (truncated or corrupt): {text[:160]}",
                            file=label) from None
    sd = obj
    if isinstance(sd, Mapping) and not any(isinstance(v, torch.Tensor) for v in sd.values()):
        for key in ("state_dict", "model", "module"):
            if isinstance(sd.get(key), Mapping):
                sd = sd[key]
                break
    if not isinstance(sd, Mapping):
        raise BadInputError(f"holds a {type(sd).__name__}, not a state dict of tensors", file=label)
    out = StateDict()
    out.path, out.identity = label, before
    check_unchanged(out)  # changed while torch read its index: what was loaded may be a mix
    for key, val in sd.items():
        if not isinstance(key, str):
            raise BadInputError(f"state dict key {brief(key)} is not a string", file=label)
        bad_name = tensor_name_problem(key)
        if bad_name:
            raise BadInputError(bad_name, file=label)
        if not isinstance(val, torch.Tensor):
            raise BadInputError(f"entry is a {type(val).__name__}, not a tensor", file=label, tensor=key)
        if val.is_meta or val.device.type != "cpu":
            raise BadInputError(f"tensor on the {val.device.type} device holds no data; save the real weights "
                                "(not a meta / empty-weights model)", file=label, tensor=key)
        if val.layout != torch.strided or val.is_nested:
            raise BadInputError(f"tensor has layout {str(val.layout).removeprefix('torch.')}"
                                f"{' (nested)' if val.is_nested else ''}; only dense tensors are read "
                                "(save it with .to_dense())", file=label, tensor=key)
        if str(val.dtype).removeprefix("torch.") not in TORCH_DTYPES:
            raise UnsupportedError(f"dtype {val.dtype} is not supported", file=label, tensor=key)
        if val.numel() and _overlaps_itself(val):
            raise BadInputError(f"shape {list(val.shape)} with strides {list(val.stride())} reuses its "
                                f"storage's elements: its {val.numel()} elements lie in {_storage_elements(val)} "
                                "stored ones (an expanded or overlapping view); save it with .contiguous()",
                                file=label, tensor=key)
        out[key] = val
    return out
