"""The norm epilogue (kernels/norm_epilogue.py, EngineConfig.norm_epilogue): a residual GEMV that also writes the
RMSNorm of its output rows, for the GEMV after it.

Kernels (TRITON_INTERPRET=1 on CPU): one row (gemv_fused's GEMV loop), 2-16 rows (its tl.dot kernel, also with
split-K) and the 12-bit one-row GEMV: the GEMV output is the plain launch's, the normed rows are the bits
kernels/rmsnorm.py gives for that output, and the arrival counter is back at 0 after each launch. The interpreter
runs the programs one after another, so it checks the counting (who is last, the reset), not the GPU's memory
ordering (scripts/gpu_engine_check.py --only=norm_epilogue does, on the H200).
Model: a tiny model's fused decode / verify steps with the switch on give the bits of the steps without it.
"""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # as conftest does: the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed")

import specpilot.kernels.gemm_rows as gemm_rows  # noqa: E402
import specpilot.kernels.gemv_fused as gf  # noqa: E402
from specpilot.formats.lossless12 import pack  # noqa: E402
from specpilot.kernels.gemv12 import gemv12  # noqa: E402
from specpilot.kernels.norm_epilogue import counter  # noqa: E402
from specpilot.kernels.rmsnorm import rmsnorm, rmsnorm_reference  # noqa: E402

OUT_EPS = 0.25  # large enough that using the prologue's eps (1e-6) instead would change the numbers


def _inputs(M, K, N, dtype, seed=0):
    """x [M, K] (rows scaled 0.2x-2x: each row needs its own norm statistics), weight [N, K], residual [M, N] and
    a norm weight [N]."""
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(M, K, generator=g) * torch.linspace(0.2, 2.0, M)[:, None]
    w = torch.randn(N, K, generator=g) / K ** 0.5
    r = torch.randn(M, N, generator=g) * torch.linspace(2.0, 0.5, M)[:, None]
    nw = 1 + 0.3 * torch.randn(N, generator=g)
    return tuple(t.to(dtype) for t in (x, w, r, nw))


def _check_epilogue(plain, y, normed, nw):
    assert torch.equal(y, plain)  # the GEMV's own output is unchanged
    assert normed.shape == y.shape and normed.dtype == y.dtype
    assert torch.equal(normed, rmsnorm(y, nw, OUT_EPS))  # the RMSNorm launch's bits, every row
    want = rmsnorm_reference(y, nw, OUT_EPS).float()  # and a norm indeed (not, say, a copy of y)
    assert (normed.float() - want).abs().max().item() <= 2 * torch.finfo(y.dtype).eps * want.abs().max().item()
    assert counter(y.device).item() == 0  # back at 0 for the next launch / graph replay


# N = 37: not a multiple of the interpreter's BLOCK_N (4 one-row, 16 M-row): 10 and 3 programs count in
@pytest.mark.parametrize("M,split,dtype", [(1, 1, torch.float32), (1, 1, torch.bfloat16), (16, 1, torch.float32),
                                           (16, 1, torch.bfloat16), (7, 1, torch.float16), (2, 2, torch.float32),
                                           (16, 3, torch.bfloat16)])
def test_gemv_fused_writes_the_rmsnorm_of_its_output(monkeypatch, M, split, dtype):
    """One row, 2-16 rows, and split-K (where only each N tile's merging program counts in, after its merge)."""
    monkeypatch.setattr(gemm_rows, "INTERPRET_SPLIT_K", split)
    x, w, r, nw = _inputs(M, 200, 37, dtype, seed=M + split)
    plain = gf.gemv_fused(x, w, residual=r)
    y, normed = gf.gemv_fused(x, w, residual=r, out_norm_weight=nw, out_eps=OUT_EPS)
    _check_epilogue(plain, y, normed, nw)
    again = gf.gemv_fused(x, w, residual=r, out_norm_weight=nw, out_eps=OUT_EPS)  # the counter reused
    assert torch.equal(again[0], y) and torch.equal(again[1], normed) and counter(x.device).item() == 0


@pytest.mark.parametrize("M", [1, 5])
def test_a_norm_prologue_and_a_norm_epilogue_keep_their_own_weights_and_eps(M):
    x, w, r, nw = _inputs(M, 96, 40, torch.bfloat16, seed=3)
    pre = (1 + 0.2 * torch.randn(96, generator=torch.Generator().manual_seed(9))).bfloat16()
    plain = gf.gemv_fused(x, w, norm_weight=pre, eps=1e-6)
    y, normed = gf.gemv_fused(x, w, norm_weight=pre, eps=1e-6, out_norm_weight=nw, out_eps=OUT_EPS)
    _check_epilogue(plain, y, normed, nw)


def test_gemv12_writes_the_rmsnorm_of_its_output():
    x, w, r, nw = _inputs(1, 104, 37, torch.bfloat16, seed=4)
    w[5, 11] = 40.0  # an exception (a weight outside the 12-bit table)
    p = pack(w)
    plain = gemv12(x, p, residual=r)
    y, normed = gemv12(x, p, residual=r, out_norm_weight=nw, out_eps=OUT_EPS)
    _check_epilogue(plain, y, normed, nw)
    again = gemv12(x, p, residual=r, out_norm_weight=nw, out_eps=OUT_EPS)
    assert torch.equal(again[0], y) and torch.equal(again[1], normed) and counter(x.device).item() == 0


