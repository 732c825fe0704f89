"""The roofline cost model: shape arithmetic, floors and predictions, gap analysis, the ceilings cache (CPU only)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specpilot.costmodel import (
    CudaUnavailableError,
    HardwareCeilings,
    StepProfile,
    analyze,
    ceilings_path,
    forward_cost,
    load_ceilings,
    load_or_measure,
    measure_ceilings,
    param_count,
    pass_floor_s,
    pass_predicted_s,
    save_ceilings,
    synthetic_config,
)
from specpilot.costmodel import hardware
from specpilot.errors import ConfigError, SpecPilotError

# H200-like numbers, made up (not measured): 4.0 TB/s copy, 700 TFLOP/s bf16, 3.5 TB/s decode GEMV.
FAKE_HW = HardwareCeilings(name="Fake GPU (test)", hbm_bytes_per_s=4.0e12, bf16_flops_per_s=7.0e14,
                           launch_s=6e-6, graph_kernel_s=1.5e-6, gemv_bytes_per_s=3.5e12,
                           measured_at="2025-01-01T00:00:00+0000")


def _bytes_s(cost, hw=FAKE_HW):
    return cost.total_bytes / hw.hbm_bytes_per_s


def _flops_s(cost, hw=FAKE_HW):
    return cost.flops / hw.bf16_flops_per_s


# --- shapes ---------------------------------------------------------------------------------------------------


def test_param_counts_match_published_sizes():
    assert param_count(synthetic_config("qwen2.5-1.5b")) == pytest.approx(1.54e9, rel=0.01)
    assert param_count(synthetic_config("qwen3-8b")) == pytest.approx(8.19e9, rel=0.01)
    assert param_count(synthetic_config("qwen2.5-0.5b")) == pytest.approx(0.494e9, rel=0.01)
    assert param_count(synthetic_config("qwen3-32b")) == pytest.approx(32.8e9, rel=0.01)


def test_untying_adds_a_head_to_params_but_not_to_bytes_read():
    tied = synthetic_config("qwen2.5-1.5b")
    untied = dataclasses.replace(tied, tie_word_embeddings=False)
    assert param_count(untied) - param_count(tied) == tied.vocab_size * tied.hidden_size
    # the pass reads the head matrix once either way; the embedding contributes only the T rows it gathers
    assert forward_cost(untied, 4, 100).weight_bytes == forward_cost(tied, 4, 100).weight_bytes


def test_weight_bytes_of_the_1_5b_in_bf16():
    cfg = synthetic_config("qwen2.5-1.5b")
    assert forward_cost(cfg, 1, 0).weight_bytes == pytest.approx(3.1e9, rel=0.02)
    assert forward_cost(cfg, 1, 0, dtype_bytes=1).weight_bytes == pytest.approx(1.55e9, rel=0.02)


def test_kv_bytes_read_the_span_and_write_the_new_tokens():
    cfg = synthetic_config("qwen3-8b")
    per_token = 2 * 36 * 8 * 128 * 2  # K+V, layers, kv heads, head_dim, bf16
    assert forward_cost(cfg, 16, 512).kv_bytes == per_token * (512 + 16 + 16)
    assert forward_cost(cfg, 1, 1000).kv_bytes - forward_cost(cfg, 1, 0).kv_bytes == per_token * 1000


def test_flops_are_linear_in_tokens_plus_attention():
    cfg = synthetic_config("qwen3-8b")
    one, two = forward_cost(cfg, 1, 0), forward_cost(cfg, 2, 0)
    linear_params = param_count(cfg) - cfg.vocab_size * cfg.hidden_size - 36 * (2 * 4096 + 2 * 128) - 4096
    attn_one = 36 * 4 * 1 * 1 * 32 * 128
    assert one.flops == 2 * linear_params + attn_one
    assert two.flops > 2 * one.flops  # attention grows with T * span


def test_kernel_estimate_counts_qk_norm_and_layers():
    q3 = forward_cost(synthetic_config("qwen3-8b"), 1, 0)
    q2 = forward_cost(synthetic_config("qwen2.5-1.5b"), 1, 0)
    assert (q3.num_kernels - 20) / 36 == (q2.num_kernels - 20) / 28 + 16  # q/k RMSNorm: 2 x 8 kernels
    assert q2.num_linear_kernels == 28 * 7 + 1


def test_bad_arguments_raise_config_errors():
    cfg = synthetic_config("qwen2.5-0.5b")
    with pytest.raises(ConfigError):
        forward_cost(cfg, 0, 10)
    with pytest.raises(ConfigError):
        forward_cost(cfg, 1, -1)
    with pytest.raises(ConfigError, match="qwen3-8b"):  # the message lists the known names
        synthetic_config("llama-70b")


# --- floors and predictions -----------------------------------------------------------------------------------


def test_8b_floor_is_bandwidth_bound_at_decode_and_compute_bound_at_prefill():
    cfg = synthetic_config("qwen3-8b")
    t1, t16, t1024 = (forward_cost(cfg, t, 512) for t in (1, 16, 1024))
    assert _bytes_s(t1) > 50 * _flops_s(t1)
    assert pass_floor_s(t1, FAKE_HW) == _bytes_s(t1)
    assert pass_floor_s(t1, FAKE_HW) == pytest.approx(15.2e9 / 4.0e12, rel=0.02)  # ~3.8 ms
    assert 1.0 < pass_floor_s(t16, FAKE_HW) / pass_floor_s(t1, FAKE_HW) < 1.05
    assert _flops_s(t1024) > _bytes_s(t1024)
    assert pass_floor_s(t1024, FAKE_HW) == _flops_s(t1024)
    assert pass_floor_s(t1024, FAKE_HW) > 5 * pass_floor_s(t1, FAKE_HW)


def test_prediction_sits_above_the_floor_and_graphs_beat_eager():
    cost = forward_cost(synthetic_config("qwen2.5-1.5b"), 1, 512)
    floor = pass_floor_s(cost, FAKE_HW)
    graphed, eager = pass_predicted_s(cost, FAKE_HW), pass_predicted_s(cost, FAKE_HW, graphed=False)
    expected_graphed = (cost.weight_bytes / 3.5e12 + (cost.kv_bytes + cost.activation_bytes) / 4.0e12
                        + (cost.num_kernels - cost.num_linear_kernels) * 1.5e-6)
    assert graphed == pytest.approx(expected_graphed, rel=1e-12)
    assert floor < graphed < eager
    assert eager - graphed == pytest.approx(cost.num_kernels * 6e-6 - (cost.num_kernels - 197) * 1.5e-6)


# --- gap analysis ---------------------------------------------------------------------------------------------


def _profile(**kw):
    base = dict(draft_s=1.0e-3, verify_s=5.0e-3, accept_s=0.2e-3, other_s=2.5e-3, tau=3.2,
                num_draft_tokens=4, drafter_passes=4, context_len=600)
    return StepProfile(**{**base, **kw})


def test_analyze_ranks_gaps_and_reports_the_ceiling_formula():
    target, drafter = synthetic_config("qwen3-8b"), synthetic_config("qwen2.5-0.5b")
    prof = _profile()
    rep = analyze(target, drafter, prof, FAKE_HW, drafter_kind="model")

    draft_floor = 4 * pass_floor_s(forward_cost(drafter, 1, 600), FAKE_HW)
    verify_floor = pass_floor_s(forward_cost(target, 5, 600), FAKE_HW)
    ar_floor = pass_floor_s(forward_cost(target, 1, 600), FAKE_HW)
    assert rep.stages["draft"].floor_s == pytest.approx(draft_floor)
    assert rep.stages["verify"].floor_s == pytest.approx(verify_floor)
    assert rep.ceiling_speedup == pytest.approx(3.2 * ar_floor / (draft_floor + verify_floor))
    assert rep.measured_speedup_equiv == pytest.approx(3.2 * ar_floor / 8.7e-3)
    assert rep.measured_speedup is None

    # verify floor ~3.8 ms -> gap ~1.2 ms; draft floor ~1.0 ms -> gap ~0; other 2.5 ms all gap; accept 0.2 ms
    assert [r.stage for r in rep.gaps] == ["other", "verify", "accept", "draft"]
    gaps = [r.gap_s for r in rep.gaps]
    assert gaps == sorted(gaps, reverse=True)
    assert rep.gaps[0].gap_s == pytest.approx(2.5e-3) and rep.gaps[0].floor_s == 0.0
    assert sum(r.share_of_step for r in rep.gaps) == pytest.approx(1.0)
    assert rep.step_measured_s == pytest.approx(8.7e-3)
    assert rep.predicted_over_measured == pytest.approx(rep.step_predicted_s / 8.7e-3)
    assert rep.stages["verify"].predicted_s > rep.stages["verify"].floor_s


def test_analyze_orders_differently_when_the_draft_is_slow():
    rep = analyze(synthetic_config("qwen3-8b"), synthetic_config("qwen2.5-0.5b"),
                  _profile(draft_s=9e-3, other_s=0.1e-3, drafter_pass_tokens=(2, 1, 1, 1)), FAKE_HW)
    assert rep.gaps[0].stage == "draft"
    two_token = pass_floor_s(forward_cost(synthetic_config("qwen2.5-0.5b"), 2, 600), FAKE_HW)
    one_token = pass_floor_s(forward_cost(synthetic_config("qwen2.5-0.5b"), 1, 600), FAKE_HW)
    assert rep.stages["draft"].floor_s == pytest.approx(two_token + 3 * one_token)


def test_analyze_prices_a_model_drafter_with_the_engines_layout():
    """A small model drafter is laid out by the same EngineConfig as the target (engine.build_drafter): with
    fused decode on, its one-token passes are fused ones (session 20: they were priced as regular passes, 2.2 ms
    predicted per 0.5B pass where the fused pass costs ~0.8 ms)."""
    target, drafter = synthetic_config("qwen2.5-1.5b"), synthetic_config("qwen2.5-0.5b")
    plain = analyze(target, drafter, _profile(drafter_pass_tokens=(2, 1, 1, 1)), FAKE_HW)
    fused = analyze(target, drafter, _profile(drafter_pass_tokens=(2, 1, 1, 1), fused_projections=True,
                                              fused_decode=True, fused_verify=True), FAKE_HW)
    on = dict(fused=True, fused_decode=True, fused_verify=True)
    passes = [forward_cost(drafter, t, 600, **on) for t in (2, 1, 1, 1)]
    assert fused.stages["draft"].predicted_s == pytest.approx(sum(pass_predicted_s(c, FAKE_HW, True, False)
                                                                  for c in passes))
    assert fused.stages["draft"].predicted_s < 0.8 * plain.stages["draft"].predicted_s


def test_analyze_ngram_and_plain_ar():
    target = synthetic_config("qwen2.5-1.5b")
    rep = analyze(target, None, _profile(draft_s=0.05e-3, drafter_passes=0, ar_step_s=2.0e-3), FAKE_HW,
                  drafter_kind="ngram")
    assert rep.stages["draft"].floor_s == 0.0 and rep.stages["draft"].predicted_s == 0.0
    assert rep.measured_speedup == pytest.approx(3.2 * 2.0e-3 / rep.step_measured_s)
    ar = analyze(target, None, _profile(draft_s=0.0, num_draft_tokens=0, drafter_passes=0, tau=1.0), FAKE_HW,
                 drafter_kind="none")
    assert ar.ceiling_speedup == pytest.approx(1.0)  # an AR step at the floor is the AR floor
    with pytest.raises(ConfigError, match="drafter's ModelConfig"):
        analyze(target, None, _profile(), FAKE_HW, drafter_kind="model")
    with pytest.raises(ConfigError):
        analyze(target, None, _profile(), FAKE_HW, drafter_kind="eagle")
    with pytest.raises(ConfigError):
        _profile(drafter_pass_tokens=(1, 1))  # 2 entries for 4 passes


def test_report_serialises_and_renders():
    from rich.console import Console

    rep = analyze(synthetic_config("qwen3-8b"), synthetic_config("qwen2.5-0.5b"), _profile(), FAKE_HW)
    d = json.loads(json.dumps(rep.to_dict()))
    assert [g["stage"] for g in d["gaps"]] == ["other", "verify", "accept", "draft"]
    assert d["stages"]["verify"]["measured_s"] == 5.0e-3
    console = Console(record=True, width=160)
    console.print(rep.table())
    text = console.export_text()
    assert "verify" in text and "ceiling speedup" in text and "Fake GPU" in text


# --- ceilings cache and the no-CUDA error ---------------------------------------------------------------------


def test_ceilings_json_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    path = save_ceilings(FAKE_HW)
    assert path == tmp_path / "hardware" / "Fake_GPU_test.json"
    assert load_ceilings(path) == FAKE_HW
    assert json.loads(path.read_text())["gemv_bytes_per_s"] == 3.5e12


def test_load_or_measure_caches_per_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(hardware, "_gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(hardware, "measure_ceilings",
                        lambda device: calls.append(device) or dataclasses.replace(FAKE_HW, name="NVIDIA H200"))
    first = load_or_measure("cuda")
    assert calls == ["cuda"] and ceilings_path("NVIDIA H200") == tmp_path / "hardware" / "NVIDIA_H200.json"
    assert load_or_measure("cuda") == first and len(calls) == 1  # served from the cache
    load_or_measure("cuda", refresh=True)
    assert len(calls) == 2
    ceilings_path("NVIDIA H200").write_text("{not json")  # a corrupt cache is measured over, not trusted
    assert load_or_measure("cuda") == first and len(calls) == 3
    assert load_ceilings(ceilings_path("NVIDIA H200")) == first


def test_measure_ceilings_without_cuda_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CudaUnavailableError, match="CUDA is not available") as err:
        measure_ceilings()
    assert isinstance(err.value, SpecPilotError)
    with pytest.raises(CudaUnavailableError):
        load_or_measure()
    with pytest.raises(CudaUnavailableError, match="'cpu'"):
        measure_ceilings("cpu")


def test_dflash_draft_pass_cost_and_analysis():
    from specpilot.costmodel.shapes import dflash_pass_cost
    from specpilot.train.dflash_init import new_drafter_config

    target = synthetic_config("qwen2.5-1.5b")
    d = new_drafter_config(target, num_layers=2, block_size=16, mask_token_id=5, num_target_features=3,
                           intermediate_size=2048)
    c1, c4 = dflash_pass_cost(d, target, 600, 1), dflash_pass_cost(d, target, 600, 4)
    H = target.hidden_size
    layer = 2 * H * H + 2 * H * 256 + 3 * H * 2048  # q, o, k, v (2 KV heads x 128) and the narrow MLP
    lm_head = target.vocab_size * H
    fc = 3 * H * H
    # weights: the draft layers, the fc, the (shared) LM head and the block's embedding rows, read once in bf16
    assert c1.weight_bytes == pytest.approx(2 * (2 * layer + lm_head + fc + 16 * H), rel=0.01)
    assert c4.weight_bytes == c1.weight_bytes  # more context rows read no more weights ...
    assert c4.flops > c1.flops and c4.kv_bytes > c1.kv_bytes  # ... but project and write more context
    assert c1.num_tokens == 16 and c1.num_kernels > c1.num_linear_kernels > 2 * 7
    prof = _profile(draft_s=3e-3, drafter_passes=1, tau=3.0, num_draft_tokens=15)
    rep = analyze(target, d, prof, FAKE_HW, drafter_kind="dflash")
    assert rep.stages["draft"].floor_s == pytest.approx(pass_floor_s(dflash_pass_cost(d, target, 600, 3), FAKE_HW))
    assert 0 < rep.stages["draft"].floor_s < rep.stages["draft"].predicted_s
    with pytest.raises(ConfigError, match="DFlashConfig"):
        analyze(target, None, prof, FAKE_HW, drafter_kind="dflash")


def test_measured_sdpa_latency_enters_predictions_not_floors():
    hw = dataclasses.replace(FAKE_HW, sdpa_fixed_s=20e-6, sdpa_per_key_s=15e-9)
    cfg = synthetic_config("qwen2.5-1.5b")
    span, pool = forward_cost(cfg, 5, 600), forward_cost(cfg, 5, 600, pool_len=4096)
    assert span.attn_keys == 605 and pool.attn_keys == 4096 and span.num_layers == 28
    assert pass_floor_s(pool, hw) == pass_floor_s(span, hw)  # the physics does not change with the pool
    extra = pass_predicted_s(pool, hw) - pass_predicted_s(span, FAKE_HW)
    assert extra == pytest.approx(28 * (20e-6 + 15e-9 * 4096))
    assert pass_predicted_s(pool, hw) > pass_predicted_s(span, hw) > pass_predicted_s(span, FAKE_HW)
    assert FAKE_HW.sdpa_s(4096) == 0.0  # not measured: no term
    # the analysis threads the pool through every pass of the step
    rep_pool = analyze(cfg, None, _profile(drafter_passes=0, kv_pool_len=4096), hw, drafter_kind="ngram")
    rep_span = analyze(cfg, None, _profile(drafter_passes=0), hw, drafter_kind="ngram")
    assert rep_pool.stages["verify"].predicted_s > rep_span.stages["verify"].predicted_s
    assert rep_pool.stages["verify"].floor_s == rep_span.stages["verify"].floor_s
    # old cached ceilings (without the SDPA fields) are re-measured rather than trusted
    old = FAKE_HW.to_dict()
    del old["sdpa_fixed_s"], old["sdpa_per_key_s"]
    with pytest.raises(ValueError):
        HardwareCeilings.from_dict(old)


def test_verify_growth_attention_kernel_and_host_stages_enter_predictions():
    """The calibration terms of session 10: GEMV chain rate at M = 16 (a verify pass grows with its tokens), the
    split-KV kernel's measured time when the engine uses it, and the host stages (accept launches, the sync)."""
    cfg = synthetic_config("qwen2.5-1.5b")
    hw = dataclasses.replace(FAKE_HW, gemv16_bytes_per_s=FAKE_HW.gemv_bytes_per_s / 1.3, sdpa_fixed_s=80e-6,
                             sdpa_per_key_s=0.0, attn_kernel_t1_s=10e-6, attn_kernel_t16_s=25e-6, host_sync_s=40e-6)
    assert hw.weight_s_per_byte(1) == pytest.approx(1 / FAKE_HW.gemv_bytes_per_s)
    assert hw.weight_s_per_byte(16) == hw.weight_s_per_byte(40) == pytest.approx(1.3 / FAKE_HW.gemv_bytes_per_s)
    assert hw.weight_s_per_byte(1) < hw.weight_s_per_byte(5) < hw.weight_s_per_byte(16)
    assert FAKE_HW.weight_s_per_byte(16) == FAKE_HW.weight_s_per_byte(1)  # not measured: no growth
    one, five, sixteen = (forward_cost(cfg, t, 600) for t in (1, 5, 16))
    assert pass_predicted_s(one, hw) < pass_predicted_s(five, hw) < pass_predicted_s(sixteen, hw)
    grow = pass_predicted_s(sixteen, hw) - pass_predicted_s(one, hw)
    assert grow > 0.25 * one.weight_bytes / FAKE_HW.gemv_bytes_per_s  # most of the growth is the weight rate
    # the kernel's measured time replaces SDPA's when the engine uses it; unmeasured -> SDPA's
    assert hw.attention_kernel_s(1) == 10e-6 and hw.attention_kernel_s(16) == pytest.approx(25e-6)
    saving = pass_predicted_s(one, hw) - pass_predicted_s(one, hw, attention_kernel=True)
    assert saving == pytest.approx(28 * (80e-6 - 10e-6))
    assert pass_predicted_s(one, FAKE_HW, attention_kernel=True) == pass_predicted_s(one, FAKE_HW)
    # host stages: accept = its eager launches, other = the step's sync; the n-gram lookup's replayed time
    prof = _profile(drafter_passes=0, attention_kernel=True)
    rep = analyze(cfg, None, prof, hw, drafter_kind="ngram", draft_host_s=0.2e-3)
    assert rep.stages["accept"].predicted_s == pytest.approx(6 * FAKE_HW.launch_s)
    assert rep.stages["other"].predicted_s == pytest.approx(40e-6)
    assert rep.stages["draft"].predicted_s == pytest.approx(0.2e-3) and rep.stages["draft"].floor_s == 0.0
    assert rep.ar_predicted_s == pytest.approx(pass_predicted_s(one, hw, attention_kernel=True), rel=0.05)


