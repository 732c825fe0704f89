#!/usr/bin/env python
"""The one-launch decode step (kernels/megakernel.py) on the GPU: parity with the six-launch fused step, then its
graphed step time against that step and the bytes/bandwidth floor (issue 3's AR bars: <= 1.5x at the 1.5B shape,
<= 1.15x at Qwen3-8B's), at real shapes with random weights (bf16).

Per shape: a 512-token prefill into two 4096-slot caches; then STEPS teacher-forced one-token steps through the
fused path (engine defaults: fused_decode and its kernels) and through the megakernel, each on its own cache:
logits max |diff| (relative to the logits' max), argmax agreement, and the two caches' K/V written. Then the graphed
step time, median of 100 replays after warm-up: the fused path as scripts/gpu_step_timing.py times it
(ModelRunner.step, the engine's graph), the same step as a bare graph replay, and each megakernel variant (programs x warps x tile bytes x cap on the rows
of a chunk) as one graph of the counter reset + the launch. A variant whose compile or launch fails is reported and
skipped. Each variant also reports `phase_us`: program 0's global timer after each barrier in one step, the median
layer's qkv / attention / o_proj / gate_up / down phases and the LM head, in us. The grid barrier needs every program resident: run this under `timeout` (a grid that could not be
co-resident would spin forever; DecodeMegakernel refuses more programs than SMs).

Run: python3 scripts/gpu_megakernel.py [qwen2.5-1.5b qwen3-8b ...] [--steps=8]
       [--variants=P:W:TILE:CAP[:PF[:PRE[:ACC1D[:SPLIT[:ACQ[:PREKV]]]]]],...]   (P 0 = one per SM; PF: bytes of each
       program's gate rows and up rows warmed in L2 with its o_proj rows during the attention phase, default -1 =
       none; PRE 1: each GEMV phase's first tile loaded before its barrier; ACC1D 1: one-dimensional GEMV sums (room
       for wider tiles); SPLIT: the attention's key slice, default 128; ACQ 1: barriers polled with acquire loads;
       PREKV 1: a program's first attention slice loaded before the attention barrier; default variants: below)
(`--cpu-smoke`: the parity part only, on a tiny fp32 Qwen2-shaped model on the CPU, one program under
TRITON_INTERPRET=1.) Last stdout line: one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from specpilot.costmodel import forward_cost, load_or_measure, pass_floor_s, synthetic_config
from specpilot.costmodel.hardware import time_median_s
from specpilot.engine.graphs import capture
from specpilot.engine.runner import ModelRunner
from specpilot.kernels.megakernel import DecodeMegakernel
from specpilot.models import random_model

POOL, CONTEXT = 4096, 512
DEV = "cuda"
DEFAULT_VARIANTS = ("0:8:32768:128,0:8:32768:128:-1:1,0:8:65536:128:-1:1:1,0:8:98304:128:-1:1:1,"
                    "0:8:65536:128:-1:1:1:128:1,0:8:65536:128:-1:1:1:128:1:1,0:8:65536:128:-1:1:1:64:1:1,"
                    "0:16:65536:128:-1:1:1:128:1:1")
FIELDS = ("programs", "num_warps", "tile_bytes", "cap_n", "prefetch_gu", "preload", "acc_1d", "split_s",
          "acquire_poll", "preload_kv")
FLAGS = ("preload", "acc_1d", "acquire_poll", "preload_kv")


def _fused(model):
    """The engine's one-token path (EngineConfig defaults on CUDA): fused decode and its kernels."""
    model.use_attention_kernel(True).use_norm_kernel(True).use_rope_kernel(True)
    model.use_act_kernel(True).use_add_norm_kernel(True).use_fused_decode(True)
    return model


@torch.no_grad()
def prefilled(model, prompt):
    """A fresh POOL-slot cache holding the prompt [1, CONTEXT] (the regular path's prefill)."""
    cache = model.new_cache(1, POOL)
    model(prompt, torch.arange(CONTEXT, device=DEV)[None], cache, kv_len=CONTEXT)
    return cache


def _prompt(cfg):
    return torch.randint(0, cfg.vocab_size, (1, CONTEXT), device=DEV)


