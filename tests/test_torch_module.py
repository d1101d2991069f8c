"""W4Linear: the native GEMM behind a torch module and custom op, against the float64 dequantized reference."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rtn_helper import rtn_quantize  # noqa: E402

from w4pack.layout import pack  # noqa: E402
from w4pack.torch_module import W4FusedLinear, W4Linear, W4SliceLinear  # noqa: E402

RNG = np.random.default_rng(7)


def _layer(n: int, k: int, **kw):
    w = RNG.standard_normal((n, k)).astype(np.float32) * 0.05
    bias = RNG.standard_normal(n).astype(np.float32) * 0.1 if kw.pop("with_bias", False) else None
    return rtn_quantize(w, bias=bias, **kw)


def _reference(layer, x: np.ndarray) -> np.ndarray:
    """float64 x @ W.T + b with W the canonical dequantized weights."""
    y = x.astype(np.float64) @ layer.dequantize(np.float64).T
    if layer.bias is not None:
        from w4pack.dtypes import to_float64

        y = y + to_float64(layer.bias, layer.bias_dtype)
    return y


CASES = [
    dict(n=48, k=128, group_size=32, sym=True),
    dict(n=40, k=96, group_size=32, sym=False),                      # N, K not multiples of the tile
    dict(n=64, k=128, group_size=64, sym=False, float_min=True),      # GGUF Q4_1-like float minimum
    dict(n=32, k=128, group_size=32, sym=True, act_order=True),       # act-order permutation
    dict(n=32, k=64, group_size=-1, sym=True, scale_dtype="bfloat16", with_bias=True),
    dict(n=32, k=128, group_size=32, sym=False, scale_dtype="float32", with_bias=True),
    dict(n=24, k=64, group_size=16, sym=True, bits=8),
    dict(n=16, k=64, group_size=32, sym=False, bits=3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_forward_matches_float64_reference(case: dict) -> None:
    c = dict(case)
    n, k = c.pop("n"), c.pop("k")
    layer = _layer(n, k, **c)
    mod = W4Linear.from_canonical(layer)
    x = RNG.standard_normal((3, 5, k)).astype(np.float32)
    y = mod(torch.from_numpy(x))
    assert y.shape == (3, 5, n) and y.dtype == torch.float32
    ref = _reference(layer, x.reshape(-1, k)).reshape(3, 5, n)
    err = np.abs(y.numpy() - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


def test_fast_path_is_close() -> None:
    layer = _layer(64, 256, group_size=64, sym=False)
    mod = W4Linear.from_canonical(layer, precision="fast")
    x = RNG.standard_normal((4, 256)).astype(np.float32)
    y = mod(torch.from_numpy(x)).numpy()
    ref = _reference(layer, x)
    rel_rms = np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2))
    assert rel_rms < 2e-2, rel_rms


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_inputs_give_half_outputs(dtype: str) -> None:
    layer = _layer(32, 128, group_size=32, sym=True)
    mod = W4Linear.from_canonical(layer)
    tdt = getattr(torch, dtype)
    x = torch.from_numpy(RNG.standard_normal((2, 128)).astype(np.float32)).to(tdt)
    y = mod(x)
    assert y.dtype == tdt
    ref = _reference(layer, x.float().numpy())
    assert np.abs(y.float().numpy() - ref).max() / np.abs(ref).max() < 1e-2


def test_dequantize_and_repr() -> None:
    layer = _layer(40, 96, group_size=32, sym=False, act_order=True)
    mod = W4Linear.from_canonical(layer)
    np.testing.assert_array_equal(mod.dequantize().numpy(), layer.dequantize(np.float32))
    r = repr(mod)
    assert "bits=4" in r and "group_size=32" in r and "zero_mode=int" in r and "act_order=True" in r


def test_dtype_casts_never_touch_scales_and_state_dict_round_trips() -> None:
    layer = _layer(32, 64, group_size=32, sym=False, with_bias=True)
    mod = W4Linear.from_canonical(layer)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    mod.to(torch.bfloat16)
    for key, val in mod.state_dict().items():
        assert torch.equal(val, before[key]), key
    empty = W4Linear(pack(layer).meta, has_bias=True)
    empty.load_state_dict(before)
    x = torch.randn(2, 64)
    assert torch.equal(empty(x), W4Linear.from_canonical(layer)(x))
    assert empty.packed_layer().tensors["scales"].dtype == np.float16


def test_wrong_input_width_is_refused() -> None:
    mod = W4Linear.from_canonical(_layer(16, 64, group_size=32))
    with pytest.raises(ValueError, match="expects 64"):
        mod(torch.randn(2, 32))


def test_custom_op_fake_and_compile() -> None:
    layer = _layer(32, 128, group_size=32, sym=True, with_bias=True)
    mod = W4Linear.from_canonical(layer)
    x = torch.randn(3, 128)
    torch.library.opcheck(torch.ops.w4pack.linear.default, (x, mod.qweight, mod.handle, 32, "exact"),
                          test_utils=("test_schema", "test_faketensor"))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = mod

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(t)) * 2

    net = Net()
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), net(x))
    seen: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    traced = torch.compile(net, backend=recording_backend, fullgraph=True)
    assert torch.equal(traced(x), net(x))
    assert any("w4pack.linear" in t for t in seen), seen  # one opaque node, not a trace into the kernel


def _fused_parts():
    q = _layer(64, 64, group_size=32, sym=True, name="a.q_proj")
    k = _layer(32, 64, group_size=32, sym=True, name="a.k_proj")
    v = _layer(32, 64, group_size=32, sym=True, name="a.v_proj")
    return q, k, v


def _fused_views() -> tuple:
    """(the q/k/v parts, their fused module, its three views)."""
    from w4pack.fuse import fuse_layers

    parts = _fused_parts()
    fused_layer, rows = fuse_layers("a.qkv_proj", list(parts))
    packed = pack(fused_layer)
    fused = W4FusedLinear(packed.meta, rows, has_bias=False, device="meta")
    fused.load_packed(packed)
    return parts, fused, [W4SliceLinear(fused, i) for i in range(3)]


def test_fused_slices_run_one_gemm_per_input() -> None:
    parts, fused, views = _fused_views()
    calls = []
    real_run = fused._run
    fused._run = lambda x, p: (calls.append(1), real_run(x, p))[1]  # type: ignore[method-assign]
    x = torch.randn(2, 3, 64)
    outs = [v(x) for v in views]
    assert len(calls) == 1
    for out, part in zip(outs, parts):
        ref = _reference(part, x.reshape(-1, 64).numpy()).reshape(2, 3, -1)
        assert np.abs(out.numpy() - ref).max() / np.abs(ref).max() < 1e-5
    # a new input (or the same tensor changed in place) runs the GEMM again
    x.mul_(2)
    views[0](x)
    assert len(calls) == 2
    outs2 = [v(x) for v in views[1:]]
    assert len(calls) == 2
    assert torch.allclose(outs2[0], outs[1] * 2, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_matches_cpu_and_captures_in_a_graph() -> None:
    layer = _layer(128, 256, group_size=128, sym=False)
    cpu = W4Linear.from_canonical(layer)
    gpu = W4Linear.from_canonical(layer).to("cuda")
    x = torch.randn(4, 256)
    y_cpu = cpu(x)
    xg = x.to("cuda", torch.float16)
    y_gpu = gpu(xg)
    assert y_gpu.dtype == torch.float16
    assert torch.allclose(y_gpu.float().cpu(), y_cpu, rtol=2e-2, atol=2e-2)
    static_x = xg.clone()
    gpu(static_x)  # warm up (prepares the kernel outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = gpu(static_x)
    x2 = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, gpu(x2))


def test_deepcopy_gets_its_own_handle_and_weights() -> None:
    import copy

    layer = _layer(32, 64, group_size=32, sym=True)
    mod = W4Linear.from_canonical(layer)
    x = torch.randn(2, 64)
    y = mod(x)
    twin = copy.deepcopy(mod)
    assert twin.handle != mod.handle
    twin.qweight.zero_()  # all codes 0: a different layer
    assert torch.equal(mod(x), y)
    assert not torch.equal(twin(x), y)


def test_errors_name_the_layer() -> None:
    """A model runs dozens of W4Linear: a wrong input width or dtype, or a wrong precision, names the layer that
    refused (the loader gives each its checkpoint name), and stays a ValueError (torch's convention)."""
    layer = _layer(16, 64, group_size=32)
    name = "model.layers.3.mlp.up_proj"
    mod = W4Linear.from_canonical(layer, name=name)
    assert mod.layer_name == name
    cases = [(torch.randn(2, 32), "input has 32 features, the layer expects 64"),
             (torch.randn(2, 64, dtype=torch.float64), "activations must be float16, bfloat16 or float32, got "
                                                        "torch.float64")]
    for x, says in cases:
        with pytest.raises(ValueError) as exc:
            mod(x)
        assert str(exc.value).startswith(f"layer {name}: {says}"), exc.value
    mod.precision = "sloppy"  # set after building: the kernel refuses it, and the layer is named
    with pytest.raises(ValueError, match=f"^layer {name}: precision must be 'exact' or 'fast'"):
        mod(torch.randn(2, 64))
    with pytest.raises(ValueError, match=f"^layer {name}: precision must be one of"):
        W4Linear.from_canonical(layer, name=name, precision="turbo")
    # a copy keeps the name; a layer packed in memory without one says what it always said
    import copy

    with pytest.raises(ValueError, match=f"^layer {name}: input has 32"):
        copy.deepcopy(mod)(torch.randn(2, 32))
    anonymous = W4Linear.from_canonical(layer)
    assert anonymous.layer_name is None
    with pytest.raises(ValueError, match="^input has 32 features, the layer expects 64$"):
        anonymous(torch.randn(2, 32))


def test_the_name_comes_from_the_manifest_entry() -> None:
    """A module built from a checkpoint's packed layer (whose manifest entry lists its tensors) knows its name
    without being told; one built from the entry alone (the loaders' skeletons) too."""
    packed = pack(_layer(16, 64, group_size=32))
    name = "model.layers.0.self_attn.o_proj"
    packed.meta["tensors"] = {s: f"{name}.{s}" for s in packed.tensors}
    assert W4Linear.from_packed(packed).layer_name == name
    assert W4Linear(packed.meta, device="meta").layer_name == name
    assert W4Linear.from_packed(packed, name="given").layer_name == "given"
    bad = dict(packed.tensors, scales=packed.tensors["scales"][:1])
    from w4pack.errors import UnsupportedError
    from w4pack.layout import PackedLayer

    with pytest.raises(UnsupportedError, match=f"tensor {name}.scales: packed tensor"):
        W4Linear.from_packed(PackedLayer(meta=packed.meta, tensors=bad))


def test_embedding_errors_name_the_layer() -> None:
    from w4pack.torch_module import W4Embedding

    packed = pack(_layer(32, 64, group_size=32))
    emb = W4Embedding(packed.meta, device="meta", name="model.embed_tokens")
    emb.load_packed(packed)
    with pytest.raises(IndexError, match="^layer model.embed_tokens: token id 32 is out of range"):
        emb(torch.tensor([1, 32]))
    with pytest.raises(TypeError, match="^layer model.embed_tokens: embedding indices must be integers"):
        emb(torch.tensor([1.0]))


def test_new_weights_written_in_place_are_used() -> None:
    """load_state_dict copies into the same storage: the kernel built for the old weights kept serving them."""
    a = W4Linear.from_canonical(_layer(48, 128, group_size=32, sym=False))
    b = W4Linear.from_canonical(_layer(48, 128, group_size=32, sym=False))
    x = torch.randn(3, 128)
    with torch.no_grad():
        a(x)  # (the kernel for a's weights is built)
        a.load_state_dict(b.state_dict())
        assert torch.equal(a(x), b(x))


def test_gradient_with_respect_to_the_input() -> None:
    """The eager layer returned a tensor without a grad_fn, so backward() ran and gave wrong gradients elsewhere."""
    layer = _layer(40, 96, group_size=32, sym=False, with_bias=True)
    mod = W4Linear.from_canonical(layer)
    x = torch.randn(2, 3, 96, dtype=torch.float64).float().requires_grad_(True)
    g = torch.randn(2, 3, 40)
    (mod(x) * g).sum().backward()
    want = g.double().reshape(-1, 40).numpy() @ layer.dequantize(np.float64)
    assert x.grad is not None and np.abs(x.grad.reshape(-1, 96).numpy() - want).max() < 1e-4
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    x2 = x.detach().clone().requires_grad_(True)
    (compiled(x2) * g).sum().backward()
    assert torch.allclose(x2.grad, x.grad, atol=1e-5)
    with torch.no_grad():  # (no gradient asked for: the plain path, and no grad_fn)
        assert mod(x).grad_fn is None


def test_an_empty_batch_gives_an_empty_result() -> None:
    mod = W4Linear.from_canonical(_layer(48, 128, group_size=32, sym=True))
    for shape in ((0, 128), (2, 0, 128)):
        y = mod(torch.randn(*shape))
        assert y.shape == (*shape[:-1], 48)


def test_fused_views_see_an_inference_tensor_changed_in_place() -> None:
    """Inference tensors keep no version counter: k_proj(x) after x.mul_(2) returned rows of the old x."""
    _parts, fused, views = _fused_views()
    with torch.inference_mode():
        x = torch.randn(2, 64)
        views[0](x)
        x.mul_(2)
        k = views[1](x)
        fresh = W4SliceLinear(fused, 1)
        fused._cache = None
        assert torch.equal(k, fresh(x))
