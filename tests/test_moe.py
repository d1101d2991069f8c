"""Mixture-of-experts models: per-expert quantized layers read, packed, verified, run and converted back.

Tiny Mixtral, Qwen2-MoE and Qwen3-MoE models with random weights are saved by transformers itself (so the tensor
names are the Hub's per-expert spelling its own loader converts), every attention and expert projection is
RTN-quantized by tests/rtn_helper.py and written as GPTQ; the router stays float as real checkpoints keep it.
The reference for ``run`` is transformers' own float model loaded with ``from_pretrained`` from a folder of the
exactly dequantized weights under the same names: independent of w4pack's loader, experts module and kernels.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rtn_helper import MemorySource, rtn_quantize  # noqa: E402

from w4pack.checkpoint import open_checkpoint  # noqa: E402
from w4pack.cli import main  # noqa: E402
from w4pack.convert import convert  # noqa: E402
from w4pack.dtypes import to_float32  # noqa: E402
from w4pack.formats import get_format, open_source  # noqa: E402
from w4pack.formats._experts import (module_path_candidates, per_expert_hf_names, split_expert_name,  # noqa: E402
                                     split_stacked, stack_experts)
from w4pack.loading import load_model  # noqa: E402

#: the module leaves the tests quantize (attention and every expert / shared-expert projection)
QUANTIZED_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"}

CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
}


def _float_model(model_type: str, seed: int, **overrides: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=False,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0,
                               **{**CONFIGS[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 if name.endswith("gate.weight") else 0.1)  # routers decisive, away from ties
    return model.eval()


def _hub_state_dict(model: Any, folder: Path) -> dict[str, np.ndarray]:
    """The model's tensors under the names transformers saves (the Hub's per-expert spelling)."""
    from safetensors.numpy import load_file

    model.save_pretrained(folder)
    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def write_moe_gptq(root: Path, model_type: str, *, seed: int = 0, sym: bool = False,
                   quantize_router: bool = False, **overrides: Any) -> tuple[Path, Path]:
    """(GPTQ folder, float reference folder) of a tiny random MoE model of ``model_type`` (``overrides``: config
    values); the router (``<block>.gate``) is quantized too with ``quantize_router``."""
    model = _float_model(model_type, seed, **overrides)
    sd = _hub_state_dict(model, root / "float")
    layers, tensors, ref = {}, {}, {}
    leaves = QUANTIZED_LEAVES | ({"gate"} if quantize_router else set())
    quantized = {n.rpartition(".")[0] for n, a in sd.items()
                 if n.endswith(".weight") and a.ndim == 2 and n.split(".")[-2] in leaves}
    for name, arr in sd.items():
        mod, _, kind = name.rpartition(".")
        if mod in quantized and kind == "weight":
            layer = rtn_quantize(arr, group_size=32, sym=sym, name=mod, bias=sd.get(f"{mod}.bias"))
            layers[mod] = layer
            ref[name] = layer.dequantize(np.float32)
            if layer.bias is not None:
                ref[f"{mod}.bias"] = to_float32(layer.bias, layer.bias_dtype)
        elif mod in quantized:
            continue  # the bias travels with its layer (fp16, as GPTQ stores it)
        else:
            tensors[name] = (arr, "float32")
            ref[name] = arr
    cfg = model.config.to_dict()
    get_format("gptq").write(MemorySource(cfg, layers, tensors), root / "gptq")
    from safetensors.numpy import save_file

    (root / "ref").mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in ref.items()}, str(root / "ref" / "model.safetensors"),
              metadata={"format": "pt"})
    (root / "ref" / "config.json").write_text(json.dumps(cfg))
    return root / "gptq", root / "ref"


def _reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp(request.param)
    gptq, ref = write_moe_gptq(root, request.param, seed=3)
    out = root / "w4"
    convert(gptq, out)
    return {"type": request.param, "root": root, "gptq": gptq, "ref": ref, "w4": out}


# -------------------------------------------------------------------------------------------------
# names
# -------------------------------------------------------------------------------------------------
def test_expert_names_split_and_map_to_transformers_paths() -> None:
    ex = split_expert_name("model.layers.3.block_sparse_moe.experts.7.w3")
    assert ex is not None and (ex.block, ex.index, ex.leaf, ex.role) == \
        ("model.layers.3.block_sparse_moe", 7, "w3", "up")
    ex = split_expert_name("model.layers.0.mlp.experts.12.down_proj.qweight")
    assert ex is not None and (ex.index, ex.role, ex.tail) == (12, "down", ".qweight")
    assert split_expert_name("model.layers.0.mlp.shared_expert.down_proj") is None
    assert split_expert_name("model.layers.0.mlp.down_proj") is None
    assert module_path_candidates("model.layers.1.block_sparse_moe.gate.weight") == \
        ["model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert per_expert_hf_names("qwen3moe", 2, "gate", 2) == ["model.layers.2.mlp.experts.0.gate_proj",
                                                             "model.layers.2.mlp.experts.1.gate_proj"]
    assert per_expert_hf_names("llama", 0, "down", 1) == ["model.layers.0.block_sparse_moe.experts.0.w2"]


def test_stacked_experts_split_and_stack_back_byte_identical() -> None:
    raw = np.random.default_rng(0).integers(0, 256, size=(4, 8, 18), dtype=np.uint8)  # e.g. Q4_0 blocks
    parts = split_stacked(raw)
    assert len(parts) == 4 and all(np.array_equal(p, raw[e]) for e, p in enumerate(parts))
    assert stack_experts(parts).tobytes() == raw.tobytes()
    with pytest.raises(ValueError, match="expert 1"):
        stack_experts([raw[0], raw[1][:4]])


# -------------------------------------------------------------------------------------------------
# read, pack, verify, convert back
# -------------------------------------------------------------------------------------------------
def test_per_expert_layers_are_read_and_packed(moe: dict[str, Any]) -> None:
    src = open_source(moe["gptq"])
    names = src.layer_names()
    experts = [n for n in names if split_expert_name(n) is not None]
    assert len(experts) == 2 * 4 * 3, experts  # layers x experts x (gate, up, down)
    with open_checkpoint(moe["w4"]) as ck:
        assert set(ck.layers) == set(names)
        for n in experts[:5]:
            a, b = ck.layer(n), src.read_layer(n)
            assert np.array_equal(a.codes, b.codes) and np.array_equal(a.scales, b.scales)
        router = [t for t in ck.passthrough if t.endswith(".gate.weight")]
        assert len(router) == 2, ck.passthrough  # the router stays float, as the source keeps it


def test_verify_against_the_source(moe: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["verify", str(moe["w4"]), "--against", str(moe["gptq"]), "--json", "--limit", "6"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0, doc
    assert doc["ok"] is True


def test_converts_back_with_per_expert_names(moe: dict[str, Any], tmp_path: Path) -> None:
    # every architecture to GPTQ; qwen2_moe (experts, shared expert and its gate) to every output format
    fmts = ["gptq", "awq", "compressed-tensors"] if moe["type"] == "qwen2_moe" else ["gptq"]
    for fmt in fmts:
        out = tmp_path / fmt
        convert(moe["w4"], out, to=fmt)
        back = open_source(out)
        with open_checkpoint(moe["w4"]) as ck:
            assert sorted(back.layer_names()) == sorted(ck.layers), fmt
            for n in ck.layers:
                if split_expert_name(n) is None:
                    continue
                a, b = ck.layer(n), back.read_layer(n)
                assert np.array_equal(a.dequantize(np.float64), b.dequantize(np.float64)), (fmt, n)
            assert set(back.passthrough_names()) >= {t for t in ck.passthrough if t.endswith("gate.weight")}, fmt


# -------------------------------------------------------------------------------------------------
# run
# -------------------------------------------------------------------------------------------------
def test_load_model_builds_packed_experts(moe: dict[str, Any]) -> None:
    from w4pack.runtime.torch_module import W4Experts, W4Linear

    model = load_model(moe["w4"])
    experts = [m for m in model.modules() if isinstance(m, W4Experts)]
    assert len(experts) == 2 and all(m.num_experts == 4 for m in experts)
    w4 = [n for n, m in model.named_modules() if isinstance(m, W4Linear) and ".experts." in n]
    assert len(w4) == 2 * 4 * 3
    assert not any(p.dim() == 3 for p in model.parameters())  # no float expert weights left


def test_logits_equal_the_float_model(moe: dict[str, Any]) -> None:
    model, ref = load_model(moe["w4"]), _reference(moe["ref"])
    x = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = model(x).logits, ref(x).logits
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, err


def test_cli_run_generates_the_float_models_tokens(moe: dict[str, Any], capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    folder = moe["root"] / "w4tok"
    if not folder.exists():
        import shutil

        shutil.copytree(moe["w4"], folder)
        _char_tokenizer(folder)
    rc = main(["run", str(folder), "--prompt", "experts route", "--max-new-tokens", "5", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0, doc
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("experts route", return_tensors="pt")
    with torch.no_grad():
        want = _reference(moe["ref"]).generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert doc["token_ids"] == want[0, ids["input_ids"].shape[1]:].tolist()


def _char_tokenizer(folder: Path) -> None:
    """A character-level tokenizer of 96 ids saved beside the weights (the model's vocabulary size)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in map(chr, range(32, 125)):
        vocab[c] = len(vocab)
    assert len(vocab) == 96
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(folder)


def test_a_missing_expert_is_named(moe: dict[str, Any], tmp_path: Path) -> None:
    """A checkpoint that lacks one expert's projection is refused naming it, never run with random weights."""
    from w4pack.errors import BadInputError

    src = open_source(moe["gptq"])
    drop = next(n for n in src.layer_names() if (e := split_expert_name(n)) and e.index == 2 and e.role == "up")
    layers = {n: src.read_layer(n) for n in src.layer_names() if n != drop}
    tensors = {t: (np.asarray(d.array), d.dtype) for t in src.passthrough_names()
               for d in [src.read_tensor(t)]}
    get_format("gptq").write(MemorySource(src.config, layers, tensors), tmp_path / "gptq")
    convert(tmp_path / "gptq", tmp_path / "w4")
    with pytest.raises(BadInputError, match=r"experts\.2\."):
        load_model(tmp_path / "w4")


def test_a_quantized_router_and_from_pretrained(tmp_path: Path) -> None:
    """A source that quantizes the router keeps it packed in the folder; at load it is dequantized exactly into
    transformers' router (which computes its logits inside its own routing code). ``from_pretrained`` on the
    folder builds the same packed experts as ``load_model``."""
    import w4pack  # noqa: F401 - registers quant_method "w4pack" with transformers
    from transformers import AutoModelForCausalLM

    # 8 experts: GPTQ's qzeros pack 8 output rows into a word
    gptq, ref_dir = write_moe_gptq(tmp_path, "mixtral", seed=4, quantize_router=True, num_local_experts=8)
    out = tmp_path / "w4"
    convert(gptq, out)
    with open_checkpoint(out) as ck:
        assert "model.layers.0.block_sparse_moe.gate" in ck.layers
    ref = _reference(ref_dir)
    x = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x).logits
        for model in (load_model(out), AutoModelForCausalLM.from_pretrained(out)):
            got = model(x).logits
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 1e-5, err


