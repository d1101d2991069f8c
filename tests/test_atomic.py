"""Replacing an output (--force) never loses it, and a later run tidies what an interrupted one left (issue 30, 5).

Before: the old output was moved aside and the new one renamed in, two renames; a kill between them left no DST,
only a hidden ``.DST.w4pack-old-*``, and killed writers left ``.DST.w4pack-tmp-*`` folders nothing ever removed.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from w4pack import atomic
from w4pack.checkpoint import validate_checkpoint
from w4pack.errors import IOFailure

from test_checkpoint import write_model

TESTS = str(Path(__file__).parent)
HAS_EXCHANGE = getattr(atomic, "_renameat2", "(before the fix: run, and fail)") is not None
linux_exchange = pytest.mark.skipif(not HAS_EXCHANGE, reason="needs Linux renameat2 (runs on Linux)")


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def _make(folder: Path, tag: str, n: int = 3) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"{tag}-{i}.bin").write_text(f"{tag} {i}")
    return _files(folder)


def _dead_token() -> str:
    """The owner token of a process that has exited: what a killed writer leaves in its folders' names."""
    out = subprocess.run([sys.executable, "-c", "from w4pack import atomic; print(atomic._owner_token())"],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": _pythonpath()})
    return out.stdout.strip()


def _pythonpath() -> str:
    root = str(Path(atomic.__file__).parent.parent)
    return os.pathsep.join([root, TESTS, os.environ.get("PYTHONPATH", "")])


# -- the swap itself --------------------------------------------------------------------------------------------
@linux_exchange
def test_force_replacement_is_one_exchange_not_two_renames(tmp_path, monkeypatch):
    """No rename at all: the finished folder and the old output swap places in one system call."""
    dst = tmp_path / "dst"
    _make(dst, "old")
    tmp = atomic.make_temp_dir(dst)
    new = _make(tmp, "new")

    def no_rename(*args, **kw):
        raise AssertionError("os.replace called: the replacement is not atomic")

    monkeypatch.setattr(os, "replace", no_rename)
    monkeypatch.setattr(os, "rename", no_rename)
    atomic.move_into_place(tmp, dst, force=True)
    assert _files(dst) == new and _siblings(tmp_path) == ["dst"]


@linux_exchange
def test_exchange_swaps_files_links_and_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").write_text("file")
    (tmp_path / "c").symlink_to("nowhere")
    assert atomic.exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a").read_text() == "file" and (tmp_path / "b").is_dir()
    assert atomic.exchange(tmp_path / "c", tmp_path / "a")
    assert os.readlink(tmp_path / "a") == "nowhere" and (tmp_path / "c").read_text() == "file"
    with pytest.raises(FileNotFoundError):
        atomic.exchange(tmp_path / "missing", tmp_path / "b")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="the raw system call number is known for x86-64 and aarch64")
def test_exchange_through_the_raw_system_call(tmp_path, monkeypatch):
    """Where glibc has no renameat2 wrapper (before 2.28), the system call itself."""
    monkeypatch.setattr(atomic, "_renameat2", atomic._load_renameat2(wrapper=False))
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").mkdir()
    assert atomic.exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").read_text() == "a"
    with pytest.raises(FileNotFoundError):
        atomic.exchange(tmp_path / "missing", tmp_path / "b")


@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, None])
def test_fallback_where_the_exchange_is_unavailable(tmp_path, monkeypatch, err):
    """A filesystem that refuses RENAME_EXCHANGE (EINVAL, ENOSYS, EOPNOTSUPP), or no renameat2 at all (another
    OS): the old output is moved aside, the new one renamed in, the old one deleted."""
    def refusing(a: bytes, b: bytes, flags: int) -> int:
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(atomic, "_renameat2", None if err is None else refusing, raising=False)
    calls = []
    real_replace = os.replace

    def spy(a, b):
        calls.append((Path(a).name, Path(b).name))
        return real_replace(a, b)

    monkeypatch.setattr(atomic.os, "replace", spy)
    dst = tmp_path / "dst"
    _make(dst, "old")
    tmp = atomic.make_temp_dir(dst)
    new = _make(tmp, "new")
    assert not atomic.exchange(tmp, dst)
    atomic.move_into_place(tmp, dst, force=True)
    assert _files(dst) == new and _siblings(tmp_path) == ["dst"]
    assert [b for _a, b in calls] == ["x", "dst"] and calls[0][0] == "dst"  # aside, then in


