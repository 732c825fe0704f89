"""Programmatic dependent launch for the fused one-token path (kernels/pdl.py, EngineConfig.pdl).

The CPU cannot run PDL (the interpreter has no griddepcontrol), so these tests hold the parts that decide whether it
is correct: the switch is off unless it can work; every fused-path launch made with the switch on carries
`launch_pdl=True` AND `USE_PDL=True` (a kernel launched with PDL that did not wait would race its predecessor);
and, compiled for sm_90, each kernel's `griddepcontrol.wait` comes before its first global load or store.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.errors import ConfigError

triton = pytest.importorskip("triton", reason="triton not installed")

from specpilot.kernels import pdl  # noqa: E402  (after the skip: it imports triton's griddepcontrol intrinsics)


@pytest.fixture(autouse=True)
def _switch_off():
    """Every test starts and ends with the process-wide switch off."""
    pdl._enabled = False
    yield
    pdl._enabled = False


def _force_on(monkeypatch):
    """The switch on as if on an H200 (the interpreter cannot run PDL: the recorders below strip it again)."""
    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)
    assert pdl.set_enabled(True)


# --- the switch ---------------------------------------------------------------------------------------------


def test_switch_is_off_by_default_and_stays_off_where_pdl_cannot_run():
    assert not pdl.enabled() and pdl.launch_options() == ({}, False, False)
    assert "interpreter" in pdl.unsupported_reason()  # conftest runs the kernels interpreted on CPU
    with pytest.warns(RuntimeWarning, match="pdl.*stays off.*interpreter"):
        assert pdl.set_enabled(True) is False
    assert not pdl.enabled() and pdl.launch_options().kwargs == {}
    with pytest.raises(TypeError, match="bool"):
        pdl.set_enabled("yes")


def test_switch_on_gives_the_launch_kwarg_and_the_constexpr_together(monkeypatch):
    _force_on(monkeypatch)
    opts = pdl.launch_options()
    assert opts.kwargs == {"launch_pdl": True} and opts.use_pdl is True
    opts.kwargs["launch_pdl"] = False  # a caller's copy: the switch is not changed through it
    assert pdl.launch_options().kwargs == {"launch_pdl": True}
    assert pdl.set_enabled(False) is False and pdl.launch_options() == ({}, False, False)


def test_trigger_late_reaches_the_launches_only_with_the_switch_on(monkeypatch):
    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)
    assert pdl.set_enabled(True, trigger="late") and pdl.launch_options() == ({"launch_pdl": True}, True, True)
    assert pdl.set_enabled(True) and pdl.launch_options().late is False  # "start" unless asked
    assert pdl.set_enabled(False, trigger="late") is False and pdl.launch_options() == ({}, False, False)
    with pytest.raises(ValueError, match="trigger"):
        pdl.set_enabled(True, trigger="end")
    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: "no CUDA device")
    with pytest.warns(RuntimeWarning, match="stays off"):  # where PDL cannot run, "late" cannot either
        assert pdl.set_enabled(True, trigger="late") is False
    assert pdl.launch_options().late is False


# --- the config field and the engine ------------------------------------------------------------------------


def test_config_field_validates_and_round_trips():
    assert EngineConfig().pdl is True  # on since session 26 (the late trigger: faster on the H200, exact)
    cfg = EngineConfig(pdl=True)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    for bad in ("false", 1, None):
        with pytest.raises(ConfigError, match="pdl"):
            EngineConfig(pdl=bad)
    assert EngineConfig().pdl_trigger == "late" and EngineConfig().pdl_late
    late = EngineConfig(pdl=True, pdl_trigger="late")
    assert EngineConfig.from_dict(late.to_dict()) == late
    with pytest.raises(ConfigError, match="pdl_trigger"):
        EngineConfig(pdl=True, pdl_trigger="end")
    assert not EngineConfig(pdl=False).pdl_late  # a trigger without PDL says nothing
    assert EngineConfig(pdl=True, pdl_l2_mb=36).pdl_l2_mb == 36 and EngineConfig().pdl_l2_mb == 8  # session 29
    for bad in (-1, 1.5, True, "36"):
        with pytest.raises(ConfigError, match="pdl_l2_mb"):
            EngineConfig(pdl=True, pdl_l2_mb=bad)
    assert EngineConfig(pdl=False).pdl_l2_mb == 8  # on by default, so without PDL it is allowed and does nothing
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ConfigError, match="pdl_l2_next_mb"):
            EngineConfig(pdl_l2_next_mb=bad)
    assert EngineConfig().pdl_l2_share == 1.0 and EngineConfig(pdl_l2_mb=36, pdl_l2_share=0.25).pdl_l2_share == 0.25
    share = EngineConfig(pdl_l2_mb=36, pdl_l2_share=0.125)
    assert EngineConfig.from_dict(share.to_dict()) == share
    for bad in (0, 0.0, -0.25, 1.5, 0.3, True, "0.25"):  # 0.3: not a multiple of 1/64
        with pytest.raises(ConfigError, match="pdl_l2_share must be"):
            EngineConfig(pdl_l2_mb=36, pdl_l2_share=bad)
    with pytest.raises(ConfigError, match="pdl_l2_share needs pdl_l2_mb"):
        EngineConfig(pdl_l2_mb=0, pdl_l2_share=0.25)  # a share of nothing warmed: an error, not a silent no-op


def test_cli_derives_the_pdl_flag():
    import argparse

    from specpilot.cli import add_engine_flags, engine_config

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).pdl  # on by default (session 26)
    assert not engine_config(parser.parse_args(["--no-pdl"])).pdl
    assert engine_config(parser.parse_args([])).pdl_trigger == "late"
    assert engine_config(parser.parse_args(["--pdl-trigger", "start"])).pdl_trigger == "start"
    assert engine_config(parser.parse_args(["--pdl-l2-mb", "8"])).pdl_l2_mb == 8
    assert engine_config(parser.parse_args(["--pdl-l2-mb", "8", "--pdl-l2-share", "0.25"])).pdl_l2_share == 0.25
    assert engine_config(parser.parse_args(["--pdl-l2-next-mb", "16"])).pdl_l2_next_mb == 16
    assert engine_config(parser.parse_args([])).pdl_l2_next_mb == 8  # on by default (session 34)
    assert engine_config(parser.parse_args(["--pdl-l2-next-mb", "0"])).pdl_l2_next_mb == 0


def test_engine_sets_the_switch_from_the_config(monkeypatch):
    from specpilot.engine import _apply_pdl
    from specpilot.kernels import gemv_fused

    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)  # as on an H200
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ignored quietly on CPU, like the other CUDA switches
        _apply_pdl(EngineConfig(pdl=True))
    assert not pdl.enabled()
    _apply_pdl(EngineConfig(device="cuda"))  # the default: on, late trigger
    assert pdl.enabled() and pdl.launch_options().late
    _apply_pdl(EngineConfig(device="cuda", pdl_trigger="start"))
    assert pdl.enabled() and not pdl.launch_options().late
    assert gemv_fused.PDL_L2_MAX_BYTES == 8 << 20  # the default warms GEMVs of <= 8 MiB (session 29)
    _apply_pdl(EngineConfig(device="cuda", pdl_l2_mb=36))
    assert gemv_fused.PDL_L2_MAX_BYTES == 36 << 20  # the L2 warming follows the config, and only with PDL on
    assert gemv_fused.PDL_L2_PART == 64  # all of each warmed weight unless a share is asked for
    _apply_pdl(EngineConfig(device="cuda", pdl_l2_mb=36, pdl_l2_share=0.25))
    assert gemv_fused.PDL_L2_MAX_BYTES == 36 << 20 and gemv_fused.PDL_L2_PART == 16
    _apply_pdl(EngineConfig(device="cuda", pdl_l2_mb=0))
    assert gemv_fused.PDL_L2_MAX_BYTES == 0 and gemv_fused.PDL_L2_PART == 64
    assert gemv_fused.PDL_L2_NEXT_BYTES == 8 << 20  # the config's default
    _apply_pdl(EngineConfig(device="cuda", pdl_l2_next_mb=0))
    assert gemv_fused.PDL_L2_NEXT_BYTES == 0
    _apply_pdl(EngineConfig(device="cuda", pdl_l2_next_mb=16))
    assert gemv_fused.PDL_L2_NEXT_BYTES == 16 << 20
    _apply_pdl(EngineConfig(device="cuda", pdl=False))  # the newest config decides
    assert not pdl.enabled() and not pdl.launch_options().late
    assert gemv_fused.PDL_L2_MAX_BYTES == 0  # no warming without PDL (it is issued before the PDL wait)
    _apply_pdl(EngineConfig(device="cuda", pdl=False, pdl_l2_next_mb=16))
    assert gemv_fused.PDL_L2_NEXT_BYTES == 0
    # on by default, so where it cannot act it stays off without a word: without fused_decode, before Hopper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for needs in (dict(fused_decode=False), dict(fused_projections=False)):
            _apply_pdl(EngineConfig(device="cuda", **needs))
            assert not pdl.enabled()
        monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: "the CUDA device is sm_80")
        _apply_pdl(EngineConfig(device="cuda"))
        assert not pdl.enabled()


def test_next_warming_splits_the_budget_over_gate_and_up_and_stays_off_where_it_cannot_act(monkeypatch):
    """gemv_fused.next_warming (EngineConfig.pdl_l2_next_mb): under PDL the head of each half of a [2I, K] gate/up
    weight, half of the budget each in whole 16-byte granules and never past the half; off (this launch's weight as
    dummy, NX_PF False) without PDL, without a budget or a weight, where granules would not be whole, or behind a
    launch whose own weight is not warmed (it streams from DRAM: HBM is not idle)."""
    from specpilot.kernels import gemv_fused as gf

    o_proj = torch.zeros(4, 8, dtype=torch.bfloat16)  # 64 bytes, rows of 16
    gate_up = torch.zeros(2 * 64, 32, dtype=torch.bfloat16)  # halves of 64 x 32 x 2 = 4096 bytes
    monkeypatch.setattr(gf, "PDL_L2_MAX_BYTES", 64)
    monkeypatch.setattr(gf, "PDL_L2_NEXT_BYTES", 1000)
    (ptr, off, each), on = gf.next_warming(gate_up, True, True, o_proj)
    assert on and ptr is gate_up and off == 4096 and each == 496  # 500 rounded down to granules
    monkeypatch.setattr(gf, "PDL_L2_NEXT_BYTES", 1 << 30)  # more than the weight: each half whole, no further
    assert gf.next_warming(gate_up, True, True, o_proj) == ((gate_up, 4096, 4096), True)
    assert gf.next_warming(gate_up, False, True, o_proj) == ((gate_up, 0, 8192), True)  # one range: all of it
    for args in ((gate_up, True, False), (None, True, True)):  # no PDL (nothing precedes a wait), no weight
        assert gf.next_warming(*args, o_proj) == ((o_proj, 0, 0), False), args
    monkeypatch.setattr(gf, "PDL_L2_MAX_BYTES", 63)  # o_proj not warmed itself: it reads DRAM, HBM is not idle
    assert gf.next_warming(gate_up, True, True, o_proj) == ((o_proj, 0, 0), False)
    monkeypatch.setattr(gf, "PDL_L2_MAX_BYTES", 64)
    monkeypatch.setattr(gf, "PDL_L2_NEXT_BYTES", 0)
    assert gf.next_warming(gate_up, True, True, o_proj) == ((o_proj, 0, 0), False)
    monkeypatch.setattr(gf, "PDL_L2_NEXT_BYTES", 1 << 20)
    odd = torch.zeros(2 * 3, 5, dtype=torch.bfloat16)  # halves of 30 bytes: not whole granules
    assert gf.next_warming(odd, True, True, o_proj) == ((o_proj, 0, 0), False)
    assert gf.next_warming(gate_up.t(), True, True, o_proj) == ((o_proj, 0, 0), False)  # not contiguous
    with pytest.raises(ValueError, match="warm_next_halves"):
        gf.next_warming(torch.zeros(3, 16, dtype=torch.bfloat16), True, True, o_proj)


def test_o_proj_hands_gate_up_over_only_for_one_token_with_the_warming_on(monkeypatch):
    """models/fused_decode._next_warm: gate/up's bf16 weight for o_proj's one-token launch when
    PDL_L2_NEXT_BYTES > 0 (whether o_proj's launch can warm it is gemv_fused.next_warming's to say); None for
    verify blocks, with the warming off, or for a 12-bit gate/up."""
    from types import SimpleNamespace

    from specpilot.kernels import gemv_fused as gf
    from specpilot.models.fused_decode import _next_warm

    w = torch.zeros(8, 4)
    mlp = SimpleNamespace(gate_up_proj=SimpleNamespace(weight=w))
    monkeypatch.setattr(gf, "PDL_L2_NEXT_BYTES", 8 << 20)
    assert _next_warm(mlp, 1) is w
    assert _next_warm(mlp, 5) is None
    assert _next_warm(SimpleNamespace(gate_up_proj=SimpleNamespace(weight=w, packed12=object())), 1) is None
    monkeypatch.setattr(gf, "PDL_L2_NEXT_BYTES", 0)
    assert _next_warm(mlp, 1) is None


def test_the_l2_warming_takes_the_weights_that_fit_and_the_share(monkeypatch):
    """gemv_fused.l2_warming: L2_PF only under PDL, for weights of at most PDL_L2_MAX_BYTES whose rows are whole
    16-byte granules; L2_PART the configured share there and 64 (the one variant) everywhere else."""
    from specpilot.kernels import gemv_fused as gf

    small, big, odd = torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(1024, 64), torch.empty(64, 10)
    monkeypatch.setattr(gf, "PDL_L2_MAX_BYTES", 64 * 64 * 2)
    monkeypatch.setattr(gf, "PDL_L2_PART", 16)
    assert gf.l2_warming(small, True) == {"L2_PF": True, "L2_PART": 16}
    assert gf.l2_warming(small, False) == {"L2_PF": False, "L2_PART": 64}  # no PDL: nothing before a wait
    assert gf.l2_warming(big, True) == {"L2_PF": False, "L2_PART": 64}  # larger than the limit
    assert gf.l2_warming(odd, True) == {"L2_PF": False, "L2_PART": 64}  # rows of 40 bytes: granules cross rows
    monkeypatch.setattr(gf, "PDL_L2_MAX_BYTES", 0)
    assert gf.l2_warming(small, True) == {"L2_PF": False, "L2_PART": 64}
    monkeypatch.setattr(gf, "PDL_L2_MAX_BYTES", 1 << 20)
    monkeypatch.setattr(gf, "PDL_L2_PART", 0)
    with pytest.raises(ValueError, match="PDL_L2_PART"):
        gf.l2_warming(small, True)


def test_laying_out_a_model_applies_the_switch(tiny_model_dir, monkeypatch):
    from specpilot import engine
    from specpilot.models import load_model

    seen = []
    monkeypatch.setattr(engine, "_apply_pdl", lambda config: seen.append(config.pdl))
    engine._apply_layout(load_model(tiny_model_dir("qwen2")), EngineConfig(pdl=True))
    assert seen == [True]


# --- every fused-path launch carries launch_pdl and USE_PDL together -------------------------------------------


class Recorder:
    """Stands in for a Triton kernel: records each launch's keyword arguments, then runs the real (interpreted)
    kernel without PDL, which the interpreter cannot run."""

    def __init__(self, name: str, kernel, log: list):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, dict(kwargs)))
            kwargs.pop("launch_pdl", None)
            kwargs["USE_PDL"] = False
            return self.kernel[grid](*args, **kwargs)

        return launch


FUSED_PATH = {"gemv_fused": ("_kernel",), "gemm_rows": ("_gemm_kernel",), "rope_write": ("_rope_write_kernel",),
              "decode_attention": ("_split_merge_kernel",), "rope_attention": ("_rope_attention_kernel",)}


def _record(monkeypatch, log: list, also_unfused: bool = False) -> None:
    import importlib

    for module, names in FUSED_PATH.items():
        mod = importlib.import_module(f"specpilot.kernels.{module}")
        for name in names + (("_split_kernel", "_combine_kernel") if also_unfused and module == "decode_attention"
                             else ()):
            monkeypatch.setattr(mod, name, Recorder(name, getattr(mod, name), log))


def _pdl_of(kwargs: dict) -> tuple[bool, bool]:
    return kwargs.get("launch_pdl", False), kwargs.get("USE_PDL", False)


@pytest.mark.parametrize("on", [False, True])
def test_each_fused_path_kernel_launches_with_pdl_exactly_when_switched_on(monkeypatch, on):
    from specpilot.kernels.decode_attention import decode_attention, decode_attention_reference
    from specpilot.kernels.gemv_fused import gemv_fused, gemv_fused_reference
    from specpilot.kernels.rope_write import rope_write, rope_write_reference

    if on:
        _force_on(monkeypatch)
    log = []
    _record(monkeypatch, log, also_unfused=True)
    torch.manual_seed(0)
    x, w, nw = torch.randn(1, 64), torch.randn(24, 64), torch.rand(64) + 0.5
    y = gemv_fused(x, w, norm_weight=nw)
    assert torch.allclose(y, gemv_fused_reference(x, w, norm_weight=nw), atol=1e-5)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    cos, sin = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    pos = torch.tensor([[5]])
    kc, vc = torch.zeros(1, 2, 32, 16), torch.zeros(1, 2, 32, 16)
    kc2, vc2 = kc.clone(), vc.clone()
    qo = rope_write(q, k, v, cos, sin, pos, kc, vc)
    assert torch.allclose(qo, rope_write_reference(q, k, v, cos, sin, pos, kc2, vc2), atol=1e-5)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    kc.normal_(), vc.normal_()
    out = decode_attention(qo, kc, vc, pos, split_s=8, block_s=8, one_launch=True)
    assert torch.allclose(out, decode_attention_reference(qo, kc, vc, pos), atol=1e-5)
    decode_attention(qo, kc, vc, pos, split_s=8, block_s=8)  # two launches: not the fused path
    fused = {name: _pdl_of(kw) for name, kw in log if name not in ("_split_kernel", "_combine_kernel")}
    assert fused == {"_kernel": (on, on), "_rope_write_kernel": (on, on), "_split_merge_kernel": (on, on)}
    # the split + merge pair never launches with PDL: its kernels do not wait
    assert [(name, _pdl_of(kw)) for name, kw in log if name in ("_split_kernel", "_combine_kernel")] == \
        [("_split_kernel", (False, False)), ("_combine_kernel", (False, False))]


@pytest.mark.parametrize("on, hint, rows", [(False, True, 16), (True, False, 16), (True, True, 16),
                                             (True, True, 32)])
def test_the_attention_takes_the_kv_hint_only_under_pdl_and_over_contiguous_rows(monkeypatch, on, hint, rows):
    """decode_attention.PDL_KV_L2: the one-launch attention's KV_L2 constexpr is on exactly when PDL is, the switch
    is, and the cache's rows of D elements lie contiguous (rows 32: a [.., S, 2D] pool's first halves, whose rows
    are not); the output is the same either way (the interpreted kernel runs without PDL, as every recorder's)."""
    from specpilot.kernels import decode_attention as da

    if on:
        _force_on(monkeypatch)
    monkeypatch.setattr(da, "PDL_KV_L2", hint)
    log = []
    _record(monkeypatch, log)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, 16)
    k, v = torch.randn(1, 2, 32, rows)[..., :16], torch.randn(1, 2, 32, rows)[..., :16]
    pos = torch.tensor([[20]])
    out = da.decode_attention(q, k, v, pos, split_s=8, block_s=8, one_launch=True)
    assert torch.allclose(out, da.decode_attention_reference(q, k, v, pos), atol=1e-5)
    assert [(name, kw["KV_L2"]) for name, kw in log] == [("_split_merge_kernel", on and hint and rows == 16)]


