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
from w4pack.verify import verify

gguf = pytest.importorskip("gguf", reason="pip install gguf (the [gguf] extra) to read and write GGUF")

from test_gguf import make_kquant_gguf, one_block_llama_writer  # noqa: E402  (tests/formats, on the path as pytest collects it)
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
        if n % 16 == 0:
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
    src, w4 = kq
    ck = open_checkpoint(w4)
    assert all(m.get("storage") for m in ck.manifest["layers"].values())
    assert ck.summary()["quantized_bytes"] == _gguf_quant_bytes(src)
    size = sum(p.stat().st_size for p in w4.iterdir() if p.is_file())
    small_files = sum(p.stat().st_size for p in w4.iterdir() if p.suffix == ".json")  # manifest, config, index
    assert size - small_files <= 1.03 * src.stat().st_size, (size, small_files, src.stat().st_size)
    res = CliRunner().invoke(cli, ["inspect", str(w4)])
    assert res.exit_code == 0 and "8 layers stored compact on disk" in res.output, res.output
    _deep_checks_and_round_trips(src, w4, ck, tmp_path, grows=1.3)


def _deep_checks_and_round_trips(src: Path, w4: Path, ck, tmp_path: Path, *, grows: float,
                                 layers: int | None = None, runtime: set[str] | None = None) -> None:
    """A compact folder converted from GGUF ``src``: validate --deep and verify --against pass (``layers`` of them
    when given), it converts back to the same GGUF byte for byte and to w4pack with the same manifest, and
    ``--expanded`` writes the runtime form (``grows`` times the quantized bytes at least; its tensors ``runtime``
    when given) with tensors identical to what the compact form expands to."""
    res = CliRunner().invoke(cli, ["validate", str(w4), "--deep"])
    assert res.exit_code == 0 and "unpack" in res.output, res.output
    rep = verify(w4, against=src, show_progress=False)
    assert rep.ok and all(c.exact for c in rep.layers) and (layers is None or len(rep.layers) == layers), \
        rep.summary()
    convert(w4, tmp_path / "back.gguf", to="gguf", show_progress=False)
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()
    convert(w4, tmp_path / "again", show_progress=False)  # w4pack -> w4pack keeps the compact form
    assert open_checkpoint(tmp_path / "again").manifest["layers"] == ck.manifest["layers"]
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "wide"), "--expanded"])
    assert res.exit_code == 0, res.output
    wide = open_checkpoint(tmp_path / "wide")
    assert not any(m.get("storage") for m in wide.manifest["layers"].values())
    assert wide.summary()["quantized_bytes"] > grows * ck.summary()["quantized_bytes"]
    for name in ck.layers:
        a, b = ck.packed(name), wide.packed(name)
        assert a.meta["tensors"].keys() == b.meta["tensors"].keys()
        assert runtime is None or b.meta["tensors"].keys() == runtime
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


# ---------------------------------------------------------------------------------------------
# IQ4_NL / IQ4_XS: 4-bit codebook indices (storage.codebook) instead of 8-bit codebook values
# ---------------------------------------------------------------------------------------------
def iq4_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """IQ4 rows in the form llama.cpp's quantizer writes (gguf-py has no IQ4 quantizer): random indices and
    sub-scales, IQ4_XS's largest sub-scale at −32 (stored 0) in each block, fp16 d = a weight-like scale."""
    bt = gq.TYPES[qtype]
    nb = k // bt.block
    d = (rng.uniform(0.5, 2.0, (n, nb)) * 1e-3 * rng.choice([-1.0, 1.0], (n, nb))).astype(np.float16)
    b = rng.integers(0, 256, (n, nb, bt.nbytes), dtype=np.uint8)
    b[..., 0:2] = d.astype("<f2")[..., None].view(np.uint8)
    if qtype == "IQ4_XS":  # scale j: low nibble of byte 4 + j // 2, high 2 bits at 2·j of the u16 at byte 2
        u = rng.integers(0, 64, (n, nb, 8))
        u[np.arange(n)[:, None], np.arange(nb)[None, :], rng.integers(0, 8, (n, nb))] = 0
        sh = sum(((u[..., j] >> 4) & 3) << (2 * j) for j in range(8)).astype("<u2")
        b[..., 2:4] = sh[..., None].view(np.uint8)
        b[..., 4:8] = ((u[..., 0::2] & 15) | ((u[..., 1::2] & 15) << 4)).astype(np.uint8)
    return b.reshape(n, -1)


