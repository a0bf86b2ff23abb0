"""Launch knobs of the row softmax: where each strategy takes over, and each one's launch shape.

Each knob's default is a constant of this module (its comment gives the measurement behind
the value); ``KNOBS`` registers them as the ``softmax`` family of ``flashtile.kernels.runtime``,
and ``plan()`` reads ``knobs()`` at every call: the defaults, overridden by the environment
variable ``FLASHTILE_SOFTMAX_TUNING="name=value,..."`` (e.g. ``unroll=2,programs_per_sm=1``),
which ``benchmarks/tune_softmax.py`` sweeps on a GPU.
"""

from __future__ import annotations

from flashtile.kernels.runtime import Knob, register_family

# --- Strategy thresholds and launch knobs (defaults for an H200: 132 SMs, 50 MB L2) ------
# Rows up to this length are held whole in registers.  At 16k elements and 16 warps that is
# 32 values per thread (61-91 registers, forward / backward, no spills); at 32k the
# backward spills (at 16 or 32 warps) and only one program fits per SM, which leaves its
# load-reduce-store phases unoverlapped, so longer rows stream (fused path) instead.
IN_REGISTER_MAX = 16384
# num_warps of the in-register kernel for rows of 8k+ elements; 0 = by row length.
REGISTER_WARPS = 0
# Streaming kernels (fused and split): each iteration loads UNROLL sub-tiles back to back;
# a sub-tile is one 16-byte vector per thread unless STREAM_BLOCK (elements) says otherwise.
# Bytes in flight per SM, not occupancy, is what sustains HBM bandwidth: 4.2 TB/s x ~0.8 us
# of loaded latency / 132 SMs ~ 25 KB; 16 warps x 32 threads x 4 x 16 B = 32 KB.
STREAM_BLOCK = 0
STREAM_UNROLL = 4
# Fused path: warps per SM, shared by the resident programs (num_warps = this / programs
# per SM, so the bytes in flight per SM stay the same however many rows are in flight).
FUSED_WARPS_PER_SM = 16
# At most this many persistent programs per SM (also capped by occupancy at launch).  More
# than one lets a program's end-of-row reduction -- a barrier that drains its loads --
# overlap the others' streaming ...
FUSED_PROGRAMS_PER_SM = 4
# ... but every program holds a row in flight, and pass 2 hits L2 only while (rows in flight)
# x (bytes re-read per row) fits in L2 (50 MB on an H200, shared with the output stream,
# whose stores are marked evict_first): fewer programs per SM for longer rows, down to
# FUSED_MIN_PROGRAMS_PER_SM.  Below 1 (e.g. 0.5: one 32-warp program per two SMs) trades
# SMs for L2 hits on the longest rows -- only worth it if half the SMs can still pull the
# full bandwidth (loop stages help: their bytes in flight sit in shared memory).
FUSED_L2_BUDGET_MB = 40
FUSED_MIN_PROGRAMS_PER_SM = 1.0
# Fused when n_rows >= this x SMs (every SM gets a whole row); fewer rows take the split
# path so that all SMs still stream.
FUSED_MIN_ROWS_PER_SM = 1.0
# Split path: num_warps per chunk program, and chunk programs per SM to aim for (several
# waves: a small tail).
SPLIT_WARPS = 8
SPLIT_PROGRAMS_PER_SM = 8
MAX_SPLITS = 256
# Cooperative path: rows longer than IN_REGISTER_MAX and up to COOPERATIVE_MAX (forward) /
# COOP_BWD_MAX (backward) elements are cut into chunks, one chunk per program of COOP_WARPS
# warps, held in registers from its read to its write.  Forward chunks are COOP_BLOCK
# elements, 0 = 32 KB of input (16k bf16 / 8k fp32 elements: 32 words per thread at 8
# warps, bf16 / fp16 held as pairs in int32 words); backward chunks COOP_BWD_BLOCK elements
# (y and dy both held: 8192 measured above 4096 for bf16 64k, 0.86 of the copy rate against
# 0.81, and equal elsewhere).  0 turns a path off.
# Why the backward goes cooperative up to 256k (H200, M x N = 2^28, fraction of the copy
# rate): bf16 64k / 256k / 1M 0.78 / 0.69 / 0.49 against the fused path's 0.74 / 0.56 /
# 0.55; fp32 0.87 / 0.78 / 0.65 against 0.67 / 0.60 / 0.59.  The forward needs its input
# held packed (COOP_PACK) to gain: holding fp32 values (63-106 registers, 2-4 programs per
# SM) it measured bf16 0.67 / 0.64 / 0.48 against 0.76 / 0.63 / 0.60, because a chunk's
# wait for its row's slowest chunk is hidden only by the other rows' resident chunks, so
# the bytes held per SM are what counts.  All alternatives: docs/tuning.md, "Row softmax".
COOPERATIVE_MAX = 4194304
COOP_BWD_MAX = 262144
# The forward takes the cooperative path only for rows of at least this many bytes: below,
# the fused path's second read still hits L2 (bf16 64k, 128 KB rows: fused 0.72-0.76 of the
# copy rate, cooperative 0.69-0.70; fp32 64k, 256 KB: fused 0.78-0.82, cooperative 0.84).
COOP_FWD_MIN_BYTES = 262144
COOP_BLOCK = 0
COOP_BWD_BLOCK = 8192
COOP_WARPS = 8
# 1: hold unmasked contiguous 16-bit rows as pairs in int32 words; 0: one element a word.
COOP_PACK = 1
# Register cap (ptxas .maxnreg) for the cooperative kernels: 0 = none, except when a row's
# chunks would not all be resident without it -- then 64 (4 programs of 8 warps per SM: a
# 4M-element row fits on an H200's 132 SMs; masked variants spill ~100 B at this cap).
# The forward's own cap, COOP_FWD_MAXNREG, overrides it for the forward: ptxas front-loads
# the exp2 arguments (~125 registers for 32 packed words a thread), and 4 programs per SM
# at 64 registers measured fastest despite ~100 B of spills (bf16 256k: 0.68 of the copy
# rate against 0.60 uncapped; fp32, which does not spill at 64, 0.78 against 0.72).
COOP_MAXNREG = 0
COOP_FWD_MAXNREG = 64
# Hopper, STAGED = 1: unmasked rows of at least STAGED_MIN_BYTES that the TMA engine can
# read (16-byte aligned, whole 128-byte inner rows) are held in shared memory by cooperating
# programs (flashtile/kernels/hopper/staged_softmax.py) instead of taking the paths above.
# Off by default: in one tune_softmax.py run on an H200 the forward trailed the paths above at
# every row length (bf16 0.50-0.65 of the copy rate against 0.59-0.90, fp32 0.52-0.75
# against 0.63-0.97), and so did the backward of rows under 2 MB (bf16 256k: 0.67 against 0.75).
STAGED = 0
STAGED_MIN_BYTES = 65536
# The backward of rows of at least STAGED_BWD_MIN_BYTES takes the staged path with STAGED
# off too (0: never): in the same run it led there (bf16 1M: 0.60 against 0.55 of the copy
# rate, bf16 4M: 0.61 against 0.57, fp32 1M: 0.62 against 0.58).
STAGED_BWD_MIN_BYTES = 2 * 1024 * 1024
# L2 eviction hints on the streaming kernels (1) or none (0).
EVICTION_HINTS = 1
# num_stages of the streaming loops (tl.range); 0 = the compiler's default (no pipelining
# of these loads).  2-3 turns them into cp.async copies through shared memory: more bytes
# in flight per thread, without the eviction hints.
LOOP_STAGES = 0

