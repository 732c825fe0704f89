"""When to speculate: per step, a speculative step (draft + verify a block) or a plain one-token step, whichever the
recent steps say commits more tokens per second (`EngineConfig.adaptive`).

Why: a speculative step pays for a draft pass and a multi-token verify pass; it wins only while its tokens per step
(tau) exceed what it costs in plain steps. On the H200 a 16-token DFlash step cost 2.2-2.8 fused one-token steps
(BENCHMARKS.md, session 14), so stretches where the drafter guesses badly (MT-Bench prose: tau 1.7) ran slower than
AR, while code (tau 4) ran faster. Acceptance moves within one answer, so the choice is made per step, not per run.

Policy (both choices are lossless: a plain step is the target's own next token, so the output is the same either
way; only the time changes):
  * it measures what each kind of step costs in wall seconds between the step's host syncs (the speculative loop
    syncs once a step anyway: no extra sync) and the tokens each speculative step commits, as moving averages;
  * after a speculative step, gain = tokens per step x plain-step seconds / speculative-step seconds. Below
    `min_gain` it runs `backoff` plain steps before probing with a speculative step again; the backoff doubles
    while probes keep losing (up to `max_plain`) and drops back to 1 when one wins;
  * no plain-step timing yet (the first prompt): one plain step right after the first speculative step measures it.
    Timings persist across prompts (the engine keeps one policy); the acceptance average restarts each prompt.
    A prompt's first step is not timed: it carries one-off costs (a conditioned drafter's first pass reads the
    whole prompt), which would make the next steps look dearer than they are;
  * the engine may cut a plain run short (`catch_up` in engine/spec.py): a conditioned drafter (DFlash) takes
    the features of every token committed meanwhile in its next pass, and its graphed pass takes at most a block.
"""

from __future__ import annotations

import time
from typing import Callable


class AdaptiveSpeculation:
    def __init__(self, min_gain: float = 1.0, max_plain: int = 8, alpha: float = 0.3,
                 clock: Callable[[], float] = time.perf_counter):
        if min_gain <= 0 or max_plain < 1 or not 0 < alpha <= 1:
            raise ValueError(f"adaptive speculation: need min_gain > 0, max_plain >= 1, 0 < alpha <= 1; got "
                             f"{min_gain}, {max_plain}, {alpha}")
        self.min_gain, self.max_plain, self.alpha, self.clock = min_gain, max_plain, alpha, clock
        self.plain_s: float | None = None  # moving average: seconds a plain step takes (kept across prompts)
        self.spec_s: float | None = None  # seconds a speculative step takes (kept across prompts)
        self.start()

    def start(self) -> None:
        """A new prompt: speculate first; the acceptance average starts afresh. Call right before the first step."""
        self.tokens: float | None = None  # moving average: tokens a speculative step commits (this prompt)
        self.plain_left = 0
        self.backoff = 1
        self._first = True  # the prompt's first step: its tokens count, its time does not (see the docstring)
        self._t = self.clock()

    def speculate(self) -> bool:
        """Whether the next step drafts (True) or is a plain one-token step (False)."""
        return self.plain_left <= 0

    def gain(self) -> float | None:
        """Expected speed of speculative over plain steps from the averages (None until all three are known)."""
        if self.tokens is None or self.spec_s is None or self.plain_s is None or self.spec_s <= 0:
            return None
        return self.tokens * self.plain_s / self.spec_s

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def record(self, speculative: bool, committed: int) -> None:
        """After the step's sync: what kind of step ran and how many tokens it committed."""
        now = self.clock()
        dt, self._t = now - self._t, now
        timed, self._first = not self._first, False
        if not speculative:
            if timed:
                self.plain_s = self._avg(self.plain_s, dt)
            self.plain_left -= 1
            return
        if timed:
            self.spec_s = self._avg(self.spec_s, dt)
        self.tokens = self._avg(self.tokens, committed)
        if self.plain_s is None and self.plain_left <= 0:  # one plain step to learn what it costs
            self.plain_left = 1
            return
        g = self.gain()
        if g is not None and g < self.min_gain:
            self.plain_left = self.backoff
            self.backoff = min(2 * self.backoff, self.max_plain)
        else:
            self.backoff = 1

    def skip(self) -> None:
        """The engine overrode a plain step with a speculative one (a drafter catch-up limit): end the plain run."""
        self.plain_left = 0
