"""GPTQ family: every peer fixture read bit-exactly against its truth, write -> read round trips, the
peers' own bytes reproduced, whole models through w4pack and back, refusals and hostile input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import w4pack
from w4pack.canonical import CanonicalLayer
from w4pack.cli import main as cli_main
from w4pack.convert import convert, plan
from w4pack.dtypes import from_float32, to_float32
from w4pack.errors import BadInputError, UnsupportedError
from w4pack.formats import detect, get_format
from w4pack.formats.base import TensorData
from w4pack.formats.gptq import GPTQFormat, GPTQWarning, write_gptq
from w4pack.safetensors_io import SafetensorsFile, write_safetensors

from conftest import MemSource, fixture_cases, fixture_dir

CASES = fixture_cases("gptq")
SINGLE = [c for c in CASES if "tiny_llama" not in c]
MODELS = [c for c in CASES if "tiny_llama" in c]
PREFIX = "model.layers.0.mlp.down_proj"


# ---------------------------------------------------------------------------------------------
# an independent decoder: np.unpackbits over the little-endian words, nothing shared with the reader
# ---------------------------------------------------------------------------------------------
def ref_unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Values of an LSB-first bit stream of int32 words along ``axis`` (0: down the rows)."""
    w = np.asarray(words).astype("<u4")
    if axis == 0:
        w = w.T
    raw = np.ascontiguousarray(w).view(np.uint8).reshape(w.shape[0], -1)
    stream = np.unpackbits(raw, axis=1, bitorder="little")
    vals = stream.reshape(w.shape[0], -1, bits).astype(np.int64) @ (1 << np.arange(bits, dtype=np.int64))
    return vals.T if axis == 0 else vals


def ref_decode(folder: Path, module: str, bits: int, v1: bool) -> dict[str, np.ndarray]:
    """codes [N,K], zeros [N,G] as a masking v1 (or v2) reader computes them, scales [N,G], g_idx, bias."""
    import torch
    from safetensors import safe_open

    tensors: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.startswith(module + "."):
                    t = sf.get_tensor(k)
                    tensors[k] = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 \
                        else t.numpy()
    codes = ref_unpack(tensors[f"{module}.qweight"], bits, 0).T
    fields = ref_unpack(tensors[f"{module}.qzeros"], bits, 1)
    zeros = ((fields + 1) % (1 << bits) if v1 else fields).T
    out = {"codes": codes, "zeros": zeros, "scales": tensors[f"{module}.scales"].T,
           "g_idx": tensors[f"{module}.g_idx"]}
    if f"{module}.bias" in tensors:
        out["bias"] = tensors[f"{module}.bias"]
    return out


def truth_of(case_dir: Path, module: str) -> dict[str, np.ndarray]:
    t = case_dir / "truth"
    if not (t / "codes.npy").exists():
        t = t / module
    out = {k: np.load(t / f"{k}.npy") for k in ("codes", "scales", "zeros", "g_idx")}
    read = sorted(t.glob("zeros_as_read_by_*.npy"))
    out["zeros_read"] = np.load(read[0]) if read else out["zeros"]
    return out


def assert_layer_is_truth(layer: CanonicalLayer, truth: dict[str, np.ndarray]) -> None:
    np.testing.assert_array_equal(layer.codes, truth["codes"])
    assert layer.codes.dtype == np.uint8
    np.testing.assert_array_equal(to_float32(layer.scales, layer.scale_dtype), truth["scales"])
    np.testing.assert_array_equal(layer.zero_points(), truth["zeros_read"])
    np.testing.assert_array_equal(layer.g_idx, truth["g_idx"])
    w = truth["scales"][:, truth["g_idx"]] * (truth["codes"].astype(np.float32)
                                              - truth["zeros_read"][:, truth["g_idx"]].astype(np.float32))
    np.testing.assert_array_equal(layer.dequantize(), w)


