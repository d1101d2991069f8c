"""GGUF: fixtures bit-exact, block codecs against gguf's own (de)quantizer, names and the q/k rotary permutation,
config.json, byte-identical round trips, refusals, hostile files, and the real SmolLM2-135M Q4_1 model.

The reference side uses only the ``gguf`` package (gguf.quants.dequantize, GGUFReader/GGUFWriter) and, for the
real model, transformers' own GGUF loader; the q/k un-permutation below is written independently of the module.
"""
from __future__ import annotations

import contextlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import REPO, fixture_cases, fixture_dir
from w4pack.canonical import CanonicalLayer
from w4pack.checkpoint import open_checkpoint
from w4pack.cli import cli, main
from w4pack.convert import convert
from w4pack.dtypes import to_float32
from w4pack.errors import BadInputError, IOFailure, UnsupportedError
from w4pack.formats import detect, get_format
from w4pack.sources import open_source
from w4pack.formats.base import Source, TensorData

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from w4pack.formats.gguf import (  # noqa: E402
    METADATA_NAME, GGUFWarning, decode_q4_0, decode_q4_1, decode_q8_0, encode_layer, tokenizer_metadata)

GGUF = get_format("gguf")
FAMILY = "gguf"
LAYER = "model.layers.0.mlp.down_proj"


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' un-permutation of llama.cpp's q/k rows (rows of each head: (d/2, 2) -> (2, d/2))."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def tensors_by_name(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def make_gguf(path: Path, *, arch: str = "llama", seed: int = 0, license: str | None = None) -> dict[str, np.ndarray]:
    """A one-block model with every kind of tensor; returns gguf's dequantization of each tensor."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name("w4pack synthetic")
    if license is not None:
        w.add_license(license)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(2)
    w.add_quantization_version(2)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    deq: dict[str, np.ndarray] = {}

    def add(name: str, shape: tuple[int, ...], qt: Any) -> None:
        x = rng.normal(0, 0.05, shape).astype(np.float32)
        if qt in (Q.F32, Q.F16):
            arr = x if qt == Q.F32 else x.astype(np.float16)
            w.add_tensor(name, arr)
            deq[name] = arr.astype(np.float32)
        else:
            data = gguf.quants.quantize(x, qt)
            w.add_tensor(name, data, raw_dtype=qt)
            deq[name] = gguf.quants.dequantize(data, qt)

    add("token_embd.weight", (32, 64), Q.F16)
    add("blk.0.attn_norm.weight", (64,), Q.F32)
    add("blk.0.attn_q.weight", (64, 64), Q.Q4_0)
    add("blk.0.attn_k.weight", (32, 64), Q.Q4_1)
    add("blk.0.attn_v.weight", (32, 64), Q.Q8_0)
    add("blk.0.attn_output.weight", (64, 64), Q.Q4_0)
    add("blk.0.ffn_norm.weight", (64,), Q.F32)
    add("blk.0.ffn_gate.weight", (96, 64), Q.Q4_1)
    add("blk.0.ffn_up.weight", (96, 64), Q.Q5_0)
    add("blk.0.ffn_down.weight", (64, 96), Q.Q4_0)
    add("output_norm.weight", (64,), Q.F32)
    add("output.weight", (32, 64), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


# -- block codecs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qt,decode", [(Q.Q4_0, decode_q4_0), (Q.Q4_1, decode_q4_1), (Q.Q8_0, decode_q8_0)])
def test_block_codecs_match_gguf(qt: Any, decode: Any) -> None:
    x = np.random.default_rng(int(qt)).normal(0, 0.1, (48, 160)).astype(np.float32)
    raw = gguf.quants.quantize(x, qt)
    layer = decode(raw, 48, 160).validate()
    assert layer.group_size == 32 and layer.scale_dtype == "float16"
    assert np.array_equal(layer.dequantize(), gguf.quants.dequantize(raw, qt))
    name, again = encode_layer(layer)
    assert name == qt.name and np.array_equal(again, raw)


def test_nibble_order_is_split_halves() -> None:
    """Byte j of a Q4_0 block holds element j (low nibble) and element j + 16 (high nibble)."""
    codes = np.arange(32, dtype=np.uint8).reshape(1, 32) % 16
    codes[0, 16:] = 15 - codes[0, 16:]
    layer = CanonicalLayer(codes=codes, scales=np.ones((1, 1), np.float16), bits=4, group_size=32)
    _t, raw = encode_layer(layer)
    qs = raw[0, 2:18]
    assert [(b & 15, b >> 4) for b in qs] == [(codes[0, j], codes[0, j + 16]) for j in range(16)]


def test_int_zeros_become_q4_1_only_when_exact() -> None:
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (8, 64)).astype(np.uint8)
    zeros = rng.integers(0, 16, (8, 2)).astype(np.uint8)
    exact = CanonicalLayer(codes=codes, scales=np.full((8, 2), 0.5, np.float16), bits=4, group_size=32,
                           zero_mode="int", zeros=zeros).validate()
    t, raw = encode_layer(exact)
    assert t == "Q4_1"
    assert np.array_equal(gguf.quants.dequantize(raw, Q.Q4_1), exact.dequantize())
    inexact = exact.replace(scales=np.full((8, 2), 0.1, np.float16), zeros=np.full((8, 2), 7, np.uint8))
    with pytest.raises(UnsupportedError, match="fp16"):
        encode_layer(inexact.validate())
    sym_int = exact.replace(zeros=np.full((8, 2), 8, np.uint8))
    assert encode_layer(sym_int.validate())[0] == "Q4_0"


# -- fixtures ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case_name", fixture_cases(FAMILY))
def test_fixture_bit_exact(case_name: str) -> None:
    case = fixture_dir(FAMILY, case_name)
    path = case / "tensors.gguf"
    assert detect(path) == "gguf"
    t = {p.stem: np.load(p) for p in (case / "truth").glob("*.npy")}
    with GGUF.open(path) as s:
        assert s.layer_names() == [LAYER]
        assert s.passthrough_names() == ["source.weight"]  # no transformers name: kept as is
        layer = s.read_layer(LAYER)
        assert layer.bits == int(t["bits"]) and layer.group_size == int(t["group_size"]) == 32
        if "codes" in t:
            assert np.array_equal(layer.codes, t["codes"])
        if "codes_int8" in t:
            assert np.array_equal(layer.codes.astype(np.int16) - 128, t["codes_int8"])
            assert layer.zero_mode == "none"
        if "scales" in t:
            assert np.array_equal(to_float32(layer.scales, "float16"), t["scales"])
        if "mins" in t:
            assert layer.zero_mode == "float"
            assert np.array_equal(to_float32(layer.zeros, "float16"), t["mins"])
        if "zeros" in t:
            assert layer.zero_mode == "none" and np.array_equal(layer.zero_points(), t["zeros"])
        if "dequant_f32" in t:
            assert np.array_equal(layer.dequantize(), t["dequant_f32"])
        src = s.read_tensor("source.weight")
        assert src.dtype == "float32"
        if "source_f32" in t:
            assert np.array_equal(src.array, t["source_f32"])
        else:  # exact cases: the float source is exactly on the grid
            assert np.array_equal(layer.dequantize(), src.array)
        assert s.config == {} and any("config.json not built" in n for n in s.info["notes"])


@pytest.mark.parametrize("case_name", fixture_cases(FAMILY))
def test_fixture_round_trip_is_byte_identical(case_name: str, tmp_path: Path) -> None:
    path = fixture_dir(FAMILY, case_name) / "tensors.gguf"
    convert(path, tmp_path / "w4", show_progress=False)
    assert open_checkpoint(tmp_path / "w4").manifest["source"]["format"] == "gguf"
    convert(tmp_path / "w4", tmp_path / "back.gguf", to="gguf", show_progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == path.read_bytes()


# -- a synthetic llama ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_model_names_permutation_config(arch: str, tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    deq = make_gguf(src, arch=arch)
    convert(src, tmp_path / "w4", show_progress=False)
    ck = open_checkpoint(tmp_path / "w4")
    hf = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj",
        "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj",
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj",
        "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj",
        "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj",  # Q5_0: 5-bit codes in 8-bit storage
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj",
        "output.weight": "lm_head",
    }
    assert sorted(ck.layers) == sorted(hf.values())
    for g, name in hf.items():
        want = deq[g]
        if arch == "llama" and "attn_q" in g:
            want = reverse_permute(want, 4)
        elif arch == "llama" and "attn_k" in g:
            want = reverse_permute(want, 2)
        assert np.array_equal(ck.dequantize(name), want), name
    assert ck.manifest["layers"]["model.layers.0.self_attn.v_proj"]["bits"] == 8
    assert ck.manifest["layers"]["model.layers.0.mlp.gate_proj"]["zero_mode"] == "float"
    # Q5_0 is packed as 5-bit codes (8-bit storage); F16/F32 untouched
    assert (ck.manifest["layers"]["model.layers.0.mlp.up_proj"]["bits"],
            ck.manifest["layers"]["model.layers.0.mlp.up_proj"]["storage_bits"]) == (5, 8)
    assert ck.dtype_name("model.embed_tokens.weight") == "float16"
    assert sorted(ck.passthrough) == sorted(["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                             "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"])
    notes = " | ".join(ck.manifest["source"]["notes"])
    assert "Q5_0: 1 packed losslessly" in notes and "dequantized" not in notes
    assert ("permutation" in notes) == (arch == "llama")
    cfg = json.loads((tmp_path / "w4" / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 96, 1)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["vocab_size"] == 32 and cfg["tie_word_embeddings"] is False
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    # and back: every tensor (the Q5_0 one re-encoded exactly) and the whole file, byte for byte
    convert(tmp_path / "w4", tmp_path / "back.gguf", to="gguf", show_progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()


def test_dry_run_reports_passthrough_types(tmp_path: Path) -> None:
    make_gguf(tmp_path / "m.gguf")
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "8 quantized layers" in res.output
    assert "Q5_0: 1 packed losslessly" in res.output and "F16: 1 passed through as they are" in res.output
    assert not (tmp_path / "out").exists()


# -- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gs", [64, 128, -1])
@pytest.mark.parametrize("mode,bits", [("none", 4), ("int", 4), ("float", 4), ("none", 8)])
def test_groups_of_whole_blocks_are_written_exactly(gs: int, mode: str, bits: int) -> None:
    """A group of 32·r columns (or a whole row) is r blocks carrying its scale and zero: llama.cpp's own
    dequantization (gguf-py) gives the layer's weights bit for bit."""
    rng = np.random.default_rng(gs + bits)
    n, k = 8, 256
    g = 1 if gs == -1 else k // gs
    codes = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
    scales = (rng.integers(1, 64, (n, g)) / 256).astype(np.float16)  # with small zeros, -s·z stays an fp16
    zeros = None
    if mode == "int":
        zeros = rng.integers(0, 16, (n, g)).astype(np.int32)
    elif mode == "float":
        zeros = (-rng.random((n, g))).astype(np.float16)
    layer = CanonicalLayer(codes=codes, scales=scales, bits=bits, group_size=gs, zero_mode=mode, zeros=zeros,
                           scale_dtype="float16").validate()
    t, raw = encode_layer(layer)
    assert t == {("none", 4): "Q4_0", ("int", 4): "Q4_1", ("float", 4): "Q4_1", ("none", 8): "Q8_0"}[mode, bits]
    assert np.array_equal(gguf.quants.dequantize(raw, getattr(Q, t)), layer.dequantize())


