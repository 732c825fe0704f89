"""The fused decode path (models/fused_decode.py) against the regular one: one-token steps (EngineConfig.fused_decode)
and verify blocks of 2-16 tokens (EngineConfig.fused_verify).

TRITON_INTERPRET=1 (conftest) runs its kernels on the CPU: the fused GEMV with norm prologue / residual and
SiLU * up epilogues (one row, or M rows through tl.dot), RoPE with the K/V write, the one-launch attention (one
token) and the split-KV attention (a block).
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


# --- fused verify: 2-16 tokens in one row ---------------------------------------------------------------------


def _verify_block(model, ids, T: int, return_layers=()):
    """Prefill ids[:6], then one T-token step over the whole pool (as graphed): -> (logits [1, T, V], captured
    layers, the cache)."""
    cache = model.new_cache(1, 32)
    pos = torch.arange(6 + T)[None]
    with torch.no_grad():
        model(ids[:, :6], pos[:, :6], cache, kv_len=6)
        out = model(ids[:, 6:6 + T], pos[:, 6:6 + T], cache, kv_len=None, return_layers=return_layers)
        hidden, captured = out if return_layers else (out, [])
        return model.logits(hidden), captured, cache


def _count_fused_layers(monkeypatch) -> list:
    """-> a list that gets the token count of every fused_decode.decode_layer call."""
    from specpilot.models import fused_decode

    calls = []
    real = fused_decode.decode_layer
    monkeypatch.setattr(fused_decode, "decode_layer",
                        lambda layer, x, *a, **k: calls.append(x.shape[1]) or real(layer, x, *a, **k))
    return calls


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])  # Qwen2: qkv bias; Qwen3: q/k norms
@pytest.mark.parametrize("T", [2, 7, 16])
def test_fused_verify_blocks_match_the_regular_path(tiny_model_dir, monkeypatch, family, T):
    from specpilot.models import load_model

    ref = load_model(tiny_model_dir(family)).fuse_projections()
    fast = copy.deepcopy(ref).use_fused_verify()
    assert fast.fused_verify and not fast.fused_decode
    ids = torch.randint(3, 96, (1, 6 + T), generator=torch.Generator().manual_seed(T))
    la, ca, cache_a = _verify_block(ref, ids, T, return_layers=(0, 1))
    calls = _count_fused_layers(monkeypatch)
    lb, cb, cache_b = _verify_block(fast, ids, T, return_layers=(0, 1))
    # every layer fused, all T tokens at once (the 6-token prefill too: a positional step of <= 16 tokens)
    assert calls == [6] * fast.config.num_hidden_layers + [T] * fast.config.num_hidden_layers
    assert la.shape == lb.shape == (1, T, 96)
    assert (la - lb).abs().max().item() < 1e-4
    for a, b in zip(ca, cb):  # captured layer outputs (DFlash conditions on them)
        assert a.shape == b.shape == (1, T, 64) and (a - b).abs().max().item() < 1e-4
    # the K/V the block wrote (positions 6..6+T-1) are the regular path's, nothing past them
    assert (cache_a.k - cache_b.k).abs().max().item() < 1e-5 and (cache_a.v - cache_b.v).abs().max().item() < 1e-5
    assert cache_b.k[:, :, :, 6 + T:].abs().max().item() == 0


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_verify_bf16_follows_the_regular_path(tiny_model_dir, family):
    """bf16: the same rounding points as the eager modules, only summation orders differ (tl.dot's, the norms'):
    the tolerance of the bf16 fused one-token tests (tests/test_lossless12.py), the same argmax."""
    from specpilot.models import load_model

    ref = load_model(tiny_model_dir(family), dtype=torch.bfloat16).fuse_projections()
    fast = copy.deepcopy(ref).use_fused_decode().use_fused_verify()
    ids = torch.randint(3, 96, (1, 22), generator=torch.Generator().manual_seed(1))
    for T in (2, 16):
        a, b = _verify_block(ref, ids, T)[0], _verify_block(fast, ids, T)[0]
        assert (a - b).abs().max().item() <= 0.05 * a.abs().max().item()
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    if family == "qwen2":  # lossless12: verify blocks read the bf16 weights it keeps (the 12-bit GEMV takes 1 row)
        from specpilot.kernels import gemv12

        w12 = copy.deepcopy(fast).use_lossless12()
        real, calls = gemv12.gemv12, []
        gemv12.gemv12 = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            got = _verify_block(w12, ids, 16)[0]
        finally:
            gemv12.gemv12 = real
        assert not calls and torch.equal(got, b)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prenorm_rows_gives_the_prologue_numbers_bit_for_bit(tiny_model_dir, monkeypatch, launch_spy, family,
                                                            dtype):
    """PRENORM_ROWS (a verify block's norms as RMSNorm launches of their own, then norm-free M-row GEMVs) rounds
    where the GEMV's norm prologue does: logits, captured layers and the K/V written are the prologue's bits; and
    it does launch the RMSNorm kernel, twice a layer, only when on."""
    import specpilot.kernels.rmsnorm as rk
    from specpilot.models import fused_decode, load_model

    model = load_model(tiny_model_dir(family), dtype=dtype).use_fused_verify()
    L = model.config.num_hidden_layers
    ids = torch.randint(3, 96, (1, 6 + 7), generator=torch.Generator().manual_seed(5))
    launch_spy(rk, "_rmsnorm_kernel", "rmsnorm")
    launches = launch_spy.grids
    assert fused_decode.PRENORM_ROWS  # the default
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(fused_decode, "PRENORM_ROWS", on)
        del launches[:]
        logits, captured, cache = _verify_block(model, ids, 7, return_layers=(0, 1))
        outs[on] = (logits, *captured, cache.k, cache.v)
        # the 6-token prefill and the 7-token block both take the fused path: two norms a layer each
        assert launches == ([(6,)] * 2 * L + [(7,)] * 2 * L if on else [])
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_verify_one_launch_gives_the_pairs_bits_in_a_verify_block(tiny_model_dir, monkeypatch, family):
    """A fused verify block with its attention in one launch (EngineConfig.verify_one_launch): logits, captured
    layers and the K/V written are the split + merge pair's bits (bf16, 16 tokens)."""
    from specpilot.kernels import decode_attention as da
    from specpilot.models import load_model

    model = load_model(tiny_model_dir(family), dtype=torch.bfloat16).use_fused_decode().use_fused_verify()
    ids = torch.randint(3, 96, (1, 6 + 16), generator=torch.Generator().manual_seed(9))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(da, "VERIFY_ONE_LAUNCH", on)
        logits, captured, cache = _verify_block(model, ids, 16, return_layers=(0, 1))
        outs[on] = (logits, *captured, cache.k, cache.v)
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))

