"""Plain-Python statements of what attention computes, shared by every backend.

``params``: :class:`AttentionParams`, the scale, band, score modifications, dropout and
determinism that travel together from the public functions to the backends.  What each
field means is docs/semantics.md.
"""

from flashtile.semantics.params import AttentionParams

__all__ = ["AttentionParams"]
