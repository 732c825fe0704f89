"""Fused GEMV of 1 to 16 rows (kernels/gemv_fused.py) vs its PyTorch twin, and the twin vs the eager dense.py modules.

TRITON_INTERPRET=1 runs the kernel on CPU. bf16 and fp16 work in the interpreter here: loads and fp32 math are
exact, and the kernel rounds fp32 -> bf16 itself (`_to_dtype`, round to nearest even; the interpreter's own cast
truncates), so the 16-bit tests hold the kernel to the eager rounding points, not just to a tolerance. M >= 2 rows
run the tl.dot kernel (a verify block, models/fused_decode.py), one row the GEMV loop."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():  # as conftest does: the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed")

from specpilot.kernels.gemv_fused import gemv_fused, gemv_fused_op, gemv_fused_reference  # noqa: E402
from specpilot.models.config import ModelConfig  # noqa: E402
from specpilot.models.dense import MLP, RMSNorm  # noqa: E402

EPS = 1e-6
# name -> which optional inputs / act; every combination the decoder layer uses, plus plain and bias alone
COMBOS = {
    "plain": dict(),
    "bias": dict(bias=True),
    "norm": dict(norm=True),
    "norm+bias": dict(norm=True, bias=True),  # Qwen2 input norm + qkv
    "residual": dict(residual=True),  # o_proj / down_proj + residual
    "norm+silu_mul": dict(norm=True, act="silu_mul"),  # post-attention norm + gate_up + silu * up
    "norm+bias+silu_mul": dict(norm=True, bias=True, act="silu_mul"),
}


def _inputs(combo, K, N, dtype, seed, rows=1):
    """x [rows, K], weight [N, K], and the combo's kwargs; N is the weight's row count (2I for silu_mul). Rows of
    several: scaled 0.2x to 2x, so each needs its own RMSNorm statistics."""
    spec = COMBOS[combo]
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(rows, K, generator=g)
    if rows > 1:
        x = x * torch.linspace(0.2, 2.0, rows)[:, None]
    w = torch.randn(N, K, generator=g) / K ** 0.5
    kw = dict(act=spec.get("act"))
    if spec.get("bias"):
        kw["bias"] = 0.5 * torch.randn(N, generator=g)
    if spec.get("norm"):
        kw["norm_weight"], kw["eps"] = 1 + 0.3 * torch.randn(K, generator=g), EPS
    if spec.get("residual"):
        kw["residual"] = torch.randn(rows, N, generator=g)
    cast = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return x.to(dtype), w.to(dtype), cast


def _ulps(got, want):
    """Max |got - want| in units of the dtype's eps times |want| (floored at 1e-3 of the row's largest value, so
    outputs that cancel to ~0 are not judged by their own tiny ulp)."""
    w = want.float().abs()
    scale = torch.finfo(want.dtype).eps * w.clamp_min(1e-3 * w.max().item())
    return ((got.float() - want.float()).abs() / scale).max().item()


# K = 100, N = 37 / 38 (I = 19): neither a multiple of the interpreter's BLOCK_K = 64 nor BLOCK_N = 4
@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("K,N", [(100, 37), (64, 16)])
def test_fp32_matches_reference(combo, K, N):
    if COMBOS[combo].get("act") and N % 2:
        N += 1  # silu_mul: weight [2I, K], I = 19
    x, w, kw = _inputs(combo, K, N, torch.float32, seed=K + N)
    got, want = gemv_fused(x, w, **kw), gemv_fused_reference(x, w, **kw)
    out_n = N // 2 if kw["act"] else N
    assert got.shape == want.shape == (1, out_n) and got.dtype == torch.float32
    assert torch.isfinite(got).all() and want.abs().max() > 0.1
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_matches_reference(combo, dtype):
    """16-bit: the same rounding points as eager; only the fp32 summation orders differ (<= 2 ulp)."""
    N = 38 if COMBOS[combo].get("act") else 37
    x, w, kw = _inputs(combo, 200, N, dtype, seed=N + 7)
    got, want = gemv_fused(x, w, **kw), gemv_fused_reference(x, w, **kw)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert _ulps(got, want) <= 2
    assert (got == want).float().mean().item() >= 0.9  # in practice all equal


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 5])
def test_identity_weight_is_bit_exact(combo, dtype, M):
    """With weight rows that each pick one input (one nonzero product per dot) the dot product has no summation
    order, so every rounding point is visible: the kernel must equal the eager modules bit for bit (a missing or
    extra rounding of the normed input, of gate/up, of silu, of y before the bias or the residual shows here).
    M = 5: the same through the tl.dot kernel."""
    K = 70
    x, _, kw = _inputs(combo, K, 2 * K if COMBOS[combo].get("act") else K, dtype, seed=11, rows=M)
    eye = torch.eye(K)
    w = torch.cat([eye, 1.5 * eye.flip(0)]) if kw["act"] else eye  # up = a permuted, scaled copy of the input
    w = w.to(dtype)
    got, want = gemv_fused(x, w, **kw), gemv_fused_reference(x, w, **kw)
    if dtype == torch.float32 and "norm_weight" in kw:  # fp32 keeps the mean's summation order (no rounding hides it)
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    else:
        assert torch.equal(got, want)


# M rows (a verify block) through the tl.dot kernel: K = 100, N = 37 / 38 (I = 19) are not multiples of its
# interpreter tile (BLOCK_N 16, BLOCK_K 64); rows >= M of its 16-row x tile are masked
@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_reference(combo, M, dtype):
    N = 38 if COMBOS[combo].get("act") else 37
    x, w, kw = _inputs(combo, 100, N, dtype, seed=M + N, rows=M)
    got, want = gemv_fused(x, w, **kw), gemv_fused_reference(x, w, **kw)
    assert got.shape == want.shape == (M, N // 2 if kw["act"] else N) and got.dtype == dtype
    assert torch.isfinite(got).all() and want.abs().max() > 0.1
    if dtype == torch.float32:
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    else:  # the same rounding points as eager; only the fp32 summation orders differ
        assert _ulps(got, want) <= 2
        assert (got == want).float().mean().item() >= 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_their_strides(dtype):
    """x and the residual as views whose rows are further apart than their lengths (e.g. slices of a wider
    buffer): each row is read from its own stride."""
    x, w, kw = _inputs("norm+bias", 100, 37, dtype, seed=4, rows=6)
    wide_x = torch.zeros(6, 130, dtype=dtype)
    wide_x[:, 7:107] = x
    res = torch.randn(6, 37).to(dtype)
    wide_r = torch.zeros(6, 50, dtype=dtype)
    wide_r[:, 3:40] = res
    for xi, ri in ((wide_x[:, 7:107], None), (x, wide_r[:, 3:40])):
        args = dict(kw) if ri is None else dict(residual=ri)
        got, want = gemv_fused(xi, w, **args), gemv_fused_reference(xi.contiguous(), w, **args)
        if dtype == torch.float32:
            assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
        else:
            assert _ulps(got, want) <= 2


def test_one_row_keeps_the_gemv_kernel_and_rows_take_the_dot_kernel(monkeypatch):
    """M == 1 runs the tuned one-row kernel (as before the M-row kernel existed), M >= 2 the tl.dot kernel."""
    import specpilot.kernels.gemm_rows as gr
    import specpilot.kernels.gemv_fused as gf

    launched = []
    for module, name in ((gf, "_kernel"), (gr, "_gemm_kernel")):
        real = getattr(module, name)

        class Spy:
            def __getitem__(self, grid, real=real, name=name):
                launched.append(name)
                return real[grid]

        monkeypatch.setattr(module, name, Spy())
    for M in (1, 2, 16, 1):
        x, w, kw = _inputs("norm+silu_mul", 64, 40, torch.float32, seed=M, rows=M)
        assert gemv_fused(x, w, **kw).shape == (M, 20)
    assert launched == ["_kernel", "_gemm_kernel", "_gemm_kernel", "_kernel"]


def test_eps_reaches_the_kernel():
    """A small input (mean of squares ~1e-4) so eps moves the result: the kernel must track the reference's eps."""
    x, w, kw = _inputs("norm+bias", 100, 37, torch.float32, seed=2)
    x = x / 300
    outs = []
    for eps in (1e-6, 1e-3):
        kw["eps"] = eps
        got, want = gemv_fused(x, w, **kw), gemv_fused_reference(x, w, **kw)
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
        outs.append(got)
    assert (outs[0] - outs[1]).abs().max().item() > 0.1


