"""Prompt lookup beside a model drafter (drafters/ngram_assist.py): the choice rule, and lossless output."""

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.drafters import NgramDrafter
from specpilot.drafters.base import Draft
from specpilot.drafters.ngram_assist import NgramAssistedDrafter
from specpilot.engine import Engine, build_drafter
from specpilot.errors import ConfigError
from specpilot.models import load_model


class FixedDrafter:
    """Drafts the given tokens whatever the context (and records what the engine hands over)."""

    name = "fixed"

    def __init__(self, tokens, probs=None):
        self.tokens, self.probs, self.seen = tokens, probs, []

    def reset(self):
        self.seen = []

    def propose(self, context_ids, num_tokens):
        self.seen.append(len(context_ids))
        return Draft(torch.tensor(self.tokens[:num_tokens]), self.probs)


CTX = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]  # suffix [5, 6, 7] occurred before, followed by 8, 9, 1, 2


@pytest.mark.parametrize("model, min_match, want", [
    ([8, 3, 3, 3], 3, [8, 9, 1, 2]),  # first tokens agree and the match is long enough: the lookup's block
    ([4, 3, 3, 3], 3, [4, 3, 3, 3]),  # first tokens disagree: the model's
    ([8, 3, 3, 3], 4, [8, 3, 3, 3]),  # the match ([5, 6, 7], 3 tokens) is shorter than asked
])
def test_lookup_stands_in_only_when_long_enough_and_agreeing(model, min_match, want):
    d = NgramAssistedDrafter(FixedDrafter(model), NgramDrafter(4, 1), min_match)
    assert d.propose(CTX, 4).token_ids.tolist() == want
    assert d.inner.seen == [len(CTX)]  # the model drafted this step as well (a conditioned one stays in step)


def test_short_lookup_is_padded_with_the_model_tokens_and_sampled_drafts_pass_through():
    ctx = [5, 6, 7, 8, 9, 5, 6, 7]  # the match is followed by only [8, 9, 5, 6, 7]: then the context ends
    d = NgramAssistedDrafter(FixedDrafter([8, 3, 3, 3, 3, 3, 3]), NgramDrafter(4, 1), 2)
    assert d.propose(ctx, 7).token_ids.tolist() == [8, 9, 5, 6, 7, 3, 3]
    probs = torch.full((4, 10), 0.1)
    sampled = NgramAssistedDrafter(FixedDrafter([8, 3, 3, 3], probs), NgramDrafter(4, 1), 2)
    out = sampled.propose(CTX, 4)
    assert out.token_ids.tolist() == [8, 3, 3, 3] and out.probs is probs  # no point masses mixed into sampling


def test_config_validates_and_the_loop_can_search_it():
    from specpilot.loop.registry import REGISTRY

    with pytest.raises(ConfigError, match="ngram_assist"):
        EngineConfig(ngram_assist=-1)
    assert EngineConfig().ngram_assist == 2  # on: it raised tau on every benchmark measured (BENCHMARKS.md)
    assert REGISTRY["ngram_assist"].fields == {"ngram_assist": [0, 2, 3, 4]}  # the loop can also switch it off


@pytest.mark.parametrize("kind", ["model", "dflash"])
def test_greedy_output_equals_ar_with_the_lookup_beside_the_model(tiny_model_dir, tmp_path, kind):
    from specpilot.models.dflash import DFlashConfig, DFlashDrafter
    from specpilot.models.dflash_io import save_dflash

    target = load_model(tiny_model_dir("qwen3"))
    drafter = load_model(tiny_model_dir("qwen3", seed=1))
    if kind == "dflash":
        cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, block_size=5, mask_token_id=95,
                           target_layer_ids=(0, 1), num_target_layers=2, vocab_size=96)
        torch.manual_seed(0)
        save_dflash(DFlashDrafter(cfg).eval(), tmp_path)
        drafter = str(tmp_path)
    cfg = EngineConfig(drafter_kind=kind, num_draft_tokens=4, max_new_tokens=40, max_seq_len=128, ignore_eos=True,
                       ngram_assist=2)
    d = build_drafter(cfg, drafter, target)
    assert isinstance(d, NgramAssistedDrafter) and d.name == f"{kind}+ngram"
    if kind == "dflash":  # a random DFlash drafter never agrees with the lookup: let it stand in whenever it matches
        d._agree = lambda look, model: torch.tensor(True)  # (longer accepted runs: more context per draft pass)
    spec, ar = Engine(target, cfg, d), Engine(target, cfg.with_(drafter_kind="none"))
    used, inner_propose = [], d.inner.propose

    def spy(ids, k):  # record the steps whose verified block is not the model's own
        own = inner_propose(ids, k)
        used.append(own.token_ids.tolist())
        return own

    d.inner.propose = spy
    chosen = []
    outer = d.propose
    d.propose = lambda ids, k: chosen.append(outer(ids, k).token_ids.tolist()) or Draft(torch.tensor(chosen[-1]))
    # repetitive prompts: the lookup finds long matches (and the tiny target tends to repeat itself too)
    for p in ([3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5], [7, 8, 9] * 5, list(range(10, 30))):
        got, want = spec.generate(p), ar.generate(p)
        assert got.output_ids == want.output_ids
    assert any(a != b for a, b in zip(used, chosen))  # the lookup's block was verified on some steps
    if kind == "dflash":  # the conditioned drafter stayed in step (it raises otherwise) and is reachable
        assert d.network is d.inner.network


