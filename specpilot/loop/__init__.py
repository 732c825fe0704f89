"""The optimization loop (v1): `specpilot optimize` searches EngineConfig for one deployment, gating every trial.

  registry  Mechanism / Deployment / REGISTRY: what may change (one entry per mechanism)
  memory    SQLite store of runs, trials and what worked where (resume, transfer)
  explore   Measurement, GpuLease, explorers, time_engine
  gate      forcing on dev + held-out, noise, held-out repeat, cost-model ceiling
  rounds    optimize(deployment, budget, memory, measure, profile_fn, dev=..., gate=...)
  agent     AgentExplorer: a coding-agent command in a git worktree, diffs to the judge rejected
  report    markdown + plots + best_config.yaml
This module adds the real measure (`EngineMeasure`), the cost-model hooks and the CLI entry points
(`add_optimize_parser`, `cmd_optimize`). Dependency rule: the loop imports engine / evaluator / costmodel; none of
them imports the loop.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, NamedTuple

from specpilot.config import EngineConfig, load_config_file
from specpilot.errors import ConfigError
from specpilot.loop.explore import GpuLease, Measurement, time_engine
from specpilot.loop.memory import Memory
from specpilot.loop.registry import REGISTRY, Deployment, Mechanism, register

_LAZY = {"Gate": "specpilot.loop.gate", "Budget": "specpilot.loop.rounds", "RunResult": "specpilot.loop.rounds",
         "optimize": "specpilot.loop.rounds"}


def __getattr__(name: str):
    """The gate and the rounds import torch (through forcing): loaded on first use, so `specpilot --help` and
    `add_optimize_parser` stay light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specpilot.loop' has no attribute {name!r}")

__all__ = ["REGISTRY", "Budget", "Deployment", "EngineMeasure", "Gate", "GpuLease", "Measurement", "Mechanism",
           "Memory", "RunResult", "add_optimize_parser", "cmd_optimize", "cost_model_hooks", "optimize", "register"]


class EngineMeasure:
    """measure(config, prompts, repeats) on real engines.

    `load_target(config)` builds the target for a config's layout (dtype, device, fused projections, GEMV kernel:
    choices applied to the weights at load time, one way); the last one is kept and reloaded only when the layout
    changes. The drafter is given as a name/path and built per config by `build_drafter` (which loads a small AR
    model with the config's layout, or a DFlash checkpoint); loading stays outside the timed region.
    """

    LAYOUT = ("dtype", "device", "fused_projections", "gemv_kernel", "attention_kernel", "norm_kernel",
              "rope_kernel", "act_kernel", "add_norm_kernel", "fused_decode", "fused_verify", "lossless12", "pdl",
              "pdl_trigger", "pdl_l2_mb", "pdl_l2_share", "pdl_l2_next_mb", "pdl_kv_l2", "rope_q_heads",
              "attn_split_keys", "attn_merge_chunk", "attn_early_pos", "attn_warps", "attn_kv_preload", "verify_l2_mb",
              "gemm_bucket_min", "norm_epilogue", "rope_in_attention", "rope_in_qkv", "l2_prefetch", "gemv_prefetch",
              "gemv_pipeline", "early_epilogue", "tile_after_wait", "tuned_tiles", "tuned_table",
              "qkv_trigger_first", "attn_single_direct", "attn_merge_unroll", "attn_block_keys", "attn_loads_first",
              "attn_cluster", "attn_cluster_even", "attn_cluster_push", "qkv_pipeline", "attn_stages",
              "fused_mlp", "verify_one_launch", "norm_pdl", "norm_handoff", "verify_rope_in_qkv")
    # (pdl, pdl_trigger, pdl_l2_mb, pdl_l2_share, pdl_l2_next_mb, pdl_kv_l2, rope_q_heads, attn_split_keys,
    # attn_merge_chunk, attn_early_pos, attn_warps, attn_kv_preload, verify_l2_mb, gemm_bucket_min,
    # gemv_prefetch, gemv_pipeline, early_epilogue, tile_after_wait, tuned_tiles, tuned_table, qkv_trigger_first,
    # attn_single_direct, attn_merge_unroll, attn_block_keys, attn_loads_first, the attn_cluster fields,
    # qkv_pipeline, attn_stages, verify_one_launch and norm_pdl change no weights, but their process-wide switches
    # are set when a model is laid out: engine._apply_pdl / _apply_gemv_prefetch / _apply_program_splits)

    def __init__(self, load_target, drafter: str | None = None, tokenizer=None, loaded=None):
        self.load_target, self.drafter, self.tokenizer = load_target, drafter, tokenizer
        self._key, self._target = (self._layout(loaded[0]), loaded[1]) if loaded else (None, None)

    def _layout(self, config: EngineConfig) -> tuple:
        return tuple(getattr(config, f, None) for f in self.LAYOUT)

    def target(self, config: EngineConfig):
        if self._layout(config) != self._key:
            self._target = None  # free the old copy first
            self._target, self._key = self.load_target(config), self._layout(config)
        return self._target

    def __call__(self, config: EngineConfig, prompts: list[list[int]], repeats: int) -> Measurement:
        import torch

        from specpilot.engine import Engine, build_drafter

        target = self.target(config)
        needs_model = config.drafter_kind in ("model", "dflash")
        drafter = build_drafter(config, self.drafter if needs_model else None, target)
        engine = Engine(target, config, drafter, self.tokenizer)
        sync = torch.cuda.synchronize if config.device.startswith("cuda") else None
        r = time_engine(engine.generate, prompts, repeats, sync)
        return Measurement(r["samples"], [list(p) for p in prompts], r["outputs"], r["tau"], r["stage_s"],
                           r["context_len"], acceptance=r["acceptance"])


