"""Context-parallel (ring) attention over ``torch.distributed``: one sequence sharded across ranks.

Each rank holds a shard of the sequence, ``(batch, seqlen / world, nheads, d)``.  The K/V
shards travel around the ring (point-to-point ``isend``/``irecv``, the next transfer started
before the current block is computed); each rank attends its queries to every K/V shard in
turn and merges the partial results with the online-softmax rule
(``flashtile.merging.merge_split_states``), so the result is exact.  The backward sends
dK/dV around the ring with their K/V while dQ stays local, recomputing each block from the
global LSE -- the single-device backward, block by block.

Causal load balance ("zigzag"): with ``2 * world`` equal chunks, rank ``r`` holds chunks ``r``
and ``2 * world - 1 - r``, so every rank has the same amount of unmasked work;
:func:`zigzag_shard` / :func:`zigzag_unshard` reorder a full sequence.  Block pairs that are
entirely masked are skipped.  ``mode="allgather"`` gathers K/V once instead (better for small
worlds or short shards).  Works with NCCL on GPUs and gloo on CPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashtile.merging import merge_split_states
from flashtile.ops import attention as _ops
from flashtile.ops.validation import check_attention_inputs


# ----------------------------------------------------------------------------------------
# Sharding
# ----------------------------------------------------------------------------------------


def _chunk_ids(rank: int, world: int, zigzag: bool) -> list[int]:
    """Global chunk indices held by ``rank``: ``world`` chunks in all, or ``2 * world`` for zigzag."""
    return [rank, 2 * world - 1 - rank] if zigzag else [rank]


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag shard of a full sequence: chunks ``rank`` and ``2 * world - 1 - rank``."""
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


# ----------------------------------------------------------------------------------------
# One block: the single-device custom ops
# ----------------------------------------------------------------------------------------


def _visibility(q_chunk: int, k_chunk: int, causal: bool) -> str | None:
    """Which mask a (query chunk, key chunk) block needs: None (skip), 'full' or 'causal'."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "causal" if k_chunk == q_chunk else None


def _block_fwd(q, k, v, scale, kind):
    return _ops.attention_forward(q, k, v, scale, -1, 0 if kind == "causal" else -1, 0.0, None, 0.0, 0, 0, False)


def _block_bwd(dout, q, k, v, out, lse, dlse, scale, kind):
    return _ops.attention_backward(dout, q, k, v, out, lse, dlse, scale, -1, 0 if kind == "causal" else -1,
                                   0.0, None, 0.0, 0, 0, False)


def _merge(parts, out_like, lse_shape):
    """Merge a list of (out, lse) partials; no part at all -> zeros and -inf."""
    if not parts:
        return (torch.zeros(out_like.shape, dtype=torch.float32, device=out_like.device),
                torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=out_like.device))
    return merge_split_states(torch.stack([p[0] for p in parts]), torch.stack([p[1].float() for p in parts]))


# ----------------------------------------------------------------------------------------
# Ring
# ----------------------------------------------------------------------------------------


class _Ring:
    """Send to the next rank and receive from the previous one, asynchronously."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None else (self.rank - 1) % self.world

    def start(self, tensors):
        buffers = [torch.empty_like(t) for t in tensors]
        reqs = []
        # Even ranks send first and odd ranks receive first, so blocking transports pair up.
        for t, buf in zip(tensors, buffers):
            if self.rank % 2 == 0:
                reqs += [dist.isend(t.contiguous(), self.next, group=self.group), dist.irecv(buf, self.prev, group=self.group)]
            else:
                reqs += [dist.irecv(buf, self.prev, group=self.group), dist.isend(t.contiguous(), self.next, group=self.group)]
        return reqs, buffers

    @staticmethod
    def finish(pending):
        reqs, buffers = pending
        for r in reqs:
            r.wait()
        return buffers


def _split_chunks(x, n):
    return list(x.chunk(n, dim=1)) if n > 1 else [x]


