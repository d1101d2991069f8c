"""GGUF files written by llama.cpp's own quantizer (tests/data/llama_quantize, made by tools/make_llama_quants.py):
every K-quant and IQ4 tensor packed losslessly, verified bit-identical, written back byte for byte, run through
the W4Linear kernels to the float model's logits, and stored in the GGUF's own size.

The other GGUF tests read files that gguf-py or w4pack wrote; these read llama.cpp's, with its recipes' type mixes
and its quantizers' choices of scales (the ones people download). They need neither llama_cpp nor the tool, except
the one that regenerates the files."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from w4pack.checkpoint import open_checkpoint
from w4pack.convert import convert
from w4pack.store.sizes import tensor_bytes
from w4pack.verify import verify

gguf = pytest.importorskip("gguf", reason="pip install gguf (the [gguf] extra) to read and write GGUF")

REPO = Path(__file__).resolve().parent.parent.parent
DATA = REPO / "tests" / "data" / "llama_quantize"

#: per file: llama's file type and its tensor types as llama.cpp's recipe chose them (the norms, F32, aside):
#: {type: tensors (without ".weight")}, or {type: count} where the type takes every remaining quantized tensor
RECIPES: dict[str, tuple[str, dict[str, list[str] | int]]] = {
    "Q4_K_M": ("MOSTLY_Q4_K_M", {"Q6_K": ["output", "blk.1.attn_v", "blk.1.ffn_down"], "Q4_K": 13}),
    "Q4_K_S": ("MOSTLY_Q4_K_S", {"Q6_K": ["output"], "Q5_K": ["blk.0.attn_v", "blk.1.attn_v"], "Q4_K": 13}),
    "Q5_K_M": ("MOSTLY_Q5_K_M", {"Q6_K": ["output", "blk.1.attn_v", "blk.1.ffn_down"], "Q5_K": 13}),
    "Q6_K": ("MOSTLY_Q6_K", {"Q6_K": 16}),
    "Q3_K_M": ("MOSTLY_Q3_K_M", {"Q6_K": ["output"], "Q5_K": ["blk.0.attn_v", "blk.1.attn_v"],
                                 "Q4_K": ["blk.0.attn_output", "blk.0.ffn_down", "blk.1.attn_output",
                                          "blk.1.ffn_down"], "Q3_K": 9}),
    "Q2_K": ("MOSTLY_Q2_K", {"Q6_K": ["output"], "Q3_K": [f"blk.{i}.{t}" for i in (0, 1)
                                                          for t in ("attn_output", "attn_v", "ffn_down")],
                             "Q2_K": 9}),
    "IQ4_XS": ("MOSTLY_IQ4_XS", {"Q6_K": ["output"], "IQ4_XS": 15}),
    "IQ4_NL": ("MOSTLY_IQ4_NL", {"Q6_K": ["output"], "IQ4_NL": 15}),
}
NORMS = ["output_norm"] + [f"blk.{i}.{n}" for i in (0, 1) for n in ("attn_norm", "ffn_norm")]

#: GGUF tensor -> transformers name, written out here so that the float reference does not use w4pack's own map
_HF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
       "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def hf_module(gname: str) -> str:
    """transformers module of a GGUF tensor name ("blk.0.attn_q.weight" -> "model.layers.0.self_attn.q_proj")."""
    base = gname[: -len(".weight")]
    if base.startswith("blk."):
        _blk, i, part = base.split(".", 2)
        return f"model.layers.{i}.{_HF[part]}"
    return _HF[base]


def path_of(ftype: str) -> Path:
    return DATA / f"tiny-{ftype}.gguf"


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' un-permutation of llama.cpp's rotary q/k row order (per head: (d/2, 2) -> (2, d/2))."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def field(r: "gguf.GGUFReader", key: str):
    return r.fields[key].contents()


def dequantized(path: Path) -> dict[str, np.ndarray]:
    """transformers module -> float32 weight, by gguf-py's own dequantization, q/k rows in transformers' order."""
    r = gguf.GGUFReader(str(path))
    heads = int(field(r, "llama.attention.head_count"))
    kv = int(field(r, "llama.attention.head_count_kv"))
    out = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if ".attn_q." in t.name:
            w = reverse_permute(w, heads)
        elif ".attn_k." in t.name:
            w = reverse_permute(w, kv)
        out[hf_module(t.name)] = w
    return out


def shard_tensor_bytes(folder: Path) -> int:
    """Bytes of tensor data in the folder's safetensors shards (each file less its JSON header)."""
    return tensor_bytes(folder)