def test_the_normed_op_and_its_fake():
    x, w, r, nw = _inputs(3, 64, 24, torch.float32, seed=5)
    y, normed = gf.gemv_fused_normed_op(x, w, None, None, 1e-6, r, "", nw, OUT_EPS)
    _check_epilogue(gf.gemv_fused(x, w, residual=r), y, normed, nw)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fy, fn = gf.gemv_fused_normed_op(torch.empty(3, 64), torch.empty(24, 64), None, None, 1e-6,
                                         torch.empty(3, 24), "", torch.empty(24), OUT_EPS)
    assert fy.shape == fn.shape == (3, 24)


def test_bad_norm_epilogue_input_is_a_clear_error():
    x, w, r, nw = _inputs(2, 64, 24, torch.float32)
    with pytest.raises(ValueError, match=r"out_norm_weight must be \[24\]"):
        gf.gemv_fused(x, w, residual=r, out_norm_weight=nw[:20])
    with pytest.raises(ValueError, match="out_norm_weight must be torch.float32"):
        gf.gemv_fused(x, w, residual=r, out_norm_weight=nw.bfloat16())
    with pytest.raises(ValueError, match="unit stride"):
        gf.gemv_fused(x, w, residual=r, out_norm_weight=torch.ones(48)[::2])
    p = pack(w.bfloat16())
    with pytest.raises(ValueError, match=r"gemv12: out_norm_weight must be \[24\]"):
        gemv12(x[:1].bfloat16(), p, out_norm_weight=nw[:3].bfloat16())
    with pytest.raises(ValueError, match="at most 16384 columns"):
        gf.gemv_fused(torch.ones(1, 8), torch.ones(16392, 8), out_norm_weight=torch.ones(16392))


# --- the model ------------------------------------------------------------------------------------------------


def _steps(model, ids, blocks):
    """Prefill ids[:6] (a fused 6-row step), then steps of the given token counts over the whole pool: -> logits,
    captured layer outputs and the cache's K after each."""
    cache = model.new_cache(1, 48)
    pos = torch.arange(ids.shape[1])[None]
    out, t = [], 0
    with torch.no_grad():
        for T in (6,) + tuple(blocks):
            hidden, layers = model(ids[:, t:t + T], pos[:, t:t + T], cache, kv_len=None, return_layers=(0, 1))
            out += [model.logits(hidden), *layers]
            t += T
    return out + [cache.k, cache.v]


def _spy_rmsnorm_launches(monkeypatch):
    import specpilot.kernels.rmsnorm as rk

    real, launches = rk._rmsnorm_kernel, []

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid[0])
            return real[grid]

    monkeypatch.setattr(rk, "_rmsnorm_kernel", Spy())
    return launches


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])  # Qwen2: qkv bias; Qwen3: q/k norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_steps_with_the_norm_epilogue_give_the_same_bits(tiny_model_dir, monkeypatch, family, dtype):
    """One-token steps and verify blocks (7 and 16 rows): logits, captured layers and K/V bit for bit (the norms are
    rmsnorm.py's numbers wherever they are computed; the final norm through the RMSNorm kernel, as on the GPU by
    default: the eager module sums in another order); and the norms' launches are gone but layer 0's."""
    from specpilot.models import load_model

    off = load_model(tiny_model_dir(family), dtype=dtype).use_fused_decode().use_fused_verify().use_norm_kernel()
    on = copy.deepcopy(off).use_norm_epilogue()
    L = off.config.num_hidden_layers
    ids = torch.randint(3, 96, (1, 6 + 1 + 7 + 1 + 16), generator=torch.Generator().manual_seed(2))
    launches = _spy_rmsnorm_launches(monkeypatch)
    blocks = (1, 7, 1, 16)
    want = _steps(off, ids, blocks)
    assert launches == [6] * (2 * L + 1) + [1] + [7] * (2 * L + 1) + [1] + [16] * (2 * L + 1)  # + the final norm
    launches.clear()
    got = _steps(on, ids, blocks)
    assert launches == [6, 7, 16]  # layer 0's input norm of each block; one-token steps: none (prologue)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got))


