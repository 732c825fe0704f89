"""Measured hardware ceilings of one GPU: the numbers every floor and prediction in the cost model divides by.

`measure_ceilings(device)` runs about ten micro-benchmarks (well under 30 s on an H200) and `load_or_measure(device)`
caches the result as JSON at ``cache_dir()/hardware/<sanitized GPU name>.json``.

Invariants:
  * Every number is measured, never taken from a spec sheet: timed with CUDA events after warm-up, the median of
    several repeats, on random (never all-zero) data, so no compression or zero-skipping can flatter a result.
  * Units are SI base units: bytes per second, FLOP per second, seconds.
  * Buffers are freed before returning; the measurement leaves no tensors behind on the device.
  * Nothing here imports the engine: this module only needs torch and the cache location.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch

from specpilot.errors import ConfigError
from specpilot.hub.registry import cache_dir

HBM_COPY_BYTES = 2 << 30  # 2 GiB source buffer: far beyond L2, so the copy streams from HBM
MATMUL_N = 8192  # bf16 [N, N] @ [N, N]
LAUNCH_COUNT = 2000  # eager tiny kernels timed per repeat
GRAPH_KERNELS = 200  # tiny kernels captured in one CUDA graph
GRAPH_REPLAYS = 10  # replays timed back to back per repeat
GEMV_LAYERS = 28  # the 1.5B-like chain used to calibrate decode GEMV bandwidth
GEMV_HIDDEN, GEMV_KV, GEMV_INTER = 1536, 256, 8960
SMALL_CHAIN = (GEMV_LAYERS, GEMV_HIDDEN, GEMV_KV, GEMV_INTER)
LARGE_CHAIN = (8, 4096, 1024, 12288)  # (layers, hidden, kv, intermediate): Qwen3-8B-like, ~3.1 GB of bf16
TINY_CHAIN = (24, 896, 128, 4864)  # Qwen2.5-0.5B-like
CHAINS = (TINY_CHAIN, SMALL_CHAIN, LARGE_CHAIN)
REPEATS = 7


class CudaUnavailableError(ConfigError):
    """Ceilings can only be measured on a CUDA device."""


@dataclass(frozen=True)
class HardwareCeilings:
    name: str  # torch.cuda.get_device_name()
    hbm_bytes_per_s: float  # device-to-device copy, bytes read + written per second
    bf16_flops_per_s: float  # dense bf16 matmul, 2*N^3 FLOP per product
    launch_s: float  # per tiny kernel launched eagerly from Python (host dispatch + launch)
    graph_kernel_s: float  # per tiny kernel inside a replayed CUDA graph
    gemv_bytes_per_s: float  # weight bytes per second of a CUDA-graphed chain of bf16 GEMVs (M=1)
    measured_at: str  # ISO-8601 local time
    # masked SDPA at decode, per layer, graphed: ~ sdpa_fixed_s + sdpa_per_key_s * keys (fitted on two pool sizes).
    # Latency-bound (a few thread blocks per layer), so bytes / bandwidth badly under-predicts it. None: not measured.
    sdpa_fixed_s: float | None = None
    sdpa_per_key_s: float | None = None
    # the same GEMV chain at M = 16 rows (a 15-draft verify block): cuBLAS picks other kernels there, and a
    # verify pass grows with its tokens even though it reads the weights once. None: not measured.
    gemv16_bytes_per_s: float | None = None
    # the split-KV decode-attention kernel (kernels/decode_attention.py), graphed, per layer at 1 and 16 query
    # tokens over a 1,024-token context (it reads only the context, so the pool size does not matter). None:
    # not measured (no Triton).
    attn_kernel_t1_s: float | None = None
    attn_kernel_t16_s: float | None = None
    # wall time of the one host sync a speculative step makes (a tiny kernel, then `.tolist()` of its result)
    host_sync_s: float | None = None
    # the GEMV chain at Qwen3-8B-like shapes (M = 1): small matrices stream far below HBM rate (1.76 TB/s at the
    # 1.5B's shapes on the H200) while large ones come close to it, so one rate mispredicts one of them (session
    # 10: the 8B step over-predicted by 35-41%); the rate is interpolated by bytes per layer between the chains.
    gemv_large_bytes_per_s: float | None = None
    gemv16_large_bytes_per_s: float | None = None  # the large chain at M = 16
    # and a Qwen2.5-0.5B-like chain (a small AR drafter's shapes: 896-wide, slower still), at M = 1 and 16
    gemv_tiny_bytes_per_s: float | None = None
    gemv16_tiny_bytes_per_s: float | None = None
    # masked SDPA per layer with 16 query tokens (a verify block): another kernel than at T = 1, ~2x the step
    # (1.5B, graphed, 4096-slot pool: 6.0 ms at T = 4 vs 3.4 ms at T = 1). Used for every T > 1.
    sdpa16_fixed_s: float | None = None
    sdpa16_per_key_s: float | None = None
    # per kernel of the eager model's elementwise / reduction chains (RMSNorm's 8 kernels: fp32 casts, pow, mean,
    # rsqrt, ...; RoPE's 10) inside a replayed graph, at 1 and 16 rows: dearer than the bf16 add `graph_kernel_s`
    # times (session 11, H200: the norm + RoPE kernels saved ~1.7 us per eager kernel at T = 1 and ~2.3 us at
    # T = 16 at both shapes, against 1.13 us per tiny add). None: not measured, `graph_kernel_s` is used.
    graph_eager_kernel_s: float | None = None
    graph_eager_kernel16_s: float | None = None

    def sdpa_s(self, keys: int, tokens: int = 1) -> float:
        """Predicted time of one masked decode-attention call of `tokens` queries over `keys` key slots (0 if not
        measured; T > 1 uses the T = 16 fit when measured)."""
        if tokens > 1 and self.sdpa16_fixed_s is not None and self.sdpa16_per_key_s is not None:
            return self.sdpa16_fixed_s + self.sdpa16_per_key_s * keys
        if self.sdpa_fixed_s is None or self.sdpa_per_key_s is None:
            return 0.0
        return self.sdpa_fixed_s + self.sdpa_per_key_s * keys

    @staticmethod
    def _by_size(rates: tuple, layer_bytes: float) -> float:
        """Rates measured on the tiny / small / large chains (None: not measured; the small one always is),
        piecewise-linear in log(bytes per layer) between the measured ones, held beyond them."""
        pts = sorted((math.log(_chain_size(c)[1] / c[0]), r) for c, r in zip(CHAINS, rates) if r is not None)
        if layer_bytes <= 0:
            return rates[1]
        x = math.log(layer_bytes)
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
            if x <= x1:
                return r0 + (x - x0) / (x1 - x0) * (r1 - r0)
        return pts[-1][1]

    def weight_s_per_byte(self, tokens: int, layer_bytes: float = 0.0) -> float:
        """Seconds per weight byte of a graphed pass of `tokens` rows through layers of `layer_bytes` bytes (0:
        the small chain's): the M = 1 and M = 16 chain rates, interpolated in T (held beyond 16) and by size."""
        at1 = 1.0 / self._by_size((self.gemv_tiny_bytes_per_s, self.gemv_bytes_per_s, self.gemv_large_bytes_per_s),
                                  layer_bytes)
        if self.gemv16_bytes_per_s is None:
            return at1
        at16 = 1.0 / self._by_size((self.gemv16_tiny_bytes_per_s, self.gemv16_bytes_per_s,
                                    self.gemv16_large_bytes_per_s), layer_bytes)
        return at1 + (at16 - at1) * _frac16(tokens)

    def weights_s(self, weight_bytes: float, layers: int, tokens: int, head_bytes: float = 0.0) -> float:
        """Seconds to stream `weight_bytes` through graphed GEMMs of `tokens` rows: the layers' share at the rate of
        their size per layer, the LM head's `head_bytes` (one matrix) at its own size's rate."""
        body = weight_bytes - head_bytes
        out = body * self.weight_s_per_byte(tokens, body / layers if layers else 0.0)
        return out + (head_bytes * self.weight_s_per_byte(tokens, head_bytes) if head_bytes else 0.0)

    def attention_kernel_s(self, tokens: int) -> float | None:
        """Per-layer time of the split-KV kernel at `tokens` query tokens (None: not measured)."""
        if self.attn_kernel_t1_s is None or self.attn_kernel_t16_s is None:
            return None
        return self.attn_kernel_t1_s + (self.attn_kernel_t16_s - self.attn_kernel_t1_s) * _frac16(tokens)

    def eager_kernel_s(self, tokens: int) -> float:
        """Per graphed kernel of an eager norm / RoPE chain at `tokens` rows (graph_kernel_s where not measured)."""
        at1 = self.graph_eager_kernel_s if self.graph_eager_kernel_s is not None else self.graph_kernel_s
        if self.graph_eager_kernel16_s is None:
            return at1
        return at1 + (self.graph_eager_kernel16_s - at1) * _frac16(tokens)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareCeilings":
        names = {f.name for f in fields(cls)}
        missing = names - d.keys()
        if missing:
            raise ValueError(f"hardware ceilings lack {sorted(missing)}")
        return cls(**{k: d[k] for k in names})


def _frac16(tokens: int) -> float:
    """Where `tokens` sits between the two measured points, 1 -> 0.0 and 16 (or more) -> 1.0."""
    return min(max(tokens - 1, 0), 15) / 15


# --- timing helpers -----------------------------------------------------------------------------------------


def _require_cuda(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type != "cuda":
        raise CudaUnavailableError(f"hardware ceilings are measured on a CUDA device, not {str(dev)!r}")
    if not torch.cuda.is_available():
        raise CudaUnavailableError("CUDA is not available (no NVIDIA GPU or a CPU-only torch build): "
                                   "hardware ceilings cannot be measured here")
    return dev


def time_median_s(fn: Callable[[], object], *, warmup: int = 2, repeats: int = REPEATS) -> float:
    """Median seconds of one call of `fn`, timed on the current stream with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)  # ms -> s
    return statistics.median(samples)


def _capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Warm `fn` up on a side stream (kernels chosen, workspaces allocated), then capture it into a graph."""
    from specpilot.engine.graphs import capture

    g, _ = capture(fn)
    torch.cuda.synchronize()
    return g


# --- the measurements ----------------------------------------------------------------------------------------


def _hbm_bytes_per_s(dev: torch.device) -> float:
    src = torch.randn(HBM_COPY_BYTES // 2, dtype=torch.bfloat16, device=dev)  # bf16: 2 bytes per element
    dst = torch.empty_like(src)
    seconds = time_median_s(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds  # read + write


def _bf16_flops_per_s(dev: torch.device) -> float:
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=dev)
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(a)
    seconds = time_median_s(lambda: torch.mm(a, b, out=out), warmup=3)
    return 2 * MATMUL_N**3 / seconds


def _tiny_operands(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(4096, dtype=torch.bfloat16, device=dev)  # the size of one token's hidden state
    return x, torch.randn_like(x), torch.empty_like(x)


def _launch_s(dev: torch.device) -> float:
    x, y, out = _tiny_operands(dev)

    def burst():
        for _ in range(LAUNCH_COUNT):
            torch.add(x, y, out=out)

    return time_median_s(burst, warmup=1) / LAUNCH_COUNT


def _graph_kernel_s(dev: torch.device) -> float:
    x, y, out = _tiny_operands(dev)

    def body():
        for _ in range(GRAPH_KERNELS):
            torch.add(x, y, out=out)

    g = _capture(body)

    def replays():
        for _ in range(GRAPH_REPLAYS):
            g.replay()

    return time_median_s(replays) / (GRAPH_REPLAYS * GRAPH_KERNELS)


def _chain_shapes(chain) -> list[tuple[int, int]]:
    """[out, in] of one layer's GEMMs as the engine runs them by default (fused projections): qkv, o, gate+up,
    down (cuBLAS picks its kernel by shape, so the chain uses the engine's shapes)."""
    _, h, kv, inter = chain
    return [(h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)]


def _chain_size(chain) -> tuple[int, int]:
    """(GEMMs, bf16 weight bytes) of a chain."""
    shapes = _chain_shapes(chain)
    return len(shapes) * chain[0], 2 * chain[0] * sum(o * i for o, i in shapes)


def _gemv_chain_weights(dev: torch.device, chain=SMALL_CHAIN) -> list[torch.Tensor]:
    """Per layer, in execution order: qkv, o, gate+up, down as [out, in] bf16, scaled to keep values O(1)."""
    return [torch.randn(o, i, dtype=torch.bfloat16, device=dev) * i**-0.5
            for _ in range(chain[0]) for o, i in _chain_shapes(chain)]


def _gemv_bytes_per_s(dev: torch.device, rows: int = 1, chain=SMALL_CHAIN) -> float:
    weights = _gemv_chain_weights(dev, chain)
    layers, h, _, inter = chain
    x = torch.randn(rows, h, dtype=torch.bfloat16, device=dev)  # [M, hidden]

    def chain_fn():
        y = x
        for layer in range(layers):
            w_qkv, w_o, w_gu, w_down = weights[4 * layer: 4 * layer + 4]
            q = torch.nn.functional.linear(y, w_qkv)[:, :h]
            a = torch.nn.functional.linear(q, w_o)
            g = torch.nn.functional.linear(a, w_gu)[:, :inter]
            y = torch.nn.functional.linear(g, w_down)
        return y

    graph = _capture(chain_fn)
    seconds = time_median_s(graph.replay)
    return sum(w.numel() * w.element_size() for w in weights) / seconds


SDPA_LAYERS = 28  # one graphed chain, distinct K/V per call (like a model's layers)
SDPA_HEADS, SDPA_KV_HEADS, SDPA_HEAD_DIM = 12, 2, 128  # the 1.5B's attention
SDPA_KEYS = (1024, 4096)


def _sdpa_layer_s(dev: torch.device, keys: int, tokens: int = 1) -> float:
    """One masked SDPA call at decode (`tokens` queries, half the keys visible), graphed, per layer."""
    q = torch.randn(1, SDPA_HEADS, tokens, SDPA_HEAD_DIM, dtype=torch.bfloat16, device=dev)
    kv = [torch.randn(2, 1, SDPA_KV_HEADS, keys, SDPA_HEAD_DIM, dtype=torch.bfloat16, device=dev)
          for _ in range(SDPA_LAYERS)]
    mask = (torch.arange(keys, device=dev) <= keys // 2)[None, None, None, :]

    def chain():
        for k, v in kv:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    graph = _capture(chain)
    return time_median_s(graph.replay) / SDPA_LAYERS


def _sdpa_fit(dev: torch.device, tokens: int = 1) -> tuple[float, float]:
    (k0, k1) = SDPA_KEYS
    t0, t1 = _sdpa_layer_s(dev, k0, tokens), _sdpa_layer_s(dev, k1, tokens)
    per_key = max(0.0, (t1 - t0) / (k1 - k0))
    return max(0.0, t0 - per_key * k0), per_key


ATTN_CONTEXT, ATTN_POOL = 1024, 4096


def _attn_kernel_layer_s(dev: torch.device, tokens: int) -> float | None:
    """One split-KV decode-attention call per layer (the 1.5B's heads), graphed; None without Triton."""
    try:
        from specpilot.kernels.decode_attention import decode_attention, triton
    except ImportError:
        return None
    if triton is None:
        return None
    q = torch.randn(1, SDPA_HEADS, tokens, SDPA_HEAD_DIM, dtype=torch.bfloat16, device=dev)
    kv = [torch.randn(2, 1, SDPA_KV_HEADS, ATTN_POOL, SDPA_HEAD_DIM, dtype=torch.bfloat16, device=dev)
          for _ in range(SDPA_LAYERS)]
    pos = torch.arange(ATTN_CONTEXT, ATTN_CONTEXT + tokens, device=dev)[None]

    def chain():
        for k, v in kv:
            decode_attention(q, k, v, pos)

    try:
        graph = _capture(chain)
    except Exception as e:  # noqa: BLE001 - an optional ceiling: the prediction falls back to SDPA's
        warnings.warn(f"split-KV attention kernel not timed: {e}")
        return None
    return time_median_s(graph.replay) / SDPA_LAYERS


EAGER_NORMS = 28  # eager RMSNorms (8 kernels each) in the graphed chain


def _graph_eager_kernel_s(dev: torch.device, rows: int = 1) -> float:
    """Per kernel of a graphed chain of eager RMSNorms on [rows, 1536] bf16 (DenseLM's 8-kernel RMSNorm)."""
    xs = [torch.randn(rows, GEMV_HIDDEN, dtype=torch.bfloat16, device=dev) for _ in range(EAGER_NORMS)]
    w = torch.ones(GEMV_HIDDEN, dtype=torch.bfloat16, device=dev)

    def chain():
        for x in xs:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            w * h.to(x.dtype)

    graph = _capture(chain)
    return time_median_s(graph.replay) / (EAGER_NORMS * _NORM_CHAIN_KERNELS)


_NORM_CHAIN_KERNELS = 8


def _host_sync_s(dev: torch.device) -> float:
    """Wall seconds of a tiny kernel followed by `.tolist()` on an idle GPU: the floor of a host round trip."""
    x = torch.arange(4, device=dev)
    samples = []
    for _ in range(50):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        (x + 1).tolist()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[5:])


def measure_ceilings(device: str | torch.device = "cuda") -> HardwareCeilings:
    """Measure the ceilings of `device` (a CUDA device); raises CudaUnavailableError elsewhere."""
    dev = _require_cuda(device)
    with torch.cuda.device(dev), torch.inference_mode():
        torch.manual_seed(0)
        hw = HardwareCeilings(
            name=torch.cuda.get_device_name(dev),
            hbm_bytes_per_s=_hbm_bytes_per_s(dev),
            bf16_flops_per_s=_bf16_flops_per_s(dev),
            launch_s=_launch_s(dev),
            graph_kernel_s=_graph_kernel_s(dev),
            gemv_bytes_per_s=_gemv_bytes_per_s(dev),
            measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **dict(zip(("sdpa_fixed_s", "sdpa_per_key_s"), _sdpa_fit(dev))),
            gemv16_bytes_per_s=_gemv_bytes_per_s(dev, rows=16),
            gemv_large_bytes_per_s=_gemv_bytes_per_s(dev, chain=LARGE_CHAIN),
            gemv16_large_bytes_per_s=_gemv_bytes_per_s(dev, rows=16, chain=LARGE_CHAIN),
            gemv_tiny_bytes_per_s=_gemv_bytes_per_s(dev, chain=TINY_CHAIN),
            gemv16_tiny_bytes_per_s=_gemv_bytes_per_s(dev, rows=16, chain=TINY_CHAIN),
            **dict(zip(("sdpa16_fixed_s", "sdpa16_per_key_s"), _sdpa_fit(dev, tokens=16))),
            attn_kernel_t1_s=_attn_kernel_layer_s(dev, 1),
            attn_kernel_t16_s=_attn_kernel_layer_s(dev, 16),
            host_sync_s=_host_sync_s(dev),
            graph_eager_kernel_s=_graph_eager_kernel_s(dev),
            graph_eager_kernel16_s=_graph_eager_kernel_s(dev, rows=16),
        )
        torch.cuda.empty_cache()
    return hw


# --- the JSON cache -----------------------------------------------------------------------------------------


def sanitize_name(name: str) -> str:
    """'NVIDIA H200 (MIG 1g.18gb)' -> 'NVIDIA_H200_MIG_1g.18gb': safe as a file name on any file system."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown-gpu"


def ceilings_path(name: str) -> Path:
    return cache_dir() / "hardware" / f"{sanitize_name(name)}.json"


def save_ceilings(hw: HardwareCeilings, path: Path | None = None) -> Path:
    """Write atomically (temp file + rename), so a reader never sees a half-written file."""
    path = path or ceilings_path(hw.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(hw.to_dict(), fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def load_ceilings(path: Path) -> HardwareCeilings:
    return HardwareCeilings.from_dict(json.loads(Path(path).read_text()))


def _gpu_name(device: str | torch.device) -> str:
    return torch.cuda.get_device_name(_require_cuda(device))


def load_or_measure(device: str | torch.device = "cuda", refresh: bool = False) -> HardwareCeilings:
    """Cached ceilings of this GPU model, measured (and cached) on first use or when `refresh`.

    An unreadable cache file is measured over rather than trusted.
    """
    path = ceilings_path(_gpu_name(device))
    if path.is_file() and not refresh:
        try:
            return load_ceilings(path)
        except (ValueError, TypeError):  # JSONDecodeError is a ValueError: a corrupt file, measure again
            pass
    hw = measure_ceilings(device)
    save_ceilings(hw, path)
    return hw
