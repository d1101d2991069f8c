"""The model card's "Use" section: how to install w4pack (it is not on the package index) and the `import w4pack`
that transformers needs before from_pretrained knows quant_method "w4pack"."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub", reason="install the test dependencies: pip install -e '.[test]'")

from hub_fixtures import make_checkpoint  # noqa: E402


def test_card_says_how_to_install_and_shows_the_import(tmp_path: Path) -> None:
    from w4pack.hub import model_card

    card = model_card(make_checkpoint(tmp_path / "tiny-w4"), repo_id="someone/tiny-w4")
    assert "pip install w4pack" not in card and "pypi.org/project/w4pack" not in card  # nothing there to install
    assert "not on the Python package index" in card and "make wheel" in card
    assert "download.pytorch.org/whl/cpu" in card  # CPU-only torch, not a 5 GB CUDA stack
    python = re.search(r"```python\n(.*?)```", card, flags=re.S)
    assert python, card
    code = python.group(1)
    assert code.index("import w4pack") < code.index("from_pretrained(")
    assert "AutoModelForCausalLM.from_pretrained('./tiny-w4')" in code
    compile(code, "card", "exec")  # the snippet is valid Python
    assert "w4pack pull someone/tiny-w4 ./tiny-w4" in card


def test_card_without_a_repository_shows_no_pull_command(tmp_path: Path) -> None:
    """convert writes the card before any repository exists: it showed `w4pack pull tiny-w4 ./tiny-w4`, which pull
    refuses (exit 2: not owner/name). Without a repository id the card starts from the local folder; push renders it
    again with the id, and the pull line appears."""
    import subprocess
    import sys

    from w4pack.cli import main
    from w4pack.hub import model_card

    folder = make_checkpoint(tmp_path / "tiny-w4")
    card = model_card(folder, name="tiny-w4")
    assert "w4pack pull" not in card and "w4pack validate ./tiny-w4" in card, card
    assert "w4pack pull someone/tiny-w4 ./tiny-w4" in model_card(folder, repo_id="someone/tiny-w4")
    repo = Path(__file__).resolve().parent.parent
    src = tmp_path / "gptq"
    subprocess.run([sys.executable, str(repo / "tools" / "make_demo_checkpoint.py"), str(src)], check=True,
                   capture_output=True)
    assert main(["convert", str(src), str(tmp_path / "packed")]) == 0
    written = (tmp_path / "packed" / "README.md").read_text()
    bash = re.search(r"```bash\n(.*?)```", written, flags=re.S)
    assert bash, written
    commands = bash.group(1).splitlines()
    assert commands == ["w4pack validate ./packed", "w4pack run ./packed --prompt 'Hello'"], written
    assert main(["validate", str(tmp_path / "packed")]) == 0
