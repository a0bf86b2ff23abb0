"""The FP8 attention kernel against the float64 oracle of its dequantised inputs.

Tolerance.  The oracle is exact attention on ``q_fp8 * q_descale`` etc., so the inputs'
own quantisation is not error here; what remains is the kernel's rounding of P to e4m3
(3 mantissa bits: relative error up to 2^-4 per probability) and of the output to bf16.
The yardstick is an *emulated* FP8 attention (``_emulated``): the same two roundings, done
once in float64 with the exact row max -- the error any correct FP8 kernel makes, up to
which probabilities happen to round which way.  The kernel keeps a running max instead,
so its P values round at other points of the grid: a different draw of errors of the same
size.  Rule: ``max|out - ref64| <= 2 * max|emulated - ref64| + floor`` with the floor half a
bf16 ulp of the largest output (``2^-9 * max|ref64|``): when the emulation's error is pure
output rounding (one key: P = 256 exactly), the kernel's extra fp32 multiply before its
bf16 cast may land one rounding step elsewhere.  Measured ratios kernel / emulation are
0.9-1.0 in the interpreter, so the factor 2 is slack for the GPU, not for bugs: a wrong
descale, head mapping or mask is off by O(|out|), far above the bound.

The bound alone would pass a kernel that skipped the max offset (its *max* error is the
same -- the large probabilities round identically on either scale).  The offset's effect is
a bias: without it, probabilities below 2^-10 of the row max flush to 0 while the fp32 row
sum still counts them, shrinking every output toward 0.  ``test_max_offset_removes_...``
measures that bias with V = 1 (output = sum of rounded P / row sum) and must fail for a
kernel whose offset does nothing.

Triton 3.6's interpreter runs the FP8 dots correctly but its fp32 -> e4m3 and fp32 -> bf16
casts truncate; the kernel rounds explicitly there (``EXACT_ROUNDING``), which
``test_interpreter_rounding_matches_torch`` checks value by value.
"""

import math
import os

import pytest
import torch
from helpers import random_qkv, reference_attention

from flashtile.fp8 import flash_attn_fp8_func, quantize_fp8, transpose_v
from flashtile.kernels import attention_fp8 as kf8
from flashtile.masking import mask_array

try:  # the Gluon FP8 forward's alternative configurations, checked on the GPU below
    from flashtile.kernels.hopper.attention_fp8 import ALTERNATIVES as GLUON_FP8_ALTERNATIVES
except ImportError:  # a Triton without Gluon: those tests could not run anyway
    GLUON_FP8_ALTERNATIVES = ()

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="interpreter-only check (TRITON_INTERPRET=1)")
needs_kernels = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()), reason="needs a GPU or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# LSE does not see P's rounding (the row sum is fp32), only the scores': exact fp8 products
# summed in fp32 in the interpreter; on Hopper the FP8 wgmma accumulates with fewer bits
# (~13-14 significant bits reported), ~1e-3 of a score at D = 128.
LSE_ATOL = 1e-5 if INTERPRET else 5e-3
HEAD_SCALES = (1.0, 4.0, 0.25, 2.0, 0.5, 8.0, 1.5, 0.75)  # per-head magnitudes: per-head descales differ


def _dequantize(x8, descale, heads_per_descale=1):
    d = descale.double()
    if d.dim() == 2:
        d = d.repeat_interleave(heads_per_descale, dim=1)[:, None, :, None]
    return x8.double() * d


def _emulated(qf, kf, vf, scale, causal, offset):
    """FP8 attention in float64 with the exact row max: P * 2^offset rounded to e4m3, out to bf16."""
    nq, nheads, nk, nheads_k = qf.shape[1], qf.shape[2], kf.shape[1], kf.shape[2]
    group = nheads // nheads_k
    k, v = kf.repeat_interleave(group, dim=2), vf.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, k) * (scale * math.log2(math.e))
    visible = mask_array(nq, nk, -1, 0 if causal else -1, xp=torch, device=qf.device).expand(nq, nk)
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    p = torch.exp2(s - m + offset)
    l = p.sum(dim=-1, keepdim=True)
    p_fp8 = p.to(torch.float8_e4m3fn).double()
    out = torch.einsum("bhqk,bkhd->bqhd", p_fp8 / torch.where(l == 0, 1.0, l), v)
    return out.to(torch.bfloat16).double()


