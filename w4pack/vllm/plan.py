"""What a serving engine needs to know about a packed checkpoint, read once from its manifest (no vLLM import).

Why separate from the linear method: vLLM builds the quantization config in the engine process and pickles it
to every worker; this is that picklable part. It answers, for each linear layer the engine builds, which
checkpoint layers feed it (vLLM merges q/k/v and gate/up into one layer; ``w4pack convert --fuse`` may already
have), and it refuses, before any weight is loaded, a checkpoint the engine's model cannot take.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ..errors import BadInputError, UnsupportedError

__all__ = ["LayerPart", "LayerPlan", "CheckpointPlan", "not_packed_message", "resolve_model_path"]

PLAIN = None  #: shard key of a layer fed by one checkpoint layer


@dataclass
class LayerPart:
    """One checkpoint layer feeding (part of) an engine layer."""

    name: str                      # checkpoint layer name (module path)
    meta: dict[str, Any]           # its manifest entry (source notes dropped)
    shard: Any = PLAIN             # the engine's shard id ("q"/"k"/"v", 0/1, ...) or PLAIN
    sub_rows: list[tuple[str, int, int]] | None = None  # a --fuse'd layer's projections: (name, start, stop)
    extra_bias: np.ndarray | None = None  # a non-zero bias on a layer the engine builds without one

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.meta["shape"]
        return int(n), int(k)


@dataclass
class LayerPlan:
    prefix: str
    parts: list[LayerPart]

    def suffixes(self) -> list[str]:
        """The packed tensors the engine must register (bias is the engine's own parameter)."""
        out: list[str] = []
        for p in self.parts:
            for s in p.meta["tensors"]:
                if s != "bias" and s not in out:
                    out.append(s)
        return out


@dataclass
class CheckpointPlan:
    """The manifest's layers under the engine's module names, and the tensors stored unquantized."""

    path: str
    layers: dict[str, dict[str, Any]]
    fused: dict[str, list[dict[str, Any]]]
    passthrough: set[str]
    biases: dict[str, np.ndarray] = field(default_factory=dict)  # non-zero biases, by checkpoint layer

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> "CheckpointPlan":
        try:
            return cls._read(path)
        except BadInputError as exc:  # the folder itself is damaged: say how to look at all of it
            raise BadInputError(f"{exc.message}; `w4pack validate {path}` checks the whole folder (convert or "
                                "download it again if it is damaged)", file=exc.file, tensor=exc.tensor) from None

    @classmethod
    def _read(cls, path: str | os.PathLike[str]) -> "CheckpointPlan":
        from ..store.checkpoint import Checkpoint

        with Checkpoint(path) as ckpt:
            _check_config(ckpt)
            # what `w4pack validate --no-checksums` reads of the shards: their headers only (no data), so that a
            # truncated shard, a tensor missing from it or one whose shape or dtype contradicts the manifest is
            # refused here, naming the file, rather than deep in the engine's weight loader
            ckpt.check_shards()
            for name in ckpt.layers:
                ckpt.packed_shapes_ok(name)
            ckpt.check_index_coverage()
            ckpt.check_architecture()  # a layer the model lacks: else vLLM's loader names only its own module
            layers = {name: {k: v for k, v in meta.items() if k != "source"}
                      for name, meta in ckpt.manifest["layers"].items()}
            biases = {}
            for name, meta in layers.items():
                tname = meta["tensors"].get("bias")
                if tname is not None:
                    b = np.array(ckpt.raw(tname))
                    if np.any(b.view(np.uint8)):  # +0.0 everywhere is no bias (AutoGPTQ writes such)
                        biases[name] = b
            return cls(path=str(ckpt.path), layers=layers, fused=dict(ckpt.manifest.get("fused") or {}),
                       passthrough=set(ckpt.passthrough), biases=biases)

    def rename(self, mapper: Callable[[str], str | None]) -> None:
        """Apply the engine's checkpoint-to-module renames (e.g. a model whose modules sit under another
        prefix); names the engine drops are dropped here too."""

        def ren(name: str) -> str | None:
            return mapper(name)

        self.layers = {new: m for name, m in self.layers.items() if (new := ren(name)) is not None}
        self.biases = {new: b for name, b in self.biases.items() if (new := ren(name)) is not None}
        self.fused = {new: [dict(p, name=ren(p["name"]) or p["name"]) for p in parts]
                      for name, parts in self.fused.items() if (new := ren(name)) is not None}
        self.passthrough = {new for t in self.passthrough if (new := ren(t)) is not None}

    @property
    def embedding(self) -> str | None:
        """The packed token embedding's name, if the checkpoint keeps one packed."""
        return next((name for name, meta in self.layers.items() if meta.get("role") == "embedding"), None)

    def embedding_for(self, rows: int, dim: int) -> str | None:
        """The packed token embedding of shape [rows, dim], if any: vLLM's models build their token embedding
        without a module prefix, so it is found by its role and shape."""
        name = self.embedding
        return name if name is not None and self.layers[name]["shape"] == [rows, dim] else None

    def unasked_embedding_error(self, prefix: str, seen: list[tuple[int, int]]) -> Exception | None:
        """The error for engine layer ``prefix`` when the packed token embedding was never asked for, else None.

        vLLM builds the token embedding before its decoder layers: reaching the first layer of the embedding's
        own stack (``<parent>.layers.``; not a vision tower's ``layers``) unasked means the model built it
        without the quantization config, or (``seen``: the shapes of the unnamed token embeddings it did build
        with it) built it with another shape than the checkpoint's."""
        name = self.embedding
        if name is None:
            return None
        parent = name.rpartition(".")[0]
        if not prefix.startswith(f"{parent}.layers." if parent else "layers."):
            return None
        shape = list(self.layers[name]["shape"])
        if seen:
            return BadInputError(f"the checkpoint's token embedding is {shape}, the model's is {list(seen[0])}",
                                 file=self.path, tensor=name)
        return UnsupportedError("this model's vLLM implementation builds its token embedding without the "
                                "quantization config, so it cannot take a packed one; convert the source again "
                                "with --float-embeddings (stored as exact float32)", file=self.path, tensor=name)

    def ties_head(self, prefix: str) -> bool:
        """Whether the engine's output head ``prefix`` can only be the packed embedding, tied: the checkpoint
        stores no head of its own, packed or float."""
        return self.embedding is not None and prefix not in self.layers and f"{prefix}.weight" not in self.passthrough

    # -- per engine layer ------------------------------------------------------------------------
    def plan(self, prefix: str, merged: Iterable[str] | None, shard_ids: list[Any] | None) -> LayerPlan | None:
        """The checkpoint layers behind engine layer ``prefix``; None when it is stored unquantized.

        ``merged``: the checkpoint names the engine merged into this layer (its ``packed_modules_mapping``),
        ``shard_ids``: the ids the engine's loader gives them, in the same order."""
        if prefix in self.layers:
            meta = self.layers[prefix]
            sub = self.fused.get(prefix)
            rows = None if sub is None else [(p["name"], int(p["rows"][0]), int(p["rows"][1])) for p in sub]
            return LayerPlan(prefix, [LayerPart(prefix, meta, PLAIN, rows, self.biases.get(prefix))])
        names = list(merged or [])
        if not names:
            self._require_float(prefix, [prefix])
            return None
        present = [n for n in names if n in self.layers]
        if not present:
            self._require_float(prefix, names)
            return None
        if len(present) != len(names):
            missing = [n for n in names if n not in self.layers]
            raise UnsupportedError(f"the engine merges {', '.join(names)} into one layer, but only "
                                   f"{', '.join(present)} are quantized in the checkpoint ({', '.join(missing)} "
                                   "are not): a merged layer must be all packed or all float", tensor=prefix)
        ids = shard_ids if shard_ids is not None else list(range(len(names)))
        return LayerPlan(prefix, [LayerPart(n, self.layers[n], sid, None, self.biases.get(n))
                                  for n, sid in zip(names, ids)])

    def moe_plan(self, prefix: str, leaves: tuple[str, str, str | None], num_experts: int) -> Any:
        """The packed experts behind engine MoE block ``prefix`` (``MoEPlan``), None when they are stored float.

        ``leaves``: the checkpoint's names of each expert's gate, up and down projections (``w1``, ``w3``, ``w2``
        for Mixtral; ``gate_proj``, ``up_proj``, ``down_proj`` for Qwen-MoE), under ``prefix.<expert>.``; up is
        None for a block without gating (refused when packed). ``num_experts``: the checkpoint's (logical)
        experts."""
        from .moe import MoEPlan, SHARDS

        fused = [n for e in range(num_experts) if (n := f"{prefix}.{e}.gate_up_proj") in self.layers]
        if fused:
            raise UnsupportedError("experts whose gate and up projections were fused (--fuse gate-up); convert the "
                                   "source again without fusing them", file=self.path, tensor=fused[0])
        known = [leaf for leaf in leaves if leaf is not None]
        present = [n for e in range(num_experts) for leaf in known if (n := f"{prefix}.{e}.{leaf}") in self.layers]
        if not present:
            return None
        if leaves[1] is None:
            raise UnsupportedError("experts without an up projection (a non-gated activation); packed experts run "
                                   "gated ones only", file=self.path, tensor=present[0])
        names = [{s: f"{prefix}.{e}.{leaf}" for s, leaf in zip(SHARDS, leaves)} for e in range(num_experts)]
        flat = [n for ex in names for n in ex.values()]
        if len(present) != len(flat):
            missing = next(n for n in flat if n not in self.layers)
            raise UnsupportedError(f"{len(present)} of the {len(flat)} expert projections of {prefix} are packed and "
                                   "the rest not: the engine runs an MoE block all packed or all float",
                                   file=self.path, tensor=missing)
        biased = next((n for n in flat if n in self.biases), None)
        if biased is not None:
            # the engine's experts have no bias (checked against the model at create) and its loader skips
            # expert biases without a word: dropping one would change every output silently
            raise UnsupportedError("the expert projection has a non-zero bias; the engine's MoE block runs "
                                   "bias-free experts", file=self.path, tensor=biased)
        return MoEPlan(prefix, [{s: LayerPart(n, self.layers[n], s) for s, n in ex.items()} for ex in names])

    def _require_float(self, prefix: str, names: list[str]) -> None:
        missing = [n for n in names if f"{n}.weight" not in self.passthrough]
        if missing:
            raise BadInputError(f"the model needs linear layer {missing[0]}, which the checkpoint holds neither "
                                "packed (manifest layers) nor as a float weight; the checkpoint is for another "
                                "architecture or incomplete", file=self.path, tensor=missing[0])


def _check_config(ckpt: Any) -> None:
    """The manifest and config.json must describe the same layout (the loader trusts the manifest per layer)."""
    qc = ckpt.config.get("quantization_config") or {}
    ckpt.check_fused()
    layout = ckpt.manifest.get("layout") or {}
    if layout and (layout.get("name"), layout.get("version")) != (qc.get("layout"), qc.get("layout_version")):
        raise BadInputError(f"config.json says layout {qc.get('layout')} v{qc.get('layout_version')} but the "
                            f"manifest says {layout.get('name')} v{layout.get('version')}",
                            file=str(Path(ckpt.path) / "config.json"))


def not_packed_message(method: str | None) -> str:
    """The error for ``quantization="w4pack"`` on a model that ``w4pack convert`` did not write (``method``: the
    quant_method its config.json names, None for an unquantized model)."""
    head = "quantization='w4pack' serves folders written by `w4pack convert`"
    if method is None:
        return (f"{head}, and this model has no quantization_config in config.json (an unquantized model): w4pack "
                "does not quantize, at load time or otherwise; quantize it with a GPTQ or AWQ tool, then convert "
                "that (w4pack convert SRC DST) and serve DST")
    return (f"{head}, and this is a {method!r} checkpoint: convert it (w4pack convert SRC DST) and serve DST, or drop "
            f"the quantization argument to load it with vLLM's own {method!r} method")


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """A local folder as is; a Hub id as its snapshot in the local cache (downloaded if needed, as the engine
    will download the same files for its weights)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision,
                                 allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
    except Exception as exc:  # noqa: BLE001 - the Hub client raises many kinds; say what was asked
        raise BadInputError(f"cannot read the w4pack manifest of {model!r}: {exc}") from None
