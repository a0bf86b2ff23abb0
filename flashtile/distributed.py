"""Context-parallel (ring) attention over ``torch.distributed``: one sequence sharded across ranks.

Each rank holds a shard of the sequence, ``(batch, seqlen / world, nheads, d)`` (packed
batches: every sequence's share, see :func:`ring_flash_attn_varlen_func`).  The K/V shards
travel around the ring: at step ``s`` rank ``r`` holds the K/V of rank ``r - s``, and it
posts the transfer of that shard to ``r + 1`` (``batch_isend_irecv``: one ``isend`` and one
``irecv`` per tensor, grouped) *before* attending its queries to it, so the transfer runs
while the block is computed.  Each step's partial ``(out, lse)`` is merged into a float32
accumulator by the rule of :func:`flashtile.merging.merge_attention_states` (the online-softmax
rule, applied in place), so the result is exact.

The backward recomputes each block from the saved output and *global* LSE (the
single-device backward, block by block).  K/V travel around the ring again, and the dK/dV
accumulated for a shard travel one step behind it (float32): after its own block, a rank
adds its contribution to the dK/dV it received for that shard and sends them on, the
transfer overlapping the next block; after ``world`` hops they are back with their owner.
dQ stays local.

Causal load balance ("zigzag"): with ``2 * world`` equal chunks, rank ``r`` holds chunks ``r``
and ``2 * world - 1 - r`` (:func:`zigzag_shard` / :func:`zigzag_unshard`), so every rank has
the same unmasked work.  Each step is then one kernel call: the own shard causally; an
earlier rank's shard: all queries against its first chunk (its second chunk is entirely in
the future); a later rank's shard: the second query chunk against all of it.  Without zigzag,
steps whose block is entirely masked (a later rank's keys) are skipped.

``mode="allgather"`` gathers every K/V shard once instead (asynchronously, overlapped with
the local block) and reduce-scatters dK/dV in the backward: fewer, larger messages, ``world``
times the K/V memory -- the better choice for small worlds or short shards.

Works with NCCL on GPUs (the Triton kernels) and gloo on CPUs (the PyTorch path).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from flashtile.ops import attention as _ops
from flashtile import validation
from flashtile.semantics.params import AttentionParams

__all__ = [
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "varlen_local_cu_seqlens",
    "varlen_shard",
    "varlen_unshard",
    "zigzag_shard",
    "zigzag_unshard",
]

_KV_TAG, _GRAD_TAG = 0, 1  # distinct tags: K/V and dK/dV messages never pair up by mistake (gloo)


# ----------------------------------------------------------------------------------------
# Sharding
# ----------------------------------------------------------------------------------------


def _chunk_ids(rank: int, world: int, zigzag: bool) -> list[int]:
    """Global chunk indices held by ``rank``: ``world`` chunks in all, or ``2 * world`` for zigzag."""
    return [rank, 2 * world - 1 - rank] if zigzag else [rank]


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag shard of a full sequence: chunks ``rank`` and ``2 * world - 1 - rank``
    of ``2 * world`` equal chunks along ``dim`` (the sequence dim; 2 for a dense LSE)."""
    validation.check_rank_world(rank, world)
    validation.check_zigzag_length(x.shape[dim], world)
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[i] for i in _chunk_ids(rank, world, True)], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Reassemble the full sequence from every rank's zigzag shard (in rank order)."""
    world = len(shards)
    chunks = [None] * (2 * world)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * world - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _varlen_rows(cu: list[int], rank: int, world: int, zigzag: bool) -> torch.Tensor:
    """Global packed rows held by ``rank``, in local order: for each sequence, its chunks."""
    n = validation.check_shardable_lengths("cu_seqlens", cu, world, zigzag)
    pieces = []
    for start, end in itertools.pairwise(cu):
        c = (end - start) // n
        pieces += [torch.arange(start + i * c, start + (i + 1) * c) for i in _chunk_ids(rank, world, zigzag)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def varlen_shard(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world: int, zigzag: bool = True,
                 dim: int = 0) -> torch.Tensor:
    """This rank's shard of a packed batch ``x`` (rows along ``dim``: 0 for q/k/v, 1 for an LSE).

    ``cu_seqlens`` describes the *full* batch.  Every sequence is cut into ``2 * world`` equal
    chunks (``world`` without ``zigzag``); the shard is, sequence after sequence, chunks
    ``rank`` and ``2 * world - 1 - rank`` (chunk ``rank``): a packed batch of the same sequences,
    each ``1 / world`` as long, described by :func:`varlen_local_cu_seqlens`.
    """
    validation.check_rank_world(rank, world)
    rows = _varlen_rows(validation.host_cu_seqlens("cu_seqlens", cu_seqlens), rank, world, zigzag)
    return x.index_select(dim, rows.to(x.device))


def varlen_unshard(shards: list[torch.Tensor], cu_seqlens: torch.Tensor, zigzag: bool = True,
                   dim: int = 0) -> torch.Tensor:
    """Reassemble the full packed batch from every rank's :func:`varlen_shard` (in rank order)."""
    world = len(shards)
    cu = validation.host_cu_seqlens("cu_seqlens", cu_seqlens)
    shape = list(shards[0].shape)
    shape[dim] = cu[-1]
    out = shards[0].new_empty(shape)
    for rank, shard in enumerate(shards):
        out.index_copy_(dim, _varlen_rows(cu, rank, world, zigzag).to(out.device), shard)
    return out


def varlen_local_cu_seqlens(cu_seqlens: torch.Tensor, world: int) -> torch.Tensor:
    """The ``cu_seqlens`` of one rank's shard: every sequence ``1 / world`` as long."""
    return torch.div(cu_seqlens, world, rounding_mode="floor").to(cu_seqlens.dtype)


# ----------------------------------------------------------------------------------------
# Which block a step computes
# ----------------------------------------------------------------------------------------

_ALL, _FRONT, _BACK = "all", "front", "back"  # rows of a shard: all, its first / second chunk


def _plan(rank: int, src: int, causal: bool, zigzag: bool):
    """``(query rows, key rows, causal mask?)`` of this rank against ``src``'s K/V; None: all masked."""
    if not causal:
        return _ALL, _ALL, False
    if src == rank:  # zigzag: chunk r then chunk 2w-1-r, both sides -- a plain causal block
        return _ALL, _ALL, True
    if zigzag:  # earlier rank: its first chunk precedes both of ours, its second follows both
        return (_ALL, _FRONT, False) if src < rank else (_BACK, _ALL, False)
    return (_ALL, _ALL, False) if src < rank else None


def _merge_into(out, lse, o, l):
    """``(out, lse) <- merge((out, lse), (o, l))`` in place: :func:`flashtile.merge_attention_states`'s
    rule (an empty part, LSE -inf, contributes nothing; two empty parts give 0 and -inf), in float32
    without its temporaries -- ``out`` and ``lse`` are float32 accumulators (or views of them)."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(new == float("-inf"), 0.0, new)  # both parts empty: no -inf - -inf

    def weight(x):
        return torch.exp(x - safe).transpose(-1, -2).unsqueeze(-1)  # (.., heads, seq) -> (.., seq, heads, 1)

    out.mul_(weight(lse)).addcmul_(o, weight(l))
    lse.copy_(new)


def _block_params(scale: float) -> dict[bool, AttentionParams]:
    """A block's params by its causal flag: the full or the causal band, nothing else (ring
    attention takes no window, softcap, ALiBi or dropout)."""
    return {False: AttentionParams.full(scale), True: AttentionParams.causal(scale)}


class _Dense:
    """Blocks of dense ``(batch, seqlen, heads, d)`` shards; chunks are views."""

    seq_dim, lse_dim = 1, 2

    def __init__(self, scale):
        self.params = _block_params(scale)

    def rows(self, x, part, dim):
        if part == _ALL or x is None:
            return x
        half = x.shape[dim] // 2
        return x.narrow(dim, 0 if part == _FRONT else half, half)

    def merge(self, out, lse, part, o, l):
        _merge_into(self.rows(out, part, self.seq_dim), self.rows(lse, part, self.lse_dim), o, l)

    def add(self, acc, part, dim, value):
        self.rows(acc, part, dim).add_(value)

    def fwd(self, q, k, v, q_part, k_part, causal):
        return _ops.forward(q, k, v, self.params[causal])

    def bwd(self, dout, q, k, v, out, lse, dlse, q_part, k_part, causal):
        return _ops.backward(dout, q, k, v, out, lse, dlse, self.params[causal])


class _Varlen:
    """Blocks of packed ``(total, heads, d)`` shards; a chunk is every sequence's first or
    second half (gathered rows), described by its own ``cu_seqlens``."""

    seq_dim, lse_dim = 0, 1

    def __init__(self, scale, cu_q, cu_k, max_q, max_k, halves):
        self.params = _block_params(scale)
        self.cu = {"q": cu_q, "k": cu_k}
        self.max = {"q": max_q, "k": max_k}
        self.halves = halves  # (cu_half, max_half, front_rows, back_rows) for causal zigzag

    def _idx(self, part):
        return self.halves[2] if part == _FRONT else self.halves[3]

    def rows(self, x, part, dim):
        if part == _ALL or x is None:
            return x
        return x.index_select(dim, self._idx(part))

    def merge(self, out, lse, part, o, l):
        if part == _ALL:
            _merge_into(out, lse, o, l)
            return
        rows_out, rows_lse = self.rows(out, part, self.seq_dim), self.rows(lse, part, self.lse_dim)
        _merge_into(rows_out, rows_lse, o, l)
        out.index_copy_(self.seq_dim, self._idx(part), rows_out)
        lse.index_copy_(self.lse_dim, self._idx(part), rows_lse)

    def add(self, acc, part, dim, value):
        if part == _ALL:
            acc.add_(value)
        else:
            acc.index_add_(dim, self._idx(part), value)

    def _seq(self, side, part):
        return (self.cu[side], self.max[side]) if part == _ALL else (self.halves[0], self.halves[1])

    def fwd(self, q, k, v, q_part, k_part, causal):
        (cu_q, max_q), (cu_k, max_k) = self._seq("q", q_part), self._seq("k", k_part)
        return _ops.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, self.params[causal])

    def bwd(self, dout, q, k, v, out, lse, dlse, q_part, k_part, causal):
        (cu_q, max_q), (cu_k, max_k) = self._seq("q", q_part), self._seq("k", k_part)
        return _ops.varlen_backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, self.params[causal])


# ----------------------------------------------------------------------------------------
# Communication: the ring, and the all-gather alternative
# ----------------------------------------------------------------------------------------


class _Comm:
    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)


class _Ring(_Comm):
    """K/V rotate one hop per step (the next hop posted before the block is computed); the
    dK/dV of a shard follow one step behind."""

    def __init__(self, group):
        super().__init__(group)
        to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.next = to_global((self.rank + 1) % self.world)
        self.prev = to_global((self.rank - 1) % self.world)
        self._grad_pending, self._grads = None, None

    def _start(self, tensors, tag):
        """Send ``tensors`` to the next rank and receive the previous rank's, asynchronously."""
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, peer=self.next, group=self.group, tag=tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer=self.prev, group=self.group, tag=tag) for t in recvs]
        return dist.batch_isend_irecv(ops), recvs, sends  # sends kept alive until the wait

    @staticmethod
    def _finish(pending):
        reqs, recvs, _ = pending
        for r in reqs:
            r.wait()
        return recvs

    def kv_stream(self, tensors):
        """Yield ``(src, tensors of rank src)`` for ``src = rank, rank - 1, ...``; while the
        caller computes on one, the next is already in flight."""
        for step in range(self.world):
            pending = self._start(tensors, _KV_TAG) if step + 1 < self.world else None
            yield (self.rank - step) % self.world, tensors
            if pending is not None:
                tensors = self._finish(pending)

    def push_grads(self, src, grads):
        """This step's float32 (dK, dV) contribution to ``src``'s shard (None: no work): add the
        sum received from the previous rank, send it on (overlapping the next step)."""
        if self._grad_pending is not None:
            received = self._finish(self._grad_pending)
            grads = received if grads is None else [g.add_(r) for g, r in zip(grads, received)]
        self._grads = grads
        self._grad_pending = self._start(grads, _GRAD_TAG) if self.world > 1 else None

    def collect_grads(self, like):
        # The last hop brings every rank the finished dK/dV of its own shard.
        return self._finish(self._grad_pending) if self._grad_pending is not None else self._grads


