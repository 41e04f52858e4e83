"""flash-attn's variable-length functions: `flash_attn_varlen_func`, `flash_attn_varlen_qkvpacked_func`,
`flash_attn_varlen_kvpacked_func`, and `flash_attn_varlen_backward` (the gradients, for CuPy users).

Sequences of different lengths are packed along one token dimension, q [total_q, nheads, headdim], k, v [total_k,
nheads_k, headdim], with cu_seqlens_q / cu_seqlens_k (int32 [batch + 1], the prefix sums of the lengths) saying
where each starts (cuflash/_varlen.py). The kernels are the V2 forward and backward of flash_attn_func compiled
for packed sequences (cuda_src/attn/seqlen.cuh); every option of flash_attn_func's runs per sequence: causal
(bottom-right aligned per sequence), sliding window, soft-cap, ALiBi (slopes per sequence and head), dropout, GQA.
The host never reads the lengths (no synchronisation: capturable, traceable).
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple, Union

from . import _interop
from ._fwd_sm90 import check_backend
from ._mods import mods_for
from ._validate import check_backward_headdim, check_softmax_scale, check_unsupported
from .packed import unpack
from ._varlen import NO_PAGES_GRAD, check_varlen, gather_pages, varlen_backward, varlen_forward


def _is_torch_grad(*xs) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def flash_attn_varlen_func(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                           max_seqlen_k: Any, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                           causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Any = None, deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Any = None, *, dq_strategy: Optional[str] = None,
                           backend: str = "auto") -> Union[Any, Tuple[Any, Any, Any]]:
    """Exact attention over packed sequences: flash-attn's `flash_attn_varlen_func`.

    Args:
        q: [total_q, nheads, headdim]; k, v: [total_k, nheads_k, headdim] (nheads a multiple of nheads_k), with
            flash_attn_func's dtypes, head dims (up to 256 with autograd, 512 forward only) and layout rules.
        cu_seqlens_q, cu_seqlens_k: int32 [batch + 1] on q's device, of q's kind, contiguous: sequence b is
            rows [cu[b], cu[b + 1]) of q and of k, v. Not read on the host, so not checked: they must start at
            0, not decrease, and end at total_q / total_k (flash-attn's contract). Empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: the longest sequences, as ints or 0-dim integer tensors (not read: no
            synchronisation). Only dq_strategy="seqpar" uses one (max_seqlen_k, as an int).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic: as flash_attn_func's,
            applied per sequence (causal and the window aligned to each sequence's bottom-right corner;
            alibi_slopes (nheads,) or (batch, nheads)).
        return_attn_probs: also return the LSE (float32 [nheads, total_q], flash-attn's varlen layout) and, with
            dropout, the probabilities: float32 [batch, nheads, max_seqlen_q, max_seqlen_k], sequence b's in
            [b, :, :len_q(b), :len_k(b)] and negated where dropout dropped them, zeros past them (flash-attn's
            S_dmask, without its rounding of the last two dims to multiples of 128), recomputed with CuPy from q, k
            and the LSE after reading cu_seqlens on the host (a synchronisation): for tests and inspection.
            Without dropout None.
        block_table: paged K/V (inference): k, v are then [num_pages, page_size, nheads_k, headdim] (page_size a
            multiple of 16) and block_table int32 [batch, max_pages]: sequence b's key r is row r % page_size of
            page block_table[b, r // page_size]. The pages are gathered into packed rows (one pass, room for
            batch x max_pages x page_size keys) and the packed kernels run on them; with autograd:
            NotImplementedError (flash-attn's paged path has no backward either).
        dq_strategy: the backward's, as flash_attn_func's ("seqpar" needs max_seqlen_k as an int).
        backend: the forward's kernels, as flash_attn_func's ("auto": the Hopper kernels on sm_90 where they apply).

    Returns:
        out [total_q, nheads, headdim] like q; with return_attn_probs, (out, softmax_lse, S_dmask or None). Torch
        tensors that require grad get a differentiable out (the backward: the packed V2 backward kernels).

    Raises (before anything is launched, naming the argument): TypeError, ValueError as flash_attn_func's, and for
        cu_seqlens of the wrong dtype, rank, length or layout, and max_seqlen that is neither an int nor a 0-dim
        integer tensor, a bad block_table or page size, and with return_attn_probs and dropout a max_seqlen shorter
        than a sequence; NotImplementedError for block_table with autograd.
    """
    if _interop.compiling():
        from ._torch_ops import compiled_flash_attn_varlen

        return compiled_flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                          softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                          return_attn_probs, block_table, dq_strategy, backend)
    check_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    check_softmax_scale(softmax_scale)
    check_backend(backend)
    if block_table is not None:  # paged K/V (inference): the pages gathered into packed rows, one pass
        if _is_torch_grad(q, k, v):
            raise NotImplementedError(NO_PAGES_GRAD)
        k, v = gather_pages(q, k, v, block_table, cu_seqlens_k)
    q4, k4, v4, packed = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    layout = None
    if return_attn_probs and dropout_p:  # S_dmask's layout: cu_seqlens read on the host, checked before any launch
        from ._dropout import varlen_probs_layout

        layout = varlen_probs_layout(packed, max_seqlen_q, max_seqlen_k)
    rng_state = None
    if dropout_p:
        from ._dropout import next_state

        rng_state = next_state(q4.kind, q4.device)
    if _is_torch_grad(q, k, v):
        check_backward_headdim(q4.shape[3], "the backward (autograd)")
        from ._autograd import FlashAttnVarlenFunction

        out, lse = FlashAttnVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 softmax_scale, causal, window_size, softcap, alibi_slopes,
                                                 dropout_p, rng_state, deterministic, dq_strategy, backend)
    else:
        out, lse, _ = varlen_forward(q4, k4, v4, packed, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                     dropout_p, rng_state, backend)
    if not return_attn_probs:
        return out
    probs = None
    if dropout_p:
        from ._dropout import attention_probs_varlen

        probs = attention_probs_varlen(_interop.wrap(q, "q"), _interop.wrap(k, "k"), lse, packed, layout,
                                       softmax_scale, causal, window_size, softcap, alibi_slopes, float(dropout_p),
                                       rng_state)
    return out, lse, probs


def flash_attn_varlen_qkvpacked_func(qkv: Any, cu_seqlens: Any, max_seqlen: Any, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Any = None, deterministic: bool = False,
                                     return_attn_probs: bool = False, **kwargs):
    """flash_attn_varlen_func on q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2] (views; gradients flow back into qkv).
    qkv: [total, 3, nheads, headdim]; cu_seqlens, max_seqlen serve q and k; the rest as flash_attn_varlen_func's."""
    q, k, v = unpack(qkv, "qkv", 3, "q, k and v stacked in dim 1", dim=1, layout="total")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  **kwargs)


