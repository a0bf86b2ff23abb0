"""flashtile.fp8's public functions on the CPU: validation, quantisation, the CPU attention path.

The kernel itself is tested in ``tests/kernels/test_attention_fp8.py``.
"""

import math

import pytest
import torch
from helpers import random_qkv, reference_attention

from flashtile.fp8 import E4M3_MAX, flash_attn_fp8_func, quantize_fp8, transpose_v

FP8 = torch.float8_e4m3fn


def _fp8_inputs(batch=1, seqlen_q=20, seqlen_k=30, nheads=4, nheads_k=2, headdim=32, granularity="head", seed=0):
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, seed=seed)
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(q, granularity, nheads_k=nheads_k if granularity == "head" else None),
                                    quantize_fp8(k, granularity), quantize_fp8(v, granularity))
    return q8, k8, v8, qd, kd, vd


def _dequantized(q8, k8, v8, qd, kd, vd):
    group = q8.shape[2] // k8.shape[2]

    def deq(x, d, g):
        d = d.double()
        if d.dim() == 2:
            d = d.repeat_interleave(g, dim=1)[:, None, :, None]
        return x.double() * d

    return deq(q8, qd, group), deq(k8, kd, 1), deq(v8, vd, 1)


# --------------------------------------------------------------------------------------
# quantize_fp8
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_quantize_round_trip(dtype, granularity):
    """Each element within half an e4m3 step: 2^-4 relative on normal numbers, and half the
    subnormal step (2^-10 in scaled units) below them; each group's amax lands on 448."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 50, 4, 32, generator=gen) * torch.tensor([1.0, 30.0, 1e-3, 5.0])[:, None]).to(dtype)
    x8, descale = quantize_fp8(x, granularity)
    assert x8.dtype == FP8 and x8.shape == x.shape and descale.dtype == torch.float32
    assert descale.shape == ((1,) if granularity == "tensor" else (2, 4))
    scale = descale if granularity == "tensor" else descale[:, None, :, None]
    xf = x.float()
    back = x8.float() * scale
    bound = 2.0 ** -4 * xf.abs() + 2.0 ** -10 * scale
    assert ((back - xf).abs() <= bound * (1 + 1e-6)).all()
    peak = x8.float().abs().amax() if granularity == "tensor" else x8.float().abs().amax(dim=(1, 3))
    assert torch.all(peak == E4M3_MAX)


def test_quantize_per_head_groups_query_heads_for_gqa():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 10, 6, 16, generator=gen) * torch.tensor([1.0, 9.0, 2.0, 3.0, 0.5, 0.1])[:, None]
    q8, descale = quantize_fp8(q, "head", nheads_k=2)
    assert descale.shape == (2, 2)
    groups = q.reshape(2, 10, 2, 3, 16).abs().amax(dim=(1, 3, 4))
    torch.testing.assert_close(descale, groups / E4M3_MAX)
    back = q8.float() * descale.repeat_interleave(3, dim=1)[:, None, :, None]
    torch.testing.assert_close(back, q, atol=2.0 ** -10 * descale.max().item(), rtol=2.0 ** -4)


def test_quantize_zero_and_saturation():
    x8, descale = quantize_fp8(torch.zeros(1, 3, 2, 16), "head")
    assert torch.equal(descale, torch.ones(1, 2)) and (x8.float() == 0).all()
    x = torch.full((1, 2, 1, 16), 1000.0)
    x8, descale = quantize_fp8(x)
    assert torch.isfinite(x8.float()).all() and (x8.float() == E4M3_MAX).all()


def test_quantize_errors():
    x = torch.randn(1, 4, 2, 16)
    with pytest.raises(TypeError, match="x"):
        quantize_fp8(x.numpy())
    with pytest.raises(ValueError, match="4 dimensions"):
        quantize_fp8(x[0])
    with pytest.raises(ValueError, match="bfloat16"):
        quantize_fp8(x.double())
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(x, "channel")
    with pytest.raises(NotImplementedError, match="block"):
        quantize_fp8(x, "block")
    with pytest.raises(ValueError, match="nheads_k"):
        quantize_fp8(x, "head", nheads_k=3)
    with pytest.raises(TypeError, match="nheads_k"):
        quantize_fp8(x, "head", nheads_k=1.0)


# --------------------------------------------------------------------------------------
# flash_attn_fp8_func on the CPU: dequantise, then flashtile's tiled CPU attention
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_cpu_path_matches_reference(causal, granularity):
    """fp32 computation, bf16 output: within one bf16 rounding (2^-9 relative) of float64."""
    q8, k8, v8, qd, kd, vd = _fp8_inputs(seqlen_q=37, seqlen_k=23, granularity=granularity)
    out, lse = flash_attn_fp8_func(q8, k8, v8, qd, kd, vd, softmax_scale=0.3, causal=causal, return_lse=True)
    ref_out, ref_lse = reference_attention(*_dequantized(q8, k8, v8, qd, kd, vd), softmax_scale=0.3, causal=causal)
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape and not out.requires_grad
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 37)
    assert ((out.double() - ref_out).abs() <= 2.0 ** -8 * ref_out.abs() + 1e-5).all()
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty)
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=1e-5, rtol=1e-5)


def test_cpu_path_defaults_and_transposed_v():
    q8, k8, v8, qd, kd, vd = _fp8_inputs(granularity="tensor")
    out = flash_attn_fp8_func(q8, k8, v8)  # descales default to 1, scale to headdim ** -0.5
    ref, _ = reference_attention(q8.double(), k8.double(), v8.double(), softmax_scale=32 ** -0.5)
    assert ((out.double() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5).all()
    v_t = transpose_v(v8)
    assert v_t.shape == (1, 2, 32, 30) and v_t.stride(-1) == 1 and v_t.stride(-2) % 16 == 0
    assert torch.equal(v_t.float(), v8.float().permute(0, 2, 3, 1))
    out_t = flash_attn_fp8_func(q8, k8, v_t, qd, kd, vd, causal=True, v_transposed=True)
    assert torch.equal(out_t, flash_attn_fp8_func(q8, k8, v8, qd, kd, vd, causal=True))


def test_max_offset_is_accepted_and_lse_is_natural_log():
    q8, k8, v8, qd, kd, vd = _fp8_inputs(seqlen_q=1, seqlen_k=1, nheads=1, nheads_k=1)
    out, lse = flash_attn_fp8_func(q8, k8, v8, qd, kd, vd, return_lse=True, max_offset=False)
    # One key: its probability is 1, out = v, LSE = the single scaled score.
    score = (q8.double() * qd.double()).flatten() @ (k8.double() * kd.double()).flatten() / math.sqrt(32)
    assert abs(lse.item() - score.item()) < 1e-5 * (1 + abs(score.item()))
    torch.testing.assert_close(out.double(), (v8.double() * vd.double()).to(torch.bfloat16).double())


def test_validation_errors():
    q8, k8, v8, _, kd, _ = _fp8_inputs()
    f = flash_attn_fp8_func
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        f(q8.float().numpy(), k8, v8)
    with pytest.raises(ValueError, match="q must have dtype torch.float8_e4m3fn"):
        f(q8.float(), k8, v8)
    with pytest.raises(ValueError, match="k must have dtype torch.float8_e4m3fn"):
        f(q8, k8.to(torch.float8_e5m2), v8)
    with pytest.raises(ValueError, match="v must have 4 dimensions"):
        f(q8, k8, v8[0])
    with pytest.raises(ValueError, match="v must have shape"):
        f(q8, k8, v8[:, :5])
    with pytest.raises(ValueError, match="v must have shape"):
        f(q8, k8, v8, v_transposed=True)
    with pytest.raises(ValueError, match="batch size"):
        f(q8, torch.cat([k8.view(torch.uint8)] * 2).view(FP8), torch.cat([v8.view(torch.uint8)] * 2).view(FP8))
    with pytest.raises(ValueError, match="head dimension"):
        f(q8[..., :24], k8[..., :24], v8[..., :24])
    with pytest.raises(ValueError, match="GQA"):
        f(q8[:, :, :3], k8, v8)
    with pytest.raises(ValueError, match=r"contiguous in its last \(head\) dimension"):
        f(q8.transpose(1, 3), k8, v8)
    with pytest.raises(TypeError, match="q_descale must be a torch.Tensor or None"):
        f(q8, k8, v8, q_descale=1.0)
    with pytest.raises(ValueError, match="k_descale must be torch.float32"):
        f(q8, k8, v8, k_descale=kd.double())
    with pytest.raises(ValueError, match=r"v_descale must have shape \(1,\)"):
        f(q8, k8, v8, v_descale=torch.ones(1, 4))
    with pytest.raises(ValueError, match="q_descale must be positive"):
        f(q8, k8, v8, q_descale=torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="k_descale must be positive"):
        f(q8, k8, v8, k_descale=torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="softmax_scale"):
        f(q8, k8, v8, softmax_scale=0.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        f(q8, k8, v8, softmax_scale="0.1")
    for name in ("causal", "return_lse", "max_offset", "v_transposed"):
        with pytest.raises(TypeError, match=name):
            f(q8, k8, v8, **{name: 1})
