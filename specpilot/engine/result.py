"""What one generation produced and what it cost: the structured record every benchmark reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length" | "context"
    num_target_forwards: int = 0  # decode/verify passes of the target, prefill excluded
    accepted_lengths: list[int] = field(default_factory=list)  # per step: drafted tokens the target accepted
    drafted_lengths: list[int] = field(default_factory=list)  # per step: tokens the drafter proposed
    plain_steps: int = 0  # speculative loop: steps that drafted nothing by choice (EngineConfig.adaptive)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stage_s: dict = field(default_factory=dict)  # speculative steps: stage -> device seconds (draft/verify/accept/commit)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        """Tokens committed per target forward (1.0 for AR)."""
        return self.num_output_tokens / max(self.num_target_forwards, 1)

    @property
    def elapsed_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