# ---------------------------------------------------------------------------------------------
# every fixture case, bit-exact
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_fixture_reads_truth(case: str) -> None:
    d = fixture_dir("gptq", case)
    meta = json.loads((d / "case.json").read_text())
    assert detect(d) == "gptq"
    with GPTQFormat.open(d) as src:
        names = src.layer_names()
        expect = sorted(meta["layers"]) if "layers" in meta else [meta["tensor_prefix"]]
        assert sorted(names) == expect
        for name in names:
            layer = src.read_layer(name)
            truth = truth_of(d, name)
            assert_layer_is_truth(layer, truth)
            assert layer.bits == int(np.load(d / "truth" / "bits.npy"))
            assert layer.group_size == int(np.load(d / "truth" / "group_size.npy"))
            assert layer.scale_dtype == "float16"
            # the canonical zero mode: sym -> "none" when every zero is 2**(b-1), asym -> "int"
            sym = meta.get("sym", "sym" in case)
            half = 1 << (layer.bits - 1)
            assert layer.zero_mode == ("none" if sym and np.all(truth["zeros_read"] == half) else "int")
            # the independent decoder agrees with the truth too (the spec, checked twice)
            ref = ref_decode(d, name, layer.bits, v1=src.read_layer(name).source["version"] == "gptq")
            np.testing.assert_array_equal(ref["codes"], truth["codes"])
            np.testing.assert_array_equal(ref["zeros"], truth["zeros_read"])
            if "bias" in ref:
                assert layer.bias is not None and layer.bias_dtype == "float16"
                np.testing.assert_array_equal(layer.bias, ref["bias"])
            else:
                assert layer.bias is None
        if "x.npy" in {p.name for p in (d / "truth").iterdir()} and (d / "truth" / "y_autogptq_forward.npy").exists():
            # AutoGPTQ's own forward used exactly these zeros (a wrong zero would be off by whole scales)
            layer = src.read_layer(names[0])
            x = np.load(d / "truth" / "x.npy").astype(np.float32)
            y = x @ layer.dequantize().T + layer.bias.astype(np.float32)
            err = float(np.abs(y - np.load(d / "truth" / "y_autogptq_forward.npy").astype(np.float32)).max())
            recorded = meta["peer_forward_check"]["y_autogptq_forward vs x@W(read zeros).T+bias max abs err"]
            # our float32 product vs the peer's fp16 one: same order as the recorded check
            assert err <= 2 * recorded + 1e-4
            if not np.array_equal(truth["zeros"], truth["zeros_read"]):
                intended = layer.replace(zeros=truth["zeros"].astype(np.int32))
                y_int = x @ intended.dequantize().T + layer.bias.astype(np.float32)
                err_int = float(np.abs(y_int - np.load(d / "truth" / "y_autogptq_forward.npy")).max())
                assert err_int > 10 * err  # the peer really computed with the wrapped zeros


def test_v1_zero_wrap_is_decoded_as_the_kernels_do() -> None:
    d = fixture_dir("gptq", "ag_b4_asym_g128_zero0")
    truth = truth_of(d, PREFIX)
    with GPTQFormat.open(d) as src:
        layer = src.read_layer(PREFIX)
        assert not np.array_equal(truth["zeros"], truth["zeros_read"])  # the fixture really is corrupted
        np.testing.assert_array_equal(layer.zeros, truth["zeros_read"])
        assert any(q.startswith("v1-zero-wrap") for q in layer.source["quirks"])
        assert any("v1-zero-wrap" in q for q in src.info["quirks"])


def test_gptqmodel_v1_borrow_masking_default_and_carry_option() -> None:
    d = fixture_dir("gptq", "gm_b4_asym_g64_zero0_v1")
    truth = truth_of(d, PREFIX)
    with GPTQFormat.open(d) as src:
        layer = src.read_layer(PREFIX)
        np.testing.assert_array_equal(layer.zeros, truth["zeros_read"])
        assert any("v1_zeros='carry'" in n for n in layer.source["notes"])
    with GPTQFormat.open(d, v1_zeros="carry") as src:
        np.testing.assert_array_equal(src.read_layer(PREFIX).zeros, truth["zeros"])


def _relabel(src_case: str, tmp: Path, **changes: Any) -> Path:
    d = tmp / src_case
    shutil.copytree(fixture_dir("gptq", src_case), d)
    qc_path = d / "quantize_config.json"
    qc = json.loads(qc_path.read_text())
    qc.update(changes)
    qc_path.chmod(0o644)
    qc_path.write_text(json.dumps(qc))
    return d


@pytest.mark.parametrize("case,label", [("gm_b4_sym_g128_descact_v2", "gptq"),
                                        ("gm_b4_sym_g128_descact_v1", "gptq_v2")])
def test_metadata_contradicting_zeros_is_detected(tmp_path: Path, case: str, label: str) -> None:
    d = _relabel(case, tmp_path, checkpoint_format=label, format=label)
    with pytest.warns(GPTQWarning, match="stored as"):
        src = GPTQFormat.open(d)
    with src:
        layer = src.read_layer(PREFIX)
        assert layer.source["version"] != label and "checkpoint-format-contradicted" in layer.source["quirks"]
        assert any("stored as" in n for n in src.info["notes"])
        assert_layer_is_truth(layer, truth_of(d, PREFIX))
        assert layer.zero_mode == "none"
    # naming the version the zero points contradict is refused: read so, every zero would be off by one
    with pytest.raises(BadInputError, match="symmetric layer") as exc:
        GPTQFormat.open(d, checkpoint_format=label)
    assert f"{PREFIX}.qzeros" in str(exc.value) and "detected format" in str(exc.value)


# ---------------------------------------------------------------------------------------------
# a named version (--from gptq-v2, checkpoint_format=...) decides only where the checkpoint cannot tell
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,named,detected", [
    ("ag_tiny_llama_b4_g64_descact_sym", "gptq_v2", "gptq"),  # no checkpoint_format, sym, qzeros 0x77777777
    ("gm_b4_sym_g128_descact_v1", "gptq_v2", "gptq"),
    ("gm_b4_sym_g128_descact_v2", "gptq", "gptq-v2"),
])
def test_named_version_contradicted_by_symmetric_zeros_is_refused(case: str, named: str, detected: str) -> None:
    d = fixture_dir("gptq", case)
    with pytest.raises(BadInputError) as exc:
        GPTQFormat.open(d, checkpoint_format=named)
    err = exc.value
    assert err.tensor is not None and err.tensor.endswith(".qzeros") and err.file and Path(err.file).parent == d
    assert f"(detected format: {detected};" in err.message and f"'{named}'" in err.message


