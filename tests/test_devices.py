"""Public functions launch on their first argument's GPU (``flashtile.devices``), whatever
device is current: Triton launches on the current one."""

import contextlib

import pytest
import torch

import flashtile
from flashtile import devices


class _OnThirdGpu(torch.Tensor):
    """A CPU tensor that says it lives on GPU 3 (what the guard reads of its argument)."""

    def get_device(self):
        return 3


def test_the_guard_makes_the_first_arguments_device_current(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(devices, "_current_device", lambda: 0)

    @devices.on_input_device
    def fn(x, y=None):
        """doc"""
        return len(entered)

    x = torch.zeros(2).as_subclass(_OnThirdGpu)
    assert fn(x) == 1 and entered == [3]  # the call runs inside the guard
    assert fn(x=x) == 2  # the first argument by keyword
    assert fn(torch.zeros(2), x) == 2 and fn(None) == 2  # a CPU tensor, no tensor: no guard
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)  # traced: Inductor places the work
        assert fn(x) == 2
    monkeypatch.setattr(devices, "_current_device", lambda: 3)
    assert fn(x) == 2  # already current
    assert fn.__name__ == "fn" and fn.__doc__ == "doc"


@pytest.mark.parametrize("fn", [flashtile.flash_attn_func, flashtile.flash_attn_varlen_func,
                                flashtile.flash_attn_with_kvcache, flashtile.flash_attn_fp8_func,
                                flashtile.fp8.transpose_v, flashtile.apply_rotary_emb, flashtile.softmax,
                                flashtile.log_softmax], ids=lambda fn: fn.__name__)
def test_public_functions_that_launch_carry_the_guard(fn):
    assert fn.__code__ is devices.on_input_device(lambda x: x).__code__ and hasattr(fn, "__wrapped__")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_calls_on_the_second_gpu_run_there():
    """Inputs on GPU 1 while GPU 0 is current: the same results as with GPU 1 current."""
    gpu = torch.device("cuda", 1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 300, 8, 64, generator=g).to(gpu, torch.bfloat16) for _ in range(3))
    kc, vc = (torch.randn(2, 512, 2, 64, generator=g).to(gpu, torch.bfloat16) for _ in range(2))
    x = torch.randn(64, 1000, generator=g).to(gpu)

    def calls():
        return (flashtile.flash_attn_func(q, k, v, causal=True),
                flashtile.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=400),
                flashtile.softmax(x))

    with torch.cuda.device(1):
        expected = calls()
        torch.cuda.synchronize()
    assert torch.cuda.current_device() == 0
    got = calls()
    torch.cuda.synchronize(gpu)
    for a, b in zip(got, expected):
        assert a.device == gpu and torch.equal(a, b)