def test_larger_row_bf16():
    """A real hidden size (Qwen2.5-0.5B, 896) through the norm + silu path: many K blocks."""
    x, w, kw = _inputs("norm+bias+silu_mul", 896, 2 * 24, torch.bfloat16, seed=5)
    got, want = gemv_fused(x, w, **kw), gemv_fused_reference(x, w, **kw)
    assert got.shape == (1, 24) and _ulps(got, want) <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_eager_modules(dtype):
    """gemv_fused_reference equals RMSNorm + nn.Linear, the fused MLP's silu * up, and the residual add exactly."""
    K, I = 64, 40
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    norm = RMSNorm(K, EPS)
    qkv = nn.Linear(K, 48, bias=True)
    o_proj = nn.Linear(48, K, bias=False)
    cfg = ModelConfig(model_type="qwen2", vocab_size=32, hidden_size=K, intermediate_size=I, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=EPS)
    mlp = MLP(cfg)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(K, generator=g))
    mlp.fuse()
    mlp.down_proj = nn.Identity()  # the MLP's forward up to silu(gate) * up
    for m in (norm, qkv, o_proj, mlp):
        m.to(dtype)
    x = (3 * torch.randn(1, K, generator=g)).to(dtype)
    attn = torch.randn(1, 48, generator=g).to(dtype)
    nw = norm.weight.detach()
    with torch.no_grad():
        assert torch.equal(gemv_fused_reference(x, qkv.weight, qkv.bias, norm_weight=nw, eps=EPS), qkv(norm(x)))
        assert torch.equal(gemv_fused_reference(x, qkv.weight, norm_weight=nw, eps=EPS), F.linear(norm(x), qkv.weight))
        assert torch.equal(gemv_fused_reference(attn, o_proj.weight, residual=x), x + o_proj(attn))
        got = gemv_fused_reference(x, mlp.gate_up_proj.weight, norm_weight=nw, eps=EPS, act="silu_mul")
        assert got.shape == (1, I) and torch.equal(got, mlp(norm(x)))


