"""A prompt's prefill from one graph per padded length (EngineConfig.prefill_graphs, engine/prefill_graphs.py), run
here from its static buffers without capturing (the code a CUDA graph records): the cache and features an eager
padded prefill leaves, bit for bit, prompt after prompt; the engines' greedy outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.drafters import SmallARDrafter
from specpilot.engine import Engine, build_drafter
from specpilot.engine.reference import reference_greedy
from specpilot.engine.runner import ModelRunner
from specpilot.errors import ConfigError
from specpilot.models import load_model


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {"qwen2": load_model(tiny_model_dir("qwen2", seed=0)), "qwen3": load_model(tiny_model_dir("qwen3")),
            "other": load_model(tiny_model_dir("qwen2", seed=1))}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_static_prefill_graph_leaves_what_the_eager_prefill_leaves(models, family):
    """Prompts of 30 then 20 tokens share the 32-token buffers (the shorter one must not leave the longer one's
    tokens in the padding: its K/V would differ), a 70-token prompt is past `prefill_graphs` (64) and runs eagerly;
    after each, the whole cache and the captured features equal an eager padded runner's exactly."""
    model = models[family]
    eager = ModelRunner(model, model.new_cache(1, 160), capture_layers=(0, 1), pad_shapes=True)
    graphed = ModelRunner(model, model.new_cache(1, 160), capture_layers=(0, 1), pad_shapes=True, static=True,
                          prefill_graphs=64)
    assert graphed.prefill_graphs.enabled and not eager.prefill_graphs.enabled
    g = torch.Generator().manual_seed(0)
    for T, runs in ((30, 1), (20, 2), (70, 2)):
        ids = torch.randint(3, 96, (T,), generator=g)
        for r in (eager, graphed):
            r.cache.k.zero_()
            r.cache.v.zero_()
            r.prefill(ids, 0)
        assert torch.equal(graphed.cache.k, eager.cache.k) and torch.equal(graphed.cache.v, eager.cache.v)
        assert graphed.last_hidden.shape == (T, 2 * model.config.hidden_size)
        assert torch.equal(graphed.last_hidden, eager.last_hidden)
        assert graphed.prefill_graphs.counts["static"] == runs
        assert set(graphed.prefill_graphs.entries) == {16, 32, 64}  # prepared with the runner: <= 64, the cap
        step = torch.randint(3, 96, (3,), generator=g)
        torch.testing.assert_close(graphed.step(step, T), eager.step(step, T), rtol=0, atol=0)
    assert graphed.prefill_graphed(30, 0) and not graphed.prefill_graphed(70, 0) and not graphed.prefill_graphed(9, 4)
    small = ModelRunner(model, model.new_cache(1, 40), pad_shapes=True, static=True, prefill_graphs=2048)
    assert set(small.prefill_graphs.entries) == {16, 32}  # prepared lengths only where the pool has room


def test_prepared_prefill_graphs_are_built_in_inference_mode(models, monkeypatch):
    """On CUDA `_build` runs the pass (the capture's warm-up) and captures it: built with the runner, outside
    any caller's inference mode, it must still run in one (the model's weights require grad: an autograd graph
    in a warm-up, or an in-place cache write outside it, breaks the capture)."""
    from specpilot.engine.prefill_graphs import PrefillGraphs

    modes = []
    build = PrefillGraphs._build
    monkeypatch.setattr(PrefillGraphs, "_build", lambda self, n: (modes.append(torch.is_inference_mode_enabled()),
                                                                  build(self, n))[1])
    model = models["qwen2"]
    assert not torch.is_inference_mode_enabled()
    ModelRunner(model, model.new_cache(1, 64), pad_shapes=True, static=True, prefill_graphs=64)
    assert modes == [True, True, True]  # 16, 32, 64


