"""Triton kernels and their launchers, one module per op family (attention, decode, softmax)."""