@pytest.mark.parametrize("case,named", [("gm_b3_asym_g64_v1", "gptq_v2"), ("gm_b3_asym_g64_v2", "gptq"),
                                        ("gm_b4_asym_g64_zero0_v2", "gptq")])
def test_named_version_contradicted_by_the_config_is_refused(case: str, named: str) -> None:
    d = fixture_dir("gptq", case)
    with pytest.raises(BadInputError, match="the config says checkpoint_format") as exc:
        GPTQFormat.open(d, checkpoint_format=named)
    assert exc.value.file == str(d / "quantize_config.json") and "detected format: gptq" in exc.value.message


def test_named_version_decides_only_where_nothing_tells(tmp_path: Path) -> None:
    # asymmetric, no checkpoint_format (AutoGPTQ): the name decides, as before
    with GPTQFormat.open(fixture_dir("gptq", "ag_b4_asym_g64"), checkpoint_format="gptq_v2") as src:
        assert src.info["version"] == "gptq_v2"
    # the config says v1 but the symmetric zero points are v2 (vLLM #38966): naming v2 agrees with the data
    d = _relabel("gm_b4_sym_g128_descact_v2", tmp_path, checkpoint_format="gptq", format="gptq")
    with GPTQFormat.open(d, checkpoint_format="gptq_v2") as src:
        assert_layer_is_truth(src.read_layer(PREFIX), truth_of(d, PREFIX))
    # naming the version the checkpoint shows reads the truth
    d = fixture_dir("gptq", "gm_b4_sym_g128_descact_v2")
    with GPTQFormat.open(d, checkpoint_format="gptq_v2") as src:
        assert_layer_is_truth(src.read_layer(PREFIX), truth_of(d, PREFIX))


def test_cli_from_gptq_v2_on_v1_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = fixture_dir("gptq", "ag_tiny_llama_b4_g64_descact_sym")
    for cmd in (["convert", str(s), str(tmp_path / "v2w")], ["inspect", str(s)]):
        assert cli_main([*cmd, "--from", "gptq-v2"]) == 2
        out, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1 and out == ""
        assert str(s / "gptq_model-4bit-64g.safetensors") in err and "--from gptq-v2" in err
        assert "detected format: gptq;" in err and "Traceback" not in err
    assert not (tmp_path / "v2w").exists()
    # --from gptq names the family: a v2 checkpoint reads as v2
    v2 = fixture_dir("gptq", "gm_b4_sym_g128_descact_v2")
    assert cli_main(["convert", str(v2), str(tmp_path / "w"), "--from", "gptq"]) == 0
    assert cli_main(["verify", str(tmp_path / "w"), "--against", str(v2)]) == 0


