"""Packed checkpoint I/O: round trips, atomicity, and hostile folders refused with one line."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import w4pack
from w4pack.checkpoint import INDEX_NAME, MANIFEST_NAME, CheckpointWriter, open_checkpoint, validate_checkpoint
from w4pack.errors import BadInputError, IOFailure
from w4pack.schema import validate_manifest

from test_layout import random_layer

REPO = Path(__file__).resolve().parent.parent


def write_model(out: Path, seed: int = 0, n_layers: int = 4, max_shard: str = "12KB", force: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    layers = {}
    with CheckpointWriter(out, config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                          source={"format": "test", "notes": ["random"]}, max_shard_size=max_shard,
                          force=force) as w:
        for i in range(n_layers):
            mode = ["none", "int", "float", "int"][i % 4]
            layer = random_layer(rng, 40 + i, 100 + 30 * i, [4, 8, 3, 2][i % 4], [32, 64, -1, 128][i % 4], mode,
                                 act_order=(i % 2 == 1), bias=(i == 0))
            name = f"model.layers.{i}.mlp.down_proj"
            w.add_layer(name, layer)
            layers[name] = layer
        w.add_tensor("model.embed_tokens.weight", rng.standard_normal((50, 16)).astype(np.float16))
        w.add_tensor("model.norm.weight", np.full(16, 0x3F80, np.uint16), "bfloat16")
    return layers


def test_roundtrip_and_api(tmp_path):
    out = tmp_path / "ck"
    layers = write_model(out)
    ck = w4pack.open_checkpoint(out)
    assert ck.layers == list(layers)
    for name, layer in layers.items():
        back = ck.layer(name)
        assert back.differences(layer) == [], name
        np.testing.assert_array_equal(ck.dequantize(name), layer.dequantize())
    assert ck.dtype_name("model.norm.weight") == "bfloat16"
    assert ck.tensor("model.norm.weight")[0] == 0x3F80
    report = validate_checkpoint(out, deep=True)
    assert report["num_layers"] == 4 and len(report["shards"]) > 1
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {s["file"] for s in ck.manifest["shards"]}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "w4pack" and qc["layout_version"] == 1


def test_no_clobber_without_force(tmp_path):
    out = tmp_path / "ck"
    write_model(out, seed=1)
    before = (out / MANIFEST_NAME).read_bytes()
    with pytest.raises(IOFailure, match="already exists"):
        write_model(out, seed=2)
    assert (out / MANIFEST_NAME).read_bytes() == before
    write_model(out, seed=2, force=True)
    assert (out / MANIFEST_NAME).read_bytes() != before
    validate_checkpoint(out)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary folders left behind


def test_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "ck"
    with pytest.raises(RuntimeError):
        with CheckpointWriter(out) as w:
            w.add_tensor("x", np.ones(4, np.float32))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_flipped_byte_caught_by_checksum(tmp_path):
    out = tmp_path / "ck"
    write_model(out)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="sha256") as ei:
        validate_checkpoint(out)
    assert shard.name in str(ei.value)
    validate_checkpoint(out, checksums=False)  # structure alone is still fine


def _mutations():
    def m(fn):
        return fn
    return [
        ("format", lambda d: d.update(format="gptq")),
        ("version", lambda d: d.update(format_version=2)),
        ("layout name", lambda d: d["layout"].update(name="marlin")),
        ("extra key", lambda d: d.update(surprise=1)),
        ("missing shards", lambda d: d.pop("shards")),
        ("bad sha", lambda d: d["shards"][0].update(sha256="xyz")),
        ("shard path escape", lambda d: d["shards"][0].update(file="../evil.safetensors")),
        ("absolute shard", lambda d: d["shards"][0].update(file="/etc/passwd")),
        ("bits 5", lambda d: next(iter(d["layers"].values())).update(bits=5)),
        ("storage mismatch", lambda d: next(iter(d["layers"].values())).update(storage_bits=8)),
        ("zero mode", lambda d: next(iter(d["layers"].values())).update(zero_mode="asym")),
        ("group 40", lambda d: next(iter(d["layers"].values())).update(group_size=40)),
        ("negative shape", lambda d: next(iter(d["layers"].values())).update(shape=[-1, 4])),
        ("layer extra", lambda d: next(iter(d["layers"].values())).update(colour="red")),
        ("int without zeros", lambda d: d["layers"]["model.layers.1.mlp.down_proj"]["tensors"].pop("zeros")),
        ("act-order without perm", lambda d: d["layers"]["model.layers.1.mlp.down_proj"]["tensors"].pop("perm")),
        ("scale dtype", lambda d: next(iter(d["layers"].values())).update(scale_dtype="float8")),
        ("passthrough dup", lambda d: d.update(passthrough=["a", "a"])),
    ]


@pytest.mark.parametrize("label, mutate", _mutations(), ids=[m[0] for m in _mutations()])
def test_broken_manifests_rejected(tmp_path, label, mutate):
    out = tmp_path / "ck"
    write_model(out)
    doc = json.loads((out / MANIFEST_NAME).read_text())
    validate_manifest(doc)
    mutate(doc)
    with pytest.raises(BadInputError, match="schema violation"):
        validate_manifest(doc)
    (out / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(BadInputError) as ei:
        validate_checkpoint(out)
    assert MANIFEST_NAME in str(ei.value)


def _edit_json(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink_out", "missing_shard", "contradicting_shape",
                                  "truncated_shard", "incomplete_marker", "no_quant_config", "tensor_not_in_index"])
def test_hostile_folders(tmp_path, case):
    out = tmp_path / "ck"
    write_model(out)
    first = sorted(out.glob("model-*.safetensors"))[0]
    expect = None
    if case == "dotdot":
        _edit_json(out / INDEX_NAME, lambda d: d["weight_map"].update({"model.norm.weight": "../x.safetensors"}))
        expect = "not a plain file name"
    elif case == "absolute":
        _edit_json(out / INDEX_NAME, lambda d: d["weight_map"].update({"model.norm.weight": "/etc/passwd"}))
        expect = "not a plain file name"
    elif case == "symlink_out":
        outside = tmp_path / "outside.safetensors"
        shutil.copy(first, outside)
        first.unlink()
        first.symlink_to(outside)
        expect = "symbolic link out of the folder"
    elif case == "missing_shard":
        first.unlink()
        expect = "missing"
    elif case == "contradicting_shape":
        _edit_json(out / MANIFEST_NAME, lambda d: d["layers"]["model.layers.0.mlp.down_proj"].update(shape=[41, 100]))
        expect = "contradicts"
    elif case == "truncated_shard":
        data = first.read_bytes()
        first.write_bytes(data[: len(data) // 2])
        expect = "truncated"
    elif case == "incomplete_marker":
        (out / ".w4pack-incomplete").write_text("")
        expect = "unfinished write"
    elif case == "no_quant_config":
        _edit_json(out / "config.json", lambda d: d.pop("quantization_config"))
        expect = "quantization_config"
    elif case == "tensor_not_in_index":
        _edit_json(out / INDEX_NAME, lambda d: d["weight_map"].pop("model.layers.0.mlp.down_proj.qweight"))
        expect = "missing from the index"
    with pytest.raises(BadInputError, match=expect) as ei:
        validate_checkpoint(out)
    assert "\n" not in str(ei.value)
    # and through the CLI: one line, exit 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "w4pack", "validate", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""


KILLER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_checkpoint import write_model
    write_model(__import__('pathlib').Path(sys.argv[1]), n_layers=12, max_shard="20KB")
    print("done", flush=True)
""")


