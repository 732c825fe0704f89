"""Two verify-block switches. EngineConfig.verify_l2_mb: a verify block's split-KV attention warms o_proj's weight in
L2 (a hint; kernels/decode_attention.py VERIFY_WARM_MAX_BYTES). EngineConfig.gemm_bucket_min: the M-row GEMMs'
autotuning bucket at least that (kernels/gemm_rows.py M_BUCKET_MIN; tested last). On CPU the hint never runs (the interpreter has no inline PTX), so
these tests pin the wiring, the arguments' rules, that the verify step hands over o_proj's weight, and (compiled
for sm_90) that the prefetch is the kernel's first memory instruction and exists only with WARM."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.errors import ConfigError

da = pytest.importorskip("specpilot.kernels.decode_attention")
if da.triton is None:
    pytest.skip("needs triton", allow_module_level=True)


def test_the_field_validates_reaches_the_kernel_module_on_cuda_only_and_has_a_flag(monkeypatch):
    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.engine import _apply_program_splits

    monkeypatch.setattr(da, "VERIFY_WARM_MAX_BYTES", 0)
    assert EngineConfig().verify_l2_mb == 0  # off until the H200 says it pays
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ConfigError, match="verify_l2_mb"):
            EngineConfig(verify_l2_mb=bad)
    _apply_program_splits(EngineConfig(device="cuda", verify_l2_mb=8))
    assert da.VERIFY_WARM_MAX_BYTES == 8 << 20
    _apply_program_splits(EngineConfig(verify_l2_mb=8))  # CPU: nothing to warm
    assert da.VERIFY_WARM_MAX_BYTES == 0
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args(["--verify-l2-mb", "16"])).verify_l2_mb == 16


def test_warm_args_take_a_small_contiguous_weight_on_the_device_and_split_it_in_whole_granules(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as compiled on a GPU (nothing is launched here)
    monkeypatch.setattr(da, "VERIFY_WARM_MAX_BYTES", 1 << 20)
    cpu = torch.empty(0)  # the kernel's dummy pointer (its device: the kernel's)
    w = torch.empty(64, 64, dtype=torch.bfloat16)  # 8192 bytes
    ptr, span, total, on = da.warm_args(w, 3, cpu)
    assert on and total == 8192 and span % 16 == 0 and 2 * span < total <= 3 * span  # every byte, whole granules
    assert ptr.dtype == torch.int8 and ptr.data_ptr() == w.data_ptr() and ptr.numel() == 8192
    assert da.warm_args(None, 3, cpu)[1:] == (0, 0, False)
    assert da.warm_args(w.t(), 3, cpu)[1:] == (0, 0, False)  # not contiguous
    assert da.warm_args(torch.empty(1, 7, dtype=torch.bfloat16), 3, cpu)[1:] == (0, 0, False)  # 14 bytes
    assert da.warm_args(torch.empty(1024, 1024), 3, cpu)[1:] == (0, 0, False)  # 4 MiB > the limit
    assert da.warm_args(w, 3, torch.empty(0, device="meta"))[1:] == (0, 0, False)  # not the kernel's device
    assert da.warm_args(None, 3, cpu)[0] is cpu  # off: the dummy itself, nothing allocated
    monkeypatch.setattr(da, "VERIFY_WARM_MAX_BYTES", 0)
    assert da.warm_args(w, 3, cpu)[1:] == (0, 0, False)
    monkeypatch.setattr(da, "VERIFY_WARM_MAX_BYTES", 1 << 20)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter: never (no inline PTX)
    assert da.warm_args(w, 3, cpu)[1:] == (0, 0, False)


def test_a_fused_verify_step_hands_each_layers_o_proj_weight_to_its_attention(tiny_model_dir, monkeypatch):
    """The 5-token fused verify step passes every layer's o_proj weight to the split kernel's warming (taken or
    not by warm_args); one-token steps (the one-launch attention) pass nothing; the logits do not change."""
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen3")).use_fused_decode().use_fused_verify()
    seen = []
    real = da.warm_args

    def spy(warm, programs, dummy):
        seen.append(warm)
        return real(warm, programs, dummy)

    def step(m, tokens):
        cache = m.new_cache(1, 32)
        with torch.no_grad():
            m(torch.arange(3, 23)[None], torch.arange(20)[None], cache, kv_len=20)  # prefill of 20: regular
            del seen[:]
            T = len(tokens)
            return m.logits(m(torch.tensor([tokens]), torch.arange(20, 20 + T)[None], cache, kv_len=None))

    off = step(copy.deepcopy(model), [8, 9, 10, 11, 12])
    monkeypatch.setattr(da, "warm_args", spy)
    monkeypatch.setattr(da, "VERIFY_WARM_MAX_BYTES", 1 << 30)
    on = step(model, [8, 9, 10, 11, 12])
    weights = [layer.self_attn.o_proj.weight for layer in model.model.layers]
    assert len(seen) == len(weights) and all(s is w for s, w in zip(seen, weights))
    assert torch.equal(on, off)
    step(model, [8])  # one token: the one-launch attention, no split kernel
    assert seen == []


def test_compiled_the_warming_is_the_split_kernels_first_memory_instruction(sm90_report):
    report = sm90_report("warm_ptx.py")
    off, on = report["off"], report["on"]
    assert off["l2_prefetches"] == 0 and off["first_l2_prefetch"] is None
    assert on["l2_prefetches"] >= 1 and on["first_l2_prefetch"] < on["first_load"] < on["first_store"], on


def test_gemm_bucket_min_validates_reaches_the_kernel_module_and_sets_the_launchs_bucket(monkeypatch):
    """EngineConfig.gemm_bucket_min -> gemm_rows.M_BUCKET_MIN (CUDA only); the M-row launch's M_BUCKET (the
    autotuner's key, never read by the kernel) is M's power of two, raised to it; the numbers do not change."""
    from specpilot.engine import _apply_program_splits
    from specpilot.kernels import gemm_rows as gr
    from specpilot.kernels import gemv_fused as gf

    monkeypatch.setattr(gr, "M_BUCKET_MIN", 0)
    assert EngineConfig().gemm_bucket_min == 0
    for bad in (-1, 3, 32, True, 16.0):
        with pytest.raises(ConfigError, match="gemm_bucket_min"):
            EngineConfig(gemm_bucket_min=bad)
    _apply_program_splits(EngineConfig(device="cuda", gemm_bucket_min=16))
    assert gr.M_BUCKET_MIN == 16
    _apply_program_splits(EngineConfig(gemm_bucket_min=16))  # CPU: the plain buckets
    assert gr.M_BUCKET_MIN == 0
    buckets = []
    real = gr._gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                buckets.append(args[16])  # x, w, b, nw, r, y, ws, cnt, M, N, K, 4 strides, eps, then M_BUCKET
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(gr, "_gemm_kernel", Spy())
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(24, 64)
    y0 = gf.gemv_fused(x, w)
    monkeypatch.setattr(gr, "M_BUCKET_MIN", 16)
    y1 = gf.gemv_fused(x, w)
    assert buckets == [8, 16] and torch.equal(y0, y1)
    assert torch.allclose(y0, gf.gemv_fused_reference(x, w), atol=1e-5)
