#!/usr/bin/env python3
"""Seeded mutation fuzzer for w4pack's readers and commands (issue 30, "keep it fixed").

Each mutation copies one fixture input (a GPTQ/AWQ/compressed-tensors folder, a TOML quant-table folder with its
base weights, a GGUF file, or a packed w4pack checkpoint converted from a fixture), changes it in one way (a byte
flip, a truncation, a header or JSON field edit, a GGUF integer field, a .npy header, a .pt member, a packed
shard with the manifest re-signed, ...), then runs the commands that read it (inspect, convert, validate --deep,
verify, verify --against), each in a child process under a wall-clock and an address-space limit. It records
crashes (signals), hangs (timeouts, memory exhaustion), tracebacks, error messages that are not one line, exit
codes the README does not allow for bad input, commands that disagree about the same input, and silent
corruptions: a provably invalid input that is accepted, or a changed meaning (dequantized layers, pass-through
tensors, config.json) that `validate --deep` / `verify --against` accept. Every finding keeps its reproducer
(mutated input, commands, outputs, mutation spec) under ``--out``.

Mutation ``i`` of reader ``r`` depends only on ``(--seed, r, i)``, so a finding is replayed with
``--reader r --seed s --index i``. The time budget decides only how many mutations run.

Usage::

    python tools/fuzz.py --reader all --minutes 10 --seed 1 --jobs 1 --out out/fuzz [--json]
    python tools/fuzz.py --reader gguf --seed 1 --index 17           # replay one mutation
    python tools/fuzz.py --reader gptq --seed 1 --runs 20 --list     # show the plan, run nothing
    python tools/fuzz.py --replay out/fuzz/summary.json --per-class  # rerun recorded findings on this tree
    python tools/fuzz.py --reader w4pack --targets llama- --minutes 20   # only llama.cpp's K-quant/IQ4 files
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parent.parent
READERS = ("gptq", "awq", "ct", "toml", "gguf", "w4pack")
FROM = {"gptq": "gptq", "awq": "awq", "ct": "compressed-tensors", "toml": "toml", "gguf": "gguf", "w4pack": "w4pack"}
FAMILY = {"gptq": "gptq", "awq": "awq", "ct": "compressed-tensors", "toml": "toml", "gguf": "gguf"}
#: finding classes, in the order of the summary table
CLASSES = ("crash", "hang", "traceback", "multi-line", "unexpected", "wrong-exit", "inconsistent", "silent")
#: packed checkpoints fuzzed by the w4pack reader: (fixture case, extra convert options)
PACKED_FROM = (("awq/tiny_llama_gemm_g128", []), ("awq/tiny_llama_gemm_g128", ["--fuse", "qkv,gate-up"]),
               ("gptq/gm_tiny_llama_b4_g64_descact_sym_v1_sharded", ["--max-shard-size", "400KB"]),
               ("compressed-tensors/tiny_llama_w4a16_sym_g128", []), ("gguf/q4_1_exact_in512_out256", []),
               ("toml/decoder_toml_inline_asym_g64", []), ("gptq/ag_b3_asym_g64", []),
               ("gptq/ag_b8_asym_g64_descact", []))
SKIP_NAMES = {"case.json", "README.md", "truth"}
#: the model card of a packed checkpoint (w4pack.store.names.CARD_NAME): not listed in the manifest
CARD_NAME = "README.md"
#: GGUFs written by llama.cpp's own quantizer (tests/data/llama_quantize): the K-quant and IQ4 blocks the
#: fixtures lack, fuzzed as GGUF sources and, converted, as packed folders in the compact storage (LAYOUT.md §8)
LLAMA_QUANTS = REPO / "tests" / "data" / "llama_quantize"
LLAMA_TYPES = ("Q4_K_M", "Q3_K_M", "Q2_K", "Q6_K", "IQ4_XS", "IQ4_NL", "moe-Q4_K_M")


def fixtures_root() -> Path | None:
    """$W4PACK_FIXTURES, else ../shared/fixtures beside the checkout (as the test suite looks them up)."""
    env = os.environ.get("W4PACK_FIXTURES")
    p = Path(env) if env else REPO.parent / "shared" / "fixtures"
    return p if p.is_dir() else None


# ------------------------------------------------------------------------------------------------------------
# targets and baselines

@dataclasses.dataclass
class Target:
    """One fuzzable input: what the commands read (``entry``, relative to the case folder) and how."""
    reader: str
    name: str                    # e.g. "gptq/ag_b4_asym_g64" or "w4pack/awq/tiny_llama_gemm_g128+fuse"
    fixture: Path                # the fixture case folder, or one test-data file
    entry: str                   # path inside the copied case folder that commands are given
    base: str | None = None      # TOML: base weights inside the copied case folder (--base)
    convert_opts: tuple[str, ...] = ()   # w4pack targets: options of the baseline conversion


def targets_for(reader: str, root: Path) -> list[Target]:
    """Every fixture case a reader can fuzz, in a stable order."""
    out: list[Target] = []
    if reader == "w4pack":
        for case, opts in PACKED_FROM:
            if (root / case / "case.json").exists():
                tag = case + ("+" + "".join(o.strip("-")[0] for o in opts[::2]) if opts else "")
                fam = case.split("/")[0]
                out.append(Target("w4pack", "w4pack/" + tag, root / case, "packed", base=_toml_base(fam),
                                  convert_opts=tuple(opts)))
        return out + [Target("w4pack", f"w4pack/gguf/llama-{q}", f, "packed") for q, f in _llama_quants()]
    fam = FAMILY[reader]
    for case in sorted(p for p in (root / fam).iterdir() if (p / "case.json").exists()) if (root / fam).is_dir() else []:
        if reader == "gguf":
            out.append(Target(reader, f"{fam}/{case.name}", case, "tensors.gguf"))
        elif reader == "toml":
            out.append(Target(reader, f"{fam}/{case.name}", case, "quant_dir", base="base_weights_fp16.safetensors"))
        else:
            out.append(Target(reader, f"{fam}/{case.name}", case, "."))
    if reader == "gguf":
        out += [Target("gguf", f"gguf/llama-{q}", f, "tensors.gguf") for q, f in _llama_quants()]
    return out


def _llama_quants() -> list[tuple[str, Path]]:
    return [(q, LLAMA_QUANTS / f"tiny-{q}.gguf") for q in LLAMA_TYPES if (LLAMA_QUANTS / f"tiny-{q}.gguf").is_file()]


def _toml_base(family: str) -> str | None:
    return "base_weights_fp16.safetensors" if family == "toml" else None


def copy_source(t: Target, dst: Path) -> None:
    """The fixture's input files (not its truth/ or case.json) into ``dst``."""
    dst.mkdir(parents=True)
    if t.fixture.is_file():  # one file of the repository's test data, under the name the commands are given
        entry = dst / (t.entry if t.reader != "w4pack" else _src_entry(t))
        shutil.copyfile(t.fixture, entry)
        entry.chmod(0o644)
        return
    for p in sorted(t.fixture.iterdir()):
        if p.name in SKIP_NAMES or p.name == "gptq_fakequant_weights_fp16.safetensors":
            continue
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
        else:
            shutil.copyfile(p, dst / p.name)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


class Baselines:
    """The unmutated copy, its conversion and its meaning digest, built once per target (thread-safe)."""

    def __init__(self, out: Path, runner: "Runner"):
        self.dir = out / "base"
        self.runner = runner
        self._locks: dict[str, threading.Lock] = {}
        self._done: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def get(self, t: Target) -> dict[str, Any]:
        with self._lock:
            lk = self._locks.setdefault(t.name, threading.Lock())
        with lk:
            if t.name not in self._done:
                self._done[t.name] = self._build(t)
            return self._done[t.name]

    def _build(self, t: Target) -> dict[str, Any]:
        d = self.dir / re.sub(r"[^A-Za-z0-9_.+-]", "_", t.name)
        if d.exists():
            shutil.rmtree(d)
        src = d / "src"
        copy_source(t, src)
        packed = d / "packed"
        extra = ["--base", str(src / t.base)] if t.base else []
        r = self.runner.cli(["convert", str(src / (t.entry if t.reader != "w4pack" else _src_entry(t))), str(packed),
                             *extra, *t.convert_opts])
        if r.rc != 0:
            return {"error": f"baseline conversion failed (exit {r.rc}): {r.stderr.strip()[-300:]}"}
        return {"src": src, "packed": packed, "extra": extra}

    def digest(self, t: Target) -> dict[str, Any]:
        """The baseline's meaning digest, computed on first need (most mutations are rejected and never need it)."""
        b = self.get(t)
        with self._locks[t.name]:
            if "digest" not in b:
                b["digest"] = self.runner.digest(b["packed"])
            if not b["digest"].get("ok"):
                raise RuntimeError(f"baseline digest of {t.name} failed: {b['digest'].get('error')}")
            return b["digest"]


def _src_entry(t: Target) -> str:
    """The entry of the fixture a packed target was converted from."""
    fam = t.name.split("/")[1]
    return {"gguf": "tensors.gguf", "toml": "quant_dir"}.get(fam, ".")


# ------------------------------------------------------------------------------------------------------------
# child processes

@dataclasses.dataclass
class RunResult:
    argv: list[str]
    rc: int | None
    timed_out: bool
    wall: float
    stdout: str
    stderr: str


