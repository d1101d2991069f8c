"""convert: the driver and its CLI on a w4pack source (formats have their own tests)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

import w4pack
from w4pack.convert import convert, plan

from test_checkpoint import write_model


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "w4pack", *map(str, args)], capture_output=True, text=True)


def test_convert_reshards_losslessly(tmp_path):
    src = tmp_path / "src"
    layers = write_model(src)
    summary = convert(src, tmp_path / "dst", max_shard_size="1MB")
    assert summary["layers"] == len(layers)
    ck = w4pack.open_checkpoint(tmp_path / "dst")
    assert len(ck.manifest["shards"]) == 1
    for name, layer in layers.items():
        assert ck.layer(name).differences(layer) == []
    np.testing.assert_array_equal(ck.tensor("model.norm.weight"), w4pack.open_checkpoint(src).tensor("model.norm.weight"))


def test_dry_run_writes_nothing_and_json(tmp_path):
    src = tmp_path / "src"
    write_model(src)
    proc = run_cli("convert", src, tmp_path / "dst", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["layers"]) == 4 and doc["problems"] == []
    assert not (tmp_path / "dst").exists()
    assert plan(src)["target_format"] == "w4pack"


def test_cli_convert_no_clobber_and_force(tmp_path):
    src = tmp_path / "src"
    write_model(src)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    proc = run_cli("convert", src, dst)
    assert proc.returncode == 4 and "--force" in proc.stderr and "Traceback" not in proc.stderr
    assert (dst / "keep.txt").read_text() == "mine"
    proc = run_cli("convert", src, dst, "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["layers"] == 4
    assert not (dst / "keep.txt").exists()


def test_cli_unknown_source(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    proc = run_cli("convert", tmp_path / "junk", tmp_path / "dst")
    assert proc.returncode == 3 and "cannot tell which format" in proc.stderr
    proc = run_cli("convert", tmp_path / "missing", tmp_path / "dst")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
