#!/usr/bin/env python
"""The cost model against a GPU session's measurements, on the CPU: `python scripts/costmodel_check.py DIR`.

DIR holds a session's logs: step_timing.log (scripts/gpu_step_timing.py), profile_{ngram,model,dflash}.log
(`specpilot profile`), optionally gemv_check.log. Every step-timing row is predicted with `forward_cost` (the
variant's flags) + `pass_predicted_s`, every profile re-analysed with `analyze` on its measured StepProfile; prints
predicted / measured per row and one JSON object as its last line.

Ceilings: the step-timing JSON's `hardware` (its last line) when present. Session 11's run timed out before that line,
so they are then reconstructed (`reconstruct_ceilings`, every number's source stated there): HBM rate from the
logged floors (exact), host sync from the profiles' `other` prediction (exact), graphed-kernel / launch / bf16 /
split-KV-kernel figures from session 10's measured ceilings (BENCHMARKS.md), the GEMV chain rates solved so that
the old model reproduces the AR / verify / drafter predictions the profiles logged (which used the real ceilings),
with M = 16 / M = 1 and tiny / large ratios from gemv_check.log. An estimate, stated as such in the output.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specpilot.costmodel import (StepProfile, analyze, dflash_pass_cost, forward_cost, pass_predicted_s,  # noqa: E402
                                 synthetic_config)
from specpilot.costmodel.gaps import PassCost  # noqa: E402
from specpilot.costmodel.shapes import eager_chain_kernels  # noqa: E402
from specpilot.costmodel.hardware import HardwareCeilings  # noqa: E402
from specpilot.models.config import ModelConfig  # noqa: E402

VARIANTS = {  # step-timing variant -> (compiled, attention kernel, norm + rope kernels)
    "graphed": (False, False, False),
    "graphed_attnkernel": (False, True, False),
    "graphed_allkernels": (False, True, True),
    "compiled_attnkernel": (True, True, False),
    # all kernels, one-token rows through models/fused_decode.py; "_pdl": launched with PDL (gaps.PDL_GAP_FACTOR)
    "graphed_fuseddecode": (False, True, True),
    "graphed_fuseddecode_pdl": (False, True, True),
}
CONTEXT, POOL = 512, 4096
BAR = 0.15


def _last_json(path: Path):
    for line in reversed(path.read_text().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def step_rows(path: Path) -> list[tuple[str, str, int, float, float]]:
    """(shape, variant, T, measured ms, floor ms) per row of step_timing.log."""
    rows = []
    for line in path.read_text().splitlines():
        m = re.match(r"(\S+) (\w+)_T(\d+) (\{.*?\})", line)
        if m and m.group(2) in VARIANTS:
            d = ast.literal_eval(m.group(4))
            rows.append((m.group(1), m.group(2), int(m.group(3)), d["ms"], d["floor_ms"]))
    return rows


def _gemv_layer_rate(gemv: dict, model: str, m: int, shapes) -> float | None:
    """Bytes / seconds of one layer's four GEMMs from gemv_check's per-shape cuBLAS times (o, unmeasured, timed
    like qkv scaled by its bytes)."""
    try:
        qkv, gu, down = (gemv[f"{model} {k} M{m}"]["cublas_us"] for k in ("qkv", "gate_up", "down"))
    except KeyError:
        return None
    (nq, k), (no, ko), (ng, kg), (nd, kd) = shapes
    o = qkv * (no * ko) / (nq * k)
    return 2 * (nq * k + no * ko + ng * kg + nd * kd) / ((qkv + o + gu + down) * 1e-6)


def reconstruct_ceilings(d: Path) -> tuple[HardwareCeilings, dict]:
    """Session 11's H200 ceilings (see the module docstring); returns (ceilings, sources)."""
    from specpilot.costmodel.hardware import LARGE_CHAIN, SMALL_CHAIN, TINY_CHAIN, _chain_shapes

    rows = step_rows(d / "step_timing.log")
    hbm = sum(forward_cost(synthetic_config(s), T, CONTEXT).total_bytes / (f * 1e-3) for s, _, T, _, f in rows) / len(rows)
    prof = {k: _last_json(d / f"profile_{k}.log") for k in ("ngram", "model", "dflash")}
    host_sync = prof["ngram"]["stages"]["other"]["predicted_s"]
    gemv = (_last_json(d / "gemv_check.log") or {}).get("gemv", {})
    ratio = {}
    for name, model, chain in (("tiny", "0.5b", TINY_CHAIN), ("small", "1.5b", SMALL_CHAIN), ("large", "8b", LARGE_CHAIN)):
        r1, r16 = (_gemv_layer_rate(gemv, model, m, _chain_shapes(chain)) for m in (1, 16))
        ratio[name] = (r1, r16)
    hw = HardwareCeilings(
        name="NVIDIA H200 (session 11, reconstructed)", hbm_bytes_per_s=hbm, bf16_flops_per_s=786e12, launch_s=9.0e-6,
        graph_kernel_s=1.13e-6, gemv_bytes_per_s=1.76e12, measured_at="reconstructed",
        gemv16_bytes_per_s=1.79e12, attn_kernel_t1_s=10.1e-6, attn_kernel_t16_s=23.7e-6, host_sync_s=host_sync)
    # the large chain relative to the small one as gemv_check measured them; scale both so that the old model
    # gives the logged AR (T = 1) and T = 16 verify predictions (the two independent ones; T = 5 follows)
    t15 = _profile_target()
    large_over_small = (ratio["large"][0] / ratio["small"][0], ratio["large"][1] / ratio["small"][1])
    tiny_over_small = (ratio["tiny"][0] / ratio["small"][0], ratio["tiny"][1] / ratio["small"][1])

    def with_small(h, s, m16):
        if m16:
            return dataclasses.replace(h, gemv16_bytes_per_s=s, gemv16_large_bytes_per_s=s * large_over_small[1],
                                       gemv16_tiny_bytes_per_s=s * tiny_over_small[1])
        return dataclasses.replace(h, gemv_bytes_per_s=s, gemv_large_bytes_per_s=s * large_over_small[0],
                                   gemv_tiny_bytes_per_s=s * tiny_over_small[0])

    old = _legacy_pass_predicted_s
    ctx = prof["ngram"]["profile"]["context_len"]
    hw = _solve(lambda s: old(forward_cost(t15, 1, ctx), with_small(hw, s, False), True, True)
                - prof["ngram"]["ar_predicted_s"], with_small, hw, False)
    hw = _solve(lambda s: old(forward_cost(t15, 16, ctx), with_small(hw, s, True), True, True)
                - prof["dflash"]["stages"]["verify"]["predicted_s"], with_small, hw, True)
    # the DFlash draft pass's logged prediction minus the old model's without SDPA: its 2 masked SDPA calls at
    # T = 16 over the draft pool (+ block); all of it put on the per-key slope (fixed part 0)
    p = prof["dflash"]["profile"]
    dc = dflash_pass_cost(_drafter_cfg("dflash"), t15, p["context_len"], max(1, round(p["tau"])),
                          pool_len=p["draft_kv_pool_len"])
    resid = prof["dflash"]["stages"]["draft"]["predicted_s"] - old(dc, hw, True, False)
    hw = dataclasses.replace(hw, sdpa16_fixed_s=0.0, sdpa16_per_key_s=max(resid, 0.0) / (dc.num_layers * dc.attn_keys))
    # eager RMSNorm / RoPE kernels in a graph: the step-timing A/B (attention kernel vs + norm and RoPE kernels)
    # saves (eager kernels removed - Triton launches added); per removed kernel at T = 1 and 16, mean of the shapes
    meas = {(s_, v, T): ms for s_, v, T, ms, _ in rows}
    per = {1: [], 16: []}
    for shape in {r[0] for r in rows}:
        cfg = synthetic_config(shape)
        removed = eager_chain_kernels(cfg)
        added = eager_chain_kernels(cfg) - eager_chain_kernels(cfg, norm_kernel=True, rope_kernel=True) - (
            forward_cost(cfg, 1, 0).num_kernels - forward_cost(cfg, 1, 0, norm_kernel=True, rope_kernel=True).num_kernels)
        for T in per:
            if (shape, "graphed_attnkernel", T) in meas and (shape, "graphed_allkernels", T) in meas:
                saved = (meas[shape, "graphed_attnkernel", T] - meas[shape, "graphed_allkernels", T]) * 1e-3
                per[T].append((saved + added * hw.graph_kernel_s) / removed)
    if per[1] and per[16]:
        hw = dataclasses.replace(hw, graph_eager_kernel_s=sum(per[1]) / len(per[1]),
                                 graph_eager_kernel16_s=sum(per[16]) / len(per[16]))
    sources = {
        "graph_eager_kernel_s / 16": "step-timing A/B: (attnkernel - allkernels + Triton launches x graph_kernel_s) "
                                     "/ eager norm+RoPE kernels removed, mean of the two shapes (new ceiling, "
                                     "measured by hardware._graph_eager_kernel_s from now on)",
        "sdpa16 fit": "the DFlash profile's logged draft prediction minus the old model's without SDPA, all per key",
        "hbm_bytes_per_s": "mean of step_timing floors (bytes / floor): exact",
        "host_sync_s": "profiles' predicted 'other' stage: exact",
        "graph_kernel_s, launch_s, bf16, attn_kernel_t1/t16": "session 10 measured (BENCHMARKS.md)",
        "gemv chains": "solved: old model == the profiles' logged AR and T=16 verify predictions; size and M ratios "
                       "from gemv_check.log cuBLAS per-shape times",
        "sdpa T=1 fit": "not recoverable (None): SDPA T=1 rows priced without attention",
    }
    return hw, sources


