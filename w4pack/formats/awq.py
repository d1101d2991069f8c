"""AWQ checkpoints: AutoAWQ GEMM / GEMV / GEMVFast and mit-han-lab llm-awq ``.pt`` dumps, read and written.

Layouts (facts in ``reference/formats-awq-ct-gguf.md`` §1-2; N = out_features, K = in_features, ng = groups):

* GEMM (AutoAWQ default; llm-awq 2023 dumps are byte-identical): ``qweight`` int32 [K, N/8] packed along N with
  the nibble order [0,2,4,6,1,3,5,7]; ``qzeros`` int32 [ng, N/8] the same way; ``scales`` [ng, N].
* GEMV (AutoAWQ GEMV; llm-awq late-2023 dumps): ``qweight`` int32 [N, K/8] natural nibble order along K;
  ``qzeros`` int32 [N, Wz] and ``scales`` [N, 8·Wz], zero-padded past ng.
* GEMVFast (AutoAWQ; llm-awq 2024 TinyChat dumps, whose zero tensor is named ``scaled_zeros``): ``qweight``
  int16 [N/4, K] (4-row interleave, 64-column stride, permuted nibbles); ``scales`` and ``qzeros`` [8·Wz, N],
  where the "zeros" are the float ``-(s·z)`` rounded to the scale dtype.
* Marlin (AutoAWQ, symmetric only): ``qweight`` int32 [K/16, 2N] in 16x16 tiles with Marlin's fixed in-tile order;
  ``scales`` [ng, N] permuted per 64 (or per 32 with one group); zero point implicitly 8 (zero mode "none").

AWQ zeros are stored as they are (no GPTQ ±1), so GEMM/GEMV layers read as zero mode "int". For the float
``-(s·z)`` form we recover the integer z only when re-rounding ``-(s·z)`` reproduces every stored bit; otherwise the
layer keeps the stored value as a float minimum (zero mode "float": w = s·q + m), which is exactly the peer's own
dequantization ``q·scale + qzeros``. Pickled ``.pt`` dumps are opened only with ``torch.load(weights_only=True)``.

Writing: GEMM (default), GEMV, GEMVFast or Marlin. AWQ is 4-bit, without act-order, one group size per model.
Symmetric layers go into GEMM/GEMV/GEMVFast with explicit zeros 2^(bits-1) = 8 (lossless; they read back as zero
mode "int"); float minima fit only GEMVFast. Anything else is refused before a byte is written.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..store.atomic import AtomicFolder, check_output
from ..core.canonical import CanonicalLayer
from ..store.checkpoint import parse_size
from ..core.dtypes import FLOAT_DTYPES, from_float32, to_float32
from ..errors import BadInputError, UnsupportedError
from ..store.folder import brief, copy_side_files, is_json_int, read_json as _read_json, side_files, write_json
from ..store.shards import ShardWriter
from ..store import TensorStore, open_tensors
from ..store.names import SIDE_FILES
from ..store.tensors import pt_files
from ._bitpack import STREAM_BITS
from .base import PICKLE_FILES, SAFETENSORS_FILES, WAY_OUT, Capabilities, Format, Source, TensorData

__all__ = [
    "AWQFormat", "AWQSource", "open_store",
    "AWQ_ORDER", "AWQ_REVERSE_ORDER", "zeros_width",
    "unpack_gemm", "pack_gemm", "unpack_gemv", "pack_gemv", "unpack_gemv_fast", "pack_gemv_fast",
]

#: nibble i of a GEMM word holds column 8c + AWQ_ORDER[i]; column j lives in nibble AWQ_REVERSE_ORDER[j]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
VERSIONS = ("gemm", "gemv", "gemv_fast", "marlin")
_QSUFFIXES = ("qweight", "qzeros", "scales", "scaled_zeros", "bias")


def open_store(path: Path) -> TensorStore:
    """The tensors of ``path``: a .safetensors/.pt file, or a folder holding safetensors or one .pt dump."""
    path = Path(path)
    if not path.exists():
        raise BadInputError("does not exist", file=str(path))
    return open_tensors(path, pickles="one")



# ---------------------------------------------------------------------------------------------
# bit layouts (numpy reference; each pack_* is the exact inverse of its unpack_*)
# ---------------------------------------------------------------------------------------------
_SHIFTS8 = np.arange(8, dtype=np.uint32) * 4


def _nibbles(words: np.ndarray) -> np.ndarray:
    """uint32 words [..., W] -> nibbles [..., W, 8], LSB first."""
    return ((words.astype(np.uint32, copy=False)[..., None] >> _SHIFTS8) & 0xF).astype(np.uint8)


def _words(nibbles: np.ndarray) -> np.ndarray:
    """nibbles [..., W, 8] -> int32 words [..., W] (nibble i at bits 4i..4i+3)."""
    acc = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        acc |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return acc.view(np.int32)


def unpack_gemm(words: np.ndarray) -> np.ndarray:
    """GEMM int32 [R, C/8] packed along columns in AWQ order -> uint8 [R, C]."""
    nib = _nibbles(words.view(np.uint32))
    return np.ascontiguousarray(nib[..., list(AWQ_REVERSE_ORDER)]).reshape(words.shape[0], -1)


def pack_gemm(values: np.ndarray) -> np.ndarray:
    """uint8 [R, C] (C % 8 == 0) -> GEMM int32 [R, C/8]: nibble i of word c holds column 8c + AWQ_ORDER[i]."""
    r, c = values.shape
    grouped = values.reshape(r, c // 8, 8)
    return _words(grouped[..., list(AWQ_ORDER)])


def unpack_gemv(words: np.ndarray) -> np.ndarray:
    """GEMV int32 [R, C/8], natural nibble order -> uint8 [R, C]."""
    return _nibbles(words.view(np.uint32)).reshape(words.shape[0], -1)


def pack_gemv(values: np.ndarray) -> np.ndarray:
    r, c = values.shape
    return _words(values.reshape(r, c // 8, 8))


def _gemv_fast_index(n: int, k: int) -> np.ndarray:
    """[N/4, K, 4]: flat index into codes [N, K] of nibble j of int16 word [r, c] (the TinyChat 2.0 packer's map)."""
    idx = np.arange(n * k, dtype=np.int64).reshape(n, k // 32, 4, 4, 2)
    idx = idx.transpose(0, 1, 3, 2, 4).reshape(n, k // 32, 4, 4, 2)  # 32-chunk: (4,4,2) -> (b,a,c)
    idx = idx.transpose(0, 1, 2, 4, 3).reshape(n, k)                   # each 8: [0,2,4,6,1,3,5,7]
    idx = idx.reshape(n // 4, 4, k // 64, 64).transpose(0, 2, 1, 3)    # interleave 4 rows, stride 64
    return idx.reshape(n // 4, k // 64, 64, 4).reshape(n // 4, k, 4)


def unpack_gemv_fast(words: np.ndarray) -> np.ndarray:
    """GEMVFast int16 [N/4, K] -> uint8 codes [N, K]."""
    r, k = words.shape
    n = r * 4
    if k % 64:
        raise ValueError("GEMVFast needs K % 64 == 0")
    w = words.view(np.uint16).astype(np.uint32)
    nib = np.stack([(w >> (4 * j)) & 0xF for j in range(4)], axis=-1).astype(np.uint8)
    out = np.empty(n * k, dtype=np.uint8)
    out[_gemv_fast_index(n, k).ravel()] = nib.ravel()
    return out.reshape(n, k)


def pack_gemv_fast(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [N, K] (N % 4 == 0, K % 64 == 0) -> GEMVFast int16 [N/4, K]."""
    n, k = codes.shape
    nib = codes.ravel()[_gemv_fast_index(n, k)].astype(np.uint16)
    word = nib[..., 0] | (nib[..., 1] << 4) | (nib[..., 2] << 8) | (nib[..., 3] << 12)
    return word.astype(np.uint16).view(np.int16)


def zeros_width(in_features: int, group_size: int) -> int | None:
    """AutoAWQ ``calculate_zeros_width``: words of 8 groups, padded per group size; None where AutoAWQ refuses."""
    if group_size >= 128:
        mult = 1
    elif group_size == 64:
        mult = 2
    elif group_size == 32:
        mult = 4
    else:
        return None
    base = -(-(in_features // group_size) // 8)
    return -(-base // mult) * mult


def _marlin_perms() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Marlin's fixed orders: position j of each 1024-code chunk holds code ``perm[j]`` of the 16x16-tiled
    matrix (mma fragment order, then [0,2,4,6,1,3,5,7] within each 8); scales per 64 (grouped) or per 32
    (one group) are taken in ``scale_perm`` / ``scale_perm_single`` order."""
    perm = []
    for i in range(32):
        col = i // 4
        rows = (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)
        base = [16 * r + col + 8 * blk for blk in (0, 1) for r in rows]
        perm += [b + 256 * j for j in range(4) for b in base]
    perm_arr = np.array(perm, dtype=np.int64).reshape(-1, 8)[:, list(AWQ_ORDER)].ravel()
    scale_perm = np.array([i + 8 * j for i in range(8) for j in range(8)], dtype=np.int64)
    single = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)], dtype=np.int64)
    return perm_arr, scale_perm, single


_MARLIN_PERM, _MARLIN_SCALE_PERM, _MARLIN_SCALE_PERM_SINGLE = _marlin_perms()


def unpack_marlin(qweight: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoAWQ Marlin int32 [K/16, 2N] + permuted scales [ng, N] -> codes uint8 [N, K], scales [N, ng]."""
    k16, w = qweight.shape
    ng, n = scales.shape
    k = 16 * k16
    res = _nibbles(qweight.view(np.uint32)).reshape(k16, w * 8)
    chunks = res.reshape(-1, _MARLIN_PERM.size)
    orig = np.empty_like(chunks)
    orig[:, _MARLIN_PERM] = chunks
    codes_kn = orig.reshape(k16, n // 16, 16, 16).transpose(0, 2, 1, 3).reshape(k, n)
    sp = _MARLIN_SCALE_PERM if ng > 1 else _MARLIN_SCALE_PERM_SINGLE
    sc = scales.reshape(-1, sp.size)
    s_orig = np.empty_like(sc)
    s_orig[:, sp] = sc
    return np.ascontiguousarray(codes_kn.T), np.ascontiguousarray(s_orig.reshape(ng, n).T)


def pack_marlin(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """codes uint8 [N, K], scales [N, ng] -> Marlin qweight int32 [K/16, 2N] and permuted scales [ng, N]."""
    n, k = codes.shape
    ng = scales.shape[1]
    tiled = codes.T.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, n * 16)
    res = tiled.reshape(-1, _MARLIN_PERM.size)[:, _MARLIN_PERM].reshape(k // 16, n * 16)
    sp = _MARLIN_SCALE_PERM if ng > 1 else _MARLIN_SCALE_PERM_SINGLE
    s = np.ascontiguousarray(scales.T).reshape(-1, sp.size)[:, sp].reshape(ng, n)
    return _words(res.reshape(k // 16, n * 2, 8)), np.ascontiguousarray(s)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AWQConfig:
    """An AWQ checkpoint's quantization settings, parsed once before any tensor is read: AutoAWQ 0.1
    (``w_bit``, ``q_group_size``) and >= 0.2 / transformers (``bits``, ``group_size``, ``version`` or ``format``),
    from config.json's quantization_config or quant_config.json. None fields: not stated (llm-awq dumps)."""

    bits: int | None = None
    group_size: int | None = None
    #: the kernel layout the config names ("gemm", "gemv", "gemv_fast", "marlin"): a hint, the tensors decide
    version: str | None = None
    zero_point: bool = True
    modules_to_not_convert: tuple[str, ...] | None = None
    #: the file the settings came from (None: no settings)
    file: str | None = None

    @classmethod
    def parse(cls, qc: dict[str, Any], file: str) -> "AWQConfig":
        bits = qc.get("bits", qc.get("w_bit"))
        gs = qc.get("group_size", qc.get("q_group_size"))
        version = qc.get("version", qc.get("format"))
        # (JSON writers emit real integers and booleans: "4", 128.5, Infinity or "false" is a damaged config, not a
        # value to coerce)
        for key, value in (("bits", bits), ("group_size", gs)):
            if value is not None and not is_json_int(value):
                raise BadInputError(f"{key} must be an integer, got {brief(value)}", file=file)
        if gs is not None and gs != -1 and gs < 1:
            raise BadInputError(f"group_size must be positive or -1, got {gs}", file=file)
        if version is not None and not isinstance(version, str):
            raise BadInputError(f"version must be a string, got {brief(version)}", file=file)
        zero_point = qc.get("zero_point", True)
        if not isinstance(zero_point, bool):
            raise BadInputError(f"zero_point must be true or false, got {brief(zero_point)}", file=file)
        not_converted = qc.get("modules_to_not_convert")
        if not_converted is not None and (not isinstance(not_converted, list)
                                          or not all(isinstance(m, str) for m in not_converted)):
            raise BadInputError(f"modules_to_not_convert must be a list of names, got {brief(not_converted)}",
                                file=file)
        return cls(bits=bits, group_size=gs, version=None if version is None else version.lower().replace("-", "_"),
                   zero_point=zero_point,
                   modules_to_not_convert=None if not_converted is None else tuple(not_converted), file=file)


def _awq_settings(folder: Path | None) -> tuple[dict[str, Any], AWQConfig]:
    """(config.json without quantization_config, the AWQ settings)."""
    config: dict[str, Any] = {}
    if folder is None:
        return config, AWQConfig()
    cpath = folder / "config.json"
    if cpath.is_file():
        doc = _read_json(cpath)
        if not isinstance(doc, dict):
            raise BadInputError("config.json is not a JSON object", file=str(cpath))
        config = {k: v for k, v in doc.items() if k != "quantization_config"}
        qc = doc.get("quantization_config")
        if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() in ("awq", "llm-awq"):
            return config, AWQConfig.parse(qc, str(cpath))
    qpath = folder / "quant_config.json"
    if qpath.is_file():
        doc = _read_json(qpath)
        if isinstance(doc, dict):
            return config, AWQConfig.parse(doc, str(qpath))
    return config, AWQConfig()


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def _classify(store: TensorStore, prefix: str, hint: str | None) -> str:
    """gemm | gemv | gemv_fast | marlin, from the tensors' dtypes and shapes (the config's version is a hint)."""
    qw = f"{prefix}.qweight"
    dt, shp = store.info(qw)
    has = lambda s: f"{prefix}.{s}" in store  # noqa: E731
    if has("scaled_zeros") or dt == "int16":
        return "gemv_fast"
    if dt != "int32":
        raise BadInputError(f"qweight must be int32 (GEMM/GEMV) or int16 (GEMVFast), got {dt}",
                            file=store.file_of(qw), tensor=qw)
    if not has("qzeros"):
        if has("scales"):
            _d, ss = store.info(f"{prefix}.scales")
            if hint == "marlin" or (len(shp) == 2 and len(ss) == 2 and shp[1] == 2 * ss[1]):
                return "marlin"
            raise UnsupportedError("symmetric AWQ without qzeros is not supported (only Marlin is symmetric in "
                                   "AutoAWQ)", file=store.file_of(qw), tensor=qw)
        raise BadInputError("quantized layer has qweight but no qzeros", file=store.file_of(qw), tensor=qw)
    if not has("scales"):
        raise BadInputError("quantized layer has no scales", file=store.file_of(qw), tensor=f"{prefix}.scales")
    _d, ss = store.info(f"{prefix}.scales")
    _d, zs = store.info(f"{prefix}.qzeros")
    if len(shp) != 2 or len(ss) != 2 or len(zs) != 2:
        raise BadInputError(f"qweight/qzeros/scales must be 2-D, got {list(shp)}, {list(zs)}, {list(ss)}",
                            file=store.file_of(qw), tensor=qw)
    gemm = ss[1] == 8 * shp[1] and zs == (ss[0], shp[1])
    gemv = shp[0] == ss[0] == zs[0] and ss[1] == 8 * zs[1]
    if gemm and gemv:
        return hint if hint in ("gemm", "gemv") else "gemm"
    if gemm:
        return "gemm"
    if gemv:
        return "gemv"
    raise BadInputError(f"tensor shapes fit no AWQ layout: qweight {list(shp)}, qzeros {list(zs)}, scales {list(ss)} "
                        "(GEMM: [in, out/8], [groups, out/8], [groups, out]; GEMV: [out, in/8], [out, W], [out, 8W])",
                        file=store.file_of(qw), tensor=qw)


class AWQSource(Source):
    """An AutoAWQ folder (safetensors) or an llm-awq ``.pt`` dump, read one layer at a time."""

    def __init__(self, path: Path, *, group_size: int | None = None):
        self.path = Path(path)
        folder = self.path if self.path.is_dir() else self.path.parent
        self.folder = folder
        self.config, self.cfg = _awq_settings(folder)
        self.store = open_store(self.path)
        label = self.cfg.file or str(self.path)
        if self.cfg.bits not in (None, 4):
            self.store.close()
            raise UnsupportedError(f"AWQ with {self.cfg.bits}-bit weights is not supported (AWQ is 4-bit)",
                                   file=label)
        self.group_hint = group_size if group_size is not None else self.cfg.group_size
        names = self.store.names()
        present = set(names)
        self._layers = [n[: -len(".qweight")] for n in names if n.endswith(".qweight")]
        if not self._layers:
            self.store.close()
            raise BadInputError("no quantized layers (no *.qweight tensors)", file=str(self.path))
        owned = {f"{p}.{s}" for p in self._layers for s in _QSUFFIXES}
        self._passthrough = [n for n in names if n not in owned]
        self._kinds: dict[str, str] = {}
        hint = self.cfg.version
        for p in self._layers:
            try:
                kind = _classify(self.store, p, hint)
            except (BadInputError, UnsupportedError):
                self.store.close()
                raise
            self._kinds[p] = kind
        kinds = sorted(set(self._kinds.values()))
        is_pt = self.store.is_pickle
        version = "+".join(kinds)
        if is_pt:
            version = {"gemm": "llm-awq-v1-2023", "gemv": "llm-awq-gemv-2023",
                       "gemv_fast": "llm-awq-v2-2024"}.get(version, f"llm-awq-{version}")
        self.info: dict[str, Any] = {"format": "awq", "version": version, "bits": 4, "notes": [], "quirks": []}
        if hint and hint not in kinds and hint not in ("marlin",):
            self.info["notes"].append(f"config version {hint!r} contradicts the tensors ({version}); "
                                      "read as the tensors say")
        if any("scaled_zeros" in n for n in present):
            self.info["quirks"].append("llm-awq v2 zero tensor named scaled_zeros")
        self._float_layers: list[str] = []
        self._int_from_float: list[str] = []

    # -- Source interface ------------------------------------------------------------------
    def layer_names(self) -> list[str]:
        return list(self._layers)

    def passthrough_names(self) -> list[str]:
        return list(self._passthrough)

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        return tuple(self.store.info(name)[1])

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        try:
            dt, shape = self.store.info(name)  # safetensors header or loaded pickle: no data read
        except KeyError:  # a pickled dtype no reader takes (fp8, complex): not a packed weight
            return None
        return dt, tuple(shape)

    def read_tensor(self, name: str) -> TensorData:
        dt, _shape = self.store.info(name)
        return TensorData(self.store.read_copy(name), dt)

    def side_files(self) -> list[Path]:
        return side_files(self.folder, SIDE_FILES)

    def close(self) -> None:
        self.store.close()

    def read_layer(self, name: str) -> CanonicalLayer:
        if name not in self._kinds:
            raise BadInputError("not a quantized layer of this checkpoint", file=str(self.path), tensor=name)
        kind = self._kinds[name]
        reader = {"gemm": self._read_gemm, "gemv": self._read_gemv, "gemv_fast": self._read_gemv_fast,
                  "marlin": self._read_marlin}[kind]
        layer = reader(name)
        layer.name = name
        bias = f"{name}.bias"
        if bias in self.store:
            b = self.store.read_copy(bias)
            bdt, _ = self.store.info(bias)
            if bdt not in FLOAT_DTYPES:
                raise BadInputError(f"bias must be a float tensor, got {bdt}", file=self.store.file_of(bias),
                                    tensor=bias)
            layer.bias, layer.bias_dtype = np.array(b), bdt
        try:
            return layer.validate()
        except BadInputError as exc:
            raise BadInputError(exc.message, file=self.store.file_of(f"{name}.qweight"), tensor=exc.tensor) from None

    # -- helpers ---------------------------------------------------------------------------
    def _tensor(self, name: str, dtypes: Iterable[str], ndim: int = 2) -> tuple[np.ndarray, str]:
        if name not in self.store:
            raise BadInputError("tensor is missing", file=str(self.path), tensor=name)
        dt, shape = self.store.info(name)
        if dt not in dtypes:
            raise BadInputError(f"dtype {dt} is not one of {', '.join(dtypes)}", file=self.store.file_of(name),
                                tensor=name)
        if len(shape) != ndim:
            raise BadInputError(f"expected a {ndim}-D tensor, got shape {list(shape)}", file=self.store.file_of(name),
                                tensor=name)
        if 0 in shape:  # the unpackers' shapes are derived from the row count: an empty layer is no layer
            raise BadInputError(f"empty tensor of shape {list(shape)}: a quantized layer has rows and columns",
                                file=self.store.file_of(name), tensor=name)
        return self.store.read_copy(name), dt

    def _bad(self, name: str, msg: str) -> BadInputError:
        return BadInputError(msg, file=self.store.file_of(name), tensor=name)

    def _check_padding(self, name: str, arr: np.ndarray, dtype: str, used: tuple[slice, slice], ng: int) -> None:
        """The groups past the last, which AutoAWQ and llm-awq write as zeros and no reader uses: a NaN or an
        infinity there is damage, refused rather than dropped unseen with the padding."""
        bad = ~np.isfinite(to_float32(arr, dtype))
        bad[used] = False
        if bad.any():
            r, c = (int(i) for i in np.argwhere(bad)[0])
            raise self._bad(name, f"[{r}, {c}] is {float(to_float32(arr[r:r + 1, c:c + 1], dtype)[0, 0])} in the "
                            f"padding past the layer's {ng} groups, which a sound checkpoint fills with zeros: damaged")

    def _group_size_unpadded(self, prefix: str, k: int, ng: int) -> int:
        g = self.group_hint
        if g is not None:
            expect = 1 if g in (-1, 0) else -(-k // g)
            if ng != expect:
                raise self._bad(f"{prefix}.scales", f"{ng} groups stored, but group_size {g} with in_features {k} "
                                f"needs {expect}")
            return -1 if g in (-1, 0) else g
        if k % ng:
            raise self._bad(f"{prefix}.scales", f"{ng} groups do not divide in_features {k}")
        return k // ng

    def _group_size_padded(self, prefix: str, k: int, width: int) -> tuple[int, int]:
        """(group_size, n_groups) of a GEMV/GEMVFast layer whose scales are padded to ``width`` columns."""
        tname = f"{prefix}.scales"
        g = self.group_hint
        if g is not None:
            geff = k if g in (-1, 0) else g
            wz = zeros_width(k, geff)
            if wz is None or 8 * wz != width:
                raise self._bad(tname, f"padded width {width} does not match group_size {g} for in_features {k} "
                                f"(expected {None if wz is None else 8 * wz})")
            return (-1 if g in (-1, 0) else g), -(-k // geff)
        # no config (bare llm-awq dump): the group sizes AutoAWQ/llm-awq can pad to this width; 128 first (default)
        cands = [gs for gs in (128, 64, 32, 256, 512, 1024, 2048, 4096, 8192)
                 if gs <= k and k % gs == 0 and (zeros_width(k, gs) or 0) * 8 == width]
        if not cands:
            raise self._bad(tname, f"no group size gives padded width {width} for in_features {k}; pass group_size")
        self.info["notes"].append(f"group size {cands[0]} inferred from the padded scales of {prefix} "
                                  "(no config; llm-awq default 128 preferred)")
        self.group_hint = cands[0]
        return cands[0], k // cands[0]

    def _read_gemm(self, p: str) -> CanonicalLayer:
        qw, _ = self._tensor(f"{p}.qweight", ("int32",))
        qz, _ = self._tensor(f"{p}.qzeros", ("int32",))
        sc, sdt = self._tensor(f"{p}.scales", tuple(FLOAT_DTYPES))
        k, n8 = qw.shape
        ng, n = sc.shape
        if n != 8 * n8 or qz.shape != (ng, n8):
            raise self._bad(f"{p}.qweight", f"GEMM shapes disagree: qweight {list(qw.shape)}, qzeros {list(qz.shape)}, "
                            f"scales {list(sc.shape)}")
        gs = self._group_size_unpadded(p, k, ng)
        codes = np.ascontiguousarray(unpack_gemm(qw).T)
        zeros = np.ascontiguousarray(unpack_gemm(qz).T)
        return CanonicalLayer(codes=codes, scales=np.ascontiguousarray(sc.T), bits=4, group_size=gs,
                              zero_mode="int", zeros=zeros, scale_dtype=sdt,
                              source={"format": "awq", "version": "gemm"})

    def _read_gemv(self, p: str) -> CanonicalLayer:
        qw, _ = self._tensor(f"{p}.qweight", ("int32",))
        qz, _ = self._tensor(f"{p}.qzeros", ("int32",))
        sc, sdt = self._tensor(f"{p}.scales", tuple(FLOAT_DTYPES))
        n, k8 = qw.shape
        k = 8 * k8
        if sc.shape[0] != n or qz.shape[0] != n or sc.shape[1] != 8 * qz.shape[1]:
            raise self._bad(f"{p}.qweight", f"GEMV shapes disagree: qweight {list(qw.shape)}, qzeros {list(qz.shape)}, "
                            f"scales {list(sc.shape)}")
        gs, ng = self._group_size_padded(p, k, sc.shape[1])
        self._check_padding(f"{p}.scales", sc, sdt, (slice(None), slice(0, ng)), ng)
        codes = unpack_gemv(qw)
        zeros = np.ascontiguousarray(unpack_gemv(qz)[:, :ng])
        return CanonicalLayer(codes=codes, scales=np.ascontiguousarray(sc[:, :ng]), bits=4, group_size=gs,
                              zero_mode="int", zeros=zeros, scale_dtype=sdt,
                              source={"format": "awq", "version": "gemv"})

    def _read_marlin(self, p: str) -> CanonicalLayer:
        qw, _ = self._tensor(f"{p}.qweight", ("int32",))
        sc, sdt = self._tensor(f"{p}.scales", tuple(FLOAT_DTYPES))
        k16, w = qw.shape
        ng, n = sc.shape
        k = 16 * k16
        if w != 2 * n or n % 16 or (k * n) % _MARLIN_PERM.size or (ng * n) % (64 if ng > 1 else 32):
            raise self._bad(f"{p}.qweight", f"Marlin shapes disagree: qweight {list(qw.shape)} (needs [in/16, 2*out]),"
                            f" scales {list(sc.shape)}")
        gs = self._group_size_unpadded(p, k, ng)
        codes, scales = unpack_marlin(qw, sc)
        return CanonicalLayer(codes=codes, scales=scales, bits=4, group_size=gs, zero_mode="none",
                              scale_dtype=sdt, source={"format": "awq", "version": "marlin"})

    def _read_gemv_fast(self, p: str) -> CanonicalLayer:
        zname = f"{p}.scaled_zeros" if f"{p}.scaled_zeros" in self.store else f"{p}.qzeros"
        qw, _ = self._tensor(f"{p}.qweight", ("int16",))
        sc, sdt = self._tensor(f"{p}.scales", tuple(FLOAT_DTYPES))
        qz, zdt = self._tensor(zname, tuple(FLOAT_DTYPES))
        r, k = qw.shape
        n = 4 * r
        if k % 64:
            raise self._bad(f"{p}.qweight", f"GEMVFast qweight [{r}, {k}] needs in_features % 64 == 0")
        if sc.shape[1] != n or qz.shape != sc.shape:
            raise self._bad(f"{p}.scales", f"GEMVFast shapes disagree: qweight {list(qw.shape)} (out {n}), "
                            f"scales {list(sc.shape)}, {zname.rsplit('.', 1)[1]} {list(qz.shape)}")
        if zdt != sdt:
            raise self._bad(zname, f"scaled zeros are {zdt} but scales are {sdt}")
        gs, ng = self._group_size_padded(p, k, sc.shape[0])
        self._check_padding(f"{p}.scales", sc, sdt, (slice(0, ng), slice(None)), ng)
        self._check_padding(zname, qz, zdt, (slice(0, ng), slice(None)), ng)
        codes = unpack_gemv_fast(qw)
        scales = np.ascontiguousarray(sc[:ng].T)
        mins = np.ascontiguousarray(qz[:ng].T)
        zeros = int_zeros_from_scaled(scales, mins, sdt, bits=4)
        src = {"format": "awq", "version": "gemv_fast" if zname.endswith("qzeros") else "llm-awq-v2"}
        if zeros is not None:
            src["notes"] = ["zeros stored as -(s*z); integer zeros recovered, re-rounding reproduces every bit"]
            if not self._int_from_float:
                self.info["notes"].append("zeros stored as -(s*z): integer zeros recovered exactly (re-rounding "
                                          "-(s*z) to the scale dtype reproduces every stored bit)")
            if p not in self._int_from_float:
                self._int_from_float.append(p)
            return CanonicalLayer(codes=codes, scales=scales, bits=4, group_size=gs, zero_mode="int", zeros=zeros,
                                  scale_dtype=sdt, source=src)
        src["notes"] = ["zeros stored as -(s*z) are not an exact integer multiple; kept as float minima"]
        if p not in self._float_layers:
            self._float_layers.append(p)
            self.info["notes"].append(f"{p}: scaled zeros kept as float minima (w = s*q + m), not integers")
        return CanonicalLayer(codes=codes, scales=scales, bits=4, group_size=gs, zero_mode="float", zeros=mins,
                              scale_dtype=sdt, source=src)


def scaled_zeros(scales: np.ndarray, zeros: np.ndarray, dtype: str) -> np.ndarray:
    """-(s·z) rounded to the scale dtype: the GEMVFast / llm-awq v2 zero tensor (fp32 product is exact)."""
    prod = to_float32(scales, dtype) * zeros.astype(np.float32)
    return from_float32(-prod, dtype)


def int_zeros_from_scaled(scales: np.ndarray, mins: np.ndarray, dtype: str, bits: int = 4) -> np.ndarray | None:
    """Integer zeros z with -(s·z) rounding to exactly the stored bits, or None if any group has none."""
    s = to_float32(scales, dtype).astype(np.float64)
    m = to_float32(mins, dtype).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(s != 0, np.rint(-m / np.where(s != 0, s, 1.0)), 0.0)
    if not np.all(np.isfinite(z)) or z.min(initial=0) < 0 or z.max(initial=0) > (1 << bits) - 1:
        return None
    zi = z.astype(np.uint8)
    again = scaled_zeros(scales, zi, dtype)
    if not np.array_equal(np.asarray(again).view(np.uint8), np.ascontiguousarray(mins).view(np.uint8)):
        return None
    return zi


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
class AWQCapabilities(Capabilities):
    """4-bit, int or implicit-symmetric zeros 0..15, no act-order, group constraints of the chosen kernel."""

    def __init__(self, version: str = "gemm"):
        super().__init__(bits=(4,), zero_modes=("none", "int", "float") if version == "gemv_fast" else ("none", "int"),
                         act_order=False, scale_dtypes=("float16", "bfloat16", "float32"))
        self.version = version

    def way_out(self, layer: CanonicalLayer) -> str:
        """GPTQ holds what AWQ refuses only for integer zeros and GPTQ's bit widths; w4pack holds everything."""
        if layer.zero_mode == "float":
            return ("of AWQ's layouts only GEMVFast stores float minima, and only the Python API writes it: "
                    f"convert(..., to='awq', version='gemv_fast'); from the command line: {WAY_OUT}")
        if layer.bits in STREAM_BITS:
            return f"--to gptq or {WAY_OUT}"
        return WAY_OUT

    def check(self, layer: CanonicalLayer) -> str | None:
        reason = super().check(layer)
        if reason:
            return reason
        n, k, g = layer.out_features, layer.in_features, layer.group_size
        geff = k if g == -1 else g
        if layer.name.rsplit(".", 1)[-1] in ("lm_head", "embed_out", "output"):
            return f"a quantized output head (AWQ loaders keep it in fp16; way out: {self.way_out(layer)})"
        if layer.zero_mode == "int" and int(layer.zeros.max()) > 15:
            return "a zero point of 16 (AWQ stores 4-bit zeros; way out: --to gptq-v2 or --to w4pack)"
        if layer.scale_dtype == "float32" and not _fp16_exact(layer.scales):
            return "float32 scales that fp16 cannot hold exactly (way out: --to w4pack or --to toml)"
        if layer.zero_mode == "float" and layer.scale_dtype == "float32" and not _fp16_exact(layer.zeros):
            return "float32 minima that fp16 cannot hold exactly (way out: --to w4pack)"
        if k % geff:
            return (f"in_features {k} not a multiple of group size {g} (AWQ has no short last group; "
                    f"way out: {self.way_out(layer)})")
        if self.version == "marlin":
            if layer.zero_mode == "int" and np.any(layer.zeros != 8):
                return "asymmetric zeros (Marlin is symmetric: zero 8 only; way out: version gemm)"
            if n % 64 or k % 16:
                return f"shape [{n}, {k}] (Marlin needs out % 64 == 0 and in % 16 == 0; way out: version gemm)"
        if self.version == "gemm" and n % 8:
            return f"out_features {n} not a multiple of 8 (GEMM packs 8 outputs per word; way out: {WAY_OUT})"
        if self.version in ("gemv", "gemv_fast"):
            if zeros_width(k, geff) is None:
                return f"group size {g} (GEMV kernels take 32, 64 or >= 128; way out: version gemm)"
            if self.version == "gemv" and k % 8:
                return f"in_features {k} not a multiple of 8 (GEMV packs 8 inputs per word; way out: version gemm)"
            if self.version == "gemv_fast" and (n % 4 or k % 64):
                return f"shape [{n}, {k}] (GEMVFast needs out % 4 == 0 and in % 64 == 0; way out: version gemm)"
        return None


def _fp16_exact(arr: np.ndarray) -> bool:
    a = np.asarray(arr, dtype=np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def awq_tensors(layer: CanonicalLayer, version: str = "gemm") -> dict[str, tuple[np.ndarray, str | None]]:
    """The peer's tensors (suffix -> (array, dtype name)) for one canonical layer; the layer must pass the check."""
    n, k = layer.codes.shape
    g = layer.group_size
    geff = k if g == -1 else g
    ng = layer.num_groups
    sdt = layer.scale_dtype
    scales = layer.scales
    if sdt == "float32":  # checked exact beforehand
        scales, sdt = layer.scales.astype(np.float16), "float16"
    if layer.zero_mode == "none":
        zeros = np.full((n, ng), 1 << (layer.bits - 1), dtype=np.uint8)
    elif layer.zero_mode == "int":
        zeros = layer.zeros.astype(np.uint8)
    else:
        zeros = None
    out: dict[str, tuple[np.ndarray, str | None]] = {}
    if version == "gemm":
        out["qweight"] = (pack_gemm(np.ascontiguousarray(layer.codes.T)), None)
        out["qzeros"] = (pack_gemm(np.ascontiguousarray(zeros.T)), None)
        out["scales"] = (np.ascontiguousarray(scales.T), sdt)
    elif version == "gemv":
        wz = zeros_width(k, geff)
        zp = np.zeros((n, 8 * wz), dtype=np.uint8)
        zp[:, :ng] = zeros
        sp = np.zeros((n, 8 * wz), dtype=scales.dtype)
        sp[:, :ng] = scales
        out["qweight"] = (pack_gemv(layer.codes), None)
        out["qzeros"] = (pack_gemv(zp), None)
        out["scales"] = (sp, sdt)
    elif version == "gemv_fast":
        wz = zeros_width(k, geff)
        if zeros is not None:
            mins = scaled_zeros(scales, zeros, sdt)
        else:
            mins = layer.zeros if layer.scale_dtype != "float32" else layer.zeros.astype(np.float16)
        sp = np.zeros((8 * wz, n), dtype=scales.dtype)
        sp[:ng] = scales.T
        mp = np.zeros((8 * wz, n), dtype=scales.dtype)
        mp[:ng] = mins.T
        out["qweight"] = (pack_gemv_fast(layer.codes), None)
        out["scales"] = (sp, sdt)
        out["qzeros"] = (mp, sdt)
    elif version == "marlin":
        qweight, mscales = pack_marlin(layer.codes, scales)
        out["qweight"] = (qweight, None)
        out["scales"] = (mscales, sdt)
    else:
        raise UnsupportedError(f"unknown AWQ version {version!r} (choose one of {', '.join(VERSIONS)})")
    if layer.bias is not None:
        out["bias"] = (layer.bias, layer.bias_dtype)
    return out


def _not_converted(source: Source) -> list[str] | None:
    """Unquantized 2-D linear weights that AWQ loaders must leave alone (embeddings and lm_head need no entry)."""
    mods = []
    quantized = set(source.layer_names())
    for t in source.passthrough_names():
        if not t.endswith(".weight"):
            continue
        mod = t[: -len(".weight")]
        leaf = mod.rsplit(".", 1)[-1]
        if mod in quantized or "embed" in leaf or leaf in ("lm_head", "wte", "wpe", "output") or "norm" in leaf:
            continue
        if re.search(r"(proj|fc\d*|dense|linear|attn|mlp|gate|experts?)", leaf):
            mods.append(mod)
    return mods or None


class AWQFormat(Format):
    name = "awq"
    write_options = frozenset({"version"})
    read_options = frozenset({"group_size"})
    description = "AWQ: AutoAWQ GEMM/GEMV/GEMVFast/Marlin safetensors, llm-awq .pt dumps (2023 and 2024 TinyChat)"
    capabilities = AWQCapabilities("gemm")
    hub_files = (SAFETENSORS_FILES, PICKLE_FILES)

    @classmethod
    def detect(cls, path: Path) -> bool:
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        if path.is_dir():
            cpath = path / "config.json"
            if cpath.is_file():
                try:
                    qc = _read_json(cpath).get("quantization_config") or {}
                except (BadInputError, AttributeError):
                    qc = {}
                method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
                if method in ("awq", "llm-awq"):
                    return True
                if method:
                    return False
            qpath = path / "quant_config.json"
            if qpath.is_file():
                doc = _read_json(qpath)
                if isinstance(doc, dict) and ("w_bit" in doc or "q_group_size" in doc):
                    return True
            if (path / "quantize_config.json").is_file():
                return False
        elif path.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
            return False
        try:
            store = open_store(path)
        except BadInputError:
            if (path.exists() and not path.is_dir() and path.suffix != ".safetensors"
                    or (path.is_dir() and pt_files(folder))):
                raise  # a hostile or broken pickle: say so now rather than "unknown format"
            return False
        try:
            names = store.names()
            prefixes = [n[: -len(".qweight")] for n in names if n.endswith(".qweight")]
            if not prefixes:
                return False
            p = prefixes[0]
            if f"{p}.g_idx" in store:
                return False
            try:
                return _classify(store, p, None) in ("gemm", "gemv", "gemv_fast", "marlin")
            except BadInputError:
                return False
        finally:
            store.close()

    @classmethod
    def open(cls, path: Path, **options: Any) -> Source:
        return AWQSource(Path(path), group_size=options.get("group_size"))

    @classmethod
    def capabilities_for(cls, version: str) -> AWQCapabilities:
        if version not in VERSIONS:
            raise UnsupportedError(f"unknown AWQ version {version!r} (choose one of {', '.join(VERSIONS)})")
        return AWQCapabilities(version)

    own_layer_checks = True

    @classmethod
    def check_writable(cls, source: Source, version: str = "gemm") -> list[str]:
        caps = cls.capabilities_for(version)
        problems = []
        groups: dict[int, str] = {}
        for name in source.layer_names():
            layer = source.read_layer(name)
            reason = caps.check(layer.replace(name=name))
            if reason:
                problems.append(f"{name}: awq ({version}) cannot express {reason}")
            groups.setdefault(layer.group_size, name)
        if len(groups) > 1:
            desc = ", ".join(f"{g} ({n})" for g, n in groups.items())
            problems.append(f"AWQ stores one group size per model, the source mixes {desc} "
                            "(way out: --to gptq or --to w4pack)")
        return problems

    @classmethod
    def write(cls, source: Source, out: Path, *, force: bool = False, version: str = "gemm",
              max_shard_size: int | str = "5GB", show_progress: bool | None = None,
              **options: Any) -> Path:
        """Write ``source`` as an AutoAWQ checkpoint (GEMM by default; ``version`` "gemv", "gemv_fast", "marlin").

        Everything is checked before anything is written. Symmetric layers are written with explicit zeros
        2^(bits-1) = 8, which dequantize identically (read back, they are integer-zero layers).
        """
        from ..progress import Progress

        version = str(version).lower()
        check_output(Path(out), force)  # (an existing output first, as every writer: --dry-run predicts this order)
        problems = cls.check_writable(source, version)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise UnsupportedError(f"cannot write AWQ: {problems[0]}{more}", file=str(source.path))
        names = source.layer_names()
        passthrough = source.passthrough_names()
        group_size = None
        max_bytes = parse_size(max_shard_size)
        with AtomicFolder(out, force=force) as tmp, ShardWriter(tmp, max_bytes) as shards:
            with Progress(len(names) + len(passthrough), "writing awq", enabled=show_progress) as bar:
                for name in names:
                    layer = source.read_layer(name)
                    group_size = layer.group_size
                    for suffix, (arr, dt) in awq_tensors(layer, version).items():
                        shards.add(f"{name}.{suffix}", arr, dt)
                    bar.update()
                for tname in passthrough:
                    t = source.read_tensor(tname)
                    shards.add(tname, t.array, t.dtype)
                    bar.update()
            shards.finish()
            qc = {"quant_method": "awq", "zero_point": version != "marlin", "group_size": group_size if group_size else 128,
                  "bits": 4, "version": version, "modules_to_not_convert": _not_converted(source)}
            config = {k: v for k, v in (source.config or {}).items() if k != "quantization_config"}
            config["quantization_config"] = qc
            write_json(tmp / "config.json", config)
            write_json(tmp / "quant_config.json", {"zero_point": qc["zero_point"], "q_group_size": qc["group_size"],
                                                    "w_bit": 4,
                                                    "version": version.upper() if version != "gemv_fast" else "gemv_fast"})
            copy_side_files(source.side_files(), tmp)
        return Path(out)
