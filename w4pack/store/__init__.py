"""Storage: the files of a model folder, read and written in one place.

``names`` (file names, side files), ``tensors`` (one read-only tensor store for every reader),
``shards`` (streaming safetensors shard writers), ``safetensors`` (the file format), ``torchfile``
(weights-only torch pickles), ``gguffile`` and ``tables`` (GGUF and TOML+NumPy files), ``folder``
(JSON, side files, link checks), ``atomic`` (folders that appear whole), ``singlefile`` (one output file that
appears whole), ``scratch`` (temporary side files a reader makes up) and ``checkpoint`` (w4pack's own
packed checkpoint folders). Readers under ``formats/`` receive tensors and never open a file themselves.
"""
from __future__ import annotations

from .tensors import TensorStore, open_tensors

__all__ = ["TensorStore", "open_tensors"]
