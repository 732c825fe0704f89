"""A generation session: the target, its preallocated KV cache, the stop rule, the RNG and the clock.

The loops in `ar.py` and `spec.py` only say *what* happens in a step; this holds *how* a target pass runs, so a
faster runtime (CUDA graphs, next issue) replaces `target_step` without touching the loops.
Cache invariant between steps: it holds K/V for every committed token except the last one.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from specpilot.config import EngineConfig
from specpilot.engine.result import GenerationResult
from specpilot.engine.stops import StopRule
from specpilot.errors import ConfigError
from specpilot.models import DenseLM


class Session:
    def __init__(
        self,
        target: DenseLM,
        config: EngineConfig,
        stop: StopRule,
        on_tokens: Callable[[list[int]], None] | None = None,
        cache=None,
    ):
        self.target, self.config, self.stop, self.on_tokens = target, config, stop, on_tokens
        self.device = target.lm_head.weight.device
        self.cache = cache if cache is not None else target.new_cache(1, config.max_seq_len)
        self.generator = torch.Generator(device=self.device).manual_seed(config.sampling.seed)

    def room(self, n_committed: int) -> int:
        """How many tokens a step may still write: the last committed token sits at position n_committed - 1."""
        return self.cache.max_seq_len - (n_committed - 1)

    def has_room(self, n_committed: int, n_new: int) -> bool:
        return self.room(n_committed) >= n_new

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def clock(self, res: GenerationResult, attr: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            setattr(res, attr, getattr(res, attr) + time.perf_counter() - t0)

    def target_step(self, token_ids: list[int], start: int) -> torch.Tensor:
        """Run the target over tokens at positions [start, start + T) -> logits [T, V] fp32."""
        t = torch.tensor([token_ids], device=self.device)
        pos = torch.arange(start, start + len(token_ids), device=self.device)[None]
        return self.target.logits(self.target(t, pos, self.cache, kv_len=start + len(token_ids)))[0]

    def prefill(self, prompt_ids: list[int], res: GenerationResult) -> list[int]:
        if not prompt_ids:
            raise ConfigError("empty prompt: give at least one token")
        if len(prompt_ids) + 1 > self.cache.max_seq_len:
            raise ConfigError(
                f"prompt of {len(prompt_ids)} tokens does not fit max_seq_len={self.cache.max_seq_len}"
            )
        with self.clock(res, "prefill_s"), torch.inference_mode():
            if len(prompt_ids) > 1:  # K/V only: no LM head over the prompt
                t = torch.tensor([prompt_ids[:-1]], device=self.device)
                pos = torch.arange(len(prompt_ids) - 1, device=self.device)[None]
                self.target(t, pos, self.cache, kv_len=len(prompt_ids) - 1)
        return list(prompt_ids)

    def emit(self, tokens: list[int]) -> None:
        if self.on_tokens and tokens:
            self.on_tokens(tokens)
