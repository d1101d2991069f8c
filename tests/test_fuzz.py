"""A short, fixed run of tools/fuzz.py: hostile inputs of every reader must give one line and exit 2 (or 3), never a
crash, hang, traceback, wrong exit code, disagreeing commands or an accepted corruption.

Each case is one explicit mutation (the spec format tools/fuzz.py records for its reproducers) and the commands it
concerns. Cases that today's main still gets wrong are strict xfails naming the issue 30 item: when the fix lands
the xfail fails, and the mark is removed.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import fixtures_root

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import fuzz  # noqa: E402

sys.path.pop(0)

SRC = ("inspect", "convert", "verify --against", "validate --deep", "verify", "load")
PACKED = ("inspect", "validate --deep", "verify", "verify --against", "load")
TINY_AWQ = "w4pack/awq/tiny_llama_gemm_g128"
NPY = "quant_dir/model.layers.0.mlp.down_proj.scale.npy"
QTOML = "toml/quant_toml_asym_actorder_observer"


def xf(item: str) -> Any:
    return pytest.mark.xfail(strict=True, reason=f"issue 30 {item} (being fixed; remove this mark when it lands)")


# (id, reader, target, spec, commands, per-command timeout or None, mark or None)
CASES: list[tuple[str, str, str, dict[str, Any], tuple[str, ...], float | None, Any]] = [
    # GPTQ
    ("gptq-header-length-huge", "gptq", "gptq/ag_b4_asym_g64",
     {"mutator": "st_header_len", "scope": "file", "file": "gptq_model-4bit-64g.safetensors", "value": 2**64 - 1},
     ("inspect", "convert", "verify --against"), None, None),
    ("gptq-qweight-dtype", "gptq", "gptq/ag_b4_sym_g128",
     {"mutator": "st_field", "scope": "file", "file": "gptq_model-4bit-128g.safetensors",
      "tensor": "model.layers.0.mlp.down_proj.qweight", "field": "dtype", "value": "F16"}, ("convert",), None, None),
    ("gptq-bits-5", "gptq", "gptq/ag_b4_sym_g128",
     {"mutator": "json_field", "scope": "file", "file": "quantize_config.json", "hot": True, "path": ["bits"],
      "op": "value", "value": 5}, ("inspect", "convert"), None, None),
    ("gptq-truncated", "gptq", "gptq/gm_b3_asym_g64_v1",
     {"mutator": "truncate", "scope": "file", "file": "model.safetensors", "mode": "random", "length": 1000},
     ("inspect", "convert", "verify --against"), None, None),
    ("gptq-g_idx-out-of-range-inspect", "gptq", "gptq/ag_b4_asym_g32_descact",
     {"mutator": "st_data", "scope": "file", "file": "gptq_model-4bit-32g.safetensors",
      "tensor": "model.layers.0.mlp.down_proj.g_idx", "how": "flip", "offset": 1401, "bit": 7}, ("inspect", "convert"), None,
     None),
    ("gptq-config-garbage", "gptq", "gptq/ag_b4_asym_g64",
     {"mutator": "json_text", "scope": "file", "file": "quantize_config.json", "how": "garbage"},
     ("inspect", "convert"), None, None),
    ("gptq-nan-scale-inspect", "gptq", "gptq/ag_b4_asym_g64",
     {"mutator": "st_data", "scope": "file", "file": "gptq_model-4bit-64g.safetensors",
      "tensor": "model.layers.0.mlp.down_proj.scales", "how": "special", "element": 0, "value": "nan"},
     ("inspect", "convert"), None, None),
    ("gptq-nan-scale-verify-against", "gptq", "gptq/ag_b4_asym_g64",
     {"mutator": "st_data", "scope": "file", "file": "gptq_model-4bit-64g.safetensors",
      "tensor": "model.layers.0.mlp.down_proj.scales", "how": "special", "element": 0, "value": "nan"},
     ("convert", "verify --against"), None, None),
    ("gptq-tensor-in-two-shards", "gptq", "gptq/gm_tiny_llama_b4_g64_descact_sym_v1_sharded",
     {"mutator": "st_duplicate", "scope": "folder", "from_shard": "model-00001-of-00005.safetensors",
      "to_shard": "model-00002-of-00005.safetensors", "tensor": "model.embed_tokens.weight"},
     ("convert", "load"), None, None),
    # AWQ
    ("awq-pt-pickle-flip", "awq", "awq/llm_awq_v1_2023_tiny_llama_g128_pt",
     {"mutator": "pt_member", "scope": "file", "file": "llama-tiny-w4-g128-awq.pt", "member": "pickle", "index": 0}, ("inspect", "convert"), None, None),
    ("awq-pt-truncated", "awq", "awq/llm_awq_v1_2023_tiny_llama_g128_pt",
     {"mutator": "truncate", "scope": "file", "file": "llama-tiny-w4-g128-awq.pt", "mode": "half"},
     ("inspect", "convert"), None, None),
    ("awq-qweight-shape", "awq", "awq/tiny_llama_gemm_g128",
     {"mutator": "st_field", "scope": "file", "file": "model.safetensors", "tensor": "model.layers.0.mlp.up_proj.qweight",
      "field": "shape", "op": "+1", "dim": 1}, ("inspect", "convert", "verify --against"), None, None),
    ("awq-truncated-no-config", "awq", "awq/gemm_g64_in576_out128",
     {"mutator": "truncate", "scope": "file", "file": "model.safetensors", "mode": "random", "length": 5000},
     ("convert",), None, None),
    ("awq-scales-renamed-no-config", "awq", "awq/gemm_g64_in576_out128",
     {"mutator": "st_field", "scope": "file", "file": "model.safetensors", "tensor": "model.layers.0.mlp.down_proj.scales",
      "field": "name", "value": "model.layers.0.mlp.down_proj.scalez"}, ("inspect", "convert", "verify --against"), None,
     None),
    # seed 111206, awq #16: the symmetric Marlin layer keeps only scales beside its renamed qweight
    ("awq-marlin-qweight-renamed", "awq", "awq/marlin_g128_in512_out256",
     {"mutator": "st_field", "scope": "file", "file": "model.safetensors", "tensor": "model.layers.0.mlp.down_proj.qweight",
      "field": "name", "value": "model.layers.0.mlp.down_proj.qw"}, ("inspect", "convert", "verify --against"), None,
     None),
    ("gptq-bytes-after-last-tensor", "gptq", "gptq/ag_b4_sym_g128",
     {"mutator": "append", "scope": "file", "file": "gptq_model-4bit-128g.safetensors", "blob": "zeros"},
     ("inspect", "convert", "verify --against"), None, None),
    # compressed-tensors
    ("ct-generation-config-not-utf8", "ct", "compressed-tensors/tiny_llama_w4a16_sym_g128",
     {"mutator": "byte_flip", "scope": "file", "file": "generation_config.json", "nflips": 3, "region": "head",
      "f0_offset": 166, "f0_bit": 6, "f1_offset": 71, "f1_bit": 6, "f2_offset": 149, "f2_bit": 7}, ("inspect", "convert"),
     None, None),
    ("ct-intermediate-size-3", "ct", "compressed-tensors/tiny_llama_w4a16_sym_g128",
     {"mutator": "json_field", "scope": "file", "file": "config.json", "hot": True, "path": ["intermediate_size"],
      "op": "value", "value": 3}, ("inspect", "convert", "verify --against", "validate --deep"), None, None),
    ("ct-num-bits-5", "ct", "compressed-tensors/tiny_llama_w4a16_sym_g128",
     {"mutator": "json_field", "scope": "file", "file": "config.json", "hot": True,
      "path": ["quantization_config", "config_groups", "group_0", "weights", "num_bits"], "op": "value", "value": 5},
     ("inspect", "convert"), None, None),
    ("ct-offsets-past-end", "ct", "compressed-tensors/tiny_llama_w4a16_sym_g128",
     {"mutator": "st_field", "scope": "file", "file": "model.safetensors", "field": "data_offsets", "op": "past-end"},
     ("inspect", "convert", "verify --against"), None, None),
    # TOML quant tables
    ("toml-npy-huge-shape", "toml", QTOML,
     {"mutator": "npy_header", "scope": "file", "file": NPY, "how": "shape", "value": "(2**40,)"},
     ("convert", "verify --against"), None, None),
    ("toml-wbits-16", "toml", QTOML,
     {"mutator": "toml", "scope": "file", "file": "quant_dir/quant.toml", "how": "value", "line": 3, "value": "16"},
     ("inspect", "convert"), None, None),
    ("toml-group-id-out-of-range", "toml", QTOML,
     {"mutator": "npy_data", "scope": "file", "file": "quant_dir/model.layers.0.mlp.down_proj.group_ids.npy",
      "element": 7, "value": "100000"}, ("convert",), None, None),
    ("toml-npy-header-stray-quote", "toml", QTOML,
     {"mutator": "npy_header", "scope": "file", "file": NPY, "how": "stray-byte", "position": 50, "char": '"'},
     ("convert",), None, None),
    ("toml-file-name-too-long", "toml", QTOML,
     {"mutator": "toml", "scope": "file", "file": "quant_dir/quant.toml", "how": "value", "line": 1,
      "value": '"' + "a" * 300 + '.npy"'}, ("convert",), None, None),
    ("toml-scale-negative", "toml", QTOML,
     {"mutator": "npy_data", "scope": "file", "file": NPY, "element": 3, "value": "-1"}, ("convert", "verify --against"),
     None, None),
    # found by the 30-minute-per-reader run: every command exits as convert does
    ("toml-group-ids-contradict", "toml", QTOML,
     {"mutator": "npy_data", "scope": "file", "file": "quant_dir/model.layers.1.self_attn.q_proj.group_ids.npy",
      "element": 1, "value": "0"}, ("inspect", "convert", "verify --against"), None, None),
    ("awq-quant-method-not-a-name", "awq", "awq/llm_awq_v1_2023_tiny_llama_g128_pt",
     {"mutator": "json_field", "scope": "file", "file": "config.json", "hot": True,
      "path": ["quantization_config", "quant_method"], "op": "value", "value": 0},
     ("inspect", "convert", "verify --against"), None, None),
    ("ct-blank-tensor-name", "ct", "compressed-tensors/asym_channel_in256_out200",
     {"mutator": "st_field", "scope": "file", "file": "model.safetensors",
      "tensor": "model.layers.0.mlp.down_proj.weight_zero_point", "field": "name", "value": ""},
     ("inspect", "convert", "verify --against"), None, None),
    # GGUF
    ("gguf-tensor-count-huge", "gguf", "gguf/q4_0_random_in256_out128",
     {"mutator": "gguf_field", "scope": "file", "file": "tensors.gguf", "kind": "count", "field": "tensor_count",
      "value": 2**63}, ("inspect", "convert"), None, None),
    ("gguf-ne0-not-whole-blocks", "gguf", "gguf/q4_0_exact_in512_out256",
     {"mutator": "gguf_field", "scope": "file", "file": "tensors.gguf", "kind": "dim",
      "field": "tensor[0](blk.0.ffn_down.weight).ne[0]", "value": 513}, ("inspect", "convert"), None, None),
    ("gguf-truncated-data", "gguf", "gguf/q8_0_exact_in576_out128",
     {"mutator": "gguf_truncate", "scope": "file", "file": "tensors.gguf", "where": "data", "length": 4096},
     ("inspect", "convert"), None, None),
    ("gguf-unknown-type", "gguf", "gguf/q4_1_exact_in512_out256",
     {"mutator": "gguf_field", "scope": "file", "file": "tensors.gguf", "kind": "ttype",
      "field": "tensor[0](blk.0.ffn_down.weight).type", "value": 100}, ("inspect", "convert"), None, None),
    ("gguf-kv-type-array", "gguf", "gguf/q4_0_random_in256_out128",
     {"mutator": "gguf_field", "scope": "file", "file": "tensors.gguf", "kind": "vtype",
      "field": "kv[0](general.architecture).type", "value": 9}, ("inspect",), 6.0,
     None),
    ("gguf-offset-wraps", "gguf", "gguf/q4_0_random_in256_out128",
     {"mutator": "gguf_field", "scope": "file", "file": "tensors.gguf", "kind": "offset",
      "field": "tensor[0](blk.0.ffn_down.weight).offset", "value": 2**64 - 18}, ("convert", "validate --deep", "load"),
     None, None),
    # llama.cpp's Mixtral (tests/data/llama_quantize): found by the 12-minute run on it
    ("gguf-router-type-leaves-a-gap", "gguf", "gguf/llama-moe-Q4_K_M",
     {"mutator": "gguf_field", "scope": "file", "file": "tensors.gguf", "kind": "ttype",
      "field": "tensor[20](blk.1.ffn_gate_inp.weight).type", "value": 2}, ("inspect", "convert"), None, None),
    ("gguf-expert-count-zero", "gguf", "gguf/llama-moe-Q4_K_M",
     {"mutator": "gguf_field", "scope": "file", "file": "tensors.gguf", "kind": "dim",
      "field": "tensor[8](blk.0.ffn_down_exps.weight).ne[2]", "value": 0}, ("inspect", "convert", "verify --against"),
     None, None),
    # packed checkpoints, manifest re-signed so the corruption reaches the deep checks
    ("w4pack-scale-flip-resigned", "w4pack", TINY_AWQ,
     {"mutator": "packed_layer_data", "scope": "folder", "layer": "model.layers.0.mlp.down_proj", "part": "scales",
      "sub_how": "flip", "sub_offset": 82501, "sub_bit": 4, "resign": True}, PACKED, None, None),
    ("w4pack-qweight-flip-unsigned", "w4pack", TINY_AWQ,
     {"mutator": "packed_layer_data", "scope": "folder", "layer": "model.layers.1.self_attn.q_proj",
      "part": "qweight", "sub_how": "flip", "resign": False},
     ("validate --deep", "verify"), None, None),
    ("w4pack-manifest-bits", "w4pack", TINY_AWQ,
     {"mutator": "json_field", "scope": "file", "file": "w4pack.json", "hot": True,
      "path": ["layers", "model.layers.0.mlp.up_proj", "bits"], "op": "value", "value": 3, "resign": True},
     PACKED, None, None),
    ("w4pack-shard-truncated-resigned", "w4pack", "w4pack/gptq/gm_tiny_llama_b4_g64_descact_sym_v1_sharded+m",
     {"mutator": "truncate", "scope": "file", "file": "model-00001-of-00005.safetensors", "mode": "half",
      "resign": True}, PACKED, None, None),
    ("w4pack-config-rms-norm-eps", "w4pack", TINY_AWQ,
     {"mutator": "json_field", "scope": "file", "file": "config.json", "hot": True, "path": ["rms_norm_eps"],
      "op": "value", "value": 0.5, "resign": False}, ("validate --deep", "verify", "verify --against"), None, None),
    ("w4pack-generation-config-truncated-resigned", "w4pack", TINY_AWQ,
     {"mutator": "truncate", "scope": "file", "file": "generation_config.json", "mode": "half", "resign": True},
     PACKED, None, None),
    ("w4pack-stray-shard", "w4pack", TINY_AWQ,
     {"mutator": "stray", "scope": "folder", "what": "copy-shard", "shard": "model-00001-of-00001.safetensors",
      "resign": True}, ("validate --deep",), None, None),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case, run once on two workers (each command is a limited child process)."""
    if fixtures_root() is None:
        pytest.skip("peer fixtures not found (set W4PACK_FIXTURES or place shared/fixtures beside the checkout)")
    fz = fuzz.Fuzz(tmp_path_factory.mktemp("fuzz"), 0, list(fuzz.READERS), timeout=60.0, mem_mb=3072)

    def one(i: int) -> tuple[str, Any]:
        cid, reader, target, spec, only, timeout, _ = CASES[i]
        return cid, fuzz.fuzz_one(fz, reader, i, spec=dict(spec), target=target, only=only, timeout=timeout)

    with ThreadPoolExecutor(max_workers=2) as ex:
        return dict(ex.map(one, range(len(CASES))))


