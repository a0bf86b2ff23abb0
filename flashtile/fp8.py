"""FP8 (e4m3) attention forward and the quantiser that feeds it.

``flash_attn_fp8_func`` follows flash-attn 3's FP8 interface: ``torch.float8_e4m3fn`` q, k, v
in flash-attn's layout, fp32 descale factors per tensor ``(1,)`` or per (batch, kv head)
``(batch, nheads_k)`` -- the real value of a stored element is ``element * descale`` -- and
a bf16 output.  Forward only: the result is detached (no autograd).  docs/fp8.md explains the
kernel (the max-offset trick, the transposed V) and the measurements behind its choices.
"""

from __future__ import annotations

import torch

from flashtile import validation
from flashtile.devices import on_input_device

__all__ = ["E4M3_MAX", "flash_attn_fp8_func", "quantize_fp8", "transpose_v"]

FP8_DTYPE = validation.FP8_DTYPE
# The largest finite e4m3fn value (1.110b * 2^8): quantize_fp8 maps each group's amax here
# so the group uses the format's whole range, and no finite input can overflow to NaN.
E4M3_MAX = 448.0
# Where flash-attn-layout V gets its keys-contiguous layout (docs/fp8.md, "V layout").  A host
# transpose costs two passes of V through HBM and a launch, once per call; the kernel's own
# transpose costs shared-memory traffic each time a query tile reads a V tile, i.e.
# seqlen_q * group / BLOCK_M times (BLOCK_M = 128 there).  Measured (benchmarks/bench_fp8.py,
# H100, seqlen_q = 1k, eight query tiles a head, d = 64 / 128 / 256): the in-kernel form at
# 0.34-0.54x of the host form, transpose included.  Below one query tile a KV head, V is read
# once either way, and the host pass would only add its two passes and its launch.
HOST_TRANSPOSE_MIN_ROWS = 128


