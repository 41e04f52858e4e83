"""cuflash: exact attention (FlashAttention V1, V2, Flash-Decoding) as hand-written CUDA kernels.

Kernels live in cuda_src/*.cu and are compiled at run time through CuPy RawModule (NVRTC). Inputs are
torch CUDA tensors or CuPy arrays (zero-copy); outputs are of the same kind. Nothing here imports CuPy or
torch at import time, so `import cuflash` works on a machine without a GPU (references, compilation).
"""
from . import reference
from .backward import flash_attn_backward
from .decode import flash_attn_with_kvcache
from .flash import flash_attn_func
from .naive import naive_attention

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_backward", "flash_attn_with_kvcache", "naive_attention", "reference", "__version__"]