def test_decoder_mlp_half_through_two_launches():
    """`x + mlp(post_norm(x))` of a layer (bf16) as [norm + gate_up + silu*up] then [down + residual]."""
    K, I = 64, 96
    g = torch.Generator().manual_seed(9)
    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=K, intermediate_size=I, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=EPS)
    torch.manual_seed(9)
    mlp, norm = MLP(cfg), RMSNorm(K, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(K, generator=g))
    mlp.fuse()
    mlp.bfloat16(), norm.bfloat16()
    x = (3 * torch.randn(1, K, generator=g)).bfloat16()
    with torch.no_grad():
        want = x + mlp(norm(x))
        act = gemv_fused(x, mlp.gate_up_proj.weight, norm_weight=norm.weight, eps=EPS, act="silu_mul")
        got = gemv_fused(act, mlp.down_proj.weight, residual=x)
    assert got.shape == want.shape and _ulps(got, want) <= 2


def test_bad_input_raises_value_error():
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    for rows in (0, 17):  # 1 to 16 rows: the M-row kernel's x tile
        with pytest.raises(ValueError, match="1 <= M <= 16"):
            gemv_fused(torch.randn(rows, 16), w)
    with pytest.raises(ValueError, match="residual"):  # one residual row per x row
        gemv_fused(torch.randn(2, 16), w, residual=torch.randn(1, 8))
    with pytest.raises(ValueError, match="disagree on K"):
        gemv_fused(x, torch.randn(8, 15))
    with pytest.raises(ValueError, match="cannot be combined"):
        gemv_fused(x, w, residual=torch.randn(1, 8), act="silu_mul")
    with pytest.raises(ValueError, match="odd N"):
        gemv_fused(x, torch.randn(7, 16), act="silu_mul")
    with pytest.raises(ValueError, match="unknown act"):
        gemv_fused(x, w, act="gelu")
    with pytest.raises(ValueError, match="contiguous"):
        gemv_fused(x, torch.randn(16, 8).t())
    with pytest.raises(ValueError, match="unit stride along K"):
        gemv_fused(torch.randn(16, 2).t()[:1], w)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv_fused(x, w, norm_weight=torch.randn(15))
    with pytest.raises(ValueError, match="bias"):
        gemv_fused(x, w, torch.randn(7))
    with pytest.raises(ValueError, match="share one"):
        gemv_fused(x, w.bfloat16())
    with pytest.raises(ValueError, match="1 <= M <= 16"):  # the reference validates the same way
        gemv_fused_reference(torch.randn(17, 16), w)


