"""The DFlash drafter against z-lab's released `dflash` 0.1.0 package: same checkpoints, same numbers, same drafts.

A tiny random Qwen3 target (HF) and a tiny random DFlash drafter built with the reference's own
`DFlashDraftModel` and `save_pretrained`; we load the drafter with `load_dflash` and the target with our loader.
The target's LM head favours three tokens so that random drafts are sometimes accepted, which exercises the
multi-token context path of the speculative loop (checked below, not assumed).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

from specpilot.errors import ModelFormatError
from specpilot.models.dflash import (
    DFlashConfig,
    DFlashDrafter,
    context_features,
    draft_block,
    target_capture_layers,
)
from specpilot.models.dflash_io import load_dflash, save_dflash
from specpilot.models.loader import load_model

V, H, N_TARGET = 32, 64, 4
MASK = V - 1
LAYER_IDS = [0, 2, 3]  # 3 is the target's last layer: the reference reads it as the final-normed state
REASON = "z-lab's reference package `dflash` is not importable (scripts/install.sh installs dflash==0.1.0)"

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _ref():
    return pytest.importorskip("dflash.model", reason=REASON)


def _perturb(model, seed):
    """Weights of O(1) effect (default init is too small to separate logits) and non-trivial norms/biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * noise)


def _draft_hf_config(**extra):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
        architectures=["DFlashDraftModel"], block_size=4, num_target_layers=N_TARGET,
        dflash_config={"mask_token_id": MASK, "target_layer_ids": LAYER_IDS},
    )
    kw.update(extra)
    return Qwen3Config(**kw)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(HF Qwen3ForCausalLM, our DenseLM of the same weights)."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=N_TARGET, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    _perturb(hf, 0)
    with torch.no_grad():
        hf.model.embed_tokens.weight.normal_(generator=torch.Generator().manual_seed(1))
        hf.lm_head.weight[3:].mul_(0.05)  # three favoured tokens: random drafts get accepted now and then
    path = tmp_path_factory.mktemp("dflash-target")
    hf.save_pretrained(path)
    return hf, load_model(path)


@pytest.fixture(scope="module")
def ref_drafter(tmp_path_factory):
    """(reference DFlashDraftModel, its save_pretrained folder)."""
    ref = _ref()
    torch.manual_seed(0)
    model = ref.DFlashDraftModel(_draft_hf_config()).float().eval()
    _perturb(model, 2)
    path = tmp_path_factory.mktemp("dflash-ref")
    model.save_pretrained(path)
    return model, path


def _target_context(hf, ids):
    ref = _ref()
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return ref.extract_context_feature(out.hidden_states, LAYER_IDS)


def _block_embeds(hf, anchor, size=4):
    block = torch.full((1, size), MASK)
    block[0, 0] = anchor
    return F.embedding(block, hf.model.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------------------
# against the reference


def test_loads_reference_checkpoint_unchanged(ref_drafter):
    ref, path = ref_drafter
    ours = load_dflash(path)
    assert set(ours.state_dict()) == set(ref.state_dict())
    for name, t in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], t), name
    assert ours.block_size == ref.block_size == 4
    assert ours.mask_token_id == ref.mask_token_id == MASK
    assert list(ours.config.target_layer_ids) == list(ref.target_layer_ids) == LAYER_IDS


def test_context_features_match_reference_extraction(target):
    hf, dense = target
    ids = torch.randint(0, MASK, (1, 9), generator=torch.Generator().manual_seed(3))
    want = _target_context(hf, ids)
    with torch.no_grad():
        hidden, captured = dense(
            ids, torch.arange(9)[None], dense.new_cache(1, 16), kv_len=9,
            return_layers=target_capture_layers(LAYER_IDS, N_TARGET),
        )
    assert target_capture_layers(LAYER_IDS, N_TARGET) == (0, 2)  # layer 3 is the final-normed output itself
    got = context_features(hidden, captured, LAYER_IDS, N_TARGET)
    assert got.shape == (1, 9, len(LAYER_IDS) * H)
    assert (got - want).abs().max().item() < 1e-5


def _kernels_on(model, kernels: bool):
    """With `kernels`: the drafter's RMSNorm, RoPE and activation through the Triton kernels (interpreted on CPU)."""
    if kernels:
        pytest.importorskip("triton", reason="triton not installed")
        model.use_kernels(norm=True, rope=True, act=True)
    return model


