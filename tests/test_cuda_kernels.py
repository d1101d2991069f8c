"""CUDA kernels on a GPU (``gpu`` marker, skipped without one): every kernel matches the float64 reference for
every option, writes every output, repeats bit for bit and runs under CUDA graph capture."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from w4pack.canonical import CanonicalLayer, default_g_idx
from w4pack.dtypes import from_float32, to_float64
from w4pack.layout import pack
from w4pack.native import cuda

# switches the native planner reads at each call (A/B runs, tests); the build's own variables are left alone
_BUILD_VARS = {"W4P_CUDA_ARCHS", "W4P_CUDA_FORCE", "W4P_CUDA_OUT", "W4P_CUDA_DEFINES", "W4P_CUDA_DEBUG"}


@pytest.fixture(autouse=True)
def _no_planner_switches(monkeypatch):
    """Each test starts from the planner's own choices, whatever the shell or an earlier test left set."""
    import os

    for var in [v for v in os.environ if v.startswith("W4P_CUDA_") and v not in _BUILD_VARS]:
        monkeypatch.delenv(var)

# -- helpers -----------------------------------------------------------------------------------------------


def random_layer(rng: np.random.Generator, n: int, k: int, bits: int = 4, gs: int = 128, zero_mode: str = "none",
                 act_order: bool = False, scale_dtype: str = "float16", bias: bool = False) -> CanonicalLayer:
    """A layer with random codes, positive scales and (for int / float zero modes) random zero points."""
    g = 1 if gs == -1 else -(-k // gs)
    codes = rng.integers(0, 1 << bits, size=(n, k), dtype=np.uint8)
    s32 = (rng.uniform(0.5, 1.5, size=(n, g)) * (0.02 if bits == 4 else 0.002)).astype(np.float32)
    scales = s32.astype(np.float16) if scale_dtype == "float16" else (
        from_float32(s32, "bfloat16") if scale_dtype == "bfloat16" else s32)
    zeros = None
    if zero_mode == "int":
        zeros = rng.integers(0, (1 << bits) + 1, size=(n, g)).astype(np.int32)
    elif zero_mode == "float":
        m32 = (rng.uniform(-1, 1, size=(n, g)) * (0.1 if bits == 4 else 0.2)).astype(np.float32)
        zeros = m32.astype(np.float16) if scale_dtype == "float16" else (
            from_float32(m32, "bfloat16") if scale_dtype == "bfloat16" else m32)
    g_idx = default_g_idx(k, gs)
    if act_order and gs != -1:
        g_idx = g_idx[rng.permutation(k)].astype(np.int32)
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    return CanonicalLayer(codes=codes, scales=scales, bits=bits, group_size=gs, zero_mode=zero_mode, zeros=zeros,
                          g_idx=g_idx, scale_dtype=scale_dtype, bias=b).validate()


def reference(layer: CanonicalLayer, x64: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    y = x64 @ layer.dequantize(np.float64).T
    if bias is not None:
        y = y + bias
    return y


def rel_err(y, ref: np.ndarray) -> float:
    y64 = y.double().cpu().numpy()
    assert np.isfinite(y64).all(), "non-finite or unwritten outputs"
    return float(np.linalg.norm(y64 - ref) / np.linalg.norm(ref))


def tolerance(dtype_name: str) -> float:
    # fp16: weights rounded once to fp16 (2^-11) and fp16 output; bf16 rounds to 2^-8, so its output alone is ~1e-3
    return 1e-3 if dtype_name == "float16" else 8e-3


def run_case(torch, rng, layer: CanonicalLayer, m: int, dtype_name: str, kernel: str = "auto", splits: int = 0,
             lin=None, bias: bool = True):
    tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
    lin = lin or cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(m, layer.in_features, device="cuda").to(tdt)
    out = torch.full((m, layer.out_features), float("nan"), dtype=tdt, device="cuda")  # poisoned
    lin.forward(x, out=out, kernel=kernel, splits=splits)
    torch.cuda.synchronize()
    b = to_float64(layer.bias, layer.bias_dtype) if (layer.bias is not None and bias) else None
    return rel_err(out, reference(layer, x.double().cpu().numpy(), b))


# -- GPU ---------------------------------------------------------------------------------------------------

def bulk_ok() -> bool:
    """The bulk kernel needs the bulk copy engine (compute capability 9.0+)."""
    import torch

    return torch.cuda.get_device_capability() >= (9, 0)


BULK_CASES = ((1, "bulk"), (8, "bulk"), (13, "bulk"), (16, "bulk"))

OPTIONS = [
    (bits, zm, gs, act)
    for bits in (4, 8)
    for zm in ("none", "int", "float")
    for gs in (32, 64, 128, -1)
    for act in (False, True)
    if not (act and gs == -1)
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits,zero_mode,gs,act_order", OPTIONS)
def test_every_option_matches_float64(dtype_name, bits, zero_mode, gs, act_order):
    import torch

    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, bits, zero_mode, gs, act_order)).encode()))
    layer = random_layer(rng, 196, 576, bits=bits, gs=gs, zero_mode=zero_mode, act_order=act_order,
                         scale_dtype=dtype_name, bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    cases = ((1, "stream"), (7, "auto"), (19, "stream"), (40, "stream"), (3, "tiled"), (67, "tiled"), (200, "auto"),
             (1, "ring"), (5, "ring"), (8, "ring")) + (BULK_CASES if bulk_ok() else ())
    for m, kernel in cases + (((1, "gemv"), (1, "auto")) if bits == 4 and gemv_ok() else ()):
        err = run_case(torch, rng, layer, m, dtype_name, kernel=kernel, lin=lin)
        assert err <= tolerance(dtype_name), (m, kernel, err)


NARROW_OPTIONS = [(bits, zm, gs) for bits in (2, 3, 5, 6) for zm in ("none", "int", "float") for gs in (16, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits,zero_mode,gs", NARROW_OPTIONS)
def test_narrow_codes_use_their_own_zero(dtype_name, bits, zero_mode, gs):
    """2/3-bit codes in 4-bit fields and 5/6-bit codes in 8-bit fields (GGUF K-quants): a symmetric layer's
    zero is 2**(bits-1) of the source width, not the storage width's 8 or 128."""
    import torch

    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, bits, zero_mode, gs)).encode()))
    layer = random_layer(rng, 100, 512, bits=bits, gs=gs, zero_mode=zero_mode, act_order=False,
                         scale_dtype=dtype_name, bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    # stream, ring and bulk take group sizes that are multiples of 32 (the planner refuses 16)
    split_k = ((1, "stream"), (5, "ring")) + (((8, "bulk"),) if bulk_ok() else ()) if gs % 32 == 0 else ()
    for m, kernel in ((1, "auto"), (19, "tiled"), (67, "auto")) + split_k:
        err = run_case(torch, rng, layer, m, dtype_name, kernel=kernel, lin=lin)
        assert err <= tolerance(dtype_name), (m, kernel, err)


@pytest.mark.gpu
def test_odd_shapes_all_small_m():
    import torch

    rng = np.random.default_rng(1)
    layer = random_layer(rng, 196, 576, gs=64, zero_mode="int", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m in range(1, 68):
        for kernel in ("stream", "tiled") + (("ring",) if m <= 8 else ()) + (("bulk",) if m <= 16 and bulk_ok() else ()):
            assert run_case(torch, rng, layer, m, "float16", kernel=kernel, lin=lin) <= 1e-3, (m, kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs", [(10, 100, 32), (33, 1000, 128), (130, 4104, -1), (1, 64, 64)])
def test_padded_and_unaligned_shapes(n, k, gs):
    import torch

    rng = np.random.default_rng(n * k)
    layer = random_layer(rng, n, k, gs=gs, zero_mode="float", act_order=gs != -1, scale_dtype="float32")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    # fp32 scales and minima are rounded to fp16 for fp16 activations (docs/CUDA.md); with a handful of outputs
    # that can cancel, the error is measured against the scale of the sums, |x| . |W|^T
    w64 = layer.dequantize(np.float64)
    for m in (1, 9, 130):
        for kernel in ("stream", "tiled", "auto") + (("ring",) if m <= 8 else ()) + (("bulk",) if m <= 16 and bulk_ok() else ()):
            x = torch.randn(m, k, device="cuda").half()
            out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
            lin.forward(x, out=out, kernel=kernel)
            x64 = x.double().cpu().numpy()
            y64 = out.double().cpu().numpy()
            assert np.isfinite(y64).all()
            err = np.linalg.norm(y64 - x64 @ w64.T) / np.linalg.norm(np.abs(x64) @ np.abs(w64).T)
            assert err <= 1e-3, (m, kernel, err)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64, 100])
def test_forced_splits(splits):
    import torch

    rng = np.random.default_rng(splits)
    layer = random_layer(rng, 256, 4096, gs=128)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    # for the ring kernel splits is the units (K tiles of 4 stripes) per warp, KT = 64 here: 1..7 share every
    # quad among warps, 64 gives whole quads, 100 ranges with a whole quad between two shared ones
    for m, kernel in ((1, "stream"), (24, "stream"), (96, "tiled"), (1, "ring"), (8, "ring"), (3, "ring")):
        assert run_case(torch, rng, layer, m, "float16", kernel=kernel, splits=splits, lin=lin) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(256, 4096), (4096, 4096), (1000, 9000), (2048, 512), (64, 28672)])
