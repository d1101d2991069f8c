"""GGUF (llama.cpp) reader and writer, with the ``gguf`` package (gguf-py) for the container.

Blocks of 32 weights along ``in`` (facts: reference/formats-awq-ct-gguf.md §5):

* Q4_0: ``f16 d; u8 qs[16]``, w = d·(q − 8)        → canonical 4-bit, group 32, zero mode "none"
* Q4_1: ``f16 d; f16 m; u8 qs[16]``, w = d·q + m   → canonical 4-bit, group 32, zero mode "float" (m = the minimum)
* Q8_0: ``f16 d; i8 qs[32]``, w = d·q             → canonical 8-bit, group 32, codes q + 128, zero mode "none"

Byte j of ``qs`` holds element j (low nibble) and element j + 16 (high nibble). Every other tensor type (F32, F16,
BF16 pass through; K-quants and the rest are dequantized by gguf's own code to float32) is carried unquantized and
said so in the source notes. Names become transformers names, and llama.cpp's rotary row permutation of attn_q /
attn_k is undone, so the folder is a normal transformers checkpoint; config.json comes from the GGUF metadata and
the tokenizer is exported by transformers (optional dependency) from the same file.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ..core.canonical import CanonicalLayer
from ..core.dtypes import to_float32
from ..errors import BadInputError, IOFailure, UnsupportedError
from . import _hf_names as names
from .base import Capabilities, Format, HubFiles, Source, TensorData
from ..store.gguffile import gguf_module, is_gguf, open_gguf, release_pages

__all__ = ["GGUFFormat", "GGUFSource", "GGUFWarning", "tokenizer_metadata", "decode_q4_0", "decode_q4_1",
           "decode_q8_0", "encode_layer", "rotary_row_permutation", "write_gguf"]

BLOCK = 32


class GGUFWarning(UserWarning):
    """Something a written GGUF lacks (e.g. a tokenizer), said once per file."""

#: side file with the GGUF metadata (tokenizer vocabulary, chat template, ...) so that writing GGUF back keeps it
METADATA_NAME = "gguf_metadata.json"
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
                                "(Q4_0/Q4_1/Q8_0 are blocks of 32 with fp16 scales)", tensor=layer.name or None)

    if layer.group_size != BLOCK:
        raise no(f"group size {layer.group_size}, GGUF blocks are 32")
    if k % BLOCK:
        raise no(f"in_features {k} is not a multiple of 32")
    if layer.act_order:
        raise no("act-order (permuted g_idx)")
    d = _as_f16_exact(layer.scales, layer.scale_dtype)
    if d is None:
        raise no(f"{layer.scale_dtype} scales that are not fp16 values")
    g = k // BLOCK
    codes = layer.codes.reshape(n, g, BLOCK)
    mid = 1 << (layer.bits - 1)
    if layer.bits == 8:
        if layer.zero_mode == "float" or (layer.zero_mode == "int" and np.any(layer.zeros != 128)):
            raise no("an 8-bit layer with zero points (Q8_0 is symmetric)")
        out = np.empty((n, g, 34), dtype=np.uint8)
        out[..., 0:2] = d.astype("<f2").reshape(n, g, 1).view(np.uint8)
        out[..., 2:34] = (codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        return "Q8_0", out.reshape(n, g * 34)
    if layer.bits != 4:
        raise no(f"{layer.bits}-bit codes")
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    if layer.zero_mode == "none" or (layer.zero_mode == "int" and np.all(layer.zeros == mid)):
        out = np.empty((n, g, 18), dtype=np.uint8)
        out[..., 0:2] = d.astype("<f2").reshape(n, g, 1).view(np.uint8)
        out[..., 2:18] = qs
        return "Q4_0", out.reshape(n, g * 18)
    if layer.zero_mode == "float":
        m = _as_f16_exact(layer.zeros, layer.scale_dtype)
        if m is None:
            raise no("float minima that are not fp16 values")
    else:  # integer zeros: w = s·(q − z) = s·q + (−s·z), exact only when −s·z is an fp16
        sz = -(d.astype(np.float64) * layer.zeros.astype(np.float64))
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
def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - a malformed field reads as absent
        return None


class GGUFSource(Source):
    """A .gguf file opened with gguf.GGUFReader (memory-mapped); layers decoded one at a time."""

    def __init__(self, path: Path, export_tokenizer: bool = True):
        self.path = Path(path)
        label = str(self.path)
        self.reader = open_gguf(self.path)
        r = self.reader
        size = self.path.stat().st_size
        declared = _field(r, "GGUF.tensor_count")
        if declared is not None and int(declared) != len(r.tensors):
            raise BadInputError(f"header declares {declared} tensors, found {len(r.tensors)}", file=label)
        self.types: dict[str, str] = {}
        self.tensors: dict[str, Any] = {}
        for t in r.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise BadInputError(f"data runs past the end of the file ({end} > {size} bytes): truncated",
                                    file=label, tensor=t.name)
            if t.name in self.tensors:
                raise BadInputError("tensor name appears twice", file=label, tensor=t.name)
            self.tensors[t.name] = t
            self.types[t.name] = t.tensor_type.name
        if self.tensors:
            # gguf-py and llama.cpp pad every tensor to the alignment, so the last one ends the file; bytes left
            # over mean the header announced fewer tensors than the file holds (or the data section is shifted)
            align = int(_field(r, "general.alignment") or 32)
            last = max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors)
            if size - last >= align:
                raise BadInputError(f"{size - last} bytes after the last tensor's data: the header's tensor count "
                                    f"({len(r.tensors)}) or offsets are wrong", file=label)
        arch = _field(r, "general.architecture")
        if arch is None:
            raise BadInputError("no general.architecture in the metadata", file=label)
        if arch not in names.ARCHS:
            raise BadInputError(f"unknown architecture {arch!r} (supported: {', '.join(names.ARCHS)})", file=label)
        self.arch = str(arch)
        self.meta = {k: _field(r, k) for k in r.fields if not k.startswith("GGUF.")}
        self.notes: list[str] = []
        self.quirks: list[str] = []
        # name mapping
        self.hf_of: dict[str, str] = {}
        unknown = []
        for gname in self.tensors:
            hf = names.gguf_to_hf(gname)
            if hf is None:
                unknown.append(gname)
                hf = gname
            self.hf_of[gname] = hf
        if unknown:
            self.notes.append(f"{len(unknown)} tensor(s) without a transformers name kept under their GGUF name: "
                              f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
        self.gguf_of = {hf: g for g, hf in self.hf_of.items()}
        if len(self.gguf_of) != len(self.hf_of):
            raise BadInputError("two tensors map to the same transformers name", file=label)
        has_output = "output.weight" in self.tensors
        emb = self.tensors.get("token_embd.weight")
        vocab_hint = int(emb.shape[-1]) if emb is not None and len(emb.shape) == 2 else None
        self.config, missing = names.build_config(self.arch, self.meta, has_output=has_output, vocab_hint=vocab_hint)
        if missing:
            self.notes.append(f"config.json not built: metadata lacks {', '.join(missing)}")
        heads = self.meta.get(f"{self.arch}.attention.head_count")
        kv = self.meta.get(f"{self.arch}.attention.head_count_kv", heads)
        self.heads = None if heads is None else int(heads)
        self.kv_heads = None if kv is None else int(kv)
        self.permute = names.permutes_qk(self.arch)
        # quantized linear layers vs pass-through
        self._layers: list[str] = []
        self._pass: list[str] = []
        dequantized: Counter[str] = Counter()
        for gname, t in self.tensors.items():
            hf = self.hf_of[gname]
            qt = self.types[gname]
            module = hf[: -len(".weight")] if hf.endswith(".weight") else None
            if qt in _DECODERS and module is not None and len(t.shape) == 2 and names.is_linear(module):
                self._layers.append(module)
            else:
                self._pass.append(hf)
                if qt not in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64") and \
                        not (qt in _DECODERS and module is not None and names.is_embedding(module)):
                    dequantized[qt] += 1
        biases = {f"{m}.bias" for m in self._layers}
        self._pass = [p for p in self._pass if p not in biases]
        if dequantized:
            kinds = ", ".join(f"{c} {q}" for q, c in sorted(dequantized.items()))
            self.notes.append(f"not packable, dequantized to float32 with gguf's own code and passed through: {kinds}")
        emb_type = self.types.get("token_embd.weight")
        if emb_type in _DECODERS:
            self.notes.append(f"token_embd.weight ({emb_type}) is an embedding (looked up, not multiplied): "
                              "dequantized exactly to float32 and passed through")
        if self.permute and any(self.hf_of[g].endswith(("q_proj.weight", "k_proj.weight")) for g in self.tensors):
            self.notes.append("llama.cpp's rotary row permutation of attn_q/attn_k undone (transformers order)")
        counts = Counter(self.types.values())
        self.notes.insert(0, "tensor types: " + ", ".join(f"{c} {q}" for q, c in sorted(counts.items())))
        version = _field(r, "GGUF.version")
        self.info = {"format": "gguf", "version": None if version is None else str(version), "notes": self.notes,
                     "quirks": self.quirks}
        name = self.meta.get("general.name")
        if isinstance(name, str) and name:
            self.info["base_model"] = name
        self._export_tokenizer = export_tokenizer
        self._side_dir: Path | None = None
        self._side_files: list[Path] | None = None

    # -- helpers -------------------------------------------------------------------------------
    def _numpy_shape(self, t: Any) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(list(t.shape)))

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

    def _release_pages(self) -> None:
        """Before each layer or tensor: the pages of the file read so far leave our resident memory (the
        reader's np.memmap keeps every page it touched mapped until it is dropped)."""
        release_pages(self.reader)

    def read_layer(self, name: str) -> CanonicalLayer:
        gname = self.gguf_of.get(f"{name}.weight")
        if gname is None or name not in self._layers:
            raise BadInputError("no such quantized layer", file=str(self.path), tensor=name)
        self._release_pages()
        t = self.tensors[gname]
        qt = self.types[gname]
        n, k = self._numpy_shape(t)
        try:
            layer = _DECODERS[qt](np.asarray(t.data), n, k)
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
        source = {"format": "gguf", "gguf_name": gname, "gguf_type": qt}
        if perm is not None:
            source["rotary_permutation"] = "undone"
        layer = layer.replace(name=name, source=source, **changes)
        try:
            return layer.validate()
        except BadInputError as exc:
            raise BadInputError(exc.message, file=str(self.path), tensor=gname) from None

    def read_tensor(self, name: str) -> TensorData:
        gname = self.gguf_of.get(name)
        if gname is None:
            raise BadInputError("no such tensor", file=str(self.path), tensor=name)
        self._release_pages()
        t = self.tensors[gname]
        qt = self.types[gname]
        shape = self._numpy_shape(t)
        data = np.asarray(t.data)
        if qt == "F32":
            arr, dt = data.astype("<f4", copy=False).reshape(shape), "float32"
        elif qt == "F16":
            arr, dt = data.astype("<f2", copy=False).reshape(shape), "float16"
        elif qt == "BF16":
            arr, dt = np.ascontiguousarray(data).view(np.uint16).reshape(shape), "bfloat16"
        elif qt in ("F64", "I8", "I16", "I32", "I64"):
            arr = data.reshape(shape)
            dt = str(arr.dtype)
        else:
            gguf = gguf_module()
            try:
                arr = gguf.quants.dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)
            except (NotImplementedError, ValueError) as exc:
                raise UnsupportedError(f"gguf cannot dequantize {qt}: {exc}", file=str(self.path),
                                       tensor=gname) from None
            dt = "float32"
        if arr.ndim >= 1:
            perm = self._qk_perm(name[: -len(".weight")] if name.endswith(".weight") else name, arr.shape[0])
            if perm is not None:
                arr = arr[perm]
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise BadInputError("tensor contains NaN or infinity", file=str(self.path), tensor=gname)
        return TensorData(np.ascontiguousarray(arr), dt)

    def side_files(self) -> list[Path]:
        """tokenizer.json, tokenizer_config.json, chat template and generation_config.json, built once."""
        if self._side_files is not None:
            return list(self._side_files)
        self._side_files = []
        self._side_dir = Path(tempfile.mkdtemp(prefix="w4pack-gguf-tok-"))
        # removed on close(), or when the source is garbage-collected without one
        self._side_cleanup = weakref.finalize(self, shutil.rmtree, str(self._side_dir), True)
        import json

        meta_doc = self.metadata_doc()
        (self._side_dir / METADATA_NAME).write_text(json.dumps(meta_doc, ensure_ascii=False) + "\n", encoding="utf-8")
        if not self._export_tokenizer:
            pass
        elif self.meta.get("tokenizer.ggml.model") is None:
            self.notes.append("no tokenizer in the GGUF metadata: none exported")
        else:
            try:
                import transformers  # noqa: F401
            except ModuleNotFoundError:
                self.notes.append("tokenizer not exported: transformers is not installed (pip install 'w4pack[hf]')")
            else:
                try:
                    self._export_hf_tokenizer(self._side_dir)
                except Exception as exc:  # noqa: BLE001 - transformers' GGUF tokenizer support varies by model
                    self.notes.append(f"tokenizer not exported: transformers failed ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''})")
        gen = {k: self.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in self.config}
        if gen:
            (self._side_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        self._side_files = sorted(p for p in self._side_dir.iterdir() if p.is_file())
        return list(self._side_files)

    def metadata_doc(self) -> dict[str, Any]:
        """Every metadata key with its GGUF value type, so a GGUF written back carries the same tokenizer/metadata."""
        gguf = gguf_module()
        doc: dict[str, Any] = {}
        skipped = []
        for key, f in self.reader.fields.items():
            if key.startswith("GGUF.") or key in _WRITER_KEYS:
                continue
            types = list(f.types)
            if not types or (types[0] == gguf.GGUFValueType.ARRAY and
                             (len(types) < 2 or types[1] == gguf.GGUFValueType.ARRAY)):
                skipped.append(key)
                continue
            try:
                value = f.contents()
            except Exception:  # noqa: BLE001 - e.g. a string that is not UTF-8
                skipped.append(key)
                continue
            if types[0] == gguf.GGUFValueType.ARRAY:
                doc[key] = {"type": "ARRAY", "item": types[1].name, "value": value}
            else:
                doc[key] = {"type": types[0].name, "value": value}
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
        if self._side_dir is not None:
            self._side_cleanup()
            self._side_dir = None
            self._side_files = None
        # GGUFReader holds a np.memmap; dropping the reference releases the mapping
        self.tensors = {}
        self.reader = None


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def tokenizer_metadata(side_files: list[Path], config: dict[str, Any]) -> tuple[dict[str, tuple[Any, str, str | None]],
                                                                                 str | None]:
    """GGUF tokenizer keys built from a Hugging Face tokenizer.json (byte-level BPE, llama.cpp's "gpt2" model).

    Returns ({key: (value, value type, array item type)}, reason when nothing could be built). Used when the
    source is not a GGUF (no saved metadata), so that llama.cpp can load what we write.
    """
    import json

    files = {p.name: p for p in side_files}
    if "tokenizer.json" not in files:
        return {}, "no tokenizer.json"
    try:
        doc = json.loads(files["tokenizer.json"].read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInputError(f"cannot read the tokenizer: {exc}", file=str(files["tokenizer.json"])) from None
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return {}, f"tokenizer model {model.get('type')!r} is not byte-level BPE"
    ids: dict[int, str] = {int(i): str(t) for t, i in model["vocab"].items()}
    kinds: dict[int, int] = {}
    for a in doc.get("added_tokens") or []:
        ids[int(a["id"])] = str(a["content"])
        kinds[int(a["id"])] = 3 if a.get("special") else 4  # CONTROL / USER_DEFINED
    size = max(ids) + 1 if ids else 0
    tokens = [ids.get(i, f"[PAD{i}]") for i in range(size)]
    types = [kinds.get(i, 1 if i in ids else 5) for i in range(size)]  # NORMAL, or UNUSED for gaps
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    out: dict[str, tuple[Any, str, str | None]] = {
        "tokenizer.ggml.model": ("gpt2", "STRING", None),
        "tokenizer.ggml.tokens": (tokens, "ARRAY", "STRING"),
        "tokenizer.ggml.token_type": (types, "ARRAY", "INT32"),
        "tokenizer.ggml.merges": (merges, "ARRAY", "STRING"),
    }
    tcfg: dict[str, Any] = {}
    if "tokenizer_config.json" in files:
        try:
            tcfg = json.loads(files["tokenizer_config.json"].read_text(encoding="utf-8"))
        except (OSError, ValueError):
            tcfg = {}
    index = {t: i for i, t in enumerate(tokens)}
    for key, hf in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"), ("unknown_token_id", "unk_token"),
                    ("padding_token_id", "pad_token")):
        tok = tcfg.get(hf)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        tid = index.get(tok) if isinstance(tok, str) else config.get(hf.replace("_token", "_token_id"))
        if isinstance(tid, int):
            out[f"tokenizer.ggml.{key}"] = (tid, "UINT32", None)
    template = tcfg.get("chat_template")
    if not isinstance(template, str) and "chat_template.jinja" in files:
        template = files["chat_template.jinja"].read_text(encoding="utf-8")
    if isinstance(template, str) and template:
        out["tokenizer.chat_template"] = (template, "STRING", None)
    return out, None


#: hyperparameters always written from config.json, even when the saved source metadata lacked them
_ESSENTIAL = (".block_count", ".context_length", ".embedding_length", ".feed_forward_length",
              ".attention.head_count", ".attention.head_count_kv", ".attention.layer_norm_rms_epsilon")
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
_PASS_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int8": "I8",
               "int16": "I16", "int32": "I32", "int64": "I64"}