def _ring_forward(q, k, v, scale, causal, zigzag, ring):
    n = 2 if zigzag else 1
    q_ids = _chunk_ids(ring.rank, ring.world, zigzag)
    q_chunks = _split_chunks(q, n)
    parts = [[] for _ in range(n)]
    kv = (k, v)
    for step in range(ring.world):
        pending = ring.start(kv) if step + 1 < ring.world else None  # overlap: next shard in flight
        src = (ring.rank - step) % ring.world
        k_chunks, v_chunks = _split_chunks(kv[0], n), _split_chunks(kv[1], n)
        for qi, (qid, qc) in enumerate(zip(q_ids, q_chunks)):
            for kid, kc, vc in zip(_chunk_ids(src, ring.world, zigzag), k_chunks, v_chunks):
                kind = _visibility(qid, kid, causal)
                if kind is not None:
                    parts[qi].append(_block_fwd(qc, kc, vc, scale, kind))
        if pending is not None:
            kv = tuple(ring.finish(pending))
    merged = [_merge(p, qc, (qc.shape[0], qc.shape[2], qc.shape[1])) for p, qc in zip(parts, q_chunks)]
    out = torch.cat([m[0] for m in merged], dim=1).to(q.dtype)
    lse = torch.cat([m[1] for m in merged], dim=2)
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, dlse, scale, causal, zigzag, ring):
    n = 2 if zigzag else 1
    q_ids = _chunk_ids(ring.rank, ring.world, zigzag)
    sq = lambda x: _split_chunks(x, n)  # noqa: E731
    lse_chunks = list(lse.chunk(n, dim=2)) if n > 1 else [lse]
    dlse_chunks = (list(dlse.chunk(n, dim=2)) if n > 1 else [dlse]) if dlse is not None else [None] * n
    q_chunks, do_chunks, o_chunks = sq(q), sq(dout), sq(out)
    dq = [torch.zeros(c.shape, dtype=torch.float32, device=q.device) for c in q_chunks]
    # The travelling state: this step's K/V shard and the dK/dV accumulated for it so far.
    state = (k, v, torch.zeros(k.shape, dtype=torch.float32, device=k.device),
             torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        kk, vv, dk_acc, dv_acc = state
        k_chunks, v_chunks = sq(kk), sq(vv)
        dk_parts, dv_parts = sq(dk_acc.clone()), sq(dv_acc.clone())
        for qi, qid in enumerate(q_ids):
            for kj, kid in enumerate(_chunk_ids(src, ring.world, zigzag)):
                kind = _visibility(qid, kid, causal)
                if kind is None:
                    continue
                g = _block_bwd(do_chunks[qi], q_chunks[qi], k_chunks[kj], v_chunks[kj], o_chunks[qi],
                               lse_chunks[qi], dlse_chunks[qi], scale, kind)
                dq[qi] += g[0].float()
                dk_parts[kj] = dk_parts[kj] + g[1].float()
                dv_parts[kj] = dv_parts[kj] + g[2].float()
        dk_acc, dv_acc = torch.cat(dk_parts, dim=1), torch.cat(dv_parts, dim=1)
        state = (kk, vv, dk_acc, dv_acc)
        if ring.world > 1:  # pass the block on; after `world` moves every dK/dV is back with its owner
            state = tuple(ring.finish(ring.start(state)))
    dk, dv = state[2], state[3]
    return torch.cat(dq, dim=1).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------
# All-gather variant
# ----------------------------------------------------------------------------------------


def _gather_seq(x, ring, zigzag):
    """All ranks' shards, reassembled in global sequence order."""
    shards = [torch.empty_like(x) for _ in range(ring.world)]
    dist.all_gather(shards, x.contiguous(), group=ring.group)
    return zigzag_unshard(shards) if zigzag else torch.cat(shards, dim=1)


def _allgather_blocks(q, ring, zigzag, causal, total):
    """(query chunk, keys it needs) pairs: keys [0, end) with the causal band bottom-right aligned."""
    chunk = total // (2 * ring.world if zigzag else ring.world)
    for qi, qid in enumerate(_chunk_ids(ring.rank, ring.world, zigzag)):
        end = (qid + 1) * chunk if causal else total
        yield qi, end, "causal" if causal else "full"


def _allgather_forward(q, k, v, scale, causal, zigzag, ring):
    kf, vf = _gather_seq(k, ring, zigzag), _gather_seq(v, ring, zigzag)
    n = 2 if zigzag else 1
    outs, lses = [], []
    for qi, end, kind in _allgather_blocks(q, ring, zigzag, causal, kf.shape[1]):
        o, l = _block_fwd(_split_chunks(q, n)[qi], kf[:, :end], vf[:, :end], scale, kind)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _allgather_backward(dout, q, k, v, out, lse, dlse, scale, causal, zigzag, ring):
    kf, vf = _gather_seq(k, ring, zigzag), _gather_seq(v, ring, zigzag)
    n = 2 if zigzag else 1
    dkf = torch.zeros(kf.shape, dtype=torch.float32, device=k.device)
    dvf = torch.zeros(vf.shape, dtype=torch.float32, device=v.device)
    dqs = []
    lse_c = list(lse.chunk(n, dim=2)) if n > 1 else [lse]
    dlse_c = (list(dlse.chunk(n, dim=2)) if n > 1 else [dlse]) if dlse is not None else [None] * n
    for qi, end, kind in _allgather_blocks(q, ring, zigzag, causal, kf.shape[1]):
        g = _block_bwd(_split_chunks(dout, n)[qi], _split_chunks(q, n)[qi], kf[:, :end], vf[:, :end],
                       _split_chunks(out, n)[qi], lse_c[qi], dlse_c[qi], scale, kind)
        dqs.append(g[0])
        dkf[:, :end] += g[1].float()
        dvf[:, :end] += g[2].float()
    # Every rank contributed to every key: sum, then keep this rank's shard.
    dist.all_reduce(dkf, group=ring.group)
    dist.all_reduce(dvf, group=ring.group)
    own = lambda x: zigzag_shard(x, ring.rank, ring.world) if zigzag else x.chunk(ring.world, dim=1)[ring.rank]  # noqa: E731
    return torch.cat(dqs, dim=1), own(dkf).to(k.dtype), own(dvf).to(v.dtype)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, zigzag, mode, group):
        ring = _Ring(group)
        fwd = _ring_forward if mode == "ring" else _allgather_forward
        out, lse = fwd(q, k, v, scale, causal, zigzag, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal, zigzag, mode, group)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, zigzag, mode, group = ctx.args
        bwd = _ring_backward if mode == "ring" else _allgather_backward
        dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, dlse, scale, causal, zigzag, _Ring(group))
        return dq, dk, dv, None, None, None, None, None


