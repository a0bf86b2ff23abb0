"""The one dispatch rule between the Gluon (Hopper) and tl.* attention kernels, forward and backward."""

import pytest
import torch

from flashtile.kernels import engine


def test_auto_and_triton_take_the_tl_kernels_off_hopper(monkeypatch):
    q = torch.zeros(1, 4, 2, 128)
    for value in ("auto", "triton", "", " Triton "):
        monkeypatch.setenv(engine.ENGINE_ENV, value)
        assert engine.forward_engine(q, q) == "triton"


def test_forcing_gluon_where_it_cannot_run_names_the_reason(monkeypatch):
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    q = torch.zeros(1, 4, 2, 128)
    with pytest.raises(NotImplementedError, match="FLASHTILE_ENGINE=gluon.*CUDA"):
        engine.forward_engine(q, q)


def test_unknown_engine_is_a_value_error(monkeypatch):
    monkeypatch.setenv(engine.ENGINE_ENV, "cutlass")
    with pytest.raises(ValueError, match="FLASHTILE_ENGINE must be one of"):
        engine.forward_engine(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64))


def test_short_masked_calls_are_masked_ones_with_few_query_rows():
    rows = engine.SHORT_MASKED_ROWS
    assert engine.short_masked(rows - 1, -1, 0)  # causal
    assert engine.short_masked(1, 128, -1)  # a left window alone
    assert engine.short_masked(1000, 3, 3)
    assert not engine.short_masked(rows, -1, 0)
    assert not engine.short_masked(1, -1, -1)  # no mask
    backward_rows = engine.SHORT_MASKED_BACKWARD_ROWS
    assert engine.short_masked_backward(backward_rows - 1, -1, 0)
    assert not engine.short_masked_backward(backward_rows, -1, 0)
    assert not engine.short_masked_backward(1, -1, -1)


def test_short_masked_backward_reads_its_threshold_at_the_call(monkeypatch):
    # The A/B benchmarks' engine:SHORT_MASKED_BACKWARD_ROWS=... variants set the module's value.
    monkeypatch.setattr(engine, "SHORT_MASKED_BACKWARD_ROWS", 0)
    assert not engine.short_masked_backward(1, -1, 0)


def test_reasons_cover_what_the_gluon_forward_lacks():
    q = torch.zeros(1, 4, 2, 128)
    assert "CUDA" in engine.gluon_forward_reason(q, q, None)


class _HopperStandIn:
    """What the engine reads of a CUDA tensor on an sm_90 GPU, for any shape (no memory)."""

    is_cuda = True
    dtype = torch.bfloat16

    def __init__(self, *shape):
        self.shape = torch.Size(shape)
        self.device = torch.device("cuda", 0)

    def dim(self):
        return len(self.shape)

    def numel(self):
        return self.shape.numel()


def test_calls_beyond_32_bit_lse_rows_take_the_tl_kernels(monkeypatch):
    # The Gluon kernels address (query row, head) pairs of the LSE in 32 bits; the tl.* ones in 64.
    monkeypatch.setattr(engine, "gluon_device_reason", lambda index: None)
    k = _HopperStandIn(1, 16, 1, 64)
    assert engine.gluon_forward_reason(_HopperStandIn(1, 2**25 - 1, 64, 64), k, None) is None
    reason = engine.gluon_forward_reason(_HopperStandIn(1, 2**25, 64, 64), k, None)
    assert "2147483648 (query row, head) pairs" in reason
    assert "pairs" in engine.gluon_backward_reason(_HopperStandIn(2**25, 64, 64), k, None, 0.0, None)  # packed
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    with pytest.raises(NotImplementedError, match="pairs"):
        engine.forward_engine(_HopperStandIn(1, 2**25, 64, 64), k)
    with pytest.raises(NotImplementedError, match="pairs"):
        engine.fp8_forward_engine(_HopperStandIn(1, 2**26, 32, 64))
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    assert engine.forward_engine(_HopperStandIn(1, 2**25, 64, 64), k) == "triton"


