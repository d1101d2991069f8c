"""The compact storage of K-quant and 5-bit layers (docs/LAYOUT.md §8): bit-exact expansion, no larger than the
GGUF, and hostile compact tensors refused naming the tensor."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from w4pack.checkpoint import open_checkpoint
from w4pack.cli import cli
from w4pack.convert import convert
from w4pack.core import compact as C
from w4pack.core.layout import PackedLayer, pack, unpack
from w4pack.errors import BadInputError
from w4pack.formats import gguf_quants as gq

gguf = pytest.importorskip("gguf", reason="pip install gguf (the [gguf] extra) to read and write GGUF")

from test_gguf import make_kquant_gguf  # noqa: E402  (tests/formats, on the path as pytest collects it)
from test_gguf_quants import random_blocks  # noqa: E402


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_dense_bits_are_lsb_first_and_invert(bits: int) -> None:
    rng = np.random.default_rng(bits)
    v = rng.integers(0, 1 << bits, (3, 64), dtype=np.uint8)
    p = C.pack_bits(v, bits)
    assert p.shape == (3, 8 * bits)
    stream = np.unpackbits(p, axis=-1, bitorder="little").reshape(3, 64, bits)
    assert np.array_equal((stream * (1 << np.arange(bits))).sum(-1), v)  # value i at bits i·b … i·b+b−1
    assert np.array_equal(C.unpack_bits(p, bits), v)


@pytest.mark.parametrize("qtype", sorted(gq.STORAGE))
def test_every_type_expands_to_todays_tensors_and_gguf_values(qtype: str) -> None:
    """Random blocks (subnormal, negative and zero d included): compact -> expand gives the runtime tensors of
    today's decode bit for bit, and their dequantization is gguf-py's; with N a multiple of 16 the compact bytes
    are the GGUF's (K-quants) or the GGUF's without nothing lost (Q5_0/Q5_1)."""
    rng = np.random.default_rng(len(qtype) * 7 + ord(qtype[1]))
    bt = gq.TYPES[qtype]
    for n in (37, 32):
        k = bt.block * (3 if bt.block == gq.QK_K else 16)
        raw = random_blocks(rng, qtype, n, k)
        packed = pack(gq.decode(qtype, raw, n, k).validate())
        st, arrays = C.compact(packed.meta, packed.tensors, gq.STORAGE[qtype])
        assert st is not None and set(st) == set(gq.STORAGE[qtype]), st
        meta = dict(packed.meta, storage=st)
        back = C.expand(meta, arrays, "L")
        assert set(back) == set(packed.tensors)
        for s, arr in packed.tensors.items():
            assert _same_bytes(back[s], arr), (qtype, n, s)
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k)
        got = unpack(PackedLayer(meta=dict(packed.meta), tensors=back)).dequantize(np.float64).astype(np.float32)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), qtype
        if n % 16 == 0 and qtype != "IQ4_XS":  # IQ4_XS keeps 8-bit codebook values: not smaller than that
            assert sum(a.nbytes for a in arrays.values()) == raw.nbytes, qtype


def test_parameters_that_are_not_products_stay_in_the_runtime_form() -> None:
    """A layer whose scales no fp16 times a 6-bit integer gives keeps float32 scales (and still expands)."""
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, "Q4_K", 16, 256)
    layer = gq.decode("Q4_K", raw, 16, 256).validate()
    layer.scales[0, 0] = np.float32(1 / 3)
    packed = pack(layer)
    st, arrays = C.compact(packed.meta, packed.tensors, gq.STORAGE["Q4_K"])
    assert st == {"mins": gq.STORAGE["Q4_K"]["mins"]} and "scales" in arrays and "mins_d" in arrays
    back = C.expand(dict(packed.meta, storage=st), arrays)
    assert all(_same_bytes(back[s], packed.tensors[s]) for s in packed.tensors)


def test_codes_past_their_range_are_not_stored_densely() -> None:
    """A packed layer whose 8-bit fields hold a value past its 5-bit codes (made by hand, not by layout.pack) keeps
    its qweight: packed densely, the high bits would be lost and expand would give another layer."""
    rng = np.random.default_rng(5)
    packed = pack(gq.decode("Q5_0", random_blocks(rng, "Q5_0", 16, 64), 16, 64).validate())
    qw = packed.tensors["qweight"].copy()
    qw.view(np.uint8)[0, 0] = 200
    tensors = dict(packed.tensors, qweight=qw)
    st, arrays = C.compact(packed.meta, tensors, gq.STORAGE["Q5_0"])
    assert st is None and "qdense" not in arrays and _same_bytes(arrays["qweight"], qw)


def _expand_error(meta: dict, arrays: dict) -> str:
    with pytest.raises(BadInputError) as exc:
        C.expand(meta, arrays, "m.layer")
    return exc.value.one_line()


def test_hostile_compact_arrays_are_refused_naming_the_tensor() -> None:
    rng = np.random.default_rng(4)
    packed = pack(gq.decode("Q6_K", random_blocks(rng, "Q6_K", 20, 256), 20, 256).validate())  # rows 20..31 pad
    st, arrays = C.compact(packed.meta, packed.tensors, gq.STORAGE["Q6_K"])
    meta = dict(packed.meta, storage=st)
    bad = dict(arrays, scales_d=arrays["scales_d"].copy())
    bad["scales_d"][0, 3] = np.float16(np.nan)
    assert "m.layer.scales_d" in _expand_error(meta, bad) and "NaN" in _expand_error(meta, bad)
    bad = dict(arrays, scales_q=arrays["scales_q"].copy())
    bad["scales_q"][0, 25] = 1  # row 25 is padding
    assert "m.layer.scales_q" in _expand_error(meta, bad) and "padding" in _expand_error(meta, bad)
    bad = dict(arrays, qdense=arrays["qdense"][:, :-1])
    assert "m.layer.qdense" in _expand_error(meta, bad) and "expected uint8" in _expand_error(meta, bad)
    assert "dense_codes on a 4-bit" in C.check_storage(dict(meta, bits=4, storage_bits=4))
    # a super-block straddling the last real group and the padding: its factor cannot be both
    assert meta["num_groups"] == meta["padded_groups"] == 16 and st["scales"]["super_groups"] == 16
    assert "does not divide the layer's 15 groups" in C.check_storage(dict(meta, num_groups=15))


@pytest.fixture(scope="module")
def kq(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("kq")
    make_kquant_gguf(d / "k.gguf")
    convert(d / "k.gguf", d / "w4", show_progress=False)
    return d / "k.gguf", d / "w4"


def _gguf_quant_bytes(path: Path) -> int:
    r = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in r.tensors if t.tensor_type.name in gq.TYPES)


def test_small_kquant_gguf_is_stored_compact_verifies_and_round_trips(kq: tuple[Path, Path], tmp_path: Path) -> None:
    """Every K-quant layer compact; the layers take exactly the GGUF's bytes; validate --deep and verify --against
    pass bit-identical; back to GGUF byte for byte; --expanded and a re-conversion keep the same layers."""
    from w4pack.verify import verify

    src, w4 = kq
    ck = open_checkpoint(w4)
    assert all(m.get("storage") for m in ck.manifest["layers"].values())
    assert ck.summary()["quantized_bytes"] == _gguf_quant_bytes(src)
    size = sum(p.stat().st_size for p in w4.iterdir() if p.is_file())
    small_files = sum(p.stat().st_size for p in w4.iterdir() if p.suffix == ".json")  # manifest, config, index
    assert size - small_files <= 1.03 * src.stat().st_size, (size, small_files, src.stat().st_size)
    res = CliRunner().invoke(cli, ["inspect", str(w4)])
    assert res.exit_code == 0 and "8 layers stored compact on disk" in res.output, res.output
    res = CliRunner().invoke(cli, ["validate", str(w4), "--deep"])
    assert res.exit_code == 0 and "unpack" in res.output, res.output
    rep = verify(w4, against=src, show_progress=False)
    assert rep.ok and all(c.exact for c in rep.layers), rep.summary()
    convert(w4, tmp_path / "back.gguf", to="gguf", show_progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()
    convert(w4, tmp_path / "again", show_progress=False)  # w4pack -> w4pack keeps the compact form
    assert open_checkpoint(tmp_path / "again").manifest["layers"] == ck.manifest["layers"]
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "wide"), "--expanded"])
    assert res.exit_code == 0, res.output
    wide = open_checkpoint(tmp_path / "wide")
    assert not any(m.get("storage") for m in wide.manifest["layers"].values())
    assert wide.summary()["quantized_bytes"] > 1.3 * ck.summary()["quantized_bytes"]
    for name in ck.layers:
        a, b = ck.packed(name), wide.packed(name)
        assert a.meta["tensors"].keys() == b.meta["tensors"].keys()
        assert all(_same_bytes(a.tensors[s], b.tensors[s]) for s in b.tensors), name


def _patch_tensor(folder: Path, tname: str, fn) -> None:
    """Rewrite one tensor's bytes in its shard (in place: the checksums then differ, so --no-checksums)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][tname]
    raw = bytearray(shard.read_bytes())
    hlen = struct.unpack("<Q", raw[:8])[0]
    entry = json.loads(raw[8:8 + hlen])[tname]
    lo, hi = (8 + hlen + o for o in entry["data_offsets"])
    raw[lo:hi] = fn(bytes(raw[lo:hi]))
    shard.write_bytes(bytes(raw))


