"""The files of a model folder: JSON documents and the file names an index or manifest points at.

Every reader (our checkpoints and the peers' formats) goes through these two checks, so a hostile index
is refused the same way everywhere.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import BadInputError

__all__ = ["read_json", "write_json", "member", "brief"]


def read_json(path: Path) -> Any:
    """Parse a JSON file; a missing, unreadable, malformed or hostile file is bad input naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise BadInputError("file is missing", file=str(path)) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, or an integer too long to convert
        raise BadInputError(f"not valid JSON: {exc}", file=str(path)) from None
    except RecursionError:  # hostile nesting ("[" * 100000) exhausts the parser's stack
        raise BadInputError("not valid JSON: nested too deeply", file=str(path)) from None
    except OSError as exc:
        raise BadInputError(f"cannot read: {exc.strerror}", file=str(path)) from None


def brief(value: Any, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: a hostile value must not turn a one-line error into megabytes."""
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_json(path: Path, doc: Any) -> None:
    """A JSON document as the Hugging Face tools write them: indented, with a final newline."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")


def member(root: Path, name: Any, what: str, file: str) -> Path:
    """``root / name`` for a file named inside an index or manifest, refusing anything that could leave
    the folder: separators, ``..``, hidden or absolute names, and symbolic links that resolve outside."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or ".." in name or name.startswith("."):
        raise BadInputError(f"{what} {name!r} is not a plain file name inside the folder", file=file)
    p = root / name
    if p.is_symlink() and not p.resolve().is_relative_to(root.resolve()):
        raise BadInputError(f"{what} {name!r} is a symbolic link out of the folder", file=file)
    return p
