"""When generation ends: EOS, a stop string, max new tokens, or the context limit.

The rule is applied to the token list alone, so AR and speculative decoding (which commits several tokens at
once) cut at exactly the same token: the output ends with the first EOS token, or with the first token whose
decoded text completes a stop string, or at `max_new_tokens` tokens, whichever comes first.
"""

from __future__ import annotations

from typing import Callable


class StopRule:
    def __init__(
        self,
        eos_ids: tuple[int, ...],
        max_new_tokens: int,
        stop_strings: tuple[str, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
    ):
        if stop_strings and decode is None:
            raise ValueError("stop strings need a tokenizer to decode with")
        self.eos_ids = set(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_strings = stop_strings
        self.decode = decode

    def apply(self, output_ids: list[int], checked: int = 0) -> tuple[int, str | None]:
        """-> (length to keep, finish reason or None). Tokens before `checked` are known not to stop."""
        for i in range(checked, len(output_ids)):
            if output_ids[i] in self.eos_ids:
                return i + 1, "eos"
            if self.stop_strings and self._completes_stop(output_ids, i):
                return i + 1, "stop"
            if i + 1 >= self.max_new_tokens:
                return i + 1, "length"
        return len(output_ids), None

    def _completes_stop(self, output_ids: list[int], i: int) -> bool:
        # decode a short window ending at token i; a stop string completed by token i ends inside it
        longest = max(len(s) for s in self.stop_strings)
        lo = max(0, i - longest - 4)
        text = self.decode(output_ids[lo:i + 1])
        before = self.decode(output_ids[lo:i])
        return any(s in text and s not in before for s in self.stop_strings)