def ring_flash_attn_func(q, k, v, group=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                         return_lse=False, zigzag=None, mode="ring"):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q, k, v: this rank's shard, ``(batch, seqlen / world, nheads[_k], d)``; all ranks
            hold equal-length shards.  With ``zigzag`` (default: ``causal``) the shard is
            :func:`zigzag_shard` of the full sequence, else the ``rank``-th contiguous chunk.
        mode: ``"ring"`` (K/V rotate, overlapped with compute) or ``"allgather"``.
        The rest as in :func:`flashtile.flash_attn_func`; sliding windows are not supported
        across shards yet.

    Returns:
        This rank's shard of the output (and of the LSE, ``(batch, nheads, seqlen / world)``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_flash_attn_func needs an initialised torch.distributed process group")
    params = check_attention_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("window_size is not supported by ring attention yet; pass (-1, -1)")
    if mode not in ("ring", "allgather"):
        raise ValueError(f"mode must be 'ring' or 'allgather', got {mode!r}")
    zigzag = causal if zigzag is None else bool(zigzag)
    if zigzag and q.shape[1] % 2:
        raise ValueError(f"zigzag shards hold two equal chunks: the local seqlen must be even, got {q.shape[1]}")
    out, lse = _ContextParallelAttention.apply(q, k, v, params.softmax_scale, causal, zigzag, mode, group)
    return (out, lse) if return_lse else out