def _static_runner(model, buckets, prefill=64, **kw):
    return ModelRunner(model, model.new_cache(1, 128), buckets=buckets, static=True, pad_shapes=True,
                       prefill_graphs=prefill, **kw)


@pytest.mark.parametrize("kind", ["none", "model", "dflash"])
def test_engines_with_prefill_graphs_equal_the_reference_greedy_output(models, tiny_dflash_dir, kind):
    """AR; a small model drafter whose prompt feed goes through its runner's prefill graph (all but the last
    token) and its one-token step (the last one) instead of one eager pass; a DFlash drafter that reads the
    prompt's features from the prefill graph's static output: greedy outputs equal plain greedy decoding, prompt
    after prompt."""
    target = models["qwen3" if kind == "dflash" else "qwen2"]
    K = 4
    cfg = EngineConfig(drafter_kind=kind, num_draft_tokens=K, max_new_tokens=16, max_seq_len=128, ignore_eos=True)
    drafter = None
    if kind == "model":
        drafter = SmallARDrafter(_static_runner(models["other"], (1, 2, K + 1)), cfg.sampling, static=True)
        fed = []
        step = drafter.runner.step
        drafter.runner.step = lambda ids, start: (fed.append((ids.shape[0], start)), step(ids, start))[1]
    if kind == "dflash":
        drafter = build_drafter(cfg, tiny_dflash_dir, target)
    eng = Engine(target, cfg, drafter)
    eng.runner = _static_runner(target, (1,) if drafter is None else (1, K + 1), greedy_verdict=drafter is not None,
                                capture_layers=getattr(drafter, "target_layers", None),
                                feature_fn=getattr(drafter, "features", None))
    plain = None
    if kind == "dflash":  # its drafts depend on the features: the same drafts as after an eager prefill
        other = build_drafter(cfg, tiny_dflash_dir, target)
        plain = Engine(target, cfg, other)
        plain.runner = _static_runner(target, (1, K + 1), prefill=0, greedy_verdict=True,
                                      capture_layers=other.target_layers, feature_fn=other.features)
        drafts = {id(drafter): [], id(other): []}
        for d in (drafter, other):
            propose = d.propose
            d.propose = lambda ctx, n, d=d, propose=propose: (
                lambda out: (drafts[id(d)].append(out.token_ids.tolist()), out)[1])(propose(ctx, n))
    g = torch.Generator().manual_seed(3)
    for prompt_len in (21, 25, 13):  # two share the 32-token buffers
        prompt = torch.randint(3, 96, (prompt_len,), generator=g).tolist()
        got = eng.generate(prompt)
        assert got.output_ids == reference_greedy(target, prompt, len(got.output_ids))
        if plain is not None:
            assert plain.generate(prompt).output_ids == got.output_ids
            assert drafts[id(drafter)] == drafts[id(other)] and drafts[id(drafter)]
    assert eng.runner.prefill_graphs.counts["static"] == 3
    if kind == "model":  # each prompt's feed: prefill of all but its last token, then that one alone
        assert drafter.runner.prefill_graphs.counts["static"] == 3
        assert fed[0] == (1, 20) and (1, 24) in fed and (1, 12) in fed


def test_prefill_graphs_field(models, monkeypatch):
    import specpilot.engine as engine

    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="prefill_graphs"):
            EngineConfig(prefill_graphs=bad)
    target = models["qwen2"]
    monkeypatch.setattr(engine, "_pads", lambda config: config.pad_shapes)  # padded as on CUDA
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_seq_len=64)
    eng = Engine(target, cfg, build_drafter(cfg, models["other"], target))
    for r in (eng.runner, eng.drafter.inner.runner):  # wired to both runners; on the CPU nothing to capture
        assert r.prefill_graphs.max_len == cfg.prefill_graphs and not r.prefill_graphs.enabled
    off = cfg.with_(pad_shapes=False)  # every prompt its own length: no graphs per length
    assert Engine(target, off).runner.prefill_graphs.max_len == 0
