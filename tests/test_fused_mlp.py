"""A one-token layer's whole MLP in one launch (kernels/fused_mlp.py, EngineConfig.fused_mlp), its sums settled by
the next layer's qkv + RoPE launch (kernels/qkv_rope.py with `pending`).

Kernel (TRITON_INTERPRET=1 on CPU): the pending sums are the eager MLP's down sums up to fp32 summation order, with
column counts that leave partial blocks and unequal programs; qkv + RoPE over x with a pending row gives the bits
of qkv + RoPE over the settled row, and writes that row; bad arguments are one clear ValueError.
Model and engine: a fused one-token step with the switch launches the fused MLP in every layer but the last and
matches the step without it; repeated steps match fresh ones (the pending rows are zeroed every step); greedy AR
and speculation equal AR token for token; the field, setter, loop and cost model are wired.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # as conftest does: the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton not installed")

from specpilot.kernels import fused_mlp as fm  # noqa: E402
from specpilot.kernels.qkv_rope import qkv_rope  # noqa: E402


def _mlp_case(H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(1, H, generator=g)).to(dtype)
    nw = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    wgu = (torch.randn(2 * I, H, generator=g) / H ** 0.5).to(dtype)
    wd = (torch.randn(H, I, generator=g) / I ** 0.5).to(dtype)
    return x, nw, wgu, wd


@pytest.mark.parametrize("H,I,dtype,block_c,programs", [
    (96, 40, torch.bfloat16, 2, 3),  # 20 blocks over 3 programs: 6, 7, 7
    (96, 41, torch.float32, 4, 5),  # a partial last block (41 columns), H not a power of two
    (64, 8, torch.bfloat16, 4, 3),  # fewer blocks than programs: the grid shrinks to the blocks
])
def test_pending_sums_are_the_eager_mlps(monkeypatch, H, I, dtype, block_c, programs):
    monkeypatch.setattr(fm, "INTERPRET_BLOCK_C", block_c)
    monkeypatch.setattr(fm, "INTERPRET_PROGRAMS", programs)
    x, nw, wgu, wd = _mlp_case(H, I, dtype)
    pending = torch.zeros(H)
    fm.fused_mlp(x, nw, 1e-6, wgu, wd.t().contiguous(), pending)
    want = fm.fused_mlp_reference(x, nw, 1e-6, wgu, wd)[0]
    assert torch.allclose(pending, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    # settled into a residual row (the consumer's rounding), within a rounding of the row's scale
    r = torch.randn(1, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    got, eager = fm.settle(r, pending[None]).float(), fm.settle(r, want[None]).float()
    assert torch.allclose(got, eager, rtol=0, atol=2 * torch.finfo(dtype).eps * eager.abs().max().item())
    # and accumulating: a second launch adds the same sums again (the caller zeroes between steps)
    fm.fused_mlp(x, nw, 1e-6, wgu, wd.t().contiguous(), pending)
    assert torch.allclose(pending, 2 * want, rtol=1e-5, atol=2e-6 * want.abs().max().item())


def test_reference_is_the_eager_mlp():
    """fused_mlp_reference rounded is the model's own MLP module (norm, fused gate/up, SiLU x up, down)."""
    from specpilot.models.config import ModelConfig
    from specpilot.models.dense import MLP, RMSNorm

    cfg = ModelConfig(model_type="qwen2", vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    mlp, norm = MLP(cfg), RMSNorm(64, 1e-6)
    x, nw, wgu, wd = _mlp_case(64, 48, torch.bfloat16, seed=3)
    with torch.no_grad():
        norm.weight.copy_(nw.float())
        mlp.gate_proj.weight.copy_(wgu[:48].float())
        mlp.up_proj.weight.copy_(wgu[48:].float())
        mlp.down_proj.weight.copy_(wd.float())
        mlp, norm = mlp.to(torch.bfloat16), norm.to(torch.bfloat16)
        mlp.fuse()
        want = mlp(norm(x))
    assert torch.equal(fm.fused_mlp_reference(x, nw, 1e-6, wgu, wd).to(torch.bfloat16), want)


@pytest.mark.parametrize("dtype,qk_norm", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_qkv_rope_settles_the_pending_row(dtype, qk_norm):
    """qkv + RoPE over x with a pending row = qkv + RoPE over settle(x, pending), bit for bit; the settled row is
    written to x_out."""
    from test_qkv_rope import _case, _one_launch

    args = list(_case(12, 2, 64, 200, 40, 5, dtype, qk_norm=qk_norm))
    x = args[0]
    pending = 3 * torch.randn(200, generator=torch.Generator().manual_seed(2))
    settled = fm.settle(x, pending[None])
    want, k_want, v_want = _one_launch(settled, *args[1:])
    x_out = torch.full_like(x, float("nan"))
    kc, vc = args[8].clone(), args[9].clone()
    call = args[:8] + [kc, vc] + args[10:]
    got = qkv_rope(*call, pending=pending, x_out=x_out)
    assert torch.equal(got, want) and torch.equal(kc, k_want) and torch.equal(vc, v_want)
    assert torch.equal(x_out, settled)
    assert not torch.equal(settled, x)  # (the pending row changed the input: the check above can fail)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.__setitem__(0, a[0].repeat(2, 1)), "one contiguous row"),
    (lambda a: a.__setitem__(3, a[3][:, :-1].contiguous()), "down_t must be"),
    (lambda a: a.__setitem__(2, a[2][:-1]), "gate_up_weight must be"),
    (lambda a: a.__setitem__(1, a[1][:-1]), "norm_weight must be"),
    (lambda a: a.__setitem__(4, a[4].double()), "pending must be"),
    (lambda a: a.__setitem__(2, a[2].double()), "one dtype"),
])
def test_bad_arguments_are_one_clear_error(change, message):
    x, nw, wgu, wd = _mlp_case(32, 16, torch.float32)
    args = [x, nw, wgu, wd.t().contiguous(), torch.zeros(32)]
    change(args)
    with pytest.raises(ValueError, match=message):
        fm.fused_mlp(args[0], args[1], 1e-6, args[2], args[3], args[4])


