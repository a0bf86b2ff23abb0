"""Ring / all-gather context-parallel attention on CPU processes over gloo.

Every multi-process test spawns its ranks once (``torch.multiprocessing``, gloo, a ``file://``
rendezvous in a temporary directory, a timeout on the process group) and runs many cases
in them: starting processes costs far more here than the small attention problems.  Each
rank compares its shard of the output, the LSE and the gradients with the single-process
result on the full sequence.  A spawn that does not finish within a deadline is killed, so
no test can hang.
"""

import datetime
import os
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashtile
from flashtile.distributed import (
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
    varlen_local_cu_seqlens,
    varlen_shard,
    varlen_unshard,
    zigzag_shard,
    zigzag_unshard,
)

DEADLINE_S = 150


def _spawn(fn, world, *args):
    """Run ``fn(rank, world, tmpdir, *args)`` on ``world`` processes; kill them all past the deadline."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(fn, args=(world, tmp) + args, nprocs=world, join=False, start_method="spawn")
        start = time.monotonic()
        while not ctx.join(timeout=0.5):  # raises ProcessRaisedException when a rank raised
            if time.monotonic() - start > DEADLINE_S:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"spawned ranks still running after {DEADLINE_S} s: a hang")


def _init(rank, world, tmp, timeout_s=60):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


# ----------------------------------------------------------------------------------------
# One case: a full problem, sharded, against the single-process result
# ----------------------------------------------------------------------------------------


def _lengths(world, causal_kv_same=True):
    u = 2 * world  # every sequence a multiple of 2 * world (zigzag); one is empty
    q = [2 * u, 0, 3 * u, u]
    return q, (q if causal_kv_same else [u, u, 2 * u, 3 * u])


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _check_case(rank, world, case, group=None):
    kind, causal, zigzag, mode = case["kind"], case["causal"], case["zigzag"], case["mode"]
    nheads_k, dtype, use_lse = case.get("nheads_k", 4), case.get("dtype", torch.float32), case.get("use_lse", True)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 2e-5, "rtol": 2e-5}
    g = torch.Generator().manual_seed(zlib.crc32(repr(sorted(case.items())).encode()))  # same on every rank
    kw = {"causal": causal, "zigzag": zigzag, "mode": mode, "group": group, "return_lse": True}
    if "window_size" in case:
        kw.update(window_size=case["window_size"], causal=False)

    if kind == "dense":
        n = 8 * world
        nk = n * case.get("k_factor", 1)
        shapes = [(2, n, 4, 16), (2, nk, nheads_k, 16), (2, nk, nheads_k, 16)]

        def shard(x, dim=1):
            return zigzag_shard(x, rank, world, dim=dim) if zigzag else x.chunk(world, dim=dim)[rank]

        lse_dim, ref_kw = 2, {}
    else:
        lens_q, lens_k = _lengths(world, causal_kv_same=case.get("same_kv", True))
        cu_q, cu_k = _cu(lens_q), _cu(lens_k)
        shapes = [(sum(lens_q), 4, 16), (sum(lens_k), nheads_k, 16), (sum(lens_k), nheads_k, 16)]

        def shard(x, dim=0, cu=cu_q):
            return varlen_shard(x, cu, rank, world, zigzag=zigzag, dim=dim)

        lse_dim = 1
        ref_kw = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max(lens_q), "max_seqlen_k": max(lens_k)}

    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in shapes)
    dout = torch.randn(shapes[0], generator=g).to(dtype)
    dlse = torch.randn(shapes[0][-2], shapes[0][0], generator=g) if kind == "varlen" else \
        torch.randn(shapes[0][0], shapes[0][2], shapes[0][1], generator=g)

    if kind == "dense":
        kshard = shard
        ql, kl, vl = shard(q).clone(), kshard(k).clone(), kshard(v).clone()
    else:
        def kshard(x):
            return shard(x, cu=cu_k)

        ql, kl, vl = shard(q).clone(), kshard(k).clone(), kshard(v).clone()
    for t in (ql, kl, vl):
        t.requires_grad_(True)
    if kind == "dense":
        out, lse = ring_flash_attn_func(ql, kl, vl, **kw)
    else:
        out, lse = ring_flash_attn_varlen_func(ql, kl, vl, **ref_kw, **kw)
    outputs, cotangents = ((out, lse), (shard(dout), shard(dlse, dim=lse_dim))) if use_lse else ((out,), (shard(dout),))
    grads = torch.autograd.grad(outputs, (ql, kl, vl), cotangents)

    qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref_causal = causal or case.get("window_size") == (-1, 0)
    if kind == "dense":
        ref_out, ref_lse = flashtile.flash_attn_func(qf, kf, vf, causal=ref_causal, return_lse=True)
    else:
        ref_out, ref_lse = flashtile.flash_attn_varlen_func(qf, kf, vf, **ref_kw, causal=ref_causal, return_lse=True)
    ref_outputs, ref_cot = ((ref_out, ref_lse), (dout, dlse)) if use_lse else ((ref_out,), (dout,))
    ref_grads = torch.autograd.grad(ref_outputs, (qf, kf, vf), ref_cot)

    torch.testing.assert_close(out, shard(ref_out), **tol)
    torch.testing.assert_close(lse, shard(ref_lse, dim=lse_dim), **tol)
    for name, got, want, sh in zip("qkv", grads, ref_grads, (shard, kshard, kshard)):
        assert got.dtype == dtype, f"d{name} dtype {got.dtype}"
        torch.testing.assert_close(got, sh(want), **tol, msg=lambda m, name=name: f"d{name}: {m}")


def _run_cases(rank, world, tmp, cases):
    _init(rank, world, tmp)
    failures = []
    try:
        for case in cases:
            try:
                if case.get("subgroups"):  # two rings of world / 2 ranks each: even and odd ranks
                    groups = [dist.new_group(list(range(p, world, 2))) for p in (0, 1)]
                    group = groups[rank % 2]
                    _check_case(dist.get_rank(group), dist.get_world_size(group), case, group=group)
                else:
                    _check_case(rank, world, case)
            except Exception:  # noqa: BLE001 -- keep going: the other ranks expect this rank in every case
                failures.append(f"{case}: {traceback.format_exc(limit=3)}")
        if failures:
            raise AssertionError(f"rank {rank}: {len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures))
    finally:
        # Every rank past its last transfer before any tears its process group down: a rank
        # that destroyed it while a peer's gloo thread still served a pair aborted the process
        # ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()


def _case(kind, causal, zigzag, mode="ring", **extra):
    return dict(kind=kind, causal=causal, zigzag=zigzag, mode=mode, **extra)


WORLD_2_CASES = [
    _case("dense", True, True),
    _case("dense", True, False),
    _case("dense", False, False),
    _case("dense", False, True, nheads_k=2),
    _case("dense", True, True, "allgather"),
    _case("dense", True, False, "allgather", nheads_k=1),
    _case("dense", False, False, "allgather", nheads_k=2),
    _case("dense", True, True, nheads_k=1, use_lse=False),  # GQA/MQA; LSE unused by the loss
    _case("dense", False, False, k_factor=2),  # cross attention: seqlen_k = 2 * seqlen_q
    _case("dense", True, True, dtype=torch.bfloat16, nheads_k=2),
    _case("dense", False, True, window_size=(-1, 0)),  # (-1, 0) is the causal mask
    _case("varlen", True, True, nheads_k=2),
    _case("varlen", True, False),
    _case("varlen", False, True, same_kv=False, nheads_k=1),
    _case("varlen", False, False, same_kv=False, use_lse=False),
    _case("varlen", True, True, "allgather", nheads_k=2),
]

WORLD_4_CASES = [
    _case("dense", True, True, nheads_k=2),
    _case("dense", True, False, nheads_k=1),
    _case("dense", False, False, "allgather", nheads_k=2),
    _case("dense", True, True, "allgather"),
    _case("varlen", True, True, nheads_k=2),
    _case("varlen", False, False, same_kv=False),
    _case("dense", True, True, nheads_k=2, subgroups=True),  # process groups other than the world
]


def test_world_2_matches_single_process():
    """Dense and packed, causal or not, zigzag or plain, ring and all-gather, GQA/MQA, bf16."""
    _spawn(_run_cases, 2, WORLD_2_CASES)


def test_world_4_matches_single_process():
    _spawn(_run_cases, 4, WORLD_4_CASES)


def _run_cases_on_triton_kernels(rank, world, tmp, cases):
    """As ``_run_cases``, but every attention call goes to the Triton kernels (in the
    interpreter, on these CPU tensors) instead of the PyTorch CPU path."""
    from flashtile.kernels import attention as triton_attention
    from flashtile.ops import attention as ops

    ops._backend = lambda t: triton_attention
    _run_cases(rank, world, tmp, cases)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter runs the kernels here")
def test_world_2_on_the_triton_kernels():
    """The GPU kernels' path through a ring: zigzag steps hand the kernels views of half a
    shard (a non-contiguous LSE), which the CPU path takes in its stride."""
    _spawn(_run_cases_on_triton_kernels, 2, [_case("dense", True, True, nheads_k=2), _case("dense", False, False),
                                             _case("varlen", True, True, nheads_k=2)])


# ----------------------------------------------------------------------------------------
# A rank that raises must not hang the others
# ----------------------------------------------------------------------------------------


def _raise_on_one_rank(rank, world, tmp):
    _init(rank, world, tmp, timeout_s=3)
    done = os.path.join(tmp, "rank0_done")
    q = torch.randn(1, 8, 2, 16)
    if rank == 1:
        try:  # this rank's call fails (bad argument) before it sends anything ...
            ring_flash_attn_func(q, q, q, causal=True, window_size=(2, 0))
        except NotImplementedError:
            pass
        start = time.monotonic()  # ... and the process lives on without joining the ring
        while not os.path.exists(done) and time.monotonic() - start < 60:
            time.sleep(0.05)
        return
    start = time.monotonic()
    try:
        ring_flash_attn_func(q, q, q, causal=True)
        raise AssertionError("rank 0 finished a ring that rank 1 never joined")
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        assert "imed out" in str(e) or "timeout" in str(e).lower(), str(e)
        assert elapsed < 30, elapsed
    finally:
        open(done, "w").close()


def test_a_rank_that_raises_does_not_hang_the_others():
    start = time.monotonic()
    _spawn(_raise_on_one_rank, 2)
    assert time.monotonic() - start < 60


# ----------------------------------------------------------------------------------------
# In-process: sharding helpers, argument checks, world size 1
# ----------------------------------------------------------------------------------------


def test_zigzag_round_trip():
    x = torch.arange(2 * 24).reshape(2, 24)
    shards = [zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0].tolist()[0] == [0, 1, 2, 3, 20, 21, 22, 23]
    assert torch.equal(zigzag_unshard(shards), x)
    with pytest.raises(ValueError, match="divisible by 2 \\* world"):
        zigzag_shard(torch.zeros(1, 10), 0, 3)


@pytest.mark.parametrize("zigzag", [True, False])
def test_varlen_shard_round_trip(zigzag):
    cu = _cu([8, 0, 4])
    x = torch.arange(12)
    shards = [varlen_shard(x, cu, r, 2, zigzag=zigzag) for r in range(2)]
    want0 = [0, 1, 6, 7, 8, 11] if zigzag else [0, 1, 2, 3, 8, 9]
    assert shards[0].tolist() == want0
    assert torch.equal(varlen_unshard(shards, cu, zigzag=zigzag), x)
    assert varlen_local_cu_seqlens(cu, 2).tolist() == [0, 4, 4, 6]
    lse = torch.arange(24).reshape(2, 12)
    assert torch.equal(varlen_unshard([varlen_shard(lse, cu, r, 2, zigzag, dim=1) for r in range(2)], cu, zigzag, dim=1), lse)
    with pytest.raises(ValueError, match="divisible"):
        varlen_shard(x, _cu([6, 6]), 0, 2, zigzag=True)


def test_needs_a_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="process group"):
        ring_flash_attn_func(q, q, q)


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_arguments_are_checked(world_of_one):
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(NotImplementedError, match="window"):
        ring_flash_attn_func(q, q, q, window_size=(4, 4))
    with pytest.raises(ValueError, match="mode"):
        ring_flash_attn_func(q, q, q, mode="tree")
    with pytest.raises(ValueError, match="seqlen_q == seqlen_k"):
        ring_flash_attn_func(q, q[:, :4], q[:, :4], causal=True)
    with pytest.raises(ValueError, match="even"):
        ring_flash_attn_func(q[:, :5], q[:, :5], q[:, :5], causal=True)
    with pytest.raises(TypeError, match="return_lse"):
        ring_flash_attn_func(q, q, q, return_lse=1)
    p = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="divisible by 2 \\* world"):
        ring_flash_attn_varlen_func(p, p, p, _cu([7, 3]), _cu([7, 3]), 7, 7, causal=True)
    with pytest.raises(ValueError, match="cu_seqlens_q == cu_seqlens_k"):
        ring_flash_attn_varlen_func(p, p, p, _cu([6, 4]), _cu([4, 6]), 6, 6, causal=True)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ring_flash_attn_varlen_func(p, p, p, _cu([6, 6]), _cu([6, 4]), 6, 6)


def test_world_of_one_is_flash_attn(world_of_one):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 12, 4, 16, requires_grad=True) for _ in range(3))
    out, lse = ring_flash_attn_func(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = flashtile.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("packed", [False, True])
def test_in_place_merge_is_merge_attention_states(packed):
    from flashtile.distributed import _merge_into

    torch.manual_seed(0)
    shape, lse_shape = ((7, 3, 8), (3, 7)) if packed else ((2, 7, 3, 8), (2, 3, 7))
    out_a, out_b = torch.randn(shape), torch.randn(shape).to(torch.bfloat16)
    lse_a, lse_b = torch.randn(lse_shape), torch.randn(lse_shape)
    lse_a[..., 0] = float("-inf")  # an empty part on one side, then on both
    lse_a[..., 1] = lse_b[..., 1] = float("-inf")
    out_a[..., 0, :, :] = 0
    out_a[..., 1, :, :] = 0
    out_b[..., 1, :, :] = 0
    want_out, want_lse = flashtile.merge_attention_states(out_a, lse_a, out_b.float(), lse_b)
    _merge_into(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out_a, want_out)
    torch.testing.assert_close(lse_a, want_lse)
    assert not out_a.isnan().any()
