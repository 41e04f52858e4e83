"""Packed sequences (flash-attn's varlen layout) as the kernels see them.

The caller packs `batch` sequences of its own lengths into q [total_q, nheads, headdim] and k, v [total_k,
nheads_k, headdim]; cu_seqlens_q / cu_seqlens_k, int32 [batch + 1] on the device, are the prefix sums of the
lengths (sequence b owns rows [cu[b], cu[b + 1])). Nothing here reads the lengths on the host: the kernels read
cu_seqlens themselves and lay their grid out over every sequence's tiles at once (cuda_src/attn/seqlen.cuh), so
the launch needs only total_q, total_k and batch, and a call stays free of host synchronisation (capturable in
a CUDA graph, traceable by torch.compile). max_seqlen_q / max_seqlen_k are accepted as Python ints or 0-dim
integer arrays and never read from the device; the "seqpar" dQ strategy is the one user of max_seqlen_k (it
sizes one dQ buffer per KV tile of the longest sequence) and needs it as an int.

The kernels see the packed tensors as [1, total, heads, headdim] views with batch strides 0 and `batch`
sequences (`Packed.patch`); cu_seqlens are trusted (non-decreasing, from 0 to total) like flash-attn's.
"""
from __future__ import annotations

import numbers

from ._interop import Arr, wrap
from ._validate import check_dtype, check_rank, check_same

from ._configs import BWD_ROW_PAD  # the backward's fp32 row buffers pad every sequence to it (flash_bwd.cu)

NO_PAGES_GRAD = ("block_table with autograd: paged K/V is an inference path (flash-attn's too); pass contiguous "
                 "packed k and v to differentiate")


