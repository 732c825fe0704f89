"""EngineConfig.early_draft: the next DFlash block is launched from the verify step's verdict on the device, before
the host reads it (engine/spec.py, drafters/dflash.py `launch_early`). On CPU the same code runs in order: the
output must equal AR's, the drafts must equal the normal loop's step for step, and the early path must really
be taken (not a silent fallback to observe + propose)."""

import pytest
import torch

from specpilot.config import EngineConfig, SamplingConfig
from specpilot.drafters.dflash import DFlashBlockDrafter
from specpilot.drafters.ngram import NgramDrafter
from specpilot.drafters.ngram_assist import NgramAssistedDrafter
from specpilot.engine import Engine
from specpilot.errors import ConfigError
from specpilot.models import load_model
from specpilot.models.dflash import DFlashConfig, DFlashDrafter


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    target = load_model(tiny_model_dir("qwen3"))
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=5, mask_token_id=95,
                       target_layer_ids=(0, 1), num_target_layers=2, vocab_size=96)
    torch.manual_seed(0)
    return target, DFlashDrafter(cfg).eval()


def _drafter(target, net, assist: bool):
    d = DFlashBlockDrafter(net, target, 128, static=True)
    return NgramAssistedDrafter(d, NgramDrafter(3, 1), 2) if assist else d


def _record(drafter, monkeypatch) -> list:
    """Every draft the engine gets from `drafter`, as token lists."""
    seen, propose = [], drafter.propose

    def recorded(*a):
        d = propose(*a)
        seen.append(d.token_ids.tolist())
        return d

    monkeypatch.setattr(drafter, "propose", recorded)
    return seen


def _count_early(drafter, monkeypatch):
    inner = getattr(drafter, "inner", drafter)
    calls = {"launched": 0, "proposed": 0}
    launch, draft = inner.launch_early, inner._draft

    def counted_launch(*a):
        ok = launch(*a)
        calls["launched"] += ok
        return ok

    def counted_draft(*a, **kw):
        out = draft(*a, **kw)
        calls["proposed"] += inner.last_pass == "early"
        return out

    monkeypatch.setattr(inner, "launch_early", counted_launch)
    monkeypatch.setattr(inner, "_draft", counted_draft)
    return calls


