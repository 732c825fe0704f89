"""The DFlash drafter's fused projections (`DFlashDrafter.fuse_projections`) and the launches of a draft pass.

Fusing is a run-time layout: per layer q/k/v in one weight (the block's q, k, v in one GEMM, the context's k, v in
one GEMM over the k/v rows) and gate/up in one. It must give the unfused network's drafts and logits (CPU fp32,
kernels off and on: TRITON_INTERPRET=1 from conftest), checkpoints must keep z-lab's split names, and a static
draft step (what the GPU captures as a CUDA graph) must launch exactly 4 GEMMs fewer per layer, nothing else
changed: that count is what pays on the H200, where the draft pass is launch-bound.
"""

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton", reason="triton not installed")

from specpilot.config import EngineConfig  # noqa: E402
from specpilot.drafters.dflash import DFlashBlockDrafter  # noqa: E402
from specpilot.engine import build_drafter  # noqa: E402
from specpilot.models import load_model  # noqa: E402
from specpilot.models.dflash import DFlashConfig, DFlashDrafter, draft_block  # noqa: E402
from specpilot.models.dflash_io import load_dflash, save_dflash  # noqa: E402

H, V, MASK = 64, 96, 95
ALL_KERNELS = dict(norm=True, rope=True, act=True, attention=True)  # the engine's CUDA defaults


def _net(block_size=16, seed=0, bias=False) -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=block_size, mask_token_id=MASK,
                       target_layer_ids=(0, 1), num_target_layers=2, vocab_size=V, attention_bias=bias)
    torch.manual_seed(seed)
    net = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # norms at 1 and a flat init make every draft alike: perturb so parity means something
        for name, p in net.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return net


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(tiny_model_dir("qwen3"))


class _Launches(TorchDispatchMode):
    """Counts the ops of a pass that launch work: every op that writes new memory or mutates (aten ops, and our
    Triton kernels' custom ops, each seen as one call), not views, aliases (`.to` a dtype it has) or allocations."""

    FREE = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach"}

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.FREE:
            return out
        leaves = torch.utils._pytree.tree_leaves
        ins = {a.untyped_storage().data_ptr() for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        outs = [o for o in leaves(out) if isinstance(o, torch.Tensor)]
        if func._schema.is_mutable or not outs or any(o.untyped_storage().data_ptr() not in ins for o in outs):
            self.ops[str(func.overloadpacket)] += 1
        return out


def _static_step_launches(net, target) -> collections.Counter:
    """Ops of one static draft step (DFlashBlockDrafter._static_step, the graphed step), after a first eager
    propose over the prompt and a static one with 3 new context rows."""
    d = DFlashBlockDrafter(net, target, 64, static=True)
    g = torch.Generator().manual_seed(4)
    feats, ids = torch.randn(40, net.fc.in_features, generator=g), list(range(3, 43))
    d.observe(feats[:19])
    d.propose(ids[:20], 15)
    d.observe(feats[19:22])
    d.propose(ids[:23], 15)
    with torch.inference_mode(), _Launches() as count:
        d._static_step()
    return count.ops


@pytest.mark.parametrize("kernels", [False, True])
def test_fused_static_step_launches_four_gemms_fewer_per_layer(target, kernels):
    """Per layer: the block's q, k, v GEMMs -> 1 and the context's k, v -> 1 (-3), gate and up -> 1 (-1); no copy
    appears in their place (the RMSNorm kernel reads q/k of the fused output in place, kernels/rmsnorm.py).
    Tiny network, 2 layers, block 16 (the shipped drafter's shape but for widths): all kernels on, 65 -> 57 ops
    (GPU launches: decode_attention is 2 each); all off, 160 -> 152."""
    net = _net()
    if kernels:
        net.use_kernels(**ALL_KERNELS)
    plain = _static_step_launches(net, target)
    fused = _static_step_launches(copy.deepcopy(net).fuse_projections(), target)
    diff = {op: plain[op] - fused[op] for op in plain.keys() | fused.keys() if plain[op] != fused[op]}
    assert diff == {"aten.linear": 4 * net.config.num_hidden_layers}, diff
    assert sum(plain.values()) == (65 if kernels else 160) and sum(fused.values()) == (57 if kernels else 152)


@pytest.mark.parametrize("kernels,bias", [(False, False), (False, True), (True, True)])  # (interpreted kernels: slow)
def test_fused_drafts_and_logits_equal_the_unfused_network(target, kernels, bias, drive_drafters):
    """Eager draft passes (cacheless, cached with a padded context) give the unfused network's logits within
    rounding and its argmax tokens; static steps (eager first step, then padded static ones) the same drafts.
    A qkv bias (attention_bias) is sliced with the weight."""
    plain = _net(8, bias=bias)
    if kernels:
        plain.use_kernels(**ALL_KERNELS)
    fused = copy.deepcopy(plain).fuse_projections()
    assert fused.projections_fused and not plain.projections_fused
    assert not hasattr(fused.layers[0].self_attn, "q_proj") and hasattr(fused.layers[0].mlp, "gate_up_proj")
    g = torch.Generator().manual_seed(5)
    ctx = torch.randn(30, plain.fc.in_features, generator=g)
    for net_kw in (dict(), dict(cache=True, pad_to=32)):
        out = []
        for net in (plain, fused):
            kw = dict(net_kw)
            if kw.pop("cache", False):
                kw["cache"] = net.new_cache(1, 64)
            out.append(draft_block(net, target, 7, ctx, anchor_pos=30, return_logits=True, **kw))
        assert (out[0] - out[1]).abs().max().item() < 1e-5
        assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))
    drafters = [DFlashBlockDrafter(n, target, 80, static=True) for n in (plain, fused)]
    feats = torch.randn(80, plain.fc.in_features, generator=g)
    ids = torch.randint(0, 90, (80,), generator=g).tolist()
    steps = drive_drafters(drafters, feats, ids, [1, 3, 8, 2, 7, 4], 7)
    assert all(a == b for a, b in steps), steps


