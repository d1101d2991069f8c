"""A private temporary folder for files a reader makes up (side files built from a GGUF's metadata).

Readers under ``formats/`` never create files; they hand documents to a ScratchFolder. It is removed by
``close()``, or when its owner is garbage-collected without one, so a failed conversion leaves nothing in /tmp.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

__all__ = ["ScratchFolder", "read_text"]


class ScratchFolder:
    """``path`` is created on first use; ``write_text``/``write_json`` put a file in it; ``files()`` lists them."""

    def __init__(self, prefix: str = "w4pack-"):
        self._prefix = prefix
        self._path: Path | None = None
        self._cleanup: weakref.finalize | None = None

    @property
    def path(self) -> Path:
        """The folder (created now if it does not exist yet): a tool that writes files itself (a tokenizer's
        ``save_pretrained``) is pointed here."""
        if self._path is None:
            self._path = Path(tempfile.mkdtemp(prefix=self._prefix))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._path), True)
        return self._path

    def write_text(self, name: str, text: str) -> Path:
        p = self.path / name
        p.write_text(text, encoding="utf-8")
        return p

    def write_json(self, name: str, doc: Any, indent: int | None = None) -> Path:
        return self.write_text(name, json.dumps(doc, ensure_ascii=False, indent=indent) + "\n")

    def files(self) -> list[Path]:
        """The plain files in the folder, sorted by name."""
        if self._path is None:
            return []
        return sorted(p for p in self._path.iterdir() if p.is_file())

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()
        self._path = None
        self._cleanup = None


def read_text(path: Path) -> str:
    """A UTF-8 text side file (a chat template); unreadable or not UTF-8 is bad input naming the file."""
    from ..errors import BadInputError

    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInputError(f"not UTF-8 text: {exc.reason}", file=str(path)) from None
    except OSError as exc:
        raise BadInputError(f"cannot read: {exc.strerror or exc}", file=str(path)) from None
