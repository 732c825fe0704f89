"""The norm handoff: an M-row GEMV launch hands the GEMV after it its output rows' sums of squares, so that GEMV
normalizes its input rows itself without an RMSNorm launch and without a serial pass over the rows.

Why: a fused verify block (models/fused_decode.py, T = 2..16 tokens) runs each layer's two RMSNorms as launches of
their own (PRENORM_ROWS), because the M-row GEMV's own norm prologue summed each row's squares row after row, 16
dependent L2 round trips in every program (H200: qkv 12.5 us with it, cuBLAS 4.55). Those 2L + 1 norm
launches cost ~1.6 us of kernel and ~1.6 us of graphed gap each (H100, session 50: 92 us of kernels and most of a
406 us gap total in a 2.18 ms 1.5B verify step). A norm needs the whole row; no program of the producing GEMV has
it, but each has its BLOCK_N columns of every row, and a sum of squares adds up across programs. So:

- producer (SS_OUT, the residual GEMVs o_proj and down_proj): after storing its output tile, a program sums the
  squares of the stored (rounded) values over each group of GROUP columns, per row, and stores those fp32 partials
  at ss[group, row] ([ceil(N / GROUP), MAX_ROWS]; rows past M are zeros). No atomics, no counter, no last program:
  every partial has exactly one writer.
- consumer (SS_IN, qkv and gate_up, a norm "prologue" with norm_weight): each program loads the [MAX_ROWS, groups]
  partials in one masked load (6 KB at a 1.5B width) and sums them: rstd = rsqrt(sum / K + eps), RMSNorm.forward's
  formula; the K loop then normalizes each x tile as the prologue does (`_norm_h`: same rounding points).

Numbers: the same as the RMSNorm launch's except the order in which the mean's squares are summed (groups of GROUP,
then a tree over the groups, instead of one tree over the row): rstd may differ in its last fp32 bit, which can
move a normed bf16 value by one ulp, as any change of summation order. Deterministic: every sum has a fixed order
whatever the producer's tile (GROUP divides every BLOCK_N the M-row kernel tries), so a replay gives the same bits.
Token forcing judges the tokens (EngineConfig.norm_handoff).

Layer 0's input norm (from the embedding) and the final norm (the LM head is cuBLAS) keep their launches: 2L + 1
norm launches become 2.
"""

from __future__ import annotations

import torch

GROUP = 16  # columns per partial: divides every M-row BLOCK_N (kernels/gemm_rows.py _GEMM_CONFIGS, the
# interpreter's 16), so a program's tile holds whole groups and the partials do not depend on the tile chosen

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing to launch
    triton = None


def groups(n: int) -> int:
    """Partials per row for n columns."""
    return -(-n // GROUP)


def check_norm_ss(norm_ss: torch.Tensor | None, norm_weight, M: int, K: int, rows: int, what: str) -> None:
    """The handed-over partials must be fp32 [ceil(K / GROUP), rows], contiguous, for a launch of M >= 2 rows with
    a norm (ValueError)."""
    if norm_ss is None:
        return
    if norm_weight is None:
        raise ValueError(f"{what}: norm_ss are the sums of squares of a norm: give its norm_weight too")
    if M < 2:
        raise ValueError(f"{what}: norm_ss is the M-row kernel's (2 to {rows} rows), got {M} row(s)")
    want = (groups(K), rows)
    if tuple(norm_ss.shape) != want or norm_ss.dtype != torch.float32 or not norm_ss.is_contiguous():
        raise ValueError(f"{what}: norm_ss must be contiguous fp32 {list(want)} (a producing launch's ss for "
                         f"K = {K}), got {norm_ss.dtype} {tuple(norm_ss.shape)}")


def handoff_args(y: torch.Tensor, ss_out: bool, norm_ss: torch.Tensor | None, K: int, rows: int):
    """For an M-row launch writing y [M, N] over K input columns: -> (the ss it writes or None, the kernel's
    (ss_out, ss_in) pointers, its SS_OUT / SS_IN / SS_P2 constexprs). Unused pointers are dummies (y)."""
    ss = torch.empty(groups(y.shape[1]), rows, device=y.device, dtype=torch.float32) if ss_out else None
    p2 = triton.next_power_of_2(groups(K)) if norm_ss is not None else 1
    return ss, (y if ss is None else ss, y if norm_ss is None else norm_ss), dict(
        SS_OUT=ss_out, SS_IN=norm_ss is not None, SS_P2=p2)


def ss_reference(y: torch.Tensor, rows: int) -> torch.Tensor:
    """What a producing launch writes for y [M, N]: fp32 [ceil(N / GROUP), rows] group sums of squares (up to the
    order within a group)."""
    M, N = y.shape
    v = torch.zeros(rows, groups(N) * GROUP, dtype=torch.float32, device=y.device)
    v[:M, :N] = y.float()
    return (v * v).view(rows, -1, GROUP).sum(-1).T.contiguous()


if triton is not None:
    _GROUP_C = tl.constexpr(GROUP)

    @triton.jit
    def ss_store(out, mask, ss_ptr, pid_n, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A program's stored output tile `out` [BLOCK_M, BLOCK_N] (the rounded values, any float type; `mask`: the
        stored ones) -> its partials ss[g, m] for its BLOCK_N // GROUP groups g, every row m."""
        GROUPS: tl.constexpr = BLOCK_N // _GROUP_C
        v = tl.where(mask, out.to(tl.float32), 0.0)
        part = tl.sum(tl.reshape(v * v, (BLOCK_M, GROUPS, _GROUP_C)), axis=2)  # [BM, GROUPS]
        g = pid_n * GROUPS + tl.arange(0, GROUPS)
        m = tl.arange(0, BLOCK_M)
        tl.store(ss_ptr + g[None, :] * BLOCK_M + m[:, None], part, mask=(g < tl.cdiv(N, _GROUP_C))[None, :])

    @triton.jit
    def rstd_from_ss(si_ptr, K, eps, BLOCK_M: tl.constexpr, SS_P2: tl.constexpr):
        """[BLOCK_M] 1 / RMS of each row from the handed-over partials of its K columns (ceil(K / GROUP) groups)."""
        g = tl.arange(0, SS_P2)
        m = tl.arange(0, BLOCK_M)
        part = tl.load(si_ptr + g[None, :] * BLOCK_M + m[:, None], mask=(g < tl.cdiv(K, _GROUP_C))[None, :], other=0.0)
        return tl.rsqrt(tl.sum(part, axis=1) / K + eps)  # as torch.rsqrt(mean + eps)
