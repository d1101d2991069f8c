"""A strict safetensors reader and a small writer.

Own code rather than the safetensors package because (1) numpy has no bfloat16 and we carry bf16 as
uint16 bits, (2) hostile headers must become one-line errors naming the file and tensor, and (3) the
writer must write one shard at a time to a file we fsync ourselves.

Tensor data is read with pread into arrays we own, never through a memory map: a mapped page whose file
was truncated (a source being downloaded or rewritten while we read it) kills the process with SIGBUS,
with no message and no clean-up, wherever a view of it is touched later. A short read, or a file whose
size or modification time differs from what the header was checked against, is ``SourceChanged``
("FILE changed while being read", exit 4) instead.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import stat
import struct
import sys
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import numpy as np

from ..errors import BadInputError, IOFailure, UnsupportedError
from .folder import MAX_JSON_DEPTH, DuplicateKeyError, unique_keys, brief, is_json_int, nesting
from .names import tensor_name_problem

__all__ = ["SafetensorsFile", "SourceChanged", "write_safetensors", "DTYPES", "dtype_to_st", "MAX_HEADER"]

#: safetensors dtype code -> (numpy storage dtype, w4pack dtype name)
DTYPES: dict[str, tuple[np.dtype, str]] = {
    "F64": (np.dtype("<f8"), "float64"),
    "F32": (np.dtype("<f4"), "float32"),
    "F16": (np.dtype("<f2"), "float16"),
    "BF16": (np.dtype("<u2"), "bfloat16"),
    "I64": (np.dtype("<i8"), "int64"),
    "I32": (np.dtype("<i4"), "int32"),
    "I16": (np.dtype("<i2"), "int16"),
    "I8": (np.dtype("i1"), "int8"),
    "U64": (np.dtype("<u8"), "uint64"),
    "U32": (np.dtype("<u4"), "uint32"),
    "U16": (np.dtype("<u2"), "uint16"),
    "U8": (np.dtype("u1"), "uint8"),
    "BOOL": (np.dtype("?"), "bool"),
}
_NAME_TO_ST = {v[1]: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


def dtype_to_st(arr: np.ndarray, dtype_name: str | None = None) -> str:
    """safetensors dtype code for an array; uint16 arrays are U16 unless dtype_name says bfloat16."""
    if dtype_name == "bfloat16":
        if arr.dtype != np.uint16:
            raise ValueError("bfloat16 data must be held as uint16 bits")
        return "BF16"
    name = np.dtype(arr.dtype).name
    if name not in _NAME_TO_ST:
        raise UnsupportedError(f"cannot store dtype {arr.dtype} in safetensors")
    return _NAME_TO_ST[name]


_MAX_ARRAY_BYTES = 2**63 - 1  # numpy's limit on the product of an array's non-zero dimensions times its item size


def _is_count(v: Any) -> bool:
    """A JSON non-negative integer: not a bool, float (4.7, Infinity) or string, which int() would accept."""
    return is_json_int(v) and v >= 0


def _entry_problem(info: dict[str, Any]) -> str | None:
    """What is wrong with one tensor's header entry (types only), or None; int() would coerce too much."""
    dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dt, str):
        return f"dtype must be a string, got {brief(dt)}"
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"shape must be a list of non-negative integers, got {brief(shape)}"
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_count(x) for x in offs):
        return f"data_offsets must be two non-negative integers, got {brief(offs)}"
    return None


class SourceChanged(IOFailure):
    """A file was truncated or rewritten while we read it (a download or another writer): not the input's
    fault, and nothing read from it can be trusted (exit 4)."""

    def __init__(self, file: str, detail: str = "", tensor: str | None = None):
        super().__init__("changed while being read" + (f" ({detail})" if detail else "")
                         + "; read it again once whatever is writing it has finished", file=file, tensor=tensor)


def check_identity(fd: int, identity: tuple[int, int], label: str, tensor: str | None = None) -> None:
    """SourceChanged when the open file's (size, mtime in ns) is no longer ``identity``, what its header was
    checked against (truncated, grown or rewritten in place)."""
    st = os.fstat(fd)
    if (st.st_size, st.st_mtime_ns) != identity:
        detail = (f"{identity[0]} bytes when opened, {st.st_size} now" if st.st_size != identity[0]
                  else "modified since it was opened")
        raise SourceChanged(label, detail, tensor=tensor)


