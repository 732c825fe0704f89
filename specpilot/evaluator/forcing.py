"""Token forcing: the gate every optimization must pass. No speedup may come from changed outputs.

Given a candidate system's output tokens for a prompt, teacher-force the stock system (AR greedy of the same
target) over prompt + output in one pass. For every output position record whether the candidate token equals the
stock argmax and the stock top-1 / top-2 logit margin. It never stops or re-syncs at a mismatch (teacher forcing
has no cascade: position i is judged on the candidate's own prefix). Verdict: pass only when every mismatch sits
on a near-tie: a stock margin no larger than `tolerance`, or than one unit in the last place of the scorer's own
precision at that logit (a bf16 scorer cannot tell apart logits one bf16 step apart: with |logit| in [16, 32) that
step is 0.125, and two correct bf16 implementations of one model do land one step apart — measured on the H200).

The stock scorer is independent of the candidate: by default transformers' own implementation of the target.

For a low-precision scorer the tolerance is *measured*, not guessed (`scorer_noise`): the largest error of the
scorer's own top-1/top-2 margin against a float32 run of the same implementation, over the deployment's own
sequences. Two correct low-precision implementations can each be off by that much, in opposite directions, so
`noise_tolerance` allows twice it. (One ulp was not enough: on the H200 our bf16 AR and transformers' bf16 met
2 ulps apart on MT-Bench; BENCHMARKS.md.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

DEFAULT_TOLERANCE = 0.1  # logits; fp32 implementations of one model differ by ~1e-4
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}

LogitsFn = Callable[[list[int]], torch.Tensor]  # token ids [T] -> logits [T, V] (fp32), causal


@dataclass(frozen=True)
class Mismatch:
    index: int  # position in the output
    token: int  # the candidate's token
    stock_token: int  # the stock argmax
    margin: float  # stock top-1 minus top-2 logit at that position


@dataclass
class ForcingVerdict:
    passed: bool
    num_tokens: int
    tolerance: float
    mismatches: list[Mismatch] = field(default_factory=list)  # all of them, tolerated or not
    failures: list[Mismatch] = field(default_factory=list)  # mismatches beyond max(tolerance, scorer ulp)

    def to_dict(self) -> dict:
        return asdict(self)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at the magnitude of x (0 for fp32/fp64 scorers: no slack)."""
    bits = MANTISSA_BITS.get(dtype)
    if bits is None:
        return torch.zeros_like(x)
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - bits)


def force(logits_fn: LogitsFn, prompt_ids: list[int], output_ids: list[int], tolerance: float = DEFAULT_TOLERANCE) -> ForcingVerdict:
    if not output_ids:
        return ForcingVerdict(True, 0, tolerance)
    seq = list(prompt_ids) + list(output_ids[:-1])
    logits = logits_fn(seq)[len(prompt_ids) - 1:]  # [N, V]: row i predicts output token i
    top2 = logits.float().topk(2, dim=-1)
    stock = top2.indices[:, 0]
    margins = top2.values[:, 0] - top2.values[:, 1]
    cand = torch.tensor(output_ids, device=logits.device)
    mismatches = [
        Mismatch(int(i), int(cand[i]), int(stock[i]), float(margins[i]))
        for i in torch.nonzero(cand != stock).flatten().tolist()
    ]
    slack = ulp(top2.values[:, 0], getattr(logits_fn, "dtype", torch.float32))
    allowed = torch.clamp(slack, min=tolerance)  # per position
    failures = [m for m in mismatches if m.margin > float(allowed[m.index])]
    return ForcingVerdict(not failures, len(output_ids), tolerance, mismatches, failures)


