"""w4pack.runtime.lean_cuda: the CUDA-graph decode loop.

Its step is plain torch code: run eagerly on the CPU in float32 (``graphs=False``, the same code minus the
capture) it must decode what transformers decodes (same greedy tokens, same seeded samples, logits to float
rounding), over the stacked, fused and per-module projections, across attention buckets. Capture and replay
are checked where a CUDA device is present (marked gpu). The loop falls back with the reason for models and
calls it does not run."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_lean import GEN, _ids, _write, _write_qwen3  # noqa: E402  (the CPU loop's models and inputs)

from w4pack.errors import BadInputError  # noqa: E402
from w4pack.loading import load_model  # noqa: E402
from w4pack.runtime import lean  # noqa: E402
from w4pack.runtime.decode import decode_mode  # noqa: E402
from w4pack.runtime.lean import NotLean, plan, remove_lean_decode, use_lean_decode  # noqa: E402
from w4pack.runtime.lean_cuda import BUCKET, GraphDecoder, _Linear  # noqa: E402
from w4pack.runtime.run import dequantized_model  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lean_cuda")
    return {
        "plain": _write(tmp, "plain", max_position_embeddings=1024),
        "fused": _write(tmp, "fused", fuse="qkv,gate-up", seed=6),
        "odd": _write(tmp, "odd", seed=7, act_order=True, attention_bias=True, num_attention_heads=4,
                      num_key_value_heads=2, sym=False, intermediate_size=224),
        "qwen3": _write_qwen3(tmp),
        # head sizes the attention kernel takes: 64 (2 query heads per kv head), and 64 under q/k norms
        "wide": _write(tmp, "wide", seed=9, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=320, max_position_embeddings=1024),
        "qwen3-64": _write_qwen3(tmp, head_dim=64, folder="qwen3-64"),
    }


def _generate(engine: GraphDecoder, ids: torch.Tensor, **kw: object) -> torch.Tensor:
    got_ids, cfg, streamer = plan(engine.model, (ids,), dict(kw))
    with torch.inference_mode():
        return engine.generate(got_ids, cfg, streamer)


@pytest.mark.parametrize("name", ["plain", "fused", "odd", "float", "qwen3"])
def test_greedy_tokens_match_transformers(models: dict[str, Path], name: str) -> None:
    model = load_model(models["odd" if name == "float" else name], compile=False)
    if name == "float":
        dequantized_model(model)  # nn.Linear layers: stacked by concatenating their weights
    engine = GraphDecoder(model)
    assert not engine.graphs and engine.device.type == "cpu"
    if name in ("plain", "float"):
        assert all(L.qkv.stacked and L.gate_up.stacked for L in engine.layers)
    if name == "fused":
        assert all(len(L.qkv.calls) == 1 and not L.qkv.stacked for L in engine.layers)
    for seed in range(2):
        ids = _ids(5 + seed, seed)
        assert torch.equal(_generate(engine, ids, **GEN), model.generate(ids, **GEN)), seed


@pytest.mark.parametrize("name", ["plain", "odd", "qwen3"])
def test_sdpa_attention_decodes_what_transformers_decodes(models: dict[str, Path], name: str) -> None:
    """attn="sdpa": one scaled_dot_product_attention call per layer over the same bucket and mask; grouped
    query heads ("odd": 4 heads on 2 kv heads) ride as a kv head's queries. Same tokens, logits to rounding."""
    model = load_model(models[name], compile=False)
    engine = GraphDecoder(model, attn="sdpa")
    assert engine.attn == "sdpa"
    for seed in range(2):
        ids = _ids(5 + seed, seed)
        assert torch.equal(_generate(engine, ids, **GEN), model.generate(ids, **GEN)), seed
    ids = _ids(9, 4)[0]
    with torch.inference_mode():
        want = model(ids.unsqueeze(0)).logits[0][3:]
        engine.pos = 0
        engine._reserve(16)
        got = [engine.forward(ids[:4]).clone()] + [engine.step(int(t)).clone() for t in ids[4:]]
    rel = (torch.stack(got) - want).abs().amax(-1) / want.abs().amax(-1)
    assert float(rel.max()) < 1e-5, rel


