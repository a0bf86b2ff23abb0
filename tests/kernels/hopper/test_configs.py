"""The Hopper kernels' configurations and their alternatives (``ALTERNATIVES``), on the CPU.

Each alternative is a spec (``hopper.config_changes``: ``name=value+name=value``) applied to
the default configuration; the offline compile check, the GPU tests and the A/B benchmarks
all read them through the same functions, so a spec that names no field must fail loudly.
"""

import dataclasses

import pytest

hopper = pytest.importorskip("flashtile.kernels.hopper")
from flashtile.kernels.engine import SHORT_MASKED_ROWS, THREE_CONSUMERS_MIN_ROWS  # noqa: E402
from flashtile.kernels.hopper import (attention_bwd, attention_bwd_dq, attention_bwd_wide, attention_fp8,  # noqa: E402
                                     attention_fwd)


def test_config_changes_parses_integer_keywords():
    assert hopper.config_changes("") == {}
    assert hopper.config_changes("block_n=64+q_buffers=2") == {"block_n": 64, "q_buffers": 2}


@pytest.mark.parametrize("spec", attention_fwd.ALTERNATIVES)
@pytest.mark.parametrize("head_dim_pad", [64, 128])
def test_forward_alternatives_change_the_default(spec, head_dim_pad):
    default = attention_fwd.config_for(head_dim_pad)
    changed = attention_fwd.config_from_spec(head_dim_pad, spec)
    assert changed != default
    assert dataclasses.replace(changed, **{k: getattr(default, k) for k in hopper.config_changes(spec)}) == default
    assert attention_fwd.config_from_spec(head_dim_pad, "") == default


def test_forward_softmax_in_its_own_block_only_with_two_consumers():
    # Three 160-register consumers (d <= 64) keep the update in the block of the wait: apart it spills.
    changed = [attention_fwd.config_from_spec(hd, "softmax_under_pv=1", two) for hd, two in
               ((64, False), (64, True), (128, False), (256, False))]
    assert [cfg.softmax_own_block for cfg in changed] == [False, True, True, True]
    assert not any(attention_fwd.config_for(hd).softmax_own_block for hd in (64, 128, 256))
    assert attention_fwd.kernel_constexprs(changed[2], 128, -1, -1, False)["SOFTMAX_OWN_BLOCK"]
    assert not attention_fwd.kernel_constexprs(changed[0], 64, -1, -1, False)["SOFTMAX_OWN_BLOCK"]


def test_three_consumers_serve_small_head_dims_but_not_short_calls():
    def consumers(hd, rows, window_left, window_right, score_mods=False):  # keys as many as rows
        return attention_fwd.call_config(hd, rows, rows, window_left, window_right, score_mods).consumers

    assert consumers(64, THREE_CONSUMERS_MIN_ROWS, -1, -1) == 3
    assert consumers(64, THREE_CONSUMERS_MIN_ROWS - 1, -1, -1) == 2  # unmasked, few rows
    assert consumers(64, 512, -1, -1) == 2
    assert consumers(64, 1500, -1, 0) == 2  # causal, short
    assert consumers(64, 1500, 128, -1) == 2  # left window, short
    assert consumers(64, SHORT_MASKED_ROWS, -1, 0) == 3
    assert consumers(64, SHORT_MASKED_ROWS, -1, 0, score_mods=True) == 2  # softcap / ALiBi
    assert consumers(128, 16384, -1, -1) == 2
    assert consumers(128, 512, -1, -1) == 2
    for two_consumers in (False, True):
        cfg = attention_fwd.config_for(64, two_consumers)
        assert cfg.block_m == 64 * cfg.consumers
        # The consumers' and producer's requests fit the SM's 64K registers, and the kernel-wide
        # cap leaves the first consumer (the default partition) at least the others' budget.
        warpgroups = cfg.consumers + 1
        assert cfg.consumers * cfg.consumer_regs + cfg.producer_regs <= 512
        leftover = cfg.maxnreg * warpgroups - (cfg.consumers - 1) * cfg.consumer_regs - cfg.producer_regs
        assert leftover >= cfg.consumer_regs


