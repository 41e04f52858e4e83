"""GPU: Flash-Decoding (flash_attn_with_kvcache) against the float64 reference: every split count from
1 to past the number of KV tiles, ragged cache_seqlens (0 included), GQA/MQA, append-then-attend, causal
with seqlen_q > 1, torch and CuPy, and CUDA-graph capture + replay after cache_seqlens changed.

Every test runs the dedicated decode kernel (kernel="decode", the default; cuda_src/flash_decode.cu);
the prefill kernel cut into splits (kernel="fwd_split") runs in a smaller parametrization."""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.decode import num_splits_heuristic
from conftest import assert_close_to_ref, to_np, torch_attention_lowp

pytestmark = pytest.mark.gpu


def make_cache(b, s_cache, hk, d, dtype):
    import torch

    dt = getattr(torch, dtype)
    return (torch.randn(b, s_cache, hk, d, device="cuda").to(dt), torch.randn(b, s_cache, hk, d, device="cuda").to(dt))


def check(out, lse, q, kc, vc, seqlens, causal):
    """Reference per batch element on its own valid keys; torch low-precision on the same slices."""
    import torch

    qn, kn, vn = to_np(q), to_np(kc), to_np(vc)
    b, sq, h, d = q.shape
    ref_o = np.zeros(qn.shape)
    ref_lse = np.zeros((b, h, sq))
    lowp = torch.zeros_like(q)
    for i in range(b):
        n = int(seqlens[i])
        ro, rl = reference.attention_forward(qn[i:i + 1], kn[i:i + 1, :n], vn[i:i + 1, :n], None, causal)
        ref_o[i], ref_lse[i] = ro[0], rl[0]
        if n:
            lowp[i:i + 1] = torch_attention_lowp(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], d ** -0.5, causal)
    assert_close_to_ref("decode out", out, lowp, ref_o)
    got = to_np(lse)
    assert np.array_equal(np.isneginf(got), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.allclose(got[fin], ref_lse[fin], atol=2e-4)


def append_case(d, s_new, b=3, s_cache=700, h=8, hk=2):
    """A cache of lengths (10, 0, 600), s_new new keys per batch element and as many queries (fp16), and the caches
    as the append must leave them: (q, k_cache, v_cache, k_new, v_new, cache_seqlens, expected k, expected v)."""
    import torch

    kc, vc = make_cache(b, s_cache, hk, d, "float16")
    seqlens = torch.tensor([10, 0, 600][:b], dtype=torch.int32, device="cuda")
    kn = torch.randn(b, s_new, hk, d, device="cuda", dtype=torch.float16)
    vn = torch.randn(b, s_new, hk, d, device="cuda", dtype=torch.float16)
    q = torch.randn(b, s_new, h, d, device="cuda", dtype=torch.float16)
    expect_k, expect_v = kc.clone(), vc.clone()
    for i, n in enumerate(seqlens.tolist()):
        expect_k[i, n:n + s_new], expect_v[i, n:n + s_new] = kn[i], vn[i]
    return q, kc, vc, kn, vn, seqlens, expect_k, expect_v


SPLITS_BY_KERNEL = [("decode", n) for n in (1, 2, 3, 7, 16, 40, 128)] + [("fwd_split", n) for n in (1, 3, 128)]


@pytest.mark.parametrize("kernel,num_splits", SPLITS_BY_KERNEL)
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2), (8, 1)])
def test_every_split_count(kernel, num_splits, h, hk):
    import torch

    # decode kernel: 63 warp tiles of 16 keys, 16 rounds of 4 warps; fwd_split: 16 KV tiles of 64.
    # Split counts up to 8x past the rounds / tiles (empty splits).
    b, s_cache, d = 3, 1000, 128
    kc, vc = make_cache(b, s_cache, hk, d, "float16")
    seqlens = torch.tensor([1000, 0, 517], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=num_splits,
                                               return_softmax_lse=True, kernel=kernel)
    check(out, lse, q, kc, vc, seqlens.tolist(), False)
    assert (to_np(out)[1] == 0).all()  # empty cache -> zeros, LSE -inf (checked above), no NaN


