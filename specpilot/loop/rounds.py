"""The optimization loop: measure, diagnose, explore, gate, integrate, remember — round after round.

Round 0 measures the starting config (it must pass forcing itself). Every later trial is measured next to its
reference — the current best, or for a combination the best single winner — and its gain is the ratio of the two;
speedups over round 0 are products of such paired gains. Each later round
  diagnose   ranks the cost model's stages by gap (measured - floor) when a profile function is given, else a
             fixed stage order;
  choose     directions: mechanisms that worked on similar deployments first, then those the cost model predicts
             to gain most (`estimate_fn`, costmodel/whatif.py), then by the rank of the stage they target;
             mechanisms that only failed there are skipped; mechanisms with nothing left to try drop out. Each
             direction proposes its values in the same order, at most `Budget.per_direction` per round.
             Round 1 of a deployment with such knowledge tries the remembered winning deltas together first;
  explore    the chosen explorers in parallel (timed runs serialized by the device lease), each trial gated;
  integrate  the best winner per mechanism; where two or more mechanisms won with disjoint fields, their deltas
             are combined, measured, and the combination is kept only if it passes the gate against the best
             single winner; otherwise the best single winner is adopted;
  remember   adopted deltas (and later, mechanisms that never won) go to memory for other deployments.
The run stops at the round, trial or wall-clock budget, or when no direction is left.

Yardsticks: right after round 0, each given system (the CLI gives our AR and the stock system) is timed once on
the dev prompts and remembered with the run; a round's best is then stated against each as
chain x round-0 tokens/s / yardstick tokens/s — the paired-gain yardstick anchored where both were measured together.

Resume: every decision is a function of finished trials, so `resume_run=id` replays the run; a trial whose key is
in memory is read back instead of measured, and the loop continues where the killed run stopped.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specpilot.config import EngineConfig
from specpilot.errors import ConfigError, SpecPilotError
from specpilot.loop.explore import (Candidate, Explorer, FixedExplorer, Measure, MechanismExplorer, View, delta_key,
                                    estimate_rank, explore, trial_key)
from specpilot.loop.gate import Gate
from specpilot.loop.memory import Knowledge, Memory, Trial
from specpilot.loop.registry import REGISTRY, Deployment, Mechanism, applicable, config_delta

FIXED_ORDER = ("verify", "draft", "other", "accept")  # no profile: the usual order of step time on a GPU
PSEUDO = ("baseline", "combine", "transfer")  # trial kinds that are not registry mechanisms
ProfileFn = Callable[[EngineConfig, dict], object]  # (config, dev stats) -> CostReport | [GapRow-like] | None
EstimateFn = Callable[[EngineConfig, dict, EngineConfig], "float | None"]  # (config, dev stats, candidate) -> gain
Yardstick = Callable[[], dict]  # () -> {"tokens_per_s": float, ...details}: one reference system timed on the dev set


class GateFailure(SpecPilotError):
    """The starting config itself does not pass token forcing: nothing can be judged against it."""


@dataclass(frozen=True)
class Budget:
    rounds: int = 3
    trials: int = 40  # gated trials, round 0 included
    wall_s: float = 3600.0
    directions: int = 3  # mechanism explorers per round (agent explorers come on top)
    workers: int = 2  # explorer threads
    per_direction: int = 0  # candidate values per direction per round (0: all)


@dataclass
class RunResult:
    run_id: int
    baseline: Trial
    best: Trial
    trials: list[Trial]
    rounds: int
    stopped: str
    yardsticks: dict = field(default_factory=dict)  # name -> {"tokens_per_s", ...}: systems timed next to round 0

    def versus(self, name: str, chain: float | None = None) -> float | None:
        """Speedup of the best config (or of `chain`) over yardstick `name`, in the paired-gain yardstick."""
        y = self.yardsticks.get(name, {}).get("tokens_per_s")
        if not y:
            return None
        return (self.best.chain if chain is None else chain) * self.baseline.median / y

    @property
    def best_config(self) -> EngineConfig:
        return EngineConfig.from_dict(self.best.config)

    @property
    def speedup(self) -> float:
        """Dev speedup over round 0 as the product of paired gains (immune to drift between rounds)."""
        return self.best.chain

    @property
    def trials_to_best(self) -> int:
        """Trials run (round 0 excluded) up to the end of the round that found the final best."""
        return sum(1 for t in self.trials if 0 < t.round <= self.best.round)

    def summary(self) -> dict:
        tried = [t for t in self.trials if t.round > 0]
        rejected = [t for t in tried if not t.passed]
        held = self.best.figures.get("chain_heldout")
        return {
            "run": self.run_id, "rounds": self.rounds, "stopped": self.stopped,
            "best_config": config_delta(EngineConfig.from_dict(self.baseline.config), self.best_config),
            "speedup_vs_round0": round(self.speedup, 4),
            "heldout_speedup_vs_round0": round(held, 4) if held else None,
            "round0_tokens_per_s": round(self.baseline.median, 3), "best_tokens_per_s": round(self.best.median, 3),
            "trials": {"tried": len(tried), "accepted": len(tried) - len(rejected), "rejected": len(rejected),
                       "reasons": dict(Counter(t.reason.split(":", 1)[0] for t in rejected)),
                       "to_best": self.trials_to_best},  # memory transfer is judged on this count
            **{f"{n}_tokens_per_s": round(y["tokens_per_s"], 3) for n, y in self.yardsticks.items()},
            **{f"speedup_vs_{n}": round(self.versus(n), 4) for n in self.yardsticks if self.versus(n)},
        }


def diagnose(profile_fn: ProfileFn | None, cfg: EngineConfig, dev_stats: dict) -> tuple[list[dict], str]:
    """Stages ranked by gap, largest first: [{"stage", "measured_s", "floor_s", "gap_s"}], and a note."""
    report = profile_fn(cfg, dev_stats) if profile_fn else None
    if report is None:
        return [{"stage": s, "measured_s": None, "floor_s": None, "gap_s": None} for s in FIXED_ORDER], \
            "no profile: fixed stage order"
    rows = [{"stage": r.stage, "measured_s": r.measured_s, "floor_s": r.floor_s, "gap_s": r.gap_s}
            for r in getattr(report, "gaps", report)]
    rows.sort(key=lambda r: -r["gap_s"])
    if not hasattr(report, "gaps"):
        return rows, "measured stage times (no floors on this device: ranked by time)"
    return rows, f"cost model: ceiling speedup x{report.ceiling_speedup:.2f}"


def choose(dep: Deployment, view: View, knowledge: Knowledge, registry: dict[str, Mechanism],
           skip_failed: bool = True, per_direction: int = 0) -> list[MechanismExplorer]:
    """Applicable mechanisms with something left to try: worked elsewhere first (by gain), then by the cost
    model's best predicted gain among their values, then by stage gap."""
    rank = {r["stage"]: i for i, r in enumerate(view.gaps)}
    worked = {m: (d, g) for m, d, g in knowledge.worked}
    order = list(registry)
    mechs = [m for m in applicable(dep, view.best_config, registry)
             if not (skip_failed and m.name in knowledge.failed and m.name not in worked)]
    mechs.sort(key=lambda m: (m.name not in worked, -worked.get(m.name, ({}, 0.0))[1],
                              estimate_rank(_best_estimate(view, m.name)),
                              min(rank.get(s, len(rank)) for s in m.gap_stages), order.index(m.name)))
    explorers = [MechanismExplorer(m, [worked[m.name][0]] if m.name in worked else [], per_direction) for m in mechs]
    return [e for e in explorers if e.propose(view)]


