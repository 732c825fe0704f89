"""Per-program timelines of the fused one-token step's kernels: a diagnostic, off unless a script turns it on.

Why: under PDL the kernels of a graphed step overlap (each one's programs launch early and sit in their wait), so a
profiler's per-kernel spans no longer add up to the step (BENCHMARKS.md, session 26: gaps of -410 us in all), and
what is left of the 1.5B step over its floor (~18 us a layer) cannot be split between the kernel boundaries, the
attention's chain and the GEMVs' ramps and tails by timing whole steps. With the switch on, each program of the
traced kernels (the one-row GEMVs, qkv + RoPE, the one-token attention) writes one row when it ends:

  [start, waited, looped, end, sm, tag, clock_waited, clock_end, summed]

start / waited / looped / end: the GPU's global nanosecond timer (%globaltimer, one clock for every SM) at the
program's first instruction, right after its PDL wait, after its main loop (where the late trigger sits) and at its
end; sm: %smid; tag: what the program did (kernel-specific: the attention's 0 = exited early, 1 = a partial, 2 = a
partial and the merge); summed: the attention's working programs' time when their slice's sums were done, before
the partial's stores and the arrival atomic (splits its publish; the GEMVs write `looped` there); clock_*: the SM's cycle counter (%clock64) at the wait and at the end, for programs' own
durations where the global timer is coarse. So `scripts/gpu_step_trace.py` can say, per layer, when each kernel's
programs passed their wait after the one ahead ended (a boundary's cost), how long they then ran, and where a tail
of late programs held the next kernel back.

How: every traced launch takes its own region of MAX_PROGRAMS rows of one device buffer (`launch_args` at launch
time, in launch order, so a CUDA graph captured with the switch on keeps the regions it was captured with); programs
past MAX_PROGRAMS write nothing. The kernels get TRACE and the region's pointer as two
launch arguments; with TRACE false (the default) nothing of it is compiled, so the untraced kernels are the same
code. GPU only: the interpreter cannot run inline asm, so `enable` refuses there. The rows hold times, never values
the step computes: tracing cannot change a token, only add ~10 instructions and one 72-byte row a program.
"""

from __future__ import annotations

import os

import torch

from specpilot.kernels.scratch import DeviceBuffers

MAX_PROGRAMS = 65536  # rows a launch's region holds (an LM head of 4-row tiles: 38k programs at Qwen's vocab)
FIELDS = ("start", "waited", "looped", "end", "sm", "tag", "clock_waited", "clock_end", "summed")
ROW = len(FIELDS)

_buf: torch.Tensor | None = None  # [launches, MAX_PROGRAMS, ROW] int64 while on
_launches: list[str] = []  # the name of each region handed out, in launch order
_on = False
_DUMMIES = DeviceBuffers("kernels/trace.py's untraced tr_ptr", torch.int64)  # one element a device


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def enabled() -> bool:
    return _on


def enable(device, launches: int = 256) -> None:
    """Trace every later launch of the traced kernels on CUDA `device` into a fresh buffer of `launches` regions
    (each launch, graph capture's included, takes the next one; past the last they wrap around, so the last
    `launches` launches keep theirs: 256 x 65536 rows x 72 bytes = 1.1 GiB of device memory)."""
    global _buf, _on
    if _interpreting():
        raise RuntimeError("kernels/trace.py: the Triton interpreter cannot run the timer reads (inline asm)")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernels/trace.py traces CUDA kernels, got device {device}")
    if launches < 1:
        raise ValueError(f"kernels/trace.py: launches must be >= 1, got {launches}")
    _buf = torch.zeros(launches, MAX_PROGRAMS, ROW, dtype=torch.int64, device=device)
    _launches.clear()
    _on = True


def disable() -> None:
    """Stop tracing later launches (a graph captured while on keeps writing its regions: keep the buffer)."""
    global _on
    _on = False


def launch_args(device: torch.device, name, *name_args) -> dict:
    """The trace arguments of one launch on `device`: {"TRACE": True, "tr_ptr": its region} while on, else
    {"TRACE": False, "tr_ptr": a one-element dummy of the device} (never read). `name`: the launch's name in the
    trace, a string or a function of `name_args` giving it (called only while on: nothing is formatted per untraced
    launch). The pointer is passed either way, so Triton's autotuning key (which counts the dtypes of a launch's
    tensor arguments) is the same traced and untraced: a traced step reuses the untraced step's tuned tiles."""
    if not _on:  # (made on the first, eager launch: kernels/scratch.py refuses to allocate during capture)
        return {"TRACE": False, "tr_ptr": _DUMMIES.at_least(device, 1)}
    i = len(_launches) % _buf.shape[0]
    _launches.append(name(*name_args) if callable(name) else str(name))
    return {"TRACE": True, "tr_ptr": _buf[i]}


def clear() -> None:
    """Zero every region (before the replay to be read: rows left by earlier launches would mix in)."""
    if _buf is not None:
        _buf.zero_()


def read() -> list[dict]:
    """-> one entry per region a launch wrote since the last `clear`, in launch order: {"index", "name",
    "rows": [[start, waited, looped, end, sm, tag, clock_waited, clock_end, summed], ...] (its programs in program order)}.
    Regions handed out more than `launches` launches ago were overwritten (wrap-around) and are not returned."""
    if _buf is None:
        return []
    written = _buf[:, :, 3] != 0  # [launches, MAX_PROGRAMS]: a program that ran wrote its end time (never 0)
    used = written.any(dim=1).tolist()
    n, cap = len(_launches), _buf.shape[0]
    out = []
    for index in range(max(0, n - cap), n):
        r = index % cap
        if used[r]:
            out.append({"index": index, "name": _launches[index], "rows": _buf[r][written[r]].tolist()})
    return out


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing to trace
    triton = None

if triton is not None:
    MAX_PROGRAMS_C = tl.constexpr(MAX_PROGRAMS)
    ROW_C = tl.constexpr(ROW)

    @triton.jit
    def now():
        """The global nanosecond timer (%globaltimer), one value for the program."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def cycles():
        """The SM's cycle counter (%clock64)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def sm_id():
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def record(tr_ptr, pid, t_start, t_waited, t_looped, c_waited, tag, t_summed):
        """Program `pid`'s row of its launch's region (see the module docstring); nothing past MAX_PROGRAMS."""
        t_end = now()
        c_end = cycles()
        if pid < MAX_PROGRAMS_C:
            row = tr_ptr + pid.to(tl.int64) * ROW_C
            tl.store(row, t_start)
            tl.store(row + 1, t_waited)
            tl.store(row + 2, t_looped)
            tl.store(row + 4, sm_id().to(tl.int64))
            tl.store(row + 5, tl.full([], 0, tl.int64) + tag)
            tl.store(row + 6, c_waited)
            tl.store(row + 7, c_end)
            tl.store(row + 8, t_summed)
            tl.store(row + 3, t_end)
