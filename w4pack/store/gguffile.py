"""GGUF files opened for reading: magic check, gguf.GGUFReader (memory-mapped) and page release."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import BadInputError, UnsupportedError
from .safetensors import release_mapped

__all__ = ["gguf_module", "is_gguf", "open_gguf", "release_pages"]


def gguf_module() -> Any:
    """The gguf package (optional dependency), or UnsupportedError saying how to install it."""
    try:
        import gguf
    except ModuleNotFoundError:
        raise UnsupportedError("reading or writing GGUF needs the gguf package: pip install 'w4pack[gguf]'") from None
    return gguf


def is_gguf(path: Path) -> bool:
    """A file starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader over ``path``; whatever the gguf package raises on a bad file becomes BadInputError."""
    gguf = gguf_module()
    label = str(path)
    if not path.is_file():
        raise BadInputError("not a file (expected a .gguf file)", file=label)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise BadInputError(f"not a GGUF file (magic {magic!r})", file=label)
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError, KeyError, struct errors, ...
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "is not a valid GGMLQuantizationType" in msg:
            raise BadInputError(f"unknown tensor type ({msg}); this gguf package cannot read it",
                                file=label) from None
        raise BadInputError(f"corrupt or truncated GGUF ({type(exc).__name__}: {msg})", file=label) from None


def release_pages(reader: Any) -> None:
    """Drop the pages of the file read so far from our resident memory (the reader's np.memmap keeps every page it
    touched mapped until it is dropped)."""
    release_mapped(getattr(getattr(reader, "data", None), "_mmap", None))