def test_backward_off_hopper_takes_the_tl_kernels_unless_gluon_is_forced(monkeypatch):
    q = torch.zeros(1, 4, 2, 128)
    for value in ("auto", "triton"):
        monkeypatch.setenv(engine.ENGINE_ENV, value)
        assert engine.backward_engine(q, q) == "triton"
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    with pytest.raises(NotImplementedError, match="Gluon backward cannot run this call.*CUDA"):
        engine.backward_engine(q, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon engine needs an sm_90 GPU")
def test_auto_rule_on_hopper(monkeypatch):
    monkeypatch.delenv(engine.ENGINE_ENV, raising=False)
    make = lambda d, dtype=torch.bfloat16: torch.zeros(1, 4, 2, d, device="cuda", dtype=dtype)  # noqa: E731
    assert engine.forward_engine(make(128), make(128)) == "gluon"
    assert engine.forward_engine(make(256), make(256)) == "gluon"
    assert engine.forward_engine(make(64), make(64)) == "gluon"
    assert engine.forward_engine(make(40), make(40)) == "gluon"
    assert engine.forward_engine(make(32), make(32)) == "triton"
    # A short masked call stays on tl.* at head dims up to 64, not above.
    assert engine.forward_engine(make(64), make(64), short=True) == "triton"
    assert engine.forward_engine(make(128), make(128), short=True) == "gluon"
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    assert engine.forward_engine(make(64), make(64), short=True) == "gluon"
    monkeypatch.delenv(engine.ENGINE_ENV)
    assert engine.forward_engine(make(128, torch.float32), make(128, torch.float32)) == "triton"
    # Softcap and ALiBi: the Gluon forward computes them, the backward leaves them to tl.*.
    slopes = torch.ones(2, device="cuda")
    assert engine.forward_engine(make(128), make(128), softcap=5.0) == "gluon"
    assert engine.forward_engine(make(128), make(128), alibi_slopes=slopes) == "gluon"
    assert engine.backward_engine(make(128), make(128), softcap=5.0) == "triton"
    assert engine.backward_engine(make(128), make(128), alibi_slopes=slopes) == "triton"
    assert engine.backward_engine(make(128), make(128)) == "gluon"
    assert engine.backward_engine(make(96), make(96)) == "gluon"
    assert engine.backward_engine(make(64), make(64)) == "gluon"
    assert engine.backward_engine(make(64), make(64), short=True) == "triton"
    assert engine.backward_engine(make(128), make(128), short=True) == "gluon"
    assert engine.backward_engine(make(256), make(256)) == "gluon"  # the wide-head kernel
    assert engine.backward_engine(make(128), make(128), softcap=5.0) == "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon engine needs an sm_90 GPU")
