"""`specpilot bench-merge` (evaluator/bench_merge.py): two runs over disjoint prompts pool into the figures one run
over all of them reports; what cannot be pooled is refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.engine.result import GenerationResult
from specpilot.errors import DatasetError
from specpilot.evaluator.bench import run_benchmark, summarize, write_results
from specpilot.evaluator.bench_merge import merge_runs
from specpilot.evaluator.datasets import Prompt

PROMPTS = [Prompt(f"x/{n}", "x", "x", ({"role": "user", "content": "a" * n},)) for n in range(3, 10)]
META = {"target": "t", "drafter": "d", "config": {"num_draft_tokens": 2}}


def _encode(p):
    return [7] * len(p.messages[0]["content"])


def _scorer(ids):  # stock: token 1 everywhere, 2 a near tie (a mismatch within tolerance)
    logits = torch.zeros(len(ids), 4)
    logits[:, 1] = 5.0
    logits[:, 2] = 4.9  # a near tie: 2 instead of 1 is a tolerated mismatch
    return logits


def _systems():
    """Deterministic systems whose figures differ by prompt length: times, forwards and per-step lengths."""
    def ar(ids):
        n = len(ids)
        return GenerationResult(list(ids), [1] * n, "length", num_target_forwards=n, prefill_s=0.001 * n,
                                decode_s=0.01 * n)

    def spec(ids):
        n = len(ids)
        out = [1] * (n - 1) + [2]  # the last token a near-tie mismatch
        acc = [2, 1] * (n // 2) + [0] * (n % 2)
        return GenerationResult(list(ids), out, "length", num_target_forwards=len(acc),
                                accepted_lengths=acc, drafted_lengths=[2] * len(acc), prefill_s=0.001 * n,
                                decode_s=0.004 * n + 0.001, stage_s={"draft": 0.001 * n, "verify": 0.002 * n})

    def stock(ids):
        n = len(ids)
        return GenerationResult(list(ids), [1] * n, "length", num_target_forwards=n, decode_s=0.05 * n)

    return {"ar": ar, "stock": stock, "specpilot": spec}


def _run(tmp_path, name, prompts):
    rep, recs = run_benchmark("x", prompts, _encode, _systems(), _scorer, tolerance=0.2)
    path = tmp_path / name
    write_results(path, summarize([rep], {**META, "wall_s": 1.0, "forcing_tolerance": 0.2}), {"x": recs})
    return path, rep


def test_merging_two_runs_equals_one_run_over_all_prompts(tmp_path):
    _, whole = _run(tmp_path, "all.json", PROMPTS)
    a, _ = _run(tmp_path, "a.json", PROMPTS[:4])
    b, _ = _run(tmp_path, "b.json", PROMPTS[4:])
    summary, records = merge_runs([a, b])
    merged = summary["benchmarks"]["x"]
    assert [r["id"] for r in records["x"]] == [p.id for p in PROMPTS]
    assert merged["num_prompts"] == whole["num_prompts"] == len(PROMPTS)
    for s in ("ar", "stock", "specpilot"):
        for key, value in whole["systems"][s].items():
            got = merged["systems"][s][key]
            assert got == pytest.approx(value, rel=1e-4), (s, key, got, value)
    assert merged["speedup_vs_stock"] == pytest.approx(whole["speedup_vs_stock"], rel=1e-4)
    assert merged["systems"]["specpilot"]["forcing_mismatches"] == len(PROMPTS)  # one near tie a prompt, all kept
    assert summary["merged_from"] == [str(a), str(b)] and summary["wall_s"] == 2.0


def test_records_without_step_lengths_pool_but_leave_acceptance_out(tmp_path):
    """Runs from before the per-step lengths were recorded: tau still pools exactly (from tau and tokens), the
    acceptance by position is left out and said to be missing, never computed from part of the prompts."""
    a, _ = _run(tmp_path, "a.json", PROMPTS[:4])
    b, whole_b = _run(tmp_path, "b.json", PROMPTS[4:])
    old = json.loads(a.read_text())
    for rec in old["prompts"]["x"]:
        for s in ("specpilot", "stock", "ar"):
            for key in ("forwards", "accepted", "drafted", "failures"):
                rec[s].pop(key, None)
    a.write_text(json.dumps(old))
    _, whole = _run(tmp_path, "all.json", PROMPTS)
    summary, _ = merge_runs([a, b])
    spec = summary["benchmarks"]["x"]["systems"]["specpilot"]
    assert spec["tau"] == pytest.approx(whole["systems"]["specpilot"]["tau"], rel=1e-4)
    for stage, ms in whole["systems"]["specpilot"]["stage_ms_per_step"].items():  # per step of all the prompts
        assert spec["stage_ms_per_step"][stage] == pytest.approx(ms, rel=1e-3), stage
    assert spec["acceptance_by_position"] == [] and "acceptance_by_position_missing" in spec
    assert whole["systems"]["specpilot"]["acceptance_by_position"]  # the unmerged run has it


def test_merge_refuses_what_is_not_one_measurement(tmp_path):
    a, _ = _run(tmp_path, "a.json", PROMPTS[:4])
    b, _ = _run(tmp_path, "b.json", PROMPTS[3:])
    with pytest.raises(DatasetError, match="x/6 appear in more than one run"):
        merge_runs([a, b])
    c, _ = _run(tmp_path, "c.json", PROMPTS[4:])
    other = json.loads(c.read_text())
    other["summary"]["config"] = {"num_draft_tokens": 4}
    c.write_text(json.dumps(other))
    with pytest.raises(DatasetError, match="differs .* in 'config'"):
        merge_runs([a, c])
    with pytest.raises(DatasetError, match="at least two"):
        merge_runs([a])
    with pytest.raises(DatasetError, match="no such file"):
        merge_runs([a, tmp_path / "missing.json"])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DatasetError, match="not a `specpilot bench` result"):
        merge_runs([a, tmp_path / "bad.json"])
    with pytest.raises(DatasetError, match="is a folder; pass the results file"):  # was an IsADirectoryError
        merge_runs([a, tmp_path])
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DatasetError, match="is not JSON"):  # was a UnicodeDecodeError
        merge_runs([a, tmp_path / "binary.json"])


@pytest.mark.parametrize("extra, same", [({"norm_epilogue": False}, True), ({"norm_epilogue": True}, False),
                                         ({"no_such_field": 1}, False), ({"num_draft_tokens": 3}, False)])
def test_merge_takes_a_newer_config_field_at_its_default_as_the_older_runs(tmp_path, extra, same):
    """A run made before EngineConfig gained a field pools with a newer run only if that one has the field at its
    default (a mechanism lands switched off: the older code's behaviour); a changed value or a field EngineConfig
    does not know is a different measurement."""
    a, _ = _run(tmp_path, "a.json", PROMPTS[:4])
    b, _ = _run(tmp_path, "b.json", PROMPTS[4:])
    newer = json.loads(b.read_text())
    newer["summary"]["config"] = {**newer["summary"]["config"], **extra}
    b.write_text(json.dumps(newer))
    if same:
        summary, _ = merge_runs([a, b])
        assert summary["benchmarks"]["x"]["num_prompts"] == len(PROMPTS)
    else:
        with pytest.raises(DatasetError, match="differs .* in 'config'"):
            merge_runs([a, b])


def test_merge_refuses_a_limited_system_out_of_prompt_order(tmp_path):
    """stock limited to its first prompts in each run would, merged, skip prompts in the middle: speedups vs stock
    are taken on the first n prompts, so that is refused rather than silently compared on other prompts."""
    rep, recs = run_benchmark("x", PROMPTS[:4], _encode, _systems(), _scorer, tolerance=0.2, limits={"stock": 2})
    a = tmp_path / "a.json"
    write_results(a, summarize([rep], {**META, "wall_s": 1.0}), {"x": recs})
    b, _ = _run(tmp_path, "b.json", PROMPTS[4:])
    with pytest.raises(DatasetError, match="stock ran on prompts that are not the first"):
        merge_runs([a, b])
