"""Host-side timing of a drafter's propose(), for `specpilot profile` (commands.py): what of the draft stage is host.

The engine times the draft stage on the device (engine/session.py StageTimer: CUDA events at the step's start and
after propose). The step before ended in its one host sync, so the GPU is idle when the stage starts and the stage
measures: host time until the drafter's pass is launched (bookkeeping, the copies before the replay; the n-gram
lookup beside it only where it sets the block's length, drafters/ngram_assist.py: otherwise it runs after the
launch, while the GPU drafts), then the pass's device time, then the launches queued behind it. The roofline model prices
only the pass; `ProposeTimer` measures the rest, per call:

  * host_pre_launch_s: perf_counter from propose() entry to the pass's launch (the drafter's `last_launch_t`;
    DFlashBlockDrafter keeps it, also inside NgramAssistedDrafter). The few host instructions of the step loop
    between the stage's start event and propose() are not included (a min and a call).
  * eager_pass_s: host time of launching an eager pass (DFlash's first pass over the prompt, once a prompt): it is
    launch-bound, so its host time stands for its device time; the model prices every step's pass as graphed.
  * launches_before / launches_after: device launches outside the pass (drafters report `last_eager_launches`).
    Those before it run while the host is still on its way to the launch (inside host_pre_launch_s); those after
    queue behind the pass and add their own device time (priced by costmodel.gaps.analyze at `launch_s` each).
  * graph_device_s: the draft graph's own device time, from CUDA event pairs around each replay (DFlash on CUDA),
    or a small model drafter's one pass (each of its K passes timed alike); None elsewhere. With the two host
    parts it splits the measured stage into host and device. `graph_device_s_by_pass`: the same per kind of pass
    where the drafter labels them (a small model drafter: the tokens a pass fed, or its chained passes), because
    one mean hides a slow kind (session 21: the 0.5B drafter's passes averaged 1.15 ms against 0.8 for a
    one-token step: the catch-up passes are the suspects).
  * wall_s: propose()'s host wall time (on CUDA it returns before the device finishes).

On CPU everything is host time and there is no graph: the numbers are only the host parts' sizes there.
"""

from __future__ import annotations

import time
from collections import Counter

import torch


def _times_passes(net) -> bool:
    """Whether a drafter's passes can be timed on the device: DFlash's draft graph, or a small model drafter's
    runner passes (drafters/small_ar.py), on CUDA."""
    if not hasattr(net, "graph_events"):
        return False
    if getattr(net, "graph", None) is not None:
        return True
    runner = getattr(net, "runner", None)
    return runner is not None and getattr(runner, "device", torch.device("cpu")).type == "cuda"


class ProposeTimer:
    """Wraps `drafter.propose` (on the instance) and sums the quantities above over calls."""

    def __init__(self, drafter, graph_device: bool = True):
        self.drafter, self._propose = drafter, drafter.propose
        self.calls, self.wall_s, self.host_pre_launch_s, self.eager_pass_s = 0, 0.0, 0.0, 0.0
        self.launches_before = self.launches_after = 0
        self.passes: Counter = Counter()  # "graph" / "static" / "eager" (DFlash), "passes" (a model
        # drafter's K), "" (no pass: nothing to draft)
        self._net = getattr(drafter, "inner", drafter)  # the model drafter (NgramAssistedDrafter wraps it)
        if graph_device and _times_passes(self._net):
            self._net.graph_events = []
        drafter.propose = self._timed

    def _timed(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return self._propose(*args, **kw)
        finally:
            t1 = time.perf_counter()
            self.calls += 1
            self.wall_s += t1 - t0
            launch_t = getattr(self._net, "last_launch_t", None)
            launched = launch_t is not None and t0 <= launch_t <= t1
            self.passes[getattr(self._net, "last_pass", "") if launched else ""] += 1
            if launched:
                self.host_pre_launch_s += launch_t - t0
                self.eager_pass_s += getattr(self._net, "last_eager_pass_s", 0.0)
                before, after = getattr(self.drafter, "last_eager_launches", (0, 0))
                self.launches_before += before
                self.launches_after += after

    def graph_device_s(self) -> float | None:
        """Summed device time of the timed graph replays (synchronizes once); None when none were timed."""
        events = getattr(self._net, "graph_events", None)
        if not events:
            return None
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in events) / 1e3

    def graph_device_s_by_pass(self) -> dict[str, dict]:
        """Mean device seconds of a timed pass per label (`graph_event_labels`), with the count; {} when the
        drafter labels nothing."""
        events = getattr(self._net, "graph_events", None)
        labels = getattr(self._net, "graph_event_labels", None)
        if not events or not labels or len(labels) != len(events):
            return {}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        sums: dict[str, list] = {}
        for (a, b), label in zip(events, labels):
            acc = sums.setdefault(str(label), [0.0, 0])
            acc[0] += a.elapsed_time(b) / 1e3
            acc[1] += 1
        return {k: {"mean_s": v[0] / v[1], "count": v[1]} for k, v in sorted(sums.items())}

    def per_step(self, steps: int) -> dict:
        """The sums divided by `steps` (the profile's speculative steps), graph_device_s per timed replay."""
        n = max(steps, 1)
        events = getattr(self._net, "graph_events", None)
        graph = self.graph_device_s()
        return {"calls": self.calls, "wall_s": self.wall_s / n, "host_pre_launch_s": self.host_pre_launch_s / n,
                "eager_pass_s": self.eager_pass_s / n, "launches_before": self.launches_before / n,
                "launches_after": self.launches_after / n, "passes": dict(self.passes),
                "graph_device_s": None if graph is None else graph / len(events),
                "graph_replays": len(events) if events else 0, "by_pass": self.graph_device_s_by_pass()}
