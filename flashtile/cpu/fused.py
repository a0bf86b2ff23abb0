"""PyTorch's fused CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward), for the calls it computes exactly: which those are (:func:`fused_plan`), and the
calls themselves in flash-attn's layout (:func:`forward`, :func:`backward`).

It masks top-left causally and knows no softcap, ALiBi, window or (our counter-based) dropout,
so it serves only calls whose visible keys are, for every query row, all keys or a top-left
causal prefix; GQA it takes natively.  Its backward has no LSE-gradient input.
"""

from __future__ import annotations

import torch

from flashtile.cpu.numerics import compute_dtype
from flashtile.semantics.params import AttentionParams
from flashtile.validation.attention import check_engine, check_fused_engine

_FUSED_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def fused_plan(q_shape, k_shape, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout=None):
    """``(first_row, is_causal)`` with which the fused kernel computes this call exactly, or None.

    Query rows ``< first_row`` see no key (they get output 0, LSE -inf); rows from
    ``first_row`` on are the kernel's problem with top-left ``is_causal``.  Query row ``i``
    sees keys ``j <= i + c`` with ``c = seqlen_k - seqlen_q + right`` (masking.visible):
    all keys when ``c >= seqlen_k - 1``, the top-left causal prefix when ``c == 0`` (and,
    for rows ``i >= -c``, when ``c < 0``); no single kernel call gives ``0 < c < seqlen_k - 1``.
    """
    if softcap > 0 or alibi_slopes is not None or dropout is not None:
        return None
    batch, seqlen_q, nheads = q_shape[0], q_shape[1], q_shape[2]
    seqlen_k = k_shape[1]
    if batch == 0 or nheads == 0 or seqlen_q == 0 or seqlen_k == 0:
        return None  # the kernel divides by these sizes (SIGFPE on empty inputs)
    if window_left >= 0 and window_left < seqlen_k - 1:
        return None  # a left edge that hides a key from some row
    if window_right < 0:
        return 0, False
    c = seqlen_k - seqlen_q + window_right
    if c >= seqlen_k - 1:
        return 0, False
    if c == 0:
        return 0, True
    if c < 0 and -c < seqlen_q:
        return -c, True
    return None


def engine_for(q_shape, k_shape, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout=None,
               dlse=None) -> str:
    """``"fused"`` where the fused kernel computes exactly this call (forward; with ``dlse``
    the backward), else ``"tiled"``."""
    if dlse is not None:
        return "tiled"
    plan = fused_plan(q_shape, k_shape, window_left, window_right, softcap, alibi_slopes, dropout)
    return "tiled" if plan is None else "fused"


def plan_for(engine, q, k, params: AttentionParams, dlse=None):
    """The plan for ``engine`` (None: tiled); ``engine="fused"`` where it does not apply is an error."""
    check_engine(engine)
    if engine == "tiled":
        return None
    plan = None if dlse is not None else fused_plan(q.shape, k.shape, params.window_left, params.window_right,
                                                      params.softcap, params.alibi_slopes, params.dropout)
    check_fused_engine(engine, plan)
    return plan


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (b, n, h, d) -> (b, h, n, d), the kernel's layout, as a view


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ``t.to(dtype)`` without its dispatch when nothing changes (a microsecond or two a call,
    # which a decoding step's call notices).
    return t if t.dtype == dtype else t.to(dtype)


def forward(q, k, v, softmax_scale, plan):
    first, causal = plan
    # fp16 / bf16 inputs are upcast (O(N d) copies) to compute in float32: the kernel's own
    # reduced-precision path gives a less accurate LSE (~3e-5 off), and it is not faster.
    dtype = compute_dtype(q.dtype)
    qs = q[:, first:] if first else q
    o, lse = _FUSED_FORWARD(_bhsd(_as(qs, dtype)), _bhsd(_as(k, dtype)), _bhsd(_as(v, dtype)), 0.0, causal,
                            scale=softmax_scale)
    # The kernel writes (b, n, h, d) memory and returns its (b, h, n, d) view; its LSE is a
    # (b, n, h) buffer seen as (b, h, n).
    o, lse = _as(_bhsd(o), q.dtype).contiguous(), lse.contiguous()
    if not first:
        return o, lse
    out = q.new_zeros(q.shape)
    out[:, first:] = o
    full = lse.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"))
    full[..., first:] = lse
    return out, full


def backward(dout, q, k, v, out, lse, softmax_scale, plan):
    first, causal = plan
    dtype = compute_dtype(q.dtype)
    rows = slice(first, None)
    dq, dk, dv = _FUSED_BACKWARD(*(_bhsd(_as(t, dtype)) for t in (dout[:, rows], q[:, rows], k, v, out[:, rows])),
                                 lse[..., rows], 0.0, causal, scale=softmax_scale)
    dq, dk, dv = (_as(_bhsd(g), t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v)))
    if first:
        full = q.new_zeros(q.shape)
        full[:, first:] = dq
        dq = full
    return dq, dk, dv

