"""FlashAttention-2 backward: dq, dk, dv from (dout, q, k, v, out, lse), three dQ strategies."""
from __future__ import annotations

import warnings
from typing import Any, Optional, Tuple

from . import _bwd_sm90, _interop, _loader
from ._fwd_sm90 import MapMemo, check_backend
from ._configs import (BWD_AUTO_PARTITION, BWD_CONVERT_SLOTS, BWD_PARTITIONS, BWD_ROW_PAD, BWD_SCORE_UNSUPPORTED,
                       DQ_ORDERED_ROWS_PER_SEM, SM90_BWD_M80_ROWS, SMALL_SMEM_PER_BLOCK, bwd_convert_spec,
                       bwd_convert_t_spec, bwd_pre_lanes_per_row, bwd_preprocess_spec, bwd_smem_bytes, bwd_spec,
                       bwd_tile, bwd_tiles, fit_bwd_partition, kernel_headdim, sm90_bwd_sq_pad, sm90_bwd_tile,
                       ua_bwd_tile, unaligned)
from ._interop import desc
from ._launch import get_launcher, smem_per_block
from ._mods import MOD_SCORE, has_dropout, has_softcap, is_plain, kernel_mode, mod_fields, mods_for, score_mods
from ._params import BWD_PARAMS, contiguous_fields, stride_fields
from ._plan import HostPlan, remember
from ._validate import check_backward_headdim, check_grad_inputs, check_qkv, check_softmax_scale, check_unsupported

DQ_STRATEGIES = {"atomic": 0, "seqpar": 1, "loop": 2, "ordered": 3}
# "ordered" (the Hopper backward, without score modifiers): the atomic accumulator, added to in KV-tile order through
# semaphores per Q tile: deterministic without seqpar's buffers (cuda_src/flash_bwd_sm90.cu).
# seqpar's per-KV-tile dQ buffers may take at most this fraction of the free device memory.
SEQPAR_MAX_FREE_FRACTION = 0.5


