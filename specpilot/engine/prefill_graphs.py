"""A prompt's prefill replayed from a CUDA graph, one graph per padded length (EngineConfig.prefill_graphs).

Why: on the H200 the eager prefill of Qwen2.5-Coder-1.5B took 16-18 ms whatever the prompt's length (51 to 215
tokens, padded to 64-256; BENCHMARKS.md, session 21): it is bound by its ~400 launches through Python, not by its
FLOPs or bytes (~1 ms). Tokens per second count the prefill, and at our decode speeds (a 150-token answer in
100-250 ms) those 17 ms were 7-25% of a prompt's time, for AR and speculative decoding alike.

What can be a graph: a pass from position 0 without logits (a prompt's prefill). Its shapes depend only on its
padded length n (engine/runner.py `padded_length`): n tokens at positions 0..n-1, attending with SDPA's causal mask
over the first n cache slots. So one graph per padded length serves every prompt that pads to it (13 lengths for a
4k pool, fewer in practice). The lengths up to 256 (PREPARED: most chat and code prompts) are captured with the
runner, the longer ones the first time they are needed (a capture's warm-up runs eagerly and writes K/V into slots
0..n-1, which any prompt's prefill overwrites before a query can see them), up to `max_len` tokens; a capture
that fails leaves that length eager (warned), never wrong.

Static buffers, refilled each call: the ids (the prompt, then zeros: the padding the eager path uses, so the cache
holds exactly what an eager prefill leaves) and the outputs (the captured features a DFlash drafter reads), which
are views valid until the next prefill of the same length. `static=True` runs the same code from the same buffers
without capturing (any device: the CPU tests hold it to the eager path).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from specpilot.engine.graphs import capture


PREPARED = (16, 32, 64, 128, 256)  # padded lengths captured with the runner (engine/runner.py padded_length)


class PrefillGraphs:
    """`run(ids [1, n], positions [1, n]) -> (None, features [n, F] or None)`: the runner's pass from position 0
    over the whole padded length (kv_len = n, causal); `capture_graphs` on CUDA, `static` anywhere (no capture)."""

    def __init__(self, run: Callable, device: torch.device, max_len: int, *, capture_graphs: bool, static: bool):
        self.run, self.device, self.max_len = run, device, max_len
        self.capture_graphs, self.static = capture_graphs, static
        self.enabled = max_len > 0 and (capture_graphs or static)
        self.entries: dict[int, tuple] = {}  # n -> (graph or None, ids buffer, positions buffer, outputs or None)
        self.pool = None
        self.counts = {"graphed": 0, "static": 0}  # how prefills ran here (the rest ran eagerly in the runner)

    @torch.inference_mode()  # as the runner's own captures: no autograd state in a capture's warm-up or graph
    def prepare(self, room: int) -> None:
        """Build the PREPARED lengths' entries now (those within `max_len` and the pool's `room`): with the decode
        buckets, when the runner is built, so that a prompt of a common length meets a captured graph and no
        capture lands inside a timed generation."""
        if self.enabled:
            for n in PREPARED:
                if n <= min(self.max_len, room) and n not in self.entries:
                    self._build(n)

    def applies(self, start: int, n: int, logits: bool) -> bool:
        return self.enabled and start == 0 and not logits and n <= self.max_len

    def _build(self, n: int) -> tuple:
        ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        graph, out = None, None
        if self.capture_graphs:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()  # the prefill graphs' own pool, shared by their lengths
            try:
                graph, out = capture(lambda: self.run(ids, pos), warmup=1, pool=self.pool)
            except RuntimeError as e:  # not expected; this length then runs eagerly from the buffers
                warnings.warn(f"prefill of {n} tokens: CUDA graph capture failed ({e}); it runs eagerly",
                              RuntimeWarning, stacklevel=3)
                self.pool = torch.cuda.graph_pool_handle()  # a failed capture's pool is not used again
        self.entries[n] = entry = (graph, ids, pos, out)
        return entry

    def __call__(self, ids: torch.Tensor, n: int) -> torch.Tensor | None:
        """Prefill ids [T] (T <= n) at positions 0..T-1, padded to n -> the captured features of the T tokens
        (None without capture_layers)."""
        T = ids.shape[0]
        graph, ids_buf, pos_buf, out = self.entries.get(n) or self._build(n)
        ids_buf[0, :T].copy_(ids)
        if T < n:
            ids_buf[0, T:].zero_()
        if graph is None:
            self.counts["static"] += 1
            out = self.run(ids_buf, pos_buf)
        else:
            self.counts["graphed"] += 1
            graph.replay()
        feats = out[1]
        return feats[:T] if feats is not None else None