# -------------------------------------------------------------------------------------------------
# GGUF: stacked ffn_*_exps split into per-expert layers and stacked back
# -------------------------------------------------------------------------------------------------
def _write_moe_gguf(root: Path, model_type: str = "qwen3_moe") -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny Qwen3-MoE (or Qwen2-MoE) GGUF laid out as llama.cpp's converter writes it (experts and attention
    Q4_0 by gguf-py's own quantizer, the rest F32; Qwen2-MoE's shared-expert gate [1, H] as a 1-D [H] tensor)
    and gguf-py's dequantization of every tensor under the transformers (Hub) names and shapes."""
    gguf = pytest.importorskip("gguf", reason="GGUF tests need gguf: pip install 'w4pack[gguf]'")
    from w4pack.formats._hf_names import hf_to_gguf

    arch = model_type.replace("_", "")
    model = _float_model(model_type, 7)
    sd = _hub_state_dict(model, root / "float")
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(root / "moe.gguf"), arch=arch)
    for key, val in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                     ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                     ("attention.head_count", c.num_attention_heads), ("attention.head_count_kv",
                     c.num_key_value_heads), ("attention.key_length", head_dim), ("attention.value_length",
                     head_dim), ("expert_count", c.num_experts), ("expert_used_count", c.num_experts_per_tok),
                     ("expert_feed_forward_length", c.moe_intermediate_size), ("vocab_size", c.vocab_size),
                     ("expert_shared_feed_forward_length", getattr(c, "shared_expert_intermediate_size", 0))):
        if val:
            w.add_uint32(f"{arch}.{key}", int(val))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
    w.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    q4 = gguf.GGMLQuantizationType.Q4_0
    ref: dict[str, np.ndarray] = {}

    def quantized(arr: np.ndarray) -> np.ndarray:
        return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), q4)

    for i in range(c.num_hidden_layers):
        for role, leaf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            names_ = [f"model.layers.{i}.mlp.experts.{e}.{leaf}.weight" for e in range(c.num_experts)]
            stacked = quantized(np.stack([sd.pop(n) for n in names_]))
            w.add_tensor(f"blk.{i}.ffn_{role}_exps.weight", stacked, raw_dtype=q4)
            deq = gguf.quants.dequantize(stacked, q4)
            for e, n in enumerate(names_):
                ref[n] = deq[e]
    for name, arr in sd.items():
        gname = hf_to_gguf(name)
        assert gname is not None, name
        if arr.ndim == 2 and name.split(".")[-2] in QUANTIZED_LEAVES:
            data = quantized(arr)
            w.add_tensor(gname, data, raw_dtype=q4)
            ref[name] = gguf.quants.dequantize(data, q4)
        else:
            if name.endswith("shared_expert_gate.weight"):  # llama.cpp: ffn_gate_inp_shexp is {n_embd}, 1-D
                assert arr.shape == (1, c.hidden_size), arr.shape
                w.add_tensor(gname, np.ascontiguousarray(arr[0], dtype=np.float32))
            else:
                w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
            ref[name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (root / "ref").mkdir()
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in ref.items()},
              str(root / "ref" / "model.safetensors"), metadata={"format": "pt"})
    (root / "ref" / "config.json").write_text(json.dumps(model.config.to_dict()))
    return root / "moe.gguf", ref


