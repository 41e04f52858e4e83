"""The forward launch grid, shared by the mma.sync (cuflash._fwd) and Hopper (cuflash._fwd_sm90) forwards: the
grid orders, the grid of a launch, the strides of an output array, when single-query GQA is folded into rows, and
the outputs of a forward (fixed or packed)."""
from __future__ import annotations

from . import _interop
from ._configs import auto_grid_order

GRID_ORDERS = {"qtile": 0, "bh": 1}
GRID_ORDER_CHOICES = ("auto", *GRID_ORDERS)
_MAX_GRID_YZ = 65535


def folds_gqa(seqlen_q: int, nheads: int, nheads_k: int, mod: int = 0) -> bool:
    """Whether the mma.sync kernels see single-query GQA/MQA as G = nheads / nheads_k rows of one KV head
    (cuflash._fwd.fold_gqa_rows): one query row per head, several heads per KV head, and no score modifier (with
    MOD_SCORE a row is a query position, each head with its own ALiBi slope)."""
    return seqlen_q == 1 and nheads > nheads_k and not mod


def resolve_grid_order(grid_order: str, causal: bool, rows: int, headdim: int = 128) -> str:
    """The grid order a launch uses: "auto" -> cuflash._configs.auto_grid_order ("bh" for causal problems of >=
    AUTO_BH_MIN_ROWS query rows at a head dim in AUTO_BH_HEADDIMS, else "qtile"); an explicit order is kept."""
    if grid_order != "auto":
        return grid_order
    return auto_grid_order(causal, rows, headdim)


def _grid(order: int, m_blocks: int, nheads: int, batch: int, splits: int):
    if order == 0 and nheads <= _MAX_GRID_YZ and batch * splits <= _MAX_GRID_YZ:
        return 0, (m_blocks, nheads, batch * splits)
    if m_blocks > _MAX_GRID_YZ or splits > _MAX_GRID_YZ:
        raise ValueError(f"problem too large for the grid: {m_blocks} Q tiles, {splits} splits")
    return 1, (batch * nheads, m_blocks, splits)


def _strides_of(x):
    s = x.stride() if callable(getattr(x, "stride", None)) else tuple(v // x.itemsize for v in x.strides)
    return tuple(s)


def outputs(qa, out, lse, packed):
    """(out, lse, out's (batch, seqlen, head) strides as the kernels see them) of a forward, allocated where None:
    [b, sq, h, d] and [b, h, sq], or packed [total_q, h, d] and [h, total_q] (batch stride 0)."""
    b, sq, h, d = qa.shape
    if packed is None:
        if out is None:
            out = _interop.empty(qa, (b, sq, h, d), qa.dtype)
        if lse is None:
            lse = _interop.empty(qa, (b, h, sq), "float32")
        return out, lse, _strides_of(out)[:3]
    if out is None:
        out = _interop.empty(qa, (packed.total_q, h, d), qa.dtype)
    if lse is None:
        lse = _interop.empty(qa, (h, packed.total_q), "float32")
    return out, lse, (0, *_strides_of(out)[:2])
