"""Shared test plumbing: where the peers' fixtures are, and the GPU marker."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from w4pack.canonical import CanonicalLayer
from w4pack.formats.base import Source, TensorData

REPO = Path(__file__).resolve().parent.parent


def fixtures_root() -> Path | None:
    """$W4PACK_FIXTURES, else ../shared/fixtures beside the checkout; None when neither exists."""
    env = os.environ.get("W4PACK_FIXTURES")
    if env:
        p = Path(env)
        return p if p.is_dir() else None
    p = REPO.parent / "shared" / "fixtures"
    return p if p.is_dir() else None


def fixture_dir(*parts: str) -> Path:
    """A fixture folder, or skip the test with the reason when fixtures are not available."""
    root = fixtures_root()
    if root is None:
        pytest.skip("peer fixtures not found (set W4PACK_FIXTURES or place shared/fixtures beside the checkout)")
    p = root.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"fixture {p} not present")
    return p


def fixture_cases(family: str) -> list[str]:
    """Case folder names of one fixture family (for parametrize); empty when fixtures are absent."""
    root = fixtures_root()
    if root is None or not (root / family).is_dir():
        return []
    return sorted(p.name for p in (root / family).iterdir() if p.is_dir() and (p / "case.json").exists())


class MemSource(Source):
    """Canonical layers and pass-through tensors held in memory: the Source a writer is handed in tests."""

    def __init__(self, layers: dict[str, CanonicalLayer], tensors: dict[str, TensorData] | None = None,
                 config: dict[str, Any] | None = None):
        self._layers, self._tensors = layers, tensors or {}
        self.config = config or {"model_type": "llama"}
        self.info = {"format": "memory"}
        self.path = Path("memory")

    def layer_names(self) -> list[str]:
        return list(self._layers)

    def read_layer(self, name: str) -> CanonicalLayer:
        return self._layers[name].replace(name=name)

    def passthrough_names(self) -> list[str]:
        return list(self._tensors)

    def read_tensor(self, name: str) -> TensorData:
        return self._tensors[name]


def full_disk_open(fails: Callable[[str, str], bool]) -> Callable[..., Any]:
    """A replacement for a module's ``open``: files for which ``fails(path, mode)`` holds fail every write with
    ENOSPC, as on a full disk (monkeypatch it in as ``module.open``)."""

    class Full:
        def __init__(self, fh: Any):
            self.fh = fh

        def write(self, _data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.fh, name)

    def full_open(path: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        fh = open(path, mode, *args, **kw)
        return Full(fh) if fails(str(path), mode) else fh

    return full_open


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
