#!/usr/bin/env python3
"""SmolLM2-135M quantized to Q4_K_M by llama.cpp's own quantizer, converted with w4pack, and measured.

    python tools/smollm2_llama_quant.py WORKDIR [--hidden 768|576] [--ftype Q4_K_M] [--threads 2]

SmolLM2's hidden size 576 is not a multiple of 256, so llama.cpp's recipes make only ``ffn_down`` a K-quant (the
rest falls back to Q5_0/Q8_0). ``--hidden 768`` (the default) first makes the model wider without changing its
function, so that every matrix is K-quantized, as in the larger models people download:

- hidden 576 -> 768 by zero padding: the token embedding's columns, every input column of q/k/v/gate/up, the
  output rows of o_proj/down (so the residual stream's extra entries stay 0);
- RMSNorm weights times sqrt(576/768) and epsilon times 576/768: the padded vector's mean square is 576/768 of
  the original's, so ``x / sqrt(mean(x²) + eps) * g`` is unchanged exactly (in real arithmetic);
- query heads 9 -> 12 by inserting one zero head after every 3, so each of the 3 key/value heads keeps its own
  query heads (groups of 3 -> 4); o_proj's input columns for the inserted heads are 0, which cancels their
  (uniform-attention) output. Whole 64-row heads are inserted, and llama.cpp's rotary row permutation acts within
  a head, so the padding is done on the GGUF's rows as they are;
- intermediate 1536 unchanged; the head is tied to the embedding (SmolLM2's), so it is padded with it.

The source weights are the demo GGUF's Q4_1 (and Q8_0 embedding) dequantized by gguf-py: llama.cpp requantizes
those, not the original bf16 checkpoint. Steps, each printed: the padded model's float logits against the
original's (transformers, gguf-py's dequantized weights); an all-float32 GGUF; llama.cpp's quantizer; w4pack
convert; the tensor types and how each is carried; sizes; verify --against; the GGUF round trip; perplexity of
``w4pack run`` against tools/ppl_gguf_reference.py (the float model of gguf-py's dequantized weights) on
tests/data/ppl_sample.txt. Heavy (a few minutes on 2 cores, ~2 GB of files in WORKDIR); needs llama_cpp, torch,
transformers and gguf.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import gguf  # noqa: E402

from get_smollm2 import smollm2_gguf  # noqa: E402
from make_llama_quants import check_ftypes, llama_quantize  # noqa: E402

from w4pack.store.sizes import tensor_bytes  # noqa: E402

SAMPLE = REPO / "tests" / "data" / "ppl_sample.txt"
HEAD_DIM = 64


def _pad_cols(w: np.ndarray, k: int) -> np.ndarray:
    return np.concatenate([w, np.zeros((w.shape[0], k - w.shape[1]), w.dtype)], axis=1)


def _pad_rows(w: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([w, np.zeros((n - w.shape[0], w.shape[1]), w.dtype)], axis=0)


def _head_slots(heads: int, kv: int, new_heads: int) -> np.ndarray:
    """New head index of each original query head: group g's heads first in g's new (wider) group."""
    per, new_per = heads // kv, new_heads // kv
    return np.array([(h // per) * new_per + h % per for h in range(heads)])


def widen(tensors: dict[str, np.ndarray], hidden: int, heads: int, kv: int, new_hidden: int,
          new_heads: int) -> dict[str, np.ndarray]:
    """SmolLM2's float tensors (GGUF names, GGUF row order) at a larger hidden size and head count, same function."""
    if new_hidden < hidden or new_heads % kv or heads % kv or new_heads < heads:
        raise SystemExit(f"cannot widen {hidden}/{heads} heads to {new_hidden}/{new_heads} heads with {kv} kv heads")
    norm = np.float32(math.sqrt(hidden / new_hidden))
    slots = _head_slots(heads, kv, new_heads)
    rows = (slots[:, None] * HEAD_DIM + np.arange(HEAD_DIM)).reshape(-1)  # original q row r -> new row rows[r]
    out = {}
    for name, w in tensors.items():
        part = name.split(".")[-2]
        if part.endswith("norm"):
            w = np.concatenate([w * norm, np.zeros(new_hidden - hidden, np.float32)])
        elif part == "token_embd" or part in ("attn_k", "attn_v", "ffn_gate", "ffn_up", "output"):
            w = _pad_cols(w, new_hidden)
        elif part == "attn_q":
            q = np.zeros((new_heads * HEAD_DIM, new_hidden), np.float32)
            q[rows] = _pad_cols(w, new_hidden)
            w = q
        elif part == "attn_output":
            o = np.zeros((new_hidden, new_heads * HEAD_DIM), np.float32)
            o[:hidden, rows] = w
            w = o
        elif part == "ffn_down":
            w = _pad_rows(w, new_hidden)
        else:
            raise SystemExit(f"{name}: no rule to widen this tensor")
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def read_float(path: Path) -> tuple[gguf.GGUFReader, dict[str, np.ndarray]]:
    r = gguf.GGUFReader(str(path))
    return r, {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in r.tensors}


