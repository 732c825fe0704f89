"""Load an HF model folder (config.json + safetensors, single file or sharded) into our `DenseLM`.

Weights are read straight onto the target device and dtype; parameters are created on the meta device first so a
model is never materialised twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specpilot.errors import ConfigError, ModelFormatError
from specpilot.models.config import ModelConfig
from specpilot.models.dense import DenseLM, rope_inv_freq


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path} holds no *.safetensors weights")
    return files


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device that this machine has, or a ConfigError that says why not (rather than an error
    from deep inside the weight reader, e.g. about pinned memory, when CUDA is asked for on a CPU-only machine)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available (no NVIDIA GPU or a CPU-only torch build)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "meta"):
        raise ConfigError(f"device {device!r}: SpecPilot runs on cpu or cuda")
    return dev


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DenseLM:
    check_device(device)
    path = Path(path)
    cfg = ModelConfig.from_folder(path)
    with torch.device("meta"):
        model = DenseLM(cfg)
    state = {}
    for f in _weight_files(path):
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                for name in fh.keys():
                    state[name] = fh.get_tensor(name).to(dtype)
        except Exception as e:  # safetensors raises its own error types for truncated headers/data
            raise ModelFormatError(f"cannot read weights {f}: {e}") from None
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {n for n, _ in model.named_parameters()}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    unexpected = {n for n in unexpected if not n.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ModelFormatError(
            f"{path}: weights do not match a {cfg.model_type} model "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)  # buffers were made on meta: rebuild on the real device
    return model.eval()


def random_model(cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0) -> DenseLM:
    """A model of real shape with random weights made directly on the device: speed work at scale needs no weight
    files (timing depends on shapes, not values; never time on zeros, hence N(0, 0.02))."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    with torch.device(device):
        model = DenseLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norm weights near 1, as trained models have them
                p.copy_(1.0 + 0.02 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    torch.random.set_rng_state(gen_state)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.to(dtype).eval()
