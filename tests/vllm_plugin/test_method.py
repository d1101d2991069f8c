"""The plugin's linear method driven directly (create → load → process → apply), as vLLM drives it, without vLLM.

The layer classes below carry the names and attributes of vLLM's (the method reads only those), so every tensor
parallel split of every layer kind runs here on CPU, and on CUDA tensors where a GPU is present.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from torch import nn

from test_layout import random_layer
from w4pack.errors import BadInputError, UnsupportedError
from w4pack.layout import PackedLayer, pack, unpack
from w4pack.vllm.method import PackedLinearMethod
from w4pack.vllm.plan import LayerPart, LayerPlan

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class LinearBase(nn.Module):
    def __init__(self, prefix: str, rank: int, size: int, has_bias: bool):
        super().__init__()
        self.prefix, self.tp_rank, self.tp_size, self.has_bias = prefix, rank, size, has_bias
        self.params_dtype = torch.float16


class ColumnParallelLinear(LinearBase):
    pass


class MergedColumnParallelLinear(ColumnParallelLinear):
    pass


class QKVParallelLinear(ColumnParallelLinear):
    pass


class RowParallelLinear(LinearBase):
    pass


def _meta(name: str, packed: PackedLayer) -> dict:
    meta = dict(packed.meta)
    meta["tensors"] = {s: f"{name}.{s}" for s in packed.tensors}
    return meta


def _seed(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _serve(cls, plan: LayerPlan, full: dict, rank: int, size: int, out_sizes: list[int], k: int, device: str,
           replicas: int = 1, has_bias: bool = False) -> nn.Module:
    """One rank's layer: create, load every part's full tensors, process."""
    layer = cls(plan.prefix, rank, size, has_bias=has_bias)
    layer.num_kv_head_replicas = replicas
    layer.output_partition_sizes = out_sizes
    method = PackedLinearMethod(plan, precision="exact", threads=1)
    with torch.device(device):
        method.create_weights(layer, k // size if cls is RowParallelLinear else k, out_sizes, k,
                              sum(out_sizes) * size, torch.float16)
    for part in plan.parts:
        for suffix, arr in full[part.name].tensors.items():
            if suffix == "bias":
                continue
            t = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16) if arr.dtype == np.uint16 else
                                 np.ascontiguousarray(arr))
            if part.meta["scale_dtype"] == "bfloat16" and suffix in ("scales", "mins"):
                t = t.view(torch.bfloat16)
            elif arr.dtype == np.uint16:
                t = t.view(torch.uint16)  # 8-bit layers' zero points, as safetensors hands them over
            param = getattr(layer, suffix)
            param.weight_loader(param, t, part.shard) if part.shard is not None else param.weight_loader(param, t)
    method.process_weights_after_loading(layer)
    assert not [n for n, _ in layer.named_parameters(recurse=False)], "placeholders must be gone"
    layer.method = method
    return layer


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.float16


def _close(got: torch.Tensor, want: np.ndarray, device: str) -> None:
    tol = 1e-4 if device == "cpu" else 2e-2
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["none", "int", "float"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_act_order_k576(device, mode, tp):
    rng = _seed("row", mode, tp)
    layer = random_layer(rng, 96, 576, 4, 128, mode, True, "float16")
    packed = pack(layer)
    bias = rng.standard_normal(96).astype(np.float16)  # a bias the engine's layer lacks: the method adds it
    plan = LayerPlan("mlp.down_proj", [LayerPart("mlp.down_proj", _meta("mlp.down_proj", packed), None, None, bias)])
    x = rng.standard_normal((4, 576)).astype(np.float32)
    want = x.astype(np.float64) @ layer.dequantize(np.float64).T + bias.astype(np.float64)
    total = torch.zeros((4, 96), dtype=torch.float32)
    per = 576 // tp
    for rank in range(tp):
        served = _serve(RowParallelLinear, plan, {"mlp.down_proj": packed}, rank, tp, [96], 576, device)
        xl = torch.from_numpy(x[:, rank * per:(rank + 1) * per]).to(device, _dtype(device))
        total += served.method.apply(served, xl).float().cpu()
    _close(total, want, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 2), (4, 2)])
def test_qkv_parts_and_kv_replicas(device, act_order, tp, kv_heads):
    """q/k/v from three checkpoint layers (own act-order permutations: three GEMMs; else one stacked)."""
    rng = _seed("qkv", act_order, tp)
    head, heads, k = 32, 4, 128
    names = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj"}
    rows = {"q": heads * head, "k": kv_heads * head, "v": kv_heads * head}
    layers = {s: random_layer(rng, rows[s], k, 4, 32, "int", act_order) for s in names}
    packed = {names[s]: pack(layers[s]) for s in names}
    plan = LayerPlan("attn.qkv_proj", [LayerPart(names[s], _meta(names[s], packed[names[s]]), s) for s in names])
    replicas = max(1, tp // kv_heads)
    kv_per = rows["k"] // tp * replicas
    out_sizes = [rows["q"] // tp, kv_per, kv_per]
    x = rng.standard_normal((3, k)).astype(np.float32)
    ref = {s: x.astype(np.float64) @ layers[s].dequantize(np.float64).T for s in names}
    for rank in range(tp):
        served = _serve(QKVParallelLinear, plan, packed, rank, tp, out_sizes, k, device, replicas)
        assert len(served.w4pack) == (3 if act_order else 1)
        got = served.method.apply(served, torch.from_numpy(x).to(device, _dtype(device)))
        kv_rank = rank // replicas
        want = np.concatenate([ref["q"][:, rank * out_sizes[0]:(rank + 1) * out_sizes[0]],
                               ref["k"][:, kv_rank * kv_per:(kv_rank + 1) * kv_per],
                               ref["v"][:, kv_rank * kv_per:(kv_rank + 1) * kv_per]], axis=1)
        _close(got, want, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_checkpoint_gate_up(device, tp):
    """A layer fused at convert time (--fuse gate-up) served as vLLM's merged gate_up_proj."""
    rng = _seed("fused", tp)
    gate = random_layer(rng, 80, 192, 8, 64, "int", True)
    up = random_layer(rng, 80, 192, 8, 64, "int", False).replace(g_idx=gate.g_idx.copy())
    from w4pack.fuse import fuse_layers

    fused, parts = fuse_layers("mlp.gate_up_proj", [gate.replace(name="mlp.gate_proj"), up.replace(name="mlp.up_proj")])
    packed = pack(fused)
    sub = [(p["name"], p["rows"][0], p["rows"][1]) for p in parts]
    plan = LayerPlan("mlp.gate_up_proj", [LayerPart("mlp.gate_up_proj", _meta("mlp.gate_up_proj", packed), None, sub)])
    x = rng.standard_normal((2, 192)).astype(np.float32)
    w = fused.dequantize(np.float64)
    ref = x.astype(np.float64) @ w.T
    per = 80 // tp
    for rank in range(tp):
        served = _serve(MergedColumnParallelLinear, plan, {"mlp.gate_up_proj": packed}, rank, tp, [per, per], 192,
                        device)
        got = served.method.apply(served, torch.from_numpy(x).to(device, _dtype(device)))
        want = np.concatenate([ref[:, rank * per:(rank + 1) * per], ref[:, 80 + rank * per:80 + (rank + 1) * per]],
                              axis=1)
        _close(got, want, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("tp,kv_heads", [(1, 2), (2, 2), (4, 2)])
def test_merged_layer_stored_as_such_qkv(device, act_order, tp, kv_heads):
    """A checkpoint that stores q/k/v as one layer (Phi-3's qkv_proj, no --fuse table): each rank serves its share
    of each of the engine's three parts, k and v replicated where the ranks outnumber the kv heads."""
    rng = _seed("merged-qkv", act_order, tp)
    head, heads, k = 32, 4, 160
    rows = [heads * head, kv_heads * head, kv_heads * head]
    layer = random_layer(rng, sum(rows), k, 4, 32, "int", act_order)
    packed = pack(layer)
    name = "attn.qkv_proj"
    plan = LayerPlan(name, [LayerPart(name, _meta(name, packed))])
    replicas = max(1, tp // kv_heads)
    kv_per = rows[1] // tp * replicas
    out_sizes = [rows[0] // tp, kv_per, kv_per]
    x = rng.standard_normal((3, k)).astype(np.float32)
    ref = x.astype(np.float64) @ layer.dequantize(np.float64).T
    q, kk, v = np.split(ref, np.cumsum(rows)[:2], axis=1)
    for rank in range(tp):
        served = _serve(QKVParallelLinear, plan, {name: packed}, rank, tp, out_sizes, k, device, replicas)
        got = served.method.apply(served, torch.from_numpy(x).to(device, _dtype(device)))
        r = rank // replicas
        want = np.concatenate([q[:, rank * out_sizes[0]:(rank + 1) * out_sizes[0]],
                               kk[:, r * kv_per:(r + 1) * kv_per], v[:, r * kv_per:(r + 1) * kv_per]], axis=1)
        _close(got, want, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [1, 2])
def test_merged_layer_stored_as_such_gate_up(device, tp):
    """Phi-3's gate_up_proj as the checkpoint stores it: [gate | up], each split across the ranks."""
    rng = _seed("merged-gate-up", tp)
    layer = random_layer(rng, 2 * 96, 128, 4, 64, "float", False)
    packed = pack(layer)
    name = "mlp.gate_up_proj"
    plan = LayerPlan(name, [LayerPart(name, _meta(name, packed))])
    x = rng.standard_normal((2, 128)).astype(np.float32)
    ref = x.astype(np.float64) @ layer.dequantize(np.float64).T
    per = 96 // tp
    for rank in range(tp):
        served = _serve(MergedColumnParallelLinear, plan, {name: packed}, rank, tp, [per, per], 128, device)
        got = served.method.apply(served, torch.from_numpy(x).to(device, _dtype(device)))
        want = np.concatenate([ref[:, rank * per:(rank + 1) * per], ref[:, 96 + rank * per:96 + (rank + 1) * per]],
                              axis=1)
        _close(got, want, device)


def test_merged_layer_of_another_size_still_refused():
    rng = _seed("merged-wrong")
    packed = pack(random_layer(rng, 160, 64, 4, 32, "none", False))
    name = "mlp.gate_up_proj"
    plan = LayerPlan(name, [LayerPart(name, _meta(name, packed))])
    with pytest.raises(BadInputError, match=r"output rows \[160\] do not match the model's \[96, 96\]"):
        _serve(MergedColumnParallelLinear, plan, {name: packed}, 0, 1, [96, 96], 64, "cpu")


def test_engine_bias_added_after_gemm():
    rng = _seed("bias")
    layer = random_layer(rng, 48, 128, 4, 64, "none", False)
    packed = pack(layer)
    plan = LayerPlan("o", [LayerPart("o", _meta("o", packed))])
    served = _serve(ColumnParallelLinear, plan, {"o": packed}, 0, 1, [48], 128, "cpu")
    x = rng.standard_normal((2, 128)).astype(np.float32)
    b = torch.from_numpy(rng.standard_normal(48).astype(np.float32))
    got = served.method.apply(served, torch.from_numpy(x), b)
    _close(got, x.astype(np.float64) @ layer.dequantize(np.float64).T + b.numpy(), "cpu")


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_checkpoint_bias_not_added_twice_when_the_engine_owns_it(cls):
    """A layer vLLM builds with a bias gets the checkpoint's bias through vLLM's own loader and apply(bias=...)."""
    rng = _seed("own-bias", cls.__name__)
    layer = random_layer(rng, 32, 128, 4, 64, "none", False)
    packed = pack(layer)
    bias = rng.standard_normal(32).astype(np.float16)
    plan = LayerPlan("o", [LayerPart("o", _meta("o", packed), None, None, bias)])
    served = _serve(cls, plan, {"o": packed}, 0, 1, [32], 128, "cpu", has_bias=True)
    x = rng.standard_normal((2, 128)).astype(np.float32)
    got = served.method.apply(served, torch.from_numpy(x), torch.from_numpy(bias.astype(np.float32)))
    _close(got, x.astype(np.float64) @ layer.dequantize(np.float64).T + bias.astype(np.float64), "cpu")


def _one_layer_method(n: int, k: int) -> tuple[nn.Module, PackedLinearMethod]:
    """An engine layer and the method for one plain packed layer 'o' of [n, k] (nothing created yet)."""
    packed = pack(random_layer(_seed("one", n, k), n, k, 4, 64, "none", False))
    plan = LayerPlan("o", [LayerPart("o", _meta("o", packed))])
    return ColumnParallelLinear("o", 0, 1, False), PackedLinearMethod(plan, precision="exact")


def test_shape_mismatch_refused_before_loading():
    layer, method = _one_layer_method(48, 128)
    with pytest.raises(BadInputError, match=r"output rows \[48\] do not match the model's \[64\]"):
        method.create_weights(layer, 128, [64], 128, 64, torch.float16)
    with pytest.raises(BadInputError, match="takes 128 inputs, the model's o takes 256"):
        method.create_weights(layer, 256, [48], 256, 48, torch.float16)


def test_wrong_stored_dtype_refused():
    layer, method = _one_layer_method(16, 64)
    method.create_weights(layer, 64, [16], 64, 16, torch.float16)

    with pytest.raises(BadInputError, match=r"tensor o.scales: stored as torch.float32"):
        layer.scales.weight_loader(layer.scales, torch.zeros(1, 16, dtype=torch.float32))


def test_unpacked_placeholders_match_manifest():
    rng = _seed("names")
    packed = pack(random_layer(rng, 16, 64, 4, 32, "float", True))
    plan = LayerPlan("o", [LayerPart("o", _meta("o", packed))])
    assert plan.suffixes() == ["qweight", "scales", "mins", "perm"]
    assert unpack(packed, "o").act_order


def _served_examples(device: str) -> list[nn.Module]:
    """A row-parallel act-order shard with padding inputs and an unstackable q/k/v (three GEMMs)."""
    rng = _seed("examples")
    down = pack(random_layer(rng, 96, 576, 4, 128, "int", True))
    plan = LayerPlan("down", [LayerPart("down", _meta("down", down))])
    row = _serve(RowParallelLinear, plan, {"down": down}, 1, 2, [96], 576, device)
    assert row.w4pack_input_pad > 0
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
    packed = {names[s]: pack(random_layer(rng, 64, 256, 4, 64, "float", True)) for s in names}
    plan = LayerPlan("qkv", [LayerPart(names[s], _meta(names[s], packed[names[s]]), s) for s in names])
    qkv = _serve(QKVParallelLinear, plan, packed, 0, 1, [64, 64, 64], 256, device)
    return [row, qkv]


def test_apply_traces_as_one_custom_op_on_cpu():
    for layer in _served_examples("cpu"):
        k = layer.w4pack[0].in_features - layer.w4pack_input_pad
        x = torch.randn(3, k)
        eager = layer.method.apply(layer, x)
        compiled = torch.compile(lambda t, layer=layer: layer.method.apply(layer, t), backend="aot_eager",
                                 fullgraph=True)
        assert torch.equal(compiled(x), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_apply_compiled_and_graphed_bit_identical_on_cuda(dtype):
    """What vLLM does on a GPU: torch.compile (inductor, and reduce-overhead's CUDA graphs) and a captured CUDA
    graph replaying apply(); every result bit-identical to eager, and no float32 round trip."""
    torch._dynamo.reset()
    for layer in _served_examples("cuda"):
        k = layer.w4pack[0].in_features - layer.w4pack_input_pad
        for m in (1, 7, 64):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            eager = layer.method.apply(layer, x)
            assert eager.dtype == dtype
            fn = lambda t, layer=layer: layer.method.apply(layer, t)  # noqa: E731
            assert torch.equal(torch.compile(fn, fullgraph=True)(x), eager)
            ro = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):
                assert torch.equal(ro(x).clone(), eager)
            static_x = x.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn(static_x)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_y = fn(static_x)
            for _ in range(2):
                static_y.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(static_y, eager)


@pytest.mark.parametrize("qtype", ["Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("cls,tp", [(RowParallelLinear, 2), (ColumnParallelLinear, 2)])
def test_compact_storage_is_expanded_before_the_split(cls, tp, qtype):
    """A layer stored compactly (docs/LAYOUT.md §8: a Q6_K layer's dense codes and int8 sub-scales, an IQ4_XS
    layer's 4-bit codebook indices and 6-bit sub-scales) reaches the engine as its compact tensors; the method
    expands them, then splits, and computes the layer's product."""
    from w4pack.core.compact import compact
    from w4pack.formats import gguf_quants as gq

    rng = _seed("compact", cls.__name__, tp, qtype)
    n, k = 64, 512
    if qtype == "Q6_K":
        raw = np.zeros((n, k // 256, 210), np.uint8)
        raw[..., :192] = rng.integers(0, 256, (n, k // 256, 192), dtype=np.uint8)
        sc = rng.integers(-127, 128, (n, k // 256, 16))
        sc[..., 0] = -128
        raw[..., 192:208] = sc.astype(np.int8).view(np.uint8)
        raw[..., 208:210] = (rng.uniform(1e-4, 1e-3, (n, k // 256)).astype("<f2"))[..., None].view(np.uint8)
    else:  # random indices and 6-bit sub-scales, a weight-like fp16 d
        raw = rng.integers(0, 256, (n, k // 256, 136), dtype=np.uint8)
        raw[..., 0:2] = (rng.uniform(1e-4, 1e-3, (n, k // 256)).astype("<f2"))[..., None].view(np.uint8)
    layer = gq.decode(qtype, raw.reshape(n, -1), n, k).validate()
    packed = pack(layer)
    st, arrays = compact(packed.meta, packed.tensors, gq.STORAGE[qtype])
    assert st and ("qdense" if qtype == "Q6_K" else "qindex") in arrays and "scales_q" in arrays
    meta = dict(packed.meta, storage=st)
    stored = PackedLayer(meta=meta, tensors=arrays)
    plan = LayerPlan("mlp.x", [LayerPart("mlp.x", _meta("mlp.x", stored), None, None, None)])
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = x.astype(np.float64) @ layer.dequantize(np.float64).T
    if cls is RowParallelLinear:
        total = torch.zeros((3, n), dtype=torch.float32)
        for rank in range(tp):
            served = _serve(cls, plan, {"mlp.x": stored}, rank, tp, [n], k, "cpu")
            total += served.method.apply(served, torch.from_numpy(x[:, rank * k // tp:(rank + 1) * k // tp])).float()
        _close(total, want, "cpu")
    else:
        for rank in range(tp):
            served = _serve(cls, plan, {"mlp.x": stored}, rank, tp, [n // tp], k, "cpu")
            got = served.method.apply(served, torch.from_numpy(x)).float()
            _close(got, want[:, rank * n // tp:(rank + 1) * n // tp], "cpu")


# -- token embeddings and output heads (vLLM's VocabParallelEmbedding / ParallelLMHead) ----------------------
class VocabParallelEmbedding(nn.Module):
    """vLLM's vocabulary split: the vocabulary padded to a multiple of 64, the padded rows dealt out evenly, each
    rank owning the real rows that fall in its share (possibly fewer than its partition)."""

    def __init__(self, vocab: int, dim: int, rank: int, size: int):
        super().__init__()
        padded = -(-vocab // 64) * 64
        assert padded % size == 0
        per = padded // size
        self.shard_indices = type("ShardIndices", (), {"org_vocab_start_index": min(rank * per, vocab),
                                                       "org_vocab_end_index": min((rank + 1) * per, vocab)})()
        self.org_vocab_size, self.embedding_dim, self.num_embeddings_per_partition = vocab, dim, per
        self.num_added_embeddings, self.tp_rank, self.tp_size = 0, rank, size
        self.params_dtype = torch.float32


class ParallelLMHead(VocabParallelEmbedding):
    pass


def _serve_vocab(cls, name: str, packed: PackedLayer, role: str | None, rank: int, size: int,
                 head: nn.Module | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> nn.Module:
    meta = dict(_meta(name, packed), role=role) if role else _meta(name, packed)
    vocab, dim = (int(v) for v in packed.meta["shape"])
    layer = cls(vocab, dim, rank, size)
    layer.params_dtype = dtype
    method = PackedLinearMethod(LayerPlan(name, [LayerPart(name, meta)]), precision="exact", threads=1)
    with torch.device(device):
        method.create_weights(layer, dim, [layer.num_embeddings_per_partition], dim,
                              layer.num_embeddings_per_partition * size, dtype)
    if head is not None:  # vLLM ties the head while it builds the model, before any weight is loaded
        head.method.tie_weights(head, layer)
    for suffix, arr in packed.tensors.items():
        t = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16) if arr.dtype == np.uint16 else
                             np.ascontiguousarray(arr))
        param = getattr(layer, suffix)
        param.weight_loader(param, t.view(torch.uint16) if arr.dtype == np.uint16 else t)
    method.process_weights_after_loading(layer)
    layer.method = method
    return layer


@pytest.mark.parametrize("bits,mode", [(4, "int"), (4, "float"), (8, "none"), (6, "float")])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_packed_embedding_and_head_split_by_vocabulary(bits, mode, tp):
    """200 tokens: vLLM pads the vocabulary to 256, so the last rank's share is partly padding (at tp 4 it holds 8
    real rows of 64). Every rank looks up exactly the canonical float32 rows of the tokens it owns, its logits
    are the full head's for those tokens and zero on the padding, and the ranks' logits, gathered and trimmed as
    vLLM does, are the full head's."""
    rng = _seed("vocab", bits, mode, tp)
    vocab, dim = 200, 96
    packed = pack(random_layer(rng, vocab, dim, bits, 32, mode, False, "float16"))
    w32 = unpack(packed).dequantize(np.float32)
    w64 = unpack(packed).dequantize(np.float64)
    x = rng.standard_normal((5, dim)).astype(np.float32)
    gathered = []
    for rank in range(tp):
        emb = _serve_vocab(VocabParallelEmbedding, "model.embed_tokens", packed, "embedding", rank, tp)
        head = _serve_vocab(ParallelLMHead, "lm_head", packed, None, rank, tp)
        lo, hi = emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index
        ids = torch.arange(lo, hi)[torch.from_numpy(rng.permutation(hi - lo))]
        rows = emb.method.embedding(emb, ids - lo)  # vLLM hands each rank its own, masked, ids
        assert rows.dtype == torch.float32
        assert np.array_equal(rows.numpy(), w32[ids.numpy()])
        logits = head.method.apply(head, torch.from_numpy(x))
        assert logits.shape == (5, head.num_embeddings_per_partition)
        _close(logits[:, :hi - lo], x.astype(np.float64) @ w64[lo:hi].T, "cpu")
        assert not logits[:, hi - lo:].any()
        gathered.append(logits)
    _close(torch.cat(gathered, dim=-1)[:, :vocab], x.astype(np.float64) @ w64.T, "cpu")


@pytest.mark.parametrize("tp", [1, 2])
def test_head_tied_to_the_packed_embedding(tp):
    from w4pack.vllm.method import TiedHeadMethod

    rng = _seed("tied", tp)
    packed = pack(random_layer(rng, 128, 64, 8, 32, "none", False, "float16"))
    w64 = unpack(packed).dequantize(np.float64)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for rank in range(tp):
        head = ParallelLMHead(128, 64, rank, tp)
        head.method = TiedHeadMethod("lm_head")
        head.method.create_weights(head, 64, [head.num_embeddings_per_partition], 64, 128, torch.float32)
        emb = _serve_vocab(VocabParallelEmbedding, "model.embed_tokens", packed, "embedding", rank, tp, head=head)
        assert emb.w4pack[0].serves_head
        head.method.process_weights_after_loading(head)
        lo, hi = head.shard_indices.org_vocab_start_index, head.shard_indices.org_vocab_end_index
        _close(head.method.apply(head, torch.from_numpy(x)), x.astype(np.float64) @ w64[lo:hi].T, "cpu")


def test_untied_head_missing_from_the_checkpoint_is_refused():
    from w4pack.vllm.method import TiedHeadMethod

    head = ParallelLMHead(128, 64, 0, 1)
    method = TiedHeadMethod("lm_head")
    method.create_weights(head, 64, [128], 64, 128, torch.float32)
    with pytest.raises(BadInputError, match="tensor lm_head: the checkpoint has no output head of its own"):
        method.process_weights_after_loading(head)


def test_added_vocabulary_refused():
    packed = pack(random_layer(_seed("added"), 64, 32, 4, 32, "int", False))
    layer = VocabParallelEmbedding(64, 32, 0, 1)
    layer.num_added_embeddings = 8
    method = PackedLinearMethod(LayerPlan("e", [LayerPart("e", dict(_meta("e", packed), role="embedding"))]))
    method.create_weights(layer, 32, [64], 32, 64, torch.float32)
    for suffix, arr in packed.tensors.items():
        getattr(layer, suffix).weight_loader(getattr(layer, suffix), torch.from_numpy(np.ascontiguousarray(arr)))
    with pytest.raises(UnsupportedError, match="added"):
        method.process_weights_after_loading(layer)



def test_config_tying_a_head_the_checkpoint_stores_packed_keeps_that_head():
    """tie_word_embeddings with a packed head in the checkpoint: vLLM asks the head's method to tie it to the
    (packed, weight-less) embedding while it builds the model; the checkpoint's own head is kept and served, as
    w4pack run keeps it."""
    rng = _seed("own head")
    table = pack(random_layer(rng, 128, 64, 4, 32, "int", False, "float16"))
    own = pack(random_layer(rng, 128, 64, 4, 32, "float", False, "float16"))
    head = ParallelLMHead(128, 64, 0, 1)
    method = PackedLinearMethod(LayerPlan("lm_head", [LayerPart("lm_head", _meta("lm_head", own))]),
                                precision="exact", threads=1)
    method.create_weights(head, 64, [128], 64, 128, torch.float32)
    emb = _serve_vocab(VocabParallelEmbedding, "model.embed_tokens", table, "embedding", 0, 1)
    assert method.tie_weights(head, emb) is head and "weight" not in head._parameters
    for suffix, arr in own.tensors.items():
        getattr(head, suffix).weight_loader(getattr(head, suffix), torch.from_numpy(np.ascontiguousarray(arr)))
    method.process_weights_after_loading(head)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    _close(method.apply(head, torch.from_numpy(x)), x.astype(np.float64) @ unpack(own).dequantize(np.float64).T,
           "cpu")


def test_unasked_packed_embedding_refused_with_the_real_reason():
    """The packed table never asked for by the time its own decoder stack is built: a model that builds it
    without the quantization config (the --float-embeddings way out), or one that built an unnamed table of
    another shape (the shapes). A vision tower's layers, built before the language model, are not its stack."""
    from w4pack.vllm.plan import CheckpointPlan

    name = "language_model.model.embed_tokens"
    plan = CheckpointPlan(path="ckpt", layers={name: {"role": "embedding", "shape": [200, 64], "tensors": {}}},
                          fused={}, passthrough=set())
    assert plan.unasked_embedding_error("vision_tower.encoder.layers.0.self_attn.qkv_proj", []) is None
    assert plan.unasked_embedding_error("language_model.lm_head", []) is None
    err = plan.unasked_embedding_error("language_model.model.layers.0.self_attn.qkv_proj", [])
    assert isinstance(err, UnsupportedError) and "--float-embeddings" in str(err) and name in str(err)
    err = plan.unasked_embedding_error("language_model.model.layers.0.self_attn.qkv_proj", [(256, 64)])
    assert isinstance(err, BadInputError)
    assert f"tensor {name}: the checkpoint's token embedding is [200, 64], the model's is [256, 64]" in str(err)
    plain = CheckpointPlan(path="ckpt", layers={"model.embed_tokens": {"role": "embedding", "shape": [200, 64],
                                                                       "tensors": {}}}, fused={}, passthrough=set())
    assert isinstance(plain.unasked_embedding_error("model.layers.0.mlp.gate_up_proj", []), UnsupportedError)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_embedding_and_head_on_cuda(dtype):
    """The vocabulary split on CUDA, in the model's half dtype: rows are the canonical float32 rows cast once,
    logits the float64 head's within the kernels' tolerance, padding logits zero."""
    rng = _seed("vocab-cuda", str(dtype))
    vocab, dim = 200, 128
    packed = pack(random_layer(rng, vocab, dim, 4, 64, "float", False, "float16"))
    w32 = unpack(packed).dequantize(np.float32)
    w64 = unpack(packed).dequantize(np.float64)
    x = rng.standard_normal((5, dim)).astype(np.float32)
    for rank in range(2):
        emb = _serve_vocab(VocabParallelEmbedding, "model.embed_tokens", packed, "embedding", rank, 2, device="cuda",
                           dtype=dtype)
        head = _serve_vocab(ParallelLMHead, "lm_head", packed, None, rank, 2, device="cuda", dtype=dtype)
        lo, hi = emb.shard_indices.org_vocab_start_index, emb.shard_indices.org_vocab_end_index
        ids = torch.arange(lo, hi, device="cuda")
        rows = emb.method.embedding(emb, ids - lo)
        assert rows.dtype == dtype and torch.equal(rows.cpu(), torch.from_numpy(w32[lo:hi]).to(dtype))
        logits = head.method.apply(head, torch.from_numpy(x).to("cuda", dtype))
        assert logits.shape == (5, head.num_embeddings_per_partition) and logits.dtype == dtype
        _close(logits[:, :hi - lo], x.astype(np.float64) @ w64[lo:hi].T, "cuda")
        assert not logits[:, hi - lo:].any()
