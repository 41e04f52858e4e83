"""GPU: the FlashAttention-1 kernels (cuda_src/flash_v1.cu through cuflash/v1.py) against the float64
reference with the error rule of conftest.py: forward (out, LSE, and the m, l statistics), both warp
partitions, backward from m, l and from the LSE, fp16 and bf16, every V1 head dim, causal and not, ragged
and unequal lengths, GQA/MQA; agreement with V2; the public torch and CuPy APIs (algorithm="v1")."""
import numpy as np
import pytest

import cuflash
from cuflash import reference, v1
from cuflash._validate import check_qkv
from conftest import assert_close_to_ref, max_err, to_np, torch_attention_lowp, torch_inputs

pytestmark = pytest.mark.gpu

LSE_ATOL = 2e-4  # as test_flash_fwd.py: fp32 statistics, ex2.approx
M_ATOL = 2e-4  # m: row max of the fp32 scores (natural units), exact up to the fp32 Q K^T
L_RTOL = 1e-3  # l: fp32 sum of ex2.approx terms
SPLITS = ("k", "q")


def grads_lowp(q, k, v, dout, scale, causal):
    """torch's own attention backward in the inputs' dtype (the yardstick)."""
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_attention_lowp(qq, kk, vv, scale, causal).backward(dout)
    return qq.grad, kk.grad, vv.grad


def check_stats(lse, m, l, q, k, v, scale, causal):
    """lse, m, l [b, h, sq] against the float64 FlashAttention-1 reference (m: max of the scaled scores)."""
    _, ref_lse, ref_m, ref_l = reference.flash_v1_forward(to_np(q), to_np(k), to_np(v), scale, causal,
                                                          block_m=128, block_n=128)
    got_lse, got_m, got_l = to_np(lse), to_np(m), to_np(l)
    for name, x in (("lse", got_lse), ("m", got_m), ("l", got_l)):
        assert not np.isnan(x).any(), f"{name}: NaN"
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), empty), "rows with no key: LSE must be -inf"
    assert np.array_equal(np.isneginf(got_m), empty) and np.all(got_l[empty] == 0), "rows with no key: m = -inf, l = 0"
    fin = ~empty
    assert np.allclose(got_lse[fin], ref_lse[fin], atol=LSE_ATOL, rtol=0), np.abs(got_lse[fin] - ref_lse[fin]).max()
    assert np.allclose(got_m[fin], ref_m[fin], atol=M_ATOL, rtol=0), np.abs(got_m[fin] - ref_m[fin]).max()
    assert np.allclose(got_l[fin], ref_l[fin], rtol=L_RTOL, atol=0), np.abs(got_l[fin] / ref_l[fin] - 1).max()


def run_forward(b, sq, sk, h, hk, d, dtype, causal, warp_split="k", scale=None):
    """v1.forward on fresh torch inputs; checks out, lse, m, l. Returns (q, k, v, out, lse, m, l)."""
    import torch

    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype)
    softmax_scale = scale if scale is not None else d ** -0.5
    out, lse, m, l = v1.forward(*check_qkv(q, k, v), scale, causal, warp_split)
    assert out.shape == q.shape and out.dtype == q.dtype
    for x in (lse, m, l):
        assert x.shape == (b, h, sq) and x.dtype == torch.float32
    ref_o, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), softmax_scale, causal)
    assert_close_to_ref(f"out (v1, split-{warp_split})", out, torch_attention_lowp(q, k, v, softmax_scale, causal),
                        ref_o)
    check_stats(lse, m, l, q, k, v, softmax_scale, causal)
    return q, k, v, out, lse, m, l


def check_grads(name, grads, q, k, v, dout, scale, causal):
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), scale, causal)
    lowp = grads_lowp(q, k, v, dout, scale, causal)
    for gname, ours, lp, r in zip(("dq", "dk", "dv"), grads, lowp, ref):
        assert tuple(ours.shape) == tuple(lp.shape) and str(ours.dtype).split(".")[-1] == str(lp.dtype).split(".")[-1]
        assert_close_to_ref(f"{gname} ({name})", ours, lp, r)


SHAPES = [(1, 1), (17, 17), (300, 300), (1000, 1000), (17, 300), (300, 17), (1000, 300), (1, 1000)]


