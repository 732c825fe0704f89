"""Prompt lookup: a training-free drafter that copies what followed the last occurrence of the context's suffix.

For n from `ngram_max` down to `ngram_min`, find the most recent earlier occurrence of the context's last n tokens
and propose the tokens that followed it (up to a whole block). Code and chat answers quote their prompts often,
which is what makes this cheap drafter useful. It has no distribution: its tokens are point masses.

Because it needs no model, its greedy acceptance can be *replayed* exactly on outputs already generated
(`replay`): the loop prices a switch to n-grams, or another n-gram setting, before measuring it.
"""

from __future__ import annotations

import time

import torch

from specpilot.drafters.base import Draft


class NgramDrafter:
    """The lookup keeps an index per n (n-gram -> its latest start with at least one token after it), extended by
    the tokens committed since the last call: O(new tokens) per step instead of a scan of the whole context
    (which grew to milliseconds of host time per step at 4k-token contexts). `lookup_scan` is the plain scan it
    must agree with (tests)."""

    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, device="cpu"):
        self.ngram_max, self.ngram_min, self.device = ngram_max, ngram_min, device
        self._clear_index()

    def reset(self) -> None:
        self._clear_index()

    def _clear_index(self) -> None:
        self._seen: list[int] = []  # the context the index covers
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}

    def _extend(self, context_ids: list[int]) -> None:
        old = len(self._seen)
        if context_ids[:old] != self._seen:  # another context (a new prompt; no reset needed): start again
            self._clear_index()
            old = 0
        L = len(context_ids)
        for n, index in self._index.items():  # n-grams starting at s <= L - n - 1 have a token after them
            for s in range(max(0, old - n), L - n):
                index[tuple(context_ids[s:s + n])] = s
        self._seen = list(context_ids)

    def lookup(self, context_ids: list[int], num_tokens: int) -> tuple[list[int], int]:
        """(up to num_tokens tokens that followed the longest, most recent earlier match of the context's suffix,
        the length n of that suffix); ([], 0) without a match."""
        self._extend(context_ids)
        n_ctx = len(context_ids)
        for n in range(min(self.ngram_max, n_ctx - 1), self.ngram_min - 1, -1):
            start = self._index[n].get(tuple(context_ids[n_ctx - n:]))
            if start is not None:
                return context_ids[start + n:start + n + num_tokens], n
        return [], 0

    def lookup_scan(self, context_ids: list[int], num_tokens: int) -> tuple[list[int], int]:
        """`lookup` by scanning the context right to left (the most recent match predicts best)."""
        n_ctx = len(context_ids)
        for n in range(min(self.ngram_max, n_ctx - 1), self.ngram_min - 1, -1):
            suffix = context_ids[n_ctx - n:]
            for start in range(n_ctx - n - 1, -1, -1):
                if context_ids[start:start + n] == suffix:
                    follow = context_ids[start + n:start + n + num_tokens]
                    if follow:
                        return follow, n
        return [], 0

    def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        follow, _ = self.lookup(context_ids, num_tokens)
        return Draft(torch.tensor(follow, dtype=torch.long, device=self.device))


def replay(drafter: NgramDrafter, prompts: list[list[int]], outputs: list[list[int]], num_tokens: int) -> dict:
    """Greedy speculative decoding with `drafter` replayed on known greedy outputs, no model run: each step drafts
    from the committed context, keeps the drafts that match the output, and commits one more token (the target's),
    as engine/spec.py does. -> {"tau": tokens per step, "propose_s": mean host seconds of one propose() here}."""
    steps, tokens, secs = 0, 0, 0.0
    for prompt, out in zip(prompts, outputs):
        ids, done = list(prompt), 0
        while done < len(out):
            k = min(num_tokens, len(out) - done - 1)
            t0 = time.perf_counter()
            draft = drafter.propose(ids, k).token_ids.tolist() if k > 0 else []
            secs += time.perf_counter() - t0
            a = 0
            while a < len(draft) and draft[a] == out[done + a]:
                a += 1
            ids += out[done:done + a + 1]
            done += a + 1
            steps, tokens = steps + 1, tokens + a + 1
    return {"tau": tokens / steps if steps else 1.0, "propose_s": secs / steps if steps else 0.0}
