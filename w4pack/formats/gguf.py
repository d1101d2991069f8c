"""GGUF (llama.cpp) reader and writer. The file is parsed by the store's bounds-checked reader
(``store/gguffile.py``) and written by the ``gguf`` package's GGUFWriter into the store's AtomicFile; gguf's
own code also dequantizes the tensor types w4pack does not pack.

Blocks of 32 weights along ``in`` (facts: reference/formats-awq-ct-gguf.md §5):

* Q4_0: ``f16 d; u8 qs[16]``, w = d·(q − 8)        → canonical 4-bit, group 32, zero mode "none"
* Q4_1: ``f16 d; f16 m; u8 qs[16]``, w = d·q + m   → canonical 4-bit, group 32, zero mode "float" (m = the minimum)
* Q8_0: ``f16 d; i8 qs[32]``, w = d·q             → canonical 8-bit, group 32, codes q + 128, zero mode "none"

Byte j of ``qs`` holds element j (low nibble) and element j + 16 (high nibble). K-quants (Q2_K..Q6_K), Q5_0, Q5_1,
IQ4_NL and IQ4_XS linear weights are packed losslessly too (``gguf_quants``) and written back in their own type. A
token embedding of one of these types stays packed as well, as a layer of role "embedding" (looked up at load,
not multiplied; docs/FORMAT.md §5), so it neither widens to float32 nor loses its type on the way back. Every
other tensor type (F32, F16, BF16 pass through; grid-codebook IQ types and the rest are dequantized by gguf's own
code to float32) is carried unquantized and said so in the source notes, one note per tensor type. Names become transformers names, and llama.cpp's rotary row permutation of attn_q /
attn_k is undone, so the folder is a normal transformers checkpoint; config.json comes from the GGUF metadata and
the tokenizer is exported by transformers (optional dependency) from the same file.

Written from a non-GGUF source, the file carries what llama.cpp's own converter (convert_hf_to_gguf.py) writes:
1-D float tensors (norms, biases) as F32, and the tokenizer keys tokenizer.ggml.pre, add_bos_token and
add_space_prefix. A GGUF -> w4pack -> GGUF trip reproduces the source file byte for byte.
"""
from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.canonical import CanonicalLayer
from ..core.dtypes import to_float32
from ..errors import BadInputError, UnsupportedError, W4PackWarning
from ..store.folder import brief, read_json, side_file
from ..store.gguffile import GGUFFile, gguf_module, is_gguf, open_gguf
from ..store.scratch import ScratchFolder, read_text
from ..store.singlefile import AtomicFile
from . import _experts as experts
from . import _hf_names as names
from . import gguf_quants
from .base import WAY_OUT, Capabilities, Format, HubFiles, Source, TensorData

__all__ = ["GGUFFormat", "GGUFMeta", "GGUFSource", "GGUFWarning", "tokenizer_metadata", "decode_q4_0", "decode_q4_1",
           "decode_q8_0", "encode_layer", "rotary_row_permutation", "write_gguf"]

BLOCK = 32


class GGUFWarning(W4PackWarning):
    """Something a written GGUF lacks (e.g. a tokenizer), said once per file."""

#: side file with the GGUF metadata (tokenizer vocabulary, chat template, ...) so that writing GGUF back keeps it
METADATA_NAME = "gguf_metadata.json"
#: what --force may replace at a GGUF output: an earlier GGUF file (or an empty file)
GGUF_MAGIC = (b"GGUF", "GGUF file")
#: keys the writer sets itself
_WRITER_KEYS = {"general.architecture", "general.alignment"}
_Q_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


