"""The one-launch decode step (kernels/megakernel.py) against the model's regular path, on the CPU interpreter.

TRITON_INTERPRET=1 (conftest) runs programs one after another, so only a grid of one program can pass the grid
barriers: that program walks every phase's tasks (all GEMV rows, every attention slice and the merges), the
barrier code included. The 132-program grid is checked on the GPU (scripts/gpu_megakernel.py).
"""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed")


def _regular(model, ids, start: int, steps: int, pool: int):
    """Prefill ids[:start], then one-token steps on the regular path: -> (per-step fp32 logits, cache)."""
    cache = model.new_cache(1, pool)
    pos = torch.arange(ids.shape[1])[None]
    out = []
    with torch.no_grad():
        model(ids[:, :start], pos[:, :start], cache, kv_len=start)
        for t in range(start, start + steps):
            out.append(model.logits(model(ids[:, t:t + 1], pos[:, t:t + 1], cache, kv_len=None))[0, 0])
    return out, cache


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_megakernel_steps_match_the_regular_path(tiny_model_dir, family):
    from specpilot.kernels.megakernel import DecodeMegakernel
    from specpilot.models import load_model

    model = load_model(tiny_model_dir(family)).fuse_projections()
    ids = torch.tensor([[3, 9, 27, 4, 11, 5, 8, 2, 6, 7]])
    pool = 160  # > SPLIT_S: the last steps' context stays in slice 0, the pool has two slices
    ref, ref_cache = _regular(model, ids, 6, 4, pool)
    cache = model.new_cache(1, pool)
    with torch.no_grad():
        model(ids[:, :6], torch.arange(6)[None], cache, kv_len=6)
        mk = DecodeMegakernel(model, cache, programs=1)
        got = [mk.step(ids[0, t:t + 1].clone(), torch.tensor([t])).clone() for t in range(6, 10)]
    for a, b in zip(ref, got):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-4
        assert a.argmax() == b.argmax()
    assert (ref_cache.k - cache.k).abs().max().item() < 1e-5 and (ref_cache.v - cache.v).abs().max().item() < 1e-5
    assert cache.k[:, :, :, 10:].abs().max().item() == 0  # nothing written past the last position
    assert mk.bar.item() == 5 * model.config.num_hidden_layers  # every barrier counted once (one program)
    assert mk.cnt.abs().sum().item() == 0  # the merge counters are back at zero for the next launch


@pytest.mark.parametrize("preload_kv", [False, True])
@pytest.mark.parametrize("split_s, slices", [(128, 2), (64, 4)])
def test_megakernel_attends_across_slices(tiny_model_dir, split_s, slices, preload_kv):
    """A position past the first key slice: two or three slices of a head, merged by the last; with preload_kv the
    program's first slice comes from keys and values loaded before the attention barrier (one block), the others
    from the cache as before."""
    from specpilot.kernels import megakernel
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen2")).fuse_projections()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 132))
    ref, ref_cache = _regular(model, ids, 130, 2, 256)
    cache = model.new_cache(1, 256)
    with torch.no_grad():
        model(ids[:, :130], torch.arange(130)[None], cache, kv_len=130)
        mk = megakernel.DecodeMegakernel(model, cache, programs=1, split_s=split_s, preload_kv=preload_kv)
        got = [mk.step(ids[0, t:t + 1].clone(), torch.tensor([t])).clone() for t in (130, 131)]
    assert mk.splits == slices
    for a, b in zip(ref, got):
        assert (a - b).abs().max().item() < 1e-4


