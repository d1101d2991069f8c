"""Sharded safetensors for the peers' formats: ``model.safetensors``, or ``model-0000k-of-0000n`` + index.

Writers of GPTQ-family, AWQ, TOML-table and compressed-tensors folders share it; w4pack's own checkpoints
use ``w4pack.checkpoint.CheckpointWriter``, which adds checksums and a manifest.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import output_of, write_failure
from ..errors import BadInputError
from ..folder import write_json
from ..safetensors_io import dtype_to_st

__all__ = ["ShardWriter", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"


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
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
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
        total = len(self.shards)
        if total == 1:
            os.replace(self.shards[0][0], self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names, _size) in enumerate(self.shards):
            fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
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