@pytest.mark.parametrize("stages", [0, 2, 3, 5])
def test_bulk_kernel_ranges_and_stages(n, k, stages, monkeypatch):
    # stream-K over one block per SM: these shapes give quads shared by up to 8 blocks, ranges that span
    # several quads, a K that is not a multiple of the unit, and a grid smaller than the GPU
    import torch

    if not bulk_ok():
        pytest.skip("the bulk kernel needs compute capability 9.0")
    if stages == 5:  # five stages fit one block's shared memory with units of 8 tiles only (up to M = 16)
        monkeypatch.setenv("W4P_CUDA_BULK_CT", "8")
    rng = np.random.default_rng(n + k + stages)
    layer = random_layer(rng, n, k, gs=128, zero_mode="int", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m in (1, 6, 11, 16):
        assert lin.plan(m, kernel="bulk", splits=stages)["kernel"] == cuda.KERNELS["bulk"]
        assert run_case(torch, rng, layer, m, "float16", kernel="bulk", splits=stages, lin=lin) <= 1e-3, m


@pytest.mark.gpu
@pytest.mark.parametrize("ct", ["8", "12", "16"])
@pytest.mark.parametrize("dtype_name,zero_mode,gs,act_order", [("float16", "int", 128, False),
                                                               ("bfloat16", "float", 32, True),
                                                               ("float16", "none", 64, False),
                                                               ("bfloat16", "int", 96, True),
                                                               ("float16", "float", -1, False)])
def test_bulk_kernel_unit_sizes_and_granules(ct, dtype_name, zero_mode, gs, act_order, monkeypatch):
    # every unit size on every option, stream-K over single tiles and over whole units: K not a multiple of the
    # unit (units of 12 tiles straddle groups of 128 and 96), quads shared by several blocks, ranges that start
    # and end inside units, forced stage counts
    import torch

    if not bulk_ok():
        pytest.skip("the bulk kernel needs compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_BULK_CT", ct)
    rng = np.random.default_rng(zlib.crc32(repr((ct, dtype_name, zero_mode, gs, act_order)).encode()))
    for n, k in ((1000, 9000), (196, 576), (4096, 2880)):
        layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                             bias=True)
        for granule in ("tile", "unit"):
            monkeypatch.setenv("W4P_CUDA_BULK_GRANULE", granule)
            lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))  # (a layer caches its plans)
            for m, stages in ((1, 0), (2, 0), (3, 3), (5, 0), (8, 0), (1, 2)):
                detail = lin.plan(m, kernel="bulk", splits=stages)["detail"]
                assert f"unit={ct} " in detail and (" granule=1 " in detail) == (granule == "tile"), detail
                err = run_case(torch, rng, layer, m, dtype_name, kernel="bulk", splits=stages, lin=lin)
                assert err <= tolerance(dtype_name), (n, k, granule, m, stages, err)


def gemv_ok() -> bool:
    """The gemv kernel runs mma.sync: compute capability 8.0 and newer."""
    import torch

    return torch.cuda.get_device_capability() >= (8, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 32, True), ("float", 64, False),
                                                    ("none", -1, False), ("int", 96, False), ("float", 32, True),
                                                    ("int", 128, True), ("none", 32, False), ("int", 256, False),
                                                    ("float", 512, False)])
def test_gemv_kernel(dtype_name, zero_mode, gs, act_order):
    # whole stripes per block, summed in warp order: odd shapes (rows past N, K past the last full tile, fewer tiles
    # than a step, a stripe count under and over the grid), bias, an unaligned activation row (staged element by
    # element), the float64 reference, repeats and graph replays bit-identical (auto's choice: test_plan_for_gemv);
    # every group segment length: whole chunks (per channel, groups of 128, 256, 512), tiles (64) and halves (32, 96)
    import torch

    if not gemv_ok():
        pytest.skip("the gemv kernel needs compute capability 8.0")
    rng = np.random.default_rng(zlib.crc32(repr(("gemv", dtype_name, zero_mode, gs, act_order)).encode()))
    tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
    for n, k in ((196, 576), (600, 1000), (17, 64), (4100, 2880), (9000, 4160), (40, 12000)):
        layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                             bias=True)
        lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
        detail = lin.plan(1, kernel="gemv")["detail"]
        assert detail.startswith("gemv ") and f" stripes={-(-n // 16)} " in detail, detail
        err = run_case(torch, rng, layer, 1, dtype_name, kernel="gemv", lin=lin)
        assert err <= tolerance(dtype_name), (n, k, err)
        wide = torch.randn(1, k + 3, device="cuda").to(tdt)
        x = wide[:, 3:]  # 6 bytes past a 16-byte boundary
        ref = reference(layer, x.double().cpu().numpy(), to_float64(layer.bias, layer.bias_dtype))
        out = torch.full((1, n), float("nan"), dtype=tdt, device="cuda")
        lin.forward(x, out=out, kernel="gemv")
        assert rel_err(out, ref) <= tolerance(dtype_name), (n, k)
        _repeats_and_replays(torch, lin, torch.randn(1, k, device="cuda").to(tdt), 3, 2, kernel="gemv")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 32, True), ("float", 64, False),
                                                    ("none", -1, False), ("int", 96, False), ("float", 512, False)])
