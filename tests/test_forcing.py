"""Token forcing: passes exact outputs, fails changed ones at the right positions, never cascades."""

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.engine import Engine
from specpilot.evaluator.forcing import force, merge, specpilot_scorer, transformers_scorer
from specpilot.models import load_model


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    path = tiny_model_dir("llama", seed=3)
    model = load_model(path)
    prompt = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    out = Engine(model, EngineConfig(drafter_kind="none", max_new_tokens=16, max_seq_len=64, ignore_eos=True)).generate(prompt)
    return path, model, prompt, out.output_ids


def test_exact_output_passes_under_both_scorers(setup):
    path, model, prompt, output = setup
    for scorer in (specpilot_scorer(model), transformers_scorer(path)):
        v = force(scorer, prompt, output)
        assert v.passed and v.num_tokens == len(output) and not v.mismatches


def test_changed_token_fails_with_position_and_margin(setup):
    _, model, prompt, output = setup
    scorer = specpilot_scorer(model)
    bad = list(output)
    bad[5] = (bad[5] + 1) % 96
    v = force(scorer, prompt, bad, tolerance=0.0)
    assert not v.passed
    assert [m.index for m in v.failures][0] == 5
    assert v.failures[0].token == bad[5] and v.failures[0].stock_token == output[5]
    assert v.failures[0].margin > 0


def test_teacher_forcing_does_not_cascade(setup):
    """After a mismatch, later positions are judged on the candidate's own prefix, not re-synced or skipped."""
    _, model, prompt, output = setup
    scorer = specpilot_scorer(model)
    bad = list(output)
    bad[3] = (bad[3] + 7) % 96
    v = force(scorer, prompt, bad, tolerance=0.0)
    logits = scorer(prompt + bad[:-1])[len(prompt) - 1:]
    expected = [i for i in range(len(bad)) if int(logits[i].argmax()) != bad[i]]
    assert [m.index for m in v.mismatches] == expected


def test_near_tie_is_tolerated_and_reported(setup):
    _, model, prompt, output = setup
    scorer = specpilot_scorer(model)
    logits = scorer(prompt + output[:-1])[len(prompt) - 1:]
    top2 = logits.topk(2, -1)
    i = int((top2.values[:, 0] - top2.values[:, 1]).argmin())  # the closest call in this output
    swapped = list(output)
    swapped[i] = int(top2.indices[i, 1])
    margin = float(top2.values[i, 0] - top2.values[i, 1])
    loose = force(scorer, prompt, swapped[: i + 1], tolerance=margin + 1e-3)
    strict = force(scorer, prompt, swapped[: i + 1], tolerance=margin / 2)
    assert loose.passed and len(loose.mismatches) == 1
    assert not strict.passed
    assert merge([loose, strict])["forcing_passed"] is False


def test_bf16_scorer_tolerates_one_ulp_ties_only():
    """A bf16 scorer's logits one bf16 step apart are a tie; two steps apart are not."""
    V = 8

    def scorer_with(top1, top2):
        def fn(ids):
            logits = torch.full((len(ids), V), -10.0)
            logits[:, 0], logits[:, 1] = top1, top2
            return logits
        fn.dtype = torch.bfloat16
        return fn

    prompt, out = [3, 4], [1]  # the candidate chose token 1, the stock argmax is token 0
    assert force(scorer_with(20.125, 20.0), prompt, out, tolerance=0.05).passed  # 1 ulp at |20| = 0.125
    assert not force(scorer_with(20.25, 20.0), prompt, out, tolerance=0.05).passed  # 2 ulps
    fp32 = scorer_with(20.125, 20.0)
    fp32.dtype = torch.float32
    assert not force(fp32, prompt, out, tolerance=0.05).passed  # no precision slack for an fp32 scorer


def test_scorer_noise_is_zero_against_itself_and_positive_in_bf16(tiny_model_dir):
    from specpilot.evaluator.forcing import noise_tolerance, scorer_noise, specpilot_scorer
    from specpilot.models import load_model

    path = tiny_model_dir("qwen3")
    ref = specpilot_scorer(load_model(path))
    low = specpilot_scorer(load_model(path, dtype=torch.bfloat16))
    seqs = [[1, 5, 9, 2, 7, 3, 3, 8], [4, 4, 1]]
    assert scorer_noise(ref, ref, seqs) == 0.0
    noise = scorer_noise(low, ref, seqs)
    assert 0.0 < noise < 1.0
    assert noise_tolerance(noise, 0.0) == 2 * noise
    assert noise_tolerance(0.0, 0.1) == 0.1


def test_calibrated_tolerance_only_for_low_precision(tiny_model_dir):
    from specpilot.evaluator.forcing import calibrated_tolerance, specpilot_scorer
    from specpilot.models import load_model

    path = tiny_model_dir("qwen3")
    built = []

    def reference():
        built.append(1)
        return specpilot_scorer(load_model(path))

    fp32 = specpilot_scorer(load_model(path))
    assert calibrated_tolerance(fp32, reference, [[1, 2, 3]], 0.1) == (None, 0.1) and not built
    noise, tol = calibrated_tolerance(specpilot_scorer(load_model(path, dtype=torch.bfloat16)), reference,
                                      [[1, 5, 9, 2, 7, 3]], 0.0)
    assert built and noise > 0 and tol == 2 * noise


