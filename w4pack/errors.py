"""Exception types that map one-to-one onto the CLI's documented exit codes.

Every error a user can cause carries the file and tensor it is about, so the CLI can print one line
that says what is wrong and where, without a traceback.
"""
from __future__ import annotations

__all__ = [
    "W4PackError",
    "BadInputError",
    "UnsupportedError",
    "VerificationError",
    "IOFailure",
    "W4PackWarning",
    "EXIT_OK",
    "EXIT_VERIFY",
    "EXIT_BAD_INPUT",
    "EXIT_UNSUPPORTED",
    "EXIT_IO",
    "printable",
]

EXIT_OK = 0
EXIT_VERIFY = 1
EXIT_BAD_INPUT = 2
EXIT_UNSUPPORTED = 3
EXIT_IO = 4


class W4PackWarning(UserWarning):
    """Base class of w4pack's notices (the source contradicts itself, the output grew, a GGUF needed F32):
    ``convert`` also returns those it issued in its summary's ``warnings``, where scripts read them."""


class W4PackError(Exception):
    """Base class: a message plus optional file and tensor context."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.message = message
        self.file = None if file is None else str(file)
        self.tensor = tensor
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = []
        if self.file:
            where.append(self.file)
        if self.tensor:
            where.append(f"tensor {self.tensor}")
        prefix = ": ".join(where)
        return printable(f"{prefix}: {self.message}" if prefix else self.message)


def printable(text: str) -> str:
    """``text`` with every character that is not printable written as its escape (``\\n``, ``\\x00``,
    ``\\udcff``): a file or tensor name is the input's to choose, and a newline in one (valid in a safetensors
    header) split the one-line error in two; a lone surrogate cannot be written to a UTF-8 terminal at all."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class BadInputError(W4PackError, ValueError):
    """Malformed, truncated, inconsistent or hostile input (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class UnsupportedError(W4PackError):
    """Well-formed input that w4pack cannot represent or read (exit 3)."""

    exit_code = EXIT_UNSUPPORTED


class VerificationError(W4PackError):
    """A check ran and failed (exit 1). ``w4pack.verify`` returns its findings as a report instead of raising
    (``report.ok``); this class is for callers that turn a failed report into an exception with that status."""

    exit_code = EXIT_VERIFY


class IOFailure(W4PackError, OSError):
    """Disk or network trouble that is not the input's fault (exit 4)."""

    exit_code = EXIT_IO
