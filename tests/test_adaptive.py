"""Adaptive speculation (engine/adaptive.py, EngineConfig.adaptive): the policy's choices from step costs and
acceptance, and the engine's output with plain steps mixed in (== AR, token for token)."""

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, build_drafter
from specpilot.engine.adaptive import AdaptiveSpeculation
from specpilot.errors import ConfigError
from specpilot.models import load_model


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(policy, clock, steps):
    """steps: (seconds a speculative step takes, tokens it commits), plain steps take 1 s -> kinds run."""
    kinds = []
    for spec_s, tokens in steps:
        speculative = policy.speculate()
        clock.t += spec_s if speculative else 1.0
        policy.record(speculative, tokens if speculative else 1)
        kinds.append("S" if speculative else "p")
    return "".join(kinds)


def test_policy_measures_a_plain_step_then_backs_off_while_speculation_loses():
    clock = Clock()
    pol = AdaptiveSpeculation(min_gain=1.0, max_plain=4, alpha=1.0, clock=clock)
    # a speculative step of 3 s committing 2 tokens against 1 s plain steps: gain 2/3 -> plain runs 1, 2, 4, 4
    assert run(pol, clock, [(3.0, 2)] * 17) == "S" + "p" + "S" + "p" + "S" + "pp" + "S" + "pppp" + "S" + "pppp"
    assert pol.gain() == pytest.approx(2 / 3)
    assert pol.plain_s == 1.0 and pol.spec_s == 3.0


def test_policy_keeps_speculating_while_it_wins_and_resets_the_backoff():
    clock = Clock()
    pol = AdaptiveSpeculation(min_gain=1.0, max_plain=8, alpha=1.0, clock=clock)
    assert run(pol, clock, [(3.0, 2)] * 6) == "SpSpSp"  # losing: backoff 1, 2, then a probe
    assert pol.backoff == 4
    assert run(pol, clock, [(3.0, 2)] * 1) == "p"
    assert run(pol, clock, [(2.0, 5)] * 4) == "SSSS"  # the probe wins: speculate on, backoff back to 1
    assert pol.backoff == 1 and pol.gain() == pytest.approx(2.5)


def test_policy_timings_persist_across_prompts_acceptance_does_not():
    clock = Clock()
    pol = AdaptiveSpeculation(alpha=1.0, clock=clock)
    run(pol, clock, [(3.0, 2)] * 3)
    pol.start()
    assert pol.speculate() and pol.tokens is None and pol.plain_s == 1.0 and pol.spec_s == 3.0
    assert run(pol, clock, [(2.0, 4)] * 3) == "SSS"  # known plain cost: no calibration step this prompt


def test_policy_does_not_time_a_prompts_first_step():
    """The first step carries one-off costs (DFlash's first pass over the whole prompt): its time is not averaged."""
    clock = Clock()
    pol = AdaptiveSpeculation(alpha=1.0, clock=clock)
    assert run(pol, clock, [(50.0, 3), (2.0, 3), (2.0, 3)]) == "SpS"
    assert pol.spec_s == 2.0 and pol.tokens == 3
    pol.start()
    assert run(pol, clock, [(50.0, 3), (2.0, 3)]) == "SS" and pol.spec_s == 2.0


def test_policy_moving_averages_and_bad_arguments():
    clock = Clock()
    pol = AdaptiveSpeculation(alpha=0.5, clock=clock)
    run(pol, clock, [(2.0, 4), (2.0, 4), (2.0, 2)])  # S (tokens 4), p (calibration), S (tokens 4 + 0.5 * -2)
    assert pol.tokens == pytest.approx(3.0)
    with pytest.raises(ValueError):
        AdaptiveSpeculation(min_gain=0)
    with pytest.raises(ValueError):
        AdaptiveSpeculation(max_plain=0)
    for bad in ({"adaptive": "false"}, {"adaptive_min_gain": 0.0}, {"adaptive_max_plain": 0}):
        with pytest.raises(ConfigError):
            EngineConfig(**bad)


