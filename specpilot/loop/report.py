"""What a run leaves behind: a markdown report, PNG plots, and the winning config as a file the CLI accepts.

  report.md       summary, each round's diagnosis, every trial with its figures and verdict (and why rejected)
  speedup.png     the best config's dev speedup over round 0 (the starting config) per round, as a product of
                  paired gains; every trial as a dot; the cost model's ceiling where one was measured; our AR and
                  the stock system (the run's yardsticks, timed next to round 0) as lines
  gaps.png        the last diagnosed gap table as a waterfall (seconds per step by stage)
  best_config.yaml  EngineConfig fields of the best config: `specpilot bench --config best_config.yaml`
  *.patch         the diff of each accepted agent trial (v1 does not apply it)
Plots need matplotlib; without it they are skipped and the report says so. Everything is read back from memory,
so a report can be written for any run, finished or not.
"""

from __future__ import annotations

import json
from pathlib import Path

from specpilot.config import EngineConfig
from specpilot.loop.memory import Memory, Trial
from specpilot.loop.registry import config_delta


def write_config(cfg: EngineConfig, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def best_by_round(trials: list[Trial]) -> list[tuple[int, float]]:
    """(round, dev speedup over round 0 of the best config after that round), round 0 first."""
    out, cur = [], None
    for r in sorted({t.round for t in trials}):
        adopted = [t for t in trials if t.round == r and t.adopted]
        if adopted:
            cur = max(adopted, key=lambda t: t.id).chain
        if cur is not None:
            out.append((r, cur))
    return out


def _plots(trials: list[Trial], rounds: list[dict], base: Trial, out: Path,
           yardsticks: dict | None = None) -> tuple[dict, list[str]]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, ["plots skipped: matplotlib is not installed"]
    paths, notes = {}, []
    fig, ax = plt.subplots(figsize=(7, 4))
    series = best_by_round(trials)
    ax.plot([r for r, _ in series], [c for _, c in series], "o-", label="best so far")
    for verdict, color in (("accepted", "tab:green"), ("rejected", "tab:red")):
        pts = [(t.round, t.chain) for t in trials if t.verdict == verdict and t.chain > 0]
        if pts:
            ax.scatter(*zip(*pts), color=color, alpha=0.5, s=18, label=f"trial {verdict}")
    ceilings = [t.figures.get("ceiling_dev") for t in trials if t.adopted and t.figures.get("ceiling_dev")]
    if ceilings:
        best = [t for t in trials if t.adopted][-1]  # ceiling in the same yardstick: speedup over round 0
        ax.axhline(ceilings[-1] / best.median * best.chain, color="gray", ls="--", label="cost-model ceiling")
    else:
        notes.append("no cost-model ceiling was available (e.g. CPU): none plotted")
    ax.axhline(1.0, color="black", lw=0.5)
    for (name, y), color in zip(sorted((yardsticks or {}).items()), ("tab:purple", "tab:brown", "tab:olive")):
        if y.get("tokens_per_s") and base.median:
            ax.axhline(y["tokens_per_s"] / base.median, color=color, ls=":", label=f"{y.get('label', name)}")
    ax.set_xticks(sorted({t.round for t in trials}))
    ax.set(xlabel="round", ylabel="dev tokens/s vs round 0", title="speedup per round (vs the starting config)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["speedup_png"] = out / "speedup.png"
    fig.savefig(paths["speedup_png"], dpi=100)
    plt.close(fig)
    gaps = next((r["gaps"] for r in reversed(rounds) if r["gaps"] and r["gaps"][0].get("gap_s") is not None), None)
    if gaps:
        fig, ax = plt.subplots(figsize=(7, 4))
        start = 0.0
        for i, g in enumerate(gaps):
            ax.bar(i, g["gap_s"] * 1e3, bottom=start * 1e3, color="tab:orange")
            start += g["gap_s"]
        ax.bar(len(gaps), start * 1e3, color="tab:blue")
        ax.set_xticks(range(len(gaps) + 1), [g["stage"] for g in gaps] + ["total"])
        ax.set(ylabel="gap to floor, ms per step", title="gap waterfall (last diagnosis)")
        fig.tight_layout()
        paths["gaps_png"] = out / "gaps.png"
        fig.savefig(paths["gaps_png"], dpi=100)
        plt.close(fig)
    else:
        notes.append("no measured gap table (no profile function): waterfall skipped")
    return paths, notes


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def write_report(memory: Memory, run: int, out_dir: str | Path, *, title: str = "") -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trials, rounds = memory.finished_trials(run), memory.rounds(run)
    base = next(t for t in trials if t.round == 0)
    best = memory.best_trial(run) or base
    base_cfg, best_cfg = EngineConfig.from_dict(base.config), EngineConfig.from_dict(best.config)
    paths = {"config": write_config(best_cfg, out / "best_config.yaml")}
    ys = memory.yardsticks(run)
    plots, notes = _plots(trials, rounds, base, out, ys)
    paths.update(plots)
    lines = [f"# Optimization run {run}{': ' + title if title else ''}", "",
             f"- best config: `{json.dumps(config_delta(base_cfg, best_cfg))}` (changes from round 0), file "
             f"`{paths['config'].name}` (`specpilot bench --config {paths['config'].name}`)",
             f"- speedup over round 0 (product of paired gains): dev x{best.chain:.3f}, held-out "
             f"x{_fmt(best.figures.get('chain_heldout'))}",
             f"- absolute dev tokens/s (each measured at its own time): round 0 {base.median:.3f}, "
             f"best {best.median:.3f}",
             f"- trials: {sum(t.round > 0 for t in trials)} gated, "
             f"{sum(t.round > 0 and t.passed for t in trials)} accepted", ""]
    for name, y in sorted(ys.items()):
        vs = [f"round {r} x{c * base.median / y['tokens_per_s']:.3f}" for r, c in best_by_round(trials)]
        lines.append(f"- vs {y.get('label', name)} ({y['tokens_per_s']:.3f} tok/s, timed next to round 0): "
                     + ", ".join(vs))
    if not ys:
        notes.append("no yardstick (our AR, stock) was measured for this run")
    lines += [f"- note: {n}" for n in notes] + [""]
    for name in ("speedup_png", "gaps_png"):
        if name in paths:
            lines += [f"![{name}]({paths[name].name})", ""]
    lines += ["## Rounds", "", "| round | diagnosis | stages by gap (ms) |", "| --- | --- | --- |"]
    for r in rounds:
        stages = ", ".join(g["stage"] + ("" if g.get("gap_s") is None else f" {g['gap_s'] * 1e3:.3f}")
                           for g in r["gaps"])
        lines.append(f"| {r['round']} | {r['note']} | {stages} |")
    lines += ["", "## Trials", "",
              "| id | round | mechanism | delta | dev tok/s | predicted x | x reference | x round 0 | held-out x reference "
              "| verdict | reason |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in trials:  # predicted x: the cost model's estimate that ordered the trial (costmodel/whatif.py)
        lines.append(f"| {t.id} | {t.round} | {t.mechanism} | `{json.dumps(t.delta)}` | {_fmt(t.median or None)} "
                     f"| {_fmt(t.figures.get('predicted_gain'))} | {_fmt(t.figures.get('gain_dev'))} "
                     f"| {_fmt(t.chain or None)} "
                     f"| {_fmt(t.figures.get('gain_heldout'))} | "
                     f"{t.verdict}{' (adopted)' if t.adopted else ''} | {t.reason.replace('|', '/')} |")
        if t.verdict == "accepted" and t.figures.get("patch"):
            p = out / f"trial-{t.id}.patch"
            p.write_text(t.figures["patch"])
            paths[f"patch_{t.id}"] = p
    paths["report"] = out / "report.md"
    paths["report"].write_text("\n".join(lines) + "\n")
    return paths
