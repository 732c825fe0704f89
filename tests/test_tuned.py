"""Pinned autotuning picks (kernels/tuned.py, EngineConfig.tuned_tiles) and their builder (scripts/tuned_table.py)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

import specpilot.kernels.gemm_rows as gr  # noqa: E402
import specpilot.kernels.gemv_fused as gf  # noqa: E402
import specpilot.kernels.qkv_rope as qr  # noqa: E402
from specpilot.kernels import tuned  # noqa: E402

H200 = "NVIDIA H200"
GATE_UP_15B = dict(N=8960, K=1536, HAS_BIAS=False, HAS_NORM=True, HAS_RES=False, SILU_MUL=True, NORM_OUT=False,
                   PREFETCH=False, PIPE=False)


def _script():
    path = Path(__file__).resolve().parent.parent / "scripts" / "tuned_table.py"
    spec = importlib.util.spec_from_file_location("tuned_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cuda_x(dtype=torch.bfloat16):  # what the prune hook reads of x: its device and dtype (no GPU needed)
    return SimpleNamespace(device=SimpleNamespace(type="cuda", index=0), dtype=dtype)


def _launch(flags, x):
    named = {"x_ptr": x, "N": flags["N"], "K": flags["K"]}
    kwargs = {k: v for k, v in flags.items() if k not in ("N", "K")}
    return named, kwargs


@pytest.fixture
def on_h200(monkeypatch):
    monkeypatch.setattr(tuned, "PINNED", True)
    monkeypatch.setattr(tuned, "_gpu_name", lambda index: H200)


def test_table_name():
    assert tuned.table_name("NVIDIA H200") == "nvidia-h200"
    assert tuned.table_name("NVIDIA GeForce RTX 4090 ") == "nvidia-geforce-rtx-4090"


def test_pinned_pick_narrows_the_one_row_gemv_to_the_table_config(on_h200):
    """On an H200 with the switch on, the 1.5B gate/up launch keeps only the table's config; the config is one of
    the kernel's own."""
    named, kwargs = _launch(GATE_UP_15B, _cuda_x())
    kept = gf._prune(gf._CONFIGS, named, **kwargs)
    assert len(kept) == 1 and kept[0] in gf._CONFIGS
    kw, warps, stages = tuned.load(H200)[("_gemv_fused_kernel", tuned._key({**GATE_UP_15B, "dtype": "bfloat16"}))]
    assert (kept[0].kwargs, kept[0].num_warps, kept[0].num_stages) == (kw, warps, stages)


@pytest.mark.parametrize("case", ["off", "other_gpu", "cpu", "unknown_shape", "fp16", "pick_not_listed"])
def test_without_a_pick_the_configs_stay_for_the_autotuner(monkeypatch, on_h200, case):
    """No pick (switch off, a GPU without a table, a CPU tensor, a shape or dtype the table lacks, a pick that is
    no longer among the configs): every config survives for the autotuner to time (gate/up keeps PAIRED ones)."""
    flags, x, configs = dict(GATE_UP_15B), _cuda_x(), gf._CONFIGS
    silu = list(configs)
    if case == "off":
        monkeypatch.setattr(tuned, "PINNED", False)
    elif case == "other_gpu":
        monkeypatch.setattr(tuned, "_gpu_name", lambda index: "NVIDIA A100-SXM4-80GB")  # no table ships
    elif case == "cpu":
        x = torch.zeros(1, 4, dtype=torch.bfloat16)
    elif case == "unknown_shape":
        flags["N"] = 8192
    elif case == "fp16":
        x = _cuda_x(torch.float16)
    elif case == "pick_not_listed":
        named, kwargs = _launch(flags, x)
        pick = gf._prune(configs, named, **kwargs)[0]
        silu = [c for c in configs if c is not pick]
    named, kwargs = _launch(flags, x)
    assert gf._prune(silu, named, **kwargs) == silu


def test_qkv_rope_and_rows_kernels_take_pins_too(on_h200):
    named = {"x_ptr": _cuda_x(), "K": 1536, "H": 12, "HKV": 2, "D": 128}
    kwargs = dict(HAS_BIAS=True, HAS_NORM=True, QK_NORM=False)
    assert len(qr._prune(qr._CONFIGS, named, **kwargs)) == 1
    named = {"x_ptr": _cuda_x(), "N": 1536, "K": 8960, "M_BUCKET": 8}
    kwargs = dict(HAS_BIAS=False, HAS_NORM=False, HAS_RES=True, SILU_MUL=False, NORM_OUT=False)
    kept = gr._gemm_prune(gr._GEMM_CONFIGS, named, **kwargs)
    assert len(kept) == 1 and kept[0].kwargs["SPLIT_K"] > 1  # a split-K pick survives the split rule


