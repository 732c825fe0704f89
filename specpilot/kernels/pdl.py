"""Programmatic dependent launch (PDL) for the fused one-token decode path: one process-wide switch.

Why: a graphed one-token step through models/fused_decode.py is ~6 Triton launches a layer (~180 at 1.5B shapes),
and on the H200 each consecutive pair leaves a ~1.3 us gap (the next grid is only launched once the previous one
has drained), a large share of a ~1.6 ms step. Hopper (sm_90+) can launch kernel N+1 while kernel N still runs:
N+1 is launched with the PDL attribute (Triton: the `launch_pdl=True` launch keyword), its programs start early
and block in `griddepcontrol.wait` (`gdc_wait()`) until N has completed and N's writes are visible; N may let its
dependents launch early with `griddepcontrol.launch_dependents` (`gdc_launch_dependents()`). Both instructions are
no-ops in a kernel that was not launched with PDL.

The rule a kernel launched with PDL must keep: NOTHING before its `gdc_wait()` may read data another kernel writes
(activations, the KV cache, positions) or write anything at all; only index arithmetic and loads of weights (never
written by anyone) may come first. The predecessor may still be running, and the caching allocator (or a CUDA
graph's memory pool) may have handed this kernel an output buffer the predecessor still reads, since stream order
no longer separates them. (One input is outside the rule: the step's positions, a static graph input written on
the stream before the replay and by no kernel of the step; the attention reads them before its wait,
kernels/decode_attention.py PDL_KV_L2 / PDL_EARLY_POS.) Every kernel of the chain waits unconditionally, so
"N+1 waited for N" implies "N-1 had completed too": the ordering is transitive along the stream.

Where a kernel lets its dependents launch (`trigger`, EngineConfig.pdl_trigger): "start" calls
`gdc_launch_dependents()` first thing, so kernel N+1's programs may become resident while N still has programs to
run and sit in their wait, holding registers and slots N's later programs need; and N+1, triggering at ITS start,
lets N+2 launch behind it, and so on down the chain. "late": the GEMVs (the launches with programs enough to fill
the machine) call it once a program's K loop is done, so the kernel after a GEMV launches during its tail, in the
slots its finishing programs free (its first-tile register prefetch, kernels/gemv_fused.py PREFETCH, is not taken
there: timed no faster); the latency-bound launches (RoPE + K/V write, attention: a few programs) keep triggering
first thing, so the GEMV after them is resident while they run (and, with EngineConfig.pdl_l2_mb, warms its weight
in L2 meanwhile). Programs that exit early count as triggered (CUDA's rule), so the placement never changes what is
computed, only when the next grid may start; the wait still orders every dependent access.

The switch is process-wide (each kernel wrapper asks `launch_options()` at launch time; a CUDA graph keeps what was
launched while it was captured). It starts off and can only be on where it can work: CUDA sm_90+, a Triton that
has the griddepcontrol intrinsics, and not under the Triton interpreter (TRITON_INTERPRET), which cannot run inline
asm. The engine sets it from `EngineConfig.pdl` and `pdl_trigger` (engine._apply_layout; on, late, by default
since session 26).
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

try:  # the griddepcontrol intrinsics (Triton >= 3.3-ish); None where missing: PDL is then unsupported
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

MIN_CAPABILITY = (9, 0)  # Hopper: griddepcontrol and programmatic stream serialization

_enabled = False  # the switch; only set_enabled changes it
TRIGGERS = ("start", "late")  # where a kernel lets its dependents launch (see the module docstring)
_late = False  # trigger == "late"; only set_enabled changes it


class LaunchOptions(NamedTuple):
    """What a fused-path kernel launch adds: `kwargs` for `kernel[grid](..., **kwargs)` and the value of the
    kernel's `USE_PDL` constexpr. The two always agree: a kernel launched with PDL must also wait (see module)."""

    kwargs: dict
    use_pdl: bool
    late: bool = False  # the kernel's PDL_LATE constexpr: trigger after its main loop instead of first thing


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unsupported_reason(device=None) -> str | None:
    """Why PDL cannot be on in this process for CUDA `device` (None: the current one), or None: it can."""
    if _interpreting():
        return "the Triton interpreter (TRITON_INTERPRET) cannot run griddepcontrol (inline asm)"
    if gdc_wait is None:
        return "this Triton has no griddepcontrol intrinsics (triton.language.extra.cuda.gdc_wait)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"the CUDA device is sm_{cap[0]}{cap[1]}; PDL needs sm_90 (Hopper) or newer"
    return None


def enabled() -> bool:
    """Whether fused-path kernels launch with PDL now."""
    return _enabled


def set_enabled(on: bool, device=None, trigger: str = "start", warn: bool = True) -> bool:
    """Switch PDL on or off for every later fused-path launch in this process -> whether it is on. `trigger`: where
    each kernel lets its dependents launch, "start" or "late" (module docstring).

    Asking for it where it cannot work (see `unsupported_reason`; `device`: the CUDA device it is for, None: the
    current one) warns (unless `warn` is False: the engine's default-on switch) and leaves it off rather than
    failing: the kernels are correct without it, only slower."""
    global _enabled, _late
    if not isinstance(on, bool):
        raise TypeError(f"pdl.set_enabled takes a bool, got {type(on).__name__} {on!r}")
    if trigger not in TRIGGERS:
        raise ValueError(f"pdl.set_enabled: trigger must be one of {TRIGGERS}, got {trigger!r}")
    reason = unsupported_reason(device) if on else None
    if reason and warn:
        warnings.warn(f"programmatic dependent launch (pdl) stays off: {reason}", RuntimeWarning, stacklevel=2)
    _enabled = on and reason is None
    _late = _enabled and trigger == "late"
    return _enabled


def launch_options() -> LaunchOptions:
    """The launch kwargs and USE_PDL value for a kernel of the fused one-token path, following the switch."""
    return LaunchOptions({"launch_pdl": True}, True, _late) if _enabled else LaunchOptions({}, False)


__all__ = ["TRIGGERS", "LaunchOptions", "enabled", "gdc_launch_dependents", "gdc_wait", "launch_options", "set_enabled",
           "unsupported_reason"]
