"""GGUF K-quant / 5-bit / IQ4 blocks → canonical layers, checked against gguf-py's own dequantizer on every type.

gguf-py computes ``(d·sc)·q − dmin·m`` (and Q5_1's ``d·q + m``) in float32, rounding once; the canonical float64
dequantization is the exact value, so it must round to gguf-py's float32 result bit for bit (types without a
float minimum are exact in float32 and must equal it outright).
"""
from __future__ import annotations

import numpy as np
import pytest

from w4pack.core.layout import pack, unpack
from w4pack.errors import BadInputError
from w4pack.formats import gguf_quants as gq

gguf = pytest.importorskip("gguf", reason="pip install gguf (the [gguf] extra) to check against gguf-py")

#: byte offsets of the fp16 super-block scale(s) of each type
_HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,),
           "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """Random bytes with finite fp16 d/dmin over many decades (subnormals, negatives, a few zeros)."""
    bt = gq.TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // bt.block, bt.nbytes), dtype=np.uint8)
    for off in _HALVES[qtype]:
        mag = 10.0 ** rng.uniform(-7, 4, raw.shape[:2])
        h = (rng.choice([-1.0, 1.0], raw.shape[:2]) * mag).astype(np.float16)
        h[rng.random(raw.shape[:2]) < 0.02] = 0
        raw[..., off:off + 2] = h.astype("<f2")[..., None].view(np.uint8)
    assert raw.any()
    return raw.reshape(n, -1)


def assert_matches_gguf(qtype: str, raw: np.ndarray, n: int, k: int) -> None:
    layer = gq.decode(qtype, raw, n, k).validate()
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k)
    ours = layer.dequantize(np.float64)
    assert np.array_equal(ours.astype(np.float32).view(np.uint32), ref.view(np.uint32)), qtype
    if layer.zero_mode != "float":  # no rounding at all on either side
        assert np.array_equal(ours, ref.astype(np.float64)), qtype
    # the stored parameters are the exact products d·sc (no rounding into float32)
    assert layer.scale_dtype == gq.TYPES[qtype].scale_dtype


@pytest.mark.parametrize("qtype", sorted(gq.TYPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_blocks_match_gguf_dequantize(qtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed * 101 + len(qtype))
    bt = gq.TYPES[qtype]
    n, k = 7, bt.block * 3 if bt.block == gq.QK_K else 512
    assert_matches_gguf(qtype, random_blocks(rng, qtype, n, k), n, k)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_blocks_from_ggufs_quantizer(qtype: str) -> None:
    """Realistic blocks: gguf-py's own quantizer on weight-like floats."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((32, 512)) * 0.02).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    assert_matches_gguf(qtype, raw, 32, 512)


@pytest.mark.parametrize("qtype", sorted(gq.TYPES))
def test_every_code_value_and_layout_round_trip(qtype: str) -> None:
    """Each canonical code width is used in full, and the decoded layer packs and unpacks unchanged."""
    rng = np.random.default_rng(11)
    bt = gq.TYPES[qtype]
    n, k = 33, bt.block * (2 if bt.block == gq.QK_K else 16)
    layer = gq.decode(qtype, random_blocks(rng, qtype, n, k), n, k).validate()
    assert layer.bits == bt.bits and layer.group_size == bt.group and layer.zero_mode == bt.zero_mode
    if bt.bits < 8:
        assert set(np.unique(layer.codes)) == set(range(1 << bt.bits))
    else:  # IQ4: the 16 codebook values + 128
        assert set(np.unique(layer.codes)) == set((gq.IQ4_NL_VALUES + 128).tolist())
    back = unpack(pack(layer))
    assert back.equals(layer), back.differences(layer)


