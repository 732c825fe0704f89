#!/usr/bin/env python
"""GPU parity and speed of the fused-decode kernels (models/fused_decode.py) at real shapes, bf16, random values.

Why: the CPU tests run these kernels in Triton's interpreter, one program at a time; on the GPU programs finish in
any order (the one-launch attention's last-program merge depends on its atomics' ordering) and bf16 rounds for
real. Checks: (1) one-launch attention == the two-launch kernel bit for bit, 200 calls with fresh positions,
eagerly and as a replayed CUDA graph, counters zero afterwards; (2) the fused GEMV (norm prologue, bias, residual,
SiLU * up) and RoPE + K/V write (1 and 16 tokens) against their PyTorch twins at the 1.5B and 8B shapes, and the
same GEMVs (+ the LM head) over lossless 12-bit weights (kernels/gemv12.py): their decode bit-exact (one-hot inputs
pick single weight columns), their outputs vs the twins; (3) the M-row fused GEMV of a fused verify step
(EngineConfig.fused_verify, the tl.dot kernel) at M = 2, 5, 16 against the twin at the same shapes, and its graphed
time at M = 16 vs M = 1 and vs cuBLAS at M = 16; with a norm also the pre-normalized path fused_verify takes
(models/fused_decode.py PRENORM_ROWS: the RMSNorm kernel, then the GEMV without its prologue), the autotuner's
choice (split-K for down_proj?), 50 repeated calls bit-equal (split-K's fixed merge order) and the split-K
counters zero afterwards; (4) graphed time of each fused launch vs the launches it replaces
(`--only=attention,gemv,gemm,rope` picks parts; `gemv12`: only the 12-bit GEMVs). Last stdout line: one JSON
object (times in us).
"""

from __future__ import annotations

import json
import sys

import torch

from specpilot.costmodel import synthetic_config
from specpilot.costmodel.hardware import time_median_s
from specpilot.kernels.decode_attention import _counters, decode_attention
from specpilot.formats.lossless12 import pack
from specpilot.kernels.gemv12 import gemv12
from specpilot.kernels import gemm_rows
from specpilot.kernels.gemv_fused import gemv_fused, gemv_fused_reference
from specpilot.kernels.rmsnorm import rmsnorm
from specpilot.kernels.rope_write import rope_write, rope_write_reference


