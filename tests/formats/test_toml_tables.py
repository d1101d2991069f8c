"""TOML+NumPy quant tables: fixture truth rebuilt exactly from base weights, tables written back, bad tables refused."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import MemSource, fixture_cases, fixture_dir
from w4pack.canonical import CanonicalLayer
from w4pack.checkpoint import open_checkpoint
from w4pack.cli import cli, main
from w4pack.convert import convert
from w4pack.dtypes import from_float32, to_float32
from w4pack.errors import BadInputError, UnsupportedError
from w4pack.formats import detect, get_format
from w4pack.formats.base import TensorData
from w4pack.formats.toml_tables import dump_toml
from w4pack.safetensors_io import SafetensorsFile, write_safetensors

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TOML = get_format("toml")
CASES = fixture_cases("toml")
BASES = [("base_weights_fp16.safetensors", "codes_rtn_from_base_weights"),
         ("gptq_fakequant_weights_fp16.safetensors", "codes")]


def truth(case: Path, name: str, codes_key: str) -> dict[str, Any]:
    t = case / "truth" / name
    out = {k: np.load(t / f"{k}.npy") for k in ("scales", "zeros", "g_idx")}
    out["codes"] = np.load(t / f"{codes_key}.npy")
    out["bits"] = int(np.load(t / "bits.npy"))
    out["group_size"] = int(np.load(t / "group_size.npy"))
    return out


def assert_truth(layer: CanonicalLayer, tr: dict[str, Any]) -> None:
    assert (layer.bits, layer.group_size, layer.zero_mode, layer.scale_dtype) == (tr["bits"], tr["group_size"],
                                                                                 "int", "float32")
    np.testing.assert_array_equal(layer.codes, tr["codes"])
    np.testing.assert_array_equal(layer.scales, tr["scales"])
    np.testing.assert_array_equal(layer.zeros, tr["zeros"])
    np.testing.assert_array_equal(layer.g_idx, tr["g_idx"])
    g = tr["g_idx"]
    want = tr["scales"][:, g].astype(np.float64) * (tr["codes"].astype(np.float64) - tr["zeros"][:, g])
    np.testing.assert_array_equal(layer.dequantize(np.float64), want)


# -- fixtures -------------------------------------------------------------------------------------
@pytest.mark.parametrize("base,codes_key", BASES)
@pytest.mark.parametrize("case", CASES)
def test_fixture_codes_rebuilt_exactly(case: str, base: str, codes_key: str) -> None:
    """Original weights give the RTN codes; GPTQ's fake-quantized weights give GPTQ's own codes, bit for bit."""
    d = fixture_dir("toml", case)
    assert detect(d / "quant_dir") == "toml"
    with TOML.open(d / "quant_dir", base=d / base) as src:
        names = src.layer_names()
        assert len(names) == 14
        for name in names:
            assert_truth(src.read_layer(name), truth(d, name, codes_key))
        assert src.info["version"] == ("quant.toml" if case.startswith("quant") else "decoder-N.toml")


def test_mixed_bits_and_group_sizes_of_the_observer() -> None:
    d = fixture_dir("toml", "quant_toml_asym_actorder_observer")
    with TOML.open(d / "quant_dir", base=d / BASES[0][0]) as src:
        kinds = {(src.read_layer(n).bits, src.read_layer(n).group_size) for n in src.layer_names()}
        assert {(4, 64), (4, 32), (8, 32), (8, 64)} <= kinds
        assert all(src.read_layer(n).act_order for n in src.layer_names())


def test_tables_need_base_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = fixture_dir("toml", "quant_toml_asym_actorder_observer")
    with pytest.raises(BadInputError, match="--base"):
        TOML.open(d / "quant_dir")
    # the line says what to pass, in the CLI's words (it showed the Python keyword: "with --base (base=...)")
    from conftest import cli_one_line

    for argv in (["convert", d / "quant_dir", tmp_path / "out"], ["inspect", d / "quant_dir"]):
        rc, err = cli_one_line(capsys, *argv)
        assert rc == 2 and f"{d / 'quant_dir'}: TOML quant tables hold no weights: name the fp16/bf16/fp32 base " \
                           "model their codes are rebuilt from with --base PATH (base=PATH in Python)" in err, err
        assert "base=..." not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", CASES)
def test_rewrite_reproduces_peer_tables(case: str, tmp_path: Path) -> None:
    d = fixture_dir("toml", case)
    variant = "quant.toml" if case.startswith("quant") else "decoder"
    with TOML.open(d / "quant_dir", base=d / BASES[0][0]) as src:
        TOML.write(src, tmp_path / "out", variant=variant, weights=False)
    peer = d / "quant_dir"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in peer.iterdir())
    for p in peer.iterdir():
        mine = tmp_path / "out" / p.name
        if p.suffix == ".npy":
            assert mine.read_bytes() == p.read_bytes(), p.name
        else:
            assert tomllib.loads(mine.read_text()) == tomllib.loads(p.read_text()), p.name


def test_whole_model_to_w4pack_and_back(tmp_path: Path) -> None:
    d = fixture_dir("toml", "quant_toml_asym_actorder_observer")
    base = d / BASES[1][0]
    convert(d / "quant_dir", tmp_path / "w4", base=base, show_progress=False)
    ck = open_checkpoint(tmp_path / "w4")
    assert len(ck.layers) == 14
    for name in ck.layers:
        assert_truth(ck.layer(name), truth(d, name, "codes"))
    convert(tmp_path / "w4", tmp_path / "tables", to="toml", show_progress=False)
    assert detect(tmp_path / "tables") == "toml"
    convert(tmp_path / "tables", tmp_path / "w4b", show_progress=False)  # its own weights are the base
    ck2 = open_checkpoint(tmp_path / "w4b")
    for name in ck.layers:
        assert ck2.layer(name).differences(ck.layer(name)) == []
    peer = tomllib.loads((d / "quant_dir" / "quant.toml").read_text())
    assert tomllib.loads((tmp_path / "tables" / "quant.toml").read_text()) == peer


# -- round trips of random layers ----------------------------------------------------------------
def random_layer(rng: np.random.Generator, n: int, k: int, g: int, bits: int, *, zero_mode: str = "int",
                 scale_dtype: str = "float32", act_order: bool = False, bias: bool = False) -> CanonicalLayer:
    ng = 1 if g == -1 else -(-k // g)
    scales = from_float32(rng.uniform(1e-4, 3e-2, size=(n, ng)).astype(np.float32), scale_dtype)
    zeros = rng.integers(0, (1 << bits) + 1, size=(n, ng)).astype(np.int32) if zero_mode == "int" else None
    g_idx = None
    if act_order:
        g_idx = (np.arange(k) // g).astype(np.int32)[rng.permutation(k)]
    layer = CanonicalLayer(codes=rng.integers(0, 1 << bits, size=(n, k)).astype(np.uint8), scales=scales, bits=bits,
                           group_size=g, zero_mode=zero_mode, zeros=zeros, g_idx=g_idx, scale_dtype=scale_dtype)
    if bias:
        layer.bias, layer.bias_dtype = from_float32(rng.standard_normal(n).astype(np.float32), "bfloat16"), "bfloat16"
    return layer.validate()


ROUND_TRIPS = [  # (N, K, group size, bits, zero mode, scale dtype, act-order, bias)
    (13, 77, 32, 4, "int", "float32", True, False),     # odd N and K, K not a multiple of the group
    (8, 96, -1, 8, "int", "float16", False, True),
    (24, 130, 64, 3, "none", "bfloat16", True, False),
    (5, 64, 16, 2, "int", "float16", False, False),
    (32, 256, 128, 8, "none", "float32", False, True),
]


@pytest.mark.parametrize("variant", ["quant.toml", "decoder"])
@pytest.mark.parametrize("n,k,g,bits,zm,sdt,act,bias", ROUND_TRIPS)
def test_random_round_trip(variant: str, n: int, k: int, g: int, bits: int, zm: str, sdt: str, act: bool,
                           bias: bool, tmp_path: Path) -> None:
    rng = np.random.default_rng(n * 1000 + k)
    layers = {f"model.layers.{i}.self_attn.o_proj": random_layer(rng, n, k, g, bits, zero_mode=zm, scale_dtype=sdt,
                                                                 act_order=act, bias=bias) for i in range(2)}
    emb = TensorData(from_float32(rng.standard_normal((10, k)).astype(np.float32), "bfloat16"), "bfloat16")
    TOML.write(MemSource(layers, {"model.embed_tokens.weight": emb}), tmp_path / "t", variant=variant)
    with TOML.open(tmp_path / "t") as back:
        assert back.layer_names() == list(layers)
        assert back.passthrough_names() == ["model.embed_tokens.weight"]
        t = back.read_tensor("model.embed_tokens.weight")
        assert t.dtype == "bfloat16" and np.array_equal(t.array, emb.array)
        for name, layer in layers.items():
            assert back.read_layer(name).differences(layer) == []
    # a runtime reading only the observer's keys gets float32 scales holding the same values
    doc_name = "quant.toml" if variant == "quant.toml" else "decoder-0.toml"
    table = tomllib.loads((tmp_path / "t" / doc_name).read_text())["model.layers.0.self_attn.o_proj"]
    assert table["wbits"] == bits and table["groupsize"] == g and table["sym"] == (zm == "none")
    assert ("group_ids" in table) == (g > 0) and ("zero" in table) == (zm == "int")


def test_float_minima_refused_up_front(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    good = random_layer(rng, 8, 64, 32, 4)
    bad = good.replace(zero_mode="float", zeros=np.full((8, 2), -0.05, dtype=np.float32))
    with pytest.raises(UnsupportedError, match="model.layers.1.mlp.up_proj") as exc:
        TOML.write(MemSource({"model.layers.0.mlp.up_proj": good, "model.layers.1.mlp.up_proj": bad}),
                   tmp_path / "t")
    assert "float" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "t").exists()


def test_negative_scales_refused_up_front(tmp_path: Path) -> None:
    """A source whose scales are not all positive (a GGUF block's d may be negative) would write tables the reader
    refuses: the writer says so before writing."""
    rng = np.random.default_rng(10)
    good = random_layer(rng, 8, 64, 32, 4)
    scales = good.scales.copy()
    scales[3, 1] = -scales[3, 1]
    bad = good.replace(scales=scales)
    with pytest.raises(UnsupportedError, match="model.layers.1.mlp.up_proj") as exc:
        TOML.write(MemSource({"model.layers.0.mlp.up_proj": good, "model.layers.1.mlp.up_proj": bad}),
                   tmp_path / "t")
    assert "not all positive" in str(exc.value) and "--to w4pack" in str(exc.value)
    assert not (tmp_path / "t").exists()


# -- bad tables ---------------------------------------------------------------------------------
@pytest.fixture()
def table_copy(tmp_path: Path) -> tuple[Path, Path]:
    d = fixture_dir("toml", "quant_toml_asym_actorder_observer")
    shutil.copytree(d / "quant_dir", tmp_path / "q")
    return tmp_path / "q", d / BASES[0][0]


LAYER = "model.layers.0.self_attn.k_proj"


def _edit_toml(q: Path, old: str, new: str) -> None:
    text = (q / "quant.toml").read_text()
    assert old in text
    (q / "quant.toml").write_text(text.replace(old, new, 1))


def _bad(call: Any, *needles: str) -> str:
    with pytest.raises(BadInputError) as exc:
        call()
    text = str(exc.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text
    return text


@pytest.mark.parametrize("path", ["../escape.scale.npy", "/etc/passwd.npy", "sub/../../x.npy"])
def test_npy_path_escaping_the_folder(table_copy: tuple[Path, Path], path: str) -> None:
    q, base = table_copy
    _edit_toml(q, f'scale = "{LAYER}.scale.npy"', f'scale = "{path}"')
    src = TOML.open(q, base=base)
    _bad(lambda: src.read_layer(LAYER), "quant.toml", f"tensor {LAYER}", "escapes")


def test_npy_missing_or_not_a_regular_file(table_copy: tuple[Path, Path]) -> None:
    """A FIFO in a table's place was called missing; opened, it would have blocked the reader."""
    import os

    q, base = table_copy
    npy = q / f"{LAYER}.group_ids.npy"
    npy.unlink()
    _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), f"'{npy.name}' is missing", f"tensor {LAYER}")
    os.mkfifo(npy)
    _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), f"'{npy.name}' is not a regular file")


