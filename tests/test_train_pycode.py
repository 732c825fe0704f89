"""The `pycode` training-prompt source: "write this function" prompts from the stdlib's docstrings."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specpilot.errors import DatasetError
from specpilot.train import data as td

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prompts():
    return td.load_pycode()


def _resolve(pid: str):
    """(function, class name or None) behind a prompt id "pycode/<module>.<qualname>"."""
    dotted = pid.removeprefix("pycode/")
    module = max((m for m in td.PYCODE_MODULES if dotted.startswith(m + ".")), key=len)
    parts = dotted[len(module) + 1:].split(".")
    obj = importlib.import_module(module)
    if len(parts) == 1:
        return getattr(obj, parts[0]), None
    cls = getattr(obj, parts[0])
    raw = vars(cls)[parts[1]]
    return (raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw), parts[0]


def test_pycode_prompts_are_many_unique_and_carry_name_and_docstring(prompts):
    assert len(prompts) >= 500
    ids = [p.id for p in prompts]
    assert len(set(ids)) == len(ids) and ids == sorted(ids)
    assert {p.source for p in prompts} == {"pycode"}
    assert all(p.id.startswith("pycode/") for p in prompts)
    contents = [p.messages[0]["content"] for p in prompts]
    docs = [c.split("\n\n", 1)[1].rsplit("\n\n", 1)[0] for c in contents]
    assert len(set(docs)) == len(docs)  # a docstring seen before is skipped
    methods = 0
    for p in prompts:
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        text = p.messages[0]["content"]
        assert len(text) <= td.MAX_PROMPT_CHARS and text.endswith("Return only the code.")
        fn, cls = _resolve(p.id)
        methods += cls is not None
        assert f"{fn.__name__}(" in text
        if cls is not None:
            assert f"`{cls}" in text
        assert inspect.getdoc(fn).strip().splitlines()[0] in text
        assert " at 0x" not in text.split("\n", 1)[0]  # no object address in the signature
    assert 0 < methods < len(prompts)  # functions and methods both
    # every phrasing is used
    firsts = {c.split("`", 1)[0] for c in contents}
    assert {t.split("`", 1)[0] for t in td.PYCODE_FUNCTION_TEMPLATES + td.PYCODE_METHOD_TEMPLATES} == firsts


def test_pycode_known_prompts(prompts):
    by_id = {p.id: p.messages[0]["content"] for p in prompts}
    assert by_id["pycode/textwrap.dedent"] == (
        "Write a Python function `dedent(text)` that does the following:\n\n"
        f"{inspect.getdoc(textwrap.dedent)}\n\nReturn only the code.")
    assert by_id["pycode/textwrap.TextWrapper.wrap"] == (
        "In a Python class `TextWrapper`, write `def wrap(self, text):` so that it behaves as documented below.\n\n"
        f"{inspect.getdoc(textwrap.TextWrapper.wrap)}\n\nReturn only the code.")
    # private defaulted parameters are left out; a named function default reads as its name
    assert by_id["pycode/json.decoder.JSONDecoder.decode"].startswith(
        "In a Python class `JSONDecoder`, write `def decode(self, s):`")
    assert "copy_function=copy2," in by_id["pycode/shutil.copytree"].split("\n", 1)[0]
    # aliases (PI = ProcessingInstruction, FTP.debug = set_debuglevel), imported names and private names are not
    # prompts of their own
    assert "pycode/xml.etree.ElementTree.ProcessingInstruction" in by_id
    assert "pycode/xml.etree.ElementTree.PI" not in by_id
    assert "pycode/ftplib.FTP.set_debuglevel" in by_id and "pycode/ftplib.FTP.debug" not in by_id
    assert "pycode/posixpath.commonprefix" not in by_id  # genericpath's
    assert not any(part.startswith("_") for i in by_id for part in i.removeprefix("pycode/").split("."))


def test_pycode_is_deterministic_across_processes_and_hash_seeds(prompts):
    assert td.load_pycode() == prompts
    # torch replaces inspect.getfile with its own function on import (one prompt fewer), so the other process
    # imports it too, as the trainer and this test session (conftest) do
    code = ("import json, torch; from specpilot.train import data as td; "
            "print(json.dumps([[p.id, p.messages[0]['content']] for p in td.load_pycode()]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=REPO).stdout
    assert json.loads(out) == [[p.id, p.messages[0]["content"]] for p in prompts]


def test_pycode_docstrings_deduplicated_long_ones_cut_and_bad_modules_skipped():
    few = td.load_pycode(("textwrap", "no_such_module_for_pycode"))
    assert few and all(p.id.startswith("pycode/textwrap.") for p in few)
    # ntpath.splitext and posixpath.splitext share a docstring: only the first (by id) is kept
    paths = {p.id for p in td.load_pycode(("posixpath", "ntpath"))}
    assert "pycode/ntpath.splitext" in paths and "pycode/posixpath.splitext" not in paths
    assert "pycode/posixpath.splitext" in {p.id for p in td.load_pycode(("posixpath",))}
    cut = td.load_pycode(("textwrap",), max_chars=300)
    assert cut and all(len(p.messages[0]["content"]) <= 300 for p in cut)
    dedent = next(p for p in cut if p.id == "pycode/textwrap.dedent").messages[0]["content"]
    assert dedent.endswith("Return only the code.") and "Remove any common leading whitespace" in dedent
    assert "Entirely blank lines" not in dedent  # the docstring's tail was cut, at a line end
    doc = dedent.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
    full = inspect.getdoc(textwrap.dedent)
    assert full.startswith(doc) and full[len(doc)] == "\n"


def test_pycode_weights_and_splits():
    assert td.parse_weights("pycode") == {"pycode": 1.0}
    assert td.parse_weights("sharegpt=0.5,pycode=0.5") == {"sharegpt": 0.5, "pycode": 0.5}
    with pytest.raises(DatasetError, match="unknown training data source 'pycodes'"):
        td.parse_weights("pycodes=1")
    logs = []
    tr, va = td.build_prompt_splits("pycode=1", 200, 10, seed=3, log=logs.append)
    assert len(tr) == 200 and len(va) == 10
    assert {p.source for p in tr + va} == {"pycode"}
    assert not {p.id for p in tr} & {p.id for p in va}
    assert any(m.startswith("pycode: ") for m in logs)
    assert td.build_prompt_splits("pycode=1", 200, 10, seed=3) == (tr, va)
    full_tr, full_va = td.hash_split(td.load_pycode())
    assert full_va and full_tr and {p.id for p in va} <= {p.id for p in full_va}