# ---------------------------------------------------------------------------------------------
# blocks <-> canonical
# ---------------------------------------------------------------------------------------------
def _blocks(raw: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    nb = _Q_BYTES[qtype]
    if k % BLOCK:
        raise BadInputError(f"{qtype} rows need in_features % 32 == 0, got {k}")
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.shape != (n, k // BLOCK * nb):
        raise BadInputError(f"{qtype} data shape {list(raw.shape)} != [{n}, {k // BLOCK * nb}] for a [{n}, {k}] weight")
    return raw.reshape(n, k // BLOCK, nb)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[.., 16] bytes -> [.., 32] codes: byte j = element j (low) | element j+16 (high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").reshape(b.shape[:-1]).astype(np.float16)


def decode_q4_0(raw: np.ndarray, n: int, k: int) -> CanonicalLayer:
    b = _blocks(raw, "Q4_0", n, k)
    return CanonicalLayer(codes=_nibbles(b[..., 2:18]).reshape(n, k), scales=_half(b[..., 0:2]), bits=4,
                          group_size=BLOCK, zero_mode="none", scale_dtype="float16")


def decode_q4_1(raw: np.ndarray, n: int, k: int) -> CanonicalLayer:
    b = _blocks(raw, "Q4_1", n, k)
    return CanonicalLayer(codes=_nibbles(b[..., 4:20]).reshape(n, k), scales=_half(b[..., 0:2]), bits=4,
                          group_size=BLOCK, zero_mode="float", zeros=_half(b[..., 2:4]), scale_dtype="float16")


def decode_q8_0(raw: np.ndarray, n: int, k: int) -> CanonicalLayer:
    b = _blocks(raw, "Q8_0", n, k)
    q = b[..., 2:34].view(np.int8).reshape(n, k)
    codes = (q.astype(np.int16) + 128).astype(np.uint8)
    return CanonicalLayer(codes=codes, scales=_half(b[..., 0:2]), bits=8, group_size=BLOCK, zero_mode="none",
                          scale_dtype="float16")


_DECODERS = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q8_0": decode_q8_0}

def _packable(qtype: str) -> bool:
    """A tensor type that decodes exactly into a canonical layer (here or in gguf_quants)."""
    return qtype in _DECODERS or gguf_quants.is_packable(qtype)


def _source_gguf_type(layer: CanonicalLayer) -> str | None:
    """The gguf_quants type a layer was read from (directly, or recorded in a w4pack manifest's source notes as
    ``gguf_type=...``), or None."""
    return gguf_quants.source_type(layer.source)


def _packs_as_layer(module: str | None, t: Any) -> bool:
    """A 2-D tensor of a packable type at a linear module or the token embedding: it becomes a canonical layer
    (the embedding with role "embedding", so it stays as compact as the source stores it)."""
    return module is not None and len(t.dims) == 2 and _packable(t.type_name) and \
        (names.is_linear(module) or names.is_embedding(module))


def _refusals(f: GGUFFile, hf_of: dict[str, str]) -> list[str]:
    """One line per quantized linear weight that cannot be a canonical layer, naming the tensor and its type."""
    out = []
    for gname, t in f.tensors.items():
        hf = hf_of.get(gname, "")  # stacked experts have per-expert names only
        module = hf[: -len(".weight")] if hf.endswith(".weight") else None
        if module is not None and len(t.dims) == 2 and names.is_linear(module) and \
                t.type_name not in _PLAIN_TYPES and not _packable(t.type_name):
            out.append(f"{gname} ({t.type_name}): not packed, {gguf_quants.why_not_packable(t.type_name)}")
    return out


def _carriage_notes(types: dict[str, str], packed: set[str], hf_of: dict[str, str]) -> list[str]:
    """One note per source tensor type: how its tensors are carried (packed losslessly, passed through as they
    are, or dequantized to float32), so ``inspect`` shows what a conversion does to each type."""
    how: dict[str, Counter[str]] = {}
    for gname, qt in types.items():
        if gname in packed:
            kind = "packed losslessly"
        elif qt in _PLAIN_TYPES:
            kind = "passed through as they are"
        else:
            kind = "dequantized to float32"
        how.setdefault(qt, Counter())[kind] += 1
    return [f"{qt}: " + ", ".join(f"{c} {kind}" for kind, c in sorted(kinds.items()))
            for qt, kinds in sorted(how.items())]


def _as_f16_exact(values: np.ndarray, dtype_name: str) -> np.ndarray | None:
    """The fp16 array equal to ``values`` (stored as dtype_name), or None when some value is not an fp16."""
    if dtype_name == "float16":
        return np.asarray(values, dtype=np.float16)
    f = to_float32(values, dtype_name)
    with np.errstate(over="ignore"):
        h = f.astype(np.float16)
    return h if np.array_equal(h.astype(np.float32), f) else None


def encode_layer(layer: CanonicalLayer) -> tuple[str, np.ndarray]:
    """(GGUF type name, uint8 [N, K/32·bytes]) for a layer GGUF can hold exactly; UnsupportedError otherwise."""
    n, k = layer.out_features, layer.in_features

    def no(why: str) -> UnsupportedError:
        return UnsupportedError(f"GGUF cannot hold this layer exactly: {why} "
                                f"(Q4_0/Q4_1/Q8_0 are blocks of 32 with fp16 scales; way out: {WAY_OUT})",
                                tensor=layer.name or None)

    gs = layer.group_size
    if gs != -1 and gs % BLOCK:
        raise no(f"group size {gs}, not a multiple of GGUF's blocks of 32")
    if k % BLOCK:
        raise no(f"in_features {k} is not a multiple of 32")
    if layer.act_order:
        raise no("act-order (permuted g_idx)")
    g = k // BLOCK
    # a group of 32·r columns is r blocks, each carrying the group's scale (and zero): the same weights
    grp = np.zeros(g, dtype=np.intp) if gs == -1 else (np.arange(g) * BLOCK) // gs
    d = _as_f16_exact(layer.scales, layer.scale_dtype)
    if d is None:
        raise no(f"{layer.scale_dtype} scales that are not fp16 values")
    d = d[:, grp]
    zeros = None if layer.zeros is None else layer.zeros[:, grp]
    codes = layer.codes.reshape(n, g, BLOCK)
    mid = 1 << (layer.bits - 1)
    if layer.bits == 8:
        if layer.zero_mode == "float" or (layer.zero_mode == "int" and np.any(zeros != 128)):
            raise no("an 8-bit layer with zero points (Q8_0 is symmetric)")
        out = np.empty((n, g, 34), dtype=np.uint8)
        out[..., 0:2] = d.astype("<f2").reshape(n, g, 1).view(np.uint8)
        out[..., 2:34] = (codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        return "Q8_0", out.reshape(n, g * 34)
    if layer.bits != 4:
        raise no(f"{layer.bits}-bit codes")
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    if layer.zero_mode == "none" or (layer.zero_mode == "int" and np.all(zeros == mid)):
        out = np.empty((n, g, 18), dtype=np.uint8)
        out[..., 0:2] = d.astype("<f2").reshape(n, g, 1).view(np.uint8)
        out[..., 2:18] = qs
        return "Q4_0", out.reshape(n, g * 18)
    if layer.zero_mode == "float":
        m = _as_f16_exact(zeros, layer.scale_dtype)
        if m is None:
            raise no("float minima that are not fp16 values")
    else:  # integer zeros: w = s·(q − z) = s·q + (−s·z), exact only when −s·z is an fp16
        sz = -(d.astype(np.float64) * zeros.astype(np.float64))
        m = sz.astype(np.float16)
        if not np.array_equal(m.astype(np.float64), sz):
            raise no("integer zero points whose −scale·zero is not an fp16 value (Q4_1 stores the minimum)")
    out = np.empty((n, g, 20), dtype=np.uint8)
    out[..., 0:2] = d.astype("<f2").reshape(n, g, 1).view(np.uint8)
    out[..., 2:4] = m.astype("<f2").reshape(n, g, 1).view(np.uint8)
    out[..., 4:20] = qs
    return "Q4_1", out.reshape(n, g * 20)


def rotary_row_permutation(rows: int, n_head: int) -> np.ndarray:
    """Row index map that undoes llama.cpp's q/k permutation: hf_rows = gguf_rows[perm].

    llama.cpp (convert_hf_to_gguf ``permute``) reorders each head's rows from (2, d/2) to (d/2, 2) so its rotary
    kernel sees interleaved pairs; transformers uses split halves. ``n_head`` is the KV head count for k.
    """
    if n_head < 1 or rows % (2 * n_head):
        raise BadInputError(f"{rows} rows cannot be split into {n_head} heads of rotary pairs")
    half = rows // n_head // 2
    idx = np.arange(rows).reshape(n_head, half, 2)
    return idx.swapaxes(1, 2).reshape(rows)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
#: hyperparameters (``{arch}.KEY``) that config.json is built from: non-negative integers
_INT_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
             "vocab_size", "rope.scaling.original_context_length")
#: ... and finite numbers
_FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor")
_TOKEN_ID_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.unknown_token_id")
_PLAIN_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


@dataclass(frozen=True)
class GGUFMeta:
    """What the reader needs from a GGUF's metadata, parsed and type-checked once, before any tensor is read."""

    arch: str
    heads: int | None
    kv_heads: int | None
    version: int
    name: str | None
    has_tokenizer: bool
    #: every key's Python value (config.json is built from these)
    values: dict[str, Any]

    @classmethod
    def parse(cls, f: GGUFFile) -> "GGUFMeta":
        label = str(f.path)
        values = {k: v.value for k, v in f.metadata.items()}
        arch = values.get("general.architecture")
        if arch is None:
            raise BadInputError("no general.architecture in the metadata", file=label)
        if not isinstance(arch, str) or arch not in names.ARCHS:
            raise BadInputError(f"unknown architecture {brief(arch)} (supported: {', '.join(names.ARCHS)})",
                                file=label)

        def bad(key: str, what: str) -> BadInputError:
            v = f.metadata[key]
            return BadInputError(f"metadata key {key}: {what}, got {v.type} {brief(v.value)}", file=label)

        for key in [f"{arch}.{k}" for k in _INT_KEYS] + list(_TOKEN_ID_KEYS):
            v = values.get(key)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise bad(key, "expected a non-negative integer")
        for key in (f"{arch}.{k}" for k in _FLOAT_KEYS):
            v = values.get(key)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
                raise bad(key, "expected a finite number")
        heads = values.get(f"{arch}.attention.head_count")
        kv = values.get(f"{arch}.attention.head_count_kv", heads)
        for key, n in ((f"{arch}.attention.head_count", heads), (f"{arch}.attention.head_count_kv", kv)):
            if n == 0 and key in values:
                raise bad(key, "expected at least one head")
        name = values.get("general.name")
        return cls(arch=arch, heads=heads, kv_heads=kv, version=f.version,
                   name=name if isinstance(name, str) and name else None,
                   has_tokenizer=values.get("tokenizer.ggml.model") is not None, values=values)


def _split_stacked(f: GGUFFile, arch: str) -> dict[str, tuple[str, int]]:
    """Per-expert layer name -> (stacked ``ffn_*_exps`` tensor, expert index) for every 3-D experts tensor of a
    known MoE architecture (docs/MOE.md): expert e's rows are ``data[e]``, exactly."""
    out: dict[str, tuple[str, int]] = {}
    for gname, t in f.tensors.items():
        found = experts.parse_stacked_gguf_name(gname)
        hf = None if found is None or len(t.shape) != 3 else \
            experts.per_expert_hf_names(arch, found[0], found[1], t.shape[0])
        for e, name in enumerate(hf or ()):
            out[name] = (gname, e)
    return out


def _map_names(tensor_names: list[str], label: str, arch: str | None = None) -> tuple[dict[str, str], list[str]]:
    """GGUF name -> transformers name (unknown names kept as they are, and listed)."""
    hf_of: dict[str, str] = {}
    unknown = []
    for gname in tensor_names:
        hf = names.gguf_to_hf(gname, arch)
        if hf is None:
            unknown.append(gname)
            hf = gname
        hf_of[gname] = hf
    if len(set(hf_of.values())) != len(hf_of):
        raise BadInputError("two tensors map to the same transformers name", file=label)
    return hf_of, unknown


def _classify(f: GGUFFile, hf_of: dict[str, str]) -> tuple[list[str], list[str], Counter[str]]:
    """(quantized layers: linear ones and a packable token embedding, pass-through tensors, count of types
    dequantized to float32 by type)."""
    layers: list[str] = []
    passthrough: list[str] = []
    dequantized: Counter[str] = Counter()
    for gname, t in f.tensors.items():
        if gname not in hf_of:
            continue  # a stacked experts tensor: its experts are classified by the caller
        hf = hf_of[gname]
        module = hf[: -len(".weight")] if hf.endswith(".weight") else None
        if _packs_as_layer(module, t):
            layers.append(module)
            continue
        passthrough.append(hf)
        if t.type_name not in _PLAIN_TYPES:
            dequantized[t.type_name] += 1
    biases = {f"{m}.bias" for m in layers}
    return layers, [p for p in passthrough if p not in biases], dequantized


class GGUFSource(Source):
    """A .gguf file parsed by our bounds-checked reader (memory-mapped); layers decoded one at a time."""

    def __init__(self, path: Path, export_tokenizer: bool = True):
        self.path = Path(path)
        label = str(self.path)
        self.file = open_gguf(self.path)
        try:
            self.gmeta = GGUFMeta.parse(self.file)
            self.types: dict[str, str] = {n: t.type_name for n, t in self.file.tensors.items()}
            #: per-expert layer name -> (stacked GGUF tensor, expert index)
            self.expert_of = _split_stacked(self.file, self.gmeta.arch)
            stacked = {g for g, _e in self.expert_of.values()}
            self.hf_of, unknown = _map_names([n for n in self.file.tensors if n not in stacked], label,
                                             self.gmeta.arch)
            self.gguf_of = {hf: g for g, hf in self.hf_of.items()}
            self.arch = self.gmeta.arch
            self.meta = {k: v for k, v in self.gmeta.values.items()}
            self.heads, self.kv_heads = self.gmeta.heads, self.gmeta.kv_heads
            self.permute = names.permutes_qk(self.arch)
            self.notes: list[str] = []
            self.quirks: list[str] = []
            self.config = self._build_config()
            self._layers, self._pass, dequantized = _classify(self.file, self.hf_of)
            for name, (gname, _e) in self.expert_of.items():  # experts: packed when decodable, else float
                if _packable(self.types[gname]):
                    self._layers.append(name)
                else:
                    self._pass.append(f"{name}.weight")
                    if self.types[gname] not in _PLAIN_TYPES:
                        dequantized[self.types[gname]] += 1
        except BaseException:
            self.file.close()
            raise
        self._add_notes(unknown, dequantized)
        self.info = {"format": "gguf", "version": str(self.gmeta.version), "notes": self.notes, "quirks": self.quirks}
        if self.gmeta.name:
            self.info["base_model"] = self.gmeta.name
        lic = self.gmeta.values.get("general.license")
        if isinstance(lic, str) and lic.strip():  # (the model card publishes it, as it does a Hub source's)
            self.info["license"] = lic.strip()
        self._export_tokenizer = export_tokenizer
        self._scratch = ScratchFolder("w4pack-gguf-tok-")
        self._side_files: list[Path] | None = None

    def _build_config(self) -> dict[str, Any]:
        emb = self.file.tensors.get("token_embd.weight")
        vocab_hint = int(emb.dims[-1]) if emb is not None and len(emb.dims) == 2 else None
        config, missing = names.build_config(self.arch, self.meta, has_output="output.weight" in self.file.tensors,
                                             vocab_hint=vocab_hint)
        if missing:
            self.notes.append(f"config.json not built: metadata lacks {', '.join(missing)}")
        return config

    def _add_notes(self, unknown: list[str], dequantized: Counter[str]) -> None:
        if unknown:
            self.notes.append(f"{len(unknown)} tensor(s) without a transformers name kept under their GGUF name: "
                              f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
        if dequantized:
            kinds = ", ".join(f"{c} {q}" for q, c in sorted(dequantized.items()))
            self.notes.append(f"not packable, dequantized to float32 with gguf's own code and passed through: {kinds}")
        emb = self.hf_of.get("token_embd.weight", "")
        if emb.endswith(".weight") and emb[: -len(".weight")] in self._layers:
            self.notes.append(f"token_embd.weight ({self.types['token_embd.weight']}) is an embedding (looked up, "
                              "not multiplied): kept packed as a layer with role \"embedding\"")
        if self.permute and any(hf.endswith(("q_proj.weight", "k_proj.weight")) for hf in self.hf_of.values()):
            self.notes.append("llama.cpp's rotary row permutation of attn_q/attn_k undone (transformers order)")
        counts = Counter(self.types.values())
        self.notes.insert(0, "tensor types: " + ", ".join(f"{c} {q}" for q, c in sorted(counts.items())))
        packed = {self.gguf_of[f"{m}.weight"] if m not in self.expert_of else self.expert_of[m][0]
                  for m in self._layers}
        self.notes[1:1] = _carriage_notes(self.types, packed, self.hf_of) + _refusals(self.file, self.hf_of)

    # -- helpers -------------------------------------------------------------------------------
    def _qk_perm(self, hf: str, rows: int) -> np.ndarray | None:
        if not self.permute:
            return None
        if ".self_attn.q_proj." in hf or hf.endswith("self_attn.q_proj"):
            n_head = self.heads
        elif ".self_attn.k_proj." in hf or hf.endswith("self_attn.k_proj"):
            n_head = self.kv_heads
        else:
            return None
        if n_head is None:
            raise BadInputError(f"{self.arch}.attention.head_count is missing: cannot undo the q/k permutation",
                                file=str(self.path), tensor=self.gguf_of.get(hf, hf))
        try:
            return rotary_row_permutation(rows, n_head)
        except BadInputError as exc:
            raise BadInputError(exc.message, file=str(self.path), tensor=self.gguf_of.get(hf, hf)) from None

    # -- Source --------------------------------------------------------------------------------
    def layer_names(self) -> list[str]:
        return list(self._layers)

    def passthrough_names(self) -> list[str]:
        return list(self._pass)

    def embedding_names(self) -> list[str]:
        return [n for n in self._layers if names.is_embedding(n)]

    def read_layer(self, name: str) -> CanonicalLayer:
        gname, expert = self.expert_of.get(name, (self.gguf_of.get(f"{name}.weight"), None))
        if gname is None or name not in self._layers:
            raise BadInputError("no such quantized layer", file=str(self.path), tensor=name)
        self.file.release_pages()
        t = self.file.tensors[gname]
        shape, data = t.shape, self.file.data(gname)
        if expert is not None:  # one expert of a stacked tensor: its rows' blocks, exactly
            shape, data = shape[1:], data[expert]
        n, k = shape
        try:
            decoder = _DECODERS.get(t.type_name)
            layer = decoder(data, n, k) if decoder is not None else gguf_quants.decode(t.type_name, data, n, k)
        except BadInputError as exc:
            raise BadInputError(exc.message, file=str(self.path), tensor=gname) from None
        perm = self._qk_perm(name, n)
        changes: dict[str, Any] = {}
        if perm is not None:
            changes = {"codes": layer.codes[perm], "scales": layer.scales[perm]}
            if layer.zeros is not None:
                changes["zeros"] = layer.zeros[perm]
        if f"{name}.bias" in self.gguf_of:
            bt = self.read_tensor(f"{name}.bias")
            changes["bias"], changes["bias_dtype"] = np.asarray(bt.array), bt.dtype
        source = {"format": "gguf", "gguf_name": gname, "gguf_type": t.type_name}
        if names.is_embedding(name):
            changes["role"] = "embedding"
        if expert is not None:
            source["expert"] = expert
        if perm is not None:
            source["rotary_permutation"] = "undone"
        layer = layer.replace(name=name, source=source, **changes)
        try:
            return layer.validate()
        except BadInputError as exc:
            raise BadInputError(exc.message, file=str(self.path), tensor=gname) from None

    def read_tensor(self, name: str) -> TensorData:
        gname, expert = self.expert_of.get(name[: -len(".weight")], (self.gguf_of.get(name), None))
        if gname is None:
            raise BadInputError("no such tensor", file=str(self.path), tensor=name)
        self.file.release_pages()
        arr, dt = self._decode_tensor(gname)
        if expert is not None:  # one expert of a stacked tensor that is not packed (e.g. F16 experts)
            arr = arr[expert]
        if arr.ndim == 1 and names.is_row_vector(gname):  # llama.cpp's [N] is transformers' [1, N]
            arr = arr.reshape(1, -1)
        if arr.ndim >= 1:
            perm = self._qk_perm(name[: -len(".weight")] if name.endswith(".weight") else name, arr.shape[0])
            if perm is not None:
                arr = arr[perm]
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise BadInputError("tensor contains NaN or infinity", file=str(self.path), tensor=gname)
        return TensorData(np.ascontiguousarray(arr), dt)

    def _decode_tensor(self, gname: str) -> tuple[np.ndarray, str]:
        """(array, dtype name) of a pass-through tensor: plain types as stored, the rest dequantized by gguf."""
        t = self.file.tensors[gname]
        data = self.file.data(gname)
        qt = t.type_name
        if qt == "F32":
            return data.astype("<f4", copy=False), "float32"
        if qt == "F16":
            return data.astype("<f2", copy=False), "float16"
        if qt == "BF16":
            return np.ascontiguousarray(data).view(np.uint16).reshape(t.shape), "bfloat16"
        if qt in ("F64", "I8", "I16", "I32", "I64"):
            return data, str(data.dtype)
        gguf = gguf_module()
        try:
            with np.errstate(all="ignore"):  # a NaN made of hostile bytes is refused below, not warned about
                arr = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.type_id))
        except (NotImplementedError, ValueError) as exc:
            raise UnsupportedError(f"gguf cannot dequantize {qt}: {exc}", file=str(self.path), tensor=gname) from None
        return arr.astype(np.float32).reshape(t.shape), "float32"

    def side_files(self) -> list[Path]:
        """gguf_metadata.json, the tokenizer (exported by transformers) and generation_config.json, built once."""
        if self._side_files is None:
            self._scratch.write_json(METADATA_NAME, self.metadata_doc())
            self._tokenizer_files()
            gen = {k: self.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in self.config}
            if gen:
                self._scratch.write_text("generation_config.json", json.dumps(gen, indent=2) + "\n")
            self._side_files = self._scratch.files()
        return list(self._side_files)

    def _tokenizer_files(self) -> None:
        """The tokenizer in Hugging Face form, exported by transformers from this file; when that cannot be done
        although the GGUF has a tokenizer, say so now (a GGUFWarning, shown by convert) with the fix, since the
        converted folder then cannot run."""
        if not self._export_tokenizer:
            return
        if not self.gmeta.has_tokenizer:
            self.notes.append("no tokenizer in the GGUF metadata: none exported")
            return
        try:
            import transformers  # noqa: F401
        except ModuleNotFoundError:
            why = "transformers is not installed"
        else:
            try:
                self._export_hf_tokenizer(self._scratch.path)
                return
            except Exception as exc:  # noqa: BLE001 - transformers' GGUF tokenizer support varies by model
                why = f"transformers failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        fix = "pip install 'w4pack[hf]'"
        self.notes.append(f"tokenizer not exported: {why} ({fix})")
        warnings.warn(f"{self.path}: the GGUF's tokenizer is not exported ({why}), so the converted folder has "
                      f"no tokenizer and `w4pack run` cannot use it; install the [hf] extra ({fix}) and convert "
                      "again", GGUFWarning, stacklevel=2)

    def metadata_doc(self) -> dict[str, Any]:
        """Every metadata key with its GGUF value type, so a GGUF written back carries the same tokenizer/metadata."""
        doc: dict[str, Any] = {}
        skipped = []
        for key, v in self.file.metadata.items():
            if key in _WRITER_KEYS:
                continue
            if v.type == "ARRAY":
                if v.item == "ARRAY" or not v.value:  # gguf's writer takes neither nested nor empty arrays
                    skipped.append(key)
                    continue
                doc[key] = {"type": "ARRAY", "item": v.item, "value": v.value}
            else:
                doc[key] = {"type": v.type, "value": v.value}
        if skipped:
            self.notes.append(f"metadata not kept for a GGUF written back: {', '.join(skipped[:5])}")
        return {"format": "w4pack gguf metadata", "version": 1, "metadata": doc, "tensor_types": dict(self.types)}

    def _export_hf_tokenizer(self, out: Path) -> None:
        import logging

        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity(logging.ERROR)
        try:
            tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
            tok.save_pretrained(str(out))
        finally:
            hf_logging.set_verbosity(level)
        self.notes.append(f"tokenizer exported in Hugging Face format by transformers ({type(tok).__name__})")

    def close(self) -> None:
        self._scratch.close()
        self._side_files = None
        self.file.close()

# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
#: llama.cpp's converter (convert_hf_to_gguf.py, ``get_vocab_base_pre``) names a byte-level BPE pre-tokenizer by
#: the sha256 of ``str(token ids)`` of this text, encoded by the model's tokenizer; llama.cpp picks its
#: pre-tokenizer regex by that name (``tokenizer.ggml.pre``) and warns "GENERATION QUALITY WILL BE DEGRADED"
#: without one
_PRE_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")
#: hash -> llama.cpp pre-tokenizer name, for the families w4pack writes (llama, qwen2, qwen3), from llama.cpp's table
_PRE_BY_HASH = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 / Qwen2
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM / SmolLM2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # GPT-2
}


def _pre_tokenizer(tokenizer_json: Path) -> tuple[str | None, str | None]:
    """(llama.cpp pre-tokenizer name, why none) for a tokenizer.json, by llama.cpp's own recognition hash."""
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:
        return None, "the tokenizers package is not installed (pip install 'w4pack[hf]')"
    try:
        ids = Tokenizer.from_file(str(tokenizer_json)).encode(_PRE_CHECK_TEXT).ids
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own Exception types
        return None, f"the tokenizers package cannot load it: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    digest = hashlib.sha256(str(list(ids)).encode()).hexdigest()
    name = _PRE_BY_HASH.get(digest)
    return name, None if name else f"pre-tokenizer not recognised (hash {digest[:12]})"


def _add_bos(doc: dict[str, Any], tcfg: dict[str, Any], arch: str, vocab_size: int) -> bool | None:
    """tokenizer.ggml.add_bos_token as llama.cpp's converter sets it: tokenizer_config's ``add_bos_token``, else
    whether the post-processor template starts with the BOS token (what the tokenizer does; llama.cpp's
    converter reads only templates of two or more pieces), else False for llama models with a 49152-token
    vocabulary (its rule for SmolLM/Granite); None: not written."""
    flag = tcfg.get("add_bos_token")
    if isinstance(flag, bool):
        return flag
    bos = tcfg.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    post = doc.get("post_processor") or {}
    for proc in post.get("processors", [post]) if isinstance(post, dict) else []:
        single = proc.get("single") if isinstance(proc, dict) and proc.get("type") == "TemplateProcessing" else None
        if isinstance(single, list) and single and isinstance(single[0], dict):
            first = (single[0].get("SpecialToken") or {}).get("id")
            return bool(first) and first == bos
    if arch == "llama" and vocab_size == 49152:
        return False
    return None


def _add_space_prefix(doc: dict[str, Any], tcfg: dict[str, Any]) -> bool | None:
    """tokenizer.ggml.add_space_prefix: tokenizer_config's ``add_prefix_space`` (where llama.cpp's converter reads
    it), else the ByteLevel pre-tokenizer's own flag in tokenizer.json (what the tokenizer does); None: unknown."""
    flag = tcfg.get("add_prefix_space")
    if isinstance(flag, bool):
        return flag
    pre = doc.get("pre_tokenizer")
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    for step in steps if isinstance(steps, list) else []:
        if isinstance(step, dict) and step.get("type") == "ByteLevel" and isinstance(step.get("add_prefix_space"), bool):
            return bool(step["add_prefix_space"])
    return None


def tokenizer_metadata(side_files: list[Path], config: dict[str, Any], arch: str = "llama") \
        -> tuple[dict[str, tuple[Any, str, str | None]], str | None]:
    """GGUF tokenizer keys built from a Hugging Face tokenizer.json (byte-level BPE, llama.cpp's "gpt2" model), with
    what llama.cpp's converter adds: the pre-tokenizer name, add_bos_token and add_space_prefix.

    Returns ({key: (value, value type, array item type)}, reason when nothing could be built). Used when the
    source is not a GGUF (no saved metadata), so that llama.cpp can load what we write.
    """
    keys, why, _pre_why = _tokenizer_keys(side_files, config, arch)
    return keys, why


def _tokenizer_keys(side_files: list[Path], config: dict[str, Any], arch: str) \
        -> tuple[dict[str, tuple[Any, str, str | None]], str | None, str | None]:
    """tokenizer_metadata, and why no pre-tokenizer name was written (None when it was)."""
    files = {p.name: p for p in side_files}
    if "tokenizer.json" not in files:
        return {}, "no tokenizer.json", None
    doc = read_json(files["tokenizer.json"])
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        return {}, f"tokenizer model {brief(kind)} is not byte-level BPE", None
    if not model.get("merges"):  # gguf-py refuses the empty array, and llama.cpp refuses a BPE vocab without it
        return {}, "tokenizer.json has no BPE merges, which llama.cpp's BPE vocabulary needs", None
    ids: dict[int, str] = {int(i): str(t) for t, i in model["vocab"].items()}
    kinds: dict[int, int] = {}
    for a in doc.get("added_tokens") or []:
        ids[int(a["id"])] = str(a["content"])
        kinds[int(a["id"])] = 3 if a.get("special") else 4  # CONTROL / USER_DEFINED
    size = max(ids) + 1 if ids else 0
    tokens = [ids.get(i, f"[PAD{i}]") for i in range(size)]
    types = [kinds.get(i, 1 if i in ids else 5) for i in range(size)]  # NORMAL, or UNUSED for gaps
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    out: dict[str, tuple[Any, str, str | None]] = {"tokenizer.ggml.model": ("gpt2", "STRING", None)}
    pre, pre_why = _pre_tokenizer(files["tokenizer.json"])
    if pre is not None:
        out["tokenizer.ggml.pre"] = (pre, "STRING", None)
    out["tokenizer.ggml.tokens"] = (tokens, "ARRAY", "STRING")
    out["tokenizer.ggml.token_type"] = (types, "ARRAY", "INT32")
    out["tokenizer.ggml.merges"] = (merges, "ARRAY", "STRING")
    tcfg: dict[str, Any] = {}
    if "tokenizer_config.json" in files:
        try:
            tcfg = read_json(files["tokenizer_config.json"])
        except BadInputError:
            tcfg = {}
        tcfg = tcfg if isinstance(tcfg, dict) else {}
    index = {t: i for i, t in enumerate(tokens)}
    for key, hf in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"), ("unknown_token_id", "unk_token"),
                    ("padding_token_id", "pad_token")):
        tok = tcfg.get(hf)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        tid = index.get(tok) if isinstance(tok, str) else config.get(hf.replace("_token", "_token_id"))
        if isinstance(tid, int):
            out[f"tokenizer.ggml.{key}"] = (tid, "UINT32", None)
    add_bos = _add_bos(doc, tcfg, arch, int(config.get("vocab_size") or size))
    if add_bos is not None:
        out["tokenizer.ggml.add_bos_token"] = (add_bos, "BOOL", None)
    prefix = _add_space_prefix(doc, tcfg)
    if prefix is not None:
        out["tokenizer.ggml.add_space_prefix"] = (prefix, "BOOL", None)
    template = tcfg.get("chat_template")
    if not isinstance(template, str) and "chat_template.jinja" in files:
        template = read_text(files["chat_template.jinja"])
    if isinstance(template, str) and template:
        out["tokenizer.chat_template"] = (template, "STRING", None)
    return out, None, pre_why