def test_gemv_kernel_tokens(dtype_name, zero_mode, gs, act_order):
    # up to 8 tokens, one per MMA column: each token's row bit-identical to that row alone through the gemv kernel
    # (the columns do not mix, and the order of every sum is the one-token kernel's), against the float64 reference;
    # rows of x and y strided and x unaligned (staged element by element) or contiguous (16-byte loads), odd shapes
    # (rows past N, K past the last full tile, a stripe count under and over the grid, K = 12000 staged 8 times where
    # a block's shared memory holds it: H100 and H200), no write past N, repeats and graph replays bit-identical
    import torch

    if not gemv_ok():
        pytest.skip("the gemv kernel needs compute capability 8.0")
    rng = np.random.default_rng(zlib.crc32(repr(("gemv-m", dtype_name, zero_mode, gs, act_order)).encode()))
    tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
    optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    for (n, k), m in zip(((196, 576), (600, 1000), (17, 64), (4100, 2880), (9000, 4160), (40, 12000)),
                         (2, 8, 3, 5, 8, 8)):
        layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                             bias=True)
        lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
        if k == 12000 and optin < 8 * (2048 + 188 * 128 + 16):  # (sm_80 to sm_89: fewer rows of it fit)
            m = 2
        assert lin.plan(m, kernel="gemv")["detail"].startswith("gemv "), (n, k, m)
        wide = torch.randn(m, k + 3, device="cuda").to(tdt)
        x = wide[:, 3:]  # rows k + 3 apart, 6 bytes past a 16-byte boundary
        ref = reference(layer, x.double().cpu().numpy(), to_float64(layer.bias, layer.bias_dtype))
        full = torch.full((m, n + 5), float("nan"), dtype=tdt, device="cuda")  # poisoned, rows n + 5 apart
        out = full[:, :n]
        lin.forward(x, out=out, kernel="gemv")
        assert rel_err(out, ref) <= tolerance(dtype_name), (n, k, m)
        assert torch.isnan(full[:, n:]).all(), (n, k, m)
        for i in range(m):
            assert torch.equal(out[i:i + 1], lin.forward(x[i:i + 1], kernel="gemv")), (n, k, m, i)
        # aligned rows are staged 16 bytes a load (without act-order): the same values, the same outputs
        assert torch.equal(lin.forward(x.contiguous(), kernel="gemv"), out), (n, k, m)
        _repeats_and_replays(torch, lin, x.contiguous(), 2, 2, kernel="gemv")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("int", 128, False), ("none", 32, True), ("float", 64, False),
                                                    ("none", -1, False), ("int", 96, True)])
def test_gemv_row_prologues(dtype_name, zero_mode, gs, act_order):
    # forward_row: transformers' RMSNorm of the row (float32 root mean square, rounded, times the weight, rounded)
    # or the SwiGLU of [gate | up] (silu in float32, rounded, times up, rounded) applied in the gemv kernel's
    # staging, plus a residual added after the product's rounding (bit for bit the unfolded add); against the
    # float64 reference of what torch computes for them, odd shapes (K past the last tile, rows past N), layers
    # with and without an own bias, each with and without a residual, a quiet row where the epsilon sets the
    # scale, repeats and graph replays bit-identical
    import torch

    if not gemv_ok():
        pytest.skip("the gemv kernel needs compute capability 8.0")
    rng = np.random.default_rng(zlib.crc32(repr(("row", dtype_name, zero_mode, gs, act_order)).encode()))
    tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 30)))

    def rmsnorm(h, w, eps):  # LlamaRMSNorm
        h32 = h.float()
        return w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(tdt)

    def swiglu(gu, k):
        return torch.nn.functional.silu(gu[:, :k]) * gu[:, k:]

    for n, k in ((196, 576), (600, 1000), (17, 64), (4100, 2880), (40, 12000)):
        layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                             bias=n not in (17, 4100))  # (without an own bias the residual takes W4P_ROW_RESIDUAL)
        lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
        assert lin.row_ok()
        h = (torch.randn(1, k, device="cuda", generator=gen) * 3 + 0.5).to(tdt)
        w = (torch.rand(k, device="cuda", generator=gen) + 0.5).to(tdt)
        gu = (torch.randn(1, 2 * k, device="cuda", generator=gen) * 2).to(tdt)
        res = torch.randn(n, device="cuda", generator=gen).to(tdt)
        own = to_float64(layer.bias, layer.bias_dtype) if layer.bias is not None else None
        eps = 1e-5
        cases = (("rmsnorm", h, dict(norm_weight=w, eps=eps), rmsnorm(h, w, eps)), ("swiglu", gu, {}, swiglu(gu, k)),
                 ("plain", h, {}, h))
        for prologue, x, kw, xf in cases:
            for residual, extra in ((None, 0.0), (res, res.double().cpu().numpy())):
                ref = reference(layer, xf.double().cpu().numpy(), own) + extra
                got = lin.forward_row(x, prologue, residual=residual, **kw)
                assert got.shape == (1, n) and got.dtype == tdt
                assert rel_err(got, ref) <= tolerance(dtype_name), (n, k, prologue, residual is None)
                if residual is not None:  # the unfolded layer's residual + proj(x), to the bit
                    assert torch.equal(got, lin.forward_row(x, prologue, **kw) + residual), (n, k, prologue)
                # a row 2 bytes off 16-byte alignment is staged one pair a trip, an aligned one 8 values a load:
                # the same values, so the same outputs to the bit
                off = torch.empty(1, x.shape[1] + 1, device="cuda", dtype=tdt)[:, 1:]
                off.copy_(x)
                kw_off = dict(kw)
                if "norm_weight" in kw:
                    kw_off["norm_weight"] = torch.empty(k + 1, device="cuda", dtype=tdt)[1:].copy_(w)
                assert torch.equal(lin.forward_row(off, prologue, residual=residual, **kw_off), got), (n, k, prologue)

            class Row:  # the call as _repeats_and_replays makes it
                def forward(self, x, out=None, prologue=prologue, kw=kw):
                    return lin.forward_row(x, prologue, residual=res, out=out, **kw)

            _repeats_and_replays(torch, Row(), x, 2, 2)
    # a quiet row with a large epsilon: the epsilon sets most of the scale (dropped or misplaced, it shows)
    h = (torch.randn(1, k, device="cuda", generator=gen) * 1e-2).to(tdt)
    ref = reference(layer, rmsnorm(h, w, 1e-3).double().cpu().numpy(), own)
    assert rel_err(lin.forward_row(h, "rmsnorm", w, 1e-3), ref) <= tolerance(dtype_name)


@pytest.mark.gpu
def test_gemv_row_refuses_what_it_cannot_run():
    import torch

    from w4pack.errors import BadInputError

    rng = np.random.default_rng(11)
    lin8 = cuda.CudaPackedLinear(pack(random_layer(rng, 64, 256, bits=8)), "cuda")
    assert not lin8.row_ok()  # (8-bit storage: the gemv kernel takes 4-bit layers)
    lin = cuda.CudaPackedLinear(pack(random_layer(rng, 64, 256)), "cuda")
    h = torch.randn(1, 256, device="cuda", dtype=torch.float16)
    w = torch.ones(256, device="cuda", dtype=torch.float16)
    with pytest.raises(BadInputError, match="one row of 256"):
        lin.forward_row(torch.randn(2, 256, device="cuda", dtype=torch.float16), "rmsnorm", w, 1e-6)
    with pytest.raises(BadInputError, match="one row of 512"):
        lin.forward_row(h, "swiglu")
    with pytest.raises(BadInputError, match="norm_weight"):
        lin.forward_row(h, "rmsnorm", w[:100], 1e-6)
    with pytest.raises(BadInputError, match="residual"):
        lin.forward_row(h, "rmsnorm", w, 1e-6, residual=torch.zeros(63, device="cuda", dtype=torch.float16))
    with pytest.raises(BadInputError, match="prologue 'gelu'"):
        lin.forward_row(h, "gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name,zero_mode,gs,act_order", [("float16", "int", 128, False),
                                                               ("bfloat16", "float", 32, True),
                                                               ("float16", "none", -1, False),
                                                               ("bfloat16", "int", 96, False),
                                                               ("float16", "int", 64, True)])
