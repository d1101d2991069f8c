"""The one streaming safetensors shard writer under every writer, and the two ways the peers' writers use it.

``ShardStream`` writes each tensor straight into the file of the shard being built, behind a header area
reserved at its start; when the shard is full (``max_bytes`` of tensor data, one group never split) its
header goes into that area, or, when the header does not fit there, in front of an in-kernel copy of the
data. Memory holds one group of tensors (a layer), never a shard. Options choose what each writer needs:

* ``pad=True`` fills the reserved area with spaces after the header, and the reservation grows from shard to
  shard after a header outgrew it (w4pack's own checkpoints, ``store.checkpoint.CheckpointWriter``);
* ``pad=False`` gives the tightest header (padded to 8 bytes): written in place when the reservation is
  exactly its size (a planned shard), else relocated (a reservation of 0: shapes learnt while writing);
* ``seal=True`` fsyncs and checksums each finished shard in a background thread while the next is written,
  ``sync=True`` fsyncs it in place.

``ShardWriter`` (AWQ, compressed-tensors, TOML tables: shapes learnt while writing) and ``PlannedShards``
(GPTQ: every tensor known up front, so each header is written in place) are thin configurations of it that
name the shards ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + index (store.names).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .atomic import is_disk_full, output_of, write_failure
from ..errors import BadInputError, IOFailure
from .folder import write_json
from .safetensors import dtype_to_st
from .names import INDEX_NAME, shard_names

__all__ = ["ShardStream", "Shard", "ShardWriter", "PlannedShards", "ShardEntry", "encode_header", "INDEX_NAME"]


def encode_header(header: dict[str, Any]) -> bytes:
    """A safetensors JSON header, padded with spaces to a multiple of 8 bytes (the length prefix not included)."""
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def _header(entries: list[tuple[str, str, list[int], int, int]]) -> dict[str, Any]:
    """The header of a shard from (name, st dtype, shape, begin, end) in data order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for name, dt, shape, begin, end in entries:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [begin, end]}
    return header


def _le(arr: np.ndarray) -> np.ndarray:
    """C-contiguous little-endian: the bytes safetensors stores."""
    a = np.ascontiguousarray(arr)
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a


@dataclass
class Shard:
    """A finished shard: its file (still under its temporary name), tensors in order, tensor data bytes (the
    index's total_size counts these), file size, and sha256 (``seal`` only: a Future until ``close``)."""

    path: Path
    names: list[str]
    data_bytes: int
    size: int
    sha256: Any = None


