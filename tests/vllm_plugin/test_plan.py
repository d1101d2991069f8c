"""The engine's view of a packed checkpoint (w4pack.vllm.plan), read without vLLM."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from w4pack.convert import convert
from w4pack.errors import BadInputError
from w4pack.vllm.plan import CheckpointPlan

from conftest import fixture_dir

TINY = ("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")


@pytest.fixture(scope="module")
def fused(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "fused"
    convert(fixture_dir(*TINY), out, fuse="qkv,gate-up", show_progress=False)
    return out


def _config_without(folder: Path, tmp: Path, key: str) -> Path:
    import shutil

    copy = tmp / f"no-{key}"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    del cfg["quantization_config"][key]
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def test_layers_the_model_lacks_refused_before_the_engine_loads(fused, tmp_path):
    """Before: a config.json with fewer decoder layers than the manifest passed here and failed in the worker's
    weight loader with vLLM's "There is no module or parameter named 'layers.1'"."""
    import shutil

    shutil.copytree(fused, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match=f"layers.{cfg['num_hidden_layers']}.") as err:
        CheckpointPlan.from_folder(tmp_path / "m")
    assert "w4pack validate" in str(err.value)


def test_fused_layers_planned_with_their_parts(fused):
    plan = CheckpointPlan.from_folder(fused)
    qkv = next(name for name in plan.fused if name.endswith("qkv_proj"))
    part, = plan.plan(qkv, None, None).parts
    assert [s[0].rsplit(".", 1)[1] for s in part.sub_rows] == ["q_proj", "k_proj", "v_proj"]
    assert part.sub_rows[-1][2] == part.shape[0]


def test_config_that_drops_the_fused_table_refused_as_validate_does(fused, tmp_path):
    """Before: a config.json without quantization_config.fused passed here while `w4pack validate` refused it."""
    folder = _config_without(fused, tmp_path, "fused")
    with pytest.raises(BadInputError, match="quantization_config.fused disagrees with the fused table"):
        CheckpointPlan.from_folder(folder)
