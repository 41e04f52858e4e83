"""GPU: the FlashAttention-2 backward (dq, dk, dv) against the float64 reference with the error rule of
conftest.py: the three warp partitions ("kv", "q", "2d"), every dQ strategy, dtype and head dim, causal and not, ragged
and unequal lengths, GQA/MQA, torch autograd and the CuPy API; determinism of the deterministic strategies.
(CPU checks of the partitions' index math: tests/test_bwd_partition.py.)"""
import warnings

import numpy as np
import pytest

import cuflash
from cuflash import backward as bwd_mod
from cuflash import reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs

pytestmark = pytest.mark.gpu


def grads_lowp(q, k, v, dout, scale, causal):
    """torch's own attention backward in the inputs' dtype (the yardstick)."""
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_attention_lowp(qq, kk, vv, scale, causal).backward(dout)
    return qq.grad, kk.grad, vv.grad


def check_grads(b, sq, sk, h, hk, d, dtype, causal, dq_strategy="atomic", deterministic=False, warp_partition="auto",
                backend="auto"):
    import torch

    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype, requires_grad=True)
    scale = d ** -0.5
    out = cuflash.flash_attn_func(q, k, v, causal=causal, dq_strategy=dq_strategy, deterministic=deterministic,
                                  warp_partition=warp_partition, backend=backend)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), scale, causal)
    lowp = grads_lowp(q, k, v, dout, scale, causal)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), lowp, ref):
        assert ours.shape == lp.shape and ours.dtype == lp.dtype
        assert_close_to_ref(f"{name} ({dq_strategy}, {warp_partition})", ours, lp, r)
    return q, k, v, dout


SHAPES = [(1, 1), (17, 300), (300, 17), (257, 257), (1000, 700)]


# The default ("auto": the partition tuned per head dim) and, where that is another one, the "kv" partition; the
# default on both backends ("auto" is the Hopper backward on sm90 where it runs the call: test_flash_bwd_sm90.py).
@pytest.mark.parametrize("d,warp_partition,backend",
                         [(d, p, bk) for d in (32, 64, 96, 128, 256) for p in ("auto", "kv") for bk in ("auto", "sm80")
                          if (p == "auto" or bwd_mod.resolve_warp_partition("auto", d) != "kv")
                          and (bk == "auto" or p == "auto")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_backward_matches_reference(dtype, d, warp_partition, backend, causal, sq, sk):
    check_grads(2, sq, sk, 2, 2, d, dtype, causal, warp_partition=warp_partition, backend=backend)


# The Q-row partition (warp_partition="q"): ragged lengths (1, 17, 127, 1000), seqlen_q != seqlen_k both ways,
# and seqlen_k - seqlen_q = 1, where the last row of a 16-row warp band sees exactly the first key of a KV tile
# (the boundary of the kernel's skip of bands that see no key of the tile).
SHAPES_Q = [(1, 1), (17, 300), (300, 17), (127, 127), (127, 1000), (1000, 127), (1000, 1000), (150, 151)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES_Q)
def test_backward_q_partition_matches_reference(dtype, d, causal, sq, sk):
    check_grads(2, sq, sk, 2, 2, d, dtype, causal, warp_partition="q")


# The 2D partition (warp_partition="2d", FlashAttention-2's): head dims 32-128, the same lengths as "q", plus
# several Q tiles per KV tile with a ragged end on both sides (the single-buffered dO of head dim 128).
SHAPES_2D = SHAPES_Q + [(333, 555)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES_2D)
def test_backward_2d_partition_matches_reference(dtype, d, causal, sq, sk):
    check_grads(2, sq, sk, 2, 2, d, dtype, causal, warp_partition="2d")


DQ_CASES = [(300, 17, 2, 2, 64), (333, 555, 4, 1, 128), (640, 384, 6, 2, 64), (129, 129, 2, 2, 256),
            (17, 1000, 8, 2, 96), (1000, 127, 4, 4, 32)]


@pytest.mark.parametrize("warp_partition,sq,sk,h,hk,d",
                         [(p, *c) for p in ("kv", "q", "2d") for c in DQ_CASES if c[-1] in bwd_mod.bwd_tiles(p)])
@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar", "loop"])
@pytest.mark.parametrize("causal", [False, True])
def test_dq_strategies(warp_partition, dq_strategy, causal, sq, sk, h, hk, d):
    check_grads(2, sq, sk, h, hk, d, "float16", causal, dq_strategy, warp_partition=warp_partition)


@pytest.mark.parametrize("warp_partition", ["q", "2d"])
@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar", "loop"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_partition_gqa_bf16(dtype, dq_strategy, warp_partition):
    check_grads(2, 257, 301, 6, 2, 128, dtype, True, dq_strategy, warp_partition=warp_partition)


@pytest.mark.parametrize("warp_partition", ["kv", "q", "2d"])
@pytest.mark.parametrize("dq_strategy", ["seqpar", "loop"])
def test_deterministic_bitwise(dq_strategy, warp_partition):
    import torch

    q, k, v = torch_inputs((2, 700, 4, 128), (2, 900, 2, 128), "bfloat16", requires_grad=True)
    dout = torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True, dq_strategy=dq_strategy,
                                warp_partition=warp_partition).backward(dout)
        grads.append([x.grad.clone() for x in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_deterministic_default_picks_a_deterministic_strategy():
    import torch

    q, k, v = torch_inputs((1, 300, 2, 64), (1, 300, 2, 64), "float16", requires_grad=True)
    dout = torch.randn(1, 300, 2, 64, device="cuda", dtype=torch.float16)
    g = []
    for _ in range(2):
        q.grad = None
        cuflash.flash_attn_func(q, k, v, deterministic=True).backward(dout)
        g.append(q.grad.clone())
    assert torch.equal(g[0], g[1])
    with pytest.raises(ValueError, match="not deterministic"):
        cuflash.flash_attn_func(q, k, v, deterministic=True, dq_strategy="atomic").backward(dout)


@pytest.mark.parametrize("warp_partition", ["kv", "q", "2d"])
def test_seqpar_falls_back_when_buffers_do_not_fit(monkeypatch, warp_partition):
    monkeypatch.setattr(bwd_mod, "SEQPAR_MAX_FREE_FRACTION", 0.0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        check_grads(1, 200, 300, 2, 2, 64, "float16", True, "seqpar", warp_partition=warp_partition)
    assert any("using 'loop'" in str(x.message) for x in w)


def test_seqpar_extra_memory_formula():
    # 16k tokens: 128 KV tiles x 1 x 16 heads x 16384 rows x 128 x 4 bytes = 4 GiB
    assert bwd_mod.seqpar_extra_bytes(1, 16, 16384, 16384, 128) == 128 * 16 * 16384 * 128 * 4
    # the Q partition's tile has 32 KV rows at head dim 128: 4x the buffers
    n = 16384 // bwd_mod.bwd_tiles("q")[128].block_n
    assert bwd_mod.seqpar_extra_bytes(1, 16, 16384, 16384, 128, warp_partition="q") == n * 16 * 16384 * 128 * 4


@pytest.mark.parametrize("warp_partition", ["kv", "q", "2d"])
def test_cupy_backward_api(warp_partition):
    import cupy
    import torch

    b, sq, sk, h, hk, d = 2, 211, 333, 4, 2, 64
    q = cupy.random.standard_normal((b, sq, h, d)).astype(cupy.float16)
    k = cupy.random.standard_normal((b, sk, hk, d)).astype(cupy.float16)
    v = cupy.random.standard_normal((b, sk, hk, d)).astype(cupy.float16)
    dout = cupy.random.standard_normal((b, sq, h, d)).astype(cupy.float16)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dq_strategy="seqpar",
                                             warp_partition=warp_partition)
    assert all(isinstance(x, cupy.ndarray) for x in (dq, dk, dv))
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), d ** -0.5, True)
    tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, dout))
    lowp = grads_lowp(tq, tk, tv, tdo, d ** -0.5, True)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (dq, dk, dv), lowp, ref):
        assert_close_to_ref(name, ours, lp, r)


