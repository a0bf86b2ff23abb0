"""The wide-head Gluon backward (``attention_bwd_wide``: dK and dV for head dims above 128, dQ from
the Gluon dQ pass, ``attention_bwd_dq``) against the float64 oracle, on an sm_90 GPU.

``FLASHTILE_ENGINE=gluon`` (``conftest.py``) forces it: under ``auto`` these head dims keep the
``tl.*`` backward until the wide kernel has been measured against it.  The rule is the other
backward tests' (``helpers.assert_close_to_reference``).
"""

import pytest
import torch

from backward_cases import FLOOR, WIDE_CASES, case_id, check_case, grads
from helpers import (assert_close_to_reference, assert_packed_grads_match_per_sequence, is_hopper, random_like,
                     random_qkv, reference_attention_grads)

import flashtile

attention_bwd_wide = pytest.importorskip("flashtile.kernels.hopper.attention_bwd_wide")
from flashtile.kernels.hopper import configured  # noqa: E402  (after the skip)

pytestmark = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not is_hopper(), reason="the Gluon kernels need an sm_90 GPU")

@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", WIDE_CASES, ids=case_id)
def test_wide_backward_matches_reference(case, dtype, monkeypatch):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window = case
    calls = []
    real = attention_bwd_wide.backward
    monkeypatch.setattr(attention_bwd_wide, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=dtype, device="cuda",
                         requires_grad=True)
    kw = dict(causal=causal, window_size=window)
    dout = random_like(q, seed=1)
    got = grads(q, k, v, dout, **kw)
    assert calls, "the wide-head kernel did not run"
    ref = reference_attention_grads(q, k, v, dout, **kw)
    low = reference_attention_grads(q, k, v, dout, upcast=False, **kw)
    for name, g, r64, rlow in zip(("dq", "dk", "dv"), got, ref[2:], low[2:]):
        assert_close_to_reference(g, r64, rlow, name, atol_floor=FLOOR[dtype])


def _use_config(monkeypatch, spec):
    """Run the wide-head kernel with configuration ``spec`` (``hopper.configured``; "": the default)."""
    monkeypatch.setattr(attention_bwd_wide, "config_for", configured(attention_bwd_wide.config_for, spec))


@needs_hopper
@pytest.mark.parametrize("spec", attention_bwd_wide.ALTERNATIVES)
@pytest.mark.parametrize("case", WIDE_CASES, ids=case_id)
def test_wide_backward_alternatives_match_reference(case, spec, monkeypatch):
    _use_config(monkeypatch, spec)
    check_case(case, torch.bfloat16)


@needs_hopper
@pytest.mark.parametrize("spec", ("",) + attention_bwd_wide.ALTERNATIVES, ids=lambda spec: spec or "default")
@pytest.mark.parametrize("causal", [False, True])
def test_wide_varlen_backward_matches_dense_per_sequence(causal, spec, monkeypatch):
    # Zero-length and one-row sequences, and sequences whose last key tile is partial.
    _use_config(monkeypatch, spec)
    assert_packed_grads_match_per_sequence([0, 1, 17, 300, 1000, 65], 4, 2, 256, causal)


@needs_hopper
def test_wide_backward_is_bitwise_reproducible():
    # Every program of the dK / dV kernel owns its keys' rows, and every one of the dQ pass its query rows.
    q, k, v = random_qkv(2, 1000, 1000, 4, 2, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = random_like(q, seed=1)
    first = grads(q, k, v, dout, causal=True)
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(first, grads(q, k, v, dout, causal=True)))
