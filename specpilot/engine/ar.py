"""Autoregressive decoding: the baseline every speedup is measured against. One target forward per token."""

from __future__ import annotations

import torch

from specpilot.engine.result import GenerationResult
from specpilot.engine.session import Session
from specpilot.sampling import next_token


@torch.inference_mode()
def generate_ar(s: Session, prompt_ids: list[int]) -> GenerationResult:
    res = GenerationResult(list(prompt_ids), [], "length")
    ids = s.prefill(prompt_ids, res)  # the cache holds all but the last prompt token
    out, checked = res.output_ids, 0
    with s.clock(res, "decode_s"):
        while True:
            if s.room(len(ids)) < 1:
                res.finish_reason = "context"
                break
            logits = s.runner.step(s.tensor(ids[-1:]), len(ids) - 1)  # [1, V]
            res.num_target_forwards += 1
            tok = int(next_token(logits[0], s.config.sampling, s.generator))  # the step's one host sync
            ids.append(tok)
            out.append(tok)
            keep, reason = s.stop.apply(out, checked)
            checked = len(out)
            s.emit([tok])
            if reason:
                res.finish_reason = reason
                break
    return res