def test_the_engine_sets_the_kv_hint_the_rope_split_and_the_attention_split_from_the_config(monkeypatch):
    """EngineConfig.pdl_kv_l2 -> decode_attention.PDL_KV_L2 (with PDL on only), rope_q_heads ->
    rope_write.Q_HEADS_PER_PROGRAM and attn_split_keys -> decode_attention.ONE_LAUNCH_SPLIT (on CUDA only); each
    validated, each a CLI flag, each a loop mechanism."""
    import argparse

    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.engine import _apply_pdl, _apply_program_splits
    from specpilot.errors import ConfigError
    from specpilot.kernels import decode_attention, rope_write
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY

    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)  # as on an H200
    monkeypatch.setattr(decode_attention, "PDL_KV_L2", False)
    monkeypatch.setattr(rope_write, "Q_HEADS_PER_PROGRAM", 0)
    assert EngineConfig().pdl_kv_l2 is False  # slower on the H200 (session 27)
    assert EngineConfig().rope_q_heads == 8 and EngineConfig().attn_split_keys == 128  # as timed there
    _apply_pdl(EngineConfig(device="cuda", pdl_kv_l2=True))
    assert pdl.enabled() and decode_attention.PDL_KV_L2 is True
    _apply_pdl(EngineConfig(device="cuda"))
    assert decode_attention.PDL_KV_L2 is False
    _apply_pdl(EngineConfig(device="cuda", pdl_kv_l2=True, fused_decode=False))  # no fused path: no PDL, no hint
    assert not pdl.enabled() and decode_attention.PDL_KV_L2 is False
    monkeypatch.setattr(decode_attention, "ONE_LAUNCH_SPLIT", (128, 64))
    _apply_program_splits(EngineConfig(device="cuda", rope_q_heads=4, attn_split_keys=32))
    assert rope_write.Q_HEADS_PER_PROGRAM == 4 and decode_attention.ONE_LAUNCH_SPLIT == (32, 32)
    _apply_program_splits(EngineConfig(device="cuda", attn_split_keys=256))
    assert rope_write.Q_HEADS_PER_PROGRAM == 8 and decode_attention.ONE_LAUNCH_SPLIT == (256, 128)
    _apply_program_splits(EngineConfig(rope_q_heads=4, attn_split_keys=64))  # CPU: the layouts the CPU tests pin
    assert rope_write.Q_HEADS_PER_PROGRAM == 0 and decode_attention.ONE_LAUNCH_SPLIT == (128, 64)
    for bad in (0, 48, 2048, True, 64.0):
        with pytest.raises(ConfigError, match="attn_split_keys must be a power of two"):
            EngineConfig(attn_split_keys=bad)
    with pytest.raises(ConfigError, match="pdl_kv_l2 must be true or false"):
        EngineConfig(pdl_kv_l2="false")
    with pytest.raises(ConfigError, match="pdl_kv_l2 needs pdl"):
        EngineConfig(pdl=False, pdl_kv_l2=True)
    for bad in (-1, True, 2.0):
        with pytest.raises(ConfigError, match="rope_q_heads must be an integer >= 0"):
            EngineConfig(rope_q_heads=bad)
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args(["--pdl-kv-l2"])).pdl_kv_l2
    assert engine_config(parser.parse_args(["--rope-q-heads", "0"])).rope_q_heads == 0
    assert engine_config(parser.parse_args(["--attn-split-keys", "64"])).attn_split_keys == 64
    assert {"pdl_kv_l2", "rope_q_heads", "attn_split_keys"} <= set(EngineMeasure.LAYOUT)
    assert REGISTRY["rope_split"].fields == {"rope_q_heads": [4, 16, 0]}
    assert REGISTRY["attn_split"].fields == {"attn_split_keys": [64, 256, 128]}
    assert REGISTRY["pdl_kv_l2"].fields == {"pdl_kv_l2": [True, False]}


