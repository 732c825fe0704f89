#!/usr/bin/env python
"""A prompt's prefill, eager vs replayed from its padded length's CUDA graph (EngineConfig.prefill_graphs).

Why: session 21's H200 bench measured 16-18 ms of prefill for every prompt of 51-215 tokens on the real 1.5B
(launch-bound: the same for 64 and 256 padded tokens), 7-25% of a prompt's time at our decode speeds; the graphs
are meant to take that to the pass's own device time. This times `ModelRunner.prefill` as the engine's clock does
(a sync before and after, wall time), median of repeats after the first call of each length (which captures), at
random weights and real shapes laid out as the engine lays out a target (EngineConfig defaults).

Run: python3 scripts/gpu_prefill_timing.py [qwen2.5-1.5b qwen2.5-0.5b qwen3-8b ...] [--lengths=51,150,215,600]
(`--cpu-smoke`: tiny shapes on the CPU, the graphs' static twin). Last stdout line: one JSON object, ms.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

import torch

from specpilot.config import EngineConfig
from specpilot.costmodel import synthetic_config
from specpilot.engine import _apply_layout
from specpilot.engine.runner import ModelRunner
from specpilot.models import random_model

POOL, REPEATS = 4096, 20


def _wall_ms(fn, device, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(samples), 3)


@torch.inference_mode()
def main(shapes: list[str], lengths: tuple[int, ...], smoke: bool) -> int:
    device = torch.device("cpu" if smoke else "cuda")
    out = {"device": "cpu" if smoke else torch.cuda.get_device_name(), "shapes": {}}
    for name in shapes:
        cfg = synthetic_config(name)
        if smoke:
            cfg = dataclasses.replace(cfg, num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
        model = random_model(cfg, dtype=torch.float32 if smoke else torch.bfloat16, device=device, seed=0)
        _apply_layout(model, EngineConfig(device=str(device), dtype="float32" if smoke else "bfloat16"))
        res = {}
        for graphs in (0, max(lengths) * 2):
            runner = ModelRunner(model, model.new_cache(1, POOL), cuda_graphs=not smoke, static=smoke,
                                 pad_shapes=True, prefill_graphs=graphs)
            for T in lengths:
                ids = torch.randint(0, cfg.vocab_size, (T,), device=device)
                t0 = time.perf_counter()
                runner.prefill(ids, 0)  # the first call of a length: graphs capture here
                first = (time.perf_counter() - t0) * 1e3
                ms = _wall_ms(lambda: runner.prefill(ids, 0), device, 2 if smoke else REPEATS)
                key = f"{'graphed' if graphs else 'eager'}_T{T}"
                res[key] = {"ms": ms, "first_call_ms": round(first, 1)}
                print(name, key, res[key], flush=True)
            del runner
        for T in lengths:
            res[f"speedup_T{T}"] = round(res[f"eager_T{T}"]["ms"] / max(res[f"graphed_T{T}"]["ms"], 1e-9), 2)
        out["shapes"][name] = res
    print(json.dumps(out))
    return 0


def parse_args(argv: list[str]) -> tuple[list[str], tuple[int, ...], bool]:
    """-> (shapes, lengths, smoke); bad input exits 2 with a message."""
    if "--help" in argv:
        print(__doc__)
        sys.exit(0)
    lengths = (51, 150, 215, 600)
    shapes = []
    for a in argv:
        if a.startswith("--lengths="):
            try:
                lengths = tuple(int(x) for x in a.split("=", 1)[1].split(","))
            except ValueError:
                lengths = ()
            if not lengths or min(lengths) < 2 or max(lengths) > POOL // 2:
                print(f"--lengths: comma-separated prompt lengths in [2, {POOL // 2}], got {a}", file=sys.stderr)
                sys.exit(2)
        elif a == "--cpu-smoke":
            continue
        elif a.startswith("--"):
            print(f"unknown option {a} (see --help)", file=sys.stderr)
            sys.exit(2)
        else:
            shapes.append(a)
    return shapes or ["qwen2.5-1.5b", "qwen2.5-0.5b", "qwen3-8b"], lengths, "--cpu-smoke" in argv


if __name__ == "__main__":
    shapes, lengths, smoke = parse_args(sys.argv[1:])
    if not smoke and not torch.cuda.is_available():
        print("gpu_prefill_timing.py needs CUDA (use --cpu-smoke to check it on the CPU)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(shapes, lengths, smoke))
