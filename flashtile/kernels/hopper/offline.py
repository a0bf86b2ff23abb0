"""Compile the Hopper kernels for sm_90a without a GPU and read ptxas's verdict.

Triton compiles for an explicit target on any machine and its wheel carries ``ptxas`` and
``cuobjdump``, so a Gluon kernel that fails to compile, spills registers or lost its wgmma
instructions is caught here -- in CI, which has no GPU -- before any device time is spent::

    python -m flashtile.kernels.hopper.offline          # every forward and backward variant, one line each
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import multiprocessing
import os
import sys

import torch
import triton
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl

from flashtile.kernels.hopper import attention_bwd as bwd
from flashtile.kernels.hopper import attention_bwd_dq as bwd_dq
from flashtile.kernels.hopper import attention_bwd_wide as bwd_wide
from flashtile.kernels.hopper import attention_fp8 as fp8
from flashtile.kernels.hopper import attention_fwd as fwd
from flashtile.kernels.hopper import staged_softmax as staged
from flashtile.kernels.sass import TARGET, report
HEAD_DIMS = {"forward": (64, 128, 256), "backward": (64, 128), "fp8": (64, 128, 256)}
# Spilled bytes (stores, and the stack frame) tolerated per (kernel, head dim); anything beyond
# is a register-pressure regression and fails the check (docs/tuning.md has the numbers):
# * forward: ptxas keeps a few scalars of the persistent work-item loop in local memory in
#   some variants at d = 128 and 256 (8-40 bytes; docs/tuning.md lists them); at d = 64 the
#   three 160-register consumers of a dense call hold the scores, the previous tile's P (an
#   operand of the wgmma still running) and the output beside the mask: 16 bytes without a
#   mask, 304 causal (a few words stored per key tile, read back outside the key loop;
#   windowed and packed-batch variants spill nothing);
# * backward, d = 128: dK and dV of 64 keys (128 fp32 registers a thread) beside the score,
#   dP and dQ tiles leave the loop's scalars and addresses in local memory (84-292 bytes in
#   the default configuration, 432-648 with the atomics of the ``dq_tma=0+dq_lag=0``
#   alternative; loaded from L1 once a step); d = 64, 128-row query tiles: each consumer's
#   score and dP tiles (64 keys x 128 queries, 128 fp32 registers a thread) beside dK, dV and
#   the dQ share leave 128 bytes in local memory dense, 176-216 packed or windowed, 436-444
#   causal (up to 776 in the alternatives with vector atomics; the 64-row tiles of
#   ``block_m=64`` spill nothing).  The spilling tiles measured faster all the same
#   (docs/tuning.md).
# * the wide-head backward (``attention_bwd_wide``), d = 256: a few words of the step loop
#   (24 bytes dense, 40-56 masked or packed; none with the one-row constants);
# * its dQ pass (``attention_bwd_dq``): a few words of the persistent item loop beside the dQ
#   accumulator (d = 256: 0-12 bytes, 16 with a two-slot K ring; d = 128 causal 20);
# * the FP8 forward: the output, the tile's P V accumulator and the scores leave a few words in
#   local memory (0-16 bytes by default, 20 in the ``key_order=0`` alternative, at d = 128; at
#   d = 256, with the output in 32-column chunks, 44-96 bytes stored outside the key loop).
SPILL_STORE_BUDGET = {("forward", 64): 336, ("forward", 128): 40, ("forward", 256): 32,
                      ("backward", 64): 776, ("backward", 128): 704, ("backward_wide", 256): 64,
                      ("backward_dq", 64): 32, ("backward_dq", 128): 32, ("backward_dq", 256): 32,
                      ("fp8", 64): 32, ("fp8", 128): 48, ("fp8", 256): 104}

# Alternatives with a budget of their own (kernel, spec): the wide-head backward on a persistent
# grid keeps its per-tile values and ring counts beside dK and dV (offline ptxas, d = 256:
# 112-208 bytes spilled against 24-56 for one program per tile; a few words reloaded a step).
# The FP8 forward with the softmax under the P V GEMM (P carried as fp16): 0-16 bytes at d = 64
# and causal d = 128; with a head dim's own budget (keyed by head dim too) where it holds more
# beside the output, as do the other alternatives listed: d = 128 non-causal 408 bytes (with the
# default's turns and 64-column output chunks); at d = 256, 292 / 592 bytes (non-causal /
# causal), P carried as e4m3 192 / 248, 64- and 128-column P V chunks 620-700 and 300-464, much
# of it in the key loop, two chunks' GEMMs in flight 120 / 160 (a few words a key step; offline
# SASS, docs/tuning.md).
ALTERNATIVE_SPILL_BUDGET = {("backward_wide", "persistent=1"): 224, ("fp8", "softmax_under_pv=1"): 32,
                            ("fp8", "softmax_under_pv=1", 128): 416, ("fp8", "softmax_under_pv=1", 256): 600,
                            ("fp8", "p_fp16=0", 256): 256, ("fp8", "pv_cols=64", 256): 704,
                            ("fp8", "pv_cols=128", 256): 472, ("fp8", "pv_depth=2", 256): 160}

# The forward with a softcap or ALiBi (``compile_forward(softcap=..., alibi=...)``): the
# softcap's tanh and ALiBi's key distances beside the score tile leave a few words of the
# loop in local memory at d >= 128 (offline ptxas, bf16: d = 128 16-76 bytes, d = 256 16-24);
# at d = 64 such calls take two consumers of 240 registers, which spill nothing but with both
# a softcap and ALiBi on an unmasked call (80 bytes).
SCORE_MOD_SPILL_BUDGET = {64: 80, 128: 80, 256: 32}

# The backward's integer arguments that are 1 for one row of one sequence against one key, in
# MHA, and that the JIT therefore specialises (``group`` is marked not to be).
ONE_ROW_CONSTANTS = ("seqlen_q", "seqlen_k", "max_seqlen_k", "nheads_k", "num_items")
# The same for the dQ kernel (``attention_bwd_dq``: one query row of one head against one key).
DQ_ONE_ROW_CONSTANTS = ("seqlen_q", "seqlen_k", "max_seqlen_q", "nheads", "group", "num_items")


def _desc(dtype: str, rows: int, hd: int, block: list | None = None) -> str:
    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp8e4nv": gl.float8e4nv, "fp32": gl.float32}[dtype]
    block = block or [1, rows, 1, hd]
    return f"tensordesc<{dtype}{block},{gl.NVMMASharedLayout.get_default_for(block, gl_dtype)!r}>"


def _aligned(fn, names) -> dict:
    """``tt.divisibility = 16`` on ``names``: what Triton's JIT specialises for an ordinary call
    (fresh, 16-byte aligned allocations; contiguous ``(batch, seqlen, heads, d)`` tensors with
    ``d`` a multiple of 16, so every stride and the head dim divide by 16), which lets the
    epilogue's stores vectorise as they do when the kernel runs."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in names}


