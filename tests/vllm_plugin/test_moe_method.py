"""The plugin's fused-MoE method driven directly (create → load → process → apply), as vLLM drives it, without vLLM.

``RoutedExperts`` below carries the attributes of vLLM's layer that the method reads; every rank of a tensor
parallel split runs here, and the ranks' outputs (which the engine all-reduces) must sum to the full block's.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from test_layout import random_layer
from w4pack.errors import BadInputError, UnsupportedError
from w4pack.layout import PackedLayer, pack, unpack
from w4pack.vllm.moe import MoEPlan, PackedMoEMethod, plan_for_layer
from w4pack.vllm.plan import CheckpointPlan, LayerPart

DATA = Path(__file__).resolve().parents[1] / "data" / "llama_quantize"


class RoutedExperts(nn.Module):
    def __init__(self, experts: int, rank: int, size: int, activation: str = "silu"):
        super().__init__()
        par = SimpleNamespace(tp_rank=rank, tp_size=size, use_ep=False)
        self.moe_config = SimpleNamespace(moe_parallel_config=par, activation=SimpleNamespace(value=activation),
                                          swiglu_limit=None, has_bias=False)
        self.global_num_experts = experts
        self.params_dtype = torch.float32


def _seed(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _experts(rng: np.random.Generator, n_exp: int, hidden: int, inter: int) -> list[dict[str, PackedLayer]]:
    """Per expert: gate and up [inter, hidden], down [hidden, inter]; options vary by expert (act-order down,
    8-bit, float minima), as GGUF mixes like Q4_K_M give different types to gate/up and down."""
    out = []
    for e in range(n_exp):
        bits, mode = [(4, "int"), (4, "float"), (8, "none"), (6, "float")][e % 4]
        out.append({"w1": pack(random_layer(rng, inter, hidden, bits, 32, mode, False, "float16")),
                    "w3": pack(random_layer(rng, inter, hidden, bits, 32, mode, False, "float16")),
                    "w2": pack(random_layer(rng, hidden, inter, 4, 32, "int", e % 2 == 0, "float16"))})
    return out


def _plan(experts: list[dict[str, PackedLayer]]) -> MoEPlan:
    parts = []
    for e, ex in enumerate(experts):
        row = {}
        for s, packed in ex.items():
            name = f"mlp.experts.{e}.{s}"
            row[s] = LayerPart(name, dict(packed.meta, tensors={k: f"{name}.{k}" for k in packed.tensors}), s)
        parts.append(row)
    return MoEPlan("mlp.experts", parts)


def _serve(experts: list[dict[str, PackedLayer]], rank: int, size: int) -> tuple[nn.Module, PackedMoEMethod]:
    hidden, inter = (int(v) for v in experts[0]["w2"].meta["shape"])
    layer = RoutedExperts(len(experts), rank, size)
    method = PackedMoEMethod(_plan(experts), precision="exact", threads=1)
    method.create_weights(layer, len(experts), hidden, inter // size, torch.float32)
    for e, ex in enumerate(experts):  # vLLM's expert mapping: w13_<suffix> for gate/up, w2_<suffix> for down
        for s, packed in ex.items():
            stem = "w2" if s == "w2" else "w13"
            for suffix, arr in packed.tensors.items():
                param = getattr(layer, f"{stem}_{suffix}")
                ok = param.weight_loader(param=param, loaded_weight=torch.from_numpy(np.ascontiguousarray(arr)),
                                         weight_name=f"mlp.experts.{stem}_{suffix}", shard_id=s, expert_id=e,
                                         return_success=True)
                assert ok is True
    method.process_weights_after_loading(layer)
    assert not list(layer.parameters(recurse=False)), "placeholders must be gone"
    return layer, method


def _reference(experts: list[dict[str, PackedLayer]], x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    w64 = [{s: unpack(p).dequantize(np.float64) for s, p in ex.items()} for ex in experts]
    x64 = x.astype(np.float64)
    out = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            ex = w64[ids[t, slot]]
            g, u = ex["w1"] @ x64[t], ex["w3"] @ x64[t]
            out[t] += w[t, slot] * (ex["w2"] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("inter", [128, 96])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_routed_tokens_sum_to_the_float_block(tp, inter):
    """8 experts, top 2, 7 tokens: each rank runs its share of every expert (down act-order on half of them, so
    row-parallel shards get padding inputs), and the ranks' sums add up to the float64 MoE block. Intermediate
    96 at TP 4 gives each rank 24 rows: gate/up cut inside a 16-row stripe, down inside a 32-channel group."""
    rng = _seed("moe", tp) if inter == 128 else _seed("moe", tp, inter)
    experts = _experts(rng, 8, 96, inter)
    x = rng.standard_normal((7, 96)).astype(np.float32)
    ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(7)]).astype(np.int64)
    w = rng.random((7, 2)).astype(np.float32)
    total = torch.zeros(7, 96)
    for rank in range(tp):
        layer, method = _serve(experts, rank, tp)
        total += method.apply(layer, torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(ids))
    want = _reference(experts, x, ids, w)
    np.testing.assert_allclose(total.numpy(), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_experts_nobody_chose_are_not_run():
    rng = _seed("unused")
    experts = _experts(rng, 4, 64, 64)
    layer, method = _serve(experts, 0, 1)
    calls = []
    for e, mod in enumerate(layer.w4pack_w2):
        orig = mod.linear
        mod.linear = lambda t, e=e, orig=orig: (calls.append(e), orig(t))[1]
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    ids = torch.tensor([[1, 3], [3, 1], [1, 3]])
    method.apply(layer, x, torch.full((3, 2), 0.5), ids)
    assert sorted(set(calls)) == [1, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sums_in_float32_and_rounds_once(dtype):
    """Top 4 of 6 experts in bf16/fp16: each expert's output (in the model dtype, as the kernel gives it) times its
    weight is summed in float32 and rounded once, not rounded at each of the four additions."""
    rng = _seed("half", str(dtype))
    experts = _experts(rng, 6, 64, 64)
    layer, method = _serve(experts, 0, 1)
    x = torch.from_numpy(rng.standard_normal((9, 64)).astype(np.float32)).to(dtype)
    ids = torch.from_numpy(np.stack([rng.choice(6, 4, replace=False) for _ in range(9)]))
    w = torch.from_numpy(rng.random((9, 4)).astype(np.float32))
    want = torch.zeros(9, 64)
    for e in range(6):  # expert by expert, each on the tokens that chose it, as the method runs them
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if len(rows):
            want[rows] += method._expert(layer, e, x[rows]).float() * w[rows, slot].unsqueeze(-1)
    got = method.apply(layer, x, w, ids)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_apply_traced_by_torch_compile_fullgraph():
    """vLLM-CPU compiles the model with ``fullgraph=True`` and, unlike on CUDA, traces into the MoE block down to
    this method: the routed loop (data-dependent shapes) must be one opaque node, with the eager result, for
    any routing and for an empty batch (the graph is traced once, with dynamic token counts)."""
    rng = _seed("compile")
    experts = _experts(rng, 4, 64, 64)
    layer, method = _serve(experts, 0, 1)
    compiled = torch.compile(lambda x, w, i: method.apply(layer, x, w, i) * 2.0, fullgraph=True, backend="eager",
                             dynamic=True)
    for tokens in (5, 3, 0):
        x = torch.from_numpy(rng.standard_normal((tokens, 64)).astype(np.float32))
        ids = torch.from_numpy(np.array([rng.choice(4, 2, replace=False) for _ in range(tokens)],
                                        dtype=np.int32).reshape(tokens, 2))
        w = torch.from_numpy(rng.random((tokens, 2)).astype(np.float32))
        torch.testing.assert_close(compiled(x, w, ids), method.apply(layer, x, w, ids) * 2.0, rtol=0, atol=0)


def test_wrong_shape_dtype_and_options_refused():
    rng = _seed("refuse")
    experts = _experts(rng, 2, 64, 64)
    layer = RoutedExperts(2, 0, 1)
    method = PackedMoEMethod(_plan(experts), precision="exact")
    with pytest.raises(BadInputError, match=r"mlp.experts.0.w1: the checkpoint's expert layer is \[64, 64\], "
                                            r"the model's expert 0 needs \[96, 64\]"):
        method.create_weights(layer, 2, 64, 96, torch.float32)
    with pytest.raises(UnsupportedError, match="activation 'relu2_no_mul'"):
        method.create_weights(RoutedExperts(2, 0, 1, "relu2_no_mul"), 2, 64, 64, torch.float32)
    method.create_weights(layer, 2, 64, 64, torch.float32)
    with pytest.raises(BadInputError, match=r"mlp.experts.1.w2.scales: stored as torch.float32"):
        layer.w2_scales.weight_loader(layer.w2_scales, torch.zeros(2, 64), "", "w2", 1)
    with pytest.raises(BadInputError, match="loaded expert 5"):
        layer.w2_scales.weight_loader(layer.w2_scales, torch.zeros(2, 64, dtype=torch.float16), "", "w2", 5)


def test_moe_plan_from_a_converted_mixtral(tmp_path):
    """llama.cpp's tiny Mixtral converted: every expert's w1/w3/w2 found under the engine's block prefix, in the
    order the engine's shard ids name them; a half-packed block is refused."""
    from w4pack.convert import convert

    convert(DATA / "tiny-moe-Q4_K_M.gguf", tmp_path / "w4", show_progress=False)
    plan = CheckpointPlan.from_folder(tmp_path / "w4")
    prefix = "model.layers.1.block_sparse_moe.experts"
    moe = plan.moe_plan(prefix, ("w1", "w3", "w2"), 4)
    assert [p["w3"].name for p in moe.experts] == [f"{prefix}.{e}.w3" for e in range(4)]
    assert moe.suffixes("w13") and moe.suffixes("w2")
    assert plan.moe_plan("model.layers.1.other", ("w1", "w3", "w2"), 4) is None
    del plan.layers[f"{prefix}.2.w2"]
    with pytest.raises(UnsupportedError, match=rf"tensor {prefix}.2.w2: 11 of the 12 expert projections"):
        plan.moe_plan(prefix, ("w1", "w3", "w2"), 4)


