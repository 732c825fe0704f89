"""RoPE + K/V write inside the one-token attention launch (kernels/rope_attention.py, EngineConfig.rope_in_attention).

Kernel (TRITON_INTERPRET=1 on CPU): the output and the whole cache are the bits of rope_write + the one-launch
decode_attention, for Qwen2-style (no q/k norm) and Qwen3-style (q/k norm) heads, GQA, positions at 0, at slice
boundaries and at the end of the pool. The interpreter runs the programs one after another, in grid order; with
the grid reversed, a program of the new token's slice runs before the one that writes the slot, so reading the slot
from the cache instead of the registers would show (a stale slot: NaN here).
Model and engine: fused one-token steps with the switch give the bits of the steps without it; greedy AR and
speculation equal AR token for token; config, setter, loop mechanism and the cost model's launch count.
"""

import builtins
import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # as conftest does: the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed")

from specpilot.kernels.decode_attention import decode_attention  # noqa: E402
from specpilot.kernels.rope_attention import rope_attention, rope_attention_reference  # noqa: E402
from specpilot.kernels.rope_write import rope_write  # noqa: E402

SPLIT = (16, 16)  # keys per program / per inner step: small, so that a 40-slot pool has three slices


def _case(B, H, Hkv, D, S, qk_norm, dtype, positions, seed=0):
    """One new token per row as fused_decode has it: q/k/v strided views of one qkv row, cos/sin of `positions`
    [B, 1], a random pool layer [B, Hkv, S, D] x 2 (random contents: untouched slots are checked too), the q/k norm
    weights (or None, None)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(B, 1, (H + 2 * Hkv) * D, generator=g)).to(dtype)
    q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = (x.reshape(B, 1, -1, D).transpose(1, 2) for x in (q, k, v))  # [B, heads, 1, D]
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    positions = torch.tensor(positions)[:, None]  # [B, 1]
    freqs = positions[..., None].float() * (1.0 / 1e6 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, 1, D]
    weights = [(1 + 0.3 * torch.randn(D, generator=g)).to(dtype) for _ in range(2)] if qk_norm else [None, None]
    return (q, k, v, emb.cos().to(dtype), emb.sin().to(dtype), positions, kc, vc, *weights)


def _two_launches(q, k, v, cos, sin, positions, kc, vc, qw, kw):
    """Today's path: rope_write, then the one-launch attention -> (out, k cache, v cache)."""
    kc, vc = kc.clone(), vc.clone()
    rq = rope_write(q, k, v, cos, sin, positions, kc, vc, qw, kw)
    return decode_attention(rq, kc, vc, positions, split_s=SPLIT[0], block_s=SPLIT[1], one_launch=True), kc, vc


def _one_launch(q, k, v, cos, sin, positions, kc, vc, qw, kw):
    kc, vc = kc.clone(), vc.clone()
    return rope_attention(q, k, v, cos, sin, positions, kc, vc, qw, kw, split_s=SPLIT[0], block_s=SPLIT[1]), kc, vc