def release_mapped(mm: Any) -> None:
    """Drop every page of a read-only file map from our address space (MADV_DONTNEED; the page cache keeps
    them, and views stay valid: a later access faults the page back in). Readers call this once per layer:
    every page read through a map stays resident until the map closes, so without it resident memory grows
    with the model even though the heap does not."""
    if mm is None or not hasattr(mm, "madvise") or sys.platform != "linux":
        return
    try:
        mm.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):
        pass


class SafetensorsFile:
    """A validated safetensors file. ``get(name)`` and ``read(name)`` return the tensor read into an array of
    our own (pread), after checking that the file is still the one whose header was validated."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        label = str(self.path)
        self._fh: BinaryIO | None = None
        try:
            # O_NONBLOCK: a FIFO (or device) in place of the file must not block the open until a writer comes
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise BadInputError("file does not exist", file=label) from None
        except OSError as exc:
            raise BadInputError(f"cannot open: {exc.strerror}", file=label) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise BadInputError("not a regular file (a FIFO, device or socket cannot be read as safetensors)",
                                file=label)
        os.set_blocking(fd, True)
        self._fh = os.fdopen(fd, "rb")
        size = st.st_size
        #: what the header was checked against: (size, mtime in ns); reads check that it still holds
        self._identity = (st.st_size, st.st_mtime_ns)
        if size < 8:
            self.close()
            raise BadInputError(f"truncated: {size} bytes, not even a header length", file=label)
        (hlen,) = struct.unpack("<Q", self._fh.read(8))
        if hlen > MAX_HEADER or 8 + hlen > size:
            self.close()
            raise BadInputError(f"header length {hlen} exceeds the file ({size} bytes): truncated or not safetensors",
                                file=label)
        raw = self._fh.read(hlen)
        if len(raw) != hlen:
            self.close()
            raise SourceChanged(label, f"header of {hlen} bytes ended after {len(raw)}")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
        except DuplicateKeyError as exc:
            self.close()
            raise BadInputError("header names this tensor twice", file=label, tensor=brief(exc.key)) from None
        except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, or an integer too long to convert
            self.close()
            raise BadInputError(f"header is not valid JSON ({exc})", file=label) from None
        except RecursionError:
            self.close()
            raise BadInputError("header is not valid JSON (nested too deeply)", file=label) from None
        if not isinstance(header, dict):
            self.close()
            raise BadInputError("header is not a JSON object", file=label)
        if nesting(header) > MAX_JSON_DEPTH:  # (the parser's own limit depends on the caller's stack depth)
            self.close()
            raise BadInputError(f"header is not valid JSON for safetensors (nested more than {MAX_JSON_DEPTH} "
                                "levels deep)", file=label)
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            self.close()
            raise BadInputError("__metadata__ must map strings to strings", file=label)
        self.metadata: dict[str, str] = meta
        self.data_start = 8 + hlen
        data_len = size - self.data_start
        spans = []
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            bad_name = tensor_name_problem(name)
            if bad_name:
                self.close()
                raise BadInputError(bad_name, file=label)
            if not isinstance(info, dict) or not all(k in info for k in ("dtype", "shape", "data_offsets")):
                self.close()
                raise BadInputError("header entry lacks dtype/shape/data_offsets", file=label, tensor=name)
            problem = _entry_problem(info)
            if problem:
                self.close()
                raise BadInputError(f"header entry: {problem}", file=label, tensor=name)
            dt = info["dtype"]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            if dt not in DTYPES:
                self.close()
                raise UnsupportedError(f"dtype {brief(dt)} is not supported", file=label, tensor=name)
            # Python ints: numpy's int64 product wraps for a hostile shape ([2**32, 2**32] -> 0 bytes)
            itemsize = DTYPES[dt][0].itemsize
            nbytes = math.prod(shape) * itemsize
            if math.prod(d for d in shape if d) * itemsize > _MAX_ARRAY_BYTES:  # numpy refuses even an empty one
                self.close()
                raise BadInputError(f"shape {brief(shape)} is too large for any array", file=label, tensor=name)
            if end < begin or end - begin != nbytes:
                self.close()
                raise BadInputError(f"data_offsets [{begin}, {end}] do not hold {nbytes} bytes for shape "
                                    f"{brief(shape)} {dt}", file=label, tensor=name)
            if end > data_len:
                self.close()
                raise BadInputError(f"data runs past the end of the file ({end} > {data_len} bytes of data): "
                                    "truncated", file=label, tensor=name)
            spans.append((begin, end, name))
            self.entries[name] = (dt, shape, begin, end)
        spans.sort()
        covered, prev = 0, ""  # the data section is the tensors back to back, as the reference library requires
        for b, e, n in spans:
            if b < covered:
                self.close()
                raise BadInputError(f"data overlaps tensor {prev}", file=label, tensor=n)
            if b > covered:
                self.close()
                raise BadInputError(f"{b - covered} bytes of data before it belong to no tensor (data_offsets "
                                    "leave a hole)", file=label, tensor=n)
            covered, prev = e, n
        if covered != data_len:
            self.close()
            raise BadInputError(f"{data_len - covered} bytes after the last tensor (the data section must end "
                                "where the file ends)", file=label)
        self._mm: mmap.mmap | None = None  # no map: see the module docstring (kept for callers that probe it)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        dt, shape, _b, _e = self.entries[name]
        return DTYPES[dt][1], shape

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only array of its own (read with pread, see ``read``)."""
        arr = self.read(name)
        arr.flags.writeable = False
        return arr

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor read with pread into ``out`` (C-contiguous, of the tensor's size and storage dtype) or a
        new array. A short read or a file changed since its header was checked raises SourceChanged."""
        if name not in self.entries:
            raise BadInputError("tensor is missing", file=str(self.path), tensor=name)
        dt, shape, begin, end = self.entries[name]
        npdt = DTYPES[dt][0]
        if out is None:
            out = np.empty(shape, dtype=npdt)
        elif out.nbytes != end - begin or not out.flags.c_contiguous:
            raise ValueError(f"out holds {out.nbytes} bytes, tensor {name} {end - begin}")
        if end == begin:
            return out
        if self._fh is None:
            raise ValueError(f"{self.path} is closed")
        fd = self._fh.fileno()
        self.check_unchanged(name)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        done, want = 0, end - begin
        while done < want:
            try:
                got = os.preadv(fd, [buf[done:]], self.data_start + begin + done)
            except OSError as exc:
                raise IOFailure(f"cannot read: {exc.strerror}", file=str(self.path), tensor=name) from None
            if got <= 0:
                raise SourceChanged(str(self.path), f"it ended {want - done} bytes into the data it was checked to "
                                    "hold", tensor=name)
            done += got
        self.check_unchanged(name)  # written to while we read: the bytes may be a mix of old and new
        return out

    def check_unchanged(self, name: str | None = None) -> None:
        """Raise SourceChanged when the file's size or modification time is no longer what the header was
        checked against (truncated, grown or rewritten in place)."""
        if self._fh is not None:
            check_identity(self._fh.fileno(), self._identity, str(self.path), name)

    @property
    def identity(self) -> tuple[int, int]:
        """(size, mtime in ns) of the file when its header was checked."""
        return self._identity

    def dtype_name(self, name: str) -> str:
        return DTYPES[self.entries[name][0]][1]

    def release(self) -> None:
        """Nothing to drop: no file is mapped (kept so that callers written for a mapped reader still work)."""

    def close(self) -> None:
        mm = getattr(self, "_mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still alive; the map is released when they go
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_safetensors(path: str | os.PathLike[str], tensors: Iterable[tuple[str, np.ndarray, str | None]],
                      metadata: dict[str, str] | None = None, fsync: bool = True) -> tuple[int, str]:
    """Write (name, array, dtype_name) triples; returns (file size, sha256 hex). Header padded to 8 bytes."""
    items = list(tensors)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, arr, dname in items:
        nbytes = arr.nbytes
        header[name] = {"dtype": dtype_to_st(arr, dname), "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            fh.write(chunk)
            digest.update(chunk)
        for _name, arr, _d in items:
            a = np.ascontiguousarray(arr)
            if a.dtype.byteorder == ">":
                a = a.astype(a.dtype.newbyteorder("<"))
            if a.size:
                buf = memoryview(a).cast("B")
                fh.write(buf)
                digest.update(buf)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
        return fh.tell(), digest.hexdigest()
