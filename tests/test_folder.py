"""Which files a model folder may name (folder.py): plain names, and symbolic links only within the folder or,
for a Hugging Face hub cache snapshot, into that repository's blobs."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from conftest import fixture_dir

from w4pack.checkpoint import open_checkpoint
from w4pack.convert import convert
from w4pack.errors import BadInputError
from w4pack.folder import link_target_allowed, member, side_files


def _hub_snapshot(src: Path, cache: Path) -> Path:
    """``src`` laid out as huggingface_hub caches a download: every file a link from snapshots/<rev>/ into
    ../../blobs/<sha256>."""
    repo = cache / "models--org--tiny-gptq"
    blobs, snap = repo / "blobs", repo / "snapshots" / ("a" * 40)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for f in src.iterdir():
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            (blobs / digest).write_bytes(f.read_bytes())
            os.symlink(Path("..") / ".." / "blobs" / digest, snap / f.name)
    return snap


def test_hub_cache_snapshot_converts(tmp_path: Path) -> None:
    # snapshot_download's folder: shards, configs and tokenizer files are all links into the repository's blobs
    src = fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")
    snap = _hub_snapshot(src, tmp_path / "hub")
    (tmp_path / "tok.json").write_text("{}")
    out = tmp_path / "out"
    convert(snap, out, show_progress=False)
    with open_checkpoint(out) as ck:
        assert ck.layers
    direct = tmp_path / "direct"
    convert(src, direct, show_progress=False)
    for f in direct.iterdir():  # the same checkpoint as from the plain folder
        if f.suffix == ".safetensors":
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_links_out_of_a_snapshot_or_folder_refused(tmp_path: Path) -> None:
    snap = _hub_snapshot(fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded"), tmp_path / "hub")
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    assert not link_target_allowed(snap, secret.resolve())
    (snap / "tokenizer.json").unlink(missing_ok=True)
    os.symlink(secret, snap / "tokenizer.json")
    with pytest.raises(BadInputError, match="symbolic link out of the source folder") as exc:
        side_files(snap, ["tokenizer.json"])
    assert "tokenizer.json" in str(exc.value)
    # a snapshot-like folder outside a models--* repository gets no exception
    plain = tmp_path / "x" / "snapshots" / "rev"
    plain.mkdir(parents=True)
    (tmp_path / "x" / "blobs").mkdir()
    (tmp_path / "x" / "blobs" / "b").write_text("{}")
    os.symlink(tmp_path / "x" / "blobs" / "b", plain / "model.safetensors")
    with pytest.raises(BadInputError, match="symbolic link out of the folder"):
        member(plain, "model.safetensors", "shard", "index")


@pytest.mark.parametrize("to", ["gptq", "awq", "compressed-tensors", "w4pack"])
def test_side_file_linked_out_is_refused_for_every_output(tmp_path: Path, to: str) -> None:
    # every writer copies the source's side files; none may copy a link's target from outside the source
    src = tmp_path / "src"
    src.mkdir()
    for f in fixture_dir("gptq", "ag_b4_asym_g64").iterdir():  # (no act-order: every target can write it)
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    os.symlink(secret, src / "tokenizer.json")
    with pytest.raises(BadInputError, match="symbolic link out of the source folder"):
        convert(src, tmp_path / "out", to=to, show_progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["gptq", "awq", "compressed-tensors", "w4pack"])
def test_side_json_that_is_not_an_object_is_refused_for_every_output(tmp_path: Path, to: str) -> None:
    """Every JSON side file Hugging Face's loaders read is an object; validate refuses any other (read_side_json),
    so no writer may copy one: convert would write what validate refuses."""
    src = tmp_path / "src"
    src.mkdir()
    for f in fixture_dir("gptq", "ag_b4_asym_g64").iterdir():
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    (src / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(BadInputError, match="not a JSON object") as ei:
        convert(src, tmp_path / "out", to=to, show_progress=False)
    assert str(src / "generation_config.json") in str(ei.value)
    assert not (tmp_path / "out").exists()


def test_a_repeated_json_key_is_bad_input(tmp_path: Path) -> None:
    """Python keeps a repeated key's last value, other parsers its first: such a file means two things."""
    from w4pack.errors import BadInputError
    from w4pack.store.folder import read_json, read_side_json

    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama", "rms_norm_eps": 1e-5, "x": {"a": 1, "a": 2}}')
    with pytest.raises(BadInputError, match="key 'a' appears twice") as exc:
        read_side_json(p)
    assert exc.value.exit_code == 2 and str(p) in exc.value.one_line()
    p.write_text('{"a": {"a": 1}, "b": [{"a": 1}, {"a": 2}]}')  # the same key in different objects is fine
    assert read_json(p)["b"][1] == {"a": 2}


