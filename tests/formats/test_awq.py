"""AWQ reader/writer: every fixture bit-exact against truth, peer bytes reproduced, round trips, refusals, bad input.

The decoders below are written independently of w4pack.formats.awq (per-nibble slicing, the reference's inverse
steps for GEMVFast), so a shared mistake in the module's pack/unpack cannot make both sides agree.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import MemSource, fixture_cases, fixture_dir
from w4pack.canonical import CanonicalLayer
from w4pack.checkpoint import open_checkpoint
from w4pack.cli import cli
from w4pack.convert import convert
from w4pack.dtypes import from_float32, to_float32
from w4pack.errors import BadInputError, IOFailure, UnsupportedError
from w4pack.formats import detect, get_format
from w4pack.formats.awq import awq_tensors
from w4pack.formats.base import TensorData
from w4pack.safetensors_io import SafetensorsFile, write_safetensors

AWQ = get_format("awq")
REV = (0, 4, 1, 5, 2, 6, 3, 7)
SINGLE = [c for c in fixture_cases("awq") if not c.startswith(("tiny_", "llm_awq_v1"))]
PREFIX = "model.layers.0.mlp.down_proj"


# -- independent decoders ---------------------------------------------------------------------
def dec_gemm(words: np.ndarray) -> np.ndarray:
    """int32 [R, C/8] -> [R, C]: column 8c+j sits in nibble REV[j]."""
    u = words.view(np.uint32)
    out = np.zeros((u.shape[0], u.shape[1] * 8), dtype=np.uint8)
    for j in range(8):
        out[:, j::8] = (u >> (4 * REV[j])) & 15
    return out


def dec_gemv(words: np.ndarray) -> np.ndarray:
    u = words.view(np.uint32)
    out = np.zeros((u.shape[0], u.shape[1] * 8), dtype=np.uint8)
    for i in range(8):
        out[:, i::8] = (u >> (4 * i)) & 15
    return out


def dec_gemv_fast(words: np.ndarray) -> np.ndarray:
    """int16 [N/4, K] -> [N, K], undoing the TinyChat packer step by step (reference §1.4)."""
    u = words.view(np.uint16).astype(np.int64)
    r, k = u.shape
    n = 4 * r
    nib = np.stack([(u >> (4 * j)) & 15 for j in range(4)], axis=-1)          # [N/4, K, 4]
    a = nib.reshape(r, k // 64, 64, 4).reshape(r, k // 64, 4, 64)             # undo the final regroup
    a = a.transpose(0, 2, 1, 3).reshape(n, k)                                 # undo the 4-row interleave
    a = a.reshape(n, k // 32, 4, 2, 4).transpose(0, 1, 2, 4, 3).reshape(n, k // 32, 32)  # undo [0,2,4,6,1,3,5,7]
    a = a.reshape(n, k // 32, 4, 4, 2).transpose(0, 1, 3, 2, 4).reshape(n, k)  # undo the (4,4,2) swap
    return a.astype(np.uint8)


def decode_file_layer(path: Path, prefix: str, version: str, k: int, ng: int) -> dict[str, np.ndarray]:
    """codes/zeros [N, *] and float32 scales [N, ng] straight from a written file (version as given)."""
    f = SafetensorsFile(path)
    st = lambda s: f.get(f"{prefix}.{s}")  # noqa: E731
    sdt = f.dtype_name(f"{prefix}.scales")
    if version == "gemm":
        out = {"codes": dec_gemm(st("qweight")).T, "zeros": dec_gemm(st("qzeros")).T,
               "scales": to_float32(st("scales"), sdt).T}
    elif version == "gemv":
        out = {"codes": dec_gemv(st("qweight")), "zeros": dec_gemv(st("qzeros"))[:, :ng],
               "scales": to_float32(st("scales"), sdt)[:, :ng]}
    else:
        s = to_float32(st("scales"), sdt)[:ng].T
        m = to_float32(st("qzeros"), sdt)[:ng].T
        out = {"codes": dec_gemv_fast(st("qweight")), "scales": s, "mins": m}
    f.close()
    return out


# -- helpers --------------------------------------------------------------------------------
def truth_of(case: Path, name: str | None) -> dict[str, np.ndarray]:
    t = case / "truth" / name if name and (case / "truth" / name).is_dir() else case / "truth"
    out = {k: np.load(t / f"{k}.npy") for k in ("codes", "scales", "zeros")}
    out["group_size"] = int(np.load(case / "truth" / "group_size.npy"))
    return out


def assert_truth(layer: CanonicalLayer, truth: dict[str, np.ndarray], zero_mode: str = "int") -> None:
    assert layer.bits == 4 and layer.zero_mode == zero_mode
    assert layer.group_size == truth["group_size"]
    np.testing.assert_array_equal(layer.codes, truth["codes"])
    np.testing.assert_array_equal(to_float32(layer.scales, layer.scale_dtype), truth["scales"])
    np.testing.assert_array_equal(layer.zero_points().astype(np.int64), truth["zeros"].astype(np.int64))
    g = np.arange(layer.in_features) // truth["group_size"]
    want = (truth["codes"].astype(np.float32) - truth["zeros"][:, g]) * truth["scales"][:, g]
    np.testing.assert_array_equal(layer.dequantize(np.float32), want)


def random_layer(rng: np.random.Generator, n: int, k: int, g: int, *, zero_mode: str = "int",
                 scale_dtype: str = "float16", bias: bool = False, act_order: bool = False) -> CanonicalLayer:
    ng = 1 if g == -1 else -(-k // g)
    s = rng.uniform(1e-3, 2e-2, size=(n, ng)).astype(np.float32)
    scales = from_float32(s, scale_dtype)
    zeros = None
    if zero_mode == "int":
        zeros = rng.integers(0, 16, size=(n, ng)).astype(np.int32)
    elif zero_mode == "float":
        zeros = from_float32(rng.uniform(-0.1, 0.0, size=(n, ng)).astype(np.float32), scale_dtype)
    g_idx = None
    if act_order:
        g_idx = (np.arange(k) // g).astype(np.int32)[rng.permutation(k)]
    layer = CanonicalLayer(codes=rng.integers(0, 16, size=(n, k)).astype(np.uint8), scales=scales, bits=4,
                           group_size=g, zero_mode=zero_mode, zeros=zeros, g_idx=g_idx, scale_dtype=scale_dtype)
    if bias:
        layer.bias, layer.bias_dtype = rng.standard_normal(n).astype(np.float16), "float16"
    return layer.validate()


# -- fixtures: every case bit-exact -------------------------------------------------------------
@pytest.mark.parametrize("case", SINGLE)
def test_single_layer_fixture_matches_truth(case: str) -> None:
    d = fixture_dir("awq", case)
    assert detect(d) == "awq"
    with AWQ.open(d) as src:
        assert src.layer_names() == [PREFIX] and src.passthrough_names() == []
        layer = src.read_layer(PREFIX)
        assert_truth(layer, truth_of(d, None), "none" if case.startswith("marlin") else "int")
        if "gemv_fast" in case or "v2_2024" in case:
            assert any("recovered exactly" in n for n in src.info["notes"])


@pytest.mark.parametrize("case", ["tiny_llama_gemm_g128", "llm_awq_v1_2023_tiny_llama_g128_pt"])
def test_whole_model_fixture_matches_truth(case: str) -> None:
    d = fixture_dir("awq", case)
    assert detect(d) == "awq"
    with AWQ.open(d) as src:
        names = src.layer_names()
        assert len(names) == 14
        for name in names:
            assert_truth(src.read_layer(name), truth_of(d, name))
        assert "model.embed_tokens.weight" in src.passthrough_names()
        assert "lm_head.weight" in src.passthrough_names()
        if case.startswith("llm_awq"):
            assert src.info["version"] == "llm-awq-v1-2023"


def test_symmetric_without_qzeros_outside_marlin_is_refused(tmp_path: Path) -> None:
    d = fixture_dir("awq", "gemm_g128_in512_out256")
    f = SafetensorsFile(d / "model.safetensors")
    (tmp_path / "m").mkdir()
    write_safetensors(tmp_path / "m" / "model.safetensors",
                      [(n, np.array(f.get(n)), None) for n in f.keys() if not n.endswith("qzeros")])
    with pytest.raises(UnsupportedError, match="symmetric AWQ without qzeros") as exc:
        AWQ.open(tmp_path / "m")
    assert f"{PREFIX}.qweight" in str(exc.value)


# -- peer bytes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["gemm_g128_in512_out256", "gemm_g64_in576_out128", "gemv_g128_in512_out256",
                                  "gemv_g64_in576_out128", "gemv_fast_g128_in512_out256",
                                  "marlin_g128_in512_out256"])
def test_rewrite_reproduces_peer_bytes(case: str, tmp_path: Path) -> None:
    d = fixture_dir("awq", case)
    version = "gemv_fast" if "gemv_fast" in case else case.split("_")[0]
    with AWQ.open(d) as src:
        AWQ.write(src, tmp_path / "out", version=version)
    a, b = SafetensorsFile(d / "model.safetensors"), SafetensorsFile(tmp_path / "out" / "model.safetensors")
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        assert a.info(name) == b.info(name), name
        assert a.get(name).tobytes() == b.get(name).tobytes(), name
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["version"] == version and qc["bits"] == 4
    assert json.loads((tmp_path / "out" / "quant_config.json").read_text())["w_bit"] == 4


def test_llm_awq_v2_rewritten_as_gemv_fast_matches_dump(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    d = fixture_dir("awq", "llm_awq_v2_2024_layer_g128_pt")
    with AWQ.open(d) as src:
        assert src.info["version"] == "llm-awq-v2-2024"
        AWQ.write(src, tmp_path / "out", version="gemv_fast")
    sd = torch.load(next(d.glob("*.pt")), weights_only=True)
    f = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    for mine, theirs in (("qweight", "qweight"), ("scales", "scales"), ("qzeros", "scaled_zeros")):
        t = sd[f"{PREFIX}.{theirs}"]
        assert f.get(f"{PREFIX}.{mine}").tobytes() == t.contiguous().numpy().tobytes(), mine


def test_whole_model_convert_to_w4pack_and_back(tmp_path: Path) -> None:
    d = fixture_dir("awq", "tiny_llama_gemm_g128")
    convert(d, tmp_path / "w4", show_progress=False)
    ck = open_checkpoint(tmp_path / "w4")
    for name in ck.layers:
        assert_truth(ck.layer(name), truth_of(d, name))
    convert(tmp_path / "w4", tmp_path / "awq", to="awq", show_progress=False)
    a, b = SafetensorsFile(d / "model.safetensors"), SafetensorsFile(tmp_path / "awq" / "model.safetensors")
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():  # quantized and pass-through tensors alike: the peer's bytes
        assert a.info(name) == b.info(name) and a.get(name).tobytes() == b.get(name).tobytes(), name
    cfg_a = json.loads((d / "config.json").read_text())
    cfg_b = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert cfg_a["quantization_config"] == cfg_b["quantization_config"]
    assert {k: v for k, v in cfg_a.items() if k != "quantization_config"} == \
        {k: v for k, v in cfg_b.items() if k != "quantization_config"}
    assert (tmp_path / "awq" / "generation_config.json").read_bytes() == (d / "generation_config.json").read_bytes()


def test_llm_awq_pt_converts_like_autoawq(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    d = fixture_dir("awq", "llm_awq_v1_2023_tiny_llama_g128_pt")
    convert(d, tmp_path / "w4", show_progress=False)
    convert(tmp_path / "w4", tmp_path / "awq", to="awq", show_progress=False)
    ref = SafetensorsFile(fixture_dir("awq", "tiny_llama_gemm_g128") / "model.safetensors")
    mine = SafetensorsFile(tmp_path / "awq" / "model.safetensors")
    for name in ref.keys():  # byte-identical to AutoAWQ's GEMM save of the same model (fixture README)
        if name.endswith((".qweight", ".qzeros", ".scales")):
            assert ref.get(name).tobytes() == mine.get(name).tobytes(), name


def test_tiny_model_logits_match_reference(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = fixture_dir("awq", "tiny_llama_gemm_g128")
    convert(d, tmp_path / "w4", show_progress=False)
    ck = open_checkpoint(tmp_path / "w4")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    config = transformers.LlamaConfig(**cfg)
    model = transformers.LlamaForCausalLM(config).float().eval()
    state = {name + ".weight": torch.from_numpy(ck.dequantize(name, np.float32)) for name in ck.layers}
    for t in ck.passthrough:
        state[t] = torch.from_numpy(np.array(to_float32(ck.raw(t), ck.dtype_name(t))))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    ids = torch.from_numpy(np.load(d / "truth" / "input_ids.npy")).long()
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
    ref = np.load(d / "truth" / "ref_logits_f32.npy")
    np.testing.assert_allclose(logits.reshape(ref.shape), ref, atol=1e-3, rtol=0)


# -- round trips of random layers ----------------------------------------------------------------
CASES = [  # (version, N, K, group size, scale dtype, bias)
    ("gemm", 24, 77, -1, "float16", True),     # odd K: one group per row
    ("gemm", 40, 96, 32, "bfloat16", False),
    ("gemm", 16, 192, 64, "float16", False),
    ("gemv", 12, 256, 64, "float16", True),     # N not a multiple of 8 is fine for GEMV
    ("gemv", 8, 328, -1, "bfloat16", False),
    ("gemv_fast", 20, 384, 128, "float16", False),
    ("gemv_fast", 8, 128, 32, "bfloat16", True),
    ("marlin", 64, 256, 64, "float16", False),
    ("marlin", 128, 96, -1, "bfloat16", True),   # one group: the single-scale permutation
]


@pytest.mark.parametrize("version,n,k,g,sdt,bias", CASES)
def test_random_round_trip(version: str, n: int, k: int, g: int, sdt: str, bias: bool, tmp_path: Path) -> None:
    rng = np.random.default_rng(abs(hash((version, n, k, g))) % 2**32)
    zm = "none" if version == "marlin" else "int"
    layers = {f"model.layers.{i}.mlp.up_proj": random_layer(rng, n, k, g, scale_dtype=sdt, bias=bias, zero_mode=zm)
              for i in range(2)}
    norm = TensorData(rng.standard_normal(k).astype(np.float16), "float16")
    AWQ.write(MemSource(layers, {"model.norm.weight": norm}), tmp_path / "out", version=version)
    ng = 1 if g == -1 else k // g
    with AWQ.open(tmp_path / "out") as back:
        assert back.layer_names() == list(layers) and back.passthrough_names() == ["model.norm.weight"]
        np.testing.assert_array_equal(back.read_tensor("model.norm.weight").array, norm.array)
        for name, layer in layers.items():
            assert back.read_layer(name).differences(layer) == []
            if version == "marlin":  # no independent decoder for the tile order: the fixture test pins it
                continue
            raw = decode_file_layer(tmp_path / "out" / "model.safetensors", name, version, k, ng)
            np.testing.assert_array_equal(raw["codes"], layer.codes)
            np.testing.assert_array_equal(raw["scales"], to_float32(layer.scales, sdt))
            if version != "gemv_fast":
                np.testing.assert_array_equal(raw["zeros"], layer.zeros)
            else:  # the peer's w = q*s + qz differs from s*(q-z) only by the rounding of -(s*z) to the scale dtype
                s64 = to_float32(layer.scales, sdt).astype(np.float64)
                grp = layer.g_idx
                mins = raw["mins"].astype(np.float64)[:, grp]
                peer = layer.codes * s64[:, grp] + mins
                exact = s64[:, grp] * (layer.codes - layer.zeros[:, grp].astype(np.float64))
                half_ulp = 2.0 ** -11 if sdt == "float16" else 2.0 ** -8
                assert np.all(np.abs(peer - exact) <= np.abs(mins) * half_ulp)
                np.testing.assert_array_equal(raw["mins"], -(s64 * layer.zeros).astype(np.float32)
                                              if sdt == "float32" else to_float32(
                                                  from_float32((-(s64 * layer.zeros)).astype(np.float32), sdt), sdt))


def test_symmetric_written_with_explicit_zero_8(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    layer = random_layer(rng, 16, 128, 64, zero_mode="none")
    AWQ.write(MemSource({"m.layers.0.q_proj": layer}), tmp_path / "out")
    back = AWQ.open(tmp_path / "out").read_layer("m.layers.0.q_proj")
    assert back.zero_mode == "int" and np.all(back.zeros == 8)
    np.testing.assert_array_equal(back.dequantize(np.float64), layer.dequantize(np.float64))


def test_float_minima_only_in_gemv_fast(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    layer = random_layer(rng, 8, 128, 64, zero_mode="float")
    src = MemSource({"m.layers.0.q_proj": layer})
    with pytest.raises(UnsupportedError, match="zero mode 'float'"):
        AWQ.write(src, tmp_path / "gemm")
    assert not (tmp_path / "gemm").exists()
    AWQ.write(src, tmp_path / "fast", version="gemv_fast")
    with AWQ.open(tmp_path / "fast") as back:
        got = back.read_layer("m.layers.0.q_proj")
        assert got.differences(layer) == []
        assert any("float minima" in n for n in back.info["notes"])


def test_inexact_scaled_zeros_stay_float(tmp_path: Path) -> None:
    """A GEMVFast qzeros value that is not -(s*z) for any integer z keeps the peer's dequantization exactly."""
    d = fixture_dir("awq", "gemv_fast_g128_in512_out256")
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.keys()}
    qz = tensors[f"{PREFIX}.qzeros"]
    qz[0, 0] = np.float16(float(qz[0, 0]) - 0.3 * float(tensors[f"{PREFIX}.scales"][0, 0]))
    (tmp_path / "src").mkdir()
    write_safetensors(tmp_path / "src" / "model.safetensors", [(n, a, None) for n, a in tensors.items()])
    layer = AWQ.open(tmp_path / "src").read_layer(PREFIX)
    assert layer.zero_mode == "float"
    s = tensors[f"{PREFIX}.scales"][:4].T.astype(np.float32)
    m = qz[:4].T.astype(np.float32)
    g = np.arange(512) // 128
    np.testing.assert_array_equal(layer.dequantize(np.float32), layer.codes * s[:, g] + m[:, g])


