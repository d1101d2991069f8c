"""Bad input and usage exit 2 with one line naming the file or option (README's exit-code table): unknown --from/--to,
a malformed config.json or a .gguf without the GGUF magic (not "cannot tell which format", 3), an --endpoint that is
not a URL (not a network failure, 4). inspect takes --from and --base as convert does (its errors point there)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import cli_one_line as _cli
from w4pack.cli import main


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
    # hf:// sources read $HF_ENDPOINT too: the same usage error (it was "network failure", 4), before any request
    import w4pack.hub as hub

    def no_request(*args: object, **kwargs: object) -> None:
        raise AssertionError("a request was attempted")

    monkeypatch.setattr(hub, "_api", no_request)
    monkeypatch.setenv("HF_ENDPOINT", "notaurl")
    for argv in (["convert", "hf://o/n", tmp_path / "x"], ["convert", "hf://o/n", tmp_path / "x", "--dry-run"],
                 ["inspect", "hf://o/n@main/sub"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and err.startswith("w4pack: error: $HF_ENDPOINT must be an http:// or https:// URL") and \
            "'notaurl'" in err, err
    assert not (tmp_path / "x").exists()


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
    # stderr is not a terminal here: the one line alone, no blank line above it (click's "end the ^C line")
    assert rc == 130 and err == "w4pack: interrupted; no output was left half-written\n", repr(err)
    # on a terminal a newline first ends the line the "^C" echo or a progress bar left open
    import w4pack.cli as cli_mod

    monkeypatch.setattr(cli_mod, "_isatty", lambda stream: True)
    rc = main(["inspect", str(tmp_path / "ck")])
    assert rc == 130 and capsys.readouterr().err == "\nw4pack: interrupted; no output was left half-written\n"


def test_ctrl_c_wrapped_by_an_import_says_interrupted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.11 wraps a KeyboardInterrupt raised in ``__set_name__`` (a lazy ``import huggingface_hub``) in a
    RuntimeError: still "interrupted", 130, not "unexpected RuntimeError" (2)."""
    import w4pack.cli.inspect_cmd as inspect_cmd

    def import_interrupted(path: object) -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance 'name'") from exc

    monkeypatch.setattr(inspect_cmd, "open_checkpoint", import_interrupted)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "w4pack.json").write_text("{}")
    rc, err = _cli(capsys, "inspect", tmp_path / "ck")
    assert rc == 130 and err == "w4pack: interrupted; no output was left half-written\n", err


def test_bare_w4pack_prints_the_formatted_help(capsys: pytest.CaptureFixture[str]) -> None:
    """``w4pack`` alone: the help as ``--help`` formats it (on stderr, exit 2 as click 8.2+ does for a group run
    without a command), not squashed into one "w4pack: error: Usage: ... Options: ..." line."""
    capsys.readouterr()
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == help_text and "\nOptions:\n" in err and "w4pack: error" not in err, err


_G = ("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_after_the_output_is_in_place_is_a_success(as_json: bool, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C landing after the writer moved the output into place (here: while convert sums the sizes for its
    summary) is a finished conversion: exit 0 and said so, not "interrupted" (130) beside a complete output. One
    landing before the move is still 130 and leaves DST as it was (absent, or the old output with --force)."""
    import json

    import w4pack.convert as conv
    from conftest import fixture_dir
    from w4pack.checkpoint import validate_checkpoint

    src = fixture_dir(*_G)
    out = tmp_path / "out"
    extra = ["--json"] if as_json else []

    def ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "open_source", ctrl_c)  # before anything is written
    assert main(["convert", str(src), str(out), *extra]) == 130 and not os.path.lexists(out)
    capsys.readouterr()
    monkeypatch.undo()
    monkeypatch.setattr(conv, "tensor_bytes", ctrl_c)  # after the move into place
    for force in ([], ["--force"]):
        before = os.lstat(out).st_ino if force else None
        rc = main(["convert", str(src), str(out), *extra, *force])
        got, err = capsys.readouterr()
        assert rc == 0 and err == "", (rc, err)
        assert validate_checkpoint(out)["num_layers"] == 14 and os.lstat(out).st_ino != before
        if as_json:
            doc = json.loads(got)
            assert doc["output"] == str(out.absolute()) and doc["format"] == "w4pack" and doc["summary"] is None
        else:
            assert got.startswith("converted ") and got.count("\n") == 1 and "output was complete" in got, got
    # --force, interrupted before the move: the old output stays, 130
    ino = os.lstat(out).st_ino
    monkeypatch.setattr(conv, "open_source", ctrl_c)
    assert main(["convert", str(src), str(out), "--force", *extra]) == 130 and os.lstat(out).st_ino == ino


_CTRL_C_AFTER_PRINTING = r"""
import atexit, os, signal, sys
import click
sys.argv = [os.path.join(os.path.dirname(sys.executable), "w4pack")] + sys.argv[1:]  # as the console script
echo = click.echo
def echo_then_ctrl_c(message=None, *args, **kwargs):
    echo(message, *args, **kwargs)
    if str(message).startswith("converted "):  # the user presses Ctrl-C just as the result is printed ...
        os.kill(os.getpid(), signal.SIGINT)
