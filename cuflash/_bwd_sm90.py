"""The Hopper backward's host path (cuda_src/flash_bwd_sm90.cu): which calls take it, the tensor maps, the plan.

`backend` as in the forward (cuflash._fwd_sm90): "auto" takes the sm90 backward on a compute-capability-9.0
device whenever the call allows (`ineligible`), else the mma.sync (sm80) kernels; "sm90" and "sm80" force a path
("sm90" on a call it cannot take is a ValueError naming why). Calls the sm90 backward cannot take: head dims
outside SM90_BWD_HEADDIMS' range, dropout, packed sequences, dq_strategy="loop", an explicit warp_partition or
tile (both select sm80 kernels), empty sequences, views whose base or strides are not 16-byte aligned (TMA), and at
the head dims of the column-split kernel (256) dq_strategy="ordered" unless `split_ordered()`.

The main kernel runs one block per (KV tile, KV head, batch), or in its persistent form (`persistent_form`:
cuflash._configs.sm90_bwd_persistent, head dims 64, 128 and 256 up to a key count per head dim and mask) on a 1-d grid
of at most one block per SM (`main_grid`), which without a mask may walk its last waves by stream-K (`stream_k_form`:
cuflash._configs.sm90_bwd_stream_k; its workspace per (device, stream), cuflash._walk).

The plan is the sm80 backward's (cuflash.backward._BwdPlan: preprocess, main, dQ convert with one BwdParams
block and one fp32 workspace) with another main kernel, which takes a second parameter, Sm90BwdMaps: the tensor
maps of q, k, v and dout, and of the outputs dk and dv (one block per tile stores them by TMA). Every kernel is
launched with the same two-entry argument vector, the forward's (cuflash._fwd_sm90._scratch; the preprocess and
convert kernels read only the first entry). A plan keeps the encoded maps of recent pointer sets and of recent
pointers per map (cuflash._fwd_sm90.MapMemo, memo_args).
"""
from __future__ import annotations

import ctypes
from dataclasses import replace

from . import _walk
from ._configs import (DQ_ORDER_HEADS_INNER, DQ_ORDER_PLAIN, MOD_SCORE, SM80_ONLY_MAX_HEADDIM,
                       SM90_BWD_CAP_ONLY_HEADDIMS, SM90_BWD_HEADDIMS, SM90_BWD_SPLIT_ORDERED, kernel_headdim,
                       sm90_bwd_causal_walk, sm90_bwd_m80, sm90_bwd_m80_eligible, sm90_bwd_m80_persistent,
                       sm90_bwd_m80_tile, sm90_bwd_ordered_group, sm90_bwd_ordered_order,
                       sm90_bwd_persist_headdims, sm90_bwd_persist_tile, sm90_bwd_persistent, sm90_bwd_spec,
                       sm90_bwd_stream_k, sm90_bwd_stream_k_eligible, sm90_bwd_stream_k_tile, sm90_bwd_tile,
                       sm90_smem_capped)
from ._fwd_sm90 import MAPS_OFFSET, MAX_MAP_SETS, _scratch, device_cc, memo_args  # noqa: F401 (re-exported)
from ._launch import _MAX_PARAM_BYTES
from ._mods import has_dropout
from ._params import BWD_PARAMS, contiguous_strides
from ._tma import MAP_BYTES, attention_map_spec, tma_compatible

# Sm90BwdMaps (q, k, v, dout, dk, dv) at the forward's offset in the same per-thread parameter buffer
# (_fwd_sm90._scratch)
ARGS_BYTES = 6 * MAP_BYTES
assert BWD_PARAMS.size <= MAPS_OFFSET and MAPS_OFFSET + ARGS_BYTES <= _MAX_PARAM_BYTES
SK_WS_OFFSET = BWD_PARAMS.offsets()["sk_workspace"][0]  # stream-K's workspace pointer, put in per call


