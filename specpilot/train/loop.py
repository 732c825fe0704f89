"""The training loop around `DFlashTrainer` (what `specpilot train-drafter` runs): steps until the step budget or
a deadline, validation (loss, teacher-forced acceptance, and tau decoded by the real engine), checkpoints, the
best drafter, and fitting the step count (so the LR schedule) to a wall-clock limit.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from specpilot.models.dflash import DFlashDrafter
from specpilot.models.dflash_io import save_dflash
from specpilot.train.dflash_trainer import BEST, DFlashTrainer, StepResult

__all__ = ["LoopConfig", "inference_copy", "run_training", "validate_tau"]


# ----------------------------------------------------------------------------------------------------------
# validation through the real engine


def inference_copy(drafter: DFlashDrafter, target) -> DFlashDrafter:
    """An eval copy of the drafter in the target's dtype (the engine runs both in one dtype)."""
    return copy.deepcopy(drafter).to(dtype=target.lm_head.weight.dtype).eval()


def validate_tau(target, drafter: DFlashDrafter, prompts_ids: list[list[int]], *, max_new_tokens: int = 128,
                 num_draft_tokens: int | None = None, ignore_eos: bool = False) -> dict:
    """Greedy speculative decoding of each prompt with the real engine and this drafter:
    -> {"tau": tokens per target forward over all prompts, "tokens", "forwards", "per_prompt": [...]}."""
    from specpilot.config import EngineConfig
    from specpilot.engine import Engine, build_drafter

    if not prompts_ids:
        return {"tau": float("nan"), "tokens": 0, "forwards": 0, "per_prompt": []}
    k = drafter.block_size - 1 if num_draft_tokens is None else num_draft_tokens
    longest = max(len(p) for p in prompts_ids)
    device = str(target.lm_head.weight.device)
    # CUDA graphs for the target on a GPU: eager steps are host-bound there (~100 ms per step on the H200 host)
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=k, max_new_tokens=max_new_tokens,
                       max_seq_len=max(16, longest + max_new_tokens + k + 2), device=device,
                       cuda_graphs=target.lm_head.weight.device.type == "cuda", fused_projections=False,
                       ignore_eos=ignore_eos)
    net = inference_copy(drafter, target)
    engine = Engine(target, cfg, build_drafter(cfg, net, target))
    tokens = forwards = 0
    per = []
    for p in prompts_ids:
        res = engine.generate(list(p))
        tokens += res.num_output_tokens
        forwards += res.num_target_forwards
        per.append(round(res.tau, 4))
    return {"tau": tokens / max(forwards, 1), "tokens": tokens, "forwards": forwards, "per_prompt": per}


# ----------------------------------------------------------------------------------------------------------
# the training loop (used by the CLI)


@dataclass
class LoopConfig:
    val_every: int = 200  # steps between validations (0 = only at the end)
    save_every: int = 200  # steps between checkpoints (0 = only at the end)
    val_max_new_tokens: int = 128
    deadline: float | None = None  # time.monotonic() seconds: stop and checkpoint before it
    log_every: int = 10
    fit_steps_to_deadline: bool = False  # shorten the run (and its LR schedule) to end at the deadline
    fit_after: int = 20  # steps timed before fitting
    refit_every: int = 25  # then refit this often (and after each validation): early steps can be far slower
    validate_first: bool = False  # a warm start: score the starting drafter, so `best` must beat it to be saved