class _AllGather(_Comm):
    """Every K/V shard gathered once (overlapped with the local block); dK/dV reduce-scattered."""

    def __init__(self, group):
        super().__init__(group)
        self._grads = {}

    def kv_stream(self, tensors):
        if self.world == 1:
            yield self.rank, tensors
            return
        tensors = [t.contiguous() for t in tensors]
        gathered = [[torch.empty_like(t) for _ in range(self.world)] for t in tensors]
        works = [dist.all_gather(g, t, group=self.group, async_op=True) for g, t in zip(gathered, tensors)]
        yield self.rank, tensors
        for w in works:
            w.wait()
        for step in range(1, self.world):
            src = (self.rank - step) % self.world
            yield src, [g[src] for g in gathered]

    def push_grads(self, src, grads):
        self._grads[src] = grads

    def collect_grads(self, like):
        out = []
        for i, t in enumerate(like):
            parts = [self._grads[s][i] if self._grads.get(s) is not None else
                     torch.zeros(t.shape, dtype=torch.float32, device=t.device) for s in range(self.world)]
            if self.world == 1:
                out.append(parts[0])
                continue
            mine = torch.empty(t.shape, dtype=torch.float32, device=t.device)
            dist.reduce_scatter(mine, [p.contiguous() for p in parts], group=self.group)
            out.append(mine)
        return out


