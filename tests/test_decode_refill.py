"""GPU: the decode kernel with its ring refilled before the wait for a warp's next tile (plan_for(..., refill="early"),
DecodeTile.early_refill; cuda_src/flash_decode.cu, EARLY_REFILL) against the float64 reference, and bitwise against
the default refill order at the same tiles and split count (only the order of the copies differs, not the arithmetic):
ragged cache_seqlens with 0 and lengths that end inside a warp tile, MHA / GQA / MQA (one and two row fragments),
head dims 64 / 128 / 256, fp16 and bf16, forced and automatic split counts, paged caches, causal speculative rows,
the score modifiers, and tiles other than the table's (8 warps of 16 keys, 4-stage rings)."""
import pytest

from cuflash import _configs
from test_kvcache_options import Case

pytestmark = pytest.mark.gpu


def _run(c: Case, refill, num_splits=0, tile=None):
    """(out, lse, plan) of the case through plan_for / run_plan."""
    from cuflash.decode import plan_for, run_plan

    plan = plan_for(c.q, c.kc, c.vc, cache_seqlens=c.cache_seqlens, causal=c.causal, num_splits=num_splits,
                    tile=tile, window_size=c.window, softcap=c.softcap, block_table=c.block_table, refill=refill)
    out, lse = run_plan(plan, c.q, c.kc, c.vc, cache_seqlens=c.cache_seqlens, return_softmax_lse=True,
                        block_table=c.block_table)
    return out, lse, plan


def _early_and_default(c: Case, num_splits=0, tile=None):
    """The early plan against the reference, then the default order at its split count: the same bits."""
    import torch

    out, lse, plan = _run(c, "early", num_splits, tile)
    c.check(out, lse, f"early refill, {plan.num_splits} splits")
    o2, l2, p2 = _run(c, "wait", plan.num_splits, tile)
    assert p2.num_splits == plan.num_splits
    assert torch.equal(out, o2) and torch.equal(lse, l2), f"early vs wait refill, {plan.num_splits} splits"
    return plan


@pytest.mark.parametrize("num_splits", [0, 1, 3, 16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2), (32, 1)])
def test_early_refill_heads_and_splits(num_splits, d, h, hk):
    c = Case(b=3, h=h, hk=hk, d=d, cap=1000, seqlens=(1000, 0, 517), seed=d + hk)
    _early_and_default(c, num_splits)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_early_refill_dtypes_short_caches(dtype, d):
    """Caches of fewer keys than one block round, one warp tile, and a few tiles: warps with 0, 1, 2 tiles."""
    c = Case(b=4, h=8, hk=2, d=d, cap=300, seqlens=(1, 15, 33, 300), dtype=dtype, seed=d)
    _early_and_default(c)
    _early_and_default(c, 7)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_early_refill_paged(page_size, d):
    c = Case(b=3, h=8, hk=2, d=d, cap=700, seqlens=(650, 0, 17), page_size=page_size, seed=d + page_size)
    _early_and_default(c)
    _early_and_default(c, 5)


@pytest.mark.parametrize("d", [64, 128])
def test_early_refill_causal_speculative(d):
    """A few query rows with the bottom-right causal mask (rows that see no key: seqlen 2 < 4 rows)."""
    c = Case(b=3, sq=4, h=4, hk=4, d=d, cap=600, seqlens=(2, 0, 600), causal=True, seed=d)
    _early_and_default(c)
    _early_and_default(c, 4)


def test_early_refill_score_modifiers():
    c = Case(b=2, h=8, hk=2, d=128, cap=900, seqlens=(900, 333), window=(200, 0), softcap=30.0, seed=5)
    _early_and_default(c, 3)


@pytest.mark.parametrize("tile", [(16, 8, 2), (16, 4, 4), (32, 4, 3)])
@pytest.mark.parametrize("h,hk", [(32, 32), (32, 1)])
def test_early_refill_other_tiles(tile, h, hk):
    """The probe's other d128 tiles (plan_for's tile=): more warps or a deeper ring at the d128 tile's shared memory,
    and a 3-stage ring of 32-key tiles (208 KB of it)."""
    c = Case(b=2, h=h, hk=hk, d=128, cap=2000, seqlens=(2000, 1001), seed=hk)
    _early_and_default(c, 0, _configs.DecodeTile(*tile))
    _early_and_default(c, 9, _configs.DecodeTile(*tile))

