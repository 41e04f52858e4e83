"""The one place that chooses kernel configurations: tiles, template arguments, threads, shared memory.

One function per kernel family picks its tile for a (head dim, mask / partition, architecture, dtype):

* `fwd_tile(headdim, causal)`            V2 forward (cuda_src/flash_fwd.cu), every architecture
* `split_tile(headdim)`                   the V2 forward's split-KV variant (kernel="fwd_split")
* `decode_tile(headdim)`                  the Flash-Decoding kernel (cuda_src/flash_decode.cu)
* `bwd_tile(headdim, partition, arch, dtype)`  V2 backward (cuda_src/flash_bwd.cu): sm_80 tables, sm_90 2D tiles
* `v1_fwd_tile(headdim, warp_split)`, `v1_bwd_tile(headdim)`  FlashAttention-1 (cuda_src/flash_v1.cu)
* `sm90_fwd_tile(headdim, causal)`       the Hopper forward (cuda_src/flash_fwd_sm90.cu), sm_90a only

The tables below are their data, each entry with the reason it was chosen. `*_spec` functions turn a tile
into a KernelSpec (the kernel's template name expression, threads, dynamic shared memory). The kernels
static_assert their invariants (tile divisibility, the shared-memory size computed here), so a wrong entry
fails to compile -- in CI, which compiles every configuration listed by `all_specs()` for sm_80 and sm_90
and rejects spills.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ._launch import SMALLEST_SMEM_PER_BLOCK, KernelSpec, _smem_cap

HEADDIMS = (32, 64, 96, 128, 256)  # the head dims the kernels are compiled for
FWD_HEADDIMS = HEADDIMS + (512,)  # the V2 forward's (flash_attn_func): 512 has no backward, decode or sm90 kernel
MAX_HEADDIM = 256
MAX_FWD_HEADDIM = 512
SM80_ONLY_MAX_HEADDIM = 32  # head dims up to this run on the sm80 kernels (their 32; the Hopper forward's least is 64)
HEADDIM_MULTIPLE = 8  # a 16-byte chunk of a row: the unit of the aligned kernels' loads (others: the UA kernels)
DTYPES = ("float16", "bfloat16")
CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
ELEM_BYTES = 2
SMEM_ROW_PAD = 8  # elements of padding per shared-memory row (cuda_src/common/tile.cuh: PaddedRow)


def kernel_headdim(headdim: int, compiled=HEADDIMS) -> int | None:
    """The compiled head dim that runs `headdim`: the smallest of `compiled` at or above it (its loads zero-fill the
    columns past `headdim` in shared memory and its stores skip them: cuda_src/common/tile.cuh), or None when
    `headdim` is above them all or below 1. A head dim that is not a multiple of HEADDIM_MULTIPLE runs on the UA
    kernels of that head dim (`unaligned`)."""
    if headdim < 1:
        return None
    return next((c for c in compiled if c >= headdim), None)


# ------------------------------------------------------------------------------ rows that are not 16-byte units
# The UA kernels (cuda_src/common/tile.cuh: PAD_ELEM): every global access of the attention rows element by element,
# for head dims that are not multiples of 8 and for views whose strides or base addresses are not 16-byte aligned.
# Kept few: the score-modifier masks only (a plain or causal call runs as the band without edges, or with right = 0:
# cuflash._mods.resolve(force=True)), the default tile of each, the default backward partition with its sm_80 tile
# on every device, no split-KV forward; the decode kernel (flash_attn_with_kvcache) with its configured tile's padded
# ring (decode_ua_tile), its combines, the KV-cache append and the paged gather of packed sequences.
UA_MODS = (1, 3)  # (MOD_SCORE, MOD_SCORE_DROPOUT), defined below


def unaligned(headdim: int, *arrays) -> bool:
    """Whether a call needs the UA kernels: a head dim that is not a multiple of HEADDIM_MULTIPLE, or a view (an
    `Arr`, or None) with a base address or a stride (of a dimension longer than 1, the last excepted) that is not a
    16-byte multiple."""
    if headdim % HEADDIM_MULTIPLE:
        return True
    for a in arrays:
        if a is not None and (a.ptr % 16 or any(n > 1 and st % HEADDIM_MULTIPLE
                                                for n, st in zip(a.shape[:-1], a.strides[:-1]))):
            return True
    return False


def ua_fwd_tile(headdim: int, mod: int) -> FwdTile:
    """The UA forward's tile: the default one of its mode with the next K / V tile loaded before S = Q K^T
    (LOAD_AT 0: the element loads' registers are free again before S is computed); head dim 128 takes its 32-key
    tile in every mode (the 64-key MOD_SCORE tile spilled 8 B on sm_80), and with dropout 64-row tiles (the packed
    MOD_SCORE_DROPOUT kernel spilled 8-24 B at every unrolling of the 128-row one, next to ALiBi's per-row shift)."""
    if headdim == 128:
        return FwdTile(64, 64, 4) if mod & MOD_DROPOUT else FwdTile(128, 32, 4)
    return replace(fwd_tile(headdim, False, mod), load_at=0)


def ua_bwd_tile(headdim: int, dtype: str, mod: int) -> tuple:
    """(partition, tile) of the UA backward: the default partition, its sm_80 tile (bwd_tiles' varlen table)."""
    part = BWD_AUTO_PARTITION.get(headdim, "kv")
    return part, bwd_tiles(part, 80, dtype, mod, varlen=True)[headdim]


@dataclass(frozen=True)
class FwdTile:
    block_m: int  # Q rows per thread block
    block_n: int  # keys per KV tile
    nwarps: int  # warps per block; each owns block_m / nwarps rows (a multiple of 16)
    kunroll: int = 0  # k16 steps of S = Q K^T unrolled per loop trip (0: all; cuda_src/flash_fwd.cu KUNROLL)
    load_at: int = 0  # where a KV step issues the next tile's cp.async: 0 or 1 (cuda_src/flash_fwd.cu LOAD_AT)
    o_split: int = 1  # blocks per (Q tile, head), each computing headdim / o_split O columns (flash_fwd.cu DO)
    cap_max: bool = False  # MOD_SCORE, fixed lengths: the soft-cap's capped-max form (flash_fwd.cu CAP_MAX)


# Forward tiles per head dim (tuned on the H200: bench/results/fwd_sweep.* records the sweep).
FWD_TILES = {
    32: FwdTile(128, 64, 4),
    64: FwdTile(128, 64, 4, 0, 1),
    96: FwdTile(128, 64, 8),
    # FlashAttention-2's tile: two 16-row fragments per warp (each K/V ldmatrix feeds 4 mma), 64 keys per stage
    # (ldmatrix of Q per key halved against 32-key tiles); Q K^T unrolled 4 of its 8 k16 steps per trip to fit
    # 255 registers without spills (the kernel caps it at 2 on sm_80, where 4 spill; flash_fwd.cu KUNROLL).
    128: FwdTile(128, 64, 4, 4, 1),
    256: FwdTile(64, 32, 4),
    # two blocks of 256 O columns each (d256's O registers), each with the whole Q K^T: 1.5x one block's FLOPs. Q,
    # 2 x K (520-element rows) and 2 x V (264) take 166,912 B, exactly sm_80's limit.
    512: FwdTile(64, 32, 4, o_split=2),
}
# load_at=1 (head dims 64, 128): the next K / V tile's cp.async issued after S = Q K^T, not before it
# (flash_fwd.cu LOAD_AT; bench/results, section fwd_interleaved, two runs: +2-6% at non-causal d128, +1-4% at
# causal d128 2k, -0.7 to +1.5% at d64). Head dims 32, 96, 256 keep 0 (not measured).

# Split-KV (decoding) tiles: 4 warps share the loads of each K/V tile; a warp whose 16 query rows are
# all past seqlen_q (decoding has 1..16 rows per KV head) skips the math.
DECODE_TILES = {
    32: FwdTile(64, 128, 4),
    64: FwdTile(64, 128, 4),
    96: FwdTile(64, 128, 4),
    128: FwdTile(64, 64, 4),
    256: FwdTile(64, 32, 4),
}


# Causal overrides of FWD_TILES (tiles on the diagonal cost a mask; registers differ with the mask code).
FWD_TILES_CAUSAL: dict[int, FwdTile] = {
    128: FwdTile(128, 32, 4, 0, 1),  # 32-key tiles: less masked work on the diagonal
}


# The mask modes every masked kernel is compiled for: (causal, MOD) = plain, causal, and the score modifiers
# (MOD_SCORE: window band, soft-cap, ALiBi from the parameter block; cuda_src/attn/mask.cuh, cuflash/_mods.py).
MOD_NONE, MOD_SCORE = 0, 1
MASK_MODES = ((False, MOD_NONE), (True, MOD_NONE), (False, MOD_SCORE))
# Dropout (cuda_src/attn/dropout.cuh) is compiled with the score modifiers: MOD_SCORE | MOD_DROPOUT, one more kernel
# per V2 forward (not split-KV, not decode), Hopper forward and sm80 backward configuration.
MOD_DROPOUT = 2
MOD_SCORE_DROPOUT = MOD_SCORE | MOD_DROPOUT
MOD_VALUES = (MOD_NONE, MOD_SCORE, MOD_SCORE_DROPOUT)


# MOD_SCORE kernels whose plain tile spills with the modifiers' registers (band edges, slope, soft-cap, about
# ten): these unroll less (compile report of every configuration: CI).
FWD_TILES_SCORE: dict[int, FwdTile] = {
    # 1 k16 step per trip: 4 spills 8 B on sm_90, and 2 too (sm_90 cubin, NVRTC 13.0) since ALiBi's per-row
    # shift (cuda_src/attn/mask.cuh) holds 4 registers more
    128: replace(FWD_TILES[128], kunroll=1),
}
# The mma.sync forward's capped-max form (FwdTile.cap_max, flash_fwd.cu CAP_MAX: the Hopper forward's, on tiles where
# the soft-cap is the only change for a warp's rows the row max taken of the raw scores and capped once), at every head
# dim of the modifier kernels: compiled at every head dim (fwd_cap_max_specs; an explicit tile reaches any of them:
# cuflash._fwd.forward, bench.diag.softcap_check --sm80, tests/test_score_mods.py). Each is the modifier kernel's tile
# with the form, but at head dim 128 32-key tiles (the 64-key tile with it spills 4 B on sm_90 under both NVRTCs, with
# every scale_log2 form; 32 keys: 235-242 registers, no spill). Soft-capped fixed-length calls (no split, no packed
# sequences) at the head dims FWD_CAP_MAX_HEADDIMS take it where its tile fits the device. Measured (H100, GPU time,
# softcap_check --sm80, bench/results/h100/softcap-check-sm80.log): the soft-cap's cost over the plain kernel at 4k /
# 16k, causal or not, head dim 64 +24.9-32.6% -> +20.2-28.5%, 96 +26.0-34.5% -> +20.6-28.6%, 128 +16.9-23.2% ->
# +11.4-16.7% (faster at 12 of 12 points); at 256, where the soft-cap costs -1.3 to +2.2% without it, -0.4 to +4.6%
# with it (not taken).
FWD_CAP_MAX_TILES = {128: FwdTile(128, 32, 4, 0, 1)}
FWD_CAP_MAX_HEADDIMS = (64, 96, 128)


def fwd_cap_max_tile(headdim: int) -> FwdTile:
    """The mma.sync forward's capped-max tile at a head dim (FWD_CAP_MAX_TILES, else the modifier kernel's)."""
    return replace(FWD_CAP_MAX_TILES.get(headdim) or fwd_tile(headdim, False, MOD_SCORE), cap_max=True)


def fwd_cap_max_specs():
    """The fixed-length modifier forward kernels (MOD_SCORE) with the capped-max form, every dtype and head dim."""
    return [fwd_spec(dt, d, False, False, fwd_cap_max_tile(d), mod=MOD_SCORE)
            for dt in DTYPES for d in (*HEADDIMS, *(x for x in FWD_HEADDIMS if x not in HEADDIMS))]


# MOD_SCORE_DROPOUT forward tiles that differ from the MOD_SCORE ones (the Philox state and its words): with
# 64-key tiles head dim 128 spilled 28-44 B at every unrolling; 32-key tiles (head dim 128's causal tile) hold half
# the S registers.
FWD_TILES_DROPOUT: dict[int, FwdTile] = {
    64: FwdTile(128, 32, 4, 0, 1),  # 64 keys: 36-40 B of spills fully unrolled, local memory at 2 steps (NVRTC 13.0)
    128: FwdTile(128, 32, 4, 0, 1),
}


def fwd_tile(headdim: int, causal: bool, mod: int = 0) -> FwdTile:
    """The V2 forward tile of a head dim and mask: FWD_TILES, or its causal override, or (mod = MOD_SCORE) its
    score-modifier override. The same tile on sm_80 and sm_90 (the kernel itself caps KUNROLL at 2 on sm_80, where
    4 spill)."""
    if mod & MOD_DROPOUT:
        return FWD_TILES_DROPOUT.get(headdim) or FWD_TILES_SCORE.get(headdim) or FWD_TILES[headdim]
    if mod:
        return FWD_TILES_SCORE.get(headdim) or FWD_TILES[headdim]
    return (FWD_TILES_CAUSAL.get(headdim) if causal else None) or FWD_TILES[headdim]


def split_tile(headdim: int) -> FwdTile:
    """The tile of the V2 forward's split-KV variant (decoding through the prefill kernel): DECODE_TILES."""
    return DECODE_TILES[headdim]


# grid_order="auto": causal problems at head dim 128 with at least this many query rows use "bh". There
# every head's heaviest Q tiles (the ones by the diagonal's far end) are issued first across the whole
# grid, which shortens the tail; "qtile" keeps one head's blocks together for L2 and wins elsewhere
# (bench/results, section grid_order, two runs: d128 causal 8k / 16k bh 4-7% faster, 2k within 1%;
# d64 causal and every non-causal case: qtile as fast or faster). Other head dims: not measured, "qtile".
AUTO_BH_MIN_ROWS = 8192
AUTO_BH_HEADDIMS = (128,)


def auto_grid_order(causal: bool, rows: int, headdim: int) -> str:
    """The V2 forward's grid order for grid_order="auto"."""
    return "bh" if causal and rows >= AUTO_BH_MIN_ROWS and headdim in AUTO_BH_HEADDIMS else "qtile"


def fwd_smem_bytes(headdim: int, tile: FwdTile) -> int:
    """Q tile + 2 stages x (K tile + V tile of the block's O columns), rows padded (cuda_src/flash_fwd.cu
    static_asserts it)."""
    dv = headdim // tile.o_split
    return ((tile.block_m + 2 * tile.block_n) * (headdim + SMEM_ROW_PAD) +
            2 * tile.block_n * (dv + SMEM_ROW_PAD)) * ELEM_BYTES


def _mod_checked(causal: bool, mod: int) -> int:
    if mod not in MOD_VALUES or (causal and mod):
        raise ValueError(f"mod must be one of {MOD_VALUES} (non-zero with causal=False: a causal window is the band "
                         f"with right = 0); got mod={mod!r}, causal={causal!r}")
    return mod


def fwd_spec(dtype: str, headdim: int, causal: bool, split: bool, tile: FwdTile | None = None,
             exp_variant: int = 0, mod: int = 0, varlen: bool = False, ua: bool = False) -> KernelSpec:
    """The V2 forward kernel (exp_variant: cuda_src/flash_fwd.cu ExpVariant; non-zero only in the V1 ladder; mod:
    MOD_SCORE for the score modifiers, cuflash/_mods.py; varlen: packed sequences, the VARLEN kernel; ua: rows that
    are not 16-byte units, the UA kernel: MOD in UA_MODS, not split)."""
    if ua and (split or causal or mod not in UA_MODS):
        raise ValueError(f"the UA forward runs mod in {UA_MODS} without split-KV; got mod={mod!r}, causal={causal!r}, "
                         f"split={split!r}")
    if split and headdim not in DECODE_TILES:
        raise ValueError(f"the split-KV forward has no kernel for head dim {headdim} (head dims {tuple(DECODE_TILES)})")
    if tile is None:
        tile = split_tile(headdim) if split else fwd_tile(headdim, causal, mod)
    if split and mod & MOD_DROPOUT:
        raise ValueError("dropout: the split-KV forward has no dropout kernel")
    if tile.cap_max and (mod != MOD_SCORE or split or varlen or ua):
        raise ValueError(f"tile {tile}: the capped-max form is the fixed-length modifier kernel's, without dropout or "
                         f"split-KV (mod {mod}, split {split}, varlen {varlen}, ua {ua})")
    smem = fwd_smem_bytes(headdim, tile)
    do = headdim // tile.o_split if tile.o_split > 1 else 0  # the kernel's DO (0: every column)
    if tile.cap_max:  # (every trailing argument spelled out up to CAP_MAX)
        extra = f", {exp_variant}, {tile.kunroll}, {tile.load_at}, {mod}, {do}, false, false, true"
    elif varlen or ua:
        if split:
            raise ValueError("varlen: the split-KV forward has no packed-sequence kernel")
        extra = (f", {exp_variant}, {tile.kunroll}, {tile.load_at}, {_mod_checked(causal, mod)}, {do}, "
                 f"{'true' if varlen else 'false'}{', true' if ua else ''}")
    elif tile.o_split > 1:
        if split:
            raise ValueError("o_split: the split-KV forward has no O column slices")
        extra = f", {exp_variant}, {tile.kunroll}, {tile.load_at}, {_mod_checked(causal, mod)}, {headdim // tile.o_split}"
    elif _mod_checked(causal, mod):
        extra = f", {exp_variant}, {tile.kunroll}, {tile.load_at}, {mod}"
    elif tile.load_at:
        extra = f", {exp_variant}, {tile.kunroll}, {tile.load_at}"
    else:
        extra = f", {exp_variant}, {tile.kunroll}" if tile.kunroll else f", {exp_variant}" if exp_variant else ""
    name = (
        f"cuflash::flash_fwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
        f"{'true' if causal else 'false'}, {'true' if split else 'false'}, {smem}{extra}>"
    )
    return KernelSpec("flash_fwd.cu", name, tile.nwarps * 32, smem)


# ------------------------------------------------------------------------------ Hopper forward (sm_90a)
@dataclass(frozen=True)
class Sm90FwdTile:
    """Tile of the warp-specialized sm_90a forward (cuda_src/flash_fwd_sm90.cu): 1 producer warpgroup + nwg
    consumer warpgroups of 64 query rows each (block_m = 64 nwg), block_n keys per K/V stage."""

    block_n: int
    nwg: int
    stages: int = 2
    regs_mma: int = 240  # setmaxnreg register counts: 128 (regs_load + nwg regs_mma) <= the launch allocation
    regs_load: int = 24
    pingpong: bool = True  # consumer warpgroups take turns at the tensor cores
    o_tma: bool = False  # O stored by TMA tensor stores (the kernel's O_TMA; takes O's tensor map as well)
    min_blocks: int = 1  # blocks per SM the launch bounds ask for (the kernel's MINB): registers and smem for that many
    persistent: bool = False  # the kernel's PERSIST: min_blocks blocks per SM walking the Q tiles (no dropout)
    stream_k: bool = False  # the kernel's SK: the persistent form able to walk by stream-K (no mask; a kernel of its own)
    cap_max: bool = False  # the kernel's CAP_MAX (MOD_SCORE): the soft-cap's row max from the raw scores

    def __post_init__(self):
        # the kernel's static_assert, said before a compile: setmaxnreg moves registers within the launch allocation
        if self.min_blocks < 1:
            raise ValueError(f"min_blocks must be at least 1; got {self.min_blocks}")
        if self.regs_mma % 8 or self.regs_load % 8:
            raise ValueError(f"regs_mma and regs_load must be multiples of 8; got {self.regs_mma}, {self.regs_load}")
        if self.stream_k and not self.persistent:
            raise ValueError("stream_k needs the persistent form (persistent=True)")
        if 128 * (self.regs_load + self.nwg * self.regs_mma) > self.launch_regs * self.threads:
            raise ValueError(f"regs_mma {self.regs_mma} x {self.nwg} consumer warpgroups + regs_load {self.regs_load} "
                             f"exceed the launch allocation of {self.launch_regs} registers per thread "
                             f"({self.threads} threads, min_blocks {self.min_blocks})")

    @property
    def block_m(self) -> int:
        return 64 * self.nwg

    @property
    def threads(self) -> int:
        return 128 * (self.nwg + 1)

    @property
    def launch_regs(self) -> int:
        """Registers per thread at launch: 65536 / (min_blocks threads), rounded down to a multiple of 8."""
        return 65536 // (self.min_blocks * self.threads) // 8 * 8


SM90_HEADDIMS = (64, 96, 128, 256)
# FlashAttention-3's shapes per head dim (its hopper/ tile table), read to learn: 3 consumer warpgroups at
# d64 (registers: O is small), 2 above; 80-key stages at d256 so that Q + 2 stages of K and V fit 227 KB.
# O leaves through TMA stores (o_tma): 1.00-1.06x the 16-byte stores' epilogue at 512-1k, within noise at 2k
# (bench/NOTES.md).
SM90_FWD_TILES = {
    64: Sm90FwdTile(128, 3, 2, 160, 24, o_tma=True),
    96: Sm90FwdTile(128, 2, o_tma=True),
    128: Sm90FwdTile(128, 2, o_tma=True),
    256: Sm90FwdTile(80, 2, o_tma=True),
}


def sm90_fwd_tile(headdim: int, causal: bool, seqlen_k: int | None = None, mod: int = MOD_NONE) -> Sm90FwdTile:
    """The sm_90a forward tile of a head dim; with seqlen_k known (the keys a query row may see: seqlen_k, or
    max_seqlen_k of packed sequences) and no modifier (mod), the variant SM90_FWD_SHORT_TILES (at most
    SM90_FWD_SHORT_MAX_SEQLEN_K keys) or SM90_FWD_LONG_TILES (more: the first of its ranges that holds seqlen_k) names
    for the head dim and mask, if any; the modifier kernels (mod MOD_SCORE, no dropout) at SM90_FWD_CAP_MAX_HEADDIMS
    take the capped-max form (cap_max)."""
    if mod == MOD_NONE and seqlen_k is not None:
        if seqlen_k <= SM90_FWD_SHORT_MAX_SEQLEN_K:
            name = SM90_FWD_SHORT_TILES.get((headdim, bool(causal)))
        else:
            name = next((n for n, upto in SM90_FWD_LONG_TILES.get((headdim, bool(causal)), ())
                         if upto is None or seqlen_k <= upto), None)
        if name:
            return replace(SM90_FWD_TILES[headdim], **_sm90_fwd_variant_fields(headdim)[name])
    if mod == MOD_SCORE and headdim in SM90_FWD_CAP_MAX_HEADDIMS:  # (the soft-cap's capped-max form)
        return replace(SM90_FWD_TILES[headdim], cap_max=True)
    return SM90_FWD_TILES[headdim]


SM90_SMEM_PER_SM = 228 * 1024  # shared memory of an H100/H200 SM
SM90_SMEM_RESERVED = 1024  # what the driver reserves per resident block
SM90_SMEM_PER_BLOCK = 227 * 1024  # the most one block may ask for


def sm90_smem_capped() -> str | None:
    """Why the sm90 kernels are left, where CUFLASH_SMEM_PER_BLOCK plans for less shared memory per block than they
    take (a compute capability 9.0 GPU allows SM90_SMEM_PER_BLOCK: only that cap plans for less); None otherwise."""
    cap = _smem_cap()
    if cap is not None and cap < SM90_SMEM_PER_BLOCK:
        return "the host plans for less shared memory per block than the sm90 kernels take (CUFLASH_SMEM_PER_BLOCK)"
    return None


def sm90_fwd_smem_bytes(headdim: int, tile: Sm90FwdTile) -> int:
    """Q (two buffers, persistent) + stages x (K + V) in 64-column chunks, the mbarriers, the persistent form's tile
    indices and 1 KB of alignment slack (the kernel's Sm90FwdLayout::BYTES, static_asserted)."""
    dp = -(-headdim // 64) * 64
    qbuf = 2 if tile.persistent else 1
    bars = qbuf + 4 * tile.stages + (qbuf if tile.persistent else 0)
    tile_of = 8 if tile.persistent else 0  # each Q buffer's tile index
    return (qbuf * tile.block_m + 2 * tile.stages * tile.block_n) * dp * ELEM_BYTES + bars * 8 + tile_of + 1024


# Tiles with more than one block per SM (min_blocks) for short sequences, where a block runs few KV tiles and its
# prologue (barrier set-up, the Q load before the first product) and epilogue (the O store) are a visible share
# that, one block per SM, nothing hides: with two or three resident blocks they run under another block's main loop
# (bench/NOTES.md, "More than one block per SM"). Two are configured for short keys (SM90_FWD_SHORT_TILES); every one
# is reachable through an explicit tile (cuflash._fwd_sm90.make_plan / forward(tile=...); bench.diag.fwd90_minb_probe). Each is the
# configured tile of its head dim with these fields replaced, so it keeps the configured epilogue (o_tma). The
# registers: the launch allocation is 65536 / (min_blocks threads) per thread and the consumers' setmaxnreg share
# must hold S, P and O of the overlapped loop at once (fp32 S: block_n / 2 per thread, P: block_n / 4, O: D / 2)
# while ptxas still compiles each wgmma within the launch allocation (the O += P V of head dim 128, 64 accumulators
# and its operands, needs 94: no three-block d128 tile) -- so 2 consumers x 104 registers take 48-key stages (64
# spill), and one consumer warpgroup (64-row Q tiles) takes 128-key stages at two blocks (232 registers) or 64-96
# at three (136). Shared memory: min_blocks x (the layout + 1 KB per block) within the SM's 228 KB (d128: at most
# 80-key stages at two blocks).
SM90_FWD_MINB_VARIANTS = {
    64: {
        "2x2wg n48": dict(block_n=48, nwg=2, stages=2, regs_mma=104, pingpong=True, min_blocks=2),
        "2x1wg n128": dict(block_n=128, nwg=1, stages=2, regs_mma=232, pingpong=False, min_blocks=2),
        "3x1wg n64": dict(block_n=64, nwg=1, stages=2, regs_mma=136, pingpong=False, min_blocks=3),
        "3x1wg n96": dict(block_n=96, nwg=1, stages=2, regs_mma=136, pingpong=False, min_blocks=3),
    },
    128: {
        "2x1wg n64": dict(block_n=64, nwg=1, stages=2, regs_mma=232, pingpong=False, min_blocks=2),
        "2x1wg n80": dict(block_n=80, nwg=1, stages=2, regs_mma=232, pingpong=False, min_blocks=2),
    },
}


# Short keys without modifiers take a variant of the configured tile (bench/NOTES.md; FA2 grid fp16/bf16 over the
# configured tile). Head dim 64 takes a tile of 2-3 blocks per SM (bench.diag.fwd90_minb_probe: non-causal "2x2wg
# n48" 1.00-1.10x at 512-1k, 0.90-0.94x from 2k; causal "3x1wg n64" 1.20-1.34x at 512-1k, 0.94-0.98x from 2k; the
# persistent form 0.77-1.01x of them at 512-1k). Head dim 128 takes the persistent form below
# (bench.diag.fwd90_persist_probe: 1.08-1.22x at 512-1k). The modifiers keep the configured tiles.
SM90_FWD_SHORT_MAX_SEQLEN_K = 1024
SM90_FWD_SHORT_TILES = {(64, False): "2x2wg n48", (64, True): "3x1wg n64", (128, False): "persist",
                        (128, True): "persist"}
# Longer keys without modifiers: (variant, the most keys it is taken for, None: no limit). The persistent form over
# the one-tile kernel (bench.diag.fwd90_persist_probe, fp16 / bf16): head dim 64 non-causal 1.02-1.06x at 2k-16k;
# causal 1.01-1.05x at 2k-4k but 0.85-0.89x at 8k-16k (its static order pairs heavy with light causal tiles only
# approximately); head dim 128 non-causal 1.01-1.03x at 2k, 0.98-1.03x at 4k-16k (kept on the one-tile kernel);
# causal 1.02-1.11x at 2k-4k, 0.96-0.99x at 8k, 0.74-0.75x at 16k.
# Each entry is a tuple of (variant, the most keys it is taken for, None: no limit), the first that holds the key count
# taken. Head dim 128 non-causal above 2048 keys: 176-key stages (SM90_FWD_WIDE_VARIANTS), 1.03-1.06x the 128-key
# stages of the one-tile kernel at 4k-16k (bench.diag.sm90_variants, fp16 / bf16, 5 rounds).
# Head dim 128 above 1024 keys without a causal mask, and from 8192 keys causal: the persistent form with 160-key
# stages ("persist n160", the widest whose two Q buffers and two K / V stages fit 227 KB), the causal ones walking the
# tiles in order of work (SM90_PERSIST_BH_MIN_ROWS); between 4097 and 8191 causal keys the configured one-tile kernel
# (a name None: the configured tile). bench.diag.sm90_variants (5 rounds, memoized plans, fp16 / bf16): non-causal
# 1.02x the persistent 128-key form at 2k, 0.98-1.04x the one-tile 176-key stages at 4k-16k (geomean 1.01x); causal at
# 8k-16k 1.02-1.08x the one-tile kernel (with its tile walk in order of work: 1.01-1.40x the (batch, head) walk), at
# 1 x 64k 1.04x / 1.03x cuDNN with the (batch, head) walk (bf16 / fp16; sm90_persist_walk).
# Head dim 64 causal at 2k-4k after both forms took the warpgroup skip (bench.diag.sm90_variants, 5 rounds, one run):
# the one-tile kernel 0.97-1.01x the persistent form at 2k and 1.00-1.05x at 4k -- within a run's spread, so the
# persistent form stays there (bench/NOTES.md, "Hopper forward").
SM90_FWD_LONG_TILES = {(64, False): (("persist", None),), (64, True): (("persist", 4096),),
                       (128, False): (("persist n160", None),),
                       (128, True): (("persist", 4096), (None, 8191), ("persist n160", None))}
# The persistent form's tile walk (cuda_src/flash_fwd_sm90.cu, Sm90FwdTiles) for grid_order "auto": "bh" (every
# head's tile x, then x - 1, ...: causal work balanced across the blocks to about one tile) for causal calls of at
# least this many query rows, else "qtile" (a (batch, head)'s tiles together). bench.diag.sm90_variants: causal "bh"
# 1.00-1.40x "qtile" at 8k-16k (head dims 64, 128; 128-, 144- and 160-key stages), 0.88-1.05x at 2k-4k (0.88-0.99x
# for the forms configured there).
SM90_PERSIST_BH_MIN_ROWS = 8192
# ... unless the "qtile" walk balances the call's tiles about as well as "bh": its largest block's work over the mean
# within this factor of "bh"'s in the list model of the walks (persist_walk_spread). At head dim 128, 16 heads,
# 160-key stages on 132 blocks: 1 x 64k 1.015 against 1.000 (qtile), 2 x 8k 1.032 against 1.003 and 1 x 16k 1.539
# against 1.003 (bh); where the tiles fit one wave the walks are alike. "qtile" keeps a head's K / V shared through L2
# by the blocks at once: at 1 x 64k it measured 1.05x / 1.07x "bh" with 160-key stages (bf16 / fp16,
# bench.diag.sm90_variants: bench/results/sm90-variants-64k.log; bench/NOTES.md).
SM90_PERSIST_QTILE_MAX_SPREAD = 1.02


@lru_cache(maxsize=256)
def persist_walk_spread(walk: str, batch_heads: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                        grid: int) -> float:
    """The list model of the persistent form's tile walks (cuda_src/flash_fwd_sm90.cu, Sm90FwdTiles) at fixed lengths,
    causal: the largest block's work over the mean, a tile's work being the K / V tiles its rows see (bottom-right).
    Linear index t runs over x (a (batch, head)'s Q tiles, the last first) innermost for walk "qtile", over the
    (batch, head)s innermost for "bh"; block G - 1 - (t mod G) takes t in odd waves, t mod G in even ones: the fixed
    waves of persist_walk_model with groups of one and of every (batch, head), no fixed cost per tile."""
    return persist_walk_model(batch_heads if walk == "bh" else 1, False, batch_heads, seqlen_q, seqlen_k, block_m,
                              block_n, grid, fixed=0.0)


def sm90_persist_walk(causal: bool, batch_heads: int, seqlen_q: int, seqlen_k: int, tile: Sm90FwdTile,
                      grid: int) -> str:
    """The persistent form's tile walk under grid_order "auto" (fixed lengths; packed sequences keep the element
    order): "bh" for causal calls of at least SM90_PERSIST_BH_MIN_ROWS query rows where the list model finds the
    "qtile" walk's spread (persist_walk_spread) more than SM90_PERSIST_QTILE_MAX_SPREAD times "bh"'s, else "qtile"."""
    if not causal or seqlen_q < SM90_PERSIST_BH_MIN_ROWS:
        return "qtile"
    q, bh = (persist_walk_spread(w, batch_heads, seqlen_q, seqlen_k, tile.block_m, tile.block_n, grid)
             for w in ("qtile", "bh"))
    return "bh" if q > SM90_PERSIST_QTILE_MAX_SPREAD * bh else "qtile"


# The persistent form's dynamic walk (cuda_src/flash_fwd_sm90.cu: Sm90FwdWalk; cuflash/_walk.py): block b takes tile
# b, then whichever tile a counter gives it as it frees up -- greedy list scheduling, which balances the blocks'
# causal work to about one tile whatever the grid, where the fixed waves balance it exactly only where the grid and
# the tiles line up. The tiles in groups of (batch, head)s, each group's heaviest first: the K / V of a group's heads
# shared through L2 by the blocks at work, as "qtile" shares one head's. A call at fixed lengths takes it under
# grid_order "auto" where the list model (persist_walk_model, each tile's K / V tiles plus one for its prologue and
# epilogue) puts its largest block's work at least SM90_WALK_DYNAMIC_MIN_GAIN of the mean below the fixed walk's,
# with the group whose spread is lowest among the powers of two whose heads' K / V take at most
# SM90_WALK_GROUP_BYTES (the smallest such group on a tie). FA2 grid, causal, 132 blocks: head dim 64 at 2k 1.063 ->
# 1.008 (16 heads), 4k 1.034 -> 1.006; head dim 128 at 1k-4k 1.031 -> 1.002-1.020; from 8k the fixed "bh" walk is
# within 0.01 and stays. Without a mask the tiles differ only where seqlen_q is no multiple of the Q tile (a last
# tile's warpgroups without rows take their turns empty): head dim 64 at 2k and 4k (Q tiles of 192 rows: last tiles
# of 128 and 64) 1.062 -> 1.016 / 1.017, measured 1.014-1.023x the fixed walk in GPU time; head dim 128's tiles are
# all alike on the grid (python -m bench.diag.fwd90_walk_model [--no-causal]).
SM90_WALK_GROUP_BYTES = 16 << 20
SM90_WALK_DYNAMIC_MIN_GAIN = 0.01


def persist_walk_model(group: int, dynamic: bool, batch_heads: int, seqlen_q: int, seqlen_k: int, block_m: int,
                       block_n: int, grid: int, fixed: float = 1.0, causal: bool = True) -> float:
    """The list model of the persistent form's walks at fixed lengths: the largest block's work over the mean. A
    tile's work is `fixed` plus, causal, the K / V tiles its rows see (bottom-right), or, without a mask, every K / V
    tile times the share of its 64-row warpgroups that hold a row (the others take their turns empty: a last Q tile
    past seqlen_q's multiple of block_m is lighter). The tiles in the kernel's order (Sm90FwdTiles::coords: the
    (batch, head)s in groups of `group`, inside a group every member's heaviest Q tile -- causal the last, else the
    first -- then the next, ...); dealt out in fixed alternating waves of `grid` (Sm90FwdTiles::tile) or, `dynamic`,
    each to the block that frees up first."""
    import heapq

    import numpy as np

    x_tiles = -(-seqlen_q // block_m)
    group = max(1, min(group, batch_heads))
    t = np.arange(x_tiles * batch_heads, dtype=np.int64)
    first = t // (x_tiles * group) * group
    size = np.minimum(group, batch_heads - first)
    within = (t - first * x_tiles) // size
    if causal:
        x = x_tiles - 1 - within
        last = np.minimum(seqlen_k, (x + 1) * block_m + seqlen_k - seqlen_q)
        work = np.where(last > 0, -(-last // block_n), 0) + fixed
    else:
        rows = np.minimum(block_m, seqlen_q - within * block_m)
        work = -(-seqlen_k // block_n) * (-(-rows // 64)) / (block_m // 64) + fixed
    mean = work.sum() / grid
    if mean <= 0:
        return 1.0
    if not dynamic:
        pos = t % grid
        block = np.where((t // grid) % 2 == 1, grid - 1 - pos, pos)
        return float(np.bincount(block, weights=work, minlength=grid).max() / mean)
    free = [float(w) for w in work[:grid]]
    heapq.heapify(free)
    for w in work[grid:].tolist():
        heapq.heapreplace(free, free[0] + w)
    return float(max(free) / mean)


@lru_cache(maxsize=256)
def sm90_persist_dynamic(batch_heads: int, heads_per_kv: int, seqlen_q: int, seqlen_k: int, headdim: int,
                         block_m: int, block_n: int, grid: int, fixed_walk: str, causal: bool = True) -> int:
    """The dynamic walk's group for a call at fixed lengths under grid_order "auto", or 0 where the fixed walk
    `fixed_walk` (sm90_persist_walk's choice) stays (see SM90_WALK_DYNAMIC_MIN_GAIN)."""
    kv_bytes = seqlen_k * (-(-headdim // 64) * 64) * 2 * ELEM_BYTES  # a KV head's K and V
    groups, g = [], 1
    while True:
        if g > 1 and -(-g // heads_per_kv) * kv_bytes > SM90_WALK_GROUP_BYTES:
            break
        groups.append(min(g, batch_heads))
        if g >= batch_heads:
            break
        g *= 2
    model = (seqlen_q, seqlen_k, block_m, block_n, grid)
    spread = {g: persist_walk_model(g, True, batch_heads, *model, causal=causal) for g in groups}
    best = min(groups, key=lambda g: (round(spread[g], 4), g))
    fixed = persist_walk_model(batch_heads if fixed_walk == "bh" else 1, False, batch_heads, *model, causal=causal)
    return best if spread[best] <= fixed - SM90_WALK_DYNAMIC_MIN_GAIN else 0


# Stream-K (cuda_src/flash_fwd_sm90.cu, Sm90FwdStreamK; without a mask, fixed lengths): the first C / G - 1 waves of
# whole tiles go out as the fixed walk's, and the (tile, K / V tile) pairs of the rest are cut into G equal ranges,
# a tile split between two blocks merged by the one that began it. It takes the part-empty last wave off calls whose
# tile count C is no multiple of the grid G: head dim 128 on the FA2 grid (2048 tiles, 15.5 waves of 132) 1.031 ->
# 1.003-1.017 at 1k-16k in the list model (stream_k_spread). Its first form, measured against the fixed walk in GPU
# time (H200, bench/NOTES.md "Hopper forward"), gained far less than the model and lost where tiles have few K / V
# tiles; the form that carries a split tile's state (bench/results/fwd90-tail-sk.log) took 0.973-0.993 of the
# configured walk's time per tile at head dim 128, 1k-16k keys. grid_order "auto" takes it where
# SM90_FWD_SK_MIN_SEQLEN_K names the kernel head dim (sm90_fwd_stream_k_auto); the diagnostic grid_order "stream_k"
# wherever it can run (cuflash._fwd_sm90.persist_walk), and sm90_stream_k is where the list model alone would. Its
# workspace (cuflash/_walk.py) holds one partial state per (block, consumer warpgroup); SM90_SK_MAX_GRID blocks at most
# (the kernel's SM90_SK_FLAGS / 4).
SM90_SK_MAX_GRID = 256
SM90_SK_MERGE = 0.5  # a split tile's merge and its second prologue, in K / V tiles, in the list model
# Kernel head dim -> the fewest keys per sequence at which grid_order "auto" walks by stream-K (whole Q tiles only:
# the measured points; a ragged last Q tile's idle warpgroups are what the walk's equal ranges cost least well).
SM90_FWD_SK_MIN_SEQLEN_K = {128: 1024}


def sm90_fwd_stream_k_auto(headdim: int, seqlen_q: int, seqlen_k: int, block_m: int) -> bool:
    """Whether grid_order "auto" walks a persistent launch (that stream_k_eligible admits) by stream-K: a kernel head
    dim SM90_FWD_SK_MIN_SEQLEN_K names, at least that many keys, whole Q tiles."""
    least = SM90_FWD_SK_MIN_SEQLEN_K.get(headdim)
    return least is not None and seqlen_k >= least and seqlen_q % block_m == 0


def stream_k_max_per_tile(tiles: int, grid: int, bits: int) -> int:
    """The most units (K / V tiles, iterations) per tile a stream-K launch of `tiles` tiles on `grid` blocks takes so
    that the units past the whole waves times the grid stay below 2^bits (the kernels' 32-bit segment arithmetic)."""
    rest = tiles - (tiles // grid - 1) * grid
    return (2 ** bits - 1) // (rest * grid)


def stream_k_max_kv(tiles: int, grid: int) -> int:
    """The most K / V tiles per Q tile a stream-K launch of `tiles` Q tiles on `grid` blocks takes: the pairs past the
    whole waves times the grid stay below 2^31 (Sm90FwdStreamK::segment's unsigned arithmetic)."""
    return stream_k_max_per_tile(tiles, grid, 31)


def stream_k_eligible(causal: bool, packed: bool, tiles: int, n_kv: int, grid: int) -> bool:
    """Whether a persistent launch can walk by stream-K: no mask, fixed lengths, keys, more tiles than blocks and a
    part-empty last wave, a grid the flags cover, and segment arithmetic within 32 bits (stream_k_max_kv)."""
    if causal or packed or n_kv <= 0 or tiles <= grid or tiles % grid == 0 or grid > SM90_SK_MAX_GRID:
        return False
    return n_kv <= stream_k_max_kv(tiles, grid)


def stream_k_segment(block: int, grid: int, tiles: int, n_kv: int, j: int) -> tuple:
    """Segment j of block `block` under stream-K, as the kernel derives it (Sm90FwdStreamK::segment): (tile, first,
    end) -- K / V visits [first, end) of the tile in the walk's order; tile >= `tiles`: the block's walk is over. The
    whole waves are the fixed walk's (Sm90FwdTiles::tile's alternation)."""
    waves = tiles // grid - 1
    if j < waves:
        return j * grid + (grid - 1 - block if j % 2 else block), 0, n_kv
    dp = waves * grid
    s = (tiles - dp) * n_kv
    lo, hi = s * block // grid, s * (block + 1) // grid
    tt = lo // n_kv + (j - waves)
    start = max(lo, tt * n_kv)
    if start >= hi:
        return tiles, 0, 0
    return dp + tt, start - tt * n_kv, min(hi - tt * n_kv, n_kv)


def stream_k_segments(block: int, grid: int, tiles: int, n_kv: int) -> list:
    """Every segment of block `block` (stream_k_segment for j = 0, 1, ... until the walk is over)."""
    out = []
    while True:
        seg = stream_k_segment(block, grid, tiles, n_kv, len(out))
        if seg[0] >= tiles:
            return out
        out.append(seg)


def stream_k_spread(batch_heads: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, grid: int,
                    fixed: float = 1.0, merge: float = SM90_SK_MERGE) -> float:
    """The list model of the stream-K walk (no mask, fixed lengths): the largest block's work over the mean work of
    the tiles walked whole. A tile's work per K / V tile is the share of its 64-row warpgroups that hold a row (as in
    persist_walk_model); a tile or a part of one costs `fixed` more, a part `merge` more. The first C / G - 1 waves are
    the fixed walk's ("qtile" order, alternating); block b takes the pairs [b S / G, (b + 1) S / G) of the rest."""
    import numpy as np

    x_tiles = -(-seqlen_q // block_m)
    n = -(-seqlen_k // block_n)
    count = x_tiles * batch_heads
    t = np.arange(count, dtype=np.int64)
    rows = np.minimum(block_m, seqlen_q - (t % x_tiles) * block_m)
    per_kv = (-(-rows // 64)) / (block_m // 64)
    work = np.zeros(grid)
    for b in range(grid):
        for tt, i0, i1 in stream_k_segments(b, grid, count, n):
            work[b] += (i1 - i0) * per_kv[tt] + fixed + (merge if i1 - i0 < n else 0.0)
    mean = (per_kv * n + fixed).sum() / grid
    return float(work.max() / mean)


@lru_cache(maxsize=256)
def sm90_stream_k(batch_heads: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, grid: int,
                  fixed_walk: str, dynamic_group: int) -> bool:
    """Whether the list model alone would take stream-K for a launch stream_k_eligible admits (see SM90_SK_MAX_GRID;
    grid_order "auto" takes it by sm90_fwd_stream_k_auto, the measured rule, not by this): whole Q tiles only, and its
    spread at least SM90_WALK_DYNAMIC_MIN_GAIN below that of the walk it would replace (the dynamic walk's in
    `dynamic_group`, or the fixed walk `fixed_walk`). (A ragged last Q tile's work per pair is what the model guesses
    least well -- its idle warpgroups measured dearer than their share -- and equal pair counts are unequal work
    there.)"""
    if seqlen_q % block_m:
        return False
    model = (batch_heads, seqlen_q, seqlen_k, block_m, block_n, grid)
    if dynamic_group:
        other = persist_walk_model(dynamic_group, True, *model, causal=False)
    else:
        other = persist_walk_model(batch_heads if fixed_walk == "bh" else 1, False, *model, causal=False)
    return stream_k_spread(*model) <= other - SM90_WALK_DYNAMIC_MIN_GAIN


# Wider K / V stages of the one-tile kernel (FlashAttention-3 takes 176 keys at head dim 128 without a causal mask):
# more products per barrier and per softmax round; two stages of 176 keys and Q fit 214 KB. Not configured (the
# persistent 160-key form above measured as fast or faster); reachable through an explicit tile.
SM90_FWD_WIDE_VARIANTS = {128: {"n176": dict(block_n=176)}}


def sm90_fwd_minb_tiles(headdim: int) -> dict:
    """{name: Sm90FwdTile} of SM90_FWD_MINB_VARIANTS at a kernel head dim (empty where there are none): the
    configured tile with the variant's fields."""
    base = sm90_fwd_tile(headdim, False)
    return {n: replace(base, **f) for n, f in SM90_FWD_MINB_VARIANTS.get(headdim, {}).items()}


# The persistent form (Sm90FwdTile.persistent, the kernel's PERSIST; cuda_src/flash_fwd_sm90.cu and bench/NOTES.md
# "Hopper forward"): min_blocks blocks per SM walking the Q tiles, the next tile's Q and first K/V loaded under the
# current tile's epilogue, the barriers set up once. Configured for head dims 64 and 128 by key count
# (SM90_FWD_SHORT_TILES, SM90_FWD_LONG_TILES); every one is reachable through an explicit tile (cuflash._fwd_sm90.make_plan /
# forward(tile=...); bench.diag.fwd90_persist_probe). Each is the configured tile of
# its head dim with these fields: the configured epilogue (o_tma) and register split, but at d64 the 16-byte stores
# (with the TMA store NVRTC 13.0 spills 8-16 B of the three consumers' 160 registers in the causal kernel); shared
# memory holds two Q buffers (d64: 113 KB, d96 and d128: 193 KB; d256's 288 KB do not fit, so it has none). No
# dropout; the modifier kernels take them as sm90_fwd_mod_persist_tiles, where SM90_FWD_MOD_PERSIST says.
SM90_FWD_PERSIST_VARIANTS = {
    64: {"persist": dict(persistent=True, o_tma=False)},
    96: {"persist": dict(persistent=True)},
    128: {"persist": dict(persistent=True), "persist n160": dict(persistent=True, block_n=160)},
}


def sm90_fwd_persist_tiles(headdim: int) -> dict:
    """{name: Sm90FwdTile} of SM90_FWD_PERSIST_VARIANTS at a kernel head dim (empty where there are none)."""
    base = SM90_FWD_TILES[headdim]
    return {n: replace(base, **f) for n, f in SM90_FWD_PERSIST_VARIANTS.get(headdim, {}).items()}


def _sm90_fwd_variant_fields(headdim: int) -> dict:
    """{name: the fields replaced in the configured tile} of the tiles of several blocks per SM and the persistent form
    at a kernel head dim."""
    return {**SM90_FWD_MINB_VARIANTS.get(headdim, {}), **SM90_FWD_PERSIST_VARIANTS.get(headdim, {}),
            **SM90_FWD_WIDE_VARIANTS.get(headdim, {})}


def sm90_fwd_spec(dtype: str, headdim: int, causal: bool, tile: Sm90FwdTile | None = None, mod: int = 0) -> KernelSpec:
    """The sm_90a forward kernel (min_arch 90, arch_suffix "a": runs on sm_90 only); mod: see fwd_spec."""
    tile = tile or sm90_fwd_tile(headdim, causal, None, mod)
    smem = sm90_fwd_smem_bytes(headdim, tile)
    if smem > SM90_SMEM_PER_BLOCK or tile.min_blocks * (smem + SM90_SMEM_RESERVED) > SM90_SMEM_PER_SM:
        raise ValueError(f"tile {tile} at head dim {headdim}: {tile.min_blocks} block(s) of {smem} bytes of shared "
                         f"memory do not fit an SM")
    if tile.persistent and mod & MOD_DROPOUT:
        raise ValueError(f"tile {tile}: the persistent form takes no dropout (mod {mod})")
    if tile.stream_k and (causal or mod != MOD_NONE):
        raise ValueError(f"tile {tile}: stream-K takes no causal mask and no score modifier (mod {mod})")
    if tile.cap_max and mod != MOD_SCORE:
        raise ValueError(f"tile {tile}: the capped-max form is a modifier kernel's, without dropout (mod {mod})")
    b = lambda x: "true" if x else "false"  # noqa: E731
    # the trailing template arguments spelled out only as far as the last one that is not its default (MOD_NONE,
    # O_TMA false, MINB 1, PERSIST false, SK false, CAP_MAX false): the configured kernels keep their names
    pers = tile.persistent
    minb = tile.min_blocks != 1 or pers or tile.cap_max
    tail = (f"{', %d' % mod if _mod_checked(causal, mod) or tile.o_tma or minb else ''}"
            f"{', %s' % b(tile.o_tma) if tile.o_tma or minb else ''}{', %d' % tile.min_blocks if minb else ''}"
            f"{', %s' % b(pers) if pers or tile.cap_max else ''}"
            f"{', %s' % b(tile.stream_k) if tile.stream_k or tile.cap_max else ''}{', true' if tile.cap_max else ''}")
    name = (f"cuflash::flash_fwd_sm90_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_n}, {tile.nwg}, {tile.stages}, "
            f"{b(causal)}, {tile.regs_mma}, {tile.regs_load}, {b(tile.pingpong)}, {smem}{tail}>")
    return KernelSpec("flash_fwd_sm90.cu", name, tile.threads, smem, 90, "a")


# Key counts at which every configured variant is taken: no count, and each side of every range's bound.
SM90_FWD_KEY_BOUNDS = (None, SM90_FWD_SHORT_MAX_SEQLEN_K, SM90_FWD_SHORT_MAX_SEQLEN_K + 1,
                       *sorted({u + i for ranges in SM90_FWD_LONG_TILES.values() for _, u in ranges if u
                                for i in (0, 1)}))


def sm90_fwd_specs():
    """Every kernel the Hopper forward launches: the configured tiles in every mask mode, the variants taken by key
    count (SM90_FWD_SHORT_TILES, SM90_FWD_LONG_TILES), and each of them also without o_tma (an output no tensor map
    describes); the persistent ones without a mask also as stream-K's (grid_order "auto" where
    sm90_fwd_stream_k_auto takes it, and the diagnostic "stream_k")."""
    out = []
    for dt in DTYPES:
        for d in SM90_HEADDIMS:
            for c, m in (*MASK_MODES, (False, MOD_SCORE_DROPOUT)):
                tiles = [sm90_fwd_tile(d, c, n, m) for n in SM90_FWD_KEY_BOUNDS]
                for t in dict.fromkeys(tiles):
                    for u in (t, replace(t, o_tma=False)):
                        out.append(sm90_fwd_spec(dt, d, c, u, m))
                        if u.persistent and not c and m == MOD_NONE:
                            out.append(sm90_fwd_spec(dt, d, c, replace(u, stream_k=True), m))
    return list(dict.fromkeys(out))


# The modifier kernels (MOD_SCORE, no dropout) at these head dims take the capped-max form (Sm90FwdTile.cap_max):
# measured against the same tiles without it (H200, fp16, 4k and 16k, causal and not, soft-cap 50;
# bench/results/softcap-check.log), the soft-cap's cost over the plain kernel went from +40-50% to +30-41% at head
# dim 64 and from +33-41% to +20-30% at 128. Head dims 96 and 256 take it as well (their modifier kernels with it compile
# with no spill under NVRTC 13.5 and 13.0, 168 registers).
SM90_FWD_CAP_MAX_HEADDIMS = (64, 96, 128, 256)


def sm90_fwd_mod_persist_tiles(headdim: int) -> dict:
    """{name: Sm90FwdTile} of the persistent form for the modifier kernels (MOD_SCORE, no dropout) at a head dim: the
    plain kernels' persistent variants (SM90_FWD_PERSIST_VARIANTS) with the modifier tile's capped-max form. Calls
    take them where SM90_FWD_MOD_PERSIST names them (sm90_fwd_mod_tile); every one is reachable through an explicit
    tile (bench/diag/mod_tile_probe.py, tests/test_score_mods.py)."""
    cap = headdim in SM90_FWD_CAP_MAX_HEADDIMS
    return {n: replace(t, cap_max=cap) for n, t in sm90_fwd_persist_tiles(headdim).items()}


# The modifier kernels' persistent form where it measured faster than one block per tile (cuflash._fwd_sm90 takes it
# for calls of fixed lengths with the score modifiers, no dropout; bench.diag.mod_tile_probe, H100, fp16, batch x
# seqlen = 16k, two runs, each modifier's cost over the plain kernel one-tile -> persistent): at 4k keys every
# modifier at both head dims (head dim 128: window-only causal +9-10% -> -1-0%, ALiBi +13-14% -> +6-9%, soft-cap
# +28-29% -> +18-19%, without a mask +35-37% -> +23-25%; head dim 64: +7-18% -> +1-13%, soft-cap +40-44% -> +31-34%);
# above 4k only where the band has no right edge (the soft-cap without a mask: head dim 128 +25-35% -> +18-21% at
# 8k-16k on 160-key stages, head dim 64 +37-38% -> +28% at 8k, level at 16k). Causal bands from 8k stay one block per
# tile: a 4096-key window +5-16% -> +10-19%, ALiBi +0-14% -> +2-20% (the same runs). Head dim 96 (two runs of its
# own, bench/results/h100/mod-tile-probe-d96*.log): without a mask at 4k the soft-cap +35-37% -> +28-32%, the one
# point where both runs gained at every modifier of a band; with a causal band at 4k the window and ALiBi gained in
# one run and lost in the other, and from 8k the runs disagree or lose, so head dim 96 takes the persistent form only
# without a right band edge up to 4k. Keys (exclusive, inclusive], variant; up to 2k keys no variant was measured.
SM90_FWD_MOD_PERSIST = {(64, "causal"): ((2048, 4096, "persist"),), (64, "flat"): ((2048, 8192, "persist"),),
                        (96, "flat"): ((2048, 4096, "persist"),), (128, "causal"): ((2048, 4096, "persist"),),
                        (128, "flat"): ((2048, 4096, "persist"), (4096, None, "persist n160"))}


def sm90_fwd_mod_tile(headdim: int, seqlen_k: int, band: str) -> Sm90FwdTile | None:
    """The persistent tile a modifier call of fixed lengths takes (SM90_FWD_MOD_PERSIST; band: cuflash._fwd_sm90.
    mod_band's "causal" or "flat"), or None: the configured one-tile modifier kernel."""
    for lo, hi, name in SM90_FWD_MOD_PERSIST.get((headdim, band), ()):
        if lo < seqlen_k and (hi is None or seqlen_k <= hi):
            return sm90_fwd_mod_persist_tiles(headdim)[name]
    return None


def sm90_fwd_variant_specs():
    """The Hopper forward's variants the diagnostics launch: each configured modifier tile at
    SM90_FWD_CAP_MAX_HEADDIMS without the capped-max form (bench/diag/softcap_check.py's "cap", the tests'
    comparison), also without o_tma (an output no tensor map describes)."""
    out = []
    for dt in DTYPES:
        for d in SM90_FWD_CAP_MAX_HEADDIMS:
            for n in SM90_FWD_KEY_BOUNDS:
                t = replace(sm90_fwd_tile(d, False, n, MOD_SCORE), cap_max=False)
                out += [sm90_fwd_spec(dt, d, False, u, MOD_SCORE) for u in (t, replace(t, o_tma=False))]
    return list(dict.fromkeys(out))


def sm90_fwd_mod_persist_specs():
    """The modifier kernels' persistent form (sm90_fwd_mod_persist_tiles) at every head dim that has one, each also
    without o_tma (an output no tensor map describes)."""
    out = []
    for dt in DTYPES:
        for d in SM90_HEADDIMS:
            for t in sm90_fwd_mod_persist_tiles(d).values():
                out += [sm90_fwd_spec(dt, d, False, u, MOD_SCORE) for u in (t, replace(t, o_tma=False))]
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------------------ Hopper backward (sm_90a)
@dataclass(frozen=True)
class Sm90BwdTile:
    """Tile of the warp-specialized sm_90a backward (cuda_src/flash_bwd_sm90.cu): 1 producer warpgroup + 2 consumer
    warpgroups of 64 keys each (block_n = 128 keys per block), block_m query rows per Q / dO stage; split: the
    column-split form (flash_bwd_sm90_split_kernel, head dim 256): block_n = 64 keys, the consumers each holding dK
    and dV of half the columns, block_m = 64; persistent: the kernel's PERSIST (a grid of at most one block per SM
    walking the tiles, each tile's K / V load under the previous tile's epilogue); stream_k: the kernel's SK (the
    persistent form without a mask, the last waves' iterations cut into one equal range per block: Sm90BwdStreamK);
    cap_only: the modifier kernel's CAP_ONLY (tiles where the soft-cap is the only change skip the band form)."""

    block_m: int
    stages: int = 2
    regs_mma: int = 240  # setmaxnreg: 128 (regs_load + 2 regs_mma) <= 168 x 384, the launch allocation
    regs_load: int = 24  # the producer warpgroup: the loads' thread and the dQ writer's
    block_n: int = 128  # (fixed by the kernel: two consumers of 64 keys; 64 in the column-split form)
    threads: int = 384
    split: bool = False
    persistent: bool = False
    stream_k: bool = False
    cap_only: bool = False  # the modifier kernel's CAP_ONLY form (SM90_BWD_CAP_ONLY_HEADDIMS)


# The compiled head dims the sm90 backward runs (with the sm80 backward's accumulator layout: the same kernel head
# dims, kernel_headdim); 32 stays on the sm80 kernels.
SM90_BWD_HEADDIMS = (64, 96, 128, 256)
# The accumulators decide the tiles: a consumer holds dK, dV [64 keys, DP] and S^T, dP^T [64 keys, block_m] in fp32,
# 2 x 32 + 2 x 64 registers per thread either way (DP = 64 with block_m = 128; DP = 128 with block_m = 64). At 256,
# dK and dV of 64 keys x 256 columns alone would be 2 x 128: the column-split form (64 keys per block, each consumer
# 128 of the columns; the S^T / dP^T products split between the consumers by operand, P^T and dS^T through smem).
SM90_BWD_TILES = {
    64: Sm90BwdTile(128),
    96: Sm90BwdTile(64),
    128: Sm90BwdTile(64),
    256: Sm90BwdTile(64, block_n=64, split=True),
}
# The column-split form runs "atomic" (16-byte reductions from registers), "seqpar" and "ordered": its shared memory
# holds no dQ staging tile, so there is no dQ writer, and under "ordered" each consumer warp takes its turn at a Q
# tile itself (a semaphore per warp) -- without a mask in the launch's order from Q tile 0, with the causal mask KV
# tiles last first (SM90_BWD_CAUSAL_ORDER) or on the heads-inner walk. SM90_BWD_SPLIT_ORDERED: whether calls take it.
# Its kernels compile (sm90_bwd_specs) and the CPU emulation of its turns passes, but until its GPU tests have run and
# it is timed against "seqpar", calls at head dims 136-256 keep "seqpar" for deterministic=True and refuse
# dq_strategy="ordered" (cuflash._bwd_sm90.SPLIT_ORDERED forces it on, for the tests and the benchmarks).
SM90_BWD_SPLIT_ORDERED = False
# dq_strategy="ordered"'s int32 semaphores after the fp32 accumulator: one per this many accumulator rows (eight per
# 64-row Q tile, one per consumer warp of the column-split kernel; cuda_src/attn/bwd.cuh: the same number).
DQ_ORDERED_ROWS_PER_SEM = 8


def sm90_bwd_tile(headdim: int) -> Sm90BwdTile:
    return SM90_BWD_TILES[headdim]


def sm90_bwd_smem_bytes(headdim: int, tile: Sm90BwdTile) -> int:
    """K, V; stages x (Q, dO); 2 dS^T buffers; the dQ staging [block_m, headdim] fp32; stages x (lse_log2, D); the
    mbarriers; 1 KB of alignment slack (the kernel's Sm90BwdLayout::BYTES, static_asserted)."""
    dp = -(-headdim // 64) * 64
    bm, bn, st = tile.block_m, tile.block_n, tile.stages
    if tile.split:  # K, V; stages x (Q, dO); 2 P^T and 2 dS^T buffers; stages x (lse_log2, D); the mbarriers
        return ((2 * bn + 2 * st * bm) * dp * ELEM_BYTES + 4 * bn * bm * ELEM_BYTES + 2 * st * bm * 4
                + (1 + 2 * st + tile.persistent) * 8 + 1024)
    return ((2 * bn + 2 * st * bm) * dp * ELEM_BYTES + 2 * bn * bm * ELEM_BYTES + bm * headdim * 4 + 2 * st * bm * 4
            + (3 + 2 * st + tile.persistent) * 8 + 1024)


# The sm90 backward's visiting orders (cuda_src/attn/bwd.cuh: DqOrder): PLAIN for every strategy; dq_strategy
# "ordered" with the causal mask takes SM90_BWD_CAUSAL_ORDER (KV tiles last first: no block waits on another once
# they run, GQA too); Q_DESC (Q tiles last first) is the alternative bench/diag/ordered_probe.py times. Without a mask
# "ordered" takes ROT (block x visits Q tile x - s mod M at step s: no block waits on another once they all run) where
# it measured faster than PLAIN (bench/diag/ordered_probe.py --no-mask, bench/results/ordered-nomask.log, H100): one
# query head per KV head and at most SM90_BWD_ROT_MAX_TILES[kernel head dim] KV tiles per sequence, else PLAIN. ROT's
# KV tile 0 waits on the last one, so a head's blocks must be resident together: never past
# SM90_BWD_ROT_MAX_SM_FRACTION of the SMs (the fraction leaves room for other kernels on the GPU). Where a head's
# blocks do not start together -- the head whose blocks straddle the resident set, the blocks dispatched one by one as
# the previous heads' finish -- every block of it waits for the last one to start, which is what ROT lost at head dim
# 128 from 8k and with GQA (a block there holds group times the iterations): 0.86-0.93x of atomic against PLAIN's
# 0.96-0.99x. The column-split kernel (head dim 256, 64-key tiles) has a ROT kernel too, each consumer warp taking
# the turns at its own semaphore; it has no SM90_BWD_ROT_MAX_TILES entry (PLAIN_ORDER forces it) until it is timed.
DQ_ORDER_PLAIN, DQ_ORDER_Q_DESC, DQ_ORDER_KV_DESC, DQ_ORDER_ROT = 0, 1, 2, 3
# The causal "atomic" / "seqpar" kernels' walk with the Q tiles outer (last first) and the KV head's query heads inner
# (cuda_src/attn/bwd.cuh), so that with GQA the blocks of one (KV head, batch) pair that run together read each Q
# and dO tile at the same step: its kernels are compiled at every kernel head dim (sm90_bwd_heads_inner_specs). The
# host takes it with GQA (at least SM90_BWD_HEADS_INNER_MIN_HEADS query heads per KV head) where the grouped dispatch
# order is configured (sm90_bwd_causal_group > 0), in the launch's dispatch order from
# SM90_BWD_HEADS_INNER_LAUNCH_MIN_HEADS query heads per KV head on grids of more than
# SM90_BWD_HEADS_INNER_GROUPED_MAX_WAVES blocks per SM, else in the grouped one. Measured (python -m
# bench.diag.bwd_order_probe --heads-inner / --gqa-grid, H100, GPU time, bench/results/h100/bwd-heads-inner.log) as
# speed over the heads-outer walk in the launch's order, next to the grouped order g4 it replaces (query / KV heads):
#   head dim 128, 16 / 2 at 4k and 8k (256 blocks): g4 0.98-1.08, launch 1.05-1.11, grouped 1.17-1.20;
#   head dim 128, 64 / 8 at 4k and 8k (1024 blocks): g4 0.96-0.97, launch 1.03-1.08, grouped 0.90-0.99;
#   head dim 128, 32 / 8 at 2k-8k (1024 blocks): g4 1.00-1.07, launch 1.01-1.07, grouped 1.00-1.05;
#   head dim 256, 16 / 2 at 4k (512 blocks of 64 keys): g4 0.97, launch 1.31, grouped 1.15;
#   head dim 256, 16 / 8 at 8k (2 per KV head): g4 0.98, launch 0.93, grouped 0.99.
# Where a pair's blocks all fit one or two waves, the grouped order's longest blocks first keeps the tail short;
# on longer grids the launch's order runs a pair's KV tiles together, which is what the walk shares. Without GQA it
# measured 0.93-1.01 (not taken); past the grouped order's key limit (16 / 2 at 16k) 0.93-0.95 in the launch's order
# and 1.00-1.02 grouped against the heads-outer launch order configured there (not taken).
DQ_ORDER_HEADS_INNER = 4
SM90_BWD_HEADS_INNER_MIN_HEADS = 2
SM90_BWD_HEADS_INNER_LAUNCH_MIN_HEADS = 4
SM90_BWD_HEADS_INNER_GROUPED_MAX_WAVES = 2


def sm90_bwd_causal_walk(headdim: int, seqlen_k: int | None, heads_per_kv: int, blocks: int, sms: int) -> tuple:
    """(order, group) of a causal "atomic" / "seqpar" call without modifiers that runs one block per tile, `blocks` of
    them on a GPU of `sms` SMs: (DQ_ORDER_HEADS_INNER, its dispatch group) with GQA where the grouped order is
    configured (see above), else (DQ_ORDER_PLAIN, sm90_bwd_causal_group's)."""
    group = sm90_bwd_causal_group(headdim, seqlen_k)
    if group and heads_per_kv >= SM90_BWD_HEADS_INNER_MIN_HEADS:
        launch = (heads_per_kv >= SM90_BWD_HEADS_INNER_LAUNCH_MIN_HEADS
                  and blocks > SM90_BWD_HEADS_INNER_GROUPED_MAX_WAVES * sms)
        return DQ_ORDER_HEADS_INNER, 0 if launch else group
    return DQ_ORDER_PLAIN, group


SM90_BWD_CAUSAL_ORDER = DQ_ORDER_KV_DESC
# "ordered" with the causal mask and GQA: the heads-inner walk with ascending turns (KV tile j adds after 0 .. j - 1;
# cuda_src/flash_bwd_sm90.cu), the kernels and dispatch order of "atomic"'s heads-inner walk (sm90_bwd_ordered_group),
# from SM90_BWD_ORDERED_HEADS_INNER_MIN_HEADS query heads per KV head with fixed lengths. KV tiles last first keeps the
# heads-outer walk, whose blocks of a pair read a Q tile steps apart, and starts each pair's longest block last (the
# grid's tail); in the heads-inner walk every block of a pair reaches (head, Q tile) at the same step of its walk, the
# longest one first.
SM90_BWD_ORDERED_HEADS_INNER_MIN_HEADS = 2
SM90_BWD_ROT_MAX_TILES = {64: 64, 96: 32, 128: 32}
SM90_BWD_ROT_MAX_SM_FRACTION = 0.5


def sm90_bwd_ordered_order(causal: bool, mod: int, n_blocks: int, sms: int, headdim: int, group: int,
                           plain_order: int | None = None, causal_order: int | None = None) -> int:
    """The visiting order of a dq_strategy="ordered" launch of n_blocks KV tiles per (KV head, batch) (0: packed
    sequences), `group` query heads per KV head, kernel head dim `headdim`, on a GPU of `sms` SMs: with the causal
    mask causal_order (None: the configuration's, DQ_ORDER_HEADS_INNER with fixed lengths and at least
    SM90_BWD_ORDERED_HEADS_INNER_MIN_HEADS query heads per KV head, else SM90_BWD_CAUSAL_ORDER); without a mask
    plain_order (None: the configuration's, ROT where group == 1 and n_blocks <= SM90_BWD_ROT_MAX_TILES[headdim],
    else PLAIN), ROT only while a head's blocks fit (n_blocks <= SM90_BWD_ROT_MAX_SM_FRACTION x sms); PLAIN with
    modifiers (they take seqpar)."""
    if mod:
        return DQ_ORDER_PLAIN
    if causal:
        if causal_order is None:
            gqa = n_blocks > 0 and group >= SM90_BWD_ORDERED_HEADS_INNER_MIN_HEADS
            causal_order = DQ_ORDER_HEADS_INNER if gqa else SM90_BWD_CAUSAL_ORDER
        return causal_order
    if plain_order is None:
        fits = group == 1 and n_blocks <= SM90_BWD_ROT_MAX_TILES.get(headdim, 0)
        plain_order = DQ_ORDER_ROT if fits else DQ_ORDER_PLAIN
    if plain_order == DQ_ORDER_ROT and n_blocks > int(SM90_BWD_ROT_MAX_SM_FRACTION * sms):
        return DQ_ORDER_PLAIN
    return plain_order


def sm90_bwd_ordered_group(order: int, headdim: int, seqlen_k: int | None, heads_per_kv: int, blocks: int,
                           sms: int) -> int:
    """The dispatch group of a causal "ordered" launch in `order` (sm90_bwd_ordered_order's; the arguments as
    sm90_bwd_causal_walk's): on the heads-inner walk the one "atomic" takes there (its turns hold in either dispatch
    order), else 0, the launch's."""
    if order != DQ_ORDER_HEADS_INNER:
        return 0
    walk, group = sm90_bwd_causal_walk(headdim, seqlen_k, heads_per_kv, blocks, sms)
    return group if walk == DQ_ORDER_HEADS_INNER else 0
# The causal "atomic" / "seqpar" kernels' dispatch order (the kernel's GROUP): 0, the launch's (each head's KV tiles in
# turn), or the longest KV tiles first within groups of SM90_BWD_CAUSAL_GROUP (KV head, batch) pairs, which the host
# takes at the head dims SM90_BWD_CAUSAL_GROUP_HEADDIMS up to SM90_BWD_CAUSAL_GROUP_MAX_SEQLEN_K keys per sequence
# (sm90_bwd_causal_group). bench/diag/bwd_order_probe.py timed groups of 4, 8 and 16 against the launch's order on
# the FA2 grid's causal points (bench/NOTES.md, "Hopper backward"): groups of 4 +1-4% at head dim 128 from 2k to 8k
# and +17% with GQA 16/2 at 4k; at 16k -0-3% (the group's Q and dO no longer share L2), at head dim 64 -5% to +3%;
# at head dim 256 (the column-split kernel, 64-key tiles) +4-8% at 2k-4k, -1 to +4% at 8k, -1 to +2% at 16k.
SM90_BWD_CAUSAL_GROUP = 4
SM90_BWD_CAUSAL_GROUP_HEADDIMS = (128, 256)
SM90_BWD_CAUSAL_GROUP_MAX_SEQLEN_K = 8192


def sm90_bwd_grouped_headdim(headdim: int) -> bool:
    """Whether the causal kernels of this kernel head dim take the grouped order (so have a grouped kernel to
    compile)."""
    return SM90_BWD_CAUSAL_GROUP > 0 and headdim in SM90_BWD_CAUSAL_GROUP_HEADDIMS


def sm90_bwd_causal_group(headdim: int, seqlen_k: int | None) -> int:
    """The GROUP of a causal "atomic" / "seqpar" call without modifiers: SM90_BWD_CAUSAL_GROUP at the kernel head dims
    SM90_BWD_CAUSAL_GROUP_HEADDIMS and seqlen_k <= SM90_BWD_CAUSAL_GROUP_MAX_SEQLEN_K, else 0 (seqlen_k None:
    packed sequences, 0)."""
    if seqlen_k is None or not sm90_bwd_grouped_headdim(headdim):
        return 0
    return SM90_BWD_CAUSAL_GROUP if seqlen_k <= SM90_BWD_CAUSAL_GROUP_MAX_SEQLEN_K else 0


def sm90_bwd_spec(dtype: str, headdim: int, causal: bool, tile: Sm90BwdTile | None = None, mod: int = 0,
                  order: int = DQ_ORDER_PLAIN, group: int = 0) -> KernelSpec:
    """The sm_90a backward's main kernel (min_arch 90, arch_suffix "a"); mod: MOD_NONE or MOD_SCORE; order: a
    DQ_ORDER_* (not PLAIN: dq_strategy "ordered" without modifiers, Q_DESC / KV_DESC with the causal mask, ROT
    without); group: the blocks' dispatch
    order (the kernel's GROUP: 0, the launch's; > 0, causal with order PLAIN and no modifiers, the longest KV tiles
    first within groups of that many (KV head, batch) pairs)."""
    tile = tile or sm90_bwd_tile(headdim)
    smem = sm90_bwd_smem_bytes(headdim, tile)
    b = lambda x: "true" if x else "false"  # noqa: E731
    if tile.cap_only and (mod != MOD_SCORE or tile.stream_k or tile.split or order or group):
        raise ValueError(f"the CAP_ONLY form is the modifier kernel's (mod {MOD_SCORE}, 128 keys, one block per tile or "
                         f"persistent without stream-K); got mod={mod!r}, stream_k={tile.stream_k!r}, "
                         f"split={tile.split!r}, order={order!r}, group={group!r}")
    if (order not in (DQ_ORDER_PLAIN, DQ_ORDER_Q_DESC, DQ_ORDER_KV_DESC, DQ_ORDER_ROT, DQ_ORDER_HEADS_INNER)
            or (order and (mod or bool(causal) == (order == DQ_ORDER_ROT)))):
        raise ValueError(f"order must be one of 0, 1, 2, 3, 4 (1, 2, 4: causal, 3: not causal; non-zero: mod 0); got "
                         f"order={order!r}, causal={causal!r}, mod={mod!r}")
    if (not isinstance(group, int) or group < 0
            or (group and (not causal or mod or order not in (DQ_ORDER_PLAIN, DQ_ORDER_HEADS_INNER)))):
        raise ValueError(f"group must be an int >= 0 (non-zero: causal, mod 0, order 0 or 4); got group={group!r}, "
                         f"causal={causal!r}, mod={mod!r}, order={order!r}")
    if tile.persistent and (order or group):
        raise ValueError(f"the persistent form walks the launch's order (no \"ordered\", no group); got "
                         f"order={order!r}, group={group!r}")
    if tile.stream_k and (not tile.persistent or causal or mod):
        raise ValueError(f"stream-K is a persistent form without a mask; got causal={causal!r}, mod={mod!r}, "
                         f"persistent={tile.persistent!r}")
    if tile.split:
        if order not in (DQ_ORDER_PLAIN, DQ_ORDER_HEADS_INNER, DQ_ORDER_KV_DESC, DQ_ORDER_ROT):
            raise ValueError(f"the column-split tile (head dim {headdim}) visits in orders 0, 2, 3 and 4; got "
                             f"order={order!r}")
        tail = (f", {mod}, {group}, true" + (", true" if tile.stream_k else "") if tile.persistent else
                f", {mod}, {group}, false, false, {order}" if order else
                f", {mod}, {group}" if group else
                (f", {mod}" if _mod_checked(causal, mod) else ""))
        name = (f"cuflash::flash_bwd_sm90_split_kernel<{CTYPE[dtype]}, {headdim}, {tile.stages}, {b(causal)}, "
                f"{tile.regs_mma}, {tile.regs_load}, {smem}{tail}>")
        return KernelSpec("flash_bwd_sm90.cu", name, tile.threads, smem, 90, "a")
    tail = (f", {mod}, {order}, {group}, true" + (", true" if tile.stream_k else ", false, true" if tile.cap_only else "")
            if tile.persistent else
            f", {mod}, 0, 0, false, false, true" if tile.cap_only else
            f", {mod}, {order}, {group}" if group else
            f", {mod}, {order}" if order else (f", {mod}" if _mod_checked(causal, mod) else ""))
    name = (f"cuflash::flash_bwd_sm90_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.stages}, {b(causal)}, "
            f"{tile.regs_mma}, {tile.regs_load}, {smem}{tail}>")
    return KernelSpec("flash_bwd_sm90.cu", name, tile.threads, smem, 90, "a")


# The persistent form (Sm90BwdTile.persistent) of the plain and causal kernels without modifiers, at these kernel head
# dims; sm90_bwd_persistent says which calls take it.
SM90_BWD_PERSIST_HEADDIMS = (64, 128, 256)
# (kernel head dim, causal) -> the most keys per sequence a call may have to take the persistent form; pairs not
# listed keep one block per tile. Measured in GPU time against one block per tile (python -m
# bench.diag.bwd_persist_probe, bench/results/bwd-persist-probe.log), head dims 64 / 128: 1.01-1.07x at 512-1k,
# 0.99-1.04x at 2k (causal head dim 64 1.03-1.04x), 0.98-1.02x at 4k (causal head dim 64 1.01-1.02x), 0.97-1.01x from
# 8k (head dim 64 causal 16k 0.93-0.98x; the per-tile set-up it hides weighs less as blocks get longer, and its
# consumers hold 232 registers, not 240); head dim 256 (the column-split kernel, fp16): 1.01-1.05x at every length
# without a mask (512-16k) and 1.01-1.04x causal at 512-4k. Under the causal mask at head dim 256 from 8k and at head
# dim 128 at 16k its static walk leaves the blocks unequal: 0.63-0.72x (bench/diag/bwd_grid_model.py,
# persistent_overhead). The limits are the longest measured lengths where it measured ahead.
SM90_BWD_PERSIST_MAX_SEQLEN_K: dict = {(64, False): 2048, (64, True): 4096, (128, False): 2048, (128, True): 2048,
                                       (256, False): 16384, (256, True): 4096}
# The persistent form of the score-modifier kernels (MOD_SCORE: the band, soft-cap and ALiBi per tile), at these kernel
# head dims: at 64 its consumers fit 232 registers with the float parameter slots and a warp-uniform consumer index
# (96 and 128 spill 36 B with serialized wgmmas; bench/NOTES.md, "Score modifiers"). Kernel head dim -> the most keys
# per sequence a modifier call without the soft-cap takes it at. Measured at head dim 64 (H100, bench.diag.
# bwd_mod_probe, causal, 2k-16k), one block per tile -> persistent, over the configured plain kernel: ALiBi +11.2 ->
# +5.8% (2k) and +9.5 -> +4.8% (4k), a window hiding nothing +9.1 -> +3.7% and +6.9 -> +3.6%, the 4096-key window
# +9.6 -> +4.8% and +8.2 -> +5.5%; at 8k 0.7-2.9 points (within the probe's spread), at 16k worse. Soft-capped calls
# take SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K instead: the persistent form in its CAP_ONLY form (Sm90BwdTile.cap_only), where
# the band form's persistent kernel measured behind the one-block CAP_ONLY kernel by 6-17 points.
SM90_BWD_PERSIST_MOD_HEADDIMS = (64,)
SM90_BWD_PERSIST_MOD_MAX_SEQLEN_K: dict = {64: 4096}
# Kernel head dim -> the most keys per sequence a soft-capped modifier call takes the persistent CAP_ONLY form at (the
# CAP_ONLY form configured at that head dim, SM90_BWD_CAP_ONLY_HEADDIMS); head dims not listed keep one block per tile.
# Measured at head dim 64 (H100, bench.diag.bwd_mod_probe, causal, soft-cap 50, two runs), its time against the
# one-block CAP_ONLY kernel's: 0.956 / 0.947 (2k), 0.986 / 0.990 (4k), 0.974 / 0.966 (8k), 1.000 / 0.992 (16k); the
# soft-cap's cost over the configured plain kernel +25.3 -> +19.8% and +24.1 -> +17.5% at 2k, +25.4 -> +23.7% and
# +20.2 -> +19.0% at 4k, +22.7 -> +19.5% and +24.1 -> +19.9% at 8k. 16k, within the runs' spread, keeps one block per
# tile.
SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K: dict = {64: 8192}


def sm90_bwd_persist_tile(headdim: int) -> Sm90BwdTile:
    """The persistent form of the head dim's tile. Its producer warpgroup walks the tiles (in the 128-key kernel the
    loads' thread and the dQ writer), which does not fit 24 registers (72-140 B of spills): 40, and the consumers
    232."""
    return replace(sm90_bwd_tile(headdim), persistent=True, regs_mma=232, regs_load=40)


def sm90_bwd_persistent(headdim: int, causal: bool, mod: int, order: int, seqlen_k: int | None,
                        softcap: bool = False) -> bool:
    """Whether a call of this kernel head dim takes the persistent form: order 0, fixed lengths, at most
    SM90_BWD_PERSIST_MAX_SEQLEN_K[(headdim, causal)] keys without modifiers, SM90_BWD_PERSIST_MOD_MAX_SEQLEN_K[headdim]
    with the score modifiers (mod MOD_SCORE) when the soft-cap is off, SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K[headdim] when it
    is on (the persistent CAP_ONLY form)."""
    if mod:
        limit = (SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K if softcap else SM90_BWD_PERSIST_MOD_MAX_SEQLEN_K).get(headdim)
    else:
        limit = SM90_BWD_PERSIST_MAX_SEQLEN_K.get((headdim, bool(causal)))
    return (limit is not None and headdim in sm90_bwd_persist_headdims(mod) and not order and seqlen_k is not None
            and seqlen_k <= limit)


def sm90_bwd_persist_headdims(mod: int) -> tuple:
    """The kernel head dims that have a persistent form for calls of this MOD: SM90_BWD_PERSIST_HEADDIMS without
    modifiers, SM90_BWD_PERSIST_MOD_HEADDIMS with the score modifiers, none with dropout."""
    return SM90_BWD_PERSIST_HEADDIMS if not mod else SM90_BWD_PERSIST_MOD_HEADDIMS if mod == MOD_SCORE else ()


# Stream-K (Sm90BwdTile.stream_k, the kernels' SK; cuda_src/flash_bwd_sm90.cu Sm90BwdStreamK): the persistent form
# without a mask, its last waves' (query head, Q tile) iterations cut into one equal range per block, so that the
# part-empty last wave of a tile count that is no multiple of the grid (the FA2 grid at head dims 64, 128 and 256:
# 4096, 2048 and 2048 tiles on 132 SMs, 3.1% of the time in the list model) is spread over every block; a tile split
# between two blocks is finished by the one that began it, adding the other's partial dK, dV from the workspace
# (cuflash/_walk.py). The walk is the forward's (stream_k_segment, with a tile's iterations for its K / V tiles), in
# 32-bit arithmetic (sm90_bwd_stream_k_max_iters). SM90_BWD_SK_SEQLEN_K: kernel head dim -> (fewest, most) keys per
# sequence where calls take it (elsewhere only where forced, cuflash._bwd_sm90.STREAM_K). Measured against the
# persistent form's fixed walk in GPU time (H200, FA2 grid, 1k-16k, fp16 and bf16; bench/results/bwd-sk-probe.log):
# head dim 256 0.969-0.991 of its time (1.009-1.032x the speed) at every point; head dim 128 0.977-1.028 and head dim
# 64 1.013-1.072 (slower at most points), which stay on the fixed walk.
SM90_BWD_SK_HEADDIMS = (64, 128, 256)
SM90_BWD_SK_SEQLEN_K: dict = {256: (1024, 16384)}
SM90_BWD_SK_MAX_GRID = 4 * SM90_SK_MAX_GRID  # one int flag per block in the workspace's flags (the forward's 4 KB)


def sm90_bwd_stream_k_max_iters(tiles: int, grid: int) -> int:
    """The most iterations per tile a stream-K launch of `tiles` tiles on `grid` blocks takes: the iterations past the
    whole waves times the grid stay below 2^32 (Sm90BwdStreamK::segment's unsigned arithmetic)."""
    return stream_k_max_per_tile(tiles, grid, 32)


def sm90_bwd_stream_k_eligible(headdim: int, causal: bool, mod: int, seqlen_k: int | None, tiles: int, grid: int,
                               iters: int) -> bool:
    """Whether a backward launch can take stream-K: kernel head dim 64, 128 or 256, no mask, fixed lengths, more tiles
    than blocks and a part-empty last wave, a grid the flags cover, and `iters` iterations per tile ((query head, Q tile)
    pairs) within the segment arithmetic's 32 bits (sm90_bwd_stream_k_max_iters)."""
    return (headdim in SM90_BWD_SK_HEADDIMS and not causal and not mod and seqlen_k is not None and tiles > grid
            and tiles % grid != 0 and grid <= SM90_BWD_SK_MAX_GRID
            and 0 < iters <= sm90_bwd_stream_k_max_iters(tiles, grid))


def sm90_bwd_stream_k(headdim: int, causal: bool, mod: int, seqlen_k: int | None, tiles: int, grid: int,
                      iters: int) -> bool:
    """Whether the configuration takes stream-K for such a launch (SM90_BWD_SK_SEQLEN_K)."""
    rng = SM90_BWD_SK_SEQLEN_K.get(headdim)
    return (rng is not None and sm90_bwd_stream_k_eligible(headdim, causal, mod, seqlen_k, tiles, grid, iters)
            and rng[0] <= seqlen_k <= rng[1])


def sm90_bwd_stream_k_tile(headdim: int) -> Sm90BwdTile:
    """The stream-K form of the head dim's persistent tile: the same shared memory; in the 128-key kernel the
    registers of one block per tile (24 for the producer warpgroup, 240 for the consumers): its walk reads every count
    from the parameters at each use (the kernel's Sm90BwdTiles<BLOCK_N, true>), which is what fits the producer in 24
    (reading them once, it spilled 188-212 B; the persistent form's fixed walk 36-72 B). The column-split kernel's
    producer (its rotated Q-tile walk) still spilled 36-48 B at 24: the persistent tile's 40 / 232."""
    t = replace(sm90_bwd_persist_tile(headdim), stream_k=True)
    return t if t.split else replace(t, regs_mma=240, regs_load=24)


# The CAP_ONLY form of the modifier kernels (Sm90BwdTile.cap_only; cuda_src/flash_bwd_sm90.cu): on the tiles where
# the soft-cap is the only change (inside the band, no element hidden, no ALiBi: Mask::cap_only) the P loop caps the
# raw scores itself and takes the derivative as 1 - tanh^2, where the modifier kernel runs apply_t's band form and
# softcap_grad_of (ALiBi's distance with a zero slope, the -inf test and its select): about 5 instructions per score
# for the soft-cap instead of 11.6 (Nsight Compute, bench/results/ncu-softcap.log), the same values bitwise. Kernel
# head dims whose calls take it (cuflash._bwd_sm90.CAP_ONLY forces it on or off): 64 and 128, timed against the band
# form by python -m bench.diag.softcap_check --bwd (bench/results/softcap-check-bwd.log: on an H100 at 4k and 16k the
# soft-cap's cost over the plain backward went from +40-58% to +28-38% at head dim 64, from +22-27% to +13-20% at 128)
# and checked bitwise by tests/test_score_mods.py::test_backward_cap_only_form (at 96 as well, which computes the same
# values with the same work saved per score).
SM90_BWD_CAP_ONLY_HEADDIMS: tuple = (64, 96, 128)


# 80-row Q tiles at head dim 128 without a mask (FlashAttention-3's Hopper backward tile there; the kernel's
# BLOCK_M = 80): S^T and dP^T are m64n80 products, dQ is computed transposed (dQ^T = K^T dS^T: wgmma's M is 64) from
# dS stored K-major by stmatrix.trans, and staged in the T layout of the fp32 accumulator (cuda_src/attn/bwd.cuh), which
# its own convert kernel reads (bwd_convert_t_spec). A Q tile's iteration does 25% more work for the same hand-offs
# (stage barriers, the consumers' named barrier, the dQ staging and its bulk reduction), and the shared-memory operand
# reads of the three products with both operands in shared memory fall from 5 / 4.5 of the tensor pipe's rate; the
# last Q tile of a head is partial (2048 rows: 26 tiles of 80, 1.6% of the rows padding). Shared memory 231736 B of
# the 232448. "atomic" and "seqpar", one block per tile (the persistent form's 232 consumer registers serialize its
# wgmma: ptxas C7512); "ordered" keeps the 64-row tile (its semaphores count 64-row blocks). The workspace's rows per
# head: a multiple of 80 rounded up to BWD_ROW_PAD (sm90_bwd_sq_pad). SM90_BWD_M80_SEQLEN_K: kernel head dim ->
# (fewest, most) keys per sequence where calls take it (in place of the persistent form, too); elsewhere only where
# cuflash._bwd_sm90.M80 forces it. Measured against the 64-row tile as configured (bench.diag.bwd_m80_probe, GPU time,
# FA2 grid at head dim 128 without a mask, 1k-16k, fp16 and bf16, and GQA 64 / 8 at 8k; three runs on an H100,
# bench/results/h100/bwd-m80-probe*.log): 1.000-1.040x at 31 of the 33 points (1k-4k 1.000-1.018x, 8k-16k up to
# 1.040x), 0.971x and 0.988x at bf16 8k and 16k in one run.
SM90_BWD_M80_HEADDIMS = (128,)
SM90_BWD_M80_ROWS = 80
SM90_BWD_M80_SEQLEN_K: dict = {128: (1024, 1 << 30)}
# Its persistent form (at most one block per SM walking the tiles, each tile's K / V load under the previous tile's
# end; Sm90BwdTile.persistent) at the same 240 / 24 registers: the producer warpgroup fits its 24 only with the loads
# walked by a whole warp (lane 0 issuing: the walk's state in uniform registers) and the walk's counts read at each use
# (cuda_src/flash_bwd_sm90.cu, Sm90BwdLayout::WARP_LOADS, Sm90BwdTiles' LEAN). SM90_BWD_M80_PERSIST_SEQLEN_K: kernel
# head dim -> (fewest, most) keys per sequence where calls of the 80-row tile take it; elsewhere only where
# cuflash._bwd_sm90.PERSIST forces it (with M80). Measured against one block per tile (bench.diag.bwd_m80_probe, GPU
# time, H100, bench/results/h100/bwd-m80p-probe.log): 0.984-1.004x at 1k-4k, 0.981-1.014x at 8k-16k, GQA 64 / 8 at 8k
# 0.966x, so no call takes it.
SM90_BWD_M80_PERSIST_SEQLEN_K: dict = {}


def sm90_bwd_m80_tile(headdim: int, persistent: bool = False) -> Sm90BwdTile:
    """The 80-row form of the head dim's tile (persistent: its persistent form)."""
    return replace(sm90_bwd_tile(headdim), block_m=SM90_BWD_M80_ROWS, persistent=persistent)


def sm90_bwd_m80_persistent(headdim: int, seqlen_k: int | None) -> bool:
    """Whether the configuration runs a call of the 80-row tile in its persistent form
    (SM90_BWD_M80_PERSIST_SEQLEN_K)."""
    rng = SM90_BWD_M80_PERSIST_SEQLEN_K.get(headdim)
    return rng is not None and seqlen_k is not None and rng[0] <= seqlen_k <= rng[1]


def sm90_bwd_m80_eligible(headdim: int, causal: bool, mod: int, strategy: str | None, seqlen_k: int | None) -> bool:
    """Whether a call can take the 80-row tile: kernel head dim in SM90_BWD_M80_HEADDIMS, no mask and no modifiers,
    fixed lengths, dq_strategy "atomic" or "seqpar"."""
    return (headdim in SM90_BWD_M80_HEADDIMS and not causal and not mod and seqlen_k is not None
            and strategy in ("atomic", "seqpar"))


def sm90_bwd_m80(headdim: int, causal: bool, mod: int, strategy: str | None, seqlen_k: int | None) -> bool:
    """Whether the configuration takes the 80-row tile for such a call (SM90_BWD_M80_SEQLEN_K)."""
    rng = SM90_BWD_M80_SEQLEN_K.get(headdim)
    return (rng is not None and sm90_bwd_m80_eligible(headdim, causal, mod, strategy, seqlen_k)
            and rng[0] <= seqlen_k <= rng[1])


def sm90_bwd_sq_pad(seqlen_q: int, block_m: int) -> int:
    """Rows per (batch element, head) of the backward's fp32 row buffers: a multiple of BWD_ROW_PAD that holds whole Q
    tiles of block_m rows (a Q tile's bulk reduction must not reach the next head's rows)."""
    rows = -(-seqlen_q // block_m) * block_m
    return -(-rows // BWD_ROW_PAD) * BWD_ROW_PAD


def sm90_bwd_m80_specs():
    """The 80-row kernels (one block per tile and persistent) and their convert, both dtypes: compiled with the
    configured kernels (CI's compile pass) whether or not a call takes them."""
    return ([sm90_bwd_spec(dt, d, False, sm90_bwd_m80_tile(d, pers)) for dt in DTYPES for d in SM90_BWD_M80_HEADDIMS
             for pers in (False, True)] +
            [bwd_convert_t_spec(dt, d, SM90_BWD_M80_ROWS) for dt in DTYPES for d in SM90_BWD_M80_HEADDIMS])


def sm90_bwd_cap_only_variant_specs():
    """The CAP_ONLY form of the modifier kernels at the kernel head dims of 128-key tiles (64, 96, 128), one block per
    tile, and of the persistent modifier kernels (SM90_BWD_PERSIST_MOD_HEADDIMS), both dtypes: compiled with the
    configured kernels (CI's compile pass) whether or not a call takes them."""
    return [sm90_bwd_spec(dt, d, False, replace(t, cap_only=True), MOD_SCORE) for dt in DTYPES
            for d in SM90_BWD_HEADDIMS if not sm90_bwd_tile(d).split
            for t in (sm90_bwd_tile(d),) + ((sm90_bwd_persist_tile(d),) if d in SM90_BWD_PERSIST_MOD_HEADDIMS else ())]


def sm90_bwd_heads_inner_specs():
    """The causal kernels of DQ_ORDER_HEADS_INNER's walk the host can launch: every kernel head dim, in the launch's
    dispatch order and, where the causal kernels take the grouped one (sm90_bwd_causal_group), in that."""
    return [sm90_bwd_spec(dt, d, True, order=DQ_ORDER_HEADS_INNER, group=g) for dt in DTYPES for d in SM90_BWD_HEADDIMS
            for g in ((0, SM90_BWD_CAUSAL_GROUP) if sm90_bwd_grouped_headdim(d) else (0,))]


def sm90_bwd_specs():
    """The sm90 backward's kernels: every mask mode, "ordered"'s causal kernels (SM90_BWD_CAUSAL_ORDER) and its ROT
    kernels without a mask (every head dim, the column-split kernel's included), the
    grouped causal kernels (sm90_bwd_causal_group), the causal kernels of the heads-inner walk, the persistent forms
    of the plain and causal kernels (which
    walk the launch's order: a static walk of the grouped order, longest tiles first, leaves the blocks of a causal
    call far more unequal) and the stream-K forms of the plain ones."""
    persist = [sm90_bwd_spec(dt, d, c, sm90_bwd_persist_tile(d)) for dt in DTYPES for d in SM90_BWD_PERSIST_HEADDIMS
               for c in (False, True)]
    persist += [sm90_bwd_spec(dt, d, False, sm90_bwd_stream_k_tile(d)) for dt in DTYPES for d in SM90_BWD_SK_HEADDIMS]
    persist += [sm90_bwd_spec(dt, d, False, sm90_bwd_persist_tile(d), mod=MOD_SCORE) for dt in DTYPES
                for d in SM90_BWD_PERSIST_MOD_HEADDIMS]
    return ([sm90_bwd_spec(dt, d, c, mod=m) for dt in DTYPES for d in SM90_BWD_HEADDIMS for c, m in MASK_MODES] +
            [sm90_bwd_spec(dt, d, True, order=SM90_BWD_CAUSAL_ORDER) for dt in DTYPES for d in SM90_BWD_HEADDIMS] +
            [sm90_bwd_spec(dt, d, False, order=DQ_ORDER_ROT) for dt in DTYPES for d in SM90_BWD_HEADDIMS] +
            [sm90_bwd_spec(dt, d, True, group=SM90_BWD_CAUSAL_GROUP) for dt in DTYPES
             for d in SM90_BWD_HEADDIMS if sm90_bwd_grouped_headdim(d)] + sm90_bwd_heads_inner_specs() + persist +
            sm90_bwd_cap_only_variant_specs() + sm90_bwd_m80_specs())


@dataclass(frozen=True)
class DecodeTile:
    """Tile of the dedicated split-KV decode kernel (cuda_src/flash_decode.cu): every warp holds all
    16 * mf query rows and streams its own warp tiles of block_n keys through a private ring of `stages`
    cp.async stages (the file header has the bytes-in-flight arithmetic)."""

    block_n: int  # keys per warp tile (multiple of 16)
    nwarps: int  # warps per block; the split's warp tiles are dealt round-robin to them
    stages: int  # cp.async ring depth per warp (>= 2)
    swizzle: bool = False  # the kernel's SWZ: K / V ring rows unpadded, 16-byte chunks XOR-swizzled (RingSwizzle)


# Decode-kernel tiles per head dim: ~8 KB of K + V per warp tile (6 KB at d96, 4 KB at d32, 16 KB at d256)
# and a shared-memory footprint of 81-113 KB, so that 2 blocks fit an sm_90 SM (228 KB) and 1 an sm_80 SM
# (164 KB): 96-144 KB of K/V in flight per SM on the H200. Head dim 128: 16 KB warp tiles, 2 stages, 140 KB
# (1 block per SM, so the split heuristic fills 132 slots, not 264): the decode_sweep (bench/NOTES.md)
# measured it best or within 1% of the best on every case, and 4-6% faster than
# 16x4w-3st (2 blocks per SM) for MQA at batch 8 with a 128k cache. The rings are swizzled, not padded (swizzle:
# 0.88-0.94x the padded rows' time on the 1-4 GB caches at d128, bench/NOTES.md "Decode"); without the padding
# the footprints are 67-135 KB, and d32's 67 KB lets 3 blocks share an sm_90 SM (2 with the padded rows).
DECODE_KERNEL_TILES = {
    32: DecodeTile(32, 4, 4, swizzle=True),
    64: DecodeTile(32, 4, 3, swizzle=True),
    96: DecodeTile(16, 4, 4, swizzle=True),
    128: DecodeTile(32, 4, 2, swizzle=True),
    256: DecodeTile(16, 2, 3, swizzle=True),
}
# The tile a head dim whose configured tile holds one block per SM takes where resident blocks matter more than the
# ring depth (cuflash.decode: a grid of more blocks than one wave of the configured tile, and paged caches): two
# blocks per SM, so one block's set-up and epilogue run under the other's loads. Head dim 128: 16 keys x 4 warps x 2
# stages (70-80 KB; bench/NOTES.md "Decode", the short steps).
DECODE_WIDE_TILES = {128: DecodeTile(16, 4, 2, swizzle=True)}
# The wide tile with a deeper ring, for a contiguous cache whose blocks each read few keys in several waves of the wide
# tile (cuflash.decode.decode_auto_tile: at most DEEP_MAX_ROUNDS block rounds): there a block is mostly its first
# loads, and a third stage puts more of them in flight at its start. Still two blocks per SM. Head dim 128: 16 keys x
# 4 warps x 3 stages (bench/NOTES.md "Decode": 1.5-2.5% faster on the 1k steps at batch 64, 1-2% slower on long
# splits and on the paged small step).
DECODE_DEEP_TILES = {128: DecodeTile(16, 4, 3, swizzle=True)}
# Row fragments per block: mf = 1 (16 rows) for <= 16 query rows, 2 (32 rows) above; head dim 256 keeps
# mf = 1 (its O accumulator alone is 128 registers per m16 fragment) and uses several m-blocks instead.
DECODE_MAX_MF = {32: 2, 64: 2, 96: 2, 128: 2, 256: 1}


def decode_tile(headdim: int) -> DecodeTile:
    """The decode kernel's tile of a head dim (DECODE_KERNEL_TILES; one table for sm_80 and sm_90: the
    footprints above fit both)."""
    return DECODE_KERNEL_TILES[headdim]


def decode_mf(headdim: int, rows: int) -> int:
    """Row fragments of the decode kernel for `rows` query rows per (batch, head) (GQA group or seqlen_q)."""
    return 1 if rows <= 16 else DECODE_MAX_MF[headdim]


def decode_smem_bytes(headdim: int, tile: DecodeTile, mf: int) -> int:
    """Q tile + NWARPS x STAGES x (K, V) warp tiles, rows padded (the rings' unpadded with tile.swizzle); the
    cross-warp combine (fp32 O_w rows of headdim + 8, and m_w, l_w, c_w) reuses the rings. Mirrors DecodeSmem in
    cuda_src/flash_decode.cu."""
    lds = headdim + SMEM_ROW_PAD
    block_m = 16 * mf
    ring = tile.nwarps * tile.stages * 2 * tile.block_n * (headdim if tile.swizzle else lds) * ELEM_BYTES
    red = tile.nwarps * block_m * (headdim + 8 + 3) * 4
    return block_m * lds * ELEM_BYTES + max(ring, red)


def decode_ua_tile(headdim: int) -> DecodeTile:
    """The UA decode kernel's tile (rows that are not 16-byte units): the configured one with the padded ring (its
    chunks land at any 16-byte slot of a padded row; the swizzle pairs 32-byte global sectors that such rows do not
    have)."""
    return replace(decode_tile(headdim), swizzle=False)


def decode_spec(dtype: str, headdim: int, causal: bool, mf: int = 1, tile: DecodeTile | None = None,
                mod: int = 0, paged: bool = False, ua: bool = False) -> KernelSpec:
    """The dedicated decode kernel (cuda_src/flash_decode.cu: flash_decode_kernel); mod: see fwd_spec; paged: the
    paged-cache kernel (its K/V loads look up a block table); ua: rows that are not 16-byte units (the UA kernel:
    MOD_SCORE, not causal, a padded ring; tile default decode_ua_tile)."""
    if ua and (causal or mod != MOD_SCORE or tile is not None and tile.swizzle):
        raise ValueError(f"the UA decode kernel runs mod={MOD_SCORE}, not causal, a padded ring; got mod={mod!r}, "
                         f"causal={causal!r}, tile={tile!r}")
    tile = tile or (decode_ua_tile(headdim) if ua else decode_tile(headdim))
    smem = decode_smem_bytes(headdim, tile, mf)
    mod = _mod_checked(causal, mod)
    tail = (f", {mod}, {'true' if paged else 'false'}, false, true" if ua else
            f", {mod}, {'true' if paged else 'false'}, true" if tile.swizzle else f", {mod}, true" if paged
            else f", {mod}" if mod else "")
    name = (f"cuflash::flash_decode_kernel<{CTYPE[dtype]}, {headdim}, {mf}, {tile.block_n}, {tile.nwarps}, "
            f"{'true' if causal else 'false'}, {tile.stages}, {smem}{tail}>")
    return KernelSpec("flash_decode.cu", name, tile.nwarps * 32, smem)


def decode_family(dtype: str, headdim: int, causal: bool, mod: int) -> list:
    """The decode kernels of one (dtype, head dim, mask mode): every row-fragment count, contiguous and paged, with
    the configured tile and, where the head dim has one, DECODE_WIDE_TILES' tile; DECODE_DEEP_TILES' tile contiguous
    only (a paged plan never takes it)."""
    tiles = [(None, (False, True))] + ([(DECODE_WIDE_TILES[headdim], (False, True))]
                                      if headdim in DECODE_WIDE_TILES else [])
    tiles += [(DECODE_DEEP_TILES[headdim], (False,))] if headdim in DECODE_DEEP_TILES else []
    return [decode_spec(dtype, headdim, causal, mf, t, mod, pg) for t, paged in tiles for pg in paged
            for mf in range(1, DECODE_MAX_MF[headdim] + 1)]


def decode_specs():
    """Every decode-kernel configuration the package can launch."""
    return [s for dt in DTYPES for d in HEADDIMS for causal, m in MASK_MODES for s in decode_family(dt, d, causal, m)]


# The padded rows (DecodeTile(..., swizzle=False): the decode ring before the swizzle) stay reachable through an
# explicit tile (cuflash.decode.plan_for(..., tile=...); bench.diag.decode_swizzle_probe compares the two).
def decode_padded_specs():
    """Every configured decode kernel with the padded rows instead of the swizzled ring."""
    return [decode_spec(s_dt, d, causal, mf, replace(decode_tile(d), swizzle=False), m, pg)
            for s_dt in DTYPES for d in HEADDIMS for causal, m in MASK_MODES for pg in (False, True)
            for mf in range(1, DECODE_MAX_MF[d] + 1)]


COMBINE_ROWS_PER_BLOCK = 4  # one warp per output row, 4 warps per block


def combine_spec(dtype: str, headdim: int) -> KernelSpec:
    """The split-KV forward's combine (cuda_src/flash_fwd.cu): one warp per output row walking the splits."""
    return KernelSpec("flash_fwd.cu", f"cuflash::flash_combine_kernel<{CTYPE[dtype]}, {headdim}>",
                      32 * COMBINE_ROWS_PER_BLOCK, 0)


# The decode kernel's combine (cuda_src/flash_decode.cu: flash_decode_combine_kernel): one block per output row,
# COMBINE_SPLIT_GROUPS groups of splits x headdim / 4 column groups; at most DECODE_MAX_SPLITS splits (the kernel's
# shared weights and unrolled loads; the host's decode.MAX_SPLITS).
COMBINE_SPLIT_GROUPS = 8
DECODE_MAX_SPLITS = 128


def decode_combine_spec(dtype: str, headdim: int, ua: bool = False) -> KernelSpec:
    """The block combine; ua: O's rows are not 16-byte units (stored element by element)."""
    tail = ", true" if ua else ""
    return KernelSpec("flash_decode.cu", f"cuflash::flash_decode_combine_kernel<{CTYPE[dtype]}, {headdim}{tail}>",
                      COMBINE_SPLIT_GROUPS * headdim // 4, 0)


# The decode kernel's combine for at most COMBINE_ROWS_MAX_SPLITS splits (flash_decode_combine_rows_kernel): one warp
# per output row, COMBINE_ROWS_WARPS rows per block (many rows of few splits: MQA and GQA at large batch). Its wide
# form (the kernel's MAXS = COMBINE_ROWS_WIDE_SPLITS) takes up to 16 splits at head dims up to
# COMBINE_ROWS_WIDE_MAX_HEADDIM (a lane's 16 float4 loads in flight in 96 registers at head dim 128; at 256 ptxas
# interleaves them with the sums); "auto" takes it for 9-16 splits there (measured against the block combine in
# CUDA-graph replay, bench/results/decode-small-fused.log: MQA at batch 8 with 128k keys, 16 splits, 131.90 against
# 132.96 us per step; 8 KV heads at batch 1 with 4k keys, 16 splits, 8.24 against 8.41 us), the block combine above.
COMBINE_ROWS_MAX_SPLITS = 8
COMBINE_ROWS_WIDE_SPLITS = 16
COMBINE_ROWS_WIDE_MAX_HEADDIM = 128
COMBINE_ROWS_WARPS = 8




def combine_rows_max_splits(headdim: int) -> int:
    """The most splits the rows combine takes at a kernel head dim (its wide form where it has one)."""
    return COMBINE_ROWS_WIDE_SPLITS if headdim <= COMBINE_ROWS_WIDE_MAX_HEADDIM else COMBINE_ROWS_MAX_SPLITS


def decode_combine_rows_spec(dtype: str, headdim: int, splits: int = COMBINE_ROWS_MAX_SPLITS,
                             ua: bool = False) -> KernelSpec:
    """The rows combine for `splits` splits: its form of COMBINE_ROWS_MAX_SPLITS up to that many, else the wide
    one; ua: O's rows are not 16-byte units."""
    if not 1 <= splits <= combine_rows_max_splits(headdim):
        raise ValueError(f"the rows combine takes at most {combine_rows_max_splits(headdim)} splits at head dim "
                         f"{headdim}; got {splits}")
    maxs = COMBINE_ROWS_MAX_SPLITS if splits <= COMBINE_ROWS_MAX_SPLITS else COMBINE_ROWS_WIDE_SPLITS
    tail = f", {maxs}, true" if ua else "" if maxs == COMBINE_ROWS_MAX_SPLITS else f", {maxs}"
    return KernelSpec("flash_decode.cu",
                      f"cuflash::flash_decode_combine_rows_kernel<{CTYPE[dtype]}, {headdim}{tail}>",
                      32 * COMBINE_ROWS_WARPS, 0)


def decode_combine_rows_specs(dtype: str, headdim: int, ua: bool = False) -> list:
    """The rows combine's kernels of a head dim: its form of 8 splits and, where it has one, the wide form."""
    return [decode_combine_rows_spec(dtype, headdim, n, ua) for n in dict.fromkeys(
        (COMBINE_ROWS_MAX_SPLITS, combine_rows_max_splits(headdim)))]


APPEND_THREADS = 256


DROPOUT_MASK_THREADS = 256


def dropout_mask_spec() -> KernelSpec:
    """The dropout keep mask (cuda_src/flash_fwd.cu: dropout_mask_kernel), one thread per Philox group."""
    return KernelSpec("flash_fwd.cu", "cuflash::dropout_mask_kernel", DROPOUT_MASK_THREADS, 0)


def gather_spec(dtype: str, ua: bool = False) -> KernelSpec:
    """Paged K/V of packed sequences -> packed rows (cuda_src/flash_fwd.cu: paged_kv_gather_kernel; the head dim
    is a run-time argument; ua: rows that are not 16-byte units, element by element)."""
    return KernelSpec("flash_fwd.cu", f"cuflash::paged_kv_gather_kernel<{CTYPE[dtype]}{', true' if ua else ''}>",
                      APPEND_THREADS, 0)


def append_spec(dtype: str, ua: bool = False) -> KernelSpec:
    """KV-cache append (cuda_src/flash_fwd.cu: kvcache_append_kernel; the head dim is a run-time argument; ua: rows
    that are not 16-byte units, element by element)."""
    return KernelSpec("flash_fwd.cu", f"cuflash::kvcache_append_kernel<{CTYPE[dtype]}{', true' if ua else ''}>",
                      APPEND_THREADS, 0)


SOFTMAX_THREADS = 256


def softmax_spec(dtype: str) -> KernelSpec:
    """The unfused baseline's row softmax (cuda_src/softmax.cu)."""
    return KernelSpec("softmax.cu", f"cuflash::softmax_rows_kernel<{CTYPE[dtype]}>", SOFTMAX_THREADS, 0)


@dataclass(frozen=True)
class BwdTile:
    block_m: int  # Q rows per inner iteration
    block_n: int  # KV rows per thread block = 16 * nwarps / dsplit
    nwarps: int
    dsplit: int  # warps sharing 16 KV rows and splitting the head dim (2 for head dim 256)
    kunroll: int = 0  # k16 steps unrolled per loop trip in the smem-operand products (0: all; see BWD_TILES)
    # 2D, sm_90 only (flash_bwd.cu DQ_BULK): dQ staged in shared memory and added by cp.reduce.async.bulk, issued
    # from warp-uniform operands at the top of the next step; implies two dO buffers (bwd_do_stages)
    dq_bulk: bool = False
    p_regs: bool = False  # 2D: dS takes P from registers, not read back from smem (flash_bwd.cu P_REGS)
    load_at: int = 0  # 2D with dq_bulk: next Q tile requested after barrier 1 (0), S = QK^T (1), P and dP (2) (LOAD_AT)
    exp_il: bool = False  # 2D: P's exps interleaved with the k16 steps of dP = dO V^T (flash_bwd.cu EXP_IL)


# kunroll (every partition): k16 steps unrolled per loop trip in the products with both operands in shared
# memory (0: all). Head dims 96-256 need it in the KV partition: fully unrolled, NVRTC 13.0 (the H200 image's
# compiler) spills 8-48 B at 255 registers there, although NVRTC 13.5 does not.
BWD_TILES = {
    32: BwdTile(64, 128, 8, 1),
    64: BwdTile(64, 128, 8, 1),
    96: BwdTile(64, 128, 8, 1, 2),
    128: BwdTile(32, 128, 8, 1, 4),  # 64-row Q tiles spill at head dim 128 (dK, dV: 128 fp32 registers)
    256: BwdTile(32, 64, 8, 2, 2),
}
# Warp partitions of the backward main kernel (cuda_src/flash_bwd.cu, template argument PARTITION):
# "kv" (the default) uses BWD_TILES, "q" BWD_TILES_Q, "2d" BWD_TILES_2D.
BWD_PARTITIONS = {"kv": 0, "q": 1, "2d": 2}
# Q-row partition: each warp owns 16 Q rows, so block_m = 16 * nwarps (dsplit is always 1); after the P/dS
# exchange the warps split [block_n, d] of dK/dV (2 * block_n * d / (32 * nwarps) fp32 registers per thread
# for the whole loop), which with the 16 x block_n S/dP tiles of a warp is what bounds block_n.
BWD_TILES_Q = {
    32: BwdTile(128, 128, 8, 1),
    64: BwdTile(64, 64, 4, 1),  # 128 x 64 x 8w spills (sm_80 causal, sm_90 bf16) and reads P/dS twice
    96: BwdTile(64, 64, 4, 1),  # 128-row Q tiles (8 warps) need more than sm_80's 163 KB of smem
    128: BwdTile(64, 32, 4, 1),  # 64 x 64 x 4w spills on sm_90 (dK, dV: 128 fp32 registers)
    256: BwdTile(64, 16, 4, 1),  # the only fit: dK, dV 64 registers, 159 KB of smem
}
# 2D partition (FlashAttention-2's): 32-row warp tiles in all five products, P and dS through shared memory.
# S / dP: (block_m / 32) x (nwarps / (block_m / 32)) warps; dK / dV: (block_n / 32) x (the rest) warps, each
# 32 KV rows x (d / that) columns; dsplit is always 1.
BWD_TILES_2D = {
    32: BwdTile(64, 128, 8, 1),  # k16 loops fully unrolled (2 per trip spilled 4 B under NVRTC 13.5, sm_80 causal)
    64: BwdTile(128, 128, 8, 1, 4),  # dO single-buffered (164 KB); 64 x 128: 4-9% slower
    96: BwdTile(64, 128, 8, 1, 2),
    128: BwdTile(64, 128, 8, 1, 4),  # fully unrolled k loops spill 20-90 B at 255 registers
}  # head dim 256: no spill-free tile within sm_80's shared memory (64 x 32 x 4w spills 60 B; 64 x 64 x 8w: 184 KB)
# warp_partition="auto" (the default): the partition measured fastest per head dim on the H200
# (bench/results: section bwd_tile_sweep); head dims not listed use "kv".
BWD_AUTO_PARTITION = {64: "2d", 128: "2d"}
SM80_MAX_SMEM = 163 * 1024  # every configuration must fit one sm_80 block (flash_bwd.cu: SM80_MAX_SMEM)
BWD_ROW_PAD = 128  # fp32 row buffers (lse_log2, D, dQ accumulator) are padded to this many rows
BWD_PRE_THREADS = 256  # preprocess: bwd_pre_lanes_per_row(d) threads per row, 16 bytes of O and dO each


def bwd_pre_lanes_per_row(headdim: int) -> int:
    """Threads per row of the preprocess kernel (its template argument LPR): a power of two >= headdim / 8."""
    return 4 if headdim <= 32 else 8 if headdim <= 64 else 16 if headdim <= 128 else 32


BWD_CONVERT_THREADS = 256
# 16-byte slots of the fp32 dQ accumulator each convert thread sums and stores (cuda_src/flash_bwd.cu: the same
# constant): the index arithmetic is paid once for 4 slots and their loads are in flight together.
BWD_CONVERT_SLOTS = 4


# sm_90 (H100 / H200: up to 227 KB of shared memory per block) runs the 2D tiles with the sm_90 options
# (bench/results, sections bwd_tile_sweep, bwd_tile_rounds_d64, bwd_tile_rounds_d128 / _bf16; 3 rounds each):
# * dq_bulk: the dQ tile staged in shared memory and added by the bulk (TMA) reduction instead of per-lane REDs,
#   dO double-buffered (no barrier before the next dO load), step i's reductions issued at the top of step i + 1
#   from warp-uniform operands: +1-4% over the sm_80 tile at d64, +2-7% at d128 4k-16k (16k non-causal fp16
#   302 -> 314, bf16 299 -> 321 TFLOP/s); the deferred issue without an early next-Q request lost 3-6%.
# * kunroll=0: the k16 loops fully unrolled (what the sm_80 tile cannot afford: it spills there).
# * p_regs: P kept in registers for dS: +0.5-3% (fp16 and bf16).
# * exp_il with load_at=2: P's exps interleaved with the k16 steps of dP = dO V^T, the next Q tile requested
#   after that: d64 fp16 +9-11% (16k non-causal 271 -> 300 TFLOP/s, 2k 233 -> 259; exp_il alone +4-7%); d128
#   fp16 best at 5 of 6 points (16k non-causal 311 -> 318, causal 303 -> 314). 247-255 registers, spill-free
#   under NVRTC 13.0 and 13.5.
BWD_TILES_2D_SM90 = {
    64: replace(BWD_TILES_2D[64], kunroll=0, dq_bulk=True, p_regs=True, load_at=2, exp_il=True),
    128: replace(BWD_TILES_2D[128], kunroll=0, dq_bulk=True, p_regs=True, load_at=2, exp_il=True),
}
# per-dtype exceptions to BWD_TILES_2D_SM90: bf16 d64 spills 8 B with P in registers (under the H200 image's
# NVRTC 13.0), so it reads P back (spill-free); bf16 d128 is faster with the next Q tile requested after S
# (load_at=1: 16k non-causal 317 -> 325, 2k 273 -> 281 TFLOP/s) than after P (load_at=2: 270 at 2k).
BWD_TILES_2D_SM90_DTYPE = {
    "bfloat16": {64: replace(BWD_TILES_2D_SM90[64], p_regs=False),
                 128: replace(BWD_TILES_2D_SM90[128], load_at=1)},
}


# MOD_SCORE backward tiles that differ from the plain ones (as FWD_TILES_SCORE): (partition, sm_90 table, dtype)
# -> {head dim: tile}. With the plain tile each spilled 4-24 B under NVRTC 13.0 or 13.5, on sm_80 or sm_90; each
# replacement was compiled spill-free under both, for both archs. The bf16 sm_90 2D tile at head dim 128 spilled
# 8-40 B in every variant tried (unrolling 0-4, P from shared memory, no interleaved exps, either next-tile
# request); the sm_80 64 x 128 tile spilled 4-8 B at every unrolling once the head-dim padding's column tests were
# in. Both take 64 x 64 x 8 warps there (half the dK/dV columns per warp: 172-176 registers).
BWD_SCORE_TILES = {
    ("2d", False, None): {128: BwdTile(64, 64, 8, 1, 0)},
    ("kv", False, None): {256: BwdTile(16, 64, 8, 2, 2)},
    ("q", False, None): {96: replace(BWD_TILES_Q[96], kunroll=2)},
    # head dim 128: unrolled 4 k16 steps, without the interleaved exps (with them it spilled 4 B under NVRTC 13.5
    # or 13.0 at every unrolling but 8, where 13.0 takes 255 registers; without: 245-246)
    ("2d", True, "float16"): {128: replace(BWD_TILES_2D_SM90[128], kunroll=4, exp_il=False)},
    ("2d", True, "bfloat16"): {64: replace(BWD_TILES_2D_SM90_DTYPE["bfloat16"][64], exp_il=False),
                               128: BwdTile(64, 64, 8, 1, 0)},
}


# MOD_SCORE_DROPOUT backward tiles that differ from the MOD_SCORE ones (the same keys as BWD_SCORE_TILES): the KV
# partition at head dim 64 spilled 4 B fully unrolled (NVRTC 13.0); sm_90 fp16 2D at head dim 64 28 B with the
# interleaved exps, none without.
BWD_DROPOUT_TILES = {
    ("kv", False, None): {64: replace(BWD_TILES[64], kunroll=2)},
    ("2d", True, "float16"): {64: replace(BWD_TILES_2D_SM90[64], exp_il=False)},
}


# (partition, head dim) without a MOD_SCORE kernel: the Q partition's only tile at head dim 256 (64 x 16 x 4w)
# spilled 8-24 B at every unrolling under NVRTC 13.5 or 13.0 with the modifiers' registers. warp_partition="q"
# there with window_size / softcap / alibi_slopes is a NotImplementedError (the default, "kv", has one).
BWD_SCORE_UNSUPPORTED = {("q", 256)}


def bwd_tiles(warp_partition: str = "kv", arch: int = 80, dtype: str | None = None, mod: int = 0,
              varlen: bool = False) -> dict:
    """The tile table of one backward warp partition ("kv", "q" or "2d") for a device of compute capability
    `arch` (e.g. 90; the sm_80 tables unless the partition has sm_90 tiles) and inputs of `dtype` ("float16" or
    "bfloat16"; None: the fp16 table); mod = MOD_SCORE: with BWD_SCORE_TILES. varlen: the packed-sequence kernels,
    which take the sm_80 tables on sm_90 too (the sm_90 2D tiles, DQ_BULK, spill 8-36 B with the packed kernel's
    extra code under NVRTC 13.0; the sm_80 2D tiles compiled for sm_90 do not)."""
    table = {"kv": BWD_TILES, "q": BWD_TILES_Q, "2d": BWD_TILES_2D}[warp_partition]
    sm90 = arch >= 90 and warp_partition == "2d" and not varlen
    if sm90:
        table = {**table, **BWD_TILES_2D_SM90, **BWD_TILES_2D_SM90_DTYPE.get(dtype, {})}
    if mod:
        table = {**table, **BWD_SCORE_TILES.get((warp_partition, False, None), {})}
        if sm90:
            table.update(BWD_SCORE_TILES.get((warp_partition, True, dtype or "float16"), {}))
    if mod & MOD_DROPOUT:
        table.update(BWD_DROPOUT_TILES.get((warp_partition, False, None), {}))
        if sm90:
            table.update(BWD_DROPOUT_TILES.get((warp_partition, True, dtype or "float16"), {}))
    return table


def bwd_tile(headdim: int, warp_partition: str = "kv", arch: int = 80, dtype: str | None = None,
             mod: int = 0, varlen: bool = False) -> BwdTile:
    """The V2 backward tile of a head dim in one warp partition ("kv", "q", "2d"; resolve "auto" first with
    cuflash.backward.resolve_warp_partition) on a device of compute capability `arch`, for inputs of `dtype`, in
    mask mode `mod`, packed (varlen) or not."""
    return bwd_tiles(warp_partition, arch, dtype, mod, varlen)[headdim]


def bwd_do_stages(headdim: int, tile: BwdTile, warp_partition: str = "kv") -> int:
    """dO buffers: 2 (like Q) with dq_bulk (the sm_90 tiles); otherwise 2, except 1 in the "2d" partition when
    2 would not fit sm_80 (flash_bwd.cu BwdSmem::DO_STAGES)."""
    if tile.dq_bulk:
        return 2
    if warp_partition == "2d" and _bwd_smem(headdim, tile, warp_partition, 2) > SM80_MAX_SMEM:
        return 1
    return 2


def _bwd_smem(headdim, tile, warp_partition, do_stages):
    lds = headdim + SMEM_ROW_PAD
    if warp_partition in ("q", "2d"):
        exchange = 2 * tile.block_m * (tile.block_n + SMEM_ROW_PAD)
    else:
        exchange = tile.block_n * (tile.block_m + SMEM_ROW_PAD)
    staging = tile.block_m * headdim * 4 if tile.dq_bulk else 0  # not part of the sm_80 fit (DO_STAGES)
    return (((2 * tile.block_n + (2 + do_stages) * tile.block_m) * lds + exchange) * ELEM_BYTES
            + 4 * tile.block_m * 4 + staging)


def bwd_smem_bytes(headdim: int, tile: BwdTile, warp_partition: str = "kv") -> int:
    """K, V tiles + 2 x Q + (1 or 2) x dO tiles + the exchange (partition "kv": the dS^T tile; "q", "2d": the
    P and dS tiles) + 2 stages x (lse, D) rows (flash_bwd.cu: BwdSmem)."""
    return _bwd_smem(headdim, tile, warp_partition, bwd_do_stages(headdim, tile, warp_partition))


def _bwd_name_extras(tile: BwdTile, mod: int = 0, varlen: bool = False, ua: bool = False) -> str:
    """The kernel's trailing template arguments DQ_BULK, P_REGS, LOAD_AT, EXP_IL, MOD, VARLEN, UA, written up to
    the last one that is not its default."""
    args = ["true" if tile.dq_bulk else "false", "true" if tile.p_regs else "false", str(tile.load_at),
            "true" if tile.exp_il else "false", str(mod), "true" if varlen else "false", "true" if ua else "false"]
    defaults = ["false", "false", "0", "false", "0", "false", "false"]
    while args and args[-1] == defaults[len(args) - 1]:
        args.pop()
    return "".join(", " + a for a in args)


def sm90_only(headdim: int, tile: BwdTile, warp_partition: str = "2d") -> bool:
    """Whether a backward tile needs sm_90 (the bulk reduction, or more shared memory than sm_80's)."""
    return tile.dq_bulk or bwd_smem_bytes(headdim, tile, warp_partition) > SM80_MAX_SMEM


def bwd_spec(dtype: str, headdim: int, causal: bool, tile: BwdTile | None = None,
             warp_partition: str = "kv", mod: int = 0, varlen: bool = False, ua: bool = False) -> KernelSpec:
    """The V2 backward kernel (varlen: packed sequences, the VARLEN kernel; ua: the UA kernel, see fwd_spec)."""
    if ua and (causal or mod not in UA_MODS or tile is not None and tile.dq_bulk):
        raise ValueError(f"the UA backward runs mod in {UA_MODS} with an sm_80 tile; got mod={mod!r}, "
                         f"causal={causal!r}")
    tile = tile or bwd_tile(headdim, warp_partition, mod=mod)
    smem = bwd_smem_bytes(headdim, tile, warp_partition)
    name = (f"cuflash::flash_bwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
            f"{tile.dsplit}, {'true' if causal else 'false'}, {smem}, {BWD_PARTITIONS[warp_partition]}, "
            f"{tile.kunroll}{_bwd_name_extras(tile, _mod_checked(causal, mod), varlen, ua)}>")
    min_arch = 90 if sm90_only(headdim, tile, warp_partition) else 80
    return KernelSpec("flash_bwd.cu", name, tile.nwarps * 32, smem, min_arch)


def bwd_preprocess_spec(dtype: str, headdim: int, ua: bool = False) -> KernelSpec:
    return KernelSpec("flash_bwd.cu", f"cuflash::flash_bwd_preprocess_kernel<{CTYPE[dtype]}, {headdim}, "
                      f"{bwd_pre_lanes_per_row(headdim)}{', true' if ua else ''}>",
                      BWD_PRE_THREADS, 0)


def bwd_convert_spec(dtype: str, headdim: int, causal: bool, block_n: int, mod: int = 0, ua: bool = False) -> KernelSpec:
    tail = f", {_mod_checked(causal, mod)}, true" if ua else f", {mod}" if _mod_checked(causal, mod) else ""
    return KernelSpec("flash_bwd.cu", f"cuflash::flash_bwd_convert_dq_kernel<{CTYPE[dtype]}, {headdim}, {block_n}, "
                      f"{'true' if causal else 'false'}{tail}>",
                      BWD_CONVERT_THREADS, 0)


def bwd_convert_t_spec(dtype: str, headdim: int, block_m: int) -> KernelSpec:
    """The convert of the T accumulator layout (the Hopper backward's 80-row Q tiles; cuda_src/attn/bwd.cuh)."""
    return KernelSpec("flash_bwd.cu", f"cuflash::flash_bwd_convert_dq_t_kernel<{CTYPE[dtype]}, {headdim}, {block_m}>",
                      BWD_CONVERT_THREADS, 0)


# ------------------------------------------------------------------------------- FlashAttention-1
V1_FILENAME = "flash_v1.cu"
V1_HEADDIMS = (32, 64, 96, 128)
WARP_SPLITS = {"k": 0, "q": 1}  # cuda_src/flash_v1.cu: enum WarpSplit { SPLIT_K = 0, SPLIT_Q = 1 }


@dataclass(frozen=True)
class V1Tile:
    block_m: int  # Q rows per inner step
    block_n: int  # keys per KV tile
    nwarps: int  # split-K: warps split block_n (block_n / nwarps keys each); split-Q: warps split block_m
    kunroll: int = 0  # backward: k16 steps of S^T, dP^T unrolled per loop trip (0: all; flash_v1.cu KUNROLL)


# Forward tiles. Split-K follows V1's own kernels: 16 query rows per step, 4 warps splitting 256 keys
# (64 each) at head dim <= 64 and 128 keys (32 each) above. Split-Q: V2's partition, 16 rows per warp.
V1_FWD_TILES = {
    "k": {32: V1Tile(16, 256, 4), 64: V1Tile(16, 256, 4), 96: V1Tile(16, 128, 4), 128: V1Tile(16, 128, 4)},
    "q": {32: V1Tile(64, 128, 4), 64: V1Tile(64, 128, 4), 96: V1Tile(64, 64, 4), 128: V1Tile(64, 64, 4)},
}
# Backward tiles: warp w owns 16 KV rows (block_n = 16 * nwarps). The V2 backward's tile sizes, so the
# ladder compares algorithms, not tiles, except head dim 96 (32-row Q tiles: with V1's extra O_i / dQ_i
# tiles 64 rows spill on sm_90); 64-row Q tiles would spill at head dim 128 (dK, dV: 128 fp32 registers).
# Head dims 96 and 128 unroll 4 k16 steps per trip: fully unrolled, NVRTC 13.0 (the H200 image's) spills there.
V1_BWD_TILES = {32: V1Tile(64, 128, 8), 64: V1Tile(64, 128, 8), 96: V1Tile(32, 128, 8, 4), 128: V1Tile(32, 128, 8, 4)}
V1_CONVERT_THREADS = 256


def check_warp_split(warp_split: str) -> None:
    if warp_split not in WARP_SPLITS:
        raise ValueError(f"warp_split must be one of {tuple(WARP_SPLITS)}; got {warp_split!r}")


def v1_fwd_tile(headdim: int, warp_split: str = "k") -> V1Tile:
    """The V1 forward tile of a head dim and warp split ("k" or "q"); the same on sm_80 and sm_90."""
    return V1_FWD_TILES[warp_split][headdim]


def v1_bwd_tile(headdim: int) -> V1Tile:
    """The V1 backward tile of a head dim; the same on sm_80 and sm_90."""
    return V1_BWD_TILES[headdim]


def v1_fwd_smem_bytes(headdim: int, tile: V1Tile, warp_split: str) -> int:
    """K, V tiles + 2 stages of Q (16-bit, rows padded) + split-K's fp32 exchange: [nwarps][block_m] rows of
    headdim + 8 floats (P~_w V_w) and 2 floats (m~_w, l~_w)."""
    lds = headdim + SMEM_ROW_PAD
    smem = (2 * tile.block_n + 2 * tile.block_m) * lds * ELEM_BYTES
    if warp_split == "k":
        smem += tile.nwarps * tile.block_m * (headdim + 8 + 2) * 4
    return smem


def v1_bwd_smem_bytes(headdim: int, tile: V1Tile) -> int:
    """K, V tiles + 2 stages x (Q, dO, O) + dS^T tile (16-bit) + 2 stages x (dQ_i rows of headdim + 4 floats,
    m2, 1/l) + D_i (fp32)."""
    lds = headdim + SMEM_ROW_PAD
    return ((2 * tile.block_n + 6 * tile.block_m) * lds + tile.block_n * (tile.block_m + SMEM_ROW_PAD)) * ELEM_BYTES \
        + (2 * tile.block_m * (headdim + 4) + 5 * tile.block_m) * 4


def v1_fwd_spec(dtype: str, headdim: int, causal: bool, warp_split: str = "k", tile: V1Tile | None = None) -> KernelSpec:
    check_warp_split(warp_split)
    tile = tile or v1_fwd_tile(headdim, warp_split)
    smem = v1_fwd_smem_bytes(headdim, tile, warp_split)
    name = (f"cuflash::flash_v1_fwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
            f"{WARP_SPLITS[warp_split]}, {'true' if causal else 'false'}, {smem}>")
    return KernelSpec(V1_FILENAME, name, tile.nwarps * 32, smem)


def v1_bwd_spec(dtype: str, headdim: int, causal: bool, tile: V1Tile | None = None) -> KernelSpec:
    tile = tile or v1_bwd_tile(headdim)
    smem = v1_bwd_smem_bytes(headdim, tile)
    name = (f"cuflash::flash_v1_bwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
            f"{'true' if causal else 'false'}, {smem}{f', {tile.kunroll}' if tile.kunroll else ''}>")
    return KernelSpec(V1_FILENAME, name, tile.nwarps * 32, smem)


def v1_convert_spec(dtype: str, headdim: int) -> KernelSpec:
    return KernelSpec(V1_FILENAME, f"cuflash::flash_v1_bwd_convert_dq_kernel<{CTYPE[dtype]}, {headdim}>",
                      V1_CONVERT_THREADS, 0)


def v1_specs():
    """Every kernel configuration the V1 code can launch (CI compiles each for sm_80 and sm_90)."""
    out = []
    for dt in DTYPES:
        for d in V1_HEADDIMS:
            for causal in (False, True):
                for split in WARP_SPLITS:
                    out.append(v1_fwd_spec(dt, d, causal, split))
                out.append(v1_bwd_spec(dt, d, causal))
            out.append(v1_convert_spec(dt, d))
    return out


def model_specs(dtypes=DTYPES, headdims=HEADDIMS, causal=(False, True), backward: bool = True, decode: bool = True,
                arch: int = 90, scores: bool = False, varlen: bool = False):
    """The kernels a model's calls launch on sm_<arch> with the default options (`python -m cuflash.precompile
    --dtypes/--headdims/--causal/--no-backward/--no-decode`): the V2 forward (and the Hopper forward for its head
    dims on sm_90); with backward, the default backward (preprocess, the auto partition's main kernel with this
    arch's tile, dQ convert); with decode, the decode kernel, the split-KV forward, its combine and the cache
    append. With scores, also the kernels of the score modifiers (window, soft-cap, ALiBi: MOD_SCORE); with varlen,
    the packed-sequence (VARLEN) forward and backward of the same modes. A subset of all_specs(). A head dim that is
    not compiled stands for the kernels that run it (kernel_headdim)."""
    out = []
    # (the V2 forward's kernel head dim, the Hopper forward's or None) of each head dim asked for
    kernels = dict.fromkeys((kernel_headdim(h, FWD_HEADDIMS),
                             kernel_headdim(h, SM90_HEADDIMS) if h > SM80_ONLY_MAX_HEADDIM else None) for h in headdims)
    modes = [(c, m) for c, m in MASK_MODES if (m == MOD_NONE and c in causal) or (m == MOD_SCORE and scores)]
    for dt in dtypes:
        for d, d90 in kernels:
            fwd_only = d > MAX_HEADDIM  # (no backward, decode or Hopper kernels)
            for c, m in modes:
                out.append(fwd_spec(dt, d, c, split=False, mod=m))
                if arch == 90 and d90:
                    out.append(sm90_fwd_spec(dt, d90, c, mod=m))
                if varlen:
                    out.append(fwd_spec(dt, d, c, split=False, mod=m, varlen=True))
                if fwd_only:
                    continue
                if backward:
                    part = BWD_AUTO_PARTITION.get(d, "kv")
                    tile = bwd_tile(d, part, arch, dt, m)
                    out += [bwd_spec(dt, d, c, tile, part, mod=m), bwd_convert_spec(dt, d, c, tile.block_n, mod=m)]
                    if arch == 90 and d90 and d in SM90_BWD_HEADDIMS:  # the Hopper backward and its convert
                        t90 = sm90_bwd_tile(d)
                        out += [sm90_bwd_spec(dt, d, c, t90, m), bwd_convert_spec(dt, d, c, t90.block_n, mod=m)]
                        if c and not m and sm90_bwd_grouped_headdim(d):  # the grouped order (shorter sequences),
                            # and with GQA the heads-inner walk in it or in the launch's (sm90_bwd_causal_walk)
                            out += [sm90_bwd_spec(dt, d, c, t90, m, group=SM90_BWD_CAUSAL_GROUP),
                                    sm90_bwd_spec(dt, d, c, t90, m, DQ_ORDER_HEADS_INNER, SM90_BWD_CAUSAL_GROUP),
                                    sm90_bwd_spec(dt, d, c, t90, m, DQ_ORDER_HEADS_INNER)]
                        if not m and SM90_BWD_PERSIST_MAX_SEQLEN_K.get((d, c)) is not None:  # the persistent form
                            out.append(sm90_bwd_spec(dt, d, c, sm90_bwd_persist_tile(d)))
                        if not m and not c and SM90_BWD_SK_SEQLEN_K.get(d) is not None:  # stream-K
                            out.append(sm90_bwd_spec(dt, d, c, sm90_bwd_stream_k_tile(d)))
                        if not m and not c and SM90_BWD_M80_SEQLEN_K.get(d) is not None:  # the 80-row tiles
                            out += [sm90_bwd_spec(dt, d, c, sm90_bwd_m80_tile(d)),
                                    bwd_convert_t_spec(dt, d, SM90_BWD_M80_ROWS)]
                            if SM90_BWD_M80_PERSIST_SEQLEN_K.get(d) is not None:
                                out.append(sm90_bwd_spec(dt, d, c, sm90_bwd_m80_tile(d, True)))
                    if varlen:
                        vt = bwd_tile(d, part, arch, dt, m, varlen=True)
                        out += [bwd_spec(dt, d, c, vt, part, mod=m, varlen=True),
                                bwd_convert_spec(dt, d, c, vt.block_n, mod=m)]
                if decode:
                    out += [fwd_spec(dt, d, c, split=True, mod=m)]
                    out += decode_family(dt, d, c, m)
            if backward and not fwd_only:
                out.append(bwd_preprocess_spec(dt, d))
            if decode and not fwd_only:
                out += [combine_spec(dt, d), decode_combine_spec(dt, d), *decode_combine_rows_specs(dt, d),
                        append_spec(dt)]
            if varlen:
                out.append(gather_spec(dt))
        for h in headdims:  # a head dim that is not a multiple of 8: its UA kernels (the modes' and dropout's)
            d = kernel_headdim(h, FWD_HEADDIMS)
            if h % HEADDIM_MULTIPLE == 0 or d is None:
                continue
            mods = UA_MODS if scores else UA_MODS[:1]
            out += [fwd_spec(dt, d, False, False, ua_fwd_tile(d, m), mod=m, varlen=v, ua=True)
                    for m in mods for v in (False, True)[:1 + varlen]]
            if backward and d <= MAX_HEADDIM:
                for m in mods:
                    part, tile = ua_bwd_tile(d, dt, m)
                    out += [bwd_spec(dt, d, False, tile, part, mod=m, varlen=v, ua=True)
                            for v in (False, True)[:1 + varlen]]
                    out.append(bwd_convert_spec(dt, d, False, tile.block_n, MOD_SCORE, ua=True))
                out.append(bwd_preprocess_spec(dt, d, ua=True))
            if decode and d <= MAX_HEADDIM:
                out.append(append_spec(dt, ua=True))
    return [s for s in dict.fromkeys(out) if s.min_arch <= arch]


def varlen_specs():
    """The packed-sequence kernels: the V2 forward of every head dim and mask mode, and the backward in the partition
    "auto" picks (the varlen functions have no warp_partition argument; the sm_80 tiles on every device: bwd_tiles)."""
    specs = []
    for dt in DTYPES:
        for d in FWD_HEADDIMS:
            for causal, m in (*MASK_MODES, (False, MOD_SCORE_DROPOUT)):
                specs.append(fwd_spec(dt, d, causal, split=False, mod=m, varlen=True))
                if d not in HEADDIMS:
                    continue
                part = BWD_AUTO_PARTITION.get(d, "kv")
                specs.append(bwd_spec(dt, d, causal, bwd_tile(d, part, 80, dt, m, varlen=True), part, mod=m,
                                      varlen=True))
    return list(dict.fromkeys(specs))


def decode_ua_specs(dtype: str, headdim: int) -> list:
    """The UA decode kernels of a dtype and kernel head dim (decode_ua_tile): every row-fragment count, contiguous
    and paged."""
    return [decode_spec(dtype, headdim, False, mf, None, MOD_SCORE, pg, ua=True) for pg in (False, True)
            for mf in range(1, DECODE_MAX_MF[headdim] + 1)]


def ua_specs():
    """The UA kernels (rows that are not 16-byte units): per dtype and head dim, the V2 forward (plain and packed)
    and the default backward (main, plain and packed; preprocess; dQ convert) of each of UA_MODS; the decode kernel
    and its combines; the append and the paged gather."""
    specs = []
    for dt in DTYPES:
        for d in FWD_HEADDIMS:
            for m in UA_MODS:
                specs += [fwd_spec(dt, d, False, False, ua_fwd_tile(d, m), mod=m, varlen=v, ua=True) for v in (False, True)]
                if d not in HEADDIMS:
                    continue
                part, tile = ua_bwd_tile(d, dt, m)
                specs += [bwd_spec(dt, d, False, tile, part, mod=m, varlen=v, ua=True) for v in (False, True)]
                specs.append(bwd_convert_spec(dt, d, False, tile.block_n, MOD_SCORE, ua=True))
            if d in HEADDIMS:
                specs.append(bwd_preprocess_spec(dt, d, ua=True))
                specs += decode_ua_specs(dt, d)
                specs.append(decode_combine_spec(dt, d, ua=True))
                specs += decode_combine_rows_specs(dt, d, ua=True)
        specs.append(append_spec(dt, ua=True))
        specs.append(gather_spec(dt, ua=True))
    return list(dict.fromkeys(specs))


# ------------------------------------------------------------------------------ GPUs with less shared memory
# The tables above are sized for A100 / H100-class shared memory (163 / 227 KB a block). sm_86, sm_89 and sm_120
# (RTX 30 / 40 / 50) allow SMALL_SMEM_PER_BLOCK; where a configured tile needs more, the host takes the fitted tile
# below instead (cuflash._launch.smem_per_block; a call with an explicit tile or warp partition keeps it and is
# refused by cuflash._launch.check_smem). CI compiles every fitted configuration (fitted_specs).
SMALL_SMEM_PER_BLOCK = SMALLEST_SMEM_PER_BLOCK  # a tile within it fits every GPU: no device query (the callers)


def fit_fwd_tile(headdim: int, tile: FwdTile, limit: int) -> FwdTile | None:
    """`tile` where its footprint fits `limit` bytes a block; else the tile with its key tiles halved (down to 32
    keys, the k16 loop fully unrolled, as head dim 128's causal tile) and then its Q tiles halved (down to one m16
    fragment per warp) until it fits; None where none does (head dim 512)."""
    t = tile
    while fwd_smem_bytes(headdim, t) > limit:
        if t.block_n > 32:
            t = replace(t, block_n=t.block_n // 2, kunroll=0)
        elif t.block_m > 16 * t.nwarps:
            t = replace(t, block_m=t.block_m // 2)
        else:
            return None
    return t


# the partitions "auto" falls back to, in order, where its own tile does not fit (their tiles: bwd_tiles)
BWD_FIT_PARTITIONS = ("q", "kv", "2d")
# (partition, head dim) whose packed-sequence and UA kernels with the score modifiers spill (the Q-row partition at
# head dim 128: 4-40 B on sm_80 at every unrolling and with 16-key tiles, under NVRTC 13.0 and 13.5); the fallback
# does not take them, so such a backward is refused on a 99 KB GPU
BWD_FIT_PACKED_MOD_SPILLS = {("q", 128)}


def fit_bwd_partition(headdim: int, warp_partition: str, arch: int, dtype: str | None, mod: int, varlen: bool,
                      limit: int) -> tuple | None:
    """(partition, tile) of the backward of a resolved "auto" partition: that partition where its tile fits
    `limit` bytes a block, else the first of BWD_FIT_PARTITIONS with a tile at this head dim that fits (and a
    score-modifier kernel where mod is set; varlen: the packed / UA kernels, BWD_FIT_PACKED_MOD_SPILLS); None where
    none does (head dim 256 on a 99 KB GPU)."""
    for part in dict.fromkeys((warp_partition, *BWD_FIT_PARTITIONS)):
        tiles = bwd_tiles(part, arch, dtype, mod, varlen)
        if headdim not in tiles or (mod and (part, headdim) in BWD_SCORE_UNSUPPORTED) or (
                mod and varlen and (part, headdim) in BWD_FIT_PACKED_MOD_SPILLS):
            continue
        if bwd_smem_bytes(headdim, tiles[headdim], part) <= limit:
            return part, tiles[headdim]
    return None


def fit_decode_tile(headdim: int, tile: DecodeTile, mf: int, limit: int) -> DecodeTile | None:
    """`tile` where the decode kernel's footprint fits `limit` bytes a block; else the head dim's DECODE_WIDE_TILES
    tile where that fits, else `tile` with fewer ring stages (down to 2), then 16-key warp tiles, then fewer warps
    (down to 2); None where none fits."""
    if decode_smem_bytes(headdim, tile, mf) <= limit:
        return tile
    wide = DECODE_WIDE_TILES.get(headdim) if tile.swizzle else None  # (a padded ring keeps its rows: the UA tile)
    if wide is not None and decode_smem_bytes(headdim, wide, mf) <= limit:
        return wide
    t = tile
    while decode_smem_bytes(headdim, t, mf) > limit:
        if t.stages > 2:
            t = replace(t, stages=t.stages - 1)
        elif t.block_n > 16:
            t = replace(t, block_n=t.block_n // 2)
        elif t.nwarps > 2:
            t = replace(t, nwarps=t.nwarps // 2)
        else:
            return None
    return t


def fitted_specs(limit: int = SMALL_SMEM_PER_BLOCK) -> list:
    """The kernels a GPU allowing `limit` bytes a block launches in place of configured ones that do not fit it:
    the V2 forward (plain, split-KV, packed, UA), the backward's fallback partition (main kernel and dQ convert;
    plain, packed, UA) and the decode kernel (every tile decode_auto_tile may take, and the UA one's)."""
    specs = []
    for dt in DTYPES:
        for d in FWD_HEADDIMS:
            for causal, m in (*MASK_MODES, (False, MOD_SCORE_DROPOUT)):
                for split, varlen in ((False, False), (True, False), (False, True)):
                    if split and (d not in DECODE_TILES or m & MOD_DROPOUT):
                        continue
                    tile = split_tile(d) if split else fwd_tile(d, causal, m)
                    fit = fit_fwd_tile(d, tile, limit)
                    if fit is not None and fit != tile:
                        specs.append(fwd_spec(dt, d, causal, split, fit, mod=m, varlen=varlen))
            for m in UA_MODS:
                tile = ua_fwd_tile(d, m)
                fit = fit_fwd_tile(d, tile, limit)
                if fit is not None and fit != tile:
                    specs += [fwd_spec(dt, d, False, False, fit, mod=m, varlen=v, ua=True) for v in (False, True)]
        for d in HEADDIMS:
            auto = BWD_AUTO_PARTITION.get(d, "kv")
            for causal, m in (*MASK_MODES, (False, MOD_SCORE_DROPOUT)):
                for varlen, ua in ((False, False), (True, False), (False, True), (True, True)):
                    if ua and (causal or m not in UA_MODS):
                        continue
                    fit = fit_bwd_partition(d, auto, 80, dt, m, varlen or ua, limit)
                    if fit is None or fit[0] == auto:
                        continue
                    part, tile = fit
                    specs.append(bwd_spec(dt, d, causal, tile, part, mod=m, varlen=varlen, ua=ua))
                    specs.append(bwd_convert_spec(dt, d, causal, tile.block_n, m & MOD_SCORE, ua))
            for causal, m in MASK_MODES:
                tiles = [decode_tile(d)] + [t[d] for t in (DECODE_WIDE_TILES, DECODE_DEEP_TILES) if d in t]
                for mf in range(1, DECODE_MAX_MF[d] + 1):
                    for tile in tiles:
                        fit = fit_decode_tile(d, tile, mf, limit)
                        if fit is not None and fit != tile:
                            specs += [decode_spec(dt, d, causal, mf, fit, m, paged=pg) for pg in (False, True)]
            for mf in range(1, DECODE_MAX_MF[d] + 1):  # the UA decode kernel's padded ring
                fit = fit_decode_tile(d, decode_ua_tile(d), mf, limit)
                if fit is not None and fit != decode_ua_tile(d):
                    specs += [decode_spec(dt, d, False, mf, fit, MOD_SCORE, pg, ua=True) for pg in (False, True)]
    return list(dict.fromkeys(specs))


def all_specs():
    """Every kernel configuration the package can launch (CI compiles each for sm_80 and sm_90)."""
    specs = []
    for dt in DTYPES:
        for d in HEADDIMS:
            for causal, m in MASK_MODES:
                specs.append(fwd_spec(dt, d, causal, split=False, mod=m))
                specs.append(fwd_spec(dt, d, causal, split=True, mod=m))
            specs.append(fwd_spec(dt, d, False, split=False, mod=MOD_SCORE_DROPOUT))
            specs.append(combine_spec(dt, d))
            specs.append(decode_combine_spec(dt, d))
            specs += decode_combine_rows_specs(dt, d)
            specs.append(append_spec(dt))
            specs.append(gather_spec(dt))
            specs.append(bwd_preprocess_spec(dt, d))
            for causal, m in (*MASK_MODES, (False, MOD_SCORE_DROPOUT)):
                for part in BWD_PARTITIONS:
                    if d in bwd_tiles(part):
                        if m and (part, d) in BWD_SCORE_UNSUPPORTED:
                            continue
                        specs.append(bwd_spec(dt, d, causal, warp_partition=part, mod=m))
                        if part == "2d" and d in BWD_TILES_2D_SM90:
                            specs.append(bwd_spec(dt, d, causal, bwd_tiles(part, 90, dt, m)[d], part, mod=m))
                        conv = bwd_convert_spec(dt, d, causal, bwd_tiles(part, mod=m)[d].block_n, mod=m & MOD_SCORE)
                        if conv not in specs:
                            specs.append(conv)
        specs.append(softmax_spec(dt))
    specs.append(dropout_mask_spec())
    for dt in DTYPES:  # the forward-only head dims: flash_attn_func's kernels, no split-KV
        for d in FWD_HEADDIMS:
            if d not in HEADDIMS:
                specs += [fwd_spec(dt, d, c, split=False, mod=m) for c, m in (*MASK_MODES, (False, MOD_SCORE_DROPOUT))]
    specs += varlen_specs()  # packed sequences (flash_attn_varlen_func): the VARLEN forward and backward kernels
    specs += decode_specs()  # the dedicated Flash-Decoding kernel (cuda_src/flash_decode.cu)
    specs += [s for s in v1_specs() if s not in specs]  # FlashAttention-1 kernels (cuda_src/flash_v1.cu)
    specs += fwd_cap_max_specs()  # the mma.sync forward's capped-max form (a variant: tile overrides)
    specs += sm90_fwd_specs()  # the Hopper forward (cuda_src/flash_fwd_sm90.cu), sm_90a only
    specs += sm90_fwd_variant_specs()  # its variants the diagnostics launch (tile overrides)
    specs += sm90_fwd_mod_persist_specs()  # the modifier kernels' persistent form (tile overrides)
    specs += sm90_bwd_specs()  # the Hopper backward (cuda_src/flash_bwd_sm90.cu), sm_90a only
    specs += ua_specs()  # rows that are not 16-byte units (head dims not multiples of 8, unaligned strides)
    specs += fitted_specs()  # GPUs of 99 KB a block (sm_86 / sm_89 / sm_120): the tiles that fit them
    return list(dict.fromkeys(specs))