def test_backward_validation():
    import torch

    q, k, v = torch_inputs((1, 16, 2, 64), (1, 16, 2, 64), "float16")
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    with pytest.raises(ValueError, match="dout must have the shape of q"):
        cuflash.flash_attn_backward(out[:, :8], q, k, v, out, lse)
    with pytest.raises(ValueError, match="softmax_lse must be float32"):
        cuflash.flash_attn_backward(out, q, k, v, out, lse[:, :1])
    with pytest.raises(ValueError, match="dq_strategy must be one of"):
        cuflash.flash_attn_backward(out, q, k, v, out, lse, dq_strategy="magic")
    with pytest.raises(ValueError, match="warp_partition must be one of"):
        cuflash.flash_attn_backward(out, q, k, v, out, lse, warp_partition="k")
    with pytest.raises(ValueError, match="warp_partition"):
        cuflash.flash_attn_backward(out, q, k, v, out, lse, algorithm="v1", warp_partition="q")


def test_grad_of_noncontiguous_dout():
    """autograd hands the backward whatever gradient the graph makes (here: transposed, from a permute)."""
    import torch

    q, k, v = torch_inputs((2, 100, 2, 64), (2, 120, 2, 64), "float16", requires_grad=True)
    out = cuflash.flash_attn_func(q, k, v)
    w = torch.randn(2, 2, 64, 100, device="cuda", dtype=torch.float16)
    (out.permute(0, 2, 3, 1) * w).sum().backward()
    dout = w.permute(0, 3, 1, 2)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), 0.125, False)
    lowp = grads_lowp(q, k, v, dout.contiguous(), 0.125, False)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), lowp, ref):
        assert_close_to_ref(name, ours, lp, r)


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_backward_plan_memo(kind):
    """The memoized backward plan (cuflash.backward.backward_memo): calls that hit a plan made for other arrays of
    the same layout use the new arrays' data; a misaligned view with a memoized key is validated (and runs on the UA
    kernels);
    an option change makes a new plan."""
    import torch

    b, sq, sk, h, hk, d = 2, 150, 211, 4, 2, 64
    bwd_mod._PLANS.clear()
    for it in range(3):
        q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), "float16")
        dout = torch.randn_like(q)
        causal = it == 2  # the third call: another option, another plan
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        args = (dout, q, k, v, out, lse)
        if kind == "cupy":
            import cupy

            args = tuple(cupy.from_dlpack(x) for x in args)
        dq, dk, dv = cuflash.flash_attn_backward(*args, causal=causal)
        assert len(bwd_mod._PLANS) == (1 if it < 2 else 2)
        ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), d ** -0.5, causal)
        lowp = grads_lowp(q, k, v, dout, d ** -0.5, causal)
        for name, ours, lp, r in zip(("dq", "dk", "dv"), (dq, dk, dv), lowp, ref):
            assert_close_to_ref(f"{name} (call {it})", ours, lp, r)
    # same shape and strides as the memoized q, 2 bytes off the 16-byte alignment of the aligned kernels: the
    # validating path, the UA kernels, the same gradients
    base = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)
    q_off = base[1:1 + q.numel()].view(q.shape)
    q_off.copy_(q)
    dq2, dk2, dv2 = cuflash.flash_attn_backward(dout, q_off, k, v, out, lse, causal=True)
    assert len(bwd_mod._PLANS) == 2  # a plan for data that is not 16-byte aligned is not kept
    for name, a, b2 in (("dq", dq, dq2), ("dk", dk, dk2), ("dv", dv, dv2)):
        a, b2 = to_np(a), to_np(b2)
        assert np.abs(a - b2).max() <= 2e-2 * max(1.0, np.abs(a).max()), name


