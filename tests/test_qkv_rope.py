"""Norm + qkv GEMV + RoPE + K/V write in one launch (kernels/qkv_rope.py, EngineConfig.rope_in_qkv).

Kernel (TRITON_INTERPRET=1 on CPU): q and the whole cache are the bits of the two launches it replaces (gemv_fused's
one-row GEMV, then rope_write), with and without the norm prologue and the bias, GQA and not, positions at 0 and
at the end of the pool; a position outside the pool writes nothing; bad arguments are one clear ValueError.
Model and engine: a fused one-token step with the switch gives the bits of the step without it; greedy AR and
speculation equal AR token for token, Qwen3's per-head q/k norm included (each head's last program normalizes it).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # as conftest does: the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed")

from specpilot.kernels.gemv_fused import gemv_fused  # noqa: E402
from specpilot.kernels.qkv_rope import qkv_rope, qkv_rope_reference  # noqa: E402
from specpilot.kernels.rope_write import rope_write  # noqa: E402


def _case(H, Hkv, D, K, S, position, dtype, bias=True, norm=True, seed=0, qk_norm=False):
    g = torch.Generator().manual_seed(seed)
    N = (H + 2 * Hkv) * D
    x = (2 * torch.randn(1, K, generator=g)).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = (0.5 * torch.randn(N, generator=g)).to(dtype) if bias else None
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype) if norm else None
    pos = torch.tensor([[position]])
    freqs = pos[..., None].float() * (1.0 / 1e6 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [1, 1, 1, D]
    kc, vc = (torch.randn(1, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    args = (x, w, b, nw, 1e-6, emb.cos().to(dtype), emb.sin().to(dtype), pos, kc, vc, H)
    if qk_norm:  # Qwen3's per-head norms (their own eps)
        args += tuple((1 + 0.3 * torch.randn(D, generator=g)).to(dtype) for _ in range(2)) + (1e-5,)
    return args


def _two_launches(x, w, b, nw, eps, cos, sin, pos, kc, vc, H, qn=None, kn=None, qk_eps=1e-6):
    """The fused layer's path without the switch: gemv_fused (norm + qkv + bias), then rope_write (+ q/k norm)."""
    kc, vc = kc.clone(), vc.clone()
    D, Hkv = kc.shape[-1], kc.shape[1]
    qkv = gemv_fused(x, w, b, norm_weight=nw, eps=eps)
    q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = (t.view(1, 1, -1, D).transpose(1, 2) for t in (q, k, v))
    return rope_write(q, k, v, cos, sin, pos, kc, vc, qn, kn, qk_eps), kc, vc


def _one_launch(x, w, b, nw, eps, cos, sin, pos, kc, vc, H, *qk):
    kc, vc = kc.clone(), vc.clone()
    return qkv_rope(x, w, b, nw, eps, cos, sin, pos, kc, vc, H, *qk), kc, vc


@pytest.mark.parametrize("H,Hkv,D,K,position,dtype,bias,norm,qk_norm", [
    (12, 2, 64, 200, 0, torch.bfloat16, True, True, False),  # the 1.5B's GQA group, bias (Qwen2), position 0
    (12, 2, 64, 200, 39, torch.bfloat16, True, False, False),  # normed already (the norm epilogue), the last slot
    (4, 4, 16, 96, 7, torch.float32, False, True, False),  # no GQA, no bias (Llama), fp32
    (8, 2, 128, 130, 17, torch.float16, True, True, False),  # D 128 (the 1.5B's head_dim), fp16
    (8, 2, 128, 130, 17, torch.bfloat16, False, True, True),  # Qwen3: q/k norm, D 128 (32 programs a head count in)
    (4, 4, 16, 96, 39, torch.float32, False, False, True),  # q/k norm, fp32, no GQA, normed already, last slot
    (6, 2, 32, 64, 0, torch.bfloat16, True, True, True),  # q/k norm with a bias, position 0
])
def test_qkv_rope_is_the_gemv_then_rope_write_bit_for_bit(H, Hkv, D, K, position, dtype, bias, norm, qk_norm):
    args = _case(H, Hkv, D, K, 40, position, dtype, bias, norm, seed=H + D + K, qk_norm=qk_norm)
    want, want_k, want_v = _two_launches(*args)
    got, got_k, got_v = _one_launch(*args)
    assert got.shape == (1, H, 1, D) and got.dtype == dtype
    assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    kc, vc = args[8], args[9]
    written = torch.zeros(kc.shape, dtype=torch.bool)
    written[:, :, position] = True
    assert not torch.equal(got_k[written], kc[written]) and not torch.equal(got_v[written], vc[written])
    assert torch.equal(got_k[~written], kc[~written]) and torch.equal(got_v[~written], vc[~written])
    # the plain-PyTorch twin: cuBLAS-order sums (fp32 / few-ulp agreement), the same slots written
    ref_k, ref_v = kc.clone(), vc.clone()
    ref = qkv_rope_reference(*args[:8], ref_k, ref_v, H, *args[11:])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(got_k, ref_k, **tol)
    torch.testing.assert_close(got_v, ref_v, **tol)


