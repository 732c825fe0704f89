"""engine/graphs.py `capture`: no cyclic garbage collection while a graph records (CPU, with torch's CUDA graph
calls replaced by stand-ins that note when a capture is open)."""

from __future__ import annotations

import gc

import pytest
import torch

from specpilot.engine import graphs


class _Stream:
    def wait_stream(self, other):
        pass


class _Open:
    """A stand-in for torch.cuda.graph(...) / torch.cuda.stream(...): `state["capturing"]` while a graph records."""

    def __init__(self, state, capturing):
        self.state, self.capturing = state, capturing

    def __enter__(self):
        self.state["capturing"] = self.capturing

    def __exit__(self, *exc):
        self.state["capturing"] = False


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"capturing": False}
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _Open(state, False))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, capture_error_mode="global": _Open(state, True))
    return state


@pytest.fixture
def eager_gc():
    """The cyclic collector on and eager (a collection every allocation), as it was after the test."""
    was, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    gc.set_threshold(1, 1, 1)
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if was else gc.disable)()


class _Graphish:
    """Stands for an old engine's CUDA graph held in a reference cycle: records whether a capture was open when it
    was destroyed (a real graph's destruction there invalidates the capture)."""

    def __init__(self, state, log):
        self.state, self.log, self.me = state, log, self

    def __del__(self):
        self.log.append(self.state["capturing"])


def test_no_collection_destroys_a_graph_in_the_middle_of_a_capture(fake_cuda, eager_gc):
    """A cycle that becomes garbage during the capture is finalized only after it, while the warm-ups (outside any
    capture) collect as usual. Without the guard the eager collector finalizes it inside the capture."""
    log, seen = [], []

    def step():
        seen.append((fake_cuda["capturing"], gc.isenabled()))
        _Graphish(fake_cuda, log)  # unreachable at once: only the cyclic collector can free it
        for _ in range(50):  # allocations that trigger collections while the collector is on
            [[]]
        return "out"

    g, out = graphs.capture(step, warmup=2)
    assert out == "out"
    assert seen == [(False, True), (False, True), (True, False)]
    gc.collect()
    assert log == [False, False, False]  # three finalized, none while the capture was open
    assert gc.isenabled()


def test_a_failed_capture_turns_the_collector_back_on_and_keeps_the_graph(fake_cuda, eager_gc):
    calls = []

    def step():
        calls.append(fake_cuda["capturing"])
        if fake_cuda["capturing"]:
            raise RuntimeError("operation failed due to a previous error during capture")

    before = len(graphs._FAILED)
    with pytest.raises(RuntimeError, match="during capture"):
        graphs.capture(step, warmup=1)
    assert calls == [False, True] and gc.isenabled()
    assert len(graphs._FAILED) == before + 1  # kept alive: the allocator's callback still points at it
    graphs._FAILED.pop()


def test_a_collector_that_was_off_stays_off(fake_cuda):
    was = gc.isenabled()
    gc.disable()
    try:
        graphs.capture(lambda: None, warmup=1)
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
