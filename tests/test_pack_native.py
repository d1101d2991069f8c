"""The native conversion helpers (native/cpu_pack.c) against their numpy specs, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from w4pack import layout
from w4pack.canonical import CanonicalLayer
from w4pack.formats import _bitpack
from w4pack.native import cpu_pack

lib = cpu_pack.lib
pytestmark = pytest.mark.skipif(lib is None, reason="native CPU module not built: make native (or python setup.py build_ext --inplace)")


def _spec_pack(codes: np.ndarray, perm: np.ndarray | None, sbits: int) -> np.ndarray:
    n, k = codes.shape
    np_, kp = layout.padded_shape(n, k)
    padded = np.zeros((np_, kp), dtype=np.uint8)
    padded[:n, :k] = codes if perm is None else codes[:, perm]
    return layout._interleave(padded, sbits)


@pytest.mark.parametrize("sbits", [4, 8])
@pytest.mark.parametrize("n,k", [(1, 1), (17, 65), (33, 200), (48, 128), (5, 1000)])
@pytest.mark.parametrize("act_order", [False, True])
def test_native_pack_matches_numpy(sbits: int, n: int, k: int, act_order: bool) -> None:
    rng = np.random.default_rng(n * 1000 + k + sbits + act_order)
    codes = rng.integers(0, 1 << sbits, size=(n, k), dtype=np.uint8)
    perm = rng.permutation(k).astype(np.int32) if act_order else None
    for threads in (1, 3):
        from w4pack.native import cpu
        saved = list(cpu._DEFAULT_THREADS)
        cpu._DEFAULT_THREADS[:] = [threads]
        try:
            got = cpu_pack.pack_codes(codes, perm, sbits)
        finally:
            cpu._DEFAULT_THREADS[:] = saved
        assert got is not None
        np.testing.assert_array_equal(got, _spec_pack(codes, perm, sbits))


def test_native_pack_strided_rows() -> None:
    """A row-strided view (e.g. codes[:, :k] of a wider array) packs like its contiguous copy."""
    rng = np.random.default_rng(7)
    wide = rng.integers(0, 16, size=(20, 300), dtype=np.uint8)
    view = wide[:, :130]
    np.testing.assert_array_equal(cpu_pack.pack_codes(view, None, 4), _spec_pack(np.ascontiguousarray(view), None, 4))


def test_pack_roundtrip_act_order_uses_native() -> None:
    rng = np.random.default_rng(3)
    n, k, gs = 40, 384, 128
    g_idx = rng.permutation(np.arange(k) // gs).astype(np.int32)
    layer = CanonicalLayer(codes=rng.integers(0, 16, size=(n, k), dtype=np.uint8),
                           scales=rng.random((n, k // gs)).astype(np.float16), bits=4, group_size=gs,
                           g_idx=g_idx)
    packed = layout.pack(layer)
    assert layout.unpack(packed).equals(layer)


def test_native_pack_rejects_bad_perm() -> None:
    codes = np.zeros((4, 8), dtype=np.uint8)
    with pytest.raises(Exception, match="perm"):
        cpu_pack.pack_codes(codes, np.array([0, 1, 2, 3, 4, 5, 6, 99], dtype=np.int32), 4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 17), (16, 40), (5, 33)])
def test_native_gptq_unpack_matches_numpy(bits: int, rows: int, n: int) -> None:
    from w4pack.formats.gptq import _unpack_qweight

    rng = np.random.default_rng(rows * 100 + n + bits)
    words = rng.integers(-(1 << 31), 1 << 31, size=(rows, n), dtype=np.int64).astype(np.int32)
    want = _bitpack.unpack_last(np.ascontiguousarray(words.T), bits)
    np.testing.assert_array_equal(_unpack_qweight(words, bits), want)


def test_pack_refuses_codes_out_of_range() -> None:
    """The native packer's own range check replaces validate()'s scan: a 3-bit layer holding 9 is bad input."""
    from w4pack.errors import BadInputError

    codes = np.zeros((16, 64), dtype=np.uint8)
    codes[5, 7] = 9
    layer = CanonicalLayer(codes=codes, scales=np.ones((16, 1), dtype=np.float16), bits=3, group_size=-1,
                           name="m.q_proj")
    with pytest.raises(BadInputError, match=r"codes exceed 7.*max 9"):
        layout.pack(layer)


def _same_packed(a: layout.PackedLayer, b: layout.PackedLayer) -> None:
    assert a.meta == b.meta
    assert a.source == b.source
    assert sorted(a.tensors) == sorted(b.tensors)
    for key in a.tensors:
        x, y = a.tensors[key], b.tensors[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=key)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("mode", ["none", "int"])
def test_gptq_read_packed_equals_pack_of_read_layer(tmp_path, act_order: bool, mode: str) -> None:
    """The fused GPTQ qweight -> layout v1 pass gives exactly pack(read_layer(...)), odd shapes included."""
    from test_layout import random_layer
    from w4pack.formats import open_source
    from w4pack.formats.gptq import GPTQSource, write_gptq

    rng = np.random.default_rng(11 + act_order + 2 * (mode == "int"))
    layers = {f"model.layers.0.mlp.p{i}": random_layer(rng, n, k, 4, 128, mode, act_order)
              for i, (n, k) in enumerate([(40, 384), (24, 136), (64, 200)])}
    if mode == "int":  # GPTQ v1 stores zero points 1..15 only
        for lay in layers.values():
            lay.zeros = np.clip(lay.zeros, 1, 15).astype(np.int32)

    class Src:
        config: dict = {}
        info = {"format": "test"}

        def layer_names(self):
            return list(layers)

        def read_layer(self, name):
            return layers[name].replace(name=name)

        def passthrough_names(self):
            return []

        def side_files(self):
            return []

    write_gptq(Src(), tmp_path / "g")
    src = open_source(tmp_path / "g")
    assert isinstance(src, GPTQSource)
    try:
        for name in src.layer_names():
            fused = src.read_packed(name)
            assert fused is not None
            _same_packed(fused, layout.pack(src.read_layer(name)))
    finally:
        src.close()


def test_gptq_read_packed_on_peer_fixtures() -> None:
    """Every 4-bit peer GPTQ fixture: the fused path equals pack(read_layer) (the latter is checked against
    truth by tests/formats/test_gptq.py)."""
    from conftest import FIXTURES_HINT, fixture_cases, fixture_dir
    from w4pack.formats import open_source

    cases = fixture_cases("gptq")
    if not cases:
        pytest.skip(FIXTURES_HINT)
    seen = 0
    for case in cases:
        try:
            src = open_source(fixture_dir("gptq", case))
        except Exception:  # cases that are meant to be refused are tested elsewhere
            continue
        try:
            for name in src.layer_names():
                fused = src.read_packed(name) if hasattr(src, "read_packed") else None
                if fused is None:
                    continue
                _same_packed(fused, layout.pack(src.read_layer(name)))
                seen += 1
        finally:
            src.close()
    assert seen > 0


def test_pack_of_odd_views_falls_back_to_numpy() -> None:
    """Views the native packer cannot walk (reversed rows, strided columns) still pack exactly."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 16, size=(20, 140), dtype=np.uint8)
    for view in (base[::-1], base[:, ::2]):
        assert cpu_pack.pack_codes(view, None, 4) is None
        layer = CanonicalLayer(codes=view, scales=np.ones((view.shape[0], 1), dtype=np.float16), bits=4,
                               group_size=-1)
        np.testing.assert_array_equal(layout.pack(layer).tensors["qweight"],
                                      _spec_pack(np.ascontiguousarray(view), None, 4))


