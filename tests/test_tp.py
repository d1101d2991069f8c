"""Tensor-parallel slices (w4pack/tp.py): every rank's layer is exact, and the ranks' GEMMs combine to the full one."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from test_layout import random_layer
from w4pack.errors import UnsupportedError
from w4pack.layout import pack, unpack
from w4pack.native.cpu import CpuPackedLinear
from w4pack.tp import column_parallel, column_slice, row_parallel, row_slice, stack_blockers, stack_rows

MODES = ["none", "int", "float"]


def _dequant(packed, k_real=None):
    w = unpack(packed, name="x").dequantize(np.float64)
    return w if k_real is None else w[:, :k_real]


def _gemm(packed, x):
    return CpuPackedLinear(packed).forward(x, precision="exact").astype(np.float64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("n,k,gs,bits", [(96, 576, 128, 4), (80, 512, 64, 8), (48, 384, 32, 3), (64, 256, -1, 4)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_sums_to_full(mode, act_order, n, k, gs, bits, tp):
    rng = np.random.default_rng(zlib.crc32(repr((mode, act_order, n, k, gs, bits, tp)).encode()))
    packed = pack(random_layer(rng, n, k, bits, gs, mode, act_order, "float16", bias=True))
    full_w = _dequant(packed)
    x = rng.standard_normal((5, k)).astype(np.float32)
    total = np.zeros((5, n))
    per = k // tp
    for rank in range(tp):
        shard = row_parallel(packed, tp, rank, name="layer")
        assert shard.in_features == per and "bias" not in shard.packed.tensors
        # the rank's weights over its own channels are the full layer's, bit for bit
        np.testing.assert_array_equal(_dequant(shard.packed, per), full_w[:, rank * per:(rank + 1) * per])
        xl = np.concatenate([x[:, rank * per:(rank + 1) * per],
                             np.zeros((5, shard.input_pad), np.float32)], axis=1)
        total += _gemm(shard.packed, xl)
    want = x.astype(np.float64) @ full_w.T
    np.testing.assert_allclose(total, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    bias = np.asarray(packed.tensors["bias"], dtype=np.float64)
    np.testing.assert_allclose(total + bias, _gemm(packed, x), rtol=1e-4, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("n,k,gs", [(128, 576, 128), (96, 320, 64), (200, 192, -1)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_concatenates_to_full(mode, act_order, n, k, gs, tp):
    rng = np.random.default_rng(zlib.crc32(repr((mode, act_order, n, k, gs, tp)).encode()))
    packed = pack(random_layer(rng, n, k, 4, gs, mode, act_order, "bfloat16", bias=True))
    x = rng.standard_normal((3, k)).astype(np.float32)
    full = _gemm(packed, x)
    outs = []
    for rank in range(tp):
        part = column_parallel(packed, tp, rank, name="layer")
        lo, hi = rank * n // tp, (rank + 1) * n // tp
        assert unpack(part, "p").differences(_slice_rows(unpack(packed, "p"), lo, hi)) == []
        outs.append(_gemm(part, x))
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), full)


def _slice_rows(layer, lo, hi):
    return layer.replace(codes=layer.codes[lo:hi], scales=layer.scales[lo:hi],
                         zeros=None if layer.zeros is None else layer.zeros[lo:hi],
                         bias=None if layer.bias is None else layer.bias[lo:hi])


@pytest.mark.parametrize("lo,hi", [(0, 16), (16, 40), (5, 37), (32, 77), (64, 77)])
def test_column_slice_any_rows(lo, hi):
    rng = np.random.default_rng(lo * 100 + hi)
    layer = random_layer(rng, 77, 200, 4, 64, "int", True, bias=True)
    part = column_slice(pack(layer), lo, hi)
    assert unpack(part, "p").differences(_slice_rows(layer, lo, hi)) == []


def test_row_slice_regroups_act_order_compactly():
    rng = np.random.default_rng(3)
    layer = random_layer(rng, 32, 1024, 4, 128, "int", True)
    shard = row_slice(pack(layer), 0, 512)
    # scattered groups cost a few padding channels per group, far fewer than the unsliced width
    assert shard.packed.meta["group_size"] <= 128 and shard.packed.meta["group_size"] % 16 == 0
    assert shard.input_pad < 8 * 16
    assert shard.packed.meta["shape"][1] < 640


def test_row_slice_on_group_boundaries_is_a_plain_layer():
    rng = np.random.default_rng(4)
    packed = pack(random_layer(rng, 48, 512, 4, 128, "float", False))
    shard = row_slice(packed, 256, 512)
    assert shard.input_pad == 0 and not shard.packed.meta["act_order"]
    assert shard.packed.meta["group_size"] == 128


def test_stack_rows_fast_and_repacked():
    rng = np.random.default_rng(5)
    for rows in ([32, 16, 16], [24, 8, 40]):
        layers = [random_layer(rng, r, 192, 4, 64, "int", False, bias=True) for r in rows]
        stacked = stack_rows([pack(l) for l in layers])
        back = unpack(stacked, "s")
        lo = 0
        for l in layers:
            assert _slice_rows(back, lo, lo + l.out_features).differences(l.replace(name="s")) == []
            lo += l.out_features


def test_stack_refuses_different_permutations():
    rng = np.random.default_rng(6)
    a = pack(random_layer(rng, 16, 256, 4, 64, "none", True))
    b = pack(random_layer(rng, 16, 256, 4, 64, "none", True))
    assert any("permutation" in w for w in stack_blockers([a, b]))
    with pytest.raises(UnsupportedError, match="permutations differ"):
        stack_rows([a, b], name="qkv")


def test_uneven_split_refused_naming_layer_and_size():
    rng = np.random.default_rng(7)
    packed = pack(random_layer(rng, 48, 192, 4, 64, "none", False))
    with pytest.raises(UnsupportedError, match=r"tensor mlp.down_proj: in_features 192 .* size 5"):
        row_parallel(packed, 5, 0, name="mlp.down_proj")
    with pytest.raises(UnsupportedError, match=r"out_features 48 .* size 5"):
        column_parallel(packed, 5, 1, name="q")


@pytest.mark.parametrize("bits,gs,lo,hi", [(4, 64, 128, 320), (8, 128, 256, 512), (4, 128, 384, 520), (3, 32, 0, 64)])
def test_aligned_row_slice_keeps_source_bytes(bits, gs, lo, hi):
    """Tile- and group-aligned cuts of a layer without act-order copy the source's words: same weights as the
    general (unpack, regroup, pack) path."""
    from w4pack.tp import _aligned_row_slice

    rng = np.random.default_rng(bits * 1000 + lo)
    layer = random_layer(rng, 40, 520, bits, gs, "int", False)
    fast = _aligned_row_slice(pack(layer), lo, hi)
    assert fast is not None
    want = layer.dequantize(np.float64)[:, lo:hi]
    np.testing.assert_array_equal(unpack(fast, "f").dequantize(np.float64), want)
    assert _aligned_row_slice(pack(layer), lo + 16, hi) is None
