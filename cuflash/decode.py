"""Flash-Decoding: attention of a few new queries against a KV cache, split across thread blocks.

For decoding (seqlen_q = 1, or a few tokens for speculative decoding), batch x heads is far too few thread
blocks to fill the GPU, so the key range is split across blocks too: each block computes a partial output
and its LSE in fp32 over its share of the keys, and a combine kernel re-scales the partials by
exp(LSE_split - LSE_total) and sums them.

Two kernels (keyword `kernel`):
* "decode" (default): cuda_src/flash_decode.cu, built for 1..32 query rows per (batch, KV head): every
  warp holds all rows and streams its own keys through a private cp.async ring (no block barrier in the
  KV loop), the warps' (m, l, O) are merged once through shared memory. One split writes the output
  directly (one launch); more write fp32 partials for a combine kernel that issues every split's loads at once:
  flash_decode_combine_rows_kernel (one warp per output row) for at most combine_rows_max_splits(head dim)
  splits (16 at head dims up to 128, its wide form past 8; 8 at 256), flash_decode_combine_kernel (one block per
  output row) for more (`plan_for(..., combine=...)` forces one, or the split-KV forward's flash_combine_kernel,
  "warp", for comparison).
* "fwd_split": the prefill kernel cut into KV splits (cuda_src/flash_fwd.cu, SPLIT=true), kept for
  comparison (bench/bench_decode.py).

CUDA-graph friendly: the split count is chosen from static shapes only (never from the values in
cache_seqlens), nothing is read back to the host, and scratch memory comes from the caller's allocator
(torch's caching allocator, which serves graph captures from the graph's private pool) or from `scratch`.

Host path. A decoding step is a few microseconds of GPU work, so the Python around the launch matters:
everything that depends only on (dtype, shapes, strides, devices, the scalar arguments) is computed once
into a `_Plan` memoized in a dict keyed by a tuple of those; a call then reads the pointers, checks their
16-byte alignment, allocates the output (and one scratch buffer when split), packs one parameter block
and launches (the combine kernel reads the same block).

Programmatic Dependent Launch (sm_90, cuflash/_launch.py; CUFLASH_PDL=0 turns it off): the combine is launched as
the split kernel's dependent and, with k / v appended, the decode kernel as the append kernel's, so each may be
scheduled before the kernel ahead of it drains (each waits for it on the device before reading what it wrote);
`plan.pdl` says whether a plan does.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple, Union

from . import _interop, _launch
from ._configs import (COMBINE_ROWS_WARPS, DECODE_MAX_MF, DECODE_MAX_SPLITS, SMALL_SMEM_PER_BLOCK,
                       DECODE_DEEP_TILES, DECODE_WIDE_TILES, DecodeTile, append_spec, decode_smem_bytes,
                       combine_rows_max_splits, combine_spec, decode_combine_rows_spec, decode_combine_spec, decode_mf,
                       decode_spec, decode_tile, decode_ua_tile, fit_decode_tile, fit_fwd_tile, fwd_smem_bytes,
                       kernel_headdim, split_tile, unaligned)
from ._fwd import folds_gqa, forward
from ._interop import desc as _desc, get_device as _get_device
from ._launch import _props, _smem_cap, get_launcher, sm_count, smem_per_block, smem_per_sm
from ._mods import kernel_mode, memo_key, mod_fields, mods_for, score_mods
from ._params import APPEND_ARGS, FWD_PARAMS, NO_WALK, stride_fields
from ._plan import HostPlan, remember
from ._validate import (check_backward_headdim, check_block_table, check_bool, check_dtype, check_int_vector,
                        check_layout, check_qkv_views, check_rank, check_same,
                        check_softmax_scale, check_unsupported)

MAX_SPLITS = DECODE_MAX_SPLITS  # the decode combine's shared weights and unrolled loads hold this many
# the decode kernel's combine: "auto" (the default: "rows" up to combine_rows_max_splits splits, else "block"),
# "rows" flash_decode_combine_rows_kernel, "block" flash_decode_combine_kernel, "warp" flash_combine_kernel
COMBINES = ("auto", "rows", "block", "warp")
WAVE_EFFICIENCY = 0.95  # num_splits_heuristic: fraction of the best wave efficiency to settle for
CHAIN_SLACK = 0.05  # shortest_chain_splits: how much longer than the shortest chain the fewest splits may be
SPLIT_RULES = ("chain", "waves", "waves_untrimmed")  # decode_num_splits
MF1_MAX_ROUNDS = 8  # decode_auto_mf: the longest split (block rounds of keys) that takes one row fragment per block
DEEP_MAX_ROUNDS = 8  # decode_auto_tile: the most block rounds of keys per block that take DECODE_DEEP_TILES' tile
APPEND_FORMAT = APPEND_ARGS.format
KERNELS = ("decode", "fwd_split")
_MAX_GRID_X = 2 ** 31 - 1
_NO_WINDOW = (-1, -1)


# ------------------------------------------------------------------------------------- device facts
# _props, sm_count, smem_per_sm: cuflash._launch (the Hopper forward's persistent grid reads them too)


def decode_slots(device: int, smem_bytes: int) -> int:
    """Thread blocks of the old split-KV kernel the GPU runs at once (shared memory bounds the occupancy)."""
    return sm_count(device) * max(1, smem_per_sm(device) // max(smem_bytes, 1))


def resident_blocks(smem: int, threads: int, regs: int = 0, *, smem_per_sm: int, max_threads_per_sm: int = 2048,
                    regs_per_sm: int = 65536, reserved_smem: int = 1024, max_blocks: int = 32) -> int:
    """Blocks of one kernel an SM holds at once, from its shared memory (plus the per-block reservation),
    threads and registers (allocated per warp in units of 256): the occupancy calculator's rule."""
    by_smem = smem_per_sm // (smem + reserved_smem)
    by_threads = max_threads_per_sm // threads
    warps = -(-threads // 32)
    by_regs = regs_per_sm // (warps * (-(-regs * 32 // 256) * 256)) if regs else max_blocks
    return max(1, min(by_smem, by_threads, by_regs, max_blocks))


def kernel_resident_blocks(lau, device: int) -> int:
    """Resident blocks per SM of a compiled kernel: the driver's occupancy calculator (registers, shared
    memory, threads), else the same rule from the device properties. Host-only; memoized by the caller."""
    try:
        from cupy.cuda import driver

        n = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(lau.ptr, lau.threads, lau.smem))
        if n > 0:
            if _smem_cap() is not None:  # CUFLASH_SMEM_PER_BLOCK: at most what the planned-for SM holds
                n = min(n, max(1, smem_per_sm(device) // (lau.smem + 1024)))
            return n
    except Exception:  # noqa: BLE001 - fall back to the formula
        pass
    p = _props(device)
    return resident_blocks(lau.smem, lau.threads, getattr(lau.raw, "num_regs", 0) or 0,
                           smem_per_sm=smem_per_sm(device),
                           max_threads_per_sm=p.get("maxThreadsPerMultiProcessor", 2048),
                           regs_per_sm=p.get("regsPerMultiprocessor", 65536),
                           reserved_smem=p.get("reservedSharedMemPerBlock", 1024))


@functools.lru_cache(maxsize=4096)
def num_splits_heuristic(blocks: int, num_sms: int, kv_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """Split count that fills the GPU in whole waves (flash-attn's rule, counted in resident blocks).

    blocks = batch x KV heads x Q tiles without splitting; num_sms = the blocks the GPU holds at once
    (SMs x resident blocks per SM of the compiled kernel: decoding is bound by the bytes in flight, so every
    resident slot counts; the d128 decode tile holds 1 block per SM, the others 2: bench/NOTES.md).
    kv_tiles = the most splits that can hold keys (key blocks of one thread block). If the blocks already
    (nearly) fill the slots, do not split. Otherwise take the smallest split count whose wave efficiency
    n*blocks / (waves * slots) is within 95% of the best, never more splits than kv_tiles. (flash-attn
    accepts 85%; decoding is bound by the bytes in flight per SM, so a slot left empty is bandwidth lost:
    MQA at batch 8 got 29 splits = 232 of 264 slots under 85% and ran at 83% of copy bandwidth.)
    """
    if blocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, kv_tiles)
    if max_splits <= 1:
        return 1

    def efficiency(n):
        waves = -(-(n * blocks) // num_sms)
        return n * blocks / (waves * num_sms)

    effs = [efficiency(n) for n in range(1, max_splits + 1)]
    best = max(effs)
    for n, e in enumerate(effs, start=1):
        if e >= WAVE_EFFICIENCY * best:
            return n
    return max_splits


# ----------------------------------------------------------------------------------------- geometry
@functools.lru_cache(maxsize=4096)
def decode_geometry(b: int, sq: int, h: int, hk: int, d: int, causal: bool, scores: bool = False):
    """How the decode kernel sees a problem: (rows, kheads, heads_per_kv, fold, causal, mf, m_blocks).

    seqlen_q == 1 with GQA/MQA folds the G = h / hk query heads of a KV head into G rows (K/V read once
    per KV head), except with the score modifiers (`scores`: the kernel's rows are then query positions, each
    head with its own ALiBi slope); causal only matters with more than one query row (one row sees every key)."""
    fold = folds_gqa(sq, h, hk, scores)
    rows = h // hk if fold else sq
    kheads = hk if fold else h
    heads_per_kv = 1 if fold else h // hk
    mf = decode_mf(d, rows)
    return rows, kheads, heads_per_kv, fold, bool(causal) and sq > 1, mf, -(-rows // (16 * mf))


def decode_kv_block(d: int, tile: DecodeTile | None = None) -> int:
    """Keys per block round of the decode kernel (NWARPS warp tiles): the unit of a split."""
    t = tile or decode_tile(d)
    return t.nwarps * t.block_n


def decode_rounds(seqlen_k: int, d: int, tile: DecodeTile | None = None) -> int:
    """Block rounds of keys (decode_kv_block each) in seqlen_k keys, at least one: the most splits that hold keys."""
    return max(1, -(-seqlen_k // decode_kv_block(d, tile)))


def without_empty_splits(num_splits: int, rounds: int) -> int:
    """The fewest splits with the same longest split: the kernel cuts `rounds` block rounds into splits of
    ceil(rounds / num_splits) rounds (attn/block.cuh: split_range), so past ceil(rounds / that) splits the rest are
    empty -- blocks that load nothing, yet are launched, write an LSE and are read by the combine (MQA at batch 1
    with 16k keys: 128 rounds in 122 splits of 2 rounds, 58 of them empty)."""
    if num_splits <= 1 or rounds <= 1:
        return 1
    return -(-rounds // -(-rounds // num_splits))


def shortest_chain_splits(blocks: int, slots: int, rounds: int, max_splits: int = MAX_SPLITS) -> int:
    """The fewest splits whose longest chain -- waves x block rounds per split, waves = ceil(n blocks / slots), a split
    ceil(rounds / n) rounds (attn/block.cuh: split_range) -- is within CHAIN_SLACK of the shortest any count up to
    min(max_splits, rounds) reaches. No split when the blocks already (nearly) fill the slots. Never a count with
    empty splits: a count with the same rounds per split and fewer splits has no longer a chain, and the fewest win.
    Unlike the wave efficiency of `num_splits_heuristic` it counts the rounds a split holds, so a single-wave grid takes
    the count that shortens its longest split (MQA at batch 1 with 4k keys: 32 rounds in 32 splits of one, where the
    efficiency rule took 31 and, trimmed, 16 splits of two)."""
    if blocks >= 0.8 * slots:
        return 1
    top = min(max_splits, rounds)
    if top <= 1:
        return 1
    chains = [-(-(n * blocks) // slots) * -(-rounds // n) for n in range(1, top + 1)]
    best = min(chains)
    return next(n for n, c in enumerate(chains, start=1) if c <= best * (1 + CHAIN_SLACK))


def decode_num_splits(blocks: int, slots: int, seqlen_k: int, d: int, tile: DecodeTile | None = None,
                      rule: str = "chain") -> int:
    """The default split count of the decode kernel from static shapes only (seqlen_k is the cache capacity, never
    cache_seqlens), at most one split per block round of keys. rule "chain" (the default): `shortest_chain_splits`;
    "waves": the wave-efficiency count (`num_splits_heuristic`) less the splits that would hold no key
    (`without_empty_splits`), the rule before it; "waves_untrimmed": the wave-efficiency count alone (both for
    comparison)."""
    if rule not in SPLIT_RULES:
        raise ValueError(f"split_rule must be one of {SPLIT_RULES}; got {rule!r}")
    rounds = decode_rounds(seqlen_k, d, tile)
    if rule == "chain":
        return shortest_chain_splits(blocks, slots, rounds)
    n = num_splits_heuristic(blocks, slots, rounds)
    return without_empty_splits(n, rounds) if rule == "waves" else n


def _smem_slots(spec, num_sms: int, smem_sm: int) -> int:
    """Resident blocks of a decode kernel on the whole GPU by its shared memory alone (no compile: the decode tiles'
    footprints, not their registers, set their occupancy on sm_80 and sm_90)."""
    return num_sms * resident_blocks(spec.smem, spec.threads, 0, smem_per_sm=smem_sm)


def decode_auto_mf(dtype, d: int, causal: bool, mod: int, paged: bool, groups: int, rows: int, mf0: int,
                   seqlen_k: int, num_splits: int, tile: DecodeTile | None, split_rule: str, num_sms: int,
                   smem_sm: int) -> int:
    """Row fragments per block. More than 16 rows (MQA's 32 folded heads) take decode_geometry's two fragments
    unless one fragment per block -- twice the m-blocks, each half the products per key -- leaves every split at
    most MF1_MAX_ROUNDS block rounds of keys: there the step is latency (each block's set-up, first tile and
    epilogue), and two blocks of half the work finish sooner; on longer splits the second m-block's reads of the
    same K / V (L2 hits) cost L2 bandwidth that a streaming step does not have. groups: batch x the kernel's heads."""
    if mf0 == 1:
        return 1
    m1 = -(-rows // 16)
    spec1 = decode_spec(dtype, d, causal, 1, tile, mod, paged=paged)
    n1 = num_splits or decode_num_splits(groups * m1, _smem_slots(spec1, num_sms, smem_sm), seqlen_k, d, tile,
                                         split_rule)
    rounds = decode_rounds(seqlen_k, d, tile)
    return 1 if -(-rounds // min(n1, rounds)) <= MF1_MAX_ROUNDS else mf0


def decode_auto_tile(dtype, d: int, causal: bool, mod: int, paged: bool, blocks: int, mf: int, num_sms: int,
                     smem_sm: int, seqlen_k: int) -> DecodeTile:
    """The decode tile of a plan: the head dim's configured tile (decode_tile), or its DECODE_WIDE_TILES tile (two
    blocks per SM where the configured one holds one) for a paged cache or a grid of more blocks (before splitting)
    than one wave of the configured tile: there a block's set-up and epilogue, which one block per SM leaves bare,
    run under the other resident block's loads. A contiguous cache whose grid is also more than one wave of
    DECODE_DEEP_TILES' tile and whose blocks read at most DEEP_MAX_ROUNDS block rounds of keys (of the configured
    tile) takes that deeper ring: such blocks are mostly their first loads."""
    base = decode_tile(d)
    if d not in DECODE_WIDE_TILES:
        return base
    if paged or blocks > _smem_slots(decode_spec(dtype, d, causal, mf, base, mod, paged=paged), num_sms, smem_sm):
        deep = DECODE_DEEP_TILES.get(d)
        if deep is not None and not paged and decode_rounds(seqlen_k, d) <= DEEP_MAX_ROUNDS:
            slots = _smem_slots(decode_spec(dtype, d, causal, mf, deep, mod), num_sms, smem_sm)
            if blocks > slots >= 2 * num_sms:  # several waves, two blocks per SM (one on sm_80's 164 KB: not there)
                return deep
        return DECODE_WIDE_TILES[d]
    return base


# ------------------------------------------------------------------------------------------ the plan
class _Plan(HostPlan):
    """Everything a call needs that depends only on the memo key; `run` does the per-call rest. `outs` holds the
    output allocators, indexed by 2 * return_lse + (scratch is None): out, [lse], [the fp32 partials when split
    and no `scratch` is given]. `append`: the KV-cache append kernel's plan, launched first, or None. `geometry`: the
    decode kernel's tile and row fragments ("32x4w2 mf2": keys x warps per tile, ring stages, fragments), for
    benchmark records. `ua`: the plan runs the UA kernels (rows that are not 16-byte units), so data at any 2-byte
    aligned address may take it."""

    __slots__ = ("outs", "num_splits", "geometry", "scratch_elems", "lse_accum_offset", "append", "ua")

    def run(self, qp, kcp, vcp, knp, vnp, sp, xp, return_lse, scratch):
        """xp: the pointers of (block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin), 0 for None."""
        arrs, ptrs, stream = self.outs[(2 if return_lse else 0) + (scratch is None)]()
        if return_lse:
            lse, lp = arrs[1], ptrs[1]
        else:
            lse, lp = None, 0
        if not self.scratch_elems:
            oa = la = 0
        elif scratch is not None:
            oa, la = (_interop.data_ptr(x) for x in scratch)
        else:
            oa = ptrs[-1]
            la = oa + self.lse_accum_offset
        if self.append is None:
            self.launch(stream, qp, kcp, vcp, ptrs[0], lp, oa, la, sp, *xp)
        else:  # k, v -> the caches at cache_seqlens (rotated, paged, at the batch index), before attending
            bt, bi, _, cos, sin = xp
            self.launch_after(self.append, (kcp, vcp, knp, vnp, sp, bt, bi, cos, sin), stream, qp, kcp, vcp, ptrs[0],
                              lp, oa, la, sp, *xp)
        return (arrs[0], lse) if return_lse else arrs[0]


def _append_fields(kca, vca, kna, vna, cache: CacheOptions) -> dict:
    """kvcache_append_kernel's non-pointer arguments by name (cuflash._params.APPEND_ARGS)."""
    f = {}
    for short, a in (("kc", kca), ("vc", vca), ("kn", kna), ("vn", vna)):
        f[f"{short}_bs"], f[f"{short}_rs"], f[f"{short}_hs"] = a.strides[:3]
    return dict(f, batch=kna.shape[0], seqlen_new=kna.shape[1], nheads_k=kna.shape[2], seqlen_cache=cache.capacity or kca.shape[1],
                headdim=kna.shape[3], bt_stride=cache.bt_stride, page_size=cache.page_size,
                rotary_dim=cache.rotary_dim, rotary_interleaved=int(cache.interleaved), seqlen_ro=cache.seqlen_ro)


def _append_plan(qa, kca, vca, kna, vna, cache: CacheOptions, ua: bool = False) -> HostPlan:
    """The append kernel's plan: 2 x batch x seqlen_new x nheads_k x ceil(headdim / 8) chunks, one per thread (ua:
    rows that are not 16-byte units, element by element)."""
    lau = get_launcher(append_spec(qa.dtype, ua), qa.device)
    n = 2 * kna.shape[0] * kna.shape[1] * kna.shape[2] * -(-kna.shape[3] // 8)
    p = HostPlan(qa)
    p.bind(APPEND_ARGS, APPEND_DYNAMIC, **_append_fields(kca, vca, kna, vna, cache))
    p.add_launch(lau, (-(-n // lau.threads), 1, 1))
    return p


@functools.lru_cache(maxsize=None)
def _resident(spec, device: int) -> int:
    lau = get_launcher(spec, device)
    if _get_device() == device:
        return kernel_resident_blocks(lau, device)
    import cupy

    with cupy.cuda.Device(device):
        return kernel_resident_blocks(lau, device)


def _make_plan(qa, kca, vca, kna, vna, ca, seqlen_k, seqlen_k_new, softmax_scale, causal, num_splits,
               tile: DecodeTile | None = None, mods=None, cache: CacheOptions | None = None,
               local: bool = False, combine: str = "auto", split_rule: str = "chain", pdl: bool | None = None,
               mf: int | None = None) -> _Plan:
    """The decode kernel's plan for validated views (ca: the cache_seqlens view or None); `tile` overrides
    the configured DecodeTile (benchmark sweeps); mods: the score modifiers (cuflash._mods.Mods) or None; cache:
    the validated cache indirections (None: none); local: a window was given (query rows rotated at their own
    positions, as with causal); combine: the combine kernel of split launches (COMBINES); split_rule: the default
    split count's rule (decode_num_splits: "chain", or for benchmarks "waves" / "waves_untrimmed"); mf: row
    fragments per block (None: decode_geometry's; benchmarks); pdl: launch the dependent kernels (the combine after
    the split kernel, the decode kernel after the append) with Programmatic Dependent Launch where the device supports
    it (None: cuflash._launch.PDL, the CUFLASH_PDL switch; `plan.pdl` says whether it does)."""
    cache = cache or NO_CACHE_OPTIONS
    if pdl is None:
        pdl = _launch.PDL
    rotate_rows = bool(causal) or local  # before kernel_mode: causal may become a band of the modifiers
    b, sq, h, d = qa.shape
    hk = kca.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    # rows that are not 16-byte units (cuflash._configs.unaligned): the UA kernel, compiled with the score modifiers'
    # mask only (a plain or causal call as a band: cuflash._mods.score_mods), its padded ring, no GQA fold
    ua = unaligned(d, qa, kca, vca, kna, vna)
    if ua:  # (a swizzled `tile` is refused by decode_spec: the UA kernel has the padded ring only)
        if combine == "warp":
            raise NotImplementedError("combine='warp' (flash_combine_kernel) stores 16-byte rows; rows that are not "
                                      "16-byte units take 'auto', 'rows' or 'block'")
        mods = score_mods(mods, causal, softmax_scale, sq, seqlen_k)
    hd, d = d, kernel_headdim(d)  # the inputs' head dim; the kernels' (padding columns zero-filled)
    causal, mod = kernel_mode(mods, causal)
    rows, kheads, heads_per_kv, fold, causal, mf0, m_blocks = decode_geometry(b, sq, h, hk, d, causal, bool(mod))
    paged = cache.block_table is not None
    dev = qa.device
    if mf is not None and mf not in range(1, DECODE_MAX_MF[d] + 1):
        raise ValueError(f"mf must be 1..{DECODE_MAX_MF[d]} at head dim {d}; got {mf!r}")
    if ua and tile is None:
        tile = decode_ua_tile(d)
    if mf is None:
        mf = decode_auto_mf(qa.dtype, d, causal, mod, paged, b * kheads, rows, mf0, seqlen_k, num_splits, tile,
                            split_rule, sm_count(dev), smem_per_sm(dev))
    m_blocks = -(-rows // (16 * mf))
    if tile is None:
        tile = decode_auto_tile(qa.dtype, d, causal, mod, paged, b * kheads * m_blocks, mf, sm_count(dev),
                                smem_per_sm(dev), seqlen_k)
        if decode_smem_bytes(d, tile, mf) > SMALL_SMEM_PER_BLOCK:  # GPUs of less shared memory a block
            tile = fit_decode_tile(d, tile, mf, smem_per_block(dev)) or tile
    spec = decode_spec(qa.dtype, d, causal, mf, tile, mod, paged=paged, ua=ua)
    main = get_launcher(spec, dev)
    if num_splits == 0:
        num_splits = decode_num_splits(b * kheads * m_blocks, sm_count(dev) * _resident(spec, dev), seqlen_k, d,
                                       tile, split_rule)
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    blocks = b * kheads * num_splits * m_blocks
    if blocks > _MAX_GRID_X:
        raise ValueError(f"problem too large for the decode grid: {blocks} blocks")
    # q rows / heads as the kernel sees them (GQA fold: q [b, 1, h, d] seen as [b, G, hk, d])
    if fold:
        q_row, q_head = qa.strides[2], rows * qa.strides[2]
    else:
        q_row, q_head = qa.strides[1], qa.strides[2]
    osb, osq, osh = sq * h * hd, h * hd, hd  # out is allocated contiguous [b, sq, h, hd]
    o_row, o_head = (osh, rows * osh) if fold else (osq, osh)
    p = _Plan(qa)
    p.num_splits = num_splits
    p.ua = ua
    p.geometry = f"{tile.block_n}x{tile.nwarps}w{tile.stages} mf{mf}"  # the tile (keys x warps, stages), row fragments
    p.bind(FWD_PARAMS, DECODE_DYNAMIC, cu_seqlens_q=0, cu_seqlens_k=0,
           block_table_batch_stride=cache.bt_stride, page_size=cache.page_size, rotary_dim=cache.rotary_dim,
           rotary_interleaved=int(cache.interleaved), seqlen_ro=cache.seqlen_ro,
           rotary_q_per_row=int(bool(cache.rotary_dim) and rotate_rows and not fold),
           q_batch_stride=qa.strides[0], q_row_stride=q_row, q_head_stride=q_head,
           **stride_fields("k", kca.strides), **stride_fields("v", vca.strides),
           o_batch_stride=osb, o_row_stride=o_row, o_head_stride=o_head,
           batch=b, nheads=kheads, heads_per_kv=heads_per_kv, seqlen_q=rows, seqlen_k=seqlen_k,
           num_splits=num_splits, seqlen_k_new=seqlen_k_new, grid_order=0, **NO_WALK,
           **mod_fields(mods, float(softmax_scale), hd))
    # PDL: the decode kernel waits for the append kernel (griddepcontrol.wait before it reads the cache), never for a
    # caller's kernel (it reads q before that wait), so only after the plan's own append
    p.add_launch(main, (blocks, 1, 1), pdl=pdl and kna is not None)
    out, lse = p.spec((b, sq, h, hd)), p.spec((b, h, sq), float32=True)
    if num_splits > 1:
        partial_rows = num_splits * b * kheads * rows
        p.scratch_elems = partial_rows * (d + 1)  # o_accum [n, b, hk', rows, d] then lse_accum [n, b, hk', rows]
        p.lse_accum_offset = partial_rows * d * 4
        buf = p.spec((p.scratch_elems,), float32=True)
        a_out, a_lse = p.allocator(out), p.allocator(out, lse)
        p.outs = (a_out, p.allocator(out, buf), a_lse, p.allocator(out, lse, buf))
        out_rows = b * kheads * rows
        if combine == "auto":
            combine = "rows" if num_splits <= combine_rows_max_splits(d) else "block"
        if combine == "rows":  # one warp per output row (cuda_src/flash_decode.cu); the same parameter block; PDL
            if num_splits > combine_rows_max_splits(d):
                raise ValueError(f"combine='rows' takes at most {combine_rows_max_splits(d)} splits at head dim {hd}; "
                                 f"got {num_splits}")
            p.add_launch(get_launcher(decode_combine_rows_spec(qa.dtype, d, num_splits, ua), dev),
                         (-(-out_rows // COMBINE_ROWS_WARPS), 1, 1), pdl=pdl)
        elif combine == "block":  # one block per output row (cuda_src/flash_decode.cu); reads the same parameter
            # block; PDL: its blocks may be resident before the split kernel drains, they wait for it on the device
            p.add_launch(get_launcher(decode_combine_spec(qa.dtype, d, ua), dev), (out_rows, 1, 1), pdl=pdl)
        else:  # one warp per output row (cuda_src/flash_fwd.cu); no griddepcontrol.wait in it: a plain launch
            comb = get_launcher(combine_spec(qa.dtype, d), dev)
            p.add_launch(comb, (-(-out_rows // (comb.threads // 32)), 1, 1))
    else:  # one split: the kernel writes out (and the LSE) itself
        p.scratch_elems, p.lse_accum_offset = 0, 0
        a_out, a_lse = p.allocator(out), p.allocator(out, lse)
        p.outs = (a_out, a_out, a_lse, a_lse)
    p.append = None if kna is None else _append_plan(qa, kca, vca, kna, vna, cache, ua)
    return p


# --------------------------------------------------------------------------------------- validation
def _check_cache_seqlens(cache_seqlens, qa, b):
    if cache_seqlens is None:
        return None, 0
    if isinstance(cache_seqlens, int):
        return None, cache_seqlens
    return check_int_vector(cache_seqlens, "cache_seqlens", qa, b, "valid keys per batch element"), 0


class CacheOptions:
    """flash_attn_with_kvcache's cache indirections, validated: the views (None when not given) and the sizes the
    kernels take (cuda_src/attn/params.cuh: FwdParams' KV-cache fields; the append kernel's arguments)."""

    __slots__ = ("block_table", "batch_idx", "leftpad", "cos", "sin", "interleaved", "capacity", "bt_stride",
                 "page_size", "rotary_dim", "seqlen_ro")

    def __init__(self, block_table=None, batch_idx=None, leftpad=None, cos=None, sin=None, interleaved=True,
                 capacity=0, page_size=0):
        self.block_table, self.batch_idx, self.leftpad, self.cos, self.sin = block_table, batch_idx, leftpad, cos, sin
        self.interleaved = interleaved
        self.capacity = capacity  # keys a cache row holds (paged: pages per row x page size)
        self.page_size = page_size
        self.bt_stride = block_table.strides[0] if block_table is not None else 0
        self.rotary_dim = 2 * cos.shape[1] if cos is not None else 0
        self.seqlen_ro = cos.shape[0] if cos is not None else 0

    @property
    def given(self) -> tuple:
        """The names of the indirections given."""
        return tuple(n for n, x in (("block_table", self.block_table), ("cache_batch_idx", self.batch_idx),
                                    ("cache_leftpad", self.leftpad), ("rotary_cos", self.cos)) if x is not None)


NO_CACHE_OPTIONS = CacheOptions()
NO_CACHE_PTRS = (0, 0, 0, 0, 0)
# The per-call pointers of the decode kernel's block and of the append kernel's arguments, in field order.
DECODE_DYNAMIC = ("q", "k", "v", "o", "lse", "o_accum", "lse_accum", "seqlens_k", "block_table", "cache_batch_idx",
                  "leftpad_k", "rotary_cos", "rotary_sin")
APPEND_DYNAMIC = ("k_cache", "v_cache", "k_new", "v_new", "seqlens", "block_table", "cache_batch_idx", "rotary_cos",
                  "rotary_sin")


def _check_cache_batch(kca, b: int, cache_batch_idx) -> None:
    if kca.shape[0] != b and cache_batch_idx is None:
        raise ValueError(f"k_cache has batch {kca.shape[0]} but q has batch {b} (pass cache_batch_idx to pick rows)")


def check_cache_options(qa, kca, vca, rotary_cos=None, rotary_sin=None, cache_batch_idx=None, cache_leftpad=None,
                        block_table=None, rotary_interleaved=True, appending=False) -> CacheOptions:
    """flash-attn's cache options next to validated q and caches (before anything is launched; errors name the
    argument): block_table int32 (batch, max_pages) with k_cache / v_cache (num_pages, page_size, nheads_k,
    headdim), page_size a multiple of 16; cache_batch_idx and cache_leftpad int32 (batch,) (neither with a block
    table, as in flash-attn); rotary_cos / rotary_sin (seqlen_ro >= the cache capacity, rotary_dim / 2) of q's
    dtype, contiguous, rotary_dim a multiple of 16 and <= headdim, only with appended k, v."""
    check_bool(rotary_interleaved, "rotary_interleaved")
    b, d = qa.shape[0], qa.shape[3]
    bt = bi = lp = cos = sin = None
    capacity, page_size = kca.shape[1], 0
    if block_table is not None:
        bt = check_block_table(block_table, qa, b, kca, "k_cache")
        page_size = kca.shape[1]
        capacity = bt.shape[1] * page_size
        for name, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if x is not None:
                raise ValueError(f"{name} with a block_table: a paged cache's rows are its block_table rows "
                                 f"(flash-attn does not take both either)")
    else:
        _check_cache_batch(kca, b, cache_batch_idx)
    if cache_batch_idx is not None:
        bi = check_int_vector(cache_batch_idx, "cache_batch_idx", qa, b, "the k_cache row of each batch element")
    if cache_leftpad is not None:
        lp = check_int_vector(cache_leftpad, "cache_leftpad", qa, b, "the first visible key of each batch element")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if not appending:
            raise ValueError("rotary_cos / rotary_sin rotate q and the appended keys: pass k and v with them")
        cos, sin = _interop.wrap(rotary_cos, "rotary_cos"), _interop.wrap(rotary_sin, "rotary_sin")
        for a, n in ((cos, "rotary_cos"), (sin, "rotary_sin")):
            check_same(qa, "q", a, n)
            check_dtype(a, n, qa, "q")
            check_rank(a, n, 2, "(seqlen_ro, rotary_dim / 2)")
        if sin.shape != cos.shape:
            raise ValueError(f"rotary_sin must have the shape of rotary_cos {cos.shape}; got {sin.shape}")
        rd = 2 * cos.shape[1]
        if rd < 16 or rd % 16 or rd > d:
            raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1] = {rd}) must be a multiple of 16 and at most the "
                             f"head dim {d}")
        if cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos must have at least the cache's {capacity} positions; got {cos.shape[0]}")
        for a, n in ((cos, "rotary_cos"), (sin, "rotary_sin")):
            if a.strides != (cos.shape[1], 1) and cos.shape[0] > 1:
                raise ValueError(f"{n} must be contiguous; got strides {a.strides}")
    return CacheOptions(bt, bi, lp, cos, sin, rotary_interleaved, capacity, page_size)


def check_kernel(kernel) -> None:
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")


def _validate(q, k_cache, v_cache, k, v, cache_seqlens, num_splits, softmax_scale=None, options=None):
    """Every check of flash_attn_with_kvcache, before anything is launched. options: (rotary_cos, rotary_sin,
    cache_batch_idx, cache_leftpad, block_table, rotary_interleaved) or None. Returns the views, (seqlen_k,
    seqlen_k_new): keys per batch element as the kernel's static bound, keys appended, and the CacheOptions."""
    names = ("q", "k_cache", "v_cache")
    qa, kca, vca = (_interop.wrap(x, n) for x, n in zip((q, k_cache, v_cache), names))
    check_qkv_views(qa, kca, vca, names, same_batch=False)
    check_backward_headdim(qa.shape[3], "flash_attn_with_kvcache")
    check_softmax_scale(softmax_scale)
    b, sq, h, d = qa.shape
    hk = kca.shape[2]
    if options is None:
        _check_cache_batch(kca, b, None)
        cache = NO_CACHE_OPTIONS
    else:
        cache = check_cache_options(qa, kca, vca, *options, appending=k is not None)
    s_cache = cache.capacity or kca.shape[1]
    ca, seqlen_int = _check_cache_seqlens(cache_seqlens, qa, b)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0; got {num_splits!r}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    kna = vna = None
    seqlen_k_new = 0
    if k is not None:
        if ca is None:
            raise ValueError("appending k, v to the cache needs cache_seqlens as an int32 device array")
        kna, vna = _interop.wrap(k, "k"), _interop.wrap(v, "v")
        for a, n in ((kna, "k"), (vna, "v")):
            check_same(qa, "q", a, n)
            check_rank(a, n, 4, "(batch, seqlen_new, nheads_k, headdim)")
            check_dtype(a, n, qa, "q")
            if a.shape[0] != b or a.shape[2:] != (hk, d):
                raise ValueError(f"{n} must have shape ({b}, seqlen_new, {hk}, {d}); got {a.shape}")
            check_layout(a, n)
        if vna.shape != kna.shape:
            raise ValueError(f"v must have the shape of k {kna.shape}; got {vna.shape}")
        seqlen_k_new = kna.shape[1]
    if ca is None and cache_seqlens is not None and seqlen_int < 1:
        raise ValueError(f"cache_seqlens must be >= 1 when given as an int; got {seqlen_int}")
    # Keys seen per batch element: a device array (cache_seqlens [+ s_new], clamped on the device to the
    # capacity) or one host int.
    seqlen_k = s_cache if ca is not None or cache_seqlens is None else min(seqlen_int, s_cache)
    return qa, kca, vca, kna, vna, ca, seqlen_k, seqlen_k_new, cache


# ------------------------------------------------------------------------------------------- the API
_PLANS: dict = {}
_MAX_PLANS = 4096


def flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, rotary_cos: Any = None,
                            rotary_sin: Any = None, cache_seqlens: Union[Any, int, None] = None,
                            cache_batch_idx: Any = None, cache_leftpad: Any = None, block_table: Any = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = _NO_WINDOW, softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Any = None, num_splits: int = 0,
                            return_softmax_lse: bool = False, *, scratch: Optional[Sequence[Any]] = None,
                            kernel: str = "decode") -> Union[Any, Tuple[Any, Any]]:
    """flash-attn's `flash_attn_with_kvcache` on torch tensors or CuPy arrays: attention of a few new queries
    against a KV cache (Flash-Decoding: the keys split across thread blocks, partials combined).

    Args:
        q: [batch, seqlen_q, nheads, headdim] (seqlen_q small: 1 for decoding, a few for speculative decoding).
        k_cache, v_cache: [batch, seqlen_cache, nheads_k, headdim], nheads a multiple of nheads_k. q, k_cache,
            v_cache (and k, v) float16 or bfloat16 (all the same), any head dim up to 256, on one CUDA device, of
            one kind, last dimension contiguous. Rows that are not 16-byte units (a head dim that is not a multiple
            of 8, strides that are not multiples of 8 elements, data not 16-byte aligned) run the decode kernel's UA
            form: every access element by element, every option below included.
        k, v: optional [batch, seqlen_new, nheads_k, headdim], written into the caches at cache_seqlens first (in
            place; entries past the capacity are dropped); the kernel attends to cache_seqlens + seqlen_new keys.
            Need cache_seqlens as a device array.
        rotary_cos, rotary_sin: [seqlen_ro, rotary_dim / 2] of q's dtype, contiguous (seqlen_ro >= the cache
            capacity, rotary_dim a multiple of 16 up to headdim), only with k, v: the appended keys are rotated at
            positions cache_seqlens + i (in the append kernel), q at cache_seqlens + i when causal or local and at
            cache_seqlens otherwise (in the decode kernel, as it is loaded); columns past rotary_dim unchanged.
        rotary_interleaved: True: pairs of columns (2k, 2k + 1) (GPT-J); False: (k, k + rotary_dim / 2) (GPT-NeoX).
        cache_seqlens: int32 [batch] contiguous device array of valid entries per cache, or an int >= 1 (the same
            for every batch element, clamped to the capacity), or None (the whole cache).
        cache_batch_idx: int32 [batch]: the k_cache / v_cache row each batch element reads and appends to (the
            caches may have more rows than the batch; the indices are trusted, as in flash-attn).
        cache_leftpad: int32 [batch]: element b's keys start at cache row cache_leftpad[b] (the causal diagonal,
            the window and ALiBi count from there).
        block_table: int32 [batch, max_pages] (last dim contiguous): a paged cache, k_cache / v_cache [num_pages,
            page_size, nheads_k, headdim] with page_size a multiple of 16; key r of element b is row
            r % page_size of page block_table[b, r // page_size]; capacity max_pages x page_size. Not with
            cache_batch_idx or cache_leftpad (flash-attn takes neither with it).
        softmax_scale: positive finite scale of Q K^T; None: headdim ** -0.5.
        causal: bottom-right aligned against each batch element's key count (matters for seqlen_q > 1).
        num_splits: 0 picks the split count from static shapes only (`decode_num_splits`; never from the values
            in cache_seqlens, so a CUDA graph capture stays valid); an explicit count is honoured (at most 128).
        return_softmax_lse: also return the LSE.
        window_size, softcap, alibi_slopes: the score modifiers of flash_attn_func (sliding window bottom-right
            aligned against each batch element's key count, soft-cap, ALiBi slopes float32 (nheads,) or (batch,
            nheads)); with them GQA query heads are not folded into one tile.
        scratch: optional preallocated fp32 partials (o_accum [n, b, hk', rows, d], lse_accum [n, b, hk', rows])
            for split launches; otherwise they come from the inputs' allocator.
        kernel: "decode" (the dedicated decode kernel, default) or "fwd_split" (the prefill kernel cut into KV
            splits, for comparison; without the cache indirections and rotary embedding: NotImplementedError).

    Returns:
        out [batch, seqlen_q, nheads, headdim] like q; with return_softmax_lse=True, (out, softmax_lse
        [batch, nheads, seqlen_q] float32 natural log).

    Raises (before anything is launched; messages name the argument):
        TypeError: non-CUDA arrays, mixed kinds, unsupported or mixed dtypes, a cache_seqlens array not int32.
        ValueError: bad shapes / strides / devices, num_splits not an int >= 0, k without v (or either without a
            cache_seqlens array), an int cache_seqlens < 1, an unknown kernel, a problem too large for the grid, a
            page size that is no multiple of 16, rotary tables without k / v or of a bad shape, cache_batch_idx or
            cache_leftpad with block_table.
        NotImplementedError: the indirections or rotary embedding with kernel="fwd_split".
    """
    if rotary_cos is None and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None \
            and block_table is None and rotary_interleaved is True:
        options, xp, xd = None, NO_CACHE_PTRS, None
    else:
        options = (rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, rotary_interleaved)
        xs = [_desc(x) if x is not None else (0, ()) for x in (block_table, cache_batch_idx, cache_leftpad,
                                                               rotary_cos, rotary_sin)]
        xp = tuple(x[0] for x in xs)
        xd = (tuple(x[1] for x in xs), rotary_interleaved)
        if None in xp or type(rotary_interleaved) is not bool:
            xp = xd = None  # not a plain tensor / array, or a bad flag: the validating path
    plain = window_size is _NO_WINDOW and not softcap and alibi_slopes is None
    if not plain:
        check_unsupported(0.0, window_size, softcap, alibi_slopes)
    opts = None if plain else (window_size, softcap, alibi_slopes)
    if kernel != "decode":
        check_kernel(kernel)
        if kernel == "fwd_split":
            if options is not None:
                _refuse_fwd_split(options)
            return _fwd_split(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, num_splits,
                              return_softmax_lse, scratch, opts)
    # Fast path: a memoized plan for these shapes / strides / dtypes / devices / scalar arguments.
    qp, qd = _desc(q)
    kcp, kcd = _desc(k_cache)
    vcp, vcd = _desc(v_cache)
    if k is None and v is None:
        knp = vnp = 0
        knd = vnd = None
    else:
        knp, knd = _desc(k)
        vnp, vnd = _desc(v)
    if cache_seqlens is None or type(cache_seqlens) is int:
        sp, sd = 0, cache_seqlens
    else:
        sp, sd = _desc(cache_seqlens)
    plan = None
    key = None
    mk = () if plain else memo_key(causal, window_size, softcap, alibi_slopes)
    if qd is not None and kcd is not None and vcd is not None and sp is not None and knp is not None \
            and vnp is not None and mk is not None and xp is not None:
        key = (qd, kcd, vcd, knd, vnd, sd, softmax_scale, causal, num_splits, mk, xd)
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: validate (and fail) below
            key = None
    if plan is None or not plan.ua and (qp | kcp | vcp | knp | vnp) & 15:
        qa, kca, vca, kna, vna, ca, seqlen_k, seqlen_k_new, cache = _validate(
            q, k_cache, v_cache, k, v, cache_seqlens, num_splits, softmax_scale, options)
        mods = None if plain else mods_for(qa, kca, causal, *opts, softmax_scale, seqlen_k)
        plan = _make_plan(qa, kca, vca, kna, vna, ca, seqlen_k, seqlen_k_new, softmax_scale, causal, num_splits,
                          mods=mods, cache=cache, local=tuple(window_size) != _NO_WINDOW)
        qp, kcp, vcp = qa.ptr, kca.ptr, vca.ptr
        knp, vnp = (kna.ptr, vna.ptr) if kna is not None else (0, 0)
        if not (qp | kcp | vcp | knp | vnp) & 15:  # (a UA plan made for data that is not 16-byte aligned is not kept:
            remember(_PLANS, key, plan, _MAX_PLANS)  # aligned calls of the same key take the 16-byte kernels)
        sp = ca.ptr if ca is not None else 0
        xp = _cache_ptrs(cache)
    return plan.run(qp, kcp, vcp, knp, vnp, sp, xp, return_softmax_lse, scratch)


def _cache_ptrs(cache: CacheOptions) -> tuple:
    """The pointers of the indirections, in DECODE_DYNAMIC's order (0 for those not given)."""
    return tuple(a.ptr if a is not None else 0 for a in (cache.block_table, cache.batch_idx, cache.leftpad, cache.cos,
                                                         cache.sin))


def _refuse_fwd_split(options) -> None:
    """The cache indirections run on the decode kernel only: a NotImplementedError naming the first one given."""
    names = ("rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad", "block_table")
    for name, x in zip(names, options):
        if x is not None:
            raise NotImplementedError(f"{name} runs on kernel='decode' (the default), not on kernel='fwd_split'")
    check_bool(options[5], "rotary_interleaved")


def _fwd_split(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, num_splits, return_softmax_lse,
               scratch, opts=None):
    """The prefill kernel cut into KV splits (the path before the decode kernel); opts: (window_size, softcap,
    alibi_slopes) or None."""
    qa, kca, vca, kna, vna, ca, seqlen_k, seqlen_k_new, _ = _validate(q, k_cache, v_cache, k, v, cache_seqlens,
                                                                      num_splits, softmax_scale)
    mods = None if opts is None else mods_for(qa, kca, causal, *opts, softmax_scale, seqlen_k)
    b, sq, h, d = qa.shape
    s_cache, hk = kca.shape[1], kca.shape[2]
    ua = unaligned(d, qa, kca, vca, kna, vna)  # rows that are not 16-byte units: one split, the UA kernels
    if ua:
        num_splits = 1
    if kna is not None:
        lau = get_launcher(append_spec(qa.dtype, ua), qa.device)
        n = 2 * b * seqlen_k_new * hk * -(-d // 8)
        with _interop.device_guard(qa.device):
            lau.launch_block((-(-n // lau.threads), 1, 1), _interop.current_stream(qa), APPEND_ARGS,
                             APPEND_ARGS.values(k_cache=kca.ptr, v_cache=vca.ptr, k_new=kna.ptr, v_new=vna.ptr,
                                                seqlens=ca.ptr, block_table=0, cache_batch_idx=0, rotary_cos=0,
                                                rotary_sin=0, **_append_fields(kca, vca, kna, vna, NO_CACHE_OPTIONS)))
    kc = kca if seqlen_k == s_cache else _interop.Arr(kca.kind, kca.obj, kca.ptr, (b, seqlen_k, hk, d), kca.strides,
                                                      kca.dtype, kca.device)
    vc = vca if seqlen_k == s_cache else _interop.Arr(vca.kind, vca.obj, vca.ptr, (b, seqlen_k, hk, d), vca.strides,
                                                      vca.dtype, vca.device)
    tile = split_tile(kernel_headdim(d))
    if fwd_smem_bytes(kernel_headdim(d), tile) > SMALL_SMEM_PER_BLOCK:
        tile = fit_fwd_tile(kernel_headdim(d), tile, smem_per_block(qa.device)) or tile
    fold = folds_gqa(sq, h, hk, kernel_mode(mods, causal)[1])
    rows = h // hk if fold else sq
    kheads = hk if fold else h
    if num_splits == 0:
        blocks = b * kheads * -(-rows // tile.block_m)
        num_splits = num_splits_heuristic(blocks, decode_slots(qa.device, fwd_smem_bytes(kernel_headdim(d), tile)),
                                          -(-seqlen_k // tile.block_n))
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    out, lse = forward(qa, kc, vc, softmax_scale, causal, tile=tile if num_splits > 1 else None,
                       seqlens_k_ptr=ca.ptr if ca is not None else 0, seqlen_k_new=seqlen_k_new,
                       num_splits=num_splits, scratch=scratch, mods=mods)
    return (out, lse) if return_softmax_lse else out


def plan_for(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None, causal=False,
             num_splits=0, tile: DecodeTile | None = None, window_size=_NO_WINDOW, softcap=0.0,
             alibi_slopes=None, block_table=None, combine: str = "auto", split_rule: str = "chain",
             pdl: bool | None = None, mf: int | None = None) -> _Plan:
    """The decode kernel's plan of a call, not memoized: benchmarks read num_splits and the launch geometry
    from it, sweep tiles with `tile`, compare combines with `combine` ("auto": the default; "rows", "block": the
    decode combines, "rows" for at most combine_rows_max_splits(headdim) splits; "warp": the split-KV forward's
    one-warp-per-row combine), the default split count's rule with `split_rule` ("chain", the default; "waves",
    "waves_untrimmed": decode_num_splits), the row fragments per block with `mf` (None: the configured ones; fewer
    give more m-blocks) and Programmatic Dependent Launch with `pdl` (None: the CUFLASH_PDL switch; False: plain
    launches; `plan.pdl` says whether the plan uses it) (run it with `run_plan`)."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}; got {combine!r}")
    if split_rule not in SPLIT_RULES:  # here too: an explicit num_splits never reaches decode_num_splits
        raise ValueError(f"split_rule must be one of {SPLIT_RULES}; got {split_rule!r}")
    if pdl is not None:
        check_bool(pdl, "pdl")
    check_unsupported(0.0, window_size, softcap, alibi_slopes)
    options = None if block_table is None else (None, None, None, None, block_table, True)
    qa, kca, vca, kna, vna, ca, seqlen_k, seqlen_k_new, cache = _validate(q, k_cache, v_cache, k, v, cache_seqlens,
                                                                          num_splits, softmax_scale, options)
    mods = mods_for(qa, kca, causal, window_size, softcap, alibi_slopes, softmax_scale, seqlen_k)
    return _make_plan(qa, kca, vca, kna, vna, ca, seqlen_k, seqlen_k_new, softmax_scale, causal, num_splits, tile,
                      mods, cache, tuple(window_size) != _NO_WINDOW, combine, split_rule, pdl, mf)


def run_plan(plan: _Plan, q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, return_softmax_lse=False,
             scratch=None, block_table=None):
    """Run a plan from `plan_for` on arrays of the shapes it was made for (benchmarks; no checks)."""
    ptr = _interop.data_ptr
    sp = ptr(cache_seqlens) if cache_seqlens is not None and not isinstance(cache_seqlens, int) else 0
    knp, vnp = (ptr(k), ptr(v)) if k is not None else (0, 0)
    xp = NO_CACHE_PTRS if block_table is None else (ptr(block_table), 0, 0, 0, 0)
    return plan.run(ptr(q), ptr(k_cache), ptr(v_cache), knp, vnp, sp, xp, return_softmax_lse, scratch)