def test_a_group_128_checkpoint_goes_to_gguf_and_back(tmp_path: Path) -> None:
    case = fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128")
    convert(case, tmp_path / "w4", show_progress=False)
    with pytest.warns(GGUFWarning, match="carry the group's scale in each block: 14 at group size 128"):
        convert(tmp_path / "w4", tmp_path / "x.gguf", to="gguf", show_progress=False)
    src, back = open_source(tmp_path / "w4"), open_source(tmp_path / "x.gguf")
    names = src.layer_names()
    assert names and sorted(names) == sorted(back.layer_names())
    for name in names:
        a, b = src.read_layer(name), back.read_layer(name)
        assert b.group_size == 32 and b.zero_mode == "none"
        assert np.array_equal(a.dequantize(), b.dequantize()), name


@pytest.mark.parametrize("change,why", [
    (lambda L: L.replace(group_size=48, scales=np.repeat(L.scales, 2, axis=1), g_idx=None),
     "group size 48, not a multiple of GGUF"),
    (lambda L: L.replace(g_idx=L.g_idx[::-1].copy()), "act-order"),
])
def test_writer_refuses_what_blocks_cannot_hold(change: Any, why: str) -> None:
    rng = np.random.default_rng(2)
    base = CanonicalLayer(codes=rng.integers(0, 16, (8, 288)).astype(np.uint8), scales=np.full((8, 3), 0.5, np.float16),
                          bits=4, group_size=96, zero_mode="none")
    with pytest.raises(UnsupportedError, match=why):
        encode_layer(change(base.validate()).validate())


