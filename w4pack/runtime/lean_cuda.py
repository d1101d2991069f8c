"""The lean CUDA decode loop: a llama-family step of torch ops captured whole into CUDA graphs, batch 1.

Why: transformers' static-cache compiled step (``w4pack.runtime.decode``) captures the layers, but its
per-token loop (input preparation, cache bookkeeping, logits processors, stopping criteria) runs in Python
between replays: about 1.4 ms of a 4.7 ms step on Llama-2-7B shapes on an H200. This loop captures
everything a token needs (embedding, every layer, final norm, head, argmax, the next position) into one
graph per attention length, so a greedy token costs one ``replay()`` and a 8-byte read:

* the step reads its token id and position from device buffers and writes the next ones (argmax of the
  logits, position + 1), so replays chain without the host; the host only reads each token back (a
  pinned copy that overlaps the next replay) for streaming and the end-of-sequence check;
* q/k/v and gate/up run as one packed GEMM each (``stack_packed``, the same stacking as the CPU loop; the
  packed layers run ``W4Linear``'s CUDA path, whose kernels capture cleanly), float ``nn.Linear`` layers are
  stacked by concatenating their weights;
* the KV cache is preallocated per layer; attention reads a fixed number of positions ("bucket": 256, 512,
  ... up to the cache) and masks those after the current position, so the graph never changes shape. One
  graph per bucket is captured when the sequence first reaches it (all share one memory pool). It runs as
  transformers' eager attention does (two batched products around a float32 softmax), with
  $W4PACK_LEAN_ATTN=sdpa as one ``scaled_dot_product_attention`` call, or with $W4PACK_LEAN_ATTN=kernel as one
  ``w4pack::decode_attention`` op (rotary, cache write and attention in one launch over the positions written
  so far: one graph serves the whole cache) (``ATTENTION``);
* the rotary rows are gathered from tables computed once, by the position buffer;
* before capture the step is compiled by ``torch.compile`` (Inductor, without its own CUDA graphs), which fuses
  the norm, rotary and attention glue; the packed GEMMs stay the ``w4pack::linear`` custom op.

The step is ordinary torch code: on the CPU (float32, no capture) it runs eagerly, which is how the tests
check its arithmetic against transformers. Sampling (temperature, top-k, top-p) runs transformers'
selection on the captured logits outside the graph. What the loop does not run (other architectures,
batch > 1, other generate options) is answered by transformers' generate with the reason
(``use_lean_decode``): on CUDA by default its compiled static-cache step (``w4pack.runtime.decode``).
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BadInputError
from .attention import decode_attention, kernel_reason
from .lean import LayerSpec, LoopBase, NotLean, _Layer, _out_features, signature, stack_packed, walk

__all__ = ["GraphDecoder", "BUCKET", "FUSE_ENV", "ATTN_ENV", "ATTENTION", "FOLD_ENV"]

#: 0/1: capture the step as written, or compiled by torch.compile (Inductor, no CUDA graphs of its own; the default
#: with graphs)
FUSE_ENV = "W4PACK_LEAN_FUSE"

#: how the step attends: "matmul" (two batched products around a float32 softmax, as transformers' eager
#: attention; the default), "sdpa" (torch's scaled_dot_product_attention: one fused kernel where the device
#: has one, over the same keys and mask) or "kernel" (``w4pack::decode_attention``: the token's rotary, cache
#: write and attention in one CUDA launch; on CUDA "matmul", with a warning, where that kernel does not run)
ATTN_ENV = "W4PACK_LEAN_ATTN"
ATTENTION = ("matmul", "sdpa", "kernel")

#: 0/1: fold each layer's RMSNorms into the following projection's kernel and its residual adds into the
#: o / down projections' (``W4Linear.fold``: packed layers the gemv kernel runs, fp16/bf16 on CUDA); on by default
FOLD_ENV = "W4PACK_LEAN_FOLD"

#: the shortest attention length a graph covers; longer ones double
BUCKET = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fold_setting() -> bool:
    """$W4PACK_LEAN_FOLD: unset or empty folds; a value that is neither on nor off is refused, since a typo
    would otherwise pick a default the user meant to change."""
    raw = os.environ.get(FOLD_ENV, "")
    env = raw.strip().lower()
    if env in ("", "1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    raise BadInputError(f"{FOLD_ENV}={raw!r}: set 1 to fold the norms and residual adds, 0 to keep them apart")


def _is_silu(act: Any) -> bool:
    """The activation is SiLU (torch's module or transformers' ``SiLUActivation``): the one the gemv folds."""
    if isinstance(act, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # pragma: no cover - transformers is what loads these models
        return False
    return type(act) is SiLUActivation


class _Linear:
    """x [M, K] -> [M, sum N] for the rows of one or more model projections: one module call (a fused packed
    layer, a packed layer stacked from several, or float weights concatenated), else one call per module.
    The stacked copies live here, not in the model (transformers' generate keeps using the originals)."""

    def __init__(self, mods: list[nn.Module], stack: bool, device: torch.device, dtype: torch.dtype):
        from .torch_module import W4Linear, W4SliceLinear

        self.sizes = [_out_features(m) for m in mods]
        self.out_features = sum(self.sizes)
        self.calls: list[Any] = list(mods)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.stacked = False
        self.fold = False  # normed / add run as one W4Linear.fold kernel (set by the decoder: may_fold)
        self.swiglu = False  # add folds the SwiGLU of its [gate | up] input too (may_fold)
        first = mods[0]
        if len(mods) == 1:
            return
        if all(isinstance(m, W4SliceLinear) for m in mods) and len({id(m.fused) for m in mods}) == 1:
            fused = first.fused
            rows = [tuple(fused.parts[m.index]["rows"]) for m in mods]
            if rows[0][0] == 0 and rows[-1][1] == fused.out_features and all(
                    a[1] == b[0] for a, b in zip(rows, rows[1:])):
                self.calls = [fused]
                return
        if not stack:
            return
        if all(type(m) is W4Linear for m in mods) and len({(m.precision, m.threads) for m in mods}) == 1:
            packed = stack_packed([m.packed_layer() for m in mods])
            if packed is not None:
                mod = W4Linear.from_packed(packed, device=device, precision=first.precision, threads=first.threads)
                mod.prepare(device, dtype)  # kernel, parameter copies and workspace before any capture
                self.calls = [mod]
                self.stacked = True
        elif all(type(m) is nn.Linear for m in mods) and len({m.weight.dtype for m in mods}) == 1 and len(
                {m.bias is None for m in mods}) == 1:
            with torch.no_grad():
                self.weight = torch.cat([m.weight.detach() for m in mods], dim=0).contiguous()
                if first.bias is not None:
                    self.bias = torch.cat([m.bias.detach() for m in mods], dim=0).contiguous()
            self.calls = []
            self.stacked = True

    def may_fold(self, device: torch.device, dtype: torch.dtype, norm: torch.Tensor | None = None,
                 swiglu: bool = False) -> bool:
        """Turn folding on where the one module is a packed layer that folds (``W4Linear.fold_ok``: the gemv
        kernel runs it): with the RMSNorm of weight ``norm`` (which must then be a [K] vector of the model's dtype
        on its device), or with the residual add, and the SwiGLU of ``swiglu_add``'s [gate | up] input too where
        ``swiglu``."""
        from .torch_module import W4Linear

        mod = self.calls[0] if self.weight is None and len(self.calls) == 1 else None
        ok = isinstance(mod, W4Linear)
        if ok and norm is not None:
            ok = norm.dtype == dtype and norm.device == device and tuple(norm.shape) == (mod.in_features,)
        self.fold = bool(ok and mod.fold_ok(device, dtype))
        self.swiglu = bool(self.fold and swiglu)
        return self.fold

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if len(self.calls) == 1:
            return self.calls[0](x)
        return torch.cat([m(x) for m in self.calls], dim=-1)

    def normed(self, h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """self(RMSNorm(h)): one kernel where folding is on, else the norm, then the projection."""
        if self.fold:
            return self.calls[0].fold(h, w, eps)
        return self(LoopBase._norm(h, w, eps))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x): added in the projection's kernel where folding is on (the same bits)."""
        if self.fold:
            return self.calls[0].fold(x, residual=residual)
        return residual + self(x)

    def swiglu_add(self, gu: torch.Tensor, act: Any, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(act(gate) * up) of gu = [gate | up]: one kernel where the SwiGLU folds."""
        if self.swiglu:
            return self.calls[0].fold(gu, residual=residual, swiglu=True)
        inter = gu.shape[-1] // 2
        return self.add(act(gu[:, :inter]) * gu[:, inter:], residual)


class GraphDecoder(LoopBase):
    """The lean CUDA loop of one loaded model (batch 1). ``graphs``: capture the step into CUDA graphs (the
    default on CUDA); False runs the same step eagerly (on the CPU: the tests). ``fuse``: run the step through
    ``torch.compile`` (Inductor fuses the norms, rotary and attention glue into a few kernels; the packed GEMMs
    stay the ``w4pack::linear`` op) and capture that; a string names the compile backend (tests: "eager");
    default $W4PACK_LEAN_FUSE (0/1), else on with graphs: a graph of unfused torch ops launches ~35 small
    kernels per layer. A step that fails to compile runs unfused, with one warning. ``attn``: one of
    ``ATTENTION``, default $W4PACK_LEAN_ATTN, else "kernel" on CUDA where the kernel runs the model (silently
    "matmul" where it does not, and off the GPU); asked for by name where it cannot run, it warns. ``fold``:
    fold the norms and residual adds into the packed projections' kernels where they can, three launches a layer
    fewer (default $W4PACK_LEAN_FOLD: 1 or unset on, 0 off, other values refused); ``folded`` counts the
    projections that do."""

    #: new tokens a call reserves cache for up front (the cache grows past it, recapturing the graphs)
    first_reserve = 4096

    def __init__(self, model: nn.Module, graphs: bool | None = None, fuse: bool | str | None = None,
                 attn: str | None = None, fold: bool | None = None):
        self.model = model
        spec = walk(model)
        first = next(model.parameters(), None)
        if first is None or first.dtype not in _DTYPES:
            raise NotLean(f"the lean loop runs float16, bfloat16 or float32 models, not "
                          f"{None if first is None else first.dtype}")
        devices = {t.device for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta}
        if len(devices) != 1:
            raise NotLean(f"the model is spread over {len(devices)} devices")
        self.device = first.device
        if graphs is None:
            graphs = self.device.type == "cuda"
        if graphs and self.device.type != "cuda":
            raise NotLean("CUDA graphs need a model on a CUDA device")
        self.graphs = bool(graphs)
        if fuse is None:
            env = os.environ.get(FUSE_ENV, "").strip().lower()
            fuse = env in ("1", "true", "yes", "on") if env else self.graphs
        self.fuse: Any = "inductor" if fuse is True else (fuse or None)  # a torch.compile backend
        if attn is None:
            attn = os.environ.get(ATTN_ENV, "").strip().lower() or None
        asked = attn is not None
        if attn is None:
            attn = "kernel" if self.device.type == "cuda" else "matmul"
        if attn not in ATTENTION:
            raise BadInputError(f"{ATTN_ENV}={attn!r}: the lean loop attends by {' or '.join(ATTENTION)}")
        self.attn = attn
        if fold is None:
            fold = _fold_setting()
        self._compiled: dict[int, Any] = {}  # bucket -> the compiled step (_own_step)
        self.dtype = first.dtype
        self._init_spec(spec)
        if self.attn == "kernel" and self.device.type == "cuda":  # (elsewhere the op runs its torch reference)
            why = kernel_reason(self.device, self.dtype, self.n_heads, self.n_kv, self.head_dim)
            if why:
                if asked:
                    import warnings

                    warnings.warn(f"{ATTN_ENV}=kernel: {why}; attending by matmul", RuntimeWarning, stacklevel=2)
                self.attn = "matmul"
        with torch.inference_mode():
            self.head = _Linear([spec.head], stack=False, device=self.device, dtype=self.dtype)
            self.layers = [self._layer(ls) for ls in spec.layers]
        self.folded = 0
        if fold:
            for L in self.layers:
                self.folded += sum((L.qkv.may_fold(self.device, self.dtype, L.ln1),
                                    L.o.may_fold(self.device, self.dtype),
                                    L.gate_up.may_fold(self.device, self.dtype, L.ln2),
                                    L.down.may_fold(self.device, self.dtype, swiglu=_is_silu(L.act))))
        self.fold = self.folded > 0
        self._check_widths(self.layers[0].qkv.sizes)
        self.vocab = int(self.head.out_features)
        with torch.inference_mode():  # the step's inputs and outputs: fixed addresses for every graph
            self.tok = torch.zeros(1, dtype=torch.long, device=self.device)
            self.pos_t = torch.zeros(1, dtype=torch.long, device=self.device)
            self.logits = torch.zeros(self.vocab, dtype=self.dtype, device=self.device)
            self.bias = torch.zeros(self.vocab, dtype=torch.float32, device=self.device)  # min_new_tokens
            self.key_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._graphs: dict[int, Any] = {}
        self._pool: Any = None
        self._host: torch.Tensor | None = None
        self.captures = 0  # graphs captured so far (tests, benchmarks)
        self.note = ""  # why the step runs eagerly after all (a failed capture), for decode_mode
        self.signature = signature(model)

    def _layer(self, ls: LayerSpec) -> _Layer:
        L = _Layer()
        L.ln1, L.eps1, L.ln2, L.eps2 = ls.ln1, ls.eps1, ls.ln2, ls.eps2
        L.qn, L.kn = ls.qn, ls.kn
        L.qkv = _Linear(ls.qkv, stack=True, device=self.device, dtype=self.dtype)
        L.o = _Linear([ls.o], stack=False, device=self.device, dtype=self.dtype)
        L.gate_up = _Linear(ls.gate_up, stack=True, device=self.device, dtype=self.dtype)
        L.down = _Linear([ls.down], stack=False, device=self.device, dtype=self.dtype)
        L.act = ls.act
        return L

    # -- state -------------------------------------------------------------------------------------
    def _reserve(self, total: int) -> None:
        """KV cache and rotary tables for at least ``total`` positions (multiples of BUCKET, growing
        geometrically, keeping the positions before ``self.pos``). A new cache has new addresses, so the
        graphs captured over the old one are dropped."""
        if total <= self.max_len:
            return
        size = max(total, BUCKET, 2 * self.max_len)
        size = (size + BUCKET - 1) // BUCKET * BUCKET
        keep = min(self.pos, self.max_len)
        if self._graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay of a graph we drop is still running
        self._graphs.clear()
        with torch.inference_mode():
            for L in self.layers:
                k = torch.zeros(self.n_kv, size, self.head_dim, dtype=self.dtype, device=self.device)
                v = torch.zeros_like(k)
                if keep:
                    k[:, :keep].copy_(L.k[:, :keep])
                    v[:, :keep].copy_(L.v[:, :keep])
                L.k, L.v = k, v
            self._rope_tables(size, self.device)
            self.key_pos = torch.arange(size, device=self.device)
        self.max_len = size

    def bucket(self, pos: int) -> int:
        """The attention length of the graph that runs position ``pos``: the smallest BUCKET·2^i above it
        (at most the cache); the whole cache for the attention kernel, which reads the position itself."""
        if self.attn == "kernel":
            return self.max_len
        b = BUCKET
        while b <= pos:
            b *= 2
        return min(b, self.max_len)

    # -- the step ----------------------------------------------------------------------------------
    def _step(self, bucket: int) -> None:
        """One token: reads ``tok`` and ``pos_t``, writes its K/V at that position, ``logits``, and the next
        inputs (``tok`` = argmax(logits + bias), ``pos_t`` + 1). Attends to the first ``bucket`` positions
        with those after ``pos_t`` masked. Fixed shapes and no host reads: capturable as it stands."""
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        g = nh // nkv
        qn, kvn = nh * d, nkv * d
        pos = self.pos_t
        h = self.embed(self.tok.view(1, 1))[0].to(self.dtype)  # [1, H]
        if self.attn != "kernel":  # (the op reads the rotary rows and the position itself)
            cos = self.cos.index_select(0, pos).unsqueeze(1)  # [1, 1, D]
            sin = self.sin.index_select(0, pos).unsqueeze(1)
            future = self.key_pos[:bucket] > pos  # [bucket]: keys not yet written for this token
        if self.attn == "sdpa":  # (an additive mask made once a step, not once a layer)
            amask = torch.zeros(bucket, dtype=self.dtype, device=self.device).masked_fill(future, float("-inf"))
            amask = amask.view(1, 1, 1, bucket)
        for L in self.layers:
            qkv = L.qkv.normed(h, L.ln1, L.eps1)
            if self.attn == "kernel":
                o = self._attend_kernel(L, qkv, pos)
            else:
                qk = self._qk(L, qkv, cos, sin)
                L.k.index_copy_(1, pos, qk[:, nh:].transpose(0, 1))
                L.v.index_copy_(1, pos, qkv[:, qn + kvn:].view(1, nkv, d).transpose(0, 1))
                q = qk[0, :nh].view(nkv, g, d)
                if self.attn == "sdpa":  # a kv head's G query heads as its G queries
                    o = F.scaled_dot_product_attention(q.unsqueeze(0), L.k[:, :bucket].unsqueeze(0),
                                                       L.v[:, :bucket].unsqueeze(0), attn_mask=amask,
                                                       scale=self.scaling).reshape(1, qn)
                else:
                    s = torch.matmul(q, L.k[:, :bucket].transpose(1, 2)) * self.scaling  # [KVH, G, bucket]
                    s = s.masked_fill(future, float("-inf"))
                    o = torch.matmul(self._softmax(s), L.v[:, :bucket]).reshape(1, qn)
            h = L.o.add(o, h)
            gu = L.gate_up.normed(h, L.ln2, L.eps2)
            h = L.down.swiglu_add(gu, L.act, h)
        last = self._norm(h, self.norm_w, self.norm_eps)
        self.logits.copy_(self.head(last)[0])
        self.tok.copy_(torch.argmax(self.logits.to(torch.float32) + self.bias).view(1))
        self.pos_t.add_(1)

    def _attend_kernel(self, L: _Layer, qkv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The layer's attention as one ``w4pack::decode_attention`` (q/k norms, where the model has them,
        applied first: the op rotates what it is given); o [1, heads * D]."""
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        if L.qn is not None:
            qk = qkv[0, :(nh + nkv) * d].view(nh + nkv, d)
            qk = torch.cat((self._norm(qk[:nh], *L.qn), self._norm(qk[nh:], *L.kn)))
            qkv = torch.cat((qk.view(1, -1), qkv[:, (nh + nkv) * d:]), dim=1)
        o = decode_attention(qkv.contiguous(), self.cos, self.sin, pos, L.k, L.v, nh, nkv, self.scaling)
        return o.view(1, nh * d)

    def _run_step(self, bucket: int) -> None:
        """The step as configured: the torch ops as written, or their ``torch.compile``d form (compiled on its
        first call for each bucket: the bucket is a constant of the traced graph)."""
        if self.fuse:
            try:
                fn = self._compiled.get(bucket)
                if fn is None:
                    fn = self._compiled[bucket] = torch.compile(self._own_step(bucket), backend=self.fuse,
                                                                fullgraph=True, dynamic=False)
                fn(bucket)
                return
            except (KeyboardInterrupt, MemoryError):
                raise
            except Exception as exc:  # noqa: BLE001 - no working compiler here: the same step unfused
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                self._no_fuse(exc)
        self._step(bucket)

    def _own_step(self, bucket: int) -> Any:
        """``_step`` bound to this loop, with a code object of its own for ``bucket``. Dynamo keeps its compiled
        graphs on the code object and counts every other loop or bucket it sees there as a recompile of the same
        function: past ``torch._dynamo.config.recompile_limit`` (8) of them in one process, compiling fails and
        loops built later would run unfused. One code object per (loop, bucket) compiles once and goes with its
        loop."""
        import types

        fn = type(self)._step
        name = f"_step_{bucket}_{id(self):x}"
        code = fn.__code__.replace(co_name=name)  # (a new code object: its dynamo cache starts empty)
        return types.MethodType(types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__), self)

    def _no_fuse(self, exc: BaseException) -> None:
        """Compiling the step failed (before it ran: the inputs are untouched): unfused from now on."""
        import warnings

        from .decode import _one_line

        self.fuse = None
        self._compiled.clear()
        self.note = f"unfused step: torch.compile failed: {_one_line(exc)}"
        warnings.warn(f"the lean loop could not compile its step ({_one_line(exc)}); running it unfused "
                      f"(set {FUSE_ENV}=0 to skip the attempt)", RuntimeWarning, stacklevel=5)

    def _capture(self, bucket: int) -> Any:
        """Record the step for ``bucket`` at the current inputs. The warm-up run (on a side stream, as CUDA
        graph capture requires) writes the K/V of the current position, which the replay rewrites with the
        same values; the token and position it advances are put back."""
        saved = (self.tok.clone(), self.pos_t.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._run_step(bucket)  # also compiles a fused step, outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.tok.copy_(saved[0])
        self.pos_t.copy_(saved[1])
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._run_step(bucket)
        self._graphs[bucket] = graph
        self.captures += 1
        return graph

    def launch(self) -> None:
        """Enqueue one step at position ``self.pos`` (graph replay, or the eager step) and advance."""
        self._reserve(self.pos + 1)
        b = self.bucket(self.pos)
        graph = self._graphs.get(b) if self.graphs else None
        if self.graphs and graph is None:
            try:
                graph = self._capture(b)
            except (KeyboardInterrupt, MemoryError):
                raise
            except Exception as exc:  # noqa: BLE001 - any capture failure: the same step, eagerly, from now on
                self._no_graphs(exc)
        if graph is not None:
            graph.replay()
        else:
            self._run_step(b)
        self.pos += 1

    def _no_graphs(self, exc: BaseException) -> None:
        """Capture failed: run the step eagerly for good (same arithmetic, launched from Python), say why once.
        The warm-up put the inputs back before capturing, so the eager step continues where the graph would."""
        import warnings

        from .decode import _one_line

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise exc  # still inside a capture (ours or a caller's): nothing sane to fall back to
        self.graphs = False
        self._graphs.clear()
        self.note = f"eager step: CUDA graph capture failed: {_one_line(exc)}"
        warnings.warn(f"the lean loop could not capture its step into a CUDA graph ({_one_line(exc)}); running "
                      "the step eagerly from now on", RuntimeWarning, stacklevel=4)

    def step(self, token: int) -> torch.Tensor:
        """One token at the current position; the logits [vocab] (the loop's buffer: read before the next)."""
        with torch.inference_mode():
            self.tok.fill_(int(token))
            self.pos_t.fill_(self.pos)
            self.launch()
        return self.logits

    # -- generation --------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, cfg: Any, streamer: Any = None) -> torch.Tensor:
        """Greedy or sampled continuation of ``input_ids`` [1, T] under ``cfg`` (checked by ``plan``); returns
        [1, T + new] on the input's device, like transformers."""
        ids = input_ids[0].to(device=self.device, dtype=torch.long)
        t_in = int(ids.shape[0])
        new_max, eos_ids, min_new = self._limits(cfg, t_in)
        eos_set = set(eos_ids)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        out = [int(v) for v in input_ids[0].tolist()]
        self.pos = 0
        if new_max > 0:
            self._reserve(t_in + min(new_max, self.first_reserve))  # longer runs grow it (and recapture)
            logits = self.forward(ids)  # the prompt, eagerly
            first = self._pick(self._suppress(logits, eos_ids) if min_new > 0 else logits, cfg)
            self.bias.zero_()
            masked = [e for e in eos_ids if 0 <= e < self.vocab]
            if min_new > 1 and masked and not cfg.do_sample:
                self.bias[masked] = -float("inf")
            self.tok.fill_(first)
            self.pos_t.fill_(self.pos)
            step = self._greedy if not cfg.do_sample else self._sampled
            for tok in step(first, new_max, min_new, eos_ids, cfg):
                out.append(tok)
                if streamer is not None:
                    streamer.put(torch.tensor([tok]))
                if tok in eos_set or len(out) - t_in == new_max:
                    break
        if streamer is not None:
            streamer.end()
        return torch.tensor([out], dtype=input_ids.dtype, device=input_ids.device)

    def _greedy(self, first: int, new_max: int, min_new: int, eos_ids: list[int], cfg: Any) -> Any:
        """Tokens 0, 1, ... of a greedy run: each step feeds the next on the device. On CUDA token i is read
        back while step i + 1 already runs (one step at most past an end token, whose output is dropped)."""
        yield first

        def enqueue(i: int) -> None:  # the step that produces new token i (i >= 1)
            if i == min_new and min_new > 1:
                self.bias.zero_()  # stream-ordered: from this step on an end token may be chosen
            self.launch()

        if self.device.type != "cuda":
            for i in range(1, new_max):
                enqueue(i)
                yield int(self.tok)
            return
        if self._host is None:
            self._host = torch.empty(2, dtype=torch.long, pin_memory=True)
        host = self._host
        events = [torch.cuda.Event(), torch.cuda.Event()]

        def enqueue_read(i: int) -> None:
            enqueue(i)
            host[i % 2:i % 2 + 1].copy_(self.tok, non_blocking=True)
            events[i % 2].record()

        if new_max > 1:
            enqueue_read(1)
        for i in range(1, new_max):
            if i + 1 < new_max:
                enqueue_read(i + 1)
            events[i % 2].synchronize()
            yield int(host[i % 2])

    def _sampled(self, first: int, new_max: int, min_new: int, eos_ids: list[int], cfg: Any) -> Any:
        """Tokens of a sampled run: transformers' selection on each step's logits, written back as the next
        step's input."""
        yield first
        for i in range(1, new_max):
            self.launch()
            tok = self._pick(self._suppress(self.logits, eos_ids) if i < min_new else self.logits, cfg)
            self.tok.fill_(tok)
            yield tok
