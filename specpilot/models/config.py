"""Model shape and numerics, read from an HF `config.json`.

One dataclass covers the dense decoder family we run (Llama, Qwen2/2.5, Qwen3). Anything the forward pass
needs is here; nothing else from config.json is read at run time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specpilot.errors import ModelFormatError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def read_config_json(path: Path, what: str) -> dict:
    """`path/config.json` as a dict, or a ModelFormatError that names the folder and what it should have been."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{path} has no config.json: not {what}") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}/config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{path}/config.json is not a JSON object")
    return cfg


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2 always has it)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelFormatError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf_dict(cls, cfg: dict, generation_cfg: dict | None = None) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        try:
            heads = cfg["num_attention_heads"]
            eos = (generation_cfg or {}).get("eos_token_id", cfg.get("eos_token_id"))
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                model_type=model_type,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                rope_scaling=cfg.get("rope_scaling"),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
                qk_norm=model_type == "qwen3",
                eos_token_ids=tuple(int(e) for e in eos_ids),
                bos_token_id=cfg.get("bos_token_id"),
            )
        except KeyError as e:
            raise ModelFormatError(f"config.json lacks required field {e.args[0]!r}") from None

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg = read_config_json(path, "an HF model folder")
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_hf_dict(cfg, gen)