def gguf_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every committed file converted once (about 0.2 s each). No growth warning: the tensor bytes equal the
    GGUF's (test_folder_is_the_gguf_size); the folder's JSON side files are not weights."""
    return convert_each(tmp_path_factory.mktemp("llamaq"), {f: path_of(f) for f in RECIPES})


def convert_each(d: Path, sources: dict[str, Path]) -> dict[str, Path]:
    """Each source converted into ``d/<key>``, a growth warning an error (the tensor bytes are the GGUF's)."""
    import warnings

    from w4pack.convert import GrowthWarning

    out = {}
    for key, src in sources.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error", GrowthWarning)
            convert(src, d / key, show_progress=False)
        out[key] = d / key
    return out


def assert_mix(types: dict[str, str], mix: dict[str, list[str] | int], ftype: str) -> None:
    """The recipe's named tensors have their types, and every other non-F32 tensor the recipe's bulk type."""
    named = {n: q for q, ns in mix.items() if isinstance(ns, list) for n in ns}
    for n, q in named.items():
        assert types[n] == q, (ftype, n, types[n])
    rest = [q for n, q in types.items() if q != "F32" and n not in named]
    (bulk, count), = [(q, c) for q, c in mix.items() if isinstance(c, int)]
    assert rest == [bulk] * count, (ftype, sorted(set(rest)))


def assert_same_tensors(a: "gguf.GGUFReader", b: "gguf.GGUFReader", ftype: str) -> None:
    """b holds a's tensors in a's order, each with its type, shape and bytes."""
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert (tb.tensor_type, list(tb.shape)) == (ta.tensor_type, list(ta.shape)), ta.name
        assert np.asarray(tb.data).tobytes() == np.asarray(ta.data).tobytes(), (ftype, ta.name)


def test_the_set_is_small() -> None:
    """The dense files (the tiny Mixtral's tiny-moe-*.gguf are test_gguf_llama_quantize_moe's)."""
    sizes = {p.name: p.stat().st_size for p in DATA.glob("*.gguf") if not p.name.startswith("tiny-moe-")}
    assert sorted(sizes) == sorted(path_of(f).name for f in RECIPES), sizes
    assert max(sizes.values()) < 750_000 and sum(sizes.values()) < 4_500_000, sizes


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_tensor_types_are_llama_cpps_recipe(ftype: str) -> None:
    """The files hold what llama.cpp's recipe wrote (a regenerated file with another mix fails here first)."""
    want_ftype, mix = RECIPES[ftype]
    r = gguf.GGUFReader(str(path_of(ftype)))
    assert field(r, "general.file_type") == gguf.LlamaFileType[want_ftype].value
    types = {t.name[: -len(".weight")]: t.tensor_type.name for t in r.tensors}
    assert sorted(n for n, q in types.items() if q == "F32") == sorted(NORMS)
    assert_mix(types, mix, ftype)


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_every_linear_layer_is_packed_and_equals_gguf_py(ftype: str, converted: dict[str, Path]) -> None:
    """16 layers (14 linear, the head and the token embedding) packed from their own type, none dequantized to
    float: each unpacks to gguf-py's dequantization bit for bit; only the five F32 norms pass through."""
    ck = open_checkpoint(converted[ftype])
    r = gguf.GGUFReader(str(path_of(ftype)))
    types = {hf_module(t.name): t.tensor_type.name for t in r.tensors}
    linear = {n for n, q in types.items() if q != "F32"}
    assert set(ck.layers) == linear and len(linear) == 16
    assert sorted(ck.passthrough) == sorted(hf_module(n + ".weight") + ".weight" for n in NORMS)
    deq = dequantized(path_of(ftype))
    for name in ck.layers:
        layer = ck.layer(name)
        assert f"gguf_type={types[name]}" in layer.source["notes"], (name, layer.source)  # the manifest's record
        got = layer.dequantize(np.float64).astype(np.float32)
        want = deq[name]
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (ftype, name)


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_verify_against_the_gguf_is_bit_identical(ftype: str, converted: dict[str, Path]) -> None:
    rep = verify(converted[ftype], against=path_of(ftype), show_progress=False)
    assert rep.ok, rep.summary()
    assert len(rep.layers) == 16 and all(c.exact is True for c in rep.layers), rep.summary()


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_back_to_gguf_keeps_every_tensor_and_key(ftype: str, converted: dict[str, Path], tmp_path: Path) -> None:
    """Each tensor comes back with its name, type, shape and bytes, in the source's order. Metadata may
    legitimately differ only in keys that describe the writer rather than the model; w4pack writes none, and
    keeps llama.cpp's keys (general.quantization_version and general.file_type included) in their order, so
    today the whole file is the same byte for byte, and that is asserted too."""
    src = path_of(ftype)
    back = tmp_path / "back.gguf"
    convert(converted[ftype], back, to="gguf", show_progress=False)
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(back))
    assert_same_tensors(a, b, ftype)
    keys = [k for k in a.fields if not k.startswith("GGUF.")]
    assert [k for k in b.fields if not k.startswith("GGUF.")] == keys
    for k in keys:
        assert b.fields[k].contents() == a.fields[k].contents(), k
    assert back.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_folder_is_the_gguf_size(ftype: str, converted: dict[str, Path]) -> None:
    """The shards' tensor bytes within 5% of the GGUF's; in fact equal, as the compact storage keeps each
    block's own fields at their own widths (IQ4 included: 4-bit codebook indices)."""
    ratio = shard_tensor_bytes(converted[ftype]) / gguf_tensor_bytes(path_of(ftype))
    assert abs(ratio - 1) <= 0.05, (ftype, ratio)


