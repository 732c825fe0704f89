"""GPU check of `grouped_attention` (GQA folded into the query length) against SDPA's own `enable_gqa` path:
parity and CUDA-event timings at decode shapes, and batched-regeneration throughput (engine/batch.py) with each.
Random weights at the Qwen2.5-1.5B shape. Prints one JSON line per measurement."""

import json
import time

import torch
import torch.nn.functional as F

from specpilot.costmodel.shapes import synthetic_config
from specpilot.engine.batch import generate_batch
from specpilot.models import dense
from specpilot.models.loader import random_model


def old_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


dev = "cuda"
for B, T, S in ((1, 1, 4096), (1, 16, 4096), (256, 1, 1280), (64, 1, 2048)):
    H, Hkv, D = 12, 2, 128
    q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
    pos = torch.full((B, T), S - T, device=dev) + torch.arange(T, device=dev)
    mask = (torch.arange(S, device=dev)[None, None] <= pos[:, :, None])[:, None]
    diff = (old_attention(q, k, v, mask).float() - dense.grouped_attention(q, k, v, mask).float()).abs().max().item()
    print(json.dumps({"B": B, "T": T, "S": S, "max_abs_diff": diff,
                      "old_ms": round(timed(lambda: old_attention(q, k, v, mask)), 4),
                      "grouped_ms": round(timed(lambda: dense.grouped_attention(q, k, v, mask)), 4)}), flush=True)

cfg = synthetic_config("qwen2.5-1.5b")
model = random_model(cfg, dtype=torch.bfloat16, device=dev)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 150000, (int(n),), generator=g).tolist() for n in torch.randint(64, 512, (256,), generator=g)]
outs = {}
for name, fn in (("grouped", dense.grouped_attention), ("old", old_attention)):
    dense.grouped_attention = fn
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = generate_batch(model, prompts, 96, eos_ids=(), batch_size=256)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    outs[name] = res
    print(json.dumps({"regen": name, "B": 256, "new_tokens": 96, "s": round(dt, 2),
                      "tok_per_s": round(sum(map(len, res)) / dt)}), flush=True)
same = sum(a == b for a, b in zip(outs["grouped"], outs["old"]))
print(json.dumps({"regen_rows_identical": same, "of": len(prompts)}))
