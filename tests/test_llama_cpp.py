"""Our GGUF output decoded by llama.cpp itself (its Python bindings, ``llama_cpp``): the same greedy tokens as
``w4pack run`` on the packed folder the GGUF was written from, wherever the two engines' numerics allow.

Two packed folders, each written back as GGUF by our writer (weights, F32 norms, tokenizer metadata):

* SmolLM2-135M-Instruct, converted from its Q4_1 GGUF (tools/get_smollm2.py): a real model and tokenizer;
* a tiny random Llama this file writes as a 4-bit GPTQ checkpoint with a byte-level BPE tokenizer (the 256 byte
  tokens and one merge; symmetric, so Q4_0 holds it exactly): the GPTQ -> packed -> GGUF path whose F16 norms
  once crashed llama.cpp.

llama.cpp must load the file, tokenize the prompt as the model's own tokenizer does, give logits close to ours and
decode greedily to our tokens up to, at most, a near-tie. Skips, saying why, where llama_cpp, gguf, transformers or
SmolLM2 cannot be had.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import smollm2_gguf
from w4pack.cli import main
from w4pack.convert import convert

PROMPT = "The capital of France is"
NEW_TOKENS = 16


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        pytest.skip(f"llama_cpp is not importable ({exc}); pip install llama-cpp-python (it builds llama.cpp: needs "
                    "a C/C++ compiler and CMake, or a prebuilt wheel) enables this")
    return llama_cpp


def _byte_bpe_tokenizer(folder: Path) -> list[Path]:
    """A GPT-2 style byte-level BPE tokenizer: the 256 byte tokens, one merge ("h" "e" -> "he", id 256; llama.cpp
    needs merges) and <|endoftext|> (id 257). Any pre-tokenizer keeps "he" inside a word, so both engines
    tokenize alike whichever one llama.cpp picks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    vocab["he"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, [("h", "e")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    assert len(tok) == 258
    return [p for p in folder.iterdir() if p.is_file()]


def _byte_of(char: str) -> int:
    """GPT-2's byte -> printable character map, inverted (printable bytes map to themselves, the rest above 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    if ord(char) in printable:
        return ord(char)
    rest = [b for b in range(256) if b not in printable]
    return rest[ord(char) - 256]


@pytest.fixture(scope="module")
def tiny_gptq_packed_and_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    _llama_cpp()
    pytest.importorskip("gguf", reason="pip install gguf (the [gguf] extra) enables this")
    pytest.importorskip("tokenizers", reason="pip install 'w4pack[hf]' enables this (run and the tokenizer)")
    from rtn_helper import write_random_llama_gptq

    tmp = tmp_path_factory.mktemp("llama-cpp-tiny")
    write_random_llama_gptq(tmp / "gptq", seed=5, std=0.1, side_files=_byte_bpe_tokenizer(tmp / "tok"),
                            group_size=32, sym=True, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=258, max_position_embeddings=128,
                            bos_token_id=257, eos_token_id=None, tie_word_embeddings=False)
    convert(tmp / "gptq", tmp / "w4", show_progress=False)
    convert(tmp / "w4", tmp / "ours.gguf", to="gguf", show_progress=False)
    return tmp / "w4", tmp / "ours.gguf"


@pytest.fixture(scope="module")
def smollm2_packed_and_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    _llama_cpp()  # before a minute of converting for nothing
    pytest.importorskip("gguf", reason="pip install gguf (the [gguf] extra) enables this")
    pytest.importorskip("transformers", reason="pip install 'w4pack[hf]' enables this (run and the tokenizer)")
    upstream = smollm2_gguf()
    tmp = tmp_path_factory.mktemp("llama-cpp")
    convert(upstream, tmp / "w4", show_progress=False)
    convert(tmp / "w4", tmp / "ours.gguf", to="gguf", show_progress=False)
    return tmp / "w4", tmp / "ours.gguf"


def _load_without_repacking(llama_cpp: Any, path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A Llama over ``path`` keeping every position's logits, with llama.cpp's extra CPU buffer types off
    (``use_extra_bufts``: weight repacking).

    Why: on CPUs with AMX, llama-cpp-python 0.3.36 puts the Q4 weights in its AMX buffer type and its
    ``ggml_backend_amx_mul_mat`` segfaults at the first decode, with llama.cpp's own upstream GGUF as with ours.
    The plain CPU path computes the same quantized dot products; ``Llama()`` has no argument for this, so its
    default model parameters are wrapped for the one load.
    """
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    monkeypatch.setattr(low, "llama_model_default_params", params)
    return llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, n_batch=64, logits_all=True, verbose=False,
                           seed=0)


def _w4pack_logits(packed: Path, ids: list[int]) -> Any:
    """Our logits [len(ids), vocab] over a token sequence (the model ``w4pack run`` decodes with)."""
    import torch

    from w4pack.runtime.loading import load_model

    model = load_model(packed, device="cpu", precision="exact")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "tiny_gptq"])
def test_llama_cpp_decodes_our_gguf_like_w4pack_run(model: str, request: pytest.FixtureRequest,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp multiplies by 8-bit quantized activations, so its logits differ from ours by a few percent of
    their range: greedy tokens must agree wherever our choice is clear (its margin over the runner-up exceeds
    twice the two engines' difference at that position), and a first divergence may only come at a near-tie."""
    import numpy as np

    llama_cpp = _llama_cpp()
    packed, gguf_path = request.getfixturevalue(f"{model}_packed_and_gguf")
    from w4pack.runtime.loading import load_tokenizer

    rc = main(["run", str(packed), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    doc = json.loads(cap.out)
    ours = doc["token_ids"]
    assert len(ours) >= 4, ours

    llm = _load_without_repacking(llama_cpp, gguf_path, monkeypatch)
    prompt_ids = load_tokenizer(packed)(PROMPT)["input_ids"]
    # the tokenizer metadata we write (pre-tokenizer, add_bos_token, ...) makes llama.cpp tokenize as the model does
    assert llm.tokenize(PROMPT.encode(), add_bos=True, special=False) == prompt_ids

    # teacher-forced over the prompt and our tokens: the same model in both engines
    seq = prompt_ids + ours
    llm.eval(seq)
    theirs = np.array(llm.scores[:len(seq)], dtype=np.float32)
    mine = _w4pack_logits(packed, seq)
    diff = np.abs(theirs - mine).max(-1)
    rel = diff / np.abs(mine).max(-1)
    assert rel.max() < 0.1, rel  # a wrong tensor, row order, norm or tokenizer id moves them far more
    top2 = np.sort(mine, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * diff
    assert clear.sum() >= len(seq) // 4, clear  # enough positions are not near-ties for the check below to bite
    assert np.array_equal(theirs.argmax(-1)[clear], mine.argmax(-1)[clear])

    # free-running greedy decode in llama.cpp
    llm.reset()
    got: list[int] = []
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        got.append(int(token))
        if len(got) == len(ours):
            break
    same = next((j for j, (a, b) in enumerate(zip(got, ours)) if a != b), len(ours))
    if same < len(ours):  # up to here both engines saw the same sequence: mine/theirs hold that position
        pos = len(prompt_ids) - 1 + same
        assert not clear[pos], (f"llama.cpp chose {got[same]} where w4pack run's {ours[same]} was clear",
                                llm.detokenize(got).decode(errors="replace"), doc["completion"])
        assert got[same] == int(np.argsort(mine[pos])[-2]), "a near-tie, but not with our runner-up"
