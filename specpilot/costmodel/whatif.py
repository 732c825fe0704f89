"""What a config change should buy before it is measured: the cost model's predicted tokens/s ratio.

The loop has a handful of trials per run and used to spend them in registry order (session 8 and 9 runs on the H200
spent their wall limit on draft lengths before reaching `compile`). `predicted_gain` lets it try first what the
cost model expects to pay most. It is an ordering heuristic, never a verdict: every candidate is still measured
and gated.

How: start from the *measured* step (so what the model cannot see — host stages, an n-gram lookup — stays as
measured) and add the predicted change of the device passes the knobs touch:

    step_new = step_measured + sum(pass_predicted_s(new passes)) - sum(pass_predicted_s(current passes))
    gain     = (tau_new / step_new) / (tau / step_measured)

`tau_new` differs from tau only when the number of drafted tokens changes: with a per-position acceptance
profile it is read from it (`acceptance_by_position`: P(draft i accepted | the drafts before it were); past its
end the last measured rate continues), else it comes from a constant per-token acceptance alpha solved from
tau = (1 - alpha^(K+1)) / (1 - alpha).
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.costmodel.gaps import StepProfile, pass_predicted_s
from specpilot.costmodel.hardware import HardwareCeilings
from specpilot.costmodel.shapes import (PassCost, dflash_pass_cost, draft_kernel_flags, forward_cost, kernel_flags,
                                        l2_fields)
from specpilot.models.config import ModelConfig


@dataclass(frozen=True)
class StepKnobs:
    """The engine settings the cost model can price (a plain mirror of EngineConfig fields: no engine import)."""

    num_draft_tokens: int
    graphed: bool = True  # cuda_graphs
    compiled: bool = False  # compile (target runner and a small AR drafter's; not the DFlash draft step)
    fused: bool = False  # fused_projections
    attention_kernel: bool = False  # attention_kernel (the split-KV Triton kernel for <= 16-token passes)
    pool_len: int | None = None  # graphed SDPA attends over this whole KV pool (None: the profile's)
    draft_attention_kernel: bool = False  # a DFlash draft block through the split-KV kernel
    draft_pool_len: int | None = None  # a graphed DFlash draft block with SDPA attends over this whole draft pool
    norm_kernel: bool = False  # norm_kernel (each RMSNorm one Triton launch instead of 8 kernels)
    rope_kernel: bool = False  # rope_kernel (a layer's RoPE of q and k one Triton launch instead of 10 kernels)
    act_kernel: bool = False  # act_kernel (SiLU and the multiply in one launch)
    add_norm_kernel: bool = False  # add_norm_kernel (each residual add takes the following RMSNorm into its launch)
    fused_decode: bool = False  # fused_decode (a one-token pass in six launches a layer)
    fused_verify: bool = False  # fused_verify (with fused_decode: a 2-16-token pass in nine launches a layer)
    lossless12: bool = False  # lossless12 (that pass's GEMVs read 12-bit weight copies: 3/4 of the bytes)
    pdl: bool = False  # pdl (with fused_decode: that pass's kernels launched with programmatic dependent launch)
    pdl_late: bool = False  # EngineConfig.pdl_late: PDL with the GEMVs' trigger after their K loop
    norm_epilogue: bool = False  # norm_epilogue (a fused pass's norms written by its residual GEMVs: fewer launches)
    rope_in_attention: bool = False  # rope_in_attention (a one-token layer's RoPE + K/V write in its attention)
    rope_in_qkv: bool = False  # rope_in_qkv (a one-token layer's RoPE + K/V write in its qkv GEMV)
    fused_mlp: bool = False  # fused_mlp (a one-token layer's MLP in one launch)
    norm_handoff: bool = False  # norm_handoff (a fused block's norms from handed-over sums of squares: fewer launches)
    verify_rope_in_qkv: bool = False  # verify_rope_in_qkv (a fused block's RoPE + K/V write in its qkv GEMM)
    pdl_l2_mb: int = 0  # pdl_l2_mb (with pdl: one-token GEMVs of at most this many MiB warm their weight in L2)
    pdl_l2_share: float = 1.0  # pdl_l2_share (the share of each such weight warmed)
    pdl_l2_next_mb: int = 0  # pdl_l2_next_mb (with pdl: MiB of gate/up's head o_proj's launch warms)
    early_draft: bool = False  # early_draft (DFlash: the pass launched before the sync, the host's work beside it)


def _tau_geometric(tau: float, k: int, k_new: int) -> float:
    """tau at k_new drafted tokens for the constant acceptance alpha that gives `tau` at k."""
    if k <= 0 or k_new <= 0:
        return 1.0 if k_new <= 0 else tau
    target = min(max(tau, 1.0), k + 1.0)

    def tau_of(alpha: float, n: int) -> float:
        return sum(alpha ** i for i in range(n + 1))

    lo, hi = 0.0, 1.0
    for _ in range(60):  # tau_of is increasing in alpha on [0, 1]
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_of(mid, k) < target else (lo, mid)
    return tau_of((lo + hi) / 2, k_new)


def tau_at(tau: float, k: int, k_new: int, acceptance_by_position=None) -> float:
    """Expected tokens per step with k_new drafted tokens, from a measurement at k (see module docstring)."""
    acc = list(acceptance_by_position or [])
    if not acc:
        return _tau_geometric(tau, k, k_new)
    rates = acc[:k_new] + [acc[-1]] * (k_new - len(acc))  # past the measured positions: the last measured rate
    out, reach = 1.0, 1.0
    for p in rates:  # P(first i drafts accepted) = product of the conditional rates up to i
        reach *= p
        out += reach
    return out


def catch_up_tokens(tau: float, k: int) -> int:
    """Tokens a small AR drafter's first pass of a step feeds (drafters/small_ar.py): the target's bonus or
    correction token, plus the last draft when all k were accepted (that draft's K/V was never written). Not ~tau:
    accepted drafts are already in its cache. 2 when most steps accept every draft (tau - k >= 1/2, the share of
    full accepts being at least tau - k), else 1. The difference matters under fused_decode, which runs only
    one-token passes in six launches a layer (without fused_verify)."""
    return 2 if k > 0 and tau - k >= 0.5 else 1


def _passes(target_cfg: ModelConfig, drafter_cfg, kind: str, knobs: StepKnobs, profile: StepProfile,
            tau: float) -> list[PassCost]:
    k, ctx = knobs.num_draft_tokens, profile.context_len
    pool = knobs.pool_len if knobs.pool_len is not None else None if knobs.attention_kernel else profile.kv_pool_len
    out = [forward_cost(target_cfg, k + 1, ctx, pool_len=pool, fused=knobs.fused, compiled=knobs.compiled,
                        **kernel_flags(knobs), **l2_fields(knobs))]
    if kind == "model" and drafter_cfg is not None and k > 0:  # the catch-up pass, then 1 token per pass
        first = catch_up_tokens(tau, k)
        out += [forward_cost(drafter_cfg, t, ctx, pool_len=pool, fused=knobs.fused, compiled=knobs.compiled,
                             **kernel_flags(knobs), **l2_fields(knobs))
                for t in (first,) + (1,) * (k - 1)]
    elif kind == "dflash" and drafter_cfg is not None:  # one block pass whatever k is
        draft_pool = None if knobs.draft_attention_kernel else knobs.draft_pool_len
        out.append(dflash_pass_cost(drafter_cfg, target_cfg, ctx, max(1, round(tau)), pool_len=draft_pool,
                                    fused=knobs.fused, attention_kernel=knobs.draft_attention_kernel,
                                    **draft_kernel_flags(knobs)))
    return out


def predicted_gain(target_cfg: ModelConfig, drafter_cfg, profile: StepProfile, hw: HardwareCeilings, *,
                   kind: str, now: StepKnobs, new: StepKnobs, new_kind: str | None = None,
                   new_tau: float | None = None, new_draft_host_s: float = 0.0) -> float | None:
    """Predicted tokens/s of `new` over `now` for a step measured as `profile` under `now` (None: not priceable,
    e.g. a model drafter whose shapes are unknown).

    A change of drafter (`new_kind`, e.g. to n-gram lookup) needs its tau from outside (`new_tau`: the n-gram
    drafter's is replayed exactly on the outputs, drafters/ngram.py) and its host-side draft time
    (`new_draft_host_s`); the measured draft stage is then replaced, not adjusted."""
    new_kind = new_kind or kind
    if (kind in ("model", "dflash") or new_kind in ("model", "dflash")) and drafter_cfg is None:
        return None
    if new_kind != kind and new_tau is None:
        return None
    if new_tau is None:
        new_tau = tau_at(profile.tau, now.num_draft_tokens, new.num_draft_tokens, profile.acceptance_by_position)

    def device_s(k: str, knobs: StepKnobs, tau: float) -> tuple[float, float]:  # (verify, draft) predictions
        verify, *drafts = _passes(target_cfg, drafter_cfg, k, knobs, profile, tau)
        kern = knobs.attention_kernel
        draft_kern = knobs.draft_attention_kernel if k == "dflash" else kern
        return (pass_predicted_s(verify, hw, knobs.graphed, kern),
                sum(pass_predicted_s(c, hw, knobs.graphed, draft_kern) for c in drafts))

    (v_now, d_now), (v_new, d_new) = device_s(kind, now, profile.tau), device_s(new_kind, new, new_tau)
    verify = profile.verify_s + v_new - v_now
    draft = profile.draft_s + d_new - d_now if new_kind == kind else new_draft_host_s + d_new
    if new.early_draft != now.early_draft and kind == new_kind == "dflash":
        if now.early_draft:  # the host part of a draft stage that was not measured: not priceable
            return None
        # the measured stage = host wait + the pass; launched early, the host's part runs beside the pass (in the
        # commit stage, where the pass is then measured): what is left is the pass alone
        draft = min(draft, d_new)
    step_new = verify + draft + profile.accept_s + profile.other_s
    if step_new <= 0:
        return None
    return (new_tau / step_new) / (profile.tau / profile.step_s)