def _legacy_pass_predicted_s(cost: PassCost, hw: HardwareCeilings, graphed: bool = True,
                             attention_kernel: bool = False) -> float:
    """gaps.pass_predicted_s as of session 11 (commit 9258d6a), with which the logged predictions were made: the
    same model without the eager-kernel term (every non-GEMM kernel at graph_kernel_s)."""
    return pass_predicted_s(dataclasses.replace(cost, num_eager_kernels=0), hw, graphed, attention_kernel)


def _solve(f, with_small, hw, m16):
    lo, hi = 1e11, 2e13
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    return with_small(hw, (lo * hi) ** 0.5, m16)


def _profile_target() -> ModelConfig:
    p = Path.home() / ".cache/specpilot/models/qwen2.5-coder-1.5b/config.json"
    if p.is_file():
        return ModelConfig.from_hf_dict(json.loads(p.read_text()))
    return dataclasses.replace(synthetic_config("qwen2.5-1.5b"), tie_word_embeddings=False)


def _drafter_cfg(kind: str):
    if kind == "model":
        p = Path.home() / ".cache/specpilot/models/qwen2.5-coder-0.5b/config.json"
        return (ModelConfig.from_hf_dict(json.loads(p.read_text())) if p.is_file()
                else synthetic_config("qwen2.5-0.5b"))
    if kind == "dflash":
        from specpilot.models.dflash_config import DFlashConfig
        p = ROOT / "specpilot/hub/drafters/dflash-qwen2.5-coder-1.5b/config.json"
        return DFlashConfig.from_hf_dict(json.loads(p.read_text()))
    return None


