"""Ping-pong between consumer warpgroups: a ring of mbarriers, one a consumer, passes the turn
to issue GEMMs, so one warpgroup's softmax runs while the tensor cores work on the others'.

The kernel initialises one barrier a consumer (``count=1``) and arrives once on consumer 0's,
so that consumer 0 issues first.  A consumer's ``count``-th turn (counted from 0) waits for
phase ``count & 1`` of its own barrier, which completes when the consumer before it in the ring
hands over; it hands over by arriving on the next consumer's barrier once its GEMMs are issued.
The ring keeps the consumers within one turn of each other, so the parity names the phase.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def issue_turn(turn_bar, count, PINGPONG: gl.constexpr):
    """Wait until the consumer before this one in the ring has issued its GEMMs."""
    if PINGPONG:
        mbarrier.wait(turn_bar, count & 1)


@gluon.jit
def hand_turn(turn_bar, PINGPONG: gl.constexpr):
    """Pass the turn to the next consumer in the ring."""
    if PINGPONG:
        mbarrier.arrive(turn_bar, count=1)