def test_op_and_fake():
    x, w, kw = _inputs("norm+bias+silu_mul", 40, 24, torch.float32, seed=1)
    got = gemv_fused_op(x, w, kw["bias"], kw["norm_weight"], EPS, None, "silu_mul")
    assert (got - gemv_fused_reference(x, w, **kw)).abs().max().item() < 1e-5
    from torch._subclasses.fake_tensor import FakeTensorMode

    xr, rr = torch.randn(5, 40), torch.randn(5, 24)
    got = gemv_fused_op(xr, w, kw["bias"], None, EPS, rr, "")
    assert (got - gemv_fused_reference(xr, w, kw["bias"], residual=rr)).abs().max().item() < 1e-5
    with FakeTensorMode():
        fx, fw = torch.empty(1, 40), torch.empty(24, 40)
        assert gemv_fused_op(fx, fw, None, None, EPS, None, "silu_mul").shape == (1, 12)
        assert gemv_fused_op(fx, fw, None, None, EPS, torch.empty(1, 24), "").shape == (1, 24)
        rows = torch.empty(5, 40)  # a verify block's rows
        assert gemv_fused_op(rows, fw, None, None, EPS, None, "silu_mul").shape == (5, 12)
        assert gemv_fused_op(rows, fw, None, None, EPS, torch.empty(5, 24), "").shape == (5, 24)
        with pytest.raises(ValueError):
            gemv_fused_op(fx, torch.empty(23, 40), None, None, EPS, None, "silu_mul")


