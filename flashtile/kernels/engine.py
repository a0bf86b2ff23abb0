"""Which GPU engine runs an attention forward or backward: the one dispatch rule.

Two engines compute the same attention on CUDA tensors:

* ``gluon`` -- the Hopper kernels of ``flashtile/kernels/hopper/`` (warp-specialised,
  asynchronous wgmma), where they cover the call and are the faster engine: an sm_90 GPU,
  Triton 3.6, float16 / bfloat16, head dims 33-256, no dropout or paged keys (softcap and
  ALiBi included).  At d = 64 its three-consumer tiles measured 1.01-1.12x cuDNN non-causal on an
  H200, against 0.89-0.96x for the ``tl.*`` forward (N = 1k-16k; docs/tuning.md); under
  ``auto`` it does not take short masked calls at head dims up to 64 (``short_masked``);
* ``triton`` -- the portable ``tl.*`` kernels of ``flashtile/kernels/attention/``, for
  everything (any CUDA GPU, Triton's interpreter, every feature).

The backward has Gluon kernels too (no dropout, softcap or ALiBi), which ``auto`` takes where
they can run the call, except at head dims up to 64 for short masked calls
(``backward_engine``): ``attention_bwd`` up to head dim 128, and for head dims 129-256 a dK / dV
kernel (``attention_bwd_wide``) with dQ from ``attention_bwd_dq``.
The FP8 forward's Gluon kernel runs under ``auto`` above head dim 128, where it is faster than
the ``tl.*`` one, and wherever ``gluon`` is forced (``fp8_forward_engine``).

Under ``auto``, a dense forward of at most ``SPLIT_KV_MAX_SEQLEN_Q`` query rows (a decoding
step through ``flash_attn_func``, as transformers makes it) runs on neither forward kernel but
on the split-KV decode kernel of ``flash_attn_with_kvcache`` (``split_kv_forward``).

``auto`` (the default) takes ``gluon`` where it applies and ``triton`` elsewhere.  The
environment variable ``FLASHTILE_ENGINE`` (``auto``, ``gluon`` or ``triton``) overrides the
choice for tests and A/B benchmarks; forcing ``gluon`` on a call it cannot run raises
``NotImplementedError`` naming the reason instead of silently falling back.
"""

from __future__ import annotations

import functools
import os

import torch

from flashtile.kernels.runtime import INTERPRET, Knob, register_family
from flashtile.masking import is_masked

ENGINES = ("auto", "gluon", "triton")
ENGINE_KNOBS = register_family("engine", "FLASHTILE_ENGINE", {
    "engine": Knob("auto", "attention kernels on CUDA: `auto` = the Hopper Gluon kernels where they apply, else the "
                   "`tl.*` ones; `gluon` / `triton` force one (a call the Gluon kernels cannot run raises)",
                   choices=ENGINES),
})
ENGINE_ENV = ENGINE_KNOBS.env_var
# The Gluon forward runs head dims 33-256.  From head dim 65 auto sends every backward it can
# run to the Gluon kernel; at 64 and below not the short masked ones, where the ``tl.*``
# backward measured as fast or faster (docs/tuning.md).
GLUON_HEADDIMS = (33, 256)
# The Gluon kernels address a head's LSE rows as ``head * rows`` in 32-bit arithmetic (the
# 64-bit product costs registers the forward does not have to spare: offline ptxas, d = 128
# causal with one query buffer, 44 bytes spilled against 40): calls with more (query row,
# head) pairs than this take the ``tl.*`` kernels, whose LSE addresses are 64-bit.
GLUON_MAX_QUERY_ROWS = 2**31 - 1
GLUON_BACKWARD_AUTO_MIN_HEADDIM = 65
# The Gluon backward keeps dK and dV of its keys in registers: head dims up to 128 split by
# keys between its consumers (``attention_bwd``), up to 256 by columns (``attention_bwd_wide``,
# dQ in a second pass, ``attention_bwd_dq``).  ``auto`` takes both: at d = 256 forward +
# backward measured 1.05-1.23x cuDNN on an H200 from N = 1k (0.91x causal at N = 512) and
# 1.6-2.5x the ``tl.*`` backward (README, docs/tuning.md).
GLUON_BACKWARD_MAX_HEADDIM = 256
# A deterministic Gluon backward (dK / dV without dQ, ``separate_dq``) takes dQ from the Gluon
# dQ kernel (``attention_bwd_dq``) from this padded head dim on, and from the ``tl.*`` dQ kernel
# below it: at d = 128 the Gluon pass measured 1.00-1.06x faster, at d = 64 0.93-0.98x
# (docs/tuning.md).  Short masked calls take the Gluon pass at every head dim.
GLUON_DQ_MIN_HEADDIM = 65