# The forward's arguments that an ordinary call passes 16-divisible (16-bit and FP8 alike).
_FORWARD_ALIGNED = ("O", "LSE", "stride_ob", "stride_om", "stride_oh", "stride_lb", "stride_lh", "headdim")


def _compile(fn, sig: dict, constexprs: dict, aligned: tuple, options: dict):
    """``fn`` compiled for sm_90a: ``sig`` the runtime arguments' types, ``constexprs`` marked as
    such, the ``aligned`` arguments 16-divisible (``_aligned``), launch ``options`` (warps, the
    register cap)."""
    sig = {**sig, **{name: "constexpr" for name in constexprs}}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=_aligned(fn, aligned))
    return triton.compile(src, target=TARGET, options=options)


def _cu_seqlens(varlen: bool) -> dict:
    """``CU_Q`` / ``CU_K`` as launched: int32 cu_seqlens when packed, else the launchers' float32
    placeholder, so that a packed-only branch compiled into a dense kernel fails here as it does
    on the GPU (its loads would not type-check against the placeholder)."""
    kind = "*i32" if varlen else "*fp32"
    return {"CU_Q": kind, "CU_K": kind}


def compile_forward(hd: int, causal: bool = False, window: bool = False, varlen: bool = False,
                    dtype: str = "bf16", config: fwd.HopperConfig | None = None, alternative: str = "",
                    two_consumers: bool = False, softcap: bool = False, alibi: bool = False,
                    long_unmasked: bool = False):
    """The forward kernel as it launches for head dim ``hd`` (a power of two), compiled for sm_90a
    (``alternative``: one of ``attention_fwd.ALTERNATIVES`` instead of the default configuration;
    ``two_consumers`` / ``long_unmasked``: the configuration of a call with few query rows at
    d = 64 / of a long unmasked call, ``config_for``; ``softcap`` / ``alibi``: with those score
    modifications)."""
    cfg = config or fwd.config_from_spec(hd, alternative, two_consumers, long_unmasked)
    fn = fwd.attention_fwd_kernel
    ints = ("stride_ob stride_om stride_oh stride_lb stride_lh stride_ds stride_dsb stride_ab seqlen_q seqlen_k "
            "max_seqlen_q nheads group headdim window_left window_right num_items section_heads").split()
    sig = {"Q_desc": _desc(dtype, cfg.query_box_rows, hd), "K_desc": _desc(dtype, cfg.block_n, hd),
           "V_desc": _desc(dtype, cfg.block_n, hd), "O": f"*{dtype}", "LSE": "*fp32", **_cu_seqlens(varlen),
           "DESCALES": "*fp32", "ALIBI": "*fp32", "qk_scale": "fp32", "softcap_scale": "fp32",
           "softcap_log2": "fp32", **{name: "i32" for name in ints}}
    options = fwd.kernel_constexprs(cfg, hd, 0 if window else -1, 0 if causal or window else -1, varlen, softcap, alibi)
    compile_options = {name: options.pop(name) for name in ("num_warps", "maxnreg")}
    return _compile(fn, sig, options, _FORWARD_ALIGNED, compile_options)