def test_fuse_projections_switches_both_ways_and_saves_zlab_names(tmp_path):
    """fuse_projections(False) restores the exact split weights; saving a fused drafter writes the split names
    (loadable, equal to the unfused weights) and leaves the drafter fused."""
    plain = _net(bias=True)
    fused = copy.deepcopy(plain).fuse_projections()
    save_dflash(fused, tmp_path)
    assert fused.projections_fused
    back = load_dflash(tmp_path)
    want = plain.state_dict()
    assert set(back.state_dict()) == set(want)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in want.items())
    again = fused.fuse_projections(False)
    assert not again.projections_fused and set(again.state_dict()) == set(want)
    assert all(torch.equal(again.state_dict()[n], t) for n, t in want.items())


def test_build_drafter_fuses_by_the_config(target):
    """build_drafter fuses the drafter's projections when `fused_projections` is on (the default, as the target),
    before the static step is built, and splits a fused network again when it is off."""
    cfg = EngineConfig(drafter_kind="dflash", max_seq_len=64)
    assert cfg.fused_projections
    net = build_drafter(cfg, _net(), target).network
    assert net.projections_fused
    assert not build_drafter(cfg.with_(fused_projections=False), net, target).network.projections_fused


@pytest.mark.parametrize("kernels", [False, True])
def test_cost_model_counts_the_static_step_launches(tiny_model_dir, kernels):
    """costmodel.shapes.dflash_pass_kernels (what the roofline model prices a draft pass's launches at) equals the
    launches of a bf16 static step counted op by op (load_dflash keeps the RoPE frequencies in fp32, so the tables
    are cast: 2 ops). The split-KV attention op launches twice on the GPU (split + merge): one more a layer."""
    from specpilot.costmodel.shapes import dflash_pass_kernels

    target = load_model(tiny_model_dir("qwen3"), dtype=torch.bfloat16)
    net = _net().to(torch.bfloat16).fuse_projections()
    net.inv_freq = net.inv_freq.float()
    if kernels:
        net.use_kernels(**ALL_KERNELS)
    ops = _static_step_launches(net, target)
    L = net.config.num_hidden_layers
    total, linears, _ = dflash_pass_kernels(L, fused=True, norm_kernel=kernels, rope_kernel=kernels,
                                            act_kernel=kernels, attention_kernel=kernels)
    assert total == sum(ops.values()) + (L if kernels else 0), ops
    assert linears == ops["aten.linear"] == 5 * L + 2