class ShardStream:
    """Stream tensors into safetensors shard files in ``folder``; see the module doc for the options.

    ``output`` is what errors name (the output the temporary folder becomes); ``temp`` names shard k's file
    until the owner renames it (``temp.format(k)``, or ``temp(k)``). ``close()`` returns the shards."""

    def __init__(self, folder: Path, max_bytes: int, *, output: Path, reserve: int = 0, pad: bool = False,
                 seal: bool = False, sync: bool = False, temp: str | Callable[[int], str] = ".shard-{:05d}.partial"):
        self.folder, self.max_bytes, self.output = Path(folder), max_bytes, Path(output)
        #: header area reserved at the start of the next shard (a planning owner sets it per shard)
        self.reserve = reserve
        self.pad, self.seal, self.sync, self.temp = pad, seal, sync, temp
        self.shards: list[Shard] = []
        self._fh: Any = None  # open file of the shard being built
        self._path: Path | None = None
        self._shard_reserve = 0
        self._pending: list[tuple[str, str, list[int], int, int]] = []  # name, st dtype, shape, begin, end
        self._pending_bytes = 0
        self._sealer: ThreadPoolExecutor | None = None
        self._names: set[str] = set()

    # -- adding ------------------------------------------------------------------------------------------------
    def _failure(self, exc: OSError, tensor: str | None = None) -> IOFailure:
        """Errors name the output and the shard's number: the temporary file is gone when the user reads them."""
        return write_failure(exc, self.output, f"cannot write shard {len(self.shards) + 1}", tensor=tensor)

    def _claim(self, name: str) -> None:
        """A tensor name must be new and one an index can hold (a non-empty string)."""
        if not isinstance(name, str) or not name:
            raise BadInputError(f"tensor name {name!r} cannot be stored (it must be a non-empty string)")
        if name in self._names:
            raise BadInputError("tensor name written twice", tensor=name)
        self._names.add(name)

    def _make_room(self, nbytes: int) -> None:
        """Close the shard first when ``nbytes`` more would overflow it (a shard holds at least one group)."""
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self.flush()
        if self._fh is None:
            k = len(self.shards)
            self._path = self.folder / (self.temp(k) if callable(self.temp) else self.temp.format(k))
            self._shard_reserve = self.reserve
            try:
                self._fh = open(self._path, "w+b")
                self._fh.seek(self._shard_reserve)
            except OSError as exc:
                raise self._failure(exc) from None

    def add(self, items: list[tuple[str, np.ndarray, str | None]]) -> None:
        """Tensors (name, array, dtype name or None) that share a shard, such as one layer's."""
        for name, _a, _d in items:
            self._claim(name)
        self._make_room(sum(a.nbytes for _n, a, _d in items))
        for name, arr, dname in items:
            a = _le(arr)
            begin = self._pending_bytes
            try:
                if a.size:
                    self._fh.write(memoryview(a).cast("B"))
            except OSError as exc:
                raise self._failure(exc, name) from None
            self._pending_bytes += a.nbytes
            self._pending.append((name, dtype_to_st(a, dname), list(a.shape), begin, self._pending_bytes))

    def add_span(self, name: str, path: str | os.PathLike[str], offset: int, nbytes: int, st_dtype: str,
                 shape: list[int] | tuple[int, ...]) -> None:
        """A tensor stored verbatim at ``offset`` of a file (a source's safetensors shard): its bytes are copied
        in the kernel, never through memory."""
        self._claim(name)
        self._make_room(nbytes)
        try:
            self._fh.flush()
            with open(path, "rb", buffering=0) as src:
                copy_fd(src.fileno(), offset, self._fh.fileno(), self._fh.tell(), nbytes)
            self._fh.seek(nbytes, os.SEEK_CUR)
        except OSError as exc:
            if not is_disk_full(exc):
                raise IOFailure(f"cannot copy tensor data: {exc.strerror}", file=str(path), tensor=name) from None
            raise self._failure(exc, name) from None
        begin = self._pending_bytes
        self._pending_bytes += nbytes
        self._pending.append((name, st_dtype, [int(d) for d in shape], begin, self._pending_bytes))

    # -- finishing ---------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Finish the shard being built (an empty one when nothing was ever added): its header goes into the
        reserved area, or in front of an in-kernel copy of the data when it does not fit there."""
        if not self._pending and self.shards:
            return
        if self._fh is None:
            self._make_room(0)
        path = self._path
        assert path is not None
        raw = json.dumps(_header(self._pending), separators=(",", ":")).encode("utf-8")
        reserve = self._shard_reserve
        try:
            self._fh.flush()
            if self.pad and 8 + len(raw) <= reserve:
                raw += b" " * (reserve - 8 - len(raw))
            else:
                raw += b" " * (-len(raw) % 8)
            if 8 + len(raw) == reserve:
                os.pwrite(self._fh.fileno(), struct.pack("<Q", len(raw)) + raw, 0)
                if self.sync:
                    os.fsync(self._fh.fileno())
                self._fh.close()
            else:
                moved = path.with_suffix(".moved")
                os.replace(path, moved)
                with open(path, "wb") as out:
                    out.write(struct.pack("<Q", len(raw)) + raw)
                    out.flush()
                    copy_fd(self._fh.fileno(), reserve, out.fileno(), out.tell(), self._pending_bytes)
                    if self.sync:
                        os.fsync(out.fileno())
                self._fh.close()
                os.unlink(moved)
                if self.pad:  # later shards reserve room for a header like this one
                    self.reserve = max(self.reserve, (len(raw) * 3 // 2 + 8 + 4095) // 4096 * 4096)
        except OSError as exc:
            raise self._failure(exc) from None
        self._fh = None
        size = 8 + len(raw) + self._pending_bytes
        sha = None
        if self.seal:
            if self._sealer is None:
                self._sealer = ThreadPoolExecutor(1, thread_name_prefix="w4pack-seal")
            sha = self._sealer.submit(seal_file, path, size)
        self.shards.append(Shard(path, [p[0] for p in self._pending], self._pending_bytes, size, sha))
        self._pending, self._pending_bytes = [], 0

    def close(self) -> list[Shard]:
        """Finish the last shard and wait for every background fsync + sha256 (IOFailure on the first that
        failed); returns the shards in order."""
        self.flush()
        for i, shard in enumerate(self.shards):
            if isinstance(shard.sha256, Future):
                try:
                    shard.sha256 = shard.sha256.result()
                except OSError as exc:
                    raise write_failure(exc, self.output, f"cannot write shard {i + 1}") from None
        if self._sealer is not None:
            self._sealer.shutdown(wait=True)
            self._sealer = None
        return self.shards

    def abort(self) -> None:
        """Close the open shard and let background fsyncs finish (the owner removes the folder); never raises."""
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None
        if self._sealer is not None:
            self._sealer.shutdown(wait=True)
            self._sealer = None


def publish(stream: ShardStream, *, sort_index: bool) -> list[str]:
    """Name a peer format's finished shards as its tools expect: one ``model.safetensors``, or numbered shards
    + an index (``total_size`` = tensor data, the Hugging Face convention). Returns the file names."""
    shards = stream.close()
    files = shard_names(len(shards))
    try:
        for shard, fname in zip(shards, files):
            if shard.path != stream.folder / fname:
                os.replace(shard.path, stream.folder / fname)
        if len(files) > 1:
            wmap = {n: fname for shard, fname in zip(shards, files) for n in shard.names}
            write_json(stream.folder / INDEX_NAME,
                       {"metadata": {"total_size": sum(s.data_bytes for s in shards)},
                        "weight_map": dict(sorted(wmap.items())) if sort_index else wmap})
    except OSError as exc:
        raise write_failure(exc, stream.output) from None
    return files


class ShardWriter:
    """AutoAWQ-style shards (one file, or ``model-0000k-of-0000n`` + index) for writers that learn shapes while
    writing: a ShardStream with no reservation, so each header is put in front of the data when the shard is
    full."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = Path(folder)
        self.stream = ShardStream(self.folder, max_bytes, output=output_of(self.folder))

    def add(self, name: str, arr: np.ndarray, dtype: str | None) -> None:
        self.stream.add([(name, arr, dtype)])

    def add_group(self, items: list[tuple[str, np.ndarray, str | None]]) -> None:
        """Tensors that must share a shard (one layer's): the shard is closed first if they would not fit."""
        self.stream.add(items)

    def finish(self) -> None:
        publish(self.stream, sort_index=False)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stream.abort()  # on error the AtomicFolder removes the partial files