# --- in the engine: plain steps change the time, never the tokens ------------------------------------------


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {"target": load_model(tiny_model_dir("qwen2", seed=0)), "other": load_model(tiny_model_dir("qwen2", seed=1))}


def _prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 96, (5,), generator=g).tolist() * 3)[: 8 + 3 * i] for i in range(n)]


@pytest.mark.parametrize("kind", ["other", "ngram"])
@pytest.mark.parametrize("min_gain", [1e-9, 1e9])  # (almost) never plain / plain whenever allowed
def test_adaptive_greedy_equals_ar(models, kind, min_gain):
    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_new_tokens=30, max_seq_len=128, ignore_eos=True,
                       adaptive=True, adaptive_min_gain=min_gain, adaptive_max_plain=4)
    drafter = NgramDrafter(3, 1) if kind == "ngram" else build_drafter(cfg, models["other"], target)
    spec, ar = Engine(target, cfg, drafter), Engine(target, cfg.with_(drafter_kind="none", adaptive=False))
    assert spec.policy is not None and ar.policy is None
    plain = 0
    for p in _prompts():
        got = spec.generate(p)
        assert got.output_ids == ar.generate(p).output_ids
        assert len(got.accepted_lengths) == got.num_target_forwards
        plain += got.plain_steps
    assert plain >= 1  # at least the calibration step
    if min_gain > 1:  # losing every time: most steps are plain
        assert plain > spec.policy.max_plain


def test_adaptive_off_takes_no_plain_steps(models):
    """Off: no policy, and a step with nothing to draft at the token limit is not counted as a chosen plain step."""
    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_new_tokens=17, max_seq_len=128,
                       ignore_eos=True, ngram_assist=0)
    eng = Engine(target, cfg, build_drafter(cfg, target, target))  # drafts perfectly: 4 tokens a step, then 1
    res = eng.generate(_prompts(1)[0])
    assert eng.policy is None and res.plain_steps == 0 and res.drafted_lengths == [3, 3, 3, 3, 0]


def test_adaptive_sampling_runs(models):
    target = models["target"]
    cfg = EngineConfig(drafter_kind="ngram", num_draft_tokens=3, max_new_tokens=20, max_seq_len=128, ignore_eos=True,
                       adaptive=True, adaptive_min_gain=1e9).with_(sampling=EngineConfig().sampling.__class__(
                           temperature=0.8, seed=3))
    res = Engine(target, cfg, NgramDrafter(3, 1)).generate(_prompts(1)[0])
    assert len(res.output_ids) == 20 and res.plain_steps > 0


def test_adaptive_dflash_plain_runs_end_before_the_static_pass_overflows(tiny_model_dir, tiny_dflash_dir, monkeypatch):
    """A plain run ends when the drafter's next pass would take more new context than its graphed (static) pass
    holds (a block): every pass after the first stays static, the output equals AR."""
    from specpilot.drafters.dflash import DFlashBlockDrafter
    from specpilot.models.dflash_io import load_dflash

    target = load_model(tiny_model_dir("qwen3"))
    net = load_dflash(tiny_dflash_dir)
    B = net.block_size
    d = DFlashBlockDrafter(net, target, 128, static=True)
    assert d.max_catch_up == B
    static_calls = []
    orig = d._static_step
    monkeypatch.setattr(d, "_static_step", lambda: static_calls.append(1) or orig())
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=B - 1, max_new_tokens=60, max_seq_len=128,
                       ignore_eos=True, adaptive=True, adaptive_min_gain=1e9, adaptive_max_plain=64)
    eng = Engine(target, cfg, d)
    p = list(range(1, 10))
    res = eng.generate(p)
    assert res.output_ids == Engine(target, cfg.with_(drafter_kind="none", adaptive=False)).generate(p).output_ids
    drafting = sum(1 for n in res.drafted_lengths if n > 0)
    assert res.plain_steps > 2 * drafting - 2  # long plain runs (cut at the block)...
    assert len(static_calls) == drafting - 1  # ... yet every pass after the prompt's first was the static one
