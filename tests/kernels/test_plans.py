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


def test_stand_ins_describe_each_output_from_one_buffer_of_the_largest():
    import torch

    from flashtile.kernels.plans import stand_ins

    device = torch.device("cpu")
    acc, dk, lse = stand_ins(device, ((2, 300, 4, 128), torch.float32), ((2, 700, 2, 64), torch.bfloat16),
                             ((2, 4, 300), torch.float32))
    for t, shape, dtype in ((acc, (2, 300, 4, 128), torch.float32), (dk, (2, 700, 2, 64), torch.bfloat16),
                            (lse, (2, 4, 300), torch.float32)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device == device
        assert t.data_ptr() % 16 == 0
    # One storage, the size of the largest (the fp32 workspace): the others overlap it.
    assert acc.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() == lse.untyped_storage().data_ptr()
    assert acc.untyped_storage().nbytes() == 2 * 300 * 4 * 128 * 4
