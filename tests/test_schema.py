"""The JSON Schemas in schemas/: what they refuse beyond the checkpoint tests' mutations."""
from __future__ import annotations

import copy

import pytest

from w4pack.errors import BadInputError
from w4pack.schema import validate_manifest

_MIN = {
    "format": "w4pack", "format_version": 1,
    "layout": {"name": "w4pack-tiles", "version": 1, "tile": [16, 64]},
    "created_by": "w4pack test",
    "source": {"format": "gptq"},
    "shards": [{"file": "model-00001-of-00001.safetensors", "sha256": "0" * 64, "size": 8}],
    "layers": {},
    "passthrough": [],
    "side_files": [],
}


def test_minimal_manifest_valid():
    validate_manifest(copy.deepcopy(_MIN))


@pytest.mark.parametrize("tile", [[32, 64], [16, 128], [64, 16], [16, 64, 1]])
def test_layout_v1_tile_is_fixed(tile):
    # LAYOUT.md defines version 1 for 16 x 64 tiles only: a reader must not guess another tile
    doc = copy.deepcopy(_MIN)
    doc["layout"]["tile"] = tile
    with pytest.raises(BadInputError, match="schema violation"):
        validate_manifest(doc)


def _v2(files: list[str]) -> dict:
    doc = copy.deepcopy(_MIN)
    doc["format_version"] = 2
    doc["files"] = [{"file": f, "sha256": "1" * 64, "size": 10} for f in files]
    return doc


def test_version_2_must_checksum_config_and_index():
    """Format version 2 covers every file that defines the model: config.json and the index at least."""
    from w4pack.schema import validate_quantization_config

    validate_manifest(_v2(["config.json", "model.safetensors.index.json", "tokenizer.json"]))
    for files in ([], ["config.json"], ["model.safetensors.index.json"]):
        with pytest.raises(BadInputError, match="schema violation"):
            validate_manifest(_v2(files))
    missing = _v2([])
    del missing["files"]
    with pytest.raises(BadInputError, match="schema violation"):
        validate_manifest(missing)
    escape = _v2(["config.json", "model.safetensors.index.json", "../secret"])
    with pytest.raises(BadInputError, match="schema violation"):
        validate_manifest(escape)
    qc = {"quant_method": "w4pack", "layout": "w4pack-tiles", "layout_version": 1, "manifest": "w4pack.json",
          "bits": 4, "group_size": 128, "zero_mode": "int"}
    for version in (1, 2):
        validate_quantization_config(dict(qc, format_version=version))
    with pytest.raises(BadInputError, match="schema violation"):
        validate_quantization_config(dict(qc, format_version=3))


def test_version_1_has_no_files():
    doc = copy.deepcopy(_MIN)
    doc["files"] = []
    with pytest.raises(BadInputError, match="schema violation"):
        validate_manifest(doc)
