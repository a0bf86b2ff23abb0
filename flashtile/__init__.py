"""flashtile: IO-aware exact attention and softmax kernels (Triton on GPU, PyTorch on CPU)."""

from flashtile import distributed, dropout, fp8
from flashtile.interface import flash_attn_func, flash_attn_varlen_func
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.merging import merge_attention_states
from flashtile.packed import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashtile.rotary import apply_rotary_emb
from flashtile.padding import pad_input, unpad_input
from flashtile.sdpa import scaled_dot_product_attention
from flashtile.fp8 import flash_attn_fp8_func, quantize_fp8
from flashtile.ops.softmax import log_softmax, softmax
from flashtile import compat

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "apply_rotary_emb",
    "flash_attn_fp8_func",
    "quantize_fp8",
    "merge_attention_states",
    "scaled_dot_product_attention",
    "unpad_input",
    "pad_input",
    "softmax",
    "log_softmax",
    "distributed",
    "dropout",
    "fp8",
    "compat",
    "__version__",
]