class Packed:
    """A validated varlen call's geometry: batch (sequences), total_q, total_k, the cu_seqlens views, and
    max_seqlen_q / max_seqlen_k as ints (None where a 0-dim array was passed)."""

    __slots__ = ("batch", "total_q", "total_k", "cu_q", "cu_k", "max_q", "max_k")

    def __init__(self, batch, total_q, total_k, cu_q: Arr, cu_k: Arr, max_q, max_k):
        self.batch, self.total_q, self.total_k = batch, total_q, total_k
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, max_q, max_k

    def pointers(self) -> dict:
        return dict(cu_seqlens_q=self.cu_q.ptr, cu_seqlens_k=self.cu_k.ptr)

    def patch(self, fields: dict, tensors=("q", "k", "v", "o")) -> dict:
        """Parameter-block fields of the [1, total, ...] views made packed: batch strides 0, `batch` sequences,
        seqlen_q / seqlen_k = the totals (the LSE's row count per head), grid order 0 (the packed grid)."""
        for t in tensors:
            fields[f"{t}_batch_stride"] = 0
        fields.update(batch=self.batch, seqlen_q=self.total_q, seqlen_k=self.total_k)
        if "grid_order" in fields:
            fields["grid_order"] = 0
        return fields

    def grid(self, block_m: int, nheads: int, splits: int = 1) -> tuple:
        """The forward grid: x over every sequence's Q tiles (sequence b's first is cu_q[b] // block_m + b)."""
        return (self.total_q // block_m + self.batch, nheads, splits)

    def kv_tiles(self, block_n: int) -> int:
        """Grid x of the backward: every sequence's KV tiles."""
        return self.total_k // block_n + self.batch

    def padded_rows(self) -> int:
        """Rows per head of the backward's fp32 row buffers (every sequence from a BWD_ROW_PAD boundary)."""
        return BWD_ROW_PAD * (self.total_q // BWD_ROW_PAD + self.batch)


def view4(a: Arr) -> Arr:
    """[total, heads, headdim] as [1, total, heads, headdim] (no copy)."""
    return Arr(a.kind, a.obj, a.ptr, (1, *a.shape), (max(1, a.shape[0]) * a.strides[0], *a.strides), a.dtype,
               a.device)


def check_max_seqlen(x, name: str):
    """An int >= 0 (returned), or a 0-dim integer array (None: not read, so no synchronisation)."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        if x < 0:
            raise ValueError(f"{name} must be >= 0; got {x}")
        return int(x)
    shape = getattr(x, "shape", None)
    dtype = str(getattr(x, "dtype", ""))
    if shape is not None and tuple(shape) == () and "int" in dtype:
        return None
    raise TypeError(f"{name} must be an int or a 0-dim integer tensor; got {type(x).__name__}"
                    + (f" of shape {tuple(shape)}" if shape is not None else ""))


def check_cu_seqlens(cu, name: str, ref: Arr) -> Arr:
    a = wrap(cu, name)
    check_same(ref, "q", a, name)
    check_rank(a, name, 1, "(batch + 1,)")
    if a.dtype != "int32":
        raise TypeError(f"{name} must be int32; got {a.dtype}")
    if a.shape[0] < 2:
        raise ValueError(f"{name} must have batch + 1 >= 2 entries; got shape {a.shape}")
    if a.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous; got strides {a.strides}")
    return a


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, names=("q", "k", "v")):
    """Validate a varlen call: q [total_q, nheads, headdim], k, v [total_k, nheads_k, headdim] (flash_attn_func's
    dtype, head-dim and layout rules), cu_seqlens int32 [batch + 1] contiguous on q's device, of q's kind, one
    length for both. Returns (q, k, v as [1, total, heads, headdim] views, Packed)."""
    from ._validate import check_qkv_views

    qn, kn, vn = names
    qa, ka, va = wrap(q, qn), wrap(k, kn), wrap(v, vn)
    for a, n, t in ((qa, qn, "total_q"), (ka, kn, "total_k"), (va, vn, "total_k")):
        check_rank(a, n, 3, f"({t}, nheads, headdim)")
    check_same(qa, qn, ka, kn)
    check_same(qa, qn, va, vn)
    check_dtype(qa, qn)
    cq = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", qa)
    ck = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", qa)
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got {cq.shape[0]} "
                         f"and {ck.shape[0]}")
    mq = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    mk = check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    q4, k4, v4 = view4(qa), view4(ka), view4(va)
    if qa.shape[0] == 0:  # nothing to attend with: check the rest on a one-row stand-in
        check_qkv_views(Arr(qa.kind, qa.obj, qa.ptr, (1, 1, *qa.shape[1:]), (qa.strides[0], *qa.strides),
                            qa.dtype, qa.device), k4, v4, names)
    else:
        check_qkv_views(q4, k4, v4, names)
    return q4, k4, v4, Packed(cq.shape[0] - 1, qa.shape[0], ka.shape[0], cq, ck, mq, mk)


def gather_pages(q, k, v, block_table, cu_seqlens_k):
    """Paged K/V of a varlen call gathered into packed rows: k, v [num_pages, page_size, nheads_k, headdim] (q's kind,
    device and dtype; page_size a multiple of 16), block_table int32 [batch, max_pages] (last dim contiguous):
    sequence b's key r is row r % page_size of page block_table[b, r // page_size] and lands at packed row
    cu_seqlens_k[b] + r (cuda_src/flash_fwd.cu: paged_kv_gather_kernel, one pass over the keys). Returns (k, v)
    [batch x max_pages x page_size, nheads_k, headdim], contiguous: room for every sequence's pages without reading
    the total on the host; the rows after the total are zeros (the last KV tile of a forward kernel may read some).
    Pages whose rows are not 16-byte units (a head dim that is not a multiple of 8, strides or data not 16-byte
    aligned) are copied element by element (the kernel's UA form); the packed rows then run the UA kernels too."""
    from . import _interop
    from ._configs import gather_spec, unaligned
    from ._launch import get_launcher
    from ._params import GATHER_ARGS
    from ._validate import check_block_table, check_headdim, check_layout

    qa = wrap(q, "q")
    ka, va = wrap(k, "k"), wrap(v, "v")
    for a, n in ((ka, "k"), (va, "v")):
        check_same(qa, "q", a, n)
        check_rank(a, n, 4, "(num_pages, page_size, nheads_k, headdim) with a block_table")
        check_dtype(a, n, qa, "q")
    if va.shape != ka.shape:
        raise ValueError(f"v must have the shape of k {ka.shape}; got {va.shape}")
    check_headdim(ka.shape[3], "k")
    for a, n in ((ka, "k"), (va, "v")):
        check_layout(a, n)
    ck = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", qa)
    batch = ck.shape[0] - 1
    bt = check_block_table(block_table, qa, batch, ka, "k")
    page_size, hk, d = ka.shape[1:]
    rows = batch * bt.shape[1] * page_size
    kg, vg = (_interop.empty(qa, (rows, hk, d), qa.dtype) for _ in range(2))
    lau = get_launcher(gather_spec(qa.dtype, unaligned(d, ka, va)), qa.device)
    n = 2 * rows * hk * -(-d // 8)
    with _interop.device_guard(qa.device):
        lau.launch_block((-(-n // lau.threads), 1, 1), _interop.current_stream(qa), GATHER_ARGS, GATHER_ARGS.values(
            k_out=_interop.data_ptr(kg), v_out=_interop.data_ptr(vg), k_pages=ka.ptr, v_pages=va.ptr,
            cu_seqlens_k=ck.ptr, block_table=bt.ptr, kp_ps=ka.strides[0], kp_rs=ka.strides[1], kp_hs=ka.strides[2],
            vp_ps=va.strides[0], vp_rs=va.strides[1], vp_hs=va.strides[2], batch=batch, rows=rows, nheads_k=hk,
            headdim=d, bt_stride=bt.strides[0], page_size=page_size))
    return kg, vg


def varlen_forward(q4, k4, v4, packed, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                   rng_state, backend="auto"):
    """(out [total_q, h, d], lse [h, total_q], mods) of validated [1, total, ...] views (check_varlen)."""
    from ._fwd import forward
    from ._mods import mods_for

    mods = mods_for(q4, k4, causal, window_size, softcap, alibi_slopes, softmax_scale, dropout_p=dropout_p,
                    rng_state=rng_state, batch=packed.batch)
    out, lse = forward(q4, k4, v4, softmax_scale, causal, backend=backend, mods=mods, packed=packed)
    return out, lse, mods


def check_varlen_backward_inputs(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Validated views of a packed backward: (dout, q, k, v, out as [1, total, ...] views, lse, Packed)."""
    from ._validate import check_backward_headdim, check_grad_inputs

    q4, k4, v4, packed = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_backward_headdim(q4.shape[3], "the backward")
    qa = wrap(q, "q")
    da, oa, la = check_grad_inputs(qa, dout, out, lse, (qa.shape[1], qa.shape[0]), "(nheads, total_q)")
    return view4(da), q4, k4, v4, view4(oa), la, packed


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                    causal, deterministic, dq_strategy, mods):
    """(dq, dk, dv) of a packed call (validated here; mods: the forward's)."""
    from .backward import _make_plan

    da, q4, k4, v4, o4, la, packed = check_varlen_backward_inputs(dout, q, k, v, out, lse, cu_seqlens_q,
                                                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    plan = _make_plan(da, q4, k4, v4, o4, la, softmax_scale, causal, dq_strategy, deterministic, None, "auto", mods,
                      packed)
    return plan.run(da.ptr, q4.ptr, k4.ptr, v4.ptr, o4.ptr, la.ptr, packed.cu_q.ptr, packed.cu_k.ptr)
