"""The CPU attention path: PyTorch's fused CPU flash kernel where it computes exactly our
function, FlashAttention's tiled online softmax written with torch matmuls everywhere else.

This is what :func:`flashtile.flash_attn_func` runs on tensors that are not on a GPU.  Each
call picks an engine (:func:`engine_for`):

* ``fused``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), the
  kernel behind PyTorch's CPU SDPA: tiled, O(N) memory, multithreaded, and it returns the
  natural-log LSE ``(batch, nheads, seqlen_q)`` that ``return_lse`` and our backward use.  It
  masks top-left causally and knows no softcap, ALiBi, window or (our counter-based)
  dropout, so it serves only calls whose visible keys are, for every query row, all keys or
  a top-left causal prefix (bottom-right causal with ``seqlen_q >= seqlen_k``: the rows
  above the diagonal see nothing and get 0 / -inf here); GQA it takes natively.  Its
  backward has no LSE-gradient input, so a loss that uses the LSE goes to the tiled backward.
* ``tiled``: everything else.

The tiled engine is the same algorithm as the Triton kernels, one level up: instead of a (BLOCK_M x BLOCK_N)
tile in registers, a (block_m x block_n) chunk of scores lives in an ordinary tensor, and
the running row max ``m``, row sum ``l`` and un-normalised accumulator ``acc`` are updated
chunk by chunk.  No ``seqlen_q x seqlen_k`` tensor is ever allocated, forward or backward:
peak extra memory is O(batch * nheads * block_m * block_n), which
``benchmarks/bench_cpu_memory.py`` measures.

Layouts follow flash-attn: q ``(batch, seqlen_q, nheads, d)``, k/v ``(batch, seqlen_k,
nheads_k, d)``; LSE ``(batch, nheads, seqlen_q)`` float32, natural log.  Low-precision
inputs are computed in float32 and the output cast back; float64 inputs in float64 throughout.

One module per concern: ``fused`` (which calls the fused kernel computes, and the calls),
``attention`` (forward and backward: the engine choice and the tiled engine), ``numerics``
(the tiled engine's log2-unit arithmetic: ``exp2`` with subnormals flushed, the LSE in and out
of log2 units), ``varlen`` (packed batches, per sequence).

Entry points: :func:`fwd`, :func:`bwd`, :func:`varlen_fwd` and :func:`varlen_bwd` take the
call's :class:`~flashtile.semantics.params.AttentionParams` (what the custom ops of
``flashtile.ops.attention`` pass); :func:`attention_forward` and the other ``*attention_*``
functions are the same with its fields as keyword arguments and dropout as one
``(p, seed, offset)``, for direct calls.
"""

from flashtile.cpu.attention import BLOCK_M, BLOCK_N, attention_backward, attention_forward, bwd, default_blocks, fwd
from flashtile.cpu.fused import engine_for, fused_plan
from flashtile.cpu.varlen import varlen_attention_backward, varlen_attention_forward, varlen_bwd, varlen_fwd

__all__ = [
    "BLOCK_M", "BLOCK_N", "attention_backward", "attention_forward", "bwd", "default_blocks", "engine_for", "fused_plan",
    "fwd", "varlen_attention_backward", "varlen_attention_forward", "varlen_bwd", "varlen_fwd",
]
