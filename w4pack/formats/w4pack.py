"""A w4pack checkpoint as a conversion source (re-shard, export to other formats) and as a target."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..canonical import CanonicalLayer
from ..checkpoint import MANIFEST_NAME, Checkpoint, CheckpointWriter
from .base import Capabilities, Format, Source, TensorData

__all__ = ["W4PackFormat", "W4PackSource", "write_packed"]

#: files a source may list that must not be copied into a packed checkpoint
_NOT_SIDE_FILES = {"config.json", "model.safetensors.index.json", MANIFEST_NAME, "quantize_config.json",
                   "quant_config.json", "quantization_config.json"}


class W4PackSource(Source):
    def __init__(self, path: Path):
        self.path = Path(path)
        self.ckpt = Checkpoint(path)
        self.config = {k: v for k, v in self.ckpt.config.items() if k != "quantization_config"}
        src = self.ckpt.manifest.get("source") or {}
        self.info = {"format": "w4pack", "version": "1", "notes": [f"repacked from {src.get('format', 'unknown')}"]}
        #: fused projections of the manifest, carried over by write_packed (w4pack.fuse)
        self.fused = dict(self.ckpt.manifest.get("fused") or {})
        if src.get("base_model"):
            self.info["base_model"] = src["base_model"]

    def layer_names(self) -> list[str]:
        return self.ckpt.layers

    def read_layer(self, name: str) -> CanonicalLayer:
        return self.ckpt.layer(name)

    def passthrough_names(self) -> list[str]:
        return self.ckpt.passthrough

    def read_tensor(self, name: str) -> TensorData:
        return TensorData(self.ckpt.raw(name), self.ckpt.dtype_name(name))

    def side_files(self) -> list[Path]:
        names = self.ckpt.manifest.get("side_files") or []
        return [self.path / n for n in names if (self.path / n).is_file()]

    def close(self) -> None:
        self.ckpt.close()


class W4PackFormat(Format):
    name = "w4pack"
    description = "w4pack packed checkpoint (layout w4pack-tiles v1)"
    capabilities = Capabilities(bits=(2, 3, 4, 8), zero_modes=("none", "int", "float"), act_order=True)

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
                 show_progress: bool | None = None, on_layer: Any = None) -> Path:
    """Stream ``source`` into a w4pack checkpoint: one layer in memory at a time, one shard buffered."""
    from ..progress import Progress

    names = source.layer_names()
    passthrough = source.passthrough_names()
    with CheckpointWriter(out, force=force, max_shard_size=max_shard_size, config=source.config,
                          source=source.info, show_progress=show_progress) as writer:
        with Progress(len(names) + len(passthrough), "packing", enabled=show_progress) as bar:
            for name in names:
                layer = source.read_layer(name)
                writer.add_layer(name, layer)
                if on_layer is not None:
                    on_layer(name, layer)
                bar.update()
            for tname in passthrough:
                t = source.read_tensor(tname)
                writer.add_tensor(tname, t.array, t.dtype)
                bar.update()
        if getattr(source, "fused", None):  # FusedSource (w4pack.fuse) records its row ranges as it reads
            writer.fused = dict(source.fused)
        for p in source.side_files():
            if p.name not in _NOT_SIDE_FILES:
                writer.add_side_file(p)
    return Path(out)