def test_table_layer_missing_from_base(table_copy: tuple[Path, Path], tmp_path: Path) -> None:
    q, base = table_copy
    f = SafetensorsFile(base)
    keep = [(n, np.array(f.get(n)), f.dtype_name(n)) for n in f.keys() if n != f"{LAYER}.weight"]
    write_safetensors(tmp_path / "partial.safetensors", keep)
    _bad(lambda: TOML.open(q, base=tmp_path / "partial.safetensors"), "partial.safetensors", f"{LAYER}.weight")


def test_truncated_and_pickled_npy(table_copy: tuple[Path, Path]) -> None:
    q, base = table_copy
    p = q / f"{LAYER}.scale.npy"
    p.write_bytes(p.read_bytes()[:-40])
    src = TOML.open(q, base=base)
    _bad(lambda: src.read_layer(LAYER), p.name, f"tensor {LAYER}")
    np.save(q / f"{LAYER}.zero.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(p, np.ones((128, 2), dtype=np.float32))
    _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), f"{LAYER}.zero.npy", f"tensor {LAYER}")


@pytest.mark.parametrize("what,needle", [
    ("scale_shape", "scale shape"), ("gids_range", "group_ids must lie"), ("zero_frac", "not integers"),
])
def test_inconsistent_tables(table_copy: tuple[Path, Path], what: str, needle: str) -> None:
    q, base = table_copy
    if what == "scale_shape":
        np.save(q / f"{LAYER}.scale.npy", np.ones((128, 3), dtype=np.float32))
    elif what == "gids_range":
        g = np.load(q / f"{LAYER}.group_ids.npy")
        g[5] = 7
        np.save(q / f"{LAYER}.group_ids.npy", g)
    elif what == "zero_frac":
        z = np.load(q / f"{LAYER}.zero.npy")
        z[0, 0] += 0.5
        np.save(q / f"{LAYER}.zero.npy", z)
    _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), "quant.toml", f"tensor {LAYER}", needle)


