"""What tree verification would buy the DFlash drafter: tau of chain vs. tree verification, simulated exactly (CPU).

Why a simulation is exact: the DFlash block is [anchor, mask, mask, ...], so the drafter's distribution at each
block position depends on the anchor and the target context only, never on the tokens drafted at the other
positions. A tree whose level i holds the drafter's top-b(i) tokens at position i (every node at level i-1 having
all of them as children) therefore contains, under greedy verification, the target's own continuation up to the
first position i whose target greedy token is not among the top-b(i) there; that prefix is what the tree accepts.
So per step only the rank of each target token in the drafter's logits at its position matters
(`target_ranks`, `accepted_length`): no tree attention is needed.

Per prompt (HumanEval, chat-templated as `specpilot bench` encodes them):
1. the target's greedy output (our AR engine, drafter_kind="none", up to --max-new-tokens);
2. the target's context features of prompt + output (one prefill through the engine's ModelRunner with the
   drafter's capture layers and feature function, as the engine's runner computes them);
3. per variant, its own trajectory over that fixed output: a fresh `DFlashBlockDrafter` (the shipped network,
   its own draft cache) is fed those features exactly as the engine feeds them (prompt[:-1] first, then each step's
   anchor + accepted tokens), drafts the block at the anchor (`propose_logits`: the eager `propose` step, logits
   kept), accepts by the rule above, and moves the anchor by accepted + 1. Blocks shrink near max_new_tokens as the
   engine's do (k = min(K, max_new_tokens - committed - 1)). tau = output tokens / steps.
4. the check: the real engine with the same drafter (num_draft_tokens=15, prompt lookup off: ngram_assist=0) on
   the same prompt; its tau, per-step accepted lengths and output must equal the chain simulation's.

Nodes per step: a full tree with widths b_1..b_k holds sum_i prod_{j<=i} b_j draft tokens; the verify pass takes
those plus the anchor (the chain: k + 1 = 16 tokens).

    PYTHONPATH=. python scripts/tree_tau.py                      # 4 prompts x 128 tokens, fp32, CPU
    PYTHONPATH=. python scripts/tree_tau.py --variants chain,top2,top2x2 --num-prompts 2 --max-new-tokens 64
Variants: "chain" (top-1 everywhere), "topB" (top-B at every position), "topBxN" (top-B at the first N
positions, then top-1).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from math import prod
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpilot.evaluator.bench import acceptance_by_steps as acceptance_by_position  # noqa: E402 (bench's profile)

TARGET = "qwen2.5-coder-1.5b"
DRAFTER = "dflash-qwen2.5-coder-1.5b"
DEFAULT_VARIANTS = "chain,top2,top3,top2x2,top2x4,top2x1,top3x2"


# ---------------------------------------------------------------------------------------------------------------
# the pure parts (tests/test_tree_tau.py)

def parse_variant(name: str) -> tuple[int, int | None]:
    """"chain" -> (1, None); "top2" -> (2, None); "top2x4" -> (2, 4): (width, positions it applies to; None = all)."""
    if name == "chain":
        return 1, None
    m = re.fullmatch(r"top(\d+)(?:x(\d+))?", name)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"unknown variant {name!r} (chain, topB, topBxN)")
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)


def widths(name: str, k: int) -> list[int]:
    """Per-position candidate counts b_1..b_k of a variant for a block of k draft positions."""
    b, n = parse_variant(name)
    return [b if n is None or i < n else 1 for i in range(k)]


def tree_nodes(w: list[int]) -> int:
    """Draft tokens of the full tree with widths w (level i holds prod(w[:i+1]) nodes); the anchor not counted."""
    return sum(prod(w[: i + 1]) for i in range(len(w)))


def target_ranks(logits: torch.Tensor, targets: list[int | None]) -> list[int | None]:
    """Rank of each target token in its position's draft logits [k, V] (0 = the argmax; ties rank the lower id
    first, as argmax picks it). A None target (past the end of the known output) stays None."""
    out = []
    for row, t in zip(logits, targets):
        if t is None:
            out.append(None)
            continue
        lt = row[t]
        out.append(int((row > lt).sum()) + int((row[:t] == lt).sum()))
    return out


def accepted_length(ranks: list[int | None], w: list[int]) -> int:
    """Tokens a tree of widths w accepts: the leading positions whose target token ranks within the width there
    (rank < w[i]); a None rank (no target token known there) rejects."""
    a = 0
    for r, b in zip(ranks, w):
        if r is None or r >= b:
            break
        a += 1
    return a


# ---------------------------------------------------------------------------------------------------------------
# the simulation

def simulate(variant: str, drafter, seq: list[int], prompt_len: int, feats: torch.Tensor, max_new: int,
             K: int) -> dict:
    """One trajectory of `variant` over the fixed sequence seq = prompt + target output; feats [len(seq)-1, F] are
    the target's context features of seq[:-1]. -> per-step accepted / drafted lengths and verify tokens."""
    L = len(seq) - prompt_len
    drafter.reset()
    if prompt_len > 1:
        drafter.observe(feats[: prompt_len - 1])
    n, acc, drafted, verify = 0, [], [], []
    while n < L:
        p = prompt_len - 1 + n  # the anchor: the last committed token
        k = min(K, max_new - n - 1)
        if k > 0:
            logits = drafter.propose_logits(seq[: p + 1], k).float()
            targets = [seq[p + i] if p + i < len(seq) else None for i in range(1, k + 1)]
            w = widths(variant, k)
            a = accepted_length(target_ranks(logits, targets), w)
        else:
            w, a = [], 0
        a = min(a, L - n - 1)  # the step that commits the output's last token ends the run
        drafter.observe(feats[p: p + a + 1])
        acc.append(a)
        drafted.append(k)
        verify.append(1 + tree_nodes(w))
        n += a + 1
    return {"accepted": acc, "drafted": drafted, "verify_tokens": verify, "tokens": L}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--block", type=int, default=15, help="draft tokens per step (K)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--no-check", action="store_true", help="skip the engine's chain run (the self-check)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        parse_variant(v)
    if "chain" not in variants:
        variants.insert(0, "chain")
    if args.threads:
        torch.set_num_threads(args.threads)

    from specpilot.config import EngineConfig
    from specpilot.drafters.dflash import DFlashBlockDrafter
    from specpilot.engine import DTYPE, Engine, build_drafter, load_target
    from specpilot.engine.runner import ModelRunner
    from specpilot.evaluator.datasets import load_prompts
    from specpilot.hub import resolve_model
    from specpilot.models.dflash_io import load_dflash

    t_all = time.perf_counter()
    M, K = args.max_new_tokens, args.block
    base = EngineConfig(drafter_kind="none", dtype=args.dtype, device="cpu", max_new_tokens=M, max_seq_len=2048)
    target, tok = load_target(TARGET, base)
    network = load_dflash(resolve_model(DRAFTER), dtype=DTYPE[args.dtype], device="cpu")
    ar = Engine(target, base, None, tok)
    spec_cfg = base.with_(drafter_kind="dflash", num_draft_tokens=K, ngram_assist=0)
    spec = None if args.no_check else Engine(target, spec_cfg, build_drafter(spec_cfg, network, target), tok)
    sim_drafter = DFlashBlockDrafter(network, target, base.max_seq_len)
    print(f"loaded in {time.perf_counter() - t_all:.1f} s; variants {variants}", file=sys.stderr, flush=True)

    prompts = load_prompts("humaneval", num_prompts=args.num_prompts)
    runs = {v: [] for v in variants}
    records = []
    for pr in prompts:
        ids = tok.encode_chat(pr.messages)
        t0 = time.perf_counter()
        ref = ar.generate(ids)
        t_ar = time.perf_counter() - t0
        seq = list(ids) + list(ref.output_ids)
        t0 = time.perf_counter()
        runner = ModelRunner(target, target.new_cache(1, len(seq) + 1), capture_layers=sim_drafter.target_layers,
                             feature_fn=sim_drafter.features)
        runner.prefill(torch.tensor(seq[:-1]), 0)
        feats = runner.last_hidden
        del runner
        sims = {v: simulate(v, sim_drafter, seq, len(ids), feats, M, K) for v in variants}
        t_sim = time.perf_counter() - t0
        rec = {"id": pr.id, "prompt_tokens": len(ids), "output_tokens": len(ref.output_ids),
               "finish": ref.finish_reason, "ar_s": round(t_ar, 1), "sim_s": round(t_sim, 1),
               "tau": {v: round(s["tokens"] / len(s["accepted"]), 4) for v, s in sims.items()}}
        for v, s in sims.items():
            runs[v].append(s)
        if spec is not None:
            t0 = time.perf_counter()
            got = spec.generate(ids)
            rec["engine_s"] = round(time.perf_counter() - t0, 1)
            chain = sims["chain"]
            rec["engine_chain_tau"] = round(got.tau, 4)
            rec["engine_forwards"] = got.num_target_forwards
            rec["engine_output_equals_ar"] = got.output_ids == ref.output_ids
            rec["engine_steps_equal_sim"] = (got.accepted_lengths == chain["accepted"]
                                             and got.drafted_lengths == chain["drafted"])
            if not rec["engine_steps_equal_sim"]:
                rec["engine_accepted"], rec["sim_accepted"] = got.accepted_lengths, chain["accepted"]
        records.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)

    table = {}
    for v in variants:
        rs = runs[v]
        tokens, steps = sum(r["tokens"] for r in rs), sum(len(r["accepted"]) for r in rs)
        verify = [t for r in rs for t in r["verify_tokens"]]
        table[v] = {
            "tau": round(tokens / steps, 4), "steps": steps, "tokens": tokens,
            "nodes_full_block": tree_nodes(widths(v, K)),  # draft tokens of the tree at k = K
            "verify_tokens_per_step": round(sum(verify) / len(verify), 1),  # mean over steps (blocks shrink at the end)
            "tau_per_prompt": [round(r["tokens"] / len(r["accepted"]), 4) for r in rs],
            "acceptance_by_position": acceptance_by_position([d for r in rs for d in r["drafted"]],
                                                             [a for r in rs for a in r["accepted"]]),
        }
    chain_tau = table["chain"]["tau"]
    print(f"\n{'variant':<8} {'tau':>7} {'x chain':>8} {'steps':>6} {'nodes(K=15)':>12} {'verify tok/step':>16}")
    for v, t in table.items():
        print(f"{v:<8} {t['tau']:>7.3f} {t['tau'] / chain_tau:>8.3f} {t['steps']:>6} {t['nodes_full_block']:>12} "
              f"{t['verify_tokens_per_step']:>16}")
    out = {"target": TARGET, "drafter": DRAFTER, "dtype": args.dtype, "num_prompts": len(prompts),
           "max_new_tokens": M, "block": K, "variants": table, "prompts": records,
           "wall_s": round(time.perf_counter() - t_all, 1)}
    if spec is not None:
        eng_tau = sum(r["output_tokens"] for r in records) / sum(r["engine_forwards"] for r in records)
        out["check"] = {"engine_chain_tau": round(eng_tau, 4), "sim_chain_tau": chain_tau,
                        "equal": all(r["engine_steps_equal_sim"] for r in records)
                        and all(r["engine_output_equals_ar"] for r in records)}
        print(f"check: engine chain tau {eng_tau:.4f} vs simulated {chain_tau:.4f}; per-step equal: "
              f"{out['check']['equal']}")
    print(f"wall {out['wall_s']} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0 if spec is None or out["check"]["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
