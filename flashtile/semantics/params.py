"""The attention semantics that travel together below the public API.

Besides the tensors and their layout, every attention backend needs the same nine values:
the score scale, the band (``window_left``, ``window_right``; -1 = unbounded, causal is
``window_right = 0``), the score modifications (``softcap``, ``alibi_slopes``), dropout (its
probability and the counter-based RNG's ``seed`` and ``offset``) and whether the backward
must be bitwise reproducible.  docs/semantics.md says what each one means.

The public functions check and normalise the user's arguments into an
:class:`AttentionParams` (``flashtile.validation``); the torch.library custom ops take
its fields as primitive arguments (a custom op's schema has no place for a dataclass) in
the order of :meth:`AttentionParams.op_args` and rebuild it inside; the backends
(``flashtile.cpu``, ``flashtile.kernels.attention``) and ring attention take it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AttentionParams:
    """Scale, band, score modifications, dropout and determinism of one attention call.

    Fields are in the order the custom ops take them (``flashtile.ops.attention``), so
    ``AttentionParams(*args)`` rebuilds one from an op's scalar arguments.  ``dropout_p == 0``
    means no dropout, whatever ``seed`` and ``offset`` hold."""

    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    deterministic: bool = False

    @classmethod
    def full(cls, softmax_scale: float) -> AttentionParams:
        """Every key visible, no softcap, ALiBi or dropout."""
        return cls(softmax_scale)

    @classmethod
    def causal(cls, softmax_scale: float) -> AttentionParams:
        """The causal band (bottom-right aligned), no softcap, ALiBi or dropout."""
        return cls(softmax_scale, window_right=0)

    @classmethod
    def from_launcher(cls, softmax_scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                      dropout=None, deterministic=False) -> AttentionParams:
        """From the backends' keyword form, where dropout is one ``(p, seed, offset)`` or None."""
        p, seed, offset = dropout if dropout is not None else (0.0, 0, 0)
        return cls(softmax_scale, window_left, window_right, softcap, alibi_slopes, p, seed, offset, deterministic)

    @property
    def dropout(self) -> tuple[float, int, int] | None:
        """``(p, seed, offset)``, or None without dropout: what the dropout mask is a function of."""
        return (self.dropout_p, self.seed, self.offset) if self.dropout_p > 0 else None

    def op_args(self) -> tuple:
        """The fields as the custom ops' scalar arguments, in their order."""
        return (self.softmax_scale, self.window_left, self.window_right, self.softcap, self.alibi_slopes,
                self.dropout_p, self.seed, self.offset, self.deterministic)

    def with_rng(self, seed: int, offset: int) -> AttentionParams:
        """The same call with the dropout RNG's ``(seed, offset)`` drawn for it."""
        # Spelled out rather than dataclasses.replace: torch.compile traces this in the public functions.
        return AttentionParams(self.softmax_scale, self.window_left, self.window_right, self.softcap,
                               self.alibi_slopes, self.dropout_p, seed, offset, self.deterministic)

    def with_alibi(self, alibi_slopes: torch.Tensor | None) -> AttentionParams:
        """The same call with other ALiBi slopes (one sequence's row of ``(batch, nheads)`` slopes,
        or the slopes autograd saved)."""
        return AttentionParams(self.softmax_scale, self.window_left, self.window_right, self.softcap,
                               alibi_slopes, self.dropout_p, self.seed, self.offset, self.deterministic)
