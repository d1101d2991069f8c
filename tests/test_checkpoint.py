"""Packed checkpoint I/O: round trips, atomicity, and hostile folders refused with one line."""
from __future__ import annotations

import json
import os
import re
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
        ("version", lambda d: d.update(format_version=3)),
        ("v2 without files", lambda d: d.pop("files")),
        ("v2 files without config", lambda d: d.update(files=[f for f in d["files"] if f["file"] != "config.json"])),
        ("v1 with files", lambda d: d.update(format_version=1)),
        ("file path escape", lambda d: d["files"][0].update(file="../config.json")),
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


def _edit_header(path: Path, fn, extra: bytes = b"") -> None:
    """Rewrite a safetensors file's JSON header through ``fn`` (padded to 8 bytes), appending ``extra`` to the data."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    fn(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:] + extra)


def _shard_of(out: Path, tname: str) -> Path:
    return out / json.loads((out / INDEX_NAME).read_text())["weight_map"][tname]


def _add_unlisted_tensor(out: Path) -> None:
    """A tensor appended to a shard (header and data) that no index entry lists."""
    shard = _shard_of(out, "model.norm.weight")
    end = max(e["data_offsets"][1] for k, e in json.loads(shard.read_bytes()[8:8 + int.from_bytes(
        shard.read_bytes()[:8], "little")]).items() if k != "__metadata__")
    _edit_header(shard, lambda h: h.update(sneaky={"dtype": "U8", "shape": [4], "data_offsets": [end, end + 4]}),
                 extra=b"\1\2\3\4")


def _list_unindexed_shard(out: Path) -> None:
    """A shard the manifest checksums that the index names for no tensor."""
    import hashlib

    extra = out / "model-99999-of-99999.safetensors"
    shutil.copyfile(sorted(out.glob("model-*.safetensors"))[0], extra)
    raw = extra.read_bytes()
    _edit_json(out / MANIFEST_NAME, lambda d: d["shards"].append(
        {"file": extra.name, "sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}))


BIAS = "model.layers.0.mlp.down_proj.bias"


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink_out", "missing_shard", "contradicting_shape",
                                  "truncated_shard", "incomplete_marker", "no_quant_config", "tensor_not_in_index",
                                  "config_fifo", "index_fifo", "config_dev_zero", "config_link_out", "shard_fifo",
                                  "tensor_not_listed", "shard_not_indexed", "bias_int16", "bias_dtype_contradicted",
                                  "kv_heads_zero", "layers_string", "heads_not_multiple", "total_size_wrong"])
def test_hostile_folders(tmp_path, case, capsys):
    out = tmp_path / "ck"
    write_model(out)
    first = sorted(out.glob("model-*.safetensors"))[0]
    expect = None
    if case in ("config_fifo", "index_fifo"):  # a reader that opened it would wait for a writer for ever
        doc = out / ("config.json" if case == "config_fifo" else INDEX_NAME)
        doc.unlink()
        os.mkfifo(doc)
        expect = "not a regular file"
    elif case == "config_dev_zero":  # read whole, it would fill memory
        (out / "config.json").unlink()
        (out / "config.json").symlink_to("/dev/zero")
        expect = "symbolic link out of the folder"
    elif case == "config_link_out":
        outside = tmp_path / "config.json"
        shutil.move(out / "config.json", outside)
        (out / "config.json").symlink_to(outside)
        expect = "symbolic link out of the folder"
    elif case == "shard_fifo":
        first.unlink()
        os.mkfifo(first)
        expect = "not a regular file"
    elif case == "tensor_not_listed":
        _add_unlisted_tensor(out)
        expect = "tensor sneaky: tensor is in the shard but not in the index"
    elif case == "shard_not_indexed":
        _list_unindexed_shard(out)
        expect = "holds no tensor of the index"
    elif case == "bias_int16":  # (same width: only the header's dtype changes)
        _edit_header(_shard_of(out, BIAS), lambda h: h[BIAS].update(dtype="I16"))
        _edit_json(out / MANIFEST_NAME, lambda d: d["layers"]["model.layers.0.mlp.down_proj"].update(bias_dtype=None))
        expect = "int16 is not a float dtype"
    elif case == "bias_dtype_contradicted":
        _edit_json(out / MANIFEST_NAME,
                   lambda d: d["layers"]["model.layers.0.mlp.down_proj"].update(bias_dtype="float32"))
        expect = "stored as float16 but the manifest says float32"
    elif case == "kv_heads_zero":
        _edit_json(out / "config.json", lambda d: d.update(num_attention_heads=4, num_key_value_heads=0))
        expect = "num_key_value_heads must be a positive integer, got 0"
    elif case == "layers_string":
        _edit_json(out / "config.json", lambda d: d.update(num_hidden_layers="2"))
        expect = "num_hidden_layers must be a positive integer, got '2'"
    elif case == "total_size_wrong":
        _edit_json(out / INDEX_NAME, lambda d: d["metadata"].update(total_size=5))
        expect = "metadata.total_size is 5, but the shards hold [0-9]+ bytes of tensor data"
    elif case == "heads_not_multiple":
        _edit_json(out / "config.json", lambda d: d.update(num_attention_heads=6, num_key_value_heads=4))
        expect = "not a multiple of num_key_value_heads"
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
    with pytest.raises(BadInputError) as ei:  # (every case is the structure's: caught before any checksum)
        validate_checkpoint(out, checksums=False)
    assert "\n" not in str(ei.value) and re.search(expect, str(ei.value)), str(ei.value)
    # and through the CLI: one line, exit 2, no traceback; inspect reads the same documents
    from w4pack.cli import main as cli_main

    capsys.readouterr()
    for cmd in ("validate", "inspect"):
        rc = cli_main([cmd, str(out)])
        cap = capsys.readouterr()
        if cmd == "inspect" and rc == 0:
            continue  # (inspect reads headers only where it shows them: what it did not read it does not judge)
        assert rc == 2, cap.err
        assert cap.err.count("\n") == 1 and "Traceback" not in cap.err and cap.err.startswith("w4pack: error: ")
        assert cap.out == ""


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


# -- output safety: side files, layer names, failures at close, the output path, sizes, modes -------------------
def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".w4pack-" in p.name)


def test_side_file_linked_out_of_the_folder_is_refused(tmp_path):
    """A tokenizer.json that is a symbolic link to /etc/passwd (or any file outside) is not copied into the output."""
    src = tmp_path / "src"
    src.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the output")
    (src / "tokenizer.json").symlink_to(secret)
    (src / "sub").mkdir()
    (src / "sub" / "gen.json").write_text("{}")
    (src / "generation_config.json").symlink_to(Path("sub") / "gen.json")  # a link inside the folder is fine
    out = tmp_path / "ck"
    with pytest.raises(BadInputError, match="symbolic link out of the source folder") as ei:
        with CheckpointWriter(out) as w:
            w.add_tensor("x", np.ones(4, np.float32))
            w.copy_side_files_from(src)
    assert str(src / "tokenizer.json") in str(ei.value) and "\n" not in str(ei.value)
    assert not out.exists() and _leftovers(tmp_path) == []
    (src / "tokenizer.json").unlink()
    with CheckpointWriter(out) as w:
        w.add_tensor("x", np.ones(4, np.float32))
        w.copy_side_files_from(src)
    assert (out / "generation_config.json").read_text() == "{}" and not (out / "tokenizer.json").exists()
    assert open_checkpoint(out).manifest["side_files"] == ["generation_config.json"]


@pytest.mark.parametrize("bad", ["model.layers.0.mlp.dówn_proj", "model.layers.0 mlp", "model/layers.0",
                                 ".hidden", "-dash", "x" * 1025, "ok\n"])
def test_layer_name_the_manifest_cannot_hold_is_refused_when_added(tmp_path, bad):
    """Refused at add_layer, naming the layer, not after the whole model was written (at close, naming a
    w4pack.json that was never written); nothing is left behind."""
    rng = np.random.default_rng(0)
    layer = random_layer(rng, 40, 100, 4, 32, "none", act_order=False)
    added = []
    with pytest.raises(BadInputError, match="layer name cannot be stored") as ei:
        with CheckpointWriter(tmp_path / "ck") as w:
            w.add_layer("model.layers.1.mlp.up_proj", layer)
            w.add_layer(bad, layer)
            added.append(bad)
    assert added == [] and MANIFEST_NAME not in str(ei.value) and "\n" not in str(ei.value)
    assert list(tmp_path.iterdir()) == []


def test_failure_or_interrupt_at_close_removes_the_temporary_folder(tmp_path, monkeypatch):
    """close() raising (here: Ctrl-C while the manifest is written, a failed rename) aborts: no temporary folder
    is left, and an output being replaced with force is still there, unchanged."""
    import w4pack.checkpoint as cp

    out = tmp_path / "ck"
    write_model(out, seed=1)
    before = (out / MANIFEST_NAME).read_bytes()
    real_write = cp._write_bytes

    def interrupted(path, raw):
        if path.name == MANIFEST_NAME:
            raise KeyboardInterrupt
        real_write(path, raw)

    monkeypatch.setattr(cp, "_write_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_model(out, seed=2, force=True)
    monkeypatch.undo()
    assert _leftovers(tmp_path) == [] and (out / MANIFEST_NAME).read_bytes() == before

    real_replace = os.replace

    def failing_replace(a, b, *args, **kw):
        if ".w4pack-tmp-" in str(a) and Path(b) == out:
            raise OSError(5, "Input/output error")
        return real_replace(a, b, *args, **kw)

    from w4pack import atomic

    monkeypatch.setattr(os, "replace", failing_replace)  # the two-rename fallback
    monkeypatch.setattr(atomic, "exchange", failing_replace)  # the atomic swap (renameat2)
    with pytest.raises(IOFailure, match="Input/output error") as ei:
        write_model(out, seed=2, force=True)
    monkeypatch.undo()
    assert str(out) in str(ei.value)
    assert _leftovers(tmp_path) == [] and (out / MANIFEST_NAME).read_bytes() == before  # put back
    validate_checkpoint(out)


def test_output_that_is_a_dangling_symlink_is_refused_up_front(tmp_path):
    """Before: the whole model was written, then the rename failed with "Not a directory" (exit 4) and the complete
    checkpoint stayed in the temporary folder."""
    dst = tmp_path / "dst"
    dst.symlink_to(tmp_path / "nonexistent")
    with pytest.raises(IOFailure, match="symbolic link .* which does not exist; remove the link") as ei:
        write_model(dst)
    assert str(dst) in str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # nothing written
    write_model(dst, force=True)  # force replaces the link itself, not what it pointed at
    assert not dst.is_symlink() and not (tmp_path / "nonexistent").exists()
    validate_checkpoint(dst)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("text", ["infGB", "1e400GB", "nanMB", "-5MB", "99999999999999999999GB", "GB", "", "2XB"])
def test_bad_max_shard_size_is_a_usage_error(tmp_path, text):
    from w4pack.checkpoint import parse_size

    with pytest.raises(BadInputError, match="size") as ei:
        parse_size(text)
    assert repr(text) in str(ei.value)
    with pytest.raises(BadInputError):
        CheckpointWriter(tmp_path / "ck", max_shard_size=text)
    assert list(tmp_path.iterdir()) == []
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("64MiB") == 64 << 20 and parse_size(7) == 7


def test_disk_full_names_the_output_and_says_so(tmp_path, monkeypatch):
    """ENOSPC while a shard is written: one line naming the output and the tensor, and no temporary folder."""
    import w4pack.store.shards as shards
    from conftest import full_disk_open

    monkeypatch.setattr(shards, "open", full_disk_open(lambda _path, mode: mode == "w+b"), raising=False)
    out = tmp_path / "ck"
    with pytest.raises(IOFailure, match="the disk is full") as ei:
        write_model(out)
    assert str(ei.value).startswith(f"{out}: tensor model.layers.0.mlp.down_proj.qweight: cannot write shard 1")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_output_folder_mode_follows_the_umask(tmp_path, umask):
    """Not mkdtemp's 0700: the finished folder gets what mkdir would give."""
    from w4pack.atomic import make_temp_dir

    old = os.umask(umask)
    try:
        write_model(tmp_path / "ck")
        made = make_temp_dir(tmp_path / "other")
    finally:
        os.umask(old)
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o777 & ~umask
    assert made.stat().st_mode & 0o777 == 0o777 & ~umask and made.name.startswith(".other.w4pack-tmp-")