@pytest.mark.parametrize("kernel", ["decode", "fwd_split"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_head_dims_and_auto_splits(kernel, dtype, d):
    import torch

    b, s_cache, h, hk = 2, 3001, 8, 2
    kc, vc = make_cache(b, s_cache, hk, d, dtype)
    seqlens = torch.tensor([3001, 1234], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda").to(getattr(torch, dtype))
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True,
                                               kernel=kernel)
    check(out, lse, q, kc, vc, seqlens.tolist(), False)


@pytest.mark.parametrize("kernel", ["decode", "fwd_split"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_append_then_attend_speculative(causal, num_splits, kernel):
    """k, v of 4 new tokens appended at cache_seqlens, then 4 queries attend (causal: bottom-right)."""
    import torch

    q, kc, vc, kn, vn, seqlens, expect_k, expect_v = append_case(64, 4)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=causal,
                                               num_splits=num_splits, return_softmax_lse=True, kernel=kernel)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
    check(out, lse, q, kc, vc, [n + 4 for n in seqlens.tolist()], causal)


def test_cupy_decode():
    import cupy

    b, s_cache, h, hk, d = 2, 900, 4, 1, 128
    q = cupy.random.standard_normal((b, 1, h, d)).astype(cupy.float16)
    kc = cupy.random.standard_normal((b, s_cache, hk, d)).astype(cupy.float16)
    vc = cupy.random.standard_normal((b, s_cache, hk, d)).astype(cupy.float16)
    seqlens = cupy.array([900, 77], dtype=cupy.int32)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=4,
                                               return_softmax_lse=True)
    assert isinstance(out, cupy.ndarray)
    import torch

    check(out, lse, torch.from_dlpack(q), torch.from_dlpack(kc), torch.from_dlpack(vc), [900, 77], False)


def test_int_cache_seqlens_and_full_cache():
    import torch

    kc, vc = make_cache(2, 333, 2, 64, "bfloat16")
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=200, return_softmax_lse=True)
    check(out, lse, q, kc, vc, [200, 200], False)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True)
    check(out, lse, q, kc, vc, [333, 333], False)


@pytest.mark.parametrize("kernel,hk,num_splits", [("decode", 8, 0), ("fwd_split", 8, 0), ("decode", 1, 0),
                                                   ("decode", 1, 128), ("decode", 1, 7)])
def test_cuda_graph_capture_and_replay_after_seqlens_change(kernel, hk, num_splits):
    """GQA 32/8 and MQA 32/1 (32 folded rows: the combine's widest rows), the heuristic split count, the most
    splits and a few; lengths change between replays (1 key after the append: most splits empty)."""
    import torch

    b, s_cache, h, d = 4, 4096, 32, 128
    kc, vc = make_cache(b, s_cache, hk, d, "float16")
    seqlens = torch.tensor([4096, 100, 2000, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    kn = torch.randn(b, 1, hk, d, device="cuda", dtype=torch.float16)
    vn = torch.randn(b, 1, hk, d, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    kw = dict(kernel=kernel, num_splits=num_splits)
    with torch.cuda.stream(s):  # warm-up (compilation) outside the capture
        cuflash.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=seqlens.clone(), **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = cuflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, **kw)
    for new in ([10, 4000, 0, 3000], [4095, 1, 2048, 17]):
        seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q)); kn.copy_(torch.randn_like(kn)); vn.copy_(torch.randn_like(vn))
        g.replay()
        torch.cuda.synchronize()
        for i, n in enumerate(new):
            assert torch.equal(kc[i, n], kn[i, 0]) and torch.equal(vc[i, n], vn[i, 0])
        lse_dummy = torch.zeros(b, h, 1)
        qn, kcn, vcn = to_np(q), to_np(kc), to_np(vc)
        for i, n in enumerate(new):
            ro, _ = reference.attention_forward(qn[i:i + 1], kcn[i:i + 1, :n + 1], vcn[i:i + 1, :n + 1], None, False)
            lp = torch_attention_lowp(q[i:i + 1], kc[i:i + 1, :n + 1], vc[i:i + 1, :n + 1], d ** -0.5, False)
            assert_close_to_ref("replay", out[i:i + 1], lp, ro)
        del lse_dummy


