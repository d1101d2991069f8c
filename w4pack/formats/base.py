"""The interface every external format implements: detect, open (read), write, and capabilities.

A reader turns a peer's checkpoint into canonical layers plus pass-through tensors and side files; a
writer takes any ``Source`` and writes the peer's bytes. Conversions compose them, so n formats need
n readers and n writers, never n² scripts. Readers must stream: ``read_layer`` loads one layer.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..core.canonical import CanonicalLayer
from ..errors import W4PackError
from ..core.layout import PackedLayer

__all__ = ["Source", "Format", "Capabilities", "TensorData", "HubFiles", "WAY_OUT"]


@dataclass
class TensorData:
    """A pass-through tensor: array (bf16 as uint16 bits) and its dtype name."""

    array: np.ndarray
    dtype: str


@dataclass(frozen=True)
class HubFiles:
    """Which files of a Hub repository a reader needs: ``globs`` when a file matching ``marker`` is present.

    Of the kinds present, only those of the lowest ``rank`` are fetched (safetensors before a GGUF file before
    torch pickles); ``single``: the reader takes one file, so exactly one match is fetched (``what`` names it
    when the repository holds several)."""

    marker: str
    globs: tuple[str, ...] = ()
    rank: int = 0
    single: bool = False
    what: str = ""


SAFETENSORS_FILES = HubFiles("*.safetensors", ("*.safetensors",))
PICKLE_FILES = HubFiles("*.pt", ("*.pt",), rank=2)


#: the target that holds every layer a reader yields, named by every writer's refusal
WAY_OUT = "--to w4pack"


@dataclass
class Capabilities:
    """What a format can express; ``check`` names the first reason a layer cannot be written."""

    bits: tuple[int, ...] = (4,)
    zero_modes: tuple[str, ...] = ("none", "int")
    group_sizes: tuple[int, ...] | None = None  # None: any
    act_order: bool = False
    scale_dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")
    notes: list[str] = field(default_factory=list)

    def check(self, layer: CanonicalLayer) -> str | None:
        """The first reason ``layer`` cannot be written, ending in a way out (a target that holds it), or None."""
        reason = self.limit(layer)
        return None if reason is None else f"{reason} (way out: {self.way_out(layer)})"

    def limit(self, layer: CanonicalLayer) -> str | None:
        """The first of the declared limits (bits, zero mode, group size, act-order, scale dtype) ``layer`` exceeds."""
        if layer.bits not in self.bits:
            return f"{layer.bits}-bit layers (supported: {self.bits})"
        if layer.zero_mode not in self.zero_modes:
            return f"zero mode {layer.zero_mode!r} (supported: {self.zero_modes})"
        if self.group_sizes is not None and layer.group_size not in self.group_sizes:
            return f"group size {layer.group_size} (supported: {self.group_sizes})"
        if layer.act_order and not self.act_order:
            return "act-order (permuted g_idx)"
        if layer.scale_dtype not in self.scale_dtypes:
            return f"{layer.scale_dtype} scales (supported: {self.scale_dtypes})"
        return None

    def way_out(self, layer: CanonicalLayer) -> str:
        """Where a refused layer can go instead: the w4pack format holds every layer any reader yields (bits 2-8,
        every zero mode, act-order); a format that knows a closer target names it too."""
        return WAY_OUT


class Source(abc.ABC):
    """An opened checkpoint in some format, read lazily layer by layer."""

    #: Hugging Face config.json contents (may be empty when the source has none)
    config: dict[str, Any]
    #: {"format": ..., "version": ..., "notes": [...], "quirks": [...]} recorded in the manifest
    info: dict[str, Any]
    path: Path

    @abc.abstractmethod
    def layer_names(self) -> list[str]:
        """Module paths of quantized linear layers, in file order."""

    @abc.abstractmethod
    def read_layer(self, name: str) -> CanonicalLayer:
        """One layer as canonical (validated); streaming, so only this layer's data is loaded."""

    @abc.abstractmethod
    def passthrough_names(self) -> list[str]:
        """Unquantized tensors to carry over (embeddings, norms, biases of unquantized layers...)."""

    @abc.abstractmethod
    def read_tensor(self, name: str) -> TensorData:
        """One pass-through tensor."""

    def side_files(self) -> list[Path]:
        """Tokenizer files, generation config, ... to copy beside the weights."""
        return []

    # -- optional hooks: the defaults say "not offered" and the writers fall back ----------------------
    def read_packed(self, name: str) -> PackedLayer | None:
        """The layer already in layout v1, exactly ``layout.pack(read_layer(name))``, when the reader can
        pack from its own storage faster (GPTQ); None: the writer packs the canonical layer."""
        return None

    def tensor_span(self, name: str) -> tuple[str, int, int, str, tuple[int, ...]] | None:
        """(file, byte offset, byte count, safetensors dtype, shape) where a pass-through tensor's bytes lie
        verbatim, so a writer can copy them file to file; None: the writer copies read_tensor(name)."""
        return None

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """A pass-through tensor's shape from the file's header, without reading its data; None where the reader
        cannot say without reading it (checks then read it, or leave it to the writer)."""
        span = self.tensor_span(name)
        return None if span is None else tuple(span[4])

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """A tensor's (dtype name, shape), as the safetensors reader spells the dtype ("int32", "bfloat16"), without
        reading its data; None where the reader cannot say without reading it. Convert asks about pass-through
        tensors that may be a damaged layer's (w4pack.formats._incomplete)."""
        span = self.tensor_span(name)
        if span is None:
            return None
        from ..store.safetensors import DTYPES

        dt = DTYPES.get(span[3])
        return (dt[1] if dt else str(span[3])), tuple(span[4])

    def embedding_names(self) -> list[str]:
        """The layers of ``layer_names`` that are token embeddings kept packed (role "embedding"): looked up,
        not multiplied. A writer whose format cannot hold them gets them dequantized (formats/embeddings.py)."""
        return []

    def fused_layers(self) -> dict[str, list[dict[str, Any]]]:
        """Fused layers and their parts' row ranges, for the manifest (a fused w4pack checkpoint, w4pack.fuse)."""
        return {}

    def layers(self) -> Iterator[tuple[str, CanonicalLayer]]:
        for name in self.layer_names():
            yield name, self.read_layer(name)

    def close(self) -> None:  # noqa: B027 - optional
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Format(abc.ABC):
    """A checkpoint family. Subclasses register themselves in ``w4pack.formats.REGISTRY``."""

    name: str = ""
    description: str = ""
    capabilities: Capabilities = Capabilities()
    #: the output is one file: a shard size does not apply and the destination is not a folder (GGUF)
    single_file: bool = False
    #: a single file's leading bytes and the kind's name: ``--force`` replaces only an empty file or one of them
    file_magic: tuple[bytes, str] | None = None
    #: it can store fused projections (``convert --fuse``)
    stores_fused: bool = False
    #: it can hold a quantized token embedding (a layer of role "embedding"); others get it dequantized
    packs_embeddings: bool = False
    #: its check_writable has rules beyond ``capabilities`` (AWQ's one group size, GGUF's block encodings):
    #: ``convert --dry-run`` then asks it rather than the capabilities alone
    own_layer_checks: bool = False
    #: the writer options it takes (convert and Format.write refuse any other); None: not declared
    write_options: frozenset[str] | None = None
    #: the reader options it takes besides ``base`` (open_source refuses any other); None: the reader checks them
    read_options: frozenset[str] | None = None
    #: its reader rebuilds codes from the base model's weights (the ``base`` option: TOML quant tables)
    takes_base: bool = False
    #: the files its reader needs from a Hub repository (besides configs, card and tokenizer)
    hub_files: tuple[HubFiles, ...] = (SAFETENSORS_FILES,)

    @classmethod
    @abc.abstractmethod
    def detect(cls, path: Path) -> bool:
        """True when ``path`` looks like this format (cheap: config files and tensor names only)."""

    @classmethod
    @abc.abstractmethod
    def open(cls, path: Path, **options: Any) -> Source:
        """Open for reading."""

    @classmethod
    def write(cls, source: Source, out: Path, *, force: bool = False, **options: Any) -> Path:
        """Write ``source`` in this format into ``out`` (atomically). Formats that cannot write raise."""
        from ..errors import UnsupportedError

        raise UnsupportedError(f"writing {cls.name} is not supported")

    @classmethod
    def source_problems(cls, source: Source, label: str) -> list[W4PackError]:
        """What stops writing ``source`` in this format before any layer is read (e.g. names its manifest cannot
        hold); ``label`` names the source in the errors."""
        return []

    @classmethod
    def check_writable(cls, source: Source) -> list[str]:
        """Reasons (one per layer) why ``source`` cannot be written losslessly in this format."""
        problems = []
        for name in source.layer_names():
            reason = cls.capabilities.check(source.read_layer(name))
            if reason:
                problems.append(f"{name}: {cls.name} cannot express {reason}")
        return problems
