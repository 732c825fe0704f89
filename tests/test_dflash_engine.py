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


def test_stock_dflash_package_agrees_with_our_engine(setup, tiny_model_dir):
    """The stock system for DFlash is z-lab's own loop on the same checkpoint: same greedy tokens (its per-step stats need CUDA, so on CPU only the tokens are compared)."""
    pytest.importorskip("dflash", reason="z-lab's dflash package not installed")
    from specpilot.evaluator.stock import DFlashStockSystem

    target, path = setup
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=4, max_new_tokens=20, max_seq_len=128, ignore_eos=True)
    ours = Engine(target, cfg, build_drafter(cfg, str(path), target))
    stock = DFlashStockSystem(tiny_model_dir("qwen3"), path, dtype=torch.float32, device="cpu", max_new_tokens=20,
                              eos_ids=())
    p = list(range(3, 14))
    a, b = ours.generate(p), stock.generate(p)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 20
