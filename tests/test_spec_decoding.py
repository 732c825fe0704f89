"""Speculative decoding on tiny random models: greedy output == AR output == the naive oracle, token for token."""

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.drafters import NgramDrafter
from specpilot.engine import Engine, build_drafter
from specpilot.engine.reference import reference_greedy
from specpilot.models import load_model


def _prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    # repetitive prompts give the n-gram drafter something to find
    return [(torch.randint(3, 96, (5,), generator=g).tolist() * 3)[: 8 + 3 * i] for i in range(n)]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {
        "target": load_model(tiny_model_dir("qwen2", seed=0)),
        "other": load_model(tiny_model_dir("qwen2", seed=1)),
    }


def test_ar_equals_reference(models):
    target = models["target"]
    cfg = EngineConfig(drafter_kind="none", max_new_tokens=24, max_seq_len=128, ignore_eos=True)
    eng = Engine(target, cfg)
    for p in _prompts():
        assert eng.generate(p).output_ids == reference_greedy(target, p, 24)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["self", "other", "ngram"])
def test_greedy_spec_equals_ar(models, kind, k):
    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=k, max_new_tokens=30, max_seq_len=128, ignore_eos=True,
                       ngram_assist=0 if kind == "self" else 2)  # a perfect drafter: a lookup could only shorten
    if kind == "ngram":
        drafter = NgramDrafter(3, 1)
    else:
        drafter = build_drafter(cfg, models["target" if kind == "self" else "other"], target)
    ar = Engine(target, cfg.with_(drafter_kind="none"))
    spec = Engine(target, cfg, drafter)
    for p in _prompts():
        want = ar.generate(p)
        got = spec.generate(p)
        assert got.output_ids == want.output_ids
        assert got.num_target_forwards <= want.num_target_forwards
        if kind == "self":  # a drafter identical to the target is always right: every step commits k+1
            assert got.accepted_lengths[:-1] == [k] * (len(got.accepted_lengths) - 1)


def test_eos_and_max_tokens_cut_identically(models):
    """Blocks that run past EOS or max_new_tokens are cut at the same token AR stops at."""
    target = models["target"]
    probe = Engine(target, EngineConfig(drafter_kind="none", max_new_tokens=20, max_seq_len=64, ignore_eos=True))
    p = _prompts(1)[0]
    free = probe.generate(p).output_ids
    eos = free[7]  # pretend the 8th generated token is EOS
    target.config.__dict__["eos_token_ids"] = (eos,)  # frozen dataclass: tests may poke it
    try:
        cfg = EngineConfig(drafter_kind="model", num_draft_tokens=4, max_new_tokens=20, max_seq_len=64)
        ar = Engine(target, cfg.with_(drafter_kind="none")).generate(p)
        spec = Engine(target, cfg, build_drafter(cfg, target, target)).generate(p)
    finally:
        target.config.__dict__["eos_token_ids"] = ()
    assert ar.output_ids == spec.output_ids == free[: free.index(eos) + 1]
    assert ar.finish_reason == spec.finish_reason == "eos"
    for n in (1, 2, 5, 9):
        cfg = EngineConfig(drafter_kind="model", num_draft_tokens=4, max_new_tokens=n, max_seq_len=64, ignore_eos=True)
        got = Engine(target, cfg, build_drafter(cfg, target, target)).generate(p)
        assert got.output_ids == free[:n] and got.finish_reason == "length"


def test_context_limit_stops_cleanly(models):
    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=4, max_new_tokens=100, max_seq_len=32, ignore_eos=True)
    p = _prompts(1)[0]
    ar = Engine(target, cfg.with_(drafter_kind="none")).generate(p)
    spec = Engine(target, cfg, build_drafter(cfg, target, target)).generate(p)
    assert ar.finish_reason == spec.finish_reason == "context"
    assert ar.output_ids == spec.output_ids
    assert len(p) + len(ar.output_ids) == 33  # positions 0..31 written, plus the last token never fed