def _quantized_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, granularity, seed=0, device=DEVICE):
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, seed=seed)
    q = q * torch.tensor(HEAD_SCALES[:nheads])[:, None]
    k = k * torch.tensor(HEAD_SCALES[:nheads_k])[:, None]
    v = v * torch.tensor(HEAD_SCALES[::-1][:nheads_k])[:, None]
    nk = nheads_k if granularity == "head" else None
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t.to(device), granularity, nheads_k=n)
                                    for t, n in ((q, nk), (k, None), (v, None)))
    return q8, k8, v8, qd, kd, vd


def _check(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, granularity, max_offset=True, seed=0,
           api=False, v_transposed=True):
    q8, k8, v8, qd, kd, vd = _quantized_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, granularity, seed)
    scale = headdim ** -0.5
    if api:
        out, lse = flash_attn_fp8_func(q8, k8, v8, qd, kd, vd, causal=causal, return_lse=True, max_offset=max_offset)
    else:
        v = transpose_v(v8) if v_transposed else v8
        out, lse = kf8.attention_fp8_forward(q8, k8, v, qd, kd, vd, scale, causal=causal, max_offset=max_offset,
                                             v_transposed=v_transposed)
    assert out.shape == q8.shape and out.dtype == torch.bfloat16
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    qf, kf, vf = _dequantize(q8, qd, nheads // nheads_k), _dequantize(k8, kd), _dequantize(v8, vd)
    ref_out, ref_lse = reference_attention(qf, kf, vf, softmax_scale=scale, causal=causal)
    emulated = _emulated(qf, kf, vf, scale, causal, kf8.MAX_OFFSET if max_offset else 0)
    assert torch.isfinite(out).all()
    err = (out.double() - ref_out).abs().max().item()
    yardstick = (emulated - ref_out).abs().max().item()
    bound = 2 * yardstick + 2.0 ** -9 * ref_out.abs().max().item()
    assert err <= bound, f"max|out - ref64| = {err:.4e} > 2 * {yardstick:.4e} (emulated FP8) + floor = {bound:.4e}"
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows with no visible key must have LSE -inf"
    assert (out.double()[empty.transpose(1, 2)] == 0).all(), "rows with no visible key must be 0"
    lse_err = (lse.double() - ref_lse)[~empty].abs()
    assert lse_err.numel() == 0 or lse_err.max().item() <= LSE_ATOL * (1 + ref_lse[~empty].abs().max().item())
    return err, yardstick


CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, descale granularity
    (1, 1, 1, 1, 1, 64, False, "tensor"),
    (1, 17, 17, 2, 2, 64, True, "head"),
    (2, 128, 128, 4, 2, 64, True, "tensor"),
    (1, 128, 200, 2, 1, 128, False, "head"),
    (1, 200, 128, 4, 2, 128, True, "head"),  # seqlen_q > seqlen_k: the first 72 rows see nothing
    (1, 17, 200, 2, 2, 128, True, "tensor"),
    (1, 200, 17, 2, 1, 64, False, "head"),
    (1, 1, 200, 4, 1, 64, True, "head"),  # one query (decoding) against a ragged key run
    (1, 40, 40, 2, 2, 48, False, "head"),  # head dim padded to 64 inside the descriptors
    (1, 33, 33, 1, 1, 16, True, "tensor"),  # head dim padded to 32 (one FP8 k-step)
    (2, 17, 33, 4, 2, 64, True, "head"),  # per-(batch, kv head) descales: batch and head strides
]


def _case_id(c):
    return "b{}-q{}-k{}-h{}/{}-d{}-{}-{}".format(*c[:6], "causal" if c[6] else "full", c[7])


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp8_forward_matches_reference(case):
    _check(*case)


@needs_kernels
@pytest.mark.parametrize("case", [CASES[2], CASES[3]], ids=_case_id)
def test_fp8_forward_without_max_offset_matches_its_emulation(case):
    _check(*case, max_offset=False)


def _normalisation_bias(max_offset, seqlen_k, device=DEVICE, api=False):
    """mean(out - 1) with V = 1: the relative shrinkage of the outputs by lost probability mass.

    Score spread ~3 (a moderately peaked softmax): then a few percent of a row's probability
    mass lies below 2^-10 of its max, where e4m3 without the offset rounds to 0.
    """
    gen = torch.Generator().manual_seed(0)
    d = 64
    q8, qd = quantize_fp8(torch.randn(1, 64, 1, d, generator=gen).to(device))
    k8, kd = quantize_fp8(torch.randn(1, seqlen_k, 1, d, generator=gen).to(device))
    v8 = torch.ones(1, seqlen_k, 1, d, device=device).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=device)
    if api:  # the public function: whichever kernel FLASHTILE_ENGINE selects
        out = flash_attn_fp8_func(q8, k8, v8, qd, kd, one, softmax_scale=3.0 / math.sqrt(d), max_offset=max_offset)
    else:
        out, _ = kf8.attention_fp8_forward(q8, k8, transpose_v(v8), qd, kd, one, 3.0 / math.sqrt(d),
                                           max_offset=max_offset)
    return (out.double() - 1).mean().item()