@pytest.mark.parametrize("warp_split", SPLITS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", v1.HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_forward_matches_reference(warp_split, dtype, d, causal, sq, sk):
    run_forward(1, sq, sk, 2, 2, d, dtype, causal, warp_split)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", v1.HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 300), (300, 17), (257, 257), (1000, 700), (700, 1000)])
def test_backward_matches_reference(dtype, d, causal, sq, sk):
    """Through torch autograd: cuflash.flash_attn_func(..., algorithm="v1").backward()."""
    import torch

    q, k, v = torch_inputs((2, sq, 2, d), (2, sk, 2, d), dtype, requires_grad=True)
    out = cuflash.flash_attn_func(q, k, v, causal=causal, algorithm="v1")
    dout = torch.randn_like(out)
    out.backward(dout)
    check_grads("v1 autograd", (q.grad, k.grad, v.grad), q, k, v, dout, d ** -0.5, causal)


@pytest.mark.parametrize("warp_split", SPLITS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16")])
def test_backward_from_m_l_and_from_lse(warp_split, causal, d, dtype):
    """v1.backward with the forward's m, l and v1.backward_from_lse (m = LSE, l = 1) give the same P."""
    import torch

    q, k, v, out, lse, m, l = run_forward(2, 333, 555, 4, 2, d, dtype, causal, warp_split)
    dout = torch.randn_like(out)
    qa, ka, va = check_qkv(q, k, v)
    da, oa = (cuflash._interop.wrap(x, n) for x, n in ((dout, "dout"), (out, "out")))
    g_ml = v1.backward(da, qa, ka, va, oa, m, l, None, causal)
    check_grads("v1 from m, l", g_ml, q, k, v, dout, d ** -0.5, causal)
    g_lse = v1.backward_from_lse(da, qa, ka, va, oa, cuflash._interop.wrap(lse, "lse"), None, causal)
    check_grads("v1 from lse", g_lse, q, k, v, dout, d ** -0.5, causal)


@pytest.mark.parametrize("h,hk", [(8, 2), (6, 1)])
@pytest.mark.parametrize("sq,sk", [(1, 700), (4, 700), (257, 129), (129, 257)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(h, hk, sq, sk, causal):
    import torch

    for d, dtype in ((128, "float16"), (64, "bfloat16")):
        for split in SPLITS:
            run_forward(2, sq, sk, h, hk, d, dtype, causal, split)
        q, k, v = torch_inputs((2, sq, h, d), (2, sk, hk, d), dtype, requires_grad=True)
        out = cuflash.flash_attn_func(q, k, v, causal=causal, algorithm="v1")
        dout = torch.randn_like(out)
        out.backward(dout)
        check_grads(f"v1 gqa {h}/{hk}", (q.grad, k.grad, v.grad), q, k, v, dout, d ** -0.5, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16")])
def test_v1_agrees_with_v2(causal, d, dtype):
    """V1 (both partitions) and V2 compute the same attention: their outputs differ by at most the error
    rule's bound, LSEs by fp32 rounding; the gradients likewise."""
    import torch

    from cuflash import backward as bwd_mod
    from cuflash import flash

    q, k, v = torch_inputs((2, 1000, 4, d), (2, 777, 2, d), dtype)
    qa, ka, va = check_qkv(q, k, v)
    o2, lse2 = flash.forward(qa, ka, va, None, causal)
    ref_o, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), d ** -0.5, causal)
    bound = 2 * max_err(torch_attention_lowp(q, k, v, d ** -0.5, causal), ref_o) + 1e-5
    fin = np.isfinite(to_np(lse2))
    for split in SPLITS:
        o1, lse1, _, _ = v1.forward(qa, ka, va, None, causal, split)
        assert float(np.abs(to_np(o1) - to_np(o2)).max()) <= bound, split
        assert np.array_equal(np.isneginf(to_np(lse1)), np.isneginf(to_np(lse2)))
        assert np.allclose(to_np(lse1)[fin], to_np(lse2)[fin], atol=LSE_ATOL, rtol=0)
    dout = torch.randn_like(o2)
    da = cuflash._interop.wrap(dout, "dout")
    g2 = bwd_mod.backward(da, qa, ka, va, cuflash._interop.wrap(o2, "out"), cuflash._interop.wrap(lse2, "lse"),
                          None, causal)
    g1 = v1.backward_from_lse(da, qa, ka, va, cuflash._interop.wrap(o2, "out"), cuflash._interop.wrap(lse2, "lse"),
                              None, causal)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), d ** -0.5, causal)
    lowp = grads_lowp(q, k, v, dout, d ** -0.5, causal)
    for name, a, b_, lp, r in zip(("dq", "dk", "dv"), g1, g2, lowp, ref):
        gbound = 2 * max_err(lp, r) + 1e-5
        assert float(np.abs(to_np(a) - to_np(b_)).max()) <= 2 * gbound, name


@pytest.mark.parametrize("warp_split", SPLITS)
def test_causal_rows_without_keys(warp_split):
    """Causal with sq > sk: rows 0..199 see no key -> out 0, LSE -inf, m -inf, l 0, zero dq; no NaN."""
    import torch

    q, k, v, out, lse, m, l = run_forward(2, 300, 100, 2, 2, 64, "float16", True, warp_split)
    assert (to_np(out)[:, :200] == 0).all() and np.isneginf(to_np(lse)[:, :, :200]).all()
    dout = torch.randn_like(out)
    qa, ka, va = check_qkv(q, k, v)
    dq, dk, dv = v1.backward(cuflash._interop.wrap(dout, "dout"), qa, ka, va, cuflash._interop.wrap(out, "out"), m, l,
                             None, True)
    assert (to_np(dq)[:, :200] == 0).all()
    check_grads("v1 empty rows", (dq, dk, dv), q, k, v, dout, 64 ** -0.5, True)


def test_public_api_forward_and_no_grad():
    import torch

    q, k, v = torch_inputs((2, 513, 4, 128), (2, 769, 2, 128), "float16")
    with torch.no_grad():
        out, lse, none = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, algorithm="v1")
    assert none is None and out.shape == q.shape and lse.shape == (2, 4, 513)
    ref, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True)
    assert_close_to_ref("out (public v1)", out, torch_attention_lowp(q, k, v, 128 ** -0.5, True), ref)
    assert np.allclose(to_np(lse), ref_lse, atol=LSE_ATOL)


