"""GPU: the Hopper backward's fused dQ convert (cuflash._bwd_sm90.FUSED_CONVERT; cuda_src/flash_bwd_sm90.cu, FUSE):
"atomic" and "ordered" without the convert kernel, against the float64 reference (test_flash_bwd_sm90.check: the
error rule of conftest.py) on ragged tails, causal and not, seqlen_q != seqlen_k both ways (rows that see no key:
dQ exactly 0, written by KV tile 0's writer), GQA / MQA, padded head dims, with the outputs' memory poisoned (NaN)
before each call; "ordered" bitwise equal to the default kernels' "ordered"; repeated calls (the per-Q-tile counters
start from the preprocess's zeros every call); the plans launch two kernels. Skipped off compute capability 9.0."""
import pytest

import cuflash
from cuflash import _bwd_sm90, backward as bwd_mod
from test_flash_bwd_sm90 import _hopper, check  # noqa: F401 (_hopper: the autouse skip off compute capability 9.0)

pytestmark = pytest.mark.gpu


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setattr(_bwd_sm90, "FUSED_CONVERT", True)
    bwd_mod._PLANS.clear()
    yield
    bwd_mod._PLANS.clear()


def poison():
    """Fill the caching allocator's free blocks of the usual sizes with NaN, so that rows no kernel writes show."""
    import torch

    xs = [torch.full((n,), float("nan"), device="cuda", dtype=torch.float16) for n in
          (1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 21, 1 << 23, 1 << 25) for _ in range(2)]
    torch.cuda.synchronize()
    del xs


def fused_plans_launch_two():
    plans = [p for p in bwd_mod._PLANS.values() if p.backend == "sm90"]
    assert plans and all(len(p.launches) == 2 for p in plans)


SHAPES = [(2, 1, 1, 2, 2), (2, 17, 300, 2, 2), (2, 300, 17, 2, 2), (2, 128, 128, 2, 2), (2, 257, 257, 4, 2),
          (1, 1000, 700, 8, 2), (2, 640, 1300, 6, 3), (1, 700, 130, 4, 1), (1, 2100, 2100, 8, 2)]


@pytest.mark.parametrize("strategy", ["atomic", "ordered"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("b,sq,sk,h,hk", SHAPES)
def test_fused_matches_reference(fused, strategy, causal, d, b, sq, sk, h, hk):
    import torch

    poison()
    dtype = "bfloat16" if (sq + d) % 2 else "float16"
    (q, k, v, out, lse, dout), grads = check(b, sq, sk, h, hk, d, dtype, causal, dq_strategy=strategy,
                                             deterministic=strategy == "ordered")
    fused_plans_launch_two()
    if causal and sq > sk:  # rows that see no key: exactly zero
        assert torch.count_nonzero(grads[0][:, : sq - sk]) == 0


@pytest.mark.parametrize("d", [40, 72, 120])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_padded_head_dims(fused, d, causal):
    poison()
    check(2, 333, 517, 4, 2, d, "bfloat16" if d % 16 else "float16", causal)
    fused_plans_launch_two()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(513, 2100), (2100, 513), (1000, 1000)])
def test_fused_ordered_is_bitwise_the_default(monkeypatch, d, causal, sq, sk):
    """"ordered" adds in the same order with or without the fused convert, and converts with the same arithmetic
    (softmax_scale * sum, rounded once): dq, dk and dv are equal; repeated fused calls too (the counters reset)."""
    import torch

    (q, k, v, out, lse, dout), _ = check(2, sq, sk, 8, 2, d, "float16", causal, dq_strategy="ordered",
                                         deterministic=True)
    args = (dout, q, k, v, out, lse)
    kw = dict(causal=causal, deterministic=True, dq_strategy="ordered", backend="sm90")
    bwd_mod._PLANS.clear()
    default = cuflash.flash_attn_backward(*args, **kw)
    monkeypatch.setattr(_bwd_sm90, "FUSED_CONVERT", True)
    bwd_mod._PLANS.clear()
    try:
        for _ in range(3):
            poison()
            got = cuflash.flash_attn_backward(*args, **kw)
            for name, a, b in zip(("dq", "dk", "dv"), default, got):
                assert torch.equal(a, b), name
        fused_plans_launch_two()
    finally:
        bwd_mod._PLANS.clear()


@pytest.mark.parametrize("causal", [False, True])
def test_fused_atomic_repeats(fused, causal):
    """Repeated calls of one plan (the counters start from zero every call): the atomic sums agree with the first
    call's to fp32 rounding; no NaN from poisoned memory."""
    import torch

    (q, k, v, out, lse, dout), first = check(2, 1500, 1100, 8, 2, 128, "bfloat16", causal)
    for _ in range(4):
        poison()
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, backend="sm90")
        for a, r in zip(again, first):
            assert not torch.isnan(a).any()
            assert (a.float() - r.float()).abs().max().item() <= 2 ** -6 * r.float().abs().max().item()
    fused_plans_launch_two()


def test_fused_under_autograd(fused):
    """autograd takes the fused plan (flash_attn_func's backward on sm90)."""
    import torch

    from conftest import torch_inputs

    q, k, v = (x.requires_grad_() for x in torch_inputs((2, 700, 8, 128), (2, 900, 2, 128), "bfloat16"))
    poison()
    cuflash.flash_attn_func(q, k, v, causal=True).float().square().sum().backward()
    assert not any(torch.isnan(x.grad).any() for x in (q, k, v))
    fused_plans_launch_two()
