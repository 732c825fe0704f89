"""The optimization loop: registry, memory (crash + resume, transfer), gate, integration, agent explorer, CLI.

Timing on a shared 2-core CPU is noise, so most tests use a deterministic fake world: a scorer whose greedy
continuation is a fixed rule (so forcing is real and exact) and a measure whose tokens/s is a function of the
config. The forcing gate and the CLI also run on tiny random models with the real engine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.errors import ConfigError
from specpilot.loop import Budget, Deployment, EngineMeasure, Gate, Measurement, Memory, optimize
from specpilot.loop.agent import AgentExplorer, DriverMeasure
from specpilot.loop.registry import REGISTRY, Mechanism, applicable, register
from specpilot.loop.report import write_report

ROOT = Path(__file__).resolve().parents[1]
V = 32


# --- the fake world ---------------------------------------------------------------------------------------------


def rule(seq):
    return (seq[-1] * 5 + len(seq)) % V


def fake_scorer(ids):
    """Logits whose argmax at each position is rule(prefix), with a margin of 4."""
    out = torch.zeros(len(ids), V)
    for t in range(len(ids)):
        out[t, rule(ids[: t + 1])] = 4.0
    return out


def greedy(prompt, n=6):
    seq = list(prompt)
    for _ in range(n):
        seq.append(rule(seq))
    return seq[len(prompt):]


DEV = [[3, 4, 5, 6], [7, 8, 9], [1, 2, 3, 4, 5]]
HELD = [[10, 11, 12], [13, 14, 15, 16]]
K_SPEED = {2: 0.9, 3: 1.0, 4: 1.05, 6: 1.25, 8: 1.1}
N_SPEED = {2: 1.0, 3: 1.15, 4: 1.05, 6: 0.95}


def additive(cfg, prompts):
    return 100 * K_SPEED[cfg.num_draft_tokens] * N_SPEED[cfg.ngram_max]


def antagonistic(cfg, prompts):
    s = additive(cfg, prompts)
    return s * 0.7 if (cfg.num_draft_tokens, cfg.ngram_max) == (6, 3) else s


class Killed(BaseException):
    """A kill, not an error: errors in measure() reject a trial, a kill stops the run."""


class FakeMeasure:
    """Deterministic tokens/s with a +-0.4% spread over repeats; outputs are the scorer's own greedy ones."""

    def __init__(self, speed=additive, fail_after=None, sleep=0.0):
        self.speed, self.fail_after, self.sleep = speed, fail_after, sleep
        self.calls, self.active, self.max_active = [], 0, 0
        self.lock = threading.Lock()

    def __call__(self, cfg, prompts, repeats):
        with self.lock:
            self.calls.append((json.dumps(cfg.to_dict(), sort_keys=True), "dev" if prompts is DEV else "held"))
            if self.fail_after is not None and len(self.calls) > self.fail_after:
                raise Killed("simulated kill")
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(self.sleep)
        s = self.speed(cfg, prompts)
        with self.lock:
            self.active -= 1
        return Measurement([s * (1 + 0.004 * (i - (repeats - 1) / 2)) for i in range(repeats)], prompts,
                           [greedy(p) for p in prompts], tau=2.0, stage_s={"verify": 0.01, "draft": 0.002})


def ngram_dep(target="toy-coder-1.5b"):
    return Deployment(target, None, EngineConfig(drafter_kind="ngram", max_new_tokens=8, max_seq_len=64))


def run(memory, measure, dep=None, budget=None, **kw):
    gate = kw.pop("gate", None) or Gate(fake_scorer, HELD, repeats=3)
    return optimize(dep or ngram_dep(), budget or Budget(rounds=3, trials=60), memory, measure, dev=DEV, gate=gate,
                    **kw)


# --- registry -----------------------------------------------------------------------------------------------