def ineligible(da, qa, ka, va, mods=None, packed=None, dq_strategy=None, warp_partition="auto",
               tile=None) -> str | None:
    """Why the sm90 backward cannot take these validated views and options, or None when it can."""
    d = qa.shape[3]
    kd = kernel_headdim(d)
    if d % 8:
        return f"head dim {d} is not a multiple of 8 (TMA reads 16-byte rows; the sm80 UA kernels run it)"
    if kd not in SM90_BWD_HEADDIMS or d <= SM80_ONLY_MAX_HEADDIM:
        return (f"head dim {d} (the sm90 backward runs the multiples of 8 from {SM80_ONLY_MAX_HEADDIM + 8} to "
                f"{SM90_BWD_HEADDIMS[-1]})")
    if has_dropout(mods):
        return "dropout (the mma.sync kernels run it)"
    if sm90_bwd_tile(kd).split and dq_strategy == "ordered" and not split_ordered():
        return (f"dq_strategy='ordered' at head dim {d} (the sm90 backward's head-dim-{kd} kernel takes 'atomic' and "
                "'seqpar'; its 'ordered' turns are not configured: cuflash._bwd_sm90.SPLIT_ORDERED)")
    if packed is not None:
        return "packed sequences (the mma.sync kernels run them)"
    if dq_strategy == "loop":
        return "dq_strategy='loop' (the sm90 backward has 'atomic', 'ordered' and 'seqpar')"
    if warp_partition != "auto" or tile is not None:
        return f"warp_partition={warp_partition!r} / an explicit tile (options of the sm80 kernels)"
    b, sq, h, _ = qa.shape
    if not (b and h and sq and ka.shape[1]):
        return "an empty batch, head count or sequence"
    for name, a in (("q", qa), ("k", ka), ("v", va), ("dout", da)):
        if not tma_compatible(a.shape, a.strides, a.ptr):
            return f"{name}'s base address or strides are not 16-byte aligned (TMA reads 16-byte units)"
    return sm90_smem_capped()


def resolve_backend(backend: str, da, qa, ka, va, mods=None, packed=None, dq_strategy=None, warp_partition="auto",
                    tile=None) -> str:
    """"sm80" or "sm90": the path a validated backward takes (see the module docstring)."""
    if backend == "sm80":
        return "sm80"
    cc = device_cc(qa.device)
    why = ineligible(da, qa, ka, va, mods, packed, dq_strategy, warp_partition, tile)
    if backend == "sm90":
        if cc != 90:
            raise ValueError(f"backend='sm90' needs a compute capability 9.0 GPU; device {qa.device} is sm_{cc}")
        if why:
            raise ValueError(f"backend='sm90' cannot take this backward: {why}")
        return "sm90"
    return "sm90" if cc == 90 and why is None else "sm80"


# "ordered" on the column-split kernel (head dim 256): None, the configuration's (cuflash._configs.
# SM90_BWD_SPLIT_ORDERED); True / False force it on or off (a test or a benchmark; clear cuflash.backward._PLANS)
SPLIT_ORDERED = None


def split_ordered() -> bool:
    """Whether calls at the column-split kernel's head dims take "ordered" (SPLIT_ORDERED, else the configuration)."""
    return SM90_BWD_SPLIT_ORDERED if SPLIT_ORDERED is None else bool(SPLIT_ORDERED)


