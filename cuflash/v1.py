"""FlashAttention-1 (Dao et al. 2022) forward and backward: cuda_src/flash_v1.cu.

The V1 algorithm, kept as the paper describes it so that the V1 -> V2 ladder (bench/bench_v1.py,
README_v1.md) measures what V2 changed:

* forward: one thread block per (head, batch); KV tiles in the outer loop, Q tiles in the inner loop;
  for every (KV tile, Q tile) pair the fp32 O_i and the row statistics m_i, l_i are read from device
  memory, updated and written back. The last KV tile that visits a row writes the output in the input
  dtype and the LSE. Warp partition: "k" (V1's split-K: warps split the KV tile's keys and combine their
  partial softmax statistics and P V products through shared memory) or "q" (the ladder's middle step:
  warps split the Q rows as V2 does, no cross-warp reduction).
* backward: one thread block per (KV head, batch) walking every KV tile (outer) and every Q tile of the
  query heads that share the KV head (inner); P = diag(l)^-1 exp(S - m) from the forward's m and l,
  D_i = rowsum(dO_i * O_i) recomputed per tile, dQ accumulated in an fp32 buffer with read-modify-write
  (one writer per row: no atomics), dK and dV in registers, written once per KV tile.

Exponentials are base 2 with the scale folded (exp(s * scale - m) = exp2(s * scale_log2 - m * log2 e));
m and l are returned in natural units: m = row max of softmax_scale * Q K^T, l = sum exp(scale * s - m),
LSE = m + log l (as cuflash.reference.flash_v1_forward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import _interop
from ._configs import CTYPE, DTYPES, ELEM_BYTES, SMEM_ROW_PAD
from ._launch import KernelSpec, get_launcher, struct_format

LOG2E = math.log2(math.e)
FILENAME = "flash_v1.cu"
HEADDIMS = (32, 64, 96, 128)
WARP_SPLITS = {"k": 0, "q": 1}  # cuda_src/flash_v1.cu: enum WarpSplit { SPLIT_K = 0, SPLIT_Q = 1 }
_MAX_GRID_Y = 65535

# Field order of cuflash::V1FwdParams / V1BwdParams (cuda_src/flash_v1.cu): P = pointer, q = int64, d = double.
FWD_PARAMS = (
    ("q", "P"), ("k", "P"), ("v", "P"), ("o", "P"), ("o_accum", "P"), ("m", "P"), ("l", "P"), ("lse", "P"),
    *((f"{t}_{s}_stride", "q") for t in ("q", "k", "v", "o") for s in ("batch", "row", "head")),
    ("batch", "q"), ("nheads", "q"), ("heads_per_kv", "q"), ("seqlen_q", "q"), ("seqlen_k", "q"),
    ("scale_log2", "d"),
)
BWD_PARAMS = (
    ("q", "P"), ("k", "P"), ("v", "P"), ("o", "P"), ("dout", "P"), ("m", "P"), ("l", "P"), ("dq_accum", "P"),
    ("dq", "P"), ("dk", "P"), ("dv", "P"),
    *((f"{t}_{s}_stride", "q") for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv") for s in ("batch", "row", "head")),
    ("batch", "q"), ("nheads", "q"), ("heads_per_kv", "q"), ("seqlen_q", "q"), ("seqlen_k", "q"), ("seqlen_q_pad", "q"),
    ("scale_log2", "d"), ("softmax_scale", "d"),
)
FWD_FORMAT = struct_format(FWD_PARAMS)
BWD_FORMAT = struct_format(BWD_PARAMS)


@dataclass(frozen=True)
class V1Tile:
    block_m: int  # Q rows per inner step
    block_n: int  # keys per KV tile
    nwarps: int  # split-K: warps split block_n (block_n / nwarps keys each); split-Q: warps split block_m
    kunroll: int = 0  # backward: k16 steps of S^T, dP^T unrolled per loop trip (0: all; flash_v1.cu KUNROLL)


# Forward tiles. Split-K follows V1's own kernels: 16 query rows per step, 4 warps splitting 256 keys
# (64 each) at head dim <= 64 and 128 keys (32 each) above. Split-Q: V2's partition, 16 rows per warp.
FWD_TILES = {
    "k": {32: V1Tile(16, 256, 4), 64: V1Tile(16, 256, 4), 96: V1Tile(16, 128, 4), 128: V1Tile(16, 128, 4)},
    "q": {32: V1Tile(64, 128, 4), 64: V1Tile(64, 128, 4), 96: V1Tile(64, 64, 4), 128: V1Tile(64, 64, 4)},
}
# Backward tiles: warp w owns 16 KV rows (block_n = 16 * nwarps). The V2 backward's tile sizes, so the
# ladder compares algorithms, not tiles, except head dim 96 (32-row Q tiles: with V1's extra O_i / dQ_i
# tiles 64 rows spill on sm_90); 64-row Q tiles would spill at head dim 128 (dK, dV: 128 fp32 registers).
# Head dims 96 and 128 unroll 4 k16 steps per trip: fully unrolled, NVRTC 13.0 (the H200 image's) spills there.
BWD_TILES = {32: V1Tile(64, 128, 8), 64: V1Tile(64, 128, 8), 96: V1Tile(32, 128, 8, 4), 128: V1Tile(32, 128, 8, 4)}
CONVERT_THREADS = 256


def fwd_smem_bytes(headdim: int, tile: V1Tile, warp_split: str) -> int:
    """K, V tiles + 2 stages of Q (16-bit, rows padded) + split-K's fp32 exchange: [nwarps][block_m] rows of
    headdim + 8 floats (P~_w V_w) and 2 floats (m~_w, l~_w)."""
    lds = headdim + SMEM_ROW_PAD
    smem = (2 * tile.block_n + 2 * tile.block_m) * lds * ELEM_BYTES
    if warp_split == "k":
        smem += tile.nwarps * tile.block_m * (headdim + 8 + 2) * 4
    return smem


def bwd_smem_bytes(headdim: int, tile: V1Tile) -> int:
    """K, V tiles + 2 stages x (Q, dO, O) + dS^T tile (16-bit) + 2 stages x (dQ_i rows of headdim + 4 floats,
    m2, 1/l) + D_i (fp32)."""
    lds = headdim + SMEM_ROW_PAD
    return ((2 * tile.block_n + 6 * tile.block_m) * lds + tile.block_n * (tile.block_m + SMEM_ROW_PAD)) * ELEM_BYTES \
        + (2 * tile.block_m * (headdim + 4) + 5 * tile.block_m) * 4


def _check_headdim(d: int) -> None:
    if d not in HEADDIMS:
        raise ValueError(f"the V1 kernels support head dims {HEADDIMS}; got {d} (use algorithm='v2')")


def _check_split(warp_split: str) -> None:
    if warp_split not in WARP_SPLITS:
        raise ValueError(f"warp_split must be one of {tuple(WARP_SPLITS)}; got {warp_split!r}")


def fwd_spec(dtype: str, headdim: int, causal: bool, warp_split: str = "k", tile: V1Tile | None = None) -> KernelSpec:
    _check_split(warp_split)
    tile = tile or FWD_TILES[warp_split][headdim]
    smem = fwd_smem_bytes(headdim, tile, warp_split)
    name = (f"cuflash::flash_v1_fwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
            f"{WARP_SPLITS[warp_split]}, {'true' if causal else 'false'}, {smem}>")
    return KernelSpec(FILENAME, name, tile.nwarps * 32, smem)


def bwd_spec(dtype: str, headdim: int, causal: bool, tile: V1Tile | None = None) -> KernelSpec:
    tile = tile or BWD_TILES[headdim]
    smem = bwd_smem_bytes(headdim, tile)
    name = (f"cuflash::flash_v1_bwd_kernel<{CTYPE[dtype]}, {headdim}, {tile.block_m}, {tile.block_n}, {tile.nwarps}, "
            f"{'true' if causal else 'false'}, {smem}{f', {tile.kunroll}' if tile.kunroll else ''}>")
    return KernelSpec(FILENAME, name, tile.nwarps * 32, smem)


def convert_spec(dtype: str, headdim: int) -> KernelSpec:
    return KernelSpec(FILENAME, f"cuflash::flash_v1_bwd_convert_dq_kernel<{CTYPE[dtype]}, {headdim}>",
                      CONVERT_THREADS, 0)


def specs():
    """Every kernel configuration the V1 code can launch (CI compiles each for sm_80 and sm_90)."""
    out = []
    for dt in DTYPES:
        for d in HEADDIMS:
            for causal in (False, True):
                for split in WARP_SPLITS:
                    out.append(fwd_spec(dt, d, causal, split))
                out.append(bwd_spec(dt, d, causal))
            out.append(convert_spec(dt, d))
    return out


def _strides_of(x):
    s = x.stride() if callable(getattr(x, "stride", None)) else tuple(v // x.itemsize for v in x.strides)
    return tuple(s)


def _grid(x: int, batch: int):
    if batch > _MAX_GRID_Y:
        raise ValueError(f"the V1 kernels launch one block per (head, batch): batch {batch} > {_MAX_GRID_Y}")
    return (x, batch, 1)


def forward(qa, ka, va, softmax_scale, causal, warp_split="k", tile=None):
    """V1 forward on validated views (cuflash._validate.check_qkv). Returns (out, lse, m, l) of the inputs'
    kind: out like q; lse, m, l float32 [b, h, sq] (lse = m + log l natural, -inf for rows that see no key;
    m = row max of the scaled scores, l = row sum of exp(scale * s - m): the statistics `backward` uses)."""
    _check_split(warp_split)
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    _check_headdim(d)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    spec = fwd_spec(qa.dtype, d, causal, warp_split, tile)
    out = _interop.empty(qa, (b, sq, h, d), qa.dtype)
    lse = _interop.empty(qa, (b, h, sq), "float32")
    m = _interop.empty(qa, (b, h, sq), "float32")
    l = _interop.empty(qa, (b, h, sq), "float32")
    o_accum = _interop.empty(qa, (b, h, sq, d), "float32")  # fully written before it is read
    osb, osq, osh, _ = _strides_of(out)
    ptr = _interop.data_ptr
    lau = get_launcher(spec, qa.device)
    stream = _interop.current_stream(qa)
    with _interop.device_guard(qa.device):
        lau.launch(
            _grid(h, b), stream, FWD_FORMAT,
            qa.ptr, ka.ptr, va.ptr, ptr(out), ptr(o_accum), ptr(m), ptr(l), ptr(lse),
            *qa.strides[:3], *ka.strides[:3], *va.strides[:3], osb, osq, osh,
            b, h, h // hk, sq, sk, softmax_scale * LOG2E,
        )
    return out, lse, m, l


def _stat_ptr(x, name: str, like, shape) -> int:
    """Pointer of a float32 contiguous [b, h, sq] statistic (an Arr view or a raw torch / CuPy array)."""
    a = x if isinstance(x, _interop.Arr) else _interop.wrap(x, name)
    if a.kind != like.kind or a.device != like.device:
        raise ValueError(f"{name} must be a {_interop.KIND_NAME[like.kind]} array on cuda:{like.device}")
    _, h, sq = shape
    if tuple(a.shape) != shape or a.dtype != "float32" or tuple(a.strides) != (h * sq, sq, 1):
        raise ValueError(f"{name} must be a contiguous float32 array of shape {shape}; got {a.dtype} {tuple(a.shape)} "
                         f"strides {tuple(a.strides)}")
    return a.ptr


def backward(da, qa, ka, va, oa, m, l, softmax_scale, causal, tile=None):
    """V1 backward on validated views: (dq, dk, dv) of the inputs' kind (contiguous; dk, dv summed over the
    query heads that share a KV head). m, l: the statistics from `forward` (float32 [b, h, sq])."""
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    _check_headdim(d)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    m_ptr = _stat_ptr(m, "m", qa, (b, h, sq))
    l_ptr = _stat_ptr(l, "l", qa, (b, h, sq))
    tile = tile or BWD_TILES[d]
    sq_pad = -(-sq // tile.block_m) * tile.block_m
    dq = _interop.empty(qa, (b, sq, h, d), qa.dtype)
    dk = _interop.empty(qa, (b, sk, hk, d), qa.dtype)
    dv = _interop.empty(qa, (b, sk, hk, d), qa.dtype)
    dq_accum = _interop.zeros(qa, (b, h, sq_pad, d), "float32")  # Algorithm 4: dQ = 0 in HBM, then += per tile
    ptr = _interop.data_ptr
    values = (
        qa.ptr, ka.ptr, va.ptr, oa.ptr, da.ptr, m_ptr, l_ptr, ptr(dq_accum), ptr(dq), ptr(dk), ptr(dv),
        *qa.strides[:3], *ka.strides[:3], *va.strides[:3], *oa.strides[:3], *da.strides[:3],
        sq * h * d, h * d, d, sk * hk * d, hk * d, d, sk * hk * d, hk * d, d,  # dq, dk, dv: contiguous
        b, h, h // hk, sq, sk, sq_pad, softmax_scale * LOG2E, softmax_scale,
    )
    dev = qa.device
    main = get_launcher(bwd_spec(qa.dtype, d, causal, tile), dev)
    conv = get_launcher(convert_spec(qa.dtype, d), dev)
    stream = _interop.current_stream(qa)
    with _interop.device_guard(dev):
        main.launch(_grid(hk, b), stream, BWD_FORMAT, *values)
        pairs = b * h * sq * (d // 2)
        conv.launch((-(-pairs // conv.threads), 1, 1), stream, BWD_FORMAT, *values)
    return dq, dk, dv


def _ones_f32(like, shape):
    x = _interop.empty(like, shape, "float32")
    if like.kind == _interop.TORCH:
        x.fill_(1.0)
    else:
        x.fill(1.0)
    return x


def backward_from_lse(da, qa, ka, va, oa, la, softmax_scale, causal):
    """V1 backward for callers that kept only the LSE (the CuPy API): m = LSE, l = 1 gives the same
    P = exp(S - LSE) (rows with LSE = -inf: P = 0)."""
    b, sq, h, _ = qa.shape
    return backward(da, qa, ka, va, oa, la, _ones_f32(qa, (b, h, sq)), softmax_scale, causal)
