"""Validated configuration. A system under test is fully described by (target, drafter, EngineConfig).

Every mechanism is a field here, so the optimization loop can search it and the CLI can derive its flags from it.
Defaults are stated once, in these dataclasses; nothing mutates a config at run time (use `dataclasses.replace`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from specpilot.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
DRAFTERS = ("none", "model", "ngram", "dflash")
VERIFIERS = ("chain",)


_TYPES = {"bool": ((bool,), "true or false"), "int": ((int,), "a whole number"), "float": ((int, float), "a number"),
          "str": ((str,), "a string")}


def _check_types(obj) -> None:
    """Every plain field holds a value of its declared type (a config file's `num_draft_tokens: "8"` or `pdl: 1` is
    a clear ConfigError, not a TypeError from a comparison further on, nor a silently truthy switch)."""
    for f in fields(obj):
        if f.type not in _TYPES:
            continue
        kinds, what = _TYPES[f.type]
        v = getattr(obj, f.name)
        if not isinstance(v, kinds) or (isinstance(v, bool) and f.type != "bool"):
            raise ConfigError(f"{f.name} must be {what}, got {v!r}")


def _validate(obj, check_values) -> None:
    """The field's own checks first (their messages say what values are allowed), then the types; a check that trips
    over a value of the wrong type (a TypeError from a comparison) gives way to the type's message."""
    try:
        check_values()
    except TypeError:
        _check_types(obj)
        raise
    _check_types(obj)


