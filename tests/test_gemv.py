"""Triton GEMV v2 (kernels/gemv.py) vs its PyTorch twin; TRITON_INTERPRET=1 runs the kernels on CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # as conftest does: the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed")

from specpilot.kernels.gemv import MAX_M, SkinnyLinear, gemv, gemv_op, gemv_reference  # noqa: E402


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