def test_bulk_kernel_single_stripes(dtype_name, zero_mode, gs, act_order, monkeypatch):
    # units of one stripe (eight warps share its K range and sum in warp order): the planner's choice on small
    # layers, forced (W4P_CUDA_BULK_QS=1) on 6000 x 2048 (375 stripes: four-stripe units otherwise) and on
    # 1000 x 9000; granules of single tiles, whole units and whole stripes (stripes then shared by several
    # blocks, or not at all), M up to 8, repeated calls bit-identical
    import torch

    if not bulk_ok():
        pytest.skip("the bulk kernel needs compute capability 9.0")
    for var in ("W4P_CUDA_BULK_CT", "W4P_CUDA_BULK_GRANULE"):
        monkeypatch.delenv(var, raising=False)
    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, zero_mode, gs, act_order)).encode()))
    for n, k, forced in ((196, 4160, False), (4096, 2880, False), (1000, 9000, True), (6000, 2048, True)):
        layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                             bias=True)
        if forced:
            monkeypatch.setenv("W4P_CUDA_BULK_QS", "1")
        else:
            monkeypatch.delenv("W4P_CUDA_BULK_QS", raising=False)
        for granule in ("tile", "unit", "quad", None):
            if granule:
                monkeypatch.setenv("W4P_CUDA_BULK_GRANULE", granule)
            else:
                monkeypatch.delenv("W4P_CUDA_BULK_GRANULE", raising=False)
            lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
            for m, stages in ((1, 0), (2, 3), (4, 2), (3, 0)) + (((8, 0), (6, 4)) if forced else ()):
                detail = lin.plan(m, kernel="bulk", splits=stages)["detail"]
                assert " stripes=1 " in detail and "unit=32 " in detail, detail
                err = run_case(torch, rng, layer, m, dtype_name, kernel="bulk", splits=stages, lin=lin)
                assert err <= tolerance(dtype_name), (n, k, granule, m, stages, err)
            tdt = torch.float16 if dtype_name == "float16" else torch.bfloat16
            x = torch.randn(3, k, device="cuda").to(tdt)
            first = lin.forward(x, kernel="bulk")
            for _ in range(5):
                assert torch.equal(lin.forward(x, kernel="bulk"), first)
            monkeypatch.setenv("W4P_CUDA_GEMV", "0")  # (auto's bulk plan: gemv takes 4096 x 2880 at M = 3 first)
            assert " stripes=1 " in lin.plan(3, kernel="auto")["detail"] or forced
            monkeypatch.delenv("W4P_CUDA_GEMV")


def wgmma_ok() -> bool:
    """The wgmma kernel is built for sm_90a: compute capability 9.0 exactly."""
    import torch

    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 32, False),
                                                    ("int", -1, False), ("none", 128, True), ("int", 96, False),
                                                    ("float", 16, True), ("int", 192, False),
                                                    ("none", 48, False)])
@pytest.mark.parametrize("kernel", ["wgmma", "wgmma_ws"])
def test_wgmma_kernel(dtype_name, zero_mode, gs, act_order, kernel):
    # weights scaled in the activation dtype before the MMA (one more rounding than the other kernels): the
    # same tolerances hold for a K of a few hundred
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, zero_mode, gs, act_order)).encode()))
    layer = random_layer(rng, 196, 576, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    # splits: split-K count (0: enough blocks for every SM; K = 576 is 9 tiles, so 1 here), tiles of 64 tokens up
    # to M = 64, else 128
    for m, splits in ((1, 0), (17, 0), (64, 0), (128, 0), (129, 0), (300, 0), (65, 2), (40, 3), (200, 9), (5, 4)):
        plan = lin.plan(m, kernel=kernel, splits=splits)
        assert plan["kernel"] == cuda.KERNELS[kernel]
        assert plan["splits"] == (splits or 1)
        err = run_case(torch, rng, layer, m, dtype_name, kernel=kernel, splits=splits, lin=lin)
        assert err <= tolerance(dtype_name), (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("int", 128, False), ("float", 32, True), ("none", -1, False),
                                                    ("int", 48, False)])
