"""Progress bars (tqdm) and step messages on stderr, drawn only when stderr is a terminal unless asked for.

The bar is tqdm's (it comes with huggingface_hub): w4pack only decides whether one is drawn. By default that is
when stderr is a terminal, so logs, pipes and ``--json`` runs get no carriage-return garbage; callers pass
``enabled`` (``show_progress``) to force it either way.

Step messages cover the silent stretches around bars (opening a large source, exporting a GGUF's tokenizer):
without them a terminal shows nothing for seconds after a bar has reached its end. tqdm has no such one-line
"doing X ... 3.2s" message, so it is written here.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["Progress", "track", "step"]


class Progress:
    """A tqdm bar over ``total`` units; a no-op (tqdm's ``disable``) where it is not drawn."""

    def __init__(self, total: int, desc: str, unit: str = "", enabled: bool | None = None):
        from tqdm import tqdm

        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self._bar: Any = tqdm(total=max(total, 0), desc=desc, unit=unit.strip() or "it", file=sys.stderr,
                              disable=not self.enabled, dynamic_ncols=True, leave=True)

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

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
