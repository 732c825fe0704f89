"""The embedded default deployment: what `specpilot optimize` (the README's main job) and `specpilot bench` run
with no arguments.

Target Qwen2.5-Coder-1.5B-Instruct, drafter Qwen2.5-Coder-0.5B-Instruct (same tokenizer), a few HumanEval
prompts, sized to finish on a 2-core CPU in about 15 minutes including the one-time model conversion.
"""

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"
DEFAULT_BENCHMARKS = ("humaneval",)
DEFAULT_NUM_PROMPTS = 3
DEFAULT_CPU_MAX_NEW_TOKENS = 64

# `specpilot optimize` on a CPU with nothing else given: one short round (~6 min once the models are converted,
# measured on the 2-core CI-like machine; ~14 min from an empty cache). Flags and deployment files override it.
OPTIMIZE_CPU = dict(rounds=1, trials=4, num_prompts=1, max_new_tokens=32, repeats=2, wall_s=900.0)