@torch.inference_mode()
def scorer_noise(scorer: LogitsFn, reference: LogitsFn, sequences: list[list[int]]) -> float:
    """Largest |margin error| of `scorer` against `reference` (the same model in float32) over the positions of
    `sequences`: for each position, the scorer's top-2 tokens, their logit difference under each."""
    worst = 0.0
    for ids in sequences:
        if len(ids) < 2:
            continue
        a, b = scorer(ids).float(), reference(ids).float()
        top2 = a.topk(2, dim=-1).indices
        ma, mb = a.gather(-1, top2), b.to(a.device).gather(-1, top2)
        err = ((ma[:, 0] - ma[:, 1]) - (mb[:, 0] - mb[:, 1])).abs().max()
        worst = max(worst, float(err))
    return worst


def noise_tolerance(noise: float, tolerance: float = DEFAULT_TOLERANCE) -> float:
    """The forcing tolerance for a low-precision scorer whose measured margin noise is `noise`."""
    return max(tolerance, 2.0 * noise)


def calibrated_tolerance(scorer: LogitsFn, reference: Callable[[], LogitsFn], sequences: list[list[int]],
                         tolerance: float = DEFAULT_TOLERANCE) -> tuple[float | None, float]:
    """(noise, tolerance) for `scorer`: a float32 scorer needs no calibration (noise None, `tolerance` as given);
    a low-precision one is measured against `reference()` (the same model in float32, built only here and dropped
    after) on `sequences`, and gets `noise_tolerance(noise, tolerance)`."""
    if getattr(scorer, "dtype", torch.float32) == torch.float32:
        return None, tolerance
    ref = reference()
    noise = scorer_noise(scorer, ref, sequences)
    del ref
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return noise, noise_tolerance(noise, tolerance)


def float32_bytes(path) -> int:
    """Bytes the float32 copy of the checkpoint in folder `path` takes: its safetensors' elements times 4, read from
    the files' headers (nothing is loaded)."""
    from math import prod
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}: cannot size its float32 copy")
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            total += sum(prod(st.get_slice(name).get_shape()) for name in st.keys())
    return 4 * total


def reference_device(path, device: str, note: Callable[[str], None] = print) -> str:
    """Where the float32 reference of `calibrated_tolerance` is built: `device`, unless it is a GPU whose free memory
    cannot hold the checkpoint's float32 copy (plus a 10% margin), then the CPU (slower, same role). Why: the run
    already holds our low-precision target and transformers' scorer there; at 14B in bf16 on an 80 GB card the float32
    copy (56 GB) would run out of memory mid-bench. `note` says when it falls back."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return device
    try:
        need = float32_bytes(path)
    except FileNotFoundError:  # weights in another format: not sized, left where asked
        return device
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if need * 1.1 <= free:
        return device
    note(f"token forcing: the float32 reference ({need / 2**30:.1f} GiB) does not fit the {free / 2**30:.1f} GiB free "
         f"on {device}: calibrating on the CPU (slower)")
    return "cpu"


def merge(verdicts: list[ForcingVerdict]) -> dict:
    """Summary over many prompts: passed only if every one passed."""
    return {
        "forcing_passed": all(v.passed for v in verdicts),
        "forcing_tokens": sum(v.num_tokens for v in verdicts),
        "forcing_mismatches": sum(len(v.mismatches) for v in verdicts),
        "forcing_failures": sum(len(v.failures) for v in verdicts),
    }


def specpilot_scorer(model) -> LogitsFn:
    """Stock scorer from our own model (used when transformers cannot load the target)."""

    @torch.inference_mode()
    def fn(ids: list[int]) -> torch.Tensor:
        device = model.lm_head.weight.device
        t = torch.tensor([ids], device=device)
        cache = model.new_cache(1, len(ids))
        return model.logits(model(t, torch.arange(len(ids), device=device)[None], cache, kv_len=len(ids)))[0]

    fn.dtype = model.lm_head.weight.dtype
    return fn


def transformers_scorer(path, dtype=torch.float32, device="cpu") -> LogitsFn:
    """Stock scorer from transformers' implementation of the target: independent of our engine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def fn(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids], device=device)).logits[0].float()

    fn.dtype = dtype
    fn.model = model  # the stock system can reuse it (one copy of the target in memory, not two)
    return fn
