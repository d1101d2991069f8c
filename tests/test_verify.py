"""w4pack verify: passes on good checkpoints (own and converted fixtures), fails naming the layer on
tampered ones, and reports quantization error against a base model."""
from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from w4pack.canonical import CanonicalLayer
from w4pack.checkpoint import CheckpointWriter, open_checkpoint
from w4pack.cli import main
from w4pack.errors import BadInputError, W4PackError
from w4pack.safetensors_io import write_safetensors

from conftest import fixture_cases, fixture_dir, has_cuda

cpu = pytest.importorskip("w4pack.native.cpu")
if not cpu.available():  # pragma: no cover
    pytest.skip("native CPU module not built (make native)", allow_module_level=True)

from w4pack.verify import TOLERANCE, verify  # noqa: E402

from test_native_cpu import make_layer  # noqa: E402

LAYERS = {
    "model.layers.0.mlp.down_proj": dict(n=96, k=320, bits=4, gs=64, zero_mode="int", act_order=True, seed=1),
    "model.layers.0.mlp.up_proj": dict(n=320, k=96, bits=4, gs=32, zero_mode="none", seed=2),
    "model.layers.0.self_attn.q_proj": dict(n=96, k=96, bits=8, gs=-1, zero_mode="float", scale_dtype="bfloat16", seed=3),
}


def layers() -> dict[str, CanonicalLayer]:
    return {name: make_layer(**spec) for name, spec in LAYERS.items()}


def write(path: Path, content: dict[str, CanonicalLayer]) -> Path:
    with CheckpointWriter(path, force=True, config={"model_type": "llama"}, source={"format": "test"}) as w:
        for name, layer in content.items():
            w.add_layer(name, layer)
        w.add_tensor("model.norm.weight", np.linspace(0.5, 1.5, 96).astype(np.float16))
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("good") / "ck", layers())