#: hyperparameters always written from config.json, even when the saved source metadata lacked them
_ESSENTIAL = (".block_count", ".context_length", ".embedding_length", ".feed_forward_length",
              ".attention.head_count", ".attention.head_count_kv", ".attention.layer_norm_rms_epsilon")
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
_PASS_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int8": "I8",
               "int16": "I16", "int32": "I32", "int64": "I64"}


def _gguf_name(hf: str) -> str:
    return names.hf_to_gguf(hf) or hf


def _target_arch(cfg: dict[str, Any]) -> tuple[str, dict[str, tuple[str, Any]]]:
    """(GGUF architecture, hyperparameter keys) for the source's config.json; llama when it has none."""
    meta_out = names.config_to_metadata(cfg) if cfg.get("model_type") else None
    if cfg.get("model_type") and meta_out is None:
        raise UnsupportedError(f"model_type {cfg.get('model_type')!r} has no GGUF tensor mapping "
                               f"(supported: {', '.join(names.ARCHS)})")
    return meta_out if meta_out is not None else ("llama", {})


_NO_HEADS = "config.json lacks num_attention_heads: cannot apply llama.cpp's q/k permutation"


def _config_problems(source: Source) -> list[str]:
    """What the writer refuses in config.json, as the dry run reports it: an architecture without a tensor
    mapping, and q/k layers to permute for llama.cpp without the head counts that say how."""
    cfg = dict(source.config or {})
    try:
        arch, _ = _target_arch(cfg)
    except UnsupportedError as exc:
        return [exc.message]
    if names.permutes_qk(arch) and not cfg.get("num_attention_heads"):
        qk = next((n for n in source.layer_names() if ".self_attn.q_proj" in n or ".self_attn.k_proj" in n), None)
        if qk is not None:
            return [f"{qk}: {_NO_HEADS}"]
    return []