def test_writer_refusal_is_one_line_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = fixture_dir("gptq", "ag_tiny_llama_b4_g64_descact_sym")
    convert(case, tmp_path / "w4", show_progress=False)
    with pytest.raises(UnsupportedError, match="act-order") as exc:
        convert(tmp_path / "w4", tmp_path / "x.gguf", to="gguf", show_progress=False)
    assert "more)" in str(exc.value) and "requantize" not in str(exc.value)
    rc = main(["convert", str(tmp_path / "w4"), str(tmp_path / "y.gguf"), "--to", "gguf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and len(err) == 1 and "act-order" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w4"]


def test_writer_refuses_to_clobber(tmp_path: Path) -> None:
    src = fixture_dir(FAMILY, "q4_0_exact_in512_out256") / "tensors.gguf"
    convert(src, tmp_path / "w4", show_progress=False)
    (tmp_path / "x.gguf").write_bytes(b"keep")
    assert main(["convert", str(tmp_path / "w4"), str(tmp_path / "x.gguf"), "--to", "gguf"]) == 4
    assert (tmp_path / "x.gguf").read_bytes() == b"keep"
    # --force replaces an earlier GGUF, not a file of another kind
    assert main(["convert", str(tmp_path / "w4"), str(tmp_path / "x.gguf"), "--to", "gguf", "--force"]) == 4
    assert (tmp_path / "x.gguf").read_bytes() == b"keep"
    (tmp_path / "x.gguf").write_bytes(b"GGUF-keep")
    assert main(["convert", str(tmp_path / "w4"), str(tmp_path / "x.gguf"), "--to", "gguf", "--force"]) == 0
    assert (tmp_path / "x.gguf").read_bytes() == src.read_bytes()


def _patch(data: bytes, what: str) -> bytes:
    b = bytearray(data)
    if what == "truncated":
        return bytes(b[:-100])
    if what == "truncated-header":
        return bytes(b[:300])
    if what in ("count+1", "count-1"):
        n = struct.unpack_from("<Q", b, 8)[0]
        struct.pack_into("<Q", b, 8, n + (1 if what == "count+1" else -1))
        return bytes(b)
    if what == "unknown-type":
        name = b"blk.0.ffn_down.weight"
        i = b.find(name) + len(name)
        nd = struct.unpack_from("<I", b, i)[0]
        struct.pack_into("<I", b, i + 4 + 8 * nd, 99)
        return bytes(b)
    if what == "magic":
        return b"GGUX" + bytes(b[4:])
    raise AssertionError(what)


@pytest.mark.parametrize("what,match", [
    ("truncated", "truncated"), ("truncated-header", "truncated"), ("count+1", "truncated"),
    ("count-1", "tensor count"), ("unknown-type", "unknown tensor type"),
    ("unknown-arch", "unknown architecture 'foo'"),
])
def test_hostile_files_are_one_line_exit_2(what: str, match: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.gguf"
    make_gguf(good, arch="foo" if what == "unknown-arch" else "llama")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes() if what == "unknown-arch" else _patch(good.read_bytes(), what))
    with pytest.raises(BadInputError, match=match):
        GGUF.open(bad)
    rc = main(["convert", str(bad), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(bad) in err[0] and "Traceback" not in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "good.gguf"]


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(_patch(b"GGUF" + bytes(64), "magic"))
    assert not GGUF.detect(p)
    with pytest.raises(BadInputError, match="not a GGUF file"):
        GGUF.open(p)


# -- the real model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from conftest import smollm2_gguf

    path = smollm2_gguf()
    out = tmp_path_factory.mktemp("smollm2") / "w4"
    res = CliRunner().invoke(cli, ["convert", str(path), str(out)])
    assert res.exit_code == 0, res.output
    return path, out


@pytest.fixture(scope="module")
def smollm2_reader(smollm2: tuple[Path, Path]) -> Any:
    """The original file as gguf's own reader parses it (parsed once: its 49k tokens take seconds)."""
    return gguf.GGUFReader(str(smollm2[0]))


@pytest.mark.slow
def test_smollm2_layers_equal_gguf_and_transformers_dequantization(smollm2: tuple[Path, Path],
                                                                   smollm2_reader: Any) -> None:
    """Every packed layer dequantizes to exactly gguf's own dequantization (q/k rows un-permuted), and to exactly
    what transformers' own GGUF loader makes of the same file; pass-through tensors too."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, out = smollm2
    ck = open_checkpoint(out)
    src = {t.name: t for t in smollm2_reader.tensors}
    q4_1 = [t for t in src.values() if t.tensor_type == Q.Q4_1]
    assert len(q4_1) == len(ck.layers) - 1 == 210  # and the embedding, kept packed
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(out)))
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    gmap = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
    for t in q4_1:
        _blk, i, kind, _w = t.name.split(".")
        name = f"model.layers.{i}.{gmap[kind]}"
        meta = ck.manifest["layers"][name]
        assert (meta["bits"], meta["group_size"], meta["zero_mode"]) == (4, 32, "float")
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        if kind == "attn_q":
            want = reverse_permute(want, 9)
        elif kind == "attn_k":
            want = reverse_permute(want, 3)
        ours = ck.dequantize(name)
        assert np.array_equal(ours, want), name
        assert np.array_equal(ours, np.asarray(theirs[f"{name}.weight"], dtype=np.float32)), name
    assert ck.manifest["layers"]["model.layers.0.self_attn.q_proj"]["shape"] == [576, 576]
    for name in ck.passthrough:
        assert np.array_equal(np.asarray(ck.tensor(name), dtype=np.float32),
                              np.asarray(theirs[name], dtype=np.float32)), name
    emb = src["token_embd.weight"]
    assert ck.manifest["layers"]["model.embed_tokens"]["role"] == "embedding"
    assert np.array_equal(ck.dequantize("model.embed_tokens"), gguf.quants.dequantize(emb.data, emb.tensor_type))
    assert np.array_equal(ck.dequantize("model.embed_tokens"), np.asarray(theirs["model.embed_tokens.weight"]))
    res = CliRunner().invoke(cli, ["inspect", str(out)])
    assert res.exit_code == 0 and "quantized layers: 211" in res.output and "LlamaForCausalLM" in res.output


@pytest.mark.slow
def test_smollm2_config_and_tokenizer_load_in_transformers(smollm2: tuple[Path, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    _path, out = smollm2
    cfg = json.loads((out / "config.json").read_text())
    want = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "head_dim": 64, "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
    assert {k: cfg[k] for k in want} == want
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["quantization_config"]["quant_method"] == "w4pack"
    hf_cfg = transformers.AutoConfig.from_pretrained(str(out))
    assert type(hf_cfg).__name__ == "LlamaConfig" and hf_cfg.rope_parameters["rope_theta"] == 100000.0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 49152
    ids = tok("What is the capital of France?")["input_ids"]
    assert tok.decode(ids) == "What is the capital of France?"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in prompt
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow
def test_smollm2_written_back_is_the_original_file(smollm2: tuple[Path, Path], tmp_path: Path) -> None:
    path, out = smollm2
    convert(out, tmp_path / "back.gguf", to="gguf", show_progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == path.read_bytes()


@pytest.mark.slow
def test_smollm2_tokenizer_rebuilt_from_tokenizer_json(smollm2: tuple[Path, Path], smollm2_reader: Any) -> None:
    """A source without saved GGUF metadata (any Hugging Face folder) still gets llama.cpp's tokenizer keys:
    rebuilt from the exported tokenizer.json, they equal the original GGUF's (pre-tokenizer "smollm",
    add_bos_token and add_space_prefix included, as llama.cpp's converter wrote them)."""
    _path, out = smollm2
    side = [p for p in out.iterdir() if p.suffix in (".json", ".jinja") and p.name != "gguf_metadata.json"]
    keys, why = tokenizer_metadata(side, json.loads((out / "config.json").read_text()))
    assert why is None
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.chat_template", "tokenizer.ggml.pre",
                "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix"):
        assert keys[key][0] == smollm2_reader.fields[key].contents(), key
        assert keys[key][1] == smollm2_reader.fields[key].types[0].name, key


def _one_layer_source(layer: CanonicalLayer, side: list[Path] | None = None) -> Source:
    """A llama source of the one layer LAYER and nothing else (no tensors; ``side``: its side files)."""

    class One(Source):
        config = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 64}
        info = {"format": "memory"}
        path = Path("memory")

        def layer_names(self) -> list[str]:
            return [LAYER]

        def read_layer(self, name: str) -> CanonicalLayer:
            return layer.replace(name=name)

        def passthrough_names(self) -> list[str]:
            return []

        def read_tensor(self, name: str) -> TensorData:
            raise KeyError(name)

        def side_files(self) -> list[Path]:
            return list(side or [])

    return One()