# A masked call of fewer query rows than this runs the Gluon backward as a deterministic call
# does: dK / dV without dQ, then the Gluon dQ pass writing dQ directly -- no fp32 workspace to
# clear, add into and convert, a fixed cost a short call feels (d = 128 causal, forward +
# backward: H200 N = 1k 346 TFLOP/s against 313 with the workspace, N = 4k 485 against 501;
# H100 N = 2k 426 against 360; docs/tuning.md).
SEPARATE_DQ_MAX_ROWS = 4096


def separate_dq(head_dim_pad: int, deterministic: bool, seqlen_q: int, window_left: int, window_right: int) -> bool:
    """Whether a Gluon backward computes dQ in a separate pass whose programs own query rows
    (``separate_dq_engine``) instead of adding it from the dK / dV kernel into an fp32
    workspace: for ``deterministic`` calls (the pass sums in a fixed order), head dims above
    128 (``attention_bwd_wide`` has no room for dQ) and short masked calls (above)."""
    return (deterministic or head_dim_pad > 128
            or short_masked(seqlen_q, window_left, window_right, SEPARATE_DQ_MAX_ROWS))


def separate_dq_engine(head_dim_pad: int, deterministic: bool) -> str:
    """``"gluon"`` or ``"triton"``: the kernel of a Gluon backward's separate dQ pass -- the
    ``tl.*`` one only for deterministic calls below ``GLUON_DQ_MIN_HEADDIM``."""
    return "gluon" if head_dim_pad >= GLUON_DQ_MIN_HEADDIM or not deterministic else "triton"


def requested_engine() -> str:
    return ENGINE_KNOBS.current()["engine"]


