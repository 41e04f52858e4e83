"""The one place that chooses kernel configurations: template arguments, threads, shared memory.

The kernels static_assert their invariants (tile divisibility, the shared-memory size computed here), so
a wrong entry fails to compile -- in CI, which compiles every configuration listed by `all_specs()` for
sm_80 and sm_90 and rejects spills.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ._launch import KernelSpec

HEADDIMS = (32, 64, 96, 128, 256)
DTYPES = ("float16", "bfloat16")
CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
ELEM_BYTES = 2
SMEM_ROW_PAD = 8  # elements of padding per shared-memory row (cuda_src/common/tile.cuh: PaddedRow)


@dataclass(frozen=True)
class FwdTile:
    block_m: int  # Q rows per thread block
    block_n: int  # keys per KV tile
    nwarps: int  # warps per block; each owns block_m / nwarps rows (a multiple of 16)
    kunroll: int = 0  # k16 steps of S = Q K^T unrolled per loop trip (0: all; cuda_src/flash_fwd.cu KUNROLL)
    load_at: int = 0  # where a KV step issues the next tile's cp.async: 0 or 1 (cuda_src/flash_fwd.cu LOAD_AT)


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
}
# load_at=1 (head dims 64, 128): the next K / V tile's cp.async issued after S = Q K^T, not before it
# (flash_fwd.cu LOAD_AT; section fwd_interleaved, session 7, two calls: +2-6% at non-causal d128, +1-4% at causal
# d128 2k, -0.7 to +1.5% at d64). Head dims 32, 96, 256 keep 0 (not measured).

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


def fwd_tile(headdim: int, causal: bool) -> FwdTile:
    """The configured V2 forward tile of a head dim and mask."""
    return (FWD_TILES_CAUSAL.get(headdim) if causal else None) or FWD_TILES[headdim]


def fwd_smem_bytes(headdim: int, tile: FwdTile) -> int:
    """Q tile + 2 stages x (K tile + V tile), rows padded (cuda_src/flash_fwd.cu static_asserts it)."""
    return (tile.block_m + 4 * tile.block_n) * (headdim + SMEM_ROW_PAD) * ELEM_BYTES


def fwd_spec(dtype: str, headdim: int, causal: bool, split: bool, tile: FwdTile | None = None,
             exp_variant: int = 0) -> KernelSpec:
    """The V2 forward kernel (exp_variant: cuda_src/flash_fwd.cu ExpVariant; non-zero only in the V1 ladder)."""
    if tile is None:
        tile = DECODE_TILES[headdim] if split else fwd_tile(headdim, causal)
    smem = fwd_smem_bytes(headdim, tile)
    if tile.load_at:
        extra = f", {exp_variant}, {tile.kunroll}, {tile.load_at}"
    else:
        extra = f", {exp_variant}, {tile.kunroll}" if tile.kunroll else f", {exp_variant}" if exp_variant else ""
    name = (
        f"cuflash::flash_fwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
        f"{'true' if causal else 'false'}, {'true' if split else 'false'}, {smem}{extra}>"
    )
    return KernelSpec("flash_fwd.cu", name, tile.nwarps * 32, smem)


@dataclass(frozen=True)
class DecodeTile:
    """Tile of the dedicated split-KV decode kernel (cuda_src/flash_decode.cu): every warp holds all
    16 * mf query rows and streams its own warp tiles of block_n keys through a private ring of `stages`
    cp.async stages (the file header has the bytes-in-flight arithmetic)."""

    block_n: int  # keys per warp tile (multiple of 16)
    nwarps: int  # warps per block; the split's warp tiles are dealt round-robin to them
    stages: int  # cp.async ring depth per warp (>= 2)


# Decode-kernel tiles per head dim: ~8 KB of K + V per warp tile (6 KB at d96, 4 KB at d32, 16 KB at d256)
# and a shared-memory footprint of 81-113 KB, so that 2 blocks fit an sm_90 SM (228 KB) and 1 an sm_80 SM
# (164 KB): 96-144 KB of K/V in flight per SM on the H200. Head dim 128: 16 KB warp tiles, 2 stages, 140 KB
# (1 block per SM, so the split heuristic fills 132 slots, not 264): the session-3 decode_sweep
# (bench/NOTES.md) measured it best or within 1% of the best on every case, and 4-6% faster than
# 16x4w-3st (2 blocks per SM) for MQA at batch 8 with a 128k cache.
DECODE_KERNEL_TILES = {
    32: DecodeTile(32, 4, 4),
    64: DecodeTile(32, 4, 3),
    96: DecodeTile(16, 4, 4),
    128: DecodeTile(32, 4, 2),
    256: DecodeTile(16, 2, 3),
}
# Row fragments per block: mf = 1 (16 rows) for <= 16 query rows, 2 (32 rows) above; head dim 256 keeps
# mf = 1 (its O accumulator alone is 128 registers per m16 fragment) and uses several m-blocks instead.
DECODE_MAX_MF = {32: 2, 64: 2, 96: 2, 128: 2, 256: 1}


def decode_mf(headdim: int, rows: int) -> int:
    """Row fragments of the decode kernel for `rows` query rows per (batch, head) (GQA group or seqlen_q)."""
    return 1 if rows <= 16 else DECODE_MAX_MF[headdim]


def decode_smem_bytes(headdim: int, tile: DecodeTile, mf: int) -> int:
    """Q tile + NWARPS x STAGES x (K, V) warp tiles, rows padded; the cross-warp combine (fp32 O_w rows of
    headdim + 8, and m_w, l_w, c_w) reuses the rings. Mirrors DecodeSmem in cuda_src/flash_decode.cu."""
    lds = headdim + SMEM_ROW_PAD
    block_m = 16 * mf
    ring = tile.nwarps * tile.stages * 2 * tile.block_n * lds * ELEM_BYTES
    red = tile.nwarps * block_m * (headdim + 8 + 3) * 4
    return block_m * lds * ELEM_BYTES + max(ring, red)


def decode_spec(dtype: str, headdim: int, causal: bool, mf: int = 1, tile: DecodeTile | None = None) -> KernelSpec:
    """The dedicated decode kernel (cuda_src/flash_decode.cu: flash_decode_kernel)."""
    tile = tile or DECODE_KERNEL_TILES[headdim]
    smem = decode_smem_bytes(headdim, tile, mf)
    name = (f"cuflash::flash_decode_kernel<{CTYPE[dtype]}, {headdim}, {mf}, {tile.block_n}, {tile.nwarps}, "
            f"{'true' if causal else 'false'}, {tile.stages}, {smem}>")
    return KernelSpec("flash_decode.cu", name, tile.nwarps * 32, smem)


def decode_specs():
    """Every decode-kernel configuration the package can launch."""
    return [decode_spec(dt, d, causal, mf) for dt in DTYPES for d in HEADDIMS for mf in range(1, DECODE_MAX_MF[d] + 1)
            for causal in (False, True)]


COMBINE_ROWS_PER_BLOCK = 4  # one warp per output row, 4 warps per block


def combine_spec(dtype: str, headdim: int) -> KernelSpec:
    return KernelSpec("flash_fwd.cu", f"cuflash::flash_combine_kernel<{CTYPE[dtype]}, {headdim}>",
                      32 * COMBINE_ROWS_PER_BLOCK, 0)


APPEND_THREADS = 256


def append_spec(dtype: str, headdim: int) -> KernelSpec:
    """KV-cache append (cuda_src/flash_fwd.cu: kvcache_append_kernel)."""
    return KernelSpec("flash_fwd.cu", f"cuflash::kvcache_append_kernel<{CTYPE[dtype]}, {headdim}>", APPEND_THREADS, 0)


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
    dq_bulk: bool = False  # 2D, sm_90 only: dQ added by cp.reduce.async.bulk from shared memory (flash_bwd.cu DQ_BULK)
    do_stages: int = 0  # dO buffers; 0: the sm_80 rule (bwd_do_stages), 2 forces two (sm_90 when beyond sm_80's smem)
    p_regs: bool = False  # 2D: dS takes P from registers, not read back from smem (flash_bwd.cu P_REGS)
    dq_issue: int = 0  # with dq_bulk: 0 lane 0, 1 warp-uniform operands, 2 = 1 deferred to step i + 1 (flash_bwd.cu DQ_ISSUE)
    load_at: int = 0  # 2D with do_stages=2: next Q tile requested after barrier 1 (0), S = QK^T (1), P and dP (2) (LOAD_AT)
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
    32: BwdTile(64, 128, 8, 1, 2),
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


# sm_90 (H100 / H200: up to 227 KB of shared memory per block) runs the 2D tiles with the sm_90 options: the dQ
# tile staged in shared memory and added by the bulk (TMA) reduction instead of per-lane REDs, and dO
# double-buffered (no barrier before the next dO load). bench/results, section bwd_tile_sweep (session 7): +1-4%
# over the sm_80 tile at d64 (k16 loops unrolled 4 per trip; with P kept in registers for dS, another +0.5-3%),
# +2-7% at d128 with the k16 loops fully unrolled (what the sm_80 tile cannot afford: it spills there).
# Session 8 (bwd_tile_sweep, fp16 and bf16): the bulk reductions of step i issued at the top of step i + 1 from
# warp-uniform operands (dq_issue=2) with the next Q tile requested after S = QK^T (load_at=1): d128 +2-7% at
# 4k-16k (16k non-causal fp16 302 -> 314, bf16 299 -> 321 TFLOP/s), d64 +0-4% (bf16 16k 268 -> 279); either
# alone lost (deferred without load_at: -3-6%). bf16 keeps P in registers too since session 8 (+0-2%).
# Session 9 (bwd_tile_rounds_d64, 3 rounds): at d64 P's exps interleaved with the k16 steps of dP = dO V^T
# (exp_il), with the k16 loops fully unrolled and the next Q tile requested after that (load_at=2): +9-11% in fp16
# (16k non-causal 271 -> 300 TFLOP/s, 2k 233 -> 259); exp_il alone +4-7%, u0 + load_at=2 without it +3-5%.
# bf16 spills 8 B with P in registers there, so bf16 reads P back (BWD_TILES_2D_SM90_DTYPE; spill-free).
# Session 10 (bwd_tile_rounds_d128 / _bf16, 3 rounds): the same options at d128, with P in registers for dS:
# fp16 with load_at=2 best at 5 of 6 points (16k non-causal 311 -> 318, causal 303 -> 314; 2k 267 -> 268), bf16
# best with load_at=1 (16k non-causal 317 -> 325, 2k 273 -> 281; with load_at=2 270 at 2k). 247-255 registers,
# spill-free under NVRTC 13.0 and 13.5.
BWD_TILES_2D_SM90 = {
    64: replace(BWD_TILES_2D[64], kunroll=0, dq_bulk=True, do_stages=2, p_regs=True, dq_issue=2, load_at=2,
                exp_il=True),
    128: replace(BWD_TILES_2D[128], kunroll=0, dq_bulk=True, do_stages=2, p_regs=True, dq_issue=2, load_at=2,
                 exp_il=True),
}
# per-dtype exceptions to BWD_TILES_2D_SM90: bf16 d64 spills with P in registers (under the GPU's NVRTC 13.0);
# bf16 d128 is faster with the next Q tile requested after S (load_at=1) than after P.
BWD_TILES_2D_SM90_DTYPE = {
    "bfloat16": {64: replace(BWD_TILES_2D_SM90[64], p_regs=False),
                 128: replace(BWD_TILES_2D_SM90[128], load_at=1)},
}


def bwd_tiles(warp_partition: str = "kv", arch: int = 80, dtype: str | None = None) -> dict:
    """The tile table of one backward warp partition ("kv", "q" or "2d") for a device of compute capability
    `arch` (e.g. 90; the sm_80 tables unless the partition has sm_90 tiles) and inputs of `dtype` ("float16" or
    "bfloat16"; None: the fp16 table)."""
    table = {"kv": BWD_TILES, "q": BWD_TILES_Q, "2d": BWD_TILES_2D}[warp_partition]
    if arch >= 90 and warp_partition == "2d":
        return {**table, **BWD_TILES_2D_SM90, **BWD_TILES_2D_SM90_DTYPE.get(dtype, {})}
    return table


def bwd_do_stages(headdim: int, tile: BwdTile, warp_partition: str = "kv") -> int:
    """dO buffers: 2 (like Q), except 1 in the "2d" partition when 2 would not fit sm_80 (BwdSmem::DO_STAGES),
    unless the tile sets do_stages."""
    if tile.do_stages:
        return tile.do_stages
    if warp_partition == "2d" and _bwd_smem(headdim, replace(tile, dq_bulk=False), warp_partition, 2) > SM80_MAX_SMEM:
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


def _bwd_name_extras(tile: BwdTile) -> str:
    """The kernel's trailing template arguments DQ_BULK, DO_ST, P_REGS, DQ_ISSUE, LOAD_AT, EXP_IL, written up to
    the last one that is not its default."""
    args = ["true" if tile.dq_bulk else "false", str(tile.do_stages), "true" if tile.p_regs else "false",
            str(tile.dq_issue), str(tile.load_at), "true" if tile.exp_il else "false"]
    defaults = ["false", "0", "false", "0", "0", "false"]
    while args and args[-1] == defaults[len(args) - 1]:
        args.pop()
    return "".join(", " + a for a in args)


def sm90_only(headdim: int, tile: BwdTile, warp_partition: str = "2d") -> bool:
    """Whether a backward tile needs sm_90 (the bulk reduction, or more shared memory than sm_80's)."""
    return tile.dq_bulk or bwd_smem_bytes(headdim, tile, warp_partition) > SM80_MAX_SMEM


def bwd_spec(dtype: str, headdim: int, causal: bool, tile: BwdTile | None = None,
             warp_partition: str = "kv") -> KernelSpec:
    tile = tile or bwd_tiles(warp_partition)[headdim]
    smem = bwd_smem_bytes(headdim, tile, warp_partition)
    name = (f"cuflash::flash_bwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
            f"{tile.dsplit}, {'true' if causal else 'false'}, {smem}, {BWD_PARTITIONS[warp_partition]}, "
            f"{tile.kunroll}{_bwd_name_extras(tile)}>")
    min_arch = 90 if sm90_only(headdim, tile, warp_partition) else 80
    return KernelSpec("flash_bwd.cu", name, tile.nwarps * 32, smem, min_arch)


def bwd_preprocess_spec(dtype: str, headdim: int) -> KernelSpec:
    return KernelSpec("flash_bwd.cu", f"cuflash::flash_bwd_preprocess_kernel<{CTYPE[dtype]}, {headdim}, "
                      f"{bwd_pre_lanes_per_row(headdim)}>",
                      BWD_PRE_THREADS, 0)


def bwd_convert_spec(dtype: str, headdim: int, causal: bool, block_n: int) -> KernelSpec:
    return KernelSpec("flash_bwd.cu", f"cuflash::flash_bwd_convert_dq_kernel<{CTYPE[dtype]}, {headdim}, {block_n}, "
                      f"{'true' if causal else 'false'}>", BWD_CONVERT_THREADS, 0)


def all_specs():
    """Every kernel configuration the package can launch (CI compiles each for sm_80 and sm_90)."""
    specs = []
    for dt in DTYPES:
        for d in HEADDIMS:
            for causal in (False, True):
                specs.append(fwd_spec(dt, d, causal, split=False))
                specs.append(fwd_spec(dt, d, causal, split=True))
            specs.append(combine_spec(dt, d))
            specs.append(append_spec(dt, d))
            specs.append(bwd_preprocess_spec(dt, d))
            for causal in (False, True):
                for part in BWD_PARTITIONS:
                    if d in bwd_tiles(part):
                        specs.append(bwd_spec(dt, d, causal, warp_partition=part))
                        if part == "2d" and d in BWD_TILES_2D_SM90:
                            specs.append(bwd_spec(dt, d, causal, bwd_tiles(part, 90, dt)[d], part))
                        conv = bwd_convert_spec(dt, d, causal, bwd_tiles(part)[d].block_n)
                        if conv not in specs:
                            specs.append(conv)
        specs.append(softmax_spec(dt))
    specs += decode_specs()  # the dedicated Flash-Decoding kernel (cuda_src/flash_decode.cu)
    from . import v1  # FlashAttention-1 kernels (their tiles live in cuflash/v1.py)

    specs += [s for s in v1.specs() if s not in specs]
    return specs