@pytest.mark.parametrize("ctx, k, after", [
    ([5, 6, 7, 8, 9, 5, 6, 7], 7, 4),  # the lookup ([8, 9, 5, 6, 7]) is shorter than the block: padded by a cat
    ([5, 6, 7, 8, 9, 1, 2, 5, 6, 7], 3, 3),  # it fills the block: copy, agreement test, choice
    ([1, 2, 3, 4], 3, 0),  # no match: the model's draft as it is
])
def test_ngram_assist_reports_the_launches_it_queues_after_the_pass(ctx, k, after):
    """What the profile prices at launch_s (drafters/timing.py): the wrapper's own launches after the model's pass,
    counted op by op (after a first call has made the wrapper's buffers). Two ops more than reported on a match
    run on the host on CUDA, no launch: the lookup's tokens as a host tensor and their write into the pinned
    buffer."""
    from specpilot.drafters import NgramDrafter
    from specpilot.drafters.base import Draft
    from specpilot.drafters.ngram_assist import NgramAssistedDrafter

    class Fixed:
        name, last_eager_launches, tokens = "fixed", (3, 1), torch.tensor([8, 3, 3, 3, 3, 3, 3])

        def propose(self, context_ids, num_tokens):
            return Draft(self.tokens[:num_tokens])

    d = NgramAssistedDrafter(Fixed(), NgramDrafter(4, 1), 2)
    with torch.inference_mode():
        d.propose([5, 6, 7, 8, 9, 1, 2, 5, 6, 7], 3)
        with _Launches() as count:
            d.propose(ctx, k)
    assert d.last_eager_launches == (3, 1 + after)
    host = {"aten.detach_": 1, "aten.copy_": 1} if after else {}
    assert count.ops - collections.Counter(host) == collections.Counter(
        {"aten.copy_": 1, "aten.cat": after - 3, "aten.eq": 1, "aten.where": 1} if after else {}), count.ops
    assert sum(count.ops.values()) - sum(host.values()) == after


def test_propose_timer_measures_the_host_part_before_the_pass(target):
    """On CPU (static steps, no graph): every propose launches a pass (the first eager, then static ones); the
    host time before it and the eager pass's host time are measured, >= 0 and within propose()'s wall time; no
    graph is timed. The launches outside the pass are the drafters' own counts (3 before a static step)."""
    from specpilot.drafters import NgramDrafter
    from specpilot.drafters.ngram_assist import NgramAssistedDrafter
    from specpilot.drafters.timing import ProposeTimer

    net = _net()
    d = NgramAssistedDrafter(DFlashBlockDrafter(net, target, 64, static=True), NgramDrafter(4, 1), 2)
    timer = ProposeTimer(d)
    g = torch.Generator().manual_seed(4)
    feats, ids = torch.randn(40, net.fc.in_features, generator=g), list(range(3, 23)) + list(range(3, 23))
    d.observe(feats[:19])
    d.propose(ids[:20], 15)
    for n in (23, 26, 30):
        d.observe(feats[d.inner.fed:n - 1])
        d.propose(ids[:n], 15)
    assert timer.calls == 4 and timer.passes == {"eager": 1, "static": 3}
    assert 0 <= timer.host_pre_launch_s <= timer.wall_s and 0 < timer.eager_pass_s <= timer.wall_s
    assert timer.host_pre_launch_s + timer.eager_pass_s <= timer.wall_s
    assert timer.launches_before == 1 + 3 * 3 and timer.graph_device_s() is None
    per = timer.per_step(4)
    assert per["host_pre_launch_s"] == pytest.approx(timer.host_pre_launch_s / 4) and per["graph_replays"] == 0
