"""The float64 oracle of ``flashtile.softmax`` / ``log_softmax`` and its tolerance rule, shared by
the softmax kernel tests (``tests/kernels/test_softmax_kernels.py`` has the rule's derivation
and ``test_tolerances_can_fail``; ``tests/kernels/hopper/test_staged_softmax.py``)."""

from __future__ import annotations

import torch

import flashtile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NEG_INF, POS_INF, NAN = float("-inf"), float("inf"), float("nan")

# Unit roundoff of the output dtype (the result is rounded once to it).
U_OUT = {F32: 0.0, F16: 2.0**-11, BF16: 2.0**-8}
# float32 compute error, relative: the exponent x*scale*log2(e) is rounded in float32 (for
# |x*scale| <~ 30 that is <~ 30 * 2**-24 * ln 2 * 2 ~ 2.5e-6 relative in exp), plus exp2 and
# reciprocal ulps and the float32 row sums.
U32 = 4e-6
FWD_ATOL = {False: 1e-6, True: 2e-6}  # softmax, log_softmax


# ---------------------------------------------------------------------------------------
# Oracle and assertions
# ---------------------------------------------------------------------------------------


def oracle(x, dim=-1, scale=None, mask=None, log=False):
    """float64 (log-)softmax of ``x * scale (+ mask)``; all -inf rows -> 0 / -inf, zero gradient.

    Differentiable: call it on a float64 leaf (or a view of one) to get the oracle gradient.
    """
    t = x.double() * (1.0 if scale is None else float(scale))
    if mask is not None:
        t = t.masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else t + mask.double()
    empty = (t == NEG_INF).all(dim=dim, keepdim=True)
    # An empty row is replaced by zeros before the softmax (torch would give NaN and NaN
    # gradients), then its result is overwritten; the `where`s route zero gradient to it.
    t = torch.where(empty, torch.zeros((), dtype=t.dtype, device=t.device), t)
    y = torch.log_softmax(t, dim) if log else torch.softmax(t, dim)
    fill = torch.full((), NEG_INF if log else 0.0, dtype=y.dtype, device=y.device)
    return torch.where(empty, fill, y)


def _same_nonfinite(got, ref, name):
    """Same NaN / +inf / -inf positions as ``ref`` rounded to got's dtype (so a float64 value
    beyond the dtype's range is expected to overflow to ±inf, as any rounding would)."""
    g, r = got.detach().double(), ref.detach().double()
    r = torch.where(torch.isfinite(r) & ~torch.isfinite(r.to(got.dtype).double()), r.to(got.dtype).double(), r)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    for label, fn in (("NaN", torch.isnan), ("+inf", lambda t: t == POS_INF), ("-inf", lambda t: t == NEG_INF)):
        a, b = fn(g), fn(r)
        if not torch.equal(a, b):
            raise AssertionError(
                f"{name}: {label} pattern differs: got {int(a.sum())} entries, oracle {int(b.sum())} "
                f"({int((a != b).sum())} positions differ)"
            )
    return g, r, torch.isfinite(r)


def _check_bound(g, r, finite, bound, name, dtype):
    err = (g - r).abs()
    bad = finite & ~(err <= bound)
    if bad.any():
        i = int(torch.argmax(torch.where(bad, err - bound, torch.zeros_like(err))).item())
        flat = lambda t: t.reshape(-1)[i].item()  # noqa: E731
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())} of {int(finite.sum())} entries out of tolerance; worst: "
            f"got {flat(g):.9g}, oracle {flat(r):.9g}, |err| {flat(err):.3e} > bound {flat(bound):.3e}"
        )


def exponent_error(x, dim=-1, scale=None, mask=None):
    """Per-row bound (natural-log units) on the float32 error of the kernels' exponent ``t - max``.

    The kernels round ``x * scale * log2(e)`` (and add ``mask * log2(e)``) in float32 *before*
    subtracting the row max, so the exponent is off by up to ~``2**-24 * (|t_i| + |max|)``
    (three roundings allowed here), i.e. relative to the magnitude of the scores, not to their
    spread -- torch subtracts first and does not have this term.  For N(0, 1) rows it is below
    ``U32``; it matters for rows like ``1000 + N(0, 1)``.
    """
    t = x.detach().double() * (1.0 if scale is None else float(scale))
    if mask is not None and mask.dtype != torch.bool:
        t = t + mask.detach().double()
    t = torch.where(torch.isfinite(t), t.abs(), torch.zeros_like(t))
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    return 3.0 * 2.0**-24 * t.amax(dim=dim, keepdim=True)


def fwd_bound(ref, dtype, log, eexp=0.0):
    if log:  # y = t - max - log(l): the exponent error is an absolute error in y
        return FWD_ATOL[log] + 2.0 * ((U_OUT[dtype] + U32) * ref.abs() + eexp)
    return FWD_ATOL[log] + 2.0 * (U_OUT[dtype] + U32 + eexp) * ref.abs()


