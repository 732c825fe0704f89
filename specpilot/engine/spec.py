"""Speculative decoding with chain verification. Each step is four named phases:

draft   -> the drafter proposes up to K tokens continuing the committed context (a device tensor);
verify  -> one target pass over [last committed token, d_1 .. d_K] gives K+1 distributions;
accept  -> chain verification keeps a prefix of the draft and yields one more token (recovered or bonus);
commit  -> the accepted prefix and that token join the context, cut by the stop rule.
Host sync: exactly one per step, the `.tolist()` in commit that brings the verdict and the draft to the host
(the stop rule and the drafter's context need them there). The verify block starts from the last committed token
as a device tensor (the previous verdict's), not a fresh host-to-device copy, which would synchronize too.
Greedy (with `EngineConfig.fused_accept`, the default): verify and accept are one runner call,
`step_greedy_verdict`, whose result is already the packed [num_accepted, next_token, d_1 .. d_K] (on CUDA computed
inside the verify step's graph), so accept launches nothing and commit reads that one tensor; the accept stage then
measures ~0. Sampling keeps the separate accept stage (`verify_chain` on the step's logits).
Greedy output equals AR output token for token; sampled output has the target's distribution.

Early draft (`EngineConfig.early_draft`, no policy, a drafter with `launch_early`): the step's sync is split. The
verdict's copy to a pinned host buffer is queued first, then the next block's draft pass, launched from the
verdict on the device (drafters/dflash.py), then the host waits for the copy alone. So the GPU
drafts while the host commits, applies the stop rule and runs the n-gram lookup, and the next step's propose()
launches nothing. Still one host sync a step. Not launched when the next step might not draft (the token or
context limit within a block) or the drafter cannot (its first pass, an eager pass); a stop ends the loop and the
early pass is dropped. Same drafts, same tokens. Greedy or sampled, fused or not: the packed verdict is a device
tensor either way, and DFlash drafts are argmax (no random draws, so a sampled run draws the same numbers).

With a `policy` (engine/adaptive.py, `EngineConfig.adaptive`) some steps are plain: nothing is drafted, the verify
block is the last committed token alone (the target's one-token step, graphed and fused like AR's), and its verdict
is the target's next token. The policy picks per step from measured step costs and acceptance; a conditioned
drafter still observes every committed token, and a plain run ends before the drafter's next pass would take more
new context than its graphed pass holds (`max_catch_up`).
"""

from __future__ import annotations

import torch

from specpilot.drafters.base import Drafter
from specpilot.engine.result import GenerationResult
from specpilot.engine.session import Session
from specpilot.sampling import probs_from_logits
from specpilot.verify import verify_chain


def _plain_step(policy, catch_up: int | None, pending: int) -> bool:
    """Whether the policy (engine/adaptive.py) takes this step plain. A plain step is refused when the drafter's
    next pass would then take more new context than it holds (`catch_up`): that step speculates instead."""
    if policy is None or policy.speculate():
        return False
    if catch_up is not None and pending >= catch_up:
        policy.skip()
        return False
    return True


def _draft_len(s: Session, n_ids: int, n_out: int, k_max: int) -> int:
    """Tokens a step drafts with n_ids committed tokens (n_out of them new): k_max, cut so the step's bonus token
    stays within max_new_tokens and the context; < 0: no room for a step at all."""
    return min(k_max, s.config.max_new_tokens - n_out - 1, s.room(n_ids) - 1)


def _room_for_next(s: Session, n_ids: int, n_out: int, k_max: int) -> bool:
    """Whether the next step drafts whatever this one accepts (up to k_max + 1 tokens): else no early launch."""
    grown = k_max + 1
    return _draft_len(s, n_ids + grown, n_out + grown, k_max) > 0


