"""`specpilot bench-merge`: one benchmark result from several `specpilot bench` runs over disjoint prompts.

Why: a run that a time limit cuts (a GPU call's 10 minutes, `--time-budget`) keeps the prompts it measured; a second
run with `--skip-prompts N` measures the rest, and this pools them into the figures one long run would report. Every
figure is recomputed from the per-prompt records (tokens, seconds, forcing verdicts, target forwards), never from
the runs' own summaries, so the pooled tokens/s is total tokens over total seconds, as in one run. What a merge
cannot recover it leaves out and says so: acceptance by position needs the per-step lengths, which runs before this
module did not record. Runs of different targets, drafters or engine configs are refused, and so are prompts that
appear twice. A config field one run lacks (added to EngineConfig after it ran) counts as agreeing when the other
run has it at its default: a mechanism lands switched off, so its default is what the older code did.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specpilot.config import EngineConfig
from specpilot.engine.result import GenerationResult
from specpilot.errors import DatasetError
from specpilot.evaluator.bench import SYSTEMS, _report, summarize
from specpilot.evaluator.forcing import ForcingVerdict, Mismatch

# what must agree for two runs to be one measurement (their figures are pooled)
SAME_KEYS = ("target", "drafter", "config")


def _load(path: str | Path) -> dict:
    try:
        payload = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DatasetError(f"bench-merge: no such file {path}") from None
    except IsADirectoryError:
        raise DatasetError(f"bench-merge: {path} is a folder; pass the results file `specpilot bench --out` "
                           "wrote") from None
    except OSError as e:
        raise DatasetError(f"bench-merge: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # not JSON, or not text at all (UnicodeDecodeError)
        raise DatasetError(f"bench-merge: {path} is not JSON ({e})") from None
    if not isinstance(payload, dict) or not {"summary", "prompts"} <= payload.keys():
        raise DatasetError(f"bench-merge: {path} is not a `specpilot bench` result (no summary/prompts)")
    return payload


def _field_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}


def _same(key: str, a, b) -> bool:
    """Whether two runs' summaries agree on `key`; for "config", a field only one run has (a newer EngineConfig
    field) must sit at its default there."""
    if key != "config" or not isinstance(a, dict) or not isinstance(b, dict):
        return a == b
    defaults = _field_defaults()
    for name in a.keys() | b.keys():
        if name in a and name in b:
            if a[name] != b[name]:
                return False
        elif name not in defaults or a.get(name, b.get(name)) != defaults[name]:
            return False
    return True


def record_result(rec: dict, system: str) -> tuple[GenerationResult, ForcingVerdict]:
    """One prompt's record of one system -> the GenerationResult and forcing verdict it was written from (the
    output ids, times, stages and forwards exactly; per-step lengths where the record has them)."""
    r = rec[system]
    tokens = len(r["output_ids"])
    forwards = r.get("forwards")
    if forwards is None:  # records before `forwards` was written: tokens / tau (tau kept to 4 decimals)
        forwards = round(tokens / r["tau"]) if r.get("tau") else 0
    # per-step lengths: older records have none; one placeholder step per target forward (a speculative step is one
    # forward) keeps the stage times per step right, and merge_runs leaves their acceptance by position out
    accepted = r.get("accepted", [0] * forwards if r.get("stage_s") else [])
    drafted = r.get("drafted", [0] * len(accepted))
    result = GenerationResult(
        prompt_ids=[], output_ids=list(r["output_ids"]), finish_reason="unknown", num_target_forwards=forwards,
        accepted_lengths=list(accepted), drafted_lengths=list(drafted),
        plain_steps=r.get("plain_steps", 0), prefill_s=r["prefill_s"], decode_s=r["s"] - r["prefill_s"],
        stage_s=dict(r.get("stage_s", {})))
    mismatches = [Mismatch(**m) for m in r.get("mismatches", [])]
    if "failures" in r:
        failures = [Mismatch(**m) for m in r["failures"]]
    elif r["forcing_passed"]:
        failures = []
    else:  # older records: a failed prompt without its failures listed counts them all as failures
        failures = mismatches
    return result, ForcingVerdict(r["forcing_passed"], tokens, 0.0, mismatches, failures)


def merge_runs(paths: list[str | Path]) -> tuple[dict, dict]:
    """-> (summary, records) over the runs' prompts, as `specpilot bench` writes them."""
    if len(paths) < 2:
        raise DatasetError("bench-merge needs at least two result files")
    payloads = [_load(p) for p in paths]
    first = payloads[0]["summary"]
    for p, payload in zip(paths[1:], payloads[1:]):
        for key in SAME_KEYS:
            if not _same(key, payload["summary"].get(key), first.get(key)):
                raise DatasetError(f"bench-merge: {p} differs from {paths[0]} in {key!r}: not one measurement")
    names: list[str] = []
    for payload in payloads:
        names += [n for n in payload["prompts"] if n not in names]
    reports, records = [], {}
    for name in names:
        recs = [r for payload in payloads for r in payload["prompts"].get(name, [])]
        ids = [r["id"] for r in recs]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise DatasetError(f"bench-merge: {name} prompt(s) {', '.join(dup)} appear in more than one run")
        systems = [s for s in SYSTEMS if any(s in r for r in recs)]
        if "ar" not in systems or "specpilot" not in systems:
            raise DatasetError(f"bench-merge: {name} has no ar/specpilot records to compare")
        results = {s: [] for s in systems}
        verdicts = {s: [] for s in systems}
        for s in systems:
            ran = [s in r for r in recs]
            if ran != sorted(ran, reverse=True):  # _report compares a limited system on the first n prompts
                raise DatasetError(f"bench-merge: {name}: {s} ran on prompts that are not the first ones of the "
                                   "merged list (merge the runs in prompt order)")
            for r in recs[:sum(ran)]:
                res, ver = record_result(r, s)
                results[s].append(res)
                verdicts[s].append(ver)
        skipped = sum(payload["summary"].get("benchmarks", {}).get(name, {}).get("skipped_long_prompts", 0)
                      for payload in payloads)
        rep = _report(name, len(recs), skipped, results, verdicts)
        for s in systems:  # acceptance by position needs every step's lengths; older records have none
            if s != "ar" and any(s in r and r[s].get("forwards") is None for r in recs):
                entry = rep["systems"][s]
                if "acceptance_by_position" in entry:
                    entry["acceptance_by_position"] = []
                    entry["acceptance_by_position_missing"] = "some runs did not record per-step lengths"
        if not rep["systems"]["specpilot"].get("acceptance_by_position"):
            rep["acceptance_by_position"] = []
        reports.append(rep)
        records[name] = recs
    meta = {k: first[k] for k in SAME_KEYS if k in first}
    meta.update(
        merged_from=[str(p) for p in paths],
        wall_s=round(sum(p["summary"].get("wall_s", 0.0) for p in payloads), 1),
        forcing_tolerance=[p["summary"].get("forcing_tolerance") for p in payloads],
    )
    return summarize(reports, meta), records
