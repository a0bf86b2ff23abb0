"""The CPU attention path: PyTorch's fused CPU flash kernel where it computes exactly our
function, FlashAttention's tiled online softmax written with torch matmuls everywhere else.

This is what :func:`flashtile.flash_attn_func` runs on tensors that are not on a GPU.  Each
call picks an engine (:func:`engine_for`):

* ``fused``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), the
  kernel behind PyTorch's CPU SDPA: tiled, O(N) memory, multithreaded, and it returns the
  natural-log LSE ``(batch, nheads, seqlen_q)`` that ``return_lse`` and our backward use.  It
  masks top-left causally and knows no softcap, ALiBi, window or (our counter-based)
  dropout, so it serves only calls whose visible keys are, for every query row, all keys or
  a top-left causal prefix (bottom-right causal with ``seqlen_q >= seqlen_k``: the rows
  above the diagonal see nothing and get 0 / -inf here); GQA it takes natively.  Its
  backward has no LSE-gradient input, so a loss that uses the LSE goes to the tiled backward.
* ``tiled``: everything else, below.

The tiled engine is the same algorithm as the Triton kernels, one level up: instead of a (BLOCK_M x BLOCK_N)
tile in registers, a (block_m x block_n) chunk of scores lives in an ordinary tensor, and
the running row max ``m``, row sum ``l`` and un-normalised accumulator ``acc`` are updated
chunk by chunk.  No ``seqlen_q x seqlen_k`` tensor is ever allocated, forward or backward:
peak extra memory is O(batch * nheads * block_m * block_n), which
``benchmarks/bench_cpu_memory.py`` measures.

Layouts follow flash-attn: q ``(batch, seqlen_q, nheads, d)``, k/v ``(batch, seqlen_k,
nheads_k, d)``; LSE ``(batch, nheads, seqlen_q)`` float32, natural log.  Low-precision
inputs are computed in float32 and the output cast back; float64 inputs in float64 throughout.

Entry points: :func:`fwd`, :func:`bwd`, :func:`varlen_fwd` and :func:`varlen_bwd` take the
call's :class:`~flashtile.semantics.params.AttentionParams` (what the custom ops of
``flashtile.ops.attention`` pass); :func:`attention_forward` and the other ``*attention_*``
functions are the same with its fields as keyword arguments and dropout as one
``(p, seed, offset)``, for direct calls.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashtile.dropout import keep_mask
from flashtile.masking import is_masked, key_range, visible
from flashtile.semantics.params import AttentionParams
from flashtile.validation.attention import check_engine, check_fused_engine

BLOCK_M = 256
BLOCK_N = 512

_FUSED_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def fused_plan(q_shape, k_shape, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout=None):
    """``(first_row, is_causal)`` with which the fused kernel computes this call exactly, or None.

    Query rows ``< first_row`` see no key (they get output 0, LSE -inf); rows from
    ``first_row`` on are the kernel's problem with top-left ``is_causal``.  Query row ``i``
    sees keys ``j <= i + c`` with ``c = seqlen_k - seqlen_q + right`` (masking.visible):
    all keys when ``c >= seqlen_k - 1``, the top-left causal prefix when ``c == 0`` (and,
    for rows ``i >= -c``, when ``c < 0``); no single kernel call gives ``0 < c < seqlen_k - 1``.
    """
    if softcap > 0 or alibi_slopes is not None or dropout is not None:
        return None
    batch, seqlen_q, nheads = q_shape[0], q_shape[1], q_shape[2]
    seqlen_k = k_shape[1]
    if batch == 0 or nheads == 0 or seqlen_q == 0 or seqlen_k == 0:
        return None  # the kernel divides by these sizes (SIGFPE on empty inputs)
    if window_left >= 0 and window_left < seqlen_k - 1:
        return None  # a left edge that hides a key from some row
    if window_right < 0:
        return 0, False
    c = seqlen_k - seqlen_q + window_right
    if c >= seqlen_k - 1:
        return 0, False
    if c == 0:
        return 0, True
    if c < 0 and -c < seqlen_q:
        return -c, True
    return None


def engine_for(q_shape, k_shape, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout=None,
               dlse=None) -> str:
    """``"fused"`` where the fused kernel computes exactly this call (forward; with ``dlse``
    the backward), else ``"tiled"``."""
    if dlse is not None:
        return "tiled"
    plan = fused_plan(q_shape, k_shape, window_left, window_right, softcap, alibi_slopes, dropout)
    return "tiled" if plan is None else "fused"


def _check_engine(engine, q, k, params: AttentionParams, dlse=None):
    """The plan for ``engine`` (None: tiled); ``engine="fused"`` where it does not apply is an error."""
    check_engine(engine)
    if engine == "tiled":
        return None
    plan = None if dlse is not None else fused_plan(q.shape, k.shape, params.window_left, params.window_right,
                                                      params.softcap, params.alibi_slopes, params.dropout)
    check_fused_engine(engine, plan)
    return plan


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (b, n, h, d) -> (b, h, n, d), the kernel's layout, as a view


def _fused_forward(q, k, v, softmax_scale, plan):
    first, causal = plan
    # fp16 / bf16 inputs are upcast (O(N d) copies) to compute in float32: the kernel's own
    # reduced-precision path gives a less accurate LSE (~3e-5 off), and it is not faster.
    dtype = _compute_dtype(q.dtype)
    qs = q[:, first:] if first else q
    o, lse = _FUSED_FORWARD(*(_bhsd(t.to(dtype)) for t in (qs, k, v)), 0.0, causal, scale=softmax_scale)
    # The kernel writes (b, n, h, d) memory and returns its (b, h, n, d) view; its LSE is a
    # (b, n, h) buffer seen as (b, h, n).
    o, lse = _bhsd(o).to(q.dtype).contiguous(), lse.contiguous()
    if not first:
        return o, lse
    out = q.new_zeros(q.shape)
    out[:, first:] = o
    full = lse.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"))
    full[..., first:] = lse
    return out, full


def _fused_backward(dout, q, k, v, out, lse, softmax_scale, plan):
    first, causal = plan
    dtype = _compute_dtype(q.dtype)
    rows = slice(first, None)
    dq, dk, dv = _FUSED_BACKWARD(*(_bhsd(t.to(dtype)) for t in (dout[:, rows], q[:, rows], k, v, out[:, rows])),
                                 lse[..., rows], 0.0, causal, scale=softmax_scale)
    dq, dk, dv = (_bhsd(g).to(t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v)))
    if first:
        full = q.new_zeros(q.shape)
        full[:, first:] = dq
        dq = full
    return dq, dk, dv


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp16/bf16 are computed in fp32 like the GPU kernels; float64 stays float64.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _l2_bytes() -> int:
    """One core's L2 cache (Linux sysfs), 1 MiB where unknown."""
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (index / "level").read_text().strip() == "2":
                text = (index / "size").read_text().strip().upper()
                scale = {"K": 1024, "M": 1024**2}.get(text[-1], 1)
                return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return 1024**2