def test_gemv_rate_follows_matrix_size_and_sdpa_has_a_multi_token_fit():
    """Small matrices stream slower than large ones (two chains measured); SDPA at T > 1 is its own fit."""
    from specpilot.costmodel.hardware import LARGE_CHAIN, SMALL_CHAIN, _chain_size

    hw = dataclasses.replace(FAKE_HW, gemv_bytes_per_s=1.8e12, gemv_large_bytes_per_s=3.8e12,
                             sdpa_fixed_s=10e-6, sdpa_per_key_s=1e-9, sdpa16_fixed_s=60e-6, sdpa16_per_key_s=2e-9)
    small, large = (_chain_size(c)[1] / c[0] for c in (SMALL_CHAIN, LARGE_CHAIN))
    assert 1 / hw.weight_s_per_byte(1, small) == pytest.approx(1.8e12)
    assert 1 / hw.weight_s_per_byte(1, large) == pytest.approx(3.8e12)
    assert 1 / hw.weight_s_per_byte(1, 100 * large) == pytest.approx(3.8e12)  # held beyond the measured sizes
    assert 1.8e12 < 1 / hw.weight_s_per_byte(1, (small * large) ** 0.5) < 3.8e12
    one_chain = dataclasses.replace(hw, gemv_large_bytes_per_s=None)
    assert 1 / one_chain.weight_s_per_byte(1, large) == pytest.approx(1.8e12)  # unmeasured: one rate for all
    b8, b15 = (forward_cost(synthetic_config(n), 1, 512) for n in ("qwen3-8b", "qwen2.5-1.5b"))
    assert pass_predicted_s(b8, hw) < pass_predicted_s(b8, one_chain)  # the 8B streams at the large rate
    assert pass_predicted_s(b15, hw) == pytest.approx(pass_predicted_s(b15, one_chain), rel=0.1)
    assert hw.sdpa_s(4096) == pytest.approx(10e-6 + 4096e-9)
    assert hw.sdpa_s(4096, tokens=5) == hw.sdpa_s(4096, tokens=16) == pytest.approx(60e-6 + 2 * 4096e-9)
    assert dataclasses.replace(hw, sdpa16_fixed_s=None).sdpa_s(4096, tokens=5) == hw.sdpa_s(4096)
    # a third, 0.5B-like chain: smaller layers interpolate towards it, below it the rate is held
    from specpilot.costmodel.hardware import TINY_CHAIN

    three = dataclasses.replace(hw, gemv_tiny_bytes_per_s=1.2e12)
    tiny = _chain_size(TINY_CHAIN)[1] / TINY_CHAIN[0]
    assert 1 / three.weight_s_per_byte(1, tiny) == pytest.approx(1.2e12)
    assert 1 / three.weight_s_per_byte(1, tiny / 10) == pytest.approx(1.2e12)
    assert 1.2e12 < 1 / three.weight_s_per_byte(1, (tiny * small) ** 0.5) < 1.8e12
    assert 1 / three.weight_s_per_byte(1, large) == pytest.approx(3.8e12)  # the rest unchanged
    assert 1 / hw.weight_s_per_byte(1, tiny) == pytest.approx(1.8e12)  # not measured: the small chain's, held


