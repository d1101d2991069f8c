"""The gemv kernel (native/cuda/kernel_gemv.cu) emulated lane by lane in numpy, against the layout's float64
reference. No GPU: what this checks is the index and offset arithmetic the kernel does per lane (the activations'
fragment-order staging, one row per token, each lane's 16-byte word of a tile as the m16n8k16 A fragment, the
token row each lane reads as its B column, the chunk and group-segment walk, the scale / zero-point offsets
through group_of's multiply-high, the stripe sums per token in warp order). A wrong
nibble, row, offset or segment gives errors of order 1; the float64 emulation must agree to rounding."""
from __future__ import annotations

import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from w4pack.canonical import CanonicalLayer, default_g_idx
from w4pack.dtypes import from_float32, to_float32
from w4pack.layout import pack

GEOMETRY = Path(__file__).resolve().parent.parent / "native" / "cuda" / "geometry.h"


def kernel_shape() -> tuple[int, int]:
    """The kernel's warps per block and tiles per warp and step (GV_W, GV_U), read from geometry.h, so the
    emulation walks the chunks as the kernel does (a changed shape there is emulated here)."""
    src = GEOMETRY.read_text()
    vals = [re.search(r"constexpr int " + name + r" = (\d+);", src) for name in ("GV_W", "GV_U")]
    assert all(vals), f"GV_W / GV_U not found in {GEOMETRY}"
    return int(vals[0].group(1)), int(vals[1].group(1))  # type: ignore[union-attr]