def test_registry_applies_and_filters(tmp_path):
    cpu_ngram = ngram_dep()
    assert [m.name for m in applicable(cpu_ngram, cpu_ngram.config)] == ["block_size", "ngram_window",
                                                                          "fused_projections"]
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert [m.name for m in applicable(gpu, gpu.config)] == [
        "block_size", "drafter_kind", "ngram_assist", "ngram_window", "cuda_graphs", "fused_projections",
        "gemv_kernel", "attention_kernel", "norm_kernel", "rope_kernel", "act_kernel", "add_norm_kernel",
        "fused_decode", "fused_verify", "pdl", "pdl_l2", "pdl_l2_next", "pdl_kv_l2", "rope_split", "attn_split",
        "attn_block", "attn_merge", "attn_merge_unroll", "attn_early_pos", "attn_warps", "attn_stages", "attn_kv_preload", "attn_cluster", "attn_cluster_even", "attn_cluster_push", "attn_loads_first", "attn_single", "qkv_trigger_first", "verify_one_launch", "norm_pdl", "norm_handoff", "verify_rope_in_qkv", "gemm_bucket", "gemv_prefetch",
        "gemv_pipeline", "qkv_pipeline", "early_epilogue", "tile_after_wait", "tuned_tiles", "norm_epilogue", "rope_in_attention", "rope_in_qkv", "fused_mlp",
        "megakernel",
        "draft_chain_graph",
        "l2_prefetch", "pad_shapes", "prefill_graphs", "adaptive", "compile"]
    assert REGISTRY["prefill_graphs"].candidates(gpu.config, gpu) == [{"prefill_graphs": 512}, {"prefill_graphs": 0}]
    assert "prefill_graphs" not in [m.name for m in applicable(gpu, gpu.config.with_(pad_shapes=False))]
    assert REGISTRY["draft_chain_graph"].candidates(gpu.config, gpu) == [{"draft_chain_graph": True}]
    assert REGISTRY["megakernel"].candidates(gpu.config, gpu) == [{"megakernel": True}]
    assert "megakernel" not in [m.name for m in applicable(gpu, gpu.config.with_(compile=True))]
    assert "draft_chain_graph" not in [m.name for m in applicable(gpu, gpu.config.with_(drafter_kind="ngram"))]
    assert REGISTRY["l2_prefetch"].candidates(gpu.config, gpu) == [{"l2_prefetch": 0.5}, {"l2_prefetch": 1.0}]
    assert "l2_prefetch" not in [m.name for m in applicable(gpu, gpu.config.with_(fused_decode=False,
                                                                                    fused_verify=False))]
    # pdl acts on the fused one-token path only: not offered without it
    assert "pdl" not in [m.name for m in applicable(gpu, gpu.config.with_(fused_decode=False))]
    assert "pdl" not in [m.name for m in applicable(gpu, gpu.config.with_(fused_projections=False))]
    # from the default (PDL, late trigger): the other trigger, or PDL off (one way: the trigger then says nothing)
    assert REGISTRY["pdl"].candidates(gpu.config, gpu) == [{"pdl": True, "pdl_trigger": "start"},
                                                           {"pdl": False, "pdl_trigger": "late"}]
    start = gpu.config.with_(pdl_trigger="start")
    assert REGISTRY["pdl"].candidates(start, gpu) == [{"pdl": True, "pdl_trigger": "late"},
                                                      {"pdl": False, "pdl_trigger": "late"}]
    assert REGISTRY["pdl_l2"].candidates(gpu.config, gpu) == [  # no share without a size (EngineConfig rejects it)
        {"pdl_l2_mb": 0, "pdl_l2_share": 1.0}, *({"pdl_l2_mb": mb, "pdl_l2_share": share} for mb in (16, 36)
                                                 for share in (0.25, 1.0)), {"pdl_l2_mb": 8, "pdl_l2_share": 0.25}]
    assert "pdl_l2" not in [m.name for m in applicable(gpu, gpu.config.with_(pdl=False))]
    assert REGISTRY["pdl_l2_next"].candidates(gpu.config, gpu) == [{"pdl_l2_next_mb": 0}, {"pdl_l2_next_mb": 16}]
    assert "pdl_l2_next" not in [m.name for m in applicable(gpu, gpu.config.with_(pdl=False))]
    assert REGISTRY["verify_l2"].candidates(gpu.config, gpu) == [{"verify_l2_mb": 8}, {"verify_l2_mb": 16}]
    assert REGISTRY["gemm_bucket"].candidates(gpu.config, gpu) == [{"gemm_bucket_min": 16}]
    for name in ("verify_l2", "gemm_bucket"):
        assert name not in [m.name for m in applicable(gpu, gpu.config.with_(fused_verify=False))]
    assert REGISTRY["drafter_kind"].candidates(gpu.config, gpu) == [{"drafter_kind": "ngram"}]
    flash = Deployment("t", "ckpt", EngineConfig(drafter_kind="dflash"), "cpu")
    assert REGISTRY["drafter_kind"].candidates(flash.config, flash) == [{"drafter_kind": "ngram"}]
    assert REGISTRY["drafter_kind"].candidates(flash.config.with_(drafter_kind="ngram"), flash) == \
        [{"drafter_kind": "dflash"}]
    no_graphs = gpu.config.with_(cuda_graphs=False)
    assert "compile" not in [m.name for m in applicable(gpu, no_graphs)]
    assert [m.name for m in applicable(cpu_ngram, cpu_ngram.config.with_(drafter_kind="none"))] == \
        ["fused_projections"]  # speculative mechanisms need a drafter; a weight layout does not
    assert {d["num_draft_tokens"] for d in REGISTRY["block_size"].candidates(cpu_ngram.config, cpu_ngram)} == {2, 3, 6, 8}
    dflash = Deployment("t", "d", cpu_ngram.config.with_(drafter_kind="dflash", num_draft_tokens=15), "cpu")
    assert 15 not in {d["num_draft_tokens"] for d in REGISTRY["block_size"].candidates(dflash.config, dflash)}
    assert {2, 8} <= {d["num_draft_tokens"] for d in REGISTRY["block_size"].candidates(dflash.config, dflash)}
    with pytest.raises(ConfigError):
        Mechanism("bogus", ("draft",), {"no_such_field": [1]})
    with pytest.raises(ConfigError):
        register(Mechanism("block_size", ("verify",), {"num_draft_tokens": [5]}))
    # one entry is all a new mechanism needs: a private registry with it is explored
    reg = {"min_ngram": Mechanism("min_ngram", ("draft",), {"ngram_min": [2]}, lambda d, c: True)}
    res = run(Memory(tmp_path / "m.sqlite"), FakeMeasure(), budget=Budget(rounds=1), registry=reg)
    assert {t.mechanism for t in res.trials} == {"baseline", "min_ngram"}