def run_training(trainer: DFlashTrainer, out: str | Path, *, loop: LoopConfig, val_prompts: list[list[int]],
                 val_sequences=(), log: Callable[[str], None] | None = None, progress: bool = True,
                 best_tau: float | None = None) -> dict:
    """Train until `trainer.cfg.steps` or the deadline, validating and checkpointing on the way.

    Appends JSON lines to OUT/log.jsonl ({"kind": "train"|"val", ...}); saves OUT/checkpoint, and OUT/best when
    validation tau improves (without validation prompts to decode: its teacher-forced proxy, 1 + acceptance
    length on the validation sequences). Short runs on little data overfit fast (BENCHMARKS.md: train acceptance
    4.1, validation tau 1.28), so `best` rather than the last checkpoint is what to ship. -> summary {steps, final_loss, best_val_tau, checkpoint, best, stopped_by}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = log or (lambda m: None)
    log_path = out / "log.jsonl"
    cfg = trainer.cfg
    best = best_tau if best_tau is not None else float("-inf")
    last: StepResult | None = None
    save_s, val_s = 5.0, 5.0
    step_times, requested = [], None  # recent step times (the command's first, warm-up, left out); cfg.steps asked
    stopped_by = "steps"
    best_step = None  # the step whose weights OUT/best holds (0 on a warm start that nothing beat)
    dist = trainer.dist  # with several ranks, rank 0 alone validates, saves and decides when to stop

    def write(rec: dict):
        if not dist.main:
            return
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")

    def validate():
        nonlocal best, best_step, val_s
        if not dist.main:
            return None
        t0 = time.monotonic()
        rec = {"kind": "val", "step": trainer.step, "time": time.time()}
        if val_sequences:
            rec.update(trainer.evaluate_loss(val_sequences))
        score = None
        if val_prompts:
            v = validate_tau(trainer.target, trainer.drafter, val_prompts, max_new_tokens=loop.val_max_new_tokens)
            rec.update({"val_tau": v["tau"], "val_tokens": v["tokens"]})
            score = v["tau"]
        elif "val_accept_len" in rec:  # no decoding: the teacher-forced proxy of tau picks the best checkpoint
            score = 1.0 + rec["val_accept_len"]
        if score is not None and score > best:
            best, best_step = score, trainer.step
            save_dflash(trainer.drafter, out / BEST)
            rec["best"] = True
        val_s = time.monotonic() - t0
        rec["val_s"] = round(val_s, 3)
        write(rec)
        log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                     if k not in ("kind", "time")))
        return rec

    def save():
        nonlocal save_s
        if not dist.main:
            return None
        t0 = time.monotonic()
        path = trainer.save(out, {"best_val_tau": best if best > float("-inf") else None})
        save_s = time.monotonic() - t0
        return path

    start_step = trainer.step

    def fit_steps():
        """Once `fit_after` steps are timed, set cfg.steps to what fits before the deadline (at most the steps
        requested), so the cosine decay completes in this command (the LR schedule reads cfg.steps, and checkpoints
        save it: resume agrees). Refits after validations move it either way. The mean step time, not the median:
        the total is what must fit, and step times vary a lot with the batch's length (a median-based fit ended
        H200 runs at 416 s of 560 s). The command's first step (warm-up) is left out of it."""
        nonlocal requested
        if requested is None:
            requested = cfg.steps
        mean = sum(step_times) / len(step_times) if step_times else last.step_s
        n_val = lambda k: (k // loop.val_every) if loop.val_every else 0  # noqa: E731
        n_save = lambda k: (k // loop.save_every) if loop.save_every else 0  # noqa: E731
        left = loop.deadline - time.monotonic() - 2 * save_s - val_s - 10.0
        fit = trainer.step
        while fit < requested:
            k = fit + 1 - trainer.step
            if k * mean + n_val(k) * val_s + n_save(k) * save_s > left:
                break
            fit += 1
        fit = max(fit, trainer.step + 1)
        if fit != cfg.steps:
            log(f"time limit: the run is set from {cfg.steps} to {fit} steps of {requested} requested "
                f"({mean * 1e3:.0f} ms per step)")
            cfg.steps = fit

    if loop.validate_first and trainer.step == start_step == 0:
        validate()  # H200, session 10: a warm-started run whose checkpoints all scored below the start shipped one

    bar = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                       TextColumn("{task.fields[info]}"), console=Console(stderr=True), transient=False)
        task = bar.add_task("train", total=cfg.steps, completed=trainer.step, info="")
        bar.start()
    try:
        while trainer.step < cfg.steps:
            stop = False
            if loop.deadline is not None:
                recent = sorted(step_times[-50:])
                typical = recent[len(recent) // 2] if recent else 5.0
                due_val = loop.val_every and (trainer.step + 1) % loop.val_every == 0
                need = 2 * typical + 2 * save_s + (val_s if due_val else 0.0) + 5.0
                stop = time.monotonic() + need > loop.deadline
            if dist.world > 1:  # rank 0's decisions (deadline, fitted step count) hold for every rank
                flag, steps = dist.share([float(stop), float(cfg.steps)])
                stop, cfg.steps = bool(flag), int(steps)
                if trainer.step >= cfg.steps:
                    break
            if stop:
                stopped_by = "time_limit"
                break
            last = trainer.train_step()
            if trainer.step > start_step + 1:
                step_times = (step_times + [last.step_s])[-200:]
            done = trainer.step - start_step
            if loop.fit_steps_to_deadline and loop.deadline is not None and (
                    done == loop.fit_after or (done > loop.fit_after and loop.refit_every
                                               and (done - loop.fit_after) % loop.refit_every == 0)):
                fit_steps()  # H200, session 10: 725 ms/step over the first 20 steps, ~280 ms after: 378 steps
                # were fitted to a 570 s run and it ended with two thirds of its training time unused
                if bar is not None:
                    bar.update(task, total=cfg.steps)
            rec = {"kind": "train", **asdict(last)}
            write(rec)
            if bar is not None:
                bar.update(task, completed=trainer.step,
                           info=f"loss {last.loss:.3f} acc-len {last.accept_len:.2f} lr {last.lr:.2e}")
            elif loop.log_every and trainer.step % loop.log_every == 0:
                log(f"step {trainer.step} loss {last.loss:.4f} accept_len {last.accept_len:.2f} lr {last.lr:.2e} "
                    f"{last.step_s * 1e3:.0f} ms")
            if loop.val_every and trainer.step % loop.val_every == 0 and trainer.step < cfg.steps:
                validate()
                if loop.fit_steps_to_deadline and loop.deadline is not None and trainer.step > start_step + loop.fit_after:
                    fit_steps()  # now with the measured validation time and more step times
                    if bar is not None:
                        bar.update(task, total=cfg.steps)
            if loop.save_every and trainer.step % loop.save_every == 0 and trainer.step < cfg.steps:
                save()
    finally:
        if bar is not None:
            bar.stop()
    dist.check_in_sync(trainer.drafter)  # ranks: same start, same averaged steps, so the copies must agree
    final_val = None
    if trainer.step >= cfg.steps and (loop.deadline is None or time.monotonic() + val_s + save_s < loop.deadline):
        final_val = validate()
    ckpt = save()
    return {
        "steps": trainer.step,
        "final_loss": last.loss if last is not None else None,
        "final_accept_len": last.accept_len if last is not None else None,
        "final_val_tau": (final_val or {}).get("val_tau"),
        "final_val_loss": (final_val or {}).get("val_loss"),
        "best_val_tau": best if best > float("-inf") else None,
        "best_step": best_step,
        "checkpoint": str(ckpt),
        "best": str(out / BEST) if (out / BEST).exists() else None,
        "stopped_by": stopped_by,
        "median_step_s": sorted(step_times)[len(step_times) // 2] if step_times else (last and last.step_s),
    }
