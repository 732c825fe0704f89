#!/usr/bin/env python
"""Where a graphed one-token step's time goes between its kernels: per-program timelines (kernels/trace.py).

  python3 scripts/gpu_step_trace.py [qwen2.5-1.5b|qwen3-8b ...] [--config=field=value,...] [--replays=5]

Per shape: a random bf16 model laid out by the engine for `EngineConfig(device="cuda", dtype="bfloat16", ...)` (the
defaults, or --config's fields: what `specpilot` runs), its graphed one-token step after a 512-token prefill into a
4096-slot pool (scripts/gpu_step_timing.py's), timed untraced, then captured again with every program of the traced
kernels (qkv + RoPE, the one-token attention, the one-row GEMVs incl. the LM head) writing its timeline row, timed
traced and replayed `--replays` times. For each replay and each launch: when its programs passed their PDL wait, when
they ended; between a kernel and the one ahead of it:

- release: this kernel's first program past its wait - the last program of the one ahead ending (a boundary's cost:
  the grid's completion becoming visible to the waiting programs);
- run: this kernel's last program ending - its first program past the wait;
- step share: release + run (= its last end - the last end of the one ahead: what the kernel adds to the chain);
- lead: its first program starting - the last end of the one ahead (negative: resident early, under PDL);
- spread: its last program past the wait - its first (programs that became resident late);
- tail: its last end - its median end (stragglers holding the next kernel back);
- busy: the median program's end - its wait (and in SM cycles, %clock64: exact where the global timer is coarse).

Medians over the layers and replays per position in the layer (qkv, attention, o_proj, gate_up, down) and for the
LM head; each position's floor (its weight bytes at the measured HBM rate) beside its step share. Also: the global
timer's granularity seen (the smallest step between distinct stamps), the SM clock the stamps imply (cycles / ns)
and the step untraced vs traced (what the stamps add). Human lines, one JSON object last.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

CONTEXT, POOL = 512, 4096  # scripts/gpu_step_timing.py's
LAYER = ("qkv", "attention", "o_proj", "gate_up", "down")  # a fused layer's five launches (rope_in_qkv, default)
FIELD = {name: i for i, name in enumerate(("start", "waited", "looped", "end", "sm", "tag", "clock_waited",
                                           "clock_end", "summed"))}  # kernels/trace.py FIELDS


def _med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def launch_stats(rows: list[list[int]], t0: int) -> dict:
    """One launch's programs -> their times (us from t0): first / last start, first / median / last past the wait,
    first / median / last end, median busy (us and SM cycles), programs, SMs, tags."""
    col = lambda name: [r[FIELD[name]] for r in rows]  # noqa: E731
    us = lambda v: (v - t0) / 1e3  # noqa: E731
    start, waited, end = col("start"), col("waited"), col("end")
    tags: dict = {}
    for t in col("tag"):
        tags[t] = tags.get(t, 0) + 1
    return {"programs": len(rows), "sms": len(set(col("sm"))), "tags": tags,
            "start_first": us(min(start)), "start_last": us(max(start)),
            "wait_first": us(min(waited)), "wait_med": us(_med(waited)), "wait_last": us(max(waited)),
            "end_first": us(min(end)), "end_med": us(_med(end)), "end_last": us(max(end)),
            "busy_us": _med([(e - w) / 1e3 for e, w in zip(end, waited)]),
            "busy_cycles": _med([c1 - c0 for c0, c1 in zip(col("clock_waited"), col("clock_end"))])}


def attention_chain(rows: list[list[int]]) -> dict:
    """One attention launch's programs (tags: 0 exited early, 1 published a partial, 2 published and merged) ->
    att_publish_us (median over the working programs of wait -> partial published: the slice's loads, softmax,
    stores, barrier and atomic), split into att_slice_us (wait -> the slice's sums issued: loads and softmax) and
    att_store_us (-> published: the partial's stores, the barrier and the gpu-scope atomic), att_merge_us (the last
    arrival's merge: published -> end) and att_working."""
    w, lo, e, tag, su = (FIELD[k] for k in ("waited", "looped", "end", "tag", "summed"))
    work = [r for r in rows if r[tag] in (1, 2)]
    if not work:
        return {}
    return {"att_publish_us": _med([(r[lo] - r[w]) / 1e3 for r in work]),
            "att_slice_us": _med([(r[su] - r[w]) / 1e3 for r in work]),
            "att_store_us": _med([(r[lo] - r[su]) / 1e3 for r in work]),
            "att_merge_us": _med([(r[e] - r[lo]) / 1e3 for r in work if r[tag] == 2]), "att_working": len(work)}


def boundaries(launches: list[dict]) -> list[dict]:
    """One replay's launches (kernels/trace.py `read`, in launch order) -> per launch its stats and, from the second
    on, what it adds after the one ahead (release, run, share, lead, spread, tail; module docstring)."""
    t0 = min(r[FIELD["start"]] for launch in launches for r in launch["rows"])
    out, prev = [], None
    for launch in launches:
        s = launch_stats(launch["rows"], t0)
        s["name"] = launch["name"]
        if "attention" in launch["name"]:
            s.update(attention_chain(launch["rows"]))
        s["run"] = s["end_last"] - s["wait_first"]
        s["spread"] = s["wait_last"] - s["wait_first"]
        s["tail"] = s["end_last"] - s["end_med"]
        if prev is not None:
            s["release"] = s["wait_first"] - prev["end_last"]
            s["share"] = s["end_last"] - prev["end_last"]
            s["lead"] = s["start_first"] - prev["end_last"]
        out.append(s)
        prev = s
    return out


def layer_offset(names: list[str], layers: int) -> int:
    """-> the index of the first layer's qkv launch: `layers` repeats of the five-launch layer (LAYER) follow it,
    with the attention second. ValueError where the launches do not repeat so (another layout: rope_in_qkv off,
    rope_in_attention, a model with non-fused layers)."""
    p = len(LAYER)
    for off in range(0, len(names) - layers * p + 1):
        first = names[off:off + p]
        if "attention" in first[1] and all(names[off + i * p:off + (i + 1) * p] == first for i in range(layers)):
            return off
    raise ValueError(f"no {layers} repeats of a {p}-launch layer (qkv, attention, ...) in {len(names)} launches: "
                     f"{names[:8]}")


SUMMED = ("release", "run", "share", "lead", "spread", "tail", "busy_us", "busy_cycles", "att_publish_us",
          "att_slice_us", "att_store_us", "att_merge_us", "att_working")


def summarize(replays: list[list[dict]], layers: int, floors_us: dict | None = None) -> dict:
    """Per replay `boundaries` -> medians over layers and replays per layer position (LAYER) and for the launches
    outside the layers (the LM head), each with its floor (us) where `floors_us` has one, and the layer's sum."""
    names = [s["name"] for s in replays[0]]
    if any([s["name"] for s in r] != names for r in replays):
        raise ValueError("replays traced different launch sequences")
    off = layer_offset(names, layers)
    per_layer = {}
    for j, label in enumerate(LAYER):
        idx = [off + i * len(LAYER) + j for i in range(layers)]
        row = {"kernel": names[off + j], "programs": replays[0][off + j]["programs"],
               "sms": replays[0][off + j]["sms"]}
        for key in SUMMED:
            vals = [r[i][key] for r in replays for i in idx if key in r[i]]
            if vals:
                row[key] = round(_med(vals), 3)
        if floors_us and label in floors_us:
            row["floor_us"] = round(floors_us[label], 3)
        per_layer[label] = row
    inside = set(range(off, off + layers * len(LAYER)))
    outside = {}
    for i, name in enumerate(names):
        if i in inside:
            continue
        row = {"kernel": name, "programs": replays[0][i]["programs"]}
        for key in SUMMED:
            vals = [r[i][key] for r in replays if key in r[i]]
            if vals:
                row[key] = round(_med(vals), 3)
        if floors_us and "lm_head" in floors_us and i == len(names) - 1:
            row["floor_us"] = round(floors_us["lm_head"], 3)
        outside[f"{i}:{name}"] = row
    layer = {key: round(sum(per_layer[label].get(key, 0.0) for label in LAYER), 3)
             for key in ("release", "run", "share")}
    layer["floor_us"] = round(sum(per_layer[label].get("floor_us", 0.0) for label in LAYER), 3)
    span = _med([r[-1]["end_last"] - r[0]["start_first"] for r in replays])
    return {"launches": len(names), "offset": off, "per_layer": per_layer, "outside_layers": outside,
            "layer_sum": layer, "traced_span_us": round(span, 2)}


def timer_granularity_ns(replays_rows: list[list[list[int]]]) -> int:
    """The smallest positive step between distinct global-timer stamps of one replay (the timer's resolution, or
    finer when the stamps are dense) -> ns; 0 when there are fewer than two distinct stamps."""
    best = 0
    for rows in replays_rows:
        vals = sorted({r[FIELD[f]] for r in rows for f in ("start", "waited", "looped", "end")})
        steps = [b - a for a, b in zip(vals, vals[1:]) if b > a]
        if steps:
            best = min(steps) if not best else min(best, min(steps))
    return best


def sm_ghz(replays_rows: list[list[list[int]]]) -> float:
    """SM cycles per ns the stamps imply: median over programs busy >= 2 us of cycles / ns."""
    ratios = [(r[FIELD["clock_end"]] - r[FIELD["clock_waited"]]) / (r[FIELD["end"]] - r[FIELD["waited"]])
              for rows in replays_rows for r in rows if r[FIELD["end"]] - r[FIELD["waited"]] >= 2000]
    return round(_med(ratios), 3) if ratios else float("nan")


def _floors_us(cfg, bytes_per_s: float) -> dict:
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    b = {"qkv": (nq + 2 * nkv) * h * 2, "attention": 2 * nkv * CONTEXT * 2, "o_proj": nq * h * 2,
         "gate_up": 2 * cfg.intermediate_size * h * 2, "down": cfg.intermediate_size * h * 2,
         "lm_head": cfg.vocab_size * h * 2}
    return {k: v / bytes_per_s * 1e6 for k, v in b.items()}


def measure(name: str, fields: dict, replays: int) -> dict:
    import torch

    from specpilot.config import EngineConfig
    from specpilot.costmodel import load_or_measure, synthetic_config
    from specpilot.costmodel.hardware import time_median_s
    from specpilot.engine import _apply_layout
    from specpilot.engine.runner import ModelRunner
    from specpilot.kernels import trace
    from specpilot.models import random_model

    hw = load_or_measure("cuda")
    cfg = synthetic_config(name)
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", **fields)
    model = random_model(cfg)
    _apply_layout(model, ecfg)
    model.eval()
    prompt = torch.randint(0, cfg.vocab_size, (CONTEXT,), device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (1,), device="cuda")
    out = {"config": fields, "hbm_tb_s": round(hw.hbm_bytes_per_s / 1e12, 3)}
    with torch.no_grad():
        runner = ModelRunner(model, model.new_cache(1, POOL), buckets=(1,), cuda_graphs=True)  # tunes, untraced
        runner.prefill(prompt, 0)
        out["step_ms"] = round(time_median_s(lambda: runner.step(ids, CONTEXT), warmup=5, repeats=100) * 1e3, 4)
        del runner
        torch.cuda.empty_cache()
        trace.enable("cuda")
        try:
            runner = ModelRunner(model, model.new_cache(1, POOL), buckets=(1,), cuda_graphs=True)  # captured traced
        finally:
            trace.disable()
        runner.prefill(prompt, 0)
        out["step_traced_ms"] = round(time_median_s(lambda: runner.step(ids, CONTEXT), warmup=5, repeats=100)
                                      * 1e3, 4)
        per_replay = []
        for _ in range(replays):
            trace.clear()
            torch.cuda.synchronize()
            runner.step(ids, CONTEXT)
            torch.cuda.synchronize()
            per_replay.append(trace.read())
    if not per_replay[0]:
        return {**out, "error": "no traced launch wrote a row (is the fused one-token path on?)"}
    rows = [[r for launch in rep for r in launch["rows"]] for rep in per_replay]
    out["timer_granularity_ns"] = timer_granularity_ns(rows)
    out["sm_ghz"] = sm_ghz(rows)
    try:
        out.update(summarize([boundaries(rep) for rep in per_replay], cfg.num_hidden_layers,
                             _floors_us(cfg, hw.hbm_bytes_per_s)))
    except ValueError as e:
        out["error"] = str(e)
        out["names"] = [launch["name"] for launch in per_replay[0]][:12]
    return out


def parse(argv: list[str]) -> tuple[list[str], dict, int]:
    """-> (shapes, EngineConfig fields, replays); SystemExit(2) with a message on a bad argument."""
    shapes, fields, replays = [], {}, 5
    for a in argv:
        if a.startswith("--replays="):
            replays = int(a.split("=", 1)[1])
            if replays < 1:
                raise SystemExit("gpu_step_trace.py: --replays must be >= 1")
        elif a.startswith("--config="):
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from gpu_step_timing import configs  # the same field=value parsing and checks

            fields = configs([f"--config=c:{a.split('=', 1)[1]}"])[0][1]
        elif a.startswith("-"):
            raise SystemExit(f"gpu_step_trace.py: unexpected argument {a!r} (see --help)")
        else:
            shapes.append(a)
    return shapes or ["qwen2.5-1.5b", "qwen3-8b"], fields, replays


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    try:
        shapes, fields, replays = parse(argv)
    except ValueError as e:
        print(f"gpu_step_trace.py: {e}", file=sys.stderr)
        return 2
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_step_kernels import print_shape  # the same human lines

    if not torch.cuda.is_available():
        print("gpu_step_trace.py needs CUDA", file=sys.stderr)
        return 2
    res = {}
    for name in shapes:
        res[name] = measure(name, fields, replays)
        print_shape(name, res[name], ("step_ms", "step_traced_ms", "traced_span_us", "timer_granularity_ns",
                                      "sm_ghz", "layer_sum", "error"))
        torch.cuda.empty_cache()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
