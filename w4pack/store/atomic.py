"""Write a folder atomically: build it in a temporary sibling, then rename it into place.

Format writers (GPTQ, AWQ, ...) use this so that no output folder ever looks complete before it is,
and an existing folder is replaced only with force. The helpers below are shared with w4pack's own
``CheckpointWriter`` and the GGUF writer: the output check, the temporary folder (with the mode ``mkdir``
would give), the rename into place, and a write error that names the file and says when the disk is full.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import IOFailure, W4PackError

__all__ = ["AtomicFolder", "write_json_atomic", "check_output", "make_temp_dir", "move_into_place",
           "write_failure", "is_disk_full", "output_of", "umask_mode"]

MARKER = ".w4pack-incomplete"
_TMP_TAG = ".w4pack-tmp-"


def umask_mode(mode: int = 0o777) -> int:
    """``mode`` less the process umask: what ``mkdir``/``open`` would give (mkdtemp/mkstemp always give 0700/0600).

    Read from /proc where it can be, as setting the umask to read it is not thread-safe."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return mode & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mode & ~mask


def check_output(target: Path, force: bool) -> None:
    """Refuse an existing output without force, before any work. A dangling symbolic link counts as existing:
    renaming the finished folder over it fails only at the very end ("Not a directory")."""
    if not os.path.lexists(target) or force:
        return
    if target.is_symlink() and not target.exists():
        raise IOFailure(f"output is a symbolic link to {os.readlink(target)!r}, which does not exist; remove the "
                        "link or choose another output (--force replaces the link itself)", file=str(target))
    raise IOFailure("output already exists; pass --force (force=True) to replace it", file=str(target))


def make_temp_dir(target: Path, tag: str = "tmp") -> Path:
    """A new empty sibling folder of ``target`` that becomes ``target`` when renamed: with the umask-derived mode a
    plain ``mkdir`` gives, not mkdtemp's 0700, so that the finished output is readable like any other folder."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.w4pack-{tag}-", dir=target.parent))
    try:
        os.chmod(tmp, umask_mode(0o777))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def move_into_place(tmp: Path, target: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``target``. An existing target (only with force) is moved aside first and put
    back if the rename fails or is interrupted, so a failure never loses the previous output."""
    old: Path | None = None
    moved = False
    try:
        if os.path.lexists(target):
            if not force:
                raise IOFailure("output appeared while writing; not replacing it without --force", file=str(target))
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.w4pack-old-", dir=target.parent))
            os.replace(target, old / "x")
        os.replace(tmp, target)
        moved = True
    except BaseException:
        moved = moved or not os.path.lexists(tmp)  # (an interrupt can land between the rename and the flag)
        if old is not None and not moved:
            with contextlib.suppress(OSError):
                if os.path.lexists(old / "x") and not os.path.lexists(target):
                    os.replace(old / "x", target)
                os.rmdir(old)
        if not moved:
            raise
        # (interrupted after the rename: the new output is complete; the old one still goes, below)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def output_of(path: Path) -> Path:
    """Where a path in a temporary folder will be: ``.NAME.w4pack-tmp-XXXX/f`` -> ``NAME/f``; error messages name
    that, not a hidden folder that is gone by the time the user reads them."""
    for p in (path, *path.parents):
        m = re.fullmatch(r"\.(.+)" + re.escape(_TMP_TAG) + r"[^/]*", p.name)
        if m:
            return p.parent / m.group(1) / path.relative_to(p)
    return path


_SHORT_WRITE = re.compile(r"^\d+ requested and \d+ written$")  # numpy's tofile on a short write (no errno)


def write_failure(exc: OSError, file: str | os.PathLike[str], what: str = "cannot write",
                  tensor: str | None = None) -> IOFailure:
    """An IOFailure for a failed write to ``file`` that says plainly when the disk is full (ENOSPC, a quota, or a
    short write, which numpy reports only as "N requested and M written")."""
    if isinstance(exc, W4PackError):
        return exc  # type: ignore[return-value]
    if exc.errno == errno.EDQUOT:
        reason = "the disk quota is exceeded"
    elif is_disk_full(exc):
        reason = "the disk is full (no space left on device)"
    else:
        reason = exc.strerror or str(exc)
    return IOFailure(f"{what}: {reason}", file=str(file), tensor=tensor)


def is_disk_full(exc: BaseException) -> bool:
    """A write that failed for lack of space: ENOSPC, a quota, or numpy's short-write message (no errno)."""
    return isinstance(exc, OSError) and not isinstance(exc, W4PackError) and \
        (exc.errno in (errno.ENOSPC, errno.EDQUOT) or bool(_SHORT_WRITE.match(str(exc))))


class AtomicFolder:
    """``with AtomicFolder(out, force) as tmp: write files into tmp`` — renamed to ``out`` on success; on any failure
    (an interrupt included) the temporary folder is removed."""

    def __init__(self, target: str | os.PathLike[str], force: bool = False):
        self.target = Path(target).absolute()
        self.force = force
        check_output(self.target, force)
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = make_temp_dir(self.target)
            (self.tmp / MARKER).write_text("incomplete\n")
        except OSError as exc:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise write_failure(exc, self.target.parent, "cannot create a temporary folder") from None
        return self.tmp

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if is_disk_full(exc):  # a writer's own write (a side file, a JSON document) on a full disk
                name = getattr(exc, "filename", None)
                raise write_failure(exc, output_of(Path(name)) if name else self.target) from None
            return
        try:
            for p in self.tmp.iterdir():
                if p.is_file() and p.name != MARKER:
                    with open(p, "rb") as fh:
                        os.fsync(fh.fileno())
            os.unlink(self.tmp / MARKER)
            move_into_place(self.tmp, self.target, self.force)
        except BaseException as err:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(err, OSError) and not isinstance(err, W4PackError):
                raise write_failure(err, self.target, "cannot move the finished output into place") from None
            raise


def write_json_atomic(path: Path, doc: Any) -> None:
    import json

    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