@on_input_device
def transpose_v(v: torch.Tensor) -> torch.Tensor:
    """``(batch, seqlen_k, nheads_k, headdim)`` -> ``(batch, nheads_k, headdim, seqlen_k)``, keys contiguous.

    The layout the FP8 kernel reads V in (Hopper's FP8 tensor cores take only K-major
    operands, and P @ V contracts over keys).  ``flash_attn_fp8_func`` transposes V itself
    unless it is given ``v_transposed=True``; a caller that keeps V (a KV cache) in this
    layout saves that work on every call.  The result is a view of a buffer
    whose rows are padded to a multiple of 16 keys: a TMA descriptor needs every stride but
    the last to be a multiple of 16 bytes.
    """
    validation.check_rank("v", v, 4, "(batch, seqlen_k, nheads_k, headdim)")
    batch, seqlen_k, nheads_k, headdim = v.shape
    padded = -(-seqlen_k // 16) * 16
    buf = torch.empty(batch, nheads_k, headdim, padded, dtype=v.dtype, device=v.device)
    out = buf[..., :seqlen_k]
    if v.is_cuda and v.element_size() == 1 and v.numel():
        from flashtile.kernels.attention_fp8 import transpose_v_into

        transpose_v_into(v, buf)  # the padding too (zeros): the stores then go 16 bytes at a time
    else:
        out.copy_(v.permute(0, 2, 3, 1))
    return out


def _transpose_v_key_ordered(v: torch.Tensor) -> torch.Tensor:
    """``transpose_v(v)`` with the keys of every 16 in the order the Hopper FP8 kernel's P
    operand takes them, zero-padded to a multiple of 16 keys (``fp8_key_order``): one pass
    over V where ``transpose_v`` and ``wgmma_key_order`` would make two."""
    from flashtile.kernels.hopper.fp8_key_order import KEY_BITS_ORDER, wgmma_key_order

    if not (v.is_cuda and v.element_size() == 1 and v.numel()):
        return wgmma_key_order(transpose_v(v))
    from flashtile.kernels.attention_fp8 import transpose_v_into

    batch, seqlen_k, nheads_k, headdim = v.shape
    out = torch.empty(batch, nheads_k, headdim, -(-seqlen_k // 16) * 16, dtype=v.dtype, device=v.device)
    transpose_v_into(v, out, KEY_BITS_ORDER)
    return out


# Launch plans of the GPU paths (``hopper_fp8.dense_plan``, ``attention_fp8.dense_plan``), by
# the engine and the calls' shapes, strides, device, descale layouts, scale, flags and
# configuration: a model calls with a handful of shapes many times, and a plan's call skips
# the per-call work of the general path.  Made at the first GPU call: this module imports
# where Triton is absent (a CPU-only install).
_plans = None


def _plan(engine, q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, max_offset, config):
    """The plan for this call on ``engine`` (``config``: the Gluon kernel's configuration, or
    for the ``tl.*`` kernel whether V is transposed on the host; if not, the kernel reads V by
    TMA, so its base must be aligned for the plan's sample too), or None: the general path
    (``flashtile.kernels.plans.PlanCache``: a key's second call builds the plan)."""
    global _plans
    from flashtile.kernels.plans import NO_PLAN, PENDING, PlanCache

    if _plans is None:
        _plans = PlanCache()
    key = (engine, q.shape, q.stride(), q.device, k.shape, k.stride(), v.shape, v.stride(), q_descale.shape,
           q_descale.stride(), k_descale.shape, k_descale.stride(), v_descale.shape, v_descale.stride(),
           softmax_scale, causal, max_offset, config)
    plan = _plans.plans.get(key)
    if plan is None:
        if engine == "gluon":
            from flashtile.kernels.hopper.attention_fp8 import dense_plan
        else:
            from flashtile.kernels.attention_fp8 import dense_plan
        plan = _plans.decide(key, lambda: dense_plan(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal,
                                                     max_offset, *(() if engine == "gluon" else (config,))),
                             ready=not (q.data_ptr() | k.data_ptr() | (v.data_ptr() if config is False else 0)) & 15)
    return None if plan is NO_PLAN or plan is PENDING else plan


def clear_plans() -> None:
    """Forget the GPU paths' launch plans (after a test changes what a plan was built from)."""
    if _plans is not None:
        _plans.clear()


def _tma_ready_vt(v_t: torch.Tensor) -> torch.Tensor:
    """A transposed V whose base and outer strides are 16-byte aligned (TMA), copied only if needed."""
    ok = (v_t.stride(-1) == 1 and v_t.data_ptr() % 16 == 0
          and all((s * v_t.element_size()) % 16 == 0 for s in v_t.stride()[:-1]))
    return v_t if ok else transpose_v(v_t.permute(0, 3, 1, 2))


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------


def _dequantize(x: torch.Tensor, descale: torch.Tensor, heads_per_descale: int) -> torch.Tensor:
    """fp32 ``x * descale`` for ``(batch, seqlen, heads, d)``; ``(batch, nheads_k)`` descales
    cover ``heads_per_descale`` consecutive heads each."""
    if descale.dim() == 2:
        descale = descale.repeat_interleave(heads_per_descale, dim=1)[:, None, :, None]
    return x.to(torch.float32) * descale


@on_input_device
def flash_attn_fp8_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
    max_offset: bool = True,
    *,
    v_transposed: bool = False,
):
    """Attention on FP8 inputs: ``softmax(Q K^T * softmax_scale) V`` with ``Q = q * q_descale`` etc.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``, ``torch.float8_e4m3fn``; headdim a multiple
            of 16, at most 256.
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``, ``torch.float8_e4m3fn``;
            ``nheads % nheads_k == 0`` (GQA/MQA: query head ``h`` reads kv head
            ``h // (nheads // nheads_k)``).  With ``v_transposed=True``, ``v`` is
            ``(batch, nheads_k, headdim, seqlen_k)`` (see :func:`transpose_v`), the layout
            the FP8 tensor cores read; otherwise it is transposed per call, on the host for
            long query runs, tile by tile inside the kernel for short ones (docs/fp8.md).
        q_descale, k_descale, v_descale: float32 ``(1,)`` or ``(batch, nheads_k)``, positive
            (None = 1).  ``q_descale`` is per kv-head group too: query head ``h`` uses
            ``q_descale[b, h // (nheads // nheads_k)]``, as in flash-attn 3.
        softmax_scale: default ``headdim ** -0.5``.
        causal: bottom-right aligned causal mask (query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``); a row that sees no key gives 0 and LSE -inf.
        return_lse: also return the log-sum-exp (natural log) of the scaled scores, float32
            ``(batch, nheads, seqlen_q)``.
        max_offset: scale the probabilities by 2^8 before their FP8 cast (FlashAttention-3's
            trick, docs/fp8.md); False only to measure what it buys.  No effect on the CPU.

    Returns:
        ``out`` bfloat16 ``(batch, seqlen_q, nheads, headdim)``, or ``(out, lse)``.  Detached:
        forward only.

    CUDA tensors run an FP8 kernel (both GEMMs on FP8 tensor cores, P rounded to e4m3): the
    ``tl.*`` one, or on Hopper the Gluon one (V transposed on the host) for head dims above 128
    and non-causal calls of at least 2048 query rows at head dims 65-128
    (``engine.fp8_forward_engine``; ``FLASHTILE_ENGINE`` forces either).  CPU tensors
    dequantise to float32 and run the tiled CPU attention, which does not round P -- the
    value the GPU result approximates.
    """
    v_transposed = validation.check_bool("v_transposed", v_transposed)
    validation.check_fp8_inputs(q, k, v, v_transposed)
    batch, _, nheads, headdim = q.shape
    nheads_k = k.shape[2]
    q_descale = validation.check_descale("q_descale", q_descale, batch, nheads_k, q.device)
    k_descale = validation.check_descale("k_descale", k_descale, batch, nheads_k, q.device)
    v_descale = validation.check_descale("v_descale", v_descale, batch, nheads_k, q.device)
    softmax_scale = validation.check_softmax_scale(softmax_scale, headdim)
    causal = validation.check_bool("causal", causal)
    return_lse = validation.check_bool("return_lse", return_lse)
    max_offset = validation.check_bool("max_offset", max_offset)

    with torch.no_grad():
        if q.is_cuda:
            from flashtile.kernels.engine import fp8_forward_engine

            engine = fp8_forward_engine(q, causal)
            # The plans' and the general path's setting: the Gluon kernel's configuration, or
            # whether the tl.* kernel gets V transposed on the host (long query runs) or does it
            # tile by tile itself.
            if engine == "gluon":
                from flashtile.kernels.hopper import attention_fp8 as hopper_fp8

                setting = hopper_fp8.config_for(hopper_fp8.padded_headdim(headdim), causal)
            else:
                setting = q.shape[1] * (nheads // nheads_k) >= HOST_TRANSPOSE_MIN_ROWS
            plan = None if v_transposed else _plan(engine, q, k, v, q_descale, k_descale, v_descale, softmax_scale,
                                                   causal, max_offset, setting)
            result = plan(q, k, v, q_descale, k_descale, v_descale) if plan is not None else None
            if result is not None:
                out, lse = result
            elif engine == "gluon":
                from flashtile.kernels.tma import tma_ready

                # The Gluon kernel reads V transposed only (its tiles land K-major as they are),
                # with its keys in the P operand's order where the configuration asks for it.
                if v_transposed:
                    v, in_key_order = _tma_ready_vt(v), False
                else:
                    v, in_key_order = ((_transpose_v_key_ordered(v) if setting.key_order else transpose_v(v)),
                                       setting.key_order)
                out, lse = hopper_fp8.forward(tma_ready(q), tma_ready(k), v, q_descale, k_descale, v_descale,
                                              softmax_scale, causal=causal, max_offset=max_offset,
                                              v_in_key_order=in_key_order)
            else:
                from flashtile.kernels.attention_fp8 import attention_fp8_forward

                if v_transposed:
                    v = _tma_ready_vt(v)
                elif setting:
                    v, v_transposed = transpose_v(v), True
                out, lse = attention_fp8_forward(q, k, v, q_descale, k_descale, v_descale, softmax_scale,
                                                 causal=causal, max_offset=max_offset, v_transposed=v_transposed)
        else:
            from flashtile import cpu

            if v_transposed:
                v = v.permute(0, 3, 1, 2)
            group = nheads // nheads_k
            out, lse = cpu.attention_forward(
                _dequantize(q, q_descale, group), _dequantize(k, k_descale, 1), _dequantize(v, v_descale, 1),
                softmax_scale, -1, 0 if causal else -1,
            )
            out = out.to(torch.bfloat16)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------
# Quantisation
# --------------------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor, granularity: str = "tensor", nheads_k: int | None = None):
    """Quantise ``(batch, seqlen, nheads, headdim)`` bf16/fp16/fp32 to e4m3: ``(x_fp8, descale)``.

    Each group's largest magnitude is scaled to 448, e4m3's largest finite value, so the
    group spans the format's whole range (values below 2^-6 * amax / 448 lose precision to
    subnormals); ``x ~= x_fp8.float() * descale`` with fp32 ``descale = amax / 448`` (1 for an
    all-zero group).  Elements round to nearest: relative error <= 2^-4 on normal numbers.

    Args:
        x: bfloat16, float16 or float32 ``(batch, seqlen, nheads, headdim)``.
        granularity: ``"tensor"`` -- one scale, descale ``(1,)``; ``"head"`` -- one scale per
            (batch, kv head), descale ``(batch, nheads_k)``, the per-head form
            :func:`flash_attn_fp8_func` accepts.  ``"block"`` (per token block) is not
            implemented: e4m3 is a floating-point format, its relative precision does not
            depend on the scale, and in emulation block scales changed the attention error
            by a median 0-5 % (docs/fp8.md).
        nheads_k: for ``"head"``: the number of kv heads.  Quantising q for GQA, pass
            ``k.shape[2]``: the query heads of one group then share a scale, as the kernel's
            ``q_descale (batch, nheads_k)`` requires.  Default ``x.shape[2]``.
    """
    nheads_k = validation.check_quantize_args(x, granularity, nheads_k)
    batch, seqlen, nheads, headdim = x.shape

    xf = x.detach().to(torch.float32)
    if granularity == "tensor":
        amax = xf.abs().amax().reshape(1)
        broadcast = amax
    else:
        grouped = xf.reshape(batch, seqlen, nheads_k, nheads // nheads_k, headdim)
        amax = grouped.abs().amax(dim=(1, 3, 4))  # (batch, nheads_k)
        broadcast = amax.repeat_interleave(nheads // nheads_k, dim=1)[:, None, :, None]
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    bdescale = torch.where(broadcast > 0, broadcast / E4M3_MAX, torch.ones_like(broadcast))
    # Clamped: amax / descale can round to a hair above 448, which e4m3fn would turn into NaN.
    x_fp8 = (xf / bdescale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return x_fp8, descale.to(torch.float32).contiguous()
