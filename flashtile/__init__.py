"""flashtile: IO-aware exact attention and softmax kernels (Triton on GPU, PyTorch on CPU)."""

from flashtile.interface import flash_attn_func
from flashtile.ops.softmax import log_softmax, softmax

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "softmax", "log_softmax", "__version__"]