@pytest.mark.parametrize("combo", ["norm+silu_mul", "norm+bias+silu_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paired_silu_layout_gives_the_same_numbers(monkeypatch, combo, dtype):
    """The autotuner's PAIRED choice (gate and up rows in one interleaved tile) equals the two-tile layout."""
    import specpilot.kernels.gemv_fused as gf

    x, w, kw = _inputs(combo, 100, 2 * 19, dtype, seed=7)
    two_tiles = gemv_fused(x, w, **kw)
    monkeypatch.setattr(gf, "INTERPRET_PAIRED", True)
    paired = gemv_fused(x, w, **kw)
    assert torch.equal(paired, two_tiles)
    assert (paired.float() - gemv_fused_reference(x, w, **kw).float()).abs().max().item() < 5e-2


# --- split-K of the M-row kernel (SPLIT_K > 1: the last program of an N tile adds the partials in a fixed order) ---

# (combo, keep the norm): bias / residual / silu_mul without a norm (what the M-row calls get with
# fused_decode.PRENORM_ROWS), and a norm prologue (the kernel takes one; the autotuner only never picks split-K there)
SPLIT_CASES = [("bias", True), ("residual", True), ("norm+bias+silu_mul", False), ("norm+bias", True)]


@pytest.mark.parametrize("combo,keep_norm", SPLIT_CASES, ids=[c for c, _ in SPLIT_CASES])
@pytest.mark.parametrize("K", [100, 300])  # split 3 of K 100: chunks of 64, the third empty
@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_rows_match_reference_deterministically(monkeypatch, combo, keep_norm, K, split, M, dtype):
    """K in SPLIT_K chunks of whole BLOCK_K (64) steps, K a multiple of neither: the reference's numbers up to the
    summation order (the M-row tests' tolerance), the same bits on a second call, and every arrival counter back
    at zero afterwards (the next launch, a graph replay, counts from zero)."""
    import specpilot.kernels.gemm_rows as gr

    N = 38 if COMBOS[combo].get("act") else 37
    x, w, kw = _inputs(combo, K, N, dtype, seed=M + K + split, rows=M)
    if not keep_norm:
        kw.pop("norm_weight"), kw.pop("eps")
    monkeypatch.setattr(gr, "INTERPRET_SPLIT_K", split)
    got, again = gemv_fused(x, w, **kw), gemv_fused(x, w, **kw)
    want = gemv_fused_reference(x, w, **kw)
    assert got.shape == want.shape == (M, N // 2 if kw["act"] else N) and got.dtype == dtype
    assert torch.equal(got, again)
    assert (gr._SPLIT_COUNTERS[x.device] == 0).all()
    assert want.abs().max() > 0.1
    if dtype == torch.float32:
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    else:
        assert _ulps(got, want) <= 2
        assert (got == want).float().mean().item() >= 0.9


def test_split_k_identity_weight_is_bit_exact(monkeypatch):
    """One nonzero product per dot (an identity weight): no summation order, so split-K must give the eager
    modules' bits exactly (each chunk's partial is 0 or the one product; bias, rounding, residual as without)."""
    import specpilot.kernels.gemm_rows as gr

    monkeypatch.setattr(gr, "INTERPRET_SPLIT_K", 3)
    K = 150
    for combo in ("bias", "residual"):
        x, _, kw = _inputs(combo, K, K, torch.bfloat16, seed=3, rows=5)
        w = torch.eye(K).bfloat16()
        assert torch.equal(gemv_fused(x, w, **kw), gemv_fused_reference(x, w, **kw))


def test_split_k_is_tried_only_for_long_k_without_a_norm():
    """The autotuner's prune (GPU): split-K configs survive for down_proj-like shapes (K >= 2N, no norm prologue),
    never for qkv / o_proj / gate_up or with a norm; the scratch sized for every survivor, none otherwise."""
    import specpilot.kernels.gemm_rows as gr

    def splits(N, K, norm):
        kept = gr._gemm_prune(gr._GEMM_CONFIGS, dict(N=N, K=K), HAS_NORM=norm)
        assert any(c.kwargs["SPLIT_K"] == 1 for c in kept)  # the plain tilings always stay
        return sorted({c.kwargs["SPLIT_K"] for c in kept} - {1})

    assert splits(1536, 8960, False) == [2, 4, 8]  # Qwen2.5-1.5B down_proj
    assert splits(4096, 12288, False) == [2, 4, 8]  # Qwen3-8B down_proj
    for N, K in ((2048, 1536), (1536, 1536), (4096, 4096), (8960, 1536)):  # qkv, o_proj, 8B o_proj, gate_up
        assert splits(N, K, False) == []
    assert splits(1536, 8960, True) == []
    assert gr._split_k_sizes(2048, 1536, False, False, 0) is None
    floats, counters = gr._split_k_sizes(1536, 8960, False, False, 0)
    assert floats == 1536 * 8 * 16 and counters == 1536 // 16  # BLOCK_N 16 x SPLIT_K 8 x 16 rows; 96 N tiles
    assert gr._split_k_sizes(100, 64, False, True, 2) == (7 * 16 * 2 * 16 * 2, 7)  # interpreter: BLOCK_N 16
    assert gr._split_k_sizes(100, 64, False, False, 1) is None


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("K", [40, 100, 300])  # one K block (the prefetched one alone), a partial second, several
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefetched_first_weight_tile_gives_the_same_bits(monkeypatch, combo, paired, K, dtype):
    """PREFETCH (the one-row kernel under PDL on a GPU): the first K block's weights loaded before the wait, the
    loop from the second block: the same sums in the same order, so the same bits as without it."""
    import specpilot.kernels.gemv_fused as gf

    if paired and "silu_mul" not in combo:
        pytest.skip("PAIRED is a SiLU x up layout")
    x, w, kw = _inputs(combo, K, 2 * 19 if "silu_mul" in combo else 37, dtype, seed=11)
    monkeypatch.setattr(gf, "INTERPRET_PAIRED", paired)
    plain = gemv_fused(x, w, **kw)
    monkeypatch.setattr(gf, "INTERPRET_PREFETCH", True)
    pre = gemv_fused(x, w, **kw)
    assert torch.equal(pre, plain)
    assert (pre.float() - gemv_fused_reference(x, w, **kw).float()).abs().max().item() < 5e-2


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("paired, prefetch", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("K", [40, 64, 100, 300])  # one partial block, one whole, a partial second, several
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipelined_k_loop_gives_the_same_bits(monkeypatch, combo, paired, prefetch, K, dtype):
    """PIPE (EngineConfig.gemv_pipeline): the K loop one block ahead, after a prefetched first tile too, adds the
    same sums in the same order as the plain loop: the same bits, and the reference's numbers."""
    import specpilot.kernels.gemv_fused as gf

    if paired and "silu_mul" not in combo:
        pytest.skip("PAIRED is a SiLU x up layout")
    x, w, kw = _inputs(combo, K, 2 * 19 if "silu_mul" in combo else 37, dtype, seed=13)
    monkeypatch.setattr(gf, "INTERPRET_PAIRED", paired)
    monkeypatch.setattr(gf, "INTERPRET_PREFETCH", prefetch)
    plain = gemv_fused(x, w, **kw)
    monkeypatch.setattr(gf, "ONE_ROW_PIPE", True)
    piped = gemv_fused(x, w, **kw)
    assert torch.equal(piped, plain)
    assert (piped.float() - gemv_fused_reference(x, w, **kw).float()).abs().max().item() < 5e-2


def _spy_on_launches(monkeypatch, gf, flag, run: bool = True) -> list:
    """Replace the one-row kernel with a spy -> the list of each launch's `flag` kwarg (a tuple of them for a tuple
    of names); each launch then runs the real (interpreted) kernel, unless `run` is False (a faked GPU launch:
    nothing runs)."""
    seen, real = [], gf._kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(tuple(kw[f] for f in flag) if isinstance(flag, tuple) else kw[flag])
                return real[grid](*args, **kw) if run else None
            return launch

    monkeypatch.setattr(gf, "_kernel", Spy())
    return seen


@pytest.mark.parametrize("interpret", [True, False])
def test_pipelined_k_loop_sums_every_block_once(monkeypatch, interpret):
    """ONE_ROW_PIPE reaches both launches as PIPE (the GPU one faked: no kernel runs), and the pipelined loop
    neither drops nor repeats a block: with an all-ones weight the output is the sum of x exactly (integers in
    fp32), for K of one to five blocks (BLOCK_K 64 under the interpreter)."""
    import specpilot.kernels.gemv_fused as gf

    seen = _spy_on_launches(monkeypatch, gf, "PIPE", run=interpret)
    monkeypatch.setattr(gf, "_INTERPRET", interpret)
    monkeypatch.setattr(gf, "ONE_ROW_PIPE", True)
    for K in (1, 63, 64, 65, 128, 129, 320):
        x = torch.arange(1, K + 1, dtype=torch.float32)[None]
        y = gemv_fused(x, torch.ones(5, K))
        if interpret:
            assert torch.equal(y, torch.full((1, 5), K * (K + 1) / 2)), K
    assert seen == [True] * 7


def test_one_row_prefetch_switch_launches_the_prefetching_kernel_with_the_same_bits(monkeypatch):
    """ONE_ROW_PREFETCH (the first weight tile ahead of the norm prologue without PDL, timed on the H200 as
    gpu_step_timing.py fusedprefetch): the one-row launch gets PREFETCH=True and gives the bits of the plain one;
    off, it launches without (the M-row kernel never takes the flag)."""
    import specpilot.kernels.gemv_fused as gf

    seen = _spy_on_launches(monkeypatch, gf, "PREFETCH")
    x, w, kw = _inputs("norm+silu_mul", 100, 2 * 19, torch.bfloat16, seed=5)
    plain = gemv_fused(x, w, **kw)
    monkeypatch.setattr(gf, "ONE_ROW_PREFETCH", True)
    pre = gemv_fused(x, w, **kw)
    assert seen == [False, True]
    assert torch.equal(pre, plain)


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("paired, pipe", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("K", [40, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("switches", [("EARLY_EPILOGUE",), ("FIRST_TILE_AFTER_WAIT",),
                                      ("EARLY_EPILOGUE", "FIRST_TILE_AFTER_WAIT")])
def test_early_loads_give_the_same_bits(monkeypatch, combo, paired, pipe, K, dtype, switches):
    """EARLY_EPI (EngineConfig.early_epilogue: the bias and residual loaded right after the wait, before the K loop)
    and TILE_AFTER_WAIT (tile_after_wait: the first block's tile ahead of the norm prologue, summed first as the
    loop would) are the same values in the same sums: the same bits as the plain kernel's, with the plain and the
    pipelined loop, each and both; the launch passes each switch (a spy on the interpreted kernel)."""
    import specpilot.kernels.gemv_fused as gf

    if paired and "silu_mul" not in combo:
        pytest.skip("PAIRED is a SiLU x up layout")
    x, w, kw = _inputs(combo, K, 2 * 19 if "silu_mul" in combo else 37, dtype, seed=17)
    monkeypatch.setattr(gf, "INTERPRET_PAIRED", paired)
    monkeypatch.setattr(gf, "ONE_ROW_PIPE", pipe)
    seen = _spy_on_launches(monkeypatch, gf, ("EARLY_EPI", "TILE_AFTER_WAIT"))
    plain = gemv_fused(x, w, **kw)
    for name in switches:
        monkeypatch.setattr(gf, name, True)
    early = gemv_fused(x, w, **kw)
    assert seen == [(False, False), ("EARLY_EPILOGUE" in switches, "FIRST_TILE_AFTER_WAIT" in switches)]
    assert torch.equal(early, plain)
    assert (early.float() - gemv_fused_reference(x, w, **kw).float()).abs().max().item() < 5e-2


_ONE_ROW_FLAGS = ("ONE_ROW_PREFETCH", "ONE_ROW_PIPE", "EARLY_EPILOGUE", "FIRST_TILE_AFTER_WAIT")
_QKV_FLAGS = {"early_epilogue": "EARLY_EPILOGUE", "tile_after_wait": "FIRST_TILE_AFTER_WAIT"}  # kernels/qkv_rope.py


@pytest.mark.parametrize("field, flag", [("gemv_prefetch", "ONE_ROW_PREFETCH"), ("gemv_pipeline", "ONE_ROW_PIPE"),
                                         ("early_epilogue", "EARLY_EPILOGUE"),
                                         ("tile_after_wait", "FIRST_TILE_AFTER_WAIT")])
def test_one_row_switch_fields_engine_switch_cli_and_loop(monkeypatch, field, flag):
    """EngineConfig.gemv_prefetch / gemv_pipeline / early_epilogue / tile_after_wait set ONE_ROW_PREFETCH /
    ONE_ROW_PIPE / EARLY_EPILOGUE / FIRST_TILE_AFTER_WAIT (and only theirs; the last two also kernels/qkv_rope.py's
    twins) when a model is laid out for a CUDA config with the fused one-token path (the newest config decides; quietly ignored on CPU, a
    warning without fused_decode); a file's "false" is refused; the CLI flag and the loop's mechanism exist, the
    mechanism only over fused decode."""
    import argparse
    import warnings

    import specpilot.kernels.gemv_fused as gf
    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_gemv_prefetch
    from specpilot.errors import ConfigError
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY, Deployment, applicable

    import specpilot.kernels.qkv_rope as qr

    for name in _ONE_ROW_FLAGS:
        monkeypatch.setattr(gf, name, False)
    for name in _QKV_FLAGS.values():
        monkeypatch.setattr(qr, name, False)
    qkv = lambda: tuple(getattr(qr, name) for name in _QKV_FLAGS.values())  # noqa: E731
    switched = lambda: tuple(getattr(gf, name) for name in _ONE_ROW_FLAGS)  # noqa: E731
    assert getattr(EngineConfig(), field) is False  # off: not faster on the H200
    with pytest.raises(ConfigError, match=f"{field} must be true or false"):
        EngineConfig(**{field: "false"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _apply_gemv_prefetch(EngineConfig(**{field: True}))  # CPU: nothing to switch
    assert getattr(gf, flag) is False
    _apply_gemv_prefetch(EngineConfig(device="cuda", **{field: True}))
    assert switched() == tuple(name == flag for name in _ONE_ROW_FLAGS)
    assert qkv() == tuple(f == field for f in _QKV_FLAGS)
    _apply_gemv_prefetch(EngineConfig(device="cuda"))
    assert getattr(gf, flag) is False and qkv() == (False, False)
    with pytest.warns(RuntimeWarning, match=f"{field} needs fused_decode"):
        _apply_gemv_prefetch(EngineConfig(device="cuda", fused_decode=False, **{field: True}))
    assert getattr(gf, flag) is False
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert getattr(engine_config(parser.parse_args(["--" + field.replace("_", "-")])), field)
    assert field in EngineMeasure.LAYOUT
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert REGISTRY[field].candidates(gpu.config, gpu) == [{field: True}]
    assert field not in [m.name for m in applicable(gpu, gpu.config.with_(fused_decode=False))]


@pytest.mark.parametrize("pdl_on, pdl_prefetch, one_row, expected, late", [
    (False, True, False, False, False), (True, True, False, True, False), (True, False, False, False, False),
    (False, True, True, True, False), (True, False, True, True, False), (True, True, False, False, True),
    (True, True, True, True, True)])
def test_gpu_launch_prefetches_by_the_pdl_and_one_row_switches(monkeypatch, pdl_on, pdl_prefetch, one_row, expected,
                                                               late):
    """The GPU launch (which the interpreter never takes: faked here, no kernel runs) passes PREFETCH when PDL is on
    with the start trigger and PDL_PREFETCH allows it (gpu_step_timing.py times PDL without it:
    fuseddecode_pdlnopf; the late trigger never prefetches the first tile), or when ONE_ROW_PREFETCH
    (EngineConfig.gemv_prefetch) asks for it."""
    import specpilot.kernels.gemv_fused as gf
    from specpilot.kernels.pdl import LaunchOptions

    seen = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["PREFETCH"], kw["USE_PDL"]))

    monkeypatch.setattr(gf, "_INTERPRET", False)
    monkeypatch.setattr(gf, "_kernel", Launcher())
    monkeypatch.setattr(gf, "launch_options",
                        lambda: LaunchOptions({"launch_pdl": True} if pdl_on else {}, pdl_on, late))
    monkeypatch.setattr(gf, "PDL_PREFETCH", pdl_prefetch)
    monkeypatch.setattr(gf, "ONE_ROW_PREFETCH", one_row)
    x, w, kw = _inputs("norm", 64, 24, torch.float32, seed=3)
    gemv_fused(x, w, **kw)
    assert seen == [(expected, pdl_on)]


@pytest.mark.parametrize("pdl_on, budget, expected", [(True, 1 << 10, True), (False, 1 << 10, False),
                                                      (True, 0, False)])
def test_gpu_launch_warms_the_next_weights_heads_under_pdl_only(monkeypatch, pdl_on, budget, expected):
    """warm_next (EngineConfig.pdl_l2_next_mb, o_proj -> gate/up): the GPU launch (faked: no kernel runs) passes
    NX_PF and the heads of the two halves (pointer, the up half's byte offset, the bytes of each) as its last
    arguments only under PDL with a budget; otherwise NX_PF is off and the arguments are dummies."""
    import specpilot.kernels.gemv_fused as gf
    from specpilot.kernels.pdl import LaunchOptions

    seen = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((args[-3:], kw["NX_PF"]))

    monkeypatch.setattr(gf, "_INTERPRET", False)
    monkeypatch.setattr(gf, "_kernel", Launcher())
    monkeypatch.setattr(gf, "launch_options",
                        lambda: LaunchOptions({"launch_pdl": True} if pdl_on else {}, pdl_on, True))
    monkeypatch.setattr(gf, "PDL_L2_NEXT_BYTES", budget)
    monkeypatch.setattr(gf, "PDL_L2_MAX_BYTES", 1 << 20)  # this launch's own weight warmed (next_warming's rule)
    x, w, kw = _inputs("residual", 64, 24, torch.float32, seed=3)
    gate_up = torch.zeros(2 * 48, 64)  # halves of 48 x 64 x 4 = 12288 bytes
    gemv_fused(x, w, **kw, warm_next=gate_up, warm_next_halves=True)
    (args, nx_pf), = seen
    assert nx_pf == expected
    if expected:
        assert args[0] is gate_up and args[1:] == (12288, 512)  # half of the 1 KiB budget from each half's head
    else:
        assert args[1:] == (0, 0) and args[0] is not gate_up


def test_warm_next_through_the_op_gives_the_same_bits():
    """The custom op's warm_next argument (o_proj handing gate/up's weight over) is only a hint: the same output,
    here where it cannot act (the interpreter, no PDL) -- and the op takes it positionally, as fused_decode passes it."""
    x, w, kw = _inputs("residual", 40, 24, torch.float32, seed=2)
    gate_up = torch.randn(2 * 16, 40)
    plain = gemv_fused_op(x, w, None, None, EPS, kw["residual"], "")
    warmed = gemv_fused_op(x, w, None, None, EPS, kw["residual"], "", gate_up)
    assert torch.equal(plain, warmed)
    assert (plain - gemv_fused_reference(x, w, residual=kw["residual"])).abs().max().item() < 1e-5


def test_early_epilogue_loads_are_compiled_before_the_k_loop(sm90_report):
    """tests/epilogue_ptx.py (sm_90, no GPU): with EARLY_EPI the residual's loads (o_proj / down), and qkv + RoPE's
    bias, cache slot and cos / sin, sit between the PDL wait and the K loop's first block; a GEMV without an
    epilogue operand (gate/up) compiles the same loads there either way."""
    report = sm90_report("epilogue_ptx.py")
    assert report["gemv_residual_l2_next_late"]["off"] == 0 < report["gemv_residual_l2_next_late"]["on"]
    assert report["gemv_norm_silu_mul_late"]["on"] == report["gemv_norm_silu_mul_late"]["off"]
    for case in ("qkv_rope_late", "qkv_rope_qk_norm_late"):  # (the norm prologue's row loads are there either way)
        assert report[case]["on"] > report[case]["off"], (case, report[case])
    for case in report:  # TILE_AFTER_WAIT: the first block's weight loads there too, in every kernel
        assert report[case]["tile"] > report[case]["off"], (case, report[case])
