"""Compile the attention kernels for sm_90 without a GPU and report registers, spills and SASS.

Triton compiles for an explicit target on any machine, and its wheel carries ``ptxas`` and
``cuobjdump``: so register pressure -- the first suspect when a kernel runs far below the
tensor-core rate -- can be read here, before spending device time.  Example::

    python benchmarks/kernel_report.py dkdv --tiles 64,128,8,2 32,128,8,2 --headdim 128 --causal 0 1
    python benchmarks/kernel_report.py decode --tiles 16,128,4,3 --causal 0 --paged-cache 0 1 --append 0 1

prints, per configuration, ptxas's register count and spill bytes and the number of
``HGMMA`` (wgmma) and local-memory (``LDL``/``STL``) instructions in the SASS
(``flashtile.kernels.sass.report``), and the shared-memory rings of the software pipeliner
(``flashtile.kernels.sass.pipeline``).
"""

from __future__ import annotations

import argparse
import itertools

import triton

from flashtile.kernels.attention import backward as kb
from flashtile.kernels.attention import forward as kf
from flashtile.kernels.sass import TARGET, pipeline, report
COMMON = {"seqlen_q": "i32", "seqlen_k": "i32", "qk_scale": "fp32", "window_left": "i32", "window_right": "i32",
          "ALIBI": "*fp32", "stride_ab": "i32", "softcap_scale": "fp32", "softcap_log2": "fp32",
          "CU_Q": "*i32", "CU_K": "*i32", "stride_lb": "i32", "stride_lh": "i32",
          "dropout_p": "fp32", "seed": "i64", "rng_offset": "i64", "rng_cols": "i32"}
VARLEN = False
PAGED = False  # fwd: K/V gathered from a paged cache (varlen only)
PAGE_SIZE = 16


def _desc(rows: int, hd: int, dtype: str) -> str:
    # Dense and packed batches alike: a host descriptor (packed: over (1, total, heads, d)).
    return f"tensordesc<{dtype}[1, {rows}, 1, {hd}]>"


