"""w4pack.fuse: a --fuse'd checkpoint converted to a format that stores no fusion is written as its original layers
(q/k/v, gate/up), which that format's loaders build; the fused names would be layers the model does not have."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from w4pack.cli import main
from w4pack.core.canonical import CanonicalLayer
from w4pack.fuse import fuse_layers, split_fused

REPO = Path(__file__).resolve().parent.parent
QUANTS = REPO / "tests" / "data" / "llama_quantize"


def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> int:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    assert rc == 0, capsys.readouterr().err
    return rc


def test_split_fused_gives_back_the_parts() -> None:
    rng = np.random.default_rng(3)
    parts = [CanonicalLayer(codes=rng.integers(0, 16, (n, 64), dtype=np.uint8),
                            scales=rng.random((n, 2)).astype(np.float16), bits=4, group_size=32, zero_mode="int",
                            zeros=rng.integers(0, 16, (n, 2)).astype(np.int32),
                            bias=rng.random(n).astype(np.float16), name=f"p{i}")
             for i, n in enumerate((32, 16, 16))]
    fused, rows = fuse_layers("qkv", parts)
    for part, entry in zip(parts, rows):
        back = split_fused(fused, entry["name"], entry["rows"])
        assert back.name == part.name and back.differences(part) == []


@pytest.mark.parametrize("target", ["gptq", "awq", "compressed-tensors", "toml"])
def test_fused_checkpoint_converts_to_its_original_layers(target: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from w4pack.sources import open_source

    src = tmp_path / "gptq"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_checkpoint.py"), str(src)], check=True,
                   capture_output=True)
    _cli(capsys, "convert", src, tmp_path / "fused", "--fuse", "qkv,gate-up")
    _cli(capsys, "convert", tmp_path / "fused", tmp_path / "out", "--to", target)
    with open_source(src) as a, open_source(tmp_path / "out") as b:
        assert sorted(b.layer_names()) == sorted(a.layer_names())
        assert not [n for n in b.layer_names() if n.endswith(("qkv_proj", "gate_up_proj"))]
        for name in a.layer_names():
            assert b.read_layer(name).differences(a.read_layer(name)) == [], name
    _cli(capsys, "verify", tmp_path / "fused", "--against", tmp_path / "out")  # part by part


def test_fused_gguf_round_trip_is_byte_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's own file, fused on the way in, comes back byte for byte (it came back with fused tensors)."""
    pytest.importorskip("gguf", reason="install the gguf package: pip install -e '.[test]'")
    gguf = QUANTS / "tiny-IQ4_NL.gguf"
    _cli(capsys, "convert", gguf, tmp_path / "fused", "--fuse", "qkv,gate-up")
    _cli(capsys, "convert", tmp_path / "fused", tmp_path / "back.gguf", "--to", "gguf")
    assert (tmp_path / "back.gguf").read_bytes() == gguf.read_bytes()
