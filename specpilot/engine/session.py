"""A generation session: the target's runner, the stop rule, the RNG and the clock.

The loops in `ar.py` and `spec.py` only say *what* happens in a step; the runner (`runner.py`) says *how* a
target pass runs (eager or CUDA graphs). Cache invariant between steps: it holds K/V for every committed token
except the last one.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from specpilot.config import EngineConfig
from specpilot.engine.result import GenerationResult
from specpilot.engine.runner import ModelRunner
from specpilot.engine.stops import StopRule
from specpilot.errors import ConfigError


class Session:
    def __init__(self, runner: ModelRunner, config: EngineConfig, stop: StopRule, on_tokens: Callable | None = None):
        self.runner, self.config, self.stop, self.on_tokens = runner, config, stop, on_tokens
        self.device = runner.device
        self.max_seq_len = runner.cache.max_seq_len
        self.generator = torch.Generator(device=self.device).manual_seed(config.sampling.seed)

    def room(self, n_committed: int) -> int:
        """How many tokens a step may still write: the last committed token sits at position n_committed - 1."""
        return self.max_seq_len - (n_committed - 1)

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

    def stage_timer(self) -> "StageTimer":
        return StageTimer(self.device)

    def tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def prefill(self, prompt_ids: list[int], res: GenerationResult) -> list[int]:
        if not prompt_ids:
            raise ConfigError("empty prompt: give at least one token")
        if len(prompt_ids) + 1 > self.max_seq_len:
            raise ConfigError(f"prompt of {len(prompt_ids)} tokens does not fit max_seq_len={self.max_seq_len}")
        with self.clock(res, "prefill_s"):
            if len(prompt_ids) > 1:
                self.runner.prefill(self.tensor(prompt_ids[:-1]), 0)
        return list(prompt_ids)

    def emit(self, tokens: list[int]) -> None:
        if self.on_tokens and tokens:
            self.on_tokens(tokens)


class StageTimer:
    """Per-stage device time of speculative steps (draft / verify / accept / commit), with no host sync per step:
    on CUDA it records events between stages and reads them once at the end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.marks.append(("", self._now()))

    def mark(self, stage: str) -> None:
        self.marks.append((stage, self._now()))

    def totals(self) -> dict[str, float]:
        """stage -> seconds, summed over steps (time since the previous mark)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for (_, a), (stage, b) in zip(self.marks, self.marks[1:]):
            if not stage:
                continue
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[stage] = out.get(stage, 0.0) + dt
        return out