def test_gguf_without_tokenizer_warns(tmp_path: Path) -> None:
    layer = CanonicalLayer(codes=np.zeros((32, 64), np.uint8), scales=np.ones((32, 2), np.float16), bits=4,
                           group_size=32).validate()
    with pytest.warns(UserWarning, match="no tokenizer embedded"):
        GGUF.write(_one_layer_source(layer), tmp_path / "x.gguf")
    t = tensors_by_name(tmp_path / "x.gguf")["blk.0.ffn_down.weight"]
    assert t.tensor_type == Q.Q4_0 and np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type),
                                                      layer.dequantize())


def test_bpe_tokenizer_without_merges_is_not_embedded(tmp_path: Path) -> None:
    """A byte-level BPE tokenizer.json with no merges: gguf's writer refuses the empty merges array (a traceback
    before) and llama.cpp cannot load a BPE vocabulary without it, so the file is written without a tokenizer and
    the warning says why."""
    layer = CanonicalLayer(codes=np.zeros((32, 64), np.uint8), scales=np.ones((32, 2), np.float16), bits=4,
                           group_size=32).validate()
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
                               "added_tokens": []}))
    with pytest.warns(UserWarning, match="no tokenizer embedded.*no BPE merges"):
        GGUF.write(_one_layer_source(layer, [tok]), tmp_path / "x.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "x.gguf"))
    assert "tokenizer.ggml.model" not in reader.fields and "blk.0.ffn_down.weight" in tensors_by_name(
        tmp_path / "x.gguf")


def make_tokenizer_gguf(path: Path) -> None:
    """A tiny byte-level BPE vocabulary in llama.cpp's keys, beside one Q4_0 layer. No feed_forward_length: the
    config then lacks intermediate_size, so this one-layer fragment of a model is not held to the architecture
    (which would refuse it for the embedding, norms and projections it lacks)."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    toks = ["<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "abc", "Ġ", "Ġa"]
    w.add_token_list(toks)
    w.add_token_types([3, 3] + [1] * (len(toks) - 2))
    w.add_token_merges(["a b", "ab c", "Ġ a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    x = np.random.default_rng(0).normal(0, 0.05, (64, 96)).astype(np.float32)
    w.add_tensor("blk.0.ffn_down.weight", gguf.quants.quantize(x, Q.Q4_0), raw_dtype=Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tokenizer_exported_by_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    make_tokenizer_gguf(tmp_path / "t.gguf")
    convert(tmp_path / "t.gguf", tmp_path / "w4", show_progress=False)
    names = sorted(p.name for p in (tmp_path / "w4").iterdir())
    assert "tokenizer.json" in names and "gguf_metadata.json" in names
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "w4"))
    assert tok("abc", add_special_tokens=False)["input_ids"] == [29]  # merged by "a b" then "ab c"
    notes = open_checkpoint(tmp_path / "w4").manifest["source"]["notes"]
    assert any("tokenizer exported" in n for n in notes)


def test_tokenizer_export_is_optional(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without transformers the conversion still works and says why there is no tokenizer."""
    make_tokenizer_gguf(tmp_path / "t.gguf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    with pytest.warns(UserWarning, match="tokenizer is not exported"):
        convert(tmp_path / "t.gguf", tmp_path / "w4", show_progress=False)
    assert not (tmp_path / "w4" / "tokenizer.json").exists()
    notes = open_checkpoint(tmp_path / "w4").manifest["source"]["notes"]
    assert any("transformers is not installed" in n for n in notes)


def kquant_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """Q4_K / Q6_K rows in the form llama.cpp's reference quantizer writes (gguf-py has no K-quant quantizer):
    random codes and sub-scales, the largest sub-scale at the top of its range (Q4_K: scale and minimum 63;
    Q6_K: -128), fp16 d = a weight-like scale."""
    nb = k // 256
    d = (rng.uniform(0.5, 2.0, (n, nb)) * 1e-3).astype(np.float16)
    if qtype == "Q4_K":
        sc, mn = rng.integers(0, 64, (n, nb, 8)), rng.integers(0, 64, (n, nb, 8))
        sc[..., 3], mn[..., 5] = 63, 63
        b = np.zeros((n, nb, 144), np.uint8)
        b[..., 0:2] = d.astype("<f2")[..., None].view(np.uint8)
        b[..., 2:4] = (d / 4).astype("<f2")[..., None].view(np.uint8)
        for j in range(4):
            b[..., 4 + j] = sc[..., j] | ((sc[..., j + 4] >> 4) << 6)
            b[..., 8 + j] = mn[..., j] | ((mn[..., j + 4] >> 4) << 6)
            b[..., 12 + j] = (sc[..., j + 4] & 15) | ((mn[..., j + 4] & 15) << 4)
        b[..., 16:] = rng.integers(0, 256, (n, nb, 128), dtype=np.uint8)
    else:
        sc = rng.integers(-127, 128, (n, nb, 16))
        sc[..., 7] = -128
        b = rng.integers(0, 256, (n, nb, 210), dtype=np.uint8)
        b[..., 192:208] = sc.astype(np.int8).view(np.uint8)
        b[..., 208:210] = d.astype("<f2")[..., None].view(np.uint8)
    return b.reshape(n, -1)


def one_block_llama_writer(path: Path, name: str, *, ffn: int, file_type: int) -> Any:
    """A gguf-py writer holding the metadata of a one-block llama (hidden 256, 4 heads on 2 KV heads), ready for
    the caller's tensors."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(ffn)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(file_type)
    w.add_quantization_version(2)
    return w


def make_kquant_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-block llama in the Q4_K_M mix (Q4_K matrices, Q6_K for attn_v / ffn_down / output); returns gguf-py's
    dequantization of each quantized tensor."""
    rng = np.random.default_rng(seed)
    w = one_block_llama_writer(path, "w4pack k-quants", ffn=512, file_type=15)  # MOSTLY_Q4_K_M
    deq: dict[str, np.ndarray] = {}
    w.add_tensor("token_embd.weight", rng.normal(0, 0.05, (32, 256)).astype(np.float16))
    for name, shape, qt in [("blk.0.attn_norm.weight", (256,), Q.F32), ("blk.0.attn_q.weight", (256, 256), Q.Q4_K),
                             ("blk.0.attn_k.weight", (128, 256), Q.Q4_K), ("blk.0.attn_v.weight", (128, 256), Q.Q6_K),
                             ("blk.0.attn_output.weight", (256, 256), Q.Q4_K), ("blk.0.ffn_norm.weight", (256,), Q.F32),
                             ("blk.0.ffn_gate.weight", (512, 256), Q.Q4_K), ("blk.0.ffn_up.weight", (512, 256), Q.Q4_K),
                             ("blk.0.ffn_down.weight", (256, 512), Q.Q6_K), ("output_norm.weight", (256,), Q.F32),
                             ("output.weight", (32, 256), Q.Q6_K)]:
        if qt == Q.F32:
            w.add_tensor(name, np.ones(shape, np.float32))
            continue
        raw = kquant_blocks(rng, qt.name, *shape)
        w.add_tensor(name, raw, raw_dtype=qt)
        deq[name] = gguf.quants.dequantize(raw, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


def test_k_quants_pack_losslessly_verify_and_round_trip(tmp_path: Path) -> None:
    """A Q4_K_M-style GGUF: every linear layer packed (none dequantized), each equal to gguf-py's dequantization,
    verify --against the GGUF bit-identical, stored at the GGUF's tensor bytes (the runtime form, larger, warned
    with sizes), and written back as the same file byte for byte."""
    import warnings

    from w4pack.convert import GrowthWarning
    from w4pack.verify import verify

    src = tmp_path / "k.gguf"
    deq = make_kquant_gguf(src)
    with warnings.catch_warnings():  # stored compact: the GGUF's own tensor bytes, no growth
        warnings.simplefilter("error", GrowthWarning)
        res = convert(src, tmp_path / "w4", show_progress=False)
    with pytest.warns(GrowthWarning, match=r"MB\) are larger than those of the source .*x1\.\d\d"):
        grown = convert(src, tmp_path / "w4x", show_progress=False, expanded=True)  # the runtime form
    assert grown["tensor_bytes"] > grown["source_tensor_bytes"]
    ck = open_checkpoint(tmp_path / "w4")
    assert len(ck.layers) == 8 and sorted(ck.passthrough) == sorted(
        ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
         "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"])
    kinds = {(m["bits"], m["storage_bits"], m["group_size"], m["zero_mode"], m["scale_dtype"])
             for m in ck.manifest["layers"].values()}
    assert kinds == {(4, 4, 32, "float", "float32"), (6, 8, 16, "none", "float32")}
    for g, name in [("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj"),
                    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj"), ("output.weight", "lm_head"),
                    ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj")]:
        want = deq[g] if "attn_k" not in g else reverse_permute(deq[g], 2)
        got = ck.layer(name).dequantize(np.float64).astype(np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
    notes = " | ".join(ck.manifest["source"]["notes"])
    assert "Q4_K: 5 packed losslessly" in notes and "Q6_K: 3 packed losslessly" in notes
    gguf_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(src)).tensors)
    assert res["tensor_bytes"] == res["source_tensor_bytes"] == gguf_bytes
    rep = verify(tmp_path / "w4", against=src, show_progress=False)
    assert rep.ok and all(c.exact for c in rep.layers), rep.summary()
    convert(tmp_path / "w4", tmp_path / "back.gguf", to="gguf", show_progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()


def test_inspect_shows_how_each_type_is_carried(tmp_path: Path) -> None:
    make_kquant_gguf(tmp_path / "k.gguf")
    res = CliRunner().invoke(cli, ["inspect", str(tmp_path / "k.gguf")])
    assert res.exit_code == 0, res.output
    assert "note: Q4_K: 5 packed losslessly" in res.output and "note: F16: 1 passed through as they are" in res.output
    assert "problem" not in res.output  # 6-bit layers are writable
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "k.gguf"), str(tmp_path / "w4")])
    assert res.exit_code == 0, res.output
    assert "warning: " not in res.stderr  # compact: the GGUF's tensor bytes
    res = CliRunner().invoke(cli, ["convert", "--expanded", str(tmp_path / "k.gguf"), str(tmp_path / "w4x")])
    assert res.exit_code == 0, res.output
    assert "warning: " in res.stderr and "are larger than those of the source" in res.stderr


