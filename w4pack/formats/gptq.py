"""GPTQ family: AutoGPTQ, GPTQModel (``gptq`` = v1 and ``gptq_v2``), GPTQ-for-LLaMa (.safetensors / .pt).

Reading decodes the peer's bytes exactly as the peers' kernels do (see ../shared/reference/formats-gptq.md):

* ``qweight`` int32 [K*b/32, N]: codes as an LSB-first bit stream along K (3-bit values straddle words);
* ``qzeros``  int32 [G, N*b/32]: zero fields, the same stream along N; v1 stores ``z - 1`` and readers
  compute ``(field + 1) & (2**b - 1)`` ("masking"), v2 stores ``z``;
* ``scales``  [G, N] in the stored dtype; ``g_idx`` int32 [K] (act-order makes it a permutation of groups);
* ``bias`` [N] when the Linear had one.

Metadata is checked against the tensors: bits and group size must agree with the shapes (else
BadInputError naming file and tensor), and symmetric layers whose zero fields say the other version
than the config are read as what they hold, with a warning and a note in the source info. A version the caller
names (``--from gptq-v2``, ``checkpoint_format=``) decides only where neither tells; one they contradict is refused.

Writing produces v1 by default (what the ecosystem reads) or v2 (``checkpoint_format="gptq_v2"``,
``--to gptq-v2``). v1 cannot store a zero point of 0 or 2**b unambiguously, so such layers are refused
before anything is written, naming the way out.
"""
from __future__ import annotations

import math
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._version import __version__
from ..store.atomic import AtomicFolder, is_disk_full, write_failure
from ..core import fastpath
from ..core.canonical import CanonicalLayer
from ..store.checkpoint import parse_size
from ..core.dtypes import FLOAT_DTYPES
from ..errors import BadInputError, IOFailure, UnsupportedError, W4PackError, W4PackWarning
from ..store.folder import brief, copy_side_files, is_json_int, read_json as _read_json, side_files, write_json
from ..core.layout import PackedLayer, group_structure, pack_with_qweight
from ..progress import Progress
from ..core.scratch import ScratchPool
from ..store.safetensors import dtype_to_st
from ..store import open_tensors
from ..store.names import PT_SUFFIXES, SIDE_FILES
from ..store.shards import PlannedShards, ShardEntry
from ._bitpack import STREAM_BITS, pack_last, unpack_last
from ._patterns import backtracking
from .base import PICKLE_FILES, SAFETENSORS_FILES, WAY_OUT, Capabilities, Format, Source, TensorData

__all__ = ["GPTQFormat", "GPTQv2Format", "GPTQSource", "GPTQWarning", "write_gptq", "V1", "V2"]

V1 = "gptq"
V2 = "gptq_v2"
_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")
_CONFIG_FILES = ("quantize_config.json", "quant_config.json")
DEFAULT_MAX_SHARD = "4GB"