@pytest.mark.parametrize("qk_norm,B,H,Hkv,D,dtype,positions", [
    (False, 1, 12, 2, 64, torch.float32, [0]),  # the 1.5B's GQA group (6 q heads a kv head), position 0
    (False, 1, 12, 2, 64, torch.bfloat16, [16]),  # the first slot of the second slice
    (False, 2, 4, 2, 16, torch.bfloat16, [15, 39]),  # the last slot of a slice; the last of the pool
    (True, 2, 8, 4, 32, torch.bfloat16, [17, 0]),  # Qwen3's q/k norms
    (True, 1, 16, 8, 128, torch.float32, [31]),
    (True, 1, 4, 4, 16, torch.float32, [33]),  # no GQA
])
def test_rope_attention_is_rope_write_then_the_one_launch_attention_bit_for_bit(qk_norm, B, H, Hkv, D, dtype,
                                                                                 positions):
    S = 40
    args = _case(B, H, Hkv, D, S, qk_norm, dtype, positions, seed=B + H + D)
    want, want_k, want_v = _two_launches(*args)
    got, got_k, got_v = _one_launch(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    kc = args[6]
    written = torch.zeros(kc.shape, dtype=torch.bool)
    written[torch.arange(B), :, torch.tensor(positions)] = True
    assert not torch.equal(got_k[written], kc[written])  # the slot was written (random k: different)
    assert torch.equal(got_k[~written], kc[~written]) and torch.equal(got_v[~written], args[7][~written])
    # and the plain-PyTorch twin agrees (fp32 softmax in another order: close, not equal)
    kr, vr = kc.clone(), args[7].clone()
    ref = rope_attention_reference(*args[:6], kr, vr, *args[8:])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (ref.float() - got.float()).abs().max().item() < tol


@pytest.mark.parametrize("qk_norm", [False, True])
def test_no_program_reads_the_new_slot_from_the_cache(monkeypatch, qk_norm):
    """Two row blocks per kv head (48 q heads on one: 32 + 16 rows), the grid run backwards: the second row block of
    the slice holding the new token runs before the first, which writes the slot. The slot holds NaN before the
    call, so a program that read it from the cache would return NaN; the kernel uses its own k and v."""
    import triton.runtime.interpreter as interp

    args = list(_case(1, 48, 1, 16, 40, qk_norm, torch.float32, [21], seed=5))
    want, want_k, want_v = _two_launches(*args)
    args[6][:, :, 21] = float("nan")
    args[7][:, :, 21] = float("nan")

    def backwards(*a):
        return builtins.range(*a)[::-1]

    monkeypatch.setattr(interp, "range", backwards, raising=False)  # GridExecutor's loops over the grid
    got, got_k, got_v = _one_launch(*args)
    monkeypatch.undo()
    assert torch.isfinite(got).all()
    assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_positions_outside_the_pool_are_not_written_and_bad_shapes_are_clear_errors():
    q, k, v, cos, sin, positions, kc, vc, _, _ = _case(1, 4, 2, 16, 24, False, torch.float32, [24])
    _, got_k, got_v = _one_launch(q, k, v, cos, sin, positions, kc, vc, None, None)
    assert torch.equal(got_k, kc) and torch.equal(got_v, vc)  # slot 24 of a 24-slot pool: as rope_write, nothing
    good = dict(q=q, k=k, v=v, cos=cos, sin=sin, positions=positions, k_cache=kc, v_cache=vc)
    q2 = torch.randn(1, 4, 2, 16)
    for change, match in ((dict(q=q2, positions=torch.zeros(1, 2, dtype=torch.long), cos=cos.expand(1, 1, 2, 16),
                                sin=sin.expand(1, 1, 2, 16), k=k.expand(1, 2, 2, 16), v=v.expand(1, 2, 2, 16)),
                           r"one token per row \(T = 1\)"),
                          (dict(k_cache=kc.bfloat16()), "k_cache must have q's dtype"),
                          (dict(q=torch.randn(1, 3, 1, 16)), "multiple of Hkv"),
                          (dict(q_norm_weight=torch.ones(8)), r"q_norm_weight must be \[D\]")):
        with pytest.raises(ValueError, match=match):
            rope_attention(**{**good, **change})


def test_rope_attention_is_one_opaque_op_under_torch_compile_and_keeps_its_cache_writes():
    from specpilot.kernels.rope_attention import rope_attention_op

    args = _case(1, 4, 2, 16, 300, True, torch.float32, [130])  # 128-key slices (the op's): the third slice
    want, want_k, want_v = _two_launches(*args)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v, c, s, p, kc, vc, qw, kw):
        return rope_attention_op(q, k, v, c, s, p, kc, vc, qw, kw) * 2

    kc, vc = args[6].clone(), args[7].clone()
    got = torch.compile(f, backend=backend, fullgraph=True)(*args[:6], kc, vc, *args[8:])
    assert torch.allclose(got, 2 * want, atol=1e-5) and torch.equal(kc, want_k) and torch.equal(vc, want_v)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("specpilot.rope_attention" in t for t in targets) == 1, targets


# --- the model and the engine ------------------------------------------------------------------------------------


def _steps(model, ids, blocks, kv_len=False):
    """Prefill ids[:6], then steps of the given token counts (over the whole pool, or over the filled slots with
    kv_len): -> logits, captured layer outputs after each, and the cache's K/V at the end."""
    cache = model.new_cache(1, 40)
    pos = torch.arange(ids.shape[1])[None]
    out, t = [], 0
    with torch.no_grad():
        for T in (6,) + tuple(blocks):
            hidden, layers = model(ids[:, t:t + T], pos[:, t:t + T], cache, kv_len=t + T if kv_len else None,
                                   return_layers=(0, 1))
            out += [model.logits(hidden), *layers]
            t += T
    return out + [cache.k, cache.v]


