"""w4pack: convert, pack, verify, run and publish 4-bit LLM checkpoints."""
from __future__ import annotations

from ._sigint import guard_startup as _guard_startup

_guard_startup()  # the w4pack command: Ctrl-C during the imports below is one line and exit 130 (see _sigint)

from ._version import __version__  # noqa: E402

from .core.canonical import CanonicalLayer, dequantize  # noqa: E402
from .store.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint, validate_checkpoint  # noqa: E402
from .errors import BadInputError, UnsupportedError, VerificationError, W4PackError  # noqa: E402
from .core.layout import PackedLayer, pack, unpack  # noqa: E402
from .runtime.loading import install_transformers_hook, load_model, register_transformers  # noqa: E402
from .native import cpu_pack as _cpu_pack  # noqa: E402,F401 - registers the native fast paths of core

# "w4pack" becomes a transformers quantization method as soon as transformers loads its quantizers (no import
# cost here), so AutoModelForCausalLM.from_pretrained(folder) works on a packed folder after `import w4pack`.
install_transformers_hook()

__all__ = [
    "__version__",
    "CanonicalLayer",
    "dequantize",
    "Checkpoint",
    "CheckpointWriter",
    "open_checkpoint",
    "validate_checkpoint",
    "PackedLayer",
    "pack",
    "unpack",
    "W4PackError",
    "BadInputError",
    "UnsupportedError",
    "VerificationError",
    "load_model",
    "register_transformers",
]
