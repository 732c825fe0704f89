"""The roofline cost model (v1): how fast a speculative step could run on this GPU, and where the time goes.

Public API (others code against exactly these names):
  hardware  measure_ceilings(device="cuda") -> HardwareCeilings     micro-benchmarks of one GPU (< 30 s)
            load_or_measure(device="cuda", refresh=False)           cached at cache_dir()/hardware/<gpu>.json
            save_ceilings(hw, path=None) / load_ceilings(path) / ceilings_path(name)
            CudaUnavailableError (a ConfigError)                    raised where CUDA is not available
  shapes    forward_cost(cfg, num_tokens, context_len, dtype_bytes=2) -> PassCost    bytes, FLOPs, kernels
            dflash_pass_cost(dflash_cfg, target_cfg, context_len, new_context) -> PassCost    one DFlash draft
            param_count(cfg), synthetic_config(name), SYNTHETIC_NAMES
  gaps      pass_floor_s(cost, hw)  physical bound;  pass_predicted_s(cost, hw, graphed=True)  calibrated estimate
            StepProfile (measured stage times, passed in), analyze(...) -> CostReport (.to_dict(), .table())
            analyze(..., draft_host_s=, draft_launches=): the draft stage's measured host part (seconds) and
            eager launches outside the drafter's pass (priced at launch_s), drafters/timing.ProposeTimer
  whatif    predicted_gain(target_cfg, drafter_cfg, profile, hw, kind=, now=StepKnobs, new=StepKnobs) -> float | None
            tau_at(tau, k, k_new, acceptance_by_position=None)      the loop orders its trials by these

Dependency rule: this package imports only torch, the stdlib, rich (lazily, for tables), `specpilot.models.config`,
`specpilot.hub` (cache location) and `specpilot.errors`; never the engine, evaluator or CLI, and it never runs a model.
"""

from specpilot.costmodel.gaps import (
    CostReport,
    GapRow,
    StageCost,
    StepProfile,
    analyze,
    pass_floor_s,
    pass_predicted_s,
)
from specpilot.costmodel.hardware import (
    CudaUnavailableError,
    HardwareCeilings,
    ceilings_path,
    load_ceilings,
    load_or_measure,
    measure_ceilings,
    save_ceilings,
)
from specpilot.costmodel.shapes import (
    SYNTHETIC_NAMES, PassCost, dflash_pass_cost, forward_cost, param_count, synthetic_config,
)
from specpilot.costmodel.whatif import StepKnobs, predicted_gain, tau_at

__all__ = [
    "SYNTHETIC_NAMES", "CostReport", "CudaUnavailableError", "GapRow", "HardwareCeilings", "PassCost",
    "StageCost", "StepProfile", "analyze", "ceilings_path", "dflash_pass_cost", "forward_cost", "load_ceilings", "load_or_measure",
    "measure_ceilings", "param_count", "pass_floor_s", "pass_predicted_s", "predicted_gain", "save_ceilings",
    "StepKnobs", "synthetic_config", "tau_at",
]
