"""What the CLI prints: inspect (layer order, padding, plurals, source label, unreadable layers) and convert
--dry-run's grouped refusals."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from w4pack.checkpoint import CheckpointWriter
from w4pack.cli import main
from w4pack.cli.convert_cmd import group_problems
from w4pack.cli.inspect_cmd import natural_key, source_label

from conftest import fixture_dir
from rtn_helper import rtn_quantize

ACT_ORDER_LLAMA = ("gptq", "ag_tiny_llama_b4_g64_descact_sym")


def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _twelve_layers(out: Path) -> Path:
    """A packed checkpoint with layers 0..11 (two widths: 64 rows need no padding, 40 rows do)."""
    rng = np.random.default_rng(0)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "num_hidden_layers": 12, "vocab_size": 32}
    with CheckpointWriter(out, config=cfg, source={"format": "gguf", "version": "3"}, show_progress=False) as w:
        for i in range(12):
            rows = 40 if i == 7 else 64
            w.add_layer(f"model.layers.{i}.mlp.down_proj",
                        rtn_quantize(rng.standard_normal((rows, 64)).astype(np.float32), group_size=32))
    return out


def test_inspect_layers_in_natural_order_padding_only_where_padded(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    ck = _twelve_layers(tmp_path / "ck")
    rc, out, err = _cli(capsys, "inspect", ck, "--layers")
    assert rc == 0, err
    names = [line.split(":")[0].strip() for line in out.splitlines() if line.strip().startswith("model.layers.")]
    assert names == [f"model.layers.{i}.mlp.down_proj" for i in range(12)]
    padded = [line for line in out.splitlines() if "padded" in line]
    assert len(padded) == 1 and "model.layers.7." in padded[0], out
    assert "  1 shard," in out and "1 shards" not in out
    assert "source: gguf (file format version 3)" in out and "source: gguf 3" not in out


def test_source_labels_and_natural_key() -> None:
    assert source_label("gguf", "3") == "gguf (file format version 3)"
    assert source_label("gptq", "v1") == "gptq v1"
    assert source_label("gptq", "gptq") == "gptq" and source_label("awq", None) == "awq"
    assert sorted(["a.10.b", "a.2.b", "a.1.b"], key=natural_key) == ["a.1.b", "a.2.b", "a.10.b"]


def test_inspect_of_a_source_with_an_unreadable_layer_lists_it_and_exits_as_convert(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30 item 7: one NaN fp16 scale made inspect print "quantized layers: 0" and exit 0; convert exits 2."""
    src = tmp_path / "nan"
    shutil.copytree(fixture_dir("gptq", "ag_b4_asym_g64"), src)
    shard = next(src.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k.endswith(".scales"))
    assert header[name]["dtype"] == "F16"
    off = 8 + n + header[name]["data_offsets"][0]
    raw[off:off + 2] = np.array([np.nan], np.float16).tobytes()
    shard.write_bytes(bytes(raw))
    layer = name[: -len(".scales")]
    rc_convert, _, _ = _cli(capsys, "convert", src, tmp_path / "out")
    rc, out, err = _cli(capsys, "inspect", src)
    assert rc == rc_convert == 2, (out, err)
    assert f"problem: {layer}: scales contain NaN or infinity" in out and str(shard) in out
    assert "1 not (below)" in out
    assert err.count("\n") == 1 and err.startswith("w4pack: error: ") and "scales contain NaN" in err
    rc, out, _ = _cli(capsys, "inspect", src, "--json")
    assert rc == 2 and json.loads(out)["exit_code"] == 2


def test_dry_run_groups_one_refusal_over_many_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = fixture_dir(*ACT_ORDER_LLAMA)
    rc, out, _ = _cli(capsys, "convert", src, tmp_path / "a", "--to", "awq", "--dry-run")
    refusals = [line for line in out.splitlines() if line.startswith("  cannot convert:")]
    assert rc == 3 and len(refusals) == 1, out
    assert "layers (model.layers.0." in refusals[0] and "more): awq (gemm) cannot express act-order" in refusals[0]


def test_group_problems_keeps_distinct_reasons_apart() -> None:
    lines = group_problems(["a.0.q: too wide", "a.1.q: too wide", "a.2.q: NaN", "AWQ stores one group size",
                            "a.3.q: too wide", "a.4.q: too wide", "a.5.q: too wide"])
    assert lines == ["5 layers (a.0.q, a.1.q, a.3.q and 2 more): too wide", "a.2.q: NaN", "AWQ stores one group size"]