@needs_kernels
@pytest.mark.parametrize("case", [CASES[3], CASES[4]], ids=_case_id)
def test_fp8_forward_with_v_in_flash_attn_layout(case):
    """V as (batch, seqlen_k, nheads_k, headdim): the kernel transposes its tiles itself."""
    _check(*case, v_transposed=False)


@needs_kernels
def test_max_offset_removes_normalisation_bias():
    seqlen_k = 1024 if INTERPRET else 4096
    with_offset, without = _normalisation_bias(True, seqlen_k), _normalisation_bias(False, seqlen_k)
    # Measured (interpreter, N = 1024): -1.6e-3 with the offset, -1.3e-2 without.
    assert abs(with_offset) < 3e-3, with_offset
    assert without < -8e-3, without
    assert abs(with_offset) < abs(without) / 4


@needs_kernels
def test_descale_shapes_are_equivalent():
    """(1,) and (batch, nheads_k) holding the same value give the same bits; the per-head
    form really is read per (batch, kv head)."""
    q8, k8, v8, qd, kd, vd = _quantized_inputs(2, 24, 40, 4, 2, 64, "tensor")
    v_t = transpose_v(v8)
    out1, lse1 = kf8.attention_fp8_forward(q8, k8, v_t, qd, kd, vd, 0.125, causal=True)
    expand = [t.expand(2, 2).contiguous() for t in (qd, kd, vd)]
    out2, lse2 = kf8.attention_fp8_forward(q8, k8, v_t, *expand, 0.125, causal=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    vd_heads = vd.expand(2, 2).clone()
    vd_heads[1, 0] *= 2  # batch 1, kv head 0 -> query heads 0 and 1 of batch 1 double
    out3, _ = kf8.attention_fp8_forward(q8, k8, v_t, *expand[:2], vd_heads, 0.125, causal=True)
    changed = (out3 != out1).any(dim=1).any(dim=-1)  # (batch, nheads)
    assert changed.tolist() == [[False, False, False, False], [True, True, False, False]]


@needs_kernels
def test_misaligned_transposed_v_is_rejected():
    q8, k8, v8, qd, kd, vd = _quantized_inputs(1, 8, 20, 1, 1, 32, "tensor")
    v_t = v8.permute(0, 2, 3, 1)  # keys strided, not contiguous
    with pytest.raises(ValueError, match="transposed v"):
        kf8.attention_fp8_forward(q8, k8, v_t, qd, kd, vd, 0.2)
    aligned = transpose_v(v8)
    assert aligned.shape == (1, 1, 32, 20) and aligned.stride() == (32 * 32, 32 * 32, 32, 1)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 17, 3, 40), (1, 1000, 2, 80), (2, 300, 2, 256)], ids=str)
