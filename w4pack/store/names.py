"""The file names of a model folder, in one place: weights, index, configs, manifest and side files."""
from __future__ import annotations

__all__ = ["INDEX_NAME", "PT_INDEX_NAME", "SINGLE_FILE", "CONFIG_NAME", "MANIFEST_NAME", "INCOMPLETE_MARKER",
           "CARD_NAME", "SIDE_FILES", "OWN_FILES", "PT_SUFFIXES", "WEIGHT_SUFFIXES", "shard_names", "is_side_file",
           "tensor_name_problem"]

#: tensor name -> shard file (Hugging Face convention); PT_INDEX_NAME for torch pickles
INDEX_NAME = "model.safetensors.index.json"
PT_INDEX_NAME = "pytorch_model.bin.index.json"
#: the weights file of an unsharded folder
SINGLE_FILE = "model.safetensors"
CONFIG_NAME = "config.json"
#: w4pack's own manifest, and the marker of a folder still being written
MANIFEST_NAME = "w4pack.json"
INCOMPLETE_MARKER = ".w4pack-incomplete"
#: the model card `w4pack push` writes into a checkpoint folder (describes the model, does not define it)
CARD_NAME = "README.md"
#: torch pickle suffixes (read with weights_only) and every weights suffix
PT_SUFFIXES = (".pt", ".bin", ".pth")
WEIGHT_SUFFIXES = (".safetensors",) + PT_SUFFIXES

#: side files copied from a source folder when present
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json",
)
#: files every writer produces itself (configs, index, manifest), never copied from a source as side files
OWN_FILES = frozenset({CONFIG_NAME, "quantize_config.json", "quant_config.json", "quantization_config.json",
                       INDEX_NAME, PT_INDEX_NAME, MANIFEST_NAME, "quant.toml"})


def shard_names(total: int, *, single: bool = True) -> list[str]:
    """``model.safetensors`` for one shard (``single``, the peers' convention), else
    ``model-0000k-of-0000n.safetensors`` (w4pack checkpoints always use these, with an index)."""
    if total == 1 and single:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]


def is_side_file(name: str) -> bool:
    """Whether a writer copies a source's side file ``name``: not a config, index, manifest, weights or hidden file."""
    return not (name in OWN_FILES or name.endswith(WEIGHT_SUFFIXES) or name.startswith("."))


def tensor_name_problem(name: str) -> str | None:
    """What makes ``name`` unusable as a tensor name, or None. A blank name names nothing; a name that is not valid
    Unicode (a lone surrogate, which a JSON ``\\udcff`` escape or a pickle's string can carry) cannot be written as
    UTF-8, so the reference safetensors library and every Hugging Face loader refuse it: carried through, it would
    make an output that nothing else reads."""
    if not name.strip():
        return f"a tensor has the blank name {name!r}"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"tensor name {ascii(name)[:80]} is not valid Unicode (character {exc.start} is a lone surrogate "
                f"{ascii(name[exc.start])}): no UTF-8 file can hold it")
    return None
