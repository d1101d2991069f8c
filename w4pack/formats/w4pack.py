"""A w4pack checkpoint as a conversion source (re-shard, export to other formats) and as a target."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..core.canonical import CanonicalLayer
from ..store.checkpoint import (HEADER_ENTRY_BYTES, MANIFEST_NAME, Checkpoint, CheckpointWriter, check_layer_name,
                               source_note)
from ..errors import UnsupportedError, W4PackError
from ..store.folder import side_files
from ..core.layout import pack
from ..core.scratch import PACK_POOL, ScratchPool
from ..store.names import is_side_file
from . import gguf_quants
from .base import Capabilities, Format, Source, TensorData

__all__ = ["W4PackFormat", "W4PackSource", "write_packed"]



class W4PackSource(Source):
    def __init__(self, path: Path):
        self.path = Path(path)
        self.ckpt = Checkpoint(path)
        self.config = {k: v for k, v in self.ckpt.config.items() if k != "quantization_config"}
        src = self.ckpt.manifest.get("source") or {}
        # the folder's own manifest version (the output's manifest records it as its source's)
        self.info = {"format": "w4pack", "version": str(self.ckpt.format_version),
                     "notes": [f"repacked from {src.get('format', 'unknown')}"]}
        #: fused projections of the manifest, carried over by write_packed (w4pack.fuse)
        self.fused = dict(self.ckpt.manifest.get("fused") or {})
        # what the model card publishes about the model's origin: its base model and its license (a license the
        # first conversion took from a Hub source's card is a "license=" note of the manifest), and where it came from
        if src.get("base_model"):
            self.info["base_model"] = src["base_model"]
        lic = source_note(src, "license")
        if lic:
            self.info["license"] = lic
        if isinstance(src.get("path"), str) and src["path"].startswith("hf://"):
            self.info["notes"].append(f"originally from {src['path']}")

    def layer_names(self) -> list[str]:
        return self.ckpt.layers

    def read_layer(self, name: str) -> CanonicalLayer:
        return self.ckpt.layer(name)

    def passthrough_names(self) -> list[str]:
        return self.ckpt.passthrough

    def read_tensor(self, name: str) -> TensorData:
        return TensorData(self.ckpt.raw(name), self.ckpt.dtype_name(name))

    def fused_layers(self) -> dict[str, list[dict[str, Any]]]:
        return dict(self.fused)

    def embedding_names(self) -> list[str]:
        return [n for n, m in self.ckpt.manifest["layers"].items() if m.get("role") == "embedding"]

    def side_files(self) -> list[Path]:
        names = self.ckpt.manifest.get("side_files") or []
        return side_files(self.path, [n for n in names if isinstance(n, str)])

    def close(self) -> None:
        self.ckpt.close()


class W4PackFormat(Format):
    name = "w4pack"
    description = "w4pack packed checkpoint (layout w4pack-tiles v1)"
    capabilities = Capabilities(bits=(2, 3, 4, 5, 6, 8), zero_modes=("none", "int", "float"), act_order=True)
    stores_fused = True
    packs_embeddings = True
    #: expanded=True: every layer in the runtime form, none in the compact storage (docs/LAYOUT.md §8)
    write_options = frozenset({"expanded"})
    read_options: frozenset[str] = frozenset()

    @classmethod
    def source_problems(cls, source: Source, label: str) -> list[W4PackError]:
        """No layers, or layer names its manifest cannot hold (checked before anything is written)."""
        problems: list[W4PackError] = []
        names = source.layer_names()
        if not names:
            problems.append(UnsupportedError("the source holds no quantized layers", file=label))
        for name in names:
            try:
                check_layer_name(name, label)
            except W4PackError as exc:
                problems.append(exc)
        return problems

    @classmethod
    def detect(cls, path: Path) -> bool:
        return Path(path).is_dir() and (Path(path) / MANIFEST_NAME).is_file()

    @classmethod
    def open(cls, path: Path, **options: Any) -> Source:
        return W4PackSource(path)

    @classmethod
    def write(cls, source: Source, out: Path, *, force: bool = False, **options: Any) -> Path:
        return write_packed(source, out, force=force, **options)


def write_packed(source: Source, out: Path, *, force: bool = False, max_shard_size: int | str = "2GB",
                 show_progress: bool | None = None, on_layer: Any = None, expanded: bool = False) -> Path:
    """Stream ``source`` into a w4pack checkpoint: a layer or two in memory at a time, no shard buffered.

    A layer read from a GGUF K-quant, 5-bit or IQ4 type (directly or through an earlier w4pack folder) is stored in
    the compact form of its type (gguf_quants.STORAGE), so the folder is no larger than the GGUF; ``expanded``
    stores every layer in the runtime form instead."""
    from ..progress import Progress

    names = source.layer_names()
    passthrough = source.passthrough_names()
    # room for every header entry of the checkpoint in each shard, so no shard is rewritten to fit its header
    hint = sum(5 * (len(n) + 10 + HEADER_ENTRY_BYTES) for n in names) + sum(len(t) + HEADER_ENTRY_BYTES for t in passthrough)
    # sources that know where a pass-through tensor's bytes lie let the writer copy them in the kernel
    with CheckpointWriter(out, force=force, max_shard_size=max_shard_size, config=source.config,
                          source=source.info, show_progress=show_progress, header_hint=hint + 4096,
                          label=str(getattr(source, "path", "") or "") or None, check_architecture=True,
                          card=_model_card) as writer:
        with Progress(len(names) + len(passthrough), "packing", enabled=show_progress) as bar, \
                ThreadPoolExecutor(1, thread_name_prefix="w4pack-write") as io:
            # two-stage pipeline: layer i+1 is read and packed here while the thread writes layer i
            # (writes mostly wait for the disk); at most two packed layers are alive at once
            pending: Future | None = None
            pool = PACK_POOL.set(ScratchPool(2))  # packed layers i (being written) and i+1 recycle buffers
            try:
                # a reader that can pack from its own storage skips the canonical codes array (same bytes)
                for name in names:
                    packed = source.read_packed(name) if on_layer is None else None
                    if packed is None:
                        layer = source.read_layer(name)
                        packed = pack(layer.replace(name=name))
                        if on_layer is not None:
                            on_layer(name, layer)
                        del layer
                    if pending is not None:
                        pending.result()
                    spec = None if expanded else gguf_quants.storage_spec(packed.source)
                    pending = io.submit(writer.add_layer, name, packed, None, spec)
                    del packed
                    bar.update()
                if pending is not None:
                    pending.result()
            finally:
                PACK_POOL.reset(pool)
            for tname in passthrough:
                span = source.tensor_span(tname)
                if span is not None:
                    writer.add_tensor_span(tname, *span)
                else:
                    t = source.read_tensor(tname)
                    writer.add_tensor(tname, t.array, t.dtype)
                bar.update()
        fused = source.fused_layers()  # FusedSource (w4pack.fuse) records its row ranges as it reads
        if fused:
            writer.fused = dict(fused)
        for p in source.side_files():
            if is_side_file(p.name):
                writer.add_side_file(p)
    return Path(out)


def _model_card(folder: Any, name: str) -> str:
    """The Hugging Face model card of a new packed folder (``w4pack push`` updates the same card)."""
    from ..hub import model_card

    return model_card(folder, name=name)
