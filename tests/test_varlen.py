"""Packed variable-length attention (CPU path) and the padding helpers."""

import pytest
import torch

import flashtile
from helpers import assert_close_to_reference, random_like, reference_attention_grads


def _padded_batch(lengths_q, lengths_k, nheads=4, nheads_k=2, headdim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, nq, nk = len(lengths_q), max(lengths_q), max(lengths_k)
    q = torch.randn(b, nq, nheads, headdim, generator=gen).to(dtype)
    k = torch.randn(b, nk, nheads_k, headdim, generator=gen).to(dtype)
    v = torch.randn(b, nk, nheads_k, headdim, generator=gen).to(dtype)
    mq = torch.arange(nq)[None, :] < torch.tensor(lengths_q)[:, None]
    mk = torch.arange(nk)[None, :] < torch.tensor(lengths_k)[:, None]
    return q, k, v, mq, mk


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2))])
@pytest.mark.parametrize("lengths_q,lengths_k", [([20, 7, 0, 1], [20, 7, 5, 3]), ([5, 9], [9, 5])])
def test_varlen_matches_per_sequence_reference(causal, window, lengths_q, lengths_k):
    q, k, v, mq, mk = _padded_batch(lengths_q, lengths_k)
    qp, iq, cu_q, max_q = flashtile.unpad_input(q, mq)
    kp, _, cu_k, max_k = flashtile.unpad_input(k, mk)
    vp, _, _, _ = flashtile.unpad_input(v, mk)
    assert cu_q.dtype == torch.int32 and cu_q.tolist()[-1] == sum(lengths_q) and max_q == max(lengths_q)
    qp, kp, vp = (t.clone().requires_grad_(True) for t in (qp, kp, vp))
    slopes = torch.rand(len(lengths_q), 4, generator=torch.Generator().manual_seed(1)) * 0.3
    out, lse = flashtile.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max_q, max_k, causal=causal,
                                                window_size=window, softcap=4.0, alibi_slopes=slopes,
                                                return_lse=True)
    assert out.shape == qp.shape and lse.shape == (4, qp.shape[0])
    dout = random_like(out, seed=2)
    grads = torch.autograd.grad(out, (qp, kp, vp), dout)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        ref = reference_attention_grads(qp[None, sq], kp[None, sk], vp[None, sk], dout[None, sq], causal=causal,
                                        window_size=window, softcap=4.0, alibi_slopes=slopes[b])
        torch.testing.assert_close(out[sq].double(), ref[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, sq].double(), ref[1][0], atol=1e-5, rtol=1e-5)
        for got, r in ((grads[0][sq], ref[2][0]), (grads[1][sk], ref[3][0]), (grads[2][sk], ref[4][0])):
            torch.testing.assert_close(got.double(), r, atol=1e-5, rtol=1e-5)
    # Keys of a sequence whose queries are all absent get no gradient.
    for b in range(len(lengths_q)):
        if lengths_q[b] == 0:
            assert (grads[1][ck[b]:ck[b + 1]] == 0).all()


