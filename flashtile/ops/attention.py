"""Attention as PyTorch custom ops, with autograd.

Two ops, ``flashtile::attention_forward`` and ``flashtile::attention_backward``, each with a
fake (meta) implementation so ``torch.compile(fullgraph=True)`` traces through them without
a graph break.  Each dispatches on the device: CUDA tensors go to the Triton kernels,
everything else to the CPU path (``flashtile.cpu``: PyTorch's fused CPU kernel or the tiled
path, chosen per call).  The backward recomputes P from the saved
LSE; nothing of size seqlen_q x seqlen_k is saved between the two.

The ops' schemas hold primitive arguments only; the scale, band, score modifications,
dropout and determinism are the fields of an :class:`AttentionParams`
(``flashtile.semantics.params``), spelled out in the order of ``AttentionParams.op_args``.
Each op rebuilds the params from them and hands the backend the whole; Python callers use
:func:`forward`, :func:`backward`, :func:`varlen_forward` and :func:`varlen_backward`, which
call the ops with one ``params``.
"""

from typing import Optional

import torch

from flashtile import cpu
from flashtile.semantics.params import AttentionParams


def _backend(t: torch.Tensor):
    if t.is_cuda:
        from flashtile.kernels import attention as triton_attention

        return triton_attention
    return cpu


@torch.library.custom_op("flashtile::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    dropout_p: float,
    seed: int,
    offset: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # ``deterministic`` only matters to the backward; the forward takes it so that autograd
    # can save it with the inputs.
    params = AttentionParams(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset,
                             deterministic)
    return _backend(q).fwd(q, k, v, params)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams):
    """``flashtile::attention_forward`` with the arguments of ``params``: ``(out, lse)``."""
    return attention_forward(q, k, v, *params.op_args())


def eager_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes) -> bool:
    """Whether a call may skip ``attention_forward`` (and its autograd's ``attention_backward``)
    for direct calls of the backend, CUDA or CPU: the custom ops' dispatch (autograd key,
    redispatch, default filling, alias checks) costs tens of microseconds of host time per
    call, which a tiny forward, or a forward and backward at small N, does not hide.

    Only where the ops would do nothing but call the same launchers (or, on CPU tensors, the
    same :mod:`flashtile.cpu` functions): plain CUDA or CPU tensors (no subclass, no fake,
    meta or functorch-wrapped tensor), ALiBi slopes that need no gradient, and no
    tracing, torch-function or dispatch mode, functorch transform (vmap, grad) or
    ``torch.compile`` in progress, each of which needs the ops.  Then a call that records
    autograd runs :class:`EagerAttention` (:func:`records_autograd`), any other
    :func:`direct_forward`."""
    # is_compiling() first: while Dynamo traces, it is all Dynamo evaluates of this test (the
    # mode queries below are C functions it cannot trace).
    if torch.compiler.is_compiling():
        return False
    if not ((q.is_cuda or q.is_cpu) and q.__class__ is _Tensor and k.__class__ is _Tensor and v.__class__ is _Tensor):
        return False
    if alibi_slopes is not None and (alibi_slopes.__class__ is not _Tensor or alibi_slopes.requires_grad):
        return False
    return not (_function_mode_enabled() or _dispatch_stack_depth() or _functorch_transforms_active())


def records_autograd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call records autograd: grad mode on and an input requiring grad."""
    return _is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def eager_forward_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes) -> bool:
    """Whether a call may run :func:`direct_forward`: :func:`eager_ok`, and nothing recording autograd."""
    return eager_ok(q, k, v, alibi_slopes) and not records_autograd(q, k, v)


# The state queries above, looked up once (C functions of torch's, read at every eager call).
_Tensor = torch.Tensor
_is_grad_enabled = torch.is_grad_enabled
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_dispatch_stack_depth = torch._C._len_torch_dispatch_stack
_functorch_transforms_active = torch._C._are_functorch_transforms_active


_kernels_forward = None  # flashtile.kernels.attention.forward, imported by the first GPU call (it imports Triton)


def _import_kernels_forward():
    global _kernels_forward
    from flashtile.kernels.attention import forward

    _kernels_forward = forward
    return forward


def eager_forward(q, k, v, params: AttentionParams, memo=None, need_lse: bool = True):
    """What ``attention_forward`` computes on CUDA tensors, the kernels' launchers called
    directly (see :func:`eager_forward_ok`; Triton's interpreter runs them on CPU tensors).

    ``memo``: the caller's memo entry for calls like this one (the public function's checked
    arguments), with a ``plan`` slot for the forward's launch plan and a ``plans`` slot for the
    plan cache it came from: every call with the entry's key has the plan's key too (the
    entry's key holds all the plan's key does), so the plan is looked up once per entry, not
    per call, and used while that cache is current (``forward.cache.plans``: emptying it makes
    every kept plan stale).  ``need_lse`` False: the caller drops the LSE, and a plan's launch
    writes it to scratch instead of a new tensor (the LSE returned is then None or unused)."""
    forward = _kernels_forward or _import_kernels_forward()
    if memo is not None:
        if memo.plans is not forward.cache.plans:
            plan = forward.lookup_plan(q, k, v, params)
            if plan is forward.PENDING:  # not decided yet (a key's first call): ask again next time
                return forward.general(q, k, v, params)
            memo.plan, memo.plans = plan, forward.cache.plans
        if memo.plan is not forward.NO_PLAN:
            result = memo.plan(q, k, v, params, need_lse)
            if result is not None:
                return result
    return forward.fwd(q, k, v, params)


def direct_forward(q, k, v, params: AttentionParams, memo=None, need_lse: bool = True):
    """What ``attention_forward`` computes, without the op (see :func:`eager_ok`): the CPU
    path's forward on CPU tensors, :func:`eager_forward` on CUDA ones."""
    if not q.is_cuda:
        return _backend(q).fwd(q, k, v, params)
    return eager_forward(q, k, v, params, memo, need_lse=need_lse)