def flash_attn_varlen_kvpacked_func(q: Any, kv: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                                    max_seqlen_k: Any, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                                    softcap: float = 0.0, alibi_slopes: Any = None, deterministic: bool = False,
                                    return_attn_probs: bool = False, **kwargs):
    """flash_attn_varlen_func on q and k, v = kv[:, 0], kv[:, 1] (views). kv: [total_k, 2, nheads_k, headdim]."""
    k, v = unpack(kv, "kv", 2, "k and v stacked in dim 1", dim=1, layout="total")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **kwargs)


def flash_attn_varlen_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, softmax_lse: Any, cu_seqlens_q: Any,
                               cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
                               softmax_scale: Optional[float] = None, causal: bool = False,
                               deterministic: bool = False, *, dq_strategy: Optional[str] = None,
                               window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                               dropout_p: float = 0.0,
                               rng_state: Optional[Tuple[int, int]] = None) -> Tuple[Any, Any, Any]:
    """Gradients of flash_attn_varlen_func for CuPy users (also accepts torch tensors): dout, out like q, softmax_lse
    float32 [nheads, total_q] from flash_attn_varlen_func(..., return_attn_probs=True) of the same inputs and
    options; dropout_p, rng_state as flash_attn_backward's. Returns packed (dq, dk, dv) like q, k, v."""
    check_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    check_softmax_scale(softmax_scale)
    if dropout_p and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state: the (seed, offset) of the forward call "
                         "(cuflash.get_rng_state() before it, for CuPy arrays)")
    q4, k4, _, packed = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods = mods_for(q4, k4, causal, window_size, softcap, alibi_slopes, softmax_scale, dropout_p=dropout_p,
                    rng_state=rng_state, batch=packed.batch)
    return varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, deterministic, dq_strategy, mods)