@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_handoff_keeps_two_norm_launches_and_follows_the_norm_launches(tiny_model_dir, launch_spy, family,
                                                                             dtype):
    """use_norm_handoff: a verify block launches the RMSNorm kernel twice (layer 0's input norm, the final norm)
    instead of 2L + 1 times; logits, captured layers and K/V follow the block with the norm launches (only the
    mean's summation order differs: fp32 to ~1e-5, bf16 the same argmax); two blocks give the same bits."""
    import specpilot.kernels.rmsnorm as rk
    from specpilot.errors import ConfigError
    from specpilot.models import load_model

    ref = load_model(tiny_model_dir(family), dtype=dtype).use_fused_verify().use_norm_kernel()
    fast = copy.deepcopy(ref).use_norm_handoff()
    L = ref.config.num_hidden_layers
    ids = torch.randint(3, 96, (1, 6 + 9), generator=torch.Generator().manual_seed(6))
    launch_spy(rk, "_rmsnorm_kernel", "rmsnorm")
    launches = launch_spy.grids
    la, ca, cache_a = _verify_block(ref, ids, 9, return_layers=(0, 1))
    assert launches.count((9,)) == 2 * L + 1
    del launches[:]
    lb, cb, cache_b = _verify_block(fast, ids, 9, return_layers=(0, 1))
    assert launches.count((9,)) == 2 and launches.count((6,)) == 2  # the 6-token prefill is a fused block too
    tol = 1e-4 if dtype == torch.float32 else 0.05 * la.abs().max().item()
    assert (la - lb).abs().max().item() <= tol and torch.equal(la.argmax(-1), lb.argmax(-1))
    for a, b in zip((*ca, cache_a.k, cache_a.v), (*cb, cache_b.k, cache_b.v)):
        assert a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= max(tol, 0.05)
    assert torch.equal(lb, _verify_block(fast, ids, 9)[0])
    with pytest.raises(ConfigError, match="choose one"):
        copy.deepcopy(fast).use_norm_epilogue()
    with pytest.raises(ConfigError, match="fused_verify"):
        load_model(tiny_model_dir(family)).use_norm_handoff()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("handoff", [False, True])
