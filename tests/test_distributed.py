"""Ring / all-gather context-parallel attention on CPU processes over gloo."""

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashtile
from flashtile.distributed import ring_flash_attn_func, zigzag_shard, zigzag_unshard


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, causal, zigzag, mode, nheads_k, fail_rank):
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        if rank == fail_rank:
            raise RuntimeError("deliberate failure on one rank")
        g = torch.Generator().manual_seed(0)
        n = 8 * world
        q = torch.randn(2, n, 4, 16, generator=g)
        k = torch.randn(2, n, nheads_k, 16, generator=g)
        v = torch.randn(2, n, nheads_k, 16, generator=g)
        dout = torch.randn(2, n, 4, 16, generator=g)
        dlse = torch.randn(2, 4, n, generator=g)

        def shard(x, dim=1):
            return zigzag_shard(x, rank, world, dim=dim) if zigzag else x.chunk(world, dim=dim)[rank]

        ql, kl, vl = (shard(t).clone().requires_grad_(True) for t in (q, k, v))
        out, lse = ring_flash_attn_func(ql, kl, vl, causal=causal, zigzag=zigzag, mode=mode, return_lse=True)
        grads = torch.autograd.grad((out, lse), (ql, kl, vl), (shard(dout), shard(dlse, dim=2)))

        qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref_out, ref_lse = flashtile.flash_attn_func(qf, kf, vf, causal=causal, return_lse=True)
        ref_grads = torch.autograd.grad((ref_out, ref_lse), (qf, kf, vf), (dout, dlse))
        torch.testing.assert_close(out, shard(ref_out), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, shard(ref_lse, dim=2), atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, shard(want), atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()


def _run(world, causal, zigzag, mode, nheads_k=4, fail_rank=-1):
    mp.spawn(_worker, args=(world, _free_port(), causal, zigzag, mode, nheads_k, fail_rank), nprocs=world, join=True)


@pytest.mark.parametrize("mode", ["ring", "allgather"])
@pytest.mark.parametrize("causal,zigzag", [(False, False), (True, False), (True, True)])
def test_world_2_matches_single_process(causal, zigzag, mode):
    _run(2, causal, zigzag, mode)


@pytest.mark.parametrize("causal,zigzag,nheads_k", [(True, True, 2), (False, False, 1)])
def test_world_4_ring_with_gqa(causal, zigzag, nheads_k):
    _run(4, causal, zigzag, "ring", nheads_k=nheads_k)


def test_a_failing_rank_does_not_hang_the_others():
    with pytest.raises(Exception, match="deliberate failure"):
        _run(2, True, True, "ring", fail_rank=1)


def test_zigzag_round_trip():
    x = torch.arange(2 * 24).reshape(2, 24)
    shards = [zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0].tolist()[0] == [0, 1, 2, 3, 20, 21, 22, 23]
    assert torch.equal(zigzag_unshard(shards), x)


def test_needs_a_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="process group"):
        ring_flash_attn_func(q, q, q)
