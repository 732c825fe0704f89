"""Warming the L2 cache with a layer's gate/up weight while the layer's latency-bound launches run
(EngineConfig.l2_prefetch).

Why: a fused decode layer (models/fused_decode.py) is six launches; four of them (qkv, RoPE + K/V write, attention,
o_proj: ~18 of ~48 us a layer at the 1.5B shape on the H200, sessions 13-19) move few bytes and are bound by
latency, so HBM idles through them, and then the gate/up GEMV streams the layer's largest weight (55 MB at 1.5B:
13 us at the bandwidth floor, 19.8 measured). Weights never depend on activations, so a kernel on a side stream can
read the first part of gate/up's weight into L2 while those launches run, and the GEMV then finds it there. The
H100/H200 L2 holds 50 MB: `fraction` of the matrix (in memory order, at most L2_SHARE of the L2) is warmed.
Nothing is written but a scratch word per program, so outputs are unchanged bit for bit.

How (MODE; scripts/gpu_step_timing.py times each):
  "load":     every element loaded with the evict_last hint and summed (a plain bandwidth kernel; it runs anywhere,
              the interpreter included, where the tests check it reads exactly the warmed elements);
  "prefetch": one `prefetch.global.L2::evict_last` per 128-byte line (sm_80+; no data comes back);
  "bulk":     `cp.async.bulk.prefetch.L2.global` of CHUNK bytes per instruction (sm_90+).
On the CPU or under the interpreter "prefetch" and "bulk" fall back to "load" (inline asm cannot run there).

`fork(weight, fraction)` queues the warming on a side stream that first waits for everything queued so far on the
current stream (so in a CUDA graph it is a parallel branch from that point), and `join(side)` makes the current
stream wait for it before the GEMV. Under torch.compile's tracing it does nothing (streams break the trace).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine then never asks for it (EngineConfig switches need Triton on a GPU)
    triton = tl = None

MODES = ("load", "prefetch", "bulk")
MODE = "prefetch"  # scripts/gpu_step_timing.py's fusedl2* variants set it; the H200 decides the default
LINE = 128  # bytes per cache line: one `prefetch` each
CHUNK = 64 * 1024  # bytes per `cp.async.bulk.prefetch` (a multiple of 16)
PROGRAMS = {"load": 64, "prefetch": 8, "bulk": 1}  # few programs: the layer's own launches keep the SMs
L2_SHARE = 0.6  # at most this share of the GPU's L2 is warmed per layer (the rest keeps activations, the KV
# cache's hot lines and the layer's other reads; warming more than L2 holds would evict its own first lines)
BLOCK = 1024  # lines or chunks (prefetch, bulk) a program issues per loop iteration
LOAD_BLOCK = 8192  # elements a "load" program reads per iteration: 8 x 16 bytes in flight per thread (8 warps),
# ~1 MB over its 64 programs (a load's result is used at once, so the in-flight bytes set its bandwidth)



def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:
    _PREFETCH_PTX = tl.constexpr("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;")
    _BULK_PTX = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;")

    @triton.jit
    def _warm_load(w_ptr, n, per_program, out_ptr, BLOCK: tl.constexpr):
        """Elements [pid * per_program, (pid + 1) * per_program) of w (< n): loaded with evict_last and summed.
        per_program is a multiple of BLOCK, so each program's loads are aligned and vectorize."""
        pid = tl.program_id(0)
        start = tl.multiple_of(pid.to(tl.int64) * per_program, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(0, per_program, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    @triton.jit
    def _warm_asm(b_ptr, n_units, per_program, unit, last, out_ptr, BULK: tl.constexpr, BLOCK: tl.constexpr):
        """Units [pid * per_program, ...) of `unit` bytes each from byte pointer b_ptr (< n_units): one
        `prefetch` per line (BULK False) or one bulk prefetch per chunk (BULK True; the last chunk `last` bytes)."""
        pid = tl.program_id(0)
        done = tl.zeros((BLOCK,), dtype=tl.int32)
        for i in range(0, per_program, BLOCK):
            u = pid * per_program + i + tl.arange(0, BLOCK)
            ok = (u < n_units) & (i + tl.arange(0, BLOCK) < per_program)
            ptrs = b_ptr + tl.where(ok, u, 0).to(tl.int64) * unit  # out of range: unit 0 again (harmless)
            if BULK:
                size = tl.where(u == n_units - 1, last, unit).to(tl.int32)
                done += tl.inline_asm_elementwise(_BULK_PTX, "=r,l,r", [ptrs, size], dtype=tl.int32,
                                                  is_pure=False, pack=1)
            else:
                done += tl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                                                  pack=1)
        tl.store(out_ptr + pid, tl.sum(done, axis=0).to(tl.float32))


_scratch: dict = {}  # device -> float32 [max programs]: one word per program (made outside any graph capture)
_l2: dict = {}  # device -> its L2 bytes
_side: dict = {}  # device -> the side stream


def _scratch_for(device: torch.device) -> torch.Tensor:
    s = _scratch.get(device)
    if s is None:
        s = _scratch[device] = torch.zeros(max(PROGRAMS.values()), dtype=torch.float32, device=device)
    return s


def l2_bytes(device: torch.device) -> int | None:
    """The L2 cache size of a CUDA device (None elsewhere; 50 MiB, the H100/H200's, when torch does not say)."""
    if device.type != "cuda":
        return None
    if device not in _l2:
        props = torch.cuda.get_device_properties(device)
        _l2[device] = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    return _l2[device]


def warm(weight: torch.Tensor, fraction: float, mode: str | None = None) -> torch.Tensor:
    """Launch the warming of the first `fraction` of `weight` (contiguous) on the current stream, at most
    L2_SHARE of the device's L2 -> the scratch (one value per program; "load": the programs' sums of the elements
    read, which the tests check)."""
    mode = MODE if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"l2_prefetch mode must be one of {MODES}, got {mode!r}")
    if not weight.is_contiguous():
        raise ValueError("l2_prefetch warms a contiguous weight")
    if not weight.is_cuda or _interpreting():
        mode = "load"  # inline asm runs on a GPU only
    out = _scratch_for(weight.device)
    n = int(weight.numel() * min(max(fraction, 0.0), 1.0))
    cap = l2_bytes(weight.device)
    if cap is not None:
        n = min(n, int(cap * L2_SHARE) // weight.element_size())
    if n == 0:
        return out
    programs = PROGRAMS[mode]
    if mode == "load":
        per = -(-n // (programs * LOAD_BLOCK)) * LOAD_BLOCK  # a multiple of the block: aligned, vectorized loads
        _warm_load[(programs,)](weight, n, per, out, BLOCK=LOAD_BLOCK, num_warps=8)
        return out
    nbytes = n * weight.element_size()
    unit = LINE if mode == "prefetch" else CHUNK
    units = -(-nbytes // unit)
    last = nbytes - (units - 1) * unit
    last = -(-last // 16) * 16  # bulk sizes are multiples of 16 bytes (weights are 16-byte aligned and sized)
    per = -(-units // programs)
    _warm_asm[(programs,)](weight.view(torch.uint8), units, per, unit, last, out, BULK=mode == "bulk", BLOCK=BLOCK)
    return out


def fork(weight: torch.Tensor, fraction: float):
    """Queue `warm(weight, fraction)` on the side stream, after what the current stream has queued so far -> the
    side stream to `join` (None where there is nothing to overlap: the CPU, fraction 0, torch.compile tracing)."""
    if fraction <= 0 or not weight.is_cuda or torch.compiler.is_compiling():
        return None
    main = torch.cuda.current_stream(weight.device)
    side = _side.get(weight.device)
    if side is None:
        side = _side[weight.device] = torch.cuda.Stream(weight.device)
    _scratch_for(weight.device)  # (allocated here on the first, uncaptured warm-up call, not inside a capture)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        warm(weight, fraction)
    return side


def join(side) -> None:
    """The current stream waits for the side stream's warming (before the GEMV that reads the warmed weight)."""
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
