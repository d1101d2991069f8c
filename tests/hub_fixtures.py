"""Fixtures for Hub tests: a running tests/hub_server.HubServer and small packed checkpoints.

huggingface_hub reads HF_ENDPOINT / HF_HUB_DISABLE_XET / its cache and token paths once, at import, so the
``hub`` fixture sets the environment *and* patches ``huggingface_hub.constants`` for the test; w4pack passes
the endpoint explicitly anyway. Nothing leaves 127.0.0.1.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from hub_server import HubServer

#: a secret-looking token: tests assert it never appears in any output
TOKEN = "hf_w4packTEST_secret_Zq8VnR2xK7"
READ_TOKEN = "hf_w4packTEST_readonly_Pm3LwT9c"
OTHER_TOKEN = "hf_w4packTEST_bob_Yh6DsA1o"
BAD_TOKEN = "hf_w4packTEST_revoked_Jf5GuE0b"
USER = "alice"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubServer]:
    """A Hub-protocol server on loopback; fails the test if the client hit a route it does not know."""
    import huggingface_hub.constants as hc

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hc, "HF_HUB_DISABLE_TELEMETRY", True, raising=False)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hc, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    monkeypatch.setattr(hc, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"), raising=False)
    monkeypatch.setenv("W4PACK_CACHE", str(tmp_path / "w4pack-cache"))
    server = HubServer(tokens={
        TOKEN: {"user": USER, "orgs": ["w4org"], "write": True},
        READ_TOKEN: {"user": USER, "orgs": ["w4org"], "write": False},
        OTHER_TOKEN: {"user": "bob", "orgs": [], "write": True},
    })
    with server:
        yield server
    assert server.protocol_errors == [], f"the client used routes or payloads the server does not know: " \
                                         f"{server.protocol_errors}"


def _layer(rng: np.random.Generator, n: int, k: int, *, gs: int, zero_mode: str, act_order: bool = False,
           scale_dtype: str = "float16") -> Any:
    from w4pack.canonical import CanonicalLayer, default_g_idx

    g = 1 if gs == -1 else -(-k // gs)
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scales = (rng.random((n, g), dtype=np.float32) * 0.02 + 0.001).astype(np.float16)
    zeros = None
    if zero_mode == "int":
        zeros = rng.integers(1, 15, size=(n, g)).astype(np.int32)
    elif zero_mode == "float":
        zeros = (-(rng.random((n, g), dtype=np.float32) * 0.1)).astype(np.float16)
    g_idx = default_g_idx(k, gs)
    if act_order:
        g_idx = g_idx[rng.permutation(k)].astype(np.int32)
    return CanonicalLayer(codes=codes, scales=scales, bits=4, group_size=gs, zero_mode=zero_mode, zeros=zeros,
                          g_idx=g_idx, scale_dtype=scale_dtype).validate()


def make_checkpoint(out: Path, *, seed: int = 0, source: dict[str, Any] | None = None,
                    verify: dict[str, Any] | None = None, max_shard_size: int = 40_000) -> Path:
    """A small packed checkpoint of a random 'LlamaForCausalLM': three layer kinds, several shards,
    a pass-through embedding and a tokenizer side file."""
    from w4pack.checkpoint import CheckpointWriter

    rng = np.random.default_rng(seed)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 1, "vocab_size": 64, "torch_dtype": "float16"}
    src = source if source is not None else {"format": "gptq", "version": "v1",
                                             "base_model": "example-org/tiny-llama-base", "license": "apache-2.0"}
    tok = out.parent / f"{out.name}-tokenizer.json"
    tok.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}))
    with CheckpointWriter(out, config=config, source=src, max_shard_size=max_shard_size,
                          show_progress=False) as w:
        w.add_layer("model.layers.0.self_attn.q_proj", _layer(rng, 128, 128, gs=64, zero_mode="int"))
        w.add_layer("model.layers.0.self_attn.o_proj", _layer(rng, 128, 128, gs=64, zero_mode="int"))
        w.add_layer("model.layers.0.mlp.up_proj", _layer(rng, 256, 128, gs=32, zero_mode="none", act_order=True))
        w.add_layer("model.layers.0.mlp.down_proj", _layer(rng, 128, 256, gs=32, zero_mode="float"))
        w.add_tensor("model.embed_tokens.weight", rng.standard_normal((64, 128)).astype(np.float16))
        w.add_side_file(tok, "tokenizer.json")
    tok.unlink()
    if verify is not None:
        mpath = out / "w4pack.json"
        manifest = json.loads(mpath.read_text())
        manifest["verify"] = verify
        mpath.write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative posix path -> content), hidden ones excluded."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            out[rel.as_posix()] = p.read_bytes()
    return out