@pytest.mark.parametrize("value", [-1.0, 0.0, -0.0, np.nan, np.inf, -np.inf])
def test_scales_must_be_positive_and_finite(table_copy: tuple[Path, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str], value: float) -> None:
    """GPTQ's quantizer makes every scale > 0 (a zero range becomes [-1, 1]); anything else is a damaged table,
    named by its .npy file and layer, not carried into the packed model."""
    q, base = table_copy
    p = q / f"{LAYER}.scale.npy"
    s = np.load(p)
    s[1, 1] = value
    np.save(p, s)
    rc = main(["convert", str(q), str(tmp_path / "out"), "--base", str(base)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{p}: tensor {LAYER}: scale [1, 1] is {float(np.float32(value))} (1 of 256 not positive" in err, err
    assert not (tmp_path / "out").exists()


def test_inline_scale_not_positive_names_the_document(tmp_path: Path) -> None:
    d = fixture_dir("toml", "decoder_toml_inline_asym_g64")
    shutil.copytree(d / "quant_dir", tmp_path / "q")
    doc = tmp_path / "q" / "decoder-0.toml"
    text = doc.read_text()
    start = text.index("scale = [") + len("scale = [")
    end = text.index(",", start)
    doc.write_text(text[:start] + "-1.0" + text[end:])
    src = TOML.open(tmp_path / "q", base=d / "base_weights_fp16.safetensors")
    errs = []
    for name in src.layer_names():
        try:
            src.read_layer(name)
        except BadInputError as exc:
            errs.append(str(exc))
    assert len(errs) == 1 and errs[0].startswith(f"{doc}: tensor ") and "is -1.0 (1 of" in errs[0], errs


def test_invalid_toml_and_unsupported_bits(table_copy: tuple[Path, Path]) -> None:
    q, base = table_copy
    original = (q / "quant.toml").read_text()
    (q / "quant.toml").write_text(original + "\n[broken\n")
    _bad(lambda: TOML.open(q, base=base), "quant.toml", "not valid TOML")
    (q / "quant.toml").write_text(original.replace("wbits = 4", "wbits = 6", 1))
    with pytest.raises(UnsupportedError, match="6-bit"):
        TOML.open(q, base=base).read_layer(LAYER)


# -- CLI ----------------------------------------------------------------------------------------
def test_cli_convert_with_base_and_back_to_toml(tmp_path: Path) -> None:
    d = fixture_dir("toml", "decoder_toml_inline_asym_g64")
    runner = CliRunner()
    res = runner.invoke(cli, ["convert", str(d / "quant_dir"), str(tmp_path / "w4"), "--base",
                              str(d / BASES[0][0]), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["source_format"] == "toml"
    res = runner.invoke(cli, ["convert", str(tmp_path / "w4"), str(tmp_path / "t"), "--to", "toml"])
    assert res.exit_code == 0, res.output
    with TOML.open(tmp_path / "t") as back:
        for name in back.layer_names():
            assert_truth(back.read_layer(name), truth(d, name, "codes_rtn_from_base_weights"))
    w = SafetensorsFile(tmp_path / "t" / "model.safetensors")
    assert w.dtype_name(f"{LAYER}.weight") == "float16"  # fp16 reproduces the codes, so the runtime gets fp16
    assert np.all(np.isfinite(to_float32(w.get(f"{LAYER}.weight"), "float16")))


def test_inline_scales_as_short_decimals_round_to_float32(tmp_path: Path) -> None:
    """A decoder-N.toml whose scales are printed as short decimals still reads as the float32 values meant."""
    d = fixture_dir("toml", "decoder_toml_inline_asym_g64")
    shutil.copytree(d / "quant_dir", tmp_path / "q")
    p = tmp_path / "q" / "decoder-0.toml"
    doc = tomllib.loads(p.read_text())
    for table in doc.values():
        table["scale"] = [float(np.format_float_positional(np.float32(v), unique=True)) for v in table["scale"]]
        table["scale"][0] = float(np.float32(table["scale"][0])) + 1e-12  # not a float32 decimal any more
    p.write_text(dump_toml(doc))
    with TOML.open(tmp_path / "q", base=d / BASES[0][0]) as src:
        for name in src.layer_names():
            assert_truth(src.read_layer(name), truth(d, name, BASES[0][1]))
        assert any("rounded to the nearest float32" in n for n in src.info["notes"])


# -- arrays of the wrong rank, mistyped flags -----------------------------------------------------------
@pytest.mark.parametrize("key,arr,needle", [
    ("scale", np.float32(0.01), "scale must be a 1-D or 2-D array, got shape []"),
    ("zero", np.float32(8), "zero must be a 1-D or 2-D array, got shape []"),
    ("group_ids", np.int32(0), "group_ids must be a 1-D array, got shape []"),
    ("scale", np.full((128, 2, 1), 0.01, np.float32), "scale must be a 1-D or 2-D array"),
    ("zero", np.full((1, 2, 3), 8, np.float32), "zero must be a 1-D or 2-D array"),
    ("group_ids", np.zeros((128, 1), np.int32), "group_ids must be a 1-D array"),
])
def test_npy_of_the_wrong_rank(table_copy: tuple[Path, Path], key: str, arr: np.ndarray, needle: str) -> None:
    q, base = table_copy
    np.save(q / f"{LAYER}.{key}.npy", arr)
    _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), f"{LAYER}.{key}.npy", f"tensor {LAYER}", needle)


@pytest.mark.parametrize("fill", [np.inf, -np.inf, np.nan])
def test_group_ids_not_finite(table_copy: tuple[Path, Path], fill: float) -> None:
    q, base = table_copy
    np.save(q / f"{LAYER}.group_ids.npy", np.full(128, fill))
    _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), "quant.toml", f"tensor {LAYER}", "not integers")


@pytest.mark.parametrize("old,new,needle", [
    ("sym = false", 'sym = "false"', "sym must be true or false"),
    ("perchannel = true", "perchannel = 1", "perchannel must be true or false"),
])
def test_flags_must_be_booleans(table_copy: tuple[Path, Path], old: str, new: str, needle: str) -> None:
    q, base = table_copy
    _edit_toml(q, old, new)
    _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), "quant.toml", f"tensor {LAYER}", needle)