def _raw_env_reader(name: str):
    """A function returning the raw value of environment variable ``name`` (``None`` when unset),
    for a key that must change when the variable does.  It reads the mapping behind
    ``os.environ`` (which ``os.environ[...] = ...``, ``del`` and ``monkeypatch.setenv`` update),
    in tens of nanoseconds instead of ``os.environ.get``'s half microsecond of key encoding;
    where that mapping is not there (another Python), ``os.environ.get`` itself."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if data.__class__ is dict and callable(encode):
        return functools.partial(data.get, encode(name))
    return functools.partial(os.environ.get, name)


# What a cached engine choice (the forward's launch plans) is keyed by: the variable's raw value.
engine_setting = _raw_env_reader(ENGINE_ENV)


@functools.lru_cache(maxsize=None)
def gluon_device_reason(device_index: int) -> str | None:
    """Why CUDA device ``device_index`` cannot run the Gluon kernels, or None when it can."""
    if INTERPRET:
        return "Triton's interpreter runs no Gluon kernels"
    from flashtile.kernels.hopper import gluon_available

    if not gluon_available():
        return "this Triton has no supported Gluon (the Hopper kernels pin Triton 3.6)"
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return "the Gluon kernels are written for sm_90 (Hopper)"
    return None


def gluon_forward_reason(q: torch.Tensor, k: torch.Tensor, dropout, paged: bool = False) -> str | None:
    """Why the Gluon forward cannot take this call, or None when it can."""
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    reason = gluon_device_reason(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if reason:
        return reason
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (the Gluon forward takes float16 / bfloat16)"
    lo, hi = GLUON_HEADDIMS
    if not lo <= q.shape[-1] <= hi:
        return f"head dim {q.shape[-1]} (the Gluon forward takes {lo}-{hi})"
    if q.numel() // q.shape[-1] > GLUON_MAX_QUERY_ROWS:
        return f"{q.numel() // q.shape[-1]} (query row, head) pairs (the Gluon kernels take up to 2^31 - 1)"
    if k.dim() == 4 and k.shape[1] == 0:
        return "no keys (a TMA descriptor needs a non-empty tensor)"
    if paged:
        return "paged keys and values (block_table)"
    if dropout is not None:
        return "dropout"
    return None


# A causal or windowed forward with fewer query rows than this is "short masked": at head dims
# up to 64 the Gluon forward's three-consumer tiles (192 query rows) cut the diagonal too
# coarsely there, and its two-consumer tiles measured slower than the ``tl.*`` forward (d = 64,
# N = 1k causal, H200: 0.91 against 0.97 of cuDNN in one run; docs/tuning.md), so ``auto``
# keeps such calls on ``tl.*`` and a forced Gluon forward runs them with two consumers.
SHORT_MASKED_ROWS = 2048
# Head dims up to this take the Gluon forward's three consumers (``attention_fwd.config_for``).
GLUON_THREE_CONSUMERS_MAX_HEADDIM = 64


# The backward's counterpart, at head dims up to 64: the ``tl.*`` backward measured as fast as
# the Gluon one for masked calls below this (d = 64 causal, forward + backward, H100, the Gluon
# dK / dV kernel with the Gluon dQ pass (``separate_dq``) against ``tl.*``: N = 1k 246 against
# 242 TFLOP/s, 2k 325 against 307; H200, with dQ from the workspace: 2k 288 against 309;
# docs/tuning.md).
SHORT_MASKED_BACKWARD_ROWS = 2048


def short_masked(seqlen_q: int, window_left: int, window_right: int, rows: int = SHORT_MASKED_ROWS) -> bool:
    """Whether a call of ``seqlen_q`` query rows (a packed batch's longest) with this window
    (``-1``: unbounded on that side; causal is ``window_right = 0``) is short masked: masked,
    and fewer rows than ``rows`` (the forward's ``SHORT_MASKED_ROWS``, or the backward's
    ``SHORT_MASKED_BACKWARD_ROWS``)."""
    return is_masked(window_left, window_right) and seqlen_q < rows


def short_masked_backward(seqlen_q: int, window_left: int, window_right: int) -> bool:
    """:func:`short_masked` with the backward's ``SHORT_MASKED_BACKWARD_ROWS`` (read at the call,
    so that tests and A/B benchmarks may change it): :func:`backward_engine`'s ``short``."""
    return short_masked(seqlen_q, window_left, window_right, SHORT_MASKED_BACKWARD_ROWS)


# An unmasked Gluon forward with fewer query rows than this runs two consumers too at head dims
# up to 64: of the 192-row tiles of a head the last one is mostly empty there (d = 64, N = 512,
# H200: 284 TFLOP/s with three consumers, 363 with two; at N = 1k 415 against 410).
THREE_CONSUMERS_MIN_ROWS = 1024


def two_consumer_call(seqlen_q: int, window_left: int, window_right: int, score_mods: bool = False) -> bool:
    """Whether a Gluon forward of ``seqlen_q`` query rows with this window takes the two-consumer
    tiles at head dims up to 64 (``attention_fwd.call_config``): a short masked call, an
    unmasked one of fewer than ``THREE_CONSUMERS_MIN_ROWS`` rows, or one with a softcap or ALiBi
    (``score_mods``), whose extra per-score work spills from three 160-register consumers
    (offline ptxas, d = 64: 80-1008 bytes, at most 80 with two)."""
    return score_mods or short_masked(seqlen_q, window_left, window_right) or seqlen_q < THREE_CONSUMERS_MIN_ROWS