def _step_profile(cfg: EngineConfig, stage_s: dict, tau: float, context_len: int, acceptance=None):
    from specpilot.costmodel import StepProfile
    from specpilot.costmodel.gaps import engine_fields
    from specpilot.costmodel.whatif import catch_up_tokens

    if not stage_s or sum(stage_s.values()) <= 0:
        return None
    k, model = cfg.num_draft_tokens, cfg.drafter_kind == "model"
    return StepProfile(draft_s=stage_s.get("draft", 0.0), verify_s=stage_s.get("verify", 0.0),
                       accept_s=stage_s.get("accept", 0.0), other_s=stage_s.get("commit", 0.0), tau=max(tau, 1e-6),
                       num_draft_tokens=k, drafter_passes=k if model else int(cfg.drafter_kind == "dflash"),
                       context_len=context_len,
                       drafter_pass_tokens=((catch_up_tokens(tau, k),) + (1,) * (k - 1)) if model else None,
                       **engine_fields(cfg),
                       acceptance_by_position=tuple(acceptance) if acceptance else None)


def _knobs(cfg: EngineConfig):
    from specpilot.costmodel.gaps import early_draft_applies
    from specpilot.costmodel.shapes import kernel_flags, l2_fields
    from specpilot.costmodel.whatif import StepKnobs

    sdpa_pool = cfg.cuda_graphs and not cfg.attention_kernel  # graphed SDPA reads the whole pool
    return StepKnobs(cfg.num_draft_tokens if cfg.drafter_kind != "none" else 0, cfg.cuda_graphs, cfg.compile,
                     cfg.fused_projections, cfg.attention_kernel, cfg.max_seq_len if sdpa_pool else None,
                     cfg.draft_attention_kernel, cfg.max_seq_len if cfg.cuda_graphs else None,
                     **kernel_flags(cfg), **l2_fields(cfg), early_draft=cfg.early_draft and early_draft_applies(cfg))


class CostHooks(NamedTuple):
    """What the loop asks the cost model (see `cost_model_hooks`)."""

    profile: Callable  # (config, dev stats) -> CostReport | [GapRow] | None: the round's diagnosis
    ceiling: Callable | None  # (config, Measurement) -> tokens/s ceiling, or None: no ceiling check
    estimate: Callable | None  # (config, dev stats, candidate config) -> predicted gain or None: trial order
    note: str


def _ngram_replay(cfg: EngineConfig, stats: dict, new_cfg: EngineConfig, prompts) -> dict | None:
    """The n-gram drafter of `new_cfg` replayed on the dev outputs of `cfg` (greedy: any passing config has them)."""
    from specpilot.drafters.ngram import NgramDrafter, replay

    outputs = stats.get("outputs")
    if not cfg.sampling.greedy or not prompts or not outputs or len(outputs) != len(prompts):
        return None
    return replay(NgramDrafter(new_cfg.ngram_max, new_cfg.ngram_min), prompts, outputs, new_cfg.num_draft_tokens)


