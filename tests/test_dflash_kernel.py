"""The DFlash draft pass through the split-KV attention kernel (`DFlashDrafter.use_attention_kernel`) against SDPA.

The kernel path writes the block's K/V into the draft cache at the block positions and attends with every query at
the block's last position; SDPA attends over cat(cache slots below the anchor, block). These must agree step for
step (static step with padded context rows included), whatever stale values the cache holds above the anchor.
TRITON_INTERPRET=1 (conftest) runs the kernel on the CPU.
"""

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed")

from specpilot.config import EngineConfig  # noqa: E402
from specpilot.drafters.dflash import DFlashBlockDrafter  # noqa: E402
from specpilot.engine import Engine, build_drafter  # noqa: E402
from specpilot.models import load_model  # noqa: E402
from specpilot.models.dflash import DFlashConfig, DFlashDrafter  # noqa: E402

H, V, MASK = 64, 96, 95


def _net(block_size=5, seed=0, **kw) -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=block_size, mask_token_id=MASK,
                       target_layer_ids=(0, 1), num_target_layers=2, vocab_size=V, **kw)
    torch.manual_seed(seed)
    net = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # norms at 1 and a flat init make every draft alike: perturb so parity means something
        for name, p in net.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return net


def _pair(net):
    """(SDPA network, kernel network) with the same weights."""
    return net, copy.deepcopy(net).use_attention_kernel()


def _count_kernel_calls(monkeypatch) -> list:
    """One entry per call of the kernel op (any network's) from now on (the drafter's token-major variant: its
    output feeds o_proj without a copy)."""
    import specpilot.models.dense as dense
    from specpilot.kernels.decode_attention import decode_attention_token_major_op as op

    calls = []
    monkeypatch.setitem(dense._KERNEL_OPS, "decode_attention_token_major", lambda *a: calls.append(1) or op(*a))
    return calls


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(tiny_model_dir("qwen3"))


SLIDING = dict(layer_types=("full_attention", "sliding_attention"), sliding_window=3)


@pytest.mark.parametrize("block_size,extra", [(5, {}), (16, {}), (5, SLIDING)])
def test_static_steps_match_sdpa(target, block_size, extra, monkeypatch, drive_drafters):
    """Consecutive draft steps with growing context through DFlashBlockDrafter(static=True): the first (eager,
    whole prompt), then static steps with 1..B new context rows (B - c padding rows written at slots >= the
    anchor, then overwritten by the block on the kernel path). Block hidden states and drafts agree; a sliding
    layer keeps SDPA, the full layer takes the kernel."""
    sdpa, kern = _pair(_net(block_size, **extra))
    calls = _count_kernel_calls(monkeypatch)
    B = block_size
    drafters = [DFlashBlockDrafter(n, target, 80, static=True) for n in (sdpa, kern)]
    hidden = {id(sdpa): [], id(kern): []}
    for d in drafters:
        g = torch.Generator().manual_seed(9)
        d.cache.k.copy_(torch.randn(d.cache.k.shape, generator=g) * 3)  # stale garbage everywhere
        d.cache.v.copy_(torch.randn(d.cache.v.shape, generator=g) * 3)
        d.network.register_forward_hook(lambda m, a, out: hidden[id(m)].append(out.clone()))
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(80, sdpa.fc.in_features, generator=g)
    ids = torch.randint(0, 90, (80,), generator=g).tolist()
    steps = drive_drafters(drafters, feats, ids, [1, 3, B, 2, 1, B - 1, 4, 1, B], B - 1)
    assert all(a == b for a, b in steps), steps
    hs, hk = hidden[id(sdpa)], hidden[id(kern)]
    assert len(hs) == len(hk) == len(steps)
    for n, (a, b) in enumerate(zip(hs, hk)):
        assert (a - b).abs().max().item() < 1e-4, n
    kernel_layers = 1 if extra else 2
    assert len(calls) == kernel_layers * len(steps)  # every step, eager or static, went through the kernel


