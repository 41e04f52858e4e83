"""CPU: the dedicated decode kernel without a GPU -- its algorithm (float64 emulation with the kernel's
integer arithmetic: split ranges, round-robin warp tiles, masks, the cross-warp combine) against naive
attention, its configurations (names, shared memory, occupancy), and the host fast path of
flash_attn_with_kvcache (plans, packed parameters, validation) with the GPU replaced by stand-ins."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from cuflash import _configs, reference
from cuflash._params import APPEND_ARGS
from cuflash.decode import (CHAIN_SLACK, KERNELS, SPLIT_RULES, check_kernel, decode_geometry, decode_kv_block,
                            decode_num_splits, resident_blocks, shortest_chain_splits, without_empty_splits)
from conftest import run_result_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HO = "bench.diag.host_overhead" if os.path.exists(os.path.join(ROOT, "bench", "diag", "host_overhead.py")) \
    else "bench.host_overhead"  # the CPU stand-ins for torch, the driver and the loader
SM80_MAX_SMEM = 163 * 1024
SM90_SMEM_PER_SM = 228 * 1024


def _inputs(rng, b, sq, h, hk, sk, d):
    return (rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hk, d)),
            rng.standard_normal((b, sk, hk, d)))


def _naive(q, k, v, seqlens, causal):
    b, sq, h, d = q.shape
    out, lse = np.zeros(q.shape), np.zeros((b, h, sq))
    for i, n in enumerate(seqlens):
        out[i:i + 1], lse[i:i + 1] = reference.attention_forward(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], None,
                                                                 causal)
    return out, lse


@pytest.mark.parametrize("kv_len", [0, 1, 15, 16, 17, 64, 65, 1000])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40, 128])
@pytest.mark.parametrize("nwarps,block_n", [(4, 16), (2, 16), (4, 32)])
def test_warp_tiles_cover_every_key_once(kv_len, num_splits, nwarps, block_n):
    seen = []
    per_split_rounds = []
    for s in range(num_splits):
        tiles = reference.decode_warp_tiles(kv_len, num_splits, s, nwarps, block_n)
        assert len(tiles) == nwarps
        assert all(len(tiles[0]) - len(ts) in (0, 1) for ts in tiles)  # warps differ by at most one tile
        flat = sorted(t for ts in tiles for t in ts)
        per_split_rounds.append(len(flat))
        seen += flat
    n_tiles = -(-kv_len // block_n)
    assert sorted(seen) == list(range(n_tiles))  # every warp tile exactly once
    full = [n for n in per_split_rounds if n]
    assert all(n % nwarps == 0 for n in full[:-1])  # all but the last non-empty split: whole warp rounds


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
@pytest.mark.parametrize("b,sq,h,hk,mf", [
    (2, 1, 8, 8, 1),     # no GQA: 1 row of 16
    (2, 1, 8, 2, 1),     # GQA fold: 4 rows
    (1, 1, 32, 1, 2),    # MQA fold, 32 rows (mf 2)
    (1, 1, 64, 1, 2),    # 64 rows: two m-blocks of 32
    (1, 1, 40, 2, 1),    # 20 rows with mf 1 (d256's choice): two m-blocks of 16
])
def test_emulation_matches_attention(num_splits, b, sq, h, hk, mf):
    rng = np.random.default_rng(0)
    sk, d = 300, 32
    q, k, v = _inputs(rng, b, sq, h, hk, sk, d)
    seqlens = [300, 0][:b] if b == 2 else [257]
    out, lse = reference.decode_kernel_forward(q, k, v, num_splits=num_splits, nwarps=4, block_n=16, mf=mf,
                                               cache_seqlens=seqlens)
    ro, rl = _naive(q, k, v, seqlens, False)
    assert np.allclose(out, ro, atol=1e-12) and not np.isnan(out).any()
    assert np.array_equal(np.isneginf(lse), np.isneginf(rl))
    assert np.allclose(lse[np.isfinite(rl)], rl[np.isfinite(rl)], atol=1e-12)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("sq,seqlens", [(4, [10, 0, 600]), (20, [30, 5, 19]), (3, [1, 2, 100])])
def test_emulation_causal_speculative(num_splits, sq, seqlens):
    """Bottom-right causal with a few query rows, including rows that see no key (seqlen_k < sq)."""
    rng = np.random.default_rng(1)
    b, h, hk, sk, d = len(seqlens), 4, 2, 640, 16
    q, k, v = _inputs(rng, b, sq, h, hk, sk, d)
    out, lse = reference.decode_kernel_forward(q, k, v, causal=True, num_splits=num_splits, nwarps=4, block_n=16,
                                               mf=1 if sq <= 16 else 2, cache_seqlens=seqlens)
    ro, rl = _naive(q, k, v, seqlens, True)
    assert np.allclose(out, ro, atol=1e-12) and not np.isnan(out).any()
    assert np.array_equal(np.isneginf(lse), np.isneginf(rl))
    assert np.allclose(lse[np.isfinite(rl)], rl[np.isfinite(rl)], atol=1e-12)


def test_decode_specs_fit_and_name_their_smem():
    specs = _configs.decode_specs()
    assert specs and all(s in _configs.all_specs() for s in specs)
    for s in specs:
        assert s.filename == "flash_decode.cu" and s.name.startswith("cuflash::flash_decode_kernel<")
        # ..., SMEM_BYTES[, MOD[, PAGED[, SWZ]]]> (the swizzled ring spells PAGED out)
        assert re.search(rf", {s.smem}(, [01](, true|, (true|false), true)?)?>$", s.name) and s.smem % 16 == 0, s.name
        assert s.smem <= SM80_MAX_SMEM, (s.name, s.smem)
    for d, t in _configs.DECODE_KERNEL_TILES.items():
        assert t.block_n % 16 == 0 and t.stages >= 2 and 32 % (d // 8) in (0, 8)  # d96: 24 of 32 lanes load
        spec = _configs.decode_spec("float16", d, False, 1)
        assert spec.threads == 32 * t.nwarps
        # 1-3 blocks per SM on sm_90 (3: d32's 66 KB with the swizzled ring) and at least 64 KB of K/V in flight per
        # SM (the file header's arithmetic)
        resident = resident_blocks(spec.smem, spec.threads, 0, smem_per_sm=SM90_SMEM_PER_SM)
        assert resident in ((1, 2, 3) if d == 32 else (1, 2)), d
        in_flight = resident * t.nwarps * (t.stages - 1) * 2 * t.block_n * d * 2
        assert in_flight >= 64 * 1024, (d, in_flight)


def test_decode_smem_formula():
    t = _configs.DecodeTile(16, 4, 3)
    lds = 128 + 8
    assert _configs.decode_smem_bytes(128, t, 1) == 16 * lds * 2 + 4 * 3 * 2 * 16 * lds * 2
    # the cross-warp combine reuses the rings; when it is larger, it sets the size
    t2 = _configs.DecodeTile(16, 4, 2)
    red = 4 * 32 * (256 + 8 + 3) * 4
    assert _configs.decode_smem_bytes(256, t2, 2) == 32 * 264 * 2 + max(4 * 2 * 2 * 16 * 264 * 2, red)


def test_mf_choice():
    assert _configs.decode_mf(128, 1) == 1 and _configs.decode_mf(128, 16) == 1
    assert _configs.decode_mf(128, 17) == 2 and _configs.decode_mf(128, 32) == 2
    assert _configs.decode_mf(256, 32) == 1  # d256 keeps one fragment (registers)


def test_geometry():
    # (rows, kheads, heads_per_kv, fold, causal, mf, m_blocks)
    assert decode_geometry(1, 1, 32, 8, 128, False) == (4, 8, 1, True, False, 1, 1)
    assert decode_geometry(1, 1, 32, 32, 128, True) == (1, 32, 1, False, False, 1, 1)  # 1 row: causal is moot
    assert decode_geometry(2, 4, 8, 2, 64, True) == (4, 8, 4, False, True, 1, 1)
    assert decode_geometry(1, 1, 64, 1, 128, False) == (64, 1, 1, True, False, 2, 2)
    assert decode_geometry(1, 1, 64, 1, 256, False) == (64, 1, 1, True, False, 1, 4)


def test_resident_blocks_rule():
    # H200: 228 KB of smem per SM, 1 KB reserved per block
    assert resident_blocks(108800, 128, 168, smem_per_sm=233472) == 2
    assert resident_blocks(108800, 128, 168, smem_per_sm=167936) == 1  # A100
    assert resident_blocks(40000, 128, 255, smem_per_sm=233472) == 2  # registers: 4 warps x 8192
    assert resident_blocks(40000, 128, 128, smem_per_sm=233472) == 4
    assert resident_blocks(1000, 1024, 32, smem_per_sm=233472) == 2  # threads
    assert resident_blocks(300000, 128, 0, smem_per_sm=233472) == 1  # never 0


def test_decode_split_count_is_static_and_bounded():
    kv = decode_kv_block(128)
    assert kv == _configs.DECODE_KERNEL_TILES[128].nwarps * _configs.DECODE_KERNEL_TILES[128].block_n
    assert decode_num_splits(32, 264, 32768, 128) > 1  # batch 1, 32 heads: fill 264 slots
    assert decode_num_splits(256, 264, 32768, 128) == 1  # enough blocks already
    assert decode_num_splits(8, 264, kv, 128) == 1  # one block round of keys: nothing to split
    assert decode_num_splits(8, 264, 3 * kv, 128) <= 3
    for n in (1, 100, 4096, 131072):
        assert 1 <= decode_num_splits(8, 264, n, 128) <= max(1, -(-n // kv))


def test_kernel_keyword_validation():
    import cuflash

    assert KERNELS == ("decode", "fwd_split")
    check_kernel("decode")
    check_kernel("fwd_split")
    for bad in ("fwd", "", None, 1, ["decode"]):
        with pytest.raises(ValueError, match="kernel must be one of"):
            check_kernel(bad)
    with pytest.raises(ValueError, match="kernel must be one of"):
        cuflash.flash_attn_with_kvcache(None, None, None, kernel="split")


_HOST_SCRIPT = r"""
import json, struct, sys
sys.path.insert(0, ROOT)
import importlib
ho = importlib.import_module(HO_MODULE)
torch = ho.install_fakes(record=True)
import cuflash
from cuflash import decode
from cuflash._launch import FWD_FORMAT, FWD_PARAMS
names = [n for n, _ in FWD_PARAMS]
T = torch.Tensor
res = {}

