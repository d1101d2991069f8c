"""Quantized token embeddings stay packed (issue 33 item 3): GGUF in, a layer of role "embedding", looked up
exactly by W4Embedding, a tied head on the same packed buffers, GGUF out byte for byte, other formats dequantized."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="reading GGUF needs the gguf package: pip install 'w4pack[gguf]'")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from w4pack.core.canonical import CanonicalLayer  # noqa: E402
from w4pack.convert import convert  # noqa: E402
from w4pack.store.checkpoint import open_checkpoint  # noqa: E402

VOCAB, HIDDEN, FFN = 40, 64, 96  # 40 rows: the last tile stripe is padded


def kquant(rng: np.random.Generator, qt: Any, n: int, k: int) -> np.ndarray:
    """Random Q4_K / Q6_K rows (gguf-py quantizes neither) in the form llama.cpp's quantizer writes: each
    super-block's largest sub-scale (and Q4_K minimum) at the end of its range, so they round-trip byte for byte."""
    nb = k // 256
    d = rng.uniform(1e-3, 4e-3, (n, nb)).astype("<f2")
    if qt == Q.Q6_K:  # ql[128] qh[64] int8 scales[16] fp16 d
        b = rng.integers(0, 256, (n, nb, 210), dtype=np.uint8)
        sc = rng.integers(-127, 128, (n, nb, 16)).astype(np.int8)
        sc[..., 0] = -128
        b[..., 192:208] = sc.view(np.uint8)
        b[..., 208:210] = d[..., None].view(np.uint8)
        return b.reshape(n, -1)
    # Q4_K: fp16 d, dmin; 12 bytes of 6-bit scales and minima (eight each); qs[128]
    sc, mn = rng.integers(0, 64, (2, n, nb, 8))
    sc[..., 0], mn[..., 1] = 63, 63
    b = np.zeros((n, nb, 144), np.uint8)
    b[..., 0:2] = d[..., None].view(np.uint8)
    b[..., 2:4] = (d / 8).astype("<f2")[..., None].view(np.uint8)
    lo, hi = slice(0, 4), slice(4, 8)
    b[..., 4:8] = sc[..., lo] | (sc[..., hi] >> 4 << 6)
    b[..., 8:12] = mn[..., lo] | (mn[..., hi] >> 4 << 6)
    b[..., 12:16] = (sc[..., hi] & 15) | ((mn[..., hi] & 15) << 4)
    b[..., 16:] = rng.integers(0, 256, (n, nb, 128), dtype=np.uint8)
    return b.reshape(n, -1)


