"""benchmarks/bench_hopper_bwd.py's plot on hand-made records: no GPU needed."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_hopper_bwd",
                                                  os.path.join(ROOT, "benchmarks", "bench_hopper_bwd.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_draws_each_shapes_own_variants(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("triton.experimental.gluon")  # the script reads attention_bwd.ALTERNATIVES
    # A variant measured at one head dim only (as a head-dim-dependent knob's alternative is).
    records = [dict(bench="hopper_bwd", impl=impl, headdim=d, causal=causal, seqlen_q=n, tflops=100.0 + n / 64,
                    device="test")
               for d, variant in ((64, "gluon:dq_writer=1"), (128, "gluon:dq_writer=0"))
               for impl in ("gluon", variant, "sdpa_cudnn") for causal in (False, True) for n in (1024, 4096)]
    bench = _bench()
    drawn = []
    save = bench.save_figure
    bench.save_figure = lambda fig, path: (drawn.append(fig), save(fig, path))
    path = tmp_path / "hopper_bwd.png"
    bench.plot(records, path)
    assert path.stat().st_size > 1000
    # One bar per record: no empty slot for a variant that a shape did not measure.
    assert len(drawn[0].axes[0].patches) == len(records)


def test_a_variants_prefix_names_the_kernel_whose_configuration_it_changes():
    pytest.importorskip("triton.experimental.gluon")
    from flashtile.kernels.hopper import attention_bwd, attention_bwd_dq, attention_bwd_wide

    bench = _bench()
    assert bench._variant("dq_lag=0") == (attention_bwd, "dq_lag=0")
    assert bench._variant("dq:k_stages=2") == (attention_bwd_dq, "k_stages=2")
    assert bench._variant("wide:num_stages=1") == (attention_bwd_wide, "num_stages=1")
    assert bench._variant("") == (attention_bwd, "")
    with pytest.raises(KeyError):
        bench._variant("nope:block_n=64")


def test_an_engine_variant_sets_int_thresholds_of_the_engine_module():
    pytest.importorskip("triton.experimental.gluon")
    from flashtile.kernels import engine

    bench = _bench()
    assert bench._variant("engine:SEPARATE_DQ_MAX_ROWS=0") == (engine, "SEPARATE_DQ_MAX_ROWS=0")
    assert bench._engine_values("SEPARATE_DQ_MAX_ROWS=0+GLUON_DQ_MIN_HEADDIM=129") == {
        "SEPARATE_DQ_MAX_ROWS": 0, "GLUON_DQ_MIN_HEADDIM": 129}
    for bad in ("NOPE=1", "ENGINE_ENV=1"):  # no such name; a name that is not an int
        with pytest.raises(ValueError, match="engine"):
            bench._engine_values(bad)
