"""The gate: a candidate is adopted only if it is lossless, its gain is real, and its gain generalizes.

A trial passes only if every check passes (the first failures are recorded as the reason, "check: detail"):
  (a) forcing   token forcing passes on every output token of the candidate, on the dev prompts and on the
                held-out prompts, scored by `scorer` — the stock AR of the same target, which shares no code path
                with the candidate (the CLI uses transformers' implementation; see evaluator/forcing.py);
  (c) noise     on dev, median tokens/s beats the reference's median by more than the run-to-run spread
                (max - min over the R repeats) of either: a "gain" inside the noise is not a gain. The reference
                (the current best) is measured again right before the candidate, so slow drift of a shared
                machine cannot pass for a gain or hide one;
  (d) ceiling   a median above the cost model's tokens/s ceiling for this config is a measurement fault, not a
                speedup (where no ceiling is available, e.g. on CPU, the check is skipped and a note says so);
  (b) held-out  measured again on the held-out prompts (which no explorer ever sees), the candidate must also
                beat the reference there by more than the noise: a gain that only exists on dev (tuned to, or
                cached for, those prompts) does not repeat.
Dev checks run first, so a candidate that fails them costs no held-out measurement. Every measurement and every
forcing pass holds the device lease. The gate only reads the evaluator (forcing.force); it never changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specpilot.config import EngineConfig
from specpilot.evaluator.forcing import DEFAULT_TOLERANCE, LogitsFn, force
from specpilot.loop.explore import GpuLease, Measure, Measurement

CeilingFn = Callable[[EngineConfig, Measurement], "float | None"]  # tokens/s no correct run can exceed


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)  # "check: detail", for every failed check
    notes: list[str] = field(default_factory=list)  # checks skipped and why, other remarks
    figures: dict = field(default_factory=dict)  # {"dev": stats, "heldout": stats, "gain_dev", "gain_heldout"}

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    @property
    def check(self) -> str:
        """The first failed check's name ("forcing", "noise", ...), "" when passed."""
        return self.reasons[0].split(":", 1)[0] if self.reasons else ""


class Gate:
    def __init__(self, scorer: LogitsFn, heldout: list[list[int]], *, repeats: int = 3,
                 tolerance: float = DEFAULT_TOLERANCE, ceiling_fn: CeilingFn | None = None, device: str = "cpu"):
        if repeats < 2:
            raise ValueError("the gate needs >= 2 repeats per measurement to know the run-to-run noise")
        if not heldout:
            raise ValueError("the gate needs held-out prompts")
        self.scorer, self.heldout, self.repeats, self.tolerance = scorer, heldout, repeats, tolerance
        self.ceiling_fn, self.lease = ceiling_fn, GpuLease(device)

    # --- the checks ---------------------------------------------------------------------------------------------

    def forcing(self, m: Measurement, split: str) -> list[str]:
        if len(m.outputs) != len(m.prompts):
            return [f"forcing: {split}: {len(m.outputs)} outputs for {len(m.prompts)} prompts"]
        with self.lease:
            verdicts = [force(self.scorer, p, o, self.tolerance) for p, o in zip(m.prompts, m.outputs)]
        bad = [(i, v.failures[0], len(v.failures)) for i, v in enumerate(verdicts) if not v.passed]
        if not bad:
            return []
        i, f, n = bad[0]
        return [f"forcing: {split}: {sum(b[2] for b in bad)} tokens differ from stock on {len(bad)} prompts; "
                f"first: prompt {i} position {f.index} token {f.token} != stock {f.stock_token} "
                f"(margin {f.margin:.3f} >= tolerance {self.tolerance})"]

    def ceiling(self, config: EngineConfig, m: Measurement, split: str, figures: dict | None = None
                ) -> tuple[list[str], list[str]]:
        limit = self.ceiling_fn(config, m) if self.ceiling_fn else None
        if figures is not None:
            figures[f"ceiling_{split}"] = limit
        if limit is None:
            return [], ["ceiling: no cost-model ceiling for this device (e.g. CPU): check (d) skipped"]
        med = m.stats()["median"]
        if med > limit:
            return [f"ceiling: {split}: {med:.2f} tok/s is above the cost model's ceiling {limit:.2f} tok/s "
                    "(a measurement fault, not a speedup)"], []
        return [], []

    @staticmethod
    def beats(cand: dict, ref: dict, split: str) -> tuple[list[str], float]:
        gain = cand["median"] - ref["median"]
        noise = max(ref["spread"], cand["spread"])
        ratio = cand["median"] / ref["median"] if ref["median"] > 0 else float("inf")
        if gain <= noise:
            what = "heldout" if split == "heldout" else ("noise" if gain > 0 else "slower")
            why = f"not faster than the reference (spread {noise:.3f})" if gain <= 0 else \
                f"gain {gain:+.3f} does not exceed the run-to-run spread {noise:.3f}"
            return [f"{what}: {split}: {cand['median']:.3f} vs {ref['median']:.3f} tok/s (x{ratio:.3f}); {why}"], \
                ratio
        return [], ratio

    # --- verdicts -----------------------------------------------------------------------------------------------

    def _pair(self, ref_cfg, ref_measure, cfg, measure, prompts) -> tuple[Measurement, Measurement]:
        """The reference, then the candidate, back to back under the lease: drift of the machine hits both."""
        with self.lease:
            return ref_measure(ref_cfg, prompts, self.repeats), measure(cfg, prompts, self.repeats)

    def baseline(self, config: EngineConfig, measure: Measure, dev: list[list[int]]) -> Verdict:
        """Round 0: the starting config must itself be lossless (and under the ceiling). Its figures are for the
        report; later trials are judged against the reference measured next to them, not against these."""
        with self.lease:
            d, h = measure(config, dev, self.repeats), measure(config, self.heldout, self.repeats)
        v = Verdict(False, self.forcing(d, "dev") + self.forcing(h, "heldout"),
                    figures={"dev": d.stats(), "heldout": h.stats(), "gain_dev": 1.0, "gain_heldout": 1.0})
        r, v.notes = self.ceiling(config, d, "dev", v.figures)
        v.reasons += r
        v.passed = not v.reasons
        return v

    def judge(self, config: EngineConfig, measure: Measure, ref_config: EngineConfig, ref_measure: Measure,
              dev: list[list[int]]) -> Verdict:
        """Is `config` (run by `measure`) better than `ref_config` (run by `ref_measure`), both measured now?

        Paired: each split measures the reference and then the candidate, R repeats each, so a machine that got
        slower or faster since the reference was first measured biases neither. Gains are ratios of medians.
        """
        ref, cand = self._pair(ref_config, ref_measure, config, measure, dev)
        v = Verdict(False, figures={"dev": cand.stats(), "ref_dev": ref.stats()})
        if cand.config:
            v.figures["measured_config"] = cand.config
        v.reasons += self.forcing(cand, "dev")
        r, v.notes = self.ceiling(config, cand, "dev", v.figures)
        v.reasons += r
        r, v.figures["gain_dev"] = self.beats(v.figures["dev"], v.figures["ref_dev"], "dev")
        v.reasons += r
        if v.reasons:
            return v
        ref_h, held = self._pair(ref_config, ref_measure, config, measure, self.heldout)
        v.figures.update(heldout=held.stats(), ref_heldout=ref_h.stats())
        v.reasons += self.forcing(held, "heldout")
        v.reasons += self.ceiling(config, held, "heldout", v.figures)[0]
        r, v.figures["gain_heldout"] = self.beats(v.figures["heldout"], v.figures["ref_heldout"], "heldout")
        v.reasons += r
        v.passed = not v.reasons
        return v