def _launch_early(drafter, packed: torch.Tensor, features: torch.Tensor, host: torch.Tensor) -> bool:
    """Queue the verdict's copy to the pinned `host` buffer, then the drafter's early pass; wait for the copy
    only (engine/spec.py docstring, "Early draft"). -> whether the pass was launched."""
    n = packed.shape[0]
    if not packed.is_cuda:  # CPU: everything runs in order anyway
        host[:n].copy_(packed)
        return drafter.launch_early(packed, features)
    host[:n].copy_(packed, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    launched = drafter.launch_early(packed, features)
    copied.synchronize()
    return launched


@torch.inference_mode()
def generate_spec(s: Session, drafter: Drafter, prompt_ids: list[int], policy=None) -> GenerationResult:
    res = GenerationResult(list(prompt_ids), [], "length")
    drafter.reset()
    ids = s.prefill(prompt_ids, res)
    conditioned = getattr(drafter, "target_layers", None) is not None
    if conditioned and len(prompt_ids) > 1:
        drafter.observe(s.runner.last_hidden)  # features of prompt[:-1]
    out, checked = res.output_ids, 0
    last = s.tensor(ids[-1:])  # the last committed token on the device; then each step's next token (next_dev)
    sampling = s.config.sampling
    fused = sampling.greedy and s.config.fused_accept  # verify + accept in one runner call (see the docstring)
    timer = s.stage_timer()
    k_max = getattr(drafter, "max_draft_tokens", None) or s.config.num_draft_tokens  # (a longer block on some steps)
    catch_up = getattr(drafter, "max_catch_up", None)  # most new context tokens the drafter's next pass may take
    pending = len(prompt_ids)  # committed tokens the drafter has not drafted after yet (a pass takes them in)
    if policy is not None:
        policy.start()
    early = (s.config.early_draft and policy is None and conditioned
             and callable(getattr(drafter, "launch_early", None)))
    verdict_host = torch.empty(k_max + 2, dtype=torch.long, pin_memory=s.device.type == "cuda") if early else None
    with s.clock(res, "decode_s"):
        while True:
            timer.start()
            k = _draft_len(s, len(ids), len(out), k_max)
            if k < 0:
                res.finish_reason = "context"
                break
            plain = _plain_step(policy, catch_up, pending)  # (k also reaches 0 at the token limit: not chosen)
            k = 0 if plain else k
            speculative = k > 0
            # draft
            draft = drafter.propose(ids, k) if speculative else None
            pending = 0 if speculative else pending
            d_ids = draft.token_ids[:k] if draft is not None else s.tensor([])
            timer.mark("draft")
            # verify
            block = torch.cat([last, d_ids])
            if fused:  # verify + accept: the verdict comes packed with the drafts, [a, next, d_1 .. d_K]
                packed = s.runner.step_greedy_verdict(block, len(ids) - 1)
                res.num_target_forwards += 1
                timer.mark("verify")
                timer.mark("accept")  # nothing left to launch: the verdict was part of the step
                next_dev = packed[1:2]
            else:
                logits = s.runner.step(block, len(ids) - 1)  # [K+1, V]
                res.num_target_forwards += 1
                timer.mark("verify")
                # accept
                if sampling.greedy:
                    verdict = verify_chain(d_ids, logits)
                else:
                    d_probs = draft.probs[: len(d_ids)] if draft is not None and draft.probs is not None else None
                    verdict = verify_chain(
                        d_ids, logits, target_probs=probs_from_logits(logits, sampling), draft_probs=d_probs,
                        generator=s.generator,
                    )
                timer.mark("accept")
                packed = torch.cat([verdict.num_accepted.view(1), verdict.next_token.view(1), d_ids])
                next_dev = verdict.next_token.view(1)
            # commit
            launched = False
            if early and speculative and _room_for_next(s, len(ids), len(out), k_max):
                launched = _launch_early(drafter, packed, s.runner.last_hidden, verdict_host)
                a, nxt, *drafted = verdict_host[: packed.shape[0]].tolist()  # the step's one host sync
            else:
                a, nxt, *drafted = packed.tolist()  # the step's one host sync
            if launched:  # the drafter took the features on the device; now it learns how many were committed
                drafter.took_early(a + 1)
            elif conditioned:  # the last committed token and the accepted drafts: their features are now final
                drafter.observe(s.runner.last_hidden[: a + 1])
            res.drafted_lengths.append(len(drafted))
            res.accepted_lengths.append(a)
            res.plain_steps += plain
            pending += a + 1
            before = len(out)
            out.extend(drafted[:a] + [nxt])
            keep, reason = s.stop.apply(out, checked)
            del out[keep:]
            checked = len(out)
            ids.extend(out[before:])
            s.emit(out[before:])
            timer.mark("commit")
            if policy is not None:
                policy.record(speculative, a + 1)
            if reason:
                res.finish_reason = reason
                break
            # == ids[-1]: nothing was cut (a cut ends the loop). On the fused path with CUDA graphs `next_dev` is a
            # view of the bucket's static output, which the bucket's next replay overwrites. That is safe: the next
            # step's torch.cat copies it into a fresh block before the replay is enqueued, and both run in order on
            # the one stream; nothing else replays the target runner in between (drafters have their own runners).
            last = next_dev
    res.stage_s = timer.totals()
    return res