def params(rec):
    return dict(zip(names, struct.unpack_from(FWD_FORMAT, rec[4], 0)))

def call(tag, *args, **kw):
    ho.LAUNCHES.clear()
    out = cuflash.flash_attn_with_kvcache(*args, **kw)
    res[tag] = dict(launches=[dict(name=r[0], grid=r[1], threads=r[2], smem=r[3], p=params(r), raw=r[4][:256].hex())
                              for r in ho.LAUNCHES],
                    out_shape=list((out[0] if isinstance(out, tuple) else out).shape), plans=len(decode._PLANS),
                    tuple=isinstance(out, tuple))

# GQA decode: b 2, h 32, hk 8, cache 4096, d 128, ragged cache_seqlens array -> fold, splits
q = T((2, 1, 32, 128), torch.float16)
kc = T((2, 4096, 8, 128), torch.float16); vc = T((2, 4096, 8, 128), torch.float16)
sl = T((2,), torch.int32)
call("gqa", q, kc, vc, cache_seqlens=sl)
call("gqa_again", q, kc, vc, cache_seqlens=sl)
call("gqa_lse", q, kc, vc, cache_seqlens=sl, return_softmax_lse=True)
call("gqa_1split", q, kc, vc, cache_seqlens=sl, num_splits=1)
# speculative, causal, append of 3 tokens
q4 = T((2, 3, 32, 128), torch.float16); kn = T((2, 3, 8, 128), torch.float16); vn = T((2, 3, 8, 128), torch.float16)
call("spec", q4, kc, vc, kn, vn, cache_seqlens=sl, causal=True, num_splits=5)
# host int cache_seqlens, bf16, d 64, no GQA
qb = T((1, 1, 8, 64), torch.bfloat16)
kb = T((1, 1000, 8, 64), torch.bfloat16); vb = T((1, 1000, 8, 64), torch.bfloat16)
call("int_seqlens", qb, kb, vb, cache_seqlens=700)
# MQA at batch 64 (64 blocks of 32 folded rows for 264 slots: a few splits, 2048 output rows)
qm = T((64, 1, 32, 128), torch.float16)
km = T((64, 16384, 1, 128), torch.float16); vm = T((64, 16384, 1, 128), torch.float16)
call("mqa_b64", qm, km, vm, cache_seqlens=T((64,), torch.int32))
call("mqa_b64_wide", qm, km, vm, cache_seqlens=T((64,), torch.int32), num_splits=9)
call("mqa_b64_block", qm, km, vm, cache_seqlens=T((64,), torch.int32), num_splits=17)
# the rows combine forced (plan_for): its wide form at 16 splits (head dim 128), none at head dim 256
sl64 = T((64,), torch.int32)
ho.LAUNCHES.clear()
decode.run_plan(decode.plan_for(qm, km, vm, cache_seqlens=sl64, num_splits=16, combine="rows"), qm, km, vm,
                cache_seqlens=sl64)
