"""Every Gluon kernel variant compiles for sm_90a without a GPU, within the spill budget, with wgmma.

Gluon is not run by Triton's interpreter, so this is what CI can check of the Hopper kernels:
the compile itself (a Gluon API or layout error fails here), ptxas's register spills (a
spilling kernel is a slow kernel; ``offline.SPILL_STORE_BUDGET`` says what little is
tolerated), that the tensor-core instructions (``HGMMA``) survived, and the shared-memory
budget.  The compile runs in a child process without
``TRITON_INTERPRET``: under the interpreter the shared ``tl.*`` helpers the Gluon kernels
call are interpreter objects, which the compiler cannot take.
"""

import json
import os
import subprocess
import sys

import pytest

from flashtile.kernels.hopper import gluon_available

pytestmark = pytest.mark.skipif(not gluon_available(), reason="needs the Triton release the Gluon kernels pin")


@pytest.fixture(scope="module")
def reports():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "flashtile.kernels.hopper.offline", "--json"], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode in (0, 1), f"the offline compile crashed:\n{run.stderr[-4000:]}"
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_every_variant_was_compiled(reports):
    from flashtile.kernels.hopper import offline

    assert len(reports) == len(list(offline.variants())) > 0


def test_no_variant_spills_beyond_budget_or_loses_wgmma(reports):
    from flashtile.kernels.hopper.offline import spill_budget, uses_wgmma

    bad = [r for r in reports if r["spill_stores"] > spill_budget(r)
           or r["stack"] > spill_budget(r) or (uses_wgmma(r) and not (r["HGMMA"] or r["QGMMA"]))]
    assert not bad, "\n".join(map(str, bad))


def test_no_variant_has_its_wgmma_serialised(reports):
    # ptxas note C7514: every wgmma waited for before the next one issues (e.g. an
    # accumulator read while another wgmma runs across a loop's back edge) -- correct but slow.
    bad = [r for r in reports if r["wgmma_serialized"]]
    assert not bad, "\n".join(map(str, bad))


def test_most_forward_variants_do_not_spill_at_all(reports):
    # The forward's budget at d >= 128 is for a few loop scalars in some variants (5 of 26:
    # 8-40 bytes, docs/tuning.md), not a drift everywhere.  At d = 64 three consumers fill the
    # SM's registers, and the dense variants spill within their own budget
    # (offline.SPILL_STORE_BUDGET).  Softcap and ALiBi variants have a budget of their own
    # (offline.SCORE_MOD_SPILL_BUDGET) and are not counted here.
    forward = [r for r in reports if r["kernel"] == "forward" and r["hd"] > 64
               and not (r.get("softcap") or r.get("alibi"))]
    spilling = [r for r in forward if r["spill_stores"]]
    assert len(spilling) <= len(forward) // 4, "\n".join(map(str, spilling))


def test_shared_memory_fits_an_sm90_multiprocessor(reports):
    # 227 KB of shared memory per block on H100 / H200.
    bad = [r for r in reports if r["shared"] > 232448]
    assert not bad, "\n".join(map(str, bad))