def test_sampled_spec_is_seeded_and_runs(models):
    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_new_tokens=20, max_seq_len=64, ignore_eos=True)
    cfg = cfg.with_(sampling=cfg.sampling.__class__(temperature=0.8, top_k=20, seed=7))
    runs = []
    for _ in range(2):
        eng = Engine(target, cfg, build_drafter(cfg, models["other"], target))
        runs.append(eng.generate(_prompts(1)[0]).output_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 20


def test_ngram_drafter_proposes_continuation():
    d = NgramDrafter(3, 1)
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert d.propose(ctx, 3).token_ids.tolist() == [8, 9, 1]
    assert d.propose([1, 2, 3], 4).token_ids.numel() == 0


@pytest.mark.parametrize("k", [2, 5])
def test_ngram_replay_predicts_the_engine_steps_exactly(models, k):
    """`replay` (the loop's prediction of an n-gram setting, no model run) gives the engine's own step count."""
    from specpilot.drafters.ngram import replay

    cfg = EngineConfig(drafter_kind="ngram", num_draft_tokens=k, max_new_tokens=30, max_seq_len=128, ignore_eos=True)
    drafter = NgramDrafter(3, 1)
    spec = Engine(models["target"], cfg, drafter)
    prompts = _prompts()
    results = [spec.generate(p) for p in prompts]
    steps = sum(len(r.accepted_lengths) for r in results)
    tokens = sum(len(r.output_ids) for r in results)
    got = replay(drafter, prompts, [r.output_ids for r in results], k)
    assert got["tau"] == pytest.approx(tokens / steps) and got["tau"] > 1.0  # repetitive prompts: drafts hit
    assert got["propose_s"] > 0
    assert replay(drafter, prompts, [r.output_ids for r in results], 0)["tau"] == 1.0  # no drafts: one per step


def test_stop_strings_cut_ar_and_spec_at_the_same_token(models):
    """A stop string ends generation at the token that completes it, in AR and speculative decoding alike."""
    target = models["target"]
    vocab = {i: f"<{i}>" for i in range(96)}
    decode = lambda ids: "".join(vocab[i] for i in ids)

    class FakeTok:  # the engine needs only decode() and eos_token_id from a tokenizer
        eos_token_id = None
        decode = staticmethod(lambda ids, skip_special_tokens=False: decode(ids))

    p = _prompts(1)[0]
    free = Engine(target, EngineConfig(drafter_kind="none", max_new_tokens=20, max_seq_len=64, ignore_eos=True)).generate(p).output_ids
    stop = decode(free[5:7])  # spans two tokens: completed by the 7th
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=4, max_new_tokens=20, max_seq_len=64, ignore_eos=True,
                       stop_strings=(stop,))
    ar = Engine(target, cfg.with_(drafter_kind="none"), None, FakeTok()).generate(p)
    spec = Engine(target, cfg, build_drafter(cfg, target, target), FakeTok()).generate(p)
    first = min(i for i in range(len(free)) if stop in decode(free[: i + 1]))
    assert ar.output_ids == spec.output_ids == free[: first + 1]
    assert ar.finish_reason == spec.finish_reason == "stop"


class _RecordingConditionedDrafter(NgramDrafter):
    """An n-gram drafter that also asks for target features, recording what the engine hands it."""

    target_layers = (0, 1)

    def __init__(self):
        super().__init__(3, 1)
        self.seen = []

    def reset(self):
        self.seen = []

    def observe(self, features):
        self.seen.append(features.clone())


def test_conditioned_drafter_sees_target_features_of_every_committed_token(models):
    """DFlash-style drafters condition on target layer outputs: the engine must deliver them for each committed
    token (all but the last), in order, equal to a full forward's."""
    target = models["target"]
    cfg = EngineConfig(drafter_kind="ngram", num_draft_tokens=4, max_new_tokens=24, max_seq_len=128, ignore_eos=True)
    drafter = _RecordingConditionedDrafter()
    p = _prompts(1)[0]
    res = Engine(target, cfg, drafter).generate(p)
    assert res.output_ids == Engine(target, cfg.with_(drafter_kind="none")).generate(p).output_ids
    seen = torch.cat(drafter.seen)
    seq = p + res.output_ids[:-1]
    with torch.no_grad():
        _, layers = target(torch.tensor([seq]), torch.arange(len(seq))[None], target.new_cache(1, 128),
                           kv_len=len(seq), return_layers=(0, 1))
    want = torch.cat(layers, -1)[0]
    assert seen.shape == want.shape
    assert (seen - want).abs().max().item() < 1e-4


def test_small_ar_drafter_feeds_only_new_tokens(models):
    """After a fully accepted block the drafter's cache already holds the drafts: it feeds just the bonus token."""
    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_new_tokens=20, max_seq_len=64, ignore_eos=True)
    drafter = build_drafter(cfg, target, target)
    fed = []
    step = drafter.runner.step
    drafter.runner.step = lambda ids, start: (fed.append(ids.shape[0]), step(ids, start))[1]
    p = _prompts(1)[0]
    res = Engine(target, cfg, drafter).generate(p)
    assert res.output_ids == Engine(target, cfg.with_(drafter_kind="none")).generate(p).output_ids
    catch_up = fed[::3]  # each propose: one catch-up pass, then num_draft_tokens - 1 single-token passes
    assert catch_up[0] == len(p) and all(n == 2 for n in catch_up[1:])  # bonus + the never-fed last draft


