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

`--real DRAFTER TARGET` (model folders; session 20): the real Qwen2.5-Coder pair as `specpilot profile` runs it
(engine defaults, a HumanEval prompt), then with one switch changed at a time (VARIANTS: prompt lookup off, fused
verify off, padded shapes off, CUDA graphs off, the K - 1 passes chained in one graph). Session 20's profile
measured 11.6 ms of draft stage a step (K = 4) with 8.9 ms of it host wall inside propose(), against 3.8 ms for
the random-weight drafter here: this prints the drafter's layout (is its one-token pass the fused one?), its
graphed 1-, 2- and K+1-token steps and the target's verify step alone, each pass on the device (and per kind of pass:
session 21 found the catch-up passes ~2 ms against ~0.8 for the others), propose()'s host wall, the stage split, and a torch.profiler
view of one generation: the host calls that take the time (a cudaStreamSynchronize per pass would show here) and
the top kernels. `--cpu-smoke --real D T` runs the same on the CPU (tests: a real small model as its own drafter).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_dflash_step import attempt, median_ms, profile_propose  # noqa: E402  (sibling script: shared timers)

from specpilot.config import EngineConfig  # noqa: E402
from specpilot.drafters.timing import ProposeTimer  # noqa: E402
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


def _by_tokens_ms(by_pass: dict) -> dict:
    """ProposeTimer's per-kind pass times -> {tokens fed: [mean device ms, passes]}."""
    return {k: [round(v["mean_s"] * 1e3, 4), v["count"]] for k, v in by_pass.items()}


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
            e.generate(ids[: p["prompt"]])  # warm-up
            timer = ProposeTimer(drafter)  # the passes' device time by tokens fed (CUDA events)
            try:
                res = e.generate(ids[: p["prompt"]])
                by = timer.per_step(len(res.accepted_lengths))["by_pass"]
            finally:
                drafter.propose, drafter.graph_events, drafter.graph_event_labels = timer._propose, None, []
            stages = {k: round(v * 1e3 / len(res.accepted_lengths), 4) for k, v in res.stage_s.items()}
            return {"stage_ms_per_step": stages, "tau": round(res.num_output_tokens / res.num_target_forwards, 3),
                    "pass_device_ms_by_tokens": _by_tokens_ms(by),
                    "steps_run": {"target": e.runner.step_counts, "drafter": dict(runner.step_counts)}}
        return run

    attempt(out, "engine_self_target", engine(small))  # every draft accepted: 2-token catch-ups
    big = random_model(tcfg, dtype=p["dtype"], device=device, seed=2)
    _apply_layout(big, ecfg)
    attempt(out, "engine_other_target", engine(big))  # every draft rejected: 1-token catch-ups
    print(json.dumps(out))
    return 0


# the engine as `specpilot profile` runs it, then one switch changed at a time: which one removes the slow draft stage
VARIANTS = (("default", {}), ("no_assist", {"ngram_assist": 0}), ("no_fused_verify", {"fused_verify": False}),
            ("no_pad_shapes", {"pad_shapes": False}), ("no_graphs", {"cuda_graphs": False}),
            ("chain_graph", {"draft_chain_graph": True}))
PROFILED = ("default", "no_assist")  # these two also under torch.profiler