@pytest.mark.parametrize("variant", [("W4P_CUDA_WGMMA_AS", "1"), ("W4P_CUDA_WGMMA_KP", "2")])
def test_wgmma_kernel_variants(dtype_name, zero_mode, gs, act_order, variant, monkeypatch):
    # the tuning variants (A through shared memory; two K tiles per step), read by the planner at each call
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    monkeypatch.setenv(*variant)
    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, zero_mode, gs, act_order, variant)).encode()))
    layer = random_layer(rng, 196, 576, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    for m, splits in ((1, 0), (33, 0), (64, 2), (17, 5), (90, 0), (130, 3)):
        err = run_case(torch, rng, layer, m, dtype_name, kernel="wgmma", splits=splits, lin=lin)
        assert err <= tolerance(dtype_name), (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs", [(200, 600, 128), (64, 100, 32), (1000, 1000, -1), (136, 4160, 64)])
@pytest.mark.parametrize("kernel", ["wgmma", "wgmma_ws"])
def test_wgmma_kernel_ragged_shapes(n, k, gs, kernel):
    # K not a multiple of 64 (the activations gathered and zero-padded to whole tiles, the padded tail's own
    # group), N not a multiple of the 128-row block, and forced split counts over short K ranges
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    rng = np.random.default_rng(n * 7 + k)
    layer = random_layer(rng, n, k, gs=gs, zero_mode="int", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m, splits in ((1, 0), (40, 0), (64, 2), (129, 0), (70, 3)):
        err = run_case(torch, rng, layer, m, "float16", kernel=kernel, splits=splits, lin=lin)
        assert err <= 1e-3, (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 128, False),
                                                    ("int", -1, False), ("float", 192, True), ("int", 256, False)])
def test_wgmma_ss_kernel(dtype_name, zero_mode, gs, act_order):
    # the tokens as A, the weights dequantized into shared memory as B (group sizes of whole K tiles): 64-token
    # blocks up to M = 64, else 128; N = 196 leaves most of the 256-row block empty; K = 576 and 9 tiles make the
    # 64-token blocks' two-tile stages end on a single tile; forced splits over short K ranges
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma_ss kernel needs compute capability 9.0")
    rng = np.random.default_rng(zlib.crc32(repr(("ss", dtype_name, zero_mode, gs, act_order)).encode()))
    layer = random_layer(rng, 196, 576, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    for m, splits in ((1, 0), (17, 0), (64, 0), (65, 0), (128, 0), (129, 0), (300, 0), (65, 2), (40, 3), (200, 9),
                      (5, 4)):
        plan = lin.plan(m, kernel="wgmma_ss", splits=splits)
        assert plan["kernel"] == cuda.KERNELS["wgmma_ss"]
        assert plan["splits"] == (splits or 1)
        err = run_case(torch, rng, layer, m, dtype_name, kernel="wgmma_ss", splits=splits, lin=lin)
        assert err <= tolerance(dtype_name), (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gs,bias", [(200, 600, 128, True), (64, 100, 64, True), (1000, 1000, -1, True),
                                         (272, 4160, 64, True), (4096, 2048, 128, True), (199, 640, 128, False),
                                         (130, 40, -1, True)])
def test_wgmma_ss_kernel_ragged_and_large(n, k, gs, bias):
    # K not a multiple of 64 (zero-filled by TMA), N not a multiple of the 256-row block, a row tile of one
    # stripe (272 = 256 + 16), whole blocks (4096 rows), an odd N without bias (the last row's unpaired store),
    # a single K tile (K = 40: the 64-token tile's two-tile code box reaches past K); an output with an odd row
    # stride (unpaired stores throughout) must hold the same values
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma_ss kernel needs compute capability 9.0")
    rng = np.random.default_rng(n * 11 + k)
    layer = random_layer(rng, n, k, gs=gs, zero_mode="int", bias=bias)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m, splits in ((1, 0), (40, 0), (64, 2), (129, 0), (70, 3), (256, 0), (513, 0)):
        err = run_case(torch, rng, layer, m, "float16", kernel="wgmma_ss", splits=splits, lin=lin)
        assert err <= 1e-3, (m, splits, err)
    x = torch.randn(200, k, device="cuda", dtype=torch.float16)
    first = lin.forward(x, kernel="wgmma_ss")
    for _ in range(20):
        assert torch.equal(lin.forward(x, kernel="wgmma_ss"), first)
    wide = torch.full((200, n + 1), float("nan"), dtype=torch.float16, device="cuda")
    lin.forward(x, kernel="wgmma_ss", out=wide[:, :n])
    assert torch.equal(wide[:, :n], first) and torch.isnan(wide[:, n]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tok", ["64", "128"])
def test_wgmma_ss_token_tiles_forced(tok, monkeypatch):
    # W4P_CUDA_SS_TOK forces the token tile: 128 at small M (one warpgroup's tokens all past M), 64 at large M
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma_ss kernel needs compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_SS_TOK", tok)
    rng = np.random.default_rng(int(tok))
    layer = random_layer(rng, 600, 1280, gs=128, zero_mode="float", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=("bfloat16",))
    # 3 row blocks x 2 token blocks of 64 at M = 100, or x 1 of 128
    assert " tiles=%d " % (6 if tok == "64" else 3) in lin.plan(100, kernel="wgmma_ss")["detail"]
    for m, splits in ((3, 0), (64, 0), (100, 2), (257, 0)):
        err = run_case(torch, rng, layer, m, "bfloat16", kernel="wgmma_ss", splits=splits, lin=lin)
        assert err <= tolerance("bfloat16"), (m, splits, err)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["wgmma_ws", "wgmma_ss"])
def test_split_sums_in_a_cluster_match_the_workspace(kernel, monkeypatch):
    # up to 8 splits of a tile are launched as one cluster and summed in shared memory; W4P_CUDA_CLUSTER=0 (or
    # more than 8 splits) sums them through the workspace. Both add the same fp32 partials in split order, so the
    # outputs must be bit-identical; odd N (row quads past N), tokens past M, bias
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    rng = np.random.default_rng(7 if kernel == "wgmma_ws" else 8)
    layer = random_layer(rng, 1002, 2560, gs=128, zero_mode="int", bias=True)
    packed = pack(layer)
    in_cluster = cuda.CudaPackedLinear(packed, "cuda")
    monkeypatch.setenv("W4P_CUDA_CLUSTER", "0")
    via_workspace = cuda.CudaPackedLinear(packed, "cuda")
    for m in (1, 70, 200):
        x = torch.randn(m, 2560, device="cuda", dtype=torch.float16)
        for splits in (2, 3, 5, 8):
            monkeypatch.setenv("W4P_CUDA_CLUSTER", "0")
            assert "sum=workspace" in via_workspace.plan(m, kernel=kernel, splits=splits)["detail"]
            want = via_workspace.forward(x, kernel=kernel, splits=splits)
            monkeypatch.delenv("W4P_CUDA_CLUSTER")
            plan = in_cluster.plan(m, kernel=kernel, splits=splits)
            assert "sum=cluster" in plan["detail"] and plan["splits"] == splits, plan
            got = in_cluster.forward(x, kernel=kernel, splits=splits)
            assert torch.equal(got, want), (m, splits)
            for _ in range(3):
                assert torch.equal(in_cluster.forward(x, kernel=kernel, splits=splits), got)
        assert "sum=workspace" in in_cluster.plan(m, kernel=kernel, splits=9)["detail"]
        assert run_case(torch, rng, layer, m, "float16", kernel=kernel, splits=5, lin=in_cluster) <= 1e-3


def _repeats_and_replays(torch, lin, x, repeats: int, replays: int, **kw):
    """The call on x, then `repeats` more and `replays` replays of it captured in a CUDA graph (output poisoned before
    each), all bit-identical to the first."""
    first = lin.forward(x, **kw)
    for _ in range(repeats):
        assert torch.equal(lin.forward(x, **kw), first)
    if not replays:
        return
    out = torch.empty_like(first)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin.forward(x, out=out, **kw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        lin.forward(x, out=out, **kw)
    for _ in range(replays):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


def _row_blocks(monkeypatch, env, markers, dtype_name, zero_mode, gs, act_order, cases, replays):
    """wgmma_ws forced by the switches `env` to the blocks whose plan says each of `markers`, on 600 rows past the last
    block's end and K = 1000 (not a multiple of 64), against the float64 reference for each (M, splits) case; then
    repeats and graph replays."""
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    rng = np.random.default_rng(zlib.crc32(repr((markers, env, dtype_name, zero_mode, gs, act_order)).encode()))
    layer = random_layer(rng, 600, 1000, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    for m, splits in cases:
        plan = lin.plan(m, dtype_name, kernel="wgmma_ws", splits=splits)
        assert all(w in plan["detail"] for w in markers) and plan["splits"] == (splits or plan["splits"]), plan
        err = run_case(torch, rng, layer, m, dtype_name, kernel="wgmma_ws", splits=splits, lin=lin)
        assert err <= tolerance(dtype_name), (m, splits, err)
    x = torch.randn(150, 1000, device="cuda", dtype=getattr(torch, dtype_name))
    _repeats_and_replays(torch, lin, x, 5, replays, kernel="wgmma_ws", splits=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 32, False),
                                                    ("int", -1, False), ("float", 16, True), ("int", 192, False),
                                                    ("none", 48, False)])
def test_wgmma_ws_256_row_blocks(dtype_name, zero_mode, gs, act_order, monkeypatch):
    # W4P_CUDA_WS_RS=2: the 128-token tile in 256-row blocks (a warp's two stripes 128 rows apart, the producer
    # warpgroup's registers handed to the consumers); N past the last block's rows, K not a multiple of 64, unsplit
    # and with splits summed in a cluster (2-8) and through the workspace (9); repeated calls bit-identical
    _row_blocks(monkeypatch, {"W4P_CUDA_WS_RS": "2"}, ("rows=256",), dtype_name, zero_mode, gs, act_order,
                ((65, 0), (128, 0), (200, 2), (300, 3), (129, 9), (97, 5)), replays=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 32, False),
                                                    ("int", -1, False), ("float", 16, True), ("none", 48, False)])
def test_wgmma_ws_192_row_blocks(dtype_name, zero_mode, gs, act_order, monkeypatch):
    # W4P_CUDA_WS_ROWS=192: the 128-token tile in 192-row blocks (three consumer warpgroups, 13 warps); 600 rows
    # end 24 rows into the fourth block, K = 1000 is not a multiple of 64; unsplit and with splits summed in a
    # cluster (2-8) and through the workspace (9); repeated calls and a graph replay bit-identical
    _row_blocks(monkeypatch, {"W4P_CUDA_WS_ROWS": "192"}, ("rows=192",), dtype_name, zero_mode, gs, act_order,
                ((65, 0), (128, 0), (256, 1), (200, 2), (300, 3), (129, 9), (97, 5)), replays=1)


