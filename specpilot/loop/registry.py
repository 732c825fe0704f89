"""What the loop may change: one registry entry per mechanism, and the deployment it is tuned for.

A `Mechanism` names the EngineConfig fields it sets and their candidate values, the cost-model stage(s) whose gap
it targets (so the loop can pick directions from a gap table) and a predicate saying where it applies. Adding a
mechanism to the engine means adding one field to `EngineConfig` and one `register(Mechanism(...))` here: the
explorers, the gate, memory and the report need no change.

A `Deployment` is what results are remembered for: target, drafter, device and regime. Its fingerprint is the key
of every remembered trial; `family` lets memory transfer what worked to similar deployments.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from typing import Callable

from specpilot.config import EngineConfig
from specpilot.costmodel.gaps import early_draft_applies
from specpilot.errors import ConfigError

STAGES = ("draft", "verify", "accept", "other")  # the cost model's stages (costmodel.gaps.STAGES)


def family_of(target: str) -> str:
    """'qwen2.5-coder-1.5b' -> 'qwen2.5-coder'; '/models/Llama-3-8B-Instruct' -> 'llama-3-instruct'.

    The size suffix is what differs inside a family; a folder path keeps only its last component.
    """
    name = target.rstrip("/").rsplit("/", 1)[-1].lower()
    name = re.sub(r"[-_.]?\d+(\.\d+)?[bm](?=$|[-_])", "", name)
    return name or target


@dataclass(frozen=True)
class Deployment:
    """The thing being optimized. `config` is the starting EngineConfig (round 0 measures it unchanged)."""

    target: str
    drafter: str | None  # drafter model name/path; None when only model-free drafters are possible
    config: EngineConfig
    device_name: str = "cpu"  # e.g. torch.cuda.get_device_name(); "cpu" for CPU
    family: str = ""  # target family; derived from the target name when empty

    def __post_init__(self):
        if not self.family:
            object.__setattr__(self, "family", family_of(self.target))

    @property
    def regime(self) -> str:
        """What else changes the answer: dtype, sampling and output length."""
        s = self.config.sampling
        mode = "greedy" if s.greedy else f"t{s.temperature}-k{s.top_k}-p{s.top_p}"
        return f"{self.config.dtype}/{mode}/{self.config.max_new_tokens}"

    @property
    def drafter_kind(self) -> str:
        return self.config.drafter_kind

    @property
    def drafter_model_kind(self) -> str:
        """What the drafter file is: a DFlash checkpoint when the deployment starts as dflash, else a small AR."""
        return self.config.drafter_kind if self.config.drafter_kind in ("model", "dflash") else "model"

    @property
    def on_cuda(self) -> bool:
        return self.config.device.startswith("cuda")

    def fingerprint(self) -> str:
        key = json.dumps([self.target, self.drafter, self.device_name, self.regime])
        return hashlib.sha256(key.encode()).hexdigest()[:16]


Applies = Callable[[Deployment, EngineConfig], bool]
Valid = Callable[[Deployment, dict], bool]


@dataclass(frozen=True)
class Mechanism:
    name: str
    gap_stages: tuple[str, ...]  # cost-model stages this mechanism can shrink, most direct first
    fields: dict[str, list]  # EngineConfig field -> candidate values
    applies: Applies = lambda dep, cfg: True  # noqa: E731  (dep, the current best config) -> usable here?
    description: str = ""
    valid: Valid = lambda dep, delta: True  # noqa: E731  drops candidate values this deployment cannot run

    def __post_init__(self):
        bad = [s for s in self.gap_stages if s not in STAGES]
        if bad or not self.gap_stages:
            raise ConfigError(f"mechanism {self.name}: gap stages must be from {STAGES}, got {self.gap_stages}")
        known = set(EngineConfig.__dataclass_fields__)
        unknown = set(self.fields) - known
        if unknown or not self.fields:
            raise ConfigError(f"mechanism {self.name}: unknown EngineConfig fields {sorted(unknown)}")

    def candidates(self, cfg: EngineConfig, dep: Deployment | None = None) -> list[dict]:
        """Config deltas (field -> value) this mechanism proposes from `cfg`, excluding `cfg` itself.
        Several fields: every combination. Deltas that EngineConfig rejects, or `valid` (given `dep`), are dropped."""
        names = list(self.fields)
        out = []
        for values in itertools.product(*(self.fields[n] for n in names)):
            delta = dict(zip(names, values))
            if all(getattr(cfg, k) == v for k, v in delta.items()) or (dep is not None and not self.valid(dep, delta)):
                continue
            try:
                cfg.with_(**delta)
            except ConfigError:
                continue
            out.append(delta)
        return out


REGISTRY: dict[str, Mechanism] = {}


def register(m: Mechanism) -> Mechanism:
    if m.name in REGISTRY:
        raise ConfigError(f"mechanism {m.name!r} is registered twice")
    REGISTRY[m.name] = m
    return m


def applicable(dep: Deployment, cfg: EngineConfig, registry: dict[str, Mechanism] | None = None) -> list[Mechanism]:
    """Mechanisms usable for `dep` from the current config, in registry order."""
    reg = REGISTRY if registry is None else registry
    return [m for m in reg.values() if m.applies(dep, cfg)]


def _speculative(dep: Deployment, cfg: EngineConfig) -> bool:
    return cfg.drafter_kind != "none"


def _cuda_switch(field: str, why: str) -> Mechanism:
    """A kernel the engine switches on or off by one bool field, on CUDA, for the verify and draft passes."""
    return Mechanism(field, ("verify", "draft"), {field: [True, False]}, lambda dep, cfg: dep.on_cuda, why)


def _fused_path(dep: Deployment, cfg: EngineConfig) -> bool:
    """The fused one-token path is laid out: CUDA, fused_decode and the fused_projections it reads."""
    return dep.on_cuda and cfg.fused_decode and cfg.fused_projections


def _fused_switch(field: str, why: str) -> Mechanism:
    """A bool switch of the fused one-token path's kernels, for the draft and verify passes."""
    return Mechanism(field, ("draft", "verify"), {field: [True, False]}, _fused_path, why)


