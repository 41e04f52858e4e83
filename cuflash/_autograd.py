"""torch autograd for flash_attn_func: saves q, k, v, out and LSE (never S or P)."""
from __future__ import annotations

import torch

from . import _fwd
from .backward import backward_memo, bwd_backend, check_score_partition
from ._interop import wrap
from ._mods import mods_for
from ._validate import check_backward_headdim, check_layout, check_qkv


def _grad_view(x, like, name):
    """autograd may hand in a gradient with any strides (expanded, transposed): make it kernel-friendly."""
    try:
        a = wrap(x, name)
        check_layout(a, name)
        return a
    except ValueError:
        return wrap(x.contiguous(), name)


class FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic, algorithm, grid_order, dq_strategy,
                warp_partition="auto", backend="auto", window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, rng_state=None):
        qa, ka, va = check_qkv(q, k, v)
        check_backward_headdim(qa.shape[3], "the backward (autograd)")  # refused before the forward launches
        mods = None
        if algorithm == "v1":  # V1's backward uses the row statistics m and l themselves
            from .v1 import forward as v1_forward

            out, lse, m, l = v1_forward(qa, ka, va, softmax_scale, causal)
            ctx.save_for_backward(q, k, v, out, lse, m, l)
        else:
            # dropout: the (seed, offset) drawn by flash_attn_autograd, replayed by the backward through ctx.mods
            mods = mods_for(qa, ka, causal, window_size, softcap, alibi_slopes, softmax_scale, dropout_p=dropout_p,
                            rng_state=rng_state)
            if mods is not None and mods.mod:  # refused before the forward launches, not at the backward
                check_score_partition(warp_partition, qa.shape[3])
            out, lse = _fwd.forward(qa, ka, va, softmax_scale, causal, grid_order, backend=backend, mods=mods)
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (softmax_scale, causal, deterministic, algorithm, dq_strategy, warp_partition,
                   bwd_backend(backend))
        ctx.mods = mods
        ctx.alibi = alibi_slopes  # the slopes the kernels read stay alive until the backward
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros for the (non-differentiable) LSE's gradient
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *ml = ctx.saved_tensors
        softmax_scale, causal, deterministic, algorithm, dq_strategy, warp_partition, backend = ctx.cfg
        if dout is None:  # only the LSE was used: no gradient flows (set_materialize_grads(False))
            return (None,) * 16
        if algorithm == "v1":
            from .v1 import backward as v1_backward

            qa, ka, va = wrap(q, "q"), wrap(k, "k"), wrap(v, "v")
            da = _grad_view(dout, q, "dout")
            dq, dk, dv = v1_backward(da, qa, ka, va, wrap(out, "out"), wrap(ml[0], "m"), wrap(ml[1], "l"),
                                     softmax_scale, causal)
        else:
            args = (q, k, v, out, lse, softmax_scale, causal, dq_strategy, deterministic, warp_partition, ctx.mods,
                    backend)
            try:
                dq, dk, dv = backward_memo(dout, *args)
            except ValueError:  # autograd may hand in a gradient with any strides (expanded, transposed)
                if dout.is_contiguous():
                    raise
                dq, dk, dv = backward_memo(dout.contiguous(), *args)
        return (dq, dk, dv) + (None,) * 13


def flash_attn_autograd(q, k, v, softmax_scale, causal, deterministic, algorithm, grid_order, dq_strategy,
                        warp_partition="auto", backend="auto", window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                        dropout_p=0.0, rng_state=None):
    """(out, lse) through FlashAttnFunction; with dropout, rng_state is the (seed, offset) the kernels use (drawn
    from torch's generator when None: cuflash._dropout)."""
    return FlashAttnFunction.apply(q, k, v, softmax_scale, causal, deterministic, algorithm, grid_order, dq_strategy,
                                   warp_partition, backend, window_size, softcap, alibi_slopes, dropout_p, rng_state)


class FlashAttnVarlenFunction(torch.autograd.Function):
    """flash_attn_varlen_func under autograd (cuflash.varlen): saves q, k, v, out, the LSE and cu_seqlens."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_size, softcap, alibi_slopes, dropout_p, rng_state, deterministic, dq_strategy, backend):
        from ._varlen import check_varlen, varlen_forward

        q4, k4, v4, packed = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse, mods = varlen_forward(q4, k4, v4, packed, softmax_scale, causal, window_size, softcap,
                                        alibi_slopes, dropout_p, rng_state, backend)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.cfg = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, dq_strategy)
        ctx.mods, ctx.alibi = mods, alibi_slopes
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        from ._varlen import varlen_backward

        if dout is None:
            return (None,) * 17
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, softmax_scale, causal, deterministic, dq_strategy = ctx.cfg
        try:
            check_layout(wrap(dout, "dout"), "dout")
        except ValueError:  # autograd may hand in a gradient with any strides
            dout = dout.contiguous()
        dq, dk, dv = varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                                     deterministic, dq_strategy, ctx.mods)
        return (dq, dk, dv) + (None,) * 14