def _validate(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from w4pack.cli import main

    rc = main(["validate", *args])
    return rc, capsys.readouterr().err.strip()


def test_hostile_compact_tensor_in_a_folder_exits_2_naming_it(kq: tuple[Path, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    _src, w4 = kq
    bad = tmp_path / "bad"
    shutil.copytree(w4, bad)
    tname = "model.layers.0.mlp.down_proj.scales_d"
    _patch_tensor(bad, tname, lambda b: np.full(len(b) // 2, np.inf, np.float16).tobytes())
    rc, err = _validate([str(bad), "--deep", "--no-checksums"], capsys)
    assert rc == 2 and tname in err and "NaN or infinite" in err and str(bad) in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    # a manifest whose storage contradicts the stored tensors: the sub-scale width no longer fits the bytes
    shutil.rmtree(bad)
    shutil.copytree(w4, bad)
    man = json.loads((bad / "w4pack.json").read_text())
    man["layers"]["model.layers.0.mlp.gate_proj"]["storage"]["scales"]["bits"] = 4
    (bad / "w4pack.json").write_text(json.dumps(man))
    rc, err = _validate([str(bad), "--no-checksums"], capsys)
    assert rc == 2 and "model.layers.0.mlp.gate_proj.scales_q" in err and len(err.splitlines()) == 1, err
    man["layers"]["model.layers.0.mlp.gate_proj"]["storage"]["dense_codes"] = True  # on a 4-bit layer
    (bad / "w4pack.json").write_text(json.dumps(man))
    rc, err = _validate([str(bad), "--no-checksums"], capsys)
    assert rc == 2 and "model.layers.0.mlp.gate_proj" in err and len(err.splitlines()) == 1, err


def test_a_reader_without_the_storage_field_refuses_cleanly(kq: tuple[Path, Path]) -> None:
    """What a w4pack from before the compact storage does with such a folder: its schema (no ``storage``, layers
    with ``qweight`` and ``scales``) rejects the manifest, so it refuses instead of misreading."""
    import jsonschema

    _src, w4 = kq
    # the manifest schema as it was released before the compact storage (commit 144eeb1), kept as data
    old = json.loads((Path(__file__).resolve().parent.parent / "data" / "manifest.schema.before-compact.json")
                     .read_text())
    man = json.loads((w4 / "w4pack.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(man, old)
