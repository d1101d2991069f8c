"""w4pack.runtime.attention: one decode token's attention as ``w4pack::decode_attention``.

The torch reference is checked against attention written out head by head in float64 (rotary as transformers
applies it, grouped query heads, the cache write); the op runs it off the GPU and keeps the caches' mutation
through ``torch.compile`` without copying them. The CUDA kernel (marked gpu) must match the reference for
every head size, group size, dtype, split count and position, store the same key and value, leave its
workspace's counters at zero and replay under graph capture at positions read from device memory."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from w4pack.errors import BadInputError  # noqa: E402
from w4pack.runtime.attention import decode_attention, kernel_reason, reference  # noqa: E402


def _inputs(heads: int, kv: int, d: int, max_len: int, pos: int, dtype: torch.dtype = torch.float32,
            device: str = "cpu", seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ang = torch.arange(max_len)[:, None] * (1e4 ** (-torch.arange(0, d, 2) / d))[None, :]
    ang = torch.cat((ang, ang), dim=1)
    to = dict(dtype=dtype, device=device)
    return dict(qkv=rnd((heads + 2 * kv) * d).to(**to), cos=ang.cos().to(**to), sin=ang.sin().to(**to),
                pos=torch.tensor([pos], device=device), k_cache=rnd(kv, max_len, d).to(**to),
                v_cache=rnd(kv, max_len, d).to(**to), heads=heads, kv_heads=kv, scaling=1 / math.sqrt(d))


def _by_hand(a: dict[str, object], rotary: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [heads * D], k_cache, v_cache) in float64, one head at a time."""
    heads, kv = a["heads"], a["kv_heads"]
    k_cache, v_cache = a["k_cache"].double().clone(), a["v_cache"].double().clone()
    d = k_cache.shape[-1]
    p = int(a["pos"])
    x = a["qkv"].double().view(heads + 2 * kv, d)

    def rot(v: torch.Tensor) -> torch.Tensor:
        if not rotary:
            return v
        c, s = a["cos"][p].double(), a["sin"][p].double()
        return v * c + torch.cat((-v[d // 2:], v[:d // 2])) * s

    for h in range(kv):
        k_cache[h, p] = rot(x[heads + h])
        v_cache[h, p] = x[heads + kv + h]
    out = []
    for q in range(heads):
        h = q // (heads // kv)
        s = torch.stack([rot(x[q]) @ k_cache[h, j] for j in range(p + 1)]) * a["scaling"]
        w = torch.softmax(s, dim=0)
        out.append((w[:, None] * v_cache[h, :p + 1]).sum(0))
    return torch.cat(out), k_cache, v_cache


@pytest.mark.parametrize("heads,kv,d,pos", [(4, 2, 16, 0), (6, 2, 32, 9), (8, 8, 64, 47), (12, 3, 16, 63)])
@pytest.mark.parametrize("rotary", [True, False])
def test_reference_is_attention_written_out(heads: int, kv: int, d: int, pos: int, rotary: bool) -> None:
    a = _inputs(heads, kv, d, 64, pos, torch.float64, seed=pos)
    if not rotary:
        a.update(cos=None, sin=None)
    want, k_want, v_want = _by_hand(a, rotary)
    got = reference(**a)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a["k_cache"], k_want, rtol=1e-12, atol=1e-12)
    assert torch.equal(a["v_cache"], v_want)


def test_op_runs_the_reference_off_the_gpu() -> None:
    a = _inputs(6, 2, 32, 40, 17, seed=3)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    got = decode_attention(**a)
    assert torch.equal(got, reference(**b))
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])
    assert "CUDA" in kernel_reason(torch.device("cpu"), torch.float16, 6, 2, 32)


def test_compiled_op_writes_the_callers_caches_without_copying_them() -> None:
    """Inductor must run the op on the caches themselves (a copy of every layer's cache each step would cost
    more than the attention)."""
    from torch._inductor.utils import run_and_get_code

    a = _inputs(8, 2, 64, 96, 40, seed=4)
    caches = (a["k_cache"], a["v_cache"])
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    want = reference(**b) * 2

    def step(x: torch.Tensor) -> torch.Tensor:
        return decode_attention(x, a["cos"], a["sin"], a["pos"], *caches, 8, 2, a["scaling"]) * 2

    torch._dynamo.reset()
    with torch.inference_mode():
        got, code = run_and_get_code(torch.compile(step), a["qkv"])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[0], b["k_cache"]) and torch.equal(caches[1], b["v_cache"])
    src = "\n".join(code)
    assert "decode_attention" in src and ".copy_(" not in src and "clone" not in src, src