# --- memory: crash + resume, transfer ----------------------------------------------------------------------------


def test_killed_run_resumes_without_rerunning_or_losing_trials(tmp_path):
    path = tmp_path / "m.sqlite"
    reference = run(Memory(tmp_path / "ref.sqlite"), FakeMeasure())
    mem = Memory(path)
    with pytest.raises(Killed):
        run(mem, FakeMeasure(fail_after=9))
    run_id = mem._q("SELECT max(id) FROM runs")[0][0]
    before = mem.finished_trials(run_id)
    assert 2 <= len(before) < len(reference.trials)
    mem.close()
    again = Memory(path)  # a new process
    measure = FakeMeasure()
    res = run(again, measure, resume_run=run_id)
    new = [t for t in res.trials if t.id not in {b.id for b in before}]
    dev_calls = [c for c, split in measure.calls if split == "dev"]  # reference, candidate, reference, ...
    assert sorted(dev_calls[1::2]) == sorted(json.dumps(t.config, sort_keys=True) for t in new), \
        "a finished trial was measured again"
    after = {t.id: t for t in res.trials}
    assert all(after[t.id] == t for t in before), "a finished trial was lost or changed"
    assert sorted(t.key for t in res.trials) == sorted(t.key for t in reference.trials)
    assert res.best.config == reference.best.config
    assert again.run_info(run_id)["status"] == "finished"


def test_memory_transfer_reaches_best_in_fewer_trials(tmp_path):
    mem = Memory(tmp_path / "shared.sqlite")
    first = run(mem, FakeMeasure())
    second = run(mem, FakeMeasure(), dep=ngram_dep("toy-coder-3b"))  # same family, remembers the first
    empty = run(Memory(tmp_path / "empty.sqlite"), FakeMeasure(), dep=ngram_dep("toy-coder-3b"))
    assert second.best.config == empty.best.config == first.best.config
    assert second.trials_to_best < empty.trials_to_best
    assert [t.mechanism for t in second.trials if t.round == 1] == ["transfer"]
    knows = mem.validated_for(ngram_dep("toy-coder-7b"))
    assert {m for m, _, _ in knows.worked} == {"block_size", "ngram_window"}


def test_failed_elsewhere_is_skipped(tmp_path):
    mem = Memory(tmp_path / "m.sqlite")
    flat_k = lambda cfg, p: 100 * N_SPEED[cfg.ngram_max]  # noqa: E731  block size never helps here
    run(mem, FakeMeasure(flat_k))
    assert "block_size" in mem.validated_for(ngram_dep("toy-coder-3b")).failed
    res = run(mem, FakeMeasure(flat_k), dep=ngram_dep("toy-coder-3b"), budget=Budget(rounds=3))
    assert "block_size" not in {t.mechanism for t in res.trials}