@pytest.mark.parametrize("cid", [pytest.param(c[0], marks=c[6]) if c[6] else c[0] for c in CASES])
def test_hostile_input_is_one_line_and_exit_2(outcomes: dict[str, Any], cid: str) -> None:
    o = outcomes[cid]
    assert o is not None, f"{cid}: the mutation did not apply (fixture changed?)"
    assert not o.findings, (f"{cid} ({o.desc}): " + "; ".join(f"{f.cls} in {f.command}: {f.detail}" for f in o.findings)
                            + f" (reproducer: {o.repro})")


def test_cases_cover_every_reader() -> None:
    assert {c[1] for c in CASES} == set(fuzz.READERS)


def test_a_corruption_that_changes_meaning_is_caught() -> None:
    # the oracle itself: two digests that differ in one layer are reported, identical ones are not
    a = {"layers": {"x": "1", "y": "2"}, "tensors": {"t": "3"}, "config": "c", "generation": None, "fused": "f"}
    b = json.loads(json.dumps(a))
    assert fuzz.digest_diff(a, b) == []
    b["layers"]["y"] = "9"
    b["config"] = "d"
    assert fuzz.digest_diff(a, b) == ["layers changed: y", "config changed"]


def test_judge_flags_each_class() -> None:
    def r(rc: Any, err: str, timed_out: bool = False) -> fuzz.RunResult:
        return fuzz.RunResult([], rc, timed_out, 0.1, "", err)

    assert fuzz.judge_run("convert", r(2, "w4pack: error: x: truncated\n")) == []
    kinds = {
        "crash": r(-7, ""), "hang": r(None, "", timed_out=True),
        "traceback": r(2, "Traceback (most recent call last):\n  ...\nValueError: x\n"),
        "multi-line": r(2, "w4pack: error: a\nmore\n"),
        "unexpected": r(2, "w4pack: error: unexpected KeyError: 'x' (this is a bug or an input ...)\n"),
        "wrong-exit": r(4, "w4pack: error: x.npy: File name too long\n"),
    }
    for cls, res in kinds.items():
        assert cls in {f.cls for f in fuzz.judge_run("convert", res)}, cls


