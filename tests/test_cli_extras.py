"""A command that needs an optional package which is not installed says which extra installs it (exit 3).

Each case runs the CLI in a child process where the package is made unimportable (``sys.modules[name] = None``),
as on a plain ``pip install .``.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from w4pack.cli.extras import missing_module_error

REPO = Path(__file__).resolve().parent.parent


def _cli_without(module: str, *argv: str) -> tuple[int, str]:
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from w4pack.cli import main\n"
            f"sys.exit(main({list(argv)!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("module", ["torch", "transformers"])
def test_run_without_hf_extra_names_it(module: str, tmp_path: Path) -> None:
    rc, err = _cli_without(module, "run", str(tmp_path), "--prompt", "x")
    assert rc == 3, err
    assert err.count("\n") == 1 and "pip install 'w4pack[hf]'" in err and module in err
    assert "unexpected" not in err and "bug" not in err


def test_hub_source_without_huggingface_hub_is_a_broken_install(tmp_path: Path) -> None:
    rc, err = _cli_without("huggingface_hub", "convert", "hf://owner/name", str(tmp_path / "out"))
    assert rc == 3, err
    assert "huggingface_hub" in err and "reinstall w4pack" in err and err.count("\n") == 1


def test_gguf_without_gguf_extra_names_it(tmp_path: Path) -> None:
    from conftest import fixture_dir

    src = fixture_dir("gguf", "q4_0_random_in256_out128", "tensors.gguf")
    for argv in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "o")]):
        rc, err = _cli_without("gguf", *argv)
        assert rc == 3 and "pip install 'w4pack[gguf]'" in err and err.count("\n") == 1, (argv, err)


def test_a_missing_module_of_w4pack_itself_is_not_blamed_on_an_extra() -> None:
    assert missing_module_error(ModuleNotFoundError("x", name="w4pack.nothing"), "run") is None
    err = missing_module_error(ModuleNotFoundError("x", name="transformers.models"), "run")
    assert err is not None and err.exit_code == 3 and "w4pack[hf]" in err.message
