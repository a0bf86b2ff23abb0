"""Registers and spills of the decode split kernel for sm_90, compiled offline (no GPU needed).

The split kernel carries the step's optional work behind constexprs -- the fused append of
new keys/values (``APPEND``), the rotary of q and the new keys (``ROTARY``) and the merge of
the splits by their last program (``MERGE_LAST``, 8 splits) -- so each combination is
compiled here at the H200's launch configuration (16-row query tile of one GQA group,
128-key tiles, 4 warps, 3 stages; paged: 16-row pages and 64-key tiles) and ptxas's register
count and spill bytes are printed (``flashtile.kernels.sass.report``), with the shared-memory
rings the software pipeliner built and the loads it left synchronous in the loop
(``flashtile.kernels.sass.pipeline``).  Pointer arguments a
variant does not read are constexpr ``None``, as the bound launch passes them, and the int
arguments are specialised as Triton specialises those of the H200 decoding step
(``_sample_ints``: equal to 1 -> constexpr, multiples of 16 marked so)::

    python benchmarks/decode_register_report.py [--headdim 128] [--block-n 128] [--stages 3]
"""

from __future__ import annotations

import argparse
import itertools

import triton

from flashtile.kernels import decode as kd
from flashtile.kernels.sass import TARGET, pipeline, report

_POINTERS = ("Q", "K", "V", "O_PART", "SEQLENS_K", "CACHE_BATCH_IDX", "BLOCK_TABLE", "LEFTPAD", "ALIBI", "OUT", "LSE",
             "K_NEW", "V_NEW", "COS", "SIN", "ARRIVALS")
_FLOATS = ("qk_scale", "softcap_scale", "softcap_log2")


def _sample_ints(paged, append, rotary, direct, block_n, seqlen_q=1, seqlen_new=1):
    """The int arguments of the H200 decoding step the launch plans are tuned for (batch 1, one
    query row, 32 / 4 heads, d = 128, 32k cache: contiguous, or 16-row pages; one appended
    key; rotary tables of 64 columns), by name: Triton specialises an int on its value (1: a
    constexpr; a multiple of 16: divisibility), so the report compiles what that launch
    compiles.  Arguments not listed are plain i32 (not a multiple of 16)."""
    cache, nheads_k, d, page = 32768, 4, 128, 16
    return {
        "seqlen_k_all": 0, "stride_ab": 0, "stride_ob": 32 * d, "stride_on": 32 * d, "stride_oh": d,
        "stride_qb": 32 * d, "stride_qn": 32 * d, "stride_qh": d,
        "stride_kb": page * nheads_k * d if paged else cache * nheads_k * d, "stride_kn": nheads_k * d, "stride_kh": d,
        "stride_vb": page * nheads_k * d if paged else cache * nheads_k * d, "stride_vn": nheads_k * d, "stride_vh": d,
        "stride_bt": cache // page if paged else 0,
        "stride_knb": nheads_k * d, "stride_knn": nheads_k * d, "stride_knh": d,
        "stride_vnb": nheads_k * d, "stride_vnn": nheads_k * d, "stride_vnh": d,
        "stride_cos_p": 64 if rotary else 0, "stride_cos_k": 1 if rotary else 0,
        "stride_sin_p": 64 if rotary else 0, "stride_sin_k": 1 if rotary else 0,
        "seqlen_ro": 2 * cache if rotary else 0, "half_rotary": 64 if rotary else 0,
        "seqlen_q": seqlen_q, "nheads_k": nheads_k, "group": 8, "chunk": 4 * block_n, "num_splits": 1 if direct else 8,
        "seqlen_new": seqlen_new if append else 0, "capacity": cache, "cache_rows": cache // page if paged else 1,
        "window_left": -1, "window_right": -1,
    }


def compile_split(hd=128, block_m=16, block_n=128, warps=4, stages=3, paged=False, append=False, rotary=False,
                  causal=False, direct=False, dtype="bf16", softcap=False, alibi=False, interleaved=False,
                  seqlen_q=1, seqlen_new=1, merge_last=False, block_s=8):
    """The split kernel compiled for sm_90 with the pointer arguments and constexprs of a
    launch of this variant (the one argument builder of the offline reports: also
    ``benchmarks/kernel_report.py decode``)."""
    fn = kd._decode_split
    used = {"Q", "K", "V", "OUT", "LSE", "SEQLENS_K"} | ({"O_PART"} if not direct else set())
    used |= {"BLOCK_TABLE"} if paged else set()
    used |= {"ALIBI"} if alibi else set()
    used |= {"K_NEW", "V_NEW"} if append else set()
    used |= {"COS", "SIN"} if rotary else set()
    used |= {"ARRIVALS"} if merge_last and not direct else set()
    consts = {"HAS_SEQLENS": True, "headdim": hd, "HEAD_DIM": hd, "BLOCK_M": block_m, "BLOCK_N": block_n,
              "MASK_LEFT": False, "MASK_RIGHT": causal, "HAS_SOFTCAP": softcap, "HAS_ALIBI": alibi, "PAGED": paged,
              "PAGE_SIZE": 16 if paged else 1, "HAS_BATCH_IDX": False, "DOT_PRECISION": "tf32",
              "PDL": not (direct or merge_last), "DIRECT": direct, "MERGE_LAST": merge_last and not direct,
              "BLOCK_S": block_s if merge_last and not direct else 1, "HAS_LEFTPAD": False, "APPEND": append,
              "ROTARY": rotary, "INTERLEAVED": interleaved,
              "ROTARY_LOCAL": causal, "BLOCK_B": 8 if append else 1, "BLOCK_P": 2 if append else 1,
              "BLOCK_T": 1, "BLOCK_NEW": 16}
    ints = _sample_ints(paged, append, rotary, direct, block_n, seqlen_q, seqlen_new)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            if name in used:
                elt = "fp32" if name in ("O_PART", "LSE", "ALIBI", "COS", "SIN") else \
                    "i32" if name in ("SEQLENS_K", "BLOCK_TABLE", "ARRIVALS") else dtype
                sig[name] = f"*{elt}"
            else:
                sig[name] = "constexpr"
                consts[name] = None
        elif name in _FLOATS:
            sig[name] = "fp32"
        elif ints.get(name) == 1:
            # Triton makes an int argument equal to 1 a constexpr, as the launch does.
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
    # As at launch: fresh allocations are 16-byte aligned, and Triton marks the int arguments
    # that are multiples of 16 (the sample's values, below).
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in fn.arg_names
             if sig[name] != "constexpr" and (name in _POINTERS and name not in ("SEQLENS_K", "BLOCK_TABLE")
                                              or ints.get(name, 1) % 16 == 0)}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    for paged, append, rotary, direct in itertools.product((False, True), repeat=4):
        for interleaved, merge_last in itertools.product((False, True) if rotary else (False,),
                                                         (False,) if direct else (False, True)):
            k = compile_split(hd=args.headdim, block_n=args.block_n if not paged else 64, stages=args.stages,
                              paged=paged, append=append, rotary=rotary, direct=direct, interleaved=interleaved,
                              merge_last=merge_last)
            print(f"paged={int(paged)} append={int(append)} rotary={int(rotary)} interleaved={int(interleaved)} "
                  f"direct={int(direct)} merge_last={int(merge_last)}: {report(k)} {pipeline(k)}", flush=True)

if __name__ == "__main__":
    main()