#: (GGUF tensor, shape [N, K], type): N = 40 (the head, the embedding) is not a multiple of 16, ffn_down's
#: K = 480 not of 64; the embedding stays packed as a layer of role "embedding"
IQ4_TENSORS = [("token_embd.weight", (40, 256), "IQ4_NL"), ("blk.0.attn_q.weight", (256, 256), "IQ4_XS"),
               ("blk.0.attn_k.weight", (128, 256), "IQ4_NL"),
               ("blk.0.attn_v.weight", (128, 256), "IQ4_XS"), ("blk.0.attn_output.weight", (256, 256), "IQ4_NL"),
               ("blk.0.ffn_gate.weight", (480, 256), "IQ4_XS"), ("blk.0.ffn_up.weight", (480, 256), "IQ4_NL"),
               ("blk.0.ffn_down.weight", (256, 480), "IQ4_NL"), ("output.weight", (40, 256), "IQ4_XS")]


def make_iq4_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-block llama (hidden 256, ffn 480, vocab 40) with IQ4_NL and IQ4_XS matrices; returns gguf-py's
    dequantization of each."""
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    w = one_block_llama_writer(path, "w4pack iq4", ffn=480, file_type=30)  # MOSTLY_IQ4_XS
    deq: dict[str, np.ndarray] = {}
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, np.ones(256, np.float32))
    for name, shape, qt in IQ4_TENSORS:
        raw = iq4_blocks(rng, qt, *shape)
        w.add_tensor(name, raw, raw_dtype=Q[qt])
        deq[name] = gguf.quants.dequantize(raw, Q[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


def _iq4_compact(qtype: str, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = random_blocks(rng, qtype, n, k)
    packed = pack(gq.decode(qtype, raw, n, k).validate())
    st, arrays = C.compact(packed.meta, packed.tensors, gq.STORAGE[qtype])
    return raw, packed, st, arrays


def test_real_fields_follow_the_layout() -> None:
    """The padding mask of §8's codebook encoding marks exactly the fields layout.pack fills from real codes."""
    from w4pack.canonical import CanonicalLayer

    for n, k in [(37, 96), (16, 64), (5, 200), (48, 448)]:
        lay = CanonicalLayer(codes=np.ones((n, k), np.uint8), scales=np.ones((n, 1), np.float16), bits=8,
                             group_size=-1, zero_mode="none", scale_dtype="float16")
        p = pack(lay)
        fields = p.tensors["qweight"].view(np.uint8).reshape(p.tensors["qweight"].shape[0], -1)
        assert np.array_equal(fields == 1, C.real_fields(p.meta)), (n, k)


@pytest.mark.parametrize("qtype,n,k", [("IQ4_NL", 37, 96), ("IQ4_NL", 21, 480), ("IQ4_NL", 48, 512),
                                       ("IQ4_XS", 37, 768), ("IQ4_XS", 9, 256), ("IQ4_XS", 32, 512)])