# --- what-if: predicted gains of config changes (costmodel/whatif.py) --------------------------------------------


def test_fused_and_compiled_passes_cut_kernels_not_bytes():
    cfg = synthetic_config("qwen2.5-1.5b")
    plain, fused, compiled = (forward_cost(cfg, 1, 512, **kw) for kw in ({}, {"fused": True}, {"compiled": True}))
    assert fused.num_linear_kernels == 28 * 4 + 1 and plain.num_linear_kernels == 28 * 7 + 1
    assert plain.num_kernels - fused.num_kernels == 28 * 3  # only GEMM launches go
    assert compiled.num_kernels - compiled.num_linear_kernels < (plain.num_kernels - plain.num_linear_kernels) / 4
    assert fused.total_bytes == plain.total_bytes == compiled.total_bytes and fused.flops == plain.flops
    assert pass_predicted_s(compiled, FAKE_HW) < pass_predicted_s(fused, FAKE_HW)
    # graphed GEMM launches are inside the measured GEMV-chain bandwidth: fusing them is priced only eagerly
    assert pass_predicted_s(fused, FAKE_HW) == pass_predicted_s(plain, FAKE_HW)
    assert pass_predicted_s(fused, FAKE_HW, graphed=False) < pass_predicted_s(plain, FAKE_HW, graphed=False)


def test_tau_at_other_draft_lengths():
    from specpilot.costmodel.whatif import tau_at

    assert tau_at(2.5, 4, 4) == pytest.approx(2.5, abs=1e-9)  # the geometric fit reproduces its input
    assert tau_at(2.5, 4, 2) < 2.5 < tau_at(2.5, 4, 8) < 5.0
    assert tau_at(1.0, 4, 8) == pytest.approx(1.0)  # nothing accepted: nothing more to gain
    assert tau_at(5.0, 4, 8) == pytest.approx(9.0, abs=1e-3)  # everything accepted: all of a longer draft too
    # a measured per-position profile wins where it reaches: 1 + 0.8 + 0.8*0.5
    assert tau_at(2.0, 4, 2, (0.8, 0.5, 0.5, 0.5)) == pytest.approx(2.2)
    assert tau_at(2.0, 2, 3, (0.8, 0.5)) == pytest.approx(1 + 0.8 + 0.4 + 0.2)  # the last rate continues


