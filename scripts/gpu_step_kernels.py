#!/usr/bin/env python
"""Where a graphed one-token decode step's time goes, kernel by kernel, against each kernel's bytes floor (issue 3's
AR-step bars: <= 1.5x the floor at the 1.5B shape, <= 1.15x at Qwen3-8B's; random bf16 weights, real shapes).

Per shape: the engine's fused one-token step (EngineConfig defaults on CUDA: six launches a layer) + the LM head,
captured in one CUDA graph after a 512-token prefill; its replay time (median of 100, CUDA events); then REPLAYS
replays under torch.profiler (graph kernels included). The kernels of one replay repeat with the
layer: the script finds that period and reports, per position in the layer (qkv, RoPE + K/V write, attention,
o_proj, gate/up, down for the fused layer), the median kernel time over layers and replays, the median gap to the
next kernel's start (the graph's kernel boundary), the weight bytes it reads and its floor at the measured HBM
rate; the same for what precedes and follows the layers (embedding, LM head). What the sums say: kernel time +
gaps = the step; a kernel far over its floor is where the bar is lost.

Run: python3 scripts/gpu_step_kernels.py [qwen2.5-1.5b qwen3-8b ...] [--replays=20] [--rope-in-qkv]
[--pdl=start|late]
(--rope-in-qkv: the step with EngineConfig.rope_in_qkv, five launches a layer; shapes with a q/k norm say so;
--pdl: its launches with programmatic dependent launch, the GEMVs' trigger first thing or after their K loop
(EngineConfig.pdl_trigger): a kernel that starts before the one ahead of it ends shows a negative gap)
Last stdout line: one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys

LAYER_NAMES = ("qkv", "rope_write", "attention", "o_proj", "gate_up", "down")  # the fused layer's six launches
# with --rope-in-qkv (EngineConfig.rope_in_qkv): five, RoPE + K/V write in the qkv GEMV's epilogue
LAYER_NAMES_ROPE_IN_QKV = ("qkv", "attention", "o_proj", "gate_up", "down")
LAYOUTS = {len(names): names for names in (LAYER_NAMES, LAYER_NAMES_ROPE_IN_QKV)}
CONTEXT = 512  # the prefill length of gpu_megakernel.prefilled, which this script shares


def layer_pattern(names: list[str], layers: int, max_period: int = 24) -> tuple[int, int, int]:
    """-> (offset, period, repeats): the kernel sequence of one step is `offset` kernels, then `repeats` copies of
    `period` kernels with the same names, then the rest; repeats = layers, or layers - 1 where the first layer
    launches differently (it is then part of the offset). The repeat must cover all but a layer and 8 kernels of
    the step (three GEMVs in a row also "repeat"); the longest period wins. Where several offsets fit (a rotation
    of the layer: the LM head's GEMV has the qkv GEMV's name), the one that puts an attention kernel where the
    fused layer has it (LAYOUTS: third of six, second of five), else the smallest. ValueError if none fits."""
    for repeats in (layers, layers - 1):
        if repeats < 1:
            continue
        for period in range(min(max_period, len(names) // repeats), 0, -1):
            if len(names) - repeats * period > period + 8:  # the repeat must be nearly all of the step
                continue
            fits = [off for off in range(0, len(names) - repeats * period + 1)
                    if all(names[off + i * period:off + (i + 1) * period] == names[off:off + period]
                           for i in range(repeats))]
            if fits:
                at = LAYOUTS[period].index("attention") if period in LAYOUTS else None
                placed = [off for off in fits if at is not None and "att" in names[off + at].lower()]
                return (placed or fits)[0], period, repeats
    raise ValueError(f"no per-layer repeat of <= {max_period} kernels over {layers} layers in {len(names)} kernels")


def summarize(steps: list[list[tuple[str, float, float]]], layers: int, layer_bytes: dict | None = None,
              bytes_per_s: float | None = None) -> dict:
    """steps: per replay, its kernels in start order as (name, start_us, end_us) -> per layer position and for the
    kernels outside the layers: median duration and median gap to the next kernel (us), the name; with the weight
    bytes of a position, its floor and kernel/floor; and the totals of one step."""
    names = [k[0] for k in steps[0]]
    offset, period, repeats = layer_pattern(names, layers)
    if any([k[0] for k in s] != names for s in steps):
        raise ValueError("replays launched different kernel sequences")
    dur = [[e - s for _, s, e in step] for step in steps]
    gap = [[step[i + 1][1] - step[i][2] for i in range(len(step) - 1)] + [0.0] for step in steps]
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    labels = LAYOUTS.get(period, tuple(f"k{j}" for j in range(period)))
    per_layer = {}
    for j in range(period):
        idx = [offset + i * period + j for i in range(repeats)]
        row = {"kernel": names[offset + j][:60], "us": med([d[i] for d in dur for i in idx]),
               "gap_us": med([g[i] for g in gap for i in idx])}
        b = (layer_bytes or {}).get(labels[j])
        if b and bytes_per_s:
            row["bytes"] = b
            row["floor_us"] = round(b / bytes_per_s * 1e6, 3)
            row["over_floor"] = round(row["us"] / row["floor_us"], 3)
        per_layer[labels[j]] = row
    outside = {}
    for i in list(range(offset)) + list(range(offset + repeats * period, len(names))):
        outside[f"{i}:{names[i][:50]}"] = {"us": med([d[i] for d in dur]), "gap_us": med([g[i] for g in gap])}
    kernel_us = statistics.median(sum(d) for d in dur)
    span_us = statistics.median(s[-1][2] - s[0][1] for s in steps)
    return {"kernels_per_step": len(names), "offset": offset, "period": period, "repeats": repeats,
            "per_layer": per_layer,
            "outside_layers": outside, "kernel_us": round(kernel_us, 2), "span_us": round(span_us, 2),
            "gaps_us": round(span_us - kernel_us, 2),
            "layer_us": round(sum(r["us"] + r["gap_us"] for r in per_layer.values()), 3)}


def replay_kernels(prof, replays: int) -> list[list[tuple[str, float, float]]] | str:
    """The GPU kernels a torch.profiler run of `replays` graph replays recorded (copies and memsets left out), in
    start order, split into one list a replay of (name, start_us, end_us); a message where they do not split
    evenly. (gpu_step_profile.py takes it too.)"""
    import torch

    kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
                      and "memset" not in e.name.lower()), key=lambda k: k[1])
    if not kernels or len(kernels) % replays:
        return f"{len(kernels)} kernels over {replays} replays"
    n = len(kernels) // replays
    return [kernels[i * n:(i + 1) * n] for i in range(replays)]


def _layer_bytes(cfg, elt: int = 2) -> dict:
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {"qkv": (nq + 2 * nkv) * h * elt, "o_proj": nq * h * elt,
            "gate_up": 2 * cfg.intermediate_size * h * elt, "down": cfg.intermediate_size * h * elt,
            "attention": 2 * nkv * CONTEXT * elt}


def measure(name: str, replays: int, rope_in_qkv: bool = False, pdl_trigger: str | None = None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gpu_megakernel import _fused, _prompt, prefilled  # the same fused model and prefill as its comparison
    from specpilot.costmodel import forward_cost, load_or_measure, pass_floor_s, synthetic_config
    from specpilot.costmodel.hardware import time_median_s
    from specpilot.engine.graphs import capture
    from specpilot.kernels import pdl
    from specpilot.models import random_model

    dev = "cuda"
    hw = load_or_measure(dev)
    cfg = synthetic_config(name)
    model = _fused(random_model(cfg).fuse_projections().eval())
    if rope_in_qkv:
        if cfg.qk_norm:  # Qwen3's q/k norm needs the whole head before the rotation: the switch cannot apply
            return {"error": "rope_in_qkv: this shape has a q/k norm"}
        model.use_rope_in_qkv()
    if pdl_trigger and not pdl.set_enabled(True, trigger=pdl_trigger):  # before the capture: graphs keep it
        return {"error": f"pdl could not be switched on: {pdl.unsupported_reason()}"}
    with torch.no_grad():
        cache = prefilled(model, _prompt(cfg))
        tok = torch.randint(0, cfg.vocab_size, (1, 1), device=dev)
        pos = torch.tensor([[CONTEXT]], device=dev)
        graph, _ = capture(lambda: model.logits(model(tok, pos, cache, kv_len=None)), warmup=3)
        ms = time_median_s(graph.replay, warmup=5, repeats=100) * 1e3
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
    pdl.set_enabled(False)
    steps = replay_kernels(prof, replays)
    if isinstance(steps, str):
        return {"error": steps}
    floor_ms = pass_floor_s(forward_cost(cfg, 1, CONTEXT), hw) * 1e3
    out = {"step_ms": round(ms, 4), "floor_ms": round(floor_ms, 4), "over_floor": round(ms / floor_ms, 3),
           "hbm_tb_s": round(hw.hbm_bytes_per_s / 1e12, 3)}
    try:
        out.update(summarize(steps, cfg.num_hidden_layers, _layer_bytes(cfg), hw.hbm_bytes_per_s))
    except ValueError as e:
        out["error"] = str(e)
        out["names"] = [k[0][:40] for k in steps[0][:40]]
    return out


def print_shape(name: str, r: dict, keys: tuple) -> None:
    """A shape's result as human lines: its `keys`, then one line per layer position and per launch outside."""
    print(name, {k: r.get(k) for k in keys}, flush=True)
    for label, row in {**r.get("per_layer", {}), **r.get("outside_layers", {})}.items():
        print(f"  {label[:40]:40s} {row}", flush=True)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    shapes, replays, rope_in_qkv, pdl_trigger = [], 20, False, None
    for a in argv:
        if a.startswith("--replays="):
            replays = int(a.split("=", 1)[1])
        elif a.startswith("--pdl="):
            pdl_trigger = a.split("=", 1)[1]
            if pdl_trigger not in ("start", "late"):
                print(f"gpu_step_kernels.py: --pdl takes start or late, got {pdl_trigger!r}", file=sys.stderr)
                return 2
        elif a == "--rope-in-qkv":
            rope_in_qkv = True
        elif a.startswith("--"):
            print(f"gpu_step_kernels.py: unexpected argument {a!r} (see --help)", file=sys.stderr)
            return 2
        else:
            shapes.append(a)
    import torch

    if not torch.cuda.is_available():
        print("gpu_step_kernels.py needs CUDA", file=sys.stderr)
        return 2
    res = {}
    for name in shapes or ["qwen2.5-1.5b", "qwen3-8b"]:
        res[name] = measure(name, replays, rope_in_qkv, pdl_trigger)
        print_shape(name, res[name], ("step_ms", "over_floor", "kernel_us", "gaps_us", "error"))
        torch.cuda.empty_cache()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