def _saved_metadata(side: list[Path]) -> dict[str, Any]:
    """The source GGUF's metadata saved beside a converted checkpoint ({} when the source was not a GGUF)."""
    for p in side:
        side_file(p)  # a tokenizer.json linked from outside the source folder is not embedded
    for p in side:
        if p.name == METADATA_NAME:
            saved = read_json(p)
            if not isinstance(saved, dict) or not isinstance(saved.get("metadata"), dict) or \
                    not all(isinstance(v, dict) and "type" in v for v in saved["metadata"].values()):
                raise BadInputError("saved GGUF metadata is not {metadata: {key: {type, value}}, ...}", file=str(p))
            return saved
    return {}


@dataclass
class _TensorPlan:
    """One output tensor: how to make it (kind: layer / bias / tensor, source name) and what the header says."""

    kind: str
    hf: str
    gname: str
    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    raw: Any


class _Payloads:
    """Makes each output tensor's bytes from the source: layers encoded as Q4_0/Q4_1/Q8_0, q/k rows permuted
    for llama.cpp, float tensors that came from a quantized GGUF tensor re-encoded when that is exact, and 1-D
    float tensors of a non-GGUF source as F32 (llama.cpp's converter does so: its norm and bias kernels take
    F32 only)."""

    def __init__(self, source: Source, cfg: dict[str, Any], arch: str, original_types: dict[str, str]):
        self.gguf = gguf_module()
        self.source = source
        self.permute = names.permutes_qk(arch)
        self.heads = cfg.get("num_attention_heads")
        self.kv_heads = cfg.get("num_key_value_heads", self.heads)
        self.original_types = original_types
        self.requant: dict[str, str] = {}  # gguf name -> type, for float tensors that re-encode exactly
        self.lost: Counter[str] = Counter()  # original types that could not be re-encoded exactly
        self.spread: Counter[int] = Counter()  # group sizes above 32 whose scale each block of 32 repeats
        self.first_pass = True
        self.stacks = _expert_stacks(source)  # {ffn_*_exps name: per-expert layers}, docs/MOE.md

    def qk_perm(self, hf: str, rows: int) -> np.ndarray | None:
        if not self.permute or not (".self_attn.q_proj" in hf or ".self_attn.k_proj" in hf):
            return None
        n_head = self.heads if ".q_proj" in hf else self.kv_heads
        if not n_head:
            raise UnsupportedError(_NO_HEADS, tensor=hf)
        return np.argsort(rotary_row_permutation(rows, int(n_head)))

    def exact_requant(self, gname: str, arr: np.ndarray) -> np.ndarray | None:
        """Quantized bytes of a float tensor that came from a quantized GGUF tensor, if they reproduce it exactly."""
        gguf = self.gguf
        qt = self.original_types.get(gname)
        if qt is None or qt in _PASS_TYPES.values() or arr.dtype != np.float32 or arr.ndim < 1:
            return None
        qtype = gguf.GGMLQuantizationType[qt]
        data = None
        if arr.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            try:
                data = gguf.quants.quantize(arr, qtype)
            except (NotImplementedError, ValueError, TypeError):  # gguf-py cannot quantize K-quants
                data = None
        if data is not None and gname not in self.requant:
            if np.array_equal(gguf.quants.dequantize(data, qtype).reshape(arr.shape), arr):
                self.requant[gname] = qt
            else:
                data = None
        if data is None:
            self.lost[qt] += 1
        return data

    def layer(self, hf: str) -> tuple[np.ndarray, Any]:
        layer = self.source.read_layer(hf).replace(name=hf)
        perm = self.qk_perm(hf, layer.out_features)
        if perm is not None:
            layer = layer.replace(codes=layer.codes[perm], scales=layer.scales[perm],
                                  zeros=None if layer.zeros is None else layer.zeros[perm])
        src_type = _source_gguf_type(layer)
        if src_type is not None:
            # read from a K-quant / Q5 / IQ4 tensor: written back in that type; where its values are not such
            # blocks (a layer changed since), they go back exactly as F32, said in the notes
            try:
                return gguf_quants.encode(src_type, layer), self.gguf.GGMLQuantizationType[src_type]
            except UnsupportedError:
                if self.first_pass:
                    self.lost[src_type] += 1
                return np.ascontiguousarray(layer.dequantize(np.float64).astype(np.float32)), None
        qt, data = encode_layer(layer)
        if self.first_pass and layer.group_size != BLOCK:
            self.spread[layer.group_size] += 1
        return data, self.gguf.GGMLQuantizationType[qt]

    def __call__(self, kind: str, hf: str) -> tuple[np.ndarray, Any]:
        """(array to write, raw GGML type or None) of one output tensor."""
        if kind == "experts":  # per-expert layers stacked back into ffn_*_exps [E, rows, blocks]
            parts = [self.layer(n) for n in self.stacks[hf]]
            kinds = sorted({raw.name for _d, raw in parts})
            if len(kinds) > 1:
                raise UnsupportedError(f"experts of one GGUF tensor encode as different types ({', '.join(kinds)})",
                                       tensor=hf)
            return experts.stack_experts([d for d, _r in parts]), parts[0][1]
        if kind == "layer":
            return self.layer(hf)
        if kind == "bias":
            layer = self.source.read_layer(hf)
            arr, dt = layer.bias, layer.bias_dtype or "float32"
            tname = f"{hf}.bias"
        else:
            td = self.source.read_tensor(hf)
            arr, dt, tname = td.array, td.dtype, hf
        if dt not in _PASS_TYPES:
            raise UnsupportedError(f"GGUF has no tensor type for {dt}", tensor=tname)
        arr = np.ascontiguousarray(arr)
        if arr.ndim >= 1:
            perm = self.qk_perm(tname, arr.shape[0])
            if perm is not None:
                arr = np.ascontiguousarray(arr[perm])
        gname = _gguf_name(tname)
        if arr.ndim == 2 and arr.shape[0] == 1 and names.is_row_vector(gname):
            arr = arr.reshape(-1)  # transformers' [1, N], written 1-D as llama.cpp's converter does
        if kind == "tensor" and dt == "float32" and self.original_types:
            if self.first_pass or gname in self.requant:
                data = self.exact_requant(gname, arr)
                if data is not None:
                    return data, self.gguf.GGMLQuantizationType[self.requant[gname]]
        if dt in ("float16", "bfloat16") and gname not in self.original_types and \
                (arr.ndim <= 1 or gname.endswith("_norm.weight")):
            arr, dt = to_float32(arr, dt), "float32"  # exact; llama.cpp's converter writes these as F32
        qt = self.gguf.GGMLQuantizationType[_PASS_TYPES[dt]]
        if dt == "bfloat16":
            return arr.view(np.uint8), qt
        return arr, (None if dt != "float64" else qt)


