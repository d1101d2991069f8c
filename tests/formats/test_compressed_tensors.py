"""compressed-tensors pack-quantized: fixtures bit-exact, round trips, the peer's own (de)compressor, bad input.

The peer checks use the ``compressed-tensors`` package itself (a test dependency): what we write must decompress in
its ``PackedQuantizationCompressor`` to the bf16/fp16 rounding of our exact dequantization, and what it compresses
must read back in w4pack to exactly the codes, scales and zeros it was given.
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

from conftest import MemSource, edit_json, fixture_cases, fixture_dir
from w4pack.canonical import CanonicalLayer
from w4pack.checkpoint import open_checkpoint
from w4pack.cli import main
from w4pack.convert import convert
from w4pack.dtypes import from_float32, to_float32
from w4pack.errors import BadInputError, UnsupportedError
from w4pack.formats import detect, get_format
from w4pack.formats.base import TensorData
from w4pack.formats.compressed_tensors import pack_rows, unpack_rows
from w4pack.safetensors_io import SafetensorsFile, write_safetensors

CT = get_format("compressed-tensors")
FAMILY = "compressed-tensors"
SINGLE = [c for c in fixture_cases(FAMILY) if not c.startswith("tiny_")]
WHOLE = [c for c in fixture_cases(FAMILY) if c.startswith("tiny_")]
PREFIX = "model.layers.0.mlp.down_proj"


def rand_layer(n: int, k: int, *, bits: int = 4, group: int = 64, asym: bool = False, scale_dtype: str = "bfloat16",
               seed: int = 0) -> CanonicalLayer:
    rng = np.random.default_rng(seed)
    g = 1 if group == -1 else k // group
    scales = from_float32(rng.uniform(0.001, 0.05, (n, g)).astype(np.float32), scale_dtype)
    zeros = rng.integers(0, 1 << bits, (n, g)).astype(np.uint8) if asym else None
    return CanonicalLayer(codes=rng.integers(0, 1 << bits, (n, k)).astype(np.uint8), scales=scales, bits=bits,
                          group_size=group, zero_mode="int" if asym else "none", zeros=zeros,
                          scale_dtype=scale_dtype).validate()


def case_src(case: Path) -> Path:
    return case if (case / "config.json").is_file() else case / "model.safetensors"


def truth(case: Path, name: str) -> dict[str, np.ndarray]:
    t = case / "truth" / name if (case / "truth" / name).is_dir() else case / "truth"
    return {k: np.load(t / f"{k}.npy") for k in ("codes", "scales", "zeros")}


def assert_matches_truth(layer: CanonicalLayer, tr: dict[str, np.ndarray]) -> None:
    n, g = layer.scales.shape
    assert np.array_equal(layer.codes, tr["codes"])
    scales = to_float32(layer.scales, layer.scale_dtype)
    assert np.array_equal(scales, np.broadcast_to(tr["scales"].reshape(-1, tr["scales"].shape[-1]), (n, g)))
    assert np.array_equal(layer.zero_points(), np.broadcast_to(tr["zeros"].astype(np.int32), (n, g)))
    # the fixture's dequant formula, evaluated independently
    gi = np.zeros(layer.in_features, np.int64) if layer.group_size == -1 else \
        np.arange(layer.in_features) // layer.group_size
    z = np.broadcast_to(tr["zeros"].astype(np.float32), (n, g))
    s = np.broadcast_to(tr["scales"].astype(np.float32).reshape(-1, tr["scales"].shape[-1]), (n, g))
    assert np.array_equal(layer.dequantize(), (tr["codes"].astype(np.float32) - z[:, gi]) * s[:, gi])


def tensors_of(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with SafetensorsFile(f) as st:
            for t in st.keys():
                out[t] = (st.dtype_name(t), np.array(st.get(t)))
    return out


# -- bit streams ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("cols", [1, 7, 64, 70, 576])
def test_pack_rows_round_trip_and_bit_order(bits: int, cols: int) -> None:
    rng = np.random.default_rng(cols * 10 + bits)
    vals = rng.integers(0, 1 << bits, (3, cols)).astype(np.uint8)
    words = pack_rows(vals, bits)
    assert words.dtype == np.int32 and words.shape == (3, -(-cols * bits // 32))
    assert np.array_equal(unpack_rows(words, bits, cols), vals)
    # element e occupies bits e*b .. e*b+b-1 of the row's little-endian stream (independent big-int check)
    for r in range(3):
        stream = sum(int(w) << (32 * i) for i, w in enumerate(words[r].view(np.uint32)))
        got = [(stream >> (e * bits)) & ((1 << bits) - 1) for e in range(cols)]
        assert got == vals[r].tolist()


# -- fixtures ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case_name", SINGLE)
def test_single_layer_fixture_bit_exact(case_name: str) -> None:
    case = fixture_dir(FAMILY, case_name)
    meta = json.loads((case / "case.json").read_text())
    src = case_src(case)
    assert detect(src) == "compressed-tensors"
    with CT.open(src) as s:
        assert s.layer_names() == [PREFIX]
        layer = s.read_layer(PREFIX)
        assert layer.bits == meta["bits"]
        assert layer.zero_mode == ("none" if meta["symmetric"] else "int")
        assert layer.group_size == (meta["group_size"] if meta["strategy"] == "group" else -1)
        assert layer.scale_dtype == "bfloat16"
        assert layer.source["strategy"] == meta["strategy"]
        assert_matches_truth(layer, truth(case, PREFIX))


@pytest.mark.parametrize("case_name", WHOLE)
def test_whole_model_fixture_bit_exact(case_name: str) -> None:
    case = fixture_dir(FAMILY, case_name)
    with CT.open(case) as s:
        names = s.layer_names()
        expected = sorted(p.name for p in (case / "truth").iterdir() if p.is_dir())
        assert sorted(names) == expected
        for name in names:
            assert_matches_truth(s.read_layer(name), truth(case, name))
        assert "lm_head.weight" in s.passthrough_names() and "model.norm.weight" in s.passthrough_names()
        assert not any(".weight_" in t for t in s.passthrough_names())
        assert "quantization_config" not in s.config and s.config["model_type"] == "llama"
        assert s.info["version"] == "0.20.1"
        assert [p.name for p in s.side_files()] == ["generation_config.json"]


@pytest.mark.parametrize("case_name", SINGLE + WHOLE)
def test_round_trip_through_w4pack_is_byte_identical(case_name: str, tmp_path: Path) -> None:
    """compressed-tensors -> w4pack -> compressed-tensors gives back every tensor, bit for bit."""
    case = fixture_dir(FAMILY, case_name)
    src = case_src(case)
    convert(src, tmp_path / "w4", show_progress=False)
    ck = open_checkpoint(tmp_path / "w4")
    assert ck.manifest["source"]["format"] == "compressed-tensors"
    convert(tmp_path / "w4", tmp_path / "ct", to="compressed-tensors", show_progress=False)
    a, b = tensors_of(src), tensors_of(tmp_path / "ct")
    assert sorted(a) == sorted(b)
    for t, (dt, arr) in a.items():
        assert b[t][0] == dt, t
        assert b[t][1].shape == arr.shape and np.array_equal(b[t][1], arr), t
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    if (case / "config.json").is_file():
        orig = json.loads((case / "config.json").read_text())
        ow = orig["quantization_config"]["config_groups"]["group_0"]["weights"]
        nw = qc["config_groups"]["group_0"]["weights"]
        for key in ("num_bits", "type", "symmetric", "strategy", "group_size"):
            assert nw[key] == ow[key], key
        assert "lm_head" in qc["ignore"]
        assert {k: v for k, v in orig.items() if k != "quantization_config"} == \
            {k: v for k, v in json.loads((tmp_path / "ct" / "config.json").read_text()).items()
             if k != "quantization_config"}


# -- the peer's own code ----------------------------------------------------------------------------------------
def _peer_decompress(folder: Path) -> dict[str, np.ndarray]:
    """Decompress every layer of a folder we wrote with compressed-tensors' PackedQuantizationCompressor."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    sd = load_file(str(folder / "model.safetensors"))
    mods = sorted({k[: -len(".weight_packed")] for k in sd if k.endswith(".weight_packed")})
    out = {}
    for m in mods:
        scheme = None
        for g in qc.config_groups.values():
            if "Linear" in g.targets or m in g.targets:
                scheme = g
        assert scheme is not None, m
        local = {k[len(m) + 1:]: v for k, v in sd.items() if k.startswith(m + ".")}
        res = PackedQuantizationCompressor.decompress(local, scheme)
        out[m] = res["weight"].to(torch.float32).numpy()
    return out


