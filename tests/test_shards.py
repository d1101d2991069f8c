"""store/shards.py: the one streaming shard writer (ShardStream) and the peers' two configurations of it."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import w4pack.store.shards as shards
from w4pack.errors import BadInputError
from w4pack.store.safetensors import dtype_to_st
from w4pack.store.shards import PlannedShards, ShardEntry, ShardStream, ShardWriter


def _tensors(seed: int = 0) -> list[tuple[str, np.ndarray, str | None]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(7):
        out.append((f"model.layers.{i}.w", rng.integers(-2**31, 2**31, size=(16, 40 + 8 * i), dtype=np.int32), None))
        out.append((f"model.layers.{i}.s", rng.standard_normal(40 + 8 * i).astype(np.float16), None))
    out.append(("model.norm.weight", np.full(24, 0x3F80, np.uint16), "bfloat16"))
    out.append(("empty", np.zeros((0, 4), np.float32), None))
    return out


def _read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("max_bytes", [1 << 30, 3000, 1])
def test_writer_and_planned_shards_write_the_same_bytes(tmp_path: Path, max_bytes: int) -> None:
    """Both peer configurations give tight headers and the same split, whatever the shard size; the planned one
    never copies data (its reservation is exactly each header), the other always relocates it."""
    items = _tensors()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with ShardWriter(a, max_bytes) as w:
        for item in items:
            w.add(*item)
        w.finish()
    entries = [ShardEntry(n, tuple(x.shape), dtype_to_st(x, d), x.nbytes) for n, x, d in items]
    copies = []
    real = shards.copy_fd
    shards.copy_fd = lambda *args: (copies.append(args), real(*args))[1]
    try:
        p = PlannedShards(b, entries, max_bytes)
        for item in items:
            p.write(*item)
        files = p.finish()
    finally:
        shards.copy_fd = real
    assert copies == [] and files == sorted(x.name for x in b.glob("*.safetensors"))
    index = "model.safetensors.index.json"
    fa, fb = _folder_bytes(a), _folder_bytes(b)
    assert {k: v for k, v in fa.items() if k != index} == {k: v for k, v in fb.items() if k != index}
    # the same index, GPTQ's sorted by tensor name (as it always was), AWQ's in writing order
    assert (index in fa) == (index in fb) == (len(files) > 1)
    if index in fa:
        ia, ib = json.loads(fa[index]), json.loads(fb[index])
        assert ia == ib and list(ib["weight_map"]) == sorted(ib["weight_map"])
        assert list(ia["weight_map"]) == [n for n, _x, _d in items]
    # a shard holds whole tensors and starts a new one only when the next would overflow it
    assert (len(files) == 1) == (max_bytes == 1 << 30) and (len(files) == len(items)) == (max_bytes == 1)
    got = {}
    for f in files:
        header, data = _read(b / f)
        assert struct.unpack("<Q", (b / f).read_bytes()[:8])[0] % 8 == 0  # tight: padded to 8 bytes, no more
        for name, e in header.items():
            if name != "__metadata__":
                got[name] = data[e["data_offsets"][0]:e["data_offsets"][1]]
    assert got == {n: np.ascontiguousarray(x).tobytes() for n, x, _d in items}


def test_padded_stream_relocates_a_header_that_outgrew_its_reservation(tmp_path: Path) -> None:
    """pad=True (w4pack checkpoints): a header that fits is padded with spaces to the reservation, data stays in
    place; one that does not is put in front of a copy, and later shards reserve more."""
    items = _tensors(1)
    s = ShardStream(tmp_path, 2500, output=tmp_path, pad=True, seal=True, reserve=64, temp="s{:03d}")
    for item in items:
        s.add([item])
    done = s.close()
    assert s.reserve == 4096  # grown (to whole pages) after the first header outgrew 64 bytes
    seen = {}
    import hashlib

    for shard in done:
        raw = shard.path.read_bytes()
        assert shard.size == len(raw) and shard.sha256 == hashlib.sha256(raw).hexdigest()
        header, data = _read(shard.path)
        assert len(data) == shard.data_bytes and list(header)[1:] == shard.names
        for name in shard.names:
            lo, hi = header[name]["data_offsets"]
            seen[name] = data[lo:hi]
    first = done[0].path.read_bytes()
    (n,) = struct.unpack("<Q", first[:8])
    assert (8 + n) % 8 == 0
    later = [d for d in done[1:] if struct.unpack("<Q", d.path.read_bytes()[:8])[0] + 8 == s.reserve]
    assert later, "later shards keep their header in the grown reservation"
    assert seen == {n: np.ascontiguousarray(x).tobytes() for n, x, _d in items}


def test_stream_refuses_a_name_twice_and_the_plan_refuses_a_changed_source(tmp_path: Path) -> None:
    s = ShardStream(tmp_path, 1 << 20, output=tmp_path)
    s.add([("x", np.ones(3, np.float32), None)])
    with pytest.raises(BadInputError, match="written twice"):
        s.add([("x", np.ones(3, np.float32), None)])
    s.abort()
    p = PlannedShards(tmp_path, [ShardEntry("a", (3,), "F32", 12)], 1 << 20)
    with pytest.raises(BadInputError, match="changed between passes"):
        p.write("a", np.ones(4, np.float32), None)
    with pytest.raises(BadInputError, match="1 tensors it listed"):
        p.finish()
    p.abort()


def test_no_tensors_still_gives_one_shard(tmp_path: Path) -> None:
    """Every configuration writes one empty, readable shard rather than none."""
    (tmp_path / "w").mkdir()
    (tmp_path / "p").mkdir()
    with ShardWriter(tmp_path / "w", 100) as w:
        w.finish()
    assert PlannedShards(tmp_path / "p", [], 100).finish() == ["model.safetensors"]
    assert _folder_bytes(tmp_path / "w") == _folder_bytes(tmp_path / "p")
    assert _read(tmp_path / "p" / "model.safetensors") == ({"__metadata__": {"format": "pt"}}, b"")
