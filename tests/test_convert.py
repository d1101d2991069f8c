"""convert: the driver and its CLI on a w4pack source (formats have their own tests)."""
from __future__ import annotations

import json
import re
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import w4pack
from w4pack.checkpoint import open_checkpoint
from w4pack.convert import convert, plan
from w4pack.errors import BadInputError, IOFailure

from conftest import fixture_dir
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
    proc = run_cli("convert", src, dst, "--force")  # a folder holding no checkpoint is not --force's to delete
    assert proc.returncode == 4 and "holds no checkpoint (keep.txt)" in proc.stderr
    assert (dst / "keep.txt").read_text() == "mine"
    (dst / "config.json").write_text("{}")  # a config beside notes is a project's, not an output
    proc = run_cli("convert", src, dst, "--force")
    assert proc.returncode == 4 and "holds no checkpoint (config.json, keep.txt)" in proc.stderr
    (dst / "model.safetensors").write_text("")  # an earlier model folder: replaced whole
    proc = run_cli("convert", src, dst, "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["layers"] == 4
    assert not (dst / "keep.txt").exists()


@pytest.mark.parametrize("to", ["w4pack", "gguf"])
def test_cli_convert_force_does_not_replace_a_users_file(tmp_path, to):
    """--force over notes.txt deleted it for a checkpoint folder (or a GGUF file): replaced are earlier outputs
    only, and the dry run predicts the same refusal."""
    src = tmp_path / "src"
    write_model(src)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    says = "is a file, not an earlier checkpoint folder" if to == "w4pack" else "is not a GGUF file"
    proc = run_cli("convert", src, notes, "--to", to, "--force")
    assert proc.returncode == 4 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert notes.read_text() == "my notes"
    proc = run_cli("convert", src, notes, "--to", to, "--force", "--dry-run", "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == doc["exit_code"] == 4 and says in doc["output_problems"][0], doc
    assert notes.read_text() == "my notes"


def test_cli_unknown_source(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    proc = run_cli("convert", tmp_path / "junk", tmp_path / "dst")
    assert proc.returncode == 3 and "cannot tell which format" in proc.stderr
    proc = run_cli("convert", tmp_path / "missing", tmp_path / "dst")
    assert proc.returncode == 2 and "does not exist" in proc.stderr


# -- output safety ------------------------------------------------------------------------------------------------
def _one_line_error(proc, rc: int, *needles: str) -> None:
    assert proc.returncode == rc, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "unexpected" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)  # the shared fixtures are read-only
    return dst


@pytest.mark.parametrize("case", ["same", "same_via_link", "parent", "grandparent", "inside_existing"])
def test_output_that_is_or_holds_the_source_is_refused(tmp_path, case):
    """Before: `convert par/src par --force` deleted the input, `convert SRC SRC --force` replaced it, and
    `convert SRC SRC/x --force` replaced a file of the source."""
    src = tmp_path / "par" / "src"
    write_model(src)
    before = sorted((str(p), p.read_bytes() if p.is_file() else b"") for p in src.rglob("*"))
    if case == "same_via_link":
        (tmp_path / "link").symlink_to(src)
    dst = {"same": src, "same_via_link": tmp_path / "link", "parent": tmp_path / "par", "grandparent": tmp_path,
           "inside_existing": src / "config.json"}[case]  # (a file of the source itself)
    with pytest.raises(BadInputError, match="the output (is|contains|lies inside) the source") as ei:
        convert(src, dst, force=True)
    assert str(dst) in str(ei.value)
    proc = run_cli("convert", src, dst, "--force")
    _one_line_error(proc, 2, "choose")
    assert sorted((str(p), p.read_bytes() if p.is_file() else b"") for p in src.rglob("*")) == before
    assert not list(tmp_path.rglob(".*w4pack-*"))


def test_output_folder_inside_the_source_is_allowed(tmp_path):
    # readers take only the top-level files of a folder: a subfolder output, new or replaced, touches no source data
    src = tmp_path / "src"
    write_model(src)
    convert(src, src / "w4")
    convert(src, src / "w4", force=True)  # the same conversion again
    w4pack.validate_checkpoint(src / "w4")
    w4pack.validate_checkpoint(src)


def test_cli_side_file_linked_out_of_the_source_is_refused(tmp_path):
    """`ln -sf /etc/passwd SRC/tokenizer.json; convert SRC OUT` copied /etc/passwd into OUT/tokenizer.json."""
    src = _copy(fixture_dir("gptq", "ag_b4_sym_g128"), tmp_path / "src")
    (src / "tokenizer.json").symlink_to("/etc/passwd")
    proc = run_cli("convert", src, tmp_path / "out")
    _one_line_error(proc, 2, str(src / "tokenizer.json"), "symbolic link out of the source folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _rename_tensors(st: Path, old: str, new: str) -> None:
    """Rewrite a safetensors header with ``old`` replaced by ``new`` in every tensor name (data untouched)."""
    raw = st.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header = {k.replace(old, new): v for k, v in header.items()}
    text = json.dumps(header, ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    st.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_cli_layer_name_the_manifest_cannot_hold_fails_before_writing(tmp_path):
    """A GPTQ module named with a non-ASCII letter: refused before any layer is written, naming it and the source
    (before: after the whole model was written, naming a w4pack.json that did not exist, leaving the temp folder)."""
    src = _copy(fixture_dir("gptq", "ag_b4_sym_g128"), tmp_path / "src")
    (shard,) = src.glob("*.safetensors")
    _rename_tensors(shard, "mlp.down_proj", "mlp.dówn_proj")
    proc = run_cli("convert", src, tmp_path / "out")
    _one_line_error(proc, 2, "model.layers.0.mlp.dówn_proj", "layer name cannot be stored", str(src))
    assert "w4pack.json" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("size", ["infGB", "1e400GB", "nanMB", "-5MB"])
def test_cli_bad_max_shard_size_is_a_usage_error(tmp_path, size):
    src = tmp_path / "src"
    write_model(src)
    proc = run_cli("convert", src, tmp_path / "dst", "--max-shard-size", size)
    _one_line_error(proc, 2, "--max-shard-size", repr(size))
    assert not (tmp_path / "dst").exists()


def test_disk_full_in_a_peer_format_writer_names_the_output(tmp_path, monkeypatch):
    """--to awq / compressed-tensors stream their tensors (store/shards.py): a full disk said only "No space left
    on device", naming no file."""
    import w4pack.store.shards as shards
    from conftest import full_disk_open

    monkeypatch.setattr(shards, "open", full_disk_open(lambda path, _mode: Path(path).name.endswith(".partial")),
                        raising=False)
    src = fixture_dir("awq", "tiny_llama_gemm_g128")
    for to in ("awq", "compressed-tensors"):
        out = tmp_path / f"out-{to}"
        with pytest.raises(IOFailure, match="the disk is full") as ei:
            convert(src, out, to=to, show_progress=False)
        assert str(ei.value).startswith(f"{out}: tensor ") and "\n" not in str(ei.value)
    assert list(tmp_path.iterdir()) == []


def test_peer_format_output_mode_and_total_size(tmp_path):
    """AtomicFolder's output gets the umask's mode (not mkdtemp's 0700); the index's total_size is tensor bytes."""
    from w4pack.safetensors_io import SafetensorsFile

    old = os.umask(0o027)
    try:
        convert(fixture_dir("awq", "tiny_llama_gemm_g128"), tmp_path / "awq", to="awq", max_shard_size="1MB",
                show_progress=False)
    finally:
        os.umask(old)
    out = tmp_path / "awq"
    assert out.stat().st_mode & 0o777 == 0o750
    index = json.loads((out / "model.safetensors.index.json").read_text())
    data = 0
    for fname in sorted(set(index["weight_map"].values())):
        f = SafetensorsFile(out / fname)
        data += sum(f.get(t).nbytes for t, owner in index["weight_map"].items() if owner == fname)
        f.close()
    assert index["metadata"]["total_size"] == data


# -- --dry-run reflects the real run -------------------------------------------------------------------------------
TINY = ("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")


def _main(capsys, *argv):
    from w4pack.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_dry_run_counts_the_layers_after_fuse(tmp_path, capsys):
    """Before: --dry-run ignored --fuse and reported 14 layers where the real run made 8."""
    src = fixture_dir(*TINY)
    rc, out, err = _main(capsys, "convert", src, tmp_path / "f", "--fuse", "qkv,gate-up", "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["exit_code"] == 0 and doc["problems"] == [], err
    assert len(doc["layers"]) == 8 and doc["source_layers"] == 14 and len(doc["fused"]) == 4
    assert all(name.endswith(("qkv_proj", "gate_up_proj")) for name in doc["fused"])
    rc, out, _ = _main(capsys, "convert", src, tmp_path / "f", "--fuse", "qkv,gate-up", "--dry-run")
    assert rc == 0 and "8 quantized layers (14 in the source, 10 of them fused into 4)" in out
    assert not (tmp_path / "f").exists()
    assert convert(src, tmp_path / "f", fuse="qkv,gate-up", show_progress=False)["layers"] == 8


@pytest.mark.parametrize("size", ["100", "junk", "1KB"])
def test_dry_run_checks_max_shard_size_as_the_real_run(tmp_path, capsys, size):
    src = fixture_dir(*TINY)
    for dry in (["--dry-run"], []):
        rc, out, err = _main(capsys, "convert", src, tmp_path / "f", "--max-shard-size", size, *dry)
        assert rc == 2 and out == "" and "--max-shard-size" in err and repr(size) in err, (dry, err)
    assert not (tmp_path / "f").exists()
    rc, _, err = _main(capsys, "convert", src, tmp_path / "f", "--max-shard-size", "1KiB", "--dry-run")
    assert rc == 0, err


def test_dry_run_exits_with_the_code_the_real_run_gives(tmp_path, capsys):
    """Before: 0 after listing "cannot convert" problems, and no word that DST exists."""
    src = fixture_dir(*TINY)
    rc, out, _ = _main(capsys, "convert", src, tmp_path / "a", "--to", "awq", "--dry-run")
    assert rc == 3 and "cannot convert: " in out and "): awq (gemm) cannot express act-order" in out
    assert out.splitlines()[-1] == "dry run: the conversion would fail (exit 3); nothing was written"
    rc, out, _ = _main(capsys, "convert", src, tmp_path / "a", "--to", "awq", "--dry-run", "--json")
    assert rc == 3 and json.loads(out)["exit_code"] == 3 and json.loads(out)["output_problems"] == []
    assert _main(capsys, "convert", src, tmp_path / "a", "--to", "awq")[0] == 3
    dst = tmp_path / "d"
    dst.mkdir()
    rc, out, _ = _main(capsys, "convert", src, dst, "--dry-run")
    assert rc == 4 and f"cannot write: {dst}: output already exists; replace it with --force" in out
    assert "force=True" not in out  # no Python argument names in a CLI message
    assert _main(capsys, "convert", src, dst)[0] == 4
    rc, out, _ = _main(capsys, "convert", src, dst, "--dry-run", "--force")
    assert rc == 0 and f"note: {dst} exists; --force replaces it" in out and list(dst.iterdir()) == []
    # an existing output and layers the target cannot hold: every writer reports the output first, as the dry run
    for to in ("awq", "toml", "compressed-tensors", "gptq"):
        dry = _main(capsys, "convert", src, dst, "--to", to, "--dry-run")[0]
        assert dry == _main(capsys, "convert", src, dst, "--to", to)[0] == 4, to


def test_convert_help_states_sizes_and_gguf(capsys):
    rc, out, _ = _main(capsys, "convert", "--help")
    out = " ".join(out.split())
    assert rc == 0 and "plain bytes" in out and "KB/MB/GB" in out and "KiB/MiB/GiB" in out
    assert "at least 1024 bytes" in out and "Ignored for --to gguf" in out and "DST is one file" in out


def test_reader_options_reach_the_reader_and_unknown_options_are_refused(tmp_path):
    """source_options go to the reader (v1_zeros="carry" changes the zero points of GPTQ v1 zero-0 layers);
    an option the w4pack writer does not take is refused, not dropped as it was."""
    src = fixture_dir("gptq", "ag_b4_asym_g128_zero0")
    convert(src, tmp_path / "masking", show_progress=False)
    convert(src, tmp_path / "carry", show_progress=False, source_options={"v1_zeros": "carry"})
    with open_checkpoint(tmp_path / "masking") as a, open_checkpoint(tmp_path / "carry") as b:
        za = [a.layer(n).zeros for n in a.layers]
        zb = [b.layer(n).zeros for n in b.layers]
    # masking reads what AutoGPTQ's own kernels read; carry reads the fields differently
    assert np.array_equal(za[0], np.load(src / "truth" / "zeros_as_read_by_v1_readers.npy"))
    assert not np.array_equal(za[0], zb[0])
    with pytest.raises(BadInputError, match="w4pack writer takes no option v1_zeros"):
        convert(src, tmp_path / "x", show_progress=False, v1_zeros="carry")
    assert not (tmp_path / "x").exists()
    # the dry run's API takes the same options and refuses the same mistakes
    assert plan(src, tmp_path / "y", source_options={"v1_zeros": "carry"})["exit_code"] == 0
    with pytest.raises(BadInputError, match="w4pack writer takes no option v1_zeros"):
        plan(src, tmp_path / "y", v1_zeros="carry")


def test_bad_thread_count_is_refused_before_anything_is_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("W4PACK_THREADS", "0")
    for extra in ((), ("--dry-run",)):
        rc, _out, err = _main(capsys, "convert", fixture_dir(*TINY), tmp_path / "o", *extra)
        assert rc == 2 and "W4PACK_THREADS='0'" in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_formats_declare_their_own_layer_checks() -> None:
    """convert --dry-run trusts the declared flag instead of probing the class: it must match the override."""
    from w4pack.formats import _available
    from w4pack.formats.base import Format

    for name, fmt in _available().items():
        overrides = fmt.check_writable.__func__ is not Format.check_writable.__func__
        assert fmt.own_layer_checks == overrides, name


# -- what config.json's architecture needs, and commands that agree about one source --------------------------
def _without(src: Path, *tnames: str) -> None:
    """Rewrite the source's single safetensors file without ``tnames``."""
    from w4pack.store.safetensors import SafetensorsFile, write_safetensors

    (st,) = src.glob("*.safetensors")
    with SafetensorsFile(st) as f:
        items = [(k, np.array(f.get(k)), f.dtype_name(k)) for k in f.keys() if k not in tnames]
        meta = dict(f.metadata)
    write_safetensors(st, items, meta)


@pytest.mark.parametrize("tname", ["model.norm.weight", "model.layers.0.input_layernorm.weight",
                                   "model.embed_tokens.weight"])
def test_source_without_a_tensor_the_model_needs_is_refused(tmp_path, tname):
    """An AWQ Llama without its final norm converted, and validate and verify accepted the output: the model then
    ran with the norm at its initial value. convert, its dry run, inspect and verify --against refuse it (2)."""
    good = tmp_path / "good"
    convert(fixture_dir("awq", "tiny_llama_gemm_g128"), good, show_progress=False)
    src = _copy(fixture_dir("awq", "tiny_llama_gemm_g128"), tmp_path / "src")
    _without(src, tname)
    want = f"{src}: tensor {tname}: the llama model of config.json needs this tensor"
    for argv in (["convert", src, tmp_path / "out"], ["inspect", src],
                 ["verify", good, "--against", src, "--threads", "1"]):
        _one_line_error(run_cli(*argv), 2, want)
    dry = run_cli("convert", src, tmp_path / "out", "--dry-run")
    assert dry.returncode == 2 and want in dry.stdout, dry.stdout
    assert not (tmp_path / "out").exists()


def test_a_tied_head_may_be_absent(tmp_path):
    """tie_word_embeddings: the head is the embedding, so a source without lm_head.weight is complete."""
    src = _copy(fixture_dir("awq", "tiny_llama_gemm_g128"), tmp_path / "src")
    _without(src, "lm_head.weight")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    convert(src, tmp_path / "out", show_progress=False)
    assert run_cli("validate", tmp_path / "out").returncode == 0


def test_config_that_contradicts_the_layers_is_refused_before_writing(tmp_path):
    """intermediate_size 3 in a compressed-tensors config.json: convert wrote a folder validate refused, and inspect
    exited 0. The writer now runs validate's architecture check before the output exists; inspect and verify
    --against say the same."""
    src = _copy(fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128"), tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 3}))
    want = f"{src}: tensor model.layers.0.mlp.gate_proj: layer is [512, 256] but the llama model of config.json needs"
    _one_line_error(run_cli("convert", src, tmp_path / "out"), 2, want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    _one_line_error(run_cli("inspect", src), 2, want)
    dry = run_cli("convert", src, tmp_path / "out", "--dry-run")
    assert dry.returncode == 2 and want in dry.stdout, dry.stdout
    good = tmp_path / "good"
    convert(fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128"), good, show_progress=False)
    _one_line_error(run_cli("verify", good, "--against", src, "--threads", "1"), 2, want)  # not a difference (1)


def test_inspect_exits_as_convert_for_a_broken_side_file(tmp_path):
    """A generation_config.json that is not UTF-8: convert refuses to copy it (2); inspect listed it and exited 0."""
    src = _copy(fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128"), tmp_path / "src")
    raw = bytearray((src / "generation_config.json").read_bytes())
    raw[20] = 0xDF
    (src / "generation_config.json").write_bytes(bytes(raw))
    want = f"{src / 'generation_config.json'}: not valid JSON"
    _one_line_error(run_cli("convert", src, tmp_path / "out"), 2, want)
    _one_line_error(run_cli("inspect", src), 2, want)
    assert not (tmp_path / "out").exists()


_QUANTS = Path(__file__).resolve().parent / "data" / "llama_quantize"


def _demo_gptq(tmp_path: Path) -> Path:
    """tools/make_demo_checkpoint.py's 4-bit GPTQ checkpoint (group 64: no GGUF block)."""
    src = tmp_path / "demo-gptq"
    subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "tools" / "make_demo_checkpoint.py"),
                    str(src)], check=True, capture_output=True)
    return src


@pytest.mark.parametrize("source,target", [
    ("tiny-Q4_K_M.gguf", "gptq"), ("tiny-Q4_K_M.gguf", "gptq-v2"), ("tiny-Q4_K_M.gguf", "awq"),
    ("tiny-Q4_K_M.gguf", "toml"), ("tiny-Q4_K_M.gguf", "compressed-tensors"), ("tiny-Q6_K.gguf", "awq"),
    ("demo", "gguf")])
def test_every_refusal_names_a_way_out_that_works(source: str, target: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """README: a writer refuses what its format cannot hold exactly, "exit 3, naming the layer and a way out".
    Each refusal names one, and every target it names converts the same source (AWQ suggested --to gptq for
    6-bit layers, which GPTQ refuses too; GGUF, GPTQ, TOML and compressed-tensors named none)."""
    import re

    from conftest import cli_one_line
    from w4pack.cli import main

    pytest.importorskip("gguf", reason="install the gguf package: pip install -e '.[test]'")
    src = _demo_gptq(tmp_path) if source == "demo" else _QUANTS / source
    dst = tmp_path / ("out.gguf" if target == "gguf" else "out")
    rc, err = cli_one_line(capsys, "convert", src, dst, "--to", target)
    assert rc == 3 and "way out: " in err, err
    way_out = err.split("way out: ", 1)[1]
    targets = re.findall(r"--to ([\w-]+)", way_out.split(")", 1)[0])
    assert targets, err
    for i, other in enumerate(targets):
        out = tmp_path / (f"w{i}.gguf" if other == "gguf" else f"w{i}")
        capsys.readouterr()
        rc = main(["convert", str(src), str(out), "--to", other])
        err2 = capsys.readouterr().err
        assert rc == 0, f"the way out of {err!r}, --to {other}, fails too: {err2}"


@pytest.mark.parametrize("to, kw, says", [
    ("awq", {"verison": "gemv"}, "the awq writer takes no option verison (it takes: version)"),
    ("gptq", {"version": "v2"}, "the gptq writer takes no option version (it takes: checkpoint_format)"),
    ("compressed-tensors", {"bogus": 1}, "the compressed-tensors writer takes no option bogus (it takes: none)"),
    ("toml", {"weight": False}, "the toml writer takes no option weight (it takes: variant, weights)"),
    ("gguf", {"bogus": 1}, "the gguf writer takes no option bogus"),
])
def test_every_writer_refuses_an_option_it_does_not_take(tmp_path, to, kw, says):
    """A misspelt option (verison=) wrote AWQ GEMM without a word; only the w4pack writer refused one."""
    src = tmp_path / "src"
    write_model(src)
    with pytest.raises(BadInputError, match=re.escape(says)):
        convert(src, tmp_path / "out", to=to, show_progress=False, **kw)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, case", [("awq", "gemm_g128_in512_out256"),
                                          ("compressed-tensors", "sym_group128_in512_out256")])
def test_every_reader_refuses_an_option_it_does_not_take(tmp_path, family, case):
    from conftest import fixture_dir

    with pytest.raises(BadInputError, match="reader takes no option bogus"):
        convert(fixture_dir(family, case), tmp_path / "out", show_progress=False, source_options={"bogus": 1})
    assert not (tmp_path / "out").exists()
