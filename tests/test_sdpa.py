"""GPU: cuflash.scaled_dot_product_attention in torch's layout against the float64 reference (error rule of
conftest.py) and torch's own SDPA, GQA, gradients (CPU checks of the launch: tests/test_sdpa_cpu.py)."""
import pytest

import cuflash
from cuflash import reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hk", [8, 2])
def test_sdpa_layout(causal, hk):
    import torch

    q = torch.randn(2, 8, 777, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, hk, 777, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, hk, 777, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = cuflash.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hk != 8)
    assert out.shape == q.shape
    qs, ks, vs = (x.detach().transpose(1, 2) for x in (q, k, v))
    ref, _ = reference.attention_forward(to_np(qs), to_np(ks), to_np(vs), None, causal)
    assert_close_to_ref("out", out.transpose(1, 2), torch_attention_lowp(qs, ks, vs, 128 ** -0.5, causal), ref)
    dout = torch.randn_like(out)
    out.backward(dout)
    rq, rk, rv = reference.attention_backward(to_np(dout.transpose(1, 2)), to_np(qs), to_np(ks), to_np(vs), None,
                                              causal)
    qq, kk, vv = (x.clone().requires_grad_() for x in (qs, ks, vs))
    torch_attention_lowp(qq, kk, vv, 128 ** -0.5, causal).backward(dout.transpose(1, 2))
    for name, ours, lp, r in (("dq", q.grad, qq.grad, rq), ("dk", k.grad, kk.grad, rk), ("dv", v.grad, vv.grad, rv)):
        assert_close_to_ref(name, ours.transpose(1, 2), lp, r, factor=3.0)
