"""FlashAttention-2 forward launches (cuda_src/flash_fwd.cu): the memoized plan of `flash_attn_func` and the
plain `forward` of autograd, the V1 ladder, the fwd_split decode path and benchmarks.

Host path. At small shapes the Python around the launch is a visible part of a call, so `flash_attn_func`
without autograd (algorithm "v2") memoizes everything that depends only on (dtypes, shapes, strides, devices,
softmax_scale, causal, grid_order) in a `_FwdPlan` (cuflash._plan.HostPlan): a call whose arrays match a
validated call's key reads the pointers, checks their 16-byte alignment, allocates out and lse, packs one
parameter block and launches. `forward` validates nothing and memoizes nothing; both build the launch with
`_launch_setup`.

A growing KV cache (generation: the keys and values are new arrays one key longer each step, with strides that grow
with them) misses that memo on every step. Nothing in a plan but k and v's strides, seqlen_k and the window's left
bound depends on the key count (the kernel, its grid -- set by seqlen_q -- and the backend choice do not), and the
kernels read all of those from the parameter block at run time: so a second memo (`_KV_PLANS`) keys the same plans
by everything but k / v's seqlen and strides, and a call that misses the first memo runs such a plan with those
fields packed per call (`_FwdPlan.run_kv`), after checking inline what validation would check of them.
"""
from __future__ import annotations

from . import _interop
from ._configs import (FWD_CAP_MAX_HEADDIMS, FWD_HEADDIMS, MOD_SCORE, SMALL_SMEM_PER_BLOCK, combine_spec,
                       fit_fwd_tile, fwd_cap_max_tile, fwd_smem_bytes, fwd_spec, fwd_tile, kernel_headdim, split_tile,
                       ua_fwd_tile, unaligned)
from ._fwd_grid import (GRID_ORDER_CHOICES, GRID_ORDERS, _grid, _strides_of, folds_gqa, outputs,  # noqa: F401
                        resolve_grid_order)
from ._interop import desc
from ._launch import _scratch, _tls, get_launcher, smem_per_block
from ._mods import (LOG2E, has_softcap, kernel_mode, memo_key, mod_fields, mods_for, score_mods,  # noqa: F401 (LOG2E)
                    window_of)
from ._params import FWD_PARAMS, NO_CACHE, NO_WALK, contiguous_strides
from ._plan import HostPlan, remember
from ._validate import MAX_ROW_STRIDE, check_qkv, check_softmax_scale


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
    osb, osq, osh = o_strides
    # rows that are not 16-byte units (cuflash._configs.unaligned; out's strides too): the UA kernel, one split,
    # its mode the score modifiers' (a plain or causal call as a band)
    ua = unaligned(hd, qa, ka, va) or any(s % 8 for s in o_strides)
    if ua:
        if num_splits > 1:
            raise ValueError("num_splits > 1: the split-KV forward needs 16-byte rows (head dims that are multiples "
                             "of 8, 16-byte aligned strides and data)")
        mods = score_mods(mods, causal, softmax_scale, sq, sk)
        tile = None
    causal, mod = kernel_mode(mods, causal)
    if packed is None and folds_gqa(sq, h, hk, mod):  # the query heads of a KV head as rows (causal is moot: 1 row sees every key)
        rows, kheads, q_row, q_head = fold_gqa_rows(qa, hk)
        o_row, o_head = osh, rows * osh
        heads_per_kv, causal = 1, False
    else:
        rows, kheads, q_row, q_head = sq, h, qa.strides[1], qa.strides[2]
        o_row, o_head = osq, osh
        heads_per_kv = h // hk
    split = num_splits > 1
    if ua:
        tile = ua_fwd_tile(d, mod)
    if (tile is None and not ua and not split and packed is None and mod == MOD_SCORE and has_softcap(mods)
            and d in FWD_CAP_MAX_HEADDIMS):  # the soft-cap's capped-max form, where its tile fits
        cap_tile = fwd_cap_max_tile(d)
        smem = fwd_smem_bytes(d, cap_tile)
        if smem <= SMALL_SMEM_PER_BLOCK or smem <= smem_per_block(qa.device):  # (the device asked only past 99 KB)
            tile = cap_tile
    if tile is None or ua:  # the configured tile, fitted to the device's shared memory per block (99 KB GPUs)
        tile = tile or (split_tile(d) if split else fwd_tile(d, causal, mod))
        if fwd_smem_bytes(d, tile) > SMALL_SMEM_PER_BLOCK:
            tile = fit_fwd_tile(d, tile, smem_per_block(qa.device)) or tile
    spec = fwd_spec(qa.dtype, d, causal, split=split, tile=tile, mod=mod, varlen=packed is not None, ua=ua)
    lau = get_launcher(spec, qa.device)
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
        **mod_fields(mods, softmax_scale, hd), **NO_WALK,
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