def random_layer(rng, n, k, gs, zero_mode, act_order, dtype):
    g = 1 if gs == -1 else -(-k // gs)
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    s32 = (rng.uniform(0.5, 1.5, size=(n, g)) * 0.02).astype(np.float32)
    cast = (lambda a: a.astype(np.float16)) if dtype == "float16" else (lambda a: from_float32(a, "bfloat16"))
    zeros = None
    if zero_mode == "int":
        zeros = rng.integers(0, 17, size=(n, g)).astype(np.int32)
    elif zero_mode == "float":
        zeros = cast((rng.uniform(-1, 1, size=(n, g)) * 0.1).astype(np.float32))
    g_idx = default_g_idx(k, gs)
    if act_order and gs != -1:
        g_idx = g_idx[rng.permutation(k)].astype(np.int32)
    return CanonicalLayer(codes=codes, scales=cast(s32), bits=4, group_size=gs, zero_mode=zero_mode, zeros=zeros,
                          g_idx=g_idx, scale_dtype=dtype).validate()


def act_bits_to_float(bits16: np.ndarray, dtype: str) -> np.ndarray:
    """16-bit patterns of the activation dtype as float64."""
    b = bits16.astype(np.uint16)
    if dtype == "float16":
        return b.view(np.float16).astype(np.float64)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def float_to_act_bits(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return np.asarray(v, dtype=np.float16).view(np.uint16)
    return from_float32(np.asarray(v, dtype=np.float32), "bfloat16")


def and_or(x, mask, bits):
    return (x & np.uint32(mask)) | np.uint32(bits)


def fragment_regs(words: np.ndarray, j: int, dtype: str, zlo, zhi):
    """The four A registers of k16 slice j per lane, as (lo16, hi16) floats: dq_int of the kernel.
    words: [32 lanes, 4] uint32; zlo / zhi: the zero point per lane's rows."""
    x = words[:, j].astype(np.uint32)
    if dtype == "float16":
        y = x >> np.uint32(8)
        raw = [and_or(x, 0x000F000F, 0x64006400), and_or(x, 0x00F000F0, 0x64006400),
               and_or(y, 0x000F000F, 0x64006400), and_or(y, 0x00F000F0, 0x64006400)]
    else:
        raw = [and_or(x >> np.uint32(4 * i), 0x000F000F, 0x43004300) for i in range(4)]
    regs = []
    for i, r in enumerate(raw):
        lo = act_bits_to_float(r & np.uint32(0xFFFF), dtype)
        hi = act_bits_to_float(r >> np.uint32(16), dtype)
        z = zhi if i & 1 else zlo  # dq_int: h - (magic + z), fp16 rows gid + 8: h / 16 - (64 + z); exact
        if dtype == "float16" and i & 1:
            lo, hi = lo / 16 - (64 + z), hi / 16 - (64 + z)
        else:
            magic = 1024.0 if dtype == "float16" else 128.0
            lo, hi = lo - (magic + z), hi - (magic + z)
        regs.append((lo, hi))
    return regs


def a_matrix(regs) -> np.ndarray:
    """m16n8k16's A (16 x 16) from the lanes' registers: a0 (gid, 2 tid + e), a1 (gid + 8, 2 tid + e),
    a2 (gid, 2 tid + 8 + e), a3 (gid + 8, 2 tid + 8 + e)."""
    a = np.zeros((16, 16))
    lane = np.arange(32)
    gid, tid = lane >> 2, lane & 3
    for i, (lo, hi) in enumerate(regs):
        row = gid + (8 if i & 1 else 0)
        col = 2 * tid + (8 if i >= 2 else 0)
        a[row, col] = lo
        a[row, col + 1] = hi
    return a


def stage(x_bits: np.ndarray, K: int, KT: int, perm) -> np.ndarray:
    """The kernel's staging loop: xs[((kb * 4 + t) * 4 + j) * 2 + hi] = the pair (k, k + 1), as 16-bit halves."""
    xs = np.zeros((KT * 32, 2), dtype=np.uint16)
    for c in range(KT * 32):
        k = 2 * c
        kb, r = k >> 6, k & 63
        j, hi, t = r >> 4, (r >> 3) & 1, (r & 7) >> 1
        for e in range(2):
            kk = k + e
            xs[((kb * 4 + t) * 4 + j) * 2 + hi, e] = x_bits[perm[kk] if perm is not None else kk] if kk < K else 0
    return xs


def b_matrix(xs_f: np.ndarray, t0: int, u: int, j: int, m: int, KT: int) -> np.ndarray:
    """B [16, 8] of slice j of the chunk's tile u as the kernel reads it: lane (gid, tid)'s uint4 pointer
    xb = xs4 + 2 tid + 8 t0, where xs4 starts at token row min(gid, m - 1)'s staging (KT * 8 + 1 uint4 a row: 16
    bytes of padding; row 0 for every lane at M = 1), then b01 = xb[8 u], b23 = xb[8 u + 1]; slice j's pair is (b01.x, b01.y), (b01.z, b01.w),
    (b23.x, b23.y), (b23.z, b23.w); its first register holds k = 2 tid + e, its second k = 2 tid + 8 + e, of column
    n = gid."""
    b = np.zeros((16, 8))
    for gid in range(8):
        for tid in range(4):
            xb = 2 * tid + min(gid, m - 1) * (KT * 8 + 1) + 8 * t0  # uint4 index: four 32-bit pair slots each
            v = xb + 8 * u + (j >> 1)
            slot = 4 * v + 2 * (j & 1)
            b[2 * tid: 2 * tid + 2, gid] = xs_f[slot]
            b[2 * tid + 8: 2 * tid + 10, gid] = xs_f[slot + 1]
    return b


def group_of(k: int, gmul: int) -> int:
    return (k * gmul) >> 32


def emulate(packed, x: np.ndarray, dtype: str, W: int, U: int) -> np.ndarray:
    """y [M, N] for x [M, K] (M <= 8) as the kernel computes it, in float64 after each MMA (so only a wrong index or
    offset can make it differ from the reference beyond rounding), for blocks of W warps taking U tiles each per
    step."""
    meta, t = packed.meta, packed.tensors
    n, K = meta["shape"]
    Np, Kp = meta["padded_shape"]
    KT, NS, gs, zm = Kp // 64, Np // 16, meta["group_size"], meta["zero_mode"]
    gmul = 0 if gs <= 0 else -(-(1 << 32) // gs)
    qw = np.ascontiguousarray(t["qweight"]).view(np.uint32).reshape(NS, KT, 32, 4)
    scales = act_bits_to_float(float_to_act_bits(to_float32(t["scales"], meta["scale_dtype"]), dtype), dtype)
    if zm == "int":
        zp = t["zeros"].astype(np.float64)  # (prepared in the activation dtype: small integers, exact)
    elif zm == "float":
        zp = act_bits_to_float(float_to_act_bits(to_float32(t["mins"], meta["scale_dtype"]), dtype), dtype)
    perm = t.get("perm")
    m = x.shape[0]
    pad = np.full((4 if m > 1 else 0, 2), 0xFFFF, dtype=np.uint16)  # (never read: NaN if it were)
    xs = np.concatenate([np.concatenate([stage(float_to_act_bits(row, dtype), K, KT, perm), pad]) for row in x])
    xs_f = act_bits_to_float(xs, dtype)  # [M * (KT * 32 + pad), 2]
    # the segment length (launch_gemv_ts): whole chunks, single tiles, or halves where groups end inside a tile
    TS = U if gs <= 0 or gs % (64 * U) == 0 else 1 if gs % 64 == 0 else 0
    lane = np.arange(32)
    gid = lane >> 2
    y = np.zeros((Np, 8))
    spp = -(-KT // (W * U))
    for s in range(NS):
        red = np.zeros((W, 16, 8))
        for wi in range(W):
            acc_lo = np.zeros((8, 8))  # rows gid, columns (tokens) 2 tid and 2 tid + 1 (lane (gid, tid) holds them)
            acc_hi = np.zeros((8, 8))
            for st in range(spp):
                t0 = st * W * U + wi * U
                nv = KT - t0
                if nv <= 0:
                    continue
                nsegc = U // TS if TS else 2 * U
                for g in range(nsegc):
                    first = g * TS if TS else g // 2
                    if first >= nv:
                        break
                    col = 64 * (t0 + first) if TS else 64 * t0 + 32 * g
                    off_row = group_of(col, gmul)
                    rows = 16 * s + gid  # per lane: the parameters at off and off + 8
                    s_lo, s_hi = scales[off_row, rows], scales[off_row, rows + 8]
                    z_lo = z_hi = np.full(32, 8.0)
                    m_lo = m_hi = np.zeros(32)
                    if zm == "int":
                        z_lo, z_hi = zp[off_row, rows], zp[off_row, rows + 8]
                    elif zm == "float":
                        m_lo, m_hi = zp[off_row, rows], zp[off_row, rows + 8]
                    d = np.zeros((16, 8))  # the segment's MMA sums, rows 0..15, columns 0..7
                    tiles = range(first, min(first + TS, nv)) if TS else [first]
                    for u in tiles:
                        kb = t0 + u
                        halves = (0, 1) if TS else (g & 1,)
                        for h in halves:
                            for jj in range(2):
                                j = 2 * h + jj
                                if zm == "float":  # s q + m per weight, rounded to the dtype
                                    regs = fragment_regs(qw[s, kb], j, dtype, np.zeros(32), np.zeros(32))
                                    sc = [(s_lo, m_lo), (s_hi, m_hi), (s_lo, m_lo), (s_hi, m_hi)]
                                    regs = [tuple(act_bits_to_float(float_to_act_bits(v * sc[i][0] + sc[i][1],
                                                                                       dtype), dtype)
                                                  for v in r) for i, r in enumerate(regs)]
                                else:
                                    regs = fragment_regs(qw[s, kb], j, dtype, z_lo, z_hi)
                                d = d + a_matrix(regs) @ b_matrix(xs_f, t0, u, j, m, KT)
                    if zm == "float":  # (scaled per weight: straight into the stripe's sums)
                        acc_lo, acc_hi = acc_lo + d[:8], acc_hi + d[8:]
                    else:  # the scale once per segment (the lanes of row gid hold the same)
                        acc_lo = acc_lo + s_lo[::4, None] * d[:8]
                        acc_hi = acc_hi + s_hi[::4, None] * d[8:]
            red[wi, :8], red[wi, 8:] = acc_lo, acc_hi
        v = np.zeros((16, 8))
        for wi in range(W):  # in warp order
            v = v + red[wi]
        y[16 * s: 16 * s + 16] = v
    return y[:n, :m].T


CASES = [  # (dtype, zero mode, group size, act-order, n, k, tokens)
    ("float16", "none", 128, False, 40, 1000, 1), ("float16", "int", 32, True, 24, 700, 3),
    ("float16", "float", 64, False, 17, 576, 8), ("float16", "none", -1, False, 33, 1100, 1),
    ("float16", "int", 96, False, 20, 640, 5), ("float16", "none", 256, False, 16, 2100, 2),
    ("bfloat16", "none", 128, False, 40, 1000, 7), ("bfloat16", "int", 128, True, 24, 900, 1),
    ("bfloat16", "float", 32, True, 18, 600, 4), ("bfloat16", "int", 64, False, 16, 1300, 8),
]


@pytest.mark.parametrize("dtype,zero_mode,gs,act_order,n,k,m", CASES)
def test_kernel_matches_the_reference(dtype, zero_mode, gs, act_order, n, k, m):
    # float64 arithmetic after the MMA: agreement to rounding shows every index, nibble and offset is right
    W, U = kernel_shape()
    rng = np.random.default_rng(zlib.crc32(repr((dtype, zero_mode, gs, act_order, n, k, m)).encode()))
    layer = random_layer(rng, n, k, gs, zero_mode, act_order, dtype)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x_act = act_bits_to_float(float_to_act_bits(x, dtype), dtype)  # the activations the kernel gets
    ref = x_act @ layer.dequantize(np.float64).T
    y = emulate(pack(layer), x_act, dtype, W, U)
    assert y.shape == (m, n)
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    # exact but for the per-weight rounding of s q + m (float minima) in the activation dtype
    bound = 1e-12 if zero_mode != "float" else (2e-3 if dtype == "float16" else 2e-2)
    assert err <= bound, (err, bound)