def _float_model(path: Path):
    """transformers' LlamaForCausalLM from the GGUF's metadata with gguf-py's dequantized weights (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    r = gguf.GGUFReader(str(path))
    hidden, heads = int(field(r, "llama.embedding_length")), int(field(r, "llama.attention.head_count"))
    cfg = LlamaConfig(vocab_size=int(field(r, "llama.vocab_size")), hidden_size=hidden,
                      intermediate_size=int(field(r, "llama.feed_forward_length")),
                      num_hidden_layers=int(field(r, "llama.block_count")), num_attention_heads=heads,
                      num_key_value_heads=int(field(r, "llama.attention.head_count_kv")), head_dim=hidden // heads,
                      rms_norm_eps=float(field(r, "llama.attention.layer_norm_rms_epsilon")),
                      rope_theta=float(field(r, "llama.rope.freq_base")),
                      max_position_embeddings=int(field(r, "llama.context_length")), tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    state = {f"{k}.weight": torch.from_numpy(v) for k, v in dequantized(path).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_w4linear_logits_equal_the_float_model(ftype: str, converted: dict[str, Path]) -> None:
    """The packed model on CPU (W4Linear, exact precision) against transformers' float model holding gguf-py's
    dequantized weights: the same logits within the kernels' float32 summation-order tolerance."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from w4pack.loading import load_model

    packed = load_model(converted[ftype], device="cpu", precision="exact")
    ref = _float_model(path_of(ftype))
    ids = torch.from_numpy(np.random.default_rng(7).integers(0, 128, (2, 24)))
    with torch.no_grad():
        a, b = packed(ids).logits.float(), ref(ids).logits
    rel = float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())
    assert rel < 1e-4, (ftype, rel)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_committed_files_are_what_the_tool_makes(tmp_path: Path) -> None:
    """llama.cpp's quantizer is deterministic: the tool regenerates every committed file byte for byte, so the
    data's provenance (tests/data/llama_quantize/README.md) can be checked, not only read."""
    pytest.importorskip("llama_cpp", reason="pip install llama-cpp-python to regenerate the llama.cpp-made files")
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_llama_quants
    finally:
        sys.path.pop(0)
    made = make_llama_quants.make(tmp_path, list(RECIPES))
    for p in made:
        assert p.read_bytes() == (DATA / p.name).read_bytes(), p.name


@pytest.mark.parametrize("ftype", list(RECIPES))
def test_inspect_says_every_type_is_packed_losslessly(ftype: str) -> None:
    """inspect on the GGUF says how each type is carried: every quantized type packed losslessly, the norms passed
    through, nothing dequantized."""
    from click.testing import CliRunner

    from w4pack.cli import cli

    res = CliRunner().invoke(cli, ["inspect", str(path_of(ftype))])
    assert res.exit_code == 0, res.output
    notes = [ln.strip()[len("note: "):] for ln in res.output.splitlines() if ln.strip().startswith("note: ")]
    _ft, mix = RECIPES[ftype]
    want = {f"{q}: {n if isinstance(n, int) else len(n)} packed losslessly" for q, n in mix.items()}
    assert want | {"F32: 5 passed through as they are"} <= set(notes), notes
    assert not [n for n in notes if "dequantized" in n or "not packed" in n], notes