def test_convert_announces_the_steps_around_its_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Opening the source and building side files (a GGUF's tokenizer export: seconds) are step messages, not a
    silent tail after the progress bar."""
    from w4pack.convert import convert

    src = fixture_dir(*ACT_ORDER_LLAMA)
    convert(src, tmp_path / "out", show_progress=True)
    err = capsys.readouterr().err
    assert f"reading {src} ..." in err and "preparing side files (config, tokenizer) ..." in err
    assert err.index("preparing side files") < err.index("packing: ")
    convert(src, tmp_path / "quiet", show_progress=False)
    assert capsys.readouterr().err == ""


def test_format_names_are_case_insensitive_and_echoed_as_the_formats_own(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    src = fixture_dir("gptq", "ag_b4_asym_g64")
    rc, out, _ = _cli(capsys, "convert", src, tmp_path / "out", "--to", "GPTQ", "--json")
    assert rc == 0, out
    assert json.loads(out)["format"] == "gptq"


def test_summary_lines_count_in_the_singular_and_dry_run_says_it_would_succeed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Were "converted 1 layers", "(1 quantized layers, 1 shards", "OK: 1 layers", and a dry run that ended without
    a verdict."""
    src = fixture_dir("gptq", "ag_b4_sym_g128")  # one quantized layer
    rc, out, err = _cli(capsys, "convert", src, tmp_path / "o", "--dry-run")
    assert rc == 0, err
    assert out.splitlines()[-1] == "dry run: the conversion would succeed; nothing was written"
    assert not (tmp_path / "o").exists()
    rc, out, err = _cli(capsys, "convert", src, tmp_path / "o")
    assert rc == 0 and out.startswith("converted 1 layer (gptq -> w4pack)"), out
    rc, out, err = _cli(capsys, "validate", tmp_path / "o")
    assert rc == 0 and "(1 quantized layer, 1 shard;" in out, out
    rc, out, err = _cli(capsys, "verify", tmp_path / "o", "--against", src)
    assert rc == 0 and "OK: 1 layer, 0 failed" in out, out


def test_convert_help_gives_examples_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    """convert, the command a newcomer runs first, was the one whose --help had neither."""
    rc, out, _ = _cli(capsys, "convert", "--help")
    assert rc == 0
    assert "Examples:" in out and "w4pack convert model.Q4_0.gguf ./model-w4" in out
    assert "--to gguf" in out and "--dry-run" in out.split("Options:")[0]
    assert "Exit 0 ok, 2 bad input or usage" in out and "4 I/O failure or DST exists without" in out


def test_from_and_to_help_name_every_format(capsys: pytest.CaptureFixture[str]) -> None:
    """--from said only "Source format (default: detected)": a user had to provoke an error to learn the names."""
    from w4pack.cli import FORMAT_NAMES
    from w4pack.formats import REGISTRY, get_format

    get_format("w4pack")  # fills the registry
    assert sorted(FORMAT_NAMES.split(", ")) == sorted(REGISTRY)
    for cmd in ("convert", "inspect", "verify"):
        rc, out, _ = _cli(capsys, cmd, "--help")
        assert rc == 0 and "--from FMT" in out
        flat = " ".join(out.split()).replace("compressed- tensors", "compressed-tensors")
        assert all(name in flat for name in FORMAT_NAMES.split(", ")), (cmd, flat)


def test_verify_limit_says_it_shapes_only_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--limit said "Show only the N worst layers", yet --json (rightly, for scripts) lists them all: say so."""
    rc, out, _ = _cli(capsys, "verify", "--help")
    assert rc == 0 and "--json lists every layer" in " ".join(out.split())
    ck = _twelve_layers(tmp_path / "ck")
    rc, out, err = _cli(capsys, "verify", ck, "--limit", "2", "--json", "--threads", "1")
    assert rc == 0, err
    assert len(json.loads(out)["layers"]) == 12


@pytest.mark.parametrize("argv, says", [
    (["inspect", ".", "--bogus"], "No such option '--bogus'"),
    (["convert"], "Missing argument 'SRC'"),
    (["verify", ".", "--precision", "bad"], "Invalid value for '--precision'"),
    (["nosuchcmd"], "No such command 'nosuchcmd'"),
])
def test_usage_errors_are_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """click's own form was three lines (Usage, Try, Error) where the README promises one."""
    from w4pack.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("w4pack: error: ") and says in err, err
    assert "--help)" in err


def test_inspect_names_per_channel_layers_and_keys_its_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --layers printed a per-channel layer as "g-1" while the kinds line said "per-channel", and the JSON
    of a packed folder lacked the source_format key a source's JSON has."""
    src = fixture_dir("gptq", "ag_b4_sym_gm1")
    for path in (src, tmp_path / "w4"):
        if path != src:
            _cli(capsys, "convert", src, path)
        rc, out, _ = _cli(capsys, "inspect", path, "--layers")
        assert rc == 0 and "per-channel" in out and "g-1" not in out, out
    rc, out, _ = _cli(capsys, "inspect", tmp_path / "w4", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["source_format"] == "w4pack" and doc["layer_kinds"][0]["group_size"] == -1
    assert json.loads(_cli(capsys, "inspect", src, "--json")[1])["source_format"] == "gptq"