KNOBS = register_family("softmax", "FLASHTILE_SOFTMAX_TUNING", {
    "in_register_max": (IN_REGISTER_MAX, "rows up to this length are held whole in registers"),
    "register_warps": (REGISTER_WARPS, "num_warps of the in-register kernel for rows of 8k+ elements (0: by row length)"),
    "block": (STREAM_BLOCK, "streaming sub-tile in elements (0: one 16-byte vector per thread)"),
    "unroll": (STREAM_UNROLL, "streaming sub-tiles loaded back to back per iteration"),
    "warps_per_sm": (FUSED_WARPS_PER_SM, "fused path: warps per SM, shared by its resident programs"),
    "programs_per_sm": Knob(FUSED_PROGRAMS_PER_SM, "fused path: at most this many persistent programs per SM",
                            kind=float),
    "l2_budget_mb": Knob(FUSED_L2_BUDGET_MB, "fused path: MB of L2 that the rows in flight may fill (their second "
                         "read hits L2)", kind=float),
    "min_programs_per_sm": (FUSED_MIN_PROGRAMS_PER_SM, "fused path: fewest programs per SM for long rows (below 1: "
                            "fewer, larger programs)"),
    "fused_min_rows_per_sm": (FUSED_MIN_ROWS_PER_SM, "fused path when rows >= this x SMs, else split"),
    "split_warps": (SPLIT_WARPS, "split path: num_warps per chunk program"),
    "split_programs_per_sm": (SPLIT_PROGRAMS_PER_SM, "split path: chunk programs per SM to aim for"),
    "cooperative_max": (COOPERATIVE_MAX, "forward: rows up to this length take the cooperative path (0: off)"),
    "coop_bwd_max": (COOP_BWD_MAX, "backward: rows up to this length take the cooperative path (0: off)"),
    "coop_fwd_min_bytes": (COOP_FWD_MIN_BYTES, "forward: the cooperative path only for rows of at least this many "
                           "bytes"),
    "coop_pack": (COOP_PACK, "cooperative forward: hold 16-bit rows as pairs in int32 words (1) or one a word (0)"),
    "coop_block": (COOP_BLOCK, "cooperative forward: chunk elements (0: 32 KB of input)"),
    "coop_bwd_block": (COOP_BWD_BLOCK, "cooperative backward: chunk elements"),
    "coop_warps": (COOP_WARPS, "cooperative path: num_warps per chunk program"),
    "coop_maxnreg": (COOP_MAXNREG, "cooperative kernels: register cap (0: none unless the chunks would not all be "
                     "resident, then 64)"),
    "coop_fwd_maxnreg": (COOP_FWD_MAXNREG, "cooperative forward: its own register cap (0: coop_maxnreg)"),
    "staged": (STAGED, "Hopper: hold long unmasked rows in shared memory (1) or not (0)"),
    "staged_min_bytes": (STAGED_MIN_BYTES, "Hopper: the shared-memory path for rows of at least this many bytes"),
    "staged_bwd_min_bytes": (STAGED_BWD_MIN_BYTES, "Hopper: the shared-memory path for the backward of rows of at "
                             "least this many bytes, staged=0 too (0: never)"),
    "evict": (EVICTION_HINTS, "L2 eviction hints on the streaming kernels (1) or none (0)"),
    "stages": (LOOP_STAGES, "num_stages of the streaming loops (0: the compiler's default)"),
})
TUNING_ENV = KNOBS.env_var
knobs = KNOBS.current
