"""A clean-room reader of packed w4pack checkpoints, written from the normative docs alone.

Sources used: docs/LAYOUT.md, docs/FORMAT.md, schemas/*.json and README.md -- nothing under w4pack/ or
native/. It exists to prove that those documents are enough for a stranger to read a checkpoint bit for bit:
tests/test_spec_reader.py compares what it reads with independent ground truth. It depends only on numpy and
the standard library (json, struct, hashlib): safetensors files are parsed by hand, so BF16 needs no special path.
Two checks follow the docs as clarified after it was first written (padding compared bit for bit, tensors looked
up through the manifest's names); the ambiguities that prompted them are in the commits that fixed the docs.

Entry points: ``read_checkpoint(folder)`` yields one ``SpecLayer`` (the logical layer of LAYOUT.md §1) per
packed layer of the manifest; ``dequantize(layer)`` evaluates LAYOUT.md §1 in float64.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np


class SpecError(ValueError):
    """The folder breaks a rule of LAYOUT.md / FORMAT.md (the message names the file and tensor)."""


# --------------------------------------------------------------------------------------------------
# safetensors (FORMAT.md §3: 8-byte little-endian header length, JSON header, data)

_ST_DTYPES = {
    "I32": np.dtype("<i4"), "U8": np.dtype("u1"), "U16": np.dtype("<u2"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "F32": np.dtype("<f4"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "U32": np.dtype("<u4"), "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"),
}


class _Shard:
    """One safetensors file: header parsed once, tensors read by name as raw numpy arrays."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SpecError(f"{path}: shorter than a safetensors header")
            (hlen,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if hlen > size - 8:
                raise SpecError(f"{path}: header length {hlen} past the end of the file")
            self.header = json.loads(f.read(hlen).decode("utf-8"))
        self.data_start = 8 + hlen
        self.size = size
        self.header.pop("__metadata__", None)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def read(self, name: str) -> tuple[np.ndarray, str]:
        """The tensor's raw values (BF16 as its uint16 words) and its safetensors dtype string."""
        if name not in self.header:
            raise SpecError(f"{self.path}: tensor {name} is not in the shard")
        info = self.header[name]
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise SpecError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        shape = tuple(int(x) for x in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != count * dt.itemsize or begin < 0 or self.data_start + end > self.size:
            raise SpecError(f"{self.path}: tensor {name} has data_offsets that do not fit its shape/file")
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            buf = f.read(end - begin)
        return np.frombuffer(buf, dtype=dt).reshape(shape).copy(), info["dtype"]


def widen(values: np.ndarray, st_dtype: str) -> np.ndarray:
    """Exact float64 of stored F16/BF16/F32 values (BF16: float32 bits ``w << 16``, FORMAT.md §3)."""
    if st_dtype == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if st_dtype in ("F16", "F32", "F64"):
        return values.astype(np.float64)
    raise SpecError(f"not a float dtype: {st_dtype}")


_SCALE_ST = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


# --------------------------------------------------------------------------------------------------
# the logical layer (LAYOUT.md §1)

@dataclass
class SpecLayer:
    """One packed layer as LAYOUT.md §1 defines it, in original column order."""

    name: str
    bits: int
    zero_mode: str                      # "none" | "int" | "float"
    group_size: int                     # -1 = per-channel
    q: np.ndarray                       # uint8 [N, K]
    s: np.ndarray                       # float64 [N, G] (exact widening of the stored scales)
    g_idx: np.ndarray                   # int64 [K]
    scale_dtype: str
    z: np.ndarray | None = None         # int64 [N, G] (zero mode int)
    m: np.ndarray | None = None         # float64 [N, G] (zero mode float)
    perm: np.ndarray | None = None      # int64 [K] (act-order)
    bias: np.ndarray | None = None      # float64 [N]
    role: str = "linear"
    storage: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


def dequantize(layer: SpecLayer) -> np.ndarray:
    """W [N, K] in float64 from the exactly widened stored values (LAYOUT.md §1)."""
    q = layer.q.astype(np.float64)
    s = layer.s[:, layer.g_idx]
    if layer.zero_mode == "none":
        return s * (q - float(2 ** (layer.bits - 1)))
    if layer.zero_mode == "int":
        return s * (q - layer.z[:, layer.g_idx].astype(np.float64))
    if layer.zero_mode == "float":
        return s * q + layer.m[:, layer.g_idx]
    raise SpecError(f"unknown zero mode {layer.zero_mode}")


# --------------------------------------------------------------------------------------------------
# field order of one 16-row stripe (LAYOUT.md §3.3, §8)

_NP = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def _field_index(kp: int, storage_bits: int) -> np.ndarray:
    """f[r, k'] = the storage field (nibble or byte, in memory order) of stripe row r, packed column k'."""
    r = np.arange(16)[:, None]
    k = np.arange(kp)[None, :]
    rh, gid = r // 8, r % 8
    kb, rem = k // 64, k % 64
    j, rem = rem // 16, rem % 16
    kh, rem = rem // 8, rem % 8
    tid, e = rem // 2, rem % 2
    lane = 4 * gid + tid
    elem = 4 * kh + 2 * rh + e
    if storage_bits == 4:
        word = 128 * kb + 4 * lane + j
        return 8 * word + _NP[elem]          # nibble p of a word = byte p//2, low nibble first
    word = 256 * kb + 8 * lane + 2 * j + elem // 4
    return 4 * word + elem % 4


def _fields_of_words(qweight: np.ndarray, storage_bits: int) -> np.ndarray:
    """[stripes, F] storage fields of int32 little-endian words, in memory order."""
    b = qweight.astype("<i4").view(np.uint8).reshape(qweight.shape[0], -1)
    if storage_bits == 8:
        return b.copy()
    out = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = b & 0xF
    out[:, 1::2] = b >> 4
    return out


def unpack_dense(rows: np.ndarray, bits: int, count: int) -> np.ndarray:
    """LAYOUT.md §8 Dense bit-packing: value i of a row at bits b·i … b·i+b−1 of the LSB-first stream."""
    bitstream = np.unpackbits(rows, axis=1, bitorder="little")[:, : count * bits]
    vals = bitstream.reshape(rows.shape[0], count, bits).astype(np.uint32)
    return (vals << np.arange(bits, dtype=np.uint32)).sum(axis=2).astype(np.uint32)


# --------------------------------------------------------------------------------------------------
# the folder (FORMAT.md)

def _safe_name(folder: str, name: str, what: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or ".." in name \
            or os.path.isabs(name):
        raise SpecError(f"{what}: unsafe file name {name!r}")
    path = os.path.join(folder, name)
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(folder):
        raise SpecError(f"{what}: {name} resolves outside the folder")
    return path


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class SpecCheckpoint:
    """The manifest, index and shards of one packed folder (FORMAT.md §1, §3–§5)."""

    def __init__(self, folder: str, verify_checksums: bool = True) -> None:
        self.folder = folder
        if os.path.exists(os.path.join(folder, ".w4pack-incomplete")):
            raise SpecError(f"{folder}: has the .w4pack-incomplete marker")
        mpath = os.path.join(folder, "w4pack.json")
        if not os.path.isfile(mpath):
            raise SpecError(f"{folder}: no w4pack.json, not a checkpoint")
        with open(mpath, encoding="utf-8") as f:
            self.manifest = json.load(f)
        man = self.manifest
        if man.get("format") != "w4pack" or man.get("format_version") not in (1, 2):
            raise SpecError("w4pack.json: not a w4pack manifest of format version 1 or 2")
        lay = man.get("layout", {})
        if lay.get("name") != "w4pack-tiles" or lay.get("version") != 1:
            raise SpecError("w4pack.json: unknown layout (name, version) — refusing rather than guessing")
        if "tile" in lay and lay["tile"] != [16, 64]:
            raise SpecError("w4pack.json: layout.tile must be [16, 64]")
        ipath = os.path.join(folder, "model.safetensors.index.json")
        with open(ipath, encoding="utf-8") as f:
            self.index = json.load(f)["weight_map"]
        manifest_shards = {s["file"] for s in man["shards"]}
        if verify_checksums:
            for entry in list(man["shards"]) + list(man.get("files", [])):
                path = _safe_name(folder, entry["file"], "w4pack.json")
                with open(path, "rb") as f:
                    data = f.read()
                if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                    raise SpecError(f"{entry['file']}: size or sha256 differs from w4pack.json")
        self._shards: dict[str, _Shard] = {}
        for file in sorted(set(self.index.values())):
            if file not in manifest_shards:
                raise SpecError(f"model.safetensors.index.json: shard {file} is not in the manifest")
            self._shards[file] = _Shard(_safe_name(folder, file, "model.safetensors.index.json"))

    def read_tensor(self, name: str) -> tuple[np.ndarray, str]:
        file = self.index.get(name)
        if file is None:
            raise SpecError(f"model.safetensors.index.json: tensor {name} is not listed")
        return self._shards[file].read(name)

    def layer_names(self) -> list[str]:
        return list(self.manifest["layers"])

    # ---------------------------------------------------------------------------------------------
    def layer(self, name: str) -> SpecLayer:
        """Read and check one layer; expand compact storage; return the logical layer."""
        e = self.manifest["layers"][name]
        where = f"w4pack.json: layer {name}"
        bits, sbits, gs, zm = e["bits"], e["storage_bits"], e["group_size"], e["zero_mode"]
        if bits not in (2, 3, 4, 5, 6, 8):
            raise SpecError(f"{where}: bits {bits}")
        if sbits != (4 if bits <= 4 else 8):
            raise SpecError(f"{where}: storage_bits {sbits} does not fit bits {bits}")
        if zm not in ("none", "int", "float"):
            raise SpecError(f"{where}: zero_mode {zm}")
        if not (gs == -1 or (gs > 0 and gs % 16 == 0)):
            raise SpecError(f"{where}: group_size {gs}")
        n, k = e["shape"]
        np_, kp = 16 * _ceil(n, 16), 64 * _ceil(k, 64)
        g = 1 if gs == -1 else _ceil(k, gs)
        gp = 1 if gs == -1 else _ceil(kp, gs)
        if list(e["padded_shape"]) != [np_, kp] or e["num_groups"] != g or e["padded_groups"] != gp:
            raise SpecError(f"{where}: padded_shape/num_groups/padded_groups disagree with shape {n}x{k}")
        sdt = e["scale_dtype"]
        if sdt not in _SCALE_ST:
            raise SpecError(f"{where}: scale_dtype {sdt}")
        storage = e.get("storage") or {}
        tensors = e["tensors"]

        def get(key: str, st_dtype: str | tuple, shape: tuple) -> np.ndarray:
            if key not in tensors:
                raise SpecError(f"{where}: tensors lacks {key}")
            arr, dt = self.read_tensor(tensors[key])
            ok = (st_dtype,) if isinstance(st_dtype, str) else st_dtype
            if dt not in ok or arr.shape != tuple(shape):
                raise SpecError(f"{where}: tensor {tensors[key]} is {dt}{list(arr.shape)}, "
                                f"expected {ok[0]}{list(shape)}")
            return arr

        allowed = {"qweight", "qdense", "qindex", "scales", "scales_d", "scales_q", "zeros", "mins", "mins_d",
                   "mins_q", "perm", "bias"}
        expected = set()
        # ---- codes → Q [Np, Kp]
        fidx = _field_index(kp, sbits)
        nstripes = np_ // 16
        if storage.get("dense_codes") and "codebook" in storage:
            raise SpecError(f"{where}: dense_codes and codebook together")
        if storage.get("dense_codes"):
            if bits not in (2, 3, 5, 6):
                raise SpecError(f"{where}: dense_codes on a {bits}-bit layer")
            qd = get("qdense", "U8", (nstripes, 2 * kp * bits))
            fields = unpack_dense(qd, bits, 16 * kp)
            expected.add("qdense")
            pad_index_nonzero = None
        elif "codebook" in storage:
            cb = storage["codebook"]
            if sbits != 8 or not 1 <= len(cb) <= 16 or len(set(cb)) != len(cb) \
                    or any((not isinstance(c, int)) or c < 0 or c > 2 ** bits - 1 for c in cb):
                raise SpecError(f"{where}: bad codebook {cb}")
            qi = get("qindex", "U8", (nstripes, 8 * kp))
            idx = unpack_dense(qi, 4, 16 * kp)
            if (idx >= len(cb)).any():
                raise SpecError(f"{where}: tensor {tensors['qindex']} has an index past the codebook")
            fields = np.asarray(cb, dtype=np.uint32)[idx]
            pad_index_nonzero = idx           # checked against the padding below
            expected.add("qindex")
        else:
            words = get("qweight", "I32", (nstripes, (kp // 64) * 32 * (4 if sbits == 4 else 8)))
            fields = _fields_of_words(words, sbits).astype(np.uint32)
            expected.add("qweight")
            pad_index_nonzero = None
        # fields [stripes, F] → Q[stripe*16 + r, k'] = fields[stripe, f[r, k']]
        Q = fields[:, fidx].reshape(np_, kp)
        real = np.zeros((np_, kp), dtype=bool)
        real[:n, :k] = True
        if pad_index_nonzero is not None:
            idx_q = pad_index_nonzero[:, fidx].reshape(np_, kp)
            if (idx_q[~real] != 0).any():
                raise SpecError(f"{where}: tensor {tensors['qindex']} has a non-zero index in the padding")
            Q = np.where(real, Q, 0)
        if (Q[~real] != 0).any():
            raise SpecError(f"{where}: non-zero code in the padding (§3.2)")
        if (Q > 2 ** bits - 1).any():
            raise SpecError(f"{where}: code above 2^bits - 1")
        # ---- perm / g_idx (§3.1)
        perm = None
        if e["act_order"]:
            p = get("perm", "I32", (k,)).astype(np.int64)
            if not np.array_equal(np.sort(p), np.arange(k)):
                raise SpecError(f"{where}: tensor {tensors['perm']} is not a permutation of 0..K-1")
            perm = p
            expected.add("perm")
        g_idx = np.zeros(k, dtype=np.int64)
        packed_groups = np.zeros(k, dtype=np.int64) if gs == -1 else np.arange(k) // gs
        if perm is not None:
            g_idx[perm] = packed_groups
            q = np.empty((n, k), dtype=np.uint8)
            q[:, perm] = Q[:n, :k]
        else:
            g_idx = packed_groups
            q = Q[:n, :k].astype(np.uint8)
        # ---- scales (§4 / §8)
        sst = _SCALE_ST[sdt]

        def params(kind: str) -> np.ndarray:
            """scales or mins [Gp, Np] as float64, checked padding; compact ones expanded (§8)."""
            spec = storage.get(kind)
            if spec is None:
                arr = get(kind, sst, (gp, np_))
                expected.add(kind)
                val = widen(arr, sst)
                pad = np.ones((gp, np_), dtype=bool)
                pad[:g, :n] = False
                if (arr.view(f"u{arr.dtype.itemsize}")[pad] != 0).any():   # +0 only, every bit (§3.2)
                    raise SpecError(f"{where}: tensor {tensors[kind]} is not zero in the padding (§3.2)")
                return val
            if sdt != "float32" or gs == -1:
                raise SpecError(f"{where}: compact {kind} on a {sdt} / group {gs} layer")
            S, b, o = spec["super_groups"], spec["bits"], spec["offset"]
            if b not in (4, 6, 8) or not -128 <= o <= 0 or S < 1 or g % S or gp % S:
                raise SpecError(f"{where}: storage.{kind} {spec}")
            d = get(f"{kind}_d", "F16", (gp // S, np_))
            uq = get(f"{kind}_q", "U8", (gp, np_ * b // 8))
            expected.update({f"{kind}_d", f"{kind}_q"})
            u = unpack_dense(uq, b, np_).astype(np.int64)
            dbits = d.view(np.uint16)
            dpad = np.ones(dbits.shape, dtype=bool)
            dpad[: g // S, :n] = False
            upad = np.ones(u.shape, dtype=bool)
            upad[:g, :n] = False
            if (dbits[dpad] != 0).any() or (u[upad] != 0).any():
                raise SpecError(f"{where}: compact {kind} not all-zero in the padding (§8)")
            d32 = d.astype(np.float32)
            if not np.isfinite(d32).all():
                raise SpecError(f"{where}: tensor {tensors[kind + '_d']} has a NaN or infinite factor")
            prod = np.repeat(d32, S, axis=0) * (u + o).astype(np.float32)
            if kind == "mins":
                prod = -prod
            out = np.zeros((gp, np_), dtype=np.float32)
            out[:g, :n] = prod[:g, :n]
            return out.astype(np.float64)

        sfull = params("scales")
        if not np.isfinite(sfull).all():
            raise SpecError(f"{where}: NaN or infinite scale")
        s = sfull[:g, :n].T.copy()
        z = m = None
        if zm == "int":
            zt = get("zeros", "U8" if sbits == 4 else "U16", (gp, np_)).astype(np.int64)
            expected.add("zeros")
            zpad = np.ones(zt.shape, dtype=bool)
            zpad[:g, :n] = False
            if (zt[zpad] != 0).any():
                raise SpecError(f"{where}: tensor {tensors['zeros']} is not zero in the padding (§3.2)")
            if (zt > 2 ** bits).any():
                raise SpecError(f"{where}: zero point above 2^bits")
            z = zt[:g, :n].T.copy()
        elif zm == "float":
            mfull = params("mins")
            if not np.isfinite(mfull).all():
                raise SpecError(f"{where}: NaN or infinite minimum")
            m = mfull[:g, :n].T.copy()
        bias = None
        if "bias" in tensors:
            barr, bdt = self.read_tensor(tensors["bias"])
            if barr.shape != (n,):
                raise SpecError(f"{where}: bias shape {barr.shape}")
            bias = widen(barr, bdt)
            expected.add("bias")
        if set(tensors) != expected or not set(tensors) <= allowed:
            raise SpecError(f"{where}: tensors {sorted(tensors)} are not exactly {sorted(expected)}")
        return SpecLayer(name=name, bits=bits, zero_mode=zm, group_size=gs, q=q, s=s, g_idx=g_idx,
                         scale_dtype=sdt, z=z, m=m, perm=perm, bias=bias, role=e.get("role", "linear"),
                         storage=dict(storage))


def read_checkpoint(folder: str, verify_checksums: bool = True) -> Iterator[SpecLayer]:
    """Yield the logical layer (LAYOUT.md §1) of every packed layer of a w4pack folder, manifest order."""
    ck = SpecCheckpoint(folder, verify_checksums)
    for name in ck.layer_names():
        yield ck.layer(name)