def forward_engine(q: torch.Tensor, k: torch.Tensor, dropout=None, softcap: float = 0.0, alibi_slopes=None,
                   paged: bool = False, short: bool = False) -> str:
    """``"gluon"`` or ``"triton"`` for an attention forward on ``q``'s device (``short``: the
    call is :func:`short_masked`).  Callers pass every feature of the call, as they do to
    :func:`backward_engine`; the Gluon forward takes a softcap and ALiBi, so today only
    dropout and paged keys decide."""
    wanted = requested_engine()
    if wanted == "triton":
        return "triton"
    reason = gluon_forward_reason(q, k, dropout, paged)
    if reason is None and (wanted == "gluon" or not (short and q.shape[-1] <= GLUON_THREE_CONSUMERS_MAX_HEADDIM)):
        return "gluon"
    if wanted == "gluon":
        raise NotImplementedError(f"{ENGINE_ENV}=gluon, but the Gluon forward cannot run this call: {reason}")
    return "triton"


# A dense forward with at most this many query rows runs as a split-KV decode step (the kernel
# of flash_attn_with_kvcache, see split_kv_forward): the forward kernels' grid has one program
# per (query tile of 64-128 rows, batch * head), so a few query rows against a long key
# sequence keep a handful of SMs busy and waste most of each tile, while the decode kernel
# packs a GQA group's rows into one tile and splits the keys across programs.
SPLIT_KV_MAX_SEQLEN_Q = 16


def split_kv_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout=None) -> bool:
    """Whether a dense forward of these tensors runs on the split-KV decode kernel: at most
    ``SPLIT_KV_MAX_SEQLEN_Q`` query rows against at least one key, no dropout (the decode
    kernel draws none), unit last strides, and ``auto`` engine selection (a forced engine runs
    its own forward kernel at every shape, for tests and A/B benchmarks)."""
    return (0 < q.shape[1] <= SPLIT_KV_MAX_SEQLEN_Q and k.shape[1] > 0 and q.shape[0] > 0 and dropout is None
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and requested_engine() == "auto")


def gluon_backward_reason(q: torch.Tensor, k: torch.Tensor, dropout, softcap: float, alibi_slopes) -> str | None:
    """Why the Gluon backward cannot take this call, or None when it can."""
    reason = gluon_forward_reason(q, k, dropout)
    if reason:
        return reason.replace("Gluon forward", "Gluon backward")
    if softcap > 0:
        return "softcap"
    if alibi_slopes is not None:
        return "ALiBi"
    if q.shape[-1] > GLUON_BACKWARD_MAX_HEADDIM:
        return f"head dim {q.shape[-1]} (the Gluon backward takes up to {GLUON_BACKWARD_MAX_HEADDIM})"
    return None


def backward_engine(q: torch.Tensor, k: torch.Tensor, dropout=None, softcap: float = 0.0, alibi_slopes=None,
                    short: bool = False) -> str:
    """``"gluon"`` or ``"triton"`` for an attention backward on ``q``'s device (``short``: the
    call is :func:`short_masked` with ``rows=SHORT_MASKED_BACKWARD_ROWS``).

    ``auto`` takes the Gluon backward where it can run the call: at d = 128 forward + backward
    measured 1.1-1.3x the ``tl.*`` backward's TFLOP/s on an H200 from N = 2k (bf16; 0.8-1.2x at
    N = 512 / 1k, where both are far below cuDNN); at head dims up to 64 (its 128-row query
    tiles there, ``attention_bwd.config_for``) 1.12-1.23x from N = 2k non-causal and from
    N = 8k causal, but not for masked calls below 2048 rows (``SHORT_MASKED_BACKWARD_ROWS``).
    Like flash-attn's, it adds dQ in no fixed order, so gradients are not bitwise
    reproducible; with ``deterministic=True`` it computes dK and dV alone (each program owns
    its keys) and the ``tl.*`` dQ kernel, whose programs own their rows, computes dQ (at
    d = 64, N = 4k / 16k: 1.03-1.14x the ``tl.*`` backward's deterministic calls; from d = 65 the
    Gluon dQ pass computes it); short masked calls take dK and dV alone too, dQ from the Gluon
    pass (``separate_dq``).
    Head dims 129-256 take ``attention_bwd_wide`` and the Gluon dQ pass.
    ``triton`` / ``gluon`` force one.
    """
    wanted = requested_engine()
    if wanted == "triton":
        return "triton"
    reason = gluon_backward_reason(q, k, dropout, softcap, alibi_slopes)
    pays = q.shape[-1] >= GLUON_BACKWARD_AUTO_MIN_HEADDIM or not short
    if reason is None and (wanted == "gluon" or pays):
        return "gluon"
    if wanted == "gluon":
        raise NotImplementedError(f"{ENGINE_ENV}=gluon, but the Gluon backward cannot run this call: {reason}")
    return "triton"


