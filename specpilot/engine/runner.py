"""How a model step runs: eagerly (any device), or as CUDA graphs replayed from static buffers (one graph per
token count, "bucket"). The loops ask for `step(ids, start) -> logits` and never know which.

Graphed steps attend over the whole KV pool (static shapes) with the positional causal mask, so a block shorter
than its bucket is padded with junk tokens at the following positions: their K/V land in slots no real query may
see yet, and are overwritten before they could be (see models/cache.py). Logits returned by a graphed step live in
a static buffer: consume them before the next step of the same runner.

Greedy speculative steps ask for `step_greedy_verdict(block, start)` instead: the same forward, then the chain
verdict (verify/chain.py `greedy_verdict_packed`) on its logits, all in the step's graph when the runner was built
with `greedy_verdict=True`: one small long tensor [num_accepted, next_token, d_1 .. d_K], no extra launches.
`static=True` runs the bucketed steps from their static buffers without capturing them (any device): the code a
graph records, run eagerly, so CPU tests can hold it to the plain eager path.

A prompt's prefill (from position 0, up to `prefill_graphs` padded tokens) replays one graph per padded length
(engine/prefill_graphs.py says why); longer prompts and steps no bucket fits run eagerly. Both are padded to one of
a few lengths (`padded_length`) when `pad_shapes` is on (the default on CUDA): every prompt has a new length, and
libraries that plan or tune per shape (cuDNN's attention builds an execution plan per new shape) made each prompt cost
35-135 ms before its first token on the H200 (BENCHMARKS.md, session 14) against ~1.5 ms a decode step. Padding
tokens sit at the positions after the real ones, so under the positional causal mask no real token sees them, and
their K/V land in slots that later steps overwrite before any query reaches them (as a bucket's padding does).
"""

from __future__ import annotations

import warnings

import torch

from specpilot.engine.graphs import capture
from specpilot.engine.prefill_graphs import PrefillGraphs
from specpilot.models import DenseLM, KVCache
from specpilot.verify import greedy_verdict_packed


