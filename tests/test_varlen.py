"""Packed variable-length attention (CPU path, and the kernels' sequence isolation) and the padding helpers."""

import os

import pytest
import torch

import flashtile
from helpers import assert_close_to_reference, random_like, reference_attention_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
    reason="needs a GPU or TRITON_INTERPRET=1",
)


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
        (torch.tensor([0, 10, 9], dtype=torch.int32), 10, ValueError,
         r"non-decreasing.*cu_seqlens_q\[2\] = 9 < cu_seqlens_q\[1\] = 10"),
        (torch.tensor([0, 5, 9], dtype=torch.int32), -1, ValueError, "max_seqlen_q must be >= 0"),
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


def test_cu_seqlens_values_are_copied_once_per_unchanged_tensor(monkeypatch):
    """A cu_seqlens tensor whose values passed is not copied to the host again (on a GPU each
    copy is a sync) until it changes in place; a bad value written then is caught, and so is
    a packed length or max_seqlen it was not checked against."""
    from flashtile.validation import indices

    copies = []
    real = indices.to_host

    def counting(*tensors):
        copies.append(len(tensors))
        return real(*tensors)

    monkeypatch.setattr(indices, "to_host", counting)
    q = torch.randn(9, 2, 16)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    for _ in range(3):
        flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
    assert len(copies) == 1
    flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6)  # another max_seqlen: checked again
    assert len(copies) == 2
    cu[1] = 10  # in place: the version counter moves
    with pytest.raises(ValueError, match="non-decreasing"):
        flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 10, 10)
    cu[1] = 4
    flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
    assert len(copies) == 4
    flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
    assert len(copies) == 4
    with pytest.raises(ValueError, match="end at the packed length"):
        flashtile.flash_attn_varlen_func(q[:8], q[:8], q[:8], cu, cu, 5, 5)  # another packed length
    with torch.inference_mode():  # no version counter: checked at every call
        frozen = torch.tensor([0, 5, 9], dtype=torch.int32)
        for _ in range(2):
            flashtile.flash_attn_varlen_func(q, q, q, frozen, frozen, 5, 5)
    assert len(copies) == 7


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


class _NanEmpty:
    """``torch`` for the kernels' launchers, except that ``torch.empty`` floats start as NaN,
    so an output row that no program should write stays visibly unwritten."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@needs_kernels
@pytest.mark.parametrize(
    "causal,window,softcap,alibi,dropout",
    [(False, (-1, -1), 0.0, False, 0.0),
     (True, (-1, -1), 2.0, True, 0.0),
     (False, (3, 2), 0.0, False, 0.2)],
    ids=["full", "causal-softcap-alibi", "window-dropout"],
)
def test_varlen_kernels_keep_sequences_apart(causal, window, softcap, alibi, dropout, monkeypatch):
    """The packed kernels read tiles across sequence boundaries; only masks keep sequences apart.

    V and dO of neighbouring sequences differ 1000x in magnitude, so one key, query or
    gradient row leaking across a boundary breaks that sequence's comparison with the
    per-sequence CPU path.  Rows after the last sequence (x1000, in no sequence) must be
    read as nothing and never written: the launchers' output buffers start as NaN there.
    """
    from flashtile import cpu
    from flashtile.kernels import attention as ka
    from flashtile.kernels.attention import backward, forward

    lens_q, lens_k = [5, 19, 0, 1, 12, 3], [7, 33, 3, 2, 9, 4]
    scales = [1.0, 1000.0, 1.0, 1000.0, 1.0, 1000.0]
    tail = 6  # trailing rows of q and k/v that belong to no sequence
    gen = torch.Generator().manual_seed(3)
    nq, nk = sum(lens_q) + tail, sum(lens_k) + tail
    q, k, v, dout = (torch.randn(n, h, 24, generator=gen) for n, h in ((nq, 2), (nk, 1), (nk, 1), (nq, 2)))
    row_scale_q = torch.cat([torch.full((n,), s) for n, s in zip(lens_q + [tail], scales + [1000.0])])
    row_scale_k = torch.cat([torch.full((n,), s) for n, s in zip(lens_k + [tail], scales + [1000.0])])
    v, dout = v * row_scale_k[:, None, None], dout * row_scale_q[:, None, None]
    # K and V as views of one (nk, 2, heads, d) tensor: packed inputs need not be contiguous.
    k, v = torch.stack([k, v], dim=1).to(DEVICE).unbind(1)
    q, dout = q.to(DEVICE), dout.to(DEVICE)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    slopes = (torch.rand(len(lens_q), 2, generator=gen) * 0.3).to(DEVICE) if alibi else None
    left, right = window[0], 0 if causal else window[1]
    kw = dict(softcap=softcap, alibi_slopes=slopes, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
              dropout=(dropout, 11, 0) if dropout else None)

    monkeypatch.setattr(forward, "torch", _NanEmpty())
    monkeypatch.setattr(backward, "torch", _NanEmpty())
    out, lse = ka.varlen_attention_forward(q, k, v, cu_q, cu_k, 0.3, left, right, **kw)
    grads = ka.varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0.3, left, right, **kw)

    # The CPU path runs each sequence on its own slice: nothing crosses a boundary there.
    q64, k64, v64, do64 = (t.cpu().double() for t in (q, k, v, dout))
    kw["alibi_slopes"] = slopes.cpu() if alibi else None
    ref_out, ref_lse = cpu.varlen_attention_forward(q64, k64, v64, cu_q.cpu(), cu_k.cpu(), 0.3, left, right, **kw)
    ref = cpu.varlen_attention_backward(do64, q64, k64, v64, ref_out, ref_lse, cu_q.cpu(), cu_k.cpu(), 0.3, left,
                                        right, **kw)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b, s in enumerate(scales):  # every row of every sequence, each at its own magnitude
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        checks = (("out", out[sq], ref_out[sq], s), ("lse", lse[:, sq], ref_lse[:, sq], 1.0),
                  ("dq", grads[0][sq], ref[0][sq], s * s), ("dk", grads[1][sk], ref[1][sk], s * s),
                  ("dv", grads[2][sk], ref[2][sk], s))
        for name, got, want, mag in checks:
            torch.testing.assert_close(got.cpu().double(), want, atol=2e-5 * mag, rtol=1e-4, msg=f"{name}[{b}]")
    for name, rest in (("out", out[tq:]), ("lse", lse[:, tq:]), ("dq", grads[0][tq:]), ("dk", grads[1][tk:]),
                       ("dv", grads[2][tk:])):
        assert rest.isnan().all(), f"{name}: rows after the last sequence were written"


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


def test_varlen_traces_with_fullgraph():
    """The cu_seqlens value check reads values on the host, which tracing cannot: it is
    skipped while torch.compile traces (the check runs again in every eager call)."""
    q = torch.randn(9, 2, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    fn = torch.compile(lambda q, cu: flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=True),
                       fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(q, cu), flashtile.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=True))