def test_megakernel_rejects_what_it_cannot_run(tiny_model_dir):
    from specpilot.kernels.megakernel import DecodeMegakernel
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen2"))
    with pytest.raises(ValueError, match="fused projections"):
        DecodeMegakernel(model, model.new_cache(1, 16))
    model.fuse_projections()
    with pytest.raises(ValueError, match="batch 1"):
        DecodeMegakernel(model, model.new_cache(2, 16))
    mk = DecodeMegakernel(model, model.new_cache(1, 16), programs=2)
    with pytest.raises(ValueError, match="one after another"):
        mk.step(torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="multiple of"):
        DecodeMegakernel(model, model.new_cache(1, 16), programs=1, split_s=96)
    with pytest.raises(ValueError, match="one token"):
        DecodeMegakernel(model, model.new_cache(1, 16), programs=1).step(torch.tensor([1, 2]), torch.tensor([0]))


def test_megakernel_compiles_for_sm90_with_its_grid_barrier(sm90_report):
    """tests/megakernel_ptx.py compiles the step for sm_90 at the 1.5B shape (no GPU needed): the barrier's
    release arrivals, volatile polling and acquire, and the merge's L2-only loads are in the PTX."""
    r = sm90_report("megakernel_ptx.py")
    assert "red.global.gpu.release.add.u32" in r["atomics"]  # the barrier's arrival (5 a layer, one site each)
    assert "atom.global.gpu.acq_rel.add.u32" in r["atomics"]  # the attention merge's arrival
    assert r["volatile_loads"] >= 5 and r["acquire_loads"] >= 5  # every barrier polls L2, then acquires
    assert r["cg_loads"] > 0  # the merge reads the partials from L2
    assert r["shared_bytes"] <= 100 * 1024  # one program per SM must fit (228 KB on an H100/H200)
    assert r["prefetches_off"] == 0 and r["prefetches_on"] >= 3  # o_proj, gate and up warmed only when asked
    # preloaded tiles, one-dimensional sums and acquire polling: the same 5 release arrivals a layer, each barrier
    # polled by acquire loads (a first one and the loop's) instead of volatile loads and a separate acquire
    assert r["fast_releases"] == 5 and r["fast_acquire_polls"] >= 10
    assert r["fast_volatile_loads"] == 0 and r["fast_acquire_loads"] == 0
    assert r["fast_shared_bytes"] <= 200 * 1024  # the one-block slice's dot operands still fit one program per SM
    # start, 5 barriers a layer (one site each), 2 inside the attention phase, end
    assert r["timer_reads_off"] == 0 and r["timer_reads_on"] >= 9


def test_runner_one_token_steps_through_the_megakernel(tiny_model_dir):
    """ModelRunner(megakernel=True) (EngineConfig.megakernel): its one-token steps (static bucket and unbucketed)
    give the regular runner's logits, the layers' weights become views of the stacks (held once), and multi-token
    steps and the prefill keep the regular path over those same weights."""
    import copy

    from specpilot.engine.runner import ModelRunner
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen3")).fuse_projections()
    ref_model = copy.deepcopy(model)
    fast = ModelRunner(model, model.new_cache(1, 64), buckets=(1, 3), static=True, megakernel=True)
    ref = ModelRunner(ref_model, ref_model.new_cache(1, 64), buckets=(1, 3), static=True)
    mk = fast.megakernel
    assert mk is not None and mk.programs == 1
    layer = model.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.data_ptr() == mk.wqkv[1].data_ptr()
    assert layer.mlp.down_proj.weight.data_ptr() == mk.wd[1].data_ptr()
    assert layer.self_attn.q_norm.weight.data_ptr() == mk.qn[1].data_ptr()
    ids = torch.tensor([3, 9, 27, 4, 11, 5, 8, 2, 6, 7, 1, 12])
    with torch.no_grad():
        for r in (fast, ref):
            r.prefill(ids[:5], 0)
        for t in range(5, 8):  # one-token steps: the megakernel's
            mk.bar.fill_(-1)
            a, b = fast.step(ids[t:t + 1], t), ref.step(ids[t:t + 1], t)
            assert (a - b).abs().max().item() < 1e-4
            assert mk.bar.item() == 5 * model.config.num_hidden_layers  # the step ran the megakernel
        mk.bar.fill_(-1)
        a, b = fast.step(ids[8:11], 8), ref.step(ids[8:11], 8)  # a 3-token step: the regular path, shared weights
        assert (a - b).abs().max().item() < 1e-4 and mk.bar.item() == -1
    assert (fast.cache.k[:, :, :, :11] - ref.cache.k[:, :, :, :11]).abs().max().item() < 1e-5


