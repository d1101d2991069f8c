"""The files of TOML+NumPy quant tables: TOML documents and .npy arrays (never pickles)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadInputError

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["read_toml", "read_npy"]


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise BadInputError(f"not valid TOML: {exc}", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"cannot read: {exc}", file=str(path)) from None


def read_npy(path: Path, tensor: str | None = None) -> Any:
    """The array of a .npy file, loaded without pickles."""
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise BadInputError(f"not a readable .npy array (truncated, or holds objects): {exc}", file=str(path),
                            tensor=tensor) from None