def test_json_nested_past_the_bound_is_refused_wherever_it_is_read(tmp_path: Path) -> None:
    """Python's parser stops near its recursion limit, which depends on how deep the caller's stack is: a config.json
    nested ~972 levels was read by convert, which wrote every shard and then died re-reading it for the model card
    ("unexpected RecursionError"), and 900 levels converted. A fixed bound gives one answer at any stack depth,
    before anything is written."""
    import json
    import shutil
    import subprocess
    import sys

    from w4pack.store.folder import MAX_JSON_DEPTH, read_json

    p = tmp_path / "doc.json"
    p.write_text("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert read_json(p) is not None
    p.write_text("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(BadInputError, match=f"nested {MAX_JSON_DEPTH + 1} levels deep") as exc:
        read_json(p)
    assert exc.value.exit_code == 2 and str(p) in exc.value.one_line()

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("awq", "tiny_llama_gemm_g128"), src)
    (src / "config.json").chmod(0o644)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config)[:-1] + ', "x": ' + "[" * 900 + "]" * 900 + "}")
    proc = subprocess.run([sys.executable, "-m", "w4pack", "convert", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{src / 'config.json'}: JSON nested 901 levels deep" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_json_string_that_is_not_unicode_is_refused(tmp_path: Path) -> None:
    """JSON may spell a lone surrogate (``"\\udcff"``) and Python's parser keeps it; Hugging Face's Rust loaders and
    strict parsers refuse it. A config.json holding one used to convert, and its output carried it on."""
    import json
    import shutil
    import subprocess
    import sys

    from w4pack.store.folder import read_json

    p = tmp_path / "doc.json"
    p.write_text('{"emoji": "\\ud83d\\ude00", "a": ["\\u00ff"]}')  # a surrogate pair is one character
    assert read_json(p)["emoji"] == "\U0001F600"
    for text in ('{"a": ["x\\udcffy"]}', '{"k\\ud800": 1}'):
        p.write_text(text)
        with pytest.raises(BadInputError, match="not valid Unicode") as exc:
            read_json(p)
        assert str(p) in exc.value.one_line() and exc.value.exit_code == 2
        exc.value.one_line().encode("utf-8")

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("awq", "tiny_llama_gemm_g128"), src)
    (src / "config.json").chmod(0o644)
    config = json.loads((src / "config.json").read_text())
    config["_name_or_path"] = "model\udcff"
    (src / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "w4pack", "convert", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "config.json" in lines[0] and "not valid Unicode" in lines[0]
    assert not (tmp_path / "out").exists()


def test_read_json_reads_only_regular_files_of_bounded_size(tmp_path, monkeypatch):
    """A FIFO named config.json would block a reader for ever and /dev/zero would fill its memory: both are refused
    before a byte is read, and so is a file larger than any JSON document of a model folder."""
    from w4pack.store import folder

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(BadInputError, match="not a regular file") as ei:
            folder.read_json(path)
        assert str(path) in str(ei.value)
    with pytest.raises(BadInputError, match="directory"):
        folder.read_json(tmp_path)
    big = tmp_path / "index.json"
    big.write_text('{"weight_map": {}}' + " " * 64)
    assert folder.read_json(big) == {"weight_map": {}}
    monkeypatch.setattr(folder, "MAX_JSON_BYTES", 32)
    with pytest.raises(BadInputError, match="larger than any JSON file"):
        folder.read_json(big)
