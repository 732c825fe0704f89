"""DFlash inside the engine: a (random) z-lab-format drafter, loaded by path, drafts whole blocks; greedy output
equals AR token for token and the drafter sees exactly the context the reference would give it."""

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.engine import Engine, build_drafter
from specpilot.models import load_model
from specpilot.models.dflash import DFlashConfig, DFlashDrafter
from specpilot.models.dflash_io import save_dflash


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    target = load_model(tiny_model_dir("qwen3"))
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=5, mask_token_id=95,
                       target_layer_ids=(0, 1), num_target_layers=2, vocab_size=96)
    torch.manual_seed(0)
    net = DFlashDrafter(cfg).eval()
    path = tmp_path_factory.mktemp("dflash")
    save_dflash(net, path)
    return target, path


@pytest.mark.parametrize("k", [2, 4])
def test_dflash_greedy_equals_ar(setup, k):
    target, path = setup
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=k, max_new_tokens=30, max_seq_len=128, ignore_eos=True)
    spec = Engine(target, cfg, build_drafter(cfg, str(path), target))
    ar = Engine(target, cfg.with_(drafter_kind="none"))
    g = torch.Generator().manual_seed(1)
    for n in (3, 9, 17):
        p = torch.randint(0, 90, (n,), generator=g).tolist()
        got, want = spec.generate(p), ar.generate(p)
        assert got.output_ids == want.output_ids
        assert max(got.drafted_lengths) == k  # whole blocks were drafted, one network pass each


def test_dflash_context_stays_in_step(setup):
    """Every position is fed to the draft cache exactly once, in order (the drafter raises otherwise)."""
    target, path = setup
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=4, max_new_tokens=25, max_seq_len=128, ignore_eos=True)
    drafter = build_drafter(cfg, str(path), target)
    res = Engine(target, cfg, drafter).generate(list(range(1, 12)))
    buffered = sum(f.shape[0] for f in drafter.pending)
    assert drafter.fed + buffered == len(res.prompt_ids) + len(res.output_ids) - 1  # all committed but the last


def test_dflash_needs_a_checkpoint(setup):
    from specpilot.errors import ConfigError

    with pytest.raises(ConfigError):
        build_drafter(EngineConfig(drafter_kind="dflash"), None, setup[0])


@pytest.mark.parametrize("storage", [None, "int8"])
def test_stock_dflash_package_agrees_with_our_engine(setup, tiny_model_dir, tmp_path, storage):
    """The stock system for DFlash is z-lab's own loop on the same checkpoint: same greedy tokens (its per-step
    stats need CUDA, so on CPU only the tokens are compared). A checkpoint in SpecPilot's int8 storage reaches
    z-lab's loop as a float export of exactly the weights our engine dequantizes."""
    pytest.importorskip("dflash", reason="z-lab's dflash package not installed")
    from specpilot.evaluator.stock import DFlashStockSystem
    from specpilot.models.dflash_io import load_dflash

    target, path = setup
    if storage is not None:
        save_dflash(load_dflash(path), tmp_path / storage, storage=storage, group_size=16)
        path = tmp_path / storage
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=4, max_new_tokens=20, max_seq_len=128, ignore_eos=True)
    ours = Engine(target, cfg, build_drafter(cfg, str(path), target))
    stock = DFlashStockSystem(tiny_model_dir("qwen3"), path, dtype=torch.float32, device="cpu", max_new_tokens=20,
                              eos_ids=())
    p = list(range(3, 14))
    a, b = ours.generate(p), stock.generate(p)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 20


def test_static_draft_step_equals_eager(setup):
    """The static-shape draft step (what is captured as a CUDA graph on a GPU: context padded to a block, the
    whole cache attended) drafts exactly what the eager step drafts, for every count of new context rows."""
    from specpilot.drafters.dflash import DFlashBlockDrafter
    from specpilot.models.dflash_io import load_dflash

    target, path = setup
    net = load_dflash(path)
    B = net.block_size
    eager = DFlashBlockDrafter(net, target, 64)
    static = DFlashBlockDrafter(net, target, 64, static=True)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(60, net.fc.in_features, generator=g)
    ids = torch.randint(0, 90, (60,), generator=g).tolist()
    committed = 8  # the prompt; its first step runs eagerly in both
    for d in (eager, static):
        d.observe(feats[: committed - 1])
    steps = [(committed, eager.propose(ids[:committed], B - 1), static.propose(ids[:committed], B - 1))]
    for c in [1, 3, B, 2, 1, B - 1, 4, 1]:  # new context rows per step (the engine: accepted drafts + 1)
        for d in (eager, static):
            d.observe(feats[committed - 1: committed - 1 + c])
        committed += c
        steps.append((committed, eager.propose(ids[:committed], B - 1), static.propose(ids[:committed], B - 1)))
    for n, a, b in steps:
        assert a.token_ids.tolist() == b.token_ids.tolist(), n
    assert static.fed == eager.fed == committed - 1
    # fewer tokens asked: the static step returns the head of its whole-block draft
    for d in (eager, static):
        d.observe(feats[committed - 1: committed])
    full = eager.propose(ids[: committed + 1], B - 1).token_ids.tolist()
    assert static.propose(ids[: committed + 1], 2).token_ids.tolist() == full[:2]


def test_static_draft_step_is_used(setup, monkeypatch):
    """Not a silent fallback: after the first step, full blocks go through the static step."""
    from specpilot.drafters.dflash import DFlashBlockDrafter
    from specpilot.models.dflash_io import load_dflash

    target, path = setup
    net = load_dflash(path)
    d = DFlashBlockDrafter(net, target, 64, static=True)
    calls = []
    orig = d._static_step
    monkeypatch.setattr(d, "_static_step", lambda: calls.append(1) or orig())
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=net.block_size - 1, max_new_tokens=20, max_seq_len=64,
                       ignore_eos=True)
    res = Engine(target, cfg, d).generate(list(range(1, 9)))
    want = Engine(target, cfg.with_(drafter_kind="none")).generate(list(range(1, 9)))
    assert res.output_ids == want.output_ids
    assert len(calls) >= 2


def test_propose_logits_is_propose_with_logits(setup):
    """`propose_logits` (scripts/tree_tau.py) runs propose's eager step and keeps the logits: their argmax is what
    `propose` drafts, step after step, with the same context bookkeeping."""
    from specpilot.drafters.dflash import DFlashBlockDrafter
    from specpilot.models.dflash_io import load_dflash

    target, path = setup
    net = load_dflash(path)
    B = net.block_size
    plain, with_logits = DFlashBlockDrafter(net, target, 64), DFlashBlockDrafter(net, target, 64)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(40, net.fc.in_features, generator=g)
    ids = torch.randint(0, 90, (40,), generator=g).tolist()
    committed = 6
    for d in (plain, with_logits):
        d.observe(feats[: committed - 1])
    for c in [0, 2, B, 1, 3]:
        for d in (plain, with_logits):
            d.observe(feats[committed - 1: committed - 1 + c])
        committed += c
        k = 3 if c == 1 else B - 1
        logits = with_logits.propose_logits(ids[:committed], k)
        assert logits.shape == (k, net.config.vocab_size)
        assert logits.argmax(-1).tolist() == plain.propose(ids[:committed], k).token_ids.tolist(), committed
    assert with_logits.fed == plain.fed == committed - 1
