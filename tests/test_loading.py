"""load_model on every architecture w4pack claims: tiny random models, RTN-quantized, written as GPTQ and as AWQ by
the format writers, converted (unfused and with --fuse qkv,gate-up), loaded with W4Linear and compared with the
float model holding the exact dequantized weights: logits within tolerance, same argmax, same 1-token generation,
single and left-padded batched input."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import fixture_dir  # noqa: E402
from rtn_helper import MemorySource, quantize_model  # noqa: E402

import w4pack  # noqa: E402
from w4pack.cli import main  # noqa: E402
from w4pack.convert import convert  # noqa: E402
from w4pack.dtypes import to_float32  # noqa: E402
from w4pack.errors import BadInputError, UnsupportedError  # noqa: E402
from w4pack.formats import get_format  # noqa: E402
from w4pack.loading import load_model  # noqa: E402
from w4pack.torch_module import W4FusedLinear, W4Linear, W4SliceLinear  # noqa: E402

VOCAB = 160
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, pad_token_id=0)


def _config(arch: str):
    from transformers import (GemmaConfig, LlamaConfig, MistralConfig, OPTConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    attn = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    if arch == "llama":
        return LlamaConfig(**attn, **COMMON, tie_word_embeddings=False)
    if arch == "mistral":
        return MistralConfig(**attn, **COMMON, sliding_window=None)
    if arch == "qwen2":  # q/k/v carry biases
        return Qwen2Config(**attn, **COMMON, tie_word_embeddings=False)
    if arch == "qwen3":  # hidden 96: K and N off the 64/16 tile grid; q/k norms
        return Qwen3Config(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
                           head_dim=16, **COMMON)
    if arch == "gemma":  # tied embeddings, scaled embeddings, gelu
        return GemmaConfig(**attn, head_dim=16, **COMMON)
    if arch == "phi3":  # natively fused qkv_proj / gate_up_proj
        return Phi3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          **{**COMMON, "pad_token_id": 0}, eos_token_id=2, bos_token_id=1)
    if arch == "opt":  # biases everywhere, learned positions, fc1/fc2
        return OPTConfig(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64,
                         **{k: v for k, v in COMMON.items() if k != "pad_token_id"}, pad_token_id=1)
    raise KeyError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "opt"]


def _float_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so logits differ clearly between tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.eval()


def _reference(model, layers):
    """The float model with every quantized Linear holding its exact dequantized weights (and bias)."""
    with torch.no_grad():
        for name, layer in layers.items():
            lin = model.get_submodule(name)
            lin.weight.copy_(torch.from_numpy(layer.dequantize(np.float32)))
            if layer.bias is not None:
                lin.bias.copy_(torch.from_numpy(to_float32(layer.bias, layer.bias_dtype)))
    return model


def _write(tmp: Path, arch: str, fmt: str, *, act_order: bool = False, perm_seed: int | None = None):
    """(source checkpoint folder in ``fmt``, canonical layers, reference model)."""
    model = _float_model(arch)
    layers, tensors = quantize_model(model, group_size=32, sym=(fmt == "gptq"), act_order=act_order,
                                     perm_seed=perm_seed)
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    src = MemorySource(cfg, layers, tensors)
    out = tmp / f"{arch}-{fmt}"
    get_format(fmt).write(src, out)
    return out, layers, _reference(model, layers)


def _inputs():
    g = torch.Generator().manual_seed(3)
    single = torch.randint(3, VOCAB, (1, 9), generator=g)
    batch = torch.randint(3, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(batch)
    mask[1, :3] = 0  # left padding
    batch[1, :3] = 0
    return single, batch, mask


def _compare(packed, ref) -> None:
    single, batch, mask = _inputs()
    with torch.no_grad():
        a, b = packed(single).logits, ref(single).logits
        scale = b.abs().max()
        assert (a - b).abs().max() / scale < 1e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        a, b = packed(batch, attention_mask=mask).logits, ref(batch, attention_mask=mask).logits
        valid = mask.bool()
        assert (a[valid] - b[valid]).abs().max() / b[valid].abs().max() < 1e-4
        assert torch.equal(a[valid].argmax(-1), b[valid].argmax(-1))
        for ids, m in ((single, None), (batch, mask)):
            kw = {"attention_mask": m} if m is not None else {}
            ga = packed.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, **kw)
            gb = ref.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, **kw)
            assert torch.equal(ga, gb)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_unfused_and_fused(tmp_path: Path, arch: str, fmt: str) -> None:
    src, layers, ref = _write(tmp_path, arch, fmt)
    plain, fused = tmp_path / "plain", tmp_path / "fused"
    convert(src, plain)
    result = convert(src, fused, fuse="qkv,gate-up")
    model = load_model(plain)
    n_w4 = sum(isinstance(m, W4Linear) for m in model.modules())
    assert n_w4 == len(layers)
    _compare(model, ref)
    fmodel = load_model(fused)
    manifest = json.loads((fused / "w4pack.json").read_text())
    if arch == "phi3":  # already fused by the model itself: nothing to fuse
        assert not manifest.get("fused") and not result["fused"]
    else:
        groups = 2 * (1 if arch == "opt" else 2)  # per block: qkv (+ gate/up except OPT)
        assert len(manifest["fused"]) == groups
        qc = json.loads((fused / "config.json").read_text())["quantization_config"]
        assert qc["fused"] == manifest["fused"]
        assert sum(isinstance(m, W4FusedLinear) for m in fmodel.modules()) == groups
        assert any(isinstance(m, W4SliceLinear) for m in fmodel.modules())
    _compare(fmodel, ref)


def test_act_order_loads_and_fuses_only_with_matching_permutations(tmp_path: Path) -> None:
    src, layers, ref = _write(tmp_path, "llama", "gptq", act_order=True)
    assert all(layer.act_order for layer in layers.values())
    convert(src, tmp_path / "plain")
    _compare(load_model(tmp_path / "plain"), ref)
    with pytest.raises(UnsupportedError, match="act-order permutations differ"):
        convert(src, tmp_path / "refused", fuse="qkv")
    assert not (tmp_path / "refused").exists()
    # one permutation shared by every layer of the same width: q/k/v and gate/up can be fused
    src2, _layers2, ref2 = _write(tmp_path / "same", "llama", "gptq", act_order=True, perm_seed=11)
    convert(src2, tmp_path / "fused", fuse="qkv,gate-up")
    _compare(load_model(tmp_path / "fused"), ref2)


def test_from_pretrained_after_import(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src, _layers, ref = _write(tmp_path, "qwen2", "awq")
    convert(src, tmp_path / "w4", fuse="qkv")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "w4")
    assert isinstance(model.model.layers[0].mlp.down_proj, W4Linear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, W4SliceLinear)
    _compare(model, ref)


def test_bfloat16_model_and_tied_embeddings(tmp_path: Path) -> None:
    src, _layers, ref = _write(tmp_path, "gemma", "gptq")
    convert(src, tmp_path / "w4")
    model = load_model(tmp_path / "w4", dtype="bfloat16")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    single, _b, _m = _inputs()
    with torch.no_grad():
        a, b = model(single).logits.float(), ref(single).logits
    assert (a - b).abs().max() / b.abs().max() < 5e-2


def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BadInputError):
        load_model(tmp_path / "missing")
    src, _layers, _ref = _write(tmp_path, "llama", "gptq")
    convert(src, tmp_path / "w4")
    cfg_path = tmp_path / "w4" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 96  # the model no longer matches the packed shapes
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match="does not match"):
        load_model(tmp_path / "w4")
    with pytest.raises(BadInputError, match="precision"):
        load_model(tmp_path / "w4", precision="sloppy")


def test_load_model_is_exported() -> None:
    assert w4pack.load_model is load_model


# -------------------------------------------------------------------------------------------------
# GPU: the same checkpoints through the CUDA kernels
# -------------------------------------------------------------------------------------------------
GPU_CASES = [("llama", "gptq", None), ("qwen2", "awq", "qkv,gate-up"), ("opt", "awq", "qkv")]


@pytest.mark.gpu
@pytest.mark.parametrize("arch,fmt,fuse", GPU_CASES)
def test_cuda_generation_matches_cpu(tmp_path: Path, arch: str, fmt: str, fuse: str | None) -> None:
    src, _layers, ref = _write(tmp_path, arch, fmt)
    out = tmp_path / "w4"
    convert(src, out, **({"fuse": fuse} if fuse else {}))
    cpu = load_model(out)
    gpu32 = load_model(out, device="cuda", dtype="float32")
    gpu16 = load_model(out, device="cuda", dtype="float16")
    single, batch, mask = _inputs()
    with torch.no_grad():
        want = cpu.generate(single, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = gpu32.generate(single.cuda(), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(got.cpu(), want)
        want_b = cpu.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        got_b = gpu32.generate(batch.cuda(), attention_mask=mask.cuda(), max_new_tokens=4, do_sample=False,
                               pad_token_id=0)
        assert torch.equal(got_b.cpu(), want_b)
        a = gpu16(single.cuda()).logits.float().cpu()
        b = ref(single).logits
        assert (a - b).abs().max() / b.abs().max() < 2e-2


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_model_forward(tmp_path: Path) -> None:
    src, _layers, _ref = _write(tmp_path, "llama", "awq")
    convert(src, tmp_path / "w4", fuse="qkv,gate-up")
    model = load_model(tmp_path / "w4", device="cuda", dtype="float16")
    single, _b, _m = _inputs()
    static_in = single.cuda()
    with torch.no_grad():
        model(static_in, use_cache=False)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = model(static_in, use_cache=False).logits
        other = torch.randint(3, VOCAB, single.shape, device="cuda")
        static_in.copy_(other)
        graph.replay()
        torch.cuda.synchronize()
        eager = model(other, use_cache=False).logits
    assert torch.equal(static_out, eager)


@pytest.mark.gpu
def test_torch_compile_on_cuda(tmp_path: Path) -> None:
    src, _layers, _ref = _write(tmp_path, "qwen3", "gptq")
    convert(src, tmp_path / "w4")
    model = load_model(tmp_path / "w4", device="cuda", dtype="float16")
    single, _b, _m = _inputs()
    x = single.cuda()
    with torch.no_grad():
        eager = model(x, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=False)
        got = compiled(x, use_cache=False).logits
    assert torch.allclose(got, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_static_cache_compiled_generate_on_cuda(tmp_path: Path) -> None:
    """transformers' own static-cache compile path (generate compiles the forward, reduce-overhead: CUDA graph
    trees) over W4Linear: it runs (the GEMM's workspace is reserved at load, outside any graph pool; it failed with
    untracked tensors in the cudagraph pool) and gives eager's greedy tokens."""
    src, _layers, _ref = _write(tmp_path, "qwen3", "gptq")
    convert(src, tmp_path / "w4")
    model = load_model(tmp_path / "w4", device="cuda", dtype="float16")
    single, _b, _m = _inputs()
    x = single.cuda()
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(x, **kw)
        for _ in range(3):  # compile and warm-up, record, replay
            assert torch.equal(model.generate(x, cache_implementation="static", **kw), eager)
    assert hasattr(model, "_compiled_call"), "transformers did not take its compiled static-cache path"


