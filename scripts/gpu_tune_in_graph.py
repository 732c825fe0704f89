#!/usr/bin/env python
"""Time every tile of the one-row GEMV in the regime of a graphed decode step, and write the winners as a table.

  python scripts/gpu_tune_in_graph.py SHAPE [SHAPE ...] [--no-pdl] [--copies=N] [--into=TABLE.json] [--rows=M]

Why: Triton's autotuner times each config alone: one launch after a 256 MB write that flushes L2, outside a graph,
without PDL. The step runs each GEMV in a CUDA graph behind the kernel before it, with PDL and the late trigger,
on weights nobody read since the last step. Those regimes disagree: compiled for sm_90 and timed by the autotuner
(H200, session 35), every one of the 80 tiles of the 1.5B gate/up took 24-49 us for 13 us of bytes, where the
graphed step spends ~18 us on it; so the tuner's ranking need not be the step's.
Here each config of a layer GEMV (models' shapes: scripts/gemv_occupancy.py `layer_gemvs`) is launched through the
engine's own wrapper (kernels/gemv_fused.py `gemv_fused`, pinned to the config by kernels/tuned.py OVERRIDES) COPIES
times in one CUDA graph, each launch on its own weight copy (so the weights of consecutive launches are not in L2:
COPIES x the weight's bytes is at least 4x the 50 MB L2 by default), with PDL on and the late trigger unless
--no-pdl: us a launch = replay time / COPIES, median of 20 replays. The winner of each GEMV goes into the table
`--into` names (default this GPU's, kernels/tuned/<gpu>.json), replacing that key's entry, as soon as it is known;
entries carry `"source": "in-graph"`. Session 44 (H100, 1.5B + Qwen3-8B + 0.5B: ~80 s and ~100 s with compiling)
made kernels/tuned/nvidia-h100-80gb-hbm3.json this way. Prints one line a config and a JSON summary last. GPU
only: without CUDA it says so and exits 2.

--rows=M (2-16): the same for a verify block of M tokens: its M-row GEMMs (kernels/gemm_rows.py
`_gemm_fused_kernel`, keyed on M's power-of-two bucket) as models/fused_decode.py launches them: qkv (+ bias),
o_proj + residual, gate/up + SiLU x up, down + residual, all norm-free (PRENORM_ROWS: the norms are launches of
their own), every tile of `_GEMM_CONFIGS` the launch's pruning allows (split-K where K >= 2N). Why: on an H100
(session 50) the 1.5B's 16-token verify spent 1.30 ms of its 2.18 in these GEMMs, ~1.5x their bytes floor, with
tiles the autotuner picked alone; the shipped tables had none for them.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

L2_BYTES = 50 << 20
MIN_COPIES, MAX_COPIES = 4, 64


def copies_for(weight_bytes: int, asked: int | None = None) -> int:
    """Weight copies a graph cycles through: `asked`, or enough for 4x the L2 (4 to 64)."""
    if asked is not None:
        return asked
    return max(MIN_COPIES, min(MAX_COPIES, math.ceil(4 * L2_BYTES / weight_bytes)))


def parse(argv: list[str]) -> tuple[list[str], dict]:
    shapes, opts = [], {"pdl": True, "copies": None, "into": None, "rows": 1}
    for a in argv:
        if a == "--no-pdl":
            opts["pdl"] = False
        elif a.startswith("--rows="):
            v = a.split("=", 1)[1]
            if not v.isdigit() or not 2 <= int(v) <= 16:
                raise ValueError(f"--rows takes a verify block's tokens, an integer in [2, 16], got {v!r}")
            opts["rows"] = int(v)
        elif a.startswith("--copies="):
            v = a.split("=", 1)[1]
            if not v.isdigit() or not 1 <= int(v) <= 256:
                raise ValueError(f"--copies takes an integer in [1, 256], got {v!r}")
            opts["copies"] = int(v)
        elif a.startswith("--into="):
            opts["into"] = a.split("=", 1)[1]
        elif a.startswith("--"):
            raise ValueError(f"unknown option {a} (takes SHAPE ... [--no-pdl] [--copies=N] [--into=TABLE.json] "
                             "[--rows=M])")
        else:
            shapes.append(a)
    if not shapes:
        raise ValueError("name at least one shape (e.g. qwen2.5-1.5b qwen3-8b)")
    return shapes, opts


def key_for(n: int, k: int, flags: dict, dtype: str = "bfloat16") -> dict:
    """The one-row GEMV's autotuning key by name (kernels/tuned.py) for a launch of `flags` on the step's path
    (PDL late: no first-tile prefetch; no pipeline, no norm epilogue)."""
    from specpilot.kernels import gemv_fused as gf

    key = {name: False for name in gf._KEY}
    key.update(N=n, K=k, dtype=dtype, **flags)
    return key


def verify_gemms(cfg) -> list[tuple[str, int, int, dict]]:
    """(name, output columns, K, flags) of a dense layer's M-row GEMMs as a fused verify block launches them
    (models/fused_decode.py: norm-free, PRENORM_ROWS; the LM head of a block is not this kernel's)."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return [("qkv", qkv, h, dict(HAS_BIAS=bool(cfg.attention_bias))), ("o_proj", h, cfg.num_attention_heads * d,
                                                                       dict(HAS_RES=True)),
            ("gate_up", inter, h, dict(SILU_MUL=True)), ("down", h, inter, dict(HAS_RES=True))]