def test_lossless12_with_the_norm_epilogue_runs_the_12bit_gemvs_norm_free(tiny_model_dir, monkeypatch):
    """bf16 one-token steps over 12-bit copies: qkv (past layer 0) and gate_up get no norm prologue, o_proj and down
    write the norms; the logits are the prologue path's bits."""
    from specpilot.models import fused_decode, load_model

    off = load_model(tiny_model_dir("qwen2"), dtype=torch.bfloat16).use_fused_decode().use_norm_kernel()
    off.use_lossless12()
    on = copy.deepcopy(off).use_norm_epilogue()
    ids = torch.randint(3, 96, (1, 6 + 3), generator=torch.Generator().manual_seed(3))
    want = _steps(off, ids, (1, 1, 1))
    calls = []
    real = fused_decode.gemv12_call
    monkeypatch.setattr(fused_decode, "gemv12_call",
                        lambda x, p, b, nw, eps, res, act, out=None: calls.append((nw is None, out is None))
                        or real(x, p, b, nw, eps, res, act, out))
    got = _steps(on, ids, (1, 1, 1))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    L = on.config.num_hidden_layers
    # per step: layer 0's qkv with its prologue, then (norm-free in, norm out) for o_proj / gate_up / down and the
    # later layers' qkv; the LM head last
    layer0 = [(False, True), (True, False), (True, True), (True, False)]
    later = [(True, True), (True, False), (True, True), (True, False)]
    assert calls == (layer0 + later * (L - 1) + [(True, True)]) * 3


@pytest.mark.parametrize("drafter_kind,k,static", [("ngram", 15, True), ("ngram", 4, False), ("model", 3, False)])
def test_greedy_spec_with_the_norm_epilogue_equals_ar(tiny_model_dir, monkeypatch, drafter_kind, k, static):
    """Speculation whose verify blocks and one-token steps run the fused layer with the norm epilogue gives regular
    AR's tokens, eagerly and through the static bucket path (what a CUDA graph records)."""
    from specpilot.config import EngineConfig
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine, build_drafter
    from specpilot.engine.runner import ModelRunner
    from specpilot.models import fused_decode, load_model

    path = tiny_model_dir("qwen2")
    ref = load_model(path)
    fast = load_model(path).use_fused_decode().use_fused_verify().use_norm_epilogue()
    cfg = EngineConfig(drafter_kind=drafter_kind, num_draft_tokens=k, max_new_tokens=20, max_seq_len=64,
                       ignore_eos=True, ngram_assist=0)
    drafter = NgramDrafter(3, 1) if drafter_kind == "ngram" else build_drafter(
        cfg, load_model(path).use_fused_decode().use_norm_epilogue(), fast)
    eng = Engine(fast, cfg, drafter)
    if static:
        eng.runner = ModelRunner(fast, eng.runner.cache, buckets=(1, k + 1), static=True, greedy_verdict=True)
    blocks = []  # the token count of each fused layer call with the norm epilogue
    real = fused_decode.decode_layer
    monkeypatch.setattr(fused_decode, "decode_layer", lambda layer, x, *a, **kw: (
        blocks.append(x.shape[1]) if kw.get("norm_epilogue") else None) or real(layer, x, *a, **kw))
    for prompt in ([5, 6, 7, 5, 6, 7, 1, 2], [9, 8, 7, 6, 5, 4, 9, 8, 7, 6, 5, 4, 9, 8]):
        want = Engine(ref, cfg.with_(drafter_kind="none")).generate(prompt).output_ids
        got = eng.generate(prompt)
        assert got.output_ids == want
    assert 1 in blocks and max(blocks) > 1  # one-token steps and verify blocks took the epilogue path


def test_norm_epilogue_field_setter_and_loop_mechanism(tiny_model_dir, monkeypatch):
    import argparse

    import specpilot.engine as eng
    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.config import EngineConfig
    from specpilot.errors import ConfigError
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY, Deployment, applicable
    from specpilot.models import load_model

    assert EngineConfig().norm_epilogue is False  # off until measured on the H200
    with pytest.raises(ConfigError, match="norm_epilogue"):
        EngineConfig(norm_epilogue="false")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args(["--norm-epilogue"])).norm_epilogue
    assert "norm_epilogue" in EngineMeasure.LAYOUT
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert "norm_epilogue" in [m.name for m in applicable(gpu, gpu.config)]
    assert REGISTRY["norm_epilogue"].candidates(gpu.config, gpu) == [{"norm_epilogue": True}]
    assert "norm_epilogue" not in [m.name for m in applicable(gpu, gpu.config.with_(fused_decode=False))]
    cpu = Deployment("t", "d", EngineConfig(), "cpu")
    assert "norm_epilogue" not in [m.name for m in applicable(cpu, cpu.config)]
    with pytest.raises(ConfigError, match="norm_epilogue needs fused_decode"):
        load_model(tiny_model_dir("qwen2")).use_norm_epilogue()
    model = load_model(tiny_model_dir("qwen2"))
    eng._apply_layout(model, EngineConfig(norm_epilogue=True))  # a CPU config: CUDA-only, stays off
    assert not model.norm_epilogue
    monkeypatch.setattr(eng, "_kernel_on", lambda config, field="attention_kernel": getattr(config, field))
    on = EngineConfig(norm_kernel=False, rope_kernel=False, norm_epilogue=True)
    eng._apply_layout(model, on)  # pretending to be on CUDA
    assert model.fused_decode and model.norm_epilogue
    alone = load_model(tiny_model_dir("qwen2"))
    with pytest.warns(RuntimeWarning, match="norm_epilogue needs fused_decode"):
        eng._apply_layout(alone, on.with_(fused_decode=False, fused_verify=False))
    assert not alone.norm_epilogue
