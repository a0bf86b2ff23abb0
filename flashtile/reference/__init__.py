"""Exact float64 NumPy references for softmax and attention.

They define what the fast paths must compute and show how the IO-aware algorithms work:
``softmax`` has the 3-pass, online 2-pass and 1-pass softmax; ``attention`` has the
materialising definition and the tiled FlashAttention forward and backward.  Tests
compare every kernel against these; these in turn are tested against PyTorch.
"""

from flashtile.reference.attention import (
    attention_1d,
    attention_backward_blocked,
    attention_backward_naive,
    attention_blocked,
    attention_naive,
)
from flashtile.reference.softmax import (
    log_softmax,
    logsumexp,
    merge_softmax_states,
    softmax_1pass,
    softmax_3pass,
    softmax_naive,
    softmax_online_2pass,
)

__all__ = [
    "attention_1d",
    "attention_backward_blocked",
    "attention_backward_naive",
    "attention_blocked",
    "attention_naive",
    "log_softmax",
    "logsumexp",
    "merge_softmax_states",
    "softmax_1pass",
    "softmax_3pass",
    "softmax_naive",
    "softmax_online_2pass",
]
