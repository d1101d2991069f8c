"""The canonical layer: invariants and the dequantize reference."""
from __future__ import annotations

import numpy as np
import pytest

from w4pack.canonical import CanonicalLayer, default_g_idx
from w4pack.dtypes import from_float32, to_float32
from w4pack.errors import BadInputError


def make(rng, n=8, k=96, bits=4, gs=32, mode="int", sdt="float16"):
    g = 1 if gs == -1 else -(-k // gs)
    s32 = (rng.random((n, g), dtype=np.float32) + 0.5) / 16
    scales = from_float32(s32, sdt)
    zeros = None
    if mode == "int":
        zeros = rng.integers(0, 1 << bits, (n, g)).astype(np.int32)
    elif mode == "float":
        zeros = from_float32(-rng.random((n, g), dtype=np.float32), sdt)
    return CanonicalLayer(codes=rng.integers(0, 1 << bits, (n, k), dtype=np.uint8), scales=scales, bits=bits,
                          group_size=gs, zero_mode=mode, zeros=zeros, scale_dtype=sdt, name="t")


def test_dequantize_matches_formula_elementwise():
    rng = np.random.default_rng(1)
    for mode in ("none", "int", "float"):
        for sdt in ("float16", "bfloat16", "float32"):
            layer = make(rng, mode=mode, sdt=sdt).validate()
            w = layer.dequantize(np.float64)
            s = to_float32(layer.scales, sdt).astype(np.float64)
            for n, k in [(0, 0), (3, 50), (7, 95)]:
                g = layer.g_idx[k]
                q = float(layer.codes[n, k])
                if mode == "none":
                    want = s[n, g] * (q - 8)
                elif mode == "int":
                    want = s[n, g] * (q - layer.zeros[n, g])
                else:
                    want = s[n, g] * q + float(to_float32(layer.zeros, sdt)[n, g])
                assert w[n, k] == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_dequantize_uses_g_idx_permutation():
    rng = np.random.default_rng(2)
    layer = make(rng, k=64, gs=32)
    layer.g_idx = np.array([1, 0] * 32, dtype=np.int32)
    w = layer.dequantize()
    s = to_float32(layer.scales, "float16")
    assert w[0, 0] == np.float32(s[0, 1] * (float(layer.codes[0, 0]) - layer.zeros[0, 1]))
    assert layer.act_order


def test_bf16_roundtrip_exact():
    x = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0, -0.0], dtype=np.float32)
    b = from_float32(x, "bfloat16")
    assert b.dtype == np.uint16
    back = to_float32(b, "bfloat16")
    assert np.array_equal(from_float32(back, "bfloat16"), b)
    assert back[0] == 1.0 and back[1] == -2.5


@pytest.mark.parametrize("mutate, msg", [
    (lambda L: setattr(L, "bits", 7), "bits must be one of"),
    (lambda L: setattr(L, "codes", L.codes.astype(np.int32)), "codes must be a uint8"),
    (lambda L: L.codes.__setitem__((0, 0), 16), "codes exceed 15"),
    (lambda L: setattr(L, "scales", L.scales[:, :2]), "scales shape"),
    (lambda L: setattr(L, "g_idx", L.g_idx[:-1]), "g_idx must be"),
    (lambda L: setattr(L, "g_idx", L.g_idx.astype(np.int64)), "g_idx must be int32"),
    (lambda L: L.g_idx.__setitem__(0, 99), "g_idx values must lie"),
    (lambda L: setattr(L, "zero_mode", "weird"), "zero_mode must be one of"),
    (lambda L: setattr(L, "zeros", None), "needs zeros of shape"),
    (lambda L: L.zeros.__setitem__((0, 0), 17), "integer zeros must lie"),
    (lambda L: L.scales.__setitem__((0, 0), np.inf), "NaN or infinity"),
    (lambda L: setattr(L, "group_size", 0), "group_size must be positive"),
    (lambda L: setattr(L, "bias", np.zeros(3, np.float16)), "bias shape"),
    (lambda L: setattr(L, "bias", np.array([0.5, -np.inf] + [1.0] * 6, np.float16)), "bias contains NaN"),
])
def test_invariants_rejected_with_clear_error(mutate, msg):
    layer = make(np.random.default_rng(3))
    mutate(layer)
    with pytest.raises(BadInputError, match=msg) as ei:
        layer.validate()
    assert "tensor t" in str(ei.value)


@pytest.mark.parametrize("sdt", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["int", "float"])
def test_scales_whose_products_overflow_float32_refused(sdt, mode):
    """A scale that is finite in its dtype but makes every GEMM of the layer overflow float32 is a damaged
    value (found by fuzzing a bf16 per-tensor scale with one bit flipped: 0.0087 became 2.97e36)."""
    layer = make(np.random.default_rng(5), mode=mode, sdt=sdt)
    layer.scales[1, 2] = from_float32(np.array([3e36], np.float32), sdt)[0]
    with pytest.raises(BadInputError, match=r"a scale of [0-9.]+e\+36: with 96 inputs the layer's products overflow") as ei:
        layer.validate()
    assert "tensor t" in str(ei.value)
    if mode == "float":
        ok = make(np.random.default_rng(5), mode=mode, sdt=sdt)
        ok.zeros[0, 0] = from_float32(np.array([-3e37], np.float32), sdt)[0]
        with pytest.raises(BadInputError, match=r"a float minimum of [0-9.]+e\+37"):
            ok.validate()


def test_large_but_plausible_scales_accepted():
    """The bound leaves every trained model far inside: fp16's largest scale at the widest layers passes."""
    layer = make(np.random.default_rng(6), k=4096, gs=128, sdt="float16")
    layer.scales[:] = np.float16(65504)
    layer.validate()


def test_zero_16_allowed_for_v1_wraparound():
    layer = make(np.random.default_rng(4))
    layer.zeros[0, 0] = 16  # what AutoGPTQ's v1 readers decode for a stored -1
    layer.validate()


def test_default_g_idx():
    assert default_g_idx(5, 2).tolist() == [0, 0, 1, 1, 2]
    assert default_g_idx(3, -1).tolist() == [0, 0, 0]


def test_differences_reports_what_differs():
    rng = np.random.default_rng(5)
    a = make(rng)
    b = a.replace(codes=a.codes.copy())
    assert a.equals(b)
    b.codes[0, 0] ^= 1
    assert any(d.startswith("codes") for d in a.differences(b))


@pytest.mark.parametrize("mode", ["none", "int", "float"])
@pytest.mark.parametrize("sdt", ["float16", "bfloat16", "float32"])
def test_float32_dequantize_is_the_float64_one_rounded_once(mode, sdt):
    """docs/LAYOUT.md §1: "the same values" in float32 are the float64 ones rounded once. A float-minimum layer
    with float32 scales came back with s·q rounded before the sum (1019 of 3700 values 1 ulp off, a review)."""
    rng = np.random.default_rng(11)
    layer = make(rng, n=37, k=100, bits=6, gs=-1, mode=mode, sdt=sdt)
    if sdt == "float32":
        layer.scales[:] = rng.random(layer.scales.shape, dtype=np.float32) * 0.37 + 0.01
    layer.validate()
    assert np.array_equal(layer.dequantize(np.float32).view(np.uint32),
                          layer.dequantize(np.float64).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.uint8])
def test_dequantize_refuses_a_dtype_it_does_not_give(dtype):
    """dtype=np.int32 returned truncated integers without a word."""
    with pytest.raises(BadInputError, match="float32 or float64 weights"):
        make(np.random.default_rng(1)).validate().dequantize(dtype)