_L2_BYTES = _l2_bytes()


def default_blocks(rows: int, seqlen_q: int, seqlen_k: int, itemsize: int) -> tuple[int, int]:
    """(block_m, block_n) for the tiled engine: one score chunk, ``rows`` (batch x heads)
    matrices of block_m x block_n, about the size of the L2 caches of the threads that share
    it, so that the elementwise passes over it stay in cache while each Python-level step (a
    fixed ~10 us per op) covers as much work as the cache allows.  On 2 cores with 1 MiB of L2
    each this gives 512 x 512 for one head and 128 x 256 for 16, within ~10% of the best of a
    sweep from 128 x 256 to 1024 x 1024."""
    budget = _L2_BYTES * max(1, torch.get_num_threads()) // (itemsize * max(rows, 1))
    block_n = 512 if budget >= 512 * 256 else 256 if budget >= 256 * 128 else 128
    block_m = max(64, min(512, budget // block_n))
    block_m = 1 << (block_m.bit_length() - 1)  # a power of two
    return min(block_m, max(seqlen_q, 1)), min(block_n, max(seqlen_k, 1))


def _heads_first(x: torch.Tensor, nheads_k: int) -> torch.Tensor:
    """(b, n, h, d) -> (b, h_k, group, n, d) as a view: GQA without copying K/V."""
    b, n, h, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, nheads_k, h // nheads_k, n, d)


def _kv_rows(x: torch.Tensor, dtype) -> torch.Tensor:
    """(b, n, h_k, d) -> contiguous (b * h_k, n, d) in ``dtype``: one O(N d) copy (none for a
    contiguous single head already in ``dtype``) so that every chunk product is a plain bmm."""
    b, n, hk, d = x.shape
    return x.permute(0, 2, 1, 3).to(dtype).contiguous().view(b * hk, n, d)


def _q_rows(x5: torch.Tensor, q0: int, q1: int, dtype, scale=None) -> torch.Tensor:
    """Rows q0:q1 of a (b, h_k, g, n, d) view as a fresh contiguous (b * h_k, g * m, d): the
    query heads of a GQA group stacked along M share one product with their K/V head (and
    the products ds^T q, p^T dO sum over the group for free)."""
    b, hk, g, _, d = x5.shape
    c = x5[..., q0:q1, :].to(dtype, copy=True).contiguous()
    if scale is not None:
        c.mul_(scale)
    return c.view(b * hk, g * (q1 - q0), d)


def _chunk_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, left, right, device):
    i = torch.arange(q0, q1, device=device)[:, None]
    j = torch.arange(k0, k1, device=device)[None, :]
    return visible(i, j, seqlen_q, seqlen_k, left, right)


def _chunk_all_visible(q0, q1, k0, k1, seqlen_q, seqlen_k, left, right) -> bool:
    """Whether every (i, j) of the chunk is in the band (then no mask is needed)."""
    offset = seqlen_k - seqlen_q
    if right >= 0 and k1 - 1 > q0 + offset + right:
        return False
    if left >= 0 and k0 < q1 - 1 + offset - left:
        return False
    return True


def _slopes(alibi_slopes, batch, nheads_k, group, dtype):
    """ALiBi slopes (nheads,) or (batch, nheads) -> broadcastable (b|1, hk, g, 1, 1)."""
    if alibi_slopes is None:
        return None
    s = alibi_slopes.to(dtype)
    if s.dim() == 1:
        s = s.unsqueeze(0)
    return s.reshape(s.shape[0], nheads_k, group, 1, 1)


def _score_mods(s, q0, q1, k0, k1, seqlen_q, seqlen_k, softcap, slopes):
    """Softcap then ALiBi on a (b, hk, g, m, n) chunk of scaled scores, in place (SEMANTICS
    order). Returns (s, tanh or None)."""
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = torch.mul(t, softcap, out=s)
    if slopes is not None:
        i = torch.arange(q0, q1, device=s.device)[:, None]
        j = torch.arange(k0, k1, device=s.device)[None, :]
        s.sub_(slopes * (i + (seqlen_k - seqlen_q) - j).abs().to(s.dtype))
    return s, t


def _rng_head_rows(batch, nheads_k, group, seqlen_q, rng_rows, device):
    """First dropout-RNG row of every (batch, head), shaped (b, hk, g, 1, 1): LSE-row numbering.

    ``rng_rows = (batch stride, head stride, base, columns)``; dense calls use
    ``(nheads * seqlen_q, seqlen_q, 0, seqlen_k)``, see ``flashtile.dropout``.
    """
    sb, sh, base, _ = rng_rows
    b = torch.arange(batch, device=device).reshape(batch, 1, 1, 1, 1)
    h = torch.arange(nheads_k * group, device=device).reshape(1, nheads_k, group, 1, 1)
    return b * sb + h * sh + base


def _dropout_factor(dropout, head_rows, rng_rows, q0, q1, k0, k1, dtype):
    """1 / (1 - p) where kept, 0 where dropped, for a chunk; the kernels' mask exactly."""
    p, seed, offset = dropout
    rows = head_rows + torch.arange(q0, q1, device=head_rows.device)[:, None]
    cols = torch.arange(k0, k1, device=head_rows.device)
    keep = keep_mask(seed, offset, rows, cols, rng_rows[3], p)
    return keep.to(dtype) * (1.0 / (1.0 - p))


def _key_chunks(q0, q1, seqlen_q, seqlen_k, left, right, block_n):
    lo, hi = key_range(q0, q1, seqlen_q, seqlen_k, left, right)
    for k0 in range(lo - lo % block_n, hi, block_n):  # chunk starts aligned to block_n
        yield max(k0, lo), min(k0 + block_n, hi)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    block_m: int | None = None,
    block_n: int | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout: tuple | None = None,
    rng_rows: tuple | None = None,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout)
    return fwd(q, k, v, params, block_m=block_m, block_n=block_n, rng_rows=rng_rows, engine=engine)