def test_exchange_failing_otherwise_changes_nothing(tmp_path, monkeypatch):
    """Any other error (EIO, EACCES...) is the writer's error: the old output stays, unchanged."""
    def failing(a: bytes, b: bytes, flags: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(atomic, "_renameat2", failing, raising=False)
    dst = tmp_path / "dst"
    old = _make(dst, "old")
    with pytest.raises(IOFailure, match="Input/output error"):
        with atomic.AtomicFolder(dst, force=True) as tmp:
            _make(tmp, "new")
    assert _files(dst) == old and _siblings(tmp_path) == ["dst"]


# -- kill -9 at each step of the replacement --------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from w4pack import atomic
    mode, step, when, dst = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    if mode == "two-renames":
        atomic._renameat2 = None
    seen = {}

    def hook(obj, name, label, match=lambda *a: True):
        real = getattr(obj, name)

        def wrapped(*args, **kw):
            hit = label == step and match(*args)
            if hit:
                seen[label] = seen.get(label, 0) + 1
            if hit and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            out = real(*args, **kw)
            if hit and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        setattr(obj, name, wrapped)

    if hasattr(atomic, "exchange"):
        hook(atomic, "exchange", "exchange")
    hook(os, "replace", "aside", lambda a, b: Path(a) == dst)
    hook(os, "replace", "rename-in", lambda a, b: Path(b) == dst)
    hook(os, "unlink", "delete-old", lambda name, *a, **k: str(name).startswith("old-1"))
    with atomic.AtomicFolder(dst, force=True) as tmp:
        for i in range(3):
            (tmp / f"new-{i}.bin").write_text(f"new {i}")
    print("finished", flush=True)
""")

STEPS = [("exchange", "before"), ("exchange", "after"), ("delete-old", "before"), ("delete-old", "after")]
FALLBACK_STEPS = [("aside", "before"), ("aside", "after"), ("rename-in", "before"), ("rename-in", "after"),
                  ("delete-old", "after")]


def _kill_at(tmp_path: Path, mode: str, step: str, when: str) -> tuple[Path, dict, dict]:
    dst = tmp_path / "dst"
    old = _make(dst, "old")
    new = {f"new-{i}.bin": f"new {i}" for i in range(3)}
    (tmp_path.parent / f"{tmp_path.name}-child.py").write_text(CHILD)
    proc = subprocess.run([sys.executable, str(tmp_path.parent / f"{tmp_path.name}-child.py"), mode, step, when,
                           str(dst)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _pythonpath()})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    return dst, old, new


@linux_exchange
@pytest.mark.parametrize("step,when", STEPS)
def test_kill_at_any_step_of_the_exchange_leaves_old_or_new_output(tmp_path, step, when):
    dst, old, new = _kill_at(tmp_path, "exchange", step, when)
    assert _files(dst) in (old, new)  # never missing, never a mix
    assert _files(dst) == (old if (step, when) == ("exchange", "before") else new)
    leftovers = [p for p in _siblings(tmp_path) if p != "dst"]
    assert leftovers and all(p.startswith(".dst.w4pack-tmp-") for p in leftovers)
    # the next run finds what the dead writer left, removes it, and writes
    with atomic.AtomicFolder(dst, force=True) as tmp:
        _make(tmp, "third")
    assert _siblings(tmp_path) == ["dst"] and sorted(_files(dst)) == ["third-0.bin", "third-1.bin", "third-2.bin"]


@pytest.mark.parametrize("step,when", FALLBACK_STEPS)
def test_kill_during_the_two_rename_fallback_is_restored_by_the_next_run(tmp_path, step, when):
    """Without the exchange a kill between the renames leaves no DST for a moment; the next run puts the old
    output back (even a run that only checks the output), then tidies."""
    dst, old, new = _kill_at(tmp_path, "two-renames", step, when)
    between = (step, when) in (("aside", "after"), ("rename-in", "before"))
    assert dst.exists() != between
    atomic.check_output(dst, force=True)  # restores, removes nothing
    assert _files(dst) == (new if step == "delete-old" or (step, when) == ("rename-in", "after") else old)
    with atomic.AtomicFolder(dst, force=True) as tmp:
        _make(tmp, "third")
    assert _siblings(tmp_path) == ["dst"]


MID_WRITE = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from w4pack import atomic
    with atomic.AtomicFolder(Path(sys.argv[1]), force=True) as tmp:
        (tmp / "part-0.bin").write_bytes(b"x" * 100_000)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_writer_killed_mid_write_is_tidied_by_the_next_run(tmp_path):
    """Before: the killed writer's ``.DST.w4pack-tmp-*`` stayed forever (10 of 23 kill -9 trials, up to 211 MB)."""
    dst = tmp_path / "dst"
    old = _make(dst, "old")
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", MID_WRITE, str(dst)], env={**os.environ,
                              "PYTHONPATH": _pythonpath()})
        assert proc.returncode == -signal.SIGKILL
    assert _files(dst) == old and len(_siblings(tmp_path)) == 2  # the second run removed the first one's
    with atomic.AtomicFolder(dst, force=True) as tmp:
        _make(tmp, "new")
    assert sorted(_files(dst)) == ["new-0.bin", "new-1.bin", "new-2.bin"] and _siblings(tmp_path) == ["dst"]


