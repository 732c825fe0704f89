"""Benchmark prompt loading: counts, selection, custom files and user errors (fast, CPU only)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from specpilot.errors import DatasetError
from specpilot.evaluator import datasets as ds
from specpilot.evaluator.datasets import (
    BENCHMARKS, Prompt, dataset_dir, load_prompt_file, load_prompts,
)

SPEC_BENCH_CATEGORIES = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
COUNTS = {"mbpp": 500, "gsm8k": 1319, "mt_bench": 80, "spec_bench": 480,
          "aime2024": 30, "aime2025": 30}


@pytest.fixture(scope="module")
def shared() -> Path:
    try:
        return dataset_dir()
    except DatasetError as exc:
        pytest.skip(f"shared datasets folder absent (expected at ../shared/datasets or "
                    f"$SPECPILOT_DATASETS): {exc}")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _check_prompts(prompts: list[Prompt], benchmark: str) -> None:
    assert len({p.id for p in prompts}) == len(prompts), "prompt ids must be unique"
    for p in prompts:
        assert p.benchmark == benchmark and p.id.startswith(f"{benchmark}/")
        assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip()


# --- the built-in benchmarks -------------------------------------------------------------

def test_benchmark_names():
    assert BENCHMARKS == ("humaneval", "mbpp", "gsm8k", "mt_bench", "spec_bench",
                          "aime2024", "aime2025")


def test_humaneval_comes_from_the_package():
    prompts = load_prompts("humaneval", dataset_dir="/nonexistent")  # needs no datasets folder
    assert len(prompts) == 164
    _check_prompts(prompts, "humaneval")
    assert prompts[0].id == "humaneval/HumanEval/0" and prompts[0].category == "humaneval"
    text = prompts[0].messages[0]["content"]
    assert "```python\n" in text and "def has_close_elements" in text


@pytest.mark.parametrize("name", sorted(COUNTS))  # not "benchmark": pytest-benchmark owns it
def test_benchmark_counts(shared, name):
    prompts = load_prompts(name, dataset_dir=shared)
    assert len(prompts) == COUNTS[name]
    _check_prompts(prompts, name)


def test_mbpp_is_the_test_split_with_its_asserts(shared):
    prompts = load_prompts("mbpp", dataset_dir=shared)
    assert [p.id for p in prompts] == [f"mbpp/{i}" for i in range(11, 511)]
    rec = next(r for r in _jsonl(shared / "mbpp/mbpp.jsonl") if r["task_id"] == 11)
    text = prompts[0].messages[0]["content"]
    assert rec["text"] in text and all(t in text for t in rec["test_list"])
    assert rec["code"] not in text  # the reference solution never leaks


def test_gsm8k_prompt_has_question_not_answer(shared):
    rec = _jsonl(shared / "gsm8k/test.jsonl")[0]
    p = load_prompts("gsm8k", dataset_dir=shared, num_prompts=1)[0]
    text = p.messages[0]["content"]
    assert p.id == "gsm8k/0" and text.startswith(rec["question"])
    assert "step by step" in text and rec["answer"] not in text


def test_aime_prompt_is_the_problem(shared):
    for bench in ("aime2024", "aime2025"):
        rec = _jsonl(shared / bench / "test.jsonl")[0]
        p = load_prompts(bench, dataset_dir=shared)[0]
        assert p.id == f"{bench}/{rec['id']}" and p.messages[0]["content"].startswith(rec["problem"])
        assert rec.get("solution", "@@none@@") not in p.messages[0]["content"]


def test_mt_bench_first_turn_and_categories(shared):
    recs = _jsonl(shared / "mt_bench/question.jsonl")
    prompts = load_prompts("mt_bench", dataset_dir=shared)
    assert [p.messages for p in prompts] == [({"role": "user", "content": r["turns"][0]},) for r in recs]
    assert Counter(p.category for p in prompts) == Counter(r["category"] for r in recs)
    assert len({p.category for p in prompts}) == 8


def test_spec_bench_categories(shared):
    prompts = load_prompts("spec_bench", dataset_dir=shared)
    assert Counter(p.category for p in prompts) == {c: 80 for c in SPEC_BENCH_CATEGORIES}
    recs = _jsonl(shared / "spec_bench/question.jsonl")
    assert all(p.messages[0]["content"] == r["turns"][0] for p, r in zip(prompts, recs))


@pytest.mark.parametrize("n", [6, 12, 13, 100])
def test_spec_bench_balanced_selection(shared, n):
    everything = load_prompts("spec_bench", dataset_dir=shared)
    chosen = load_prompts("spec_bench", dataset_dir=shared, num_prompts=n)
    assert len(chosen) == n
    counts = Counter(p.category for p in chosen)
    assert set(counts) == SPEC_BENCH_CATEGORIES
    assert max(counts.values()) - min(counts.values()) <= 1
    order = {p.id: i for i, p in enumerate(everything)}
    assert [order[p.id] for p in chosen] == sorted(order[p.id] for p in chosen)  # file order
    by_cat = {c: [p.id for p in everything if p.category == c] for c in counts}
    for c, k in counts.items():  # the first k of each category, in file order
        assert [p.id for p in chosen if p.category == c] == by_cat[c][:k]


def test_first_n_in_file_order_is_stable_and_seed_free(shared):
    full = load_prompts("gsm8k", dataset_dir=shared)
    first = load_prompts("gsm8k", dataset_dir=shared, num_prompts=5)
    assert first == full[:5] == load_prompts("gsm8k", dataset_dir=shared, num_prompts=5, seed=7)
    assert [p.id for p in first] == [f"gsm8k/{i}" for i in range(5)]
    assert load_prompts("aime2025", dataset_dir=shared, num_prompts=1000) == \
        load_prompts("aime2025", dataset_dir=shared)


# --- dataset_dir ------------------------------------------------------------------------------

def test_dataset_dir_explicit_and_env(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setenv("SPECPILOT_DATASETS", str(tmp_path / "b"))
    assert dataset_dir(tmp_path / "a") == (tmp_path / "a").resolve()
    assert dataset_dir() == (tmp_path / "b").resolve()
    monkeypatch.setenv("SPECPILOT_DATASETS", str(tmp_path / "missing"))
    with pytest.raises(DatasetError, match="SPECPILOT_DATASETS"):
        dataset_dir()
    with pytest.raises(DatasetError, match="does not exist"):
        dataset_dir(tmp_path / "missing")


def test_dataset_dir_search_order(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECPILOT_DATASETS", raising=False)
    repo = tmp_path / "clone"
    repo.mkdir()
    monkeypatch.setattr(ds, "__file__", str(repo / "specpilot/evaluator/datasets.py"))
    cwd = tmp_path / "elsewhere" / "work"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    with pytest.raises(DatasetError, match="SPECPILOT_DATASETS"):
        dataset_dir()
    (tmp_path / "shared/datasets").mkdir(parents=True)  # ../shared/datasets of the repo root
    assert dataset_dir() == (tmp_path / "shared/datasets").resolve()
    (tmp_path / "elsewhere/shared/datasets").mkdir(parents=True)  # ../shared/datasets of cwd
    assert dataset_dir() == (tmp_path / "elsewhere/shared/datasets").resolve()
    (cwd / "shared/datasets").mkdir(parents=True)  # ./shared/datasets wins
    assert dataset_dir() == (cwd / "shared/datasets").resolve()


def test_missing_benchmark_file_names_the_path(tmp_path):
    with pytest.raises(DatasetError, match=r"gsm8k data file .*gsm8k[/\\]test.jsonl"):
        load_prompts("gsm8k", dataset_dir=tmp_path)


# --- custom prompt files -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["p.jsonl", "p.json"])
def test_prompt_file_that_is_a_folder_or_binary_says_so(tmp_path, name):
    """Were "does not exist" for a folder and a UnicodeDecodeError traceback for a binary file."""
    folder = tmp_path / "dir"
    folder.mkdir()
    with pytest.raises(DatasetError, match="is a folder: pass a JSON or JSONL file"):
        load_prompt_file(folder, "prompt")
    binary = tmp_path / name
    binary.write_bytes(b"\xff\xfe\xfd not text")
    with pytest.raises(DatasetError, match="is not UTF-8 text"):
        load_prompt_file(binary, "prompt")


def _write(path: Path, records, jsonl: bool) -> Path:
    text = "\n".join(json.dumps(r) for r in records) + "\n" if jsonl else json.dumps(records)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("jsonl", [True, False])
def test_custom_file_field_shapes(tmp_path, jsonl):
    records = [
        {"q": "plain text"},
        {"q": ["first turn", "second turn"]},
        {"q": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello"}, {"role": "user", "content": "later"}]},
    ]
    path = _write(tmp_path / ("mine.jsonl" if jsonl else "mine.json"), records, jsonl)
    prompts = load_prompt_file(path, "q")
    assert [p.messages for p in prompts] == [
        ({"role": "user", "content": "plain text"},),
        ({"role": "user", "content": "first turn"},),
        ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}),
    ]
    assert [p.id for p in prompts] == ["mine/0", "mine/1", "mine/2"]
    assert {(p.benchmark, p.category) for p in prompts} == {("mine", "mine")}
    assert load_prompt_file(path, "q", num_prompts=2) == prompts[:2]


BAD_RECORDS = [
    ([{"q": "ok"}, {"other": "x"}], r"record 2.*no field 'q'"),
    ([{"q": "ok"}, {"q": "   "}], r"record 2.*empty"),
    ([{"q": []}], r"record 1.*empty list"),
    ([{"q": 5}], r"record 1.*must be text"),
    (["just a string"], r"record 1.*expected a JSON object"),
    ([{"q": [{"role": "system", "content": "s"}]}], r"record 1.*no 'user' turn"),
    ([{"q": [{"role": "user"}]}], r"record 1.*'role' and 'content'"),
    ([{"q": [{"role": "user", "content": ""}]}], r"record 1.*user message is empty"),
]


@pytest.mark.parametrize("jsonl", [True, False])
@pytest.mark.parametrize("records,message", BAD_RECORDS)
def test_custom_file_bad_records(tmp_path, records, message, jsonl):
    path = _write(tmp_path / ("bad.jsonl" if jsonl else "bad.json"), records, jsonl)
    with pytest.raises(DatasetError, match=message):
        load_prompt_file(path, "q")


def test_custom_file_unparsable_and_missing(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"q": "fine"}\n\n{"q": "unterminated\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"broken.jsonl, line 3: not valid JSON"):
        load_prompt_file(path, "q")
    (tmp_path / "broken.json").write_text('[\n{"q": "a"},\n{"q": }\n]', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"broken.json, line 3: not valid JSON"):
        load_prompt_file(tmp_path / "broken.json", "q")
    (tmp_path / "obj.json").write_text('{"q": "a"}', encoding="utf-8")
    with pytest.raises(DatasetError, match="list of objects"):
        load_prompt_file(tmp_path / "obj.json", "q")
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="holds no prompts"):
        load_prompt_file(tmp_path / "empty.jsonl", "q")
    with pytest.raises(DatasetError, match=r"nope.jsonl does not exist"):
        load_prompt_file(tmp_path / "nope.jsonl", "q")


def test_unknown_benchmark_lists_known_names():
    with pytest.raises(DatasetError, match="unknown benchmark 'humaneva'") as info:
        load_prompts("humaneva")
    assert all(name in str(info.value) for name in BENCHMARKS)


@pytest.mark.parametrize("n", [0, -3, True, 2.5])
def test_bad_num_prompts(tmp_path, n):
    path = _write(tmp_path / "p.jsonl", [{"q": "a"}], jsonl=True)
    with pytest.raises(DatasetError, match="num_prompts must be a positive integer"):
        load_prompts("humaneval", num_prompts=n)
    with pytest.raises(DatasetError, match="num_prompts must be a positive integer"):
        load_prompt_file(path, "q", num_prompts=n)
