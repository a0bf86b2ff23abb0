"""The Gluon forward and backward under Gluon's concurrency sanitizer (run with TRITON_INSTRUMENTATION_MODE=consan).

ConSan instruments every shared-memory access, mbarrier and async copy of the Gluon kernels
and traps on a read of a buffer that an in-flight TMA or wgmma may still touch, or on a
missing wait.  Small shapes, but more work items than programs, so the persistent loop's
hand-over between items (query buffer, K/V ring across items, ping-pong phases) is covered;
the backward cases (``bwd``) run the Gluon backward (the Q/dO ring, the shared dS tile, the dQ
writer's staging tiles at d = 128), in its default configuration and in each of
``attention_bwd.ALTERNATIVES``; at d = 256 the wide-head dK / dV kernel and the dQ pass
(``attention_bwd_dq``: its Q / dO buffers and K and V rings of their own depths), in the
defaults and each of the two kernels' ``ALTERNATIVES`` (specs ``dq:<spec>``, ``wide:<spec>``);
the FP8 forward (``fp8``) in its defaults and each of ``attention_fp8.ALTERNATIVES``::

    TRITON_INSTRUMENTATION_MODE=consan python benchmarks/hopper_consan.py [CASE ...]

(CASE: indices into ``CASES``, or ``fwd`` / ``bwd`` / ``fp8`` for all cases of that kind; default
all; each instrumented compile takes tens of seconds.)
"""

import os
import sys

import torch
import triton

from flashtile.kernels import attention as ka
from flashtile.kernels import engine
from flashtile.fp8 import quantize_fp8, transpose_v
from flashtile.kernels.hopper import attention_bwd, attention_bwd_dq, attention_bwd_wide, attention_fp8, configured
from flashtile.kernels.hopper import attention_fwd as hopper
from flashtile.kernels.tma import padded_headdim

assert os.environ.get("TRITON_INSTRUMENTATION_MODE") == "consan", "set TRITON_INSTRUMENTATION_MODE=consan"
# ConSan keeps its shadow state in global scratch memory, which Triton takes from this allocator.
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

# Backward cases: ("bwd", d, n, heads, causal, configuration spec: "" or one of attention_bwd.ALTERNATIVES,
# deterministic: the Gluon kernel without dQ, ``attention_bwd.separate_dq_config``).
# Forward cases: (d, n, heads, causal, varlen[, window_left[, score mods[, spec]]]), in
# ``config_for``'s default (three consumers at d = 64: at n = 600 and 700 the last tile's later
# consumers pass every key tile, and with a left window the earlier tiles of the later
# consumers) or as ``spec`` changes it; with score mods a softcap and ALiBi slopes, in the
# configuration such calls take (``call_config``).
CASES = [(64, 600, 32, False, False), (64, 700, 24, True, False), (64, 700, 24, True, False, 100),
         (128, 700, 24, True, False), (256, 300, 40, True, False), (128, 500, 24, False, True),
         ("bwd", 128, 300, 4, True, "", False), ("bwd", 64, 300, 4, False, "", False),
         ("bwd", 64, 300, 4, True, "", False), ("bwd", 128, 300, 4, True, "", True)]
CASES += [("bwd", 128, 300, 4, True, spec, False) for spec in attention_bwd.ALTERNATIVES]
# The late hand-over of the staged dQ share without the writer warp (d = 64: the consumer issues the TMA's add).
CASES += [("bwd", 64, 300, 4, True, "dk_early=1+dq_publish_late=1", False)]
# dK / dV without dQ at d = 64 (128-row query tiles, ``separate_dq_config``): deterministic and
# short masked calls take it.
CASES += [("bwd", 64, 300, 4, True, "", True)]
CASES += [(64, 700, 24, True, False, -1, True), (128, 500, 24, False, False, -1, True)]
# d = 256 without turns: the tiles of long unmasked calls (``call_config``), dense and packed.
CASES += [(256, 300, 40, False, varlen, -1, False, "pingpong=0") for varlen in (False, True)]
# More key tiles (and query tiles) than SMs, so that the persistent programs hand over between
# items: 3 tiles a head x 48 heads.
CASES += [("bwd", 128, 300, 48, causal, "persistent=1", False) for causal in (False, True)]
CASES += [("bwd", 256, 300, 48, causal, "", False) for causal in (False, True)]
CASES += [("bwd", 256, 300, 48, True, "dq:" + spec, False) for spec in attention_bwd_dq.ALTERNATIVES]
CASES += [("bwd", 256, 300, 48, True, "wide:" + spec, False) for spec in attention_bwd_wide.ALTERNATIVES]
# FP8 forward cases: ("fp8", d, n, heads, causal, configuration spec: "" or one of
# attention_fp8.ALTERNATIVES -- non-causal, where they differ from the default -- or 128-key tiles
# for causal d = 128).
CASES += [("fp8", 128, 700, 24, causal, "") for causal in (False, True)] + [("fp8", 64, 600, 32, True, "")]
CASES += [("fp8", 128, 700, 24, False, spec) for spec in attention_fp8.ALTERNATIVES
          if not attention_fp8.is_default(128, False, spec)]