# -- recovery: what is ours, whose it is ----------------------------------------------------------------------
def test_dead_writers_leftovers_are_removed_live_and_foreign_ones_kept(tmp_path, capfd):
    dst = tmp_path / "dst"
    dst.mkdir()  # DST present: the dead run's old copy is not restored, it goes
    dead = _dead_token()
    host = atomic._identity()[2]
    gone_tmp = tmp_path / f".dst.w4pack-tmp-{dead}-abcd1234"
    gone_pull = tmp_path / f".dst.w4pack-pull-{dead}-abcd1234"
    gone_old = tmp_path / f".dst.w4pack-old-{dead}-abcd1234"
    for p in (gone_tmp, gone_pull):
        _make(p, "junk")
    _make(gone_old / "x", "old")
    mine = atomic.make_temp_dir(dst)  # a live writer: this process
    keep = {
        "legacy": tmp_path / ".dst.w4pack-tmp-abcd1234",  # made before owners were recorded: owner unknown
        "other_dst": tmp_path / f".dst2.w4pack-tmp-{dead}-abcd1234",
        "other_name": tmp_path / f".dst.w4pack-tmp-{dead}-abcd1234.bak",
        "not_ours": tmp_path / f"dst.w4pack-tmp-{dead}-abcd1234",
        "other_host": tmp_path / f".dst.w4pack-tmp-{dead.rsplit('.', 1)[0]}.{'0000' if host == 'ffff' else 'ffff'}"
                                 f"{dead[-8:]}-abcd1234",
    }
    for p in keep.values():
        _make(p, "keep")
    target = tmp_path / "elsewhere"
    _make(target, "precious")
    link = tmp_path / f".dst.w4pack-tmp-{dead}-link1234"
    link.symlink_to(target)  # a name of ours that is a link: never followed, never removed
    with atomic.AtomicFolder(dst, force=True) as tmp:
        _make(tmp, "new")
    err = capfd.readouterr().err
    for p in (gone_tmp, gone_pull, gone_old):
        assert not p.exists() and f"removed {p}" in err
    assert mine.is_dir() and link.is_symlink() and _files(target)["precious-0.bin"] == "precious 0"
    assert all(p.is_dir() for p in keep.values())
    assert f"left alone: {keep['legacy']}" in err and f"left alone: {keep['other_host']}" in err
    assert str(mine) not in err  # this process's own folder is no other run's
    assert sorted(_files(dst)) == ["new-0.bin", "new-1.bin", "new-2.bin"]


LIVE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from w4pack import atomic
    tmp = atomic.make_temp_dir(Path(sys.argv[1]))
    (tmp / "part.bin").write_text("being written")
    print(tmp, flush=True)
    time.sleep(120)