def estimates(estimate_fn: EstimateFn | None, dep: Deployment, cfg: EngineConfig, stats: dict,
              registry: dict[str, Mechanism]) -> dict[str, dict]:
    """mechanism -> {delta_key: predicted gain} for every candidate value the cost model can price."""
    if estimate_fn is None:
        return {}
    out: dict[str, dict] = {}
    for m in applicable(dep, cfg, registry):
        for d in m.candidates(cfg, dep):
            try:
                gain = estimate_fn(cfg, stats, cfg.with_(**d))
            except (ConfigError, ValueError, ZeroDivisionError):  # an unpriceable shape: ordered as unknown
                gain = None
            if gain is not None:
                out.setdefault(m.name, {})[delta_key(d)] = gain
    return out


def _best_estimate(view: View, mechanism: str) -> float | None:
    """The largest predicted gain among a mechanism's values this round (None: none priced)."""
    return max(view.estimates.get(mechanism, {}).values(), default=None)


def _direction(explorer: Explorer, view: View) -> str:
    gain = _best_estimate(view, explorer.name)
    return explorer.name + ("" if gain is None else f" (predicted x{gain:.2f})")


def _merge(deltas: Sequence[dict]) -> dict:
    """Union of deltas in order, skipping any whose fields collide with those already taken."""
    out: dict = {}
    for d in deltas:
        if d and not set(d) & set(out):
            out.update(d)
    return out


