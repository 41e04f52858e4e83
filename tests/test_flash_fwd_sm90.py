"""GPU: what the Hopper forward adds to the forward tests of test_flash_fwd.py (which run every case on both
backends): the automatic choice and its fallbacks, the memoized tensor maps under changing pointers, the caller's
stream, CUDA-graph capture and replay, autograd through it, and long KV loops that wrap the stage ring many times.
Skipped off compute capability 9.0."""
import numpy as np
import pytest

import cuflash
from cuflash import _fwd, _fwd_sm90, reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if _fwd_sm90.device_cc(0) != 90:
        pytest.skip("the sm90 kernels need a compute capability 9.0 GPU")


def _check(out, q, k, v, causal, scale=None):
    d = q.shape[-1]
    ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), scale, causal)
    assert_close_to_ref("out", out, torch_attention_lowp(q, k, v, scale or d ** -0.5, causal), ref)


def test_auto_is_sm90_and_bitwise_the_forced_path():
    q, k, v = torch_inputs((2, 777, 4, 128), (2, 901, 2, 128), "float16")
    _fwd._PLANS.clear()
    a = cuflash.flash_attn_func(q, k, v, causal=True)
    assert any(isinstance(p, _fwd_sm90.Sm90Plan) for p in _fwd._PLANS.values())
    b = cuflash.flash_attn_func(q, k, v, causal=True, backend="sm90")
    c = cuflash.flash_attn_func(q, k, v, causal=True, backend="sm80")
    assert (a == b).all()
    _check(a, q, k, v, True)
    _check(c, q, k, v, True)


def test_fallbacks_to_sm80():
    """Inputs the sm90 kernels cannot take run on the sm80 kernels under "auto", read in place; forced, they are
    a ValueError before any launch."""
    import torch

    q, _, _ = torch_inputs((2, 300, 8, 64), (2, 300, 8, 64), "bfloat16")
    k1 = torch.randn(2, 400, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = k1.expand(2, 400, 8, 64), torch.randn_like(k1).expand(2, 400, 8, 64)  # head stride 0
    _check(cuflash.flash_attn_func(q, k, v), q, k, v, False)
    with pytest.raises(ValueError, match="strides"):
        cuflash.flash_attn_func(q, k, v, backend="sm90")
    q32, k32, v32 = torch_inputs((1, 100, 2, 32), (1, 100, 2, 32), "float16")
    _check(cuflash.flash_attn_func(q32, k32, v32), q32, k32, v32, False)
    with pytest.raises(ValueError, match="head dim 32"):
        cuflash.flash_attn_func(q32, k32, v32, backend="sm90")


def test_changing_pointers_reencode_the_maps():
    """More distinct (q, k, v) pointer triples than a plan keeps sets of maps for, in one memoized shape, twice over,
    then triples mixing the tensors of different calls (each map from the plan's single-map memo): every call reads
    its own inputs."""
    ins = [torch_inputs((1, 200, 2, 64), (1, 333, 2, 64), "float16") for _ in range(_fwd_sm90.MAX_MAP_SETS + 3)]
    for _ in range(2):
        for q, k, v in ins:
            _check(cuflash.flash_attn_func(q, k, v, causal=True, backend="sm90"), q, k, v, True)
    for a, b, c in ((0, 1, 2), (5, 0, 9), (len(ins) - 1, 3, 0)):
        q, k, v = ins[a][0], ins[b][1], ins[c][2]
        _check(cuflash.flash_attn_func(q, k, v, causal=True, backend="sm90"), q, k, v, True)


def test_callers_stream():
    import torch

    q, k, v = torch_inputs((4, 1024, 8, 128), (4, 1024, 8, 128), "float16")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = cuflash.flash_attn_func(q, k, v, backend="sm90")
        ev = torch.cuda.Event()
        ev.record()
    ev.synchronize()
    _check(out, q, k, v, False)


def test_cuda_graph_capture_and_replay():
    import torch

    q, k, v = torch_inputs((2, 513, 4, 128), (2, 700, 4, 128), "bfloat16")
    static = [x.clone() for x in (q, k, v)]
    cuflash.flash_attn_func(*static, causal=True, backend="sm90")  # compile and memoize outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuflash.flash_attn_func(*static, causal=True, backend="sm90")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cuflash.flash_attn_func(*static, causal=True, backend="sm90")
    for _ in range(2):
        new = torch_inputs((2, 513, 4, 128), (2, 700, 4, 128), "bfloat16")
        for dst, src in zip(static, new):
            dst.copy_(src)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(out, *new, True)


def test_autograd_through_the_sm90_forward():
    """The backward (sm80 kernels) from the sm90 forward's out and LSE, by the error rule of the backward tests."""
    import torch

    q, k, v = torch_inputs((2, 257, 4, 64), (2, 300, 2, 64), "float16", requires_grad=True)
    out = cuflash.flash_attn_func(q, k, v, causal=True, backend="sm90")
    dout = torch.randn_like(out)
    out.backward(dout)
    scale = 64 ** -0.5
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), scale, True)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_attention_lowp(qq, kk, vv, scale, True).backward(dout)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (qq.grad, kk.grad, vv.grad), ref):
        assert_close_to_ref(name, ours, lp, r, factor=3.0)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_long_kv_loops(d):
    """Thousands of keys (tens of KV tiles: the stage ring wraps many times), a tail in every dimension."""
    q, k, v = torch_inputs((1, 389, 2, d), (1, 7001, 2, d), "bfloat16")
    for causal in (False, True):
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm90", return_attn_probs=True)
        _check(out, q, k, v, causal)
        _, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, causal)
        assert np.allclose(to_np(lse), ref_lse, atol=2e-4, rtol=0)