""")


def test_live_writers_temporary_folder_is_left_alone(tmp_path, capfd):
    """Another process writing the same DST right now: its folder stays, named on stderr (FORMAT rule 4; it was
    not named); once it is killed, the next run removes it (a reused PID would not fool the check: the start time
    is in the name too)."""
    dst = tmp_path / "dst"
    proc = subprocess.Popen([sys.executable, "-c", LIVE, str(dst)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": _pythonpath()})
    try:
        theirs = Path(proc.stdout.readline().strip())
        assert theirs.name.startswith(f".dst.w4pack-tmp-{proc.pid}.")
        capfd.readouterr()
        with atomic.AtomicFolder(dst) as tmp:
            _make(tmp, "new")
        assert (theirs / "part.bin").is_file()
        assert f"left alone: {theirs}, being written by another w4pack run" in capfd.readouterr().err
    finally:
        proc.kill()
        proc.wait()
    with atomic.AtomicFolder(dst, force=True) as tmp:
        _make(tmp, "newer")
    assert not theirs.exists() and _siblings(tmp_path) == ["dst"]


def test_output_lost_by_the_old_two_renames_is_restored_without_force(tmp_path):
    """What today's code leaves after a kill between its renames (DST gone, the output in a legacy
    ``.DST.w4pack-old-XXXXXXXX/x``): the next run puts it back and then, without --force, refuses to replace it."""
    dst = tmp_path / "dst"
    old = _make(tmp_path / ".dst.w4pack-old-q1w2e3r4" / "x", "old")
    with pytest.raises(IOFailure, match="already exists"):
        atomic.AtomicFolder(dst)
    assert _files(dst) == old and _siblings(tmp_path) == ["dst"]


def test_recovery_never_fails_the_run(tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    _make(tmp_path / f".dst.w4pack-tmp-{_dead_token()}-abcd1234", "junk")
    monkeypatch.setattr(atomic, "_clean", lambda found: (_ for _ in ()).throw(PermissionError(13, "denied")),
                        raising=False)
    notes = atomic.recover(dst)
    assert notes and "could not tidy" in notes[0]


# -- through the CLI -------------------------------------------------------------------------------------------
def _cli(*args: str, hook: str = "") -> subprocess.CompletedProcess:
    code = f"import sys; from w4pack import atomic\n{hook}\nfrom w4pack.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": _pythonpath()})


KILL_AFTER_SWAP = """
import os, signal
def _die_after(real):  # (any implementation: killed right after the first step that moves DST)
    def step(a, b, *rest, **kw):
        out = real(a, b, *rest, **kw)
        if "dst" in (os.path.basename(str(a)), os.path.basename(str(b))):
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return step
os.replace = _die_after(os.replace)
if hasattr(atomic, "exchange"):
    atomic.exchange = _die_after(atomic.exchange)
