"""``save_pretrained`` of a loaded packed model: the packed folder written back, checked, never a float copy.

Why not transformers' own save: the packed layers live in ``W4Linear`` buffers whose meaning is defined by the
manifest (``w4pack.json``: layouts, fused rows, sha256 of every shard), which transformers does not write, so its
output could not be read back. The folder the model was loaded from *is* its serialization while its weights are
the ones loaded: its shards, index, manifest, config and model card are copied into the target, then the target is
validated with checksums. Weights can be changed in memory (a pass-through tensor, or a packed layer's buffers by
load_state_dict); a model whose weights differ from the folder's is refused, naming the first tensor, because
writing them would need a new packed checkpoint (convert the changed model's source instead).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadInputError, UnsupportedError
from ..store.checkpoint import Checkpoint, open_checkpoint, validate_checkpoint
from ..store.atomic import umask_mode
from ..store.names import CARD_NAME, MANIFEST_NAME, WEIGHT_SUFFIXES

__all__ = ["attach_save_pretrained", "save_packed"]


def attach_save_pretrained(model: Any) -> None:
    """Give ``model`` (loaded from ``model.w4pack_path``) a ``save_pretrained`` that writes the packed folder."""

    def save_pretrained(self: Any, save_directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        """Write the packed folder this model was loaded from into ``save_directory`` (see w4pack.runtime.saving).

        Sharding and serialization options do not apply (the packed shards are kept as they are); ``state_dict``
        cannot be honoured and is refused.
        """
        if kwargs.get("state_dict") is not None:
            raise UnsupportedError("save_pretrained(state_dict=...) cannot be written as a packed checkpoint; "
                                   "save without state_dict (the packed folder is copied)")
        if not kwargs.get("is_main_process", True):
            return
        save_packed(self, save_directory)
        if kwargs.get("push_to_hub"):
            raise UnsupportedError("save_pretrained(push_to_hub=True) is not supported for packed models; "
                                   f"the folder is saved at {save_directory}: upload it with `w4pack push`")

    model.save_pretrained = types.MethodType(save_pretrained, model)


def _changed_passthrough(model: Any, ckpt: Checkpoint) -> str | None:
    """The first pass-through tensor whose value in ``model`` differs from the folder's (in the model's dtype)."""
    import torch

    from .loading import _np_to_torch

    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    for tname in ckpt.passthrough:
        cur = state.get(tname)
        if cur is None:
            continue
        stored = _np_to_torch(ckpt.raw(tname), ckpt.dtype_name(tname)).to(cur.dtype)
        if stored.shape != cur.shape or not torch.equal(stored, cur.detach().to("cpu")):
            return tname
    return None


def _changed_layer(model: Any, ckpt: Checkpoint) -> str | None:
    """The first quantized layer whose packed buffers in ``model`` differ from the folder's (load_state_dict or
    copy_ can write other packed weights into them), compared tensor by tensor, one layer in memory at a time."""
    from .torch_module import W4Linear

    for mod in model.modules():
        name = getattr(mod, "layer_name", None)
        if not isinstance(mod, W4Linear) or name not in ckpt.manifest["layers"]:
            continue
        mine, stored = mod.packed_layer().tensors, ckpt.packed(name).tensors
        for suffix, arr in mine.items():
            other = stored.get(suffix)
            if other is None or other.shape != arr.shape or \
                    not np.array_equal(np.ascontiguousarray(other).view(np.uint8), arr.view(np.uint8)):
                return f"{name}.{suffix}"
    return None


def _copy_atomic(src: Path, dst: Path) -> None:
    """``src`` to ``dst`` through a temporary sibling renamed into place, so ``dst`` is never half-written."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        os.chmod(tmp, umask_mode(0o666))  # (mkstemp's 0600 would keep the copy from other users)
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_packed(model: Any, save_directory: str | os.PathLike[str]) -> Path:
    """Write the packed folder ``model`` was loaded from into ``save_directory``; returns the target path.

    Every file the manifest lists (shards, index, config, generation config, tokenizer files) is copied as it is:
    the manifest holds their checksums, so none may be rewritten. Weights files of an earlier save that this
    checkpoint does not have are removed so the folder holds one model; any other file already there that the
    checkpoint does not list (the manifest forbids unlisted files) is refused before anything is written. The
    manifest is written last, and the result is validated with checksums before returning.
    """
    source = getattr(model, "w4pack_path", None)
    if not source:
        raise UnsupportedError("this model was not loaded from a w4pack folder; nothing to save")
    src = Path(source)
    dst = Path(save_directory)
    if dst.exists() and not dst.is_dir():
        raise BadInputError("save_pretrained needs a directory, this is a file", file=str(dst))
    with open_checkpoint(src) as ckpt:
        changed = _changed_passthrough(model, ckpt) or _changed_layer(model, ckpt)
        if changed is not None:
            raise UnsupportedError("changed after loading; save_pretrained writes the packed folder "
                                   "back as it was loaded and cannot store changed weights (quantize and convert the "
                                   "changed model instead)", file=str(src), tensor=changed)
        listed = sorted(ckpt.listed_files() - {MANIFEST_NAME})
    if dst.exists() and dst.resolve() == src.resolve():
        return dst
    if dst.is_dir():
        foreign = sorted(p.name for p in dst.iterdir() if p.is_file() and not p.name.startswith(".")
                         and p.name not in listed and p.name not in (MANIFEST_NAME, CARD_NAME)
                         and not p.name.endswith(WEIGHT_SUFFIXES))
        if foreign:
            raise BadInputError(f"holds {len(foreign)} file(s) the packed checkpoint does not list (first: "
                                f"{foreign[0]}); a packed folder holds only its manifest's files, so save into an "
                                "empty or new folder (the checkpoint's own tokenizer files are saved with it)",
                                file=str(dst))
    dst.mkdir(parents=True, exist_ok=True)
    for name in listed:
        if (src / name).is_file():
            _copy_atomic(src / name, dst / name)
    for stale in dst.iterdir():
        if stale.is_file() and stale.name.endswith(WEIGHT_SUFFIXES) and stale.name not in listed:
            stale.unlink()
    _copy_atomic(src / MANIFEST_NAME, dst / MANIFEST_NAME)
    # the model card describes the model: the source folder's goes with it; without one, a card an earlier save
    # of another model left has its generated part rewritten for this one (the author's text around it kept)
    if (src / CARD_NAME).is_file():
        _copy_atomic(src / CARD_NAME, dst / CARD_NAME)
    elif (dst / CARD_NAME).is_file():
        from ..hub import _write_text_atomic, model_card

        _write_text_atomic(dst / CARD_NAME, model_card(dst))
    validate_checkpoint(dst)
    return dst
