"""One output file that appears whole: written in a temporary sibling folder, then renamed into place.

The GGUF writer uses this the way folder writers use ``AtomicFolder``: an existing output is refused without
force (before any work) and replaced in one step with it (``move_into_place``: an exchange on Linux, so a kill at
any instant leaves the old or the new file at DST); the temporary folder's name records its owner, so what a
killed writer leaves is removed by the next run on the same DST; a failed write names DST, and a full disk is said
plainly. The file gets the mode ``open`` would give (umask), not mkstemp's 0600.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import BadInputError, W4PackError
from .atomic import check_output, make_temp_dir, move_into_place, umask_mode, write_failure

__all__ = ["AtomicFile"]


class AtomicFile:
    """``with AtomicFile(out, force) as tmp: write the file tmp`` — renamed to ``out`` on success; on any failure
    (an interrupt included) nothing is left. ``out`` must not be a folder."""

    def __init__(self, target: str | os.PathLike[str], force: bool = False, hint: str = "give a file path", *,
                 magic: tuple[bytes, str]):
        """``magic``: the file kind's leading bytes and name: --force replaces only an empty file or one of them."""
        self.target = Path(target).absolute()
        self.force = force
        check_output(self.target, force, magic)
        if self.target.is_dir():
            raise BadInputError(f"the output is a single file, not a folder; {hint}", file=str(target))
        self._dir: Path | None = None

    def __enter__(self) -> Path:
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self._dir = make_temp_dir(self.target)
        except OSError as exc:
            if isinstance(exc, W4PackError):
                raise
            raise write_failure(exc, self.target.parent, "cannot create a temporary folder") from None
        return self._dir / self.target.name

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._dir is not None
        tmp = self._dir / self.target.name
        if exc_type is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, W4PackError):
                # e.g. a full disk: numpy says only "73728 requested and 40608 written"
                raise write_failure(exc, self.target) from None
            return
        try:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp, umask_mode(0o666))
            move_into_place(tmp, self.target, self.force)
        except BaseException as err:
            shutil.rmtree(self._dir, ignore_errors=True)
            if isinstance(err, OSError) and not isinstance(err, W4PackError):
                raise write_failure(err, self.target, "cannot move the finished output into place") from None
            raise
        shutil.rmtree(self._dir, ignore_errors=True)


