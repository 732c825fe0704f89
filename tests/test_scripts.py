"""The GPU-machine scripts only run on the device, so CI at least checks that each one parses."""

import ast
import subprocess
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
