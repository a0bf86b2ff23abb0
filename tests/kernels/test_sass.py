"""The offline compile report (``flashtile/kernels/sass.py``) reads what the pipeliner built.

The decode split kernel is compiled for sm_90a in a child process without ``TRITON_INTERPRET``
(the compiler cannot take the interpreter's objects) at the launch configuration of a
contiguous cache (64-key tiles, 4 warps, 3 stages).  Its K and V loads must stay
software-pipelined: two tiles of each in flight, no synchronous load left in the loop.  A
change that stops the pipelining (a runtime mask on the head dim, an index the compiler cannot
prove contiguous) keeps the kernel correct and halves its bandwidth, which only this sees.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from decode_register_report import compile_split
from flashtile.kernels.sass import pipeline, report
kernel = compile_split(block_n=64, stages=3)
print(json.dumps({**pipeline(kernel), **report(kernel)}))
"""


def test_decode_split_kernel_streams_two_tiles_of_k_and_v():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD, str(BENCHMARKS)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["buffers"].count("2x64x128xbf16") == 2, result
    assert result["loop_loads"] == 0, result
    assert result["spill_stores"] == 0, result
