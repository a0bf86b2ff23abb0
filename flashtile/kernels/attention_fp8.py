"""FlashAttention forward on FP8 (e4m3) inputs, with FlashAttention-3's max-offset trick.

Same structure as the bf16/fp16 forward in ``attention.py`` -- one program per (query tile,
batch * head), K/V tiles streamed by TMA, an online softmax with deferred normalisation,
tile skipping for causal masks through ``masking.py`` -- with three differences:

* **Both GEMMs run on FP8 tensor cores.**  Q and K arrive in e4m3; the probabilities P are
  cast to e4m3 for the P @ V product.  The per-tensor or per-(batch, kv-head) descale
  factors never touch the tiles: ``q_descale * k_descale * softmax_scale * log2(e)`` is the
  one scale of the FMA that turns raw scores into exp2 arguments, and ``v_descale`` joins
  the ``1 / l`` of the final normalisation.
* **The max offset.**  ``exp(s - m)`` lies in [0, 1], the bottom of e4m3's range, where its
  subnormals hold only 3, 2, 1 significant bits and anything below 2^-10 is 0.  Adding
  ``MAX_OFFSET = 8`` to the exp2 argument computes ``P * 2^8`` instead: [0, 256] keeps the
  row's large probabilities on normal numbers and moves the subnormal cliff down to 2^-14
  of the row maximum.  256 = 2^8 is the largest power of two below e4m3's maximum of 448,
  so the biggest P is still exact and nothing saturates.  The row sum ``l`` accumulates the
  same scaled values in fp32, so ``O = acc / l`` is unchanged and the LSE subtracts the
  offset back out.
* **V's layout.**  Hopper's FP8 wgmma takes both operands K-major (the contraction
  dimension contiguous in shared memory).  For ``P @ V`` the contraction runs over keys, so
  the kernel wants V as ``(batch, nheads_k, headdim, seqlen_k)`` (``V_TRANSPOSED``;
  ``flashtile.fp8.transpose_v`` makes it, one pass over V).  Given flash-attn's layout
  instead, Triton transposes every V tile through registers into shared memory inside the
  loop, once per query tile that reads it; docs/fp8.md compares the two.

Outputs: ``out`` bf16 ``(batch, seqlen_q, nheads, headdim)``, LSE fp32 natural log
``(batch, nheads, seqlen_q)`` -- the bf16 kernel's conventions, an empty row giving 0 and -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashtile.kernels.launch import bind, launch
from flashtile.kernels.masking import band_mask, key_tiles
from flashtile.kernels.online_softmax import LOG2E, online_max
from flashtile.kernels.runtime import INTERPRET, TileConfig, cdiv, next_power_of_2
from flashtile.kernels.tile_info import tile_and_head
from flashtile.kernels.tma import descriptor, tma_ready

# e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; exponent 1111 with
# mantissa 111 is NaN, so the largest finite value is 1.110b * 2^8 = 448.
E4M3_MAX = 448.0
# log2 of the factor P is scaled by before its cast: 2^8 = 256 <= 448 (see the module docstring).
MAX_OFFSET = 8


@triton.jit
def _round_to_e4m3(x):
    """``x`` rounded to the nearest e4m3 value (ties to even), saturated at +-448, still fp32.

    Only for Triton's interpreter: its fp32 -> e4m3 cast (Triton 3.6) truncates instead of
    rounding, mis-carries into the exponent (124.5 -> 64) and flushes subnormals, while the
    GPU's ``cvt.rn.satfinite`` rounds to nearest even and saturates.  Casting a value that
    is already on the e4m3 grid is exact in both, so rounding here first makes the
    interpreter compute what the hardware computes.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    # Spacing of e4m3 values near x: 2^(e - 3) for normals, 2^-9 (the subnormal step) below 2^-6.
    ulp_exponent = tl.maximum(exponent, -6) - 3
    # Adding then subtracting 1.5 * 2^23 * ulp rounds to a multiple of ulp, ties to even,
    # in fp32 arithmetic (|x| < 2^4 * ulp here, far inside the trick's 2^22 * ulp range).
    magic = ((ulp_exponent + 23 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    rounded = (x + magic) - magic
    return tl.minimum(tl.maximum(rounded, -448.0), 448.0)


@triton.jit
def _round_to_bf16(x):
    """``x`` rounded to the nearest bfloat16 (ties to even), still fp32; finite ``x`` only.

    Only for the interpreter, whose fp32 -> bf16 cast truncates toward zero (a bias of half
    an ulp, visible in the tests' error statistics) where the GPU rounds to nearest even.
    """
    bits = x.to(tl.int32, bitcast=True)
    # Adding 0x7FFF plus the lowest kept bit, then dropping the low 16 bits, rounds ties to even.
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(x, EXACT_ROUNDING: tl.constexpr):
    if EXACT_ROUNDING:
        x = _round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _to_bf16(x, EXACT_ROUNDING: tl.constexpr):
    if EXACT_ROUNDING:
        x = _round_to_bf16(x)
    return x.to(tl.bfloat16)


@triton.jit
def _fp8_fwd_tiles(
    acc, l_i, m_i, q, K_desc, V_desc, b, hk, m0, start, end, seqlen_q, seqlen_k, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, OFFSET: tl.constexpr, V_TRANSPOSED: tl.constexpr, EXACT_ROUNDING: tl.constexpr,
):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    for start_n in range(start, end, BLOCK_N):
        k = K_desc.load([b, start_n, hk, 0]).reshape([BLOCK_N, HEAD_DIM])
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            visible = band_mask(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, -1, 0, False, CAUSAL)
            qk = tl.where(visible, qk, float("-inf"))
        m_ij, m_sub = online_max(qk, m_i, qk_scale, MASKED)
        # One FMA per score: descales, softmax scale and log2(e) live in qk_scale, and the
        # offset in the subtrahend, so P = 2^OFFSET * exp(s - m) costs nothing extra.
        p = tl.math.exp2(qk * qk_scale - (m_sub - OFFSET)[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_TRANSPOSED:
            # Keys contiguous: the tile lands in shared memory K-major, as the wgmma wants it.
            v = tl.trans(V_desc.load([b, hk, 0, start_n]).reshape([HEAD_DIM, BLOCK_N]))
        else:
            # Head dim contiguous: Triton transposes the tile through registers into a second
            # shared-memory buffer before the wgmma, on every tile of every program.
            v = V_desc.load([b, start_n, hk, 0]).reshape([BLOCK_N, HEAD_DIM])
        # A fresh accumulator per tile, added in fp32: Hopper's FP8 wgmma accumulates at
        # reduced precision, so chaining every tile's P V into one wgmma accumulator drops
        # the small terms of a long row (H200, peaked scores with V = N(1, 1): mean error
        # -4.0e-2 either way, the max offset's gain lost, against -2.1e-3 this way; docs/fp8.md).
        acc = acc * alpha[:, None] + tl.dot(_to_e4m3(p, EXACT_ROUNDING), v)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_fp8(
    Q_desc, K_desc, V_desc, O_desc, LSE, Q_DESCALE, K_DESCALE, V_DESCALE,
    stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    seqlen_q, seqlen_k, nheads, group, softmax_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, OFFSET: tl.constexpr, V_TRANSPOSED: tl.constexpr, EXACT_ROUNDING: tl.constexpr,
):
    pid_m, bh = tile_and_head(seqlen_q, BLOCK_M, CAUSAL)
    b = bh // nheads
    h = bh % nheads
    hk = h // group
    m0 = pid_m * BLOCK_M
    q_descale = tl.load(Q_DESCALE + b * stride_qdb + hk * stride_qdh)
    k_descale = tl.load(K_DESCALE + b * stride_kdb + hk * stride_kdh)
    v_descale = tl.load(V_DESCALE + b * stride_vdb + hk * stride_vdh)
    qk_scale = q_descale * k_descale * softmax_scale_log2

    q = Q_desc.load([b, m0, h, 0]).reshape([BLOCK_M, HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Causal is the band (unbounded, 0): the interior tiles need no mask, the diagonal
    # tiles and the ragged last tile do, tiles above the diagonal are never loaded.
    _, full_lo, full_hi, hi = key_tiles(m0, seqlen_q, seqlen_k, -1, 0, BLOCK_M, BLOCK_N, False, CAUSAL)
    acc, l_i, m_i = _fp8_fwd_tiles(acc, l_i, m_i, q, K_desc, V_desc, b, hk, m0, full_lo, full_hi,
                                   seqlen_q, seqlen_k, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                                   False, CAUSAL, OFFSET, V_TRANSPOSED, EXACT_ROUNDING)
    acc, l_i, m_i = _fp8_fwd_tiles(acc, l_i, m_i, q, K_desc, V_desc, b, hk, m0, full_hi, hi,
                                   seqlen_q, seqlen_k, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                                   True, CAUSAL, OFFSET, V_TRANSPOSED, EXACT_ROUNDING)

    # l holds 2^OFFSET times the true row sum, exactly as acc does: their ratio is the
    # output; only the LSE takes the offset back out.  Empty rows: out 0, LSE -inf.
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, v_descale / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i)) - OFFSET) * 0.6931471805599453)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    lse_row = bh.to(tl.int64) * seqlen_q
    tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < seqlen_q)
    out = _to_bf16(acc * inv_l[:, None], EXACT_ROUNDING)
    O_desc.store([b, m0, h, 0], out.reshape([1, BLOCK_M, 1, HEAD_DIM]))


# --------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------


def padded_headdim(d: int) -> int:
    # An FP8 wgmma contracts 32 elements per instruction, so Q K^T needs HEAD_DIM >= 32;
    # columns past the true head dim read as zeros through the descriptors.
    return max(32, next_power_of_2(d))


def fwd_config(head_dim_pad: int, causal: bool, v_transposed: bool = True, interpret: bool = INTERPRET) -> TileConfig:
    """Default tiles, measured on an H200 (the alternatives: docs/tuning.md, "FP8 forward").

    V pre-transposed, d <= 128: one warpgroup per program (64 query rows, 4 warps, 128-key
    tiles) at <= 236 registers and <= 104 KB of shared memory, so two programs share an SM
    and one's exp2s run while the other's wgmmas do -- the overlap that one 8-warp program
    of 128 rows, whose two warpgroups move in step, does not get (d = 128, N = 16k, one run
    with chained P V accumulation: 864 TFLOP/s against 606 for (128, 128, 8, 3)).  At
    d = 256 the per-tile P V accumulator (see ``_fp8_fwd_tiles``) and the output
    accumulator are 128 registers each at 4 warps, which spills; 8 warps over 64 rows
    measured best (474 TFLOP/s at N = 16k; 347 for the spilling (64, 64, 4, 3)).
    Transposing V tiles in the kernel keeps the 8-warp tiles: at 4 warps that variant ran
    at 176-190 TFLOP/s (d = 128), with (128, 128, 8, 3) at 235-268.
    """
    if interpret:
        return TileConfig(16, 32, 4, 1)
    if not v_transposed:
        return TileConfig(128, 128, 8, 3) if head_dim_pad <= 128 else TileConfig(128, 64, 8, 2)
    if head_dim_pad <= 128:
        return TileConfig(64, 128, 4, 3)
    return TileConfig(64, 64, 8, 3)


@triton.jit
def _transpose_v_kernel(V, VT, seqlen_k, keys_out, nheads_k, headdim, s_vb, s_vn, s_vh, s_vd, s_tb, s_th, s_td,
                        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, KEY_BITS: tl.constexpr):
    """One tile of ``VT[b, h, dims, keys] = V[b, keys, h, dims]`` (bytes), the keys from
    ``seqlen_k`` to ``keys_out`` zero: a 2-D transpose per (batch, kv head), through shared
    memory so that both the loads (along the head dim) and the stores (along the keys) stay
    contiguous.  A ``keys_out`` that is a multiple of 16 lets the stores go 16 bytes at a time.

    With ``KEY_BITS`` (the Gluon FP8 forward's key order, ``fp8_key_order.KEY_BITS_ORDER``) the
    keys of every 16 are stored in that order: bit ``3 - i`` of a key's place is bit
    ``3 - KEY_BITS[i]`` of the key.  The tile is reordered in registers, so that the stores
    keep their contiguous addresses."""
    bh = tl.program_id(2)
    b = (bh // nheads_k).to(tl.int64)
    h = (bh % nheads_k).to(tl.int64)
    keys = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (keys[:, None] < seqlen_k) & (dims[None, :] < headdim)
    tile = tl.trans(tl.load(V + b * s_vb + h * s_vh + keys[:, None].to(tl.int64) * s_vn + dims[None, :] * s_vd,
                            mask=ok, other=0))
    if KEY_BITS is not None:
        grouped = tl.reshape(tile, (BLOCK_D, BLOCK_K // 16, 2, 2, 2, 2))
        tile = tl.reshape(tl.permute(grouped, (0, 1, 2 + KEY_BITS[0], 2 + KEY_BITS[1], 2 + KEY_BITS[2],
                                               2 + KEY_BITS[3])), (BLOCK_D, BLOCK_K))
    stored = (dims[:, None] < headdim) & (keys[None, :] < keys_out)
    tl.store(VT + b * s_tb + h * s_th + dims[:, None].to(tl.int64) * s_td + keys[None, :], tile, mask=stored)


def transpose_v_into(v: torch.Tensor, out: torch.Tensor, key_bits: tuple | None = None) -> None:
    """``out[b, h, d, n] = v[b, n, h, d]`` for one-byte ``v`` (any strides) and ``out`` with
    unit key stride: the kernel behind ``flashtile.fp8.transpose_v`` on the GPU (a torch
    permute-copy of fp8 runs at ~0.37 TB/s; docs/fp8.md).  ``out`` holds ``seqlen_k`` keys, or
    that many zero-padded to a multiple of 16 (stored 16 bytes at a time); with ``key_bits``
    the latter, the keys of every 16 stored in that order (``_transpose_v_kernel``)."""
    launch(_transpose_v_kernel, *_transpose_v_launch(v, out, key_bits))


def transpose_v_bound(v: torch.Tensor, out: torch.Tensor, key_bits: tuple | None = None):
    """A bound launcher (``flashtile.kernels.launch.bind``) of :func:`transpose_v_into` for a
    ``v`` and an ``out`` with these shapes, strides and dtypes: a launch plan calls it with
    ``(v.view(torch.uint8), out.view(torch.uint8))``."""
    grid, args, options = _transpose_v_launch(v, out, key_bits)
    return bind(_transpose_v_kernel, grid, options, args, tail_from=2)


def _transpose_v_launch(v: torch.Tensor, out: torch.Tensor, key_bits: tuple | None = None) -> tuple:
    """:func:`transpose_v_into`'s ``(grid, runtime arguments, constexprs)`` (its checks first); the
    first two arguments are ``v`` and ``out`` as bytes, the rest follow from their shapes and
    strides (what a launch plan binds)."""
    batch, seqlen_k, nheads_k, headdim = v.shape
    padded = cdiv(seqlen_k, 16) * 16
    if out.stride(-1) != 1:
        raise ValueError(f"out must have unit stride along the keys, got strides {tuple(out.stride())}")
    if out.shape[-1] not in ((padded,) if key_bits is not None else (seqlen_k, padded)):
        raise ValueError(f"out must hold {padded} keys{' in key order' if key_bits is not None else ''}, "
                         f"got {out.shape[-1]}")
    vb, tb = v.view(torch.uint8), out.view(torch.uint8)  # bytes: no fp8 arithmetic happens here
    block_k = 16 if INTERPRET else 128
    block_d = min(16 if INTERPRET else 128, next_power_of_2(headdim))
    grid = (cdiv(out.shape[-1], block_k), cdiv(headdim, block_d), batch * nheads_k)
    return (grid, (vb, tb, seqlen_k, out.shape[-1], nheads_k, headdim, *vb.stride(), tb.stride(0), tb.stride(1),
                   tb.stride(2)), dict(BLOCK_K=block_k, BLOCK_D=block_d, KEY_BITS=key_bits, num_warps=4))


def _tma_aligned(t: torch.Tensor) -> bool:
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1]))


def _descale_strides(descale: torch.Tensor) -> tuple[int, int]:
    # (1,) is shared by every (batch, kv head): stride 0 in both.
    return (0, 0) if descale.dim() == 1 else (descale.stride(0), descale.stride(1))


def attention_fp8_forward(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal=False,
                          max_offset=True, v_transposed=True, config=None):
    """FP8 forward.

    ``q (b, nq, h, d)``, ``k (b, nk, hk, d)``, all ``torch.float8_e4m3fn``; ``v`` likewise,
    either ``(b, hk, d, nk)`` with 16-byte aligned strides (``v_transposed``, made by
    ``flashtile.fp8.transpose_v``) or ``(b, nk, hk, d)`` (transposed tile by tile in the
    kernel).  Descales fp32 ``(1,)`` or ``(b, hk)`` (a stored element means ``element *
    descale``).  Returns ``(out bf16 (b, nq, h, d), lse fp32 (b, h, nq))``.
    ``max_offset=False`` casts the raw ``exp(s - m)`` (for the accuracy comparison).
    """
    batch, seqlen_q, nheads, d = q.shape
    hd = padded_headdim(d)
    cfg = config or fwd_config(hd, causal, v_transposed)
    q_, k_ = tma_ready(q), tma_ready(k)
    if v_transposed:
        if not _tma_aligned(v):
            raise ValueError(f"a transposed v must have unit last stride and 16-byte aligned base and strides "
                             f"(flashtile.fp8.transpose_v makes one), got strides {tuple(v.stride())}")
        v_desc = _transposed_v_descriptor(v, hd, cfg.block_n)
    else:
        v_desc = descriptor(tma_ready(v), cfg.block_n, hd)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
    grid, rest, options = _launch_args(q, k, lse, q_descale, k_descale, v_descale, softmax_scale, causal, max_offset,
                                       v_transposed, cfg)
    launch(_attn_fwd_fp8, grid, (descriptor(q_, cfg.block_m, hd), descriptor(k_, cfg.block_n, hd), v_desc,
                                 descriptor(out, cfg.block_m, hd)) + rest, options)
    return out, lse


def _transposed_v_descriptor(v_t: torch.Tensor, hd: int, block_n: int) -> TensorDescriptor:
    # V transposed, ``(b, hk, d, nk)``: a box of ``block_n`` keys by the padded head dim.
    return TensorDescriptor(v_t, list(v_t.shape), list(v_t.stride()), [1, 1, hd, block_n])


def _launch_args(q, k, lse, q_descale, k_descale, v_descale, softmax_scale, causal, max_offset, v_transposed, cfg):
    """``(grid, arguments, constexprs)`` of ``_attn_fwd_fp8`` for these tensors, the arguments
    from the fifth on (the first four are the q, k, V and output descriptors)."""
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    grid = (cdiv(seqlen_q, cfg.block_m) * batch * nheads,)
    return grid, (
        lse, q_descale, k_descale, v_descale,
        *_descale_strides(q_descale), *_descale_strides(k_descale), *_descale_strides(v_descale),
        seqlen_q, seqlen_k, nheads, nheads // nheads_k, softmax_scale * LOG2E,
    ), dict(HEAD_DIM=padded_headdim(d), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal),
            OFFSET=MAX_OFFSET if max_offset else 0, V_TRANSPOSED=bool(v_transposed), EXACT_ROUNDING=INTERPRET,
            **cfg.launch_options())


