"""``AttentionParams``: its fields are the custom ops' scalar arguments in their order, the
helpers build the bundles the callers mean, and the ops hand the backends the very values
the public functions were given (the dropout RNG's seed and offset, the ALiBi slopes, the
determinism flag) in the forward and in the backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashtile
import flashtile.ops.attention  # noqa: F401  (registers torch.ops.flashtile.*)
from flashtile import cpu
from flashtile.semantics.params import AttentionParams
from helpers import random_qkv

FIELDS = [f.name for f in dataclasses.fields(AttentionParams)]


@pytest.mark.parametrize("op,first,skip_last", [
    ("attention_forward", 3, 0),          # q, k, v
    ("attention_backward", 7, 0),         # dout, q, k, v, out, lse, dlse
    ("varlen_attention_forward", 7, 1),   # q, k, v, cu_q, cu_k, max_q, max_k; block_table last
    ("varlen_attention_backward", 11, 0),
])
def test_fields_are_the_ops_scalar_arguments_in_order(op, first, skip_last):
    schema = getattr(torch.ops.flashtile, op).default._schema
    names = [a.name for a in schema.arguments]
    assert names[first:len(names) - skip_last] == FIELDS


def test_full_and_causal_are_the_plain_bands():
    assert AttentionParams.full(0.5).op_args() == (0.5, -1, -1, 0.0, None, 0.0, 0, 0, False)
    assert AttentionParams.causal(0.5).op_args() == (0.5, -1, 0, 0.0, None, 0.0, 0, 0, False)


def test_from_launcher_and_dropout():
    slopes = torch.ones(2)
    p = AttentionParams.from_launcher(0.25, 3, 0, 2.0, slopes, (0.1, 7, 64), True)
    assert p.op_args() == (0.25, 3, 0, 2.0, slopes, 0.1, 7, 64, True)
    assert p.dropout == (0.1, 7, 64)
    assert AttentionParams.from_launcher(0.25).dropout is None
    assert AttentionParams(0.25, seed=7, offset=64).dropout is None  # p = 0: no dropout


def test_with_rng_and_with_alibi_change_only_their_fields():
    slopes = torch.ones(2)
    p = AttentionParams(0.25, 3, 0, 2.0, None, 0.1, 0, 0, True)
    assert p.with_rng(5, 32).op_args() == (0.25, 3, 0, 2.0, None, 0.1, 5, 32, True)
    assert p.with_alibi(slopes).op_args() == (0.25, 3, 0, 2.0, slopes, 0.1, 0, 0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.seed = 1


def _spy(monkeypatch, name, seen):
    real = getattr(cpu, name)

    def spy(*args, **kwargs):
        seen.append(next(a for a in args if isinstance(a, AttentionParams)))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, name, spy)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_the_ops_pass_the_callers_params_to_the_backend(monkeypatch, varlen):
    seen_fwd, seen_bwd = [], []
    _spy(monkeypatch, "varlen_fwd" if varlen else "fwd", seen_fwd)
    _spy(monkeypatch, "varlen_bwd" if varlen else "bwd", seen_bwd)
    q, k, v = random_qkv(1, 12, 12, 4, 2, 16, torch.float32, requires_grad=True, seed=1)
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4])
    kw = dict(dropout_p=0.2, softmax_scale=0.3, causal=True, window_size=(5, -1), softcap=2.0, alibi_slopes=slopes,
              deterministic=True)
    if varlen:
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, **kw)
    else:
        out = flashtile.flash_attn_func(q, k, v, **kw)
    out.sum().backward()
    (fwd,), (bwd,) = seen_fwd, seen_bwd
    assert fwd.op_args()[:4] == (0.3, 5, 0, 2.0) and fwd.alibi_slopes is slopes
    assert fwd.dropout_p == pytest.approx(0.2) and fwd.deterministic is True
    # The backward regenerates the forward's dropout mask: the same seed and offset.
    assert bwd.with_alibi(None) == fwd.with_alibi(None) and torch.equal(bwd.alibi_slopes, slopes)
