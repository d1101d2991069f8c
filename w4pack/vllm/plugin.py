"""The vLLM side of the plugin: the quantization config and the linear method, as vLLM's classes want them.

Everything that does work lives in ``plan`` (the manifest, read once in the engine process and pickled to the
workers) and ``method`` (create/load/process/apply); this module only adapts them to vLLM's base classes.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from ..errors import BadInputError, UnsupportedError
from ..schema import validate_quantization_config
from .method import PackedLinearMethod, TiedHeadMethod, is_qkv, precision_from_env
from .moe import PackedMoEMethod, plan_for_layer
from .plan import CheckpointPlan, not_packed_message, resolve_model_path

__all__ = ["W4PackConfig", "W4PackLinearMethod", "W4PackMoEMethod", "W4PackTiedHeadMethod", "W4PackVocabMethod"]


class W4PackLinearMethod(PackedLinearMethod, LinearMethodBase):
    """``PackedLinearMethod`` as a vLLM ``LinearMethodBase``."""


class W4PackVocabMethod(PackedLinearMethod, QuantizeMethodBase):
    """A packed token embedding (``embedding``) or output head (``apply``), split by vocabulary rows."""


class W4PackTiedHeadMethod(TiedHeadMethod, QuantizeMethodBase):
    """An output head tied to the packed token embedding."""


class W4PackMoEMethod(PackedMoEMethod, FusedMoEMethodBase):
    """``PackedMoEMethod`` as a vLLM ``FusedMoEMethodBase`` (it routes and runs the experts itself)."""

    def __init__(self, plan: Any, moe: Any, *, precision: str | None = None):
        PackedMoEMethod.__init__(self, plan, precision=precision)
        FusedMoEMethodBase.__init__(self, moe)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None  # no vLLM MoE kernel runs these experts


class W4PackConfig(QuantizationConfig):
    """config.json's ``quantization_config`` plus the manifest it names (read in ``maybe_update_config``)."""

    def __init__(self, quant_config: dict[str, Any] | None = None):
        if quant_config is None:  # vLLM builds it so for `quantization="w4pack"` on a model without any
            raise BadInputError(not_packed_message(None))
        super().__init__()
        self.quant_config = quant_config
        self.checkpoint: CheckpointPlan | None = None
        self.precision = precision_from_env()

    def __repr__(self) -> str:
        return f"W4PackConfig(layout={self.quant_config.get('layout')} v{self.quant_config.get('layout_version')})"

    def get_name(self) -> str:
        return "w4pack"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the CUDA kernels use mma.sync m16n8k16 (sm_80 and newer)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the quantization_config in config.json is enough; the manifest is read from the model

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """vLLM asks every registered method first; w4pack claims nothing, but ``quantization="w4pack"`` on
        another method's checkpoint is told what to do instead of only that the two names differ."""
        method = (hf_quant_cfg or {}).get("quant_method")
        if user_quant == "w4pack" and method != "w4pack":
            raise BadInputError(not_packed_message(method))
        return None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "W4PackConfig":
        validate_quantization_config(dict(config), file="config.json")
        return cls(dict(config))

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        self.checkpoint = CheckpointPlan.from_folder(resolve_model_path(model_name, revision))

    def _check_embedding_asked(self, layer: torch.nn.Module, prefix: str) -> None:
        """Some of vLLM's models (Mixtral) build their token embedding without the quantization config, so it can
        only load a float table: refuse a packed one with the way out, when the first layer of its decoder
        stack is built (the embedding is built before it), rather than with a loader error about unknown
        tensors (``CheckpointPlan.unasked_embedding_error``)."""
        if getattr(self, "_embedding_asked", False):
            return
        error = self.checkpoint.unasked_embedding_error(prefix, getattr(self, "_embedding_seen", []))
        if error is None:
            return
        from vllm.distributed import get_pp_group

        if get_pp_group().is_first_rank:
            raise error

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        if self.checkpoint is not None:
            self.checkpoint.rename(hf_to_vllm_mapper._map_name)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        if self.checkpoint is None:
            raise BadInputError("the w4pack manifest was not read (maybe_update_config was not called)")
        _refuse_lora(self.checkpoint.path)
        self._check_embedding_asked(layer, prefix)
        if isinstance(layer, RoutedExperts):
            moe = plan_for_layer(self.checkpoint, layer, prefix)
            return None if moe is None else W4PackMoEMethod(moe, layer.moe_config, precision=self.precision)
        if isinstance(layer, VocabParallelEmbedding):  # token embedding, or output head (ParallelLMHead)
            if not prefix and not isinstance(layer, ParallelLMHead):
                prefix = self.checkpoint.embedding_for(layer.org_vocab_size, layer.embedding_dim) or ""
                if not prefix:  # an unnamed table of another shape: said when the decoder's layers are built
                    self._embedding_seen = getattr(self, "_embedding_seen", []) + \
                        [(int(layer.org_vocab_size), int(layer.embedding_dim))]
            if prefix in self.checkpoint.layers:
                if prefix == self.checkpoint.embedding:
                    self._embedding_asked = True
                return W4PackVocabMethod(self.checkpoint.plan(prefix, None, None), precision=self.precision)
            if isinstance(layer, ParallelLMHead) and self.checkpoint.ties_head(prefix):
                return W4PackTiedHeadMethod(prefix)
            return None
        if not isinstance(layer, LinearBase):
            if prefix in self.checkpoint.layers:
                raise UnsupportedError(f"the checkpoint stores {type(layer).__name__} {prefix!r} packed; the vLLM "
                                       "plugin serves packed linear layers, token embeddings and output heads only "
                                       "(keep it unquantized at convert time)",
                                       file=self.checkpoint.path, tensor=prefix)
            return None
        parent, _, leaf = prefix.rpartition(".")
        merged = self.packed_modules_mapping.get(leaf)
        names = [f"{parent}.{m}" if parent else m for m in merged] if merged else None
        shard_ids = ["q", "k", "v"] if names and len(names) == 3 and is_qkv(layer) else None
        plan = self.checkpoint.plan(prefix, names, shard_ids)
        if plan is None:
            return UnquantizedLinearMethod()
        return W4PackLinearMethod(plan, precision=self.precision)


def _refuse_lora(path: str) -> None:
    """vLLM's LoRA layers wrap every linear layer of the model and look for a float ``weight`` or a GPTQ-style
    ``qweight`` on it; on a packed layer they stopped at "Unsupported base layer" deep in the worker. Say so
    before any layer is built."""
    import vllm.config

    current = getattr(vllm.config, "get_current_vllm_config_or_none", None)
    config = current() if current is not None else None
    if config is not None and getattr(config, "lora_config", None) is not None:
        raise UnsupportedError("LoRA adapters (enable_lora / --enable-lora) are not supported on packed w4pack "
                               "layers; serve the checkpoint without them, or merge the adapter into the float "
                               "model before quantizing and converting it", file=path)