def compile_kernel(kind: str, bm: int, bn: int, hd: int, warps: int, stages: int, causal: bool,
                   paged_cache: bool = False, dtype: str = "bf16", softcap: bool = False, alibi: bool = False,
                   dropout: bool = False, append: bool = False, rotary: bool = False, direct: bool = False):
    masks = {"HEAD_DIM": hd, "BLOCK_M": bm, "BLOCK_N": bn, "MASK_LEFT": False, "MASK_RIGHT": causal,
             "DOT_PRECISION": "tf32", "HAS_SOFTCAP": softcap, "HAS_ALIBI": alibi, "VARLEN": VARLEN,
             "HAS_DROPOUT": dropout}
    if kind == "fwd":
        fn = kf._attn_fwd
        # paged_kv: (K_CACHE, V_CACHE, BLOCK_TABLE, num_blocks, max_blocks, headdim, 6 strides).
        paged_kv = (f"*{dtype}", f"*{dtype}", "*i32") + ("i32",) * 9 if PAGED else ("*fp32",) * 3 + ("i32",) * 9
        sig = {"Q_desc": _desc(bm, hd, dtype), "K_desc": _desc(bn, hd, dtype), "V_desc": _desc(bn, hd, dtype),
               "paged_kv": paged_kv, "stride_bt": "i32",
               "O_desc": _desc(bm, hd, dtype), "O": f"*{dtype}", "LSE": "*fp32", **COMMON, "nheads": "i32",
               "group": "i32", "max_seqlen_q": "i32"}
        consts = dict(masks, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE if PAGED else 1)
    elif kind == "dkdv":
        fn = kb._attn_bwd_dkdv
        sig = {"Q_desc": _desc(bm, hd, dtype), "K_desc": _desc(bn, hd, dtype), "V_desc": _desc(bn, hd, dtype),
               "DO_desc": _desc(bm, hd, dtype), "DK_desc": _desc(bn, hd, dtype), "DV_desc": _desc(bn, hd, dtype),
               "DK": f"*{dtype}", "DV": f"*{dtype}", "LSE2": "*fp32", "Delta": "*fp32", **COMMON, "nheads_k": "i32",
               "group": "i32", "softmax_scale": "fp32", "max_seqlen_k": "i32"}
        consts = masks
    elif kind == "dq":
        fn = kb._attn_bwd_dq
        sig = {"Q_desc": _desc(bm, hd, dtype), "K_desc": _desc(bn, hd, dtype), "V_desc": _desc(bn, hd, dtype),
               "DO_desc": _desc(bm, hd, dtype), "DQ_desc": _desc(bm, hd, dtype), "DQ": f"*{dtype}",
               "LSE2": "*fp32", "Delta": "*fp32", **COMMON, "nheads": "i32", "group": "i32", "softmax_scale": "fp32",
               "max_seqlen_q": "i32"}
        consts = masks
    elif kind == "decode":
        # The split kernel's arguments come from decode_register_report's builder (one list of
        # the kernel's parameters, read from its signature, so this report cannot drift from
        # it).  BLOCK_M: the GQA group (8 query heads) of one query row, padded to 16.
        from decode_register_report import compile_split

        return compile_split(hd=hd, block_m=bm, block_n=bn, warps=warps, stages=stages, paged=paged_cache,
                             append=append, rotary=rotary, causal=causal, direct=direct, dtype=dtype,
                             softcap=softcap, alibi=alibi)
    else:
        raise ValueError(f"kind must be fwd, dkdv, dq or decode, got {kind!r}")
    # The signature must list every parameter, in any order, constexprs included.
    sig.update({name: "constexpr" for name in consts})
    # As at launch: pointers to fresh allocations are 16-byte aligned.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ("O", "DK", "DV", "DQ", "Q", "K", "V", "O_PART", "LSE_PART", "stride_qb", "stride_qn",
                          "stride_kb", "stride_kn", "stride_vb", "stride_vn", "stride_qh", "stride_kh", "stride_vh")
             if name in sig}
    if kind == "fwd" and PAGED:
        # Triton specialises a tuple's elements as it does arguments: the caches, the block table,
        # the head dim and the strides of a d = 128 cache are multiples of 16 (or 16-byte aligned).
        attrs.update({(fn.arg_names.index("paged_kv"), i): [["tt.divisibility", 16]]
                      for i in (0, 1, 2, 5, 6, 7, 8, 9, 10, 11)})
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("fwd", "dkdv", "dq", "decode"))
    ap.add_argument("--tiles", nargs="+", default=["64,128,8,2"], help="BLOCK_M,BLOCK_N,warps,stages")
    ap.add_argument("--headdim", type=int, nargs="+", default=[128])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--paged-cache", type=int, nargs="+", default=[0], help="decode: 1 = a paged cache (16-row pages)")
    ap.add_argument("--append", type=int, nargs="+", default=[0], help="decode: 1 = the fused append of new keys")
    ap.add_argument("--rotary", type=int, nargs="+", default=[0], help="decode: 1 = rotary of q (and new keys)")
    ap.add_argument("--direct", type=int, nargs="+", default=[0], help="decode: 1 = one split (writes out itself)")
    ap.add_argument("--softcap", type=int, nargs="+", default=[0])
    ap.add_argument("--alibi", type=int, nargs="+", default=[0])
    ap.add_argument("--varlen", action="store_true", help="the packed-batch variant")
    ap.add_argument("--dropout", action="store_true")
    ap.add_argument("--paged", type=int, default=0, metavar="PAGE_SIZE",
                    help="fwd: K/V gathered from a paged cache with this page size (implies --varlen)")
    args = ap.parse_args()
    global VARLEN, PAGED, PAGE_SIZE
    VARLEN = args.varlen or args.paged > 0
    PAGED, PAGE_SIZE = args.paged > 0, max(args.paged, 1)
    decode = args.kind == "decode"
    for tiles, hd, causal, kvb, sc, al, ap_, rot, dr in itertools.product(
            args.tiles, args.headdim, args.causal, args.paged_cache if decode else [0], args.softcap, args.alibi,
            args.append if decode else [0], args.rotary if decode else [0], args.direct if decode else [0]):
        bm, bn, w, s = map(int, tiles.split(","))
        k = compile_kernel(args.kind, bm, bn, hd, w, s, bool(causal), bool(kvb), softcap=bool(sc), alibi=bool(al),
                           dropout=args.dropout, append=bool(ap_), rotary=bool(rot), direct=bool(dr))
        extra = f" paged_cache={kvb} append={ap_} rotary={rot} direct={dr}" if decode else ""
        print(f"{args.kind} BLOCK_M={bm} BLOCK_N={bn} warps={w} stages={s} d={hd} causal={causal}{extra} "
              f"softcap={sc} alibi={al} varlen={int(VARLEN)} dropout={int(args.dropout)}: {report(k)} {pipeline(k)}",
              flush=True)


if __name__ == "__main__":
    main()
