"""The native CPU GEMM against numpy float64 references, on every instruction-set path this CPU has.

Two references per case: the true one (float64 dequantized weights · the activations) and, for the
fast path, its exact semantics (float64 weights · the int8-rounded activations, rounded per block the
way docs/CPU.md specifies), which the kernel must hit to ~1e-6.
"""
from __future__ import annotations

import numpy as np
import pytest

from w4pack.canonical import CanonicalLayer
from w4pack.dtypes import from_float32, to_float32
from w4pack.errors import BadInputError, UnsupportedError
from w4pack.layout import PackedLayer, _deinterleave, pack

cpu = pytest.importorskip("w4pack.native.cpu")
if not cpu.available():  # pragma: no cover
    pytest.skip("native CPU module not built: make native (or python setup.py build_ext --inplace)",
                allow_module_level=True)

from w4pack.native import CpuPackedLinear, cpu_linear, gemm, isa_info  # noqa: E402

ALL_ISAS = ["scalar", "avx2", "avx512novnni", "avx512vnni", "amx", "neon"]


def isa_or_skip(isa: str) -> str:
    if isa not in isa_info()["available"]:
        pytest.skip(f"{isa} path not available on this CPU (runs on a CPU that has {isa})")
    return isa


def make_layer(n: int, k: int, bits: int = 4, gs: int = 128, zero_mode: str = "int", act_order: bool = False,
               scale_dtype: str = "float16", bias: bool = True, seed: int = 0) -> CanonicalLayer:
    """Random, non-trivial layer: full code range, distinct non-zero scales, zeros and minima."""
    rng = np.random.default_rng(seed)
    g = 1 if gs == -1 else -(-k // gs)
    codes = rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    s = (rng.random((n, g)) * 0.05 + 0.002).astype(np.float32)
    scales = from_float32(s, scale_dtype) if scale_dtype == "bfloat16" else s.astype(scale_dtype)
    zeros = None
    if zero_mode == "int":
        zeros = rng.integers(0, (1 << bits) + 1, (n, g)).astype(np.int32)
    elif zero_mode == "float":
        m = (rng.standard_normal((n, g)) * 0.1).astype(np.float32)
        zeros = from_float32(m, scale_dtype) if scale_dtype == "bfloat16" else m.astype(scale_dtype)
    g_idx = None
    if act_order and gs != -1:
        g_idx = (np.arange(k) // gs).astype(np.int32)
        rng.shuffle(g_idx)
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    return CanonicalLayer(codes=codes, scales=scales, bits=bits, group_size=gs, zero_mode=zero_mode, zeros=zeros,
                          g_idx=g_idx, scale_dtype=scale_dtype, bias=b)


def activations(m: int, k: int, dtype: str, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(array in dtype, its exact float64 values); non-zero, with an outlier column or two."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, rng.integers(0, k, 2)] *= 8.0
    if dtype == "bfloat16":
        xb = from_float32(x, "bfloat16")
        return xb, to_float32(xb, "bfloat16").astype(np.float64)
    xd = x.astype(dtype)
    return xd, xd.astype(np.float64)


def activation_block(layer: CanonicalLayer, kp: int) -> int:
    """The kernel's activation block: the largest of 128/64/32/16 dividing the group size and Kp."""
    gs = kp if layer.group_size == -1 else layer.group_size
    return next(b for b in (128, 64, 32, 16) if gs % b == 0 and kp % b == 0)


def fast_reference(layer: CanonicalLayer, packed: PackedLayer, x64: np.ndarray) -> np.ndarray:
    """Exact semantics of the fast path: per block of K (packed order), a = rint(x·(127/amax)) in fp32,
    x ≈ a·amax/127; the result is the float64 product of those values with the dequantized weights."""
    n, k = layer.codes.shape
    _, kp = packed.padded
    perm = packed.tensors.get("perm")
    order = np.arange(k) if perm is None else perm
    xp = np.zeros((x64.shape[0], kp), dtype=np.float32)
    xp[:, :k] = x64[:, order].astype(np.float32)
    ab = activation_block(layer, kp)
    blocks = xp.reshape(x64.shape[0], kp // ab, ab)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    a = np.clip(np.rint((blocks * inv).astype(np.float32)), -127, 127)
    xq = (a * (amax / np.float32(127.0)).astype(np.float32).astype(np.float64)).reshape(x64.shape[0], kp)
    w = np.zeros((n, kp))
    w[:, :k] = layer.dequantize(np.float64)[:, order]
    y = xq @ w.T
    if layer.bias is not None:
        y = y + layer.bias.astype(np.float64)
    return y


def true_reference(layer: CanonicalLayer, x64: np.ndarray) -> np.ndarray:
    y = x64 @ layer.dequantize(np.float64).T
    if layer.bias is not None:
        y = y + layer.bias.astype(np.float64)
    return y


def rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))


# (n, k, bits, group size, zero mode, act-order, scale dtype): odd shapes, every zero mode and bit width
CASES = [
    (196, 576, 4, 64, "int", False, "float16"),      # K=576, N=196: neither a multiple of the tiles
    (70, 300, 4, 32, "none", True, "float16"),       # act-order, K not a multiple of 64
    (130, 256, 4, 128, "float", False, "float16"),   # float minima (GGUF Q4_1 style)
    (96, 384, 3, 128, "int", True, "bfloat16"),      # 3-bit, act-order, bf16 scales
    (64, 256, 2, 64, "none", False, "float32"),      # 2-bit, fp32 scales
    (80, 512, 8, 128, "int", False, "float16"),      # 8-bit layer (two nibble planes)
    (48, 200, 8, -1, "none", False, "bfloat16"),     # 8-bit per-channel
    (33, 130, 4, -1, "int", False, "float16"),       # per-channel, tiny N
    (100, 448, 4, 64, "float", True, "bfloat16"),    # act-order + float minima
    (17, 96, 4, 32, "int", False, "float32"),
    (50, 200, 4, 48, "int", True, "float16"),        # group size 48: activation blocks of 16
    # 5- and 6-bit codes in 8-bit fields (GGUF Q5_0/Q5_1/Q5_K, Q6_K): the implicit zero is 2^(bits-1), not 128
    (64, 256, 5, 32, "none", False, "float16"),      # Q5_0 style
    (48, 320, 5, 32, "float", False, "float32"),     # Q5_K style float minima
    (40, 256, 5, 64, "int", True, "bfloat16"),
    (64, 256, 6, 16, "none", False, "float32"),      # Q6_K style: groups of 16
    (36, 192, 6, 32, "int", False, "float16"),
    (70, 256, 6, 16, "float", True, "float32"),
    # fp16 parameters kept as fp16 in the CPU layout (kinds F16F16 and F16U8 of cpu_repack.c)
    (72, 320, 8, 32, "none", False, "float16"),      # Q8_0 style (a GGUF token table / tied head)
    (90, 192, 4, 32, "float", True, "float16"),      # act-order + fp16 minima
]


def _ids(c: tuple) -> str:
    n, k, bits, gs, zm, act, sdt = c
    return f"{n}x{k}-b{bits}-g{gs}-{zm}{'-act' if act else ''}-{sdt}"


@pytest.fixture(scope="module", params=CASES, ids=[_ids(c) for c in CASES])
def case(request: pytest.FixtureRequest) -> tuple[CanonicalLayer, PackedLayer, CpuPackedLinear]:
    n, k, bits, gs, zm, act, sdt = request.param
    layer = make_layer(n, k, bits, gs, zm, act, sdt, seed=n + k)
    packed = pack(layer)
    return layer, packed, CpuPackedLinear(packed, threads=1)


def test_repack_holds_the_same_codes(case: tuple) -> None:
    _layer, packed, lin = case
    np_, kp = packed.padded
    expect = _deinterleave(packed.tensors["qweight"], np_, kp, packed.meta["storage_bits"])
    assert np.array_equal(lin.codes(), expect)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_every_isa_against_float64(case: tuple, isa: str) -> None:
    isa_or_skip(isa)
    layer, packed, lin = case
    k = layer.in_features
    for m, dt in ((1, "float16"), (3, "bfloat16"), (17, "float32")):
        x, x64 = activations(m, k, dt, seed=m)
        ref = true_reference(layer, x64)
        y = lin.forward(x, precision="exact", out_dtype="float32", isa=isa, threads=1)
        assert y.dtype == np.float32 and y.shape == (m, layer.out_features)
        assert rel(y, ref) < 2e-6, (isa, m, dt, rel(y, ref))
        yf = lin.forward(x, precision="fast", out_dtype="float32", isa=isa, threads=1)
        assert rel(yf, fast_reference(layer, packed, x64)) < 2e-6, (isa, m, dt)
        assert rel(yf, ref) < 2e-2, (isa, m, dt, rel(yf, ref))  # the documented cost of int8 activations


# ---- large scales: no cancellation between the code sum and the zero-point term (issue 30, item 6) -----
def large_scale_layer(s: float, zero_mode: str = "int", bits: int = 4, scale_dtype: str = "float32",
                      seed: int = 0) -> CanonicalLayer:
    """The issue's 16x128 layer, group 64: zero point 2^(bits-1), scales 0.01, random codes, except row 0
    group 1 with scale s and every code equal to the zero point (weights exactly 0). zero_mode "float"
    stores the same weights as minima m = -s*z; "none" uses the implicit zero point."""
    rng = np.random.default_rng(seed)
    n, k, gs, z = 16, 128, 64, 1 << (bits - 1)
    codes = rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    codes[0, 64:] = z
    sc = np.full((n, 2), 0.01, np.float32)
    sc[0, 1] = s
    def store(v: np.ndarray) -> np.ndarray:
        return from_float32(v, "bfloat16") if scale_dtype == "bfloat16" else v.astype(scale_dtype)
    zeros = None
    if zero_mode == "int":
        zeros = np.full((n, 2), z, np.int32)
    elif zero_mode == "float":
        zeros = store(-sc * np.float32(z))
    return CanonicalLayer(codes=codes, scales=store(sc), bits=bits, group_size=gs, zero_mode=zero_mode, zeros=zeros,
                          scale_dtype=scale_dtype)


LARGE_VARIANTS = [("int", 4, "float32"), ("int", 4, "bfloat16"), ("none", 4, "float32"), ("float", 4, "float32"),
                  ("int", 8, "float32"), ("float", 8, "bfloat16")]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("variant", LARGE_VARIANTS, ids=["-".join(map(str, v)) for v in LARGE_VARIANTS])
def test_exact_keeps_accuracy_with_large_scales(isa: str, variant: tuple) -> None:
    """Once 6.0e-5 / 9.6e-4 / 2.4e-1 relative error at s = 16 / 256 / 65536 (the fp32 sum of q*x and the
    o*sum(x) term cancelled); now at fp32 dequantize-then-matmul level on every path. Also 300.3, a scale
    whose products are not exact, and the fast path against its own definition."""
    isa_or_skip(isa)
    zero_mode, bits, sdt = variant
    for s in (16.0, 256.0, 65536.0, 300.3):
        layer = large_scale_layer(s, zero_mode, bits, sdt)
        packed = pack(layer)
        lin = CpuPackedLinear(packed, threads=1)
        for m in (1, 2, 3, 4, 7):  # every register-tile height of every path
            x, x64 = activations(m, 128, "float32", seed=m)
            ref = true_reference(layer, x64)
            y = lin.forward(x, precision="exact", out_dtype="float32", isa=isa, threads=1)
            assert rel(y, ref) <= 1e-5, (isa, variant, s, m, rel(y, ref))
            yf = lin.forward(x, precision="fast", out_dtype="float32", isa=isa, threads=1)
            assert rel(yf, fast_reference(layer, packed, x64)) <= 1e-5, (isa, variant, s, m, "fast")


# (n, k, bits, group size, zero mode, act-order, scale dtype) for layers whose scales span 1e-3 .. 1e5
WIDE_CASES = [
    (75, 200, 4, 32, "int", True, "float32"),
    (130, 320, 4, 64, "none", False, "bfloat16"),
    (66, 448, 4, 64, "float", True, "float32"),
    (40, 256, 3, 128, "int", False, "float32"),
    (90, 192, 8, 64, "int", True, "float32"),
    (33, 384, 8, -1, "float", False, "float32"),
    (20, 100, 2, 48, "none", True, "float16"),
]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("wide", WIDE_CASES, ids=[_ids(c) for c in WIDE_CASES])
def test_exact_with_scales_over_eight_decades(isa: str, wide: tuple) -> None:
    """Random non-trivial layers (no zero codes, scales or activations by construction), odd shapes, every
    zero mode, act-order, with scales log-uniform over 1e-3 .. 1e5 (fp16: .. 6e4), where every group with
    a scale above 100 holds weights that are exactly zero (minima: m = -s*z, so s*q + m is zero up to the
    rounding of m): the result comes from the small-scale groups, and exact stays within 1e-5 of float64."""
    isa_or_skip(isa)
    n, k, bits, gs, zm, act, sdt = wide
    layer = make_layer(n, k, bits, gs, zm, act, sdt, seed=n * k)
    rng = np.random.default_rng(n + k)
    g = layer.scales.shape[1]
    top = 4.7 if sdt == "float16" else 5.0
    s32 = (10.0 ** rng.uniform(-3, top, (n, g))).astype(np.float32)
    store = (lambda v: from_float32(v, "bfloat16")) if sdt == "bfloat16" else (lambda v: v.astype(sdt))
    scales = store(s32)
    zeros = layer.zeros
    codes = layer.codes.copy()
    gcol = layer.g_idx  # group of every column
    if zm == "float":  # minima near -s*q: the weights of a column group cancel to small multiples of s
        z = rng.integers(0, 1 << bits, (n, g)).astype(np.float32)
        zeros = store(-to_float32(scales, sdt) * z)
    elif zm == "int":
        z = zeros.astype(np.int64)
    else:
        z = np.full((n, g), 1 << (bits - 1))
    big = np.argwhere(to_float32(scales, sdt) > 1e2)
    for r, gg in big:  # every group with a scale above 100 holds weights that are exactly zero
        cols = np.nonzero(gcol == gg)[0]
        codes[r, cols] = np.clip(z[r, gg], 0, (1 << bits) - 1) if zm != "float" else z[r, gg]
        if zm == "int":
            zeros[r, gg] = codes[r, cols[0]]
    layer = layer.replace(scales=scales, zeros=zeros, codes=codes)
    packed = pack(layer)
    lin = CpuPackedLinear(packed, threads=1)
    for m, dt in ((1, "float32"), (4, "float16"), (9, "bfloat16")):
        x, x64 = activations(m, k, dt, seed=m + k)
        ref = true_reference(layer, x64)
        y = lin.forward(x, precision="exact", out_dtype="float32", isa=isa, threads=1)
        assert rel(y, ref) <= 1e-5, (isa, wide, m, rel(y, ref))
        yf = lin.forward(x, precision="fast", out_dtype="float32", isa=isa, threads=1)
        assert rel(yf, fast_reference(layer, packed, x64)) <= 1e-5, (isa, wide, m, "fast")


# ---- the AMX path: exact work items of several rows on bf16 tiles (cpu_amx.c) ----------------------------
AMX_CASES = [
    (196, 576, 4, 64, "int", False, "float16"),
    (70, 300, 4, 32, "none", True, "float16"),
    (96, 384, 3, 128, "int", True, "bfloat16"),
    (64, 256, 2, 64, "none", False, "float32"),
    (33, 130, 4, -1, "int", False, "float16"),    # per-channel: activation blocks of 64, two k-steps of tiles
    (300, 640, 4, 128, "int", True, "float32"),
    (130, 256, 4, 128, "float", False, "float16"),   # float minima (GGUF Q4_1 style): fp16 scale and minimum
    (100, 448, 4, 64, "float", True, "bfloat16"),
    (90, 192, 4, 32, "float", True, "float32"),
    # 8-bit storage: whole codes from two nibble planes, q - z up to 256 in magnitude
    (80, 512, 8, 128, "int", False, "float16"),
    (72, 320, 8, 32, "none", False, "float16"),      # Q8_0 style (a GGUF token table / tied head)
    (48, 200, 8, -1, "none", False, "bfloat16"),
    (48, 320, 5, 32, "float", False, "float32"),     # Q5_K style float minima
    (36, 192, 6, 32, "int", True, "float16"),
    (64, 256, 6, 16, "none", False, "float32"),      # groups of 16: blocks smaller than a tile, VNNI
]


@pytest.mark.parametrize("amx_case", AMX_CASES, ids=[_ids(c) for c in AMX_CASES])
def test_amx_tiles_against_float64(amx_case: tuple) -> None:
    """Row counts around the tiles' threshold, the 16-row tile and the 64-row work item, every activation dtype (three, two and one
    bf16 pieces), 1 and 2 threads: within fp32 dot-product accuracy of float64, and the same bits on both."""
    isa_or_skip("amx")
    n, k, bits, gs, zm, act, sdt = amx_case
    layer = make_layer(n, k, bits, gs, zm, act, sdt, seed=n * 7 + k)
    lin = CpuPackedLinear(pack(layer), threads=1)
    for m in (4, 7, 8, 15, 16, 17, 63, 64, 65, 130):  # tiles from 8 rows (16 for fp32), fewer on VNNI
        for dt in ("float32", "float16", "bfloat16"):
            x, x64 = activations(m, k, dt, seed=m)
            ref = true_reference(layer, x64)
            y = lin.forward(x, precision="exact", out_dtype="float32", isa="amx", threads=1)
            assert rel(y, ref) < 2e-6, (m, dt, rel(y, ref))
            assert np.array_equal(y, lin.forward(x, precision="exact", out_dtype="float32", isa="amx", threads=2))


@pytest.mark.parametrize("variant", LARGE_VARIANTS, ids=["-".join(map(str, v)) for v in LARGE_VARIANTS])
def test_amx_keeps_accuracy_with_large_scales(variant: tuple) -> None:
    """Groups of weights that are exactly zero under scales up to 65536, at row counts the AMX kernel takes
    (8-bit and minima layers go to the VNNI kernel of the same path, and are held to the same bound)."""
    isa_or_skip("amx")
    zero_mode, bits, sdt = variant
    for s in (16.0, 65536.0, 300.3):
        lin = CpuPackedLinear(pack(layer := large_scale_layer(s, zero_mode, bits, sdt)), threads=1)
        for m, dt in ((16, "float32"), (9, "bfloat16"), (33, "float16")):
            x, x64 = activations(m, 128, dt, seed=m)
            y = lin.forward(x, precision="exact", out_dtype="float32", isa="amx", threads=1)
            assert rel(y, true_reference(layer, x64)) <= 1e-5, (variant, s, m)


@pytest.mark.parametrize("sdt", ["float16", "float32"])
def test_amx_minima_far_from_the_codes(sdt: str) -> None:
    """Float minima whose virtual zero point round(-m/s) falls outside [0, 16] (every weight of the group
    positive, or every one below -16 scales), scales of zero, and minima that cancel a large scale exactly:
    the rewrite s*(q - z) + r stays within exact's bound of float64 for all of them."""
    isa_or_skip("amx")
    n, k, gs = 64, 256, 64
    rng = np.random.default_rng(9)
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s = (rng.random((n, k // gs)) * 0.05 + 0.01).astype(np.float32)
    kind = rng.integers(0, 5, s.shape)
    m = np.where(kind == 0, s * rng.uniform(0.5, 40, s.shape),            # all weights positive: z clamps to 0
         np.where(kind == 1, -s * rng.uniform(17, 60, s.shape),          # all below -s: z clamps to 16
         np.where(kind == 2, -s * rng.integers(0, 16, s.shape), -s * rng.uniform(0, 15, s.shape))))
    s[kind == 3] = 0.0                                                     # a scale of zero: w = m
    big = kind == 4
    s[big] *= 65536.0
    m[big] = -s[big] * 7                                                   # weights s*(q - 7): exact zeros at q = 7
    store = (lambda v: v.astype(np.float16)) if sdt == "float16" else (lambda v: v.astype(np.float32))
    layer = CanonicalLayer(codes=codes, scales=store(s), bits=4, group_size=gs, zero_mode="float",
                           zeros=store(m.astype(np.float32)), scale_dtype=sdt)
    lin = CpuPackedLinear(pack(layer), threads=1)
    for rows, dt in ((16, "float32"), (8, "bfloat16"), (40, "float16")):
        x, x64 = activations(rows, k, dt, seed=rows)
        ref = true_reference(layer, x64)
        y = lin.forward(x, precision="exact", out_dtype="float32", isa="amx", threads=1)
        vnni = lin.forward(x, precision="exact", out_dtype="float32", isa="avx512vnni", threads=1)
        assert rel(y, ref) <= 1e-5 and rel(y, ref) <= 4 * rel(vnni, ref) + 1e-7, (rows, dt, rel(y, ref), rel(vnni, ref))


FAST_ROWS = (8, 15, 16, 17, 64, 65, 130)


def test_amx_fast_gives_the_vnni_bits(case: tuple) -> None:
    """Fast on int8 tiles (from 16 rows) forms the same exact integer sums as VNNI and applies the same per-block
    arithmetic, so every output bit agrees, for every layer of the matrix (all bit widths, zero modes,
    group sizes including 16, act-order) and row counts around the tiles."""
    isa_or_skip("amx")
    layer, packed, lin = case
    for m in FAST_ROWS:
        for dt in ("float32", "bfloat16"):
            x, x64 = activations(m, layer.in_features, dt, seed=m + 1)
            y = lin.forward(x, precision="fast", out_dtype="float32", isa="amx", threads=1)
            assert np.array_equal(y, lin.forward(x, precision="fast", out_dtype="float32", isa="avx512vnni",
                                                 threads=1)), (m, dt)
            assert rel(y, fast_reference(layer, packed, x64)) < 2e-6, (m, dt)


def test_amx_splits_activations_into_exact_pieces() -> None:
    """Activations whose low significand bits matter: x = 1 + 2^-20 style values against integer weights give a
    result that one or two bf16 pieces would round away (2^-20 relative), so only an exact split passes."""
    isa_or_skip("amx")
    layer = make_layer(64, 256, 4, 64, "int", False, "float32", seed=5)
    lin = CpuPackedLinear(pack(layer), threads=1)
    rng = np.random.default_rng(1)
    x = (1.0 + rng.integers(1, 1 << 23, (16, 256)) * 2.0 ** -23).astype(np.float32)
    x *= rng.choice([-1.0, 1.0], x.shape).astype(np.float32)
    ref = true_reference(layer, x.astype(np.float64))
    y = lin.forward(x, precision="exact", out_dtype="float32", isa="amx", threads=1)
    vnni = lin.forward(x, precision="exact", out_dtype="float32", isa="avx512vnni", threads=1)
    assert rel(y, ref) <= 2 * max(rel(vnni, ref), 1e-7), (rel(y, ref), rel(vnni, ref))


def test_amx_passes_non_finite_activations_through() -> None:
    """inf and NaN sit in the first bf16 piece alone: the outputs they reach are non-finite as on VNNI."""
    isa_or_skip("amx")
    layer = make_layer(64, 256, 4, 64, "int", False, "float32", seed=6)
    lin = CpuPackedLinear(pack(layer), threads=1)
    x, _ = activations(16, 256, "float32", seed=3)
    x[2, 10], x[5, 100] = np.inf, np.nan
    y = lin.forward(x, precision="exact", out_dtype="float32", isa="amx", threads=1)
    vnni = lin.forward(x, precision="exact", out_dtype="float32", isa="avx512vnni", threads=1)
    assert np.array_equal(np.isfinite(y), np.isfinite(vnni)) and not np.isfinite(y[[2, 5]]).any()
    assert np.isfinite(np.delete(y, [2, 5], axis=0)).all()


def test_output_dtypes_round_the_fp32_result(case: tuple) -> None:
    layer, _packed, lin = case
    for dt in ("float16", "bfloat16", "float32"):
        x, _ = activations(5, layer.in_features, dt, seed=7)
        y32 = lin.forward(x, out_dtype="float32", threads=1)
        y = lin.forward(x, threads=1)  # output in the activations' dtype
        expect = y32.astype(np.float16) if dt == "float16" else (from_float32(y32, "bfloat16") if dt == "bfloat16" else y32)
        assert y.dtype == expect.dtype
        assert np.array_equal(y, expect)


def test_threads_and_repeats_are_bit_identical() -> None:
    layer = make_layer(300, 640, 4, 128, "int", True, seed=3)
    lin = CpuPackedLinear(pack(layer))
    x, _ = activations(67, 640, "float16", seed=5)
    for prec in ("exact", "fast"):
        y1 = lin.forward(x, precision=prec, threads=1)
        y2 = lin.forward(x, precision=prec, threads=2)
        y3 = lin.forward(x, precision=prec, threads=2)
        assert np.array_equal(y1, y2) and np.array_equal(y2, y3)


def test_m_from_1_to_67_on_the_default_path() -> None:
    layer = make_layer(196, 576, 4, 64, "int", False, seed=11)
    lin = CpuPackedLinear(pack(layer))
    x, x64 = activations(67, 576, "float32", seed=2)
    ref = true_reference(layer, x64)
    for m in (1, 2, 4, 5, 8, 31, 64, 65, 67):
        assert rel(lin.forward(x[:m], threads=1), ref[:m]) < 2e-6, m
    # more rows than one pass of the kernel's activation scratch (256): processed in passes
    xl, xl64 = activations(600, 576, "float16", seed=6)
    for prec, tol in (("exact", 2e-6), ("fast", 2e-2)):
        yl = lin.forward(xl, precision=prec, out_dtype="float32", threads=2)
        assert rel(yl, true_reference(layer, xl64)) < tol
        if prec == "fast":  # integer dots: a row's result does not depend on the rows around it
            assert np.array_equal(yl[300:301], lin.forward(xl[300:301], precision=prec, out_dtype="float32",
                                                           threads=1))


def test_w4pack_isa_env_forces_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = make_layer(64, 128, seed=4)
    lin = CpuPackedLinear(pack(layer))
    x, x64 = activations(2, 128, "float32")
    ref = true_reference(layer, x64)
    for isa in isa_info()["available"] + ["avx512"] * ("avx512novnni" in isa_info()["available"]):
        monkeypatch.setenv("W4PACK_ISA", isa)
        assert rel(lin.forward(x, threads=1), ref) < 2e-6
    other = "neon" if "neon" not in isa_info()["available"] else "avx2"
    monkeypatch.setenv("W4PACK_ISA", other)
    with pytest.raises(UnsupportedError, match="W4PACK_ISA"):
        lin.forward(x, threads=1)
    monkeypatch.setenv("W4PACK_ISA", "sse9")
    with pytest.raises(UnsupportedError):
        lin.forward(x, threads=1)
    with pytest.raises(BadInputError, match="unknown instruction-set"):
        lin.forward(x, threads=1, isa="sse9")
    monkeypatch.delenv("W4PACK_ISA")
    info = isa_info()
    assert info["selected"] in info["available"] and info["forced"] is None


def test_shapes_bias_and_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    layer = make_layer(40, 192, 4, 64, "int", seed=9)
    packed = pack(layer)
    lin = cpu_linear(packed)
    assert cpu_linear(packed) is lin  # repacked once, kept on the PackedLayer
    x, x64 = activations(6, 192, "float32")
    ref = true_reference(layer, x64)
    nobias = ref - layer.bias.astype(np.float64)
    assert rel(gemm(x.reshape(2, 3, 192), packed, threads=1).reshape(6, 40), ref) < 2e-6
    assert rel(gemm(x, packed, bias=False, threads=1), nobias) < 2e-6
    other = np.linspace(-1, 1, 40).astype(np.float32)
    assert rel(gemm(x, packed, bias=other, threads=1), nobias + other) < 2e-6
    assert gemm(x[0], packed, threads=1).shape == (40,)
    wide = np.zeros((6, 300), np.float32)
    wide[:, :192] = x
    assert rel(gemm(wide[:, :192], packed, threads=1), ref) < 2e-6  # strided rows, no copy
    for tdt, atol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
        xt = torch.from_numpy(x).to(tdt)
        yt = gemm(xt, packed, threads=1)
        assert isinstance(yt, torch.Tensor) and yt.dtype == tdt and yt.shape == (6, 40)
        ref_t = true_reference(layer, xt.float().numpy().astype(np.float64))
        assert rel(yt.float().numpy(), ref_t) < atol
    yt = gemm(torch.from_numpy(x).t().contiguous().t(), packed, threads=1, out_dtype=torch.float32)
    assert rel(yt.numpy(), ref) < 2e-6  # non-contiguous tensor is copied, result unchanged


def test_bad_inputs_give_clean_errors() -> None:
    layer = make_layer(32, 128, seed=1)
    packed = pack(layer)
    lin = CpuPackedLinear(packed)
    x = np.ones((2, 128), np.float32)
    with pytest.raises(BadInputError, match="K=128"):
        lin.forward(np.ones((2, 100), np.float32))
    with pytest.raises(BadInputError, match="float16"):
        lin.forward(np.ones((2, 128), np.int32))
    with pytest.raises(BadInputError, match="precision"):
        lin.forward(x, precision="medium")
    with pytest.raises(BadInputError, match="threads"):
        lin.forward(x, threads=0)
    with pytest.raises(BadInputError, match="M = 0"):
        lin.forward(np.ones((0, 128), np.float32))
    with pytest.raises(BadInputError, match="bias"):
        lin.forward(x, bias=np.ones(7, np.float32))
    with pytest.raises(BadInputError, match="output dtype"):
        lin.forward(x, out_dtype="int8")
    bad = PackedLayer(meta=dict(packed.meta), tensors=dict(packed.tensors))
    bad.tensors["qweight"] = packed.tensors["qweight"][:, :-1]
    with pytest.raises(BadInputError, match="qweight"):
        CpuPackedLinear(bad)
    meta = dict(packed.meta, padded_shape=[48, 128])
    with pytest.raises(BadInputError, match="padded shape"):
        CpuPackedLinear(PackedLayer(meta=meta, tensors=packed.tensors))
    act = pack(make_layer(32, 128, 4, 32, "int", True, seed=2))
    act.tensors["perm"] = np.zeros(128, np.int32)
    with pytest.raises(BadInputError, match="permutation"):
        CpuPackedLinear(act)


# ---- NEON: cross-compiled with Debian's aarch64 gcc, run under qemu-user --------------------------
NEON_CASES = [
    (196, 576, 4, 64, "int", False, "float16", 3, "float16"),
    (70, 300, 4, 32, "none", True, "bfloat16", 2, "bfloat16"),
    (80, 256, 8, 128, "float", False, "float32", 5, "float32"),
    (40, 130, 3, -1, "int", False, "float16", 1, "float16"),
    (72, 320, 4, 32, "float", False, "float16", 2, "float32"),   # fp16 scales and minima (GGUF Q4_1)
    (48, 192, 8, 32, "none", False, "float16", 1, "float16"),    # 8-bit codes, fp16 scales (GGUF Q8_0)
]
_DT_CODE = {"float16": 1, "bfloat16": 2, "float32": 3}
_ZERO_CODE = {"none": 0, "int": 1, "float": 2}


def write_neon_case(path, layer: CanonicalLayer, packed: PackedLayer, m: int, xdt: str) -> None:
    """The binary case file tests/native/neon_check.c reads (header, packed tensors, x, references)."""
    meta = packed.meta
    x, x64 = activations(m, layer.in_features, xdt, seed=m + 3)
    t = packed.tensors
    head = np.array([0x57345043, *meta["shape"], *meta["padded_shape"], meta["bits"], meta["storage_bits"],
                     meta["group_size"], meta["padded_groups"], _ZERO_CODE[meta["zero_mode"]],
                     _DT_CODE[meta["scale_dtype"]], int("perm" in t), m, _DT_CODE[xdt]], dtype=np.int32)
    parts = [head, t["qweight"], t["scales"]]
    parts += [t["zeros"]] if "zeros" in t else []
    parts += [t["mins"]] if "mins" in t else []
    parts += [t["perm"]] if "perm" in t else []
    nobias = layer.replace(bias=None)
    parts += [x, true_reference(nobias, x64), fast_reference(nobias, packed, x64)]
    with open(path, "wb") as fh:
        for a in parts:
            fh.write(np.ascontiguousarray(a).tobytes())


@pytest.fixture(scope="module")
def neon_binary(tmp_path_factory: pytest.TempPathFactory):
    import shutil
    import subprocess
    from pathlib import Path

    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if not cc or not qemu:
        pytest.skip("NEON test needs Debian's cross compiler and emulator: "
                    "apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static")
    repo = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("neon") / "neon_check"
    sources = sorted(str(p) for p in (repo / "native").glob("cpu_*.c"))
    subprocess.run([cc, "-O2", "-std=gnu11", "-static", "-Wall", "-Wno-unused-function", f"-I{repo / 'native'}",
                    *sources, str(repo / "tests/native/neon_check.c"), "-o", str(out), "-lpthread", "-lm"],
                   check=True, capture_output=True, text=True)
    return qemu, out


@pytest.mark.parametrize("qemu_cpu", ["max", "cortex-a53"], ids=["dotprod", "no-dotprod"])
def test_neon_under_qemu(neon_binary, qemu_cpu: str, tmp_path) -> None:
    import subprocess

    qemu, binary = neon_binary
    for i, (n, k, bits, gs, zm, act, sdt, m, xdt) in enumerate(NEON_CASES):
        layer = make_layer(n, k, bits, gs, zm, act, sdt, bias=False, seed=i)
        case = tmp_path / f"case{i}.bin"
        write_neon_case(case, layer, pack(layer), m, xdt)
        r = subprocess.run([qemu, "-cpu", qemu_cpu, str(binary), str(case)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (n, k, bits, gs, zm, r.stdout + r.stderr)
        assert r.stdout.count(" ok") == 4 and "neon fast" in r.stdout


@pytest.mark.parametrize("qemu_cpu", ["max", "cortex-a53"], ids=["dotprod", "no-dotprod"])
def test_neon_large_scales_under_qemu(neon_binary, qemu_cpu: str, tmp_path) -> None:
    """The issue-30 layers (a large-scale group of exact zeros) on NEON and scalar, both precisions."""
    import subprocess

    qemu, binary = neon_binary
    for i, (zero_mode, bits, sdt) in enumerate(LARGE_VARIANTS):
        for s in (65536.0, 300.3):
            layer = large_scale_layer(s, zero_mode, bits, sdt, seed=i)
            case = tmp_path / f"large{i}.bin"
            write_neon_case(case, layer, pack(layer), 3, "float32")
            r = subprocess.run([qemu, "-cpu", qemu_cpu, str(binary), str(case)], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, (zero_mode, bits, sdt, s, r.stdout + r.stderr)
            assert r.stdout.count(" ok") == 4 and "neon exact" in r.stdout


def test_thread_pool_survives_fork() -> None:
    import os

    layer = make_layer(512, 1024, seed=8)  # big enough (4.7M multiply-adds) for the kernel to use 2 threads
    lin = CpuPackedLinear(pack(layer))
    x, x64 = activations(9, 1024, "float32")
    y = lin.forward(x, threads=2)  # the parent's pool now has a worker
    pid = os.fork()
    if pid == 0:  # child: no workers exist here; the pool must notice and still finish every item
        ok = np.array_equal(lin.forward(x, threads=2), y)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert rel(y, true_reference(layer, x64)) < 2e-6


@pytest.mark.parametrize("bits,zero_mode,stride16", [(4, "float", 256), (8, "none", 192), (4, "int", 192)])
def test_fp16_parameters_stay_half_width(bits: int, zero_mode: str, stride16: int) -> None:
    """fp16 scales (and fp16 minima, byte-sized zero points) are kept at their width in the CPU layout: a
    memory-bound GEMV reads them once per group, so fp32 copies cost a sixth of a 4-bit layer's bytes."""
    n, k, gs = 128, 256, 32
    sizes = {}
    for sdt in ("float16", "float32"):
        layer = make_layer(n, k, bits, gs, zero_mode, False, sdt, seed=3)
        sizes[sdt] = CpuPackedLinear(pack(layer), threads=1).nbytes
    tiles, groups = n // 64, k // gs
    assert sizes["float32"] - sizes["float16"] == tiles * groups * (512 - stride16)


@pytest.mark.parametrize("heads,kv,head_dim,inter", [
    (65536, 1, 65536, 8),      # heads x head_dim wraps to 0 in an int
    (1, 1, 1 << 30, 8),        # (heads + 2 kv heads) x head_dim wraps
])
def test_llama_decode_refuses_dimensions_that_overflow_an_int(heads: int, kv: int, head_dim: int,
                                                              inter: int) -> None:
    """w4p_llama_decode's widths are ints: a product past INT_MAX is refused, not wrapped (a wrapped width can
    match a real layer's and then index q/k/v past their buffers). No layer is needed to see the check."""
    ffi, lib = cpu.ffi, cpu.lib
    dims = ffi.new("w4p_llama_dims *")
    dims.hidden, dims.n_heads, dims.n_kv, dims.head_dim = 8, heads, kv, head_dim
    dims.inter, dims.max_len, dims.scaling, dims.threads = inter, 4, 1.0, 1
    layers = ffi.new("w4p_llama_layer[]", 1)
    h = np.zeros(8, np.float32)
    rot = np.zeros(16, np.float32)  # not read: no layer runs
    fp = lambda a: ffi.cast("float *", a.ctypes.data)  # noqa: E731
    rc = lib.w4p_llama_decode(dims, layers, 0, fp(h), 0, fp(rot), fp(rot))
    assert rc != 0 and "too large" in ffi.string(lib.w4p_last_error()).decode()


def test_read_stream_reads_every_byte_once():
    """The bench's bandwidth stream (w4p_cpu_read_stream): its XOR fold is the model's on random bytes and an odd
    length, so a changed loop that skips or re-reads part of the buffer fails here (the AVX-512 form: 256-byte
    steps into four 64-byte lanes, then the tail byte by byte; elsewhere the 8-byte-word fold)."""
    from w4pack.native.cpu import ffi, lib

    rng = np.random.default_rng(5)
    buf = rng.integers(0, 256, (1 << 20) + 77, dtype=np.uint8)
    got = lib.w4p_cpu_read_stream(ffi.from_buffer(buf), buf.nbytes)
    if "avx512novnni" in isa_info()["available"] or "avx512vnni" in isa_info()["available"]:
        q = buf.nbytes // 256 * 256
        want = int(np.bitwise_xor.reduce(buf[:q].view(np.uint64)))
        for b in buf[q:]:
            want ^= int(b)
    else:
        n = buf.nbytes // 8
        want = int(np.bitwise_xor.reduce(buf[:n * 8].view(np.uint64)))
    assert got == want
