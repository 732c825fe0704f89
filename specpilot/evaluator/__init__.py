"""The evaluator: benchmarks, timing and token forcing. It judges systems and never depends on what it judges."""