def test_the_engine_sets_the_attention_kv_preload_from_the_config(monkeypatch):
    """EngineConfig.attn_kv_preload -> decode_attention.KV_PRELOAD with PDL on only (off by default); validated, a
    CLI flag, a loop mechanism only under the late trigger; the one-launch attention takes PRELOAD only at T = 1,
    with one or two blocks a slice, and not under the "start" trigger (kernels/decode_attention.py says why)."""
    import argparse

    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.engine import _apply_pdl
    from specpilot.errors import ConfigError
    from specpilot.kernels import decode_attention as da
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY, Deployment

    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)  # as on an H200
    monkeypatch.setattr(da, "KV_PRELOAD", False)
    assert EngineConfig().attn_kv_preload is False
    _apply_pdl(EngineConfig(device="cuda", attn_kv_preload=True))
    assert pdl.enabled() and da.KV_PRELOAD is True
    _apply_pdl(EngineConfig(device="cuda"))
    assert da.KV_PRELOAD is False
    _apply_pdl(EngineConfig(device="cuda", attn_kv_preload=True, pdl=False))  # it needs PDL's wait to mean anything
    assert not pdl.enabled() and da.KV_PRELOAD is False
    with pytest.raises(ConfigError, match="attn_kv_preload must be true or false"):
        EngineConfig(attn_kv_preload="true")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args(["--attn-kv-preload"])).attn_kv_preload is True
    assert "attn_kv_preload" in EngineMeasure.LAYOUT
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert REGISTRY["attn_kv_preload"].candidates(gpu.config, gpu) == [{"attn_kv_preload": True}]
    assert not REGISTRY["attn_kv_preload"].applies(gpu, gpu.config.with_(pdl_trigger="start"))
    log = []
    _record(monkeypatch, log)
    q, k, v = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16)
    pos = torch.tensor([[5]])
    for on, trigger, split, t, want in ((False, "late", (32, 16), 1, (False, 1)), (True, "late", (32, 16), 1, (True, 2)),
                                        (True, "late", (16, 16), 1, (True, 1)), (True, "late", (64, 16), 1, (False, 1)),
                                        (True, "late", (32, 16), 3, (False, 1)),
                                        (True, "start", (32, 16), 1, (False, 1))):
        monkeypatch.setattr(da, "KV_PRELOAD", on)
        assert pdl.set_enabled(True, trigger=trigger)
        qt, pt = (q, pos) if t == 1 else (q.expand(1, 4, t, 16), torch.tensor([[5, 6, 7]]))
        da.decode_attention(qt, k, v, pt, split_s=split[0], block_s=split[1], one_launch=True)
        kw = log[-1][1]
        assert (kw["PRELOAD"], kw["PRE_NB"]) == want, (on, trigger, split, t)
        assert "num_warps" not in kw  # Triton's default unless attn_warps says otherwise
    # EngineConfig.attn_warps -> ONE_LAUNCH_WARPS (CUDA only) -> the launch's num_warps
    from specpilot.engine import _apply_program_splits

    monkeypatch.setattr(da, "ONE_LAUNCH_WARPS", 0)
    monkeypatch.setattr(da, "ONE_LAUNCH_SPLIT", (128, 64))
    _apply_program_splits(EngineConfig(device="cuda", attn_warps=8))
    assert da.ONE_LAUNCH_WARPS == 8
    da.decode_attention(q, k, v, pos, split_s=32, block_s=16, one_launch=True)
    assert log[-1][1]["num_warps"] == 8
    _apply_program_splits(EngineConfig(attn_warps=8))  # CPU: the default layout
    assert da.ONE_LAUNCH_WARPS == 0
    with pytest.raises(ConfigError, match="attn_warps must be 0"):
        EngineConfig(attn_warps=3)
    assert REGISTRY["attn_warps"].candidates(gpu.config, gpu) == [{"attn_warps": 8}]


