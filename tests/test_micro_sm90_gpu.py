"""GPU (sm_90): the Hopper microbenchmark kernels compute what they claim -- every wgmma kernel's accumulators equal
numpy's A B on random data (the shared-memory descriptors, the 128-byte swizzle and the rs A fragments are right),
the TMA kernel reads the tensor's words where the swizzle puts them, the mbarrier round trips finish, the bulk
reductions' sums are exact -- and a quick run of the micro90 suite gives a value and a passing SASS check for
every record."""
import time

import pytest

import bench.bench_micro_sm90 as b9

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ctx():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU (the kernels are compiled for sm_90a)")
    return b9._Ctx(deadline=time.time() + 600)


@pytest.mark.parametrize("form", b9.FORMS + (b9.FORM_RS_K,), ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [d for d, _ in b9.DTYPES])
@pytest.mark.parametrize("n", b9.NS)
def test_wgmma_matches_numpy(ctx, form, dtype, n):
    t = dict(b9.DTYPES)[dtype]
    for ch in b9.chains(n):
        for nwg in (1, b9.tput_max_threads(n, form.rs, ch) // 128):
            err = b9.check_wgmma_tput(ctx, form, dtype, t, n, ch, nwg)
            assert err < b9.CHECK_TOL, (b9.tput_name(t, n, form, ch), nwg, err)
    if form in b9.FORMS:
        for g in b9.LAT_GROUPS:
            err = b9.check_wgmma_latency(ctx, form, dtype, t, n, g)
            assert err < b9.CHECK_TOL, (b9.latency_name(t, n, form, g), err)


@pytest.fixture(scope="module")
def tma_buf(ctx):
    """The TMA benchmark's 1 GiB tensor, random bytes."""
    elems = 1
    for x in b9.TMA_SHAPE:
        elems *= x
    buf = ctx.torch.empty(2 * elems, dtype=ctx.torch.uint8, device="cuda").random_(0, 256)
    yield buf
    del buf


@pytest.mark.parametrize("layout", b9.TMA_LAYOUTS)
@pytest.mark.parametrize("stages,rows", b9.TMA_VARIANTS)
def test_tma_load_reads_the_tensor(ctx, tma_buf, layout, stages, rows):
    assert b9.tma_check(ctx, tma_buf, layout, stages, rows, grid=3, total=2 * stages + 1)


def test_mbarrier_round_trips_finish(ctx):
    recs = []
    b9.bench_mbarrier(ctx, recs, quick=True)
    assert len(recs) == len(b9.MBAR_SIDES) + 1
    for r in recs:
        assert r["metric"] == "latency" and r["value"] is not None and 0 < r["value"] < 1e5, r


@pytest.mark.parametrize("tile_bytes,wait_done", b9.bulk_configs())
@pytest.mark.parametrize("dest", b9.BULK_DESTS)
def test_bulk_reduce_sums_exactly(ctx, tile_bytes, wait_done, dest):
    """Every destination tile holds the sum of its blocks' tiles (one, 8 or distinct destinations, 2 blocks per SM
    plus a ragged few)."""
    torch = ctx.torch
    grid = 2 * ctx.sms + 3
    src = torch.randint(0, 16, (grid * tile_bytes // 4,), device="cuda").float() / 16
    dst = torch.full_like(src, float("nan"))
    lau = ctx.launcher(b9.bulk_spec(tile_bytes, wait_done))
    assert b9.bulk_check(ctx, lau, src, dst, grid, b9.bulk_dests(dest, grid), tile_bytes, iters=3)


def test_micro90_quick_run():
    pytest.importorskip("torch")
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    recs = b9.micro90(quick=True)
    errors = [r for r in recs if r.get("metric") == "error"]
    assert not errors, [(r["name"], r["variant"], r.get("error", "")[-400:]) for r in errors]
    names = {r["name"] for r in recs}
    assert {"wgmma.ss", "wgmma.rs", "tma.load", "mbarrier", "bulk.reduce"} <= names
    for r in recs:
        if r.get("metric") == "skipped":
            continue
        assert r["value"] is not None and r["value"] > 0, r
        assert r.get("informs"), r
        if isinstance(r.get("sass"), dict):
            assert r["sass"]["ok"], (r["kernel"], r["sass"])
    tflops = [r["value"] for r in recs if r["metric"] == "TFLOP/s"]
    assert tflops and max(tflops) > 100  # any wgmma point far above a serialized or broken kernel