def write_f32(r: gguf.GGUFReader, tensors: dict[str, np.ndarray], overrides: dict[str, object], out: Path) -> None:
    """An all-float32 GGUF with r's metadata (tokenizer included) but the keys in overrides."""
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch=arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, overrides.get(f.name, f.contents()), f.types[0], sub_type=sub)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_float(src: Path, out: Path, new_hidden: int | None = None) -> int:
    """src's weights dequantized by gguf-py into an all-float32 GGUF at out, widened to new_hidden (same number
    of key/value heads, head_dim 64) when that differs from src's hidden size; returns src's hidden size."""
    r, tensors = read_float(src)
    hidden = int(r.fields["llama.embedding_length"].contents())
    heads = int(r.fields["llama.attention.head_count"].contents())
    kv = int(r.fields["llama.attention.head_count_kv"].contents())
    eps = float(r.fields["llama.attention.layer_norm_rms_epsilon"].contents())
    overrides: dict[str, object] = {"general.file_type": 0}  # LLAMA_FTYPE_ALL_F32
    if new_hidden is not None and new_hidden != hidden:
        new_heads = new_hidden // HEAD_DIM
        tensors = widen(tensors, hidden, heads, kv, new_hidden, new_heads)
        overrides.update({"llama.embedding_length": new_hidden, "llama.attention.head_count": new_heads,
                          "llama.attention.layer_norm_rms_epsilon": eps * hidden / new_hidden})
    write_f32(r, tensors, overrides, out)
    return hidden


