"""The files of TOML+NumPy quant tables: TOML documents and .npy arrays (never pickles).

The reader in ``formats/toml_tables.py`` receives parsed documents and arrays from here; the writer hands its
text and arrays here to be written into the temporary output folder.
"""
from __future__ import annotations

import errno
import os
import re
import tokenize
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadInputError

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["read_toml", "read_npy", "table_documents", "has_table_documents", "npy_beside", "append_text", "write_npy", "QUANT_TOML",
           "DECODER_RE"]

QUANT_TOML = "quant.toml"
#: the April 2023 variant: one document per decoder block, ``decoder-N.toml`` (also ``decoder.N.toml``)
DECODER_RE = re.compile(r"^decoder[-.](\d+)\.toml$")


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise BadInputError(f"not valid TOML: {exc}", file=str(path)) from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively: "a = " + "[" * 50000
        raise BadInputError("not valid TOML: arrays or inline tables nested too deeply", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"cannot read: {exc}", file=str(path)) from None


def read_npy(path: Path, tensor: str | None = None) -> Any:
    """The array of a .npy file, loaded without pickles. numpy parses the header with ``tokenize`` and
    ``ast``: a stray byte there surfaces as their errors, which are the file's fault like any other."""
    try:
        _check_npy_size(path)
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError) as exc:
        raise BadInputError(f"not a readable .npy array (truncated, or holds objects): {exc}", file=str(path),
                            tensor=tensor) from None


def _check_npy_size(path: Path) -> None:
    """The header's shape against the bytes the file holds, before numpy allocates it: a header that claims
    2^40 elements must be a one-line error, not a MemoryError (or a 4 TiB allocation that succeeds)."""
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version in ((2, 0), (3, 0)):
            shape, _fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"unsupported .npy version {version}")
        data_at = fh.tell()
        size = os.fstat(fh.fileno()).st_size
    if dtype.hasobject:
        raise ValueError("holds Python objects")
    count = 1
    for dim in shape:
        count *= int(dim)
    need = count * dtype.itemsize
    if need > size - data_at:
        raise ValueError(f"the header declares shape {tuple(shape)} of {dtype} ({need} bytes) but the file holds "
                         f"{size - data_at} bytes of data")


def table_documents(path: Path) -> tuple[Path, list[Path], str]:
    """(folder, TOML documents in order, variant) of a table export: ``path`` is one document or a folder with
    quant.toml or decoder-N.toml files."""
    if path.is_file():
        folder = path.parent
        files = [path]
    else:
        folder = path
        if (path / QUANT_TOML).is_file():
            files = [path / QUANT_TOML]
            other = sorted(p.name for p in path.iterdir() if DECODER_RE.match(p.name))
            if other:  # two sets of tables for one model: reading either would silently ignore the other
                raise BadInputError(f"holds both {QUANT_TOML} and {other[0]}: two sets of quant tables, and which "
                                    f"one is the model cannot be told; keep one, or name the document to read",
                                    file=str(path))
        else:
            found = [(int(m.group(1)), p) for p in path.iterdir() if (m := DECODER_RE.match(p.name)) and p.is_file()]
            files = [p for _i, p in sorted(found)]
            _check_contiguous(path, sorted(i for i, _p in found))
    if not files:
        raise BadInputError(f"no {QUANT_TOML} or decoder-N.toml quant tables here" + tables_below_hint(path),
                            file=str(path))
    variant = QUANT_TOML if files[0].name == QUANT_TOML else "decoder-N.toml"
    return folder, files, variant


def _check_contiguous(folder: Path, indices: list[int]) -> None:
    """decoder-0.toml … decoder-N.toml with none missing: a deleted document would silently drop its layer's
    quantization (the model would then run that layer's float weights, or none)."""
    for want, got in enumerate(indices):
        if want and got == indices[want - 1]:
            raise BadInputError(f"two documents for decoder layer {got} (decoder-{got}.toml and decoder.{got}.toml)",
                                file=str(folder))
        if got != want:
            raise BadInputError(f"decoder-{want}.toml is missing (found decoder-N.toml for N = {indices[0]} … "
                                f"{indices[-1]}; one document per decoder layer, from 0)", file=str(folder))


def has_table_documents(path: Path) -> bool:
    """Whether ``path`` is a table document or a folder holding one (detection: names only)."""
    if path.is_file():
        return path.name == QUANT_TOML or bool(DECODER_RE.match(path.name))
    if not path.is_dir():
        return False
    return (path / QUANT_TOML).is_file() or any(DECODER_RE.match(p.name) for p in path.iterdir())


def tables_below_hint(path: Path) -> str:
    """"; the quant tables are in FOLDER/quant_dir: pass that folder" when a sub-folder of ``path`` holds them (how
    GPTQ-for-LLaMa's export is usually laid out beside the base weights), else ""."""
    try:
        subs = sorted(p for p in Path(path).iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return ""
    found = [d for d in subs if has_table_documents(d)]
    return f"; the quant tables are in {found[0]}: pass that folder (with --base)" if found else ""


def npy_beside(folder: Path, rel: str, key: str) -> Path:
    """The .npy file a table names (``key = "<rel>"``) inside ``folder``. BadInputError without a file (the caller
    names the document and layer) when the name leaves the folder, the file is missing, or the file system refuses
    the name (too long, a NUL byte): each is a fault of the table, not of the disk."""
    relp = Path(rel)
    p = folder / relp
    try:
        if relp.is_absolute() or ".." in relp.parts or not p.resolve().is_relative_to(folder.resolve()):
            raise BadInputError(f"{key} path {rel!r} escapes the table folder")
        if not p.is_file():
            raise BadInputError(f"{key} file {rel!r} " + ("is not a regular file" if p.exists() else "is missing"))
    except BadInputError:
        raise
    except OSError as exc:
        reason = "the file name is too long" if exc.errno == errno.ENAMETOOLONG else \
            f"not a usable file name ({exc.strerror or exc})"
        raise BadInputError(f"{key} names {_short(rel)}: {reason}") from None
    except ValueError as exc:  # an embedded NUL byte
        raise BadInputError(f"{key} names {_short(rel)}: not a usable file name ({exc})") from None
    return p


def _short(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def append_text(path: Path, text: str) -> None:
    """Append ``text`` to a document being written (the writer emits one layer's table at a time)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


def write_npy(path: Path, arr: np.ndarray) -> None:
    np.save(path, np.ascontiguousarray(arr), allow_pickle=False)