CASES += [("fp8", 128, 700, 24, True, "block_n=128")]
# d = 256: the output in column chunks, each chunk's P V issued and waited for in turn.
CASES += [("fp8", 256, 300, 48, causal, "") for causal in (False, True)]
CASES += [("fp8", 256, 300, 48, False, spec) for spec in ("pv_cols=64", "pv_depth=2")]
# The short causal cases at d = 128 keep the dQ workspace (engine.separate_dq would give them the
# separate dQ pass, whose kernels the deterministic case runs), so the configurations are exercised.
engine.SEPARATE_DQ_MAX_ROWS = 0
default_bwd_config, default_dq_config = attention_bwd.config_for, attention_bwd_dq.config_for
default_wide_config = attention_bwd_wide.config_for


def _kind(case) -> str:
    return case[0] if isinstance(case[0], str) else "fwd"


def selected(args) -> list:
    """The case indices that ``args`` name: indices, or kinds (``fwd``, ``bwd``, ``fp8``)."""
    kinds = {_kind(c) for c in CASES}
    picked = []
    for a in args:
        if a in kinds:
            picked += [i for i, c in enumerate(CASES) if _kind(c) == a]
        elif a.isdigit() and int(a) < len(CASES):
            picked.append(int(a))
        else:
            sys.exit(f"hopper_consan.py: {a!r} is neither a case index below {len(CASES)} nor one of {sorted(kinds)}")
    return picked or list(range(len(CASES)))


for case in selected(sys.argv[1:]):
    if CASES[case][0] == "bwd":
        _, d, n, heads, causal, spec, deterministic = CASES[case]
        os.environ["FLASHTILE_ENGINE"] = "gluon"
        kernel, _, kernel_spec = spec.rpartition(":")
        attention_bwd.config_for = configured(default_bwd_config, "" if kernel else spec)
        attention_bwd_dq.config_for = configured(default_dq_config, kernel_spec if kernel == "dq" else "")
        attention_bwd_wide.config_for = configured(default_wide_config, kernel_spec if kernel == "wide" else "")
        import flashtile

        q, k, v = (torch.randn(1, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        # The ops called on this thread, not through autograd: the backward pass runs on autograd's
        # own thread, where the allocator set above (a context variable) is not visible.
        params = (d ** -0.5, -1, 0 if causal else -1, 0.0, None, 0.0, 0, 0, deterministic)
        out, lse = torch.ops.flashtile.attention_forward(q, k, v, *params)
        grads = torch.ops.flashtile.attention_backward(torch.randn_like(q), q, k, v, out, lse, None, *params)
        torch.cuda.synchronize()
        print(f"consan backward d={d} n={n} heads={heads} causal={causal} config={spec or 'default'} "
              f"deterministic={deterministic}: ok, "
              f"finite={all(bool(g.isfinite().all()) for g in grads)}", flush=True)
        continue
    if CASES[case][0] == "fp8":
        _, d, n, heads, causal, spec = CASES[case]
        (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(torch.randn(1, n, heads, d, device="cuda")) for _ in range(3))
        cfg = attention_fp8.config_from_spec(attention_fp8.padded_headdim(d), causal, spec)
        out, _ = attention_fp8.forward(q8, k8, transpose_v(v8), qd, kd, vd, d ** -0.5, causal=causal, config=cfg)
        torch.cuda.synchronize()
        print(f"consan fp8 d={d} n={n} heads={heads} causal={causal} config={spec or 'default'}: ok, "
              f"finite={bool(out.isfinite().all())}", flush=True)
        continue
    d, n, heads, causal, varlen, left, mods, spec = CASES[case] + (-1, False, "")[len(CASES[case]) - 5:]
    q, k, v = (torch.randn(1, n, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = hopper.call_config(padded_headdim(d), n, n, left, 0 if causal else -1, mods) if mods else \
        hopper.config_from_spec(padded_headdim(d), spec)
    if mods:
        slopes = torch.rand(heads, device="cuda")
        out, _ = hopper.forward(ka.Layout(q, k), q, k, v, d ** -0.5, left, 0 if causal else -1, config=cfg,
                                softcap=5.0, alibi_slopes=slopes)
    elif varlen:
        cu = torch.tensor([0, 1, n // 3, n], dtype=torch.int32, device="cuda")
        layout = ka.Layout(q[0], k[0], cu, cu, n - n // 3, n - n // 3)
        out, _ = hopper.forward(layout, q[0], k[0], v[0], d ** -0.5, -1, -1, config=cfg)
    else:
        out, _ = hopper.forward(ka.Layout(q, k), q, k, v, d ** -0.5, left, 0 if causal else -1, config=cfg)
    torch.cuda.synchronize()
    print(f"consan d={d} n={n} heads={heads} causal={causal} varlen={varlen} window_left={left} mods={mods} "
          f"config={spec or 'default'}: ok, finite={bool(out.isfinite().all())}", flush=True)
