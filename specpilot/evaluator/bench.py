"""`specpilot bench`: decode the same prompts with AR and with the speculative system, time both, gate with forcing.

Per benchmark it reports tau (tokens committed per target forward), per-position acceptance rates, tokens/s of
each system, the speedup, and the token-forcing verdict over every speculative output token. Timing: each system
is warmed up once, then every prompt is generated once per system, AR and speculative interleaved so drift hits
both alike; tokens/s = output tokens / (prefill + decode wall time), synchronized on GPU.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.engine import Engine, GenerationResult
from specpilot.evaluator.datasets import Prompt
from specpilot.evaluator.forcing import LogitsFn, force, merge
from specpilot.tokenizer import Tokenizer


@dataclass
class BenchmarkReport:
    benchmark: str
    num_prompts: int
    tau: float
    acceptance_by_position: list[float]  # P(draft token i accepted | drafted and tokens before it accepted)
    ar_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    ar_tokens: int
    spec_tokens: int
    outputs_equal_ar: int  # prompts whose speculative output equals AR's exactly (greedy: should be all)
    forcing: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def acceptance_by_position(results: list[GenerationResult]) -> list[float]:
    reached, accepted = {}, {}
    for r in results:
        for drafted, acc in zip(r.drafted_lengths, r.accepted_lengths):
            for i in range(drafted):
                if i > acc:
                    break
                reached[i] = reached.get(i, 0) + 1
                accepted[i] = accepted.get(i, 0) + (i < acc)
    return [round(accepted[i] / reached[i], 4) for i in sorted(reached)]


def run_benchmark(
    name: str,
    prompts: list[Prompt],
    tokenizer: Tokenizer,
    ar: Engine,
    spec: Engine,
    scorer: LogitsFn,
    *,
    tolerance: float,
    progress=None,
) -> tuple[BenchmarkReport, list[dict]]:
    encoded = [tokenizer.encode_chat(p.messages) for p in prompts]
    ar.generate(encoded[0][:32])  # warm-up: first-call allocations stay out of the numbers
    spec.generate(encoded[0][:32])
    ar_res, spec_res, verdicts, records = [], [], [], []
    for p, ids in zip(prompts, encoded):
        a = ar.generate(ids)
        s = spec.generate(ids)
        v = force(scorer, ids, s.output_ids, tolerance)
        ar_res.append(a), spec_res.append(s), verdicts.append(v)
        records.append({
            "id": p.id, "category": p.category, "prompt_tokens": len(ids),
            "ar_tokens": a.num_output_tokens, "spec_tokens": s.num_output_tokens,
            "ar_s": a.elapsed_s, "spec_s": s.elapsed_s, "tau": s.tau, "equal_ar": a.output_ids == s.output_ids,
            "forcing_passed": v.passed, "forcing_mismatches": [m.__dict__ for m in v.mismatches],
            "output": tokenizer.decode(s.output_ids, skip_special_tokens=True),
        })
        if progress:
            progress()
    ar_tok, spec_tok = sum(r.num_output_tokens for r in ar_res), sum(r.num_output_tokens for r in spec_res)
    ar_tps = ar_tok / sum(r.elapsed_s for r in ar_res)
    spec_tps = spec_tok / sum(r.elapsed_s for r in spec_res)
    report = BenchmarkReport(
        benchmark=name,
        num_prompts=len(prompts),
        tau=round(spec_tok / max(sum(r.num_target_forwards for r in spec_res), 1), 4),
        acceptance_by_position=acceptance_by_position(spec_res),
        ar_tokens_per_s=round(ar_tps, 3),
        spec_tokens_per_s=round(spec_tps, 3),
        speedup=round(spec_tps / ar_tps, 4),
        ar_tokens=ar_tok,
        spec_tokens=spec_tok,
        outputs_equal_ar=sum(r["equal_ar"] for r in records),
        forcing=merge(verdicts),
    )
    return report, records


def summarize(reports: list[BenchmarkReport], meta: dict) -> dict:
    """The run's one JSON object: pooled figures over all benchmarks, plus each benchmark's."""
    ar_tok = sum(r.ar_tokens for r in reports)
    spec_tok = sum(r.spec_tokens for r in reports)
    ar_s = sum(r.ar_tokens / r.ar_tokens_per_s for r in reports)
    spec_s = sum(r.spec_tokens / r.spec_tokens_per_s for r in reports)
    forwards = sum(r.spec_tokens / r.tau for r in reports)
    return {
        "tau": round(spec_tok / forwards, 4),
        "speedup": round((spec_tok / spec_s) / (ar_tok / ar_s), 4),
        "ar_tokens_per_s": round(ar_tok / ar_s, 3),
        "spec_tokens_per_s": round(spec_tok / spec_s, 3),
        "forcing_passed": all(r.forcing["forcing_passed"] for r in reports),
        "forcing_mismatches": sum(r.forcing["forcing_mismatches"] for r in reports),
        "forcing_failures": sum(r.forcing["forcing_failures"] for r in reports),
        "benchmarks": {r.benchmark: r.to_dict() for r in reports},
        **meta,
    }


def write_results(path: Path, summary: dict, records: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary, "prompts": records, "written": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