# The order of dq_strategy="ordered" with the causal mask: None, the configuration's (cuflash._configs.
# sm90_bwd_ordered_order: SM90_BWD_CAUSAL_ORDER, DQ_ORDER_HEADS_INNER with GQA); a diagnostic or a test may force
# DQ_ORDER_KV_DESC, DQ_ORDER_Q_DESC or DQ_ORDER_HEADS_INNER here, and clear cuflash.backward._PLANS
CAUSAL_ORDER = None
# The order of "ordered" without a mask: None, the configuration's (cuflash._configs.sm90_bwd_ordered_order); a
# diagnostic or a test may force DQ_ORDER_PLAIN or DQ_ORDER_ROT (ROT still only where a head's blocks fit the GPU at
# once) here, and clear the plans
PLAIN_ORDER = None
# The dispatch order of the causal "atomic" and "seqpar" kernels: None, cuflash._configs.sm90_bwd_causal_group's; a
# diagnostic or a test may set a group size here (0: the launch's order), and clear cuflash.backward._PLANS
CAUSAL_GROUP = None
# The causal "atomic" / "seqpar" kernels' heads-inner walk (DQ_ORDER_HEADS_INNER): None, cuflash._configs.
# sm90_bwd_causal_walk's choice (with its dispatch group, unless CAUSAL_GROUP is set); True / False force it on or off
# where it can run (one block per tile: a call that would take the persistent form keeps it); a diagnostic or a test;
# clear cuflash.backward._PLANS.
HEADS_INNER = None
# The persistent form (cuflash._configs.sm90_bwd_persistent): None, the configuration's choice (not for causal calls
# while CAUSAL_GROUP is set); True / False force it where it can run (head dims sm90_bwd_persist_headdims(mod), "atomic"
# / "seqpar") or off (a diagnostic or a test; clear cuflash.backward._PLANS). PERSIST_MAX_GRID: None, one block per SM; an int caps the persistent grid (a
# test: a few blocks walk many tiles each).
PERSIST = None
PERSIST_MAX_GRID = None
# Stream-K (cuflash._configs.sm90_bwd_stream_k): None, the configuration's choice (none while PERSIST is False); True /
# False force it where it can run (sm90_bwd_stream_k_eligible, "atomic" / "seqpar": the persistent form then too) or off.
STREAM_K = None
# The modifier kernels' CAP_ONLY form (cuflash._configs.SM90_BWD_CAP_ONLY_HEADDIMS): None, the configuration's choice;
# True / False force it on or off for the calls with score modifiers at the kernel head dims of 128-key tiles (in the
# persistent form, for soft-capped calls only; a diagnostic or a test; clear cuflash.backward._PLANS).
CAP_ONLY = None
# The 80-row Q tiles (cuflash._configs.SM90_BWD_M80_SEQLEN_K): None, the configuration's choice; True / False force them
# on or off where they can run (sm90_bwd_m80_eligible: head dim 128 without a mask, "atomic" / "seqpar"; one block
# per tile or persistent, in place of the 64-row tile's persistent and stream-K forms; a diagnostic or a test; clear
# cuflash.backward._PLANS). While PERSIST or STREAM_K is forced, the configuration's choice is the 64-row tile's forms;
# with M80 forced, PERSIST chooses between the 80-row tile's two forms (None: the configuration,
# cuflash._configs.SM90_BWD_M80_PERSIST_SEQLEN_K).
M80 = None


def cap_only_form(d, mod) -> bool:
    """Whether a call of kernel head dim d with modifier bits `mod` takes the modifier kernel's CAP_ONLY form
    (CAP_ONLY, else the configuration)."""
    if mod != MOD_SCORE or sm90_bwd_tile(d).split:
        return False
    return d in SM90_BWD_CAP_ONLY_HEADDIMS if CAP_ONLY is None else bool(CAP_ONLY)


def persistent_form(d, causal, mod, strategy, seqlen_k, softcap=False) -> bool:
    """Whether the main kernel of a call of kernel head dim d takes the persistent form (PERSIST, else the
    configuration; softcap: whether the call's soft-cap is on)."""
    if strategy not in ("atomic", "seqpar") or seqlen_k is None:
        return False
    if d not in sm90_bwd_persist_headdims(mod):
        return False
    if PERSIST is None and causal and CAUSAL_GROUP is not None:  # a dispatch order asked for: one block per tile
        return False
    if PERSIST is not None:
        return bool(PERSIST)
    if softcap and not cap_only_form(d, mod):  # (soft-capped calls are configured in the persistent CAP_ONLY form)
        return False
    return sm90_bwd_persistent(d, causal, mod, DQ_ORDER_PLAIN, seqlen_k, softcap)