def test_qkv_rope_pending_arguments_are_checked():
    from test_qkv_rope import _case

    args = list(_case(4, 2, 16, 64, 8, 3, torch.float32))
    with pytest.raises(ValueError, match="come together"):
        qkv_rope(*args, pending=torch.zeros(64))
    with pytest.raises(ValueError, match="pending must be"):
        qkv_rope(*args, pending=torch.zeros(63), x_out=torch.empty(1, 64))
    no_norm = args[:3] + [None] + args[4:]
    with pytest.raises(ValueError, match="norm prologue"):
        qkv_rope(*no_norm, pending=torch.zeros(64), x_out=torch.empty(1, 64))


def _fused(model):
    return model.use_fused_decode().use_fused_verify().use_rope_in_qkv()


@pytest.mark.parametrize("family,dtype", [("qwen2", torch.float32), ("qwen2", torch.bfloat16),
                                          ("qwen3", torch.bfloat16), ("llama", torch.float32)])
def test_fused_steps_with_the_fused_mlp_match(tiny_model_dir, launch_spy, family, dtype):
    """One-token steps between a 7-token verify block: the fused MLP in every layer of a one-token step but the
    last, none in the block; logits and cache as without it up to down's summation order."""
    import copy

    from test_qkv_rope import _steps  # prefill, then the blocks: every step's logits and the cache

    from specpilot.models import load_model

    off = _fused(load_model(tiny_model_dir(family), dtype=dtype))
    on = copy.deepcopy(off).use_fused_mlp()
    ids = torch.randint(3, 96, (1, 6 + 3 + 7 + 1), generator=torch.Generator().manual_seed(5))
    blocks = (1, 1, 1, 7, 1)
    want = _steps(off, ids, blocks)
    launch_spy(fm, "_kernel", "fused_mlp")
    got = _steps(on, ids, blocks)
    L = off.config.num_hidden_layers
    assert launch_spy.launches == ["fused_mlp"] * (L - 1) * 4
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b in zip(want, got):
        assert torch.allclose(a.float(), b.float(), atol=tol * max(1.0, a.float().abs().max().item()))
    assert [torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(want[:5], got[:5])] == [True] * 5


def test_repeated_steps_start_from_zeroed_rows(tiny_model_dir):
    """The same one-token step twice on the same cache state gives the same logits: the pending rows are zeroed at
    every step (without it the second step would add the first's sums again)."""
    from specpilot.models import load_model

    model = _fused(load_model(tiny_model_dir("qwen2"))).use_fused_mlp()
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(7))
    cache = model.new_cache(1, 40)
    with torch.no_grad():
        model(ids[:, :6], torch.arange(6)[None], cache, kv_len=6)
        first = model.logits(model(ids[:, 6:7], torch.tensor([[6]]), cache, kv_len=None))
        second = model.logits(model(ids[:, 6:7], torch.tensor([[6]]), cache, kv_len=None))  # slot 6 rewritten
    assert torch.equal(first, second)
    assert model._mlp_pending.shape == (model.config.num_hidden_layers, model.config.hidden_size)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_ar_and_spec_with_the_fused_mlp_equal_ar(tiny_model_dir, family):
    from specpilot.config import EngineConfig
    from specpilot.drafters import NgramDrafter
    from specpilot.engine import Engine
    from specpilot.models import load_model

    path = tiny_model_dir(family)
    on = _fused(load_model(path)).use_fused_mlp()
    cfg = EngineConfig(drafter_kind="none", max_new_tokens=10, max_seq_len=32, ignore_eos=True, ngram_assist=0)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    want = Engine(load_model(path), cfg).generate(prompt).output_ids
    assert Engine(on, cfg).generate(prompt).output_ids == want
    spec = Engine(on, cfg.with_(drafter_kind="ngram", num_draft_tokens=3), NgramDrafter(3, 1))
    assert spec.generate(prompt).output_ids == want