# --- what the engine has now --------------------------------------------------------------------------------

register(Mechanism(
    "block_size", ("verify", "draft"), {"num_draft_tokens": [2, 3, 4, 6, 8, 15]}, _speculative,
    "tokens drafted per step: more raises tau but costs drafter passes and a wider verify pass",
    # 15 (a whole 16-token block) is for block drafters, which draft it in one pass; AR drafters pay per token
    lambda dep, delta: delta["num_draft_tokens"] <= 8 or dep.config.drafter_kind == "dflash"))
register(Mechanism(
    "drafter_kind", ("draft",), {"drafter_kind": ["model", "dflash", "ngram"]},
    lambda dep, cfg: dep.drafter is not None and cfg.drafter_kind != "none",
    "the deployment's drafter model (small AR or DFlash block drafter) vs prompt-lookup n-grams",
    lambda dep, delta: delta["drafter_kind"] in (dep.drafter_model_kind, "ngram")))
register(Mechanism(
    "ngram_assist", ("draft",), {"ngram_assist": [0, 2, 3, 4]},
    lambda dep, cfg: cfg.drafter_kind in ("dflash", "model") and cfg.sampling.greedy,
    "prompt lookup beside the model drafter: its continuation is verified instead when its suffix match is at "
    "least this long and its first token agrees with the model's (chosen on the device)"))
register(Mechanism(
    "ngram_assist_tokens", ("draft", "verify"), {"ngram_assist_tokens": [0, 8, 15]},
    lambda dep, cfg: cfg.ngram_assist > 0 and cfg.drafter_kind == "dflash",
    "on steps where prompt lookup has a match, draft and verify this many tokens (a long copy, one more verify "
    "bucket); the other steps keep the usual block",
    lambda dep, delta: delta["ngram_assist_tokens"] == 0 or delta["ngram_assist_tokens"] > dep.config.num_draft_tokens))
register(Mechanism(
    "ngram_window", ("draft",), {"ngram_max": [2, 3, 4, 6]},
    lambda dep, cfg: cfg.drafter_kind == "ngram" or (cfg.ngram_assist > 0 and cfg.drafter_kind in ("dflash", "model")),
    "longest suffix n-gram the prompt-lookup drafter matches"))
register(Mechanism(
    "cuda_graphs", ("other",), {"cuda_graphs": [True, False]},
    lambda dep, cfg: dep.on_cuda,
    "replay captured CUDA graphs per step bucket instead of launching kernels from Python"))
register(Mechanism(
    "fused_projections", ("verify", "draft"), {"fused_projections": [True, False]},
    lambda dep, cfg: True,
    "one qkv and one gate+up GEMM per layer instead of five (same numbers, fewer kernels)"))
