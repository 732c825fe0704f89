"""qkv GEMM + RoPE + K/V write of a verify block in one launch (kernels/qkv_rope_rows.py) against the two launches
it replaces (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed")  # conftest sets TRITON_INTERPRET on CPU


def _case(T, H, Hkv, D, K, dtype, seed, bias=True, norm=True, S=40, outside=False):
    from specpilot.models.dense import rope_cos_sin
    from specpilot.models.config import ModelConfig

    g = torch.Generator().manual_seed(seed)
    N = (H + 2 * Hkv) * D
    x = torch.randn(T, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = (0.1 * torch.randn(N, generator=g)).to(dtype) if bias else None
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype) if norm else None
    positions = (torch.arange(T) + 7)[None]
    if outside:
        positions[0, -1] = S + 3  # past the pool: not written
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = positions[..., None].float() * inv
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [1, 1, T, D]
    kc = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    vc = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    return x, w, b, nw, cos, sin, positions, kc, vc


@pytest.mark.parametrize("T,H,Hkv,D,dtype", [(2, 4, 2, 16, torch.float32), (7, 2, 1, 32, torch.bfloat16),
                                             (16, 6, 2, 16, torch.bfloat16)])
@pytest.mark.parametrize("bias,norm", [(True, True), (False, False)])
def test_matches_the_gemm_then_rope_write(T, H, Hkv, D, dtype, bias, norm):
    from specpilot.kernels.qkv_rope_rows import qkv_rope_rows, qkv_rope_rows_reference

    x, w, b, nw, cos, sin, positions, kc, vc = _case(T, H, Hkv, D, 72, dtype, T * D, bias, norm)
    kc2, vc2 = kc.clone(), vc.clone()
    want = qkv_rope_rows_reference(x, w, b, nw, 1e-6, cos, sin, positions, kc, vc, H)
    got = qkv_rope_rows(x, w, b, nw, 1e-6, cos, sin, positions, kc2, vc2, H)
    assert got.shape == (1, H, T, D) and got.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(kc2, kc, **tol)
    torch.testing.assert_close(vc2, vc, **tol)
    if dtype == torch.bfloat16:  # only the dot products' summation order differs: nearly every value is the same
        assert (got == want).float().mean() > 0.9 and (kc2 == kc).float().mean() > 0.95
    written = torch.zeros(kc.shape[2], dtype=torch.bool)  # the slots the positions name, nothing elsewhere
    written[positions[0]] = True
    kc0 = _case(T, H, Hkv, D, 72, dtype, T * D, bias, norm)[7]
    assert torch.equal(kc2[:, :, ~written], kc0[:, :, ~written])


def test_a_position_outside_the_pool_is_not_written():
    from specpilot.kernels.qkv_rope_rows import qkv_rope_rows, qkv_rope_rows_reference

    x, w, b, nw, cos, sin, positions, kc, vc = _case(5, 4, 2, 16, 72, torch.float32, 2, outside=True)
    kc2, vc2 = kc.clone(), vc.clone()
    got = qkv_rope_rows(x, w, b, nw, 1e-6, cos, sin, positions, kc2, vc2, 4)
    want = qkv_rope_rows_reference(x[:4], w, b, nw, 1e-6, cos[:, :, :4], sin[:, :, :4], positions[:, :4], kc, vc, 4)
    torch.testing.assert_close(got[:, :, :4], want, rtol=1e-5, atol=1e-5)  # rows are independent
    torch.testing.assert_close(kc2, kc, rtol=1e-5, atol=1e-5)  # the fifth token wrote nothing
    torch.testing.assert_close(vc2, vc, rtol=1e-5, atol=1e-5)


def test_takes_the_handed_over_sums_of_squares_for_its_norm():
    from specpilot.kernels.norm_handoff import ss_reference
    from specpilot.kernels.qkv_rope_rows import qkv_rope_rows, qkv_rope_rows_reference

    x, w, b, nw, cos, sin, positions, kc, vc = _case(5, 4, 2, 16, 72, torch.float32, 3)
    kc2, vc2 = kc.clone(), vc.clone()
    want = qkv_rope_rows_reference(x, w, b, nw, 1e-6, cos, sin, positions, kc, vc, 4)
    got = qkv_rope_rows(x, w, b, nw, 1e-6, cos, sin, positions, kc2, vc2, 4, norm_ss=ss_reference(x, 16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc2, kc, rtol=1e-5, atol=1e-5)
    halved = qkv_rope_rows(x, w, None, nw, 1e-6, cos, sin, positions, kc2, vc2, 4, norm_ss=4 * ss_reference(x, 16))
    plain = qkv_rope_rows(x, w, None, nw, 1e-6, cos, sin, positions, kc2, vc2, 4)
    torch.testing.assert_close(halved, plain / 2, rtol=1e-4, atol=1e-5)  # it reads the sums: rstd halves


def test_bad_arguments_are_clear_errors():
    from specpilot.kernels.qkv_rope_rows import qkv_rope_rows

    x, w, b, nw, cos, sin, positions, kc, vc = _case(4, 4, 2, 16, 72, torch.float32, 1)
    with pytest.raises(ValueError, match="2 <= T"):
        qkv_rope_rows(x[:1], w, b, nw, 1e-6, cos[:, :, :1], sin[:, :, :1], positions[:, :1], kc, vc, 4)
    with pytest.raises(ValueError, match="fused qkv"):
        qkv_rope_rows(x, w, b, nw, 1e-6, cos, sin, positions, kc, vc, 3)
    with pytest.raises(ValueError, match="positions"):
        qkv_rope_rows(x, w, b, nw, 1e-6, cos, sin, positions[:, :3], kc, vc, 4)
    with pytest.raises(ValueError, match="dtype"):
        qkv_rope_rows(x, w, b, nw, 1e-6, cos.double(), sin.double(), positions, kc, vc, 4)


def test_the_cost_model_counts_a_launch_fewer_a_layer_without_a_qk_norm():
    from specpilot.costmodel import synthetic_config
    from specpilot.costmodel.shapes import KERNEL_FLAGS, forward_cost
    from specpilot.loop import EngineMeasure

    flags = dict(fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True, fused_verify=True, pdl=True)
    for shape, fewer in (("qwen2.5-1.5b", True), ("qwen3-8b", False)):
        cfg = synthetic_config(shape)
        off, on = forward_cost(cfg, 16, 512, **flags), forward_cost(cfg, 16, 512, **flags, verify_rope_in_qkv=True)
        L = cfg.num_hidden_layers * fewer
        assert off.num_kernels - on.num_kernels == L and off.num_pdl_kernels - on.num_pdl_kernels == L
        assert forward_cost(cfg, 1, 512, **flags, verify_rope_in_qkv=True) == forward_cost(cfg, 1, 512, **flags)
    assert "verify_rope_in_qkv" in KERNEL_FLAGS and "verify_rope_in_qkv" in EngineMeasure.LAYOUT
