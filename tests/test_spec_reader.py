"""The normative docs are enough to read a checkpoint: tests/spec_reader.py, written from docs/LAYOUT.md,
docs/FORMAT.md and the schemas alone, reads what w4pack writes bit for bit.

Truth never comes from w4pack's own unpack:

* the peers' fixtures (W4PACK_FIXTURES) carry their ground truth (codes, scales, zeros or minima, g_idx);
* llama.cpp's own GGUFs (tests/data/llama_quantize) are dequantized by gguf-py;
* random layers of every option are their own truth (packed by ``w4pack.layout.pack``, saved by the public
  ``CheckpointWriter``).

w4pack only produces the folders here (``convert``, ``CheckpointWriter``).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import spec_reader as sr
from conftest import fixture_cases, fixture_path

import w4pack
from w4pack.convert import convert
from w4pack.layout import pack

REPO = Path(__file__).resolve().parent.parent
LLAMA_QUANTIZE = REPO / "tests" / "data" / "llama_quantize"
#: a few sources are a little smaller than their packed form (padding, the bf16/fp16 kept); convert says so
quiet_growth = pytest.mark.filterwarnings("ignore:.*larger than those of the source")


def _read_all(folder: Path) -> dict[str, sr.SpecLayer]:
    return {layer.name: layer for layer in sr.read_checkpoint(str(folder))}


def _bf16_to_f64(bits: np.ndarray) -> np.ndarray:
    """Our own widening of bfloat16 bits (independent of the reader's)."""
    return np.frombuffer((bits.astype(np.uint32) << 16).tobytes(), dtype=np.float32).reshape(bits.shape) \
        .astype(np.float64)


# ------------------------------------------------------------------------------------------------------------
# 1. the peers' fixtures, against their truth/

FIXTURE_CASES = [f"{fam}/{case}" for fam in ("gptq", "awq", "compressed-tensors", "gguf", "toml")
                 for case in fixture_cases(fam)]


def _convert_fixture(case_dir: Path, dst: Path, tmp: Path, **source_options: str) -> None:
    """The fixture's source converted by w4pack's public convert (TOML tables take GPTQ's own weights as base,
    so the rebuilt codes are GPTQ's codes, the truth)."""
    family = case_dir.parent.name
    if any(case_dir.glob("*.pt")):
        pytest.importorskip("torch")
    if family == "gguf":
        convert(str(case_dir / "tensors.gguf"), str(dst), show_progress=False)
    elif family == "toml":
        base = tmp / "base"
        base.mkdir()
        os.symlink(case_dir / "gptq_fakequant_weights_fp16.safetensors", base / "model.safetensors")
        convert(str(case_dir / "quant_dir"), str(dst), show_progress=False, base=str(base))
    else:
        convert(str(case_dir), str(dst), show_progress=False, source_options=source_options or None)


def _truth_of(case_dir: Path, layer: str, n_layers: int) -> dict[str, np.ndarray]:
    truth = case_dir / "truth"
    top = {p.stem: np.load(p) for p in truth.glob("*.npy")}
    if (truth / layer).is_dir():
        return {**top, **{p.stem: np.load(p) for p in (truth / layer).glob("*.npy")}}
    assert n_layers == 1, f"no truth/{layer} in a case with {n_layers} layers"
    return top


def _check_against_truth(layer: sr.SpecLayer, t: dict[str, np.ndarray], zeros_key: str) -> None:
    n, k = layer.q.shape
    if "dequant_f32" in t:  # a case that gives no codes: gguf-py's own dequantization of the tensor
        np.testing.assert_array_equal(sr.dequantize(layer).astype(np.float32), t["dequant_f32"])
        return
    codes = t["codes"] if "codes" in t else t["codes_int8"].astype(np.int64) + 128
    np.testing.assert_array_equal(layer.q, codes)
    scales = np.broadcast_to(t["scales"], (n, t["scales"].shape[1]))    # tensor strategy: one scale
    if "g_idx" in t:
        g_truth = t["g_idx"].astype(np.int64)
    elif scales.shape[1] == 1:
        g_truth = np.zeros(k, dtype=np.int64)
    else:
        g_truth = np.arange(k) // int(t["group_size"])
    np.testing.assert_array_equal(layer.g_idx, g_truth)
    np.testing.assert_array_equal(layer.s, scales.astype(np.float64))   # truth scales are exact fp16/bf16 values
    if "mins" in t:
        assert layer.zero_mode == "float"
        np.testing.assert_array_equal(layer.m, t["mins"].astype(np.float64))
        ref = scales[:, g_truth] * codes + t["mins"].astype(np.float64)[:, g_truth]
    else:
        zeros = t.get(zeros_key, t.get("zeros"))
        if zeros is None:   # Q8_0: symmetric around the signed code's 0
            zeros = np.full((n, scales.shape[1]), 128)
        zeros = np.broadcast_to(zeros, scales.shape).astype(np.int64)
        mine = layer.z if layer.zero_mode == "int" else np.full(layer.s.shape, 2 ** (layer.bits - 1))
        assert layer.zero_mode in ("int", "none")
        np.testing.assert_array_equal(mine, zeros)
        ref = scales.astype(np.float64)[:, g_truth] * (codes.astype(np.float64) - zeros[:, g_truth])
    np.testing.assert_array_equal(sr.dequantize(layer), ref)


@quiet_growth
@pytest.mark.parametrize("case", FIXTURE_CASES)
def test_fixture_reads_as_its_truth(case: str, tmp_path: Path) -> None:
    case_dir = fixture_path(*case.split("/"))
    dst = tmp_path / "packed"
    _convert_fixture(case_dir, dst, tmp_path)
    layers = _read_all(dst)
    assert layers
    sub = {p.name for p in (case_dir / "truth").iterdir() if p.is_dir()}
    if sub:
        assert set(layers) == sub
    # w4pack's default decodes GPTQ v1 zero points as the masking readers (AutoGPTQ, vLLM) do
    masked = [p.stem for p in (case_dir / "truth").glob("zeros_as_read_by*v1_readers.npy")]
    for name, layer in layers.items():
        _check_against_truth(layer, _truth_of(case_dir, name, len(layers)), masked[0] if masked else "zeros")


def test_gptq_v1_zero_zero_carried_reads_as_the_real_zeros(tmp_path: Path) -> None:
    """GPTQModel's v1 file with real zero points 0, read with carry (v1_zeros="carry"): the intended zeros."""
    case_dir = fixture_path("gptq", "gm_b4_asym_g64_zero0_v1")
    _convert_fixture(case_dir, tmp_path / "packed", tmp_path, v1_zeros="carry")
    (layer,) = _read_all(tmp_path / "packed").values()
    truth = {p.stem: np.load(p) for p in (case_dir / "truth").glob("*.npy")}
    assert (truth["zeros"] == 0).any() and not np.array_equal(truth["zeros"],
                                                              truth["zeros_as_read_by_masking_v1_readers"])
    _check_against_truth(layer, truth, "zeros")


# ------------------------------------------------------------------------------------------------------------
# 2. llama.cpp's own GGUFs, against gguf-py's dequantization

GGUF_FILES = sorted(p.name for p in LLAMA_QUANTIZE.glob("*.gguf"))
_PROJ = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
_EXPERT = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
#: LAYOUT.md §8, Writers: the compact storage each GGUF type is stored in (codes key, scales, mins)
_STORAGE = {"Q2_K": ("dense_codes", (16, 4, 0), (16, 4, 0)), "Q3_K": ("dense_codes", (16, 6, -32), None),
            "Q4_K": (None, (8, 6, 0), (8, 6, 0)), "Q5_K": ("dense_codes", (8, 6, 0), (8, 6, 0)),
            "Q6_K": ("dense_codes", (16, 8, -128), None), "IQ4_NL": ("codebook", None, None),
            "IQ4_XS": ("codebook", (8, 6, -32), None), "Q4_0": (None, None, None), "Q4_1": (None, None, None),
            "Q8_0": (None, None, None), "Q5_0": ("dense_codes", None, None), "Q5_1": ("dense_codes", None, None)}
#: FORMAT.md §6: the layer each GGUF type becomes (bits, group size, zero mode, scale dtype)
_GGUF_LAYER = {"Q4_0": (4, 32, "none", "float16"), "Q4_1": (4, 32, "float", "float16"),
               "Q8_0": (8, 32, "none", "float16"), "Q5_0": (5, 32, "none", "float16"),
               "Q5_1": (5, 32, "float", "float16"), "Q2_K": (2, 16, "float", "float32"),
               "Q3_K": (3, 16, "none", "float32"),
               "Q4_K": (4, 32, "float", "float32"), "Q5_K": (5, 32, "float", "float32"),
               "Q6_K": (6, 16, "none", "float32"), "IQ4_NL": (8, 32, "none", "float16"),
               "IQ4_XS": (8, 32, "none", "float32")}


def _hf_names(gguf_name: str, n_experts: int) -> list[str]:
    """The module path(s) of a GGUF llama tensor, from llama.cpp's naming (docs/MOE.md for the experts)."""
    if gguf_name == "token_embd.weight":
        return ["model.embed_tokens"]
    if gguf_name == "output.weight":
        return ["lm_head"]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    assert m, gguf_name
    blk, part = m.groups()
    if part in _EXPERT:
        return [f"model.layers.{blk}.block_sparse_moe.experts.{e}.{_EXPERT[part]}" for e in range(n_experts)]
    return [f"model.layers.{blk}.{_PROJ[part]}"]


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert permute (HF rows → GGUF rows interleaved per head)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _small_block_gguf(path: Path) -> None:
    """A llama GGUF whose linear weights are gguf-py's own Q4_0, Q4_1, Q8_0, Q5_0 and Q5_1 quantizations of random
    data (the 32-wide types llama.cpp's K-quant recipes never pick for the tiny model), K = 160 (padded), 3
    query heads and 1 key/value head (rotary rows)."""
    import gguf

    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.attention.head_count", 3)
    w.add_uint32("llama.attention.head_count_kv", 1)
    w.add_uint32("llama.block_count", 1)
    kinds = {"attn_q": ("Q5_0", 96), "attn_k": ("Q5_1", 32), "attn_v": ("Q8_0", 32), "ffn_up": ("Q4_0", 48),
             "ffn_down": ("Q4_1", 80)}
    for part, (qtype, rows) in kinds.items():
        x = rng.normal(0, 0.05, size=(rows, 160)).astype(np.float32)
        qt = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(f"blk.0.{part}.weight", gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@quiet_growth
@pytest.mark.parametrize("file", GGUF_FILES + ["gguf-py small blocks"])
def test_llama_cpp_gguf_dequantizes_as_gguf_py(file: str, tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize as gguf_dequantize

    src = LLAMA_QUANTIZE / file
    if not file.endswith(".gguf"):
        src = tmp_path / "small.gguf"
        _small_block_gguf(src)
    dst = tmp_path / "packed"
    convert(str(src), str(dst), show_progress=False)
    layers = _read_all(dst)
    reader = gguf.GGUFReader(str(src))

    def meta(key: str) -> int:
        return int(reader.fields[key].parts[-1][0])

    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    n_experts = meta("llama.expert_count") if "llama.expert_count" in reader.fields else 0
    seen: set[str] = set()
    storage_seen: set[str] = set()
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype in ("F32", "F16"):
            continue
        ref_all = gguf_dequantize(t.data, t.tensor_type)
        names = _hf_names(t.name, n_experts)
        stacked = ref_all if len(names) > 1 else ref_all[None]
        for name, ref in zip(names, stacked):
            if t.name.split(".")[-2] in ("attn_q", "attn_k"):
                ref = _unpermute_rotary(ref, kv_heads if t.name.split(".")[-2] == "attn_k" else heads)
            layer = layers[name]
            got64 = sr.dequantize(layer)
            got = got64.astype(np.float32)
            assert got.shape == ref.shape, name
            np.testing.assert_array_equal(got, ref, err_msg=f"{file}: {name} ({t.name}, {qtype})")
            assert (layer.bits, layer.group_size, layer.zero_mode, layer.scale_dtype) == _GGUF_LAYER[qtype], name
            codes_key, scales_spec, mins_spec = _STORAGE[qtype]
            st = layer.storage
            assert (codes_key in st) if codes_key else not ({"dense_codes", "codebook"} & set(st)), (name, st)
            for key, spec in (("scales", scales_spec), ("mins", mins_spec)):
                if spec is None:
                    assert key not in st, (name, st)
                else:
                    assert (st[key]["super_groups"], st[key]["bits"], st[key]["offset"]) == spec, (name, st)
            storage_seen.update(st)
            seen.add(name)
    assert seen == set(layers), f"packed layers without a GGUF tensor: {set(layers) - seen}"
    assert storage_seen, "no layer of a llama.cpp file used the compact storage of LAYOUT.md §8"


# ------------------------------------------------------------------------------------------------------------
# 3. random layers of every option, packed by w4pack.layout.pack and saved by CheckpointWriter

_DTYPES = ("float16", "bfloat16", "float32")


def _random_params(rng: np.random.Generator, shape: tuple[int, int], dtype: str,
                   positive: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(stored values as the canonical form holds them, exact float64) of random finite non-zero floats."""
    mag = rng.uniform(0.001, 0.1, size=shape) * (1 if positive else rng.choice([-1.0, 1.0], size=shape))
    if dtype == "float16":
        v = mag.astype(np.float16)
        return v, v.astype(np.float64)
    if dtype == "float32":
        v = mag.astype(np.float32)
        return v, v.astype(np.float64)
    bits = (mag.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)   # truncation: exact bf16 values
    return bits, _bf16_to_f64(bits)


def _random_layer(rng: np.random.Generator, bits: int, zero_mode: str, dtype: str, act_order: bool,
                  group_size: int, n: int, k: int) -> tuple[w4pack.CanonicalLayer, dict[str, np.ndarray]]:
    g = 1 if group_size == -1 else -(-k // group_size)
    codes = rng.integers(0, 2 ** bits, size=(n, k), dtype=np.uint8)
    codes[0, 0], codes[-1, -1] = 2 ** bits - 1, 1      # the range's top, and never all zero
    g_idx = np.zeros(k, dtype=np.int32) if group_size == -1 else (np.arange(k) // group_size).astype(np.int32)
    if act_order and group_size != -1:
        g_idx = rng.permutation(g_idx).astype(np.int32)
    stored_s, s64 = _random_params(rng, (n, g), dtype)
    truth = {"q": codes, "s": s64, "g_idx": g_idx.astype(np.int64)}
    zeros = None
    if zero_mode == "int":
        zeros = rng.integers(0, 2 ** bits + 1, size=(n, g)).astype(np.int32)
        zeros[0, 0] = 2 ** bits                          # legal, readers MUST accept it (LAYOUT.md §1)
        truth["z"] = zeros.astype(np.int64)
    elif zero_mode == "float":
        zeros, truth["m"] = _random_params(rng, (n, g), dtype, positive=False)
    layer = w4pack.CanonicalLayer(codes=codes, scales=stored_s, bits=bits, group_size=group_size,
                                  zero_mode=zero_mode, zeros=zeros, g_idx=g_idx, scale_dtype=dtype)
    return layer, truth


def _check_random(layer: sr.SpecLayer, truth: dict[str, np.ndarray], bits: int, zero_mode: str) -> None:
    assert (layer.bits, layer.zero_mode) == (bits, zero_mode)
    np.testing.assert_array_equal(layer.q, truth["q"])
    np.testing.assert_array_equal(layer.g_idx, truth["g_idx"])
    np.testing.assert_array_equal(layer.s, truth["s"])
    assert np.array_equal(layer.s.view(np.uint64), truth["s"].view(np.uint64))      # signed zeros too
    if zero_mode == "int":
        np.testing.assert_array_equal(layer.z, truth["z"])
        zero = truth["z"][:, truth["g_idx"]]
    elif zero_mode == "float":
        assert np.array_equal(layer.m.view(np.uint64), truth["m"].view(np.uint64))
    else:
        assert layer.z is None and layer.m is None
        zero = 2 ** (bits - 1)
    # LAYOUT.md §1 evaluated here element by element in float64, from the truth
    s = truth["s"][:, truth["g_idx"]]
    q = truth["q"].astype(np.float64)
    want = s * q + truth["m"][:, truth["g_idx"]] if zero_mode == "float" else s * (q - zero)
    np.testing.assert_array_equal(sr.dequantize(layer), want)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_random_layers_of_every_option(bits: int, tmp_path: Path) -> None:
    """Every zero mode × scale dtype × (act-order, grouped, per-channel), N and K not multiples of 16/64, in a
    checkpoint sharded small enough that the layers spread over several shards."""
    rng = np.random.default_rng(1000 + bits)
    truths = {}
    dst = tmp_path / "packed"
    with w4pack.CheckpointWriter(dst, max_shard_size=4096, config={"model_type": "custom"}) as w:
        i = 0
        for zero_mode in ("none", "int", "float"):
            for dtype in _DTYPES:
                for act_order, group_size in ((False, 32), (True, 48), (True, 16), (False, -1)):
                    n, k = int(rng.integers(1, 40)), int(rng.integers(1, 150))
                    layer, truth = _random_layer(rng, bits, zero_mode, dtype, act_order, group_size, n, k)
                    name = f"model.layers.{i}.proj"
                    w.add_layer(name, pack(layer.replace(name=name)))
                    truths[name] = (truth, zero_mode)
                    i += 1
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected a sharded checkpoint"
    layers = _read_all(dst)
    assert set(layers) == set(truths)
    assert any(layer.perm is not None for layer in layers.values())
    for name, (truth, zero_mode) in truths.items():
        _check_random(layers[name], truth, bits, zero_mode)


def _fp16_products(rng: np.random.Generator, n: int, g: int, s: int, b: int, o: int, sign: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """float32 parameters [N, G] that are exactly fp16 d (per S groups) × (u + o), u of b bits; and the
    float64 truth (minima: negated, as GGUF's −dmin·m)."""
    d = rng.uniform(0.001, 0.05, size=(n, g // s)).astype(np.float16)
    u = rng.integers(0, 2 ** b, size=(n, g))
    u[0, 0] = 2 ** b - 1
    vals = np.repeat(d.astype(np.float32), s, axis=1) * (u + o).astype(np.float32) * np.float32(sign)
    return vals.astype(np.float32), vals.astype(np.float64)


#: IQ4's codebook as w4pack writes it (LAYOUT.md §8): kvalues_iq4nl + 128, in index order
_IQ4_CODES = [1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241]

# (bits, zero mode, group size, N, K, storage spec): K-quant-like, dense 2/3/5/6-bit codes, codebooks; shapes
# with row and column padding (N % 16, K % 64 != 0) and, where S allows, padded groups
_COMPACT_CASES = [
    (6, "none", 16, 37, 96, {"dense_codes": True, "scales": {"super_groups": 2, "bits": 8, "offset": -128}}),
    (3, "none", 16, 21, 96, {"dense_codes": True, "scales": {"super_groups": 2, "bits": 6, "offset": -32}}),
    (2, "float", 16, 50, 200, {"dense_codes": True, "scales": {"super_groups": 1, "bits": 4, "offset": 0},
                               "mins": {"super_groups": 1, "bits": 4, "offset": 0}}),
    (4, "float", 32, 19, 192, {"scales": {"super_groups": 3, "bits": 6, "offset": 0},
                               "mins": {"super_groups": 3, "bits": 6, "offset": 0}}),
    (5, "float", 32, 33, 100, {"dense_codes": True, "scales": {"super_groups": 1, "bits": 6, "offset": 0},
                               "mins": {"super_groups": 1, "bits": 6, "offset": 0}}),
    (8, "none", 32, 45, 130, {"codebook": _IQ4_CODES, "scales": {"super_groups": 1, "bits": 6, "offset": -32}}),
    (6, "int", 16, 7, 70, {"codebook": [63, 0, 17, 5, 40], "dense_codes": False}),
    (5, "none", 48, 29, 160, {"codebook": [3, 31, 9]}),
]


@pytest.mark.parametrize("case", range(len(_COMPACT_CASES)))
@pytest.mark.parametrize("act_order", [False, True])
def test_random_compact_layers(case: int, act_order: bool, tmp_path: Path) -> None:
    """LAYOUT.md §8 on random data: dense codes, codebook indices and factorised scales/minima, padded shapes."""
    bits, zero_mode, gs, n, k, spec = _COMPACT_CASES[case]
    rng = np.random.default_rng(case * 2 + act_order)
    spec = {key: v for key, v in spec.items() if v is not False}
    dtype = "float32" if ("scales" in spec or "mins" in spec) else "float16"
    layer, truth = _random_layer(rng, bits, zero_mode, dtype, act_order, gs, n, k)
    g = layer.num_groups
    if "codebook" in spec:
        cb = np.asarray(spec["codebook"])
        codes = cb[rng.integers(0, len(cb), size=(n, k))].astype(np.uint8)
        codes[-1, -1] = cb[-1]
        layer = layer.replace(codes=codes)
        truth["q"] = codes
    if "scales" in spec:
        sp = spec["scales"]
        stored, truth["s"] = _fp16_products(rng, n, g, sp["super_groups"], sp["bits"], sp["offset"], 1.0)
        layer = layer.replace(scales=stored)
    if "mins" in spec:
        sp = spec["mins"]
        stored, truth["m"] = _fp16_products(rng, n, g, sp["super_groups"], sp["bits"], sp["offset"], -1.0)
        layer = layer.replace(zeros=stored)
    dst = tmp_path / "packed"
    with w4pack.CheckpointWriter(dst, config={"model_type": "custom"}) as w:
        w.add_layer("blk.proj", pack(layer.replace(name="blk.proj")), storage=spec)
    (got,) = _read_all(dst).values()
    assert set(got.storage) == set(spec), f"the writer did not store the compact form asked for: {got.storage}"
    assert (got.perm is not None) == (act_order and g > 1)
    _check_random(got, truth, bits, zero_mode)


# ------------------------------------------------------------------------------------------------------------
# 4. the worked example of LAYOUT.md §3.5, and what a reader must refuse

def test_worked_example_decodes() -> None:
    """qweight words of LAYOUT.md §3.5 give the codes the text says, through the reader's own field order."""
    words = np.zeros((1, 128), dtype=np.int32)
    words[0, 0] = np.uint32(0x19910880).view(np.int32)
    words[0, 20] = np.uint32(0x4CC43BB3).view(np.int32)
    fields = sr._fields_of_words(words, 4)
    Q = fields[:, sr._field_index(64, 4)].reshape(16, 64)
    assert [Q[0, 0], Q[0, 1], Q[8, 0], Q[8, 1], Q[0, 8], Q[0, 9], Q[8, 8], Q[8, 9]] == [0, 1, 8, 9, 8, 9, 0, 1]
    assert [Q[1, 2], Q[1, 3], Q[9, 2], Q[9, 3], Q[1, 10], Q[1, 11], Q[9, 10], Q[9, 11]] == \
        [3, 4, 11, 12, 11, 12, 3, 4]


@pytest.fixture()
def small_folder(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    layer, _truth = _random_layer(rng, 4, "int", "float16", False, 32, 20, 70)
    dst = tmp_path / "packed"
    with w4pack.CheckpointWriter(dst, config={"model_type": "custom"}) as w:
        w.add_layer("blk.proj", pack(layer.replace(name="blk.proj")))
    return dst


def test_reader_refuses_a_changed_shard(small_folder: Path) -> None:
    shard = next(small_folder.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(sr.SpecError, match="sha256"):
        _read_all(small_folder)


def test_reader_refuses_an_unknown_layout_version(small_folder: Path) -> None:
    path = small_folder / "w4pack.json"
    man = json.loads(path.read_text())
    man["layout"]["version"] = 2
    path.write_text(json.dumps(man))
    with pytest.raises(sr.SpecError, match="unknown layout"):
        _read_all(small_folder)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_reader_refuses_negative_zero_in_padded_scales(dtype: str, tmp_path: Path) -> None:
    """LAYOUT.md §3.2: padding is +0, every bit; a −0.0 in a padded row is refused."""
    rng = np.random.default_rng(11)
    layer, _truth = _random_layer(rng, 4, "none", dtype, False, -1, 20, 64)
    packed = pack(layer.replace(name="blk.proj"))
    scales = packed.tensors["scales"].copy()
    scales[0, 25] = -0.0                                 # row 25 >= N = 20
    packed.tensors["scales"] = scales
    dst = tmp_path / "packed"
    with w4pack.CheckpointWriter(dst, config={"model_type": "custom"}) as w:
        w.add_layer("blk.proj", packed)
    with pytest.raises(sr.SpecError, match="padding"):
        _read_all(dst)
