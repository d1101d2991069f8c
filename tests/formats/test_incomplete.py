"""A folder without config.json whose tensor names belong to a quantized layout but whose layer lost or renamed a
tensor is a damaged checkpoint (bad input, exit 2, naming the file, the layer and what it lacks), not "cannot tell
which format" (exit 3); folders whose names belong to no layout w4pack reads stay exit 3 (issue 30 round 2, item 1)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import cli_one_line as _cli, fixture_dir
from w4pack.store.safetensors import SafetensorsFile, write_safetensors

LAYER = "model.layers.0.mlp.down_proj"


def _damaged(tmp_path: Path, family: str, case: str, leaf: str, rename: str | None) -> Path:
    """A copy of a fixture without its JSON files, ``LAYER.leaf`` deleted (or renamed to ``LAYER.rename``)."""
    src = tmp_path / "src"
    shutil.copytree(fixture_dir(family, case), src)
    for j in ("config.json", "quantize_config.json", "quant_config.json"):
        (src / j).unlink(missing_ok=True)
    (st,) = sorted(src.glob("*.safetensors"))
    with SafetensorsFile(st) as f:
        items = [(k, np.array(f.get(k)), f.dtype_name(k)) for k in f.keys()]
    target = f"{LAYER}.{leaf}"
    assert target in {k for k, _, _ in items}
    items = [(f"{LAYER}.{rename}" if k == target else k, a, d) for k, a, d in items if rename or k != target]
    write_safetensors(st, items, {})
    return st


@pytest.mark.parametrize("family,case,leaf,rename,has", [
    ("awq", "gemm_g64_in576_out128", "scales", None, "has qweight, qzeros but no scales"),
    ("awq", "gemm_g64_in576_out128", "scales", "scalez", "has qweight, qzeros but no scales"),
    ("awq", "gemm_g64_in576_out128", "qweight", None, "has qzeros, scales but no qweight"),
    # a symmetric layer (no qzeros) left with its scales alone: no name only GPTQ/AWQ use is left (fuzz seed 91206)
    ("awq", "marlin_g128_in512_out256", "qweight", None, "has scales but no qweight"),
    ("gptq", "ag_b4_asym_g64", "scales", None, "has qweight, qzeros, g_idx but no scales"),
    ("gptq", "gm_b3_asym_g64_v1", "qweight", "qweights", "has qzeros, scales, g_idx but no qweight"),
    ("compressed-tensors", "asym_group64_in256_out384", "weight_packed", "packed",
     "has weight_scale, weight_zero_point, weight_shape but no weight_packed"),
    # the symmetric layer's qweight renamed in its module: scales beside one unknown int32 tensor, which its dtype
    # and shape name as the Marlin qweight (fuzz seed 111206, awq index 16)
    ("awq", "marlin_g128_in512_out256", "qweight", "qw",
     f"has scales but no qweight: its packed weights are missing or under an unexpected name ({LAYER}.qw, int32 "
     "[32, 512], is shaped as the AWQ Marlin qweight of scales [4, 256])"),
])
def test_a_layer_missing_a_tensor_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str,
                                               case: str, leaf: str, rename: str | None, has: str) -> None:
    st = _damaged(tmp_path, family, case, leaf, rename)
    src = st.parent
    for argv in (["inspect", src], ["convert", src, tmp_path / "out"], ["inspect", st]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{st}: layer {LAYER} {has}" in err and "cannot tell" not in err, err
    if rename:
        assert f"{LAYER}.{rename}" in err  # the renamed tensor is named: the likely culprit
    assert not (tmp_path / "out").exists()


def test_names_of_another_layout_stay_unknown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A packed weight with scales and biases beside it (MLX) is a layout w4pack does not read: still "cannot tell
    which format" (3), whatever "scales" suggests."""
    src = tmp_path / "mlx"
    src.mkdir()
    write_safetensors(src / "model.safetensors", [
        (f"{LAYER}.weight", np.zeros((8, 4), np.uint32), "U32"), (f"{LAYER}.scales", np.ones((8, 1), np.float16), "F16"),
        (f"{LAYER}.biases", np.zeros((8, 1), np.float16), "F16")], {})
    rc, err = _cli(capsys, "inspect", src)
    assert rc == 3 and "cannot tell which format" in err


