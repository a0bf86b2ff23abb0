"""The launch plans' cache (flashtile/kernels/plans.py): when a key's plan is built, and how it goes stale."""

from flashtile.kernels.plans import NO_PLAN, PENDING, PlanCache


def test_a_key_is_planned_at_its_second_call_once_a_call_is_ready():
    cache, built = PlanCache(), []

    def build():
        built.append(1)
        return "plan"

    assert cache.decide("k", build) is PENDING and not built  # first call: the general way
    assert cache.decide("k", build, ready=False) is PENDING and not built  # this call cannot be the sample
    assert cache.decide("k", build) == "plan" and cache.plans == {"k": "plan"} and len(built) == 1
    assert cache.decide("j", lambda: None, at_once=True) is NO_PLAN and cache.plans["j"] is NO_PLAN


def test_clearing_replaces_the_dict_and_a_full_cache_starts_over():
    cache = PlanCache(max_plans=2, max_seen_once=2)
    for key in ("a", "b"):
        cache.decide(key, lambda: key, at_once=True)
    kept = cache.plans
    cache.decide("c", lambda: "c", at_once=True)  # over the bound: emptied first
    assert cache.plans == {"c": "c"} and cache.plans is not kept
    for key in ("x", "y", "z"):  # seen-once keys are bounded apart and never evict plans
        assert cache.decide(key, lambda: key) is PENDING
    assert cache.seen_once == {"z"} and cache.plans == {"c": "c"}
    cache.clear()
    assert cache.plans == {} and not cache.seen_once
