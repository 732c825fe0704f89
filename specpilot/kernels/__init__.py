"""Triton kernels, each with a plain-PyTorch reference twin used in tests. Depends on nothing above it."""
