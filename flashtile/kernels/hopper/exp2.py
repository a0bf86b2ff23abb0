"""``exp2`` split between the multi-function unit and the FMA pipe (``exp2_mixed``).

The softmax of a 64 x 128 score tile takes 8192 ``exp2``; an SM's multi-function units
(MUFU) return 16 a clock, so at head dim 64 in 16-bit (and at 128 in FP8) one tile's ``exp2``
take as long as the tensor cores take for its two GEMMs, and the forward can only be as fast
as both units running flat out side by side.  ``exp2_mixed`` computes one element in
``EVERY`` with a polynomial on the FMA pipe instead, which has room to spare, so the MUFU
work per tile shrinks by ``1 / EVERY``.

The polynomial element, for ``x <= 0`` (a softmax exponent; FP8's max offset adds at most a
few units):

* ``j = round(x)`` with the 1.5 * 2^23 trick (``t = x + 1.5 * 2^23`` holds ``j`` in its low
  bits), ``f = x - j`` in ``[-1/2, 1/2]``;
* ``2^f`` by a degree-4 polynomial (``COEFFS``, fitted to the relative error over
  ``[-1/2, 1/2]``: at most 7e-6, against the MUFU's ~2e-7; a 16-bit P rounds at 4e-3 or 5e-4);
* times ``2^j``, built as the float whose bits are ``(bits(t) << 23) + bits(1.0)``;
* ``x < -125`` (``-inf`` included) gives exactly 0, as the MUFU's flush to zero does; a NaN
  stays NaN (the product keeps it), so NaN inputs propagate as with ``gl.exp2``.

``emulated_exp2`` is the same arithmetic in NumPy (FMA rounded once), for the CPU tests of
the constants and the GPU test of the assembly.
"""

from __future__ import annotations

import numpy as np
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# 2^f ~ C0 + f (C1 + f (C2 + f (C3 + f C4))) on [-1/2, 1/2] (float32 values).
COEFFS = (0.9999975562095642, 0.6931290626525879, 0.2403152734041214, 0.055871669203042984, 0.00926539208739996)
ROUNDER = 12582912.0  # 1.5 * 2^23: adding it rounds a float of magnitude < 2^22 to an integer
FLOOR = -125.0  # below: 0 (2^j stays a normal float down to here)


def _hex(x: float) -> str:
    """A PTX float literal (``0f`` and the IEEE bits) of ``x`` rounded to float32."""
    return f"0f{int(np.float32(x).view(np.uint32)):08X}"


def _poly_template() -> str:
    """The polynomial element's PTX up to its output operand, ``{x}`` to fill (its own register scope)."""
    c0, c1, c2, c3, c4 = (_hex(c) for c in COEFFS)
    return (
        "{{\n"
        ".reg .pred %low;\n.reg .f32 %t, %j, %f, %y;\n.reg .b32 %s;\n"
        f"setp.lt.f32 %low, {{x}}, {_hex(FLOOR)};\n"
        f"add.rn.f32 %t, {{x}}, {_hex(ROUNDER)};\n"
        f"sub.rn.f32 %j, %t, {_hex(ROUNDER)};\n"
        "sub.rn.f32 %f, {x}, %j;\n"
        f"fma.rn.f32 %y, %f, {c4}, {c3};\n"
        f"fma.rn.f32 %y, %y, %f, {c2};\n"
        f"fma.rn.f32 %y, %y, %f, {c1};\n"
        f"fma.rn.f32 %y, %y, %f, {c0};\n"
        "shl.b32 %s, %t, 23;\n"
        "add.s32 %s, %s, 1065353216;\n"  # + bits(1.0): the float 2^j
        "mul.rn.f32 %y, %y, %s;\n"
        "selp.f32 "
    )


# The template cut at its input operand, and what follows the output operand (string methods
# of globals cannot be called from a constexpr function: ``mixed_asm`` joins these).
POLY_PIECES = tuple(_poly_template().replace("{{", "{").split("{x}"))
POLY_END = ", 0f00000000, %y, %low;\n}\n"


@triton.constexpr_function
def mixed_asm(every: int) -> str:
    """The inline assembly of one pack of ``every`` elements: the first ``every - 1`` on the
    MUFU (``ex2.approx.ftz``, what ``gl.exp2`` issues), the last by the polynomial."""
    lines = [f"ex2.approx.ftz.f32 ${i}, ${every + i};\n" for i in range(every - 1)]
    x = f"${2 * every - 1}"
    return "".join(lines) + x.join(POLY_PIECES) + f"${every - 1}" + POLY_END


@triton.constexpr_function
def mixed_constraints(every: int) -> str:
    """``every`` 32-bit outputs, then ``every`` 32-bit inputs."""
    return ",".join(["=r"] * every + ["r"] * every)


@gluon.jit
def exp2_mixed(x, EVERY: gl.constexpr):
    """``2^x`` of an fp32 tensor, one element in ``EVERY`` (of each thread's registers) on the
    FMA pipe (see the module docstring); ``EVERY`` divides the elements a thread holds."""
    return gl.inline_asm_elementwise(
        mixed_asm(EVERY), mixed_constraints(EVERY), [x], dtype=gl.float32, is_pure=True, pack=EVERY)


def _fma32(a, b, c):
    # One rounding, as fma.rn.f32: the product of two float32 is exact in float64.
    return (a.astype(np.float64) * np.float64(b) + np.float64(c)).astype(np.float32)


def emulated_exp2(x: np.ndarray) -> np.ndarray:
    """The polynomial element's arithmetic on a float32 array, step for step."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        t = (x + np.float32(ROUNDER)).astype(np.float32)
        j = (t - np.float32(ROUNDER)).astype(np.float32)
        f = (x - j).astype(np.float32)
        c0, c1, c2, c3, c4 = (np.float32(c) for c in COEFFS)
        y = _fma32(f, c4, c3)
        for c in (c2, c1, c0):
            y = _fma32(y, f, c)
        scale = ((t.view(np.uint32) << np.uint32(23)) + np.uint32(0x3F800000)).view(np.float32)
        y = (y * scale).astype(np.float32)
    return np.where(x < np.float32(FLOOR), np.float32(0.0), y)
