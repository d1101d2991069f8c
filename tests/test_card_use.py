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
