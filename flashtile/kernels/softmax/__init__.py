"""Row softmax / log-softmax kernels, forward and backward, chosen by row length and row count.

Softmax is memory-bound: the floor is one read and one write per element (the backward: two
reads and one write).  How close a kernel gets depends on whether a row fits on chip and,
when it does not, on whether its second read can be served by the L2 cache.  One module per
concern:

* ``planning``: which strategy for which row length and row count, and its launch shape;
* ``tuning``: the launch knobs behind the plan, and their one environment override,
  ``FLASHTILE_SOFTMAX_TUNING``;
* ``registers``: rows held whole in registers (1 read + 1 write);
* ``cooperative``: rows cut into chunks held in registers by programs that wait for each
  other on a cooperatively launched grid (1 read + 1 write however long the row);
* ``streaming``: rows read twice by the online softmax, by persistent programs (fused) or
  by row chunks with merged partials (split);
* ``rows``: what every strategy shares -- row addressing, the scale and mask rule, the
  normaliser, the merge of chunk partials, the backward's dx;
* ``packing``: 16-bit floats held as pairs in 32-bit words, and the inline PTX on them;
* ``residency``: how many programs of a compiled kernel the GPU holds at once;
* ``launch``: ``softmax_forward`` / ``softmax_backward``, which plan and launch.
* on Hopper, ``flashtile/kernels/hopper/staged_softmax.py`` (Gluon): long unmasked rows held in
  shared memory by cooperating programs, loaded and stored by the TMA engine (the backward of
  rows of 2 MB and more, the forward with the ``staged`` knob; ``planning.staged_plan``).

A row with no finite entry (all ``-inf`` / all masked) gives zeros (log-softmax: ``-inf``),
never NaN; NaN and ``+inf`` inputs propagate as in ``torch.softmax``.
"""

from flashtile.kernels.softmax.launch import softmax_backward, softmax_forward
from flashtile.kernels.softmax.packing import KIND_BF16X2, KIND_F16X2, KIND_PLAIN
from flashtile.kernels.softmax.planning import STRATEGIES, plan, streaming_strategy
from flashtile.kernels.softmax.residency import resident_programs_per_sm
from flashtile.kernels.softmax.rows import collapse_rows
from flashtile.kernels.softmax.tuning import KNOBS, TUNING_ENV, knobs

__all__ = [
    "KIND_BF16X2", "KIND_F16X2", "KIND_PLAIN", "KNOBS", "STRATEGIES", "TUNING_ENV", "collapse_rows", "knobs",
    "plan", "resident_programs_per_sm", "softmax_backward", "softmax_forward", "streaming_strategy",
]
