"""The attention functions' arguments: dense, packed (varlen), paged and stacked inputs.

Every attention entry point calls :func:`check_attention_inputs` (or its parts) before any
kernel sees a tensor, so a wrong dtype, device, rank, shape or stride becomes a
``TypeError`` / ``ValueError`` that names the argument -- never a crash inside a kernel or a
silent wrong answer.  Supported-but-not-yet-implemented options raise
``NotImplementedError``.
"""

from __future__ import annotations

import torch

from flashtile.masking import normalize_window
from flashtile.semantics.params import AttentionParams
from flashtile.validation.common import (
    MAX_HEADDIM,
    check_bool,
    check_dropout_p,
    check_float32_tensor,
    check_gqa_heads,
    check_same_device,
    check_scalar,
    check_softmax_scale,
    check_tensor,
    check_window,
)
from flashtile.validation.indices import check_block_table


def check_attention_inputs(
    q,
    k,
    v,
    *,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    packed: bool = False,
    packed_batch: int | None = None,
) -> AttentionParams:
    """Validate dense ``(batch, seqlen, nheads, headdim)`` (or packed ``(total, nheads, headdim)``)
    inputs and return the normalised parameters (``alibi_slopes`` included; the dropout RNG's
    seed and offset are drawn later, only when ``dropout_p > 0``)."""
    rank = 3 if packed else 4
    layout_q = "(total_q, nheads, headdim)" if packed else "(batch, seqlen_q, nheads, headdim)"
    layout_k = "(total_k, nheads_k, headdim)" if packed else "(batch, seqlen_k, nheads_k, headdim)"
    check_tensor("q", q, rank, layout_q)
    check_tensor("k", k, rank, layout_k)
    check_tensor("v", v, rank, layout_k)
    if not packed and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    check_qkv_agree(q, k, v)
    params = check_attention_scalars(q.shape[-1], dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, softcap=softcap, deterministic=deterministic)
    if alibi_slopes is not None:
        check_alibi_slopes(alibi_slopes, batch=packed_batch if packed else q.shape[0], nheads=q.shape[-2],
                           device=q.device)
        params = params.with_alibi(alibi_slopes)
    return params


def check_qkv_agree(q, k, v, k_name: str = "k", v_name: str = "v") -> None:
    """What q, k and v (already shape-checked one by one) must share: dtype, device, the
    sequence / head axes of k and v, the head dimension, and nheads a multiple of nheads_k."""
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, {k_name} and {v_name} must share one dtype, got q {q.dtype}, {k_name} {k.dtype}, "
                         f"{v_name} {v.dtype}")
    check_same_device(q, k, v, k_name, v_name)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{k_name} and {v_name} must agree in all but the head dimension, got {k_name} "
                         f"{tuple(k.shape)}, {v_name} {tuple(v.shape)}")
    headdim = q.shape[-1]
    if k.shape[-1] != headdim:
        raise ValueError(f"q and {k_name} must have the same head dimension, got {headdim} and {k.shape[-1]}")
    if v.shape[-1] != headdim:
        raise ValueError(f"{v_name} must have the same head dimension as q ({headdim}), got {v.shape[-1]}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"head dimension must be between 1 and {MAX_HEADDIM}, got {headdim}")
    check_gqa_heads(q.shape[-2], k.shape[-2], f"{k_name}/{v_name}")


def check_attention_scalars(headdim: int, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, deterministic=False) -> AttentionParams:
    """The scalar arguments, checked and normalised (``causal`` folded into the window); no ALiBi
    slopes and no dropout seed or offset yet."""
    dropout_p = check_dropout_p(dropout_p)
    softmax_scale = check_softmax_scale(softmax_scale, headdim)
    causal = check_bool("causal", causal)
    left, right = normalize_window(causal, check_window(window_size))
    softcap = check_scalar("softcap", softcap, float, "a finite float >= 0")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    deterministic = check_bool("deterministic", deterministic)
    return AttentionParams(
        softmax_scale=softmax_scale,
        window_left=left,
        window_right=right,
        softcap=softcap,
        dropout_p=dropout_p,
        deterministic=deterministic,
    )


def check_alibi_slopes(alibi_slopes, batch, nheads, device) -> None:
    """ALiBi slopes: float32 ``(nheads,)`` or ``(batch, nheads)`` on the inputs' device."""
    shapes = {(nheads,): ""} | ({(batch, nheads): ""} if batch is not None else {})
    check_float32_tensor("alibi_slopes", alibi_slopes, device, shapes)


def check_paged_kv(q, k, v, block_table, batch: int) -> None:
    """Paged keys and values for packed queries: ``k``, ``v`` ``(num_blocks, page_size,
    nheads_k, headdim)`` alike, ``block_table`` an int32 ``(batch, max_blocks)`` index tensor on
    q's device, and no gradient asked of anything (the paged forward has no backward)."""
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 4, "(num_blocks, page_size, nheads_k, headdim) with block_table")
    if k.shape != v.shape:
        raise ValueError(f"k and v must be paged alike with block_table, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] == 0 or k.shape[1] == 0:
        raise ValueError(f"k must hold at least one page of at least one row with block_table, got {tuple(k.shape)}")
    check_block_table(block_table, q.device, batch)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("block_table: attention over paged keys and values is forward only (inference); "
                                  "call it under torch.no_grad() or on tensors that do not require grad")


def check_stacked(name: str, stacked, rank: int, count: int, layout: str) -> None:
    """q, k, v (``count`` 3) or k, v (``count`` 2) stacked in one tensor of ``rank`` dimensions,
    along dimension ``rank - 3``; the stacked tensors then pass :func:`check_tensor`'s rules."""
    check_tensor(name, stacked, rank, layout)
    if stacked.shape[-3] != count:
        raise ValueError(f"{name} must have shape {layout} (size {count} in dimension {rank - 3}), "
                         f"got {tuple(stacked.shape)}")


ENGINES = ("auto", "fused", "tiled")


def check_engine(engine) -> None:
    """The CPU backend's ``engine``: ``"auto"``, ``"fused"`` or ``"tiled"``."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def check_fused_engine(engine, plan) -> None:
    """``engine="fused"`` only where the fused kernel computes the call (``plan`` is not None)."""
    if plan is None and engine == "fused":
        raise ValueError("engine='fused' does not compute this call (softcap, ALiBi, dropout, a window, "
                         "bottom-right causal with seqlen_q < seqlen_k, an LSE gradient or an empty input)")


def check_packed_query(q) -> None:
    """The packed query of a varlen call is a tensor (its shape is checked with the keys'
    by :func:`check_attention_inputs`, once ``cu_seqlens`` have given the batch)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor of shape (total_q, nheads, headdim), got {type(q).__name__}")