# ------------------------------------------------------------------ the decode combine
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 9, 16, 64, 127, 128])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_combines_every_split_count(num_splits, d):
    """flash_decode_combine_rows_kernel (combine "rows", the default up to combine_rows_max_splits splits: its wide
    form for 9-16 at head dims up to 128),
    flash_decode_combine_kernel ("block", the default above) and flash_combine_kernel ("warp") on the same case:
    MQA 32/1 (32 folded rows; two m-blocks at head dim 256), lengths (full, 0, 130: most splits see no key), the
    fp32 partials poisoned with NaN before each launch (an empty split's o is never written and must never be read),
    against the float64 reference."""
    import torch

    from cuflash.decode import combine_rows_max_splits, plan_for, run_plan

    b, s_cache, h, hk = 3, 4100, 32, 1
    kc, vc = make_cache(b, s_cache, hk, d, "float16")
    seqlens = torch.tensor([4100, 0, 130], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    outs = {}
    for combine in (("rows",) if num_splits <= combine_rows_max_splits(d) else ()) + ("block", "warp"):
        plan = plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=num_splits, combine=combine)
        assert plan.num_splits == num_splits
        scratch = (torch.full((num_splits, b, hk, h, d), float("nan"), device="cuda"),
                   torch.full((num_splits, b, hk, h), float("nan"), device="cuda"))
        out, lse = run_plan(plan, q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True,
                            scratch=scratch if num_splits > 1 else None)
        check(out, lse, q, kc, vc, seqlens.tolist(), False)
        assert (to_np(out)[1] == 0).all()
        outs[combine] = out.float()
    assert (outs["block"] - outs["warp"]).abs().max().item() < 2e-3
    if "rows" in outs:
        assert (outs["rows"] - outs["block"]).abs().max().item() < 2e-3


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rows_combine_tails_and_empty_splits(d, dtype):
    """The rows combine (one warp per output row, COMBINE_ROWS_WARPS rows per block) where the output rows are no
    multiple of a block's (GQA 12/4 at batch 5: 5 x 4 x 3 = 60 rows), with every split count up to its limit,
    ragged lengths (0, 1, a few keys: splits of no key) and the partials poisoned with NaN, against the float64
    reference; the default combine of these split counts is the rows one, its wide form for 9-16 splits at head dims
    up to 128."""
    import torch

    from cuflash._configs import COMBINE_ROWS_MAX_SPLITS
    from cuflash.decode import combine_rows_max_splits, plan_for, run_plan

    b, s_cache, h, hk = 5, 2000, 12, 4
    kc, vc = make_cache(b, s_cache, hk, d, dtype)
    lens = [2000, 0, 1, 37, 1500]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=getattr(torch, dtype))
    assert (b * h) % 8 and (b * h) % 32
    for n in range(2, combine_rows_max_splits(d) + 1):
        plan = plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=n,
                        combine="auto" if n <= COMBINE_ROWS_MAX_SPLITS else "rows")
        assert plan.num_splits == n
        scratch = (torch.full((n, b, hk, h // hk, d), float("nan"), device="cuda"),
                   torch.full((n, b, hk, h // hk), float("nan"), device="cuda"))
        out, lse = run_plan(plan, q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True, scratch=scratch)
        check(out, lse, q, kc, vc, lens, False)
        assert (to_np(out)[1] == 0).all()
    with pytest.raises(ValueError, match="combine='rows' takes at most"):
        plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=combine_rows_max_splits(d) + 1, combine="rows")


def test_decode_validation():
    import torch

    kc, vc = make_cache(2, 64, 2, 64, "float16")
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, 2], device="cuda"))
    with pytest.raises(ValueError, match="cache_seqlens must be a contiguous int32 array of shape"):
        cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, 2, 3], device="cuda",
                                                                              dtype=torch.int32))
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        cuflash.flash_attn_with_kvcache(q, kc, vc, kc[:, :1], vc[:, :1])
    with pytest.raises(ValueError, match="k must have shape"):
        cuflash.flash_attn_with_kvcache(q, kc, vc, kc[:, :1, :1], vc[:, :1, :1],
                                        cache_seqlens=torch.zeros(2, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="num_splits"):
        cuflash.flash_attn_with_kvcache(q, kc, vc, num_splits=-1)


# ------------------------------------------------------------------ the decode kernel's own geometry
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("h,hk", [(32, 1), (64, 1), (40, 2)])
def test_many_folded_rows(h, hk, d, num_splits):
    """GQA groups of 20-64 heads: 32-row blocks (mf 2), several m-blocks, and head dim 256 (mf 1 only)."""
    import torch

    b, s_cache = 2, 700
    kc, vc = make_cache(b, s_cache, hk, d, "float16")
    seqlens = torch.tensor([700, 33], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=num_splits,
                                               return_softmax_lse=True)
    check(out, lse, q, kc, vc, seqlens.tolist(), False)


@pytest.mark.parametrize("num_splits", [0, 1, 4, 64])
@pytest.mark.parametrize("sq,d", [(20, 128), (17, 256), (32, 64), (16, 32), (5, 96)])
def test_causal_rows_without_keys(sq, d, num_splits):
    """Bottom-right causal with 5-32 query rows (mf 1 and 2, several m-blocks at d 256) and caches shorter
    than seqlen_q: the first rows see no key (zeros, LSE -inf, no NaN)."""
    import torch

    b, s_cache, h, hk = 4, 300, 4, 2
    kc, vc = make_cache(b, s_cache, hk, d, "bfloat16")
    seqlens = torch.tensor([300, sq - 3, 0, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, num_splits=num_splits,
                                               return_softmax_lse=True)
    check(out, lse, q, kc, vc, seqlens.tolist(), True)
    assert np.isneginf(to_np(lse)[1, :, :3]).all()


def test_strided_views():
    """q a view into a packed qkv, the caches head-major ([b, hk, s, d] transposed): pure strides."""
    import torch

    b, s_cache, h, hk, d = 2, 900, 8, 2, 64
    qkv = torch.randn(b, 1, h + 2 * hk, d, device="cuda", dtype=torch.float16)
    q = qkv[:, :, :h]
    kc = torch.randn(b, hk, s_cache, d, device="cuda", dtype=torch.float16).transpose(1, 2)
    vc = torch.randn(b, hk, s_cache, d, device="cuda", dtype=torch.float16).transpose(1, 2)
    seqlens = torch.tensor([900, 450], dtype=torch.int32, device="cuda")
    for ns in (0, 1):
        out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=ns,
                                                   return_softmax_lse=True)
        check(out, lse, q, kc, vc, seqlens.tolist(), False)


def test_64bit_offsets_decode():
    """The second batch element of the cache starts past 2^31 elements: K/V offsets must be 64-bit."""
    import torch

    s_cache, hk, d, h = 1024, 8, 128, 32
    pad = 2 ** 31 + 8 * 1024
    big_k = torch.empty(pad + s_cache * hk * d, device="cuda", dtype=torch.float16)
    big_v = torch.empty_like(big_k)
    kc = big_k.as_strided((2, s_cache, hk, d), (pad, hk * d, d, 1))
    vc = big_v.as_strided((2, s_cache, hk, d), (pad, hk * d, d, 1))
    for x in (kc, vc):
        x.copy_(torch.randn(2, s_cache, hk, d, device="cuda", dtype=torch.float16))
    seqlens = torch.tensor([1024, 1000], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, h, d, device="cuda", dtype=torch.float16)
    for ns in (0, 1):
        out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=ns,
                                                   return_softmax_lse=True)
        check(out, lse, q, kc.contiguous(), vc.contiguous(), seqlens.tolist(), False)
    del big_k, big_v
    torch.cuda.empty_cache()