def test_the_engine_sets_the_attention_merge_chunk_and_early_positions_from_the_config(monkeypatch):
    """EngineConfig.attn_merge_chunk -> decode_attention.MERGE_CHUNK (CUDA only) and attn_early_pos ->
    PDL_EARLY_POS (with PDL on only); validated, CLI flags, loop mechanisms; the launch passes the chunk (no wider
    than the slices), the merge's rows (the GQA group's, as a power of two) and EARLY_POS only under PDL."""
    import argparse

    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.engine import _apply_pdl, _apply_program_splits
    from specpilot.errors import ConfigError
    from specpilot.kernels import decode_attention as da
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY

    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)  # as on an H200
    monkeypatch.setattr(da, "PDL_EARLY_POS", False)
    monkeypatch.setattr(da, "MERGE_CHUNK", 0)
    monkeypatch.setattr(da, "ONE_LAUNCH_SPLIT", (128, 64))
    assert EngineConfig().attn_merge_chunk == 0 and EngineConfig().attn_early_pos is True  # as timed (session 28)
    _apply_pdl(EngineConfig(device="cuda"))
    assert pdl.enabled() and da.PDL_EARLY_POS is True
    _apply_pdl(EngineConfig(device="cuda", attn_early_pos=False))
    assert pdl.enabled() and da.PDL_EARLY_POS is False
    _apply_pdl(EngineConfig(device="cuda", pdl=False))  # a default that needs PDL: nothing without it
    assert not pdl.enabled() and da.PDL_EARLY_POS is False
    _apply_pdl(EngineConfig(device="cuda", attn_early_pos=True, fused_decode=False))  # no fused path: no PDL
    assert not pdl.enabled() and da.PDL_EARLY_POS is False
    _apply_program_splits(EngineConfig(device="cuda", attn_merge_chunk=8))
    assert da.MERGE_CHUNK == 8
    _apply_program_splits(EngineConfig(attn_merge_chunk=8))  # CPU: the serial merge the CPU tests pin
    assert da.MERGE_CHUNK == 0
    for bad in (-1, 3, 128, True, 8.0):
        with pytest.raises(ConfigError, match="attn_merge_chunk must be 0 or a power of two"):
            EngineConfig(attn_merge_chunk=bad)
    with pytest.raises(ConfigError, match="attn_early_pos must be true or false"):
        EngineConfig(attn_early_pos="false")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    got = engine_config(parser.parse_args(["--attn-merge-chunk", "4", "--no-attn-early-pos"]))
    assert got.attn_merge_chunk == 4 and got.attn_early_pos is False
    assert {"attn_merge_chunk", "attn_early_pos"} <= set(EngineMeasure.LAYOUT)
    assert REGISTRY["attn_merge"].fields == {"attn_merge_chunk": [8, 4, 0]}
    assert REGISTRY["attn_early_pos"].fields == {"attn_early_pos": [True, False]}
    log = []
    _record(monkeypatch, log)
    for on, chunk in ((False, 8), (True, 8), (True, 0)):
        if on:
            _force_on(monkeypatch)
        monkeypatch.setattr(da, "PDL_EARLY_POS", True)
        monkeypatch.setattr(da, "MERGE_CHUNK", chunk)
        log.clear()
        torch.manual_seed(0)
        q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
        pos = torch.tensor([[20]])
        out = da.decode_attention(q, k, v, pos, split_s=8, block_s=8, one_launch=True)
        assert torch.allclose(out, da.decode_attention_reference(q, k, v, pos), atol=1e-5)
        assert [(kw["EARLY_POS"], kw["MERGE_CH"], kw["MERGE_R"]) for _, kw in log] == [(on, min(chunk, 4), 4)]