def test_predicted_gain_prices_compile_and_draft_length():
    from specpilot.costmodel.whatif import StepKnobs, predicted_gain

    target, drafter = synthetic_config("qwen2.5-1.5b"), synthetic_config("qwen2.5-0.5b")
    prof = StepProfile(draft_s=4e-3, verify_s=3.5e-3, accept_s=2e-4, other_s=2e-4, tau=2.5, num_draft_tokens=4,
                       drafter_passes=4, context_len=600)
    now = StepKnobs(4, fused=True)

    def gain(new, kind="model", d=drafter):
        return predicted_gain(target, d, prof, FAKE_HW, kind=kind, now=now, new=new)

    assert gain(now) == pytest.approx(1.0)
    assert gain(StepKnobs(4, fused=True, compiled=True)) > 1.05  # ~1,000 elementwise kernels fewer per pass
    assert gain(StepKnobs(4, fused=True, graphed=False)) < 1.0  # host launches instead of graph replays
    assert gain(StepKnobs(4)) == pytest.approx(1.0)  # graphed, unfusing is not priced as a win
    # an AR drafter pays per drafted token: at this acceptance a shorter draft is predicted faster
    assert gain(StepKnobs(2, fused=True)) > gain(StepKnobs(8, fused=True))
    # n-gram drafting costs no device pass: a longer draft only widens the verify pass a little
    assert gain(StepKnobs(8, fused=True), kind="ngram", d=None) > 1.0
    assert gain(StepKnobs(4, fused=True, compiled=True), kind="model", d=None) is None  # drafter shapes unknown


def test_predicted_gain_prices_the_draft_attention_kernel():
    """A graphed DFlash block with SDPA attends over the whole draft pool (0.18 ms a call on the H200); through the
    split-KV kernel it costs the kernel's measured time: the switch is priced as a gain, and only for DFlash."""
    from specpilot.costmodel.whatif import StepKnobs, predicted_gain
    from specpilot.train.dflash_init import new_drafter_config

    target = synthetic_config("qwen2.5-1.5b")
    d = new_drafter_config(target, num_layers=2, block_size=16, mask_token_id=5, num_target_features=3,
                           intermediate_size=2048)
    hw = dataclasses.replace(FAKE_HW, sdpa_fixed_s=10e-6, sdpa_per_key_s=1e-9, sdpa16_fixed_s=40e-6,
                             sdpa16_per_key_s=3.5e-8, attn_kernel_t1_s=10e-6, attn_kernel_t16_s=24e-6)
    prof = StepProfile(draft_s=1.3e-3, verify_s=4.2e-3, accept_s=1e-4, other_s=1.5e-4, tau=2.2, num_draft_tokens=15,
                       drafter_passes=1, context_len=600, attention_kernel=True, draft_kv_pool_len=4096)
    now = StepKnobs(15, fused=True, attention_kernel=True, draft_pool_len=4096)
    on = dataclasses.replace(now, draft_attention_kernel=True)
    gain = predicted_gain(target, d, prof, hw, kind="dflash", now=now, new=on)
    # two draft layers: SDPA over the pool -> the kernel; and the launches: the pass's mask (7) goes, a layer's 3
    # SDPA launches become the block's K/V write and the kernel's split + merge (4): 5 graphed launches fewer
    from specpilot.costmodel.shapes import dflash_pass_kernels

    fewer = dflash_pass_kernels(2, fused=True)[0] - dflash_pass_kernels(2, fused=True, attention_kernel=True)[0]
    assert fewer == 7 - 2 * (4 - 3)
    saved = 2 * (40e-6 + 3.5e-8 * (4096 + 16) - 24e-6) + fewer * hw.graph_kernel_s
    assert gain == pytest.approx(prof.step_s / (prof.step_s - saved), rel=1e-6) and gain > 1.02
    rep_on = analyze(target, d, dataclasses.replace(prof, draft_attention_kernel=True, draft_kv_pool_len=None), hw,
                     drafter_kind="dflash")
    rep_off = analyze(target, d, prof, hw, drafter_kind="dflash")
    assert rep_off.stages["draft"].predicted_s - rep_on.stages["draft"].predicted_s == pytest.approx(saved)
    assert rep_on.stages["verify"].predicted_s == rep_off.stages["verify"].predicted_s  # the target's unchanged


def _ngram_switch_gains(cfg, field):
    """(profile, predicted gain of switching `field` on, and of switching it back off) for a graphed n-gram step."""
    from specpilot.costmodel.whatif import StepKnobs, predicted_gain

    prof = StepProfile(draft_s=1e-4, verify_s=3.5e-3, accept_s=2e-4, other_s=2e-4, tau=2.5, num_draft_tokens=4,
                       drafter_passes=0, context_len=600)
    off = StepKnobs(4, fused=True)
    on = dataclasses.replace(off, **{field: True})
    return (prof, predicted_gain(cfg, None, prof, FAKE_HW, kind="ngram", now=off, new=on),
            predicted_gain(cfg, None, prof, FAKE_HW, kind="ngram", now=on, new=off))


def test_norm_kernel_cuts_seven_kernels_per_rmsnorm_and_is_priced_as_a_gain():
    q2, q3 = synthetic_config("qwen2.5-1.5b"), synthetic_config("qwen2.5-1.5b")
    q3 = dataclasses.replace(q3, qk_norm=True)
    for cfg, norms in ((q2, 2), (q3, 4)):
        plain, norm = forward_cost(cfg, 1, 512), forward_cost(cfg, 1, 512, norm_kernel=True)
        L = cfg.num_hidden_layers
        assert plain.num_kernels - norm.num_kernels == 7 * (L * norms + 1)  # + the final norm
        assert norm.num_linear_kernels == plain.num_linear_kernels and norm.total_bytes == plain.total_bytes
        # under torch.compile a norm is already one fused kernel: the flag changes nothing there
        assert forward_cost(cfg, 1, 512, compiled=True, norm_kernel=True).num_kernels == \
            forward_cost(cfg, 1, 512, compiled=True).num_kernels
    prof, gain, back = _ngram_switch_gains(q2, "norm_kernel")
    saved = 7 * (28 * 2 + 1) * FAKE_HW.graph_kernel_s
    assert gain == pytest.approx(prof.step_s / (prof.step_s - saved), rel=1e-6) and gain > 1.0
    assert back < 1.0


def test_loop_knobs_carry_the_norm_kernel():
    from specpilot.config import EngineConfig
    from specpilot.loop import _knobs
    from specpilot.loop.registry import REGISTRY

    assert _knobs(EngineConfig(norm_kernel=True)).norm_kernel
    assert not _knobs(EngineConfig(norm_kernel=False)).norm_kernel
    assert REGISTRY["norm_kernel"].fields == {"norm_kernel": [True, False]}


def test_rope_kernel_cuts_nine_kernels_per_layer_and_is_priced_as_a_gain():
    cfg = synthetic_config("qwen2.5-1.5b")
    plain, rope = forward_cost(cfg, 1, 512), forward_cost(cfg, 1, 512, rope_kernel=True)
    both = forward_cost(cfg, 1, 512, rope_kernel=True, norm_kernel=True)
    assert plain.num_kernels - rope.num_kernels == 9 * 28 and rope.total_bytes == plain.total_bytes
    assert plain.num_kernels - both.num_kernels == 9 * 28 + 7 * (2 * 28 + 1)
    assert forward_cost(cfg, 1, 512, compiled=True, rope_kernel=True).num_kernels == \
        forward_cost(cfg, 1, 512, compiled=True).num_kernels
    prof, gain, _ = _ngram_switch_gains(cfg, "rope_kernel")
    assert gain == pytest.approx(prof.step_s / (prof.step_s - 9 * 28 * FAKE_HW.graph_kernel_s), rel=1e-6)
    from specpilot.config import EngineConfig
    from specpilot.loop import _knobs

    assert _knobs(EngineConfig(rope_kernel=True)).rope_kernel
    assert not _knobs(EngineConfig(rope_kernel=False)).rope_kernel


def test_dflash_pass_counts_fewer_kernels_with_the_norm_kernel():
    from specpilot.costmodel.shapes import dflash_pass_cost
    from specpilot.train.dflash_init import new_drafter_config

    target = synthetic_config("qwen2.5-1.5b")
    d = new_drafter_config(target, num_layers=2, block_size=16, mask_token_id=5, num_target_features=3,
                           intermediate_size=2048)
    plain, fast = dflash_pass_cost(d, target, 600, 3), dflash_pass_cost(d, target, 600, 3, norm_kernel=True)
    # per layer: input, post-attention, q and k norms of the block, k norm of the context; then the final and
    # the hidden (context projection) norms: 7 launches fewer each
    assert plain.num_kernels - fast.num_kernels == (2 * 5 + 2) * 7
    assert plain.total_bytes == fast.total_bytes


def test_engine_fields_follow_the_config():
    """The pools each attention path reads, and acceptance fused into the verify step (predicted to launch
    nothing), as profile and the loop derive them from an EngineConfig."""
    from specpilot.config import EngineConfig, SamplingConfig
    from specpilot.costmodel.gaps import engine_fields

    f = engine_fields(EngineConfig(max_seq_len=2048, cuda_graphs=True, attention_kernel=False,
                                   draft_attention_kernel=False))
    assert f["kv_pool_len"] == 2048 and f["draft_kv_pool_len"] == 2048 and f["fused_accept"]
    f = engine_fields(EngineConfig(attention_kernel=True, draft_attention_kernel=True,
                                   sampling=SamplingConfig(temperature=0.7)))
    assert f["kv_pool_len"] is None and f["draft_kv_pool_len"] is None and not f["fused_accept"]
    cfg = synthetic_config("qwen2.5-1.5b")
    fused = analyze(cfg, None, _profile(drafter_passes=0, fused_accept=True), FAKE_HW, drafter_kind="ngram")
    eager = analyze(cfg, None, _profile(drafter_passes=0), FAKE_HW, drafter_kind="ngram")
    assert fused.stages["accept"].predicted_s == 0 < eager.stages["accept"].predicted_s