def padded_length(T: int, room: int) -> int:
    """The length an eager pass of T tokens is padded to: a power of two >= 16 up to 512 (at most 2x the tokens
    where a pass is bound by its weight reads, not its tokens), then a multiple of 512; never past `room` (the
    slots left) nor below T. 13 shapes for a 4k pool instead of one per prompt length."""
    p = max(16, 1 << (T - 1).bit_length()) if T <= 512 else -(-T // 512) * 512
    return max(T, min(p, room))


class ModelRunner:
    def __init__(self, model: DenseLM, cache: KVCache, *, buckets: tuple[int, ...] = (), cuda_graphs: bool = False,
                 compile: bool = False, capture_layers: tuple[int, ...] | None = None, feature_fn=None,
                 greedy_verdict: bool = False, static: bool = False, pad_shapes: bool | None = None,
                 prefill_graphs: int = 0, megakernel: bool = False):
        self.model, self.cache = model, cache
        # one-token steps of one row through ONE persistent launch (kernels/megakernel.py, EngineConfig.megakernel):
        # only where no layer features are wanted (it returns logits), the model's weights then shared with it
        self.megakernel = None
        if megakernel and capture_layers is None and cache.batch_size == 1:
            from specpilot.kernels.megakernel import DecodeMegakernel

            try:
                self.megakernel = DecodeMegakernel(model, cache, share_weights=True)
            except ValueError as e:  # a shape it does not cover (head_dim, GQA group): the regular one-token path
                warnings.warn(f"megakernel: {e}; one-token steps keep the fused path", RuntimeWarning, stacklevel=2)
        # with capture_layers (even empty), features of every processed token are kept after each call in
        # `last_hidden` [T, F]: `feature_fn(final_hidden, layer_outputs)` or, by default, the layer outputs
        # concatenated. A drafter conditioned on the target (DFlash) reads them.
        self.capture_layers, self.feature_fn = capture_layers, feature_fn
        self.last_hidden: torch.Tensor | None = None
        # greedy_verdict: each bucketed step also computes the greedy chain verdict (see step_greedy_verdict)
        self.greedy_verdict = greedy_verdict
        # torch.compile fuses the many small elementwise kernels (norms, RoPE, SiLU) that otherwise dominate a
        # graphed decode step at small shapes; captured into the same CUDA graphs afterwards.
        self._fwd = torch.compile(self._forward, dynamic=False) if compile else self._forward
        self.device = model.lm_head.weight.device
        # eager passes padded to a few lengths (padded_length; the module docstring says why): on CUDA by default
        self.pad_shapes = self.device.type == "cuda" if pad_shapes is None else pad_shapes
        # T -> (graph or None when static and not captured, ids buffer, positions buffer, drafts-count buffer (None
        #       without the verdict), outputs: (logits, captured hidden, packed verdict or None); None when static)
        self.graphs: dict[int, tuple] = {}
        self._num_drafts: dict[int, int] = {}  # bucket -> the value its drafts-count buffer holds now
        self._arange = torch.arange(max(buckets, default=1), device=self.device)
        # how steps ran (the profile prints them: a graphed engine whose steps run eagerly is slow for no visible
        # reason): replayed graphs, static buckets run eagerly (no graph, or its capture failed), and steps no
        # bucket fits (eager, any shape)
        self.step_counts = {"graphed": 0, "eager_bucket": 0, "unbucketed": 0}
        graphs = cuda_graphs and self.device.type == "cuda"
        if graphs or static:
            self._build(sorted(set(buckets), reverse=True), graphs)
        # a prompt's prefill (from position 0, no logits) replayed from one graph per padded length up to
        # `prefill_graphs` tokens (engine/prefill_graphs.py); needs padded shapes, else every prompt is a new length
        self.prefill_graphs = PrefillGraphs(
            lambda ids, pos: self._run(ids, pos, kv_len=ids.shape[1], logits=False, is_causal=True), self.device,
            prefill_graphs if self.pad_shapes else 0, capture_graphs=graphs, static=static)
        self.prefill_graphs.prepare(cache.max_seq_len)

    def _run(self, ids, pos, kv_len=None, logits=True, is_causal=False):
        # -> (logits [T, V] or None, captured hidden [T, F] or None)
        if self.megakernel is not None and logits and ids.shape == (1, 1):  # attends up to its position itself
            return self.megakernel.step(ids[0], pos[0])[None], None
        out = self.model(ids, pos, self.cache, kv_len=kv_len, return_layers=self.capture_layers or (),
                         is_causal=is_causal)
        hidden, layers = out if self.capture_layers else (out, [])
        feats = None
        if self.capture_layers is not None:
            feats = (self.feature_fn(hidden, layers) if self.feature_fn else torch.cat(layers, dim=-1))[0]
        return (self.model.logits(hidden)[0] if logits else None), feats

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor):
        return self._run(ids, pos)

    def _bucket_step(self, ids: torch.Tensor, pos: torch.Tensor, num_drafts: torch.Tensor | None):
        # what a bucket's graph records: the forward over the padded block (whole KV pool), then, given the
        # drafts-count buffer (greedy_verdict), the verdict on its logits. Only the forward is compiled
        # (torch.compile); the verdict's few small ops are recorded into the same graph as they are.
        logits, feats = self._fwd(ids, pos)
        packed = greedy_verdict_packed(ids[0], logits, num_drafts) if num_drafts is not None else None
        return logits, feats, packed

    @torch.inference_mode()
    def _build(self, buckets: list[int], graphs: bool) -> None:
        pool = torch.cuda.graph_pool_handle() if graphs else None  # largest first, one shared pool: later graphs
        for T in buckets:                                         # reuse its blocks
            ids = torch.zeros(1, T, dtype=torch.long, device=self.device)
            pos = torch.arange(T, device=self.device)[None].clone()
            num_drafts = torch.full((1,), T - 1, dtype=torch.long, device=self.device) if self.greedy_verdict else None
            self._num_drafts[T] = T - 1
            g, outputs = None, None
            if graphs:  # 3 warm-ups: torch.compile (when on) recompiles once more before its code settles
                try:
                    g, outputs = capture(lambda: self._bucket_step(ids, pos, num_drafts), warmup=3, pool=pool)
                except RuntimeError as e:
                    # not expected (H200 session 11: once, compile + the norm/RoPE kernels on an fp32 model; the
                    # failures of sessions 28-49 were a garbage collection mid-capture, now kept out: graphs.py); the
                    # bucket then runs the same step eagerly (slower, same tokens) rather than the engine failing.
                    # The pool that capture broke stays marked as recording: later buckets take a fresh one.
                    warnings.warn(f"T={T} step: CUDA graph capture failed ({e}); this bucket runs eagerly",
                                  RuntimeWarning, stacklevel=2)
                    g, outputs, pool = None, None, torch.cuda.graph_pool_handle()
            self.graphs[T] = (g, ids, pos, num_drafts, outputs)

    def _pick_bucket(self, T: int, start: int) -> int | None:
        return min((b for b in self.graphs if b >= T and start + b <= self.cache.max_seq_len), default=None)

    def _replay(self, bucket: int, ids: torch.Tensor, start: int):
        # -> the bucket's outputs (logits [bucket, V], hidden, packed verdict or None), for ids [T] padded to it
        g, ids_buf, pos_buf, num_drafts, outputs = self.graphs[bucket]
        T = ids.shape[0]
        ids_buf[0, :T].copy_(ids)
        torch.add(self._arange[:bucket], start, out=pos_buf[0])  # device-side: no host sync
        if num_drafts is not None and self._num_drafts[bucket] != T - 1:  # rarely changes: write only then
            num_drafts.fill_(T - 1)  # a kernel with the value as its argument: no host sync
            self._num_drafts[bucket] = T - 1
        if g is None:
            self.step_counts["eager_bucket"] += 1
            return self._bucket_step(ids_buf, pos_buf, num_drafts)
        self.step_counts["graphed"] += 1
        g.replay()
        return outputs

    def _eager(self, ids: torch.Tensor, start: int, logits: bool):
        """An eager pass over ids [T] at positions [start, start + T), padded to `padded_length` when pad_shapes is
        on -> (logits [T, V] or None, captured hidden [T, F] or None) of the real tokens. From position 0 the pass
        attends with SDPA's own causal mask (no [T, S] mask tensor; the padded length is the whole key range)."""
        T = ids.shape[0]
        n = self._padded(T, start)
        if self.prefill_graphs.applies(start, n, logits):  # a prompt's prefill: its padded length's graph
            return None, self.prefill_graphs(ids, n)
        if n > T:  # padding tokens after the real ones (token 0: any id will do, nothing real sees them)
            ids = torch.cat((ids, ids.new_zeros(n - T)))
        pos = torch.arange(start, start + n, device=self.device)[None]
        out, feats = self._run(ids[None], pos, kv_len=start + n, logits=logits, is_causal=start == 0)
        return (out[:T] if out is not None else None), (feats[:T] if feats is not None else None)

    def _padded(self, T: int, start: int) -> int:
        """The length an eager pass of T tokens at `start` runs at (T itself without pad_shapes)."""
        return padded_length(T, self.cache.max_seq_len - start) if self.pad_shapes else T

    def prefill_graphed(self, T: int, start: int) -> bool:
        """Whether `prefill` of T tokens at `start` replays its padded length's graph (or, static, its buffers)."""
        return self.prefill_graphs.applies(start, self._padded(T, start), False)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, start: int = 0) -> None:
        """K/V of ids [T] at positions [start, start + T); no LM head. From position 0 its padded length's graph
        when `prefill_graphs` allows it, else eager (prompt lengths vary; padded to a few lengths on CUDA: see the
        module docstring)."""
        _, self.last_hidden = self._eager(ids, start, logits=False)

    def _step(self, ids: torch.Tensor, start: int):
        # -> (logits [T, V], the packed greedy verdict [T + 1] when its bucket computed one, else None)
        T = ids.shape[0]
        bucket = self._pick_bucket(T, start)
        if bucket is None:
            self.step_counts["unbucketed"] += 1
            logits, self.last_hidden = self._eager(ids, start, logits=True)
            return logits, None
        logits, feats, packed = self._replay(bucket, ids, start)
        self.last_hidden = feats[:T] if feats is not None else None
        return logits[:T], (packed[: T + 1] if packed is not None else None)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [T] long on the device, at positions [start, start + T) -> logits [T, V] fp32."""
        return self._step(ids, start)[0]

    @torch.inference_mode()
    def step_greedy_verdict(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The greedy verify step: ids [T] = [last committed token, d_1 .. d_K] at positions [start, start + T)
        -> [K + 2] long on the device = [num_accepted, next_token, d_1 .. d_K] (verify/chain.py
        `greedy_verdict_packed`); `last_hidden` is set as by `step`. From a bucket built with greedy_verdict, the
        verdict was computed inside the step (its graph on CUDA) and the result is a view of the bucket's static
        output: read it before the next step of this runner. Otherwise it is computed here from the logits."""
        logits, packed = self._step(ids, start)
        return packed if packed is not None else greedy_verdict_packed(ids, logits)
