"""Write a folder atomically: build it in a temporary sibling, then rename it into place.

Format writers (GPTQ, AWQ, ...) use this so that no output folder ever looks complete before it is,
and an existing folder is replaced only with force.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .errors import IOFailure

__all__ = ["AtomicFolder", "write_json_atomic"]

MARKER = ".w4pack-incomplete"


class AtomicFolder:
    """``with AtomicFolder(out, force) as tmp: write files into tmp`` — renamed to ``out`` on success."""

    def __init__(self, target: str | os.PathLike[str], force: bool = False):
        self.target = Path(target).absolute()
        self.force = force
        if self.target.exists() and not force:
            raise IOFailure("output already exists; pass --force (force=True) to replace it", file=str(self.target))
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.w4pack-tmp-", dir=self.target.parent))
            (self.tmp / MARKER).write_text("incomplete\n")
        except OSError as exc:
            raise IOFailure(f"cannot create a temporary folder: {exc.strerror}", file=str(self.target.parent)) from None
        return self.tmp

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            for p in self.tmp.iterdir():
                if p.is_file() and p.name != MARKER:
                    with open(p, "rb") as fh:
                        os.fsync(fh.fileno())
            os.unlink(self.tmp / MARKER)
            old = None
            if self.target.exists():
                if not self.force:
                    raise IOFailure("output appeared while writing; not replacing it", file=str(self.target))
                old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.w4pack-old-", dir=self.target.parent))
                os.replace(self.target, old / "x")
            os.replace(self.tmp, self.target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise IOFailure(f"cannot move the finished output into place: {exc.strerror}",
                            file=str(self.target)) from None


def write_json_atomic(path: Path, doc: Any) -> None:
    import json

    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
