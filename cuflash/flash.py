"""FlashAttention-2 forward (and, through autograd, backward) with flash-attn's interface.

Host path. At small shapes the Python around the launch is a visible part of a call, so `flash_attn_func`
without autograd (algorithm "v2") memoizes, like decode.py, everything that depends only on (dtypes, shapes,
strides, devices, softmax_scale, causal, grid_order) in a `_FwdPlan`: a call whose arrays match a validated
call's key reads the pointers, checks their 16-byte alignment, allocates out and lse, packs one parameter
block and launches. `forward` (autograd, V1's comparison path, the fwd_split decode path, benchmarks)
validates nothing and memoizes nothing; both build the launch with `_launch_setup`.
"""
from __future__ import annotations

import math
import struct
import sys

from . import _interop
from ._configs import DECODE_TILES, combine_spec, fwd_spec, fwd_tile
from ._interop import desc, ensure_context, get_device, launch_fn
from ._launch import FWD_FORMAT, _scratch, get_launcher
from ._validate import check_qkv, check_softmax_scale, check_unsupported
from .backward import check_warp_partition

LOG2E = math.log2(math.e)
GRID_ORDERS = {"qtile": 0, "bh": 1}
GRID_ORDER_CHOICES = ("auto", *GRID_ORDERS)
# grid_order="auto": causal problems at head dim 128 with at least this many query rows use "bh". There
# every head's heaviest Q tiles (the ones by the diagonal's far end) are issued first across the whole
# grid, which shortens the tail; "qtile" keeps one head's blocks together for L2 and wins elsewhere
# (results.json, section grid_order, two sessions: d128 causal 8k / 16k bh 4-7% faster, 2k within 1%;
# d64 causal and every non-causal case: qtile as fast or faster). Other head dims: not measured, "qtile".
AUTO_BH_MIN_ROWS = 8192
AUTO_BH_HEADDIMS = (128,)


def resolve_grid_order(grid_order: str, causal: bool, rows: int, headdim: int = 128) -> str:
    """The grid order a launch uses: "auto" -> "bh" for causal problems of >= AUTO_BH_MIN_ROWS query rows
    at a head dim in AUTO_BH_HEADDIMS, else "qtile"; an explicit order is kept."""
    if grid_order != "auto":
        return grid_order
    return "bh" if causal and rows >= AUTO_BH_MIN_ROWS and headdim in AUTO_BH_HEADDIMS else "qtile"
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