def test_expected_parameters_of_one_q4_k_block() -> None:
    """One hand-built Q4_K block: d=0.5, dmin=0.25, sub-block j has sc = j + 1 and m = 2j (j >= 4 uses the
    split high bits), codes = element index mod 16."""
    sc, mn = np.arange(1, 9), np.arange(0, 16, 2)
    sc[5], mn[6] = 63, 50  # values with the top two bits set
    b = np.zeros(144, np.uint8)
    b[0:2] = np.array([0.5], "<f2").view(np.uint8)
    b[2:4] = np.array([0.25], "<f2").view(np.uint8)
    for j in range(4):
        b[4 + j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        b[8 + j] = mn[j] | ((mn[j + 4] >> 4) << 6)
        b[12 + j] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    e = np.arange(256) % 16
    for c in range(4):
        b[16 + 32 * c:48 + 32 * c] = e[64 * c:64 * c + 32] | (e[64 * c + 32:64 * c + 64] << 4)
    layer = gq.decode("Q4_K", b[None], 1, 256).validate()
    assert np.array_equal(layer.codes[0], e)
    assert np.array_equal(layer.scales[0], 0.5 * sc.astype(np.float32))
    assert np.array_equal(layer.zeros[0], -0.25 * mn.astype(np.float32))
    assert_matches_gguf("Q4_K", b[None], 1, 256)


def test_non_finite_super_scale_is_refused() -> None:
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, "Q6_K", 2, 256)
    raw[1, 208:210] = np.array([np.inf], "<f2").view(np.uint8)
    with pytest.raises(BadInputError, match="NaN or infinity"):
        gq.decode("Q6_K", raw, 2, 256).validate()


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(BadInputError, match="in_features % 256"):
        gq.decode("Q4_K", np.zeros((2, 144), np.uint8), 2, 128)
    with pytest.raises(BadInputError, match="data shape"):
        gq.decode("Q4_K", np.zeros((2, 140), np.uint8), 2, 256)


def test_codebook_types_have_a_reason() -> None:
    assert not gq.is_packable("IQ2_XS") and "codebook" in gq.why_not_packable("IQ2_XS")
    assert gq.is_packable("IQ4_NL")


@pytest.mark.parametrize("qtype", sorted(gq.TYPES))
def test_encode_gives_back_the_same_values(qtype: str) -> None:
    """Any block decodes and re-encodes to blocks of the same canonical values (random super-block scales
    need not be in llama.cpp's form, so the bytes may differ where several d·sc give the same products)."""
    rng = np.random.default_rng(21)
    bt = gq.TYPES[qtype]
    n, k = 9, 512
    raw = random_blocks(rng, qtype, n, k)
    layer = gq.decode(qtype, raw, n, k)
    back = gq.encode(qtype, layer)
    assert back.shape == raw.shape
    assert gq.decode(qtype, back, n, k).equals(layer)
    if bt.block == 32:  # the fp16 scale is stored as it is: byte for byte
        assert np.array_equal(back, raw)


@pytest.mark.parametrize("qtype,lo,hi", [("Q4_K", 0, 63), ("Q6_K", -128, 127), ("Q3_K", -32, 31), ("Q2_K", 0, 15)])
def test_super_scales_recover_the_reference_quantizers_d(qtype: str, lo: int, hi: int) -> None:
    """llama.cpp's reference quantizers put the largest sub-scale at the end of its range (63, -128, -32, 15):
    the derivation then finds exactly that d and those integers."""
    rng = np.random.default_rng(8)
    d = (rng.uniform(0.5, 2, (40,)) * 1e-3).astype(np.float16)
    L = rng.integers(max(lo, -hi), hi + 1, (40, 8))
    L[:, 2] = lo if lo < 0 else hi
    vals = d.astype(np.float64)[:, None] * L
    got = gq.super_scales(vals, lo, hi)
    assert got is not None
    assert np.array_equal(got[0], d) and np.array_equal(got[1], L)


def test_encode_refuses_values_that_are_not_blocks() -> None:
    from w4pack.errors import UnsupportedError

    rng = np.random.default_rng(2)
    layer = gq.decode("Q4_K", random_blocks(rng, "Q4_K", 2, 256), 2, 256)
    layer.scales[0, 3] = np.float32(np.pi)  # not an fp16 times an integer in 0..63 together with the others
    with pytest.raises(UnsupportedError, match="not expressible as GGUF Q4_K: scales"):
        gq.encode("Q4_K", layer)
    with pytest.raises(UnsupportedError, match="needs 6-bit"):
        gq.encode("Q6_K", layer)
