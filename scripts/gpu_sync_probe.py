#!/usr/bin/env python
"""What one kernel boundary of a CUDA-graphed chain of dependent kernels costs under three ways of waiting for the
predecessor: stream order, programmatic dependent launch (PDL: `griddepcontrol.wait`), or arrival counters.

Why: the fused decode step chains ~5 dependent, latency-bound Triton kernels a layer under PDL (kernels/pdl.py).
`gdc_wait()` returns once the whole predecessor grid has completed and its memory is flushed; with an arrival
counter (each program of kernel k-1 does one release atomic after its stores, each program of kernel k polls with
acquire reads until all have arrived) kernel k may read as soon as the last store is published. Is that shorter?
Each kernel of the synthetic chain does what ours do at a boundary: every program reads the whole vector the
previous kernel wrote (the RMSNorm / GEMV input pattern), optionally streams its share of --weights-mb of bf16
weights nobody writes (distinct per kernel, so a replay streams from HBM as a decode step does), and writes its
slice of the next vector. Schemes (each a chain of --chain kernels of --programs programs, in one CUDA graph):
  stream    plain launches: a boundary is full grid completion + the next launch
  pdl       launch_pdl=True; trigger first thing, weight loads, gdc_wait(), then the input
  pdl_late  the same, but triggering after the loads and the compute, just before the store
  counter   launch_pdl=True (programs resident early), trigger first thing, weight loads, then a spin on the
            predecessor's counter instead of gdc_wait(); ".cg" input loads; after the store a CTA barrier and one
            release atomic. The graph starts with a zero_ of the counters.
  counter_late  the counter scheme triggering as pdl_late does (after the spin and the compute, before the
            store): at most two kernels resident, as our GEMVs' late trigger keeps it (kernels/pdl.py)
Kernel 0 of every scheme is a plain launch (so in "counter" stream-ordered after the zero_). Each kernel writes its
own buffer (chain + 1 vectors), so nothing is written twice in a replay: no write-after-read hazard.

Why "counter" cannot deadlock: kernel k is launched with PDL, so it starts only once every program of kernel k-1
has triggered or exited; every program triggers first thing, so by then all of k-1 is resident (or done) and needs
no SM slot, whatever kernels k, k+1, ... occupy. By induction (kernel 0 spins on nothing) the oldest unfinished
kernel is fully resident and waits for nothing unfinished, so the chain progresses, for any program count (above
the SM count kernel k+1 just launches later). This relies on the PDL launch rule and on the trigger preceding the
spin unconditionally; as a bug there would hang the GPU, each spin gives up after --spin-limit polls and counts a
timeout in a buffer the host reads after the check replay (a FAIL line; the scheme is then not timed).

Correctness: all schemes do the same arithmetic in the same order, so the final vector must equal the stream
scheme's bit for bit (torch.equal); the check replay first fills every non-input buffer with NaN, so a read not
ordered after its producer's store shows. The constants are powers of two (FMA contraction changes no bit) and the
+ 1 keeps values O(1) over any chain length.

Run on an H200, from the repository root: python3 scripts/gpu_sync_probe.py [--n=1536,4096] [--programs=132,16]
[--chain=200] [--replays=50] [--rounds=3] [--weights-mb=0,4] [--spin-limit=4194304]. Prints per shape the median
us per kernel (replay time / chain; median over replays, then over rounds, schemes interleaved) and the difference
to "pdl"; the last stdout line is one JSON object. Exit 2 (one line) without CUDA sm_90+, 1 after any FAIL.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: runs without PYTHONPATH
from specpilot.kernels import pdl  # noqa: E402
from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # main() says why it cannot run
    triton = None

W_BLOCK = 4096  # bf16 weight elements per iteration of a program's weight loop (8 KiB in flight)
WARMUP_REPLAYS = 5
_OFF = dict(TRIGGER_FIRST=False, TRIGGER_LATE=False, GDC_WAIT=False, SPIN=False, SIGNAL=False, CACHE="")
SCHEMES = {  # name -> (launch_pdl for kernels 1.., the step kernel's switches)
    "stream": (False, _OFF),
    "pdl": (True, {**_OFF, "TRIGGER_FIRST": True, "GDC_WAIT": True}),
    "pdl_late": (True, {**_OFF, "TRIGGER_LATE": True, "GDC_WAIT": True}),
    "counter": (True, {**_OFF, "TRIGGER_FIRST": True, "SPIN": True, "SIGNAL": True, "CACHE": ".cg"}),
    "counter_late": (True, {**_OFF, "TRIGGER_LATE": True, "SPIN": True, "SIGNAL": True, "CACHE": ".cg"}),
}

if triton is not None:
    @triton.jit
    def _weight_sum(w_ptr, share, W_BLOCK: tl.constexpr):
        """The sum of this program's `share` weights (bf16, fp32 accumulation; `share` a multiple of W_BLOCK, so
        the loads are unmasked 16-byte vectors), folded into the output so the compiler cannot drop the loads."""
        acc = tl.zeros([W_BLOCK], dtype=tl.float32)
        for start in range(0, share, W_BLOCK):
            acc += tl.load(w_ptr + start + tl.arange(0, W_BLOCK)).to(tl.float32)
        return tl.sum(acc, axis=0)

    @triton.jit
    def _spin_until(cnt_ptr, target, err_ptr, spin_limit):
        """Return once *cnt_ptr >= target (every program of the predecessor has published its stores), or after
        `spin_limit` polls, counting a timeout in *err_ptr (the watchdog: a clear error instead of a hang).

        A poll is `atomic_add(ptr, 0, sem="acquire", scope="gpu")`. Triton runs a scalar atomic in one thread and
        broadcasts its result through shared memory behind a bar.sync, so the loop condition is uniform across the
        CTA, and that thread's gpu-scope acquire, then the barrier, order every thread's later loads after the
        producers' release atomics (the split-K semaphore pattern; the signal side mirrors it: bar.sync, then one
        release atomic). Triton 3.9 compiles the add of 0 to `ld.global.gpu.acquire.b32`, an older one may keep
        `atom.global.gpu.acquire.add`: both acquire at gpu scope. (A volatile load is only relaxed; it would need
        a fence, which Triton does not expose.) The input is then read ".cg" (L2 only, the point of coherence),
        so no line in this SM's non-coherent L1 can be served stale."""
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        left = spin_limit - 1  # a tensor from the start (an int literal could not be loop-carried in older Tritons)
        while (seen < target) & (left > 0):
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            left -= 1
        if seen < target:
            tl.atomic_add(err_ptr, 1, sem="relaxed", scope="gpu")

    @triton.jit
    def _step_kernel(x_ptr, y_ptr, w_ptr, wait_ptr, signal_ptr, err_ptr, n, slice_len, w_share, wait_count,
                     spin_limit, BLOCK_N: tl.constexpr, SLICE_P2: tl.constexpr, W_BLOCK: tl.constexpr,
                     HAS_W: tl.constexpr, TRIGGER_FIRST: tl.constexpr, TRIGGER_LATE: tl.constexpr,
                     GDC_WAIT: tl.constexpr, SPIN: tl.constexpr, SIGNAL: tl.constexpr, CACHE: tl.constexpr):
        """One kernel of the chain: y[i] = x[i] * 0.5 + (sum(x) + weight sum) * 2**-20 + 1 for this program's
        slice of y. Before the wait (gdc_wait or the spin) only the trigger and the weight loads, which nobody
        writes: the predecessor may still be running (kernels/pdl.py's rule)."""
        pid = tl.program_id(0)
        if TRIGGER_FIRST:
            gdc_launch_dependents()
        w_sum = 0.0
        if HAS_W:
            w_sum = _weight_sum(w_ptr + pid.to(tl.int64) * w_share, w_share, W_BLOCK)
        if GDC_WAIT:
            gdc_wait()
        if SPIN:
            _spin_until(wait_ptr, wait_count, err_ptr, spin_limit)
        offs = tl.arange(0, BLOCK_N)
        s = tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0, cache_modifier=CACHE), axis=0)
        bias = (s + w_sum) * 9.5367431640625e-07 + 1.0  # 2**-20: exact, so FMA contraction changes nothing
        lane = tl.arange(0, SLICE_P2)
        idx = pid * slice_len + lane
        mine = (lane < slice_len) & (idx < n)
        y = tl.load(x_ptr + idx, mask=mine, other=0.0, cache_modifier=CACHE) * 0.5 + bias
        if TRIGGER_LATE:
            gdc_launch_dependents()
        tl.store(y_ptr + idx, y, mask=mine)
        if SIGNAL:  # every thread's stores before the barrier; then one thread releases them all at gpu scope
            tl.debug_barrier()
            tl.atomic_add(signal_ptr, 1, sem="release", scope="gpu")


