"""`flash_attn_func`: FlashAttention-2 (and, with algorithm="v1", FlashAttention-1) with flash-attn's interface.

This module validates the options and dispatches: torch tensors that require grad go through autograd
(cuflash/_autograd.py: forward and backward kernels), everything else through the memoized V2 forward
(cuflash/_fwd.py) or the V1 forward (cuflash/v1.py). The launch code itself lives in those modules; the names
below are re-exported for the benchmarks and tests that import them from here.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple, Union

from ._configs import AUTO_BH_HEADDIMS, AUTO_BH_MIN_ROWS  # noqa: F401 (re-exported)
from ._fwd import (GRID_ORDER_CHOICES, GRID_ORDERS, LOG2E, _launch_setup, _make_plan, _strides_of,  # noqa: F401
                   fold_gqa_rows, forward, forward_memo, resolve_grid_order)
from ._fwd_sm90 import BACKENDS, check_backend  # noqa: F401 (BACKENDS re-exported)
from ._interop import compiling
from ._validate import check_qkv, check_softmax_scale, check_unsupported
from .backward import check_warp_partition

_forward_memo = forward_memo


def _is_torch_grad(q, k, v) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    t = torch.Tensor
    return (isinstance(q, t) and isinstance(k, t) and isinstance(v, t)
            and bool(q.requires_grad or k.requires_grad or v.requires_grad))


def flash_attn_func(q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Any = None, deterministic: bool = False, return_attn_probs: bool = False, *,
                    algorithm: str = "v2", grid_order: str = "auto", dq_strategy: Optional[str] = None,
                    warp_partition: str = "auto", backend: str = "auto") -> Union[Any, Tuple[Any, Any, Any]]:
    """Exact attention softmax(scale * Q K^T) V: flash-attn's `flash_attn_func` on torch tensors or CuPy arrays.

    Args:
        q: [batch, seqlen_q, nheads, headdim]; k, v: [batch, seqlen_k, nheads_k, headdim], nheads a multiple of
            nheads_k (GQA / MQA). float16 or bfloat16 (all three the same), any head dim up to 256 that is a
            multiple of 8 (32, 64, 96, 128, 256 are compiled; the others run on the next one, padded with zeros
            in shared memory), and up to 512 without autograd (a forward-only kernel),
            all on one CUDA device and of one kind (torch CUDA tensors, CuPy arrays, or other DLPack producers,
            which get CuPy results). Last dimension contiguous, other strides multiples of 8 elements, data
            16-byte aligned (views such as q, k, v slices of one packed tensor are read in place, no copy).
        dropout_p: the probability of dropping each attention probability (flash-attn's: the kept ones are
            scaled by 1 / (1 - dropout_p), the softmax normaliser keeps all). Applied whenever it is > 0 (pass 0.0
            for evaluation). Random numbers: Philox, keyed by torch's CUDA generator for torch tensors (reproducible
            under torch.manual_seed; the backward drops exactly what the forward dropped), by cuflash's own
            counter for CuPy arrays (cuflash.manual_seed, cuflash.get_rng_state); both forwards run it, the
            mma.sync backward its gradients.
        window_size: (left, right) keys around each query's diagonal position: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 leaves that side
            unbounded; with causal, right = 0 (flash-attn's sliding window). Blocks outside the band are skipped.
        softcap: > 0 caps the scaled scores: softcap * tanh(softmax_scale * q.k / softcap) (Gemma 2); 0: off.
        alibi_slopes: float32 (nheads,) or (batch, nheads) on q's device, of q's kind: -slope * |i + seqlen_k -
            seqlen_q - j| is added to the scaled scores (after the soft-cap). The score modifiers need
            algorithm="v2" and run forward and backward, on both backends.
        softmax_scale: the scale of Q K^T, a positive finite number; None: headdim ** -0.5.
        causal: mask keys after each query, bottom-right aligned (query i sees keys j <= i + seqlen_k - seqlen_q).
        deterministic: for the backward (autograd): a dQ strategy without atomics.
        return_attn_probs: also return the softmax LSE and, with dropout, the probabilities: float32 [batch,
            nheads, seqlen_q, seqlen_k], negated where dropped (flash-attn's S_dmask; recomputed for inspection,
            quadratic in memory); without dropout the third element is None.
        algorithm: "v2" (FlashAttention-2, the default) or "v1" (FlashAttention-1, head dims 32-128).
        grid_order: V2 forward block order: "qtile" (Q-tile index in grid x: one head's blocks run together and
            share K/V in L2), "bh" (batch/head first) or "auto" (the default: "bh" for causal problems of >=
            8192 query rows at head dim 128, else "qtile"; on the Hopper forward's persistent form, the walk of its
            tiles: cuflash._configs.sm90_persist_walk).
        dq_strategy: backward dQ accumulation: "atomic", "seqpar", "loop", "ordered" (the Hopper backward:
            cuflash.flash_attn_backward); None: if deterministic "ordered" where the Hopper backward takes it, else
            "seqpar" (falling back to "loop" when its buffers do not fit), otherwise "atomic".
        warp_partition: V2 backward warp partition: "auto" (the default: the tuned one per head dim,
            cuflash._configs.BWD_AUTO_PARTITION), "kv" (warps split the KV rows), "q" (warps split the Q rows) or
            "2d" (FlashAttention-2's 32-row warp tiles in every product, head dims 32-128).
        backend: the V2 forward's kernels: "auto" (the default: on a compute capability 9.0 GPU the Hopper
            kernels -- wgmma, TMA, warp specialization -- for head dims 40-256 and inputs whose base and strides are
            16-byte aligned, else the mma.sync kernels), "sm90" (the Hopper kernels or a ValueError
            saying why not), "sm80" (the mma.sync kernels, any CUDA GPU of compute capability >= 8.0). The
            backward (autograd) follows: "sm80" keeps the mma.sync kernels; otherwise the Hopper backward runs
            wherever it can take the call (head dims 40-128, no dropout, dq_strategy "atomic" or "seqpar",
            warp_partition "auto"), else the mma.sync backward (cuflash.backward.bwd_backend).

    Returns:
        out [batch, seqlen_q, nheads, headdim] like q (a new contiguous array of q's kind, dtype and device);
        with return_attn_probs=True, (out, softmax_lse [batch, nheads, seqlen_q] float32 natural log, S_dmask or
        None). Under torch.compile the call is one custom-operator node (cuflash._torch_ops; no graph break).
        Torch tensors that require grad (under grad mode) get a differentiable out (backward: cuflash kernels;
        the LSE is not differentiable).

    Raises (before anything is launched; messages name the argument):
        TypeError: a non-CUDA or host array, mixed array kinds, an unsupported or mixed dtype, a non-numeric
            softmax_scale.
        ValueError: bad ranks, shapes, head dims, strides or alignment, arrays on different devices, a
            non-positive softmax_scale, an unknown algorithm / grid_order / dq_strategy / warp_partition /
            backend, backend="sm90" where it cannot run, a problem too large for the launch grid.
        NotImplementedError: dropout, window_size, softcap or alibi_slopes with algorithm="v1"; a head dim that is
            not a multiple of 8.
    """
    if compiling():  # torch.compile: one custom-operator node and its autograd formula (cuflash._torch_ops)
        from ._torch_ops import compiled_flash_attn

        return compiled_flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                   deterministic, return_attn_probs, algorithm, grid_order, dq_strategy,
                                   warp_partition, backend)
    check_unsupported(dropout_p, window_size, softcap, alibi_slopes, scores=algorithm != "v1")
    check_softmax_scale(softmax_scale)
    if grid_order not in GRID_ORDER_CHOICES:
        raise ValueError(f"grid_order must be one of {GRID_ORDER_CHOICES}; got {grid_order!r}")
    if algorithm not in ("v2", "v1"):
        raise ValueError(f"algorithm must be 'v2' or 'v1'; got {algorithm!r}")
    check_warp_partition(warp_partition, algorithm=algorithm)
    check_backend(backend)
    if backend != "auto" and algorithm != "v2":
        raise ValueError(f"backend={backend!r} selects the V2 forward's kernels; algorithm={algorithm!r} has one path")
    rng_state = None
    if dropout_p and algorithm == "v2":  # the (seed, offset) of this call, validated inputs first
        from ._dropout import next_state

        qa, ka, va = check_qkv(q, k, v)
        rng_state = next_state(qa.kind, qa.device)
    if _is_torch_grad(q, k, v):
        from ._autograd import flash_attn_autograd

        out, lse = flash_attn_autograd(q, k, v, softmax_scale, causal, deterministic, algorithm, grid_order,
                                       dq_strategy, warp_partition, backend, window_size, softcap, alibi_slopes,
                                       dropout_p, rng_state)
    elif rng_state is not None:  # dropout without autograd: not memoized (every call has its own rng state)
        from ._mods import mods_for

        mods = mods_for(qa, ka, causal, window_size, softcap, alibi_slopes, softmax_scale, dropout_p=dropout_p,
                        rng_state=rng_state)
        out, lse = forward(qa, ka, va, softmax_scale, causal, grid_order, backend=backend, mods=mods)
    elif algorithm == "v2":
        out, lse = forward_memo(q, k, v, softmax_scale, causal, grid_order, backend, window_size, softcap,
                                alibi_slopes)
    else:
        from .v1 import forward as v1_forward

        qa, ka, va = check_qkv(q, k, v)
        out, lse = v1_forward(qa, ka, va, softmax_scale, causal)[:2]
    if not return_attn_probs:
        return out
    probs = None
    if rng_state is not None:
        from ._dropout import attention_probs
        from ._interop import wrap

        probs = attention_probs(qa, ka, wrap(lse, "lse").obj, softmax_scale, causal, window_size, softcap,
                                alibi_slopes, dropout_p, rng_state)
    return out, lse, probs