@pytest.mark.gpu
@pytest.mark.parametrize("ks", ["1", "2"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("zero_mode,gs,act_order", [("none", 128, False), ("int", 64, True), ("float", 32, False),
                                                    ("int", -1, False), ("float", 16, True), ("none", 48, False)])
def test_wgmma_ws_256_token_tile(ks, dtype_name, zero_mode, gs, act_order, monkeypatch):
    # W4P_CUDA_WS_TOK=256: 128-row blocks of 256 tokens (one m64n256 wgmma per slice, the producer warpgroup's
    # registers handed to the consumers), one or two K tiles a stage; tokens past M in the last tile, 600 rows end
    # 88 rows into the fifth block, K = 1000 not a multiple of 64; unsplit and with splits summed in a cluster (2-8)
    # and through the workspace (9); repeated calls and a graph replay bit-identical
    smem = {"1": "smem=229376", "2": "smem=190464"}[ks]  # five stages of one K tile, or two of two
    _row_blocks(monkeypatch, {"W4P_CUDA_WS_TOK": "256", "W4P_CUDA_WS_TOK_KS": ks}, ("tokens=256", smem), dtype_name,
                zero_mode, gs, act_order, ((129, 0), (256, 0), (300, 1), (513, 0), (257, 2), (400, 3), (200, 9),
                                           (600, 5)), replays=1)


@pytest.mark.gpu
@pytest.mark.parametrize("env,m,splits", [({}, 129, 0), ({}, 300, 3), ({"W4P_CUDA_WS_TOK": "256"}, 257, 0),
                                          ({"W4P_CUDA_WS_TOK": "256"}, 600, 2), ({"W4P_CUDA_WS_ROWS": "192"}, 300, 0),
                                          ({"W4P_CUDA_WS_ROWS": "256"}, 129, 9)])
def test_wgmma_ws_last_token_tile_box(env, m, splits, monkeypatch):
    # a last token tile that ends past M is copied as one box of its rows (8 to 128, a power of two), and the tile's
    # other rows keep what the stage held before: here the infinities and NaNs of the call before, which must reach
    # no stored output (1, 44, 1, 88, 44 and 1 rows of 128, 128, 256, 256, 128 and 128 tokens)
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    rng = np.random.default_rng(zlib.crc32(repr(("tail", env, m)).encode()))
    layer = random_layer(rng, 600, 1000, gs=64, zero_mode="int", scale_dtype="float16", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=("float16",))
    bad = torch.full((768, 1000), float("nan"), device="cuda", dtype=torch.float16)
    bad[::3] = float("inf")
    for _ in range(3):  # non-finite rows in the stages: 270, 135, 216 or 162 blocks, more than an H200's SMs
        lin.forward(bad, kernel="wgmma_ws", splits=9)
    err = run_case(torch, rng, layer, m, "float16", kernel="wgmma_ws", splits=splits, lin=lin)
    assert err <= tolerance("float16"), err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name,zero_mode,gs,act_order,n,k,ms", [
    ("float16", "none", 128, False, 600, 1000, (65, 128, 300)),      # 8 stages a tile, 1-8 blocks a tile
    ("bfloat16", "int", 64, True, 1000, 1000, (97, 256)),
    ("float16", "float", 32, False, 16384, 512, (600,)),            # runs of whole tiles between partial ends
    ("float16", "int", -1, False, 4000, 3000, (129, 1000)),         # stages ending mid-tile (47 K tiles)
    ("bfloat16", "none", 48, False, 2000, 2000, (200,)),
])
def test_wgmma_ws_stream_k(dtype_name, zero_mode, gs, act_order, n, k, ms, monkeypatch):
    # W4P_CUDA_WS_SK=1: the 256-row blocks as stream-K (runs of stages across tiles, the partial tiles summed in
    # block order); poisoned outputs fully written, tokens and rows past the ends, bias; repeated calls and graph
    # replays bit-identical
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_WS_RS", "2")
    monkeypatch.setenv("W4P_CUDA_WS_SK", "1")
    rng = np.random.default_rng(zlib.crc32(repr(("sk", dtype_name, zero_mode, gs, n, k)).encode()))
    layer = random_layer(rng, n, k, gs=gs, zero_mode=zero_mode, act_order=act_order, scale_dtype=dtype_name,
                         bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda", dtypes=(dtype_name,))
    for m in ms:
        plan = lin.plan(m, dtype_name, kernel="wgmma_ws")
        assert "stream-k=" in plan["detail"] and "rows=256" in plan["detail"], plan
        err = run_case(torch, rng, layer, m, dtype_name, kernel="wgmma_ws", lin=lin)
        assert err <= tolerance(dtype_name), (m, err)
    x = torch.randn(ms[-1], k, device="cuda", dtype=getattr(torch, dtype_name))
    _repeats_and_replays(torch, lin, x, 20, 3, kernel="wgmma_ws")


@pytest.mark.gpu
def test_wgmma_ws_stream_k_by_auto_and_its_workspace_fallback(monkeypatch):
    # auto takes stream-K on a layer whose 256-row grid leaves SMs idle (28672 rows: 224 tiles at M = 256 on an
    # H200's 132 SMs); a caller's workspace too small for its slots gets the plain grid instead, bit for bit
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_WS_TOK", "128")  # (the 256-token tile's rule takes this layer at M = 256)
    rng = np.random.default_rng(29)
    layer = random_layer(rng, 28672, 1216, gs=64, zero_mode="int", bias=True)  # 2^25.06 weights
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(256, 1216, device="cuda", dtype=torch.float16)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert "stream-k=132" in lin.plan(256)["detail"], lin.plan(256)
    got = lin.forward(x)
    monkeypatch.setenv("W4P_CUDA_WS_SK", "0")
    lin._plans.clear()
    plain_plan = lin.plan(256)
    assert "stream-k" not in plain_plan["detail"], plain_plan
    want = lin.forward(x)
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err <= 1e-3, err
    monkeypatch.delenv("W4P_CUDA_WS_SK")
    lin._plans.clear()
    small = torch.zeros(plain_plan["workspace_bytes"], dtype=torch.uint8, device="cuda")
    monkeypatch.setattr(cuda, "_workspace", lambda *args: small)
    assert torch.equal(lin.forward(x), want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,sk,ms", [("128", "0", (16, 40, 64, 200)), ("256", "0", (100, 256)),
                                        ("256", "1", (100, 300)), ("192", "0", (100, 256))])
def test_wgmma_ws_output_staging(rows, sk, ms, monkeypatch):
    # wgmma_ws stages its output tile in shared memory and writes y in 16-byte runs where y allows (a row stride that
    # is a multiple of 8 elements, a 16-byte aligned start), else element by element: the same bits either way, all
    # of y written (a ragged last run of rows, tokens past M) and nothing outside it
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    monkeypatch.setenv("W4P_CUDA_WS_ROWS", rows)
    monkeypatch.setenv("W4P_CUDA_WS_SK", sk)
    rng = np.random.default_rng(zlib.crc32(repr(("staging", rows, sk)).encode()))
    n, k = 1003, 1000
    layer = random_layer(rng, n, k, gs=128, zero_mode="int", bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    splits = 0 if sk == "1" else 1
    for m in ms:
        plan = lin.plan(m, kernel="wgmma_ws", splits=splits)
        tiled = m > 64 and rows != "128"  # (the smaller token tiles keep 128-row blocks, which print no rows=)
        assert (f"rows={rows}" in plan["detail"] if tiled else "rows=" not in plan["detail"]), plan
        assert ("stream-k" in plan["detail"]) == (sk == "1"), plan
        assert plan["splits"] == 1, plan
        err = run_case(torch, rng, layer, m, "float16", kernel="wgmma_ws", splits=splits, lin=lin)
        assert err <= 1e-3, (m, err)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        runs = torch.full((m, 1008), float("nan"), dtype=torch.float16, device="cuda")  # 16-byte runs
        lin.forward(x, out=runs[:, :n], kernel="wgmma_ws", splits=splits)
        odd = torch.full((m, n + 2), float("nan"), dtype=torch.float16, device="cuda")  # misaligned, odd stride
        lin.forward(x, out=odd[:, 1:n + 1], kernel="wgmma_ws", splits=splits)
        torch.cuda.synchronize()
        assert not torch.isnan(runs[:, :n]).any() and torch.isnan(runs[:, n:]).all()
        assert torch.isnan(odd[:, 0]).all() and torch.isnan(odd[:, n + 1]).all()
        assert torch.equal(odd[:, 1:n + 1], runs[:, :n]), m


PDL_CHAIN = (  # (M, kernel, splits, env, a word of its plan): every sm_90 kernel path, launched with programmatic
    # dependent launch: the bulk kernel's split sums through the workspace and its one-stripe units, wgmma_ws's
    # cluster and workspace split sums, wgmma_ss, stream-K, the plain grid, the gemv kernel (its activations staged
    # after the wait)
    (1, "gemv", 0, {}, "gemv"),
    (1, "bulk", 0, {"W4P_CUDA_BULK_QS": "4"}, "stripes=4"), (8, "bulk", 0, {"W4P_CUDA_BULK_QS": "1"}, "stripes=1"),
    (16, "wgmma_ws", 3, {}, "sum=cluster"), (64, "wgmma_ws", 2, {"W4P_CUDA_CLUSTER": "0"}, "sum=workspace"),
    (128, "wgmma_ss", 0, {}, "wgmma_ss"), (200, "wgmma_ws", 0, {"W4P_CUDA_WS_RS": "2", "W4P_CUDA_WS_SK": "1"},
                                           "stream-k="),
    (300, "wgmma_ws", 0, {"W4P_CUDA_WS_RS": "1"}, "splits=1"), (150, "wgmma_ws", 0, {"W4P_CUDA_WS_ROWS": "192"},
                                                                "rows=192"))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "2"])