def test_shipped_tables_name_current_configs_and_keys():
    """Every shipped table is for the GPU its file names, and each entry names the kernel's current key and one of
    its current configs (a config list changed since the table was built must rebuild it: scripts/tuned_table.py)."""
    known = _script().kernels()
    tables = sorted(tuned.TABLES.glob("*.json"))
    assert tables, "kernels/tuned/ ships no table"
    for path in tables:
        data = json.loads(path.read_text())
        assert tuned.table_name(data["gpu"]) == path.stem
        assert tuned.load(data["gpu"])
        for e in data["entries"]:
            names, configs = known[e["kernel"]]
            assert sorted(e["key"]) == sorted([*names, "dtype"]), e
            c = e["config"]
            assert _script().config_id(c["kwargs"], c["num_warps"], c["num_stages"]) in configs, e


def test_a_table_for_another_gpu_in_the_file_is_refused(monkeypatch, tmp_path):
    (tmp_path / "nvidia-h200.json").write_text(json.dumps({"gpu": "NVIDIA H100", "entries": []}))
    monkeypatch.setattr(tuned, "TABLES", tmp_path)
    tuned.load.cache_clear()
    try:
        with pytest.raises(ValueError, match="not a tile table for 'NVIDIA H200'.*has 'gpu': 'NVIDIA H100'"):
            tuned.load(H200)
    finally:
        tuned.load.cache_clear()


def _run(tmp, name, key, timings):
    d = tmp / f"H{len(list(tmp.iterdir()))}"
    d.mkdir()
    cts = [[{"kwargs": kw, "num_warps": w, "num_stages": s, "num_ctas": 1, "maxnreg": None}, [t, t, t]]
           for (kw, w, s), t in timings]
    (d / f"{name}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": cts}))


def test_builder_merges_runs_by_mean_ratio_and_keeps_listed_picks(tmp_path):
    """Two runs of one key: the config best on average relative to each run's best wins, not the one a single run
    liked; a run from before PIPE existed (one key value fewer) reads as PIPE off; unknown kernels, configs no longer
    listed and keys that do not fit are dropped."""
    mod = _script()
    a, b, gone = ({"BLOCK_N": 32, "BLOCK_K": 128}, 8, 1), ({"BLOCK_N": 2, "BLOCK_K": 1024}, 4, 1), \
        ({"BLOCK_N": 3, "BLOCK_K": 7}, 4, 1)
    dtypes = ["torch.bfloat16"] * 3
    key = [8960, 1536, False, True, False, True, False, False]  # without PIPE (a run before session 35)
    _run(tmp_path, "_gemv_fused_kernel", key + dtypes, [(a, 10.0), (b, 11.0), (gone, 1.0)])
    _run(tmp_path, "_gemv_fused_kernel", key + [False] + dtypes, [(a, 30.0), (b, 12.0)])  # a drifting run
    _run(tmp_path, "_other_kernel", [1, 2] + dtypes, [(a, 1.0)])
    _run(tmp_path, "_gemv_fused_kernel", [1] * 12 + dtypes, [(a, 1.0)])  # too many values: not this kernel's key
    entries = mod.build(mod.read_runs([str(tmp_path)]), mod.kernels())
    assert len(entries) == 1
    e = entries[0]
    assert e["kernel"] == "_gemv_fused_kernel" and e["runs"] == 2
    assert e["key"] == {**GATE_UP_15B, "dtype": "bfloat16"}
    assert e["config"] == {"kwargs": b[0], "num_warps": 4, "num_stages": 1}  # ratios 1.1 and 1.0 beat 1.0 and 2.5
    out = tmp_path / "t.json"
    assert mod.main(["--gpu", "G", str(tmp_path), "-o", str(out)]) == 0
    assert json.loads(out.read_text())["gpu"] == "G"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert mod.main(["--gpu", "G", str(empty)]) == 1


def test_tuned_tiles_field_engine_switch_cli_and_loop(monkeypatch):
    import argparse

    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits
    from specpilot.errors import ConfigError
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY, Deployment

    monkeypatch.setattr(tuned, "PINNED", False)
    assert EngineConfig().tuned_tiles is True  # on since session 44 (the H100 table timed against tuning)
    with pytest.raises(ConfigError, match="tuned_tiles must be true or false"):
        EngineConfig(tuned_tiles="false")
    _apply_program_splits(EngineConfig(tuned_tiles=True))  # CPU: nothing to pin
    assert tuned.PINNED is False
    _apply_program_splits(EngineConfig(device="cuda", tuned_tiles=True))
    assert tuned.PINNED is True
    _apply_program_splits(EngineConfig(device="cuda", tuned_tiles=False))
    assert tuned.PINNED is False
    _apply_program_splits(EngineConfig(device="cuda"))
    assert tuned.PINNED is True
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert not engine_config(parser.parse_args(["--no-tuned-tiles"])).tuned_tiles
    assert "tuned_tiles" in EngineMeasure.LAYOUT
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert REGISTRY["tuned_tiles"].candidates(gpu.config, gpu) == [{"tuned_tiles": False}]