def compile_backward(hd: int, causal: bool = False, window: bool = False, varlen: bool = False,
                     dtype: str = "bf16", config: bwd.HopperBwdConfig | None = None, alternative: str = "",
                     deterministic: bool = False, **constexprs):
    """The backward kernel as it launches for head dim ``hd`` (a power of two), compiled for sm_90a
    (``alternative``: one of ``attention_bwd.ALTERNATIVES`` instead of the default configuration;
    ``deterministic``: the dK / dV kernel without dQ, ``attention_bwd.separate_dq_config``, of a
    ``deterministic=True`` call and the others ``engine.separate_dq`` names)."""
    cfg = config or (bwd.separate_dq_config(hd) if deterministic else bwd.config_from_spec(hd, alternative))
    fn = bwd.attention_bwd_kernel
    ints = ("stride_dqb stride_dqm stride_dqh stride_kb stride_km stride_kh stride_lb stride_lh seqlen_q seqlen_k "
            "max_seqlen_k nheads_k group headdim window_left window_right num_items section_heads").split()
    sig = {"Q_desc": _desc(dtype, cfg.block_m, hd), "K_desc": _desc(dtype, cfg.block_n, hd),
           "V_desc": _desc(dtype, cfg.block_n, hd), "DO_desc": _desc(dtype, cfg.block_m, hd),
           "DQ_desc": _desc("fp32", cfg.block_m, hd // 2), "DQ": "*fp32", "DK": f"*{dtype}", "DV": f"*{dtype}", "LSE2": "*fp32", "Delta": "*fp32",
           **_cu_seqlens(varlen), "qk_scale": "fp32", "softmax_scale": "fp32",
           **{name: "i32" for name in ints}}
    consts = {**bwd.kernel_constexprs(cfg, hd, window, causal or window, varlen), **constexprs}
    aligned = ("DQ", "DK", "DV", "LSE2", "Delta", "stride_dqb", "stride_dqm", "stride_dqh", "stride_kb", "stride_km",
               "stride_kh", "stride_lb", "stride_lh", "headdim")
    return _compile(fn, sig, consts, aligned, {"num_warps": 4, "maxnreg": cfg.maxnreg})


def compile_backward_wide(hd: int = 256, causal: bool = False, window: bool = False, varlen: bool = False,
                          dtype: str = "bf16", alternative: str = "", **constexprs):
    """The wide-head backward kernel (``attention_bwd_wide``: dK and dV) as it launches for head
    dim ``hd`` (a power of two above 128), compiled for sm_90a (``alternative``: one of
    ``attention_bwd_wide.ALTERNATIVES``; ``constexprs``: integer arguments the JIT would
    specialise, as ``compile_backward``'s)."""
    cfg = bwd_wide.config_from_spec(hd, alternative)
    fn = bwd_wide.attention_bwd_wide_kernel
    ints = ("stride_kb stride_km stride_kh stride_lb stride_lh seqlen_q seqlen_k max_seqlen_k nheads_k group headdim "
            "window_left window_right num_items section_heads").split()
    sig = {"Q_desc": _desc(dtype, cfg.block_m, hd), "K_desc": _desc(dtype, cfg.block_n, hd),
           "V_desc": _desc(dtype, cfg.block_n, hd), "DO_desc": _desc(dtype, cfg.block_m, hd),
           "DK": f"*{dtype}", "DV": f"*{dtype}", "LSE2": "*fp32", "Delta": "*fp32", **_cu_seqlens(varlen),
           "qk_scale": "fp32", "softmax_scale": "fp32", **{name: "i32" for name in ints}}
    consts = {**bwd_wide.kernel_constexprs(cfg, hd, window, causal or window, varlen), **constexprs}
    aligned = ("DK", "DV", "LSE2", "Delta", "stride_kb", "stride_km", "stride_kh", "stride_lb", "stride_lh", "headdim")
    return _compile(fn, sig, consts, aligned, {"num_warps": 4, "maxnreg": cfg.maxnreg})


def compile_backward_dq(hd: int = 256, causal: bool = False, window: bool = False, varlen: bool = False,
                        dtype: str = "bf16", alternative: str = "", **constexprs):
    """The dQ kernel (``attention_bwd_dq``) as it launches for head dim ``hd`` (a power of two),
    compiled for sm_90a (``alternative``: one of ``attention_bwd_dq.ALTERNATIVES``;
    ``constexprs``: integer arguments the JIT would specialise, as ``compile_backward``'s)."""
    cfg = bwd_dq.config_from_spec(hd, alternative)
    fn = bwd_dq.attention_bwd_dq_kernel
    ints = ("stride_qb stride_qm stride_qh stride_lb stride_lh seqlen_q seqlen_k max_seqlen_q nheads group headdim "
            "window_left window_right num_items section_heads").split()
    sig = {"Q_desc": _desc(dtype, cfg.block_m, hd), "K_desc": _desc(dtype, cfg.block_n, hd),
           "V_desc": _desc(dtype, cfg.block_n, hd), "DO_desc": _desc(dtype, cfg.block_m, hd),
           "DQ": f"*{dtype}", "LSE2": "*fp32", "Delta": "*fp32", **_cu_seqlens(varlen),
           "qk_scale": "fp32", "softmax_scale": "fp32", **{name: "i32" for name in ints}}
    options = {**bwd_dq.kernel_constexprs(cfg, hd, window, causal or window, varlen), **constexprs}
    compile_options = {name: options.pop(name) for name in ("num_warps", "maxnreg")}
    aligned = ("DQ", "LSE2", "Delta", "stride_qb", "stride_qm", "stride_qh", "stride_lb", "stride_lh", "headdim")
    return _compile(fn, sig, options, aligned, compile_options)


def compile_fp8(hd: int, causal: bool = False, config: fp8.HopperFp8Config | None = None, alternative: str = ""):
    """The forward kernel in its FP8 form as it launches for head dim ``hd`` (a power of two), compiled for
    sm_90a (``alternative``: one of ``attention_fp8.ALTERNATIVES`` instead of the default configuration)."""
    cfg = config or fp8.config_from_spec(hd, causal, alternative)
    fn = fwd.attention_fwd_kernel
    ints = ("stride_ob stride_om stride_oh stride_lb stride_lh stride_ds stride_dsb stride_ab seqlen_q seqlen_k "
            "max_seqlen_q nheads group headdim window_left window_right num_items section_heads").split()
    sig = {"Q_desc": _desc("fp8e4nv", cfg.query_box_rows, hd), "K_desc": _desc("fp8e4nv", cfg.block_n, hd),
           "V_desc": _desc("fp8e4nv", 0, 0, [1, 1, hd, cfg.block_n]), "O": "*bf16", "LSE": "*fp32",
           "CU_Q": "*fp32", "CU_K": "*fp32", "DESCALES": "*fp32", "ALIBI": "*fp32", "qk_scale": "fp32",
           "softcap_scale": "fp32", "softcap_log2": "fp32", **{name: "i32" for name in ints}}
    consts = fp8.kernel_constexprs(cfg, hd, causal)
    compile_options = {name: consts.pop(name) for name in ("num_warps", "maxnreg")}
    return _compile(fn, sig, consts, _FORWARD_ALIGNED, compile_options)


def compile_softmax(direction: str, dtype: str = "bf16", log: bool = False, chunk_boxes: int = 6, buffers: int = 2):
    """The shared-memory softmax kernel (``staged_softmax``, ``direction`` ``"forward"`` or
    ``"backward"``) as it launches with ``chunk_boxes`` boxes a chunk in ``buffers`` buffers."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    box = f"tensordesc<{dtype}[1, {staged.BOX_ROWS}, {staged.inner_cols(torch_dtype.itemsize)}]," \
          f"{staged.box_layout(torch_dtype)!r}>"
    ints = {name: "i32" for name in ("n_rows", "vrows", "groups", "splits")}
    if direction == "forward":
        fn = staged.staged_softmax_fwd_kernel
        sig = {"X_desc": box, "Y_desc": box, "M_PART": "*fp32", "L_PART": "*fp32", "ARRIVED": "*i32", **ints,
               "scale_log2": "fp32"}
    else:
        fn = staged.staged_softmax_bwd_kernel
        sig = {"Y_desc": box, "G_desc": box, "DX_desc": box, "S_PART": "*fp32", "ARRIVED": "*i32", **ints,
               "scale": "fp32"}
    consts = dict(LOG=log, CHUNK_BOXES=chunk_boxes, BUFFERS=buffers, SPLITS_P2=128,
                  BOX_LAYOUT=staged.box_registers(torch_dtype.itemsize))
    sig.update({name: "constexpr" for name in consts})
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=TARGET, options={"num_warps": staged.NUM_WARPS})


def uses_wgmma(variant: dict) -> bool:
    """The attention kernels must keep their wgmma; the softmax kernels have none."""
    return variant["kernel"] != "softmax"


def spill_budget(variant: dict) -> int:
    """Spilled bytes tolerated for one ``variants()`` entry: ``SPILL_STORE_BUDGET``, or
    ``SCORE_MOD_SPILL_BUDGET`` for a forward with a softcap or ALiBi, or an alternative's own
    ``ALTERNATIVE_SPILL_BUDGET`` (its head dim's where it has one)."""
    if variant["kernel"] == "softmax":
        return 0
    if variant.get("softcap") or variant.get("alibi"):
        return SCORE_MOD_SPILL_BUDGET[variant["hd"]]
    alternative = (variant["kernel"], variant.get("alternative", ""))
    own = ALTERNATIVE_SPILL_BUDGET.get(alternative + (variant["hd"],), ALTERNATIVE_SPILL_BUDGET.get(alternative))
    return own if own is not None else SPILL_STORE_BUDGET[variant["kernel"], variant["hd"]]


def within_budget(rep: dict, variant: dict) -> bool:
    """Spills within ``spill_budget``, wgmma present and not serialised by ptxas, shared
    memory that fits an SM."""
    budget = spill_budget(variant)
    return (rep["spill_stores"] <= budget and rep["stack"] <= budget
            and (rep["HGMMA"] + rep["QGMMA"] > 0 or not uses_wgmma(variant))
            and not rep["wgmma_serialized"] and rep["shared"] <= 232448)


def variants():
    """Every (kernel, head dim, causal, window, varlen, dtype) the dispatch can send to a Hopper kernel,
    and the kernels' alternative configurations (``ALTERNATIVES`` of each kernel's module)."""
    for kernel, (causal, window), varlen, dtype in itertools.product(
            ("forward", "backward"), ((False, False), (True, False), (False, True)), (False, True), ("bf16", "fp16")):
        for hd in HEAD_DIMS[kernel]:
            yield dict(kernel=kernel, hd=hd, causal=causal, window=window, varlen=varlen, dtype=dtype)
    for hd, causal in itertools.product(HEAD_DIMS["fp8"], (False, True)):  # dense, e4m3 only
        yield dict(kernel="fp8", hd=hd, causal=causal)
    # The alternative configurations: the 16-bit forward's in bf16 (the dtype changes no
    # register or barrier of theirs) on dense inputs up to d = 128, where the exp2 units bound
    # the tile; FP8's at every head dim where one launches another kernel than the default; the
    # backward's everywhere the backward runs.
    for alternative, causal, hd in itertools.product(fwd.ALTERNATIVES, (False, True), (64, 128)):
        yield dict(kernel="forward", hd=hd, causal=causal, window=False, varlen=False, dtype="bf16",
                   alternative=alternative)
    # Softcap and ALiBi (each alone and both, causal and not) at every head dim, in bf16, with
    # the consumers such calls take (``attention_fwd.call_config``: two at d = 64).
    for (softcap, alibi), causal, hd in itertools.product(((True, False), (False, True), (True, True)), (False, True),
                                                           HEAD_DIMS["forward"]):
        yield dict(kernel="forward", hd=hd, causal=causal, window=False, varlen=False, dtype="bf16",
                   softcap=softcap, alibi=alibi, two_consumers=hd <= 64)
    # The tiles of long unmasked calls (``attention_fwd.call_config``), dense and packed.
    for hd, varlen in itertools.product(HEAD_DIMS["forward"], (False, True)):
        if fwd.config_for(hd, False, True) != fwd.config_for(hd):
            yield dict(kernel="forward", hd=hd, causal=False, window=False, varlen=varlen, dtype="bf16",
                       long_unmasked=True)
    # The two-consumer tiles of short calls at d = 64 (``attention_fwd.call_config``).
    for (causal, window), varlen in itertools.product(((False, False), (True, False), (False, True)), (False, True)):
        yield dict(kernel="forward", hd=64, causal=causal, window=window, varlen=varlen, dtype="bf16",
                   two_consumers=True)
    for alternative, causal, hd in itertools.product(fp8.ALTERNATIVES, (False, True), HEAD_DIMS["fp8"]):
        if not fp8.is_default(hd, causal, alternative):
            yield dict(kernel="fp8", hd=hd, causal=causal, alternative=alternative)
    for alternative, (causal, window), varlen, hd in itertools.product(
            bwd.ALTERNATIVES, ((False, False), (True, False), (False, True)), (False, True), HEAD_DIMS["backward"]):
        if bwd.config_from_spec(hd, alternative) == bwd.config_for(hd):
            continue  # the default itself at this head dim
        yield dict(kernel="backward", hd=hd, causal=causal, window=window, varlen=varlen, dtype="bf16",
                   alternative=alternative)
    # The dK / dV kernel without dQ (deterministic and short masked calls), wherever the backward runs.
    for (causal, window), varlen, hd in itertools.product(
            ((False, False), (True, False), (False, True)), (False, True), HEAD_DIMS["backward"]):
        yield dict(kernel="backward", hd=hd, causal=causal, window=window, varlen=varlen, dtype="bf16",
                   deterministic=True)
    # One query row, one key and one query head per key head: Triton's JIT passes the integer
    # arguments equal to 1 as constants, which fold the query-tile loop to one step (Triton
    # 3.6 fails to lower the late dQ GEMM's loop when ``group`` is a constant 1 as well).
    for alternative, hd in itertools.product(("",) + bwd.ALTERNATIVES, HEAD_DIMS["backward"]):
        yield dict(kernel="backward", hd=hd, causal=False, window=False, varlen=False, dtype="bf16",
                   alternative=alternative, **{name: 1 for name in ONE_ROW_CONSTANTS})
    for hd in HEAD_DIMS["backward"]:
        yield dict(kernel="backward", hd=hd, causal=False, window=False, varlen=False, dtype="bf16",
                   deterministic=True, **{name: 1 for name in ONE_ROW_CONSTANTS})
    # The wide-head backward (dK and dV by columns) wherever it runs.
    for (causal, window), varlen, dtype in itertools.product(((False, False), (True, False), (False, True)),
                                                             (False, True), ("bf16", "fp16")):
        yield dict(kernel="backward_wide", hd=256, causal=causal, window=window, varlen=varlen, dtype=dtype)
    yield dict(kernel="backward_wide", hd=256, causal=False, window=False, varlen=False, dtype="bf16",
               **{name: 1 for name in ONE_ROW_CONSTANTS})
    for alternative, (causal, window), varlen in itertools.product(
            bwd_wide.ALTERNATIVES, ((False, False), (True, False), (False, True)), (False, True)):
        yield dict(kernel="backward_wide", hd=256, causal=causal, window=window, varlen=varlen, dtype="bf16",
                   alternative=alternative)
    # The dQ pass of the wide-head backward wherever it runs, its alternatives, and its tiles
    # at d <= 128 (``engine.separate_dq``'s calls: ``engine.separate_dq_engine``).
    for (causal, window), varlen, dtype in itertools.product(((False, False), (True, False), (False, True)),
                                                             (False, True), ("bf16", "fp16")):
        yield dict(kernel="backward_dq", hd=256, causal=causal, window=window, varlen=varlen, dtype=dtype)
    for alternative, causal in itertools.product(bwd_dq.ALTERNATIVES, (False, True)):
        yield dict(kernel="backward_dq", hd=256, causal=causal, window=False, varlen=False, dtype="bf16",
                   alternative=alternative)
    for hd, causal in itertools.product(HEAD_DIMS["backward"], (False, True)):
        yield dict(kernel="backward_dq", hd=hd, causal=causal, window=False, varlen=False, dtype="bf16")
    yield dict(kernel="backward_dq", hd=256, causal=False, window=False, varlen=False, dtype="bf16",
               **{name: 1 for name in DQ_ONE_ROW_CONSTANTS})
    # The shared-memory softmax: every chunk size its plans give in bf16 (two buffers up to half
    # the slots, one beyond), and each dtype and log-softmax at the largest of each.
    for direction, tensors in (("forward", 1), ("backward", 2)):
        half = staged.SLOTS // (2 * tensors)
        for chunk_boxes in range(1, 2 * half + 1):
            yield dict(kernel="softmax", direction=direction, dtype="bf16", log=False, chunk_boxes=chunk_boxes,
                       buffers=2 if chunk_boxes <= half else 1)
        for dtype, log, chunk_boxes in itertools.product(("bf16", "fp16", "fp32"), (False, True), (half, 2 * half)):
            if (dtype, log) != ("bf16", False):
                yield dict(kernel="softmax", direction=direction, dtype=dtype, log=log, chunk_boxes=chunk_boxes,
                           buffers=2 if chunk_boxes == half else 1)


def compile_variant(kernel: str, **shape):
    """The ``compile_*`` function of one ``variants()`` entry's kernel, called with the rest of it."""
    return {"forward": compile_forward, "backward": compile_backward, "backward_wide": compile_backward_wide,
            "backward_dq": compile_backward_dq, "fp8": compile_fp8, "softmax": compile_softmax}[kernel](**shape)


def _reported(variant: dict) -> tuple[dict, dict]:
    return variant, report(compile_variant(**variant))


# Compiles run in this many processes at most (each ptxas run takes one core and well under
# a GiB): the check's wall time divides by the cores a machine has.
MAX_WORKERS = 8


def main(argv=None) -> int:
    """Compile every variant; one line each (``--json``: one JSON object each), in the order of
    ``variants()``. Exit 1 when one is over budget."""
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)
    bad = 0
    workers = min(os.cpu_count() or 1, MAX_WORKERS)
    # Fresh interpreters for the workers (spawn): nothing of this process's state is forked.
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for v, rep in pool.map(_reported, variants()):
            ok = within_budget(rep, v)
            bad += not ok
            if as_json:
                print(json.dumps({**v, **rep}), flush=True)
            else:
                print(("ok  " if ok else "BAD ") + " ".join(f"{k}={x}" for k, x in v.items()), {
                    k: rep[k] for k in ("registers", "spill_stores", "spill_loads", "shared", "HGMMA", "QGMMA", "LDL",
                                        "wgmma_serialized")}, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
