"""Register w4pack's quantization method with transformers in every process of an environment w4pack is installed in.

Why: transformers only warns about a ``quant_method`` it does not know and then fills the quantized layers with
random weights, so a packed folder loaded with ``AutoModelForCausalLM.from_pretrained`` without ``import w4pack``
silently produced nonsense. The installed ``w4pack-autoregister.pth`` imports this module at interpreter start; it
only puts a finder on ``sys.meta_path`` (no numpy, torch or transformers import: a few microseconds). When
transformers loads its quantizer registry (``transformers.quantizers.auto``), the finder registers "w4pack" right
after that module runs, so every ``from_pretrained`` in the environment finds it.

This file is deliberately outside the ``w4pack`` package: importing the package loads numpy and the native
extension, which must not happen in every Python process. ``W4PACK_AUTOREGISTER=0`` turns the hook off.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any

TARGET = "transformers.quantizers.auto"


def _register() -> None:
    try:
        from w4pack.runtime.loading import register_transformers

        register_transformers()
    except Exception as exc:  # noqa: BLE001 - never break transformers' own import
        warnings.warn(f"w4pack could not register with transformers: {exc}", stacklevel=3)


class RegisterOnImport:
    """A meta-path finder that runs ``_register`` right after ``transformers.quantizers.auto`` is executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, RegisterOnImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            loader = spec.loader
            if loader is not None and hasattr(loader, "exec_module"):
                original = loader.exec_module

                def exec_module(module: Any, _orig: Any = original) -> None:
                    _orig(module)
                    _register()

                loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec
        return None


def install() -> None:
    """Register now if transformers' quantizer registry is already loaded, else as soon as it is (idempotent)."""
    if TARGET in sys.modules:
        _register()
        return
    if not any(isinstance(f, RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterOnImport())


def _from_pth() -> None:
    """The .pth entry point: never raises (a failing .pth line prints a traceback at every interpreter start)."""
    if os.environ.get("W4PACK_AUTOREGISTER", "1") == "0":
        return
    try:
        install()
    except Exception:  # noqa: BLE001
        pass
