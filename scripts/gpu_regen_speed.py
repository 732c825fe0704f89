#!/usr/bin/env python
"""Batched regeneration throughput (engine/batch.py `generate_batch`, as train-drafter's regeneration runs it) with
random weights at a real shape, per decode-step variant: the graphed step over the whole KV pool (`pool`, the old
step: kv_bucket=0) against steps over a bucketed prefix of the pool (`bucket128`, `bucket256`: one graph per
(rows, bucket)), each with masked SDPA or, suffixed `_attnkernel`, the split-KV attention kernel
(`use_attention_kernel`, which skips the slices above each row's position by itself).

Each variant is one `generate_batch` call over `--chunks` batches of `--batch` prompts of ~`--prompt-len` random
tokens, `--new-tokens` each, no EOS (every row runs to the end). A batch's wall time is taken at its `on_batch`
callback (the step loop has already synchronised on its last tokens); the first batch includes the CUDA-graph
captures, so tokens/s is the median over the later ones (new tokens only, prefill included in the time).
`--cpu-smoke`: tiny shapes, eager, on the CPU (the tests run it). Last stdout line: one JSON object.

  python3 scripts/gpu_regen_speed.py                      # Qwen2.5-1.5B shape, B 256, ~300 + 256 tokens
  python3 scripts/gpu_regen_speed.py --variants=pool,bucket128 --chunks=3
  python3 scripts/gpu_regen_speed.py --variants=bucket128 --chunks=2 --profile   # + where a step's time goes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specpilot.costmodel import synthetic_config
from specpilot.engine.batch import generate_batch
from specpilot.models import random_model

VARIANTS = {"pool": (0, False), "bucket128": (128, False), "bucket256": (256, False),
            "pool_attnkernel": (0, True), "bucket128_attnkernel": (128, True)}  # name -> (kv_bucket, kernel)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b", help="a costmodel synthetic shape")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=300, help="prompts of prompt-len +- 10%% random tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4, help="batches per call: the first one warms up (captures)")
    ap.add_argument("--variants", default="pool,bucket128,bucket256,pool_attnkernel,bucket128_attnkernel",
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, eager, CPU")
    ap.add_argument("--profile", action="store_true",
                    help="then the first variant that ran once more over 2 batches, the second under torch.profiler: "
                         "its kernels by device time per step, against the step's wall time (where a step goes)")
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or args.chunks < 1:
        ap.error(f"unknown variants {bad}" if bad else "--chunks must be >= 1")
    return args


def _model(args):
    if args.cpu_smoke:
        from specpilot.models.config import ModelConfig

        cfg = ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          attention_bias=True)
        return random_model(cfg, dtype=torch.float32, device="cpu")
    return random_model(synthetic_config(args.model))


def run_variant(model, prompts, args, kv_bucket: int, kernel: bool) -> dict:
    model.use_attention_kernel(kernel)
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not args.cpu_smoke else (lambda: None)
    sync()
    stamps = [time.perf_counter()]
    outs = generate_batch(model, prompts, args.new_tokens, (), args.batch, sort_by_length=False, kv_bucket=kv_bucket,
                   on_batch=lambda idx, outs: (sync(), stamps.append(time.perf_counter())))
    chunk_s = [b - a for a, b in zip(stamps, stamps[1:])]
    timed = chunk_s[1:] or chunk_s
    med = statistics.median(timed)
    return {"kv_bucket": kv_bucket, "attention_kernel": kernel, "tok_s": round(args.batch * args.new_tokens / med),
            "ms_per_step": round(med / args.new_tokens * 1e3, 3), "chunk_s": [round(s, 3) for s in chunk_s],
            "outputs": outs}


def profile_variant(model, prompts, args, kv_bucket: int, kernel: bool, top: int = 12) -> dict:
    """One generate_batch call over two batches, the second traced (the first captures the graphs): the top kernels
    by their own device time (CPU: op time) per decode step, their sum, and the traced batch's wall time per step
    (tracing adds to it: compare the sum with the untraced variant's ms_per_step too). A sum well under the step's
    time says the step waits on the host (the per-step sync and the row bookkeeping)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    on_gpu = torch.cuda.is_available() and not args.cpu_smoke
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    model.use_attention_kernel(kernel)
    stamps = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts, schedule=schedule(wait=1, warmup=0, active=1)) as prof:
        def step(idx, outs):
            sync()
            stamps.append(time.perf_counter())
            prof.step()
        sync()
        stamps.append(time.perf_counter())
        generate_batch(model, prompts[: 2 * args.batch], args.new_tokens, (), args.batch, sort_by_length=False,
                       kv_bucket=kv_bucket, on_batch=step)
    field = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    rows = [(e.key, getattr(e, field, 0.0) or 0.0) for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    per_step = lambda us: round(us / args.new_tokens, 2)  # noqa: E731
    return {"variant_kv_bucket": kv_bucket, "attention_kernel": kernel, "time": "device" if on_gpu else "cpu op",
            "traced_wall_us_per_step": round((stamps[-1] - stamps[-2]) / args.new_tokens * 1e6, 1),  # (+ tracing)
            "traced_us_per_step": per_step(sum(us for _, us in rows)),
            "top": [[name[:80], per_step(us)] for name, us in rows[:top]]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        args.batch, args.prompt_len, args.new_tokens, args.chunks = 4, 12, 8, 2
        args.variants = [v for v in args.variants if not v.endswith("_attnkernel")]  # Triton: GPU only
    model = _model(args)
    g = torch.Generator().manual_seed(0)
    lo, hi = max(1, int(args.prompt_len * 0.9)), int(args.prompt_len * 1.1) + 1
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.batch * args.chunks)]
    out = {"model": "cpu-smoke" if args.cpu_smoke else args.model, "batch": args.batch, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "chunks": args.chunks, "variants": {}}
    ref = None
    print(f"{'variant':<24}{'tok/s':>10}{'ms/step':>10}  batch seconds (first: captures)")
    for name in args.variants:
        kv_bucket, kernel = VARIANTS[name]
        try:
            r = run_variant(model, prompts, args, kv_bucket, kernel)
        except Exception as e:  # one variant failing must not lose the others' figures
            r = {"error": f"{type(e).__name__}: {e}"[:300]}
        outs = r.pop("outputs", None)
        ref = outs if ref is None else ref  # the first variant that ran: the others' tokens compared with it
        if outs is not None:  # bf16 batched kernels: equal up to float reassociation (and near-ties)
            r["rows_equal_to_first"] = round(sum(a == b for a, b in zip(outs, ref)) / len(ref), 3)
        out["variants"][name] = r
        print(f"{name:<24}{r.get('tok_s', '-'):>10}{r.get('ms_per_step', '-'):>10}  {r.get('chunk_s', r.get('error'))}",
              flush=True)
    ran = [n for n in args.variants if "tok_s" in out["variants"][n]]
    if args.profile and ran:
        try:
            out["profile"] = {"variant": ran[0], "untraced_us_per_step": out["variants"][ran[0]]["ms_per_step"] * 1e3,
                              **profile_variant(model, prompts, args, *VARIANTS[ran[0]])}
            print(f"profile of {ran[0]}: {out['profile']}", flush=True)
        except Exception as e:  # the timings above must still come out
            out["profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    base = out["variants"].get("pool", {}).get("tok_s")
    out["speedup_vs_pool"] = {k: round(v["tok_s"] / base, 3) for k, v in out["variants"].items()
                              if base and "tok_s" in v}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
