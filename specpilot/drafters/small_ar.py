"""A small AR model as drafter (e.g. Qwen2.5-Coder-0.5B drafting for -1.5B): any model with the target's tokenizer.

It keeps its own KV cache and the list of tokens that cache holds. Each step it finds the longest common prefix
of that list and the committed context, feeds only the tokens past it (after an accepted block: just the token
the target added), then drafts K tokens one at a time. The
drafted tokens never leave the device (each feeds the next step's input directly), so drafting costs no host
sync. Rejected drafts need no rollback: their slots are simply overwritten later (see models/cache.py).

For `specpilot profile` (drafters/timing.py ProposeTimer): `last_launch_t` is when the step's first pass was
launched, and `graph_events` (None: off; a list turns it on, CUDA only) collects a CUDA event pair around each
pass, so the profile can tell the passes' device time from the host's part of the draft stage.
"""

from __future__ import annotations

import time

import torch

from specpilot.config import SamplingConfig
from specpilot.drafters.base import Draft
from specpilot.sampling import probs_from_logits, sample


class SmallARDrafter:
    name = "model"

    def __init__(self, runner, sampling: SamplingConfig, generator=None):
        self.runner = runner  # an engine ModelRunner over the drafter model and its own cache
        self.sampling = sampling
        self.generator = generator
        self.device = runner.device
        self.cached: list[int] = []  # tokens whose K/V the cache holds, in position order
        self._unread: torch.Tensor | None = None
        self.last_launch_t, self.last_pass = 0.0, ""  # see the module docstring (profiling only)
        self.graph_events: list | None = None

    def reset(self) -> None:
        self.cached = []
        self._unread: torch.Tensor | None = None  # last step's fed drafts, still on the device

    def _pick(self, logits: torch.Tensor, dists: list) -> torch.Tensor:
        # logits [V] -> token (0-dim, on device)
        if self.sampling.greedy:
            return logits.argmax(-1)
        probs = probs_from_logits(logits, self.sampling)
        dists.append(probs)
        return sample(probs, self.generator)

    def _pass(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        if self.graph_events is None or self.device.type != "cuda":
            return self.runner.step(ids, start)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        logits = self.runner.step(ids, start)
        b.record()
        self.graph_events.append((a, b))
        return logits

    @torch.inference_mode()
    def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        if self._unread is not None:  # the engine has synced since: reading them now stalls nothing
            values = self._unread.tolist()
            self.cached[len(self.cached) - len(values):] = values
            self._unread = None
        keep = 0
        limit = min(len(self.cached), len(context_ids) - 1)  # always re-feed at least the last context token
        while keep < limit and self.cached[keep] == context_ids[keep]:
            keep += 1
        new = context_ids[keep:]
        if keep + len(new) + num_tokens > self.runner.cache.max_seq_len:
            raise ValueError("drafter cache too small for this context")
        fed = torch.tensor(new, dtype=torch.long, device=self.device)
        self.last_launch_t, self.last_pass = time.perf_counter(), "passes"
        logits = self._pass(fed, keep)
        dists: list[torch.Tensor] = []
        tokens = [self._pick(logits[len(new) - 1], dists)]
        pos = len(context_ids)
        for _ in range(num_tokens - 1):
            logits = self._pass(tokens[-1].view(1), pos)
            tokens.append(self._pick(logits[0], dists))
            pos += 1
        # the cache now holds the context and all drafts but the last; their values are on the device only, so
        # they are read at the next propose (after the engine's sync): accepted drafts then need no re-feeding.
        drafted = torch.stack(tokens)
        self.cached = list(context_ids) + [-1] * (num_tokens - 1)
        self._unread = drafted[: num_tokens - 1] if num_tokens > 1 else None
        return Draft(drafted, torch.stack(dists) if dists else None)
