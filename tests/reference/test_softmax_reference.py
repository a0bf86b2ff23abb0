"""The NumPy softmax references against the seeds' printed values and torch.softmax."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

from flashtile.reference import (
    log_softmax,
    logsumexp,
    merge_softmax_states,
    softmax_1pass,
    softmax_3pass,
    softmax_naive,
    softmax_online_2pass,
)

BLOCKS = (1, 3, 4, 7, 64)  # 3 and 7 do not divide the row lengths used below; 64 exceeds them

# Every max-subtracting variant, at several chunk sizes.
SAFE = {"3pass": softmax_3pass}
for _b in BLOCKS:
    SAFE[f"online2pass_b{_b}"] = partial(softmax_online_2pass, block=_b)
    SAFE[f"1pass_b{_b}"] = partial(softmax_1pass, block=_b)
ALL = {"naive": softmax_naive, **SAFE}

SEED_X = [1.0, 3.0, 2.0, 5.0, 4.0, -1.0, 0.5]
SEED_Y = [0.0115563, 0.08539015, 0.03141328, 0.63095257, 0.23211448, 0.00156398, 0.00700925]
SEED_BIG = [1000.0, 1001.0, 1002.0]
SEED_BIG_Y = [0.09003057, 0.24472847, 0.66524096]


def torch_softmax(x, axis=-1):
    return torch.softmax(torch.as_tensor(np.asarray(x, dtype=np.float64)), dim=axis).numpy()


safe_variants = pytest.mark.parametrize("fn", list(SAFE.values()), ids=list(SAFE))
all_variants = pytest.mark.parametrize("fn", list(ALL.values()), ids=list(ALL))


# --- the seeds' printed values (seed 002, appendix A.4; seed 000 section 33) -------------


@all_variants
def test_seed_printed_values(fn):
    np.testing.assert_allclose(fn(SEED_X), SEED_Y, rtol=0, atol=1e-7)


@safe_variants
def test_seed_large_values_do_not_overflow(fn):
    np.testing.assert_allclose(fn(SEED_BIG), SEED_BIG_Y, rtol=0, atol=1e-7)


def test_naive_overflows_to_nan():
    with pytest.warns(RuntimeWarning, match="overflow"), np.errstate(invalid="ignore"):  # inf / inf
        y = softmax_naive(SEED_BIG)
    assert np.isnan(y).all()


def test_online_worked_example_two_blocks():
    """Seed 000 section 33: blocks [2, 1] then [4, 3]; the merged l equals the direct sum."""
    m1, l1 = 2.0, 1.0 + math.exp(-1.0)
    m, l = merge_softmax_states(m1, l1, 4.0, 1.0 + math.exp(-1.0))
    direct = sum(math.exp(x - 4.0) for x in (2.0, 1.0, 4.0, 3.0))
    assert m == 4.0
    assert l == pytest.approx(math.exp(-2.0) * (1.0 + math.exp(-1.0)) + 1.0 + math.exp(-1.0), rel=1e-15)
    assert l == pytest.approx(direct, rel=1e-15)
    # The chunked online pass (block=2 walks exactly these two blocks) lands on the same
    # denominator: softmax(x)[j] = exp(x_j - 4) / l.
    y = softmax_online_2pass([2.0, 1.0, 4.0, 3.0], block=2)
    np.testing.assert_allclose(y, np.exp(np.array([2.0, 1.0, 4.0, 3.0]) - 4.0) / direct, rtol=1e-15)
    assert 4.0 + math.log(l) == pytest.approx(float(logsumexp([2.0, 1.0, 4.0, 3.0])), rel=1e-15)


# --- against torch.softmax ---------------------------------------------------------------


@all_variants
@pytest.mark.parametrize("shape,axis", [((5, 33), -1), ((4, 16), 0), ((2, 3, 10), 1), ((8,), 0)])
def test_random_rows_match_torch(fn, shape, axis):
    x = np.random.default_rng(0).normal(scale=3.0, size=shape)
    np.testing.assert_allclose(fn(x, axis=axis), torch_softmax(x, axis), rtol=1e-13, atol=1e-15)


@safe_variants
def test_huge_magnitudes_match_torch(fn):
    rng = np.random.default_rng(1)
    x = rng.choice([-1000.0, 1000.0], size=(6, 19)) + rng.normal(size=(6, 19))
    x[0] = 1000.0 + np.arange(19)  # monotone increasing: the 1-pass worst case, max grows every step
    x[1] = -1000.0 - np.arange(19)  # all very negative: naive would underflow to 0 / 0
    y = fn(x)
    np.testing.assert_allclose(y, torch_softmax(x), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-14)


@all_variants
def test_length_one(fn):
    x = [[0.3], [-7.0], [500.0]]
    np.testing.assert_array_equal(fn(x), [[1.0], [1.0], [1.0]])
    np.testing.assert_array_equal(fn(x), torch_softmax(x))


@safe_variants
def test_all_neg_inf_row_gives_zeros(fn):
    x = np.random.default_rng(2).normal(size=(4, 11))
    x[1] = -np.inf
    x[3, ::2] = -np.inf  # partly masked: masked entries get exactly 0
    y = fn(x)
    assert not np.isnan(y).any()
    np.testing.assert_array_equal(y[1], 0.0)
    assert (y[3, ::2] == 0.0).all()
    keep = [0, 2, 3]
    np.testing.assert_allclose(y[keep], torch_softmax(x[keep]), rtol=1e-13, atol=1e-15)


@all_variants
def test_nan_propagates_to_its_row_only(fn):
    x = np.random.default_rng(3).normal(size=(3, 9))
    x[1, 5] = np.nan
    y = fn(x)
    assert np.isnan(y[1]).all()
    np.testing.assert_allclose(y[[0, 2]], torch_softmax(x[[0, 2]]), rtol=1e-13)
    assert np.isnan(torch_softmax(x)[1]).all()


@safe_variants
def test_pos_inf_matches_torch(fn):
    x = np.array([[1.0, np.inf, 2.0], [np.inf, np.inf, 0.0], [-np.inf, np.inf, 3.0], [0.0, 1.0, 2.0]])
    np.testing.assert_array_equal(np.isnan(fn(x)), np.isnan(torch_softmax(x)))
    np.testing.assert_allclose(fn(x)[3], torch_softmax(x)[3], rtol=1e-14)


@safe_variants
def test_empty_axis(fn):
    assert fn(np.zeros((3, 0))).shape == (3, 0)


@pytest.mark.parametrize("fn", [softmax_online_2pass, softmax_1pass])
def test_block_must_be_positive(fn):
    with pytest.raises(ValueError, match="block"):
        fn([1.0, 2.0], block=0)


def test_float32_input_is_computed_in_float64():
    x = np.random.default_rng(4).normal(size=(2, 5)).astype(np.float32)
    for fn in SAFE.values():
        assert fn(x).dtype == np.float64


def test_1pass_buffer_rescale_is_exact_on_monotone_rows():
    """Worst case for the 1-pass buffer: the max grows at every element."""
    x = np.linspace(-50.0, 50.0, 101)
    for block in (1, 2, 5, 101):
        np.testing.assert_allclose(softmax_1pass(x, block=block), torch_softmax(x), rtol=1e-12, atol=1e-300)


# --- log_softmax / logsumexp ---------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 1000.0])
def test_logsumexp_and_log_softmax_match_torch(scale):
    x = np.random.default_rng(5).normal(scale=scale, size=(3, 4, 13))
    xt = torch.as_tensor(x)
    for axis in (-1, 0, 1):
        np.testing.assert_allclose(logsumexp(x, axis=axis), torch.logsumexp(xt, dim=axis).numpy(), rtol=1e-14)
        np.testing.assert_allclose(
            log_softmax(x, axis=axis), torch.log_softmax(xt, dim=axis).numpy(), rtol=1e-12, atol=1e-12
        )


def test_log_softmax_does_not_underflow():
    y = log_softmax([0.0, -2000.0])
    assert y[1] == pytest.approx(-2000.0, rel=1e-15)
    assert np.isfinite(y).all()


def test_logsumexp_edge_cases_follow_torch():
    inf, nan = np.inf, np.nan
    x = np.array([[-inf, -inf], [1.0, inf], [-inf, inf], [1.0, nan], [-inf, 2.0]])
    ours = logsumexp(x)
    theirs = torch.logsumexp(torch.as_tensor(x), dim=-1).numpy()
    np.testing.assert_array_equal(ours, theirs)  # -inf, inf, inf, nan, 2.0
    assert logsumexp(np.zeros((2, 0))).tolist() == [-inf, -inf]


def test_log_softmax_edge_cases():
    x = np.array([[-np.inf, -np.inf], [1.0, np.inf], [1.0, np.nan], [-np.inf, 0.0]])
    y = log_softmax(x)
    np.testing.assert_array_equal(y[0], [-np.inf, -np.inf])  # log of the zeros softmax returns
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()  # as torch
    np.testing.assert_array_equal(y[3], [-np.inf, 0.0])
    assert np.isnan(torch.log_softmax(torch.as_tensor(x[1:3]), dim=-1).numpy()).all()


def test_log_softmax_is_log_of_softmax():
    x = np.random.default_rng(6).normal(size=(4, 9))
    np.testing.assert_allclose(np.exp(log_softmax(x)), softmax_3pass(x), rtol=1e-14)


# --- merge rule ----------------------------------------------------------------------------


def _state(x):
    m = np.max(x, axis=-1, initial=-np.inf)
    return m, np.exp(x - np.where(m == -np.inf, 0.0, m)[..., None]).sum(-1)


@pytest.mark.parametrize("split", [1, 6, 11])
def test_merge_matches_whole_row(split):
    x = np.random.default_rng(7).normal(scale=10.0, size=(5, 12))
    m, l = merge_softmax_states(*_state(x[:, :split]), *_state(x[:, split:]))
    m_ref = x.max(-1)
    np.testing.assert_array_equal(m, m_ref)
    np.testing.assert_allclose(m + np.log(l), torch.logsumexp(torch.as_tensor(x), -1).numpy(), rtol=1e-14)
    # associativity / commutativity: any order of merging three parts agrees
    a, b, c = _state(x[:, :3]), _state(x[:, 3:8]), _state(x[:, 8:])
    left = merge_softmax_states(*merge_softmax_states(*a, *b), *c)
    right = merge_softmax_states(*c, *merge_softmax_states(*b, *a))
    np.testing.assert_allclose(left[1], right[1], rtol=1e-14)
    np.testing.assert_allclose(left[1], l, rtol=1e-14)


def test_merge_with_empty_parts():
    m, l = merge_softmax_states(-np.inf, 0.0, 3.0, 2.5)
    assert (float(m), float(l)) == (3.0, 2.5)
    m, l = merge_softmax_states(3.0, 2.5, -np.inf, 0.0)
    assert (float(m), float(l)) == (3.0, 2.5)
    m, l = merge_softmax_states(-np.inf, 0.0, -np.inf, 0.0)
    assert (float(m), float(l)) == (-np.inf, 0.0)