def test_resign_recomputes_what_the_manifest_signs(tmp_path: Path) -> None:
    (tmp_path / "a.safetensors").write_bytes(b"new bytes")
    (tmp_path / "w4pack.json").write_text(json.dumps({"shards": [{"file": "a.safetensors", "sha256": "0", "size": 1}],
                                                      "other": {"file": "gone.json", "sha256": "0"}}))
    assert fuzz.resign(tmp_path) == ["a.safetensors"]
    shard = json.loads((tmp_path / "w4pack.json").read_text())["shards"][0]
    assert shard["size"] == 9 and shard["sha256"] == __import__("hashlib").sha256(b"new bytes").hexdigest()


@pytest.mark.parametrize("name,invalid", [("README.md", False), ("config.json", True), ("w4pack.json", True)])
def test_a_packed_folder_without_its_model_card_is_still_valid(tmp_path: Path, name: str, invalid: bool) -> None:
    """Seed 20261205, w4pack #58: deleting README.md was judged "provably invalid", so validate accepting the folder
    was reported as inconsistent. The manifest lists every file but the model card (docs/FORMAT.md §5), which
    defines nothing: only deleting a listed file is a corruption to refuse."""
    for f in ("README.md", "config.json", "w4pack.json"):
        (tmp_path / f).write_text("{}")
    t = fuzz.Target(reader="w4pack", name="w4pack/x", fixture=tmp_path, entry=".")
    spec = {"scope": "folder", "mutator": "delete", "file": name, "resign": True}
    m, _full = fuzz.apply_mutation(t, tmp_path, fuzz.random.Random(0), spec)
    assert m.desc.startswith(f"delete {name}") and not (tmp_path / name).exists()
    assert m.must_reject is invalid