def _gguf_name(hf: str) -> str:
    return names.hf_to_gguf(hf) or hf


def write_gguf(source: Source, out: Path, *, force: bool = False, show_progress: bool | None = None,
               **options: Any) -> Path:
    """Write ``source`` as one GGUF file: quantized layers as Q4_0/Q4_1/Q8_0 when exact, others refused."""
    gguf = gguf_module()
    from ..progress import Progress

    from ..store.atomic import check_output, umask_mode, write_failure
    from ..store.folder import side_file

    out = Path(out)
    check_output(out, force)
    if out.is_dir():
        raise BadInputError("GGUF output is a single file; give a path ending in .gguf", file=str(out))
    cfg = dict(source.config or {})
    meta_out = names.config_to_metadata(cfg) if cfg.get("model_type") else None
    if cfg.get("model_type") and meta_out is None:
        raise UnsupportedError(f"model_type {cfg.get('model_type')!r} has no GGUF tensor mapping "
                               f"(supported: {', '.join(names.ARCHS)})")
    arch, kv = meta_out if meta_out is not None else ("llama", {})
    permute = names.permutes_qk(arch)
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", heads)

    def qk_perm(hf: str, rows: int) -> np.ndarray | None:
        if not permute or not (".self_attn.q_proj" in hf or ".self_attn.k_proj" in hf):
            return None
        n_head = heads if ".q_proj" in hf else kv_heads
        if not n_head:
            raise UnsupportedError("config.json lacks num_attention_heads: cannot apply llama.cpp's q/k permutation",
                                   tensor=hf)
        inv = np.argsort(rotary_row_permutation(rows, int(n_head)))
        return inv

    saved: dict[str, Any] = {}
    notes: list[str] = []
    side = source.side_files()
    for p in side:
        side_file(p)  # a tokenizer.json linked from outside the source folder is not embedded
    for p in side:
        if p.name == METADATA_NAME:
            import json

            try:
                saved = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise BadInputError(f"cannot read the saved GGUF metadata: {exc}", file=str(p)) from None
            if not isinstance(saved, dict) or not isinstance(saved.get("metadata"), dict) or \
                    not all(isinstance(v, dict) and "type" in v for v in saved["metadata"].values()):
                raise BadInputError("saved GGUF metadata is not {metadata: {key: {type, value}}, ...}", file=str(p))
    original_types: dict[str, str] = saved.get("tensor_types") or {}
    requant: dict[str, str] = {}  # gguf name -> type, for float tensors that re-encode exactly

    lost: Counter[str] = Counter()  # original types that could not be re-encoded exactly

    def exact_requant(gname: str, arr: np.ndarray) -> np.ndarray | None:
        """Quantized bytes of a float tensor that came from a quantized GGUF tensor, if they reproduce it exactly."""
        qt = original_types.get(gname)
        if qt is None or qt in _PASS_TYPES.values() or arr.dtype != np.float32 or arr.ndim < 1:
            return None
        qtype = gguf.GGMLQuantizationType[qt]
        data = None
        if arr.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            try:
                data = gguf.quants.quantize(arr, qtype)
            except (NotImplementedError, ValueError, TypeError):  # gguf-py cannot quantize K-quants
                data = None
        if data is not None and gname not in requant:
            if np.array_equal(gguf.quants.dequantize(data, qtype).reshape(arr.shape), arr):
                requant[gname] = qt
            else:
                data = None
        if data is None:
            lost[qt] += 1
        return data

    def tensor_payload(kind: str, hf: str) -> tuple[np.ndarray, Any]:
        """(array to write, raw GGML type or None) of one output tensor, q/k rows re-permuted for llama.cpp."""
        if kind == "layer":
            layer = source.read_layer(hf).replace(name=hf)
            perm = qk_perm(hf, layer.out_features)
            if perm is not None:
                layer = layer.replace(codes=layer.codes[perm], scales=layer.scales[perm],
                                      zeros=None if layer.zeros is None else layer.zeros[perm])
            qt, data = encode_layer(layer)
            return data, gguf.GGMLQuantizationType[qt]
        if kind == "bias":
            layer = source.read_layer(hf)
            arr, dt = layer.bias, layer.bias_dtype or "float32"
            tname = f"{hf}.bias"
        else:
            td = source.read_tensor(hf)
            arr, dt, tname = td.array, td.dtype, hf
        if dt not in _PASS_TYPES:
            raise UnsupportedError(f"GGUF has no tensor type for {dt}", tensor=tname)
        arr = np.ascontiguousarray(arr)
        if arr.ndim >= 1:
            perm = qk_perm(tname, arr.shape[0])
            if perm is not None:
                arr = np.ascontiguousarray(arr[perm])
        if kind == "tensor" and dt == "float32" and original_types:
            gname = _gguf_name(hf)
            if pass_one or gname in requant:
                data = exact_requant(gname, arr)
                if data is not None:
                    return data, gguf.GGMLQuantizationType[requant[gname]]
        qt = gguf.GGMLQuantizationType[_PASS_TYPES[dt]]
        if dt == "bfloat16":
            return arr.view(np.uint8), qt
        return arr, (None if dt != "float64" else qt)

    jobs: list[tuple[str, str, str]] = []  # (kind, source name, gguf name)
    for name in source.layer_names():
        jobs.append(("layer", name, _gguf_name(f"{name}.weight")))
        jobs.append(("bias", name, _gguf_name(f"{name}.bias")))
    jobs += [("tensor", t, _gguf_name(t)) for t in source.passthrough_names()]
    if original_types:  # the source GGUF's tensor order, so a round trip reproduces the file
        order = {g: i for i, g in enumerate(original_types)}
        jobs.sort(key=lambda j: order.get(j[2], len(order)))
    # pass 1: every tensor's type, shape and size (GGUF writes infos before data); refuse before writing anything
    infos: list[tuple[str, str, str, tuple[int, ...], Any, int, Any]] = []
    types: Counter[str] = Counter()
    problems = []
    pass_one = True
    for kind, hf, gname in jobs:
        if kind == "bias" and source.read_layer(hf).bias is None:
            continue
        try:
            data, raw = tensor_payload(kind, hf)
        except UnsupportedError as exc:
            problems.append(f"{hf}: {exc.message}")
            continue
        if kind == "layer":
            types[raw.name] += 1
        infos.append((kind, hf, gname, data.shape, data.dtype, data.nbytes, raw))
        del data
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UnsupportedError(problems[0] + more)
    seen: set[str] = set()
    for _k, hf, gname, *_rest in infos:
        if gname in seen:
            raise UnsupportedError(f"two tensors map to the GGUF name {gname}", tensor=hf)
        seen.add(gname)
    ftype = _FILE_TYPES[types.most_common(1)[0][0]] if types else 1
    pass_one = False
    if lost:
        notes.append("written as F32, not re-encodable exactly by gguf: "
                     + ", ".join(f"{c} {q}" for q, c in sorted(lost.items())))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.w4pack-tmp-", dir=out.parent)
    os.close(tmp_fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(str(tmp), arch=arch)
        VT = gguf.GGUFValueType
        # saved keys first, in their original order, so a GGUF -> w4pack -> GGUF trip reproduces the header
        final: dict[str, tuple[Any, Any, Any]] = {}
        for key, entry in saved.get("metadata", {}).items():
            if key in _WRITER_KEYS or (key.split(".")[0] in names.ARCHS and key.split(".")[0] != arch):
                continue
            if entry.get("type") == "ARRAY":
                final[key] = (entry["value"], VT.ARRAY, VT[entry["item"]])
            else:
                final[key] = (entry["value"], VT[entry["type"]], None)
        final["general.quantization_version"] = (int(gguf.GGML_QUANT_VERSION), VT.UINT32, None)
        final["general.file_type"] = (int(ftype), VT.UINT32, None)
        if not saved:  # a GGUF source is reproduced as it was, with or without a tokenizer
            tok, why = tokenizer_metadata(side, cfg)
            for key, (val, vt, sub) in tok.items():
                final[key] = (val, VT[vt], None if sub is None else VT[sub])
            if why:
                notes.append(f"no tokenizer embedded ({why}): llama.cpp needs one to run this file")
        base = getattr(source, "info", {}).get("base_model")
        if base and "general.name" not in final:
            final["general.name"] = (str(base), VT.STRING, None)
        for key, (kind, val) in kv.items():
            if saved and key not in final and not key.endswith(_ESSENTIAL):
                continue  # keep a GGUF -> w4pack -> GGUF trip to the keys the source had
            final[key] = (int(val), VT.UINT32, None) if kind == "u32" else (float(val), VT.FLOAT32, None)
        for key, (val, vt, sub) in final.items():
            w.add_key_value(key, val, vt, sub_type=sub)
        for _kind, _hf, gname, shape, dtype, nbytes, raw in infos:
            w.add_tensor_info(gname, shape, dtype, nbytes, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with Progress(len(infos), "writing gguf", enabled=show_progress) as bar:
            for kind, hf, _gname, *_rest in infos:
                data, _raw = tensor_payload(kind, hf)
                w.write_tensor_data(data)
                bar.update()
        w.close()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, umask_mode(0o666))
        os.replace(tmp, out)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, IOFailure):
            # e.g. a full disk: numpy says only "73728 requested and 40608 written"
            raise write_failure(exc, out) from None
        raise
    for note in notes:
        warnings.warn(f"{out}: {note}", GGUFWarning, stacklevel=3)
    return out


class GGUFFormat(Format):
    name = "gguf"
    description = "GGUF (llama.cpp): Q4_0 / Q4_1 / Q8_0 blocks of 32"
    capabilities = Capabilities(bits=(4, 8), zero_modes=("none", "int", "float"), group_sizes=(32,),
                                act_order=False, scale_dtypes=("float16", "bfloat16", "float32"),
                                notes=["scales (and Q4_1 minima) must be fp16 values",
                                       "integer zeros other than 8 need -scale*zero to be an fp16 (Q4_1)"])
    single_file = True
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

    @classmethod
    def check_writable(cls, source: Source) -> list[str]:
        problems = []
        for name in source.layer_names():
            try:
                encode_layer(source.read_layer(name).replace(name=name))
            except UnsupportedError as exc:
                problems.append(f"{name}: {exc.message}")
        return problems
