"""One tensor store under every reader: a ``.safetensors`` file, an indexed folder, a folder of shards, or
weights-only torch pickles (``torch.load(weights_only=True)``).

Safetensors data is read with pread into arrays we own (``get``, ``read_copy``, ``read_into``: a recycled
buffer), never through a memory map, so a source truncated while we read it is one error
(``SourceChanged``, exit 4), not a SIGBUS; resident memory stays at the tensors the caller holds.
``populate``/``release``/``release_all`` remain for callers written for a mapped reader and do nothing.
Index entries are checked to stay inside the folder (``folder.member``), and a tensor stored in two files
is refused ("defined in two shards"): which copy would be the model?
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadInputError, UnsupportedError
from .folder import brief, member, read_json
from .safetensors import DTYPES, SafetensorsFile, SourceChanged
from .names import INDEX_NAME, PT_INDEX_NAME, PT_SUFFIXES
from .torchfile import StateDict, dtype_name as torch_dtype_name, load_state_dict, read_tensor

__all__ = ["TensorStore", "open_tensors", "pt_files", "first_unreadable", "safetensors_infos", "pickle_infos"]

#: torch files in a model folder that hold no weights
_NOT_WEIGHTS = ("training_args", "optimizer", "scheduler", "rng_state")


class TensorStore:
    """Every tensor of a checkpoint by name, with the file it lives in; data is read on demand."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else Path()
        self._st: dict[str, SafetensorsFile] = {}
        self._pt: dict[str, StateDict] = {}
        self._lazy: set[str] = set()  # safetensors files named by an index, opened on first use
        self.where: dict[str, str] = {}  # tensor -> file path (str)
        self._unlisted: dict[str, str] = {}  # tensor -> a file that holds it although the index names another
        self.metadata: dict[str, str] = {}

    # -- building ------------------------------------------------------------------------------
    def add_safetensors(self, path: Path, only: set[str] | None = None) -> None:
        """Every tensor of one file, or (an index's shard) those in ``only``; the others must not be claimed by
        another file: a tensor in two shards is refused whichever one an index names."""
        f = SafetensorsFile(path)
        self._st[str(path)] = f
        self.metadata.update(f.metadata)
        for name in f.keys():
            if only is not None and name not in only:
                self._no_second_copy(name, str(path))
                continue
            self._claim(name, str(path))

    def add_pt(self, path: Path, only: set[str] | None = None) -> None:
        sd = load_state_dict(path)
        self._pt[str(path)] = sd
        for name in sd:
            if only is not None and name not in only:
                self._no_second_copy(name, str(path))
                continue
            self._claim(name, str(path))

    def add_index(self, root: Path, weight_map: dict[str, str]) -> None:
        """Tensors of an index already checked by the caller (a w4pack checkpoint: names inside the folder, shards
        present); each shard opens on first use, so looking at one layer opens one file."""
        for name, fname in weight_map.items():
            path = str(root / fname)
            self._lazy.add(path)
            self._claim(name, path)

    def _sfile(self, path: str) -> SafetensorsFile | None:
        """The safetensors file at ``path`` (opened now if it was named lazily), or None for a pickle."""
        f = self._st.get(path)
        if f is None and path in self._lazy:
            f = self._st[path] = SafetensorsFile(path)
            # the shard may hold a tensor the index places in another shard: refused here, when the shard is
            # first opened, so every reader (convert, loading, verify --against) sees it, not only check_index
            for name in f.keys():
                self._no_second_copy(name, path)
        return f

    def in_file(self, name: str) -> bool:
        """Whether the file an index names for ``name`` really holds it (opening that file's header)."""
        f = self._sfile(self._file(name))
        return f is None or name in f

    def check_index(self) -> None:
        """Open every shard header; refuse tensors the index lists that their shard lacks, and tensors a shard
        holds that the index places in another shard."""
        for name, path in list(self.where.items()):
            f = self._sfile(path)
            if f is not None and name not in f:
                raise BadInputError("tensor listed in the index is missing from its shard", file=path, tensor=name)
        for path, f in list(self._st.items()):
            for name in f.keys():
                self._no_second_copy(name, path)

    def safetensors_files(self) -> list[SafetensorsFile]:
        """The safetensors files opened so far (after check_index: every shard)."""
        return list(self._st.values())

    def unlisted(self) -> list[tuple[str, str]]:
        """(file, tensor) for each tensor an opened shard holds that the index does not list (sorted)."""
        return sorted((path, name) for name, path in self._unlisted.items() if name not in self.where)

    def _claim(self, name: str, path: str) -> None:
        self._no_second_copy(name, path)
        other = self._unlisted.get(name)
        if other is not None and other != path:
            self._two_shards(name, other, path)
        self.where[name] = path

    def _no_second_copy(self, name: str, path: str) -> None:
        """Refuse ``name`` in ``path`` when another file already holds or is named for it; remember it, so that
        a file opened later that claims it is refused too."""
        other = self.where.get(name)
        if other is not None and other != path:
            self._two_shards(name, other, path)
        if name not in self.where:
            self._unlisted.setdefault(name, path)

    def _two_shards(self, name: str, a: str, b: str) -> None:
        first, second = sorted(Path(x).name if Path(x).parent == self.path else x for x in (a, b))
        raise BadInputError(f"defined in two shards, {first} and {second}; remove one copy (which one is the "
                            "model cannot be told)", file=str(self.path), tensor=name)

    # -- what is there -------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    @property
    def is_pickle(self) -> bool:
        """True when every tensor comes from torch pickles (the original llm-awq and GPTQ-for-LLaMa dumps)."""
        return bool(self._pt) and not self._st

    def file_of(self, name: str) -> str:
        """The file a tensor lives in (the store's path for unknown names), for error messages."""
        return self.where.get(name, str(self.path))

    def _file(self, name: str) -> str:
        path = self.where.get(name)
        if path is None:
            raise BadInputError("tensor is missing", file=str(self.path), tensor=name)
        return path

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype name, shape) without reading the data."""
        path = self._file(name)
        f = self._sfile(path)
        if f is not None:
            return f.info(name)
        t = self._pt[path][name]
        return torch_dtype_name(t), tuple(int(d) for d in t.shape)

    def storage_dtype(self, name: str) -> np.dtype:
        """The numpy dtype ``get`` returns for ``name`` (bf16: uint16), without reading the data: ``get`` reads the
        whole tensor, so ``get(name).dtype`` costs a read of it."""
        path = self._file(name)
        f = self._sfile(path)
        if f is not None:
            return DTYPES[f.entries[name][0]][0]
        import torch

        t = self._pt[path][name]
        return np.dtype(np.uint16) if t.dtype == torch.bfloat16 else np.dtype(torch.empty(0, dtype=t.dtype).numpy().dtype)

    # -- reading -------------------------------------------------------------------------------
    def get(self, name: str) -> np.ndarray:
        """The stored array (bf16 as uint16 bits), read-only; safetensors data is read with pread."""
        path = self._file(name)
        f = self._sfile(path)
        if f is not None:
            return f.get(name)
        arr = read_tensor(self._pt[path], name)
        arr.flags.writeable = False
        return arr

    def read_into(self, name: str, pool: Any) -> np.ndarray:
        """Like read_copy, into an array from ``pool`` (a scratch.ScratchPool)."""
        path = self._file(name)
        f = self._sfile(path)
        if f is None:
            return read_tensor(self._pt[path], name)
        dt, shape, _b, _e = f.entries[name]
        return self.read_copy(name, out=pool.take(shape, DTYPES[dt][0]))

    def read_copy(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """A writable array of our own (into ``out`` when given), read with pread."""
        path = self._file(name)
        f = self._sfile(path)
        if f is None:
            return read_tensor(self._pt[path], name)
        return f.read(name, out)

    def span(self, name: str) -> tuple[str, int, int, str, tuple[int, ...]] | None:
        """(file, byte offset, byte count, safetensors dtype, shape) of a tensor stored in a safetensors
        file, or None (pickles): lets a writer copy its bytes file to file."""
        path = self._file(name)
        f = self._sfile(path)
        if f is None:
            return None
        dt, shape, begin, end = f.entries[name]
        f.check_unchanged(name)
        try:
            st = os.stat(path)
        except OSError:
            raise SourceChanged(path, "it is gone", tensor=name) from None
        if (st.st_size, st.st_mtime_ns) != f.identity:  # the copier opens the path anew: it must be this file
            raise SourceChanged(path, "another file now has its name", tensor=name)
        return path, f.data_start + begin, end - begin, dt, shape

    # -- mapped pages (none: kept for callers written for a mapped reader) ----------------------------
    def populate(self, name: str) -> bool:
        """False: nothing is mapped, so the caller reads the tensor with read_into."""
        return False

    def release(self, name: str) -> None:
        """Nothing to drop (no file is mapped)."""

    def release_all(self) -> None:
        """Nothing to drop (no file is mapped)."""

    def close(self) -> None:
        for f in self._st.values():
            f.close()
        self._st.clear()
        self._pt.clear()

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pt_files(folder: Path) -> list[Path]:
    """The torch weight files of a folder (not training state), sorted."""
    return sorted(p for p in folder.iterdir() if p.suffix in PT_SUFFIXES and p.is_file()
                  and not p.name.startswith(_NOT_WEIGHTS))


def _shard(root: Path, name: Any, index: Path) -> Path:
    """A shard named by an index: inside the folder (folder.member) and present."""
    p = member(root, name, "shard", str(index))
    if not p.is_file():
        raise BadInputError(f"shard {name!r} named by the index is missing", file=str(p))
    return p


def _open_index(store: TensorStore, root: Path, ipath: Path, pickles: bool) -> None:
    doc = read_json(ipath)
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise BadInputError("index has no weight_map object", file=str(ipath))
    by_file: dict[str, set[str]] = {}
    for tname, fname in wmap.items():
        if not isinstance(fname, str):  # 5 or null would only fail later, inside sorted()
            raise BadInputError(f"weight_map names shard {brief(fname)}, which is not a plain file name inside the "
                                "folder (not a file name at all)", file=str(ipath), tensor=tname)
        by_file.setdefault(fname, set()).add(tname)
    for fname, names in sorted(by_file.items()):
        shard = _shard(root, fname, ipath)
        (store.add_pt if pickles else store.add_safetensors)(shard, only=names)
        for tname in sorted(names):
            if tname not in store:
                raise BadInputError("tensor listed in the index is missing from its shard", file=str(shard),
                                    tensor=tname)


def open_tensors(path: Path, *, base_name: str | None = None, pickles: str = "any") -> TensorStore:
    """The weights of a folder (index, single or several files) or of one file, opened for reading.

    ``base_name``: prefer ``<base_name>.safetensors`` among several files (GPTQ's model_file_base_name).
    ``pickles``: which torch files a folder may hold the weights in: "any", "one" (several are refused:
    which one is the model?) or "none" (safetensors only; a file is then read as safetensors whatever its name).
    """
    if pickles not in ("any", "one", "none"):
        raise ValueError(f"pickles={pickles!r}")
    path = Path(path)
    store = TensorStore(path)
    try:
        _open_into(store, path, base_name, pickles)
    except BaseException:
        store.close()
        raise
    return store


def _open_into(store: TensorStore, path: Path, base_name: str | None, pickles: str) -> None:
    if path.is_file() or (os.path.lexists(path) and not path.is_dir()):  # a FIFO or device: the readers say so
        (store.add_pt if path.suffix in PT_SUFFIXES and pickles != "none" else store.add_safetensors)(path)
        return
    if not path.is_dir():
        raise BadInputError("does not exist", file=str(path))
    for index_name, of_pickles in ((INDEX_NAME, False), (PT_INDEX_NAME, True)):
        ipath = path / index_name
        if ipath.is_file() and not (of_pickles and pickles == "none"):
            _open_index(store, path, ipath, of_pickles)
            return
    st = sorted(path.glob("*.safetensors"))
    if base_name and (path / f"{base_name}.safetensors").is_file():
        st = [path / f"{base_name}.safetensors"]
    if st:
        for p in st:
            store.add_safetensors(p)
        return
    if pickles == "none":
        raise BadInputError("no .safetensors files", file=str(path))
    pts = pt_files(path)
    if len(pts) > 1 and pickles == "one":
        raise BadInputError(f"holds several torch files ({', '.join(p.name for p in pts[:4])}); name one",
                            file=str(path))
    if pts:
        for p in pts:
            store.add_pt(p)
        return
    odd = sorted(q.name for q in path.iterdir() if q.suffix in (".safetensors", ".pt", ".bin", ".pth")
                 and q.exists() and not q.is_file())  # (a FIFO or device named like weights: never opened)
    if odd:
        raise BadInputError("not a regular file (a FIFO, device or socket named like a weights file)",
                            file=str(path / odd[0]))
    raise BadInputError("no weights found (.safetensors, model.safetensors.index.json, .pt or .bin)", file=str(path))


def first_unreadable(path: Path) -> BadInputError | None:
    """The error of the first safetensors file at ``path`` (the file, or the folder's ``*.safetensors``) whose
    header does not read, or None. Format detection asks when no format recognises a folder: a truncated
    weights file is then what to report, not "unknown format"."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))  # a FIFO or folder of that name too: it is what is wrong
    elif path.exists() and path.suffix == ".safetensors":
        files = [path]
    else:
        return None
    for p in files:
        try:
            SafetensorsFile(p).close()
        except BadInputError as exc:
            return exc
    return None


def _torch_dtype(t: Any) -> str:
    """The dtype name of a loaded tensor as the safetensors reader spells it ("int32", "bfloat16"); torch's own name
    for a dtype no reader takes (an fp8, a complex): a name for a message, never matched."""
    try:
        return torch_dtype_name(t)
    except (KeyError, AttributeError):
        return str(getattr(t, "dtype", "")).removeprefix("torch.")


def pickle_infos(path: Path) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """Tensor names with their (dtype name, shape) of every torch weights file at ``path`` that loads
    (``weights_only``), by file: ``safetensors_infos`` for llm-awq's ``.pt`` dumps. A file that does not load is left
    to the reader that refused it, which names what is wrong."""
    path = Path(path)
    if path.is_dir():
        files = pt_files(path)
    elif path.is_file() and path.suffix in PT_SUFFIXES:
        files = [path]
    else:
        return {}
    out: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for p in files:
        try:
            sd = load_state_dict(p)
        except (BadInputError, UnsupportedError):  # (no torch: nothing to list)
            continue
        out[str(p)] = {n: (_torch_dtype(t), tuple(int(d) for d in getattr(t, "shape", ()))) for n, t in sd.items()}
    return out


def safetensors_infos(path: Path) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """Tensor names with their (dtype name, shape) of every readable safetensors file at ``path`` (the file, or the
    folder's ``*.safetensors``), by file. Format detection asks when no format recognises a folder, to tell a
    damaged quantized checkpoint (a layer missing a tensor, or holding it under another name) from a format w4pack
    does not know."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    elif path.is_file() and path.suffix == ".safetensors":
        files = [path]
    else:
        return {}
    out: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for p in files:
        try:
            f = SafetensorsFile(p)
        except BadInputError:
            continue
        try:
            out[str(p)] = {n: f.info(n) for n in f.keys()}
        finally:
            f.close()
    return out

