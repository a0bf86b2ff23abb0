"""Every argument rule of flashtile's public functions -- types, shapes, index values -- once.

A public function calls ``validation.<rule>(...)`` before any kernel or backend sees its
arguments.  A wrong type raises ``TypeError``; a wrong value, shape, dtype, device or layout
``ValueError``; a supported-but-not-implemented combination ``NotImplementedError``.  Every
message names the argument.  Rules that normalise return the normalised value.

Modules: :mod:`~flashtile.validation.common` (dtypes, one tensor, scalars -- what every family
shares), :mod:`~flashtile.validation.indices` (index tensors and when their values are read),
and one module per family: ``attention`` (dense, varlen, paged, stacked; the CPU backend's
engine), ``kvcache``, ``rotary``, ``fp8``, ``softmax``, ``sdpa``, ``distributed``,
``padding``, ``merging``, ``transformers`` (the transformers attention backend).  Every rule
is re-exported here.
"""

from flashtile.validation.attention import (
    ENGINES,
    check_alibi_slopes,
    check_attention_inputs,
    check_attention_scalars,
    check_engine,
    check_fused_engine,
    check_packed_query,
    check_paged_kv,
    check_qkv_agree,
    check_stacked,
)
from flashtile.validation.common import (
    CPU_DTYPE_NAMES,
    CPU_DTYPES,
    DTYPE_NAMES,
    MAX_HEADDIM,
    SUPPORTED_DTYPES,
    check_bool,
    check_dropout_p,
    check_dtype,
    check_float32_tensor,
    check_gqa_heads,
    check_rank,
    check_same_device,
    check_scalar,
    check_softmax_scale,
    check_tensor,
    check_window,
    type_name,
)
from flashtile.validation.distributed import (
    check_process_group,
    check_rank_world,
    check_ring_inputs,
    check_ring_options,
    check_ring_varlen_inputs,
    check_shardable_lengths,
    check_zigzag_length,
    host_cu_seqlens,
)
from flashtile.validation.fp8 import (
    FP8_DTYPE,
    GRANULARITIES,
    check_descale,
    check_fp8_inputs,
    check_quantize_args,
)
from flashtile.validation.indices import (
    check_block_table,
    check_cu_seqlens,
    check_cu_seqlens_pair,
    check_cu_seqlens_values,
    check_index_tensor,
    check_max_seqlen,
    to_host,
    values_readable,
)
from flashtile.validation.kvcache import (
    check_kvcache_arguments,
    check_kvcache_cache_layout,
    check_kvcache_index_values,
    check_kvcache_length,
    check_kvcache_rotary,
    check_kvcache_rotary_pair,
    kvcache_capacity,
)
from flashtile.validation.merging import check_merge_states
from flashtile.validation.padding import check_pad_args, check_unpad_args, check_unused_mask, pad_indices_error
from flashtile.validation.rotary import check_rotary_arguments
from flashtile.validation.sdpa import check_sdpa_inputs, check_sdpa_mask
from flashtile.validation.softmax import check_softmax_args
from flashtile.validation.transformers import (
    UNSUPPORTED_KWARGS,
    check_sliding_window,
    check_transformers_inputs,
    check_transformers_mask,
    check_transformers_padding,
)

__all__ = [
    "CPU_DTYPES",
    "CPU_DTYPE_NAMES",
    "DTYPE_NAMES",
    "ENGINES",
    "FP8_DTYPE",
    "GRANULARITIES",
    "MAX_HEADDIM",
    "SUPPORTED_DTYPES",
    "UNSUPPORTED_KWARGS",
    "check_alibi_slopes",
    "check_attention_inputs",
    "check_attention_scalars",
    "check_block_table",
    "check_bool",
    "check_cu_seqlens",
    "check_cu_seqlens_pair",
    "check_cu_seqlens_values",
    "check_descale",
    "check_dropout_p",
    "check_dtype",
    "check_engine",
    "check_float32_tensor",
    "check_fp8_inputs",
    "check_fused_engine",
    "check_gqa_heads",
    "check_index_tensor",
    "check_kvcache_arguments",
    "check_kvcache_cache_layout",
    "check_kvcache_index_values",
    "check_kvcache_length",
    "check_kvcache_rotary",
    "check_kvcache_rotary_pair",
    "check_max_seqlen",
    "check_merge_states",
    "check_pad_args",
    "check_packed_query",
    "check_paged_kv",
    "check_process_group",
    "check_qkv_agree",
    "check_quantize_args",
    "check_rank",
    "check_rank_world",
    "check_ring_inputs",
    "check_ring_options",
    "check_ring_varlen_inputs",
    "check_rotary_arguments",
    "check_same_device",
    "check_scalar",
    "check_sdpa_inputs",
    "check_sdpa_mask",
    "check_shardable_lengths",
    "check_sliding_window",
    "check_softmax_args",
    "check_softmax_scale",
    "check_stacked",
    "check_tensor",
    "check_transformers_inputs",
    "check_transformers_mask",
    "check_transformers_padding",
    "check_unpad_args",
    "check_unused_mask",
    "check_window",
    "check_zigzag_length",
    "host_cu_seqlens",
    "kvcache_capacity",
    "pad_indices_error",
    "to_host",
    "type_name",
    "values_readable",
]
