"""The score and softmax pieces every attention kernel shares, and their launch arguments.

Scores follow docs/semantics.md's order (scale, softcap, ALiBi, masks) in log2 units, so the
softmax runs on the hardware's native ``exp2`` with the scale folded into one FMA:
``score_mod`` applies the optional softcap and ALiBi, ``online_max`` keeps the running row
max (rows with nothing visible yet subtract 0, never ``-inf - -inf``), ``recompute_p``
rebuilds the backward's probabilities from the saved LSE, ``softcap_grad`` is the chain rule
through the softcap; ``merge_state_weights`` / ``merged_state_lse`` merge whole partial
results (output, LSE) one after another.  ``score_mod_args`` turns ``softcap`` / ``alibi_slopes`` into the kernel
arguments that drive them.

The attention kernels build two bundles once and hand them to every run of tiles:
``seq = (seqlen_q, seqlen_k, window_left, window_right)`` (the band, in this sequence's
lengths) and ``mods = (qk_scale, softcap_scale, softcap_log2, slope_log2)`` (the score's
scale and modifications; ``slope_log2`` is this head's ALiBi slope).
"""

import torch
import triton
import triton.language as tl

from flashtile.kernels.masking import band_mask

LOG2E = 1.4426950408889634


@triton.jit
def score_mod(qk, q_idx, k_idx, seqlen_q, seqlen_k, qk_scale, softcap_scale, softcap_log2, slope_log2,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Scores in log2 units after the score order of docs/semantics.md (scale, softcap, ALiBi), and tanh.

    ``q_idx``/``k_idx`` broadcast to ``qk``'s shape (either orientation).  The softcap's
    ``tanh`` is returned for the backward, whose dS picks up ``1 - tanh^2``.
    """
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1) with softcap_scale = 2 * log2(e) * scale / softcap:
        # built on exp2 (tl.math has no tanh) and saturating cleanly to +-1 at overflow.
        t = 1.0 - 2.0 / (tl.math.exp2(qk * softcap_scale) + 1.0)
        s = t * softcap_log2
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        # The distance in float32 from the converted index vectors: one subtraction per score
        # instead of integer arithmetic and an int-to-float conversion, which issues at the
        # exp2 units' quarter rate.  Exact while indices stay below 2^24.
        s = s - slope_log2 * tl.abs((q_idx + (seqlen_k - seqlen_q)).to(tl.float32) - k_idx.to(tl.float32))
    return s, t


@triton.jit
def alibi_slope_log2(ALIBI, stride_ab, b, h, HAS_ALIBI: tl.constexpr):
    if HAS_ALIBI:
        return tl.load(ALIBI + b * stride_ab + h) * 1.4426950408889634
    return 0.0


@triton.jit
def online_max(qk, m_i, scale, MASKED: tl.constexpr):
    """Running row max after one tile, ``max(m_i, rowmax(qk) * scale)`` (log2 units), and the
    value the tile's exp2 arguments subtract.

    Only a masked tile can leave a row with no visible key so far (m = -inf): it subtracts 0
    instead, so exp2(-inf - -inf) = NaN never appears and its probabilities stay exactly 0.
    """
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * scale)
    if MASKED:
        return m_ij, tl.where(m_ij == float("-inf"), 0.0, m_ij)
    return m_ij, m_ij


@triton.jit
def merge_state_weights(m, lse_s):
    """One partial result (its natural-log LSE ``lse_s``) into a running merge of partials, the
    online-softmax rule over whole blocks (split-KV decoding): the new running max, the factor
    of what is merged so far and the partial's weight.  A partial without a visible key (LSE
    -inf) weighs 0, and a merge of such partials alone stays empty."""
    m_new = tl.maximum(m, lse_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp(m - m_safe), tl.exp(lse_s - m_safe)


@triton.jit
def merged_state_lse(m, total):
    """``(empty, lse)`` of a finished merge (running max ``m``, weight ``total``): a row with no
    visible key in any split is empty (out 0, LSE -inf)."""
    empty = total == 0.0
    return empty, tl.where(empty, float("-inf"), tl.where(empty, 0.0, m) + tl.log(tl.where(empty, 1.0, total)))


@triton.jit
def recompute_p(qk, q_idx, k_idx, lse2, seq, mods,
                MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """The backward's P = exp2(score - LSE) for a tile in either orientation, and tanh.

    ``q_idx``, ``k_idx`` and ``lse2`` (the LSE in log2 units, +inf for empty rows) are shaped
    to broadcast to ``qk`` (see ``band_mask``); ``seq`` and ``mods`` are the bundles of the
    module docstring.
    """
    seqlen_q, seqlen_k, window_left, window_right = seq
    qk_scale, softcap_scale, softcap_log2, slope_log2 = mods
    if HAS_SOFTCAP or HAS_ALIBI:
        s, tanh = score_mod(qk, q_idx, k_idx, seqlen_q, seqlen_k, qk_scale,
                             softcap_scale, softcap_log2, slope_log2, HAS_SOFTCAP, HAS_ALIBI)
        p = tl.math.exp2(s - lse2)
    else:
        tanh = qk
        p = tl.math.exp2(qk * qk_scale - lse2)
    if MASKED:
        visible = band_mask(q_idx, k_idx, seqlen_q, seqlen_k, window_left, window_right, MASK_LEFT, MASK_RIGHT)
        p = tl.where(visible, p, 0.0)
    return p, tanh


@triton.jit
def softcap_grad(ds, tanh, HAS_SOFTCAP: tl.constexpr):
    # d(cap * tanh(x / cap)) = (1 - tanh^2) dx: the chain rule through the softcap.
    if HAS_SOFTCAP:
        ds = ds * (1.0 - tanh * tanh)
    return ds


def score_mod_args(softmax_scale: float, softcap: float, alibi_slopes, placeholder: torch.Tensor) -> dict:
    """Kernel arguments for the optional softcap and ALiBi (see ``score_mod``)."""
    has_alibi = alibi_slopes is not None
    if has_alibi:
        alibi_slopes = alibi_slopes.contiguous()  # the kernels step over heads with stride 1
    return dict(
        HAS_SOFTCAP=softcap > 0,
        softcap_scale=2.0 * LOG2E * softmax_scale / softcap if softcap > 0 else 0.0,
        softcap_log2=softcap * LOG2E,
        HAS_ALIBI=has_alibi,
        alibi=alibi_slopes if has_alibi else placeholder,
        # (nheads,) slopes are shared by every batch entry: batch stride 0.
        stride_ab=(alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0) if has_alibi else 0,
    )
