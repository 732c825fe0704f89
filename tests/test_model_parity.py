"""Our dense model vs transformers (the reference): logits and greedy continuations, tiny random configs."""

import pytest
import torch

from specpilot.errors import ConfigError
from specpilot.models import load_model


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False)])
def test_logits_match_transformers(tiny_model_dir, family, tie):
    import transformers

    path = tiny_model_dir(family, tie)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        cache = ours.new_cache(1, 64)
        pos = torch.arange(23)[None]
        got = ours.logits(ours(ids, pos, cache, kv_len=23))
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_incremental_decode_matches_full_forward(tiny_model_dir, family):
    """Prefill + chunked verification + one-token decode over the cache == one full causal pass."""
    ours = load_model(tiny_model_dir(family), dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = ours.logits(ours(ids, torch.arange(20)[None], ours.new_cache(1, 32), kv_len=20))
        cache = ours.new_cache(1, 32)
        parts = []
        for lo, hi in [(0, 9), (9, 14), (14, 15), (15, 20)]:
            pos = torch.arange(lo, hi)[None]
            parts.append(ours.logits(ours(ids[:, lo:hi], pos, cache, kv_len=hi)))
        # whole-pool attention (static shapes, as CUDA graphs use) gives the same numbers
        static = ours.logits(ours(ids[:, 15:20], torch.arange(15, 20)[None], cache))
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-4
    assert (static - full[:, 15:]).abs().max().item() < 1e-4


def test_rollback_overwrites_stale_slots(tiny_model_dir):
    """Rejected tokens left in the cache must not leak into later steps once their positions are rewritten."""
    ours = load_model(tiny_model_dir("qwen2"), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    prefix, junk, real = (torch.randint(0, 96, (1, n), generator=g) for n in (10, 4, 4))
    with torch.no_grad():
        cache = ours.new_cache(1, 32)
        ours(prefix, torch.arange(10)[None], cache, kv_len=10)
        ours(junk, torch.arange(10, 14)[None], cache, kv_len=14)  # "rejected draft"
        got = ours.logits(ours(real, torch.arange(10, 14)[None], cache, kv_len=14))
        seq = torch.cat([prefix, real], 1)
        want = ours.logits(ours(seq, torch.arange(14)[None], ours.new_cache(1, 32), kv_len=14))[:, 10:]
    assert (got - want).abs().max().item() < 1e-4


def test_return_layers_matches_hf_hidden_states(tiny_model_dir):
    import transformers

    path = tiny_model_dir("qwen3")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hs = ref(ids, output_hidden_states=True).hidden_states  # [embeddings, layer0 out, layer1 out(normed? no)]
        _, layers = ours(ids, torch.arange(7)[None], ours.new_cache(1, 8), kv_len=7, return_layers=(0,))
    assert (layers[0] - hs[1]).abs().max().item() < 1e-5


def test_batch_rows_at_different_positions(tiny_model_dir):
    ours = load_model(tiny_model_dir("llama"), dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        singles = [ours.logits(ours(ids[i:i + 1], torch.arange(12)[None], ours.new_cache(1, 16), kv_len=12)) for i in range(2)]
        cache = ours.new_cache(2, 16)
        ours(ids[:, :8], torch.arange(8).expand(2, 8), cache, kv_len=12)
        pos = torch.tensor([[8, 9, 10, 11], [8, 9, 10, 11]])
        got = ours.logits(ours(ids[:, 8:], pos, cache, kv_len=12))
    assert (got[0] - singles[0][0, 8:]).abs().max() < 1e-4
    assert (got[1] - singles[1][0, 8:]).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_fused_projections_give_the_same_logits(tiny_model_dir, family):
    path = tiny_model_dir(family)
    plain, fused = load_model(path), load_model(path).fuse_projections()
    assert not hasattr(fused.model.layers[0].self_attn, "q_proj") and hasattr(fused.model.layers[0].mlp, "gate_up_proj")
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(11)[None]
    with torch.no_grad():
        a = plain.logits(plain(ids, pos, plain.new_cache(1, 16), kv_len=11))
        b = fused.logits(fused(ids, pos, fused.new_cache(1, 16), kv_len=11))
    assert (a - b).abs().max().item() < 1e-5


def test_last_layer_stops_early_with_the_same_captured_layers(tiny_model_dir):
    """last_layer=k: the captured layers are the full pass's bit for bit, hidden is None, later layers never run
    (their cache slots stay empty); last_layer=None or L-1 is today's full pass."""
    ours = load_model(tiny_model_dir("qwen3"), dtype=torch.float32)
    L = ours.config.num_hidden_layers
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        full_hidden, full_layers = ours(ids, pos, ours.new_cache(2, 16), kv_len=9, return_layers=(0,))
        cache = ours.new_cache(2, 16)
        hidden, layers = ours(ids, pos, cache, kv_len=9, return_layers=(0,), last_layer=0)
        assert hidden is None and torch.equal(layers[0], full_layers[0])
        assert cache.k[0].any() and not cache.k[1:].any()  # layers after 0 were skipped
        for last in (None, L - 1):
            h, ls = ours(ids, pos, ours.new_cache(2, 16), kv_len=9, return_layers=(0,), last_layer=last)
            assert torch.equal(h, full_hidden) and torch.equal(ls[0], full_layers[0])
        for bad in (-1, L):
            with pytest.raises(ConfigError, match="last_layer"):
                ours(ids, pos, ours.new_cache(2, 16), kv_len=9, last_layer=bad)
        with pytest.raises(ConfigError, match="reach past"):
            ours(ids, pos, ours.new_cache(2, 16), kv_len=9, return_layers=(1,), last_layer=0)


@pytest.mark.parametrize("kernel", [False, True])
def test_is_causal_pass_equals_the_masked_pass(tiny_model_dir, kernel):
    """A causal pass from position 0 with SDPA's is_causal (no mask tensor) == the positional-mask pass, also
    when the attention kernel is on (a short pass must still attend causally)."""
    ours = load_model(tiny_model_dir("qwen2"), dtype=torch.float32).use_attention_kernel(kernel)
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(13).expand(2, 13)
    with torch.no_grad():
        want_h, want_l = ours(ids, pos, ours.new_cache(2, 32), kv_len=13, return_layers=(0,),
                              attn_mask=torch.arange(13)[None, None, :] <= pos[:, :, None])
        got_h, got_l = ours(ids, pos, ours.new_cache(2, 32), kv_len=13, return_layers=(0,), is_causal=True)
    assert (got_h - want_h).abs().max().item() < 1e-5 and (got_l[0] - want_l[0]).abs().max().item() < 1e-5
    with pytest.raises(ConfigError, match="is_causal"):
        ours(ids, pos, ours.new_cache(2, 32), is_causal=True)  # whole-pool attention: kv_len != T