def test_cost_model_estimates_order_directions_and_values(tmp_path):
    """Predicted gains (costmodel/whatif.py via `estimate_fn`) put the most promising direction and value first;
    `per_direction` caps the values tried per round; each trial records the prediction that ordered it."""
    seen = []

    def estimate(cfg, stats, new):
        seen.append(stats)
        if new.ngram_max != cfg.ngram_max:
            return {3: 1.2, 6: 1.05}.get(new.ngram_max, 0.9)  # ngram_max 3 first, though registry order is 2, 3, 4, 6
        if new.fused_projections != cfg.fused_projections:
            return 0.8  # a predicted loss: last
        return None  # block sizes: not priceable here

    res = run(Memory(tmp_path / "m.sqlite"), FakeMeasure(), estimate_fn=estimate,
              budget=Budget(rounds=1, directions=2, per_direction=2))
    tried = [(t.mechanism, t.delta) for t in res.trials if t.round == 1]
    assert tried[:2] == [("ngram_window", {"ngram_max": 3}), ("ngram_window", {"ngram_max": 6})]
    assert [m for m, _ in tried[2:]] == ["block_size", "block_size"]  # unpriced, ahead of the predicted loss
    assert "fused_projections" not in {m for m, _ in tried}
    first = next(t for t in res.trials if t.delta == {"ngram_max": 3})
    assert first.figures["predicted_gain"] == 1.2 and first.passed  # N_SPEED[3] = 1.15 over N_SPEED[4]
    assert seen and all("samples" in st for st in seen)  # priced from the best config's dev measurement
    report = (write_report(Memory(tmp_path / "m.sqlite"), res.run_id, tmp_path / "out")["report"]).read_text()
    assert "| predicted x |" in report and "| 1.200 |" in report


def test_cost_model_hooks_price_ngram_switches_by_replay(monkeypatch):
    """On a GPU the hooks predict gains; a switch to n-grams (or another n-gram setting) gets its tau replayed on
    the dev outputs, so a drafter the loop has never run is still priced."""
    import specpilot.costmodel as cm
    from specpilot.costmodel import HardwareCeilings, synthetic_config
    from specpilot.drafters.ngram import NgramDrafter, replay
    from specpilot.loop import cost_model_hooks
    from specpilot.models.dflash import DFlashConfig

    hw = HardwareCeilings(name="Fake GPU", hbm_bytes_per_s=4e12, bf16_flops_per_s=7e14, launch_s=6e-6,
                          graph_kernel_s=1.5e-6, gemv_bytes_per_s=3.5e12, measured_at="2025-01-01T00:00:00+0000")
    monkeypatch.setattr(cm, "load_or_measure", lambda device: hw)
    target = synthetic_config("qwen2.5-1.5b")
    drafter = DFlashConfig(hidden_size=1536, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=12,
                           num_key_value_heads=2, head_dim=128, block_size=16, mask_token_id=5,
                           target_layer_ids=(1, 13, 25), num_target_layers=28, vocab_size=target.vocab_size)
    prompts = [[7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23] * 5]
    outputs = [[7, 8, 9, 10, 11, 12] * 6, [20, 21, 22, 23] * 8]  # the outputs quote their prompts: n-grams shine
    hooks = cost_model_hooks(target, drafter, "cuda", dev_prompts=prompts)
    stats = {"stage_s": {"draft": 2e-3, "verify": 4e-3, "accept": 1.5e-4, "commit": 1.8e-4}, "tau": 2.0,
             "context_len": 60, "acceptance": [0.6, 0.5, 0.4, 0.4], "outputs": outputs}
    flash = EngineConfig(drafter_kind="dflash", num_draft_tokens=4)
    to_ngram = hooks.estimate(flash, stats, flash.with_(drafter_kind="ngram"))
    assert to_ngram > 2.0  # replayed tau ~4.6 of 5 and the 2 ms draft stage gone
    assert hooks.estimate(flash, {**stats, "outputs": None}, flash.with_(drafter_kind="ngram")) is None
    assert hooks.estimate(flash, stats, flash.with_(drafter_kind="model")) is None  # an unknown drafter's tau
    ngram = EngineConfig(drafter_kind="ngram", num_draft_tokens=2)
    for outs, verdict in ((outputs, lambda g: g > 1.5),  # replayed: long copies pay
                          ([list(range(100, 136)), list(range(200, 232))], lambda g: g < 1.0)):  # nothing to copy
        measured = replay(NgramDrafter(4, 1), prompts, outs, 2)["tau"]  # what the run at K = 2 saw
        assert verdict(hooks.estimate(ngram, {**stats, "tau": measured, "outputs": outs},
                                      ngram.with_(num_draft_tokens=8)))


# --- gate ------------------------------------------------------------------------------------------------------


CFG = EngineConfig(drafter_kind="ngram")
REF = FakeMeasure(lambda c, p: 100.0)  # the reference: 99.6, 100, 100.4 tok/s over three repeats


