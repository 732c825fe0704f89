"""Grow-only per-device scratch buffers shared by every launch of a kernel (arrival counters, split partials).

Why: kernels whose last-arriving program merges the others' partials (decode_attention.py's one-launch path,
gemm_rows.py's split-K) need counters that start at zero and a place for the partials. Allocating them per call
would put an allocation and a memset into every CUDA graph (more launches); so there is one buffer per device,
shared by every call (every layer). That is safe because launches on one stream run in order and each launch's
merging programs reset their counters to zero before it ends; two streams of one device must NOT run such kernels
concurrently. A buffer grows only eagerly (the engine runs a step eagerly before capturing it); an outgrown one is
kept alive, since a graph captured earlier may still use it.
"""

from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeviceBuffers(dict):
    """device -> one zero-initialised buffer of `dtype`, grown on demand (`at_least`); `what` names it in errors."""

    def __init__(self, what: str, dtype: torch.dtype):
        super().__init__()
        self.what, self.dtype = what, dtype
        self.retired: list[torch.Tensor] = []  # outgrown buffers: a graph captured earlier may still use one

    def at_least(self, device: torch.device, n: int) -> torch.Tensor:
        """The device's buffer, with >= n elements (all zero when new)."""
        buf = self.get(device)
        if buf is None or buf.numel() < n:
            if capturing(device):
                raise RuntimeError(f"{self.what}: needs {n} on {device} but has {0 if buf is None else buf.numel()}, "
                                   "and cannot allocate them during CUDA graph capture: run the same shapes once "
                                   "eagerly before capturing")
            if buf is not None:
                self.retired.append(buf)
                n = max(n, buf.numel())
            buf = self[device] = torch.zeros(n, dtype=self.dtype, device=device)
        return buf
