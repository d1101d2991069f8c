"""w4pack.runtime.decode: the compiled static-cache decode path, its eager fallback, and the lean loop over it.

transformers compiles the decode step only on accelerators; here its ``compile_config._compile_all_devices``
makes it take the same path on the CPU, so the wrapper meets the real compiled call (and, with a backend that
raises, a real compile failure)."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rtn_helper import write_random_llama_gptq  # noqa: E402

from w4pack.convert import convert  # noqa: E402
from w4pack.loading import load_model  # noqa: E402
from w4pack.runtime.decode import (compile_wanted, decode_mode, remove_decode, use_compiled_decode,  # noqa: E402
                                   use_decode)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("decode")
    write_random_llama_gptq(tmp / "gptq", seed=3, std=0.1, group_size=32, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                            max_position_embeddings=128, eos_token_id=None, bos_token_id=1, pad_token_id=0)
    convert(tmp / "gptq", tmp / "w4")
    return tmp / "w4"


def test_compile_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("W4PACK_COMPILE", raising=False)
    assert compile_wanted("cuda", None) and compile_wanted("cuda:1", None)
    assert not compile_wanted("cpu", None)
    assert not compile_wanted("cuda", False) and compile_wanted("cpu", True)
    monkeypatch.setenv("W4PACK_COMPILE", "0")
    assert not compile_wanted("cuda", None)
    assert compile_wanted("cuda", True)  # an explicit argument wins over the environment


def test_cpu_load_decodes_lean_not_compiled(packed: Path) -> None:
    model = load_model(packed, device="cpu")  # the lean loop (tests/test_lean.py), never transformers' compile
    assert decode_mode(model) == "lean"
    assert model.generation_config.cache_implementation != "static"
    eager = load_model(packed, device="cpu", compile=False)
    assert decode_mode(eager) == "eager"


def _forced_compile(model: object, backend: object) -> None:
    from transformers import CompileConfig

    cfg = CompileConfig(backend=backend, mode=None, fullgraph=False)
    cfg._compile_all_devices = True
    model.generation_config.compile_config = cfg  # type: ignore[attr-defined]


def _ids() -> object:
    return torch.tensor([[1, 17, 42, 5, 9]])


def test_compiled_path_is_taken_and_matches_eager(packed: Path) -> None:
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    eager = load_model(packed, device="cpu").generate(_ids(), **kw)
    model = load_model(packed, device="cpu", compile=True)
    _forced_compile(model, "eager")  # dynamo traces the step; no C++ compiler needed
    torch._dynamo.reset()
    with torch.no_grad():
        got = model.generate(_ids(), **kw)
    assert torch.equal(got, eager)
    assert decode_mode(model) == "compiled"
    assert hasattr(model, "_compiled_call"), "transformers did not take its compiled static-cache path"


def test_compile_failure_falls_back_to_eager_once(packed: Path) -> None:
    calls = []

    def broken_backend(gm: object, example_inputs: object) -> object:
        calls.append(1)
        raise RuntimeError("Cannot find a working triton installation\nsecond line of the report")

    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    eager = load_model(packed, device="cpu").generate(_ids(), **kw)
    model = load_model(packed, device="cpu", compile=True)
    _forced_compile(model, broken_backend)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = model.generate(_ids(), **kw)
    assert calls, "the backend was never asked to compile"
    assert torch.equal(got, eager)
    mode = decode_mode(model)
    assert mode.startswith("eager (") and "triton" in mode and "\n" not in mode and "second line" not in mode
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert any("decoding eagerly" in m and "W4PACK_COMPILE=0" in m for m in msgs), msgs
    # from now on eager, without another attempt
    n = len(calls)
    with torch.no_grad():
        assert torch.equal(model.generate(_ids(), **kw), eager)
    assert len(calls) == n


def test_bad_arguments_are_not_retried(packed: Path) -> None:
    model = load_model(packed, device="cpu", compile=True)
    with pytest.raises((TypeError, ValueError)):
        model.generate(_ids(), max_new_tokens=-3)
    assert decode_mode(model) == "compiled"


def test_wrapping_twice_is_harmless(packed: Path) -> None:
    model = load_model(packed, device="cpu", compile=True)
    first = model.generate
    use_compiled_decode(model)
    assert model.generate is first


def _two() -> object:
    return torch.tensor([[1, 17, 42, 5, 9], [3, 8, 60, 2, 11]])


def test_default_on_cuda_is_lean_over_compiled(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # use_decode's CUDA default installed on a CPU model (the lean loop then is the CPU one; transformers'
    # compile forced onto the CPU): batch 1 goes to the lean loop, the rest to the compiled step, each with
    # transformers' eager tokens; a compile failure leaves the lean loop in place and the rest eager
    monkeypatch.delenv("W4PACK_COMPILE", raising=False)
    monkeypatch.delenv("W4PACK_LEAN", raising=False)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = load_model(packed, device="cpu", compile=False)
    one, two = ref.generate(_ids(), **kw), ref.generate(_two(), **kw)
    model = load_model(packed, device="cpu", compile=False)
    assert use_decode(model, "cuda", None) == "lean"
    assert model.generation_config.cache_implementation == "static"
    _forced_compile(model, "eager")
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(model.generate(_ids(), **kw), one)
        assert decode_mode(model) == "lean" and not hasattr(model, "_compiled_call")
        assert torch.equal(model.generate(_two(), **kw), two)
        mode = decode_mode(model)
        assert mode.startswith("compiled (") and "one sequence" in mode, mode
        assert hasattr(model, "_compiled_call"), "the batch did not reach transformers' compiled path"
        assert torch.equal(model.generate(_ids(), **kw), one) and decode_mode(model) == "lean"

    def broken_backend(gm: object, example_inputs: object) -> object:
        raise RuntimeError("Cannot find a working triton installation")

    _forced_compile(model, broken_backend)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True), torch.no_grad():
        warnings.simplefilter("always")
        assert torch.equal(model.generate(_two(), **kw), two)
        assert decode_mode(model).startswith("eager (RuntimeError: Cannot find a working triton")
        assert torch.equal(model.generate(_two(), **kw), two)
        assert decode_mode(model).startswith("eager (") and "one sequence" in decode_mode(model)
        assert torch.equal(model.generate(_ids(), **kw), one) and decode_mode(model) == "lean"
    remove_decode(model)
    assert "generate" not in model.__dict__ and decode_mode(model) == "eager"
    assert model.generation_config.cache_implementation is None and not model.generation_config.disable_compile
    with torch.no_grad():
        assert torch.equal(model.generate(_two(), **kw), two)


@pytest.mark.parametrize("device,chosen,env,want", [
    ("cuda", None, {}, ("lean", True)),
    ("cuda", None, {"W4PACK_LEAN": "0"}, ("compiled", True)),
    ("cuda", None, {"W4PACK_COMPILE": "0"}, ("lean", False)),
    ("cuda", True, {}, ("compiled", True)),
    ("cuda", False, {}, ("eager", False)),
    ("cuda", "lean", {}, ("lean", False)),
    ("cpu", None, {}, ("lean", False)),
    ("cpu", True, {}, ("compiled", True)),
    ("cpu", None, {"W4PACK_LEAN": "off"}, ("eager", False)),
])
def test_use_decode_choice(packed: Path, monkeypatch: pytest.MonkeyPatch, device: str, chosen: object,
                           env: dict, want: tuple) -> None:
    monkeypatch.delenv("W4PACK_COMPILE", raising=False)
    monkeypatch.delenv("W4PACK_LEAN", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model = load_model(packed, device="cpu", compile=False)
    mode = use_decode(model, device, chosen)
    assert (mode, model.generation_config.cache_implementation == "static") == want
    assert (getattr(model, "_w4pack_lean", None) is not None) == (mode == "lean")
    if mode == "lean":  # what the loop declines goes to the layer under it
        with torch.no_grad():
            model.generate(_two(), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert decode_mode(model).startswith(f"{'compiled' if want[1] else 'eager'} (")


@pytest.mark.gpu
def test_cuda_load_decodes_lean_over_compiled_by_default(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run the gpu suite on a machine with one)")
    monkeypatch.delenv("W4PACK_COMPILE", raising=False)
    monkeypatch.delenv("W4PACK_LEAN", raising=False)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    eager_model = load_model(packed, device="cuda", dtype="float16", compile=False)
    x, xx = _ids().cuda(), _two().cuda()
    with torch.no_grad():
        eager, eager2 = eager_model.generate(x, **kw), eager_model.generate(xx, **kw)
    model = load_model(packed, device="cuda", dtype="float16")
    assert model.generation_config.cache_implementation == "static"
    with torch.no_grad():
        for _ in range(3):  # compile, capture, replay
            assert torch.equal(model.generate(x, **kw), eager)
            assert decode_mode(model) == "lean", decode_mode(model)
            assert torch.equal(model.generate(xx, **kw), eager2)
            assert decode_mode(model).startswith("compiled ("), decode_mode(model)
    assert hasattr(model, "_compiled_call")
    only = load_model(packed, device="cuda", dtype="float16", engine="compiled")
    with torch.no_grad():
        assert torch.equal(only.generate(x, **kw), eager)
    assert decode_mode(only) == "compiled"


def test_no_memory_for_the_lean_loop_leaves_the_layer_under_it(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from w4pack.runtime import lean

    def no_memory(model: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.delenv("W4PACK_COMPILE", raising=False)
    monkeypatch.delenv("W4PACK_LEAN", raising=False)
    monkeypatch.setattr(lean, "build_engine", no_memory)
    model = load_model(packed, device="cpu", compile=False)
    mode = use_decode(model, "cuda", None)
    assert mode.startswith("compiled (no memory for the loop's stacked layers: CUDA out of memory."), mode
    assert "more detail" not in mode and getattr(model, "_w4pack_lean", None) is None
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = load_model(packed, device="cpu", compile=False).generate(_ids(), **kw)
        assert torch.equal(model.generate(_ids(), **kw), want)