@pytest.mark.parametrize("version,member", [("gemv", "scales"), ("gemv_fast", "scales"), ("gemv_fast", "qzeros")])
def test_non_finite_padding_is_refused(version: str, member: str, tmp_path: Path) -> None:
    """GEMV and GEMVFast pad the groups to a width the kernels want; the padding is zeros and no reader uses it,
    so a NaN or infinity there is damage: refused with the tensor and position, not dropped unseen."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(11)
    name = "model.layers.0.mlp.up_proj"
    AWQ.write(MemSource({name: random_layer(rng, 16, 256, 128)}), tmp_path / "out", version=version)
    st = tmp_path / "out" / "model.safetensors"
    tensors = load_file(str(st))
    arr = tensors[f"{name}.{member}"].copy()
    at = (3, 5) if version == "gemv" else (5, 3)  # (past the 2 groups: a column of GEMV's, a row of GEMVFast's)
    with AWQ.open(tmp_path / "out") as sound:
        assert sound.read_layer(name).group_size == 128  # zeros there: the layer reads
    arr[at] = np.inf if member == "qzeros" else np.nan
    tensors[f"{name}.{member}"] = arr
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(BadInputError, match=rf"{member}: \[{at[0]}, {at[1]}\] is (nan|inf) in the padding past the "
                       r"layer's 2 groups") as exc:
        with AWQ.open(tmp_path / "out") as src:
            src.read_layer(name)
    assert "\n" not in str(exc.value)


# -- refusals, up front ------------------------------------------------------------------------
@pytest.mark.parametrize("change,match", [
    (dict(act_order=True), "act-order"),
    (dict(bits8=True), "8-bit"),
    (dict(zero16=True), "zero point of 16"),
    (dict(k=100), "not a multiple of group size"),
    (dict(mixed=True), "one group size per model"),
    (dict(version="marlin"), "Marlin is symmetric"),
    (dict(head=True), "quantized output head"),
])
def test_refusals_name_layer_and_way_out(change: dict[str, Any], match: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    k = change.get("k", 128)
    layer = random_layer(rng, 16, k, 32 if k == 100 else 64, act_order=change.get("act_order", False))
    if change.get("bits8"):
        layer = layer.replace(bits=8)
    if change.get("zero16"):
        z = layer.zeros.copy()
        z[3, 1] = 16
        layer = layer.replace(zeros=z)
    layers = {"model.layers.0.self_attn.q_proj": layer}
    if change.get("mixed"):
        layers["model.layers.0.self_attn.k_proj"] = random_layer(rng, 16, 128, 32)
    if change.get("head"):
        layers = {"lm_head": layer, **layers}
    with pytest.raises(UnsupportedError, match=match) as exc:
        AWQ.write(MemSource(layers), tmp_path / "out", version=change.get("version", "gemm"))
    assert ("lm_head" if change.get("head") else "model.layers.0.self_attn") in str(exc.value)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_force(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    src = MemSource({"m.layers.0.q_proj": random_layer(rng, 8, 64, 32)})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(IOFailure, match="--force"):
        AWQ.write(src, tmp_path / "out")
    assert (tmp_path / "out" / "keep").exists()
    with pytest.raises(IOFailure, match="holds no checkpoint"):  # --force replaces earlier outputs only
        AWQ.write(src, tmp_path / "out", force=True)
    (tmp_path / "out" / "model.safetensors").write_text("")
    AWQ.write(src, tmp_path / "out", force=True)
    assert not (tmp_path / "out" / "keep").exists()


# -- bad input: one line naming the file and the tensor ------------------------------------------
def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


def test_truncated_safetensors(tmp_path: Path) -> None:
    d = fixture_dir("awq", "gemm_g128_in512_out256")
    (tmp_path / "m").mkdir()
    data = (d / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(BadInputError) as exc:
        AWQ.open(tmp_path / "m")
    text = _one_line(exc.value)
    assert "model.safetensors" in text and "truncated" in text and "tensor" in text


def test_wrong_shapes_name_the_tensor(tmp_path: Path) -> None:
    d = fixture_dir("awq", "gemm_g128_in512_out256")
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.keys()}
    tensors[f"{PREFIX}.qzeros"] = tensors[f"{PREFIX}.qzeros"][:3]
    (tmp_path / "m").mkdir()
    write_safetensors(tmp_path / "m" / "model.safetensors", [(n, a, None) for n, a in tensors.items()])
    with pytest.raises(BadInputError) as exc:
        AWQ.open(tmp_path / "m")
    text = _one_line(exc.value)
    assert "model.safetensors" in text and f"{PREFIX}.qweight" in text


def test_config_group_size_contradicting_tensors(tmp_path: Path) -> None:
    d = fixture_dir("awq", "gemm_g128_in512_out256")
    shutil.copytree(d, tmp_path / "m", ignore=shutil.ignore_patterns("truth", "case.json"))
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"}}))
    with AWQ.open(tmp_path / "m") as src:
        with pytest.raises(BadInputError) as exc:
            src.read_layer(PREFIX)
    assert f"{PREFIX}.scales" in _one_line(exc.value) and "group_size 64" in str(exc.value)
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 128}}))
    with pytest.raises(UnsupportedError, match="8-bit"):
        AWQ.open(tmp_path / "m")


class _Boom:
    def __reduce__(self):  # a pickle that would run code when loaded without weights_only
        return (Path.touch, (Path(_Boom.marker),))


def test_pt_that_would_run_code_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    _Boom.marker = str(tmp_path / "pwned")
    (tmp_path / "m").mkdir()
    torch.save({f"{PREFIX}.qweight": torch.zeros(4, 1, dtype=torch.int32), "evil": _Boom()},
               tmp_path / "m" / "dump.pt")
    for call in (lambda: AWQ.open(tmp_path / "m"), lambda: detect(tmp_path / "m")):
        with pytest.raises(BadInputError) as exc:
            call()
        text = _one_line(exc.value)
        assert "dump.pt" in text and "weights_only" in text
    assert not (tmp_path / "pwned").exists()


def test_pt_with_non_tensor_entry_and_truncated_pt(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.save({f"{PREFIX}.qweight": torch.zeros(4, 1, dtype=torch.int32), "step": 3}, tmp_path / "a.pt")
    with pytest.raises(BadInputError) as exc:
        AWQ.open(tmp_path / "a.pt")
    assert "a.pt" in _one_line(exc.value) and "tensor step" in str(exc.value)
    src = next(fixture_dir("awq", "llm_awq_v2_2024_layer_g128_pt").glob("*.pt")).read_bytes()
    (tmp_path / "b.pt").write_bytes(src[: len(src) // 2])
    with pytest.raises(BadInputError) as exc:
        AWQ.open(tmp_path / "b.pt")
    assert "b.pt" in _one_line(exc.value)


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    d = fixture_dir("awq", "gemm_g128_in512_out256")
    (tmp_path / "m").mkdir()
    data = (d / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[:-64])
    proc = subprocess.run([sys.executable, "-m", "w4pack", "convert", tmp_path / "m", tmp_path / "out", "--from",
                           "awq"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "model.safetensors" in proc.stderr
    assert not (tmp_path / "out").exists()


# -- CLI ----------------------------------------------------------------------------------------
def test_cli_convert_to_w4pack_and_back_to_awq(tmp_path: Path) -> None:
    d = fixture_dir("awq", "gemv_g64_in576_out128")
    runner = CliRunner()
    res = runner.invoke(cli, ["convert", str(d), str(tmp_path / "w4")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["convert", str(tmp_path / "w4"), str(tmp_path / "awq"), "--to", "awq", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["format"] == "awq"
    with AWQ.open(tmp_path / "awq") as back:  # written as GEMM (the default) from a GEMV source
        assert back.info["version"] == "gemm"
        assert_truth(back.read_layer(PREFIX), truth_of(d, None))
    res = runner.invoke(cli, ["convert", str(tmp_path / "w4"), str(tmp_path / "awq"), "--to", "awq", "--dry-run"])
    assert res.exit_code == 0 and "cannot convert" not in res.output


def test_sharded_output_with_index_reads_back(tmp_path: Path) -> None:
    d = fixture_dir("awq", "tiny_llama_gemm_g128")
    with AWQ.open(d) as src:
        AWQ.write(src, tmp_path / "out", max_shard_size="300KB")
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and not (tmp_path / "out" / "model.safetensors").exists()
        for s in shards:  # a shard passes the limit only when one tensor alone is larger
            held = [t for t, f in index["weight_map"].items() if f == s]
            assert (tmp_path / "out" / s).stat().st_size <= 300_000 + 4096 or len(held) == 1, s
        assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]
        with AWQ.open(tmp_path / "out") as back:
            assert back.layer_names() == src.layer_names()
            for name in src.layer_names():
                assert back.read_layer(name).differences(src.read_layer(name)) == []
            for t in src.passthrough_names():
                assert back.read_tensor(t).array.tobytes() == src.read_tensor(t).array.tobytes()


def test_autoawq_01_quant_config_json(tmp_path: Path) -> None:
    """AutoAWQ 0.1.x kept its settings in quant_config.json (w_bit, q_group_size, upper-case version)."""
    d = fixture_dir("awq", "gemv_g64_in576_out128")
    shutil.copytree(d, tmp_path / "m", ignore=shutil.ignore_patterns("truth", "case.json"))
    (tmp_path / "m" / "quant_config.json").write_text(json.dumps(
        {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMV"}))
    assert detect(tmp_path / "m") == "awq"
    with AWQ.open(tmp_path / "m") as src:
        assert_truth(src.read_layer(PREFIX), truth_of(d, None))
        assert not src.info["notes"]
    (tmp_path / "m" / "quant_config.json").write_text(json.dumps(
        {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}))
    with AWQ.open(tmp_path / "m") as src:  # the tensors win over a contradicting version, with a note
        assert_truth(src.read_layer(PREFIX), truth_of(d, None))
        assert any("contradicts" in n for n in src.info["notes"])


@pytest.mark.parametrize("key,value", [("w_bit", "4"), ("w_bit", 4.0), ("q_group_size", 64.5), ("w_bit", True),
                                       ("q_group_size", float("inf")), ("q_group_size", 0), ("zero_point", "false"),
                                       ("version", 2), ("modules_to_not_convert", "lm_head")])
def test_mistyped_quant_config_is_refused(tmp_path: Path, key: str, value: object) -> None:
    """Settings are typed as AutoAWQ writes them: strings, floats, Infinity or "false" are a damaged config named
    with its key (int() used to coerce 64.5 to 64, read "false" as true and crash on Infinity)."""
    d = fixture_dir("awq", "gemv_g64_in576_out128")
    shutil.copytree(d, tmp_path / "m", ignore=shutil.ignore_patterns("truth", "case.json"))
    doc = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMV", key: value}
    (tmp_path / "m" / "quant_config.json").write_text(json.dumps(doc))
    with pytest.raises(BadInputError, match=r"quant_config\.json.*" + key.replace("w_bit", "bits").replace(
            "q_group_size", "group_size")):
        AWQ.open(tmp_path / "m")


def test_llm_awq_gemv_era_and_bf16_tinychat_dumps(tmp_path: Path) -> None:
    """llm-awq late-2023 dumps use the GEMV layout; 2025 TinyChat dumps may carry bf16 scales and scaled_zeros."""
    torch = pytest.importorskip("torch")
    d = fixture_dir("awq", "gemv_g128_in512_out256")
    f = SafetensorsFile(d / "model.safetensors")
    torch.save({n: torch.from_numpy(np.array(f.get(n))) for n in f.keys()}, tmp_path / "gemv-era.pt")
    with AWQ.open(tmp_path / "gemv-era.pt") as src:
        assert src.info["version"] == "llm-awq-gemv-2023"
        assert_truth(src.read_layer(PREFIX), truth_of(d, None))
    tr = truth_of(d, None)
    layer = CanonicalLayer(codes=tr["codes"], scales=from_float32(tr["scales"], "bfloat16"), bits=4, group_size=128,
                           zero_mode="int", zeros=tr["zeros"].astype(np.int32), scale_dtype="bfloat16").validate()
    t = {k: v for k, (v, _d) in awq_tensors(layer, "gemv_fast").items()}
    as_torch = lambda a: torch.from_numpy(np.array(a)).view(torch.bfloat16)  # noqa: E731
    torch.save({f"{PREFIX}.qweight": torch.from_numpy(t["qweight"]), f"{PREFIX}.scales": as_torch(t["scales"]),
                f"{PREFIX}.scaled_zeros": as_torch(t["qzeros"])}, tmp_path / "v2-bf16.pt")
    with AWQ.open(tmp_path / "v2-bf16.pt") as src:
        got = src.read_layer(PREFIX)
        assert got.scale_dtype == "bfloat16" and got.zero_mode == "int"
        assert got.differences(layer) == []


def test_unquantized_linears_listed_for_loaders(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    tensors = {n: TensorData(np.zeros(shape, dtype=np.float16), "float16") for n, shape in [
        ("model.embed_tokens.weight", (10, 64)), ("model.layers.0.mlp.gate.weight", (4, 64)),
        ("model.norm.weight", (64,)), ("lm_head.weight", (10, 64))]}
    AWQ.write(MemSource({"model.layers.0.self_attn.q_proj": random_layer(rng, 64, 64, 32)}, tensors), tmp_path / "o")
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["model.layers.0.mlp.gate"]


@pytest.mark.parametrize("version", ["gemm", "gemv", "gemv_fast"])
@pytest.mark.parametrize("case", ["gemm_g64_in576_out128", "llm_awq_v2_2024_layer_g128_pt"])
def test_w4pack_to_each_awq_version_decodes_to_truth(case: str, version: str, tmp_path: Path) -> None:
    if case.endswith("_pt"):
        pytest.importorskip("torch")
    d = fixture_dir("awq", case)
    tr = truth_of(d, None)
    convert(d, tmp_path / "w4", show_progress=False)
    if version == "gemv_fast" and tr["codes"].shape[1] % 64:
        pytest.skip("GEMVFast needs in_features % 64 == 0")
    convert(tmp_path / "w4", tmp_path / version, to="awq", version=version, show_progress=False)
    k = tr["codes"].shape[1]
    raw = decode_file_layer(tmp_path / version / "model.safetensors", PREFIX, version, k, k // tr["group_size"])
    np.testing.assert_array_equal(raw["codes"], tr["codes"])
    np.testing.assert_array_equal(raw["scales"], tr["scales"])
    if version == "gemv_fast":
        np.testing.assert_array_equal(raw["mins"], -(tr["scales"] * tr["zeros"]).astype(np.float16).astype(np.float32))
    else:
        np.testing.assert_array_equal(raw["zeros"], tr["zeros"])
    with AWQ.open(tmp_path / version) as back:
        assert back.read_layer(PREFIX).differences(open_checkpoint(tmp_path / "w4").layer(PREFIX)) == []


def test_float_minima_refusal_says_what_the_command_line_can_do(tmp_path: Path) -> None:
    """The refusal suggested AWQ version gemv_fast, which no CLI option selects: it names the Python call and the
    command line's way out."""
    layer = random_layer(np.random.default_rng(5), 8, 128, 64, zero_mode="float")
    with pytest.raises(UnsupportedError) as ei:
        AWQ.write(MemSource({"m.layers.0.q_proj": layer}), tmp_path / "gemm")
    text = str(ei.value)
    assert "version='gemv_fast'" in text and "Python API" in text and "from the command line: --to w4pack" in text