@pytest.mark.parametrize("trigger", ["start", "late"])
def test_the_gemvs_take_the_trigger_and_the_latency_bound_launches_keep_theirs(tiny_model_dir, monkeypatch, trigger):
    """EngineConfig.pdl_trigger "late": every GEMV launch of a fused one-token step (one-row kernel) and of a fused
    verify step (M-row kernel) carries PDL_LATE=True, "start" False; RoPE + K/V write and attention never take it
    (a few programs each: they let the GEMV after them launch first thing); the logits stay the switch off's."""
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen3")).use_fused_decode().use_fused_verify()

    def steps(m):
        cache = m.new_cache(1, 32)
        with torch.no_grad():
            m(torch.arange(3, 23)[None], torch.arange(20)[None], cache, kv_len=20)
            del log[:]
            one = m.logits(m(torch.tensor([[8]]), torch.tensor([[20]]), cache, kv_len=None))
            block = m.logits(m(torch.tensor([[8, 9, 10]]), torch.arange(21, 24)[None], cache, kv_len=None))
        return one, block

    log = []
    _record(monkeypatch, log)
    off = steps(copy.deepcopy(model))
    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)
    assert pdl.set_enabled(True, trigger=trigger)
    on = steps(model)
    gemvs = [kw.get("PDL_LATE") for name, kw in log if name in ("_kernel", "_gemm_kernel")]
    assert {"_kernel", "_gemm_kernel"} <= {name for name, _ in log} and gemvs
    assert gemvs == [trigger == "late"] * len(gemvs)
    assert all("PDL_LATE" not in kw for name, kw in log if name not in ("_kernel", "_gemm_kernel"))
    assert all(torch.equal(a, b) for a, b in zip(on, off))