def cost_model_hooks(target_cfg, drafter_cfg, device: str, dev_prompts=None) -> CostHooks:
    """The loop's cost-model hooks from the target's config and the drafter's (a ModelConfig for a small AR
    drafter, a DFlashConfig for DFlash; None: no model drafter).
    On CUDA: the cost model's gap table, tokens/s ceiling (tau / step floor) and predicted gains of candidate
    configs (costmodel/whatif.py; n-gram settings and switches to n-grams get their tau replayed on the dev
    outputs, `dev_prompts`). Elsewhere: the measured stage times with floor 0 (a ranking by time, not by gap), no
    ceiling and no predictions."""
    from specpilot.costmodel import GapRow, analyze, load_or_measure
    from specpilot.costmodel.whatif import predicted_gain

    try:
        hw = load_or_measure(device)
    except ConfigError as e:  # CudaUnavailableError: CPU or no CUDA
        def stage_times(cfg, stats):
            st = stats.get("stage_s") or {}
            rows = [("draft", st.get("draft")), ("verify", st.get("verify")), ("accept", st.get("accept")),
                    ("other", st.get("commit"))]
            total = sum(v or 0.0 for _, v in rows)
            if total <= 0:
                return None
            return [GapRow(s, v or 0.0, 0.0, v or 0.0, (v or 0.0) / total) for s, v in rows]
        return CostHooks(stage_times, None, None, f"no cost-model ceilings ({e}); diagnosis ranks measured stage "
                                                  f"times")

    def report(cfg, stage_s, tau, context_len):
        if cfg.drafter_kind in ("model", "dflash") and drafter_cfg is None:
            return None  # the drafter's shapes are unknown
        prof = _step_profile(cfg, stage_s, tau, context_len)
        keep = cfg.drafter_kind in ("model", "dflash")
        return None if prof is None else analyze(target_cfg, drafter_cfg if keep else None, prof, hw,
                                                 drafter_kind=cfg.drafter_kind, graphed=cfg.cuda_graphs)

    def profile_fn(cfg, stats):
        return report(cfg, stats.get("stage_s"), stats.get("tau", 1.0), stats.get("context_len", 0))

    def ceiling_fn(cfg, m: Measurement):
        rep = report(cfg, {"verify": 1.0}, m.tau, m.context_len)  # the floor depends on shapes and tau only
        return None if rep is None or rep.step_floor_s <= 0 else m.tau / rep.step_floor_s

    def estimate_fn(cfg, stats, new_cfg):
        kind, new_kind = cfg.drafter_kind, new_cfg.drafter_kind
        if "none" in (kind, new_kind) or new_cfg.ngram_assist != cfg.ngram_assist:
            return None  # (prompt lookup beside a model: the pair's tau is not predictable from either alone)
        ngram = None
        if new_kind == "ngram" and (kind != "ngram" or (new_cfg.ngram_max, new_cfg.ngram_min, new_cfg.num_draft_tokens)
                                    != (cfg.ngram_max, cfg.ngram_min, cfg.num_draft_tokens)):
            ngram = _ngram_replay(cfg, stats, new_cfg, dev_prompts)
            if ngram is None:
                return None
        elif new_kind != kind:
            return None  # another model drafter's tau is not predictable from this one's
        prof = _step_profile(cfg, stats.get("stage_s"), stats.get("tau", 1.0), stats.get("context_len", 0),
                             stats.get("acceptance"))
        if prof is None:
            return None
        # the replayed lookup time replaces the draft stage only on a switch of drafter (predicted_gain)
        return predicted_gain(target_cfg, drafter_cfg, prof, hw, kind=kind, now=_knobs(cfg), new=_knobs(new_cfg),
                              new_kind=new_kind, new_tau=ngram and ngram["tau"],
                              new_draft_host_s=ngram["propose_s"] if ngram else 0.0)

    return CostHooks(profile_fn, ceiling_fn, estimate_fn, f"cost model on {hw.name}")


