"""Storage: the files of a model folder, read and written in one place.

``names`` (file names, side files), ``tensors`` (one read-only tensor store for every reader),
``shards`` (streaming safetensors shard writers), ``torchfile`` (weights-only torch pickles).
Readers under ``formats/`` receive a TensorStore and never open a file themselves.
"""
from __future__ import annotations

from .tensors import TensorStore, open_tensors

__all__ = ["TensorStore", "open_tensors"]