def _expert_stacks(source: Source) -> dict[str, list[str]]:
    """{GGUF ffn_*_exps name: per-expert layers in expert order}; refused when an expert is missing or has a
    bias (GGUF's stacked experts have none)."""
    try:
        stacks = experts.plan_gguf_stacks(source.layer_names())
    except ValueError as exc:
        raise UnsupportedError(str(exc)) from None
    for parts in stacks.values():
        for name in parts:
            if source.read_layer(name).bias is not None:
                raise UnsupportedError("GGUF's stacked experts have no bias", tensor=name)
    return stacks


def _jobs(source: Source, original_types: dict[str, str], stacks: dict[str, list[str]]
          ) -> list[tuple[str, str, str]]:
    """(kind, source name, gguf name) of every output tensor, in the source GGUF's order when there was one, so
    that a round trip reproduces the file."""
    jobs: list[tuple[str, str, str]] = []
    jobs += [("experts", g, g) for g in stacks]
    stacked = {n for parts in stacks.values() for n in parts}
    for name in source.layer_names():
        if name in stacked:
            continue
        jobs.append(("layer", name, _gguf_name(f"{name}.weight")))
        jobs.append(("bias", name, _gguf_name(f"{name}.bias")))
    jobs += [("tensor", t, _gguf_name(t)) for t in source.passthrough_names()]
    if original_types:
        order = {g: i for i, g in enumerate(original_types)}
        jobs.sort(key=lambda j: order.get(j[2], len(order)))
    return jobs


