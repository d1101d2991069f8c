"""The files of a model folder: JSON documents and the file names an index or manifest points at.

Every reader (our checkpoints and the peers' formats) goes through these two checks, so a hostile index
is refused the same way everywhere.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from ..errors import BadInputError, IOFailure

__all__ = ["read_json", "read_side_json", "nesting", "json_problem", "MAX_JSON_DEPTH", "MAX_JSON_BYTES", "write_json",
           "member", "brief", "is_json_int", "link_target_allowed", "side_file", "side_files"]


#: the largest JSON file read: the largest a model folder holds are tokenizer files of a few tens of MB; reading a
#: bigger one whole would take ten times its size in memory before anything could be said about it
MAX_JSON_BYTES = 256 << 20


def read_json(path: Path) -> Any:
    """Parse a JSON file; a missing, unreadable, malformed or hostile file is bad input naming the file. Only a
    regular file is read: a FIFO in its place would block the reader for ever, and /dev/zero would fill memory."""
    try:
        # (O_NONBLOCK: opening a FIFO must not wait for a writer; it changes nothing for a regular file)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, encoding="utf-8", closefd=True) as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise BadInputError("not a regular file (a JSON document of a model folder is a plain file)",
                                    file=str(path))
            if st.st_size > MAX_JSON_BYTES:
                raise BadInputError(f"{st.st_size} bytes: larger than any JSON file of a model folder (at most "
                                    f"{MAX_JSON_BYTES >> 20} MiB are read)", file=str(path))
            text = fh.read(MAX_JSON_BYTES + 1)
        doc = json.loads(text, object_pairs_hook=unique_keys)
    except BadInputError:
        raise
    except DuplicateKeyError as exc:
        raise BadInputError(f"key {brief(exc.key)} appears twice in one object (readers disagree on which "
                            "value holds)", file=str(path)) from None
    except FileNotFoundError:
        raise BadInputError("file is missing", file=str(path)) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, or an integer too long to convert
        raise BadInputError(f"not valid JSON: {exc}", file=str(path)) from None
    except RecursionError:  # hostile nesting ("[" * 100000) exhausts the parser's stack
        raise BadInputError("not valid JSON: nested too deeply", file=str(path)) from None
    except OSError as exc:
        raise BadInputError(f"cannot read: {exc.strerror}", file=str(path)) from None
    # (UTF-8 text holds no surrogate, only a \udXXX escape makes one: the strings are walked only when one is there)
    problem = json_problem(doc, strings=_SURROGATE_ESCAPE.search(text) is not None)
    if problem:
        raise BadInputError(problem, file=str(path))
    return doc


#: how deep a JSON document may nest. Python's parser stops near its recursion limit, which depends on how deep the
#: caller's stack already is: a config.json nested 976 levels read here but not where the model card reads it again
#: (an "unexpected RecursionError" after every tensor was written). A fixed bound decides the same everywhere.
MAX_JSON_DEPTH = 128


def nesting(doc: Any) -> int:
    """How many arrays and objects deep ``doc`` nests (a scalar: 0), walked without recursion."""
    return _walk(doc)[0]


#: a JSON escape of a UTF-16 surrogate (half of a pair, or a lone one)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def json_problem(doc: Any, strings: bool = True) -> str | None:
    """What makes a parsed JSON document unfit for a model folder although Python parsed it, or None: nesting past
    MAX_JSON_DEPTH, or a string (key or value) holding a lone surrogate. JSON may spell one (``"\\udcff"``) and
    Python's parser keeps it, but it is no Unicode text: the reference safetensors library, Hugging Face's Rust
    tokenizers and strict parsers refuse it, and copied on it would make an output they cannot read (I-JSON,
    RFC 7493, forbids it). ``strings=False``: the depth only (the caller knows no string can hold one)."""
    depth, bad = _walk(doc, strings)
    if depth > MAX_JSON_DEPTH:
        return f"JSON nested {depth} levels deep (more than {MAX_JSON_DEPTH}; a model's JSON files nest a few levels)"
    if bad is not None:
        return (f"string {ascii(bad)[:80]} is not valid Unicode (a \\ud800-\\udfff escape that is not half of a "
                "surrogate pair)")
    return None


def _walk(doc: Any, strings: bool = True) -> tuple[int, str | None]:
    """(depth, the first string that cannot be encoded as UTF-8 or None; None unless ``strings``), without
    recursion."""
    deepest, bad = 0, None
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if bad is None:
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    bad = node
            continue
        if isinstance(node, dict):
            children: Any = [*node.keys(), *node.values()]
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, str) if strings else (dict, list)))
    return deepest, bad


class DuplicateKeyError(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object without repeated keys: Python keeps the last value, other parsers the first, so a
    repeated key could mean one thing to validate and another to a loader."""
    doc: dict[str, Any] = {}
    for k, v in pairs:
        if k in doc:
            raise DuplicateKeyError(k)
        doc[k] = v
    return doc


