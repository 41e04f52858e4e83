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

from . import _interop
from ._configs import (V1_BWD_TILES, V1_FILENAME, V1_FWD_TILES, V1_HEADDIMS, WARP_SPLITS, V1Tile,  # noqa: F401
                       check_warp_split, v1_bwd_smem_bytes, v1_bwd_spec, v1_bwd_tile, v1_convert_spec,
                       v1_fwd_smem_bytes, v1_fwd_spec, v1_specs)
from ._launch import get_launcher
from ._mods import LOG2E
from ._params import V1_BWD_PARAMS, V1_FWD_PARAMS, contiguous_fields, stride_fields
from ._plan import HostPlan
from ._validate import check_aligned

_MAX_GRID_Y = 65535

# The V1 configuration lives in cuflash/_configs.py with every other family's; these names are kept for the
# benchmarks and tests that read them from here.
FILENAME, HEADDIMS = V1_FILENAME, V1_HEADDIMS
FWD_TILES, BWD_TILES = V1_FWD_TILES, V1_BWD_TILES
fwd_smem_bytes, bwd_smem_bytes = v1_fwd_smem_bytes, v1_bwd_smem_bytes
fwd_spec, bwd_spec, convert_spec, specs = v1_fwd_spec, v1_bwd_spec, v1_convert_spec, v1_specs
# Parameter blocks (cuda_src/attn/params.cuh: V1FwdParams, V1BwdParams), filled by field name.
FWD_PARAMS, BWD_PARAMS = V1_FWD_PARAMS, V1_BWD_PARAMS
FWD_FORMAT, BWD_FORMAT = V1_FWD_PARAMS.format, V1_BWD_PARAMS.format
_check_split = check_warp_split


def _check_headdim(d: int) -> None:
    if d not in HEADDIMS:
        raise ValueError(f"the V1 kernels support head dims {HEADDIMS}; got {d} (use algorithm='v2')")


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
    check_warp_split(warp_split)
    b, sq, h, d = qa.shape
    sk, hk = ka.shape[1], ka.shape[2]
    _check_headdim(d)
    check_aligned(d, ((qa, "q"), (ka, "k"), (va, "v")), "algorithm='v1'")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    spec = fwd_spec(qa.dtype, d, causal, warp_split, tile)
    plan = HostPlan(qa)
    stats = plan.spec((b, h, sq), float32=True)
    # out, lse, m, l, and o_accum (fully written before it is read)
    (out, lse, m, l, o_accum), (op, lp, mp, lsp, oap), stream = plan.allocator(
        plan.spec((b, sq, h, d)), stats, stats, stats, plan.spec((b, h, sq, d), float32=True))()
    osb, osq, osh, _ = _strides_of(out)
    plan.bind(V1_FWD_PARAMS, ("q", "k", "v", "o", "o_accum", "m", "l", "lse"),
              **stride_fields("q", qa.strides), **stride_fields("k", ka.strides), **stride_fields("v", va.strides),
              **stride_fields("o", (osb, osq, osh)),
              batch=b, nheads=h, heads_per_kv=h // hk, seqlen_q=sq, seqlen_k=sk, scale_log2=softmax_scale * LOG2E)
    plan.add_launch(get_launcher(spec, qa.device), _grid(h, b))
    plan.launch(stream, qa.ptr, ka.ptr, va.ptr, op, oap, mp, lsp, lp)
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
    check_aligned(d, ((da, "dout"), (qa, "q"), (ka, "k"), (va, "v"), (oa, "out")), "algorithm='v1'")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    m_ptr = _stat_ptr(m, "m", qa, (b, h, sq))
    l_ptr = _stat_ptr(l, "l", qa, (b, h, sq))
    tile = tile or v1_bwd_tile(d)
    sq_pad = -(-sq // tile.block_m) * tile.block_m
    plan = HostPlan(qa)
    dq_shape, kv_shape = (b, sq, h, d), (b, sk, hk, d)
    kv = plan.spec(kv_shape)
    (dq, dk, dv), (dqp, dkp, dvp), stream = plan.allocator(plan.spec(dq_shape), kv, kv)()
    dq_accum = _interop.zeros(qa, (b, h, sq_pad, d), "float32")  # Algorithm 4: dQ = 0 in HBM, then += per tile
    plan.bind(V1_BWD_PARAMS, ("q", "k", "v", "o", "dout", "m", "l", "dq_accum", "dq", "dk", "dv"),
              **stride_fields("q", qa.strides), **stride_fields("k", ka.strides), **stride_fields("v", va.strides),
              **stride_fields("o", oa.strides), **stride_fields("do", da.strides),
              **contiguous_fields("dq", dq_shape), **contiguous_fields("dk", kv_shape),
              **contiguous_fields("dv", kv_shape),
              batch=b, nheads=h, heads_per_kv=h // hk, seqlen_q=sq, seqlen_k=sk, seqlen_q_pad=sq_pad,
              scale_log2=softmax_scale * LOG2E, softmax_scale=softmax_scale)
    dev = qa.device
    plan.add_launch(get_launcher(bwd_spec(qa.dtype, d, causal, tile), dev), _grid(hk, b))
    conv = get_launcher(convert_spec(qa.dtype, d), dev)
    pairs = b * h * sq * (d // 2)
    plan.add_launch(conv, (-(-pairs // conv.threads), 1, 1))
    plan.launch(stream, qa.ptr, ka.ptr, va.ptr, oa.ptr, da.ptr, m_ptr, l_ptr, _interop.data_ptr(dq_accum), dqp,
                dkp, dvp)
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
