"""A mixture-of-experts GGUF written by llama.cpp's own quantizer (tests/data/llama_quantize/tiny-moe-*.gguf, made
by tools/make_llama_quants.py): a tiny Mixtral (GGUF architecture ``llama`` with ``llama.expert_count``) whose
stacked 3-D expert tensors ``ffn_{gate,up,down}_exps`` are K-quants as in the Mixtral ``Q4_K_M`` files people
download. Every expert is read into its own packed layer bit-exactly, verified, written back byte for byte, stored
in the GGUF's own size and run through W4Linear to the float model's logits and greedy tokens.

tests/test_moe.py covers MoE with files that w4pack's tests write (gguf-py's Q4_0); these are llama.cpp's, with
its recipe's type mix (the last layer's ffn_down_exps in Q6_K) and its router kept F32. They need neither llama_cpp
nor the tool, except the test that regenerates the files."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from w4pack.checkpoint import open_checkpoint
from w4pack.convert import convert
from w4pack.verify import verify

gguf = pytest.importorskip("gguf", reason="pip install gguf (the [gguf] extra) to read and write GGUF")

from test_gguf_llama_quantize import (DATA, REPO, assert_mix, assert_same_tensors, convert_each,  # noqa: E402
                                      field, gguf_tensor_bytes, reverse_permute, shard_tensor_bytes)

LAYERS, EXPERTS = 2, 4
#: per file: llama's file type and the tensor types llama.cpp's recipe chose, as in test_gguf_llama_quantize
#: ({type: tensors without ".weight"}, or {type: count} for the type of every remaining quantized tensor)
RECIPES: dict[str, tuple[str, dict[str, list[str] | int]]] = {
    "Q4_K_M": ("MOSTLY_Q4_K_M", {"Q6_K": ["output", "blk.1.attn_v", "blk.1.ffn_down_exps"], "Q4_K": 13}),
}
#: float tensors: the norms and the routers (llama.cpp never quantizes ffn_gate_inp)
FLOAT = ["output_norm"] + [f"blk.{i}.{n}" for i in range(LAYERS) for n in ("attn_norm", "ffn_norm", "ffn_gate_inp")]
STACKED = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}

#: GGUF tensor -> transformers' checkpoint (Hub) name of a Mixtral, written out here rather than taken from w4pack
_HF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
       "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
       "ffn_gate_inp": "block_sparse_moe.gate"}


def path_of(ftype: str) -> Path:
    return DATA / f"tiny-moe-{ftype}.gguf"


def hf_modules(gname: str, experts: int = EXPERTS) -> list[str]:
    """Checkpoint module(s) of a GGUF tensor: one per expert for a stacked ``ffn_*_exps`` tensor."""
    base = gname[: -len(".weight")]
    if not base.startswith("blk."):
        return [_HF[base]]
    _blk, i, part = base.split(".", 2)
    if part in STACKED:
        return [f"model.layers.{i}.block_sparse_moe.experts.{e}.{STACKED[part]}" for e in range(experts)]
    return [f"model.layers.{i}.{_HF[part]}"]


def dequantized(path: Path) -> dict[str, np.ndarray]:
    """Checkpoint module -> float32 weight by gguf-py's own dequantization (each expert its slice of the stacked
    tensor), q/k rows in transformers' order."""
    r = gguf.GGUFReader(str(path))
    heads, kv = int(field(r, "llama.attention.head_count")), int(field(r, "llama.attention.head_count_kv"))
    out = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if ".attn_q." in t.name:
            w = reverse_permute(w, heads)
        elif ".attn_k." in t.name:
            w = reverse_permute(w, kv)
        mods = hf_modules(t.name)
        parts = [w] if len(mods) == 1 else list(w)
        assert len(parts) == len(mods), (t.name, w.shape)
        out.update(zip(mods, parts))
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every committed MoE file converted once, with no growth warning (the tensor bytes are the GGUF's)."""
    return convert_each(tmp_path_factory.mktemp("llamaq-moe"), {f: path_of(f) for f in RECIPES})


def test_the_moe_set_is_small() -> None:
    sizes = {p.name: p.stat().st_size for p in DATA.glob("tiny-moe-*.gguf")}
    assert sorted(sizes) == sorted(path_of(f).name for f in RECIPES), sizes
    assert max(sizes.values()) < 1_300_000 and sum(sizes.values()) < 2_000_000, sizes


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_tensor_types_are_llama_cpps_recipe(ftype: str) -> None:
    """llama.cpp's Mixtral metadata and type mix: the stacked experts are 3-D K-quant tensors [E, rows, cols]
    (the last layer's ffn_down_exps promoted to Q6_K as the _M recipes do), the router and norms F32."""
    want_ftype, mix = RECIPES[ftype]
    r = gguf.GGUFReader(str(path_of(ftype)))
    assert field(r, "general.file_type") == gguf.LlamaFileType[want_ftype].value
    assert field(r, "general.architecture") == "llama"
    assert (field(r, "llama.expert_count"), field(r, "llama.expert_used_count")) == (EXPERTS, 2)
    tensors = {t.name[: -len(".weight")]: t for t in r.tensors}
    types = {n: t.tensor_type.name for n, t in tensors.items()}
    assert sorted(n for n, q in types.items() if q == "F32") == sorted(FLOAT)
    stacked = [n for n in tensors if n.split(".")[-1] in STACKED]
    assert len(stacked) == 3 * LAYERS
    for n in stacked:
        assert types[n] in ("Q4_K", "Q6_K") and len(tensors[n].shape) == 3, (n, types[n])
        assert list(tensors[n].shape) == [256, 256, EXPERTS], n  # GGUF's dims: cols, rows, experts
    assert list(tensors["blk.0.ffn_gate_inp"].shape) == [256, EXPERTS]
    assert_mix(types, mix, ftype)


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_every_expert_and_linear_layer_is_packed_and_equals_gguf_py(ftype: str, converted: dict[str, Path]
                                                                   ) -> None:
    """34 layers (2 x (4 attention + 4 experts x 3)), the head and the token embedding) packed from their own
    K-quant type, none dequantized: each unpacks to gguf-py's dequantization bit for bit; only the norms and
    the F32 routers pass through, as float tensors."""
    ck = open_checkpoint(converted[ftype])
    r = gguf.GGUFReader(str(path_of(ftype)))
    types = {m: t.tensor_type.name for t in r.tensors for m in hf_modules(t.name)}
    linear = {n for n, q in types.items() if q != "F32"}
    experts = {n for n in linear if ".experts." in n}
    assert len(experts) == LAYERS * EXPERTS * 3 and len(linear) == 34
    assert set(ck.layers) == linear
    assert sorted(ck.passthrough) == sorted(hf_modules(n + ".weight")[0] + ".weight" for n in FLOAT)
    deq = dequantized(path_of(ftype))
    for name in ck.layers:
        layer = ck.layer(name)
        assert f"gguf_type={types[name]}" in layer.source["notes"], (name, layer.source)
        got = layer.dequantize(np.float64).astype(np.float32)
        assert np.array_equal(got.view(np.uint32), deq[name].view(np.uint32)), (ftype, name)
    for name in ck.passthrough:  # the router: llama.cpp's F32 values, unchanged
        want = deq[name[: -len(".weight")]]
        assert np.array_equal(np.asarray(ck.tensor(name), dtype=np.float32), want), name


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_verify_against_the_gguf_is_bit_identical(ftype: str, converted: dict[str, Path]) -> None:
    rep = verify(converted[ftype], against=path_of(ftype), show_progress=False)
    assert rep.ok, rep.summary()
    assert len(rep.layers) == 34 and all(c.exact is True for c in rep.layers), rep.summary()


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_back_to_gguf_is_the_same_file(ftype: str, converted: dict[str, Path], tmp_path: Path) -> None:
    """The per-expert layers stack back into each 3-D ffn_*_exps tensor with its type, shape and bytes, every
    tensor in the source's order and every key kept: the whole file is the same byte for byte."""
    src = path_of(ftype)
    back = tmp_path / "back.gguf"
    convert(converted[ftype], back, to="gguf", show_progress=False)
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(back))
    assert_same_tensors(a, b, ftype)
    assert back.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_folder_tensor_bytes_are_the_gguf_s(ftype: str, converted: dict[str, Path]) -> None:
    """Compact storage: the shards hold exactly the GGUF's tensor bytes (each expert's K-quant blocks at their
    own field widths, the F32 tensors as they are)."""
    assert shard_tensor_bytes(converted[ftype]) == gguf_tensor_bytes(path_of(ftype))