def judge(speed, gate=None):
    gate = gate or Gate(fake_scorer, HELD, repeats=3)
    return gate.judge(CFG.with_(num_draft_tokens=6), FakeMeasure(speed), CFG, REF, DEV)


def test_gate_rejects_gain_within_noise_and_slower():
    within = judge(lambda c, p: 100.5)
    assert not within.passed and within.check == "noise" and "run-to-run spread" in within.reason
    slower = judge(lambda c, p: 99.0)
    assert not slower.passed and slower.check == "slower"
    real = judge(lambda c, p: 110.0)
    assert real.passed and real.figures["gain_dev"] == pytest.approx(1.1)
    assert real.figures["heldout"]["median"] == pytest.approx(110.0)


def test_gate_measures_the_reference_next_to_the_candidate():
    """A machine that slows down after the reference was first measured must not hide a real gain (or fake one)."""
    drift = FakeMeasure(lambda c, p: 50.0 * (1.2 if c.num_draft_tokens == 6 else 1.0))  # everything at half speed
    v = Gate(fake_scorer, HELD, repeats=3).judge(CFG.with_(num_draft_tokens=6), drift, CFG, drift, DEV)
    assert v.passed and v.figures["gain_dev"] == pytest.approx(1.2)
    assert [split for _, split in drift.calls] == ["dev", "dev", "held", "held"]  # reference, candidate, per split


def test_gate_rejects_speed_above_ceiling_and_notes_missing_ceiling():
    v = judge(lambda c, p: 150.0, Gate(fake_scorer, HELD, repeats=3, ceiling_fn=lambda c, meas: 120.0))
    assert not v.passed and v.check == "ceiling" and "measurement fault" in v.reason
    free = judge(lambda c, p: 150.0)
    assert free.passed and any("skipped" in n for n in free.notes)


def test_gate_rejects_gain_that_does_not_repeat_on_heldout():
    """A candidate tuned to (or caching outputs for) the dev prompts: fast there, not on held-out."""
    v = judge(lambda c, p: 150.0 if p is DEV else 100.0)
    assert not v.passed and v.check == "heldout"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from specpilot.models import load_model

    path = tiny_model_dir("llama", seed=3)
    return path, load_model(path), load_model(path)  # candidate's model, and an independent scorer instance


def test_gate_rejects_changed_output_at_high_margin(tiny):
    """Real engine outputs on a tiny model, forced by an independent instance; one confident token changed."""
    from specpilot.evaluator.forcing import specpilot_scorer

    _, model, scorer_model = tiny
    scorer = specpilot_scorer(scorer_model)
    g = torch.Generator().manual_seed(0)
    dev = [torch.randint(3, 96, (7,), generator=g).tolist() for _ in range(2)]
    held = [torch.randint(3, 96, (6,), generator=g).tolist()]
    cfg = EngineConfig(drafter_kind="ngram", max_new_tokens=8, max_seq_len=64, ignore_eos=True)
    honest = EngineMeasure(lambda c: model)
    real = {id(dev): honest(cfg, dev, 2).outputs, id(held): honest(cfg, held, 2).outputs}

    def confident_swap(prompt, out):
        """`out` with its most confident token (largest stock margin) replaced by the runner-up; and where."""
        top2 = scorer(prompt + out[:-1])[len(prompt) - 1:].topk(2, -1)
        pos = int((top2.values[:, 0] - top2.values[:, 1]).argmax())
        return out[:pos] + [int(top2.indices[pos, 1])] + out[pos + 1:], pos

    def measure(split_to_corrupt=None, speed=100.0):  # real outputs; fixed figures: this test is about forcing
        def m(c, prompts, repeats):
            outs = [list(o) for o in real[id(prompts)]]
            if prompts is split_to_corrupt:
                outs[0] = confident_swap(prompts[0], outs[0])[0]
            return Measurement([speed, speed + 0.2], prompts, outs)
        return m

    gate, ref = Gate(scorer, held, repeats=2), measure(speed=90.0)
    ok = gate.judge(cfg, measure(), cfg, ref, dev)
    assert ok.passed, ok.reason
    bad = gate.judge(cfg, measure(dev), cfg, ref, dev)
    pos = confident_swap(dev[0], real[id(dev)][0])[1]
    assert not bad.passed and bad.check == "forcing" and "forcing: dev:" in bad.reason
    assert f"position {pos} " in bad.reason and "heldout" not in bad.figures  # rejected before held-out
    bad_held = gate.judge(cfg, measure(held), cfg, ref, dev)  # passes on dev, changes a held-out output
    assert not bad_held.passed and "forcing: heldout:" in bad_held.reason


# --- explore / integrate ------------------------------------------------------------------------------------------


