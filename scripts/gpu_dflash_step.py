#!/usr/bin/env python
"""Where a DFlash speculative step's time goes, at real shapes with random weights (bf16, CUDA).

Why: on the H200 a step of Qwen2.5-Coder-1.5B + a 2-layer DFlash drafter took verify 3.87 ms and draft 1.96 ms
(StageTimer), though the drafter is tiny and its static step is one CUDA graph. After a 512-token prompt this
separates the graph's GPU work from host work in `DFlashBlockDrafter.propose()`: (1) draft graph replay, GPU time;
(2) eager `_static_step()`, GPU and wall time; (3) `propose(ids, 15)` with 3 pending feature rows: wall time,
host-busy time (no final sync) and CUDA-event span (what StageTimer sees); (4) the target's graphed 16-token verify
with feature capture, attention kernel off and on; (4b) the draft graph with the drafter's attention on SDPA and on
the split-KV kernel (`DFlashDrafter.use_attention_kernel`), and how many drafts agree; (5) a torch.profiler trace of
20 propose() calls: top kernels, kernels per call; (6) the engine's own stage split. Medians of 50 after warm-up;
a failing measurement prints its traceback to stderr and the rest still run.

Run: python3 scripts/gpu_dflash_step.py   (`--cpu-smoke`: tiny shapes on the CPU, perf_counter timing, no graphs,
as its test runs it). Last stdout line: one JSON object, figures in ms.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
import traceback

import torch

from specpilot.config import EngineConfig
from specpilot.costmodel import synthetic_config
from specpilot.drafters.dflash import DFlashBlockDrafter
from specpilot.engine import Engine
from specpilot.engine.runner import ModelRunner
from specpilot.models import ModelConfig, random_model
from specpilot.models.dense import rope_inv_freq
from specpilot.models.dflash import DFlashConfig, DFlashDrafter

REAL = dict(prompt=512, pool=4096, repeats=50, warmup=5, calls=20, new_tokens=64, dtype=torch.bfloat16)
SMOKE = dict(prompt=48, pool=256, repeats=3, warmup=1, calls=2, new_tokens=8, dtype=torch.float32)
NEW_ROWS = 3  # feature rows pending per propose: a step that accepted 2 drafts (tau ~ 3)


def configs(smoke: bool) -> tuple[ModelConfig, DFlashConfig]:
    if not smoke:
        return synthetic_config("qwen2.5-1.5b"), DFlashConfig(
            hidden_size=1536, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=12,
            num_key_value_heads=2, head_dim=128, block_size=16, mask_token_id=151662, target_layer_ids=(1, 13, 25),
            num_target_layers=28, vocab_size=151936)
    return ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                       tie_word_embeddings=True), DFlashConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, block_size=16, mask_token_id=127, target_layer_ids=(0, 1, 2), num_target_layers=4, vocab_size=128)


def median_ms(fn, device, p, mode="wall", prep=None) -> float:
    """mode: "gpu" CUDA-event span (perf_counter on CPU), "wall" host time incl. a final sync, "host" without it.
    `prep()` runs untimed before each call; every call starts with an idle device."""
    events = mode == "gpu" and device.type == "cuda"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples = []
    for _ in range(p["warmup"] + p["repeats"]):
        if prep:
            prep()
        sync()
        a, b = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if events else (None, None)
        t0 = time.perf_counter()
        if events:
            a.record()
        fn()
        if events:
            b.record()
        elif mode != "host":
            sync()
        dt = (time.perf_counter() - t0) * 1e3
        sync()
        samples.append(a.elapsed_time(b) if events else dt)
    return round(statistics.median(samples[p["warmup"]:]), 4)


def attempt(out: dict, key: str, fn) -> None:
    try:
        out[key] = fn()
        print(f"{key:32s} {out[key]}", flush=True)
    except Exception:  # a diagnostic: report the failure, keep measuring the rest
        traceback.print_exc()
        out[key] = None


def profile_propose(step, device, calls: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"  # kernels incl. memcpy/memset; the CPU smoke run counts (nested) aten ops instead
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize()
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == kind:
            s = by_name.setdefault(e.name, [0.0, 0])
            s[0], s[1] = s[0] + e.time_range.elapsed_us() / 1e3, s[1] + 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    for name, (ms, n) in top:
        print(f"  {ms / calls:8.4f} ms/call {n // calls:4d}x/call  {name[:100]}")
    return {"kernels_per_propose": sum(n for _, n in by_name.values()) / calls,
            "top": [[name[:100], round(ms / calls, 4), n / calls] for name, (ms, n) in top]}


@torch.inference_mode()
def main(smoke: bool) -> int:
    if not smoke and not torch.cuda.is_available():
        print("gpu_dflash_step.py needs CUDA (use --cpu-smoke to check it on the CPU)", file=sys.stderr)
        return 2
    device, p = torch.device("cpu" if smoke else "cuda"), SMOKE if smoke else REAL
    cfg, dcfg = configs(smoke)
    B = dcfg.block_size
    target = random_model(cfg, dtype=p["dtype"], device=device)
    target.fuse_projections()
    torch.manual_seed(0)
    with torch.device(device):
        network = DFlashDrafter(dcfg).to(p["dtype"]).eval()
    network.inv_freq = rope_inv_freq(dcfg).to(device)
    drafter = DFlashBlockDrafter(network, target, max_seq_len=p["pool"], static=True, cuda_graphs=not smoke)
    out = {"device": torch.cuda.get_device_name() if not smoke else "cpu", "smoke": smoke, "prompt": p["prompt"],
           "draft_graph_captured": drafter.graph is not None}
    print("draft graph captured:", out["draft_graph_captured"])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size - 1, (p["prompt"],), generator=gen).tolist()
    block = torch.randint(0, cfg.vocab_size - 1, (B,), generator=gen).to(device)
    runners, prompt_feats = {}, {}
    for kernel in (False, True) if not smoke else (False,):  # Triton attention kernel (CUDA only) on last: the
        def verify(kernel=kernel):  # engine's default, which the drafter and engine measurements below then use
            if not smoke:
                target.use_attention_kernel(kernel)
            r = ModelRunner(target, target.new_cache(1, p["pool"]), buckets=(1, B), cuda_graphs=not smoke,
                            capture_layers=drafter.target_layers, feature_fn=drafter.features)
            r.prefill(torch.tensor(ids[:-1], device=device), 0)
            runners[kernel], prompt_feats[kernel] = r, r.last_hidden  # prefill is eager: a fresh [prompt - 1, 3H]
            return median_ms(lambda: r.step(block, p["prompt"] - 1), device, p, "gpu")

        attempt(out, f"verify16_{'attnkernel' if kernel else 'sdpa'}_gpu_ms", verify)
    if not runners:
        print(json.dumps(out))
        return 1
    kernel = max(runners)  # the last variant that worked
    drafter.observe(prompt_feats[kernel])
    drafter.propose(ids, B - 1)  # the first step: eager, over the whole prompt
    runners[kernel].step(block, p["prompt"] - 1)
    feats = runners[kernel].last_hidden  # [16, 3H] static feature rows, sliced as the engine slices them
    new_ids = block[:NEW_ROWS].tolist()

    def prep():  # what a step with NEW_ROWS committed tokens hands over before the next propose
        drafter.observe(feats[:NEW_ROWS])
        ids.extend(new_ids)

    def propose():
        return drafter.propose(ids, B - 1)

    if drafter.graph is not None:
        attempt(out, "graph_replay_gpu_ms", lambda: median_ms(drafter.graph.replay, device, p, "gpu"))

        def draft_kernel():  # the drafter's attention on SDPA vs the split-KV kernel (the engine's CUDA default):
            res, drafts = {}, {}  # fresh drafters fed the prompt, then one static step (the graph's positions real)
            for on in (False, True):
                d = DFlashBlockDrafter(copy.deepcopy(network).use_attention_kernel(on), target, max_seq_len=p["pool"],
                                       static=True, cuda_graphs=True)
                d.observe(prompt_feats[kernel])
                d.propose(ids, B - 1)
                d.observe(feats[:NEW_ROWS])
                name = "kernel" if on else "sdpa"
                drafts[name] = d.propose(ids + new_ids, B - 1).token_ids.tolist()
                res[f"draft_graph_{name}_gpu_ms"] = median_ms(d.graph.replay, device, p, "gpu")
            res["draft_tokens_agree"] = sum(a == b for a, b in zip(drafts["sdpa"], drafts["kernel"])) / (B - 1)
            return res

        attempt(out, "draft_attention_kernel", draft_kernel)
    attempt(out, "static_step_eager_gpu_ms", lambda: median_ms(drafter._static_step, device, p, "gpu"))
    attempt(out, "static_step_eager_wall_ms", lambda: median_ms(drafter._static_step, device, p, "wall"))
    attempt(out, "propose_wall_ms", lambda: median_ms(propose, device, p, "wall", prep))
    attempt(out, "propose_host_ms", lambda: median_ms(propose, device, p, "host", prep))
    attempt(out, "propose_event_ms", lambda: median_ms(propose, device, p, "gpu", prep))
    attempt(out, "profile", lambda: profile_propose(lambda: (prep(), propose()), device, p["calls"]))

    def engine_stages():  # the engine's StageTimer split per step (random weights: ~1 token a step; the mean
        # includes the first, eager draft over the prompt)
        ecfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=B - 1, max_new_tokens=p["new_tokens"],
                            max_seq_len=p["pool"], ignore_eos=True, device=str(device), cuda_graphs=not smoke)
        engine = Engine(target, ecfg, drafter)
        for _ in range(2):  # the first run warms up
            res = engine.generate(ids[: p["prompt"]])
        return {k: round(v * 1e3 / len(res.accepted_lengths), 4) for k, v in res.stage_s.items()}

    attempt(out, "engine_stage_ms_per_step", engine_stages)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main("--cpu-smoke" in sys.argv[1:]))