def _float_model(path: Path):
    """transformers' MixtralForCausalLM from the GGUF's metadata holding gguf-py's dequantized weights (float32),
    the experts written straight into transformers' fused parameters (gate_up_proj [E, 2I, H] = gate rows then
    up rows, down_proj [E, H, I]), independent of w4pack's names, loader and experts module."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    r = gguf.GGUFReader(str(path))
    hidden, heads = int(field(r, "llama.embedding_length")), int(field(r, "llama.attention.head_count"))
    cfg = MixtralConfig(vocab_size=int(field(r, "llama.vocab_size")), hidden_size=hidden,
                        intermediate_size=int(field(r, "llama.feed_forward_length")),
                        num_hidden_layers=int(field(r, "llama.block_count")), num_attention_heads=heads,
                        num_key_value_heads=int(field(r, "llama.attention.head_count_kv")), head_dim=hidden // heads,
                        num_local_experts=int(field(r, "llama.expert_count")),
                        num_experts_per_tok=int(field(r, "llama.expert_used_count")),
                        rms_norm_eps=float(field(r, "llama.attention.layer_norm_rms_epsilon")),
                        rope_theta=float(field(r, "llama.rope.freq_base")),
                        max_position_embeddings=int(field(r, "llama.context_length")), tie_word_embeddings=False)
    model = MixtralForCausalLM(cfg).float().eval()
    deq = dequantized(path)
    state = {}
    for name, w in deq.items():
        if ".experts." in name:
            continue
        state[name.replace(".block_sparse_moe.", ".mlp.") + ".weight"] = torch.from_numpy(w)
    for i in range(cfg.num_hidden_layers):
        ex = [f"model.layers.{i}.block_sparse_moe.experts.{e}." for e in range(cfg.num_local_experts)]
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.from_numpy(
            np.stack([np.concatenate([deq[p + "w1"], deq[p + "w3"]]) for p in ex]))
        state[f"model.layers.{i}.mlp.experts.down_proj"] = torch.from_numpy(np.stack([deq[p + "w2"] for p in ex]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_w4linear_experts_equal_the_float_model(ftype: str, converted: dict[str, Path]) -> None:
    """The packed model on CPU (every expert a W4Linear, exact precision) against transformers' float Mixtral
    holding gguf-py's dequantized weights: the same logits within the kernels' float32 summation-order
    tolerance, and the same greedy tokens for 6 steps."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from w4pack.loading import load_model
    from w4pack.runtime.torch_module import W4Experts, W4Linear

    packed = load_model(converted[ftype], device="cpu", precision="exact")
    assert sum(isinstance(m, W4Experts) for m in packed.modules()) == LAYERS
    assert sum(isinstance(m, W4Linear) and ".experts." in n for n, m in packed.named_modules()) == \
        LAYERS * EXPERTS * 3
    assert not any(p.dim() == 3 for p in packed.parameters())  # no float expert weights
    ref = _float_model(path_of(ftype))
    ids = torch.from_numpy(np.random.default_rng(7).integers(0, 128, (2, 24)))
    with torch.no_grad():
        a, b = packed(ids).logits.float(), ref(ids).logits
        rel = float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())
        assert rel < 1e-4, (ftype, rel)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        seqs = []
        for model in (packed, ref):
            x = ids[:, :8]
            for _ in range(6):
                x = torch.cat([x, model(x).logits[:, -1:].argmax(-1)], dim=1)
            seqs.append(x[:, 8:])
    assert torch.equal(seqs[0], seqs[1]), seqs