def seqpar_extra_bytes(batch, nheads, seqlen_q, seqlen_k, headdim, tile=None, warp_partition="auto") -> int:
    """Extra device memory of dq_strategy="seqpar": one fp32 dQ buffer per KV tile (of the partition's tile)."""
    tile = tile or bwd_tile(headdim, resolve_warp_partition(warp_partition, headdim))
    n_blocks = -(-seqlen_k // tile.block_n)
    sq_pad = -(-seqlen_q // BWD_ROW_PAD) * BWD_ROW_PAD
    return n_blocks * batch * nheads * sq_pad * headdim * 4


def resolve_warp_partition(warp_partition, headdim: int) -> str:
    """"auto" -> the partition tuned for this head dim (cuflash._configs.BWD_AUTO_PARTITION, else "kv")."""
    return BWD_AUTO_PARTITION.get(headdim, "kv") if warp_partition == "auto" else warp_partition


def check_score_partition(warp_partition, headdim: int) -> None:
    """NotImplementedError for a warp partition without a score-modifier kernel at this head dim
    (cuflash._configs.BWD_SCORE_UNSUPPORTED; a head dim that is not compiled: the kernel that runs it)."""
    kd = kernel_headdim(headdim) or headdim
    part = resolve_warp_partition(warp_partition, kd)
    if (part, kd) in BWD_SCORE_UNSUPPORTED:
        raise NotImplementedError(f"warp_partition={warp_partition!r} at head dim {headdim} has no kernel for "
                                  "window_size / softcap / alibi_slopes (it does not fit the registers); use "
                                  "warp_partition='auto' or 'kv'")


def check_warp_partition(warp_partition, headdim=None, algorithm="v2") -> None:
    """warp_partition: "auto" (the default: per head dim, BWD_AUTO_PARTITION), "kv" (warps split the KV rows),
    "q" (warps split the Q rows) or "2d" (32-row warp tiles in every product, FlashAttention-2's; head dims
    32-128)."""
    if warp_partition != "auto" and warp_partition not in BWD_PARTITIONS:
        raise ValueError(f"warp_partition must be one of {('auto', *BWD_PARTITIONS)}; got {warp_partition!r}")
    if algorithm == "v1" and warp_partition not in ("auto", "kv"):
        raise ValueError(f"warp_partition={warp_partition!r} selects a partition of the V2 backward; "
                         f"algorithm='v1' has its own kernel")
    kd = None if headdim is None else kernel_headdim(headdim) or headdim  # the compiled head dim that runs it
    if kd is not None and kd not in bwd_tiles(resolve_warp_partition(warp_partition, kd)):
        raise ValueError(f"warp_partition={warp_partition!r} does not support head dim {headdim}; supported: "
                         f"{tuple(bwd_tiles(warp_partition))} and the head dims they run (multiples of 8 below each)")


def bwd_backend(fwd_backend: str) -> str:
    """The backward's backend under autograd, from the forward's `backend` keyword: "sm80" keeps the mma.sync
    kernels; "auto" and "sm90" take the Hopper backward wherever it can run the call (it takes fewer head dims and
    options than the Hopper forward, so a forward forced onto sm90 never makes its backward fail)."""
    return "sm80" if fwd_backend == "sm80" else "auto"


def choose_dq_strategy(dq_strategy, deterministic, extra_seqpar: int, device: int) -> str:
    if dq_strategy is not None:
        if dq_strategy not in DQ_STRATEGIES:
            raise ValueError(f"dq_strategy must be one of {tuple(DQ_STRATEGIES)}; got {dq_strategy!r}")
        if deterministic and dq_strategy == "atomic":
            raise ValueError("dq_strategy='atomic' is not deterministic; use 'seqpar', 'loop' or (the Hopper "
                             "backward) 'ordered' with deterministic=True")
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
    check_backward_headdim(qa.shape[3], "the backward")
    b, sq, h, _ = qa.shape
    da, oa, la = check_grad_inputs(qa, dout, out, lse, (b, h, sq), "(batch, nheads, seqlen_q)")
    return da, qa, ka, va, oa, la


class _BwdPlan(HostPlan):
    """A V2 backward for fixed (dtypes, shapes, strides, devices, options), validated once: `run` allocates dq, dk,
    dv and one fp32 workspace (lse_log2, delta, dQ accumulator) and launches preprocess, main and dQ-convert
    kernels with one parameter block."""

    __slots__ = ("outs", "ws_off", "strategy", "backend", "maps", "encoded", "sk")

    def run(self, dp, qp, kp, vp, op, lp, *cu):
        """cu: a packed plan's (cu_seqlens_q, cu_seqlens_k) pointers."""
        if self.maps is not None:  # the sm90 main kernel: its tensor maps ride along (cuflash._bwd_sm90)
            return _bwd_sm90.run_plan(self, dp, qp, kp, vp, op, lp)
        (dq, dk, dv, _), (dqp, dkp, dvp, w), stream = self.outs()
        o_lse, o_delta, o_acc = self.ws_off
        self.launch(stream, qp, kp, vp, op, dp, lp, w + o_lse, w + o_delta, w + o_acc, dqp, dkp, dvp, *cu)
        return dq, dk, dv


def _make_plan(da, qa, ka, va, oa, la, softmax_scale, causal, dq_strategy, deterministic, tile, warp_partition,
               mods=None, packed=None, backend="auto"):
    """The plan of validated views (every strategy; "seqpar" checks free memory when the plan is made); mods: the
    forward's score modifiers (cuflash._mods.Mods) or None; packed: a cuflash._varlen.Packed (the views its [1,
    total, ...] ones; the plan then takes the cu_seqlens pointers in `run` and returns packed gradients); backend:
    "auto", "sm80" or "sm90" (cuflash._bwd_sm90: the main kernel's path)."""
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    hd, d = d, kernel_headdim(d)  # the inputs' head dim; the kernels' (padding columns zero-filled)
    check_warp_partition(warp_partition, d)
    path = _bwd_sm90.resolve_backend(backend, da, qa, ka, va, mods, packed, dq_strategy, warp_partition, tile)
    fit = warp_partition == "auto" and tile is None  # "auto" may move to a partition whose tile fits the device
    warp_partition = resolve_warp_partition(warp_partition, d)
    # rows that are not 16-byte units (cuflash._configs.unaligned): the UA kernels (the sm80 path; the score
    # modifiers' mode, a plain or causal call as a band; the default partition and its sm_80 tile)
    ua = path == "sm80" and unaligned(hd, qa, ka, va, oa, da)
    if ua:
        mods = score_mods(mods, causal, softmax_scale, sq, sk)
    causal, mod = kernel_mode(mods, causal)
    if ua:
        warp_partition, tile = ua_bwd_tile(d, qa.dtype, mod)
    if path == "sm80" and (fit or ua):  # GPUs of less shared memory a block (99 KB): the first partition whose
        # tile fits (the UA kernels take the default partition whatever was asked)
        arch, varlen = (80 if ua else _loader.device_cc(qa.device)), ua or packed is not None
        own = tile or bwd_tile(d, warp_partition, arch, qa.dtype, mod, varlen)
        if bwd_smem_bytes(d, own, warp_partition) > SMALL_SMEM_PER_BLOCK:
            fitted = fit_bwd_partition(d, warp_partition, arch, qa.dtype, mod, varlen, smem_per_block(qa.device))
            if fitted is not None:
                warp_partition, tile = fitted
    if mod and path == "sm80":
        check_score_partition(warp_partition, d)
    if path == "sm90":  # (the main kernel's spec and maps once the strategy is known)
        block_n, maps, tile = sm90_bwd_tile(d).block_n, None, None
    else:
        tile = tile or bwd_tile(d, warp_partition, _loader.device_cc(qa.device), qa.dtype, mod,
                                varlen=packed is not None)
        block_n, maps = tile.block_n, None
    if packed is None:
        n_blocks = -(-sk // block_n)  # KV tiles per sequence (seqpar's dQ buffers)
        sq_pad = -(-sq // BWD_ROW_PAD) * BWD_ROW_PAD
        rows = b * h * sq_pad  # fp32 workspace: lse_log2 [rows], delta [rows], dQ accumulator [splits, rows, d]
        dq_shape, dkv_shape = (b, sq, h, hd), (b, sk, hk, hd)
    else:  # packed: the rows of every sequence per head; seqpar's buffers: the KV tiles of the longest sequence
        b = packed.batch
        n_blocks = None if packed.max_k is None else max(1, -(-packed.max_k // block_n))
        sq_pad = packed.padded_rows()
        rows = h * sq_pad
        dq_shape, dkv_shape = (sq, h, hd), (sk, hk, hd)
    if packed is not None and n_blocks is None:
        if dq_strategy == "seqpar":
            raise ValueError("dq_strategy='seqpar' with packed sequences needs max_seqlen_k as an int (it sizes one "
                             "dQ buffer per KV tile of the longest sequence); use 'loop' or pass an int")
        if dq_strategy is None and deterministic:
            dq_strategy = "loop"
    if dq_strategy == "ordered" and (path != "sm90" or mod):
        raise ValueError("dq_strategy='ordered' runs on the Hopper backward without window_size / softcap / "
                         "alibi_slopes" + ("" if path == "sm90" else " (this call takes the sm80 kernels)") +
                         "; use 'seqpar' or 'loop' for a deterministic backward")
    if (dq_strategy is None and deterministic and path == "sm90" and not mod
            and (not sm90_bwd_tile(d).split or _bwd_sm90.split_ordered())):
        dq_strategy = "ordered"  # deterministic at the atomic strategy's memory (and nearly its speed)
    strategy = choose_dq_strategy(dq_strategy, deterministic, (n_blocks or 0) * rows * d * 4, qa.device)
    if path == "sm90" and strategy == "loop":  # seqpar's buffers did not fit: "loop" runs on the sm80 kernels
        if backend == "sm90":
            raise ValueError("backend='sm90' cannot take this backward: deterministic=True needs dq_strategy="
                             "'seqpar' there, and its dQ buffers do not fit the free memory")
        return _make_plan(da, qa, ka, va, oa, la, softmax_scale, causal, "loop", deterministic, None, "auto", mods,
                          packed, "sm80")
    persistent, sk_bytes, trans = False, 0, False
    if path == "sm90":
        main_spec, t90, maps, persistent, sk_bytes = _bwd_sm90.main_launch(da, qa, ka, va, causal, mod, strategy,
                                                                           sk if packed is None else None,
                                                                           has_softcap(mods))
        block_n, trans = t90.block_n, t90.block_m == SM90_BWD_M80_ROWS
        if trans:  # the 80-row tiles (fixed lengths): whole Q tiles per head, the T accumulator layout
            sq_pad = sm90_bwd_sq_pad(sq, t90.block_m)
            rows = b * h * sq_pad
    splits = n_blocks if strategy == "seqpar" else 1
    p = _BwdPlan(qa)
    p.strategy, p.backend, p.maps, p.encoded, p.sk = strategy, path, maps, MapMemo(), sk_bytes
    sems = rows // DQ_ORDERED_ROWS_PER_SEM if strategy == "ordered" else 0  # int32 semaphores after the accumulator
    p.outs = p.allocator(p.spec(dq_shape), p.spec(dkv_shape), p.spec(dkv_shape),
                         p.spec((rows * (2 + splits * d) + sems,), float32=True))
    p.ws_off = (0, 4 * rows, 8 * rows)
    c4 = (lambda shape: shape) if packed is None else (lambda shape: (1, *shape))  # the kernels' [b, s, h, d] view
    fields = dict(
        **stride_fields("q", qa.strides), **stride_fields("k", ka.strides), **stride_fields("v", va.strides),
        **stride_fields("o", oa.strides), **stride_fields("do", da.strides),
        **contiguous_fields("dq", c4(dq_shape)), **contiguous_fields("dk", c4(dkv_shape)),
        **contiguous_fields("dv", c4(dkv_shape)),
        batch=b, nheads=h, heads_per_kv=h // hk, seqlen_q=sq, seqlen_k=sk, seqlen_q_pad=sq_pad,
        dq_strategy=DQ_STRATEGIES[strategy], num_dq_splits=splits, softmax_scale=softmax_scale,
        **mod_fields(mods, softmax_scale, hd), sk_workspace=0)
    dynamic = ("q", "k", "v", "o", "dout", "lse", "lse_log2", "delta", "dq_accum", "dq", "dk", "dv")
    if packed is None:
        p.bind(BWD_PARAMS, dynamic, cu_seqlens_q=0, cu_seqlens_k=0, **fields)
    else:
        packed.patch(fields, ("q", "k", "v", "o", "do", "dq", "dk", "dv"))
        p.bind(BWD_PARAMS, dynamic + ("cu_seqlens_q", "cu_seqlens_k"), **fields)
    dev = qa.device
    if path == "sm90":  # the main kernel first: the one whose tile may not fit the device (cuflash._launch.check_smem)
        main = get_launcher(main_spec, dev)
    else:
        main = get_launcher(bwd_spec(qa.dtype, d, causal, tile, warp_partition, mod, varlen=packed is not None,
                                     ua=ua), dev)
    pre = get_launcher(bwd_preprocess_spec(qa.dtype, d, ua), dev)
    if trans:  # the T layout's convert: a warp per 16 rows x 32 columns of a Q tile
        conv = get_launcher(bwd_convert_t_spec(qa.dtype, d, t90.block_m), dev)
        conv_threads = b * h * -(-sq // t90.block_m) * (t90.block_m // 16) * (d // 32) * 32
    else:
        conv = get_launcher(bwd_convert_spec(qa.dtype, d, causal, block_n, mod & MOD_SCORE, ua), dev)  # (no dropout)
        conv_threads = rows * (d // 4) // BWD_CONVERT_SLOTS  # convert: 16-byte slots of the fragment-tiled accumulator
    p.add_launch(pre, (-(-rows * bwd_pre_lanes_per_row(d) // pre.threads), 1, 1))
    if packed is None:
        p.add_launch(main, _bwd_sm90.main_grid(persistent, 1 if strategy == "loop" else n_blocks, hk, b, dev))
    else:  # x over every sequence's KV tiles ("loop": one block per (KV head, sequence))
        p.add_launch(main, (1, hk, b) if strategy == "loop" else (packed.kv_tiles(tile.block_n), hk, 1))
    p.add_launch(conv, (-(-conv_threads // conv.threads), 1, 1))
    return p


def backward(da, qa, ka, va, oa, la, softmax_scale, causal, dq_strategy=None, deterministic=False, tile=None, *,
             warp_partition="auto", mods=None, backend="auto"):
    """Launch preprocess, main and dQ-convert kernels on validated views; returns (dq, dk, dv).

    warp_partition: "auto", "kv" (warps split the KV rows of a tile), "q" (warps split the Q rows) or "2d"; `tile`
    overrides that partition's configured tile (benchmark sweeps); mods: the forward's score modifiers; backend:
    the main kernel's path (cuflash._bwd_sm90)."""
    plan = _make_plan(da, qa, ka, va, oa, la, softmax_scale, causal, dq_strategy, deterministic, tile,
                      warp_partition, mods, backend=backend)
    return plan.run(da.ptr, qa.ptr, ka.ptr, va.ptr, oa.ptr, la.ptr)


_PLANS: dict = {}
_MAX_PLANS = 4096


def backward_memo(dout, q, k, v, out, lse, softmax_scale, causal, dq_strategy, deterministic, warp_partition,
                  mods=None, backend="auto"):
    """`backward` on raw arrays through a memoized plan: a call whose arrays (dtypes, shapes, strides, devices) and
    options match a validated one skips validation and set-up. "seqpar" plans are not kept (their strategy
    depends on the free memory when made). mods: the forward's score modifiers (cuflash._mods.Mods), or None."""
    ptrs, keys = zip(*(desc(x) for x in (dout, q, k, v, out, lse)))
    plan = key = None
    if None not in keys and not has_dropout(mods):  # (dropout: every call has its own rng state)
        mk = () if mods is None else (mods.causal, mods.mod, tuple(mods.fields.items()))
        key = (keys, softmax_scale, type(softmax_scale), causal, dq_strategy, deterministic, warp_partition, mk,
               backend)
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: validate (and maybe fail) below
            key = None
    if plan is None or (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
        check_warp_partition(warp_partition)
        check_backend(backend)
        views = check_backward_inputs(dout, q, k, v, out, lse)
        plan = _make_plan(*views, softmax_scale, causal, dq_strategy, deterministic, None, warp_partition, mods,
                          backend=backend)
        ptrs = tuple(a.ptr for a in views)
        # not kept: "seqpar" plans, and plans for data that is not 16-byte aligned (the UA kernels: aligned calls of
        # the same key take the 16-byte kernels)
        if plan.strategy != "seqpar" and not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
            remember(_PLANS, key, plan, _MAX_PLANS)
    return plan.run(*ptrs)


def flash_attn_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, softmax_lse: Any,
                        softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = False, *,
                        dq_strategy: Optional[str] = None, algorithm: str = "v2",
                        warp_partition: str = "auto", window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Any = None, dropout_p: float = 0.0,
                        rng_state: Optional[Tuple[int, int]] = None, backend: str = "auto") -> Tuple[Any, Any, Any]:
    """Gradients of flash_attn_func for CuPy users (CuPy has no autograd); also accepts torch tensors.

    Args:
        dout, q, out: [batch, seqlen_q, nheads, headdim]; k, v: [batch, seqlen_k, nheads_k, headdim]; float16 or
            bfloat16 (all the same), on one CUDA device, of one kind, with flash_attn_func's layout rules.
        softmax_lse: [batch, nheads, seqlen_q] float32, contiguous: the LSE from
            flash_attn_func(..., return_attn_probs=True) of the same q, k, v, softmax_scale and causal.
        softmax_scale, causal: as in the forward call (None: headdim ** -0.5).
        deterministic: use a dQ strategy without atomics (bitwise reproducible).
        dq_strategy: "atomic" (fp32 atomics; on the Hopper backward TMA bulk reductions), "seqpar" (a dQ buffer per
            KV tile + reduce; deterministic), "loop" (one block per head walks all KV tiles; deterministic; sm80
            kernels), "ordered" (the Hopper backward without score modifiers: the reductions of each Q tile in
            KV-tile order through a semaphore; deterministic, no extra memory); None picks "atomic", or if
            deterministic "ordered" where it runs, else "seqpar" (falling back to "loop", with a RuntimeWarning,
            when its buffers would take more than half the free memory).
        algorithm: "v2" (default) or "v1" (FlashAttention-1's backward, head dims 32-128).
        warp_partition (V2): "auto" (default: the partition tuned per head dim,
            cuflash._configs.BWD_AUTO_PARTITION), "kv" (warps split the KV rows of a tile; dS^T goes through
            shared memory for dQ), "q" (warps split the Q rows; P and dS go through shared memory for dK, dV; head
            dims as cuflash._configs.BWD_TILES_Q) or "2d" (FlashAttention-2's: 32-row warp tiles in all five
            products, P and dS through shared memory; head dims 32-128, cuflash._configs.BWD_TILES_2D).
        window_size, softcap, alibi_slopes: the forward call's score modifiers (flash_attn_func); V2 only.
        dropout_p, rng_state: the forward call's dropout: its probability and the (seed, offset) its kernels used
            (cuflash.get_rng_state() before a forward on CuPy arrays; required with dropout_p > 0); V2 only.
        backend: the V2 backward's main kernel: "auto" (the default: on a compute capability 9.0 GPU the Hopper
            backward, cuda_src/flash_bwd_sm90.cu, wherever it can take the call -- head dims 40-128, no dropout,
            dq_strategy "atomic" or "seqpar", warp_partition "auto", TMA-aligned views -- else the mma.sync
            kernels), "sm80" (the mma.sync kernels) or "sm90" (ValueError where it cannot run).

    Returns:
        (dq, dk, dv) of the inputs' kind: new contiguous arrays shaped and typed like q, k, v (dk, dv summed over
        the query heads that share a KV head).

    Raises (before anything is launched; messages name the argument):
        TypeError: non-CUDA arrays, mixed kinds, unsupported or mixed dtypes.
        ValueError: shapes, strides or devices that do not match q / the forward's, a softmax_lse that is not
            float32 contiguous [batch, nheads, seqlen_q], an unknown dq_strategy / algorithm / warp_partition /
            backend, dq_strategy="atomic" with deterministic=True, a head dim the partition does not support,
            backend="sm90" where the Hopper backward cannot run.
    """
    if algorithm not in ("v2", "v1"):
        raise ValueError(f"algorithm must be 'v2' or 'v1'; got {algorithm!r}")
    check_backend(backend)
    if backend != "auto" and algorithm != "v2":
        raise ValueError(f"backend={backend!r} selects the V2 backward's kernels; algorithm={algorithm!r} has one path")
    check_warp_partition(warp_partition, algorithm=algorithm)
    check_unsupported(dropout_p, window_size, softcap, alibi_slopes, scores=algorithm != "v1")
    if dropout_p and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state: the (seed, offset) of the forward call "
                         "(cuflash.get_rng_state() before it, for CuPy arrays)")
    if algorithm == "v1":
        from .v1 import backward_from_lse

        return backward_from_lse(*check_backward_inputs(dout, q, k, v, out, softmax_lse), softmax_scale, causal)
    check_softmax_scale(softmax_scale)
    mods = None
    if not is_plain(window_size, softcap, alibi_slopes) or dropout_p:
        qa, ka, _ = check_qkv(q, k, v)
        mods = mods_for(qa, ka, causal, window_size, softcap, alibi_slopes, softmax_scale, dropout_p=dropout_p,
                        rng_state=rng_state)
    return backward_memo(dout, q, k, v, out, softmax_lse, softmax_scale, causal, dq_strategy, deterministic,
                         warp_partition, mods, backend)
