"""FlashAttention-2 forward launches (cuda_src/flash_fwd.cu): the memoized plan of `flash_attn_func` and the
plain `forward` of autograd, the V1 ladder, the fwd_split decode path and benchmarks.

Host path. At small shapes the Python around the launch is a visible part of a call, so `flash_attn_func`
without autograd (algorithm "v2") memoizes everything that depends only on (dtypes, shapes, strides, devices,
softmax_scale, causal, grid_order) in a `_FwdPlan` (cuflash._plan.HostPlan): a call whose arrays match a
validated call's key reads the pointers, checks their 16-byte alignment, allocates out and lse, packs one
parameter block and launches. `forward` validates nothing and memoizes nothing; both build the launch with
`_launch_setup`.
"""
from __future__ import annotations

from . import _interop
from ._configs import FWD_HEADDIMS, combine_spec, fwd_spec, fwd_tile, kernel_headdim, split_tile
from ._fwd_grid import (GRID_ORDER_CHOICES, GRID_ORDERS, _grid, _strides_of, folds_gqa, outputs,  # noqa: F401
                        resolve_grid_order)
from ._interop import desc
from ._launch import get_launcher
from ._mods import LOG2E, kernel_mode, memo_key, mod_fields, mods_for  # noqa: F401 (LOG2E re-exported)
from ._params import FWD_PARAMS, NO_CACHE
from ._plan import HostPlan, remember
from ._validate import check_qkv, check_softmax_scale


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
                  seqlen_k_new=0, mods=None, packed=None):
    """The V2 forward launch of validated views, less its pointers: (launcher, grid, fields), fields being
    FwdParams' non-pointer fields by name (strides as the kernel sees them -- GQA fold included --, sizes,
    grid order, scale, score modifiers). o_strides: out's (batch, seqlen, head) strides. mods: cuflash._mods.Mods
    of the call, or None. packed: a cuflash._varlen.Packed (qa, ka, va its [1, total, ...] views) or None."""
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    hd, d = d, kernel_headdim(d, FWD_HEADDIMS)  # the inputs' head dim; the kernel's (padded in shared memory)
    causal, mod = kernel_mode(mods, causal)
    osb, osq, osh = o_strides
    if packed is None and folds_gqa(sq, h, hk, mod):  # the query heads of a KV head as rows (causal is moot: 1 row sees every key)
        rows, kheads, q_row, q_head = fold_gqa_rows(qa, hk)
        o_row, o_head = osh, rows * osh
        heads_per_kv, causal = 1, False
    else:
        rows, kheads, q_row, q_head = sq, h, qa.strides[1], qa.strides[2]
        o_row, o_head = osq, osh
        heads_per_kv = h // hk
    split = num_splits > 1
    spec = fwd_spec(qa.dtype, d, causal, split=split, tile=tile, mod=mod, varlen=packed is not None)
    lau = get_launcher(spec, qa.device)
    tile = tile or (split_tile(d) if split else fwd_tile(d, causal, mod))
    # the grid's split index: the KV split (split-KV), or the block's O column slice (tile.o_split > 1)
    num_splits = num_splits if split else tile.o_split
    order, grid = _grid(GRID_ORDERS[resolve_grid_order(grid_order, causal, rows, d)], -(-rows // tile.block_m), kheads,
                        b, num_splits)
    fields = dict(
        q_batch_stride=qa.strides[0], q_row_stride=q_row, q_head_stride=q_head,
        k_batch_stride=ka.strides[0], k_row_stride=ka.strides[1], k_head_stride=ka.strides[2],
        v_batch_stride=va.strides[0], v_row_stride=va.strides[1], v_head_stride=va.strides[2],
        o_batch_stride=osb, o_row_stride=o_row, o_head_stride=o_head,
        batch=b, nheads=kheads, heads_per_kv=heads_per_kv, seqlen_q=rows, seqlen_k=sk, num_splits=num_splits,
        seqlen_k_new=seqlen_k_new, grid_order=order,
        **mod_fields(mods, softmax_scale, hd),
    )
    if packed is not None:
        grid = packed.grid(tile.block_m, kheads, num_splits)
        packed.patch(fields)
    return lau, grid, fields


def forward(qa, ka, va, softmax_scale, causal, grid_order="auto", tile=None, out=None, lse=None,
            seqlens_k_ptr=0, seqlen_k_new=0, num_splits=1, scratch=None, backend="sm80", mods=None, packed=None):
    """Launch the V2 forward on validated views; returns (out, lse) of the inputs' kind.

    backend: "sm80" (the mma.sync kernels, every option below), "sm90" or "auto" (cuflash._fwd_sm90: the Hopper
    kernels where the device and the inputs allow; only for a plain forward -- no tile, KV cache or splits).

    out [b, sq, h, d] (same dtype as q), lse [b, h, sq] float32 natural log. `tile` overrides the
    configured tile (benchmark sweeps). mods: the score modifiers (cuflash._mods.mods_for), or None. KV cache: `seqlens_k_ptr` is an int32 [b] device array of valid
    keys per batch element (plus `seqlen_k_new` appended by this call). num_splits > 1 runs the split-KV
    kernel into fp32 partials (`scratch` = (o_accum, lse_accum), allocated here when None) and combines.
    packed (cuflash._varlen.Packed; qa, ka, va its [1, total, ...] views): packed sequences, out [total_q, h, d]
    and lse [h, total_q] (flash-attn's varlen layouts), not with a KV cache or splits.
    """
    if backend != "sm80" and tile is None and not seqlens_k_ptr and num_splits == 1:
        from . import _fwd_sm90

        if _fwd_sm90.resolve_backend(backend, qa, ka, va, mods, packed) == "sm90":
            return _fwd_sm90.forward(qa, ka, va, softmax_scale, causal, grid_order, out, lse, mods=mods,
                                     packed=packed)
    b, sq, h, d = qa.shape
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    check_softmax_scale(softmax_scale)
    out, lse, o_strides = outputs(qa, out, lse, packed)
    if packed is not None and packed.total_q == 0:
        return out, lse
    lau, grid, fields = _launch_setup(qa, ka, va, softmax_scale, causal, grid_order, o_strides, tile,
                                      num_splits, seqlen_k_new, mods, packed)
    split = num_splits > 1
    o_accum = lse_accum = 0
    if split:
        kheads, rows = fields["nheads"], fields["seqlen_q"]
        if scratch is None:
            scratch = (_interop.empty(qa, (num_splits, b, kheads, rows, kernel_headdim(d)), "float32"),
                       _interop.empty(qa, (num_splits, b, kheads, rows), "float32"))
        o_accum, lse_accum = (_interop.data_ptr(x) for x in scratch)
    op, lp = _interop.data_ptr(out), _interop.data_ptr(lse)
    stream = _interop.current_stream(qa)
    with _interop.device_guard(qa.device):
        lau.launch_block(grid, stream, FWD_PARAMS, FWD_PARAMS.values(
            q=qa.ptr, k=ka.ptr, v=va.ptr, o=op, lse=lp, o_accum=o_accum, lse_accum=lse_accum,
            **dict(NO_CACHE, seqlens_k=seqlens_k_ptr), **(packed.pointers() if packed is not None else _NOT_PACKED),
            **fields))
        if split:  # flash_combine_kernel: the partials -> out, lse (the fields it reads; the others 0)
            comb = get_launcher(combine_spec(qa.dtype, kernel_headdim(d)), qa.device)
            nrows = b * fields["nheads"] * fields["seqlen_q"]
            lau_fields = {n: fields[n] for n in ("o_batch_stride", "o_row_stride", "o_head_stride", "batch",
                                                  "nheads", "seqlen_q", "seqlen_k", "num_splits", "head_dim")}
            comb.launch_block((-(-nrows // (comb.threads // 32)), 1, 1), stream, FWD_PARAMS, FWD_PARAMS.values(
                0, o=op, lse=lp, o_accum=o_accum, lse_accum=lse_accum, heads_per_kv=1, **lau_fields))
    return out, lse


_NOT_PACKED = dict(cu_seqlens_q=0, cu_seqlens_k=0)


class _FwdPlan(HostPlan):
    """A V2 forward for one memo key (validated once): `run` allocates out and lse and launches."""

    __slots__ = ("outs",)

    def run(self, qp, kp, vp):
        (out, lse), (op, lp), stream = self.outs()
        self.launch(stream, qp, kp, vp, op, lp)
        return out, lse


def _make_plan(qa, ka, va, softmax_scale, causal, grid_order, backend="sm80", mods=None):
    """The plan of validated views (out allocated contiguous): an sm90 plan where `backend` resolves to it
    (cuflash._fwd_sm90), else a _FwdPlan; None for an empty batch or head count (left to `forward`: the strides
    of an empty out are the array library's choice)."""
    b, sq, h, d = qa.shape
    if not b or not h:
        return None
    if backend != "sm80":
        from . import _fwd_sm90

        if _fwd_sm90.resolve_backend(backend, qa, ka, va, mods) == "sm90":
            return _fwd_sm90.make_plan(qa, ka, va, softmax_scale, causal, grid_order, mods)
    lau, grid, fields = _launch_setup(qa, ka, va, softmax_scale, causal, grid_order, (sq * h * d, h * d, d),
                                      mods=mods)
    p = _FwdPlan(qa)
    p.bind(FWD_PARAMS, ("q", "k", "v", "o", "lse"), o_accum=0, lse_accum=0, cu_seqlens_q=0, cu_seqlens_k=0,
           **NO_CACHE, **fields)
    p.add_launch(lau, grid)
    p.outs = p.allocator(p.spec((b, sq, h, d)), p.spec((b, h, sq), float32=True))
    return p


_PLANS: dict = {}
_MAX_PLANS = 4096


def forward_memo(q, k, v, softmax_scale, causal, grid_order, backend="auto", window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None):
    """`forward` of flash_attn_func without autograd through a memoized plan; validates on a miss only."""
    qp, qd = desc(q)
    kp, kd = desc(k)
    vp, vd = desc(v)
    plan = key = None
    mk = memo_key(causal, window_size, softcap, alibi_slopes)
    if qd is not None and kd is not None and vd is not None and mk is not None:
        # the scale's type too: np.float32(0.125) == 0.125, but times LOG2E it stays a float32
        key = (qd, kd, vd, softmax_scale, type(softmax_scale), causal, grid_order, backend, mk)
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: validate (and maybe fail) below
            key = None
    if plan is None or (qp | kp | vp) & 15:
        qa, ka, va = check_qkv(q, k, v)
        mods = mods_for(qa, ka, causal, window_size, softcap, alibi_slopes, softmax_scale)
        plan = _make_plan(qa, ka, va, softmax_scale, causal, grid_order, backend, mods)
        if plan is None:
            return forward(qa, ka, va, softmax_scale, causal, grid_order, backend=backend, mods=mods)
        remember(_PLANS, key, plan, _MAX_PLANS)
        qp, kp, vp = qa.ptr, ka.ptr, va.ptr
    return plan.run(qp, kp, vp)
