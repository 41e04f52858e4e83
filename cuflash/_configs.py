"""The one place that chooses kernel configurations: template arguments, threads, shared memory.

The kernels static_assert their invariants (tile divisibility, the shared-memory size computed here), so
a wrong entry fails to compile -- in CI, which compiles every configuration listed by `all_specs()` for
sm_80 and sm_90 and rejects spills.
"""
from __future__ import annotations

from dataclasses import dataclass

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


# Forward tiles per head dim (tuned on the H200: bench/results/fwd_sweep.* records the sweep).
FWD_TILES = {
    32: FwdTile(128, 64, 4),
    64: FwdTile(128, 64, 4),
    96: FwdTile(128, 64, 8),
    128: FwdTile(128, 32, 4),  # two 16-row fragments per warp: each K/V ldmatrix feeds 4 mma
    256: FwdTile(64, 32, 4),
}

# Split-KV (decoding) tiles: 4 warps share the loads of each K/V tile; a warp whose 16 query rows are
# all past seqlen_q (decoding has 1..16 rows per KV head) skips the math.
DECODE_TILES = {
    32: FwdTile(64, 128, 4),
    64: FwdTile(64, 128, 4),
    96: FwdTile(64, 128, 4),
    128: FwdTile(64, 64, 4),
    256: FwdTile(64, 32, 4),
}


def fwd_smem_bytes(headdim: int, tile: FwdTile) -> int:
    """Q tile + 2 stages x (K tile + V tile), rows padded (cuda_src/flash_fwd.cu static_asserts it)."""
    return (tile.block_m + 4 * tile.block_n) * (headdim + SMEM_ROW_PAD) * ELEM_BYTES


def fwd_spec(dtype: str, headdim: int, causal: bool, split: bool, tile: FwdTile | None = None) -> KernelSpec:
    if tile is None:
        tile = (DECODE_TILES if split else FWD_TILES)[headdim]
    smem = fwd_smem_bytes(headdim, tile)
    name = (
        f"cuflash::flash_fwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
        f"{'true' if causal else 'false'}, {'true' if split else 'false'}, {smem}>"
    )
    return KernelSpec("flash_fwd.cu", name, tile.nwarps * 32, smem)


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


BWD_TILES = {
    32: BwdTile(64, 128, 8, 1),
    64: BwdTile(64, 128, 8, 1),
    96: BwdTile(64, 128, 8, 1),
    128: BwdTile(32, 128, 8, 1),  # 64-row Q tiles spill at head dim 128 (dK, dV: 128 fp32 registers)
    256: BwdTile(32, 64, 8, 2),
}
BWD_ROW_PAD = 128  # fp32 row buffers (lse_log2, D, dQ accumulator) are padded to this many rows
BWD_PRE_ROWS_PER_BLOCK = 4
BWD_CONVERT_THREADS = 256


def bwd_smem_bytes(headdim: int, tile: BwdTile) -> int:
    """K, V tiles + 2 stages x (Q, dO) tiles + dS^T tile + 2 stages x (lse, D) rows (flash_bwd.cu)."""
    lds = headdim + SMEM_ROW_PAD
    return ((2 * tile.block_n + 4 * tile.block_m) * lds + tile.block_n * (tile.block_m + SMEM_ROW_PAD)) * ELEM_BYTES \
        + 4 * tile.block_m * 4


def bwd_spec(dtype: str, headdim: int, causal: bool, tile: BwdTile | None = None) -> KernelSpec:
    tile = tile or BWD_TILES[headdim]
    smem = bwd_smem_bytes(headdim, tile)
    name = (f"cuflash::flash_bwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
            f"{tile.dsplit}, {'true' if causal else 'false'}, {smem}>")
    return KernelSpec("flash_bwd.cu", name, tile.nwarps * 32, smem)


def bwd_preprocess_spec(dtype: str, headdim: int) -> KernelSpec:
    return KernelSpec("flash_bwd.cu", f"cuflash::flash_bwd_preprocess_kernel<{CTYPE[dtype]}, {headdim}>",
                      32 * BWD_PRE_ROWS_PER_BLOCK, 0)


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
                specs.append(bwd_spec(dt, d, causal))
                specs.append(bwd_convert_spec(dt, d, causal, BWD_TILES[d].block_n))
        specs.append(softmax_spec(dt))
    from . import v1  # FlashAttention-1 kernels (their tiles live in cuflash/v1.py)

    specs += [s for s in v1.specs() if s not in specs]
    return specs
