"""GPU: attention dropout. The kernels' keep mask against the NumPy Philox reference; forward and backward
against the float64 reference that applies that mask (outputs within 2x, gradients within 3x of torch's own
attention with the same mask in the same dtype: conftest.py's rule), every backward warp partition and dQ strategy,
with the score modifiers, GQA, ragged lengths; the dropped fraction and its independence (statistics);
reproducibility under torch.manual_seed, different masks on consecutive calls, the CuPy path with
cuflash.manual_seed / get_rng_state and flash_attn_backward(rng_state=), return_attn_probs' S_dmask."""
import numpy as np
import pytest

import cuflash
from cuflash import _dropout, reference
from cuflash import backward as bwd_mod
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs

pytestmark = pytest.mark.gpu


def torch_rng_state():
    """(seed, offset) the next dropout call on torch tensors takes (torch's CUDA generator, not advanced)."""
    import torch

    w = torch.cuda.default_generators[torch.cuda.current_device()].get_state().view(torch.int64)
    return int(w[0]) & ((1 << 64) - 1), int(w[1])


def mask_of(q, k, p, state):
    import torch

    return torch.as_tensor(cuflash.dropout_mask(q, k, p, state), device=q.device).bool()


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 37, 53), (1, 2, 130, 17)])
@pytest.mark.parametrize("state", [(0, 0), (12345, 8), (2**63 + 7, 2**33 + 4)])
def test_mask_kernel_matches_reference(shape, state):
    import torch

    b, h, sq, sk = shape
    q = torch.randn(b, sq, h, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(b, sk, h, 64, device="cuda", dtype=torch.float16)
    for p in (0.1, 0.5, 0.97):
        got = cuflash.dropout_mask(q, k, p, state).cpu().numpy().astype(bool)
        ref = _dropout.keep_mask_reference(b, h, sq, sk, p, *state)
        assert np.array_equal(got, ref)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropped_fraction_and_independence(p):
    """Over 2 x 4 x 1024 x 1024 elements the dropped fraction is p within 6 standard deviations, in every head and
    row band; neighbouring elements (same group, adjacent keys, adjacent rows, the next head) are uncorrelated."""
    import torch

    q = torch.randn(2, 1024, 4, 64, device="cuda", dtype=torch.float16)
    m = cuflash.dropout_mask(q, q, p, (2024, 16)).double()
    n = m.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs((1 - m.mean().item()) - p) < 6 * sigma + 2 ** -16
    per = 1 - m.mean(dim=(2, 3))  # [b, h]
    sig_h = (p * (1 - p) / (1024 * 1024)) ** 0.5
    assert (per - p).abs().max().item() < 6 * sig_h + 2 ** -16
    z = m - m.mean()
    for a, bb in ((z[..., :-1], z[..., 1:]), (z[..., :-8], z[..., 8:]), (z[:, :, :-1], z[:, :, 1:]),
                  (z[:, :, :-8], z[:, :, 8:]), (z[:, :-1], z[:, 1:])):
        corr = (a * bb).mean() / (z * z).mean()
        assert abs(corr.item()) < 0.01, corr.item()


def dropout_case(b, sq, sk, h, hk, d, dtype, p, causal=False, window=(-1, -1), cap=0.0, alibi=None, backward=True,
                 warp_partition="auto", dq_strategy=None, deterministic=False, backend="auto"):
    import torch

    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype, requires_grad=backward, scale=3.0 if cap else 1.0)
    scale = d ** -0.5
    state = torch_rng_state()
    out, lse, probs = cuflash.flash_attn_func(q, k, v, p, causal=causal, window_size=window, softcap=cap,
                                              alibi_slopes=alibi, return_attn_probs=True,
                                              warp_partition=warp_partition, dq_strategy=dq_strategy,
                                              deterministic=deterministic, backend=backend)
    assert torch_rng_state() != state, "the call advances torch's generator"
    mask = mask_of(q, k, p, state)
    an = None if alibi is None else alibi.double().cpu().numpy()
    mnp = mask.cpu().numpy()
    ref_o, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), scale, causal, window, cap, an,
                                                 mnp, p)
    lowp = torch_attention_lowp(q.detach(), k.detach(), v.detach(), scale, causal, window, cap, alibi, (mask, p))
    assert_close_to_ref(f"out p={p}", out, lowp, ref_o)
    fin = np.isfinite(ref_lse)
    assert np.allclose(to_np(lse)[fin], ref_lse[fin], atol=2e-4, rtol=0)
    # S_dmask: the probabilities, negative where dropped
    nz = probs != 0
    assert torch.equal(~torch.signbit(probs) & nz, mask & nz), "S_dmask: negative exactly where dropped"
    ref_p = np.exp(reference._scores(reference._bhsd(to_np(q)), np.repeat(reference._bhsd(to_np(k)), h // hk, 1),
                                     scale, causal, window, cap, an)[0] - ref_lse[..., None])
    assert np.abs(np.abs(to_np(probs)) - np.nan_to_num(ref_p)).max() < 2e-3
    if not backward:
        return q, k, v, out
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), scale, causal, window, cap, an,
                                       mnp, p)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_attention_lowp(qq, kk, vv, scale, causal, window, cap, alibi, (mask, p)).backward(dout)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (qq.grad, kk.grad, vv.grad), ref):
        assert_close_to_ref(f"{name} p={p} ({warp_partition}, {dq_strategy})", ours, lp, r, factor=3.0)
    return q, k, v, out


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256, 80])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("p", [0.17, 0.5])
@pytest.mark.parametrize("sq,sk", [(1, 1), (77, 300), (300, 77), (257, 257)])
@pytest.mark.parametrize("backend", ["auto", "sm80"])  # auto: the Hopper forward on sm_90 (head dims from 40)
def test_forward_backward(d, dtype, p, sq, sk, backend):
    # One key per row: torch's gradients are exactly 0 there (dS = P (dP / (1 - p) - D) cancels in exact
    # arithmetic), while the kernels' D = rowsum(dO O) comes from the 16-bit O, as in FlashAttention-2: dQ, dK are
    # that rounding (bench/NOTES.md, "Backward numerics"), so the 1 x 1 case checks the forward only.
    dropout_case(2, sq, sk, 4, 2, d, dtype, p, backward=sk > 1, backend=backend)


