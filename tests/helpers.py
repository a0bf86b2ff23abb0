"""Shared test helpers: a plain PyTorch attention oracle, flash-attn's tolerance rule, inputs.

Used by the CPU-path tests and the Triton kernel tests alike, so nothing here assumes a
device: every helper takes tensors on any device (CPU, CUDA, or the Triton interpreter's
CPU tensors).

Layout is flash-attn's: ``q (batch, seqlen_q, nheads, headdim)``, ``k, v (batch, seqlen_k,
nheads_k, headdim)``; LSE ``(batch, nheads, seqlen_q)``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import torch

from flashtile.masking import mask_array, normalize_window

__all__ = [
    "reference_attention",
    "reference_attention_grads",
    "assert_close_to_reference",
    "max_abs_diff",
    "random_qkv",
    "random_like",
    "default_scale",
]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    upcast: bool = True,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
):
    """Naive materialising attention in plain PyTorch, differentiable by torch autograd.

    Scores follow docs/semantics.md's order: scale, then ``softcap * tanh(s / softcap)`` when
    ``softcap > 0``, then minus ``slope[b, h] * |i + seqlen_k - seqlen_q - j|`` for ALiBi
    slopes ``(nheads,)`` or ``(batch, nheads)``, then the masks.

    Computes in float64 when ``upcast`` (the oracle), otherwise in the inputs' own dtype
    (like flash-attn's ``attention_ref(..., upcast=False)``: the error of that result against
    the float64 one is "PyTorch's own error" at that precision, the yardstick of
    :func:`assert_close_to_reference`).

    GQA/MQA: kv head ``h // (nheads // nheads_k)`` serves query head ``h``
    (``repeat_interleave``).  Masks are flashtile's bottom-right causal / sliding window
    (:func:`flashtile.masking.mask_array`).

    Returns ``(out, lse)`` in the compute dtype (float64 when ``upcast``):
    ``out (batch, seqlen_q, nheads, headdim)``, ``lse (batch, nheads, seqlen_q)``.  A query
    row with no visible key gets ``out`` 0 and ``lse`` ``-inf``, and -- because the
    formulation uses ``torch.where`` rather than a softmax over an all ``-inf`` row, which
    is NaN in torch -- finite, zero gradients.  Inf/NaN *inputs* propagate exactly as in a
    textbook ``softmax(q k^T) v``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("reference_attention expects 4-D (batch, seqlen, nheads, headdim) tensors")
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    if softmax_scale is None:
        softmax_scale = headdim ** -0.5
    group = nheads // nheads_k
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=dtype).reshape(-1, nheads, 1, 1)
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores - slopes * (i + (seqlen_k - seqlen_q) - j).abs().to(dtype)
    left, right = normalize_window(causal, window_size)
    # mask_array returns a (1, seqlen_k) row when the band is unbounded on both sides: expand.
    mask = mask_array(seqlen_q, seqlen_k, left, right, xp=torch, device=q.device).expand(seqlen_q, seqlen_k)
    row_empty = ~mask.any(dim=-1)  # (nq,)
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=q.device)
    zero = torch.tensor(0.0, dtype=dtype, device=q.device)
    scores = torch.where(mask, scores, neg_inf)
    # Rows with no visible key: replace the whole row by zeros so softmax / logsumexp see a
    # finite row, then overwrite the results; the `where`s route zero gradient to them.
    scores = torch.where(row_empty[:, None], zero, scores)
    lse = torch.logsumexp(scores, dim=-1)
    lse = torch.where(row_empty, neg_inf, lse)
    p = torch.softmax(scores, dim=-1)
    p = torch.where(row_empty[:, None], zero, p)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


# The score tensor's size above which reference_attention_grads splits the heads.
REFERENCE_CHUNK_BYTES = 2**30


def reference_attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None = None,
    upcast: bool = True,
    **kwargs,
):
    """Forward and backward of :func:`reference_attention` on detached leaf copies.

    The copies are made in the compute dtype (float64 when ``upcast``), so the returned
    gradients are *not* rounded back to the inputs' dtype.  ``dlse`` (optional) is the
    gradient flowing into the LSE.  Returns ``(out, lse, dq, dk, dv)``.

    Heads are independent, so a problem whose score tensor would pass
    ``REFERENCE_CHUNK_BYTES`` runs a few KV heads (with their query heads) at a time: the
    autograd graph holds several score-sized tensors, and GPU tests run side by side.
    """
    nheads_k = k.shape[2]
    group = q.shape[2] // max(nheads_k, 1)
    score_bytes = q.shape[0] * group * q.shape[1] * k.shape[1] * (8 if upcast else q.element_size())
    per_chunk = max(1, REFERENCE_CHUNK_BYTES // max(score_bytes, 1))
    if nheads_k <= per_chunk:
        return _reference_attention_grads(q, k, v, dout, dlse, upcast, **kwargs)
    slopes = kwargs.pop("alibi_slopes", None)
    parts = []
    for h in range(0, nheads_k, per_chunk):
        kv, rows = slice(h, h + per_chunk), slice(h * group, (h + per_chunk) * group)
        chunk_slopes = None if slopes is None else slopes[..., rows]
        parts.append(_reference_attention_grads(q[:, :, rows], k[:, :, kv], v[:, :, kv], dout[:, :, rows],
                                                None if dlse is None else dlse[:, rows], upcast,
                                                alibi_slopes=chunk_slopes, **kwargs))
    out, lse, dq, dk, dv = zip(*parts)
    return torch.cat(out, 2), torch.cat(lse, 1), torch.cat(dq, 2), torch.cat(dk, 2), torch.cat(dv, 2)


def _reference_attention_grads(q, k, v, dout, dlse, upcast, **kwargs):
    dtype = torch.float64 if upcast else q.dtype
    qr, kr, vr = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out, lse = reference_attention(qr, kr, vr, upcast=upcast, **kwargs)
    outputs, grads = [out], [dout.to(dtype)]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.to(dtype))
    dq, dk, dv = torch.autograd.grad(outputs, (qr, kr, vr), grads)
    return out.detach(), lse.detach(), dq, dk, dv


