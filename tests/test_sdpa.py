"""flashtile.scaled_dot_product_attention against PyTorch's own, on every mask kind and routing path.

Each case compares the output and the gradients of query, key and value with
``torch.nn.functional.scaled_dot_product_attention`` (float32, CPU), and, where the case is
meant to run flashtile's kernels, checks that PyTorch's SDPA was *not* what computed it.
"""

import pytest
import torch
import torch.nn.functional as F

import flashtile
import flashtile.sdpa as sdpa_module
from helpers import assert_close_to_reference
from flashtile.masking import mask_array

TOL = {"atol": 2e-5, "rtol": 1e-4}


def _qkv(b, h, hk, lq, lk, d, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hk, lk, d, generator=g)
    v = torch.randn(b, hk, lk, d, generator=g)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


@pytest.fixture
def torch_sdpa_calls(monkeypatch):
    """Counts the calls that flashtile hands to PyTorch's SDPA (its slow path)."""
    calls = []
    real = sdpa_module._torch_sdpa
    monkeypatch.setattr(sdpa_module, "_torch_sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _compare(q, k, v, **kwargs):
    ours = flashtile.scaled_dot_product_attention(q, k, v, **kwargs)
    ref = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(ours, ref, **TOL)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, **TOL)
    return ours


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(17, 17), (9, 23), (23, 9), (1, 12)])
def test_no_mask_runs_the_kernels_with_torchs_top_left_causal(causal, lq, lk, torch_sdpa_calls):
    q, k, v = _qkv(2, 4, 4, lq, lk, 16)
    _compare(q, k, v, is_causal=causal, scale=0.3)
    assert torch_sdpa_calls == []


def test_gqa_needs_enable_gqa(torch_sdpa_calls):
    q, k, v = _qkv(1, 8, 2, 10, 13, 16)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashtile.scaled_dot_product_attention(q, k, v)
    _compare(q, k, v, enable_gqa=True, is_causal=True)
    assert torch_sdpa_calls == []


@pytest.mark.parametrize("shape", [(3, 1, 1, 11), (1, 1, 1, 11), (1, 1, 11), (1, 11)])
def test_bool_key_padding_masks_run_the_packed_kernels(shape, torch_sdpa_calls):
    q, k, v = _qkv(3, 4, 2, 6, 11, 16, seed=1)
    keep = torch.ones(3, 11, dtype=torch.bool)
    keep[0, 7:] = False
    keep[1, :3] = False
    keep[2, 4] = False
    mask = keep.reshape(shape) if shape[0] == 3 else keep[1].reshape(shape)  # per batch entry, or shared
    _compare(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch_sdpa_calls == []


def test_batch_entry_without_any_key_gives_zeros_like_torch(torch_sdpa_calls):
    """torch >= 2.5 gives 0 for a fully masked query row (older versions: NaN); so does flashtile."""
    q, k, v = _qkv(2, 2, 2, 5, 7, 8, seed=2)
    keep = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keep[1] = False
    out = _compare(q, k, v, attn_mask=keep)
    assert torch.equal(out[1].detach(), torch.zeros_like(out[1]))
    assert torch_sdpa_calls == []


def test_additive_key_padding_with_minus_inf(torch_sdpa_calls):
    q, k, v = _qkv(2, 2, 2, 5, 9, 8, seed=3)
    additive = torch.zeros(2, 1, 1, 9)
    additive[0, ..., 6:] = float("-inf")
    additive[1] = float("-inf")  # every key masked: zeros, as torch
    _compare(q, k, v, attn_mask=additive)
    assert torch_sdpa_calls == []


@pytest.mark.parametrize("lq,lk", [(8, 8), (5, 9), (9, 5)])
@pytest.mark.parametrize("alignment", ["top-left", "bottom-right", "all"])
@pytest.mark.parametrize("as_float", [False, True])
def test_shared_causal_patterns_are_recognised(lq, lk, alignment, as_float, torch_sdpa_calls):
    q, k, v = _qkv(2, 4, 4, lq, lk, 16, seed=4)
    if alignment == "top-left":
        keep = torch.ones(lq, lk, dtype=torch.bool).tril()
    elif alignment == "bottom-right":
        keep = mask_array(lq, lk, -1, 0, xp=torch)
    else:
        keep = torch.ones(1, 1, lq, lk, dtype=torch.bool)
    mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) if as_float else keep
    _compare(q, k, v, attn_mask=mask)
    assert torch_sdpa_calls == []


@pytest.mark.parametrize("kind", ["bool-arbitrary", "bool-per-head", "bool-per-batch-causal", "additive-bias",
                                  "additive-with-inf-rows"])
def test_general_masks_take_the_documented_slow_path(kind, torch_sdpa_calls):
    q, k, v = _qkv(2, 2, 2, 5, 7, 8, seed=5)
    g = torch.Generator().manual_seed(6)
    if kind == "bool-arbitrary":
        mask = torch.rand(2, 2, 5, 7, generator=g) > 0.3
    elif kind == "bool-per-head":
        mask = torch.ones(1, 2, 1, 7, dtype=torch.bool)
        mask[0, 1, 0, :3] = False
    elif kind == "bool-per-batch-causal":  # causal and key padding combined: a per-batch pattern
        mask = torch.ones(5, 7, dtype=torch.bool).tril() & torch.tensor([[True] * 7, [False] + [True] * 6])[:, None, None]
    elif kind == "additive-bias":
        mask = torch.randn(5, 7, generator=g)
    else:
        mask = torch.randn(2, 1, 5, 7, generator=g)
        mask[0, 0, 2] = float("-inf")  # a fully masked row in a real bias: torch (>= 2.5) gives zeros
    out = _compare(q, k, v, attn_mask=mask)
    assert len(torch_sdpa_calls) == 1
    if kind == "additive-with-inf-rows":
        assert torch.equal(out[0, :, 2].detach(), torch.zeros_like(out[0, :, 2]))


