"""`flash_attn_with_kvcache`, the public entry: the decode path of cuflash.decode, or, while torch.compile traces,
its custom operator (cuflash._torch_ops: one node, the cache append declared as a mutation)."""
from __future__ import annotations

import functools

from . import decode
from ._interop import compiling


@functools.wraps(decode.flash_attn_with_kvcache)
def flash_attn_with_kvcache(*args, **kwargs):
    if compiling():
        from ._torch_ops import compiled_kvcache

        return compiled_kvcache(*args, **kwargs)
    return decode.flash_attn_with_kvcache(*args, **kwargs)
