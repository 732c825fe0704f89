"""What each CLI subcommand does, in library calls. Human output goes to stderr/stdout tables; machine output is
the last stdout line, one JSON object."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specpilot.errors import ConfigError, DatasetError

out = Console()
err = Console(stderr=True)


def cmd_models(args) -> int:
    from specpilot import hub

    if args.models_command == "pull":
        for name in args.names:
            path = hub.pull(name, force=args.force, log=lambda m: err.print(f"[dim]{m}[/dim]"))
            out.print(f"{name}: {path}")
        return 0
    table = Table("name", "status", "size", "path")
    for m in hub.list_models():
        size = f"{m['size_bytes'] / 1e9:.2f} GB" if m.get("size_bytes") else "-"
        status = m.get("status") or ("cached" if m.get("cached") else "not pulled")
        table.add_row(m["name"], status, size, str(m.get("path") or "-"))
    out.print(table)
    return 0


def _load_engines(args, cfg):
    from specpilot import deployments as dep
    from specpilot.engine import Engine, build_drafter, load_target

    if cfg.drafter_kind == "dflash" and args.drafter == dep.DEFAULT_DRAFTER:  # --drafter left at its default
        raise ConfigError("--drafter-kind dflash needs --drafter, a DFlash checkpoint (e.g. "
                          f"dflash-qwen2.5-coder-1.5b); the default drafter {dep.DEFAULT_DRAFTER} is a plain model "
                          "(--drafter-kind model)")
    err.print(f"loading target {args.target} ({cfg.dtype}, {cfg.device})")
    target, tok = load_target(args.target, cfg)
    drafter = None
    uses_model = cfg.drafter_kind in ("model", "dflash")
    if uses_model:
        err.print(f"loading drafter {args.drafter}")
    drafter = build_drafter(cfg, args.drafter if uses_model else None, target)
    return target, tok, Engine(target, cfg, drafter, tok), Engine(target, cfg.with_(drafter_kind="none"), None, tok)


def cmd_generate(args) -> int:
    from specpilot.cli import engine_config

    cfg = engine_config(args)
    if not (args.chat if args.chat is not None else args.prompt).strip():
        raise ConfigError("empty prompt")
    target, tok, spec, _ = _load_engines(args, cfg)
    if args.chat is not None:
        ids = tok.encode_chat([{"role": "user", "content": args.chat}])
    else:
        ids = tok.encode(args.prompt)
    shown = []

    def stream(tokens):
        before = tok.decode(shown, skip_special_tokens=True)
        shown.extend(tokens)
        sys.stdout.write(tok.decode(shown, skip_special_tokens=True)[len(before):])
        sys.stdout.flush()

    res = spec.generate(ids, on_tokens=stream)
    sys.stdout.write("\n")
    err.print(f"[bold]{res.num_output_tokens} tokens, tau {res.tau:.2f}, {res.tokens_per_s:.2f} tok/s[/bold] ({res.finish_reason})")
    print(json.dumps({"tokens": res.num_output_tokens, "tau": round(res.tau, 4), "tokens_per_s": round(res.tokens_per_s, 3),
                      "finish_reason": res.finish_reason}))
    return 0


def _scorer(args, target, cfg):
    from specpilot.evaluator.forcing import specpilot_scorer, transformers_scorer
    from specpilot.hub import resolve_model

    if args.stock == "transformers":
        from specpilot.engine import DTYPE

        return transformers_scorer(resolve_model(args.target), DTYPE[cfg.dtype], cfg.device)
    return specpilot_scorer(target)


def _check_tolerance(args) -> None:
    if args.tolerance is not None and not args.tolerance >= 0:  # (`not >=`: NaN too)
        raise ConfigError(f"--tolerance is a logit margin >= 0, got {args.tolerance}")


def _system_names(args) -> list[str]:
    """--systems as a list, every name known (checked before any model loads)."""
    from specpilot.evaluator.bench import SYSTEMS

    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        raise ConfigError(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    return names


def _systems(names, args, cfg, target, tok, spec, ar, hf_model=None):
    """name -> generate(prompt_ids) for each system asked for (`names`: _system_names). `hf_model`: transformers'
    target already loaded in this dtype and device (the forcing scorer's), which hf-ar and stock then run on
    instead of loading their own copies: one copy of the target beside ours, not up to three."""
    from specpilot.engine import DTYPE
    from specpilot.evaluator.stock import HFSystem, stock_system
    from specpilot.hub import resolve_model

    names = ["ar"] + [n for n in names if n not in ("ar", "specpilot")] + ["specpilot"]  # both always run
    systems = {"ar": ar.generate, "specpilot": spec.generate}
    hf = dict(dtype=DTYPE[cfg.dtype], device=cfg.device, max_new_tokens=cfg.max_new_tokens,
              eos_ids=target.config.eos_token_ids, model=hf_model)
    for n in names:
        if n == "hf-ar":
            systems[n] = HFSystem(resolve_model(args.target), **hf).generate
        elif n == "stock":
            systems[n] = stock_system(args.target, args.drafter, cfg.drafter_kind, cfg.num_draft_tokens, **hf)[0]
    return {n: systems[n] for n in names}


def _calibrate_tolerance(args, cfg, sets, tok, ar, scorer, tol):
    """Measure the low-precision scorer's margin noise against a float32 copy of it on the first prompt of each
    benchmark (prompt + our AR output) -> (noise, tolerance = max(tol, 2 * noise)); evaluator/forcing.py says why."""
    import torch

    from specpilot.evaluator.forcing import calibrated_tolerance, reference_device, transformers_scorer
    from specpilot.hub import resolve_model

    seqs = []
    for prompts in sets.values():
        ids = tok.encode_chat(prompts[0].messages)
        seqs.append(ids + ar.generate(ids).output_ids)
    path = resolve_model(args.target)
    noise, tol = calibrated_tolerance(
        scorer, lambda: transformers_scorer(path, torch.float32, reference_device(path, cfg.device, err.print)), seqs,
        tol)
    err.print(f"token forcing: {cfg.dtype} scorer margin noise {noise:.4f} vs float32 on {len(seqs)} sequences "
              f"-> tolerance {tol:.4f}")
    return noise, tol


def _bench_meta(args, cfg, t0: float, partial: bool = False) -> dict:
    drafter = args.drafter if cfg.drafter_kind in ("model", "dflash") else cfg.drafter_kind
    meta = {"target": args.target, "drafter": drafter, "config": cfg.to_dict(), "wall_s": round(time.time() - t0, 1)}
    if getattr(args, "skip_prompts", 0):
        meta["skip_prompts"] = args.skip_prompts
    return {**meta, "partial": True} if partial else meta


def cmd_bench(args) -> int:
    from rich.progress import Progress

    from specpilot import deployments as dep
    from specpilot.cli import engine_config
    from specpilot.evaluator import datasets
    from specpilot.evaluator.bench import run_benchmark, summarize, write_results
    from specpilot.evaluator.forcing import DEFAULT_TOLERANCE

    overrides = {}
    if args.max_new_tokens is None and not args.config:
        overrides["max_new_tokens"] = dep.DEFAULT_CPU_MAX_NEW_TOKENS if (args.device or "cpu") == "cpu" else 256
    cfg = engine_config(args, **overrides)
    if cfg.drafter_kind == "none":
        raise ConfigError("bench compares AR with a speculative system: choose --drafter-kind model or ngram")
    if args.num_prompts is not None and args.num_prompts <= 0:
        raise ConfigError("--num-prompts must be > 0")
    if args.time_budget is not None and args.time_budget <= 0:
        raise ConfigError("--time-budget must be > 0 seconds")
    if args.skip_prompts < 0:
        raise ConfigError("--skip-prompts must be >= 0")
    if args.baseline_prompts < 0:
        raise ConfigError("--baseline-prompts must be >= 0 (0: all)")
    _check_tolerance(args)
    system_names = _system_names(args)
    deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
    # --skip-prompts N: the selection --num-prompts N + M would make, less its first N (the rest of a cut run,
    # pooled with it by `specpilot bench-merge`)
    num = None if args.num_prompts is None else args.skip_prompts + args.num_prompts
    if args.prompts:
        sets = {Path(args.prompts).stem: datasets.load_prompt_file(args.prompts, args.field, num_prompts=num)}
    else:
        names = [b for b in args.benchmarks.split(",") if b]
        if not names:
            raise DatasetError("no benchmarks given")
        sets = {b: datasets.load_prompts(b, num_prompts=num, dataset_dir=args.dataset_dir) for b in names}
    sets = {name: prompts[args.skip_prompts:] for name, prompts in sets.items()}
    for name, prompts in sets.items():
        if not prompts:
            raise DatasetError(f"{name}: --skip-prompts {args.skip_prompts} leaves no prompts")
    t0 = time.time()
    target, tok, spec, ar = _load_engines(args, cfg)
    scorer = _scorer(args, target, cfg)
    systems = _systems(system_names, args, cfg, target, tok, spec, ar, getattr(scorer, "model", None))
    # the run's fixed cost, where it goes (each benchmark's warm-ups: its report's warmup_s)
    setup_s = {"load": round(time.time() - t0, 2)}
    tol = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    noise = None
    if args.tolerance is None and cfg.dtype != "float32" and args.stock == "transformers":
        t1 = time.time()
        noise, tol = _calibrate_tolerance(args, cfg, sets, tok, ar, scorer, tol)
        setup_s["calibrate_tolerance"] = round(time.time() - t1, 2)
    limits = {s: args.baseline_prompts for s in ("hf-ar", "stock") if args.baseline_prompts}
    reports, records, skipped = [], {}, []

    def checkpoint(name, rep, recs):  # after every prompt: a run killed later keeps what it measured
        write_results(Path(args.out), summarize(reports + [rep], {**_bench_meta(args, cfg, t0, partial=True),
                                                                   "setup_s": setup_s}), {**records, name: recs})

    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("decoding", total=sum(len(p) for p in sets.values()))
        for name, prompts in sets.items():
            if deadline is not None and reports and time.monotonic() >= deadline:
                skipped.append(name)
                continue
            bar.update(task, description=name)
            rep, recs = run_benchmark(name, prompts, lambda p: tok.encode_chat(p.messages), systems, scorer,
                                      tolerance=tol, limits=limits, progress=lambda: bar.advance(task),
                                      max_prompt_tokens=cfg.max_seq_len - cfg.num_draft_tokens - 2,
                                      deadline=deadline, checkpoint=lambda r, rs, n=name: checkpoint(n, r, rs))
            if rep["skipped_long_prompts"]:
                err.print(f"[yellow]{name}: {rep['skipped_long_prompts']} prompts longer than the KV pool "
                          f"(--max-seq-len {cfg.max_seq_len}) left out")
            if rep.get("stopped_by_time_budget"):
                err.print(f"[yellow]{name}: --time-budget reached after {rep['num_prompts']} of {len(prompts)} prompts")
            reports.append(rep)
            records[name] = recs
    if skipped:
        err.print(f"[yellow]--time-budget reached: {', '.join(skipped)} not run")
    meta = {**_bench_meta(args, cfg, t0), "forcing_tolerance": round(tol, 5),
            "scorer_noise": None if noise is None else round(noise, 5), "setup_s": setup_s}
    if args.time_budget is not None:
        meta.update(time_budget_s=args.time_budget, benchmarks_not_run=skipped)
    summary = summarize(reports, meta)
    write_results(Path(args.out), summary, records)
    _print_bench(summary, args.out)
    return 0 if summary["forcing_passed"] else 1


def _print_bench(summary: dict, path) -> None:
    """The human table of a bench result, its vs-stock line and the last stdout line (JSON)."""
    cfg = summary.get("config", {})
    table = Table("benchmark", "system", "prompts", "tok/s", "vs our AR", "tau", "accept by position", "forcing",
                  title=f"{summary.get('target')} + {summary.get('drafter')}, K={cfg.get('num_draft_tokens')}, "
                        f"{cfg.get('device')}/{cfg.get('dtype')}, {cfg.get('max_new_tokens')} new tokens")
    for r in summary["benchmarks"].values():
        for s, e in r["systems"].items():
            verdict = "pass" if e["forcing_passed"] else f"FAIL ({e['forcing_failures']})"
            table.add_row(r["benchmark"], s, str(e["prompts"]), f"{e['tokens_per_s']:.2f}", f"{e['speedup_vs_ar']:.2f}x",
                          f"{e['tau']:.2f}" if "tau" in e else "-",
                          " ".join(f"{a:.2f}" for a in e.get("acceptance_by_position", [])),
                          f"{verdict}, {e['forcing_mismatches']} near-tie mismatches / {e['forcing_tokens']} tokens")
    out.print(table)
    if "speedup_vs_stock" in summary:
        out.print(f"SpecPilot vs stock (same prompts): {summary['speedup_vs_stock']}")
    out.print(f"results: {path}")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("benchmarks", "config")}))


def cmd_bench_merge(args) -> int:
    from specpilot.evaluator.bench import write_results
    from specpilot.evaluator.bench_merge import merge_runs

    summary, records = merge_runs(args.results)
    write_results(Path(args.out), summary, records)
    _print_bench(summary, args.out)
    return 0 if summary["forcing_passed"] else 1


def cmd_force(args) -> int:
    from specpilot.config import EngineConfig
    from specpilot.evaluator.forcing import DEFAULT_TOLERANCE, force, merge
    from specpilot.engine import load_target

    _check_tolerance(args)
    records = []
    try:
        for n, line in enumerate(Path(args.input).read_text().splitlines(), 1):
            if line.strip():
                r = json.loads(line)
                records.append((r["prompt_ids"], r["output_ids"]))
    except FileNotFoundError:
        raise DatasetError(f"no such file: {args.input}") from None
    except IsADirectoryError:
        raise DatasetError(f"{args.input} is a folder: pass a JSONL file of prompt_ids / output_ids") from None
    except UnicodeDecodeError:
        raise DatasetError(f"{args.input} is not UTF-8 text (JSONL expected)") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DatasetError(f"{args.input} line {n}: need a JSON object with prompt_ids and output_ids ({e})") from None
    cfg = EngineConfig(drafter_kind="none")
    target, _ = load_target(args.target, cfg)
    scorer = _scorer(args, target, cfg)
    tol = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    verdicts = [force(scorer, p, o, tol) for p, o in records]
    for i, v in enumerate(verdicts):
        for m in v.failures:
            out.print(f"record {i}: position {m.index}: token {m.token} != stock {m.stock_token} (margin {m.margin:.3f})")
    summary = merge(verdicts)
    out.print(f"token forcing: {'PASS' if summary['forcing_passed'] else 'FAIL'} over {summary['forcing_tokens']} tokens")
    print(json.dumps(summary))
    return 0 if summary["forcing_passed"] else 1


def cmd_profile(args) -> int:
    """Measure AR and speculative steps on real prompts, then let the cost model rank the gaps to the ceiling."""
    from specpilot.cli import engine_config
    from specpilot.costmodel import StepProfile, analyze, load_or_measure
    from specpilot.costmodel.gaps import engine_fields
    from specpilot.evaluator import datasets

    cfg = engine_config(args)
    if cfg.drafter_kind not in ("model", "ngram", "dflash"):
        raise ConfigError("profile needs a speculative system: --drafter-kind model, ngram or dflash")
    hw = load_or_measure(cfg.device)
    prompts = []
    for b in [b for b in args.benchmarks.split(",") if b]:
        prompts += datasets.load_prompts(b, num_prompts=args.num_prompts, dataset_dir=args.dataset_dir)
    target, tok, spec, ar = _load_engines(args, cfg)
    encoded = [tok.encode_chat(p.messages) for p in prompts]
    spec.generate(encoded[0][:32]), ar.generate(encoded[0][:32])  # warm-up
    ar_res = [ar.generate(ids) for ids in encoded]
    from specpilot.drafters.timing import ProposeTimer

    # host time inside propose(), up to the drafter's pass launch, outside launches, the draft graph's device time
    propose = ProposeTimer(spec.drafter)
    spec_res = [spec.generate(ids) for ids in encoded]
    steps = sum(len(r.accepted_lengths) for r in spec_res)
    stage = {k: sum(r.stage_s.get(k, 0.0) for r in spec_res) / steps for k in ("draft", "verify", "accept", "commit")}
    decode_per_step = sum(r.decode_s for r in spec_res) / steps
    tau = sum(r.num_output_tokens for r in spec_res) / sum(r.num_target_forwards for r in spec_res)
    K = cfg.num_draft_tokens
    model_drafter, dflash = cfg.drafter_kind == "model", cfg.drafter_kind == "dflash"
    full_accepts = sum(a >= K for r in spec_res for a in r.accepted_lengths) / max(steps, 1)
    profile = StepProfile(
        draft_s=stage["draft"], verify_s=stage["verify"], accept_s=stage["accept"],
        other_s=max(decode_per_step - stage["draft"] - stage["verify"] - stage["accept"], 0.0),
        tau=tau, num_draft_tokens=K, drafter_passes=K if model_drafter else int(dflash),
        context_len=int(sum(len(r.prompt_ids) + r.num_output_tokens / 2 for r in spec_res) / len(spec_res)),
        # the drafter's catch-up pass feeds 2 tokens after a step that accepted every draft, else 1
        drafter_pass_tokens=(1 + round(full_accepts),) + (1,) * (K - 1) if model_drafter else None,
        ar_step_s=sum(r.decode_s for r in ar_res) / sum(r.num_target_forwards for r in ar_res),
        **engine_fields(cfg),
    )
    drafter_cfg = (spec.drafter.runner.model.config if model_drafter
                   else spec.drafter.network.config if dflash else None)
    host_s, launches = 0.0, 0.0
    timed = propose.per_step(steps)
    if dflash or model_drafter:  # measured host part of the stage (the device waits for it) and launches queued
        host_s, launches = timed["host_pre_launch_s"] + timed["eager_pass_s"], timed["launches_after"]  # behind
    if cfg.drafter_kind == "ngram":  # the lookup is host work: its time replayed on the outputs, off the GPU
        from specpilot.drafters.ngram import NgramDrafter, replay

        host_s = replay(NgramDrafter(cfg.ngram_max, cfg.ngram_min), [r.prompt_ids for r in spec_res],
                        [r.output_ids for r in spec_res], K)["propose_s"]
    report = analyze(target.config, drafter_cfg, profile, hw, drafter_kind=cfg.drafter_kind, graphed=cfg.cuda_graphs,
                     draft_host_s=host_s, draft_launches=launches)
    out.print(report.table())
    graph = timed["graph_device_s"]
    out.print(f"propose(): {timed['wall_s'] * 1e3:.3f} ms host wall per step; host before the pass's launch "
              f"{timed['host_pre_launch_s'] * 1e3:.3f} ms, eager passes {timed['eager_pass_s'] * 1e3:.3f} ms, "
              f"launches outside it {timed['launches_before']:.1f} before / {timed['launches_after']:.1f} after; "
              f"{'drafter pass' if model_drafter else 'draft graph'} "
              f"{'not timed' if graph is None else f'{graph * 1e3:.3f} ms a replay'} on the device; "
              f"passes {timed['passes']} (the draft stage measured {stage['draft'] * 1e3:.3f} ms on the device)")
    if timed["by_pass"]:  # a small model drafter: the catch-up pass (2+ tokens) apart from the one-token ones
        out.print("device ms a pass, by tokens fed: " + ", ".join(
            f"{k}: {v['mean_s'] * 1e3:.3f} x {v['count']}" for k, v in timed["by_pass"].items()))
    runs = {"target": spec.runner.step_counts}
    if model_drafter:
        runs["drafter"] = spec.drafter.runner.step_counts
    out.print("steps run (graphed / eager static bucket / no bucket): " +
              ", ".join(f"{k} {v['graphed']} / {v['eager_bucket']} / {v['unbucketed']}" for k, v in runs.items()))
    print(json.dumps({"profile": profile.__dict__, "step_counts": runs,
                      "propose_wall_s_per_step": timed["wall_s"], "propose": timed, **report.to_dict()},
                     default=list))
    return 0


def cmd_optimize(args) -> int:
    from specpilot.loop import cmd_optimize

    return cmd_optimize(args)


def cmd_train_drafter(args) -> int:
    from specpilot.train import cmd_train_drafter

    return cmd_train_drafter(args)


def cmd_export_drafter(args) -> int:
    from specpilot.hub import resolve_model
    from specpilot.models.dflash_io import load_dflash, save_dflash

    src = resolve_model(args.src, log=lambda m: err.print(f"[dim]{m}[/dim]"))
    drafter = load_dflash(src)
    save_dflash(drafter, args.dst, storage=args.storage, group_size=args.group_size,
                max_shard_bytes=int(args.max_shard_mb * (1 << 20)))
    files = sorted(Path(args.dst).glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    err.print(f"{src} -> {args.dst}: {args.storage}, {len(files)} shard(s), {size / 1e6:.1f} MB")
    print(json.dumps({"src": str(src), "dst": str(args.dst), "storage": args.storage, "bytes": size,
                      "shards": len(files)}))
    return 0
