"""The ``flashtile`` command: ``flashtile info`` and ``flashtile bench``.

    flashtile info                      versions, devices, and which backend will run
    flashtile bench [--device auto|cpu|cuda] [--out DIR] [--seqlens N ...] [--headdim D]
                    [--batch B] [--nheads H] [--causal] [--compare LIST] [--quick]

``python -m flashtile ...`` is the same.
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
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    return 0


def _split_list(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [x for v in values for x in v.split(",") if x]


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from flashtile.bench.cpu import DEFAULT_SEQLENS, IMPLS, default_out_dir, run_cpu_benchmark

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("flashtile bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out is not None else default_out_dir()
    compare = _split_list(args.compare)

    if device == "cpu":
        impls = ["flashtile"] + [c for c in (compare if compare is not None else IMPLS) if c != "flashtile"]
        bad = [c for c in impls if c not in IMPLS]
        if bad:
            print(f"flashtile bench: --compare on CPU accepts {', '.join(i for i in IMPLS if i != 'flashtile')}; got {', '.join(bad)}", file=sys.stderr)
            return 2
        run_cpu_benchmark(
            seqlens=args.seqlens or DEFAULT_SEQLENS,
            batch=args.batch,
            nheads=args.nheads,
            headdim=args.headdim,
            causal=args.causal,
            out_path=out_dir / "attention_cpu.jsonl",
            progress=not args.no_progress,
            impls=impls,
            quick=args.quick,
        )
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


class _Given(argparse.Action):
    """Store the value and remember that the option was given on the command line."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtile", description="IO-aware exact attention: info and benchmarks.")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench}")

    p_info = sub.add_parser("info", help="print versions, devices and the backend flash_attn_func will use")
    p_info.set_defaults(func=cmd_info)

    p_bench = sub.add_parser(
        "bench",
        help="benchmark attention (CPU: flashtile vs naive vs SDPA; CUDA: the GPU benchmark)",
        description=(
            "Benchmark attention and append JSONL records to DIR (attention_cpu.jsonl on CPU). "
            "On CPU: time (median) and peak extra memory of flashtile, naive torch attention and "
            "torch SDPA, forward for every N and forward+backward for N <= 8192."
        ),
    )
    p_bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available, else cpu")
    p_bench.add_argument("--out", metavar="DIR", default=None, help="results folder (default: benchmarks/results if it exists here, else ./flashtile-results)")
    p_bench.add_argument("--seqlens", metavar="N", type=int, nargs="+", default=None, help="sequence lengths (default on CPU: 512 ... 16384)")
    p_bench.add_argument("--headdim", type=int, default=64, action=_Given)
    p_bench.add_argument("--batch", type=int, default=1, action=_Given)
    p_bench.add_argument("--nheads", type=int, default=1, action=_Given)
    p_bench.add_argument("--causal", action="store_true", help="causal (bottom-right) mask")
    p_bench.add_argument("--compare", metavar="LIST", nargs="+", default=None, help="implementations to compare against, comma- or space-separated (CPU: naive, sdpa)")
    p_bench.add_argument("--quick", action="store_true", help="one timed repeat per case (smoke test)")
    p_bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_bench.set_defaults(func=cmd_bench, headdim_given=False, batch_given=False, nheads_given=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
