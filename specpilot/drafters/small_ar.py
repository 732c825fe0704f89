"""A small AR model as drafter (e.g. Qwen2.5-Coder-0.5B drafting for -1.5B): any model with the target's tokenizer.

It keeps its own KV cache and the list of tokens that cache holds. Each step it finds the longest common prefix
of that list and the committed context, feeds only the tokens past it (after an accepted block: just the token
the target added; a prompt through the runner's prefill graph where it has one, engine/prefill_graphs.py), then
drafts K tokens one at a time. The
drafted tokens never leave the device (each feeds the next step's input directly), so drafting costs no host
sync. Rejected drafts need no rollback: their slots are simply overwritten later (see models/cache.py).

Chained passes (`chain` > 0: EngineConfig.draft_chain_graph, greedy, CUDA graphs): the K - 1 one-token passes
after the catch-up pass are ONE captured graph: each pass's argmax feeds the next on the device, so a step
launches two graphs instead of K, and the host's per-pass work (bucket choice, input copies, the argmax launch)
goes. Same drafts (the same forward, the same argmax). Built with the drafter, before any prompt: its capture's
warm-up passes write K/V into slots 0..K-2, which a prompt's prefill overwrites. Steps that draft fewer or more
than K tokens (the end of the output) take the pass-by-pass loop. `static` runs the chain's code eagerly from the
same buffers without capturing (any device: the CPU tests).

For `specpilot profile` (drafters/timing.py ProposeTimer): `last_launch_t` is when the step's first pass was
launched, `last_eager_launches` the (before, after) device launches outside the runner's graphs (greedy: the fed
tokens' copy before it; each pass's two input copies and argmax, the chain's two copies, the final stack after),
and `graph_events` (None: off; a list turns it on, CUDA only) collects a CUDA event pair around each pass, with
`graph_event_labels` saying which (the tokens it fed, or "chain"): the profile can then tell the passes' device
time from the host's part of the draft stage, and a catch-up pass's from a one-token pass's.
"""

from __future__ import annotations

import time

import torch

from specpilot.config import SamplingConfig
from specpilot.drafters.base import Draft
from specpilot.sampling import probs_from_logits, sample


class SmallARDrafter:
    name = "model"

    def __init__(self, runner, sampling: SamplingConfig, generator=None, chain: int = 0, static: bool = False):
        self.runner = runner  # an engine ModelRunner over the drafter model and its own cache
        self.sampling = sampling
        self.generator = generator
        self.device = runner.device
        self.chain = chain if sampling.greedy else 0  # one-token passes chained in one graph (module docstring)
        self._chain_graph, self._chain_out = None, None
        if self.chain > 0:
            self._build_chain(static)
        self.cached: list[int] = []  # tokens whose K/V the cache holds, in position order
        self._unread: torch.Tensor | None = None
        self.last_launch_t, self.last_pass = 0.0, ""  # see the module docstring (profiling only)
        self.last_eager_launches = (0, 0)
        self.graph_events: list | None = None
        self.graph_event_labels: list = []

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

    def _chained(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """`chain` greedy one-token passes from token tok [1] at position pos [1] -> their tokens [chain]."""
        out = []
        for j in range(self.chain):
            logits, _ = self.runner._run(tok.view(1, 1), (pos + j).view(1, 1))
            tok = logits[0].argmax(-1, keepdim=True)
            out.append(tok)
        return torch.cat(out)

    @torch.inference_mode()
    def _build_chain(self, static: bool) -> None:
        from specpilot.engine.graphs import or_eager

        self._chain_tok = torch.zeros(1, dtype=torch.long, device=self.device)
        self._chain_pos = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.device.type == "cuda" and not static:
            from specpilot.engine.graphs import capture

            built = or_eager(lambda: capture(lambda: self._chained(self._chain_tok, self._chain_pos), warmup=2),
                             "small drafter's chained passes")
            if built is None:  # capture failed: the pass-by-pass loop (warned)
                self.chain = 0
                return
            self._chain_graph, self._chain_out = built
        elif not static:  # no graphs here (CPU engine): the pass-by-pass loop
            self.chain = 0

    def _run_chain(self, first: torch.Tensor, pos: int) -> torch.Tensor:
        """The chained passes after `first` (0-dim, on the device) drafted at position pos -> [chain] tokens."""
        self._chain_tok.copy_(first.view(1))
        self._chain_pos.fill_(pos)  # a kernel with the value as its argument: no host sync
        if self._chain_graph is None:  # static: the same code, eagerly
            return self._chained(self._chain_tok, self._chain_pos)
        self._timed(self._chain_graph.replay, "chain")
        return self._chain_out

    def _pass(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        return self._timed(lambda: self.runner.step(ids, start), ids.shape[0])

    def _timed(self, launch, label):
        """launch() -> its result; between a CUDA event pair kept in `graph_events` (and its label in
        `graph_event_labels`) when profiling (see the module docstring)."""
        if self.graph_events is None or self.device.type != "cuda":
            return launch()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = launch()
        b.record()
        self.graph_events.append((a, b))
        self.graph_event_labels.append(label)
        return out

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
        last = len(new) - 1
        if last > 0 and len(new) > max(self.runner.graphs, default=0) and self.runner.prefill_graphed(last, keep):
            # a feed no bucket takes (a prompt's): all but its last token through the runner's prefill graph,
            # the last through the one-token step, instead of one eager pass with logits for every row
            self.runner.prefill(fed[:last], keep)
            logits, last = self._pass(fed[last:], keep + last), 0
        else:
            logits = self._pass(fed, keep)
        dists: list[torch.Tensor] = []
        tokens = [self._pick(logits[last], dists)]
        pos = len(context_ids)
        after = 3  # the first pass's two input copies and its pick (greedy: one argmax)
        if self.chain > 0 and num_tokens - 1 == self.chain:  # K - 1 passes in one graph (module docstring)
            tokens.extend(self._run_chain(tokens[0], pos).unbind())
            pos += self.chain
            after += 2
        after += 3 * (num_tokens - len(tokens)) + 1  # the loop's passes alike; the stack below
        self.last_eager_launches = (1, after)
        for _ in range(num_tokens - len(tokens)):
            logits = self._pass(tokens[-1].view(1), pos)
            tokens.append(self._pick(logits[0], dists))
            pos += 1
        # the cache now holds the context and all drafts but the last; their values are on the device only, so
        # they are read at the next propose (after the engine's sync): accepted drafts then need no re-feeding.
        drafted = torch.stack(tokens)
        self.cached = list(context_ids) + [-1] * (num_tokens - 1)
        self._unread = drafted[: num_tokens - 1] if num_tokens > 1 else None
        return Draft(drafted, torch.stack(dists) if dists else None)
