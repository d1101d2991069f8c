"""Layout v1: pack → unpack is the identity, and the bytes follow the index formulas of docs/LAYOUT.md."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from w4pack.canonical import CanonicalLayer
from w4pack.dtypes import from_float32
from w4pack.errors import BadInputError, UnsupportedError
from w4pack.layout import NIBBLE_POS, TILE_K, TILE_N, pack, padded_shape, unpack


def random_layer(rng, n, k, bits, gs, mode, act_order, sdt="float16", bias=False):
    g = 1 if gs == -1 else -(-k // gs)
    scales = from_float32((rng.random((n, g), dtype=np.float32) + 0.25) / 8, sdt)
    zeros = None
    if mode == "int":
        zeros = rng.integers(0, (1 << bits) + 1, (n, g)).astype(np.int32)
    elif mode == "float":
        zeros = from_float32(rng.standard_normal((n, g)).astype(np.float32), sdt)
    g_idx = None
    if act_order and gs != -1:
        g_idx = (np.argsort(rng.permutation(k)) // gs).astype(np.int32)
    b = from_float32(rng.standard_normal(n).astype(np.float32), sdt) if bias else None
    return CanonicalLayer(codes=rng.integers(0, 1 << bits, (n, k), dtype=np.uint8), scales=scales, bits=bits,
                          group_size=gs, zero_mode=mode, zeros=zeros, g_idx=g_idx, scale_dtype=sdt, bias=b,
                          bias_dtype=sdt if bias else None, name="layer")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 300), bits=st.sampled_from([2, 3, 4, 5, 6, 8]),
       gs=st.sampled_from([32, 64, 128, -1]), mode=st.sampled_from(["none", "int", "float"]),
       act_order=st.booleans(), sdt=st.sampled_from(["float16", "bfloat16", "float32"]), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip(n, k, bits, gs, mode, act_order, sdt, bias, seed):
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, n, k, bits, gs, mode, act_order, sdt, bias)
    packed = pack(layer)
    back = unpack(packed, name="layer")
    assert layer.differences(back) == []
    np_, kp = packed.meta["padded_shape"]
    assert np_ % TILE_N == 0 and kp % TILE_K == 0 and np_ >= n and kp >= k
    np.testing.assert_array_equal(back.dequantize(np.float64), layer.dequantize(np.float64))


def scalar_index(n: int, k: int, kp: int, storage_bits: int) -> tuple[int, int, int]:
    """docs/LAYOUT.md §3, written out as plain integer arithmetic: (stripe row, word column, bit shift)."""
    nb, r = divmod(n, 16)
    kb, c = divmod(k, 64)
    j, kk = divmod(c, 16)
    rh, gid = divmod(r, 8)
    kh, rest = divmod(kk, 8)
    tid, e = divmod(rest, 2)
    lane = gid * 4 + tid
    elem = 4 * kh + 2 * rh + e
    if storage_bits == 4:
        return nb, kb * 128 + lane * 4 + j, 4 * int(NIBBLE_POS[elem])
    return nb, kb * 256 + lane * 8 + j * 2 + elem // 4, 8 * (elem % 4)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_bytes_follow_documented_formula(bits):
    rng = np.random.default_rng(7)
    layer = random_layer(rng, 35, 150, bits, 32, "int", act_order=False)
    packed = pack(layer)
    q = packed.tensors["qweight"].view(np.uint32)
    mask = 0xF if bits == 4 else 0xFF
    _, kp = padded_shape(35, 150)
    for n in range(35):
        for k in range(150):
            row, col, shift = scalar_index(n, k, kp, packed.meta["storage_bits"])
            assert (int(q[row, col]) >> shift) & mask == layer.codes[n, k]


def test_worked_example_from_docs():
    """The 16×64 worked example in docs/LAYOUT.md: codes[n, k] = (n + k) % 16."""
    n_idx, k_idx = np.meshgrid(np.arange(16), np.arange(64), indexing="ij")
    codes = ((n_idx + k_idx) % 16).astype(np.uint8)
    layer = CanonicalLayer(codes=codes, scales=np.ones((16, 1), np.float16), bits=4, group_size=-1)
    q = pack(layer).tensors["qweight"].view(np.uint32)
    assert q.shape == (1, 128)
    # lane 0 (rows 0 and 8, columns 0-1 and 8-9 of each k16 slice), word 0:
    # elements e0..e7 = (n,k) (0,0)(0,1)(8,0)(8,1)(0,8)(0,9)(8,8)(8,9) -> codes 0,1,8,9,8,9,0,1;
    # nibbles p7..p0 hold e7 e5 e3 e1 e6 e4 e2 e0 = 1 9 9 1 0 8 8 0
    assert f"{int(q[0, 0]):08x}" == "19910880"
    # lane 5 = gid 1, tid 1: rows 1 and 9, columns 2-3 and 10-11 -> e0..e7 = 3,4,11,12,11,12,3,4
    assert f"{int(q[0, 5 * 4 + 0]):08x}" == "4cc43bb3"
    # word j=1 of lane 0 is the next k16 slice: every code + 16 columns -> same codes (period 16)
    assert int(q[0, 1]) == int(q[0, 0])


def test_act_order_perm_sorts_groups():
    rng = np.random.default_rng(8)
    layer = random_layer(rng, 16, 128, 4, 32, "none", act_order=True)
    packed = pack(layer)
    perm = packed.tensors["perm"]
    assert np.array_equal(layer.g_idx[perm], np.arange(128) // 32)


def test_unsupported_group_structure_refused():
    rng = np.random.default_rng(9)
    layer = random_layer(rng, 16, 128, 4, 32, "none", act_order=False)
    layer.g_idx = np.minimum(np.arange(128) // 20, 3).astype(np.int32)  # groups of 20, not 32
    with pytest.raises(UnsupportedError, match="g_idx contradicts group_size"):
        pack(layer)
    odd = random_layer(rng, 16, 120, 4, 40, "none", act_order=False)
    with pytest.raises(UnsupportedError, match="multiple of 16"):
        pack(odd)


def test_unpack_rejects_inconsistent_tensors():
    rng = np.random.default_rng(10)
    packed = pack(random_layer(rng, 20, 100, 4, 64, "int", act_order=True))
    bad = dict(packed.tensors)
    bad["qweight"] = bad["qweight"][:, :-1]
    with pytest.raises(BadInputError, match="qweight"):
        unpack(type(packed)(meta=packed.meta, tensors=bad), name="x")
    bad = dict(packed.tensors)
    bad["perm"] = np.zeros_like(bad["perm"])
    with pytest.raises(BadInputError, match="not a permutation"):
        unpack(type(packed)(meta=packed.meta, tensors=bad), name="x")
    meta = dict(packed.meta, padded_shape=[32, 100])
    with pytest.raises(BadInputError, match="padded shape"):
        unpack(type(packed)(meta=meta, tensors=packed.tensors), name="x")


def test_unpack_rejects_out_of_range_parameters():
    rng = np.random.default_rng(11)
    packed = pack(random_layer(rng, 20, 100, 4, 64, "int", act_order=False))
    bad = dict(packed.tensors)
    bad["zeros"] = bad["zeros"].copy()
    bad["zeros"][1, 3] = 200  # a 4-bit zero point past 2^bits
    with pytest.raises(BadInputError, match=r"zeros must lie in 0\.\.16, got .*200"):
        unpack(type(packed)(meta=packed.meta, tensors=bad), name="x")
    bad = dict(packed.tensors)
    bad["scales"] = bad["scales"].copy()
    bad["scales"][0, 0] = np.inf
    with pytest.raises(BadInputError, match="NaN or infinity"):
        unpack(type(packed)(meta=packed.meta, tensors=bad), name="x")


@pytest.mark.parametrize("field", ["qweight", "scales", "zeros"])
def test_unpack_rejects_nonzero_padding(field):
    # a manifest shape shrunk from K = 100 to 90 (same padded shape) must not drop real columns silently
    rng = np.random.default_rng(12)
    packed = pack(random_layer(rng, 20, 100, 4, 32, "int", act_order=False))
    if field == "qweight":
        meta = dict(packed.meta, shape=[20, 90], num_groups=3)
        with pytest.raises(BadInputError, match="x.qweight.*padding past the recorded shape"):
            unpack(type(packed)(meta=meta, tensors=packed.tensors), name="x")
        return
    bad = dict(packed.tensors)
    bad[field] = bad[field].copy()
    bad[field][0, 21] = 1  # padded row n >= N
    with pytest.raises(BadInputError, match=f"x.{field}.*padding past the recorded shape"):
        unpack(type(packed)(meta=packed.meta, tensors=bad), name="x")


@pytest.mark.parametrize("sdt", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("field", ["scales", "mins"])
def test_unpack_rejects_negative_zero_in_padding(sdt, field):
    """Section 3.2: padded scales and minima are +0, every bit zero; -0.0 is refused at every width (float32
    compared numerically once, and let it through)."""
    rng = np.random.default_rng(13)
    packed = pack(random_layer(rng, 20, 64, 4, 32, "float", False, sdt))
    bad = dict(packed.tensors)
    arr = bad[field].copy()
    arr.view(np.uint16 if arr.dtype.itemsize == 2 else np.uint32)[0, 25] = 0x8000 if arr.dtype.itemsize == 2 \
        else 0x80000000  # -0.0 in padded row 25 >= N = 20
    bad[field] = arr
    with pytest.raises(BadInputError, match=f"x.{field}.*padding past the recorded shape"):
        unpack(type(packed)(meta=packed.meta, tensors=bad), name="x")
