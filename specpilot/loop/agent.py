"""The command explorer: a coding agent proposes a code change in a fresh git worktree; the loop judges it.

Per round: `git worktree add --detach` of the repo's HEAD in a temp dir; a brief (markdown, outside the worktree)
with the direction, the gap table, the files that matter and what memory knows; the command template run in the
worktree (`{brief_file}`, `{worktree}`, `{direction}` are substituted, shell-quoted). The diff is collected with
`git add -A && git diff --cached`, so new files count too. The candidate is rejected before any measurement when
  * the command fails or changes nothing (reason "agent: ..."),
  * the diff touches the judge: the evaluator, the gate, the cost model or their tests ("protected: ..."),
  * the worktree's resolved config changes the regime (sampling, output length, stops, dtype, device), so its
    outputs would not be comparable ("regime: ...").
Otherwise it is gated like any candidate, with a measure that runs the worktree's code:
  * the worktree's config is resolved in a subprocess with the worktree first on PYTHONPATH: the loop's current
    best config, as overrides of the loop's own defaults, on top of the worktree's defaults (so an agent that
    changes a default changes what is measured);
  * `DriverMeasure` (the default) runs the worktree's engine in a subprocess: loads the target and drafter,
    generates the prompts and times them with `explore.time_engine`, whose source is copied into the driver
    script, so the clock and the outputs' collection are the loop's code, never the candidate's. The outputs come
    back and are token-forced here, in this process, by the gate's independent scorer;
  * or `measure_factory(worktree)`, e.g. an in-process measure of the resolved config (tests use this).
v1 limits: an accepted agent trial adopts its resolved config; its patch is recorded with the trial and written by
the report, and applying it to the main tree is left to a person (later rounds measure the main tree's code).
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from specpilot.config import EngineConfig
from specpilot.loop.explore import Candidate, Explorer, Measure, Measurement, View, time_engine, trial_key
from specpilot.loop.registry import config_delta

PROTECTED = ("specpilot/evaluator/", "specpilot/loop/gate.py", "specpilot/costmodel/", "tests/test_forcing.py",
             "tests/test_costmodel.py", "tests/test_datasets.py", "tests/test_loop.py", "tests/conftest.py")
REGIME = ("max_new_tokens", "stop_strings", "ignore_eos", "dtype", "device", "sampling")
STAGE_FILES = {
    "draft": ["specpilot/drafters/", "specpilot/engine/spec.py"],
    "verify": ["specpilot/models/dense.py", "specpilot/engine/runner.py", "specpilot/verify/chain.py"],
    "accept": ["specpilot/verify/chain.py", "specpilot/sampling/__init__.py"],
    "other": ["specpilot/engine/spec.py", "specpilot/engine/session.py", "specpilot/engine/runner.py"],
}
MAX_PATCH = 200_000

_DRIVER = '''
import json, sys
req = json.load(sys.stdin)
from specpilot.config import EngineConfig
import os, specpilot
if not os.path.realpath(specpilot.__file__).startswith(os.path.realpath(req["worktree"]) + os.sep):
    sys.exit("specpilot was imported from " + specpilot.__file__ + ", not from the candidate worktree")
cfg = EngineConfig.from_dict(req["overrides"])
if req.get("resolve_only"):
    print(json.dumps(cfg.to_dict()))
    sys.exit(0)
import torch
from specpilot.engine import DTYPE, Engine, build_drafter
from specpilot.hub import resolve_model
from specpilot.models import load_model
path = resolve_model(req["target"])
target = load_model(path, dtype=DTYPE[cfg.dtype], device=cfg.device)
tok = None  # only stop strings need it; a folder without tokenizer files has none
if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
    from specpilot.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(path)
drafter = build_drafter(cfg, req["drafter"] if cfg.drafter_kind == "model" else None, target)
engine = Engine(target, cfg, drafter, tok)
sync = (lambda: torch.cuda.synchronize()) if cfg.device.startswith("cuda") else None
out = time_engine(engine.generate, req["prompts"], req["repeats"], sync)
out["config"] = cfg.to_dict()
print("SPECPILOT-RESULT " + json.dumps(out))
'''


def protected_paths(paths: list[str]) -> list[str]:
    return [p for p in paths if p.startswith(PROTECTED)]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _driver(worktree: Path, request: dict, timeout_s: float) -> str:
    """Run the driver with the worktree's specpilot first on the path; its stdout."""
    script = "import json, sys\n" + inspect.getsource(time_engine) + _DRIVER
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worktree), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(request), cwd=worktree, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"candidate driver failed (rc {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def overrides_of(cfg: EngineConfig) -> dict:
    """The loop's config as changes from the loop's own defaults (the worktree supplies the rest)."""
    return config_delta(EngineConfig(), cfg)


def resolve_config(worktree: Path, cfg: EngineConfig, timeout_s: float = 120) -> dict:
    out = _driver(worktree, {"overrides": overrides_of(cfg), "resolve_only": True, "worktree": str(worktree)},
                  timeout_s)
    return json.loads(out.strip().splitlines()[-1])


