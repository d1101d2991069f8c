"""Ctrl-C before the command line's own handling is in place: one line and exit 130, never a traceback.

Importing w4pack (numpy, the checkpoint code) takes the first tenth of a second or more of every ``w4pack``
command; a KeyboardInterrupt raised there would escape as a traceback, because ``w4pack.cli.main`` (which maps
it to one line and 130) is not running yet. ``guard_startup`` (called first thing by ``w4pack/__init__``)
therefore makes SIGINT exit at once in the CLI process only, and ``main`` hands SIGINT back to Python's
KeyboardInterrupt once it can clean up after one. Nothing has been written at that point, so exiting at once
loses nothing. Library users importing w4pack keep Python's usual KeyboardInterrupt.
"""
from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["INTERRUPTED", "EXIT_INTERRUPTED", "is_cli_process", "guard_startup", "exit_now", "release"]

INTERRUPTED = "w4pack: interrupted; no output was left half-written"
EXIT_INTERRUPTED = 130


def is_cli_process() -> bool:
    """True when this interpreter was started as the w4pack command (the console script or ``python -m w4pack``)."""
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("w4pack", "w4pack.exe"):
        return True
    argv = list(getattr(sys, "orig_argv", []) or [])
    for i, arg in enumerate(argv):
        if arg in ("-mw4pack", "-mw4pack.cli") or (arg == "-m" and argv[i + 1:i + 2] in (["w4pack"], ["w4pack.cli"])):
            return True
    return False


def exit_now(signum: int, frame: FrameType | None) -> None:
    """SIGINT handler while nothing can be half-written: say so in one line and exit 130 at once."""
    try:
        os.write(2, (INTERRUPTED + "\n").encode())
    finally:
        os._exit(EXIT_INTERRUPTED)


def guard_startup() -> None:
    """Install ``exit_now`` for SIGINT, in the CLI process only, unless someone set a handler of their own."""
    try:
        if is_cli_process() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, exit_now)
    except ValueError:  # not the main thread
        pass


def release() -> None:
    """Give SIGINT back to Python's KeyboardInterrupt if ``guard_startup`` took it (``main`` is now ready)."""
    try:
        if signal.getsignal(signal.SIGINT) is exit_now:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        pass


def exit_on_interrupt() -> None:
    """From here to the end of the process (the command is done, output flushed), Ctrl-C exits at once."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, exit_now)
    except ValueError:
        pass
