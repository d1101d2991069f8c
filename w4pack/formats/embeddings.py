"""Packed token embeddings for formats that cannot hold them: dequantized exactly, carried as float32.

A GGUF's quantized ``token_embd`` stays packed in a w4pack checkpoint (a layer of role "embedding") and goes back
into a GGUF in its own type. GPTQ, AWQ, compressed-tensors and the TOML tables quantize linear layers only, and
their loaders expect ``<embedding>.weight`` as a plain tensor: for them the embedding becomes that tensor, the
float32 values of ``canonical.dequantize`` (what the layer means, bit for bit), and the source notes say so.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..core.canonical import CanonicalLayer
from ..errors import BadInputError
from .base import Format, Source, TensorData

__all__ = ["DequantizedEmbeddings", "for_target"]


class DequantizedEmbeddings(Source):
    """``inner`` with its packed embeddings moved from the layers to the pass-through tensors, as float32."""

    def __init__(self, inner: Source, target: str, why: str | None = None):
        self.inner = inner
        self.path = inner.path
        self.config = inner.config
        self.embeddings = {f"{n}.weight": n for n in inner.embedding_names()}
        self.info = dict(inner.info)
        why = why or f"which {target} cannot hold"
        self.info["notes"] = list(inner.info.get("notes") or []) + [
            f"{n}: a packed embedding, {why}: dequantized exactly to float32" for n in self.embeddings.values()]

    def layer_names(self) -> list[str]:
        mine = set(self.embeddings.values())
        return [n for n in self.inner.layer_names() if n not in mine]

    def read_layer(self, name: str) -> CanonicalLayer:
        if name in self.embeddings.values():
            raise BadInputError("a packed embedding is carried as a float tensor here", tensor=name)
        return self.inner.read_layer(name)

    def passthrough_names(self) -> list[str]:
        return list(self.embeddings) + self.inner.passthrough_names()

    def read_tensor(self, name: str) -> TensorData:
        if name in self.embeddings:
            return TensorData(self.inner.read_layer(self.embeddings[name]).dequantize(np.float32), "float32")
        return self.inner.read_tensor(name)

    def tensor_span(self, name: str) -> Any:
        return None if name in self.embeddings else self.inner.tensor_span(name)

    def side_files(self) -> list[Path]:
        return self.inner.side_files()

    def fused_layers(self) -> dict[str, list[dict[str, Any]]]:
        return self.inner.fused_layers()

    def close(self) -> None:
        self.inner.close()


def for_target(source: Source, target: type[Format], keep_packed: bool = True) -> Source:
    """``source`` as ``target`` can write it: unchanged when the format holds packed embeddings (and they are to
    stay packed) or there are none."""
    if not source.embedding_names() or (target.packs_embeddings and keep_packed):
        return source
    why = "asked for as float (--float-embeddings)" if target.packs_embeddings else None
    return DequantizedEmbeddings(source, target.name, why)
