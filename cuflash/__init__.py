"""cuflash: exact attention (FlashAttention V1, V2, Flash-Decoding) as hand-written CUDA kernels.

Kernels live in cuda_src/*.cu and are compiled at run time through CuPy RawModule (NVRTC). Inputs are
torch CUDA tensors or CuPy arrays (zero-copy); outputs are of the same kind. Nothing here imports CuPy or
torch at import time, so `import cuflash` works on a machine without a GPU (references, compilation).

Public API (flash-attn's names and keywords):

* `flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, ..., return_attn_probs=False)`:
  exact attention, forward and (torch autograd) backward; FlashAttention-2, or FlashAttention-1 with
  algorithm="v1".
* `flash_attn_qkvpacked_func(qkv, ...)`, `flash_attn_kvpacked_func(q, kv, ...)`: the same on packed inputs
  ([b, s, 3, h, d] / [b, s, 2, hk, d]), split into views without a copy.
* `flash_attn_backward(dout, q, k, v, out, softmax_lse, ...)`: its gradients without autograd (CuPy).
* `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)` and its
  `_qkvpacked` / `_kvpacked` forms: packed sequences of different lengths ([total, h, d]), forward and backward;
  `flash_attn_varlen_backward` for CuPy.
* `flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
  ...)` (flash-attn's order): Flash-Decoding
  against a KV cache, with an optional in-place append.
* `naive_attention(q, k, v, softmax_scale=None, causal=False)`: the unfused baseline.
* `scaled_dot_product_attention(query, key, value, is_causal=False, scale=None, enable_gqa=False)`: the same
  in torch SDPA's [batch, heads, seqlen, headdim] layout, through views (no copy).
* `reference`: float64 NumPy references of every algorithm (CPU).
* Under torch.compile each entry point is one `torch.library` custom operator (cuflash._torch_ops): no graph break.
* `manual_seed(seed)`, `get_rng_state()`: the dropout generator of CuPy inputs (torch inputs use torch's).
* `dropout_mask(q, k, dropout_p, rng_state)`: the keep mask of a dropout call, [batch, nheads, seqlen_q, seqlen_k].

Layout: q [batch, seqlen_q, nheads, headdim], k / v [batch, seqlen_k, nheads_k, headdim], float16 or
bfloat16, any head dim up to 256 that is a multiple of 8. Every function validates its inputs before launching
anything and raises TypeError / ValueError / NotImplementedError naming the offending argument.
"""
from . import reference
from .backward import flash_attn_backward
from .kvcache import flash_attn_with_kvcache
from .flash import flash_attn_func
from .naive import naive_attention
from .packed import flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .sdpa import scaled_dot_product_attention
from .varlen import (flash_attn_varlen_backward, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                     flash_attn_varlen_qkvpacked_func)
from ._dropout import dropout_mask, get_rng_state, manual_seed

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_backward",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_backward", "flash_attn_with_kvcache", "naive_attention", "scaled_dot_product_attention", "reference", "manual_seed", "get_rng_state", "dropout_mask", "__version__"]