def test_plan_is_deterministic_and_replayable(tmp_path: Path) -> None:
    # the same seed gives the same mutations; a recorded spec replays the same mutation
    if fixtures_root() is None:
        pytest.skip("peer fixtures not found (set W4PACK_FIXTURES or place shared/fixtures beside the checkout)")
    t = fuzz.targets_for("gguf", fixtures_root())[0]
    fuzz.copy_source(t, tmp_path / "a")
    fuzz.copy_source(t, tmp_path / "b")
    fuzz.copy_source(t, tmp_path / "c")
    m1, spec = fuzz.apply_mutation(t, tmp_path / "a", fuzz.random.Random("5:gguf:3"), {})
    m2, _ = fuzz.apply_mutation(t, tmp_path / "b", fuzz.random.Random("5:gguf:3"), {})
    m3, _ = fuzz.apply_mutation(t, tmp_path / "c", fuzz.random.Random("other"), json.loads(json.dumps(spec)))
    assert m1.desc == m2.desc == m3.desc
    data = [(tmp_path / d / "tensors.gguf").read_bytes() for d in "abc"]
    assert data[0] == data[1] == data[2] != (t.fixture / "tensors.gguf").read_bytes()


def test_cli_replays_one_mutation_with_a_json_summary(tmp_path: Path) -> None:
    if fixtures_root() is None:
        pytest.skip("peer fixtures not found (set W4PACK_FIXTURES or place shared/fixtures beside the checkout)")
    spec = {"mutator": "gguf_field", "scope": "file", "file": "tensors.gguf", "kind": "ttype",
            "field": "tensor[0](blk.0.ffn_down.weight).type", "value": 100}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--reader", "gguf", "--target",
                        "gguf/q4_1_exact_in512_out256", "--spec", json.dumps(spec), "--out", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=120)
    doc = json.loads(r.stdout)
    assert doc["table"]["gguf"]["mutations"] == 1 and doc["table"]["gguf"]["ok-exit-2"] == 1, r.stdout
    assert r.returncode == 0 and doc["findings"] == []
    assert json.loads((tmp_path / "summary.json").read_text())["table"] == doc["table"]