@pytest.mark.parametrize("spec", attention_fp8.ALTERNATIVES)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_alternatives_apply_their_changes(spec, causal):
    changed = attention_fp8.config_from_spec(128, causal, spec)
    for name, value in hopper.config_changes(spec).items():
        assert getattr(changed, name) == value


@pytest.mark.parametrize("spec", attention_fp8.ALTERNATIVES)
def test_fp8_alternatives_launch_another_kernel_somewhere(spec):
    # An alternative that launches the default's kernel at every head dim and mask would be
    # compiled, tested and timed for nothing; where it does at one, those steps skip it.
    assert not all(attention_fp8.is_default(hd, causal, spec) for hd in (64, 128, 256) for causal in (False, True))
    assert attention_fp8.is_default(128, False, "")


@pytest.mark.parametrize("spec", ["", *attention_fp8.ALTERNATIVES])
@pytest.mark.parametrize("hd", [32, 64, 128, 256])
def test_fp8_output_chunks_tile_the_head_dim(spec, hd):
    # The output's column chunks cover the head dim exactly, each a multiple of a wgmma's 8
    # columns; d = 256 keeps its output in chunks (a whole P V accumulator does not fit beside it).
    for causal in (False, True):
        cfg = attention_fp8.config_from_spec(hd, causal, spec)
        chunks = cfg.pv_chunks(hd)
        assert chunks >= 1 and hd % chunks == 0 and (hd // chunks) % 8 == 0
        if hd == 256 and "pv_cols" not in spec:
            assert chunks > 1 and cfg.block_n == 64


@pytest.mark.parametrize("spec", attention_bwd.ALTERNATIVES)
def test_backward_alternatives_differ_from_the_default(spec):
    # Some knobs differ by head dim (the dQ writer runs at d = 128 only): an alternative must
    # change the default of at least one head dim the backward runs.
    assert any(attention_bwd.config_from_spec(hd, spec) != attention_bwd.config_for(hd) for hd in (64, 128))
    for hd in (64, 128):
        assert attention_bwd.config_from_spec(hd, "") == attention_bwd.config_for(hd)


def test_backward_knobs_that_need_others_are_rejected_without_them():
    with pytest.raises(ValueError, match="dk_smem"):
        attention_bwd.config_from_spec(128, "dk_early=1+dk_smem=1")
    for spec in ("dq_publish_late=1+dq_tma=0", "dq_publish_late=1+dq_lag=0", "dq_publish_late=1+with_dq=0"):
        with pytest.raises(ValueError, match="dq_publish_late"):
            attention_bwd.config_from_spec(128, spec)
    for spec in ("third_ds_buffer=1+dq_lag=0+dq_publish_late=0", "third_ds_buffer=1+with_dq=0+dq_publish_late=0"):
        with pytest.raises(ValueError, match="third_ds_buffer"):
            attention_bwd.config_from_spec(128, spec)
    for hd in (64, 128):
        assert attention_bwd.config_from_spec(hd, "dk_early=1+dq_publish_late=1").dq_publish_late


def test_backward_third_ds_buffer_only_where_three_tiles_fit():
    # Three 128 x 64 dS tiles fit beside the rest at d = 128; three 128 x 128 ones (d <= 64) do not.
    assert [attention_bwd.config_from_spec(hd, "third_ds_buffer=1").ds_buffers for hd in (64, 128)] == [2, 3]
    assert [attention_bwd.config_for(hd).ds_buffers for hd in (64, 128)] == [2, 2]
    assert attention_bwd.separate_dq_config(128).ds_buffers == 1
    assert attention_bwd.config_from_spec(128, "dq_lag=0+dq_publish_late=0").ds_buffers == 1


def test_backward_issues_dk_early_and_publishes_dq_late_above_head_dim_64():
    assert [(c.dk_early, c.dq_publish_late) for c in map(attention_bwd.config_for, (64, 128))] == [
        (False, False), (True, True)]
    assert not attention_bwd.separate_dq_config(128).dq_publish_late


def test_backward_writer_warp_issues_the_dq_add_at_head_dim_128_only():
    assert attention_bwd.config_for(128).dq_writer and not attention_bwd.config_for(64).dq_writer
    assert not attention_bwd.config_from_spec(128, "dq_writer=0").dq_writer


def test_a_spec_naming_no_field_is_rejected():
    with pytest.raises(TypeError):
        attention_fwd.config_from_spec(128, "no_such_knob=1")
    with pytest.raises(TypeError):
        attention_bwd.config_from_spec(128, "no_such_knob=1")


def test_backward_takes_128_row_query_tiles_up_to_head_dim_64_deterministic_or_not():
    assert attention_bwd.config_for(64).block_m == 128
    assert attention_bwd.config_for(128).block_m == 64
    for head_dim_pad, rows in ((64, 128), (128, 64)):
        det = attention_bwd.separate_dq_config(head_dim_pad)
        assert (det.block_m, det.with_dq, det.dq_tma, det.dq_lag, det.dk_smem) == (rows, False, False, False, False)


@pytest.mark.parametrize("spec", attention_bwd_dq.ALTERNATIVES)
@pytest.mark.parametrize("head_dim_pad", [64, 128, 256])
def test_dq_pass_alternatives_change_the_default(spec, head_dim_pad):
    default = attention_bwd_dq.config_for(head_dim_pad)
    changed = attention_bwd_dq.config_from_spec(head_dim_pad, spec)
    assert changed != default
    for name, value in hopper.config_changes(spec).items():
        assert getattr(changed, name) == value


def test_dq_pass_fits_shared_memory_and_registers():
    # Q and dO of block_m rows, K and V rings of block_n keys (bf16), within 227 KB; K's ring
    # at least two deep (a consumer holds a K tile until the next one has arrived).
    for head_dim_pad in (64, 128, 256):
        for spec in ("",) + attention_bwd_dq.ALTERNATIVES:
            cfg = attention_bwd_dq.config_from_spec(head_dim_pad, spec)
            tiles = 2 * cfg.block_m + (cfg.k_stages + cfg.v_stages) * cfg.block_n
            assert tiles * head_dim_pad * 2 <= 232448, (head_dim_pad, spec)
            assert cfg.consumers * cfg.consumer_regs + cfg.producer_regs <= 512
            assert cfg.maxnreg >= (cfg.consumer_regs if cfg.consumers == 1 else 128)
    with pytest.raises(ValueError, match="k_stages"):
        attention_bwd_dq.kernel_constexprs(attention_bwd_dq.config_from_spec(256, "k_stages=1"), 256, False, False,
                                           False)


def test_deterministic_dq_pass_is_gluon_above_head_dim_64():
    from flashtile.kernels.engine import separate_dq_engine

    assert [separate_dq_engine(d, True) for d in (64, 128, 256)] == ["triton", "gluon", "gluon"]
    assert not attention_bwd.returns_dq_workspace(256, False) and not attention_bwd.returns_dq_workspace(128, True)
    assert attention_bwd.returns_dq_workspace(128, False)


@pytest.mark.parametrize("spec", attention_bwd_wide.ALTERNATIVES)
def test_wide_backward_alternatives_change_the_default(spec):
    default, changed = attention_bwd_wide.config_for(256), attention_bwd_wide.config_from_spec(256, spec)
    assert changed != default
    for name, value in hopper.config_changes(spec).items():
        assert getattr(changed, name) == value


def test_head_dim_256_takes_turns_except_on_long_unmasked_calls():
    from flashtile.kernels.hopper.attention_fwd import NO_TURNS_MIN_KEYS

    def turns(seqlen_q, seqlen_k, window_left=-1, window_right=-1, score_mods=False):
        return attention_fwd.call_config(256, seqlen_q, seqlen_k, window_left, window_right, score_mods).pingpong

    assert not turns(16384, 16384) and not turns(128, NO_TURNS_MIN_KEYS)  # the key count decides, not the rows
    assert turns(NO_TURNS_MIN_KEYS, NO_TURNS_MIN_KEYS - 1)
    assert turns(16384, 16384, -1, 0) and turns(16384, 16384, 256, -1)  # causal, left window
    assert turns(16384, 16384, score_mods=True)  # a softcap or ALiBi: measured with turns only
    # Below d = 256 the key count changes nothing.
    for hd in (64, 128):
        assert attention_fwd.call_config(hd, 16384, 16384, -1, -1) == attention_fwd.call_config(hd, 16384, 2048, -1, -1)
    assert attention_fwd.config_from_spec(256, "", long_unmasked=True) == attention_fwd.config_for(256, False, True)
