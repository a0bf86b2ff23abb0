"""Forwards to :mod:`flashtile.validation`, the one home of argument rules."""

from flashtile.validation import (  # noqa: F401
    SUPPORTED_DTYPES,
    check_alibi_slopes,
    check_attention_inputs,
    check_attention_scalars,
    check_cu_seqlens,
    check_cu_seqlens_values,
    check_index_tensor,
    check_kvcache_cache_layout,
    check_kvcache_index_values,
    check_kvcache_length,
    check_paged_kv,
    check_qkv_agree,
    check_tensor,
    kvcache_capacity,
    to_host,
)