def _assert_runs_like_the_reference(out: Path, ref: Path) -> None:
    """The packed folder ``out`` loads and gives the float reference model's (at ``ref``) logits."""
    model = load_model(out)
    x = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(x).logits, _reference(ref)(x).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_gguf_stacked_experts_read_run_and_write_back(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf", reason="GGUF tests need gguf: pip install 'w4pack[gguf]'")
    path, ref = _write_moe_gguf(tmp_path)
    src = open_source(path)
    experts_ = [n for n in src.layer_names() if split_expert_name(n) is not None]
    assert len(experts_) == 2 * 4 * 3
    for n in experts_[:6] + experts_[-3:]:
        got = src.read_layer(n).dequantize(np.float32)
        assert np.array_equal(got, ref[n + ".weight"]), n  # bit-exact against gguf-py's own dequantization
    assert src.config["model_type"] == "qwen3_moe" and src.config["num_experts"] == 4
    assert "model.layers.0.mlp.gate.weight" in src.passthrough_names()
    out = tmp_path / "w4"
    convert(path, out)
    _assert_runs_like_the_reference(out, tmp_path / "ref")
    back = tmp_path / "back.gguf"
    convert(out, back, to="gguf")
    a, b = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(back))
    ta = {t.name: t for t in a.tensors}
    tb = {t.name: t for t in b.tensors}
    assert set(ta) == set(tb)
    for name, t in ta.items():
        assert tb[name].tensor_type == t.tensor_type and list(tb[name].shape) == list(t.shape), name
        assert np.asarray(tb[name].data).tobytes() == np.asarray(t.data).tobytes(), name