def dense_plan(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, max_offset, host_transpose):
    """The launch plan of ``flash_attn_fp8_func``'s ``tl.*`` path for calls with these shapes,
    strides and device, descale shapes and strides, scale and flags (``flashtile.fp8`` keys its
    plans by them; V in flash-attn's layout, transposed on the host first where
    ``host_transpose``, else in the kernel): a function ``(q, k, v, q_descale, k_descale,
    v_descale) -> (out, lse)``, ``None`` for a call whose q or k base (or V's, transposed in the
    kernel) is not 16-byte aligned (the general path takes it).  Per call it allocates the
    outputs (and V's transposed copy) and makes bound launches (``flashtile.kernels.launch.bind``),
    the descriptors built from templates; grids, arguments and constexprs are the ones
    :func:`transpose_v_into` and :func:`attention_fp8_forward` compute.  ``None`` where no
    plan serves (an empty call, strides TMA cannot read)."""
    from flashtile.kernels.plans import stand_ins
    from flashtile.kernels.tma import DescriptorTemplate, tma_strides

    batch, seqlen_q, nheads, d = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    if not (q.numel() and k.numel() and tma_strides(q) and tma_strides(k) and (host_transpose or tma_strides(v))):
        return None
    device, hd = q.device, padded_headdim(d)
    cfg = fwd_config(hd, causal, host_transpose)
    buf_shape, out_shape, lse_shape = (batch, nheads_k, d, cdiv(seqlen_k, 16) * 16), tuple(q.shape), \
        (batch, nheads, seqlen_q)
    sample_buf, sample_out, sample_lse = stand_ins(device, (buf_shape, v.dtype), (out_shape, torch.bfloat16),
                                                   (lse_shape, torch.float32))
    transpose = None
    if host_transpose:
        transpose = transpose_v_bound(v, sample_buf)
        sample_v = sample_buf[..., :seqlen_k]
        v_template = DescriptorTemplate(_transposed_v_descriptor(sample_v, hd, cfg.block_n))
    else:
        v_template = DescriptorTemplate(descriptor(v, cfg.block_n, hd))
    grid, rest, options = _launch_args(q, k, sample_lse, q_descale, k_descale, v_descale, softmax_scale, causal,
                                       max_offset, host_transpose, cfg)
    templates = (DescriptorTemplate(descriptor(q, cfg.block_m, hd)), DescriptorTemplate(descriptor(k, cfg.block_n, hd)),
                 v_template, DescriptorTemplate(descriptor(sample_out, cfg.block_m, hd)))
    # The head (tail_from=8): q, k, V (or its copy) and the output (as templates' tensors), the
    # LSE and the three descales; the rest is the plan's own.
    attend = bind(_attn_fwd_fp8, grid, options, templates + rest, tail_from=8)
    empty, uint8, v_dtype = torch.empty, torch.uint8, v.dtype

    def run(q, k, v, q_descale, k_descale, v_descale):
        if (q.data_ptr() | k.data_ptr() | (0 if host_transpose else v.data_ptr())) & 15:
            return None
        if transpose is not None:
            buf = empty(buf_shape, dtype=v_dtype, device=device)
            transpose((v.view(uint8), buf.view(uint8)))
            v = buf[..., :seqlen_k]
        out = empty(out_shape, dtype=torch.bfloat16, device=device)
        lse = empty(lse_shape, dtype=torch.float32, device=device)
        attend((q, k, v, out, lse, q_descale, k_descale, v_descale))
        return out, lse

    return run