@pytest.mark.parametrize("name", ["plain", "odd", "qwen3", "wide"])
def test_kernel_attention_decodes_what_transformers_decodes(models: dict[str, Path], name: str) -> None:
    """attn="kernel" off the GPU: the step calls ``w4pack::decode_attention``, whose torch reference runs here
    (the kernel's own arithmetic is checked in test_attention.py); one graph length covers the whole cache."""
    model = load_model(models[name], compile=False)
    engine = GraphDecoder(model, attn="kernel")
    assert engine.attn == "kernel"
    for seed in range(2):
        ids = _ids(5 + seed, seed)
        assert torch.equal(_generate(engine, ids, **GEN), model.generate(ids, **GEN)), seed
    assert engine.bucket(3) == engine.bucket(engine.max_len - 1) == engine.max_len


def test_attention_follows_the_environment_and_refuses_unknown_values(models: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(models["plain"], compile=False)
    monkeypatch.delenv("W4PACK_LEAN_ATTN", raising=False)
    assert GraphDecoder(model).attn == "matmul"  # (on the CPU; on CUDA "kernel" where it runs the model)
    monkeypatch.setenv("W4PACK_LEAN_ATTN", "SDPA")
    assert GraphDecoder(model).attn == "sdpa"
    assert GraphDecoder(model, attn="matmul").attn == "matmul"  # the argument wins
    monkeypatch.setenv("W4PACK_LEAN_ATTN", "flash")
    with pytest.raises(BadInputError, match="W4PACK_LEAN_ATTN='flash'.*matmul or sdpa or kernel"):
        GraphDecoder(model)


def test_fold_is_on_by_default_but_never_on_the_cpu(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Folding is asked for by default ($W4PACK_LEAN_FOLD unset, empty or 1) and refused by 0; off the GPU no
    projection folds (W4Linear.fold_ok: CUDA only), so normed / add stay the norm, the projection and the
    residual add as separate ops and the tokens stay transformers'. A value that is neither is refused."""
    model = load_model(models["odd"], compile=False)
    seen: list[bool] = []
    real = _Linear.may_fold

    def spy(self: _Linear, *args: object, **kw: object) -> bool:
        seen.append(True)
        return real(self, *args, **kw)

    monkeypatch.setattr(_Linear, "may_fold", spy)
    for env, asked in ((None, True), ("", True), ("1", True), ("on", True), ("0", False), ("off", False)):
        if env is None:
            monkeypatch.delenv("W4PACK_LEAN_FOLD", raising=False)
        else:
            monkeypatch.setenv("W4PACK_LEAN_FOLD", env)
        seen.clear()
        engine = GraphDecoder(model)
        assert (engine.fold, engine.folded, bool(seen)) == (False, 0, asked), env
    assert GraphDecoder(model, fold=True).folded == 0 and seen  # (the argument wins over the environment)
    monkeypatch.setenv("W4PACK_LEAN_FOLD", "2")
    with pytest.raises(BadInputError, match="W4PACK_LEAN_FOLD='2': set 1 .* 0 "):
        GraphDecoder(model)
    monkeypatch.delenv("W4PACK_LEAN_FOLD")
    engine = GraphDecoder(model)
    assert not any(lin.fold for L in engine.layers for lin in (L.qkv, L.o, L.gate_up, L.down))
    ids = _ids(6, 1)
    assert torch.equal(_generate(engine, ids, **GEN), model.generate(ids, **GEN))


def test_what_folds_where_the_gemv_cannot_run_the_layer(models: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """may_fold: a layer the gemv kernel cannot run (fold_ok False) folds nothing (its residual add, too, stays
    the unfolded add); one it runs folds the norm, the SwiGLU and the residual add; float or split projections
    fold nothing."""
    model = load_model(models["plain"], compile=False)
    engine = GraphDecoder(model)
    L = engine.layers[0]
    cuda, half = torch.device("cuda", 0), torch.float16
    for gemv_runs in (False, True):
        for lin in (L.qkv, L.o, L.down):
            monkeypatch.setattr(lin.calls[0], "fold_ok", lambda device, dtype, ok=gemv_runs: ok)
        norm = torch.ones(L.qkv.calls[0].in_features, dtype=half)
        assert L.qkv.may_fold(cuda, half, norm.to("meta")) is False  # (the norm weight on another device)
        assert L.qkv.may_fold(norm.device, half, norm) is gemv_runs
        assert L.o.may_fold(cuda, half) is gemv_runs
        assert L.down.may_fold(cuda, half, swiglu=True) is gemv_runs and L.down.swiglu is gemv_runs
    fl = GraphDecoder(dequantized_model(load_model(models["plain"], compile=False)))
    assert fl.layers[0].down.may_fold(cuda, half) is False  # (a float nn.Linear)


def test_traced_step_decodes_the_same(models: dict[str, Path]) -> None:
    """fuse: the step goes through torch.compile whole (fullgraph: no graph break, the buffer writes traced);
    the "eager" backend runs dynamo's graph without Inductor, so this needs no compiler."""
    model = load_model(models["plain"], compile=False)
    engine = GraphDecoder(model, fuse="eager")
    kw = dict(GEN, max_new_tokens=BUCKET + 4)  # two buckets: one traced graph each
    want = model.generate(_ids(), **kw)
    assert torch.equal(_generate(engine, _ids(), **kw), want)
    assert sorted(engine._compiled) == [BUCKET, 2 * BUCKET] and not engine.note
    sdpa = GraphDecoder(model, fuse="eager", attn="sdpa")  # (the attention call traces whole too)
    assert torch.equal(_generate(sdpa, _ids(), **kw), want)
    assert sorted(sdpa._compiled) == [BUCKET, 2 * BUCKET] and sdpa.fuse == "eager"
    kern = GraphDecoder(model, fuse="eager", attn="kernel")  # (the op traces whole; one length for the cache)
    assert torch.equal(_generate(kern, _ids(), **kw), want)
    assert list(kern._compiled) == [kern.max_len] and kern.fuse == "eager"


def test_many_loops_in_one_process_all_compile(models: dict[str, Path]) -> None:
    """Each loop and bucket compiles its own copy of the step: loops built one after another in one process (a
    server, a benchmark's variants) stay compiled past dynamo's recompile limit of one function (8)."""
    import torch._dynamo

    model = load_model(models["plain"], compile=False)
    limit = int(torch._dynamo.config.recompile_limit)
    kw = dict(GEN, max_new_tokens=3)
    want = model.generate(_ids(), **kw)
    for i in range(limit + 2):
        engine = GraphDecoder(model, fuse="eager")
        assert torch.equal(_generate(engine, _ids(), **kw), want), i
        assert engine.fuse == "eager" and not engine.note and list(engine._compiled) == [BUCKET], (i, engine.note)


def test_a_step_that_does_not_compile_runs_unfused_and_says_why(models: dict[str, Path]) -> None:
    model = load_model(models["plain"], compile=False)

    def broken(gm: object, example_inputs: object) -> object:
        raise RuntimeError("no working C++ compiler\nsecond line")

    engine = GraphDecoder(model, fuse=broken)  # type: ignore[arg-type]
    with pytest.warns(RuntimeWarning, match="could not compile its step"):
        got = _generate(engine, _ids(), **GEN)
    assert torch.equal(got, model.generate(_ids(), **GEN))
    assert engine.fuse is None and engine.note.startswith("unfused step: torch.compile failed:")
    assert "no working C++ compiler" in engine.note and "second line" not in engine.note


def test_fuse_defaults_to_graphs_unless_the_environment_says(models: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(models["plain"], compile=False)
    monkeypatch.delenv("W4PACK_LEAN_FUSE", raising=False)
    assert GraphDecoder(model).fuse is None  # no graphs (the CPU): nothing to fuse for
    monkeypatch.setenv("W4PACK_LEAN_FUSE", "1")
    assert GraphDecoder(model).fuse == "inductor"
    monkeypatch.setenv("W4PACK_LEAN_FUSE", "0")
    assert GraphDecoder(model, graphs=False).fuse is None


def test_step_logits_match_transformers_forward(models: dict[str, Path]) -> None:
    for name in ("plain", "odd"):
        model = load_model(models[name], compile=False)
        engine = GraphDecoder(model)
        ids = _ids(9, 4)[0]
        with torch.inference_mode():
            want = model(ids.unsqueeze(0)).logits[0]
            engine.pos = 0
            engine._reserve(16)
            got = [engine.forward(ids[:4]).clone()] + [engine.step(int(t)).clone() for t in ids[4:]]
        ref = want[3:]
        rel = (torch.stack(got) - ref).abs().amax(-1) / ref.abs().amax(-1)
        assert float(rel.max()) < 1e-5, (name, rel)


def test_long_run_crosses_buckets_and_grows_the_cache(models: dict[str, Path]) -> None:
    model = load_model(models["plain"], compile=False)
    engine = GraphDecoder(model)
    kw = dict(GEN, max_new_tokens=2 * BUCKET + 20)
    ids = _ids()
    want = model.generate(ids, **kw)
    engine.first_reserve = 100  # the run must grow the cache mid-sequence, keeping its positions
    buckets = []
    real = engine.bucket

    def spy(pos: int) -> int:
        b = real(pos)
        if not buckets or buckets[-1] != b:
            buckets.append(b)
        return b

    engine.bucket = spy  # type: ignore[method-assign]
    assert torch.equal(_generate(engine, ids, **kw), want)
    assert buckets == [BUCKET, 2 * BUCKET, 4 * BUCKET] and engine.max_len == 4 * BUCKET


def test_min_new_tokens_eos_and_streaming_match_transformers(models: dict[str, Path]) -> None:
    model = load_model(models["plain"], compile=False)
    engine = GraphDecoder(model)
    free = model.generate(_ids(), **GEN)[0, 7:].tolist()
    eos = free[2]
    for extra in ({"eos_token_id": eos}, {"eos_token_id": [eos, 79], "min_new_tokens": 6}):
        kw = dict(GEN, **extra)
        want = model.generate(_ids(), **kw)

        class Sink:
            got: list[list[int]] = []

            def put(self, v: torch.Tensor) -> None:
                self.got.append(v.reshape(-1).tolist())

            def end(self) -> None:
                self.got.append(["end"])  # type: ignore[list-item]

        sink = Sink()
        sink.got = []
        got = _generate(engine, _ids(), streamer=sink, **kw)
        assert torch.equal(got, want), extra
        assert [t for part in sink.got[1:-1] for t in part] == got[0, 7:].tolist() and sink.got[-1] == ["end"]
    assert want.shape[1] > 7 + free.index(eos) + 1  # min_new_tokens kept it going past the first end


def test_seeded_sampling_draws_what_transformers_draws(models: dict[str, Path]) -> None:
    model = load_model(models["plain"], compile=False)
    engine = GraphDecoder(model)
    for extra in ({"top_k": 0, "top_p": 0.9}, {"top_k": 20, "top_p": None, "min_new_tokens": 4,
                                                "eos_token_id": 5}):
        kw = dict(max_new_tokens=10, do_sample=True, temperature=0.8, pad_token_id=0, **extra)
        torch.manual_seed(11)
        want = model.generate(_ids(), **kw)
        torch.manual_seed(11)
        assert torch.equal(_generate(engine, _ids(), **kw), want), extra


def test_models_and_calls_it_does_not_run_give_the_reason(models: dict[str, Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(models["plain"], compile=False)
    with pytest.raises(NotLean, match="CUDA graphs need a model on a CUDA device"):
        GraphDecoder(model, graphs=True)
    with pytest.raises(NotLean, match="float16, bfloat16 or float32"):
        GraphDecoder(load_model(models["plain"], compile=False).to(torch.float64))
    partial = load_model(models["plain"], compile=False)  # the shared walk's checks, e.g. partial rotary
    partial.model.rotary_emb.inv_freq = partial.model.rotary_emb.inv_freq[:4].clone()
    with pytest.raises(NotLean, match="rotary embedding of 8 dimensions on heads of 16"):
        GraphDecoder(partial)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(NotLean, match="model type 'gpt2'"):
        GraphDecoder(transformers.GPT2LMHeadModel(cfg))
    # through generate: the CUDA loop (run eagerly here) answers batch 1, transformers the rest, with the reason
    monkeypatch.setattr(lean, "build_engine", lambda m: GraphDecoder(m, graphs=False))
    assert use_lean_decode(model) == "lean" and isinstance(model._w4pack_lean, GraphDecoder)
    ref = load_model(models["plain"], compile=False)
    two = torch.cat([_ids(), _ids(seed=1)])
    assert torch.equal(model.generate(two, **GEN), ref.generate(two, **GEN))
    assert decode_mode(model).startswith("eager (") and "one sequence" in decode_mode(model)
    kw = dict(GEN, num_beams=2)
    assert torch.equal(model.generate(_ids(), **kw), ref.generate(_ids(), **kw))
    assert "num_beams" in decode_mode(model)
    assert torch.equal(model.generate(_ids(), **GEN), ref.generate(_ids(), **GEN))
    assert decode_mode(model) == "lean"
    remove_lean_decode(model)
    assert decode_mode(model) == "eager" and "generate" not in model.__dict__


def test_a_failed_capture_runs_the_step_eagerly_and_says_why(models: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(models["plain"], compile=False)
    ref = load_model(models["plain"], compile=False)
    engine = GraphDecoder(model, graphs=False)
    engine.graphs = True  # as on CUDA; the capture fails the way an uncapturable op makes it fail

    def fail(bucket: int) -> None:
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(engine, "_capture", fail)
    monkeypatch.setattr(lean, "build_engine", lambda m: engine)
    use_lean_decode(model)
    with pytest.warns(RuntimeWarning, match="could not capture"):
        got = model.generate(_ids(), **GEN)
    assert torch.equal(got, ref.generate(_ids(), **GEN))
    assert not engine.graphs
    mode = decode_mode(model)
    assert mode.startswith("lean (eager step: CUDA graph capture failed: RuntimeError: operation not permitted")
    assert "second line" not in mode


def test_engine_option(models: dict[str, Path]) -> None:
    assert decode_mode(load_model(models["plain"], engine="lean")) == "lean"
    assert decode_mode(load_model(models["plain"], engine="eager")) == "eager"
    assert decode_mode(load_model(models["plain"], engine="auto")) == "lean"  # the CPU default
    with pytest.raises(BadInputError, match="engine must be one of"):
        load_model(models["plain"], engine="graphs")
    with pytest.raises(BadInputError, match="contradicts"):
        load_model(models["plain"], engine="lean", compile=True)


def test_cli_refuses_eager_with_another_engine(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from w4pack.cli import main

    assert main(["run", str(models["plain"]), "--prompt", "x", "--eager", "--engine", "lean"]) == 2
    err = capsys.readouterr().err
    assert "--eager contradicts --engine lean" in err and len(err.strip().splitlines()) == 1


# -- on a GPU: capture and replay ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["plain", "fused", "odd"])
def test_graph_replay_matches_the_eager_step(models: dict[str, Path], name: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The captured (unfused) step decodes what the same step run eagerly decodes, token for token, and
    transformers' float16 generate agrees on the tokens (with the default fold: the residual adds rounded as
    the unfolded adds are); crossing a bucket captures a second graph."""
    monkeypatch.setenv("W4PACK_LEAN_FUSE", "0")
    monkeypatch.delenv("W4PACK_LEAN_FOLD", raising=False)
    model = load_model(models[name], device="cuda", dtype="float16", engine="lean")
    assert decode_mode(model) == "lean"
    graphed = model._w4pack_lean
    assert isinstance(graphed, GraphDecoder) and graphed.graphs and graphed.fuse is None and graphed.folded > 0
    eager = GraphDecoder(model, graphs=False)
    ids = _ids().cuda()
    kw = dict(GEN, max_new_tokens=BUCKET + 8)
    got = model.generate(ids, **kw)
    assert graphed.captures == 2  # the first bucket, then the second when the sequence reached it
    assert torch.equal(got, _generate(eager, ids, **kw))
    again = model.generate(ids, **kw)
    assert torch.equal(again, got) and graphed.captures == 2  # replayed, not recaptured
    assert decode_mode(model) == "lean"
    ref = load_model(models[name], device="cuda", dtype="float16", engine="eager", attn_implementation="eager")
    short = dict(GEN, max_new_tokens=12)
    assert torch.equal(model.generate(ids, **short), ref.generate(ids, **short))


@pytest.mark.gpu
def test_fused_graph_matches_the_fused_step_run_eagerly(models: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's step (the CUDA default), captured, decodes what the same compiled step decodes uncaptured,
    and its logits follow transformers' to float16 rounding."""
    monkeypatch.delenv("W4PACK_LEAN_FUSE", raising=False)
    model = load_model(models["plain"], device="cuda", dtype="float16", engine="eager")
    fused, fused_eager = GraphDecoder(model), GraphDecoder(model, graphs=False, fuse=True)
    assert fused.fuse == "inductor" and fused.graphs
    ids = _ids().cuda()
    kw = dict(GEN, max_new_tokens=24)
    assert torch.equal(_generate(fused, ids, **kw), _generate(fused_eager, ids, **kw))
    assert fused.captures == 1 and fused.graphs and fused.fuse and not fused.note
    _logits_follow_transformers(model, fused)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["matmul", "sdpa"])
def test_graph_logits_match_transformers_float16(models: dict[str, Path], attn: str) -> None:
    model = load_model(models["plain"], device="cuda", dtype="float16", engine="eager")
    engine = GraphDecoder(model, fuse=False, attn=attn)
    _logits_follow_transformers(model, engine)
    assert engine.captures == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["plain", "odd"])
def test_fused_sdpa_graph_decodes_what_the_matmul_graph_decodes(models: dict[str, Path], name: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """$W4PACK_LEAN_ATTN=sdpa under Inductor and capture (the bench's A/B of the two): across a bucket, every
    greedy token is an argmax of the matmul attention's logits on the same tokens, to float16 rounding, and
    the logits follow transformers'."""
    monkeypatch.delenv("W4PACK_LEAN_FUSE", raising=False)
    model = load_model(models[name], device="cuda", dtype="float16", engine="eager")
    monkeypatch.setenv("W4PACK_LEAN_ATTN", "sdpa")
    sdpa = GraphDecoder(model)
    monkeypatch.delenv("W4PACK_LEAN_ATTN")
    plain = GraphDecoder(model, attn="matmul")
    assert (sdpa.attn, plain.attn) == ("sdpa", "matmul") and sdpa.fuse == "inductor" and sdpa.graphs
    ids = _ids().cuda()
    kw = dict(GEN, max_new_tokens=BUCKET + 8)
    got = _generate(sdpa, ids, **kw)
    assert got.shape[1] == ids.shape[1] + BUCKET + 8 and sdpa.captures == 2 and not sdpa.note
    _greedy_by_rounding(plain, got[0], ids.shape[1])
    _logits_follow_transformers(model, GraphDecoder(model, attn="sdpa"))


@pytest.mark.gpu
@pytest.mark.parametrize("name,new", [("wide", BUCKET + 8), ("qwen3-64", 40)])
def test_kernel_attention_graph_decodes_what_the_matmul_graph_decodes(models: dict[str, Path], name: str, new: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel attention, the CUDA default where it runs the model, under Inductor and capture: one graph for
    the whole cache; every greedy token is an argmax of the matmul attention's logits on the same tokens, to
    float16 rounding, and the logits follow transformers' (q/k norms included)."""
    monkeypatch.delenv("W4PACK_LEAN_FUSE", raising=False)
    model = load_model(models[name], device="cuda", dtype="float16", engine="eager")
    monkeypatch.delenv("W4PACK_LEAN_ATTN", raising=False)
    kern, plain = GraphDecoder(model), GraphDecoder(model, attn="matmul")
    assert kern.attn == "kernel" and kern.fuse == "inductor" and kern.graphs
    ids = _ids().cuda()
    got = _generate(kern, ids, **dict(GEN, max_new_tokens=new))
    assert got.shape[1] == ids.shape[1] + new and kern.captures == 1 and not kern.note
    _greedy_by_rounding(plain, got[0], ids.shape[1])
    _logits_follow_transformers(model, GraphDecoder(model, attn="kernel"))


@pytest.mark.gpu
def test_kernel_attention_falls_back_where_the_kernel_does_not_run(models: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for by name, the kernel that cannot run the model warns; as the default it gives way silently."""
    model = load_model(models["plain"], device="cuda", dtype="float16", engine="eager")  # head size 16
    with pytest.warns(RuntimeWarning, match="head size 16.*attending by matmul"):
        engine = GraphDecoder(model, attn="kernel")
    assert engine.attn == "matmul"
    monkeypatch.delenv("W4PACK_LEAN_ATTN", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GraphDecoder(model).attn == "matmul"


def _forced_logits(engine: GraphDecoder, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """[len(ids) - prefix + 1, vocab] float32: the logits after ids[:prefix], then after each further token."""
    with torch.inference_mode():
        engine.pos = 0
        engine._reserve(len(ids))
        got = [engine.forward(ids[:prefix]).float()] + [engine.step(int(t)).float().clone() for t in ids[prefix:]]
    return torch.stack(got)


def _greedy_by_rounding(ref: GraphDecoder, seq: torch.Tensor, prompt: int, tol: float = 2e-2) -> None:
    """Each token of ``seq`` past the prompt is an argmax of ``ref``'s logits on the same tokens to within
    ``tol`` of their largest magnitude: greedy decoding by a loop that rounds differently (a kernel that sums
    in another order) may pick another of near-equal logits, and from there decode another text."""
    logits = _forced_logits(ref, seq[:-1], prompt)  # logits[i] chooses seq[prompt + i]
    chosen = logits.gather(1, seq[prompt:].unsqueeze(1)).squeeze(1)
    best, scale = logits.amax(1), logits.abs().amax(1)
    gap = (best - chosen) / scale
    assert float(gap.max()) <= tol, (int(gap.argmax()), float(gap.max()))


def _logits_follow_transformers(model: torch.nn.Module, engine: GraphDecoder) -> None:
    ids = _ids(9, 4)[0].cuda()
    with torch.inference_mode():
        want = model(ids.unsqueeze(0)).logits[0].float()
    ref = want[3:]
    rel = (_forced_logits(engine, ids, 4) - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert float(rel.max()) < 2e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["plain", "fused", "odd"])
def test_folded_step_follows_the_unfolded_one(models: dict[str, Path], name: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """fold=True: every packed projection folds (the norms into q/k/v and gate/up, the SwiGLU into down, the
    residual adds into o and down), captured plain and through Inductor; logits follow transformers' and the
    unfolded loop's to float16 rounding, and every greedy token is an argmax of the unfolded loop's logits to
    that rounding (the kernels sum the norm in another order, so near-equal logits may swap)."""
    monkeypatch.delenv("W4PACK_LEAN_FOLD", raising=False)
    model = load_model(models[name], device="cuda", dtype="float16", engine="eager")
    n_layers = model.config.num_hidden_layers
    plain = GraphDecoder(model, fuse=False, fold=False)
    folded = GraphDecoder(model, fuse=False)  # (the default folds)
    # "odd" has a permutation per projection (act-order): q/k/v and gate/up stay separate calls, unfolded
    per_layer = {"plain": 4, "fused": 4, "odd": 2}[name]
    assert (plain.folded, folded.folded, folded.fold) == (0, per_layer * n_layers, True)
    assert all(L.o.fold and L.down.fold and L.down.swiglu for L in folded.layers)  # (llama: SiLU)
    ids = _ids().cuda()
    kw = dict(GEN, max_new_tokens=24)
    got = _generate(folded, ids, **kw)
    assert folded.captures == 1 and not folded.note
    _greedy_by_rounding(plain, got[0], ids.shape[1])
    seq = _ids(32, 9)[0].cuda()
    want, have = _forced_logits(plain, seq, 4), _forced_logits(folded, seq, 4)
    rel = (have - want).abs().amax(-1) / want.abs().amax(-1)
    assert float(rel.max()) < 2e-2, rel
    _logits_follow_transformers(model, GraphDecoder(model, fuse=False, fold=True))
    inductor = GraphDecoder(model, fold=True)
    assert inductor.fuse == "inductor"
    got = _generate(inductor, ids, **kw)
    assert inductor.captures == 1 and not inductor.note
    _greedy_by_rounding(plain, got[0], ids.shape[1])
