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
