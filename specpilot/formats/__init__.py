"""Weight formats the kernels read (the bottom layer, beside kernels/): lossless12 (12-bit bf16 weights, exact)."""
