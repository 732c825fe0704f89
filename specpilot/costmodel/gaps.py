"""Where a speculative step's time goes: measured stage times against their roofline floors and predictions.

Two bounds per pass, both in seconds:
  * floor     `pass_floor_s`: the physical bound, max(bytes / HBM bandwidth, FLOPs / bf16 matmul rate). Nothing
              on this GPU can run the pass faster; measured / floor is the efficiency left on the table.
  * predicted `pass_predicted_s`: a calibrated prediction of what a CUDA-graphed (or eager) pass of our
              implementation should take: weights at the measured decode-GEMV bandwidth, K/V and activations
              at HBM bandwidth (or the FLOP bound if larger), plus a per-kernel overhead for every kernel that is
              not a GEMM. It is an estimate, not a bound: it may err either way.

`analyze(target_cfg, drafter_cfg, profile, hw)` turns a measured StepProfile (stage times per speculative step,
passed in: this module never runs the engine) into a CostReport: per-stage measured / floor / predicted, the
ceiling speedup at the measured acceptance, and the stages ranked by gap (measured - floor), largest first.

Invariants: all times in seconds per speculative step; floors are never above predictions for the same pass when
gemv_bytes_per_s <= hbm_bytes_per_s; a stage with no device work (accept, other, an n-gram draft) has floor 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from specpilot.costmodel.hardware import HardwareCeilings
from specpilot.costmodel.shapes import (PassCost, dflash_pass_cost, draft_kernel_flags, forward_cost, kernel_flags,
                                        l2_fields, param_count)
from specpilot.errors import ConfigError
from specpilot.models.config import ModelConfig

DrafterKind = Literal["model", "ngram", "dflash", "none"]
STAGES = ("draft", "verify", "accept", "other")


# --- one pass -----------------------------------------------------------------------------------------------


def pass_floor_s(cost: PassCost, hw: HardwareCeilings) -> float:
    """Physical lower bound of one pass: the slower of streaming its bytes and computing its FLOPs."""
    return max(cost.total_bytes / hw.hbm_bytes_per_s, cost.flops / hw.bf16_flops_per_s)


# A kernel launched with PDL (PassCost.num_pdl_kernels) pays this share of a graphed launch's gap, taken as
# `graph_kernel_s` (a tiny graphed kernel is mostly gap): it launches while the kernel before it drains and waits
# in-kernel. Measured once (H200, session 13, scripts/gpu_step_timing.py fuseddecode vs fuseddecode_pdl at the 1.5B
# shape: 1.547 -> 1.530 ms, implied 0.914; within run-to-run noise). Session 26 (the GEMVs triggering first thing):
# implied 1.035 (1.5B) and 1.317 (Qwen3-8B), i.e. nothing given back; with the GEMVs' trigger after their K loop
# (pdl_trigger "late", PassCost.pdl_late) 0.57 and 0.30 on one machine, 0.87 at 1.5B on another: PDL_LATE_GAP_FACTOR.
PDL_GAP_FACTOR = 1.0
PDL_LATE_GAP_FACTOR = 0.6


def pass_predicted_s(cost: PassCost, hw: HardwareCeilings, graphed: bool = True,
                     attention_kernel: bool = False) -> float:
    """Calibrated prediction of one pass of our implementation (not a bound).

    Graphed: weights stream at the graphed GEMV chains' rate (1.5B- and 8B-like chains, interpolated by bytes per
    layer; grown by the M = 16 chain's ratio at the pass's T), and the other kernels pay `graph_kernel_s` each, the
    eager RMSNorm / RoPE chains' kernels `eager_kernel_s(T)` (fp32 casts and reductions, dearer, growing with T);
    kernels launched with PDL (GEMVs included: the GEMV chains' rates were measured with full gaps) each give back
    (1 - PDL_GAP_FACTOR) * `graph_kernel_s`. Eager: every kernel pays
    the host launch `launch_s` (additive: the host's overlap with long GEMVs is ignored, so eager predictions lean
    high). Attention at <= 16 tokens is latency-bound: the measured per-layer time of the split-KV kernel when
    `attention_kernel` (and it was measured), else masked SDPA's over the keys it covers.
    """
    memory_s = (hw.weights_s(cost.weight_bytes - cost.l2_warm_bytes, cost.num_layers, cost.num_tokens, cost.head_bytes)
                / cost.weight_rate + (cost.kv_bytes + cost.activation_bytes) / hw.hbm_bytes_per_s)
    compute_s = cost.flops / hw.bf16_flops_per_s
    if graphed:
        eager = min(cost.num_eager_kernels, cost.num_kernels - cost.num_linear_kernels)
        overhead_s = ((cost.num_kernels - cost.num_linear_kernels - eager) * hw.graph_kernel_s
                      + eager * hw.eager_kernel_s(cost.num_tokens)
                      - cost.num_pdl_kernels * (1.0 - (PDL_LATE_GAP_FACTOR if cost.pdl_late else PDL_GAP_FACTOR))
                      * hw.graph_kernel_s)
    else:
        overhead_s = cost.num_kernels * hw.launch_s
    # masked attention at decode is latency-bound: its measured per-call time, not bytes / bandwidth
    kernel_s = hw.attention_kernel_s(cost.num_tokens) if attention_kernel else None
    if cost.num_tokens > 16:
        attention_s = 0.0
    elif kernel_s is not None:
        attention_s = cost.num_layers * kernel_s
    else:
        attention_s = cost.num_layers * hw.sdpa_s(cost.attn_keys, cost.num_tokens)
    return max(memory_s, compute_s) + overhead_s + attention_s


# --- what the engine measured -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepProfile:
    """Mean stage times of one speculative step, as measured by the engine (seconds per step)."""

    draft_s: float  # drafter work (all its passes, or the n-gram lookup)
    verify_s: float  # the target pass over K + 1 tokens
    accept_s: float  # acceptance / sampling / bookkeeping on device
    other_s: float  # host work and everything not in the three stages above
    tau: float  # mean tokens emitted per step (accepted drafts + the bonus token)
    num_draft_tokens: int  # K, drafted tokens per step
    drafter_passes: int  # drafter forward passes per step (0 for n-gram / none)
    context_len: int  # mean tokens in the KV cache when a step starts
    drafter_pass_tokens: tuple[int, ...] | None = None  # tokens of each drafter pass; None: 1 token per pass
    kv_pool_len: int | None = None  # graphed steps with SDPA attend over this whole pool; None: the context only
    acceptance_by_position: tuple[float, ...] | None = None  # P(draft i accepted), i = 0..K-1
    ar_step_s: float | None = None  # optional: measured plain autoregressive step on the same setup
    attention_kernel: bool = False  # few-token passes attend through the split-KV kernel (EngineConfig field)
    # a DFlash draft pass: graphed, its block attends over the whole draft pool with SDPA (None: the context only),
    # or through the split-KV kernel (EngineConfig.draft_attention_kernel)
    draft_kv_pool_len: int | None = None
    draft_attention_kernel: bool = False
    fused_accept: bool = False  # greedy acceptance inside the verify step (EngineConfig.fused_accept): no launches
    norm_kernel: bool = False  # EngineConfig.norm_kernel / rope_kernel / act_kernel / add_norm_kernel: kernels
    rope_kernel: bool = False  # the engine ran instead of eager chains (costmodel.shapes.KERNEL_FLAGS)
    act_kernel: bool = False
    add_norm_kernel: bool = False
    fused_decode: bool = False  # one-token passes in six launches a layer (EngineConfig.fused_decode)
    fused_verify: bool = False  # with it, 2-16-token passes in nine launches a layer (EngineConfig.fused_verify)
    lossless12: bool = False  # their GEMVs over 12-bit weight copies (EngineConfig.lossless12)
    pdl: bool = False  # their kernels launched with programmatic dependent launch (EngineConfig.pdl)
    pdl_late: bool = False  # ... the GEMVs triggering after their K loop (EngineConfig.pdl_late)
    norm_epilogue: bool = False  # their norms written by the residual GEMVs (EngineConfig.norm_epilogue)
    rope_in_attention: bool = False  # one-token layers' RoPE + K/V write in the attention launch (EngineConfig.*)
    rope_in_qkv: bool = False  # one-token layers' RoPE + K/V write in the qkv GEMV's launch (EngineConfig.*)
    fused_mlp: bool = False  # one-token layers' MLP in one launch (EngineConfig.*)
    norm_handoff: bool = False  # fused blocks' norms from handed-over sums of squares (EngineConfig.*)
    verify_rope_in_qkv: bool = False  # fused blocks' RoPE + K/V write in the qkv GEMM (EngineConfig.*)
    pdl_l2_mb: int = 0  # with pdl: one-token GEMVs of at most this many MiB warm their weight in L2 (EngineConfig.*)
    pdl_l2_share: float = 1.0  # ... this share of it (EngineConfig.pdl_l2_share)
    pdl_l2_next_mb: int = 0  # with pdl: MiB of gate/up's head o_proj's launch warms (EngineConfig.*)
    fused_projections: bool = False  # q/k/v and gate/up fused (EngineConfig.fused_projections): GEMM launch counts
    # EngineConfig.early_draft (DFlash): the draft pass is launched before the step's sync, so its device time is
    # measured in the commit ("other") stage while the host commits, and the draft stage launches nothing
    early_draft: bool = False

    def __post_init__(self):
        times = (self.draft_s, self.verify_s, self.accept_s, self.other_s)
        if any(t < 0 for t in times) or sum(times) <= 0:
            raise ConfigError(f"stage times must be >= 0 with a positive sum, got {times}")
        if self.tau <= 0 or self.num_draft_tokens < 0 or self.drafter_passes < 0 or self.context_len < 0:
            raise ConfigError("tau must be > 0; num_draft_tokens, drafter_passes, context_len >= 0")
        if self.drafter_pass_tokens is not None and len(self.drafter_pass_tokens) != self.drafter_passes:
            raise ConfigError(f"drafter_pass_tokens has {len(self.drafter_pass_tokens)} entries, "
                              f"drafter_passes is {self.drafter_passes}")

    @property
    def step_s(self) -> float:
        return self.draft_s + self.verify_s + self.accept_s + self.other_s

    def pass_tokens(self) -> tuple[int, ...]:
        return self.drafter_pass_tokens if self.drafter_pass_tokens is not None else (1,) * self.drafter_passes


def engine_fields(cfg) -> dict:
    """StepProfile's fields that follow from an engine config (duck-typed: no engine import): a graphed pass with
    SDPA attends over the whole KV pool, through the split-KV kernel over the context only; greedy acceptance
    fused into the verify step launches nothing of its own."""
    pool = cfg.max_seq_len if cfg.cuda_graphs else None
    return {"kv_pool_len": None if cfg.attention_kernel else pool, "attention_kernel": cfg.attention_kernel,
            "draft_kv_pool_len": None if cfg.draft_attention_kernel else pool,
            "draft_attention_kernel": cfg.draft_attention_kernel,
            "fused_accept": cfg.fused_accept and cfg.sampling.greedy,
            "fused_projections": cfg.fused_projections, **kernel_flags(cfg), **l2_fields(cfg),
            "early_draft": bool(getattr(cfg, "early_draft", False)) and early_draft_applies(cfg)}


def early_draft_applies(cfg) -> bool:
    """Where engine/spec.py launches DFlash blocks early (EngineConfig.early_draft): graphed on CUDA (the static
    draft step; CUDA graphs are ignored elsewhere), no adaptive policy; greedy or sampled."""
    on_cuda = str(getattr(cfg, "device", "cuda")).startswith("cuda")
    return cfg.drafter_kind == "dflash" and cfg.cuda_graphs and on_cuda and not getattr(cfg, "adaptive", False)


# --- the report ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCost:
    measured_s: float
    floor_s: float
    predicted_s: float


@dataclass(frozen=True)
class GapRow:
    stage: str
    measured_s: float
    floor_s: float
    gap_s: float  # measured - floor
    share_of_step: float  # measured / measured step


@dataclass(frozen=True)
class CostReport:
    hardware: str
    drafter_kind: str
    target_params: int
    tau: float
    num_draft_tokens: int
    context_len: int
    stages: dict[str, StageCost]
    step_measured_s: float
    step_floor_s: float
    step_predicted_s: float
    predicted_over_measured: float  # step_predicted / step_measured
    ar_floor_s: float  # target pass at 1 token
    ar_predicted_s: float
    ceiling_speedup: float  # tau * ar_floor / (draft_floor + verify_floor)
    measured_speedup_equiv: float  # tau * ar_floor / step_measured: same yardstick as the ceiling
    predicted_speedup: float  # tau * ar_predicted / step_predicted
    measured_speedup: float | None  # tau * ar_step_s / step_measured, when the profile carries ar_step_s
    gaps: tuple[GapRow, ...] = field(default_factory=tuple)  # largest gap first
    # of the draft stage's prediction: measured host time (analyze's draft_host_s) and eager launches outside the
    # drafter's pass priced at launch_s (draft_launches); the rest is the passes' device prediction
    draft_host_s: float = 0.0
    draft_launch_s: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gaps"] = [asdict(r) for r in self.gaps]
        return d

    def table(self):
        """A rich Table: stages ranked by gap, the step total, and the speedup summary as caption."""
        from rich.table import Table

        t = Table(title=f"Step cost vs roofline on {self.hardware} (drafter: {self.drafter_kind}, "
                        f"tau {self.tau:.2f}, K {self.num_draft_tokens}, context {self.context_len})")
        for col in ("stage", "measured ms", "floor ms", "predicted ms", "gap ms", "share"):
            t.add_column(col, justify="left" if col == "stage" else "right")
        for r in self.gaps:
            t.add_row(r.stage, _ms(r.measured_s), _ms(r.floor_s), _ms(self.stages[r.stage].predicted_s),
                      _ms(r.gap_s), f"{r.share_of_step:.0%}")
        t.add_section()
        t.add_row("step", _ms(self.step_measured_s), _ms(self.step_floor_s), _ms(self.step_predicted_s),
                  _ms(self.step_measured_s - self.step_floor_s), "100%")
        measured = "" if self.measured_speedup is None else f", measured vs AR {self.measured_speedup:.2f}x"
        draft = ""
        if self.draft_host_s or self.draft_launch_s:
            passes = self.stages["draft"].predicted_s - self.draft_host_s - self.draft_launch_s
            draft = (f"; draft predicted = host {_ms(self.draft_host_s)} ms (measured) + launches outside the pass "
                     f"{_ms(self.draft_launch_s)} + pass {_ms(passes)} (modelled)")
        t.caption = (f"ceiling speedup {self.ceiling_speedup:.2f}x, measured-equivalent "
                     f"{self.measured_speedup_equiv:.2f}x, predicted {self.predicted_speedup:.2f}x{measured}; "
                     f"predicted/measured step {self.predicted_over_measured:.2f}{draft}")
        return t


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


# --- analysis -----------------------------------------------------------------------------------------------


def _draft_passes(drafter_cfg, profile: StepProfile, kind: str, target_cfg: ModelConfig) -> list[PassCost]:
    if kind in ("ngram", "none"):
        return []  # host-side lookup or no drafting: no device passes, floor 0
    if kind == "dflash":  # one block pass; the context grows by the tokens committed last step (~tau)
        if drafter_cfg is None:
            raise ConfigError("drafter_kind 'dflash' needs the drafter's DFlashConfig")
        return [dflash_pass_cost(drafter_cfg, target_cfg, profile.context_len, max(1, round(profile.tau)),
                                 pool_len=profile.draft_kv_pool_len, fused=profile.fused_projections,
                                 attention_kernel=profile.draft_attention_kernel, **draft_kernel_flags(profile))]
    if kind != "model":
        raise ConfigError(f"drafter_kind must be 'model', 'ngram', 'dflash' or 'none', not {kind!r}")
    if drafter_cfg is None:
        raise ConfigError("drafter_kind 'model' needs the drafter's ModelConfig")
    # a small model drafter is laid out like the target (engine.build_drafter applies the same EngineConfig to
    # it): its one-token passes are fused decode passes, its catch-up pass of 2-16 tokens a fused verify one
    return [forward_cost(drafter_cfg, t, profile.context_len, pool_len=profile.kv_pool_len,
                         fused=profile.fused_projections, **kernel_flags(profile), **l2_fields(profile))
            for t in profile.pass_tokens()]


# Host-side stages, predicted from measured host costs: greedy chain acceptance launches ~6 small eager kernels
# (argmax, compare, cast, cumprod, sum, gather; verify/chain.py) at `launch_s` each; the commit is the step's one
# host sync (`host_sync_s`) plus bookkeeping, which is not modelled. With `fused_accept` (greedy) the verdict is
# computed inside the verify step (its CUDA graph): nothing is launched for it, and accept is predicted 0.
ACCEPT_LAUNCHES = 6


def _stage_costs(target_cfg, drafter_cfg, profile, hw, kind, graphed, draft_host_s=0.0,
                 draft_launches=0.0) -> dict[str, StageCost]:
    drafts = _draft_passes(drafter_cfg, profile, kind, target_cfg)
    verify = forward_cost(target_cfg, profile.num_draft_tokens + 1, profile.context_len, pool_len=profile.kv_pool_len,
                          **kernel_flags(profile), **l2_fields(profile))
    kern = profile.attention_kernel
    draft_kern = profile.draft_attention_kernel if kind == "dflash" else kern
    pass_floor = sum(pass_floor_s(c, hw) for c in drafts)
    pass_pred = sum(pass_predicted_s(c, hw, graphed, draft_kern) for c in drafts)
    sync = hw.host_sync_s or 0.0
    if profile.early_draft and kind == "dflash":  # the pass runs in the commit stage, the host's work beside it
        draft = StageCost(profile.draft_s, 0.0, draft_launches * hw.launch_s)
        other = StageCost(profile.other_s, pass_floor, sync + max(pass_pred, draft_host_s))
    else:
        draft = StageCost(profile.draft_s, pass_floor, draft_host_s + draft_launches * hw.launch_s + pass_pred)
        other = StageCost(profile.other_s, 0.0, sync)
    return {
        "draft": draft,
        "verify": StageCost(profile.verify_s, pass_floor_s(verify, hw), pass_predicted_s(verify, hw, graphed, kern)),
        "accept": StageCost(profile.accept_s, 0.0, 0.0 if profile.fused_accept else ACCEPT_LAUNCHES * hw.launch_s),
        "other": other,
    }


def _gap_rows(stages: dict[str, StageCost], step_s: float) -> tuple[GapRow, ...]:
    rows = [GapRow(name, s.measured_s, s.floor_s, s.measured_s - s.floor_s, s.measured_s / step_s)
            for name, s in stages.items()]
    return tuple(sorted(rows, key=lambda r: r.gap_s, reverse=True))


def analyze(target_cfg: ModelConfig, drafter_cfg: ModelConfig | None, profile: StepProfile,
            hw: HardwareCeilings, *, drafter_kind: DrafterKind = "model", graphed: bool = True,
            draft_host_s: float = 0.0, draft_launches: float = 0.0) -> CostReport:
    """Compare a measured step with its roofline floor and calibrated prediction (see module docstring).
    `draft_host_s`: measured host time of one proposal that the device waits for, added to the draft stage's
    prediction: an n-gram lookup replayed on the outputs (drafters/ngram.replay), or a model drafter's host time
    from propose() entry to its pass's launch (+ an eager first pass's), drafters/timing.ProposeTimer.
    `draft_launches`: eager launches a proposal queues behind its pass (per step), priced at `launch_s` each.
    Neither changes the floor (host work is no physical bound of the GPU)."""
    stages = _stage_costs(target_cfg, drafter_cfg, profile, hw, drafter_kind, graphed, draft_host_s, draft_launches)
    ar = forward_cost(target_cfg, 1, profile.context_len, pool_len=profile.kv_pool_len, **kernel_flags(profile))
    ar_floor, ar_pred = pass_floor_s(ar, hw), pass_predicted_s(ar, hw, graphed, profile.attention_kernel)
    step = profile.step_s
    step_floor = sum(s.floor_s for s in stages.values())
    step_pred = sum(s.predicted_s for s in stages.values())
    return CostReport(
        hardware=hw.name, drafter_kind=drafter_kind, target_params=param_count(target_cfg), tau=profile.tau,
        num_draft_tokens=profile.num_draft_tokens, context_len=profile.context_len, stages=stages,
        step_measured_s=step, step_floor_s=step_floor, step_predicted_s=step_pred,
        predicted_over_measured=step_pred / step, ar_floor_s=ar_floor, ar_predicted_s=ar_pred,
        ceiling_speedup=profile.tau * ar_floor / (stages["draft"].floor_s + stages["verify"].floor_s),
        measured_speedup_equiv=profile.tau * ar_floor / step,
        predicted_speedup=profile.tau * ar_pred / step_pred,
        measured_speedup=None if profile.ar_step_s is None else profile.tau * profile.ar_step_s / step,
        gaps=_gap_rows(stages, step),
        draft_host_s=draft_host_s, draft_launch_s=draft_launches * hw.launch_s,
    )