def _engine_layer(global_experts: int, logical: int, *, use_ep: bool = False, eplb: bool = False,
                  up: str | None = "w3") -> SimpleNamespace:
    """The attributes of vLLM's RoutedExperts that plan_for_layer reads."""
    par = SimpleNamespace(tp_rank=0, tp_size=1, use_ep=use_ep, enable_eplb=eplb)
    return SimpleNamespace(moe_config=SimpleNamespace(moe_parallel_config=par, num_logical_experts=logical),
                           global_num_experts=global_experts, ckpt_gate_proj_name="w1", ckpt_up_proj_name=up,
                           ckpt_down_proj_name="w2")


def test_plan_refusals_name_the_real_reason(tmp_path):
    """Refused with the reason, not a misleading count of missing projections: expert parallelism and EPLB
    (whose redundant copies the engine counts as experts), a block without up projections, and a non-zero expert
    bias, which vLLM's expert loader would skip without a word (every output silently wrong)."""
    from w4pack.convert import convert

    convert(DATA / "tiny-moe-Q4_K_M.gguf", tmp_path / "w4", show_progress=False)
    plan = CheckpointPlan.from_folder(tmp_path / "w4")
    prefix = "model.layers.0.block_sparse_moe.experts"
    assert len(plan_for_layer(plan, _engine_layer(4, 4), prefix).experts) == 4
    for layer in (_engine_layer(6, 4, use_ep=True, eplb=True), _engine_layer(4, 4, use_ep=True)):
        with pytest.raises(UnsupportedError, match=rf"tensor {prefix}: expert parallelism or EPLB"):
            plan_for_layer(plan, layer, prefix)
    assert plan_for_layer(plan, _engine_layer(6, 4, eplb=True), "model.layers.0.float_block.experts") is None
    with pytest.raises(UnsupportedError, match=rf"tensor {prefix}.0.w1: experts without an up projection"):
        plan_for_layer(plan, _engine_layer(4, 4, up=None), prefix)
    plan.biases[f"{prefix}.3.w2"] = np.array([0.0, 0.5], dtype=np.float32)
    with pytest.raises(UnsupportedError, match=rf"tensor {prefix}.3.w2: the expert projection has a non-zero bias"):
        plan_for_layer(plan, _engine_layer(4, 4), prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_captured_cuda_graph_runs_every_expert_weighted(tp):
    """Under CUDA graph capture (vLLM's decode graphs) no host sync is allowed: every expert runs on every token
    with its routing weight, zero where not chosen. The replay must give the eager (routed) result."""
    rng = _seed("graph", tp)
    experts = _experts(rng, 4, 64, 128)
    # activations / 16: these random experts give outputs up to ~3e4 at unit activations, past which silu(g)*u
    # overflows float16 (inf, then NaN through down) on any path; / 16 keeps every intermediate well inside
    x32 = (rng.standard_normal((5, 64)) / 16).astype(np.float32)
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(5)]).astype(np.int64)
    w = rng.random((5, 2)).astype(np.float32)
    total_eager = torch.zeros(5, 64, device="cuda")
    total_graph = torch.zeros(5, 64, device="cuda")
    for rank in range(tp):
        with torch.device("cuda"):
            layer, method = _serve(experts, rank, tp)
        x = torch.from_numpy(x32).to("cuda", torch.float16)
        args = (x, torch.from_numpy(w).cuda(), torch.from_numpy(ids).cuda())
        eager = method.apply(layer, *args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = method.apply(layer, *args)
        graph.replay()
        torch.cuda.synchronize()
        total_eager += eager.float()
        total_graph += captured.float()
    want = _reference(experts, x32.astype(np.float16).astype(np.float32), ids, w)
    scale = float(np.abs(want).max())
    for got in (total_eager, total_graph):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(total_graph, total_eager, rtol=2e-3, atol=2e-3 * scale)
