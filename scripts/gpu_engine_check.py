#!/usr/bin/env python
"""GPU parity check of the engine's fast paths: eager vs CUDA-graphed vs compiled+graphed, AR vs speculative.

On a random-weight model (fp32, so every path must give identical greedy tokens), checks that AR eager ==
AR graphed == AR compiled, that speculative decoding (self drafter, random drafter, n-gram) equals AR, and that
batched regeneration (eager and graphed) equals batch-1 AR; then one section per fast path (defaults: the model
laid out for the default config with the engine's switches set, as users run it; attention_kernel,
norm_kernel, fused_decode, fused_verify: verify blocks through the fused layer, pdl: the fused path launched with
programmatic dependent launch, norm_epilogue: the fused layer's norms written by its residual GEMVs,
rope_in_attention: a one-token layer's RoPE + K/V write inside its attention launch, rope_in_qkv: the same in
its qkv GEMV's epilogue, gemv_prefetch: the one-row GEMVs' first weight tile ahead of their norm prologue, gemv_pipeline: their K loop one
block ahead, early_epilogue: their (and qkv + RoPE's) epilogue operands loaded right after the wait,
tile_after_wait: their first weight tile right after it, qkv_trigger_first: qkv + RoPE letting the attention
launch first thing, with the attention's older K/V rows loaded before its wait, attn_single_direct: the
one-token attention's only working slice storing the output itself, attn_merge_unroll: its merge's loads
four slices at a time, attn_block_keys: a program's 128 keys in one inner step, attn_loads_first: V asked for
with K and the merge's first partials with the maxima, attn_cluster / attn_cluster_groups: the slices of a KV head
merged inside a thread-block cluster (one cluster of 8; two of 4, merged across by the last CTA; one of 4 dealing
out every key evenly; pushing the partials to the merging CTA), qkv_pipeline: qkv + RoPE's K loop two blocks ahead,
attn_stages: the attention's slice loop in 2 pipeline stages, verify_one_launch: a verify block's attention in one
launch, norm_pdl: the RMSNorm launches with PDL, norm_handoff: a verify block's norms from handed-over sums of
squares, verify_rope_in_qkv: a verify block's RoPE + K/V write in its qkv GEMM,
rope_split: q's heads over several RoPE + K/V-write programs,
l2_prefetch: gate/up's weight
warmed in L2 on a side stream in each of its three modes, draft_chain_graph: a small drafter's K - 1 passes in one
graph, prefill_graphs: a prompt's prefill from its padded length's graph, megakernel: every one-token step as one
persistent launch, dflash, early_draft: the next
DFlash block launched before the host reads the verdict, batch, lossless12).
`--only=pdl,fused_decode` runs just those sections (after the eager AR reference; the base variants are skipped);
`--help`: this text. Last stdout line: one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from specpilot.config import EngineConfig, SamplingConfig
from specpilot.costmodel import synthetic_config
from specpilot.engine import Engine, build_drafter, config_switches, kernel_switches
from specpilot.models import random_model


# lossless12 last: it autotunes the 12-bit GEMV per shape (~150 s on the H200)
SECTIONS = ("defaults", "attention_kernel", "norm_kernel", "fused_decode", "fused_verify", "pdl", "norm_epilogue",
            "rope_in_attention", "rope_in_qkv", "rope_in_qkv_qk_norm", "gemv_prefetch", "gemv_pipeline", "early_epilogue",
            "tile_after_wait", "qkv_trigger_first", "attn_single_direct", "attn_merge_unroll", "attn_block_keys",
            "attn_loads_first", "attn_cluster", "attn_cluster_groups", "attn_cluster_even", "attn_cluster_push",
            "qkv_pipeline", "attn_stages", "verify_one_launch", "norm_pdl", "norm_handoff", "verify_rope_in_qkv",
            "rope_split",
            "attn_split", "pdl_kv_l2", "pdl_l2_next", "attn_kv_preload",
            "attn_merge", "l2_prefetch", "draft_chain_graph", "prefill_graphs", "megakernel", "dflash", "early_draft", "adaptive", "batch", "lossless12")


def main(only: tuple[str, ...] = ()) -> int:
    import dataclasses

    result, problems = {}, []
    cfg = dataclasses.replace(synthetic_config("qwen2.5-0.5b"), num_hidden_layers=4)
    target, other = random_model(cfg, dtype=torch.float32, seed=0), random_model(cfg, dtype=torch.float32, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(0, 1000, (7,), generator=g).tolist() * 4)[: 20 + i] for i in range(3)]
    base = EngineConfig(drafter_kind="none", device="cuda", max_new_tokens=48, max_seq_len=256, ignore_eos=True,
                        num_draft_tokens=4)
    ref = [Engine(target, base.with_(cuda_graphs=False)).generate(p).output_ids for p in prompts]
    variants = {
        "ar_graphed": (base, None),
        "ar_compiled": (base.with_(compile=True), None),
        "spec_self": (base.with_(drafter_kind="model"), target),
        "spec_other": (base.with_(drafter_kind="model"), other),
        "spec_ngram": (base.with_(drafter_kind="ngram"), None),
        "spec_other_compiled": (base.with_(drafter_kind="model", compile=True), other),
    }

    def record(name, outs, **extra):
        """One check: the outputs of `outs` (GenerationResults, one per prompt) against eager AR's."""
        result[name] = {"equal": all(o.output_ids == r for o, r in zip(outs, ref)), **extra}
        print(name, result[name], flush=True)
        if not result[name]["equal"]:
            problems.append(name)

    for name, (c, dm) in variants.items() if not only else ():
        t0 = time.time()
        eng = Engine(target, c, build_drafter(c, dm, target))
        outs = [eng.generate(p) for p in prompts]
        tau = sum(o.num_output_tokens for o in outs) / sum(o.num_target_forwards for o in outs)
        record(name, outs, tau=round(tau, 3), setup_and_run_s=round(time.time() - t0, 1))
    import copy
    import traceback
    import warnings

    def section(name, fn):
        """Run one check; an exception or a graph-capture fallback warning is a problem, the rest still runs."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            try:
                fn()
            except Exception as e:  # report and go on: one broken path must not hide the others
                traceback.print_exc()
                problems.append(f"{name}: {type(e).__name__}: {e}"[:300])
        for w in caught:
            if "capture failed" in str(w.message):
                problems.append(f"{name}: {w.message}"[:300])

    def same_tokens(cases):
        for name, c, model in cases:
            record(name, [Engine(model, c, build_drafter(c, None, model)).generate(p) for p in prompts])

    def fused_under_pdl_late(section):
        """A fused-decode copy of the check's target with PDL switched on (late trigger) for a section that times
        a PDL-only mechanism, or None (a problem recorded) where PDL cannot run here."""
        from specpilot.kernels import pdl

        if not pdl.set_enabled(True, trigger="late"):
            problems.append(f"{section}: PDL not available here: {pdl.unsupported_reason()}")
            return None
        return copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode()

    def switches_differ(name, on_state, off_state):
        """A problem when a switch's on and off runs took the same switches: the comparison would show nothing."""
        if on_state == off_state:
            problems.append(f"{name}: the on and off runs took the same kernel switches (a vacuous comparison)")

    def equals_off(name, on, off):
        """A switch's outputs against the same engine's with it off: recorded, and a problem when they differ."""
        same = all(a.output_ids == b.output_ids for a, b in zip(on, off))
        result[name] = {"equal": same}
        print(name, result[name], flush=True)
        if not same:
            problems.append(name)

    ngram = base.with_(drafter_kind="ngram")

    def defaults():
        # the engine as users run it: the check model laid out for the default config (engine._apply_layout, as
        # load_target does: fused decode and verify, RoPE in the qkv GEMV, PDL late, L2 warming, the attention's
        # default split, inner step and merge unroll) and its process-wide switches set; graphed and eager AR and
        # n-gram and self-drafter speculation against the plain eager AR reference. The other sections start from
        # the kernels' module defaults, which are not the engine's (MERGE_UNROLL 0, 64-key inner steps, PDL off)
        from specpilot.engine import _apply_layout

        with config_switches(base):
            laid = copy.deepcopy(target)
            _apply_layout(laid, base)
            same_tokens((("defaults_ar_graphed", base, laid), ("defaults_ar_eager", base.with_(cuda_graphs=False), laid),
                         ("defaults_spec_ngram", ngram, laid)))
            spec = base.with_(drafter_kind="model")
            eng = Engine(laid, spec, build_drafter(spec, laid, laid))
            record("defaults_spec_self", [eng.generate(p) for p in prompts])

    def attention_kernel():
        fast = copy.deepcopy(target).use_attention_kernel()  # the split-KV attention kernel: same greedy tokens
        same_tokens((("ar_attention_kernel", base, fast), ("spec_ngram_attention_kernel", ngram, fast),
                     # the kernel under torch.compile: a custom op since the loop's compile trial failed there
                     ("spec_ngram_attention_kernel_compiled", ngram.with_(compile=True), fast)))

    def norm_kernel():
        # every RMSNorm in one Triton launch, RoPE of q and k in another: same greedy tokens, alone and together
        both = copy.deepcopy(target).use_norm_kernel().use_rope_kernel()
        # the MLP's silu*mul and each residual add + norm in one launch (off by default until this passes)
        fused = copy.deepcopy(target).use_act_kernel().use_add_norm_kernel()
        every = copy.deepcopy(both).use_act_kernel().use_add_norm_kernel()
        same_tokens((("ar_norm_kernel", base, copy.deepcopy(target).use_norm_kernel()),
                     ("ar_rope_kernel", base, copy.deepcopy(target).use_rope_kernel()),
                     ("spec_ngram_norm_rope_kernels", ngram, both),
                     ("spec_ngram_norm_rope_kernels_compiled", ngram.with_(compile=True), both),
                     ("ar_act_kernel", base, copy.deepcopy(target).use_act_kernel()),
                     ("ar_add_norm_kernel", base, copy.deepcopy(target).use_add_norm_kernel()),
                     ("spec_ngram_act_add_norm_kernels", ngram, fused),
                     ("spec_ngram_all_kernels", ngram, every),
                     ("spec_ngram_all_kernels_compiled", ngram.with_(compile=True), every)))

    def fused_decode():
        # one-token steps in six launches a layer (models/fused_decode.py): AR, a small drafter's passes, and
        # n-gram speculation whose one-token steps (nothing drafted) take it; the verify blocks keep the regular path
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode()
        model = base.with_(drafter_kind="model")
        drafter = copy.deepcopy(other).use_fused_decode()
        same_tokens((("ar_fused_decode", base, fast), ("spec_ngram_fused_decode", ngram, fast),
                     ("ar_fused_decode_eager", base.with_(cuda_graphs=False), fast)))
        record("spec_other_fused_decode", [Engine(fast, model, build_drafter(model, drafter, fast)).generate(p)
                                           for p in prompts])

    def fused_verify():
        # verify blocks of 2-16 tokens through fused decode's layer at T rows (models/fused_decode.py,
        # EngineConfig.fused_verify: M-row GEMVs, RoPE + K/V write, split-KV attention): n-gram speculation (blocks
        # of up to 5 and of up to 16 tokens), a small drafter (itself: every block full; another model), graphed and
        # eager, and a random DFlash drafter's 8-token blocks (its features captured from the fused layers)
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        on = base.with_(fused_verify=True)
        ngram_on, model = ngram.with_(fused_verify=True), on.with_(drafter_kind="model")
        same_tokens((("ar_fused_verify", on, fast), ("spec_ngram_fused_verify", ngram_on, fast),
                     ("spec_ngram_fused_verify_eager", ngram_on.with_(cuda_graphs=False), fast),
                     ("spec_ngram16_fused_verify", ngram_on.with_(num_draft_tokens=15), fast)))
        for name, c, drafter in (("spec_self_fused_verify", model, copy.deepcopy(fast)),
                                 ("spec_other_fused_verify", model,
                                  copy.deepcopy(other).use_fused_decode().use_fused_verify()),
                                 ("spec_other_fused_verify_eager", model.with_(cuda_graphs=False),
                                  copy.deepcopy(other).use_fused_decode().use_fused_verify())):
            record(name, [Engine(fast, c, build_drafter(c, drafter, fast)).generate(p) for p in prompts])
        c = on.with_(drafter_kind="dflash", num_draft_tokens=7)
        record("spec_dflash_fused_verify", [Engine(fast, c, build_drafter(c, dflash_net(), fast)).generate(p)
                                            for p in prompts])

    def lossless12():
        # bf16 (the format's dtype): fused one-token steps over the 12-bit copies vs over the bf16 weights. Only the
        # GEMVs' summation order differs, so random weights (near-tied logits) may part after a while: recorded, not
        # a problem; a problem is a copy that does not restore its weights exactly
        from specpilot.formats.lossless12 import unpack

        b16 = copy.deepcopy(target).to(torch.bfloat16).use_norm_kernel().use_rope_kernel().use_fused_decode()
        w12 = copy.deepcopy(b16).use_lossless12()
        exact = all(torch.equal(unpack(m.packed12).view(torch.int16), m.weight.view(torch.int16))
                    for m in w12.modules() if hasattr(m, "packed12"))
        c = base.with_(dtype="bfloat16")
        a = [Engine(b16, c).generate(p).output_ids for p in prompts]
        b = [Engine(w12, c).generate(p).output_ids for p in prompts]
        agree = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)]
        result["ar_lossless12"] = {"weights_exact": exact, "tokens_before_first_difference": agree,
                                   "lengths": [len(u) for u in a]}
        print("ar_lossless12", result["ar_lossless12"], flush=True)
        if not exact:
            problems.append("lossless12_weights_not_exact")
        # with the norm epilogue (EngineConfig.norm_epilogue): the 12-bit qkv / gate_up GEMVs without their norm
        # prologue, o_proj / down (12-bit too) writing the norms. The sum of squares may take another order on the
        # GPU (another launch's layout), so as above: recorded against the 12-bit steps without it, not a problem
        e = [Engine(copy.deepcopy(w12).use_norm_epilogue(), c.with_(norm_epilogue=True)).generate(p).output_ids
             for p in prompts]
        agree = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(b, e)]
        result["ar_lossless12_norm_epilogue"] = {"tokens_before_first_difference": agree}
        print("ar_lossless12_norm_epilogue", result["ar_lossless12_norm_epilogue"], flush=True)

    def pdl_launch():
        # the fused one-token path's kernels launched with programmatic dependent launch (kernels/pdl.py,
        # EngineConfig.pdl): each may start while the one before it drains and waits in-kernel, so a kernel that
        # touched memory before its wait would show here as different tokens. Graphed AR (the check that matters),
        # eager AR, n-gram speculation (PDL launches between regular verify blocks) and a small drafter's passes,
        # all against eager AR, and graphed AR with pdl on against the same with pdl off directly
        from specpilot.kernels import pdl

        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode()
        drafter = copy.deepcopy(other).use_fused_decode()
        model = base.with_(drafter_kind="model")
        off = [Engine(fast, base).generate(p) for p in prompts]
        if not pdl.set_enabled(True):
            problems.append(f"pdl: not available here: {pdl.unsupported_reason()}")
            return
        try:
            on_cfg = base.with_(pdl=True)
            on = [Engine(fast, on_cfg).generate(p) for p in prompts]
            record("ar_fused_decode_pdl", on)
            equals_off("ar_fused_decode_pdl_equals_off", on, off)
            same_tokens((("ar_fused_decode_pdl_eager", on_cfg.with_(cuda_graphs=False), fast),
                         ("spec_ngram_fused_decode_pdl", ngram.with_(pdl=True), fast)))
            record("spec_other_fused_decode_pdl",
                   [Engine(fast, model, build_drafter(model, drafter, fast)).generate(p) for p in prompts])
            # the GEMVs' trigger after their K loop (EngineConfig.pdl_trigger "late"), and with every GEMV's weight
            # warmed in L2 before its wait (pdl_l2_mb: this model's are all small)
            from specpilot.kernels import gemv_fused

            late_cfg = on_cfg.with_(pdl_trigger="late")
            pdl.set_enabled(True, trigger="late")
            late = [Engine(fast, late_cfg).generate(p) for p in prompts]
            record("ar_fused_decode_pdl_late", late)
            equals_off("ar_fused_decode_pdl_late_equals_off", late, off)
            same_tokens((("spec_ngram_fused_decode_pdl_late", ngram.with_(pdl=True, pdl_trigger="late"), fast),))
            gemv_fused.PDL_L2_MAX_BYTES = 1 << 30
            l2 = [Engine(fast, late_cfg.with_(pdl_l2_mb=1024)).generate(p) for p in prompts]
            record("ar_fused_decode_pdl_late_l2", l2)
            equals_off("ar_fused_decode_pdl_late_l2_equals_off", l2, off)
        finally:
            pdl.set_enabled(False)
            gemv_fused.PDL_L2_MAX_BYTES = 0

    def norm_epilogue():
        # the fused layer's residual GEMVs also write the norm the next GEMV reads (EngineConfig.norm_epilogue,
        # kernels/norm_epilogue.py: the last program of a launch normalizes the finished rows). A row read before
        # another program's slice was visible, or a counter left non-zero (graph replays reuse it), shows as other
        # tokens: graphed AR (against eager AR, and against graphed AR without it), eager AR, n-gram speculation
        # (fused verify blocks of up to 5 and 16 tokens: the M-row kernel, split-K at down_proj), a small drafter
        # (its one-token passes) and a random DFlash drafter's 8-token blocks
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        epi = copy.deepcopy(fast).use_norm_epilogue()
        off_cfg = base.with_(fused_verify=True)
        on_cfg = off_cfg.with_(norm_epilogue=True)
        off = [Engine(fast, off_cfg).generate(p) for p in prompts]
        on = [Engine(epi, on_cfg).generate(p) for p in prompts]
        record("ar_norm_epilogue", on)
        equals_off("ar_norm_epilogue_equals_off", on, off)
        ngram_on, model = on_cfg.with_(drafter_kind="ngram"), on_cfg.with_(drafter_kind="model")
        same_tokens((("ar_norm_epilogue_eager", on_cfg.with_(cuda_graphs=False), epi),
                     ("spec_ngram_norm_epilogue", ngram_on, epi),
                     ("spec_ngram_norm_epilogue_eager", ngram_on.with_(cuda_graphs=False), epi),
                     ("spec_ngram16_norm_epilogue", ngram_on.with_(num_draft_tokens=15), epi)))
        drafter = copy.deepcopy(other).use_fused_decode().use_fused_verify().use_norm_epilogue()
        record("spec_other_norm_epilogue", [Engine(epi, model, build_drafter(model, drafter, epi)).generate(p)
                                            for p in prompts])
        c = on_cfg.with_(drafter_kind="dflash", num_draft_tokens=7)
        record("spec_dflash_norm_epilogue", [Engine(epi, c, build_drafter(c, dflash_net(), epi)).generate(p)
                                             for p in prompts])

    def rope_in_attention():
        # a one-token layer's q/k norm, RoPE and K/V write inside its attention launch (EngineConfig.
        # rope_in_attention, kernels/rope_attention.py): the slice holding the new token must use the k/v its own
        # program computed, never the cache slot another program of the launch is writing; a stale slot (or a
        # slot written twice, a counter left non-zero) shows as other tokens. Graphed AR against eager AR and
        # against graphed AR without it, eager AR, with PDL, n-gram speculation (fused verify blocks keep
        # rope_write; the one-token steps between them use the switch) and a small drafter's one-token passes.
        # Random weights of the 0.5B's shape, 4 layers: 7 q heads a kv head, one row block; the pool's 128-key
        # slices cross at positions 128, 256 (prompts of 20-22 tokens + 48 new ones: slice 0 only, so also 300 new)
        from specpilot.kernels import pdl

        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        ria = copy.deepcopy(fast).use_rope_in_attention()
        off_cfg = base.with_(fused_verify=True)
        on_cfg = off_cfg.with_(rope_in_attention=True, rope_in_qkv=False)
        off = [Engine(fast, off_cfg).generate(p) for p in prompts]
        on = [Engine(ria, on_cfg).generate(p) for p in prompts]
        record("ar_rope_in_attention", on)
        equals_off("ar_rope_in_attention_equals_off", on, off)
        long_cfg = on_cfg.with_(max_new_tokens=300, max_seq_len=512)  # past two slice boundaries
        long_off = [Engine(fast, long_cfg.with_(rope_in_attention=False)).generate(p) for p in prompts[:1]]
        equals_off("ar_rope_in_attention_300_equals_off", [Engine(ria, long_cfg).generate(p) for p in prompts[:1]],
                   long_off)
        ngram_on, model = on_cfg.with_(drafter_kind="ngram"), on_cfg.with_(drafter_kind="model")
        same_tokens((("ar_rope_in_attention_eager", on_cfg.with_(cuda_graphs=False), ria),
                     ("spec_ngram_rope_in_attention", ngram_on, ria),
                     ("spec_ngram_rope_in_attention_eager", ngram_on.with_(cuda_graphs=False), ria)))
        drafter = copy.deepcopy(other).use_fused_decode().use_rope_in_attention()
        record("spec_other_rope_in_attention", [Engine(ria, model, build_drafter(model, drafter, ria)).generate(p)
                                                for p in prompts])
        if pdl.set_enabled(True):
            try:
                record("ar_rope_in_attention_pdl", [Engine(ria, on_cfg.with_(pdl=True)).generate(p) for p in prompts])
            finally:
                pdl.set_enabled(False)
        else:
            print("ar_rope_in_attention_pdl skipped:", pdl.unsupported_reason(), flush=True)

    def rope_in_qkv():
        # a one-token layer's RoPE and K/V write in its qkv GEMV's epilogue (EngineConfig.rope_in_qkv, kernels/
        # qkv_rope.py; autotuned per shape on first use): graphed AR against graphed AR without it (past a
        # 128-key slice boundary too), eager AR, n-gram speculation (its verify blocks keep rope_write) and a small
        # drafter's one-token passes through it
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        riq = copy.deepcopy(fast).use_rope_in_qkv()
        off_cfg = base.with_(fused_verify=True)
        on_cfg = off_cfg.with_(rope_in_qkv=True)
        off = [Engine(fast, off_cfg).generate(p) for p in prompts]
        on = [Engine(riq, on_cfg).generate(p) for p in prompts]
        record("ar_rope_in_qkv", on)
        equals_off("ar_rope_in_qkv_equals_off", on, off)
        long_cfg = on_cfg.with_(max_new_tokens=300, max_seq_len=512)
        long_off = [Engine(fast, long_cfg.with_(rope_in_qkv=False)).generate(p) for p in prompts[:1]]
        equals_off("ar_rope_in_qkv_300_equals_off", [Engine(riq, long_cfg).generate(p) for p in prompts[:1]], long_off)
        ngram_on, model = on_cfg.with_(drafter_kind="ngram"), on_cfg.with_(drafter_kind="model")
        same_tokens((("ar_rope_in_qkv_eager", on_cfg.with_(cuda_graphs=False), riq),
                     ("spec_ngram_rope_in_qkv", ngram_on, riq)))
        drafter = copy.deepcopy(other).use_fused_decode().use_rope_in_qkv()
        record("spec_other_rope_in_qkv", [Engine(riq, model, build_drafter(model, drafter, riq)).generate(p)
                                          for p in prompts])

    def rope_in_qkv_qk_norm():
        # the same on a Qwen3-shaped model (2 layers at the 8B's widths, a small vocabulary): each q/k head's last
        # qkv program normalizes, rotates and stores it (kernels/qkv_rope.py QK_NORM); graphed AR against eager AR
        # and against graphed AR without it (past a 128-key slice boundary too), n-gram speculation through it
        cfg3 = dataclasses.replace(synthetic_config("qwen3-8b"), num_hidden_layers=2, vocab_size=4096)
        q3 = random_model(cfg3, dtype=torch.float32, seed=2)
        ref3 = [Engine(q3, base.with_(cuda_graphs=False)).generate(p).output_ids for p in prompts]
        fast = copy.deepcopy(q3).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        riq = copy.deepcopy(fast).use_rope_in_qkv()
        off_cfg = base.with_(fused_verify=True)
        on_cfg = off_cfg.with_(rope_in_qkv=True)
        for name, c, model in (("ar_qk_norm_rope_in_qkv", on_cfg, riq), ("ar_qk_norm_rope_in_qkv_off", off_cfg, fast),
                               ("spec_ngram_qk_norm_rope_in_qkv", on_cfg.with_(drafter_kind="ngram"), riq)):
            outs = [Engine(model, c, build_drafter(c, None, model)).generate(p) for p in prompts]
            result[name] = {"equal": all(o.output_ids == r for o, r in zip(outs, ref3))}
            print(name, result[name], flush=True)
            if not result[name]["equal"]:
                problems.append(name)
        long_cfg = on_cfg.with_(max_new_tokens=300, max_seq_len=512)
        equals_off("ar_qk_norm_rope_in_qkv_300_equals_off", [Engine(riq, long_cfg).generate(prompts[0])],
                   [Engine(fast, long_cfg.with_(rope_in_qkv=False)).generate(prompts[0])])

    def l2_prefetch():
        # gate/up's weight read into L2 on a side stream during the layer's first launches (EngineConfig.
        # l2_prefetch, kernels/l2_prefetch.py), in each mode ("prefetch" and "bulk" are inline PTX: an illegal
        # instruction or a bad address would fail here first), all of the weight (the last line / chunk's bounds)
        # and half; graphed AR (the side stream a branch of the graph), eager AR, fused verify blocks (n-gram)
        from specpilot.kernels import l2_prefetch as l2

        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        off = [Engine(fast, base.with_(fused_verify=True)).generate(p) for p in prompts]
        try:
            for mode in l2.MODES:
                l2.MODE = mode
                for frac in (1.0, 0.5):
                    warm = copy.deepcopy(fast).use_l2_prefetch(frac)
                    cfg = base.with_(fused_verify=True, l2_prefetch=frac)
                    on = [Engine(warm, cfg).generate(p) for p in prompts]
                    equals_off(f"ar_l2_prefetch_{mode}_{frac}_equals_off", on, off)
                same_tokens(((f"ar_l2_prefetch_{mode}_eager", cfg.with_(cuda_graphs=False), warm),
                             (f"spec_ngram_l2_prefetch_{mode}", cfg.with_(drafter_kind="ngram"), warm)))
        finally:
            l2.MODE = "prefetch"

    def draft_chain_graph():
        # a small model drafter's K - 1 one-token passes captured as one graph, each argmax feeding the next
        # (EngineConfig.draft_chain_graph, drafters/small_ar.py): regular and fused layouts, self and other drafter
        c = base.with_(drafter_kind="model", draft_chain_graph=True)
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        fast_other = copy.deepcopy(other).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        for name, t, d in (("spec_other_chain", target, other), ("spec_self_chain", target, target),
                           ("spec_other_chain_fused", fast, fast_other)):
            drafter = build_drafter(c, d, t)
            chain = getattr(drafter, "inner", drafter).chain  # 0: the capture failed and it fell back (warned)
            record(name, [Engine(t, c, drafter).generate(p) for p in prompts], chain=chain)
            if chain != c.num_draft_tokens - 1:
                problems.append(f"{name}_not_chained")

    def prefill_graphs():
        # a prompt's prefill from one graph per padded length (EngineConfig.prefill_graphs, engine/prefill_graphs.py;
        # on by default, so the variants above ran it too): AR, and a small model drafter whose prompt feed goes
        # through its own runner's prefill graph and a one-token step; against the same engines with it off
        for name, c, d in (("ar", base, None), ("spec_other", base.with_(drafter_kind="model"), other)):
            eng = Engine(target, c, build_drafter(c, d, target))
            on = [eng.generate(p) for p in prompts]
            off_cfg = c.with_(prefill_graphs=0)
            off = [Engine(target, off_cfg, build_drafter(off_cfg, d, target)).generate(p) for p in prompts]
            equals_off(f"{name}_prefill_graphs_equals_off", on, off)
            runs = eng.runner.prefill_graphs.counts["graphed"]
            print(f"{name}_prefill_graphs_replays", runs, flush=True)
            if runs != len(prompts):
                problems.append(f"{name}_prefill_graphs: {runs} graphed prefills of {len(prompts)}")

    def megakernel():
        # every one-token step of one row through one persistent launch (EngineConfig.megakernel,
        # kernels/megakernel.py): AR, and a small model drafter whose target and drafter runners both take it,
        # against the same engines with it off (graphed: the 132-program grid inside the bucket's graph)
        for name, c, d in (("ar", base, None), ("spec_other", base.with_(drafter_kind="model"), other)):
            on_cfg = c.with_(megakernel=True)
            t_on = copy.deepcopy(target).fuse_projections()  # (it reads the fused qkv / gate+up weights)
            d_on = copy.deepcopy(d).fuse_projections() if d is not None else None
            eng = Engine(t_on, on_cfg, build_drafter(on_cfg, d_on, t_on))
            on = [eng.generate(p) for p in prompts]
            off = [Engine(target, c, build_drafter(c, d, target)).generate(p) for p in prompts]
            equals_off(f"{name}_megakernel_equals_off", on, off)
            taken = [eng.runner.megakernel is not None]
            if d_on is not None:  # the small drafter's own runner too
                taken.append(getattr(getattr(eng.drafter, "inner", eng.drafter), "runner").megakernel is not None)
            print(f"{name}_megakernel_taken", taken, flush=True)
            if not all(taken):
                problems.append(f"{name}_megakernel: taken {taken} (target, drafter)")

    def dflash_net():
        from specpilot.models.dflash import DFlashDrafter
        from specpilot.train.dflash_init import new_drafter_config

        torch.manual_seed(2)  # a random DFlash drafter, one layer, blocks of 8
        net = DFlashDrafter(new_drafter_config(target.config, num_layers=1, block_size=8, mask_token_id=5))
        return net.cuda().eval()

    def dflash():
        net = dflash_net()  # graphed (static) draft steps must draft what eager ones do
        taus = {}
        for graphs, kern in ((False, False), (True, False), (True, True)):
            c = base.with_(drafter_kind="dflash", num_draft_tokens=7, cuda_graphs=graphs, draft_attention_kernel=kern)
            outs = [Engine(target, c, build_drafter(c, net, target)).generate(p) for p in prompts]
            name = f"spec_dflash_{'graphed' if graphs else 'eager'}{'_draft_kernel' if kern else ''}"
            if kern:  # the draft block through the split-KV kernel: same verified output
                record(name, outs)
                continue
            taus[graphs] = [o.tau for o in outs]
            record(name, outs, tau=taus[graphs])
        if taus[False] != taus[True]:
            problems.append("dflash_graphed_drafts_differ")

    def early_draft():
        # EngineConfig.early_draft (engine/spec.py): the next block launched from the verdict on the device before
        # the host reads it (a pinned copy + event instead of .tolist()): same tokens, same drafts (tau), alone
        # and with prompt lookup beside it, on the default fast path
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_attention_kernel()
        net = dflash_net()
        for assist in (0, 2):
            c = base.with_(drafter_kind="dflash", num_draft_tokens=7, ngram_assist=assist)
            runs = {on: [Engine(fast, c.with_(early_draft=on), build_drafter(c, net, fast)).generate(p)
                         for p in prompts] for on in (False, True)}
            record(f"spec_dflash_early_draft{'_assist' if assist else ''}", runs[True],
                   tau=[o.tau for o in runs[True]])
            if [o.tau for o in runs[True]] != [o.tau for o in runs[False]]:
                problems.append(f"early_draft{'_assist' if assist else ''}_drafts_differ")
        # sampled (seeded): the early pass moves no random draw, so the same tokens as without it
        c = base.with_(drafter_kind="dflash", num_draft_tokens=7, sampling=SamplingConfig(temperature=0.8, seed=1))
        runs = {on: [Engine(fast, c.with_(early_draft=on), build_drafter(c, net, fast)).generate(p).output_ids
                     for p in prompts] for on in (False, True)}
        result["spec_dflash_early_draft_sampled"] = {"equal_to_off": runs[True] == runs[False]}
        print("spec_dflash_early_draft_sampled", result["spec_dflash_early_draft_sampled"], flush=True)
        if runs[True] != runs[False]:
            problems.append("early_draft_sampled_differs")

    def adaptive():
        # EngineConfig.adaptive (engine/adaptive.py): plain one-token steps mixed into speculation, on the default
        # fast path (kernels + fused decode: plain steps take the fused graphed one-token bucket). min_gain 1e9
        # makes every probe lose, so long plain runs and DFlash's catch-up limit are exercised
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_attention_kernel()
        for gain in (1.0, 1e9):
            on = base.with_(adaptive=True, adaptive_min_gain=gain)
            same_tokens(((f"spec_ngram_adaptive_{gain:g}", on.with_(drafter_kind="ngram"), fast),))
            c = on.with_(drafter_kind="dflash", num_draft_tokens=7)
            record(f"spec_dflash_adaptive_{gain:g}", [Engine(fast, c, build_drafter(c, dflash_net(), fast)).generate(p)
                                                      for p in prompts])

    def batch():
        from specpilot.engine.batch import generate_batch

        for graphs in (False, True):  # batched regeneration (train-drafter): eager and graphed equal batch-1 AR
            t0 = time.time()
            outs = generate_batch(target, prompts, 48, eos_ids=(), batch_size=len(prompts), cuda_graphs=graphs)
            name = f"batch_{'graphed' if graphs else 'eager'}"
            result[name] = {"equal": outs == ref, "setup_and_run_s": round(time.time() - t0, 1)}
            print(name, result[name], flush=True)
            if outs != ref:
                problems.append(name)

    def one_row_switch(field: str, flag: str):
        # a process-wide switch of the one-row GEMVs (EngineConfig field -> kernels/gemv_fused.py flag, which
        # load_target sets; autotuned per shape for each way): graphed AR and n-gram speculation against the same
        # engine without it
        from specpilot.kernels import gemv_fused

        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        off_cfg = base.with_(fused_verify=True)
        off = [Engine(fast, off_cfg).generate(p) for p in prompts]
        setattr(gemv_fused, flag, True)
        try:
            on = [Engine(fast, off_cfg.with_(**{field: True})).generate(p) for p in prompts]
            ngram = off_cfg.with_(**{field: True}, drafter_kind="ngram")
            same_tokens(((f"spec_ngram_{field}", ngram, fast),))
        finally:
            setattr(gemv_fused, flag, False)
        record(f"ar_{field}", on)
        equals_off(f"ar_{field}_equals_off", on, off)

    def gemv_prefetch():  # the first weight tile loaded ahead of the norm prologue
        one_row_switch("gemv_prefetch", "ONE_ROW_PREFETCH")

    def gemv_pipeline():  # the K loop one block ahead
        one_row_switch("gemv_pipeline", "ONE_ROW_PIPE")

    def early_loads(field: str, value=True, off_more=None, **more):
        # a switch of the one-row GEMVs and qkv + RoPE that the engine sets from the config (kernels/gemv_fused.py
        # and qkv_rope.py; tiles not re-tuned): graphed AR with RoPE in the qkv GEMV's epilogue against the same
        # without the switch (off_more: fields both runs take), eager AR, n-gram speculation
        # (Engine() sets no process-wide switch: each run sets its config's, config_switches, restored after)
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        riq = fast.use_rope_in_qkv()
        off_cfg = base.with_(fused_verify=True, rope_in_qkv=True, **(off_more or {}))
        on_cfg = off_cfg.with_(**{field: value}, **more)
        with config_switches(off_cfg):
            off, off_state = [Engine(riq, off_cfg).generate(p) for p in prompts], kernel_switches()
        with config_switches(on_cfg):
            on, on_state = [Engine(riq, on_cfg).generate(p) for p in prompts], kernel_switches()
            same_tokens(((f"ar_{field}_eager", on_cfg.with_(cuda_graphs=False), riq),
                         (f"spec_ngram_{field}", on_cfg.with_(drafter_kind="ngram"), riq)))
        record(f"ar_{field}", on)
        equals_off(f"ar_{field}_equals_off", on, off)
        switches_differ(field, on_state, off_state)

    def early_epilogue():  # the epilogue's operands loaded right after the wait (EARLY_EPILOGUE)
        early_loads("early_epilogue")

    def tile_after_wait():  # the first weight tile right after the wait, ahead of the norm prologue
        early_loads("tile_after_wait")

    def attn_single_direct():  # the only working slice stores the output itself (256 keys a program: 1 slice)
        early_loads("attn_single_direct", attn_split_keys=256)

    def attn_merge_unroll():  # the merge's loads 4 slices at a time (64 keys a program: several slices), both runs,
        # against the serial loop (0; 4 is the default since session 40, so "off" must name the loop)
        early_loads("attn_merge_unroll", 4, dict(attn_split_keys=64, attn_merge_unroll=0))

    def attn_block_keys():  # a program's 128 keys in one inner step (one K/V tile, one softmax pass) against two
        # of 64 (128 is the default since session 41, so "off" must name 64): the same attention up to the online
        # softmax's fp32 order, so the same tokens barring a near-tie
        early_loads("attn_block_keys", 128, dict(attn_block_keys=64))

    def attn_loads_first():  # V asked for with K and the merge's first partials with the maxima (several slices:
        # 64 keys a program; 300 new tokens, so up to 5 slices: a first group of 4 and a second)
        early_loads("attn_loads_first", True, dict(attn_split_keys=64))

    def attn_cluster():  # the slices of a KV head merged inside a CTA cluster of 8 (16 keys a program: up to 5
        # slices of the 70 positions in one cluster, the rest of its CTAs empty partials), against the one-launch
        # kernel's merge (0; 8 is the default since session 42, so "off" must name 0)
        early_loads("attn_cluster", 8, dict(attn_split_keys=16, attn_cluster=0))

    def attn_cluster_groups():  # clusters of 4 CTAs (16 keys a program): past 64 positions two clusters, whose
        # partials the last CTA to arrive merges
        early_loads("attn_cluster", 4, dict(attn_split_keys=16, attn_cluster=0))

    def attn_cluster_even():  # one cluster of 4 takes every visible key in whole 16-key tiles (up to 2 a CTA at
        # 70 positions), against clusters of 4 over fixed 16-key slices (two clusters past 64 positions)
        early_loads("attn_cluster_even", True, dict(attn_split_keys=16, attn_block_keys=16, attn_cluster=4))

    def attn_cluster_push():  # clusters of 4 over 16-key slices (two past 64 positions), the partials pushed to
        # the CTA that merges them, against the same clusters reading them remotely (on by default since session
        # 49, so "off" must name False)
        early_loads("attn_cluster_push", True, dict(attn_split_keys=16, attn_cluster=4, attn_cluster_push=False))

    def qkv_pipeline():  # qkv + RoPE's K loop two blocks ahead (the same sums in the same order)
        early_loads("qkv_pipeline")

    def attn_stages():  # the attention's slice loop in 2 pipeline stages instead of Triton's 3 (same sums)
        early_loads("attn_stages", 2)

    def verify_one_launch():  # a verify block's attention in one launch (its n-gram speculation's blocks), against
        # the split + merge pair (on by default since session 52, so "off" must name False)
        early_loads("verify_one_launch", True, dict(verify_one_launch=False))

    def norm_pdl():  # the RMSNorm launches with PDL (its n-gram speculation's verify blocks: two a layer), against
        # plain launches (on by default since session 52, so "off" must name False)
        early_loads("norm_pdl", True, dict(norm_pdl=False))

    def norm_handoff():
        # a verify block's residual GEMVs hand the next GEMV their rows' sums of squares (EngineConfig.norm_handoff,
        # kernels/norm_handoff.py): a partial stored in the wrong place, or read before it is written, shows as other
        # tokens than eager AR's in n-gram speculation (verify blocks of up to 5 and 16 tokens; split-K at
        # down_proj), graphed and eager, and in a random DFlash drafter's 8-token blocks (its layer features)
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        hand = fast.use_norm_handoff()
        ngram_on = base.with_(fused_verify=True, norm_handoff=True, drafter_kind="ngram")
        same_tokens((("spec_ngram_norm_handoff", ngram_on, hand),
                     ("spec_ngram_norm_handoff_eager", ngram_on.with_(cuda_graphs=False), hand),
                     ("spec_ngram16_norm_handoff", ngram_on.with_(num_draft_tokens=15), hand)))
        c = ngram_on.with_(drafter_kind="dflash", num_draft_tokens=7)
        record("spec_dflash_norm_handoff", [Engine(hand, c, build_drafter(c, dflash_net(), hand)).generate(p)
                                            for p in prompts])

    def verify_rope_in_qkv():
        # a verify block's RoPE + K/V write in its qkv GEMM's epilogue (EngineConfig.verify_rope_in_qkv,
        # kernels/qkv_rope_rows.py), alone and with the norm handoff: a pair of columns rotated with the wrong
        # partner, a slot written for the wrong token or not at all shows as other tokens than eager AR's in n-gram
        # speculation (blocks of up to 5 and 16 tokens), graphed and eager, and in a random DFlash drafter's blocks
        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode().use_fused_verify()
        for extra in ({}, {"norm_handoff": True}):
            tag = "_handoff" if extra else ""
            m = copy.deepcopy(fast).use_verify_rope_in_qkv()
            if extra:
                m.use_norm_handoff()
            ngram_on = base.with_(fused_verify=True, verify_rope_in_qkv=True, drafter_kind="ngram", **extra)
            same_tokens(((f"spec_ngram_verify_rope_in_qkv{tag}", ngram_on, m),
                         (f"spec_ngram_verify_rope_in_qkv{tag}_eager", ngram_on.with_(cuda_graphs=False), m),
                         (f"spec_ngram16_verify_rope_in_qkv{tag}", ngram_on.with_(num_draft_tokens=15), m)))
            c = ngram_on.with_(drafter_kind="dflash", num_draft_tokens=7)
            record(f"spec_dflash_verify_rope_in_qkv{tag}",
                   [Engine(m, c, build_drafter(c, dflash_net(), m)).generate(p) for p in prompts])

    def qkv_trigger_first():  # qkv + RoPE lets the attention launch first thing; the attention preloads old K/V
        early_loads("qkv_trigger_first", attn_kv_preload=True)

    def rope_split():
        # q's heads over several RoPE + K/V-write programs (kernels/rope_write.py Q_HEADS_PER_PROGRAM, 4 a program):
        # graphed AR and n-gram speculation against the same engine with one program for all q heads
        from specpilot.kernels import rope_write

        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode()
        rope_write.Q_HEADS_PER_PROGRAM = 0
        off = [Engine(fast, base).generate(p) for p in prompts]
        for n in (4, 8):  # 8: EngineConfig.rope_q_heads's default
            rope_write.Q_HEADS_PER_PROGRAM = n
            try:
                on = [Engine(fast, base).generate(p) for p in prompts]
                same_tokens(((f"spec_ngram_rope_split_{n}", ngram, fast),))
            finally:
                rope_write.Q_HEADS_PER_PROGRAM = 0
            record(f"ar_rope_split_{n}", on)
            equals_off(f"ar_rope_split_{n}_equals_off", on, off)

    def attn_split():
        # the one-token attention over 64 / 256 keys a program (EngineConfig.attn_split_keys, kernels/
        # decode_attention.py ONE_LAUNCH_SPLIT): another merge order of the same fp32 partials, so graphed AR (also
        # 300 new tokens, past several slice boundaries) and n-gram speculation against eager AR's tokens
        from specpilot.kernels import decode_attention

        fast = copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode()
        long_cfg = base.with_(max_new_tokens=300, max_seq_len=512)
        long_ref = [Engine(target, long_cfg.with_(cuda_graphs=False)).generate(p).output_ids for p in prompts[:1]]
        for keys in (64, 256):
            decode_attention.ONE_LAUNCH_SPLIT = (keys, 64)
            try:
                record(f"ar_attn_split_{keys}", [Engine(fast, base).generate(p) for p in prompts])
                same_tokens(((f"spec_ngram_attn_split_{keys}", ngram, fast),))
                got = [Engine(fast, long_cfg).generate(p).output_ids for p in prompts[:1]]
            finally:
                decode_attention.ONE_LAUNCH_SPLIT = (128, 64)
            result[f"ar_attn_split_{keys}_300"] = {"equal": got == long_ref}
            print(f"ar_attn_split_{keys}_300", result[f"ar_attn_split_{keys}_300"], flush=True)
            if got != long_ref:
                problems.append(f"ar_attn_split_{keys}_300")

    def pdl_kv_l2():
        # the one-token attention's K/V L2 hint before its PDL wait (EngineConfig.pdl_kv_l2, kernels/
        # decode_attention.py PDL_KV_L2): a hint, so the tokens must be those without it; graphed AR (also past two
        # slice boundaries: 300 new tokens), n-gram speculation, against the same engine under PDL late without it
        from specpilot.kernels import decode_attention, pdl

        fast = fused_under_pdl_late("pdl_kv_l2")
        if fast is None:
            return
        try:
            off = [Engine(fast, base).generate(p) for p in prompts]
            long_cfg = base.with_(max_new_tokens=300, max_seq_len=512)
            long_off = [Engine(fast, long_cfg).generate(p) for p in prompts[:1]]
            decode_attention.PDL_KV_L2 = True
            on = [Engine(fast, base.with_(pdl_kv_l2=True)).generate(p) for p in prompts]
            record("ar_pdl_kv_l2", on)
            equals_off("ar_pdl_kv_l2_equals_off", on, off)
            equals_off("ar_pdl_kv_l2_300_equals_off", [Engine(fast, long_cfg).generate(p) for p in prompts[:1]],
                       long_off)
            same_tokens((("spec_ngram_pdl_kv_l2", ngram.with_(pdl_kv_l2=True), fast),))
        finally:
            pdl.set_enabled(False)
            decode_attention.PDL_KV_L2 = False

    def pdl_l2_next():
        # o_proj's one-token GEMV warming the head of gate/up's weight before its PDL wait (EngineConfig.
        # pdl_l2_next_mb, kernels/gemv_fused.py PDL_L2_NEXT_BYTES; here all of it): a hint, so the tokens must be
        # those without it: graphed AR (also 300 new tokens), n-gram speculation, against the same engine under PDL
        # late without it. It applies only behind an o_proj warmed itself (pdl_l2_mb; the check model's 3 MiB
        # o_proj is within the default 8), so each run takes its config's switches (config_switches: until session
        # 41 this section set PDL_L2_NEXT_BYTES alone, with the o_proj warming off, and compared nothing)
        fast = fused_under_pdl_late("pdl_l2_next")
        if fast is None:
            return
        from specpilot.kernels import pdl

        pdl.set_enabled(False)  # config_switches sets it from each config (on, late, by default)
        off_cfg, on_cfg = base.with_(pdl_l2_next_mb=0), base.with_(pdl_l2_next_mb=1024)
        long_cfg = dict(max_new_tokens=300, max_seq_len=512)
        with config_switches(off_cfg):
            off, off_state = [Engine(fast, off_cfg).generate(p) for p in prompts], kernel_switches()
            long_off = [Engine(fast, off_cfg.with_(**long_cfg)).generate(p) for p in prompts[:1]]
        with config_switches(on_cfg):
            on, on_state = [Engine(fast, on_cfg).generate(p) for p in prompts], kernel_switches()
            long_on = [Engine(fast, on_cfg.with_(**long_cfg)).generate(p) for p in prompts[:1]]
            same_tokens((("spec_ngram_pdl_l2_next", ngram.with_(pdl_l2_next_mb=1024), fast),))
        record("ar_pdl_l2_next", on)
        equals_off("ar_pdl_l2_next_equals_off", on, off)
        equals_off("ar_pdl_l2_next_300_equals_off", long_on, long_off)
        switches_differ("pdl_l2_next", on_state, off_state)

    def attn_merge():
        # the one-token attention's merge in chunks (EngineConfig.attn_merge_chunk, decode_attention.MERGE_CHUNK)
        # and its positions read before the PDL wait (attn_early_pos, PDL_EARLY_POS), under PDL late, 64 keys a
        # program so 300 new tokens make 5-6 slices (chunks of 4 loop, of 8 are partly masked): graphed AR and
        # n-gram speculation against the same engine with the serial merge
        from specpilot.kernels import decode_attention, pdl

        fast = fused_under_pdl_late("attn_merge")
        if fast is None:
            return
        decode_attention.ONE_LAUNCH_SPLIT = (64, 64)
        try:
            long_cfg = base.with_(max_new_tokens=300, max_seq_len=512)
            off = [Engine(fast, base).generate(p) for p in prompts]
            long_off = [Engine(fast, long_cfg).generate(p) for p in prompts[:1]]
            for chunk, early in ((4, True), (8, False), (8, True)):
                name = f"attn_merge_{chunk}{'_early_pos' if early else ''}"
                decode_attention.MERGE_CHUNK, decode_attention.PDL_EARLY_POS = chunk, early
                cfg = base.with_(attn_merge_chunk=chunk, attn_early_pos=early)
                on = [Engine(fast, cfg).generate(p) for p in prompts]
                record(f"ar_{name}", on)
                equals_off(f"ar_{name}_equals_off", on, off)
                equals_off(f"ar_{name}_300_equals_off", [Engine(fast, long_cfg).generate(p) for p in prompts[:1]],
                           long_off)
                same_tokens(((f"spec_ngram_{name}", ngram.with_(attn_merge_chunk=chunk, attn_early_pos=early),
                              fast),))
        finally:
            pdl.set_enabled(False)
            decode_attention.MERGE_CHUNK, decode_attention.PDL_EARLY_POS = 0, False
            decode_attention.ONE_LAUNCH_SPLIT = (128, 64)

    def attn_kv_preload():
        # the one-token attention's older K/V rows loaded before the PDL wait (EngineConfig.attn_kv_preload,
        # decode_attention.KV_PRELOAD), under PDL late, with 128 keys a program (two preloaded blocks) and 64 (one):
        # 300 new tokens cross slice boundaries, so slot p falls on every position of a slice; graphed AR and n-gram
        # speculation against the same engine without it
        from specpilot.kernels import decode_attention, pdl

        fast = fused_under_pdl_late("attn_kv_preload")
        if fast is None:
            return
        try:
            long_cfg = base.with_(max_new_tokens=300, max_seq_len=512)
            for split in ((128, 64), (64, 64)):
                decode_attention.ONE_LAUNCH_SPLIT, decode_attention.KV_PRELOAD = split, False
                off = [Engine(fast, base).generate(p) for p in prompts]
                long_off = [Engine(fast, long_cfg).generate(p) for p in prompts[:1]]
                decode_attention.KV_PRELOAD = True
                name = f"attn_kv_preload_{split[0]}"
                cfg = base.with_(attn_kv_preload=True)
                on = [Engine(fast, cfg).generate(p) for p in prompts]
                record(f"ar_{name}", on)
                equals_off(f"ar_{name}_equals_off", on, off)
                equals_off(f"ar_{name}_300_equals_off",
                           [Engine(fast, long_cfg.with_(attn_kv_preload=True)).generate(p) for p in prompts[:1]],
                           long_off)
                same_tokens(((f"spec_ngram_{name}", ngram.with_(attn_kv_preload=True), fast),))
        finally:
            pdl.set_enabled(False)
            decode_attention.KV_PRELOAD = False
            decode_attention.ONE_LAUNCH_SPLIT = (128, 64)

    checks = {"defaults": defaults, "attention_kernel": attention_kernel, "norm_kernel": norm_kernel, "fused_decode": fused_decode,
              "fused_verify": fused_verify, "lossless12": lossless12, "pdl": pdl_launch,
              "norm_epilogue": norm_epilogue, "rope_in_attention": rope_in_attention, "rope_in_qkv": rope_in_qkv,
              "rope_in_qkv_qk_norm": rope_in_qkv_qk_norm,
              "gemv_prefetch": gemv_prefetch, "gemv_pipeline": gemv_pipeline, "early_epilogue": early_epilogue,
              "tile_after_wait": tile_after_wait, "qkv_trigger_first": qkv_trigger_first,
              "attn_single_direct": attn_single_direct, "attn_merge_unroll": attn_merge_unroll,
              "attn_block_keys": attn_block_keys, "attn_loads_first": attn_loads_first,
              "attn_cluster": attn_cluster, "attn_cluster_groups": attn_cluster_groups,
              "attn_cluster_even": attn_cluster_even, "attn_cluster_push": attn_cluster_push,
              "qkv_pipeline": qkv_pipeline, "attn_stages": attn_stages, "verify_one_launch": verify_one_launch,
              "norm_pdl": norm_pdl, "norm_handoff": norm_handoff, "verify_rope_in_qkv": verify_rope_in_qkv,
              "rope_split": rope_split, "attn_split": attn_split,
              "pdl_kv_l2": pdl_kv_l2, "pdl_l2_next": pdl_l2_next, "attn_merge": attn_merge,
              "attn_kv_preload": attn_kv_preload, "l2_prefetch": l2_prefetch,
              "draft_chain_graph": draft_chain_graph, "prefill_graphs": prefill_graphs, "megakernel": megakernel,
              "dflash": dflash,
              "early_draft": early_draft, "adaptive": adaptive, "batch": batch}
    for name in SECTIONS:
        if not only or name in only:
            section(name, checks[name])
    result["problems"] = problems
    print(json.dumps(result))
    return 1 if problems else 0


def parse_args(argv: list[str]) -> tuple[str, ...]:
    """-> the sections of --only= (empty: everything); `--help` prints the module docstring; bad input exits 2."""
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        print(f"\nusage: gpu_engine_check.py [--only={','.join(SECTIONS)}]")
        sys.exit(0)
    only: tuple[str, ...] = ()
    for a in argv:
        names = a.split("=", 1)[1].split(",") if a.startswith("--only=") else None
        if names is None or not names or any(n not in SECTIONS for n in names):
            print(f"gpu_engine_check.py: unexpected argument {a!r}; takes --only= with names from "
                  f"{', '.join(SECTIONS)}", file=sys.stderr)
            sys.exit(2)
        only += tuple(names)
    return only


if __name__ == "__main__":
    sections = parse_args(sys.argv[1:])
    if not torch.cuda.is_available():  # a GPU script: one clear line, not a traceback from the first CUDA tensor
        print("gpu_engine_check: needs a CUDA GPU (run it on the device machine: scripts/GPU_SESSION.md)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sections))