class GPTQWarning(W4PackWarning):
    """The checkpoint's metadata contradicts its tensors (e.g. a "gptq" config over v2 zero points)."""


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _ones_pattern(bits: int) -> int:
    """The int32 word with a 1 in every field: what GPTQModel subtracts per word to write v1."""
    return sum(1 << (bits * j) for j in range(32 // bits))


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
_SYNONYMS = {"w_bit": "bits", "wbits": "bits", "q_group_size": "group_size", "groupsize": "group_size"}


#: config keys w4pack reads (synonyms included) and the JSON type each must have; null means "not stated"
_INT_KEYS = ("bits", "w_bit", "wbits", "group_size", "q_group_size", "groupsize")
_BOOL_KEYS = ("sym", "desc_act", "static_groups", "true_sequential", "is_marlin_format", "lm_head")
_STR_KEYS = ("quant_method", "checkpoint_format", "format", "pack_dtype")


def _check_settings(doc: dict[str, Any], file: str, where: str) -> None:
    """Refuse mistyped settings: int() read "x" as a crash and 128.5 as 128, bool() read "false" as True."""
    for key, value in doc.items():
        if value is None:
            continue
        if key in _INT_KEYS:
            if not is_json_int(value):
                raise BadInputError(f"{where}{key} must be an integer, got {brief(value)}", file=file)
            if key in ("group_size", "q_group_size", "groupsize") and (value == 0 or value < -1):
                raise BadInputError(f"{where}{key} must be a positive integer or -1, got {value}", file=file)
        elif key in _BOOL_KEYS and not isinstance(value, bool):
            raise BadInputError(f"{where}{key} must be true or false, got {brief(value)}", file=file)
        elif key in _STR_KEYS and not isinstance(value, str):
            raise BadInputError(f"{where}{key} must be a string, got {brief(value)}", file=file)


def _check_config(doc: dict[str, Any], file: str, where: str = "") -> None:
    """Types of one quantization config (``where`` prefixes the key names) and of its ``dynamic`` rules."""
    _check_settings(doc, file, where)
    dynamic = doc.get("dynamic")
    if dynamic is None:
        return
    if not isinstance(dynamic, dict):
        raise BadInputError(f"{where}dynamic must be an object of pattern: overrides, got {brief(dynamic)}", file=file)
    for pattern, overrides in dynamic.items():
        key = f"{where}dynamic[{brief(pattern)}]"
        regex = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        try:
            re.compile(regex)
        except re.error as exc:
            raise BadInputError(f"{key}: not a valid regular expression ({exc})", file=file) from None
        risk = backtracking(regex)
        if risk:
            raise BadInputError(f"{key}: the pattern {risk}: matching it against a module name can take "
                                "exponential time; write the pattern without it", file=file)
        if not isinstance(overrides, dict):
            raise BadInputError(f"{key} must be an object of overrides, got {brief(overrides)}", file=file)
        _check_settings(overrides, file, f"{key}.")


def _normalise_qc(qc: dict[str, Any]) -> dict[str, Any]:
    out = dict(qc)
    for old, new in _SYNONYMS.items():
        if old in out and new not in out:
            out[new] = out[old]
    return out


def _quant_config(root: Path) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(quantization config, HF config.json, notes). quantize_config.json wins over config.json on conflict."""
    notes: list[str] = []
    hf: dict[str, Any] = {}
    cpath = root / "config.json"
    if cpath.is_file():
        doc = _read_json(cpath)
        if not isinstance(doc, dict):
            raise BadInputError("config.json is not a JSON object", file=str(cpath))
        hf = doc
    qc: dict[str, Any] = {}
    from_hf = hf.get("quantization_config")
    if isinstance(from_hf, dict):
        _check_config(from_hf, str(cpath), "quantization_config.")
        qc = _normalise_qc(from_hf)
    for name in _CONFIG_FILES:
        p = root / name
        if p.is_file():
            doc = _read_json(p)
            if not isinstance(doc, dict):
                raise BadInputError("not a JSON object", file=str(p))
            _check_config(doc, str(p))
            doc = _normalise_qc(doc)
            for key in ("bits", "group_size", "sym", "desc_act", "checkpoint_format"):
                if key in qc and key in doc and qc[key] != doc[key]:
                    notes.append(f"{name} says {key}={doc[key]!r} but config.json says {qc[key]!r}; using {name}")
            qc = {**qc, **doc}
            break
    return qc, hf, notes


def _declared_version(qc: dict[str, Any]) -> str:
    fmt = _named_format(qc) or V1
    if fmt in (V1, V2):
        return fmt
    # an unknown name may store anything, zero points v1 or v2 among them: read as v1, it would shift every zero
    raise UnsupportedError(f"GPTQ checkpoint_format {fmt!r} is not one w4pack knows; only 'gptq' (v1) and 'gptq_v2' "
                           "are readable (--from gptq or --from gptq-v2 reads it as that version)")


def _named_format(qc: dict[str, Any]) -> str | None:
    """``checkpoint_format`` (else ``format``) lower-cased, None when neither is given; the layouts w4pack cannot
    read are refused here, --from or not."""
    named = qc.get("checkpoint_format") or qc.get("format")
    if not named:
        return None
    fmt = str(named).lower()
    if fmt in ("gptq_p", "marlin", "bitblas", "ipex", "qqq"):
        raise UnsupportedError(f"GPTQ checkpoint_format {fmt!r} stores a different layout; only 'gptq' (v1) and "
                               "'gptq_v2' are readable")
    return fmt


def _stated_version(qc: dict[str, Any]) -> str | None:
    """The version the config itself names (``checkpoint_format``, else ``format``), or None when it names none
    or a name w4pack does not know: a missing key says nothing, so a named --from may decide (a v1 default would
    contradict every v2 --from)."""
    fmt = _named_format(qc)
    return fmt if fmt in (V1, V2) else None


def _config_naming(root: Path, keys: tuple[str, ...] = ("checkpoint_format", "format")) -> Path:
    """The config file whose ``keys`` (the version's by default) the reader took: quantize_config.json wins."""
    for name in _CONFIG_FILES:
        if (root / name).is_file():
            doc = _read_json(root / name)
            if isinstance(doc, dict) and any(doc.get(k) for k in keys):
                return root / name
    return root / "config.json"


#: how a forced version was named: the CLI's --from and the Python option both, since the reader sees only the option
_NAMED = {V2: "--from gptq-v2 (Python: checkpoint_format='gptq_v2')", V1: "checkpoint_format='gptq'"}
_LABEL = {V1: "GPTQ v1", V2: "GPTQ v2"}
#: what to do instead, per forced version
_INSTEAD = {V2: "drop --from gptq-v2, or pass --from gptq", V1: "leave checkpoint_format out"}


def _dynamic_override(dynamic: Any, module: str, file: str | None = None) -> tuple[bool, dict[str, Any]]:
    """GPTQModel ``dynamic``: the first pattern (re.match) that matches decides; ``-:`` skips the module."""
    if not isinstance(dynamic, dict):
        return False, {}
    for pattern, overrides in dynamic.items():
        try:
            if pattern.startswith("-:"):
                if re.match(pattern[2:], module):
                    return True, {}
            elif re.match(pattern.removeprefix("+:"), module):
                return False, dict(overrides) if isinstance(overrides, dict) else {}
        except re.error as exc:
            raise BadInputError(f"dynamic pattern {pattern!r} is not a valid regular expression ({exc})",
                                file=file) from None
    return False, {}


@dataclass(frozen=True)
class ModuleSettings:
    """What the config says about one module, after GPTQModel's ``dynamic`` rules: ``skip``: a ``-:`` rule names
    it (the file may hold it quantized all the same)."""

    bits: int | None
    group_size: int | None
    sym: bool | None
    skip: bool


@dataclass(frozen=True)
class GPTQConfig:
    """A GPTQ checkpoint's quantization config, parsed once before any tensor is read: quantize_config.json
    (or quant_config.json) over config.json's quantization_config, types checked, synonyms (wbits, groupsize...)
    resolved, the layouts w4pack cannot read refused. Covers AutoGPTQ, GPTQModel v1/v2 (``checkpoint_format``,
    ``dynamic``, ``meta``) and config-less GPTQ-for-LLaMa files (``empty``)."""

    bits: int | None
    group_size: int | None
    sym: bool | None
    desc_act: bool | None
    #: the declared checkpoint format, V1 or V2 (the zero fields may contradict it: see GPTQSource)
    version: str
    dynamic: dict[str, Any] | None
    base_name: str | None
    #: who wrote it, as the config says (``meta.quantizer``, GPTQModel's own keys), or None
    quantizer: str | None
    empty: bool
    #: the file the ``dynamic`` rules are reported against
    file: str
    notes: tuple[str, ...] = ()
    #: the version the config itself names, V1 or V2, or None when it names none (``version`` then defaults to V1)
    stated: str | None = None

    @classmethod
    def parse(cls, qc: dict[str, Any], notes: list[str], root: Path, label: str, bits: int | None = None,
              group_size: int | None = None, version: str | None = None) -> "GPTQConfig":
        """The config ``_quant_config(root)`` merged (``label`` names the checkpoint in errors); ``bits``,
        ``group_size`` and ``version`` (the reader's options) stand in for what the files do not say."""
        qc = dict(qc)
        qm = qc.get("quant_method")
        if qm is not None and str(qm).lower() != "gptq":
            raise UnsupportedError(f"quant_method is {qm!r}, not gptq",
                                   file=str(_config_naming(root, ("quant_method",))))
        if qc.get("is_marlin_format"):
            raise UnsupportedError("is_marlin_format: qweight was repacked for Marlin on disk; re-export it in the "
                                   "plain GPTQ layout", file=label)
        pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack_dtype != "int32":
            raise UnsupportedError(f"pack_dtype {pack_dtype} is not supported (only int32 words)", file=label)
        if bits is not None:
            qc["bits"] = int(bits)
        if group_size is not None:
            qc["group_size"] = int(group_size)
        try:
            stated = _stated_version(qc)
            version = version or _declared_version(qc)
        except UnsupportedError as exc:  # named with the config file that says it
            raise UnsupportedError(exc.message, file=str(_config_naming(root))) from None
        base_name = qc.get("model_file_base_name") if isinstance(qc.get("model_file_base_name"), str) else None
        meta_q = (qc.get("meta") or {}).get("quantizer") if isinstance(qc.get("meta"), dict) else None
        if meta_q:
            quantizer: str | None = ", ".join(map(str, meta_q if isinstance(meta_q, list) else [meta_q]))
        elif "pack_dtype" in qc or isinstance(qc.get("meta"), dict):
            quantizer = "gptqmodel (from its config keys)"
        else:
            quantizer = None
        sym, desc_act = qc.get("sym"), qc.get("desc_act")
        return cls(bits=qc.get("bits"), group_size=qc.get("group_size"), sym=None if sym is None else bool(sym),
                   desc_act=None if desc_act is None else bool(desc_act), version=version,
                   dynamic=qc.get("dynamic") if isinstance(qc.get("dynamic"), dict) else None, base_name=base_name,
                   quantizer=quantizer, empty=not qc, file=str(root / "quantize_config.json"), notes=tuple(notes),
                   stated=stated)

    def for_module(self, module: str) -> ModuleSettings:
        skip, over = _dynamic_override(self.dynamic, module, self.file)
        sym = over.get("sym", self.sym)
        return ModuleSettings(bits=over.get("bits", self.bits), group_size=over.get("group_size", self.group_size),
                              sym=None if sym is None else bool(sym), skip=skip)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """Everything about one quantized layer that the shapes and configs say, before any data is read."""

    name: str
    bits: int
    group_size: int
    in_features: int
    out_features: int
    groups: int
    sym: bool | None
    version: str
    tensors: dict[str, str]
    notes: list[str] = field(default_factory=list)
    quirks: list[str] = field(default_factory=list)


class _Shapes(NamedTuple):
    """The shapes of one layer's GPTQ tensors, checked against each other; ``k`` from g_idx when there is one."""

    qshape: tuple[int, ...]
    zshape: tuple[int, ...]
    rows: int
    n: int
    groups: int
    k: int | None


class GPTQSource(Source):
    """An opened GPTQ checkpoint (folder or single file), read layer by layer from memory maps.

    Options: ``checkpoint_format`` ("gptq"/"gptq_v2", what ``--from gptq-v2`` passes): the version where the
    checkpoint cannot tell (no checkpoint_format in its config, asymmetric zero points); one its config or its
    symmetric zero points contradict is refused, since reading it would put every zero point off by one,
    ``v1_zeros`` ("masking", the default, as AutoGPTQ/vLLM/transformers kernels decode v1 zeros; or
    "carry", as GPTQModel's own loader does: add the per-word constant back with carry), and ``bits`` /
    ``group_size`` for config-less files whose shapes cannot tell.
    """

    def __init__(self, path: Path, *, checkpoint_format: str | None = None, v1_zeros: str = "masking",
                 bits: int | None = None, group_size: int | None = None):
        self.path = Path(path)
        if v1_zeros not in ("masking", "carry"):
            raise UnsupportedError(f"v1_zeros must be 'masking' or 'carry', got {v1_zeros!r}")
        if checkpoint_format not in (None, V1, V2):
            raise UnsupportedError(f"checkpoint_format must be {V1!r} or {V2!r}, got {checkpoint_format!r}")
        self.v1_zeros = v1_zeros
        # a single weights file uses the configs beside it, if any (GPTQ-for-LLaMa files have none)
        self.root = self.path if self.path.is_dir() else self.path.parent
        qc, hf, notes = _quant_config(self.root)
        self.cfg = GPTQConfig.parse(qc, notes, self.root, str(self.path), bits, group_size, checkpoint_format)
        self.declared = self.cfg.version
        self.forced = checkpoint_format is not None
        #: a forced version that some layer's symmetric zero points confirm (then a config naming the other loses)
        self._zeros_confirm = False
        self.config = {k: v for k, v in hf.items() if k != "quantization_config"}
        self.store = open_tensors(self.path, base_name=self.cfg.base_name)
        self.producer = self._producer()
        self._gptqmodel = "gptqmodel" in self.producer.lower()
        self.notes = list(self.cfg.notes)
        self.quirks: list[str] = []
        self._plans: dict[str, _Plan] = {}
        self._scratch = ScratchPool(4)  # qweight read buffer + codes of the layers in flight
        try:
            self._plan_all()
        except BaseException:
            self.store.close()
            raise
        self.store.release_all()
        versions = sorted({p.version for p in self._plans.values()}) or [self.declared]
        self.info = {"format": "gptq", "version": versions[0] if len(versions) == 1 else "+".join(versions),
                     "producer": self.producer, "notes": self.notes, "quirks": self.quirks}

    def _producer(self) -> str:
        """Who wrote the checkpoint: the config's word, else AutoGPTQ's safetensors metadata."""
        if self.cfg.quantizer:
            return self.cfg.quantizer
        if "auto_gptq_version" in self.store.metadata:
            return f"auto_gptq:{self.store.metadata['auto_gptq_version']}"
        if self.cfg.empty:
            return "unknown (no quantization config: GPTQ-for-LLaMa style state dict)"
        return "unknown"

    # -- planning ------------------------------------------------------------------------------
    def _plan_all(self) -> None:
        names = self.store.names()
        modules = sorted({n[: -len(".qweight")] for n in names if n.endswith(".qweight")}, key=_natural_key)
        contradicted: list[str] = []
        wrapped = 0
        for m in modules:
            plan = self._plan(m)
            self._decide_version(plan)
            if plan.version != self.declared:
                contradicted.append(m)
            wrapped += sum(1 for q in plan.quirks if q.startswith("v1-zero-wrap"))
            self._plans[m] = plan
        if self.forced:
            self._refuse_contradicting_config()
        claimed = {t for p in self._plans.values() for t in p.tensors.values()}
        self._passthrough = [n for n in names if n not in claimed]
        if contradicted:
            other = V2 if self.declared == V1 else V1
            msg = (f"metadata says checkpoint_format {self.declared!r} but the zero points of {len(contradicted)} "
                   f"symmetric layer(s) (first: {contradicted[0]}) are stored as {other}; read as {other}")
            self.notes.append(msg)
            warnings.warn(f"{self.path}: {msg}", GPTQWarning, stacklevel=3)
        if wrapped:
            self.quirks.append(f"v1-zero-wrap in {wrapped} layer(s): v1 zero fields holding all ones are decoded as "
                               "zero 0, as masking v1 kernels do (AutoGPTQ, vLLM, transformers); see the layer notes")

    def _plan(self, m: str) -> _Plan:
        """A layer's plan from its tensors' shapes and the config (no data read unless a group size must be
        inferred from g_idx)."""
        t = self._layer_tensors(m)
        cfg = self.cfg.for_module(m)
        notes: list[str] = []
        if cfg.skip:
            notes.append("the config's dynamic rules skip this module, but the file holds it quantized; read as "
                         "quantized")
        sh = self._shapes(t)
        b, k = self._bit_width(t, sh, cfg.bits, notes)
        gs = self._group_size(t, k, sh.groups, cfg.group_size, notes)
        if "bias" in t:
            bdt, bshape = self.store.info(t["bias"])
            if bdt not in FLOAT_DTYPES or bshape != (sh.n,):
                raise self._bad(t, "bias", f"bias must be a float [N={sh.n}] vector, got {bdt} {list(bshape)}")
        return _Plan(name=m, bits=b, group_size=gs, in_features=k, out_features=sh.n, groups=sh.groups, sym=cfg.sym,
                     version=self.declared, tensors=t, notes=notes)

    def _bad(self, t: dict[str, str], key: str, msg: str) -> BadInputError:
        return BadInputError(msg, file=self.store.where[t[key]], tensor=t[key])

    def _layer_tensors(self, m: str) -> dict[str, str]:
        """suffix -> tensor name of module ``m``; qweight, qzeros and scales must be there."""
        st = self.store
        t = {s: f"{m}.{s}" for s in _SUFFIXES if f"{m}.{s}" in st}
        qname = t["qweight"]
        qfile = st.where[qname]
        if "qzeros" not in t:
            if f"{m}.zeros" in st:
                raise UnsupportedError("float 'zeros' instead of 'qzeros': a pre-g_idx GPTQ-for-LLaMa checkpoint "
                                       "(March 2023), not supported", file=qfile, tensor=f"{m}.zeros")
            raise BadInputError(f"quantized layer has qweight but no {m}.qzeros", file=qfile, tensor=qname)
        if "scales" not in t:
            raise BadInputError(f"quantized layer has qweight but no {m}.scales", file=qfile, tensor=qname)
        return t

    def _shapes(self, t: dict[str, str]) -> _Shapes:
        """The dtypes and shapes of qweight, scales, qzeros and g_idx, checked against each other."""
        st = self.store
        qdt, qshape = st.info(t["qweight"])
        if qdt not in ("int32", "uint32") or len(qshape) != 2:
            raise self._bad(t, "qweight", f"qweight must be int32 [K*bits/32, N], got {qdt} {list(qshape)}")
        sdt, sshape = st.info(t["scales"])
        if sdt not in FLOAT_DTYPES or len(sshape) != 2:
            raise self._bad(t, "scales", f"scales must be float16/bfloat16/float32 [G, N], got {sdt} {list(sshape)}")
        zdt, zshape = st.info(t["qzeros"])
        if zdt not in ("int32", "uint32") or len(zshape) != 2:
            raise self._bad(t, "qzeros", f"qzeros must be int32 [G, N*bits/32], got {zdt} {list(zshape)}")
        rows, n = qshape
        groups = sshape[0]
        if sshape[1] != n or n == 0 or rows == 0 or groups == 0:
            raise self._bad(t, "qweight", f"qweight shape {list(qshape)} and scales shape {list(sshape)} disagree "
                            "on N (or are empty)")
        if zshape[0] != groups:
            raise self._bad(t, "qzeros", f"qzeros has {zshape[0]} group rows but scales has {groups}")
        k = None
        if "g_idx" in t:
            gdt, gshape = st.info(t["g_idx"])
            if gdt not in ("int32", "int64", "int16") or len(gshape) != 1:
                raise self._bad(t, "g_idx", f"g_idx must be an integer [K] vector, got {gdt} {list(gshape)}")
            k = gshape[0]
        return _Shapes(qshape=tuple(qshape), zshape=tuple(zshape), rows=rows, n=n, groups=groups, k=k)

    def _bit_width(self, t: dict[str, str], sh: _Shapes, cfg_bits: int | None, notes: list[str]) -> tuple[int, int]:
        """(bits, K): from g_idx's length where there is one (checked against the config), else from the config,
        else from the qzeros shape."""
        rows, n, k, qshape, zshape = sh.rows, sh.n, sh.k, list(sh.qshape), list(sh.zshape)
        qname = t["qweight"]
        qfile = self.store.where[qname]
        zbits = _ratio(zshape[1] * 32, n)
        if k is not None:
            kb = _ratio(rows * 32, k)
            if kb not in STREAM_BITS:
                raise self._bad(t, "qweight", f"qweight shape {qshape} holds {rows * 32}/{k} bits per code for K={k} "
                                f"(from g_idx): truncated or not a GPTQ qweight")
            b = int(kb)
            if cfg_bits is not None and int(cfg_bits) != b:
                raise self._bad(t, "qweight", f"qweight shape {qshape} means {b}-bit codes for K={k}, but the config "
                                f"says bits={cfg_bits}")
        elif cfg_bits is not None:
            b = int(cfg_bits)
            if b not in STREAM_BITS:
                raise UnsupportedError(f"bits={b} is not supported (GPTQ stream bits: {STREAM_BITS})",
                                       file=qfile, tensor=qname)
            if (rows * 32) % b:
                raise self._bad(t, "qweight", f"qweight has {rows} rows, not a whole number of {b}-bit codes per "
                                "column")
            k = rows * 32 // b
            notes.append("no g_idx tensor: groups taken as k // group_size")
        elif zbits in STREAM_BITS:
            b = int(zbits)
            k = rows * 32 // b
            notes.append(f"no g_idx and no config: bits={b} inferred from the qzeros shape")
        else:
            raise BadInputError("cannot tell the bit width: no g_idx, no config bits, and qzeros shape "
                                f"{zshape} does not say it", file=qfile, tensor=qname)
        if zbits != b:
            raise self._bad(t, "qzeros", f"qzeros shape {zshape} does not hold {b}-bit zeros for N={n} "
                            f"(expected [{sh.groups}, {n * b // 32 if (n * b) % 32 == 0 else f'{n}*{b}/32'}])")
        if (k * b) % 32 or rows != k * b // 32:
            raise self._bad(t, "qweight", f"qweight shape {qshape} does not hold K={k} {b}-bit codes "
                            f"(expected [{k * b / 32:g}, {n}])")
        return b, k

    def _group_size(self, t: dict[str, str], k: int, groups: int, cfg_gs: int | None, notes: list[str]) -> int:
        """The config's group size checked against G; else inferred from G or from g_idx."""
        if cfg_gs is not None:
            gs = int(cfg_gs)
            if gs == 0 or gs < -1:
                raise BadInputError(f"group_size {gs} is invalid", file=self.store.where[t["qweight"]],
                                    tensor=t["qweight"])
            want_g = 1 if gs == -1 else math.ceil(k / gs)
            if want_g != groups:
                raise self._bad(t, "scales", f"scales has {groups} groups but K={k} with group_size={gs} needs "
                                f"{want_g}")
        elif groups == 1:
            gs = -1
        elif "g_idx" in t:
            g_idx = np.asarray(self.store.get(t["g_idx"]))
            if g_idx.size and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
                raise self._bad(t, "g_idx", f"g_idx values {int(g_idx.min())}..{int(g_idx.max())} outside "
                                f"0..{groups - 1}")
            gs = int(np.bincount(g_idx.astype(np.int64), minlength=groups).max())
            if math.ceil(k / gs) != groups:
                raise self._bad(t, "g_idx", f"g_idx group sizes are not uniform (largest {gs}, K={k}, G={groups})")
            notes.append(f"group_size={gs} inferred from g_idx (no config)")
        else:
            gs = math.ceil(k / groups)
            if math.ceil(k / gs) != groups:
                raise self._bad(t, "scales", f"cannot infer a group size for K={k} and G={groups}")
            notes.append(f"group_size={gs} inferred from the scales shape (no config)")
        return gs

    def _fields(self, plan: _Plan) -> np.ndarray:
        """Raw zero fields [G, N] as stored (no v1 offset applied)."""
        fields = unpack_last(self.store.get(plan.tensors["qzeros"]), plan.bits)[:, : plan.out_features]
        self.store.release(plan.tensors["qzeros"])  # unpack_last copied them
        return fields

    def _decide_version(self, plan: _Plan) -> None:
        """Trust the metadata, unless a symmetric layer's zero fields are uniformly the other version's value."""
        fields = self._fields(plan)
        half = 1 << (plan.bits - 1)
        if self.forced:
            self._refuse_contradicting_zeros(plan, fields)
        if not self.forced and plan.sym is not False and fields.size:
            lo, hi = int(fields.min()), int(fields.max())
            if lo == hi == half and self.declared == V1:
                plan.version = V2
            elif lo == hi == half - 1 and self.declared == V2:
                plan.version = V1
            if plan.version != self.declared:
                plan.notes.append(f"metadata says {self.declared!r}, but every zero field is {lo} (the {plan.version} "
                                  f"encoding of the symmetric zero {half}); read as {plan.version}")
                plan.quirks.append("checkpoint-format-contradicted")
        if plan.version == V1:
            mask = (1 << plan.bits) - 1
            wrapped = int(np.count_nonzero(fields == mask))
            if wrapped:
                plan.quirks.append(f"v1-zero-wrap: {wrapped} zero field(s)")
                plan.notes.append(
                    f"{wrapped} v1 zero field(s) hold all ones and decode to zero 0 as masking v1 readers compute it "
                    f"((field+1) & {mask}; AutoGPTQ, vLLM, transformers). A real zero 0 cannot be stored in v1: "
                    "AutoGPTQ's packer then forces every higher field of that word to all ones, GPTQModel's borrows 1 "
                    "from the next field; these zeros are what the kernels use, not necessarily what was intended")
                if self._gptqmodel and plan.bits in (2, 4, 8):
                    carry = self._carry_zeros(plan)
                    masked = (fields.astype(np.int32) + 1) & mask
                    diff = int(np.count_nonzero(carry != masked))
                    if diff:
                        plan.notes.append(f"GPTQModel's own loader (adds {_ones_pattern(plan.bits):#x} per word, with "
                                          f"carry) reads {diff} zero(s) differently; open with v1_zeros='carry' to "
                                          "read them its way")

    def _refuse_contradicting_zeros(self, plan: _Plan, fields: np.ndarray) -> None:
        """A forced version on a symmetric layer whose zero fields all hold the other version's encoding of the
        symmetric zero 2**(b-1) is a mistaken --from: read so, every zero point is off by one, silently."""
        if plan.sym is False or not fields.size:
            return
        lo, hi = int(fields.min()), int(fields.max())
        half = 1 << (plan.bits - 1)
        shown = {half - 1: V1, half: V2}.get(lo) if lo == hi else None
        if shown == self.declared:
            self._zeros_confirm = True
        elif shown is not None:
            detected = "gptq-v2" if shown == V2 else "gptq"
            qz = plan.tensors["qzeros"]
            raise BadInputError(
                f"{_NAMED[self.declared]} reads the zero points as {_LABEL[self.declared]}, but every zero field of "
                f"this symmetric layer is {lo}, the {_LABEL[shown]} encoding of the zero {half} (detected format: "
                f"{detected}; {_INSTEAD[self.declared]})", file=self.store.where[qz], tensor=qz)

    def _refuse_contradicting_config(self) -> None:
        """A forced version the config's own checkpoint_format contradicts, with no symmetric zero points to
        confirm it: the config is the only evidence, and it says the other version."""
        stated = self.cfg.stated
        if stated is None or stated == self.declared or self._zeros_confirm:
            return
        cfg = _config_naming(self.root)
        raise BadInputError(
            f"{_NAMED[self.declared]} reads the zero points as {_LABEL[self.declared]}, but the config says "
            f"checkpoint_format {stated!r} (detected format: {'gptq-v2' if stated == V2 else 'gptq'}; "
            f"{_INSTEAD[self.declared]}, or correct the config if it is wrong)", file=str(cfg))

    def _carry_zeros(self, plan: _Plan) -> np.ndarray:
        words = np.asarray(self.store.get(plan.tensors["qzeros"])).view(np.uint32)
        fixed = (words.astype(np.uint64) + _ones_pattern(plan.bits)) & 0xFFFFFFFF
        return unpack_last(fixed.astype(np.uint32), plan.bits)[:, : plan.out_features].astype(np.int32)

    # -- Source interface ----------------------------------------------------------------------
    def layer_names(self) -> list[str]:
        return list(self._plans)

    def passthrough_names(self) -> list[str]:
        return list(self._passthrough)

    def read_tensor(self, name: str) -> TensorData:
        if name not in self.store:
            raise BadInputError("no such tensor", file=str(self.path), tensor=name)
        dt, _shape = self.store.info(name)
        return TensorData(self.store.read_copy(name), dt)

    def tensor_span(self, name: str) -> tuple[str, int, int, str, tuple[int, ...]] | None:
        """Where a pass-through tensor's bytes lie verbatim (see TensorStore.span), for a kernel-side copy."""
        if name not in self.store:
            raise BadInputError("no such tensor", file=str(self.path), tensor=name)
        return self.store.span(name)

    def side_files(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        return side_files(self.path, SIDE_FILES)

    def plan(self, name: str) -> _Plan:
        if name not in self._plans:
            raise BadInputError("no such quantized layer", file=str(self.path), tensor=name)
        return self._plans[name]

    def raw_fields(self, name: str) -> np.ndarray:
        """The stored zero fields [G, N] of a layer, before any v1 offset (for inspection and tests)."""
        return self._fields(self.plan(name))

    def read_layer(self, name: str) -> CanonicalLayer:
        return self._read(name, with_codes=True)

    def read_packed(self, name: str) -> PackedLayer | None:
        """The layer in layout v1 straight from qweight (one native pass, no codes array), exactly what
        ``layout.pack(read_layer(name))`` gives; None where that fused path does not apply (not 4-bit,
        no registered ``gptq_pack`` fast path), and the caller then packs the canonical layer."""
        plan = self.plan(name)
        fast = fastpath.get("gptq_pack")
        if fast is None or plan.bits != 4:
            return None
        layer = self._read(name, with_codes=False)
        st, qname = self.store, plan.tensors["qweight"]
        perm, _gs = group_structure(layer)
        qbuf = np.asarray(st.get(qname)) if st.populate(qname) else st.read_into(qname, self._scratch)
        try:
            qweight = fast(qbuf, plan.out_features, plan.in_features, perm, name)
        finally:
            del qbuf
            st.release_all()
        return pack_with_qweight(layer, qweight)

    def _read(self, name: str, with_codes: bool) -> CanonicalLayer:
        plan = self.plan(name)
        st, t, b = self.store, plan.tensors, plan.bits
        codes = self._codes(plan) if with_codes else \
            np.broadcast_to(np.zeros((), dtype=np.uint8), (plan.out_features, plan.in_features))
        zero_mode, zeros = self._zero_points(plan)
        sdt, _ = st.info(t["scales"])
        scales = np.ascontiguousarray(np.asarray(st.get(t["scales"])).T)
        g_idx = self._g_idx(plan)
        bias = bias_dtype = None
        if "bias" in t:
            bias_dtype, _ = st.info(t["bias"])
            bias = np.array(st.get(t["bias"]))
        if with_codes:  # everything above is copied out of the map (or refaults harmlessly)
            st.release_all()
        layer = CanonicalLayer(codes=codes, scales=scales, bits=b, group_size=plan.group_size, zero_mode=zero_mode,
                               zeros=zeros, g_idx=g_idx, scale_dtype=sdt, bias=bias, bias_dtype=bias_dtype,
                               source=self._layer_source(plan), name=name)
        try:
            return layer.validate(check_codes=False)  # split out of a b-bit stream: always < 2**b
        except BadInputError as exc:
            raise self._named(exc, t) from None

    def _codes(self, plan: _Plan) -> np.ndarray:
        """codes [N, K] from qweight. Page faults one by one on the map cost more than the unpack: map the pages in
        one call where the kernel can (MADV_POPULATE_READ), else read with pread into a recycled buffer."""
        st, qname = self.store, plan.tensors["qweight"]
        qbuf = np.asarray(st.get(qname)) if st.populate(qname) else st.read_into(qname, self._scratch)
        codes = _unpack_qweight(qbuf, plan.bits, self._scratch)
        del qbuf
        return codes

    def _zero_points(self, plan: _Plan) -> tuple[str, np.ndarray | None]:
        """(zero mode, zeros [N, G]): v2 fields as stored, v1 fields + 1 (masking, or GPTQModel's carry); a layer
        whose zeros are all 2**(b-1) is symmetric unless the config says otherwise."""
        b = plan.bits
        fields = self._fields(plan)
        if plan.version == V2:
            zeros = fields.astype(np.int32)
        elif self.v1_zeros == "carry" and b in (2, 4, 8):
            zeros = self._carry_zeros(plan)
        else:
            zeros = (fields.astype(np.int32) + 1) & ((1 << b) - 1)
        zeros = np.ascontiguousarray(zeros.T)
        if plan.sym is not False and bool(np.all(zeros == 1 << (b - 1))):
            return "none", None
        if plan.sym:
            plan_note = "config says sym=True but the zero points vary; kept as integer zeros"
            if plan_note not in plan.notes:
                plan.notes.append(plan_note)
        return "int", zeros

    def _g_idx(self, plan: _Plan) -> np.ndarray | None:
        t = plan.tensors
        if "g_idx" not in t:
            if self.cfg.desc_act:
                # act-order permutes the groups over the columns: without g_idx that order is lost, and reading the
                # layer as k // group_size would silently give other weights
                qw = t["qweight"]
                raise BadInputError(f"the config says desc_act (act-order) but layer {plan.name} has no g_idx: its "
                                    "column-to-group order is lost", file=self.store.where[qw], tensor=qw)
            return None
        raw_g = np.asarray(self.store.get(t["g_idx"]))
        if raw_g.size and (int(raw_g.min()) < 0 or int(raw_g.max()) >= plan.groups):
            raise BadInputError(f"g_idx values {int(raw_g.min())}..{int(raw_g.max())} lie outside the "
                                f"{plan.groups} groups", file=self.store.where[t["g_idx"]], tensor=t["g_idx"])
        return raw_g.astype(np.int32)

    def _layer_source(self, plan: _Plan) -> dict[str, Any]:
        """The layer's provenance for the manifest: version, notes and quirks."""
        source: dict[str, Any] = {"format": "gptq", "version": plan.version}
        if plan.notes:
            source["notes"] = list(plan.notes)
        if plan.quirks:
            source["quirks"] = list(plan.quirks)
        if self.v1_zeros == "carry" and plan.version == V1:
            source.setdefault("notes", []).append("v1 zeros read GPTQModel's way (per-word add with carry)")
        return source

    def _named(self, exc: BadInputError, t: dict[str, str]) -> BadInputError:
        """A validation error without a file, pinned on the tensor its message is about."""
        if exc.file is None:
            key = next((k for k, word in (("scales", "scale"), ("g_idx", "g_idx"), ("qzeros", "zero"),
                                          ("bias", "bias")) if word in exc.message and k in t), "qweight")
            exc.file = self.store.where[t[key]]
            exc.tensor = t[key]
            exc.args = (exc.one_line(),)
        return exc

    def close(self) -> None:
        self._scratch.clear()
        self.store.close()


def _unpack_qweight(words: np.ndarray, bits: int, pool: Any = None) -> np.ndarray:
    """qweight [K*b/32, N] -> codes uint8 [N, K]: the registered ``gptq_unpack`` fast path (one native
    pass for 4 and 8 bits) where it applies, the numpy bit stream (the spec, _bitpack.unpack_last)
    otherwise. ``pool``: a scratch.ScratchPool to take the output from."""
    fast = fastpath.get("gptq_unpack")
    codes = fast(words, bits, pool) if fast is not None else None
    if codes is None:
        codes = unpack_last(np.ascontiguousarray(np.asarray(words).T), bits)
    return codes


def _ratio(num: int, den: int) -> float:
    """num/den as an int when exact, else a non-integer float (never equal to a bit width)."""
    if den == 0:
        return -1.0
    return num // den if num % den == 0 else num / den


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
class GPTQCapabilities(Capabilities):
    """What GPTQ can hold: integer zeros only, codes and zeros as whole int32 streams, and in v1 only the
    zero points 1..2**b-1 (the stored field is z-1, and readers disagree about a stored -1)."""

    def __init__(self, version: str):
        super().__init__(bits=STREAM_BITS, zero_modes=("none", "int"), group_sizes=None, act_order=True,
                         scale_dtypes=("float16", "bfloat16", "float32"))
        self.version = version

    def check(self, layer: CanonicalLayer) -> str | None:
        if layer.zero_mode == "float":
            return ("float-minimum zero points (w = s*q + m): GPTQ stores integer zero points only (way out: "
                    f"{WAY_OUT}, or --to gguf where the layer has GGUF Q4_1's blocks of 32 and fp16 factors)")
        reason = super().check(layer)
        if reason:
            return reason
        b = layer.bits
        if (layer.in_features * b) % 32:
            return (f"K={layer.in_features} in_features: {b}-bit qweight needs K*{b} to be a multiple of 32 "
                    f"(whole int32 words per column; way out: {WAY_OUT})")
        if (layer.out_features * b) % 32:
            return (f"N={layer.out_features} out_features: {b}-bit qzeros need N*{b} to be a multiple of 32 "
                    f"(whole int32 words per group; way out: {WAY_OUT})")
        if layer.zero_mode == "int":
            z = layer.zeros
            hi = (1 << b) - 1
            if self.version == V1:
                bad = int(np.count_nonzero((z < 1) | (z > hi)))
                if bad:
                    vals = sorted({int(v) for v in np.unique(z[(z < 1) | (z > hi)])})
                    return (f"zero point(s) {vals} in {bad} group(s): GPTQ v1 stores zero-1, so a zero of 0 (or "
                            f"{1 << b}) becomes a field that readers decode differently (masking kernels read 0, "
                            "GPTQModel's loader borrows from the neighbouring field; way out: "
                            + (f"{WAY_OUT})" if np.any(z > hi) else
                               "--to gptq-v2, checkpoint_format='gptq_v2' in the Python API)"))
            else:
                bad = int(np.count_nonzero(z > hi))
                if bad:
                    return (f"zero point {1 << b} in {bad} group(s): a {b}-bit GPTQ v2 field holds 0..{hi} "
                            f"(way out: {WAY_OUT})")
        return None


def encode_layer(layer: CanonicalLayer, version: str = V1) -> dict[str, tuple[np.ndarray, str | None]]:
    """The GPTQ tensors of one canonical layer: suffix -> (array, dtype name). Assumes the layer passed
    GPTQCapabilities(version).check."""
    b = layer.bits
    qweight = np.ascontiguousarray(pack_last(layer.codes, b).T)  # [K*b/32, N]
    z = layer.zero_points()  # [N, G] int32
    fields = z - 1 if version == V1 else z
    qzeros = pack_last(np.ascontiguousarray(fields.T), b)  # [G, N*b/32]
    out: dict[str, tuple[np.ndarray, str | None]] = {
        "qweight": (qweight, None),
        "qzeros": (qzeros, None),
        "scales": (np.ascontiguousarray(layer.scales.T), layer.scale_dtype),
        "g_idx": (np.ascontiguousarray(layer.g_idx, dtype=np.int32), None),
    }
    if layer.bias is not None:
        out["bias"] = (np.ascontiguousarray(layer.bias), layer.bias_dtype)
    return out


def _layer_entries(name: str, meta: dict[str, Any]) -> list[ShardEntry]:
    """The GPTQ tensors ``encode_layer`` will produce for a layer, known from its shape alone."""
    n, k, b, g = meta["out_features"], meta["in_features"], meta["bits"], meta["groups"]
    item = {"F16": 2, "BF16": 2, "F32": 4}
    sdt = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
    out = [ShardEntry(f"{name}.qweight", (k * b // 32, n), "I32", k * b // 32 * n * 4),
           ShardEntry(f"{name}.qzeros", (g, n * b // 32), "I32", g * n * b // 32 * 4),
           ShardEntry(f"{name}.scales", (g, n), sdt[meta["scale_dtype"]], g * n * item[sdt[meta["scale_dtype"]]]),
           ShardEntry(f"{name}.g_idx", (k,), "I32", k * 4)]
    if meta["bias_dtype"] is not None:
        bdt = sdt[meta["bias_dtype"]]
        out.append(ShardEntry(f"{name}.bias", (n,), bdt, n * item[bdt]))
    return out


def _st_name(dtype: str) -> str | None:
    """The dtype name to hand to the safetensors writer: only bfloat16 differs from numpy's own."""
    return "bfloat16" if dtype == "bfloat16" else None


def _block_prefixes(names: list[str]) -> set[str]:
    """'model.layers.' from 'model.layers.3.mlp.up_proj': where the repeated blocks live."""
    out = set()
    for n in names:
        m = re.match(r"^(.*\.)\d+\.", n)
        if m:
            out.add(m.group(1))
    return out


def gptq_quantization_config(metas: dict[str, dict[str, Any]], passthrough: list[str],
                             passthrough_2d: set[str], version: str) -> dict[str, Any]:
    """The quantization_config (= quantize_config.json) for the written layers.

    Global bits/group_size/sym are the most common; other layers get GPTQModel ``dynamic`` overrides
    ("+:^name$"; sym is true exactly for zero mode "none", so a re-read gives the same canonical layer),
    and 2-D ``.weight`` tensors left unquantized inside the quantized blocks get "-:" rules so
    loaders do not expect them quantized.
    """
    if metas:
        bits = Counter(m["bits"] for m in metas.values()).most_common(1)[0][0]
        gs = Counter(m["group_size"] for m in metas.values()).most_common(1)[0][0]
    else:
        bits, gs = 4, 128
    n_sym = sum(1 for m in metas.values() if m["sym"])
    sym = n_sym * 2 >= len(metas)
    dynamic: dict[str, dict[str, Any]] = {}
    for name, m in metas.items():
        over: dict[str, Any] = {}
        if m["bits"] != bits:
            over["bits"] = m["bits"]
        if m["group_size"] != gs:
            over["group_size"] = m["group_size"]
        if m["sym"] != sym:
            over["sym"] = m["sym"]
        if over:
            dynamic["+:^" + re.escape(name) + "$"] = over
    blocks = _block_prefixes(list(metas))
    for t in passthrough:
        if t in passthrough_2d and t.endswith(".weight") and any(t.startswith(b) for b in blocks):
            mod = t[: -len(".weight")]
            if mod not in metas:
                dynamic["-:^" + re.escape(mod) + "$"] = {}
    qc: dict[str, Any] = {
        "bits": bits,
        "group_size": gs,
        "desc_act": any(m["act_order"] for m in metas.values()),
        "sym": sym,
        "static_groups": False,
        "lm_head": "lm_head" in metas,
        "quant_method": "gptq",
        "checkpoint_format": version,
        "format": version,
        "pack_dtype": "int32",
        "model_file_base_name": "model",
        "meta": {"quantizer": [f"w4pack:{__version__}"]},
    }
    if dynamic:
        qc["dynamic"] = dynamic
    return qc


def write_gptq(source: Source, out: str | os.PathLike[str], *, force: bool = False,
               checkpoint_format: str = V1, max_shard_size: int | str = DEFAULT_MAX_SHARD,
               show_progress: bool | None = None, **_other: Any) -> Path:
    """Write ``source`` as a GPTQ checkpoint folder (v1 by default, or ``checkpoint_format='gptq_v2'``).

    Every layer is checked first; anything GPTQ cannot hold raises UnsupportedError before a byte is
    written. The folder appears atomically: model.safetensors (or shards + index), config.json with
    quantization_config, quantize_config.json, and the source's side files. Options meant for other
    formats are ignored.

    Example::

        with open_source("llama-w4/") as src:
            write_gptq(src, "llama-gptq/", checkpoint_format="gptq_v2")
    """
    if checkpoint_format not in (V1, V2):
        raise UnsupportedError(f"checkpoint_format must be {V1!r} or {V2!r}, got {checkpoint_format!r}")
    max_shard = parse_size(max_shard_size)
    if max_shard < 1024:
        raise BadInputError(f"max shard size {max_shard} bytes is too small")
    names = source.layer_names()
    passthrough = source.passthrough_names()
    metas = _layer_metas(source, names, GPTQCapabilities(checkpoint_format))  # 1. refuse up front
    claimed = {f"{n}.{s}" for n in names for s in _SUFFIXES}
    clash = [t for t in passthrough if t in claimed]
    if clash:
        raise BadInputError("pass-through tensor has the name of a quantized layer's GPTQ tensor", tensor=clash[0])
    entries, pass_2d = _shard_entries(source, names, metas, passthrough)
    with AtomicFolder(out, force=force) as tmp:  # 2. stream: one layer in memory, straight into its planned place
        _stream(source, PlannedShards(tmp, entries, max_shard), names, passthrough, checkpoint_format, Path(out),
                show_progress)
        qc = gptq_quantization_config(metas, passthrough, pass_2d, checkpoint_format)
        config = {k: v for k, v in (source.config or {}).items() if k != "quantization_config"}
        config["quantization_config"] = qc
        write_json(tmp / "config.json", config)
        write_json(tmp / "quantize_config.json", qc)
        copy_side_files(source.side_files(), tmp)
    return Path(out)


def _version_name(version: str) -> str:
    return "GPTQ v1" if version == V1 else "GPTQ v2 (gptq_v2)"


def _layer_metas(source: Source, names: list[str], caps: GPTQCapabilities) -> dict[str, dict[str, Any]]:
    """What the config and the shard plan need of each layer; UnsupportedError naming the first layer GPTQ
    cannot hold (and how many more), before a byte is written."""
    problems: list[str] = []
    metas: dict[str, dict[str, Any]] = {}
    for name in names:
        layer = source.read_layer(name)
        reason = caps.check(layer)
        if reason:
            problems.append(f"{name}: {reason}")
            continue
        metas[name] = {"bits": layer.bits, "group_size": layer.group_size, "sym": layer.zero_mode == "none",
                       "act_order": bool(layer.act_order), "out_features": layer.out_features,
                       "in_features": layer.in_features, "groups": layer.num_groups,
                       "scale_dtype": layer.scale_dtype,
                       "bias_dtype": layer.bias_dtype if layer.bias is not None else None}
        del layer
    if problems:
        more = f" (and {len(problems) - 1} more layer(s))" if len(problems) > 1 else ""
        raise UnsupportedError(f"cannot write {_version_name(caps.version)}: {problems[0]}{more}",
                               file=str(source.path))
    return metas


def _shard_entries(source: Source, names: list[str], metas: dict[str, dict[str, Any]],
                   passthrough: list[str]) -> tuple[list[ShardEntry], set[str]]:
    """Every tensor the writer will produce, in order (layers, then pass-through), and the 2-D pass-through
    tensors (the config's ``dynamic`` skips them)."""
    entries = [e for name in names for e in _layer_entries(name, metas[name])]
    pass_2d: set[str] = set()
    for tname in passthrough:
        td = source.read_tensor(tname)  # memory-mapped in every reader: only the shape is looked at here
        arr = np.asarray(td.array)
        if arr.ndim == 2:
            pass_2d.add(tname)
        entries.append(ShardEntry(tname, tuple(arr.shape), dtype_to_st(arr, _st_name(td.dtype)), arr.nbytes))
        del td, arr
    return entries, pass_2d


def _stream(source: Source, shards: PlannedShards, names: list[str], passthrough: list[str], version: str,
            out: Path, show_progress: bool | None) -> None:
    """Each layer's GPTQ tensors, then the pass-through tensors, into the planned shards. A full disk is reported
    against the destination ``out`` and the tensor being written, as the other writers say it (the shard writer
    names its file in the hidden temporary folder, which is gone by the time the message is read)."""
    current = None
    try:
        with Progress(len(names) + len(passthrough), "writing gptq", enabled=show_progress) as bar:
            for name in names:
                layer = source.read_layer(name)
                for suffix, (arr, dt) in encode_layer(layer, version).items():
                    current = f"{name}.{suffix}"
                    shards.write(current, arr, dt)
                del layer
                bar.update()
            for tname in passthrough:
                td = source.read_tensor(tname)
                current = tname
                shards.write(tname, td.array, _st_name(td.dtype))
                bar.update()
        current = None
        shards.finish()
    except IOFailure as exc:
        cause = exc.__context__
        if isinstance(cause, OSError) and is_disk_full(cause):
            raise write_failure(cause, out, tensor=current) from None
        raise
    finally:
        shards.abort()


# ---------------------------------------------------------------------------------------------
# the format
# ---------------------------------------------------------------------------------------------
def _looks_gptq_tensors(path: Path) -> bool:
    """A .qweight whose column count equals its .scales' column count (AWQ packs N, GPTQ packs K)."""
    try:
        if path.is_dir():
            files = sorted(path.glob("*.safetensors"))[:1] or sorted(
                p for p in path.iterdir() if p.suffix in PT_SUFFIXES)[:1]
            if not files:
                return False
            path = files[0]
        store = open_tensors(path)
        try:
            for n in store.names():
                if n.endswith(".qweight"):
                    m = n[: -len(".qweight")]
                    if f"{m}.scales" in store:
                        q = store.info(n)[1]
                        s = store.info(f"{m}.scales")[1]
                        return len(q) == 2 and len(s) == 2 and q[1] == s[1]
            return False
        finally:
            store.close()
    except (W4PackError, OSError):
        return False


class GPTQFormat(Format):
    name = "gptq"
    write_options = frozenset({"checkpoint_format"})
    description = "GPTQ (AutoGPTQ, GPTQModel v1/v2, GPTQ-for-LLaMa): int32 qweight packed along K, qzeros, g_idx"
    capabilities = GPTQCapabilities(V1)
    hub_files = (SAFETENSORS_FILES, PICKLE_FILES)
    version = V1

    @classmethod
    def detect(cls, path: Path) -> bool:
        p = Path(path)
        if p.is_dir():
            try:
                qc, _hf, _n = _quant_config(p)
            except W4PackError:
                qc = {}
            qm = str(qc.get("quant_method", "")).lower()
            if qm and qm != "gptq":
                return False
            if qm == "gptq" and not str(qc.get("version", "")).lower().startswith("gem"):
                return True
        return _looks_gptq_tensors(p)

    @classmethod
    def open(cls, path: Path, **options: Any) -> Source:
        options = {k: v for k, v in options.items() if not (k == "base" and v is None)}
        if "base" in options:
            raise UnsupportedError("--base is only for TOML+NumPy quant tables; a GPTQ checkpoint holds its codes")
        allowed = {"checkpoint_format", "v1_zeros", "bits", "group_size"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise UnsupportedError(f"unknown GPTQ read option(s): {', '.join(unknown)}")
        if cls.version == V2:
            options["checkpoint_format"] = V2
        return GPTQSource(Path(path), **options)

    @classmethod
    def write(cls, source: Source, out: Path, *, force: bool = False, **options: Any) -> Path:
        options.setdefault("checkpoint_format", cls.version)
        return write_gptq(source, out, force=force, **options)


class GPTQv2Format(GPTQFormat):
    """``--to gptq-v2``: zero points stored as is (GPTQModel checkpoint_format "gptq_v2")."""

    name = "gptq-v2"
    description = "GPTQ with v2 zero points (GPTQModel checkpoint_format gptq_v2)"
    capabilities = GPTQCapabilities(V2)
    version = V2

    @classmethod
    def detect(cls, path: Path) -> bool:
        return False  # "gptq" detects and reads both versions