def test_index_total_size_is_tensor_bytes(tmp_path):
    """Hugging Face's convention: the sum of the tensors' data, not of the shard files (headers included)."""
    out = tmp_path / "ck"
    write_model(out)
    ck = open_checkpoint(out)
    index = json.loads((out / INDEX_NAME).read_text())
    data = sum(ck.raw(t).nbytes for t in ck.weight_map)
    assert index["metadata"]["total_size"] == data < sum(s["size"] for s in ck.manifest["shards"])


@pytest.mark.parametrize("fmt", ["w4pack", "compressed-tensors", "gguf"])
def test_reading_a_whole_checkpoint_keeps_resident_memory_flat(tmp_path, fmt):
    """Every page read through a memory map stays resident until the map closes: the readers drop them before
    each layer, so reading every layer of a checkpoint (conversion, verify, validate --deep) does not grow
    resident memory with the model."""
    if fmt == "gguf":
        pytest.importorskip("gguf")
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to measure the peak of the reading alone")
    script = textwrap.dedent("""
        import sys, numpy as np
        sys.path.insert(0, {tests!r})
        from w4pack.checkpoint import CheckpointWriter
        from w4pack.convert import convert
        from w4pack.formats import open_source
        from test_layout import random_layer
        out, n_layers, fmt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        rng = np.random.default_rng(4)
        layer = random_layer(rng, 1024, 4096, 4, 32, {{"gguf": "float", "compressed-tensors": "none"}}.get(fmt, "int"),
                             act_order=False)
        with CheckpointWriter(out + ".w4", max_shard_size="1GB") as w:
            for i in range(n_layers):
                name = f"model.layers.{{i}}.mlp.down_proj"
                w.add_layer(name, layer.replace(name=name))
        src = out + ".w4"
        if fmt != "w4pack":
            src = out + (".gguf" if fmt == "gguf" else ".ct")
            convert(out + ".w4", src, to=fmt, show_progress=False)
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        with open("/proc/self/clear_refs", "w") as fh:  # the peak (VmHWM) restarts from here
            fh.write("5")
        base = status("VmRSS")
        with open_source(src) as s:
            for name in s.layer_names():
                s.read_layer(name)
        print(base, status("VmHWM"))
    """).format(tests=str(Path(__file__).parent))
    (tmp_path / "m.py").write_text(script)
    grew = {}
    for n in (2, 48):
        proc = subprocess.run([sys.executable, str(tmp_path / "m.py"), str(tmp_path / f"ck{n}"), str(n), fmt],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        base, peak = (int(v) * 1024 for v in proc.stdout.split()[-2:])
        grew[n] = peak - base
    layer_bytes = 1024 * 4096 // 2
    # 46 more layers (~100 MB of weights read) must not add more than a few layers' worth
    assert grew[48] - grew[2] < 8 * layer_bytes, grew


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "two-renames"])
def test_interrupt_just_after_the_final_rename_leaves_no_old_copy(tmp_path, monkeypatch, swap):
    """Ctrl-C landing right after the finished folder was renamed (or swapped) into place: the new output stands
    and the previous one (moved aside for --force) is removed, not left behind as a hidden full copy."""
    from w4pack import atomic

    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("previous output")
    tmp = atomic.make_temp_dir(target)
    (tmp / "new.txt").write_text("new output")
    real_replace, real_exchange = os.replace, atomic.exchange

    def replace_then_interrupt(a, b):
        real_replace(a, b)
        if Path(a) == tmp:
            raise KeyboardInterrupt

    def exchange_then_interrupt(a, b):
        if not swap:
            return False
        assert real_exchange(a, b)
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "replace", replace_then_interrupt)
    monkeypatch.setattr(atomic, "exchange", exchange_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        atomic.move_into_place(tmp, target, force=True)
    assert (target / "new.txt").is_file() and not (target / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- issue 30 item 3: every file that defines the model is covered (manifest format version 2) ---------------
from conftest import fixture_dir  # noqa: E402
from hub_fixtures import TOKEN, USER, folder_bytes, hub  # noqa: E402,F401

AWQ_LLAMA = ("awq", "tiny_llama_gemm_g128")


def _cli(*args: str) -> tuple[int, str]:
    """Run the CLI in a child process (as a user would): exit status and stderr (+ stdout for verify's report,
    which names a structure failure there)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "w4pack", *args], capture_output=True, text=True, env=env, timeout=300)
    return p.returncode, p.stderr + (p.stdout if args[0] == "verify" else "")


@pytest.fixture(scope="module")
def packed_llama(tmp_path_factory) -> dict[str, Path]:
    """The AWQ tiny Llama converted twice: plain and with --fuse qkv,gate-up."""
    from w4pack.convert import convert

    src = fixture_dir(*AWQ_LLAMA)
    root = tmp_path_factory.mktemp("packed")
    out = {"src": src}
    for kind, fuse in (("plain", None), ("fused", "qkv,gate-up")):
        convert(src, root / kind, fuse=fuse, show_progress=False)
        out[kind] = root / kind
    return out


def _resign(folder: Path) -> None:
    """Re-record config.json's and the index's checksums in the manifest, as a careful tamperer would: what is
    left to catch it is the consistency of the contents."""
    import hashlib

    def fix(doc: dict) -> None:
        for entry in doc["files"]:
            raw = (folder / entry["file"]).read_bytes()
            entry.update(sha256=hashlib.sha256(raw).hexdigest(), size=len(raw))
    _edit_json(folder / MANIFEST_NAME, fix)


def _truncate_resigned(folder: Path, name: str) -> None:
    """Cut a covered JSON file in half and re-sign it: only parsing it can catch it."""
    raw = (folder / name).read_bytes()
    (folder / name).write_bytes(raw[: len(raw) // 2])
    _resign(folder)


def _rewrite_resigned(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)
    _resign(folder)


def _drop_layer(folder: Path, name: str, *, index_too: bool) -> None:
    gone = {}

    def drop(doc: dict) -> None:
        gone.update(doc["layers"].pop(name)["tensors"])
    _edit_json(folder / MANIFEST_NAME, drop)
    if index_too:
        _edit_json(folder / INDEX_NAME, lambda d: [d["weight_map"].pop(t) for t in gone.values()])
        _resign(folder)


def _swap_fused_parts(folder: Path, i: int, j: int, *, in_config: bool) -> None:
    def swap(parts: list) -> None:
        parts[i]["name"], parts[j]["name"] = parts[j]["name"], parts[i]["name"]
    _edit_json(folder / MANIFEST_NAME, lambda d: swap(d["fused"]["model.layers.0.self_attn.qkv_proj"]))
    if in_config:
        _edit_json(folder / "config.json",
                   lambda d: swap(d["quantization_config"]["fused"]["model.layers.0.self_attn.qkv_proj"]))
        _resign(folder)


#: (kind of checkpoint, tampering, the file the one-line error must name)
TAMPERING = {
    "rms_norm_eps": ("plain", lambda f: _edit_json(f / "config.json", lambda d: d.update(rms_norm_eps=0.5)),
                     "config.json"),
    "empty generation_config": ("plain", lambda f: (f / "generation_config.json").write_bytes(b""),
                                "generation_config.json"),
    "stray shard": ("plain", lambda f: shutil.copyfile(next(f.glob("model-0*.safetensors")),
                                                        f / "model-99999.safetensors"), "model-99999.safetensors"),
    "stray tokenizer": ("plain", lambda f: (f / "tokenizer.json").write_text("{}"), "tokenizer.json"),
    "layer entry removed": ("plain", lambda f: _drop_layer(f, "model.layers.1.mlp.up_proj", index_too=False),
                            INDEX_NAME),
    # (the shard still holds the layer's tensors, which no index entry lists now)
    "layer removed, index re-signed": ("plain", lambda f: _drop_layer(f, "model.layers.1.mlp.down_proj",
                                                                       index_too=True), "model-00001-of-00001"),
    "generation_config truncated, re-signed": ("plain", lambda f: _truncate_resigned(f, "generation_config.json"),
                                               "generation_config.json"),
    "generation_config a list, re-signed": ("plain", lambda f: _rewrite_resigned(f, "generation_config.json", "[]"),
                                            "generation_config.json"),
    "fused table edited": ("fused", lambda f: _swap_fused_parts(f, 0, 1, in_config=False), "config.json"),
    "fused table edited, config re-signed": ("fused", lambda f: _swap_fused_parts(f, 0, 1, in_config=True),
                                             MANIFEST_NAME),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_tampered_folder_refused_by_validate_verify_and_pull(packed_llama, tmp_path, case, hub):  # noqa: F811
    """Before format version 2 all of these were accepted by validate --deep, verify and pull."""
    kind, tamper, names = TAMPERING[case]
    folder = tmp_path / "ck"
    shutil.copytree(packed_llama[kind], folder)
    rc, err = _cli("validate", str(folder))
    assert rc == 0, err
    tamper(folder)
    rc, err = _cli("validate", "--deep", str(folder))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and names in err and "Traceback" not in err, err
    rc, err = _cli("verify", str(folder), "--threads", "1", "--seed", "1")
    assert rc in (1, 2) and names in err, err
    rc, err = _cli("verify", str(folder), "--against", str(packed_llama["src"]), "--threads", "1", "--seed", "1")
    assert rc in (1, 2) and names in err, err
    repo = f"{USER}/tampered"
    hub.add_repo(repo, folder_bytes(folder))
    dest = tmp_path / "pulled"
    rc, err = _cli("pull", repo, str(dest), "--endpoint", hub.endpoint, "--token", TOKEN)
    assert rc == 2 and names in err and not dest.exists(), err


def test_manifest_covers_every_file_and_is_version_2(packed_llama, tmp_path):
    import hashlib

    folder = packed_llama["plain"]
    doc = json.loads((folder / MANIFEST_NAME).read_text())
    assert doc["format_version"] == 2
    covered = {e["file"]: e for e in doc["files"]}
    assert set(covered) == {"config.json", INDEX_NAME, "generation_config.json"}
    # the hash is of the final config.json, quantization_config (written by the writer) included
    for name, entry in covered.items():
        raw = (folder / name).read_bytes()
        assert entry == {"file": name, "sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"]["format_version"] == 2
    report = validate_checkpoint(folder)
    assert {"listing", "fused", "architecture", "sha256"} <= set(report["checks"]) and report["warnings"] == []


def test_card_hidden_entries_and_subfolders_are_not_the_model(packed_llama, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(packed_llama["plain"], folder)
    (folder / "README.md").write_text("# a card\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (folder / "original").mkdir()
    (folder / "original" / "model.safetensors").write_bytes(b"\0" * 64)
    assert validate_checkpoint(folder)["num_layers"] == 14


def test_version_1_manifest_is_read_with_a_warning(packed_llama, tmp_path):
    """Older checkpoints stay usable; validate says what is not covered and how to get a covering manifest."""
    folder = tmp_path / "ck"
    shutil.copytree(packed_llama["plain"], folder)
    _edit_json(folder / MANIFEST_NAME, lambda d: (d.update(format_version=1), d.pop("files")))
    _edit_json(folder / "config.json", lambda d: d["quantization_config"].update(format_version=1))
    report = validate_checkpoint(folder)
    assert "sha256" in report["checks"] and len(report["warnings"]) == 1
    assert "format version 1" in report["warnings"][0] and "w4pack convert" in report["warnings"][0]
    rc, err = _cli("validate", str(folder))
    assert rc == 0 and "warning:" in err and "format version 1" in err
    # the listing and architecture checks apply to version 1 too
    shutil.copyfile(folder / "config.json", folder / "config.json.bak")
    with pytest.raises(BadInputError, match="not listed") as ei:
        validate_checkpoint(folder)
    assert "config.json.bak" in str(ei.value)
    (folder / "config.json.bak").unlink()
    # the remedy the warning names: converting the folder again writes version 2
    from w4pack.convert import convert

    convert(folder, tmp_path / "again", show_progress=False)
    again = validate_checkpoint(tmp_path / "again")
    assert again["format_version"] == 2 and again["warnings"] == []


def test_architecture_check(packed_llama, tmp_path):
    """Layers beyond num_hidden_layers, a shape config.json contradicts, and a model type w4pack does not know
    (skipped, with a warning)."""
    folder = tmp_path / "ck"
    shutil.copytree(packed_llama["plain"], folder)
    _edit_json(folder / "config.json", lambda d: d.update(num_hidden_layers=1))
    _resign(folder)
    with pytest.raises(BadInputError, match="does not have") as ei:
        validate_checkpoint(folder)
    assert "model.layers.1." in str(ei.value)
    _edit_json(folder / "config.json", lambda d: d.update(num_hidden_layers=2, intermediate_size=1024))
    _resign(folder)
    with pytest.raises(BadInputError, match=r"needs \[1024, 256\]"):
        validate_checkpoint(folder)
    _edit_json(folder / "config.json", lambda d: d.update(intermediate_size=512, model_type="somethingnew"))
    _resign(folder)
    report = validate_checkpoint(folder)
    assert "architecture" not in report["checks"] and "somethingnew" in report["warnings"][0]


def _drop_passthrough(folder: Path, tname: str) -> None:
    """Remove a pass-through tensor from a packed folder and re-sign everything (shard, index, manifest), as a
    conversion of a source without it would have written it before the architecture covered such tensors."""
    import hashlib

    from w4pack.store.safetensors import SafetensorsFile, write_safetensors

    index = json.loads((folder / INDEX_NAME).read_text())
    shard = folder / index["weight_map"].pop(tname)
    with SafetensorsFile(shard) as f:
        items = [(k, np.array(f.get(k)), f.dtype_name(k)) for k in f.keys() if k != tname]
        meta = dict(f.metadata)
    size, sha = write_safetensors(shard, items, meta)
    (folder / INDEX_NAME).write_text(json.dumps(index))

    def fix(doc: dict) -> None:
        doc["passthrough"].remove(tname)
        for entry in doc["shards"]:
            if entry["file"] == shard.name:
                entry.update(size=size, sha256=sha)
        for entry in doc["files"]:
            raw = (folder / entry["file"]).read_bytes()
            entry.update(sha256=hashlib.sha256(raw).hexdigest(), size=len(raw))
    _edit_json(folder / MANIFEST_NAME, fix)


@pytest.mark.parametrize("tname", ["model.norm.weight", "model.layers.1.post_attention_layernorm.weight",
                                   "model.embed_tokens.weight"])
def test_architecture_needs_embedding_and_norms(packed_llama, tmp_path, tname):
    """A packed folder without a norm or the embedding passed every check (its linears were all there) and
    loaded with that tensor at its initial value: validate and verify refuse it, naming the tensor."""
    folder = tmp_path / "ck"
    shutil.copytree(packed_llama["plain"], folder)
    assert validate_checkpoint(folder, deep=True)["num_layers"] == 14
    _drop_passthrough(folder, tname)
    with pytest.raises(BadInputError, match="needs this tensor") as ei:
        validate_checkpoint(folder)
    assert f"{folder / MANIFEST_NAME}: tensor {tname}: the llama model of config.json" in str(ei.value)
    rc, err = _cli("verify", str(folder), "--threads", "1", "--seed", "1")
    assert rc == 2 and f"tensor {tname}" in err, err


def test_architecture_qwen3_needs_q_and_k_norms(packed_llama, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(packed_llama["plain"], folder)
    _edit_json(folder / "config.json", lambda d: d.update(model_type="qwen3", head_dim=64))
    _resign(folder)
    # qwen3 normalises each head's queries and keys: q_norm/k_norm weights of head_dim, which this llama lacks
    with pytest.raises(BadInputError, match="needs this tensor") as ei:
        validate_checkpoint(folder)
    assert "model.layers.0.self_attn.q_norm.weight" in str(ei.value)


def test_needed_tensors_table():
    from w4pack.core.arch import needed_tensors

    cfg = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100,
           "tie_word_embeddings": True}
    need, why = needed_tensors(cfg)
    assert why == "" and need["model.embed_tokens.weight"] == (100, 64) and need["model.norm.weight"] == (64,)
    assert need["model.layers.1.self_attn.k_norm.weight"] == (32,) and need["model.layers.1.input_layernorm.weight"] \
        == (64,)
    assert len(need) == 2 + 2 * 4 and "lm_head.weight" not in need  # the head is a linear (needed_linears)
    assert "self_attn.q_norm" not in str(needed_tensors({**cfg, "model_type": "llama"})[0])
    assert needed_tensors({**cfg, "model_type": "gpt2"}) == ({}, "model_type 'gpt2' is not one w4pack knows the "
                                                                  "layers of")


def test_covered_file_linked_out_of_the_folder_is_refused(packed_llama, tmp_path):
    """A checksummed side file must not be read through a link out of the folder (rule 1), even with the same
    bytes."""
    folder = tmp_path / "ck"
    shutil.copytree(packed_llama["plain"], folder)
    outside = tmp_path / "elsewhere.json"
    shutil.move(folder / "generation_config.json", outside)
    (folder / "generation_config.json").symlink_to(outside)
    with pytest.raises(BadInputError, match="symbolic link out of the folder") as ei:
        validate_checkpoint(folder)
    assert "generation_config.json" in str(ei.value)


def test_a_malformed_json_side_file_is_refused_at_convert(tmp_path: Path) -> None:
    """A generation_config.json that is not UTF-8 JSON was copied as is and made the loader fail later; it is bad
    input naming the file (found by tools/fuzz.py: bit flips in the file)."""
    import shutil

    from w4pack.cli import main as cli_main

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128"), src)
    gen = src / "generation_config.json"
    gen.write_bytes(gen.read_bytes()[:-20] + b"\xdf\xff" + gen.read_bytes()[-18:])
    assert cli_main(["convert", str(src), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_quantization_config_must_say_what_the_manifest_implies(tmp_path: Path) -> None:
    """config.json's quantization_config is derived from the manifest: an edit re-signed into the manifest passes
    the checksums but not this check (found by tools/fuzz.py: group_size set to 1e308)."""
    import hashlib

    from w4pack.cli import main as cli_main
    from w4pack.convert import convert

    out = tmp_path / "w4"
    convert(fixture_dir("awq", "tiny_llama_gemm_g128"), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 1e308
    data = json.dumps(cfg, indent=2).encode()
    (out / "config.json").write_bytes(data)
    manifest = json.loads((out / "w4pack.json").read_text())
    for entry in manifest["files"]:
        if entry["file"] == "config.json":
            entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (out / "w4pack.json").write_text(json.dumps(manifest, indent=2))
    assert cli_main(["validate", str(out)]) == 2


@pytest.mark.parametrize("value", [True, "LlamaForCausalLM", [5], [""], {"a": 1}])
def test_config_architectures_not_a_list_of_names_is_one_line(packed_llama, tmp_path, value):
    """Fuzz seed 20261205, w4pack #12: ``"architectures": true`` in a re-signed config.json ended inspect and
    validate --deep in "unexpected TypeError" (the summary takes the list's first class name, as vLLM does). The
    reader now refuses it naming config.json, and convert refuses such a source before writing anything, so it
    never writes what the reader refuses."""
    folder = tmp_path / "ck"
    shutil.copytree(packed_llama["plain"], folder)
    _edit_json(folder / "config.json", lambda d: d.update(architectures=value))
    _resign(folder)
    for args in (("inspect", str(folder)), ("validate", "--deep", str(folder))):
        rc, err = _cli(*args)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, err
        assert f"{folder / 'config.json'}: architectures must be a list" in lines[0], err
    src = tmp_path / "src"
    shutil.copytree(packed_llama["src"], src)
    (src / "config.json").chmod(0o644)
    _edit_json(src / "config.json", lambda d: d.update(architectures=value))
    rc, err = _cli("convert", str(src), str(tmp_path / "out"))
    assert rc == 2 and "config.json: architectures must be a list" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_source_path_of_non_utf8_bytes_is_written_as_unicode_text(tmp_path):
    """A base model path with a byte that is not UTF-8 reaches Python as a lone surrogate (PEP 383); written as is,
    the manifest held "\\udcff", which strict JSON parsers (and now w4pack's own reader) refuse."""
    rng = np.random.default_rng(0)
    with CheckpointWriter(tmp_path / "ck", config={"model_type": "llama"},
                          source={"format": "toml", "base_model": "/models/base\udcff/w.safetensors",
                                  "notes": ["from \udcff"], "where": "x\udcffy"}) as w:
        w.add_layer("model.layers.0.mlp.down_proj", random_layer(rng, 64, 128, 4, 32, "int", False))
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text(encoding="utf-8"))
    text = json.dumps(doc["source"], ensure_ascii=False)
    text.encode("utf-8")  # no lone surrogate left anywhere in the source record
    assert doc["source"]["base_model"] == "/models/base\\udcff/w.safetensors"
    assert "where=x\\udcffy" in doc["source"]["notes"]
    validate_checkpoint(tmp_path / "ck")


def _limited_cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI under a 2 GiB address-space limit: a memory blowup fails fast instead of taking the machine."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "w4pack", *args], capture_output=True, text=True, env=env,
                          timeout=300, preexec_fn=limit)


def test_num_hidden_layers_no_model_has_is_refused_without_a_blowup(packed_llama, tmp_path):
    """``"num_hidden_layers": 1000000000`` (or a GGUF's llama.block_count) made the architecture check list 7·10^9
    modules: gigabytes and "unexpected MemoryError" after a minute, from one edited number. Refused by name now,
    in the packed reader and among a source's problems, before any table is built."""
    import struct

    folder = tmp_path / "ck"
    shutil.copytree(packed_llama["plain"], folder)
    _edit_json(folder / "config.json", lambda d: d.update(num_hidden_layers=10**9))
    _resign(folder)
    src = tmp_path / "src"
    shutil.copytree(packed_llama["src"], src)
    (src / "config.json").chmod(0o644)
    _edit_json(src / "config.json", lambda d: d.update(num_hidden_layers=10**9))
    gguf = tmp_path / "bc.gguf"
    raw = bytearray((REPO / "tests" / "data" / "llama_quantize" / "tiny-Q4_K_M.gguf").read_bytes())
    at = raw.find(b"llama.block_count") + len(b"llama.block_count")
    assert struct.unpack_from("<II", raw, at) == (4, 2)  # a UINT32 value of 2
    struct.pack_into("<I", raw, at + 4, 10**9)
    gguf.write_bytes(bytes(raw))
    for args, where in (((("validate", "--deep", str(folder)), f"{folder / 'config.json'}: ")),
                        (("inspect", str(src)), f"{src}: config.json: "),
                        (("convert", str(src), str(tmp_path / "out")), f"{src}: config.json: "),
                        (("convert", str(gguf), str(tmp_path / "out")), f"{gguf}: the config its metadata gives: ")):
        p = _limited_cli(*args)
        assert p.returncode == 2 and f"{where}num_hidden_layers 1000000000 is more than any model has" in p.stderr, \
            (args, p.stderr)
        assert "unexpected" not in p.stderr and (args[0] == "inspect" or len(p.stderr.strip().splitlines()) == 1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["repeat", "range"])
def test_a_damaged_permutation_names_its_file_and_tensor(tmp_path, how):
    """Every runtime gathers the activations by perm: reading the layer checks it, where the file and tensor are
    known (the native repacker's own check, reached first on the run path, named neither)."""
    out = tmp_path / "ck"
    write_model(out, max_shard="1GB")
    name = "model.layers.1.mlp.down_proj"
    tname = f"{name}.perm"
    (shard,) = sorted(out.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start = json.loads(data[8:8 + n])[tname]["data_offsets"][0] + 8 + n
    first = int.from_bytes(data[start:start + 4], "little")
    bad = first if how == "repeat" else 10 ** 6
    data[start + 4 * 7:start + 4 * 8] = bad.to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="not a permutation of 0..129: entry 7") as exc:
        open_checkpoint(out).packed(name)
    assert exc.value.file == str(shard) and exc.value.tensor == tname
