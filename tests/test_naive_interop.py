"""GPU: the unfused baseline against float64, interop both ways (torch, CuPy, DLPack) and streams.

Stream tests capture the op into a CUDA graph on a non-default stream: a launch that went to any other
stream would either break the capture or be missing from the replay, and the replayed output is checked
against the reference for *new* input values."""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,h,hk,d", [(1, 1, 1, 1, 64), (77, 300, 4, 2, 64), (300, 77, 2, 2, 128),
                                          (513, 513, 3, 1, 32)])
def test_naive_matches_reference(dtype, causal, sq, sk, h, hk, d):
    q, k, v = torch_inputs((2, sq, h, d), (2, sk, hk, d), dtype)
    out = cuflash.naive_attention(q, k, v, causal=causal)
    ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, causal)
    assert_close_to_ref("naive", out, torch_attention_lowp(q, k, v, d ** -0.5, causal), ref)


def test_naive_cupy():
    import cupy
    import torch

    q = cupy.random.standard_normal((1, 100, 2, 64)).astype(cupy.float16)
    k = cupy.random.standard_normal((1, 130, 2, 64)).astype(cupy.float16)
    out = cuflash.naive_attention(q, k, k, causal=True)
    assert isinstance(out, cupy.ndarray)
    ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(k), None, True)
    tq, tk = torch.from_dlpack(q), torch.from_dlpack(k)
    assert_close_to_ref("naive", out, torch_attention_lowp(tq, tk, tk, 0.125, True), ref)


def test_torch_graph_capture_on_side_stream():
    import torch

    q, k, v = torch_inputs((2, 200, 4, 64), (2, 300, 4, 64), "float16")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        cuflash.flash_attn_func(q, k, v, causal=True)  # compile + warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = cuflash.flash_attn_func(q, k, v, causal=True)
    for _ in range(2):  # new values in the same buffers, then replay
        q.copy_(torch.randn_like(q)); k.copy_(torch.randn_like(k)); v.copy_(torch.randn_like(v))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True)
        assert_close_to_ref("replay", out, torch_attention_lowp(q, k, v, 0.125, True), ref)


def test_cupy_graph_capture_on_side_stream():
    import cupy
    import torch

    q = cupy.random.standard_normal((1, 150, 2, 128)).astype(cupy.float16)
    k = cupy.random.standard_normal((1, 250, 2, 128)).astype(cupy.float16)
    v = cupy.random.standard_normal((1, 250, 2, 128)).astype(cupy.float16)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        cuflash.flash_attn_func(q, k, v)
        s.synchronize()
        s.begin_capture()
        out = cuflash.flash_attn_func(q, k, v)
        graph = s.end_capture()
    q[...] = cupy.random.standard_normal(q.shape).astype(cupy.float16)
    with s:
        graph.launch()
    s.synchronize()
    ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, False)
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    assert_close_to_ref("replay", out, torch_attention_lowp(tq, tk, tv, 128 ** -0.5, False), ref)


def test_dlpack_producer_zero_copy():
    """A generic DLPack producer (not torch, not CuPy) is viewed through cupy.from_dlpack, no copy."""
    import torch

    class Producer:
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    q, k, v = torch_inputs((1, 64, 2, 64), (1, 80, 2, 64), "float16")
    out = cuflash.flash_attn_func(Producer(q), Producer(k), Producer(v))
    ref, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, False)
    assert_close_to_ref("dlpack", out, torch_attention_lowp(q, k, v, 0.125, False), ref)


def test_device_inputs_validation_messages():
    import torch

    q, k, v = torch_inputs((1, 16, 2, 64), (1, 16, 2, 64), "float16")
    with pytest.raises(TypeError, match="k must be a CUDA tensor"):
        cuflash.flash_attn_func(q, k.cpu(), v)
    with pytest.raises(TypeError, match="v must have the dtype of q"):
        cuflash.flash_attn_func(q, k, v.to(torch.bfloat16))
    with pytest.raises(TypeError, match="q must be float16 or bfloat16; got float32"):
        cuflash.flash_attn_func(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        cuflash.flash_attn_func(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)
    with pytest.raises(ValueError, match="head dim 520"):
        x = torch.randn(1, 16, 2, 520, device="cuda", dtype=torch.float16)
        cuflash.flash_attn_func(x, x, x)
    import cupy

    with pytest.raises(TypeError, match="k is a cupy array but q is a torch array"):
        cuflash.flash_attn_func(q, cupy.asarray(k), v)