def _spy_launches(launch_spy):
    """-> list of rope_write's and rope_attention's launches, in order."""
    import specpilot.kernels.rope_attention as ra
    import specpilot.kernels.rope_write as rw

    launch_spy(rw, "_rope_write_kernel", "rope_write")
    launch_spy(ra, "_rope_attention_kernel", "rope_attention")
    return launch_spy.launches


@pytest.mark.parametrize("family,dtype,kv_len", [("qwen2", torch.float32, False), ("qwen3", torch.bfloat16, False),
                                                 ("llama", torch.bfloat16, True), ("qwen3", torch.float32, True)])
def test_fused_steps_with_rope_in_attention_give_the_same_bits(tiny_model_dir, monkeypatch, launch_spy, family,
                                                               dtype, kv_len):
    """One-token steps (at positions 6-8 and 16: a 16-key slice's first slot) and a 7-token verify block: logits,
    captured layers and the whole cache bit for bit; one-token layers launch rope_attention, the block rope_write."""
    from specpilot.models import load_model

    off = load_model(tiny_model_dir(family), dtype=dtype).use_fused_decode().use_fused_verify()
    on = copy.deepcopy(off).use_rope_in_attention()
    monkeypatch.setattr("specpilot.kernels.decode_attention.ONE_LAUNCH_SPLIT", SPLIT)  # three slices of 40 slots
    ids = torch.randint(3, 96, (1, 6 + 3 + 7 + 1), generator=torch.Generator().manual_seed(4))
    blocks = (1, 1, 1, 7, 1)
    launches = _spy_launches(launch_spy)
    want = _steps(off, ids, blocks, kv_len)
    L = off.config.num_hidden_layers
    assert launches == ["rope_write"] * L * 6
    launches.clear()
    got = _steps(on, ids, blocks, kv_len)
    one, block = ["rope_attention"] * L, ["rope_write"] * L
    assert launches == block + one * 3 + block + one  # the prefill and the verify block keep rope_write
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got))


def test_greedy_ar_and_spec_with_rope_in_attention_equal_ar(tiny_model_dir, monkeypatch):
    """Greedy AR through the engine with the switch gives the regular path's AR tokens (the oracle); an n-gram
    speculative engine with fused verify blocks between its one-token steps too. (Qwen2 only: the interpreter is
    slow; Qwen3's q/k norms are covered bit for bit above.)"""
    from specpilot.config import EngineConfig
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine
    from specpilot.models import fused_decode, load_model

    path = tiny_model_dir("qwen2")
    on = load_model(path).use_fused_decode().use_fused_verify().use_rope_in_attention()
    cfg = EngineConfig(drafter_kind="none", max_new_tokens=10, max_seq_len=32, ignore_eos=True, ngram_assist=0)
    calls = []
    real = fused_decode.decode_layer
    monkeypatch.setattr(fused_decode, "decode_layer", lambda layer, x, *a, **kw: (
        calls.append(x.shape[1]) if kw.get("rope_in_attention") else None) or real(layer, x, *a, **kw))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    want = Engine(load_model(path), cfg).generate(prompt).output_ids
    assert Engine(on, cfg).generate(prompt).output_ids == want
    assert calls.count(1) >= 9 * on.config.num_hidden_layers  # the one-token steps took the switch's path
    calls.clear()
    spec = Engine(on, cfg.with_(drafter_kind="ngram", num_draft_tokens=3), NgramDrafter(3, 1))
    assert spec.generate(prompt).output_ids == want
    assert max(calls) > 1  # verify blocks went through the same layer (with rope_write)