def test_plan_reuse_scratch_and_alignment():
    """The memoized plan serves a second call with new data; preallocated scratch is used; a misaligned
    view on a known shape takes the validating path (the V2 UA kernel)."""
    import torch

    from cuflash.decode import plan_for

    b, s_cache, h, hk, d = 2, 2048, 16, 4, 128
    kc, vc = make_cache(b, s_cache, hk, d, "float16")
    seqlens = torch.tensor([2048, 999], dtype=torch.int32, device="cuda")
    for _ in range(2):
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
        out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=6,
                                                   return_softmax_lse=True)
        check(out, lse, q, kc, vc, seqlens.tolist(), False)
    plan = plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=6)
    rows = h // hk
    scratch = (torch.full((6, b, hk, rows, d), float("nan"), device="cuda"),
               torch.full((6, b, hk, rows), float("nan"), device="cuda"))
    assert plan.num_splits == 6
    out2 = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=6, scratch=scratch)
    assert torch.equal(out2, out)
    assert not torch.isnan(scratch[1]).any()  # every split wrote its LSE (-inf when empty)
    flat = torch.randn(b * h * d + 1, device="cuda", dtype=torch.float16)
    q_bad = flat[1:].view(b, 1, h, d)  # 2-byte offset: the V2 UA kernel, one split
    out_bad = cuflash.flash_attn_with_kvcache(q_bad, kc, vc, cache_seqlens=seqlens, num_splits=6)
    out_good = cuflash.flash_attn_with_kvcache(q_bad.clone(), kc, vc, cache_seqlens=seqlens, num_splits=6)
    assert (out_bad.float() - out_good.float()).abs().max().item() < 2e-3
    out_auto = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    out_old = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, kernel="fwd_split")
    assert (out_auto.float() - out_old.float()).abs().max().item() < 2e-3
