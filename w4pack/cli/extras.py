"""Missing optional packages as one line naming the extra that installs them (exit 3), not "unexpected error".

A plain ``pip install .`` leaves out torch, transformers and gguf; a command that needs one used to end in
"unexpected ModuleNotFoundError ... this is a bug" (exit 2). Each command that can need an extra wraps its body
with :func:`needs_extras`, which turns that error into :class:`UnsupportedError` with the install command.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from ..errors import UnsupportedError

__all__ = ["needs_extras", "missing_module_error", "EXTRA_OF", "CORE_DEPENDENCIES"]

F = TypeVar("F", bound=Callable[..., Any])

#: top-level module -> the extra of pyproject.toml that installs it
EXTRA_OF: dict[str, str] = {
    "torch": "torch",
    "transformers": "hf",
    "tokenizers": "hf",
    "gguf": "gguf",
    "vllm": "vllm",
}

#: modules every install has (pyproject.toml's dependencies): missing means a broken install, not an extra
CORE_DEPENDENCIES = frozenset({"numpy", "safetensors", "click", "jsonschema", "cffi", "huggingface_hub", "tomli"})


def missing_module_error(exc: ModuleNotFoundError, command: str,
                         extra_for: dict[str, str] | None = None) -> UnsupportedError | None:
    """The one-line error for a missing optional or core package; None when ``exc`` is about anything else
    (a module of w4pack itself missing is a real bug and keeps its own message)."""
    root = (exc.name or "").split(".")[0]
    extras = {**EXTRA_OF, **(extra_for or {})}
    if root in extras:
        extra = extras[root]
        return UnsupportedError(f"w4pack {command} needs {root}, which is not installed: "
                                f"pip install 'w4pack[{extra}]' (or pip install -e '.[{extra}]' in a checkout)")
    if root in CORE_DEPENDENCIES:
        return UnsupportedError(f"w4pack {command} needs {root}, a dependency of w4pack that is missing from this "
                                "environment: reinstall w4pack (pip install . in a checkout)")
    return None


def needs_extras(command: str, **extra_for: str) -> Callable[[F], F]:
    """Decorate a command's function: a missing optional package becomes exit 3 naming the extra.

    ``extra_for`` overrides which extra to name for a module (``run`` names ``hf`` for torch, since it needs
    transformers too).
    """
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except ModuleNotFoundError as exc:
                err = missing_module_error(exc, command, extra_for)
                if err is None:
                    raise
                raise err from None
        return inner  # type: ignore[return-value]
    return wrap