res["rows16"] = [[r[0], r[1]] for r in ho.LAUNCHES]
q256 = T((64, 1, 32, 256), torch.float16); k256 = T((64, 16384, 1, 256), torch.float16)
try:
    decode.plan_for(q256, k256, k256, cache_seqlens=sl64, num_splits=16, combine="rows")
    res["rows16_d256"] = "no error"
except ValueError as e:
    res["rows16_d256"] = str(e)
call("d256_9", q256, k256, k256, cache_seqlens=sl64, num_splits=9)
# misaligned pointer on a memoized plan: the validating path (the decode kernel's UA form runs it; not memoized)
bad = T((2, 1, 32, 128), torch.float16); bad._ptr += 2
plans0 = len(decode._PLANS)
try:
    call("misaligned_call", bad, kc, vc, cache_seqlens=sl)
    res["misaligned"] = "no error"
except ValueError as e:
    res["misaligned"] = str(e)
res["misaligned_kept"] = len(decode._PLANS) - plans0
try:
    cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=T((2,), torch.float32))
    res["bad_seqlens"] = "no error"
except TypeError as e:
    res["bad_seqlens"] = str(e)
for scale in (-1.0, float("nan"), "x"):
    try:
        cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, softmax_scale=scale)
        res.setdefault("bad_scale", []).append("no error")
    except (TypeError, ValueError) as e:
        res.setdefault("bad_scale", []).append(str(e))
# the cache indirections: a paged cache (6 pages of 256 keys, 3 per sequence) with a one-token append
kp = T((6, 256, 8, 128), torch.float16); vp = T((6, 256, 8, 128), torch.float16)
bt = T((2, 3), torch.int32)
k1 = T((2, 1, 8, 128), torch.float16); v1 = T((2, 1, 8, 128), torch.float16)
call("paged", q, kp, vp, k1, v1, cache_seqlens=sl, block_table=bt)
# two rows of a 5-row cache, left-padded
k5 = T((5, 4096, 8, 128), torch.float16); v5 = T((5, 4096, 8, 128), torch.float16)
bi = T((2,), torch.int32); lp = T((2,), torch.int32)
call("batch_idx", q, k5, v5, cache_seqlens=sl, cache_batch_idx=bi, cache_leftpad=lp)
# rotary (half-split, rotary_dim 64) on a causal speculative step, and on a folded GQA step
cos = T((4096, 32), torch.float16); sin = T((4096, 32), torch.float16)
call("rotary", q4, kc, vc, kn, vn, cos, sin, sl, causal=True, rotary_interleaved=False)
call("rotary_fold", q, kc, vc, k1, v1, cos, sin, sl)
# head dim 59 (rows of 118 bytes): paged (2 pages of 16 keys per sequence), a 3-token causal append rotated
# (rotary_dim 48, interleaved), 3 splits; then a contiguous cache with cache_batch_idx and cache_leftpad, one split
q59 = T((2, 3, 4, 59), torch.float16)
kp59 = T((5, 16, 2, 59), torch.float16); vp59 = T((5, 16, 2, 59), torch.float16)
kn59 = T((2, 3, 2, 59), torch.float16); vn59 = T((2, 3, 2, 59), torch.float16)
bt59 = T((2, 2), torch.int32); cos59 = T((32, 24), torch.float16); sin59 = T((32, 24), torch.float16)
call("ua_paged", q59, kp59, vp59, kn59, vn59, cos59, sin59, sl, block_table=bt59, causal=True, num_splits=3)
call("ua_paged_again", q59, kp59, vp59, kn59, vn59, cos59, sin59, sl, block_table=bt59, causal=True, num_splits=3)
k59 = T((4, 300, 2, 59), torch.float16); v59 = T((4, 300, 2, 59), torch.float16)
q59d = T((2, 1, 4, 59), torch.float16)
call("ua_batch_idx", q59d, k59, v59, cache_seqlens=sl, cache_batch_idx=bi, cache_leftpad=lp, num_splits=1,
     return_softmax_lse=True)
call("ua_block", q59d, k59, v59, cache_seqlens=sl, cache_batch_idx=bi, num_splits=20)
errs = {}
def err(tag, *args, **kw):
    try:
        cuflash.flash_attn_with_kvcache(*args, **kw)
        errs[tag] = "no error"
    except (TypeError, ValueError, NotImplementedError) as e:
        errs[tag] = type(e).__name__ + ": " + str(e)
err("leftpad_paged", q, kp, vp, cache_seqlens=sl, block_table=bt, cache_leftpad=lp)
err("idx_paged", q, kp, vp, cache_seqlens=sl, block_table=bt, cache_batch_idx=bi)
err("page_40", q, T((6, 40, 8, 128), torch.float16), T((6, 40, 8, 128), torch.float16), cache_seqlens=sl,
    block_table=bt)
err("bt_float", q, kp, vp, cache_seqlens=sl, block_table=T((2, 3), torch.float32))
err("bt_batch", q, kp, vp, cache_seqlens=sl, block_table=T((3, 3), torch.int32))
err("batch_no_idx", q, k5, v5, cache_seqlens=sl)
err("idx_shape", q, k5, v5, cache_seqlens=sl, cache_batch_idx=T((3,), torch.int32))
err("rotary_no_k", q, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=sl)
err("rotary_cos_only", q, kc, vc, k1, v1, rotary_cos=cos, cache_seqlens=sl)
err("rotary_dim_24", q, kc, vc, k1, v1, T((4096, 12), torch.float16), T((4096, 12), torch.float16), sl)
err("rotary_dim_big", q, kc, vc, k1, v1, T((4096, 72), torch.float16), T((4096, 72), torch.float16), sl)
err("rotary_short", q, kc, vc, k1, v1, T((4000, 32), torch.float16), T((4000, 32), torch.float16), sl)
err("rotary_dtype", q, kc, vc, k1, v1, T((4096, 32), torch.bfloat16), T((4096, 32), torch.bfloat16), sl)
err("interleaved_int", q, kc, vc, k1, v1, cos, sin, sl, rotary_interleaved=1)
err("fwd_split_paged", q, kp, vp, cache_seqlens=sl, block_table=bt, kernel="fwd_split")
for tag, kw in (("ua_warp", dict(combine="warp")), ("ua_swizzled", dict(tile=decode.decode_tile(64)))):
    try:
        decode.plan_for(q59d, kp59, vp59, cache_seqlens=sl, block_table=bt59, num_splits=4, **kw)
        errs[tag] = "no error"
    except (ValueError, NotImplementedError) as e:
        errs[tag] = type(e).__name__ + ": " + str(e)
