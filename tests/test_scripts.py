"""The GPU-machine scripts only run on the device, so CI at least checks that each one parses."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.sh")), ids=lambda p: p.name)
def test_shell_scripts_parse(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("path", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_python_scripts_parse(path):
    ast.parse(path.read_text(), filename=str(path))


def test_there_are_scripts_to_check():
    assert len(list(SCRIPTS.glob("*.sh"))) >= 4 and len(list(SCRIPTS.glob("*.py"))) >= 4


def test_dflash_step_diagnostic_runs_on_cpu():
    """gpu_dflash_step.py runs its whole measuring sequence at tiny shapes on the CPU (`--cpu-smoke`)."""
    path = os.pathsep.join(filter(None, [str(SCRIPTS.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, str(SCRIPTS / "gpu_dflash_step.py"), "--cpu-smoke"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    figures = ["verify16_sdpa_gpu_ms", "static_step_eager_gpu_ms", "static_step_eager_wall_ms", "propose_wall_ms",
               "propose_host_ms", "propose_event_ms", "profile", "engine_stage_ms_per_step"]
    assert all(out.get(k) is not None for k in figures), r.stderr  # a failed measurement reads None
    assert out["smoke"] and out["draft_graph_captured"] is False and out["profile"]["kernels_per_propose"] > 0
    assert set(out["engine_stage_ms_per_step"]) >= {"draft", "verify", "accept"}