class DriverMeasure:
    """measure(config, prompts, repeats) that runs the worktree's engine in a subprocess (see module docstring)."""

    def __init__(self, worktree: Path, target: str, drafter: str | None, timeout_s: float = 3600):
        self.worktree, self.target, self.drafter, self.timeout_s = Path(worktree), target, drafter, timeout_s

    def __call__(self, config: EngineConfig, prompts: list[list[int]], repeats: int) -> Measurement:
        req = {"overrides": overrides_of(config), "target": str(self.target), "drafter": self.drafter,
               "prompts": prompts, "repeats": repeats, "worktree": str(self.worktree)}
        line = [x for x in _driver(self.worktree, req, self.timeout_s).splitlines()
                if x.startswith("SPECPILOT-RESULT ")][-1]
        r = json.loads(line.split(" ", 1)[1])
        return Measurement(r["samples"], [list(p) for p in prompts], r["outputs"], r["tau"], r["stage_s"],
                           r["context_len"], r["config"], acceptance=r.get("acceptance", []))


class AgentExplorer(Explorer):
    def __init__(self, command: str, repo: str | Path, *, name: str = "agent", direction: str = "",
                 measure_factory: Callable[[Path], Measure] | None = None, timeout_s: float = 3600):
        self.command, self.repo, self.name, self.direction = command, Path(repo), name, direction
        self.measure_factory, self.timeout_s = measure_factory, timeout_s
        self._tmp: Path | None = None

    def key(self, view: View) -> str:
        return trial_key(view.round, self.name, {})

    def brief(self, view: View) -> str:
        direction = self.direction or (view.gaps[0]["stage"] if view.gaps else "any")
        rows = "\n".join(f"| {g['stage']} | {g['measured_s']} | {g['floor_s']} | {g['gap_s']} |" for g in view.gaps)
        files = sorted({f for g in view.gaps[:2] for f in STAGE_FILES.get(g["stage"], [])})
        return (f"# Make speculative decoding faster: direction `{direction}`\n\n"
                f"Deployment: target `{view.deployment.target}`, drafter `{view.deployment.drafter}`, "
                f"device `{view.deployment.device_name}`, regime `{view.deployment.regime}`.\n"
                f"Current best config (EngineConfig fields): `{json.dumps(view.best_config.to_dict())}`; "
                f"dev median {view.best_figures['dev']['median']:.3f} tok/s.\n\n"
                "## Gap table (seconds per speculative step, largest gap first)\n\n"
                f"| stage | measured | floor | gap |\n| --- | --- | --- | --- |\n{rows}\n\n"
                f"## Files that matter\n\n" + "\n".join(f"- `{f}`" for f in files) + "\n\n"
                f"## What memory knows\n\n{view.knowledge.describe() if view.knowledge else 'nothing yet'}\n\n"
                "## Rules\n\n- Outputs must stay token-identical to the target's greedy AR (every token is forced).\n"
                f"- Do not touch: {', '.join(PROTECTED)} (any such diff is rejected unread).\n"
                "- Do not change sampling, output length, stop rules, dtype or device.\n"
                "- Edit files in this worktree; no commit needed: the loop collects the diff.\n")

    def propose(self, view: View) -> list[Candidate]:
        self._tmp = Path(tempfile.mkdtemp(prefix="specpilot-agent-"))
        wt, brief = self._tmp / "worktree", self._tmp / "brief.md"
        _git(self.repo, "worktree", "add", "--detach", str(wt), "HEAD")
        brief.write_text(self.brief(view))
        cmd = self.command.format(brief_file=shlex.quote(str(brief)), worktree=shlex.quote(str(wt)),
                                  direction=shlex.quote(self.direction or view.gaps[0]["stage"]))
        reject = ""
        try:
            proc = subprocess.run(cmd, shell=True, cwd=wt, capture_output=True, text=True, timeout=self.timeout_s)
            if proc.returncode != 0:
                reject = f"agent: command exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            reject = f"agent: command ran past {self.timeout_s:.0f} s"
        _git(wt, "add", "-A")
        files = [f for f in _git(wt, "diff", "--cached", "--name-only", "HEAD").splitlines() if f]
        patch = _git(wt, "diff", "--cached", "HEAD")[:MAX_PATCH]
        extra = {"agent_files": files, "patch": patch}
        bad = protected_paths(files)
        if not reject and bad:
            reject = f"protected: the diff touches the judge ({', '.join(bad)}); rejected unmeasured"
        if not reject and not files:
            reject = "agent: no change"
        cfg = view.best_config
        if not reject:
            try:
                resolved = resolve_config(wt, view.best_config)
                cfg = EngineConfig.from_dict(resolved)
            except Exception as e:  # the worktree's package may not even import
                reject = f"agent: the worktree's config does not resolve: {str(e)[-300:]}"
        changed = [f for f in REGIME if getattr(cfg, f) != getattr(view.best_config, f)]
        if not reject and changed:
            reject = f"regime: the change alters {', '.join(changed)}; outputs would not be comparable"
        measure = None
        if not reject:
            measure = self.measure_factory(wt) if self.measure_factory else \
                DriverMeasure(wt, view.deployment.target, view.deployment.drafter)
        return [Candidate(self.name, config_delta(view.best_config, cfg), cfg, self.key(view), measure, reject,
                          extra)]

    def close(self) -> None:
        if self._tmp is None:
            return
        subprocess.run(["git", "worktree", "remove", "--force", str(self._tmp / "worktree")], cwd=self.repo,
                       capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=self.repo, capture_output=True)
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp = None