_EMPTY_P = "model.layers.0.mlp.down_proj"
#: layout -> tensors of one layer with a zero dimension (shapes consistent with each other, as a hostile writer makes)
EMPTY_LAYERS: dict[str, list[tuple[str, Any]]] = {
    "gemm": [("qweight", np.zeros((0, 2**37), np.int32)), ("qzeros", np.zeros((0, 2**37), np.int32)),
             ("scales", np.zeros((0, 2**40), np.float16))],
    "gemv": [("qweight", np.zeros((0, 64), np.int32)), ("qzeros", np.zeros((0, 1), np.int32)),
             ("scales", np.zeros((0, 8), np.float16))],
    "marlin": [("qweight", np.zeros((0, 512), np.int32)), ("scales", np.zeros((0, 256), np.float16))],
    "gemm-no-columns": [("qweight", np.zeros((512, 0), np.int32)), ("qzeros", np.zeros((4, 0), np.int32)),
                        ("scales", np.zeros((4, 0), np.float16))],
}


@pytest.mark.parametrize("layout", list(EMPTY_LAYERS))
def test_empty_quantized_layer_is_one_line(tmp_path: Path, layout: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A layer whose tensors have a zero dimension (a few hundred bytes of header claiming [0, 2^40]) ended in
    "unexpected ValueError: cannot reshape" or "ZeroDivisionError" for GEMM, GEMV and Marlin; every layout now
    names the tensor and exits 2 before anything is written."""
    from w4pack.cli import main
    from w4pack.safetensors_io import write_safetensors

    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(src / "model.safetensors", [(f"{_EMPTY_P}.{s}", a, None) for s, a in EMPTY_LAYERS[layout]])
    (src / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected" not in err and f"tensor {_EMPTY_P}" in err, err
    assert "empty" in err and str(src / "model.safetensors") in err, err
    assert not (tmp_path / "out").exists()