click.echo = echo_then_ctrl_c
from w4pack.cli import entry
atexit.register(os.kill, os.getpid(), signal.SIGINT)  # ... and again while the interpreter shuts down
entry()
"""


def test_ctrl_c_after_the_result_is_printed_keeps_the_exit_status(tmp_path: Path) -> None:
    """A Ctrl-C as "converted ..." is printed, or during the interpreter's shutdown, used to make a finished
    conversion exit 130 (or die of SIGINT: -2) with a complete output; the outcome now stands: exit 0."""
    import subprocess
    import sys

    from conftest import fixture_dir

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    env.pop("W4PACK_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_AFTER_PRINTING, "convert", str(fixture_dir(*_G)),
                           str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300,
                          preexec_fn=_sigint_as_in_a_terminal)
    assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr[-800:])
    assert proc.stdout.startswith("converted ") and (tmp_path / "out" / "w4pack.json").is_file()


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
    assert rc == 3 and f"{odd / 'config.json'}: quant_method 'autoawq' is not a method w4pack reads" in err
    assert "name it with --from" in err
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


# -- issue 30: hostile folders and the command line's own contract ------------------------------------------------
def test_corrupt_safetensors_without_config_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No config.json, so only the weights could tell the format; when they do not open, their error is the answer
    (bad input, 2), not "cannot tell which format" (3), for the folder and for the file itself (item 8)."""
    import shutil

    from conftest import fixture_dir

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("awq", "gemm_g64_in576_out128"), src)
    assert not (src / "config.json").exists()
    os.truncate(src / "model.safetensors", 5000)
    ok = tmp_path / "ok"
    shutil.copytree(fixture_dir("awq", "gemm_g64_in576_out128"), ok)
    assert main(["convert", str(ok), str(tmp_path / "packed")]) == 0
    for argv in (["inspect", src], ["convert", src, tmp_path / "out"], ["convert", src, tmp_path / "o", "--dry-run"],
                 ["inspect", src / "model.safetensors"], ["verify", tmp_path / "packed", "--against", src]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{src / 'model.safetensors'}: " in err and "truncated" in err, err
        assert "cannot tell" not in err
    assert not (tmp_path / "out").exists()


def _shard_with_extra(shard: Path, donor: Path, tname: str) -> None:
    """Rewrite ``shard`` with ``tname`` (read from ``donor``) added to it."""
    import numpy as np

    from w4pack.store.safetensors import SafetensorsFile, write_safetensors

    with SafetensorsFile(donor) as d, SafetensorsFile(shard) as s:
        items = [(k, np.array(s.get(k)), s.dtype_name(k)) for k in s.keys()]
        items.append((tname, np.array(d.get(tname)), d.dtype_name(tname)))
        meta = dict(s.metadata)
    write_safetensors(shard, items, meta)


@pytest.mark.parametrize("into", ["later", "earlier"])
def test_tensor_in_two_shards_is_refused(into: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The index names one shard, another shard holds the same tensor: which one is the model? (item 9)."""
    import json
    import shutil

    from conftest import fixture_dir

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded"), src)
    wmap = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    if into == "later":  # the case: embed_tokens (shard 1) copied into shard 2, opened after shard 1
        tname, listed, extra = "model.embed_tokens.weight", wmap["model.embed_tokens.weight"], \
            "model-00002-of-00005.safetensors"
    else:  # a tensor of the last shard copied into the first, which is opened before the one the index names
        tname = next(t for t, f in wmap.items() if f == "model-00005-of-00005.safetensors")
        listed, extra = "model-00005-of-00005.safetensors", "model-00001-of-00005.safetensors"
    assert listed != extra
    _shard_with_extra(src / extra, src / listed, tname)
    for argv in (["inspect", src], ["convert", src, tmp_path / "out"], ["convert", src, tmp_path / "o", "--dry-run"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"tensor {tname}: defined in two shards" in err, err
        assert listed in err and extra in err
    assert not (tmp_path / "out").exists()


def test_tensor_in_two_files_without_an_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    from w4pack.store.safetensors import write_safetensors

    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(src / "a.safetensors", [("w", np.zeros(4, np.float16), None)])
    write_safetensors(src / "b.safetensors", [("w", np.ones(4, np.float16), None)])
    rc, err = _cli(capsys, "inspect", src, "--from", "gptq")
    assert rc == 2 and "tensor w: defined in two shards, a.safetensors and b.safetensors" in err, err


def test_one_shard_of_an_index_says_pass_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One shard given as the source was "has scales, g_idx but no qweight: a damaged GPTQ/AWQ checkpoint" (2) or
    "cannot tell which format" (3, for the shard holding only embeddings): the shard is whole, the path is wrong."""
    import json
    import shutil

    from conftest import fixture_dir
    from w4pack.formats import open_source as formats_open_source
    from w4pack.errors import BadInputError
    from w4pack.sources import open_source

    g = fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")
    packed = tmp_path / "packed"
    assert main(["convert", str(g), str(packed)]) == 0
    for shard in (g / "model-00004-of-00005.safetensors", g / "model-00001-of-00005.safetensors"):
        for argv in (["inspect", shard], ["inspect", shard, "--from", "gptq"], ["convert", shard, tmp_path / "out"],
                     ["convert", shard, tmp_path / "out", "--dry-run"],
                     ["convert", shard, tmp_path / "out", "--from", "awq"], ["verify", packed, "--against", shard]):
            rc, err = _cli(capsys, *argv)
            assert rc == 2 and f"{shard}: one of the 5 shards that model.safetensors.index.json lists, not a whole " \
                               f"checkpoint: pass the folder {g}" in err, (argv, err)
        for opener in (open_source, formats_open_source):
            with pytest.raises(BadInputError, match="pass the folder"):
                opener(shard)
    assert not (tmp_path / "out").exists()
    # a file the index lists alone is the whole checkpoint; a broken index is not what the user asked about
    one = tmp_path / "one"
    shutil.copytree(fixture_dir("gptq", "ag_b4_sym_g128"), one)
    weights = one / "gptq_model-4bit-128g.safetensors"
    index = one / "model.safetensors.index.json"
    for text in (json.dumps({"weight_map": {"x": weights.name}}), "{broken"):
        index.write_text(text)
        capsys.readouterr()
        assert main(["inspect", str(weights)]) == 0, capsys.readouterr().err
    # a packed folder's one shard was read as AWQ ("symmetric AWQ without qzeros is not supported", 3)
    (shard,) = [e["file"] for e in json.loads((packed / "w4pack.json").read_text())["shards"]]
    for argv in (["inspect", packed / shard], ["convert", packed / shard, tmp_path / "out"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{packed / shard}: a shard of the packed checkpoint whose manifest w4pack.json lists " \
                           f"it, not a checkpoint by itself: pass the folder {packed}" in err, (argv, err)
    assert not (tmp_path / "out").exists()


def _demo_packed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """The demo's GPTQ checkpoint (tools/make_demo_checkpoint.py) packed into several shards."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    src = tmp_path / "gptq"
    subprocess.run([sys.executable, str(repo / "tools" / "make_demo_checkpoint.py"), str(src)], check=True,
                   capture_output=True)
    packed = tmp_path / "packed"
    assert main(["convert", str(src), str(packed), "--max-shard-size", "200KB"]) == 0
    capsys.readouterr()
    return packed


@pytest.mark.parametrize("command", ["convert", "verify-against", "run"])
def test_packed_tensor_in_two_shards_is_refused_by_every_reader(command: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A packed folder whose shard holds a tensor the index places in another shard is bad input for every
    command that reads it, not only for validate and inspect (which open every shard header up front): convert,
    verify --against and run open shards as they need them."""
    import json

    packed = _demo_packed(tmp_path, capsys)
    wmap = json.loads((packed / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(wmap.values()))
    assert len(shards) > 1
    tname, listed, extra = "model.norm.weight", wmap["model.norm.weight"], shards[0]
    if extra == listed:
        extra = shards[-1]
    _shard_with_extra(packed / extra, packed / listed, tname)
    if command == "convert":
        argv = ["convert", packed, tmp_path / "out"]
    elif command == "verify-against":
        argv = ["verify", _demo_packed(tmp_path / "other", capsys), "--against", packed]
    else:
        pytest.importorskip("transformers")
        argv = ["run", packed, "--prompt", "hi", "--max-new-tokens", "1"]
    rc, err = _cli(capsys, *argv)
    assert rc == 2 and f"tensor {tname}: defined in two shards" in err, err
    assert listed in err and extra in err
    assert not (tmp_path / "out").exists()


def test_library_warnings_stay_off_the_error_line(tmp_path: Path) -> None:
    """numpy's "overflow encountered in cast" (here: GGUF export checking −scale·zero in fp16) is not printed above
    the one-line error (item 11); W4PACK_DEBUG=1 still shows it."""
    import subprocess
    import sys

    import numpy as np

    from w4pack.canonical import CanonicalLayer
    from w4pack.checkpoint import CheckpointWriter

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "torch_dtype": "float16"}
    ck = tmp_path / "ck"
    with CheckpointWriter(ck, config=cfg, source={"format": "test"}) as w:
        # the rest of the model (attention, embedding, norms) is written as zeros: convert refuses a source that
        # lacks what config.json's architecture needs before any writer looks at a layer
        w.add_tensor("model.embed_tokens.weight", np.zeros((100, 64), np.float16))
        w.add_tensor("lm_head.weight", np.zeros((100, 64), np.float16))
        w.add_tensor("model.norm.weight", np.ones(64, np.float16))
        for part in ("input_layernorm", "post_attention_layernorm"):
            w.add_tensor(f"model.layers.0.{part}.weight", np.ones(64, np.float16))
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            w.add_tensor(f"model.layers.0.{part}.weight", np.zeros((64, 64), np.float16))
        w.add_layer("model.layers.0.mlp.down_proj", CanonicalLayer(
            codes=np.zeros((64, 64), np.uint8), scales=np.full((64, 2), 60000, np.float16), bits=4, group_size=32,
            zero_mode="int", zeros=np.full((64, 2), 3, np.int32), scale_dtype="float16"))
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    env.pop("W4PACK_DEBUG", None)
    env.pop("PYTHONWARNINGS", None)
    argv = [sys.executable, "-m", "w4pack", "convert", str(ck), str(tmp_path / "m.gguf"), "--to", "gguf"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"w4pack: error: {ck}: cannot write GGUF: model.layers.0.mlp.down_proj: GGUF "
                                  "cannot hold this layer")  # (the source named, as every writer names it)
    proc = subprocess.run(argv, capture_output=True, text=True, env={**env, "W4PACK_DEBUG": "1"}, timeout=300)
    assert "RuntimeWarning" in proc.stderr


_INTERRUPT_DURING_IMPORT = r"""
import builtins, os, signal, sys
sys.argv = [os.path.join(os.path.dirname(sys.executable), "w4pack")] + sys.argv[1:]  # as the console script
real_import = builtins.__import__
def importing(name, *args, **kwargs):
    if name == "numpy" and "numpy" not in sys.modules:  # the user presses Ctrl-C while `import w4pack` runs
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)
builtins.__import__ = importing
from w4pack.cli import entry
entry()
"""


def _sigint_as_in_a_terminal() -> None:
    """preexec_fn: a command started from a terminal has SIGINT at its default; a runner started in the background
    (make under nohup, some CI shells) passes SIGINT on ignored, and Python then never raises KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_the_imports_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C in the first tenth of a second (while w4pack and numpy import) is one line and 130, no traceback
    (item 11); inside a command it still reaches the command's clean-up (test above)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT_DURING_IMPORT, "convert", str(tmp_path / "src"),
                           str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=_sigint_as_in_a_terminal)
    assert "numpy" not in proc.stdout
    assert proc.returncode == 130 and proc.stderr == "w4pack: interrupted; no output was left half-written\n", \
        (proc.returncode, proc.stderr[-800:])
    # a library user importing w4pack keeps Python's own KeyboardInterrupt
    lib = _INTERRUPT_DURING_IMPORT.replace("sys.argv = [", "sys.argv = ['x'] or [").replace(
        "from w4pack.cli import entry\nentry()", "try:\n    import w4pack\nexcept KeyboardInterrupt:\n    print('KI')")
    proc = subprocess.run([sys.executable, "-c", lib], capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=_sigint_as_in_a_terminal)
    assert proc.stdout.strip() == "KI", (proc.returncode, proc.stdout, proc.stderr[-500:])


def test_stdout_closed_by_its_reader(tmp_path: Path) -> None:
    """`w4pack inspect X --json | head -c 10`: the reader goes away. Not exit 1 (that is "verification failed", which
    click would give): I/O (4), one line on stderr, no "Exception ignored" from the final flush."""
    import subprocess
    import sys

    from conftest import fixture_dir

    src = fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for extra in (["--layers"], ["--json"]):
        r, w = os.pipe()
        os.close(r)
        try:
            proc = subprocess.run([sys.executable, "-m", "w4pack", "inspect", str(src), *extra], stdout=w,
                                  stderr=subprocess.PIPE, text=True, env=env, timeout=120)
        finally:
            os.close(w)
        assert proc.returncode == 4 and proc.stderr == \
            "w4pack: error: stdout was closed before all output was written (broken pipe)\n", proc.stderr


_LIBRARY_WARNS = r"""
import sys, types
from w4pack.errors import BadInputError
import w4pack.cli.inspect_cmd as inspect_cmd
from w4pack.cli import main

lib = types.ModuleType("somelib")  # a library's Python-level warning (as torch and transformers issue them)
exec(compile("import warnings\ndef load():\n    warnings.warn('somelib: this argument is deprecated', FutureWarning)\n",
             "/usr/lib/python3/site-packages/somelib/__init__.py", "exec"), lib.__dict__)

def open_checkpoint(path, *args, **kwargs):
    lib.load()
    raise BadInputError("not valid JSON", file=str(path))

inspect_cmd.open_checkpoint = open_checkpoint
sys.exit(main(["inspect", sys.argv[1]]))
"""


def test_a_library_warning_is_not_printed_above_the_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "w4pack.json").write_text("{}")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("W4PACK_DEBUG", None)
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-c", _LIBRARY_WARNS, str(tmp_path / "ck")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"w4pack: error: {tmp_path / 'ck'}: not valid JSON\n", proc.stderr


def test_own_warning_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """w4pack's own notices print as one "warning:" line, not Python's two-line form with the source file, line
    and code (found by the fuzzer: a GPTQ folder without its quantize_config.json)."""
    import shutil

    from conftest import fixtures_root

    if fixtures_root() is None:
        pytest.skip("peer fixtures not found (set W4PACK_FIXTURES or place shared/fixtures beside the checkout)")
    src = tmp_path / "src"
    shutil.copytree(fixtures_root() / "gptq" / "gm_b4_sym_g128_descact_v2", src)
    (src / "quantize_config.json").unlink()
    import subprocess
    import sys

    # a child process: under pytest the warning would be recorded by pytest rather than printed
    r = subprocess.run([sys.executable, "-m", "w4pack", "inspect", str(src)], capture_output=True, text=True,
                       timeout=120)
    err = r.stderr
    assert r.returncode == 0 and err.count("\n") == 1, err
    assert err.startswith("warning: ") and "checkpoint_format" in err and ".py:" not in err, err


# -- errors that say what to do next (a first-time user's mistakes) ------------------------------------------------
def test_a_missing_path_says_it_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was "not a folder (a w4pack checkpoint is a model folder)" for a path that is not there at all."""
    gone = tmp_path / "typo"
    for argv in (["validate", gone], ["verify", gone], ["run", gone, "--prompt", "hi"],
                 ["push", gone, "me/x", "--dry-run"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and err.strip() == f"w4pack: error: {gone}: does not exist", (argv, err)


def test_a_source_given_where_a_packed_folder_is_needed_says_convert_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was "not a folder" (a GGUF file) or "no w4pack.json" (a GPTQ folder): true, but not what to do."""
    from conftest import fixture_dir

    gptq = fixture_dir("gptq", "ag_b4_sym_g128")
    gguf = fixture_dir("gguf", "q4_1_exact_in512_out256") / "tensors.gguf"
    for src, fmt in ((gptq, "gptq"), (gguf, "gguf")):
        for argv in (["validate", src], ["verify", src], ["run", src, "--prompt", "hi"],
                     ["push", src, "me/x", "--dry-run"]):
            rc, err = _cli(capsys, *argv)
            assert rc == 2 and f"{src}: a {fmt} checkpoint, not a packed w4pack folder" in err, (argv, err)
            assert f"w4pack convert {src} OUT_DIR, then w4pack {argv[0]} OUT_DIR" in err, err
    rc, err = _cli(capsys, "verify", gptq)
    assert f"then w4pack verify OUT_DIR --against {gptq}" in err
    rc, err = _cli(capsys, "push", gptq, "me/x", "--dry-run")
    assert "then w4pack push OUT_DIR me/x" in err
    (tmp_path / "empty").mkdir()  # not a checkpoint of any format: the reader's own line, unchanged
    rc, err = _cli(capsys, "validate", tmp_path / "empty")
    assert rc == 2 and "no w4pack.json" in err and "w4pack convert" not in err


def test_a_folder_holding_gguf_files_names_the_file_to_convert(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The folder a GGUF file was downloaded into, given to validate/verify/run/push, was answered "no w4pack.json";
    as convert does for such a folder, the line names the file (README: "answered with the file to pass")."""
    import shutil

    data = Path(__file__).resolve().parent / "data" / "llama_quantize"
    one = tmp_path / "download"
    one.mkdir()
    shutil.copy(data / "tiny-Q4_K_M.gguf", one)
    gguf = one / "tiny-Q4_K_M.gguf"
    for argv in (["validate", one], ["verify", one], ["run", one, "--prompt", "hi"], ["push", one, "me/x", "--dry-run"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{one}: a folder holding a GGUF file, not a packed w4pack folder" in err, (argv, err)
        assert f"w4pack convert {gguf} OUT_DIR, then w4pack {argv[0]} OUT_DIR" in err, err
    rc, err = _cli(capsys, "verify", one)
    assert f"then w4pack verify OUT_DIR --against {gguf}" in err
    rc, err = _cli(capsys, "validate", data)
    n = len(list(data.glob("*.gguf")))
    assert rc == 2 and f"{data}: a folder holding {n} GGUF files (tiny-IQ4_NL.gguf, " in err, err
    assert f"w4pack convert {data / 'FILE.gguf'} OUT_DIR" in err


def test_a_wrong_from_names_the_format_detected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was the wrong reader's complaint alone ("header length ... exceeds the file: truncated or not safetensors"
    for a GGUF read with --from awq), which sends the user after a corrupt file instead of the option."""
    from conftest import fixture_dir

    gguf = fixture_dir("gguf", "q4_1_exact_in512_out256") / "tensors.gguf"
    gptq = fixture_dir("gptq", "ag_b4_sym_g128")
    awq = fixture_dir("awq", "tiny_llama_gemm_g128")
    ct = fixture_dir("compressed-tensors", "sym_group128_in512_out256")
    for argv, named, found in ((["convert", gguf, tmp_path / "o", "--from", "awq"], "awq", "gguf"),
                               (["convert", gptq, tmp_path / "o", "--from", "w4pack", "--dry-run"], "w4pack", "gptq"),
                               (["convert", gptq, tmp_path / "o", "--from", "compressed-tensors"],
                                "compressed-tensors", "gptq"),
                               (["inspect", awq, "--from", "gptq"], "gptq", "awq"),
                               # was exit 3 (the GPTQ reader's "not GPTQ" is "unsupported"), and --from w4pack on a
                               # GPTQ folder "no w4pack.json" without the hint
                               (["inspect", "PACKED", "--from", "gptq"], "gptq", "w4pack"),
                               (["inspect", "PACKED", "--from", "awq"], "awq", "w4pack"),
                               (["convert", "PACKED", tmp_path / "o", "--from", "gptq"], "gptq", "w4pack"),
                               (["inspect", gptq, "--from", "w4pack"], "w4pack", "gptq"),
                               (["inspect", gguf, "--from", "w4pack"], "w4pack", "gguf"),
                               # a reader that opens the folder and finds none of its layers (every tensor a
                               # pass-through): was "the source holds no quantized layers", exit 3, no hint
                               (["inspect", ct, "--from", "gptq"], "gptq", "compressed-tensors"),
                               (["convert", ct, tmp_path / "o", "--from", "gptq-v2"], "gptq-v2", "compressed-tensors"),
                               (["verify", "PACKED", "--against", awq, "--from", "gptq"], "gptq", "awq")):
        if not (tmp_path / "packed").exists():  # a packed checkpoint to verify, or to read with a wrong --from
            from w4pack.convert import convert

            convert(_demo_checkpoint(tmp_path / "gptq"), tmp_path / "packed", show_progress=False)
        argv = [tmp_path / "packed" if a == "PACKED" else a for a in argv]
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"(detected format: {found}; drop --from {named}, or pass --from {found})" in err, \
            (argv, err)
    assert not (tmp_path / "o").exists()
    # one family: --from gptq reads v1 and v2 as the checkpoint shows them; --from gptq-v2 forces v2, so on a
    # symmetric v1 folder (every zero field 7) it is the mistake, and said so; where nothing tells, it decides
    rc, err = _cli(capsys, "convert", gptq, tmp_path / "o", "--from", "gptq-v2", "--dry-run")
    assert rc == 2 and "(detected format: gptq; drop --from gptq-v2, or pass --from gptq)" in err, err
    asym = fixture_dir("gptq", "ag_b4_asym_g64")
    assert main(["convert", str(asym), str(tmp_path / "o"), "--from", "gptq-v2", "--dry-run"]) == 0


def test_a_folder_holding_a_gguf_file_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF model is one file; a user who passes the folder it came in was told to name a format with --from,
    and with --from gguf "not a file"."""
    from conftest import fixture_dir

    folder = fixture_dir("gguf", "q4_1_exact_in512_out256")
    rc, err = _cli(capsys, "inspect", folder)
    assert rc == 3 and f"a GGUF model is one file: pass {folder / 'tensors.gguf'}" in err and "--from" not in err
    rc, err = _cli(capsys, "convert", folder, tmp_path / "o", "--from", "gguf")
    assert rc == 2 and f"pass {folder / 'tensors.gguf'}" in err
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes((folder / "tensors.gguf").read_bytes())
    rc, err = _cli(capsys, "inspect", two)
    assert rc == 3 and "pass one of the 2 in it (a.gguf, b.gguf)" in err


def test_an_output_named_like_a_gguf_file_needs_to_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was a w4pack *folder* called model.gguf: the default target is w4pack, and the .gguf name says otherwise."""
    from conftest import fixture_dir

    src = fixture_dir("gguf", "q4_1_exact_in512_out256") / "tensors.gguf"
    for dry in ([], ["--dry-run"]):
        rc, err = _cli(capsys, "convert", src, tmp_path / "model.gguf", *dry)
        assert rc == 2 and "named like a GGUF file" in err and "add --to gguf" in err
    assert not (tmp_path / "model.gguf").exists()
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "model.gguf"), "--to", "gguf"]) == 0
    assert (tmp_path / "model.gguf").is_file()
    assert main(["convert", str(src), str(tmp_path / "dir.gguf"), "--to", "w4pack"]) == 0
    assert (tmp_path / "dir.gguf" / "w4pack.json").is_file()


def test_debug_shows_the_traceback_and_keeps_the_exit_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """W4PACK_DEBUG=1 adds the traceback; the status stays the documented one (an uncaught exception would exit 1,
    "verification failed"), and W4PACK_DEBUG=0 is off like the project's other 0/1 switches."""
    missing = tmp_path / "missing"
    monkeypatch.setenv("W4PACK_DEBUG", "1")
    capsys.readouterr()
    rc = main(["validate", str(missing)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback (most recent call last)" in err and "BadInputError" in err, err
    assert err.rstrip("\n").splitlines()[-1] == f"w4pack: error: {missing}: does not exist", err
    monkeypatch.setenv("W4PACK_DEBUG", "0")
    rc, err = _cli(capsys, "validate", missing)
    assert rc == 2 and err == f"w4pack: error: {missing}: does not exist\n"


def test_a_declared_method_whose_reader_refuses_the_folder_says_why(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """config.json declares gptq, but a mistyped field makes GPTQ's detection refuse the folder: the reader's own
    error names the file and the field (2), not "cannot tell which format" (3) (found by tools/fuzz.py)."""
    import json
    import shutil

    from conftest import fixture_dir

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded"), src)
    qpath = src / "quantize_config.json"
    doc = json.loads(qpath.read_text())
    doc["checkpoint_format"] = 2147483648
    qpath.write_text(json.dumps(doc))
    for argv in (["inspect", src], ["convert", src, tmp_path / "out"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2 and f"{qpath}: checkpoint_format must be a string, got 2147483648" in err, err
    assert not (tmp_path / "out").exists()
