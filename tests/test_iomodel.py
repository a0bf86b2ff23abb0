"""flashtile.iomodel: the HBM-traffic model, the FlashAttention paper's Figure 2, the CLI, and
the CSV handling of benchmarks/measure_io.py (no GPU needed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from flashtile import cli, iomodel
from flashtile.analysis.iomodel import key_tiles_per_query_tile, query_tiles_per_key_tile
from flashtile.iomodel import AttentionShape, KernelTiles
from flashtile.kernels.masking import key_tiles, query_tiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Explicit tiles keep the hand counts independent of tuning: (64, 64) forward, (32, 128)
# dK/dV, (64, 64) dQ -- the H200 table's entries for d = 64 when this was written.
TILES = KernelTiles(fwd=(64, 64), dkdv=(32, 128), dq=(64, 64), head_dim_pad=64)


def _shape(n=128, causal=False, **kw):
    return AttentionShape(batch=kw.pop("batch", 1), nheads=kw.pop("nheads", 1), seqlen_q=n, headdim=kw.pop("headdim", 64),
                          causal=causal, **kw)


# --------------------------------------------------------------------------------------
# The FlashAttention paper, Figure 2 (GPT-2 medium, A100: 40.3 GB vs 4.4 GB)
# --------------------------------------------------------------------------------------


def test_figure2_standard_attention_reproduces_40_3_gb():
    est = iomodel.figure2_standard_io()
    # The paper prints one decimal: our accounting must land inside its rounding, +-0.05 GB.
    assert abs(est.total_bytes / 1e9 - 40.3) <= 0.05
    # Exactly: 17 fp16 passes over the N x N matrices plus 2 over the 1-byte dropout mask,
    # and 12 passes over the N x d tensors, for 64 x 16 heads of N = 1024, d = 64.
    bh, n, d = 64 * 16, 1024, 64
    assert est.total_bytes == bh * (17 * n * n * 2 + 2 * n * n + 12 * n * d * 2)


def test_figure2_without_mask_and_dropout_is_the_textbook_count():
    est = iomodel.figure2_standard_io(mask_and_dropout=False)
    bh, n, d = 64 * 16, 1024, 64
    # Forward: S written, read; P written, read.  Backward: P read, dP written, read, dS
    # written, read twice (dQ, dK), and P read again by the softmax backward: 11 passes.
    assert est.total_bytes == bh * (11 * n * n * 2 + 12 * n * d * 2)
    assert est.total_bytes / 1e9 == pytest.approx(25.23, abs=0.01)


def test_figure2_flashattention_algorithms_near_4_4_gb():
    assert iomodel.paper_block_sizes(64, 192 * 1024, 2) == (64, 384)
    est = iomodel.flash_paper_io(iomodel.FIGURE2_SHAPE)
    # The paper's 4.4 GB is a profiler reading of its CUDA kernel, whose blocking is not
    # exactly Algorithm 1's; T_c = 3 here (4.65 GB), T_c = 2 would give 3.55 GB.  10 %
    # separates this count from both neighbours.
    assert est.total_bytes / 1e9 == pytest.approx(4.4, rel=0.10)
    standard = iomodel.figure2_standard_io()
    assert 8 < standard.total_bytes / est.total_bytes < 10  # the paper: 40.3 / 4.4 = 9.2


def test_figure2_flops_recompute_one_extra_matmul():
    standard = iomodel.figure2_standard_io()
    flash = iomodel.flash_paper_io(iomodel.FIGURE2_SHAPE)
    assert flash.flops / standard.flops == pytest.approx(7 / 6)  # S recomputed in the backward


def test_figure2_table_text():
    text = iomodel.format_figure2(tiles=TILES)
    assert "40.27 GB" in text and "40.3 GB" in text and "4.4 GB" in text and "B_c=384" in text


def test_paper_causal_skipping_roughly_halves_the_repeated_traffic():
    full = iomodel.flash_paper_io(_shape(4096, causal=True, headdim=64, dtype="float16"), "fwd")
    skipped = iomodel.flash_paper_io(_shape(4096, causal=True, headdim=64, dtype="float16"), "fwd",
                                     skip_masked_blocks=True)
    assert 0.45 < skipped.total_bytes / full.total_bytes < 0.65


# --------------------------------------------------------------------------------------
# flashtile's kernels, counted by hand
# --------------------------------------------------------------------------------------


def test_flashtile_forward_hand_count():
    # N = 128, d = 64, bf16: a (128 x 64) tensor is 16384 B; 2 query tiles of 64 rows.
    shape = _shape(128)
    no_l2 = iomodel.flashtile_forward_io(shape, "no_l2", TILES)
    # Q once (16384) + K and V once per query tile (2 x 2 x 16384); O (16384) and LSE (128 x 4).
    assert (no_l2.bytes_read, no_l2.bytes_written) == (16384 + 65536, 16384 + 512)
    ideal = iomodel.flashtile_forward_io(shape, "ideal_l2", TILES)
    assert (ideal.bytes_read, ideal.bytes_written) == (3 * 16384, 16384 + 512)
    # 2 x 2 tile pairs, 2 matmuls of 2 * 64 * 64 * 64 each.
    assert no_l2.flops == 4 * 2 * 2 * 64 * 64 * 64


def test_flashtile_forward_causal_hand_count():
    # Tile 0 sees key tile 0 (64 rows), tile 1 key tiles 0 and 1 (128 rows): K and V 192 rows each.
    est = iomodel.flashtile_forward_io(_shape(128, causal=True), "no_l2", TILES)
    assert est.bytes_read == 16384 + 2 * 192 * 64 * 2
    assert est.flops == 3 * 2 * 2 * 64 * 64 * 64


def test_flashtile_backward_hand_count():
    est = iomodel.flashtile_backward_io(_shape(128), "no_l2", TILES)
    rows = {k.name: (k.bytes_read, k.bytes_written) for k in est.kernels}
    assert rows["dlse zero fill (autograd)"] == (0, 512)
    # O, dO (16384 each), LSE and dLSE (512 each) in; D and LSE2 (512 each) out.
    assert rows["_bwd_preprocess"] == (2 * 16384 + 2 * 512, 2 * 512)
    # One key tile of 128 rows: K, V once; it streams all 128 query rows of Q, dO, LSE2, D once.
    assert rows["_attn_bwd_dkdv"] == (2 * 16384 + 2 * 16384 + 2 * 512, 2 * 16384)
    # Two query tiles: Q, dO, LSE2, D once; K and V twice.
    assert rows["_attn_bwd_dq"] == (2 * 16384 + 2 * 512 + 2 * 2 * 16384, 16384)
    assert len(est.kernels) == 4
    without = iomodel.flashtile_backward_io(_shape(128), "no_l2", TILES, zero_filled_dlse=False)
    assert est.total_bytes - without.total_bytes == 512 + 512  # the fill, and its read


def test_flashtile_backward_gqa_streams_queries_per_group_head():
    mha = iomodel.flashtile_backward_io(_shape(256, nheads=4), "no_l2", TILES)
    gqa = iomodel.flashtile_backward_io(_shape(256, nheads=4, nheads_k=1), "no_l2", TILES)
    mha_dkdv, gqa_dkdv = ({k.name: k for k in e.kernels}["_attn_bwd_dkdv"] for e in (mha, gqa))
    kv = 256 * 64 * 2
    # Same query streaming, K/V read and dK/dV written for 1 kv head instead of 4.
    assert mha_dkdv.bytes_read - gqa_dkdv.bytes_read == 3 * 2 * kv
    assert mha_dkdv.bytes_written - gqa_dkdv.bytes_written == 3 * 2 * kv


def test_naive_hand_count_bytes_per_score():
    # One head (no gradient layout copies), N = 256, d = 64, bf16 with an fp32 softmax.
    n, d = 256, 64
    fwd = iomodel.naive_forward_io(_shape(n), "ideal_l2")
    # S written (2), scaled (2 + 2), cast up (2 + 4), softmax (4 + 4), cast down (4 + 2), P read (2):
    # 28 B per score; Q, K, V read and O written: 8 B per row element.
    assert fwd.total_bytes == 28 * n * n + 8 * n * d
    bwd = iomodel.naive_backward_io(_shape(n), "ideal_l2")
    # dP written (2), P read for dV (2), cast up (2 + 4), dP * P (8 + 4), reduction (8 + 4),
    # cast down (4 + 2), scale (2 + 2), dS read for dQ and dK (2 + 2): 48 B per score.
    assert bwd.total_bytes == 48 * n * n + 16 * n * d
    # A row of 256 fp32 scores fits a warp's registers: no re-read, even without L2.
    assert iomodel.naive_backward_io(_shape(n), "no_l2").total_bytes > bwd.total_bytes  # (GEMM re-reads only)
    long_rows = [iomodel.naive_backward_io(_shape(2048), v) for v in ("ideal_l2", "no_l2")]
    reduce = [{k.name: k for k in e.kernels}["softmax backward: rowsum, epilogue"] for e in long_rows]
    assert reduce[1].bytes_read == 3 * 2048 * 2048 * 4 and reduce[0].bytes_read == 2 * 2048 * 2048 * 4


# --------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fwd", "bwd"])
def test_naive_grows_as_n_squared(mode):
    small, large = (iomodel.predict("naive", mode, _shape(n, nheads=16), "ideal_l2").total_bytes for n in (4096, 8192))
    assert 3.95 < large / small < 4.0  # the N x d terms keep it just under 4


def test_flashtile_kv_rereads_are_n_squared_d_over_block_m():
    for n in (1024, 4096):
        shape = _shape(n, nheads=2, headdim=128)
        est = iomodel.flashtile_forward_io(shape, "no_l2", TILES)
        rereads = est.bytes_read - shape.q_bytes()
        assert rereads == 2 * 2 * n * n * 128 * 2 // TILES.fwd[0]


def test_flashtile_ideal_l2_is_linear_in_n():
    for mode in ("fwd", "bwd"):
        a, b = (iomodel.predict("flashtile", mode, _shape(n), "ideal_l2", TILES).total_bytes for n in (2048, 4096))
        assert b == 2 * a


def test_causal_halves_flashtile_rereads_and_flops():
    n, bm = 4096, TILES.fwd[0]
    full, causal = (iomodel.flashtile_forward_io(_shape(n, causal=c), "no_l2", TILES) for c in (False, True))
    q = _shape(n).q_bytes()
    tiles = n // bm
    assert (causal.bytes_read - q) / (full.bytes_read - q) == pytest.approx((tiles + 1) / (2 * tiles))
    assert causal.flops / full.flops == pytest.approx((tiles + 1) / (2 * tiles))


def test_no_l2_bounds_ideal_l2_and_naive_exceeds_flashtile():
    for causal in (False, True):
        for mode in ("fwd", "bwd"):
            shape = _shape(4096, causal=causal, nheads=4)
            lo, hi = (iomodel.predict("flashtile", mode, shape, v, TILES) for v in ("ideal_l2", "no_l2"))
            assert lo.bytes_read < hi.bytes_read and lo.bytes_written == hi.bytes_written
            assert iomodel.predict("naive", mode, shape, "ideal_l2").total_bytes > 5 * hi.total_bytes


def test_gqa_ideal_reads_kv_once_per_kv_head():
    mha, gqa = (iomodel.flashtile_forward_io(_shape(1024, nheads=8, nheads_k=hk), "ideal_l2", TILES) for hk in (8, 2))
    assert mha.bytes_read - gqa.bytes_read == 2 * 6 * 1024 * 64 * 2


def test_asymptotic_formula():
    standard, flash = iomodel.asymptotic_hbm_accesses(1024, 64, 98304)
    assert standard == 1024 * 64 + 1024**2
    assert flash == pytest.approx(1024**2 * 64**2 / 98304)
    s2, f2 = iomodel.asymptotic_hbm_accesses(2048, 64, 98304)
    assert f2 / flash == pytest.approx(4.0) and s2 / standard < 4.0


# --------------------------------------------------------------------------------------
# The tile ranges in the model are the kernels' own (checked against masking.py's code)
# --------------------------------------------------------------------------------------


@triton.jit
def _count_key_tiles(Out, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    # The forward's / dQ's runs with MASK_LEFT off: [full_lo, full_hi) then [full_hi, hi).
    pid = tl.program_id(0)
    _lo, full_lo, full_hi, hi = key_tiles(pid * BLOCK_M, seqlen_q, seqlen_k, -1, 0, BLOCK_M, BLOCK_N, False, CAUSAL)
    visited = seqlen_k * 0
    loaded = seqlen_k * 0
    for start in range(full_lo, full_hi, BLOCK_N):
        visited += 1
        loaded += tl.minimum(tl.maximum(seqlen_k - start, 0), BLOCK_N)
    for start in range(full_hi, hi, BLOCK_N):
        visited += 1
        loaded += tl.minimum(tl.maximum(seqlen_k - start, 0), BLOCK_N)
    tl.store(Out + 2 * pid, visited)
    tl.store(Out + 2 * pid + 1, loaded)


@triton.jit
def _count_query_tiles(Out, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    # The dK/dV kernel's runs with MASK_LEFT off: [lo, full_lo) when causal, then [full_lo, full_hi).
    pid = tl.program_id(0)
    lo, full_lo, full_hi, _hi = query_tiles(pid * BLOCK_N, seqlen_q, seqlen_k, -1, 0, BLOCK_M, BLOCK_N, False, CAUSAL)
    visited = seqlen_q * 0
    loaded = seqlen_q * 0
    if CAUSAL:
        for start in range(lo, full_lo, BLOCK_M):
            visited += 1
            loaded += tl.minimum(tl.maximum(seqlen_q - start, 0), BLOCK_M)
    for start in range(full_lo, full_hi, BLOCK_M):
        visited += 1
        loaded += tl.minimum(tl.maximum(seqlen_q - start, 0), BLOCK_M)
    tl.store(Out + 2 * pid, visited)
    tl.store(Out + 2 * pid + 1, loaded)


# Triton 3.6's interpreter turns the tensor loop bounds into ints through a NumPy path that warns.
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("seqlen_q,seqlen_k,block_m,block_n", [
    (128, 128, 64, 64), (100, 200, 32, 64), (200, 100, 64, 32), (130, 130, 16, 64), (96, 96, 32, 128),
])
@pytest.mark.parametrize("causal", [False, True])
def test_model_visits_the_kernels_tiles(seqlen_q, seqlen_k, block_m, block_n, causal):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_q, n_k = triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n)
    out = torch.zeros(2 * n_q, dtype=torch.int32, device=device)
    _count_key_tiles[(n_q,)](out, seqlen_q, seqlen_k, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    model = [(v, loaded) for _, v, loaded in key_tiles_per_query_tile(seqlen_q, seqlen_k, block_m, block_n, causal)]
    assert [tuple(p) for p in out.view(-1, 2).tolist()] == model
    out = torch.zeros(2 * n_k, dtype=torch.int32, device=device)
    _count_query_tiles[(n_k,)](out, seqlen_q, seqlen_k, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    model = [(v, loaded) for _, v, loaded in query_tiles_per_key_tile(seqlen_q, seqlen_k, block_m, block_n, causal)]
    assert [tuple(p) for p in out.view(-1, 2).tolist()] == model


def test_kernel_tiles_read_from_the_config_functions():
    from flashtile.kernels.attention import backward, forward

    before = (forward.INTERPRET, backward.INTERPRET)
    gpu = iomodel.kernel_tiles(64)
    assert (forward.INTERPRET, backward.INTERPRET) == before  # the modules are not touched
    assert min(gpu.fwd + gpu.dkdv + gpu.dq) >= 32  # the GPU table, not the interpreter's 16 x 32
    assert iomodel.kernel_tiles(64, interpreter=True).fwd == (16, 32)
    assert iomodel.kernel_tiles(100).head_dim_pad == 128


@pytest.mark.parametrize("interpreter", [False, True])
def test_builtin_tiles_match_the_config_functions(interpreter):
    """The plain-Python table used without Triton is the kernels' configs, tile for tile."""
    for headdim in (1, 8, 16, 24, 32, 40, 64, 80, 96, 128, 160, 192, 256):
        for dtype in ("float16", "bfloat16", "float32"):
            for causal in (False, True):
                got = iomodel.builtin_kernel_tiles(headdim, causal, interpreter=interpreter)
                assert got == iomodel.kernel_tiles(headdim, dtype, causal, interpreter=interpreter), (headdim, dtype, causal)