def test_verify_rope_in_qkv_drops_the_rope_launch_and_follows_it(tiny_model_dir, launch_spy, family, handoff):
    """use_verify_rope_in_qkv: a verify block's qkv GEMM does RoPE and the K/V write (no rope_write launch; Qwen3's
    q/k-norm layers keep it); logits, captured layers and the K/V written follow the block without it (fp32: only
    summation orders differ), with or without the norm handoff."""
    import specpilot.kernels.rope_write as rw
    from specpilot.errors import ConfigError
    from specpilot.models import load_model

    ref = load_model(tiny_model_dir(family)).use_fused_verify().use_norm_kernel()
    fast = copy.deepcopy(ref).use_verify_rope_in_qkv()
    if handoff:
        fast.use_norm_handoff()
    L = ref.config.num_hidden_layers
    ids = torch.randint(3, 96, (1, 6 + 9), generator=torch.Generator().manual_seed(7))
    launch_spy(rw, "_rope_write_kernel", "rope_write")
    launches = launch_spy.grids
    la, ca, cache_a = _verify_block(ref, ids, 9, return_layers=(0, 1))
    assert len(launches) == 2 * L  # the 6-token prefill and the 9-token block
    del launches[:]
    lb, cb, cache_b = _verify_block(fast, ids, 9, return_layers=(0, 1))
    assert len(launches) == (2 * L if family == "qwen3" else 0)
    assert (la - lb).abs().max().item() < 1e-4
    for a, b in zip((*ca, cache_a.k, cache_a.v), (*cb, cache_b.k, cache_b.v)):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
    assert cache_b.k[:, :, :, 15:].abs().max().item() == 0  # nothing written past the block
    with pytest.raises(ConfigError, match="fused_verify"):
        load_model(tiny_model_dir(family)).use_verify_rope_in_qkv()


def test_fused_verify_is_used_only_for_2_to_16_token_steps_in_one_row(tiny_model_dir, monkeypatch):
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen2")).use_fused_verify()
    calls = _count_fused_layers(monkeypatch)
    L = model.config.num_hidden_layers
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(torch.arange(1, 21)[None], torch.arange(20)[None], cache, kv_len=20)  # prefill of 20: regular
        model(torch.tensor([[4]]), torch.tensor([[20]]), cache, kv_len=None)  # one token: fused_decode is off
        assert not calls
        for T in (2, 16):
            model(torch.arange(T)[None], torch.arange(21, 21 + T)[None], cache, kv_len=None)
        assert calls == [2] * L + [16] * L
        calls.clear()
        model(torch.arange(17)[None], torch.arange(21, 38)[None], cache, kv_len=None)  # 17 tokens: regular
        mask = torch.ones(1, 4, 64, dtype=torch.bool)
        model(torch.arange(4)[None], torch.arange(21, 25)[None], cache, kv_len=None, attn_mask=mask)  # a tree mask
        two = model.new_cache(2, 64)
        model(torch.ones(2, 4, dtype=torch.long), torch.arange(4).expand(2, 4), two, kv_len=None)  # two rows
        assert not calls
    model.use_fused_decode()
    with torch.no_grad():
        model(torch.tensor([[4]]), torch.tensor([[20]]), cache, kv_len=None)  # with fused_decode: one token too
    assert calls == [1] * L
    model.use_fused_verify(False)
    assert not model.fused_verify and model.fused_decode


@pytest.mark.parametrize("drafter_kind,k,static", [("ngram", 4, False), ("ngram", 15, True), ("model", 3, False),
                                                   ("model", 3, True)])
def test_greedy_spec_with_fused_verify_equals_ar(tiny_model_dir, monkeypatch, drafter_kind, k, static):
    """Speculative decoding whose verify blocks run the fused path (n-gram: K + 1 up to 16 tokens; the model
    drafter as itself: every draft accepted, so every block is full) gives regular AR's tokens, eagerly and through
    the static bucket path (what a CUDA graph records: padded blocks over the whole KV pool)."""
    from specpilot.config import EngineConfig
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine, build_drafter
    from specpilot.engine.runner import ModelRunner
    from specpilot.models import load_model

    path = tiny_model_dir("qwen2")
    ref = load_model(path)
    fast = load_model(path).use_fused_decode().use_fused_verify()
    cfg = EngineConfig(drafter_kind=drafter_kind, num_draft_tokens=k, max_new_tokens=20, max_seq_len=64,
                       ignore_eos=True, ngram_assist=0)
    drafter = NgramDrafter(3, 1) if drafter_kind == "ngram" else build_drafter(cfg, load_model(path), fast)
    eng = Engine(fast, cfg, drafter)
    if static:
        r = eng.runner
        eng.runner = ModelRunner(fast, r.cache, buckets=(1, k + 1), static=True, greedy_verdict=True)
    calls = _count_fused_layers(monkeypatch)
    for prompt in ([5, 6, 7, 5, 6, 7, 1, 2], [9, 8, 7, 6, 5, 4, 9, 8, 7, 6, 5, 4, 9, 8]):
        want = Engine(ref, cfg.with_(drafter_kind="none")).generate(prompt).output_ids
        got = eng.generate(prompt)
        assert got.output_ids == want
    assert max(calls) > 1  # verify blocks took the fused path
    if drafter_kind == "model":
        assert got.num_target_forwards < len(want)  # drafts were accepted: the drafter really ran