def _tool():
    """tools/make_llama_quants.py as a module."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_llama_quants
    finally:
        sys.path.pop(0)
    return make_llama_quants


def _with_no_vocab(src: Path, dst: Path) -> None:
    """A copy of src with ``tokenizer.ggml.model = "none"`` (llama.cpp's no-vocabulary type: it refuses to load a
    file without the key), every other key and tensor as they are."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch=field(r, "general.architecture"))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    w.add_tokenizer_model("none")
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_llama_cpp_runs_the_file_as_w4pack_does(ftype: str, converted: dict[str, Path], tmp_path: Path) -> None:
    """llama.cpp itself evaluating its own file gives w4pack's logits (on CPU it rounds the activations to 8
    bits for K-quant dot products: about 1% of the largest logit here) and the same argmax: the metadata,
    expert order and routing are read as llama.cpp means them, not only as this file's float reference does."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python to compare with llama.cpp")
    torch = pytest.importorskip("torch")
    from w4pack.loading import load_model

    _tool()._quiet_llama_log()
    lc_file = tmp_path / "novocab.gguf"
    _with_no_vocab(path_of(ftype), lc_file)
    ids = np.random.default_rng(7).integers(0, 128, 24).tolist()
    llm = llama_cpp.Llama(model_path=str(lc_file), n_ctx=64, logits_all=True, n_threads=1, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
    packed = load_model(converted[ftype], device="cpu", precision="exact")
    with torch.no_grad():
        ours = packed(torch.tensor([ids])).logits[0].float().numpy()
    rel = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    assert rel < 0.05, (ftype, rel)
    assert np.array_equal(theirs.argmax(-1), ours.argmax(-1)), ftype


def test_the_committed_moe_files_are_what_the_tool_makes(tmp_path: Path) -> None:
    """llama.cpp's quantizer is deterministic: the tool regenerates every committed MoE file byte for byte
    (tests/data/llama_quantize/README.md, provenance)."""
    pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python to regenerate the llama.cpp-made files")
    make_llama_quants = _tool()
    made = make_llama_quants.make(tmp_path, list(RECIPES), make_llama_quants.MOE_SEED, moe=True)
    assert [p.name for p in made] == [path_of(f).name for f in RECIPES]
    for p in made:
        assert p.read_bytes() == (DATA / p.name).read_bytes(), p.name


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_inspect_says_every_expert_type_is_packed_losslessly(ftype: str) -> None:
    from click.testing import CliRunner

    from w4pack.cli import cli

    res = CliRunner().invoke(cli, ["inspect", str(path_of(ftype))])
    assert res.exit_code == 0, res.output
    notes = [ln.strip()[len("note: "):] for ln in res.output.splitlines() if ln.strip().startswith("note: ")]
    _ft, mix = RECIPES[ftype]
    want = {f"{q}: {n if isinstance(n, int) else len(n)} packed losslessly" for q, n in mix.items()}
    assert want | {f"F32: {len(FLOAT)} passed through as they are"} <= set(notes), notes
    assert not [n for n in notes if "dequantized" in n or "not packed" in n], notes
