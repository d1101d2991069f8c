"""Our writers' output read by the peers' own readers, compared with the canonical layers it was written from.

One test per writer. A peer that does not install from the package index on a CPU machine skips, saying why:

* compressed-tensors: transformers + the compressed-tensors package load our folder (the peer decompresses the
  packed weights itself); its logits must equal those of the float model holding our canonical dequantized weights.
* GGUF: gguf-py's own ``GGUFReader`` and ``quants.dequantize`` read every Q4_0/Q4_1/Q8_0 tensor of our file; each
  equals the canonical layer (llama.cpp's q/k row order undone with llama.cpp's permutation, written out here).
* GPTQ: GPTQModel's torch backend (``TorchLinear``) runs our v2 tensors; AWQ: AutoAWQ's ``dequantize_gemm``. Both
  are published only as sdists that build CUDA kernels or pin old transformers, so they skip unless installed.
* TOML quant tables: their reader is GPTQ-for-LLaMa's script, not a package: skipped with that reason.

The model is a tiny random Llama (2 blocks), round-to-nearest quantized (tests/rtn_helper.py), so this file runs
in seconds.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rtn_helper import MemorySource, rtn_quantize

from w4pack.dtypes import to_float32
from w4pack.formats import get_format

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, BLOCKS = 64, 128, 4, 2, 96, 2
PROJ = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
        "self_attn.v_proj": (HIDDEN // HEADS * KV_HEADS, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}


def _config() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": BLOCKS, "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}


def _source(*, sym: bool, float_min: bool = False, seed: int = 0) -> MemorySource:
    """A tiny Llama: every projection RTN-quantized at group 32 (GGUF's block size) with float16 scales."""
    rng = np.random.default_rng(seed)
    layers = {}
    for b in range(BLOCKS):
        for proj, (n, k) in PROJ.items():
            name = f"model.layers.{b}.{proj}"
            layers[name] = rtn_quantize(rng.normal(0, 0.08, (n, k)).astype(np.float32), group_size=32, sym=sym,
                                        float_min=float_min, name=name)
    tensors = {"model.embed_tokens.weight": (rng.normal(0, 0.5, (VOCAB, HIDDEN)).astype(np.float16), "float16"),
               "lm_head.weight": (rng.normal(0, 0.08, (VOCAB, HIDDEN)).astype(np.float16), "float16"),
               "model.norm.weight": (np.ones(HIDDEN, np.float16), "float16")}
    for b in range(BLOCKS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{b}.{norm}.weight"] = ((1 + rng.normal(0, 0.05, HIDDEN)).astype(np.float16),
                                                          "float16")
    return MemorySource(_config(), layers, tensors)


def _peer(module: str, why: str) -> Any:
    """The peer's module, or a skip that says why it is missing and how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"{module} is not importable ({exc}); {why}")


# ---- compressed-tensors: transformers + the compressed-tensors package ------------------------------------------------
def _float_reference(src: MemorySource, torch: Any, transformers: Any) -> Any:
    """transformers' float Llama holding the source's pass-through tensors and canonical dequantized weights."""
    cfg = {k: v for k, v in _config().items() if k not in ("architectures", "model_type", "torch_dtype")}
    ref = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg), dtype=torch.float32)
    with torch.no_grad():
        for name, (arr, dt) in src._tensors.items():
            ref.get_parameter(name).copy_(torch.from_numpy(to_float32(arr, dt)))
        for name, layer in src._layers.items():
            ref.get_submodule(name).weight.copy_(torch.from_numpy(layer.dequantize(np.float32)))
    return ref.eval()


def _dequantizing_config(transformers: Any) -> Any:
    """CompressedTensorsConfig that decompresses every layer into a plain Linear weight at load (``dequantize=True``
    since transformers 5.x renamed it; ``run_compressed=False`` before)."""
    import inspect

    params = inspect.signature(transformers.CompressedTensorsConfig.__init__).parameters
    if "dequantize" in params:
        return transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.CompressedTensorsConfig(run_compressed=False)


def _transformers_matches_canonical(out: Path, src: Any, torch: Any, transformers: Any, ids: list[list[int]]) -> None:
    """transformers (+ compressed-tensors, dequantizing) loads ``out``: each layer's weight is our canonical layer's
    and the logits over ``ids`` are the float reference model's (same argmax)."""
    peer = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             quantization_config=_dequantizing_config(transformers))
    for name, layer in src._layers.items():
        got = peer.get_submodule(name).weight.detach().float().numpy()
        np.testing.assert_allclose(got, layer.dequantize(np.float32), rtol=2e-3, atol=1e-6, err_msg=name)
    ref = _float_reference(src, torch, transformers)
    tokens = torch.tensor(ids)
    with torch.no_grad():
        a, b = peer(tokens).logits, ref(tokens).logits
    assert (a - b).abs().max() / b.abs().max() < 5e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_compressed_tensors_output_in_transformers(tmp_path: Path) -> None:
    """Symmetric layers (what GPTQ/AWQ-sym sources give): transformers loads the folder through compressed-tensors,
    which decompresses every layer itself; weights and logits must be the canonical ones."""
    _peer("compressed_tensors", "pip install compressed-tensors (in the [test] extra) enables this")
    torch = _peer("torch", "pip install -e '.[test]' enables this")
    transformers = _peer("transformers", "pip install -e '.[test]' enables this")

    src = _source(sym=True)
    out = tmp_path / "ct"
    get_format("compressed-tensors").write(src, out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    _transformers_matches_canonical(out, src, torch, transformers, [[1, 5, 9, 33, 60, 7]])


def test_compressed_tensors_asymmetric_output_in_transformers(tmp_path: Path) -> None:
    """Asymmetric layers (packed zero points): transformers + compressed-tensors load our folder, decompressing
    every layer itself; its weights and logits must be those of our canonical layers.

    Loaded with ``dequantize=True``: the default (compressed) route of transformers 5.25 + compressed-tensors 0.20.1
    refuses every asymmetric group/channel pack-quantized folder, compressed-tensors' own included ("size mismatch
    [N/8, G] vs [N, G]" on weight_zero_point): it builds the compressed skeleton on the meta device, where
    ``PackedQuantizationCompressor.compress`` keeps the unpacked [N, G] zero point, while on real tensors it packs it
    (what it writes to disk, what ``decompress`` reads and what we write: the next test checks that)."""
    _peer("compressed_tensors", "pip install compressed-tensors (in the [test] extra) enables this")
    torch = _peer("torch", "pip install -e '.[test]' enables this")
    transformers = _peer("transformers", "pip install -e '.[test]' enables this")

    src = _source(sym=False, seed=3)
    assert any(np.any(layer.zeros != 8) for layer in src._layers.values())  # really asymmetric
    out = tmp_path / "ct"
    get_format("compressed-tensors").write(src, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert [g["weights"]["symmetric"] for g in qc["config_groups"].values()] == [False]
    _transformers_matches_canonical(out, src, torch, transformers, [[1, 5, 9, 33, 60, 7], [1, 80, 2, 44, 13, 95]])


def test_compressed_tensors_asymmetric_output_equals_its_own_writer(tmp_path: Path) -> None:
    """compressed-tensors' own writer (``apply_quantization_config`` + ``ModelCompressor.compress_model``, what
    llm-compressor saves) given our canonical scales and zero points and the weights they dequantize to stores
    exactly our tensors: same names, shapes and dtypes, identical packed codes and packed int32 zero points
    [ceil(N·b/32), G]."""
    _peer("compressed_tensors", "pip install compressed-tensors (in the [test] extra) enables this")
    torch = _peer("torch", "pip install -e '.[test]' enables this")
    transformers = _peer("transformers", "pip install -e '.[test]' enables this")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    src = _source(sym=False, seed=3)
    out = tmp_path / "ct"
    get_format("compressed-tensors").write(src, out)
    ours: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        ours.update(load_file(str(f)))

    model = _float_reference(src, torch, transformers)
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    apply_quantization_config(model, qc)
    with torch.no_grad():
        for name, layer in src._layers.items():
            mod = model.get_submodule(name)
            mod.weight_scale.copy_(torch.from_numpy(to_float32(layer.scales, layer.scale_dtype)))
            mod.weight_zero_point.copy_(torch.from_numpy(layer.zeros.astype(np.int16) - 8))  # signed
    ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized").compress_model(model)
    theirs = model.state_dict()
    for name in src._layers:
        mine = {k: v for k, v in ours.items() if k.startswith(name + ".")}
        peer = {k: v for k, v in theirs.items() if k.startswith(name + ".")}
        assert sorted(mine) == sorted(peer), name
        for key, want in peer.items():
            got = mine[key]
            assert got.shape == want.shape, key
            if key.endswith("weight_scale"):  # ours keeps the source's float16; theirs is the model's float32
                assert torch.equal(got.float(), want.float()), key
            else:
                assert got.dtype == want.dtype and torch.equal(got, want), key
    zp = theirs["model.layers.0.mlp.down_proj.weight_zero_point"]
    assert zp.dtype == torch.int32 and tuple(zp.shape) == (-(-HIDDEN * 4 // 32), INTER // 32)


def test_compressed_tensors_asymmetric_output_in_its_decompressor(tmp_path: Path) -> None:
    """Asymmetric layers (packed zero points): compressed-tensors' own PackedQuantizationCompressor decompresses
    each layer's tensors, with the scheme parsed from our config.json by its own pydantic model."""
    _peer("compressed_tensors", "pip install compressed-tensors (in the [test] extra) enables this")
    _peer("torch", "pip install -e '.[test]' enables this")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    src = _source(sym=False)
    out = tmp_path / "ct"
    get_format("compressed-tensors").write(src, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    groups = [QuantizationScheme.model_validate(g) for g in qc["config_groups"].values()]
    tensors: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name, layer in src._layers.items():
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        assert "weight_zero_point" in local, name
        scheme = next(g for g in groups if not g.weights.symmetric)
        got = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        np.testing.assert_allclose(got.float().numpy(), layer.dequantize(np.float32), rtol=2e-3, atol=1e-6,
                                   err_msg=name)


# ---- GGUF: gguf-py's reader and dequantizer -----------------------------------------------------------------------
_GGUF_PROJ = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def _llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf ``permute`` (rows of each head from (2, d/2) to (d/2, 2))."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_gguf_output_in_gguf_py(tmp_path: Path, kind: str) -> None:
    gguf = _peer("gguf", "pip install gguf (the [gguf] extra) enables this")
    src = _source(sym=(kind == "q4_0"), float_min=(kind == "q4_1"))
    out = tmp_path / "model.gguf"
    get_format("gguf").write(src, out)
    reader = gguf.GGUFReader(str(out))
    by_name = {t.name: t for t in reader.tensors}
    want_type = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[kind]
    for name, layer in src._layers.items():
        block, proj = name.split(".")[2], ".".join(name.split(".")[3:])
        t = by_name[f"blk.{block}.{_GGUF_PROJ[proj]}.weight"]
        assert t.tensor_type == want_type, (name, t.tensor_type)
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(layer.out_features, layer.in_features)
        if proj == "self_attn.q_proj":
            got = _llama_cpp_unpermute(got, HEADS)
        elif proj == "self_attn.k_proj":
            got = _llama_cpp_unpermute(got, KV_HEADS)
        np.testing.assert_array_equal(got.astype(np.float32), layer.dequantize(np.float32), err_msg=name)
    # llama.cpp's own converter writes 1-D tensors (norms) as F32
    norm = by_name["output_norm.weight"]
    np.testing.assert_array_equal(np.asarray(norm.data, dtype=np.float32),
                                  to_float32(*src._tensors["model.norm.weight"]))


# ---- GPTQ: GPTQModel's torch backend -------------------------------------------------------------------------------
def test_gptq_output_in_gptqmodel_torch_backend(tmp_path: Path) -> None:
    torch = _peer("torch", "pip install -e '.[test]' enables this")
    qlinear = _peer("gptqmodel.nn_modules.qlinear.torch",
                    "GPTQModel is published only as an sdist that compiles CUDA kernels at install "
                    "(pip install gptqmodel needs nvcc and a CUDA torch); install it to enable this")
    from safetensors.torch import load_file

    src = _source(sym=True)
    out = tmp_path / "gptq"
    get_format("gptq-v2").write(src, out)  # v2 zero points: what GPTQModel's kernels use after loading a v1 file
    tensors: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0), dtype=torch.float16)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"):
        layer = src._layers[name]
        mod = qlinear.TorchLinear(bits=4, group_size=32, sym=True, desc_act=False, in_features=layer.in_features,
                                  out_features=layer.out_features, bias=False)
        for key in ("qweight", "qzeros", "scales", "g_idx"):
            getattr(mod, key).copy_(tensors[f"{name}.{key}"])
        mod.post_init()
        mod.eval()
        with torch.no_grad():
            got = mod(x).float()
        want = x.float() @ torch.from_numpy(layer.dequantize(np.float32)).T
        assert (got - want).abs().max() / want.abs().max() < 5e-3, name


# ---- AWQ: AutoAWQ's dequantizer -------------------------------------------------------------------------------------
def test_awq_output_in_autoawq(tmp_path: Path) -> None:
    torch = _peer("torch", "pip install -e '.[test]' enables this")
    packing = _peer("awq.utils.packing_utils",
                    "AutoAWQ is published only as an sdist pinned to transformers < 5 (and deprecated upstream); "
                    "install autoawq to enable this")
    from safetensors.torch import load_file

    src = _source(sym=False)
    out = tmp_path / "awq"
    get_format("awq").write(src, out)
    tensors: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name, layer in src._layers.items():
        w = packing.dequantize_gemm(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"],
                                    tensors[f"{name}.scales"], 4, 32)  # [in, out]
        np.testing.assert_allclose(w.float().numpy().T, layer.dequantize(np.float32), rtol=2e-3, atol=1e-6,
                                   err_msg=name)


# ---- TOML quant tables ----------------------------------------------------------------------------------------------
def test_toml_tables_peer_reader() -> None:
    pytest.skip("the TOML quant tables' reader is GPTQ-for-LLaMa's own script, not a package on the index; "
                "tests/formats checks our tables against its fixture files (W4PACK_FIXTURES)")