@pytest.mark.parametrize("H,Hkv,D,K,position,dtype,bias,norm,qk_norm", [
    (12, 2, 64, 200, 39, torch.bfloat16, True, True, False),
    (4, 4, 16, 96, 7, torch.float32, False, True, False),
    (8, 2, 128, 130, 17, torch.bfloat16, True, True, True),
    (6, 2, 32, 64, 0, torch.bfloat16, True, False, True),
])
def test_early_loads_give_the_same_bits(monkeypatch, H, Hkv, D, K, position, dtype, bias, norm, qk_norm):
    """EARLY_EPI (EngineConfig.early_epilogue: bias, cache slot and cos / sin loaded right after the wait) and
    TILE_AFTER_WAIT (tile_after_wait: the first weight tile ahead of the norm prologue) are the same values in the
    same sums: q and both caches the bits of the plain kernel's."""
    import specpilot.kernels.qkv_rope as qr

    args = _case(H, Hkv, D, K, 40, position, dtype, bias, norm, seed=H + K, qk_norm=qk_norm)
    want, want_k, want_v = _one_launch(*args)
    for flag in ("EARLY_EPILOGUE", "FIRST_TILE_AFTER_WAIT"):  # each, then both (TILE_AFTER_WAIT: the first tile
        monkeypatch.setattr(qr, flag, True)  # ahead of the norm prologue)
        got, got_k, got_v = _one_launch(*args)
        assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v), flag
    monkeypatch.setattr(qr, "EARLY_EPILOGUE", False)
    got, got_k, got_v = _one_launch(*args)
    assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("H,Hkv,D,K,position,dtype,bias,norm,qk_norm,tile", [
    (12, 2, 64, 200, 39, torch.bfloat16, True, True, False, False),  # 4 blocks of 64, the last one partial
    (4, 4, 16, 96, 7, torch.float32, False, True, False, True),  # 2 blocks (the 1.5B shape's count), with the tile
    (8, 2, 128, 130, 17, torch.bfloat16, True, True, True, False),  # 3 blocks, q/k norms
    (6, 2, 32, 64, 0, torch.bfloat16, True, False, True, False),  # one block: the second load all masked
])
def test_the_pipelined_k_loop_gives_the_same_bits(monkeypatch, H, Hkv, D, K, position, dtype, bias, norm, qk_norm,
                                                  tile):
    """PIPE (EngineConfig.qkv_pipeline: the first two blocks' tiles asked for right after the wait, each iteration
    asking for the block two ahead before it sums its own; blocks past K fully masked) sums the same values in the
    same order: q and both caches are the plain loop's bits, with or without TILE_AFTER_WAIT."""
    import specpilot.kernels.qkv_rope as qr

    args = _case(H, Hkv, D, K, 40, position, dtype, bias, norm, seed=H + K + 1, qk_norm=qk_norm)
    want, want_k, want_v = _one_launch(*args)
    monkeypatch.setattr(qr, "PIPE", True)
    monkeypatch.setattr(qr, "FIRST_TILE_AFTER_WAIT", tile)
    got, got_k, got_v = _one_launch(*args)
    assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_position_outside_the_pool_writes_nothing(qk_norm):
    args = list(_case(4, 2, 16, 64, 8, 0, torch.float32, seed=3, qk_norm=qk_norm))
    args[7] = torch.tensor([[8]])  # S = 8: one past the end
    q, kc, vc = _one_launch(*args)
    assert torch.equal(kc, args[8]) and torch.equal(vc, args[9]) and torch.isfinite(q).all()
    want, _, _ = _two_launches(*args[:7], torch.tensor([[3]]), *args[8:])  # q itself does not depend on the slot
    assert torch.equal(q, want)


def test_the_head_counters_are_back_at_zero_after_each_launch():
    """Every q/k head's last program zeroes its counter: a second launch (the next layer, a graph replay) counts
    from zero again and gives the same bits."""
    from specpilot.kernels.qkv_rope import _COUNTERS

    args = _case(4, 2, 16, 64, 8, 3, torch.bfloat16, seed=6, qk_norm=True)
    first = _one_launch(*args)
    counters = _COUNTERS[args[0].device]
    assert counters.numel() >= 6 and not counters.any()
    second = _one_launch(*args)
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and not counters.any()