"""

KILL_BETWEEN_RENAMES = """
import os, signal
atomic._renameat2 = None
_real = os.replace
def _aside_then_die(a, b):
    _real(a, b)
    if os.path.basename(b) == "x":
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = _aside_then_die
"""


@pytest.mark.parametrize("hook", ["swap", "two-renames"])
def test_cli_convert_force_killed_mid_replacement_loses_nothing(tmp_path, hook):
    src_a, src_b, dst = tmp_path / "a", tmp_path / "b", tmp_path / "dst"
    write_model(src_a, seed=1)
    write_model(src_b, seed=2)
    proc = _cli("convert", str(src_a), str(dst))
    assert proc.returncode == 0, proc.stderr
    first = (dst / "w4pack.json").read_bytes()
    if hook == "swap" and not HAS_EXCHANGE:
        pytest.skip("needs Linux renameat2 (runs on Linux)")
    proc = _cli("convert", str(src_b), str(dst), "--force",
                hook=KILL_AFTER_SWAP if hook == "swap" else KILL_BETWEEN_RENAMES)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if hook == "swap":
        validate_checkpoint(dst)  # the new output, complete; the old one half-deleted or not at the hidden name
        second = (dst / "w4pack.json").read_bytes()
        assert second != first
    else:
        assert not dst.exists()  # the fallback's window: the next run restores it
        proc = _cli("validate", str(dst))
        assert proc.returncode == 2
        proc = _cli("convert", str(src_b), str(dst))  # no --force: restored, then refused
        assert proc.returncode == 4 and "already exists" in proc.stderr and "restored the previous output" \
            in proc.stderr, proc.stderr
        assert (dst / "w4pack.json").read_bytes() == first
        validate_checkpoint(dst)
    assert any(p.startswith(".dst.w4pack-tmp-") for p in _siblings(tmp_path))  # the dead run's folder
    proc = _cli("convert", str(src_a), str(dst), "--force")
    assert proc.returncode == 0, proc.stderr
    assert _siblings(tmp_path) == ["a", "b", "dst"]  # the dead run's leftovers are gone
    validate_checkpoint(dst)


def test_force_does_not_replace_a_folder_that_holds_no_checkpoint(tmp_path, monkeypatch):
    """--force deleted a folder of notes and photos wholesale, and "convert SRC . --force" the working folder (a
    reviewer's runs): it replaces earlier outputs, not any folder."""
    foreign = tmp_path / "notes"
    (foreign / "photos").mkdir(parents=True)
    (foreign / "keep.txt").write_text("keep")
    with pytest.raises(IOFailure, match=r"holds no checkpoint \(keep.txt, photos\)"):
        atomic.check_output(foreign, force=True)
    assert (foreign / "keep.txt").read_text() == "keep"
    monkeypatch.chdir(foreign / "photos")
    with pytest.raises(IOFailure, match="is the current folder or holds it"):
        atomic.check_output(foreign, force=True)
    with pytest.raises(IOFailure, match="is the current folder or holds it"):
        atomic.check_output(Path("."), force=True)
    # what --force is for: an earlier output, an empty folder, a model folder
    write_model(tmp_path / "ck")
    empty = tmp_path / "empty"
    empty.mkdir()
    hf = tmp_path / "hf"
    (hf / "original").mkdir(parents=True)
    (hf / ".cache" / "huggingface").mkdir(parents=True)
    for name in ("config.json", "README.md", "model.safetensors", "original/consolidated.00.pth",
                 "original/params.json", "original/tokenizer.model", ".cache/huggingface/model.safetensors.lock"):
        (hf / name).write_text("x")
    for ok in (tmp_path / "ck", empty, hf):
        atomic.check_output(ok, force=True)


@pytest.mark.parametrize("files,says", [
    ({"config.json": "{}", "src/train.py": "code", "NOTES.md": "n"},
     r"holds no checkpoint \(NOTES.md, config.json, src\)"),
    ({"results.npy": "1", "thesis.tex": "t"}, r"holds no checkpoint \(results.npy, thesis.tex\)"),
    ({"config.json": "{}", "model.safetensors": "w", "src/train.py": "code"},
     r"holds src/train.py, which no checkpoint"),
    ({"model.safetensors": "w", ".git/HEAD": "ref: refs/heads/main"}, r"holds .git/HEAD, which no checkpoint"),
])
def test_force_does_not_replace_a_project_folder(tmp_path, files, says):
    """A reviewer's --force runs deleted a project folder that held a config.json beside its code, and one that
    held a .npy beside a thesis: a folder is an earlier output only when it holds weights, tables or a manifest,
    and its subfolders only what model folders hold."""
    dst = tmp_path / "proj"
    for name, text in files.items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_text(text)
    with pytest.raises(IOFailure, match=says):
        atomic.check_output(dst, force=True)
    assert all((dst / name).read_text() == text for name, text in files.items())


def test_force_does_not_replace_a_file_with_a_folder_or_a_foreign_file(tmp_path):
    """``convert SRC notes.txt --force`` replaced the user's file with a checkpoint folder, and ``--to gguf
    --force`` any file: a folder output replaces no file; a GGUF output only a GGUF file or an empty one."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(IOFailure, match="is a file, not an earlier checkpoint folder"):
        atomic.check_output(notes, force=True)
    gguf = (b"GGUF", "GGUF file")
    with pytest.raises(IOFailure, match=r"is not a GGUF file \(it does not start with b'GGUF'\)"):
        atomic.check_output(notes, force=True, magic=gguf)
    assert notes.read_text() == "my notes"
    earlier, blank = tmp_path / "earlier.gguf", tmp_path / "blank.gguf"
    earlier.write_bytes(b"GGUF\x03\x00\x00\x00")
    blank.write_bytes(b"")
    for ok in (earlier, blank):
        atomic.check_output(ok, force=True, magic=gguf)
    link = tmp_path / "link"
    link.symlink_to(notes)  # the link itself is replaced, never what it points to
    atomic.check_output(link, force=True)
    atomic.check_output(link, force=True, magic=gguf)