@pytest.mark.parametrize("static", [False, True])
def test_greedy_spec_with_the_handoff_and_rope_in_qkv_equals_ar(tiny_model_dir, static):
    """Verify blocks with the norm handoff and RoPE in the qkv GEMM (both on) give regular AR's tokens, eagerly and
    through the static bucket path (padded blocks over the whole KV pool, as a CUDA graph records)."""
    from specpilot.config import EngineConfig
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine
    from specpilot.engine.runner import ModelRunner
    from specpilot.models import load_model

    path = tiny_model_dir("qwen2")
    ref = load_model(path)
    fast = load_model(path).use_fused_decode().use_fused_verify().use_norm_handoff().use_verify_rope_in_qkv()
    cfg = EngineConfig(drafter_kind="ngram", num_draft_tokens=15, max_new_tokens=24, max_seq_len=64,
                       ignore_eos=True, ngram_assist=0)
    eng = Engine(fast, cfg, NgramDrafter(3, 1))
    if static:
        eng.runner = ModelRunner(fast, eng.runner.cache, buckets=(1, 16), static=True, greedy_verdict=True)
    for prompt in ([5, 6, 7, 5, 6, 7, 1, 2], [9, 8, 7, 6, 5, 4, 9, 8, 7, 6, 5, 4, 9, 8]):
        want = Engine(ref, cfg.with_(drafter_kind="none")).generate(prompt).output_ids
        got = eng.generate(prompt)
        assert got.output_ids == want and got.num_target_forwards < len(want)


def test_fused_verify_field_is_on_by_default_needs_fused_decode_and_is_a_loop_mechanism(monkeypatch):
    import argparse

    import specpilot.engine as eng
    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.config import EngineConfig
    from specpilot.errors import ConfigError
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY, Deployment, applicable
    from specpilot.models import ModelConfig, random_model

    assert EngineConfig().fused_verify  # on since session 15's H200 A/B (verify 2.12 -> 1.80 ms)
    with pytest.raises(ConfigError, match="fused_verify"):
        EngineConfig(fused_verify="false")
    assert "fused_verify" in EngineMeasure.LAYOUT and REGISTRY["fused_verify"].gap_stages == ("verify",)
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert "fused_verify" in [m.name for m in applicable(gpu, gpu.config)]
    assert REGISTRY["fused_verify"].candidates(gpu.config, gpu) == [{"fused_verify": False}]  # the loop may turn it off
    assert "fused_verify" not in [m.name for m in applicable(gpu, gpu.config.with_(fused_decode=False))]
    cpu = Deployment("t", "d", EngineConfig(), "cpu")
    assert "fused_verify" not in [m.name for m in applicable(cpu, cpu.config)]
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args(["--fused-verify"])).fused_verify
    assert not engine_config(parser.parse_args(["--no-fused-verify"])).fused_verify
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = random_model(cfg, dtype=torch.float32, device="cpu")
    eng._apply_layout(model, EngineConfig(fused_verify=True))  # a CPU config: the switch applies on CUDA only
    assert not model.fused_verify
    monkeypatch.setattr(eng, "_kernel_on", lambda config, field="attention_kernel": getattr(config, field))
    on = EngineConfig(norm_kernel=False, rope_kernel=False, fused_verify=True)
    eng._apply_layout(model, on)  # pretending to be on CUDA
    assert model.fused_decode and model.fused_verify
    alone = random_model(cfg, dtype=torch.float32, device="cpu")
    with pytest.warns(RuntimeWarning, match="fused_verify needs fused_decode"):
        eng._apply_layout(alone, on.with_(fused_decode=False))
    assert not alone.fused_verify