def graphed_us(fn, reps: int = 20) -> float:
    """Time per call of `fn`, `reps` calls captured back to back in one CUDA graph and replayed (after eager
    warm-up): a graph of one small kernel would time mostly the replay's own launch."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return round(time_median_s(g.replay, warmup=5, repeats=50) * 1e6 / reps, 2)


def attention_parity(out: dict) -> None:
    torch.manual_seed(0)
    worst = 0
    for B, H, Hkv, T in ((1, 12, 2, 1), (1, 32, 8, 1), (1, 12, 2, 16), (2, 14, 2, 5)):
        S, D = 4096, 128 if H != 14 else 64
        q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
        pos = torch.zeros(B, T, dtype=torch.long, device="cuda")
        bad = 0
        for i in range(200):  # eager, fresh positions each call (short and long contexts)
            end = torch.randint(T - 1, S, (B,), device="cuda") if i % 4 else torch.full((B,), T - 1, device="cuda")
            pos.copy_(end[:, None] - (T - 1) + torch.arange(T, device="cuda")[None])
            a = decode_attention(q, k, v, pos)
            b = decode_attention(q, k, v, pos, one_launch=True)
            bad += int(not torch.equal(a, b))
        g_bad = 0
        res = torch.empty_like(q)
        g = torch.cuda.CUDAGraph()
        decode_attention(q, k, v, pos, one_launch=True)
        with torch.cuda.graph(g):
            res.copy_(decode_attention(q, k, v, pos, one_launch=True))
        for i in range(200):  # replayed, positions changed in place
            end = torch.randint(T - 1, S, (B,), device="cuda")
            pos.copy_(end[:, None] - (T - 1) + torch.arange(T, device="cuda")[None])
            g.replay()
            g_bad += int(not torch.equal(res, decode_attention(q, k, v, pos)))
        key = f"B{B}_H{H}_Hkv{Hkv}_T{T}"
        pos.copy_(torch.full((B, T), 511, device="cuda") - (T - 1) + torch.arange(T, device="cuda")[None])
        out[f"attn_{key}"] = {"eager_mismatches": bad, "graph_mismatches": g_bad,
                              "two_launch_us": graphed_us(lambda: decode_attention(q, k, v, pos)),
                              "one_launch_us": graphed_us(lambda: decode_attention(q, k, v, pos, one_launch=True))}
        worst = max(worst, bad + g_bad)
        print(key, out[f"attn_{key}"], flush=True)
    for name, (H, Hkv) in (("1.5b", (12, 2)), ("8b", (32, 8))):  # the one-launch path's split sizes, T = 1
        q = torch.randn(1, H, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, 4096, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for ctx in (512, 2048):
            pos = torch.tensor([[ctx - 1]], device="cuda")
            row = {"two_launch_128_64": graphed_us(lambda: decode_attention(q, k, v, pos))}
            for split, block in ((128, 64), (128, 128), (64, 64), (64, 32), (32, 32), (256, 64)):
                row[f"one_{split}_{block}"] = graphed_us(lambda: decode_attention(
                    q, k, v, pos, split_s=split, block_s=block, one_launch=True))
            out[f"attn_sweep_{name}_ctx{ctx}"] = row
            print(name, ctx, row, flush=True)
    out["attn_counters_zero"] = bool((_counters(torch.device("cuda"), 1) == 0).all())
    out["attn_ok"] = worst == 0 and out["attn_counters_zero"]


def gemv_parity(out: dict, only12: bool = False) -> None:
    torch.manual_seed(1)
    for name in ("qwen2.5-1.5b", "qwen3-8b"):
        c = synthetic_config(name)
        H, I, qkv = c.hidden_size, c.intermediate_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        nw = 1 + 0.02 * torch.randn(H, device="cuda", dtype=torch.bfloat16)

        def w(n, k):
            return 0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)

        cases = {"qkv_norm_bias": (x, w(qkv, H), dict(bias=0.02 * torch.randn(qkv, device="cuda", dtype=torch.bfloat16),
                                                     norm_weight=nw, eps=1e-6)),
                 "o_residual": (torch.randn(1, c.num_attention_heads * c.head_dim, device="cuda", dtype=torch.bfloat16),
                                w(H, c.num_attention_heads * c.head_dim), dict(residual=x)),
                 "gate_up_norm_silu": (x, w(2 * I, H), dict(norm_weight=nw, eps=1e-6, act="silu_mul")),
                 "down_residual": (torch.randn(1, I, device="cuda", dtype=torch.bfloat16), w(H, I), dict(residual=x)),
                 "lm_head": (x, w(c.vocab_size, H), dict())}
        # the same qkv / gate_up without the norm prologue: what a GEMV reading an already-normed x (a separate
        # RMSNorm launch, or the previous GEMV's epilogue) streams
        cases["qkv_bias_nonorm"] = (x, cases["qkv_norm_bias"][1], dict(bias=cases["qkv_norm_bias"][2]["bias"]))
        cases["gate_up_silu_nonorm"] = (x, cases["gate_up_norm_silu"][1], dict(act="silu_mul"))
        for case, (xi, wi, kw) in cases.items():
            want = gemv_fused_reference(xi, wi, **kw)
            row = {}
            if not only12:  # the 16-bit fused GEMV and cuBLAS beside it
                got = gemv_fused(xi, wi, **kw)
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                bias = kw.get("bias")
                plain_us = graphed_us(lambda: torch.nn.functional.linear(xi, wi, bias))
                us = graphed_us(lambda: gemv_fused(xi, wi, **kw))
                row = {"max_rel_err": round(err, 5), "fused_us": us, "cublas_linear_us": plain_us,
                       "fused_TBps": round(wi.numel() * 2 / us / 1e6, 2)}
            p = pack(wi)
            got12 = gemv12(xi, p, **kw)
            us12 = graphed_us(lambda: gemv12(xi, p, **kw))
            row.update({"w12_max_rel_err": round(((got12.float() - want.float()).abs().max()
                                                  / want.float().abs().max()).item(), 5),
                        "w12_equal_frac": round((got12 == want).float().mean().item(), 4),
                        "w12_us": us12, "w12_TBps_stored": round(p.nbytes() / us12 / 1e6, 2),
                        "w12_exceptions": p.num_exceptions, "w12_decode_exact": _decode_exact(p, wi)})
            out[f"gemv_{name}_{case}"] = row
            print(name, case, row, flush=True)


def gemm_parity(out: dict) -> None:
    """The M-row fused GEMV (M >= 2: kernels/gemm_rows.py `_gemm_fused_kernel`, tl.dot) against its twin at M = 2,
    5, 16 (bf16: tl.dot's products exact, fp32 sums, so a few ulp at most), then graphed M = 16 vs M = 1 (the
    weights are read once either way: ideally about the same time) and vs cuBLAS at M = 16 (the regular verify)."""
    torch.manual_seed(3)
    for name in ("qwen2.5-1.5b", "qwen3-8b"):
        c = synthetic_config(name)
        H, I, qkv = c.hidden_size, c.intermediate_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        heads = c.num_attention_heads * c.head_dim
        nw = 1 + 0.02 * torch.randn(H, device="cuda", dtype=torch.bfloat16)

        def w(n, k):
            return 0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)

        # case -> (weight, K, kwargs); the residual cases get an [M, H] residual per M. The LM head of a verify
        # step stays cuBLAS: timed for comparison only
        cases = {"qkv_norm_bias": (w(qkv, H), H, dict(bias=0.02 * torch.randn(qkv, device="cuda", dtype=torch.bfloat16),
                                                      norm_weight=nw, eps=1e-6)),
                 "o_residual": (w(H, heads), heads, {}),
                 "gate_up_norm_silu": (w(2 * I, H), H, dict(norm_weight=nw, eps=1e-6, act="silu_mul")),
                 "down_residual": (w(H, I), I, {}),
                 "lm_head": (w(c.vocab_size, H), H, {})}
        for case, (wi, k, kw) in cases.items():
            def inputs(M):
                x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
                if "residual" in case:
                    return x, {**kw, "residual": torch.randn(M, H, device="cuda", dtype=torch.bfloat16)}
                return x, kw

            row = {}
            for M in (2, 5, 16):
                xi, kwi = inputs(M)
                got, want = gemv_fused(xi, wi, **kwi), gemv_fused_reference(xi, wi, **kwi)
                row[f"M{M}_max_rel_err"] = round(((got.float() - want.float()).abs().max()
                                                  / want.float().abs().max()).item(), 5)
                row[f"M{M}_equal_frac"] = round((got == want).float().mean().item(), 4)
            (x1, kw1), (x16, kw16) = inputs(1), inputs(16)
            bias = kw16.get("bias")
            row["m1_us"] = graphed_us(lambda: gemv_fused(x1, wi, **kw1))
            row["m16_us"] = graphed_us(lambda: gemv_fused(x16, wi, **kw16))
            row["m16_config"] = _picked_config()  # the M = 16 call's autotuned tile (SPLIT_K > 1: split-K)
            first = gemv_fused(x16, wi, **kw16)
            row["m16_repeat_mismatches"] = sum(not torch.equal(first, gemv_fused(x16, wi, **kw16)) for _ in range(50))
            if "norm_weight" in kw16:  # what fused_verify runs (PRENORM_ROWS): RMSNorm launch + norm-free GEMV
                plain = {k: v for k, v in kw16.items() if k not in ("norm_weight", "eps")}
                pre = gemv_fused(rmsnorm(x16, nw, 1e-6), wi, **plain)
                row["m16_prenorm_equal_frac"] = round((pre == first).float().mean().item(), 4)
                row["m16_prenorm_us"] = graphed_us(lambda: gemv_fused(rmsnorm(x16, nw, 1e-6), wi, **plain))
                row["m16_prenorm_config"] = _picked_config()
            row["cublas_m16_us"] = graphed_us(lambda: torch.nn.functional.linear(x16, wi, bias))
            row["m16_over_m1"] = round(row["m16_us"] / row["m1_us"], 3)
            row["m16_TBps"] = round(wi.numel() * 2 / row["m16_us"] / 1e6, 2)
            out[f"gemm_{name}_{case}"] = row
            print(name, case, row, flush=True)
        del cases
        torch.cuda.empty_cache()
    counters = gemm_rows._SPLIT_COUNTERS.get(torch.device("cuda", torch.cuda.current_device()))
    out["gemm_split_k_used"] = counters is not None  # some shape let the autotuner try split-K
    out["gemm_split_k_counters_zero"] = counters is None or bool((counters == 0).all())


def _picked_config() -> str | None:
    """The M-row kernel's config of its latest launch (the autotuner's `best_config`; None where this Triton's
    autotuner has no such attribute)."""
    cfg = getattr(gemm_rows._gemm_kernel, "best_config", None)
    return None if cfg is None else str(cfg)


def _decode_exact(p, wi) -> bool:
    """One-hot inputs pick single columns of W: gemv12 must return them bit for bit (a GEMV with one nonzero
    product per row has no summation order), over the first 16 columns (both nibbles, both low-byte halves) and
    48 random ones."""
    k = wi.shape[1]
    cols = list(range(16)) + torch.randint(16, k, (48,)).tolist()
    for col in cols:
        e = torch.zeros(1, k, device=wi.device, dtype=wi.dtype)
        e[0, col] = 1
        if not torch.equal(gemv12(e, p)[0], wi[:, col]):
            return False
    return True


def rope_parity(out: dict) -> None:
    """T = 1 (fused decode) and T = 16 (a fused verify block: one program per token and q / k / v)."""
    torch.manual_seed(2)
    for name, qk_norm in (("qwen2.5-1.5b", False), ("qwen3-8b", True)):
        c = synthetic_config(name)
        H, Hkv, D, S = c.num_attention_heads, c.num_key_value_heads, c.head_dim, 4096
        for T in (1, 16):
            qkv = torch.randn(1, T, (H + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
            q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
            q, k, v = (t.view(1, T, n, D).transpose(1, 2) for t, n in ((q, H), (k, Hkv), (v, Hkv)))
            ang = torch.rand(1, 1, T, D, device="cuda") * 6
            cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
            pos = torch.arange(700, 700 + T, device="cuda")[None]
            nw = (1 + 0.02 * torch.randn(D, device="cuda", dtype=torch.bfloat16)) if qk_norm else None
            caches = [torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            ref_caches = [t.clone() for t in caches]
            got = rope_write(q, k, v, cos, sin, pos, *caches, nw, nw)
            want = rope_write_reference(q, k, v, cos, sin, pos, *ref_caches, nw, nw)
            ok = torch.equal(caches[1], ref_caches[1])
            err = max((got.float() - want.float()).abs().max().item(),
                      (caches[0] - ref_caches[0]).float().abs().max().item())
            key = f"rope_write_{name}" + ("" if T == 1 else f"_T{T}")
            out[key] = {"max_abs_err": err, "v_equal": ok,
                        "us": graphed_us(lambda: rope_write(q, k, v, cos, sin, pos, *caches, nw, nw))}
            print(name, key, out[key], flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_fused_check.py needs CUDA", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name()}
    only = [a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--only=")]  # e.g. --only=gemv
    for fn in (attention_parity, gemv_parity, gemm_parity, rope_parity):
        name = fn.__name__.split("_")[0]
        if only and name not in only[0] and not (name == "gemv" and "gemv12" in only[0]):
            continue
        try:
            fn(out, only12=True) if only and name == "gemv" and "gemv" not in only[0] else fn(out)
        except Exception as e:  # a diagnostic: report, keep checking the rest
            import traceback

            traceback.print_exc()
            out[fn.__name__] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
