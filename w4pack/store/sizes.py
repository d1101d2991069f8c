"""Bytes of tensor data in a checkpoint, for judging whether a conversion made it grow.

Whole-file sizes mislead here: a GGUF carries its tokenizer inside the file and a safetensors header lists every
tensor by name, while a folder keeps its tokenizer.json, config and manifest beside the weights. The growth
worth a warning is in the tensor bytes themselves (a layer widened to float32, codes stored wider than the
source's), so that is what is counted: the data section of safetensors and GGUF files, the whole file for other
weight files (pickles, ``.npy``), and nothing for side files.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

from ..errors import BadInputError
from .gguffile import is_gguf, open_gguf

__all__ = ["WEIGHT_SUFFIXES", "tensor_bytes"]

#: files that hold tensors; everything else in a folder (tokenizer, config, manifest, metadata JSON) is a side file
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npy")


def _file_tensor_bytes(p: Path) -> int:
    size = p.stat().st_size
    if p.suffix.lower() == ".safetensors" and size >= 8:
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n <= size:
            return size - 8 - n
    elif p.suffix.lower() == ".gguf" or (p.suffix.lower() not in WEIGHT_SUFFIXES and is_gguf(p)):
        try:
            g = open_gguf(p)
        except BadInputError:
            return size  # a damaged file is judged by its size; its reader says what is wrong with it
        try:
            return sum(t.n_bytes for t in g.tensors.values())
        finally:
            g.close()
    return size


def tensor_bytes(path: str | os.PathLike[str]) -> int | None:
    """Tensor bytes of a local file or folder; None for a Hub address or a path that is neither.

    In a folder, the weight files of one kind are counted: safetensors where there are any (a Hub repository
    often ships the same weights again as ``pytorch_model.bin`` or ``original/*.pth``, which no reader reads
    beside them), else GGUF, else the pickles and ``.npy`` tables. Counting both would hide real growth."""
    if str(path).startswith("hf:"):
        return None
    p = Path(path)
    if p.is_file():
        return _file_tensor_bytes(p)
    if not p.is_dir():
        return None
    # links count as their targets: a Hub cache snapshot is a folder of links into its blobs
    files = [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix.lower() in WEIGHT_SUFFIXES]
    for kind in (".safetensors", ".gguf"):
        chosen = [f for f in files if f.suffix.lower() == kind]
        if chosen:
            return sum(_file_tensor_bytes(f) for f in chosen)
    return sum(_file_tensor_bytes(f) for f in files)
