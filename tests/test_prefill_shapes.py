"""Eager passes padded to a few lengths (engine/runner.py `padded_length`, `pad_shapes`): the same numbers for the
real tokens, the same greedy outputs, and few distinct shapes."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, build_drafter
from specpilot.engine.reference import reference_greedy
from specpilot.engine.runner import ModelRunner, padded_length
from specpilot.models import load_model
from specpilot.models.dflash import DFlashConfig, DFlashDrafter, draft_block


def test_padded_length_is_a_few_shapes_never_short_never_past_the_room():
    assert [padded_length(t, 4096) for t in (1, 16, 17, 100, 512, 513, 1025, 4000)] == [
        16, 16, 32, 128, 512, 1024, 1536, 4096]
    shapes = {padded_length(t, 4096) for t in range(1, 4097)}
    assert len(shapes) == 13
    for t in range(1, 300):
        for room in (t, t + 3, 64, 4096):
            n = padded_length(t, room)
            assert n >= t and (n <= room or n == t)
    assert padded_length(100, 90) == 100  # no room: unpadded (the caller's own checks decide whether it fits)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {"qwen2": load_model(tiny_model_dir("qwen2", seed=0)), "qwen3": load_model(tiny_model_dir("qwen3")),
            "other": load_model(tiny_model_dir("qwen2", seed=1))}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("T,start", [(5, 0), (17, 0), (40, 0), (9, 6)])
def test_padded_pass_gives_the_real_tokens_the_unpadded_numbers(models, family, T, start):
    model = models[family]
    g = torch.Generator().manual_seed(T)
    prefix = torch.randint(3, 96, (start,), generator=g)
    ids = torch.randint(3, 96, (T,), generator=g)
    runs = {}
    for pad in (False, True):
        r = ModelRunner(model, model.new_cache(1, 96), capture_layers=(0, 1), pad_shapes=pad)
        if start:
            r.prefill(prefix, 0)
        r.prefill(ids, start)
        hidden = r.last_hidden.clone()
        logits = r.step(ids[:3], start + T).clone()  # an unbucketed step (padded too), after the prefill
        runs[pad] = (hidden, r.cache.k[:, :, :, : start + T + 3].clone(), logits)
    for a, b in zip(runs[False], runs[True]):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["none", "ngram", "model", "dflash"])
def test_padded_engines_equal_the_reference_greedy_output(models, tiny_dflash_dir, kind, monkeypatch):
    """Greedy outputs with every eager pass padded (target prefill, a model drafter's first feed, DFlash's first
    pass) equal plain greedy decoding, also near the end of the pool (max_seq_len 40: padding capped by the room).
    The engine pads as on CUDA (its `_pads` switch), through the same wiring."""
    import specpilot.engine as engine

    monkeypatch.setattr(engine, "_pads", lambda config: config.pad_shapes)
    target = models["qwen3" if kind == "dflash" else "qwen2"]
    for max_seq_len, prompt_len in ((128, 21), (40, 30)):
        cfg = EngineConfig(drafter_kind=kind, num_draft_tokens=4, max_new_tokens=20, max_seq_len=max_seq_len,
                           ignore_eos=True)
        drafter = None
        if kind == "ngram":
            drafter = NgramDrafter(3, 1)
        elif kind == "model":
            drafter = build_drafter(cfg, models["other"], target)
        elif kind == "dflash":
            drafter = build_drafter(cfg, tiny_dflash_dir, target)
        eng = Engine(target, cfg, drafter)
        assert eng.runner.pad_shapes and (kind != "dflash" or drafter.pad_shapes)  # (through prompt lookup's wrapper)
        g = torch.Generator().manual_seed(prompt_len)
        prompt = (torch.randint(3, 96, (7,), generator=g).tolist() * 5)[:prompt_len]
        got = eng.generate(prompt)
        want = reference_greedy(target, prompt, len(got.output_ids))
        assert got.output_ids == want


def test_padded_dflash_first_pass_drafts_as_unpadded(models):
    """The DFlash eager pass over a whole prompt, its context padded: the same draft logits, and the padding's
    cache slots (from the anchor on) are never read as context."""
    target = models["qwen3"]
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=5, mask_token_id=95,
                       target_layer_ids=(0, 1), num_target_layers=2, vocab_size=96)
    torch.manual_seed(1)
    net = DFlashDrafter(cfg).eval()
    C = 13
    ctx = torch.randn(C, 2 * 64)
    out = {}
    for pad_to in (None, 16, 32):
        cache = net.new_cache(1, 64)
        cache.k.fill_(7.0)  # stale junk everywhere: what the padding and the mask must keep out
        cache.v.fill_(-7.0)
        with torch.inference_mode():
            out[pad_to] = draft_block(net, target, 5, ctx, anchor_pos=C, cache=cache, return_logits=True,
                                      pad_to=pad_to)
    torch.testing.assert_close(out[16], out[None], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[32], out[None], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="slots"):
        draft_block(net, target, 5, ctx, anchor_pos=C, cache=net.new_cache(1, 20), pad_to=32)


def test_pad_shapes_field_reaches_every_runner_on_cuda_only(models, monkeypatch):
    import specpilot.engine as engine

    assert not engine._pads(EngineConfig(device="cpu")) and engine._pads(EngineConfig(device="cuda"))
    assert not engine._pads(EngineConfig(device="cuda", pad_shapes=False))
    target = models["qwen2"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_seq_len=64)
    eng = Engine(target, cfg, build_drafter(cfg, models["other"], target))
    assert not eng.runner.pad_shapes and not eng.drafter.inner.runner.pad_shapes  # CPU: exact shapes
    monkeypatch.setattr(engine, "_pads", lambda config: config.pad_shapes)  # as on CUDA
    eng = Engine(target, cfg, build_drafter(cfg, models["other"], target))
    assert eng.runner.pad_shapes and eng.drafter.inner.runner.pad_shapes
    off = cfg.with_(pad_shapes=False)
    assert not Engine(target, off, build_drafter(off, models["other"], target)).runner.pad_shapes
