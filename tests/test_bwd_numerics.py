"""GPU: the backward's large-logit tail and the forward's output residual that closes it.

With large logits (inputs x3, softmax_scale 0.3) a row's softmax is nearly one-hot and dS = P (dP - D) of its
dominant key is a difference of two nearly equal numbers, so D = rowsum(dO * O) must be formed from the fp32
output: from the rounded out it carries out's rounding error times dO (bench/NOTES.md, "Backward numerics").
The forward writes that rounding error (`return_residual`, saved by autograd) and the preprocess adds it back.

* the residual: |res| <= half an ulp of out and out + res rounds back to out (it is the kernel's own fp32 output
  less out), on both backends, ragged, GQA, packed;
* the tail, over 256 independent (batch, head) problems of one query row against 1999 keys, per backend: a
  problem fails the error rule when its dq or dk error exceeds 3x torch's own low-precision error (+ the floor);
  cuflash (autograd: the residual) fails no more problems than SDPA's FlashAttention-2 kernel on the same
  problems and its worst ratio is no larger, and the residual fails no more problems than D from out alone;
* autograd equals the explicit call with the residual bitwise (deterministic).
"""
import numpy as np
import pytest

import cuflash
from cuflash import _fwd_sm90
from conftest import ERR_FLOOR, torch_attention_lowp

pytestmark = pytest.mark.gpu

BACKENDS = ("sm80", "sm90")


def _backend_or_skip(backend):
    if backend == "sm90" and _fwd_sm90.device_cc(0) != 90:
        pytest.skip("the sm90 kernels need a compute capability 9.0 GPU")


def _ulp_half(x):
    """Half an ulp of each element of x (fp16 / bf16), as float32."""
    import torch

    bits = 10 if x.dtype == torch.float16 else 7
    emin = -14 if x.dtype == torch.float16 else -126  # below it the spacing is the subnormals'
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** emin))).clamp_min(emin)
    return torch.exp2(e - bits - 1)


def _assert_rounding_error(out, res):
    """res is what rounding the fp32 output to out lost: at most half an ulp of out (the residual itself rounded:
    one more ulp of it), and out + res rounds back to out except at an exact tie (|res| half an ulp)."""
    import torch

    half = _ulp_half(out)
    r = res.float().abs()
    assert (r <= half * (1 + 2.0 ** -8)).all()
    back = (out.float() + res.float()).to(out.dtype)
    assert bool(((back == out) | (r == half)).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(2, 133, 257, 4, 2, 64), (1, 77, 77, 6, 1, 128), (3, 1, 500, 8, 8, 96)])
def test_residual_is_the_rounding_error_of_out(backend, dtype, shape):
    import torch

    _backend_or_skip(backend)
    b, sq, sk, h, hk, d = shape
    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda").to(dt)
    k = torch.randn(b, sk, hk, d, device="cuda").to(dt)
    v = torch.randn(b, sk, hk, d, device="cuda").to(dt)
    out, res = cuflash.flash_attn_func(q, k, v, causal=True, backend=backend, return_residual=True)
    plain = cuflash.flash_attn_func(q, k, v, causal=True, backend=backend)
    assert torch.equal(out, plain)
    assert res.shape == out.shape and res.dtype == out.dtype and res.stride() == out.stride()
    assert not torch.isnan(res).any()
    _assert_rounding_error(out, res)
    assert (res != 0).float().mean() > 0.5  # a real residual, not zeros


def test_residual_packed_and_errors():
    import torch

    lens = (0, 130, 1, 257)
    total = sum(lens)
    cu = torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, 4, 64, device="cuda").half() for _ in range(3))
    out, lse, _, res = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                      return_attn_probs=True, return_residual=True)
    assert res.shape == out.shape
    _assert_rounding_error(out, res)
    dout = torch.randn_like(out)
    a = cuflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, max(lens), max(lens), causal=True,
                                           deterministic=True, out_residual=res)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o2 = cuflash.flash_attn_varlen_func(qg, kg, vg, cu, cu, max(lens), max(lens), causal=True, deterministic=True)
    o2.backward(dout)
    for x, y in zip(a, (qg.grad, kg.grad, vg.grad)):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="out_residual"):
        cuflash.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, max(lens), max(lens), out_residual=res[1:])
    with pytest.raises(ValueError, match="return_residual"):
        cuflash.flash_attn_func(qg[None], kg[None], vg[None], return_residual=True)


