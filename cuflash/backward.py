"""FlashAttention-2 backward: dq, dk, dv from (dout, q, k, v, out, lse), three dQ strategies."""
from __future__ import annotations

import math
import struct
import sys
import warnings

from . import _interop, _loader
from ._configs import (BWD_AUTO_PARTITION, BWD_PARTITIONS, BWD_ROW_PAD, bwd_convert_spec,
                       bwd_pre_lanes_per_row, bwd_preprocess_spec, bwd_spec, bwd_tiles)
from ._interop import desc, ensure_context, launch_fn
from ._launch import BWD_FORMAT, _scratch, get_launcher
from ._validate import check_dtype, check_layout, check_qkv, check_rank, check_same, check_softmax_scale

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


class _BwdPlan:
    """A V2 backward for fixed (dtypes, shapes, strides, devices, options), validated once: `run` allocates dq, dk,
    dv and one fp32 workspace (lse_log2, delta, dQ accumulator), packs the kernel parameters once and launches
    preprocess, main and dQ-convert kernels with them."""

    __slots__ = ("kind", "device", "tdevice", "odtype", "dq_shape", "dkv_shape", "ws_floats", "ws_off", "tail",
                 "launches", "strategy")

    def run(self, dp, qp, kp, vp, op, lp):
        kind, dev = self.kind, self.device
        if kind == _interop.TORCH:
            torch = sys.modules["torch"]
            dq = torch.empty(self.dq_shape, dtype=self.odtype, device=self.tdevice)
            dk = torch.empty(self.dkv_shape, dtype=self.odtype, device=self.tdevice)
            dv = torch.empty(self.dkv_shape, dtype=self.odtype, device=self.tdevice)
            ws = torch.empty((self.ws_floats,), dtype=torch.float32, device=self.tdevice)
            if _interop.POISON:
                for x in (dq, dk, dv, ws):
                    x.fill_(float("nan"))
            ptrs = dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), ws.data_ptr()
            stream = torch._C._cuda_getCurrentRawStream(dev)
        else:
            import cupy

            with _interop.device_guard(dev):
                dq = cupy.empty(self.dq_shape, dtype=self.odtype)
                dk = cupy.empty(self.dkv_shape, dtype=self.odtype)
                dv = cupy.empty(self.dkv_shape, dtype=self.odtype)
                ws = cupy.empty((self.ws_floats,), dtype="float32")
            if _interop.POISON:
                for x in (dq, dk, dv, ws):
                    x.fill(float("nan"))
            ptrs = dq.data.ptr, dk.data.ptr, dv.data.ptr, ws.data.ptr
            stream = cupy.cuda.get_current_stream(dev).ptr
        w = ptrs[3]
        o_lse, o_delta, o_acc = self.ws_off
        buf, argv, _ = _scratch()  # one parameter block for all three kernels (the driver copies it per launch)
        struct.pack_into(BWD_FORMAT, buf, 0, qp, kp, vp, op, dp, lp, w + o_lse, w + o_delta, w + o_acc, *ptrs[:3],
                         *self.tail)
        launch = launch_fn()
        ensure_context()
        with _interop.device_guard(dev):
            for fn, gx, gy, gz, threads, smem in self.launches:
                launch(fn, gx, gy, gz, threads, 1, 1, smem, stream, argv, 0)
        return dq, dk, dv