def test_float32_reference_falls_back_to_the_cpu_only_where_the_gpu_cannot_hold_it(tiny_model_dir, monkeypatch):
    """The float32 copy's size comes from the safetensors headers; a GPU with room for it (plus 10%) keeps it, one
    without sends it to the CPU and says so; a CPU run is left alone (no CUDA call)."""
    from safetensors import safe_open

    from specpilot.evaluator import forcing

    path = tiny_model_dir("qwen3")
    want = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            want += sum(st.get_tensor(k).numel() for k in st.keys())
    assert forcing.float32_bytes(path) == 4 * want > 0
    notes = []
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    free["bytes"] = int(4 * want * 1.2)
    assert forcing.reference_device(path, "cuda", notes.append) == "cuda" and not notes
    free["bytes"] = int(4 * want * 1.05)  # fits, but not with the 10% margin
    assert forcing.reference_device(path, "cuda:0", notes.append) == "cpu"
    assert len(notes) == 1 and "calibrating on the CPU" in notes[0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: 1 / 0)
    assert forcing.reference_device(path, "cpu", notes.append) == "cpu" and len(notes) == 1
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        forcing.float32_bytes(path / "nothing-here")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * 2**30))
    assert forcing.reference_device(path / "nothing-here", "cuda", notes.append) == "cuda"  # not sized: as asked


def _echo_scorer(ids):
    """A stock scorer for the bench tests: its argmax is always token 1 or 2 as the candidate wrote them."""
    logits = torch.zeros(len(ids), 4)
    for i, t in enumerate(ids[1:] + [2]):
        logits[i, t if t in (1, 2) else 1] = 5.0
    return logits


def test_bench_leaves_out_prompts_longer_than_the_pool_and_counts_them():
    from specpilot.engine.result import GenerationResult
    from specpilot.errors import DatasetError
    from specpilot.evaluator.bench import run_benchmark
    from specpilot.evaluator.datasets import Prompt

    prompts = [Prompt(f"x/{n}", "x", "x", ({"role": "user", "content": "a" * n},)) for n in (3, 50, 5)]
    seen = []

    def gen(ids):
        seen.append(len(ids))
        return GenerationResult(list(ids), [1, 2], "length", num_target_forwards=2, decode_s=0.01, prefill_s=0.004,
                                accepted_lengths=[0, 0], stage_s={"draft": 0.002, "verify": 0.006})

    scorer = _echo_scorer
    rep, recs = run_benchmark("x", prompts, lambda p: [7] * len(p.messages[0]["content"]),
                              {"ar": gen, "specpilot": gen}, scorer, tolerance=0.1, max_prompt_tokens=10)
    assert rep["skipped_long_prompts"] == 1 and rep["num_prompts"] == 2 and [r["id"] for r in recs] == ["x/3", "x/5"]
    assert 50 not in seen
    spec = rep["systems"]["specpilot"]  # same generate for both: a step is one token at AR's speed
    assert spec["tau"] == 1.0 and spec["step_cost_ar_steps"] == pytest.approx(1.0, rel=1e-3)
    # where the time went: prefill per prompt, stages per step (2 steps a prompt), and per prompt in the records
    assert spec["prefill_ms_per_prompt"] == pytest.approx(4.0)
    assert spec["stage_ms_per_step"] == {"draft": pytest.approx(1.0), "verify": pytest.approx(3.0)}
    assert recs[0]["ar"]["prefill_s"] == 0.004 and recs[0]["ar"]["stage_s"] == {"draft": 0.002, "verify": 0.006}
    with pytest.raises(DatasetError, match="max-seq-len"):
        run_benchmark("x", prompts[1:2], lambda p: [7] * 50, {"ar": gen, "specpilot": gen}, scorer, tolerance=0.1,
                      max_prompt_tokens=10)


def test_bench_rotates_which_system_meets_a_prompt_first():
    """Systems sharing a target share its first-call costs for a new prompt length: whoever runs first pays. The
    order rotates by prompt, so over the prompts each system goes first equally often (AR always going first
    flattered the speculative system)."""
    from specpilot.engine.result import GenerationResult
    from specpilot.evaluator.bench import run_benchmark
    from specpilot.evaluator.datasets import Prompt

    prompts = [Prompt(f"x/{n}", "x", "x", ({"role": "user", "content": "a" * n},)) for n in range(3, 9)]
    firsts, seen = {}, set()

    def make(name):
        def gen(ids):
            if len(ids) not in seen:  # first meeting of this length: a shared cost
                seen.add(len(ids))
                firsts[name] = firsts.get(name, 0) + 1
            return GenerationResult(list(ids), [1, 2], "length", num_target_forwards=2, decode_s=0.01)
        return gen

    scorer = _echo_scorer
    run_benchmark("x", prompts, lambda p: [7] * len(p.messages[0]["content"]),
                  {"ar": make("ar"), "stock": make("stock"), "specpilot": make("specpilot")}, scorer, tolerance=0.1)
    # the warm-up prompt (the longest, x/8) went to ar; the other five lengths are met first in rotation (ar x/3,
    # stock x/4, specpilot x/5, ar x/6, stock x/7)
    assert firsts == {"ar": 3, "stock": 2, "specpilot": 1}, firsts