def float_model(path: Path):
    """transformers' LlamaForCausalLM of a GGUF's metadata holding gguf-py's dequantized weights (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    r, t = read_float(path)

    def f(key: str):
        return r.fields[f"llama.{key}"].contents()

    hidden, heads, kv = int(f("embedding_length")), int(f("attention.head_count")), int(f("attention.head_count_kv"))
    cfg = LlamaConfig(vocab_size=int(f("vocab_size")), hidden_size=hidden,
                      intermediate_size=int(f("feed_forward_length")), num_hidden_layers=int(f("block_count")),
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=HEAD_DIM,
                      rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
                      rope_theta=float(f("rope.freq_base")), max_position_embeddings=int(f("context_length")),
                      tie_word_embeddings="output.weight" not in t)
    hf = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    state = {}
    for name, w in t.items():
        parts = name.split(".")
        if parts[0] == "blk":
            key = f"model.layers.{parts[1]}.{hf[parts[2]]}.weight"
            n = heads if parts[2] == "attn_q" else kv if parts[2] == "attn_k" else None
            if n is not None:  # llama.cpp's rotary row order -> transformers'
                w = w.reshape(n, HEAD_DIM // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        else:
            key = f"{hf[parts[0]]}.weight"
        state[key] = torch.from_numpy(np.ascontiguousarray(w))
    model = LlamaForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"{path}: weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def float_check(orig: Path, wide: Path) -> float:
    """Worst relative logit difference (per token, over the vocabulary) of the widened model against the original."""
    import torch

    ma, mb = float_model(orig), float_model(wide)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, ma.config.vocab_size, (2, 96)))
    with torch.no_grad():
        a, b = ma(ids).logits, mb(ids).logits
    return float(((a - b).abs().amax(-1) / a.abs().amax(-1)).max())


def _w4(*args: object) -> str:
    env_py = [sys.executable, "-m", "w4pack"]
    res = subprocess.run([*env_py, *map(str, args)], capture_output=True, text=True, cwd=REPO)
    if res.returncode != 0:
        raise SystemExit(f"w4pack {' '.join(map(str, args))} failed ({res.returncode}): {res.stderr.strip()[-800:]}")
    return res.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--hidden", type=int, default=768, choices=(576, 768))
    ap.add_argument("--ftype", default="Q4_K_M")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    check_ftypes(ap, [a.ftype])  # before the minutes of dequantizing and widening
    if a.workdir.exists() and not a.workdir.is_dir():
        ap.error(f"WORKDIR {a.workdir} is a file, not a folder")
    a.workdir.mkdir(parents=True, exist_ok=True)
    tag = f"smollm2-{a.hidden}"
    rows: list[tuple[str, str]] = []

    def row(k: str, v: object) -> None:
        rows.append((k, str(v)))
        print(f"  {k}: {v}", flush=True)

    src = smollm2_gguf()
    f32 = a.workdir / f"{tag}-F32.gguf"
    t0 = time.time()
    hidden = write_float(src, f32, a.hidden)
    row("source", f"{src.name} (Q4_1/Q8_0) dequantized by gguf-py -> {f32.name}, {f32.stat().st_size:,} B "
        f"({time.time() - t0:.0f} s)")
    if a.hidden != hidden:
        row("float check: widened logits vs SmolLM2's (max relative, 2x96 random tokens)",
            f"{float_check(src, f32):.2e}")

    q = a.workdir / f"{tag}-{a.ftype}.gguf"
    t0 = time.time()
    llama_quantize(f32, q, a.ftype, threads=a.threads)
    rq = gguf.GGUFReader(str(q))
    types = Counter(t.tensor_type.name for t in rq.tensors)
    gguf_tensor_bytes = sum(int(t.n_bytes) for t in rq.tensors)
    row(f"llama.cpp {a.ftype}", f"{q.stat().st_size:,} B ({time.time() - t0:.0f} s); tensor types "
        f"{dict(sorted(types.items()))}")
    linear = [t for t in rq.tensors if len(t.shape) == 2]
    kq = [t for t in linear if t.tensor_type.name.endswith("_K")]
    row("2-D weights that are K-quants", f"{len(kq)} of {len(linear)} "
        f"({', '.join(f'{c} {n}' for n, c in sorted(Counter(t.tensor_type.name for t in linear).items()))})")

    folder = a.workdir / f"{tag}-{a.ftype}-w4"
    t0 = time.time()
    _w4("convert", q, folder, "--force")
    row("w4pack convert", f"{time.time() - t0:.0f} s")
    man = json.loads((folder / "w4pack.json").read_text())
    plan = json.loads(_w4("inspect", q, "--json"))
    notes = plan["source_info"]["notes"]
    row("carried (inspect on the GGUF)", "; ".join(n for n in notes if "packed" in n or "dequantized" in n
                                                  or "passed" in n))
    row("packed layers", f"{len(man['layers'])} ({sum(1 for m in man['layers'].values() if m.get('storage'))} "
        f"stored compact); pass-through tensors {len(plan['passthrough'])}")
    folder_bytes = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    shard = tensor_bytes(folder)
    row("size: GGUF file / folder (all files)", f"{q.stat().st_size:,} / {folder_bytes:,} B "
        f"(x{folder_bytes / q.stat().st_size:.4f})")
    row("size: GGUF tensor bytes / shards' tensor bytes", f"{gguf_tensor_bytes:,} / {shard:,} B "
        f"(x{shard / gguf_tensor_bytes:.4f})")

    t0 = time.time()
    rep = json.loads(_w4("verify", folder, "--against", q, "--json"))
    layers = rep.get("layers", [])
    exact = sum(1 for c in layers if c.get("exact"))
    pt = rep.get("passthrough", {})
    row("verify --against the GGUF", f"ok={rep.get('ok')}; {exact}/{len(layers)} layers bit-identical; "
        f"pass-through identical {pt.get('identical')}/{pt.get('total')} ({time.time() - t0:.0f} s)")

    back = a.workdir / f"{tag}-{a.ftype}-back.gguf"
    _w4("convert", folder, back, "--to", "gguf", "--force")
    row("back to GGUF", "byte-identical" if back.read_bytes() == q.read_bytes() else "DIFFERENT")

    t0 = time.time()
    got = json.loads(_w4("run", folder, "--perplexity", SAMPLE, "--json"))
    ref = subprocess.run([sys.executable, str(REPO / "tools" / "ppl_gguf_reference.py"), str(q), str(folder),
                          str(SAMPLE)], capture_output=True, text=True, cwd=REPO)
    if ref.returncode != 0:
        raise SystemExit(f"ppl_gguf_reference failed: {ref.stderr.strip()[-800:]}")
    want = json.loads(ref.stdout)
    row("perplexity: w4pack run / float model of gguf-py's weights",
        f"{got['perplexity']:.6f} / {want['perplexity']:.6f} ({got.get('scored_tokens')} tokens, "
        f"ratio {got['perplexity'] / want['perplexity'] - 1:+.2e}; {time.time() - t0:.0f} s)")
    print("\n| " + tag + f" {a.ftype} | |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