@pytest.mark.parametrize("shape,needle", [([], "must be 1-D or 2-D"), ([1, 1, 128, 2], "must be 1-D or 2-D"),
                                          ([128.0, 2], "scale_shape must be a list of non-negative integers"),
                                          ("128x2", "scale_shape must be a list")])
def test_inline_shape_of_the_wrong_rank(tmp_path: Path, shape: Any, needle: str) -> None:
    d = fixture_dir("toml", "decoder_toml_inline_asym_g64")
    shutil.copytree(d / "quant_dir", tmp_path / "q")
    p = tmp_path / "q" / "decoder-0.toml"
    doc = tomllib.loads(p.read_text())
    name = next(iter(doc))
    if shape == []:
        doc[name]["scale"] = doc[name]["scale"][:1]
    doc[name]["scale_shape"] = shape
    p.write_text(dump_toml(doc))
    _bad(lambda: TOML.open(tmp_path / "q", base=d / BASES[0][0]).read_layer(name), "decoder-0.toml",
         f"tensor {name}", needle)


def test_cli_zero_d_scale_is_one_line_exit_2(table_copy: tuple[Path, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    q, base = table_copy
    np.save(q / f"{LAYER}.scale.npy", np.float32(0.01))
    rc = main(["convert", str(q), str(tmp_path / "out"), "--base", str(base)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "scale must be a 1-D or 2-D array" in err, err
    assert not (tmp_path / "out").exists()


def test_decoder_variant_streams_its_documents(tmp_path: Path) -> None:
    """The decoder variant's inline lists are appended to their decoder-N.toml as each layer is made: the
    documents used to be kept to the end, which grew memory with the model (several MB of Python lists per
    1024 x 4096 layer). Measured as the Python heap's peak (tracemalloc: deterministic, unlike RSS, which the
    allocator's retention moves by tens of MB)."""
    import tracemalloc

    from test_layout import random_layer

    from w4pack.checkpoint import CheckpointWriter

    layer = random_layer(np.random.default_rng(5), 1024, 4096, 4, 32, "int", act_order=False)
    peak = {}
    for n in (2, 12):
        src = tmp_path / f"m{n}.w4"
        with CheckpointWriter(src) as w:
            for i in range(n):
                name = f"model.layers.{i}.mlp.down_proj"
                w.add_layer(name, layer.replace(name=name))
        tracemalloc.start()
        try:
            convert(src, tmp_path / f"m{n}.toml", to="toml", variant="decoder", show_progress=False)
            peak[n] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(list((tmp_path / f"m{n}.toml").glob("decoder-*.toml"))) == n
    assert peak[12] - peak[2] < 8 * 2**20, peak  # 10 more layers' documents would be ~50 MB


# -- hostile file names and .npy headers (issue 30, item 11) -----------------------------------------------
@pytest.mark.parametrize("stray", [b"(", b"["])
def test_stray_byte_in_npy_header_names_the_file(table_copy: tuple[Path, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str], stray: bytes) -> None:
    """numpy tokenizes the header: an unclosed bracket was "unexpected TokenError" naming no file."""
    q, base = table_copy
    p = q / f"{LAYER}.scale.npy"
    raw = bytearray(p.read_bytes())
    at = raw.index(b"}") + 2  # the header's space padding
    raw[at:at + 1] = stray
    p.write_bytes(bytes(raw))
    _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), f"{LAYER}.scale.npy", "not a readable .npy array")
    rc = main(["convert", str(q), str(tmp_path / "out"), "--base", str(base)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{LAYER}.scale.npy" in err and "TokenError" not in err, err


def test_file_name_too_long_in_quant_toml_is_bad_input(table_copy: tuple[Path, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A 300-character .npy name is the table's fault: exit 2 naming quant.toml and the key (was exit 4, "File
    name too long", naming the missing file)."""
    q, base = table_copy
    _edit_toml(q, f'scale = "{LAYER}.scale.npy"', f'scale = "{"a" * 300}.npy"')
    text = _bad(lambda: TOML.open(q, base=base).read_layer(LAYER), "quant.toml", f"tensor {LAYER}",
                "scale names", "too long")
    assert "a" * 100 not in text
    rc = main(["convert", str(q), str(tmp_path / "out"), "--base", str(base)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "quant.toml" in err and "scale names" in err, err


def test_decoder_documents_cover_every_decoder_layer(tmp_path: Path) -> None:
    """decoder-1.toml deleted from a two-layer export: the base weights have two decoder layers, so the missing
    document is refused instead of leaving layer 1 silently unquantized (found by tools/fuzz.py)."""
    import shutil

    from w4pack.errors import BadInputError
    from w4pack.formats import open_source

    src = tmp_path / "case"
    shutil.copytree(fixture_dir("toml", "decoder_toml_inline_asym_g64"), src)
    (src / "quant_dir" / "decoder-1.toml").unlink()
    with pytest.raises(BadInputError, match="decoder-1.toml and after are missing"):
        open_source(src / "quant_dir", "toml", base=src / "base_weights_fp16.safetensors")


def test_a_folder_with_the_tables_one_level_down_names_them(capsys: pytest.CaptureFixture[str]) -> None:
    """GPTQ-for-LLaMa's export sits in a sub-folder beside the base weights. Given the folder above, detection said
    "name it with --from" (and, base weights being float, would now say "unquantized model"), and --from toml said
    "no quant tables here": each now names the sub-folder to pass."""
    from conftest import cli_one_line

    case = fixture_dir("toml", "quant_toml_asym_actorder_observer")
    rc, err = cli_one_line(capsys, "inspect", case)
    assert rc == 3 and f"the quant tables are in {case / 'quant_dir'}: pass that folder (with --base)" in err, err
    assert "unquantized" not in err
    rc, err = cli_one_line(capsys, "inspect", case, "--from", "toml", "--base", case / "base_weights_fp16.safetensors")
    assert rc == 2 and f"no quant.toml or decoder-N.toml quant tables here; the quant tables are in " \
                       f"{case / 'quant_dir'}" in err, err


# -- hostile documents the fuzzer's mutators do not write --------------------------------------
def _convert_refused(q: Path, base: Path, out: Path, capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    rc = main(["convert", str(q), str(out), "--base", str(base)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("w4pack: error: "), err
    assert "unexpected" not in err and str(q) in err, err
    for needle in needles:
        assert needle in err, err
    assert not out.exists()
    return err


def test_quoted_and_dotted_tables_of_one_layer_are_refused(table_copy: tuple[Path, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``["a.b"]`` and ``[a.b]`` are two valid TOML tables with one layer name: the second used to replace the
    first silently (here an 8-bit symmetric table for a 4-bit asymmetric layer)."""
    q, base = table_copy
    with open(q / "quant.toml", "a") as fh:
        fh.write(f'\n[{LAYER}]\nwbits = 8\ngroupsize = 64\nsym = true\nscale = "{LAYER}.scale.npy"\n'
                 f'group_ids = "{LAYER}.group_ids.npy"\n')
    _bad(lambda: TOML.open(q, base=base), "quant.toml", f"tensor {LAYER}", "two tables")
    _convert_refused(q, base, tmp_path / "out", capsys, f"tensor {LAYER}", "two tables")


@pytest.mark.parametrize("tail,needle", [
    ("\n[x]\nwbits = 4\nscale = " + "[" * 50000 + "]" * 50000 + "\n", "nested too deeply"),
    ("\n[" + ".".join(["a"] * 5000) + "]\nwbits = 4\n", "nested more than 64 levels"),
])
def test_deeply_nested_documents_are_one_line(table_copy: tuple[Path, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str], tail: str, needle: str) -> None:
    """Arrays nested 50000 deep (tomllib recurses) and tables nested 5000 deep (the layer walk) used to end in
    "unexpected RecursionError" without naming the document."""
    q, base = table_copy
    with open(q / "quant.toml", "a") as fh:
        fh.write(tail)
    _convert_refused(q, base, tmp_path / "out", capsys, needle)


def test_quant_toml_beside_decoder_documents_is_refused(table_copy: tuple[Path, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A folder with quant.toml and decoder-N.toml holds two sets of tables; quant.toml used to win silently and
    the decoder documents were ignored. Naming one document still reads it."""
    q, base = table_copy
    d = fixture_dir("toml", "decoder_toml_inline_asym_g64")
    shutil.copyfile(d / "quant_dir" / "decoder-0.toml", q / "decoder-0.toml")
    _bad(lambda: TOML.open(q, base=base), str(q), "holds both quant.toml and decoder-0.toml")
    _convert_refused(q, base, tmp_path / "out", capsys, "two sets of quant tables")
    assert TOML.open(q / "quant.toml", base=base).layer_names()


@pytest.mark.parametrize("shape", [(0, 256), (4, 0)])
def test_empty_base_weight_is_one_line(tmp_path: Path, shape: tuple[int, int],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A base weight with a zero dimension (and tables of matching empty arrays) ended in "unexpected ValueError:
    zero-size array to reduction operation minimum"; it names the base tensor now."""
    layer = "model.layers.0.mlp.down_proj"
    q = tmp_path / "q"
    q.mkdir()
    write_safetensors(tmp_path / "base.safetensors", [(f"{layer}.weight", np.zeros(shape, np.float16), None)])
    groups = (0, 4) if shape[0] == 0 else (4, 0)
    np.save(q / "s.npy", np.zeros(groups, np.float32))
    np.save(q / "z.npy", np.zeros(groups, np.float32))
    (q / "quant.toml").write_text(f'["{layer}"]\nwbits = 4\ngroupsize = 64\nscale = "s.npy"\nzero = "z.npy"\n')
    rc = main(["convert", str(q), str(tmp_path / "out"), "--base", str(tmp_path / "base.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "unexpected" not in err, err
    assert f"base.safetensors: tensor {layer}.weight: base weight is empty" in err, err
    assert not (tmp_path / "out").exists()
