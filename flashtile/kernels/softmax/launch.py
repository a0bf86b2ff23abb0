"""The two entry points: plan a softmax (or its backward) and launch the planned strategy's kernels."""

from __future__ import annotations

import torch

from flashtile.kernels.softmax import cooperative, registers, streaming
from flashtile.kernels.softmax.packing import KIND_PLAIN, word_kind
from flashtile.kernels.softmax.planning import plan, staged_plan, streaming_strategy

LOG2E = 1.4426950408889634


def _mask_kind(mask):
    if mask is None:
        return 0
    return 1 if mask.dtype == torch.bool else 2


def softmax_forward(x, mask, lead_shape, x_strides, m_strides, n_cols, scale, log,
                    out_dtype, strategy=None, block=None, splits=None, unroll=None, programs=None):
    """Launch the forward over rows described by (lead_shape, strides). Returns y (rows, n_cols)."""
    n_rows = lead_shape[0] * lead_shape[1] * lead_shape[2]
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return y
    scale_log2 = scale * LOG2E
    # Uniformly strided rows with unit column stride: the shared-memory path's layout.
    if mask is None and lead_shape[0] == lead_shape[1] == 1 and x_strides[3] == 1 and out_dtype == x.dtype:
        sp = staged_plan(n_rows, n_cols, x.element_size(), 1, x.device.index, strategy)
        if sp is not None:
            from flashtile.kernels.hopper import staged_softmax

            if (staged_softmax.stageable(x, x_strides[2], n_cols)
                    and staged_softmax.forward(x, y, n_rows, n_cols, x_strides[2], scale_log2, log, sp)):
                return y
    kind = _mask_kind(mask)
    mask_arg = mask if mask is not None else x
    rows = (n_rows, n_cols, lead_shape[1], lead_shape[2])
    reread = n_cols * (x.element_size() + (mask.element_size() if mask is not None else 0))
    p = plan(n_rows, n_cols, strategy, block, splits, unroll, programs, x.element_size(), reread,
             masked=mask is not None)
    if p["strategy"] == "registers":
        registers.forward(x, mask_arg, y, *rows, x_strides, m_strides, scale_log2, log, kind, p)
        return y
    if p["strategy"] == "cooperative":
        packing = word_kind(x, mask, x_strides, n_cols, out_dtype) if p["pack"] else KIND_PLAIN.value
        if cooperative.forward(x, mask_arg, y, *rows, x_strides, m_strides, scale_log2, log, kind, packing, p):
            return y
        p = plan(n_rows, n_cols, streaming_strategy(n_rows), elem_bytes=x.element_size(), reread_bytes=reread)
    streaming.forward(x, mask_arg, y, *rows, x_strides, m_strides, scale_log2, log, kind, p)
    return y


def softmax_backward(y, g, mask, lead_shape, m_strides, scale, log, out_dtype,
                     strategy=None, block=None, splits=None, unroll=None, programs=None):
    """dx for contiguous (rows, n_cols) ``y`` and ``g``; dx has the same (rows, n_cols) layout."""
    n_rows, n_cols = y.shape
    dx = torch.empty((n_rows, n_cols), dtype=out_dtype, device=y.device)
    if n_rows == 0 or n_cols == 0:
        return dx
    if mask is None and g.dtype == y.dtype == out_dtype:
        sp = staged_plan(n_rows, n_cols, y.element_size(), 2, y.device.index, strategy)
        if sp is not None:
            from flashtile.kernels.hopper import staged_softmax

            if (all(staged_softmax.stageable(t, n_cols, n_cols) for t in (y, g, dx))
                    and staged_softmax.backward(y, g, dx, n_rows, n_cols, scale, log, sp)):
                return dx
    kind = _mask_kind(mask)
    mask_arg = mask if mask is not None else y
    rows = (n_rows, n_cols, lead_shape[1], lead_shape[2])
    reread = n_cols * (y.element_size() + g.element_size() + (mask.element_size() if mask is not None else 0))
    p = plan(n_rows, n_cols, strategy, block, splits, unroll, programs, y.element_size(), reread, backward=True)
    if p["strategy"] == "registers":
        registers.backward(y, g, mask_arg, dx, *rows, m_strides, scale, log, kind, p)
        return dx
    if p["strategy"] == "cooperative":
        # y, g and dx are contiguous (rows, n_cols): pairs when 16-bit, even and unmasked.
        packing = KIND_PLAIN.value
        if p["pack"] and g.dtype == y.dtype and g.data_ptr() % 4 == 0:
            packing = word_kind(y, mask, (0, 0, n_cols, 1), n_cols, out_dtype)
        if cooperative.backward(y, g, mask_arg, dx, *rows, m_strides, scale, log, kind, packing, p):
            return dx
        p = plan(n_rows, n_cols, streaming_strategy(n_rows), elem_bytes=y.element_size(), reread_bytes=reread)
    streaming.backward(y, g, mask_arg, dx, *rows, m_strides, scale, log, kind, p)
    return dx