# the Triton kernels gpu_step_timing.py's "all kernels" variant switches on (session 11: norm and RoPE only;
# act_kernel and add_norm_kernel joined it afterwards): override with a second argument, comma-separated
ALL_KERNELS = ["norm_kernel", "rope_kernel", "act_kernel", "add_norm_kernel"]


def predict_step(hw, shape: str, variant: str, T: int) -> float:
    compiled, kern, allk = VARIANTS[variant]
    cost = forward_cost(synthetic_config(shape), T, CONTEXT, pool_len=None if kern else POOL, fused=True,
                        compiled=compiled, **{f: allk for f in ALL_KERNELS},
                        fused_decode="fuseddecode" in variant, pdl=variant.endswith("_pdl"))
    return pass_predicted_s(cost, hw, True, kern)


def main(d: Path) -> int:
    st = _last_json(d / "step_timing.log")
    if st and "hardware" in st:
        hw, sources = HardwareCeilings.from_dict(st["hardware"]), {"all": "step_timing.log hardware JSON"}
    else:
        hw, sources = reconstruct_ceilings(d)
    out = {"hardware": hw.to_dict(), "sources": sources, "steps": {}, "profiles": {}}
    print(f"{'shape':14s} {'variant':22s} {'T':>3s} {'meas ms':>8s} {'pred ms':>8s} {'pred/meas':>9s}")
    for shape, variant, T, ms, _ in step_rows(d / "step_timing.log"):
        pred = predict_step(hw, shape, variant, T) * 1e3
        r = pred / ms
        out["steps"][f"{shape} {variant} T{T}"] = {"measured_ms": ms, "predicted_ms": round(pred, 4), "ratio": round(r, 3)}
        print(f"{shape:14s} {variant:22s} {T:3d} {ms:8.3f} {pred:8.3f} {r:9.3f}{'' if abs(r - 1) <= BAR else '  *'}")
    target = _profile_target()
    for kind in ("ngram", "model", "dflash"):
        path = d / f"profile_{kind}.log"
        if not path.is_file():
            continue
        logged = _last_json(path)
        p = dict(logged["profile"])
        p = StepProfile(**{k: tuple(v) if isinstance(v, list) else v for k, v in p.items()})
        host = logged["stages"]["draft"]["predicted_s"] if kind == "ngram" else 0.0  # the replayed lookup
        rep = analyze(target, _drafter_cfg(kind), p, hw, drafter_kind=kind, graphed=True, draft_host_s=host)
        row = {"step_measured_ms": rep.step_measured_s * 1e3, "step_predicted_ms": rep.step_predicted_s * 1e3,
               "ratio": round(rep.predicted_over_measured, 3), "logged_ratio": round(logged["predicted_over_measured"], 3),
               "stages": {k: {"measured_ms": round(s.measured_s * 1e3, 4), "predicted_ms": round(s.predicted_s * 1e3, 4)}
                          for k, s in rep.stages.items()},
               "ar_measured_ms": (p.ar_step_s or 0) * 1e3, "ar_predicted_ms": rep.ar_predicted_s * 1e3}
        out["profiles"][kind] = row
        stages = " ".join(f"{k} {v['predicted_ms']:.3f}/{v['measured_ms']:.3f}" for k, v in row["stages"].items())
        print(f"profile {kind:7s} step {row['step_predicted_ms']:.3f}/{row['step_measured_ms']:.3f} = {row['ratio']:.3f}"
              f" (logged {row['logged_ratio']:.3f}); {stages}; AR {row['ar_predicted_ms']:.3f}/{row['ar_measured_ms']:.3f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: costmodel_check.py RESULTS_DIR [ALL_KERNEL_FLAGS, e.g. norm_kernel,rope_kernel]")
    if len(sys.argv) > 2:
        ALL_KERNELS = sys.argv[2].split(",")
    sys.exit(main(Path(sys.argv[1])))
