"""cuflash's entry points as torch custom operators, so that torch.compile traces through them without a graph break.

Registered with `torch.library.custom_op` when torch is imported (module import time of this file; flash_attn_func
and flash_attn_with_kvcache import it only while Dynamo traces, so eager calls keep their direct launch path):

* `cuflash::flash_attn_fwd(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
  alibi_slopes, grid_order, backend, deterministic, dq_strategy, warp_partition) -> (out, softmax_lse,
  rng_state)`: the V2 forward (the last three are the backward's options, kept for its autograd formula).
  rng_state is an int64 [2] CPU tensor, the (seed, offset) dropout took from torch's generator at run time (zeros
  without dropout), so that the backward replays it; the random draw happens inside the operator, once per call
  of the compiled graph.
* `cuflash::flash_attn_bwd(dout, q, k, v, out, softmax_lse, rng_state, dropout_p, softmax_scale, causal, ...)
  -> (dq, dk, dv)`: the V2 backward; the forward's autograd formula (`register_autograd`).
* `cuflash::flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)` and
  `cuflash::flash_attn_varlen_bwd`: the same for packed sequences (cuflash.varlen; max_seqlen -1 when the caller
  passed a 0-dim tensor, which is never read).
* `cuflash::paged_kv_gather(q, k, v, block_table, cu_seqlens_k) -> (k, v)`: a paged varlen call's pages as packed
  rows (no autograd: the paged path is inference-only), before `flash_attn_varlen_fwd`.
* `cuflash::flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, ..., rotary_cos, rotary_sin,
  cache_batch_idx, cache_leftpad, block_table, rotary_interleaved) -> (out, softmax_lse)`: the decode path; it
  mutates k_cache and v_cache (the append), declared in the schema.

Each has a fake implementation that gives the outputs' shapes, dtypes and strides without launching anything, and
the real one validates as the eager functions do. `compiled_flash_attn` / `compiled_kvcache` are what the public
functions return while compiling."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _dropout
from .backward import bwd_backend
from ._mods import mods_for, rng_state_of
from ._validate import check_backward_headdim, check_bool, check_qkv, check_softmax_scale, check_unsupported

Tensor = torch.Tensor
_NO_RNG = (0, 0)


def _window(window_left: int, window_right: int) -> tuple:
    return int(window_left), int(window_right)


@torch.library.custom_op("cuflash::flash_attn_fwd", mutates_args=(), device_types="cuda")
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
                   window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                   grid_order: str, backend: str, deterministic: bool, dq_strategy: Optional[str],
                   warp_partition: str) -> Tuple[Tensor, Tensor, Tensor]:
    from . import _fwd
    from .backward import check_warp_partition

    check_unsupported(dropout_p, _window(window_left, window_right), softcap, alibi_slopes)
    check_softmax_scale(softmax_scale)
    check_warp_partition(warp_partition)
    qa, ka, va = check_qkv(q, k, v)
    state = _dropout.next_state(qa.kind, qa.device) if dropout_p else None
    mods = mods_for(qa, ka, causal, _window(window_left, window_right), softcap, alibi_slopes, softmax_scale,
                    dropout_p=dropout_p, rng_state=state)
    out, lse = _fwd.forward(qa, ka, va, softmax_scale, causal, grid_order, backend=backend, mods=mods)
    seed, offset = rng_state_of(mods) or _NO_RNG
    return out, lse, torch.tensor([_dropout._int64(seed), _dropout._int64(offset)], dtype=torch.int64)


@flash_attn_fwd.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, grid_order,
      backend, deterministic, dq_strategy, warp_partition):
    b, sq, h, d = q.shape
    return (q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32),
            torch.empty((2,), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("cuflash::flash_attn_bwd", mutates_args=(), device_types="cuda")
def flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor,
                   dropout_p: float, softmax_scale: float, causal: bool, window_left: int, window_right: int,
                   softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool, dq_strategy: Optional[str],
                   warp_partition: str, backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    from .backward import backward_memo

    qa, ka, _ = check_qkv(q, k, v)
    check_backward_headdim(qa.shape[3], "the backward")
    state = tuple(int(x) for x in rng_state.tolist()) if dropout_p else None
    mods = mods_for(qa, ka, causal, _window(window_left, window_right), softcap, alibi_slopes, softmax_scale,
                    dropout_p=dropout_p, rng_state=state)
    if not dout.is_contiguous():
        dout = dout.contiguous()
    return backward_memo(dout, q, k, v, out, lse, softmax_scale, causal, dq_strategy, deterministic, warp_partition,
                         mods, backend)


@flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
      alibi_slopes, deterministic, dq_strategy, warp_partition, backend):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _setup_context(ctx, inputs, output):
    (q, k, v, dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, grid_order,
     backend, deterministic, dq_strategy, warp_partition) = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state)
    ctx.opts = (dropout_p, softmax_scale, causal, window_left, window_right, softcap)
    ctx.bwd_opts = (deterministic, dq_strategy, warp_partition, bwd_backend(backend))
    ctx.alibi = alibi_slopes


def _backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    dropout_p, softmax_scale, causal, window_left, window_right, softcap = ctx.opts
    deterministic, dq_strategy, warp_partition, backend = ctx.bwd_opts
    dq, dk, dv = torch.ops.cuflash.flash_attn_bwd(dout, q, k, v, out, lse, rng_state, dropout_p, softmax_scale,
                                                  causal, window_left, window_right, softcap, ctx.alibi,
                                                  deterministic, dq_strategy, warp_partition, backend)
    return (dq, dk, dv) + (None,) * 12


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cuflash::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"),
                         device_types="cuda")
def flash_attn_with_kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                               cache_seqlens: Optional[Tensor], cache_seqlens_int: int, softmax_scale: float,
                               causal: bool, num_splits: int, window_left: int, window_right: int, softcap: float,
                               alibi_slopes: Optional[Tensor], rotary_cos: Optional[Tensor],
                               rotary_sin: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                               cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                               rotary_interleaved: bool) -> Tuple[Tensor, Tensor]:
    from .decode import flash_attn_with_kvcache

    seqlens = cache_seqlens if cache_seqlens is not None else (None if cache_seqlens_int < 0 else cache_seqlens_int)
    return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale=softmax_scale, causal=causal,
                                   num_splits=num_splits, return_softmax_lse=True,
                                   window_size=_window(window_left, window_right), softcap=softcap,
                                   rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes)


@flash_attn_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, softmax_scale, causal, num_splits, window_left,
      window_right, softcap, alibi_slopes, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
      rotary_interleaved):
    b, sq, h, d = q.shape
    return q.new_empty((b, sq, h, d)), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("cuflash::paged_kv_gather", mutates_args=(), device_types="cuda")
def paged_kv_gather(q: Tensor, k: Tensor, v: Tensor, block_table: Tensor,
                    cu_seqlens_k: Tensor) -> Tuple[Tensor, Tensor]:
    """Paged K/V of a varlen call as packed rows (cuflash._varlen.gather_pages)."""
    from ._varlen import gather_pages

    return gather_pages(q, k, v, block_table, cu_seqlens_k)


@paged_kv_gather.register_fake
def _(q, k, v, block_table, cu_seqlens_k):
    rows = block_table.shape[0] * block_table.shape[1] * k.shape[1]
    return k.new_empty((rows, k.shape[2], k.shape[3])), v.new_empty((rows, v.shape[2], v.shape[3]))


@torch.library.custom_op("cuflash::flash_attn_varlen_fwd", mutates_args=(), device_types="cuda")
def flash_attn_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                          window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                          backend: str, deterministic: bool,
                          dq_strategy: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    """The packed forward (cuflash.varlen); max_seqlen_* -1 where the caller passed a 0-dim tensor."""
    from ._varlen import check_varlen, varlen_forward

    check_unsupported(dropout_p, _window(window_left, window_right), softcap, alibi_slopes)
    check_softmax_scale(softmax_scale)
    mq = None if max_seqlen_q < 0 else max_seqlen_q
    mk = None if max_seqlen_k < 0 else max_seqlen_k
    q4, k4, v4, packed = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, mq if mq is not None else 0,
                                      mk if mk is not None else 0)
    packed.max_q, packed.max_k = mq, mk
    state = _dropout.next_state(q4.kind, q4.device) if dropout_p else None
    out, lse, mods = varlen_forward(q4, k4, v4, packed, softmax_scale, causal, _window(window_left, window_right),
                                    softcap, alibi_slopes, dropout_p, state, backend)
    seed, offset = rng_state_of(mods) or _NO_RNG
    return out, lse, torch.tensor([_dropout._int64(seed), _dropout._int64(offset)], dtype=torch.int64)


@flash_attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, backend, deterministic, dq_strategy):
    total, h, d = q.shape
    return (q.new_empty((total, h, d)), q.new_empty((h, total), dtype=torch.float32),
            torch.empty((2,), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("cuflash::flash_attn_varlen_bwd", mutates_args=(), device_types="cuda")
def flash_attn_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          rng_state: Tensor, dropout_p: float, softmax_scale: float, causal: bool, window_left: int,
                          window_right: int, softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
                          dq_strategy: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    from ._varlen import check_varlen, varlen_backward

    q4, k4, _, packed = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, 0, 0)
    state = tuple(int(x) for x in rng_state.tolist()) if dropout_p else None
    mods = mods_for(q4, k4, causal, _window(window_left, window_right), softcap, alibi_slopes, softmax_scale,
                    dropout_p=dropout_p, rng_state=state, batch=packed.batch)
    if not dout.is_contiguous():
        dout = dout.contiguous()
    mq = max_seqlen_q if max_seqlen_q >= 0 else torch.zeros((), dtype=torch.int32)
    mk = max_seqlen_k if max_seqlen_k >= 0 else torch.zeros((), dtype=torch.int32)
    return varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, mq, mk, softmax_scale, causal,
                           deterministic, dq_strategy, mods)


@flash_attn_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rng_state, dropout_p,
      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, deterministic, dq_strategy):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap,
     alibi_slopes, backend, deterministic, dq_strategy) = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state)
    ctx.opts = (max_q, max_k, dropout_p, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                dq_strategy)
    ctx.alibi = alibi_slopes


def _varlen_backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
    max_q, max_k, dropout_p, softmax_scale, causal, wl, wr, softcap, deterministic, dq_strategy = ctx.opts
    dq, dk, dv = torch.ops.cuflash.flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                         rng_state, dropout_p, softmax_scale, causal, wl, wr,
                                                         softcap, ctx.alibi, deterministic, dq_strategy)
    return (dq, dk, dv) + (None,) * 14


flash_attn_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ------------------------------------------------------------------------------- the compiled paths
def compiled_flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_attn_probs, block_table, dq_strategy, backend):
    """flash_attn_varlen_func while Dynamo traces: one cuflash::flash_attn_varlen_fwd node (max_seqlen given as a
    tensor goes in as -1: never read)."""
    from ._varlen import NO_PAGES_GRAD

    if return_attn_probs and dropout_p:
        raise NotImplementedError("return_attn_probs with dropout_p > 0: not implemented for packed sequences")
    if block_table is not None:  # paged K/V: the gather is a node of its own, then the packed forward
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise NotImplementedError(NO_PAGES_GRAD)
        k, v = torch.ops.cuflash.paged_kv_gather(q, k, v, block_table, cu_seqlens_k)
    d = q.shape[-1]
    scale = float(d) ** -0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window_size
    mq = max_seqlen_q if isinstance(max_seqlen_q, int) else -1
    mk = max_seqlen_k if isinstance(max_seqlen_k, int) else -1
    out, lse, _ = torch.ops.cuflash.flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, mq, mk,
                                                          float(dropout_p), scale, bool(causal), int(left),
                                                          int(right), float(softcap), alibi_slopes, backend,
                                                          bool(deterministic), dq_strategy)
    return (out, lse, None) if return_attn_probs else out


def compiled_flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs, algorithm, grid_order, dq_strategy, warp_partition,
                        backend):
    """flash_attn_func while Dynamo traces: one cuflash::flash_attn_fwd node (its autograd formula the backward
    node). The options are checked here with plain Python on constants; the tensors inside the operator."""
    if algorithm != "v2":
        raise NotImplementedError("algorithm='v1' under torch.compile: the V2 kernels only (algorithm='v2')")
    if return_attn_probs and dropout_p:
        raise NotImplementedError("return_attn_probs with dropout under torch.compile (S_dmask is recomputed "
                                  "eagerly): call it outside the compiled region")
    d = q.shape[-1]
    scale = float(d) ** -0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window_size
    out, lse, _ = torch.ops.cuflash.flash_attn_fwd(q, k, v, float(dropout_p), scale, bool(causal), int(left),
                                                   int(right), float(softcap), alibi_slopes, grid_order, backend,
                                                   bool(deterministic), dq_strategy, warp_partition)
    return (out, lse, None) if return_attn_probs else out


def compiled_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                     cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                     window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                     return_softmax_lse=False, *, scratch=None, kernel="decode", loads=None):
    """flash_attn_with_kvcache while Dynamo traces (its arguments, flash-attn's order): one
    cuflash::flash_attn_with_kvcache node (the decode kernel with its default loads; scratch, kernel and loads are
    eager-only options)."""
    check_bool(rotary_interleaved, "rotary_interleaved")
    if scratch is not None or kernel != "decode" or loads is not None:
        raise NotImplementedError("scratch / kernel / loads under torch.compile: the decode kernel with its own "
                                  "partials and default loads")
    d = q.shape[-1]
    scale = float(d) ** -0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window_size
    tensor_seqlens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    seqlens_int = -1 if cache_seqlens is None or tensor_seqlens is not None else int(cache_seqlens)
    out, lse = torch.ops.cuflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, tensor_seqlens, seqlens_int, scale,
                                                         bool(causal), int(num_splits), int(left), int(right),
                                                         float(softcap), alibi_slopes, rotary_cos, rotary_sin,
                                                         cache_batch_idx, cache_leftpad, block_table,
                                                         rotary_interleaved)
    return (out, lse) if return_softmax_lse else out
