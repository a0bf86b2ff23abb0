"""The Gluon (Hopper) attention backward against the float64 oracle, on an sm_90 GPU.

``FLASHTILE_ENGINE=gluon`` forces both Gluon kernels, so a call the Gluon backward cannot
take fails instead of silently running the ``tl.*`` kernels.  Gradients follow flash-attn's
rule (``helpers.assert_close_to_reference``): error against float64 at most twice PyTorch's
own error in the input dtype, plus a floor.
"""

import pytest
import torch

from backward_cases import NARROW_CASES, case_id, check_case, grads
from helpers import (assert_close_to_reference, assert_packed_grads_match_per_sequence, is_hopper, random_like,
                     random_qkv, reference_attention_grads)

import flashtile
from flashtile.kernels import engine

# Its configurations parametrise the tests (a Triton without Gluon has none to run).
attention_bwd = pytest.importorskip("flashtile.kernels.hopper.attention_bwd")
from flashtile.kernels.hopper import configured  # noqa: E402  (after the skip)

pytestmark = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not is_hopper(), reason="the Gluon kernels need an sm_90 GPU")

def _use_config(monkeypatch, spec):
    """Run the Gluon backward with configuration ``spec`` (``hopper.configured``; "": the default),
    dQ from its workspace on short masked calls too (``engine.separate_dq`` gives those a
    separate dQ pass, which would leave the configuration untested there)."""
    monkeypatch.setattr(attention_bwd, "config_for", configured(attention_bwd.config_for, spec))
    monkeypatch.setattr(engine, "SEPARATE_DQ_MAX_ROWS", 0)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", NARROW_CASES, ids=case_id)
def test_gluon_backward_matches_reference(case, dtype):
    check_case(case, dtype)


@needs_hopper
@pytest.mark.parametrize("case", [c for c in NARROW_CASES if c[6] or c[7] != (-1, -1)], ids=case_id)
def test_gluon_backward_with_dq_workspace_matches_reference_on_masked_calls(case, monkeypatch):
    # The short ones among these take a separate dQ pass by default (engine.separate_dq).
    monkeypatch.setattr(engine, "SEPARATE_DQ_MAX_ROWS", 0)
    check_case(case, torch.bfloat16)


@needs_hopper
@pytest.mark.parametrize("case", NARROW_CASES, ids=case_id)
def test_gluon_deterministic_backward_matches_reference(case, monkeypatch):
    # dK and dV on the Gluon kernel without dQ, dQ on the tl.* dQ kernel at every head dim (by
    # default it takes d <= 64; test_attention_bwd_dq.py holds the Gluon pass to the same cases).
    monkeypatch.setattr(engine, "GLUON_DQ_MIN_HEADDIM", 257)
    check_case(case, torch.bfloat16, deterministic=True)


@needs_hopper
@pytest.mark.parametrize("alternative", attention_bwd.ALTERNATIVES)
@pytest.mark.parametrize("case", NARROW_CASES, ids=case_id)
def test_gluon_backward_alternative_configurations_match_reference(case, alternative, monkeypatch):
    _use_config(monkeypatch, alternative)
    check_case(case, torch.bfloat16)


@needs_hopper
def test_gluon_backward_with_lse_gradient():
    q, k, v = random_qkv(1, 300, 300, 2, 2, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out, lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    dout, dlse = random_like(out, seed=1), random_like(lse, seed=2)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    ref = reference_attention_grads(q, k, v, dout, dlse=dlse, causal=True)
    low = reference_attention_grads(q, k, v, dout, dlse=dlse, upcast=False, causal=True)
    for name, g, r64, rlow in zip(("dq", "dk", "dv"), got, ref[2:], low[2:]):
        assert_close_to_reference(g, r64, rlow, name, atol_floor=1e-2)


@needs_hopper
@pytest.mark.parametrize("config", ("",) + attention_bwd.ALTERNATIVES + ("deterministic",), ids=lambda spec: spec or "default")
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_backward_matches_dense_per_sequence(causal, config, monkeypatch):
    deterministic = config == "deterministic"  # dK and dV on the Gluon kernel, dQ in a separate pass
    if not deterministic:
        _use_config(monkeypatch, config)
    # Zero-length and one-row sequences, and sequences whose last key tile is partial (so the
    # next packed sequence's keys sit in it and must stay masked).
    assert_packed_grads_match_per_sequence([0, 1, 17, 300, 1000, 129], 4, 2, 128, causal,
                                           deterministic=deterministic)


@needs_hopper
@pytest.mark.parametrize("d, causal", [(128, True), (64, False)])
def test_deterministic_backward_is_bitwise_reproducible(monkeypatch, d, causal):
    # deterministic=True (auto engine): dK and dV on the Gluon kernel, whose programs own their
    # keys, dQ in a separate pass (the Gluon one at d = 128, tl.* at 64), whose programs own
    # their rows: the same bits every run.
    monkeypatch.setenv("FLASHTILE_ENGINE", "auto")
    q, k, v = random_qkv(2, 1000, 1000, 4, 2, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = random_like(q, seed=1)
    first = grads(q, k, v, dout, causal=causal, deterministic=True)
    for _ in range(5):
        again = grads(q, k, v, dout, causal=causal, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@needs_hopper
def test_forcing_gluon_backward_on_unsupported_calls_names_the_reason():
    # Calls the Gluon forward takes and its backward does not: a softcap (or ALiBi).
    q, k, v = random_qkv(1, 64, 64, 1, 1, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = flashtile.flash_attn_func(q, k, v, softcap=5.0)
    with pytest.raises(NotImplementedError, match="softcap"):
        out.sum().backward()
