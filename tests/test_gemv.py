"""Triton GEMV v2 (kernels/gemv.py) vs its PyTorch twin; TRITON_INTERPRET=1 runs the kernels on CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # as conftest does: the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed")

from specpilot.kernels.gemv import (MAX_M, SkinnyLinear, choose_split_k, gemv, gemv_op, gemv_reference,  # noqa: E402
                                    gemv_split_k)


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# N = 37: not a multiple of BLOCK_N (4 / 16 in the interpreter); K = 200: not a multiple of BLOCK_K (64 / 32)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N,K", [(37, 200), (16, 64)])
def test_gemv_matches_reference(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    got = gemv(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert torch.isfinite(got).all()
    assert _rel(got, gemv_reference(x, w, b)) < 1e-5
    xb, wb, bb = x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()
    got = gemv(xb, wb, bb)
    assert got.dtype == torch.bfloat16
    assert _rel(got, gemv_reference(xb, wb, bb)) < 1e-2


def test_gemv_rejects_bad_shapes():
    assert MAX_M == 16
    with pytest.raises(ValueError):
        gemv(torch.randn(17, 16), torch.randn(8, 16))
    with pytest.raises(ValueError):
        gemv(torch.randn(1, 16), torch.randn(8, 15))
    with pytest.raises(ValueError):
        gemv(torch.randn(0, 16), torch.randn(8, 16))
    with pytest.raises(ValueError):
        gemv(torch.randn(2, 16), torch.randn(8, 16), torch.randn(7))


def test_gemv_op_and_fake():
    x, w = torch.randn(2, 40), torch.randn(24, 40)
    assert _rel(gemv_op(x, w, None), gemv_reference(x, w)) < 1e-5
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert gemv_op(torch.empty(3, 40), torch.empty(24, 40), None).shape == (3, 24)


@pytest.mark.parametrize("lead", [(1, 1), (1, 5), (16,)])
def test_skinny_linear_matches_linear(lead, monkeypatch):
    import specpilot.kernels.gemv as gemv_mod

    monkeypatch.setattr(gemv_mod, "MIN_N_MULTI", 16)  # a small N takes the multi-token kernel path here too
    calls = []
    monkeypatch.setattr(gemv_mod, "gemv_op", lambda *a: calls.append(1) or gemv_op(*a))
    torch.manual_seed(0)
    ref = torch.nn.Linear(72, 20)
    fast = torch.nn.Linear(72, 20)
    fast.load_state_dict(ref.state_dict())
    fast.__class__ = SkinnyLinear
    fast.force_kernel = True
    x = torch.randn(*lead, 72)
    with torch.no_grad():
        assert (fast(x) - ref(x)).abs().max().item() < 1e-4
    assert calls == [1]  # through the kernel, not the library fallback


def test_kernel_only_where_it_measured_faster():
    """M = 1 always; 2..16 tokens only for wide outputs (narrow ones lost to cuBLAS on the H200); prefill never."""
    from specpilot.kernels.gemv import MIN_N_MULTI, uses_kernel

    assert uses_kernel(1, 896) and uses_kernel(1, 151936)
    assert uses_kernel(16, MIN_N_MULTI) and uses_kernel(2, 17920)
    assert not uses_kernel(16, 2048) and not uses_kernel(5, 1536)
    assert not uses_kernel(MAX_M + 1, 17920) and not uses_kernel(0, 17920)


# Interpreter tiles: BLOCK_N 16, BLOCK_K 32. K = 200 -> 7 K blocks: slices of 4/3/2 blocks for SPLIT_K 2/3/4, the
# last one short (K % 32 != 0); K = 64 -> 2 blocks: SPLIT_K 3 and 4 leave empty slices (zero partials).
@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N,K", [(37, 200), (40, 64)])
@pytest.mark.parametrize("split_k", [2, 3, 4])
def test_gemv_split_k_matches_reference(M, N, K, bias, split_k):
    g = torch.Generator().manual_seed(M * 100 + N + K + split_k)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    got = gemv(x, w, b, split_k=split_k)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert _rel(got, gemv_reference(x, w, b)) < 1e-5
    assert torch.equal(got, gemv_split_k(x, w, b, split_k))  # deterministic: fixed-order reduction, no atomics
    xb, wb, bb = x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()
    got = gemv(xb, wb, bb, split_k=split_k)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    assert _rel(got, gemv_reference(xb, wb, bb)) < 1e-2
    assert torch.equal(got, gemv(xb, wb, bb, split_k=split_k))


def test_gemv_split_k_defaults_and_edges():
    x, w, b = torch.randn(3, 96), torch.randn(20, 96), torch.randn(20)
    ref = gemv_reference(x, w, b)
    assert torch.equal(gemv(x, w, b, split_k=1), gemv(x, w, b))  # 1 = the single-launch path
    assert _rel(gemv_split_k(x, w, b), ref) < 1e-5  # automatic split (1 at this K)
    assert _rel(gemv_split_k(x, w, b, 1), ref) < 1e-5
    assert _rel(gemv_split_k(x[:1], w, b, 2), gemv_reference(x[:1], w, b)) < 1e-5  # M = 1 works too
    with pytest.raises(ValueError):
        gemv_split_k(x, w, b, 0)
    with pytest.raises(ValueError):
        gemv_split_k(torch.randn(17, 96), w, b, 2)


def test_choose_split_k():
    """tiles x splits >= ~2 x SMs for the narrow shapes that lost to cuBLAS at M = 16; slices >= 256; wide N: 1."""
    assert choose_split_k(1536, 8960, 132) == 6 and choose_split_k(896, 4864, 132) == 10
    assert choose_split_k(2048, 1536, 132) == 5
    assert choose_split_k(17920, 1536, 132) == 1 and choose_split_k(37, 200, 132) == 1
    for n, k in ((1536, 8960), (896, 4864), (2048, 1536), (1152, 896)):
        s = choose_split_k(n, k, 132)
        assert 1 <= s <= 16 and (s == 1 or k // s >= 256)
