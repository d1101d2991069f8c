"""convert and inspect defects a review found: each said something wrong or nothing where the project's rules want
one line on stderr with the right exit status (bad argument 2, not I/O 4), a warning only where it means
something, and a dry run that lists what the real run would write."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from conftest import REPO, cli_one_line as _cli, edit_json, fixture_dir
from w4pack.cli import main

MOE_GGUF = REPO / "tests" / "data" / "llama_quantize" / "tiny-moe-Q4_K_M.gguf"


def _q4_gguf() -> Path:
    return fixture_dir("gguf", "q4_0_exact_in512_out256") / "tensors.gguf"


def test_a_folder_given_for_a_gguf_output_is_a_bad_argument(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Was exit 4 "output already exists; replace it with --force", then with --force exit 2 "give a path ending in
    .gguf" for a path that ends in .gguf: no --force can turn a folder into a file."""
    dst = tmp_path / "dir.gguf"
    dst.mkdir()
    for extra in ([], ["--force"], ["--dry-run"], ["--dry-run", "--force"]):
        rc, err = _cli(capsys, "convert", _q4_gguf(), dst, "--to", "gguf", *extra)
        assert rc == 2, err
        assert f"{dst}: is an existing folder, and GGUF output is a single file" in err
        assert "--force" not in err and "ending in .gguf" not in err
    assert dst.is_dir() and list(dst.iterdir()) == []


