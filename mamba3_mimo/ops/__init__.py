"""Triton kernels and their host wrappers, one module per stage."""
