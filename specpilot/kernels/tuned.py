"""Autotuning picks pinned per GPU model: the fused kernels' tiles taken from a shipped table instead of timed.

Why: Triton's autotuner times every config of a kernel at each new shape in a process (the one-row GEMV has 44-80
configs a shape: 100-140 s for the 1.5B or Qwen3-8B layer on the H200, session 35), and it times them one launch at
a time on whatever the machine is doing then. On two H200s the same kernel's best timing at one shape (1.5B
down_proj) was 15.4 us on one and 32.9 us on the other, which then took another tile. A table of picks made from
several tuning runs (scripts/tuned_table.py merges Triton's cached autotuning results: the config with the lowest
median, over the runs, of its 20th-percentile timing over its run's best; or scripts/gpu_tune_in_graph.py, timed in
the step's regime) gives every machine of that model the same tiles at once.

How: each autotuned kernel's `early_config_prune` hook (kernels/gemv_fused.py, gemm_rows.py, qkv_rope.py) passes its
surviving configs through `narrow`; where the switch is on, the launch's GPU has a table (kernels/tuned/<name>.json,
named by `table_name(torch.cuda.get_device_name())`) and the table names this launch's key and a config of the list,
only that config survives, and Triton's autotuner takes a single config without timing it. Anything else (no table,
a shape or flag set the table lacks, a pick no longer among the kernel's configs) leaves the list as it was, so the
autotuner times it as before: a table can make a launch skip tuning, never fail. Picks change only which tiles run:
the numbers are another fp32 summation order, as any autotuning choice.

A table: {"gpu": device name, "entries": [{"kernel": kernel function name, "key": {key name: value, ...,
"dtype": x's dtype}, "config": {"kwargs": {...}, "num_warps": w, "num_stages": s}}]}. The key names are the
kernel's autotuning key (`triton.autotune(key=...)`), with x's dtype for the dtypes Triton adds.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
from pathlib import Path

PINNED = False  # the process-wide switch (EngineConfig.tuned_tiles; engine._apply_program_splits sets it)
TABLE = ""  # a table file taken instead of the shipped one (EngineConfig.tuned_table); "" = kernels/tuned/<gpu>.json
TABLES = Path(__file__).parent / "tuned"
_AUTOTUNERS: list = []  # the pinned kernels' autotuners (`register`), whose per-process picks a switch flip drops
# (kernel, key) -> (kwargs, num_warps, num_stages) taken before any table, whatever PINNED says: a tuner that times
# one config after another through the real launch path (scripts/gpu_tune_in_graph.py) sets it, then `forget`s
OVERRIDES: dict = {}


def register(autotuner):
    """Note a pinned kernel's Triton autotuner (its module does, where it builds one) -> the autotuner."""
    _AUTOTUNERS.append(autotuner)
    return autotuner


def disk_cache_kwargs(autotune=None) -> dict:
    """`cache_results=True` for `triton.autotune` where that Triton takes it (3.2 and later) and
    SPECPILOT_AUTOTUNE_CACHE is not "0"; else {}.

    Why: Triton's autotuner keeps its picks in the process only, so every process that runs the engine re-timed
    every config of every fused kernel at each new shape: ~46 s at the 1.5B shape on an H100 (session 44: a step
    timing's setup 69.7 s tuned, 23.9 s from a table), ~100-140 s a shape on the H200 (session 35), each time
    `specpilot bench` starts. With it the timings go to Triton's cache dir (TRITON_CACHE_DIR, ~/.triton/cache),
    keyed by Triton's version, the GPU target, the kernel's source, its config list and the launch's key, so a
    later process on the machine takes the pick at once and a changed kernel is tuned again. A pick made on a
    noisy machine is kept too: SPECPILOT_AUTOTUNE_CACHE=0 (or an emptied cache dir) tunes afresh."""
    if os.environ.get("SPECPILOT_AUTOTUNE_CACHE", "1") == "0":
        return {}
    if autotune is None:
        import triton

        autotune = triton.autotune
    try:
        takes = "cache_results" in inspect.signature(autotune).parameters
    except (TypeError, ValueError):  # no signature to read: leave Triton's default
        takes = False
    return {"cache_results": True} if takes else {}