def test_integration_keeps_combination_only_when_it_beats_best_single(tmp_path):
    good = run(Memory(tmp_path / "a.sqlite"), FakeMeasure(additive), budget=Budget(rounds=1))
    assert good.best.mechanism == "combine" and good.best.delta == {"num_draft_tokens": 6, "ngram_max": 3}
    bad = run(Memory(tmp_path / "b.sqlite"), FakeMeasure(antagonistic), budget=Budget(rounds=1))
    combo = [t for t in bad.trials if t.mechanism == "combine"]
    assert combo and not combo[0].passed
    assert bad.best.mechanism == "block_size" and bad.best.delta == {"num_draft_tokens": 6}


def test_error_in_a_trial_rejects_it_and_the_run_goes_on(tmp_path):
    def speed(cfg, prompts):
        if cfg.num_draft_tokens == 8:
            raise RuntimeError("out of memory")
        return additive(cfg, prompts)

    res = run(Memory(tmp_path / "m.sqlite"), FakeMeasure(speed), budget=Budget(rounds=1))
    broken = [t for t in res.trials if t.config["num_draft_tokens"] == 8]
    assert broken and broken[0].reason.startswith("error: RuntimeError: out of memory")
    assert res.best.delta == {"num_draft_tokens": 6, "ngram_max": 3}


def test_ray_flag_without_ray_says_so(tmp_path):
    from specpilot.loop.explore import ray_available

    if ray_available():
        pytest.skip("ray is installed here")
    with pytest.raises(ConfigError, match="ray is not installed"):
        run(Memory(tmp_path / "m.sqlite"), FakeMeasure(), budget=Budget(rounds=1), use_ray=True)


def test_timed_runs_never_overlap(tmp_path):
    """Two loops on one device in one process (e.g. two deployments): the lease keeps their clocks apart."""
    m = FakeMeasure(sleep=0.005)
    loops = [threading.Thread(target=run, args=(Memory(tmp_path / f"{i}.sqlite"), m),
                              kwargs={"budget": Budget(rounds=1, workers=4)}) for i in range(2)]
    for t in loops:
        t.start()
    for t in loops:
        t.join()
    assert len(m.calls) > 20 and m.max_active == 1


# --- agent explorer -----------------------------------------------------------------------------------------------

HONEST = """import pathlib, sys
brief = pathlib.Path(sys.argv[1]).read_text()
assert "## Gap table" in brief and "## Rules" in brief and "specpilot/evaluator/" in brief
p = pathlib.Path("specpilot/config.py")
p.write_text(p.read_text().replace("num_draft_tokens: int = 4", "num_draft_tokens: int = 6"))
"""
CHEAT = """import pathlib
p = pathlib.Path("specpilot/evaluator/forcing.py")
p.write_text(p.read_text() + "\\ndef force(*a, **k):\\n    return ForcingVerdict(True, 0, 0.0)\\n")
"""
SHORTCUT = """import pathlib
p = pathlib.Path("specpilot/config.py")
p.write_text(p.read_text().replace("ignore_eos: bool = False", "ignore_eos: bool = True"))
"""


@pytest.fixture
def agent_repo(tmp_path):
    repo = tmp_path / "repo"
    for f in ("specpilot/__init__.py", "specpilot/config.py", "specpilot/errors.py", "specpilot/evaluator/__init__.py",
              "specpilot/evaluator/forcing.py"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, repo / f)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["add", "."], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-qm", "base"], cwd=repo, check=True)
    for name, text in (("honest", HONEST), ("cheat", CHEAT), ("shortcut", SHORTCUT)):
        (tmp_path / f"{name}.py").write_text(text)
    return repo


def test_agent_honest_change_accepted_cheats_rejected(tmp_path, agent_repo):
    fake = FakeMeasure()
    extra = [lambda v, n=n: AgentExplorer(f"{sys.executable} {tmp_path / n}.py {{brief_file}}", agent_repo,
                                          name=f"agent:{n}", measure_factory=lambda wt: fake)
             for n in ("honest", "cheat", "shortcut")]
    res = run(Memory(tmp_path / "m.sqlite"), fake, budget=Budget(rounds=1, directions=0), extra=extra)
    by = {t.mechanism: t for t in res.trials}
    assert by["agent:honest"].verdict == "accepted", by["agent:honest"].reason
    assert by["agent:honest"].delta == {"num_draft_tokens": 6} and "num_draft_tokens: int = 6" in \
        by["agent:honest"].figures["patch"]
    assert by["agent:cheat"].verdict == "rejected" and by["agent:cheat"].reason.startswith("protected:")
    assert "specpilot/evaluator/forcing.py" in by["agent:cheat"].reason
    assert by["agent:shortcut"].verdict == "rejected" and by["agent:shortcut"].reason.startswith("regime:")
    assert res.best_config.num_draft_tokens == 6
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=agent_repo, capture_output=True, text=True).stdout
    assert len(worktrees.strip().splitlines()) == 1  # every agent worktree was removed