def test_megakernel_config_and_engine_switch(tiny_model_dir):
    from specpilot.config import EngineConfig
    from specpilot.engine import _megakernel
    from specpilot.errors import ConfigError
    from specpilot.models import load_model

    with pytest.raises(ConfigError, match="megakernel"):
        EngineConfig(megakernel="false")
    model = load_model(tiny_model_dir("qwen2"))
    assert not _megakernel(EngineConfig(megakernel=True), model)  # CPU: the kernels stay off, as every kernel
    assert not _megakernel(EngineConfig(), model)


@pytest.mark.parametrize("cap_n, tile_bytes, preload, acc_1d", [(16, 1024, False, False), (64, 4096, False, False),
                                                              (16, 1024, True, True), (64, 4096, True, False),
                                                              (16, 1024, False, True)])
def test_megakernel_row_chunks_and_tiles(tiny_model_dir, cap_n, tile_bytes, preload, acc_1d):
    """Programs whose rows take several chunks (equal ones: 96 rows at cap 64 are two of 48, masked in a 64-row
    tile) and narrow K tiles (several double-buffered K steps): the same logits; also with each phase's first tile
    preloaded before its barrier (the first chunk starts from it, later chunks load their own) and with the K steps
    summed into one-dimensional accumulators."""
    from specpilot.kernels.megakernel import DecodeMegakernel
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen2")).fuse_projections()
    ids = torch.tensor([[3, 9, 27, 4, 11, 5, 8, 2]])
    ref, _ = _regular(model, ids, 6, 2, 32)
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        model(ids[:, :6], torch.arange(6)[None], cache, kv_len=6)
        mk = DecodeMegakernel(model, cache, programs=1, cap_n=cap_n, tile_bytes=tile_bytes, preload=preload,
                              acc_1d=acc_1d)
        got = [mk.step(ids[0, t:t + 1].clone(), torch.tensor([t])).clone() for t in (6, 7)]
    assert mk.blocks["BN_LM"] == min(cap_n, 128) and mk.blocks["BK_D"] < model.config.intermediate_size
    for a, b in zip(ref, got):
        assert (a - b).abs().max().item() < 1e-4


def test_phase_times_from_the_stamps(tiny_model_dir):
    """`phase_times_us` turns program 0's stamps (start, after each barrier, the LM head's end) into the median
    layer's phase times and the step's."""
    from specpilot.kernels.megakernel import DecodeMegakernel
    from specpilot.models import load_model

    model = load_model(tiny_model_dir("qwen2")).fuse_projections()  # 2 layers: 12 stamps
    mk = DecodeMegakernel(model, model.new_cache(1, 16), programs=1)
    gaps_us = [1, 4, 2, 10, 5] * 2 + [30]  # qkv, attention, o_proj, gate_up, down per layer, then the LM head
    stamps = torch.tensor([0] + gaps_us).cumsum(0) * 1000  # ns
    assert mk.phase_times_us(stamps) == {"qkv": 1.0, "attention": 4.0, "o_proj": 2.0, "gate_up": 10.0,
                                         "down": 5.0, "lm_head": 30.0, "step": 74.0}
    # with the attention phase's two stamps a layer (program 0's stored partial, its publish/merge): the split
    att = torch.tensor([1 + 2.5, 1 + 3.5, 23 + 2.5, 23 + 3.5]) * 1000  # layer starts of attention: 1 and 23 us
    split = mk.phase_times_us(torch.cat([stamps, att.long()]))
    assert split["att_slice"] == 2.5 and split["att_merge"] == 1.0 and split["att_wait"] == 0.5
    assert split["attention"] == 4.0 and split["step"] == 74.0
