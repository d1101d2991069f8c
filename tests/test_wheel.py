"""A built wheel, installed the way a user without the Makefile installs it: a fresh venv, no C compiler anywhere on
PATH (and CC=false), binaries only. Then, from that venv and outside the repository: the native CPU extension is the
wheel's own, `w4pack convert`, `verify --against`, `run` work on a GPTQ checkpoint, and transformers'
`from_pretrained(..., device_map="cpu")` loads the packed folder in a script that never imports w4pack (the wheel's
.pth registers the quantization method; `accelerate` comes with the [hf] extra).

`make test-wheel` builds the wheel (`make wheel`) and runs this with W4PACK_WHEEL set; CI runs it after `make test`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WHEEL = os.environ.get("W4PACK_WHEEL")
REPO = Path(__file__).resolve().parent.parent
needs_wheel = pytest.mark.skipif(not WHEEL, reason="needs a built wheel: make test-wheel builds one (make wheel) and "
                                                  "runs this with W4PACK_WHEEL=dist/w4pack-...whl")
COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "x86_64-linux-gnu-gcc", "nvcc")


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def test_ci_runs_the_wheel_test() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    # after the CUDA build of `make test`, so CI's wheel is the GPU wheel and that library's packaging is tested
    assert ci.index("W4PACK_BUILD_CUDA=1 make test ") < ci.index("make test-wheel")


@needs_wheel
def test_wheel_installs_without_a_compiler_then_converts_verifies_and_runs(tmp_path: Path) -> None:
    wheel = Path(WHEEL).resolve()  # type: ignore[arg-type]
    assert wheel.is_file() and "manylinux" in wheel.name, wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bindir = venv / "bin"
    # PATH holds the venv alone: no cc/gcc/clang/nvcc; CC/CXX point at `false` for anything that asks the env
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "W4PACK_"))}
    env.update(PATH=str(bindir), CC="false", CXX="false", PIP_ONLY_BINARY=":all:", PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert not [c for c in COMPILERS if shutil.which(c, path=env["PATH"])]
    py = str(bindir / "python")
    # CPU torch first (the Makefile's pin, served by the local wheel mirror), then the wheel with its [hf] extra
    _run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], env, tmp_path)
    _run([py, "-m", "pip", "install", "-q", f"{wheel}[hf]"], env, tmp_path)

    where = _run([py, "-c", "import w4pack, w4pack._w4p_cpu as m; print(w4pack.__file__); print(m.__file__)"],
                 env, tmp_path).stdout.split()
    assert all(p.startswith(str(venv)) for p in where), where  # the wheel's files, not the checkout's

    # the peer input: a small random Llama as a 4-bit GPTQ checkpoint with a tokenizer (made by this checkout)
    src, packed = tmp_path / "src-gptq", tmp_path / "packed"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_checkpoint.py"), str(src)], check=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (src / "tokenizer.json").is_file(), "make_demo_checkpoint needs the tokenizers package for run"
    w4 = str(bindir / "w4pack")
    _run([w4, "convert", str(src), str(packed), "--json"], env, tmp_path)
    report = json.loads(_run([w4, "verify", str(packed), "--against", str(src), "--json"], env, tmp_path).stdout)
    assert report["ok"] is True, report
    out = json.loads(_run([w4, "run", str(packed), "--prompt", "hello", "--max-new-tokens", "4", "--json"],
                          env, tmp_path).stdout)
    assert 1 <= out["new_tokens"] <= 4 and len(out["token_ids"]) == out["new_tokens"], out

    code = f"""
import json, sys
from transformers import AutoModelForCausalLM
assert "w4pack" not in sys.modules
model = AutoModelForCausalLM.from_pretrained({str(packed)!r}, device_map="cpu")
names = json.load(open({str(packed / 'w4pack.json')!r}))["layers"]
print(sorted({{type(model.get_submodule(n)).__name__ for n in names}}))
"""
    kinds = _run([py, "-c", code], env, tmp_path).stdout.strip().splitlines()[-1]
    assert kinds == "['W4Linear']", kinds
