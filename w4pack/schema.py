"""Load the JSON Schemas in schemas/ and validate documents against them with one-line errors."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from .errors import BadInputError

__all__ = ["schema_dir", "load_schema", "validate_manifest", "validate_quantization_config"]


def schema_dir() -> Path:
    """schemas/ of a source checkout, or the copy installed as package data."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "schemas", here / "_schemas"):
        if (cand / "manifest.schema.json").is_file():
            return cand
    raise FileNotFoundError("w4pack's JSON schemas are missing from this installation")


@functools.lru_cache(maxsize=None)
def load_schema(name: str) -> dict[str, Any]:
    with open(schema_dir() / f"{name}.schema.json", encoding="utf-8") as fh:
        return json.load(fh)


@functools.lru_cache(maxsize=None)
def _validator(name: str):  # type: ignore[no-untyped-def]
    import jsonschema

    schema = load_schema(name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _validate(name: str, doc: Any, file: str | None) -> None:
    errors = sorted(_validator(name).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        path = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise BadInputError(f"{name} schema violation at {path}: {err.message}{more}", file=file)


def validate_manifest(doc: Any, file: str | None = None) -> None:
    _validate("manifest", doc, file)


def validate_quantization_config(doc: Any, file: str | None = None) -> None:
    _validate("quantization_config", doc, file)
