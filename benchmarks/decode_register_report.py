"""Registers and spills of the decode split kernel for sm_90, compiled offline (no GPU needed).

The split kernel carries the step's optional work behind constexprs -- the fused append of
new keys/values (``APPEND``) and the rotary of q and the new keys (``ROTARY``) -- so each
combination is compiled here at the H200's launch configuration (16-row query tile of one
GQA group, 128-key tiles, 4 warps, 3 stages; paged: 16-row pages) and ptxas's register
count and spill bytes are printed (``flashtile.kernels.sass.report``).  Pointer arguments a
variant does not read are constexpr ``None``, as the bound launch passes them::

    python benchmarks/decode_register_report.py [--headdim 128] [--block-n 128] [--stages 3]
"""

from __future__ import annotations

import argparse
import itertools

import triton

from flashtile.kernels import decode as kd
from flashtile.kernels.sass import TARGET, report

_POINTERS = ("Q", "K", "V", "O_PART", "SEQLENS_K", "CACHE_BATCH_IDX", "BLOCK_TABLE", "LEFTPAD", "ALIBI", "OUT", "LSE",
             "K_NEW", "V_NEW", "COS", "SIN")
_FLOATS = ("qk_scale", "softcap_scale", "softcap_log2")


def compile_split(hd=128, block_m=16, block_n=128, warps=4, stages=3, paged=False, append=False, rotary=False,
                  causal=False, direct=False, dtype="bf16"):
    fn = kd._decode_split
    used = {"Q", "K", "V", "OUT", "LSE", "SEQLENS_K"} | ({"O_PART"} if not direct else set())
    used |= {"BLOCK_TABLE"} if paged else set()
    used |= {"K_NEW", "V_NEW"} if append else set()
    used |= {"COS", "SIN"} if rotary else set()
    consts = {"HAS_SEQLENS": True, "headdim": hd, "HEAD_DIM": hd, "BLOCK_M": block_m, "BLOCK_N": block_n,
              "MASK_LEFT": False, "MASK_RIGHT": causal, "HAS_SOFTCAP": False, "HAS_ALIBI": False, "PAGED": paged,
              "PAGE_SIZE": 16 if paged else 1, "HAS_BATCH_IDX": False, "DOT_PRECISION": "tf32", "PDL": not direct,
              "DIRECT": direct, "HAS_LEFTPAD": False, "APPEND": append, "ROTARY": rotary, "INTERLEAVED": False,
              "ROTARY_LOCAL": causal, "BLOCK_B": 8 if append else 1, "BLOCK_P": 2 if append else 1,
              "BLOCK_T": 1, "BLOCK_NEW": 16}
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            if name in used:
                elt = "fp32" if name in ("O_PART", "LSE") or (name in ("COS", "SIN")) else \
                    "i32" if name in ("SEQLENS_K", "BLOCK_TABLE") else dtype
                sig[name] = f"*{elt}"
            else:
                sig[name] = "constexpr"
                consts[name] = None
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    # As at launch: fresh allocations and the usual strides are multiples of 16.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("Q", "K", "V", "O_PART", "OUT", "K_NEW", "V_NEW", "stride_qb", "stride_qn", "stride_kb",
                          "stride_kn", "stride_vb", "stride_vn", "stride_qh", "stride_kh", "stride_vh")
             if sig.get(name, "constexpr") != "constexpr"}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    for paged, append, rotary, direct in itertools.product((False, True), repeat=4):
        k = compile_split(hd=args.headdim, block_n=args.block_n if not paged else 64, stages=args.stages, paged=paged,
                          append=append, rotary=rotary, direct=direct)
        print(f"paged={int(paged)} append={int(append)} rotary={int(rotary)} direct={int(direct)}: {report(k)}",
              flush=True)


if __name__ == "__main__":
    main()
