"""Training sequences whose responses the target wrote itself, so the drafter learns the target's distribution.

Each prompt goes through the target's chat template (`Tokenizer.encode_chat`), then greedy batched AR
(`engine.batch.generate_batch`) writes the response. Results land in a shard cache, a folder of JSONL files
(`shard-NNNNN.jsonl`, one record per prompt: `{"id", "prompt_ids", "response_ids"}`), each shard written
atomically (temp file + rename) after its batch, so a command killed or stopped by a deadline loses at most
the batch in flight and a later command resumes where it stopped. `meta.json` fingerprints what the responses
depend on (target, generation length, chat template); a cache made under other settings is refused, not mixed.
Prompts whose templated ids exceed `max_prompt_tokens` are recorded as skipped (`response_ids: null`), so they
are not retried.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from specpilot.engine.batch import generate_batch
from specpilot.errors import ConfigError

META = "meta.json"


@dataclass(frozen=True)
class Sequence:
    id: str
    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def read_cache(folder: str | Path) -> dict[str, dict]:
    """id -> record of every complete line in the cache's shards (a torn last line is ignored)."""
    out: dict[str, dict] = {}
    for shard in sorted(Path(folder).glob("shard-*.jsonl")):
        with open(shard, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and "id" in rec:
                    out[rec["id"]] = rec
    return out


def _write_shard(folder: Path, records: list[dict]) -> Path:
    n = len(list(folder.glob("shard-*.jsonl")))
    pid = os.getpid()  # processes sharing the folder (--regen-shard) never pick the same name
    while (folder / f"shard-{pid}-{n:05d}.jsonl").exists():
        n += 1
    path = folder / f"shard-{pid}-{n:05d}.jsonl"
    tmp = folder / f".{path.name}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def fingerprint(target_name: str, tokenizer, max_new_tokens: int, max_prompt_tokens: int) -> dict:
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None) or ""
    return {
        "target": str(target_name),
        "max_new_tokens": int(max_new_tokens),
        "max_prompt_tokens": int(max_prompt_tokens),
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest()[:16],
    }


def _check_meta(folder: Path, meta: dict) -> None:
    path = folder / META
    if path.exists():
        old = json.loads(path.read_text())
        if old != meta:
            diff = {k: (old.get(k), meta.get(k)) for k in set(old) | set(meta) if old.get(k) != meta.get(k)}
            raise ConfigError(f"regeneration cache {folder} was made with other settings {diff} (old, new); "
                              "use another folder or delete it")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2) + "\n")


ORDERS = ("short", "long", "random")
ORDER_WINDOW_BATCHES = 8  # "random": prompts are sorted by length inside windows of this many batches


def regen_order(encoded: list, order: str, seed: int = 0, *, window: int = 2048) -> list:
    """The order in which pending (prompt, token ids) pairs are regenerated; batches are cut from it in turn.

    Why: a time budget stops regeneration part-way, so the order decides WHICH prompts a run gets. Shortest-first
    (the least padding) hands every budget-limited run the same shortest prompts: session 17 (one GPU, 170 s)
    regenerated the 9k shortest of 39k prompts, all inside what the warm start had already been trained on, and its
    validation tau did not move. "long" takes the longest first (what earlier shortest-first runs never reached);
    "random" draws a seeded random order and sorts it by length only inside windows of `window` prompts, so the
    batches stay of similar length (little padding) while different seeds reach different prompts."""
    if order not in ORDERS:
        raise ConfigError(f"regeneration order must be one of {', '.join(ORDERS)}, got {order!r}")
    by_len = lambda x: len(x[1])  # noqa: E731
    if order != "random":
        return sorted(encoded, key=by_len, reverse=order == "long")
    shuffled = list(encoded)
    random.Random(seed).shuffle(shuffled)
    return [x for i in range(0, len(shuffled), max(1, window)) for x in sorted(shuffled[i:i + window], key=by_len)]