def test_captured_layers_keep_their_mlp(tiny_model_dir, launch_spy):
    """A layer whose output is captured (a DFlash target's features) runs its MLP unfused, so the captured output is
    the finished residual stream."""
    from specpilot.models import load_model

    model = _fused(load_model(tiny_model_dir("qwen2"))).use_fused_mlp()
    L = model.config.num_hidden_layers
    cache = model.new_cache(1, 40)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        model(ids[:, :6], torch.arange(6)[None], cache, kv_len=6)
        launch_spy(fm, "_kernel", "fused_mlp")
        _, layers = model(ids[:, 6:7], torch.tensor([[6]]), cache, kv_len=None, return_layers=(0,))
    assert launch_spy.launches == ["fused_mlp"] * (L - 2)
    off = _fused(load_model(tiny_model_dir("qwen2")))
    cache = off.new_cache(1, 40)
    with torch.no_grad():
        off(ids[:, :6], torch.arange(6)[None], cache, kv_len=6)
        _, want = off(ids[:, 6:7], torch.tensor([[6]]), cache, kv_len=None, return_layers=(0,))
    assert torch.equal(layers[0], want[0])


def test_fused_mlp_field_setter_loop_and_cost_model(tiny_model_dir, monkeypatch):
    import argparse

    import specpilot.engine as eng
    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.config import EngineConfig
    from specpilot.costmodel.shapes import KERNEL_FLAGS, forward_cost
    from specpilot.errors import ConfigError
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY, Deployment, applicable
    from specpilot.models import load_model
    from specpilot.models.config import ModelConfig

    assert EngineConfig().fused_mlp is False
    with pytest.raises(ConfigError, match="true or false"):
        EngineConfig(fused_mlp="true")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args(["--fused-mlp"])).fused_mlp
    assert "fused_mlp" in EngineMeasure.LAYOUT and "fused_mlp" in KERNEL_FLAGS
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert REGISTRY["fused_mlp"].candidates(gpu.config, gpu) == [{"fused_mlp": True}]
    for other in (dict(rope_in_qkv=False), dict(norm_epilogue=True), dict(lossless12=True), dict(compile=True)):
        assert "fused_mlp" not in [m.name for m in applicable(gpu, gpu.config.with_(**other))]
    # the setter: needs fused_decode + rope_in_qkv, not with the norm epilogue
    with pytest.raises(ConfigError, match="needs fused_decode and rope_in_qkv"):
        load_model(tiny_model_dir("qwen2")).use_fused_decode().use_fused_mlp()
    epi = _fused(load_model(tiny_model_dir("qwen2"))).use_norm_epilogue()
    with pytest.raises(ConfigError, match="norm_epilogue"):
        epi.use_fused_mlp()
    model = _fused(load_model(tiny_model_dir("qwen2"))).use_fused_mlp()
    assert all(torch.equal(m.mlp.down_t, m.mlp.down_proj.weight.t()) for m in model.model.layers)
    model.use_fused_mlp(False)
    assert not model.fused_mlp and not hasattr(model.model.layers[0].mlp, "down_t")
    # the engine's layout (pretending to be on CUDA): on after rope_in_qkv; with the norm epilogue a warning
    monkeypatch.setattr(eng, "_kernel_on", lambda config, field="attention_kernel": getattr(config, field))
    base = EngineConfig(norm_kernel=False, rope_kernel=False, fused_mlp=True)
    laid = load_model(tiny_model_dir("qwen2"))
    eng._apply_layout(laid, base)
    assert laid.fused_mlp and laid.rope_in_qkv
    for other in (dict(norm_epilogue=True), dict(compile=True)):
        with pytest.warns(RuntimeWarning, match="fused_mlp needs"):
            eng._apply_layout(load_model(tiny_model_dir("qwen2")), base.with_(**other))
    # priced: one launch fewer in every one-token layer but the last, one zeroing a pass; bytes unchanged
    cfg = ModelConfig(model_type="qwen2", vocab_size=1000, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    flags = dict(fused=True, norm_kernel=True, rope_kernel=True, fused_decode=True, fused_verify=True,
                 rope_in_qkv=True)
    off, on = forward_cost(cfg, 1, 64, **flags), forward_cost(cfg, 1, 64, **flags, fused_mlp=True)
    assert off.num_kernels - on.num_kernels == 4 - 1 - 1 and off.weight_bytes == on.weight_bytes
    assert forward_cost(cfg, 7, 64, **flags, fused_mlp=True) == forward_cost(cfg, 7, 64, **flags)