@pytest.mark.parametrize("rope_in_attention", [False, True])
def test_a_fused_decode_step_launches_every_kernel_with_pdl_and_keeps_its_numbers(tiny_model_dir, monkeypatch,
                                                                                   rope_in_attention):
    """One graphed-shape one-token step of a tiny model: with the switch on, all 6 launches a layer (5 with
    rope_in_attention: RoPE + K/V write inside the attention launch) and the LM head GEMV carry launch_pdl=True and
    USE_PDL=True (one without would run with stream order, one with launch_pdl but no wait would race its
    predecessor); the logits are those of the switch off."""
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen3")).use_fused_decode().use_rope_in_attention(rope_in_attention)
    L = model.config.num_hidden_layers
    per_layer = 5 if rope_in_attention else 6

    def step(m):
        cache = m.new_cache(1, 32)
        ids, positions = torch.tensor([[3, 9, 27, 4, 11, 5]]), torch.arange(6)[None]
        with torch.no_grad():
            m(ids, positions, cache, kv_len=6)  # prefill: the regular path
            del log[:]
            return m.logits(m(torch.tensor([[8]]), torch.tensor([[6]]), cache, kv_len=None))

    log = []
    _record(monkeypatch, log)
    off = step(copy.deepcopy(model))
    assert len(log) == per_layer * L + 1 and all(_pdl_of(kw) == (False, False) for _, kw in log)
    names = [name for name, _ in log]
    assert ("_rope_attention_kernel" in names, "_rope_write_kernel" in names) == (rope_in_attention,
                                                                                 not rope_in_attention)
    _force_on(monkeypatch)
    on = step(model)
    assert len(log) == per_layer * L + 1
    assert [name for name, kw in log if _pdl_of(kw) != (True, True)] == []
    assert torch.equal(on, off)


def test_a_fused_verify_step_launches_its_gemvs_and_rope_write_with_pdl_and_keeps_its_numbers(tiny_model_dir,
                                                                                               monkeypatch):
    """A 5-token fused verify step (fused_verify): with the switch on, its 4 M-row GEMVs and RoPE + K/V write a
    layer carry launch_pdl and USE_PDL; the split-KV attention pair never does (it does not wait: stream order
    keeps it after its predecessor, and a PDL kernel after it waits for it); the logits are the switch off's."""
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen3")).use_fused_decode().use_fused_verify()
    L = model.config.num_hidden_layers

    def step(m):
        cache = m.new_cache(1, 32)
        with torch.no_grad():
            m(torch.arange(3, 23)[None], torch.arange(20)[None], cache, kv_len=20)  # prefill of 20: regular
            del log[:]
            return m.logits(m(torch.tensor([[8, 9, 10, 11, 12]]), torch.arange(20, 25)[None], cache, kv_len=None))

    log = []
    _record(monkeypatch, log, also_unfused=True)
    off = step(copy.deepcopy(model))
    assert all(_pdl_of(kw) == (False, False) for _, kw in log)
    _force_on(monkeypatch)
    on = step(model)
    layer = ["_gemm_kernel", "_rope_write_kernel", "_split_kernel", "_combine_kernel"] + ["_gemm_kernel"] * 3
    assert [name for name, _ in log] == layer * L
    assert all(_pdl_of(kw) == ((True, True) if name in ("_gemm_kernel", "_rope_write_kernel") else (False, False))
               for name, kw in log)
    assert torch.equal(on, off)


