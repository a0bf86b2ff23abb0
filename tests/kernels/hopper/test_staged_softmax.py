"""The shared-memory softmax for long rows (``flashtile/kernels/hopper/staged_softmax.py``) against the
float64 oracle, on an sm_90 GPU; its launch shapes (``staged_softmax.plan``) anywhere.

Every GPU test runs ``flashtile.softmax`` / ``log_softmax`` forward and backward with the path's
threshold at 0 and checks, by counting the path's launches, that both directions ran on it.
The tolerance is the softmax tests' rule (``tests/softmax_oracle.py``).
"""

import pytest
import torch

from helpers import is_hopper
from softmax_oracle import BF16, F16, F32, NAN, NEG_INF, POS_INF, check_fwd_bwd, randn

import flashtile
from flashtile.kernels import softmax as ks

staged_softmax = pytest.importorskip("flashtile.kernels.hopper.staged_softmax")

needs_hopper = pytest.mark.skipif(not is_hopper(), reason="the Gluon kernels need an sm_90 GPU")
H200_SMS = 132


@pytest.mark.parametrize("n_rows,n_cols,elem,tensors", [
    (1, 65536, 2, 1), (300, 65536, 2, 1), (64, 262144, 2, 1), (1, 4_194_304, 2, 1), (64, 4_194_304, 4, 1),
    (7, 64 * 1001, 2, 1), (300, 65536, 2, 2), (64, 1_048_576, 4, 2), (2, 4_194_304, 2, 2), (3, 32 * 77, 4, 1),
])
def test_plan_holds_every_row_within_shared_memory(n_rows, n_cols, elem, tensors):
    p = staged_softmax.plan(n_rows, n_cols, elem, tensors, H200_SMS)
    row_boxes = -(-n_cols // staged_softmax.inner_cols(elem) // staged_softmax.BOX_ROWS)
    assert p is not None and p.programs <= H200_SMS and p.groups <= n_rows
    assert p.buffers * p.chunk_boxes * tensors <= staged_softmax.SLOTS
    # Every chunk program has at least one box of the row, and the chunks cover it.
    assert (p.splits - 1) * p.chunk_boxes < row_boxes <= p.splits * p.chunk_boxes
    # Two buffers whenever a row's chunks fit in half of the programs' slots.
    assert p.buffers == (2 if -(-row_boxes // (staged_softmax.SLOTS // (2 * tensors))) <= H200_SMS else 1)


def test_plan_fills_the_gpu_and_refuses_what_cannot_be_staged():
    # 8 boxes a row (64k bf16): two chunks of 4 boxes, 66 rows in flight -> every SM busy.
    p = staged_softmax.plan(1000, 65536, 2, 1, H200_SMS)
    assert (p.splits, p.chunk_boxes, p.groups, p.buffers) == (2, 4, 66, 2)
    # One row: as many chunk programs as it has boxes.
    assert staged_softmax.plan(1, 65536, 2, 1, H200_SMS).programs == 8
    assert staged_softmax.plan(5, 64 * 1000 + 8, 2, 1, H200_SMS) is None  # not whole 128-byte inner rows
    assert staged_softmax.plan(1, 8 * 2**20, 4, 1, H200_SMS) is None  # 32 MB: more than 132 x 192 KB
    assert staged_softmax.plan(1, 4 * 2**20, 4, 2, H200_SMS) is None  # y and dy: 32 MB


def test_only_aligned_separate_rows_of_whole_inner_rows_are_staged():
    x = torch.empty(4, 65536, dtype=torch.bfloat16)
    assert staged_softmax.stageable(x, 65536, 65536)
    assert staged_softmax.stageable(x[:, :32768], 65536, 32768)  # a strided view's rows
    assert not staged_softmax.stageable(x[:1].expand(4, 65536), 0, 65536)  # broadcast: stride 0
    assert not staged_softmax.stageable(x, 32768, 65536)  # overlapping rows
    assert not staged_softmax.stageable(x.view(-1)[4:], 65536, 65536)  # base 8 bytes past 16-byte alignment
    assert not staged_softmax.stageable(x, 65536 + 4, 65536)  # row stride not a multiple of 16 bytes
    assert not staged_softmax.stageable(x[:, :1000], 65536, 1000)  # not whole 128-byte inner rows
    assert not staged_softmax.stageable(x.to(torch.int16), 65536, 65536)


@pytest.fixture
def hopper_planning(monkeypatch):
    """``planning.staged_plan`` as on an H200: compiled kernels, a Gluon device, 132 SMs."""
    from flashtile.kernels import engine
    from flashtile.kernels.softmax import planning

    monkeypatch.setattr(planning, "INTERPRET", False)
    monkeypatch.setattr(planning, "sm_count", lambda index: H200_SMS)
    monkeypatch.setattr(engine, "gluon_device_reason", lambda index: None)
    return planning


def test_by_default_only_the_backward_of_long_rows_is_staged(hopper_planning, monkeypatch):
    """The defaults as measured (``tuning.STAGED_BWD_MIN_BYTES``): a backward of rows of 2 MB
    and more, never a forward, nor a backward of shorter rows; the knobs override both ways."""
    monkeypatch.delenv(ks.TUNING_ENV, raising=False)
    plan = hopper_planning.staged_plan
    assert plan(256, 1_048_576, 2, 2, 0) is not None  # bf16 1M: 2 MB a row
    assert plan(1024, 262_144, 4, 2, 0) is None  # fp32 256k: 1 MB
    assert plan(256, 1_048_576, 2, 1, 0) is None  # the forward
    assert plan(64, 4_194_304, 4, 2, 0) is None  # fp32 4M: y and dy exceed shared memory
    assert plan(256, 1_048_576, 2, 2, 0, strategy="fused") is None
    monkeypatch.setenv(ks.TUNING_ENV, "staged_bwd_min_bytes=0")
    assert plan(256, 1_048_576, 2, 2, 0) is None
    monkeypatch.setenv(ks.TUNING_ENV, "staged=1")
    assert plan(256, 1_048_576, 2, 1, 0) is not None
    assert plan(1024, 262_144, 4, 2, 0) is not None


class _Refusing:
    """A kernel whose launch fails like the driver's refusal of a cooperative grid (or otherwise)."""

    def __init__(self, message):
        self.message = message

    def __getitem__(self, grid):
        def launch(*args, **options):
            assert options["launch_cooperative_grid"] is True
            raise RuntimeError(self.message)
        return launch


def test_a_refused_cooperative_launch_falls_back():
    p = staged_softmax.StagedPlan(splits=2, groups=3, chunk_boxes=4, buffers=2)
    parts = (torch.empty(2 * p.programs),)
    refused = _Refusing("CUDA error: too many blocks in cooperative launch")
    assert staged_softmax._launch(refused, p, (), parts, 3, 65536, 2, 1.0, False) is False
    with pytest.raises(RuntimeError, match="illegal address"):
        staged_softmax._launch(_Refusing("an illegal address"), p, (), parts, 3, 65536, 2, 1.0, False)


@pytest.fixture
def staged_calls(monkeypatch):
    """The path at every row length, and a count of its forward and backward launches that ran
    (a launch the driver refused returns False, and the other paths compute the result)."""
    monkeypatch.setenv(ks.TUNING_ENV, "staged=1,staged_min_bytes=0")
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(staged_softmax, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            ran = _real(*args, **kwargs)
            calls[_name] += bool(ran)
            return ran

        monkeypatch.setattr(staged_softmax, name, counted)
    return calls


def _check_staged(x, calls, scale=None, log=False, backward_staged=True):
    before = dict(calls)
    y, dx = check_fwd_bwd(x, scale=scale, log=log)
    assert calls["forward"] == before["forward"] + 1
    assert calls["backward"] == before["backward"] + backward_staged
    return y, dx


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("rows,cols", [
    (1, 2048),            # one box, one program
    (5, 64 * 1001),       # the last box of each row partly past its end
    (300, 65536),         # many rounds per group: the partials' two slots alternate
    (3, 262144),
    (1, 1_048_576),       # one row over many programs
], ids=str)
def test_staged_matches_oracle(rows, cols, dtype, log, staged_calls):
    x = randn(rows, cols, dtype=dtype, device="cuda", seed=cols + rows, std=2.0)
    _check_staged(x, staged_calls, scale=0.9, log=log)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_staged_one_buffer_rows(dtype, staged_calls):
    """Rows too long for two buffers: 16 MB fp32 forward (bf16: the backward's y and dy); fp32's
    backward (32 MB a row) exceeds the GPU's shared memory and is left to the other paths."""
    cols = 4_194_304
    x = randn(2, cols, dtype=dtype, device="cuda", seed=11)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tensors = 1 if dtype == F32 else 2
    assert staged_softmax.plan(2, cols, x.element_size(), tensors, sms).buffers == 1
    backward_staged = staged_softmax.plan(2, cols, x.element_size(), 2, sms) is not None
    assert backward_staged == (dtype != F32)
    _check_staged(x, staged_calls, backward_staged=backward_staged)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_staged_non_finite_rows_and_scales(log, staged_calls):
    rows, cols = 8, 64 * 1001
    x = randn(rows, cols, dtype=F32, device="cuda", seed=5, std=3.0)
    x[0] = 1000.0                      # a large common value
    x[1, ::2], x[1, 1::2] = 1000.0, -1000.0
    x[2, 7] = NAN                      # NaN propagates to its row
    x[3, -1] = POS_INF                 # +inf: NaN row, as torch.softmax
    x[4, : cols // 2] = NEG_INF        # -inf in the first chunks only
    x[5, -5:] = 80.0                   # the row's max in its last, partial box
    y, _ = _check_staged(x, staged_calls, scale=0.7, log=log)
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all()
    for scale in (-1.3, 0.0):
        _check_staged(x[4:], staged_calls, scale=scale, log=log)
    empty = torch.full((2, cols), NEG_INF, device="cuda")  # no finite entry: zeros / -inf
    out = (flashtile.log_softmax if log else flashtile.softmax)(empty, -1)
    assert torch.equal(out, torch.full_like(out, NEG_INF if log else 0.0))


@pytest.mark.gpu
@needs_hopper
def test_staged_repeats_are_bitwise_equal(staged_calls):
    """Chunks merge in chunk order whatever order their programs arrive in."""
    x = randn(300, 262144, dtype=BF16, device="cuda", seed=3)
    first = flashtile.softmax(x, -1)
    for _ in range(20):
        assert torch.equal(flashtile.softmax(x, -1), first)


@pytest.mark.gpu
@needs_hopper
def test_staged_rows_of_a_strided_view(staged_calls):
    """Every other row of a larger tensor: rows a stride apart are read in place."""
    base = randn(6, 2 * 65536, dtype=BF16, device="cuda", seed=9, std=2.0)
    x = base[:, :65536]
    _check_staged(x, staged_calls, log=False)