def test_dependent_launches_wait_for_the_previous_kernel(pdl, monkeypatch):
    # With programmatic dependent launch a kernel starts while the one before it on the stream still runs. Calls
    # that read the previous call's output, or overwrite the buffer the previous call read, must see exactly what
    # they see with plain launches. The graph replays queue every call before any completes (eager calls may not:
    # Python's launch overhead can outlast a kernel)
    import torch

    if not wgmma_ok():
        pytest.skip("programmatic dependent launch is used by the sm_90 kernels")
    rng = np.random.default_rng(zlib.crc32(repr(("pdl", pdl)).encode()))
    n = k = 1536
    lins = [cuda.CudaPackedLinear(pack(random_layer(rng, n, k, gs=128, zero_mode="int", bias=True)), "cuda")
            for _ in range(2)]
    for m, kernel, splits, env, word in PDL_CHAIN:
        for other in PDL_CHAIN:  # only this entry's switches
            for key in other[3]:
                monkeypatch.delenv(key, raising=False)
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        x = (torch.randn(m, k, device="cuda") * 0.1).half()

        def chain(b, sync=False):
            # (input, output) per call: each reads the last call's output; after the second a plain torch kernel
            # (which does not trigger the next launch) rescales its output; the fifth overwrites the buffer the
            # fourth read, the sixth the first call's input
            for i, (src, dst) in enumerate(((0, 1), (1, 2), (2, 3), (3, 4), (4, 3), (3, 0))):
                lins[i % 2].forward(b[src], out=b[dst], kernel=kernel, splits=splits)
                if i == 1:
                    b[dst].mul_(0.01)
                if sync:
                    torch.cuda.synchronize()

        def fresh():
            return [x.clone()] + [torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
                                  for _ in range(4)]

        monkeypatch.setenv("W4P_CUDA_PDL", "0")
        ref = fresh()
        chain(ref, sync=True)  # one call at a time, plain launches
        assert all(torch.isfinite(r).all() for r in ref), (m, kernel)

        monkeypatch.setenv("W4P_CUDA_PDL", pdl)
        plan = lins[0].plan(m, kernel=kernel, splits=splits)
        assert plan["kernel"] == cuda.KERNELS[kernel] and word in plan["detail"], (m, plan)
        bufs = fresh()
        chain(bufs)
        torch.cuda.synchronize()
        for i in range(5):
            assert torch.equal(bufs[i], ref[i]), (m, kernel, i)

        bufs = fresh()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain(fresh())  # warm-up on the capture stream: its workspace is allocated outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            chain(bufs)
        for _ in range(2):
            for i in range(1, 5):
                bufs[i].fill_(float("nan"))
            bufs[0].copy_(x)
            g.replay()
            torch.cuda.synchronize()
            for i in range(5):
                assert torch.equal(bufs[i], ref[i]), ("graph", m, kernel, i)
        for key in env:
            monkeypatch.delenv(key)


@pytest.mark.gpu
def test_wgmma_kernel_large_and_repeatable():
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernel needs compute capability 9.0")
    rng = np.random.default_rng(17)
    layer = random_layer(rng, 1000, 4096, gs=128, zero_mode="int")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for kernel in ("wgmma", "wgmma_ws"):
        for m in (64, 256, 1000):
            assert run_case(torch, rng, layer, m, "float16", kernel=kernel, lin=lin) <= 1e-3, (kernel, m)
        x = torch.randn(200, 4096, device="cuda", dtype=torch.float16)
        first = lin.forward(x, kernel=kernel)
        for _ in range(5):
            assert torch.equal(lin.forward(x, kernel=kernel), first)


@pytest.mark.gpu
def test_large_shapes():
    import torch

    rng = np.random.default_rng(7)
    layer = random_layer(rng, 4096, 4096, gs=128, zero_mode="int")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m in (1, 16, 64, 300, 2048):
        assert run_case(torch, rng, layer, m, "float16", lin=lin) <= 1e-3, m
    assert run_case(torch, rng, layer, 1000, "bfloat16", lin=lin) <= 8e-3


@pytest.mark.gpu
def test_strided_input_and_explicit_bias():
    import torch

    rng = np.random.default_rng(3)
    layer = random_layer(rng, 96, 512, gs=128)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    wide = torch.randn(20, 520, device="cuda", dtype=torch.float16)
    x = wide[:, 3:515]  # row stride 520, not 16-byte aligned
    bias = torch.randn(96, device="cuda", dtype=torch.float16)
    y = lin.forward(x, bias=bias)
    ref = reference(layer, x.double().cpu().numpy(), bias.double().cpu().numpy())
    assert rel_err(y, ref) <= 1e-3
    # M <= 8 on unaligned rows: the ring kernel gathers them first
    assert rel_err(lin.forward(x[:7], bias=bias, kernel="ring"), ref[:7]) <= 1e-3
    if bulk_ok():
        assert rel_err(lin.forward(x[:13], bias=bias, kernel="bulk"), ref[:13]) <= 1e-3
    y3 = lin.forward(x.reshape(4, 5, 512), bias=False)
    assert y3.shape == (4, 5, 96)
    assert rel_err(y3.reshape(20, 96), reference(layer, x.double().cpu().numpy(), None)) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m,kernel", [(1, "stream"), (16, "stream"), (64, "tiled"), (1024, "tiled"), (256, "dense"),
                                      (1, "ring"), (8, "ring"), (4, "ring"), (1, "bulk"), (16, "bulk")])
