"""Explorers: one direction each, proposing candidate configs; trials: measure on dev, gate, remember.

`measure(config, prompts, repeats) -> Measurement` is the only way the loop learns how fast a config is; the CLI's
`EngineMeasure` times real engines, tests pass a deterministic fake. Explorers propose concurrently (a thread pool,
or Ray tasks) because proposing can be slow — a coding agent thinks for minutes — while trials run one at a time
on the loop's thread, and every timed run and every forcing pass holds the `GpuLease` of its device, so
measurements never overlap and one explorer's work cannot slow another's clock.

A trial is finished once it is gated and written to memory. Before doing anything, a trial (and a single-shot
explorer such as an agent) looks its key up in memory: a resumed run re-uses what was finished and redoes only
what was not.
"""

from __future__ import annotations

import json
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable

from specpilot.config import EngineConfig
from specpilot.errors import ConfigError
from specpilot.loop.registry import Deployment, Mechanism, config_delta


@dataclass
class Measurement:
    """What one measure() call saw: tokens/s of each repeat over all prompts, and the outputs (first repeat)."""

    samples: list[float]  # tokens/s per repeat: total output tokens / total (prefill + decode) seconds
    prompts: list[list[int]]
    outputs: list[list[int]]  # output ids per prompt
    tau: float = 1.0  # tokens committed per target forward
    stage_s: dict = field(default_factory=dict)  # mean seconds per speculative step, by stage
    context_len: int = 0  # mean tokens in the KV cache during decoding
    config: dict | None = None  # the config actually run, where it differs from the one asked for (agents)
    acceptance: list = field(default_factory=list)  # P(draft i accepted | drafts before it were), i = 0..K-1

    def stats(self) -> dict:
        return {"samples": [round(s, 4) for s in self.samples], "median": statistics.median(self.samples),
                "spread": max(self.samples) - min(self.samples), "tau": self.tau, "stage_s": self.stage_s,
                "context_len": self.context_len, "acceptance": [round(a, 4) for a in self.acceptance],
                "outputs": self.outputs}  # greedy outputs: what a model-free drafter's tau is replayed on


Measure = Callable[[EngineConfig, list[list[int]], int], Measurement]


class GpuLease:
    """One lock per device index (all of CPU counts as one device). `with GpuLease("cuda:1"): ...`"""

    _locks: dict[tuple[str, int], threading.Lock] = {}
    _guard = threading.Lock()

    def __init__(self, device: str = "cpu"):
        kind, _, idx = device.partition(":")
        key = ("cpu", 0) if kind == "cpu" else (kind, int(idx or 0))
        with GpuLease._guard:
            self.lock = GpuLease._locks.setdefault(key, threading.Lock())
        self.key = key

    def __enter__(self):
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def trial_key(round: int, mechanism: str, delta: dict) -> str:
    return f"{round}|{mechanism}|{json.dumps(delta, sort_keys=True)}"


@dataclass
class Candidate:
    mechanism: str
    delta: dict  # changes from the current best config
    config: EngineConfig
    key: str
    measure: Measure | None = None  # None: the loop's measure; agents bring their worktree's
    rejected: str = ""  # a reason found before any measurement (e.g. the diff touches the gate)
    extra: dict = field(default_factory=dict)  # recorded with the figures (e.g. the agent's patch)


@dataclass(frozen=True)
class View:
    """What an explorer is told: plain data, so a proposal can run in another process."""

    deployment: Deployment
    round: int
    best_config: EngineConfig
    best_figures: dict
    gaps: list  # [{"stage", "measured_s", "floor_s", "gap_s"}], largest gap first
    knowledge: object = None  # memory.Knowledge from similar deployments
    tried: frozenset = frozenset()  # JSON of every config already tried in this run
    estimates: dict = field(default_factory=dict)  # mechanism -> {delta_key(delta): cost-model predicted gain}


def delta_key(delta: dict) -> str:
    return json.dumps(delta, sort_keys=True)


def estimate_rank(gain: float | None) -> tuple[int, float]:
    """Sort key of a predicted gain: predicted wins (largest first), then unpredictable, then predicted losses."""
    if gain is None:
        return (1, 0.0)
    return (0, -gain) if gain > 1.0 else (2, -gain)