def test_propose_timer_times_a_small_model_drafters_passes(models):
    """`specpilot profile` (drafters/timing.py) on a small model drafter: every propose launches its passes
    (`last_launch_t` inside the call, pass kind "passes"); their device time is timed on CUDA only (the runner's
    device decides; on the CPU nothing is timed and the output is unchanged)."""
    from types import SimpleNamespace

    from specpilot.drafters.timing import ProposeTimer, _times_passes

    target = models["target"]
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_new_tokens=12, max_seq_len=64, ignore_eos=True)
    drafter = build_drafter(cfg, target, target)
    timer = ProposeTimer(drafter)
    p = _prompts(1)[0]
    res = Engine(target, cfg, drafter).generate(p)
    assert res.output_ids == Engine(target, cfg.with_(drafter_kind="none")).generate(p).output_ids
    steps = len(res.accepted_lengths)
    assert timer.calls == steps and timer.passes == {"passes": steps}
    assert 0 <= timer.host_pre_launch_s <= timer.wall_s and timer.graph_device_s() is None
    assert drafter.inner.graph_events is None  # CPU: not switched on
    # its launches outside the graphs: the fed tokens' copy before the first pass; after it, per pass two input
    # copies and an argmax, and the final stack (K = 3: 3 * 3 + 1)
    inner = drafter.inner
    assert inner.propose(p, 3) is not None and inner.last_eager_launches == (1, 10)
    assert inner.propose(p, 1) is not None and inner.last_eager_launches == (1, 4)
    # the device time per kind of pass, from the labels the drafter keeps beside its event pairs (fake events
    # here: elapsed_time in ms, as CUDA events give it)
    ev = lambda ms: (SimpleNamespace(elapsed_time=lambda _b: ms), None)  # noqa: E731
    inner.graph_events, inner.graph_event_labels = [ev(2.0), ev(1.0), ev(1.0), ev(4.0)], [2, 1, 1, "chain"]
    by = timer.graph_device_s_by_pass()
    assert by == {"1": {"mean_s": 1e-3, "count": 2}, "2": {"mean_s": 2e-3, "count": 1},
                  "chain": {"mean_s": 4e-3, "count": 1}}
    inner.graph_event_labels = [1]  # labels that do not match the events: nothing claimed
    assert timer.graph_device_s_by_pass() == {}
    on_gpu = SimpleNamespace(graph_events=None, runner=SimpleNamespace(device=torch.device("cuda")))
    on_cpu = SimpleNamespace(graph_events=None, runner=SimpleNamespace(device=torch.device("cpu")))
    assert _times_passes(on_gpu) and not _times_passes(on_cpu) and not _times_passes(SimpleNamespace())


def _small_drafter(model, chain: int, K: int):
    from specpilot.drafters import SmallARDrafter
    from specpilot.engine.runner import ModelRunner

    runner = ModelRunner(model, model.new_cache(1, 64), buckets=(1, 2, K + 1), static=True)
    return SmallARDrafter(runner, EngineConfig().sampling, chain=chain, static=True)


def test_chained_draft_passes_equal_the_pass_by_pass_loop(models):
    """EngineConfig.draft_chain_graph (drafters/small_ar.py): the K - 1 one-token passes chained on the device (run
    here from the chain's static buffers, eagerly) draft the same tokens as the pass-by-pass loop, step after step,
    with only the catch-up pass going through the runner's bucketed steps; a step drafting another number of
    tokens takes the loop; greedy output through the engine equals AR."""
    target, other = models["target"], models["other"]
    K = 4
    loop, chained = _small_drafter(other, 0, K), _small_drafter(other, K - 1, K)
    calls = []
    step = chained.runner.step
    chained.runner.step = lambda ids, start: (calls.append(ids.shape[0]), step(ids, start))[1]
    ctx = _prompts(1)[0]
    for n in range(6):
        k = K if n != 3 else 2  # one step drafts fewer (the end of an output): the loop
        a, b = loop.propose(ctx, k).token_ids, chained.propose(ctx, k).token_ids
        assert a.tolist() == b.tolist()
        ctx = ctx + a.tolist()[: 1 + n % 3] + [7]  # some drafts accepted, then the target's token
    assert len(calls) == 6 + 1  # one catch-up pass a step, + the short step's second pass
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=K, max_new_tokens=20, max_seq_len=64, ignore_eos=True,
                       ngram_assist=0)
    p = _prompts(2)[1]
    res = Engine(target, cfg, _small_drafter(other, K - 1, K)).generate(p)
    assert res.output_ids == Engine(target, cfg.with_(drafter_kind="none")).generate(p).output_ids
    # off the GPU without static buffers (the CPU engine), and under sampling, there is no chain
    assert build_drafter(cfg.with_(draft_chain_graph=True), other, target).chain == 0
    from specpilot.config import SamplingConfig

    sampled = _small_drafter(other, 0, K)
    from specpilot.drafters import SmallARDrafter

    assert SmallARDrafter(sampled.runner, SamplingConfig(temperature=0.7), chain=3, static=True).chain == 0
    with pytest.raises(Exception, match="draft_chain_graph"):
        EngineConfig(draft_chain_graph="yes")