def test_codebook_types_are_refused_for_packing_by_name(tmp_path: Path) -> None:
    """A grid-codebook linear weight (IQ2_XXS) cannot be a canonical layer: one note names tensor and type."""
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (64, 66), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(np.array([0.01], "<f2").tobytes(), np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), arch="llama")
    w.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = GGUF.open(tmp_path / "iq.gguf")
    assert src.layer_names() == []
    assert any(n.startswith("blk.0.ffn_down.weight (IQ2_XXS): not packed, grid-codebook") for n in src.info["notes"])
    assert "IQ2_XXS: 1 dequantized to float32" in src.info["notes"]
    src.close()


# -- output safety --------------------------------------------------------------------------------------------------
def test_disk_full_names_the_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's tofile on a full disk says only "73728 requested and 40608 written": the error names the output
    and says the disk is full, and the temporary file is gone."""
    src = fixture_dir(FAMILY, "q4_0_exact_in512_out256") / "tensors.gguf"

    def full(self: Any, tensor: Any) -> None:
        raise OSError("73728 requested and 40608 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full)
    out = tmp_path / "x.gguf"
    with pytest.raises(IOFailure, match="the disk is full") as exc:
        convert(src, out, to="gguf", show_progress=False)
    assert str(exc.value).startswith(f"{out}: ")
    assert list(tmp_path.iterdir()) == []


def test_side_file_linked_out_of_the_source_is_not_embedded(tmp_path: Path) -> None:
    """The writer reads side files (saved GGUF metadata, tokenizer.json) into the GGUF header: one that is a link
    out of the source folder is refused, naming it, as when side files are copied."""
    src = fixture_dir(FAMILY, "q4_0_exact_in512_out256") / "tensors.gguf"
    w4 = tmp_path / "w4"
    convert(src, w4, show_progress=False)
    meta = w4 / METADATA_NAME
    assert meta.is_file()
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(meta.read_bytes())
    meta.unlink()
    meta.symlink_to(outside)
    with pytest.raises(BadInputError, match="symbolic link out of the source folder") as exc:
        convert(w4, tmp_path / "x.gguf", to="gguf", show_progress=False)
    assert str(meta) in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.json", "w4"]


# -- hostile headers: every count, length and offset checked before use ----------------------------------------------
RANDOM_CASE = ("gguf", "q4_0_random_in256_out128")
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def header_ints(data: bytes) -> list[tuple[str, int, str]]:
    """(what, offset, struct format) of every integer field of a well-formed GGUF header: counts, key and string
    lengths, value and item types, array counts, integer values, tensor dims, types and offsets. Written apart
    from the reader under test (a plain walk of the v3 layout)."""
    fields: list[tuple[str, int, str]] = [("tensor count", 8, "<Q"), ("kv count", 16, "<Q")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(what: str) -> str:
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        fields.append((f"{what} length", pos, "<Q"))
        s = data[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        return s

    def value(key: str, vt: int) -> None:
        nonlocal pos
        if vt == 8:
            string(f"{key} value")
        elif vt == 9:
            item, count = struct.unpack_from("<IQ", data, pos)
            fields.extend([(f"{key} item type", pos, "<I"), (f"{key} count", pos + 4, "<Q")])
            pos += 12
            for _ in range(count):
                value(f"{key}[]", item)
        else:
            fmt = _SCALARS[vt]
            if fmt[-1] in "BbHhIiQq":
                fields.append((f"{key} value", pos, fmt))
            pos += struct.calcsize(fmt)

    for _ in range(n_kv):
        key = string("key")
        vt = struct.unpack_from("<I", data, pos)[0]
        fields.append((f"{key} type", pos, "<I"))
        pos += 4
        value(key, vt)
    for _ in range(n_tensors):
        name = string("tensor name")
        nd = struct.unpack_from("<I", data, pos)[0]
        fields.append((f"{name} n_dims", pos, "<I"))
        pos += 4
        for d in range(nd):
            fields.append((f"{name} dim {d}", pos, "<Q"))
            pos += 8
        fields.extend([(f"{name} type", pos, "<I"), (f"{name} offset", pos + 4, "<Q")])
        pos += 12
    return fields


def _field(data: bytes, what: str) -> tuple[int, str]:
    return next((off, fmt) for w, off, fmt in header_ints(data) if w == what)


def _set(data: bytes, what: str, value: int) -> bytes:
    off, fmt = _field(data, what)
    b = bytearray(data)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


def _cli_one_line(argv: list[str], timeout: float = 30.0) -> tuple[int, str, float]:
    """Run the CLI in a child process (a hang or a runaway allocation must not take the test run with it)
    and return (exit status, stderr, seconds). 30 s and 2 GiB of address space at most."""
    import resource
    import subprocess
    import time

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "w4pack", *argv], capture_output=True, text=True, env=env,
                         timeout=timeout, preexec_fn=limit)  # noqa: PLW1509 - no threads here
    return res.returncode, res.stderr, time.perf_counter() - t0


def test_value_type_flipped_to_array_fails_fast_naming_the_key(tmp_path: Path) -> None:
    """Issue 30.1: general.architecture's value type 8 (string) -> 9 (array) made gguf's reader iterate ~10^18
    items (>120 s, 3.4 GiB). Now: exit 2 at once, one line naming the file and the key, for inspect, convert and
    verify --against."""
    import time

    src = fixture_dir(*RANDOM_CASE) / "tensors.gguf"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_set(src.read_bytes(), "general.architecture type", 9))
    w4 = tmp_path / "w4"
    convert(src, w4, show_progress=False)
    for argv in (["inspect", str(bad)], ["convert", str(bad), str(tmp_path / "out")],
                 ["verify", str(w4), "--against", str(bad)]):
        rc, err, sec = _cli_one_line(argv)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and sec < 15, (err, sec)
        assert str(bad) in lines[0] and "'general.architecture'" in lines[0] and "array of" in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "w4"]

    def in_process() -> None:
        t0 = time.perf_counter()
        with pytest.raises(BadInputError, match="general.architecture"):
            GGUF.open(bad)
        assert time.perf_counter() - t0 < 1.0

    _guarded(in_process, timeout=30)


@pytest.mark.parametrize("offset,match", [
    (2**64 - 18, "not a multiple of the alignment"),  # the value: 18 bytes before the data section
    (2**64 - 32, "outside the data section"),  # aligned, and wrapping around to 32 bytes before it
    (2**63, "outside the data section"),
    (2**32, "outside the data section"),
])
def test_tensor_offset_outside_the_data_section_is_refused(offset: int, match: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30.2: a wrapped offset read 18 bytes before the data section, silently (convert and validate --deep
    exit 0, 98.8% of the weights wrong). Offsets are unsigned and must lie inside the data section."""
    src = fixture_dir(*RANDOM_CASE) / "tensors.gguf"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_set(src.read_bytes(), "blk.0.ffn_down.weight offset", offset))
    with pytest.raises(BadInputError, match=match) as exc:
        GGUF.open(bad)
    assert "tensor blk.0.ffn_down.weight" in str(exc.value) and str(bad) in str(exc.value)
    for argv in (["convert", str(bad), str(tmp_path / "out")], ["inspect", str(bad)]):
        capsys.readouterr()
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "tensor blk.0.ffn_down.weight" in err[0]
    assert not (tmp_path / "out").exists()