res["errors"] = errs
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def host_path():
    return run_result_script(_HOST_SCRIPT.replace("ROOT", repr(ROOT)).replace("HO_MODULE", repr(HO)))


def test_host_path_gqa_split(host_path):
    r = host_path["gqa"]
    assert r["out_shape"] == [2, 1, 32, 128] and not r["tuple"]
    main, comb = r["launches"]
    assert main["name"].startswith("cuflash::flash_decode_kernel<__half, 128, 1, 32, 4, false, 2, ")
    p = main["p"]
    n = p["num_splits"]
    # 9-16 splits at head dim 128: the rows combine's wide form, one warp per output row (batch x KV heads x rows)
    assert _configs.COMBINE_ROWS_MAX_SPLITS < n <= _configs.combine_rows_max_splits(128)
    assert comb["name"] == "cuflash::flash_decode_combine_rows_kernel<__half, 128, 16>"
    assert comb["threads"] == 32 * _configs.COMBINE_ROWS_WARPS
    # fold: 4 rows per KV head, q rows = heads (stride 128), q heads = 4 * 128; out likewise
    assert (p["nheads"], p["seqlen_q"], p["heads_per_kv"]) == (8, 4, 1)
    assert (p["q_row_stride"], p["q_head_stride"], p["q_batch_stride"]) == (128, 512, 32 * 128)
    assert (p["o_row_stride"], p["o_head_stride"], p["o_batch_stride"]) == (128, 512, 32 * 128)
    assert (p["k_batch_stride"], p["k_row_stride"], p["k_head_stride"]) == (4096 * 8 * 128, 8 * 128, 128)
    assert p["seqlen_k"] == 4096 and p["seqlen_k_new"] == 0 and p["batch"] == 2
    assert p["scale_log2"] == float(np.float32(128 ** -0.5 * 1.4426950408889634))  # (an f32_slot)
    # 2 x 8 = 16 blocks for 264 slots (132 SMs x 2): split; grid = blocks x splits x m-blocks
    assert 1 < n <= 4096 // 64 and main["grid"] == [16 * n, 1, 1] and main["threads"] == 128
    assert p["o_accum"] and p["lse_accum"] and p["seqlens_k"] and p["lse"] == 0
    assert p["lse_accum"] - p["o_accum"] == n * 2 * 8 * 4 * 128 * 4  # one scratch buffer: o_accum then lse_accum
    assert comb["p"] == p  # the combine reads the same parameter block
    assert comb["grid"] == [-(-2 * 8 * 4 // _configs.COMBINE_ROWS_WARPS), 1, 1]
    # the split count holds keys in every split: 4096 keys = 32 block rounds of 128, ceil(32 / n) rounds per split
    assert n == -(-32 // -(-32 // n))


def test_host_path_memo_and_lse(host_path):
    assert host_path["gqa_again"]["plans"] == host_path["gqa"]["plans"]  # same key: no new plan
    r = host_path["gqa_lse"]
    assert r["tuple"] and r["launches"][0]["p"]["lse"] != 0 and r["plans"] == host_path["gqa"]["plans"]


def test_host_path_one_split_writes_directly(host_path):
    (main,) = host_path["gqa_1split"]["launches"]
    p = main["p"]
    assert p["num_splits"] == 1 and p["o_accum"] == 0 and p["lse_accum"] == 0 and main["grid"] == [16, 1, 1]


def test_host_path_speculative_append(host_path):
    app, main, comb = host_path["spec"]["launches"]
    assert app["name"] == "cuflash::kvcache_append_kernel<__half>"
    assert main["name"].startswith("cuflash::flash_decode_kernel<__half, 128, 1, 32, 4, true, 2, ")
    p = main["p"]
    # no fold with 3 query rows: heads 32, rows 3, heads_per_kv 4; 5 splits
    assert (p["nheads"], p["seqlen_q"], p["heads_per_kv"], p["num_splits"], p["seqlen_k_new"]) == (32, 3, 4, 5, 3)
    assert (p["q_row_stride"], p["q_head_stride"]) == (32 * 128, 128)
    assert main["grid"] == [2 * 32 * 5, 1, 1]
    # 5 <= COMBINE_ROWS_MAX_SPLITS splits: the rows combine, one warp per output row (2 x 32 x 3 rows)
    assert comb["name"] == "cuflash::flash_decode_combine_rows_kernel<__half, 128>" and comb["p"] == p
    assert comb["threads"] == 32 * _configs.COMBINE_ROWS_WARPS and comb["grid"] == [-(-(2 * 32 * 3) // 8), 1, 1]
    a = APPEND_ARGS.unpack(bytes.fromhex(app["raw"]))
    assert (a["k_cache"], a["v_cache"], a["seqlens"]) == (p["k"], p["v"], p["seqlens_k"]) and a["k_new"] and a["v_new"]
    assert (a["kc_bs"], a["kc_rs"], a["kc_hs"]) == (4096 * 8 * 128, 8 * 128, 128)
    assert [a[n] for n in ("batch", "seqlen_new", "nheads_k", "seqlen_cache", "headdim")] == [2, 3, 8, 4096, 128]
    assert a["block_table"] == a["cache_batch_idx"] == a["rotary_cos"] == a["rotary_dim"] == 0
    assert app["grid"] == [-(-(2 * 2 * 3 * 8 * 16) // app["threads"]), 1, 1]


def test_host_path_combine_by_split_count(host_path):
    """At most combine_rows_max_splits splits take flash_decode_combine_rows_kernel (one warp per output row: MQA at
    batch 64 has 2048 rows of 4 splits here), its wide form for 9-16 splits at head dims up to 128, more (or more
    than 8 at head dim 256) the block-per-row combine; combine="rows" forced refuses more than that."""
    main, comb = host_path["mqa_b64"]["launches"]
    n = main["p"]["num_splits"]
    assert n == 4 and main["grid"] == [64 * n, 1, 1]  # 64 x 4 = 256 blocks of the 264 slots
    assert comb["name"] == "cuflash::flash_decode_combine_rows_kernel<__half, 128>"
    assert comb["grid"] == [64 * 32 // _configs.COMBINE_ROWS_WARPS, 1, 1] and comb["threads"] == 256
    main, comb = host_path["mqa_b64_wide"]["launches"]
    assert main["p"]["num_splits"] == 9 > _configs.COMBINE_ROWS_MAX_SPLITS
    assert comb["name"] == "cuflash::flash_decode_combine_rows_kernel<__half, 128, 16>"
    assert comb["grid"] == [64 * 32 // _configs.COMBINE_ROWS_WARPS, 1, 1]
    main, comb = host_path["mqa_b64_block"]["launches"]
    assert main["p"]["num_splits"] == 17 > _configs.combine_rows_max_splits(128)
    assert comb["name"] == "cuflash::flash_decode_combine_kernel<__half, 128>" and comb["grid"] == [64 * 32, 1, 1]
    main, comb = host_path["d256_9"]["launches"]
    assert main["p"]["num_splits"] == 9 > _configs.combine_rows_max_splits(256)
    assert comb["name"] == "cuflash::flash_decode_combine_kernel<__half, 256>"
    # forced, the rows combine's wide form (up to 16 splits at head dims up to 128)
    (main, _), (comb, cgrid) = host_path["rows16"]
    assert main.startswith("cuflash::flash_decode_kernel<__half, 128, ")
    assert comb == "cuflash::flash_decode_combine_rows_kernel<__half, 128, 16>"
    assert cgrid == [64 * 32 // _configs.COMBINE_ROWS_WARPS, 1, 1]
    assert "takes at most 8 splits at head dim 256" in host_path["rows16_d256"]


def test_host_path_int_seqlens_bf16(host_path):
    main = host_path["int_seqlens"]["launches"][0]
    assert main["name"].startswith("cuflash::flash_decode_kernel<__nv_bfloat16, 64, 1, 32, 4, false, 3, ")
    p = main["p"]
    assert p["seqlens_k"] == 0 and p["seqlen_k"] == 700 and p["nheads"] == 8 and p["seqlen_q"] == 1
    assert p["num_splits"] == 1 or main["grid"][0] == 8 * p["num_splits"]


def test_host_path_validation(host_path):
    assert host_path["misaligned"] == "no error"
    # data at a 2-byte aligned address: the decode kernel's UA form (the modifiers' mask, no GQA fold, the padded
    # ring), one plan made for the call and not kept
    main = host_path["misaligned_call"]["launches"][0]
    assert main["name"].startswith("cuflash::flash_decode_kernel<__half, 128, 1, 32, 4, false, 2, ")
    assert main["name"].endswith(", 1, false, false, true>")
    assert (main["p"]["nheads"], main["p"]["heads_per_kv"], main["p"]["seqlen_q"]) == (32, 4, 1)
    assert host_path["misaligned_kept"] == 0
    assert "cache_seqlens must be int32" in host_path["bad_seqlens"]
    assert all("softmax_scale must be" in e for e in host_path["bad_scale"]), host_path["bad_scale"]


def test_host_overhead_script_runs():
    """bench's host_overhead (the CPU-only host-path timing) keeps working; one launch with one split."""
    r = subprocess.run([sys.executable, "-m", HO, "--calls", "5"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 14 and all("us/call" in x for x in lines)
    assert "launches x1" in [x for x in lines if "no split" in x][0]
    assert "launches x3" in [x for x in lines if "append" in x][0]
    fwd = [x for x in lines if x.startswith("fwd ")]  # flash_attn_func: out + lse, one launch
    assert len(fwd) == 4 and all("torch.empty x2  launches x1" in x for x in fwd)
    assert len([x for x in lines if x.startswith("hf step ")]) == 3  # the Transformers integration's decode steps
    bwd = [x for x in lines if x.startswith("bwd ")]  # dq, dk, dv + one fp32 workspace; three kernels
    assert len(bwd) == 2 and all("torch.empty x4  launches x3" in x for x in bwd)


def test_host_overhead_recycled_addresses():
    """host_overhead's --recycle: a dropped tensor's address goes to the next torch.empty of its size (as torch's
    caching allocator), never while a view of it lives, and never to another size."""
    import importlib

    ho = importlib.import_module(HO)
    torch = ho._fake_torch()
    ho.RECYCLE[0] = True
    try:
        a = torch.empty((4, 8), dtype=torch.float16)
        p = a.data_ptr()
        view = a.transpose(0, 1)
        del a
        b = torch.empty((4, 8), dtype=torch.float16)
        assert b.data_ptr() != p  # the view holds it
        del view
        assert torch.empty((4, 8), dtype=torch.float32).data_ptr() != p  # another size
        assert torch.empty((8, 4), dtype=torch.float16).data_ptr() == p
    finally:
        ho.RECYCLE[0] = False
    assert torch.empty((4, 8), dtype=torch.float16).data_ptr() not in (p, b.data_ptr())  # the default: new


def test_kvcache_signature_is_flash_attns():
    """flash_attn_with_kvcache takes flash-attn's arguments in flash-attn's order (cuflash's own options after them,
    keyword-only), so positional calls written for flash-attn mean the same here."""
    import inspect

    flash_attn_order = ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                        "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size",
                        "softcap", "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse"]
    import cuflash
    from cuflash import decode

    for fn in (cuflash.flash_attn_with_kvcache, decode.flash_attn_with_kvcache):
        params = inspect.signature(fn).parameters
        positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == flash_attn_order
        assert [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY] == ["scratch", "kernel"]


def test_host_path_paged(host_path):
    app, main = host_path["paged"]["launches"][:2]
    p, a = main["p"], APPEND_ARGS.unpack(bytes.fromhex(app["raw"]))
    assert p["block_table"] and p["block_table"] == a["block_table"]
    assert (p["page_size"], p["block_table_batch_stride"], p["seqlen_k"]) == (256, 3, 3 * 256)  # capacity 768
    assert (p["k_batch_stride"], p["k_row_stride"]) == (256 * 8 * 128, 8 * 128)  # the page stride
    assert (a["page_size"], a["bt_stride"], a["seqlen_cache"], a["kc_bs"]) == (256, 3, 768, 256 * 8 * 128)
    assert p["cache_batch_idx"] == p["leftpad_k"] == p["rotary_cos"] == 0


def test_host_path_batch_idx_and_leftpad(host_path):
    (main, *_) = host_path["batch_idx"]["launches"]
    p = main["p"]
    assert p["cache_batch_idx"] and p["leftpad_k"] and p["cache_batch_idx"] != p["leftpad_k"]
    assert p["block_table"] == 0 and p["batch"] == 2 and p["seqlen_k"] == 4096
    # a second call with the same descriptors reuses the plan; the pointers come per call
    assert host_path["batch_idx"]["plans"] > host_path["gqa"]["plans"]


def test_host_path_rotary(host_path):
    app, main = host_path["rotary"]["launches"][:2]
    p, a = main["p"], APPEND_ARGS.unpack(bytes.fromhex(app["raw"]))
    assert p["rotary_cos"] and p["rotary_sin"] and (p["rotary_cos"], p["rotary_sin"]) == (a["rotary_cos"],
                                                                                          a["rotary_sin"])
    assert (p["rotary_dim"], p["rotary_interleaved"], p["seqlen_ro"]) == (64, 0, 4096)
    assert (a["rotary_dim"], a["rotary_interleaved"], a["seqlen_ro"]) == (64, 0, 4096)
    assert p["rotary_q_per_row"] == 1  # causal: query row i at position cache_seqlens + i
    p1 = host_path["rotary_fold"]["launches"][1]["p"]
    assert p1["rotary_q_per_row"] == 0 and p1["rotary_interleaved"] == 1  # folded heads share one position


def test_host_path_ua(host_path):
    """Head dim 59: the append's and the decode kernel's UA forms with every indirection, the combines' UA forms, the
    plans kept (their key fixes the head dim) and reused."""
    app, main, comb = host_path["ua_paged"]["launches"]
    assert app["name"] == "cuflash::kvcache_append_kernel<__half, true>"
    assert app["grid"][0] == -(-2 * 2 * 3 * 2 * 8 // app["threads"])  # ceil(59 / 8) = 8 chunks a row
    a = APPEND_ARGS.unpack(bytes.fromhex(app["raw"]))
    assert (a["headdim"], a["rotary_dim"], a["page_size"]) == (59, 48, 16)
    assert main["name"].startswith("cuflash::flash_decode_kernel<__half, 64, 1, 32, 4, false, 3, ")
    assert main["name"].endswith(", 1, true, false, true>")  # MOD_SCORE, paged, padded ring, UA
    p = main["p"]
    assert (p["head_dim"], p["nheads"], p["seqlen_q"], p["num_splits"], p["rotary_q_per_row"]) == (59, 4, 3, 3, 1)
    assert p["window_right"] == 0 and p["window_left"] == 2 * 16  # causal as the band (left: the capacity)
    assert p["block_table"] == a["block_table"] and p["rotary_cos"] == a["rotary_cos"]
    assert comb["name"] == "cuflash::flash_decode_combine_rows_kernel<__half, 64, 8, true>"
    again = host_path["ua_paged_again"]
    assert [r["name"] for r in again["launches"]] == [r["name"] for r in host_path["ua_paged"]["launches"]]
    assert again["plans"] == host_path["ua_paged"]["plans"]
    (main,) = host_path["ua_batch_idx"]["launches"]
    assert main["name"].endswith(", 1, false, false, true>") and host_path["ua_batch_idx"]["tuple"]
    assert main["p"]["cache_batch_idx"] and main["p"]["leftpad_k"] and main["p"]["o_accum"] == 0
    assert host_path["ua_block"]["launches"][1]["name"] == "cuflash::flash_decode_combine_kernel<__half, 64, true>"


@pytest.mark.parametrize("tag,kind,words", [
    ("ua_warp", "NotImplementedError", "combine='warp'"),
    ("ua_swizzled", "ValueError", "padded ring"),
    ("leftpad_paged", "ValueError", "cache_leftpad with a block_table"),
    ("idx_paged", "ValueError", "cache_batch_idx with a block_table"),
    ("page_40", "ValueError", "multiple of 16"),
    ("bt_float", "TypeError", "block_table must be int32"),
    ("bt_batch", "ValueError", "block_table must have shape"),
    ("batch_no_idx", "ValueError", "cache_batch_idx"),
    ("idx_shape", "ValueError", "cache_batch_idx must be"),
    ("rotary_no_k", "ValueError", "pass k and v"),
    ("rotary_cos_only", "ValueError", "rotary_cos and rotary_sin"),
    ("rotary_dim_24", "ValueError", "multiple of 16"),
    ("rotary_dim_big", "ValueError", "at most the head dim"),
    ("rotary_short", "ValueError", "4096 positions"),
    ("rotary_dtype", "TypeError", "rotary_cos must have the dtype of q"),
    ("interleaved_int", "TypeError", "rotary_interleaved must be a bool"),
    ("fwd_split_paged", "NotImplementedError", "block_table runs on kernel='decode'"),
])
def test_host_path_cache_option_errors(host_path, tag, kind, words):
    e = host_path["errors"][tag]
    assert e.startswith(kind + ":") and words in e, e


def test_page_multiple_matches_the_kernel():
    """The host's page-size rule (PAGE_MULTIPLE) is the decode kernel's look-up chunk (cuda_src/flash_decode.cu)."""
    from cuflash._loader import source_dir
    from cuflash._validate import PAGE_MULTIPLE

    src = (source_dir() / "flash_decode.cu").read_text()
    m = re.search(r"constexpr int CHUNK = (\d+);", src)
    assert m and int(m.group(1)) == PAGE_MULTIPLE


# ------------------------------------------------------------------ the split count and the decode combine
def test_without_empty_splits():
    """The trimmed count keeps the longest split (ceil(rounds / n) rounds, attn/block.cuh: split_range) and
    leaves no split empty; it never adds splits."""
    for rounds in range(1, 300):
        for n in range(1, 129):
            m = without_empty_splits(n, rounds)
            per = -(-rounds // n)
            assert 1 <= m <= n and -(-rounds // m) <= per
            if rounds > 1 and n > 1:
                assert (m - 1) * -(-rounds // m) < rounds  # the last split holds a key
    assert without_empty_splits(1, 1000) == 1 and without_empty_splits(50, 1) == 1


def test_decode_split_count_mqa_batch1():
    """MQA at batch 1 (one block of 32 folded rows) on 132 SMs x 1 resident block, head dim 128 (128 keys per
    block round). The wave-efficiency rule alone takes 122 splits at 16k keys (128 rounds: 2 per split, 58 splits
    empty), trimmed 64 splits of 2 rounds; the chain rule (the default) 128 splits of one round. At 4k keys (32
    rounds) the efficiency rule takes 31 splits, trimmed 16 of 2 rounds; the chain rule 32 of one. 1k keys: 8
    rounds, 8 splits under every rule."""
    assert decode_num_splits(1, 132, 16384, 128, rule="waves_untrimmed") == 122
    assert decode_num_splits(1, 132, 16384, 128, rule="waves") == 64
    assert decode_num_splits(1, 132, 16384, 128) == 128
    assert decode_num_splits(1, 132, 4096, 128, rule="waves") == 16
    assert decode_num_splits(1, 132, 4096, 128) == 32
    for rule in SPLIT_RULES:
        assert decode_num_splits(1, 132, 1024, 128, rule=rule) == 8
    assert decode_num_splits(1, 132, 131072, 128, rule="waves") == 114  # 1024 rounds: 9 per split
    assert decode_num_splits(1, 132, 131072, 128) == 128  # 8 per split
    assert decode_num_splits(8, 132, 4096, 128) == 16  # GQA 32 / 8 at batch 1: 32 rounds, 2 per split, one wave
    with pytest.raises(ValueError, match="split_rule must be one of"):
        decode_num_splits(1, 132, 4096, 128, rule="fewest")
    from cuflash.decode import plan_for

    with pytest.raises(ValueError, match="split_rule must be one of"):  # before the arrays are looked at
        plan_for(None, None, None, num_splits=4, split_rule="fewest")


def _chain(blocks, slots, rounds, n):
    return -(-(n * blocks) // slots) * -(-rounds // n)


def test_shortest_chain_splits():
    """Exhaustively against its definition on small grids: the count is the fewest whose chain (waves x rounds per
    split) is within CHAIN_SLACK of the shortest over 1..min(128, rounds); no split is empty; a grid that (nearly)
    fills the slots is not split."""
    for slots in (132, 264):
        for blocks in (1, 2, 3, 8, 16, 32, 64, 100):
            for rounds in (1, 2, 3, 7, 8, 31, 32, 33, 100, 128, 256, 1000, 1024):
                n = shortest_chain_splits(blocks, slots, rounds)
                top = min(128, rounds)
                best = min(_chain(blocks, slots, rounds, k) for k in range(1, top + 1))
                if blocks >= 0.8 * slots:
                    assert n == 1
                    continue
                assert 1 <= n <= top
                assert _chain(blocks, slots, rounds, n) <= best * (1 + CHAIN_SLACK)
                assert all(_chain(blocks, slots, rounds, k) > best * (1 + CHAIN_SLACK) for k in range(1, n))
                assert (n - 1) * -(-rounds // n) < rounds  # the last split holds a key
    assert shortest_chain_splits(110, 132, 1000) == 1
    # 32 KV heads at batch 1 (32 blocks on 132 slots), 128k keys at 128 per round: 4 splits (one wave of 128
    # blocks, 256 rounds each), not 41 (10 waves of 25 rounds, 2.3% shorter: within the slack)
    assert shortest_chain_splits(32, 132, 1024) == 4


def test_decode_combine_matches_the_host():
    """flash_decode_combine_kernel's split limit and split groups are the host's (MAX_SPLITS, the launch's
    threads), and every head dim's combine is among the configurations the package compiles."""
    from cuflash._loader import source_dir
    from cuflash.decode import MAX_SPLITS

    src = (source_dir() / "flash_decode.cu").read_text()
    assert int(re.search(r"constexpr int DECODE_MAX_SPLITS = (\d+);", src).group(1)) == MAX_SPLITS
    assert int(re.search(r"constexpr int COMBINE_SPLIT_GROUPS = (\d+);", src).group(1)) == \
        _configs.COMBINE_SPLIT_GROUPS
    for name in ("COMBINE_ROWS_MAX_SPLITS", "COMBINE_ROWS_WARPS"):
        assert int(re.search(rf"constexpr int {name} = (\d+);", src).group(1)) == getattr(_configs, name)
    specs = _configs.all_specs()
    for dt in _configs.DTYPES:
        for d in _configs.HEADDIMS:
            s = _configs.decode_combine_spec(dt, d)
            assert s in specs and s.threads == _configs.COMBINE_SPLIT_GROUPS * d // 4 and s.threads % 32 == 0
            assert s.threads <= 1024
            r = _configs.decode_combine_rows_spec(dt, d)
            assert r in specs and r.threads == 32 * _configs.COMBINE_ROWS_WARPS
            wide = _configs.decode_combine_rows_spec(dt, d, _configs.combine_rows_max_splits(d))
            assert wide in specs and wide.threads == r.threads
            assert (wide == r) == (d > _configs.COMBINE_ROWS_WIDE_MAX_HEADDIM)
            assert _configs.decode_combine_rows_spec(dt, d, 2) == r  # (the form of 8 up to 8 splits)
            with pytest.raises(ValueError, match="at most"):
                _configs.decode_combine_rows_spec(dt, d, _configs.combine_rows_max_splits(d) + 1)
    assert [_configs.combine_rows_max_splits(d) for d in (32, 64, 96, 128, 256)] == [16, 16, 16, 16, 8]


def test_decode_probe_table():
    """bench/diag/decode_probe.py's last table from a record (the script itself needs a GPU)."""
    from bench.diag.decode_probe import table

    rec = dict(batch=1, heads=32, heads_k=1, seqlen_k=16384, kv_mb=8.0, floor_us=2.0, splits_new=64, splits_old=122,
               us={"old(122)": 28.6, "new(64)": 9.0, "n32": 10.0, "n128": None, "cudnn": 10.2, "flash": 20.0})
    t = table([rec]).splitlines()
    assert len(t) == 3 and t[0].count("|") == t[2].count("|") == 13
    assert "| 28.6 (122) | 9.0 (64) | 10.0 (32) | 0.36 | 1.13 | 1.13 |" in t[2]


def test_decode_small_probe_table_and_cases():
    """bench/diag/decode_small_probe.py: its table from records (cuDNN's time over each plan's; paged cases over the
    contiguous cache's), its --case parsing, and the tiles it times are tiles the decode kernel compiles (the script
    itself needs a GPU)."""
    from bench.diag import decode_small_probe as p

    recs = [dict(batch=1, heads=32, heads_k=1, seqlen_k=4096, page=0, kv_bytes=2 << 20,
                 us={"def": 8.0, "waves": 9.0, "static": None, "cudnn": 7.6}, splits={"def": 32, "waves": 16}),
            dict(batch=1, heads=32, heads_k=8, seqlen_k=8192, page=16, kv_bytes=32 << 20,
                 us={"contig": 10.0, "def": 12.5}, splits={"contig": 16, "def": 16})]
    t = p.table(recs).splitlines()
    assert t[0] == "hk1 b1 4k (2 MB): def(32)=8.00 [0.95]  waves(16)=9.00 [0.84]  cudnn=7.60"
    assert t[1] == "hk8 b1 8k page 16 (32 MB): contig(16)=10.00 [1.00]  def(16)=12.50 [0.80]"
    for t in p.tiles().values():
        spec = _configs.decode_spec("float16", 128, False, 2, t)
        assert spec.smem <= 227 * 1024 and t.swizzle
    assert all(32 % hk == 0 for hk, _, _ in p.CASES) and all(ps % 16 == 0 for *_, ps in p.PAGES)


def test_decode_auto_mf_and_tile():
    """The plan's automatic geometry on an H200 (132 SMs, 228 KB of shared memory per SM), head dim 128, fp16: one
    row fragment per block for 32 folded rows (MQA) where every split of that plan reads at most MF1_MAX_ROUNDS block
    rounds of keys, else two; the wide tile (two blocks per SM) for paged caches and for grids of more blocks than
    one wave of the configured tile, its deeper ring for a contiguous cache of at most DEEP_MAX_ROUNDS block rounds
    in more than one wave of that ring's two blocks per SM."""
    from cuflash.decode import DEEP_MAX_ROUNDS, MF1_MAX_ROUNDS, decode_auto_mf, decode_auto_tile

    sms, smem = 132, 233472

    def mf(groups, seqlen_k, num_splits=0, rows=32, mf0=2, d=128):
        return decode_auto_mf("float16", d, False, 0, False, groups, rows, mf0, seqlen_k, num_splits, None, "chain",
                              sms, smem)

    assert MF1_MAX_ROUNDS == 8
    assert mf(1, 1024) == mf(1, 4096) == mf(1, 16384) == mf(1, 32768) == 1  # batch 1: 1, 1, 2, 4 rounds per split
    assert mf(1, 131072) == 2  # 64 splits of 16 rounds
    assert mf(8, 1024) == mf(8, 4096) == 1 and mf(8, 16384) == 2  # 16 m-blocks: 8 splits of 1, 4, 16 rounds
    assert mf(64, 1024) == 1 and mf(64, 2048) == 2  # 128 m-blocks, one split: 8 / 16 rounds
    assert mf(1, 4096, num_splits=1) == 2 and mf(1, 4096, num_splits=4) == 1  # an explicit count: 32 / 8 rounds
    assert mf(1, 1024, rows=16, mf0=1) == 1
    wide, base, deep = _configs.DECODE_WIDE_TILES[128], _configs.decode_tile(128), _configs.DECODE_DEEP_TILES[128]

    def tile(blocks, paged=False, d=128, mf=1, seqlen_k=4096):
        return decode_auto_tile("float16", d, False, 0, paged, blocks, mf, sms, smem, seqlen_k)

    assert DEEP_MAX_ROUNDS == 8 and deep.stages == wide.stages + 1
    assert tile(256) == tile(133) == tile(1, paged=True) == tile(512, mf=2) == wide
    assert tile(132) == tile(8) == tile(8, seqlen_k=1024) == base
    assert tile(1024, d=64) == _configs.decode_tile(64) and tile(8, paged=True, d=256) == _configs.decode_tile(256)
    # 1k keys (8 rounds of 128) in more than 264 blocks (two per SM of the deep tile): the deep ring
    assert tile(2048, seqlen_k=1024) == tile(512, seqlen_k=1000) == tile(265, mf=2, seqlen_k=1024) == deep
    # one wave of it, longer blocks, or paged: the 2-stage wide tile
    assert tile(264, seqlen_k=1024) == tile(2048, seqlen_k=1025) == tile(2048, paged=True, seqlen_k=1024) == wide
    # an A100 (108 SMs, 164 KB): the deep ring holds one block per SM there, so never it
    assert decode_auto_tile("float16", 128, False, 0, False, 2048, 1, 108, 167936, 1024) == wide


def test_decode_wide_tiles_fit():
    """Each wide tile holds at least two blocks per SM on sm_90 (by shared memory) where its head dim's configured tile
    holds one, keeps 64 KB of K / V in flight per SM, and compiles in every mode (decode_family lists it)."""
    for d, t in _configs.DECODE_WIDE_TILES.items():
        assert t.swizzle and t.block_n % 16 == 0 and t.stages >= 2
        for mf in range(1, _configs.DECODE_MAX_MF[d] + 1):
            spec = _configs.decode_spec("float16", d, False, mf, t)
            base = _configs.decode_spec("float16", d, False, mf)
            assert resident_blocks(base.smem, base.threads, 0, smem_per_sm=SM90_SMEM_PER_SM) == 1
            resident = resident_blocks(spec.smem, spec.threads, 0, smem_per_sm=SM90_SMEM_PER_SM)
            assert resident >= 2
            assert 2 * t.nwarps * (t.stages - 1) * 2 * t.block_n * d * 2 >= 64 * 1024
            assert spec in _configs.decode_family("float16", d, False, 0)
    for d, t in _configs.DECODE_DEEP_TILES.items():  # contiguous only, still two blocks per SM
        wide = _configs.DECODE_WIDE_TILES[d]
        assert t.swizzle and (t.block_n, t.nwarps) == (wide.block_n, wide.nwarps) and t.stages > wide.stages
        for mf in range(1, _configs.DECODE_MAX_MF[d] + 1):
            for dt, causal, mod in (("float16", False, 0), ("bfloat16", True, 0), ("float16", False, 1)):
                spec = _configs.decode_spec(dt, d, causal, mf, t, mod)
                assert resident_blocks(spec.smem, spec.threads, 0, smem_per_sm=SM90_SMEM_PER_SM) == 2
                family = _configs.decode_family(dt, d, causal, mod)
                assert spec in family and _configs.decode_spec(dt, d, causal, mf, t, mod, paged=True) not in family
