"""Bad input and usage exit 2 with one line naming the file or option (README's exit-code table): unknown --from/--to,
a malformed config.json or a .gguf without the GGUF magic (not "cannot tell which format", 3), an --endpoint that is
not a URL (not a network failure, 4). inspect takes --from and --base as convert does (its errors point there)."""
from __future__ import annotations

from pathlib import Path

import pytest

from w4pack.cli import main


def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return rc, err


def test_unknown_format_names_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "src").mkdir()
    for argv, option in ((["convert", tmp_path / "src", tmp_path / "out", "--to", "bogus"], "--to"),
                         (["convert", tmp_path / "src", tmp_path / "out", "--from", "bogus"], "--from"),
                         (["convert", tmp_path / "src", tmp_path / "out", "--dry-run", "--to", "bogus"], "--to"),
                         (["verify", tmp_path / "src", "--against", tmp_path / "src", "--from", "bogus"], "--from")):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{option}: unknown format 'bogus'" in err and "known: " in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,what", [("garbage{", "not valid JSON"), ("[1, 2]", "not a JSON object")])
def test_malformed_config_json_names_the_file(content: str, what: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(content)
    (src / "model.safetensors").write_bytes(b"")
    for argv in (["inspect", src], ["convert", src, tmp_path / "out"], ["convert", src, tmp_path / "o", "--dry-run"],
                 ["verify", src, "--against", src]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{src / 'config.json'}: {what}" in err and "cannot tell" not in err
    assert not (tmp_path / "out").exists()


def test_gguf_with_bad_magic_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    for argv in (["inspect", bad], ["convert", bad, tmp_path / "out"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{bad}: not a GGUF file" in err and "b'GGML'" in err
    # a folder nothing can be made of stays "cannot tell which format" (3): no file in it is broken
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    rc, err = _cli(capsys, "inspect", tmp_path / "junk")
    assert rc == 3 and "cannot tell which format" in err


def test_endpoint_that_is_not_a_url_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    for argv in (["pull", "owner/name", tmp_path / "d", "--endpoint", "notaurl"],
                 ["push", tmp_path, "owner/name", "--endpoint", "notaurl", "--dry-run"],
                 ["push", tmp_path, "owner/name", "--endpoint", "ftp://host/x"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and "--endpoint must be an http:// or https:// URL" in err
    monkeypatch.setenv("HF_ENDPOINT", "localhost:8080")
    rc, err = _cli(capsys, "pull", "owner/name", tmp_path / "d")
    assert rc == 2 and "$HF_ENDPOINT must be an http:// or https:// URL" in err and "'localhost:8080'" in err
    assert not (tmp_path / "d").exists()


def test_ctrl_c_inside_a_command_says_interrupted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # click turns a KeyboardInterrupt inside a command into Abort; the user still gets "interrupted" and 130
    import w4pack.cli.inspect_cmd as inspect_cmd

    def interrupted(path: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(inspect_cmd, "open_checkpoint", interrupted)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "w4pack.json").write_text("{}")
    capsys.readouterr()
    rc = main(["inspect", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    # (click ends the terminal's "^C" line first: one line of text after it)
    assert rc == 130 and err.strip().splitlines() == ["w4pack: interrupted; no output was left half-written"], err


def _demo_checkpoint(out: Path) -> Path:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(repo / "tools" / "make_demo_checkpoint.py"), str(out)], check=True,
                   capture_output=True)
    return out


def test_inspect_from_reads_a_source_detection_cannot_tell(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from w4pack.convert import convert

    src = _demo_checkpoint(tmp_path / "packed")
    odd = tmp_path / "odd"
    convert(src, odd, to="awq", show_progress=False)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "autoawq"  # a name no reader claims: detection cannot tell
    (odd / "config.json").write_text(json.dumps(cfg))
    rc, err = _cli(capsys, "inspect", odd)
    assert rc == 3 and "cannot tell which format" in err and "--from" in err
    capsys.readouterr()
    assert main(["inspect", str(odd), "--from", "awq", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source_format"] == "awq" and len(doc["layers"]) == 14
    rc, err = _cli(capsys, "inspect", odd, "--from", "bogus")
    assert rc == 2 and "--from: unknown format 'bogus'" in err


def test_inspect_base_reads_toml_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from w4pack.convert import convert

    src = _demo_checkpoint(tmp_path / "packed")
    full = tmp_path / "full"  # tables + the weights that rebuild their codes: a base for the bare tables
    convert(src, full, to="toml", show_progress=False)
    tables = tmp_path / "tables"
    convert(src, tables, to="toml", weights=False, show_progress=False)
    rc, err = _cli(capsys, "inspect", tables)
    assert rc == 2 and "--base" in err
    capsys.readouterr()
    assert main(["inspect", str(tables), "--base", str(full / "model.safetensors"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source_format"] == "toml" and len(doc["layers"]) == 14
    assert main(["inspect", str(tables), "--from", "toml", "--base", str(full / "model.safetensors")]) == 0
    assert "toml checkpoint" in capsys.readouterr().out
    # a w4pack checkpoint holds its codes: --base there is a usage error, not silently ignored
    rc, err = _cli(capsys, "inspect", src, "--base", full / "model.safetensors")
    assert rc == 2 and "--base is only for TOML" in err


def test_fuse_and_base_misuse_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Were exit 3 (unsupported input): the input is fine, the options are not; the line says what to drop."""
    from conftest import fixture_dir

    src = fixture_dir("gptq", "ag_b4_sym_g128")
    for dry in ([], ["--dry-run"]):
        rc, err = _cli(capsys, "convert", src, tmp_path / "o.gguf", "--to", "gguf", "--fuse", "qkv", *dry)
        assert rc == 2 and "--fuse applies to w4pack output only, not gguf: drop --fuse" in err
        rc, err = _cli(capsys, "convert", src, tmp_path / "o", "--base", src, *dry)
        assert rc == 2 and f"{src}: --base is only for TOML quant-table sources" in err and "drop --base" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("var,value,allowed", [("W4PACK_ISA", "sse9", "auto, scalar"),
                                               ("W4PACK_THREADS", "many", "whole number >= 1"),
                                               ("W4PACK_THREADS", "0", "whole number >= 1")])
def test_bad_kernel_environment_is_a_usage_error_in_verify(var: str, value: str, allowed: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Was every layer failing ("N failed", exit 1): the environment is checked once, up front."""
    from conftest import fixture_dir
    from w4pack.convert import convert

    pytest.importorskip("w4pack.native.cpu")
    convert(fixture_dir("gptq", "ag_b4_sym_g128"), tmp_path / "ck", show_progress=False)
    monkeypatch.setenv(var, value)
    rc, err = _cli(capsys, "verify", tmp_path / "ck")
    assert rc == 2 and f"{var}={value!r}" in err and allowed in err and "unset it" in err
    if var == "W4PACK_THREADS":  # not read when --threads gives the count
        capsys.readouterr()
        assert main(["verify", str(tmp_path / "ck"), "--threads", "1"]) == 0
