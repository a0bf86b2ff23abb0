"""The ``flashtile`` command: ``flashtile info``, ``bench``, ``iomodel`` and ``knobs``.

    flashtile --version
    flashtile info                      versions, devices, and which backend will run
    flashtile bench [--device auto|cpu|cuda] [--out DIR] [--seqlens N ...] [--headdim D]
                    [--batch B] [--nheads H] [--causal] [--compare LIST] [--quick]
    flashtile iomodel [--seqlens N ...] [--headdim D] [--batch B] [--nheads H] [--nheads-k HK]
                    [--causal] [--dtype bf16|fp16|fp32] [--figure2]
                                        predicted HBM bytes, naive vs flashtile (flashtile/analysis/)
    flashtile knobs [--markdown]        the kernels' launch knobs: defaults, values in force, variables

``python -m flashtile ...`` is the same.  Results go to ``--out DIR``, by default to a
per-user folder (:func:`flashtile.bench.common.default_out_dir`), never into a checkout.
An argument error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys
from importlib import metadata
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def backend_name(device) -> str:
    """The backend :func:`flashtile.flash_attn_func` uses for tensors on ``device``
    (it dispatches on the tensors' device: CUDA -> Triton kernels, anything else -> CPU path)."""
    import torch

    return "triton (CUDA)" if torch.device(device).type == "cuda" else "pytorch-cpu"


def _default_device():
    import torch

    get = getattr(torch, "get_default_device", None)
    return get() if get is not None else torch.empty(0).device


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import flashtile

    lines = [
        ("flashtile", f"{flashtile.__version__} ({Path(flashtile.__file__).resolve().parent})"),
        ("torch", torch.__version__),
        ("triton", _version("triton")),
        ("numpy", _version("numpy")),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", f"{platform.platform()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads"),
    ]
    cuda = torch.cuda.is_available()
    lines.append(("CUDA available", f"yes (CUDA {torch.version.cuda}), {torch.cuda.device_count()} device(s)" if cuda else "no"))
    if cuda:
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            lines.append((f"cuda:{i}", f"{torch.cuda.get_device_name(i)}, capability {major}.{minor}"))
    interp = os.environ.get("TRITON_INTERPRET")
    lines.append(("TRITON_INTERPRET", f"set ({interp!r})" if interp is not None else "not set"))
    dev = _default_device()
    lines.append(("default device", str(dev)))
    lines.append(("backend", f"{backend_name(dev)}  (flash_attn_func on tensors on the default device)"))
    if cuda and dev.type != "cuda":
        lines.append(("backend (CUDA)", "triton (CUDA)  (for tensors on a GPU)"))
    if cuda:
        from flashtile.kernels.engine import ENGINE_ENV, SPLIT_KV_MAX_SEQLEN_Q, gluon_device_reason, requested_engine

        for i in range(torch.cuda.device_count()):
            reason = gluon_device_reason(i)
            engine = "tl.* kernels" if reason else "Gluon (head dims 33-256, fp16/bf16), else tl.* kernels"
            lines.append((f"forward engine cuda:{i}",
                          f"{engine}  ({ENGINE_ENV}={requested_engine()}{'; ' + reason if reason else ''})"))
        if requested_engine() == "auto":
            lines.append(("few query rows", f"at most {SPLIT_KV_MAX_SEQLEN_Q} (no dropout): the split-KV decode kernel"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    return 0


def _split_list(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [x for v in values for x in v.split(",") if x]


def _results_dir(out: str | None) -> tuple[Path | None, str | None]:
    """The results folder, created: (path, None), or (None, why it cannot be used)."""
    from flashtile.bench.common import default_out_dir

    path = Path(out).expanduser() if out is not None else default_out_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return None, f"cannot create the results folder {str(path)!r}: {e.strerror or e}"
    if not os.access(path, os.W_OK | os.X_OK):
        return None, f"cannot write to the results folder {str(path)!r}"
    return path, None


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from flashtile.bench.cpu import DEFAULT_SEQLENS, IMPLS, QUICK_SEQLENS, plot_cpu, run_cpu_benchmark

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("flashtile bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    compare = _split_list(args.compare)
    if device == "cpu":
        impls = ["flashtile"] + [c for c in (compare if compare is not None else IMPLS) if c != "flashtile"]
        bad = [c for c in impls if c not in IMPLS]
        if bad:
            print(f"flashtile bench: --compare on CPU accepts {', '.join(i for i in IMPLS if i != 'flashtile')}; got {', '.join(bad)}", file=sys.stderr)
            return 2
    out_dir, problem = _results_dir(args.out)
    if problem is not None:
        print(f"flashtile bench: {problem}", file=sys.stderr)
        return 2

    if device == "cpu":
        records = run_cpu_benchmark(
            seqlens=args.seqlens or (QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS),
            batch=args.batch,
            nheads=args.nheads,
            headdim=args.headdim,
            causal=args.causal,
            out_path=out_dir / "attention_cpu.jsonl",
            progress=not args.no_progress,
            impls=impls,
            quick=args.quick,
        )
        png = out_dir / "attention_cpu.png"
        try:
            plot_cpu(records, png)
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)")
        else:
            print(f"plot of this run: {png}")
        return 0

    from flashtile.bench.gpu import run_gpu_benchmark  # written for the GPU; imported only here

    kwargs = {"out_dir": out_dir, "quick": args.quick}
    # Everything else is passed on only when given, and only where the GPU benchmark takes
    # it (its own defaults -- all its comparisons, its shape sweep -- apply otherwise).
    accepted = inspect.signature(run_gpu_benchmark).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    options = [
        ("--compare", "compare", compare),
        ("--seqlens", "seqlens", tuple(args.seqlens) if args.seqlens else None),
        ("--headdim", "headdims", (args.headdim,) if args.headdim_given else None),
        ("--causal", "causals", (True,) if args.causal else None),
        ("--batch", "batch", args.batch if args.batch_given else None),
        ("--nheads", "nheads", args.nheads if args.nheads_given else None),
        ("--no-progress", "progress", False if args.no_progress else None),
    ]
    for flag, name, value in options:
        if value is None:
            continue
        if name in accepted or takes_any:
            kwargs[name] = value
        else:
            print(f"flashtile bench: note: the GPU benchmark does not take {flag}; ignored", file=sys.stderr)
    run_gpu_benchmark(**kwargs)
    return 0


IOMODEL_SEQLENS = (1024, 4096, 16384)


def cmd_iomodel(args: argparse.Namespace) -> int:
    from flashtile import iomodel

    try:
        if args.figure2:
            print(iomodel.format_figure2())
            print()
        tiles = iomodel.kernel_tiles(args.headdim, args.dtype, args.causal)
        rows = []
        for n in args.seqlens or IOMODEL_SEQLENS:
            shape = iomodel.AttentionShape(args.batch, args.nheads, n, args.headdim, nheads_k=args.nheads_k,
                                           causal=args.causal, dtype=args.dtype)
            for mode in ("fwd", "bwd"):
                naive = iomodel.predict("naive", mode, shape, "ideal_l2").total_bytes
                upper = iomodel.predict("flashtile", mode, shape, "no_l2", tiles).total_bytes
                lower = iomodel.predict("flashtile", mode, shape, "ideal_l2", tiles).total_bytes
                rows.append((mode, n, naive, upper, lower))
    except (ValueError, RuntimeError) as e:
        print(f"flashtile iomodel: {e}", file=sys.stderr)
        return 2
    kv = f" (kv {args.nheads_k})" if args.nheads_k not in (None, args.nheads) else ""
    print(f"Predicted HBM bytes read + written (1 GB = 1e9 B): batch {args.batch}, {args.nheads} heads{kv}, "
          f"d={args.headdim}, {iomodel.dtype_name(args.dtype)}, {'causal' if args.causal else 'non-causal'}")
    print(f"flashtile tiles: {tiles.describe()}")
    print("flashtile no-L2: every tile load from HBM (upper bound); ideal-L2: each tensor read once (lower bound)")
    print("naive: torch ops (GEMM, scale, fp32 softmax, casts, GEMM), each tensor read once per kernel")
    header = f"{'mode':<5} {'N':>6}  {'naive':>10}  {'flashtile no-L2':>16}  {'ideal-L2':>10}  {'naive / no-L2':>13}  {'naive / ideal':>13}"
    print(header)
    for mode, n, naive, upper, lower in rows:
        print(f"{mode:<5} {n:>6}  {iomodel.format_bytes(naive):>10}  {iomodel.format_bytes(upper):>16}  "
              f"{iomodel.format_bytes(lower):>10}  {naive / upper:>12.1f}x  {naive / lower:>12.1f}x")
    return 0


def cmd_knobs(args: argparse.Namespace) -> int:
    try:
        from flashtile.kernels.runtime import all_knobs, knobs_table

        families = all_knobs()
        current = {family.name: family.current() for family in families}
    except ImportError as e:
        print(f"flashtile knobs: the kernels cannot be imported here ({e})", file=sys.stderr)
        return 1
    except ValueError as e:  # a malformed override in the environment
        print(f"flashtile knobs: {e}", file=sys.stderr)
        return 2
    if args.markdown:
        print(knobs_table(families))
        return 0
    for family in families:
        print(f"{family.name}: {family.env_var}={os.environ.get(family.env_var, '')!r}")
        rows = []
        for name, knob in family.knobs.items():
            value = current[family.name][name]
            rows.append((name, f"{value}" if value == knob.default else f"{value} (default {knob.default})", knob.doc))
        width = [max(len(row[i]) for row in rows) for i in (0, 1)]
        for name, shown, doc in rows:
            print(f"  {name:<{width[0]}}  {shown:<{width[1]}}  {doc}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _headdim(text: str) -> int:
    from flashtile.validation import MAX_HEADDIM

    value = _positive_int(text)
    if value > MAX_HEADDIM:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_HEADDIM}, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """An argument error is one line on stderr (``prog: error: ...``) and exit status 2:
    the usage block argparse prints by default is what ``--help`` is for."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Given(argparse.Action):
    """Store the value and remember that the option was given on the command line."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashtile", description="IO-aware exact attention: info and benchmarks.")
    parser.add_argument("--version", action="version", version=f"flashtile {_own_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench,iomodel,knobs}")

    p_info = sub.add_parser("info", help="print versions, devices and the backend flash_attn_func will use")
    p_info.set_defaults(func=cmd_info)

    p_bench = sub.add_parser(
        "bench",
        help="benchmark attention (CPU: flashtile vs naive vs SDPA; CUDA: the GPU benchmark)",
        description=(
            "Benchmark attention and append JSONL records to DIR (attention_cpu.jsonl and a plot, "
            "attention_cpu.png, on CPU). "
            "On CPU: time (median) and peak extra memory of flashtile, naive torch attention and "
            "torch SDPA, forward for every N and forward+backward for N <= 8192."
        ),
    )
    p_bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available, else cpu")
    p_bench.add_argument("--out", metavar="DIR", default=None,
                         help="results folder (default: the per-user folder $XDG_CACHE_HOME/flashtile, else ~/.cache/flashtile)")
    p_bench.add_argument("--seqlens", metavar="N", type=_positive_int, nargs="+", default=None,
                         help="sequence lengths (default on CPU: 512 ... 16384; with --quick 256 512)")
    p_bench.add_argument("--headdim", type=_headdim, default=64, action=_Given)
    p_bench.add_argument("--batch", type=_positive_int, default=1, action=_Given)
    p_bench.add_argument("--nheads", type=_positive_int, default=1, action=_Given)
    p_bench.add_argument("--causal", action="store_true", help="causal (bottom-right) mask")
    p_bench.add_argument("--compare", metavar="LIST", nargs="+", default=None, help="implementations to compare against, comma- or space-separated (CPU: naive, sdpa)")
    p_bench.add_argument("--quick", action="store_true",
                         help="smoke test: one timed repeat per case; on CPU also N = 256 512 unless --seqlens (seconds)")
    p_bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_bench.set_defaults(func=cmd_bench, headdim_given=False, batch_given=False, nheads_given=False)

    p_io = sub.add_parser(
        "iomodel",
        help="predicted HBM traffic: naive attention vs flashtile's kernels (no GPU needed)",
        description=(
            "Print the HBM bytes read + written that flashtile/analysis/iomodel.py predicts for naive attention "
            "and for flashtile's Triton kernels (with their real tile sizes), forward and backward."
        ),
    )
    p_io.add_argument("--seqlens", metavar="N", type=_positive_int, nargs="+", default=None,
                      help=f"sequence lengths (default {' '.join(map(str, IOMODEL_SEQLENS))})")
    p_io.add_argument("--headdim", type=_headdim, default=64)
    p_io.add_argument("--batch", type=_positive_int, default=1)
    p_io.add_argument("--nheads", type=_positive_int, default=16)
    p_io.add_argument("--nheads-k", type=_positive_int, default=None, help="kv heads (GQA); default: --nheads")
    p_io.add_argument("--causal", action="store_true", help="causal (bottom-right) mask")
    p_io.add_argument("--dtype", default="bfloat16", help="bf16 / bfloat16 (default), fp16 / float16, fp32 / float32")
    p_io.add_argument("--figure2", action="store_true",
                      help="also print the FlashAttention paper's Figure 2 comparison (GPT-2 medium on an A100)")
    p_io.set_defaults(func=cmd_iomodel)

    p_knobs = sub.add_parser(
        "knobs",
        help="the kernels' launch knobs: defaults, the values in force, the environment variables that set them",
    )
    p_knobs.add_argument("--markdown", action="store_true", help="the README's table of every knob")
    p_knobs.set_defaults(func=cmd_knobs)
    return parser


def _namespace_error() -> str | None:
    """Why ``import flashtile`` gave the wrong module, or None when it gave the package.

    ``python -m flashtile`` puts the current directory first on ``sys.path``; when that
    directory holds a folder named ``flashtile`` without an ``__init__.py`` (a clone of this
    repository, say), Python imports that folder as an empty namespace package in place of
    the installed one.
    """
    pkg = sys.modules.get("flashtile")
    if pkg is None or getattr(pkg, "__file__", None) is not None:
        return None
    where = ", ".join(str(p) for p in getattr(pkg, "__path__", [])) or "a folder"
    return (f"flashtile: `import flashtile` found the folder {where} (an empty namespace package), not the "
            f"flashtile package: run from another directory, or use the `flashtile` command")


def _own_version() -> str:
    import flashtile

    return getattr(flashtile, "__version__", "unknown")


def main(argv: list[str] | None = None) -> int:
    problem = _namespace_error()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, an argument error: argparse's exit status
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early (`flashtile info | head -1`): nothing left to say, and
        # stdout is pointed at /dev/null so that the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
