"""GPU: head dims that are not compiled (multiples of 8 up to 256) on the kernel of the next compiled head dim,
whose loads zero-fill the columns past the inputs' head dim in shared memory and whose stores skip them: the
forward on both backends, the backward in every warp partition, the decode and split-KV paths with the cache
append, strided views whose rows are longer than the head dim, and outputs that never touch the padding
(neighbouring heads of a contiguous output stay exact). Against the float64 reference with conftest.py's rule."""
import numpy as np
import pytest

import cuflash
from cuflash import _configs, reference
from cuflash import backward as bwd_mod
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs
from test_decode import append_case, check as check_decode

pytestmark = pytest.mark.gpu

# every run-time padding class: below 32, between each pair of compiled head dims, and just below 256
HEADDIMS = [8, 16, 24, 40, 48, 56, 72, 80, 88, 104, 112, 120, 136, 160, 192, 200, 224, 248]


def backend_ok(backend):
    if backend == "sm90":
        from cuflash._fwd_sm90 import device_cc

        if device_cc(0) != 90:
            pytest.skip("backend sm90 needs a compute capability 9.0 GPU")


def check_fwd(q, k, v, out, lse, causal, what):
    d = q.shape[-1]
    ref_o, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, causal)
    assert_close_to_ref(f"out {what}", out, torch_attention_lowp(q, k, v, d ** -0.5, causal), ref_o)
    fin = np.isfinite(ref_lse)
    assert np.allclose(to_np(lse)[fin], ref_lse[fin], atol=2e-4, rtol=0)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("backend", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal,sq,sk", [(False, 77, 300), (True, 300, 77), (True, 257, 257)])
def test_forward(d, backend, dtype, causal, sq, sk):
    backend_ok(backend)
    assert _configs.kernel_headdim(d) != d
    q, k, v = torch_inputs((2, sq, 4, d), (2, sk, 2, d), dtype)
    if backend == "sm90" and d <= 32:  # the sm80 kernels' own head dim 32 runs these
        with pytest.raises(ValueError, match=f"head dim {d}"):
            cuflash.flash_attn_func(q, k, v, causal=causal, backend=backend)
        return
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, backend=backend)
    assert out.shape == q.shape
    check_fwd(q, k, v, out, lse, causal, f"d{d} {backend}")


def check_bwd(d, dtype, causal, warp_partition="auto", dq_strategy=None, sq=190, sk=333, hk=2):
    import torch

    q, k, v = torch_inputs((2, sq, 4, d), (2, sk, hk, d), dtype, requires_grad=True)
    out = cuflash.flash_attn_func(q, k, v, causal=causal, warp_partition=warp_partition, dq_strategy=dq_strategy)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), None, causal)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_attention_lowp(qq, kk, vv, d ** -0.5, causal).backward(dout)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (qq.grad, kk.grad, vv.grad), ref):
        assert ours.shape == lp.shape
        assert_close_to_ref(f"{name} d{d} {warp_partition} {dq_strategy}", ours, lp, r, factor=3.0)


