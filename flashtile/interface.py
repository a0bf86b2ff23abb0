"""The public attention functions (flash-attn's API and layout)."""

from __future__ import annotations

import torch

from flashtile.devices import on_input_device
from flashtile.dropout import counters_per_row, next_seed_offset
from flashtile.kernels.engine import engine_setting
from flashtile.ops import attention as _ops
from flashtile.semantics.params import AttentionParams
from flashtile.validation import (
    check_attention_inputs,
    check_bool,
    check_cu_seqlens_pair,
    check_cu_seqlens_values,
    check_kvcache_index_values,
    check_packed_query,
    check_paged_kv,
    kvcache_capacity,
)


@on_input_device
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
    checked = _checked_func_arguments(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic, return_lse)
    params = checked.params
    if alibi_slopes is not None:
        params = params.with_alibi(alibi_slopes)
    if params.dropout_p > 0:
        params = params.with_rng(*next_seed_offset(q.device, q.shape[0] * q.shape[2] * q.shape[1]
                                                   * counters_per_row(k.shape[1])))
    if _ops.eager_ok(q, k, v, alibi_slopes):
        # Nothing traces: the backend directly, without the ops' dispatch.
        if _ops.records_autograd(q, k, v):
            out, lse = _ops.EagerAttention.apply(q, k, v, params, checked)
        else:
            out, lse = _ops.direct_forward(q, k, v, params, checked, need_lse=return_lse)
    else:
        out, lse = _ops.forward(q, k, v, params)
    return (out, lse) if return_lse else out


def _check_func_arguments(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                          return_lse) -> AttentionParams:
    """Every check of :func:`flash_attn_func`'s arguments; its params (ALiBi slopes included)."""
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
    check_bool("return_lse", return_lse)
    return params


# The checks above passed once for a key (below) pass again for every call with that key:
# they read the tensors' classes, shapes, strides, dtypes and devices and the scalars' types
# and values, all of which are in it.  So a model calling with a handful of shapes pays them
# once per shape; a call with a new key (a bad one included) runs them in full, and a
# failing call caches nothing.  An entry holds the params without the ALiBi slopes (a
# tensor, attached per call) and, once a plain call has asked for it, the forward's launch
# plan (``_ops.eager_forward``), which is a function of the key and the engine setting (in
# the key too).  Bounded: a workload cycling through more keys than this checks again,
# nothing else.
_MAX_CHECKED = 256
_checked: dict = {}
_Tensor = torch.Tensor


class _Checked:
    """One key's checked params, and the launch plan slot ``_ops.eager_forward`` fills."""

    __slots__ = ("params", "plan", "plans")

    def __init__(self, params: AttentionParams):
        self.params = params
        self.plan = self.plans = None


def _checked_func_arguments(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            deterministic, return_lse) -> _Checked:
    """:func:`_check_func_arguments`, memoised by key (see ``_checked``); not while torch.compile
    traces (the shapes may be symbolic: the checks are traced as they stand).  The params come
    without ALiBi slopes: the caller attaches ``alibi_slopes``."""
    if (q.__class__ is not _Tensor or k.__class__ is not _Tensor or v.__class__ is not _Tensor
            or window_size.__class__ is not tuple or torch.compiler.is_compiling()):
        return _Checked(_check_func_arguments(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, deterministic, return_lse))
    if alibi_slopes is None:
        alibi = None
    elif alibi_slopes.__class__ is _Tensor:
        alibi = (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype, alibi_slopes.device)
    else:
        return _Checked(_check_func_arguments(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, deterministic, return_lse))
    try:
        # Scalars by value *and* type (True == 1 == 1.0 as dict keys, but the checks tell them
        # apart), the window's first two elements too (a longer window fails its check, so no
        # key holding one is ever stored).
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
               v.dtype, v.device, alibi, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
               return_lse, engine_setting(), dropout_p.__class__, softmax_scale.__class__, causal.__class__,
               softcap.__class__, deterministic.__class__, return_lse.__class__, window_size[0].__class__,
               window_size[1].__class__)
        checked = _checked.get(key)
    except (TypeError, IndexError):  # an unhashable scalar, a window of fewer than two values
        return _Checked(_check_func_arguments(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, deterministic, return_lse))
    if checked is None:
        checked = _Checked(_check_func_arguments(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                                 alibi_slopes, deterministic, return_lse).with_alibi(None))
        if len(_checked) >= _MAX_CHECKED:
            _checked.clear()
        _checked[key] = checked
    return checked


@on_input_device
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
    check_packed_query(q)
    batch = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, q.shape[0] if q.dim() == 3 else -1,
                                  k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else -1, q.device,
                                  max_seqlen_q, max_seqlen_k, values=False)
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
    return_lse = check_bool("return_lse", return_lse)
    if params.dropout_p > 0:
        params = params.with_rng(*next_seed_offset(q.device, q.shape[1] * q.shape[0] * counters_per_row(max_seqlen_k)))
    out, lse = _ops.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params, block_table)
    return (out, lse) if return_lse else out
