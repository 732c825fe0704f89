"""Greedy verdict computed inside the verify step (`ModelRunner.step_greedy_verdict`, EngineConfig.fused_accept).

The packed verdict [num_accepted, next_token, d_1 .. d_K] must equal `verify_chain`'s on any logits, also for a
padded block (what a bucket's CUDA graph runs: junk after the real drafts must never be accepted). In the engine,
greedy output must equal AR token for token through the eager path and through the static bucket path (the exact
code a CUDA graph records, run uncaptured on the CPU), with K = 0 steps and steps shortened near the limits.
"""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specpilot.config import EngineConfig, SamplingConfig
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, build_drafter
from specpilot.engine.reference import reference_greedy
from specpilot.engine.runner import ModelRunner
from specpilot.models import load_model
from specpilot.sampling import probs_from_logits
from specpilot.verify import greedy_verdict_packed, verify_chain


def _want(block, logits):
    v = verify_chain(block[1:], logits)
    return [int(v.num_accepted), int(v.next_token)] + block[1:].tolist()


@pytest.mark.parametrize("K", [0, 1, 2, 4, 7])
def test_packed_verdict_equals_verify_chain(K):
    g = torch.Generator().manual_seed(K)
    V = 11
    for trial in range(40):
        logits = torch.randn(K + 1, V, generator=g)
        best = logits.argmax(-1)
        drafts = torch.randint(0, V, (K,), generator=g)
        cut = trial % (K + 1)  # the first `cut` drafts agree with the target (then, usually, a disagreement)
        drafts[:cut] = best[:cut]
        block = torch.cat([torch.randint(0, V, (1,), generator=g), drafts])
        got = greedy_verdict_packed(block, logits).tolist()
        assert got == _want(block, logits)
        assert got[0] >= cut


@pytest.mark.parametrize("K", [0, 1, 3, 6])
def test_packed_verdict_all_and_none_accepted(K):
    V = 9
    logits = torch.randn(K + 1, V, generator=torch.Generator().manual_seed(10 + K))
    best = logits.argmax(-1)
    all_in = torch.cat([torch.tensor([3]), best[:K]])
    assert greedy_verdict_packed(all_in, logits).tolist() == [K, int(best[K])] + best[:K].tolist()  # bonus token
    if K:
        none_in = all_in.clone()
        none_in[1] = (best[0] + 1) % V
        assert greedy_verdict_packed(none_in, logits).tolist() == [0, int(best[0])] + none_in[1:].tolist()


@pytest.mark.parametrize("K", [0, 1, 3])
def test_padded_block_never_accepts_junk(K):
    """A bucket of B tokens run for K + 1 < B: the junk drafts after d_K agree with the target (the worst case),
    yet the verdict stops at K, equals the unpadded one, and the junk reads back as -1."""
    B, V = 6, 13
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(K))
    best = logits.argmax(-1)
    padded = torch.cat([torch.tensor([4]), best[: B - 1]])  # every draft, real or junk, is the target's argmax
    got = greedy_verdict_packed(padded, logits, torch.tensor([K])).tolist()
    assert got[: K + 2] == _want(padded[: K + 1], logits[: K + 1])
    assert got[: 2] == [K, int(best[K])]
    assert got[K + 2:] == [-1] * (B - 1 - K)