def _comm(mode, group):
    return _Ring(group) if mode == "ring" else _AllGather(group)


# ----------------------------------------------------------------------------------------
# Forward and backward over the blocks
# ----------------------------------------------------------------------------------------


def _forward(q, k, v, causal, zigzag, comm, lay):
    out = lse = None
    for src, (kk, vv) in comm.kv_stream((k, v)):
        plan = _plan(comm.rank, src, causal, zigzag)
        if plan is None:
            continue
        qp, kp, blk_causal = plan
        o, l = lay.fwd(lay.rows(q, qp, lay.seq_dim), lay.rows(kk, kp, lay.seq_dim), lay.rows(vv, kp, lay.seq_dim),
                       qp, kp, blk_causal)
        if out is None:  # step 0 is this rank's own shard: every query row, a fresh accumulator
            out, lse = o.float(), l.float()
        else:
            lay.merge(out, lse, qp, o, l)
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, dlse, causal, zigzag, comm, lay):
    dq = None
    for src, (kk, vv) in comm.kv_stream((k, v)):
        plan = _plan(comm.rank, src, causal, zigzag)
        if plan is None:
            comm.push_grads(src, None)
            continue
        qp, kp, blk_causal = plan
        sd = lay.seq_dim
        g = lay.bwd(lay.rows(dout, qp, sd), lay.rows(q, qp, sd), lay.rows(kk, kp, sd), lay.rows(vv, kp, sd),
                    lay.rows(out, qp, sd), lay.rows(lse, qp, lay.lse_dim), lay.rows(dlse, qp, lay.lse_dim),
                    qp, kp, blk_causal)
        if dq is None:  # step 0: every query row
            dq = g[0].float()
        else:
            lay.add(dq, qp, sd, g[0])
        grads = []
        for gk, t in zip(g[1:], (kk, vv)):
            if kp == _ALL:
                grads.append(gk.float())
            else:
                acc = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                lay.add(acc, kp, sd, gk)
                grads.append(acc)
        comm.push_grads(src, grads)
    dk, dv = comm.collect_grads((k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lay, causal, zigzag, mode, group):
        out, lse = _forward(q, k, v, causal, zigzag, _comm(mode, group), lay)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (lay, causal, zigzag, mode, group)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        lay, causal, zigzag, mode, group = ctx.args
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = _backward(dout, q, k, v, out, lse, dlse, causal, zigzag, _comm(mode, group), lay)
        return dq, dk, dv, None, None, None, None, None


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------


def ring_flash_attn_func(q, k, v, group=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                         return_lse=False, zigzag=None, mode="ring"):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: this rank's shard, ``(batch, seqlen / world, nheads, d)``; k, v:
            ``(batch, seqlen_k / world, nheads_k, d)``.  Every rank holds equal-length shards
            (the same shapes on every rank).  With ``zigzag`` (default: ``causal``) a shard is
            :func:`zigzag_shard` of the full sequence (chunks ``rank`` and ``2 * world - 1 - rank``
            of ``2 * world``), else the ``rank``-th of ``world`` contiguous chunks.
        group: the process group (default: the world).
        softmax_scale: score scale, default ``d ** -0.5``.
        causal: causal mask over the *full* sequence; needs ``seqlen_q == seqlen_k``.
        window_size: only ``(-1, -1)`` (or ``(-1, 0)``, the causal mask); sliding windows raise
            ``NotImplementedError``.
        return_lse: also return this rank's shard of the LSE, float32 ``(batch, nheads, seqlen / world)``.
        zigzag: how the sequence is sharded (above); only affects load balance when causal.
        mode: ``"ring"`` (K/V rotate, transfers overlapped with compute; memory: two K/V shards)
            or ``"allgather"`` (every K/V shard gathered at once; ``world`` K/V shards).

    Returns:
        This rank's shard of the output (and of the LSE); differentiable (dK/dV travel the ring
        back to their owner, dQ stays local).  Works on CUDA tensors with NCCL and on CPU tensors
        with gloo.
    """
    params, causal, zigzag = validation.check_ring_inputs(q, k, v, group, softmax_scale, causal, window_size,
                                                         return_lse, zigzag, mode)
    out, lse = _ContextParallelAttention.apply(q, k, v, _Dense(params.softmax_scale), causal, zigzag, mode, group)
    return (out, lse) if return_lse else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, group=None,
                                softmax_scale=None, causal=False, return_lse=False, zigzag=None, mode="ring"):
    """Ring attention over a packed batch of variable-length sequences, each sharded across ranks.

    Sharding: every sequence of the batch is cut into ``2 * world`` equal chunks (``zigzag``,
    the default when ``causal``) or ``world`` chunks, and rank ``r`` holds, sequence after
    sequence, chunks ``r`` and ``2 * world - 1 - r`` (or chunk ``r``) -- :func:`varlen_shard`.
    So each rank holds a packed batch of the *same* sequences, each ``1 / world`` as long
    (:func:`varlen_local_cu_seqlens`), and every sequence length must be divisible by
    ``2 * world`` (``world``); pad sequences otherwise (``ValueError`` names the offenders).

    Args:
        q: this rank's shard ``(total_q / world, nheads, d)``; k, v: ``(total_k / world, nheads_k, d)``.
        cu_seqlens_q, cu_seqlens_k: int32 prefix sums of the *full* batch (the same on every rank);
            ``causal`` needs them equal.
        max_seqlen_q, max_seqlen_k: the longest *full* sequence lengths.
        The rest as in :func:`ring_flash_attn_func`.

    Returns:
        This rank's shard of the output (and of the LSE, float32 ``(nheads, total_q / world)``).

    Each step is one call of the packed kernels with per-rank ``cu_seqlens``.  Reads
    ``cu_seqlens`` on the host once per call (to validate and to index the chunks).
    """
    params, causal, zigzag, batch, cu_q = validation.check_ring_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, group, softmax_scale, causal, return_lse,
        zigzag, mode)
    world = dist.get_world_size(group)

    halves = None
    if causal and zigzag:
        local = torch.tensor(cu_q, dtype=torch.long) // world
        lens = local[1:] - local[:-1]
        seq = torch.repeat_interleave(torch.arange(batch), lens)
        pos = torch.arange(int(local[-1])) - local[:-1][seq]
        front = pos < (lens // 2)[seq]
        halves = (varlen_local_cu_seqlens(cu_seqlens_q, 2 * world), _ceil_div(max_seqlen_q, 2 * world),
                  front.nonzero().flatten().to(q.device), (~front).nonzero().flatten().to(q.device))
    lay = _Varlen(params.softmax_scale, varlen_local_cu_seqlens(cu_seqlens_q, world),
                  varlen_local_cu_seqlens(cu_seqlens_k, world), _ceil_div(max_seqlen_q, world), _ceil_div(max_seqlen_k, world),
                  halves)
    out, lse = _ContextParallelAttention.apply(q, k, v, lay, causal, zigzag, mode, group)
    return (out, lse) if return_lse else out
