"""flash-attn's packed-input functions: `flash_attn_qkvpacked_func(qkv, ...)` with qkv [batch, seqlen, 3, nheads,
headdim] and `flash_attn_kvpacked_func(q, kv, ...)` with kv [batch, seqlen_k, 2, nheads_k, headdim]. The packed
tensor is split into strided views (torch `select`, CuPy indexing: no copy) and handed to `flash_attn_func`,
which reads views in place; under torch autograd the gradients flow back into the packed tensor through the
views."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _interop
from .flash import flash_attn_func


def unpack(x, name: str, n: int, what: str, dim: int = 2, layout: str = "batch, seqlen"):
    """The n views x.select(dim, i) of a packed tensor (no copy): [batch, seqlen, n, heads, headdim] (dim 2), or a
    varlen one [total, n, heads, headdim] (dim 1; cuflash.varlen). ValueError naming `name` for another shape."""
    rank = dim + 3
    shape = x.shape if _interop.compiling() else _interop.wrap(x, name).shape
    if len(shape) != rank or shape[dim] != n:
        raise ValueError(f"{name} must be [{layout}, {n}, nheads, headdim] ({what}); got shape {tuple(shape)}")
    if _interop.compiling():  # torch.compile: plain tensor views (the attention is then one operator node)
        return tuple(x.select(dim, i) for i in range(n))
    a = _interop.wrap(x, name)
    if a.kind == _interop.TORCH:
        return tuple(a.obj.select(dim, i) for i in range(n))
    index = (slice(None),) * dim
    return tuple(a.obj[index + (i,)] for i in range(n))


def flash_attn_qkvpacked_func(qkv: Any, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Any = None, deterministic: bool = False, return_attn_probs: bool = False,
                              **kwargs):
    """flash_attn_func on q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2] (views). qkv: [batch, seqlen, 3,
    nheads, headdim]; the other arguments and the return value as flash_attn_func's (its keyword-only options
    too: algorithm, grid_order, dq_strategy, warp_partition, backend)."""
    q, k, v = unpack(qkv, "qkv", 3, "q, k and v stacked in dim 2")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **kwargs)


def flash_attn_kvpacked_func(q: Any, kv: Any, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Any = None, deterministic: bool = False, return_attn_probs: bool = False,
                             **kwargs):
    """flash_attn_func on q and k, v = kv[:, :, 0], kv[:, :, 1] (views). kv: [batch, seqlen_k, 2, nheads_k,
    headdim]; the rest as flash_attn_func's."""
    k, v = unpack(kv, "kv", 2, "k and v stacked in dim 2")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **kwargs)