def regenerate(target, tokenizer, prompts: Iterable, folder: str | Path, *, max_new_tokens: int,
               batch_size: int = 64, max_prompt_tokens: int = 1024, eos_ids: Iterable[int] | None = None,
               target_name: str = "", deadline: float | None = None, order: str = "short", order_seed: int = 0,
               kv_bucket: int | None = None, log: Callable[[str], None] | None = None) -> tuple[list[Sequence], int]:
    """Responses of `target` to `prompts` (objects with `.id` and `.messages`), cached in `folder`.

    `order` says which pending prompts go first (it matters when a `deadline` cuts the work short; see
    `regen_order`): "short" (shortest first), "long" (longest first) or "random" (drawn by `order_seed`).

    -> (sequences of the prompts done, in prompt order, skipped ones left out; number of prompts still pending
    because the `deadline` (time.monotonic() seconds) came first: 0 when all are done)."""
    log = log or (lambda m: None)
    folder = Path(folder)
    _check_meta(folder, fingerprint(target_name, tokenizer, max_new_tokens, max_prompt_tokens))
    prompts = list(prompts)
    done = read_cache(folder)
    pending = [p for p in prompts if p.id not in done]
    if eos_ids is None:
        eos_ids = set(target.config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(tokenizer.eos_token_id)
    if pending:
        log(f"regenerating {len(pending)} responses ({len(prompts) - len(pending)} cached) in {folder}")
        encoded, skipped = [], []
        for p in pending:
            ids = tokenizer.encode_chat(list(p.messages))
            (encoded if len(ids) <= max_prompt_tokens else skipped).append((p, ids))
        if skipped:
            _write_shard(folder, [{"id": p.id, "prompt_ids": ids, "response_ids": None} for p, ids in skipped])
            for p, ids in skipped:
                done[p.id] = {"id": p.id, "prompt_ids": ids, "response_ids": None}
        encoded = regen_order(encoded, order, order_seed, window=batch_size * ORDER_WINDOW_BATCHES)
        t0, n_tok = time.monotonic(), 0

        def save(idx, outs):
            nonlocal n_tok
            recs = [{"id": encoded[i][0].id, "prompt_ids": encoded[i][1], "response_ids": o} for i, o in zip(idx, outs)]
            _write_shard(folder, recs)
            for r in recs:
                done[r["id"]] = r
            n_tok += sum(len(o) for o in outs)
            n_done = sum(1 for p, _ in encoded if p.id in done)
            log(f"regenerated {n_done}/{len(encoded)} ({n_tok / max(time.monotonic() - t0, 1e-9):.0f} tok/s)")

        # one generate_batch call for all (sorted here, so it keeps the order): its KV pool and decode graphs serve
        # every batch; each batch is saved as it finishes
        generate_batch(target, [ids for _, ids in encoded], max_new_tokens, eos_ids, batch_size,
                       sort_by_length=False, deadline=deadline, on_batch=save, kv_bucket=kv_bucket)
    seqs = []
    for p in prompts:
        rec = done.get(p.id)
        if rec is not None and rec.get("response_ids"):
            prompt_ids = rec.get("prompt_ids")  # None in a packed cache (`pack`): the same template re-encodes it
            prompt_ids = tokenizer.encode_chat(list(p.messages)) if prompt_ids is None else prompt_ids
            seqs.append(Sequence(p.id, list(prompt_ids), list(rec["response_ids"])))
    remaining = sum(1 for p in prompts if p.id not in done)
    return seqs, remaining


# --- carrying a cache between machines ------------------------------------------------------------------------
# The GPU machine keeps nothing between sessions and each one regenerated the same ~30k responses again (240 s of
# two GPUs). The responses alone (no prompt ids: the fingerprinted chat template re-encodes them), gzipped, come
# back in a few files under the transfer limit and seed the next session's cache.


def pack(folder: str | Path, out_prefix: str | Path, max_part_bytes: int = 14 << 20) -> list[Path]:
    """Write the cache's meta and responses as gzipped JSONL parts `<out_prefix>.NN.jsonl.gz` (each under
    `max_part_bytes`); -> the parts. Prompts recorded as skipped are kept (so they are not retried)."""
    import gzip

    folder, out_prefix = Path(folder), Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    meta = json.loads((folder / META).read_text())
    recs = sorted(read_cache(folder).values(), key=lambda r: r["id"])
    parts, buf, size = [], [], 0

    def flush():
        path = out_prefix.with_name(f"{out_prefix.name}.{len(parts):02d}.jsonl.gz")
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(json.dumps({"meta": meta}) + "\n")
            fh.writelines(buf)
        parts.append(path)

    for r in recs:
        line = json.dumps({"id": r["id"], "response_ids": r["response_ids"]}, separators=(",", ":")) + "\n"
        # token ids as JSON gzip ~2.3:1 (Zipf-distributed ids, measured on CPU): 2:1 keeps parts under the limit
        if buf and size + len(line) // 2 > max_part_bytes:
            flush()
            buf, size = [], 0
        buf.append(line)
        size += len(line) // 2
    if buf or not parts:
        flush()
    return parts


def unpack(parts: Iterable[str | Path], folder: str | Path) -> int:
    """Seed cache `folder` from `pack` parts (meta checked like any cache); -> records added."""
    import gzip

    folder, n = Path(folder), 0
    for part in sorted(Path(x) for x in parts):
        with gzip.open(part, "rt", encoding="utf-8") as fh:
            meta = json.loads(fh.readline())["meta"]
            _check_meta(folder, meta)
            recs = [json.loads(line) for line in fh]
        for r in recs:
            r["prompt_ids"] = None
        _write_shard(folder, recs)
        n += len(recs)
    return n