# -------------------------------------------------------------------------------------------------
# --fuse at convert time
# -------------------------------------------------------------------------------------------------
def test_fuse_cli_records_groups_and_refuses_bad_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from w4pack.cli import main

    src, _layers, _ref = _write(tmp_path, "mistral", "awq")
    rc = main(["convert", str(src), str(tmp_path / "w4"), "--fuse", "qkv,gate-up", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert sorted(doc["fused"]) == sorted(f"model.layers.{i}.{m}" for i in range(2)
                                          for m in ("self_attn.qkv_proj", "mlp.gate_up_proj"))
    assert doc["fused"]["model.layers.0.self_attn.qkv_proj"] == [
        {"name": "model.layers.0.self_attn.q_proj", "rows": [0, 64]},
        {"name": "model.layers.0.self_attn.k_proj", "rows": [64, 96]},
        {"name": "model.layers.0.self_attn.v_proj", "rows": [96, 128]}]
    assert w4pack.validate_checkpoint(tmp_path / "w4")["num_layers"] == 2 * 4  # qkv, o, gate_up, down per block
    assert main(["convert", str(src), str(tmp_path / "x"), "--fuse", "qk"]) == 2
    assert "unknown fusion" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "y"), "--fuse", "qkv", "--to", "gptq"]) == 2  # usage
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_fusion_refuses_mismatched_group_structure() -> None:
    from rtn_helper import rtn_quantize

    from w4pack.fuse import fuse_layers, parse_fuse, plan_fusion

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    q = rtn_quantize(w, group_size=32, name="b.q_proj")
    k = rtn_quantize(w, group_size=64, name="b.k_proj")
    v = rtn_quantize(w, group_size=32, bits=8, name="b.v_proj")
    with pytest.raises(UnsupportedError) as exc:
        fuse_layers("b.qkv_proj", [q, k, v])
    assert "group_size differs" in str(exc.value) and "bits differs" in str(exc.value)
    assert parse_fuse("QKV, gate_up") == ["qkv", "gate-up"]
    assert plan_fusion(["b.q_proj", "b.k_proj", "c.q_proj", "c.v_proj"], ["qkv"]) == {}
    fused, rows = fuse_layers("b.qkv_proj", [q, q.replace(name="b.k_proj"), q.replace(name="b.v_proj")])
    assert fused.out_features == 96 and rows[2]["rows"] == [64, 96]
    np.testing.assert_array_equal(fused.dequantize()[32:64], q.dequantize())


