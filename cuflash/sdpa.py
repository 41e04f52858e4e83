"""`scaled_dot_product_attention` in torch's layout: query [batch, heads, seqlen_q, headdim], key / value
[batch, heads_k, seqlen_k, headdim], as torch.nn.functional.scaled_dot_product_attention takes them. The
arguments are transposed into [batch, seqlen, heads, headdim] views (no copy; cuflash reads strided views in
place), and the output comes back as a [batch, heads, seqlen_q, headdim] view of cuflash's output. torch's
is_causal aligns the mask top-left (query i sees keys j <= i), flash-attn's and cuflash's causal bottom-right;
the two agree when seqlen_q == seqlen_k, and is_causal with seqlen_q != seqlen_k is refused rather than
silently aligned the other way (flash_attn_func takes bottom-right causal at any lengths)."""
from __future__ import annotations

from typing import Any, Optional

from . import _interop
from .flash import flash_attn_func


def _t12(x, name):
    if _interop.compiling():  # torch.compile: plain tensor views
        if x.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seqlen, headdim]; got shape {tuple(x.shape)}")
        return x.transpose(1, 2)
    a = _interop.wrap(x, name)
    if len(a.shape) != 4:
        raise ValueError(f"{name} must be [batch, heads, seqlen, headdim]; got shape {tuple(a.shape)}")
    return a.obj.transpose(1, 2) if a.kind == _interop.TORCH else a.obj.transpose(0, 2, 1, 3)


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                                 **kwargs):
    """softmax(scale * Q K^T) V in torch's SDPA layout and arguments (see the module docstring); the keyword-only
    options of flash_attn_func (backend, ...) pass through. attn_mask is not supported (NotImplementedError);
    heads_k != heads needs enable_gqa=True, as in torch."""
    if attn_mask is not None:
        raise NotImplementedError("attn_mask is not supported (is_causal covers the causal mask)")
    q, k, v = _t12(query, "query"), _t12(key, "key"), _t12(value, "value")
    hq, hk = q.shape[2], k.shape[2]
    if is_causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError(f"is_causal with seqlen_q {q.shape[1]} != seqlen_k {k.shape[1]}: torch aligns "
                                  "this mask top-left, cuflash bottom-right (flash_attn_func(causal=True))")
    if hq != hk and not enable_gqa:
        raise ValueError(f"query has {hq} heads and key {hk}: pass enable_gqa=True for grouped-query attention")
    out = flash_attn_func(q, k, v, dropout_p, scale, is_causal, **kwargs)
    if _interop.compiling() or _interop.wrap(out, "out").kind == _interop.TORCH:
        return out.transpose(1, 2)
    return out.transpose(0, 2, 1, 3)