@pytest.mark.parametrize("assist", [False, True])
@pytest.mark.parametrize("max_new", [5, 7, 40])
def test_early_draft_equals_ar_and_the_normal_loop(setup, monkeypatch, assist, max_new):
    target, net = setup
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=net.block_size - 1, max_new_tokens=max_new,
                       max_seq_len=128, ignore_eos=True, early_draft=True)
    ar = Engine(target, cfg.with_(drafter_kind="none", early_draft=False))
    early_d, plain_d = _drafter(target, net, assist), _drafter(target, net, assist)
    calls = _count_early(early_d, monkeypatch)
    drafts_early, drafts_plain = _record(early_d, monkeypatch), _record(plain_d, monkeypatch)
    early, plain = Engine(target, cfg, early_d), Engine(target, cfg.with_(early_draft=False), plain_d)
    g = torch.Generator().manual_seed(5)
    for n in (4, 11, 23):
        p = torch.randint(0, 90, (n,), generator=g).tolist()
        # a repeated stretch, so prompt lookup has something to copy
        p = p + p[: n // 2] if assist else p
        want = ar.generate(p)
        got, ref = early.generate(p), plain.generate(p)
        assert got.output_ids == want.output_ids == ref.output_ids
        # same drafts every step (so the same acceptance)
        assert drafts_early == drafts_plain and got.accepted_lengths == ref.accepted_lengths
    # every early pass was used by the next step's propose (no launch for a step that does not come)
    assert calls["proposed"] == calls["launched"]
    if max_new <= net.block_size:  # a first step might reach the token limit: the next might not draft, no launch
        assert calls["launched"] == 0
    else:
        assert calls["launched"] > 0


@pytest.mark.parametrize("assist", [False, True])
def test_early_draft_under_sampling_and_unfused_acceptance(setup, monkeypatch, assist):
    """Sampled (seeded) and greedy without the fused verdict: the packed verdict is a device tensor there too, so
    the early pass runs, and outputs, acceptance and drafts equal the normal loop's (DFlash drafts are argmax, so
    launching early moves no random draw); greedy also equals AR."""
    target, net = setup
    base = EngineConfig(drafter_kind="dflash", num_draft_tokens=net.block_size - 1, max_new_tokens=30,
                        max_seq_len=128, ignore_eos=True, early_draft=True)
    ar = Engine(target, base.with_(drafter_kind="none", early_draft=False))
    for cfg in (base.with_(sampling=SamplingConfig(temperature=0.9, seed=3)), base.with_(fused_accept=False)):
        early_d, plain_d = _drafter(target, net, assist), _drafter(target, net, assist)
        calls = _count_early(early_d, monkeypatch)
        drafts_early, drafts_plain = _record(early_d, monkeypatch), _record(plain_d, monkeypatch)
        early, plain = Engine(target, cfg, early_d), Engine(target, cfg.with_(early_draft=False), plain_d)
        g = torch.Generator().manual_seed(7)
        for n in (6, 17):
            p = torch.randint(0, 90, (n,), generator=g).tolist()
            p = p + p[: n // 2] if assist else p
            got, ref = early.generate(p), plain.generate(p)
            assert got.output_ids == ref.output_ids and got.accepted_lengths == ref.accepted_lengths
            if cfg.sampling.greedy:
                assert got.output_ids == ar.generate(p).output_ids
        assert drafts_early == drafts_plain
        assert calls["launched"] > 0 and calls["proposed"] == calls["launched"]


def test_early_draft_needs_the_static_step(setup):
    """An eager drafter (no static step) cannot launch early: the loop falls back to observe + propose."""
    target, net = setup
    d = DFlashBlockDrafter(net, target, 128)
    assert not d.launch_early(torch.tensor([1, 2, 3]), torch.zeros(2, net.fc.in_features))
    with pytest.raises(RuntimeError):
        d.took_early(2)


def test_early_draft_config_is_a_bool():
    with pytest.raises(ConfigError):
        EngineConfig(early_draft="false")


def test_early_launch_drafts_what_observe_and_propose_draft(setup):
    """Drafter level, for every count of accepted drafts (the engine's tiny random models accept few): launching
    from a verdict [a, next, ...] and the verify block's K+1 feature rows drafts what observing the a + 1
    committed rows and proposing drafts, and keeps the same context bookkeeping."""
    target, net = setup
    B = net.block_size
    early, plain = (DFlashBlockDrafter(net, target, 128, static=True) for _ in range(2))
    g = torch.Generator().manual_seed(7)
    feats = torch.randn(80, net.fc.in_features, generator=g)
    ids = torch.randint(0, 90, (80,), generator=g).tolist()
    committed = 6
    for d in (early, plain):  # the prompt: the first pass, eager in both
        d.observe(feats[: committed - 1])
        d.propose(ids[:committed], B - 1)
    for c in [1, B, 3, 2, B - 1, 1, 4]:  # committed tokens per step (accepted drafts + 1)
        block = feats[committed - 1: committed - 1 + B]  # the verify block's rows: last token + B - 1 drafts
        verdict = torch.tensor([c - 1, ids[committed + c - 1]] + ids[committed: committed + B - 1])
        assert early.launch_early(verdict, block)
        early.took_early(c)
        plain.observe(block[:c])
        committed += c
        a, b = early.propose(ids[:committed], B - 1), plain.propose(ids[:committed], B - 1)
        assert a.token_ids.tolist() == b.token_ids.tolist(), c
        assert early.fed == plain.fed == committed - 1
