"""The safetensors reader: hostile header entries become one-line BadInputErrors naming the file and tensor."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from w4pack.cli import main
from w4pack.errors import BadInputError, UnsupportedError
from w4pack.safetensors_io import SafetensorsFile, write_safetensors


def _raw_file(path: Path, header: bytes, data: bytes = b"\0" * 16) -> Path:
    """A safetensors file with exactly this header text (json.dumps cannot write every hostile header)."""
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _refused(path: Path, *needles: str) -> str:
    with pytest.raises(BadInputError) as exc:
        SafetensorsFile(path)
    text = str(exc.value)
    assert "\n" not in text and str(path) in text
    for needle in needles:
        assert needle in text, text
    return text


@pytest.mark.parametrize("entry,needle", [
    (b'{"dtype": ["F16"], "shape": [2], "data_offsets": [0, 4]}', "dtype must be a string"),
    (b'{"dtype": {"a": 1}, "shape": [2], "data_offsets": [0, 4]}', "dtype must be a string"),
    (b'{"dtype": "F16", "shape": [Infinity, 256], "data_offsets": [0, 4]}', "shape must be a list"),
    (b'{"dtype": "F16", "shape": [NaN], "data_offsets": [0, 4]}', "shape must be a list"),
    (b'{"dtype": "F16", "shape": [4.7, 256], "data_offsets": [0, 4]}', "shape must be a list"),
    (b'{"dtype": "F16", "shape": [2.0], "data_offsets": [0, 4]}', "shape must be a list"),
    (b'{"dtype": "F16", "shape": ["4", "256"], "data_offsets": [0, 4]}', "shape must be a list"),
    (b'{"dtype": "F16", "shape": [true, 2], "data_offsets": [0, 4]}', "shape must be a list"),
    (b'{"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}', "shape must be a list"),
    (b'{"dtype": "F16", "shape": "2", "data_offsets": [0, 4]}', "shape must be a list"),
    (b'{"dtype": "F16", "shape": [2], "data_offsets": [0.0, 4.0]}', "data_offsets must be two"),
    (b'{"dtype": "F16", "shape": [2], "data_offsets": [0, 4, 8]}', "data_offsets must be two"),
    (b'{"dtype": "F16", "shape": [2], "data_offsets": ["0", "4"]}', "data_offsets must be two"),
    (b'{"dtype": "F16", "shape": [2], "data_offsets": [-4, 0]}', "data_offsets must be two"),
    (b'{"dtype": "F16", "shape": [2]}', "lacks dtype/shape/data_offsets"),
    (b'[1, 2]', "lacks dtype/shape/data_offsets"),
])
def test_malformed_header_entry(tmp_path: Path, entry: bytes, needle: str) -> None:
    p = _raw_file(tmp_path / "bad.safetensors", b'{"t.weight": ' + entry + b"}")
    _refused(p, "tensor t.weight", needle)


@pytest.mark.parametrize("shape,offsets", [
    ("[4294967296, 4294967296]", "[0, 0]"),  # int64 product wraps to 0 bytes
    ("[4294967296, 4294967297]", "[0, 0]"),
    ("[0, 4611686018427387904]", "[0, 0]"),  # empty, yet numpy cannot make the array
    ("[3074457345618258603, 3]", "[0, 2]"),  # 2**63 + 1 elements: the int64 product wraps
])
def test_huge_shape_is_refused_not_wrapped(tmp_path: Path, shape: str, offsets: str) -> None:
    p = _raw_file(tmp_path / "huge.safetensors",
                  f'{{"t": {{"dtype": "F16", "shape": {shape}, "data_offsets": {offsets}}}}}'.encode())
    _refused(p, "tensor t", "too large")


def test_size_mismatch_still_named(tmp_path: Path) -> None:
    p = _raw_file(tmp_path / "short.safetensors", b'{"t": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 8]}}')
    _refused(p, "tensor t", "do not hold 24 bytes")


def test_deeply_nested_or_huge_int_header(tmp_path: Path) -> None:
    _refused(_raw_file(tmp_path / "deep.safetensors", b"[" * 100000), "not valid JSON")
    _refused(_raw_file(tmp_path / "deep2.safetensors", b'{"t": ' + b"[" * 100000), "not valid JSON")
    big = b'{"t": {"dtype": "F16", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'
    _refused(_raw_file(tmp_path / "bigint.safetensors", big), "not valid JSON")


def test_long_values_do_not_flood_the_line(tmp_path: Path) -> None:
    shape = "[" + ", ".join(["1.5"] * 10000) + "]"
    p = _raw_file(tmp_path / "long.safetensors",
                  f'{{"t": {{"dtype": "F16", "shape": {shape}, "data_offsets": [0, 0]}}}}'.encode())
    assert len(_refused(p, "shape must be a list")) < 400
    p = _raw_file(tmp_path / "longdt.safetensors",
                  b'{"t": {"dtype": "' + b"X" * 10000 + b'", "shape": [], "data_offsets": [0, 0]}}')
    with pytest.raises(UnsupportedError) as exc:
        SafetensorsFile(p)
    assert len(str(exc.value)) < 400


def test_valid_file_still_reads(tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    write_safetensors(tmp_path / "ok.safetensors", [("a", a, None), ("e", np.zeros((0, 5), np.int8), None)])
    with SafetensorsFile(tmp_path / "ok.safetensors") as f:
        assert np.array_equal(f.get("a"), a) and f.get("e").shape == (0, 5)


def test_cli_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _raw_file(tmp_path / "model.safetensors",
                  b'{"t": {"dtype": "F16", "shape": [Infinity, 256], "data_offsets": [0, 4]}}')
    rc = main(["convert", str(p), str(tmp_path / "out"), "--from", "gptq"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and "unexpected" not in err
    assert "model.safetensors" in err and "tensor t" in err


# -- a file that changes while it is read (issue 30 item 4) -------------------------------------------------------
# Run in a child process: on a reader that maps the file, touching a truncated page is SIGBUS, which must fail the
# test (negative return code), not kill pytest.
_CHANGED_CHILD = r"""
import os, sys
import numpy as np
from w4pack.errors import W4PackError
from w4pack.store.safetensors import SafetensorsFile, write_safetensors
from w4pack.store.tensors import open_tensors

