"""Host-side helpers of ``flashtile/kernels/runtime.py``."""

import pytest
import triton

from flashtile.kernels.runtime import cdiv, next_power_of_2, parse_tuning


def test_integer_helpers_match_triton():
    # The plain-Python versions replace Triton's (constexpr functions, slow on the host).
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in range(1, 40):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert next_power_of_2(2**40 + 1) == 2**41


def test_parse_tuning():
    assert parse_tuning("ENV", " a=1, b=2.5 ", ("a", "b"), ("b",)) == {"a": 1, "b": 2.5}
    with pytest.raises(ValueError, match="ENV"):
        parse_tuning("ENV", "c=1", ("a",))
