"""torch.save files (.pt/.bin): tensors that hold no dense CPU data are refused when the file is read, and a pickle
torch will not load gets w4pack's one line on stderr, without torch's warning before it."""
from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

from w4pack.errors import BadInputError
from w4pack.store.torchfile import load_state_dict

torch = pytest.importorskip("torch")

PREFIX = "model.layers.0.mlp.down_proj"


def _awq_dump(scales: Any) -> dict[str, Any]:
    """An llm-awq style state dict whose scales are the given tensor."""
    return {f"{PREFIX}.qweight": torch.zeros(64, 512, dtype=torch.int16), f"{PREFIX}.scales": scales,
            f"{PREFIX}.scaled_zeros": torch.zeros(8, 256, dtype=torch.float16)}


def _cli(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "w4pack", *map(str, args)], capture_output=True, text=True)


BAD_TENSORS: dict[str, tuple[Callable[[], Any], str]] = {
    "meta": (lambda: torch.empty(8, 256, dtype=torch.float16, device="meta"), "meta device"),
    "sparse_coo": (lambda: torch.ones(8, 256, dtype=torch.float16).to_sparse(), "layout sparse_coo"),
    "sparse_csr": (lambda: torch.ones(8, 256, dtype=torch.float32).to_sparse_csr(), "layout sparse_csr"),
}


@pytest.mark.parametrize("kind", list(BAD_TENSORS))
def test_meta_and_sparse_tensors_refused_at_load(kind: str, tmp_path: Path) -> None:
    make, what = BAD_TENSORS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's beta warning for sparse CSR when building the test input
        torch.save(_awq_dump(make()), tmp_path / "dump.pt")
    with pytest.raises(BadInputError) as exc:
        load_state_dict(tmp_path / "dump.pt")
    text = exc.value.one_line()
    assert "dump.pt" in text and f"tensor {PREFIX}.scales" in text and what in text
    # inspect used to pass (exit 0) and convert to crash with "unexpected TypeError/RuntimeError"
    for args in (("inspect", tmp_path / "dump.pt"), ("convert", tmp_path / "dump.pt", tmp_path / "out")):
        proc = _cli(*args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "dump.pt" in lines[0] and f"{PREFIX}.scales" in lines[0] and what in lines[0]
        assert "unexpected" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_raw_protocol_4_pickle_is_one_line_without_torch_warning(tmp_path: Path) -> None:
    with open(tmp_path / "raw.pt", "wb") as fh:
        pickle.dump({f"{PREFIX}.qweight": [1, 2, 3]}, fh, protocol=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(BadInputError, match="weights_only"):
            load_state_dict(tmp_path / "raw.pt")
    assert not [w for w in caught if "pickle protocol" in str(w.message)]
    proc = _cli("inspect", tmp_path / "raw.pt")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "raw.pt" in lines[0] and "weights_only" in lines[0], proc.stderr


def test_expanded_view_claiming_more_than_its_storage_is_refused(tmp_path: Path) -> None:
    """A pickle holds storages: one element expanded to [2^20, 2^19] is a 1 TiB tensor in a file of a few bytes.
    It used to load, and convert died copying it out ("unexpected RuntimeError ... can't allocate memory", or
    allocated what the machine had); contiguous, transposed and sliced views still read."""
    dump = _awq_dump(torch.zeros(8, 256, dtype=torch.float16))
    dump["lm_head.weight"] = torch.zeros(1, dtype=torch.float16).expand(2**20, 2**19)
    torch.save(dump, tmp_path / "dump.pt")
    with pytest.raises(BadInputError) as exc:
        load_state_dict(tmp_path / "dump.pt")
    text = exc.value.one_line()
    assert "dump.pt" in text and "tensor lm_head.weight" in text and "strides [0, 0]" in text, text
    proc = _cli("convert", tmp_path / "dump.pt", tmp_path / "out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "lm_head.weight" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
    base = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    fine = {"t": base.t(), "s": base[8:16, ::2], "c": base.clone()}
    torch.save(fine, tmp_path / "fine.pt")
    sd = load_state_dict(tmp_path / "fine.pt")
    assert sorted(sd) == ["c", "s", "t"]


def test_tensor_name_that_is_not_unicode_is_refused(tmp_path: Path) -> None:
    """A pickle's string may hold a lone surrogate; carried into a safetensors header (as the escape \\udcff) it
    made an output the reference library and Hugging Face loaders refuse."""
    dump = _awq_dump(torch.zeros(8, 256, dtype=torch.float16))
    dump["model.norm\udcff.weight"] = torch.ones(4, dtype=torch.float16)
    torch.save(dump, tmp_path / "dump.pt")
    with pytest.raises(BadInputError) as exc:
        load_state_dict(tmp_path / "dump.pt")
    text = exc.value.one_line()
    assert "dump.pt" in text and "not valid Unicode" in text and "\\udcff" in text, text
    text.encode("utf-8")  # the message itself prints anywhere


def test_fifo_named_like_a_torch_file_is_one_line_exit_2(tmp_path: Path) -> None:
    """A FIFO called model.pt was "cannot tell which format" (exit 3) to inspect and "does not exist" to convert
    --from awq; it is bad input that says what it is, as a FIFO called .safetensors already was."""
    import os

    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    for args in (("inspect", fifo), ("convert", fifo, tmp_path / "out", "--from", "awq")):
        proc = _cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"{fifo}: not a regular file" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
    # in a folder given as the source it was "no weights found": named now
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    proc = _cli("inspect", tmp_path, "--from", "awq")
    assert proc.returncode == 2 and f"{fifo}: not a regular file" in proc.stderr, proc.stderr