def test_indexed_lookup_agrees_with_the_scan_as_contexts_grow_and_change():
    """The incremental index answers exactly what the right-to-left scan does: growing contexts (a step at a
    time, or several tokens), a context that is not an extension (a new prompt), small vocabularies (many
    repeats)."""
    g = torch.Generator().manual_seed(0)
    for vocab, (nmax, nmin) in ((3, (4, 1)), (5, (3, 2)), (50, (4, 1))):
        d = NgramDrafter(nmax, nmin)
        for _ in range(4):  # new prompts: the index restarts
            ctx = torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            while len(ctx) < 120:
                for k in (1, 4):
                    assert d.lookup(ctx, k) == d.lookup_scan(ctx, k), (vocab, ctx)
                ctx += torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()


def test_long_blocks_only_where_the_lookup_matches_and_output_stays_the_targets(tiny_model_dir):
    """ngram_assist_tokens: steps with a lookup match draft (and verify) the long block, the others the usual one;
    the engine keeps a verify bucket for each; greedy output equals AR."""
    target = load_model(tiny_model_dir("qwen3"))
    cfg = EngineConfig(drafter_kind="model", num_draft_tokens=3, max_new_tokens=40, max_seq_len=128, ignore_eos=True,
                       ngram_assist=2, ngram_assist_tokens=7)
    d = build_drafter(cfg, load_model(tiny_model_dir("qwen3", seed=1)), target)
    assert d.max_draft_tokens == 7
    spec, ar = Engine(target, cfg, d), Engine(target, cfg.with_(drafter_kind="none"))
    drafted = []
    for p in ([3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5], [7, 8, 9] * 5, list(range(10, 30))):
        got = spec.generate(p)
        assert got.output_ids == ar.generate(p).output_ids
        drafted += got.drafted_lengths
    assert 7 in drafted and 3 in drafted and max(drafted) == 7  # long blocks on matches, short ones elsewhere
    with pytest.raises(ConfigError, match="ngram_assist_tokens"):
        EngineConfig(ngram_assist_tokens=-1)
    short = build_drafter(cfg.with_(ngram_assist_tokens=0), load_model(tiny_model_dir("qwen3", seed=1)), target)
    assert short.max_draft_tokens is None  # off: the engine's own draft length


@pytest.mark.parametrize("short_tokens, want", [(0, ["model", "lookup"]), (2, ["lookup", "model"])])
def test_model_pass_is_queued_before_the_host_lookup_unless_the_lookup_sets_the_length(short_tokens, want):
    """Without a short block the model's pass goes first (the host's lookup then overlaps the GPU's draft); with
    one, the lookup must run first: its match decides how many tokens the model drafts. Drafts are the same."""
    calls = []

    class Spy(NgramDrafter):
        def lookup(self, context_ids, num_tokens):
            calls.append("lookup")
            return super().lookup(context_ids, num_tokens)

    inner = FixedDrafter([8, 3, 3, 3])
    real = inner.propose
    inner.propose = lambda c, k: calls.append("model") or real(c, k)
    d = NgramAssistedDrafter(inner, Spy(4, 1), 3, short_tokens=short_tokens, long_tokens=4 if short_tokens else 0)
    assert d.propose(CTX, 4).token_ids.tolist() == [8, 9, 1, 2]
    assert calls == want