def test_kernel_mask_against_cacheless_forward(monkeypatch):
    """The mask itself: two cached passes (the second feeds the context since the first anchor) over a cache full
    of random values must equal one pass without a cache over the whole context (non-causal, no cache involved).
    A mask showing any slot above the block's last position, hiding the block, or making it causal would fail."""
    sdpa, kern = _pair(_net(8))
    calls = _count_kernel_calls(monkeypatch)
    g = torch.Generator().manual_seed(5)
    ctx = sdpa.project_context(torch.randn(1, 40, sdpa.fc.in_features, generator=g))
    block = torch.randn(1, 8, H, generator=g)
    a1, a2 = 17, 31  # anchors of the two passes
    pos = torch.arange(48)[None]
    with torch.no_grad():
        want = sdpa(block, ctx[:, :a2], pos[:, :a2], pos[:, a2: a2 + 8])
        for net in (sdpa, kern):
            cache = net.new_cache(1, 64)
            cache.k.normal_(generator=g).mul_(5)
            cache.v.normal_(generator=g).mul_(5)
            net(block, ctx[:, :a1], pos[:, :a1], pos[:, a1: a1 + 8], cache, kv_len=a1)
            got = net(block, ctx[:, a1:a2], pos[:, a1:a2], pos[:, a2: a2 + 8], cache, kv_len=a2)
            assert (got - want).abs().max().item() < 1e-4
            # static shapes (kv_len None): the whole pool, the same answer
            cache.k[:, :, :, a2:].normal_(generator=g)
            got = net(block, ctx[:, :0], pos[:, :0], pos[:, a2: a2 + 8], cache)
            assert (got - want).abs().max().item() < 1e-4
    assert len(calls) == 3 * 2
    # a cache without room for the block's slots (eager, kv_len = the anchor) falls back to SDPA
    calls.clear()
    with torch.no_grad():
        got = kern(block, ctx[:, :a2], pos[:, :a2], pos[:, a2: a2 + 8], kern.new_cache(1, a2 + 4), kv_len=a2)
    assert not calls and (got - want).abs().max().item() < 1e-4


def test_training_pass_keeps_sdpa(target, monkeypatch):
    """The batched training forward (no cache) never reaches the kernel, switched on or not."""
    from specpilot.train.block_loss import drafter_block_hidden

    sdpa, kern = _pair(_net(4))
    calls = _count_kernel_calls(monkeypatch)
    g = torch.Generator().manual_seed(2)
    feats, tokens = torch.randn(2, 20, sdpa.fc.in_features, generator=g), torch.randint(0, 90, (2, 20), generator=g)
    anchors = torch.tensor([[1, 6, 12], [3, 9, 15]])
    w = target.model.embed_tokens.weight
    with torch.no_grad():
        a = drafter_block_hidden(sdpa, w, feats, tokens, anchors)
        b = drafter_block_hidden(kern, w, feats, tokens, anchors)
    assert not calls and torch.equal(a, b)


@pytest.mark.parametrize("static", [False, True])
def test_greedy_with_kernel_equals_ar(target, static, monkeypatch):
    """Speculative decoding with the drafter's kernel on gives AR's tokens, eager draft steps and static ones (what the GPU captures as a graph). (The target keeps SDPA: its kernel has its own tests,
    and interpreted it would double this test's time.)"""
    net = _net(5).use_attention_kernel()
    calls = _count_kernel_calls(monkeypatch)
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=4, max_new_tokens=16, max_seq_len=96, ignore_eos=True)
    drafter = DFlashBlockDrafter(net, target, 96, static=static)  # (build_drafter switches it off on the CPU)
    spec, ar = Engine(target, cfg, drafter), Engine(target, cfg.with_(drafter_kind="none"))
    g = torch.Generator().manual_seed(1)
    for n in (3, 11):
        p = torch.randint(0, 90, (n,), generator=g).tolist()
        got = spec.generate(p)
        assert got.output_ids == ar.generate(p).output_ids
        assert max(got.drafted_lengths) == 4
    assert len(calls) >= 2 * 4  # two layers, every draft step