def read_side_json(path: Path) -> dict[str, Any]:
    """A JSON side file (generation config, tokenizer files, config.json, the index): every one the Hugging Face
    loaders read is a JSON object, so anything else (truncated, empty, a list) is bad input naming the file. The
    writers check it before copying and validate/verify before accepting, so neither carries what the loader
    would refuse later."""
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise BadInputError(f"not a JSON object (a {type(doc).__name__})", file=str(path))
    return doc


def brief(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: a hostile value must not turn a one-line error into megabytes."""
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_json_int(v: Any) -> bool:
    """A JSON integer as the readers take one: not a bool, float (4.0, 128.5, Infinity) or string, all of which
    int() would have coerced."""
    return isinstance(v, int) and not isinstance(v, bool)


def write_json(path: Path, doc: Any) -> None:
    """A JSON document as the Hugging Face tools write them: indented, with a final newline."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")


def _plain(name: Any) -> bool:
    """A plain file name: no separators, no ``..``, not hidden, not absolute."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and ".." not in name \
        and not name.startswith(".")


def link_target_allowed(root: Path, real: Path) -> bool:
    """Whether a file of the folder ``root`` whose real path is ``real`` stays within what the folder may name:
    the folder itself or, for a Hugging Face hub cache snapshot (``models--org--name/snapshots/<revision>``, whose
    files are links into ``../../blobs``), that repository's ``blobs`` folder. Anything else is a link out."""
    base = root.resolve()
    if real.is_relative_to(base):
        return True
    snapshots = base.parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith(("models--", "datasets--")):
        blobs = snapshots.parent / "blobs"
        return blobs.is_dir() and real.is_relative_to(blobs.resolve())
    return False


def side_file(path: str | Path) -> Path:
    """The real path of a side file (tokenizer.json, ...) if it is a regular file of its folder. A symbolic link
    out of the folder is refused: copying it would put whatever it points at (/etc/passwd, another model's files)
    into the output. Same rule as for shards (member)."""
    p = Path(path)
    try:
        real = p.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling or looping link
        raise BadInputError("side file is a broken symbolic link", file=str(p)) from None
    if not link_target_allowed(p.parent, real):
        raise BadInputError(f"side file is a symbolic link out of the source folder (to {real}); refusing to copy "
                            "it: replace the link with a copy of the file to convert it", file=str(p))
    if not real.is_file():
        raise BadInputError("side file is not a regular file", file=str(p))
    return real


def side_files(root: Path, names: Any) -> list[Path]:
    """The side files among ``names`` that exist in ``root``, each checked by side_file (links included: a
    broken one is refused rather than skipped, so the user learns why a tokenizer did not come along)."""
    out = []
    for n in names:
        if not _plain(n):
            raise BadInputError(f"side file {n!r} is not a plain file name inside the folder", file=str(root))
        p = root / n
        if p.is_symlink() or p.exists():
            side_file(p)
            out.append(p)
    return out


def member(root: Path, name: Any, what: str, file: str) -> Path:
    """``root / name`` for a file named inside an index or manifest, refusing anything that could leave
    the folder: separators, ``..``, hidden or absolute names, and symbolic links that resolve outside."""
    if not _plain(name):
        raise BadInputError(f"{what} {name!r} is not a plain file name inside the folder", file=file)
    p = root / name
    if p.is_symlink() and not link_target_allowed(root, p.resolve()):
        raise BadInputError(f"{what} {name!r} is a symbolic link out of the folder", file=file)
    return p


def copy_side_files(paths: Any, dest: Path) -> None:
    """Copy a source's side files into the folder being written, skipping what the writer makes itself
    (store.names.is_side_file: configs, index, manifest, weights, hidden files)."""
    from .names import is_side_file

    for p in paths:
        if not is_side_file(p.name):
            continue
        if p.name.endswith(".json"):
            read_side_json(p)  # malformed JSON or not an object: refused here (naming the file), not by the loader
        try:
            shutil.copyfile(p, dest / p.name)
        except OSError as exc:
            raise IOFailure(f"cannot copy side file: {exc.strerror}", file=str(p)) from None
