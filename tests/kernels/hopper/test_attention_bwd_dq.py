"""The Gluon dQ pass (``attention_bwd_dq``) against the float64 oracle, on an sm_90 GPU.

Under ``FLASHTILE_ENGINE=gluon`` (``conftest.py``) the wide-head backward takes its dQ from this
kernel (``engine.separate_dq_engine``); here the head dims up to 128 are sent to it too, through
the ``deterministic=True`` calls whose dQ is a separate pass, so that every tile configuration
meets the awkward shapes.  The rule is the other backward tests' (``helpers.assert_close_to_reference``).
"""

import pytest
import torch

from helpers import is_hopper, random_like, random_qkv

import flashtile
from flashtile.kernels import engine

attention_bwd_dq = pytest.importorskip("flashtile.kernels.hopper.attention_bwd_dq")
from flashtile.kernels.hopper import configured  # noqa: E402  (after the skip)
from backward_cases import NARROW_CASES, WIDE_CASES, case_id, check_case  # noqa: E402

pytestmark = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(not is_hopper(), reason="the Gluon kernels need an sm_90 GPU")


@pytest.fixture
def dq_launches(monkeypatch):
    """The dQ kernel for every separate dQ pass; counts its launches (general path and plans)."""
    from flashtile.kernels import launch as launch_mod

    monkeypatch.setattr(engine, "GLUON_DQ_MIN_HEADDIM", 0)
    counted = []
    real_launch, real_call = attention_bwd_dq.launch, launch_mod.BoundLaunch.__call__

    def launch(kernel, *args, **kw):
        counted.append(kernel)
        return real_launch(kernel, *args, **kw)

    def bound_call(self, head):
        if self.kernel is attention_bwd_dq.attention_bwd_dq_kernel:
            counted.append(self.kernel)
        return real_call(self, head)

    monkeypatch.setattr(attention_bwd_dq, "launch", launch)
    monkeypatch.setattr(launch_mod.BoundLaunch, "__call__", bound_call)
    return counted


def _use_config(monkeypatch, spec):
    monkeypatch.setattr(attention_bwd_dq, "config_for", configured(attention_bwd_dq.config_for, spec))


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", NARROW_CASES + WIDE_CASES, ids=case_id)
def test_dq_pass_matches_reference(case, dtype, dq_launches):
    # deterministic=True: dK and dV from the kernels that own key tiles, dQ from this pass (and
    # bitwise the same on a second run, which _check_case asserts).
    check_case(case, dtype, deterministic=True)
    assert dq_launches, "the dQ pass did not run"


# The alternatives meet the shapes that stress what they change: one row, GQA, Nq > Nk,
# windows, several items a program, at narrow and wide head dims.
ALTERNATIVE_CASES = [c for c in NARROW_CASES + WIDE_CASES
                     if c[1] in (1, 4097) or c[3] != c[4] and c[6] or c[1] > c[2] or c[7] != (-1, -1)]


@needs_hopper
@pytest.mark.parametrize("spec", attention_bwd_dq.ALTERNATIVES)
@pytest.mark.parametrize("case", ALTERNATIVE_CASES, ids=case_id)
def test_dq_pass_alternatives_match_reference(case, spec, dq_launches, monkeypatch):
    _use_config(monkeypatch, spec)
    check_case(case, torch.bfloat16, deterministic=True)
    assert dq_launches, "the dQ pass did not run"


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [128, 256])
def test_dq_pass_on_packed_batches_matches_dense_per_sequence(headdim, causal, dq_launches):
    from helpers import assert_packed_grads_match_per_sequence

    # Zero-length and one-row sequences, and sequences whose last query and key tiles are partial.
    assert_packed_grads_match_per_sequence([0, 1, 17, 300, 1000, 65], 4, 2, headdim, causal, deterministic=True)
    assert dq_launches, "the dQ pass did not run"


@needs_hopper
def test_dq_pass_gives_zero_rows_where_no_key_is_visible(dq_launches):
    # Nq > Nk, causal (bottom-right): the first 870 rows see no key; their dQ is exactly 0.
    q, k, v = random_qkv(1, 1000, 130, 4, 2, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    dq, = torch.autograd.grad(out, (q,), random_like(q, seed=1))
    assert dq_launches
    assert torch.all(dq[:, :870] == 0) and torch.isfinite(dq).all() and dq[:, 870:].abs().sum() > 0


@needs_hopper
def test_dq_pass_is_bitwise_reproducible(dq_launches):
    q, k, v = random_qkv(2, 2000, 2000, 8, 2, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = random_like(q, seed=1)
    first = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q,), dout)[0]
    for _ in range(20):
        again = torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q,), dout)[0]
        assert torch.equal(first, again)
