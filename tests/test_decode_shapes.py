"""GPU: the decode kernel in every geometry a plan may take at head dim 128 -- the configured tile, the wide one
(DECODE_WIDE_TILES: two blocks per SM) and its deeper ring (DECODE_DEEP_TILES), one and two row fragments per block
(cuflash.decode.decode_auto_mf) -- contiguous and paged, forced and automatic split counts, against the float64
reference; the cache rows past each element's keys hold NaN. The automatic choice itself is tested on the CPU
(test_decode_kernel_cpu.py)."""
import numpy as np
import pytest

from cuflash import _configs
from test_decode import check
from test_decode_swizzle import kernel_cache

pytestmark = pytest.mark.gpu

# (batch, cache capacity, KV heads, query heads, query rows, causal, cache_seqlens, page size, dtype)
CASES = [(3, 1100, 1, 32, 1, False, [1100, 0, 130], 0, "float16"),  # MQA: 32 folded rows
         (2, 800, 1, 4, 20, True, [800, 300], 0, "bfloat16"),  # 20 causal query rows
         (3, 1024, 1, 32, 1, False, [1024, 0, 515], 16, "float16"),  # MQA, pages of 16 keys
         (2, 2304, 8, 32, 1, False, [2304, 17], 256, "bfloat16")]  # GQA, pages of 256 keys
TILES = {"configured": _configs.decode_tile(128), "wide": _configs.DECODE_WIDE_TILES[128],
         "deep": _configs.DECODE_DEEP_TILES[128]}


@pytest.mark.parametrize("num_splits", [0, 1, 5])
@pytest.mark.parametrize("mf", [1, 2])
@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[3]}/{c[2]}-sq{c[4]}-c{int(c[5])}-p{c[7]}-{c[8]}")
def test_tiles_and_row_fragments(case, tile, mf, num_splits):
    import torch

    from cuflash.decode import plan_for, run_plan

    b, s, hk, h, sq, causal, lens, ps, dtype = case
    dt = getattr(torch, dtype)
    kc = torch.randn(b, s, hk, 128, device="cuda").to(dt)
    vc = torch.randn(b, s, hk, 128, device="cuda").to(dt)
    q = torch.randn(b, sq, h, 128, device="cuda").to(dt)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kx, vx, bt = kernel_cache(kc, vc, lens, ps)
    plan = plan_for(q, kx, vx, cache_seqlens=seqlens, causal=causal, num_splits=num_splits, tile=TILES[tile], mf=mf,
                    block_table=bt)
    out, lse = run_plan(plan, q, kx, vx, cache_seqlens=seqlens, return_softmax_lse=True, block_table=bt)
    torch.cuda.synchronize()
    assert not np.isnan(out.float().cpu().numpy()).any()
    check(out, lse, q, kc, vc, lens, causal)


def test_mf_override_is_validated():
    import torch

    from cuflash.decode import plan_for

    q = torch.randn(1, 1, 32, 256, device="cuda", dtype=torch.float16)
    kc = torch.randn(1, 64, 1, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="mf must be 1..1 at head dim 256"):
        plan_for(q, kc, kc, mf=2)
