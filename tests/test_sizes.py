"""Tensor bytes (store/sizes.py): what convert's growth warning compares, so side files and headers never
count as growth, and a Hub snapshot's links count as the blobs they name."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from w4pack.convert import GrowthWarning, convert
from w4pack.store.safetensors import write_safetensors
from w4pack.store.sizes import tensor_bytes

LLAMA_Q = Path(__file__).parent / "data" / "llama_quantize" / "tiny-Q4_K_M.gguf"


def _st(path: Path, arrays: dict[str, np.ndarray]) -> None:
    write_safetensors(path, ((k, v, None) for k, v in arrays.items()))


def test_safetensors_counts_its_data_not_its_header(tmp_path: Path) -> None:
    a = np.arange(6 * 7, dtype=np.float32).reshape(6, 7) + 1
    b = np.arange(10, dtype=np.int32) + 3
    _st(tmp_path / "m.safetensors", {"a" * 200: a, "b": b})
    assert (tmp_path / "m.safetensors").stat().st_size > a.nbytes + b.nbytes + 200
    assert tensor_bytes(tmp_path / "m.safetensors") == a.nbytes + b.nbytes


def test_gguf_counts_its_tensors_not_its_metadata() -> None:
    gguf = pytest.importorskip("gguf", reason="gguf-py (pip install gguf) reads the reference sizes")
    want = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(LLAMA_Q)).tensors)
    got = tensor_bytes(LLAMA_Q)
    assert got == want and got < LLAMA_Q.stat().st_size


def test_a_folder_counts_weight_files_only_and_follows_links(tmp_path: Path) -> None:
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    a = np.full((4, 4), 2.5, dtype=np.float16)
    _st(blobs / "x", {"w": a})
    os.symlink(Path("..") / "blobs" / "x", snap / "model.safetensors")
    (snap / "tokenizer.json").write_text(json.dumps({"v": list(range(50_000))}))
    (snap / "config.json").write_text("{}")
    np.save(snap / "extra.npy", np.ones(9, dtype=np.float64))
    assert tensor_bytes(snap) == a.nbytes  # the .npy is not the kind this folder keeps its weights in


def test_a_damaged_gguf_counts_as_its_size_and_hub_addresses_as_unknown(tmp_path: Path) -> None:
    bad = tmp_path / "t.gguf"
    bad.write_bytes(LLAMA_Q.read_bytes()[:5000])
    assert tensor_bytes(bad) == 5000
    assert tensor_bytes("hf:org/model") is None and tensor_bytes(tmp_path / "nothing") is None


def test_convert_does_not_call_side_files_growth(tmp_path: Path) -> None:
    """A GGUF's folder has the GGUF's tensor bytes (compact storage) plus JSON side files; the whole folder is
    larger than the file, which the growth warning used to report as growth."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", GrowthWarning)
        res = convert(LLAMA_Q, tmp_path / "out", show_progress=False)
    assert res["bytes"] > LLAMA_Q.stat().st_size  # the whole folder, side files included
    assert res["tensor_bytes"] == res["source_tensor_bytes"] == tensor_bytes(LLAMA_Q)


def test_a_folder_counts_one_kind_of_weight_file(tmp_path: Path) -> None:
    """Safetensors weights shipped again as a pickle (pytorch_model.bin, original/consolidated.pth) count once."""
    a = np.arange(64, dtype=np.float32) + 1
    _st(tmp_path / "model.safetensors", {"w": a})
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 999)
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "consolidated.pth").write_bytes(b"y" * 777)
    assert tensor_bytes(tmp_path) == a.nbytes
    (tmp_path / "model.safetensors").unlink()
    assert tensor_bytes(tmp_path) == 999 + 777


def test_toml_tables_count_their_base_weights() -> None:
    """TOML tables hold scales and zeros only (a few kB of .npy); the codes come from --base's fp16 weights,
    so the source is both, and the packed output is far smaller than it, not 'larger than the source'."""
    import tempfile

    from conftest import fixture_dir

    case = fixture_dir("toml", "decoder_toml_inline_asym_g64")
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("error", GrowthWarning)
        res = convert(case / "quant_dir", Path(tmp) / "o", base=case / "base_weights_fp16.safetensors",
                      show_progress=False)
    base = tensor_bytes(case / "base_weights_fp16.safetensors")
    assert res["source_tensor_bytes"] == tensor_bytes(case / "quant_dir") + base
    assert res["tensor_bytes"] < base