def assert_packed_grads_match_per_sequence(lens, nheads, nheads_k, headdim, causal, atol_floor=1e-2, **kw):
    """``flash_attn_varlen_func``'s gradients on a packed bf16 CUDA batch of sequences of lengths
    ``lens`` (zero-length ones allowed) against each sequence's float64 reference (flash-attn's
    rule); ``kw`` goes to the varlen call (e.g. ``deterministic``)."""
    import flashtile

    total = sum(lens)
    q, k, v = random_qkv(1, total, total, nheads, nheads_k, headdim, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t[0].requires_grad_(True) for t in (q, k, v))
    dout = random_like(q, seed=3)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b, n in enumerate(lens):
        s, e = int(cu[b]), int(cu[b + 1])
        if n == 0:
            continue
        parts = [t[None, s:e].detach().requires_grad_(True) for t in (q, k, v)]
        ref = reference_attention_grads(*parts, dout[None, s:e], causal=causal)
        low = reference_attention_grads(*parts, dout[None, s:e], upcast=False, causal=causal)
        for name, g, r64, rlow in zip(("dq", "dk", "dv"), grads, ref[2:], low[2:]):
            assert_close_to_reference(g[None, s:e], r64, rlow, f"{name} of sequence {b}", atol_floor=atol_floor)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` in float64; 0 for empty tensors."""
    if a.numel() == 0:
        return 0.0
    return (a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs().max().item()


def assert_close_to_reference(
    out: torch.Tensor,
    ref64: torch.Tensor,
    ref_lowp: torch.Tensor,
    name: str = "out",
    atol_floor: float = 1e-5,
    factor: float = 2.0,
) -> None:
    """flash-attn's accuracy rule: ``max|out - ref64| <= factor * max|ref_lowp - ref64| + atol_floor``.

    ``ref64`` is the float64 oracle, ``ref_lowp`` the same naive computation done in the
    tested precision (PyTorch's own error at that precision).  All three must be finite
    (a NaN would make every comparison false and hide the failure).
    """
    if out.shape != ref64.shape or ref_lowp.shape != ref64.shape:
        raise AssertionError(
            f"{name}: shape mismatch: got {tuple(out.shape)}, ref64 {tuple(ref64.shape)}, "
            f"ref_lowp {tuple(ref_lowp.shape)}"
        )
    for label, t in (("output", out), ("ref64", ref64), ("ref_lowp", ref_lowp)):
        if not torch.isfinite(t).all():
            raise AssertionError(f"{name}: {label} has {int((~torch.isfinite(t)).sum())} non-finite entries")
    err = max_abs_diff(out, ref64)
    base = max_abs_diff(ref_lowp, ref64)
    bound = factor * base + atol_floor
    if not err <= bound:
        raise AssertionError(
            f"{name}: max|out - ref64| = {err:.3e} exceeds {factor} * max|ref_lowp - ref64| "
            f"({base:.3e}) + {atol_floor:.1e} = {bound:.3e} "
            f"(out dtype {out.dtype}, max|ref64| = {ref64.abs().max().item():.3e})"
        )


def random_qkv(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    headdim: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    requires_grad: bool = False,
    seed: int = 0,
):
    """Reproducible standard-normal ``q, k, v`` in flash-attn layout.

    Drawn in float32 on the CPU from a seeded generator (the same numbers on every device
    and for every dtype, up to the final rounding), then cast and moved.  With
    ``requires_grad`` each is a leaf that requires grad.
    """
    gen = torch.Generator().manual_seed(seed)

    def make(n, h):
        t = torch.randn(batch, n, h, headdim, generator=gen, dtype=torch.float32)
        return t.to(dtype=dtype, device=device).requires_grad_(requires_grad)

    return make(seqlen_q, nheads), make(seqlen_k, nheads_k), make(seqlen_k, nheads_k)


def random_like(t: torch.Tensor, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    """A seeded standard-normal tensor shaped and typed like ``t`` (e.g. an upstream gradient)."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(t.shape, generator=gen, dtype=torch.float32) * scale
    return r.to(dtype=t.dtype, device=t.device)


def default_scale(headdim: int) -> float:
    return 1.0 / math.sqrt(headdim)


def is_hopper() -> bool:
    """An sm_90 GPU (H100 / H200): the Gluon kernels' target."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# --- Stubbed-GPU host-path tests ---------------------------------------------------------
# The stubs (benchmarks/profile_host_cpu.py) patch process-wide state (torch.Tensor.is_cuda,
# Triton's launch, device queries) and leave compiled-kernel caches behind them, so a process
# that also runs real kernels -- the interpreter's, or a GPU's -- runs them in a child without
# either (TRITON_INTERPRET=0; nothing is compiled, the launches are stubbed).


def stubs_in_child() -> bool:
    """Whether this process runs real kernels, so the stubbed tests go to a child."""
    from flashtile.kernels.runtime import INTERPRET

    return INTERPRET or torch.cuda.is_available()


def run_stubbed_tests_in_child(path: str, *select: str) -> str:
    """pytest on ``path`` (``select``: more pytest arguments) in a child without the interpreter
    or a GPU; asserts it passed and returns its summary line."""
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, *select], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout.splitlines()[-1]