def test_repacking_a_fused_checkpoint_keeps_the_fusion(tmp_path: Path) -> None:
    src, _layers, ref = _write(tmp_path, "llama", "awq")
    convert(src, tmp_path / "fused", fuse="qkv")
    convert(tmp_path / "fused", tmp_path / "again", max_shard_size="64KB")
    convert(tmp_path / "fused", tmp_path / "more", fuse="gate-up")
    first = json.loads((tmp_path / "fused" / "w4pack.json").read_text())["fused"]
    assert json.loads((tmp_path / "again" / "w4pack.json").read_text())["fused"] == first
    more = json.loads((tmp_path / "more" / "w4pack.json").read_text())["fused"]
    assert len(more) == 4 and all(more[k] == v for k, v in first.items())
    _compare(load_model(tmp_path / "more"), ref)


def test_import_w4pack_loads_neither_torch_nor_transformers() -> None:
    import subprocess
    import sys

    code = "import sys, w4pack; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ---- a real AutoGPTQ checkpoint: all-zero bias tensors on a bias-free Llama ----------------------------------------
AG_TINY = ("gptq", "ag_tiny_llama_b4_g64_descact_sym")


def _ag_tiny_reference(case: Path):
    """transformers' float Llama from the fixture's config, its unquantized tensors and the quantizer's truth
    (W = scales[n, g_idx[k]] * (codes - zeros[n, g_idx[k]]); AutoGPTQ's zero biases are not part of the model)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((case / "config.json").read_text())
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    stored = load_file(str(next(case.glob("*.safetensors"))))
    sd = {k: torch.from_numpy(v.astype(np.float32)) for k, v in stored.items()
          if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx", ".bias"))}
    for d in sorted(p for p in (case / "truth").iterdir() if p.is_dir()):
        t = {n: np.load(d / f"{n}.npy") for n in ("codes", "scales", "zeros", "g_idx")}
        g = t["g_idx"]
        w = t["scales"][:, g].astype(np.float64) * (t["codes"].astype(np.float64) - t["zeros"][:, g])
        sd[f"{d.name}.weight"] = torch.from_numpy(w.astype(np.float32))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("fuse", [None, "qkv,gate-up"], ids=["plain", "fused"])
def test_autogptq_zero_bias_on_bias_free_linear_loads(tmp_path: Path, fuse: str | None) -> None:
    """AutoGPTQ writes an all-zero bias for every bias-free Linear: harmless, so the loader drops it and runs."""
    case = fixture_dir(*AG_TINY)
    convert(case, tmp_path / "w4", **({"fuse": fuse} if fuse else {}))
    manifest = json.loads((tmp_path / "w4" / "w4pack.json").read_text())
    assert all("bias" in m["tensors"] for m in manifest["layers"].values())  # the converter keeps them
    model = load_model(tmp_path / "w4")
    packed = [m for m in model.modules() if isinstance(m, W4Linear)]
    assert packed and all(m.bias_tensor() is None for m in packed)
    _compare(model, _ag_tiny_reference(case))


def test_autogptq_cli_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = fixture_dir(*AG_TINY)
    tok_src = fixture_dir("gptq", "gm_tiny_llama_b4_g64_descact_sym_v1_sharded")  # same vocab (1000)
    assert main(["convert", str(case), str(tmp_path / "w4")]) == 0
    capsys.readouterr()
    rc = main(["run", str(tmp_path / "w4"), "--prompt", "hello"])  # AutoGPTQ saved no tokenizer
    err = capsys.readouterr().err
    # the advice is to convert again with the tokenizer beside the source (a file copied into the packed folder
    # is one its manifest does not list: the folder would no longer validate)
    assert rc == 2 and err.count("\n") == 1 and "beside the source's weights and convert again" in err, err
    shutil.copytree(case, tmp_path / "src")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "src" / f).write_bytes((tok_src / f).read_bytes())
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "w4"), "--force"]) == 0
    assert main(["validate", str(tmp_path / "w4")]) == 0
    capsys.readouterr()
    rc = main(["run", str(tmp_path / "w4"), "--prompt", "hello", "--max-new-tokens", "5", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tmp_path / "w4"))("hello", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = _ag_tiny_reference(case).generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert doc["new_tokens"] == 5 and doc["token_ids"] == want[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("fuse", [None, "qkv"], ids=["plain", "fused"])
def test_nonzero_bias_on_bias_free_linear_is_refused(tmp_path: Path, fuse: str | None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A bias the architecture has no place for would change the output: refused, naming the layer."""
    from safetensors.numpy import load_file, save_file

    case = fixture_dir(*AG_TINY)
    src = tmp_path / "src"
    src.mkdir()
    for f in case.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    shard = next(case.glob("*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.layers.1.self_attn.k_proj.bias"][7] = np.float16(0.25)
    save_file(tensors, str(src / shard.name), metadata={"format": "pt"})
    convert(src, tmp_path / "w4", **({"fuse": fuse} if fuse else {}))
    with pytest.raises(BadInputError, match="non-zero bias for model.layers.1.self_attn.k_proj") as exc:
        load_model(tmp_path / "w4")
    assert ".safetensors" in exc.value.one_line()
    capsys.readouterr()
    rc = main(["run", str(tmp_path / "w4"), "--prompt", "hello"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "model.layers.1.self_attn.k_proj" in err and "bias" in err


# ---- transformers' own entry points on a packed folder ---------------------------------------------------------------
_REPO = Path(__file__).resolve().parent.parent


def test_from_pretrained_without_import_w4pack(tmp_path: Path) -> None:
    """transformers only warns about an unknown quant_method and then loads random weights: the .pth an installed
    w4pack ships must register "w4pack" in every process, so a script that never imports w4pack still gets the
    packed layers (the same logits as load_model) and w4pack is imported only once transformers loads quantizers."""
    import shutil
    import subprocess
    import sys

    src, _layers, ref = _write(tmp_path, "llama", "gptq")
    convert(src, tmp_path / "w4")
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(_REPO / "w4pack-autoregister.pth", site_dir)  # what `pip install` puts in site-packages
    single, _batch, _mask = _inputs()
    expected = load_model(tmp_path / "w4")(single).logits.detach()
    torch.save(single, tmp_path / "ids.pt")
    code = f"""
import site, sys
site.addsitedir({str(site_dir)!r})
assert "w4pack" not in sys.modules, "the .pth must not import the package at start"
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'w4')!r})
import json
names = json.load(open({str(tmp_path / 'w4' / 'w4pack.json')!r}))["layers"]
print(",".join(sorted({{type(model.get_submodule(n)).__name__ for n in names}})))
with torch.no_grad():
    torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(tmp_path / 'out.pt')!r})
"""
    env = {**__import__("os").environ, "PYTHONPATH": str(_REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "W4Linear", proc.stdout  # no nn.Linear left with random weights
    got = torch.load(tmp_path / "out.pt")
    assert torch.equal(got, expected)
    assert torch.equal(got.argmax(-1), ref(single).logits.argmax(-1))


def test_precision_fast_through_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from w4pack.runtime.loading import W4PackConfig

    src, _layers, _ref = _write(tmp_path, "llama", "awq")
    convert(src, tmp_path / "w4")
    fast = AutoModelForCausalLM.from_pretrained(tmp_path / "w4", quantization_config=W4PackConfig(precision="fast"))
    exact = AutoModelForCausalLM.from_pretrained(tmp_path / "w4")
    assert {m.precision for m in fast.modules() if isinstance(m, W4Linear)} == {"fast"}
    assert {m.precision for m in exact.modules() if isinstance(m, W4Linear)} == {"exact"}
    single, _b, _m = _inputs()
    with torch.no_grad():
        a, b = fast(single).logits, exact(single).logits
    assert not torch.equal(a, b)  # int8 activations really ran
    assert (a - b).abs().max() / b.abs().max() < 5e-2
    with pytest.raises(ValueError, match="precision must be one of"):
        W4PackConfig(precision="turbo")


def test_a_dequantized_model_saves_its_float_weights(tmp_path: Path) -> None:
    """dequantized_model gives a float model: save_pretrained writes float weights, not the packed folder it was
    loaded from (a float copy made that way once held the packed tensors, and vLLM refused it)."""
    from safetensors import safe_open

    from w4pack.runtime.run import dequantized_model

    src, _layers, _ref = _write(tmp_path, "qwen2", "gptq")
    convert(src, tmp_path / "w4")
    model = dequantized_model(load_model(tmp_path / "w4"))
    model.config.quantization_config = None
    model.save_pretrained(tmp_path / "float")
    keys = set()
    for f in (tmp_path / "float").glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            keys |= set(st.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and not any(k.endswith(".qweight") for k in keys)
    assert not (tmp_path / "float" / "w4pack.json").exists()


@pytest.mark.parametrize("how", ["from_pretrained", "load_model"])
def test_save_pretrained_writes_the_packed_folder(tmp_path: Path, how: str) -> None:
    from transformers import AutoModelForCausalLM

    src, _layers, _ref = _write(tmp_path, "qwen2", "gptq")
    convert(src, tmp_path / "w4", fuse="qkv")
    model = (AutoModelForCausalLM.from_pretrained(tmp_path / "w4") if how == "from_pretrained"
             else load_model(tmp_path / "w4"))
    out = tmp_path / "saved"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # a file the checkpoint does not list: refused, nothing written
    with pytest.raises(BadInputError, match="notes.txt.*empty or new folder"):
        model.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "notes.txt").unlink()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"old")  # an earlier save's shard: removed
    model.save_pretrained(out)
    assert not (out / "model-00001-of-00009.safetensors").exists()
    listed = {f["file"] if isinstance(f, dict) else f for f in json.loads((tmp_path / "w4" / "w4pack.json")
                                                                           .read_text())["files"]}
    assert listed and all((out / n).is_file() for n in listed)  # config, index, side files: every covered file
    from w4pack.store.atomic import umask_mode  # readable as convert's files are (was mkstemp's 0600)

    assert {(out / n).stat().st_mode & 0o777 for n in listed} == {umask_mode(0o666)}
    assert w4pack.validate_checkpoint(out)["num_layers"] == len(json.loads((tmp_path / "w4" / "w4pack.json")
                                                                          .read_text())["layers"])
    again = AutoModelForCausalLM.from_pretrained(out)
    single, _b, _m = _inputs()
    with torch.no_grad():
        assert torch.equal(again(single).logits, model(single).logits)
        model.model.norm.weight.add_(1.0)
    with pytest.raises(UnsupportedError, match="model.norm.weight.*changed after loading"):
        model.save_pretrained(tmp_path / "changed")


def test_save_pretrained_refuses_new_packed_weights_and_keeps_the_card(tmp_path: Path) -> None:
    """load_state_dict of another layer's buffers: forward kept the old weights and save_pretrained wrote the
    original folder. Now the forward uses the new ones and save refuses, naming the tensor. The folder's model card
    goes with a save; one left there by a save of another model was kept before."""
    src, _layers, _ref = _write(tmp_path, "llama", "gptq")
    convert(src, tmp_path / "w4")
    model = load_model(tmp_path / "w4", compile=False)
    out = tmp_path / "saved"
    out.mkdir()
    (out / "README.md").write_text("a card of another model\n")
    model.save_pretrained(out)
    assert (out / "README.md").read_bytes() == (tmp_path / "w4" / "README.md").read_bytes()
    a, b = model.model.layers[0].mlp.gate_proj, model.model.layers[0].mlp.up_proj
    x = torch.randn(2, a.in_features)
    with torch.no_grad():
        before = a(x)
        a.load_state_dict(b.state_dict())
        assert torch.equal(a(x), b(x)) and not torch.equal(a(x), before)
    with pytest.raises(UnsupportedError, match="model.layers.0.mlp.gate_proj.qweight.*changed after loading"):
        model.save_pretrained(tmp_path / "changed")
    assert not (tmp_path / "changed").exists()


def test_a_folder_from_a_gguf_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    """llama.cpp's tiny test GGUFs hold no tokenizer: "put the original model's tokenizer files beside the
    source's weights", followed by transformers' guesses about sentencepiece, fitted no single GGUF file."""
    from w4pack.convert import convert
    from w4pack.errors import BadInputError
    from w4pack.loading import load_tokenizer

    src = Path(__file__).resolve().parent / "data" / "llama_quantize" / "tiny-Q4_K_M.gguf"
    convert(src, tmp_path / "w4", show_progress=False)
    with pytest.raises(BadInputError, match="the GGUF this folder was converted from has none in its metadata") as e:
        load_tokenizer(tmp_path / "w4")
    assert "sentencepiece" not in str(e.value).lower()


@pytest.mark.parametrize("threads", [0, -2, 2.5, True])
def test_load_model_refuses_a_bad_thread_count_at_the_call(tmp_path: Path, threads: object) -> None:
    """threads=0 loaded the model and failed only at the first forward."""
    from w4pack.errors import BadInputError
    from w4pack.loading import load_model

    with pytest.raises(BadInputError, match="threads must be a whole number >= 1"):
        load_model(tmp_path / "any", threads=threads)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["load_model", "from_pretrained"])
def test_each_layer_knows_its_name_for_its_errors(tmp_path: Path, how: str) -> None:
    """A layer fed the wrong width (a model edited by hand, a custom forward) names itself: the loaders give each
    W4Linear its checkpoint name, the fused ones included (load_model fills modules it builds; from_pretrained
    builds skeletons first)."""
    from transformers import AutoModelForCausalLM

    src, _layers, _ref = _write(tmp_path, "llama", "gptq")
    convert(src, tmp_path / "w4", fuse="qkv")
    manifest = json.loads((tmp_path / "w4" / "w4pack.json").read_text())
    model = load_model(tmp_path / "w4") if how == "load_model" else \
        AutoModelForCausalLM.from_pretrained(tmp_path / "w4")
    named = {n: m.layer_name for n, m in model.named_modules() if isinstance(m, W4Linear)}
    assert set(named) == set(manifest["layers"]) and all(named[n] == n for n in named), named
    down = "model.layers.1.mlp.down_proj"
    mod = model.get_submodule(down)
    with pytest.raises(ValueError, match=f"^layer {down}: input has 3 features, the layer expects {mod.in_features}"):
        mod(torch.randn(1, 3))
    fused = next(iter(manifest["fused"]))
    with pytest.raises(ValueError, match=f"^layer {fused}: input has 3 features"):
        model.get_submodule(manifest["fused"][fused][0]["name"])(torch.randn(1, 3))


def test_a_dtype_the_layers_cannot_run_is_refused_at_load(tmp_path: Path) -> None:
    """torch.float64 loaded and failed at the first forward; torch.int8 raised transformers' ValueError."""
    from transformers import AutoModelForCausalLM

    src, _layers, _ref = _write(tmp_path, "llama", "gptq")
    convert(src, tmp_path / "w4")
    for dtype in (torch.float64, torch.int8):
        with pytest.raises(BadInputError, match=f"dtype {dtype} is not one the packed layers run in"):
            load_model(tmp_path / "w4", dtype=dtype)
        with pytest.raises(BadInputError, match=f"dtype {dtype} is not one"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "w4", dtype=dtype)


def test_a_source_checkpoint_given_to_load_model_says_convert_first(tmp_path: Path) -> None:
    src, _layers, _ref = _write(tmp_path, "llama", "gptq")
    with pytest.raises(BadInputError, match=r"a gptq checkpoint, not a packed w4pack folder; convert it first: "
                                            r"w4pack convert .* OUT_DIR"):
        load_model(src)


def test_from_pretrained_with_a_device_map(tmp_path: Path) -> None:
    """README: device_map works (accelerate comes with the [hf] extra, and with the test environment)."""
    from transformers import AutoModelForCausalLM

    src, _layers, _ref = _write(tmp_path, "llama", "gptq")
    convert(src, tmp_path / "w4")
    ref = load_model(tmp_path / "w4", compile=False)
    single, _b, _m = _inputs()
    for device_map in ("cpu", "auto", {"": "cpu"}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "w4", device_map=device_map)
        with torch.no_grad():
            assert torch.equal(model(single).logits, ref(single).logits), device_map