# the fields of a plan's block that follow from k / v's key count, in block order (cuflash._params.FWD_PARAMS)
_KV_STRIDES = ("k_batch_stride", "k_row_stride", "k_head_stride", "v_batch_stride", "v_row_stride", "v_head_stride")
_KV_FIELDS = (_KV_STRIDES[0], "seqlen_k", "window_left")
_K0 = FWD_PARAMS.index[_KV_STRIDES[0]]
assert [FWD_PARAMS.index[n] for n in _KV_STRIDES] == list(range(_K0, _K0 + 6))
assert sorted(_KV_FIELDS, key=FWD_PARAMS.index.get) == list(_KV_FIELDS)
_MAX_STRIDE = 1 << 39  # elements of a 2-byte dtype: a tensor map's 2^40-byte stride bound (cuflash._tma.MAX_STRIDE)


class KvFields:
    """What a plan needs to run at another key count than its own (`_FwdPlan.run_kv`): its constant fields split
    around k / v's strides, seqlen_k and window_left, and the window's left edge (None: window_left stays the plan's
    constant, as without a score modifier)."""

    __slots__ = ("r0", "r1", "r2", "r3", "wl", "left", "dims", "isz")

    def __init__(self, plan, left, kshape, itemsize):
        rest, nd = plan.rest, len(plan.params.dynamic)
        a, b, c = (FWD_PARAMS.index[n] - nd for n in _KV_FIELDS)
        self.r0, self.r1, self.r2, self.wl, self.r3 = rest[:a], rest[a + 6:b], rest[b + 1:c], rest[c], rest[c + 1:]
        self.left = left
        # the stride indices validation looks at (sizes above 1; the key count's: per call) and the stride unit
        self.dims = tuple(i for i in (0, 2) if kshape[i] > 1)
        self.isz = itemsize

    def strides(self, sk, st):
        """k's or v's element strides (st: desc's) when validation (cuflash._validate.check_layout) and the
        tensor-map check (cuflash._tma.tma_compatible) both take them, as they took the plan's own: positive
        multiples of 8 elements below the bounds on every dimension of size > 1, the last one contiguous, sk >= 1;
        else None (the call then takes the validating path)."""
        if self.isz != 1:  # CuPy: byte strides
            st = tuple(x // self.isz for x in st)
        if st[3] != 1 or sk < 1:
            return None
        for i in self.dims:
            x = st[i]
            if x <= 0 or x & 7 or x >= _MAX_STRIDE:
                return None
        if sk > 1 and (st[1] <= 0 or st[1] & 7 or st[1] >= MAX_ROW_STRIDE):
            return None
        return st

    def pack(self, plan, buf, qp, kp, vp, op, lp, sk, ks, vs):
        """Pack plan's block with k / v's strides ks, vs (elements), seqlen_k = sk and the window's left bound
        (cuflash._mods.resolve: an unbounded left edge is seqlen_k, a bounded one at most seqlen_k)."""
        left = self.left
        wl = self.wl if left is None else sk if left < 0 else min(left, sk)
        plan.pack(buf, 0, qp, kp, vp, op, lp, *self.r0, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], *self.r1, sk,
                  *self.r2, wl, *self.r3)