def test_iq4_stores_4bit_indices_and_expands_exactly(qtype: str, n: int, k: int) -> None:
    """Random IQ4 blocks at odd shapes: stored as 4-bit indices plus the manifest's codebook, expanded to the
    runtime tensors of today's decode bit for bit, dequantizing to gguf-py's values; with N a multiple of 16 (and
    K of 64) exactly the GGUF's bytes, otherwise those plus the padding."""
    raw, packed, st, arrays = _iq4_compact(qtype, n, k, n * 1000 + k)
    assert st is not None and st["codebook"] == [int(v) + 128 for v in gq.IQ4_NL_VALUES]
    assert set(st) == set(gq.STORAGE[qtype]) and "qweight" not in arrays
    assert arrays["qindex"].dtype == np.uint8 and arrays["qindex"].shape == (-(-n // 16), 8 * -(-k // 64) * 64)
    meta = dict(packed.meta, storage=st)
    back = C.expand(meta, arrays, "L")
    assert set(back) == set(packed.tensors)
    for s, arr in packed.tensors.items():
        assert _same_bytes(back[s], arr), (qtype, s)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k)
    got = unpack(PackedLayer(meta=dict(packed.meta), tensors=back)).dequantize(np.float64).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    np_, kp = packed.meta["padded_shape"]
    stored = sum(a.nbytes for a in arrays.values())
    assert stored == raw.nbytes * (np_ * kp) // (n * k)  # 18 per 32 / 136 per 256 over the padded matrix
    if n % 16 == 0 and k % 64 == 0:
        assert stored == raw.nbytes


def test_codes_outside_the_codebook_stay_in_the_runtime_form() -> None:
    """An 8-bit layer with a code the codebook lacks, or a non-zero padding field, keeps its qweight: stored as
    indices it would expand to another layer."""
    _raw, packed, _st, _arrays = _iq4_compact("IQ4_NL", 20, 96, 1)
    qw = packed.tensors["qweight"].copy()
    fields = qw.view(np.uint8).reshape(qw.shape[0], -1)
    real = C.real_fields(packed.meta)
    fields[np.nonzero(real)[0][0], np.nonzero(real)[1][0]] = 128  # code 128 (weight 0) is not in IQ4's codebook
    st, arrays = C.compact(packed.meta, dict(packed.tensors, qweight=qw), gq.STORAGE["IQ4_NL"])
    assert st is None and _same_bytes(arrays["qweight"], qw)
    qw = packed.tensors["qweight"].copy()
    fields = qw.view(np.uint8).reshape(qw.shape[0], -1)
    fields[np.nonzero(~real)[0][0], np.nonzero(~real)[1][0]] = gq.IQ4_CODEBOOK[0]
    st, arrays = C.compact(packed.meta, dict(packed.tensors, qweight=qw), gq.STORAGE["IQ4_NL"])
    assert st is None and _same_bytes(arrays["qweight"], qw)
    # a codebook on 4-bit fields is not used (and a manifest naming one is refused)
    q4 = pack(gq.decode("Q4_K", random_blocks(np.random.default_rng(2), "Q4_K", 16, 256), 16, 256).validate())
    st, arrays = C.compact(q4.meta, q4.tensors, {"codebook": list(range(16))})
    assert st is None and "qweight" in arrays


def test_hostile_codebook_storage_is_refused_naming_the_tensor() -> None:
    _raw, packed, st, arrays = _iq4_compact("IQ4_XS", 20, 256, 3)  # rows 20..31 are padding
    meta = dict(packed.meta, storage=st)
    idx = C.unpack_bits(arrays["qindex"], 4)
    real = C.real_fields(packed.meta)
    bad = idx.copy()
    bad[np.nonzero(~real)[0][0], np.nonzero(~real)[1][0]] = 3
    err = _expand_error(meta, dict(arrays, qindex=C.pack_bits(bad, 4)))
    assert "m.layer.qindex" in err and "padding" in err and "non-zero codebook index" in err, err
    short = dict(st, codebook=st["codebook"][:12])  # indices 12..15 now point past the codebook
    err = _expand_error(dict(packed.meta, storage=short), arrays)
    assert "m.layer.qindex" in err and "past the manifest's 12-entry codebook" in err, err
    err = _expand_error(meta, dict(arrays, qindex=arrays["qindex"][:, :-8]))
    assert "m.layer.qindex" in err and "expected uint8 [2, 2048]" in err, err
    err = _expand_error(meta, dict(arrays, qindex=arrays["qindex"].view(np.int8)))
    assert "m.layer.qindex" in err and "int8" in err, err
    err = _expand_error(meta, {s: a for s, a in arrays.items() if s != "qindex"})
    assert "m.layer.qindex" in err and "missing" in err, err
    for cb, why in [(st["codebook"][:15] + [st["codebook"][0]], "lists a code twice"),
                    (st["codebook"][:15] + [256], "entry 256 is not one of the layer's 8-bit codes 0..255"),
                    (st["codebook"][:15] + [-1], "entry -1 is not one of"),
                    (st["codebook"] + [0], "1 to 16 codes"), ([], "1 to 16 codes")]:
        assert why in C.check_storage(dict(meta, storage=dict(st, codebook=cb))), cb
        err = _expand_error(dict(meta, storage=dict(st, codebook=cb)), arrays)
        assert why in err and "m.layer" in err, err
    assert "storage_bits 4" in C.check_storage(dict(meta, bits=4, storage_bits=4))
    assert "together" in C.check_storage(dict(meta, bits=6, storage=dict(st, dense_codes=True)))


@pytest.fixture(scope="module")
def iq4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("iq4")
    deq = make_iq4_gguf(d / "iq4.gguf")
    convert(d / "iq4.gguf", d / "w4", show_progress=False)
    return d / "iq4.gguf", d / "w4", deq


def _layer_disk_bytes(ck, name: str) -> int:
    return sum(int(np.prod(ck.store.info(t)[1])) * ck.store.storage_dtype(t).itemsize
               for t in ck.manifest["layers"][name]["tensors"].values())


def test_iq4_gguf_takes_its_gguf_bytes_verifies_and_round_trips(iq4, tmp_path: Path) -> None:
    """Every IQ4 layer stored as codebook indices; with N a multiple of 16 and K of 64 a layer takes exactly its
    GGUF tensor's bytes; dequantization is gguf-py's; validate --deep and verify --against pass bit-identical;
    back to GGUF byte for byte; --expanded writes the runtime form with the same tensors once read."""
    src, w4, deq = iq4
    ck = open_checkpoint(w4)
    gbytes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(src)).tensors}
    hf = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head",
          **{f"blk.0.{g}.weight": f"model.layers.0.{m}" for g, m in [
              ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
              ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
              ("ffn_down", "mlp.down_proj")]}}
    assert sorted(ck.layers) == sorted(hf.values())
    for g, (n, k), qt in IQ4_TENSORS:
        meta = ck.manifest["layers"][hf[g]]
        want_st = {"codebook": gq.IQ4_CODEBOOK} | ({"scales": gq.STORAGE[qt]["scales"]} if qt == "IQ4_XS" else {})
        assert meta["storage"] == want_st and "qindex" in meta["tensors"] and "qweight" not in meta["tensors"], g
        np_, kp = meta["padded_shape"]
        assert _layer_disk_bytes(ck, hf[g]) == gbytes[g] * (np_ * kp) // (n * k), g
        if n % 16 == 0 and k % 64 == 0:
            assert _layer_disk_bytes(ck, hf[g]) == gbytes[g], g
        if "attn_q" not in g and "attn_k" not in g:  # q/k rows are un-permuted for rotary (test_gguf checks)
            got = ck.layer(hf[g]).dequantize(np.float64).astype(np.float32)
            assert np.array_equal(got.view(np.uint32), deq[g].view(np.uint32)), g
    _deep_checks_and_round_trips(src, w4, ck, tmp_path, grows=1.8, layers=9, runtime={"qweight", "scales"})