def test_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    src = fixture_dir(*RANDOM_CASE) / "tensors.gguf"
    data = src.read_bytes()
    first = struct.unpack_from("<Q", data, _field(data, "blk.0.ffn_down.weight offset")[0])[0]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_set(data, "source.weight offset", first))
    with pytest.raises(BadInputError, match="overlaps tensor"):
        GGUF.open(bad)


def test_tensor_data_past_the_end_is_refused(tmp_path: Path) -> None:
    """The last tensor's dimension grown so that its data runs past the end of the file (and, with 2^62, so that a
    64-bit size computation would wrap to a small number)."""
    src = fixture_dir(*RANDOM_CASE) / "tensors.gguf"
    for dim in (129, 2**62):
        bad = tmp_path / f"bad{dim}.gguf"
        bad.write_bytes(_set(src.read_bytes(), "source.weight dim 1", dim))
        with pytest.raises(BadInputError, match="outside the data section"):
            GGUF.open(bad)


_INTERESTING = [0, 1, 2, 3, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                2**63 - 1, 2**63, 2**64 - 18, 2**64 - 32, 2**64 - 1]


def _fuzz_one(tmp_path: Path, data: bytes, off: int, fmt: str, value: int) -> None:
    """Open and read everything; only a clean W4PackError (or success) is allowed, quickly and with little memory."""
    import time
    import tracemalloc

    from w4pack.errors import W4PackError

    width = struct.calcsize(fmt)
    b = bytearray(data)
    b[off:off + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(b))
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with GGUF.open(path) as s:
            for name in s.layer_names():
                s.read_layer(name)
            for name in s.passthrough_names():
                s.read_tensor(name)
    except W4PackError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
    finally:
        _cur, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0
    assert peak < 64 << 20, f"{peak} bytes allocated for a {len(data)}-byte file"


