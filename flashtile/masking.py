"""The one rule for which keys a query may see.

Every mask in flashtile -- causal, sliding window, their bottom-right alignment when
``seqlen_q != seqlen_k`` -- is an instance of one band::

    diag(i) = i + seqlen_k - seqlen_q          # the key aligned with query i
    visible(i, j)  <=>  diag(i) - left <= j <= diag(i) + right      (and 0 <= j < seqlen_k)

with ``left`` / ``right`` equal to ``-1`` meaning "unbounded on that side".  ``causal=True``
is the window ``(left, 0)``.  The NumPy references, the PyTorch CPU path and the tile
ranges of the Triton launchers all call the functions below; the Triton kernels evaluate
the same inequality on their tiles (``flashtile/kernels/masking.py``).

Aligning to the bottom right (as flash-attn >= 2.1 does) means the *last* query sees the
*last* key.  For ``seqlen_q > seqlen_k`` with ``causal=True`` the first
``seqlen_q - seqlen_k`` queries therefore see no key at all: their output is 0 and their
log-sum-exp is ``-inf``.
"""

from __future__ import annotations

UNBOUNDED = -1


def normalize_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """Fold ``causal`` into ``window_size`` and return ``(left, right)``, -1 = unbounded.

    ``causal=True`` caps ``right`` at 0 (flash-attn's rule: causal is window (left, 0)).
    """
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    return left, right


def is_masked(left: int, right: int) -> bool:
    """True when the band excludes at least some (i, j) for large enough sequences."""
    return left >= 0 or right >= 0


def visible(i, j, seqlen_q: int, seqlen_k: int, left: int, right: int):
    """Boolean "query i may see key j", broadcasting over NumPy arrays or torch tensors.

    ``i`` and ``j`` are integer arrays (e.g. ``i[:, None]`` and ``j[None, :]``); the
    result has their broadcast shape.  Only ``<=``, ``+`` and ``&`` are used so the same
    function serves NumPy and PyTorch.
    """
    diag = i + (seqlen_k - seqlen_q)
    ok = (i >= 0) & (j >= 0) & (j < seqlen_k)  # i in the expression keeps the full broadcast shape
    if right >= 0:
        ok = ok & (j <= diag + right)
    if left >= 0:
        ok = ok & (j >= diag - left)
    return ok


def key_range(q_start: int, q_end: int, seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of keys that any query in ``[q_start, q_end)`` may see.

    Used to skip whole K/V tiles: keys outside it are invisible to every query of the
    tile.  The range can be empty (``lo >= hi``).
    """
    offset = seqlen_k - seqlen_q
    lo, hi = 0, seqlen_k
    if right >= 0:
        hi = min(hi, (q_end - 1) + offset + right + 1)
    if left >= 0:
        lo = max(lo, q_start + offset - left)
    return max(lo, 0), max(min(hi, seqlen_k), 0)


def query_range(k_start: int, k_end: int, seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of queries that may see any key in ``[k_start, k_end)``
    (``key_range`` the other way round: the query tiles a backward's key tile visits).  The
    range can be empty (``lo >= hi``)."""
    offset = seqlen_k - seqlen_q
    k_end = min(k_end, seqlen_k)
    lo, hi = 0, seqlen_q
    if right >= 0:
        lo = max(lo, k_start - offset - right)
    if left >= 0:
        hi = min(hi, (k_end - 1) - offset + left + 1)
    return max(min(lo, seqlen_q), 0), max(hi, 0)


def mask_array(seqlen_q: int, seqlen_k: int, left: int, right: int, xp=None, device=None):
    """The full ``(seqlen_q, seqlen_k)`` boolean visibility matrix (references and tests only).

    ``xp`` is ``numpy`` (default) or ``torch``.
    """
    if xp is None:
        import numpy as xp  # noqa: N813
    if xp.__name__ == "torch":
        i = xp.arange(seqlen_q, device=device)[:, None]
        j = xp.arange(seqlen_k, device=device)[None, :]
    else:
        i = xp.arange(seqlen_q)[:, None]
        j = xp.arange(seqlen_k)[None, :]
    return visible(i, j, seqlen_q, seqlen_k, left, right)
