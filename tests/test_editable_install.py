"""An editable install (`pip install -e .`, what `make test` uses) registers "w4pack" with transformers like a wheel.

The editable wheel is built from a copy of this checkout through setuptools' PEP 660 hook (what pip calls), with the
native build step stubbed out (it compiles the same extension `make native` does and is not what is tested here),
unpacked the way pip installs a wheel's root into site-packages, and that folder is then processed as a site
directory in a fresh interpreter: the autoregister hook must be live from the checkout's own module.
"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PTH = "w4pack-autoregister.pth"

BUILD = """
import sys
import setuptools.command.build_ext as be
be.build_ext.run = lambda self: None  # the CPU extension build: not under test, ~1 min on a busy machine
import setuptools.build_meta as backend
print(backend.build_editable(sys.argv[1]))
"""

CHECK = """
import site, sys
site.addsitedir(sys.argv[1])
hook = sys.modules.get("_w4pack_autoregister")
assert hook is not None, "no .pth imported the autoregister module"
assert any(isinstance(f, hook.RegisterOnImport) for f in sys.meta_path), "the finder is not on sys.meta_path"
assert "w4pack" not in sys.modules, "the .pth must not import the package at start"
print(hook.__file__)
"""


def _checkout_copy(dest: Path) -> Path:
    """The tracked and untracked-but-not-ignored files of this checkout (no build outputs), as pip would build."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=False)
    if files.returncode != 0:
        pytest.skip("needs this checkout as a git work tree (git ls-files) to copy the project from")
    for rel in files.stdout.splitlines():
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(src.read_bytes())
    return dest


def test_editable_install_carries_the_autoregister_pth(tmp_path: Path) -> None:
    pytest.importorskip("setuptools.build_meta", reason="needs setuptools (pip install setuptools) to build")
    project = _checkout_copy(tmp_path / "project")
    dist = tmp_path / "dist"
    dist.mkdir()
    proc = subprocess.run([sys.executable, "-c", BUILD, str(dist)], cwd=project, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = dist / proc.stdout.split()[-1]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert PTH in names, names  # at the wheel's root: pip puts it straight into site-packages
        assert zf.read(PTH) == (REPO / PTH).read_bytes()
        site_dir = tmp_path / "site-packages"
        zf.extractall(site_dir, [n for n in names if "/" not in n])  # the root files, as pip installs them
    # -I -S: only the editable install's site dir (no PYTHONPATH, not this environment's own w4pack install)
    check = subprocess.run([sys.executable, "-I", "-S", "-c", CHECK, str(site_dir)], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stderr[-3000:]
    assert Path(check.stdout.strip()) == project / "_w4pack_autoregister.py"  # served from the checkout, editable