class Runner:
    """Runs ``python -m w4pack`` (and the digest helper) in children with a wall-clock and an RLIMIT_AS limit."""

    def __init__(self, timeout: float, mem_mb: int):
        self.timeout, self.mem = timeout, mem_mb * 1024 * 1024
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = str(REPO) + (os.pathsep + self.env["PYTHONPATH"] if self.env.get("PYTHONPATH") else "")
        for k in ("W4PACK_DEBUG", "PYTHONWARNINGS"):
            self.env.pop(k, None)
        self.env.update({"W4PACK_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                         "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})

    def _limits(self) -> None:
        resource.setrlimit(resource.RLIMIT_AS, (self.mem, self.mem))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def run(self, argv: list[str]) -> RunResult:
        t0 = time.monotonic()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             env=self.env, cwd=str(REPO), start_new_session=True, preexec_fn=self._limits)
        timed_out = False
        try:
            out, err = p.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = p.communicate()
        return RunResult(argv, None if timed_out else p.returncode, timed_out, time.monotonic() - t0,
                         out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    def cli(self, args: list[str]) -> RunResult:
        return self.run([sys.executable, "-m", "w4pack", *args])

    def digest(self, path: Path) -> dict[str, Any]:
        r = self.run([sys.executable, str(Path(__file__).resolve()), "--digest", str(path)])
        if r.timed_out:
            return {"ok": False, "error": "digest timed out"}
        try:
            return json.loads(r.stdout)
        except ValueError:
            return {"ok": False, "error": f"digest exit {r.rc}: {(r.stderr.strip().splitlines() or [''])[-1][:300]}"}


#: config.json keys whose value does not change what the model computes
CONFIG_IGNORED = {"_name_or_path", "transformers_version"}


def digest(path: Path) -> dict[str, Any]:
    """The meaning of a packed checkpoint as w4pack's loader sees it: per-layer sha256 of the dequantized float32
    weights, per-tensor sha256 of the pass-through bytes, and the parsed config.json / generation_config.json."""
    import numpy as np

    import w4pack

    try:
        ck = w4pack.open_checkpoint(path)
        layers = {n: hashlib.sha256(np.ascontiguousarray(ck.dequantize(n)).tobytes()).hexdigest() for n in ck.layers}
        tensors = {n: hashlib.sha256(np.ascontiguousarray(ck.tensor(n)).tobytes()).hexdigest() for n in ck.passthrough}
        cfg = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k not in CONFIG_IGNORED}
        gen_p = path / "generation_config.json"
        gen = json.loads(gen_p.read_text()) if gen_p.exists() else None
        canon = lambda v: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()  # noqa: E731
        return {"ok": True, "layers": layers, "tensors": tensors, "config": canon(cfg),
                "generation": None if gen is None else canon(gen), "fused": canon(ck.manifest.get("fused") or {})}
    except Exception as exc:  # noqa: BLE001 - the oracle reports, the caller judges
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def digest_diff(a: dict[str, Any], b: dict[str, Any], config: bool = True) -> list[str]:
    """What differs between two digests (empty: same meaning). ``config=False`` compares tensors only: a source
    mutation may legitimately drop or change a side file the conversion then writes differently."""
    out = []
    for part in ("layers", "tensors"):
        x, y = a[part], b[part]
        gone, new = sorted(set(x) - set(y)), sorted(set(y) - set(x))
        changed = sorted(k for k in set(x) & set(y) if x[k] != y[k])
        if gone:
            out.append(f"{part} missing: {', '.join(gone[:3])}" + (" ..." if len(gone) > 3 else ""))
        if new:
            out.append(f"{part} added: {', '.join(new[:3])}")
        if changed:
            out.append(f"{part} changed: {', '.join(changed[:3])}" + (f" (+{len(changed) - 3})" if len(changed) > 3 else ""))
    for part in ("config", "generation", "fused") if config else ("fused",):
        if a.get(part) != b.get(part):
            out.append(f"{part} changed")
    return out


# ------------------------------------------------------------------------------------------------------------
# mutations

class Chooser:
    """Random choices that an explicit spec can override; every choice is recorded so the spec replays exactly."""

    def __init__(self, rng: random.Random, spec: dict[str, Any]):
        self.rng, self.spec = rng, spec
        self.record: dict[str, Any] = {}

    def pick(self, key: str, options: Iterable[Any]) -> Any:
        if key in self.spec:
            v = self.spec[key]
        else:
            opts = list(options)
            v = opts[self.rng.randrange(len(opts))]
        self.record[key] = v
        return v

    def int(self, key: str, lo: int, hi: int) -> int:
        v = self.spec[key] if key in self.spec else self.rng.randint(lo, hi)
        self.record[key] = v
        return v


@dataclasses.dataclass
class Mutation:
    desc: str
    must_reject: bool = False    # the input is provably invalid: accepting it is a silent corruption
    removes: bool = False        # a file was deleted


class Skip(Exception):
    """This mutator does not apply to the chosen file."""


def kind_of(rel: str) -> str:
    """The mutators' file type."""
    n = rel.rsplit("/", 1)[-1]
    if n == "w4pack.json":
        return "manifest"
    for suf, k in ((".safetensors.index.json", "json"), (".safetensors", "st"), (".json", "json"), (".toml", "toml"),
                   (".npy", "npy"), (".gguf", "gguf"), (".pt", "pt"), (".bin", "pt")):
        if n.endswith(suf):
            return k
    return "other"


#: JSON files whose breakage makes an input unreadable (side files such as generation_config may be passed along)
REQUIRED_JSON = {"config.json", "quantize_config.json", "quant_config.json", "model.safetensors.index.json",
                 "w4pack.json"}
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
               "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
HOSTILE_INTS = [0, -1, 1, 3, 5, 7, 9, 16, 33, 2**31, 2**63, 2**64, -2**63]
HOSTILE_VALUES = HOSTILE_INTS + [1.5, 1e308, -0.0, "", "x", "4", None, True, False, [], {}, [1, 2], "a" * 300]


def flip_bits(data: bytearray, c: Chooser, lo: int, hi: int, tag: str = "") -> str:
    if hi <= lo:
        raise Skip
    off = c.int(tag + "offset", lo, hi - 1)
    if not lo <= off < hi:
        raise Skip   # an explicit offset outside the region this mutator may touch
    bit = c.int(tag + "bit", 0, 7)
    data[off] ^= 1 << bit
    return f"flip bit {bit} of byte {off}"


def m_byte_flip(path: Path, c: Chooser) -> Mutation:
    data = bytearray(path.read_bytes())
    if not data:
        raise Skip
    n = c.int("nflips", 1, 4)
    where = c.pick("region", ["head", "any"])
    hi = min(len(data), 4096) if where == "head" else len(data)
    descs = [flip_bits(data, c, 0, hi, tag=f"f{i}_") for i in range(n)]
    path.write_bytes(bytes(data))
    return Mutation("; ".join(descs))


def m_truncate(path: Path, c: Chooser) -> Mutation:
    size = path.stat().st_size
    if size < 2:
        raise Skip
    mode = c.pick("mode", ["random", "head", "last-byte", "half"])
    if mode == "random":
        new = c.int("length", 0, size - 1)
    elif mode == "head":
        new = c.int("length", 0, min(size - 1, 256))
    else:
        new = size - 1 if mode == "last-byte" else size // 2
    with open(path, "r+b") as fh:
        fh.truncate(new)
    return Mutation(f"truncate {size} -> {new} bytes", must_reject=_truncation_invalid(path, new))


def _truncation_invalid(path: Path, new: int) -> bool:
    """Truncating is provably invalid for binary tensor files; for text only when it no longer parses."""
    k = kind_of(path.name)
    if k in ("st", "npy", "pt"):
        return True
    if k in ("json", "manifest"):
        try:
            json.loads(path.read_bytes())
            return False
        except ValueError:
            return path.name in REQUIRED_JSON
    if k == "toml":
        import tomllib
        try:
            tomllib.loads(path.read_text("utf-8", "replace"))
            return False
        except tomllib.TOMLDecodeError:
            return True
    return False  # GGUF: decided by gguf_truncate


def m_append(path: Path, c: Chooser) -> Mutation:
    blob = c.pick("blob", ["zeros", "garbage", "json"])
    extra = {"zeros": b"\0" * 37, "garbage": bytes(range(256))[:97], "json": b'{"x": 1}'}[blob]
    with open(path, "ab") as fh:
        fh.write(extra)
    # safetensors: bytes after the last tensor are a hole the format forbids; .npy: trailing data is not part of it
    return Mutation(f"append {len(extra)} {blob} bytes", must_reject=kind_of(path.name) == "st")


# -- safetensors ------------------------------------------------------------------------------------------------

def st_parse(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw, 0)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def st_write(path: Path, header: dict[str, Any], data: bytes) -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def st_tensor(header: dict[str, Any], c: Chooser) -> str:
    names = sorted(k for k in header if k != "__metadata__")
    if not names:
        raise Skip
    return c.pick("tensor", names)


def _nbytes(entry: dict[str, Any]) -> int | None:
    try:
        size = ST_ITEMSIZE[entry["dtype"]]
        return size * math.prod(entry["shape"]) if all(isinstance(d, int) and d >= 0 for d in entry["shape"]) else None
    except (KeyError, TypeError):
        return None


