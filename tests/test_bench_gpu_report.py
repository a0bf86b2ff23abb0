"""The GPU benchmark's report functions (table, memory plot) on hand-made records: no GPU needed."""

import pytest

from flashtile.bench.gpu import print_table


def _memory_records():
    return [dict(bench="attention_memory", impl=impl, causal=causal, seqlen_q=n, nheads=16, headdim=128,
                 peak_extra_bytes=(48 * n * n if impl == "naive" else 3000 * n) if n < 32768 or impl != "naive" else None)
            for impl in ("flashtile", "naive") for causal in (False, True) for n in (1024, 4096, 32768)]


def test_memory_table_lists_every_measurement(capsys):
    print_table(_memory_records())
    out = capsys.readouterr().out
    assert "N= 32768      flashtile causal=1: 93.8 MiB" in out
    assert "N= 32768          naive causal=0: -" in out


def test_memory_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from flashtile.bench.gpu import plot_memory

    path = tmp_path / "attention_memory.png"
    plot_memory(_memory_records(), path)
    assert path.stat().st_size > 1000