@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__(0, a[0].repeat(2, 1)), "one row"),
    (lambda a: a.__setitem__(1, a[1][:-1]), "fused qkv"),
    (lambda a: a.__setitem__(2, a[2][:-1]), "bias"),
    (lambda a: a.__setitem__(5, a[5].repeat(1, 1, 2, 1)), "one token"),
    (lambda a: a.__setitem__(7, torch.tensor([[1.0]])), "integer position"),
    (lambda a: a.__setitem__(8, a[8].double()), "head_dim|dtype|must both"),
    (lambda a: a.__setitem__(1, a[1].double()), "dtype"),
    (lambda a: a.__setitem__(12, None), "come together"),
    (lambda a: a.__setitem__(11, a[11][:-1]), "q_norm_weight must be"),
    (lambda a: a.__setitem__(12, a[12].double()), "dtype"),
])
def test_bad_arguments_are_one_clear_error(change, message):
    args = list(_case(4, 2, 16, 64, 8, 3, torch.float32, seed=4, qk_norm=True))
    change(args)
    with pytest.raises(ValueError, match=message):
        qkv_rope(*args)


def _spy(launch_spy):
    """-> the list of qkv_rope's and rope_write's launches, in order."""
    import specpilot.kernels.qkv_rope as qr
    import specpilot.kernels.rope_write as rw

    launch_spy(rw, "_rope_write_kernel", "rope_write")
    launch_spy(qr, "_kernel", "qkv_rope")
    return launch_spy.launches


def _steps(model, ids, blocks, norm_epilogue=False):
    """Prefill ids[:6], then `blocks` steps of T tokens each -> logits of every step and the whole cache."""
    from specpilot.models import fused_decode  # noqa: F401  (the path under test)

    model.norm_epilogue = norm_epilogue
    cache = model.new_cache(1, 40)
    t, out = 6, []
    with torch.no_grad():
        model(ids[:, :6], torch.arange(6)[None], cache, kv_len=6)
        for T in blocks:
            pos = torch.arange(t, t + T)[None]
            out.append(model.logits(model(ids[:, t:t + T], pos, cache, kv_len=None)))
            t += T
    return out + [cache.k, cache.v]


@pytest.mark.parametrize("family,dtype,norm_epilogue", [("qwen2", torch.float32, False),
                                                        ("qwen2", torch.bfloat16, True),
                                                        ("llama", torch.bfloat16, False),
                                                        ("qwen3", torch.bfloat16, False),
                                                        ("qwen3", torch.float32, True)])
def test_fused_steps_with_rope_in_qkv_give_the_same_bits(tiny_model_dir, launch_spy, family, dtype, norm_epilogue):
    """One-token steps and a 7-token verify block, with and without the norm epilogue (qkv then runs norm-free):
    logits and the whole cache bit for bit; one-token layers launch qkv_rope, the prefill and the block rope_write."""
    import copy

    from specpilot.models import load_model

    off = load_model(tiny_model_dir(family), dtype=dtype).use_fused_decode().use_fused_verify()
    on = copy.deepcopy(off).use_rope_in_qkv()
    ids = torch.randint(3, 96, (1, 6 + 3 + 7 + 1), generator=torch.Generator().manual_seed(5))
    blocks = (1, 1, 1, 7, 1)
    launches = _spy(launch_spy)
    want = _steps(off, ids, blocks, norm_epilogue)
    L = off.config.num_hidden_layers
    assert launches == ["rope_write"] * L * 6
    launches.clear()
    got = _steps(on, ids, blocks, norm_epilogue)
    one, block = ["qkv_rope"] * L, ["rope_write"] * L
    assert launches == block + one * 3 + block + one
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_ar_and_spec_with_rope_in_qkv_equal_ar(tiny_model_dir, family):
    """Greedy AR through the engine with the switch gives the regular path's tokens; an n-gram speculative engine
    (fused verify blocks between one-token steps) too; Qwen3 (q/k norm) as well."""
    from specpilot.config import EngineConfig
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine
    from specpilot.models import load_model

    path = tiny_model_dir(family)
    on = load_model(path).use_fused_decode().use_fused_verify().use_rope_in_qkv()
    cfg = EngineConfig(drafter_kind="none", max_new_tokens=10, max_seq_len=32, ignore_eos=True, ngram_assist=0)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    want = Engine(load_model(path), cfg).generate(prompt).output_ids
    assert Engine(on, cfg).generate(prompt).output_ids == want
    spec = Engine(on, cfg.with_(drafter_kind="ngram", num_draft_tokens=3), NgramDrafter(3, 1))
    assert spec.generate(prompt).output_ids == want


