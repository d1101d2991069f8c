"""`w4pack run` and w4pack.run: generation and perplexity with the native kernels, against transformers' own float
model holding the same dequantized weights. Tiny random model + character tokenizer for the CLI, and the real
SmolLM2-135M-Instruct (converted from its Q4_1 GGUF) for the issue's 20-token and perplexity checks."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rtn_helper import write_random_llama_gptq  # noqa: E402

from w4pack.checkpoint import open_checkpoint  # noqa: E402
from w4pack.cli import main  # noqa: E402
from w4pack.convert import convert  # noqa: E402
from w4pack.dtypes import to_float32  # noqa: E402
from w4pack.errors import BadInputError  # noqa: E402
from w4pack.loading import check_device, load_model, load_tokenizer  # noqa: E402
from w4pack.run import dequantized_model, generate, perplexity  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "tests" / "data" / "ppl_sample.txt"


def float_reference(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' own model from config.json, with torch's load_state_dict of the exact dequantized weights.

    Independent of w4pack's loader and kernels: only the checkpoint reader and the canonical dequantize are shared.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    del cfg.quantization_config
    sd = {}
    with open_checkpoint(path) as ck:
        fused = ck.manifest.get("fused") or {}
        for name in ck.layers:
            layer = ck.layer(name)
            w = torch.from_numpy(layer.dequantize(np.float32))
            b = None if layer.bias is None else torch.from_numpy(to_float32(layer.bias, layer.bias_dtype))
            parts = fused.get(name) or [{"name": name, "rows": [0, w.shape[0]]}]
            for p in parts:
                lo, hi = p["rows"]
                sd[p["name"] + ".weight"] = w[lo:hi]
                if b is not None:
                    sd[p["name"] + ".bias"] = b[lo:hi]
        for name in ck.passthrough:
            arr = np.array(ck.raw(name))
            t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if ck.dtype_name(name) == "bfloat16" \
                else torch.from_numpy(arr)
            sd[name] = t.float()
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model.to(dtype).eval()


# -------------------------------------------------------------------------------------------------
# a tiny model with a character tokenizer, written as GPTQ and converted
# -------------------------------------------------------------------------------------------------
def _char_tokenizer(folder: Path) -> list[Path]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return [p for p in folder.iterdir() if p.is_file()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tiny")
    write_random_llama_gptq(tmp / "gptq", seed=1, std=0.1, side_files=_char_tokenizer(tmp / "tok"), group_size=32,
                            sym=False, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=112, max_position_embeddings=128,
                            eos_token_id=None, bos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    out = tmp / "w4"
    convert(tmp / "gptq", out, fuse="qkv,gate-up")
    return out


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_greedy_generation_matches_float_model(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _err = _cli(capsys, "run", str(tiny), "--prompt", "The lamp was lit", "--max-new-tokens", "6",
                         "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["new_tokens"] == 6 and doc["precision"] == "exact" and doc["sampling"] == "greedy"
    assert "tokens_per_s" in doc and "prefill_s" in doc
    tok = load_tokenizer(tiny)
    ref = float_reference(tiny)
    ids = tok("The lamp was lit", return_tensors="pt")
    with torch.no_grad():
        want = ref.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert doc["token_ids"] == want[0, ids["input_ids"].shape[1]:].tolist()
    assert doc["completion"] == tok.decode(doc["token_ids"], skip_special_tokens=True)
    rc, out, err = _cli(capsys, "run", str(tiny), "--prompt", "The lamp was lit", "--max-new-tokens", "6")
    assert rc == 0 and out.startswith("The lamp was lit") and "tokens/s" in err


def test_sampling_is_repeatable_with_a_seed(tiny: Path) -> None:
    model, tok = load_model(tiny), load_tokenizer(tiny)
    a = generate((model, tok), "keeper", max_new_tokens=8, temperature=1.5, seed=3)
    b = generate((model, tok), "keeper", max_new_tokens=8, temperature=1.5, seed=3)
    greedy = generate((model, tok), "keeper", max_new_tokens=8)
    assert a["token_ids"] == b["token_ids"] and a["sampling"] == {"temperature": 1.5, "seed": 3}
    assert len(greedy["token_ids"]) == 8


def test_cli_perplexity_matches_float_model(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _err = _cli(capsys, "run", str(tiny), "--perplexity", str(SAMPLE), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["window"] == 128 and doc["scored_tokens"] > 1000
    # independent reference: transformers' float model, cross-entropy per non-overlapping window
    tok, ref = load_tokenizer(tiny), float_reference(tiny)
    ids = tok(SAMPLE.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][0]
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, 128):
            chunk = ids[s:s + 128]
            if chunk.numel() < 2:
                break
            logits = ref(chunk[None]).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
            count += chunk.numel() - 1
    assert doc["scored_tokens"] == count
    assert abs(doc["perplexity"] / math.exp(total / count) - 1) < 1e-4


def test_dequantized_model_replaces_every_packed_layer(tiny: Path) -> None:
    from w4pack.torch_module import W4FusedLinear, W4Linear, W4SliceLinear

    model = dequantized_model(load_model(tiny))
    assert not any(isinstance(m, (W4Linear, W4FusedLinear, W4SliceLinear)) for m in model.modules())
    ref = float_reference(tiny)
    x = torch.randint(4, 100, (1, 12))
    with torch.no_grad():
        assert torch.allclose(model(x).logits, ref(x).logits, atol=1e-5)


def test_usage_errors_exit_2_with_one_line(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", str(tiny)],
                 ["run", str(tiny), "--prompt", "x", "--perplexity", str(SAMPLE)],
                 ["run", str(tmp_path / "nothing"), "--prompt", "x"],
                 ["run", str(tiny), "--prompt", "x", "--chat"],
                 ["run", str(tiny), "--perplexity", str(tmp_path / "missing.txt")]):
        rc, _out, err = _cli(capsys, *argv)
        assert rc == 2, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("extra, says", [
    (["--perplexity", str(SAMPLE), "--chat", "--max-new-tokens", "5", "--temperature", "1"],
     "--max-new-tokens, --temperature, --chat apply to generation (--prompt) only, not --perplexity"),
    (["--perplexity", str(SAMPLE), "--engine", "lean"], "--engine applies to generation (--prompt) only"),
    (["--prompt", "x", "--window", "8"], "--window applies to --perplexity only, not --prompt"),
])
def test_options_of_the_other_mode_are_refused(extra: list[str], says: str, tiny: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Given to the mode that does not read them they were dropped without a word (a reviewer's runs)."""
    rc, out, err = _cli(capsys, "run", str(tiny), *extra)
    assert rc == 2 and out == "" and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("device", ["tpu", "cuda:abc", "cuda:-1", "meta", "CPU", " cpu", "cuda:"])
