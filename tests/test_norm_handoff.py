"""The norm handoff (kernels/norm_handoff.py): an M-row GEMV writes its rows' group sums of squares, the next one
normalizes its input from them (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed")  # conftest sets TRITON_INTERPRET on CPU


def _data(M, K, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    r = torch.randn(M, N, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    return x, w, r, nw


@pytest.mark.parametrize("M,N,split,act", [(2, 40, 1, ""), (5, 48, 2, ""), (16, 33, 1, ""), (7, 64, 1, "silu_mul")])
def test_producer_writes_each_rows_group_sums_of_squares_of_what_it_stored(monkeypatch, M, N, split, act):
    from specpilot.kernels import gemm_rows
    from specpilot.kernels import gemv_fused as gf
    from specpilot.kernels.norm_handoff import ss_reference

    monkeypatch.setattr(gemm_rows, "INTERPRET_SPLIT_K", split)
    K = 160 if split > 1 else 48  # split-K where K >= 2N
    x, w, r, _ = _data(M, K, N, torch.bfloat16, M * N)
    res = None if act else r
    y, ss = gf.gemv_fused(x, w, residual=res, act=act or None, ss_out=True)
    assert torch.equal(y, gf.gemv_fused(x, w, residual=res, act=act or None))  # the output is untouched
    out_n = y.shape[1]
    assert ss.shape == (-(-out_n // 16), 16) and ss.dtype == torch.float32
    torch.testing.assert_close(ss, ss_reference(y, 16), rtol=1e-6, atol=0)
    assert not ss[:, M:].any() and ss[:, :M].min() > 0  # rows past M: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consumer_normalizes_from_the_handed_sums_as_the_rmsnorm_launch_does(dtype):
    """rstd from the partials differs from one tree over the row only in summation order: fp32 agrees to ~1e-6,
    bf16 to a rare ulp of the normed input."""
    from specpilot.kernels.gemv_fused import gemv_fused, gemv_fused_reference
    from specpilot.kernels.norm_handoff import ss_reference

    M, K, N = 9, 72, 40  # K not a multiple of 16: the last group is partial
    x, w, _, nw = _data(M, K, N, dtype, 3)
    want = gemv_fused_reference(x, w, norm_weight=nw, eps=1e-6)
    got = gemv_fused(x, w, norm_weight=nw, eps=1e-6, norm_ss=ss_reference(x, 16))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.95
    # it reads the sums, not x's rows: four times the sums halve every rstd
    halved = gemv_fused(x, w, norm_weight=nw, eps=1e-6, norm_ss=4 * ss_reference(x, 16))
    torch.testing.assert_close(halved.float(), want.float() / 2, rtol=2e-2, atol=2e-2)


def test_a_chain_of_producer_and_consumer_is_deterministic_and_close_to_the_norm_launch():
    """o_proj-like residual GEMV -> (y, ss) -> norm + gate/up from ss; twice the same bits, close to the path with
    an RMSNorm launch between."""
    from specpilot.kernels.gemv_fused import gemv_fused
    from specpilot.kernels.rmsnorm import rmsnorm_reference

    M, K, N, inter = 16, 64, 48, 32
    x, w, r, _ = _data(M, K, N, torch.bfloat16, 11)
    _, gu, _, nw = _data(M, N, 2 * inter, torch.bfloat16, 12)
    runs = []
    for _ in range(2):
        y, ss = gemv_fused(x, w, residual=r, ss_out=True)
        runs.append(gemv_fused(y, gu, norm_weight=nw, eps=1e-6, act="silu_mul", norm_ss=ss))
    assert torch.equal(runs[0], runs[1])
    plain = gemv_fused(rmsnorm_reference(y, nw, 1e-6), gu, act="silu_mul")
    torch.testing.assert_close(runs[0], plain, rtol=1.6e-2, atol=1e-2)


def test_bad_handoff_arguments_are_clear_errors():
    from specpilot.kernels.gemv_fused import gemv_fused
    from specpilot.kernels.norm_handoff import ss_reference

    x, w, r, nw = _data(4, 32, 16, torch.float32, 5)
    ss = ss_reference(x, 16)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv_fused(x, w, norm_ss=ss)
    with pytest.raises(ValueError, match="must be contiguous fp32"):
        gemv_fused(x, w, norm_weight=nw, norm_ss=ss[:1])
    with pytest.raises(ValueError, match="M-row"):
        gemv_fused(x[:1], w, norm_weight=nw, norm_ss=ss)
    with pytest.raises(ValueError, match="ss_out"):
        gemv_fused(x[:1], w, ss_out=True)
    with pytest.raises(ValueError, match="ss_out"):
        gemv_fused(x, w, ss_out=True, out_norm_weight=torch.ones(16))


def test_the_cost_model_counts_two_norm_launches_a_block_and_the_config_checks_the_switch():
    from specpilot.config import EngineConfig
    from specpilot.costmodel import synthetic_config
    from specpilot.costmodel.shapes import KERNEL_FLAGS, forward_cost
    from specpilot.errors import ConfigError
    from specpilot.loop import EngineMeasure

    cfg = synthetic_config("qwen2.5-1.5b")
    L = cfg.num_hidden_layers
    flags = dict(fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True, fused_verify=True)
    for T in (2, 16):
        off, on = forward_cost(cfg, T, 512, **flags), forward_cost(cfg, T, 512, **flags, norm_handoff=True)
        assert off.num_kernels - on.num_kernels == 2 * L - 1  # layer 0's input norm stays
        assert (on.weight_bytes, on.flops) == (off.weight_bytes, off.flops)
    assert forward_cost(cfg, 1, 512, **flags, norm_handoff=True) == forward_cost(cfg, 1, 512, **flags)
    assert "norm_handoff" in KERNEL_FLAGS and "norm_handoff" in EngineMeasure.LAYOUT
    with pytest.raises(ConfigError, match="choose one"):
        EngineConfig(norm_handoff=True, norm_epilogue=True)
    with pytest.raises(ConfigError, match="true or false"):
        EngineConfig(norm_handoff="false")