def _yardsticks(s: dict, cfg, measure, dev, eos_ids, hf_target=None) -> dict:
    """name -> () -> {"tokens_per_s", "label"}: our AR through the loop's own measure (same harness, same repeats),
    and the stock speculative system for this drafter (its released code, one repeat: it is slow and only a
    reference)."""
    from specpilot.engine import DTYPE

    def ar():
        m = measure(cfg.with_(drafter_kind="none"), dev, s["repeats"])
        return {"tokens_per_s": statistics.median(m.samples), "label": "our AR", "samples": m.samples}

    def stock():
        import torch

        from specpilot.evaluator.stock import stock_system

        gen, label = stock_system(s["target"], s["drafter"], cfg.drafter_kind, cfg.num_draft_tokens,
                                  dtype=DTYPE[cfg.dtype], device=cfg.device, max_new_tokens=cfg.max_new_tokens,
                                  eos_ids=eos_ids, model=hf_target)
        sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else None
        r = time_engine(gen, dev, 1, sync)
        del gen  # its models (an assistant, a draft network) are not needed again
        gc.collect()
        return {"tokens_per_s": statistics.median(r["samples"]), "label": f"stock ({label})"}

    known = {"ar": ar, "stock": stock}
    names = [n for n in str(s.get("yardsticks") or "").split(",") if n]
    unknown = set(names) - set(known)
    if unknown:
        raise ConfigError(f"unknown yardsticks {sorted(unknown)}; choose from ar, stock")
    return {n: known[n] for n in names}


# --- CLI ------------------------------------------------------------------------------------------------------

DEFAULTS = dict(target=None, drafter=None, drafter_kind="model", device="cpu", dtype="float32", max_new_tokens=None,
                config=None, dev_benchmarks="humaneval", heldout_benchmark="mbpp", dev_prompts_file=None,
                heldout_prompts_file=None, field="prompt", num_prompts=3, heldout_num_prompts=None, dataset_dir=None,
                rounds=3, trials=40, wall_s=3600.0, directions=3, per_direction=3, repeats=3, workers=2, memory=None, resume=None,
                agent_command=None, agent_repo=None, ray=False, tolerance=None, stock="transformers",
                yardsticks="ar,stock", out="results/optimize")


def add_optimize_parser(subparsers):
    p = subparsers.add_parser("optimize", help="search engine configs for a deployment; every trial token-forced")
    a = p.add_argument
    a("--deployment", help="YAML file holding any of the options below (underscored names; flags override it)")
    a("--target", help="target model (default: the embedded default deployment's)")
    a("--drafter", help="drafter model (enables drafter_kind 'model')")
    a("--drafter-kind", choices=("model", "ngram", "dflash"))
    a("--device"), a("--dtype", choices=("float32", "bfloat16", "float16"))
    a("--max-new-tokens", type=int, help="(default 64 on CPU, 256 elsewhere)")
    a("--config", help="YAML/JSON of EngineConfig fields: the starting config")
    a("--dev-benchmarks", help="comma list (default humaneval); explorers only ever see these prompts")
    a("--heldout-benchmark", help="(default mbpp) must differ from the dev benchmarks")
    a("--dev-prompts-file"), a("--heldout-prompts-file"), a("--field", help="prompt field of prompt files")
    a("--num-prompts", type=int), a("--heldout-num-prompts", type=int), a("--dataset-dir")
    a("--rounds", type=int), a("--trials", type=int), a("--wall-s", type=float)
    a("--directions", type=int, help="mechanism explorers per round"), a("--workers", type=int)
    a("--per-direction", type=int, help="candidate values each direction tries per round, best predicted first "
                                        "(0: all)")
    a("--repeats", type=int, help="timed repeats per measurement (>= 2: the noise estimate)")
    a("--memory", help="SQLite memory (default: <cache>/loop/memory.sqlite)")
    a("--resume", type=int, metavar="RUN", help="resume a killed run: finished trials are not re-run")
    a("--agent-command", help="coding-agent command template, e.g. 'my-agent -p {brief_file}'")
    a("--agent-repo", help="git repo the agent's worktrees come from (default: the one holding this package)")
    a("--ray", action="store_true", default=None, help="run explorer proposals as Ray tasks (needs ray)")
    a("--tolerance", type=float), a("--stock", choices=("transformers", "specpilot"))
    a("--yardsticks", help="systems timed once next to round 0 that every round is stated against: a comma list "
      "of ar (our AR), stock (the released speculative system for this drafter); '' for none (default ar,stock)")
    a("--out", help="report folder (default results/optimize)")
    return p


