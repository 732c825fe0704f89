"""`specpilot bench`: decode the same prompts with several systems, time them, gate every output with forcing.

Systems: `ar` (our AR, the denominator of every speedup), `specpilot` (our speculative engine), and where asked
`hf-ar` (transformers' generate) and `stock` (the released speculative system for the same drafter). Per benchmark
it reports tau (tokens committed per target forward), per-position acceptance, tokens/s of each system, speedups
over our AR and over stock (on the prompts both ran), and the token-forcing verdict over every output token.
Timing: each system is warmed up once on the benchmark's longest prompt; then prompt by prompt every system
generates once (interleaved, so drift hits all alike; the order rotates from prompt to prompt, so no system always
meets a new prompt shape first); tokens/s = output tokens / (prefill + decode wall time), synchronized on GPU. A
system may be limited to the first N prompts (slow peers); its comparisons then use only those prompts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from specpilot.engine.result import GenerationResult
from specpilot.evaluator.datasets import Prompt
from specpilot.evaluator.forcing import LogitsFn, force, merge

SYSTEMS = ("ar", "hf-ar", "stock", "specpilot")
Generate = Callable[[list[int]], GenerationResult]


def acceptance_by_position(results: list[GenerationResult]) -> list[float]:
    """P(draft token i accepted | it was drafted and every token before it accepted), i = 0..K-1."""
    return acceptance_by_steps([d for r in results for d in r.drafted_lengths],
                               [a for r in results for a in r.accepted_lengths])


def acceptance_by_steps(drafted: list[int], accepted: list[int]) -> list[float]:
    """acceptance_by_position over steps given as (drafted, accepted) lengths."""
    reached, acc_at = {}, {}
    for d, a in zip(drafted, accepted):
        for i in range(min(d, a + 1)):
            reached[i] = reached.get(i, 0) + 1
            acc_at[i] = acc_at.get(i, 0) + (i < a)
    return [round(acc_at[i] / reached[i], 4) for i in sorted(reached)]


def _tps(results: list[GenerationResult]) -> float:
    secs = sum(r.elapsed_s for r in results)
    return sum(r.num_output_tokens for r in results) / secs if secs > 0 else 0.0


def run_benchmark(
    name: str,
    prompts: list[Prompt],
    encode: Callable[[Prompt], list[int]],
    systems: dict[str, Generate],
    scorer: LogitsFn,
    *,
    tolerance: float,
    limits: dict[str, int] | None = None,
    progress=None,
    max_prompt_tokens: int | None = None,
    deadline: float | None = None,
    checkpoint: Callable[[dict, list[dict]], None] | None = None,
) -> tuple[dict, list[dict]]:
    """Every system on every prompt (rotating which meets a prompt first), each output token-forced against the
    scorer -> (the benchmark's report, one record per prompt). deadline (a time.monotonic() value): no prompt
    starts after it, the first always runs, and the report then says `stopped_by_time_budget` and counts only the
    prompts run. checkpoint(report, records) after each prompt: a run killed later keeps what it measured."""
    limits = limits or {}
    encoded = [encode(p) for p in prompts]
    skipped = 0
    if max_prompt_tokens is not None:  # a prompt the KV pool cannot hold is left out (and counted), not fatal
        kept = [(p, ids) for p, ids in zip(prompts, encoded) if len(ids) <= max_prompt_tokens]
        skipped = len(prompts) - len(kept)
        if not kept:
            from specpilot.errors import DatasetError

            raise DatasetError(f"{name}: all {len(prompts)} prompts exceed {max_prompt_tokens} tokens "
                               "(raise --max-seq-len)")
        prompts, encoded = [p for p, _ in kept], [ids for _, ids in kept]
    warmup_s = {}
    for s, gen in systems.items():
        # warm-up on a real prompt at full length: first-call allocations, graph capture and the peers' own
        # compilation (transformers compiles static-cache decoding on first use) stay out of the numbers; its
        # seconds are reported (a run's fixed cost: what a --time-budget must leave room for). The longest prompt:
        # transformers sizes its static cache by prompt + new tokens and grows it (recompiling the decode step,
        # ~40 s on the H200) whenever a longer prompt comes; warmed on the first prompt, its AR stalled at 5-7
        # tok/s on exactly the prompts longer than every earlier one (BENCHMARKS.md, session 25)
        t0 = time.monotonic()
        gen(max(encoded, key=len))
        warmup_s[s] = round(time.monotonic() - t0, 2)
    results = {s: [] for s in systems}
    verdicts = {s: [] for s in systems}
    records = []
    names = list(systems)
    stopped = False
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        if deadline is not None and i > 0 and time.monotonic() >= deadline:
            stopped = True
            break
        rec = {"id": p.id, "category": p.category, "prompt_tokens": len(ids)}
        # the order rotates by prompt: the first system to meet a new prompt length pays its new prefill shapes
        # (kernel choices, attention plans) for every system sharing the target model (ours share it)
        for s in names[i % len(names):] + names[:i % len(names)]:
            gen = systems[s]
            if i >= limits.get(s, len(prompts)):
                continue
            r = gen(ids)
            v = force(scorer, ids, r.output_ids, tolerance)
            results[s].append(r)
            verdicts[s].append(v)
            rec[s] = {"tokens": r.num_output_tokens, "s": round(r.elapsed_s, 5), "prefill_s": round(r.prefill_s, 5),
                      "stage_s": {k: round(x, 5) for k, x in r.stage_s.items()}, "forcing_passed": v.passed,
                      "mismatches": [m.__dict__ for m in v.mismatches], "failures": [m.__dict__ for m in v.failures],
                      "output_ids": r.output_ids}
            if r.num_target_forwards:  # what evaluator/bench_merge.py needs to pool this prompt with another run's
                rec[s].update(tau=round(r.tau, 4), forwards=r.num_target_forwards, accepted=r.accepted_lengths,
                              drafted=r.drafted_lengths)
            if r.plain_steps:
                rec[s]["plain_steps"] = r.plain_steps
        records.append(rec)
        if progress:
            progress()
        if checkpoint:
            checkpoint({**_report(name, len(records), skipped, results, verdicts), "warmup_s": warmup_s}, records)
    report = _report(name, len(records), skipped, results, verdicts)
    report["warmup_s"] = warmup_s
    if stopped:
        report["stopped_by_time_budget"] = True
    return report, records


def _report(name: str, num_prompts: int, skipped: int, results: dict, verdicts: dict) -> dict:
    """One benchmark's figures from the outputs so far: per system tokens/s, speedup over our AR on the same
    prompts, forcing verdicts, where the time went; tau and speedup over stock for the speculative ones."""
    ar_out = [r.output_ids for r in results["ar"]]
    report = {"benchmark": name, "num_prompts": num_prompts, "skipped_long_prompts": skipped, "systems": {}}
    for s, rs in results.items():
        n = len(rs)
        entry = {
            "prompts": n,
            "tokens": sum(r.num_output_tokens for r in rs),
            "tokens_per_s": round(_tps(rs), 3),
            "speedup_vs_ar": round(_tps(rs) / _tps(results["ar"][:n]), 4),
            "outputs_equal_ar": sum(r.output_ids == a for r, a in zip(rs, ar_out)),
            **merge(verdicts[s]),
            # where the time went (session 14 found 35-135 ms a prompt outside the decode steps): the prefill, and
            # for speculative systems the engine's stages per step (device time, from StageTimer)
            "prefill_ms_per_prompt": round(1e3 * sum(r.prefill_s for r in rs) / max(n, 1), 3),
        }
        steps = sum(len(r.accepted_lengths) for r in rs)
        if steps:
            stages = {}
            for r in rs:
                for k, x in r.stage_s.items():
                    stages[k] = stages.get(k, 0.0) + x
            entry["stage_ms_per_step"] = {k: round(1e3 * x / steps, 4) for k, x in stages.items()}
            plain = sum(r.plain_steps for r in rs)
            if plain:  # EngineConfig.adaptive: steps that drafted nothing by choice, and tau over the others
                entry["plain_step_share"] = round(plain / steps, 4)
                entry["tau_speculative_steps"] = round((entry["tokens"] - plain) / max(steps - plain, 1), 4)
        if any(r.num_target_forwards for r in rs) and s != "ar":
            forwards = sum(r.num_target_forwards for r in rs)
            entry["tau"] = round(entry["tokens"] / forwards, 4)
            entry["acceptance_by_position"] = acceptance_by_position(rs)
            if entry["speedup_vs_ar"] > 0:  # what one step costs in our AR's steps = the tau it needs to break even
                entry["step_cost_ar_steps"] = round(entry["tau"] / entry["speedup_vs_ar"], 3)
        report["systems"][s] = entry
    spec = report["systems"]["specpilot"]
    report.update(
        tau=spec.get("tau", 1.0), acceptance_by_position=spec.get("acceptance_by_position", []),
        ar_tokens_per_s=report["systems"]["ar"]["tokens_per_s"], spec_tokens_per_s=spec["tokens_per_s"],
        speedup=spec["speedup_vs_ar"], forcing={k: spec[k] for k in spec if k.startswith("forcing")},
    )
    if "stock" in results and results["stock"]:
        n = len(results["stock"])
        report["speedup_vs_stock"] = round(_tps(results["specpilot"][:n]) / _tps(results["stock"]), 4)
    return report


def summarize(reports: list[dict], meta: dict) -> dict:
    """The run's one JSON object: figures pooled over all benchmarks (by tokens and seconds), plus each one's."""
    def pooled(system, key="tokens_per_s"):
        tok = sum(r["systems"][system]["tokens"] for r in reports if system in r["systems"])
        secs = sum(r["systems"][system]["tokens"] / r["systems"][system][key] for r in reports
                   if system in r["systems"] and r["systems"][system][key] > 0)
        return tok / secs if secs else 0.0

    spec_tok = sum(r["systems"]["specpilot"]["tokens"] for r in reports)
    forwards = sum(r["systems"]["specpilot"]["tokens"] / r["tau"] for r in reports)
    out = {
        "tau": round(spec_tok / forwards, 4) if forwards else 0.0,
        "speedup": round(pooled("specpilot") / pooled("ar"), 4),
        "ar_tokens_per_s": round(pooled("ar"), 3),
        "spec_tokens_per_s": round(pooled("specpilot"), 3),
        "forcing_passed": all(r["systems"][s]["forcing_passed"] for r in reports for s in r["systems"]),
        "forcing_mismatches": sum(r["systems"][s]["forcing_mismatches"] for r in reports for s in r["systems"]),
        "forcing_failures": sum(r["systems"][s]["forcing_failures"] for r in reports for s in r["systems"]),
    }
    for s in ("hf-ar", "stock"):
        if all(s in r["systems"] for r in reports):
            out[f"{s.replace('-', '_')}_tokens_per_s"] = round(pooled(s), 3)
    if all("speedup_vs_stock" in r for r in reports):
        out["speedup_vs_stock"] = {r["benchmark"]: r["speedup_vs_stock"] for r in reports}
    out["benchmarks"] = {r["benchmark"]: r for r in reports}
    out.update(meta)
    return out


def write_results(path: Path, summary: dict, records: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"summary": summary, "prompts": records, "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.write_text(json.dumps(payload, indent=1))