def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: AttentionParams,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    rng_rows: tuple | None = None,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward. Returns ``out`` (like q) and ``lse`` (batch, nheads, seqlen_q), float32
    (float64 for float64 inputs).  ``engine``: ``"auto"`` (the fused kernel where it applies),
    ``"fused"`` (an error where it does not) or ``"tiled"``; ``block_m`` / ``block_n`` are the
    tiled engine's chunk sizes (default: :func:`default_blocks`); ``rng_rows``: the dropout
    RNG's row numbering (see :func:`_rng_head_rows`; default: the dense LSE's)."""
    plan = _check_engine(engine, q, k, params)
    if plan is not None:
        return _fused_forward(q, k, v, params.softmax_scale, plan)
    softmax_scale, window_left, window_right = params.softmax_scale, params.window_left, params.window_right
    softcap, alibi_slopes, dropout = params.softcap, params.alibi_slopes, params.dropout
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    masked = is_masked(window_left, window_right)
    acc_dtype = _compute_dtype(q.dtype)
    rows = batch * nheads_k
    dm, dn = default_blocks(batch * nheads, seqlen_q, seqlen_k, torch.empty((), dtype=acc_dtype).element_size())
    block_m, block_n = block_m or dm, block_n or dn

    slopes = _slopes(alibi_slopes, batch, nheads_k, group, acc_dtype)
    if dropout is not None:
        rng_rows = rng_rows or (nheads * seqlen_q, seqlen_q, 0, seqlen_k)
        head_rows = _rng_head_rows(batch, nheads_k, group, seqlen_q, rng_rows, q.device)
    qh = _heads_first(q, nheads_k)  # (b, hk, g, nq, d) view
    kr, vr = _kv_rows(k, acc_dtype), _kv_rows(v, acc_dtype)  # (b * hk, nk, d)

    out = torch.empty(batch, nheads_k, group, seqlen_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, nheads_k, group, seqlen_q, dtype=acc_dtype, device=q.device)

    for q0 in range(0, seqlen_q, block_m):
        q1 = min(q0 + block_m, seqlen_q)
        m_rows = group * (q1 - q0)
        qc = _q_rows(qh, q0, q1, acc_dtype, softmax_scale)  # scaled once per Q chunk, not per score
        m = torch.full((rows, m_rows), float("-inf"), dtype=acc_dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(rows, m_rows, d, dtype=acc_dtype, device=q.device)
        for k0, k1 in _key_chunks(q0, q1, seqlen_q, seqlen_k, window_left, window_right, block_n):
            s = torch.bmm(qc, kr[:, k0:k1].transpose(1, 2))  # (b * hk, g * m, n)
            s5 = s.view(batch, nheads_k, group, q1 - q0, k1 - k0)
            _score_mods(s5, q0, q1, k0, k1, seqlen_q, seqlen_k, softcap, slopes)
            if masked and not _chunk_all_visible(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right):
                s5.masked_fill_(~_chunk_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right, q.device),
                                float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen only masked keys keeps m = -inf; shift by 0 instead so that
            # exp(-inf - (-inf)) = NaN never appears and its p stays exactly 0.
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p = s.sub_(m_safe[..., None]).exp_()
            alpha = torch.exp(m - m_safe)
            l.mul_(alpha).add_(p.sum(dim=-1))  # the denominator counts dropped entries too
            if dropout is not None:
                p.view(s5.shape).mul_(_dropout_factor(dropout, head_rows, rng_rows, q0, q1, k0, k1, acc_dtype))
            acc.mul_(alpha[..., None]).baddbmm_(p, vr[:, k0:k1])
            m = m_new
        empty = l == 0
        # Deferred normalisation: one division per row at the end, not one per chunk.  A row
        # with no visible key gives 0 by selection: its acc may hold 0 * inf = NaN from a
        # masked key's V.
        o = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, l)[..., None])
        out[..., q0:q1, :] = o.view(batch, nheads_k, group, q1 - q0, d)
        lse[..., q0:q1] = torch.where(empty, float("-inf"), m + torch.log(l)).view(batch, nheads_k, group, q1 - q0)
    return (
        out.reshape(batch, nheads, seqlen_q, d).permute(0, 2, 1, 3).contiguous(),
        lse.reshape(batch, nheads, seqlen_q),
    )


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    block_m: int | None = None,
    block_n: int | None = None,
    dlse: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout: tuple | None = None,
    rng_rows: tuple | None = None,
    deterministic: bool = False,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`bwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout,
                                           deterministic)
    return bwd(dout, q, k, v, out, lse, params, dlse=dlse, block_m=block_m, block_n=block_n, rng_rows=rng_rows,
               engine=engine)


def bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    params: AttentionParams,
    *,
    dlse: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    rng_rows: tuple | None = None,
    engine: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward by recomputation: P is rebuilt block by block from Q, K and the LSE (either
    engine's LSE: both are the natural-log LSE of the same scores).

    Always deterministic (no atomics, fixed reduction orders), so ``params.deterministic``
    changes nothing here.  The other arguments as in :func:`fwd`."""
    if dlse is not None and not bool(dlse.any()):
        dlse = None  # autograd hands an unused LSE's gradient over as zeros
    plan = _check_engine(engine, q, k, params, dlse)
    if plan is not None:
        return _fused_backward(dout, q, k, v, out, lse, params.softmax_scale, plan)
    softmax_scale, window_left, window_right = params.softmax_scale, params.window_left, params.window_right
    softcap, alibi_slopes, dropout = params.softcap, params.alibi_slopes, params.dropout
    batch, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    masked = is_masked(window_left, window_right)
    acc_dtype = _compute_dtype(q.dtype)
    rows = batch * nheads_k
    dm, dn = default_blocks(batch * nheads, seqlen_q, seqlen_k, torch.empty((), dtype=acc_dtype).element_size())
    block_m, block_n = block_m or dm, block_n or dn

    slopes = _slopes(alibi_slopes, batch, nheads_k, group, acc_dtype)
    if dropout is not None:
        rng_rows = rng_rows or (nheads * seqlen_q, seqlen_q, 0, seqlen_k)
        head_rows = _rng_head_rows(batch, nheads_k, group, seqlen_q, rng_rows, q.device)
    qh = _heads_first(q, nheads_k)
    doh = _heads_first(dout, nheads_k)
    oh = _heads_first(out, nheads_k)
    kr, vr = _kv_rows(k, acc_dtype), _kv_rows(v, acc_dtype)
    lseh = lse.reshape(batch, nheads_k, group, seqlen_q)
    dlseh = None if dlse is None else dlse.reshape(batch, nheads_k, group, seqlen_q).to(acc_dtype)

    dq = torch.empty(batch, nheads_k, group, seqlen_q, d, dtype=acc_dtype, device=q.device)
    # dK/dV are summed over the query heads of a GQA group, which the (g * m)-row products
    # below do by themselves.
    dk = torch.zeros(rows, seqlen_k, d, dtype=acc_dtype, device=q.device)
    dv = torch.zeros_like(dk)

    def rows_of(x4, q0, q1):  # (b, hk, g, n) -> (b * hk, g * m)
        return x4[..., q0:q1].reshape(rows, group * (q1 - q0))

    for q0 in range(0, seqlen_q, block_m):
        q1 = min(q0 + block_m, seqlen_q)
        # Scale q once, exactly as the forward did, so the recomputed P matches its rounding.
        qc = _q_rows(qh, q0, q1, acc_dtype, softmax_scale)
        doc = _q_rows(doh, q0, q1, acc_dtype)
        # D_i = rowsum(dO_i * O_i) = rowsum(P_i * dP_i): the softmax Jacobian's correction term.
        delta = (doc * _q_rows(oh, q0, q1, acc_dtype)).sum(dim=-1)
        if dlseh is not None:  # d lse_i / d s_ij = P_ij, so a gradient on the LSE shifts D_i
            delta = delta - rows_of(dlseh, q0, q1)
        lse_c = rows_of(lseh, q0, q1).to(acc_dtype)
        # Rows with no visible key have lse = -inf; exp(s - (-inf)) would be inf, so shift
        # them by +inf instead, which makes their recomputed P exactly 0.
        lse_safe = torch.where(lse_c == float("-inf"), float("inf"), lse_c)
        dqc = torch.zeros_like(qc)
        for k0, k1 in _key_chunks(q0, q1, seqlen_q, seqlen_k, window_left, window_right, block_n):
            kc, vc = kr[:, k0:k1], vr[:, k0:k1]
            s = torch.bmm(qc, kc.transpose(1, 2))
            s5 = s.view(batch, nheads_k, group, q1 - q0, k1 - k0)
            _, tanh = _score_mods(s5, q0, q1, k0, k1, seqlen_q, seqlen_k, softcap, slopes)
            if masked and not _chunk_all_visible(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right):
                s5.masked_fill_(~_chunk_mask(q0, q1, k0, k1, seqlen_q, seqlen_k, window_left, window_right, q.device),
                                float("-inf"))
            p = s.sub_(lse_safe[..., None]).exp_()
            dp = torch.bmm(doc, vc.transpose(1, 2))
            if dropout is not None:
                drop = _dropout_factor(dropout, head_rows, rng_rows, q0, q1, k0, k1, acc_dtype)
                dv[:, k0:k1].baddbmm_((p.view(s5.shape) * drop).view(p.shape).transpose(1, 2), doc)
                dp.view(s5.shape).mul_(drop)
            else:
                dv[:, k0:k1].baddbmm_(p.transpose(1, 2), doc)
            ds = dp.sub_(delta[..., None]).mul_(p)
            if tanh is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2
                ds.view(s5.shape).mul_(1 - tanh * tanh)
            dqc.baddbmm_(ds, kc)
            dk[:, k0:k1].baddbmm_(ds.transpose(1, 2), qc)  # qc carries the scale
        dq[..., q0:q1, :] = dqc.mul_(softmax_scale).view(batch, nheads_k, group, q1 - q0, d)

    def back(x, dtype, heads):
        n, dd = x.shape[-2], x.shape[-1]
        return x.reshape(batch, heads, n, dd).permute(0, 2, 1, 3).to(dtype).contiguous()

    return back(dq, q.dtype, nheads), back(dk, k.dtype, nheads_k), back(dv, v.dtype, nheads_k)


