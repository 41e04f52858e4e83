"""GPU: flash_attn_qkvpacked_func / flash_attn_kvpacked_func against the float64 reference (error rule of
conftest.py), both forward backends, and the gradients flowing back into the packed tensor (CPU checks of the
launches: tests/test_packed_cpu.py)."""
import pytest

import cuflash
from cuflash import reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp

pytestmark = pytest.mark.gpu


def _grads_lowp(q, k, v, dout, scale, causal):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_attention_lowp(qq, kk, vv, scale, causal).backward(dout)
    return qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("backend", ["sm80", "auto"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked(backend, d, causal):
    import torch

    qkv = torch.randn(2, 333, 3, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = cuflash.flash_attn_qkvpacked_func(qkv, causal=causal, backend=backend)
    q, k, v = (qkv.detach()[:, :, i] for i in range(3))
    scale = d ** -0.5
    ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), scale, causal)
    assert_close_to_ref("out", out, torch_attention_lowp(q, k, v, scale, causal), ref)
    dout = torch.randn_like(out)
    out.backward(dout)
    rq, rk, rv = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), scale, causal)
    lq, lk, lv = _grads_lowp(q, k, v, dout, scale, causal)
    g = qkv.grad
    assert g.shape == qkv.shape
    for i, (name, lp, r) in enumerate((("dq", lq, rq), ("dk", lk, rk), ("dv", lv, rv))):
        assert_close_to_ref(name, g[:, :, i], lp, r, factor=3.0)


@pytest.mark.parametrize("backend", ["sm80", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_kvpacked_gqa(backend, causal):
    import torch

    q = torch.randn(2, 257, 8, 128, device="cuda", dtype=torch.float16)
    kv = torch.randn(2, 513, 2, 2, 128, device="cuda", dtype=torch.float16)
    out, lse, _ = cuflash.flash_attn_kvpacked_func(q, kv, causal=causal, backend=backend, return_attn_probs=True)
    k, v = kv[:, :, 0], kv[:, :, 1]
    ref, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, causal)
    assert_close_to_ref("out", out, torch_attention_lowp(q, k, v, 128 ** -0.5, causal), ref)
    assert abs(to_np(lse) - ref_lse).max() < 2e-4