class _HostReads(TorchDispatchMode):
    """Counts ops that read a device value on the host (`.item()` and friends: a sync on CUDA, and refused inside
    a CUDA graph capture). `.tolist()` on a CPU tensor is no dispatched op, so the engine's one read is not
    counted."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default,
                    torch.ops.aten.is_nonzero.default):  # item() shows as aten.item under inference_mode
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("K", [0, 3])
def test_verification_reads_nothing_on_the_host(K):
    """Greedy and sampled verification stay on the device (a 0-dim tensor index or F.one_hot would call .item())."""
    g = torch.Generator().manual_seed(0)
    V = 10
    logits, drafts = torch.randn(K + 1, V, generator=g), torch.randint(0, V, (K,), generator=g)
    probs = probs_from_logits(logits, SamplingConfig(temperature=1.0))
    q = torch.softmax(torch.randn(K, V, generator=g), -1)
    block = torch.cat([torch.tensor([1]), drafts, torch.tensor([2, 3])])
    with _HostReads() as reads:
        verify_chain(drafts, logits)
        greedy_verdict_packed(block[: K + 1], logits)
        greedy_verdict_packed(block, torch.randn(K + 3, V, generator=g), torch.tensor([K]))
        verify_chain(drafts, logits, target_probs=probs, draft_probs=q, generator=g)
        verify_chain(drafts, logits, target_probs=probs, generator=g)  # point-mass drafter
    assert reads.count == 0


# -- in the engine --


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {"target": load_model(tiny_model_dir("qwen2", seed=0)), "other": load_model(tiny_model_dir("qwen2", seed=1)),
            "qwen3": load_model(tiny_model_dir("qwen3"))}


def _static(eng: Engine) -> Engine:
    """The engine with its target runner replaced by one running the bucketed steps from static buffers, as the
    CUDA graphs do (padded blocks, the whole KV pool attended, the verdict inside the step), uncaptured."""
    r = eng.runner
    eng.runner = ModelRunner(eng.target, r.cache, buckets=(1, eng.config.num_draft_tokens + 1), static=True,
                             greedy_verdict=True, capture_layers=r.capture_layers, feature_fn=r.feature_fn)
    assert eng.runner.graphs  # the buckets exist (uncaptured): steps that fit one take the static path
    return eng


def _count_calls(eng: Engine) -> dict:
    calls = {"step": 0, "step_greedy_verdict": 0}
    for name in calls:
        fn = getattr(eng.runner, name)

        def wrapped(*a, _fn=fn, _name=name):
            calls[_name] += 1
            return _fn(*a)

        setattr(eng.runner, name, wrapped)
    return calls


def _prompts():
    g = torch.Generator().manual_seed(0)
    repetitive = [(torch.randint(3, 96, (5,), generator=g).tolist() * 3)[: 8 + 3 * i] for i in range(2)]
    return repetitive + [torch.randint(3, 96, (9,), generator=g).tolist()]  # the last: few n-gram hits (K = 0)


LIMITS = {"length": dict(max_new_tokens=23, max_seq_len=128), "context": dict(max_new_tokens=100, max_seq_len=40)}


@pytest.mark.parametrize("kind,static,limits", [
    ("ngram", True, "length"), ("ngram", True, "context"), ("model", True, "length"),
    ("dflash", True, "length"), ("dflash", True, "context"),
    ("ngram", False, "length"), ("ngram", False, "context"),  # the eager fused path also runs in every other
])                                                            # greedy engine test (it is the default)
def test_fused_greedy_equals_ar_and_the_unfused_path(models, tiny_dflash_dir, kind, static, limits):
    """Token for token equal to AR, and step for step equal to the unfused path (same drafts, same verdicts),
    with K = 0 steps (n-gram misses) and K shortened by max_new_tokens (23 is no multiple of K + 1) or by the
    context limit (max_seq_len=40: the last steps no longer fit the bucket and run eagerly, down to K = 0)."""
    limits = LIMITS[limits]
    target = models["target"]
    k = 4
    cfg = EngineConfig(drafter_kind=kind, num_draft_tokens=k, ignore_eos=True, **limits)
    if kind == "ngram":
        drafter = lambda: NgramDrafter(3, 1)  # noqa: E731
    elif kind == "model":
        drafter = lambda: build_drafter(cfg, models["other"], target)  # noqa: E731
    else:
        path = tiny_dflash_dir
        target = models["qwen3"]  # as in test_dflash_engine.py
        cfg = cfg.with_(drafter_kind="dflash")
        drafter = lambda: build_drafter(cfg, path, target)  # noqa: E731
    ar = Engine(target, cfg.with_(drafter_kind="none"))
    shared = drafter()  # one drafter serves both engines: each generate() resets it
    fused = Engine(target, cfg, shared)
    if static:
        fused = _static(fused)
    unfused = Engine(target, cfg.with_(fused_accept=False), shared)
    calls = _count_calls(fused)
    drafted = []
    for p in _prompts():
        want, got, old = ar.generate(p), fused.generate(p), unfused.generate(p)
        assert got.output_ids == want.output_ids == old.output_ids
        assert got.finish_reason == want.finish_reason
        assert got.accepted_lengths == old.accepted_lengths and got.drafted_lengths == old.drafted_lengths
        assert got.stage_s["accept"] < got.stage_s["verify"]
        drafted += got.drafted_lengths
    assert calls["step"] == 0 and calls["step_greedy_verdict"] == len(drafted)  # the fused path, every step
    assert max(drafted) == k and min(drafted) < k  # full blocks and shortened ones
    if kind == "ngram" or limits["max_seq_len"] == 40:
        assert 0 in drafted  # steps with no draft at all


def test_padded_bucket_step_ignores_stale_drafts(models):
    """A static bucket of 5 tokens whose buffer still holds the previous block: asked for a shorter block, the
    verdict must not accept the stale tokens behind it, even when they are exactly the target's continuation."""
    target = models["target"]
    p = [7, 8, 9, 10, 11, 12]
    cont = reference_greedy(target, p, 6)
    runner = ModelRunner(target, target.new_cache(1, 64), buckets=(1, 5), static=True, greedy_verdict=True)
    eager = ModelRunner(target, target.new_cache(1, 64))
    for r in (runner, eager):
        r.prefill(torch.tensor(p[:-1]), 0)
    start = len(p) - 1
    full = torch.tensor([p[-1]] + cont[:4])
    assert runner.step_greedy_verdict(full, start).tolist() == [4, cont[4]] + cont[:4]  # all accepted + bonus
    for T in (1, 2, 3):  # the buffer's tail is stale: cont[T-1:4], the target's own continuation
        short = full[:T]
        got = runner.step_greedy_verdict(short, start).tolist()
        assert got == eager.step_greedy_verdict(short, start).tolist() == [T - 1, cont[T - 1]] + cont[: T - 1]
    wrong = torch.tensor([p[-1], cont[0], (cont[1] + 1) % 96])
    assert runner.step_greedy_verdict(wrong, start).tolist() == [1, cont[1], cont[0], (cont[1] + 1) % 96]