@pytest.mark.parametrize("d", HEADDIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward(d, dtype):
    check_bwd(d, dtype, causal=d % 16 == 0)


@pytest.mark.parametrize("d,part", [(d, part) for d in (40, 80, 112, 200) for part in ("kv", "q", "2d")
                                    if _configs.kernel_headdim(d) in bwd_mod.bwd_tiles(part)])
@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar", "loop"])
def test_backward_partitions(d, part, dq_strategy):
    check_bwd(d, "float16", True, part, dq_strategy)


@pytest.mark.parametrize("d", [8, 40, 80, 112, 160, 248])
@pytest.mark.parametrize("kernel", ["decode", "fwd_split"])
def test_decode_with_append(d, kernel):
    import torch

    s_new = 3
    q, kc, vc, kn, vn, seqlens, expect_k, expect_v = append_case(d, s_new)
    for num_splits in (1, 4):
        kc2, vc2 = kc.clone(), vc.clone()
        out, lse = cuflash.flash_attn_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=seqlens, causal=True,
                                                   num_splits=num_splits, return_softmax_lse=True, kernel=kernel)
        assert torch.equal(kc2, expect_k) and torch.equal(vc2, expect_v), "append writes exactly the head dim"
        check_decode(out, lse, q, kc2, vc2, [n + s_new for n in seqlens.tolist()], True)


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
def test_strided_views_and_neighbours(backend):
    """q, k, v as the first 80 columns of head-dim-96 tensors (rows longer than the head dim: the padding reads
    stop at 80, not at the row's end), and dq/dk/dv of every head exact (a store past the head dim would overwrite
    the next head's first columns)."""
    import torch

    backend_ok(backend)
    big = [torch.randn(2, 200, 4, 96, device="cuda", dtype=torch.float16) for _ in range(3)]
    q, k, v = (x[..., :80] for x in big)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend=backend)
    check_fwd(q, k, v, out, lse, True, f"strided {backend}")
    check_view_grads(q, k, v, True, "strided", lambda x: x.clone().requires_grad_(), backend=backend)


def check_view_grads(q, k, v, causal, what, leaf, **kw):
    """Autograd gradients of flash_attn_func on leaf(q), leaf(k), leaf(v) against the float64 reference."""
    import torch

    qg, kg, vg = (leaf(x) for x in (q, k, v))
    o = cuflash.flash_attn_func(qg, kg, vg, causal=causal, **kw)
    dout = torch.randn_like(o)
    o.backward(dout)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), None, causal)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_attention_lowp(qq, kk, vv, q.shape[-1] ** -0.5, causal).backward(dout)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), (qq.grad, kk.grad, vv.grad), ref):
        assert_close_to_ref(f"{name} {what}", ours, lp, r, factor=3.0)


def test_headdim_validation():
    import torch

    q = torch.randn(1, 8, 2, 520, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="head dim 520"):
        cuflash.flash_attn_func(q, q, q)
    q = torch.randn(1, 8, 2, 59, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="backend='sm90' cannot take this input: head dim 59"):
        cuflash.flash_attn_func(q, q, q, backend="sm90")


# ------------------------------------------------------------------ head dims above 256: the forward only
WIDE = [512, 264, 384, 448]


@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal,sq,sk,h,hk", [(False, 77, 300, 4, 2), (True, 300, 77, 4, 4), (True, 257, 257, 4, 1),
                                               (False, 1, 333, 8, 2)])
def test_wide_forward(d, dtype, causal, sq, sk, h, hk):
    """Head dims 264-512 on the 512 kernel (two blocks of 256 O columns per Q tile), GQA/MQA, ragged, sq != sk, single
    query; backend auto takes it (the Hopper forward stops at 256)."""
    q, k, v = torch_inputs((2, sq, h, d), (2, sk, hk, d), dtype)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check_fwd(q, k, v, out, lse, causal, f"d{d}")


def test_wide_modifiers_dropout_and_cupy():
    """The 512 forward with window + soft-cap + ALiBi, with dropout (against the reference with the kernels' keep
    mask), and on CuPy arrays."""
    import cupy
    import torch

    from test_dropout import torch_rng_state
    from test_score_mods import slopes

    q, k, v = torch_inputs((2, 200, 4, 512), (2, 333, 2, 512), "float16", scale=3.0)
    alibi = slopes(2, 4)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, window_size=(60, -1), softcap=20.0,
                                          alibi_slopes=alibi, return_attn_probs=True)
    an = alibi.double().cpu().numpy()
    ref_o, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True, (60, -1), 20.0, an)
    assert_close_to_ref("out d512 modifiers", out,
                        torch_attention_lowp(q, k, v, 512 ** -0.5, True, (60, -1), 20.0, alibi), ref_o)
    state = torch_rng_state()
    out = cuflash.flash_attn_func(q, k, v, 0.2)
    mask = torch.as_tensor(cuflash.dropout_mask(q, k, 0.2, state), device="cuda").bool()
    ref_o, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, False, dropout_mask=mask.cpu().numpy(),
                                           dropout_p=0.2)
    assert_close_to_ref("out d512 dropout", out, torch_attention_lowp(q, k, v, 512 ** -0.5, False, dropout=(mask, 0.2)),
                        ref_o)
    qc, kc, vc = (cupy.asarray(x.cpu().numpy()) for x in (q, k, v))
    out_c = cuflash.flash_attn_func(qc, kc, vc, causal=True)
    assert torch.equal(torch.as_tensor(out_c, device="cuda"), cuflash.flash_attn_func(q, k, v, causal=True))