def gemm_key_for(n: int, k: int, rows: int, flags: dict, dtype: str = "bfloat16") -> dict:
    """The M-row kernel's autotuning key by name (kernels/tuned.py) for `rows` rows of a launch of `flags`."""
    from specpilot.kernels import gemm_rows as gr

    key = {name: False for name in gr._GEMM_KEY}
    key.update(N=n, K=k, M_BUCKET=max(1 << (rows - 1).bit_length(), gr.M_BUCKET_MIN), dtype=dtype, **flags)
    return key


def gemm_configs(n: int, k: int) -> list:
    """The M-row kernel's tiles its pruning lets a norm-free launch of this shape take (kernels/gemm_rows.py
    `_gemm_prune`, without a pinned pick)."""
    from specpilot.kernels import gemm_rows as gr

    split_ok = gr._split_k_applies(n, k, False)
    return [c for c in gr._GEMM_CONFIGS if c.kwargs["SPLIT_K"] == 1
            or split_ok and k >= 2 * c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"]]


def merge(table: dict, entries: list[dict]) -> dict:
    """`table` with each entry of `entries` in place of the same kernel and key's (or added)."""
    keyed = {(e["kernel"], json.dumps(e["key"], sort_keys=True)): e for e in table.get("entries", [])}
    for e in entries:
        keyed[(e["kernel"], json.dumps(e["key"], sort_keys=True))] = e
    return {**table, "entries": [keyed[k] for k in sorted(keyed)]}


def tune(shape: str, pdl_on: bool, copies_asked: int | None, done=lambda entry: None, rows: int = 1) -> list[dict]:
    """Every layer GEMV of `shape` timed tile by tile -> the winners' entries; `done(entry)` is called as each GEMV's
    winner is known (main writes the table then, so a run cut short by a device call's limit keeps what it timed).
    rows > 1: a verify block's M-row GEMMs of that many rows instead (--rows)."""
    import torch

    from gemv_occupancy import layer_gemvs
    from specpilot.costmodel import synthetic_config
    from specpilot.costmodel.hardware import time_median_s
    from specpilot.engine.graphs import capture
    from specpilot.kernels import gemv_fused as gf
    from specpilot.kernels import pdl, tuned

    cfg = synthetic_config(shape)
    dev, dt = torch.device("cuda"), torch.bfloat16
    pdl.set_enabled(pdl_on, dev, "late")
    gf.PDL_L2_MAX_BYTES = (8 << 20) if pdl.enabled() else 0  # the engine's default warming (EngineConfig.pdl_l2_mb)
    entries = []
    kernel = "_gemv_fused_kernel" if rows == 1 else "_gemm_fused_kernel"
    for name, n, k, flags in layer_gemvs(cfg) if rows == 1 else verify_gemms(cfg):
        silu = flags.get("SILU_MUL", False)
        out_rows = 2 * n if silu else n
        copies = copies_for(out_rows * k * 2, copies_asked)
        g = torch.Generator(device=dev).manual_seed(0)
        ws = [torch.randn(out_rows, k, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(copies)]
        x = torch.randn(rows, k, device=dev, dtype=dt, generator=g)
        kw = {}
        if flags.get("HAS_BIAS"):
            kw["bias"] = torch.randn(n, device=dev, dtype=dt, generator=g)
        if flags.get("HAS_NORM"):
            kw["norm_weight"] = torch.ones(k, device=dev, dtype=dt)
        if flags.get("HAS_RES"):
            kw["residual"] = torch.randn(rows, n, device=dev, dtype=dt, generator=g)
        if silu:
            kw["act"] = "silu_mul"
        if rows == 1:
            key = key_for(n, k, flags)
            configs = [c for c in gf._CONFIGS if silu or not c.kwargs.get("PAIRED", False)]
        else:
            key = gemm_key_for(n, k, rows, flags)
            configs = gemm_configs(n, k)
        tkey = (kernel, tuned._key(key))
        timings = {}
        for c in configs:
            tuned.OVERRIDES[tkey] = (c.kwargs, c.num_warps, c.num_stages)
            tuned.forget()
            try:  # (the capture's warm-up launches compile the tile; the autotuner takes the one config)
                graph, _ = capture(lambda: [gf.gemv_fused(x, w, **kw) for w in ws], warmup=1)
                us = time_median_s(graph.replay, warmup=1, repeats=20) * 1e6 / copies
            except Exception as e:  # a tile that does not compile or launch at this shape: skipped, said so
                print(f"{shape} {name} {c.kwargs} w{c.num_warps} s{c.num_stages}: failed ({type(e).__name__}: {e})",
                      flush=True)
                continue
            finally:
                tuned.OVERRIDES.pop(tkey, None)
            timings[(json.dumps(c.kwargs, sort_keys=True), c.num_warps, c.num_stages)] = us
            print(f"{shape} {name} {c.kwargs} w{c.num_warps} s{c.num_stages}: {us:.2f} us a launch "
                  f"({copies} copies)", flush=True)
        del ws
        torch.cuda.empty_cache()
        if not timings:
            continue
        (kwj, warps, stages), us = min(timings.items(), key=lambda kv: kv[1])
        floor_us = out_rows * k * 2 / 4.24e12 * 1e6
        entries.append({"kernel": kernel, "key": key, "runs": 1, "source": "in-graph",
                        "config": {"kwargs": json.loads(kwj), "num_warps": warps, "num_stages": stages},
                        "us": round(us, 2), "floor_us_at_4.24TBps": round(floor_us, 2),
                        "gemv": f"{shape} {name}" + (f" x{rows} rows" if rows > 1 else "")})
        done(entries[-1])
        print(f"{shape} {name} best {kwj} w{warps} s{stages}: {us:.2f} us (bytes at 4.24 TB/s: {floor_us:.2f})",
              flush=True)
    tuned.forget()
    pdl.set_enabled(False)
    return entries


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        shapes, opts = parse(argv)
    except ValueError as e:
        print(f"gpu_tune_in_graph: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_tune_in_graph: needs a CUDA GPU (run it on the device machine: scripts/GPU_SESSION.md)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # gemv_occupancy's shapes
    from specpilot.kernels import tuned

    gpu = torch.cuda.get_device_name()
    path = Path(opts["into"]) if opts["into"] else tuned.TABLES / f"{tuned.table_name(gpu)}.json"
    table = json.loads(path.read_text()) if path.is_file() else {"gpu": gpu, "entries": []}
    if table.get("gpu") != gpu:
        print(f"gpu_tune_in_graph: {path} is a table for {table.get('gpu')!r}, this GPU is {gpu!r}", file=sys.stderr)
        return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    entries: list[dict] = []

    def write(entry: dict) -> None:  # after each GEMV: the table as far as it is timed
        entries.append(entry)
        path.write_text(json.dumps(merge(table, entries), indent=1) + "\n")

    for shape in shapes:
        tune(shape, opts["pdl"], opts["copies"], write, opts["rows"])
    print(json.dumps({"table": str(path), "entries": entries}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
