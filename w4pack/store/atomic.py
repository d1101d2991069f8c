"""Write a folder atomically: build it in a temporary sibling, then rename it into place.

Format writers (GPTQ, AWQ, ...) use this so that no output folder ever looks complete before it is,
and an existing folder is replaced only with force. The helpers below are shared with w4pack's own
``CheckpointWriter`` and the GGUF writer: the output check, the temporary folder (with the mode ``mkdir``
would give), the rename into place, and a write error that names the file and says when the disk is full.

Replacing an existing output (``--force``) is one atomic step on Linux: ``renameat2(RENAME_EXCHANGE)`` swaps the
finished folder with the old output, and the old one (now at the temporary name) is deleted afterwards, so a kill
at any instant leaves either the old or the new output at DST. Elsewhere (or where the filesystem refuses the
exchange) the old output is moved aside first, and a kill between the two renames leaves it at
``.DST.w4pack-old-*``: every later run on the same DST puts such a copy back when DST is missing (``recover``),
and removes what a dead writer left (its temporary folder, the old output it was deleting). Our leftovers are told
apart by their names, which carry the owner: ``.DST.w4pack-TAG-PID.START.ID-XXXXXXXX`` (PID, the process's start
time in clock ticks, hashes of host name, boot id and PID namespace), so a live writer's folder is never removed.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import platform
import re
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..errors import BadInputError, IOFailure, W4PackError
from .names import MANIFEST_NAME, WEIGHT_SUFFIXES

__all__ = ["AtomicFolder", "write_json_atomic", "check_output", "make_temp_dir", "move_into_place",
           "write_failure", "is_disk_full", "output_of", "umask_mode", "recover", "exchange", "refuse_foreign_folder",
           "refuse_foreign_file", "refuse_path_below_file"]

MARKER = ".w4pack-incomplete"
_TMP_TAG = ".w4pack-tmp-"
_OLD_TAG = "old"
_RAND = r"[a-z0-9_]{8}"  # tempfile's random part


# ---------------------------------------------------------------------------------------------
# who owns a temporary folder: PID, start time, and hashes of host, boot and PID namespace
# ---------------------------------------------------------------------------------------------
def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:4]


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22); None when there is no such process
    (or no /proc). With the PID it names one process: a PID reused after the owner died has another start time."""
    line = _read_text(f"/proc/{pid}/stat")
    if not line:
        return None
    try:
        return int(line.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _identity() -> tuple[int, int, str, str, str]:
    """(pid, start, host hash, boot hash, PID-namespace hash) of this process. The boot id tells a folder left
    before a reboot (its owner is certainly gone); the namespace, one made in another container (its PIDs mean
    nothing here)."""
    pid = os.getpid()
    ns = ""
    with contextlib.suppress(OSError):
        ns = os.readlink("/proc/self/ns/pid")
    return (pid, _start_time(pid) or 0, _short_hash(socket.gethostname()),
            _short_hash(_read_text("/proc/sys/kernel/random/boot_id")), _short_hash(ns))


def _owner_token() -> str:
    pid, start, host, boot, ns = _identity()
    return f"{pid}.{start}.{host}{boot}{ns}"


def _leftover_re(target: Path) -> re.Pattern[str]:
    """Our sibling names for ``target``, exactly: ``.NAME.w4pack-TAG-`` then the owner (absent in names made by
    w4pack before owners were recorded) and tempfile's 8 random characters."""
    return re.compile(r"\." + re.escape(target.name) + r"\.w4pack-(?P<tag>[a-z]+)-"
                      r"(?:(?P<pid>\d{1,10})\.(?P<start>\d{1,20})\.(?P<id>[0-9a-f]{12})-)?" + _RAND)


def _owner_state(m: re.Match[str]) -> str:
    """``dead``, ``alive`` (another running process), ``own`` (this process) or ``unknown`` (another host or
    container, or no owner recorded: left alone)."""
    if m.group("pid") is None:
        return "unknown"
    pid, start, ident = int(m.group("pid")), int(m.group("start")), m.group("id")
    _me, _start, host, boot, ns = _identity()
    if ident[:4] != host:
        return "unknown"
    if ident[4:8] != boot:
        return "dead"  # this host, an earlier boot
    if ident[8:] != ns:
        return "unknown"
    if start and os.path.isdir("/proc/self"):
        if _start_time(pid) != start:
            return "dead"
        return "own" if pid == _me else "alive"
    try:  # no /proc: a PID that exists counts as alive (it may be reused: then the folder stays, never wrongly goes)
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except OSError:
        pass
    return "own" if pid == _me else "alive"


# ---------------------------------------------------------------------------------------------
# atomic exchange: renameat2(RENAME_EXCHANGE)
# ---------------------------------------------------------------------------------------------
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_RENAMEAT2_SYSCALL = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _load_renameat2(wrapper: bool = True) -> Callable[[bytes, bytes, int], int] | None:
    """libc's renameat2 (unless ``wrapper`` is False: tests), else the raw system call (glibc before 2.28, some
    musl builds); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None) if wrapper else None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return lambda a, b, flags: fn(_AT_FDCWD, a, _AT_FDCWD, b, flags)
    nr = _RENAMEAT2_SYSCALL.get(platform.machine().lower())
    if nr is None:
        return None
    sc = libc.syscall
    sc.restype = ctypes.c_long
    return lambda a, b, flags: sc(ctypes.c_long(nr), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(a),
                                  ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(b), ctypes.c_uint(flags))


_renameat2: Callable[[bytes, bytes, int], int] | None = _load_renameat2()


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``): True when swapped, False where
    the exchange is not available (another OS, an old kernel, a filesystem answering EINVAL/ENOSYS/EOPNOTSUPP);
    any other failure raises OSError, nothing changed."""
    if _renameat2 is None:
        return False
    if _renameat2(os.fsencode(a), os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _rename_noreplace(a: Path, b: Path) -> None:
    """Rename that never replaces what appeared at ``b`` meanwhile (a plain rename would replace an empty folder)."""
    if _renameat2 is not None:
        if _renameat2(os.fsencode(a), os.fsencode(b), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err), str(a), None, str(b))
    if os.path.lexists(b):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(b))
    os.rename(a, b)