# ---------------------------------------------------------------------------------------------
# the peers' bytes reproduced, and refusals
# ---------------------------------------------------------------------------------------------
def _tensor_bytes(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with SafetensorsFile(f) as sf:
            for k in sf.keys():
                dt, shape = sf.info(k)
                out[k] = (dt, shape, np.asarray(sf.get(k)).tobytes())
    return out


@pytest.mark.parametrize("case", [c for c in CASES if not (c.startswith("ag_") and "zero0" in c or "zero0_v1" in c)])
def test_rewrite_reproduces_peer_bytes(tmp_path: Path, case: str) -> None:
    d = fixture_dir("gptq", case)
    with GPTQFormat.open(d) as src:
        out = write_gptq(src, tmp_path / "out", checkpoint_format=src.info["version"], max_shard_size="400KB")
    assert _tensor_bytes(out) == _tensor_bytes(d)


@pytest.mark.parametrize("case", ["ag_b4_asym_g128_zero0", "gm_b4_asym_g64_zero0_v1"])
def test_zero_zero_refused_for_v1_and_kept_by_v2(tmp_path: Path, case: str) -> None:
    d = fixture_dir("gptq", case)
    with GPTQFormat.open(d) as src:
        with pytest.raises(UnsupportedError, match="gptq-v2") as exc:
            write_gptq(src, tmp_path / "v1")
        assert PREFIX in str(exc.value) and "\n" not in str(exc.value)
        assert not (tmp_path / "v1").exists() and list(tmp_path.iterdir()) == []
        out = write_gptq(src, tmp_path / "v2", checkpoint_format="gptq_v2")
        original = src.read_layer(PREFIX)
    qc = json.loads((out / "quantize_config.json").read_text())
    assert qc["checkpoint_format"] == "gptq_v2" and qc["sym"] is False
    with GPTQFormat.open(out) as back:
        assert back.read_layer(PREFIX).differences(original) == []
        assert back.info["version"] == "gptq_v2"


# ---------------------------------------------------------------------------------------------
# random layers: write -> read round trips
# ---------------------------------------------------------------------------------------------
def random_layer(rng: np.random.Generator, n: int, k: int, bits: int, gs: int, sym: bool, act_order: bool,
                 version: str = "gptq", scale_dtype: str = "float16", bias: bool = True) -> CanonicalLayer:
    groups = 1 if gs == -1 else -(-k // gs)
    if act_order and gs != -1:
        perm = rng.permutation(k)
        g_idx = np.empty(k, np.int32)
        g_idx[perm] = np.arange(k) // gs
    else:
        g_idx = None
    hi = (1 << bits) - 1
    zeros = None if sym else rng.integers(1 if version == "gptq" else 0, hi + 1, (n, groups)).astype(np.int32)
    scales = from_float32(rng.uniform(1e-3, 0.1, (n, groups)).astype(np.float32), scale_dtype)
    b = from_float32(rng.standard_normal(n).astype(np.float32), scale_dtype) if bias else None
    return CanonicalLayer(codes=rng.integers(0, hi + 1, (n, k)).astype(np.uint8), scales=scales, bits=bits,
                          group_size=gs, zero_mode="none" if sym else "int", zeros=zeros, g_idx=g_idx,
                          scale_dtype=scale_dtype, bias=b, bias_dtype=scale_dtype if bias else None).validate()


def _check_roundtrip(tmp: Path, layers: dict[str, CanonicalLayer], version: str) -> None:
    out = write_gptq(MemSource(layers), tmp, checkpoint_format=version, force=True)
    with GPTQFormat.open(out) as back:
        assert back.layer_names() == list(layers)
        for name, layer in layers.items():
            got = back.read_layer(name)
            assert got.differences(layer) == [], name
            ref = ref_decode(out, name, layer.bits, v1=version == "gptq")
            np.testing.assert_array_equal(ref["codes"], layer.codes)
            np.testing.assert_array_equal(ref["zeros"], layer.zero_points())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_roundtrip_grid(tmp_path: Path, bits: int, sym: bool, act_order: bool) -> None:
    """K=160 is not a multiple of 64 or 128: the last group is short, as GPTQ allows."""
    rng = np.random.default_rng(bits * 10 + sym * 2 + act_order)
    for version in ("gptq", "gptq_v2"):
        layers = {f"model.layers.{i}.mlp.up_proj": random_layer(rng, 64, 160, bits, gs, sym, act_order, version,
                                                                 bias=i % 2 == 0)
                  for i, gs in enumerate((-1, 32, 64, 128))}
        _check_roundtrip(tmp_path / version, layers, version)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bits=st.sampled_from([2, 3, 4, 8]), n32=st.integers(1, 4), k32=st.integers(1, 6),
       gs=st.sampled_from([-1, 16, 32, 48, 64, 128]), sym=st.booleans(), act=st.booleans(),
       version=st.sampled_from(["gptq", "gptq_v2"]), sdt=st.sampled_from(["float16", "bfloat16", "float32"]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_roundtrip_property(tmp_path: Path, bits: int, n32: int, k32: int, gs: int, sym: bool, act: bool,
                            version: str, sdt: str, bias: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, 32 * n32, 32 * k32, bits, gs, sym, act, version, sdt, bias)
    _check_roundtrip(tmp_path / "rt", {"model.layers.0.self_attn.q_proj": layer}, version)


def test_mixed_bits_dynamic_passthrough_and_side_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    layers = {
        "model.layers.0.self_attn.q_proj": random_layer(rng, 64, 128, 4, 128, True, False),
        "model.layers.0.mlp.down_proj": random_layer(rng, 64, 128, 8, 64, False, True),
        "model.layers.1.self_attn.q_proj": random_layer(rng, 64, 128, 4, 128, True, False),
        "lm_head": random_layer(rng, 96, 64, 4, 128, True, False, bias=False),
    }
    emb = TensorData(rng.standard_normal((96, 64)).astype(np.float16), "float16")
    norm = TensorData(np.full(64, 0x3F80, np.uint16), "bfloat16")
    plain = TensorData(rng.standard_normal((64, 64)).astype(np.float16), "float16")
    tensors = {"model.embed_tokens.weight": emb, "model.norm.weight": norm,
               "model.layers.1.mlp.down_proj.weight": plain}
    side = tmp_path / "tokenizer.json"
    side.write_text('{"x": 1}')

    class WithSide(MemSource):
        def side_files(self) -> list[Path]:
            return [side, tmp_path / "config.json"]

    (tmp_path / "config.json").write_text("{}")
    src = WithSide(layers, tensors, {"model_type": "llama", "quantization_config": {"quant_method": "awq"}})
    out = write_gptq(src, tmp_path / "out", max_shard_size="20KB")
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files and ".w4pack-incomplete" not in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    qc = json.loads((out / "quantize_config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == qc and cfg["model_type"] == "llama"
    assert qc["bits"] == 4 and qc["group_size"] == 128 and qc["lm_head"] is True and qc["desc_act"] is True
    assert qc["sym"] is True and qc["checkpoint_format"] == "gptq"
    assert qc["dynamic"]["+:^model\\.layers\\.0\\.mlp\\.down_proj$"] == {"bits": 8, "group_size": 64, "sym": False}
    assert "-:^model\\.layers\\.1\\.mlp\\.down_proj$" in qc["dynamic"]
    with GPTQFormat.open(out) as back:
        assert sorted(back.layer_names()) == sorted(layers)
        for name, layer in layers.items():
            assert back.read_layer(name).differences(layer) == []
        assert sorted(back.passthrough_names()) == sorted(tensors)
        for name, td in tensors.items():
            got = back.read_tensor(name)
            assert got.dtype == td.dtype and got.array.tobytes() == td.array.tobytes()
    # the config without its dynamic rule contradicts the 8-bit tensors: a clear one-line error
    qc.pop("dynamic")
    (out / "quantize_config.json").write_text(json.dumps(qc))
    (out / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc)))
    with pytest.raises(BadInputError, match="config says bits=4") as exc:
        GPTQFormat.open(out)
    assert "model.layers.0.mlp.down_proj.qweight" in str(exc.value) and ".safetensors" in str(exc.value)


@pytest.mark.parametrize("what", ["float", "bad_n", "bits_v2_top"])
def test_writer_refuses_what_gptq_cannot_hold(tmp_path: Path, what: str) -> None:
    rng = np.random.default_rng(3)
    layer = random_layer(rng, 64, 128, 4, 64, False, False)
    if what == "float":
        layer = layer.replace(zero_mode="float", zeros=from_float32(-np.ones((64, 2), np.float32), "float16"))
        fmt, match = "gptq-v2", "float-minimum"
    elif what == "bad_n":
        layer = random_layer(rng, 36, 128, 3, 64, True, False)
        fmt, match = "gptq", "N=36"
    else:
        layer = layer.replace(zeros=np.full((64, 2), 16, np.int32))
        fmt, match = "gptq-v2", "zero point 16"
    src = MemSource({"model.layers.0.mlp.up_proj": layer})
    with pytest.raises(UnsupportedError, match=match):
        get_format(fmt).write(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert get_format(fmt).check_writable(src)


# ---------------------------------------------------------------------------------------------
# whole models: GPTQ -> w4pack -> GPTQ
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", MODELS)
def test_model_converts_to_w4pack_and_back(tmp_path: Path, case: str) -> None:
    d = fixture_dir("gptq", case)
    summary = convert(d, tmp_path / "w4")
    ck = w4pack.open_checkpoint(tmp_path / "w4")
    with GPTQFormat.open(d) as src:
        assert summary["layers"] == len(src.layer_names()) == 14
        for name in src.layer_names():
            assert_layer_is_truth(ck.layer(name), truth_of(d, name))
        assert sorted(ck.passthrough) == sorted(src.passthrough_names())
        p = plan(tmp_path / "w4", to="gptq")
        assert p["problems"] == []
        convert(tmp_path / "w4", tmp_path / "back", to="gptq", max_shard_size="600KB")
        back = tmp_path / "back"
        assert (back / "model.safetensors.index.json").is_file()
        with GPTQFormat.open(back) as again:
            assert again.layer_names() == src.layer_names()
            for name in src.layer_names():
                assert again.read_layer(name).differences(src.read_layer(name)) == []
                ref = ref_decode(back, name, 4, v1=True)
                np.testing.assert_array_equal(ref["codes"], truth_of(d, name)["codes"])
            for t in src.passthrough_names():
                a, b = src.read_tensor(t), again.read_tensor(t)
                assert a.dtype == b.dtype and a.array.tobytes() == b.array.tobytes()
    qc = json.loads((back / "config.json").read_text())["quantization_config"]
    got = (qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"], qc["checkpoint_format"])
    assert got == (4, 64, True, True, "gptq")
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (back / side).is_file() == (d / side).is_file()
    ck.close()


# ---------------------------------------------------------------------------------------------
# GPTQ-for-LLaMa: config-less .pt (weights_only) and .safetensors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["ag_b3_asym_g64", "ag_b4_sym_g128_descact", "ag_b8_asym_g64_descact"])
def test_gptq_for_llama_single_files(tmp_path: Path, case: str) -> None:
    torch = pytest.importorskip("torch")
    d = fixture_dir("gptq", case)
    with SafetensorsFile(next(d.glob("*.safetensors"))) as sf:
        arrays = {k: np.array(sf.get(k)) for k in sf.keys()}
    pt = tmp_path / "llama7b-4bit.pt"
    torch.save({k: torch.from_numpy(v) for k, v in arrays.items()}, pt)
    st_file = tmp_path / "llama7b-4bit.safetensors"
    write_safetensors(st_file, [(k, v, None) for k, v in arrays.items()])
    truth = truth_of(d, PREFIX)
    for f in (pt, st_file):
        assert GPTQFormat.detect(f)
        with GPTQFormat.open(f) as src:
            layer = src.read_layer(PREFIX)
            assert "GPTQ-for-LLaMa" in src.info["producer"]
            np.testing.assert_array_equal(layer.codes, truth["codes"])
            np.testing.assert_array_equal(layer.zero_points(), truth["zeros_read"])
            np.testing.assert_array_equal(layer.g_idx, truth["g_idx"])
            assert layer.group_size == int(np.load(d / "truth" / "group_size.npy"))


def test_autogptq_bin_folder_and_dynamic_skip(tmp_path: Path) -> None:
    """AutoGPTQ's use_safetensors=False writes a .bin beside quantize_config.json; a GPTQModel "-:" rule
    that names a module stored quantized anyway is noted, not obeyed (the tensors decide)."""
    torch = pytest.importorskip("torch")
    d = fixture_dir("gptq", "ag_b4_asym_g64")
    with SafetensorsFile(next(d.glob("*.safetensors"))) as sf:
        arrays = {k: torch.from_numpy(np.array(sf.get(k))) for k in sf.keys()}
    folder = tmp_path / "m"
    folder.mkdir()
    torch.save(arrays, folder / "gptq_model-4bit-64g.bin")
    qc = json.loads((d / "quantize_config.json").read_text())
    qc["dynamic"] = {"-:.*down_proj": {}}
    (folder / "quantize_config.json").write_text(json.dumps(qc))
    assert detect(folder) == "gptq"
    with GPTQFormat.open(folder) as src:
        layer = src.read_layer(PREFIX)
        assert_layer_is_truth(layer, truth_of(d, PREFIX))
        assert any("dynamic rules skip" in n for n in layer.source["notes"])


def test_pt_that_is_not_only_tensors_is_refused_and_never_runs(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    bad = tmp_path / "evil.pt"
    torch.save({"model.layers.0.mlp.down_proj.qweight": Evil()}, bad)
    with pytest.raises(BadInputError, match="weights_only") as exc:
        GPTQFormat.open(bad)
    assert not marker.exists() and str(bad) in str(exc.value) and "\n" not in str(exc.value)
    odd = tmp_path / "odd.pt"
    torch.save({"model.layers.0.mlp.down_proj.qweight": torch.zeros(4, 4, dtype=torch.int32), "step": 3}, odd)
    with pytest.raises(BadInputError, match="not a tensor"):
        GPTQFormat.open(odd)


# ---------------------------------------------------------------------------------------------
# bad input: one line naming file and tensor
# ---------------------------------------------------------------------------------------------
def _single_copy(tmp: Path, case: str = "ag_b4_sym_g128") -> tuple[Path, Path, dict[str, np.ndarray]]:
    d = tmp / case
    shutil.copytree(fixture_dir("gptq", case), d, ignore=shutil.ignore_patterns("truth"))
    for p in d.iterdir():
        p.chmod(0o644)
    f = next(d.glob("*.safetensors"))
    with SafetensorsFile(f) as sf:
        arrays = {k: np.array(sf.get(k)) for k in sf.keys()}
    return d, f, arrays


def _rewrite(f: Path, arrays: dict[str, np.ndarray]) -> None:
    write_safetensors(f, [(k, v, None) for k, v in arrays.items()])


def test_wrong_shape_qweight_names_file_and_tensor(tmp_path: Path) -> None:
    d, f, arrays = _single_copy(tmp_path)
    arrays[f"{PREFIX}.qweight"] = arrays[f"{PREFIX}.qweight"][:-3]
    _rewrite(f, arrays)
    with pytest.raises(BadInputError) as exc:
        GPTQFormat.open(d)
    msg = str(exc.value)
    assert str(f) in msg and f"tensor {PREFIX}.qweight" in msg and "\n" not in msg


def test_truncated_file_names_file(tmp_path: Path) -> None:
    d, f, _ = _single_copy(tmp_path)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(BadInputError, match="truncated") as exc:
        GPTQFormat.open(d)
    assert str(f) in str(exc.value)


@pytest.mark.parametrize("defect", ["nan_scales", "g_idx_range", "config_bits", "group_size", "no_qzeros"])
def test_inconsistent_layers_are_bad_input(tmp_path: Path, defect: str) -> None:
    d, f, arrays = _single_copy(tmp_path)
    tensor = {"nan_scales": "scales", "g_idx_range": "g_idx", "config_bits": "qweight", "group_size": "scales",
              "no_qzeros": "qweight"}[defect]
    if defect == "nan_scales":
        arrays[f"{PREFIX}.scales"][1, 5] = np.nan
    elif defect == "g_idx_range":
        arrays[f"{PREFIX}.g_idx"][7] = 99
    elif defect == "no_qzeros":
        del arrays[f"{PREFIX}.qzeros"]
    else:
        qc = json.loads((d / "quantize_config.json").read_text())
        qc.update({"bits": 8} if defect == "config_bits" else {"group_size": 64})
        (d / "quantize_config.json").write_text(json.dumps(qc))
    _rewrite(f, arrays)
    with pytest.raises(BadInputError) as exc:
        with GPTQFormat.open(d) as src:
            src.read_layer(PREFIX)
    msg = str(exc.value)
    assert str(f) in msg and f"tensor {PREFIX}.{tensor}" in msg and "\n" not in msg


def test_sharded_index_defects(tmp_path: Path) -> None:
    case = "gm_tiny_llama_b4_g64_descact_sym_v1_sharded"
    d = tmp_path / "m"
    shutil.copytree(fixture_dir("gptq", case), d, ignore=shutil.ignore_patterns("truth"))
    for p in d.iterdir():
        p.chmod(0o644)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    escaped = dict(index, weight_map=dict(index["weight_map"], **{"lm_head.weight": "../outside.safetensors"}))
    (d / "model.safetensors.index.json").write_text(json.dumps(escaped))
    with pytest.raises(BadInputError, match="not a plain file name"):
        GPTQFormat.open(d)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model-00005-of-00005.safetensors").unlink()
    with pytest.raises(BadInputError, match="missing") as exc:
        GPTQFormat.open(d)
    assert "model-00005-of-00005.safetensors" in str(exc.value)


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------
def test_cli_convert_to_w4pack_and_back(tmp_path: Path) -> None:
    d = fixture_dir("gptq", "ag_tiny_llama_b4_g64_descact_sym")
    for args in (["convert", d, tmp_path / "w4"], ["convert", tmp_path / "w4", tmp_path / "g", "--to", "gptq"]):
        proc = subprocess.run([sys.executable, "-m", "w4pack", *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    with GPTQFormat.open(d) as a, GPTQFormat.open(tmp_path / "g") as b:
        for name in a.layer_names():
            assert b.read_layer(name).differences(a.read_layer(name)) == []


def test_cli_refusal_and_bad_input_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    zero0 = fixture_dir("gptq", "ag_b4_asym_g128_zero0")
    assert cli_main(["convert", str(zero0), str(tmp_path / "v1"), "--to", "gptq"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gptq-v2" in err and not (tmp_path / "v1").exists()
    assert cli_main(["convert", str(zero0), str(tmp_path / "v2"), "--to", "gptq-v2"]) == 0
    capsys.readouterr()
    d, f, arrays = _single_copy(tmp_path)
    arrays[f"{PREFIX}.qweight"] = arrays[f"{PREFIX}.qweight"][:, :-1]
    _rewrite(f, arrays)
    assert cli_main(["convert", str(d), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{PREFIX}.qweight" in err and str(f) in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# mistyped configs and indexes: one line naming the file and the key, never int()/bool() coercion
# ---------------------------------------------------------------------------------------------
def _refused_config(d: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, *needles: str) -> None:
    with pytest.raises(BadInputError) as exc:
        with GPTQFormat.open(d) as src:
            for name in src.layer_names():
                src.read_layer(name)
    msg = str(exc.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    capsys.readouterr()
    assert cli_main(["convert", str(d), str(tmp_path / "out"), "--from", "gptq"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("key,value,needle", [
    ("bits", "four", "bits must be an integer"), ("bits", True, "bits must be an integer"),
    ("bits", 4.0, "bits must be an integer"), ("group_size", "x", "group_size must be an integer"),
    ("group_size", [128], "group_size must be an integer"), ("group_size", float("nan"), "group_size must be"),
    ("group_size", 128.5, "group_size must be an integer"), ("group_size", 0, "group_size must be a positive"),
    ("group_size", -2, "group_size must be a positive"), ("sym", "false", "sym must be true or false"),
    ("sym", 0, "sym must be true or false"), ("desc_act", "yes", "desc_act must be true or false"),
    ("static_groups", 1, "static_groups must be"), ("is_marlin_format", "false", "is_marlin_format must be"),
    ("checkpoint_format", 2, "checkpoint_format must be a string"), ("wbits", "4", "wbits must be an integer"),
    ("dynamic", [1], "dynamic must be an object"), ("dynamic", {"+:.*": {"bits": "x"}}, "dynamic['+:.*'].bits"),
    ("dynamic", {"+:.*": {"sym": "false"}}, "dynamic['+:.*'].sym"), ("dynamic", {"+:.*": 3}, "dynamic['+:.*']"),
    ("dynamic", {"-:model.(": {}}, "not a valid regular expression"),
])
def test_mistyped_quantize_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any,
                                  needle: str) -> None:
    d = _relabel("ag_b4_asym_g64", tmp_path, **{key: value})
    _refused_config(d, capsys, tmp_path, str(d / "quantize_config.json"), needle)


def test_mistyped_config_json_quantization_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "m"
    shutil.copytree(fixture_dir("gptq", "ag_tiny_llama_b4_g64_descact_sym"), d, ignore=shutil.ignore_patterns("truth"))
    for p in d.iterdir():
        p.chmod(0o644)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["sym"] = "false"
    (d / "config.json").write_text(json.dumps(cfg))
    _refused_config(d, capsys, tmp_path, str(d / "config.json"), "quantization_config.sym must be true or false")


def test_hostile_quantize_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _relabel("ag_b4_asym_g64", tmp_path)
    (d / "quantize_config.json").write_text("[" * 100000)
    _refused_config(d, capsys, tmp_path, "quantize_config.json", "nested too deeply")
    (d / "quantize_config.json").write_text('{"bits": ' + "4" * 5000 + "}")
    _refused_config(d, capsys, tmp_path, "quantize_config.json", "not valid JSON")


@pytest.mark.parametrize("shard", [5, None, ["model-00001-of-00005.safetensors"]])
def test_index_shard_that_is_not_a_string(tmp_path: Path, capsys: pytest.CaptureFixture[str], shard: Any) -> None:
    d = tmp_path / "m"
    shutil.copytree(fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded"), d,
                    ignore=shutil.ignore_patterns("truth"))
    for p in d.iterdir():
        p.chmod(0o644)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused_config(d, capsys, tmp_path, "model.safetensors.index.json", "tensor lm_head.weight", "not a file name")


# -- messages (issues 30 and 32) ----------------------------------------------------------------------
def test_disk_full_names_the_destination_not_the_hidden_folder(tmp_path: Path, monkeypatch: Any) -> None:
    """The GPTQ writer's shards failed with "cannot write: No space left on device" naming the hidden
    .DST.w4pack-tmp-* file, which is gone when the message is read; the other writers say the disk is full and
    name DST."""
    import w4pack.store.shards as shards
    from conftest import full_disk_open
    from w4pack.errors import IOFailure

    monkeypatch.setattr(shards, "open", full_disk_open(lambda path, _mode: path.endswith(".safetensors")),
                        raising=False)
    out = tmp_path / "out"
    with pytest.raises(IOFailure, match="the disk is full") as ei:
        convert(fixture_dir("gptq", "ag_b4_sym_g128"), out, to="gptq", show_progress=False)
    text = str(ei.value)
    assert text.startswith(f"{out}: tensor model.layers.0.") and "w4pack-tmp" not in text and "\n" not in text, text
    assert list(tmp_path.iterdir()) == []


def test_refusal_names_the_gptq_version_once(tmp_path: Path) -> None:
    """"cannot write as GPTQ gptq": the version is named as users know it."""
    zero0 = fixture_dir("gptq", "ag_b4_asym_g128_zero0")
    with pytest.raises(UnsupportedError) as ei:
        convert(zero0, tmp_path / "v1", to="gptq", show_progress=False)
    assert "cannot write GPTQ v1: " in str(ei.value) and "GPTQ gptq" not in str(ei.value)


@pytest.mark.parametrize("name", ["GPTQ", "Gptq-V2"])
def test_format_names_in_any_case(tmp_path: Path, name: str) -> None:
    """`--to GPTQ` was refused as an unknown format."""
    src = fixture_dir("gptq", "ag_b4_sym_g128")
    assert get_format(name) is get_format(name.lower())
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--to", name, "--from", name.split("-")[0]]) == 0
    with get_format("gptq").open(tmp_path / "out") as back, get_format("gptq").open(src) as ref:
        for layer in ref.layer_names():
            assert back.read_layer(layer).differences(ref.read_layer(layer)) == []


def test_act_order_layer_without_g_idx_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """desc_act in the config and no g_idx: the column-to-group order is lost, so reading the layer as
    k // group_size would give other weights silently (found by tools/fuzz.py: the header entry deleted)."""
    from w4pack.store.safetensors import SafetensorsFile, write_safetensors

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("gptq", "ag_b4_asym_g32_descact"), src)
    shard = next(src.glob("*.safetensors"))
    with SafetensorsFile(shard) as f:  # rewritten without g_idx (deleting its header entry leaves a hole: refused)
        items = [(k, np.array(f.get(k)), f.dtype_name(k)) for k in f.keys() if not k.endswith(".g_idx")]
        meta = dict(f.metadata)
    write_safetensors(shard, items, meta)
    rc = cli_main(["convert", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "desc_act" in err and "no g_idx" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_backtracking_dynamic_pattern_is_refused_not_run(tmp_path: Path) -> None:
    """GPTQModel's ``dynamic`` rules are regular expressions matched against every module name; ``-:(.*.*)*!``
    made every command hang (Python's engine backtracks). Refused by name when the config is read."""
    from conftest import fixture_dir

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("gptq", "ag_b4_sym_g128"), src)
    qc_path = src / "quantize_config.json"
    qc_path.chmod(0o644)
    qc = json.loads(qc_path.read_text())
    qc["dynamic"] = {r"-:^lm_head$": {}, "-:(.*.*)*!": {}}
    qc_path.write_text(json.dumps(qc))
    proc = subprocess.run([sys.executable, "-m", "w4pack", "convert", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert str(qc_path) in lines[0] and "nests a repetition inside a repetition" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_checkpoint_format_refused_unless_from_names_the_version(tmp_path: Path, capsys) -> None:
    """Before: any checkpoint_format w4pack did not know was read as v1 without a word: a checkpoint storing v2
    zero points under another name got every zero shifted by one."""
    from conftest import cli_one_line

    src = tmp_path / "g"
    shutil.copytree(fixture_dir("gptq", "gm_b3_asym_g64_v2"), src)
    qc_path = src / "quantize_config.json"
    qc_path.chmod(0o644)
    qc = json.loads(qc_path.read_text())
    assert qc["checkpoint_format"] == "gptq_v2"
    qc_path.write_text(json.dumps(dict(qc, checkpoint_format="gptq_v3")))
    rc, err = cli_one_line(capsys, "inspect", src)
    assert rc == 3 and "quantize_config.json: GPTQ checkpoint_format 'gptq_v3' is not one w4pack knows" in err, err
    rc, err = cli_one_line(capsys, "convert", src, tmp_path / "out")
    assert rc == 3 and not (tmp_path / "out").exists()
    truth = GPTQFormat.open(fixture_dir("gptq", "gm_b3_asym_g64_v2"))
    forced = get_format("gptq-v2").open(src)
    name = truth.layer_names()[0]
    assert np.array_equal(forced.read_layer(name).zeros, truth.read_layer(name).zeros)


def test_quantize_config_naming_another_method_is_named(tmp_path: Path, capsys) -> None:
    """config.json says gptq, quantize_config.json (which wins) another method. Before: "cannot tell which format
    this is" (found by tools/fuzz.py); now the file and the method."""
    from conftest import cli_one_line

    src = tmp_path / "g"
    shutil.copytree(fixture_dir("gptq", "ag_b4_sym_g128"), src)
    qc_path = src / "quantize_config.json"
    qc_path.chmod(0o644)
    qc_path.write_text(json.dumps(dict(json.loads(qc_path.read_text()), quant_method="gptqx")))
    cfg = {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = cli_one_line(capsys, "inspect", src)
    assert rc == 3 and f"{qc_path}: quant_method is 'gptqx', not gptq" in err, err