@pytest.mark.parametrize("opt", [(True, (-1, -1), 0.0, None), (False, (40, 9), 0.0, None),
                                 (True, (-1, -1), 15.0, "h"), (False, (-1, -1), 0.0, "h")],
                         ids=["causal", "window", "causal-cap-alibi", "alibi"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("backend", ["auto", "sm80"])
def test_with_score_modifiers(opt, d, backend):
    from test_score_mods import slopes

    causal, window, cap, akind = opt
    dropout_case(2, 200, 333, 4, 2, d, "float16", 0.3, causal, window, cap, slopes(2, 4) if akind else None,
                 backend=backend)


PART_CASES = [(d, part) for d in (32, 64, 96, 128, 256) for part in ("kv", "q", "2d")
              if d in bwd_mod.bwd_tiles(part) and (part, d) not in bwd_mod.BWD_SCORE_UNSUPPORTED]


@pytest.mark.parametrize("d,part", PART_CASES)
@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar", "loop"])
def test_partitions_and_strategies(d, part, dq_strategy):
    dropout_case(2, 333, 555, 4, 1, d, "bfloat16" if d == 64 else "float16", 0.25, True, warp_partition=part,
                 dq_strategy=dq_strategy)


def test_reproducible_and_fresh():
    """torch.manual_seed replays a call bit for bit (forward and gradients); two calls in a row drop differently;
    deterministic=True gives bitwise equal gradients for the same rng state."""
    import torch

    q, k, v = torch_inputs((2, 300, 4, 64), (2, 300, 4, 64), "float16", requires_grad=True)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        for x in (q, k, v):
            x.grad = None
        out = cuflash.flash_attn_func(q, k, v, 0.4, causal=True, deterministic=True)
        out.backward(dout)
        runs.append([out.detach().clone()] + [x.grad.clone() for x in (q, k, v)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    torch.manual_seed(7)
    o1 = cuflash.flash_attn_func(q.detach(), k.detach(), v.detach(), 0.4)
    o2 = cuflash.flash_attn_func(q.detach(), k.detach(), v.detach(), 0.4)
    assert not torch.equal(o1, o2)


def test_cupy_path_and_explicit_backward():
    import cupy

    rng = np.random.default_rng(3)
    b, s, h, d, p = 2, 190, 2, 64, 0.3
    q, k, v, dout = (cupy.asarray(rng.standard_normal((b, s, h, d)), dtype=cupy.float16) for _ in range(4))
    cuflash.manual_seed(11)
    state = cuflash.get_rng_state()
    out, lse, probs = cuflash.flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    assert cuflash.get_rng_state() != state
    cuflash.manual_seed(11)
    assert cuflash.get_rng_state() == state
    out2 = cuflash.flash_attn_func(q, k, v, p, causal=True)
    assert bool((out == out2).all())
    mask = cupy.asnumpy(cuflash.dropout_mask(q, k, p, state)).astype(bool)
    pr = cupy.asnumpy(probs)
    assert np.array_equal((pr > 0), mask & (pr != 0))
    ref_o, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True, dropout_mask=mask, dropout_p=p)
    assert np.abs(to_np(out) - ref_o).max() < 4e-3
    dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dropout_p=p, rng_state=state)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), None, True, dropout_mask=mask,
                                       dropout_p=p)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert np.abs(to_np(g) - r).max() < 2e-2 * max(1.0, np.abs(r).max()), name
    with pytest.raises(ValueError, match="rng_state"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dropout_p=p)


def test_backend_and_algorithm():
    """The Hopper forward drops exactly what the mma.sync one drops (the same seed: the same elements zeroed, the
    outputs equal up to rounding, the zeros of a row where every key is dropped included); its backward refuses
    dropout by name; V1 has no dropout."""
    import torch

    q, k, v = torch_inputs((2, 300, 4, 128), (2, 333, 2, 128), "float16")
    from cuflash._fwd_sm90 import device_cc

    if device_cc(0) == 90:
        outs = []
        for backend in ("sm90", "sm80"):
            torch.manual_seed(5)
            outs.append(cuflash.flash_attn_func(q, k, v, 0.9, causal=True, backend=backend))
        # different kernels, the same mask: rounding apart (a different mask would differ by O(1))
        assert (outs[0].float() - outs[1].float()).abs().max() <= 4e-3 * outs[1].float().abs().max()
        assert torch.equal(outs[0] == 0, outs[1] == 0)
        qg = q.detach().clone().requires_grad_()
        out = cuflash.flash_attn_func(qg, k, v, 0.2)
        with pytest.raises(ValueError, match="dropout"):
            cuflash.flash_attn_backward(torch.randn_like(out), q, k, v, out.detach(), torch.zeros(2, 4, 300,
                                        device="cuda"), dropout_p=0.2, rng_state=(1, 0), backend="sm90")
    out = cuflash.flash_attn_func(q, k, v, 0.2)
    assert torch.isfinite(out).all()
    with pytest.raises(NotImplementedError, match="dropout"):
        cuflash.flash_attn_func(q, k, v, 0.2, algorithm="v1")