def test_bench_warms_every_system_up_on_the_longest_prompt():
    """transformers' static cache grows (and its compiled decode step recompiles, ~40 s on the H200) whenever a
    prompt is longer than every earlier one: warmed up on the first prompt, its AR stalled at 5-7 tok/s on exactly
    those prompts. Each system's first call is the benchmark's longest prompt, whatever the order."""
    from specpilot.engine.result import GenerationResult
    from specpilot.evaluator.bench import run_benchmark
    from specpilot.evaluator.datasets import Prompt

    prompts = [Prompt(f"x/{n}", "x", "x", ({"role": "user", "content": "a" * n},)) for n in (5, 3, 11, 7)]
    calls = {}

    def make(name):
        def gen(ids):
            calls.setdefault(name, []).append(len(ids))
            return GenerationResult(list(ids), [1, 2], "length", num_target_forwards=2, decode_s=0.01)
        return gen

    scorer = _echo_scorer
    run_benchmark("x", prompts, lambda p: [7] * len(p.messages[0]["content"]),
                  {"ar": make("ar"), "hf-ar": make("hf-ar"), "specpilot": make("specpilot")}, scorer, tolerance=0.1)
    assert {s: c[0] for s, c in calls.items()} == {"ar": 11, "hf-ar": 11, "specpilot": 11}
    assert all(sorted(c[1:]) == [3, 5, 7, 11] for c in calls.values()), calls  # then every prompt once


def test_bench_stops_at_its_deadline_and_checkpoints_every_prompt():
    """A time budget starts no prompt after the deadline (the first always runs) and says so; every prompt's
    checkpoint carries the report so far, so a run killed later keeps what it measured."""
    import time

    from specpilot.engine.result import GenerationResult
    from specpilot.evaluator.bench import run_benchmark
    from specpilot.evaluator.datasets import Prompt

    prompts = [Prompt(f"x/{n}", "x", "x", ({"role": "user", "content": "a" * n},)) for n in range(3, 8)]
    calls = []

    def gen(ids):
        calls.append(len(ids))
        return GenerationResult(list(ids), [1, 2], "length", num_target_forwards=2, decode_s=0.01)

    scorer = _echo_scorer
    encode = lambda p: [7] * len(p.messages[0]["content"])  # noqa: E731
    seen = []
    rep, recs = run_benchmark("x", prompts, encode, {"ar": gen, "specpilot": gen}, scorer, tolerance=0.1,
                              checkpoint=lambda r, rs: seen.append((r["num_prompts"], len(rs), set(r["warmup_s"]))))
    assert seen == [(n, n, {"ar", "specpilot"}) for n in range(1, 6)] and "stopped_by_time_budget" not in rep
    assert set(rep["warmup_s"]) == {"ar", "specpilot"} and all(s >= 0 for s in rep["warmup_s"].values())
    calls.clear()
    rep, recs = run_benchmark("x", prompts, encode, {"ar": gen, "specpilot": gen}, scorer, tolerance=0.1,
                              deadline=time.monotonic() - 1)  # already past: the first prompt only
    assert rep["stopped_by_time_budget"] and rep["num_prompts"] == 1 and [r["id"] for r in recs] == ["x/3"]
    # the warm-ups on the longest prompt (x/7), then the one prompt, two systems
    assert rep["systems"]["ar"]["prompts"] == 1 and calls == [7, 7, 3, 3]


@pytest.mark.parametrize("argv, message", [
    (["--systems", "ar,foo"], "unknown systems ['foo']; choose from ar, hf-ar, stock, specpilot"),
    (["--tolerance", "-1"], "--tolerance is a logit margin >= 0, got -1.0"),
    (["--tolerance", "nan"], "--tolerance is a logit margin >= 0, got nan"),
    (["--baseline-prompts", "-2"], "--baseline-prompts must be >= 0"),
    (["--drafter-kind", "dflash"], "--drafter-kind dflash needs --drafter, a DFlash checkpoint"),
])
def test_bench_rejects_bad_options_before_loading_any_model(monkeypatch, capsys, argv, message):
    """These are checked first: a typo must not cost the minutes of loading (and downloading) two models."""
    import specpilot.engine
    from specpilot.cli import main

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(specpilot.engine, "load_target", no_load)
    assert main(["bench", *argv, "--num-prompts", "1"]) == 2
    assert message in capsys.readouterr().err


def test_force_input_that_is_a_folder_or_binary_says_so(tmp_path, capsys):
    from specpilot.cli import main

    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\xfd")
    for path, message in ((tmp_path, "is a folder: pass a JSONL file"), (tmp_path / "bin.jsonl", "is not UTF-8")):
        assert main(["force", "--input", str(path)]) == 2
        assert message in capsys.readouterr().err
