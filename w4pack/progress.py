"""A dependency-free progress bar on stderr, drawn only when stderr is a terminal."""
from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["Progress", "track"]


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "", enabled: bool | None = None):
        self.total, self.desc, self.unit, self.n = max(total, 0), desc, unit, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0
        self._start = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.n >= self.total):
            self._last = now
            frac = self.n / self.total if self.total else 1.0
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.desc} [{bar:<30}] {self.n}/{self.total}{self.unit} "
                             f"{now - self._start:5.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def track(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    with Progress(total, desc) as bar:
        for item in items:
            yield item
            bar.update()