def test_a_switch_flip_drops_the_processes_picks(monkeypatch):
    """The autotuners' per-process picks do not hold the switch: flipping it clears them (so an A/B in one process
    compares the table with tuning), setting it again to the same value keeps them."""
    monkeypatch.setattr(tuned, "PINNED", False)
    fake = SimpleNamespace(cache={("k",): "config"})
    monkeypatch.setattr(tuned, "_AUTOTUNERS", [fake])
    tuned.set_pinned(False)
    assert fake.cache
    tuned.set_pinned(True)
    assert tuned.PINNED is True and not fake.cache
    fake.cache["k2"] = "c"
    tuned.set_pinned(True)
    assert fake.cache
    tuned.set_pinned(False)
    assert tuned.PINNED is False and not fake.cache


def test_the_pinned_kernels_register_their_autotuners():
    """Outside the interpreter (a fresh process: the kernels' modules build real autotuners at import) the three
    pinned kernels' autotuners are the ones a flip clears."""
    import os
    import subprocess
    import sys

    code = ("import specpilot.kernels.gemv_fused as g, specpilot.kernels.gemm_rows as r, "
            "specpilot.kernels.qkv_rope as q; from specpilot.kernels import tuned as t; "
            "print([a in t._AUTOTUNERS for a in (g._kernel, r._gemm_kernel, q._kernel)])")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[True, True, True]", out.stderr[-2000:]


def test_an_override_wins_over_the_table_and_the_switch(monkeypatch):
    """OVERRIDES (the in-graph tuner's) narrow a launch to their config with the switch off and before a table pick;
    a config not listed leaves the list."""
    monkeypatch.setattr(tuned, "PINNED", False)
    named, kwargs = _launch(GATE_UP_15B, _cuda_x())
    key = ("_gemv_fused_kernel", tuned._key(tuned.launch_key(gf._KEY, named, kwargs)))
    other = next(c for c in gf._CONFIGS if c.kwargs == {"BLOCK_N": 1, "BLOCK_K": 1024} and c.num_warps == 2)
    monkeypatch.setattr(tuned, "OVERRIDES", {key: (other.kwargs, other.num_warps, other.num_stages)})
    assert gf._prune(gf._CONFIGS, named, **kwargs) == [other]
    monkeypatch.setattr(tuned, "PINNED", True)
    monkeypatch.setattr(tuned, "_gpu_name", lambda index: H200)
    assert gf._prune(gf._CONFIGS, named, **kwargs) == [other]
    monkeypatch.setattr(tuned, "OVERRIDES", {key: ({"BLOCK_N": 3}, 4, 1)})
    assert gf._prune(gf._CONFIGS, named, **kwargs) == gf._CONFIGS


def test_autotuning_is_kept_on_disk_where_triton_can(monkeypatch):
    """tuned.autotune asks Triton to keep its timings on disk (cache_results) where this Triton's autotune takes
    that argument, never where it does not (an older Triton would raise TypeError at import), and not with
    SPECPILOT_AUTOTUNE_CACHE=0; the prune hook and key reach Triton, and the tuner is registered (a switch flip
    drops its picks)."""
    import triton

    def new_autotune(configs, key, prune_configs_by=None, reset_to_zero=None, cache_results=False):
        return lambda fn: SimpleNamespace(fn=fn, configs=configs, key=key, prune=prune_configs_by,
                                          cache_results=cache_results, cache={})

    def old_autotune(configs, key, prune_configs_by=None, reset_to_zero=None):
        return lambda fn: SimpleNamespace(fn=fn, configs=configs, key=key, prune=prune_configs_by, cache={})

    monkeypatch.delenv("SPECPILOT_AUTOTUNE_CACHE", raising=False)
    assert tuned.disk_cache_kwargs(new_autotune) == {"cache_results": True}
    assert tuned.disk_cache_kwargs(old_autotune) == {}
    monkeypatch.setenv("SPECPILOT_AUTOTUNE_CACHE", "0")
    assert tuned.disk_cache_kwargs(new_autotune) == {}
    monkeypatch.delenv("SPECPILOT_AUTOTUNE_CACHE")

    hook = lambda configs, named_args, **kw: configs  # noqa: E731
    for fake, cached in ((new_autotune, True), (old_autotune, None)):
        monkeypatch.setattr(triton, "autotune", fake)
        before = len(tuned._AUTOTUNERS)
        t = tuned.autotune("kernel", ["c1", "c2"], ["N", "K"], hook)
        assert (t.fn, t.configs, t.key, t.prune) == ("kernel", ["c1", "c2"], ["N", "K"], {"early_config_prune": hook})
        assert getattr(t, "cache_results", None) is cached
        assert tuned._AUTOTUNERS[-1] is t and len(tuned._AUTOTUNERS) == before + 1
        tuned._AUTOTUNERS.pop()
        assert tuned.autotune("k", [], ["N"]).prune is None  # no hook: none passed
        tuned._AUTOTUNERS.pop()


