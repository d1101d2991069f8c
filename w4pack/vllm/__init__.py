"""Serve packed checkpoints with vLLM: the ``w4pack`` quantization method, registered by a vLLM plugin.

vLLM loads the plugin through the ``vllm.general_plugins`` entry point (``register`` below) in every process it
starts; after that a folder written by ``w4pack convert`` loads with ``LLM(model=folder)`` or
``python -m vllm.entrypoints.openai.api_server --model folder``, tensor parallel included. Importing this package
does not import vLLM: ``plan``, ``method`` and ``w4pack.tp`` work (and are tested) without it.
"""
from __future__ import annotations

__all__ = ["register"]

_REGISTERED = False


def register() -> None:
    """Register the ``w4pack`` quantization config with vLLM (idempotent: vLLM calls it in every process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from .plugin import W4PackConfig

    register_quantization_config("w4pack")(W4PackConfig)
    _REGISTERED = True