def test_engine_switches_the_drafter_kernel_by_its_own_field(target, monkeypatch):
    """build_drafter turns the drafter's kernel on exactly when `draft_attention_kernel` applies (CUDA), whatever
    the target's `attention_kernel` says, and off again for a network that had it on."""
    import specpilot.engine as engine

    cfg = EngineConfig(drafter_kind="dflash", max_seq_len=64, draft_attention_kernel=True)
    assert not build_drafter(cfg, _net(), target).network.attention_kernel  # the CPU: off
    monkeypatch.setattr(engine, "_kernel_on", lambda config, field="attention_kernel": getattr(config, field))
    net = build_drafter(cfg.with_(attention_kernel=False), _net(), target).network
    assert net.attention_kernel and all(layer.self_attn.kernel_max_t == 16 for layer in net.layers)
    assert copy.deepcopy(net).attention_kernel  # copies still work (validate_tau copies networks)
    assert not build_drafter(cfg.with_(draft_attention_kernel=False), net, target).network.attention_kernel
    assert EngineConfig().draft_attention_kernel  # on by default since session 14 (measured faster, GPU parity)
    from specpilot.models.dense import RMSNorm

    norms = lambda n: [m.kernel for m in n.modules() if isinstance(m, RMSNorm)]  # noqa: E731
    net = build_drafter(cfg.with_(norm_kernel=True), _net(), target).network
    assert norms(net) and all(norms(net))  # the drafter's RMSNorms follow the target's norm_kernel
    assert not any(norms(build_drafter(cfg.with_(norm_kernel=False), net, target).network))


# --- RoPE and activation kernels (DFlashDrafter.use_rope_kernel / use_act_kernel) --------------------------------


def _count_op_calls(monkeypatch, name) -> list:
    """One entry per call of kernels/<name>.py's op (any network's) from now on."""
    import specpilot.models.dense as dense

    op = dense.kernel_op(name)
    calls = []
    monkeypatch.setitem(dense._KERNEL_OPS, name, lambda *a: calls.append(1) or op(*a))
    return calls


def _same(a, b, exact):
    """bf16 (and RoPE in fp32): bit-equal on the CPU; silu_mul in fp32 (exp/division order): within rounding."""
    return torch.equal(a, b) if exact else (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flag", ["rope", "act"])
def test_rope_and_act_kernels_match_eager_passes(target, dtype, flag, monkeypatch):
    """A cacheless (training-style) pass, two cached passes over a stale cache, and a static-shaped pass (whole
    pool, no new context) give the eager network's hidden states: RoPE bit-equal in both dtypes; silu_mul
    bit-equal in bf16, within rounding in fp32. The block's q and k rotate in one launch, the context keys in
    another; the MLPs' activation in one launch per layer."""
    from specpilot.train.block_loss import drafter_block_hidden

    eager = _net(8).to(dtype)
    fast = copy.deepcopy(eager).use_kernels(**{flag: True})
    assert getattr(fast, f"{flag}_kernel") and not getattr(eager, f"{flag}_kernel")
    calls = _count_op_calls(monkeypatch, "rope" if flag == "rope" else "silu_mul")
    exact = dtype == torch.bfloat16 or flag == "rope"
    g = torch.Generator().manual_seed(5)
    ctx = eager.project_context(torch.randn(1, 40, eager.fc.in_features, generator=g).to(dtype))
    block = torch.randn(1, 8, H, generator=g).to(dtype)
    pos = torch.arange(48)[None]
    a1, a2 = 17, 31
    with torch.no_grad():
        got = [net(block, ctx[:, :a2], pos[:, :a2], pos[:, a2: a2 + 8]) for net in (eager, fast)]
        assert _same(*got, exact)
        assert len(calls) == (2 * 2 if flag == "rope" else 2)  # per layer: block q+k and context k / one MLP
        outs = {}
        for net in (eager, fast):
            cache = net.new_cache(1, 64)
            gc = torch.Generator().manual_seed(7)
            cache.k.copy_(torch.randn(cache.k.shape, generator=gc))
            cache.v.copy_(torch.randn(cache.v.shape, generator=gc))
            first = net(block, ctx[:, :a1], pos[:, :a1], pos[:, a1: a1 + 8], cache, kv_len=a1)
            second = net(block, ctx[:, a1:a2], pos[:, a1:a2], pos[:, a2: a2 + 8], cache, kv_len=a2)
            static = net(block, ctx[:, :0], pos[:, :0], pos[:, a2: a2 + 8], cache)  # no context rows: 1 RoPE launch
            outs[id(net)] = (first, second, static, cache.k.clone())
        assert all(_same(a, b, exact) for a, b in zip(outs[id(eager)], outs[id(fast)]))
        calls.clear()
        w = target.model.embed_tokens.weight.to(dtype)
        feats, tokens = torch.randn(2, 20, eager.fc.in_features, generator=g), torch.randint(0, 90, (2, 20), generator=g)
        anchors = torch.tensor([[1, 6, 12], [3, 9, 15]])
        got = [drafter_block_hidden(net, w, feats.to(dtype), tokens, anchors) for net in (eager, fast)]
        assert calls and _same(*got, exact)


def test_rope_act_and_attention_kernels_static_steps_match_eager(target, monkeypatch,
                                                                 drive_drafters):
    """DFlashBlockDrafter(static=True) steps (eager first step, then static steps with padded context rows, the
    CUDA-graphed shape) with the RoPE, activation and attention kernels all on draft the eager network's tokens."""
    eager = _net(5)
    fast = copy.deepcopy(eager).use_kernels(rope=True, act=True, attention=True)
    rope_calls = _count_op_calls(monkeypatch, "rope")
    drafters = [DFlashBlockDrafter(n, target, 64, static=True) for n in (eager, fast)]
    hidden = {id(eager): [], id(fast): []}
    for d in drafters:
        d.network.register_forward_hook(lambda m, a, out: hidden[id(m)].append(out.clone()))
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(64, eager.fc.in_features, generator=g)
    ids = torch.randint(0, 90, (64,), generator=g).tolist()
    steps = drive_drafters(drafters, feats, ids, [1, 5, 3], 4)
    assert all(a == b for a, b in steps), steps
    for a, b in zip(hidden[id(eager)], hidden[id(fast)], strict=True):
        assert (a - b).abs().max().item() < 1e-4
    assert len(rope_calls) == 2 * 2 * len(steps)  # every step has context rows: 2 launches per layer


@pytest.mark.parametrize("static", [False, True])
def test_greedy_with_rope_and_act_kernels_equals_ar(target, static, monkeypatch):
    """Speculative decoding with the drafter's RoPE and activation kernels on gives AR's tokens."""
    net = _net(5).use_rope_kernel().use_act_kernel()
    rope_calls, act_calls = _count_op_calls(monkeypatch, "rope"), _count_op_calls(monkeypatch, "silu_mul")
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=4, max_new_tokens=12, max_seq_len=96, ignore_eos=True)
    drafter = DFlashBlockDrafter(net, target, 96, static=static)
    spec, ar = Engine(target, cfg, drafter), Engine(target, cfg.with_(drafter_kind="none"))
    g = torch.Generator().manual_seed(1)
    for n in (3, 11):
        p = torch.randint(0, 90, (n,), generator=g).tolist()
        got = spec.generate(p)
        assert got.output_ids == ar.generate(p).output_ids
        assert max(got.drafted_lengths) == 4
    assert len(rope_calls) >= 2 * 4 and len(act_calls) >= 2 * 4  # (the target keeps eager: only drafter calls)