def test_eager_norm_and_rope_kernels_priced_at_their_own_graphed_rate():
    """Session 11 (H200): removing the eager RMSNorm/RoPE chains saved ~1.7 us per kernel at T = 1 and ~2.3 us at
    T = 16, not the 1.13 us of a tiny bf16 add: those kernels carry their own measured per-kernel cost."""
    from specpilot.costmodel.shapes import eager_chain_kernels

    cfg = synthetic_config("qwen2.5-1.5b")
    assert eager_chain_kernels(cfg) == (28 * 2 + 1) * 8 + 28 * 10
    assert eager_chain_kernels(cfg, norm_kernel=True, rope_kernel=True) == 0
    assert eager_chain_kernels(cfg, compiled=True) == 0
    assert eager_chain_kernels(synthetic_config("qwen3-8b"), rope_kernel=True) == (36 * 4 + 1) * 8
    hw = dataclasses.replace(FAKE_HW, graph_kernel_s=1e-6, graph_eager_kernel_s=2e-6, graph_eager_kernel16_s=3e-6)
    eager, kern = forward_cost(cfg, 1, 512), forward_cost(cfg, 1, 512, norm_kernel=True, rope_kernel=True)
    assert eager.num_eager_kernels == eager_chain_kernels(cfg) and kern.num_eager_kernels == 0
    # every eager-chain kernel pays 1 us more than the plain per-kernel figure at T = 1, 2 us more at T = 16
    assert pass_predicted_s(eager, hw) - pass_predicted_s(eager, FAKE_HW) == pytest.approx(
        (eager.num_kernels - eager.num_linear_kernels) * (1e-6 - 1.5e-6) + eager.num_eager_kernels * 1e-6)
    e16 = forward_cost(cfg, 16, 512)
    assert hw.eager_kernel_s(16) == 3e-6 and hw.eager_kernel_s(1) == 2e-6
    assert FAKE_HW.eager_kernel_s(16) == FAKE_HW.graph_kernel_s  # not measured: the tiny-kernel figure
    no_eager = dataclasses.replace(e16, num_eager_kernels=0)
    assert pass_predicted_s(e16, hw) - pass_predicted_s(no_eager, hw) == pytest.approx(e16.num_eager_kernels * 2e-6)


def test_act_and_add_norm_kernels_cut_their_kernels_and_the_loop_prices_them():
    from specpilot.config import EngineConfig
    from specpilot.costmodel.shapes import eager_chain_kernels
    from specpilot.loop import _knobs

    cfg = synthetic_config("qwen2.5-1.5b")
    L = cfg.num_hidden_layers
    plain = forward_cost(cfg, 1, 512)
    assert plain.num_kernels - forward_cost(cfg, 1, 512, act_kernel=True).num_kernels == L  # SiLU + mul -> 1
    # add + RMSNorm in one launch: each layer's two norms go (8 kernels each eager, 1 with the norm kernel)
    assert plain.num_kernels - forward_cost(cfg, 1, 512, add_norm_kernel=True).num_kernels == L * 2 * 8
    normk = forward_cost(cfg, 1, 512, norm_kernel=True)
    assert normk.num_kernels - forward_cost(cfg, 1, 512, norm_kernel=True, add_norm_kernel=True).num_kernels == 2 * L
    assert eager_chain_kernels(cfg) - eager_chain_kernels(cfg, add_norm_kernel=True) == 2 * L * 8
    assert forward_cost(cfg, 1, 512, compiled=True, act_kernel=True, add_norm_kernel=True).num_kernels == \
        forward_cost(cfg, 1, 512, compiled=True).num_kernels  # Inductor fuses them already
    for field in ("act_kernel", "add_norm_kernel"):
        assert not getattr(_knobs(EngineConfig(**{field: False})), field)
        assert getattr(_knobs(EngineConfig()), field)  # on by default since session 14
        prof, gain, back = _ngram_switch_gains(cfg, field)
        assert gain > 1.0 > back


def test_dflash_pass_counts_the_rope_and_act_kernels_the_drafter_follows():
    from specpilot.config import EngineConfig
    from specpilot.costmodel.shapes import dflash_pass_cost, draft_kernel_flags
    from specpilot.train.dflash_init import new_drafter_config

    d = new_drafter_config(synthetic_config("qwen2.5-1.5b"), num_layers=2, block_size=16, mask_token_id=5)
    target = synthetic_config("qwen2.5-1.5b")
    plain = dflash_pass_cost(d, target, 600, 3)
    rope = dflash_pass_cost(d, target, 600, 3, rope_kernel=True)
    act = dflash_pass_cost(d, target, 600, 3, act_kernel=True)
    # per layer: the block's q/k RoPE 10 -> 1 and the context keys' 5 -> 1; SiLU x mul 2 -> 1
    assert plain.num_kernels - rope.num_kernels == 2 * (9 + 4) and plain.num_kernels - act.num_kernels == 2
    assert plain.num_eager_kernels - rope.num_eager_kernels == 2 * (10 + 5)
    assert draft_kernel_flags(EngineConfig()) == {"norm_kernel": True, "rope_kernel": True, "act_kernel": True}
    assert draft_kernel_flags(EngineConfig(act_kernel=False))["act_kernel"] is False


def test_dflash_pass_counts_four_gemms_fewer_a_layer_with_fused_projections():
    """DFlashDrafter.fuse_projections: the block's q/k/v -> 1 GEMM, the context's k/v -> 1, gate/up -> 1, per
    layer (tests/test_dflash_fused.py counts the same 4 in a static step's ops); bytes and FLOPs unchanged. The
    what-if model prices the draft pass with the target's `fused` knob."""
    from specpilot.costmodel.shapes import dflash_pass_cost
    from specpilot.costmodel.whatif import StepKnobs, _passes
    from specpilot.train.dflash_init import new_drafter_config

    target = synthetic_config("qwen2.5-1.5b")
    d = new_drafter_config(target, num_layers=2, block_size=16, mask_token_id=5)
    for kw in ({}, dict(norm_kernel=True, rope_kernel=True, act_kernel=True)):
        plain, fused = dflash_pass_cost(d, target, 600, 3, **kw), dflash_pass_cost(d, target, 600, 3, fused=True, **kw)
        assert plain.num_kernels - fused.num_kernels == 4 * 2
        assert plain.num_linear_kernels - fused.num_linear_kernels == 4 * 2
        assert (plain.total_bytes, plain.flops) == (fused.total_bytes, fused.flops)
    prof = _profile(draft_s=3e-3, drafter_passes=1, tau=3.0, num_draft_tokens=15)
    draft = [_passes(target, d, "dflash", StepKnobs(15, fused=f), prof, 3.0)[-1] for f in (False, True)]
    assert draft[0].num_kernels - draft[1].num_kernels == 4 * 2


def test_fused_decode_prices_one_token_passes_at_six_launches_a_layer():
    from specpilot.config import EngineConfig
    from specpilot.loop import _knobs

    for name in ("qwen2.5-1.5b", "qwen3-8b"):
        cfg = synthetic_config(name)
        L = cfg.num_hidden_layers
        one = forward_cost(cfg, 1, 512, fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True)
        # 4 GEMVs + RoPE/K-V write + attention a layer; embedding, RoPE tables (7), final norm, LM head, cast
        assert one.num_kernels == 6 * L + 1 + 7 + 1 + 1 + 1 and one.num_linear_kernels == 4 * L + 1
        assert one.num_eager_kernels == 0
        assert forward_cost(cfg, 1, 512, fused=True, fused_decode=True).num_eager_kernels == 8  # eager final norm
        regular = forward_cost(cfg, 1, 512, fused=True, norm_kernel=True, rope_kernel=True)
        assert one.num_kernels < regular.num_kernels and one.weight_bytes == regular.weight_bytes
        # verify blocks keep the regular path
        assert forward_cost(cfg, 5, 512, fused=True, fused_decode=True) == forward_cost(cfg, 5, 512, fused=True)
    assert _knobs(EngineConfig()).fused_decode and not _knobs(EngineConfig(fused_decode=False)).fused_decode


