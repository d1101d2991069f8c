"""Optional accelerated twins of core functions, registered by the native package.

Core (``layout``, the format decoders) stays pure numpy and is the spec: it asks here for a fast
path by name and falls back to its own code when none is registered or the fast path declines
(returns None). ``w4pack.native.cpu_pack`` registers its paths when it imports; nothing here imports
compiled code.

Registered names and signatures:

* ``"pack"``: ``(codes [N, K] uint8, perm | None, storage_bits, bits, name) -> qweight | None``;
  pad, permute and interleave into layout v1 words, raising BadInputError for codes above 2**bits-1.
* ``"gptq_unpack"``: ``(words [K*b/32, N] int32, bits, out [N, K] uint8 | None) -> codes | None``.
* ``"gptq_pack"``: ``(words [K/8, N] int32, n, k, perm | None, name) -> qweight``: 4-bit GPTQ
  words straight into layout v1 words (same bytes as ``pack`` of the unpacked codes).
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["register", "get"]

_PATHS: dict[str, Callable[..., Any]] = {}


def register(name: str, fn: Callable[..., Any]) -> None:
    _PATHS[name] = fn


def unregister(name: str) -> None:
    _PATHS.pop(name, None)


def get(name: str) -> Callable[..., Any] | None:
    return _PATHS.get(name)