def test_mask_that_requires_grad_keeps_its_gradient(torch_sdpa_calls):
    q, k, v = _qkv(1, 2, 2, 4, 6, 8, seed=7)
    bias = torch.zeros(4, 6, requires_grad=True)
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    (grad,) = torch.autograd.grad(out.sum(), bias)
    (expected,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum(), bias)
    torch.testing.assert_close(grad, expected, **TOL)
    assert len(torch_sdpa_calls) == 1  # it went to PyTorch


def test_three_dimensional_inputs_and_views_of_bshd_tensors(torch_sdpa_calls):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 9, 4, 16, generator=g).requires_grad_()  # (b, s, h, d) as a model holds it
    k = torch.randn(2, 9, 4, 16, generator=g).requires_grad_()
    v = torch.randn(2, 9, 4, 16, generator=g).requires_grad_()
    _compare(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    _compare(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))
    assert torch_sdpa_calls == []


def test_dropout_uses_the_kernels_rng_and_keeps_the_expectation():
    q, k, v = _qkv(2, 2, 2, 8, 8, 16, seed=9, requires_grad=False)
    with flashtile.dropout.capture() as calls:
        out = flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    (seed, offset), = calls
    keep = flashtile.dropout.dropout_mask(seed, offset, 2, 2, 8, 8, 0.25)
    weights = torch.softmax(q @ k.transpose(-1, -2) * 16 ** -0.5, dim=-1)
    expected = (weights * keep / 0.75) @ v
    torch.testing.assert_close(out, expected, **TOL)


def test_inputs_the_kernels_do_not_take_go_to_torch(torch_sdpa_calls):
    q, k, v = _qkv(1, 2, 2, 4, 5, 8, seed=10)
    _compare(q.double(), k.double(), v.double())
    _compare(q, k, v, scale=-0.5)  # the kernels need a positive scale
    g = torch.Generator().manual_seed(11)
    v_wide = torch.randn(1, 2, 5, 12, generator=g, requires_grad=True)  # value head dim != query head dim
    _compare(q, k, v_wide)
    assert len(torch_sdpa_calls) == 3


def test_validation():
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, requires_grad=False)
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="query"):
        flashtile.scaled_dot_product_attention(q[0, 0], k, v)
    with pytest.raises(TypeError, match="key"):
        flashtile.scaled_dot_product_attention(q, None, v)
    with pytest.raises(ValueError, match="attn_mask"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="attn_mask"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=[[True]])
    with pytest.raises(ValueError, match="dropout_p"):
        flashtile.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="is_causal"):
        flashtile.scaled_dot_product_attention(q, k, v, is_causal=1)
    with pytest.raises(ValueError, match="multiple"):
        flashtile.scaled_dot_product_attention(q, k[:, :1].expand(1, 3, 4, 8), v[:, :1].expand(1, 3, 4, 8),
                                               enable_gqa=True)


def test_rank_error_names_each_tensor_with_its_shape():
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, requires_grad=False)
    with pytest.raises(ValueError) as err:
        flashtile.scaled_dot_product_attention(q, k[0], v)
    msg = str(err.value)
    assert msg.startswith("key must be")
    assert f"got query {tuple(q.shape)}, key {tuple(k[0].shape)}, value {tuple(v.shape)}" in msg


def _gpu_mask(kind, b, lq, lk, g):
    if kind in ("none", "causal"):
        return None
    keep = torch.ones(b, lk, dtype=torch.bool)
    keep[0, lk // 2:] = False  # a padded batch entry
    if kind == "bool-key-padding":
        return keep[:, None, None, :].cuda()
    if kind == "additive-key-padding":
        return torch.zeros(b, 1, 1, lk).masked_fill(~keep[:, None, None, :], float("-inf")).cuda()
    return (torch.rand(b, 1, lq, lk, generator=g) > 0.3).cuda()  # "general": the slow path


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["none", "causal", "bool-key-padding", "additive-key-padding", "general"])
def test_gpu_bf16_within_twice_torchs_error(kind):
    """On a GPU, in bf16: output and gradients within 2x PyTorch's own bf16 error (vs float64) + a floor."""
    b, h, hk, lq, lk, d = 2, 8, 2, 300, 517, 64
    g = torch.Generator().manual_seed(7)
    q64, k64, v64 = (torch.randn(b, n, length, d, generator=g, dtype=torch.float64).cuda()
                     for n, length in ((h, lq), (hk, lk), (hk, lk)))
    mask = _gpu_mask(kind, b, lq, lk, g)
    dout = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64).cuda()
    kwargs = dict(attn_mask=mask, is_causal=kind == "causal", enable_gqa=True)

    def run(fn, dtype):
        q, k, v = (t.to(dtype).requires_grad_(True) for t in (q64, k64, v64))
        out = fn(q, k, v, **kwargs)
        return (out, *torch.autograd.grad(out, (q, k, v), dout.to(dtype)))

    ref64 = run(F.scaled_dot_product_attention, torch.float64)
    ref_bf16 = run(F.scaled_dot_product_attention, torch.bfloat16)
    ours = run(flashtile.scaled_dot_product_attention, torch.bfloat16)
    for name, a, r64, rlow in zip(("out", "dq", "dk", "dv"), ours, ref64, ref_bf16):
        assert_close_to_reference(a, r64, rlow, name=f"{kind} {name}", atol_floor=1e-3)
