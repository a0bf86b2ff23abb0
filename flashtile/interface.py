"""The public attention functions (flash-attn's API and layout)."""

from __future__ import annotations

import torch

from flashtile.dropout import counters_per_row, next_seed_offset
from flashtile.ops import attention as _ops
from flashtile.ops.validation import (
    check_attention_inputs,
    check_cu_seqlens,
    check_cu_seqlens_values,
    check_kvcache_index_values,
    check_paged_kv,
    kvcache_capacity,
)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Exact softmax attention, ``softmax(q k^T * softmax_scale) v``, computed tile by tile.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, float16 / bfloat16 (float32 accepted).
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (GQA/MQA:
            query head ``h`` reads kv head ``h // (nheads // nheads_k)``), no copy made.
        dropout_p: dropout on the attention probabilities: each is kept with probability
            ``1 - dropout_p`` and scaled by ``1 / (1 - dropout_p)``; the mask comes from a
            counter-based RNG seeded by torch's generator (``torch.manual_seed`` reproduces a
            run) and is regenerated, never stored, in the backward (``flashtile.dropout``).
        softmax_scale: score scale, default ``headdim ** -0.5``.
        causal: mask keys after the query, aligned to the bottom right when
            ``seqlen_q != seqlen_k`` (query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``).
        window_size: ``(left, right)`` sliding window, -1 = unbounded on that side.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after the scale).
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``; subtracts
            ``slope * |i + seqlen_k - seqlen_q - j|`` from the scores (after the softcap).
        deterministic: make the backward bitwise reproducible run to run.
        return_lse: also return the log-sum-exp of the scaled scores, float32
            ``(batch, nheads, seqlen_q)``; a row with no visible key has LSE ``-inf``
            and output 0.

    Returns:
        ``out`` shaped like ``q``, or ``(out, lse)`` when ``return_lse``.

    CUDA tensors run the Triton kernels; CPU tensors run the tiled PyTorch path.  Both
    support autograd (the backward recomputes P from the LSE) and ``torch.compile``.
    """
    params = check_attention_inputs(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
    )
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if params.dropout_p > 0:
        params = params.with_rng(*next_seed_offset(q.device, q.shape[0] * q.shape[2] * q.shape[1]
                                                   * counters_per_row(k.shape[1])))
    if _ops.eager_forward_ok(q, k, v, alibi_slopes):
        # Nothing records autograd or traces: the launcher directly, without the op's dispatch.
        out, lse = _ops.eager_forward(q, k, v, params)
    else:
        out, lse = _ops.forward(q, k, v, params)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    block_table: torch.Tensor | None = None,
):
    """Attention over a packed batch of sequences of different lengths.

    Args:
        q: ``(total_q, nheads, headdim)``; k, v: ``(total_k, nheads_k, headdim)`` -- the
            sequences of the batch concatenated (see :func:`flashtile.unpad_input`).
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` prefix sums: sequence ``b`` is
            rows ``cu_seqlens[b] : cu_seqlens[b + 1]``; a sequence may be empty.
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (ints).
        block_table: int32 ``(batch, max_blocks)`` for keys and values in a paged cache
            (chunked prefill against a KV cache): ``k``, ``v`` are then
            ``(num_blocks, page_size, nheads_k, headdim)`` pages, sequence ``b``'s key ``j``
            is row ``j % page_size`` of page ``block_table[b, j // page_size]``, and
            ``cu_seqlens_k`` gives the key lengths.  Forward only (inference).
        The other arguments mean what they mean for :func:`flash_attn_func`, per sequence
        (causal / window masks are aligned to each sequence's bottom right).

    Returns:
        ``out`` shaped like ``q``, or ``(out, lse)`` with ``lse (nheads, total_q)`` float32.

    On a GPU the whole batch is one launch of the Triton kernels (each program finds its
    sequence through ``cu_seqlens``; ``max_seqlen_*`` size the grid and must not be smaller
    than the longest sequence); on the CPU each sequence runs the tiled PyTorch path.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor of shape (total_q, nheads, headdim), got {type(q).__name__}")
    batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0] if q.dim() == 3 else -1, q.device,
                             max_seqlen_q, "max_seqlen_q", values=False)
    batch_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else -1,
                               q.device, max_seqlen_k, "max_seqlen_k", values=False)
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got {batch} and {batch_k} sequences")
    k_rows = k, v  # what the packed-input checks see
    if block_table is not None:
        check_paged_kv(q, k, v, block_table, batch)
        k_rows = k[:, 0], v[:, 0]  # (num_blocks, nheads_k, headdim): one row per page, for the shared checks
    params = check_attention_inputs(
        q, *k_rows, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic, packed=True, packed_batch=batch,
    )
    check_cu_seqlens_values(("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
                            ("cu_seqlens_k", cu_seqlens_k, k.shape[0] if block_table is None else None, max_seqlen_k,
                             "max_seqlen_k"))
    if block_table is not None:
        check_kvcache_index_values(cu_seqlens_k[1:] - cu_seqlens_k[:-1], None, block_table, seqlen_new=0,
                                   capacity=kvcache_capacity(k, block_table), cache_rows=k.shape[0])
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if params.dropout_p > 0:
        params = params.with_rng(*next_seed_offset(q.device, q.shape[1] * q.shape[0] * counters_per_row(max_seqlen_k)))
    out, lse = _ops.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params, block_table)
    return (out, lse) if return_lse else out