def test_wide_refusals():
    """Above 256: no backward (autograd, flash_attn_backward), no KV-cache path, no Hopper forward -- each a clear
    error before anything launches."""
    import torch

    q, k, v = torch_inputs((1, 64, 2, 320), (1, 64, 2, 320), "float16", requires_grad=True)
    with pytest.raises(NotImplementedError, match="head dim 320"):
        cuflash.flash_attn_func(q, k, v)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    out, lse, _ = cuflash.flash_attn_func(qd, kd, vd, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="the backward"):
        cuflash.flash_attn_backward(torch.randn_like(out), qd, kd, vd, out, lse)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache"):
        cuflash.flash_attn_with_kvcache(qd[:, :1], kd, vd)
    from cuflash._fwd_sm90 import device_cc

    if device_cc(0) == 90:
        with pytest.raises(ValueError, match="head dim 320"):
            cuflash.flash_attn_func(qd, kd, vd, backend="sm90")


# ------------------------------------------------------------ rows that are not 16-byte units (the UA kernels)
ODD = [1, 3, 17, 59, 83, 111, 127, 203, 255]


def odd_views(shape, dtype="float16", pad=3, offset=1):
    """A fresh random [b, s, h, d] view with rows `pad` elements longer than d and data `offset` elements into its
    buffer: every stride and the base address 2-byte aligned only."""
    import torch

    b, s, h, d = shape
    big = torch.randn(b * s * h * (d + pad) + offset, device="cuda").to(getattr(torch, dtype))
    return big[offset:].view(b, s, h, d + pad)[..., :d]


@pytest.mark.parametrize("d", ODD)
@pytest.mark.parametrize("causal,sq,sk", [(False, 77, 300), (True, 300, 77)])
def test_odd_forward(d, causal, sq, sk):
    import torch

    q, k, v = torch_inputs((2, sq, 4, d), (2, sk, 2, d), "float16")
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check_fwd(q, k, v, out, lse, causal, f"d{d}")
    if d in (3, 59, 111):  # odd strides and base addresses, auto backend (never the Hopper kernels)
        q2, k2, v2 = odd_views((2, sq, 4, d)), odd_views((2, sk, 2, d), pad=5), odd_views((2, sk, 2, d), offset=3)
        out, lse, _ = cuflash.flash_attn_func(q2, k2, v2, causal=causal, return_attn_probs=True, backend="auto")
        check_fwd(q2, k2, v2, out, lse, causal, f"odd views d{d}")
        assert out.shape == q2.shape and torch.isfinite(out).all()


def test_odd_strides_aligned_headdim():
    """Head dim 64 with rows of 67 elements: the UA kernel by the strides alone (forward and backward)."""
    q, k, v = (odd_views((2, 150, 4, 64), pad=3, offset=0) for _ in range(3))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_fwd(q, k, v, out, lse, True, "odd strides d64")
    # leaves that keep the odd strides (a detached view, not a copy)
    check_view_grads(q, k, v, True, "odd strides", lambda x: x.detach().requires_grad_())


@pytest.mark.parametrize("d", [1, 17, 59, 111, 203, 255])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_odd_backward(d, dtype):
    check_bwd(d, dtype, causal=d % 2 == 1)


