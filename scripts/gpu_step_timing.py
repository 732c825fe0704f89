#!/usr/bin/env python
"""AR decode-step time vs the bytes/bandwidth floor at real shapes with random weights (bf16, H200).

For each shape (q/k/v and gate/up projections fused): CUDA-graphed steps, plain and torch.compile'd, with SDPA or
the split-KV attention kernel (and, uncompiled, with the RMSNorm and RoPE kernels too), at T = 1, 4, 8 and 16 after a 512-token prefill into a 4096-slot pool (how a verify
pass grows with its tokens: the cost model prices draft lengths with it)
(`--tokens=1,4,8,16,32,64` sets the step sizes, default 1-16; `--no-compile` skips the compiled variants, `--compiled-kernel-only` compiles only with the kernel,
`--variants=sdpa,attnkernel,allkernels,allkernels_gemv,fuseddecode` keeps those uncompiled ones); "allkernels_gemv"
(uncompiled) is "all kernels" plus the Triton GEMV for few-token projections (`model.use_gemv_kernel()`: M = 1 and
wide N at 2-16 tokens, kernels/gemv.py `uses_kernel`), undone after its rows so later variants run the plain GEMMs;
"fuseddecode" is "all kernels" with one-token steps through models/fused_decode.py (six launches a layer; its
T > 1 rows run the "all kernels" path); "fuseddecode12" the same over lossless 12-bit weights (its T = 1 row also
gives the floor of the bytes it reads), "fuseddecode12pre" with the norms in a launch of their own before the 12-bit
GEMVs instead of in their prologues (models/fused_decode.py PRENORM_12BIT); "fuseddecode_pdl" is "fuseddecode" with those launches made with programmatic
dependent launch (kernels/pdl.py, EngineConfig.pdl; "fuseddecode_pdlnopf" the same without the one-row GEMVs' first-tile
prefetch before their wait, kernels/gemv_fused.py PDL_PREFETCH; "fuseddecode_pdllate" / "_pdllatenopf" those two with
the GEMVs' trigger after their K loop, EngineConfig.pdl_trigger "late"; "_pdllatel2" / "_pdllatel2s" late without the
first tile, the GEMVs of <= 36 / 8 MiB of weights warmed in L2 before their wait (EngineConfig.pdl_l2_mb); its `_pdl_on` entry says whether the GPU took it, and with
"fuseddecode" measured too, `pdl_gap_factor_implied` is the share of a graphed launch gap left at T = 1, for the cost
model's estimate costmodel/gaps.py PDL_GAP_FACTOR); "fusedverify" is "fuseddecode" with its 2-16-token steps through the
same fused layer at T rows too (EngineConfig.fused_verify: M-row GEMVs, split-KV attention; `--variants=fuseddecode,
fusedverify --tokens=1,16` compares the T = 16 step of both); "fusednormepi" is "fusedverify" with the norm epilogue
(EngineConfig.norm_epilogue: o_proj / down GEMVs also write the next norm, so qkv, gate_up and the LM head run
norm-free and a T-row step drops its two RMSNorm launches a layer; `--variants=fusedverify,fusednormepi`), and
"fused12normepi" "fuseddecode12" with it (the 12-bit qkv / gate_up GEMVs without their norm prologue);
"fusedropeattn" is "fuseddecode" with a one-token layer's RoPE + K/V write inside its attention launch
(EngineConfig.rope_in_attention, kernels/rope_attention.py: five launches a layer; `--variants=fuseddecode,
fusedropeattn --tokens=1`); "fusedropeqkv" the same work in the qkv GEMV's epilogue instead (EngineConfig.rope_in_qkv,
kernels/qkv_rope.py; models without a q/k norm only: skipped at Qwen3 shapes); "fusedprefetch" is "fuseddecode" with
each one-row GEMV's first weight tile loaded before its norm prologue (kernels/gemv_fused.py ONE_ROW_PREFETCH; same
bits); "fusedropesplit" is "fuseddecode" with q's heads over RoPE + K/V-write programs of 4
(kernels/rope_write.py Q_HEADS_PER_PROGRAM; same bits); "fusedl2load", "fusedl2pf", "fusedl2bulk" are
"fusedverify" with `--l2-fraction` (0.5)
of each layer's gate/up weight warmed in L2 on a side stream during the layer's first launches (EngineConfig.
l2_prefetch, kernels/l2_prefetch.py MODE load / prefetch / bulk; `--variants=fuseddecode,fusedverify,fusedl2pf`);
`--config=NAME:field=value,field=value` (repeatable) times the graphed step of a fresh random model laid out by
the engine itself (engine._apply_layout) for `EngineConfig(device="cuda", dtype="bfloat16", field=value, ...)`:
what `specpilot` runs for that config (without --variants, only those rows), e.g. `--config=default: --config=l2:pdl_l2_mb=36
--config=kvl2:pdl_kv_l2=true,rope_q_heads=4`; its rows are "graphed_cfg_NAME_T..". `--context=N` (default 512)
the tokens in the cache before a --config row's step; `--rounds=N` times every config N times in turn (a fresh
capture each) and reports the median. Median of 100 replays timed with CUDA events. Floors from the cost model
with measured ceilings. `--help`: this text. Last stdout line: one JSON object.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import torch

from specpilot.config import EngineConfig
from specpilot.costmodel import forward_cost, load_or_measure, pass_floor_s, synthetic_config
from specpilot.costmodel.hardware import time_median_s
from specpilot.engine import _apply_layout, kernel_switches, restore_kernel_switches
from specpilot.engine.runner import ModelRunner
from specpilot.kernels import gemv_fused, l2_prefetch, pdl, rope_write
from specpilot.models import fused_decode, random_model


def median_ms(fn, repeats=100) -> float:
    return time_median_s(fn, warmup=5, repeats=repeats) * 1e3


_KERNEL_TAG = {False: "", True: "_attnkernel", "all": "_allkernels", "all_gemv": "_allkernels_gemv",
               "fused": "_fuseddecode", "fused12": "_fuseddecode12", "fused12pre": "_fuseddecode12pre",
               "fused_pdl": "_fuseddecode_pdl", "fused_pdlnopf": "_fuseddecode_pdlnopf",
               "fused_pdllate": "_fuseddecode_pdllate", "fused_pdllatenopf": "_fuseddecode_pdllatenopf",
               "fused_pdllatel2": "_fuseddecode_pdllatel2", "fused_pdllatel2s": "_fuseddecode_pdllatel2s",
               "fused_verify": "_fusedverify",
               "fused_normepi": "_fusednormepi",
               "fused12_normepi": "_fused12normepi", "fused_ropeattn": "_fusedropeattn", "fused_ropeqkv": "_fusedropeqkv",
               "fused_prefetch": "_fusedprefetch", "fused_ropesplit": "_fusedropesplit", "fused_l2load": "_fusedl2load",
               "fused_l2pf": "_fusedl2pf", "fused_l2bulk": "_fusedl2bulk"}
_L2_MODE = {"fused_l2load": "load", "fused_l2pf": "prefetch", "fused_l2bulk": "bulk"}  # kernels/l2_prefetch.py
VARIANT_NAMES = tuple(t[1:] or "sdpa" for t in _KERNEL_TAG.values())  # what --variants= takes
POOL = 4096  # KV slots: the graphed step attends over the whole pool (the kernel skips what is above the context)


def config_summary(res: dict, names: list[str], tokens) -> list[str]:
    """One line a --config and token count, in order: the median over rounds, x its floor, and the change against
    the first config named (the A/B a call is made for, readable without the per-round lines); with two rounds or
    more also the paired change: the median over rounds of this config's time over the first's in the same round.
    Why: a machine can drift 10% within a call (H200, session 35: one config 1.32 -> 1.46 ms over five rounds), and
    configs timed in one round meet the same state, so the per-round ratio cancels most of the drift."""
    lines = []
    for T in tokens:
        base = res.get(f"graphed_cfg_{names[0]}_T{T}") if names else None
        for cname in names:
            r = res.get(f"graphed_cfg_{cname}_T{T}")
            if r is None:  # (a run cut by its time limit)
                continue
            vs = f"{r['ms'] / base['ms'] - 1:+.1%} vs {names[0]}" if base and cname != names[0] else ""
            pairs = [a / b for a, b in zip(r["rounds_ms"], base["rounds_ms"])] if vs else []
            if len(pairs) >= 2:
                vs += (f", paired {statistics.median(pairs) - 1:+.1%} (rounds {min(pairs) - 1:+.1%} to "
                       f"{max(pairs) - 1:+.1%})")
            lines.append(f"summary T{T} {cname:12s} {r['ms']:.4f} ms ({r['over_floor']:.3f}x floor, "
                         f"{len(r['rounds_ms'])} rounds) {vs}".rstrip())
    return lines


def main(shapes, flags=()) -> int:
    # --tokens=1,4,8,16,32,64: the step sizes timed (default 1,4,8,16; 32 and 64 price a tree verify pass: a DFlash
    # block with top-2 at its first one or two positions is 31 / 59 tokens, scripts/tree_tau.py)
    tok = [f.split("=", 1)[1] for f in flags if f.startswith("--tokens=")]
    tokens = tuple(int(t) for t in tok[0].split(",")) if tok else (1, 4, 8, 16)
    # --l2-fraction=F: the share of each layer's gate/up weight the fusedl2* variants warm (EngineConfig.l2_prefetch)
    frac = [f.split("=", 1)[1] for f in flags if f.startswith("--l2-fraction=")]
    l2_fraction = float(frac[0]) if frac else 0.5
    cfgs, n_rounds = configs(flags), rounds(flags)  # --config / --rounds, parsed once
    ctx = context(flags)  # --context: the --config rows' tokens already in the cache
    hw = load_or_measure("cuda")
    out = {"hardware": hw.to_dict(), "shapes": {}}
    print("hardware", json.dumps(out["hardware"]), flush=True)  # first: a run cut by its time limit keeps it
    for name in shapes:
        cfg = synthetic_config(name)
        res = {}
        # (compiled, attention kernel); "all": the attention, RMSNorm, RoPE, silu*mul and add+RMSNorm kernels together;
        # "all_gemv": those plus the Triton GEMV (uncompiled only)
        variants = [(False, False), (False, True), (False, "all"), (False, "all_gemv"), (False, "fused"),
                    (False, "fused12"), (False, "fused12pre"), (False, "fused_pdl"), (False, "fused_pdlnopf"),
                    (False, "fused_pdllate"), (False, "fused_pdllatenopf"), (False, "fused_pdllatel2"),
                    (False, "fused_pdllatel2s"), (False, "fused_verify"),
                    (False, "fused_normepi"), (False, "fused12_normepi"), (False, "fused_ropeattn"),
                    (False, "fused_ropeqkv"), (False, "fused_prefetch"), (False, "fused_ropesplit"),
                    (False, "fused_l2load"), (False, "fused_l2pf"),
                    (False, "fused_l2bulk"), (True, False), (True, True)]
        if "--no-compile" in flags:
            variants = [v for v in variants if not v[0]]
        if "--compiled-kernel-only" in flags:  # of the compiled ones, only what the engine would run (4 compiles)
            variants = [v for v in variants if not v[0] or v[1]]
        only = [f.split("=", 1)[1].split(",") for f in flags if f.startswith("--variants=")]
        if only:  # e.g. --variants=allkernels,fuseddecode: the tags of _KERNEL_TAG without "_" (plain: "sdpa")
            variants = [v for v in variants if (_KERNEL_TAG[v[1]][1:] or "sdpa") in only[0] and not v[0]]
        elif cfgs:  # --config alone: only its rows
            variants = []
        model = random_model(cfg).fuse_projections() if variants else None  # --config rows make their own
        for compiled, kernel in variants:
            pdl_kinds = ("fused_pdl", "fused_pdlnopf", "fused_pdllate", "fused_pdllatenopf", "fused_pdllatel2",
                         "fused_pdllatel2s")
            fused = kernel in ("fused", "fused12", "fused12pre", *pdl_kinds, "fused_verify",
                               "fused_normepi", "fused12_normepi", "fused_ropeattn", "fused_ropeqkv", "fused_prefetch",
                               "fused_ropesplit",
                               *_L2_MODE)
            twelve = kernel in ("fused12", "fused12pre", "fused12_normepi")
            every = kernel in ("all", "all_gemv") or fused
            model.use_attention_kernel(bool(kernel))
            model.use_norm_kernel(every).use_rope_kernel(every)
            model.use_act_kernel(every).use_add_norm_kernel(every)
            model.use_gemv_kernel(kernel == "all_gemv")
            model.use_fused_decode(fused)
            model.use_fused_verify(kernel in ("fused_verify", "fused_normepi"))  # T = 2..16 rows fused as well
            model.use_norm_epilogue(kernel in ("fused_normepi", "fused12_normepi"))  # the norms from the GEMVs
            model.use_rope_in_attention(kernel == "fused_ropeattn")  # RoPE + K/V write in the attention launch
            if kernel == "fused_ropeqkv" and cfg.qk_norm:  # Qwen3's q/k norm needs the whole head first
                res["fusedropeqkv_skipped"] = "q/k norm"
                continue
            model.use_rope_in_qkv(kernel == "fused_ropeqkv")  # ... or in the qkv GEMV's epilogue
            model.use_lossless12(twelve)
            if kernel in _L2_MODE:  # gate/up's weight warmed in L2 during the layer's first launches (T > 1: fused
                l2_prefetch.MODE = _L2_MODE[kernel]  # verify too, so its T > 1 rows time that path)
                model.use_fused_verify(True)
            model.use_l2_prefetch(l2_fraction if kernel in _L2_MODE else 0.0)
            fused_decode.PRENORM_12BIT = kernel == "fused12pre"  # 12-bit GEMVs after a separate RMSNorm launch
            gemv_fused.ONE_ROW_PREFETCH = kernel == "fused_prefetch"  # first weight tile ahead of the norm prologue
            rope_write.Q_HEADS_PER_PROGRAM = 4 if kernel == "fused_ropesplit" else 0  # q's heads over programs
            pdl_on = pdl.set_enabled(kernel in pdl_kinds,  # before the runner captures its graphs
                                     trigger="late" if kernel.startswith("fused_pdllate") else "start")
            gemv_fused.PDL_PREFETCH = not kernel.endswith(("nopf", "l2", "l2s"))  # without the first-tile prefetch
            gemv_fused.PDL_L2_MAX_BYTES = {"fused_pdllatel2": 36 << 20, "fused_pdllatel2s": 8 << 20}.get(kernel, 0)
            if kernel == "fused_pdl":
                res["graphed_fuseddecode_pdl_on"] = pdl_on
            t0 = time.time()
            runner = ModelRunner(model.eval(), model.new_cache(1, POOL), buckets=tokens, cuda_graphs=True,
                                 compile=compiled)
            setup = time.time() - t0
            runner.prefill(torch.randint(0, cfg.vocab_size, (512,), device="cuda"), 0)
            for T in tokens:
                ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda")
                ms = median_ms(lambda: runner.step(ids, 512))
                floor = pass_floor_s(forward_cost(cfg, T, 512), hw) * 1e3  # (bytes only: any kernel flags)
                key = f"{'compiled' if compiled else 'graphed'}{_KERNEL_TAG[kernel]}_T{T}"
                res[key] = {"ms": round(ms, 4), "floor_ms": round(floor, 4), "over_floor": round(ms / floor, 3)}
                if twelve and T == 1:  # the 16-bit floor above; this one counts the bytes it reads
                    f12 = pass_floor_s(forward_cost(cfg, 1, 512, fused_decode=True, lossless12=True), hw) * 1e3
                    res[key].update({"floor12_ms": round(f12, 4), "over_floor12": round(ms / f12, 3)})
                print(name, key, res[key], f"setup {setup:.1f}s", flush=True)
            res[f"{'compiled' if compiled else 'graphed'}{_KERNEL_TAG[kernel]}_setup_s"] = round(setup, 1)
            del runner
            pdl.set_enabled(False)
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
        times = {}  # (config name, T) -> ms of each round
        off = kernel_switches()  # what each config's layout changes, put back after it
        for rnd in range(n_rounds):  # --rounds=N: every config once a round, so drift hits them alike
            for cname, fields in cfgs:  # the engine's own layout for each --config
                ecfg = EngineConfig(device="cuda", dtype="bfloat16", **fields)
                m = random_model(cfg)
                _apply_layout(m, ecfg)
                t0 = time.time()
                runner = ModelRunner(m.eval(), m.new_cache(1, POOL), buckets=tokens, cuda_graphs=True,
                                     compile=ecfg.compile)
                setup = time.time() - t0
                runner.prefill(torch.randint(0, cfg.vocab_size, (ctx,), device="cuda"), 0)
                for T in tokens:
                    ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda")
                    times.setdefault((cname, T), []).append(median_ms(lambda: runner.step(ids, ctx)))
                    floor = pass_floor_s(forward_cost(cfg, T, ctx), hw) * 1e3
                    ms = statistics.median(times[cname, T])
                    key = f"graphed_cfg_{cname}_T{T}"
                    res[key] = {"ms": round(ms, 4), "floor_ms": round(floor, 4), "over_floor": round(ms / floor, 3),
                                "rounds_ms": [round(t, 4) for t in times[cname, T]], "config": fields,
                                "pdl_on": pdl.enabled()}
                    print(name, f"round {rnd}", key, res[key], f"setup {setup:.1f}s", flush=True)
                del runner, m
                restore_kernel_switches(off)
                gc.collect()  # a model kept by reference cycles until a GC pass: session 41's Qwen3-8B run ran out of
                torch.cuda.empty_cache()  # memory at its fourth model (78 GiB held in the process, one model ~16)
        for line in config_summary(res, [c for c, _ in cfgs], tokens):
            print(name, line, flush=True)
        implied = pdl_gap_factor_implied(cfg, hw, res)
        if implied is not None:
            res["pdl_gap_factor_implied"] = implied
            print(name, "pdl_gap_factor_implied", implied, flush=True)
        out["shapes"][name] = res
    print(json.dumps(out))
    return 0


def context(flags) -> int:
    """--context=N (default 512): the tokens prefilled before a --config row's step, i.e. the keys its attention
    sees (how the one-token attention's slices and merge grow with the context); 1 <= N <= POOL - 16."""
    got = [f.split("=", 1)[1] for f in flags if f.startswith("--context=")]
    if got and not (got[-1].isdigit() and 1 <= int(got[-1]) <= POOL - 16):
        raise ValueError(f"--context takes an integer in [1, {POOL - 16}], got {got[-1]!r}")
    return int(got[-1]) if got else 512


def rounds(flags) -> int:
    """--rounds=N (default 1): how many times each --config is laid out, captured and timed, in turn; its row is
    the median over the rounds (H200, session 27: one config's step moved 2-6% between captures minutes apart)."""
    got = [f.split("=", 1)[1] for f in flags if f.startswith("--rounds=")]
    if got and not (got[-1].isdigit() and int(got[-1]) >= 1):
        raise ValueError(f"--rounds takes a positive integer, got {got[-1]!r}")
    return int(got[-1]) if got else 1


def configs(flags) -> list[tuple[str, dict]]:
    """--config=NAME:field=value,... -> [(NAME, {field: value})], each value parsed as its EngineConfig field's
    type (true / false, an integer, a number, else text); ValueError on an unknown field or a bad value."""
    import dataclasses

    types = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    out = []
    for f in flags:
        if not f.startswith("--config="):
            continue
        name, sep, body = f.split("=", 1)[1].partition(":")
        if not sep or not name or not name.replace("_", "").isalnum():
            raise ValueError(f"--config takes NAME:field=value,...; got {f!r}")
        fields = {}
        for item in filter(None, body.split(",")):
            key, eq, val = item.partition("=")
            if not eq or key not in types:
                raise ValueError(f"--config={name}: {item!r} is not field=value with an EngineConfig field")
            kind = str(types[key])
            if kind == "bool":
                if val.lower() not in ("true", "false"):
                    raise ValueError(f"--config={name}: {key} takes true or false, got {val!r}")
                fields[key] = val.lower() == "true"
            elif kind in ("int", "float"):
                fields[key] = (int if kind == "int" else float)(val)
            else:
                fields[key] = val
        EngineConfig(device="cuda", dtype="bfloat16", **fields)  # its own checks, before any GPU time
        out.append((name, fields))
    return out


def pdl_gap_factor_implied(cfg, hw, res: dict) -> float | None:
    """The share of a graphed launch gap (`graph_kernel_s`) a PDL launch still paid at T = 1, from the fuseddecode
    and fuseddecode_pdl rows: 1 - saved time / (PDL launches x gap). None unless both ran and PDL was on."""
    if not res.get("graphed_fuseddecode_pdl_on") or "graphed_fuseddecode_T1" not in res:
        return None
    saved_s = (res["graphed_fuseddecode_T1"]["ms"] - res["graphed_fuseddecode_pdl_T1"]["ms"]) / 1e3
    launches = forward_cost(cfg, 1, 512, fused=True, norm_kernel=True, rope_kernel=True, act_kernel=True,
                            add_norm_kernel=True, fused_decode=True, pdl=True).num_pdl_kernels
    return round(1.0 - saved_s / (launches * hw.graph_kernel_s), 3)


def parse_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """-> (shapes, flags); `--help` prints the module docstring and exits; an unknown --variants name or a bad
    --tokens list exits 2."""
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        print(f"\nusage: gpu_step_timing.py [SHAPE ...] [--no-compile] [--compiled-kernel-only] "
              f"[--variants={','.join(VARIANT_NAMES)}] [--tokens=1,4,8,16,32,64] "
              f"[--config=NAME:field=value,...] [--rounds=N] [--context=N]")
        sys.exit(0)
    flags = [a for a in argv if a.startswith("--")]
    try:
        configs(flags), rounds(flags), context(flags)
    except Exception as e:  # a bad --config: a clear message, before any GPU time
        print(f"gpu_step_timing.py: {e}", file=sys.stderr)
        sys.exit(2)
    for f in flags:
        unknown = [v for v in f.split("=", 1)[1].split(",") if v not in VARIANT_NAMES] if f.startswith(
            "--variants=") else []
        if unknown:
            print(f"gpu_step_timing.py: unknown variants {unknown}; known: {', '.join(VARIANT_NAMES)}", file=sys.stderr)
            sys.exit(2)
        if f.startswith("--tokens=") and not all(t.isdigit() and int(t) > 0 for t in f.split("=", 1)[1].split(",")):
            print(f"gpu_step_timing.py: --tokens takes positive integers, e.g. --tokens=1,16,32; got {f}",
                  file=sys.stderr)
            sys.exit(2)
    return [a for a in argv if not a.startswith("--")] or ["qwen2.5-1.5b", "qwen3-8b"], flags


if __name__ == "__main__":
    sys.exit(main(*parse_args(sys.argv[1:])))