def _tail_problems(dtype, d, seed):
    """256 problems of one query row against 1999 keys: (q, k, v, dout) as [2, 1, 128, d], inputs x3."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    shape_q, shape_k = (2, 1, 128, d), (2, 1999, 128, d)
    q = (torch.randn(shape_q, device="cuda", generator=g) * 3).to(dt)
    k = (torch.randn(shape_k, device="cuda", generator=g) * 3).to(dt)
    v = torch.randn(shape_k, device="cuda", generator=g).to(dt)
    dout = torch.randn(shape_q, device="cuda", generator=g).to(dt)
    return q, k, v, dout


def _ref_grads(q, k, v, dout, scale):
    """float64 (dq, dk) as [b, s, h, d]."""
    import torch

    qh, kh, vh, gh = (x.double().transpose(1, 2) for x in (q, k, v, dout))
    p = torch.softmax(qh @ kh.transpose(-1, -2) * scale, dim=-1)
    dp = gh @ vh.transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return (ds @ kh * scale).transpose(1, 2), (ds.transpose(-1, -2) @ qh * scale).transpose(1, 2)


def _per_problem_err(x, ref):
    """max |x - ref| per (batch, head): [b, h]."""
    return (x.double() - ref).abs().amax(dim=(1, 3))


def _fails_and_worst(grads, ref, lowp):
    """(problems failing the 3x rule, worst ratio of error to torch's) over dq and dk."""
    import torch

    fails, worst = torch.zeros_like(lowp[0][:, 0, :, 0], dtype=torch.bool), 0.0
    for ours, r, lp in zip(grads, ref, lowp):
        e, et = _per_problem_err(ours, r), _per_problem_err(lp, r)
        fails |= e > 3 * et + ERR_FLOOR
        worst = max(worst, float((e / et.clamp_min(ERR_FLOOR)).max()))
    return int(fails.sum()), worst


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,d", [("float16", 64), ("float16", 128), ("bfloat16", 64)])
def test_large_logit_tail_at_or_below_flash_attention_2(backend, dtype, d):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _backend_or_skip(backend)
    scale = 0.3
    q, k, v, dout = _tail_problems(dtype, d, seed=20261201 + d)
    ref = _ref_grads(q, k, v, dout, scale)
    qq, kk = (x.detach().clone().requires_grad_() for x in (q, k))
    torch_attention_lowp(qq, kk, v, scale, False).backward(dout)
    lowp = (qq.grad, kk.grad)
    # cuflash under autograd (the forward saves out's residual), deterministic so that the explicit call matches
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    cuflash.flash_attn_func(qg, kg, vg, softmax_scale=scale, deterministic=True, backend=backend).backward(dout)
    ours = (qg.grad, kg.grad)
    out, lse, _, res = cuflash.flash_attn_func(q, k, v, softmax_scale=scale, backend=backend, return_attn_probs=True,
                                               return_residual=True)
    with_res = cuflash.flash_attn_backward(dout, q, k, v, out, lse, scale, deterministic=True, out_residual=res,
                                           backend=backend)
    assert torch.equal(with_res[0], qg.grad) and torch.equal(with_res[1], kg.grad)
    without = cuflash.flash_attn_backward(dout, q, k, v, out, lse, scale, deterministic=True, backend=backend)
    # SDPA's FlashAttention-2 kernel on the same problems
    qf, kf, vf = (x.transpose(1, 2).clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, scale=scale).backward(dout.transpose(1, 2))
    fa2 = (qf.grad.transpose(1, 2), kf.grad.transpose(1, 2))
    f_ours, w_ours = _fails_and_worst(ours, ref, lowp)
    f_wo, w_wo = _fails_and_worst(without[:2], ref, lowp)
    f_fa2, w_fa2 = _fails_and_worst(fa2, ref, lowp)
    summary = (f"{backend} {dtype} d{d}: failing problems / worst ratio: cuflash {f_ours} / {w_ours:.1f}, D from "
               f"out alone {f_wo} / {w_wo:.1f}, FlashAttention-2 {f_fa2} / {w_fa2:.1f} (of 256)")
    print(summary)
    assert f_ours <= f_fa2 and w_ours <= w_fa2, summary
    assert f_ours <= f_wo, summary
