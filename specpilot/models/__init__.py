"""Pure forward passes. A model is `forward(input_ids, positions, cache, ...) -> hidden` and `logits(hidden)`."""

from specpilot.models.cache import KVCache
from specpilot.models.config import ModelConfig
from specpilot.models.dense import DenseLM
from specpilot.models.loader import load_model, random_model

__all__ = ["DenseLM", "KVCache", "ModelConfig", "load_model", "random_model"]