def test_pad_unpad_round_trip_and_gradient():
    x = torch.randn(3, 6, 2, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    packed, idx, cu, mx = flashtile.unpad_input(x, mask)
    assert packed.shape == (9, 2) and cu.tolist() == [0, 3, 9, 9] and mx == 6
    back = flashtile.pad_input(packed, idx, 3, 6)
    torch.testing.assert_close(back, x * mask[..., None])
    back.sum().backward()
    torch.testing.assert_close(x.grad, mask[..., None].float().expand_as(x))


def test_varlen_equals_dense_on_equal_lengths():
    q, k, v, mq, mk = _padded_batch([12, 12], [12, 12])
    dense = flashtile.flash_attn_func(q, k, v, causal=True)
    cu = torch.tensor([0, 12, 24], dtype=torch.int32)
    packed = flashtile.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 12, 12,
                                              causal=True)
    torch.testing.assert_close(packed, dense.flatten(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "cu,max_q,exc,match",
    [
        (torch.tensor([0, 5, 9]), 5, ValueError, "int32"),
        (torch.tensor([0, 5, 8], dtype=torch.int32), 5, ValueError, "end at the packed length"),
        (torch.tensor([1, 5, 9], dtype=torch.int32), 5, ValueError, "start at 0"),
        (torch.tensor([0, 6, 5, 9], dtype=torch.int32), 6, ValueError, "non-decreasing"),
        (torch.tensor([0, 5, 9], dtype=torch.int32), 4, ValueError, "max_seqlen_q"),
        (torch.tensor([[0, 5, 9]], dtype=torch.int32), 5, ValueError, "1-D"),
        ([0, 5, 9], 5, TypeError, "cu_seqlens_q"),
        (torch.tensor([0, 5, 9], dtype=torch.int32), 5.0, TypeError, "max_seqlen_q"),
    ],
)
def test_cu_seqlens_validation(cu, max_q, exc, match):
    q = torch.randn(9, 2, 16)
    cu_k = torch.tensor([0, 5, 9], dtype=torch.int32)
    with pytest.raises(exc, match=match):
        flashtile.flash_attn_varlen_func(q, q, q, cu, cu_k, max_q, 5)


def test_cu_seqlens_batch_mismatch():
    q = torch.randn(9, 2, 16)
    with pytest.raises(ValueError, match="same batch"):
        flashtile.flash_attn_varlen_func(q, q, q, torch.tensor([0, 5, 9], dtype=torch.int32),
                                         torch.tensor([0, 9], dtype=torch.int32), 5, 9)


def test_unpad_input_validation():
    with pytest.raises(ValueError, match="attention_mask"):
        flashtile.unpad_input(torch.randn(2, 3, 4), torch.ones(2, 4))
    with pytest.raises(TypeError):
        flashtile.unpad_input([1, 2], torch.ones(2, 4))


def test_opcheck_varlen_ops():
    q = torch.randn(9, 2, 16, requires_grad=True)
    k = torch.randn(11, 1, 16, requires_grad=True)
    v = torch.randn(11, 1, 16, requires_grad=True)
    cu_q = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 8, 11], dtype=torch.int32)
    args = (q, k, v, cu_q, cu_k, 5, 6, 0.25, -1, 0, 0.0, None, 0.0, 0, 0, False)
    torch.library.opcheck(torch.ops.flashtile.varlen_attention_forward, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_matches_reference(dtype, causal):
    lengths_q, lengths_k = [300, 1, 0, 1024, 77], [300, 64, 5, 900, 77]
    q, k, v, mq, mk = _padded_batch(lengths_q, lengths_k, nheads=8, nheads_k=2, headdim=128, dtype=dtype)
    q, k, v, mq, mk = (t.cuda() for t in (q, k, v, mq, mk))
    qp, _, cu_q, max_q = flashtile.unpad_input(q, mq)
    kp, _, cu_k, max_k = flashtile.unpad_input(k, mk)
    vp, _, _, _ = flashtile.unpad_input(v, mk)
    qp, kp, vp = (t.clone().requires_grad_(True) for t in (qp, kp, vp))
    out, lse = flashtile.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True)
    dout = random_like(out, seed=2)
    grads = torch.autograd.grad(out, (qp, kp, vp), dout)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        ref = reference_attention_grads(qp[None, sq], kp[None, sk], vp[None, sk], dout[None, sq], causal=causal)
        low = reference_attention_grads(qp[None, sq], kp[None, sk], vp[None, sk], dout[None, sq], causal=causal,
                                        upcast=False)
        assert_close_to_reference(out[None, sq], ref[0], low[0], f"out[{b}]", atol_floor=1e-3)
        for name, got, r, lo in (("dq", grads[0][None, sq], ref[2], low[2]), ("dk", grads[1][None, sk], ref[3], low[3]),
                                 ("dv", grads[2][None, sk], ref[4], low[4])):
            assert_close_to_reference(got, r, lo, f"{name}[{b}]", atol_floor=1e-2)
