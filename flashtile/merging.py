"""Merging partial attention results: the online-softmax rule, one level up.

Attention over a key set split into disjoint parts A and B can be computed part by part and
merged exactly from each part's output and log-sum-exp:

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

This is the primitive behind split-KV decoding, shared-prefix (cascade) attention and ring
attention.  An empty part has ``lse = -inf`` and contributes nothing; if both are empty the
result is ``out = 0, lse = -inf`` (never NaN).
"""

from __future__ import annotations

import torch

from flashtile import validation


def _lse_like_out(lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # lse is (..., nheads, seqlen) while out is (..., seqlen, nheads, d): align them.
    return lse.transpose(-1, -2).unsqueeze(-1)



def merge_split_states(outs: torch.Tensor, lses: torch.Tensor):
    """Merge ``S`` partial results stacked on a leading dim: ``outs (S, ..., seqlen, nheads, d)``,
    ``lses (S, ..., nheads, seqlen)`` -> ``(out float32, lse float32)``."""
    lses = lses.float()
    m = lses.amax(dim=0)
    m_safe = torch.where(m == float("-inf"), 0.0, m)  # all parts empty: avoid -inf - -inf
    w = torch.exp(lses - m_safe)
    total = w.sum(dim=0)
    lse = torch.where(total == 0, float("-inf"), m_safe + torch.log(torch.where(total == 0, 1.0, total)))
    w = w * torch.where(total == 0, 0.0, 1.0 / torch.where(total == 0, 1.0, total))
    out = (outs.float() * _lse_like_out(w, outs)).sum(dim=0)
    return out, lse


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial attention results over disjoint key sets.

    Args:
        out_a, out_b: ``(batch, seqlen_q, nheads, d)`` (or packed ``(total_q, nheads, d)``).
        lse_a, lse_b: float32 ``(batch, nheads, seqlen_q)`` (packed: ``(nheads, total_q)``).

    Returns:
        ``(out, lse)``: ``out`` in ``out_a``'s dtype, computed in float32; ``lse`` float32.
    """
    validation.check_merge_states(out_a, lse_a, out_b, lse_b)
    out, lse = merge_split_states(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))
    return out.to(out_a.dtype), lse