def test_driver_measures_the_worktree_engine(tiny_model_dir):
    """The default agent measure: the worktree's engine in a subprocess, clocked by the loop's own code."""
    from specpilot.engine import Engine
    from specpilot.models import load_model

    path = tiny_model_dir("qwen2", seed=0)
    cfg = EngineConfig(drafter_kind="ngram", max_new_tokens=10, max_seq_len=64, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12]]
    m = DriverMeasure(ROOT, str(path), None)(cfg, prompts, 2)
    from specpilot.drafters import NgramDrafter

    want = [Engine(load_model(path), cfg, NgramDrafter(cfg.ngram_max, cfg.ngram_min)).generate(p).output_ids
            for p in prompts]
    assert m.outputs == want and len(m.samples) == 2 and all(s > 0 for s in m.samples)
    assert m.config["num_draft_tokens"] == cfg.num_draft_tokens


# --- report and CLI ------------------------------------------------------------------------------------------------


def test_yardsticks_are_timed_once_remembered_and_stated_per_round(tmp_path):
    calls = []

    def ar():
        calls.append("ar")
        return {"tokens_per_s": 50.0, "label": "our AR"}

    def broken():
        raise ImportError("no stock package")

    path = tmp_path / "m.sqlite"
    mem = Memory(path)
    with pytest.raises(Killed):
        run(mem, FakeMeasure(fail_after=4), yardsticks={"ar": ar, "stock": broken})
    run_id = mem._q("SELECT max(id) FROM runs")[0][0]
    assert set(mem.yardsticks(run_id)) == {"ar"}  # the broken one is skipped, not fatal
    res = run(Memory(path), FakeMeasure(), resume_run=run_id, yardsticks={"ar": ar})
    assert calls == ["ar"], "a yardstick measured before the kill was measured again"
    base = res.baseline.median
    assert res.versus("ar") == pytest.approx(res.best.chain * base / 50.0)
    summary = res.summary()
    assert summary["ar_tokens_per_s"] == 50.0 and summary["speedup_vs_ar"] == pytest.approx(res.versus("ar"), 1e-3)
    assert "speedup_vs_stock" not in summary
    text = write_report(Memory(path), run_id, tmp_path / "out")["report"].read_text()
    assert f"vs our AR (50.000 tok/s, timed next to round 0): round 0 x{base / 50:.3f}" in text


def test_report_and_config_file_roundtrip(tmp_path):
    mem = Memory(tmp_path / "m.sqlite")
    res = run(mem, FakeMeasure(antagonistic), budget=Budget(rounds=2))
    paths = write_report(mem, res.run_id, tmp_path / "out")
    text = paths["report"].read_text()
    for t in res.trials:
        assert f"| {t.id} | {t.round} | {t.mechanism} |" in text
    assert "rejected" in text and "noise" in text or "slower" in text
    from specpilot.cli import build_parser, engine_config

    args = build_parser().parse_args(["bench", "--config", str(paths["config"])])
    assert engine_config(args) == res.best_config
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in text
    else:
        assert paths["speedup_png"].stat().st_size > 1000


def _tokenized_copy(src: Path, dst: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, dst)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(dst)
    return dst


