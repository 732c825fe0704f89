#!/usr/bin/env python
"""Where a small-AR-drafter speculative step's time goes, at real shapes with random weights (bf16, CUDA).

Why: on the H200 (BENCHMARKS.md, session 11) the Qwen2.5-Coder-0.5B drafter's stage took 27.96 ms for its 4
passes (7 ms a pass) while a graphed 0.5B pass should cost ~2 ms. After a 512-token prompt this separates:
(1) the drafter runner's graphed 1- and 2-token steps, GPU time; (2) `SmallARDrafter.propose(ids, 4)` after a
fully accepted step (2 catch-up tokens, as at tau ~4.85): wall time, host-busy time (no final sync) and CUDA-event
span (what the engine's StageTimer sees); (3) a torch.profiler trace of propose(): kernels per call, top kernels;
(4) the engine's stage split and how each runner's steps ran (graphed / eager bucket / no bucket), with the
drafter's own weights as target (every draft accepted) and with a 1.5B random target (every draft rejected).

Run: python3 scripts/gpu_model_draft_step.py   (`--cpu-smoke`: tiny shapes on the CPU, no graphs, as its test
runs it; `--fused-decode`: the drafter's and target's one-token passes through models/fused_decode.py). Last stdout line: one JSON object, figures in ms.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_dflash_step import attempt, median_ms, profile_propose  # noqa: E402  (sibling script: shared timers)

from specpilot.config import EngineConfig  # noqa: E402
from specpilot.costmodel import synthetic_config  # noqa: E402
from specpilot.engine import Engine, _apply_layout, build_drafter  # noqa: E402
from specpilot.models import ModelConfig, random_model  # noqa: E402

REAL = dict(prompt=512, pool=2048, repeats=50, warmup=5, calls=20, new_tokens=64, dtype=torch.bfloat16)
SMOKE = dict(prompt=48, pool=256, repeats=3, warmup=1, calls=2, new_tokens=8, dtype=torch.float32)
K = 4


def configs(smoke: bool) -> tuple[ModelConfig, ModelConfig]:
    """(drafter, target) shapes: Qwen2.5-0.5B and -1.5B, or tiny ones for the CPU smoke run."""
    if not smoke:
        return synthetic_config("qwen2.5-0.5b"), synthetic_config("qwen2.5-1.5b")
    tiny = dict(model_type="qwen2", vocab_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                attention_bias=True, tie_word_embeddings=True)
    return (ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, **tiny),
            ModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, **tiny))


@torch.inference_mode()
def main(smoke: bool, fused: bool = False) -> int:
    if not smoke and not torch.cuda.is_available():
        print("gpu_model_draft_step.py needs CUDA (use --cpu-smoke to check it on the CPU)", file=sys.stderr)
        return 2
    device, p = torch.device("cpu" if smoke else "cuda"), SMOKE if smoke else REAL
    dcfg, tcfg = configs(smoke)
    ecfg = EngineConfig(drafter_kind="model", num_draft_tokens=K, max_new_tokens=p["new_tokens"], max_seq_len=p["pool"],
                        ignore_eos=True, device=str(device), cuda_graphs=not smoke, ngram_assist=0,
                        fused_decode=fused)
    small = random_model(dcfg, dtype=p["dtype"], device=device, seed=1)
    _apply_layout(small, ecfg)  # what build_drafter does to a drafter it loads by name
    drafter = build_drafter(ecfg, small, small)
    runner = drafter.runner
    out = {"device": torch.cuda.get_device_name() if not smoke else "cpu", "smoke": smoke, "fused_decode": fused,
           "prompt": p["prompt"],
           "graphs": sorted(T for T, g in runner.graphs.items() if g[0] is not None)}
    print("drafter buckets captured:", out["graphs"])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dcfg.vocab_size - 1, (p["prompt"],), generator=gen).tolist()
    drafter.propose(ids, K)  # the first step: the drafter's own prefill over the prompt (eager)
    tok = torch.tensor([ids[-1]], device=device)
    for T in (1, 2):
        block = tok.repeat(T)
        attempt(out, f"step{T}_gpu_ms", lambda block=block: median_ms(lambda: runner.step(block, len(ids)), device, p,
                                                                       "gpu"))
    last = {"draft": drafter.propose(ids, K).token_ids}

    def prep():  # a fully accepted step: the K drafts and a bonus token join the context (2 tokens to catch up)
        ids.extend(last["draft"].tolist() + [ids[-1]])
        if len(ids) + 2 * K + 2 > p["pool"]:
            del ids[p["prompt"]:]
            drafter.reset()
            drafter.propose(ids, K)

    def propose():
        last["draft"] = drafter.propose(ids, K).token_ids
        return last["draft"]

    attempt(out, "propose_wall_ms", lambda: median_ms(propose, device, p, "wall", prep))
    attempt(out, "propose_host_ms", lambda: median_ms(propose, device, p, "host", prep))
    attempt(out, "propose_event_ms", lambda: median_ms(propose, device, p, "gpu", prep))
    attempt(out, "profile", lambda: profile_propose(lambda: (prep(), propose()), device, p["calls"]))

    def engine(target):
        def run():  # the engine's StageTimer split per step (the mean includes the drafter's prefill step)
            e = Engine(target, ecfg, drafter)
            for _ in range(2):  # the first run warms up
                res = e.generate(ids[: p["prompt"]])
            stages = {k: round(v * 1e3 / len(res.accepted_lengths), 4) for k, v in res.stage_s.items()}
            return {"stage_ms_per_step": stages, "tau": round(res.num_output_tokens / res.num_target_forwards, 3),
                    "steps_run": {"target": e.runner.step_counts, "drafter": dict(runner.step_counts)}}
        return run

    attempt(out, "engine_self_target", engine(small))  # every draft accepted: 2-token catch-ups
    big = random_model(tcfg, dtype=p["dtype"], device=device, seed=2)
    _apply_layout(big, ecfg)
    attempt(out, "engine_other_target", engine(big))  # every draft rejected: 1-token catch-ups
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main("--cpu-smoke" in sys.argv[1:], "--fused-decode" in sys.argv[1:]))