path, how, api = sys.argv[1], sys.argv[2], sys.argv[3]
rng = np.random.default_rng(0)
write_safetensors(path, [("a", rng.standard_normal((512, 512)).astype(np.float32), None),
                         ("b", rng.standard_normal((512, 512)).astype(np.float32), None)])
f = SafetensorsFile(path) if api == "file" else open_tensors(path)
if how == "truncate":
    os.truncate(path, 4096)
else:  # rewritten in place, same size: the bytes are no longer those the header was checked against
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(st.st_size - 4)
        fh.write(b"\xff\xff\xff\x7f")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
try:
    for name in ("a", "b"):
        arr = f.get(name) if api != "copy" else f.read_copy(name)
        float(np.asarray(arr, dtype=np.float64).sum())  # touch every byte
except W4PackError as exc:
    print(exc.exit_code, exc.one_line())
    sys.exit(0)
print("read without an error")
"""


@pytest.mark.parametrize("api", ["file", "store", "copy"])
@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_file_changed_while_open_is_an_error_not_sigbus(tmp_path: Path, how: str, api: str) -> None:
    import os
    import subprocess
    import sys

    path = tmp_path / "model.safetensors"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", _CHANGED_CHILD, str(path), how, api], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"child died (signal {-proc.returncode})" if proc.returncode < 0 else proc.stderr
    line = proc.stdout.strip()
    assert line.count("\n") == 0 and line.startswith("4 "), line
    assert f"{path}: tensor a: changed while being read" in line, line


def test_reads_are_private_arrays(tmp_path: Path) -> None:
    """get() is read-only like the map it replaces; read() fills the caller's buffer and checks its size."""
    path = tmp_path / "m.safetensors"
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    write_safetensors(path, [("a", a, None), ("e", np.zeros((0, 4), np.float16), None)])
    with SafetensorsFile(path) as f:
        got = f.get("a")
        assert not got.flags.writeable and np.array_equal(got, a)
        out = np.empty((3, 4), np.int32)
        assert f.read("a", out) is out and np.array_equal(out, a)
        with pytest.raises(ValueError):
            f.read("a", np.empty(5, np.int32))
        assert f.get("e").shape == (0, 4)