@pytest.mark.parametrize("tensors,says", [
    ({"qweight": np.zeros((3, 5), np.int32), "scales": np.zeros((7, 11), np.float16)},
     "layer (top level) has qweight [3, 5], scales [7, 11], shapes that fit neither"),
    ({"qweight": np.zeros((3, 5), np.int32), "qzeros": np.zeros((1, 5), np.int32)},
     "layer (top level) has qweight, qzeros but no scales"),
])
def test_tensor_names_without_a_module_are_bad_input_not_a_crash(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tensors: dict[str, np.ndarray], says: str) -> None:
    """Top-level names ("qweight", no dot) belong to module "": the message names the layer without a KeyError."""
    src = tmp_path / "top"
    src.mkdir()
    write_safetensors(src / "model.safetensors", [(k, a, None) for k, a in tensors.items()], {})
    rc, err = _cli(capsys, "inspect", src)
    assert rc == 2 and says in err and "KeyError" not in err, err


def test_a_quant_method_that_is_not_a_name_is_bad_input(tmp_path: Path) -> None:
    """config.json's quantization_config.quant_method set to 0: the config is damaged (exit 2, naming it), not a
    format w4pack cannot tell (exit 3)."""
    import json

    from w4pack.errors import BadInputError
    from w4pack.formats import detect

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "quantization_config": {"quant_method": 0, "bits": 4}}))
    with pytest.raises(BadInputError, match="quant_method is 0") as exc:
        detect(tmp_path)
    assert exc.value.exit_code == 2 and "config.json" in exc.value.one_line()


