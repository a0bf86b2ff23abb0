"""The awkward shapes the Gluon backward tests share, and their check against the float64 oracle.

Each case is ``(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window)``;
:func:`check_case` runs ``flash_attn_func``'s forward and backward on it and holds the gradients
to flash-attn's rule (``helpers.assert_close_to_reference``).
"""

import torch

from helpers import assert_close_to_reference, random_like, random_qkv, reference_attention_grads

import flashtile

FLOOR = {torch.float16: 1e-3, torch.bfloat16: 1e-2}

# Head dims up to 128 (``attention_bwd``).
NARROW_CASES = [
    (1, 1, 1, 1, 1, 64, False, (-1, -1)),
    (2, 17, 17, 2, 2, 128, False, (-1, -1)),
    (1, 17, 17, 2, 1, 96, True, (-1, -1)),
    (1, 1000, 1000, 2, 2, 128, True, (-1, -1)),
    (1, 1000, 1000, 2, 2, 128, False, (-1, -1)),
    (1, 4097, 4097, 2, 2, 64, False, (-1, -1)),
    (2, 1000, 1000, 8, 1, 64, True, (-1, -1)),  # GQA 8:1
    (1, 128, 1000, 2, 1, 40, False, (-1, -1)),  # Nq < Nk
    (1, 1000, 130, 4, 2, 128, True, (-1, -1)),  # Nq > Nk: the first 870 rows see nothing
    (1, 1000, 1000, 2, 2, 128, False, (64, 0)),  # sliding window
    (1, 700, 900, 2, 1, 96, False, (100, 37)),
    (3, 1500, 1500, 12, 4, 128, True, (-1, -1)),
    (4, 2048, 2048, 8, 4, 64, True, (-1, -1)),  # 256 key tiles: several a program on a persistent grid
    (1, 200, 8192, 4, 2, 128, False, (100, 0)),  # 256 key tiles, most seen by no query, between the others
]

# Head dims 129-256 (``attention_bwd_wide`` and the dQ pass).
WIDE_CASES = [
    (1, 1, 1, 1, 1, 256, False, (-1, -1)),
    (2, 17, 17, 2, 2, 256, False, (-1, -1)),
    (1, 17, 17, 2, 1, 192, True, (-1, -1)),  # padded to 256: the last 64 columns neither read nor stored
    (1, 1000, 1000, 2, 2, 256, True, (-1, -1)),
    (1, 1000, 1000, 2, 2, 256, False, (-1, -1)),
    (2, 1000, 1000, 8, 1, 256, True, (-1, -1)),  # GQA 8:1
    (1, 128, 1000, 2, 1, 160, False, (-1, -1)),  # Nq < Nk
    (1, 1000, 130, 4, 2, 256, True, (-1, -1)),  # Nq > Nk: the first 870 rows see nothing
    (1, 700, 900, 2, 1, 256, False, (100, 37)),  # sliding window
    (1, 4097, 4097, 2, 2, 256, False, (-1, -1)),
    (2, 2048, 2048, 16, 4, 256, True, (-1, -1)),  # 512 query tiles: several a program of the dQ pass
    (1, 200, 8192, 4, 2, 256, False, (100, 0)),  # 512 key tiles, most seen by no query, between the others
]


def case_id(c):
    return "b{}-q{}-k{}-h{}/{}-d{}-{}-w{}".format(*c[:6], "causal" if c[6] else "full", c[7])


def grads(q, k, v, dout, **kw):
    """(dq, dk, dv) of ``flash_attn_func(q, k, v, **kw)`` against ``dout``."""
    out = flashtile.flash_attn_func(q, k, v, **kw)
    return torch.autograd.grad(out, (q, k, v), dout)


def check_case(case, dtype, deterministic=False):
    """The case's gradients against the oracle (with ``deterministic``, also bitwise equal on a
    second run)."""
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window = case
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=dtype, device="cuda",
                         requires_grad=True)
    kw = dict(causal=causal, window_size=window)
    dout = random_like(q, seed=1)
    got = grads(q, k, v, dout, deterministic=deterministic, **kw)
    if deterministic:  # bitwise the same again
        for name, a, b in zip(("dq", "dk", "dv"), got, grads(q, k, v, dout, deterministic=True, **kw)):
            assert torch.equal(a, b), name
    ref = reference_attention_grads(q, k, v, dout, **kw)
    low = reference_attention_grads(q, k, v, dout, upcast=False, **kw)
    for name, g, r64, rlow in zip(("dq", "dk", "dv"), got, ref[2:], low[2:]):
        assert_close_to_reference(g, r64, rlow, name, atol_floor=FLOOR[dtype])
