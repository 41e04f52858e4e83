"""GPU: torch.compile through cuflash. Every entry point (flash_attn_func with the score options and dropout, the
packed functions, the varlen functions, scaled_dot_product_attention, flash_attn_with_kvcache) traces as one custom-operator node with
no graph break (torch._dynamo.explain), compiled results equal the eager ones (forward, gradients with
deterministic=True, dropout under one torch.manual_seed, the cache append), and torch.library.opcheck passes on
each operator (schema, fake implementation, autograd registration, AOT dispatch with dynamic shapes)."""
import pytest

import cuflash
from conftest import torch_inputs

pytestmark = pytest.mark.gpu


def graph_breaks(fn, *args):
    import torch

    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


def attention(q, k, v):
    return cuflash.flash_attn_func(q, k, v, causal=True, window_size=(100, -1), softcap=30.0, deterministic=True)


@pytest.mark.parametrize("what", ["func", "dropout", "packed", "sdpa", "kvcache", "varlen", "varlen_tensor_max"])
def test_no_graph_breaks(what):
    import torch

    q, k, v = torch_inputs((2, 256, 4, 64), (2, 256, 2, 64), "bfloat16")
    if what == "func":
        assert graph_breaks(lambda q, k, v: attention(q, k, v) * 2, q, k, v) == 0
    elif what == "dropout":
        assert graph_breaks(lambda q, k, v: cuflash.flash_attn_func(q, k, v, 0.1) + 1, q, k, v) == 0
    elif what == "packed":
        qkv = torch.randn(2, 256, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
        assert graph_breaks(lambda x: cuflash.flash_attn_qkvpacked_func(x, causal=True).sum(), qkv) == 0
    elif what.startswith("varlen"):
        cu = torch.tensor([0, 100, 100, 512], dtype=torch.int32, device="cuda")
        mx = torch.tensor(412, dtype=torch.int32, device="cuda") if what.endswith("max") else 412
        qp, kp, vp = (x.reshape(512, *x.shape[2:]) for x in (q, k, v))
        assert graph_breaks(lambda q, k, v, cu: cuflash.flash_attn_varlen_func(
            q, k, v, cu, cu, mx, mx, causal=True, softcap=5.0).float().sum(), qp, kp, vp, cu) == 0
    elif what == "sdpa":
        qt = q.transpose(1, 2).contiguous()
        assert graph_breaks(lambda a: cuflash.scaled_dot_product_attention(a, a, a, is_causal=True), qt) == 0
    else:
        kc, vc = torch.randn(2, 512, 2, 64, device="cuda", dtype=torch.bfloat16), torch.randn(
            2, 512, 2, 64, device="cuda", dtype=torch.bfloat16)
        sl = torch.tensor([100, 300], dtype=torch.int32, device="cuda")
        assert graph_breaks(lambda q, kc, vc, kn, vn, sl: cuflash.flash_attn_with_kvcache(
            q, kc, vc, kn, vn, cache_seqlens=sl), q[:, :1], kc, vc, k[:, :1], v[:, :1], sl) == 0


def test_compiled_forward_and_backward_equal_eager():
    """fullgraph=True around attention and the ops next to it: the same out and (deterministic) gradients."""
    import torch

    q, k, v = torch_inputs((2, 333, 4, 64), (2, 333, 2, 64), "bfloat16", requires_grad=True)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16)

    def block(q, k, v):
        return attention(q * 0.5, k, v) @ w

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    results = []
    for fn in (block, compiled):
        for x in (q, k, v):
            x.grad = None
        out = fn(q, k, v)
        out.backward(dout)
        results.append([out.detach().clone()] + [x.grad.clone() for x in (q, k, v)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * float(a.abs().max()), msg=name)
    # the attention alone: bitwise
    torch._dynamo.reset()
    qd, kd, vd = (x.detach() for x in (q, k, v))
    assert torch.equal(torch.compile(attention, fullgraph=True)(qd, kd, vd), attention(qd, kd, vd))


def test_compiled_dropout_replays_torch_generator():
    """Dropout inside the compiled graph draws from torch's generator at run time, as the eager call does: under one
    torch.manual_seed the compiled and eager outputs are equal, and two compiled calls in a row differ."""
    import torch

    q, k, v = torch_inputs((2, 200, 4, 64), (2, 200, 2, 64), "float16")
    fn = lambda q, k, v: cuflash.flash_attn_func(q, k, v, 0.3, causal=True)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    torch.manual_seed(5)
    eager = fn(q, k, v)
    torch.manual_seed(5)
    c1 = compiled(q, k, v)
    c2 = compiled(q, k, v)
    assert torch.equal(eager, c1) and not torch.equal(c1, c2)


def test_compiled_kvcache_append():
    import torch

    q = torch.randn(2, 3, 8, 64, device="cuda", dtype=torch.float16)
    kc, vc = (torch.randn(2, 400, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    kn, vn = (torch.randn(2, 3, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    sl = torch.tensor([10, 200], dtype=torch.int32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    fn = lambda q, kc, vc, kn, vn, sl: cuflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=sl,  # noqa
                                                                       causal=True)
    eager = fn(q, kc, vc, kn, vn, sl)
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True)(q, kc2, vc2, kn, vn, sl)
    assert torch.equal(out, eager) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    # the cache indirections: a paged cache with a rotary append, rows picked by index with left padding
    kp, vp = (torch.randn(60, 16, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    bt = torch.randperm(60, device="cuda")[:50].reshape(2, 25).to(torch.int32)
    cos, sin = torch.rand(400, 16, device="cuda").half(), torch.rand(400, 16, device="cuda").half()
    kp2, vp2 = kp.clone(), vp.clone()
    fn = lambda q, kc, vc, kn, vn, sl: cuflash.flash_attn_with_kvcache(  # noqa: E731
        q, kc, vc, kn, vn, cos, sin, sl, block_table=bt, causal=True, rotary_interleaved=False)
    eager = fn(q, kp, vp, kn, vn, sl)
    torch._dynamo.reset()
    assert graph_breaks(fn, q, kp2, vp2, kn, vn, sl) == 0
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True)(q, kp2, vp2, kn, vn, sl)
    assert torch.equal(out, eager) and torch.equal(kp2, kp) and torch.equal(vp2, vp)


def test_opcheck():
    import torch

    q, k, v = torch_inputs((2, 96, 4, 64), (2, 96, 2, 64), "float16", requires_grad=True)
    fwd_args = (q, k, v, 0.0, 0.125, True, -1, -1, 0.0, None, "auto", "auto", True, None, "auto")
    torch.library.opcheck(torch.ops.cuflash.flash_attn_fwd.default, fwd_args)
    out, lse, rng = torch.ops.cuflash.flash_attn_fwd(*(x.detach() if isinstance(x, torch.Tensor) else x
                                                       for x in fwd_args))
    dout = torch.randn_like(out)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out, lse, rng, 0.0, 0.125, True, -1, -1, 0.0, None, True,
                None, "auto", "auto")
    torch.library.opcheck(torch.ops.cuflash.flash_attn_bwd.default, bwd_args)
    kc, vc = (torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    kn, vn = (torch.randn(2, 2, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    sl = torch.tensor([10, 200], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.cuflash.flash_attn_with_kvcache.default,
                          (q[:, :2].detach(), kc, vc, kn, vn, sl, -1, 0.125, True, 1, -1, -1, 0.0, None, None, None,
                           None, None, None, True))
    # paged, rotary: pages of 16, rotary_dim 32
    kp, vp = (torch.randn(40, 16, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    bt = torch.randperm(40, device="cuda")[:38].reshape(2, 19).to(torch.int32)
    cos, sin = torch.rand(304, 16, device="cuda").half(), torch.rand(304, 16, device="cuda").half()
    torch.library.opcheck(torch.ops.cuflash.flash_attn_with_kvcache.default,
                          (q[:, :2].detach(), kp, vp, kn, vn, sl, -1, 0.125, True, 1, -1, -1, 0.0, None, cos, sin,
                           None, None, bt, False))


def test_compiled_varlen_equals_eager():
    """flash_attn_varlen_func under torch.compile(fullgraph=True): the same out and (deterministic) gradients."""
    import torch

    lens = (100, 0, 257, 1)
    cu = torch.tensor([0, 100, 100, 357, 358], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(358, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (4, 2, 2))
    dout = torch.randn(358, 4, 64, device="cuda", dtype=torch.bfloat16)

    def fn(q, k, v, cu):
        return cuflash.flash_attn_varlen_func(q * 0.5, k, v, cu, cu, max(lens), max(lens), causal=True,
                                              window_size=(64, -1), deterministic=True)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (fn, compiled):
        for x in (q, k, v):
            x.grad = None
        out = f(q, k, v, cu)
        out.backward(dout)
        results.append([out.detach().clone()] + [x.grad.clone() for x in (q, k, v)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * float(a.abs().max()) + 1e-3, msg=name)


def test_opcheck_varlen():
    import torch

    cu = torch.tensor([0, 50, 50, 170], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(170, n, 64, device="cuda", dtype=torch.float16, requires_grad=True) for n in (4, 2, 2))
    fwd_args = (q, k, v, cu, cu, 120, 120, 0.0, 0.125, True, -1, -1, 0.0, None, "auto", True, None)
    torch.library.opcheck(torch.ops.cuflash.flash_attn_varlen_fwd.default, fwd_args)
    out, lse, rng = torch.ops.cuflash.flash_attn_varlen_fwd(*(x.detach() if isinstance(x, torch.Tensor) else x
                                                              for x in fwd_args))
    dout = torch.randn_like(out)
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out, lse, cu, cu, 120, 120, rng, 0.0, 0.125, True, -1, -1,
                0.0, None, True, None)
    torch.library.opcheck(torch.ops.cuflash.flash_attn_varlen_bwd.default, bwd_args)


def test_compiled_paged_varlen():
    """flash_attn_varlen_func with a block_table under torch.compile(fullgraph=True): the gather and the packed
    forward as two nodes, no graph break, the eager result."""
    import torch

    from test_varlen import cu_of, paged_of

    lens = (100, 0, 257, 1)
    cu = cu_of(lens)
    q = torch.randn(358, 4, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(358, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    kp, vp, bt = paged_of(k, v, lens, 32)
    fn = lambda q, kp, vp, bt: cuflash.flash_attn_varlen_func(q, kp, vp, cu, cu, 257, 257, causal=True,  # noqa
                                                              block_table=bt)
    eager = fn(q, kp, vp, bt)
    assert graph_breaks(fn, q, kp, vp, bt) == 0
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True)(q, kp, vp, bt), eager)
    torch.library.opcheck(torch.ops.cuflash.paged_kv_gather.default, (q, kp, vp, bt, cu))
