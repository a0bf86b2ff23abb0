"""``apply_rotary_emb`` against the float64 NumPy reference (``flashtile.reference.rotary``).

The PyTorch path runs on CPU tensors; the Triton kernel runs in the interpreter on CPU
tensors (directly, and under the public function with its dispatch pointed at the kernel),
and on a GPU in the ``gpu`` tests.  The interpreter's float16 is exact enough here (no
``tl.dot``); bfloat16 is covered on the GPU.
"""

import os

import numpy as np
import pytest
import torch

import flashtile
import flashtile.rotary as rotary_module
from flashtile import apply_rotary_emb
from flashtile.kernels import rotary as rotary_kernel
from flashtile.reference.rotary import apply_rotary_naive

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                   reason="needs a GPU or TRITON_INTERPRET=1")

# Outputs are rounded once from float32: half an ulp of the output dtype, relative.
ATOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rope_tables(seqlen_ro, rotary_dim, dtype=torch.float32, device="cpu", base=10000.0):
    """The usual RoPE tables: angle ``p * base ** (-2k / rotary_dim)`` for pair k at position p."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def reference(x, cos, sin, **kw):
    return torch.from_numpy(apply_rotary_naive(x.double().cpu(), cos.double().cpu(), sin.double().cpu(), **kw))


def assert_close(got, want, dtype):
    got = got.double().cpu()
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max())
    assert err <= ATOL[dtype] * scale, f"max abs error {err:.3g} > {ATOL[dtype] * scale:.3g}"


def _offsets(kind, batch, device="cpu"):
    if kind == "int":
        return 3
    if kind == "tensor":
        return torch.tensor([0, 5, 2][:batch], dtype=torch.int32, device=device)
    return 0


# --- the reference itself ----------------------------------------------------------------------------


def test_reference_is_a_rotation_whose_adjoint_is_the_conjugate():
    """<R x, y> == <x, R^T y> with R^T the conjugate rotation, and |R x| == |x| per pair."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 1, 6, 2, 8))
    cos, sin = (t.numpy() for t in rope_tables(10, 6, torch.float64))
    for interleaved in (False, True):
        rx = apply_rotary_naive(x, cos, sin, interleaved=interleaved, seqlen_offsets=2)
        rty = apply_rotary_naive(y, cos, sin, interleaved=interleaved, seqlen_offsets=2, conjugate=True)
        np.testing.assert_allclose((rx * y).sum(), (x * rty).sum(), rtol=1e-12)
        np.testing.assert_allclose(np.linalg.norm(rx[..., :6]), np.linalg.norm(x[..., :6]), rtol=1e-12)
        np.testing.assert_array_equal(rx[..., 6:], x[..., 6:])


