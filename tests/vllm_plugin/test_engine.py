"""Packed checkpoints served by a real vLLM engine (vLLM-CPU) through the w4pack plugin.

Run by ``make test-vllm`` (its own environment with a pinned vLLM); skipped where vLLM is not installed. Each
engine runs in a subprocess with a time limit (engine_case.py). References are w4pack's own runner
(``w4pack.run``, float32, exact precision) in this process: the engine must give the same greedy tokens.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(HERE.parent))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed in this environment (make test-vllm runs these)")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CASE_TIMEOUT = 420


def _env(tmp: Path, tp: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
               TOKENIZERS_PARALLELISM="false", VLLM_PLUGINS="w4pack")
    if tp > 1:
        # automatic thread binding refuses TP on a machine with one NUMA node: one core per rank, by hand
        env.update(VLLM_CPU_OMP_THREADS_BIND="|".join(str(c % os.cpu_count()) for c in range(tp)),
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return env


def _engine(tmp: Path, spec: dict, tp: int = 1) -> dict:
    spec_path, result_path = tmp / f"spec-{time.monotonic_ns()}.json", tmp / f"result-{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(dict(spec, tp=tp)))
    proc = subprocess.run([sys.executable, str(HERE / "engine_case.py"), str(spec_path), str(result_path)],
                          env=_env(tmp, tp), capture_output=True, text=True, timeout=CASE_TIMEOUT)
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        pytest.fail(f"engine exited {proc.returncode}:\n{tail}")
    return json.loads(result_path.read_text())


# -- SmolLM2-135M (the demo's GGUF) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from get_smollm2 import smollm2_gguf

    from w4pack.convert import convert

    try:
        gguf = smollm2_gguf()
    except RuntimeError as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")
    tmp = tmp_path_factory.mktemp("smollm2")
    # "plain" keeps the GGUF's Q8_0 token table packed, with the head tied to it; the fused copy stores it as
    # exact float32 (--float-embeddings), so both of vLLM's embedding paths are served
    convert(gguf, tmp / "w4")
    convert(gguf, tmp / "w4-fused", fuse="qkv,gate-up", float_embeddings=True)
    return {"plain": tmp / "w4", "fused": tmp / "w4-fused"}


@pytest.fixture(scope="module")
def smollm2_reference(smollm2: dict[str, Path]) -> dict:
    from w4pack.loading import load_model, load_tokenizer
    from w4pack.run import generate, perplexity

    model = load_model(smollm2["plain"], device="cpu", dtype="float32", precision="exact")
    tok = load_tokenizer(smollm2["plain"])
    tokens = [generate((model, tok), p, max_new_tokens=24)["token_ids"] for p in PROMPTS]
    text = (REPO / "tests" / "data" / "ppl_sample.txt").read_text(encoding="utf-8")
    ppl = perplexity((model, tok), text=text, window=256)
    return {"tokens": tokens, "perplexity": ppl["perplexity"],
            "text_ids": tok(text, return_tensors="np")["input_ids"][0].tolist()}


def test_smollm2_tokens_and_perplexity_match_w4pack_run(smollm2, smollm2_reference, tmp_path):
    ref = smollm2_reference
    got = _engine(tmp_path, {"model": str(smollm2["plain"]), "prompts": PROMPTS, "max_tokens": 24,
                             "perplexity": {"token_ids": ref["text_ids"], "window": 256}})
    assert got["tokens"] == ref["tokens"]
    assert abs(got["perplexity"] / ref["perplexity"] - 1) < 0.005, (got["perplexity"], ref["perplexity"])


def test_smollm2_all_packed_in_bfloat16(smollm2, tmp_path):
    """Every linear layer, the token table and the tied head packed, in bfloat16: no vLLM float GEMM runs, so
    nothing of vLLM's asks Linux for the AMX state its CPU attention uses; the plugin does (before, the first
    attention call died of SIGILL on CPUs with AMX)."""
    got = _engine(tmp_path, {"model": str(smollm2["plain"]), "dtype": "bfloat16", "prompts": PROMPTS[:2],
                             "max_tokens": 8})
    assert [len(t) for t in got["tokens"]] == [8, 8]


def test_smollm2_fused_checkpoint_compiled(smollm2, smollm2_reference, tmp_path):
    """The --fuse'd checkpoint, with vLLM's torch.compile path (the custom op traced as one node)."""
    got = _engine(tmp_path, {"model": str(smollm2["fused"]), "prompts": PROMPTS, "max_tokens": 24,
                             "enforce_eager": False})
    assert got["tokens"] == smollm2_reference["tokens"]


# -- a random Llama: act-order GPTQ, K not a multiple of the group, tensor parallel ----------------------
@pytest.fixture(scope="module")
def act_order_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 heads, 2 kv heads, hidden 320 and ffn 576 at group 128 (neither a multiple of 128, nor are their
    halves), every layer act-order with its own permutation: written as GPTQ, converted to w4pack."""
    from rtn_helper import write_random_llama_gptq

    from w4pack.convert import convert

    tmp = tmp_path_factory.mktemp("llama")
    layers = write_random_llama_gptq(
        tmp / "gptq", seed=3, std=0.08, group_size=128, sym=True, act_order=True, hidden_size=320,
        intermediate_size=576, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=256, eos_token_id=None, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    assert all(layer.act_order for layer in layers.values())
    convert(tmp / "gptq", tmp / "w4")
    return tmp / "w4"


TOKEN_PROMPTS = [[1, 17, 300, 45, 9], [1, 250, 251, 252], [1, 5]]


def _reference_tokens(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch

    from w4pack.loading import load_model

    model = load_model(folder, device="cpu", dtype="float32", precision="exact")
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def test_act_order_uneven_groups_tp1_and_tp2(act_order_llama, tmp_path):
    from w4pack.checkpoint import Checkpoint

    with Checkpoint(act_order_llama) as ckpt:
        down = ckpt.manifest["layers"]["model.layers.0.mlp.down_proj"]
        assert down["act_order"] and down["shape"][1] % down["group_size"] != 0
    want = _reference_tokens(act_order_llama, TOKEN_PROMPTS, 20)
    spec = {"model": str(act_order_llama), "prompts": None, "token_prompts": TOKEN_PROMPTS, "max_tokens": 20,
            "max_model_len": 256}
    tp1 = _engine(tmp_path, spec, tp=1)
    assert tp1["tokens"] == want
    tp2 = _engine(tmp_path, spec, tp=2)
    assert tp2["tokens"] == tp1["tokens"]


def _engine_fails(tmp: Path, folder: Path, max_len: int, **engine_args: object) -> str:
    """An engine that must refuse ``folder``: its output (stdout and stderr), after checking it made nothing."""
    spec_path, result_path = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(json.dumps({"model": str(folder), "prompts": None, "token_prompts": [[1, 2]],
                                     "max_model_len": max_len, "engine_args": engine_args}))
    proc = subprocess.run([sys.executable, str(HERE / "engine_case.py"), str(spec_path), str(result_path)],
                          env=_env(tmp), capture_output=True, text=True, timeout=CASE_TIMEOUT)
    assert proc.returncode != 0 and not result_path.exists()
    return proc.stdout + proc.stderr


def _tp1_and_tp2_generate_as_w4pack_run(tmp: Path, folder: Path, prompts: list[list[int]], n: int, max_len: int,
                                        end_token: int | None = None) -> None:
    """The engine at TP=1 and TP=2 gives the greedy tokens of w4pack's runner: all ``n``, or up to and including
    ``end_token`` where the runner stops at it (the engine is told to ignore it and goes on)."""
    want = _reference_tokens(folder, prompts, n)
    assert all(len(w) == n or w[-1] == end_token for w in want)
    spec = {"model": str(folder), "prompts": None, "token_prompts": prompts, "max_tokens": n,
            "max_model_len": max_len}
    for tp in (1, 2):
        got = _engine(tmp, spec, tp=tp)["tokens"]
        assert [g[:len(w)] for g, w in zip(got, want)] == want, tp


def test_phi3_merged_layers_as_the_checkpoint_stores_them_tp1_and_tp2(tmp_path):
    """Phi-3 stores q/k/v and gate/up merged (qkv_proj, gate_up_proj) in the checkpoint itself, no --fuse table:
    each rank takes its share of every part. Before: refused at create ("output rows [512] do not match the
    model's [256, 128, 128]")."""
    from rtn_helper import write_random_llama_gptq

    from w4pack.checkpoint import Checkpoint
    from w4pack.convert import convert

    write_random_llama_gptq(
        tmp_path / "gptq", seed=5, std=0.08, model_type="phi3", group_size=64, sym=True, hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=256, eos_token_id=None, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    convert(tmp_path / "gptq", tmp_path / "w4")
    with Checkpoint(tmp_path / "w4") as ckpt:
        assert "model.layers.0.self_attn.qkv_proj" in ckpt.manifest["layers"] and not ckpt.manifest.get("fused")
    _tp1_and_tp2_generate_as_w4pack_run(tmp_path, tmp_path / "w4", TOKEN_PROMPTS, 16, 128)


# -- llama.cpp's own K-quant file: packed embedding and packed (untied) head ---------------------------
def test_k_quant_gguf_with_packed_embedding_and_head_tp1_and_tp2(tmp_path):
    """tiny-Q4_K_M.gguf as llama.cpp wrote it (Q4_K token table, Q6_K output head, compact storage), converted
    with nothing dequantized: the engine serves the embedding and the head packed, split by vocabulary rows at
    TP=2, with the greedy tokens of w4pack's runner."""
    from w4pack.checkpoint import Checkpoint
    from w4pack.convert import convert

    convert(REPO / "tests" / "data" / "llama_quantize" / "tiny-Q4_K_M.gguf", tmp_path / "w4")
    with Checkpoint(tmp_path / "w4") as ckpt:
        assert ckpt.manifest["layers"]["model.embed_tokens"]["role"] == "embedding"
        assert "lm_head" in ckpt.manifest["layers"]
    _tp1_and_tp2_generate_as_w4pack_run(tmp_path, tmp_path / "w4", [[1, 2, 3, 4], [5, 77, 100], [9]], 16, 128)


# -- llama.cpp's tiny Mixtral: packed experts (Q4_K / Q6_K, compact storage) ----------------------------
def test_k_quant_mixtral_experts_tp1_and_tp2(tmp_path):
    """tiny-moe-Q4_K_M.gguf (4 experts, top 2, stacked 3-D expert tensors in the GGUF): every expert served
    packed through vLLM's MoE block, split over the intermediate rows at TP=2, with the greedy tokens of
    w4pack's runner. vLLM's Mixtral builds its token embedding without the quantization config, so the table
    is stored float (--float-embeddings); the head stays packed."""
    from w4pack.convert import convert

    convert(REPO / "tests" / "data" / "llama_quantize" / "tiny-moe-Q4_K_M.gguf", tmp_path / "w4",
            float_embeddings=True)
    _tp1_and_tp2_generate_as_w4pack_run(tmp_path, tmp_path / "w4", [[1, 2, 3, 4], [5, 77, 100], [9]], 16, 128)


def test_k_quant_mixtral_experts_compiled(tmp_path):
    """The same Mixtral on vLLM-CPU's torch.compile path (fullgraph, traced into the MoE block down to the plugin's
    method): the routed experts are one opaque custom op, and the tokens are w4pack's runner's."""
    from w4pack.convert import convert

    convert(REPO / "tests" / "data" / "llama_quantize" / "tiny-moe-Q4_K_M.gguf", tmp_path / "w4",
            float_embeddings=True)
    prompts = [[1, 2, 3, 4], [5, 77, 100], [9]]
    want = _reference_tokens(tmp_path / "w4", prompts, 16)
    got = _engine(tmp_path, {"model": str(tmp_path / "w4"), "prompts": None, "token_prompts": prompts,
                             "max_tokens": 16, "max_model_len": 128, "enforce_eager": False})
    assert got["tokens"] == want


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_gptq_qwen_moe_tp1_and_tp2(model_type, tmp_path):
    """Tiny Qwen2-MoE (with a shared expert and its gate) and Qwen3-MoE (per-head q/k norms, normalized top-k):
    4 experts, top 2, heads 64 wide, one kv head, quantized to GPTQ by the project's test helper and converted.
    The routed experts run through vLLM's MoE block, Qwen2's shared expert as a merged gate/up layer, the kv
    head is replicated at TP=2. Greedy tokens are w4pack's runner's up to the model's end token (where the
    runner stops and the engine, told to ignore it, goes on)."""
    from test_moe import write_moe_gptq

    from w4pack.convert import convert

    extra = {"head_dim": 64} if model_type == "qwen3_moe" else {}
    gptq, _ref = write_moe_gptq(tmp_path / "src", model_type, seed=5, hidden_size=128, num_attention_heads=2,
                                num_key_value_heads=1, **extra)
    convert(gptq, tmp_path / "w4")
    _tp1_and_tp2_generate_as_w4pack_run(tmp_path, tmp_path / "w4", [[1, 2, 3, 4], [5, 77, 90], [9, 10]], 12, 64,
                                        end_token=2)


def test_packed_embedding_refused_where_the_model_cannot_take_it(tmp_path):
    """The same Mixtral with its token table packed: one line naming the table and the way out."""
    from w4pack.convert import convert

    convert(REPO / "tests" / "data" / "llama_quantize" / "tiny-moe-Q4_K_M.gguf", tmp_path / "w4")
    out = _engine_fails(tmp_path, tmp_path / "w4", 128)
    assert "tensor model.embed_tokens: this model's vLLM implementation builds its token embedding without the " \
           "quantization config" in out
    assert "--float-embeddings" in out


# -- every public fixture model -------------------------------------------------------------------------
PUBLIC_MODELS = ["gptq/ag_tiny_llama_b4_g64_descact_sym", "gptq/gm_tiny_llama_b4_g64_descact_sym_v1_sharded",
                 "awq/tiny_llama_gemm_g128", "awq/llm_awq_v1_2023_tiny_llama_g128_pt",
                 "compressed-tensors/tiny_llama_w4a16_sym_g128"]


@pytest.mark.parametrize("case", PUBLIC_MODELS)
def test_public_fixture_models_generate_as_w4pack_run(case, tmp_path):
    """The peers' own checkpoints (act-order GPTQ v1 sharded, AutoAWQ, llm-awq .pt, compressed-tensors) converted
    and served: the same greedy tokens as w4pack's runner."""
    from conftest import fixture_dir

    from w4pack.convert import convert

    convert(fixture_dir(*case.split("/")), tmp_path / "w4")
    prompts = [[1, 17, 300, 45, 9], [1, 250, 251, 252]]
    want = _reference_tokens(tmp_path / "w4", prompts, 16)
    got = _engine(tmp_path, {"model": str(tmp_path / "w4"), "prompts": None, "token_prompts": prompts,
                             "max_tokens": 16, "max_model_len": 256})
    assert got["tokens"] == want


# -- the OpenAI-compatible server ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, doc: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def test_openai_server_completions_and_chat(smollm2, smollm2_reference, tmp_path):
    from w4pack.loading import load_tokenizer

    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2["plain"]),
         "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "512", "--enforce-eager", "--gpu-memory-utilization", "0.5"],
        env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + CASE_TIMEOUT
        while True:
            if server.poll() is not None:
                pytest.fail("server exited:\n" + (tmp_path / "server.log").read_text()[-4000:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server not ready in time:\n" + (tmp_path / "server.log").read_text()[-4000:])
            time.sleep(2)
        done = _post(base + "/v1/completions", {"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 24,
                                                "temperature": 0})
        tok = load_tokenizer(smollm2["plain"])
        assert done["choices"][0]["text"] == tok.decode(smollm2_reference["tokens"][0], skip_special_tokens=True)
        chat = _post(base + "/v1/chat/completions", {"model": "smollm2", "max_tokens": 16, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Say hello."}]})
        reply = chat["choices"][0]["message"]["content"]
        assert isinstance(reply, str) and reply.strip()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_bad_checkpoint_refused_before_loading(act_order_llama, tmp_path):
    """A manifest layer whose shape disagrees with config.json: one clear error naming the layer, from the
    configuration (the architecture check) before any worker starts, for a model type w4pack knows; the method's
    own check at create covers the others (test_method.py)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(act_order_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 640
    (bad / "config.json").write_text(json.dumps(cfg))
    assert "tensor model.layers.0.mlp.gate_proj: layer is [576, 320] but the llama model of config.json needs " \
           "[640, 320]" in _engine_fails(tmp_path, bad, 256)


def _config_errors(tmp: Path, cases: list[dict]) -> list[str | None]:
    """Build each case's engine configuration only (what ``LLM()`` does first, in the caller's process, and where
    the plugin reads the checkpoint): no engine starts. Each case's error as the user sees it, or None."""
    spec_path, result_path = tmp / "configs.json", tmp / "configs-result.json"
    spec_path.write_text(json.dumps({"configs": cases}))
    proc = subprocess.run([sys.executable, str(HERE / "engine_case.py"), str(spec_path), str(result_path)],
                          env=_env(tmp), capture_output=True, text=True, timeout=CASE_TIMEOUT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(result_path.read_text())["errors"]


def test_damaged_folders_and_wrong_method_refused_before_any_worker(act_order_llama, tmp_path):
    """Each refused while the configuration is built, in the caller's process, with one message naming the file
    or the method and the way out. Before: a truncated shard died in the worker's safetensors loader (no file
    named, under 200 lines of traceback), a manifest contradicting its tensors in the worker's weight loader,
    quantization='w4pack' on an unquantized model with a TypeError about W4PackConfig's arguments, and on
    another method's checkpoint with only "does not match"."""
    import shutil

    def damaged(name: str) -> Path:
        shutil.copytree(act_order_llama, tmp_path / name)
        return tmp_path / name

    truncated = damaged("truncated")
    shard = next(truncated.glob("model-*.safetensors"))
    os.truncate(shard, shard.stat().st_size - 4096)
    retyped = damaged("retyped")  # the manifest says bfloat16 scales, the shard holds float16
    manifest = json.loads((retyped / "w4pack.json").read_text())
    manifest["layers"]["model.layers.0.mlp.down_proj"]["scale_dtype"] = "bfloat16"
    (retyped / "w4pack.json").write_text(json.dumps(manifest))
    missing = damaged("missing")
    next(missing.glob("model-*.safetensors")).unlink()
    unquantized = tmp_path / "float"  # only config.json is read before the workers start
    unquantized.mkdir()
    cfg = json.loads((act_order_llama / "config.json").read_text())
    del cfg["quantization_config"]
    (unquantized / "config.json").write_text(json.dumps(cfg))
    gptq = act_order_llama.parent / "gptq"

    errors = _config_errors(tmp_path, [{"model": str(truncated)}, {"model": str(retyped)}, {"model": str(missing)},
                                       {"model": str(unquantized), "quantization": "w4pack"},
                                       {"model": str(gptq), "quantization": "w4pack"},
                                       {"model": str(act_order_llama), "quantization": "w4pack"}])
    for error, folder in zip(errors[:3], (truncated, retyped, missing)):
        assert error and f"`w4pack validate {folder}` checks the whole folder" in error, error
    assert f"{shard.name}: tensor" in errors[0] and "truncated" in errors[0]
    assert "model.layers.0.mlp.down_proj.scales: dtype float16 contradicts the manifest" in errors[1]
    assert "shard named in the manifest is missing" in errors[2]
    assert "this model has no quantization_config in config.json (an unquantized model)" in errors[3]
    assert "this is a 'gptq' checkpoint: convert it (w4pack convert SRC DST) and serve DST" in errors[4]
    assert errors[5] is None  # the packed folder itself, named explicitly


def test_lora_refused_with_the_reason(act_order_llama, tmp_path):
    """vLLM's LoRA layers wrap every linear layer and stopped at "Unsupported base layer" on a packed one."""
    out = _engine_fails(tmp_path, act_order_llama, 256, enable_lora=True)
    assert "LoRA adapters (enable_lora / --enable-lora) are not supported on packed w4pack layers" in out
    assert "Unsupported base layer" not in out