def test_cli_optimize_end_to_end_on_tiny_model(tmp_path, tiny_model_dir, capsys):
    import argparse

    from specpilot.loop import add_optimize_parser, cmd_optimize

    model = _tokenized_copy(tiny_model_dir("llama", seed=3), tmp_path / "tiny")
    g = torch.Generator().manual_seed(1)
    for name, n in (("dev", 2), ("held", 2)):
        rows = [{"prompt": " ".join(f"w{i}" for i in torch.randint(3, 96, (4,), generator=g).tolist() * 2)}
                for _ in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "base.yaml").write_text("ignore_eos: true\nmax_seq_len: 64\n")
    parser = argparse.ArgumentParser()
    add_optimize_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "optimize", "--target", str(model), "--drafter-kind", "ngram", "--max-new-tokens", "8",
        "--config", str(tmp_path / "base.yaml"), "--dev-prompts-file", str(tmp_path / "dev.jsonl"),
        "--heldout-prompts-file", str(tmp_path / "held.jsonl"), "--rounds", "1", "--directions", "1",
        "--repeats", "2", "--memory", str(tmp_path / "m.sqlite"), "--out", str(tmp_path / "out")])
    assert cmd_optimize(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rounds"] == 1 and summary["trials"]["tried"] >= 1
    assert summary["ar_tokens_per_s"] > 0 and summary["stock_tokens_per_s"] > 0  # prompt lookup, transformers'
    assert summary["speedup_vs_ar"] > 0 and summary["speedup_vs_stock"] > 0
    assert "vs our AR" in Path(summary["report"]).read_text()
    assert summary["trials"]["tried"] == summary["trials"]["accepted"] + summary["trials"]["rejected"]
    assert Path(summary["report"]).is_file() and Path(summary["config_file"]).is_file()
    mem = Memory(tmp_path / "m.sqlite")
    base = mem.finished_trials(summary["run"])[0]
    assert base.verdict == "baseline" and base.figures["dev"]["median"] > 0  # real engine, forcing passed
    assert mem.rounds(summary["run"])[0]["gaps"][0]["measured_s"] is not None  # CPU: measured stage times


def test_cpu_runs_default_to_the_short_main_job_and_flags_win(tmp_path):
    from specpilot import deployments as dep
    from specpilot.cli import build_parser
    from specpilot.loop import DEFAULTS, _settings

    s = _settings(build_parser().parse_args(["optimize"]))
    assert {k: s[k] for k in dep.OPTIMIZE_CPU} == dep.OPTIMIZE_CPU
    s = _settings(build_parser().parse_args(["optimize", "--rounds", "3", "--num-prompts", "2"]))
    assert s["rounds"] == 3 and s["num_prompts"] == 2 and s["trials"] == dep.OPTIMIZE_CPU["trials"]
    s = _settings(build_parser().parse_args(["optimize", "--device", "cuda"]))
    assert s["rounds"] == DEFAULTS["rounds"] and s["trials"] == DEFAULTS["trials"]
    f = tmp_path / "d.yaml"
    f.write_text("device: cuda\nrounds: 5\n")
    s = _settings(build_parser().parse_args(["optimize", "--deployment", str(f)]))
    assert s["rounds"] == 5 and s["trials"] == DEFAULTS["trials"]


@pytest.mark.parametrize("argv, deployment, message", [
    (["--rounds", "-1"], None, "rounds must be a whole number >= 0, got -1"),
    (["--wall-s", "0"], None, "wall_s must be a number > 0"),
    (["--workers", "0"], None, "workers must be a whole number >= 1"),
    (["--num-prompts", "0"], None, "num_prompts must be a whole number >= 1"),
    ([], "repeats: 1\n", "repeats must be a whole number >= 2, got 1"),
    ([], "rounds: three\n", "rounds must be a whole number >= 0, got 'three'"),
    ([], "trials: true\n", "trials must be a whole number >= 1, got True"),
])
def test_optimize_rejects_bad_numbers_before_loading_any_model(tmp_path, monkeypatch, capsys, argv, deployment,
                                                                message):
    """A bad budget in a flag or the deployment file is one clear line and exit 2, before the minutes of model
    loading it would otherwise cost (or a run with a nonsense budget)."""
    import specpilot.engine
    from specpilot.cli import main

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(specpilot.engine, "load_target", no_load)
    if deployment is not None:
        f = tmp_path / "d.yaml"
        f.write_text(deployment)
        argv = argv + ["--deployment", str(f)]
    assert main(["optimize", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def test_optimize_default_settings_pass_the_check():
    from specpilot.cli import build_parser
    from specpilot.loop import _check_settings, _settings

    for argv in (["optimize"], ["optimize", "--device", "cuda"]):
        _check_settings(_settings(build_parser().parse_args(argv)))


def test_time_engine_warms_every_prompt_shape_before_timing():
    """A first call per prompt length is slow (new prefill shapes: kernel choices, attention plans); timing starts
    only after every prompt has run once, so the repeats agree and the gate's noise is not the warm-up."""
    from types import SimpleNamespace

    from specpilot.loop.explore import time_engine

    seen = set()

    def generate(ids):
        if len(ids) not in seen:  # the first time this prefill shape is met
            seen.add(len(ids))
            time.sleep(0.05)
        time.sleep(0.005)
        return SimpleNamespace(output_ids=[1] * 8, accepted_lengths=[1], drafted_lengths=[2], stage_s={},
                               num_target_forwards=4)

    out = time_engine(generate, [[1] * 40, [2] * 55, [3] * 70], repeats=3)
    s = out["samples"]
    assert max(s) - min(s) < 0.3 * min(s), s  # a one-prompt warm-up left the first repeat ~4x slower