def test_transpose_v_kernel(shape):
    """The byte transpose behind ``transpose_v`` on the GPU: every element, ragged key and
    head-dim tiles, a strided (sliced) source, and no write past the keys."""
    gen = torch.Generator().manual_seed(sum(shape))
    big = torch.randint(0, 255, (shape[0], shape[1], shape[2] + 1, shape[3]), generator=gen, dtype=torch.uint8)
    v = big.to(DEVICE).view(torch.float8_e4m3fn)[:, :, 1:]  # heads sliced: not contiguous
    padded = -(-shape[1] // 16) * 16
    buf = torch.full((shape[0], shape[2], shape[3], padded), 7, dtype=torch.uint8, device=DEVICE)
    out = buf.view(torch.float8_e4m3fn)[..., : shape[1]]
    kf8.transpose_v_into(v, out)
    want = v.view(torch.uint8).permute(0, 2, 3, 1)
    assert torch.equal(out.view(torch.uint8), want)
    assert (buf[..., shape[1]:] == 7).all()
    # The padded form (what transpose_v hands it): the keys past seqlen_k zero.
    kf8.transpose_v_into(v, buf.view(torch.float8_e4m3fn))
    assert torch.equal(buf[..., : shape[1]], want)
    assert (buf[..., shape[1]:] == 0).all()
    with pytest.raises(ValueError, match=f"must hold {padded} keys"):
        kf8.transpose_v_into(v, torch.empty_like(buf)[..., :-1].view(torch.float8_e4m3fn))


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 17, 3, 40), (1, 300, 2, 256)], ids=str)
def test_transpose_v_kernel_in_key_order(shape):
    """The transpose with the Hopper FP8 kernel's key order (one pass): the same bytes as the
    transpose followed by ``wgmma_key_order``, the keys zero-padded to a multiple of 16."""
    fp8_key_order = pytest.importorskip("flashtile.kernels.hopper.fp8_key_order")
    gen = torch.Generator().manual_seed(sum(shape))
    big = torch.randint(1, 255, (shape[0], shape[1], shape[2] + 1, shape[3]), generator=gen, dtype=torch.uint8)
    v = big.to(DEVICE).view(torch.float8_e4m3fn)[:, :, 1:]
    padded = -(-shape[1] // 16) * 16
    # 255 never occurs in v: a byte left unwritten (the padding included) shows.
    out = torch.full((shape[0], shape[2], shape[3], padded), 255, dtype=torch.uint8, device=DEVICE)
    kf8.transpose_v_into(v, out.view(torch.float8_e4m3fn), fp8_key_order.KEY_BITS_ORDER)
    want = fp8_key_order.wgmma_key_order(transpose_v(v)).view(torch.uint8)
    assert torch.equal(out, want)
    # What flash_attn_fp8_func hands the Gluon kernel (this kernel on a GPU, the two passes elsewhere).
    from flashtile.fp8 import _transpose_v_key_ordered

    assert torch.equal(_transpose_v_key_ordered(v).view(torch.uint8), want)
    with pytest.raises(ValueError, match="keys in key order"):
        kf8.transpose_v_into(v, out.view(torch.float8_e4m3fn)[..., :shape[1]], fp8_key_order.KEY_BITS_ORDER)


@needs_interpreter
def test_interpreter_rounding_matches_torch():
    """The interpreter-only rounding helpers against torch's casts (round to nearest even),
    over random magnitudes from 2^-21 to 2^9, every e4m3 value and every midpoint (ties)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast_both(X, Y8, Y16, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(X + offs)
        tl.store(Y8 + offs, kf8._to_e4m3(x, True))
        tl.store(Y16 + offs, kf8._to_bf16(x, True))

    gen = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(1 << 14, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.exp2(torch.rand(1 << 14, generator=gen) * 30 - 21) * sign
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    x = torch.cat([x, grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([448.0, 463.9, 464.0, 500.0, -1000.0])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    y8, y16 = torch.empty(n, dtype=torch.float8_e4m3fn), torch.empty(n, dtype=torch.bfloat16)
    cast_both[(1,)](x, y8, y16, n)
    # Saturating like the GPU's cvt.rn.satfinite: beyond +-448 the result is +-448.
    torch.testing.assert_close(y8.float(), x.clamp(-448, 448).to(torch.float8_e4m3fn).float(), atol=0, rtol=0)
    torch.testing.assert_close(y16.float(), x.to(torch.bfloat16).float(), atol=0, rtol=0)


# --------------------------------------------------------------------------------------
# GPU (skipped without CUDA): bigger shapes through the public function
# --------------------------------------------------------------------------------------

GPU_CASES = [
    (1, 4096, 4096, 4, 2, 256, False, "head"),
    (1, 4096, 4096, 4, 2, 256, True, "tensor"),
    (2, 1000, 1300, 8, 2, 128, False, "head"),
    (2, 1300, 1000, 8, 2, 128, True, "tensor"),
    (1, 4096, 4096, 8, 8, 128, True, "head"),
    (1, 4096, 4096, 8, 1, 64, False, "tensor"),
    (4, 1, 4096, 8, 1, 128, True, "head"),
]


def _engine(monkeypatch, engine, headdim):
    # FLASHTILE_ENGINE picks the FP8 kernel: gluon forces the Gluon one (Hopper), triton the tl.* one.
    if engine == "gluon" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon FP8 forward runs on sm_90")
    monkeypatch.setenv("FLASHTILE_ENGINE", engine)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["triton", "gluon"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_fp8_forward_gpu(case, engine, monkeypatch):
    _engine(monkeypatch, engine, case[5])
    _check(*case, api=True)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["triton", "gluon"])
def test_fp8_forward_gpu_without_max_offset(engine, monkeypatch):
    _engine(monkeypatch, engine, 128)
    _check(2, 1000, 1300, 8, 2, 128, False, "head", max_offset=False, api=True)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["triton", "gluon"])
@pytest.mark.parametrize("case", [(1, 17, 17, 2, 2, 64, True, "head"), (1, 200, 128, 4, 2, 128, True, "head"),
                                  (1, 40, 40, 2, 2, 48, False, "head"), (1, 1, 200, 4, 1, 64, True, "head"),
                                  (1, 200, 128, 4, 2, 256, True, "head"), (1, 1, 200, 4, 1, 256, True, "tensor"),
                                  (2, 1000, 1000, 2, 2, 192, False, "head"), (1, 17, 1000, 8, 1, 256, False, "head")],
                         ids=_case_id)
def test_fp8_forward_gpu_awkward_shapes(case, engine, monkeypatch):
    _engine(monkeypatch, engine, case[5])
    _check(*case, api=True)


@pytest.mark.gpu
@pytest.mark.parametrize("alternative", GLUON_FP8_ALTERNATIVES)
@pytest.mark.parametrize("case", GPU_CASES + [(1, 17, 17, 2, 2, 64, True, "head"),
                                              (2, 300, 200, 4, 2, 256, True, "head")], ids=_case_id)
def test_gluon_fp8_alternative_configurations_gpu(case, alternative, monkeypatch):
    # Each of attention_fp8.ALTERNATIVES in place of the Gluon FP8 forward's configuration,
    # where it launches another kernel.
    _engine(monkeypatch, "gluon", case[5])
    from flashtile.kernels.hopper import attention_fp8 as hopper_fp8, configured

    if hopper_fp8.is_default(hopper_fp8.padded_headdim(case[5]), case[6], alternative):
        pytest.skip(f"{alternative} is the default configuration here")

    monkeypatch.setattr(hopper_fp8, "config_for", configured(hopper_fp8.config_for, alternative))
    _check(*case, api=True)


@pytest.mark.gpu
def test_gluon_fp8_max_offset_removes_normalisation_bias(monkeypatch):
    _engine(monkeypatch, "gluon", 64)
    with_offset, without = _normalisation_bias(True, 4096, api=True), _normalisation_bias(False, 4096, api=True)
    assert abs(with_offset) < 3e-3, with_offset
    assert without < -8e-3, without
    assert abs(with_offset) < abs(without) / 4


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [128, 256])
def test_pretransposed_v_gives_the_same_bits_gpu(headdim):
    # On Hopper d = 256 runs the Gluon kernel: V transposed into its key order in one pass,
    # against the given transposed V put in that order on the host.
    q8, k8, v8, qd, kd, vd = _quantized_inputs(2, 1000, 1000, 8, 2, headdim, "head")
    out = flash_attn_fp8_func(q8, k8, v8, qd, kd, vd, causal=True)
    out_t = flash_attn_fp8_func(q8, k8, transpose_v(v8), qd, kd, vd, causal=True, v_transposed=True)
    assert torch.equal(out, out_t)


@pytest.mark.gpu
@pytest.mark.parametrize("engine, headdim, seqlen_q, causal", [
    ("gluon", 256, 300, False), ("gluon", 256, 300, True), ("gluon", 128, 300, False),
    ("triton", 128, 300, True), ("triton", 64, 300, False), ("triton", 128, 8, False),  # the last: V in the kernel
])
def test_fp8_launch_plans_give_the_general_paths_bits_gpu(engine, headdim, seqlen_q, causal, monkeypatch):
    # flash_attn_fp8_func builds a launch plan at a key's second call and launches from it
    # after: the same bits (output and LSE) as the general path on every call.
    _engine(monkeypatch, engine, headdim)
    from flashtile import fp8

    inputs = [_quantized_inputs(2, seqlen_q, 333, 8, 2, headdim, "head", seed=seed) for seed in range(3)]
    fp8.clear_plans()
    planned = [flash_attn_fp8_func(*x, causal=causal, return_lse=True) for x in inputs]
    assert fp8._plans.plans and all(callable(p) for p in fp8._plans.plans.values())
    for x, (out, lse) in zip(inputs, planned):
        fp8.clear_plans()  # the key's first call again: the general path
        want_out, want_lse = flash_attn_fp8_func(*x, causal=causal, return_lse=True)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    fp8.clear_plans()