def test_reference_layouts_are_a_permutation_of_each_other():
    """Interleaved pairs (2k, 2k+1) are the halves layout after de-interleaving the features."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3, 8))
    cos, sin = (t.numpy() for t in rope_tables(5, 8, torch.float64))
    halves_order = np.r_[0:8:2, 1:8:2]
    inter = apply_rotary_naive(x, cos, sin, interleaved=True)
    halves = apply_rotary_naive(x[..., halves_order], cos, sin, interleaved=False)
    np.testing.assert_allclose(inter[..., halves_order], halves, rtol=0, atol=1e-14)


def test_reference_position_zero_is_the_identity_and_offsets_shift_positions():
    x = np.arange(2 * 4 * 1 * 4, dtype=np.float64).reshape(2, 4, 1, 4)
    cos, sin = (t.numpy() for t in rope_tables(8, 4, torch.float64))
    out = apply_rotary_naive(x, cos, sin)
    np.testing.assert_array_equal(out[:, 0], x[:, 0])
    shifted = apply_rotary_naive(x[:, 1:], cos, sin, seqlen_offsets=1)
    np.testing.assert_allclose(shifted, out[:, 1:], rtol=0, atol=1e-12)


# --- the PyTorch path (CPU tensors) and the kernel -----------------------------------------------------

SHAPE = dict(batch=2, seqlen=7, nheads=3, headdim=16)


def _run_dense(rotate_fn, dtype, interleaved, fraction, offsets_kind, inplace, device="cpu"):
    b, n, h, d = SHAPE.values()
    rotary_dim = int(d * fraction)
    torch.manual_seed(0)
    x = torch.randn(b, n, h, d, dtype=dtype).to(device)
    cos, sin = rope_tables(n + 5, rotary_dim, dtype, device)
    offsets = _offsets(offsets_kind, b, device)
    want = reference(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets.cpu().numpy()
                     if isinstance(offsets, torch.Tensor) else offsets)
    x_in = x.clone()
    out = rotate_fn(x_in, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=offsets)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, want, dtype)
    if inplace:
        assert out.data_ptr() == x_in.data_ptr()
    else:
        assert torch.equal(x_in, x), "x must be left unchanged when not in place"
    if rotary_dim < d:
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:]), "features past rotary_dim pass through"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("offsets_kind", ["zero", "int", "tensor"])
@pytest.mark.parametrize("inplace", [False, True])
def test_cpu_path_matches_reference(dtype, interleaved, fraction, offsets_kind, inplace):
    _run_dense(apply_rotary_emb, dtype, interleaved, fraction, offsets_kind, inplace)


def _through_kernel(monkeypatch):
    """The public function with the kernel behind it: CUDA tensors take it anyway; in the
    interpreter the CPU tensors are sent to it instead of the PyTorch path."""
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(rotary_module, "_backend", lambda x: rotary_kernel.rotate)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("offsets_kind,inplace", [("zero", False), ("int", True), ("tensor", False), ("tensor", True)])
def test_kernel_matches_reference(monkeypatch, dtype, interleaved, fraction, offsets_kind, inplace):
    _through_kernel(monkeypatch)
    _run_dense(apply_rotary_emb, dtype, interleaved, fraction, offsets_kind, inplace, KERNEL_DEVICE)


def _run_varlen(dtype, interleaved, fraction, offsets_kind, inplace, device="cpu"):
    lengths = [3, 0, 6]
    cu_seqlens = torch.tensor([0, 3, 3, 9], dtype=torch.int32, device=device)
    nheads, d = 2, 16
    rotary_dim = int(d * fraction)
    torch.manual_seed(1)
    x = torch.randn(sum(lengths), nheads, d, dtype=dtype).to(device)
    cos, sin = rope_tables(12, rotary_dim, dtype, device)
    offsets = _offsets(offsets_kind, len(lengths), device)
    np_offsets = offsets.cpu().numpy() if isinstance(offsets, torch.Tensor) else offsets
    want = reference(x, cos, sin, interleaved=interleaved, seqlen_offsets=np_offsets,
                     cu_seqlens=cu_seqlens.cpu().numpy())
    x_in = x.clone()
    out = apply_rotary_emb(x_in, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=offsets,
                           cu_seqlens=cu_seqlens, max_seqlen=max(lengths))
    assert_close(out, want, dtype)
    assert (out.data_ptr() == x_in.data_ptr()) == inplace


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("offsets_kind,inplace", [("zero", False), ("int", True), ("tensor", False)])
def test_cpu_varlen_matches_reference(interleaved, fraction, offsets_kind, inplace):
    _run_varlen(torch.float32, interleaved, fraction, offsets_kind, inplace)


@needs_kernels
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("offsets_kind,inplace", [("int", False), ("tensor", True)])
def test_kernel_varlen_matches_reference(monkeypatch, interleaved, fraction, offsets_kind, inplace):
    _through_kernel(monkeypatch)
    _run_varlen(torch.float16, interleaved, fraction, offsets_kind, inplace, KERNEL_DEVICE)


def _run_grad(dtype, interleaved, fraction, inplace, varlen, device="cpu"):
    torch.manual_seed(2)
    d = 16
    rotary_dim = int(d * fraction)
    if varlen:
        cu_seqlens, max_seqlen = torch.tensor([0, 4, 9], dtype=torch.int32, device=device), 5
        shape = (9, 2, d)
        offsets = torch.tensor([1, 3], dtype=torch.int64, device=device)
    else:
        cu_seqlens, max_seqlen = None, None
        shape = (2, 5, 2, d)
        offsets = torch.tensor([1, 3], dtype=torch.int32, device=device)
    cos, sin = rope_tables(9, rotary_dim, dtype, device)
    leaf = torch.randn(shape, dtype=dtype).to(device).requires_grad_()
    dout = torch.randn(shape, dtype=dtype).to(device)
    x = leaf * 1 if inplace else leaf  # in place needs a non-leaf
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=offsets,
                           cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    out.backward(dout)
    kw = dict(interleaved=interleaved, seqlen_offsets=offsets.cpu().numpy(),
              cu_seqlens=None if cu_seqlens is None else cu_seqlens.cpu().numpy())
    assert_close(leaf.grad, reference(dout, cos, sin, conjugate=True, **kw), dtype)
    # And the backward is the adjoint of the forward: <R x, dout> == <x, R^T dout>.
    rx = reference(leaf.detach(), cos, sin, **kw)
    x64, dout64, grad64 = (t.detach().double().cpu() for t in (leaf, dout, leaf.grad))
    assert torch.allclose((rx * dout64).sum(), (x64 * grad64).sum(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_cpu_gradient_is_the_conjugate_rotation(interleaved, fraction, inplace, varlen):
    _run_grad(torch.float32, interleaved, fraction, inplace, varlen)


@needs_kernels
@pytest.mark.parametrize("interleaved,fraction,inplace,varlen", [
    (False, 1.0, False, False), (True, 0.5, True, False), (False, 0.5, True, True), (True, 1.0, False, True),
])
def test_kernel_gradient_is_the_conjugate_rotation(monkeypatch, interleaved, fraction, inplace, varlen):
    _through_kernel(monkeypatch)
    _run_grad(torch.float32, interleaved, fraction, inplace, varlen, KERNEL_DEVICE)


@needs_kernels
def test_kernel_reads_and_writes_strided_views():
    """q of a packed qkv view (strided in every axis but the last), into a strided output."""
    torch.manual_seed(3)
    qkv = torch.randn(2, 6, 3, 4, 32, dtype=torch.float16).to(KERNEL_DEVICE)
    q = qkv[:, :, 0]
    cos, sin = rope_tables(6, 16, torch.float16, KERNEL_DEVICE)
    want = reference(q, cos, sin)
    out = torch.full_like(qkv, float("nan"))[:, :, 2]
    rotary_kernel.rotate(q, cos, sin, out, interleaved=False, conjugate=False, seqlen_offsets=0, cu_seqlens=None,
                         max_seqlen=None)
    assert_close(out, want, torch.float16)
    assert torch.equal(out[..., 16:], q[..., 16:])
    rotary_kernel.rotate(q, cos, sin, q, interleaved=False, conjugate=False, seqlen_offsets=0, cu_seqlens=None,
                         max_seqlen=None)
    assert_close(qkv[:, :, 0], want, torch.float16)


@needs_kernels
def test_kernel_leaves_positions_outside_the_table_unrotated():
    """What a CUDA offset tensor (not read on the host) past the table gives: no rotation."""
    x = torch.randn(2, 3, 1, 8).to(KERNEL_DEVICE)
    cos, sin = rope_tables(4, 8, device=KERNEL_DEVICE)
    offsets = torch.tensor([0, 2], dtype=torch.int32, device=KERNEL_DEVICE)  # sequence 1 reaches positions 2, 3, 4
    out = rotary_kernel.rotate(x, cos, sin, torch.empty_like(x), interleaved=True, conjugate=False,
                               seqlen_offsets=offsets, cu_seqlens=None, max_seqlen=None)
    assert torch.equal(out[1, 2], x[1, 2])
    assert_close(out[1, :2], reference(x[1:, :2], cos, sin, interleaved=True, seqlen_offsets=2)[0], torch.float32)


def test_inplace_on_a_view_of_a_packed_tensor_sends_gradients_to_it():
    torch.manual_seed(4)
    leaf = torch.randn(1, 4, 3, 2, 8, requires_grad=True)
    qkv = leaf * 1
    cos, sin = rope_tables(4, 8)
    apply_rotary_emb(qkv[:, :, 0], cos, sin, inplace=True)
    apply_rotary_emb(qkv[:, :, 1], cos, sin, inplace=True)
    dout = torch.randn_like(qkv)
    qkv.backward(dout)
    want = dout.clone().double()
    for i in (0, 1):
        want[:, :, i] = reference(dout[:, :, i], cos, sin, conjugate=True)
    assert_close(leaf.grad, want, torch.float32)


def test_float32_tables_with_half_inputs():
    x = torch.randn(1, 5, 2, 8, dtype=torch.float16)
    cos, sin = rope_tables(5, 8, torch.float32)
    assert_close(apply_rotary_emb(x, cos, sin), reference(x, cos, sin), torch.float16)


def test_exported_from_flashtile_and_compat():
    assert flashtile.apply_rotary_emb is apply_rotary_emb
    assert flashtile.compat.apply_rotary_emb is apply_rotary_emb


# --- argument checking -----------------------------------------------------------------------------------


def _bad_cases():
    x = torch.randn(2, 6, 2, 16)
    cos, sin = rope_tables(8, 8)
    cu, packed = torch.tensor([0, 2, 6], dtype=torch.int32), torch.randn(6, 2, 16)
    return [
        ("x not a tensor", dict(x=x.tolist()), TypeError, "x must be a torch.Tensor"),
        ("x rank", dict(x=x[0]), ValueError, "x must have shape"),
        ("x dtype", dict(x=x.double()), ValueError, "x must have dtype"),
        ("cos rank", dict(cos=cos[0]), ValueError, "cos must have shape"),
        ("cos not a tensor", dict(cos=0.5), TypeError, "cos must be a torch.Tensor"),
        ("sin shape", dict(sin=sin[:, :3]), ValueError, "sin must have cos's shape"),
        ("sin dtype", dict(sin=sin.half()), ValueError, "cos and sin must share one dtype"),
        ("cos dtype", dict(cos=cos.double(), sin=sin.double()), ValueError, "cos and sin must have x's dtype"),
        ("rotary_dim > headdim", dict(cos=rope_tables(8, 20)[0], sin=rope_tables(8, 20)[1]), ValueError,
         "rotary_dim = 2 \\* cos.shape\\[1\\] = 20 exceeds"),
        ("empty rotary", dict(cos=cos[:, :0], sin=sin[:, :0]), ValueError, "rotary_dim / 2 >= 1"),
        ("seqlen_ro too short", dict(cos=cos[:5], sin=sin[:5]), ValueError, "fewer than seqlen"),
        ("int offset too far", dict(seqlen_offsets=3), ValueError, "seqlen_offsets \\(3\\)"),
        ("negative offset", dict(seqlen_offsets=-1), ValueError, "seqlen_offsets \\(-1\\)"),
        ("offset type", dict(seqlen_offsets=1.0), TypeError, "seqlen_offsets must be an int"),
        ("offset bool", dict(seqlen_offsets=True), TypeError, "seqlen_offsets must be an int"),
        ("offset tensor dtype", dict(seqlen_offsets=torch.zeros(2)), ValueError, "seqlen_offsets must be an int32"),
        ("offset tensor shape", dict(seqlen_offsets=torch.zeros(3, dtype=torch.int32)), ValueError, "shape \\(batch,\\)"),
        ("offset tensor too far", dict(seqlen_offsets=torch.tensor([0, 3])), ValueError, "seqlen_offsets \\+ sequence"),
        ("offset tensor negative", dict(seqlen_offsets=torch.tensor([0, -1])), ValueError, "seqlen_offsets \\+ sequence"),
        ("interleaved type", dict(interleaved=1), TypeError, "interleaved must be a bool"),
        ("inplace type", dict(inplace=None), TypeError, "inplace must be a bool"),
        ("packed x without cu_seqlens", dict(x=packed), ValueError, "x must have shape \\(batch"),
        ("cu_seqlens with 4-D x", dict(cu_seqlens=cu, max_seqlen=4), ValueError, "x must have shape \\(total"),
        ("cu_seqlens without max_seqlen", dict(x=packed, cu_seqlens=cu), TypeError, "max_seqlen"),
        ("cu_seqlens dtype", dict(x=packed, cu_seqlens=cu.long(), max_seqlen=4), ValueError, "cu_seqlens must be torch.int32"),
        ("cu_seqlens end", dict(x=packed[:5], cu_seqlens=cu, max_seqlen=4), ValueError, "cu_seqlens must start at 0"),
        ("max_seqlen small", dict(x=packed, cu_seqlens=cu, max_seqlen=3), ValueError, "max_seqlen"),
        ("max_seqlen > seqlen_ro", dict(x=packed, cu_seqlens=cu, max_seqlen=9), ValueError, "fewer than max_seqlen"),
        ("varlen offsets too far", dict(x=packed, cu_seqlens=cu, max_seqlen=4, seqlen_offsets=torch.tensor([7, 4])),
         ValueError, "seqlen_offsets \\+ sequence"),
    ], (x, cos, sin)


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])), ids=[c[0] for c in _bad_cases()[0]])
@pytest.mark.parametrize("inplace", [False, True])
def test_bad_arguments_raise_naming_them_before_writing(case, inplace):
    cases, (x, cos, sin) = _bad_cases()
    _, override, error, message = cases[case]
    kwargs = dict(x=x, cos=cos, sin=sin, inplace=inplace) | override
    target = kwargs["x"]
    before = target.clone() if isinstance(target, torch.Tensor) else None
    with pytest.raises(error, match=message):
        apply_rotary_emb(**kwargs)
    if before is not None:
        assert torch.equal(target, before), "nothing may be written before the arguments are checked"


def test_inplace_on_a_leaf_that_requires_grad_is_refused():
    x = torch.randn(1, 2, 1, 4, requires_grad=True)
    cos, sin = rope_tables(2, 4)
    with pytest.raises(ValueError, match="inplace=True"):
        apply_rotary_emb(x, cos, sin, inplace=True)


# --- GPU --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_gpu_matches_reference(dtype, interleaved, fraction):
    torch.manual_seed(5)
    b, n, h, d = 3, 1000, 12, 128
    rotary_dim = int(d * fraction)
    x = torch.randn(b, n, h, d, dtype=dtype, device="cuda")
    cos, sin = rope_tables(n + 50, rotary_dim, dtype, "cuda")
    offsets = torch.tensor([0, 50, 17], dtype=torch.int32, device="cuda")
    want = reference(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets.cpu().numpy())
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    assert_close(out, want, dtype)
    torch.cuda.synchronize()
    xi = x.clone()
    apply_rotary_emb(xi, cos, sin, interleaved=interleaved, seqlen_offsets=offsets, inplace=True)
    assert torch.equal(xi, out)

    leaf = x.clone().requires_grad_()
    dout = torch.randn_like(x)
    apply_rotary_emb(leaf, cos, sin, interleaved=interleaved, seqlen_offsets=offsets).backward(dout)
    want_grad = reference(dout, cos, sin, interleaved=interleaved, seqlen_offsets=offsets.cpu().numpy(),
                          conjugate=True)
    assert_close(leaf.grad, want_grad, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_varlen_matches_reference(interleaved):
    torch.manual_seed(6)
    lengths = [100, 0, 257, 31]
    cu_seqlens = torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32, device="cuda")
    x = torch.randn(sum(lengths), 8, 64, dtype=torch.bfloat16, device="cuda")
    cos, sin = rope_tables(400, 32, torch.bfloat16, "cuda")
    offsets = torch.tensor([3, 0, 100, 300], dtype=torch.int64, device="cuda")
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                           max_seqlen=max(lengths))
    want = reference(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets.cpu().numpy(),
                     cu_seqlens=cu_seqlens.cpu().numpy())
    assert_close(out, want, torch.bfloat16)