@pytest.mark.parametrize("kernels", [False, True])
def test_forward_matches_reference(target, ref_drafter, kernels):
    hf, _ = target
    ref, path = ref_drafter
    ours = _kernels_on(load_dflash(path), kernels)
    feat = _target_context(hf, torch.randint(0, MASK, (1, 7), generator=torch.Generator().manual_seed(4)))
    noise = _block_embeds(hf, anchor=5)
    pos = torch.arange(0, 7 + 4)[None]
    with torch.no_grad():
        want = ref(target_hidden=feat, noise_embedding=noise, position_ids=pos)
        got = ours(noise, ours.project_context(feat), pos[:, :7], pos[:, 7:])
        want_logits = ref.compute_logits(want, hf.lm_head)
        got_logits = ours.compute_logits(got, hf.lm_head)
    assert want.abs().max() > 0.5  # not a vacuous comparison
    assert (got - want).abs().max().item() < 1e-5
    assert (got_logits - want_logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("kernels", [False, True])
def test_cached_forward_matches_reference_cache(target, ref_drafter, kernels):
    """Two draft steps: the reference appends to its HF cache and crops back to `start`; ours writes context
    K/V by position. Step 2 feeds only the three new context positions."""
    ref_mod = _ref()
    hf, _ = target
    ref, path = ref_drafter
    ours = _kernels_on(load_dflash(path), kernels)
    feat = _target_context(hf, torch.randint(0, MASK, (1, 9), generator=torch.Generator().manual_seed(5)))
    noise1, noise2 = _block_embeds(hf, 7), _block_embeds(hf, 11)
    with torch.no_grad():
        cache = ref_mod._make_cache(ref.config)
        want1 = ref(target_hidden=feat[:, :6], noise_embedding=noise1, position_ids=torch.arange(0, 10)[None],
                    past_key_values=cache, use_cache=True)
        ref_mod._crop_to(cache, 6)
        want2 = ref(target_hidden=feat[:, 6:9], noise_embedding=noise2, position_ids=torch.arange(6, 13)[None],
                    past_key_values=cache, use_cache=True)
        dc = ours.new_cache(1, 32)
        got1 = ours(noise1, ours.project_context(feat[:, :6]), torch.arange(6)[None], torch.arange(6, 10)[None],
                    dc, kv_len=6)
        got2 = ours(noise2, ours.project_context(feat[:, 6:9]), torch.arange(6, 9)[None], torch.arange(9, 13)[None],
                    dc, kv_len=9)
        # static-shape mode (whole pool, stale slots masked by position) and no cache at all give the same
        got2_pool = ours(noise2, ours.project_context(feat[:, 6:9]), torch.arange(6, 9)[None],
                         torch.arange(9, 13)[None], dc)
        got2_full = ours(noise2, ours.project_context(feat[:, :9]), torch.arange(9)[None], torch.arange(9, 13)[None])
    assert (got1 - want1).abs().max().item() < 1e-5
    assert (got2 - want2).abs().max().item() < 1e-5
    assert (got2_pool - want2).abs().max().item() < 1e-5
    assert (got2_full - want2).abs().max().item() < 1e-5


@pytest.mark.parametrize("is_causal", [None, False])
def test_config_variants_match_reference(target, tmp_path, is_causal):
    """A sliding-window layer (causal by default, or non-causal both ways with `is_causal: false`), qkv/o bias,
    llama3 RoPE, embedding scale, output multiplier (dflash_config wins over the top level), softcap."""
    ref_mod = _ref()
    hf, _ = target
    extra = {} if is_causal is None else {"is_causal": is_causal}
    cfg = _draft_hf_config(
        layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=3,
        attention_bias=True, output_multiplier=2.0, **extra,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 2], "input_embedding_scale": 1.5,
                       "output_multiplier": 0.7, "final_logit_softcapping": 3.0},
    )
    torch.manual_seed(0)
    ref = ref_mod.DFlashDraftModel(cfg).float().eval()
    _perturb(ref, 6)
    ref.save_pretrained(tmp_path)
    ours = load_dflash(tmp_path)
    assert ours.config.layer_types == ("full_attention", "sliding_attention") and ours.config.sliding_window == 3
    assert ours.config.output_multiplier == 0.7 and ours.config.is_causal is is_causal
    feat = torch.randn(1, 9, 2 * H, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([[9, MASK, MASK, MASK]])
    scale = float(ref_mod._draft_value(ref.config, "input_embedding_scale", 1.0))
    noise = ref_mod._raw_input_embeddings(hf, ids, scale)
    assert torch.equal(ours.embed(ids, hf.model.embed_tokens.weight), noise)
    with torch.no_grad():
        want = ref(target_hidden=feat[:, :6], noise_embedding=noise, position_ids=torch.arange(10)[None])
        got = ours(noise, ours.project_context(feat[:, :6]), torch.arange(6)[None], torch.arange(6, 10)[None])
        cache = ref_mod._make_cache(ref.config)
        ref(target_hidden=feat[:, :6], noise_embedding=noise, position_ids=torch.arange(10)[None],
            past_key_values=cache, use_cache=True)
        ref_mod._crop_to(cache, 6)
        want2 = ref(target_hidden=feat[:, 6:9], noise_embedding=noise, position_ids=torch.arange(6, 13)[None],
                    past_key_values=cache, use_cache=True)
        dc = ours.new_cache(1, 32)
        ours(noise, ours.project_context(feat[:, :6]), torch.arange(6)[None], torch.arange(6, 10)[None], dc, kv_len=6)
        got2 = ours(noise, ours.project_context(feat[:, 6:9]), torch.arange(6, 9)[None], torch.arange(9, 13)[None],
                    dc, kv_len=9)
        want_logits, got_logits = ref.compute_logits(want, hf.lm_head), ours.compute_logits(got, hf.lm_head)
    assert (got - want).abs().max().item() < 1e-5
    assert (got2 - want2).abs().max().item() < 1e-5
    assert (got_logits - want_logits).abs().max().item() < 1e-5


def _spec_generate_ours(drafter, dense, prompt, max_new_tokens):
    """Greedy DFlash speculative decoding with our pieces, step for step as the reference's dflash_generate:
    the target prefill gives the first token and the prompt's context; each step drafts after the anchor, verifies
    [anchor, drafts], commits the accepted prefix plus the bonus, and feeds the drafter the context of the
    committed positions only (the bonus token is the next anchor).
    -> (output ids, drafts per step, tokens produced per step)"""
    n, bs = prompt.shape[1], drafter.block_size
    max_len = n + max_new_tokens
    ids = drafter.config.target_layer_ids
    capture = target_capture_layers(ids, N_TARGET)
    tcache, dcache = dense.new_cache(1, max_len + bs), drafter.new_cache(1, max_len + bs)
    with torch.no_grad():
        hidden, captured = dense(prompt, torch.arange(n)[None], tcache, kv_len=n, return_layers=capture)
        out = prompt[0].tolist() + [int(dense.logits(hidden[:, -1]).argmax())]
        ctx = context_features(hidden, captured, ids, N_TARGET)
        start, drafts, produced_log = n, [], []
        while start + 1 < max_len:
            size = min(bs, max_len - start)
            d = draft_block(drafter, dense, out[start], ctx, anchor_pos=start, cache=dcache, num_tokens=size - 1)
            drafts.append(d.tolist())
            block = torch.tensor([[out[start], *d.tolist()]])
            hidden, captured = dense(block, torch.arange(start, start + size)[None], tcache, kv_len=start + size,
                                     return_layers=capture)
            posterior = dense.logits(hidden).argmax(-1)[0]
            accepted = int((d == posterior[:-1]).long().cumprod(0).sum())
            del out[start + 1:]
            out += d[:accepted].tolist() + [int(posterior[accepted])]
            produced = min(accepted + 1, max_len - start - 1)
            start += produced
            produced_log.append(produced)
            ctx = context_features(hidden, captured, ids, N_TARGET)[:, :produced]
    return out[: min(start + 1, max_len)], drafts, produced_log


def test_greedy_drafts_match_reference_generate(target, ref_drafter, monkeypatch):
    """The reference's own speculative loop (dflash_generate, greedy) against ours: every drafted block, every
    step's acceptance, and the output must agree."""
    ref_mod = _ref()
    hf, dense = target
    ref, path = ref_drafter
    ours = load_dflash(path)
    monkeypatch.setattr(ref_mod, "_cuda_time", time.perf_counter)  # return_stats times with cuda syncs
    ref_drafts = []
    compute_logits = ref.compute_logits

    def spy(hidden, head):  # what dflash_generate argmaxes into the block: the reference's drafted tokens
        logits = compute_logits(hidden, head)
        ref_drafts.append(logits.argmax(-1)[0].tolist())
        return logits

    monkeypatch.setattr(ref, "compute_logits", spy)
    all_produced = []
    for seed in (0, 1, 4):
        prompt = torch.randint(0, MASK, (1, 7), generator=torch.Generator().manual_seed(seed))
        ref_drafts.clear()
        want = ref_mod.dflash_generate(ref, hf, prompt, max_new_tokens=20, stop_token_ids=None, return_stats=True)
        out, drafts, produced = _spec_generate_ours(ours, dense, prompt, 20)
        assert drafts == ref_drafts, f"prompt seed {seed}"
        assert produced == want.acceptance_lengths, f"prompt seed {seed}"
        assert out == want.output_ids[0].tolist(), f"prompt seed {seed}"
        all_produced += produced
    # the comparison covered steps that accepted drafts (multi-token context feeds) and a fully accepted block
    assert max(all_produced) == 4 and sum(p > 1 for p in all_produced) >= 5


# ---------------------------------------------------------------------------------------------------------
# format: round trip and errors (need no reference)


def _our_drafter(seed=0, **overrides):
    kw = dict(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, block_size=4, mask_token_id=MASK,
              target_layer_ids=tuple(LAYER_IDS), num_target_layers=N_TARGET, vocab_size=V)
    kw.update(overrides)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DFlashConfig(**kw)).eval()
    _perturb(drafter, seed)
    return drafter


