"""SpecPilot: lossless speculative decoding, measured honestly.

Layers (each depends only on those below it): models -> drafters / verify / sampling -> engine ->
evaluator -> cli. See DESIGN.md in the shared folder for the intended shape.
"""

__version__ = "0.1.0"