def assert_fwd(got, ref, dtype, log=False, name="y", eexp=0.0):
    """``got`` (dtype) vs the float64 ``ref``: same NaN/±inf positions, finite entries within
    ``atol + 2 (u_dtype + U32 + eexp) |ref|`` (log-softmax: ``atol + 2 ((u_dtype + U32) |ref| + eexp)``),
    ``eexp`` from :func:`exponent_error`."""
    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}"
    g, r, finite = _same_nonfinite(got, ref, name)
    rr = torch.where(finite, r, torch.zeros_like(r))
    _check_bound(g, r, finite, fwd_bound(rr, dtype, log, eexp), name, dtype)


def grad_bound(y64, g64, dx64, dim, scale, log, dtype, eexp=0.0):
    """Twice the first-order effect on dx of the error in the stored y -- relative
    ``u + U32 + eexp`` (log-softmax: absolute ``(u + U32)(|y| + 1) + eexp``) -- plus one
    rounding of dx."""
    c = 1.0 if scale is None else abs(float(scale))
    finite_y = torch.isfinite(y64)
    y = torch.where(finite_y, y64, torch.zeros_like(y64))
    g = torch.where(torch.isfinite(g64), g64, torch.zeros_like(g64))
    if log:
        uy = (U_OUT[dtype] + U32) * (y.abs() + 1.0) + eexp
        p = torch.where(finite_y, y64.exp(), torch.zeros_like(y64))
        gsum = g.sum(dim, keepdim=True)
        gabs = g.abs().sum(dim, keepdim=True)
        prop = c * p * (uy * gsum.abs() + (U_OUT[dtype] + U32) * gabs)
    else:
        uy = U_OUT[dtype] + U32 + eexp
        s = (g * y).sum(dim, keepdim=True)
        sabs = (g * y).abs().sum(dim, keepdim=True)
        prop = c * uy * y.abs() * ((g - s).abs() + sabs)
    dx = torch.where(torch.isfinite(dx64), dx64, torch.zeros_like(dx64))
    return 1e-6 + 2.0 * (prop + U_OUT[dtype] * dx.abs())


def assert_grad(got, ref_dx, y64, g64, dim, scale, log, dtype, name="dx", eexp=0.0):
    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}"
    g, r, finite = _same_nonfinite(got, ref_dx, name)
    _check_bound(g, r, finite, grad_bound(y64, g64, r, dim, scale, log, dtype, eexp), name, dtype)


def randn(*shape, dtype=F32, device=DEVICE, seed=0, std=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * std).to(dtype=dtype, device=device)


def fn_of(log):
    return flashtile.log_softmax if log else flashtile.softmax


def run_case(base, dim=-1, scale=None, mask=None, log=False, view=lambda t: t, grad=True, seed=7, fn=None):
    """Forward (and backward) of flashtile on ``view(base)`` against the oracle on ``view(base64)``.

    ``base`` is a leaf; the view (transpose, slice, expand, ...) is what flashtile sees.  The
    gradient checked is the one with respect to that view -- flashtile's backward output; the
    one reaching ``base`` (through the view's own backward) must have base's shape and dtype.
    Returns ``(y, dx_view)``.
    """
    dtype = base.dtype
    fn = fn or fn_of(log)
    b = base.detach().clone().requires_grad_(grad)
    x = view(b)
    y = fn(x, dim, scale=scale, mask=mask)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    b64 = base.detach().double().requires_grad_(grad)
    x64 = view(b64)
    y64 = oracle(x64, dim, scale, mask, log)
    eexp = exponent_error(x64, dim, scale, mask)
    assert_fwd(y, y64, dtype, log, eexp=eexp)
    if not grad:
        return y, None
    g = randn(*y.shape, dtype=dtype, device=y.device, seed=seed)
    if x is b:
        (dx,) = torch.autograd.grad(y, b, g)
        db = dx
    else:
        dx, db = torch.autograd.grad(y, (x, b), g)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    assert dx.shape == x.shape and db.shape == base.shape and db.dtype == dtype
    assert_grad(dx, dx64, y64.detach(), g.double(), dim, scale, log, dtype, eexp=eexp)
    return y, dx


def check_fwd_bwd(x, dim=-1, scale=None, mask=None, log=False, seed=1):
    """Forward and backward of ``x`` (a GPU tensor) against the oracle; returns ``(y, dx)``."""
    xl = x.detach().clone().requires_grad_(True)
    y = fn_of(log)(xl, dim, scale=scale, mask=mask)
    g = randn(*x.shape, dtype=x.dtype, device=x.device, seed=seed)
    (dx,) = torch.autograd.grad(y, xl, g)
    x64 = x.detach().double().requires_grad_(True)
    y64 = oracle(x64, dim, scale, mask, log)
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    eexp = exponent_error(x, dim, scale, mask)
    assert_fwd(y, y64, x.dtype, log, eexp=eexp)
    assert_grad(dx, dx64, y64.detach(), g.double(), dim, scale, log, x.dtype, eexp=eexp)
    return y, dx
