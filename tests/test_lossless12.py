"""Lossless 12-bit weights (formats/lossless12.py) and the GEMV that reads them (kernels/gemv12.py).

The format must give back every bf16 weight bit for bit (zeros, -0, subnormals, inf, NaN, weights outside the
table); the kernel (TRITON_INTERPRET=1 on CPU: the integer decode path, bit-identical to the GPU's PTX one) must
compute what gemv_fused computes from the restored matrix, up to the fp32 summation order."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specpilot.errors import ConfigError  # noqa: E402
from specpilot.formats.lossless12 import bytes_per_weight, pack, unpack  # noqa: E402


def _bits(w):
    return w.view(torch.int16)


def _randn(n, k, seed, scale=0.02):
    return (scale * torch.randn(n, k, generator=torch.Generator().manual_seed(seed))).bfloat16()


def test_roundtrip_is_bit_exact_with_special_values():
    w = _randn(64, 96, seed=0)
    w[0, :10] = 0
    w[1, 3] = -0.0
    w[2, 5] = 1e-39  # subnormal
    w[3, 7], w[3, 8] = float("inf"), float("-inf")
    w[4, 9] = float("nan")
    w[5, 1] = 3e38  # outside any table a 0.02-scale matrix picks
    p = pack(w)
    assert torch.equal(_bits(unpack(p)), _bits(w))
    assert p.num_exceptions >= 4  # inf, -inf, nan, 3e38 (at least) are not table magnitudes
    assert int(p.table[0]) == 0 and p.lo.dtype == p.codes.dtype == torch.uint8


def test_wide_dynamic_range_goes_to_exceptions_and_stays_exact():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(40, 64, generator=g) * torch.exp2(torch.randint(-60, 60, (40, 64), generator=g).float()))
    w = w.bfloat16()
    p = pack(w)
    assert p.num_exceptions > w.numel() // 4  # ~120 binades: most weights are outside the 8-entry table
    assert torch.equal(_bits(unpack(p)), _bits(w))
    assert p.exc_ptr[-1].item() == p.num_exceptions and (p.exc_ptr[1:] >= p.exc_ptr[:-1]).all()


def test_bytes_per_weight_is_about_one_and_a_half():
    p = pack(_randn(256, 1024, seed=2))
    assert 1.5 <= bytes_per_weight(p) < 1.51
    assert p.num_exceptions < 1e-3 * 256 * 1024


def test_bad_input_is_a_clear_error():
    with pytest.raises(ConfigError, match="bf16"):
        pack(torch.randn(4, 8))
    with pytest.raises(ConfigError, match="multiple of 8"):
        pack(torch.randn(4, 12).bfloat16())
    with pytest.raises(ConfigError, match="multiple of 8"):
        pack(torch.randn(8).bfloat16())


triton = pytest.importorskip("triton", reason="triton not installed")
from specpilot.kernels.gemv12 import gemv12, gemv12_reference  # noqa: E402
from specpilot.kernels.gemv_fused import gemv_fused_reference  # noqa: E402

EPS = 1e-6
COMBOS = {
    "plain": dict(),
    "norm+bias": dict(norm=True, bias=True),
    "residual": dict(residual=True),
    "norm+silu_mul": dict(norm=True, act="silu_mul"),
    "norm+bias+silu_mul": dict(norm=True, bias=True, act="silu_mul"),
}


def _kwargs(combo, K, N, seed):
    spec, g = COMBOS[combo], torch.Generator().manual_seed(seed)
    kw = dict(act=spec.get("act"))
    if spec.get("bias"):
        kw["bias"] = (0.5 * torch.randn(N, generator=g)).bfloat16()
    if spec.get("norm"):
        kw["norm_weight"], kw["eps"] = (1 + 0.3 * torch.randn(K, generator=g)).bfloat16(), EPS
    if spec.get("residual"):
        kw["residual"] = torch.randn(1, N, generator=g).bfloat16()
    return kw


def _ulps(got, want):
    w = want.float().abs()
    scale = torch.finfo(want.dtype).eps * w.clamp_min(1e-3 * w.max().item())
    return ((got.float() - want.float()).abs() / scale).max().item()


# K = 104 (K/2 = 52: not a multiple of the interpreter's BLOCK_J = 32), N = 37 / 38: not a multiple of BLOCK_N = 4
@pytest.mark.parametrize("combo", list(COMBOS))
def test_kernel_matches_the_restored_matrix(combo):
    N = 38 if COMBOS[combo].get("act") else 37
    x = (3 * torch.randn(1, 104, generator=torch.Generator().manual_seed(5))).bfloat16()
    w = (torch.randn(N, 104, generator=torch.Generator().manual_seed(6)) / 10).bfloat16()
    w[3, :7] = 0  # zeros: table entry 0
    w[5, 11] = 40.0  # far above the table's magnitudes: an exception in a gate row (and an up row below)
    w[N - 1, 90] = -1e-30  # far below: an exception in the last row
    p = pack(w)
    assert p.num_exceptions >= 2
    kw = _kwargs(combo, 104, N, seed=7)
    got, want = gemv12(x, p, **kw), gemv_fused_reference(x, w, **kw)
    assert torch.equal(gemv12_reference(x, p, **kw), want)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert _ulps(got, want) <= 2
    assert (got == want).float().mean().item() >= 0.9


def test_exceptions_are_added_to_their_own_rows():
    """One nonzero weight per row, all of them exceptions except in row 0: any row mix-up changes the output."""
    K, N = 64, 24
    x = torch.arange(1, K + 1, dtype=torch.float32).bfloat16()[None]
    w = torch.zeros(N, K)
    for n in range(N):
        w[n, (5 * n) % K] = 2.0 ** (2 * n - 24)  # 24 magnitude bytes: the table holds 7, the rest are exceptions
    w = w.bfloat16()
    p = pack(w)
    assert p.num_exceptions >= N - 7
    got = gemv12(x, p)
    assert torch.equal(got, gemv_fused_reference(x, w))  # one product per row: no summation order, exact


def test_identity_weight_is_bit_exact_through_norm_and_silu():
    K = 72
    g = torch.Generator().manual_seed(11)
    x = (3 * torch.randn(1, K, generator=g)).bfloat16()
    eye = torch.eye(K)
    w = torch.cat([eye, 1.5 * eye.flip(0)]).bfloat16()
    kw = dict(norm_weight=(1 + 0.3 * torch.randn(K, generator=g)).bfloat16(), eps=EPS, act="silu_mul")
    assert torch.equal(gemv12(x, pack(w), **kw), gemv_fused_reference(x, w, **kw))


def test_kernel_rejects_bad_input():
    p = pack(_randn(8, 16, seed=3))
    with pytest.raises(ValueError, match="bf16"):
        gemv12(torch.randn(1, 16), p)
    with pytest.raises(ValueError, match="disagree on K"):
        gemv12(torch.randn(1, 24).bfloat16(), p)
    with pytest.raises(ValueError, match="odd N"):
        gemv12(torch.randn(1, 16).bfloat16(), pack(_randn(7, 16, seed=4)), act="silu_mul")
    with pytest.raises(ValueError, match="one row"):  # gemv_fused takes up to 16 rows; this kernel one
        gemv12(torch.randn(2, 16).bfloat16(), p)


def _decode_steps(model, ids, steps):
    """Prefill ids[:6], then `steps` one-token steps -> per-step bf16-model logits (fp32)."""
    cache = model.new_cache(1, 32)
    pos = torch.arange(ids.shape[1])[None]
    out = []
    with torch.no_grad():
        model(ids[:, :6], pos[:, :6], cache, kv_len=6)
        for t in range(6, 6 + steps):
            out.append(model.logits(model(ids[:, t:t + 1], pos[:, t:t + 1], cache, kv_len=None)))
    return out


@pytest.mark.parametrize("family,tie", [("qwen2", False), ("llama", True)])
def test_fused_decode_over_12bit_weights_matches_16bit(tiny_model_dir, family, tie):
    """A bf16 model's fused one-token steps with the 12-bit copies (every projection and the LM head, tied or not)
    give the 16-bit fused steps' logits up to the GEMVs' summation order."""
    import copy

    from specpilot.kernels import gemv12 as g12
    from specpilot.models import load_model

    ref = load_model(tiny_model_dir(family, tie=tie), dtype=torch.bfloat16).use_fused_decode()
    fast = copy.deepcopy(ref).use_lossless12()
    packed = [m for m in fast.modules() if hasattr(m, "packed12")]
    assert len(packed) == 4 * fast.config.num_hidden_layers + 1
    assert all(torch.equal(unpack(m.packed12).view(torch.int16), m.weight.view(torch.int16)) for m in packed)
    calls = []
    real = g12.gemv12
    g12.gemv12 = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        ids = torch.tensor([[3, 9, 27, 4, 11, 5, 8, 2, 6, 7]])
        want, got = _decode_steps(ref, ids, 3), _decode_steps(fast, ids, 3)
    finally:
        g12.gemv12 = real
    assert len(calls) == 3 * (4 * fast.config.num_hidden_layers + 1)  # every GEMV of every step read 12 bits
    for a, b in zip(want, got):
        assert (a - b).abs().max().item() <= 0.05 * a.abs().max().item()
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    fast.use_lossless12(False)
    assert not any(hasattr(m, "packed12") for m in fast.modules())


def test_lossless12_needs_fused_decode_and_bf16(tiny_model_dir):
    from specpilot.models import load_model

    with pytest.raises(ConfigError, match="fused_decode"):
        load_model(tiny_model_dir("qwen2"), dtype=torch.bfloat16).use_lossless12()
    with pytest.raises(ConfigError, match="bf16"):
        load_model(tiny_model_dir("qwen2")).use_fused_decode().use_lossless12()


def test_prenorm_launch_gives_the_prologue_numbers(tiny_model_dir, monkeypatch):
    """PRENORM_12BIT: the norms in a launch of their own before the 12-bit GEMVs (same rounding as the prologue,
    only the sum of squares' order may differ): the same logits up to that, the same tokens."""
    from specpilot.models import fused_decode, load_model

    model = load_model(tiny_model_dir("qwen2"), dtype=torch.bfloat16).use_fused_decode().use_lossless12()
    ids = torch.tensor([[3, 9, 27, 4, 11, 5, 8, 2]])
    prologue = _decode_steps(model, ids, 2)
    calls = []
    real = fused_decode.gemv12_call
    monkeypatch.setattr(fused_decode, "PRENORM_12BIT", True)
    monkeypatch.setattr(fused_decode, "gemv12_call", lambda x, p, b, nw, *a: calls.append(nw) or real(x, p, b, nw, *a))
    separate = _decode_steps(model, ids, 2)
    assert calls and all(nw is None for nw in calls)  # no 12-bit GEMV got a norm prologue
    for a, b in zip(prologue, separate):
        assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()
        assert torch.equal(a.argmax(-1), b.argmax(-1))
