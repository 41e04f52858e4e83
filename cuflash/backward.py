"""FlashAttention-2 backward: dq, dk, dv from (dout, q, k, v, out, lse), three dQ strategies."""
from __future__ import annotations

import math
import warnings

from . import _interop
from ._configs import (BWD_AUTO_PARTITION, BWD_PARTITIONS, BWD_PRE_ROWS_PER_BLOCK, BWD_ROW_PAD, bwd_convert_spec,
                       bwd_preprocess_spec, bwd_spec, bwd_tiles)
from ._launch import BWD_FORMAT, get_launcher
from ._validate import check_dtype, check_layout, check_qkv, check_rank, check_same

DQ_STRATEGIES = {"atomic": 0, "seqpar": 1, "loop": 2}
LOG2E = math.log2(math.e)
# seqpar's per-KV-tile dQ buffers may take at most this fraction of the free device memory.
SEQPAR_MAX_FREE_FRACTION = 0.5


def seqpar_extra_bytes(batch, nheads, seqlen_q, seqlen_k, headdim, tile=None, warp_partition="auto") -> int:
    """Extra device memory of dq_strategy="seqpar": one fp32 dQ buffer per KV tile (of the partition's tile)."""
    tile = tile or bwd_tiles(resolve_warp_partition(warp_partition, headdim))[headdim]
    n_blocks = -(-seqlen_k // tile.block_n)
    sq_pad = -(-seqlen_q // BWD_ROW_PAD) * BWD_ROW_PAD
    return n_blocks * batch * nheads * sq_pad * headdim * 4


def resolve_warp_partition(warp_partition, headdim: int) -> str:
    """"auto" -> the partition tuned for this head dim (cuflash._configs.BWD_AUTO_PARTITION, else "kv")."""
    return BWD_AUTO_PARTITION.get(headdim, "kv") if warp_partition == "auto" else warp_partition


def check_warp_partition(warp_partition, headdim=None, algorithm="v2") -> None:
    """warp_partition: "auto" (the default: per head dim, BWD_AUTO_PARTITION), "kv" (warps split the KV rows),
    "q" (warps split the Q rows) or "2d" (32-row warp tiles in every product, FlashAttention-2's; head dims
    32-128)."""
    if warp_partition != "auto" and warp_partition not in BWD_PARTITIONS:
        raise ValueError(f"warp_partition must be one of {('auto', *BWD_PARTITIONS)}; got {warp_partition!r}")
    if algorithm == "v1" and warp_partition not in ("auto", "kv"):
        raise ValueError(f"warp_partition={warp_partition!r} selects a partition of the V2 backward; "
                         f"algorithm='v1' has its own kernel")
    if headdim is not None and headdim not in bwd_tiles(resolve_warp_partition(warp_partition, headdim)):
        raise ValueError(f"warp_partition={warp_partition!r} does not support head dim {headdim}; supported: "
                         f"{tuple(bwd_tiles(warp_partition))}")


def choose_dq_strategy(dq_strategy, deterministic, extra_seqpar: int, device: int) -> str:
    if dq_strategy is not None:
        if dq_strategy not in DQ_STRATEGIES:
            raise ValueError(f"dq_strategy must be one of {tuple(DQ_STRATEGIES)}; got {dq_strategy!r}")
        if deterministic and dq_strategy == "atomic":
            raise ValueError("dq_strategy='atomic' is not deterministic; use 'seqpar' or 'loop' with "
                             "deterministic=True")
    else:
        dq_strategy = "seqpar" if deterministic else "atomic"
    if dq_strategy == "seqpar":
        from cupy.cuda import runtime

        with _interop.device_guard(device):
            free = runtime.memGetInfo()[0]
        if extra_seqpar > SEQPAR_MAX_FREE_FRACTION * free:
            warnings.warn(f"dq_strategy='seqpar' needs {extra_seqpar / 2**30:.2f} GiB of dQ buffers (more than "
                          f"{SEQPAR_MAX_FREE_FRACTION:.0%} of the {free / 2**30:.1f} GiB free); using 'loop' "
                          f"(also deterministic) instead", RuntimeWarning, stacklevel=3)
            dq_strategy = "loop"
    return dq_strategy


def check_backward_inputs(dout, q, k, v, out, lse):
    qa, ka, va = check_qkv(q, k, v)
    da, oa, la = _interop.wrap(dout, "dout"), _interop.wrap(out, "out"), _interop.wrap(lse, "softmax_lse")
    for a, n in ((da, "dout"), (oa, "out")):
        check_same(qa, "q", a, n)
        check_dtype(a, n, qa, "q")
        if a.shape != qa.shape:
            raise ValueError(f"{n} must have the shape of q {qa.shape}; got {a.shape}")
        check_layout(a, n)
    check_same(qa, "q", la, "softmax_lse")
    check_rank(la, "softmax_lse", 3, "(batch, nheads, seqlen_q)")
    b, sq, h, _ = qa.shape
    if la.shape != (b, h, sq) or la.dtype != "float32":
        raise ValueError(f"softmax_lse must be float32 of shape {(b, h, sq)}; got {la.dtype} {la.shape}")
    if la.strides != (h * sq, sq, 1):
        raise ValueError(f"softmax_lse must be contiguous; got strides {la.strides}")
    return da, qa, ka, va, oa, la


def backward(da, qa, ka, va, oa, la, softmax_scale, causal, dq_strategy=None, deterministic=False, tile=None, *,
             warp_partition="auto"):
    """Launch preprocess, main and dQ-convert kernels on validated views; returns (dq, dk, dv).

    warp_partition: "auto", "kv" (warps split the KV rows of a tile), "q" (warps split the Q rows) or "2d"; `tile`
    overrides that partition's configured tile (benchmark sweeps)."""
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    check_warp_partition(warp_partition, d)
    warp_partition = resolve_warp_partition(warp_partition, d)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    tile = tile or bwd_tiles(warp_partition)[d]
    n_blocks = -(-sk // tile.block_n)
    sq_pad = -(-sq // BWD_ROW_PAD) * BWD_ROW_PAD
    strategy = choose_dq_strategy(dq_strategy, deterministic,
                                  seqpar_extra_bytes(b, h, sq, sk, d, tile), qa.device)
    code = DQ_STRATEGIES[strategy]
    splits = n_blocks if strategy == "seqpar" else 1
    dq = _interop.empty(qa, (b, sq, h, d), qa.dtype)
    dk = _interop.empty(qa, (b, sk, hk, d), qa.dtype)
    dv = _interop.empty(qa, (b, sk, hk, d), qa.dtype)
    lse_log2 = _interop.empty(qa, (b, h, sq_pad), "float32")
    delta = _interop.empty(qa, (b, h, sq_pad), "float32")
    dq_accum = _interop.empty(qa, (splits, b, h, sq_pad, d), "float32")
    ptr = _interop.data_ptr
    values = (
        qa.ptr, ka.ptr, va.ptr, oa.ptr, da.ptr, la.ptr, ptr(lse_log2), ptr(delta), ptr(dq_accum), ptr(dq), ptr(dk),
        ptr(dv), *qa.strides[:3], *ka.strides[:3], *va.strides[:3], *oa.strides[:3], *da.strides[:3],
        sq * h * d, h * d, d, sk * hk * d, hk * d, d, sk * hk * d, hk * d, d,  # dq, dk, dv: contiguous
        b, h, h // hk, sq, sk, sq_pad, code, splits, softmax_scale * LOG2E, softmax_scale,
    )
    stream = _interop.current_stream(qa)
    dev = qa.device
    pre = get_launcher(bwd_preprocess_spec(qa.dtype, d), dev)
    main = get_launcher(bwd_spec(qa.dtype, d, causal, tile, warp_partition), dev)
    conv = get_launcher(bwd_convert_spec(qa.dtype, d, causal, tile.block_n), dev)
    with _interop.device_guard(dev):
        pre.launch((-(-b * h * sq_pad // BWD_PRE_ROWS_PER_BLOCK), 1, 1), stream, BWD_FORMAT, *values)
        main.launch((1 if strategy == "loop" else n_blocks, hk, b), stream, BWD_FORMAT, *values)
        pairs = b * h * sq * (d // 2)
        conv.launch((-(-pairs // conv.threads), 1, 1), stream, BWD_FORMAT, *values)
    return dq, dk, dv


def flash_attn_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, deterministic=False, *,
                        dq_strategy=None, algorithm="v2", warp_partition="auto"):
    """Gradients of flash_attn_func for CuPy users (CuPy has no autograd); also accepts torch tensors.

    dout, q, out [b, sq, h, d]; k, v [b, sk, hk, d]; softmax_lse [b, h, sq] float32 from
    flash_attn_func(..., return_attn_probs=True). Returns (dq, dk, dv) of the inputs' kind.
    dq_strategy: "atomic" (fp32 atomics), "seqpar" (a dQ buffer per KV tile + reduce; deterministic),
    "loop" (one block per head walks all KV tiles; deterministic); None picks "atomic", or "seqpar"
    (falling back to "loop" when its buffers do not fit) if deterministic.
    warp_partition (V2): "auto" (default: the partition tuned per head dim, cuflash._configs.BWD_AUTO_PARTITION),
    "kv" (warps split the KV rows of a tile; dS^T goes through shared memory for dQ), "q" (warps split the Q rows; P and dS go through shared memory for dK, dV; head dims as
    cuflash._configs.BWD_TILES_Q) or "2d" (FlashAttention-2's: 32-row warp tiles in all five products, P and
    dS through shared memory; head dims 32-128, cuflash._configs.BWD_TILES_2D).
    """
    if algorithm not in ("v2", "v1"):
        raise ValueError(f"algorithm must be 'v2' or 'v1'; got {algorithm!r}")
    check_warp_partition(warp_partition, algorithm=algorithm)
    da, qa, ka, va, oa, la = check_backward_inputs(dout, q, k, v, out, softmax_lse)
    if algorithm == "v1":
        from .v1 import backward_from_lse

        return backward_from_lse(da, qa, ka, va, oa, la, softmax_scale, causal)
    return backward(da, qa, ka, va, oa, la, softmax_scale, causal, dq_strategy, deterministic,
                    warp_partition=warp_partition)