def test_launch_from_a_thread_without_a_cuda_context():
    """A thread that has not used the CUDA runtime has no current context, and cuLaunchKernel then fails
    (CUDA_ERROR_INVALID_CONTEXT): a user's fresh thread, or torch's autograd device thread when no torch kernel ran
    there before cuflash's backward. cuflash makes the device's primary context current before it launches."""
    import threading

    import torch

    q, k, v = torch_inputs((2, 200, 4, 64), (2, 300, 2, 64), "float16")
    dout = torch.randn_like(q)

    def run():
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        return out, *grads

    want = run()  # also leaves every buffer size in torch's caching allocator: the thread allocates from it
    torch.cuda.synchronize()
    got, errors = [], []

    def worker():
        try:
            got.extend(run())
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name  # deterministic kernels, same inputs: bitwise equal


@pytest.mark.parametrize("d,tile", [(64, (128, 128, 8, 1, 4)), (128, (64, 128, 8, 1, 4))])
@pytest.mark.parametrize("bulk,p_regs,load_at,exp_il", [
    (False, False, 0, 0), (True, False, 0, 0), (False, True, 0, 0), (True, True, 0, 0), (True, False, 1, 0),
    (True, True, 1, 0), (True, True, 2, 0), (True, True, 1, 1), (True, True, 2, 1), (True, False, 2, 1),
    (False, True, 0, 1), (False, False, 0, 1)])
@pytest.mark.parametrize("strategy", ["atomic", "seqpar", "loop"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 300), (300, 17), (1000, 700)])
def test_2d_tile_options_match_reference(d, tile, bulk, p_regs, load_at, exp_il, strategy, causal, sq, sk):
    """The 2D tile as sm_80 runs it (the H200 runs BWD_TILES_2D_SM90 by default) and with its sm_90 options, through
    cuflash.backward.backward: dq_bulk (dQ staged in shared memory, added by cp.reduce.async.bulk from warp-uniform
    operands one step later, with a second dO buffer beyond sm_80's smem; other strategies keep their own writes),
    where the next Q tile is requested (`load_at`, with dq_bulk: after S = QK^T, after P and dP), P kept in
    registers for dS, and P's exps interleaved with dP = dO V^T (`exp_il`)."""
    import cupy
    import torch

    if bulk and int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("sm_90 tile options")
    from cuflash._configs import BwdTile

    t = BwdTile(*tile, dq_bulk=bulk, p_regs=p_regs, load_at=load_at, exp_il=bool(exp_il))
    q, k, v = torch_inputs((2, sq, 2, d), (2, sk, 1, d), "bfloat16")
    dout = torch.randn_like(q)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    views = bwd_mod.check_backward_inputs(dout, q, k, v, out, lse)
    dq, dk, dv = bwd_mod.backward(*views, None, causal, strategy, tile=t, warp_partition="2d")
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), d ** -0.5, causal)
    lowp = grads_lowp(q, k, v, dout, d ** -0.5, causal)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (dq, dk, dv), lowp, ref):
        assert_close_to_ref(f"{name} ({t}, {strategy})", ours, lp, r)