class EagerAttention(torch.autograd.Function):
    """``attention_forward`` with its autograd for an eager call that records autograd
    (:func:`eager_ok`): the same launchers, the same saved tensors and the same backward as the
    op's registered autograd, called directly.  Not differentiable twice, like the op."""

    @staticmethod
    def forward(ctx, q, k, v, params: AttentionParams, memo):
        out, lse = direct_forward(q, k, v, params, memo)
        ctx.save_for_backward(q, k, v, out, lse, params.alibi_slopes)
        ctx.params = params.with_alibi(None)
        ctx.set_materialize_grads(False)  # an unused LSE costs nothing in the backward
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        if dout is None:  # a loss of the LSE alone
            dout = torch.zeros_like(out)
        dq, dk, dv = _backend(q).bwd(dout.contiguous(), q, k, v, out, lse, ctx.params.with_alibi(alibi_slopes),
                                     dlse=dlse)
        return dq, dk, dv, None, None


@attention_forward.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # float32 LSE, except for float64 inputs, which the CPU path keeps in float64 (oracle use).
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=lse_dtype)
    return out, lse


@torch.library.custom_op("flashtile::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    dropout_p: float,
    seed: int,
    offset: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The Gluon backward adds dQ in no fixed order; ``deterministic`` makes dQ a pass whose programs own their rows.
    params = AttentionParams(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset,
                             deterministic)
    return _backend(q).bwd(dout, q, k, v, out, lse, params, dlse=dlse)


def backward(dout, q, k, v, out, lse, dlse, params: AttentionParams):
    """``flashtile::attention_backward`` with the arguments of ``params``: ``(dq, dk, dv)``."""
    return attention_backward(dout, q, k, v, out, lse, dlse, *params.op_args())


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, seed,
      offset, deterministic):
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )


def _save_params(ctx, scalars) -> Optional[torch.Tensor]:
    """Keep an op's scalar arguments (``AttentionParams.op_args`` order) on ``ctx`` as params
    without the ALiBi slopes, and return the slopes, for the caller to save as a tensor."""
    # The slopes are saved as a tensor (saved-tensor hooks and torch.compile see them), the
    # scalars on ctx; the seed and offset let the backward regenerate the same dropout mask.
    scale, left, right, softcap, alibi_slopes, *dropout_and_determinism = scalars
    ctx.params = AttentionParams(scale, left, right, softcap, None, *dropout_and_determinism)
    return alibi_slopes


def _saved_params(ctx, alibi_slopes) -> AttentionParams:
    return ctx.params.with_alibi(alibi_slopes)


def _setup_context(ctx, inputs, output):
    q, k, v, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, _save_params(ctx, scalars))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    # A loss that uses the LSE (return_lse=True) adds dlse_i * P_ij to dS_ij; it is folded
    # into the backward's per-row term D_i, so it costs nothing when absent.
    dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, dlse, _saved_params(ctx, alibi_slopes))
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# Packed variable-length batches
# --------------------------------------------------------------------------------------


@torch.library.custom_op("flashtile::varlen_attention_forward", mutates_args=())
def varlen_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    dropout_p: float,
    seed: int,
    offset: int,
    deterministic: bool,
    block_table: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # block_table: k, v are (num_blocks, page_size, nheads_k, d) pages (forward only).
    params = AttentionParams(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset,
                             deterministic)
    return _backend(q).varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, params, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_k=max_seqlen_k, block_table=block_table)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params: AttentionParams,
                   block_table=None):
    """``flashtile::varlen_attention_forward`` with the arguments of ``params``: ``(out, lse)``."""
    return varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    *params.op_args(), block_table)


@varlen_attention_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
      softcap, alibi_slopes, dropout_p, seed, offset, deterministic, block_table=None):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype))


@torch.library.custom_op("flashtile::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    dropout_p: float,
    seed: int,
    offset: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    params = AttentionParams(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset,
                             deterministic)
    return _backend(q).varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params, dlse=dlse,
                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def varlen_backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    params: AttentionParams):
    """``flashtile::varlen_attention_backward`` with the arguments of ``params``: ``(dq, dk, dv)``."""
    return varlen_attention_backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, *params.op_args())


@varlen_attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      window_left, window_right, softcap, alibi_slopes, dropout_p, seed, offset, deterministic):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, *scalars, block_table = inputs
    out, lse = output
    ctx.paged = block_table is not None
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, _save_params(ctx, scalars))
    ctx.max_seqlens = (max_q, max_k)


def _varlen_backward(ctx, dout, dlse):
    if ctx.paged:
        raise NotImplementedError("block_table: attention over paged keys and values is forward only")
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = varlen_backward(dout.contiguous(), q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.max_seqlens,
                                 _saved_params(ctx, alibi_slopes))
    return (dq, dk, dv) + (None,) * 14


varlen_attention_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)