def test_attention_splits_follow_the_multiprocessors_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two blocks a multiprocessor in all by default, $W4PACK_ATTN_BLOCKS of them when set; 1 to 64 a kv head."""
    from w4pack.native import cuda

    monkeypatch.setattr(cuda, "_multiprocessors", lambda index: 132)
    dev = torch.device("cuda", 0)
    monkeypatch.delenv("W4PACK_ATTN_BLOCKS", raising=False)
    assert [cuda.attention_splits(dev, kv) for kv in (32, 8, 1, 400)] == [9, 33, 64, 1]
    monkeypatch.setenv("W4PACK_ATTN_BLOCKS", "4")
    assert [cuda.attention_splits(dev, kv) for kv in (32, 8)] == [17, 64]
    for bad in ("0", "17", "two"):
        monkeypatch.setenv("W4PACK_ATTN_BLOCKS", bad)
        with pytest.raises(BadInputError, match=f"W4PACK_ATTN_BLOCKS='{bad}'.*1 to 16"):
            cuda.attention_splits(dev, 32)


# -- the CUDA kernel ---------------------------------------------------------------------------------------

def _cuda_or_skip() -> None:
    from w4pack.native import cuda

    why = cuda.unavailable_reason()
    if why:
        pytest.skip(why)


def _check_kernel(heads: int, kv: int, d: int, max_len: int, pos: int, dtype: torch.dtype, splits: int,
                  rotary: bool = True, seed: int = 0) -> None:
    from w4pack.native import cuda

    a = _inputs(heads, kv, d, max_len, pos, dtype, "cuda", seed)
    if not rotary:
        a.update(cos=None, sin=None)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    got = cuda.decode_attention(**a, splits=splits)
    want = reference(**b)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # the key and value at pos, nothing else; the key bit for bit (products of two 16-bit floats are exact in
    # fp32, so the rotation rounds once either way)
    assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(a["v_cache"], b["v_cache"])
    again = cuda.decode_attention(**a, splits=splits)  # counters left at zero: the same result again
    assert torch.equal(again, got)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads,kv", [(32, 32), (8, 4), (16, 4), (28, 4), (64, 8)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernel_matches_the_reference(d: int, heads: int, kv: int, dtype: str) -> None:
    _cuda_or_skip()
    dt = getattr(torch, dtype)
    for pos, splits in [(0, 0), (1, 3), (15, 64), (16, 1), (63, 2), (64, 0), (65, 7), (300, 0), (1023, 0)]:
        _check_kernel(heads, kv, d, 1024, pos, dt, splits, seed=pos)


@pytest.mark.gpu
def test_kernel_without_rotary_and_at_long_positions() -> None:
    _cuda_or_skip()
    _check_kernel(32, 8, 128, 4096, 4000, torch.float16, 0, rotary=False)
    _check_kernel(32, 8, 128, 8192, 8191, torch.bfloat16, 5, seed=2)
    # 64 splits with keys: the combine's lanes each take two (chunks of one tile, and of 32 keys at D = 256)
    _check_kernel(32, 8, 128, 4096, 4095, torch.float16, 64, seed=3)
    _check_kernel(16, 4, 256, 2048, 2047, torch.bfloat16, 64, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv", [(12, 4), (20, 4), (24, 4)])
def test_kernel_with_query_groups_that_are_not_powers_of_two(heads: int, kv: int) -> None:
    """G = 3, 5, 6 run the instance of the next power of two, with the extra heads' sums computed and dropped."""
    _cuda_or_skip()
    for pos, splits in [(15, 0), (300, 0), (1023, 64)]:
        _check_kernel(heads, kv, 128, 1024, pos, torch.float16, splits, seed=pos + heads)


@pytest.mark.gpu
def test_kernel_replays_in_a_graph_at_positions_from_device_memory() -> None:
    _cuda_or_skip()
    from w4pack.native import cuda

    a = _inputs(32, 8, 128, 512, 0, torch.float16, "cuda", seed=5)
    cuda.decode_attention(**a)  # the workspace, before capture (it stores row 0 of the caches)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda.decode_attention(**a)
    for pos in (3, 200, 511, 100):
        a["pos"].fill_(pos)
        b["pos"].fill_(pos)
        graph.replay()
        want = reference(**b)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_kernel_outside_the_cache_writes_nan_and_nothing_else() -> None:
    _cuda_or_skip()
    from w4pack.native import cuda

    a = _inputs(8, 2, 64, 128, 128, torch.float16, "cuda")
    k0, v0 = a["k_cache"].clone(), a["v_cache"].clone()
    assert bool(cuda.decode_attention(**a).isnan().all())
    assert torch.equal(a["k_cache"], k0) and torch.equal(a["v_cache"], v0)


@pytest.mark.gpu
def test_kernel_refuses_what_it_does_not_take() -> None:
    _cuda_or_skip()
    from w4pack.native import cuda

    assert kernel_reason(torch.device("cuda"), torch.float16, 32, 8, 128) == ""
    assert "head size 96" in kernel_reason(torch.device("cuda"), torch.float16, 32, 8, 96)
    assert "up to 8" in kernel_reason(torch.device("cuda"), torch.float16, 32, 2, 128)
    a = _inputs(32, 2, 128, 64, 3, torch.float16, "cuda")
    with pytest.raises(cuda.CudaKernelError, match="at most 8"):
        cuda.decode_attention(**a)
    a = _inputs(8, 2, 64, 64, 3, torch.float16, "cuda")
    with pytest.raises(BadInputError, match="cos and sin"):
        cuda.decode_attention(**dict(a, sin=None))
    with pytest.raises(BadInputError, match="pos must be one int64"):
        cuda.decode_attention(**dict(a, pos=a["pos"].int()))
