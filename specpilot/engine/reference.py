"""The correctness oracle: naive greedy decoding that re-reads the whole sequence every step with a fresh cache.

Slow on purpose and obviously right; tests hold every fast path (AR and speculative) equal to it.
"""

from __future__ import annotations

import torch

from specpilot.models import DenseLM


@torch.inference_mode()
def reference_greedy(model: DenseLM, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    ids, out = list(prompt_ids), []
    device = model.lm_head.weight.device
    for _ in range(max_new_tokens):
        t = torch.tensor([ids], device=device)
        pos = torch.arange(len(ids), device=device)[None]
        logits = model.logits(model(t, pos, model.new_cache(1, len(ids)), kv_len=len(ids)))
        tok = int(logits[0, -1].argmax())
        ids.append(tok)
        out.append(tok)
        if tok in eos_ids:
            break
    return out
