"""L2 warming of a fused layer's gate/up weight (EngineConfig.l2_prefetch, kernels/l2_prefetch.py).

TRITON_INTERPRET=1 (conftest) runs the "load" kernel on the CPU: it must read exactly the first `fraction` of the
weight (its programs' sums add up to that slice's sum). The PTX modes ("prefetch", "bulk") run on a GPU only (the
GPU engine check's l2_prefetch section); on the CPU they fall back to "load". The model wiring: one warming per
fused layer, of that layer's gate/up weight, and the same outputs with it as without.
"""

import copy

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.errors import ConfigError

triton = pytest.importorskip("triton", reason="triton not installed")


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.3, 1e-4])
@pytest.mark.parametrize("mode", ["load", "prefetch"])
def test_warm_reads_exactly_the_first_fraction(fraction, mode):
    from specpilot.kernels import l2_prefetch as l2

    w = torch.randn(96, 160)
    out = l2.warm(w, fraction, mode)  # "prefetch" falls back to "load" off the GPU
    n = int(w.numel() * fraction)
    assert n > 0
    expected = w.flatten()[:n].double().sum().item()
    assert out.double().sum().item() == pytest.approx(expected, rel=1e-5, abs=1e-3)
    if fraction < 1.0:  # the rest was not read: a changed tail leaves the sums as they were
        w2 = w.clone()
        w2.view(-1)[n:] += 1000.0
        assert l2.warm(w2, fraction, mode).double().sum().item() == pytest.approx(expected, rel=1e-5, abs=1e-3)


def test_warm_rejects_bad_input_and_fork_does_nothing_on_the_cpu():
    from specpilot.kernels import l2_prefetch as l2

    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match="mode"):
        l2.warm(w, 0.5, "tma")
    with pytest.raises(ValueError, match="contiguous"):
        l2.warm(w.t(), 0.5)
    assert l2.warm(w, 0.0, "load") is not None  # nothing to read: no launch, the scratch back
    assert l2.fork(w, 0.5) is None and l2.fork(w, 0.0) is None  # CPU: nothing runs beside anything
    l2.join(None)


def _fused(tiny_model_dir, family="qwen2"):
    from specpilot.models import load_model

    return load_model(tiny_model_dir(family)).use_fused_decode().use_fused_verify()


def test_each_fused_layer_warms_its_own_gate_up_weight_and_outputs_stay(tiny_model_dir, monkeypatch):
    """With l2_prefetch on, every fused layer (a one-token step and a verify block) forks one warming of its own
    gate/up weight at that fraction and joins it; the logits are the same bit for bit (the warming runs here, on
    the CPU, in place of the side stream)."""
    from specpilot.kernels import l2_prefetch as l2

    ref = _fused(tiny_model_dir)
    warm = copy.deepcopy(ref).use_l2_prefetch(0.5)
    forks, joins = [], []

    def fork(weight, fraction):
        forks.append((weight.data_ptr(), fraction))
        l2.warm(weight, fraction)
        return "side"

    monkeypatch.setattr(l2, "fork", fork)
    monkeypatch.setattr(l2, "join", lambda side: joins.append(side))
    ids = torch.tensor([[3, 9, 27, 4, 11, 5, 8, 2, 6, 7, 12, 13]])
    pos = torch.arange(ids.shape[1])[None]
    outs = []
    for model in (ref, warm):
        cache = model.new_cache(1, 32)
        with torch.no_grad():
            model(ids[:, :6], pos[:, :6], cache, kv_len=6)  # 6 tokens in one row: a fused block too
            one = model.logits(model(ids[:, 6:7], pos[:, 6:7], cache))  # a fused one-token step
            block = model.logits(model(ids[:, 7:12], pos[:, 7:12], cache))  # a fused 5-token verify block
        outs.append((one, block))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    layers = warm.model.layers
    expected = [(layer.mlp.gate_up_proj.weight.data_ptr(), 0.5) for layer in layers]
    assert forks == expected * 3 and joins == ["side"] * (3 * len(layers))


def test_use_l2_prefetch_and_the_config_check_their_input(tiny_model_dir):
    from specpilot.engine import _apply_layout
    from specpilot.models import load_model

    with pytest.raises(ConfigError, match="fused_decode or fused_verify"):
        load_model(tiny_model_dir("qwen2")).use_l2_prefetch(0.5)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        _fused(tiny_model_dir).use_l2_prefetch(1.5)
    for bad in (-0.1, 2, True, "half"):
        with pytest.raises(ConfigError, match="l2_prefetch"):
            EngineConfig(l2_prefetch=bad)
    model = _fused(tiny_model_dir)
    _apply_layout(model, EngineConfig(l2_prefetch=0.5))  # CPU: the CUDA-only switch is ignored
    assert model.l2_prefetch == 0.0
    assert _fused(tiny_model_dir).use_l2_prefetch(0.25).use_l2_prefetch(0.0).l2_prefetch == 0.0


def test_the_ptx_modes_assemble_for_sm90(sm90_report):
    """tests/l2_prefetch_ptx.py compiles the three warming kernels for sm_90 through ptxas (no GPU): each mode's
    PTX holds its own L2 instruction and no other's."""
    report = sm90_report("l2_prefetch_ptx.py")
    assert all(report[m]["cubin_bytes"] > 0 for m in ("load", "prefetch", "bulk"))
    load, pf, bulk = report["load"], report["prefetch"], report["bulk"]
    assert load["evict_last_loads"] > 0 and load["prefetch"] == load["bulk"] == 0
    assert load["vector_loads"] > 0  # 16-byte loads: a bandwidth kernel, not 2-byte ones
    assert pf["prefetch"] > 0 and pf["bulk"] == 0 and pf["evict_last_loads"] == 0
    assert bulk["bulk"] > 0 and bulk["prefetch"] == 0 and bulk["evict_last_loads"] == 0