def test_kernel_tiles_without_triton_use_the_builtin_table():
    """What a plain install (no Triton) sees: `import triton` fails, the table answers."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from flashtile import iomodel\n"
        "t = iomodel.kernel_tiles(128, 'bf16', True)\n"
        "assert 'flashtile.kernels.attention' not in sys.modules\n"
        "print(t.fwd, t.dkdv, t.dq, t.head_dim_pad)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "(64, 64) (32, 128) (64, 64) 128"


# --------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"batch": 0}, "batch"),
    ({"seqlen_q": -1}, "seqlen_q"),
    ({"nheads_k": 3}, "nheads_k"),
    ({"dtype": "int8"}, "dtype"),
    ({"headdim": 64.0}, "headdim"),
])
def test_bad_shapes_raise_value_error(kwargs, match):
    args = {"batch": 1, "nheads": 4, "seqlen_q": 128, "headdim": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        AttentionShape(**args)


def test_bad_choices_raise_value_error():
    shape = _shape(128)
    with pytest.raises(ValueError, match="variant"):
        iomodel.flashtile_forward_io(shape, "l3", TILES)
    with pytest.raises(ValueError, match="impl"):
        iomodel.predict("sdpa", "fwd", shape)
    with pytest.raises(ValueError, match="mode"):
        iomodel.predict("naive", "both", shape)
    with pytest.raises(ValueError, match="BLOCK"):
        KernelTiles((64,), (32, 128), (64, 64), 64)
    with pytest.raises(TypeError, match="tiles"):
        iomodel.flashtile_forward_io(shape, "no_l2", tiles=(64, 64))


def test_dtype_aliases():
    assert AttentionShape(1, 1, 8, 8, dtype="bf16").dtype == "bfloat16"
    assert AttentionShape(1, 1, 8, 8, dtype=torch.float16).elem == 2
    assert AttentionShape(1, 1, 8, 8, dtype="fp32").elem == 4


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def test_cli_iomodel_prints_the_table(capsys):
    assert cli.main(["iomodel", "--seqlens", "1024", "4096", "--headdim", "64", "--nheads", "16"]) == 0
    out = capsys.readouterr().out
    assert "naive" in out and "flashtile no-L2" in out and "ideal-L2" in out
    lines = [line.split() for line in out.splitlines() if line.startswith(("fwd ", "bwd "))]
    assert [(r[0], r[1]) for r in lines] == [("fwd", "1024"), ("bwd", "1024"), ("fwd", "4096"), ("bwd", "4096")]
    shape = _shape(4096, nheads=16)
    naive_fwd = iomodel.predict("naive", "fwd", shape, "ideal_l2").total_bytes
    assert f"{naive_fwd / 1e9:.2f} GB" in out


def test_cli_iomodel_figure2(capsys):
    assert cli.main(["iomodel", "--figure2", "--seqlens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "Figure 2" in out and "40.27 GB" in out and "40.3 GB" in out


def test_cli_iomodel_bad_arguments(capsys):
    assert cli.main(["iomodel", "--seqlens", "0"]) == 2
    err = capsys.readouterr().err
    assert "--seqlens" in err and "positive" in err and len(err.splitlines()) == 1
    assert cli.main(["iomodel", "--nheads", "16", "--nheads-k", "5"]) == 2
    assert "nheads_k" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# benchmarks/measure_io.py: what can be checked without a GPU
# --------------------------------------------------------------------------------------


def _measure_io():
    spec = importlib.util.spec_from_file_location("measure_io", os.path.join(ROOT, "benchmarks", "measure_io.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RAW_CSV = """==PROF== Connected to process 123 (/usr/bin/python3)