def _settings(args) -> dict:
    """DEFAULTS, then on a CPU the short run of deployments.OPTIMIZE_CPU (what the README's main job runs),
    then the deployment file, then flags."""
    from specpilot import deployments as dep

    s = dict(DEFAULTS)
    given: dict = {}
    if getattr(args, "deployment", None):
        loaded = load_config_file(args.deployment, "deployment file")
        unknown = set(loaded) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"unknown deployment keys: {sorted(unknown)}")
        given.update(loaded)
    given.update({k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None})
    if given.get("device", s["device"]) == "cpu":
        s.update(dep.OPTIMIZE_CPU)
    s.update(given)
    return s


# numeric settings: (type, least value, whether the least itself is allowed), checked before any model loads
_NUMBERS = {"rounds": (int, 0, True), "trials": (int, 1, True), "wall_s": (float, 0, False),
            "directions": (int, 0, True), "per_direction": (int, 0, True), "repeats": (int, 2, True),
            "workers": (int, 1, True), "num_prompts": (int, 1, True), "heldout_num_prompts": (int, 1, True),
            "max_new_tokens": (int, 1, True), "tolerance": (float, 0, True)}
_OPTIONAL = ("heldout_num_prompts", "max_new_tokens", "tolerance")  # None: its default applies


def _check_settings(s: dict) -> None:
    """A clear ConfigError for a bad number in the settings (a flag or the deployment file), before the minutes of
    loading models that a bad value would otherwise waste before failing (or before running a nonsense budget)."""
    for key, (kind, least, inclusive) in _NUMBERS.items():
        v = s.get(key)
        if v is None and key in _OPTIONAL:
            continue
        ok = (not isinstance(v, bool) and isinstance(v, (int, float) if kind is float else int)
              and (v >= least if inclusive else v > least))
        if not ok:
            what = "a whole number" if kind is int else "a number"
            raise ConfigError(f"optimize: {key} must be {what} {'>=' if inclusive else '>'} {least}, got {v!r}")


def _prompts(s: dict, which: str) -> list:
    from specpilot.evaluator import datasets

    n = s["num_prompts"] if which == "dev" else (s["heldout_num_prompts"] or s["num_prompts"])
    if s[f"{which}_prompts_file"]:
        return datasets.load_prompt_file(s[f"{which}_prompts_file"], s["field"], num_prompts=n)
    names = s["dev_benchmarks"].split(",") if which == "dev" else [s["heldout_benchmark"]]
    return [p for b in names if b for p in datasets.load_prompts(b, num_prompts=n, dataset_dir=s["dataset_dir"])]


