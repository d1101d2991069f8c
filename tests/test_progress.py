"""Progress bars are tqdm's, drawn on a terminal (or when asked), never into logs, pipes or next to --json output."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rtn_helper import write_random_llama_gptq

from w4pack.cli import main
from w4pack.progress import Progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize("tty,enabled,drawn", [(True, None, True), (False, None, False), (False, True, True),
                                               (True, False, False)])
def test_bar_is_tqdm_and_only_where_wanted(tty: bool, enabled: bool | None, drawn: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Stream(tty)
    monkeypatch.setattr("sys.stderr", err)
    with Progress(3, "packing", enabled=enabled) as bar:
        for _ in range(3):
            bar.update()
    text = err.getvalue()
    if drawn:
        assert "packing: 100%|" in text and "3/3" in text and text.endswith("\n"), text  # tqdm's own line
    else:
        assert text == ""


def _gptq_folder(tmp_path: Path) -> Path:
    src = tmp_path / "gptq"
    write_random_llama_gptq(src, seed=0, std=0.1, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=4, vocab_size=32)
    return src


@pytest.mark.parametrize("tty", [False, True])
def test_convert_json_stdout_is_the_document_alone(tty: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a terminal (a log, CI) stderr holds no bar at all; on one the bar goes to stderr, and stdout is the
    JSON document either way."""
    src = _gptq_folder(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    rc = main(["convert", str(src), str(tmp_path / "out"), "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert json.loads(cap.out)["layers"] == 7
    if tty:
        assert "packing: 100%|" in cap.err, cap.err
    else:
        assert "\r" not in cap.err and "%|" not in cap.err and "packing" not in cap.err, cap.err
