"""GGUF files opened for reading by our own bounds-checked parser (header, metadata, tensor infos), memory-mapped.

Why not gguf.GGUFReader: it trusts every count, length and offset in the file. A value type flipped from string
to array makes it iterate a count of 10^18 items (minutes, gigabytes), and a tensor offset near 2^64 wraps
around and reads bytes before the data section, silently. Here every count, length and offset is checked
against the bytes left *before* anything is allocated or iterated, so a hostile file fails in milliseconds with
one line naming the file and the key or tensor. The gguf package is still used for its tables (tensor type
sizes) and by the format module for dequantizing K-quants and for writing, never to parse a file we are given.

Layout (GGUF v2/v3, little-endian; llama.cpp's ``gguf.cpp`` is the reference): magic ``GGUF``, u32 version,
u64 tensor count, u64 key-value count, the key-value pairs (string key, u32 value type, value), the tensor
infos (string name, u32 n_dims, u64 dims[n_dims], u32 type, u64 offset relative to the data section), padding
to ``general.alignment`` (default 32), then the data section. A string is a u64 length and that many UTF-8 bytes;
an array is a u32 item type, a u64 count and the items.
"""
from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadInputError, IOFailure, UnsupportedError
from .safetensors import SourceChanged, check_identity

__all__ = ["GGUFFile", "GGUFTensorInfo", "GGUFValue", "gguf_module", "is_gguf", "open_gguf", "VALUE_TYPES"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: llama.cpp's GGML_MAX_DIMS
MAX_DIMS = 4
#: arrays of arrays deeper than this are refused (llama.cpp reads none; Python recursion stays shallow)
MAX_NESTING = 4

#: GGUF value type id -> (name, struct format or None for string/array, encoded size: the minimum for those)
VALUE_TYPES: dict[int, tuple[str, str | None, int]] = {
    0: ("UINT8", "<B", 1), 1: ("INT8", "<b", 1), 2: ("UINT16", "<H", 2), 3: ("INT16", "<h", 2),
    4: ("UINT32", "<I", 4), 5: ("INT32", "<i", 4), 6: ("FLOAT32", "<f", 4), 7: ("BOOL", "<?", 1),
    8: ("STRING", None, 8), 9: ("ARRAY", None, 12), 10: ("UINT64", "<Q", 8), 11: ("INT64", "<q", 8),
    12: ("FLOAT64", "<d", 8),
}
#: numpy dtypes of the numeric value types, for reading arrays of them in one step
_NP_VALUE = {"UINT8": "<u1", "INT8": "<i1", "UINT16": "<u2", "INT16": "<i2", "UINT32": "<u4", "INT32": "<i4",
             "FLOAT32": "<f4", "BOOL": "?", "UINT64": "<u8", "INT64": "<i8", "FLOAT64": "<f8"}
#: tensor types whose data is handed out as typed elements (as gguf-py does); the rest as bytes per row
_NP_TENSOR = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
#: the smallest tensor info: name length, n_dims, type, offset
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8
#: the smallest key-value pair: key length, value type, a one-byte value
_MIN_KV = 8 + 4 + 1


def gguf_module() -> Any:
    """The gguf package (optional dependency), or UnsupportedError saying how to install it."""
    try:
        import gguf
    except ModuleNotFoundError:
        raise UnsupportedError("reading or writing GGUF needs the gguf package: pip install 'w4pack[gguf]'") from None
    return gguf


def is_gguf(path: Path) -> bool:
    """A file starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


def gguf_files_in(folder: Path) -> list[Path]:
    """The GGUF files directly inside ``folder`` (sorted; [] for a file or an unreadable folder): a GGUF model is
    one file, and a user who passes the folder it was downloaded into is told which file to pass instead."""
    try:
        return sorted(p for p in Path(folder).iterdir() if p.suffix.lower() == ".gguf" and is_gguf(p))
    except OSError:
        return []


def folder_not_file_hint(folder: Path) -> str:
    """"; pass the file: FOLDER/x.gguf" (or the list of them) when ``folder`` holds GGUF files, else ""."""
    found = gguf_files_in(folder)
    if not found:
        return ""
    if len(found) == 1:
        return f"; a GGUF model is one file: pass {found[0]}"
    shown = ", ".join(p.name for p in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return f"; a GGUF model is one file: pass one of the {len(found)} in it ({shown})"


@dataclass(frozen=True)
class GGUFValue:
    """One metadata value: its GGUF type name, the item type name of an ARRAY, and the Python value (as gguf-py's
    ``ReaderField.contents()`` gives it: int, float, bool, str, or a list of them)."""

    type: str
    value: Any
    item: str | None = None


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor info, checked: ``dims`` in GGUF order (fastest first), ``start`` the absolute file offset of its
    data, ``n_bytes`` its size; the data lies inside the data section and overlaps no other tensor's."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    type_name: str
    start: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (slowest first)."""
        return tuple(reversed(self.dims))


class _Cursor:
    """Reads little-endian fields of the header, refusing any read past the end, naming what was being read.

    The header is read with pread into a buffer that grows as the parse needs it (never a memory map: a mapped
    file truncated while it is read kills the process with SIGBUS)."""

    def __init__(self, fd: int, size: int, label: str):
        self.fd, self.size, self.label, self.pos = fd, size, label, 0
        self.buf = bytearray()
        self.context = "the header"

    def _load(self, end: int) -> None:
        """Have the file's bytes up to ``end`` (at most the size checked at open) in ``buf``."""
        if end <= len(self.buf):
            return
        want = min(self.size, max(end, 2 * len(self.buf), 1 << 20))
        self.buf += _pread_exact(self.fd, len(self.buf), want - len(self.buf), self.label)

    def fail(self, what: str, tensor: str | None = None) -> BadInputError:
        return BadInputError(f"corrupt or truncated GGUF: {self.context}: {what}", file=self.label, tensor=tensor)

    @property
    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, only {self.left} left")
        self._load(self.pos + n)

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None


def _read_value(cur: _Cursor, type_id: int, depth: int = 0) -> GGUFValue:
    spec = VALUE_TYPES.get(type_id)
    if spec is None:
        raise cur.fail(f"unknown value type {type_id}")
    name, fmt, _size = spec
    if fmt is not None:
        return GGUFValue(name, cur.scalar(fmt, f"a {name} value"))
    if name == "STRING":
        return GGUFValue(name, cur.string("a string value"))
    item_id = cur.scalar("<I", "the item type of an array")
    count = cur.scalar("<Q", "the item count of an array")
    item = VALUE_TYPES.get(item_id)
    if item is None:
        raise cur.fail(f"unknown array item type {item_id}")
    item_name, _fmt, item_min = item
    # every item takes at least item_min bytes: a count the rest of the file cannot hold is refused before any loop
    if count * item_min > cur.left:
        raise cur.fail(f"array of {count} {item_name} items needs at least {count * item_min} bytes, "
                       f"only {cur.left} left")
    if item_name in _NP_VALUE:
        cur.need(count * item_min, f"an array of {count} {item_name} items")
        arr = np.frombuffer(cur.buf, dtype=_NP_VALUE[item_name], count=count, offset=cur.pos)
        cur.pos += count * item_min
        return GGUFValue(name, arr.tolist(), item_name)
    if item_name == "STRING":
        return GGUFValue(name, [cur.string("a string in an array") for _ in range(count)], item_name)
    if depth + 1 >= MAX_NESTING:
        raise cur.fail(f"arrays nested more than {MAX_NESTING} deep")
    return GGUFValue(name, [_read_value(cur, 9, depth + 1).value for _ in range(count)], item_name)


def _read_metadata(cur: _Cursor, count: int) -> dict[str, GGUFValue]:
    meta: dict[str, GGUFValue] = {}
    for i in range(count):
        cur.context = f"key-value pair {i}"
        key = cur.string("its key")
        cur.context = f"key {key!r}"
        if key in meta:
            raise cur.fail("the key appears twice")
        meta[key] = _read_value(cur, cur.scalar("<I", "its value type"))
    return meta


def _type_table() -> dict[int, tuple[str, int, int]]:
    """GGML tensor type id -> (name, elements per block, bytes per block), from the gguf package's own table."""
    gguf = gguf_module()
    return {int(t): (t.name, int(b), int(s)) for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}


@dataclass(frozen=True)
class _RawInfo:
    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


def _read_tensor_infos(cur: _Cursor, count: int) -> list[_RawInfo]:
    infos = []
    for i in range(count):
        cur.context = f"tensor info {i}"
        name = cur.string("its name")
        cur.context = f"tensor {name!r}"
        n_dims = cur.scalar("<I", "its dimension count")
        if n_dims > MAX_DIMS:
            raise cur.fail(f"{n_dims} dimensions (GGUF allows at most {MAX_DIMS})")
        dims = tuple(cur.scalar("<Q", "a dimension") for _ in range(n_dims))
        type_id = cur.scalar("<I", "its type")
        offset = cur.scalar("<Q", "its data offset")
        infos.append(_RawInfo(name, dims, type_id, offset))
    return infos


def _alignment(meta: dict[str, GGUFValue], label: str) -> int:
    v = meta.get("general.alignment")
    if v is None:
        return DEFAULT_ALIGNMENT
    if v.type != "UINT32" or v.value == 0 or v.value & (v.value - 1):
        raise BadInputError(f"general.alignment must be a UINT32 power of two, got {v.type} {v.value!r}", file=label)
    return int(v.value)


def _check_tensors(raw: list[_RawInfo], data_start: int, size: int, align: int,
                   label: str) -> dict[str, GGUFTensorInfo]:
    """Each tensor's type known, no dimension 0, size computed without overflow, offset aligned, data inside the
    data section, no two tensors overlapping, and nothing but padding between them and after the last one."""
    types = _type_table()
    data_len = size - data_start
    out: dict[str, GGUFTensorInfo] = {}
    for r in raw:
        if r.name in out:
            raise BadInputError("tensor name appears twice", file=label, tensor=r.name)
        spec = types.get(r.type_id)
        if spec is None:
            raise BadInputError(f"unknown tensor type {r.type_id}; this gguf package cannot read it", file=label,
                                tensor=r.name)
        tname, block, type_size = spec
        if any(d == 0 for d in r.dims):  # no writer stores an empty weight; a zeroed count hides what follows
            raise BadInputError(f"dimensions {list(r.dims)} include 0: an empty tensor", file=label, tensor=r.name)
        row = r.dims[0] if r.dims else 1
        if row % block:
            raise BadInputError(f"row length {row} is not a multiple of the {tname} block size {block}",
                                file=label, tensor=r.name)
        n_bytes = math.prod(r.dims) // block * type_size  # Python ints: no wrap-around
        if r.offset % align:
            raise BadInputError(f"data offset {r.offset} is not a multiple of the alignment {align}", file=label,
                                tensor=r.name)
        if r.offset > data_len or n_bytes > data_len - r.offset:
            raise BadInputError(f"data at offset {r.offset} ({n_bytes} bytes) lies outside the data section "
                                f"({data_len} bytes): truncated or a corrupt offset", file=label, tensor=r.name)
        out[r.name] = GGUFTensorInfo(r.name, r.dims, r.type_id, tname, data_start + r.offset, n_bytes)
    spans = sorted(out.values(), key=lambda t: (t.start, t.n_bytes))
    for a, b in zip(spans, spans[1:]):
        if b.start < a.start + a.n_bytes:
            raise BadInputError(f"data overlaps tensor {a.name}'s (offsets {a.start - data_start} and "
                                f"{b.start - data_start})", file=label, tensor=b.name)
        # writers place each tensor right after the previous one, padded to the alignment: a wider gap means the
        # tensor's type or dimensions say fewer bytes than it holds (it would be read as other values)
        if b.start - (a.start + a.n_bytes) >= align:
            raise BadInputError(f"{b.start - a.start - a.n_bytes} unused bytes after its data, before tensor "
                                f"{b.name}'s: its type ({a.type_name}) or dimensions {list(a.dims)} are wrong",
                                file=label, tensor=a.name)
    if spans:
        # gguf-py and llama.cpp pad every tensor to the alignment, so the last one ends the file; bytes left over
        # mean the header announced fewer tensors than the file holds (or the data section is shifted)
        last = max(t.start + t.n_bytes for t in spans)
        if size - last >= align:
            raise BadInputError(f"{size - last} bytes after the last tensor's data: the header's tensor count "
                                f"({len(spans)}) or offsets are wrong", file=label)
    return out


class GGUFFile:
    """A parsed, checked GGUF file: ``metadata`` (key -> GGUFValue, in file order), ``tensors`` (name ->
    GGUFTensorInfo, in file order), ``version``, ``alignment``; ``data(name)`` is a read-only view of a tensor."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        label = str(self.path)
        self._fd: int | None = None
        try:
            # O_NONBLOCK: a FIFO in place of the file must not block the open until a writer comes
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise BadInputError("file does not exist", file=label) from None
        except IsADirectoryError:
            raise BadInputError("a folder, not a file (expected a .gguf file)" + folder_not_file_hint(self.path),
                                file=label) from None
        except OSError as exc:
            raise BadInputError(f"cannot open: {exc.strerror or exc}", file=label) from None
        self._fd = fd
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise BadInputError("a folder, not a file (expected a .gguf file)" + folder_not_file_hint(self.path),
                                    file=label)
            if not stat.S_ISREG(st.st_mode):
                raise BadInputError("not a regular file (a FIFO, device or socket cannot be read as GGUF)",
                                    file=label)
            os.set_blocking(fd, True)
            #: what the header was checked against: (size, mtime in ns); every data read checks it still holds
            self._identity = (st.st_size, st.st_mtime_ns)
            size = st.st_size
            magic = _pread_exact(fd, 0, min(size, 4), label)
            if size >= 4 and magic != MAGIC:
                raise BadInputError(f"not a GGUF file (magic {magic!r})", file=label)
            if size < 24:
                raise BadInputError(f"corrupt or truncated GGUF: {size} bytes, shorter than the fixed header",
                                    file=label)
            self._parse(size, label)
        except BaseException:
            self.close()
            raise

    def _parse(self, size: int, label: str) -> None:
        cur = _Cursor(self._fd, size, label)
        cur.pos = 4
        version = cur.scalar("<I", "the version")
        if version & 0xFFFF == 0 and version:
            raise UnsupportedError("big-endian GGUF is not supported", file=label)
        if version not in VERSIONS:
            raise UnsupportedError(f"GGUF version {version} is not supported (only {VERSIONS})", file=label)
        n_tensors = cur.scalar("<Q", "the tensor count")
        n_kv = cur.scalar("<Q", "the key-value count")
        # the cheapest check first: counts the file cannot possibly hold are refused before any loop
        if n_kv * _MIN_KV > cur.left:
            raise cur.fail(f"key-value count {n_kv} cannot fit in the {cur.left} bytes left")
        if n_tensors * _MIN_TENSOR_INFO > cur.left:
            raise cur.fail(f"tensor count {n_tensors} cannot fit in the {cur.left} bytes left")
        self.version = int(version)
        self.metadata = _read_metadata(cur, n_kv)
        if n_tensors * _MIN_TENSOR_INFO > cur.left:
            cur.context = "the tensor infos"
            raise cur.fail(f"tensor count {n_tensors} cannot fit in the {cur.left} bytes left")
        raw = _read_tensor_infos(cur, n_tensors)
        self.alignment = _alignment(self.metadata, label)
        self.data_start = -(-cur.pos // self.alignment) * self.alignment
        if raw and self.data_start > size:
            raise BadInputError(f"corrupt or truncated GGUF: the data section would start at {self.data_start}, "
                                f"past the end of the file ({size} bytes)", file=label)
        self.tensors = _check_tensors(raw, self.data_start, size, self.alignment, label)
        self.size = size

    def value(self, key: str) -> Any:
        """The Python value of ``key``, or None when absent."""
        v = self.metadata.get(key)
        return None if v is None else v.value

    def data(self, name: str) -> np.ndarray:
        """A tensor's data, read into an array of its own (read-only): typed elements in numpy order for
        F32/F16/F64/I8..I64, otherwise uint8 with the last dimension in bytes (rows of blocks), as gguf-py gives
        them. A file truncated or rewritten since its header was checked raises SourceChanged (exit 4)."""
        if self._fd is None:
            raise BadInputError("the file is closed", file=str(self.path), tensor=name)
        t = self.tensors[name]
        shape = t.shape
        self.check_unchanged(name)
        raw = _pread_exact(self._fd, t.start, t.n_bytes, str(self.path), tensor=name)
        self.check_unchanged(name)  # written to while we read: the bytes may be a mix of old and new
        if t.type_name in _NP_TENSOR:
            dt = np.dtype(_NP_TENSOR[t.type_name])
            arr = np.frombuffer(raw, dtype=dt, count=t.n_bytes // dt.itemsize).reshape(shape)
        else:
            arr = np.frombuffer(raw, dtype=np.uint8, count=t.n_bytes)
            if shape:
                rows = math.prod(shape[:-1])
                arr = arr.reshape(*shape[:-1], t.n_bytes // rows if rows else 0)
        arr.flags.writeable = False
        return arr

    def check_unchanged(self, name: str | None = None) -> None:
        """SourceChanged when the file's size or modification time is no longer what the header was checked
        against (a download or another writer at work)."""
        if self._fd is not None:
            check_identity(self._fd, self._identity, str(self.path), name)

    def release_pages(self) -> None:
        """Nothing to release: tensors are read into arrays of their own (kept for the readers' call sites)."""

    def close(self) -> None:
        """Close the file; arrays handed out stay valid (they are copies)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _pread_exact(fd: int, offset: int, n: int, label: str, tensor: str | None = None) -> bytearray:
    """``n`` bytes at ``offset``; a short read means the file shrank after it was checked (SourceChanged)."""
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise IOFailure(f"cannot read: {exc.strerror or exc}", file=label, tensor=tensor) from None
        if got <= 0:
            raise SourceChanged(label, f"it ended {n - done} bytes into data it was checked to hold", tensor=tensor)
        done += got
    return buf


def open_gguf(path: Path) -> GGUFFile:
    """A checked GGUFFile over ``path``; every problem is a BadInputError naming the file (and key or tensor)."""
    gguf_module()  # the tensor type table; say how to install it before reading anything
    return GGUFFile(Path(path))


def release_pages(f: GGUFFile | None) -> None:
    """Kept for callers that hold a file that may be closed."""
    if f is not None:
        f.release_pages()