def test_fused_steps_read_the_device_only_once(models):
    """Between a step's forward and its `.tolist()`, nothing reads the device: on the static path (what the graph
    records) no op of the whole decode loop does, so the commit's read is the step's one host sync."""
    cfg = EngineConfig(drafter_kind="ngram", num_draft_tokens=4, max_new_tokens=20, max_seq_len=64, ignore_eos=True)
    eng = _static(Engine(models["target"], cfg, NgramDrafter(3, 1)))
    p = _prompts()[0]
    eng.generate(p)
    with _HostReads() as reads:
        res = eng.generate(p)
    assert reads.count == 0 and len(res.accepted_lengths) > 1


def test_sampling_keeps_the_logits_path(models):
    """Sampled decoding never takes the fused step (it needs the logits), and its target runner has no verdict."""
    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_new_tokens=12, max_seq_len=64, ignore_eos=True)
    cfg = cfg.with_(sampling=cfg.sampling.__class__(temperature=0.8, seed=3))
    eng = Engine(target, cfg, build_drafter(cfg, models["other"], target))
    assert not eng.runner.greedy_verdict
    calls = _count_calls(eng)
    assert len(eng.generate(_prompts()[0]).output_ids) == 12
    assert calls["step_greedy_verdict"] == 0 and calls["step"] > 0


def test_compiled_static_step_keeps_the_verdict(models, monkeypatch):
    """With compile=True the runner's forward goes through torch.compile (TorchDynamo; the 'eager' backend keeps
    this test fast on the CPU) and the verdict still comes out of the bucketed step, equal to the eager one."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(real, backend="eager"))
    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_new_tokens=16, max_seq_len=64, ignore_eos=True,
                       compile=True)
    eng = Engine(target, cfg, build_drafter(cfg, models["other"], target))
    r = eng.runner
    eng.runner = ModelRunner(target, r.cache, buckets=(1, 4), static=True, compile=True, greedy_verdict=True)
    assert eng.runner._fwd is not eng.runner._forward  # really compiled
    ar = Engine(target, cfg.with_(drafter_kind="none", compile=False))
    for p in _prompts()[:2]:
        assert eng.generate(p).output_ids == ar.generate(p).output_ids


def test_failed_capture_runs_the_bucket_eagerly_and_never_reuses_the_broken_pool(models, monkeypatch):
    """A CUDA-graph capture that fails (H200 session 11: compile + the norm/RoPE kernels) must leave a working
    runner: the bucket runs eagerly with a warning, and later buckets capture into a fresh pool (a second capture
    into the broken one raised `beginAllocateToPool: already recording`)."""
    import specpilot.engine.runner as runner_mod

    pools, used = iter(range(100)), []
    monkeypatch.setattr(runner_mod.torch.cuda, "graph_pool_handle", lambda: next(pools))

    def broken_capture(fn, *, warmup=2, pool=None):
        if pool in used:
            raise AssertionError("captured again into a pool whose capture failed")
        used.append(pool)
        fn()
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(runner_mod, "capture", broken_capture)
    target = models["target"]
    runner = ModelRunner(target, target.new_cache(1, 64), greedy_verdict=True)
    runner._arange = torch.arange(5)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        runner._build([5, 1], graphs=True)
    assert used == [0, 1] and all(runner.graphs[T][0] is None for T in (5, 1))
    eager = ModelRunner(target, target.new_cache(1, 64))
    p = [7, 8, 9, 10, 11, 12]
    cont = reference_greedy(target, p, 5)
    for r in (runner, eager):
        r.prefill(torch.tensor(p[:-1]), 0)
    block = torch.tensor([p[-1]] + cont[:4])
    assert runner.step_greedy_verdict(block, len(p) - 1).tolist() == \
        eager.step_greedy_verdict(block, len(p) - 1).tolist() == [4, cont[4]] + cont[:4]
    assert runner.step_counts == {"graphed": 0, "eager_bucket": 1, "unbucketed": 0}  # (prefill is not a step)