def config_json(cfg: EngineConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


class Explorer:
    name = "explorer"

    def key(self, view: View) -> str | None:
        """A key for explorers that make one expensive candidate per round (found in memory: skip proposing)."""
        return None

    def propose(self, view: View) -> list[Candidate]:
        raise NotImplementedError

    def close(self) -> None:
        """Called after the round's trials (e.g. to remove a worktree)."""


class MechanismExplorer(Explorer):
    """A registry mechanism's values applied to the current best, values that worked elsewhere first."""

    def __init__(self, mechanism: Mechanism, prefer: list[dict] = (), limit: int = 0):
        self.mechanism, self.name, self.prefer, self.limit = mechanism, mechanism.name, list(prefer), limit

    def propose(self, view: View) -> list[Candidate]:
        """Values that worked elsewhere first, then by the cost model's predicted gain (registry order where it has
        none); at most `limit` per round (0: all) — the rest stay for later rounds."""
        est = view.estimates.get(self.name, {})
        deltas = self.mechanism.candidates(view.best_config, view.deployment)
        deltas.sort(key=lambda d: (d not in self.prefer, estimate_rank(est.get(delta_key(d)))))  # stable
        out = []
        for d in deltas:
            cfg = view.best_config.with_(**d)
            if config_json(cfg) not in view.tried:
                gain = est.get(delta_key(d))
                out.append(Candidate(self.name, d, cfg, trial_key(view.round, self.name, d),
                                     extra={} if gain is None else {"predicted_gain": round(gain, 4)}))
        return out[: self.limit] if self.limit else out


class FixedExplorer(Explorer):
    """Given deltas, e.g. what memory says worked on similar deployments, tried as one candidate each."""

    def __init__(self, name: str, deltas: list[dict]):
        self.name, self.deltas = name, deltas

    def propose(self, view: View) -> list[Candidate]:
        out = []
        for d in self.deltas:
            try:
                cfg = view.best_config.with_(**d)
            except (ConfigError, TypeError):
                continue
            d = config_delta(view.best_config, cfg)
            if d and config_json(cfg) not in view.tried:
                out.append(Candidate(self.name, d, cfg, trial_key(view.round, self.name, d)))
        return out


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _proposals(explorers: list[Explorer], view: View, workers: int, use_ray: bool, skip: set[int]):
    """Yields (index, candidates) for each explorer as its proposal finishes."""
    todo = [(i, ex) for i, ex in enumerate(explorers) if i not in skip]
    if use_ray:
        if not ray_available():
            raise ConfigError("--ray: ray is not installed here (pip install ray); run without --ray")
        import ray

        ray.init(ignore_reinit_error=True, log_to_driver=False)
        task = ray.remote(num_cpus=1)(lambda ex, v: ex.propose(v))
        refs = {task.remote(ex, view): i for i, ex in todo}
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            yield refs.pop(done[0]), ray.get(done[0])
        return
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futs = {pool.submit(ex.propose, view): i for i, ex in todo}
        for f in as_completed(futs):
            yield futs[f], f.result()


def explore(explorers: list[Explorer], view: View, run_trial: Callable, find: Callable, *, workers: int = 2,
            use_ray: bool = False) -> list:
    """Propose in parallel; run each candidate's trial (measure, gate, remember) as its proposal arrives.

    Trials run one after another on the calling thread — the thread that measured round 0 — under the device
    lease (which also keeps concurrent loops in one process apart): timed runs never share the machine with each
    other, and every one runs on the same thread. `run_trial(candidate) -> Trial | None` (None: out of budget);
    `find(key) -> Trial | None` (memory). The result lists trials in explorer order, then proposal order.
    """
    results: dict[int, list] = {i: [] for i in range(len(explorers))}
    skip = set()
    for i, ex in enumerate(explorers):
        k = ex.key(view)
        found = find(k) if k else None
        if found is not None:
            results[i], _ = [found], skip.add(i)
    done = []
    try:
        for i, cands in _proposals(explorers, view, workers, use_ray, skip):
            done += [(i, j, run_trial(c)) for j, c in enumerate(cands)]
    finally:
        for ex in explorers:
            ex.close()
    for i, _, t in sorted(done, key=lambda x: (x[0], x[1])):
        if t is not None:
            results[i].append(t)
    return [t for i in range(len(explorers)) for t in results[i]]


def time_engine(generate, prompts, repeats, sync=None) -> dict:
    """Time `generate(prompt_ids) -> GenerationResult` on every prompt, `repeats` times, after one untimed pass over
    every prompt. Why every prompt: each new prompt length is a new prefill shape (library kernel choices, cuDNN
    attention plans), so a warm-up on one prompt left the first timed repeat slow, and the gate's noise (max - min of
    the repeats) read 15-25% on the H200 (session 10), more than most real gains.

    Self-contained on purpose (stdlib only, no imports from specpilot): the agent explorer copies this function's
    source into the driver that runs a candidate worktree's engine, so the clock is never the candidate's code.
    Tokens/s is wall-clock (synchronized by `sync`) around each generate call, summed over prompts.
    """
    import time as _time

    sync = sync or (lambda: None)
    for p in prompts:  # untimed: every prefill shape and the decode path seen once
        generate(list(p))
    samples, first = [], None
    for _ in range(repeats):
        results, secs = [], 0.0
        for p in prompts:
            sync()
            t0 = _time.perf_counter()
            results.append(generate(list(p)))
            sync()
            secs += _time.perf_counter() - t0
        samples.append(sum(len(r.output_ids) for r in results) / secs if secs > 0 else 0.0)
        first = first or results
    steps = sum(len(r.accepted_lengths) for r in first)
    stage: dict = {}
    for r in first:
        for k, v in (r.stage_s or {}).items():
            stage[k] = stage.get(k, 0.0) + v
    tokens = sum(len(r.output_ids) for r in first)
    forwards = sum(r.num_target_forwards for r in first)
    # per draft position: steps that reached it, and of those, steps that accepted it (evaluator/bench.py's
    # acceptance_by_position, written out here because this function must stay stdlib-only)
    reached, hit = {}, {}
    for r in first:
        for drafted, acc in zip(r.drafted_lengths, r.accepted_lengths):
            for i in range(min(drafted, acc + 1)):
                reached[i] = reached.get(i, 0) + 1
                hit[i] = hit.get(i, 0) + (i < acc)
    return {"samples": samples, "outputs": [list(r.output_ids) for r in first],
            "tau": tokens / forwards if forwards else 1.0,
            "stage_s": {k: v / steps for k, v in stage.items()} if steps else {},
            "acceptance": [hit[i] / reached[i] for i in sorted(reached)],
            "context_len": int(sum(len(p) + len(r.output_ids) / 2 for p, r in zip(prompts, first)) / len(first))}
