"""The engine: a target, an optional drafter and an EngineConfig -> generate().

`Engine` owns the preallocated caches (made once, reused for every prompt) and picks the loop: AR when there is
no drafter, speculative otherwise. It knows nothing of benchmarks or the optimization loop.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch

from specpilot.config import EngineConfig
from specpilot.drafters import Drafter, NgramDrafter, SmallARDrafter
from specpilot.engine.adaptive import AdaptiveSpeculation
from specpilot.engine.ar import generate_ar
from specpilot.engine.result import GenerationResult
from specpilot.engine.runner import ModelRunner
from specpilot.engine.session import Session
from specpilot.engine.spec import generate_spec
from specpilot.engine.stops import StopRule
from specpilot.errors import ConfigError
from specpilot.models import DenseLM, load_model
from specpilot.models.dense import use_norm_kernel
from specpilot.tokenizer import Tokenizer

__all__ = ["Engine", "GenerationResult", "build_drafter", "load_target"]

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _kernel_on(config: EngineConfig, field: str = "attention_kernel") -> bool:
    """Whether a Triton-kernel field (attention, norm, RoPE, activation, add + norm) applies: asked for, on a GPU, and Triton installed."""
    if not (getattr(config, field) and str(config.device).startswith("cuda")):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # on by default, so a GPU without Triton falls back to SDPA rather than failing
        warnings.warn(f"{field} needs Triton, which is not installed: the eager PyTorch path stays",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _pads(config: EngineConfig) -> bool:
    """EngineConfig.pad_shapes applies: asked for and on CUDA (the per-shape planning it avoids is a GPU cost)."""
    return config.pad_shapes and str(config.device).startswith("cuda")


def _head_dim_fits(model: DenseLM, field: str) -> bool:
    """The attention kernels (split-KV attention, RoPE + K/V write) take head dims that are powers of two >= 16; a
    model with another (e.g. 80, 96) keeps SDPA rather than failing on its first step."""
    d = model.config.head_dim
    if d >= 16 and not d & (d - 1):
        return True
    warnings.warn(f"{field}: head_dim {d} is not a power of two >= 16; the eager PyTorch path stays",
                  RuntimeWarning, stacklevel=3)
    return False


def _megakernel(config: EngineConfig, model: DenseLM) -> bool:
    """Whether a runner's one-token steps go through the one-launch step (EngineConfig.megakernel): asked for, on a
    GPU with Triton, over fused projections (it reads the fused qkv / gate+up weights), without compile (one opaque
    launch; torch.compile would trace around it)."""
    if not _kernel_on(config, "megakernel"):
        return False
    if not (config.fused_projections and hasattr(model.model.layers[0].self_attn, "qkv_proj")) or config.compile:
        warnings.warn("megakernel needs fused_projections and no compile: one-token steps keep their path",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def _apply_layout(model: DenseLM, config: EngineConfig) -> None:
    """Run-time layout choices that keep the numbers: fused projections, the Triton GEMV and attention kernels."""
    if config.fused_projections:
        model.fuse_projections()
    if config.gemv_kernel:
        model.use_gemv_kernel()
    if _kernel_on(config) and _head_dim_fits(model, "attention_kernel"):
        model.use_attention_kernel()
    if _kernel_on(config, "norm_kernel"):
        model.use_norm_kernel()
    if _kernel_on(config, "rope_kernel"):
        model.use_rope_kernel()
    if _kernel_on(config, "act_kernel"):
        model.use_act_kernel()
    if _kernel_on(config, "add_norm_kernel"):
        model.use_add_norm_kernel()
    # fused decode reads the fused qkv / gate+up weights: with fused_projections off (a loop trial of that layout)
    # it stays off too
    if config.fused_projections and _kernel_on(config, "fused_decode") and _head_dim_fits(model, "fused_decode"):
        model.use_fused_decode()
    if _kernel_on(config, "fused_verify"):  # fused decode's layer at T rows: with it or not at all
        if model.fused_decode:
            model.use_fused_verify()
        else:
            warnings.warn("fused_verify needs fused_decode (and the fused_projections it reads): verify steps keep "
                          "the regular path", RuntimeWarning, stacklevel=2)
    if _kernel_on(config, "norm_epilogue"):  # the fused layer's GEMVs: with it or not at all
        if model.fused_decode or model.fused_verify:
            model.use_norm_epilogue()
        else:
            warnings.warn("norm_epilogue needs fused_decode (and the fused_projections it reads): the norms keep "
                          "their own launches", RuntimeWarning, stacklevel=2)
    if _kernel_on(config, "norm_handoff"):  # a fused verify block's GEMVs: with it or not at all
        if model.fused_verify and not model.norm_epilogue:
            model.use_norm_handoff()
        else:
            warnings.warn("norm_handoff needs fused_verify, without norm_epilogue: a verify block's norms keep "
                          "their own launches", RuntimeWarning, stacklevel=2)
    if _kernel_on(config, "verify_rope_in_qkv"):  # a fused verify block's qkv GEMM: with RoPE + K/V write or not
        if model.fused_verify:
            model.use_verify_rope_in_qkv()
        else:
            warnings.warn("verify_rope_in_qkv needs fused_verify: a verify block's RoPE and K/V write keep their own "
                          "launch", RuntimeWarning, stacklevel=2)
    if _kernel_on(config, "rope_in_attention"):  # the fused one-token layer's attention launch: with it or not
        if model.fused_decode:
            model.use_rope_in_attention()
        else:
            warnings.warn("rope_in_attention needs fused_decode (and the fused_projections it reads): RoPE and the "
                          "K/V write keep their own launch", RuntimeWarning, stacklevel=2)
    if _kernel_on(config, "rope_in_qkv"):  # the fused one-token layer's qkv GEMV: with RoPE + K/V write or not
        if not model.fused_decode:
            warnings.warn("rope_in_qkv needs fused_decode (and the fused_projections it reads): RoPE and the K/V "
                          "write keep their own launch", RuntimeWarning, stacklevel=2)
        else:
            model.use_rope_in_qkv()
    if _kernel_on(config, "l2_prefetch"):  # the fused layer's gate/up weight warmed in L2: with it or not at all
        if model.fused_decode or model.fused_verify:
            model.use_l2_prefetch(config.l2_prefetch)
        else:
            warnings.warn("l2_prefetch needs fused_decode or fused_verify (and the fused_projections they read): "
                          "no weight is warmed", RuntimeWarning, stacklevel=2)
    if model.fused_decode and _kernel_on(config, "lossless12"):
        if model.lm_head.weight.dtype == torch.bfloat16:
            model.use_lossless12()
        else:
            warnings.warn(f"lossless12 needs bf16 weights (dtype {config.dtype}): the 16-bit weights stay",
                          RuntimeWarning, stacklevel=2)
    if _kernel_on(config, "fused_mlp"):  # after lossless12 and the norm epilogue: it goes with neither
        if model.fused_decode and model.rope_in_qkv and not model.norm_epilogue and not config.compile \
                and getattr(model.lm_head, "packed12", None) is None:
            model.use_fused_mlp()
        else:
            warnings.warn("fused_mlp needs fused_decode and rope_in_qkv, without norm_epilogue, lossless12 or "
                          "compile: the MLP keeps its two launches", RuntimeWarning, stacklevel=2)
    _apply_pdl(config)
    _apply_gemv_prefetch(config)
    _apply_program_splits(config)


def _fused_switch_wanted(config: EngineConfig, field: str, what: str, quiet: bool = False) -> bool:
    """Whether a process-wide switch of the fused one-token path (pdl, gemv_prefetch) is asked for on CUDA with
    that path laid out; without fused_decode it has nothing to act on (`what`: why, for the warning; `quiet`: a
    switch on by default, pdl, stays off without one)."""
    want = getattr(config, field) and str(config.device).startswith("cuda")
    if want and not (config.fused_projections and config.fused_decode):
        if quiet:
            return False
        warnings.warn(f"{field} needs fused_decode (and the fused_projections it reads): {what}, so {field} stays "
                      "off", RuntimeWarning, stacklevel=4)
        return False
    return bool(want)


def _apply_pdl(config: EngineConfig) -> None:
    """EngineConfig.pdl -> the process-wide PDL switch (kernels/pdl.py), set whenever a model is laid out for a
    config, so it follows the newest config (CUDA graphs keep how their kernels were launched at capture); with it
    norm_pdl -> kernels/rmsnorm.py's PDL. PDL only changes how the fused one-token path's kernels launch: without
    fused_decode it has nothing to act on.
    Like the other CUDA switches it is ignored on other devices; on a GPU before Hopper (or without fused_decode)
    it stays off without a word: it is on by default, and the kernels are the same without it."""
    from specpilot.kernels import decode_attention, gemv_fused, pdl, qkv_rope

    want = _fused_switch_wanted(config, "pdl", "only the fused one-token path launches with PDL", quiet=True)
    pdl.set_enabled(want and _kernel_on(config, "pdl"), config.device if want else None, config.pdl_trigger,
                    warn=False)  # on by default: where PDL cannot run (before Hopper) it stays off quietly
    if gemv_fused.triton is not None:  # the L2 warming before the wait (EngineConfig.pdl_l2_mb): PDL launches only
        gemv_fused.PDL_L2_MAX_BYTES = config.pdl_l2_mb << 20 if pdl.enabled() else 0
        gemv_fused.PDL_L2_PART = round(config.pdl_l2_share * 64)  # the share of each weight it warms
        gemv_fused.PDL_L2_NEXT_BYTES = config.pdl_l2_next_mb << 20 if pdl.enabled() else 0  # gate/up's head, by o_proj
        decode_attention.PDL_KV_L2 = config.pdl_kv_l2 and pdl.enabled()  # the attention's K/V hint, as above
        decode_attention.PDL_EARLY_POS = config.attn_early_pos and pdl.enabled()  # its positions before the wait
        decode_attention.KV_PRELOAD = config.attn_kv_preload and pdl.enabled()  # its older K/V rows, too
        qkv_rope.TRIGGER_FIRST = config.qkv_trigger_first and pdl.enabled()  # the attention resident during qkv
    from specpilot.kernels import rmsnorm

    rmsnorm.PDL = config.norm_pdl and pdl.enabled()  # the RMSNorm launches with PDL too (a verify block's norms)


def _apply_gemv_prefetch(config: EngineConfig) -> None:
    """EngineConfig.gemv_prefetch, gemv_pipeline, early_epilogue and tile_after_wait -> the one-row GEMV's
    process-wide switches (kernels/gemv_fused.py ONE_ROW_PREFETCH, ONE_ROW_PIPE, EARLY_EPILOGUE,
    FIRST_TILE_AFTER_WAIT; the last two also kernels/qkv_rope.py's), and qkv_pipeline -> kernels/qkv_rope.py's PIPE,
    set whenever a model is laid out, as _apply_pdl."""
    from specpilot.kernels import gemv_fused, qkv_rope

    what = "the one-row GEMVs it changes are the fused one-token path's"
    want = _fused_switch_wanted(config, "gemv_prefetch", what)
    pipe = _fused_switch_wanted(config, "gemv_pipeline", what)
    qkv_pipe = _fused_switch_wanted(config, "qkv_pipeline", "the qkv + RoPE launch it changes is the fused one-token "
                                    "path's")
    early = _fused_switch_wanted(config, "early_epilogue", what)
    tile = _fused_switch_wanted(config, "tile_after_wait", what)
    if gemv_fused.triton is not None:
        gemv_fused.ONE_ROW_PREFETCH = want and _kernel_on(config, "gemv_prefetch")
        gemv_fused.ONE_ROW_PIPE = pipe and _kernel_on(config, "gemv_pipeline")
        qkv_rope.PIPE = qkv_pipe and _kernel_on(config, "qkv_pipeline")  # qkv + RoPE's two blocks in flight
        gemv_fused.EARLY_EPILOGUE = qkv_rope.EARLY_EPILOGUE = early and _kernel_on(config, "early_epilogue")
        gemv_fused.FIRST_TILE_AFTER_WAIT = qkv_rope.FIRST_TILE_AFTER_WAIT = (tile
                                                                             and _kernel_on(config, "tile_after_wait"))


def _apply_program_splits(config: EngineConfig) -> None:
    """EngineConfig.rope_q_heads -> kernels/rope_write.py's process-wide Q_HEADS_PER_PROGRAM, attn_split_keys and
    attn_block_keys -> kernels/decode_attention.py's ONE_LAUNCH_SPLIT, attn_merge_chunk -> its MERGE_CHUNK,
    attn_merge_unroll -> its MERGE_UNROLL, attn_warps -> its ONE_LAUNCH_WARPS, attn_stages -> its
    ONE_LAUNCH_STAGES, attn_single_direct -> its SINGLE_DIRECT, attn_cluster / attn_cluster_even / attn_cluster_push
    -> kernels/cluster_attention.py's CLUSTER / EVEN / PUSH, verify_l2_mb -> decode_attention's
    VERIFY_WARM_MAX_BYTES, verify_one_launch -> its VERIFY_ONE_LAUNCH and tuned_tiles / tuned_table ->
    kernels/tuned.py's PINNED / TABLE, set whenever a model is laid out, as _apply_pdl; off CUDA the layouts the CPU
    tests pin (one program for all q heads; 128 keys a program, 64 an inner step; the merge a slice at a time; no
    warming; no pinned tiles; a verify block's attention in two launches)."""
    from specpilot.kernels import decode_attention, rope_write

    cuda = str(config.device).startswith("cuda")
    rope_write.Q_HEADS_PER_PROGRAM = config.rope_q_heads if cuda else 0
    keys = config.attn_split_keys if cuda else 128
    block = (config.attn_block_keys or 128) if cuda else 64  # keys an inner step (0: 128, the slice's default)
    decode_attention.ONE_LAUNCH_SPLIT = (keys, min(keys, block))
    decode_attention.MERGE_CHUNK = config.attn_merge_chunk if cuda else 0
    decode_attention.MERGE_UNROLL = config.attn_merge_unroll if cuda else 0
    decode_attention.ONE_LAUNCH_WARPS = config.attn_warps if cuda else 0
    decode_attention.ONE_LAUNCH_STAGES = config.attn_stages if cuda else 0  # its slice loop's pipeline stages
    decode_attention.SINGLE_DIRECT = config.attn_single_direct and cuda  # one slice: no merge
    decode_attention.LOADS_FIRST = config.attn_loads_first and cuda  # V with K, the merge's first slices early
    from specpilot.kernels import cluster_attention

    cluster_attention.CLUSTER = config.attn_cluster if cuda else 0  # the slices' merge inside a CTA cluster
    cluster_attention.EVEN = config.attn_cluster_even and cuda  # one cluster, the keys dealt out evenly
    cluster_attention.PUSH = config.attn_cluster_push and cuda  # partials pushed to the CTA that merges them
    decode_attention.VERIFY_ONE_LAUNCH = config.verify_one_launch and cuda  # a verify block's attention: one launch
    decode_attention.VERIFY_WARM_MAX_BYTES = config.verify_l2_mb << 20 if cuda else 0  # a verify block's o_proj
    from specpilot.kernels import gemm_rows, tuned

    gemm_rows.M_BUCKET_MIN = config.gemm_bucket_min if cuda else 0  # the M-row GEMM's tuned tiling
    table = config.tuned_table if config.tuned_tiles and cuda else ""
    if table and torch.cuda.is_available():
        try:
            tuned.check_table(table, config.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    tuned.set_pinned(config.tuned_tiles and cuda, table)  # the shipped table's tiles, or tuned_table's


def kernel_switches() -> dict:
    """The process-wide kernel switches as they are now: (module, name) -> value for the kernel modules' upper-case
    settings and PDL's state, the ones _apply_pdl, _apply_gemv_prefetch and _apply_program_splits set (a snapshot
    for `restore_kernel_switches`, or to tell two configurations' switches apart)."""
    from specpilot.kernels import (cluster_attention, decode_attention, gemm_rows, gemv_fused, pdl, qkv_rope, rmsnorm,
                                   rope_write, tuned)

    return {(m, k): v for m in (decode_attention, cluster_attention, gemv_fused, gemm_rows, qkv_rope, rmsnorm,
                                rope_write, tuned, pdl)
            for k, v in vars(m).items() if k.isupper() or k in ("_enabled", "_late")}


def restore_kernel_switches(saved: dict) -> None:
    """Every switch of a `kernel_switches` snapshot back to its value there."""
    from specpilot.kernels import tuned

    tuned.set_pinned(saved[tuned, "PINNED"], saved.get((tuned, "TABLE"), ""))  # through the setter: a change
    # drops the autotuners' per-process picks
    for (module, name), value in saved.items():
        setattr(module, name, value)


@contextlib.contextmanager
def config_switches(config: EngineConfig) -> Iterator[None]:
    """The process-wide kernel switches that laying a model out for `config` sets (_apply_pdl, _apply_gemv_prefetch,
    _apply_program_splits), set for the block and restored after. Why: `Engine(model, config)` takes a model laid
    out already and sets none of them, so two engines on one model that differ only in such a field run the same
    kernels; a check comparing them must set them (session 41: scripts/gpu_engine_check.py's shared helper did not,
    and six of its sections compared a configuration with itself)."""
    saved = kernel_switches()
    try:
        _apply_pdl(config)
        _apply_gemv_prefetch(config)
        _apply_program_splits(config)
        yield
    finally:
        restore_kernel_switches(saved)


def load_target(name_or_path: str, config: EngineConfig) -> tuple[DenseLM, Tokenizer]:
    from specpilot.hub import resolve_model

    path = resolve_model(name_or_path)
    model = load_model(path, dtype=DTYPE[config.dtype], device=config.device)
    _apply_layout(model, config)
    return model, Tokenizer.from_folder(path)


def build_drafter(config: EngineConfig, drafter_model: str | DenseLM | None, target: DenseLM) -> Drafter | None:
    drafter = _build_drafter(config, drafter_model, target)
    if config.ngram_assist and config.drafter_kind in ("dflash", "model"):  # prompt lookup beside the model
        from specpilot.drafters.ngram_assist import NgramAssistedDrafter

        lookup = NgramDrafter(config.ngram_max, config.ngram_min, device=config.device)
        long = config.ngram_assist_tokens
        drafter = NgramAssistedDrafter(drafter, lookup, config.ngram_assist, config.num_draft_tokens if long else 0,
                                       long)
    return drafter


def _build_drafter(config: EngineConfig, drafter_model, target: DenseLM) -> Drafter | None:
    if config.drafter_kind == "none":
        return None
    if config.drafter_kind == "ngram":
        return NgramDrafter(config.ngram_max, config.ngram_min, device=config.device)
    if config.drafter_kind == "dflash":
        from specpilot.drafters.dflash import DFlashBlockDrafter
        from specpilot.hub import resolve_model
        from specpilot.models.dflash_io import load_dflash

        if drafter_model is None:
            raise ConfigError("drafter 'dflash' needs a DFlash checkpoint (--drafter PATH)")
        network = drafter_model if not isinstance(drafter_model, (str, bytes)) else load_dflash(
            resolve_model(drafter_model), dtype=DTYPE[config.dtype], device=config.device)
        # before the draft step is captured as a graph; a given network too (only its cached passes change).
        # Fused projections follow the target's (same numbers, 4 GEMMs fewer a layer; a run-time layout)
        network.fuse_projections(config.fused_projections)
        network.use_attention_kernel(_kernel_on(config, "draft_attention_kernel"))
        use_norm_kernel(network, _kernel_on(config, "norm_kernel"))  # the drafter's RMSNorms follow the target's
        network.use_rope_kernel(_kernel_on(config, "rope_kernel"))  # its RoPE and MLP activation likewise
        network.use_act_kernel(_kernel_on(config, "act_kernel"))
        drafter = DFlashBlockDrafter(network, target, config.max_seq_len, cuda_graphs=config.cuda_graphs)
        drafter.pad_shapes = _pads(config)
        return drafter
    if drafter_model is None:
        raise ConfigError("drafter 'model' needs a drafter model (--drafter NAME|PATH)")
    if isinstance(drafter_model, str):
        from specpilot.hub import resolve_model

        drafter_model = load_model(resolve_model(drafter_model), dtype=DTYPE[config.dtype], device=config.device)
        _apply_layout(drafter_model, config)
    if abs(drafter_model.config.vocab_size - target.config.vocab_size) > 1024:  # padding may differ a little
        raise ConfigError("the drafter model must share the target's tokenizer (vocabulary sizes differ)")
    gen = torch.Generator(device=config.device).manual_seed(config.sampling.seed + 1)
    # catch-up feeds: 1 token after a rejection, 2 after a full accept, up to a block + 1 when prompt lookup's
    # drafts were verified instead of the model's (up to its long block with ngram_assist_tokens)
    long = config.ngram_assist_tokens if config.ngram_assist else 0
    buckets = tuple(sorted({1, 2, config.num_draft_tokens + 1, long + 1}))
    runner = ModelRunner(drafter_model, drafter_model.new_cache(1, config.max_seq_len), buckets=buckets,
                         cuda_graphs=config.cuda_graphs, compile=config.compile, pad_shapes=_pads(config),
                         prefill_graphs=config.prefill_graphs, megakernel=_megakernel(config, drafter_model))
    chain = config.num_draft_tokens - 1 if config.draft_chain_graph and config.cuda_graphs else 0
    return SmallARDrafter(runner, config.sampling, gen, chain=chain)


class Engine:
    def __init__(self, target: DenseLM, config: EngineConfig, drafter: Drafter | None = None, tokenizer=None):
        self.target, self.config, self.drafter, self.tokenizer = target, config, drafter, tokenizer
        # a drafter may draft longer blocks on some steps (drafters/ngram_assist.py): a verify bucket for those too
        k_max = getattr(drafter, "max_draft_tokens", None) or config.num_draft_tokens
        buckets = (1,) if drafter is None else tuple(sorted({1, config.num_draft_tokens + 1, k_max + 1}))
        self.runner = ModelRunner(target, target.new_cache(1, config.max_seq_len), buckets=buckets,
                                  cuda_graphs=config.cuda_graphs, compile=config.compile,
                                  capture_layers=getattr(drafter, "target_layers", None),
                                  feature_fn=getattr(drafter, "features", None),
                                  greedy_verdict=drafter is not None and config.sampling.greedy and config.fused_accept,
                                  pad_shapes=_pads(config), prefill_graphs=config.prefill_graphs,
                                  megakernel=_megakernel(config, target))
        eos = () if config.ignore_eos else tuple(target.config.eos_token_ids)
        if not eos and tokenizer is not None and tokenizer.eos_token_id is not None and not config.ignore_eos:
            eos = (tokenizer.eos_token_id,)
        decode = tokenizer.decode if tokenizer is not None else None
        self.stop = StopRule(eos, config.max_new_tokens, config.stop_strings, decode)
        # one policy for the engine's life: the step costs it measures hold for every prompt (engine/adaptive.py)
        self.policy = AdaptiveSpeculation(config.adaptive_min_gain, config.adaptive_max_plain) if (
            drafter is not None and config.adaptive) else None

    def generate(self, prompt_ids: list[int], on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        session = Session(self.runner, self.config, self.stop, on_tokens)
        if self.drafter is None:
            return generate_ar(session, prompt_ids)
        return generate_spec(session, self.drafter, prompt_ids, self.policy)
