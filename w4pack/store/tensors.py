"""One tensor store under every reader: a ``.safetensors`` file, an indexed folder, a folder of shards, or
weights-only torch pickles (``torch.load(weights_only=True)``).

Safetensors data is memory-mapped (``get`` is zero-copy), or read with pread into a private array
(``read_copy``, ``read_into``) so big pass-through tensors leave no mapped pages behind; ``release`` and
``release_all`` drop mapped pages (MADV_DONTNEED) so resident memory stays flat over a checkpoint.
Index entries are checked to stay inside the folder (``folder.member``).
"""
from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadInputError, IOFailure
from .folder import brief, member, read_json
from .safetensors import DTYPES, SafetensorsFile
from .names import INDEX_NAME, PT_INDEX_NAME, PT_SUFFIXES
from .torchfile import dtype_name as torch_dtype_name, load_state_dict, to_numpy as torch_to_numpy

__all__ = ["TensorStore", "open_tensors", "pt_files"]

_MADV_POPULATE_READ = 22  # linux/mman.h; Python's mmap module names it only from 3.13
#: torch files in a model folder that hold no weights
_NOT_WEIGHTS = ("training_args", "optimizer", "scheduler", "rng_state")


class TensorStore:
    """Every tensor of a checkpoint by name, with the file it lives in; data is read on demand."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else Path()
        self._st: dict[str, SafetensorsFile] = {}
        self._pt: dict[str, dict[str, Any]] = {}
        self._fds: dict[str, int] = {}
        self._lazy: set[str] = set()  # safetensors files named by an index, opened on first use
        self.where: dict[str, str] = {}  # tensor -> file path (str)
        self.metadata: dict[str, str] = {}

    # -- building ------------------------------------------------------------------------------
    def add_safetensors(self, path: Path, only: set[str] | None = None) -> None:
        f = SafetensorsFile(path)
        self._st[str(path)] = f
        self.metadata.update(f.metadata)
        for name in f.keys():
            if only is not None and name not in only:
                continue
            self._claim(name, str(path))

    def add_pt(self, path: Path, only: set[str] | None = None) -> None:
        sd = load_state_dict(path)
        self._pt[str(path)] = sd
        for name in sd:
            if only is not None and name not in only:
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
        return f

    def in_file(self, name: str) -> bool:
        """Whether the file an index names for ``name`` really holds it (opening that file's header)."""
        f = self._sfile(self._file(name))
        return f is None or name in f

    def check_index(self) -> None:
        """Open every shard header and refuse tensors the index lists that their shard lacks."""
        for name, path in self.where.items():
            f = self._sfile(path)
            if f is not None and name not in f:
                raise BadInputError("tensor listed in the index is missing from its shard", file=path, tensor=name)

    def _claim(self, name: str, path: str) -> None:
        if name in self.where and self.where[name] != path:
            raise BadInputError(f"tensor also stored in {self.where[name]}", file=path, tensor=name)
        self.where[name] = path

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

    # -- reading -------------------------------------------------------------------------------
    def get(self, name: str) -> np.ndarray:
        """The stored array (bf16 as uint16 bits); safetensors data is a zero-copy memory map."""
        path = self._file(name)
        f = self._sfile(path)
        if f is not None:
            return f.get(name)
        return torch_to_numpy(self._pt[path][name])

    def read_into(self, name: str, pool: Any) -> np.ndarray:
        """Like read_copy, into an array from ``pool`` (a scratch.ScratchPool)."""
        path = self._file(name)
        f = self._sfile(path)
        if f is None:
            return np.asarray(torch_to_numpy(self._pt[path][name]))
        dt, shape, _b, _e = f.entries[name]
        return self.read_copy(name, out=pool.take(shape, DTYPES[dt][0]))

    def read_copy(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """A private copy of the array read with pread, not through the map: a big pass-through tensor
        then leaves no mapped pages behind, so resident memory does not add up over a checkpoint."""
        path = self._file(name)
        f = self._sfile(path)
        if f is None:
            return np.array(torch_to_numpy(self._pt[path][name]))
        dt, shape, begin, end = f.entries[name]
        if out is None:
            out = np.empty(shape, dtype=DTYPES[dt][0])
        if end > begin:
            buf = memoryview(out.reshape(-1).view(np.uint8))
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            done = 0
            while done < end - begin:
                got = os.preadv(fd, [buf[done:]], f.data_start + begin + done)
                if got <= 0:
                    raise IOFailure("short read (file changed while reading?)", file=path)
                done += got
        return out

    def span(self, name: str) -> tuple[str, int, int, str, tuple[int, ...]] | None:
        """(file, byte offset, byte count, safetensors dtype, shape) of a tensor stored in a safetensors
        file, or None (pickles): lets a writer copy its bytes file to file."""
        path = self._file(name)
        f = self._sfile(path)
        if f is None:
            return None
        dt, shape, begin, end = f.entries[name]
        return path, f.data_start + begin, end - begin, dt, shape

    # -- mapped pages --------------------------------------------------------------------------
    def _mapped(self, name: str) -> tuple[Any, int, int] | None:
        """(map, first page offset, end offset) of a mapped tensor, or None."""
        path = self.where.get(name)
        f = self._st.get(path) if path is not None else None
        mm = getattr(f, "_mm", None)
        if mm is None or not hasattr(mm, "madvise"):
            return None
        _dt, _shape, begin, end = f.entries[name]
        return mm, (f.data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE, f.data_start + end

    def populate(self, name: str) -> bool:
        """Map this tensor's pages in one call (MADV_POPULATE_READ, Linux 5.14+); False where not possible."""
        mapped = self._mapped(name)
        if mapped is None or sys.platform != "linux":
            return False
        mm, start, stop = mapped
        try:
            mm.madvise(getattr(mmap, "MADV_POPULATE_READ", _MADV_POPULATE_READ), start, stop - start)
        except (OSError, ValueError):
            return False
        return True

    def release(self, name: str) -> None:
        """Drop this tensor's mapped pages from our address space (the page cache keeps them): every
        layer is read through the map once, so without this resident memory grows with the model."""
        mapped = self._mapped(name)
        if mapped is None:
            return
        mm, start, stop = mapped
        if stop > start:
            try:
                mm.madvise(mmap.MADV_DONTNEED, start, stop - start)
            except (OSError, ValueError):
                pass

    def release_all(self) -> None:
        """Drop every mapped page of every file from our address space. Reading a few bytes maps the pages
        around them too (the kernel's fault-around), so per-tensor releases leave neighbours behind, and
        those add up over a checkpoint; once per layer this keeps resident memory flat."""
        for f in self._st.values():
            f.release()

    def close(self) -> None:
        for f in self._st.values():
            f.close()
        for fd in self._fds.values():
            os.close(fd)
        self._st.clear()
        self._pt.clear()
        self._fds.clear()

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
    if path.is_file():
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
    raise BadInputError("no weights found (.safetensors, model.safetensors.index.json, .pt or .bin)", file=str(path))
