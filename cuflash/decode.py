"""Flash-Decoding: attention of a few new queries against a KV cache, split across thread blocks.

For decoding (seqlen_q = 1, or a few tokens for speculative decoding), batch x heads x Q tiles is far
too few thread blocks to fill the GPU, so the key range is split across blocks too: each block computes
a partial output and its LSE in fp32 over its share of the keys (cuda_src/flash_fwd.cu with SPLIT), and
a combine kernel re-scales the partials by exp(LSE_split - LSE_total) and sums them.

CUDA-graph friendly: the split count is chosen from static shapes only (never from the values in
cache_seqlens), nothing is read back to the host, and scratch memory comes from the caller's allocator
(torch's caching allocator, which serves graph captures from the graph's private pool) or from `scratch`.
"""
from __future__ import annotations

import functools

from . import _interop
from ._configs import DECODE_TILES, append_spec, fwd_smem_bytes
from ._launch import get_launcher
from ._validate import check_dtype, check_layout, check_qkv, check_rank, check_same, check_unsupported
from .flash import forward

MAX_SPLITS = 128
APPEND_FORMAT = "=" + "Q" * 5 + "q" * 16


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    from cupy.cuda import runtime

    return runtime.getDeviceProperties(device)["multiProcessorCount"]


@functools.lru_cache(maxsize=None)
def smem_per_sm(device: int) -> int:
    from cupy.cuda import runtime

    return runtime.getDeviceProperties(device)["sharedMemPerMultiprocessor"]


def decode_slots(device: int, smem_bytes: int) -> int:
    """Thread blocks of the split-KV kernel the GPU runs at once (shared memory bounds the occupancy)."""
    return sm_count(device) * max(1, smem_per_sm(device) // max(smem_bytes, 1))


@functools.lru_cache(maxsize=4096)
def num_splits_heuristic(blocks: int, num_sms: int, kv_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """Split count that fills the GPU in whole waves (flash-attn's rule, counted in resident blocks).

    blocks = batch x KV heads x Q tiles without splitting; num_sms = the blocks the GPU holds at once
    (SMs x blocks per SM: decoding is bound by the bytes in flight, so every resident slot counts; on the
    H200 2 slots per SM measured 1.3-1.4x faster than 1 at batch 1, bench/results decode_sweep). If the
    blocks already (nearly) fill the slots, do not split. Otherwise take the smallest split count whose
    wave efficiency n*blocks / (waves * slots) is within 85% of the best, never more splits than KV tiles.
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
        if e >= 0.85 * best:
            return n
    return max_splits


def _check_cache_seqlens(cache_seqlens, qa, b):
    if cache_seqlens is None:
        return None, 0
    if isinstance(cache_seqlens, int):
        return None, cache_seqlens
    ca = _interop.wrap(cache_seqlens, "cache_seqlens")
    check_same(qa, "q", ca, "cache_seqlens")
    if ca.dtype != "int32":
        raise TypeError(f"cache_seqlens must be int32; got {ca.dtype}")
    if ca.shape != (b,) or ca.strides != (1,):
        raise ValueError(f"cache_seqlens must be a contiguous int32 array of shape ({b},); got shape {ca.shape}")
    return ca, 0


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None,
                            causal=False, num_splits=0, return_softmax_lse=False, *, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, scratch=None):
    """flash-attn's `flash_attn_with_kvcache` on torch tensors or CuPy arrays.

    q [b, sq, h, d] (sq small: 1 for decoding); k_cache, v_cache [b, s_cache, hk, d]; cache_seqlens
    int32 [b] (or an int) valid entries per cache; k, v [b, s_new, hk, d] are first written into the
    caches at cache_seqlens (in place; the kernel attends to cache_seqlens + s_new keys, and entries past
    the capacity are dropped). Causal is bottom-right aligned against each batch element's key count.
    num_splits = 0 picks the split count by `num_splits_heuristic`; an explicit count is honoured.
    Returns out [b, sq, h, d], and softmax_lse [b, h, sq] float32 with return_softmax_lse=True.
    `scratch` may hold preallocated fp32 partials (o_accum [n, b, hk', rows, d], lse_accum [n, b, hk', rows]).
    """
    check_unsupported(0.0, window_size, softcap, alibi_slopes)
    qa, kca, vca = check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    b, sq, h, d = qa.shape
    s_cache, hk = kca.shape[1], kca.shape[2]
    ca, seqlen_int = _check_cache_seqlens(cache_seqlens, qa, b)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0; got {num_splits!r}")
    seqlen_k_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
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
        lau = get_launcher(append_spec(qa.dtype, d), qa.device)
        n = 2 * b * seqlen_k_new * hk * (d // 8)
        with _interop.device_guard(qa.device):
            lau.launch((-(-n // lau.threads), 1, 1), _interop.current_stream(qa), APPEND_FORMAT,
                       kca.ptr, vca.ptr, kna.ptr, vna.ptr, ca.ptr, *kca.strides[:3], *vca.strides[:3],
                       *kna.strides[:3], *vna.strides[:3], b, seqlen_k_new, hk, s_cache)

    # Keys seen per batch element: a device array (cache_seqlens [+ s_new]) or one host int.
    seqlen_k = s_cache if ca is not None or cache_seqlens is None else min(seqlen_int, s_cache)
    if ca is None and cache_seqlens is not None and seqlen_int < 1:
        raise ValueError(f"cache_seqlens must be >= 1 when given as an int; got {seqlen_int}")
    kc = kca if seqlen_k == s_cache else _interop.Arr(kca.kind, kca.obj, kca.ptr, (b, seqlen_k, hk, d), kca.strides,
                                                      kca.dtype, kca.device)
    vc = vca if seqlen_k == s_cache else _interop.Arr(vca.kind, vca.obj, vca.ptr, (b, seqlen_k, hk, d), vca.strides,
                                                      vca.dtype, vca.device)
    tile = DECODE_TILES[d]
    rows = h // hk if (sq == 1 and h > hk) else sq
    kheads = hk if (sq == 1 and h > hk) else h
    if num_splits == 0:
        blocks = b * kheads * -(-rows // tile.block_m)
        num_splits = num_splits_heuristic(blocks, decode_slots(qa.device, fwd_smem_bytes(d, tile)),
                                          -(-seqlen_k // tile.block_n))
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    out, lse = forward(qa, kc, vc, softmax_scale, causal, tile=tile if num_splits > 1 else None,
                       seqlens_k_ptr=ca.ptr if ca is not None else 0, seqlen_k_new=seqlen_k_new,
                       num_splits=num_splits, scratch=scratch)
    return (out, lse) if return_softmax_lse else out