def test_engine_switches_the_drafter_rope_and_act_kernels_by_their_fields(target, monkeypatch):
    """build_drafter turns the drafter's RoPE / activation kernels on exactly when `rope_kernel` / `act_kernel`
    apply (CUDA), and off again for a network that had them on; the networks still deepcopy."""
    import specpilot.engine as engine

    cfg = EngineConfig(drafter_kind="dflash", max_seq_len=64, rope_kernel=True, act_kernel=True)
    net = build_drafter(cfg, _net(), target).network  # the CPU: off
    assert not net.rope_kernel and not net.act_kernel
    rope_on = lambda n: [layer.self_attn.rope_kernel for layer in n.layers]  # noqa: E731
    act_on = lambda n: [layer.mlp.act_kernel for layer in n.layers]  # noqa: E731
    monkeypatch.setattr(engine, "_kernel_on", lambda config, field="attention_kernel": getattr(config, field))
    for rope, act in [(True, False), (False, True), (True, True)]:
        net = build_drafter(cfg.with_(rope_kernel=rope, act_kernel=act), _net(), target).network
        assert (net.rope_kernel, net.act_kernel) == (rope, act)
        assert rope_on(net) == [rope] * 2 and act_on(net) == [act] * 2
        twin = copy.deepcopy(net)  # validate_tau copies networks
        assert (twin.rope_kernel, twin.act_kernel) == (rope, act) and rope_on(twin) == [rope] * 2
    net = build_drafter(cfg.with_(rope_kernel=False, act_kernel=False), net, target).network
    assert not net.rope_kernel and not net.act_kernel and not any(rope_on(net) + act_on(net))
    cfg12 = dataclasses.replace(_net().config, head_dim=12)
    assert not any(rope_on(DFlashDrafter(cfg12).use_rope_kernel()))  # a head_dim the kernel cannot take: eager RoPE