# ----------------------------------------------------------------------------------------
# Packed variable-length batches: the same tiled algorithm per sequence
# ----------------------------------------------------------------------------------------


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        yield b, cq[b], cq[b + 1], ck[b], ck[b + 1]


def _sequence_params(params: AttentionParams, b: int) -> AttentionParams:
    """Sequence ``b``'s params: its row of ``(batch, nheads)`` ALiBi slopes; the rest shared."""
    slopes = params.alibi_slopes
    return params if slopes is None or slopes.dim() == 1 else params.with_alibi(slopes[b])


def _varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k):
    # Packed LSE rows: head * total_q + token; columns: max_seqlen_k, as the kernels count them.
    if max_seqlen_k is None:
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        max_seqlen_k = int(lens.max()) if lens.numel() else 0
    return (0, q.shape[0], q0, max_seqlen_k)


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1, window_right=-1,
                             softcap=0.0, alibi_slopes=None, dropout=None, max_seqlen_q=None, max_seqlen_k=None,
                             block_table=None):
    """:func:`varlen_fwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout)
    return varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, params, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, block_table=block_table)


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, params: AttentionParams, *, max_seqlen_q=None, max_seqlen_k=None,
               block_table=None):
    """Packed ``(total, nheads, d)`` forward; LSE ``(nheads, total_q)``.  With ``block_table``,
    k / v are ``(num_blocks, page_size, nheads_k, d)`` pages, gathered into packed rows first."""
    if block_table is not None:
        k, v = _gather_pages(k, block_table, cu_seqlens_k), _gather_pages(v, block_table, cu_seqlens_k)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_compute_dtype(q.dtype), device=q.device)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        o, l = fwd(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], _sequence_params(params, b),
                   rng_rows=_varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k))
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def _gather_pages(cache, block_table, cu_seqlens_k):
    """Paged ``(num_blocks, page_size, h, d)`` keys -> packed ``(total_k, h, d)`` rows in
    cu_seqlens_k's order (sequence b's key j: page ``block_table[b, j // page_size]``)."""
    page_size = cache.shape[1]
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    rows = [block_table[b, torch.arange(n) // page_size].long() * page_size + torch.arange(n) % page_size
            for b, n in enumerate(lens)]
    flat = cache.reshape(-1, *cache.shape[2:])
    return flat[torch.cat(rows)] if rows else flat[:0]


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left=-1,
                              window_right=-1, softcap=0.0, alibi_slopes=None, dlse=None, dropout=None,
                              max_seqlen_q=None, max_seqlen_k=None, deterministic=False):
    """:func:`varlen_bwd` with the params as arguments; ``dropout``: ``(p, seed, offset)`` or None."""
    params = AttentionParams.from_launcher(softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout,
                                           deterministic)
    return varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params, dlse=dlse,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params: AttentionParams, *, dlse=None,
               max_seqlen_q=None, max_seqlen_k=None):
    """Packed backward: each sequence through :func:`bwd` on its own rows."""
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    for b, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        g = bwd(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            lse[None, :, q0:q1], _sequence_params(params, b), dlse=None if dlse is None else dlse[None, :, q0:q1],
            rng_rows=_varlen_rng_rows(q, cu_seqlens_k, q0, max_seqlen_k),
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv
