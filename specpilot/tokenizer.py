"""Text <-> token ids for a model folder, with its chat template. A thin layer over HF tokenizers."""

from __future__ import annotations

from pathlib import Path

from specpilot.errors import ConfigError, ModelFormatError


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(str(path)))
        except Exception as e:  # transformers raises many types for a missing/broken tokenizer
            raise ModelFormatError(f"cannot load a tokenizer from {path}: {e}") from None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        if not text:
            raise ConfigError("empty prompt")
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict] | tuple[dict, ...]) -> list[int]:
        """Messages -> prompt ids with the generation prompt appended (the assistant turn starts next)."""
        if not messages or not any((m.get("content") or "").strip() for m in messages):
            raise ConfigError("empty prompt")
        if not self.has_chat_template:
            return self.encode("\n\n".join(m["content"] for m in messages))
        out = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):  # newer transformers return a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def __len__(self) -> int:
        return len(self.hf)