def cmd_optimize(args) -> int:
    import torch
    from rich.console import Console

    from specpilot import deployments as dep_defaults
    from specpilot.engine import DTYPE, load_target
    from specpilot.evaluator.forcing import (
        DEFAULT_TOLERANCE, calibrated_tolerance, reference_device, specpilot_scorer, transformers_scorer,
    )
    from specpilot.hub import cache_dir, resolve_model
    from specpilot.loop.agent import AgentExplorer
    from specpilot.loop.gate import Gate
    from specpilot.loop.report import write_report
    from specpilot.loop.rounds import Budget, optimize
    from specpilot.models import load_model

    err = Console(stderr=True)
    s = _settings(args)
    _check_settings(s)
    s["target"] = s["target"] or dep_defaults.DEFAULT_TARGET
    if s["drafter"] is None and s["drafter_kind"] == "dflash":
        raise ConfigError("--drafter-kind dflash needs --drafter (a DFlash checkpoint)")
    if s["drafter"] is None and s["drafter_kind"] == "model":
        s["drafter"] = dep_defaults.DEFAULT_DRAFTER
    base = load_config_file(s["config"]) if s["config"] else {}
    base.update(drafter_kind=s["drafter_kind"], device=s["device"], dtype=s["dtype"],
                max_new_tokens=s["max_new_tokens"] or base.get("max_new_tokens")
                or (dep_defaults.DEFAULT_CPU_MAX_NEW_TOKENS if s["device"] == "cpu" else 256))
    cfg = EngineConfig.from_dict(base)
    dev_p, held_p = _prompts(s, "dev"), _prompts(s, "heldout")
    if {p.id for p in dev_p} & {p.id for p in held_p} or not dev_p or not held_p:
        raise ConfigError("dev and held-out prompts must be non-empty, different prompt sets")
    err.print(f"loading target {s['target']} ({cfg.dtype}, {cfg.device})")
    target, tok = load_target(s["target"], cfg)
    drafter_cfg = None  # the cost model's view of the drafter: a ModelConfig (small AR) or a DFlashConfig
    if s["drafter"] and cfg.drafter_kind == "dflash":
        from specpilot.models.dflash_io import read_dflash_config

        drafter_cfg = read_dflash_config(resolve_model(s["drafter"]))
    elif s["drafter"]:
        from specpilot.models.config import ModelConfig

        drafter_cfg = ModelConfig.from_folder(resolve_model(s["drafter"]))
    dev, held = [tok.encode_chat(p.messages) for p in dev_p], [tok.encode_chat(p.messages) for p in held_p]
    if s["stock"] == "transformers":
        scorer = transformers_scorer(resolve_model(s["target"]), DTYPE[cfg.dtype], cfg.device)
    else:  # an independent instance of our implementation of the stock AR
        scorer = specpilot_scorer(load_model(resolve_model(s["target"]), dtype=DTYPE[cfg.dtype], device=cfg.device))
    device_name = torch.cuda.get_device_name(torch.device(cfg.device)) if cfg.device.startswith("cuda") else "cpu"
    deployment = Deployment(s["target"], s["drafter"], cfg, device_name)
    hooks = cost_model_hooks(target.config, drafter_cfg, cfg.device, dev_prompts=dev)
    err.print(f"[dim]{hooks.note}[/dim]")
    tolerance = DEFAULT_TOLERANCE if s["tolerance"] is None else s["tolerance"]
    if s["tolerance"] is None and s["stock"] == "transformers":  # low precision: a measured tolerance (forcing.py)
        path = resolve_model(s["target"])
        noise, tolerance = calibrated_tolerance(
            scorer, lambda: transformers_scorer(path, torch.float32, reference_device(path, cfg.device, err.print)),
            dev + held, tolerance)
        if noise is not None:
            err.print(f"token forcing: {cfg.dtype} scorer margin noise {noise:.4f} vs float32 -> tolerance "
                      f"{tolerance:.4f}")
    gate = Gate(scorer, held, repeats=s["repeats"], ceiling_fn=hooks.ceiling, device=cfg.device, tolerance=tolerance)
    memory = Memory(s["memory"] or cache_dir() / "loop" / "memory.sqlite")
    extra = []
    if s["agent_command"]:
        repo = s["agent_repo"] or subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=Path(__file__).parent,
                                                 capture_output=True, text=True, check=True).stdout.strip()
        extra = [lambda view: AgentExplorer(s["agent_command"], repo)]
    budget = Budget(s["rounds"], s["trials"], s["wall_s"], s["directions"], s["workers"], s["per_direction"])
    t0 = time.time()
    measure = EngineMeasure(lambda c: load_target(s["target"], c)[0], s["drafter"], tok, loaded=(cfg, target))
    eos_ids = list(target.config.eos_token_ids)
    del target  # the measure owns it now: a trial with another weight layout must be able to free it (CPU: 23 GB)
    result = optimize(deployment, budget, memory, measure, hooks.profile, dev=dev, estimate_fn=hooks.estimate,
                      gate=gate, extra=extra, resume_run=s["resume"], use_ray=bool(s["ray"]),
                      progress=lambda msg: err.print(f"[dim]{msg}[/dim]"),
                      yardsticks=_yardsticks(s, cfg, measure, dev, eos_ids, getattr(scorer, "model", None)))
    paths = write_report(memory, result.run_id, s["out"], title=f"{s['target']} + {s['drafter'] or 'ngram'}")
    summary = result.summary()
    err.print(f"[bold]run {result.run_id}: x{result.speedup:.3f} vs round 0 after {result.rounds} rounds "
              f"({result.stopped}); report {paths['report']}[/bold]")
    print(json.dumps({**summary, "wall_s": round(time.time() - t0, 1), "report": str(paths["report"]),
                      "config_file": str(paths["config"]), "memory": str(memory.path)}))
    return 0
