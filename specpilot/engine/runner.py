"""How a model step runs: eagerly (any device), or as CUDA graphs replayed from static buffers (one graph per
token count, "bucket"). The loops ask for `step(ids, start) -> logits` and never know which.

Graphed steps attend over the whole KV pool (static shapes) with the positional causal mask, so a block shorter
than its bucket is padded with junk tokens at the following positions: their K/V land in slots no real query may
see yet, and are overwritten before they could be (see models/cache.py). Logits returned by a graphed step live in
a static buffer: consume them before the next step of the same runner.
"""

from __future__ import annotations

import torch

from specpilot.engine.graphs import capture
from specpilot.models import DenseLM, KVCache


class ModelRunner:
    def __init__(self, model: DenseLM, cache: KVCache, *, buckets: tuple[int, ...] = (), cuda_graphs: bool = False,
                 compile: bool = False, capture_layers: tuple[int, ...] | None = None, feature_fn=None):
        self.model, self.cache = model, cache
        # with capture_layers (even empty), features of every processed token are kept after each call in
        # `last_hidden` [T, F]: `feature_fn(final_hidden, layer_outputs)` or, by default, the layer outputs
        # concatenated. A drafter conditioned on the target (DFlash) reads them.
        self.capture_layers, self.feature_fn = capture_layers, feature_fn
        self.last_hidden: torch.Tensor | None = None
        # torch.compile fuses the many small elementwise kernels (norms, RoPE, SiLU) that otherwise dominate a
        # graphed decode step at small shapes; captured into the same CUDA graphs afterwards.
        self._fwd = torch.compile(self._forward, dynamic=False) if compile else self._forward
        self.device = model.lm_head.weight.device
        self.graphs: dict[int, tuple] = {}  # T -> (graph, ids buffer, positions buffer, logits, captured hidden)
        self._arange = torch.arange(max(buckets, default=1), device=self.device)
        if cuda_graphs and self.device.type == "cuda":
            self._capture(sorted(set(buckets), reverse=True))

    def _run(self, ids, pos, kv_len=None, logits=True):
        # -> (logits [T, V] or None, captured hidden [T, F] or None)
        out = self.model(ids, pos, self.cache, kv_len=kv_len, return_layers=self.capture_layers or ())
        hidden, layers = out if self.capture_layers else (out, [])
        feats = None
        if self.capture_layers is not None:
            feats = (self.feature_fn(hidden, layers) if self.feature_fn else torch.cat(layers, dim=-1))[0]
        return (self.model.logits(hidden)[0] if logits else None), feats

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor):
        return self._run(ids, pos)

    @torch.inference_mode()
    def _capture(self, buckets: list[int]) -> None:
        pool = torch.cuda.graph_pool_handle()  # largest first, one shared pool: later graphs reuse its blocks
        for T in buckets:
            ids = torch.zeros(1, T, dtype=torch.long, device=self.device)
            pos = torch.arange(T, device=self.device)[None].clone()
            # 3 warm-ups: torch.compile (when on) recompiles once more before its code settles
            g, (logits, feats) = capture(lambda: self._fwd(ids, pos), warmup=3, pool=pool)
            self.graphs[T] = (g, ids, pos, logits, feats)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, start: int = 0) -> None:
        """K/V of ids [T] at positions [start, start + T); no LM head. Always eager (prompt lengths vary)."""
        pos = torch.arange(start, start + ids.shape[0], device=self.device)[None]
        _, self.last_hidden = self._run(ids[None], pos, kv_len=start + ids.shape[0], logits=False)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [T] long on the device, at positions [start, start + T) -> logits [T, V] fp32."""
        T = ids.shape[0]
        bucket = min((b for b in self.graphs if b >= T and start + b <= self.cache.max_seq_len), default=None)
        if bucket is None:
            pos = torch.arange(start, start + T, device=self.device)[None]
            logits, self.last_hidden = self._run(ids[None], pos, kv_len=start + T)
            return logits
        g, ids_buf, pos_buf, logits, feats = self.graphs[bucket]
        ids_buf[0, :T].copy_(ids)
        torch.add(self._arange[:bucket], start, out=pos_buf[0])  # device-side: no host sync
        g.replay()
        self.last_hidden = feats[:T] if feats is not None else None
        return logits[:T]