==PROF== Profiling "iomodel_case_marker": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum"
"","","","","","","","","","","","byte","byte"
"0","123","python3","h","iomodel_case_marker","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","64","0"
"1","123","python3","h","_attn_fwd","1","7","(128, 1, 1)","(256, 1, 1)","0","9.0","1,048,576","524,288"
"2","123","python3","h","iomodel_case_marker","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","32","32"
"3","123","python3","h","_bwd_preprocess","1","7","(128, 1, 1)","(256, 1, 1)","0","9.0","2048","1024"
"4","123","python3","h","_attn_bwd_dq","1","7","(128, 1, 1)","(256, 1, 1)","0","9.0","4096.5","512"
==PROF== Disconnected from process 123
"""

DETAILS_CSV = """"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","p","h","iomodel_case_marker","1","7","(1)","(1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","0"
"0","1","p","h","iomodel_case_marker","1","7","(1)","(1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"1","1","p","h","gemm","1","7","(1)","(1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","2.5"
"1","1","p","h","gemm","1","7","(1)","(1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","3"
"""


def test_measure_io_parses_raw_csv_and_splits_cases():
    m = _measure_io()
    kernels = m.parse_ncu_csv(RAW_CSV)
    assert [k["name"] for k in kernels] == ["iomodel_case_marker", "_attn_fwd", "iomodel_case_marker",
                                           "_bwd_preprocess", "_attn_bwd_dq"]
    assert kernels[1]["read"] == 1048576 and kernels[1]["write"] == 524288
    cases = m.split_cases(kernels)
    assert [[k["name"] for k in c] for c in cases] == [["_attn_fwd"], ["_bwd_preprocess", "_attn_bwd_dq"]]
    assert sum(k["read"] for k in cases[1]) == 2048 + 4096.5


def test_measure_io_parses_details_csv_with_scaled_units():
    kernels = _measure_io().parse_ncu_csv(DETAILS_CSV)
    assert kernels[1] == {"name": "gemm", "read": 2.5e6, "write": 3e3}


def test_measure_io_rejects_a_non_ncu_csv():
    with pytest.raises(ValueError, match="header"):
        _measure_io().parse_ncu_csv('"a","b"\n"1","2"\n')


def test_measure_io_predictions_and_latest_records():
    m = _measure_io()
    case = m.make_cases(["flashtile"], ["bwd"], [1024], [64], 1, 16, False)[0]
    pred = m.predicted(case)
    assert pred["predicted_bytes"]["no_l2"] > pred["predicted_bytes"]["ideal_l2"] > 0
    assert "_attn_bwd_dkdv" in pred["predicted_kernels"]
    old = dict(case, bench="iomodel", measured_bytes=1)
    new = dict(case, bench="iomodel", measured_bytes=2)
    assert m.latest_records([old, new, {"bench": "attention"}]) == [new]
