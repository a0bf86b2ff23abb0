"""FP8 (e4m3) attention forward for Hopper: the Gluon forward kernel in its FP8 form.

``attention_fwd.attention_fwd_kernel`` with ``FP8=True`` keeps the bf16 forward's work items,
producer warp, two consumers and online softmax (the consumers take turns at the tensor cores
at d = 128 only, ``config_for``); what FP8 changes there (the reasons are in
``flashtile/kernels/attention_fp8.py``, the portable FP8 kernel, and docs/fp8.md):

* Q and K are e4m3 and their wgmma contracts 32 elements an instruction; the descales
  ``q_descale * k_descale`` join the softmax scale in the one exp2 argument.
* P is cast to e4m3 after the **max offset**: ``P * 2^8`` (the largest power of two below
  e4m3's 448) keeps a row's probabilities on normal numbers; ``l`` carries the same factor,
  so ``O = acc / l`` is unchanged and only the LSE takes the offset back out.  P waits for
  its GEMM (the next step's) as fp16 and is cast to e4m3 where the GEMM is issued.
* ``P V`` needs V K-major (keys contiguous): V arrives transposed, ``(batch, nheads_k,
  headdim, seqlen_k)``, and its tiles are ``[HEAD_DIM, BLOCK_N]`` boxes.
* Each tile's ``P V`` is a fresh wgmma accumulator added to the output in fp32, one FMA an
  element: the output is kept one tile behind the running max (``acc * alpha_prev + P V``).
* ``v_descale`` joins ``1 / l`` in the epilogue; the output is bf16.

This module is the host side: tiles, descriptors, the descales, the launch.  Dense batches,
causal (bottom-right) or not, GQA; head dims 32-256.  At d = 256 the output and a whole
per-tile accumulator would take 256 registers a thread: there the output is eight accumulators
of 32 columns and a tile's P V is issued a chunk of 32 columns at a time into one fresh
accumulator (``pv_cols``), beside 64-key tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from flashtile.kernels.hopper import RegisterBudget, configured
from flashtile.kernels.hopper.attention_fwd import CONSUMER_ROWS, attention_fwd_kernel
from flashtile.kernels.hopper.descriptors import box_descriptor, descriptor
from flashtile.kernels.hopper.fp8_key_order import KEY_BITS_ORDER, wgmma_key_order
from flashtile.kernels.launch import bind, launch, placeholder
from flashtile.kernels.runtime import cdiv, l2_bytes, next_power_of_2, sm_count
from flashtile.kernels.tile_info import work_schedule
from flashtile.kernels.tma import DescriptorTemplate

LOG2E = 1.4426950408889634
# log2 of the factor P is scaled by before its e4m3 cast: 2^8 = 256 <= 448.
MAX_OFFSET = 8
MAX_HEADDIM = 256


# --------------------------------------------------------------------------------------
# Launch configuration and launcher
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HopperFp8Config(RegisterBudget):
    """Tiles of the Hopper FP8 forward (``BLOCK_M`` is two consumers' rows)."""

    block_n: int = 128
    num_stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    # V's keys stored in the P operand's order (fp8_key_order), so that P needs no shuffle
    # between threads on its way to the P V wgmma.
    key_order: bool = True
    # The consumers take turns issuing their GEMMs (else each issues when it is ready).
    pingpong: bool = True
    # The online-softmax update in a block of its own (``attention_fwd.softmax_step``), so that
    # it runs while the previous tile's P V GEMM does.
    softmax_under_pv: bool = False
    # P carried from its softmax to the next step's P V GEMM as fp16, cast to e4m3 at the GEMM:
    # Triton 3.6 carries an e4m3 tensor across the loop as single bytes and packs them into
    # the operand's registers byte by byte, where fp16 pairs stay packed (H100, d = 128, N = 16k
    # non-causal: 743 TFLOP/s against 655 with e4m3 carried; docs/tuning.md).
    p_fp16: bool = True
    # The output in chunks of this many columns (0: the whole head dim), P V issued chunk by
    # chunk into one fresh accumulator of a chunk's width (d = 256: the whole head dim's would
    # not fit beside the output).
    pv_cols: int = 0
    # Output chunks' P V GEMMs in flight at a time after the first (1: each waited for before
    # the next issues; 2: the next issued before the wait, in a second fresh accumulator).
    pv_depth: int = 1

    def pv_chunks(self, head_dim_pad: int) -> int:
        """The output's column chunks at ``head_dim_pad``."""
        return head_dim_pad // min(self.pv_cols or head_dim_pad, head_dim_pad)

    @property
    def block_m(self) -> int:
        return 2 * CONSUMER_ROWS.value

    @property
    def query_box_rows(self) -> int:
        return CONSUMER_ROWS.value


@functools.lru_cache(maxsize=None)
def config_for(head_dim_pad: int, causal: bool) -> HopperFp8Config:
    """Per padded head dim (the measurements behind each choice are in docs/tuning.md):

    * d = 64: 128-key tiles, each consumer issuing its GEMMs when ready;
    * d = 128: the consumers take turns at the tensor cores, and the output is two 64-column
      chunks (P V issued a chunk at a time into a 64-column accumulator: 64 registers fewer
      than a whole one); 128-key tiles, 64 causal (128 spilled 528 bytes offline with the
      masked tiles' extra registers).  H100, N = 16k, best of three runs in turns: 868 TFLOP/s
      non-causal against 726 for 128-key tiles without turns or chunks; causal 740 against 685;
    * d = 256: 64-key tiles and the output in 32-column chunks: the output (128 registers a
      thread), one chunk's P V, the scores and P of 64 keys fit with no spill in the key loop
      (64- and 128-column chunks spilled 11-45 words a step there, offline; 64-column ones ran
      11-38 % slower); each consumer issues its GEMMs when ready (in turns: 1-6 % slower in
      the best of three runs in turns)."""
    if head_dim_pad > 128:
        return HopperFp8Config(block_n=64, pingpong=False, pv_cols=32)
    if head_dim_pad > 64:
        return HopperFp8Config(block_n=64 if causal else 128, pingpong=True, pv_cols=64)
    return HopperFp8Config(block_n=128, pingpong=False)


# Alternatives to ``config_for``'s configurations (``config_from_spec`` specs), compiled offline
# in CI, checked by the GPU tests and timed by ``benchmarks/bench_fp8.py`` (docs/tuning.md).
ALTERNATIVES = ("key_order=0", "block_n=64", "pingpong=0", "pingpong=1", "softmax_under_pv=1", "p_fp16=0",
                "pv_cols=64", "pv_cols=128", "pv_depth=2")


def is_default(head_dim_pad: int, causal: bool, spec: str) -> bool:
    """Whether ``spec`` launches ``config_for``'s kernel itself at this head dim and mask (e.g.
    ``block_n=64`` at d = 256, ``pv_cols=128`` at d = 64)."""
    return (kernel_constexprs(config_from_spec(head_dim_pad, causal, spec), head_dim_pad, causal)
            == kernel_constexprs(config_for(head_dim_pad, causal), head_dim_pad, causal))


def config_from_spec(head_dim_pad: int, causal: bool, spec: str) -> HopperFp8Config:
    """``config_for(head_dim_pad, causal)`` with the changes of ``spec`` (``hopper.config_changes``;
    ``""``: the default itself)."""
    return configured(config_for, spec)(head_dim_pad, causal)


def padded_headdim(d: int) -> int:
    # An FP8 wgmma contracts 32 elements an instruction: HEAD_DIM >= 32, a power of two.
    return max(32, next_power_of_2(d))


def forward(q, k, v_t, q_descale, k_descale, v_descale, softmax_scale, causal=False, max_offset=True, config=None,
            v_in_key_order=False):
    """The FP8 forward on Hopper: ``q (b, nq, h, d)``, ``k (b, nk, hk, d)`` e4m3 with TMA-ready
    strides, ``v_t (b, hk, d, nk)`` (V transposed, keys contiguous), descales fp32 ``(1,)`` or
    ``(b, hk)``.  Returns ``(out bf16 (b, nq, h, d), lse fp32 (b, h, nq))``, as the portable
    FP8 kernel does.  A configuration with ``key_order`` reads V with its keys in the P
    operand's order: made here from ``v_t``, or ``v_t`` already is (``v_in_key_order``, from
    :func:`wgmma_key_order`)."""
    hd = padded_headdim(q.shape[-1])
    cfg = config or config_for(hd, bool(causal))
    out, lse = _outputs(q)
    if cfg.key_order and not v_in_key_order:
        v_t = wgmma_key_order(v_t)
    launched = _launch_args(q, k, out, lse, descale_table(q_descale, k_descale, v_descale, q.shape[0], k.shape[2]),
                            softmax_scale, causal, max_offset, cfg)
    if launched is not None:
        # Through the launch layer: after the first call of a class the compiled kernel is
        # launched directly (Triton's per-call dispatch costs more host time than a short
        # call's kernel).
        grid, rest, options = launched
        launch(attention_fwd_kernel, grid, (descriptor(q, cfg.query_box_rows, hd), descriptor(k, cfg.block_n, hd),
                                            box_descriptor(v_t, (1, 1, hd, cfg.block_n))) + rest, options)
    return out, lse


def _outputs(q):
    batch, seqlen_q, nheads, _ = q.shape
    return (torch.empty(batch, seqlen_q, nheads, q.shape[-1], dtype=torch.bfloat16, device=q.device),
            torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device))