def make_gguf(path: Path, *, emb_type: Any = Q.Q4_1, output: Any = None, layer_type: Any = Q.Q4_1,
              hidden: int = HIDDEN, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-block llama whose token embedding is quantized (``emb_type``); a head of type ``output`` or none
    (tied). Returns gguf-py's dequantization of each tensor."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add, v in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, FFN), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                   (w.add_vocab_size, VOCAB), (w.add_file_type, 3), (w.add_quantization_version, 2)):
        add(v)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    deq: dict[str, np.ndarray] = {}
    h = hidden
    shapes = [("token_embd.weight", (VOCAB, h), emb_type), ("blk.0.attn_norm.weight", (h,), Q.F32)]
    shapes += [(f"blk.0.{n}.weight", s, layer_type) for n, s in (
        ("attn_q", (h, h)), ("attn_k", (h // 2, h)), ("attn_v", (h // 2, h)), ("attn_output", (h, h)),
        ("ffn_gate", (FFN, h)), ("ffn_up", (FFN, h)), ("ffn_down", (h, FFN)))]
    shapes += [("blk.0.ffn_norm.weight", (h,), Q.F32), ("output_norm.weight", (h,), Q.F32)]
    if output is not None:
        shapes.append(("output.weight", (VOCAB, h), output))
    for name, shape, qt in shapes:
        x = rng.normal(0, 0.5 if "embd" in name else 0.05, shape).astype(np.float32)
        if qt == Q.F32:
            x = (1 + 0.1 * x).astype(np.float32)
            w.add_tensor(name, x)
            deq[name] = x
            continue
        data = kquant(rng, qt, *shape) if qt in (Q.Q4_K, Q.Q6_K) else gguf.quants.quantize(x, qt)
        w.add_tensor(name, data, raw_dtype=qt)
        deq[name] = gguf.quants.dequantize(data, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


pytestmark = pytest.mark.filterwarnings("ignore::w4pack.convert.GrowthWarning")


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A GGUF with a Q4_1 embedding and no head (tied), and its w4pack folder."""
    d = tmp_path_factory.mktemp("tied")
    deq = make_gguf(d / "m.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a model this small grows by its side files (metadata, config)
        convert(d / "m.gguf", d / "w4", show_progress=False)
    return d / "m.gguf", d / "w4", deq


def test_gguf_embedding_stays_packed_verifies_and_round_trips(tied: tuple[Path, Path, dict[str, np.ndarray]],
                                                               tmp_path: Path) -> None:
    """The embedding is a packed layer marked "embedding", equal to gguf-py's dequantization bit for bit, verified
    against the GGUF, and written back as the same file byte for byte."""
    from w4pack.verify import verify

    src, out, deq = tied
    with open_checkpoint(out) as ck:
        meta = ck.manifest["layers"]["model.embed_tokens"]
        assert meta["role"] == "embedding" and meta["shape"] == [VOCAB, HIDDEN] and meta["zero_mode"] == "float"
        assert "model.embed_tokens.weight" not in ck.passthrough
        assert all("role" not in m for n, m in ck.manifest["layers"].items() if n != "model.embed_tokens")
        got = ck.dequantize("model.embed_tokens")
        assert np.array_equal(got.view(np.uint32), deq["token_embd.weight"].view(np.uint32))
        assert any('kept packed as a layer with role "embedding"' in n for n in ck.manifest["source"]["notes"])
    rep = verify(out, against=src, show_progress=False)
    assert rep.ok and all(c.exact for c in rep.layers), rep.summary()
    convert(out, tmp_path / "back.gguf", to="gguf", show_progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()


def _random_layer(rng: np.random.Generator, n: int, k: int, bits: int, zero_mode: str, scale_dtype: str,
                  act_order: bool = False) -> CanonicalLayer:
    gs = 32
    g = -(-k // gs)
    sd = {"float16": np.float16, "float32": np.float32}[scale_dtype]
    scales = rng.uniform(0.001, 0.1, (n, g)).astype(sd)
    zeros = None
    if zero_mode == "int":
        zeros = rng.integers(0, 1 << bits, (n, g)).astype(np.int32)
    elif zero_mode == "float":
        zeros = rng.normal(0, 0.1, (n, g)).astype(sd)
    g_idx = None
    if act_order:
        g_idx = (np.arange(k) // gs).astype(np.int32)
        rng.shuffle(g_idx)
    return CanonicalLayer(codes=rng.integers(0, 1 << bits, (n, k)).astype(np.uint8), scales=scales, bits=bits,
                          group_size=gs, zero_mode=zero_mode, zeros=zeros, g_idx=g_idx, scale_dtype=scale_dtype,
                          role="embedding").validate()


@pytest.mark.parametrize("bits,zero_mode,scale_dtype,act_order", [
    (4, "float", "float16", False), (4, "int", "float32", False), (4, "none", "float16", True),
    (8, "none", "float16", False), (6, "float", "float32", False), (8, "int", "float16", True),
    (3, "none", "float32", False)])
def test_w4embedding_rows_are_the_canonical_dequantization(bits: int, zero_mode: str, scale_dtype: str,
                                                           act_order: bool) -> None:
    """Every row looked up equals canonical.dequantize bit for bit in float32, and its cast in fp16/bf16; the
    shapes leave padding in both N and K, and act-order permutes the packed columns."""
    torch = pytest.importorskip("torch")
    from w4pack.core.layout import pack
    from w4pack.runtime.torch_module import W4Embedding

    layer = _random_layer(np.random.default_rng(bits * 7 + len(zero_mode)), 37, 96, bits, zero_mode, scale_dtype,
                          act_order)
    packed = pack(layer)
    assert packed.meta["role"] == "embedding"
    mod = W4Embedding(packed.meta, device="meta")
    mod.load_packed(packed)
    want = layer.dequantize(np.float32)
    ids = torch.tensor([[36, 0, 5], [16, 15, 36]])
    got = mod(ids)
    assert got.shape == (2, 3, 96) and got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.uint32), want[ids.numpy()].view(np.uint32))
    every = mod(torch.arange(37)).numpy()
    assert np.array_equal(every.view(np.uint32), want.view(np.uint32))
    for dt in (torch.float16, torch.bfloat16):
        assert torch.equal(mod.rows(ids, dt), torch.from_numpy(want[ids.numpy()]).to(dt))
    with pytest.raises(IndexError, match="out of range"):
        mod(torch.tensor([37]))
    mod.half()  # the rows follow the module's dtype, as an nn.Embedding's weight would
    assert torch.equal(mod(ids), torch.from_numpy(want[ids.numpy()]).half())


def _logits(model: Any, ids: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits


def test_load_model_runs_the_packed_embedding_and_tied_head(tied: tuple[Path, Path, dict[str, np.ndarray]]
                                                            ) -> None:
    """load_model: a W4Embedding and a tied W4TiedHead over the same packed buffers (no float copy of the table),
    logits equal to the float model of the same weights within the kernel tolerance; from_pretrained the same."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from w4pack.runtime.loading import load_model
    from w4pack.runtime.run import dequantized_model
    from w4pack.runtime.torch_module import W4Embedding, W4TiedHead

    _src, out, deq = tied
    model = load_model(out)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, W4Embedding) and isinstance(head, W4TiedHead) and head.embedding is emb
    assert not any(p.shape == (VOCAB, HIDDEN) for p in model.parameters())  # no float table anywhere
    ids = torch.tensor([[1, 39, 7, 16, 0, 33]])
    assert np.array_equal(emb(ids)[0].numpy(), deq["token_embd.weight"][ids[0].numpy()])
    packed = _logits(model, ids)
    ref = _logits(dequantized_model(load_model(out)), ids)
    assert torch.allclose(packed, ref, atol=1e-4, rtol=1e-4), (packed - ref).abs().max()
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert isinstance(hf.get_input_embeddings(), W4Embedding) and isinstance(hf.get_output_embeddings(), W4TiedHead)
    assert torch.equal(_logits(hf, ids), packed)
    # bfloat16: the tied head's CPU kernel is built from the embedding's packed tensors alone (its bf16 dtype
    # marker once went along and could not be read back)
    half = _logits(load_model(out, dtype="bfloat16"), ids)
    assert half.dtype == torch.bfloat16
    assert torch.allclose(half.float(), ref, atol=0.05 * float(ref.abs().max()), rtol=0.05)


@pytest.mark.parametrize("emb_type,head_type,hidden", [(Q.Q8_0, Q.Q8_0, HIDDEN), (Q.Q4_K, Q.Q6_K, 256)])
def test_quantized_head_stays_packed(emb_type: Any, head_type: Any, hidden: int, tmp_path: Path) -> None:
    """An untied quantized head (output.weight Q8_0, or Q6_K beside a Q4_K embedding as in Q4_K_M files) is an
    ordinary packed layer run by W4Linear, beside the packed embedding; both written back in their own types."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from w4pack.runtime.loading import load_model
    from w4pack.runtime.torch_module import W4Embedding, W4Linear, W4TiedHead

    src = tmp_path / "h.gguf"
    deq = make_gguf(src, emb_type=emb_type, output=head_type, hidden=hidden)
    convert(src, tmp_path / "w4", show_progress=False)
    with open_checkpoint(tmp_path / "w4") as ck:
        assert ck.manifest["layers"]["lm_head"].get("role", "linear") == "linear"
        assert ck.manifest["layers"]["model.embed_tokens"]["role"] == "embedding"
        assert np.array_equal(ck.dequantize("lm_head"), deq["output.weight"])
        assert np.array_equal(ck.dequantize("model.embed_tokens"), deq["token_embd.weight"])
    model = load_model(tmp_path / "w4")
    head = model.get_output_embeddings()
    assert isinstance(model.get_input_embeddings(), W4Embedding)
    ids = torch.tensor([0, 17, 39])
    assert np.array_equal(model.get_input_embeddings()(ids).numpy(), deq["token_embd.weight"][ids.numpy()])
    assert isinstance(head, W4Linear) and not isinstance(head, (W4Embedding, W4TiedHead))
    x = torch.randn(3, hidden)
    want = x.double() @ torch.from_numpy(deq["output.weight"]).double().T
    assert torch.allclose(head(x).double(), want, atol=1e-5)
    convert(tmp_path / "w4", tmp_path / "back.gguf", to="gguf", show_progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()


def test_formats_without_packed_embeddings_get_it_dequantized(tmp_path: Path) -> None:
    """GPTQ cannot hold a quantized embedding: convert writes its exact float32 values with a note, the GPTQ folder
    reads back with that tensor, and verify compares the packed embedding with it bit for bit (both ways)."""
    from w4pack.formats import open_source
    from w4pack.verify import verify

    src = tmp_path / "s.gguf"
    deq = make_gguf(src, emb_type=Q.Q4_0, layer_type=Q.Q4_0)
    convert(src, tmp_path / "w4", show_progress=False)
    res = convert(tmp_path / "w4", tmp_path / "gptq", to="gptq", show_progress=False)
    assert any("model.embed_tokens: a packed embedding, which gptq cannot hold: dequantized exactly to float32" in n
               for n in res["notes"])
    with open_source(tmp_path / "gptq") as g:
        assert "model.embed_tokens" not in g.layer_names()
        t = g.read_tensor("model.embed_tokens.weight")
        assert t.dtype == "float32" and np.array_equal(t.array, deq["token_embd.weight"])
    rep = verify(tmp_path / "w4", against=tmp_path / "gptq", show_progress=False)
    assert rep.ok and all(c.exact for c in rep.layers), rep.summary()
    convert(tmp_path / "gptq", tmp_path / "w4-from-gptq", show_progress=False)  # embedding now a float tensor
    rep = verify(tmp_path / "w4-from-gptq", against=tmp_path / "w4", show_progress=False)
    assert rep.ok and rep.passthrough["identical"] == rep.passthrough["total"], rep.summary()


def test_smollm2_folder_is_no_larger_than_its_gguf(tmp_path: Path) -> None:
    """The demo's model: the folder stays within 5% of the GGUF (it was 1.9x with the embedding as float32)."""
    from conftest import smollm2_gguf

    path = smollm2_gguf()
    res = convert(path, tmp_path / "w4", show_progress=False)
    assert res["bytes"] <= 1.05 * path.stat().st_size, (res["bytes"], path.stat().st_size)


def test_packed_embedding_of_the_wrong_size_is_refused(tied: tuple[Path, Path, dict[str, np.ndarray]],
                                                       tmp_path: Path) -> None:
    """The architecture check knows a packed embedding: [vocab_size, hidden_size] of config.json, or one line."""
    import json
    import shutil

    from w4pack.errors import BadInputError

    _src, out, _deq = tied
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] = VOCAB + 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match=r"embedding is \[40, 64\] but the llama model of config.json needs "
                                            r"\[41, 64\]"):
        with open_checkpoint(bad) as ck:
            ck.check_structure()


@pytest.mark.gpu
def test_packed_embedding_and_tied_head_on_cuda(tied: tuple[Path, Path, dict[str, np.ndarray]]) -> None:
    """The same lookup and tied head on CUDA: rows equal to the canonical dequantization cast to fp16, logits
    close to the CPU float32 model's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run the gpu suite on a machine with one)")
    from w4pack.runtime.loading import load_model
    from w4pack.runtime.torch_module import W4Embedding, W4TiedHead

    _src, out, deq = tied
    model = load_model(out, device="cuda", dtype="float16", compile=False)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, W4Embedding) and isinstance(head, W4TiedHead)
    ids = torch.tensor([[1, 39, 7, 16, 0, 33]])
    rows = emb(ids.cuda())[0].float().cpu().numpy()
    want = deq["token_embd.weight"][ids[0].numpy()].astype(np.float16).astype(np.float32)
    assert np.array_equal(rows, want)
    got = _logits(model, ids.cuda()).float().cpu()
    ref = _logits(load_model(out), ids)
    assert torch.allclose(got, ref, atol=3e-2, rtol=3e-2), (got - ref).abs().max()


def test_float_embeddings_on_request_and_the_vllm_plan(tied: tuple[Path, Path, dict[str, np.ndarray]],
                                                                tmp_path: Path) -> None:
    """--float-embeddings keeps the table as exact float32; the vLLM plan finds a packed one (and its tied head)
    and, with the option, the float table among the pass-through tensors."""
    from w4pack.checkpoint import open_checkpoint
    from w4pack.cli import main
    from w4pack.vllm.plan import CheckpointPlan

    src, out, deq = tied
    packed_plan = CheckpointPlan.from_folder(out)
    assert packed_plan.embedding == "model.embed_tokens" and packed_plan.ties_head("lm_head")
    assert packed_plan.embedding_for(VOCAB, HIDDEN) == "model.embed_tokens"
    assert packed_plan.embedding_for(VOCAB + 1, HIDDEN) is None
    for extra in ([], ["--fuse", "qkv,gate-up"]):  # a fused conversion keeps the request (it once lost it)
        flat = tmp_path / f"flat{len(extra)}"
        assert main(["convert", str(src), str(flat), "--float-embeddings", *extra]) == 0
        with open_checkpoint(flat) as ck:
            assert "model.embed_tokens" not in ck.layers
            assert np.array_equal(ck.tensor("model.embed_tokens.weight"), deq["token_embd.weight"])
            assert bool(ck.manifest.get("fused")) == bool(extra)
        plan = CheckpointPlan.from_folder(flat)
        assert "model.embed_tokens.weight" in plan.passthrough
