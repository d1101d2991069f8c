"""w4pack.runtime.lean: the lean CPU decode loop and its native step (w4p_llama_decode).

The loop must decode exactly what transformers' generate decodes (same greedy tokens, same seeded samples,
logits to float rounding), fall back to transformers with the reason for what it does not run, and its native
step must match a float64 numpy reference of a llama layer on every CPU path the machine has."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rtn_helper import MemorySource, quantize_model, write_random_llama_gptq  # noqa: E402

from w4pack.convert import convert  # noqa: E402
from w4pack.core.canonical import CanonicalLayer  # noqa: E402
from w4pack.core.layout import pack  # noqa: E402
from w4pack.formats import get_format  # noqa: E402
from w4pack.loading import load_model  # noqa: E402
from w4pack.native import cpu as ncpu  # noqa: E402
from w4pack.runtime.decode import decode_mode  # noqa: E402
from w4pack.runtime.lean import LeanDecoder, NotLean, stack_packed  # noqa: E402

if not ncpu.available():
    pytest.skip("the native CPU module is not built (make native)", allow_module_level=True)

GEN = dict(max_new_tokens=12, do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)


def _write(tmp: Path, name: str, fuse: str | None = None, **cfg: object) -> Path:
    base = dict(seed=5, std=0.15, group_size=32, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, vocab_size=80, max_position_embeddings=256,
                eos_token_id=None, bos_token_id=1, pad_token_id=0)
    base.update(cfg)
    write_random_llama_gptq(tmp / f"{name}-gptq", **base)  # type: ignore[arg-type]
    convert(tmp / f"{name}-gptq", tmp / name, fuse=fuse)
    return tmp / name


def _write_qwen3(tmp: Path, head_dim: int = 16, folder: str = "qwen3") -> Path:
    """A Qwen3 model (per-head q/k RMSNorms with random weights, head_dim apart from hidden / heads, biases
    off), RTN-quantized to GPTQ and converted."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(8)
    cfg = Qwen3Config(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=head_dim, vocab_size=80, max_position_embeddings=256,
                      eos_token_id=None, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "q_norm" in name or "k_norm" in name:  # not all ones: the norms' weights must matter
                p.uniform_(0.5, 1.5)
    layers, tensors = quantize_model(model, group_size=32)
    conf = model.config.to_dict()
    conf["architectures"] = ["Qwen3ForCausalLM"]
    get_format("gptq").write(MemorySource(conf, layers, tensors), tmp / f"{folder}-gptq")
    convert(tmp / f"{folder}-gptq", tmp / folder)
    return tmp / folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lean")
    return {
        "plain": _write(tmp, "plain"),
        "fused": _write(tmp, "fused", fuse="qkv,gate-up", seed=6),
        # act-order, biases on q/k/v/o, head_dim 24, asymmetric codes (int zeros), untied 8-bit-free head
        "odd": _write(tmp, "odd", seed=7, act_order=True, attention_bias=True, hidden_size=96,
                      num_attention_heads=4, num_key_value_heads=2, sym=False, intermediate_size=224),
        "qwen3": _write_qwen3(tmp),
    }


def _ids(n: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 80, (1, n), generator=g)


@pytest.mark.parametrize("name", ["plain", "fused", "odd", "qwen3"])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_greedy_tokens_match_transformers(models: dict[str, Path], name: str, precision: str) -> None:
    ref = load_model(models[name], precision=precision, compile=False)
    assert decode_mode(ref) == "eager"
    lean = load_model(models[name], precision=precision)
    assert decode_mode(lean) == "lean"
    engine = lean._w4pack_lean
    assert engine.native, "every projection here is a native kernel: the step should be one native call"
    for seed in range(3):
        ids = _ids(5 + seed, seed)
        want = ref.generate(ids, **GEN)
        got = lean.generate(ids, **GEN)
        assert torch.equal(got, want), (seed, got, want)
        assert decode_mode(lean) == "lean"


@pytest.mark.parametrize("name", ["plain", "odd", "qwen3"])
def test_step_logits_match_transformers_forward(models: dict[str, Path], name: str) -> None:
    model = load_model(models[name], compile=False)
    engine = LeanDecoder(model)
    ids = _ids(9, 4)[0]
    with torch.inference_mode():
        want = model(ids.unsqueeze(0)).logits[0]  # [T, vocab]
        engine.pos = 0
        prefill = engine.forward(ids[:4])  # the prompt through the torch path, the rest one native step each
        got = [prefill] + [engine.step(int(t)) for t in ids[4:]]
    got_t = torch.stack(got)
    ref = want[3:]
    rel = (got_t - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert float(rel.max()) < 1e-5, rel


def _numpy_reference(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """The final hidden state (after the last norm) of the last token, float64, from dequantized weights."""
    cfg = model.config
    base = model.model
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    theta = cfg.rope_parameters["rope_theta"]

    def w(mod: torch.nn.Module) -> tuple[np.ndarray, np.ndarray | None]:
        b = mod.bias_tensor(torch.float64) if hasattr(mod, "bias_tensor") else None
        return mod.dequantize(torch.float64).numpy(), None if b is None else b.numpy()

    def lin(x: np.ndarray, mod: torch.nn.Module) -> np.ndarray:
        wt, b = w(mod)
        y = x @ wt.T
        return y + b if b is not None else y

    def norm(x: np.ndarray, mod: torch.nn.Module) -> np.ndarray:
        return mod.weight.double().numpy() * x / np.sqrt((x * x).mean(-1, keepdims=True) + mod.variance_epsilon)

    def heads(x: np.ndarray, mod: torch.nn.Module | None) -> np.ndarray:  # qwen3's per-head q/k norms
        return x if mod is None else norm(x, mod)

    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)

    def rope(x: np.ndarray, pos: int) -> np.ndarray:
        ang = np.concatenate([pos * inv, pos * inv])
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        return x * np.cos(ang) + rot * np.sin(ang)

    caches: list[tuple[list[np.ndarray], list[np.ndarray]]] = [([], []) for _ in base.layers]
    h = None
    for pos, tok in enumerate(ids):
        h = base.embed_tokens(torch.tensor([[tok]]))[0, 0].double().numpy()
        for li, layer in enumerate(base.layers):
            at = layer.self_attn
            x = norm(h, layer.input_layernorm)
            q = rope(heads(lin(x, at.q_proj).reshape(nh, d), getattr(at, "q_norm", None)), pos)
            k = rope(heads(lin(x, at.k_proj).reshape(nkv, d), getattr(at, "k_norm", None)), pos)
            v = lin(x, at.v_proj).reshape(nkv, d)
            caches[li][0].append(k)
            caches[li][1].append(v)
            K, V = np.stack(caches[li][0], 1), np.stack(caches[li][1], 1)  # [nkv, T, d]
            out = np.empty((nh, d))
            for hd in range(nh):
                s = K[hd // (nh // nkv)] @ q[hd] / np.sqrt(d)
                p = np.exp(s - s.max())
                out[hd] = (p / p.sum()) @ V[hd // (nh // nkv)]
            h = h + lin(out.reshape(-1), at.o_proj)
            x = norm(h, layer.post_attention_layernorm)
            g, u = lin(x, layer.mlp.gate_proj), lin(x, layer.mlp.up_proj)
            h = h + lin(g / (1 + np.exp(-g)) * u, layer.mlp.down_proj)
    return norm(h, base.norm)


def _isas() -> list[str]:
    names = ncpu.isa_info()["available"]
    return [n for n in ("scalar", "avx2", "avx512", "neon") if n in names or (n == "avx512" and any(
        a.startswith("avx512") for a in names))]


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("name", ["odd", "qwen3"])
def test_native_step_matches_numpy_reference(models: dict[str, Path], isa: str, name: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("W4PACK_ISA", isa)
    model = load_model(models[name], compile=False, threads=2)
    engine = LeanDecoder(model)
    assert engine.native
    ids = _ids(6, 9)[0].tolist()
    with torch.inference_mode():
        engine.pos = 0
        engine._reserve(len(ids))
        for tok in ids[:-1]:
            engine.step(tok)  # every position through the native step
        p0 = engine.layers[0].qkv
        h = engine.embed(torch.tensor([[ids[-1]]]))[0].float().contiguous()
        dims, arr, cos, sin = engine._desc
        d = engine.head_dim
        rc = p0.lib.w4p_llama_decode(dims, arr, len(engine.layers), p0.ffi.cast("float *", h.data_ptr()),
                                     engine.pos, cos + engine.pos * d, sin + engine.pos * d)
        assert rc == 0
    ref = _numpy_reference(model, ids)
    err = np.abs(h[0].double().numpy() - ref).max() / np.abs(ref).max()
    assert err < 2e-5, err


def test_native_step_refuses_bad_arguments(models: dict[str, Path]) -> None:
    model = load_model(models["plain"], compile=False)
    engine = LeanDecoder(model)
    engine._reserve(4)
    p0 = engine.layers[0].qkv
    dims, arr, cos, sin = engine._desc
    h = torch.zeros(1, engine.hidden)
    hp = p0.ffi.cast("float *", h.data_ptr())
    assert p0.lib.w4p_llama_decode(dims, arr, len(engine.layers), hp, engine.max_len, cos, sin) != 0
    assert "outside the cache" in p0.ffi.string(p0.lib.w4p_last_error()).decode()
    saved = arr[0].o[0]
    arr[0].o[0] = arr[0].down[0]  # wrong shape for o_proj
    assert p0.lib.w4p_llama_decode(dims, arr, len(engine.layers), hp, 0, cos, sin) != 0
    assert "projection shapes" in p0.ffi.string(p0.lib.w4p_last_error()).decode()
    arr[0].o[0] = saved


def test_seeded_sampling_draws_what_transformers_draws(models: dict[str, Path]) -> None:
    ref = load_model(models["plain"], compile=False)
    lean = load_model(models["plain"])
    for extra in ({"top_k": 0, "top_p": 0.9}, {"top_k": 20, "top_p": None}, {}):
        kw = dict(max_new_tokens=10, do_sample=True, temperature=0.8, pad_token_id=0, **extra)
        torch.manual_seed(11)
        want = ref.generate(_ids(), **kw)
        torch.manual_seed(11)
        got = lean.generate(_ids(), **kw)
        assert torch.equal(got, want), extra


def test_calls_it_does_not_run_fall_back_with_the_reason(models: dict[str, Path]) -> None:
    ref = load_model(models["plain"], compile=False)
    lean = load_model(models["plain"])
    two = torch.cat([_ids(), _ids(seed=1)])
    assert torch.equal(lean.generate(two, **GEN), ref.generate(two, **GEN))
    assert decode_mode(lean).startswith("eager (") and "one sequence" in decode_mode(lean)
    kw = dict(GEN, repetition_penalty=1.3)
    assert torch.equal(lean.generate(_ids(), **kw), ref.generate(_ids(), **kw))
    assert "repetition_penalty" in decode_mode(lean)
    assert torch.equal(lean.generate(_ids(), **GEN), ref.generate(_ids(), **GEN))
    assert decode_mode(lean) == "lean"


def test_stopping_at_eos_and_streaming_match_transformers(models: dict[str, Path]) -> None:
    ref = load_model(models["plain"], compile=False)
    lean = load_model(models["plain"])
    free = ref.generate(_ids(), **GEN)[0, 7:].tolist()
    eos = free[4]  # a token the greedy continuation produces: both must stop right after it

    class Sink:
        def __init__(self) -> None:
            self.got: list[list[int]] = []
            self.ended = False

        def put(self, v: torch.Tensor) -> None:
            self.got.append(v.reshape(-1).tolist())

        def end(self) -> None:
            self.ended = True

    a, b = Sink(), Sink()
    want = ref.generate(_ids(), streamer=a, **dict(GEN, eos_token_id=eos))
    got = lean.generate(_ids(), streamer=b, **dict(GEN, eos_token_id=eos))
    assert torch.equal(got, want) and got.shape[1] == 7 + free.index(eos) + 1
    assert a.got == b.got and b.ended


def test_swapped_layers_rebuild_the_loop(models: dict[str, Path]) -> None:
    """dequantized_model swaps every packed layer for nn.Linear: the loop must see the new layers."""
    from w4pack.runtime.run import dequantized_model

    lean = load_model(models["plain"])
    before = lean.generate(_ids(), **GEN)
    dequantized_model(lean)
    ref = dequantized_model(load_model(models["plain"], compile=False))
    assert torch.equal(lean.generate(_ids(), **GEN), ref.generate(_ids(), **GEN))
    assert decode_mode(lean) == "lean" and not lean._w4pack_lean.native
    assert before.shape == ref.generate(_ids(), **GEN).shape


def test_opt_out_and_unsupported_models(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("W4PACK_LEAN", "0")
    assert decode_mode(load_model(models["plain"])) == "eager"
    monkeypatch.delenv("W4PACK_LEAN")
    bf16 = load_model(models["plain"], dtype="bfloat16")
    assert decode_mode(bf16).startswith("eager (") and "float32" in decode_mode(bf16)


def test_rotary_narrower_than_the_heads_is_not_lean(models: dict[str, Path]) -> None:
    """Rotary tables narrower than head_dim (partial rotary): the native step would read head_dim values per
    position past each row, so the loop is not built (transformers' generate answers, and says why)."""
    model = load_model(models["plain"], compile=False)
    rot = model.model.rotary_emb
    rot.inv_freq = rot.inv_freq[: rot.inv_freq.shape[0] // 2].clone()
    with pytest.raises(NotLean, match="rotary embedding of 8 dimensions on heads of 16"):
        LeanDecoder(model)


def _layer(rng: np.random.Generator, n: int, k: int, gs: int = 32, bits: int = 4,
           zero: str = "int") -> CanonicalLayer:
    q = rng.integers(0, 1 << bits, size=(n, k), dtype=np.uint8)
    s = rng.uniform(0.01, 0.1, size=(n, k // gs)).astype(np.float16)
    kw: dict[str, object] = {}
    if zero == "int":
        kw["zeros"] = rng.integers(0, 1 << bits, size=(n, k // gs), dtype=np.uint8)
    return CanonicalLayer(codes=q, scales=s, bits=bits, group_size=gs, zero_mode=zero, **kw)  # type: ignore


def test_stack_packed_is_lossless_and_refuses_mismatches() -> None:
    rng = np.random.default_rng(0)
    parts = [pack(_layer(rng, n, 96)) for n in (48, 16, 32)]
    stacked = stack_packed(parts)
    assert stacked is not None and stacked.meta["shape"] == [96, 96]
    x = rng.standard_normal((3, 96)).astype(np.float32)
    for precision in ("exact", "fast"):
        want = np.concatenate([ncpu.CpuPackedLinear(p, threads=1).forward(x, precision) for p in parts], axis=1)
        got = ncpu.CpuPackedLinear(stacked, threads=2).forward(x, precision)
        assert np.array_equal(got, want), precision
    assert stack_packed([parts[0], pack(_layer(rng, 16, 96, gs=16))]) is None  # group sizes differ
    assert stack_packed([parts[0], pack(_layer(rng, 24, 96))]) is None  # N not a multiple of 16
    assert stack_packed([parts[0], pack(_layer(rng, 16, 64))]) is None  # K differs
    assert stack_packed([parts[0], pack(_layer(rng, 16, 96, zero="none"))]) is None  # zero modes differ


def test_cache_grows_and_keeps_its_positions(models: dict[str, Path]) -> None:
    """A sequence longer than the first reservation: the cache grows mid-sequence and keeps the positions."""
    ref = load_model(models["plain"], compile=False)
    lean = load_model(models["plain"])
    engine = lean._w4pack_lean
    engine._reserve(8)
    assert engine.max_len == 256
    kw = dict(GEN, max_new_tokens=300)
    import w4pack.runtime.lean as lean_mod

    real = lean_mod.LeanDecoder._reserve
    sizes = []

    def spy(self: LeanDecoder, total: int) -> None:
        real(self, min(total, 64) if not sizes else total)  # the first reservation small, as for a long run
        sizes.append(self.max_len)

    lean_mod.LeanDecoder._reserve = spy  # type: ignore[method-assign]
    try:
        engine.max_len = 0
        got = lean.generate(_ids(), **kw)
    finally:
        lean_mod.LeanDecoder._reserve = real  # type: ignore[method-assign]
    assert max(sizes) > 256 and sizes[0] == 256
    assert torch.equal(got, ref.generate(_ids(), **kw))


def test_min_new_tokens_keeps_going_past_an_end_as_transformers_does(models: dict[str, Path]) -> None:
    ref = load_model(models["plain"], compile=False)
    lean = load_model(models["plain"])
    free = ref.generate(_ids(), **GEN)[0, 7:].tolist()
    kw = dict(GEN, eos_token_id=free[1], min_new_tokens=5)
    want = ref.generate(_ids(), **kw)
    assert torch.equal(lean.generate(_ids(), **kw), want) and decode_mode(lean) == "lean"
    assert want.shape[1] >= 7 + 5


def test_logits_survive_the_next_step(models: dict[str, Path]) -> None:
    """A packed head (W4Linear) writes its output into a buffer it reuses: what step() and forward() return must
    still hold that step's logits after the next call."""
    model = load_model(models["plain"], compile=False)
    engine = LeanDecoder(model)
    real = engine.head

    class ReusingHead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.buf: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = real(x)
            if self.buf is None or self.buf.shape != y.shape:
                self.buf = torch.empty_like(y)
            return self.buf.copy_(y)

    ids = _ids(9, 4)[0]
    with torch.inference_mode():
        engine.pos = 0
        want = [engine.forward(ids[:4]).clone()] + [engine.step(int(t)).clone() for t in ids[4:7]]
        engine.head = ReusingHead()
        engine.pos = 0
        got = [engine.forward(ids[:4])] + [engine.step(int(t)) for t in ids[4:7]]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_sampling_defaults_are_transformers_own() -> None:
    """transformers samples with top_k 50 where neither the call nor the model's config sets one; the loop read the
    unset value as "no top-k" and drew from the whole vocabulary (SmolLM2: 29 of 30 tokens outside the top 50)."""
    import types

    from transformers import GenerationConfig

    from w4pack.runtime.lean import plan

    model = types.SimpleNamespace(generation_config=GenerationConfig())
    ids = torch.ones(1, 3, dtype=torch.long)
    _ids_, cfg, _s = plan(model, (ids,), {"do_sample": True, "max_new_tokens": 4})
    assert (cfg.top_k, cfg.top_p, cfg.temperature) == (50, 1.0, 1.0)
    _ids_, cfg, _s = plan(model, (ids,), {"do_sample": True, "max_new_tokens": 4, "top_k": 0, "temperature": 0.7})
    assert (cfg.top_k, cfg.temperature) == (0, 0.7)  # (what the call gives stays)
