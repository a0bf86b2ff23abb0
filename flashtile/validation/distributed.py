"""Ring attention's and the sharding helpers' arguments."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from flashtile.semantics.params import AttentionParams
from flashtile.validation.attention import check_attention_inputs
from flashtile.validation.common import check_bool, check_scalar
from flashtile.validation.indices import check_cu_seqlens_pair

RING_MODES = ("ring", "allgather")


def check_rank_world(rank, world) -> None:
    """Ints with ``0 <= rank < world``."""
    for name, value in (("rank", rank), ("world", world)):
        check_scalar(name, value, int, "an int")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank {rank}, world {world}")


def check_zigzag_length(length: int, world: int) -> None:
    """A sequence of ``length`` cuts into ``2 * world`` equal zigzag chunks."""
    if length % (2 * world):
        raise ValueError(f"zigzag sharding needs a length divisible by 2 * world = {2 * world}, got {length}")


def host_cu_seqlens(name: str, cu_seqlens) -> list[int]:
    """``cu_seqlens`` read on the host (one small device-to-host copy): a 1-D tensor of
    ``batch + 1`` prefix sums, starting at 0, non-decreasing."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor of batch + 1 prefix sums")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu}")
    return cu


def check_shardable_lengths(name: str, cu: list[int], world: int, zigzag: bool) -> int:
    """Every sequence of the prefix sums ``cu`` cuts into ``n = 2 * world`` (zigzag) or
    ``world`` equal chunks; returns ``n``."""
    n = 2 * world if zigzag else world
    lens = [b - a for a, b in itertools.pairwise(cu)]
    bad = [(i, n_) for i, n_ in enumerate(lens) if n_ % n]
    if bad:
        how = f"2 * world = {n} (zigzag)" if zigzag else f"world = {n}"
        raise ValueError(
            f"{name}: every sequence is split into {n} equal chunks, so every length must be divisible by "
            f"{how}; sequences (index, length) {bad[:8]} are not (pad them)"
        )
    return n


def check_process_group() -> None:
    """An initialised ``torch.distributed`` process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring attention needs an initialised torch.distributed process group "
                         "(torch.distributed.init_process_group)")


def check_ring_options(group, window_size, return_lse, zigzag, mode, params: AttentionParams) -> tuple[bool, bool]:
    """The options both ring functions share: a process group this rank belongs to, ``mode``
    one of :data:`RING_MODES`, bools, and no sliding window (full or causal attention only).
    Returns ``(causal, zigzag)``, zigzag defaulting to causal."""
    check_process_group()
    check_bool("return_lse", return_lse)
    if mode not in RING_MODES:
        raise ValueError(f"mode must be 'ring' or 'allgather', got {mode!r}")
    if zigzag is not None:
        zigzag = check_scalar("zigzag", zigzag, bool, "a bool or None")
    if params.window_left != -1 or params.window_right not in (-1, 0):
        raise NotImplementedError(
            f"ring attention supports no sliding window yet: window_size must be (-1, -1) (or (-1, 0), i.e. "
            f"causal), got {tuple(window_size)}")
    causal = params.window_right == 0
    if dist.get_rank(group) < 0:
        raise ValueError("this rank is not a member of group")
    return causal, causal if zigzag is None else zigzag


def check_ring_inputs(q, k, v, group, softmax_scale, causal, window_size, return_lse, zigzag, mode):
    """``ring_flash_attn_func``'s arguments: the attention rules on each rank's shards, the ring
    options, equal shard lengths when causal, even ones with zigzag.  Returns
    ``(params, causal, zigzag)``."""
    params = check_attention_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    causal, zigzag = check_ring_options(group, window_size, return_lse, zigzag, mode, params)
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal ring attention needs seqlen_q == seqlen_k, got shards of {q.shape[1]} and {k.shape[1]}")
    if zigzag and (q.shape[1] % 2 or k.shape[1] % 2):
        raise ValueError(f"zigzag shards hold two equal chunks: the local seqlen must be even, got "
                         f"{q.shape[1]} (q) and {k.shape[1]} (k)")
    return params, causal, zigzag


def check_ring_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, group, softmax_scale,
                             causal, return_lse, zigzag, mode):
    """``ring_flash_attn_varlen_func``'s arguments: packed shards, ``cu_seqlens`` of the full
    batch (one batch for q and k, each rank's shard ``1 / world`` of it, every sequence
    shardable, equal for q and k when causal), the ring options.  Returns
    ``(params, causal, zigzag, batch, cu_q)``, ``cu_q`` the query prefix sums read on the host."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a torch.Tensor of shape (total_q / world, nheads, headdim)")
    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        raise ValueError("k must be a torch.Tensor of shape (total_k / world, nheads_k, headdim)")
    check_process_group()
    world = dist.get_world_size(group)
    batch = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, q.shape[0] * world, k.shape[0] * world, q.device,
                                  max_seqlen_q, max_seqlen_k)
    params = check_attention_inputs(q, k, v, softmax_scale=softmax_scale, causal=causal, packed=True, packed_batch=batch)
    causal, zigzag = check_ring_options(group, (-1, 0) if causal else (-1, -1), return_lse, zigzag, mode, params)

    cu_q, cu_k = host_cu_seqlens("cu_seqlens_q", cu_seqlens_q), host_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    for name, cu, local, mx, mx_name in (("cu_seqlens_q", cu_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
                                         ("cu_seqlens_k", cu_k, k.shape[0], max_seqlen_k, "max_seqlen_k")):
        if cu[-1] != local * world:
            raise ValueError(f"{name} ends at {cu[-1]}, but this rank's shard has {local} rows: the shard must be "
                             f"1 / world of the full batch ({cu[-1]} / {world})")
        if max(b - a for a, b in itertools.pairwise(cu)) > mx:
            raise ValueError(f"{mx_name} ({mx}) is smaller than the longest sequence")
        check_shardable_lengths(name, cu, world, zigzag)
    if causal and cu_q != cu_k:
        raise ValueError("causal ring attention needs cu_seqlens_q == cu_seqlens_k (self-attention)")
    return params, causal, zigzag, batch, cu_q
