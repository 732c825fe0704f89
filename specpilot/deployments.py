"""The embedded default deployment: what `specpilot bench` runs with no arguments (the README's main job).

Target Qwen2.5-Coder-1.5B-Instruct, drafter Qwen2.5-Coder-0.5B-Instruct (same tokenizer), a few HumanEval
prompts, sized to finish on a 2-core CPU in about 15 minutes including the one-time model conversion.
"""

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"
DEFAULT_BENCHMARKS = ("humaneval",)
DEFAULT_NUM_PROMPTS = 3
DEFAULT_CPU_MAX_NEW_TOKENS = 64