def descale_table(q_descale, k_descale, v_descale, batch: int, nheads_k: int) -> torch.Tensor:
    """The (q, k, v) descales as one contiguous ``(3, batch, nheads_k)`` table: the kernel reads
    ``[which, b, hk]``."""
    return torch.stack([x.reshape(-1, x.shape[-1] if x.dim() == 2 else 1).expand(batch, nheads_k)
                        for x in (q_descale, k_descale, v_descale)]).contiguous()


def _launch_args(q, k, out, lse, descales, softmax_scale, causal, max_offset, cfg):
    """``(grid, arguments, constexprs)`` of the kernel for these tensors, the arguments from the
    fourth on (the first three are the q, k and V descriptors), or None for an empty call."""
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    num_items = cdiv(seqlen_q, cfg.block_m) * batch * nheads
    if num_items == 0:
        return None
    programs = min(num_items, sm_count(q.device.index))
    unread = placeholder(q.device)  # no packed batch, no ALiBi
    return (programs,), (
        out, lse, unread, unread, descales,
        out.stride(0), out.stride(1), out.stride(2), nheads * seqlen_q, seqlen_q, descales.stride(0),
        descales.stride(1), seqlen_q, seqlen_k, seqlen_q, nheads, nheads // nheads_k, d, softmax_scale * LOG2E,
        -1, 0 if causal else -1, num_items,
        work_schedule(batch * nheads, nheads // nheads_k, seqlen_q, seqlen_k, 2 * d, cfg.block_m, cfg.block_n, -1,
                      0 if causal else -1, programs, l2_bytes(q.device.index) // 2),
        unread, 0, 0.0, 0.0,  # no ALiBi, no softcap
    ), kernel_constexprs(cfg, padded_headdim(d), causal, max_offset)


def dense_plan(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, max_offset):
    """The launch plan of ``flash_attn_fp8_func``'s Gluon path for calls with these shapes,
    strides and device, descale shapes and strides, scale and flags (``flashtile.fp8`` keys its
    plans by them and by :func:`config_for`'s configuration, which must have ``key_order``; V
    in flash-attn's layout): a function ``(q, k, v, q_descale, k_descale, v_descale) -> (out,
    lse)``, ``None`` for a call whose q or k base is not 16-byte aligned (the general path takes
    it).  Per call it allocates V's copy in the key order, the descale table and the outputs and
    makes two bound launches (``flashtile.kernels.launch.bind``): the transpose, and the forward
    with its three descriptors built from templates; grids, arguments and constexprs are the
    ones ``transpose_v_into`` and :func:`forward` compute.  ``None`` where no plan serves (an
    empty call, strides TMA cannot read)."""
    from flashtile.kernels.attention_fp8 import transpose_v_bound
    from flashtile.kernels.plans import stand_ins
    from flashtile.kernels.tma import tma_strides

    batch, seqlen_q, nheads, d = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    cfg = config_for(padded_headdim(d), bool(causal))
    if not (cfg.key_order and tma_strides(q) and tma_strides(k) and q.numel() and k.numel()):
        return None
    device, hd = q.device, padded_headdim(d)
    v_shape, out_shape, lse_shape = (batch, nheads_k, d, cdiv(seqlen_k, 16) * 16), (batch, seqlen_q, nheads, d), \
        (batch, nheads, seqlen_q)
    sample_vt, sample_out, sample_lse = stand_ins(device, (v_shape, v.dtype), (out_shape, torch.bfloat16),
                                                  (lse_shape, torch.float32))
    transpose = transpose_v_bound(v, sample_vt, KEY_BITS_ORDER)
    sample_table = torch.empty(3, batch, nheads_k, dtype=torch.float32, device=device)
    launched = _launch_args(q, k, sample_out, sample_lse, sample_table, softmax_scale, causal, max_offset, cfg)
    if launched is None:
        return None
    grid, rest, options = launched
    templates = (DescriptorTemplate(descriptor(q, cfg.query_box_rows, hd)),
                 DescriptorTemplate(descriptor(k, cfg.block_n, hd)),
                 DescriptorTemplate(box_descriptor(sample_vt, (1, 1, hd, cfg.block_n))))
    # The head (tail_from=8): q, k and V's copy (as templates' tensors), the outputs, the two
    # unread pointers and the descale table; the rest is the plan's own.
    attend = bind(attention_fwd_kernel, grid, options, templates + rest, tail_from=8)
    unread = rest[2]
    empty, uint8, vt_dtype = torch.empty, torch.uint8, v.dtype

    def run(q, k, v, q_descale, k_descale, v_descale):
        if (q.data_ptr() | k.data_ptr()) & 15:
            return None
        v_t = empty(v_shape, dtype=vt_dtype, device=device)
        transpose((v.view(uint8), v_t.view(uint8)))
        out = empty(out_shape, dtype=torch.bfloat16, device=device)
        lse = empty(lse_shape, dtype=torch.float32, device=device)
        attend((q, k, v_t, out, lse, unread, unread,
                descale_table(q_descale, k_descale, v_descale, batch, nheads_k)))
        return out, lse

    return run


def kernel_constexprs(cfg: HopperFp8Config, hd: int, causal: bool, max_offset: bool = True) -> dict:
    """The FP8 form's constexprs and launch options for ``cfg``: what :func:`forward` launches
    and the offline compile check (``offline.compile_fp8``) compiles with."""
    return dict(
        HEAD_DIM=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, Q_BUFFERS=1, MASK_LEFT=False,
        MASK_RIGHT=bool(causal), VARLEN=False, PINGPONG=cfg.pingpong, CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs, FP8=True, OFFSET=MAX_OFFSET if max_offset else 0,
        KEY_ORDER=cfg.key_order, P_FP16=cfg.p_fp16, HAS_SOFTCAP=False, HAS_ALIBI=False,
        SOFTMAX_OWN_BLOCK=cfg.softmax_under_pv, PV_CHUNKS=cfg.pv_chunks(hd),
        PV_DEPTH=cfg.pv_depth if cfg.pv_chunks(hd) > 2 else 1,  # two chunks: the second alone follows the first
        num_warps=4, maxnreg=cfg.maxnreg,
    )