def _plan(source: Source, jobs: list[tuple[str, str, str]], payloads: _Payloads) -> tuple[list[_TensorPlan], int]:
    """Every tensor's type, shape and size (GGUF writes the infos before the data), and the file type; what
    cannot be written is refused here, before anything is written."""
    plans: list[_TensorPlan] = []
    types: Counter[str] = Counter()
    problems = []
    for kind, hf, gname in jobs:
        if kind == "bias" and source.read_layer(hf).bias is None:
            continue
        try:
            data, raw = payloads(kind, hf)
        except UnsupportedError as exc:
            problems.append(f"{hf}: {exc.message}")
            continue
        if kind in ("layer", "experts") and raw is not None:
            types[raw.name] += 1
        plans.append(_TensorPlan(kind, hf, gname, data.shape, data.dtype, data.nbytes, raw))
        del data
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        src = getattr(source, "path", None)  # (named as the other writers name it: the source that holds them)
        raise UnsupportedError("cannot write GGUF: " + problems[0] + more, file=str(src) if src else None)
    seen: set[str] = set()
    for p in plans:
        if p.gname in seen:
            raise UnsupportedError(f"two tensors map to the GGUF name {p.gname}", tensor=p.hf)
        seen.add(p.gname)
    payloads.first_pass = False
    return plans, _FILE_TYPES.get(types.most_common(1)[0][0], 1) if types else 1


