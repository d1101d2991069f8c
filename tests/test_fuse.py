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


def test_refusal_gives_the_real_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's Q4_K_M mixes Q4_K and Q6_K in one block's q/k/v: the refusal said "act-order permutations differ
    ... different column sets" (g_idx = k // group_size differs with the group size) for layers without act-order."""
    from conftest import cli_one_line

    pytest.importorskip("gguf", reason="install the gguf package: pip install -e '.[test]'")
    src = QUANTS / "tiny-Q4_K_M.gguf"
    rc, err = cli_one_line(capsys, "convert", src, tmp_path / "e", "--fuse", "qkv")
    assert rc == 3 and f"{src}: tensor model.layers." in err and "cannot fuse" in err, err
    assert "bits differs" in err and "group_size differs" in err and "act-order" not in err, err
    assert "convert without --fuse qkv" in err and not (tmp_path / "e").exists()


def test_act_order_is_the_reason_only_with_the_same_groups() -> None:
    from rtn_helper import rtn_quantize

    from w4pack.errors import UnsupportedError

    w = np.random.default_rng(1).standard_normal((32, 128)).astype(np.float32)
    plain = rtn_quantize(w, group_size=32, name="b.q_proj")
    act1 = rtn_quantize(w, group_size=32, act_order=True, seed=1, name="b.k_proj")
    act2 = rtn_quantize(w, group_size=32, act_order=True, seed=2, name="b.v_proj")
    with pytest.raises(UnsupportedError, match="b.k_proj has act-order and b.q_proj has not: their groups along K"):
        fuse_layers("b.qkv_proj", [plain, act1, act1.replace(name="b.v_proj")])
    with pytest.raises(UnsupportedError, match=r"act-order permutations differ \(b.k_proj vs b.v_proj\)"):
        fuse_layers("b.qkv_proj", [act1, act2])
    coarse = rtn_quantize(w, group_size=64, name="b.k_proj")
    with pytest.raises(UnsupportedError) as exc:
        fuse_layers("b.qkv_proj", [plain, coarse])
    assert "group_size differs (b.q_proj: 32, b.k_proj: 64)" in str(exc.value) and "act-order" not in str(exc.value)
