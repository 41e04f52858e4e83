"""GPU: the decode kernel's swizzled ring (DecodeTile.swizzle, the kernel's SWZ; cuda_src/flash_decode.cu RingSwizzle)
against the float64 reference and bitwise against the padded rows (the same tile with swizzle=False) at the same split
count (the products and their order are the same): every head dim, fp16 and bf16, MHA / GQA / MQA (two row
fragments), causal with several query rows, ragged cache_seqlens with 0, forced and automatic split counts, paged
caches. The rows past each element's keys hold NaN, which the kernel must never read into a result."""
from dataclasses import replace

import numpy as np
import pytest

from cuflash import _configs
from test_decode import check

pytestmark = pytest.mark.gpu

# (batch, cache capacity, KV heads, query heads, query rows, causal, head dim, cache_seqlens, page size)
CASES = [(2, 800, 1, 4, 20, True, 128, [800, 300], 0),  # 20 causal query rows: two row fragments
         (2, 600, 2, 8, 1, False, 32, [600, 9], 0),
(3, 700, 2, 8, 1, False, 64, [700, 0, 33], 0),
         (2, 900, 8, 32, 1, False, 128, [900, 17], 0),
         (3, 1100, 1, 32, 1, False, 128, [1100, 0, 130], 0),  # MQA: 32 folded rows
         (2, 600, 4, 16, 3, True, 128, [600, 40], 0),
         (2, 500, 2, 8, 1, False, 96, [499, 77], 0),
         (2, 500, 2, 8, 1, False, 256, [500, 1], 0),
         (2, 400, 2, 8, 2, True, 32, [400, 21], 0),
         (2, 512, 4, 16, 1, False, 32, [512, 100], 16),
         (3, 1024, 8, 32, 1, False, 128, [1024, 0, 515], 16),
         (2, 512, 2, 8, 2, True, 64, [512, 300], 16)]


def kernel_cache(kc, vc, lens, ps):
    """The cache as the kernel reads it: (k, v, block table or None), the rows past each element's keys NaN (the kernel
    must never read them into a result); with ps > 0 the same keys in pages of ps rows in a random order."""
    import torch

    b, s, hk, d = kc.shape
    kx, vx, bt = kc.clone(), vc.clone(), None
    for i, n in enumerate(lens):
        kx[i, n:] = float("nan")
        vx[i, n:] = float("nan")
    if ps:
        perm = torch.randperm(b * s // ps, device="cuda")
        kp, vp = torch.empty_like(kx).view(-1, ps, hk, d), torch.empty_like(vx).view(-1, ps, hk, d)
        kp[perm], vp[perm] = kx.reshape(-1, ps, hk, d), vx.reshape(-1, ps, hk, d)
        kx, vx, bt = kp, vp, perm.reshape(b, s // ps).to(torch.int32)
    return kx, vx, bt


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[6]}-h{c[3]}/{c[2]}-sq{c[4]}-c{int(c[5])}-p{c[8]}")
def test_swizzled_ring_matches_reference_and_padded_rows(case, num_splits, dtype):
    import torch

    from cuflash.decode import plan_for, run_plan

    b, s, hk, h, sq, causal, d, lens, ps = case
    dt = getattr(torch, dtype)
    kc = torch.randn(b, s, hk, d, device="cuda").to(dt)
    vc = torch.randn(b, s, hk, d, device="cuda").to(dt)
    q = torch.randn(b, sq, h, d, device="cuda").to(dt)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kx, vx, bt = kernel_cache(kc, vc, lens, ps)
    swz = replace(_configs.decode_tile(d), swizzle=True)
    plan = plan_for(q, kx, vx, cache_seqlens=seqlens, causal=causal, num_splits=num_splits, tile=swz, block_table=bt)
    out, lse = run_plan(plan, q, kx, vx, cache_seqlens=seqlens, return_softmax_lse=True, block_table=bt)
    base = plan_for(q, kx, vx, cache_seqlens=seqlens, causal=causal, num_splits=plan.num_splits, block_table=bt,
                    tile=replace(swz, swizzle=False))
    out0, lse0 = run_plan(base, q, kx, vx, cache_seqlens=seqlens, return_softmax_lse=True, block_table=bt)
    torch.cuda.synchronize()
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    assert not np.isnan(out.float().cpu().numpy()).any()
    check(out, lse, q, kc, vc, lens, causal)