def test_forced_gluon_backward_rule_on_hopper(monkeypatch):
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    make = lambda d: torch.zeros(1, 4, 2, d, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    assert engine.backward_engine(make(128), make(128)) == "gluon"
    assert engine.backward_engine(make(64), make(64)) == "gluon"
    assert engine.backward_engine(make(256), make(256)) == "gluon"  # attention_bwd_wide
    with pytest.raises(NotImplementedError, match="softcap"):
        engine.backward_engine(make(128), make(128), softcap=5.0)


def test_auto_backward_rule_by_head_dim_and_short_masked(monkeypatch):
    # The rule itself, on any machine: the Gluon backward taken as able to run every call.
    monkeypatch.delenv(engine.ENGINE_ENV, raising=False)
    monkeypatch.setattr(engine, "gluon_backward_reason", lambda *args: None)
    q = lambda d: torch.zeros(1, 4, 2, d)  # noqa: E731
    for d in (40, 64):
        assert engine.backward_engine(q(d), q(d)) == "gluon"
        assert engine.backward_engine(q(d), q(d), short=True) == "triton"
    for d in (65, 96, 128, 129, 192, 256):  # above 128 the wide-head kernel (attention_bwd_wide)
        assert engine.backward_engine(q(d), q(d)) == "gluon"
        assert engine.backward_engine(q(d), q(d), short=True) == "gluon"
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    assert engine.backward_engine(q(64), q(64), short=True) == "gluon"
    assert engine.backward_engine(q(256), q(256)) == "gluon"
    monkeypatch.setenv(engine.ENGINE_ENV, "triton")
    assert engine.backward_engine(q(128), q(128)) == "triton"


def test_separate_dq_for_deterministic_wide_and_short_masked_calls():
    rows = engine.SEPARATE_DQ_MAX_ROWS
    for d in (64, 128, 256):
        assert engine.separate_dq(d, True, 4096, -1, -1)  # deterministic: always
    assert engine.separate_dq(256, False, 4096, -1, -1)  # the wide heads: always
    assert not engine.separate_dq(128, False, 4096, -1, -1)
    # Short masked calls at every head dim: causal (window_right 0) or windowed.
    for d in (64, 128):
        assert engine.separate_dq(d, False, rows - 1, -1, 0) and engine.separate_dq(d, False, rows - 1, 100, -1)
        assert not engine.separate_dq(d, False, rows, -1, 0)
        assert not engine.separate_dq(d, False, rows - 1, -1, -1)  # unmasked


def test_separate_dq_pass_is_gluon_but_for_deterministic_calls_up_to_head_dim_64():
    below, at = engine.GLUON_DQ_MIN_HEADDIM - 1, engine.GLUON_DQ_MIN_HEADDIM
    assert engine.separate_dq_engine(below, deterministic=True) == "triton"
    assert engine.separate_dq_engine(below, deterministic=False) == "gluon"
    assert engine.separate_dq_engine(at, deterministic=True) == engine.separate_dq_engine(256, True) == "gluon"


def test_two_consumer_calls_are_short_masked_or_few_unmasked_rows():
    assert engine.two_consumer_call(engine.THREE_CONSUMERS_MIN_ROWS - 1, -1, -1)
    assert not engine.two_consumer_call(engine.THREE_CONSUMERS_MIN_ROWS, -1, -1)
    assert engine.two_consumer_call(engine.SHORT_MASKED_ROWS - 1, -1, 0)
    assert not engine.two_consumer_call(engine.SHORT_MASKED_ROWS, -1, 0)
    assert engine.two_consumer_call(engine.SHORT_MASKED_ROWS, -1, 0, score_mods=True)


def test_fp8_takes_the_tl_kernel_unless_gluon_is_forced(monkeypatch):
    q = torch.zeros(1, 4, 2, 128)
    for value in ("auto", "triton"):
        monkeypatch.setenv(engine.ENGINE_ENV, value)
        assert engine.fp8_forward_engine(q) == "triton"
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    with pytest.raises(NotImplementedError, match="Gluon FP8 forward cannot run this call.*CUDA"):
        engine.fp8_forward_engine(q)


def test_fp8_takes_the_gluon_kernel_above_d128_and_long_unmasked_calls_on_hopper(monkeypatch):
    monkeypatch.setattr(engine, "gluon_device_reason", lambda index: None)
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    for d, expected in ((256, "gluon"), (192, "gluon"), (136, "gluon"), (128, "triton"), (64, "triton")):
        assert engine.fp8_forward_engine(_HopperStandIn(1, 4, 2, d)) == expected, d
    # d = 65-128: non-causal calls of GLUON_FP8_AUTO_MIN_ROWS query rows or more.
    rows = engine.GLUON_FP8_AUTO_MIN_ROWS
    for d, n, causal, expected in ((128, rows, False, "gluon"), (80, rows, False, "gluon"),
                                   (128, rows - 1, False, "triton"), (128, rows, True, "triton"),
                                   (64, rows, False, "triton"), (256, 1, True, "gluon")):
        assert engine.fp8_forward_engine(_HopperStandIn(1, n, 2, d), causal) == expected, (d, n, causal)
    monkeypatch.setenv(engine.ENGINE_ENV, "triton")
    assert engine.fp8_forward_engine(_HopperStandIn(1, 4, 2, 256)) == "triton"
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    assert engine.fp8_forward_engine(_HopperStandIn(1, 4, 2, 64)) == "gluon"
    # Off Hopper (or without the pinned Triton) auto keeps the tl.* kernel; gluon says why it cannot.
    monkeypatch.setattr(engine, "gluon_device_reason", lambda index: "the Gluon kernels are written for sm_90")
    with pytest.raises(NotImplementedError, match="sm_90"):
        engine.fp8_forward_engine(_HopperStandIn(1, 4, 2, 256))
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    assert engine.fp8_forward_engine(_HopperStandIn(1, 4, 2, 256)) == "triton"
