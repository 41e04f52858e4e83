"""The Hopper forward's host path (cuda_src/flash_fwd_sm90.cu): which calls it takes, the tensor maps, the launch.

`backend` (flash_attn_func's keyword): "auto" takes the sm90 kernels on a compute-capability-9.0 device whenever
the inputs allow (`ineligible`), else the mma.sync (sm80) kernels; "sm90" and "sm80" force a path ("sm90" on an
input it cannot take is a ValueError naming why). Inputs the sm90 kernels cannot take: head dims other than
SM90_HEADDIMS, single-query GQA decoding (the sm80 kernel folds the query heads of a KV head into one tile),
empty sequences, and views whose base or strides are not 16-byte aligned (TMA reads 16-byte units): those run
on the sm80 kernels, read in place, never copied.

The kernel takes two parameters: the FwdParams block (the same fields as the sm80 forward, the same grid) and
Sm90FwdMaps: the three 128-byte tensor maps (cuflash._tma), which embed the base addresses. A memoized plan keeps the
encoded maps of recent pointers (MapMemo): each pointer set's bytes (a repeated call -- a benchmark loop, a
static-buffer inference step -- is one look-up and encodes nothing) and each map's bytes by its own pointer, so a
set that shares pointers with recent ones encodes only the maps of its new pointers (one cuTensorMapEncodeTiled
each): the layers of a model call one plan with their own tensors, more sets than the first memo holds, and their
pointers recur from step to step. A tile with `o_tma` (the TMA-store epilogue, the configured tiles') takes O's
map as a fourth (Sm90FwdMapsO): a call whose output lands at a new address encodes that map alone.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import replace

from . import _interop, _walk
from ._fwd_grid import GRID_ORDERS, _grid, folds_gqa, outputs, resolve_grid_order
from ._configs import (MOD_SCORE, SM80_ONLY_MAX_HEADDIM, SM90_HEADDIMS, kernel_headdim, sm90_fwd_mod_tile,
                       sm90_fwd_spec, sm90_fwd_stream_k_auto, sm90_fwd_tile, sm90_persist_dynamic, sm90_persist_walk,
                       sm90_smem_capped, stream_k_eligible, stream_k_max_kv)
from ._launch import _MAX_PARAM_BYTES, get_launcher, sm_count
from ._mods import MOD_NONE, has_right_edge, kernel_mode, mod_fields
from ._params import FWD_PARAMS, NO_CACHE, NO_WALK, contiguous_strides
from ._plan import HostPlan
from ._tma import MAP_BYTES, attention_map_spec, tma_compatible

BACKENDS = ("auto", "sm80", "sm90")
MAPS_OFFSET = 512  # byte offset of Sm90FwdMaps in the parameter buffer (64-byte aligned, past FwdParams)
ARGS_BYTES = 3 * MAP_BYTES  # the maps of q, k, v
O_ARGS_BYTES = 4 * MAP_BYTES  # and of o (a tile with o_tma: Sm90FwdMapsO)
MAX_MAP_SETS = 64  # encoded pointer sets ((q, k, v[, o]) map bytes) a plan keeps
MAX_MAPS = 512  # encoded single maps a plan keeps (by map and pointer)
assert FWD_PARAMS.size <= MAPS_OFFSET and MAPS_OFFSET + O_ARGS_BYTES <= _MAX_PARAM_BYTES

_tls = threading.local()
_cc: dict = {}


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")


def device_cc(device_id: int) -> int:
    cc = _cc.get(device_id)
    if cc is None:
        from ._loader import device_cc as _device_cc

        cc = _cc[device_id] = _device_cc(device_id)
    return cc


def ineligible(qa, ka, va, mods=None, packed=None) -> str | None:
    """Why the sm90 kernels cannot take these validated views, or None when they can. With score modifiers
    (`mods` of MOD_SCORE) single-query GQA is eligible: the sm80 kernels do not fold the heads into rows then
    either."""
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    if d % 8:
        return f"head dim {d} is not a multiple of 8 (TMA reads 16-byte rows; the sm80 UA kernels run it)"
    if kernel_headdim(d, SM90_HEADDIMS) is None or d <= SM80_ONLY_MAX_HEADDIM:
        return (f"head dim {d} (the sm90 forward runs the multiples of 8 from {SM80_ONLY_MAX_HEADDIM + 8} to "
                f"{SM90_HEADDIMS[-1]}; the sm80 kernels have head dim {SM80_ONLY_MAX_HEADDIM} itself)")
    if packed is None and folds_gqa(sq, h, hk, kernel_mode(mods, False)[1]):
        return "single-query GQA/MQA decoding (the sm80 kernel folds the query heads of a KV head into one tile)"
    if not (b and h and sq and sk):
        return "an empty batch, head count or sequence"
    for name, a in (("q", qa), ("k", ka), ("v", va)):
        if not tma_compatible(a.shape, a.strides, a.ptr):
            return f"{name}'s base address or strides are not 16-byte aligned (TMA reads 16-byte units)"
    return sm90_smem_capped()


def resolve_backend(backend: str, qa, ka, va, mods=None, packed=None) -> str:
    """"sm80" or "sm90": the path a validated call takes (see the module docstring)."""
    if backend == "sm80":
        return "sm80"
    cc = device_cc(qa.device)
    if backend == "sm90":
        if cc != 90:
            raise ValueError(f"backend='sm90' needs a compute capability 9.0 GPU; device {qa.device} is sm_{cc}")
        why = ineligible(qa, ka, va, mods, packed)
        if why:
            raise ValueError(f"backend='sm90' cannot take this input: {why}")
        return "sm90"
    return "sm90" if cc == 90 and ineligible(qa, ka, va, mods, packed) is None else "sm80"


def launch_setup(qa, ka, va, softmax_scale, causal, grid_order, o_strides, tile=None, mods=None, packed=None,
                 o_ptr=0):
    """(launcher, grid, FwdParams fields less pointers, (q, k, v) TensorMapSpecs -- and o's with a tile of o_tma) of a
    validated, eligible call; `tile` (a cuflash._configs.Sm90FwdTile) overrides the configured one (benchmark
    sweeps); mods: the score modifiers (cuflash._mods.Mods) or None. An output (o_strides, o_ptr) no tensor map can
    describe takes the tile without o_tma. Calls of fixed lengths with the score modifiers (no dropout) take their
    persistent form where cuflash._configs.SM90_FWD_MOD_PERSIST names it. A persistent tile with dropout is a
    ValueError (the persistent form has none); with the score modifiers it walks as under a causal mask where the
    band has a right edge (the kernel takes their tiles heaviest first) and never by stream-K."""
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    hd, d = d, kernel_headdim(d, SM90_HEADDIMS)  # the maps' columns past hd read as zeros (TMA out of bounds)
    causal, mod = kernel_mode(mods, causal)
    band = mod_band(mods, sq)
    if tile is None:
        tile = sm90_fwd_tile(d, causal, packed.max_k if packed is not None else sk, mod)
        if mod == MOD_SCORE and packed is None:  # the modifier kernels' persistent form where configured
            tile = sm90_fwd_mod_tile(d, sk, band) or tile
    o_shape = (qa.shape[0], sq, h, hd)
    if tile.o_tma and not tma_compatible(o_shape, (*o_strides, 1), o_ptr):
        tile = replace(tile, o_tma=False)
    m_blocks = -(-sq // tile.block_m)
    walk = NO_WALK
    if not tile.persistent:
        grid_order = resolve_grid_order(grid_order, causal, sq, d)
    else:  # the persistent form's tile walk (Sm90FwdTiles; packed sequences keep the element order)
        walk, grid_order = persist_walk(grid_order, causal, packed, b, h, hk, sq, sk, d, tile, m_blocks, qa.device,
                                        band)
        if walk["walk_slot"] == _walk.STREAM_K:  # (stream-K's code in a kernel of its own: the tile's SK form)
            tile = replace(tile, stream_k=True)
    lau = get_launcher(sm90_fwd_spec(qa.dtype, d, causal, tile, mod), qa.device)
    order, grid = _grid(GRID_ORDERS[grid_order], m_blocks, h, b, 1)
    osb, osq, osh = o_strides
    fields = dict(
        q_batch_stride=qa.strides[0], q_row_stride=qa.strides[1], q_head_stride=qa.strides[2],
        k_batch_stride=ka.strides[0], k_row_stride=ka.strides[1], k_head_stride=ka.strides[2],
        v_batch_stride=va.strides[0], v_row_stride=va.strides[1], v_head_stride=va.strides[2],
        o_batch_stride=osb, o_row_stride=osq, o_head_stride=osh,
        batch=b, nheads=h, heads_per_kv=h // hk, seqlen_q=sq, seqlen_k=sk, num_splits=1, seqlen_k_new=0,
        grid_order=order, **mod_fields(mods, softmax_scale, hd), **walk,
    )
    if packed is not None:  # the maps see [1, total, heads, d] (cuda_src/flash_fwd_sm90.cu)
        grid = packed.grid(tile.block_m, h)
        packed.patch(fields)
    if tile.persistent:
        grid = persistent_grid(grid, tile, qa.device)
    maps = (attention_map_spec(qa.dtype, qa.shape, qa.strides, tile.block_m),
            attention_map_spec(ka.dtype, ka.shape, ka.strides, tile.block_n),
            attention_map_spec(va.dtype, va.shape, va.strides, tile.block_n))
    if tile.o_tma:  # boxes of one consumer warpgroup's 64 rows
        maps += (attention_map_spec(qa.dtype, o_shape, (*o_strides, 1), 64),)
    return lau, grid, fields, maps


def mod_band(mods, seqlen_q: int) -> str | None:
    """How the modifier kernels' band shapes a persistent walk: None without modifiers, "causal" where it has a right
    edge inside the rows (row i sees no key past i + diag + right: the later rows see more, as under a causal mask),
    else "flat"."""
    if mods is None or mods.mod == MOD_NONE:
        return None
    return "causal" if has_right_edge(mods, seqlen_q) else "flat"


def persist_walk(grid_order, causal, packed, b, h, hk, sq, sk, d, tile, m_blocks, device, band=None) -> tuple:
    """(the walk's FwdParams fields, the one-tile grid order) of a persistent launch. "qtile" and "bh" walk in fixed
    waves with groups of 1 and of every (batch, head); "auto" walks by stream-K where it can run and
    cuflash._configs.sm90_fwd_stream_k_auto takes it, else takes the dynamic walk where sm90_persist_dynamic names a
    group (walk_slot _walk.DYNAMIC: the caller puts the launch's slot there), else sm90_persist_walk's fixed one;
    "dynamic" (diagnostics) takes it with that function's group, or every (batch, head) where it names none; "stream_k"
    (diagnostics, cuflash._configs.SM90_SK_MAX_GRID's note) takes stream-K wherever it can run (walk_slot
    _walk.STREAM_K: the caller puts the workspace in o_accum). Packed sequences walk "qtile" in fixed waves. band:
    mod_band's (the modifier kernels: no stream-K; the models as under a causal mask where it is "causal")."""
    if packed is not None:
        return dict(walk_group=1, walk_slot=-1), "qtile"
    bhs = b * h
    if band is not None:
        causal = band == "causal"
    if grid_order in ("auto", "dynamic", "stream_k"):
        g = persistent_grid((m_blocks * bhs, 1, 1), tile, device)[0]
        sk_ok = band is None and stream_k_eligible(bool(causal), False, m_blocks * bhs, -(-sk // tile.block_n), g)
        if grid_order == "stream_k" and not sk_ok:
            raise ValueError("grid_order 'stream_k' needs a persistent launch without a mask or score modifier whose "
                             "tiles leave the last wave part empty")
        if grid_order == "stream_k" or (grid_order == "auto" and sk_ok
                                        and sm90_fwd_stream_k_auto(d, sq, sk, tile.block_m)):
            return dict(walk_group=1, walk_slot=_walk.STREAM_K), "qtile"
        fixed = sm90_persist_walk(causal, bhs, sq, sk, tile, g)
        group = sm90_persist_dynamic(bhs, h // hk, sq, sk, d, tile.block_m, tile.block_n, g, fixed, bool(causal))
        if grid_order == "dynamic":
            return dict(walk_group=group or bhs, walk_slot=_walk.DYNAMIC), "qtile"
        if group:
            return dict(walk_group=group, walk_slot=_walk.DYNAMIC), "qtile"
        grid_order = fixed
    return dict(walk_group=bhs if grid_order == "bh" else 1, walk_slot=-1), grid_order


def persistent_grid(grid, tile, device: int) -> tuple:
    """The persistent form's grid (a tile with `persistent`): at most min_blocks blocks per SM, one per Q tile of the
    one-tile grid `grid` at most (the kernel walks the tiles: Sm90FwdTiles in cuda_src/flash_fwd_sm90.cu)."""
    tiles = grid[0] * grid[1] * grid[2]
    return (max(1, min(tiles, sm_count(device) * tile.min_blocks)), 1, 1)


def sk_bytes(lau, grid, headdim: int) -> int:
    """Stream-K's workspace for a launch of `lau` (1 + nwg warpgroups) on `grid` at a call's head dim."""
    return _walk.sk_bytes(grid[0], lau.threads // 128 - 1, kernel_headdim(headdim, SM90_HEADDIMS))


def encode_args(maps, *ptrs: int) -> bytes:
    """The maps' bytes at these base addresses, in order (Sm90FwdMaps: q, k, v; Sm90FwdMapsO: q, k, v, o; the
    backward's Sm90BwdMaps: q, k, v, dout); pointers past the maps' count are ignored."""
    return b"".join(m.encode(ptr) for m, ptr in zip(maps, ptrs))


class MapMemo:
    """A plan's encoded tensor maps at recent base addresses: `sets`, each pointer set's bytes (at most
    MAX_MAP_SETS), and under it `each`, each map's bytes by (map, pointer) (at most MAX_MAPS); each dict is
    cleared when full."""

    __slots__ = ("sets", "each")

    def __init__(self):
        self.sets, self.each = {}, {}

    def get(self, key):
        return self.sets.get(key)

    def encode(self, maps, ptrs: tuple, key) -> bytes:
        """The set's bytes, encoding only the maps whose (map, pointer) is not kept (cuTensorMapEncodeTiled)."""
        each, parts = self.each, []
        for m, ptr in zip(maps, ptrs):
            b = each.get((m, ptr))
            if b is None:
                if len(each) >= MAX_MAPS:
                    each.clear()
                b = each[(m, ptr)] = m.encode(ptr)
            parts.append(b)
        if len(self.sets) >= MAX_MAP_SETS:
            self.sets.clear()
        mb = self.sets[key] = b"".join(parts)
        return mb


def memo_args(encoded: MapMemo, maps, ptrs: tuple, key=None) -> bytes:
    """encode_args of a plan's maps at `ptrs`, from its MapMemo (a repeated call encodes nothing; a set whose
    pointers were seen in other sets encodes only the new ones); `key` (default: ptrs) names the set when the maps
    themselves vary."""
    key = ptrs if key is None else key
    mb = encoded.sets.get(key)
    return mb if mb is not None else encoded.encode(maps, ptrs, key)


def _scratch():
    """This thread's parameter buffer and an argv of two entries: the parameter block (FwdParams, or the
    backward's BwdParams) at 0, the maps at MAPS_OFFSET."""
    s = getattr(_tls, "s", None)
    if s is None:
        buf = ctypes.create_string_buffer(_MAX_PARAM_BYTES)
        base = ctypes.addressof(buf)
        argv = (ctypes.c_void_p * 2)(base, base + MAPS_OFFSET)
        s = _tls.s = (buf, base, ctypes.addressof(argv), argv)
    return s


def _launch(fn, grid, threads, smem, stream, pack, maps_bytes, device, *values):
    buf, base, argv, _ = _scratch()
    pack(buf, 0, *values)
    ctypes.memmove(base + MAPS_OFFSET, maps_bytes, len(maps_bytes))
    _interop.ensure_context()
    with _interop.device_guard(device):
        from cupy.cuda import driver

        driver.launchKernel(fn, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream, argv, 0)


def forward(qa, ka, va, softmax_scale, causal, grid_order="auto", out=None, lse=None, tile=None, mods=None,
            packed=None):
    """The sm90 forward of validated, eligible views (no memo: autograd, explicit calls, tile sweeps); returns
    (out, lse). packed: as cuflash._fwd.forward's."""
    from ._validate import check_softmax_scale

    check_softmax_scale(softmax_scale)
    out, lse, o_strides = outputs(qa, out, lse, packed)
    op, lp = _interop.data_ptr(out), _interop.data_ptr(lse)
    lau, grid, fields, maps = launch_setup(qa, ka, va, softmax_scale, causal, grid_order, o_strides, tile, mods,
                                           packed, op)
    cu = packed.pointers() if packed is not None else dict(cu_seqlens_q=0, cu_seqlens_k=0)
    stream = _interop.current_stream(qa)
    oa = 0
    if fields["walk_slot"] == _walk.DYNAMIC:
        fields["walk_slot"] = _walk.slot(qa.device, stream)
    elif fields["walk_slot"] == _walk.STREAM_K:
        fields["walk_slot"] = -1
        oa = _walk.sk_workspace(qa.device, stream, sk_bytes(lau, grid, qa.shape[3]))
    values = FWD_PARAMS.values(q=qa.ptr, k=ka.ptr, v=va.ptr, o=op, lse=lp, o_accum=oa, lse_accum=0, **NO_CACHE,
                               **cu, **fields)
    _launch(lau.ptr, grid, lau.threads, lau.smem, stream, FWD_PARAMS.struct.pack_into,
            encode_args(maps, qa.ptr, ka.ptr, va.ptr, op), qa.device, *values)
    return out, lse


class Sm90Plan(HostPlan):
    """A memoized sm90 forward (see cuflash._fwd._FwdPlan): the maps of recent pointer triples are kept; `run_kv`
    runs it at another key count (k and v's maps then follow the call's shape and strides). With o_tma the maps
    are keyed by the output's pointer too."""

    __slots__ = ("outs", "maps", "encoded", "kv", "kv_maps", "o_tma", "walk", "sk")

    def put_walk(self, buf, stream, seqlen_k=None):
        """The per-call part of the walk: the dynamic walk's counter slot (the stream's, or a captured launch's own),
        or stream-K's workspace (`sk`: (bytes, block_n, largest key count the segment arithmetic takes); none at a key
        count past it, or while the stream is captured: fixed waves)."""
        if self.walk:
            _walk.put_slot(buf, _walk.SLOT_OFFSET, _walk.slot(self.device, stream))
        elif self.sk and (seqlen_k is None or 0 < seqlen_k <= self.sk[2]):
            _walk.put_ptr(buf, _walk.O_ACCUM_OFFSET, _walk.sk_workspace(self.device, stream, self.sk[0]))

    def run(self, qp, kp, vp):
        (out, lse), (op, lp), stream = self.outs()
        mb = memo_args(self.encoded, self.maps, (qp, kp, vp, op) if self.o_tma else (qp, kp, vp))
        buf, base, argv, _ = _scratch()
        self.pack(buf, 0, qp, kp, vp, op, lp, *self.rest)
        self.put_walk(buf, stream)
        ctypes.memmove(base + MAPS_OFFSET, mb, len(mb))
        self.launch_packed(stream, argv)
        return out, lse

    def run_kv(self, qp, kp, vp, kshape, ks, vs):
        """run with k, v of shape kshape (the plan's but for the key count) and element strides ks, vs."""
        (out, lse), (op, lp), stream = self.outs()
        ptrs = (qp, kp, vp, op) if self.o_tma else (qp, kp, vp)
        mb = self.encoded.get((*ptrs, kshape, ks, vs))
        if mb is None:  # the maps launch_setup makes of such k, v: made once for the layers of a step, then encoded
            shape = (kshape, ks, vs)
            maps = self.kv_maps.get(shape)
            if maps is None:
                qm, km, _, *om = self.maps
                if len(self.kv_maps) >= MAX_MAP_SETS:
                    self.kv_maps.clear()
                maps = self.kv_maps[shape] = (qm, attention_map_spec(km.dtype, kshape, ks, km.box[1]),
                                              attention_map_spec(km.dtype, kshape, vs, km.box[1]), *om)
            mb = memo_args(self.encoded, maps, ptrs, (*ptrs, kshape, ks, vs))
        buf, base, argv, _ = _scratch()
        self.kv.pack(self, buf, qp, kp, vp, op, lp, kshape[1], ks, vs)
        self.put_walk(buf, stream, kshape[1])
        ctypes.memmove(base + MAPS_OFFSET, mb, len(mb))
        self.launch_packed(stream, argv)
        return out, lse


def make_plan(qa, ka, va, softmax_scale, causal, grid_order, mods=None, tile=None) -> Sm90Plan:
    """The memoized forward (cuflash._fwd._make_plan's sm90 branch); `tile` overrides the configured one
    (diagnostics time a variant through the same memoized calls)."""
    b, sq, h, d = qa.shape
    lau, grid, fields, maps = launch_setup(qa, ka, va, softmax_scale, causal, grid_order,
                                           contiguous_strides(qa.shape)[:3], tile=tile, mods=mods)
    p = Sm90Plan(qa)
    p.walk = fields["walk_slot"] == _walk.DYNAMIC  # (its slot put in per call: Sm90Plan.run)
    p.sk = None
    if fields["walk_slot"] == _walk.STREAM_K:  # (its workspace put in per call)
        block_m, block_n = maps[0].box[1], maps[1].box[1]
        p.sk = (sk_bytes(lau, grid, d), block_n, stream_k_max_kv(-(-sq // block_m) * b * h, grid[0]) * block_n)
    p.bind(FWD_PARAMS, ("q", "k", "v", "o", "lse"), o_accum=0, lse_accum=0, cu_seqlens_q=0, cu_seqlens_k=0,
           **NO_CACHE, **dict(fields, walk_slot=-1))
    p.add_launch(lau, grid)
    p.maps, p.encoded, p.kv_maps, p.o_tma = maps, MapMemo(), {}, len(maps) == 4
    p.outs = p.allocator(p.spec((b, sq, h, d)), p.spec((b, h, sq), float32=True))
    return p