def load_config_file(path, what: str = "config file") -> dict:
    """A YAML / JSON file holding one mapping -> that dict ({} for an empty file); ConfigError for a missing or
    unreadable file, bad YAML, or anything but a mapping at the top."""
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"cannot read {what}: {e}") from None
    except yaml.YAMLError as e:
        where = " ".join(x.strip() for x in str(e).splitlines())
        raise ConfigError(f"{what} {path} is not valid YAML/JSON: {where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of field: value, got a {type(data).__name__}")
    return data


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 samples
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        _validate(self, self._check_values)

    def _check_values(self):
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    drafter_kind: str = "model"  # "none" = AR; "model" = small AR drafter; "ngram" = prompt lookup; "dflash" = block
    num_draft_tokens: int = 4  # block size: tokens drafted per step (the n-gram drafter may propose fewer)
    ngram_max: int = 4  # longest suffix n-gram the prompt-lookup drafter matches
    ngram_min: int = 1
    # > 0 (drafter_kind "dflash" or "model", greedy): prompt lookup drafts beside the model each step and its
    # continuation is verified instead when its suffix match is at least this long and its first token agrees with
    # the model's (chosen on the device; drafters/ngram_assist.py); 0 = off. On (2) since it raised the DFlash
    # drafter's tau on HumanEval 2.21 -> 3.68 and by 0.5-2% on MT-Bench, GSM8K and MBPP (BENCHMARKS.md session 11)
    ngram_assist: int = 2
    # > num_draft_tokens: on steps where the lookup has such a match, draft (and verify) this many tokens instead
    # (a second verify bucket): long copies get a long block, other steps keep the short one; 0 = num_draft_tokens
    ngram_assist_tokens: int = 0
    verify: str = "chain"
    max_new_tokens: int = 256
    max_seq_len: int = 4096  # KV pool length: prompt + output + one block must fit
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    cuda_graphs: bool = True  # on CUDA: replay captured graphs per (tokens-per-step) bucket; ignored on CPU
    compile: bool = False  # torch.compile each graphed step first (fuses small kernels; costs compile time once)
    fused_projections: bool = True  # one qkv GEMM and one gate+up GEMM per layer (same numbers, fewer kernels)
    gemv_kernel: bool = False  # few-token projections through our Triton GEMV instead of cuBLAS (CUDA only)
    attention_kernel: bool = True  # CUDA: steps of <= 16 tokens attend through the split-KV Triton kernel (x1.15-
    # x1.28 on whole H200 runs, BENCHMARKS.md session 8) instead of masked SDPA over the whole pool; ignored elsewhere
    draft_attention_kernel: bool = True  # CUDA: the DFlash draft block attends through the same kernel instead of
    # masked SDPA over the whole draft pool (H200: the draft graph 0.823 -> 0.631 ms, session 11; GPU engine check
    # equal, sessions 11-14). On since session 14's bench found the speculative step, not tau, holding SpecPilot
    # below our fused AR
    norm_kernel: bool = True  # CUDA: every RMSNorm through one Triton launch (kernels/rmsnorm.py) instead of 8 eager
    # kernels (~32 per layer of a 1.5B graphed decode step, each >= ~1.1 us); same numbers. On since the H200 loop
    # accepted it (x1.21 dev / x1.22 held-out, DFlash on the 1.5B; BENCHMARKS.md session 11)
    rope_kernel: bool = True  # CUDA: RoPE of q and k in one Triton launch per layer (kernels/rope.py) instead of
    # 10 eager kernels (neg, cat, 2 mul, add, each for q and k); same numbers. On since the loop accepted it (x1.16)
    act_kernel: bool = True  # CUDA: the MLP's silu(gate) * up in one Triton launch per layer (kernels/silu_mul.py)
    # instead of 2 eager kernels (silu, mul; the gate+up halves read in place); bit-equal in bf16
    add_norm_kernel: bool = True  # CUDA: each residual add + the RMSNorm after it (post-attention; next layer's
    # input norm / the final norm) in one Triton launch (kernels/add_rmsnorm.py) instead of the add + the norm's
    # kernels, twice per layer; bit-equal in bf16. Both on since session 14 (the 16-token verify step, now most of a
    # speculative step, runs this path): H200 engine check equal, verify step 2.623 -> 2.484 ms at the 1.5B shape
    # with both (session 11)
    fused_decode: bool = True  # CUDA: one-token steps (AR decode, a small drafter's passes, n-gram steps with
    # nothing drafted) through six launches per layer (models/fused_decode.py: norms as GEMV prologues, residual adds
    # and SiLU * up as epilogues, RoPE with the K/V write, one-launch attention) instead of ~15; multi-token steps
    # keep the regular path; needs fused_projections. H200 (BENCHMARKS.md session 12): graphed step 1.5B 2.01 -> 1.59 ms, Qwen3-8B 5.54 ->
    # 4.90 ms (random weights); real Qwen2.5-Coder-1.5B AR 414 -> 561 tok/s; engine parity checks equal
    fused_verify: bool = True  # CUDA, with fused_decode: steps of 2-16 tokens in one row (speculative verify
    # blocks, e.g. DFlash's 16) through the fused layer at T rows (models/fused_decode.py: RMSNorm launches, M-row
    # GEMVs via tl.dot (split-K where K >= 2N) with residual / SiLU * up epilogues, RoPE + K/V write, split-KV
    # attention; nine launches a layer instead of ~12 with cuBLAS at M = 16). On since session 15's real-weight H200
    # A/B (Qwen2.5-Coder-1.5B + DFlash, 6 prompts x 3 benchmarks, forcing passed): the verify stage 2.12 -> 1.80 ms,
    # SpecPilot x1.17 -> x1.30 our AR pooled (the first version, with norm prologues in the GEMV, was 14% slower)
    lossless12: bool = False  # CUDA, bf16, with fused_decode: the one-token steps' GEMVs (and the LM head's) read
    # lossless 12-bit copies of the weights (formats/lossless12.py, kernels/gemv12.py): every weight exact, 1.5 bytes
    # instead of 2, so the bytes floor of a decode step drops by a quarter; the bf16 weights stay for prefill and
    # verify (memory +3/4 of the weights). Off until an H200 run times it
    pdl: bool = True  # CUDA sm_90+: the fused one-token path's kernels launch with programmatic dependent launch
    # (kernels/pdl.py): each may start while the one before it drains, hiding part of the ~1.1 us gap between graphed
    # launches (~170 in a 1.5B step). Needs fused_decode (the kernels it launches); same numbers. With the GEMVs
    # triggering first thing it bought nothing on the H200 (sessions 13-26: ~1%, and 8% slower with the first-tile
    # prefetch); with pdl_trigger "late" the graphed step is 1.7-5.6% faster at 1.5B and 3.6% at Qwen3-8B
    # (session 26, exact): on by default since. Elsewhere (CPU, a GPU before Hopper, no fused_decode) it stays off
    pdl_trigger: str = "late"  # with pdl: where the fused path's GEMVs let the next kernel launch (kernels/pdl.py):
    # "start" (first thing: the next grid's programs may sit in their wait holding slots the GEMV's later programs
    # need, and the chain runs on behind them) or "late" (after the K loop: the next kernel launches during the
    # GEMV's tail). Same numbers either way
    pdl_l2_mb: int = 8  # with pdl: a one-row GEMV whose weight is at most this many MiB asks L2 for all of it (bulk
    # prefetches of each program's rows) before its wait, so it streams in while the kernel ahead runs: o_proj behind
    # RoPE + attention, latency-bound launches in which HBM idles (kernels/gemv_fused.py PDL_L2_MAX_BYTES). 0: off.
    # Same numbers. 8 since session 29 (H200, graphed one-token step, interleaved: Qwen2.5-1.5B -6.5 / -9.4 / -6.5%
    # in three runs, o_proj's 4.5 MiB alone as much; session 26 -5.3%, session 27 +0.5%; Qwen2.5-0.5B within noise;
    # at Qwen3-8B no weight is that small: warming its o_proj's 32 MiB was +1.4%). Without pdl it does nothing
    pdl_l2_share: float = 1.0  # with pdl_l2_mb: the share of each warmed weight asked of L2 (every program's first
    # share of its rows' bytes; a multiple of 1/64 in (0, 1]): no more traffic than the idle window ahead can hold,
    # so the kernel ahead's own loads do not queue behind it (kernels/gemv_fused.py PDL_L2_PART). Same numbers.
    # 1.0: a share was slower or neutral at both shapes on the H200 (session 29); the loop may search 0.25
    pdl_l2_next_mb: int = 8  # with pdl: o_proj's one-token GEMV also asks L2, before its wait, for this many MiB
    # of the head of gate/up's weight (the first rows of both halves, which gate/up's first programs read), while the
    # latency-bound attention ahead leaves HBM idle (kernels/gemv_fused.py PDL_L2_NEXT_BYTES). A hint: same numbers.
    # Only behind an o_proj warmed itself (pdl_l2_mb). 8 since session 34 (H200, graphed one-token step at 1.5B:
    # -2.8 / -2.0 / -1.9% on three machines, every interleaved round below the default's in the last two; at
    # Qwen3-8B o_proj streams from DRAM, so a no-op; real-weight AR +0.4% over two orders, within its noise). 0: off
    pdl_kv_l2: bool = False  # with pdl: the one-token attention asks L2 for its slice's K/V rows (written by earlier
    # steps) before its wait, while RoPE + K/V write runs ahead of it, so its loads after the wait hit L2 instead of
    # making DRAM round trips (kernels/decode_attention.py PDL_KV_L2). A hint: same numbers. Off: SLOWER on the
    # H200 (session 27, random weights: Qwen3-8B step +1.5 / +1.6%, 1.5B +6%; engine check equal)
    rope_q_heads: int = 8  # CUDA: q heads one RoPE + K/V-write program takes (rounded up to a power of two); 0: all
    # of them in one program (kernels/rope_write.py Q_HEADS_PER_PROGRAM: Qwen3-8B's 32 normed q heads took 5.1 us
    # on one SM, session 26). Same numbers. 8 since session 27 (H200, graphed one-token step, random weights,
    # interleaved against 0 on two machines: Qwen3-8B -1.4 / -1.6%, 1.5B -0.5 / -0.6%)
    attn_split_keys: int = 128  # CUDA: keys a program of the one-token attention takes (kernels/decode_attention.py
    # ONE_LAUNCH_SPLIT; a power of two, 16-1024; keys an inner step: attn_block_keys): more programs and more
    # partials to merge, or fewer. Same numbers up to the merge's summation order (fp32). H200, session 27: 64 was
    # -0.8 to -1.0% at Qwen3-8B (8 KV heads) and +0.7 to +1.4% at 1.5B (2): the loop searches it
    attn_block_keys: int = 0  # CUDA: keys one inner step of a one-token attention program takes (kernels/
    # decode_attention.py ONE_LAUNCH_SPLIT's second number; 0: min(attn_split_keys, 128); else a power of two in
    # [16, 256], at most attn_split_keys). 128 with 128 keys a program: one K and one V tile load and one pass of
    # the online softmax instead of two dependent ones (64: two). Same attention up to the fp32 order of the online
    # softmax. 0 = 128 since session 41 (H100, graphed one-token step against 64, interleaved: 1.5B -2.5 / -3.3% at
    # 512 / 2048 tokens over 6 rounds, -4.2 / -5.8% over 4 on another machine; Qwen3-8B -0.2% twice; GPU engine
    # check equal; not yet timed on an H200); the loop searches 64 and 32
    attn_merge_chunk: int = 0  # CUDA: the one-token attention's last-arriving program reads the slices' partials
    # this many at a time (one L2 round trip a chunk; kernels/decode_attention.py MERGE_CHUNK; 0: one slice at a
    # time, a dependent round trip each; else a power of two <= 64). Same numbers up to the merge's fp32 order.
    # H200, session 28: 8 is -1.5 to -2.9% at Qwen3-8B (8 KV heads, 4 rows a merge) and +1.6 to +3.5% at 1.5B (2
    # KV heads, 6 rows; 4 there +6.6%): the loop searches it (mechanism attn_merge)
    verify_l2_mb: int = 0  # CUDA, with fused_verify: a 2-16-token verify block's attention (the split + merge
    # pair) warms o_proj's weight in L2 when it is at most this many MiB, so the o_proj GEMV after it reads L2
    # instead of ramping on DRAM (kernels/decode_attention.py VERIFY_WARM_MAX_BYTES; the one-token path's twin is
    # pdl_l2_mb, which at 1.5B took 4.5-9% off the step). A hint: same numbers. 0: off (H200, session 29: neutral,
    # 5 / 16 tokens +0.3 / +0.4%)
    verify_one_launch: bool = True  # CUDA, with fused_verify: a 2-16-token verify block's attention is ONE launch
    # whose last-arriving program merges the slices (PDL where on), not the split + merge pair: a launch fewer a
    # layer (kernels/decode_attention.py VERIFY_ONE_LAUNCH). Same numbers; verify_l2_mb does not apply with it.
    # On since session 52: H100s, random bf16 weights, paired: 1.5B 16-token step -4.4% (session 50, two calls),
    # -3.9% (session 52), 5 tokens -4.1%, Qwen3-8B 16 tokens -0.9%; with norm_pdl -1.0% on a second H100 (every
    # round faster); the engine check's tokens equal (session 52).
    # Not yet timed on an H200; the loop searches off
    norm_pdl: bool = True  # CUDA, with PDL: the RMSNorm launches (a verify block's two a layer) launch with PDL too,
    # letting the next GEMV launch first thing and waiting before they read (kernels/rmsnorm.py PDL). Same numbers.
    # On since session 52: on top of verify_one_launch, 1.5B 16-token step -1.5% more on an H100 (paired; -5.4%
    # against neither), the engine check's tokens equal. Not yet timed on an H200; the loop searches off
    gemm_bucket_min: int = 0  # CUDA, with fused_verify: the verify block's M-row GEMMs take the autotuned tiling of
    # at least this many rows' bucket (kernels/gemm_rows.py M_BUCKET_MIN; 0 or a power of two <= 16; 0: M rounded
    # up to a power of two). Same numbers up to the fp32 summation order of the tiling. 0 for now: 16 was -0.3 to
    # -5.6% at 5 / 8 tokens on one H200 (session 29, 1.5B), to be confirmed (a 5-token step cost 7% more than a
    # 9-token one on another)
    attn_merge_unroll: int = 4  # CUDA: the one-token attention's last-arriving program issues this many slices'
    # loads (2 or 4) before summing them, in the loop's order (kernels/decode_attention.py MERGE_UNROLL: the same
    # bits as the loop, fewer dependent L2 round trips; attn_merge_chunk, if set, takes precedence). 0: the loop, a
    # slice an iteration. 4 since session 40 (H100, graphed one-token step: 1.5B -0.2 / -0.7 / -2.9% at 256 / 512 /
    # 2048 tokens, Qwen3-8B -0.1 / -0.4% at 512 / 2048; the merge 2.43 -> 2.08 us a layer in the trace; not yet
    # timed on an H200)
    attn_early_pos: bool = True  # with pdl: the one-token attention reads the positions before its wait, so its
    # K/V loads follow the wait at once instead of a round trip later (kernels/decode_attention.py PDL_EARLY_POS
    # says why that read is safe). Same numbers (engine check). On since session 28 (H200, interleaved: 1.5B step
    # -0.6 / -1.4 / -0.9% in three runs of four, Qwen3-8B -0.5 to +0.4%); without pdl it does nothing
    attn_warps: int = 0  # CUDA: warps a program of the one-token attention runs (kernels/decode_attention.py
    # ONE_LAUNCH_WARPS; 0: Triton's default, 4). Why: compiled for sm_90 the kernel holds 255 registers a thread and
    # spills with 4 warps (more with attn_kv_preload's tiles: 1.4 KB a thread); 8 spread them. Same math, another
    # order of the softmax's in-warp sums. 0: 8 was no faster on the H200 (session 35: 1.5B +0.3%, 8B -0.7%, both
    # within the drift); the loop searches 8
    attn_stages: int = 0  # CUDA: software-pipeline stages of the one-token attention's slice loop (kernels/
    # decode_attention.py ONE_LAUNCH_STAGES; 0: Triton's default, 3). 3 stages take 136 KB of shared memory a program
    # for a loop that runs once at 128 keys a program (2: 72 KB). Same numbers. Off until a GPU times it (session 42);
    # the loop searches 2 and 1
    attn_kv_preload: bool = False  # with pdl (late trigger): the one-token attention loads its slice's older K/V
    # rows into registers before its wait and only the new token's row after it (kernels/decode_attention.py
    # KV_PRELOAD says why that is safe), so no DRAM round trip sits between the wait and the softmax. Same numbers.
    # Off: not faster on the H200 (session 35: 1.5B +1.3 / +2.4% with 8 warps, 8B -0.7%); the loop searches it
    attn_loads_first: bool = False  # CUDA: the one-token attention asks for loads ahead of the reductions that do
    # not feed them: a block's V rows with its K rows (not after the scores' maxima: a second DRAM round trip a
    # slice) and the merge's first slices with the maxima (kernels/decode_attention.py LOADS_FIRST). Same bits.
    # Off until a GPU times it (session 41); the loop searches it
    attn_cluster: int = 8  # CUDA sm_90+: the one-token attention's key slices of a KV head run as a thread-block
    # cluster of this many CTAs (4, 8 or 16) and merge through distributed shared memory, with no global partials,
    # atomic or L2 reads (kernels/cluster_attention.py); a context past one cluster's keys merges the clusters'
    # partials as the one-launch kernel does. Another summation order of the partials. 8 since session 42 (H100,
    # graphed one-token step: 1.5B -4.8 / -5.0% at 512 tokens, -1.9 / -2.0% at 2048; Qwen3-8B -1.4%; 16: 1.5B -3.8%
    # / -4.8%, 8B +1.6%; 4: 1.5B +3.2%); 0: off (the one-launch kernel's merge). Where it cannot run (before Hopper,
    # the interpreter) the one-launch kernel runs without a word; the loop searches 16 and 0
    attn_cluster_even: bool = False  # with attn_cluster: one cluster takes every visible key of a KV head, its CTAs
    # ceil(tiles / attn_cluster) whole attn_block_keys tiles each (attn_split_keys unused), so no context needs a
    # second cluster and the atomic merge across clusters (kernels/cluster_attention.py EVEN); short contexts get
    # smaller slices. Another split of the same sums. Off until a GPU times it (session 42); the loop searches it
    attn_cluster_push: bool = True  # with attn_cluster: each CTA stores its partial's columns straight into the
    # shared memory of the CTA that merges them (kernels/cluster_attention.py PUSH), so after one cluster barrier
    # every read is local: no distributed-memory read round trip and no second barrier. Same sums. On since session
    # 49: faster at every shape on two H100s (graphed one-token step, paired: 1.5B -0.7 / -0.8% at 512 tokens,
    # -0.2 / -0.7% at 2048, Qwen3-8B -0.4 / -0.2%; sessions 42 and 49), not yet timed on an H200; the loop searches
    # off
    attn_single_direct: bool = False  # CUDA: the one-token attention's only working slice (the context within
    # attn_split_keys) stores the output itself instead of a partial, an atomic arrival and a merge of one
    # (kernels/decode_attention.py SINGLE_DIRECT; with attn_split_keys 256-512 most decode contexts). Same bits.
    # Off: SLOWER on an H100 (session 39: 1.5B +14.2% with 512 keys, +5.5% with 256; Qwen3-8B +3.1% with 512): one
    # program streaming 512 keys took 13.3 us to its store, four of 128 plus the merge 7.4; the loop searches it
    qkv_trigger_first: bool = False  # with pdl (late trigger): qkv + RoPE lets the attention launch first thing
    # (kernels/qkv_rope.py TRIGGER_FIRST: one wave, so no program of it is stranded), so the attention's programs are
    # resident during the qkv GEMV and attn_kv_preload's older K/V rows load under its weight stream. Same numbers.
    # Off: on an H100 (session 39) alone +5.5% at 1.5B, with attn_kv_preload -0.0% (1.5B) / +0.4% (Qwen3-8B)
    gemv_prefetch: bool = False  # CUDA, with fused_decode: the one-row GEMVs (kernels/gemv_fused.py) load their first
    # weight tile before the norm prologue's row load and reduction, without PDL, so that DRAM round trip overlaps
    # it (qkv, gate/up: every program). A process-wide switch, as pdl. Same numbers. Off: SLOWER on the H200
    # (session 26, scripts/gpu_step_timing.py --variants=fuseddecode,fusedprefetch: 1.5B step +8.5%, Qwen3-8B equal)
    gemv_pipeline: bool = False  # CUDA, with fused_decode: the one-row GEMVs' K loop runs one block ahead (block k's
    # weights asked for before block k - 1's are summed: two tiles in flight a program, not one; kernels/gemv_fused.py
    # ONE_ROW_PIPE says why). A process-wide switch, as pdl. Same numbers. Off: neutral on the H200 (session 35,
    # graphed one-token step: 1.5B -0.8%, Qwen3-8B +0.4%, two interleaved pairs each, within the drift)
    qkv_pipeline: bool = False  # CUDA, with fused_decode: qkv + RoPE's K loop runs two blocks ahead (the first two
    # blocks' weights asked for right after the PDL wait, ahead of the norm prologue; kernels/qkv_rope.py PIPE says
    # why: at the 1.5B shape a program's two blocks were two DRAM round trips in a row). Same numbers. Off until a
    # GPU times it (session 42); the loop searches it
    early_epilogue: bool = False  # CUDA, with fused_decode: the one-row GEMVs and qkv + RoPE load their epilogue's
    # operands (residual, bias; qkv's cache slot and cos / sin) right after the PDL wait instead of after the K loop,
    # so that L2 round trip overlaps the weight stream instead of sitting between a program's last tile and its
    # store (the last program's store releases the next kernel; kernels/gemv_fused.py EARLY_EPILOGUE). A
    # process-wide switch, as pdl. Same numbers. Off until the H200 times it (session 36 had no device)
    tile_after_wait: bool = False  # CUDA, with fused_decode: the one-row GEMVs and qkv + RoPE ask for their first
    # K block's weight tile right after the PDL wait, ahead of the norm prologue's row load and reduction (gate/up,
    # qkv and the LM head otherwise make their first DRAM request only after it; kernels/gemv_fused.py
    # FIRST_TILE_AFTER_WAIT; gemv_prefetch's tile comes before the wait). A process-wide switch, as pdl. Same
    # numbers. Off until the H200 times it (session 36 had no device)
    tuned_tiles: bool = True  # CUDA: the fused GEMVs and qkv + RoPE take their tiles from the table shipped for
    # this GPU model (kernels/tuned/<gpu>.json: scripts/tuned_table.py over several tuning runs, or
    # scripts/gpu_tune_in_graph.py) instead of timing every config at each new shape (100-140 s a layer shape on the
    # H200; ~46 s at 1.5B on an H100; and one run on a drifting machine can pick a slow tile: kernels/tuned.py).
    # Shapes the table lacks, and GPUs with no table, are tuned as before. On since session 44: on an H100 the
    # in-graph table's step was as fast as the machine's own tuning at 1.5B (+0.0% / -0.3% at 512 / 2048 tokens)
    # and 0.6% faster at Qwen3-8B. The H200 table (sessions 34-35) is not yet timed against per-machine tuning;
    # the loop searches it
    tuned_table: str = ""  # CUDA, with tuned_tiles: a tile table file (kernels/tuned.py's format; e.g. one
    # scripts/gpu_tune_in_graph.py wrote for your GPU) taken instead of the one shipped for this GPU model. Why: a GPU
    # with no shipped table gets pinned tiles too, and one process can time two tables against each other
    norm_epilogue: bool = False  # CUDA, with fused_decode / fused_verify: the fused layer's residual GEMVs (o_proj,
    # down_proj) also write the RMSNorm of their output that the next GEMV reads (post-attention; the next layer's
    # input norm, after the last layer the final norm): the last program of the launch to finish normalizes the
    # finished rows (kernels/norm_epilogue.py). So qkv, gate_up and the LM head run norm-free: a verify block loses
    # its two RMSNorm launches a layer (9 -> 7; ~1.3 us of graphed gap + latency each), every fused pass the final
    # norm's launch, and a one-token step the per-program norm prologues (the 12-bit GEMVs streamed 2.5-2.7 TB/s
    # with one vs 3.8-3.9 without). Same numbers (rmsnorm.py's rounding). Off: SLOWER on the H200 (session 16,
    # 1.5B random weights: T = 1 1.525 -> 1.662 ms, T = 16 1.940 -> 2.553; the last program's serial tail and the
    # registers it adds to every program cost more than the launches saved; scripts/gpu_step_timing.py fusednormepi)
    norm_handoff: bool = False  # CUDA, with fused_verify: a verify block's residual GEMVs (o_proj, down_proj) hand
    # the GEMV after them (gate_up, the next layer's qkv) their output rows' sums of squares by 16-column groups,
    # each partial from the one program that stored those columns (kernels/norm_handoff.py): that GEMV normalizes
    # its input from them in one small load, with no RMSNorm launch before it and no serial pass over the rows (what
    # made the M-row norm prologue slow). 2L + 1 norm launches a block become 2 (layer 0's input norm, the final
    # norm). Numbers: the mean's squares summed in another (fixed) order than the RMSNorm launch's; token forcing
    # judges. Not with norm_epilogue. Off: slower on an H100 (session 52, 1.5B, paired against verify_one_launch +
    # norm_pdl: +3.4% at 16 tokens, +3.2% at 5); the loop searches it
    verify_rope_in_qkv: bool = False  # CUDA, with fused_verify: a verify block's RoPE and K/V-cache write run in its
    # qkv GEMM's epilogue (kernels/qkv_rope_rows.py: a program holds both halves of its columns' RoPE pairs through
    # two weight tiles) instead of rope_write's launch after it: a launch fewer a layer (H100, session 50: that
    # launch was 75 us of a 2.18 ms 1.5B 16-token step, plus its boundaries). Layers with a q/k norm (Qwen3) keep
    # the launch. Numbers: the GEMM's and apply_rope's rounding; the dot products' summation order may differ with
    # the tiles. Off: not faster on an H100 (session 52, 1.5B, paired against verify_one_launch + norm_pdl: +0.3% at
    # 16 tokens, +3.1% at 5); the loop searches it
    rope_in_attention: bool = False  # CUDA, with fused_decode: a one-token fused layer's q/k norm (Qwen3), RoPE and
    # K/V-cache write run inside its attention launch (kernels/rope_attention.py) instead of a launch of their own
    # (kernels/rope_write.py): 6 -> 5 launches a layer (~2.4 us of a ~54 us 1.5B layer on the H200, pure launch
    # latency). Same numbers. Off: SLOWER on the H200 (session 19, random weights: 1.5B 1.442 -> 1.573 ms, Qwen3-8B
    # 4.647 -> 4.692; scripts/gpu_step_timing.py fusedropeattn)
    rope_in_qkv: bool = True  # CUDA, with fused_decode: a one-token fused layer's RoPE and K/V-cache write (and
    # Qwen3's per-head q/k norm, done by each head's last program) run in its qkv GEMV's epilogue
    # (kernels/qkv_rope.py) instead of a launch of their own: 6 -> 5 launches a layer. Same numbers (GPU engine
    # check, Qwen2 and Qwen3 shapes). On since session 31: graphed one-token step, PDL late, interleaved 4 rounds,
    # 1.5B -4.0% (session 30) and -2.0% (session 31, a second machine), Qwen3-8B -0.2% / 0.0% (neutral). Not with
    # rope_in_attention (both move the same work: set this false to try that); with lossless12 the 12-bit qkv GEMV
    # keeps the RoPE launch
    fused_mlp: bool = False  # CUDA, with fused_decode and rope_in_qkv: a one-token fused layer's whole MLP (norm,
    # gate/up, SiLU x up, down) in ONE launch split by intermediate columns, down's partial sums added into a
    # pending fp32 row by atomics that the next layer's qkv + RoPE launch rounds and adds to the residual
    # (kernels/fused_mlp.py): 5 -> 4 launches a layer, and the MLP one 82 MB stream (1.5B) with one ramp and one
    # tail instead of two. Numbers: down's fp32 summation order differs and on a GPU varies between runs (token
    # forcing judges it). Keeps a transposed copy of down_proj's weights. Not with norm_epilogue, lossless12 or
    # compile. Off: exact but slower (H100, session 47, graphed one-token step at 512 tokens: 1.5B 2.36 vs 1.45 ms,
    # +63%; Qwen3-8B 10.46 vs 5.62 ms, +86%; BENCHMARKS.md)
    draft_chain_graph: bool = False  # a small model drafter (greedy, CUDA graphs): its K - 1 one-token passes after
    # the catch-up pass captured as ONE graph, each pass's argmax feeding the next on the device (drafters/
    # small_ar.py): two launches a step instead of K, none of the host's per-pass work. Same drafts. Off: it did
    # not pay on the H200 (session 21, the real 0.5B drafter: draft stage 3.90 -> 4.06 ms a step)
    l2_prefetch: float = 0.0  # CUDA, with fused_decode / fused_verify: this fraction of each fused layer's gate/up
    # weight is read into L2 on a side stream while the layer's latency-bound launches (qkv, RoPE + K/V write,
    # attention, o_proj: HBM mostly idle) run, so the gate/up GEMV (the layer's largest read) finds it there
    # (kernels/l2_prefetch.py). Same numbers; 0 = off. Off: slower in all three of its modes on the H200 (session
    # 21: 1.5B step 1.458 -> 1.718-4.213 ms, Qwen3-8B 4.613 -> 4.885-5.620)
    megakernel: bool = False  # CUDA, fused projections, one row: every one-token step (AR decode, a small drafter's
    # passes; not a DFlash target's, which must hand the drafter its layer features) as ONE persistent launch of one
    # program per SM walking all layers, phases separated by grid barriers (kernels/megakernel.py): no launch
    # boundaries, ramps or tails between the ~170 kernels of a fused step, the o_proj / gate-up GEMVs over balanced
    # row ranges. Same numbers as the fused step up to GEMV summation order. Off: exact but slower on the H200
    # (session 23, scripts/gpu_megakernel.py: 1.5B step 1.45 -> 1.75 ms, Qwen3-8B 4.66 -> 7.15 ms)
    pad_shapes: bool = True  # CUDA: eager passes (the prompt's prefill, DFlash's first pass, a step no graph bucket
    # fits) padded to a few lengths (engine/runner.py `padded_length`): each new prompt length cost 35-135 ms
    # outside the decode steps on the H200 (session 14; per-shape library planning); same tokens, ignored on CPU
    prefill_graphs: int = 2048  # CUDA graphs, padded shapes: a prompt's prefill of up to this many (padded) tokens
    # replays one captured graph per padded length (16-256 with the runner, longer on first use; engine/
    # prefill_graphs.py): the eager prefill was launch-bound, 16-18 ms for any prompt of 51-215 tokens on the H200
    # (session 21), and tokens/s count it. Same tokens (the same pass from the same buffers); 0 = always eager
    # speculative engines: each step either drafts or is a plain one-token step, whichever measured step costs and
    # recent acceptance say commits more tokens a second (engine/adaptive.py); lossless either way. Why: on the H200
    # a 16-token DFlash step cost 2.2-2.8 fused one-token steps (session 14), so low-acceptance stretches ran slower
    # than AR. adaptive_min_gain: speculate while predicted gain >= this; adaptive_max_plain: longest plain run.
    # Off: session 15's H200 A/B lost with it (pooled x1.17 -> x1.14, with fused verify x1.30 -> x1.13; it went
    # plain on 43-78% of GSM8K / MT-Bench steps where speculation still paid: the acceptance average is too noisy)
    adaptive: bool = False
    adaptive_min_gain: float = 1.0
    adaptive_max_plain: int = 8
    fused_accept: bool = True  # greedy speculative steps: the chain verdict is computed inside the verify step (in
    # its CUDA graph) and read packed with the drafts in the step's one sync; False = separate eager accept launches
    early_draft: bool = True  # a graphed (static) DFlash drafter, no adaptive policy (greedy or sampled): the next
    # block's draft pass is launched right after the verify step, from the verdict still on the device (drafters/
    # dflash.py `launch_early`), before the host reads that verdict; the host's commit, stop rule and n-gram lookup
    # then run while the GPU drafts, instead of the GPU idling through them and the host's launch of the pass. Same
    # drafts, same tokens; a no-op elsewhere (CPU, eager drafters, sampling). On since session 19's H200 A/B (real
    # Qwen2.5-Coder-1.5B + the shipped DFlash drafter, 20 prompts each, forcing passed): HumanEval 1,209 -> 1,299
    # tok/s (x2.05 -> x2.26 our AR), MT-Bench 586 -> 692 (x1.12 -> x1.27); the draft stage 0.64 -> 0.17 ms a step
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    @property
    def pdl_late(self) -> bool:
        """PDL on with the GEMVs' trigger after their K loop (the cost model's flag, costmodel/shapes.py)."""
        return self.pdl and self.pdl_trigger == "late"

    def __post_init__(self):
        _validate(self, self._check_values)

    def _check_values(self):
        if not isinstance(self.sampling, SamplingConfig):
            raise ConfigError(f"sampling must be a mapping of {[f.name for f in fields(SamplingConfig)]}, "
                              f"got {self.sampling!r}")
        if not (isinstance(self.stop_strings, tuple) and all(isinstance(x, str) for x in self.stop_strings)):
            raise ConfigError(f"stop_strings must be a list of strings, got {self.stop_strings!r}")
        if self.drafter_kind not in DRAFTERS:
            raise ConfigError(f"drafter_kind must be one of {DRAFTERS}, got {self.drafter_kind!r}")
        if self.verify not in VERIFIERS:
            raise ConfigError(f"verify must be one of {VERIFIERS}, got {self.verify!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.num_draft_tokens <= 0 and self.drafter_kind != "none":
            raise ConfigError(f"num_draft_tokens must be > 0, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("need 1 <= ngram_min <= ngram_max")
        if self.ngram_assist < 0:
            raise ConfigError(f"ngram_assist must be >= 0 (0 = off), got {self.ngram_assist}")
        if self.ngram_assist_tokens < 0:
            raise ConfigError(f"ngram_assist_tokens must be >= 0 (0 = num_draft_tokens), got {self.ngram_assist_tokens}")
        if self.max_seq_len < 16:
            raise ConfigError(f"max_seq_len must be >= 16, got {self.max_seq_len}")
        if not isinstance(self.pdl, bool):  # a process-wide launch switch: "false" from a file must not turn it on
            raise ConfigError(f"pdl must be true or false, got {self.pdl!r}")
        if self.pdl_trigger not in ("start", "late"):
            raise ConfigError(f"pdl_trigger must be 'start' or 'late', got {self.pdl_trigger!r}")
        if not isinstance(self.pdl_l2_mb, int) or isinstance(self.pdl_l2_mb, bool) or self.pdl_l2_mb < 0:
            raise ConfigError(f"pdl_l2_mb must be an integer >= 0 (MiB), got {self.pdl_l2_mb!r}")
        share = self.pdl_l2_share
        if (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1
                or share * 64 != int(share * 64)):
            raise ConfigError(f"pdl_l2_share must be a multiple of 1/64 in (0, 1] (e.g. 0.25), got {share!r}")
        if share != 1 and not self.pdl_l2_mb:
            raise ConfigError("pdl_l2_share needs pdl_l2_mb (the weights it warms: without it nothing is warmed)")
        if (not isinstance(self.pdl_l2_next_mb, int) or isinstance(self.pdl_l2_next_mb, bool)
                or self.pdl_l2_next_mb < 0):
            raise ConfigError(f"pdl_l2_next_mb must be an integer >= 0 (MiB), got {self.pdl_l2_next_mb!r}")
        if not isinstance(self.pdl_kv_l2, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"pdl_kv_l2 must be true or false, got {self.pdl_kv_l2!r}")
        if self.pdl_kv_l2 and not self.pdl:
            raise ConfigError("pdl_kv_l2 needs pdl (the prefetch is issued before the PDL wait)")
        if not isinstance(self.rope_q_heads, int) or isinstance(self.rope_q_heads, bool) or self.rope_q_heads < 0:
            raise ConfigError(f"rope_q_heads must be an integer >= 0 (0: one program for all q heads), got "
                              f"{self.rope_q_heads!r}")
        if (not isinstance(self.attn_split_keys, int) or isinstance(self.attn_split_keys, bool)
                or not 16 <= self.attn_split_keys <= 1024 or self.attn_split_keys & (self.attn_split_keys - 1)):
            raise ConfigError(f"attn_split_keys must be a power of two in [16, 1024], got {self.attn_split_keys!r}")
        if (not isinstance(self.attn_block_keys, int) or isinstance(self.attn_block_keys, bool)
                or (self.attn_block_keys and (not 16 <= self.attn_block_keys <= min(256, self.attn_split_keys)
                                              or self.attn_block_keys & (self.attn_block_keys - 1)))):
            raise ConfigError(f"attn_block_keys must be 0 or a power of two in [16, 256] and at most attn_split_keys "
                              f"({self.attn_split_keys}), got {self.attn_block_keys!r}")
        if (not isinstance(self.gemm_bucket_min, int) or isinstance(self.gemm_bucket_min, bool)
                or self.gemm_bucket_min not in (0, 2, 4, 8, 16)):
            raise ConfigError(f"gemm_bucket_min must be 0, 2, 4, 8 or 16, got {self.gemm_bucket_min!r}")
        if not isinstance(self.verify_l2_mb, int) or isinstance(self.verify_l2_mb, bool) or self.verify_l2_mb < 0:
            raise ConfigError(f"verify_l2_mb must be an integer >= 0 (MiB), got {self.verify_l2_mb!r}")
        if not isinstance(self.verify_one_launch, bool):
            raise ConfigError(f"verify_one_launch must be true or false, got {self.verify_one_launch!r}")
        if not isinstance(self.norm_pdl, bool):
            raise ConfigError(f"norm_pdl must be true or false, got {self.norm_pdl!r}")
        if (not isinstance(self.attn_merge_chunk, int) or isinstance(self.attn_merge_chunk, bool)
                or not 0 <= self.attn_merge_chunk <= 64 or self.attn_merge_chunk & (self.attn_merge_chunk - 1)):
            raise ConfigError(f"attn_merge_chunk must be 0 or a power of two <= 64, got {self.attn_merge_chunk!r}")
        if self.attn_merge_unroll not in (0, 2, 4) or isinstance(self.attn_merge_unroll, bool):
            raise ConfigError(f"attn_merge_unroll must be 0, 2 or 4, got {self.attn_merge_unroll!r}")
        if not isinstance(self.attn_early_pos, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"attn_early_pos must be true or false, got {self.attn_early_pos!r}")
        if self.attn_warps not in (0, 1, 2, 4, 8, 16) or isinstance(self.attn_warps, bool):
            raise ConfigError(f"attn_warps must be 0 (Triton's default) or a power of two <= 16, got "
                              f"{self.attn_warps!r}")
        if self.attn_cluster not in (0, 4, 8, 16) or isinstance(self.attn_cluster, bool):
            raise ConfigError(f"attn_cluster must be 0 (off), 4, 8 or 16 CTAs a cluster, got {self.attn_cluster!r}")
        if not isinstance(self.attn_cluster_even, bool):
            raise ConfigError(f"attn_cluster_even must be true or false, got {self.attn_cluster_even!r}")
        if not isinstance(self.attn_cluster_push, bool):
            raise ConfigError(f"attn_cluster_push must be true or false, got {self.attn_cluster_push!r}")
        if self.attn_stages not in (0, 1, 2, 3, 4) or isinstance(self.attn_stages, bool):
            raise ConfigError(f"attn_stages must be 0 (Triton's default) or 1-4, got {self.attn_stages!r}")
        if not isinstance(self.attn_loads_first, bool):
            raise ConfigError(f"attn_loads_first must be true or false, got {self.attn_loads_first!r}")
        if not isinstance(self.attn_kv_preload, bool):
            raise ConfigError(f"attn_kv_preload must be true or false, got {self.attn_kv_preload!r}")
        if not isinstance(self.attn_single_direct, bool):
            raise ConfigError(f"attn_single_direct must be true or false, got {self.attn_single_direct!r}")
        if not isinstance(self.qkv_trigger_first, bool):
            raise ConfigError(f"qkv_trigger_first must be true or false, got {self.qkv_trigger_first!r}")
        if not isinstance(self.gemv_prefetch, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"gemv_prefetch must be true or false, got {self.gemv_prefetch!r}")
        if not isinstance(self.tuned_tiles, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"tuned_tiles must be true or false, got {self.tuned_tiles!r}")
        if isinstance(self.tuned_table, str) and self.tuned_table and not Path(self.tuned_table).is_file():
            raise ConfigError(f"tuned_table: no file {self.tuned_table!r} (a table as kernels/tuned/*.json, or \"\" "
                              f"for the one shipped for the GPU)")
        if not isinstance(self.qkv_pipeline, bool):
            raise ConfigError(f"qkv_pipeline must be true or false, got {self.qkv_pipeline!r}")
        if not isinstance(self.gemv_pipeline, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"gemv_pipeline must be true or false, got {self.gemv_pipeline!r}")
        if not isinstance(self.early_epilogue, bool):
            raise ConfigError(f"early_epilogue must be true or false, got {self.early_epilogue!r}")
        if not isinstance(self.tile_after_wait, bool):
            raise ConfigError(f"tile_after_wait must be true or false, got {self.tile_after_wait!r}")
        if not isinstance(self.adaptive, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"adaptive must be true or false, got {self.adaptive!r}")
        if not self.adaptive_min_gain > 0:
            raise ConfigError(f"adaptive_min_gain must be > 0, got {self.adaptive_min_gain}")
        if self.adaptive_max_plain < 1:
            raise ConfigError(f"adaptive_max_plain must be >= 1, got {self.adaptive_max_plain}")
        if not isinstance(self.fused_verify, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"fused_verify must be true or false, got {self.fused_verify!r}")
        if not isinstance(self.norm_epilogue, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"norm_epilogue must be true or false, got {self.norm_epilogue!r}")
        if not isinstance(self.verify_rope_in_qkv, bool):
            raise ConfigError(f"verify_rope_in_qkv must be true or false, got {self.verify_rope_in_qkv!r}")
        if not isinstance(self.norm_handoff, bool):
            raise ConfigError(f"norm_handoff must be true or false, got {self.norm_handoff!r}")
        if self.norm_handoff and self.norm_epilogue:
            raise ConfigError("norm_handoff and norm_epilogue both replace a verify block's RMSNorm launches: "
                              "choose one")
        if not isinstance(self.early_draft, bool):
            raise ConfigError(f"early_draft must be true or false, got {self.early_draft!r}")
        if not isinstance(self.rope_in_attention, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"rope_in_attention must be true or false, got {self.rope_in_attention!r}")
        if not isinstance(self.rope_in_qkv, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"rope_in_qkv must be true or false, got {self.rope_in_qkv!r}")
        if self.rope_in_qkv and self.rope_in_attention:
            raise ConfigError("rope_in_qkv (on by default) and rope_in_attention both move a layer's RoPE + K/V write "
                              "(into the qkv GEMV, into the attention): choose one; with rope_in_attention set "
                              "rope_in_qkv false (--no-rope-in-qkv)")
        if not isinstance(self.fused_mlp, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"fused_mlp must be true or false, got {self.fused_mlp!r}")
        if not isinstance(self.megakernel, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"megakernel must be true or false, got {self.megakernel!r}")
        if not isinstance(self.draft_chain_graph, bool):  # as pdl: "false" from a file must not turn it on
            raise ConfigError(f"draft_chain_graph must be true or false, got {self.draft_chain_graph!r}")
        if isinstance(self.prefill_graphs, bool) or not isinstance(self.prefill_graphs, int) or self.prefill_graphs < 0:
            raise ConfigError(f"prefill_graphs is a token count >= 0 (0 = off), got {self.prefill_graphs!r}")
        if isinstance(self.l2_prefetch, bool) or not isinstance(self.l2_prefetch, (int, float)) \
                or not 0.0 <= self.l2_prefetch <= 1.0:
            raise ConfigError(f"l2_prefetch is a fraction of the gate/up weight in [0, 1], got {self.l2_prefetch!r}")

    def with_(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["sampling"] = {f.name: getattr(self.sampling, f.name) for f in fields(self.sampling)}
        out["stop_strings"] = list(self.stop_strings)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config fields: {sorted(unknown)}")
        if isinstance(d.get("sampling"), dict):
            bad = set(d["sampling"]) - {f.name for f in fields(SamplingConfig)}
            if bad:
                raise ConfigError(f"unknown sampling fields: {sorted(bad)}")
            d["sampling"] = SamplingConfig(**d["sampling"])
        if isinstance(d.get("stop_strings"), str):  # one stop string, not its characters
            d["stop_strings"] = (d["stop_strings"],)
        elif isinstance(d.get("stop_strings"), list):
            d["stop_strings"] = tuple(d["stop_strings"])
        return cls(**d)
