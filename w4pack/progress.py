"""A dependency-free progress bar and step messages on stderr, drawn only when stderr is a terminal.

Step messages cover the silent stretches around bars (opening a large source, exporting a GGUF's tokenizer):
without them a terminal shows nothing for seconds after a bar has reached its end.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["Progress", "track", "step"]


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


@contextmanager
def step(desc: str, enabled: bool | None = None, live: bool = False) -> Iterator[None]:
    """``desc ...`` on stderr while the block runs, then ``desc: 3.2s`` on the same line (terminal only).

    ``live`` redraws the elapsed seconds twice a second from a thread, for steps long enough that a still line
    looks like a hang (loading a model).
    """
    on = sys.stderr.isatty() if enabled is None else enabled
    t0 = time.monotonic()
    done = threading.Event()
    ticker = None
    if on:
        sys.stderr.write(f"{desc} ...")
        sys.stderr.flush()
        if live:
            def tick() -> None:
                while not done.wait(0.5):
                    sys.stderr.write(f"\r{desc} ... {time.monotonic() - t0:.0f}s\033[K")
                    sys.stderr.flush()

            ticker = threading.Thread(target=tick, name="w4pack-step", daemon=True)
            ticker.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        if ticker is not None:
            ticker.join()
        if on:
            sys.stderr.write(f"\r{desc}: {time.monotonic() - t0:.1f}s{'' if ok else ' (stopped)'}\033[K\n")
            sys.stderr.flush()