# ---------------------------------------------------------------------------------------------
# recovery: what an interrupted run left beside DST
# ---------------------------------------------------------------------------------------------
_reported: set[str] = set()


def _note(text: str) -> None:
    """One line on stderr (the CLI's convention for notes); each leftover is reported once per process."""
    print(f"w4pack: {text}", file=sys.stderr, flush=True)


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _ours(path: Path) -> bool:
    """A real folder (not a link) of this user: nothing else is ever moved or removed."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _leftovers(target: Path) -> list[tuple[Path, str, str]]:
    """(path, tag, owner state) of every sibling named as we name ours, newest first."""
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    pat = _leftover_re(target)
    found = []
    for name in names:
        m = pat.fullmatch(name)
        if m:
            p = target.parent / name
            with contextlib.suppress(OSError):
                found.append((os.lstat(p).st_mtime, p, m.group("tag"), _owner_state(m)))
    found.sort(key=lambda t: t[0], reverse=True)
    return [(p, tag, state) for _t, p, tag, state in found]


def _restore(target: Path, found: list[tuple[Path, str, str]]) -> list[str]:
    """DST missing, and an output moved aside by a run that is not running (an unknown owner too: putting a copy
    back deletes nothing, and a live writer of old w4pack is between its renames for microseconds): the newest."""
    if os.path.lexists(target):
        return []
    for path, tag, state in found:
        if tag != _OLD_TAG or state in ("alive", "own") or not _ours(path) or not os.path.lexists(path / "x"):
            continue
        try:
            _rename_noreplace(path / "x", target)
        except FileExistsError:
            return []  # another run restored or wrote it meanwhile
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return [f"{target}: restored the previous output from {path.name} (left by an interrupted --force run)"]
    return []


def _clean(found: list[tuple[Path, str, str]]) -> list[str]:
    """Remove the leftovers of writers that are gone; name the ones left alone (another run's, or an unknown
    owner's), once."""
    notes = []
    for path, _tag, state in found:
        if not os.path.lexists(path):
            continue
        if state == "dead" and _ours(path):
            size = _size(path)
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                notes.append(f"removed {path} ({size / 1e6:.1f} MB), left by an interrupted w4pack run")
        elif state == "unknown" and str(path) not in _reported:
            _reported.add(str(path))
            notes.append(f"left alone: {path}, from an older w4pack or another machine; remove it if no w4pack "
                         "run is writing there")
        elif state == "alive" and str(path) not in _reported:
            _reported.add(str(path))
            notes.append(f"left alone: {path}, being written by another w4pack run that is still running")
    return notes


def recover(target: str | os.PathLike[str], clean: bool = True) -> list[str]:
    """Before writing ``target``: when it is missing but an interrupted replacement moved it aside, put it back;
    with ``clean``, remove the temporary folders and old copies whose writer is gone. Returns (and prints) what was
    done. Never fails the run: a leftover that cannot be handled stays, named."""
    target = Path(target).absolute()
    notes: list[str] = []
    try:
        found = _leftovers(target)
        if not found:
            return []
        notes += _restore(target, found)
        if clean:
            notes += _clean(_leftovers(target))
    except OSError as exc:
        notes.append(f"{target}: could not tidy what an interrupted run left: {exc.strerror or exc}")
    for n in notes:
        _note(n)
    return notes




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


def check_output(target: Path, force: bool, magic: tuple[bytes, str] | None = None) -> None:
    """Refuse an existing output without force, before any work. A dangling symbolic link counts as existing:
    renaming the finished folder over it fails only at the very end ("Not a directory"). An output that an
    interrupted --force run moved aside is put back first, so that it counts as existing.

    ``magic`` (the leading bytes, a name for them): the output is one file of that kind (GGUF), and --force
    replaces only an empty file or one of that kind; without it the output is a folder, and --force replaces only
    an earlier checkpoint folder, never a file (replacing deletes it, and a user's file is no earlier output)."""
    recover(target, clean=False)
    if not os.path.lexists(target):
        return
    if force:
        if target.is_symlink():
            return  # the link itself is replaced; what it points to is left alone
        if target.is_dir():
            if magic is None:
                refuse_foreign_folder(target)
            return  # (a single-file writer refuses a folder as a bad argument)
        if magic is not None and target.is_file():
            refuse_foreign_file(target, *magic)
            return
        kind = "a file" if target.is_file() else "a pipe, socket or device"
        want = f"an earlier {magic[1]}" if magic is not None else "an earlier checkpoint folder"
        raise IOFailure(f"is {kind}, not {want}: --force replaces only that, since replacing deletes what is there; "
                        "remove it yourself or choose another output path", file=str(target))
    if target.is_symlink() and not target.exists():
        raise IOFailure(f"output is a symbolic link to {os.readlink(target)!r}, which does not exist; remove the "
                        "link or choose another output (--force replaces the link itself)", file=str(target))
    raise IOFailure("output already exists; replace it with --force", file=str(target))


def refuse_foreign_file(target: Path, magic: bytes, what: str) -> None:
    """--force replaces an earlier single-file output (or an empty file), not any file."""
    try:
        with open(target, "rb") as fh:
            head = fh.read(len(magic))
    except OSError:
        return  # the writer's own attempt names what is wrong
    if head and head != magic:
        raise IOFailure(f"is not a {what} (it does not start with {magic!r}): --force replaces an earlier output, not "
                        "any file, since replacing deletes it; remove it yourself or choose another output path",
                        file=str(target))


#: a folder is an earlier output (w4pack's, a GPTQ/AWQ/compressed-tensors folder, quant tables, a model download)
#: when it holds one of these at its top (a config.json alone is also a project's, a .npy alone anyone's)
_CHECKPOINT_NAMES = frozenset({MANIFEST_NAME})
_CHECKPOINT_SUFFIXES = WEIGHT_SUFFIXES + (".safetensors.index.json", ".gguf", ".toml")
#: what a model folder's subfolders hold (a download's original/ weights, tokenizer and config files); .cache is
#: huggingface_hub's own bookkeeping in a downloaded folder
_SUBFOLDER_SUFFIXES = _CHECKPOINT_SUFFIXES + (".json", ".model", ".txt", ".md", ".npy", ".tiktoken", ".jinja")
_SUBFOLDER_ENTRIES_MAX = 10_000


def refuse_foreign_folder(target: Path) -> None:
    """--force replaces an earlier output, not any folder: refuse the folder this process works in (or one
    holding it), a non-empty folder holding no checkpoint at its top, and one whose subfolders hold files no
    model folder holds (source code, documents, a git repository): replacing deletes all of it."""
    try:
        here, there = Path.cwd().resolve(), target.resolve()
    except OSError:
        here = there = None
    if here is not None and (here == there or there in here.parents):
        raise IOFailure("is the current folder or holds it: --force would delete the folder you are working in; "
                        "choose another output path", file=str(target))
    try:
        entries = sorted(os.listdir(target))
    except OSError:
        return  # the writer's own attempt names what is wrong
    advice = ("--force replaces an earlier output, not any folder, since replacing deletes everything in it; "
              "remove it yourself or choose another output path")
    if entries and not any(e in _CHECKPOINT_NAMES or e.endswith(_CHECKPOINT_SUFFIXES) or e.startswith(".w4pack")
                           for e in entries):
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise IOFailure(f"holds no checkpoint ({shown}): {advice}", file=str(target))
    stray = _stray_in_subfolders(target, entries)
    if stray is not None:
        raise IOFailure(f"holds {stray}: {advice}", file=str(target))


def _stray_in_subfolders(target: Path, entries: list[str]) -> str | None:
    """What a subfolder of ``target`` holds that no model folder does (the first such file, relative to target),
    or None. Links are not followed (replacing removes a link, not what it points to)."""
    seen = 0
    for entry in entries:
        sub = target / entry
        if entry == ".cache" or entry.startswith(".w4pack") or sub.is_symlink() or not sub.is_dir():
            continue
        for root, dirs, files in os.walk(sub):
            dirs.sort()
            for name in sorted(files):
                if not name.endswith(_SUBFOLDER_SUFFIXES):
                    return f"{Path(root, name).relative_to(target)}, which no checkpoint holds"
            seen += len(files) + len(dirs)
            if seen > _SUBFOLDER_ENTRIES_MAX:
                return f"more than {_SUBFOLDER_ENTRIES_MAX:,} entries in its subfolders"
    return None


def refuse_path_below_file(dst: Path) -> None:
    """Refuse (bad argument, exit 2) an output path below a file (``notes.txt/out``): no folder can be made there,
    and the OS says only "File exists" or "Not a directory"."""
    for parent in dst.parents:
        if not os.path.lexists(parent):
            continue
        if parent.is_dir():
            return
        what = (f"a symbolic link to {os.readlink(parent)!r}, which does not exist" if not parent.exists()
                else "a file")
        raise BadInputError(f"is {what}, not a folder: the output {str(dst)!r} cannot be created inside it; choose "
                            "another output path", file=str(parent))


def make_temp_dir(target: Path, tag: str = "tmp") -> Path:
    """A new empty sibling folder of ``target`` that becomes ``target`` when renamed: with the umask-derived mode a
    plain ``mkdir`` gives, not mkdtemp's 0700, so that the finished output is readable like any other folder.

    Its name records this process (see the module's docstring), so that a later run can tell it from a live
    writer's; that later run is this one: what dead writers left beside ``target`` is recovered first."""
    recover(target)
    tmp = _mkdtemp_owned(target, tag)
    try:
        os.chmod(tmp, umask_mode(0o777))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _mkdtemp_owned(target: Path, tag: str) -> Path:
    """``.NAME.w4pack-TAG-OWNER-XXXXXXXX``; without the owner where that name would be too long for the
    filesystem (such a folder is then never removed by recovery, only reported)."""
    try:
        return Path(tempfile.mkdtemp(prefix=f".{target.name}.w4pack-{tag}-{_owner_token()}-", dir=target.parent))
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.w4pack-{tag}-", dir=target.parent))


def _remove(path: Path) -> None:
    """Delete what was at ``path`` (the old output after a swap): a folder, a file, or a link (itself only)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _same(path: Path, ident: tuple[int, int]) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == ident


def move_into_place(tmp: Path, target: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``target``. An existing target (only with force) is swapped with ``tmp`` in
    one step where the system can (then deleted from ``tmp``'s name, which records our PID: if we are killed
    meanwhile, the next run removes it); elsewhere it is moved aside first and put back if the rename fails or is
    interrupted, and a kill between the two renames leaves it for the next run to restore. Either way a failure
    never loses the previous output."""
    if os.path.lexists(target):
        if not force:
            raise IOFailure("output appeared while writing; not replacing it without --force", file=str(target))
        st = os.lstat(tmp)
        new = (st.st_dev, st.st_ino)
        try:
            swapped = exchange(tmp, target)
        except BaseException:
            if _same(target, new):  # (an interrupt landing just after the swap: the new output stands)
                _remove(tmp)
            raise
        if swapped:
            _remove(tmp)
            return
    _move_aside_then_rename(tmp, target, force)


def _move_aside_then_rename(tmp: Path, target: Path, force: bool) -> None:
    """The fallback where the exchange is unavailable: two renames, the old output kept aside until the second."""
    old: Path | None = None
    moved = False
    try:
        if os.path.lexists(target):
            if not force:
                raise IOFailure("output appeared while writing; not replacing it without --force", file=str(target))
            old = _mkdtemp_owned(target, _OLD_TAG)
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