# --- compiled for sm_90: nothing touches global memory before the wait ----------------------------------------


def test_compiled_kernels_wait_before_their_first_global_access(sm90_report):
    """tests/pdl_ptx.py compiles each fused-path kernel for sm_90 (no GPU needed) in a process without the
    interpreter. With USE_PDL: launch_dependents, then wait, in the entry block, before any global load, store or
    atomic (so before every one of them in execution order); with PDL_LATE the wait so, and launch_dependents past
    the K loop's branch and before any store; without USE_PDL: no griddepcontrol at all."""
    report = sm90_report("pdl_ptx.py")
    assert {"gemv_norm_bias", "gemv_residual", "gemv_norm_silu_mul", "gemv_norm_silu_mul_paired",
            "gemm_norm_bias", "gemm_residual", "gemm_norm_silu_mul", "gemm_residual_split_k", "rope_write_qk_norm",
            "attention_one_launch", "rope_attention_qk_norm", "gemv_residual_norm_out", "gemm_residual_norm_out",
            "gemm_residual_split_k_norm_out", "gemv12_residual_norm_out", "gemv_norm_bias_prefetch",
            "gemv_residual_prefetch", "gemv_norm_silu_mul_prefetch", "gemv_norm_silu_mul_paired_prefetch",
            "gemv_norm_bias_late", "gemv_norm_silu_mul_paired_prefetch_late", "gemv_residual_late",
            "gemm_residual_split_k_late", "gemv12_residual_late", "gemv_residual_l2_late",
            "gemv_norm_silu_mul_l2_late", "attention_one_launch_kv_hint",
            "attention_one_launch_early_pos", "qkv_rope_late", "qkv_rope_qk_norm_late",
            "qkv_rope_l2_late", "gemv_residual_l2_next_late", "attention_one_launch_kv_preload",
            "attention_one_launch_single_early_pos", "qkv_rope_trigger_first",
            "attention_one_launch_unroll_early_pos", "rmsnorm", "gemm_residual_ss_out",
            "gemm_residual_split_k_ss_out", "gemm_norm_silu_mul_ss_in", "qkv_rope_rows",
            "qkv_rope_rows_ss_in_late"} <= set(report)
    for name, cases in report.items():
        off, on = cases["off"], cases["on"]
        assert off["launch_dependents"] is None and off["wait"] is None and not off["launch_pdl"], name
        assert on["launch_pdl"], name
        assert on["launch_dependents"] is not None and on["wait"] is not None, name
        if name.endswith("_kv_hint"):  # decode_attention.PDL_KV_L2: one positions load and the K and V bulk L2
            # prefetches before the wait, no store or atomic before it; none of it without PDL
            assert on["launch_dependents"] < on["wait"] < on["first_global_write"], (name, on)
            assert on["loads_before_wait"] == 1, (name, on)
            assert on["l2_prefetches"] == on["l2_prefetches_before_wait"] == 2, (name, on)
            assert off["l2_prefetches"] == 0 and off["loads_before_wait"] == 0, (name, off)
            continue
        if name.endswith("_kv_preload"):  # decode_attention.KV_PRELOAD: the positions' loads and the four K/V
            # tiles' (vector loads) before the wait, no store or atomic before it; without PDL the same loads but no
            # wait (stream order), and no L2 hint either way
            assert on["launch_dependents"] < on["wait"] < on["first_global_write"], (name, on)
            assert on["loads_before_wait"] >= 6 and on["l2_prefetches"] == 0, (name, on)
            assert on["cg_loads"] > 0 and "atom.global.gpu.acq_rel.add.u32" in on["atomics"], (name, on)
            continue
        if name.endswith("_early_pos"):  # decode_attention.PDL_EARLY_POS: the positions' one load before the wait
            # (a static graph input nobody writes during the step), no store or atomic before it; none without PDL
            assert on["launch_dependents"] < on["wait"] < on["first_global_write"], (name, on)
            assert on["loads_before_wait"] == 1 and off["loads_before_wait"] == 0, (name, on, off)
            assert on["cg_loads"] > 0 and "atom.global.gpu.acq_rel.add.u32" in on["atomics"], (name, on)
            continue
        if name.endswith("_late"):  # the trigger after the K loop (past its branch), before any store or atomic
            assert on["wait"] < on["first_global_write"] and on["first_branch"] is not None, (name, on)
            assert on["first_branch"] < on["launch_dependents"] < on["first_global_write"], (name, on)
            assert (on["loads_before_wait"] > 0) == ("_prefetch" in name), (name, on)
        elif name.endswith("_prefetch"):  # weight loads may come first; no store or atomic does (kernels/pdl.py)
            assert on["launch_dependents"] < on["wait"] < on["first_global_write"], (name, on)
            assert on["loads_before_wait"] > 0, (name, on)
        else:
            assert on["launch_dependents"] < on["wait"] < on["first_global_access"], (name, on)
            assert on["loads_before_wait"] == 0, (name, on)
        # L2_PF: the bulk prefetches (gate and up: two loops) come before the wait; nowhere else, and never without PDL
        expected = (2 if "silu" in name or name.startswith("qkv_rope") else 1) * ("_l2" in name)  # (qkv_rope: a
        # program's two row ranges, columns j and j + D / 2)
        expected += 2 * ("_next" in name)  # NX_PF: the heads of the next weight's two halves (gate and up)
        assert on["l2_prefetches"] == on["l2_prefetches_before_wait"] == expected, (name, on)
        assert off["l2_prefetches"] == 0, (name, off)
        if "_l2" in name:  # the prefetch loop branches before the wait: the wait is then not in the entry block
            continue
        assert on["first_branch"] is None or on["wait"] < on["first_branch"], (name, on)
        # the norm epilogue (kernels/norm_epilogue.py): its acq_rel arrival at gpu scope and ".cg" row loads where
        # it is on; no atomic at all in the GEMVs without it and without split-K (the default paths)
        for case in (off, on):
            if name.endswith("_norm_out"):
                assert "atom.global.gpu.acq_rel.add.u32" in case["atomics"] and case["cg_loads"] > 0, (name, case)
            elif name.startswith(("gemv", "gemm")) and "split_k" not in name:
                assert case["atomics"] == [] and case["cg_loads"] == 0, (name, case)
            elif name.startswith("qkv_rope"):  # the q/k heads' arrival and the last program's L2-only reads
                norm = "qk_norm" in name  # with Qwen3's per-head norm only
                assert ("atom.global.gpu.acq_rel.add.u32" in case["atomics"]) == norm, (name, case)
                assert (case["cg_loads"] > 0) == norm, (name, case)