def m80_form(d, causal, mod, strategy, seqlen_k) -> bool:
    """Whether the main kernel of a call takes the 80-row Q tiles (M80, else the configuration -- not while PERSIST or
    STREAM_K is forced, which choose among the 64-row tile's forms); m80_persistent says in which form."""
    if not sm90_bwd_m80_eligible(d, causal, mod, strategy, seqlen_k):
        return False
    if M80 is None:
        return PERSIST is None and STREAM_K is None and sm90_bwd_m80(d, causal, mod, strategy, seqlen_k)
    return bool(M80)


def m80_persistent(d, seqlen_k) -> bool:
    """Whether a call that takes the 80-row Q tiles (m80_form) runs their persistent form (PERSIST, else the
    configuration)."""
    return sm90_bwd_m80_persistent(d, seqlen_k) if PERSIST is None else bool(PERSIST)


def stream_k_form(d, causal, mod, strategy, seqlen_k, tiles, grid, iters) -> bool:
    """Whether the main kernel of a call takes the stream-K form (STREAM_K, else the configuration) on a persistent
    grid of `grid` blocks over `tiles` tiles of `iters` iterations."""
    if strategy not in ("atomic", "seqpar") or not sm90_bwd_stream_k_eligible(d, causal, mod, seqlen_k, tiles, grid,
                                                                                iters):
        return False
    if STREAM_K is None:
        return PERSIST is not False and sm90_bwd_stream_k(d, causal, mod, seqlen_k, tiles, grid, iters)
    return bool(STREAM_K)


def main_grid(persistent, n_blocks, kv_heads, batch, device):
    """The main kernel's grid: (KV tiles, KV heads, batch), or for the persistent form at most one block per SM."""
    if not persistent:
        return (n_blocks, kv_heads, batch)
    from ._launch import sm_count

    g = min(n_blocks * kv_heads * batch, sm_count(device))
    return (g if PERSIST_MAX_GRID is None else max(1, min(g, PERSIST_MAX_GRID)), 1, 1)