def test_gguf_qwen2_moe_shared_expert_gate_runs_and_writes_back(tmp_path: Path) -> None:
    """llama.cpp stores Qwen2-MoE's shared-expert gate ``ffn_gate_inp_shexp`` 1-D ([H], as in the Hub's
    Qwen1.5-MoE GGUFs); transformers' ``mlp.shared_expert_gate`` is nn.Linear(H, 1), weight [1, H]. The folder
    holds transformers' shape, so the model loads and runs; the way back writes llama.cpp's 1-D tensor again
    with every tensor's bytes, and a GPTQ source's [1, H] gate is written 1-D too. (The source lacks the
    general.file_type keys w4pack's writer adds, so the files differ in those.)"""
    gguf = pytest.importorskip("gguf", reason="GGUF tests need gguf: pip install 'w4pack[gguf]'")
    path, ref = _write_moe_gguf(tmp_path, "qwen2_moe")
    src = open_source(path)
    gate = "model.layers.0.mlp.shared_expert_gate.weight"
    assert src.config["shared_expert_intermediate_size"] == 64
    assert src.read_tensor(gate).array.shape == (1, 64)
    out = tmp_path / "w4"
    convert(path, out)
    with open_checkpoint(out) as ck:
        assert np.array_equal(np.asarray(ck.tensor(gate)), ref[gate])
    _assert_runs_like_the_reference(out, tmp_path / "ref")
    back = tmp_path / "back.gguf"
    convert(out, back, to="gguf")
    a, b = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(back))
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    for ta, tb in zip(a.tensors, b.tensors):  # the gate 1-D again; every tensor's bytes as they were
        assert (tb.tensor_type, list(tb.shape)) == (ta.tensor_type, list(ta.shape)), ta.name
        assert np.asarray(tb.data).tobytes() == np.asarray(ta.data).tobytes(), ta.name
    gptq, _ref = write_moe_gptq(tmp_path / "g", "qwen2_moe", seed=3, sym=True)  # sym: GGUF Q4_0 holds it
    convert(gptq, tmp_path / "g" / "w4")
    convert(tmp_path / "g" / "w4", tmp_path / "g" / "out.gguf", to="gguf")
    shexp = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "g" / "out.gguf")).tensors
             if t.name.endswith("ffn_gate_inp_shexp.weight")}
    assert sorted(shexp) == ["blk.0.ffn_gate_inp_shexp.weight", "blk.1.ffn_gate_inp_shexp.weight"]
    assert all(list(t.shape) == [64] for t in shexp.values()), {n: list(t.shape) for n, t in shexp.items()}