def test_portable_pack_code_matches_sse2(tmp_path) -> None:
    """native/cpu_pack.c built with -DW4P_PACK_SCALAR (what ARM and other hosts run) gives the same bytes
    as the SSE2 build (which the tests above compare with numpy)."""
    import os
    import platform
    import shutil
    import subprocess
    from pathlib import Path

    if platform.machine() not in ("x86_64", "AMD64", "i686"):
        pytest.skip("the SSE2 side of the comparison needs an x86 host")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler: install gcc or clang, or set CC")
    repo = Path(__file__).resolve().parent.parent
    outs = []
    for flags in ([], ["-DW4P_PACK_SCALAR"]):
        exe = tmp_path / f"pack_check{len(outs)}"
        subprocess.run([cc, "-O2", "-std=gnu11", *flags, f"-I{repo / 'native'}", str(repo / "tests/native/pack_check.c"),
                        str(repo / "native/cpu_pack.c"), str(repo / "native/cpu_threads.c"), "-lpthread", "-o",
                        str(exe)], check=True, capture_output=True)
        out = tmp_path / f"out{len(outs)}.bin"
        subprocess.run([str(exe), str(out)], check=True, timeout=60)
        outs.append(out.read_bytes())
    assert len(outs[0]) > 1_000_000 and outs[0] == outs[1]
