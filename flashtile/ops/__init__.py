"""Autograd / custom-op wrappers."""