def test_pdl_gives_back_part_of_each_fused_launchs_gap_in_graphed_one_token_passes():
    """EngineConfig.pdl: the fused one-token pass's launches (six a layer + the LM head GEMV) each pay
    PDL_GAP_FACTOR of a graphed launch gap with the GEMVs triggering first thing (measured: nothing given back) and
    PDL_LATE_GAP_FACTOR with their trigger after the K loop (pdl_trigger "late", the default); nothing else
    changes."""
    from specpilot.config import EngineConfig
    from specpilot.costmodel.gaps import PDL_GAP_FACTOR, PDL_LATE_GAP_FACTOR, engine_fields
    from specpilot.costmodel.shapes import draft_kernel_flags, kernel_flags
    from specpilot.costmodel.whatif import StepKnobs, predicted_gain
    from specpilot.loop import _knobs

    assert 0.0 < PDL_LATE_GAP_FACTOR < PDL_GAP_FACTOR <= 1.0
    cfg = synthetic_config("qwen2.5-1.5b")
    L = cfg.num_hidden_layers
    flags = dict(fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True)
    off, on = forward_cost(cfg, 1, 512, **flags), forward_cost(cfg, 1, 512, **flags, pdl=True)
    late = forward_cost(cfg, 1, 512, **flags, pdl=True, pdl_late=True)
    assert on.num_pdl_kernels == late.num_pdl_kernels == 6 * L + 1 and off.num_pdl_kernels == 0
    assert dataclasses.replace(on, num_pdl_kernels=0) == off  # same kernels, same bytes
    assert late.pdl_late and not on.pdl_late and dataclasses.replace(late, pdl_late=False) == on
    # PDL acts on the fused path only: not without fused_decode, not on multi-token or compiled passes
    assert forward_cost(cfg, 1, 512, fused=True, pdl=True).num_pdl_kernels == 0
    assert forward_cost(cfg, 5, 512, **flags, pdl=True).num_pdl_kernels == 0
    assert forward_cost(cfg, 1, 512, **flags, compiled=True, pdl=True, pdl_late=True).num_pdl_kernels == 0
    assert not forward_cost(cfg, 1, 512, fused=True, pdl=True, pdl_late=True).pdl_late  # no PDL launch: no flag
    for cost, factor in ((on, PDL_GAP_FACTOR), (late, PDL_LATE_GAP_FACTOR)):
        saved = (6 * L + 1) * (1 - factor) * FAKE_HW.graph_kernel_s
        assert pass_predicted_s(off, FAKE_HW) - pass_predicted_s(cost, FAKE_HW) == pytest.approx(saved, abs=1e-12)
        assert pass_predicted_s(cost, FAKE_HW, graphed=False) == pass_predicted_s(off, FAKE_HW, graphed=False)
    # the switch reaches the cost model from the config, as fused_decode does (a DFlash pass does not take it)
    start = EngineConfig(pdl_trigger="start")
    assert kernel_flags(EngineConfig())["pdl"] and kernel_flags(EngineConfig())["pdl_late"]  # the defaults
    assert kernel_flags(start)["pdl"] and not kernel_flags(start)["pdl_late"]
    assert not any(kernel_flags(EngineConfig(pdl=False))[f] for f in ("pdl", "pdl_late"))  # the trigger says nothing
    assert "pdl" not in draft_kernel_flags(EngineConfig()) and "pdl_late" not in draft_kernel_flags(EngineConfig())
    assert _knobs(EngineConfig()).pdl_late and engine_fields(EngineConfig())["pdl_late"]
    # a small AR drafter's one-token passes: PDL with the late trigger is predicted as a gain, off as a loss
    prof = StepProfile(draft_s=4e-3, verify_s=3.5e-3, accept_s=2e-4, other_s=2e-4, tau=2.5, num_draft_tokens=4,
                       drafter_passes=4, context_len=600, fused_decode=True)
    now = StepKnobs(4, fused=True, attention_kernel=True, norm_kernel=True, rope_kernel=True, fused_decode=True)
    new = dataclasses.replace(now, pdl=True, pdl_late=True)
    gain = predicted_gain(cfg, synthetic_config("qwen2.5-0.5b"), prof, FAKE_HW, kind="model", now=now, new=new)
    back = predicted_gain(cfg, synthetic_config("qwen2.5-0.5b"), prof, FAKE_HW, kind="model", now=new, new=now)
    assert gain > 1.0 > back


def test_l2_warmed_weights_leave_a_one_token_passs_predicted_stream_and_stay_in_its_floor():
    """EngineConfig.pdl_l2_mb / pdl_l2_share: a fused one-token pass under PDL warms its GEMV weights of at most
    that many MiB in L2 while the kernel ahead runs; the prediction streams the rest only (the floor still counts
    every byte). At Qwen2.5-1.5B 8 MiB takes qkv (6 MiB) and o_proj (4.5 MiB); Qwen3-8B has none that small."""
    from specpilot.config import EngineConfig
    from specpilot.costmodel.gaps import engine_fields
    from specpilot.costmodel.shapes import l2_fields
    from specpilot.loop import _knobs

    cfg = synthetic_config("qwen2.5-1.5b")
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    qkv_o = ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * h
             + cfg.num_attention_heads * cfg.head_dim * h) * 2
    flags = dict(fused=True, fused_decode=True, pdl=True, pdl_late=True)
    cold, warm = forward_cost(cfg, 1, 512, **flags), forward_cost(cfg, 1, 512, **flags, pdl_l2_mb=8)
    assert cold.l2_warm_bytes == 0 and warm.l2_warm_bytes == L * qkv_o
    assert forward_cost(cfg, 1, 512, **flags, pdl_l2_mb=8, pdl_l2_share=0.25).l2_warm_bytes == L * qkv_o / 4
    assert forward_cost(cfg, 1, 512, **flags, pdl_l2_mb=5).l2_warm_bytes == L * cfg.num_attention_heads * \
        cfg.head_dim * h * 2  # o_proj alone
    assert dataclasses.replace(warm, l2_warm_bytes=0.0) == cold  # nothing else changes
    assert pass_floor_s(warm, FAKE_HW) == pass_floor_s(cold, FAKE_HW)
    streamed = FAKE_HW.weights_s(cold.weight_bytes, L, 1, cold.head_bytes) - FAKE_HW.weights_s(
        cold.weight_bytes - warm.l2_warm_bytes, L, 1, cold.head_bytes)
    assert pass_predicted_s(cold, FAKE_HW) - pass_predicted_s(warm, FAKE_HW) == pytest.approx(streamed, rel=1e-9)
    assert streamed > 0
    # only where the engine warms: PDL on, a one-token fused pass of 16-bit weights
    for other in (dict(flags, pdl=False, pdl_late=False), dict(flags, lossless12=True), dict(fused=True, pdl=True)):
        assert forward_cost(cfg, 1, 512, **other, pdl_l2_mb=8).l2_warm_bytes == 0, other
    assert forward_cost(cfg, 5, 512, **flags, fused_verify=True, pdl_l2_mb=8).l2_warm_bytes == 0  # M-row GEMVs
    assert forward_cost(synthetic_config("qwen3-8b"), 1, 512, **flags, pdl_l2_mb=8).l2_warm_bytes == 0
    # from the config: the default warms, and nothing without PDL
    assert l2_fields(EngineConfig()) == {"pdl_l2_mb": 8, "pdl_l2_share": 1.0, "pdl_l2_next_mb": 8}
    assert l2_fields(EngineConfig(pdl_l2_next_mb=16))["pdl_l2_next_mb"] == 16
    assert l2_fields(EngineConfig(pdl=False, pdl_l2_next_mb=16))["pdl_l2_next_mb"] == 0
    assert l2_fields(EngineConfig(pdl=False))["pdl_l2_mb"] == 0
    assert engine_fields(EngineConfig())["pdl_l2_mb"] == 8 and _knobs(EngineConfig()).pdl_l2_mb == 8