def test_rope_in_qkv_field_setter_loop_and_cost_model(tiny_model_dir, monkeypatch):
    import argparse

    import specpilot.engine as eng
    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.config import EngineConfig
    from specpilot.costmodel.shapes import KERNEL_FLAGS, forward_cost
    from specpilot.errors import ConfigError
    from specpilot.loop import EngineMeasure, _knobs
    from specpilot.loop.registry import REGISTRY, Deployment, applicable
    from specpilot.models import load_model
    from specpilot.models.config import ModelConfig

    assert EngineConfig().rope_in_qkv is True  # on since session 31 (H200: 1.5B -2 to -4%, Qwen3-8B neutral)
    for bad, message in (("false", "true or false"), (True, "--no-rope-in-qkv")):
        with pytest.raises(ConfigError, match=message):
            EngineConfig(rope_in_qkv=bad, rope_in_attention=bad is True)
    assert EngineConfig(rope_in_attention=True, rope_in_qkv=False).rope_in_attention
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).rope_in_qkv
    assert not engine_config(parser.parse_args(["--no-rope-in-qkv"])).rope_in_qkv
    assert "rope_in_qkv" in EngineMeasure.LAYOUT and "rope_in_qkv" in KERNEL_FLAGS
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    # the loop: from the default it tries rope_in_qkv off, and rope_in_attention only with rope_in_qkv off
    assert REGISTRY["rope_in_qkv"].candidates(gpu.config, gpu) == [{"rope_in_qkv": False, "rope_in_attention": False}]
    assert REGISTRY["rope_in_attention"].candidates(gpu.config, gpu) == [{"rope_in_attention": True,
                                                                         "rope_in_qkv": False}]
    in_attention = gpu.config.with_(rope_in_attention=True, rope_in_qkv=False)
    assert REGISTRY["rope_in_qkv"].candidates(in_attention, gpu) == [{"rope_in_qkv": False, "rope_in_attention": False},
                                                                     {"rope_in_qkv": True, "rope_in_attention": False}]
    assert "rope_in_qkv" not in [m.name for m in applicable(gpu, gpu.config.with_(fused_decode=False))]
    assert _knobs(EngineConfig(rope_in_qkv=True)).rope_in_qkv
    # the setter and the engine's layout: needs fused_decode (a q/k norm is served)
    with pytest.raises(ConfigError, match="rope_in_qkv needs fused_decode"):
        load_model(tiny_model_dir("qwen2")).use_rope_in_qkv()
    assert load_model(tiny_model_dir("qwen3")).use_fused_decode().use_rope_in_qkv().rope_in_qkv
    monkeypatch.setattr(eng, "_kernel_on", lambda config, field="attention_kernel": getattr(config, field))
    on = EngineConfig(norm_kernel=False, rope_kernel=False, rope_in_qkv=True)
    model = load_model(tiny_model_dir("qwen2"))
    eng._apply_layout(model, on)  # pretending to be on CUDA
    assert model.fused_decode and model.rope_in_qkv
    qwen3 = load_model(tiny_model_dir("qwen3"))
    eng._apply_layout(qwen3, on)
    assert qwen3.fused_decode and qwen3.rope_in_qkv
    # priced as one launch a one-token fused layer fewer, q/k-norm models too; bytes unchanged
    flags = dict(fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True, fused_verify=True)
    for qk_norm in (False, True):
        cfg = ModelConfig(model_type="qwen3" if qk_norm else "qwen2", vocab_size=1000, hidden_size=256,
                          intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, qk_norm=qk_norm)
        off, with_ = forward_cost(cfg, 1, 64, **flags), forward_cost(cfg, 1, 64, **flags, rope_in_qkv=True)
        assert off.num_kernels - with_.num_kernels == 4 and off.weight_bytes == with_.weight_bytes
        assert forward_cost(cfg, 7, 64, **flags, rope_in_qkv=True) == forward_cost(cfg, 7, 64, **flags)


def test_engine_sets_the_qkv_pipeline_from_the_config(monkeypatch, switch_wired):
    """EngineConfig.qkv_pipeline -> kernels/qkv_rope.py PIPE when a model is laid out for a CUDA config with the
    fused one-token path (off by default; quietly ignored on CPU; a warning without fused_decode); a bool; a CLI
    flag; in the loop's layout key and searched by its mechanism."""
    import specpilot.kernels.qkv_rope as qr
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_gemv_prefetch

    monkeypatch.setattr(qr, "PIPE", False)
    _apply_gemv_prefetch(EngineConfig(qkv_pipeline=True))  # CPU: nothing to switch
    assert qr.PIPE is False
    _apply_gemv_prefetch(EngineConfig(device="cuda", qkv_pipeline=True))
    assert qr.PIPE is True
    _apply_gemv_prefetch(EngineConfig(device="cuda"))
    assert qr.PIPE is False
    with pytest.warns(RuntimeWarning, match="qkv_pipeline needs fused_decode"):
        _apply_gemv_prefetch(EngineConfig(device="cuda", fused_decode=False, qkv_pipeline=True))
    assert qr.PIPE is False
    switch_wired("qkv_pipeline", "--qkv-pipeline", "qkv_pipeline", {"qkv_pipeline": True})