def test_fifo_in_place_of_the_weights_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO named model.safetensors blocked open() until a writer came: inspect/convert hung forever."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "model.safetensors")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for argv in (["inspect", src], ["inspect", src / "model.safetensors"], ["convert", src, tmp_path / "out"]):
        proc = subprocess.run([sys.executable, "-m", "w4pack", *map(str, argv)], capture_output=True, text=True,
                              env=env, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"{src / 'model.safetensors'}: not a regular file" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_storage_dtype_without_reading(tmp_path: Path) -> None:
    """storage_dtype answers what get(name).dtype would, from the header alone (get reads the whole tensor)."""
    from w4pack.store.tensors import open_tensors

    path = tmp_path / "m.safetensors"
    write_safetensors(path, [("h", np.zeros(3, np.float16), None), ("b", np.zeros(2, np.uint16), "bfloat16"),
                             ("i", np.zeros(2, np.int32), None)])
    with open_tensors(path) as st:
        for name in ("h", "b", "i"):
            assert st.storage_dtype(name) == st.get(name).dtype


def test_data_section_must_end_at_the_file_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes after the last tensor, or between tensors, belong to no tensor: the reference safetensors library
    refuses such files, so we do too. Padding inside the header (spaces after the JSON) is legal."""
    entry = b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}'
    ok = _raw_file(tmp_path / "ok.safetensors", entry + b"}" + b" " * 11, b"\0\x3c\0\x40")
    with SafetensorsFile(ok) as f:
        assert f.get("a").tolist() == [1.0, 2.0]
    tail = _raw_file(tmp_path / "tail.safetensors", entry + b"}", b"\0\x3c\0\x40" + b"\0" * 5)
    assert _refused(tail).endswith(f"{tail}: 5 bytes after the last tensor (the data section must end where the "
                                   "file ends)")
    assert main(["inspect", str(tail)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    hole = _raw_file(tmp_path / "hole.safetensors",
                     entry + b', "b": {"dtype": "F16", "shape": [1], "data_offsets": [6, 8]}}', b"\0" * 8)
    _refused(hole, "tensor b", "2 bytes of data before it belong to no tensor")
    empty = _raw_file(tmp_path / "empty.safetensors", b"{}", b"\0")
    _refused(empty, "1 bytes after the last tensor")
    # a file the writer pads (header to 8 bytes) and every fixture-sized real file still read
    n, _sha = write_safetensors(tmp_path / "w.safetensors", [("x", np.arange(3, dtype=np.float32), None)])
    with SafetensorsFile(tmp_path / "w.safetensors") as f:
        assert f.get("x").tolist() == [0, 1, 2]


@pytest.mark.parametrize("header,says", [
    ({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "blank name"),
    ('{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     '"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "names this tensor twice"),
    # a lone surrogate escape: valid to Python's json, refused by the reference library; an output carrying it
    # would be unreadable to every Hugging Face loader
    ('{"t\\udcff": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "not valid Unicode"),
])
def test_blank_repeated_or_broken_tensor_names_are_refused(tmp_path: Path, header: Any, says: str) -> None:
    import json
    import struct

    from w4pack.errors import BadInputError
    from w4pack.store.safetensors import SafetensorsFile

    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 4)
    with pytest.raises(BadInputError, match=says) as exc:
        SafetensorsFile(p)
    assert str(p) in exc.value.one_line()


def test_header_nested_past_the_bound_is_refused(tmp_path: Path) -> None:
    """An extra key nested 900 deep parsed or not depending on the caller's stack depth (inspect accepted what a
    deeper reader refused); the bound on nesting decides the same everywhere."""
    deep = b"[" * 900 + b"]" * 900
    p = _raw_file(tmp_path / "deep.safetensors",
                  b'{"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4], "x": ' + deep + b"}}", b"\0" * 4)
    _refused(p, "nested more than")


def test_control_characters_in_a_tensor_name_keep_the_error_on_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A safetensors name may hold a newline (the reference library accepts it); named in an error, it split the
    one line in two. Every character that is not printable is written as its escape."""
    p = _raw_file(tmp_path / "nl.safetensors",
                  b'{"a\\nb\\u0000c": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}      ', b"\0")
    assert main(["inspect", str(p)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{p}: tensor a\\nb\\x00c: dtype 'F8_E4M3' is not supported" in err, err