def run_cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["verify", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_good_checkpoint_passes(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = verify(good, against=good, threads=1, seed=1)
    assert rep.ok, rep.summary()
    assert {c.name for c in rep.layers} == set(LAYERS)
    assert all(c.exact and c.gemm_error < TOLERANCE["exact"] for c in rep.layers)
    assert rep.passthrough == {"total": 1, "identical": 1, "extra": 0}
    rc, out, _ = run_cli(str(good), "--against", str(good), "--threads", "1", capsys=capsys)
    assert rc == 0
    assert "OK: 3 layers, 0 failed" in out and "3/3 bit-identical" in out
    rc, out, _ = run_cli(str(good), "--precision", "fast", "--json", "--threads", "1", capsys=capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] is True and doc["precision"] == "fast" and doc["tolerance"] == TOLERANCE["fast"]
    assert len(doc["layers"]) == 3 and all(0 < lay["gemm_error"] < 2e-2 for lay in doc["layers"])


def test_flipped_nibble_fails_naming_the_layer(good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    content = layers()
    bad = content["model.layers.0.mlp.up_proj"]
    codes = bad.codes.copy()
    codes[5, 7] ^= 0x1
    content["model.layers.0.mlp.up_proj"] = bad.replace(codes=codes)
    tampered = write(tmp_path / "ck", content)
    rc, out, _ = run_cli(str(tampered), "--against", str(good), "--threads", "1", capsys=capsys)
    assert rc == 1
    first = out.splitlines()[1]
    assert first.startswith("FAIL") and "model.layers.0.mlp.up_proj" in first and "DIFF" in first
    assert "codes: 1 mismatches" in out
    assert "1 failed" in out.splitlines()[-1]


def test_wrong_scale_fails_naming_the_layer(good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    content = layers()
    bad = content["model.layers.0.mlp.down_proj"]
    scales = bad.scales.copy()
    scales[3, 1] = np.float16(float(scales[3, 1]) * 1.5)
    content["model.layers.0.mlp.down_proj"] = bad.replace(scales=scales)
    tampered = write(tmp_path / "ck", content)
    rc, out, _ = run_cli(str(tampered), "--against", str(good), "--json", "--threads", "1", capsys=capsys)
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False
    worst = doc["layers"][0]
    assert worst["name"] == "model.layers.0.mlp.down_proj" and worst["exact"] is False
    assert any(re.search(r"scales: \d+ mismatches", p) for p in worst["problems"])
    assert all(lay["ok"] for lay in doc["layers"][1:])


def test_corrupted_shard_fails_structure_and_names_the_layer(good: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "ck"
    shutil.copytree(good, copy)
    with open_checkpoint(copy) as ck:
        tname = ck.manifest["layers"]["model.layers.0.self_attn.q_proj"]["tensors"]["qweight"]
        shard = copy / ck.weight_map[tname]
    data = bytearray(shard.read_bytes())
    hlen = struct.unpack("<Q", data[:8])[0]
    offset = 8 + hlen + json.loads(data[8:8 + hlen])[tname]["data_offsets"][0]
    data[offset + 100] ^= 0x10  # one nibble of one code
    shard.write_bytes(bytes(data))
    rep = verify(copy, against=good, threads=1, seed=2)
    assert not rep.ok and not rep.structure_ok and "sha256" in rep.structure_error
    failed = [c.name for c in rep.failed_layers]
    assert failed == ["model.layers.0.self_attn.q_proj"]
    rc, out, _ = run_cli(str(copy), "--threads", "1", capsys=capsys)
    assert rc == 1 and "sha256" in out


def test_quantization_error_against_base(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    content = layers()
    rng = np.random.default_rng(0)
    tensors = []
    expect = {}
    for name, layer in content.items():
        w = layer.dequantize(np.float64)
        w0 = (w + rng.standard_normal(w.shape) * 0.01 * np.abs(w).mean()).astype(np.float16)
        tensors.append((f"{name}.weight", w0, None))
        expect[name] = np.linalg.norm(w - w0) / np.linalg.norm(w0.astype(np.float64))
    base = tmp_path / "base"
    base.mkdir()
    write_safetensors(base / "model.safetensors", tensors, metadata={"format": "pt"})
    ck = write(tmp_path / "ck", content)
    rep = verify(ck, base=base, threads=1, seed=3)
    assert rep.ok, rep.summary()
    for c in rep.layers:
        assert c.quant_error == pytest.approx(expect[c.name], rel=1e-6)
    assert [c.name for c in rep.sorted_layers()] == sorted(expect, key=lambda n: -expect[n])
    rc, out, _ = run_cli(str(ck), "--base", str(base / "model.safetensors"), "--threads", "1", capsys=capsys)
    assert rc == 0 and "quant err" in out and "quantization error mean" in out


def test_bad_input_and_unavailable_device(tmp_path: Path, good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(str(tmp_path), capsys=capsys)
    assert rc == 2 and "w4pack.json" in err
    with pytest.raises(BadInputError):
        verify(tmp_path)
    if not has_cuda():
        rc, _, err = run_cli(str(good), "--device", "cuda", capsys=capsys)
        assert rc == 3 and "CUDA verification is not available" in err


def _shard_of(ck: Path) -> Path:
    return ck / json.loads((ck / "w4pack.json").read_text())["shards"][0]["file"]


def _point_index_outside(ck: Path) -> None:
    index = ck / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    name = next(iter(doc["weight_map"]))
    doc["weight_map"][name] = "../" + doc["weight_map"][name]
    index.write_text(json.dumps(doc))


def _symlink_shard_out(ck: Path) -> None:
    shard = _shard_of(ck)
    outside = ck.parent / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)


def _truncate_shard(ck: Path) -> None:
    shard = _shard_of(ck)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


BAD_FOLDERS = {
    "garbage-config": (lambda ck: (ck / "config.json").write_text("garbage{"), "config.json"),
    "missing-config": (lambda ck: (ck / "config.json").unlink(), "config.json"),
    "garbage-manifest": (lambda ck: (ck / "w4pack.json").write_text("garbage{"), "w4pack.json"),
    "missing-index": (lambda ck: (ck / "model.safetensors.index.json").unlink(), "model.safetensors.index.json"),
    "truncated-shard": (_truncate_shard, ".safetensors"),
    "index-outside-folder": (_point_index_outside, "model.safetensors.index.json"),
    "symlinked-shard": (_symlink_shard_out, ".safetensors"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_unreadable_checkpoint_is_bad_input_exit_2(case: str, as_json: bool, good: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Malformed input exits 2 with one line on stderr, as validate does; exit 1 is kept for failed checks."""
    copy = tmp_path / "ck"
    shutil.copytree(good, copy)
    spoil, names = BAD_FOLDERS[case]
    spoil(copy)
    with pytest.raises(BadInputError):
        verify(copy, threads=1, seed=5)
    rc, out, err = run_cli(str(copy), "--threads", "1", *(["--json"] if as_json else []), capsys=capsys)
    assert rc == 2 and out == ""  # nothing on stdout: no summary, no half JSON document
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("w4pack: error: ") and names in lines[0], err
    rc, _, err = main(["validate", str(copy)]), *capsys.readouterr()
    assert rc == 2


# ---- every converted fixture verifies bit-exact against its source ----------------------------------
FIXTURES = [(fam, case) for fam in ("gptq", "awq", "compressed-tensors", "gguf", "toml") for case in fixture_cases(fam)]


@pytest.mark.parametrize("family,case", FIXTURES, ids=[f"{f}/{c}" for f, c in FIXTURES] or None)
def test_converted_fixture_verifies(family: str, case: str, tmp_path: Path) -> None:
    from w4pack.convert import convert

    src = fixture_dir(family, case)
    opts = {}
    base = None
    if family == "toml":
        base = src / "base_weights_fp16.safetensors"
        opts["base"] = base
        src = src / "quant_dir"
    elif family == "gguf":
        src = next(src.glob("*.gguf"))
    try:
        convert(src, tmp_path / "out", **opts)
    except (W4PackError, ImportError) as exc:
        pytest.skip(f"{family} reader cannot convert this case yet: {exc}")
    rep = verify(tmp_path / "out", against=src, base=base, threads=1, seed=4)
    assert rep.ok, rep.summary() + "\n" + rep.table()
    assert rep.layers and all(c.exact for c in rep.layers)
    if base is not None:
        assert all(c.quant_error is not None and c.quant_error < 0.5 for c in rep.layers)


# ---- fused checkpoints: each part against its rows ---------------------------------------------------
ATTN = "model.layers.0.self_attn"


def _qkv_parts() -> dict[str, CanonicalLayer]:
    """q/k/v that can be fused: same kind, one act-order permutation (the parts share g_idx), biases."""
    perm = (np.arange(128) // 32).astype(np.int32)
    np.random.default_rng(7).shuffle(perm)
    return {f"{ATTN}.{leaf}": make_layer(n, 128, 4, 32, "int", seed=10 + i).replace(g_idx=perm.copy())
            for i, (leaf, n) in enumerate((("q_proj", 64), ("k_proj", 32), ("v_proj", 32)))}


def _write_fused(path: Path, parts: dict[str, CanonicalLayer], flip_row: int | None = None) -> Path:
    """A checkpoint holding q/k/v as one qkv_proj (fuse.fuse_layers), optionally with one code changed."""
    from w4pack.fuse import fuse_layers

    fused, rows = fuse_layers(f"{ATTN}.qkv_proj", [lay.replace(name=n) for n, lay in parts.items()])
    if flip_row is not None:
        codes = fused.codes.copy()
        codes[flip_row, 3] ^= 0x1
        fused = fused.replace(codes=codes)
    with CheckpointWriter(path, force=True, config={"model_type": "llama"}, source={"format": "test"}) as w:
        w.add_layer(f"{ATTN}.qkv_proj", fused)
        w.fused = {f"{ATTN}.qkv_proj": rows}
        w.add_tensor("model.norm.weight", np.linspace(0.5, 1.5, 96).astype(np.float16))
    return path


@pytest.mark.parametrize("family,case", [("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded"),
                                         ("awq", "tiny_llama_gemm_g128")])
def test_fused_conversion_verifies_against_its_source(family: str, case: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Before: every fused layer was "not in the source checkpoint" and every q/k/v/gate/up "missing" (exit 1)."""
    from w4pack.convert import convert

    src = fixture_dir(family, case)
    convert(src, tmp_path / "f", fuse="qkv,gate-up", show_progress=False)
    rep = verify(tmp_path / "f", against=src, threads=1, seed=8)
    assert rep.ok, rep.summary() + "\n" + rep.table()
    fused = [c for c in rep.layers if c.parts]
    assert fused and {c.name.rsplit(".", 1)[1] for c in fused} == {"qkv_proj", "gate_up_proj"}
    assert all(c.exact and all(p["exact"] for p in c.parts) for c in rep.layers if c.parts)
    n_parts = sum(len(c.parts) for c in fused)
    rc, out, _ = run_cli(str(tmp_path / "f"), "--against", str(src), "--threads", "1", capsys=capsys)
    assert rc == 0 and f"({n_parts}/{n_parts} fused parts)" in out and "missing" not in out


def test_fused_part_that_differs_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parts = _qkv_parts()
    plain = write(tmp_path / "plain", parts)
    good_fused = _write_fused(tmp_path / "fused", parts)
    assert verify(good_fused, against=plain, threads=1, seed=1).ok
    bad = _write_fused(tmp_path / "bad", parts, flip_row=64 + 5)  # a row of k_proj
    rep = verify(bad, against=plain, threads=1, seed=1)
    (check,) = rep.layers
    assert not rep.ok and check.exact is False and not rep.problems
    assert [(p["name"].rsplit(".", 1)[1], p["rows"], p["exact"]) for p in check.parts] == [
        ("q_proj", [0, 64], True), ("k_proj", [64, 96], False), ("v_proj", [96, 128], True)]
    assert check.problems == [f"part {ATTN}.k_proj (rows 64:96) differs from the source: codes: 1 mismatches"]
    rc, out, _ = run_cli(str(bad), "--against", str(plain), "--json", "--threads", "1", capsys=capsys)
    assert rc == 1 and json.loads(out)["layers"][0]["parts"][1]["differences"] == ["codes: 1 mismatches"]
    # the other way round: an unfused checkpoint against a fused source compares with the source's rows
    rep = verify(plain, against=bad, threads=1, seed=1)
    assert [c.name for c in rep.failed_layers] == [f"{ATTN}.k_proj"] and not rep.problems


def test_fused_quantization_error_uses_the_parts_base_weights(tmp_path: Path) -> None:
    parts = _qkv_parts()
    rng = np.random.default_rng(3)
    base = tmp_path / "base.safetensors"
    orig = {n: (lay.dequantize(np.float64) + rng.standard_normal((lay.out_features, 128)) * 1e-3) for n, lay in
            parts.items()}
    write_safetensors(base, [(f"{n}.weight", w.astype(np.float16), None) for n, w in orig.items()],
                      metadata={"format": "pt"})
    rep = verify(_write_fused(tmp_path / "fused", parts), base=base, threads=1, seed=1)
    (check,) = rep.layers
    w = np.concatenate([lay.dequantize(np.float64) for lay in parts.values()])
    w0 = np.concatenate([o.astype(np.float16).astype(np.float64) for o in orig.values()])
    assert rep.ok, rep.table()
    assert check.quant_error == pytest.approx(np.linalg.norm(w - w0) / np.linalg.norm(w0), rel=1e-6)


def test_fused_rows_that_do_not_tile_the_layer_fail(tmp_path: Path) -> None:
    from w4pack.errors import BadInputError

    ck = _write_fused(tmp_path / "fused", _qkv_parts())
    mpath = ck / "w4pack.json"
    doc = json.loads(mpath.read_text())
    doc["fused"][f"{ATTN}.qkv_proj"][2]["rows"] = [96, 120]
    mpath.write_text(json.dumps(doc))
    # an inconsistent manifest is bad input (exit 2), found by the structure check before any layer runs
    with pytest.raises(BadInputError, match="fused"):
        verify(ck, threads=1, seed=1)
    qc_path = ck / "config.json"
    cfg = json.loads(qc_path.read_text())
    cfg["quantization_config"]["fused"] = doc["fused"]
    qc_path.write_text(json.dumps(cfg))  # config.json agrees again: the rows themselves are refused
    with pytest.raises(BadInputError, match=r"fused parts cover rows \[0, 120\) of the layer's 128"):
        verify(ck, threads=1, seed=1)


# ---- --against hf://, the seed, the help ---------------------------------------------------------------
from hub_fixtures import hub  # noqa: E402,F401


def test_against_hf_source(hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001,F811
                           capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "does not exist" (verify ran detect() on the spec); convert and inspect took hf:// already."""
    from w4pack.convert import convert

    src = fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")
    hub.add_repo("w4org/tiny-gptq", {p.relative_to(src).as_posix(): p.read_bytes()
                                     for p in src.rglob("*") if p.is_file()})
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    convert(src, tmp_path / "f", fuse="qkv", show_progress=False)
    rc, out, err = run_cli(str(tmp_path / "f"), "--against", "hf://w4org/tiny-gptq", "--threads", "1",
                           capsys=capsys)
    assert rc == 0, err
    assert "10/10 bit-identical (6/6 fused parts) to hf://w4org/tiny-gptq" in out.splitlines()[-1]


def test_summary_prints_the_seed_that_reproduces_it(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(str(good), "--threads", "1", capsys=capsys)
    seed = int(re.search(r"; seed (\d+);", out.splitlines()[-1]).group(1))
    rc2, out2, _ = run_cli(str(good), "--threads", "1", "--seed", str(seed), capsys=capsys)
    assert rc == rc2 == 0 and f"; seed {seed};" in out2
    errors = [line.split()[-1] for line in out.splitlines()[1:4]]
    assert errors == [line.split()[-1] for line in out2.splitlines()[1:4]]  # the same activations


def test_help_states_the_checks_as_the_code_makes_them(capsys: pytest.CaptureFixture[str]) -> None:
    from w4pack.verify import CUDA_TOLERANCE, FAST_FLOAT_BOUND

    rc = main(["verify", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "(2e-2)" not in out
    assert f"<= {TOLERANCE['fast']:.0e} against a float64 reference on the same rounded activations" in out
    assert f"<= {FAST_FLOAT_BOUND:.0e} against the unrounded float64 reference" in out
    assert f"--device cuda: {CUDA_TOLERANCE:.0e}" in out
    assert "TOML quant-table --against source needs" in out and "hf://" in out and "reruns with --seed" in out


def _packed_and_source_copy(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(packed folder, a copy of its GPTQ source to damage, that copy's safetensors file)."""
    good = fixture_dir("gptq", "ag_b4_asym_g64")
    packed = tmp_path / "packed"
    assert main(["convert", str(good), str(packed)]) == 0
    src = tmp_path / "src"
    shutil.copytree(good, src)
    return packed, src, next(src.glob("*.safetensors"))


@pytest.mark.parametrize("drop,rc,needle", [
    ((".qweight", ".qzeros", ".scales", ".g_idx"), 3, "the source holds no quantized layers"),
    ((".qweight",), 2, "layer model.layers.0.mlp.down_proj has qzeros, scales, g_idx but no qweight"),
], ids=["no-layers", "layer-without-qweight"])
def test_against_a_source_convert_refuses_exits_as_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          drop: tuple[str, ...], rc: int, needle: str) -> None:
    """A GPTQ source whose only layer lost its tensors: convert refuses it (3: nothing to convert; 2: a damaged
    layer, whose other tensors were carried as floats), and verify --against reported a difference (1)."""
    from w4pack.store.safetensors import SafetensorsFile

    packed, src, st = _packed_and_source_copy(tmp_path)
    with SafetensorsFile(st) as f:
        items = [(k, np.array(f.get(k)), f.dtype_name(k)) for k in f.keys() if not k.endswith(drop)]
    write_safetensors(st, items)
    results = []
    for argv in (["convert", str(src), str(tmp_path / "out")], ["inspect", str(src)],
                 ["verify", str(packed), "--against", str(src), "--threads", "1"]):
        capsys.readouterr()
        code = main(argv)
        err = capsys.readouterr().err
        results.append((code, err.count("\n"), needle in err and str(src) in err))
    assert results == [(rc, 1, True)] * 3, results


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_unreadable_source_is_bad_input_exit_2(as_json: bool, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--against a source whose layer cannot be read (an fp16 scale set to NaN) is bad input naming the source file
    and tensor (2), not a difference in the packed checkpoint (1): the conversion is not what is wrong (issue 30
    item 10)."""
    from w4pack.store.safetensors import SafetensorsFile

    packed, src, st = _packed_and_source_copy(tmp_path)
    with SafetensorsFile(st) as f:
        tname = next(k for k in f.keys() if k.endswith(".scales"))
        assert f.dtype_name(tname) == "float16"
        offset = f.data_start + f.entries[tname][2]
    with open(st, "r+b") as fh:
        fh.seek(offset)
        fh.write(np.array([np.nan], np.float16).tobytes())
    with pytest.raises(BadInputError):
        verify(packed, against=src, threads=1, seed=5)
    capsys.readouterr()
    rc, out, err = run_cli(str(packed), "--against", str(src), "--threads", "1",
                           *(["--json"] if as_json else []), capsys=capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, (rc, out, err)
    assert lines[0].startswith(f"w4pack: error: {st}: tensor {tname}: ") and "NaN" in lines[0], lines[0]


_VERIFY_WHILE_TRUNCATED = r"""
import os, sys
from w4pack.store.checkpoint import Checkpoint
from w4pack.cli import main

real = Checkpoint.packed
def packed(self, name):  # the first layer's shard shrinks as verify reaches it (a copy or download in progress)
    if not getattr(Checkpoint, "_done", False):
        Checkpoint._done = True
        os.truncate(self.path / self.weight_map[self.manifest["layers"][name]["tensors"]["qweight"]], 4096)
    return real(self, name)
Checkpoint.packed = packed
sys.exit(main(["verify", sys.argv[1], "--threads", "1"]))
"""


def test_packed_checkpoint_truncated_during_verify_is_io_not_a_failed_check(good: Path, tmp_path: Path) -> None:
    """A shard that shrinks while verify reads it is exit 4 "changed while being read", not exit 1 (a failed check
    that would blame the conversion), and no SIGBUS."""
    import os
    import subprocess
    import sys

    copy = tmp_path / "ck"
    shutil.copytree(good, copy)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", _VERIFY_WHILE_TRUNCATED, str(copy)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode >= 0, f"verify died by signal {-proc.returncode}"
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 4 and len(lines) == 1 and "changed while being read" in lines[0], proc.stderr
    assert str(copy) in lines[0]


def test_same_weights_in_another_representation_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A symmetric layer stored by the source as integer zero points of 2^(bits-1) (what compressed-tensors' own
    AWQ converter writes) is the same layer: verify --against passes and says the representation differs; a
    real difference in the weights still fails."""
    from w4pack.verify import same_weights

    sym = {"model.layers.0.mlp.up_proj": make_layer(n=64, k=128, bits=4, gs=32, zero_mode="none", seed=7)}
    lay = sym["model.layers.0.mlp.up_proj"]
    as_int = lay.replace(zero_mode="int", zeros=np.full(lay.scales.shape, 8, np.int32))
    assert lay.differences(as_int) and same_weights(lay, as_int)
    a = write(tmp_path / "a", sym)
    b = write(tmp_path / "b", {"model.layers.0.mlp.up_proj": as_int})
    rc, out, _ = run_cli(str(a), "--against", str(b), capsys=capsys)
    assert rc == 0, out
    assert "1/1 bit-identical" in out and "stored differently with the same weights" in out and "zero_mode" in out
    zeros = as_int.zeros.copy()
    zeros[3, 1] = 9  # one group's weights now differ
    c = write(tmp_path / "c", {"model.layers.0.mlp.up_proj": as_int.replace(zeros=zeros)})
    rc, out, _ = run_cli(str(a), "--against", str(c), capsys=capsys)
    assert rc == 1 and "differs from the source" in out


def test_against_catches_a_model_file_edit_even_when_re_signed(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An edit of config.json whose manifest entry is re-signed passes validate's checksums; verify --against still
    sees that the file no longer says what the source's says (found by tools/fuzz.py)."""
    import hashlib

    from w4pack.convert import convert

    src = fixture_dir("awq", "tiny_llama_gemm_g128")
    out = tmp_path / "w4"
    convert(src, out)
    rc, text, _ = run_cli(str(out), "--against", str(src), capsys=capsys)
    assert rc == 0, text
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rms_norm_eps"] = 0.5
    cfg_path.write_text(json.dumps(cfg, indent=2))
    manifest = json.loads((out / "w4pack.json").read_text())
    for entry in manifest["files"]:
        if entry["file"] == "config.json":
            data = cfg_path.read_bytes()
            entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (out / "w4pack.json").write_text(json.dumps(manifest, indent=2))
    assert main(["validate", str(out)]) == 0  # the re-signed manifest is self-consistent
    capsys.readouterr()
    rc, text, _ = run_cli(str(out), "--against", str(src), capsys=capsys)
    assert rc == 1 and "rms_norm_eps" in text, text


def test_against_a_source_with_a_side_file_convert_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The source's generation_config.json turned into a JSON list: convert refuses it (2), and verify --against
    refuses it too, naming the file, instead of reporting the packed copy as differing (1) (found by
    tools/fuzz.py)."""
    import shutil

    from w4pack.convert import convert

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("awq", "tiny_llama_gemm_g128"), src)
    out = tmp_path / "w4"
    convert(src, out)
    gen = src / "generation_config.json"
    assert gen.is_file()
    gen.write_text("[1, 2]")
    results = []
    for argv in (["convert", str(src), str(tmp_path / "again")], ["verify", str(out), "--against", str(src)]):
        capsys.readouterr()
        code = main(argv)
        err = capsys.readouterr().err
        results.append((code, err.count("\n"), f"{gen}: not a JSON object (a list)" in err))
    assert results == [(2, 1, True)] * 2, results


def test_against_a_source_whose_head_contradicts_its_config(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """config.json's vocab_size no longer matches the AWQ source's float embedding and head: convert refuses the source (2),
    and verify --against must too, rather than report the packed checkpoint different (1). The shape comes from
    the file's header, not its data (found by the fuzzer's 30-minute run)."""
    import json
    import shutil

    from conftest import fixtures_root

    if fixtures_root() is None:
        pytest.skip("peer fixtures not found (set W4PACK_FIXTURES or place shared/fixtures beside the checkout)")
    src = tmp_path / "src"
    shutil.copytree(fixtures_root() / "awq" / "tiny_llama_gemm_g128", src)
    packed = tmp_path / "packed"
    assert main(["convert", str(src), str(packed)]) == 0
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] *= 2
    (src / "config.json").write_text(json.dumps(cfg))
    results = []
    for argv in (["convert", str(src), str(tmp_path / "out")],
                 ["verify", str(packed), "--against", str(src), "--threads", "1"]):
        capsys.readouterr()
        code = main(argv)
        err = capsys.readouterr().err
        results.append((code, err.count("\n"), "the llama model of config.json needs [2000, 256]" in err))
    assert results == [(2, 1, True), (2, 1, True)], results


def test_a_negative_seed_is_a_usage_error(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was numpy's ValueError at the first layer, printed as "unexpected ValueError ... this is a bug"."""
    for bad in (-1, 1.5, True):
        with pytest.raises(BadInputError, match="seed must be a whole number >= 0"):
            verify(good, seed=bad, threads=1)  # type: ignore[arg-type]
    rc, out, err = run_cli(str(good), "--seed", "-1", capsys=capsys)
    assert rc == 2 and out == "" and "unexpected" not in err and "--seed" in err
    assert verify(good, seed=0, threads=1).ok


def test_a_base_without_any_layer_weight_is_bad_input(tmp_path: Path, good: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """--base given a quantized checkpoint (or another model) was "FAILED: every layer failed" (exit 1), each line
    "no weight for this layer in the base model": the wrong --base, reported as a failed verification."""
    other = tmp_path / "other"
    other.mkdir()
    write_safetensors(other / "model.safetensors", [("model.layers.0.mlp.down_proj.qweight",
                                                     np.zeros((8, 8), np.int32), None)], metadata={"format": "pt"})
    with pytest.raises(BadInputError, match="base model holds no float weight of the checkpoint's quantized layers"):
        verify(good, base=other, threads=1, seed=1)
    rc, out, err = run_cli(str(good), "--base", str(other), "--threads", "1", capsys=capsys)
    assert rc == 2 and out == "" and f"{other}: base model holds no float weight" in err
    assert "--base takes the original unquantized model" in err
    # a base holding some of the layers is still a verification: the missing ones fail, exit 1
    some = tmp_path / "some"
    some.mkdir()
    name = next(iter(LAYERS))
    w = layers()[name].dequantize(np.float64).astype(np.float16)
    write_safetensors(some / "model.safetensors", [(f"{name}.weight", w, None)], metadata={"format": "pt"})
    rep = verify(good, base=some, threads=1, seed=1)
    assert not rep.ok and [c.name for c in rep.failed_layers] == sorted(set(LAYERS) - {name})


def test_a_base_of_another_model_is_bad_input(tmp_path: Path, good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A base with every layer's name but none of their shapes is another model (a reviewer's run: exit 1, every
    line "base weight has shape ..."): the wrong --base, exit 2."""
    other = tmp_path / "other"
    other.mkdir()
    items = [(f"{name}.weight", np.ones((3, 5), np.float16), None) for name in LAYERS]
    write_safetensors(other / "model.safetensors", items, metadata={"format": "pt"})
    with pytest.raises(BadInputError, match="base model's weights are not this model's: no layer's has its shape"):
        verify(good, base=other, threads=1, seed=1)
    rc, out, err = run_cli(str(good), "--base", str(other), "--threads", "1", capsys=capsys)
    assert rc == 2 and out == "" and "[3, 5]" in err and "--base takes the original" in err


@pytest.mark.parametrize("kw, says", [
    ({"threads": 0}, "threads must be a whole number >= 1"),
    ({"threads": -1}, "threads must be a whole number >= 1"),
    ({"threads": 3.5}, "threads must be a whole number >= 1"),
    ({"src_format": "gptq"}, "src_format names the format of against="),
])
def test_api_arguments_refused_at_the_call(good: Path, kw: dict, says: str) -> None:
    """threads=0 came back as every layer failing ("GEMM failed: threads must be >= 1"), 3.5 passed, and a
    src_format without against= was dropped: usage errors, refused before any check runs."""
    with pytest.raises(BadInputError, match=says):
        verify(good, seed=1, **kw)


def test_cli_from_without_against_is_a_usage_error(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(str(good), "--from", "gptq", capsys=capsys)
    assert rc == 2 and out == "" and "--from names the format of --against" in err


def test_a_pass_through_tensor_says_how_it_differs() -> None:
    """A round trip through GGUF widens bf16 norms to float32 with the same values; verify said only "differs from
    the source", as for changed values."""
    from w4pack.verify import _how_it_differs

    bf16 = np.array([0x3F80, 0x4000, 0xBF00], np.uint16)  # 1.0, 2.0, -0.5
    same = np.array([1.0, 2.0, -0.5], np.float32)
    assert _how_it_differs(same, "float32", bf16, "bfloat16") == \
        "stored as float32, the source's as bfloat16: the same values in another dtype"
    assert _how_it_differs(same + 1, "float32", bf16, "bfloat16") == \
        "stored as float32, the source's as bfloat16, and the values differ"
    assert _how_it_differs(same[:2], "float32", bf16, "bfloat16") == "shape [2], the source's [3]"
    assert _how_it_differs(same, "float32", same * 2, "float32") == "different values"
    assert _how_it_differs(np.array([1, 2, 3], np.int64), "int64", np.array([1, 2, 3], np.int32), "int32") == \
        "stored as int64, the source's as int32"
