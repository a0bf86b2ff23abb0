"""Test-suite setup shared by every test directory.

* Without a CUDA GPU the Triton kernels run in Triton's interpreter on the CPU: the
  environment variable must be set before any ``flashtile.kernels`` module (and so any
  ``@triton.jit``) is imported, hence at the top of this file, which pytest imports first.
* Torch runs single-threaded unless ``OMP_NUM_THREADS`` is set (see below).
* Tests marked ``gpu`` are skipped when CUDA is not available (the markers themselves are
  declared in ``pyproject.toml``).
* After a test, a CUDA cache above 8 GiB is emptied, so that parallel GPU runs do not run
  out of memory beside one test's leftovers.
* ``tests/`` has no ``__init__.py``; its directory is put on ``sys.path`` so that every test
  module, in any sub-directory, can ``import helpers``.
"""

from __future__ import annotations

import os
import sys

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import torch  # noqa: E402  (after the sys.path set-up on purpose)

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

# The tests use small shapes, where intra-op threads buy little, and on a loaded 2-core
# machine a second OpenMP thread makes every small op wait for a descheduled spinning peer
# (observed: 10-15x slower).  One thread unless the caller chose a count explicitly.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# A test that leaves many GiB in PyTorch's caching allocator would keep them from the other
# workers of a parallel GPU run (pytest -n): past this much reserved memory it is handed back.
CUDA_CACHE_RETURN_BYTES = 8 << 30


@pytest.fixture(autouse=True)
def _return_large_cuda_caches():
    yield
    if torch.cuda.is_initialized() and torch.cuda.memory_reserved() > CUDA_CACHE_RETURN_BYTES:
        torch.cuda.empty_cache()