def _header(source: Source, saved: dict[str, Any], arch: str, kv: dict[str, tuple[str, Any]], ftype: int,
            side: list[Path], cfg: dict[str, Any], notes: list[str]) -> dict[str, tuple[Any, str, str | None]]:
    """The metadata to write ({key: (value, value type name, item type name)}): a GGUF source's saved keys first,
    in their order, so a GGUF -> w4pack -> GGUF trip reproduces the header; else tokenizer keys from
    tokenizer.json; then the hyperparameters from config.json."""
    final: dict[str, tuple[Any, str, str | None]] = {}
    for key, entry in saved.get("metadata", {}).items():
        if key in _WRITER_KEYS or (key.split(".")[0] in names.ARCHS and key.split(".")[0] != arch):
            continue
        if entry.get("type") == "ARRAY":
            final[key] = (entry["value"], "ARRAY", entry["item"])
        else:
            final[key] = (entry["value"], entry["type"], None)
    final["general.quantization_version"] = (int(gguf_module().GGML_QUANT_VERSION), "UINT32", None)
    final["general.file_type"] = (int(ftype), "UINT32", None)
    if not saved:  # a GGUF source is reproduced as it was, with or without a tokenizer
        tok, why, pre_why = _tokenizer_keys(side, cfg, arch)
        final.update(tok)
        if why:
            notes.append(f"no tokenizer embedded ({why}): llama.cpp needs one to run this file")
        elif pre_why:
            notes.append(f"no tokenizer.ggml.pre written ({pre_why}): llama.cpp falls back to its default "
                         "pre-tokenizer and may tokenize differently")
    base = getattr(source, "info", {}).get("base_model")
    if base and "general.name" not in final:
        final["general.name"] = (str(base), "STRING", None)
    for key, (kind, val) in kv.items():
        if saved and key not in final and not key.endswith(_ESSENTIAL):
            continue  # keep a GGUF -> w4pack -> GGUF trip to the keys the source had
        final[key] = (int(val), "UINT32", None) if kind == "u32" else (float(val), "FLOAT32", None)
    return final