def _guarded(fn: Any, timeout: float = 120.0, max_rss: int = 1 << 30) -> None:
    """Run ``fn`` in a forked child watched from here: killed past ``timeout`` seconds or ``max_rss`` bytes of
    resident memory, so a reader that hangs or allocates without bound fails this test instead of taking the
    machine; an assertion in the child fails the test with its message."""
    import multiprocessing
    import time
    import traceback

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            fn()
            send.send(None)
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            send.send(traceback.format_exc(limit=-3))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    t0, peak = time.perf_counter(), 0
    try:
        while proc.is_alive() and not recv.poll(0.05):
            with contextlib.suppress(OSError):
                with open(f"/proc/{proc.pid}/status") as fh:
                    peak = max(peak, next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmRSS:")))
            assert peak < max_rss, f"the reader used {peak / 2**30:.1f} GiB"
            assert time.perf_counter() - t0 < timeout, f"the reader still runs after {timeout} s"
        outcome = recv.recv() if recv.poll(5) else f"the child died (exit {proc.exitcode})"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    assert outcome is None, outcome


def test_header_integer_mutations_fail_cleanly(tmp_path: Path) -> None:
    """Seeded fuzzing of every integer field of a real GGUF header (counts, lengths, value types, array counts,
    dims, tensor types and offsets) with boundary values: never a hang, a huge allocation, or an error other than
    a one-line W4PackError naming the file."""
    hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis to fuzz GGUF headers")
    st = hypothesis.strategies
    data = (fixture_dir(*RANDOM_CASE) / "tensors.gguf").read_bytes()
    fields = header_ints(data)
    assert len(fields) > 20

    @hypothesis.settings(max_examples=300, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(i=st.integers(0, len(fields) - 1),
                      value=st.one_of(st.sampled_from(_INTERESTING), st.integers(0, 2**64 - 1)),
                      delta=st.sampled_from([None, -1, 1]))
    def run(i: int, value: int, delta: int | None) -> None:
        _what, off, fmt = fields[i]
        if delta is not None:  # next to the original value: the near misses
            value = struct.unpack_from(fmt, data, off)[0] + delta
        _fuzz_one(tmp_path, data, off, fmt, value)

    _guarded(run)


def test_every_header_field_at_its_boundaries(tmp_path: Path) -> None:
    """Exhaustive companion of the fuzz test: every integer field, every boundary value."""
    data = (fixture_dir(*RANDOM_CASE) / "tensors.gguf").read_bytes()

    def run() -> None:
        for _what, off, fmt in header_ints(data):
            for value in _INTERESTING:
                _fuzz_one(tmp_path, data, off, fmt, value)

    _guarded(run)


# -- what llama.cpp needs from a GGUF written from a non-GGUF source (issue 32) ---------------------------------
def _memory_llama(tmp_path: Path, side: list[Path]) -> Source:
    """One-block llama in memory as a GPTQ/AWQ/CT reader gives it: fp16 RMSNorm weights, an fp16 bias."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from rtn_helper import MemorySource, rtn_quantize
    finally:
        sys.path.pop(0)
    rng = np.random.default_rng(5)
    cfg = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": 32}
    down = rtn_quantize(rng.normal(0, 0.05, (64, 96)), group_size=32,
                        bias=rng.normal(0, 0.1, 64).astype(np.float16))
    tensors = {
        "model.embed_tokens.weight": (rng.normal(0, 1, (32, 64)).astype(np.float16), "float16"),
        "model.layers.0.input_layernorm.weight": (rng.normal(1, 0.1, 64).astype(np.float16), "float16"),
        "model.norm.weight": (rng.normal(1, 0.1, 64).astype(np.float16), "float16"),
    }
    return MemorySource(cfg, {"model.layers.0.mlp.down_proj": down}, tensors, side)


def test_one_dimensional_floats_are_written_as_f32(tmp_path: Path) -> None:
    """llama.cpp's converter writes norms and other 1-D float tensors as F32 (its RMSNorm multiplies an F32
    activation by them: an F16 weight stops it with "binary_op: unsupported types"); 2-D ones keep their type."""
    src = _memory_llama(tmp_path, [])
    with pytest.warns(UserWarning, match="no tokenizer embedded"):
        GGUF.write(src, tmp_path / "x.gguf")
    t = tensors_by_name(tmp_path / "x.gguf")
    assert t["blk.0.attn_norm.weight"].tensor_type == Q.F32 and t["output_norm.weight"].tensor_type == Q.F32
    assert t["blk.0.ffn_down.bias"].tensor_type == Q.F32
    assert t["token_embd.weight"].tensor_type == Q.F16 and t["blk.0.ffn_down.weight"].tensor_type == Q.Q4_0
    for gname, hf in (("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                      ("output_norm.weight", "model.norm.weight")):
        assert np.array_equal(np.asarray(t[gname].data), src.read_tensor(hf).array.astype(np.float32))
    bias = src.read_layer("model.layers.0.mlp.down_proj").bias
    assert np.array_equal(np.asarray(t["blk.0.ffn_down.bias"].data), bias.astype(np.float32))


def _byte_level_tokenizer(folder: Path, *, add_prefix_space: bool, template_bos: bool) -> list[Path]:
    """A tiny byte-level BPE tokenizer.json (+ tokenizer_config.json), as a Hugging Face folder holds it."""
    vocab = {"<s>": 0, "</s>": 1, **{chr(c): i + 2 for i, c in enumerate(range(ord("a"), ord("z") + 1))},
             "Ġ": 28, "ab": 29}
    single = [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}] \
        if template_bos else [{"Sequence": {"id": "A", "type_id": 0}}]
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    doc = {"version": "1.0", "added_tokens": [{"id": 0, "content": "<s>", **flags},
                                              {"id": 1, "content": "</s>", **flags}],
           "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True,
                             "use_regex": True},
           "post_processor": {"type": "TemplateProcessing", "single": single, "pair": single,
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"], "dropout": None, "unk_token": None}}
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return [folder / "tokenizer.json", folder / "tokenizer_config.json"]


@pytest.mark.parametrize("prefix,bos", [(False, True), (True, False)])
def test_tokenizer_keys_llama_cpp_reads(prefix: bool, bos: bool, tmp_path: Path) -> None:
    """add_bos_token from the post-processor template and add_space_prefix from the ByteLevel pre-tokenizer are
    written; a pre-tokenizer llama.cpp does not know is not guessed, and the writer says so."""
    side = _byte_level_tokenizer(tmp_path / "tok", add_prefix_space=prefix, template_bos=bos)
    with pytest.warns(UserWarning, match="no tokenizer.ggml.pre written .*not recognised"):
        GGUF.write(_memory_llama(tmp_path, side), tmp_path / "x.gguf")
    fields = gguf.GGUFReader(str(tmp_path / "x.gguf")).fields
    assert fields["tokenizer.ggml.add_bos_token"].contents() is bos
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is prefix
    assert fields["tokenizer.ggml.model"].contents() == "gpt2" and "tokenizer.ggml.pre" not in fields
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 0


def test_gguf_tokenizer_not_exported_is_said_at_convert_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 32.3: without transformers the converted folder has no tokenizer; convert says so on stderr, with the
    fix, instead of leaving it to a later `run` error (and in --json's "warnings")."""
    import re

    make_tokenizer_gguf(tmp_path / "t.gguf")
    monkeypatch.setitem(sys.modules, "transformers", None)
    said = re.compile(r"tokenizer is not exported \(transformers is not installed\).*"
                      r"pip install 'w4pack\[hf\]'\) and convert again")
    capsys.readouterr()
    rc = main(["convert", str(tmp_path / "t.gguf"), str(tmp_path / "w4")])
    err = capsys.readouterr().err
    assert rc == 0 and not (tmp_path / "w4" / "tokenizer.json").exists()
    assert len([line for line in err.splitlines() if line.startswith("warning: ") and said.search(line)]) == 1, err
    rc = main(["convert", str(tmp_path / "t.gguf"), str(tmp_path / "w4b"), "--json"])
    assert rc == 0 and any(said.search(w) for w in json.loads(capsys.readouterr().out)["warnings"])
    with pytest.warns(UserWarning, match=said):  # the Python API issues it as a warning
        convert(tmp_path / "t.gguf", tmp_path / "w4c", show_progress=False)


def test_interrupted_write_leaves_nothing_and_keeps_the_old_output(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF is written in an owner-named temporary folder beside DST (which a later run can tell from a live
    writer's and remove); an interrupt removes it, and with --force the previous DST survives the failure."""
    import re

    src = fixture_dir(FAMILY, "q4_0_exact_in512_out256") / "tensors.gguf"
    w4 = tmp_path / "w4"
    convert(src, w4, show_progress=False)
    out = tmp_path / "x.gguf"
    out.write_bytes(b"GGUF-keep")
    seen: list[str] = []

    def interrupted(self: Any, tensor: Any) -> None:
        seen.extend(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(w4, out, to="gguf", force=True, show_progress=False)
    assert len(seen) == 1 and re.fullmatch(r"\.x\.gguf\.w4pack-tmp-\d+\.\d+\.[0-9a-f]{12}-\w{8}", seen[0]), seen
    assert out.read_bytes() == b"GGUF-keep" and sorted(p.name for p in tmp_path.iterdir()) == ["w4", "x.gguf"]


def test_the_gguf_license_reaches_the_model_card(tmp_path: Path) -> None:
    """general.license (apache-2.0 in SmolLM2's GGUF) was dropped: the card of the packed folder named none."""
    from huggingface_hub import ModelCard

    make_gguf(tmp_path / "m.gguf", license="apache-2.0")
    convert(tmp_path / "m.gguf", tmp_path / "w4", show_progress=False)
    assert ModelCard((tmp_path / "w4" / "README.md").read_text()).data.to_dict()["license"] == "apache-2.0"
