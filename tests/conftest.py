"""Shared fixtures: tiny random models of each family, saved as HF folders (built once per session)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on CPU; set before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def make_hf_model(family: str, seed: int = 0, tie: bool = False, **overrides):
    import transformers

    torch.manual_seed(seed)
    kw = dict(TINY, tie_word_embeddings=tie, **overrides)
    if family == "llama":
        cfg = transformers.LlamaConfig(**kw, rope_theta=10000.0)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**kw, rope_theta=1000000.0)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**kw, head_dim=16, rope_theta=1000000.0)
    else:
        raise ValueError(family)
    cfg.eos_token_id = 2
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # random init leaves biases/norms at trivial values: perturb them so parity means something
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: (family, tie) -> path of a saved tiny random HF model."""
    made = {}

    def get(family: str = "qwen2", tie: bool = False, seed: int = 0):
        key = (family, tie, seed)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{family}-{int(tie)}-{seed}")
            make_hf_model(family, seed=seed, tie=tie).save_pretrained(path)
            made[key] = path
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_dflash_dir(tmp_path_factory):
    """Path of a saved tiny random DFlash drafter (2 layers, block 5) for the tiny qwen3 target (2 layers)."""
    from specpilot.models.dflash import DFlashConfig, DFlashDrafter
    from specpilot.models.dflash_io import save_dflash

    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=5, mask_token_id=95,
                       target_layer_ids=(0, 1), num_target_layers=2, vocab_size=96)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-dflash")
    save_dflash(DFlashDrafter(cfg).eval(), path)
    return str(path)


def _drive_drafters(drafters, feats, ids, chunks, num_tokens, committed=9):
    """Each drafter sees the first `committed` tokens, then `chunks` more at a time (their features observed
    first, as the engine hands them over): -> per step, each drafter's drafted tokens."""
    for d in drafters:
        d.observe(feats[: committed - 1])
    steps = [[d.propose(ids[:committed], num_tokens).token_ids.tolist() for d in drafters]]
    for c in chunks:
        for d in drafters:
            d.observe(feats[committed - 1: committed - 1 + c])
        committed += c
        steps.append([d.propose(ids[:committed], num_tokens).token_ids.tolist() for d in drafters])
    return steps


@pytest.fixture
def drive_drafters():
    """Feeds DFlash drafters a growing context step by step (`_drive_drafters`): shared by the DFlash tests."""
    return _drive_drafters


@pytest.fixture
def sm90_report():
    """Runs a tests/<script> that compiles kernels for sm_90 (no GPU needed: ptxas through Triton) in a process
    without TRITON_INTERPRET (the interpreter replaces `triton.jit`, so nothing compiles under it) -> the JSON of
    its last stdout line. Skips where this Triton cannot compile for NVIDIA GPUs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    try:
        from triton.backends import backends
    except ImportError:
        backends = {}
    if "nvidia" not in backends:
        pytest.skip("this Triton cannot compile for NVIDIA GPUs")
    root = Path(__file__).resolve().parent.parent

    def run(script: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        r = subprocess.run([sys.executable, str(root / "tests" / script)], capture_output=True, text=True,
                           timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture
def launch_spy(monkeypatch):
    """spy(module, attr, name): the Triton kernel module.attr still launches, and each launch appends `name` to
    spy.launches and its grid to spy.grids (in launch order): which kernels a model step ran, over how many
    programs."""
    launches, grids = [], []

    class Spy:
        def __init__(self, name, real):
            self.name, self.real = name, real

        def __getitem__(self, grid):
            launches.append(self.name)
            grids.append(grid)
            return self.real[grid]

    def spy(module, attr: str, name: str) -> None:
        monkeypatch.setattr(module, attr, Spy(name, getattr(module, attr)))

    spy.launches, spy.grids = launches, grids
    return spy


def _field_wired(field: str, args: list[str], want, mechanism: str, candidate: dict):
    """The part of a config field's wiring every field shares: `args` (its CLI flag and value) parse to `want`, it
    is in the loop's layout key (a new layout re-applies the process-wide switch), and the loop mechanism
    `mechanism` proposes `candidate` on a GPU deployment -> that deployment (for further checks)."""
    import argparse

    from specpilot.cli import add_engine_flags, engine_config
    from specpilot.config import EngineConfig
    from specpilot.loop import EngineMeasure
    from specpilot.loop.registry import REGISTRY, Deployment

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    got = getattr(engine_config(parser.parse_args(args)), field)
    assert got == want and type(got) is type(want)
    assert field in EngineMeasure.LAYOUT
    gpu = Deployment("t", "d", EngineConfig(device="cuda"), "H200")
    assert candidate in REGISTRY[mechanism].candidates(gpu.config, gpu)
    return gpu


@pytest.fixture
def field_wired():
    """`_field_wired` for a config field of any type: its CLI flag, the loop's layout key and its mechanism."""
    return _field_wired


@pytest.fixture
def switch_wired():
    """Checks that a boolean EngineConfig switch is wired end to end: off by default, a non-bool value one clear
    ConfigError, its CLI flag, in the loop's layout key (a new layout re-applies the process-wide switch), and a loop
    mechanism proposing `candidate` on a GPU deployment -> that deployment (for further checks)."""

    def check(field: str, flag: str, mechanism: str, candidate: dict):
        from specpilot.config import EngineConfig
        from specpilot.errors import ConfigError

        assert getattr(EngineConfig(), field) is False
        with pytest.raises(ConfigError, match=f"{field} must be true or false"):
            EngineConfig(**{field: "yes"})
        return _field_wired(field, [flag], True, mechanism, candidate)

    return check


def _step_outputs_and_greedy(ref, fast, *, logits: bool):
    """(max |fast - ref| over a 4-token step after a 6-token prefill, the hidden states or their logits; fast's
    greedy n-gram speculative run, checked equal to ref's AR). The step attends over the whole pool, as graphed."""
    from specpilot.config import EngineConfig
    from specpilot.engine import Engine, build_drafter

    ids = torch.tensor([[3, 9, 27, 4, 11, 5, 8, 2, 6, 7]])
    pos = torch.arange(10)[None]
    outs = []
    for model in (ref, fast):
        cache = model.new_cache(1, 48)
        model(ids[:, :6], pos[:, :6], cache, kv_len=6)  # prefill (SDPA in both)
        hidden = model(ids[:, 6:], pos[:, 6:], cache, kv_len=None)
        outs.append(model.logits(hidden) if logits else hidden)
    cfg = EngineConfig(drafter_kind="ngram", num_draft_tokens=4, max_new_tokens=24, max_seq_len=64, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 1, 2]
    spec = Engine(fast, cfg, build_drafter(cfg, None, fast)).generate(prompt)  # multi-token verify steps
    assert spec.output_ids == Engine(ref, cfg.with_(drafter_kind="none")).generate(prompt).output_ids
    return (outs[1] - outs[0]).abs().max().item(), spec


@pytest.fixture
def step_outputs_and_greedy():
    """`_step_outputs_and_greedy`: a kernel-switched model's step against the eager one, and its greedy speculation."""
    return _step_outputs_and_greedy