@dataclass
class ShardEntry:
    """A tensor a PlannedShards writer expects: name, shape, safetensors dtype and byte count."""

    name: str
    shape: tuple[int, ...]
    st_dtype: str
    nbytes: int


class PlannedShards:
    """Shards written tensor by tensor in an order planned up front (GPTQ: every shape and dtype is known from
    the capability pass): each shard reserves exactly its planned header, so the header is written in place
    and no data is ever copied. A tensor that arrives out of plan is a bug in a source (it changed between
    passes)."""

    def __init__(self, folder: Path, entries: list[ShardEntry], max_shard: int):
        self.folder = Path(folder)
        # the stream's rule (close the shard when the next tensor would overflow it) applied to the plan
        plan: list[list[ShardEntry]] = [[]]
        size = 0
        for e in entries:
            if plan[-1] and size + e.nbytes > max_shard:
                plan.append([])
                size = 0
            plan[-1].append(e)
            size += e.nbytes
        self._reserve = []
        for shard in plan:
            rows, off = [], 0
            for e in shard:
                rows.append((e.name, e.st_dtype, list(e.shape), off, off + e.nbytes))
                off += e.nbytes
            self._reserve.append(8 + len(encode_header(_header(rows))))
        self.files = shard_names(len(plan))
        self._order = [(si, e) for si, shard in enumerate(plan) for e in shard]
        self._pos = 0
        # the files get their final names at once (a planned shard is complete when its last tensor is in)
        self.stream = ShardStream(self.folder, max_shard, output=output_of(self.folder), sync=True,
                                  reserve=self._reserve[0], temp=self.files.__getitem__)

    def write(self, name: str, arr: np.ndarray, dtype_name: str | None) -> None:
        if self._pos >= len(self._order):
            raise BadInputError("the source produced more tensors than it listed", tensor=name)
        si, e = self._order[self._pos]
        a = _le(arr)
        if name != e.name or tuple(a.shape) != e.shape or dtype_to_st(a, dtype_name) != e.st_dtype:
            raise BadInputError(f"the source changed between passes: expected {e.name} {list(e.shape)} {e.st_dtype}, "
                                f"got {list(a.shape)} {dtype_to_st(a, dtype_name)}", tensor=name)
        self.stream.reserve = self._reserve[si]
        self.stream.add([(name, a, dtype_name)])
        self._pos += 1

    def finish(self) -> list[str]:
        if self._pos != len(self._order):
            raise BadInputError(f"the source produced {self._pos} of the {len(self._order)} tensors it listed")
        return publish(self.stream, sort_index=True)

    def abort(self) -> None:
        self.stream.abort()


def copy_fd(src: int, src_off: int, dst: int, dst_off: int, nbytes: int) -> None:
    """Copy nbytes from src at src_off to dst at dst_off (file positions untouched), in the kernel where
    possible, else through an 8 MiB buffer."""
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src, dst, nbytes - done, src_off + done, dst_off + done)
            if n == 0:
                break
            done += n
    except (AttributeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL,
                                                          errno.EOPNOTSUPP, errno.EBADF):
            raise
        while done < nbytes:
            chunk = os.pread(src, min(8 << 20, nbytes - done), src_off + done)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                w = os.pwrite(dst, view, dst_off + done)
                done += w
                view = view[w:]
    if done != nbytes:
        raise OSError(errno.EIO, f"short copy ({done} of {nbytes} bytes)")


def seal_file(path: Path, size: int) -> str:
    """fsync a finished shard and return its sha256 (runs in the writer's background thread). The fsync
    (waiting for the disk) runs in a helper thread while this one hashes (CPU; the data is read back from
    the page cache, and hashing releases the GIL)."""
    h = hashlib.sha256()
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    failed: list[OSError] = []
    with open(path, "rb", buffering=0) as fh:
        def sync() -> None:
            try:
                os.fsync(fh.fileno())
            except OSError as exc:
                failed.append(exc)

        syncer = threading.Thread(target=sync, name="w4pack-fsync")
        syncer.start()
        try:
            total = 0
            while True:
                n = fh.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
                total += n
        finally:
            syncer.join()
    if failed:
        raise failed[0]
    if total != size:
        raise OSError(errno.EIO, f"shard is {total} bytes, expected {size}")
    return h.hexdigest()

