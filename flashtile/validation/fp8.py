"""The FP8 functions' arguments: e4m3 inputs, descale factors, the quantiser's options."""

from __future__ import annotations

import torch

from flashtile.validation.common import (
    MAX_HEADDIM,
    check_float32_tensor,
    check_gqa_heads,
    check_rank,
    check_same_device,
    check_scalar,
    check_tensor,
)

FP8_DTYPE = torch.float8_e4m3fn
GRANULARITIES = ("tensor", "head", "block")
QUANTIZE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fp8_inputs(q, k, v, v_transposed: bool) -> None:
    """e4m3 ``q (batch, seqlen_q, nheads, headdim)``, ``k (batch, seqlen_k, nheads_k, headdim)``
    and ``v`` of k's shape, or ``(batch, nheads_k, headdim, seqlen_k)`` when ``v_transposed``;
    one device; headdim a multiple of 16 up to :data:`MAX_HEADDIM`; GQA head counts."""
    hint = " (see flashtile.quantize_fp8)"
    check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)", dtype=FP8_DTYPE, dtype_hint=hint)
    check_tensor("k", k, 4, "(batch, seqlen_k, nheads_k, headdim)", dtype=FP8_DTYPE, dtype_hint=hint)
    v_layout = "(batch, nheads_k, headdim, seqlen_k)" if v_transposed else "(batch, seqlen_k, nheads_k, headdim)"
    check_tensor("v", v, 4, v_layout, dtype=FP8_DTYPE, dtype_hint=hint)
    check_same_device(q, k, v)
    batch, _, nheads, headdim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {k.shape[0]}")
    if k.shape[-1] != headdim:
        raise ValueError(f"q and k must have the same head dimension, got {headdim} and {k.shape[-1]}")
    expected_v = (batch, nheads_k, headdim, seqlen_k) if v_transposed else tuple(k.shape)
    if tuple(v.shape) != expected_v:
        raise ValueError(f"v must have shape {v_layout} = {expected_v}, got {tuple(v.shape)}")
    if headdim % 16 != 0 or not 16 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"head dimension must be a multiple of 16 between 16 and {MAX_HEADDIM}, got {headdim}")
    check_gqa_heads(nheads, nheads_k)


def check_descale(name: str, descale, batch: int, nheads_k: int, device) -> torch.Tensor:
    """``None`` -> ``ones(1)``; otherwise float32 ``(1,)`` or ``(batch, nheads_k)`` on the inputs'
    device, positive and finite (checked where that costs no device sync: on the CPU).
    Returns the descale, detached."""
    if descale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    check_float32_tensor(name, descale, device, {(1,): "(per tensor)", (batch, nheads_k): "(batch, nheads_k)"})
    # The kernels take the row max of raw scores times the scale, which is the max of the
    # scaled scores only for a positive scale.
    if descale.device.type == "cpu" and not bool(((descale > 0) & torch.isfinite(descale)).all()):
        raise ValueError(f"{name} must be positive and finite, got {descale.tolist()}")
    return descale.detach()


def check_quantize_args(x, granularity, nheads_k) -> int:
    """``quantize_fp8``'s arguments: bf16 / fp16 / fp32 ``x (batch, seqlen, nheads, headdim)``,
    ``granularity`` ``"tensor"`` or ``"head"`` (``"block"`` is not implemented), ``nheads_k``
    a positive divisor of nheads (for ``"head"`` only).  Returns ``nheads_k`` (default nheads)."""
    check_rank("x", x, 4, "(batch, seqlen, nheads, headdim)")
    if x.dtype not in QUANTIZE_DTYPES:
        raise ValueError(f"x must be torch.bfloat16, torch.float16 or torch.float32, got {x.dtype}")
    if not isinstance(granularity, str):
        raise TypeError(f"granularity must be a str, one of {GRANULARITIES}, got {type(granularity).__name__}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "block":
        raise NotImplementedError(
            "granularity='block' is not implemented: per-token-block scales did not lower the FP8 attention "
            "error measurably (median 0-5 % over seeds, docs/fp8.md); use 'tensor' or 'head'"
        )
    nheads = x.shape[2]
    if nheads_k is None:
        nheads_k = nheads
    nheads_k = check_scalar("nheads_k", nheads_k, int, "an int or None")
    if nheads_k <= 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads_k must be a positive divisor of x's nheads ({nheads}), got {nheads_k}")
    if granularity == "tensor" and nheads_k != nheads:
        raise ValueError("nheads_k applies to granularity='head' only")
    return nheads_k