def test_the_warmed_head_of_gate_up_leaves_the_predicted_stream_once():
    """EngineConfig.pdl_l2_next_mb: o_proj's one-token launch warms that many MiB of gate/up's head; the prediction
    streams that much less a layer (never more than gate/up holds, and bytes already warmed by pdl_l2_mb count
    once), the floor is unchanged, and only where the engine warms (PDL, a one-token fused 16-bit pass, behind an
    o_proj warmed itself)."""
    cfg = synthetic_config("qwen2.5-1.5b")
    L, gate_up = cfg.num_hidden_layers, 2 * cfg.intermediate_size * cfg.hidden_size * 2
    flags = dict(fused=True, fused_decode=True, pdl=True, pdl_late=True)
    base = forward_cost(cfg, 1, 512, **flags, pdl_l2_mb=8)
    nxt = forward_cost(cfg, 1, 512, **flags, pdl_l2_mb=8, pdl_l2_next_mb=16)
    assert nxt.l2_warm_bytes - base.l2_warm_bytes == L * (16 << 20)
    assert pass_floor_s(nxt, FAKE_HW) == pass_floor_s(base, FAKE_HW)
    assert pass_predicted_s(nxt, FAKE_HW) < pass_predicted_s(base, FAKE_HW)
    assert forward_cost(cfg, 1, 512, **flags, pdl_l2_mb=8, pdl_l2_next_mb=1 << 12).l2_warm_bytes == \
        base.l2_warm_bytes + L * gate_up  # all of it
    assert forward_cost(cfg, 1, 512, **flags, pdl_l2_next_mb=16).l2_warm_bytes == 0  # o_proj not warmed: no-op
    assert forward_cost(synthetic_config("qwen3-8b"), 1, 512, **flags, pdl_l2_mb=8,
                        pdl_l2_next_mb=16).l2_warm_bytes == 0  # its o_proj (32 MiB) streams from DRAM
    assert forward_cost(cfg, 1, 512, **flags, pdl_l2_mb=64, pdl_l2_next_mb=16).l2_warm_bytes == \
        forward_cost(cfg, 1, 512, **flags, pdl_l2_mb=64).l2_warm_bytes  # gate/up already warm: counted once
    for other in (dict(flags, pdl=False, pdl_late=False), dict(flags, lossless12=True)):
        assert forward_cost(cfg, 1, 512, **other, pdl_l2_mb=8, pdl_l2_next_mb=16).l2_warm_bytes == 0, other
    assert forward_cost(cfg, 5, 512, **flags, fused_verify=True, pdl_l2_mb=8, pdl_l2_next_mb=16).l2_warm_bytes == 0


def test_a_small_drafters_catch_up_pass_feeds_one_or_two_tokens_not_tau():
    """After a step the drafter's cache lacks the target's bonus / correction token, and the last draft only when
    every draft was accepted: 1 or 2 tokens (a one-token pass runs fused_decode's six launches a layer)."""
    from specpilot.costmodel.whatif import StepKnobs, _passes, catch_up_tokens

    assert catch_up_tokens(4.85, 4) == 2 and catch_up_tokens(3.0, 4) == 1 and catch_up_tokens(4.4, 4) == 1
    assert catch_up_tokens(1.0, 0) == 1
    target, drafter = synthetic_config("qwen2.5-1.5b"), synthetic_config("qwen2.5-0.5b")
    prof = _profile(draft_s=4e-3, drafter_pass_tokens=(1, 1, 1, 1))
    knobs = StepKnobs(num_draft_tokens=4, fused=True, attention_kernel=True, norm_kernel=True, rope_kernel=True,
                      fused_decode=True)
    passes = _passes(target, drafter, "model", knobs, prof, tau=3.0)
    assert [p.num_tokens for p in passes] == [5, 1, 1, 1, 1]
    full = _passes(target, drafter, "model", knobs, prof, tau=4.9)
    assert [p.num_tokens for p in full] == [5, 2, 1, 1, 1]
    assert full[1].num_kernels > full[2].num_kernels  # the 2-token catch-up takes the regular path


def test_fused_verify_prices_2_to_16_token_passes_at_nine_launches_a_layer():
    """EngineConfig.fused_verify (with fused_decode): a verify pass of 2-16 tokens runs fused decode's layer at T
    rows with the two-launch split-KV attention and its two RMSNorms as launches of their own (PRENORM_ROWS): 9
    launches a layer, the head as fused decode's; the bytes are any pass's (weights once for all rows, activations
    per row). PDL: its 4 GEMVs and RoPE + K/V write a layer."""
    from specpilot.config import EngineConfig
    from specpilot.costmodel.gaps import engine_fields
    from specpilot.costmodel.shapes import draft_kernel_flags, kernel_flags
    from specpilot.costmodel.whatif import StepKnobs, predicted_gain
    from specpilot.loop import _knobs

    cfg = synthetic_config("qwen2.5-1.5b")
    L = cfg.num_hidden_layers
    flags = dict(fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True)
    for T in (2, 16):
        block, regular = forward_cost(cfg, T, 512, **flags, fused_verify=True), forward_cost(cfg, T, 512, **flags)
        # 2 RMSNorms + 4 GEMVs + RoPE/K-V write + split-KV attention and its merge a layer; embedding, RoPE tables
        # (7), final norm, LM head (cuBLAS), cast
        assert block.num_kernels == 9 * L + 1 + 7 + 1 + 1 + 1 and block.num_linear_kernels == 4 * L + 1
        assert block.num_eager_kernels == 0 and block.num_kernels < regular.num_kernels
        same = ("weight_bytes", "kv_bytes", "activation_bytes", "flops", "head_bytes", "weight_rate")
        assert all(getattr(block, f) == getattr(regular, f) for f in same)
        assert forward_cost(cfg, T, 512, **flags, fused_verify=True, pdl=True).num_pdl_kernels == 5 * L
        # 12-bit copies are for one-token passes only
        assert forward_cost(cfg, T, 512, **flags, fused_verify=True, lossless12=True) == block
    # one token: fused decode's six; past 16 tokens, compiled, or without fused_decode: unchanged
    assert forward_cost(cfg, 1, 512, **flags, fused_verify=True) == forward_cost(cfg, 1, 512, **flags)
    assert forward_cost(cfg, 17, 512, **flags, fused_verify=True) == forward_cost(cfg, 17, 512, **flags)
    assert forward_cost(cfg, 5, 512, **flags, compiled=True, fused_verify=True) == forward_cost(
        cfg, 5, 512, **flags, compiled=True)
    assert forward_cost(cfg, 5, 512, fused=True, fused_verify=True) == forward_cost(cfg, 5, 512, fused=True)
    # the switch reaches the cost model from the config (a DFlash draft pass does not take it)
    assert kernel_flags(EngineConfig(fused_verify=True))["fused_verify"] and not kernel_flags(
        EngineConfig(fused_verify=False))["fused_verify"]
    assert "fused_verify" not in draft_kernel_flags(EngineConfig(fused_verify=True))
    assert _knobs(EngineConfig(fused_verify=True)).fused_verify
    assert engine_fields(EngineConfig(fused_verify=True))["fused_verify"]
    # an n-gram step verifying 16 tokens: switching fused_verify on is predicted as a gain, off again as a loss
    prof = StepProfile(draft_s=1e-4, verify_s=3.0e-3, accept_s=2e-4, other_s=2e-4, tau=3.0, num_draft_tokens=15,
                       drafter_passes=0, context_len=600, fused_decode=True)
    now = StepKnobs(15, fused=True, attention_kernel=True, norm_kernel=True, rope_kernel=True, fused_decode=True)
    new = dataclasses.replace(now, fused_verify=True)
    assert predicted_gain(cfg, None, prof, FAKE_HW, kind="ngram", now=now, new=new) > 1.0 > predicted_gain(
        cfg, None, prof, FAKE_HW, kind="ngram", now=new, new=now)


def test_norm_epilogue_prices_fused_passes_without_their_norm_launches():
    """EngineConfig.norm_epilogue: a fused verify block's layer is 7 launches instead of 9 (its two RMSNorms come out
    of the residual GEMVs), layer 0's input norm stays one launch a pass, and every fused pass (one token too) loses
    the final norm's launch; bytes and PDL launches unchanged; passes off the fused path are unchanged."""
    from specpilot.config import EngineConfig
    from specpilot.costmodel.gaps import engine_fields
    from specpilot.costmodel.shapes import draft_kernel_flags, kernel_flags
    from specpilot.costmodel.whatif import StepKnobs, predicted_gain
    from specpilot.loop import _knobs

    cfg = synthetic_config("qwen2.5-1.5b")
    L = cfg.num_hidden_layers
    flags = dict(fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True, fused_verify=True)
    for T in (2, 16):
        off, on = forward_cost(cfg, T, 512, **flags), forward_cost(cfg, T, 512, **flags, norm_epilogue=True)
        assert off.num_kernels - on.num_kernels == 2 * L  # 2 L norm launches + the final norm, - layer 0's input
        assert on.num_kernels == 7 * L + 1 + (1 + 7 + 1 + 1) and on.num_linear_kernels == off.num_linear_kernels
        assert dataclasses.replace(on, num_kernels=off.num_kernels) == off  # only the launches change
        assert forward_cost(cfg, T, 512, **flags, pdl=True, norm_epilogue=True).num_pdl_kernels == 5 * L
    one_off, one_on = (forward_cost(cfg, 1, 512, **flags, norm_epilogue=e) for e in (False, True))
    assert one_off.num_kernels - one_on.num_kernels == 1 and one_on.num_eager_kernels == 0
    eager_final = dict(flags, norm_kernel=False)  # the final norm as 8 eager kernels: those go
    assert forward_cost(cfg, 1, 512, **eager_final).num_kernels - forward_cost(
        cfg, 1, 512, **eager_final, norm_epilogue=True).num_kernels == 8
    for T, kw in ((1, dict(fused=True)), (17, flags), (5, dict(flags, compiled=True))):  # not a fused pass
        assert forward_cost(cfg, T, 512, **kw, norm_epilogue=True) == forward_cost(cfg, T, 512, **kw)
    assert kernel_flags(EngineConfig(norm_epilogue=True))["norm_epilogue"]
    assert not kernel_flags(EngineConfig())["norm_epilogue"]
    assert "norm_epilogue" not in draft_kernel_flags(EngineConfig(norm_epilogue=True))
    assert _knobs(EngineConfig(norm_epilogue=True)).norm_epilogue
    assert engine_fields(EngineConfig(norm_epilogue=True))["norm_epilogue"]
    prof = StepProfile(draft_s=1e-4, verify_s=3.0e-3, accept_s=2e-4, other_s=2e-4, tau=3.0, num_draft_tokens=15,
                       drafter_passes=0, context_len=600, fused_decode=True, fused_verify=True)
    now = StepKnobs(15, fused=True, attention_kernel=True, norm_kernel=True, rope_kernel=True, fused_decode=True,
                    fused_verify=True)
    new = dataclasses.replace(now, norm_epilogue=True)
    assert predicted_gain(cfg, None, prof, FAKE_HW, kind="ngram", now=now, new=new) > 1.0 > predicted_gain(
        cfg, None, prof, FAKE_HW, kind="ngram", now=new, new=now)


