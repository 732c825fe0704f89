"""The fused one-token decode path (models/fused_decode.py, EngineConfig.fused_decode) against the regular one.

TRITON_INTERPRET=1 (conftest) runs its kernels on the CPU: the fused GEMV with norm prologue / residual and
SiLU * up epilogues, RoPE with the K/V write, and the one-launch attention.
"""

import copy
import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed")


def _decode(model, ids, steps: int, return_layers=()):
    """Prefill ids[:6] (regular path), then `steps` one-token steps over the whole pool (as graphed):
    -> (per-step logits, per-step captured layers, the cache)."""
    cache = model.new_cache(1, 32)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        model(ids[:, :6], pos[:, :6], cache, kv_len=6)
        logits, layers = [], []
        for t in range(6, 6 + steps):
            out = model(ids[:, t:t + 1], pos[:, t:t + 1], cache, kv_len=None, return_layers=return_layers)
            hidden, captured = out if return_layers else (out, [])
            logits.append(model.logits(hidden))
            layers.append(captured)
    return logits, layers, cache


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_fused_decode_steps_match_the_regular_path(tiny_model_dir, family):
    from specpilot.models import load_model

    ref = load_model(tiny_model_dir(family)).fuse_projections()
    fast = copy.deepcopy(ref).use_fused_decode()
    assert fast.fused_decode
    ids = torch.tensor([[3, 9, 27, 4, 11, 5, 8, 2, 6, 7]])
    la, ca, cache_a = _decode(ref, ids, 4, return_layers=(0, 1))
    lb, cb, cache_b = _decode(fast, ids, 4, return_layers=(0, 1))
    for a, b in zip(la, lb):
        assert (a - b).abs().max().item() < 1e-4
    for a, b in zip(ca, cb):  # captured layer outputs (a conditioned drafter reads them)
        assert all((p - q).abs().max().item() < 1e-4 for p, q in zip(a, b))
    # the K/V the fused steps wrote (positions 6..9) are the regular path's
    assert (cache_a.k - cache_b.k).abs().max().item() < 1e-5 and (cache_a.v - cache_b.v).abs().max().item() < 1e-5
    assert cache_b.k[:, :, :, 10:].abs().max().item() == 0  # nothing written past the last position


def test_fused_decode_is_used_only_for_one_token_steps(tiny_model_dir, monkeypatch):
    from specpilot.models import fused_decode, load_model

    model = load_model(tiny_model_dir("qwen2")).use_fused_decode()
    calls = []
    real = fused_decode.decode_layer
    monkeypatch.setattr(fused_decode, "decode_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = model.new_cache(1, 16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, kv_len=3)  # prefill: regular
        assert not calls
        model(torch.tensor([[4]]), torch.tensor([[3]]), cache, kv_len=None)  # one token: fused, every layer
        assert len(calls) == model.config.num_hidden_layers
        calls.clear()
        model(torch.tensor([[4, 5]]), torch.tensor([[3, 4]]), cache, kv_len=None)  # a verify block: regular
        mask = torch.ones(1, 1, 16, dtype=torch.bool)
        model(torch.tensor([[4]]), torch.tensor([[3]]), cache, kv_len=None, attn_mask=mask)  # a custom mask
        assert not calls
    model.use_fused_decode(False)
    assert not model.fused_decode


@pytest.mark.parametrize("drafter_kind", ["none", "model"])
def test_greedy_outputs_unchanged_with_fused_decode(tiny_model_dir, drafter_kind):
    """AR with the fused steps, and speculative decoding whose small drafter runs them (its one-token passes),
    give the regular AR's tokens."""
    from specpilot.config import EngineConfig
    from specpilot.engine import Engine, build_drafter
    from specpilot.models import load_model

    path = tiny_model_dir("qwen2")
    ref = load_model(path)
    fast = load_model(path).use_fused_decode()
    cfg = EngineConfig(drafter_kind=drafter_kind, num_draft_tokens=3, max_new_tokens=8, max_seq_len=32,
                       ignore_eos=True, ngram_assist=0)
    prompt = [5, 6, 7, 5, 6, 7, 1, 2]
    want = Engine(ref, cfg.with_(drafter_kind="none")).generate(prompt).output_ids
    drafter = None
    if drafter_kind == "model":
        drafter = build_drafter(cfg, load_model(path).use_fused_decode(), fast)  # itself: every draft accepted
    got = Engine(fast, cfg, drafter).generate(prompt)
    assert got.output_ids == want
    if drafter_kind == "model":
        assert got.num_target_forwards < len(want)  # drafts were accepted: the drafter really ran


def test_fused_decode_field_is_on_by_default_cuda_only_and_a_loop_mechanism():
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_layout
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY
    from specpilot.models import ModelConfig, random_model

    assert EngineConfig().fused_decode  # on since the H200 runs (BENCHMARKS.md, session 12)
    assert "fused_decode" in EngineMeasure.LAYOUT and "fused_decode" in REGISTRY
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = random_model(cfg, dtype=torch.float32, device="cpu")
    _apply_layout(model, EngineConfig(fused_decode=True))  # a CPU config: the switch applies on CUDA only
    assert not model.fused_decode


def test_a_head_dim_the_kernels_cannot_take_keeps_the_eager_path(monkeypatch):
    """head_dim 24 (not a power of two): on CUDA the engine warns and keeps SDPA / the regular step instead of
    failing at the first step (checked here by pretending the CPU config is a CUDA one)."""
    import specpilot.engine as eng
    from specpilot.config import EngineConfig
    from specpilot.models import ModelConfig, random_model

    monkeypatch.setattr(eng, "_kernel_on", lambda config, field="attention_kernel": getattr(config, field))
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    model = random_model(cfg, dtype=torch.float32, device="cpu")
    with pytest.warns(RuntimeWarning, match="head_dim 24"):
        eng._apply_layout(model, EngineConfig(norm_kernel=False, rope_kernel=False))
    assert not model.attention_kernel and not model.fused_decode
    ok = random_model(dataclasses.replace(cfg, head_dim=16, hidden_size=32), dtype=torch.float32, device="cpu")
    eng._apply_layout(ok, EngineConfig(norm_kernel=False, rope_kernel=False))
    assert ok.attention_kernel and ok.fused_decode
