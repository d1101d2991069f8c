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