def test_lossless12_prices_one_token_fused_passes_at_three_quarters_of_the_weight_bytes():
    from specpilot.costmodel import forward_cost, synthetic_config

    cfg = synthetic_config("qwen3-8b")
    base = forward_cost(cfg, 1, 512, fused_decode=True)
    w12 = forward_cost(cfg, 1, 512, fused_decode=True, lossless12=True)
    assert 0.74 < w12.weight_bytes / base.weight_bytes < 0.76 and w12.head_bytes < base.head_bytes
    assert w12.num_kernels == base.num_kernels and w12.kv_bytes == base.kv_bytes
    # multi-token passes (verify) and unfused ones keep the 16-bit weights
    for kw in (dict(num_tokens=4, fused_decode=True), dict(num_tokens=1, fused_decode=False)):
        t = kw.pop("num_tokens")
        assert forward_cost(cfg, t, 512, lossless12=True, **kw).weight_bytes == forward_cost(cfg, t, 512, **kw).weight_bytes


def test_dflash_draft_prediction_adds_the_measured_host_part_and_the_outside_launches():
    """`specpilot profile` measures the host time before the draft graph's launch (drafters/timing.py): analyze adds
    it to the DFlash draft stage's prediction exactly, and the launches queued behind the graph at launch_s each;
    floors, the other stages and the pass's own prediction stay; the table's caption splits the prediction."""
    from specpilot.config import EngineConfig
    from specpilot.costmodel.gaps import engine_fields
    from specpilot.costmodel.shapes import dflash_pass_cost
    from specpilot.train.dflash_init import new_drafter_config

    target = synthetic_config("qwen2.5-1.5b")
    d = new_drafter_config(target, num_layers=2, block_size=16, mask_token_id=5, num_target_features=3,
                           intermediate_size=2048)
    prof = _profile(draft_s=0.678e-3, drafter_passes=1, tau=3.0, num_draft_tokens=15,  # the pass in the draft stage
                    **engine_fields(EngineConfig(drafter_kind="dflash", num_draft_tokens=15, early_draft=False)))
    base = analyze(target, d, prof, FAKE_HW, drafter_kind="dflash")
    host = analyze(target, d, prof, FAKE_HW, drafter_kind="dflash", draft_host_s=0.31e-3)
    both = analyze(target, d, prof, FAKE_HW, drafter_kind="dflash", draft_host_s=0.31e-3, draft_launches=2.5)
    assert host.stages["draft"].predicted_s - base.stages["draft"].predicted_s == pytest.approx(0.31e-3, abs=1e-15)
    assert both.stages["draft"].predicted_s - host.stages["draft"].predicted_s == pytest.approx(2.5 * 6e-6)
    assert host.stages["draft"].floor_s == base.stages["draft"].floor_s == both.stages["draft"].floor_s
    for stage in ("verify", "accept", "other"):
        assert host.stages[stage] == base.stages[stage]
    assert host.step_predicted_s - base.step_predicted_s == pytest.approx(0.31e-3)
    assert (both.draft_host_s, both.draft_launch_s) == (0.31e-3, pytest.approx(15e-6))
    assert base.draft_host_s == base.draft_launch_s == 0.0 and "host" not in base.table().caption
    assert "host 0.310 ms (measured)" in both.table().caption and both.to_dict()["draft_host_s"] == 0.31e-3
    # the pass itself: the engine's defaults (fused projections, the split-KV kernel) reach dflash_pass_cost
    assert prof.fused_projections and prof.draft_attention_kernel
    pass_s = pass_predicted_s(dflash_pass_cost(d, target, 600, 3, fused=True, norm_kernel=True, rope_kernel=True,
                                               act_kernel=True, attention_kernel=True), FAKE_HW, True, True)
    assert base.stages["draft"].predicted_s == pytest.approx(pass_s)


def test_early_draft_moves_the_dflash_pass_into_the_commit_stage_and_is_priced_as_a_gain():
    """EngineConfig.early_draft: the pass is launched before the step's sync, so the profile measures it in the
    commit ("other") stage and the draft stage launches nothing; analyze predicts it there (the host's part beside
    the pass, not after it). The loop's what-if prices the switch as the draft stage's host part hidden: the
    measured draft stage becomes the pass alone; switching it back off (host part unmeasured) is not priced."""
    from specpilot.config import EngineConfig, SamplingConfig
    from specpilot.costmodel.gaps import engine_fields
    from specpilot.costmodel.shapes import dflash_pass_cost
    from specpilot.costmodel.whatif import StepKnobs, predicted_gain
    from specpilot.train.dflash_init import new_drafter_config

    target = synthetic_config("qwen2.5-1.5b")
    d = new_drafter_config(target, num_layers=2, block_size=16, mask_token_id=5, num_target_features=3,
                           intermediate_size=2048)
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=15, early_draft=False, device="cuda")
    assert engine_fields(cfg.with_(early_draft=True))["early_draft"] and not engine_fields(cfg)["early_draft"]
    on = EngineConfig(drafter_kind="dflash", num_draft_tokens=15, device="cuda")
    assert engine_fields(on)["early_draft"]  # on by default, where it applies: CUDA graphs
    assert not engine_fields(on.with_(device="cpu"))["early_draft"]  # the drafter's static step needs CUDA graphs
    assert not engine_fields(on.with_(cuda_graphs=False))["early_draft"]
    assert engine_fields(on.with_(sampling=SamplingConfig(temperature=0.7)))["early_draft"]  # sampled runs too
    assert not engine_fields(cfg.with_(early_draft=True, adaptive=True))["early_draft"]  # spec.py skips it there
    prof = _profile(draft_s=0.57e-3, drafter_passes=1, tau=3.0, num_draft_tokens=15, other_s=0.06e-3,
                    **engine_fields(cfg))
    early = dataclasses.replace(prof, early_draft=True, draft_s=0.01e-3, other_s=0.40e-3)
    off = analyze(target, d, prof, FAKE_HW, drafter_kind="dflash", draft_host_s=0.25e-3)
    on = analyze(target, d, early, FAKE_HW, drafter_kind="dflash")
    pass_s = pass_predicted_s(dflash_pass_cost(d, target, 600, 3, fused=True, norm_kernel=True, rope_kernel=True,
                                               act_kernel=True, attention_kernel=True), FAKE_HW, True, True)
    assert on.stages["draft"].predicted_s == 0.0 and on.stages["draft"].floor_s == 0.0
    assert on.stages["other"].predicted_s == pytest.approx(pass_s)  # (FAKE_HW has no host_sync_s)
    assert on.stages["other"].floor_s == off.stages["draft"].floor_s > 0  # the floor moves with the pass
    assert off.step_predicted_s - on.step_predicted_s == pytest.approx(0.25e-3)  # the host part, hidden
    assert on.stages["verify"] == dataclasses.replace(off.stages["verify"], measured_s=early.verify_s)
    # the loop's what-if: the measured draft stage (host wait + pass) shrinks to the pass
    now = StepKnobs(15, fused=True, attention_kernel=True, draft_attention_kernel=True, norm_kernel=True,
                    rope_kernel=True, act_kernel=True)
    new = dataclasses.replace(now, early_draft=True)
    gain = predicted_gain(target, d, prof, FAKE_HW, kind="dflash", now=now, new=new)
    assert gain == pytest.approx(prof.step_s / (prof.step_s - (prof.draft_s - pass_s)), rel=1e-6) and gain > 1.05
    assert predicted_gain(target, d, early, FAKE_HW, kind="dflash", now=new, new=now) is None
    # n-gram or a small model drafter: nothing launched early, nothing priced for it
    assert predicted_gain(target, None, _profile(drafter_passes=0), FAKE_HW, kind="ngram", now=StepKnobs(4),
                          new=StepKnobs(4, early_draft=True)) == pytest.approx(1.0)
