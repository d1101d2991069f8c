"""Streaming safetensors shard writers for the peers' formats: ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` + index (names from store.names).

* ``ShardWriter`` spools tensors as they arrive and writes each shard's header when the shard is full
  (AWQ, TOML tables, compressed-tensors: shapes are learnt while writing).
* ``PlannedShards`` writes each header first and streams the data behind it, for writers that know every
  tensor's shape and dtype up front (GPTQ): no spool copy.

w4pack's own checkpoints use ``w4pack.checkpoint.CheckpointWriter``, which adds checksums and a manifest
on the same names.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import output_of, write_failure
from ..errors import BadInputError, IOFailure
from .folder import write_json
from .safetensors import dtype_to_st
from .names import INDEX_NAME, shard_names

__all__ = ["ShardWriter", "PlannedShards", "ShardEntry", "encode_header", "INDEX_NAME"]


def encode_header(header: dict[str, Any]) -> bytes:
    """A safetensors JSON header, padded with spaces to a multiple of 8 bytes (the length prefix not included)."""
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


class ShardWriter:
    """Streams tensors into AutoAWQ-style shards (one file, or ``model-0000k-of-0000n`` + index).

    Memory stays at one tensor: data goes to a spool file as it arrives; when a shard is full its header is
    written and the spool copied behind it (the header needs every offset, so it cannot come first).
    """

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        #: what errors name: the output folder the temporary one becomes, not the spool that is gone by then
        self.output = output_of(Path(folder))
        self.entries: list[tuple[str, str, list[int], int]] = []  # name, st dtype, shape, nbytes
        self.spool_path = folder / ".spool.partial"
        try:
            self.spool = open(self.spool_path, "wb")
        except OSError as exc:
            raise write_failure(exc, self.output) from None
        self.spool_bytes = 0
        self.shards: list[tuple[Path, list[str], int]] = []
        self.seen: set[str] = set()

    def add(self, name: str, arr: np.ndarray, dtype: str | None) -> None:
        self.add_group([(name, arr, dtype)])

    def add_group(self, items: list[tuple[str, np.ndarray, str | None]]) -> None:
        """Tensors that must share a shard (one layer's): the shard is closed first if they would not fit."""
        for name, _a, _d in items:
            if name in self.seen:
                raise BadInputError("tensor name written twice", tensor=name)
            self.seen.add(name)
        if self.entries and self.spool_bytes + sum(a.nbytes for _n, a, _d in items) > self.max_bytes:
            self.flush()
        for name, arr, dtype in items:
            a = np.ascontiguousarray(arr)
            if a.dtype.byteorder == ">":
                a = a.astype(a.dtype.newbyteorder("<"))
            self.entries.append((name, dtype_to_st(a, dtype), list(a.shape), a.nbytes))
            try:
                if a.nbytes:
                    self.spool.write(memoryview(a).cast("B"))
            except OSError as exc:
                raise write_failure(exc, self.output, tensor=name) from None
            self.spool_bytes += a.nbytes

    def flush(self) -> None:
        try:
            self._flush()
        except OSError as exc:
            raise write_failure(exc, self.output, f"cannot write shard {len(self.shards) + 1}") from None

    def _flush(self) -> None:
        if not self.entries and self.shards:
            return
        self.spool.close()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dt, shape, nbytes in self.entries:
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = encode_header(header)
        path = self.folder / f".shard-{len(self.shards):05d}.partial"
        with open(path, "wb") as out, open(self.spool_path, "rb") as spool:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            shutil.copyfileobj(spool, out, 16 << 20)
        # the index's total_size is the tensor data (the Hugging Face convention), not the files with headers
        self.shards.append((path, [e[0] for e in self.entries], offset))
        self.entries, self.spool_bytes = [], 0
        self.spool = open(self.spool_path, "wb")

    def finish(self) -> None:
        self.flush()
        try:
            self.spool.close()
            os.unlink(self.spool_path)
        except OSError as exc:
            raise write_failure(exc, self.output) from None
        files = shard_names(len(self.shards))
        if len(files) == 1:
            os.replace(self.shards[0][0], self.folder / files[0])
            return
        weight_map = {}
        for fname, (path, names, _size) in zip(files, self.shards):
            os.replace(path, self.folder / fname)
            weight_map.update({n: fname for n in names})
        index = {"metadata": {"total_size": sum(s for _p, _n, s in self.shards)}, "weight_map": weight_map}
        try:
            write_json(self.folder / INDEX_NAME, index)
        except OSError as exc:
            raise write_failure(exc, self.output / INDEX_NAME) from None

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.spool.close()  # on error the AtomicFolder removes the partial files
        except OSError:
            if exc[0] is None:
                raise


@dataclass
class ShardEntry:
    """A tensor a PlannedShards writer expects: name, shape, safetensors dtype and byte count."""

    name: str
    shape: tuple[int, ...]
    st_dtype: str
    nbytes: int


class PlannedShards:
    """Safetensors shards written tensor by tensor, in an order planned up front.

    Every tensor's shape and dtype is known before the first byte (from the capability pass), so
    each shard's header is written first and the data streams after it: memory holds one layer, not
    one shard. A tensor that arrives out of plan is a bug in a source (it changed between passes).
    """

    def __init__(self, folder: Path, entries: list[ShardEntry], max_shard: int):
        self.folder = folder
        self.shards: list[list[ShardEntry]] = [[]]
        size = 0
        for e in entries:
            if self.shards[-1] and size + e.nbytes > max_shard:
                self.shards.append([])
                size = 0
            self.shards[-1].append(e)
            size += e.nbytes
        self.files = shard_names(len(self.shards))
        self._order = [(si, e) for si, shard in enumerate(self.shards) for e in shard]
        self._pos = 0
        self._fh: Any = None
        self._shard = -1
        if not entries:
            self._open(0)
            self._close()

    def _open(self, si: int) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for e in self.shards[si]:
            header[e.name] = {"dtype": e.st_dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
            off += e.nbytes
        raw = encode_header(header)
        path = self.folder / self.files[si]
        try:
            self._fh = open(path, "wb")
            self._fh.write(len(raw).to_bytes(8, "little"))
            self._fh.write(raw)
        except OSError as exc:
            raise IOFailure(f"cannot write: {exc.strerror}", file=str(path)) from None
        self._shard = si

    def _close(self) -> None:
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
        except OSError as exc:
            raise IOFailure(f"cannot write: {exc.strerror}", file=str(self.folder / self.files[self._shard])) from None
        self._fh = None

    def write(self, name: str, arr: np.ndarray, dtype_name: str | None) -> None:
        if self._pos >= len(self._order):
            raise BadInputError("the source produced more tensors than it listed", tensor=name)
        si, e = self._order[self._pos]
        a = np.ascontiguousarray(arr)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if name != e.name or tuple(a.shape) != e.shape or dtype_to_st(a, dtype_name) != e.st_dtype:
            raise BadInputError(f"the source changed between passes: expected {e.name} {list(e.shape)} {e.st_dtype}, "
                                f"got {list(a.shape)} {dtype_to_st(a, dtype_name)}", tensor=name)
        if si != self._shard:
            self._open(si)
        try:
            if a.size:
                self._fh.write(memoryview(a).cast("B"))
        except OSError as exc:
            raise IOFailure(f"cannot write: {exc.strerror}", file=str(self.folder / self.files[si])) from None
        self._pos += 1
        if self._pos == len(self._order) or self._order[self._pos][0] != si:
            self._close()

    def finish(self) -> list[str]:
        if self._pos != len(self._order):
            raise BadInputError(f"the source produced {self._pos} of the {len(self._order)} tensors it listed")
        if len(self.files) > 1:
            wmap = {e.name: self.files[si] for si, e in self._order}
            total = sum(e.nbytes for _si, e in self._order)
            write_json(self.folder / INDEX_NAME,
                        {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))})
        return self.files

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
