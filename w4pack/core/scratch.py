"""Recycled output buffers for conversion loops (pure Python; used by layout.pack and the readers)."""
from __future__ import annotations

import sys
from contextvars import ContextVar
from typing import Any

import numpy as np

__all__ = ["ScratchPool", "PACK_POOL", "take"]


class ScratchPool:
    """Reusable output arrays for a conversion loop: one layer's arrays are recycled for a later layer once
    nothing references them any more (CPython reference counts; every numpy view and buffer export keeps
    its base alive, so a buffer still in use is never handed out). Fresh large arrays cost a page fault
    and zeroing per page, which on small VMs is slower than the packing itself."""

    def __init__(self, size: int = 4):
        self.size = size
        self._arrays: list[np.ndarray] = []

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        # references to a free buffer: the list, the loop variable and getrefcount's argument
        free = [a for a in self._arrays if sys.getrefcount(a) <= 3]
        fits = [a for a in free if a.nbytes >= nbytes]
        if fits:
            arr = min(fits, key=lambda a: a.nbytes)
        else:
            arr = np.empty(max(nbytes, 1), dtype=np.uint8)
            if len(self._arrays) < self.size:
                self._arrays.append(arr)
            elif free:  # retire the smallest free buffer for this bigger one
                small = min(free, key=lambda a: a.nbytes)
                self._arrays = [arr if a is small else a for a in self._arrays]
        del free, fits
        return arr[:nbytes].view(dt).reshape(shape)

    def clear(self) -> None:
        self._arrays.clear()


#: the pool pack() takes its qweight output from while a conversion loop has one active (write_packed)
PACK_POOL: ContextVar[ScratchPool | None] = ContextVar("w4pack_pack_pool", default=None)


def take(shape: tuple[int, ...], dtype: Any, pool: ScratchPool | None = None) -> np.ndarray:
    """An output array from ``pool``, else from the active PACK_POOL, else a fresh one."""
    pool = pool if pool is not None else PACK_POOL.get()
    return pool.take(shape, dtype) if pool is not None else np.empty(shape, dtype=dtype)