class _FwdPlan(HostPlan):
    """A V2 forward for one memo key (validated once): `run` allocates out and lse and launches; `run_kv` does so
    at another key count (the plan's `kv`: KvFields, or None where the plan cannot)."""

    __slots__ = ("outs", "kv")

    def run(self, qp, kp, vp):
        (out, lse), (op, lp), stream = self.outs()
        self.launch(stream, qp, kp, vp, op, lp)
        return out, lse

    def run_kv(self, qp, kp, vp, kshape, ks, vs):
        (out, lse), (op, lp), stream = self.outs()
        buf, argv, _ = getattr(_tls, "s", None) or _scratch()
        self.kv.pack(self, buf, qp, kp, vp, op, lp, kshape[1], ks, vs)
        self.launch_packed(stream, argv)
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
    lau, grid, fields = _launch_setup(qa, ka, va, softmax_scale, causal, grid_order,
                                      contiguous_strides(qa.shape)[:3], mods=mods)
    p = _FwdPlan(qa)
    p.bind(FWD_PARAMS, ("q", "k", "v", "o", "lse"), o_accum=0, lse_accum=0, cu_seqlens_q=0, cu_seqlens_k=0,
           **NO_CACHE, **fields)
    p.add_launch(lau, grid)
    p.outs = p.allocator(p.spec((b, sq, h, d)), p.spec((b, h, sq), float32=True))
    return p


_PLANS: dict = {}
_KV_PLANS: dict = {}  # the same plans by kv_key: a KV cache that grows reuses its plan (module docstring)
_MAX_PLANS = 4096


def kv_key(key):
    """The memo key `key` of forward_memo less k's and v's key count and strides (what run_kv takes per call)."""
    qd, (kt, (b, _, h, d), _, kdev), (vt, _, _, vdev) = key[:3]
    return qd, kt, b, h, d, kdev, vt, vdev, *key[3:]


def _kv_run(key, qp, kp, vp, kd, vd):
    """The call of memo key `key` (a miss) through the _KV_PLANS plan of its kv_key when there is one and k, v
    pass the checks validation would make of their new key count and strides; None otherwise."""
    plan = _KV_PLANS.get(kv_key(key))
    if plan is None or kd[1] != vd[1] or (qp | kp | vp) & 15:
        return None
    kv, sk = plan.kv, kd[1][1]
    ks, vs = kv.strides(sk, kd[2]), kv.strides(sk, vd[2])
    if ks is None or vs is None:
        return None
    return plan.run_kv(qp, kp, vp, kd[1], ks, vs)


def forward_memo(q, k, v, softmax_scale, causal, grid_order, backend="auto", window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None):
    """`forward` of flash_attn_func without autograd through a memoized plan; validates on a miss only (a miss
    that only changed k / v's key count and strides runs the plan of the other counts: _KV_PLANS)."""
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
        if plan is None and key is not None:
            res = _kv_run(key, qp, kp, vp, kd, vd)
            if res is not None:
                return res
    if plan is None or (qp | kp | vp) & 15:
        qa, ka, va = check_qkv(q, k, v)
        mods = mods_for(qa, ka, causal, window_size, softcap, alibi_slopes, softmax_scale)
        plan = _make_plan(qa, ka, va, softmax_scale, causal, grid_order, backend, mods)
        if plan is None:
            return forward(qa, ka, va, softmax_scale, causal, grid_order, backend=backend, mods=mods)
        if (qa.ptr | ka.ptr | va.ptr) & 15:  # a plan for data that is not 16-byte aligned (the UA kernels) is not
            return plan.run(qa.ptr, ka.ptr, va.ptr)  # kept: aligned calls of the same key take the 16-byte kernels
        remember(_PLANS, key, plan, _MAX_PLANS)
        if key is not None:
            left = window_of(causal, window_size)[0] if mods is not None and mods.mod else None
            plan.kv = KvFields(plan, left, ka.shape, 1 if qa.kind == _interop.TORCH else qa.obj.itemsize)
            if plan.kv.strides(ka.shape[1], kd[2]) is not None and plan.kv.strides(ka.shape[1], vd[2]) is not None:
                remember(_KV_PLANS, kv_key(key), plan, _MAX_PLANS)
        qp, kp, vp = qa.ptr, ka.ptr, va.ptr
    return plan.run(qp, kp, vp)