def parity(model, cfg, steps: int, variant: dict) -> dict:
    """Teacher-forced steps through both paths from the same prefilled state -> the worst differences."""
    prompt = _prompt(cfg)
    caches = [prefilled(model, prompt) for _ in range(2)]
    with torch.no_grad():
        mk = DecodeMegakernel(model, caches[1], **variant)
        tok = torch.randint(0, cfg.vocab_size, (1,), device=DEV)
        worst, agree = 0.0, 0
        for i in range(steps):
            pos = torch.tensor([CONTEXT + i], device=DEV)
            ref = model.logits(model(tok[None], pos[None], caches[0], kv_len=None))[0, 0]
            got = mk.step(tok, pos)
            worst = max(worst, ((ref - got).abs().max() / ref.abs().max()).item())
            agree += int(ref.argmax() == got.argmax())
            tok = ref.argmax().view(1)
        end = CONTEXT + steps
        kv = max((caches[0].k[..., :end, :] - caches[1].k[..., :end, :]).abs().max().item(),
                 (caches[0].v[..., :end, :] - caches[1].v[..., :end, :]).abs().max().item())
    out = {"steps": steps, "max_rel_logit_diff": round(worst, 6), "argmax_agree": agree, "kv_max_diff": kv,
           "barrier_count": int(mk.bar.item()), "expected_barriers": 5 * cfg.num_hidden_layers * mk.programs,
           "merge_counters_zero": bool((mk.cnt == 0).all().item())}
    if mk.compiled is not None:
        out.update(n_regs=getattr(mk.compiled, "n_regs", None), n_spills=getattr(mk.compiled, "n_spills", None))
    del mk
    return out


def fused_graph_ms(model, cfg) -> float:
    """The fused one-token step + LM head captured in one CUDA graph, median replay ms (static token/position)."""
    cache = prefilled(model, _prompt(cfg))
    with torch.no_grad():
        tok = torch.randint(0, cfg.vocab_size, (1, 1), device=DEV)
        pos = torch.tensor([[CONTEXT]], device=DEV)
        # warm-up (autotuning, allocations) on a side stream outside the capture, as the engine captures
        graph, _ = capture(lambda: model.logits(model(tok, pos, cache, kv_len=None)), warmup=3)
        ms = time_median_s(graph.replay, warmup=5, repeats=100) * 1e3
    del graph, cache
    torch.cuda.empty_cache()
    return ms


def time_variant(model, cfg, variant: dict) -> dict:
    cache = prefilled(model, _prompt(cfg))
    with torch.no_grad():
        t0 = time.time()
        mk = DecodeMegakernel(model, cache, **variant)
        tok = torch.randint(0, cfg.vocab_size, (1,), device=DEV)
        pos = torch.tensor([CONTEXT], device=DEV)
        for _ in range(3):  # compile and warm up outside the capture
            mk.step(tok, pos)
        torch.cuda.synchronize()
        setup = time.time() - t0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mk.step(tok, pos)
        ms = time_median_s(graph.replay, warmup=5, repeats=100) * 1e3
        # where the step goes: program 0's timer after each barrier (one eager step; the median layer's phases)
        times = torch.zeros(7 * cfg.num_hidden_layers + 2, dtype=torch.int64, device=DEV)
        mk.step(tok, pos, times=times)
        torch.cuda.synchronize()
        phases = mk.phase_times_us(times)
    out = {"ms": round(ms, 4), "setup_s": round(setup, 1), "blocks": mk.blocks, "programs": mk.programs,
           "phase_us": phases}
    if mk.compiled is not None:
        out.update(n_regs=getattr(mk.compiled, "n_regs", None), n_spills=getattr(mk.compiled, "n_spills", None))
    del mk, graph, cache
    torch.cuda.empty_cache()
    return out