def test_odd_varlen_dropout_softcap_cupy():
    """Head dim 59: the packed forward and backward against per-sequence references, soft-cap with a window, dropout
    (its keep mask from cuflash.dropout_mask, as in test_dropout), and the CuPy backward."""
    import torch

    d, lens = 59, [37, 1, 130]
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device="cuda")
    total = sum(lens)
    q, k, v = (torch.randn(total, 4, d, device="cuda", dtype=torch.float16).requires_grad_() for _ in range(3))
    out = cuflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    for i, n in enumerate(lens):
        s0 = int(cu[i])
        qi, ki, vi = (x.detach()[s0:s0 + n][None] for x in (q, k, v))
        ref_o, _ = reference.attention_forward(to_np(qi), to_np(ki), to_np(vi), None, True)
        assert_close_to_ref(f"varlen out seq {i}", out[s0:s0 + n][None], torch_attention_lowp(qi, ki, vi, d ** -0.5,
                                                                                             True), ref_o)
        ref = reference.attention_backward(to_np(dout[s0:s0 + n][None]), to_np(qi), to_np(ki), to_np(vi), None, True)
        qq, kk, vv = (x.clone().requires_grad_() for x in (qi, ki, vi))
        torch_attention_lowp(qq, kk, vv, d ** -0.5, True).backward(dout[s0:s0 + n][None])
        for name, g, lp, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (qq.grad, kk.grad, vv.grad), ref):
            assert_close_to_ref(f"varlen {name} seq {i}", g[s0:s0 + n][None], lp, r, factor=3.0)
    # soft-cap and a window
    q, k, v = torch_inputs((2, 90, 4, d), (2, 140, 4, d), "float16")
    out = cuflash.flash_attn_func(q, k, v, window_size=(20, 5), softcap=10.0)
    ref_o = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, False, window_size=(20, 5),
                                        softcap=10.0)[0]
    assert np.isfinite(to_np(out)).all() and np.abs(to_np(out) - ref_o).max() < 2e-2
    # dropout: against the reference with the kernels' keep mask (cuflash.dropout_mask of the call's rng state)
    from test_dropout import torch_rng_state

    state = torch_rng_state()
    out = cuflash.flash_attn_func(q, k, v, 0.2)
    mask = torch.as_tensor(cuflash.dropout_mask(q, k, 0.2, state), device="cuda").bool()
    ref_o, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, False, dropout_mask=mask.cpu().numpy(),
                                           dropout_p=0.2)
    assert_close_to_ref("out d59 dropout", out, torch_attention_lowp(q, k, v, d ** -0.5, False, dropout=(mask, 0.2)),
                        ref_o)
    # CuPy backward (the low-level API)
    import cupy

    qc, kc, vc = (cupy.asarray(x.detach()) for x in (q, k, v))
    oc, lse = cuflash.flash_attn_func(qc, kc, vc, causal=True, return_attn_probs=True)[:2]
    doc = cupy.random.standard_normal(oc.shape, dtype=cupy.float32).astype(cupy.float16)
    dq, dk, dv = cuflash.flash_attn_backward(doc, qc, kc, vc, oc, lse, causal=True)
    ref = reference.attention_backward(cupy.asnumpy(doc).astype(np.float64), to_np(q), to_np(k), to_np(v), None, True)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        err = np.abs(cupy.asnumpy(g).astype(np.float64) - r).max()
        assert np.isfinite(err) and err < 5e-2 * max(1.0, np.abs(r).max()), (name, err)


@pytest.mark.parametrize("d", [3, 59, 111, 255])
def test_odd_kvcache_append(d):
    """flash_attn_with_kvcache with k / v appended at an odd head dim: the cache bytes exactly, the output against
    the reference (the decode kernel's UA form; its cache indirections: tests/test_kvcache_options.py)."""
    import torch

    s_new = 3
    q, kc, vc, kn, vn, seqlens, expect_k, expect_v = append_case(d, s_new)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                               return_softmax_lse=True)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v), "append writes exactly the head dim"
    check_decode(out, lse, q, kc, vc, [n + s_new for n in seqlens.tolist()], True)