def test_save_load_round_trip_is_exact(tmp_path):
    drafter = _our_drafter()
    for sub, shard in (("one", 4 << 30), ("sharded", 20_000)):
        save_dflash(drafter, tmp_path / sub, max_shard_bytes=shard)
        back = load_dflash(tmp_path / sub)
        assert back.config == drafter.config
        assert set(back.state_dict()) == set(drafter.state_dict())
        for name, t in drafter.state_dict().items():
            assert torch.equal(back.state_dict()[name], t), (sub, name)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    cfg = json.loads((tmp_path / "one" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}
    # bf16 stays bf16 bit for bit when loaded as stored
    save_dflash(drafter.to(torch.bfloat16), tmp_path / "bf16")
    back = load_dflash(tmp_path / "bf16", dtype=None)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in drafter.state_dict().items())
    assert back.fc.weight.dtype == torch.bfloat16


def test_reference_loads_our_checkpoint(tmp_path):
    ref_mod = _ref()
    drafter = _our_drafter(seed=3)
    save_dflash(drafter, tmp_path)
    ref = ref_mod.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ref.block_size == 4 and ref.mask_token_id == MASK and list(ref.target_layer_ids) == LAYER_IDS
    feat = torch.randn(1, 5, len(LAYER_IDS) * H, generator=torch.Generator().manual_seed(8))
    noise = torch.randn(1, 4, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = ref(target_hidden=feat, noise_embedding=noise, position_ids=torch.arange(9)[None])
        got = drafter(noise, drafter.project_context(feat), torch.arange(5)[None], torch.arange(5, 9)[None])
    assert (got - want).abs().max().item() < 1e-5


def test_released_style_config_parses():
    """config.json as z-lab's Hub checkpoints write it (transformers 4.x era: rope_theta at top level)."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": 16, "dflash_config": {"mask_token_id": 151669,
                                                                   "target_layer_ids": [1, 9, 17, 25, 33]},
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "rope_scaling": None, "max_position_embeddings": 40960, "num_target_layers": 36, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 5,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
    }
    c = DFlashConfig.from_hf_dict(cfg)
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))
    assert c.rope_theta == 1e6 and c.rope_scaling is None and c.layer_types == ("full_attention",) * 5
    assert not any(c.layer_is_causal(i) for i in range(5))
    assert DFlashConfig.from_hf_dict(c.to_hf_dict()) == c
    assert c.to_hf_dict()["auto_map"] == cfg["auto_map"]  # unknown fields survive a save


def test_bad_checkpoints_raise_model_format_error(tmp_path):
    drafter = _our_drafter()
    good = tmp_path / "good"
    save_dflash(drafter, good)
    cfg = json.loads((good / "config.json").read_text())

    def variant(name, mutate_cfg=None, weights_from=None):
        d = tmp_path / name
        d.mkdir()
        c = json.loads(json.dumps(cfg))
        if mutate_cfg:
            mutate_cfg(c)
        (d / "config.json").write_text(json.dumps(c))
        src = weights_from or good
        (d / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
        return d

    def plain_qwen3(c):
        del c["dflash_config"]
        c["architectures"] = ["Qwen3ForCausalLM"]

    cases = {
        "no_dflash_config": lambda c: c.pop("dflash_config"),
        "plain_qwen3": plain_qwen3,
        "dflash2": lambda c: c.update(architectures=["DFlash2DraftModel"]),
        "no_mask_token": lambda c: c["dflash_config"].pop("mask_token_id"),
        "more_layers": lambda c: c.update(num_hidden_layers=3, layer_types=["full_attention"] * 3),
        "other_target_layers": lambda c: c["dflash_config"].update(target_layer_ids=[0, 2]),  # fc shape differs
        "wide": lambda c: c.update(intermediate_size=128),
    }
    for name, mutate in cases.items():
        with pytest.raises(ModelFormatError):
            load_dflash(variant(name, mutate))
    with pytest.raises(ModelFormatError):
        load_dflash(tmp_path / "nowhere")
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "truncated" / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:500])
    with pytest.raises(ModelFormatError):
        load_dflash(tmp_path / "truncated")
    assert isinstance(load_dflash(good), DFlashDrafter)