def test_hostile_qindex_in_a_folder_exits_2_naming_it(iq4, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    _src, w4, _deq = iq4
    bad = tmp_path / "bad"
    # lm_head: N = 40, rows 40..47 are padding; its last stripe's last byte holds indices of padding fields
    tname = "lm_head.qindex"
    shutil.copytree(w4, bad)
    _patch_tensor(bad, tname, lambda b: b[:-1] + b"\x11")
    rc, err = _validate([str(bad), "--deep", "--no-checksums"], capsys)
    assert rc == 2 and tname in err and "non-zero codebook index" in err and str(bad) in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    # a codebook shortened in the manifest: stored indices point past it
    shutil.rmtree(bad)
    shutil.copytree(w4, bad)
    man = json.loads((bad / "w4pack.json").read_text())
    man["layers"]["lm_head"]["storage"]["codebook"] = gq.IQ4_CODEBOOK[:8]
    (bad / "w4pack.json").write_text(json.dumps(man))
    rc, err = _validate([str(bad), "--deep", "--no-checksums"], capsys)
    assert rc == 2 and tname in err and "past the manifest's 8-entry codebook" in err, err
    assert len(err.splitlines()) == 1
    # manifests the schema or the layer checks refuse, naming the layer
    for cb in (gq.IQ4_CODEBOOK[:15] + [gq.IQ4_CODEBOOK[0]], gq.IQ4_CODEBOOK[:15] + [300], gq.IQ4_CODEBOOK + [0]):
        man["layers"]["lm_head"]["storage"]["codebook"] = cb
        (bad / "w4pack.json").write_text(json.dumps(man))
        rc, err = _validate([str(bad), "--no-checksums"], capsys)
        assert rc == 2 and "w4pack.json" in err and "lm_head" in err and len(err.splitlines()) == 1, err
    man["layers"]["lm_head"]["storage"]["codebook"] = gq.IQ4_CODEBOOK
    man["layers"]["lm_head"]["storage"]["dense_codes"] = True
    (bad / "w4pack.json").write_text(json.dumps(man))
    rc, err = _validate([str(bad), "--no-checksums"], capsys)
    assert rc == 2 and "lm_head" in err and len(err.splitlines()) == 1, err
    # the index tensor stored with the wrong shape: found at open, before any data is read
    shutil.rmtree(bad)
    shutil.copytree(w4, bad)
    man = json.loads((bad / "w4pack.json").read_text())
    man["layers"]["lm_head"]["shape"] = [56, 256]
    man["layers"]["lm_head"]["padded_shape"] = [64, 256]
    (bad / "w4pack.json").write_text(json.dumps(man))
    rc, err = _validate([str(bad), "--no-checksums"], capsys)
    assert rc == 2 and "lm_head." in err and "contradicts the manifest" in err and len(err.splitlines()) == 1, err


def test_a_reader_before_the_codebook_refuses_cleanly(iq4) -> None:
    """What a w4pack from before ``storage.codebook`` (schema of commit 246c5cd, kept as data) does with an IQ4
    folder: its closed ``storage`` object and ``tensors`` map reject the manifest, so it refuses instead of
    misreading; the K-quant folders it already read stay valid under the current schema."""
    import jsonschema

    from w4pack.schema import load_schema

    _src, w4, _deq = iq4
    old = json.loads((Path(__file__).resolve().parent.parent / "data" / "manifest.schema.before-codebook.json")
                     .read_text())
    man = json.loads((w4 / "w4pack.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(man, old)
    jsonschema.validate(man, load_schema("manifest"))
    for bad in ({"codebook": gq.IQ4_CODEBOOK + [0]}, {"codebook": [1, 1]}, {"codebook": [256]}):
        m = json.loads(json.dumps(man))
        m["layers"]["lm_head"]["storage"] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(m, load_schema("manifest"))
    m = json.loads(json.dumps(man))
    m["layers"]["lm_head"]["tensors"]["qweight"] = "lm_head.qweight"  # both forms of the codes
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(m, load_schema("manifest"))