@pytest.mark.parametrize("to", ["w4pack", "gguf"])
def test_an_output_below_a_file_says_the_file_is_not_a_folder(to: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Was exit 4 "cannot create a folder next to the output: File exists" (or "Not a directory"), and a dry run
    said the conversion would succeed."""
    plain = tmp_path / "plainfile"
    plain.write_text("x\n")
    for dst in (plain / "out.gguf", plain / "a" / "b.gguf"):
        for dry in ([], ["--dry-run"]):
            rc, err = _cli(capsys, "convert", _q4_gguf(), dst, "--to", to, *dry)
            assert rc == 2, err
            assert f"{plain}: is a file, not a folder: the output {str(dst)!r} cannot be created inside it" in err
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "nowhere")
    rc, err = _cli(capsys, "convert", _q4_gguf(), dangling / "out", "--to", "w4pack")
    assert rc == 2 and f"{dangling}: is a symbolic link to {str(tmp_path / 'nowhere')!r}, which does not exist" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "plainfile"]
    assert plain.read_text() == "x\n"


@pytest.mark.parametrize("spec", ["hf://", "hf:/"])
def test_an_empty_hub_spec_says_how_to_write_one(spec: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Was "hf:: does not exist": the Path click made of the argument collapsed hf:// to a local name."""
    for argv in (["convert", spec, tmp_path / "x"], ["convert", spec, tmp_path / "x", "--dry-run"],
                 ["inspect", spec]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and "'hf://' is not a Hub source; use hf://owner/name[@revision][/path]" in err, err
    assert list(tmp_path.iterdir()) == []


def test_expanded_is_refused_for_other_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was silently ignored (exit 0) while --fuse, the other w4pack-only option, is refused."""
    src = fixture_dir("gptq", "ag_b4_sym_g128")
    for to in ("gptq-v2", "gguf", "compressed-tensors"):
        dst = tmp_path / ("o.gguf" if to == "gguf" else "o")
        for dry in ([], ["--dry-run"]):
            rc, err = _cli(capsys, "convert", src, dst, "--expanded", "--to", to, *dry)
            assert rc == 2 and f"--expanded applies to w4pack output only, not {to}: drop --expanded" in err
    assert list(tmp_path.iterdir()) == []
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "w4"), "--expanded"]) == 0


def test_growth_warning_only_for_notable_growth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A lossless repack into GPTQ grows a little (g_idx, stored zero points): it warned "x1.00"/"x1.01". The
    runtime form of K-quants (--expanded) grows by a third and still warns, with a ratio that is not x1.00."""
    from w4pack.convert import GrowthWarning, convert

    packed = tmp_path / "p1"
    assert main(["convert", str(fixture_dir("gptq", "ag_tiny_llama_b4_g64_descact_sym")), str(packed)]) == 0
    capsys.readouterr()
    assert main(["convert", str(packed), str(tmp_path / "gptq"), "--to", "gptq"]) == 0
    assert "warning" not in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("error", GrowthWarning)
        res = convert(packed, tmp_path / "gptq-v2", to="gptq-v2", show_progress=False)
    assert res["tensor_bytes"] > res["source_tensor_bytes"] and "warnings" not in res  # it did grow, a little
    assert main(["convert", str(MOE_GGUF), str(tmp_path / "x"), "--expanded"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "are larger than those of the source" in err and "x1.3" in err, err


def test_growth_threshold() -> None:
    """More than 5% and more than 64 KiB: layout overheads stay under either (w4pack.convert.GROWTH_SHARE)."""
    from w4pack.convert import growth_is_notable

    assert not growth_is_notable(100 << 20, (100 << 20) * 104 // 100)  # 4% of a large model
    assert growth_is_notable(100 << 20, (100 << 20) * 106 // 100)
    assert not growth_is_notable(16 << 10, 32 << 10)  # doubled, but 16 KiB
    assert not growth_is_notable(1000, 900)


def test_inspect_reports_the_version_of_a_repacked_w4pack_folder(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Was "source: w4pack (file format version 1)" whatever the source folder's w4pack.json said."""
    first, second = tmp_path / "p1", tmp_path / "p2"
    assert main(["convert", str(_q4_gguf()), str(first)]) == 0
    version = json.loads((first / "w4pack.json").read_text())["format_version"]
    assert version >= 2
    assert main(["convert", str(first), str(second)]) == 0
    assert json.loads((second / "w4pack.json").read_text())["source"]["version"] == str(version)
    capsys.readouterr()
    assert main(["inspect", str(second)]) == 0
    assert f"source: w4pack (file format version {version})" in capsys.readouterr().out


def test_inspect_json_of_a_damaged_source_also_says_why_on_stderr(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Was the JSON report on stdout and nothing on stderr: a script reading stderr saw exit 2 and no reason."""
    import shutil

    src = tmp_path / "ctb8"
    shutil.copytree(fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128"), src)
    cfg = src / "config.json"
    cfg.chmod(0o644)
    text = cfg.read_text()
    assert '"num_bits": 4' in text
    cfg.write_text(text.replace('"num_bits": 4', '"num_bits": 8'))
    capsys.readouterr()
    rc = main(["inspect", str(src), "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)  # stdout stays one JSON document
    assert rc == 2 and doc["exit_code"] == 2 and doc["problems"]
    assert err.count("\n") == 1 and err.startswith(f"w4pack: error: {doc['problems'][0]}"), err
    assert f"(and {len(doc['problems']) - 1} more, in the JSON's problems)" in err
    rc, err = _cli(capsys, "inspect", src)  # the text report's line is unchanged
    assert rc == 2 and "more, listed above" in err


def test_dry_run_lists_a_refused_fusion_unfused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The MoE file's layer 1 q/k/v differ in bits, so --fuse qkv fuses layer 0's group only. The dry run said "29
    quantized layers (34 in the source, 6 of them fused into 2)" and left layer 1's q/k/v out of its listing."""
    capsys.readouterr()
    rc = main(["convert", str(MOE_GGUF), str(tmp_path / "dd"), "--fuse", "qkv", "--dry-run", "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 3 == doc["exit_code"]  # the real run still stops at the refused fusion
    # and the one error line on stderr, as inspect --json gives it
    assert err.count("\n") == 1 and err.startswith("w4pack: error: model.layers.1.self_attn.qkv_proj: cannot fuse")
    names = [m["name"] for m in doc["layers"]]
    attn = [n for n in names if "self_attn" in n and "o_proj" not in n]
    assert attn == ["model.layers.0.self_attn.qkv_proj", "model.layers.1.self_attn.q_proj",
                    "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"]
    assert len(names) == doc["source_layers"] - 2 == 32
    assert list(doc["fused"]) == ["model.layers.0.self_attn.qkv_proj"]
    assert any(p.startswith("model.layers.1.self_attn.qkv_proj: cannot fuse") for p in doc["problems"])
    main(["convert", str(MOE_GGUF), str(tmp_path / "dd"), "--fuse", "qkv", "--dry-run"])
    out = capsys.readouterr().out
    assert ": 32 quantized layers (34 in the source, 3 of them fused into 1)" in out
    assert not (tmp_path / "dd").exists()


def _ct_with_config(tmp: Path, name: str, **changes: object) -> Path:
    """The compressed-tensors tiny Llama with config.json changed (a value of None drops the key)."""
    import shutil

    src = tmp / name
    shutil.copytree(fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128"), src)
    (src / "config.json").chmod(0o644)
    edit_json(src / "config.json", changes)
    return src


@pytest.mark.parametrize("changes,reason", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type 'mistral' has no GGUF tensor"),
    ({"num_attention_heads": None, "num_key_value_heads": None, "head_dim": None},
     "lacks num_attention_heads: cannot apply llama.cpp's q/k permutation"),
    ({"num_attention_heads": None, "num_key_value_heads": None, "head_dim": 16},
     "lacks num_attention_heads: cannot apply llama.cpp's q/k permutation"),
])
def test_gguf_config_refusals_in_the_dry_run_as_in_the_real_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                changes: dict, reason: str) -> None:
    """Before: the dry run said "would succeed" (exit 0) where the real run refused (exit 3); with head_dim and no
    head count the real run died with "unexpected TypeError"."""
    src = _ct_with_config(tmp_path, "src", **changes)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "x.gguf"), "--to", "gguf", "--dry-run", "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 3 and reason in doc["problems"][0], doc["problems"]
    rc, err = _cli(capsys, "convert", src, tmp_path / "x.gguf", "--to", "gguf")
    assert rc == 3 and reason in err, err
    assert not (tmp_path / "x.gguf").exists()


def test_gguf_writer_notes_reach_the_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the GGUF writer's notes went to stderr only; --json's document had no "warnings"."""
    from w4pack.formats.gguf import GGUFWarning

    packed = tmp_path / "w4"
    assert main(["convert", str(fixture_dir("compressed-tensors", "tiny_llama_w4a16_sym_g128")), str(packed)]) == 0
    capsys.readouterr()
    assert main(["convert", str(packed), str(tmp_path / "x.gguf"), "--to", "gguf", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    spread = [w for w in doc["warnings"] if "carry the group's scale in each block" in w]
    assert len(spread) == 1 and f"warning: {spread[0]}" in err.splitlines(), (doc, err)
    assert len(err.splitlines()) == len(doc["warnings"])  # each said once
    from w4pack.convert import convert  # the Python API: in the summary, and still issued as a warning

    with pytest.warns(GGUFWarning, match="carry the group's scale"):
        res = convert(packed, tmp_path / "y.gguf", to="gguf", show_progress=False)
    assert any("carry the group's scale" in w for w in res["warnings"])


def test_dry_run_does_not_promise_force_replaces_what_it_refuses(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "note: DST exists; --force replaces it" and then "cannot write: DST: holds no checkpoint"."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "main.py").write_text("x\n")
    capsys.readouterr()
    assert main(["convert", str(fixture_dir("gptq", "ag_b4_sym_g128")), str(proj), "--force", "--dry-run"]) == 4
    out = capsys.readouterr().out
    assert "cannot write" in out and "--force replaces it" not in out, out
    assert "1 quantized layer," in out and "1 quantized layers" not in out, out