def m_st_field(path: Path, c: Chooser) -> Mutation:
    header, data = st_parse(path)
    name = st_tensor(header, c)
    e = header[name]
    before = _nbytes(e)
    span = e["data_offsets"][1] - e["data_offsets"][0]
    field = c.pick("field", ["dtype", "shape", "data_offsets", "name", "delete"])
    if field == "dtype":
        v = c.pick("value", sorted(ST_ITEMSIZE) + ["XYZ", "f16", "", 4, None])
        e["dtype"] = v
        desc = f"{name}.dtype = {v!r}"
    elif field == "shape":
        op = c.pick("op", ["+1", "-1", "zero", "swap", "drop", "add1", "huge", "negative", "string", "float"])
        s = list(e["shape"])
        if not s and op in ("+1", "-1", "zero", "swap", "drop", "huge", "negative", "string", "float"):
            raise Skip
        i = c.int("dim", 0, max(0, len(s) - 1))
        if op == "+1":
            s[i] += 1
        elif op == "-1":
            s[i] -= 1
        elif op == "zero":
            s[i] = 0
        elif op == "swap":
            s = s[::-1]
        elif op == "drop":
            s.pop(i)
        elif op == "add1":
            s.append(1)
        elif op == "huge":
            s[i] = 2**62
        elif op == "negative":
            s[i] = -s[i] if s[i] else -1
        elif op == "string":
            s[i] = str(s[i])
        else:
            s[i] = s[i] + 0.5
        e["shape"] = s
        desc = f"{name}.shape = {s}"
    elif field == "data_offsets":
        op = c.pick("op", ["shift+", "shift-", "past-end", "reversed", "negative", "huge", "swap", "float"])
        b, end = e["data_offsets"]
        if op == "shift+":
            e["data_offsets"] = [b + 2, end + 2]
        elif op == "shift-":
            e["data_offsets"] = [max(0, b - 2), max(0, end - 2)]
        elif op == "past-end":
            e["data_offsets"] = [b, len(data) + 64]
        elif op == "reversed":
            e["data_offsets"] = [end, b]
        elif op == "negative":
            e["data_offsets"] = [-8, end]
        elif op == "huge":
            e["data_offsets"] = [b, 2**64 - 1]
        elif op == "float":
            e["data_offsets"] = [float(b), float(end)]
        else:  # swap with another tensor of the same length: a spec-valid file whose tensors trade bytes
            same = sorted(k for k in header if k not in ("__metadata__", name)
                          and header[k]["data_offsets"][1] - header[k]["data_offsets"][0] == span)
            if not same:
                raise Skip
            other = c.pick("other", same)
            e["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], e["data_offsets"]
            st_write(path, header, data)
            return Mutation(f"swap data_offsets of {name} and {other}")
        if e["data_offsets"] == [b, end]:
            raise Skip
        desc = f"{name}.data_offsets = {e['data_offsets']}"
        st_write(path, header, data)
        return Mutation(desc, must_reject=True)   # a hole, an overlap or bytes out of range: invalid per the format
    elif field == "name":
        new = c.pick("value", [name + "x", name.replace(".0.", ".7.", 1), name.replace("weight", "w"), "", "a" * 300])
        if new == name or new in header:
            raise Skip
        header[new] = header.pop(name)
        desc = f"rename tensor {name} -> {new[:60]!r}"
        st_write(path, header, data)
        return Mutation(desc)
    else:
        del header[name]
        st_write(path, header, data)
        return Mutation(f"delete header entry {name}", must_reject=True)   # leaves a hole in the byte buffer
    st_write(path, header, data)
    after = _nbytes(e)
    return Mutation(desc, must_reject=after is None or after != span or before != span)


def m_st_header_len(path: Path, c: Chooser) -> Mutation:
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", raw, 0)
    v = c.pick("value", [0, n - 1, n + 1, n + 8, len(raw), len(raw) - 7, 2**63, 2**64 - 1, 100 * 1024 * 1024])
    if v == n:
        raise Skip
    struct.pack_into("<Q", raw, 0, v)
    path.write_bytes(bytes(raw))
    return Mutation(f"header length {n} -> {v}", must_reject=True)


def m_st_metadata(path: Path, c: Chooser) -> Mutation:
    header, data = st_parse(path)
    v = c.pick("value", [{"format": "np"}, {"format": 5}, {"format": None}, [], "pt", {}, {"format": "pt", "x": "y" * 9000}])
    header["__metadata__"] = v
    st_write(path, header, data)
    return Mutation(f"__metadata__ = {json.dumps(v)[:60]}")


def m_st_data(path: Path, c: Chooser) -> Mutation:
    """Bytes inside one tensor: flips (any value is a valid tensor) or a special float where floats live."""
    header, data = st_parse(path)
    name = st_tensor(header, c)
    e = header[name]
    b, end = e["data_offsets"]
    if end <= b:
        raise Skip
    start = len(path.read_bytes()) - len(data)
    raw = bytearray(path.read_bytes())
    how = c.pick("how", ["flip", "special"] if e["dtype"] in ("F16", "BF16", "F32") else ["flip"])
    if how == "flip":
        d = flip_bits(raw, c, start + b, start + end)
        path.write_bytes(bytes(raw))
        return Mutation(f"{name}: {d}")
    isz = ST_ITEMSIZE[e["dtype"]]
    i = c.int("element", 0, (end - b) // isz - 1)
    val = c.pick("value", ["nan", "inf", "-inf", "0", "-1", "max"])
    f = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "0": 0.0, "-1": -1.0, "max": 65504.0}[val]
    if e["dtype"] == "F32":
        enc = struct.pack("<f", f)
    elif e["dtype"] == "F16":
        enc = struct.pack("<e", f)
    else:
        enc = struct.pack("<f", f)[2:]
    raw[start + b + i * isz:start + b + (i + 1) * isz] = enc
    path.write_bytes(bytes(raw))
    scale = bool(re.search(r"(scales?|weight_scale)$", name))
    # a non-finite quantization scale can never be a valid layer
    return Mutation(f"{name}[{i}] = {val}", must_reject=scale and val in ("nan", "inf", "-inf"))


def m_st_duplicate(case: Path, c: Chooser, files: list[str]) -> Mutation:
    """Copy one tensor of a shard into another shard (issue 30 item 9: a tensor defined in two shards)."""
    shards = sorted(f for f in files if kind_of(f) == "st" and "base_weights" not in f)
    if len(shards) < 2:
        raise Skip
    a = c.pick("from_shard", shards)
    b = c.pick("to_shard", [s for s in shards if s != a])
    ha, da = st_parse(case / a)
    name = st_tensor(ha, c)
    hb, db = st_parse(case / b)
    if name in hb:
        raise Skip
    e = dict(ha[name])
    x, y = e["data_offsets"]
    e["data_offsets"] = [len(db), len(db) + (y - x)]
    hb[name] = e
    st_write(case / b, hb, db + da[x:y])
    return Mutation(f"copy tensor {name} from {a} into {b}", must_reject=True)


# -- JSON -------------------------------------------------------------------------------------------------------

def _leaves(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(doc, dict):
        for k in sorted(doc, key=str):
            out.append(prefix + (k,))
            out.extend(_leaves(doc[k], prefix + (k,)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:64]):
            out.append(prefix + (i,))
            out.extend(_leaves(v, prefix + (i,)))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _json_path_str(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path) or "."


#: keys that decide how a reader interprets tensors: chosen far more often than arbitrary leaves
INTERESTING = re.compile(r"^(bits|wbits|w_bit|group_size|groupsize|q_group_size|sym|desc_act|zero_point|version|"
                         r"quant_method|format|checkpoint_format|storage_bits|zero_mode|shape|padded_shape|num_groups|"
                         r"padded_groups|scale_dtype|act_order|tensors|qweight|scales|zeros|perm|num_bits|strategy|"
                         r"symmetric|type|targets|weights|config_groups|num_hidden_layers|hidden_size|rms_norm_eps|"
                         r"vocab_size|intermediate_size|num_attention_heads|num_key_value_heads|head_dim|"
                         r"tie_word_embeddings|rope_theta|rope_parameters|hidden_act|weight_map|file|size|sha256|"
                         r"rows|fused|passthrough|side_files|layers|tile|layout|format_version|dynamic|"
                         r"true_sequential|model_type|torch_dtype|dtype|eos_token_id|bos_token_id|storage|codebook|"
                         r"super_groups|dense_codes|offset)$")


def m_json_field(path: Path, c: Chooser) -> Mutation:
    doc = json.loads(path.read_text())
    leaves = _leaves(doc)
    if not leaves:
        raise Skip
    hot = [p for p in leaves if isinstance(p[-1], str) and INTERESTING.match(p[-1])]
    pool = hot if hot and c.pick("hot", [True, True, True, False]) else leaves
    jp = tuple(c.pick("path", [list(p) for p in pool]))
    parent, key = _get(doc, jp[:-1]), jp[-1]
    old = parent[key]
    op = c.pick("op", ["value", "value", "tweak", "delete"])
    if op == "delete":
        del parent[key]
        desc = f"delete {_json_path_str(jp)}"
    elif op == "tweak":
        if isinstance(old, bool) or old is None:
            new: Any = not old
        elif isinstance(old, (int, float)):
            new = c.pick("tweak", [old + 1, old - 1, old * 2, -old, old * 1000, old / 2])
        elif isinstance(old, str):
            new = c.pick("tweak", [old + "x", old[:-1], old.upper(), old.replace("0", "1"), "../" + old, "/" + old])
        elif isinstance(old, list) and old:
            new = c.pick("tweak", [old[:-1], old + old[-1:], old[::-1]])
        else:
            new = {}
        parent[key] = new
        desc = f"{_json_path_str(jp)}: {json.dumps(old)[:40]} -> {json.dumps(new)[:60]}"
    else:
        new = c.pick("value", HOSTILE_VALUES)
        parent[key] = new
        desc = f"{_json_path_str(jp)}: {json.dumps(old)[:40]} -> {json.dumps(new)[:60]}"
    if op != "delete" and new == old and type(new) is type(old):
        raise Skip
    path.write_text(json.dumps(doc, indent=2))
    return Mutation(desc)


def m_json_text(path: Path, c: Chooser) -> Mutation:
    text = path.read_bytes()
    how = c.pick("how", ["garbage", "empty", "not-object", "nan", "dup-key", "bom"])
    new = {"garbage": text[: len(text) // 2] + b"}{", "empty": b"", "not-object": b"[1, 2, 3]",
           "nan": text.replace(b": 1", b": NaN", 1) if b": 1" in text else text.replace(b":", b": Infinity, \"_\":", 1),
           "dup-key": text.replace(b"{", b'{"_dup": 1, "_dup": 2, ', 1), "bom": b"\xef\xbb\xbf" + text}[how]
    if new == text:
        raise Skip
    path.write_bytes(new)
    try:
        ok = isinstance(json.loads(new), dict)
    except ValueError:
        ok = False
    return Mutation(f"JSON text: {how}", must_reject=not ok and path.name in REQUIRED_JSON)


# -- TOML -------------------------------------------------------------------------------------------------------

def m_toml(path: Path, c: Chooser) -> Mutation:
    import tomllib

    lines = path.read_text().splitlines(keepends=True)
    how = c.pick("how", ["value", "value", "number", "delete-line", "long-name", "dup-table", "rename-table"])
    kv = [i for i, ln in enumerate(lines) if re.match(r"^\s*[A-Za-z_]+\s*=", ln)]
    heads = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("[")]
    if how == "value":
        if not kv:
            raise Skip
        i = c.pick("line", kv)
        key = lines[i].split("=", 1)[0].strip()
        v = c.pick("value", ["0", "-1", "3", "5", "16", "99999999999999999999", "nan", "inf", "1e400", '"4"', "true",
                             "[]", '"../../etc/passwd"', '"' + "a" * 300 + '.npy"', "2.5"])
        lines[i] = f"{key} = {v}\n"
        desc = f"line {i + 1}: {key} = {v[:40]}"
    elif how == "number":
        text = "".join(lines)
        nums = [m.span() for m in re.finditer(r"(?<![\w.])-?\d+(\.\d+)?(e-?\d+)?(?![\w.])", text)]
        if not nums:
            raise Skip
        a, b = nums[c.int("number", 0, len(nums) - 1)]
        v = c.pick("value", ["nan", "inf", "-1", "0", "1e39", "99999999999999999999", "-0.0", "3.5"])
        path.write_text(text[:a] + v + text[b:])
        return Mutation(f"number at char {a} ({text[a:b]}) -> {v}")
    elif how == "delete-line":
        if not kv:
            raise Skip
        i = c.pick("line", kv)
        desc = f"delete line {i + 1}: {lines[i].strip()[:50]}"
        del lines[i]
    elif how in ("long-name", "rename-table"):
        if not heads:
            raise Skip
        i = c.pick("line", heads)
        name = "a" * 300 if how == "long-name" else c.pick("name", ["model.layers.99.mlp.up_proj", "x", "", "../up"])
        lines[i] = f'["{name}"]\n'
        desc = f"table at line {i + 1} renamed to {name[:40]!r}" + (f" ({len(name)} chars)" if len(name) > 40 else "")
    else:
        if len(heads) < 2:
            raise Skip
        i = c.pick("line", heads[1:])
        lines[i] = lines[heads[0]]
        desc = f"table at line {i + 1} duplicates {lines[heads[0]].strip()[:50]}"
    text = "".join(lines)
    path.write_text(text)
    try:
        tomllib.loads(text)
        bad = False
    except tomllib.TOMLDecodeError:
        bad = True
    return Mutation(desc, must_reject=bad)


# -- .npy -------------------------------------------------------------------------------------------------------

def npy_parse(raw: bytes) -> tuple[int, int, str]:
    """(header start, header length, header text) of a .npy file."""
    if raw[:6] != b"\x93NUMPY":
        raise Skip
    if raw[6] == 1:
        (n,) = struct.unpack_from("<H", raw, 8)
        return 10, n, raw[10:10 + n].decode("latin1")
    (n,) = struct.unpack_from("<I", raw, 8)
    return 12, n, raw[12:12 + n].decode("latin1")


def m_npy_header(path: Path, c: Chooser) -> Mutation:
    raw = path.read_bytes()
    start, n, text = npy_parse(raw)
    data = raw[start + n:]
    how = c.pick("how", ["descr", "fortran", "shape", "stray-byte", "length", "magic", "version", "object"])
    if how in ("length", "magic", "version"):
        b = bytearray(raw)
        if how == "length":
            v = c.pick("value", [0, n - 1, n + 1, 65535])
            struct.pack_into("<H", b, 8, v)
        elif how == "magic":
            b[1] = ord("X")
            v = "\\x93XUMPY"
        else:
            v = c.pick("value", [0, 3, 9, 255])
            b[6] = v
        path.write_bytes(bytes(b))
        return Mutation(f".npy {how} -> {v}", must_reject=True)
    if how == "descr":
        v = c.pick("value", ["<f8", "<f2", ">f4", "|u1", "<i8", "<c8", "|b1", "<U4", "|V4", "zz"])
        new = re.sub(r"'descr': '[^']*'", f"'descr': '{v}'", text)
    elif how == "object":
        v = "|O"
        new = re.sub(r"'descr': '[^']*'", "'descr': '|O'", text)
    elif how == "fortran":
        v = "True" if "'fortran_order': False" in text else "False"
        new = re.sub(r"'fortran_order': \w+", f"'fortran_order': {v}", text)
    elif how == "shape":
        v = c.pick("value", ["()", "(0,)", "(1,)", "(2**40,)", "(-1,)", "(9999999999, 9999999999)", "('a',)", "(1, 2, 3)"])
        new = re.sub(r"'shape': \([^)]*\)", f"'shape': {v}".replace("2**40", str(2**40)), text)
    else:  # issue 30 item 11: a stray byte in the header
        pos = c.int("position", 1, max(1, text.index("}")))
        ch = c.pick("char", ["'", '"', "(", "\\", "\x00", "#"])
        new = text[:pos] + ch + text[pos + 1:]
        v = f"{ch!r} at {pos}"
    new = new.rstrip()
    body = new + " " * (-(start + len(new) + 1) % 64) + "\n"   # numpy pads the header to a multiple of 64
    hdr = raw[:8] + (struct.pack("<H", len(body)) if start == 10 else struct.pack("<I", len(body)))
    path.write_bytes(hdr + body.encode("latin1") + data)
    return Mutation(f".npy header {how} -> {v}", must_reject=how in ("stray-byte", "object"))


def m_npy_data(path: Path, c: Chooser) -> Mutation:
    """A special value in an .npy's data (scale, zero or group index of a TOML table)."""
    import numpy as np

    raw = path.read_bytes()
    start, n, _ = npy_parse(raw)
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception:  # noqa: BLE001
        raise Skip from None
    if arr.size == 0:
        raise Skip
    flat = arr.reshape(-1).copy()
    i = c.int("element", 0, flat.size - 1)
    if arr.dtype.kind == "f":
        v = c.pick("value", ["nan", "inf", "-1", "0", "1e30"])
        flat[i] = float(v)
    elif arr.dtype.kind in "iu":
        v = c.pick("value", ["-1", "255", "100000", "0"])
        flat[i] = np.array(int(v)).astype(arr.dtype)
    else:
        raise Skip
    order = "F" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C"
    path.write_bytes(raw[:start + n] + flat.reshape(arr.shape).astype(arr.dtype).tobytes(order=order))
    nm = path.name
    bad = (("scale" in nm and v in ("nan", "inf", "-1", "0")) or ("zero" in nm and v in ("nan", "inf", "-1", "1e30"))
           or ("group_ids" in nm and v in ("-1", "255", "100000")))
    return Mutation(f"{nm}[{i}] = {v}", must_reject=bad)


# -- GGUF -------------------------------------------------------------------------------------------------------

GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
#: ggml type -> (elements per block, bytes per block), for the types the fixtures and w4pack use
GGML_BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 30: (1, 2)}


@dataclasses.dataclass
class GField:
    pos: int
    fmt: str       # "<I" or "<Q"
    kind: str      # version, count, strlen, vtype, arrtype, arrcount, ndims, dim, ttype, offset, alignment
    label: str
    value: int


def gguf_parse(raw: bytes) -> tuple[list[GField], dict[str, Any]]:
    """Every integer field of a GGUF v2/v3 file with its position, and the data section's layout."""
    if raw[:4] != b"GGUF":
        raise Skip
    f: list[GField] = []

    def rd(pos: int, fmt: str, kind: str | None, label: str) -> tuple[int, int]:
        (v,) = struct.unpack_from(fmt, raw, pos)
        if kind:
            f.append(GField(pos, fmt, kind, label, v))
        return v, pos + struct.calcsize(fmt)

    def rstr(pos: int, label: str) -> tuple[str, int]:
        n, pos = rd(pos, "<Q", "strlen", label)
        return raw[pos:pos + n].decode("utf-8", "replace"), pos + n

    _, pos = rd(4, "<I", "version", "version")
    nt, pos = rd(pos, "<Q", "count", "tensor_count")
    nkv, pos = rd(pos, "<Q", "count", "kv_count")
    align = 32
    for i in range(nkv):
        key, pos = rstr(pos, f"kv[{i}].key.len")
        t, pos = rd(pos, "<I", "vtype", f"kv[{i}]({key}).type")
        if t == 8:
            _, pos = rstr(pos, f"kv[{i}]({key}).value.len")
        elif t == 9:
            et, pos = rd(pos, "<I", "arrtype", f"kv[{i}]({key}).elem_type")
            cnt, pos = rd(pos, "<Q", "arrcount", f"kv[{i}]({key}).count")
            for j in range(cnt):
                if et == 8:
                    _, pos = rstr(pos, f"kv[{i}]({key})[{j}].len") if j < 4 else rstr(pos, "")
                    if j >= 4:
                        f.pop()
                else:
                    pos += struct.calcsize(GGUF_SCALAR[et])
        else:
            fmt = GGUF_SCALAR[t]
            v, pos2 = rd(pos, fmt, "alignment" if key == "general.alignment" else None, f"kv[{i}]({key})")
            if key == "general.alignment":
                align = v
            pos = pos2
    tensors = []
    for i in range(nt):
        name, pos = rstr(pos, f"tensor[{i}].name.len")
        nd, pos = rd(pos, "<I", "ndims", f"tensor[{i}]({name}).n_dims")
        dims = []
        for d in range(nd):
            v, pos = rd(pos, "<Q", "dim", f"tensor[{i}]({name}).ne[{d}]")
            dims.append(v)
        tt, pos = rd(pos, "<I", "ttype", f"tensor[{i}]({name}).type")
        off, pos = rd(pos, "<Q", "offset", f"tensor[{i}]({name}).offset")
        tensors.append({"name": name, "dims": dims, "type": tt, "offset": off})
    data_start = pos + (-pos % align)
    end = data_start
    for t in tensors:
        if t["type"] in GGML_BLOCK:
            bs, ts = GGML_BLOCK[t["type"]]
            end = max(end, data_start + t["offset"] + math.prod(t["dims"]) // bs * ts)
    return f, {"align": align, "data_start": data_start, "data_end": end, "tensors": tensors}


def m_gguf_field(path: Path, c: Chooser) -> Mutation:
    raw = bytearray(path.read_bytes())
    fields, lay = gguf_parse(bytes(raw))
    fields = [x for x in fields if x.label]
    kinds = sorted({x.kind for x in fields})
    kind = c.pick("kind", kinds)
    cand = [x for x in fields if x.kind == kind]
    label = c.pick("field", [x.label for x in cand])
    fd = next(x for x in cand if x.label == label)
    top = 2**64 if fd.fmt == "<Q" else 2**32
    v0, size = fd.value, len(raw)
    rem = size - fd.pos
    opts: dict[str, list[int]] = {
        "version": [0, 1, 2, 4, top - 1],
        "count": [v0 + 1, v0 + 1000, 2**32, 2**63, top - 1, 0, max(0, v0 - 1)],
        "strlen": [v0 + 1, max(0, v0 - 1), 0, rem + 1, 2**40, 2**63, top - 1],
        "vtype": [9, 13, 255, top - 1, 8, 10, 4, 6, 0],
        "arrtype": [9, 13, 255, 8, 0, 10],
        "arrcount": [v0 + 1, 2**40, 2**63, top - 1, 0],
        "ndims": [0, 5, 255, top - 1, 1, 3],
        "dim": [0, v0 + 1, v0 * 2, v0 + 32, 2**32, 2**63, top - 1],
        "ttype": [4, 5, 100, top - 1, 0, 1, 2, 3, 8, 12],
        "offset": [top - 18, top - lay["align"], v0 + 1, v0 + lay["align"], v0 + size, 0, 2**63],
        "alignment": [0, 3, 1, 2**31, 7, 64],
    }
    v = c.pick("value", [x for x in opts[kind] if x != v0 and 0 <= x < top])
    struct.pack_into(fd.fmt, raw, fd.pos, v)
    path.write_bytes(bytes(raw))
    after = size - (fd.pos + struct.calcsize(fd.fmt))
    bad = {
        "version": v not in (2, 3),
        "count": v > v0,
        "strlen": v > after,
        "vtype": v > 12,
        "arrtype": v > 12,
        "arrcount": v > after,
        "ndims": v > 4 or v == 0,
        "dim": v == 0 or v >= 2**32,
        "ttype": v in (4, 5) or v > 41,
        # offsets are unsigned and relative to the data section: past the file, wrapped or misaligned is invalid
        "offset": v % lay["align"] != 0 or lay["data_start"] + v >= size,
        "alignment": v == 0 or v & (v - 1) != 0,
    }[kind]
    if kind in ("dim", "ttype") and not bad:
        bad = _gguf_layout_invalid(bytes(raw))
    return Mutation(f"GGUF {label}: {v0} -> {v}", must_reject=bool(bad))


def _gguf_layout_invalid(raw: bytes) -> bool:
    """A known tensor type whose rows are not whole blocks, or whose data runs past the end of the file."""
    try:
        _, lay = gguf_parse(raw)
    except (Skip, struct.error, KeyError, ValueError, OverflowError):
        return False
    for t in lay["tensors"]:
        if t["type"] in GGML_BLOCK and t["dims"]:
            bs, ts = GGML_BLOCK[t["type"]]
            if t["dims"][0] % bs or lay["data_start"] + t["offset"] + math.prod(t["dims"]) // bs * ts > len(raw):
                return True
    return False


def m_gguf_truncate(path: Path, c: Chooser) -> Mutation:
    raw = path.read_bytes()
    _, lay = gguf_parse(raw)
    where = c.pick("where", ["header", "tensor-info", "data", "last-byte"])
    if where == "header":
        new = c.int("length", 0, 23)
    elif where == "tensor-info":
        new = c.int("length", 24, max(24, lay["data_start"] - 1))
    elif where == "data":
        new = c.int("length", lay["data_start"], max(lay["data_start"], len(raw) - 1))
    else:
        new = len(raw) - 1
    if new >= len(raw):
        raise Skip
    path.write_bytes(raw[:new])
    return Mutation(f"truncate GGUF {len(raw)} -> {new} bytes ({where})", must_reject=new < lay["data_end"])


def m_gguf_data(path: Path, c: Chooser) -> Mutation:
    raw = bytearray(path.read_bytes())
    _, lay = gguf_parse(bytes(raw))
    d = flip_bits(raw, c, lay["data_start"], len(raw))
    path.write_bytes(bytes(raw))
    return Mutation(f"GGUF data: {d}")


# -- .pt --------------------------------------------------------------------------------------------------------

def m_pt_member(path: Path, c: Chooser) -> Mutation:
    """Flip bytes inside one member of the zip archive torch.save writes (pickle or a storage)."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = [(i.filename, i.header_offset, i.compress_size) for i in z.infolist() if i.compress_size > 0]
    except zipfile.BadZipFile:
        raise Skip from None
    raw = bytearray(path.read_bytes())
    pkl = [i for i in infos if i[0].endswith(".pkl")]
    which = c.pick("member", ["pickle", "storage", "any"])
    pool = pkl if which == "pickle" and pkl else [i for i in infos if "/data/" in i[0]] if which == "storage" else infos
    if not pool:
        raise Skip
    name, hoff, csize = pool[c.int("index", 0, len(pool) - 1)]
    (nlen, xlen) = struct.unpack_from("<HH", raw, hoff + 26)
    start = hoff + 30 + nlen + xlen
    d = flip_bits(raw, c, start, start + csize)
    path.write_bytes(bytes(raw))
    return Mutation(f"{name}: {d}")


# -- folders ----------------------------------------------------------------------------------------------------

def m_delete(case: Path, c: Chooser, files: list[str]) -> Mutation:
    rel = c.pick("file", files)
    (case / rel).unlink()
    # a source may do without its config.json (llm-awq dumps, bare layer files); its tensor files it cannot
    required = kind_of(rel) in ("st", "npy", "gguf", "toml", "manifest")
    return Mutation(f"delete {rel}", must_reject=required, removes=True)


def m_stray(case: Path, c: Chooser, files: list[str]) -> Mutation:
    """An extra file beside the input: a stray shard, or an empty one."""
    sts = sorted(f for f in files if kind_of(f) == "st")
    what = c.pick("what", ["copy-shard", "empty-shard", "stray-json"])
    d = (case / files[0]).parent if files else case
    if what == "copy-shard":
        if not sts:
            raise Skip
        src = c.pick("shard", sts)
        shutil.copyfile(case / src, (case / src).parent / "model-99999.safetensors")
        return Mutation(f"stray copy of {src} as model-99999.safetensors")
    if what == "empty-shard":
        (d / "model-99999.safetensors").write_bytes(b"")
        return Mutation("stray empty model-99999.safetensors")
    (d / "quantize_config.json.bak").write_text("{")
    return Mutation("stray broken quantize_config.json.bak")


# -- packed checkpoints -----------------------------------------------------------------------------------------

def resign(folder: Path) -> list[str]:
    """Recompute every sha256 (and size) the manifest carries for a file of the folder, so that a mutation reaches
    the checks behind the checksums. Works for any manifest entry with a file name beside a ``sha256``."""
    mp = folder / "w4pack.json"
    try:
        man = json.loads(mp.read_text())
    except (OSError, ValueError):
        return []
    done: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            fname = next((x[k] for k in ("file", "path", "name") if isinstance(x.get(k), str)), None)
            if isinstance(x.get("sha256"), str) and fname and (folder / fname).is_file():
                data = (folder / fname).read_bytes()
                x["sha256"] = hashlib.sha256(data).hexdigest()
                if "size" in x:
                    x["size"] = len(data)
                done.append(fname)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(man)
    mp.write_text(json.dumps(man, indent=2))
    return done


def signed_files(folder: Path) -> set[str]:
    try:
        man = json.loads((folder / "w4pack.json").read_text())
    except (OSError, ValueError):
        return set()
    out: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            fname = next((x[k] for k in ("file", "path", "name") if isinstance(x.get(k), str)), None)
            if isinstance(x.get("sha256"), str) and fname:
                out.add(fname)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(man)
    return out


def m_packed_layer_data(case: Path, c: Chooser, files: list[str]) -> Mutation:
    """Bytes of one quantized layer's tensor (codes, scales, zeros, mins, perm, bias) inside its shard."""
    man = json.loads((case / "w4pack.json").read_text())
    index = json.loads((case / "model.safetensors.index.json").read_text())["weight_map"]
    layer = c.pick("layer", sorted(man["layers"]))
    suffix = c.pick("part", sorted(man["layers"][layer]["tensors"]))
    tname = man["layers"][layer]["tensors"][suffix]
    shard = case / index[tname]
    sub = Chooser(c.rng, {k[4:]: v for k, v in c.spec.items() if k.startswith("sub_")})
    sub.spec.setdefault("tensor", tname)
    m = m_st_data(shard, sub)
    c.record.update({"sub_" + k: v for k, v in sub.record.items()})
    return Mutation(f"{index[tname]}: {m.desc}", must_reject=m.must_reject)


MUTATORS_FILE: dict[str, tuple[tuple[str, ...], Callable[[Path, Chooser], Mutation], int]] = {
    # name: (file kinds, function, weight)
    "byte_flip": (("st", "json", "manifest", "toml", "npy", "gguf", "pt", "other"), m_byte_flip, 2),
    "truncate": (("st", "json", "manifest", "toml", "npy", "pt"), m_truncate, 2),
    "append": (("st", "npy", "pt"), m_append, 1),
    "st_field": (("st",), m_st_field, 6),
    "st_header_len": (("st",), m_st_header_len, 2),
    "st_metadata": (("st",), m_st_metadata, 1),
    "st_data": (("st",), m_st_data, 3),
    "json_field": (("json", "manifest"), m_json_field, 8),
    "json_text": (("json", "manifest"), m_json_text, 2),
    "toml": (("toml",), m_toml, 8),
    "npy_header": (("npy",), m_npy_header, 5),
    "npy_data": (("npy",), m_npy_data, 3),
    "gguf_field": (("gguf",), m_gguf_field, 12),
    "gguf_truncate": (("gguf",), m_gguf_truncate, 3),
    "gguf_data": (("gguf",), m_gguf_data, 2),
    "pt_member": (("pt",), m_pt_member, 5),
}
MUTATORS_FOLDER: dict[str, tuple[Callable[[Path, Chooser, list[str]], Mutation], int, bool]] = {
    # name: (function, weight, packed only)
    "delete": (m_delete, 1, False),
    "stray": (m_stray, 1, False),
    "st_duplicate": (m_st_duplicate, 1, False),
    "packed_layer_data": (m_packed_layer_data, 6, True),
}
#: how often a file of each kind is picked to mutate
FILE_WEIGHT = {"st": 4, "json": 2, "manifest": 6, "toml": 4, "npy": 2, "gguf": 4, "pt": 4, "other": 0}


def case_files(case: Path) -> list[str]:
    return sorted(str(p.relative_to(case)) for p in case.rglob("*") if p.is_file())


def apply_mutation(t: Target, case: Path, rng: random.Random, spec: dict[str, Any]) -> tuple[Mutation, dict[str, Any]]:
    """Mutate the copied input in ``case`` once (``spec`` fixes any choice); (mutation, full replayable spec)."""
    c = Chooser(rng, spec)
    files = case_files(case)
    packed = t.reader == "w4pack"
    for _attempt in range(20):
        c.record = {}
        folder = [(n, w) for n, (_, w, only) in MUTATORS_FOLDER.items() if packed or not only]
        scope = c.pick("scope", ["file", "folder"] if packed else ["file", "file", "file", "file", "folder"])
        try:
            if scope == "folder":
                name = c.pick("mutator", [n for n, w in folder for _ in range(w)])
                m = MUTATORS_FOLDER[name][0](case, c, files)
                rel = None
            else:
                pool = [f for f in files for _ in range(FILE_WEIGHT[kind_of(f)])]
                if not pool:
                    raise Skip
                rel = c.pick("file", pool)
                k = kind_of(rel)
                names = [n for n, (kinds, _, w) in MUTATORS_FILE.items() if k in kinds for _ in range(w)]
                name = c.pick("mutator", names)
                if k not in MUTATORS_FILE[name][0]:
                    raise Skip
                m = MUTATORS_FILE[name][1](case / rel, c)
        except Skip:
            if spec:
                raise
            continue
        if packed:
            if ((name == "delete" and c.record.get("file") != CARD_NAME)
                    or (name == "stray" and c.record.get("what") != "stray-json")):
                # every file of a packed checkpoint is listed; nothing unlisted may appear. The model card is the
                # exception (docs/FORMAT.md §5): it describes the model and defines nothing, so a folder without
                # it is as valid as one with it
                m.must_reject = True
            signed = signed_files(case)
            do = c.pick("resign", [True, True, True, True, False])
            touched = {rel} if rel else set()
            if name == "packed_layer_data" or name == "st_duplicate":
                touched = {f for f in case_files(case) if kind_of(f) == "st"}
            if do:
                resign(case)
                m.desc += " (re-signed)"
            elif touched & signed:
                m.must_reject = True   # a signed file changed and its checksum was not updated
        full = {"mutator": name, **c.record}
        return m, full
    raise Skip


# ------------------------------------------------------------------------------------------------------------
# judging

@dataclasses.dataclass
class Finding:
    cls: str
    command: str
    detail: str


def judge_run(label: str, r: RunResult) -> list[Finding]:
    """Per-command rules: no signal, no timeout, no traceback, one error line, documented exit codes."""
    out: list[Finding] = []
    err = r.stderr
    if r.timed_out:
        return [Finding("hang", label, f"no exit after {r.wall:.0f} s")]
    if r.rc is not None and r.rc < 0:
        sig = signal.Signals(-r.rc).name if -r.rc in signal.Signals._value2member_map_ else str(-r.rc)
        out.append(Finding("crash", label, f"killed by {sig}"))
    if re.search(r"MemoryError|Cannot allocate memory|bad_alloc|out of memory", err):
        out.append(Finding("hang", label, f"memory exhausted under the {label} limit: {_last(err)}"))
    if "Traceback (most recent call last)" in err:
        out.append(Finding("traceback", label, _last(err)))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if r.rc not in (0, 1, None) and (len(lines) != 1 or not lines[0].startswith("w4pack: error: ")) \
            and not any(f.cls == "traceback" for f in out) and (r.rc or 0) >= 0:
        out.append(Finding("multi-line", label, f"{len(lines)} stderr lines: " + " | ".join(ln[:100] for ln in lines[:3])))
    if re.search(r"\b\w+Warning: ", err):
        out.append(Finding("multi-line", label, "a Python warning on stderr: " + next(
            ln for ln in lines if re.search(r"\b\w+Warning: ", ln))[:160]))
    if "unexpected " in err and "this is a bug" in err:
        out.append(Finding("unexpected", label, _last(err)))
    if r.rc is not None and r.rc >= 0:
        if r.rc == 1 and not label.startswith("verify"):
            out.append(Finding("wrong-exit", label, "exit 1 outside verify"))
        elif r.rc == 4:
            out.append(Finding("wrong-exit", label, f"exit 4 (I/O) for a malformed input: {_last(err)}"))
        elif r.rc not in (0, 1, 2, 3, 4, 130):
            out.append(Finding("wrong-exit", label, f"exit {r.rc}"))
        elif r.rc == 3 and "cannot tell which format" in err:
            out.append(Finding("wrong-exit", label, "a damaged file reported as an unknown format (exit 3): " + _last(err)))
    return out


def _last(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def rejected(rc: int | None) -> bool:
    return rc in (2, 3)


@dataclasses.dataclass
class Outcome:
    reader: str
    index: int
    target: str
    spec: dict[str, Any]
    desc: str
    must_reject: bool
    runs: list[dict[str, Any]]
    findings: list[Finding]
    status: str                 # "rejected", "accepted" or "finding"
    repro: str | None = None
    seconds: float = 0.0


def fuzz_one(ctx: "Fuzz", reader: str, index: int, spec: dict[str, Any] | None = None,
             target: str | None = None, only: Iterable[str] | None = None,
             timeout: float | None = None) -> Outcome | None:
    """Plan, apply and judge mutation ``index`` of ``reader`` (or the explicit ``spec`` on ``target``).

    ``only`` limits the commands to those labels (the cross-command checks then use what ran); ``timeout``
    overrides the per-command limit (a test of a known hang need not wait the full limit)."""
    t0 = time.monotonic()
    runner = ctx.runner
    if timeout is not None:
        runner = copy.copy(ctx.runner)
        runner.timeout = timeout
    wanted = set(only) if only is not None else None
    rng = random.Random(f"{ctx.seed}:{reader}:{index}")
    tl = ctx.targets[reader]
    t = next(x for x in tl if x.name == target) if target else tl[rng.randrange(len(tl))]
    base = ctx.baselines.get(t)
    if "error" in base:
        return None
    case_root = ctx.out / "cases" / f"{reader}-{index:05d}"
    if case_root.exists():
        shutil.rmtree(case_root)
    inp = case_root / "input"
    if t.reader == "w4pack":
        shutil.copytree(base["packed"], inp)
    else:
        shutil.copytree(base["src"], inp)
    try:
        mut, full = apply_mutation(t, inp, rng, dict(spec or {}))
    except Skip:
        shutil.rmtree(case_root)
        return None
    entry = inp if t.reader == "w4pack" else inp / t.entry
    extra = ["--base", str(inp / t.base)] if t.base and t.reader != "w4pack" else []
    runs: list[dict[str, Any]] = []
    findings: list[Finding] = []
    res: dict[str, RunResult] = {}

    def run(label: str, args: list[str]) -> RunResult:
        if wanted is not None and label not in wanted:
            res[label] = RunResult(args, None, False, 0.0, "", "")   # not run: rc None is neither accept nor reject
            return res[label]
        r = runner.cli(args)
        res[label] = r
        runs.append({"label": label, "argv": ["w4pack", *args], "rc": r.rc, "timed_out": r.timed_out,
                     "wall": round(r.wall, 2), "stdout": r.stdout[-4000:], "stderr": r.stderr[-4000:]})
        findings.extend(judge_run(label, r))
        return r

    dig = None
    if t.reader != "w4pack":
        dst = case_root / "converted"
        run("inspect", ["inspect", str(entry), *extra])
        conv = run("convert", ["convert", str(entry), str(dst), *extra])
        vag = run("verify --against", ["verify", str(base["packed"]), "--against", str(entry), *extra, "--seed", "1"])
        if conv.rc == 0:
            val = run("validate --deep", ["validate", "--deep", str(dst)])
            ver = run("verify", ["verify", str(dst), "--seed", "1"])
            dig = runner.digest(dst)
            if mut.must_reject:
                same = dig.get("ok") and not digest_diff(ctx.baselines.digest(t), dig, config=False)
                findings.append(Finding("inconsistent" if same else "silent", "convert",
                                        "accepted a provably invalid input" + (" (same meaning as the original)"
                                                                              if same else "")))
            if val.rc != 0 and val.rc is not None and val.rc >= 0:
                findings.append(Finding("inconsistent", "validate --deep",
                                        f"convert wrote a checkpoint validate rejects (exit {val.rc}): {_last(val.stderr)}"))
            if ver.rc not in (0, None) and ver.rc >= 0:
                findings.append(Finding("inconsistent", "verify", f"convert wrote a checkpoint verify fails (exit {ver.rc})"))
            if not dig.get("ok"):
                findings.append(Finding("inconsistent", "load", f"convert wrote a checkpoint the loader refuses: {dig['error']}"))
            elif vag.rc == 0:
                diff = digest_diff(ctx.baselines.digest(t), dig, config=False)
                if diff:
                    findings.append(Finding("silent", "verify --against",
                                            "source meaning changed, yet verify --against the old conversion accepts: "
                                            + "; ".join(diff)))
        else:
            if conv.rc in (2, 3) and vag.rc == 1:
                findings.append(Finding("inconsistent", "verify --against",
                                        f"exit 1 (a difference) for a source convert rejects (exit {conv.rc})"))
            if conv.rc in (2, 3) and vag.rc == 0:
                findings.append(Finding("silent", "verify --against", f"accepts a source convert rejects (exit {conv.rc})"))
        ins = res["inspect"].rc
        if conv.rc in (0, 2, 3) and ins in (0, 2, 3) and (ins == 0) != (conv.rc == 0):
            findings.append(Finding("inconsistent", "inspect", f"inspect exit {ins} but convert exit {conv.rc}"))
        primary_ok = conv.rc == 0
    else:
        run("inspect", ["inspect", str(entry)])
        val = run("validate --deep", ["validate", "--deep", str(entry)])
        ver = run("verify", ["verify", str(entry), "--seed", "1"])
        src = base["src"] / _src_entry(t)
        bextra = ["--base", str(base["src"] / t.base)] if t.base else []
        vag = run("verify --against", ["verify", str(entry), "--against", str(src), *bextra, "--seed", "1"])
        run("convert", ["convert", str(entry), str(case_root / "converted")])
        if wanted is None or "load" in wanted:
            dig = runner.digest(entry)
            changed = digest_diff(ctx.baselines.digest(t), dig) if dig.get("ok") else None
        else:
            dig, changed = {"ok": True, "skipped": True}, []
        if mut.must_reject:
            for lbl, r in (("validate --deep", val), ("verify", ver)):
                if r.rc == 0:
                    findings.append(Finding("silent" if changed or not dig.get("ok") else "inconsistent", lbl,
                                            "accepted a provably invalid checkpoint"
                                            + ("" if changed or not dig.get("ok") else " (same meaning as the original)")))
        if val.rc == 0 and not dig.get("ok"):
            findings.append(Finding("silent", "validate --deep",
                                    f"accepts a checkpoint that w4pack's loader refuses: {dig['error']}"))
        if vag.rc == 0 and changed:
            findings.append(Finding("silent", "verify --against", "meaning changed, yet verify --against the source "
                                    "accepts: " + "; ".join(changed)))
        if rejected(val.rc) and vag.rc == 0 and ver.rc == 0:
            findings.append(Finding("inconsistent", "verify", f"validate rejects (exit {val.rc}) what verify and "
                                    "verify --against accept: " + _last(val.stderr)))
        primary_ok = val.rc == 0
    # one finding per class and command; "cannot tell which format" is a fair answer for a deleted or extra file
    seen, uniq = set(), []
    for f in findings:
        if full.get("scope") != "file" and f.cls == "wrong-exit" and "unknown format" in f.detail:
            continue
        if (f.cls, f.command) not in seen:
            seen.add((f.cls, f.command))
            uniq.append(f)
    status = "finding" if uniq else ("accepted" if primary_ok else "rejected")
    o = Outcome(reader, index, t.name, full, mut.desc, mut.must_reject, runs, uniq, status,
                seconds=round(time.monotonic() - t0, 2))
    if uniq:
        o.repro = str(case_root)
        keep_repro(o, case_root, dig)
    else:
        shutil.rmtree(case_root, ignore_errors=True)
    return o


def keep_repro(o: Outcome, case_root: Path, dig: dict[str, Any] | None) -> None:
    """The mutated input stays; beside it what was done and what came out."""
    shutil.rmtree(case_root / "converted", ignore_errors=True)
    doc = {"reader": o.reader, "index": o.index, "target": o.target, "mutation": o.desc, "spec": o.spec,
           "must_reject": o.must_reject, "findings": [dataclasses.asdict(f) for f in o.findings], "runs": o.runs,
           "digest_ok": None if dig is None else dig.get("ok"), "digest_error": None if dig is None else dig.get("error")}
    (case_root / "repro.json").write_text(json.dumps(doc, indent=2))
    sh = ["#!/bin/sh", f"# {o.reader} #{o.index} on {o.target}: {o.desc}",
          *(f"# {f.cls} in {f.command}: {f.detail}" for f in o.findings),
          f"cd {REPO}", "export PYTHONPATH=" + str(REPO)]
    for r in o.runs:
        sh.append(f"{sys.executable} -m " + " ".join(_q(a) for a in r["argv"]) + f"   # exit {r['rc']}")
    (case_root / "repro.sh").write_text("\n".join(sh) + "\n")


def _q(a: str) -> str:
    return a if re.fullmatch(r"[\w./,:+=-]+", a) else "'" + a.replace("'", "'\\''") + "'"


# ------------------------------------------------------------------------------------------------------------
# driver

class Fuzz:
    def __init__(self, out: Path, seed: int, readers: list[str], timeout: float, mem_mb: int):
        root = fixtures_root()
        if root is None:
            raise SystemExit("fuzz: fixtures not found (set W4PACK_FIXTURES or place shared/fixtures beside the checkout)")
        self.out, self.seed = out, seed
        self.runner = Runner(timeout, mem_mb)
        self.baselines = Baselines(out, self.runner)
        self.targets = {r: targets_for(r, root) for r in readers}
        for r, tl in self.targets.items():
            if not tl:
                raise SystemExit(f"fuzz: no fixture cases for reader {r} under {root}")


def summarize(outcomes: list[Outcome], readers: list[str]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for r in readers:
        row = {"mutations": 0, "runs": 0, "ok-exit-2": 0, "accepted-harmless": 0, **{c: 0 for c in CLASSES}}
        for o in outcomes:
            if o.reader != r:
                continue
            row["mutations"] += 1
            row["runs"] += len(o.runs)
            if o.status == "rejected":
                row["ok-exit-2"] += 1
            elif o.status == "accepted":
                row["accepted-harmless"] += 1
            for c in {f.cls for f in o.findings}:
                row[c] += 1
        table[r] = row
    return table


def print_table(table: dict[str, dict[str, int]]) -> None:
    cols = ["mutations", "runs", "ok-exit-2", "accepted-harmless", *CLASSES]
    heads = ["reader", *cols]
    rows = [[r, *(str(v[c]) for c in cols)] for r, v in table.items()]
    if len(rows) > 1:
        rows.append(["total", *(str(sum(v[c] for v in table.values())) for c in cols)])
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(heads)]
    print("  ".join(h.ljust(w[i]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(heads)))
    for x in rows:
        print("  ".join(v.ljust(w[i]) if i == 0 else v.rjust(w[i]) for i, v in enumerate(x)))


def _regex(text: str) -> re.Pattern[str]:
    """--targets: a regular expression that compiles (a bad one is a usage error, exit 2, not a traceback)."""
    try:
        return re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reader", default="all", choices=[*READERS, "all"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=1.0, help="time budget for all readers together")
    ap.add_argument("--runs", type=int, default=None, help="at most this many mutations (per reader)")
    ap.add_argument("--index", type=int, default=None, help="replay mutation INDEX only")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "fuzz")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per command")
    ap.add_argument("--mem-mb", type=int, default=3072, help="address-space limit per command (MiB)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the planned mutations, run no command")
    ap.add_argument("--target", help="with --spec: the target to mutate (e.g. gguf/q4_0_random_in256_out128)")
    ap.add_argument("--targets", metavar="REGEX", default=None, type=_regex,
                    help="fuzz only the targets whose name matches, and only the readers that have one (e.g. "
                         "'llama-' for llama.cpp's K-quant files)")
    ap.add_argument("--spec", type=json.loads, help="with --target: an explicit mutation spec (JSON, as recorded)")
    ap.add_argument("--replay", type=Path, default=None,
                    help="rerun the findings recorded in this summary.json on the current tree")
    ap.add_argument("--per-class", action="store_true",
                    help="with --replay: one finding per (reader, class, command, kind of mutation)")
    ap.add_argument("--digest", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.digest:
        print(json.dumps(digest(a.digest)))
        return 0
    if a.replay is not None:
        return replay(a)
    readers = list(READERS) if a.reader == "all" else [a.reader]
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    fz = Fuzz(a.out, a.seed, readers, a.timeout, a.mem_mb)
    if a.targets:
        fz.targets = {r: [t for t in tl if a.targets.search(t.name)] for r, tl in fz.targets.items()}
        fz.targets = {r: tl for r, tl in fz.targets.items() if tl}  # a reader without a match is not fuzzed
        if not fz.targets:
            ap.error(f"--targets {a.targets.pattern!r}: no target matches (readers: {', '.join(readers)})")
        readers = [r for r in readers if r in fz.targets]
    if a.list:
        for r in readers:
            for i in range(a.runs or 10):
                print(json.dumps(plan_one(fz, r, i)))
        return 0
    deadline = time.monotonic() + a.minutes * 60
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    if a.spec is not None and (a.target is None or len(readers) != 1):
        ap.error("--spec needs --target and one --reader")
    if a.spec is not None:
        a.index = a.index or 0
    if a.index is not None:
        todo: Iterable[tuple[str, int]] = [(r, a.index) for r in readers]
    else:
        def gen() -> Iterable[tuple[str, int]]:
            i = 0
            while time.monotonic() < deadline and (a.runs is None or i < a.runs):
                for r in readers:
                    if time.monotonic() >= deadline:
                        return
                    yield r, i
                i += 1
        todo = gen()

    def work(item: tuple[str, int]) -> None:
        r, i = item
        if a.index is None and time.monotonic() >= deadline:
            return
        o = fuzz_one(fz, r, i, spec=a.spec, target=a.target) if a.spec is not None else fuzz_one(fz, r, i)
        if o is not None:
            with lock:
                outcomes.append(o)
                if not a.json and o.findings:
                    print(f"[{r} #{i}] {o.target}: {o.desc}", file=sys.stderr)
                    for f in o.findings:
                        print(f"    {f.cls} in {f.command}: {f.detail[:200]}", file=sys.stderr)

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        pending = []
        for item in todo:
            pending.append(ex.submit(work, item))
            while sum(not p.done() for p in pending) >= 2 * max(1, a.jobs):
                time.sleep(0.05)
        for p in pending:
            p.result()
    outcomes.sort(key=lambda o: (readers.index(o.reader), o.index))
    table = summarize(outcomes, readers)
    skipped = {t.name: b["error"] for t in (x for tl in fz.targets.values() for x in tl)
               for b in [fz.baselines._done.get(t.name, {})] if "error" in b}
    doc = {"seed": a.seed, "minutes": a.minutes, "readers": readers, "table": table,
           "findings": [{"reader": o.reader, "index": o.index, "target": o.target, "mutation": o.desc,
                         "spec": o.spec, "findings": [dataclasses.asdict(f) for f in o.findings], "repro": o.repro}
                        for o in outcomes if o.findings],
           "skipped_targets": skipped}
    (a.out / "summary.json").write_text(json.dumps(doc, indent=2))
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        print_table(table)
        for name, e in skipped.items():
            print(f"skipped target {name}: {e}")
        print(f"reproducers and summary.json under {a.out}")
    return 1 if any(o.findings for o in outcomes) else 0


def mutation_kind(desc: str) -> str:
    """The kind of a recorded mutation ("rename tensor", "append", ...): its words before the first detail."""
    words = re.split(r"[^a-z ]", desc.lower(), maxsplit=1)[0].split()
    return " ".join(words[:2]) or desc[:20]


def replay_groups(doc: dict[str, Any], per_class: bool) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """The recorded findings to rerun, each once with its (first new) group key; per class, the first record of
    each group: a record that opens several groups (one mutation, findings in several commands) runs once."""
    out: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    seen: set[tuple[str, ...]] = set()
    for rec in doc.get("findings", []):
        keys = [(rec["reader"], f["cls"], f["command"], mutation_kind(rec["mutation"])) for f in rec["findings"]]
        new = [k for k in keys if k not in seen]
        seen.update(keys)
        if not keys or (per_class and not new):
            continue
        out.append(((new or keys)[0], rec))
    return out


def replay(a: argparse.Namespace) -> int:
    """Rerun recorded findings by their specs; report which still give a finding on this tree."""
    try:
        doc = json.loads(a.replay.read_text())
        groups = replay_groups(doc, a.per_class)
        for _, rec in groups:  # every key the rerun reads, checked before anything runs
            _ = (rec["index"], rec["spec"], rec["target"])
        unknown = sorted({str(rec["reader"]) for _, rec in groups} - set(READERS))
        if unknown:
            raise ValueError(f"unknown reader {unknown[0]!r} (known: {', '.join(READERS)})")
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        print(f"fuzz: error: {a.replay}: cannot read a summary: {exc}", file=sys.stderr)
        return 2
    except (AttributeError, KeyError, TypeError) as exc:
        print(f"fuzz: error: {a.replay}: not a fuzz summary (findings[].reader/index/target/mutation/spec/findings"
              f"[].cls/command): {type(exc).__name__} {exc}", file=sys.stderr)
        return 2
    readers = sorted({rec["reader"] for _, rec in groups}, key=READERS.index)
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    fz = Fuzz(a.out, doc.get("seed", a.seed), readers, a.timeout, a.mem_mb)
    rows = []
    for key, rec in groups:
        o = fuzz_one(fz, rec["reader"], rec["index"], spec=rec["spec"], target=rec["target"])
        now = sorted({f"{f.cls} in {f.command}" for f in o.findings}) if o is not None else ["target skipped"]
        rows.append({"group": list(key), "index": rec["index"], "target": rec["target"],
                     "mutation": rec["mutation"], "before": sorted({f"{f['cls']} in {f['command']}"
                                                                    for f in rec["findings"]}), "now": now})
        if not a.json:
            state = "still: " + "; ".join(now) if now else "fixed"
            print(f"[{rec['reader']} #{rec['index']}] {rec['target']}: {rec['mutation'][:80]}: {state}", flush=True)
    fixed = sum(not r["now"] for r in rows)
    (a.out / "replay.json").write_text(json.dumps({"replayed": rows, "fixed": fixed}, indent=2))
    if a.json:
        print(json.dumps({"replayed": rows, "fixed": fixed}, indent=2))
    else:
        print(f"{fixed} of {len(rows)} replayed findings give no finding now; details in {a.out / 'replay.json'}")
    return 0 if fixed == len(rows) else 1


def plan_one(fz: Fuzz, reader: str, index: int) -> dict[str, Any]:
    """Mutation ``index`` of ``reader`` applied to a scratch copy, without running anything (for --list)."""
    rng = random.Random(f"{fz.seed}:{reader}:{index}")
    tl = fz.targets[reader]
    t = tl[rng.randrange(len(tl))]
    base = fz.baselines.get(t)
    if "error" in base:
        return {"reader": reader, "index": index, "target": t.name, "skipped": base["error"]}
    scratch = fz.out / "plan" / f"{reader}-{index:05d}"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(base["packed"] if t.reader == "w4pack" else base["src"], scratch)
    try:
        m, spec = apply_mutation(t, scratch, rng, {})
        return {"reader": reader, "index": index, "target": t.name, "mutation": m.desc, "spec": spec,
                "must_reject": m.must_reject}
    except Skip:
        return {"reader": reader, "index": index, "target": t.name, "skipped": "no applicable mutation"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