def test_norm_pdl_launches_the_rmsnorm_with_pdl_only_where_pdl_is_on(monkeypatch, field_wired):
    """EngineConfig.norm_pdl (ON by default since session 52) -> kernels/rmsnorm.py PDL with PDL on only; the RMSNorm
    launch then passes USE_PDL and launch_pdl (tests/pdl_ptx.py: the compiled kernel triggers, then waits, before any
    global access), and neither where either is off; only a bool passes validation; --no-norm-pdl; in the loop's
    layout key, and its mechanism proposes turning it off first."""
    import specpilot.kernels.rmsnorm as rk
    from specpilot.engine import _apply_pdl
    from specpilot.loop.registry import REGISTRY

    assert EngineConfig().norm_pdl is True
    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)  # as on an H200
    monkeypatch.setattr(rk, "PDL", False)
    _apply_pdl(EngineConfig(device="cuda"))
    assert pdl.enabled() and rk.PDL is True
    _apply_pdl(EngineConfig(device="cuda", pdl=False))
    assert rk.PDL is False
    _apply_pdl(EngineConfig(device="cuda", norm_pdl=False))
    assert rk.PDL is False
    with pytest.raises(ConfigError, match="norm_pdl must be true or false"):
        EngineConfig(norm_pdl="yes")
    real, launches = rk._rmsnorm_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launches.append(kw)
                if not kw.get("USE_PDL"):  # (the interpreter has no griddepcontrol: only the plain launch runs)
                    real[grid](*args, **kw)
            return run

    monkeypatch.setattr(rk, "_rmsnorm_kernel", Spy())
    x, w = torch.randn(3, 64), torch.randn(64)
    for flag, on in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(rk, "PDL", flag)
        monkeypatch.setattr(pdl, "_enabled", on)
        rk.rmsnorm(x, w, 1e-6)
    assert [(kw.get("USE_PDL", False), kw.get("launch_pdl", False)) for kw in launches] == [
        (False, False), (False, False), (True, True)]
    monkeypatch.setattr(pdl, "_enabled", False)
    gpu = field_wired("norm_pdl", ["--no-norm-pdl"], False, "norm_pdl", {"norm_pdl": False})
    assert REGISTRY["norm_pdl"].candidates(gpu.config, gpu)[0] == {"norm_pdl": False}

def test_qkv_trigger_first_lets_the_attention_launch_at_qkv_start(monkeypatch, switch_wired):
    """EngineConfig.qkv_trigger_first -> kernels/qkv_rope.py TRIGGER_FIRST with PDL on only: under the late trigger
    qkv + RoPE then launches with PDL_LATE False (launch_dependents first thing) and the same bits; validated, a CLI
    flag, in the loop's layout key, a loop mechanism only under the late trigger."""
    import specpilot.kernels.qkv_rope as qr
    from specpilot.engine import _apply_pdl
    from specpilot.loop.registry import REGISTRY

    monkeypatch.setattr(pdl, "unsupported_reason", lambda device=None: None)  # as on an H200
    monkeypatch.setattr(qr, "TRIGGER_FIRST", False)
    _apply_pdl(EngineConfig(device="cuda", qkv_trigger_first=True))
    assert pdl.enabled() and qr.TRIGGER_FIRST is True
    _apply_pdl(EngineConfig(device="cuda"))
    assert qr.TRIGGER_FIRST is False
    _apply_pdl(EngineConfig(device="cuda", qkv_trigger_first=True, pdl=False))
    assert not pdl.enabled() and qr.TRIGGER_FIRST is False
    gpu = switch_wired("qkv_trigger_first", "--qkv-trigger-first", "qkv_trigger_first", {"qkv_trigger_first": True})
    assert not REGISTRY["qkv_trigger_first"].applies(gpu, gpu.config.with_(pdl_trigger="start"))
    log = []
    monkeypatch.setattr(qr, "_kernel", Recorder("qkv_rope", qr._kernel, log))
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, K, S = 4, 2, 16, 64, 8
    x, w = torch.randn(1, K, generator=g), torch.randn((H + 2 * Hkv) * D, K, generator=g) / 8
    cos, sin = torch.ones(1, 1, 1, D), torch.zeros(1, 1, 1, D)
    outs = []
    for trigger, first, late in (("late", False, True), ("late", True, False), ("start", True, False)):
        assert pdl.set_enabled(True, trigger=trigger)
        monkeypatch.setattr(qr, "TRIGGER_FIRST", first)
        kc, vc = torch.zeros(1, Hkv, S, D), torch.zeros(1, Hkv, S, D)
        outs.append((qr.qkv_rope(x, w, None, None, 1e-6, cos, sin, torch.tensor([[3]]), kc, vc, H), kc, vc))
        assert log[-1][1]["PDL_LATE"] is late and log[-1][1]["USE_PDL"] is True, (trigger, first)
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(o, outs[0]))
    pdl.set_enabled(False)