def test_rope_in_attention_field_setter_and_loop_mechanism(tiny_model_dir, monkeypatch):
    import argparse

    import specpilot.engine as eng
    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.config import EngineConfig
    from specpilot.errors import ConfigError
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY, Deployment, applicable
    from specpilot.models import load_model

    assert EngineConfig().rope_in_attention is False  # off until measured on the H200
    with pytest.raises(ConfigError, match="rope_in_attention"):
        EngineConfig(rope_in_attention="false")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args(["--rope-in-attention", "--no-rope-in-qkv"])).rope_in_attention
    with pytest.raises(ConfigError, match="--no-rope-in-qkv"):  # rope_in_qkv is on by default: one must go
        engine_config(parser.parse_args(["--rope-in-attention"]))
    assert not engine_config(parser.parse_args([])).rope_in_attention
    assert "rope_in_attention" in EngineMeasure.LAYOUT
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert "rope_in_attention" in [m.name for m in applicable(gpu, gpu.config)]
    assert REGISTRY["rope_in_attention"].candidates(gpu.config, gpu) == [{"rope_in_attention": True, "rope_in_qkv": False}]
    assert "rope_in_attention" not in [m.name for m in applicable(gpu, gpu.config.with_(fused_decode=False))]
    cpu = Deployment("t", "d", EngineConfig(), "cpu")
    assert "rope_in_attention" not in [m.name for m in applicable(cpu, cpu.config)]
    with pytest.raises(ConfigError, match="rope_in_attention needs fused_decode"):
        load_model(tiny_model_dir("qwen2")).use_rope_in_attention()
    model = load_model(tiny_model_dir("qwen2"))
    eng._apply_layout(model, EngineConfig(rope_in_attention=True, rope_in_qkv=False))  # a CPU config: CUDA-only, stays off
    assert not model.rope_in_attention
    monkeypatch.setattr(eng, "_kernel_on", lambda config, field="attention_kernel": getattr(config, field))
    on = EngineConfig(norm_kernel=False, rope_kernel=False, rope_in_attention=True, rope_in_qkv=False)
    eng._apply_layout(model, on)  # pretending to be on CUDA
    assert model.fused_decode and model.rope_in_attention
    alone = load_model(tiny_model_dir("qwen2"))
    with pytest.warns(RuntimeWarning, match="rope_in_attention needs fused_decode"):
        eng._apply_layout(alone, on.with_(fused_decode=False, fused_verify=False))
    assert not alone.rope_in_attention


def test_rope_in_attention_prices_a_one_token_fused_layer_at_five_launches():
    """forward_cost: a one-token fused pass loses one launch a layer (and, with pdl, one PDL launch a layer);
    verify blocks, unfused and compiled passes are unchanged; bytes unchanged."""
    import dataclasses

    from specpilot.costmodel.shapes import forward_cost
    from specpilot.models.config import ModelConfig

    cfg = ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                      num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128)
    L = cfg.num_hidden_layers
    flags = dict(fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True, fused_verify=True)
    for pdl in (False, True):
        off = forward_cost(cfg, 1, 512, **flags, pdl=pdl)
        on = forward_cost(cfg, 1, 512, **flags, pdl=pdl, rope_in_attention=True)
        assert off.num_kernels - on.num_kernels == L and on.num_linear_kernels == off.num_linear_kernels
        assert off.num_pdl_kernels - on.num_pdl_kernels == (L if pdl else 0)
        assert dataclasses.replace(on, num_kernels=off.num_kernels, num_pdl_kernels=off.num_pdl_kernels) == off
    assert forward_cost(cfg, 1, 512, **flags, rope_in_attention=True).num_kernels == 5 * L + (1 + 7 + 1 + 1) + 1
    for T, kw in ((16, flags), (1, dict(fused=True)), (1, dict(flags, compiled=True))):
        assert forward_cost(cfg, T, 512, **kw, rope_in_attention=True) == forward_cost(cfg, T, 512, **kw)


def test_cost_model_sees_the_switch_through_the_profile_and_the_loop_knobs():
    """rope_in_attention is one of KERNEL_FLAGS: a profile or the loop's knobs with it on price one launch a
    one-token layer fewer; the DFlash draft pass does not follow it (it is the dense model's)."""
    from specpilot.config import EngineConfig as EC
    from specpilot.costmodel.gaps import StepProfile, engine_fields
    from specpilot.costmodel.shapes import KERNEL_FLAGS, draft_kernel_flags, kernel_flags
    from specpilot.loop import _knobs

    assert "rope_in_attention" in KERNEL_FLAGS and "rope_in_attention" not in draft_kernel_flags(EC())
    on = EC(rope_in_attention=True, rope_in_qkv=False)
    prof = StepProfile(draft_s=0.0, verify_s=1e-3, accept_s=0.0, other_s=0.0, tau=1.0, num_draft_tokens=0,
                       drafter_passes=0, context_len=64, **engine_fields(on))
    assert kernel_flags(prof)["rope_in_attention"] and _knobs(on).rope_in_attention
    assert not _knobs(EC()).rope_in_attention
