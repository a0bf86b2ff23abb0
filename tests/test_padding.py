"""``pad_input`` / ``unpad_input``: argument errors."""

import pytest
import torch

import flashtile


def test_pad_input_with_a_smaller_batch_names_the_arguments():
    x = torch.randn(3, 5, 2, 4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    packed, indices, _, _ = flashtile.unpad_input(x, mask)
    with pytest.raises(ValueError, match=r"batch \* seqlen\) = \[0, 10\) for batch=2, seqlen=5"):
        flashtile.pad_input(packed, indices, 2, 5)
    assert torch.equal(flashtile.pad_input(packed, indices, 3, 5), x * mask[..., None, None])


def test_pad_input_indices_must_match_the_rows():
    packed = torch.randn(4, 2)
    with pytest.raises(ValueError, match="one entry per row"):
        flashtile.pad_input(packed, torch.arange(3), 1, 4)
    with pytest.raises(TypeError, match="torch.Tensors"):
        flashtile.pad_input(packed, [0, 1, 2, 3], 1, 4)
