"""FlashAttention-2 forward (and, through autograd, backward) with flash-attn's interface."""
from __future__ import annotations

import math

from . import _interop
from ._configs import DECODE_TILES, combine_spec, fwd_spec, fwd_tile
from ._launch import FWD_FORMAT, get_launcher
from ._validate import check_qkv, check_softmax_scale, check_unsupported
from .backward import check_warp_partition

LOG2E = math.log2(math.e)
GRID_ORDERS = {"qtile": 0, "bh": 1}
_MAX_GRID_YZ = 65535


def _grid(order: int, m_blocks: int, nheads: int, batch: int, splits: int):
    if order == 0 and nheads <= _MAX_GRID_YZ and batch * splits <= _MAX_GRID_YZ:
        return 0, (m_blocks, nheads, batch * splits)
    if m_blocks > _MAX_GRID_YZ or splits > _MAX_GRID_YZ:
        raise ValueError(f"problem too large for the grid: {m_blocks} Q tiles, {splits} splits")
    return 1, (batch * nheads, m_blocks, splits)


def fold_gqa_rows(qa, hk: int):
    """Decoding with GQA/MQA (seqlen_q == 1): the G = h / hk query heads that share a KV head become G
    rows of one Q tile, so each K/V byte is read once per KV head. Pure stride arithmetic, no copy:
    q [b, 1, h, d] with strides (sb, -, sh, 1) is seen as [b, G, hk, d] with strides (sb, sh, G*sh, 1).
    Returns (rows, nheads, row_stride, head_stride) for the kernel."""
    b, sq, h, d = qa.shape
    g = h // hk
    sh = qa.strides[2]
    return g, hk, sh, g * sh


def forward(qa, ka, va, softmax_scale, causal, grid_order="qtile", tile=None, out=None, lse=None,
            seqlens_k_ptr=0, seqlen_k_new=0, num_splits=1, scratch=None):
    """Launch the V2 forward on validated views; returns (out, lse) of the inputs' kind.

    out [b, sq, h, d] (same dtype as q), lse [b, h, sq] float32 natural log. `tile` overrides the
    configured tile (benchmark sweeps). KV cache: `seqlens_k_ptr` is an int32 [b] device array of valid
    keys per batch element (plus `seqlen_k_new` appended by this call). num_splits > 1 runs the split-KV
    kernel into fp32 partials (`scratch` = (o_accum, lse_accum), allocated here when None) and combines.
    """
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    check_softmax_scale(softmax_scale)
    if out is None:
        out = _interop.empty(qa, (b, sq, h, d), qa.dtype)
    if lse is None:
        lse = _interop.empty(qa, (b, h, sq), "float32")
    osb, osq, osh, _ = _strides_of(out)
    if sq == 1 and h > hk:  # fold the query heads of a KV head into rows (causal is moot: 1 row sees all)
        rows, kheads, q_row, q_head = fold_gqa_rows(qa, hk)
        o_row, o_head = osh, rows * osh
        heads_per_kv, causal = 1, False
    else:
        rows, kheads, q_row, q_head = sq, h, qa.strides[1], qa.strides[2]
        o_row, o_head = osq, osh
        heads_per_kv = h // hk
    split = num_splits > 1
    spec = fwd_spec(qa.dtype, d, causal, split=split, tile=tile)
    lau = get_launcher(spec, qa.device)
    block_m = (tile or (DECODE_TILES[d] if split else fwd_tile(d, causal))).block_m
    order, grid = _grid(GRID_ORDERS[grid_order], -(-rows // block_m), kheads, b, num_splits)
    o_accum = lse_accum = 0
    if split:
        if scratch is None:
            scratch = (_interop.empty(qa, (num_splits, b, kheads, rows, d), "float32"),
                       _interop.empty(qa, (num_splits, b, kheads, rows), "float32"))
        o_accum, lse_accum = (_interop.data_ptr(x) for x in scratch)
    stream = _interop.current_stream(qa)
    with _interop.device_guard(qa.device):
        lau.launch(
            grid, stream, FWD_FORMAT,
            qa.ptr, ka.ptr, va.ptr, _interop.data_ptr(out), _interop.data_ptr(lse), o_accum, lse_accum, seqlens_k_ptr,
            qa.strides[0], q_row, q_head, *ka.strides[:3], *va.strides[:3], osb, o_row, o_head,
            b, kheads, heads_per_kv, rows, sk, num_splits, seqlen_k_new, order, softmax_scale * LOG2E,
        )
        if split:
            comb = get_launcher(combine_spec(qa.dtype, d), qa.device)
            nrows = b * kheads * rows
            comb.launch(
                (-(-nrows // (comb.threads // 32)), 1, 1), stream, FWD_FORMAT,
                0, 0, 0, _interop.data_ptr(out), _interop.data_ptr(lse), o_accum, lse_accum, 0,
                0, 0, 0, 0, 0, 0, 0, 0, 0, osb, o_row, o_head,
                b, kheads, 1, rows, sk, num_splits, 0, 0, 0.0,
            )
    return out, lse


def _strides_of(x):
    s = x.stride() if callable(getattr(x, "stride", None)) else tuple(v // x.itemsize for v in x.strides)
    return tuple(s)


def _is_torch_grad(q, k, v) -> bool:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    xs = (q, k, v)
    return all(isinstance(x, torch.Tensor) for x in xs) and any(x.requires_grad for x in xs)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    algorithm="v2", grid_order="qtile", dq_strategy=None, warp_partition="kv"):
    """Exact attention, flash-attn's `flash_attn_func` on torch tensors or CuPy arrays.

    q [batch, seqlen_q, nheads, headdim], k/v [batch, seqlen_k, nheads_k, headdim] (nheads a multiple
    of nheads_k), fp16 or bf16, head dim in (32, 64, 96, 128, 256). Returns out like q; with
    return_attn_probs=True returns (out, softmax_lse [batch, nheads, seqlen_q] float32, None).
    Torch tensors that require grad get a differentiable result (backward: cuflash kernels).

    Keyword-only extras: algorithm ("v2" or "v1"), grid_order ("qtile": Q-tile index in grid x, so the
    blocks of one head run together and share K/V in L2; "bh": batch/head first), dq_strategy for the
    backward ("atomic", "seqpar", "loop"; None: "loop" if deterministic else "atomic"), warp_partition for
    the V2 backward ("kv": warps split the KV rows, the default; "q": warps split the Q rows).
    """
    check_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    check_softmax_scale(softmax_scale)
    if grid_order not in GRID_ORDERS:
        raise ValueError(f"grid_order must be one of {tuple(GRID_ORDERS)}; got {grid_order!r}")
    if algorithm not in ("v2", "v1"):
        raise ValueError(f"algorithm must be 'v2' or 'v1'; got {algorithm!r}")
    check_warp_partition(warp_partition, algorithm=algorithm)
    if _is_torch_grad(q, k, v):
        from ._autograd import flash_attn_autograd

        out, lse = flash_attn_autograd(q, k, v, softmax_scale, causal, deterministic, algorithm, grid_order,
                                       dq_strategy, warp_partition)
    else:
        qa, ka, va = check_qkv(q, k, v)
        out, lse = _forward_dispatch(algorithm)(qa, ka, va, softmax_scale, causal, grid_order)
    return (out, lse, None) if return_attn_probs else out


def _forward_dispatch(algorithm):
    if algorithm == "v1":
        from .v1 import forward as v1_forward

        return lambda qa, ka, va, scale, causal, grid_order: v1_forward(qa, ka, va, scale, causal)[:2]
    return forward