def _make_plan(da, qa, ka, va, oa, la, softmax_scale, causal, dq_strategy, deterministic, tile, warp_partition):
    """The plan of validated views (every strategy; "seqpar" checks free memory when the plan is made)."""
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    check_warp_partition(warp_partition, d)
    warp_partition = resolve_warp_partition(warp_partition, d)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    tile = tile or bwd_tiles(warp_partition, _loader.device_cc(qa.device), qa.dtype)[d]
    n_blocks = -(-sk // tile.block_n)
    sq_pad = -(-sq // BWD_ROW_PAD) * BWD_ROW_PAD
    strategy = choose_dq_strategy(dq_strategy, deterministic,
                                  seqpar_extra_bytes(b, h, sq, sk, d, tile), qa.device)
    splits = n_blocks if strategy == "seqpar" else 1
    p = _BwdPlan()
    p.kind, p.device, p.strategy = qa.kind, qa.device, strategy
    p.tdevice = qa.obj.device if qa.kind == _interop.TORCH else None
    p.odtype = qa.obj.dtype
    p.dq_shape, p.dkv_shape = (b, sq, h, d), (b, sk, hk, d)
    rows = b * h * sq_pad  # fp32 workspace: lse_log2 [rows], delta [rows], dQ accumulator [splits, rows, d]
    p.ws_floats, p.ws_off = rows * (2 + splits * d), (0, 4 * rows, 8 * rows)
    p.tail = (
        *qa.strides[:3], *ka.strides[:3], *va.strides[:3], *oa.strides[:3], *da.strides[:3],
        sq * h * d, h * d, d, sk * hk * d, hk * d, d, sk * hk * d, hk * d, d,  # dq, dk, dv: contiguous
        b, h, h // hk, sq, sk, sq_pad, DQ_STRATEGIES[strategy], splits, softmax_scale * LOG2E, softmax_scale,
    )
    dev = qa.device
    pre = get_launcher(bwd_preprocess_spec(qa.dtype, d), dev)
    main = get_launcher(bwd_spec(qa.dtype, d, causal, tile, warp_partition), dev)
    conv = get_launcher(bwd_convert_spec(qa.dtype, d, causal, tile.block_n), dev)
    slots = b * h * sq_pad * (d // 4)  # convert: one thread per 16-byte slot of the fragment-tiled accumulator
    p.launches = tuple((lau.ptr, *grid, lau.threads, lau.smem) for lau, grid in (
        (pre, (-(-rows * bwd_pre_lanes_per_row(d) // pre.threads), 1, 1)),
        (main, (1 if strategy == "loop" else n_blocks, hk, b)),
        (conv, (-(-slots // conv.threads), 1, 1)),
    ))
    return p


def backward(da, qa, ka, va, oa, la, softmax_scale, causal, dq_strategy=None, deterministic=False, tile=None, *,
             warp_partition="auto"):
    """Launch preprocess, main and dQ-convert kernels on validated views; returns (dq, dk, dv).

    warp_partition: "auto", "kv" (warps split the KV rows of a tile), "q" (warps split the Q rows) or "2d"; `tile`
    overrides that partition's configured tile (benchmark sweeps)."""
    plan = _make_plan(da, qa, ka, va, oa, la, softmax_scale, causal, dq_strategy, deterministic, tile,
                      warp_partition)
    return plan.run(da.ptr, qa.ptr, ka.ptr, va.ptr, oa.ptr, la.ptr)


_PLANS: dict = {}
_MAX_PLANS = 4096


def backward_memo(dout, q, k, v, out, lse, softmax_scale, causal, dq_strategy, deterministic, warp_partition):
    """`backward` on raw arrays through a memoized plan: a call whose arrays (dtypes, shapes, strides, devices) and
    options match a validated one skips validation and set-up. "seqpar" plans are not kept (their strategy
    depends on the free memory when made)."""
    ptrs, keys = zip(*(desc(x) for x in (dout, q, k, v, out, lse)))
    plan = key = None
    if None not in keys:
        key = (keys, softmax_scale, type(softmax_scale), causal, dq_strategy, deterministic, warp_partition)
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: validate (and maybe fail) below
            key = None
    if plan is None or (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
        check_warp_partition(warp_partition)
        views = check_backward_inputs(dout, q, k, v, out, lse)
        plan = _make_plan(*views, softmax_scale, causal, dq_strategy, deterministic, None, warp_partition)
        if plan.strategy != "seqpar":
            _interop.remember(_PLANS, key, plan, _MAX_PLANS)
        ptrs = tuple(a.ptr for a in views)
    return plan.run(*ptrs)


def flash_attn_backward(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, deterministic=False, *,
                        dq_strategy=None, algorithm="v2", warp_partition="auto"):
    """Gradients of flash_attn_func for CuPy users (CuPy has no autograd); also accepts torch tensors.

    dout, q, out [b, sq, h, d]; k, v [b, sk, hk, d]; softmax_lse [b, h, sq] float32 from
    flash_attn_func(..., return_attn_probs=True). Returns (dq, dk, dv) of the inputs' kind.
    dq_strategy: "atomic" (fp32 atomics), "seqpar" (a dQ buffer per KV tile + reduce; deterministic),
    "loop" (one block per head walks all KV tiles; deterministic); None picks "atomic", or "seqpar"
    (falling back to "loop" when its buffers do not fit) if deterministic.
    warp_partition (V2): "auto" (default: the partition tuned per head dim, cuflash._configs.BWD_AUTO_PARTITION),
    "kv" (warps split the KV rows of a tile; dS^T goes through shared memory for dQ), "q" (warps split the Q
    rows; P and dS go through shared memory for dK, dV; head dims as cuflash._configs.BWD_TILES_Q) or "2d" (FlashAttention-2's: 32-row warp tiles in all five products, P and
    dS through shared memory; head dims 32-128, cuflash._configs.BWD_TILES_2D).
    """
    if algorithm not in ("v2", "v1"):
        raise ValueError(f"algorithm must be 'v2' or 'v1'; got {algorithm!r}")
    check_warp_partition(warp_partition, algorithm=algorithm)
    if algorithm == "v1":
        from .v1 import backward_from_lse

        return backward_from_lse(*check_backward_inputs(dout, q, k, v, out, softmax_lse), softmax_scale, causal)
    check_softmax_scale(softmax_scale)
    return backward_memo(dout, q, k, v, out, softmax_lse, softmax_scale, causal, dq_strategy, deterministic,
                         warp_partition)