def test_strided_inputs_no_copy():
    """q/k/v as views into one packed qkv tensor: strided rows and heads, forward and backward."""
    import torch

    qkv = torch.randn(2, 333, 3, 4, 64, device="cuda", dtype=torch.float16)
    for split in SPLITS:
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = v1.forward(*check_qkv(q, k, v), None, True, split)[0]
        ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True)
        assert_close_to_ref(f"out (strided, split-{split})", out, torch_attention_lowp(q, k, v, 0.125, True), ref)
    qkv.requires_grad_()
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = cuflash.flash_attn_func(q, k, v, causal=True, algorithm="v1")
    dout = torch.randn_like(out)
    out.backward(dout)
    g = qkv.grad
    check_grads("v1 strided", (g[:, :, 0], g[:, :, 1], g[:, :, 2]), q.detach(), k.detach(), v.detach(), dout, 0.125,
                True)


def test_cupy_api():
    import cupy
    import torch

    b, sq, sk, h, hk, d = 2, 211, 333, 4, 2, 64
    q = cupy.random.standard_normal((b, sq, h, d)).astype(cupy.float16)
    k = cupy.random.standard_normal((b, sk, hk, d)).astype(cupy.float16)
    v = cupy.random.standard_normal((b, sk, hk, d)).astype(cupy.float16)
    dout = cupy.random.standard_normal((b, sq, h, d)).astype(cupy.float16)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, algorithm="v1")
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, algorithm="v1")
    assert all(isinstance(x, cupy.ndarray) for x in (dq, dk, dv))
    tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, dout))
    ref_o, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True)
    assert_close_to_ref("out (cupy v1)", out, torch_attention_lowp(tq, tk, tv, d ** -0.5, True), ref_o)
    check_grads("v1 cupy", (dq, dk, dv), tq, tk, tv, tdo, d ** -0.5, True)


def test_backward_is_deterministic():
    """One block per (KV head, batch) owns its dQ rows: no atomics, bitwise reproducible."""
    import torch

    q, k, v = torch_inputs((2, 700, 4, 128), (2, 900, 2, 128), "bfloat16", requires_grad=True)
    dout = torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        cuflash.flash_attn_func(q, k, v, causal=True, algorithm="v1").backward(dout)
        grads.append([x.grad.clone() for x in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_explicit_scale_and_large_values():
    run_forward(1, 200, 300, 2, 1, 128, "bfloat16", False, "k", scale=0.3)
    run_forward(1, 200, 300, 2, 1, 128, "bfloat16", True, "q", scale=0.3)


def test_unsupported_head_dim():
    q, k, v = torch_inputs((1, 16, 2, 256), (1, 16, 2, 256), "float16")
    with pytest.raises(ValueError, match="head dims"):
        v1.forward(*check_qkv(q, k, v), None, False)


def test_64bit_offsets():
    """q, out, dout hold more than 2^31 elements (and o_accum / dq_accum more than 2^31 floats): offsets must
    be 64-bit. Checked on the last batch elements, forward (both partitions) and backward."""
    import torch

    b, sq, h, sk, d = 16400, 128, 8, 16, 128  # q: 16400*128*8*128 = 2.15e9 elements (4.3 GB fp16)
    q = torch.randn((b, sq, h, d), device="cuda", dtype=torch.float16)
    k = torch.randn((b, sk, 1, d), device="cuda", dtype=torch.float16)
    v = torch.randn((b, sk, 1, d), device="cuda", dtype=torch.float16)
    tail = slice(b - 3, b)
    ref, _ = reference.attention_forward(to_np(q[tail]), to_np(k[tail]), to_np(v[tail]), None, False)
    lowp = torch_attention_lowp(q[tail], k[tail], v[tail], d ** -0.5, False)
    qa, ka, va = check_qkv(q, k, v)
    for split in ("q", "k"):  # keep the split-K result for the backward
        out, _, m, l = v1.forward(qa, ka, va, None, False, split)
        assert_close_to_ref(f"out[last batches] (split-{split})", out[tail], lowp, ref)
    torch.cuda.empty_cache()
    dout = torch.randn_like(q)
    dq, dk, dv = v1.backward(cuflash._interop.wrap(dout, "dout"), qa, ka, va, cuflash._interop.wrap(out, "out"), m, l,
                             None, False)
    check_grads("v1 64-bit", (dq[tail], dk[tail], dv[tail]), q[tail], k[tail], v[tail], dout[tail], d ** -0.5, False)