def _transferable(knowledge: Knowledge, dep: Deployment, cfg: EngineConfig, registry) -> list[dict]:
    """Remembered deltas of registry mechanisms that apply here and whose values this deployment can run."""
    return [d for m, d, _ in knowledge.worked
            if m in registry and registry[m].applies(dep, cfg) and registry[m].valid(dep, d)]


def _by_mechanism(delta: dict, registry: dict[str, Mechanism]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for k, v in delta.items():
        owner = next((m.name for m in registry.values() if k in m.fields), None)
        if owner:
            out.setdefault(owner, {})[k] = v
    return out


def optimize(deployment: Deployment, budget: Budget, memory: Memory, measure: Measure,
             profile_fn: ProfileFn | None = None, *, dev: list[list[int]], gate: Gate,
             registry: dict[str, Mechanism] | None = None, extra: Sequence[Callable[[View], Explorer]] = (),
             resume_run: int | None = None, use_ray: bool = False, skip_failed: bool = True,
             progress: Callable[[str], None] | None = None,
             yardsticks: dict[str, Yardstick] | None = None, estimate_fn: EstimateFn | None = None) -> RunResult:
    reg = REGISTRY if registry is None else registry
    say = progress or (lambda msg: None)
    if resume_run is not None:
        info = memory.run_info(resume_run)
        if info is None or info["deployment"] != memory.deployment(deployment):
            raise ConfigError(f"run {resume_run} does not exist for this deployment (target, drafter, device, regime)")
        run = resume_run
        deployment = Deployment(deployment.target, deployment.drafter, EngineConfig.from_dict(info["base_config"]),
                                deployment.device_name, deployment.family)
        memory.set_run_status(run, "running")
    else:
        run = memory.new_run(deployment)
    knowledge = memory.validated_for(deployment, exclude_run=run)
    t0, lock = time.monotonic(), threading.Lock()
    started = [len(memory.finished_trials(run))]

    def run_trial(cand: Candidate, rnd: int, reference: Trial | None) -> Trial | None:
        """Gate `cand` against `reference` (None: round 0), record it; a trial found in memory is returned as is."""
        found = memory.find_trial(run, cand.key)
        if found is not None:
            return found
        with lock:
            if reference is not None and (started[0] >= budget.trials or time.monotonic() - t0 > budget.wall_s):
                return None
            started[0] += 1
        figures = dict(cand.extra)
        if cand.rejected:
            verdict, reason, cfg = "rejected", cand.rejected, cand.config.to_dict()
        else:
            m = cand.measure or measure
            try:
                v = gate.baseline(cand.config, m, dev) if reference is None else \
                    gate.judge(cand.config, m, EngineConfig.from_dict(reference.config), measure, dev)
            except Exception as e:  # a config the engine cannot run (OOM, no kernel): rejected, not fatal
                if reference is None:
                    raise
                verdict, reason, cfg = "rejected", f"error: {type(e).__name__}: {str(e)[:300]}", cand.config.to_dict()
            else:
                figures.update(v.figures, notes=v.notes)
                ref_chain = (reference.chain, reference.figures.get("chain_heldout")) if reference else (1.0, 1.0)
                figures["chain"] = ref_chain[0] * v.figures["gain_dev"]
                if "gain_heldout" in v.figures and ref_chain[1]:
                    figures["chain_heldout"] = ref_chain[1] * v.figures["gain_heldout"]
                cfg = v.figures.get("measured_config") or cand.config.to_dict()
                verdict = ("baseline" if reference is None else "accepted") if v.passed else "rejected"
                reason = v.reason
        t = memory.record_trial(run, rnd, cand.key, cand.mechanism, cfg, cand.delta, figures, verdict, reason)
        say(f"round {rnd} {cand.mechanism} {cand.delta}: {verdict} x{t.gain:.3f} vs reference {reason}".rstrip())
        return t

    base = run_trial(Candidate("baseline", {}, deployment.config, trial_key(0, "baseline", {})), 0, None)
    if not base.passed:
        memory.set_run_status(run, "failed")
        raise GateFailure(f"the starting config fails the gate: {base.reason}")
    memory.adopt(base.id)
    known = memory.yardsticks(run)
    for name, fn in (yardsticks or {}).items():
        if name in known:  # resumed: measured before the kill
            continue
        try:
            y = fn()
        except Exception as e:  # a missing stock package must not stop the search: the report says so
            say(f"yardstick {name}: not measured ({type(e).__name__}: {str(e)[:200]})")
            continue
        memory.record_yardstick(run, name, float(y["tokens_per_s"]), {k: v for k, v in y.items() if k != "tokens_per_s"})
        say(f"yardstick {name}: {y['tokens_per_s']:.3f} tok/s (round 0: {base.median:.3f})")
    best, tried, won = base, {json.dumps(base.config, sort_keys=True)}, {}
    rounds_done, stopped = 0, "round budget spent"
    for rnd in range(1, budget.rounds + 1):
        if started[0] >= budget.trials or time.monotonic() - t0 > budget.wall_s:
            stopped = "trial or wall-clock budget spent"
            break
        best_cfg = EngineConfig.from_dict(best.config)
        gaps, note = diagnose(profile_fn, best_cfg, best.figures["dev"])
        memory.record_round(run, rnd, gaps, note)
        view = View(deployment, rnd, best_cfg, best.figures, gaps, knowledge, frozenset(tried),
                    estimates(estimate_fn, deployment, best_cfg, best.figures["dev"], reg))
        explorers: list[Explorer] = []
        if rnd == 1 and knowledge.worked:
            warm = FixedExplorer("transfer", [_merge(_transferable(knowledge, deployment, best_cfg, reg))])
            explorers = [warm] if warm.propose(view) else []
        if not explorers:
            explorers = choose(deployment, view, knowledge, reg, skip_failed, budget.per_direction)[:budget.directions]
            explorers += [make(view) for make in extra]
        if not explorers:
            stopped = "no direction left to explore"
            break
        say(f"round {rnd}: {note}; directions: {', '.join(_direction(e, view) for e in explorers)}")
        trials = explore(explorers, view, lambda c: run_trial(c, rnd, best),
                         lambda k: memory.find_trial(run, k), workers=budget.workers, use_ray=use_ray)
        rounds_done = rnd
        for t in trials:
            tried.add(json.dumps(t.config, sort_keys=True))
            won[t.mechanism] = won.get(t.mechanism, False) or t.passed
        winners = [t for t in trials if t.passed]
        if not winners:
            continue
        new, used = _integrate(winners, best_cfg, rnd, run_trial)
        memory.adopt(new.id)
        for t in used:
            delta = config_delta(best_cfg, EngineConfig.from_dict(t.config))
            parts = _by_mechanism(delta, reg) if t.mechanism in PSEUDO else {t.mechanism: delta}
            for mech, d in parts.items():
                memory.validate(run, deployment, mech, d, t.chain / best.chain, ok=True)
        say(f"round {rnd}: adopted {new.mechanism} {config_delta(best_cfg, EngineConfig.from_dict(new.config))} "
            f"x{new.chain:.3f} vs round 0")
        best = new
    for mech, ok in won.items():
        if not ok and mech not in PSEUDO:
            memory.validate(run, deployment, mech, {}, 0.0, ok=False)
    memory.set_run_status(run, "finished")
    return RunResult(run, base, best, memory.finished_trials(run), rounds_done, stopped, memory.yardsticks(run))


def _integrate(winners: list[Trial], best_cfg: EngineConfig, rnd: int, run_trial) -> tuple[Trial, list[Trial]]:
    """Best single winner, or the combination of all mechanisms' winners if it beats that winner at the gate."""
    per: dict[str, Trial] = {}
    for t in winners:
        if t.mechanism not in per or t.gain > per[t.mechanism].gain:
            per[t.mechanism] = t
    ranked = sorted(per.values(), key=lambda t: -t.gain)  # one reference for all of a round: gains compare
    single = ranked[0]
    delta: dict = {}
    used = []
    for t in ranked:  # best first; a winner whose fields collide with a better one's stays out
        d = config_delta(best_cfg, EngineConfig.from_dict(t.config))
        if d and not set(d) & set(delta):
            delta.update(d)
            used.append(t)
    if len(used) < 2:
        return single, [single]
    try:
        cfg = EngineConfig.from_dict({**best_cfg.to_dict(), **delta})
    except (ConfigError, TypeError):
        return single, [single]
    combo = run_trial(Candidate("combine", delta, cfg, trial_key(rnd, "combine", delta)), rnd, single)
    if combo is not None and combo.passed:
        return combo, used
    return single, [single]