def test_replay_groups_one_finding_per_class() -> None:
    f = lambda cls, cmd: {"cls": cls, "command": cmd, "detail": ""}  # noqa: E731
    doc = {"findings": [
        {"reader": "gptq", "index": 3, "target": "a", "mutation": "append 97 garbage bytes", "spec": {},
         "findings": [f("inconsistent", "convert")]},
        {"reader": "gptq", "index": 9, "target": "b", "mutation": "append 8 json bytes", "spec": {},
         "findings": [f("inconsistent", "convert"), f("wrong-exit", "inspect")]},
        {"reader": "ct", "index": 4, "target": "c", "mutation": "rename tensor x.weight -> 'y'", "spec": {},
         "findings": [f("inconsistent", "convert")]}]}
    assert fuzz.mutation_kind("append 97 garbage bytes") == "append"
    assert fuzz.mutation_kind("rename tensor x.weight -> 'y'") == "rename tensor"
    per = fuzz.replay_groups(doc, per_class=True)
    assert [(k, r["index"]) for k, r in per] == [(("gptq", "inconsistent", "convert", "append"), 3),
                                                  (("gptq", "wrong-exit", "inspect", "append"), 9),
                                                  (("ct", "inconsistent", "convert", "rename tensor"), 4)]
    assert [r["index"] for _, r in fuzz.replay_groups(doc, per_class=False)] == [3, 9, 4]
    # one mutation with findings in three commands opens three groups, and runs once (it ran three times)
    one = {"findings": [{"reader": "gptq", "index": 6, "target": "a", "mutation": "set quant_method", "spec": {},
                         "findings": [f("wrong-exit", c) for c in ("inspect", "convert", "validate")]}]}
    assert [r["index"] for _, r in fuzz.replay_groups(one, per_class=True)] == [6]


