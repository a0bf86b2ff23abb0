"""Host-side helpers and the launch-knob registry of ``flashtile/kernels/runtime.py``."""

import pytest
import triton

from flashtile.kernels.runtime import (
    Knob,
    KnobFamily,
    all_knobs,
    cdiv,
    knobs_table,
    next_power_of_2,
    register_family,
)


def test_integer_helpers_match_triton():
    # The plain-Python versions replace Triton's (constexpr functions, slow on the host).
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in range(1, 40):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert next_power_of_2(2**40 + 1) == 2**41


def test_knob_family_overrides_from_its_environment_variable(monkeypatch):
    family = KnobFamily("example", "FLASHTILE_EXAMPLE_TUNING", {
        "tile": (64, "a tile"),
        "share": Knob(4, "an int default that takes fractions", kind=float),
        "ratio": (0.5, "a float"),
    })
    monkeypatch.delenv(family.env_var, raising=False)
    assert family.current() == {"tile": 64, "share": 4, "ratio": 0.5} == family.defaults
    monkeypatch.setenv(family.env_var, " tile=128, share=0.5 ")
    knobs = family.current()
    assert knobs == {"tile": 128, "share": 0.5, "ratio": 0.5} and type(knobs["tile"]) is int
    assert family.current() is knobs is family.parse(" tile=128, share=0.5 ")  # parsed once per text
    with pytest.raises(TypeError):
        knobs["tile"] = 1  # frozen
    for bad, message in (("tiles=1", "name in"), ("tile", "name=value"), ("tile=1.5", "tile takes int"),
                         ("ratio=x", "ratio takes float")):
        with pytest.raises(ValueError, match=f"FLASHTILE_EXAMPLE_TUNING: .*{message}"):
            family.parse(bad)


def test_one_knob_family_takes_the_bare_value():
    family = KnobFamily("choice", "FLASHTILE_EXAMPLE_ENGINE", {
        "engine": Knob("auto", "which engine", choices=("auto", "fast")),
    })
    assert family.parse("")["engine"] == "auto"
    assert family.parse(" Fast ")["engine"] == family.parse("engine=fast")["engine"] == "fast"
    with pytest.raises(ValueError, match=r"FLASHTILE_EXAMPLE_ENGINE must be one of \('auto', 'fast'\), got 'slow'"):
        family.parse("slow")
    with pytest.raises(ValueError, match="one of its choices"):
        Knob("other", "a default outside the choices", choices=("auto",))


def test_registry_holds_one_family_per_environment_variable():
    families = {family.name: family for family in all_knobs()}
    softmax = families["softmax"]
    assert softmax.env_var == "FLASHTILE_SOFTMAX_TUNING" and softmax.defaults["unroll"] >= 1
    assert len({family.env_var for family in families.values()}) == len(families)
    with pytest.raises(ValueError, match="already overrides the knob family 'softmax'"):
        register_family("another", "FLASHTILE_SOFTMAX_TUNING", {"x": (1, "x")})
    assert "another" not in {family.name for family in all_knobs()}
    table = knobs_table()
    assert all(f"| `{name}` | `FLASHTILE_SOFTMAX_TUNING` |" in table for name in softmax.knobs)