def main_launch(da, qa, ka, va, causal, mod, strategy=None, seqlen_k=None, softcap=False):
    """(KernelSpec of the main kernel, its Sm90BwdTile, the (q, k, v, dout, dk, dv) TensorMapSpecs, persistent, the
    stream-K workspace's bytes or 0) of an eligible call; strategy: the dQ strategy's name ("ordered": the kernel of
    sm90_bwd_ordered_order's order, CAUSAL_ORDER / PLAIN_ORDER); seqlen_k: the keys per sequence (None: packed
    sequences), which the dispatch order's and the persistent and stream-K forms' choices read; softcap: whether the
    soft-cap is on (the persistent modifier form has its own key limit then, SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K, and
    runs in the CAP_ONLY form)."""
    from ._launch import sm_count

    d = kernel_headdim(qa.shape[3])
    tile = sm90_bwd_tile(d)
    hk, b = ka.shape[2], ka.shape[0]
    heads = qa.shape[2] // hk  # query heads per KV head
    n_blocks = -(-seqlen_k // tile.block_n) if seqlen_k is not None else 0  # KV tiles per sequence (fixed lengths)
    order = DQ_ORDER_PLAIN
    # (without a mask, fixed lengths only: ROT's turns count the grid's KV tiles, every sequence's)
    if strategy == "ordered" and (causal or seqlen_k is not None):
        order = sm90_bwd_ordered_order(causal, mod, n_blocks, sm_count(qa.device), d, heads, PLAIN_ORDER,
                                       CAUSAL_ORDER)
    group = 0
    if causal and not mod and strategy == "ordered":  # (on the heads-inner walk, "atomic"'s dispatch order there)
        group = sm90_bwd_ordered_group(order, d, seqlen_k, heads, n_blocks * hk * b, sm_count(qa.device))
    if causal and not mod and order == DQ_ORDER_PLAIN and strategy != "ordered":
        walk, group = sm90_bwd_causal_walk(d, seqlen_k, heads, n_blocks * hk * b, sm_count(qa.device))
        if CAUSAL_GROUP is not None:
            group = CAUSAL_GROUP
        if HEADS_INNER is not None:
            walk = DQ_ORDER_HEADS_INNER if HEADS_INNER else DQ_ORDER_PLAIN
        order = walk
    persistent = persistent_form(d, causal, mod, strategy, seqlen_k, softcap)
    sk = 0
    if seqlen_k is not None:
        grid = main_grid(True, n_blocks, hk, b, qa.device)[0]
        iters = heads * -(-qa.shape[1] // tile.block_m)  # (query head, Q tile) pairs of a tile (no mask)
        if stream_k_form(d, causal, mod, strategy, seqlen_k, n_blocks * hk * b, grid, iters):
            persistent, sk = True, _walk.bwd_sk_bytes(grid, d, tile.split)
    if persistent:  # (its static walk balances the causal tiles in the launch's order, not in the grouped one)
        tile, group, order = sm90_bwd_stream_k_tile(d) if sk else sm90_bwd_persist_tile(d), 0, DQ_ORDER_PLAIN
    if m80_form(d, causal, mod, strategy, seqlen_k):  # (in place of the 64-row tile's persistent and stream-K forms)
        persistent, sk = m80_persistent(d, seqlen_k), 0
        tile = sm90_bwd_m80_tile(d, persistent)
    # CAP_ONLY: one block per tile wherever it is configured; in the persistent form for soft-capped calls only (the
    # persistent modifier kernel without the soft-cap is configured as measured, in the band form; stream-K has no
    # modifiers)
    if cap_only_form(d, mod) and (not persistent or softcap):
        tile = replace(tile, cap_only=True)
    spec = sm90_bwd_spec(qa.dtype, d, causal, tile, mod, order, group)
    out = contiguous_strides(ka.shape)  # dk, dv: the plan's contiguous outputs of k's shape
    maps = (attention_map_spec(qa.dtype, qa.shape, qa.strides, tile.block_m),
            attention_map_spec(ka.dtype, ka.shape, ka.strides, tile.block_n),
            attention_map_spec(va.dtype, va.shape, va.strides, tile.block_n),
            attention_map_spec(da.dtype, da.shape, da.strides, tile.block_m),
            attention_map_spec(ka.dtype, ka.shape, out, tile.block_n),
            attention_map_spec(va.dtype, va.shape, out, tile.block_n))
    return spec, tile, maps, persistent, sk


def run_plan(plan, dp, qp, kp, vp, op, lp):
    """One call of a cuflash.backward._BwdPlan whose main kernel is the sm90 one (plan.maps set): (dq, dk, dv). A
    stream-K plan (plan.sk: its workspace's bytes) puts in the stream's workspace (cuflash._walk.sk_workspace: none
    while the stream is captured, and the kernel then walks whole tiles)."""
    (dq, dk, dv, _), (dqp, dkp, dvp, w), stream = plan.outs()
    o_lse, o_delta, o_acc = plan.ws_off
    mb = memo_args(plan.encoded, plan.maps, (qp, kp, vp, dp, dkp, dvp))
    buf, base, argv, _ = _scratch()
    plan.pack(buf, 0, qp, kp, vp, op, dp, lp, w + o_lse, w + o_delta, w + o_acc, dqp, dkp, dvp, *plan.rest)
    if plan.sk:
        _walk.put_ptr(buf, SK_WS_OFFSET, _walk.sk_workspace(plan.device, stream, plan.sk))
    ctypes.memmove(base + MAPS_OFFSET, mb, ARGS_BYTES)
    plan.launch_packed(stream, argv)
    return dq, dk, dv
