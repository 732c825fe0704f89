"""The DFlash drafter's configuration as z-lab's config.json states it (`DFlashConfig.from_hf_dict` /
`to_hf_dict`), including the reference's defaults and quirks; the network itself is `models/dflash.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

from specpilot.errors import ModelFormatError

ARCHITECTURE = "DFlashDraftModel"
_QWEN3_MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default, which the reference inherits
_QWEN3_HEAD_DIM = 128  # ditto: Qwen3Config's head_dim default when config.json has none


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default choice of target layers (used only when the config names none)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, num_target_layers - 3
    return tuple(round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () means all full
    sliding_window: int | None = None  # effective window (None unless the config enables sliding windows)
    is_causal: bool | None = None  # explicit override of the per-layer rule, as in the reference
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    extra: dict = field(default_factory=dict, compare=False)  # other config.json fields, kept for saving

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ModelFormatError(f"DFlash block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ModelFormatError("DFlash config names no target layers")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError("layer_types must name one type per draft layer")
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ModelFormatError(f"unsupported DFlash layer types {sorted(bad)}")

    def layer_is_causal(self, i: int) -> bool:
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        if self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "DFlashConfig":
        """Read a z-lab DFlash config.json (a Qwen3 config plus `block_size` and `dflash_config`)."""
        archs = cfg.get("architectures") or []
        if "DFlash2DraftModel" in archs:
            raise ModelFormatError("DFlash 2 drafters (DFlash2DraftModel) are not supported, only DFlashDraftModel")
        dcfg = cfg.get("dflash_config")
        if not isinstance(dcfg, dict) or (archs and ARCHITECTURE not in archs):
            raise ModelFormatError(
                f"not a DFlash drafter config (architectures={archs}, dflash_config "
                f"{'present' if isinstance(dcfg, dict) else 'missing'}); expected {ARCHITECTURE} with dflash_config"
            )

        def draft_value(name, default=None):  # the reference reads dflash_config first, then the top level
            return dcfg.get(name, cfg.get(name, default))

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelFormatError(f"unsupported DFlash hidden_act {act!r} (Qwen3-style layers use silu)")
        try:
            heads = int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
            mask_token_id = draft_value("mask_token_id")
            if mask_token_id is None:
                raise KeyError("dflash_config.mask_token_id")
            ids = draft_value("target_layer_ids")
            n_target = cfg.get("num_target_layers")
            if ids is None:
                if n_target is None:
                    raise KeyError("dflash_config.target_layer_ids")
                ids = build_target_layer_ids(int(n_target), n_layers)
            rope_params = cfg.get("rope_parameters") or {}
            scaling = cfg.get("rope_scaling")
            if scaling is None and rope_params.get("rope_type", "default") != "default":
                scaling = dict(rope_params)
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
            layer_types = cfg.get("layer_types")
            if layer_types is None:  # Qwen3Config's rule
                max_window = cfg.get("max_window_layers", _QWEN3_MAX_WINDOW_LAYERS)
                layer_types = [
                    "sliding_attention" if window is not None and i >= max_window else "full_attention"
                    for i in range(n_layers)
                ]
            softcap = draft_value("final_logit_softcapping")
            head_dim = cfg.get("head_dim", _QWEN3_HEAD_DIM) or cfg["hidden_size"] // heads
            known = {
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "block_size", "dflash_config", "num_target_layers", "vocab_size",
                "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                "attention_bias", "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
                "is_causal", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                "architectures", "model_type", "hidden_act", "dtype", "torch_dtype", "transformers_version",
            }
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                block_size=int(draft_value("block_size", 16)),
                mask_token_id=int(mask_token_id),
                target_layer_ids=tuple(int(i) for i in ids),
                num_target_layers=None if n_target is None else int(n_target),
                vocab_size=cfg.get("vocab_size"),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                layer_types=tuple(layer_types),
                sliding_window=None if window is None else int(window),
                is_causal=cfg.get("is_causal"),
                input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
                output_multiplier=float(draft_value("output_multiplier", 1.0)),
                final_logit_softcapping=None if softcap is None else float(softcap),
                extra={k: v for k, v in cfg.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"DFlash config.json lacks or mangles field {e}") from None

    def to_hf_dict(self) -> dict:
        """The config.json z-lab's loader reads (transformers' Qwen3Config plus the DFlash fields)."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        out = {
            **self.extra,
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": dflash,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "max_window_layers": _QWEN3_MAX_WINDOW_LAYERS,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out
