"""The README's Python example runs as written (against a checkpoint made the way `make demo` makes it)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_readme_python_example(tmp_path):
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README lost its Python example"
    src = tmp_path / "source"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_checkpoint.py"), str(src)], check=True,
                   capture_output=True)
    (tmp_path / "out").mkdir()
    subprocess.run([sys.executable, "-m", "w4pack", "convert", str(src), str(tmp_path / "out" / "demo" / "packed")],
                   check=True, capture_output=True)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in blocks:
            exec(compile(block, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)


def test_demo_input_is_a_peer_gptq_checkpoint(tmp_path):
    """`make demo` starts from a peer format (its first step used to write w4pack and print "w4pack -> w4pack")."""
    from w4pack.formats import detect

    src = tmp_path / "gptq"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_checkpoint.py"), str(src)], check=True,
                   capture_output=True)
    assert detect(src) == "gptq" and (src / "quantize_config.json").is_file() and (src / "tokenizer.json").is_file()
    demo = (REPO / "tools" / "demo.py").read_text()
    for step in ('"convert", gptq, small', '"verify", small, "--against", gptq', '"run", small',
                 '"--to", "compressed-tensors"', '"verify", small, "--against", ct'):
        assert step in demo, step
