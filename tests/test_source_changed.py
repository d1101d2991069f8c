"""A source truncated while convert reads it (a download or a rewrite in progress): exit 4 with one line
"FILE ... changed while being read", and nothing left behind, not a SIGBUS (issue 30 item 4).

The child process truncates the file right after the first tensor is read from it (a hook on the tensor store), so
the test is deterministic; it runs in a child so that a SIGBUS fails the test instead of killing pytest.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import fixture_dir

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import os, sys
from w4pack.store.tensors import TensorStore
from w4pack.cli import main

src, dst = sys.argv[1], sys.argv[2]
done = []

def hooked(method):
    real = getattr(TensorStore, method)
    def read(self, name, *args, **kwargs):
        out = real(self, name, *args, **kwargs)
        if not done:  # the first tensor is in: now the file shrinks, as a restarted download would
            done.append(self.file_of(name))
            os.truncate(self.file_of(name), 4096)
        return out
    return read

for method in ("get", "read_copy", "read_into"):
    setattr(TensorStore, method, hooked(method))
rc = main(["convert", src, dst] + sys.argv[3:])
print("truncated:", done)
sys.exit(rc)
"""


@pytest.mark.parametrize("case", ["gptq/ag_tiny_llama_b4_g64_descact_sym", "awq/tiny_llama_gemm_g128",
                                  "compressed-tensors/tiny_llama_w4a16_sym_g128",
                                  "awq/llm_awq_v1_2023_tiny_llama_g128_pt"])
@pytest.mark.parametrize("to", ["w4pack", "gptq"])
def test_convert_of_a_source_truncated_mid_run(case: str, to: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir(*case.split("/")), src)
    dst = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), "--to", to], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode >= 0, f"convert died by signal {-proc.returncode}: {proc.stderr[-500:]}"
    assert "truncated: ['" in proc.stdout, proc.stdout  # the hook ran
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr
    assert "changed while being read" in lines[0] and str(src) in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temporary folder


def test_convert_refuses_a_source_replaced_under_its_name(tmp_path: Path) -> None:
    """A pass-through tensor copied file to file (GPTQ's kernel-side copy) opens the path again: a file that now
    has another content under that name must be refused, not copied from."""
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("gptq", "ag_tiny_llama_b4_g64_descact_sym"), src)
    child = _CHILD.replace("os.truncate(self.file_of(name), 4096)",
                           "p = self.file_of(name); d = open(p, 'rb').read(); os.replace(p, p + '.old'); "
                           "open(p, 'wb').write(d[:-8] + bytes(8))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", child, str(src), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=300, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and len(lines) == 1 and "changed while being read" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if "w4pack-tmp" in p.name]


_GGUF_CHILD = r"""
import os, sys
from w4pack.store.gguffile import GGUFFile
from w4pack.cli import main

src, dst = sys.argv[1], sys.argv[2]
done = []
real = GGUFFile.data

def data(self, name):
    out = real(self, name)
    if not done:  # the first tensor is in: now the file shrinks
        done.append(str(self.path))
        os.truncate(self.path, 4096)
    return out

GGUFFile.data = data
rc = main(["convert", src, dst] + sys.argv[3:])
print("truncated:", done)
sys.exit(rc)
"""


@pytest.mark.parametrize("to", ["w4pack", "gguf"])
def test_convert_of_a_gguf_truncated_mid_run(to: str, tmp_path: Path) -> None:
    """GGUF tensors are read with pread, as safetensors ones: a shrunk file is exit 4, never a SIGBUS."""
    src = tmp_path / "src.gguf"
    shutil.copy(fixture_dir("gguf", "q4_0_exact_in512_out256") / "tensors.gguf", src)
    dst = tmp_path / ("out.gguf" if to == "gguf" else "out")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _GGUF_CHILD, str(src), str(dst), "--to", to],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode >= 0, f"convert died by signal {-proc.returncode}: {proc.stderr[-500:]}"
    assert "truncated: ['" in proc.stdout, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr
    assert "changed while being read" in lines[0] and str(src) in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


def test_gguf_open_then_truncate_then_read(tmp_path: Path) -> None:
    src = tmp_path / "t.gguf"
    shutil.copy(fixture_dir("gguf", "q4_0_exact_in512_out256") / "tensors.gguf", src)
    code = ("import os, sys\nfrom w4pack.store.gguffile import GGUFFile\nf = GGUFFile(sys.argv[1])\n"
            "name = list(f.tensors)[-1]\nos.truncate(sys.argv[1], 4096)\n"
            "try:\n    f.data(name)\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, f"died by signal {-proc.returncode}" if proc.returncode < 0 else proc.stderr
    assert proc.stdout.startswith("SourceChanged") and "changed while being read" in proc.stdout, proc.stdout