def test_bad_device_is_a_usage_error(device: str, tiny: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--device is checked before anything is loaded: one line, exit 2 (torch's RuntimeError was "unexpected")."""
    for path in (tiny, tmp_path / "nothing"):
        rc, _out, err = _cli(capsys, "run", str(path), "--prompt", "x", "--device", device)
        assert rc == 2 and err.count("\n") == 1, err
        assert "device must be cpu, cuda or cuda:N" in err and repr(device) in err and "unexpected" not in err
    with pytest.raises(BadInputError, match="device must be"):
        load_model(tiny, device=device)


@pytest.mark.parametrize("var,value", [("W4PACK_ISA", "sse9"), ("W4PACK_THREADS", "0"), ("W4PACK_THREADS", "x")])
def test_bad_kernel_environment_is_a_usage_error(var: str, value: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A $W4PACK_ISA or $W4PACK_THREADS the CPU kernels cannot use is refused before the model is read."""
    monkeypatch.setenv(var, value)
    rc, _out, err = _cli(capsys, "run", str(tmp_path / "nothing"), "--prompt", "x")
    assert rc == 2 and err.count("\n") == 1 and var in err, err


def test_good_device_names_are_accepted() -> None:
    assert [check_device(d) for d in ("cpu", "cuda", "cuda:0", "cuda:12")] == ["cpu", "cuda", "cuda:0", "cuda:12"]
    assert check_device(torch.device("cpu")) == "cpu" and check_device(torch.device("cuda", 1)) == "cuda:1"
    assert check_device("cpu:0") == check_device(torch.device("cpu", 0)) == "cpu"  # (the string was refused)
    with pytest.raises(BadInputError, match="device must be cpu, cuda or cuda:N"):
        check_device(np.array(["cpu", "cuda"]))  # (not a truth-value error from comparing an array)


# -------------------------------------------------------------------------------------------------
# the real model
# -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    from conftest import smollm2_gguf

    gguf_path = smollm2_gguf()
    out = tmp_path_factory.mktemp("smollm2") / "w4"
    convert(gguf_path, out)
    return out


PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smol_models(smollm2: Path):
    """(tokenizer, W4Linear model on CPU, transformers float reference), built once for the module."""
    return load_tokenizer(smollm2), load_model(smollm2, device="cpu", precision="exact"), float_reference(smollm2)


def test_smollm2_greedy_20_tokens_and_logits_match_float_model(smol_models) -> None:
    tok, packed, ref = smol_models
    got = generate((packed, tok), PROMPT, max_new_tokens=20)
    ids = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        want = ref.generate(**ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
    n_prompt = ids["input_ids"].shape[1]
    assert got["token_ids"] == want[0, n_prompt:].tolist()
    assert len(got["token_ids"]) == 20
    assert got["completion"].startswith(" Paris")
    with torch.no_grad():  # per-token logits over prompt + continuation
        a, b = packed(want).logits[0], ref(want).logits[0]
    rel = ((a - b).abs().amax(-1) / b.abs().amax(-1))
    assert float(rel.max()) < 1e-3, rel
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_smollm2_perplexity_within_half_a_percent(smol_models) -> None:
    tok, packed, ref = smol_models
    got = perplexity((packed, tok), SAMPLE)
    want = perplexity((ref, tok), SAMPLE)
    assert got["scored_tokens"] == want["scored_tokens"] > 300
    assert got["precision"] == "exact" and want["precision"] == "float"
    assert abs(got["perplexity"] / want["perplexity"] - 1) < 0.005


@pytest.mark.gpu
def test_smollm2_on_cuda_same_tokens_batched_and_graph_captured(smollm2: Path) -> None:
    tok = load_tokenizer(smollm2)
    cpu = generate((load_model(smollm2, device="cpu"), tok), PROMPT, max_new_tokens=20)
    gpu_model = load_model(smollm2, device="cuda", dtype=torch.float32)
    gpu = generate((gpu_model, tok), PROMPT, max_new_tokens=20)
    assert gpu["token_ids"] == cpu["token_ids"]
    # batched generation with left padding: each row equals its own single-row run
    prompts = [PROMPT, "A lighthouse keeper needs"]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    with torch.no_grad():
        batch = gpu_model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    for i, p in enumerate(prompts):
        single = generate((gpu_model, tok), p, max_new_tokens=8)
        assert batch[i, enc["input_ids"].shape[1]:].tolist() == single["token_ids"]
    # CUDA graph capture of a decode-shaped forward (one token, static cache-free input)
    x = torch.tensor([[tok.eos_token_id]], device="cuda")
    with torch.no_grad():
        eager = gpu_model(x).logits.clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = gpu_model(x).logits
        graph.replay()
        torch.cuda.synchronize()
    assert torch.allclose(static, eager, atol=1e-4, rtol=1e-4)


def test_cli_engine_picks_the_decode_path(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ("run", str(tiny), "--prompt", "The lamp was lit", "--max-new-tokens", "5", "--json")
    docs = {}
    for engine in ("eager", "lean"):
        rc, out, _err = _cli(capsys, *common, "--engine", engine)
        assert rc == 0
        docs[engine] = json.loads(out)
        assert docs[engine]["decode"] == engine
    assert docs["eager"]["token_ids"] == docs["lean"]["token_ids"]
    assert "attention" not in docs["lean"]  # (the CPU loop attends one way)


def test_lean_loop_facts_name_the_cuda_loops_attention_and_fold() -> None:
    """Only where the lean loop answered and it is the CUDA loop (whose ``attn`` says how it attends and
    ``folded`` how many projections fold)."""
    from types import SimpleNamespace

    from w4pack.runtime.run import lean_loop_facts

    cuda_loop = SimpleNamespace(_w4pack_lean=SimpleNamespace(attn="kernel", folded=96), w4pack_decode="lean")
    assert lean_loop_facts(cuda_loop) == {"attention": "kernel", "folded": 96}
    cuda_loop.w4pack_decode = "lean (eager step: CUDA graph capture failed: x)"  # (the loop answered all the same)
    assert lean_loop_facts(cuda_loop) == {"attention": "kernel", "folded": 96}
    cuda_loop.w4pack_decode = "compiled (the lean loop decodes one sequence at a time)"
    assert lean_loop_facts(cuda_loop) == {}
    assert lean_loop_facts(SimpleNamespace(_w4pack_lean=SimpleNamespace(), w4pack_decode="lean")) == {}
    assert lean_loop_facts(SimpleNamespace(w4pack_decode="eager")) == {}


def test_stats_line_names_the_lean_loops_attention_and_fold(tiny: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The stats line carries what generate reports of the CUDA loop (stood in for here: the CPU has none), and
    leaves the fold out where nothing folded."""
    import w4pack.runtime.run as run_mod

    def fake_generate(path: object, prompt: str, **kw: object) -> dict[str, object]:
        return {"device": "cuda:0", "precision": "exact", "decode": "lean", "attention": "kernel", "folded": folded,
                "new_tokens": 3, "tokens_per_s": 100.0, "prefill_s": 0.01, "load_s": 0.5}

    monkeypatch.setattr(run_mod, "generate", fake_generate)
    for folded, tail in ((96, "kernel attention, 96 projections folded)"), (0, "kernel attention)")):
        rc, _out, err = _cli(capsys, "run", str(tiny), "--prompt", "x")
        assert rc == 0 and f"(exact, lean, {tail}: 100.0 tokens/s" in err, err


@pytest.mark.gpu
def test_cli_lean_engine_on_cuda(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """run --engine lean on CUDA decodes through the CUDA-graph loop (fused q/k/v, tied head) and gives the
    tokens transformers' eager generate gives on the same device and dtype; so does the default engine."""
    common = ("run", str(tiny), "--prompt", "The lamp was lit", "--max-new-tokens", "8", "--device", "cuda",
              "--dtype", "float32", "--json")
    rc, out, _err = _cli(capsys, *common, "--engine", "lean")
    assert rc == 0
    lean_doc = json.loads(out)
    assert lean_doc["decode"] == "lean" and lean_doc["new_tokens"] == 8
    assert lean_doc["attention"] == "matmul"  # (head size 16: the kernel gives way)
    assert lean_doc["folded"] == 0  # (float32: the gemv folds fp16 and bf16 only)
    rc, out, _err = _cli(capsys, *common, "--engine", "eager")
    assert rc == 0 and json.loads(out)["token_ids"] == lean_doc["token_ids"]
    rc, out, _err = _cli(capsys, *common)  # the default on CUDA: the lean loop where it runs
    assert rc == 0 and json.loads(out)["decode"] == "lean" and json.loads(out)["token_ids"] == lean_doc["token_ids"]


def test_cuda_without_a_device_is_unsupported(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present (this checks the error on a machine without one)")
    rc, _out, err = _cli(capsys, "run", str(tiny), "--prompt", "x", "--device", "cuda")
    assert rc == 3 and "no CUDA device" in err and err.count("\n") == 1


# -------------------------------------------------------------------------------------------------
# what a terminal shows: a loading indicator, then the completion while it is generated
# -------------------------------------------------------------------------------------------------
def test_completion_is_passed_on_while_generated(tiny: Path) -> None:
    """The streamer hands text on as tokens arrive (transformers' TextStreamer decides how finely), before
    generation ends: not all at once."""
    from w4pack.runtime.run import _Clock

    tok = load_tokenizer(tiny)
    pieces: list[str] = []
    prompt = tok("The", add_special_tokens=False)["input_ids"]
    clock = _Clock(tok, pieces.append, prompt)
    clock.put(torch.tensor([prompt]))  # the prompt: not shown
    seen = []
    for ch in "ab cd ef":
        clock.put(torch.tensor(tok(ch, add_special_tokens=False)["input_ids"]))
        seen.append("".join(pieces))
    clock.end()
    assert all("ab cd ef".startswith(s) for s in seen) and seen[2].startswith("ab ") and seen[5].startswith("ab cd ")
    assert "".join(pieces) == "ab cd ef" and len(clock.times) == 8


def _metaspace_tokenizer():
    """Words as SentencePiece tokenizers (Llama 2, Mistral) cut them: "▁w5" carries its leading space, and decoding
    drops the space of the first token decoded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"\u2581w{i}": i + 1 for i in range(20)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def test_completion_keeps_the_space_that_joins_it_to_the_prompt() -> None:
    """Decoded alone, the new tokens " w16 w7" read "w16 w7", and the prompt "w5 w6" printed before them ran into
    them ("w5 w6w16 w7"). The returned completion and the streamed text are the prompt's continuation."""
    from w4pack.runtime.run import _Clock, completion_text

    tok = _metaspace_tokenizer()
    prompt, new = tok("w5 w6")["input_ids"], tok("w16 w7")["input_ids"]
    assert tok.decode(new) == "w16 w7"  # (what the tokenizer does to a completion decoded alone)
    assert completion_text(tok, prompt, new) == " w16 w7"
    pieces: list[str] = []
    clock = _Clock(tok, pieces.append, prompt)
    clock.put(torch.tensor([prompt]))
    for t in new:
        clock.put(torch.tensor([t]))
    clock.end()
    assert "".join(pieces) == " w16 w7"


def test_generate_streams_the_same_text_it_returns(tiny: Path) -> None:
    events: list[str] = []

    @__import__("contextlib").contextmanager
    def loading():
        events.append("loading")
        yield
        events.append("loaded")

    doc = generate(tiny, "The lamp was lit", max_new_tokens=12, on_text=events.append, loading=loading)
    assert events[:2] == ["loading", "loaded"] and len(events) > 2
    assert "".join(events[2:]) == doc["completion"]


def test_cli_text_output_is_the_streamed_completion(tiny: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, _ = _cli(capsys, "run", str(tiny), "--prompt", "The lamp was lit", "--max-new-tokens", "8", "--json")
    want = json.loads(out)["completion"]
    monkeypatch.setattr(__import__("sys").stderr, "isatty", lambda: True)  # a terminal: the indicator shows
    rc, out, err = _cli(capsys, "run", str(tiny), "--prompt", "The lamp was lit", "--max-new-tokens", "8")
    assert rc == 0 and out == "The lamp was lit" + want + "\n"
    assert f"loading {tiny} ..." in err and "tokens/s" in err


def test_perplexity_shows_loading_and_windows_on_a_terminal(tiny: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(__import__("sys").stderr, "isatty", lambda: True)
    rc, out, err = _cli(capsys, "run", str(tiny), "--perplexity", str(SAMPLE), "--json")
    assert rc == 0 and json.loads(out)["window"] == 128  # stdout: the JSON document alone
    assert f"loading {tiny}" in err and "scoring windows: " in err


def test_a_tokenizer_of_another_model_is_named(tiny: Path, tmp_path: Path) -> None:
    """Was torch's "unexpected IndexError: index out of range in self" from inside the forward: the ids of a
    larger vocabulary (here the characters from id 200 on, the model has 112 rows) do not fit the embedding."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from w4pack.errors import BadInputError

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({chr(i): 200 + i for i in range(32, 127)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    other = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                    pad_token="<pad>")
    model = load_model(tiny)
    with pytest.raises(BadInputError, match=r"token id \d+, but the model's vocabulary has 112 tokens"):
        generate((model, other), "hello", max_new_tokens=2)
    with pytest.raises(BadInputError, match="the tokenizer files belong to another model"):
        perplexity((model, other), text="hello there")
    assert generate((model, load_tokenizer(tiny)), "hello", max_new_tokens=2)["new_tokens"] == 2


def test_an_empty_prompt_is_a_usage_error(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Was "activations hold no rows (M = 0)", the GEMM's complaint about the empty batch it was handed."""
    rc, out, err = _cli(capsys, "run", str(tiny), "--prompt", "", "--max-new-tokens", "2")
    assert rc == 2 and out == "" and err.strip() == \
        "w4pack: error: the prompt gives no tokens: give some text to continue (--prompt)", err


def test_seed_without_temperature_is_pointed_out(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--seed alone was silently ignored: a user expecting varied, repeatable samples got greedy output."""
    rc, out, err = _cli(capsys, "run", str(tiny), "--prompt", "keeper", "--max-new-tokens", "2", "--seed", "3",
                        "--json")
    assert rc == 0 and json.loads(out)["sampling"] == "greedy"
    assert "warning: --seed has no effect with greedy decoding (--temperature 0)" in err
    rc, out, err = _cli(capsys, "run", str(tiny), "--prompt", "keeper", "--max-new-tokens", "2", "--seed", "3",
                        "--temperature", "0.7", "--json")
    assert rc == 0 and "warning" not in err


def test_a_listed_tokenizer_file_that_is_gone_is_named(tiny: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Was, after the whole model had loaded: "no usable tokenizer in the folder; put the original model's
    tokenizer files ... beside the source's weights and convert again (...transformers' message...)"."""
    import shutil

    folder = tmp_path / "w4"
    shutil.copytree(tiny, folder)
    (folder / "tokenizer.json").unlink()
    rc, out, err = _cli(capsys, "run", str(folder), "--prompt", "The", "--max-new-tokens", "1")
    assert rc == 2 and out == ""
    assert err.strip() == (f"w4pack: error: {folder / 'tokenizer.json'}: file is missing, though w4pack.json lists "
                           "it (the folder lost it after it was written): convert or download the checkpoint again")


def test_a_window_past_the_models_context_is_refused(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--window 5000 on a model of 128 positions gave a perplexity of positions the model never saw, exit 0."""
    rc, out, err = _cli(capsys, "run", str(tiny), "--perplexity", str(SAMPLE), "--window", "129", "--json")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "window 129 is longer than the model's context (max_position_embeddings 128); give --window 128" in err
    rc, out, _err = _cli(capsys, "run", str(tiny), "--perplexity", str(SAMPLE), "--window", "128", "--json")
    assert rc == 0 and json.loads(out)["window"] == 128
    assert perplexity(tiny, SAMPLE, window="64")["window"] == 64  # (the API takes a number's text, as before)
    with pytest.raises(BadInputError, match="window must be a whole number of tokens, got 'abc'"):
        perplexity(tiny, SAMPLE, window="abc")