def _host_view(prof, top: int = 12) -> dict:
    """A profiler's CPU-side view: the calls with the most self time (CUDA runtime calls included), and how often
    the ones that block the host or launch work ran."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    watch = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
             "cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "aten::item", "aten::_local_scalar_dense")
    counts = {e.key: e.count for e in prof.key_averages() if e.key in watch}
    return {"top_self_cpu_us": [[e.key[:60], e.count, round(e.self_cpu_time_total)] for e in rows[:top]],
            "counts": counts}


@torch.inference_mode()
def real(drafter_dir: str, target_dir: str, smoke: bool) -> int:
    from torch.profiler import ProfilerActivity, profile

    from specpilot.evaluator import datasets
    from specpilot.models import load_model
    from specpilot.tokenizer import Tokenizer

    if not smoke and not torch.cuda.is_available():
        print("gpu_model_draft_step.py --real needs CUDA (with --cpu-smoke it runs on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    base = EngineConfig(drafter_kind="model", num_draft_tokens=K, max_new_tokens=16 if smoke else 128,
                        max_seq_len=512 if smoke else 2048, device=str(device),
                        dtype="float32" if smoke else "bfloat16")
    target = load_model(target_dir, dtype=REAL["dtype"] if not smoke else torch.float32, device=device)
    _apply_layout(target, base)
    tok = Tokenizer.from_folder(target_dir)
    if smoke:
        ids = tok.encode("def add(a, b):\n    return a + b\n\ndef mul(a, b):")
    else:
        ids = tok.encode_chat(datasets.load_prompts("humaneval", num_prompts=1)[0].messages)
    out = {"device": torch.cuda.get_device_name() if not smoke else "cpu", "smoke": smoke, "prompt": len(ids)}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not smoke else [])
    for name, change in VARIANTS:
        cfg = base.with_(**change)
        drafter = build_drafter(cfg, drafter_dir, target)  # by path: laid out as build_drafter lays out any
        inner = getattr(drafter, "inner", drafter)
        model, runner = inner.runner.model, inner.runner
        r = {"layout": {f: bool(getattr(model, f, False))
                        for f in ("fused_decode", "fused_verify", "attention_kernel", "norm_epilogue")},
             "graphs": sorted(T for T, g in runner.graphs.items() if g[0] is not None)}
        e = Engine(target, cfg, drafter, tok)
        e.generate(ids)  # warm-up (captures nothing new: the runners captured at construction)
        timer = ProposeTimer(drafter)
        res = e.generate(ids)
        n = max(len(res.accepted_lengths), 1)
        timed = timer.per_step(n)  # (reads every CUDA event pair once)
        r.update(tau=round(res.tau, 3), tokens_per_s=round(res.tokens_per_s, 1),
                 stage_ms_per_step={k: round(v * 1e3 / n, 4) for k, v in res.stage_s.items()},
                 propose_wall_ms=round(timed["wall_s"] * 1e3, 4),
                 # each of the drafter's passes between CUDA events (drafters/small_ar.py graph_events; CUDA only)
                 pass_device_ms=None if (g := timed["graph_device_s"]) is None else round(g * 1e3, 4),
                 # the same per kind of pass (tokens fed, "chain"): is the catch-up pass the slow one?
                 pass_device_ms_by_tokens=_by_tokens_ms(timed["by_pass"]),
                 steps_run={"target": dict(e.runner.step_counts), "drafter": dict(runner.step_counts)})
        # each bucket's step alone on an idle device (session 21: in the loop a 2-token catch-up pass took ~2 ms
        # against ~0.8 for a one-token pass, while gpu_step_timing.py's fused 0.5B step at 2 tokens took 1.05):
        # the drafter's 1-, 2- and 5-token steps and the target's verify step over K + 1 tokens
        for T in (1, 2, K + 1):
            block = torch.tensor(ids[-T:], device=device)
            attempt(r, f"drafter_step{T}_device_ms", lambda block=block: median_ms(
                lambda: runner.step(block, len(ids)), device, REAL if not smoke else SMOKE, "gpu"))
        block = torch.tensor(ids[-(K + 1):], device=device)
        attempt(r, f"target_verify{K + 1}_device_ms", lambda: median_ms(
            lambda: e.runner.step_greedy_verdict(block, len(ids)), device, REAL if not smoke else SMOKE, "gpu"))
        if name in PROFILED:
            with profile(activities=acts) as prof:
                e.generate(ids)
                if not smoke:
                    torch.cuda.synchronize()
            r["host"] = _host_view(prof)
            if not smoke:
                kern = sorted((k for k in prof.key_averages() if k.self_device_time_total > 0),
                              key=lambda k: k.self_device_time_total, reverse=True)
                r["top_kernels_us"] = [[k.key[:60], k.count, round(k.self_device_time_total)] for k in kern[:10]]
        out[name] = r
        print(f"{name}: {json.dumps(r)[:1500]}", flush=True)
        del e, drafter, inner, model, runner
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--real" in argv:
        i = argv.index("--real")
        if len(argv) < i + 3:
            print("usage: gpu_model_draft_step.py --real DRAFTER_DIR TARGET_DIR [--cpu-smoke]", file=sys.stderr)
            sys.exit(2)
        sys.exit(real(argv[i + 1], argv[i + 2], "--cpu-smoke" in argv))
    sys.exit(main("--cpu-smoke" in argv, "--fused-decode" in argv))
