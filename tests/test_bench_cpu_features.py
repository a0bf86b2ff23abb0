"""The CPU features benchmark's peers compute what flashtile computes (small shapes)."""

import pytest
import torch

from flashtile.bench.cpu_features import attention_calls, softmax_calls


@pytest.mark.parametrize("case", ["plain", "alibi", "softcap", "window"])
def test_attention_peers_agree_with_flashtile(case):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, 8, 64, generator=gen) for _ in range(3))
    outs = {impl: fn(q, k, v) for impl, fn in attention_calls(case, 300).items()}
    assert len(outs) == 2 and "flashtile" in outs
    want = outs.pop("flashtile")
    (got,) = outs.values()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["plain", "masked", "peaked"])
def test_softmax_peers_agree_with_flashtile(case):
    x, calls = softmax_calls(case, shape=(64, 300))
    outs = {impl: fn(x) for impl, fn in calls.items()}
    torch.testing.assert_close(outs["torch"], outs["flashtile"], atol=1e-6, rtol=1e-5)
