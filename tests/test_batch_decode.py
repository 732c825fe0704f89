"""Batched greedy decode (engine/batch.py): the kv bucket and batch bucket rules, and batched outputs equal to
batch-1 AR with steps attending over bucketed prefixes of one KV pool shared by every chunk (stale K/V of earlier
chunks above each row's position), across bucket boundaries and compactions; the per-(rows, bucket) graph cache
driven on CPU through a fake graph that runs the same step eagerly (tiny random Qwen3, CPU)."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.engine import Engine
from specpilot.engine import batch as eb
from specpilot.engine.batch import batch_bucket, generate_batch, kv_bucket_len
from specpilot.errors import ConfigError
from specpilot.models import load_model

N = 24  # new tokens: rows cross several 4- and 8-slot buckets


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(tiny_model_dir("qwen3"))


@pytest.fixture(scope="module")
def cases(target):
    """(prompts of varied lengths, batch-1 AR outputs without EOS, an EOS that ends most rows early, the outputs
    cut at it)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(9)]
    ar = Engine(target, EngineConfig(drafter_kind="none", max_new_tokens=N, max_seq_len=64, ignore_eos=True))
    ref = [ar.generate(p).output_ids for p in prompts]
    eos = max(range(96), key=lambda t: sum(t in r[2:12] for r in ref))
    cut = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    assert sum(len(c) < N for c in cut) >= 4  # enough rows end early for compactions
    return prompts, ref, eos, cut


@pytest.mark.parametrize("need, bucket, pool, want", [
    (1, 128, 1000, 128), (128, 128, 1000, 128), (129, 128, 1000, 256), (999, 128, 1000, 1000),
    (5, 1, 1000, 5), (5, 0, 1000, 1000), (7, 4, 9, 8), (9, 4, 9, 9), (300, 256, 685, 512)])
def test_kv_bucket_len(need, bucket, pool, want):
    assert kv_bucket_len(need, bucket, pool) == want


def test_kv_bucket_len_refuses_positions_outside_the_pool():
    for need in (0, 11):
        with pytest.raises(ValueError):
            kv_bucket_len(need, 4, 10)


def test_batch_bucket_is_the_next_power_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 100, 128, 129)] == [1, 2, 4, 4, 8, 128, 128, 256]


@pytest.mark.parametrize("kv_bucket", [1, 4, 8, 0])
def test_bucketed_eager_steps_equal_batch1_ar(target, cases, kv_bucket):
    """Steps over a bucketed prefix (4, 8), exactly the written slots (1) or the whole pool (0) give batch-1 AR's
    tokens, with and without EOS (compaction), chunks of 4 sharing the pool."""
    prompts, ref, eos, cut = cases
    assert generate_batch(target, prompts, N, [], 4, kv_bucket=kv_bucket) == ref
    assert generate_batch(target, prompts, N, [eos], 4, kv_bucket=kv_bucket) == cut
    assert generate_batch(target, prompts, N, [eos], 9, kv_bucket=kv_bucket) == cut  # one chunk, 8 -> 4 -> 2 ...


def test_stale_pool_slots_stay_hidden(target, cases, monkeypatch):
    """The pool is shared by chunks and never cleared: fill it with huge values first; outputs are unchanged
    because every slot a row reads below its position was written by the row itself."""
    prompts, ref, eos, cut = cases
    real = target.new_cache

    def dirty(*a, **k):
        cache = real(*a, **k)
        cache.k.fill_(1e4)
        cache.v.normal_(0, 1e3)
        return cache

    monkeypatch.setattr(target, "new_cache", dirty)
    assert generate_batch(target, prompts, N, [eos], 4, kv_bucket=8) == cut


class _FakeGraph:
    """Stands in for _GraphedStep on CPU: records each capture's (rows, kv_len) and runs the step eagerly at
    that kv_len on the cache it was 'captured' on (as a graph replays on the addresses it recorded)."""

    captured: list = []

    def __init__(self, model, cache, kv_len, mempool, warmup):
        self.model, self.cache, self.kv_len = model, cache, kv_len
        _FakeGraph.captured.append((cache.batch_size, kv_len))

    def __call__(self, tok, pos):
        return self.model.logits(self.model(tok[:, None], pos[:, None], self.cache, kv_len=self.kv_len))[:, 0].argmax(-1)


def test_graph_per_rows_and_bucket_captured_once_and_reused(target, cases, monkeypatch):
    prompts, ref, eos, cut = cases
    monkeypatch.setattr(eb, "_can_graph", lambda model: True)
    monkeypatch.setattr(eb, "_new_mempool", lambda: None)
    monkeypatch.setattr(eb, "_GraphedStep", _FakeGraph)
    _FakeGraph.captured = []
    assert generate_batch(target, prompts, N, [eos], 4, kv_bucket=8) == cut
    keys = _FakeGraph.captured
    assert len(keys) == len(set(keys))  # each (rows, bucket) captured once for the whole call
    pool = max(map(len, prompts)) + N + 1
    assert all(kv % 8 == 0 or kv == pool for _, kv in keys)  # buckets, or the pool's end
    assert {n for n, _ in keys} >= {4, 2}  # compaction to powers of two
    assert len({kv for n, kv in keys if n == 4}) >= 3  # the full batch crossed bucket boundaries
    steps_run = len(prompts) // 4 * N  # far more steps than captures: later chunks reuse the graphs
    assert len(keys) < steps_run // 4
    _FakeGraph.captured = []
    assert generate_batch(target, prompts, N, [], 4) == ref  # kv_bucket None: DEFAULT_KV_BUCKET when graphed
    assert {kv for _, kv in _FakeGraph.captured} == {min(pool, eb.DEFAULT_KV_BUCKET)}


def test_failed_capture_runs_that_step_eagerly(target, cases, monkeypatch):
    prompts, ref, _, _ = cases

    class Failing(_FakeGraph):
        def __init__(self, model, cache, kv_len, mempool, warmup):
            if kv_len == 16:
                raise RuntimeError("capture failed")
            super().__init__(model, cache, kv_len, mempool, warmup)

    pools = []
    monkeypatch.setattr(eb, "_can_graph", lambda model: True)
    monkeypatch.setattr(eb, "_new_mempool", lambda: pools.append(object()) or pools[-1])
    monkeypatch.setattr(eb, "_GraphedStep", Failing)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert generate_batch(target, prompts, N, [], 4, kv_bucket=8) == ref
    assert len(pools) == 2  # a fresh memory pool after the failure


def test_kv_bucket_must_not_be_negative(target):
    with pytest.raises(ConfigError):
        generate_batch(target, [[1, 2]], 4, [], 1, kv_bucket=-1)