def test_killed_writer_never_leaves_a_valid_folder(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(KILLER.format(tests=str(Path(__file__).parent)))
    # measure one full run, then kill at points spread over it
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(script), str(tmp_path / "full")], check=True, capture_output=True)
    full = time.perf_counter() - t0
    validate_checkpoint(tmp_path / "full")
    rng = np.random.default_rng(0)
    for i, frac in enumerate(sorted(rng.uniform(0.2, 1.0, 6))):
        out = tmp_path / f"k{i}"
        proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        time.sleep(full * frac)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            validate_checkpoint(out)  # only a finished rename may exist, and then it is complete
        for leftover in tmp_path.glob(f".k{i}.w4pack-tmp-*"):
            with pytest.raises(BadInputError):
                validate_checkpoint(leftover)


def test_cli_inspect_and_validate_json(tmp_path):
    out = tmp_path / "ck"
    write_model(out)
    for cmd in (["inspect", str(out), "--json"], ["validate", str(out), "--json"]):
        proc = subprocess.run([sys.executable, "-m", "w4pack", *cmd], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["num_layers"] == 4
    proc = subprocess.run([sys.executable, "-m", "w4pack", "inspect", str(out), "--layers"], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "model.layers.3.mlp.down_proj" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "w4pack", "validate", str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "nope" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "w4pack", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and w4pack.__version__ in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "w4pack", "validate"], capture_output=True, text=True)
    assert proc.returncode == 2


def test_memory_is_bounded_by_shard_not_model(tmp_path):
    """Peak RSS of a conversion does not grow with the number of layers (tensors are spooled to disk)."""
    script = textwrap.dedent("""
        import resource, sys, numpy as np
        sys.path.insert(0, {tests!r})
        from w4pack.checkpoint import CheckpointWriter
        from test_layout import random_layer
        n_layers = int(sys.argv[2])
        rng = np.random.default_rng(3)
        layer = random_layer(rng, 1024, 2048, 4, 64, "int", act_order=False)
        with CheckpointWriter(sys.argv[1], max_shard_size="1GB") as w:
            for i in range(n_layers):
                w.add_layer(f"l{{i}}", layer)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """).format(tests=str(Path(__file__).parent))
    (tmp_path / "m.py").write_text(script)
    rss = {}
    for n in (2, 40):
        proc = subprocess.run([sys.executable, str(tmp_path / "m.py"), str(tmp_path / f"ck{n}"), str(n)],
                              capture_output=True, text=True, check=True)
        rss[n] = int(proc.stdout.split()[-1]) * 1024
    layer_bytes = 1024 * 2048 // 2
    # 38 more layers (~40 MB of packed data in one shard) must not add more than a few layers' worth
    assert rss[40] - rss[2] < 6 * layer_bytes, rss
    assert len(open_checkpoint(tmp_path / "ck40").manifest["shards"]) == 1