def _launch_setup(qa, ka, va, softmax_scale, causal, grid_order, o_strides, tile=None, num_splits=1,
                  seqlen_k_new=0):
    """The V2 forward launch of validated views, less its pointers: (launcher, grid, tail), tail being the
    FWD_FORMAT parameters after the 8 pointers (strides as the kernel sees them -- GQA fold included --,
    sizes, grid order, scale). o_strides: out's (batch, seqlen, head) strides."""
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    osb, osq, osh = o_strides
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
    order, grid = _grid(GRID_ORDERS[resolve_grid_order(grid_order, causal, rows, d)], -(-rows // block_m), kheads,
                        b, num_splits)
    tail = (qa.strides[0], q_row, q_head, *ka.strides[:3], *va.strides[:3], osb, o_row, o_head,
            b, kheads, heads_per_kv, rows, sk, num_splits, seqlen_k_new, order, softmax_scale * LOG2E)
    return lau, grid, tail


def forward(qa, ka, va, softmax_scale, causal, grid_order="auto", tile=None, out=None, lse=None,
            seqlens_k_ptr=0, seqlen_k_new=0, num_splits=1, scratch=None):
    """Launch the V2 forward on validated views; returns (out, lse) of the inputs' kind.

    out [b, sq, h, d] (same dtype as q), lse [b, h, sq] float32 natural log. `tile` overrides the
    configured tile (benchmark sweeps). KV cache: `seqlens_k_ptr` is an int32 [b] device array of valid
    keys per batch element (plus `seqlen_k_new` appended by this call). num_splits > 1 runs the split-KV
    kernel into fp32 partials (`scratch` = (o_accum, lse_accum), allocated here when None) and combines.
    """
    b, sq, h, d = qa.shape
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    check_softmax_scale(softmax_scale)
    if out is None:
        out = _interop.empty(qa, (b, sq, h, d), qa.dtype)
    if lse is None:
        lse = _interop.empty(qa, (b, h, sq), "float32")
    lau, grid, tail = _launch_setup(qa, ka, va, softmax_scale, causal, grid_order, _strides_of(out)[:3], tile,
                                    num_splits, seqlen_k_new)
    split = num_splits > 1
    o_accum = lse_accum = 0
    if split:
        # FWD_PARAMS order: o batch/row/head strides, batch, nheads, heads_per_kv, seqlen_q (rows), seqlen_k
        osb, o_row, o_head, _, kheads, _, rows, sk = tail[9:17]
        if scratch is None:
            scratch = (_interop.empty(qa, (num_splits, b, kheads, rows, d), "float32"),
                       _interop.empty(qa, (num_splits, b, kheads, rows), "float32"))
        o_accum, lse_accum = (_interop.data_ptr(x) for x in scratch)
    stream = _interop.current_stream(qa)
    with _interop.device_guard(qa.device):
        lau.launch(
            grid, stream, FWD_FORMAT,
            qa.ptr, ka.ptr, va.ptr, _interop.data_ptr(out), _interop.data_ptr(lse), o_accum, lse_accum, seqlens_k_ptr,
            *tail,
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


class _FwdPlan:
    """A V2 forward for one memo key (validated once): `run` allocates out and lse and launches."""

    __slots__ = ("kind", "device", "tdevice", "odtype", "out_shape", "lse_shape", "lau", "grid", "tail")

    def run(self, qp, kp, vp):
        dev = self.device
        if self.kind == _interop.TORCH:
            torch = sys.modules["torch"]
            out = torch.empty(self.out_shape, dtype=self.odtype, device=self.tdevice)
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.tdevice)
            if _interop.POISON:
                out.fill_(float("nan"))
                lse.fill_(float("nan"))
            op, lp = out.data_ptr(), lse.data_ptr()
            stream = torch._C._cuda_getCurrentRawStream(dev)
        else:
            import cupy

            with _interop.device_guard(dev):
                out = cupy.empty(self.out_shape, dtype=self.odtype)
                lse = cupy.empty(self.lse_shape, dtype="float32")
            if _interop.POISON:
                out.fill(float("nan"))
                lse.fill(float("nan"))
            op, lp = out.data.ptr, lse.data.ptr
            stream = cupy.cuda.get_current_stream(dev).ptr
        lau, (gx, gy, gz) = self.lau, self.grid
        buf, argv, _ = _scratch()
        struct.pack_into(FWD_FORMAT, buf, 0, qp, kp, vp, op, lp, 0, 0, 0, *self.tail)
        ensure_context()
        if get_device() == dev:
            launch_fn()(lau.ptr, gx, gy, gz, lau.threads, 1, 1, lau.smem, stream, argv, 0)
        else:
            import cupy

            with cupy.cuda.Device(dev):
                launch_fn()(lau.ptr, gx, gy, gz, lau.threads, 1, 1, lau.smem, stream, argv, 0)
        return out, lse


def _make_plan(qa, ka, va, softmax_scale, causal, grid_order) -> _FwdPlan | None:
    """The plan of validated views (out allocated contiguous); None for an empty batch or head count
    (left to `forward`: the strides of an empty out are the array library's choice)."""
    b, sq, h, d = qa.shape
    if not b or not h:
        return None
    p = _FwdPlan()
    p.lau, p.grid, p.tail = _launch_setup(qa, ka, va, softmax_scale, causal, grid_order, (sq * h * d, h * d, d))
    p.kind, p.device = qa.kind, qa.device
    p.odtype = qa.obj.dtype
    p.tdevice = qa.obj.device if qa.kind == _interop.TORCH else None
    p.out_shape, p.lse_shape = (b, sq, h, d), (b, h, sq)
    return p


_PLANS: dict = {}
_MAX_PLANS = 4096


def _forward_memo(q, k, v, softmax_scale, causal, grid_order):
    """`forward` of flash_attn_func without autograd through a memoized plan; validates on a miss only."""
    qp, qd = desc(q)
    kp, kd = desc(k)
    vp, vd = desc(v)
    plan = key = None
    if qd is not None and kd is not None and vd is not None:
        # the scale's type too: np.float32(0.125) == 0.125, but times LOG2E it stays a float32
        key = (qd, kd, vd, softmax_scale, type(softmax_scale), causal, grid_order)
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: validate (and maybe fail) below
            key = None
    if plan is None or (qp | kp | vp) & 15:
        qa, ka, va = check_qkv(q, k, v)
        plan = _make_plan(qa, ka, va, softmax_scale, causal, grid_order)
        if plan is None:
            return forward(qa, ka, va, softmax_scale, causal, grid_order)
        _interop.remember(_PLANS, key, plan, _MAX_PLANS)
        qp, kp, vp = qa.ptr, ka.ptr, va.ptr
    return plan.run(qp, kp, vp)


def _is_torch_grad(q, k, v) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    t = torch.Tensor
    return (isinstance(q, t) and isinstance(k, t) and isinstance(v, t)
            and bool(q.requires_grad or k.requires_grad or v.requires_grad))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                    algorithm="v2", grid_order="auto", dq_strategy=None, warp_partition="auto"):
    """Exact attention, flash-attn's `flash_attn_func` on torch tensors or CuPy arrays.

    q [batch, seqlen_q, nheads, headdim], k/v [batch, seqlen_k, nheads_k, headdim] (nheads a multiple
    of nheads_k), fp16 or bf16, head dim in (32, 64, 96, 128, 256). Returns out like q; with
    return_attn_probs=True returns (out, softmax_lse [batch, nheads, seqlen_q] float32, None).
    Torch tensors that require grad get a differentiable result (backward: cuflash kernels).

    Keyword-only extras: algorithm ("v2" or "v1"), grid_order ("qtile": Q-tile index in grid x, so the
    blocks of one head run together and share K/V in L2; "bh": batch/head first; "auto", the default:
    "bh" for causal problems of >= 8192 query rows at head dim 128, else "qtile"), dq_strategy for the
    backward ("atomic", "seqpar", "loop"; None: "loop" if deterministic else "atomic"), warp_partition for
    the V2 backward ("auto", the default: the tuned one per head dim, cuflash._configs.BWD_AUTO_PARTITION;
    "kv": warps split the KV rows; "q": warps split the Q rows; "2d": FlashAttention-2's 32-row warp tiles
    in every product, head dims 32-128).
    """
    check_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    check_softmax_scale(softmax_scale)
    if grid_order not in GRID_ORDER_CHOICES:
        raise ValueError(f"grid_order must be one of {GRID_ORDER_CHOICES}; got {grid_order!r}")
    if algorithm not in ("v2", "v1"):
        raise ValueError(f"algorithm must be 'v2' or 'v1'; got {algorithm!r}")
    check_warp_partition(warp_partition, algorithm=algorithm)
    if _is_torch_grad(q, k, v):
        from ._autograd import flash_attn_autograd

        out, lse = flash_attn_autograd(q, k, v, softmax_scale, causal, deterministic, algorithm, grid_order,
                                       dq_strategy, warp_partition)
    elif algorithm == "v2":
        out, lse = _forward_memo(q, k, v, softmax_scale, causal, grid_order)
    else:
        from .v1 import forward as v1_forward

        qa, ka, va = check_qkv(q, k, v)
        out, lse = v1_forward(qa, ka, va, softmax_scale, causal)[:2]
    return (out, lse, None) if return_attn_probs else out