def test_repeated_calls_are_bit_identical(m, kernel):
    import torch

    if kernel == "bulk" and not bulk_ok():
        pytest.skip("the bulk kernel needs compute capability 9.0")

    rng = np.random.default_rng(m)
    layer = random_layer(rng, 1024, 4096, gs=128, zero_mode="int")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
    if kernel != "bulk":  # (for the bulk kernel, splits are its stages; 1024 rows always share quads)
        assert lin.plan(m, kernel=kernel)["splits"] > 1 or m >= 256  # the split-K reduction is exercised
    first = lin.forward(x, kernel=kernel)
    for _ in range(20):
        assert torch.equal(lin.forward(x, kernel=kernel), first)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    import torch

    rng = np.random.default_rng(11)
    layer = random_layer(rng, 512, 2048, gs=64, zero_mode="float", act_order=True, bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    for m, kernel in ((1, "auto"), (24, "auto"), (48, "tiled"), (48, "auto"), (256, "auto"), (7, "ring"),
                      (2, "ring"), (1, "stream")) + (((1, "bulk"), (13, "bulk")) if bulk_ok() else ()):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
        eager = lin.forward(x, kernel=kernel)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lin.forward(x, kernel=kernel)  # warm-up on the capture stream (workspace allocated outside the capture)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = lin.forward(x, kernel=kernel)
        g.replay()
        torch.cuda.synchronize()
        dense = lin.plan(m, kernel=kernel)["kernel"] == cuda.KERNELS["dense"]

        def same(a, b):  # our kernels: bit-identical; the dense path's GEMM is cuBLAS's (may pick another algorithm)
            return torch.equal(a, b) if not dense else rel_err(a, b.double().cpu().numpy()) <= 1e-3

        assert same(y, eager), (m, kernel)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert same(y, lin.forward(x, kernel=kernel)), (m, kernel)


@pytest.mark.gpu
def test_auto_plan_per_shape():
    # small M: the ring kernel on 70B-sized layers, the stream kernel on small ones, dense from DENSE_MIN_M
    import torch

    ffi, lib = cuda._load()
    ko, so, wb = ffi.new("int *"), ffi.new("int *"), ffi.new("size_t *")

    def auto(m, n, k):
        assert lib.w4p_cuda_plan(0, m, n, k, 4, 128, 0, 1, 0, 0, ko, so, wb) == 0
        return ko[0]

    # sm_90+: the bulk kernel up to M = 4 on every shape, to 8 on layers of 2^25 weights or more and on those
    # of one-stripe units (at most two stripes per SM); otherwise (and before sm_90) ring / stream as measured
    m1 = cuda.KERNELS["bulk"] if bulk_ok() else None
    # (on sm_90 the gemv kernel first: at M = 1 and 2 from 32 stripes on 132 SMs, at M = 3-8 from 113, where its
    # blocks fill their rounds and the staged rows leave its blocks per SM: test_cuda_planner.py)
    g1 = cuda.KERNELS["gemv"] if torch.cuda.get_device_capability() == (9, 0) else None
    assert auto(1, 28672, 8192) == (g1 or m1 or cuda.KERNELS["ring"])
    assert auto(1, 4096, 4096) == (g1 or m1 or cuda.KERNELS["stream"])
    assert auto(1, 1024, 4096) == (g1 or m1 or cuda.KERNELS["stream"])  # 64 stripes: fewer than the SMs
    assert auto(2, 1024, 4096) == (g1 or m1 or cuda.KERNELS["stream"])
    assert auto(3, 1024, 4096) == (m1 or cuda.KERNELS["stream"])
    assert auto(2, 4096, 4096) == (g1 or m1 or cuda.KERNELS["stream"])
    assert auto(4, 28672, 8192) == (g1 or m1 or cuda.KERNELS["ring"])
    assert auto(4, 4096, 4096) == (g1 or m1 or cuda.KERNELS["stream"])
    assert auto(7, 8192, 28672) == (m1 or cuda.KERNELS["ring"])
    assert auto(8, 8192, 28672) == (m1 or cuda.KERNELS["ring"])
    one_stripe = bulk_ok() and torch.cuda.get_device_properties(0).multi_processor_count * 2 >= 256
    assert auto(5, 4096, 4096) == (g1 or (m1 if one_stripe else cuda.KERNELS["stream"]))
    assert auto(5, 6144, 4096) == (g1 or cuda.KERNELS["stream"])
    # sm_90: the warp-specialized wgmma kernel from M = 9 (to 32 on every layer, to 256 on large ones), else
    # tiled (-> dense)
    wg = cuda.KERNELS["wgmma_ws"] if wgmma_ok() else None
    assert auto(9, 28672, 8192) == (wg or cuda.KERNELS["stream"])
    assert auto(9, 4096, 4096) == (wg or cuda.KERNELS["stream"])
    assert auto(16, 11008, 4096) == (wg or cuda.KERNELS["stream"])
    assert auto(17, 4096, 4096) == (wg or cuda.KERNELS["stream"])
    # sm_90: wgmma_ws in 256-row blocks from M = 65 where they fill the waves (112 row blocks here; H200: 85%)
    # or run unsplit where wgmma_ss would; wgmma_ss where it splits
    ss = cuda.KERNELS["wgmma_ss"] if wgmma_ok() else None
    assert auto(200, 28672, 8192) == (wg or cuda.KERNELS["tiled"])
    assert auto(100, 28672, 8192) == (wg or cuda.KERNELS["tiled"])
    assert auto(200, 8192, 28672) == (wg or cuda.KERNELS["tiled"])
    assert auto(257, 28672, 8192) == (wg or cuda.KERNELS["tiled"])
    # 300 tokens on 8192 rows: 129 blocks of 192 rows (one wave on 132 SMs), else wgmma_ss's 4 splits of 96 blocks
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert auto(300, 8192, 28672) == ((wg if sms == 132 else ss) or cuda.KERNELS["tiled"])
    assert auto(1025, 28672, 8192) == cuda.KERNELS["tiled"]
    lin = cuda.CudaPackedLinear(pack(random_layer(np.random.default_rng(3), 4096, 4096, gs=128)), "cuda")
    assert lin.plan(64)["kernel"] == (wg or -1)  # 2^24 weights: wgmma_ws while its blocks fit in one wave
    assert lin.plan(300)["kernel"] == -1  # the last token tile less than half full: dense
    assert lin.plan(32)["kernel"] == (wg or cuda.KERNELS["stream"])
    small = cuda.CudaPackedLinear(pack(random_layer(np.random.default_rng(4), 2048, 4096, gs=128)), "cuda")
    assert small.plan(64)["kernel"] == -1  # 2^23 weights: dense from M = 33


@pytest.mark.gpu
def test_auto_without_tma_runs_the_wgmma_kernel(monkeypatch):
    # the fallback a driver without the TMA encoder gets, simulated: same numbers through the one-pass kernel
    import torch

    if not wgmma_ok():
        pytest.skip("the wgmma kernels need compute capability 9.0")
    rng = np.random.default_rng(11)
    layer = random_layer(rng, 196, 576, gs=64, bias=True)
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")
    x = torch.randn(16, 576, device="cuda", dtype=torch.float16)
    ref = reference(layer, x.double().cpu().numpy(), to_float64(layer.bias, "float16"))
    assert lin.plan(16)["kernel"] == cuda.KERNELS["wgmma_ws"]
    assert rel_err(lin.forward(x), ref) <= 1e-3
    monkeypatch.setenv("W4P_CUDA_NO_TMA", "1")
    lin = cuda.CudaPackedLinear(pack(layer), "cuda")  # (a layer caches its plans)
    assert lin.plan(16)["kernel"] == cuda.KERNELS["wgmma"]
    assert rel_err(lin.forward(x), ref) <= 1e-3


@pytest.mark.gpu
def test_gemm_entry_and_errors():
    import torch

    from w4pack.errors import BadInputError, UnsupportedError

    rng = np.random.default_rng(5)
    layer = random_layer(rng, 64, 256, gs=64, bias=True)
    packed = pack(layer)
    x = torch.randn(3, 256, device="cuda", dtype=torch.float16)
    y = cuda.gemm_cuda(x, packed)
    ref = reference(layer, x.double().cpu().numpy(), to_float64(layer.bias, "float16"))
    assert rel_err(y, ref) <= 1e-3
    with pytest.raises(UnsupportedError):
        cuda.gemm_cuda(x.float(), packed)
    with pytest.raises(BadInputError):
        cuda.gemm_cuda(x[:, :128], packed)
    with pytest.raises(cuda.CudaKernelError, match="ring kernel takes M <= 8"):
        cuda.CudaPackedLinear(packed, "cuda").forward(torch.randn(9, 256, device="cuda", dtype=torch.float16),
                                                      kernel="ring")
    with pytest.raises(cuda.CudaKernelError, match="gemv kernel takes M <= 8"):
        cuda.CudaPackedLinear(packed, "cuda").forward(torch.randn(9, 256, device="cuda", dtype=torch.float16),
                                                      kernel="gemv")
    with pytest.raises(cuda.CudaKernelError, match="bulk kernel needs"):
        cuda.CudaPackedLinear(packed, "cuda").forward(torch.randn(17, 256, device="cuda", dtype=torch.float16),
                                                      kernel="bulk")
