"""Forwards to :mod:`flashtile.validation`, the one home of argument rules."""

from flashtile.validation import (  # noqa: F401
    check_attention_inputs,
    check_cu_seqlens,
    check_cu_seqlens_values,
    check_kvcache_index_values,
    check_paged_kv,
    kvcache_capacity,
)