def test_an_unquantized_model_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plain float model (the base model, downloaded by mistake) was "cannot tell which format; name it with
    --from", which no --from can satisfy; still unsupported (3), now saying what the folder is and what to do."""
    import json

    src = tmp_path / "fp16"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    write_safetensors(src / "model.safetensors", [
        (f"{LAYER}.weight", np.zeros((8, 8), np.float16), "F16"), ("model.norm.weight", np.ones(8, np.float16), "F16"),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", np.ones(4, np.float32), "F32")], {})
    for argv in (["inspect", src], ["convert", src, tmp_path / "out"], ["convert", src / "model.safetensors",
                                                                         tmp_path / "out", "--dry-run"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 3 and "no quantized layers: every tensor is a plain float weight" in err, err
        assert "quantize the model first" in err and "--from" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rename", [None, "qweigh|"])
def test_an_llm_awq_dump_missing_its_qweight_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          rename: str | None) -> None:
    """llm-awq's .pt dumps (qweight, scales, scaled_zeros) are read from torch pickles: one whose qweight was lost
    or renamed is named as damaged, as a safetensors checkpoint would be."""
    torch = pytest.importorskip("torch")
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("awq", "llm_awq_v2_2024_layer_g128_pt"), src)
    (pt,) = sorted(src.glob("*.pt"))
    sd = torch.load(pt, weights_only=True)
    qweight = sd.pop(f"{LAYER}.qweight")
    if rename:
        sd[f"{LAYER}.{rename}"] = qweight
    torch.save(sd, pt)
    for argv in (["inspect", src], ["convert", src, tmp_path / "out"], ["inspect", pt]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{pt}: layer {LAYER} has scales, scaled_zeros but no qweight" in err, err
    assert not (tmp_path / "out").exists()


def _write(folder: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", [(k, a, d) for k, (a, d) in tensors.items()], {})
    return folder / "model.safetensors"


def _fixture_tensors(family: str, case: str) -> dict[str, tuple[np.ndarray, str]]:
    (st,) = sorted(fixture_dir(family, case).glob("*.safetensors"))
    with SafetensorsFile(st) as f:
        return {k: (np.array(f.get(k)), f.dtype_name(k)) for k in f.keys()}


def _renamed(tensors: dict[str, tuple[np.ndarray, str]], renames: dict[str, str | None]) -> dict[str, tuple[np.ndarray, str]]:
    """``tensors`` with LAYER's leaves renamed (to None: deleted)."""
    out = {}
    for k, v in tensors.items():
        leaf = k.rpartition(".")[2]
        if k.startswith(LAYER + ".") and leaf in renames:
            if renames[leaf] is not None:
                out[f"{LAYER}.{renames[leaf]}"] = v
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("renames,says", [
    # GPTQ symmetric layer kept only its scales: the renamed tensor's columns are the scales' (out), rows in*4/32
    ({"qweight": "q", "qzeros": None, "g_idx": None},
     f"has scales but no qweight: its packed weights are missing or under an unexpected name ({LAYER}.q, int32 "
     "[64, 256], is shaped as the GPTQ qweight of scales [4, 256])"),
    # with g_idx kept, its length (in_features) fixes the rows exactly; qzeros and g_idx name the family anyway,
    # the shapes name the culprit
    ({"qweight": "qw"}, f"has qzeros, scales, g_idx but no qweight: its packed weights are missing or under an "
                        f"unexpected name ({LAYER}.qw, int32 [64, 256], is shaped as the GPTQ qweight of scales"),
])
def test_a_gptq_qweight_under_another_name_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    renames: dict[str, str | None], says: str) -> None:
    st = _write(tmp_path / "src", _renamed(_fixture_tensors("gptq", "ag_b4_sym_g128"), renames))
    for argv in (["inspect", st.parent], ["convert", st.parent, tmp_path / "out"], ["inspect", st]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{st}: layer {LAYER} {says}" in err and "cannot tell" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_marlin_layer_beside_intact_ones_is_not_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two Marlin layers, the second's qweight renamed: the reader takes the first and carries the second's scales
    and renamed qweight as pass-through; convert refused nothing and wrote one layer, the other silently lost."""
    tensors = _fixture_tensors("awq", "marlin_g128_in512_out256")
    other = "model.layers.1.mlp.down_proj"
    tensors.update({k.replace(LAYER, other).replace(".qweight", ".qw"): v for k, v in list(tensors.items())})
    _write(tmp_path / "src", tensors)
    for argv in (["inspect", tmp_path / "src"], ["convert", tmp_path / "src", tmp_path / "out"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"layer {other} has scales but no qweight: its packed weights are missing or under an " \
            f"unexpected name ({other}.qw, int32 [32, 512], is shaped as the AWQ Marlin qweight" in err, err
    assert not (tmp_path / "out").exists()


def _aqlm(out: int = 256, k: int = 512, books: int = 1) -> dict[str, tuple[np.ndarray, str]]:
    """An AQLM linear as its checkpoints store it: codes int16 [out, in/8, books], codebooks float16
    [books, 2^bits, 1, 8], scales float16 [out, 1, 1, 1]."""
    return {f"{LAYER}.codes": (np.zeros((out, k // 8, books), np.int16), "int16"),
            f"{LAYER}.codebooks": (np.zeros((books, 256, 1, 8), np.float16), "float16"),
            f"{LAYER}.scales": (np.ones((out, 1, 1, 1), np.float16), "float16")}


@pytest.mark.parametrize("tensors", [
    pytest.param(_aqlm(), id="aqlm"),
    # scales 2-D and codes int32 2-D shaped as a GPTQ qweight of them: two unknown tensors, not one damaged layer
    pytest.param({f"{LAYER}.codes": (np.zeros((64, 256), np.int32), "int32"),
                  f"{LAYER}.codebooks": (np.zeros((1, 256, 1, 8), np.float16), "float16"),
                  f"{LAYER}.scales": (np.ones((8, 256), np.float16), "float16")}, id="aqlm-2d-scales"),
    # one unknown tensor, but shaped as no GPTQ/AWQ qweight of these scales
    pytest.param({f"{LAYER}.codes": (np.zeros((64, 100), np.int32), "int32"),
                  f"{LAYER}.scales": (np.ones((8, 256), np.float16), "float16")}, id="int32-other-shape"),
    # one unknown tensor of a qweight's shape, but not an integer
    pytest.param({f"{LAYER}.codes": (np.zeros((64, 256), np.float16), "float16"),
                  f"{LAYER}.scales": (np.ones((8, 256), np.float16), "float16")}, id="float-qweight-shape"),
])
def test_scales_beside_tensors_of_another_layout_stay_unknown(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """AQLM keeps ``scales`` beside its own ``codes`` and ``codebooks``: no tensor of it is shaped as a GPTQ/AWQ
    qweight of those scales, so the folder is a layout w4pack does not read (3), not a damaged GPTQ/AWQ one."""
    _write(tmp_path / "src", tensors)
    rc, err = _cli(capsys, "inspect", tmp_path / "src")
    assert rc == 3 and "cannot tell which format" in err, err


def test_disguised_qweight_fits() -> None:
    """The shapes each reader takes, beside 2-D float scales [groups, out] (GEMV: [out, padded groups])."""
    from w4pack.formats._incomplete import disguised_qweight

    def fit(**t: tuple[str, tuple[int, ...]]) -> str | None:
        found = disguised_qweight("m", set(t), {f"m.{k}": v for k, v in t.items()}.get)
        return None if found is None else found[1].split("is shaped as the ")[1].split(" qweight")[0]

    sc = ("float16", (4, 256))
    assert fit(scales=sc, x=("int32", (64, 256))) == "GPTQ"                       # [in/8, out]
    assert fit(scales=sc, x=("int32", (512, 32))) == "AWQ GEMM"                   # [in, out/8]
    assert fit(scales=sc, x=("int32", (32, 512))) == "AWQ Marlin"                 # [in/16, 2*out]
    assert fit(scales=("float16", (64, 256)), x=("int32", (3, 256))) is None      # 64 groups of 48 inputs at most
    assert fit(scales=sc, x=("int8", (64, 256))) is None
    assert fit(scales=sc, x=("int32", (64, 256, 1))) is None
    assert fit(scales=("int32", (4, 256)), x=("int32", (64, 256))) is None        # scales are floats
    assert fit(scales=sc, x=("int32", (64, 256)), weight=("float16", (256, 512))) is None  # a weight is there
    assert fit(scales=sc, x=("int32", (64, 256)), y=("int32", (64, 256))) is None  # two candidates: no guess
    assert fit(scales=sc, g_idx=("int32", (512,)), x=("int32", (64, 256))) == "GPTQ"
    assert fit(scales=sc, g_idx=("int32", (500,)), x=("int32", (64, 256))) is None  # 64 rows hold no 500 inputs
    assert fit(scales=sc, qzeros=("int32", (4, 32)), x=("int32", (512, 32))) == "AWQ GEMM"
    assert fit(scales=sc, qzeros=("int32", (4, 32)), x=("int32", (32, 512))) is None  # Marlin has no qzeros
    assert fit(scales=("float16", (256, 8)), qzeros=("int32", (256, 1)), x=("int32", (256, 64))) == "AWQ GEMV"
    assert fit(scales=("float16", (8, 256)), qzeros=("float16", (8, 256)), x=("int16", (64, 512))) == "AWQ GEMVFast"
    assert fit(scales=("float16", (8, 256)), scaled_zeros=("float16", (8, 256)), x=("int16", (64, 512))) \
        == "AWQ GEMVFast"


def test_only_the_disguised_layer_is_named_beside_another_layout(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A file of an AQLM-like layer (sorted first; 2-D scales, and int32 codes shaped as a GPTQ qweight of them
    beside its codebooks) and one Marlin layer whose qweight was renamed: the error names the Marlin layer, not
    the other ("has scales but no qweight" would misreport it)."""
    other = "model.layers.0.a_proj"
    tensors = {f"{other}.codes": (np.zeros((64, 256), np.int32), "int32"),
               f"{other}.codebooks": (np.zeros((1, 256, 1, 8), np.float16), "float16"),
               f"{other}.scales": (np.ones((8, 256), np.float16), "float16")}
    tensors[f"{LAYER}.qw"] = (np.zeros((32, 512), np.int32), "int32")
    tensors[f"{LAYER}.scales"] = (np.ones((4, 256), np.float16), "float16")
    st = _write(tmp_path / "src", tensors)
    rc, err = _cli(capsys, "inspect", tmp_path / "src")
    assert rc == 2 and f"{st}: layer {LAYER} has scales but no qweight: its packed weights" in err, err
    assert "a_proj" not in err