def _rounded(w: np.ndarray, dtype: str) -> np.ndarray:
    return to_float32(from_float32(w, dtype), dtype) if dtype != "float32" else w


PEER_CASES = [
    # (n, k, bits, group, asym, scale dtype): N not a multiple of 8 pads the packed zero points
    (196, 576, 4, 64, True, "bfloat16"),
    (200, 256, 4, -1, True, "float16"),
    (128, 256, 4, 128, False, "float16"),
    (64, 128, 8, 32, True, "bfloat16"),
    (72, 96, 3, 32, True, "bfloat16"),
    (40, 128, 2, -1, False, "float32"),
]


@pytest.mark.parametrize("n,k,bits,group,asym,sdt", PEER_CASES)
def test_written_layers_decompress_in_compressed_tensors(n: int, k: int, bits: int, group: int, asym: bool,
                                                          sdt: str, tmp_path: Path) -> None:
    layer = rand_layer(n, k, bits=bits, group=group, asym=asym, scale_dtype=sdt, seed=n + k)
    CT.write(MemSource({PREFIX: layer}), tmp_path / "ct")
    st = tensors_of(tmp_path / "ct")
    assert st[f"{PREFIX}.weight_packed"][1].shape == (n, -(-k * bits // 32))
    if asym:
        assert st[f"{PREFIX}.weight_zero_point"][1].shape == (-(-n * bits // 32), layer.num_groups)
    else:
        assert f"{PREFIX}.weight_zero_point" not in st
    got = _peer_decompress(tmp_path / "ct")[PREFIX]
    # the peer computes (q - z) * s in the scale dtype: exact product rounded once
    assert np.array_equal(got, _rounded(layer.dequantize(np.float64).astype(np.float32), sdt))
    with CT.open(tmp_path / "ct") as s:
        assert s.read_layer(PREFIX).equals(layer)


@pytest.mark.parametrize("strategy,bits,sym,group", [("group", 4, False, 32), ("channel", 8, True, None),
                                                      ("tensor", 4, True, None), ("tensor", 4, False, None),
                                                      ("group", 3, False, 64)])
def test_peer_compressed_layers_read_exactly(strategy: str, bits: int, sym: bool, group: int | None,
                                            tmp_path: Path) -> None:
    """What compressed-tensors' own compressor writes reads back as exactly the codes/scales/zeros it was given."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import save_file

    n, k = 104, 192
    rng = np.random.default_rng(bits)
    g = k // group if strategy == "group" else 1
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rng.integers(lo, hi + 1, (n, k))
    zp = np.zeros((n, g), np.int64) if sym else rng.integers(lo, hi + 1, (n, g))
    if strategy == "tensor":
        zp = np.full((n, 1), zp[0, 0])
    if strategy == "tensor":
        scale = torch.tensor([0.0123], dtype=torch.bfloat16)
        s_full = np.full((n, 1), float(scale.float()), np.float32)
    else:
        scale = torch.tensor(rng.uniform(0.001, 0.05, (n, g)), dtype=torch.float32).to(torch.bfloat16)
        s_full = scale.float().numpy()
    gi = np.arange(k) // (k // g)
    w = ((q - zp[:, gi]) * s_full[:, gi]).astype(np.float32)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    state = {"weight": torch.tensor(w), "weight_scale": scale}
    if not sym:
        state["weight_zero_point"] = torch.tensor(zp[:1, 0] if strategy == "tensor" else zp, dtype=torch.int8)
    comp = PackedQuantizationCompressor.compress(state, scheme)
    save_file({f"{PREFIX}.{key}": v.contiguous() for key, v in comp.items()}, str(tmp_path / "model.safetensors"))
    cfg = {"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json")}},
        "ignore": ["lm_head"]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with CT.open(tmp_path) as s:
        layer = s.read_layer(PREFIX)
    off = 1 << (bits - 1)
    assert layer.bits == bits and layer.group_size == (group if strategy == "group" else -1)
    assert np.array_equal(layer.codes, (q + off).astype(np.uint8))
    assert np.array_equal(to_float32(layer.scales, "bfloat16"), np.broadcast_to(s_full, (n, g)))
    assert np.array_equal(layer.zero_points(), (zp + off).astype(np.int32))


def test_unpacked_zero_points_of_older_files_read_like_packed(tmp_path: Path) -> None:
    """Files from compressed-tensors < 0.9.4 keep asymmetric zero points unpacked (int8 [N, G], signed): they read
    as the same layer as the packed int32 [ceil(N·b/32), G] form written today (ours and compressed-tensors')."""
    rng = np.random.default_rng(7)
    n, k, g = 40, 128, 4
    layer = CanonicalLayer(codes=rng.integers(0, 16, (n, k)).astype(np.uint8),
                           scales=rng.uniform(0.01, 0.05, (n, g)).astype(np.float16), bits=4, group_size=k // g,
                           zero_mode="int", zeros=rng.integers(0, 16, (n, g)).astype(np.uint8), scale_dtype="float16")
    CT.write(MemSource({"model.layers.0.mlp.down_proj": layer}), tmp_path / "new")
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new", old)
    shard = next(old.glob("*.safetensors"))
    tensors = tensors_of(shard)
    assert tensors[f"{PREFIX}.weight_zero_point"][1].shape == (n * 4 // 32, g)
    tensors[f"{PREFIX}.weight_zero_point"] = ("int8", (layer.zeros.astype(np.int16) - 8).astype(np.int8))
    write_safetensors(shard, [(t, a, d) for t, (d, a) in tensors.items()])
    with CT.open(tmp_path / "new") as a, CT.open(old) as b:
        new_layer, old_layer = a.read_layer(PREFIX), b.read_layer(PREFIX)
    for got in (new_layer, old_layer):
        assert np.array_equal(got.codes, layer.codes) and np.array_equal(got.zero_points(), layer.zeros)


def test_transformers_loads_what_we_write(tmp_path: Path) -> None:
    """The whole-model fixture, re-written by w4pack, loads in transformers and gives the reference logits."""
    case = fixture_dir(FAMILY, "tiny_llama_w4a16_sym_g128")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    convert(case, tmp_path / "w4", show_progress=False)
    convert(tmp_path / "w4", tmp_path / "ct", to="compressed-tensors", show_progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct"), dtype=torch.float32)
    ids = torch.tensor(np.load(case / "truth" / "input_ids.npy"))
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
    ref = np.load(case / "truth" / "ref_logits_f32.npy")
    assert np.max(np.abs(logits - ref)) < 1e-4


# -- writer refusals --------------------------------------------------------------------------------------------
def test_writer_refuses_what_compressed_tensors_cannot_hold(tmp_path: Path) -> None:
    base = rand_layer(32, 128, group=32)
    fmin = base.replace(zero_mode="float", zeros=base.scales.copy())
    with pytest.raises(UnsupportedError, match="zero mode 'float'"):
        CT.write(MemSource({PREFIX: fmin}), tmp_path / "a")
    perm = base.replace(g_idx=np.random.default_rng(0).permutation(base.g_idx).astype(np.int32))
    with pytest.raises(UnsupportedError, match="act-order"):
        CT.write(MemSource({PREFIX: perm}), tmp_path / "b")
    short = rand_layer(32, 96, group=-1).replace(group_size=64, scales=from_float32(np.ones((32, 2), np.float32),
                                                                                     "bfloat16"))
    short = short.replace(g_idx=(np.arange(96) // 64).astype(np.int32)).validate()
    with pytest.raises(UnsupportedError, match="does not divide"):
        CT.write(MemSource({PREFIX: short}), tmp_path / "c")
    z16 = rand_layer(32, 128, group=32, asym=True)
    z16.zeros[0, 0] = 16
    with pytest.raises(UnsupportedError, match="signed 4-bit"):
        CT.write(MemSource({PREFIX: z16.validate()}), tmp_path / "d")
    assert not any(tmp_path.iterdir())  # nothing left behind


def test_mixed_schemes_get_explicit_targets(tmp_path: Path) -> None:
    layers = {"model.layers.0.mlp.up_proj": rand_layer(64, 128, group=64),
              "model.layers.0.mlp.down_proj": rand_layer(128, 64, bits=8, group=-1, asym=True, seed=3)}
    emb = TensorData(np.zeros((10, 128), np.float16), "float16")
    CT.write(MemSource(layers, {"model.embed_tokens.weight": emb}), tmp_path / "ct")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    targets = sorted(t for g in qc["config_groups"].values() for t in g["targets"])
    assert targets == sorted(layers)
    assert qc["ignore"] == ["lm_head", "model.embed_tokens"]
    with CT.open(tmp_path / "ct") as s:
        for name, layer in layers.items():
            assert s.read_layer(name).equals(layer)
        assert s.passthrough_names() == ["model.embed_tokens.weight"]


# -- bad input --------------------------------------------------------------------------------------------------
def _bad_copy(tmp_path: Path, edit: Any) -> Path:
    case = fixture_dir(FAMILY, "asym_group64_in256_out384")
    tensors = tensors_of(case / "model.safetensors")
    edit(tensors)
    out = tmp_path / "bad"
    out.mkdir()
    write_safetensors(out / "model.safetensors", [(t, a, d) for t, (d, a) in tensors.items()])
    return out


@pytest.mark.parametrize("what,edit,match", [
    ("narrow weight_packed", lambda t: t.__setitem__(f"{PREFIX}.weight_packed",
                                                     ("int32", t[f"{PREFIX}.weight_packed"][1][:, :-1].copy())),
     "words per row|fits no bit width"),
    ("scale rows", lambda t: t.__setitem__(f"{PREFIX}.weight_scale",
                                           ("bfloat16", t[f"{PREFIX}.weight_scale"][1][:-1].copy())),
     "rows"),
    ("zero point shape", lambda t: t.__setitem__(f"{PREFIX}.weight_zero_point",
                                                 ("int32", t[f"{PREFIX}.weight_zero_point"][1][:-1].copy())),
     "weight_zero_point shape"),
    ("weight_shape lies", lambda t: t.__setitem__(f"{PREFIX}.weight_shape", ("int64", np.array([383, 256]))),
     "weight_shape says 383 rows"),
    ("no weight_scale", lambda t: t.pop(f"{PREFIX}.weight_scale"), "tensor model.layers.0.mlp.down_proj.weight_scale"),
    ("empty scale groups", lambda t: t.__setitem__(f"{PREFIX}.weight_scale",
                                                   ("bfloat16", t[f"{PREFIX}.weight_scale"][1][:, :0].copy())),
     "weight_scale shape"),
    ("weight_packed dtype", lambda t: t.__setitem__(f"{PREFIX}.weight_packed",
                                                    ("float32", t[f"{PREFIX}.weight_packed"][1].view(np.float32))),
     "must be int32"),
])
def test_bad_tensors_are_one_line_errors(what: str, edit: Any, match: str, tmp_path: Path) -> None:
    bad = _bad_copy(tmp_path, edit)
    with pytest.raises(BadInputError, match=match) as exc:
        with CT.open(bad) as s:
            s.read_layer(PREFIX)
    assert "\n" not in str(exc.value) and "model.safetensors" in str(exc.value)
    rc = main(["convert", str(bad), str(tmp_path / "out")])
    assert rc == 2 and not (tmp_path / "out").exists()


def test_cli_bad_input_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _bad_copy(tmp_path, lambda t: t.pop(f"{PREFIX}.weight_zero_point"))
    cfg = {"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}}}}}
    (bad / "config.json").write_text(json.dumps(cfg))
    rc = main(["convert", str(bad), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "weight_zero_point" in err[0] and "asymmetric" in err[0]
    assert not (tmp_path / "out").exists()


def test_unsupported_formats_and_types(tmp_path: Path) -> None:
    case = fixture_dir(FAMILY, "tiny_llama_w4a16_sym_g128")
    work = tmp_path / "m"
    shutil.copytree(case, work, ignore=shutil.ignore_patterns("truth"))
    cfg = json.loads((work / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24"
    (work / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="marlin-24"):
        with CT.open(work) as s:
            s.read_layer(s.layer_names()[0])
    cfg["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized"
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"
    (work / "config.json").write_text(json.dumps(cfg))
    assert main(["convert", str(work), str(tmp_path / "out")]) == 3
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*down_proj$"]
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int"
    (work / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match="ignore"):
        with CT.open(work) as s:
            s.read_layer("model.layers.0.mlp.down_proj")


def test_weight_g_idx_of_older_files_is_read(tmp_path: Path) -> None:
    """Files from compressed-tensors < 0.20 with actorder "group" carry weight_g_idx: a group per input column."""
    n, k, gs = 48, 128, 32
    src = tmp_path / "src"  # the w4pack output goes beside the source folder, not inside it
    src.mkdir()
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    g_idx = rng.permutation(np.arange(k) // gs).astype(np.int32)
    scales = from_float32(rng.uniform(0.01, 0.05, (n, k // gs)).astype(np.float32), "bfloat16")
    items = [(f"{PREFIX}.weight_packed", pack_rows(codes, 4), None), (f"{PREFIX}.weight_scale", scales, "bfloat16"),
             (f"{PREFIX}.weight_shape", np.array([n, k], np.int64), None), (f"{PREFIX}.weight_g_idx", g_idx, None)]
    write_safetensors(src / "model.safetensors", items)
    cfg = {"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "version": "0.9.2", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": gs,
            "actorder": "group"}}}, "ignore": ["lm_head"]}}
    (src / "config.json").write_text(json.dumps(cfg))
    with CT.open(src) as s:
        layer = s.read_layer(PREFIX)
    assert layer.act_order and np.array_equal(layer.g_idx, g_idx)
    s_f = to_float32(scales, "bfloat16")
    assert np.array_equal(layer.dequantize(), (codes.astype(np.float32) - 8) * s_f[:, g_idx])
    convert(src, tmp_path / "w4", show_progress=False)
    assert open_checkpoint(tmp_path / "w4").layer(PREFIX).equals(layer)
    g_bad = g_idx.copy()
    g_bad[0] = k // gs
    items[3] = (f"{PREFIX}.weight_g_idx", g_bad, None)
    write_safetensors(src / "model.safetensors", items)
    with pytest.raises(BadInputError, match="weight_g_idx values outside"):
        with CT.open(src) as s:
            s.read_layer(PREFIX)


# -- hostile config.json and index ------------------------------------------------------------------------------
def _model_copy(tmp_path: Path) -> Path:
    work = tmp_path / "m"
    shutil.copytree(fixture_dir(FAMILY, "tiny_llama_w4a16_sym_g128"), work, ignore=shutil.ignore_patterns("truth"))
    return work


def _open_all(folder: Path) -> None:
    with CT.open(folder) as s:
        for name in s.layer_names():
            s.read_layer(name)


def _refused_one_line(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    with pytest.raises(BadInputError) as exc:
        _open_all(folder)
    assert "\n" not in str(exc.value)
    for needle in needles:
        assert needle in str(exc.value), str(exc.value)
    capsys.readouterr()
    rc = main(["convert", str(folder), str(tmp_path / "out"), "--from", "compressed-tensors"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "unexpected" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("key,value,needle", [
    ("group_size", "x", "weights.group_size"), ("group_size", 128.5, "weights.group_size"),
    ("group_size", [128], "weights.group_size"), ("group_size", 0, "weights.group_size"),
    ("group_size", True, "weights.group_size"), ("num_bits", "four", "weights.num_bits"),
    ("num_bits", 4.0, "weights.num_bits"), ("symmetric", "false", "weights.symmetric"),
    ("symmetric", 0, "weights.symmetric"), ("strategy", ["group"], "weights.strategy"),
])
def test_bad_weight_arguments(key: str, value: Any, needle: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    work = _model_copy(tmp_path)
    cfg = json.loads((work / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"][key] = value
    (work / "config.json").write_text(json.dumps(cfg))
    _refused_one_line(work, tmp_path, capsys, "config.json", "config_groups.group_0." + needle)


@pytest.mark.parametrize("edit,needle", [
    (lambda q: q["config_groups"]["group_0"].__setitem__("targets", ["re:model.("]), "not a valid regular expression"),
    (lambda q: q.__setitem__("ignore", ["lm_head", "re:lm_head("]), "ignore: 're:lm_head('"),
    (lambda q: q["config_groups"]["group_0"].__setitem__("targets", 5), "targets must be a list of strings"),
    (lambda q: q["config_groups"]["group_0"].__setitem__("targets", ["Linear", 3]), "targets must be a list"),
])
def test_bad_targets(edit: Any, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = _model_copy(tmp_path)
    cfg = json.loads((work / "config.json").read_text())
    edit(cfg["quantization_config"])
    (work / "config.json").write_text(json.dumps(cfg))
    _refused_one_line(work, tmp_path, capsys, "config.json", needle)


def test_quantization_config_not_an_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = _model_copy(tmp_path)
    cfg = json.loads((work / "config.json").read_text())
    cfg["quantization_config"] = [1]
    (work / "config.json").write_text(json.dumps(cfg))
    _refused_one_line(work, tmp_path, capsys, "config.json", "quantization_config is a list")


@pytest.mark.parametrize("text,needle", [("[" * 100000, "nested too deeply"),
                                         ('{"a": ' + "9" * 5000 + "}", "not valid JSON")])
def test_hostile_json_documents(text: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = _model_copy(tmp_path)
    (work / "config.json").write_text(text)
    _refused_one_line(work, tmp_path, capsys, "config.json", needle)
    work2 = _model_copy(tmp_path / "2")
    (work2 / "model.safetensors.index.json").write_text(text)
    _refused_one_line(work2, tmp_path / "2", capsys, "model.safetensors.index.json", needle)


def _sharded(tmp_path: Path) -> tuple[Path, list[str]]:
    work = _model_copy(tmp_path)
    with SafetensorsFile(work / "model.safetensors") as f:
        names = f.keys()
    (work / "model.safetensors").rename(work / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
    (work / "model.safetensors.index.json").write_text(json.dumps(index))
    return work, names


def test_index_weight_map_and_shard_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work, names = _sharded(tmp_path)
    _open_all(work)  # the well-formed index reads
    idx = work / "model.safetensors.index.json"
    for wm, needle in ([[1], "no weight_map object"], [{names[0]: 5}, "not a plain file name"],
                       [{names[0]: "../model-00001-of-00001.safetensors"}, "not a plain file name"],
                       [{names[0]: ".hidden.safetensors"}, "not a plain file name"]):
        idx.write_text(json.dumps({"weight_map": wm}))
        _refused_one_line(work, tmp_path, capsys, "model.safetensors.index.json", needle)


def test_shard_symlinked_out_of_the_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work, _names = _sharded(tmp_path / "a")
    outside = tmp_path / "outside.safetensors"
    (work / "model-00001-of-00001.safetensors").rename(outside)
    (work / "model-00001-of-00001.safetensors").symlink_to(outside)
    _refused_one_line(work, tmp_path, capsys, "model.safetensors.index.json", "symbolic link out of the folder")


@pytest.mark.parametrize("pattern,says", [
    ("re:(.*.*)*!", "nests a repetition inside a repetition"),
    ("re:(ab|a.)*!", "repeats a choice of alternatives"),
    ("re:" + ".*" * 12 + "!", "has 12 unbounded repetitions"),
])
def test_backtracking_pattern_is_refused_not_run(tmp_path: Path, pattern: str, says: str) -> None:
    """A few bytes of config.json made every command hang: Python's regex engine backtracks, and matching
    ``re:(.*.*)*!`` against "model.layers.0.mlp.down_proj" takes longer than anyone waits. Such a pattern is refused
    by name before any module is matched; compressed-tensors' own patterns still read."""
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128"), src)
    (src / "config.json").chmod(0o644)
    doc = json.loads((src / "config.json").read_text())
    doc["quantization_config"]["ignore"] = ["lm_head", "re:.*embed_tokens", pattern]
    (src / "config.json").write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "w4pack", "convert", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{src / 'config.json'}: ignore: " in lines[0] and says in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
    doc["quantization_config"]["ignore"] = ["lm_head", "re:.*embed_tokens", r"re:.*self_attn.(q|k|v)_proj_x$"]
    (src / "config.json").write_text(json.dumps(doc))
    assert CT.open(src).layer_names()


def test_a_refusal_names_the_source_and_counts_the_other_layers(tmp_path: Path) -> None:
    """The writer stopped at the first layer it cannot express ("tensor lm_head: ... 6-bit layers"), naming
    neither the source nor how many more would fail, where the GPTQ writer says both."""
    src = Path(__file__).resolve().parent.parent / "data" / "llama_quantize" / "tiny-Q4_K_M.gguf"
    convert(src, tmp_path / "w4", show_progress=False)
    with pytest.raises(UnsupportedError, match=r"cannot write compressed-tensors: lm_head: .*6-bit layers.*"
                                               r"\(and \d+ more layer\(s\)\)") as exc:
        convert(tmp_path / "w4", tmp_path / "ct", to="compressed-tensors", show_progress=False)
    assert exc.value.file == str(tmp_path / "w4") and not (tmp_path / "ct").exists()


def _legacy_pack_rows(vals: np.ndarray, bits: int) -> np.ndarray:
    """Older compressed-tensors' packing of odd widths: 32 // b whole values per int32, low value first."""
    per = 32 // bits
    r, c = vals.shape
    padded = np.zeros((r, -(-c // per) * per), np.uint64)
    padded[:, :c] = vals
    shifts = np.arange(per, dtype=np.uint64) * np.uint64(bits)
    return (padded.reshape(r, -1, per) << shifts).sum(axis=2).astype(np.uint32).view(np.int32)


def test_whole_values_per_word_zero_points_of_older_3bit_files(tmp_path: Path) -> None:
    """Older compressed-tensors pack 3-bit codes and zero points 10 whole values a word. Before: the codes were
    read so, the zero points refused ("fits neither packed [6, 4] nor unpacked [64, 4]")."""
    rng = np.random.default_rng(11)
    n, k, g = 64, 128, 4
    layer = CanonicalLayer(codes=rng.integers(0, 8, (n, k)).astype(np.uint8),
                           scales=rng.uniform(0.01, 0.05, (n, g)).astype(np.float16), bits=3, group_size=k // g,
                           zero_mode="int", zeros=rng.integers(0, 8, (n, g)).astype(np.uint8), scale_dtype="float16")
    CT.write(MemSource({PREFIX: layer}), tmp_path / "new")
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new", old)
    shard = next(old.glob("*.safetensors"))
    tensors = tensors_of(shard)
    tensors[f"{PREFIX}.weight_packed"] = ("int32", _legacy_pack_rows(layer.codes, 3))
    tensors[f"{PREFIX}.weight_zero_point"] = ("int32", np.ascontiguousarray(_legacy_pack_rows(layer.zeros.T, 3).T))
    assert tensors[f"{PREFIX}.weight_zero_point"][1].shape == (7, g)  # against 6 rows of the dense stream
    write_safetensors(shard, [(t, a, d) for t, (d, a) in tensors.items()])
    with CT.open(old) as s:
        got = s.read_layer(PREFIX)
    assert np.array_equal(got.codes, layer.codes) and np.array_equal(got.zero_points(), layer.zeros)
    assert "whole values per int32" in got.source["quirk"]


def _edit_scheme(folder: Path, **changes: Any) -> None:
    edit_json(folder / "config.json", changes,
              lambda cfg: next(iter(cfg["quantization_config"]["config_groups"].values()))["weights"])


@pytest.mark.parametrize("bits,group,changes", [
    (4, 64, {"strategy": "GROUP", "type": "INT"}),  # the peer lower-cases both
    (4, -1, {"strategy": None, "group_size": -1}),  # no strategy, group size -1: channel
    (8, 64, {"num_bits": None}),  # the peer's default width is 8
])
def test_scheme_defaults_and_spellings_as_compressed_tensors_reads_them(tmp_path: Path, bits: int, group: int,
                                                                        changes: dict) -> None:
    """Before: upper case was refused ("weight type 'INT'"), a missing num_bits read as 4 and a missing strategy
    with group size -1 as group."""
    layer = rand_layer(96, 128, bits=bits, group=group, asym=True, seed=bits)
    CT.write(MemSource({PREFIX: layer}), tmp_path / "m")
    _edit_scheme(tmp_path / "m", **changes)
    with CT.open(tmp_path / "m") as s:
        assert s.read_layer(PREFIX).equals(layer)


def test_scheme_without_strategy_or_group_size_is_the_tensor_strategy(tmp_path: Path) -> None:
    """Before: refused ("weight_scale shape [1] is not [128 rows, groups]"), read as the channel strategy."""
    bare = fixture_dir(FAMILY, "sym_tensor_in256_out128") / "model.safetensors"
    (tmp_path / "m").mkdir()
    shutil.copy(bare, tmp_path / "m" / "model.safetensors")
    weights = {"num_bits": 4, "type": "int", "symmetric": True}  # as a hand-written config may say it
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}))
    with CT.open(tmp_path / "m") as s, CT.open(bare) as t:
        name = t.layer_names()[0]
        got = s.read_layer(name)
        assert got.equals(t.read_layer(name)) and got.source["strategy"] == "tensor"


@pytest.mark.parametrize("ignore", [{"a": 1}, [1, 2], "lm_head"])
def test_ignore_must_be_names(tmp_path: Path, ignore: Any) -> None:
    """Before: any JSON value was turned into strings and accepted; the peer refuses what is not a list of names."""
    layer = rand_layer(32, 64, seed=3)
    CT.write(MemSource({PREFIX: layer}), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ignore
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    if isinstance(ignore, str):  # one name, as a list of one
        with CT.open(tmp_path / "m") as s:
            assert s.read_layer(PREFIX).equals(layer)
        return
    with pytest.raises(BadInputError, match="ignore must be a list of module names"):
        CT.open(tmp_path / "m")