def autotune(kernel, configs: list, key: list, prune=None, reset_to_zero: list | None = None):
    """`kernel` under Triton's autotuner with `configs` and `key`, `prune` as its early_config_prune hook (where the
    kernel's pinned picks narrow the list: `narrow`), its timings kept on disk (`disk_cache_kwargs`), registered
    here (`register`) -> the autotuned kernel. `reset_to_zero`: arguments the kernel accumulates into (atomics),
    zeroed before each timed run so the real launch after tuning starts from zero."""
    import triton

    extra = {"prune_configs_by": {"early_config_prune": prune}} if prune is not None else {}
    if reset_to_zero:
        extra["reset_to_zero"] = list(reset_to_zero)
    return register(triton.autotune(configs=configs, key=key, **extra, **disk_cache_kwargs())(kernel))


def forget() -> None:
    """Drop every registered autotuner's per-process picks (the next launch at each shape prunes again)."""
    for autotuner in _AUTOTUNERS:
        getattr(autotuner, "cache", {}).clear()


def set_pinned(on: bool, table: str = "") -> None:
    """Switch pinning on or off, with `table` (a file) instead of the shipped table where given. A change of either
    also drops every registered autotuner's picks of this process (its `cache`: a launch key -> config, which holds
    neither), so the next launch at each shape takes the table's pick, or is tuned again (from Triton's on-disk
    results where it has them), instead of the other setting's."""
    global PINNED, TABLE
    if bool(on) != PINNED or str(table) != TABLE:
        forget()
    PINNED, TABLE = bool(on), str(table)


def table_name(gpu: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': a device name as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


@functools.lru_cache(maxsize=None)
def load(gpu: str, table: str = "") -> dict:
    """The pinned picks for GPU model `gpu`: {(kernel, key tuple): (kwargs, num_warps, num_stages)}, from the file
    `table` where given, else from the table shipped for `gpu` ({} where none ships). A table for another GPU
    inside the file, or a malformed one, is an error (ValueError): tiles tuned on another chip are not taken
    silently, and a shipped file must be right."""
    path = Path(table) if table else TABLES / f"{table_name(gpu)}.json"
    if not path.is_file():
        if table:
            raise ValueError(f"tuned_table: no file {table!r}")
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("gpu") != gpu or not isinstance(data.get("entries"), list):
            raise ValueError(f"needs 'gpu': {gpu!r} (this GPU) and a list of 'entries', has 'gpu': {data.get('gpu')!r}")
        picks = {}
        for e in data["entries"]:
            cfg = e["config"]
            picks[(e["kernel"], _key(e["key"]))] = (cfg["kwargs"], cfg["num_warps"], cfg["num_stages"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # bad JSON, a missing field, a wrong shape
        raise ValueError(f"{path}: not a tile table for {gpu!r}: {e}") from None
    return picks


def check_table(table: str, device) -> None:
    """Where `table` names a file: read it now for the GPU at `device` (ValueError, saying what is wrong, for a
    missing or malformed file or one for another GPU), so a bad table stops the engine's start, not a launch."""
    if table:
        import torch

        load(torch.cuda.get_device_name(torch.device(device)), table)


def _key(named: dict) -> tuple:
    return tuple(sorted(named.items()))


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def launch_key(key_names, named_args: dict, kwargs: dict, x_name: str = "x_ptr") -> dict:
    """The launch's autotuning key by name (as the table holds it): each key's value from the launch's arguments
    or constexpr kwargs, and x's dtype."""
    key = {n: kwargs.get(n, named_args.get(n)) for n in key_names}
    key["dtype"] = str(named_args[x_name].dtype).removeprefix("torch.")
    return key


def narrow(kernel: str, configs: list, named_args: dict, kwargs: dict, key_names, x_name: str = "x_ptr") -> list:
    """`configs` narrowed to the pinned pick for this launch where the switch is on and a table has one (module
    docstring); otherwise `configs` as they are."""
    if not PINNED and not OVERRIDES:
        return configs
    x = named_args.get(x_name)
    if x is None or getattr(x, "device", None) is None or x.device.type != "cuda":
        return configs
    key = (kernel, _key(launch_key(key_names, named_args, kwargs, x_name)))
    pick = OVERRIDES.get(key)
    if pick is None and PINNED:
        pick = load(_gpu_name(x.device.index or 0), TABLE).get(key)
    if pick is None:
        return configs
    kw, warps, stages = pick
    same = [c for c in configs if c.kwargs == kw and c.num_warps == warps and c.num_stages == stages]
    return same[:1] or configs


__all__ = ["OVERRIDES", "PINNED", "TABLE", "TABLES", "autotune", "check_table", "disk_cache_kwargs", "forget",
           "launch_key", "load", "narrow", "register", "set_pinned", "table_name"]