# The Gluon FP8 forward keeps the output and each tile's P V accumulator in registers: head
# dims up to 256 (at 256 the P V accumulator a chunk of the output's columns at a time).
GLUON_FP8_MAX_HEADDIM = 256
# ``auto`` takes the Gluon FP8 forward above this head dim, and above
# ``GLUON_FP8_AUTO_MIN_HEADDIM`` for non-causal calls of at least ``GLUON_FP8_AUTO_MIN_ROWS``
# query rows (``fp8_forward_engine``).
GLUON_FP8_AUTO_ABOVE_HEADDIM = 128
GLUON_FP8_AUTO_MIN_HEADDIM = 65
GLUON_FP8_AUTO_MIN_ROWS = 2048


def fp8_forward_engine(q: torch.Tensor, causal: bool = False) -> str:
    """``"gluon"`` or ``"triton"`` for ``flash_attn_fp8_func`` on ``q``'s device (e4m3 inputs).

    ``auto`` takes the Gluon kernel above d = 128, where it runs at about twice the ``tl.*``
    kernel's speed (H100, d = 256, V pre-transposed, N = 4k / 16k: non-causal 910 / 955 TFLOP/s
    against 457 / 484, causal 832 / 947 against 417 / 487), and at d = 65-128 for non-causal
    calls from 2048 query rows (three H100 runs, N = 4k / 16k: 2-11 % ahead, e.g. 881 against
    793 at N = 16k; 754 against 694 at N = 2k, but 551 against 606 at N = 1k).  The ``tl.*``
    kernel keeps the rest: causal d = 128 (N = 16k: 756 against 761, 740 against 828), d = 64
    (slower Gluon in every run: N = 16k non-causal 481 against 585) and short calls
    (docs/tuning.md).  ``gluon`` forces the Gluon kernel where it can run the call (else
    ``NotImplementedError``), ``triton`` the ``tl.*`` one.
    """
    wanted = requested_engine()
    d = q.shape[-1]
    pays = d > GLUON_FP8_AUTO_ABOVE_HEADDIM or (
        d >= GLUON_FP8_AUTO_MIN_HEADDIM and not causal and q.shape[1] >= GLUON_FP8_AUTO_MIN_ROWS)
    if wanted == "triton" or (wanted != "gluon" and not pays):
        return "triton"
    reason = None if q.is_cuda else "the tensors are not on a CUDA device"
    if reason is None:
        reason = gluon_device_reason(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if reason is None and q.shape[-1] > GLUON_FP8_MAX_HEADDIM:
        reason = f"head dim {q.shape[-1]} (the Gluon FP8 forward takes up to {GLUON_FP8_MAX_HEADDIM})"
    if reason is None and q.numel() // max(q.shape[-1], 1) > GLUON_MAX_QUERY_ROWS:
        reason = f"{q.numel() // q.shape[-1]} (query row, head) pairs (the Gluon kernels take up to 2^31 - 1)"
    if reason is None:
        return "gluon"
    if wanted == "gluon":
        raise NotImplementedError(f"{ENGINE_ENV}=gluon, but the Gluon FP8 forward cannot run this call: {reason}")
    return "triton"