class Chain:
    """One scheme's chain of `length` kernels at one shape: its own activation buffers (input copied from `x0`),
    counters, watchdog buffer, and the CUDA graph that replays it."""

    def __init__(self, scheme: str, x0: torch.Tensor, weights: torch.Tensor, programs: int, length: int,
                 spin_limit: int):
        self.programs, self.length, self.spin_limit, self.n = programs, length, spin_limit, x0.numel()
        self.launch_pdl, self.switches = SCHEMES[scheme]
        self.acts = torch.cat([x0[None], x0.new_empty(length, self.n)])  # acts[k]: kernel k's input
        self.counters = torch.zeros(length, device=x0.device, dtype=torch.int32)  # counters[k]: kernel k's arrivals
        self.errors = torch.zeros(1, device=x0.device, dtype=torch.int32)  # watchdog timeouts
        self.weights = weights  # [length, programs * share] bf16 (share 0: a [length, 1] dummy)
        self.w_share = weights.shape[1] // programs
        self.graph = None

    def launch_all(self):
        """Launch the whole chain on the current stream (eagerly, or into a capture)."""
        if self.switches["SPIN"]:
            self.counters.zero_()  # ordered before kernel 0, a plain launch, and so before every later kernel
        slice_len = triton.cdiv(self.n, self.programs)
        for k in range(self.length):
            first = k == 0  # a plain launch, waiting for nothing inside the graph: kernel 0 of every scheme
            switches = {**self.switches, "SPIN": self.switches["SPIN"] and not first}
            _step_kernel[(self.programs,)](
                self.acts[k], self.acts[k + 1], self.weights[k], self.counters[max(k - 1, 0)], self.counters[k],
                self.errors, self.n, slice_len, self.w_share, self.programs, self.spin_limit,
                BLOCK_N=triton.next_power_of_2(self.n), SLICE_P2=triton.next_power_of_2(slice_len), W_BLOCK=W_BLOCK,
                HAS_W=self.w_share > 0, **switches, launch_pdl=self.launch_pdl and not first)

    def capture(self):
        """Compile and run once eagerly on a side stream (Triton compiles at the first launch, not inside a
        capture), then capture the chain in one graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.launch_all()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.launch_all()
        torch.cuda.synchronize()

    def check_replay(self) -> tuple[torch.Tensor, int]:
        """One replay with every non-input buffer poisoned with NaN -> (final vector, watchdog timeouts)."""
        self.acts[1:].fill_(float("nan"))
        self.errors.zero_()
        self.graph.replay()
        torch.cuda.synchronize()
        return self.acts[-1].clone(), int(self.errors.item())

    def time_us(self, replays: int) -> float:
        """Median microseconds of one graph replay over `replays` replays, each between its own CUDA events."""
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in events:
            start.record()
            self.graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def probe_shape(n: int, programs: int, weights_mb: float, args) -> dict:
    """Every scheme at one (N, programs, weight MiB): check, then rounds of timing with the schemes interleaved
    (the order rotated each round) -> this shape's result row."""
    gen = torch.Generator(device="cuda").manual_seed(n * 1000 + programs)
    x0 = torch.randn(n, device="cuda", generator=gen)
    # bf16 weight elements per program and kernel, rounded up to whole W_BLOCKs (weight_bytes: what is streamed)
    share = W_BLOCK * triton.cdiv(int(weights_mb * 2 ** 20) // 2, programs * W_BLOCK)
    weights = (torch.randn(args.chain, programs * share, device="cuda", generator=gen).to(torch.bfloat16) if share
               else torch.zeros(args.chain, 1, device="cuda", dtype=torch.bfloat16))
    chains = {name: Chain(name, x0, weights, programs, args.chain, args.spin_limit) for name in SCHEMES}
    row = {"n": n, "programs": programs, "weights_mb": weights_mb, "weight_bytes": 2 * programs * share,
           "schemes": {}, "fail": []}
    reference = None
    for name, chain in chains.items():  # "stream" first: the reference
        chain.capture()
        final, timeouts = chain.check_replay()
        reference = final if reference is None else reference
        equal = bool(torch.equal(final, reference)) and bool(torch.isfinite(final).all())
        row["schemes"][name] = {"equal_to_stream": equal, "watchdog_timeouts": timeouts, "rounds_us_per_kernel": []}
        if not equal or timeouts:
            row["fail"].append(f"{name}: {'' if equal else 'final vector differs from stream; '}"
                               f"{timeouts} watchdog timeouts")
        for _ in range(0 if timeouts else WARMUP_REPLAYS):
            chain.graph.replay()
    timed = [name for name in SCHEMES if not row["schemes"][name]["watchdog_timeouts"]]
    for r in range(args.rounds):
        for name in timed[r % len(timed):] + timed[:r % len(timed)]:
            row["schemes"][name]["rounds_us_per_kernel"].append(chains[name].time_us(args.replays) / args.chain)
    for name in timed:
        row["schemes"][name]["us_per_kernel"] = statistics.median(row["schemes"][name]["rounds_us_per_kernel"])
    base = row["schemes"]["pdl"]["us_per_kernel"]  # ("pdl" never spins: always timed)
    for name in timed:
        row["schemes"][name]["vs_pdl_us"] = row["schemes"][name]["us_per_kernel"] - base
    return row


def print_row(row: dict):
    print(f"N={row['n']} programs={row['programs']} weights={row['weight_bytes'] / 2 ** 20:.2f} MiB/kernel")
    for name, stats in row["schemes"].items():
        if "us_per_kernel" not in stats:
            print(f"  {name:9s} not timed (watchdog)")
            continue
        rounds = " ".join(f"{v:.3f}" for v in stats["rounds_us_per_kernel"])
        print(f"  {name:9s} {stats['us_per_kernel']:7.3f} us/kernel  {stats.get('vs_pdl_us', float('nan')):+7.3f} "
              f"vs pdl  (rounds: {rounds})")
    for line in row["fail"]:
        print(f"  FAIL {line}")


def parse_args(argv):
    def numbers(kind):
        return lambda text: [kind(v) for v in text.split(",") if v]

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=numbers(int), default=[1536, 4096], help="vector lengths (fp32), comma-separated")
    ap.add_argument("--programs", type=numbers(int), default=[132, 16], help="programs per kernel, comma-separated")
    ap.add_argument("--chain", type=int, default=200, help="dependent kernels per graph")
    ap.add_argument("--replays", type=int, default=50, help="timed replays per scheme and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, schemes interleaved")
    ap.add_argument("--weights-mb", type=numbers(float), default=[0.0, 4.0], help="MiB of bf16 weights per kernel")
    ap.add_argument("--spin-limit", type=int, default=2 ** 22, help="polls before a counter spin gives up")
    args = ap.parse_args(argv)
    if args.spin_limit < 2 or args.chain < 1 or args.replays < 1 or args.rounds < 1:
        ap.error("--spin-limit must be >= 2 and --chain, --replays, --rounds >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = "Triton is not installed" if triton is None else pdl.unsupported_reason()  # (sm_90+, griddepcontrol)
    if reason:
        print(f"gpu_sync_probe: needs CUDA sm_90+ with Triton's griddepcontrol (PDL): {reason}")
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}; "
          f"chain {args.chain}, {args.replays} replays x {args.rounds} rounds")
    rows = []
    for n, programs, weights_mb in itertools.product(args.n, args.programs, args.weights_mb):
        rows.append(probe_shape(n, programs, weights_mb, args))
        print_row(rows[-1])
        torch.cuda.empty_cache()
    print(json.dumps({"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                      "triton": triton.__version__, "chain": args.chain, "replays": args.replays,
                      "rounds": args.rounds, "spin_limit": args.spin_limit, "results": rows}))
    return 1 if any(row["fail"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
