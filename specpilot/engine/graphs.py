"""Capturing a CUDA graph, the one way every graphed path here does it.

`capture(fn)` runs `fn` a few times on a side stream first (lazy compilation, cuBLAS/cuDNN kernel choice and
workspace allocation must not happen inside the capture), then records one call into a graph. It returns the
graph and what the recorded call returned: static tensors that every `graph.replay()` refills.

Python's cyclic garbage collector is off while a graph records. Why: torch no longer collects before a capture
(`torch.compiler.config.force_cudagraph_gc`, off by default), so an earlier engine's graphs, held in reference
cycles, could be destroyed by a collection that happens to run mid-capture. Destroying a graph is an API call that
a global-mode capture forbids, and it invalidates the capture. The sign is torch's "operation not permitted when
stream is capturing (function reset)" warnings right before a "cudaErrorStreamCaptureInvalidated" capture
failure. It was seen in processes that build many engines: H200 session 28, and the H100 engine checks of
sessions 40, 47 and 49. It never showed in one engine alone (session 48's probe).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], object], *, warmup: int = 2, pool=None,
            capture_error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, object]:
    """`capture_error_mode` is torch.cuda.graph's ("relaxed" lets unsafe API calls through: a capture that passes
    only there failed on such a call, not on a sync; scripts/gpu_capture_probe.py asks for it)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    try:
        with no_cyclic_gc(), torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
            out = fn()
    except RuntimeError:
        # a failed capture leaves the allocator routing its capture to `pool` through a callback on this graph
        # object: keep the object alive (no dangling callback); never capture into that pool again (the runner
        # takes a fresh one)
        _FAILED.append(graph)
        raise
    return graph, out


_FAILED: list = []  # graphs whose capture failed (see `capture`)


@contextlib.contextmanager
def no_cyclic_gc():
    """Python's cyclic garbage collector off inside (as it was after): no collection, and so no destruction of an
    unreachable CUDA graph, can run in the middle of a capture (module docstring)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def or_eager(build: Callable[[], T], what: str) -> T | None:
    """`build()` (something that captures a graph), or None with a warning when capture fails: the caller then
    runs the same step eagerly — slower, never wrong."""
    try:
        return build()
    except RuntimeError as e:  # capture errors surface as RuntimeError (CUDA / cuBLAS / allocator)
        warnings.warn(f"{what}: CUDA graph capture failed ({e}); running it eagerly", RuntimeWarning)
        return None