def _own_table(tmp_path, gpu, config):
    """A one-entry table file for `gpu` pinning the 1.5B gate/up launch to `config` (a gf._CONFIGS member)."""
    entry = {"kernel": "_gemv_fused_kernel", "key": {**GATE_UP_15B, "dtype": "bfloat16"},
             "config": {"kwargs": config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"gpu": gpu, "entries": [entry]}))
    return path


def test_a_table_file_of_ones_own_replaces_the_shipped_one(monkeypatch, on_h200, tmp_path):
    """EngineConfig.tuned_table -> tuned.TABLE: the launch takes that file's pick, not the shipped table's; a file
    for another GPU, a malformed one or a missing one is a ValueError naming the file (never a silent fall-back
    to tuning); a change of table drops the autotuners' per-process picks."""
    named, kwargs = _launch(GATE_UP_15B, _cuda_x())
    shipped = gf._prune(gf._CONFIGS, named, **kwargs)[0]
    other = next(c for c in gf._CONFIGS if c is not shipped)
    path = _own_table(tmp_path, H200, other)
    fake = SimpleNamespace(cache={("k",): "config"})
    monkeypatch.setattr(tuned, "_AUTOTUNERS", [fake])
    monkeypatch.setattr(tuned, "TABLE", "")
    tuned.set_pinned(True, str(path))
    assert tuned.TABLE == str(path) and not fake.cache
    assert gf._prune(gf._CONFIGS, named, **kwargs) == [other]
    tuned.set_pinned(True)
    assert gf._prune(gf._CONFIGS, named, **kwargs) == [shipped]
    tuned.load.cache_clear()
    try:
        with pytest.raises(ValueError, match="not a tile table for 'NVIDIA H200'.*'NVIDIA H100 80GB HBM3'"):
            tuned.load(H200, str(_own_table(tmp_path, "NVIDIA H100 80GB HBM3", other)))
        (tmp_path / "bad.json").write_text('{"gpu": "NVIDIA H200", "entries": [{"kernel": "k"}]}')
        with pytest.raises(ValueError, match="bad.json: not a tile table"):
            tuned.load(H200, str(tmp_path / "bad.json"))
        (tmp_path / "bad2.json").write_text("{not json")
        with pytest.raises(ValueError, match="bad2.json: not a tile table"):
            tuned.load(H200, str(tmp_path / "bad2.json"))
        with pytest.raises(ValueError, match="no file"):
            tuned.load(H200, str(tmp_path / "missing.json"))
    finally:
        tuned.load.cache_clear()
        tuned.set_pinned(False)


def test_tuned_table_field(tmp_path, monkeypatch):
    """The config field: a missing file is a ConfigError at once; a non-string one too; off CUDA (or with
    tuned_tiles off) laying out sets no table; the engine's switch snapshot restores it through the setter."""
    from specpilot.config import EngineConfig
    from specpilot.engine import _apply_program_splits, kernel_switches, restore_kernel_switches
    from specpilot.errors import ConfigError

    with pytest.raises(ConfigError, match="tuned_table: no file"):
        EngineConfig(tuned_table=str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="tuned_table must be a string"):
        EngineConfig(tuned_table=3)
    path = _own_table(tmp_path, H200, gf._CONFIGS[0])
    monkeypatch.setattr(tuned, "TABLE", "")
    monkeypatch.setattr(tuned, "PINNED", False)
    _apply_program_splits(EngineConfig(tuned_table=str(path)))  # CPU: nothing to pin
    assert (tuned.PINNED, tuned.TABLE) == (False, "")
    saved = kernel_switches()
    tuned.set_pinned(True, str(path))
    fake = SimpleNamespace(cache={("k",): "config"})
    monkeypatch.setattr(tuned, "_AUTOTUNERS", [fake])
    restore_kernel_switches(saved)
    assert (tuned.PINNED, tuned.TABLE) == (False, "") and not fake.cache