def _emit(path: Path, arch: str, header: dict[str, tuple[Any, str, str | None]], plans: list[_TensorPlan],
          payloads: _Payloads, show_progress: bool | None) -> None:
    """Write the GGUF to ``path`` (a temporary file of the store's AtomicFile) with gguf's own writer."""
    from ..progress import Progress

    gguf = gguf_module()
    VT = gguf.GGUFValueType
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, (val, vt, sub) in header.items():
        w.add_key_value(key, val, VT[vt], sub_type=None if sub is None else VT[sub])
    for p in plans:
        w.add_tensor_info(p.gname, p.shape, p.dtype, p.nbytes, raw_dtype=p.raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with Progress(len(plans), "writing gguf", enabled=show_progress) as bar:
        for p in plans:
            data, _raw = payloads(p.kind, p.hf)
            w.write_tensor_data(data)
            bar.update()
    w.close()


def write_gguf(source: Source, out: Path, *, force: bool = False, show_progress: bool | None = None,
               **options: Any) -> Path:
    """Write ``source`` as one GGUF file: quantized layers as Q4_0/Q4_1/Q8_0 when exact, others refused."""
    out = Path(out)
    # (refuses an existing DST before any work)
    target = AtomicFile(out, force, hint="give a path ending in .gguf", magic=GGUF_MAGIC)
    cfg = dict(source.config or {})
    arch, kv = _target_arch(cfg)
    side = source.side_files()
    saved = _saved_metadata(side)
    payloads = _Payloads(source, cfg, arch, saved.get("tensor_types") or {})
    plans, ftype = _plan(source, _jobs(source, payloads.original_types, payloads.stacks), payloads)
    saved_ftype = saved.get("metadata", {}).get("general.file_type", {}).get("value")
    if isinstance(saved_ftype, int):  # a GGUF source keeps its own file type (K-quant mixes have no single type)
        ftype = saved_ftype
    notes: list[str] = []
    if payloads.lost:
        notes.append("written as F32, not re-encodable exactly by gguf: "
                     + ", ".join(f"{c} {q}" for q, c in sorted(payloads.lost.items())))
    if payloads.spread:  # (why the file is larger than the source: the growth warning's explanation)
        notes.append("layers whose groups span several blocks of 32 carry the group's scale in each block: "
                     + ", ".join(f"{c} at group size {'per channel' if g == -1 else g}"
                                 for g, c in sorted(payloads.spread.items())))
    header = _header(source, saved, arch, kv, ftype, side, cfg, notes)
    with target as tmp:
        _emit(tmp, arch, header, plans, payloads, show_progress)
    for note in notes:
        warnings.warn(f"{out}: {note}", GGUFWarning, stacklevel=3)
    return out


class GGUFFormat(Format):
    name = "gguf"
    write_options: frozenset[str] = frozenset()
    read_options = frozenset({"export_tokenizer"})
    description = "GGUF (llama.cpp): Q4_0/Q4_1/Q8_0, Q5_0/Q5_1, K-quants, IQ4_NL/XS"
    capabilities = Capabilities(bits=(4, 8), zero_modes=("none", "int", "float"), group_sizes=(32,),
                                act_order=False, scale_dtypes=("float16", "bfloat16", "float32"),
                                notes=["scales (and Q4_1 minima) must be fp16 values",
                                       "integer zeros other than 8 need -scale*zero to be an fp16 (Q4_1)"])
    single_file = True
    file_magic = GGUF_MAGIC
    packs_embeddings = True  # token_embd is written back in its own block type
    hub_files = (HubFiles("*.gguf", rank=1, single=True, what="GGUF"),)

    @classmethod
    def detect(cls, path: Path) -> bool:
        return is_gguf(Path(path))

    @classmethod
    def open(cls, path: Path, **options: Any) -> Source:
        return GGUFSource(Path(path), export_tokenizer=bool(options.get("export_tokenizer", True)))

    @classmethod
    def write(cls, source: Source, out: Path, *, force: bool = False, **options: Any) -> Path:
        return write_gguf(source, out, force=force, **options)

    own_layer_checks = True

    @classmethod
    def check_writable(cls, source: Source) -> list[str]:
        problems = _config_problems(source)
        for name in source.layer_names():
            layer = source.read_layer(name)
            if _source_gguf_type(layer) is not None:  # written in its own block type, else exactly as F32
                continue
            try:
                encode_layer(layer.replace(name=name))
            except UnsupportedError as exc:
                problems.append(f"{name}: {exc.message}")
        return problems