def test_replay_reruns_a_recorded_finding_on_this_tree(tmp_path: Path) -> None:
    # bytes after the last tensor were accepted before the reader required the data section to end at the file end
    if fixtures_root() is None:
        pytest.skip("peer fixtures not found (set W4PACK_FIXTURES or place shared/fixtures beside the checkout)")
    spec = {"mutator": "append", "scope": "file", "file": "model.safetensors", "blob": "garbage"}
    rec = {"reader": "awq", "index": 0, "target": "awq/gemm_g64_in576_out128", "mutation": "append 97 garbage bytes",
           "spec": spec, "findings": [{"cls": "inconsistent", "command": "convert", "detail": "accepted"}]}
    (tmp_path / "summary.json").write_text(json.dumps({"seed": 1, "findings": [rec]}))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--replay", str(tmp_path / "summary.json"),
                        "--out", str(tmp_path / "o"), "--json"], capture_output=True, text=True, timeout=300)
    doc = json.loads(r.stdout)
    assert doc["fixed"] == 1 and doc["replayed"][0]["now"] == [], r.stdout + r.stderr
    assert r.returncode == 0


@pytest.mark.parametrize("summary,says", [
    ({"findings": [{"reader": "bogus", "index": 0, "target": "t", "mutation": "append 1 byte", "spec": {},
                    "findings": [{"cls": "traceback", "command": "inspect"}]}]}, "unknown reader 'bogus'"),
    ([1, 2], "not a fuzz summary"),
    ({"findings": [{"reader": "gptq"}]}, "not a fuzz summary"),
    ({"findings": [{"reader": "gptq", "mutation": "append 8 json bytes",
                    "findings": [{"cls": "inconsistent", "command": "convert"}]}]}, "KeyError 'index'"),
])
def test_replay_refuses_a_file_that_is_not_a_summary(tmp_path: Path, summary: Any, says: str) -> None:
    """--replay of a JSON file that is not fuzz.py's summary: one line naming it, exit 2, no traceback."""
    (tmp_path / "s.json").write_text(json.dumps(summary))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "fuzz.py"), "--replay", str(tmp_path / "s.json"),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr and str(tmp_path / "s.json") in \
        r.stderr, r.stderr
