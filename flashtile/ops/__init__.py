"""Autograd / custom-op wrappers and argument validation."""
