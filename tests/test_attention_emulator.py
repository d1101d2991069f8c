"""The decode attention kernel (native/cuda/kernel_attention.cu) emulated warp by warp in numpy (float64), against
plain softmax attention. No GPU: what this checks is the kernel's index arithmetic, where a slip gives errors of
order 1 and not of rounding: the split and tile walk (chunks of at least a tile, splits left without keys), each
warp's rows held in registers across tiles (the next tile's rows loaded while this one's math runs, rows past the
split's end left from the tile before, the new key taken from the projections, not the cache), the transposed
warp sums of the scores and the lane that writes each (row, head), the online softmax and the combine of the
splits through the workspace."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

KERNEL = Path(__file__).resolve().parent.parent / "native" / "cuda" / "kernel_attention.cu"


def kernel_constants() -> tuple[int, int, int]:
    """(threads a block, rows a warp for head sizes of 256, rows a warp otherwise), read from the kernel source so
    a changed tile is emulated here."""
    src = KERNEL.read_text()
    threads = re.search(r"constexpr int AT_THREADS = (\d+);", src)
    kpw = re.search(r"constexpr int KPW = EPL == 8 \? (\d+) : (\d+);", src)
    assert threads and kpw, f"AT_THREADS / KPW not found in {KERNEL}"
    return int(threads.group(1)), int(kpw.group(1)), int(kpw.group(2))


def warp_sums(v: np.ndarray) -> np.ndarray:
    """v [32 lanes, V]: warp_sums<V> shuffle by shuffle; returns each lane's v[0] afterwards."""
    v = v.copy()
    n_vals = v.shape[1]
    lanes = np.arange(32)
    for step in range(5):
        o, n = 16 >> step, n_vals >> step
        partner = lanes ^ o
        if n >= 2:
            up = (lanes & o) != 0
            lo, hi = v[:, :n // 2].copy(), v[:, n // 2:n].copy()
            keep = np.where(up[:, None], hi, lo)
            send = np.where(up[:, None], lo, hi)
            v[:, :n // 2] = keep + send[partner]
        else:
            v[:, 0] = v[:, 0] + v[partner, 0]
    return v[:, 0]


@pytest.mark.parametrize("n_vals", [1, 2, 4, 8, 16, 32])
def test_warp_sums_leave_sum_j_in_lane_j_times_v_over_32(n_vals: int) -> None:
    rng = np.random.default_rng(n_vals)
    v = rng.standard_normal((32, n_vals))
    got = warp_sums(v)
    want = v.sum(0)
    lanes_a_sum = 32 // n_vals
    np.testing.assert_allclose(got, want[np.arange(32) // lanes_a_sum], rtol=1e-12, atol=1e-12)


def emulate(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
            pos: int, splits: int, scaling: float) -> np.ndarray:
    """The kernel's output [heads, D] for queries q [heads, D] (rotated) against caches [kv, max_len, D] whose row
    pos is replaced by k_new / v_new [kv, D]; every block of the grid (kv, splits) in turn, then each kv head's
    combine, as the last block to finish does it."""
    threads, kpw_256, kpw_other = kernel_constants()
    warps = threads // 32
    heads, d = q.shape
    kv = k_cache.shape[0]
    g_n = heads // kv
    gm = 1 if g_n <= 1 else 2 if g_n <= 2 else 4 if g_n <= 4 else 8
    epl = d // 32
    kpw = kpw_256 if epl == 8 else kpw_other
    tk = kpw * warps
    keys = pos + 1
    chunk = -(-keys // splits)
    chunk = max(-(-chunk // 16) * 16, tk)
    n_splits = -(-keys // chunk)
    rc = min(kpw, 32 // gm)
    n_vals = rc * gm
    lanes_a_sum = 32 // n_vals
    out = np.zeros((heads, d))
    for h in range(kv):
        qs = np.zeros((gm, d))
        qs[:g_n] = q[h * g_n:(h + 1) * g_n]
        parts = []
        for s in range(splits):
            if s >= n_splits:
                continue  # (a block without keys returns at once)
            j0, j1 = s * chunk, min(keys, s * chunk + chunk)
            kr = np.zeros((warps, kpw, d))
            vr = np.zeros((warps, kpw, d))

            def load_rows(r: np.ndarray, cache: np.ndarray, t0: int) -> None:
                for w in range(warps):
                    for i in range(kpw):
                        j = t0 + w * kpw + i
                        if j < j1 and j != pos:
                            r[w, i] = cache[h, j]

            load_rows(kr, k_cache, j0)
            load_rows(vr, v_cache, j0)
            m = np.full(gm, -np.inf)
            lsum = np.zeros(gm)
            acc = np.zeros((warps, gm, d))
            for t0 in range(j0, j1, tk):
                more = t0 + tk < j1
                p = np.full((gm, tk), np.nan)  # (every slot a head reads must be written this tile)
                for w in range(warps):
                    w0 = t0 + w * kpw
                    for i in range(kpw):
                        if w0 + i == pos:
                            kr[w, i], vr[w, i] = k_new[h], v_new[h]
                    for c in range(0, kpw, rc):
                        # lane L's partial products: its EPL elements of row c + v // gm with head v % gm
                        part = np.zeros((32, n_vals))
                        for vi in range(n_vals):
                            row, g = c + vi // gm, vi % gm
                            prod = (qs[g] * kr[w, row]).reshape(32, epl)
                            part[:, vi] = prod.sum(1)
                        sums = warp_sums(part)
                        written = set()
                        for lane in range(32):
                            j = lane // lanes_a_sum
                            row, g = c + j // gm, j % gm
                            if lane % lanes_a_sum == 0 and g < g_n:
                                assert (row, g) not in written
                                written.add((row, g))
                                p[g, w * kpw + row] = sums[lane] * scaling if w0 + row < j1 else -np.inf
                        assert written == {(r, g) for r in range(c, c + rc) for g in range(g_n)}
                if more:
                    load_rows(kr, k_cache, t0 + tk)
                alpha = np.ones(gm)
                for g in range(g_n):
                    assert not np.isnan(p[g]).any()
                    m_new = max(m[g], p[g].max())
                    p[g] = np.exp(p[g] - m_new)
                    alpha[g] = np.exp(m[g] - m_new)
                    lsum[g] = lsum[g] * alpha[g] + p[g].sum()
                    m[g] = m_new
                for w in range(warps):
                    acc[w] *= alpha[:, None]
                    w0 = t0 + w * kpw
                    for i in range(kpw):
                        if w0 + i < j1:
                            for g in range(g_n):
                                acc[w, g] += p[g, w * kpw + i] * vr[w, i]
                if more:
                    load_rows(vr, v_cache, t0 + tk)
            total = acc.sum(0)
            if n_splits == 1:
                out[h * g_n:(h + 1) * g_n] = total[:g_n] / lsum[:g_n, None]
            parts.append((m.copy(), lsum.copy(), total))
        if n_splits > 1:
            for g in range(g_n):
                ms = np.array([pt[0][g] for pt in parts])
                big = ms.max()
                w = np.exp(ms - big)
                den = (np.array([pt[1][g] for pt in parts]) * w).sum()
                num = sum(pt[2][g] * wt for pt, wt in zip(parts, w))
                out[h * g_n + g] = num / den
    return out


def reference(q, k_cache, v_cache, k_new, v_new, pos, scaling):
    heads, d = q.shape
    kv = k_cache.shape[0]
    g_n = heads // kv
    k = k_cache[:, :pos + 1].copy()
    v = v_cache[:, :pos + 1].copy()
    k[:, pos], v[:, pos] = k_new, v_new
    out = np.zeros((heads, d))
    for hq in range(heads):
        h = hq // g_n
        s = k[h] @ q[hq] * scaling
        e = np.exp(s - s.max())
        out[hq] = e @ v[h] / e.sum()
    return out


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads,kv", [(2, 2), (4, 2), (3, 1), (8, 2), (5, 1), (8, 1)])
def test_emulated_kernel_matches_attention(d: int, heads: int, kv: int) -> None:
    rng = np.random.default_rng(d * 100 + heads * 10 + kv)
    max_len = 700
    for pos, splits in [(0, 1), (15, 64), (63, 2), (64, 1), (65, 7), (200, 3), (699, 9), (699, 64)]:
        q = rng.standard_normal((heads, d))
        k_cache = rng.standard_normal((kv, max_len, d))
        v_cache = rng.standard_normal((kv, max_len, d))
        k_new, v_new = rng.standard_normal((kv, d)), rng.standard_normal((kv, d))
        scaling = d ** -0.5
        got = emulate(q, k_cache, v_cache, k_new, v_new, pos, splits, scaling)
        want = reference(q, k_cache, v_cache, k_new, v_new, pos, scaling)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"pos {pos} splits {splits}")