def cpu_smoke(steps: int) -> int:
    """The parity check on a tiny fp32 model on the CPU (one program: the interpreter runs programs serially)."""
    global DEV, POOL, CONTEXT
    DEV, POOL, CONTEXT = "cpu", 64, 8
    os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg = dataclasses.replace(synthetic_config("qwen2.5-0.5b"), vocab_size=128, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = random_model(cfg, dtype=torch.float32, device="cpu").fuse_projections().eval()
    out, ok = {}, True
    for pre in (False, True):  # the plain step, then preloaded tiles and slices with one-dimensional sums
        res = parity(model, cfg, steps, {"programs": 1, "num_warps": 4, "tile_bytes": 4096, "cap_n": 16,
                                         "preload": pre, "acc_1d": pre, "preload_kv": pre})
        print("tiny parity" + (" preloaded" if pre else ""), res, flush=True)
        out["parity_preloaded" if pre else "parity"] = res
        ok = ok and res["argmax_agree"] == steps and res["max_rel_logit_diff"] < 1e-4
    print(json.dumps({"shapes": {"tiny": out}}))
    return 0 if ok else 1


def main(shapes: list[str], steps: int, variants: list[dict]) -> int:
    hw = load_or_measure("cuda")
    out = {"hardware": hw.to_dict(), "shapes": {}}
    for name in shapes:
        cfg = synthetic_config(name)
        model = _fused(random_model(cfg).fuse_projections().eval())
        floor = pass_floor_s(forward_cost(cfg, 1, CONTEXT), hw) * 1e3
        res = {"floor_ms": round(floor, 4)}
        runner = ModelRunner(model, model.new_cache(1, POOL), buckets=(1,), cuda_graphs=True)
        runner.prefill(torch.randint(0, cfg.vocab_size, (CONTEXT,), device=DEV), 0)
        ids = torch.randint(0, cfg.vocab_size, (1,), device=DEV)
        ms = time_median_s(lambda: runner.step(ids, CONTEXT), warmup=5, repeats=100) * 1e3
        res["fuseddecode"] = {"ms": round(ms, 4), "over_floor": round(ms / floor, 3)}
        print(name, "fuseddecode", res["fuseddecode"], flush=True)
        del runner
        # the same fused step as a bare graph replay (no input copy, no sampling): what the megakernel's replays are
        # timed as, so `vs_fuseddecode_graph` compares device time with device time
        res["fuseddecode_graph"] = {"ms": round(fused_graph_ms(model, cfg), 4)}
        res["fuseddecode_graph"]["over_floor"] = round(res["fuseddecode_graph"]["ms"] / floor, 3)
        print(name, "fuseddecode_graph", res["fuseddecode_graph"], flush=True)
        torch.cuda.empty_cache()
        checked = set()
        for v in variants:
            tag = (f"mk_p{v['programs'] or 'sm'}_w{v['num_warps']}_t{v['tile_bytes']}_c{v['cap_n']}"
                   + (f"_pf{v['prefetch_gu']}" if v["prefetch_gu"] >= 0 else "")
                   + ("_pre" if v["preload"] else "") + ("_acc1d" if v["acc_1d"] else "")
                   + (f"_s{v['split_s']}" if v["split_s"] != 128 else "") + ("_acq" if v["acquire_poll"] else "")
                   + ("_prekv" if v["preload_kv"] else ""))
            kw = {**v, "programs": v["programs"] or None}
            try:
                path = tuple(v[f] for f in FLAGS)
                if path not in checked:  # each code path's parity once per shape
                    checked.add(path)
                    res[f"{tag}_parity"] = parity(model, cfg, steps, kw)
                    print(name, f"{tag}_parity", res[f"{tag}_parity"], flush=True)
                r = time_variant(model, cfg, kw)
                r["over_floor"] = round(r["ms"] / floor, 3)
                r["vs_fuseddecode"] = round(r["ms"] / res["fuseddecode"]["ms"], 3)
                r["vs_fuseddecode_graph"] = round(r["ms"] / res["fuseddecode_graph"]["ms"], 3)
            except Exception as e:  # noqa: BLE001 -- one variant's failure must not hide the others'
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            res[tag] = r
            print(name, tag, r, flush=True)
        out["shapes"][name] = res
        del model
        torch.cuda.empty_cache()
    print(json.dumps(out))
    return 0


def parse_args(argv: list[str]) -> tuple[list[str], int, list[dict]]:
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        sys.exit(0)
    shapes, steps, spec = [], 8, DEFAULT_VARIANTS
    for a in argv:
        if a == "--cpu-smoke":
            continue
        if a.startswith("--steps="):
            steps = int(a.split("=", 1)[1])
        elif a.startswith("--variants="):
            spec = a.split("=", 1)[1]
        elif a.startswith("--"):
            print(f"gpu_megakernel.py: unexpected argument {a!r} (see --help)", file=sys.stderr)
            sys.exit(2)
        else:
            shapes.append(a)
    variants = []
    for item in spec.split(","):
        try:
            vals = [int(x) for x in item.split(":")]
            if not 4 <= len(vals) <= len(FIELDS):
                raise ValueError
        except ValueError:
            print(f"gpu_megakernel.py: a variant is P:W:TILE:CAP[:PF[:PRE[:ACC1D[:SPLIT[:ACQ[:PREKV]]]]]] (4 to 10 "
                  f"integers), got {item!r}", file=sys.stderr)
            sys.exit(2)
        v = dict(zip(FIELDS, vals + [-1, 0, 0, 128, 0, 0][len(vals) - 4:]))
        for flag in FLAGS:
            v[flag] = bool(v[flag])
        variants.append(v)
    return shapes or ["qwen2.5-1.5b", "qwen3-8b"], steps, variants


if __name__ == "__main__":
    _shapes, _steps, _variants = parse_args(sys.argv[1:])
    if "--cpu-smoke" in sys.argv[1:]:
        sys.exit(cpu_smoke(min(_steps, 3)))
    if not torch.cuda.is_available():
        print("gpu_megakernel.py needs CUDA (use --cpu-smoke to check it on the CPU)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(_shapes, _steps, _variants))