register(_cuda_switch(
    "gemv_kernel",
    "few-token projections through the Triton GEMV (1 token always, 2-16 tokens for wide outputs: where it beat "
    "cuBLAS on the H200) instead of cuBLAS"))
register(_cuda_switch(
    "attention_kernel",
    "few-token steps attend through the split-KV Triton kernel (GQA group per program, early exit above the "
    "context) instead of SDPA with a mask over the whole pool"))
register(Mechanism(
    "draft_attention_kernel", ("draft",), {"draft_attention_kernel": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.drafter_kind == "dflash",
    "the DFlash draft block attends through the split-KV kernel (block K/V written into the draft cache, every "
    "query at the block's last position: non-causal inside the block) instead of SDPA over the whole draft pool"))
register(_cuda_switch(
    "norm_kernel",
    "every RMSNorm in one Triton launch (fp32 row statistics, same rounding order) instead of 8 eager kernels"))
register(_cuda_switch(
    "rope_kernel",
    "RoPE of q and k in one Triton launch per layer (same rounding as the eager ops) instead of 10 eager kernels"))
register(_cuda_switch(
    "act_kernel",
    "the MLP's silu(gate) * up in one Triton launch per layer (fused gate+up halves read in place, eager rounding "
    "order) instead of 2 eager kernels"))
register(_cuda_switch(
    "add_norm_kernel",
    "each residual add and the RMSNorm after it (post-attention, next layer's input / final norm) in one Triton "
    "launch instead of the add + the norm's kernels"))
register(_cuda_switch(
    "fused_decode",
    "one-token steps (AR decode, a small drafter's passes) in six launches a layer: RMSNorms as GEMV prologues, "
    "residual adds and SiLU * up as GEMV epilogues, RoPE with the K/V write, one-launch attention"))
register(Mechanism(
    "fused_verify", ("verify",), {"fused_verify": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "verify steps of 2-16 tokens in one row through fused decode's layer at T rows: M-row GEMVs (tl.dot, weights "
    "read once) after RMSNorm launches, with residual / SiLU * up epilogues, RoPE + K/V write, split-KV attention: "
    "nine launches a layer instead of ~12 with cuBLAS"))
register(Mechanism(
    "lossless12", ("verify", "draft"), {"lossless12": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode and cfg.dtype == "bfloat16",
    "one-token steps' GEMVs (and the LM head's) read lossless 12-bit copies of the weights (an 8-entry magnitude "
    "table + the low byte, exact exceptions): the same weights in 3/4 of the bytes"))
register(Mechanism(
    "pdl", ("draft", "verify"), {"pdl": [True, False], "pdl_trigger": ["start", "late"]},
    _fused_path,
    "the fused one-token path's kernels launch with programmatic dependent launch (Hopper): each starts while the "
    "one before it drains and waits on it in-kernel, hiding part of the gap between graphed launches; the GEMVs "
    "let the next kernel launch first thing or after their K loop (pdl_trigger)",
    valid=lambda dep, delta: delta.get("pdl", True) or delta.get("pdl_trigger", "late") == "late"))
register(Mechanism(
    "pdl_l2", ("verify", "draft"), {"pdl_l2_mb": [0, 16, 36, 8], "pdl_l2_share": [0.25, 1.0]},
    lambda dep, cfg: dep.on_cuda and cfg.pdl,
    "under PDL, a one-row GEMV whose weight fits the size asks L2 for all of it (or a share) before its wait, so "
    "o_proj's weight streams in while RoPE and attention (latency-bound: HBM idles) run ahead of it, qkv's in "
    "down_proj's tail"))
register(Mechanism(
    "pdl_l2_next", ("verify", "draft"), {"pdl_l2_next_mb": [0, 8, 16]},
    lambda dep, cfg: dep.on_cuda and cfg.pdl and cfg.fused_decode,
    "under PDL, o_proj's one-token GEMV also asks L2 for the head of gate/up's weight before its wait, while the "
    "attention ahead (latency-bound: HBM idles) runs, so the layer's largest GEMV starts from L2"))
register(Mechanism(
    "pdl_kv_l2", ("verify", "draft"), {"pdl_kv_l2": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.pdl and cfg.fused_decode,
    "under PDL, the one-token attention asks L2 for its slice's older K/V rows before its wait, so they stream in "
    "while RoPE + K/V write runs ahead of it and its loads after the wait hit L2"))
register(Mechanism(
    "rope_split", ("verify", "draft"), {"rope_q_heads": [4, 16, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "RoPE + K/V write spreads q's heads over several programs instead of one (with a q/k norm, one program for 32 "
    "heads is latency on one SM)"))
register(Mechanism(
    "attn_split", ("verify", "draft"), {"attn_split_keys": [64, 256, 128]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention's keys per program: more programs and partials to merge (many KV heads), or fewer "
    "(few KV heads)"))
register(Mechanism(
    "attn_block", ("verify", "draft"), {"attn_block_keys": [64, 32, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention's keys an inner step: a program's slice in one K/V tile load and one softmax pass "
    "(fewer dependent steps) or in smaller tiles (fewer registers)"))
register(Mechanism(
    "attn_merge", ("verify", "draft"), {"attn_merge_chunk": [8, 4, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention's last program reads the slices' partials a chunk at a time (one L2 round trip a "
    "chunk) instead of one dependent round trip a slice"))
register(Mechanism(
    "attn_merge_unroll", ("verify", "draft"), {"attn_merge_unroll": [4, 2, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention's last program issues 2-4 slices' partial loads before it sums them (the loop's order, "
    "the same bits), so their L2 round trips overlap"))
register(Mechanism(
    "attn_early_pos", ("verify", "draft"), {"attn_early_pos": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.pdl and cfg.fused_decode,
    "under PDL, the one-token attention reads the positions (a graph input no kernel writes) before its wait, so "
    "its K/V loads follow the wait at once"))
def _under_pdl_late(dep: Deployment, cfg: EngineConfig) -> bool:
    """A one-token-path switch that acts only under PDL with the late trigger (the fused path on CUDA)."""
    return dep.on_cuda and cfg.pdl and cfg.pdl_trigger == "late" and cfg.fused_decode


register(Mechanism(
    "attn_warps", ("verify", "draft"), {"attn_warps": [8, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention's programs run 8 warps instead of 4, so its 255 registers a thread do not spill"))
register(Mechanism(
    "attn_stages", ("verify", "draft"), {"attn_stages": [2, 1, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention's slice loop pipelines 2 (or 1) stages instead of Triton's 3: 72 KB of shared memory a "
    "program instead of 136 KB for a loop that runs once, room the kernels around it and a cluster's SMs need"))
register(Mechanism(
    "attn_kv_preload", ("verify", "draft"), {"attn_kv_preload": [True, False]},
    _under_pdl_late,
    "under PDL, the one-token attention loads its slice's older K/V rows (written by earlier steps) into registers "
    "before its wait, so only q and the new token's row are read behind it"))
register(Mechanism(
    "attn_cluster", ("verify", "draft"), {"attn_cluster": [16, 0, 8]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention's key slices of a KV head run as one thread-block cluster and merge through "
    "distributed shared memory: no global partials, atomic or L2 reads between the slices and the output"))
register(Mechanism(
    "attn_cluster_even", ("verify", "draft"), {"attn_cluster_even": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode and cfg.attn_cluster > 0,
    "one cluster takes every visible key of a KV head, dealt out evenly over its CTAs in whole tiles: short contexts "
    "get smaller slices and long ones no second cluster and atomic merge"))
register(Mechanism(
    "attn_cluster_push", ("verify", "draft"), {"attn_cluster_push": [False, True]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode and cfg.attn_cluster > 0,
    "the cluster's CTAs store their partials' columns into the CTA that merges them, so the merge reads only its "
    "own shared memory: one cluster barrier and no distributed-memory reads"))
register(Mechanism(
    "attn_loads_first", ("verify", "draft"), {"attn_loads_first": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention asks for a block's V rows with its K rows and for the merge's first partials with the "
    "maxima, not after the reductions that do not feed them: a round trip fewer in the slice and in the merge"))
register(Mechanism(
    "attn_single", ("verify", "draft"), {"attn_single_direct": [True, False], "attn_split_keys": [512, 256, 128]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode,
    "the one-token attention's only working slice stores the output itself (no partial, atomic arrival or merge); "
    "with 256-512 keys a program most decode contexts take that path"))
register(Mechanism(
    "qkv_trigger_first", ("verify", "draft"), {"qkv_trigger_first": [True, False]},
    _under_pdl_late,
    "under the late PDL trigger, qkv + RoPE (one wave) lets the attention launch first thing, so its programs are "
    "resident during the qkv GEMV (with attn_kv_preload: its older K/V rows load meanwhile)"))
register(Mechanism(
    "verify_l2", ("verify",), {"verify_l2_mb": [8, 16, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode and cfg.fused_verify and not cfg.verify_one_launch,
    "a verify block's attention warms o_proj's weight in L2 while it runs (latency-bound: HBM idles), so the "
    "o_proj GEMV after it reads L2"))
register(Mechanism(
    "verify_one_launch", ("verify",), {"verify_one_launch": [False, True]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode and cfg.fused_verify,
    "a verify block's attention in one launch, its slices merged by the last program to finish (PDL where on), not "
    "a split launch and a merge launch: a launch fewer a layer in the step a speculative step is mostly made of"))
register(Mechanism(
    "norm_pdl", ("verify",), {"norm_pdl": [False, True]},
    lambda dep, cfg: dep.on_cuda and cfg.pdl and cfg.fused_decode and cfg.fused_verify,
    "the RMSNorm launches (a verify block's two a layer) launch with PDL too, so the GEMV after each launches while "
    "it runs and loads its first weight tile before its wait, instead of a full kernel boundary"))
register(Mechanism(
    "norm_handoff", ("verify",), {"norm_handoff": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode and cfg.fused_verify and not cfg.norm_epilogue,
    "a verify block's residual GEMVs hand the next GEMV their rows' sums of squares (one writer a partial, no "
    "atomics), so qkv and gate_up normalize their input themselves: the block's two RMSNorm launches a layer go"))
register(Mechanism(
    "verify_rope_in_qkv", ("verify",), {"verify_rope_in_qkv": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode and cfg.fused_verify,
    "a verify block's RoPE and K/V-cache write run in its qkv GEMM's epilogue (each program holds both halves of "
    "its RoPE pairs through two weight tiles): a launch fewer a layer in the step a speculative step is made of"))
register(Mechanism(
    "gemm_bucket", ("verify",), {"gemm_bucket_min": [16, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_decode and cfg.fused_verify,
    "a verify block's M-row GEMMs take the tiling tuned for 16 rows whatever their rows (the tunings are timed "
    "alone, outside a graph: a 5-8-row bucket's choice was slower in the graphed step at 1.5B)"))
register(_fused_switch(
    "gemv_prefetch",
    "the fused one-token path's GEMVs load their first weight tile before the norm prologue reads and reduces the "
    "input row, so the first DRAM round trip of every program overlaps it instead of following it"))
register(_fused_switch(
    "gemv_pipeline",
    "the fused one-token path's GEMVs run their K loop one block ahead: each block's weights are asked for before "
    "the previous block's are summed, two tiles in flight a program instead of one DRAM round trip a block"))
register(_fused_switch(
    "qkv_pipeline",
    "qkv + RoPE runs its K loop two blocks ahead: the first two blocks' weights are asked for right after the wait, "
    "so a program's blocks are one DRAM round trip, not one each"))
register(_fused_switch(
    "early_epilogue",
    "the fused one-token path's GEMVs (and qkv + RoPE) load their epilogue's residual / bias / RoPE operands right "
    "after their wait, so that round trip overlaps the weight stream instead of following each program's last tile"))
register(_fused_switch(
    "tile_after_wait",
    "the fused one-token path's GEMVs (and qkv + RoPE) ask for their first weight tile right after their wait, "
    "ahead of the norm prologue, so the first DRAM round trip overlaps the input row's load and reduction"))
register(Mechanism(
    "tuned_tiles", ("draft", "verify"), {"tuned_tiles": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_projections,
    "the fused GEMVs and qkv + RoPE take their tiles from the table shipped for this GPU model (picks merged over "
    "several tuning runs) instead of one timing run on this machine"))
register(_fused_switch(
    "norm_epilogue",
    "the fused layer's residual GEMVs (o_proj, down_proj) also write the RMSNorm the next GEMV reads (the last "
    "program to finish normalizes the finished rows): qkv, gate_up and the LM head run norm-free, a verify block "
    "loses its two RMSNorm launches a layer and every fused pass the final norm's"))
register(Mechanism(
    "rope_in_attention", ("draft", "verify"), {"rope_in_attention": [True], "rope_in_qkv": [False]},
    _fused_path,
    "a one-token fused layer's q/k norm, RoPE and K/V-cache write run inside its attention launch (every program "
    "rotates q and the new k itself; one writes the slot): five launches a layer instead of six"))
register(Mechanism(
    "rope_in_qkv", ("draft", "verify"), {"rope_in_qkv": [False, True], "rope_in_attention": [False]},
    _fused_path,
    "a one-token fused layer's RoPE and K/V-cache write run in its qkv GEMV's epilogue (each program holds the "
    "pairs of columns RoPE mixes; a q/k norm in each head's last program): five launches a layer instead of six"))
register(Mechanism(
    "fused_mlp", ("draft", "verify"), {"fused_mlp": [True, False]},
    lambda dep, cfg: (_fused_path(dep, cfg) and cfg.rope_in_qkv and not cfg.norm_epilogue and not cfg.lossless12
                      and not cfg.compile),
    "a one-token fused layer's whole MLP in one launch split by intermediate columns: down's partial sums meet in "
    "a pending fp32 row by atomics, settled by the next layer's qkv launch (four launches a layer, one MLP stream)"))
register(Mechanism(
    "megakernel", ("draft", "other"), {"megakernel": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.fused_projections and not cfg.compile,
    "every one-token step (a small drafter's passes, AR decode) as one persistent launch walking all layers, its "
    "phases separated by grid barriers: no launch boundaries, ramps or tails between a step's ~170 kernels"))
register(Mechanism(
    "draft_chain_graph", ("draft",), {"draft_chain_graph": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.drafter_kind == "model" and cfg.cuda_graphs and cfg.sampling.greedy
    and cfg.num_draft_tokens > 1,
    "a small model drafter's K - 1 one-token passes captured as one graph, each argmax feeding the next on the "
    "device: two launches a step instead of K, no per-pass host work"))
register(Mechanism(
    "l2_prefetch", ("draft", "verify"), {"l2_prefetch": [0.5, 1.0, 0.0]},
    lambda dep, cfg: dep.on_cuda and (cfg.fused_decode or cfg.fused_verify) and cfg.fused_projections,
    "a fused layer's gate/up weight (that fraction of it) read into L2 on a side stream while the layer's "
    "latency-bound launches (qkv, RoPE + K/V write, attention, o_proj) leave HBM idle; the gate/up GEMV finds it "
    "there"))
register(Mechanism(
    "early_draft", ("draft", "other"), {"early_draft": [True, False]},
    lambda dep, cfg: dep.on_cuda and early_draft_applies(cfg),
    "the next block's DFlash pass is launched right after the verify step, from the verdict on the device, before "
    "the host reads it: the host's commit, stop rule and n-gram lookup run while the GPU drafts"))
register(Mechanism(
    "pad_shapes", ("other",), {"pad_shapes": [True, False]},
    lambda dep, cfg: dep.on_cuda,
    "eager passes (prefill, the DFlash drafter's first pass, steps no graph bucket fits) padded to a few lengths, "
    "so libraries that plan per shape see a handful of shapes instead of one per prompt length"))
register(Mechanism(
    "prefill_graphs", ("other",), {"prefill_graphs": [2048, 512, 0]},
    lambda dep, cfg: dep.on_cuda and cfg.cuda_graphs and cfg.pad_shapes,
    "a prompt's prefill (and a small drafter's prompt feed) replayed from one CUDA graph per padded length up to "
    "this many tokens, captured on first use, instead of ~400 eager launches (tokens/s count the prefill)"))
register(Mechanism(
    "adaptive", ("draft", "verify"), {"adaptive": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.drafter_kind != "none",  # (a speed choice priced in GPU step costs)
    "per step, draft + verify a block or take a plain one-token step, whichever the measured step costs and the "
    "recent acceptance say commits more tokens a second (lossless either way)"))
register(Mechanism(
    "compile", ("verify", "draft"), {"compile": [True, False]},
    lambda dep, cfg: dep.on_cuda and cfg.cuda_graphs,
    "torch.compile each graphed step (fuses small kernels; compile time paid once)"))


def config_delta(base: EngineConfig, cfg: EngineConfig) -> dict:
    """Fields of `cfg` that differ from `base` (sampling as a nested dict when it differs)."""
    a, b = base.to_dict(), cfg.to_dict()
    return {k: b[k] for k in b if a[k] != b[k]}


__all__ = ["REGISTRY", "STAGES", "Deployment", "Mechanism", "applicable", "config_delta", "family_of", "register"]
