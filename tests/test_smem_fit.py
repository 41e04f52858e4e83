"""GPU: the tiles a GPU of 99 KB of shared memory per block takes (sm_86 / sm_89 / sm_120: cuflash._configs.
fit_fwd_tile, fit_bwd_partition, fit_decode_tile), run on this GPU planned as such a one (CUFLASH_SMEM_PER_BLOCK =
101376: the host plans for 99 KB a block and 100 KB an SM, "auto" leaves the sm90 kernels, and every kernel built
is checked to fit: cuflash._launch.check_smem) against the float64 reference, with the error rule of the other
tests: the forward at every compiled head dim and padded ones, causal and not, GQA, ragged tails and sq != sk, the
score modifiers; the backward ("auto" takes the Q-row partition from head dim 64) with each dQ strategy; packed
sequences; rows that are not 16-byte units (head dim 90); the decode kernel and the split-KV forward, contiguous and
paged. The backwards that have no fitted kernel are refused (head dim 256; head dims 97-128 packed or UA with a
score modifier, or UA, whose kernels always take the modifiers' mode).
Plans and launchers are made afresh under the cap and cleared after the module."""
import pytest

import cuflash
from conftest import torch_inputs
from test_decode import check as check_decode, make_cache
from test_flash_bwd import check_grads
from test_flash_fwd import run_case
from test_kvcache_options import Case
from test_score_mods import OPTIONS, check_backward
from test_varlen import LENS_K, LENS_Q, check as check_varlen, packed_inputs

pytestmark = pytest.mark.gpu

CAP = 99 * 1024


def _clear_plans():
    """The plans, and the launchers: a launcher checks its kernel's shared memory against the cap when it is built
    (cuflash._launch.check_smem), so one an earlier test of the process built under no cap must not be reused."""
    from cuflash import _fwd, _launch, backward, decode

    for memo in (_fwd._PLANS, _fwd._KV_PLANS, backward._PLANS, decode._PLANS, _launch._launchers):
        memo.clear()
    decode._resident.cache_clear()


@pytest.fixture(scope="module", autouse=True)
def _planned_as_99kb():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUFLASH_SMEM_PER_BLOCK", str(CAP))
        _clear_plans()
        yield
    _clear_plans()


def test_the_cap_is_in_effect():
    """Plans see 99 KB a block, and a configuration that needs more is refused: the "kv" partition's head-dim-128
    tile (115 KB) when asked for by name."""
    from cuflash import _launch

    assert _launch.smem_per_block(0) == CAP
    q, k, v = torch_inputs((1, 64, 2, 128), (1, 64, 2, 128), "float16")
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="at most 101376 bytes"):
        cuflash.flash_attn_backward(out, q, k, v, out, lse, warp_partition="kv")
    q, k, v = torch_inputs((1, 64, 2, 100), (1, 64, 2, 100), "float16")  # UA at head dim 128: none fits
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="at most 101376 bytes"):
        cuflash.flash_attn_backward(out, q, k, v, out, lse)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256, 40, 100, 160])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 3001), (127, 1000), (1000, 127), (600, 600)])
def test_forward(dtype, d, causal, sq, sk):
    run_case(2, sq, sk, 4, 2, d, dtype, causal, backend="auto")


@pytest.mark.parametrize("d", [32, 64, 96, 128, 40, 90])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 300), (300, 17), (257, 257)])
def test_backward(d, dtype, causal, sq, sk):
    check_grads(2, sq, sk, 4, 2, d, dtype, causal)


@pytest.mark.parametrize("dq_strategy,deterministic", [("atomic", False), ("seqpar", False), ("loop", False),
                                                       (None, True)])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_dq_strategies(d, dq_strategy, deterministic):
    check_grads(2, 300, 517, 8, 2, d, "bfloat16", True, dq_strategy=dq_strategy, deterministic=deterministic)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("opt", [OPTIONS[i] for i in (0, 1, 6, 9, 10)], ids=["w", "cw", "cap", "alibi", "all"])
def test_score_modifiers_forward_backward(d, opt):
    causal, window, cap, akind = opt
    check_backward(2, 257, 300, 4, 2, d, "float16", causal, window, cap, akind)


@pytest.mark.parametrize("d", [64, 128, 90])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_sequences(d, causal):
    q, k, v = packed_inputs(LENS_Q, LENS_K, 4, 2, d, "float16")
    check_varlen(q, k, v, LENS_Q, LENS_K, causal=causal)


@pytest.mark.parametrize("kernel", ["decode", "fwd_split"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("h,hk", [(32, 8), (32, 1)])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_decode(kernel, d, h, hk, num_splits):
    import torch

    b, s_cache = 2, 3001
    kc, vc = make_cache(b, s_cache, hk, d, "float16")
    seqlens = torch.tensor([3001, 1234], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda").to(torch.float16)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=num_splits,
                                               return_softmax_lse=True, kernel=kernel)
    check_decode(out, lse, q, kc, vc, seqlens.tolist(), False)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("page_size", [16, 256])
def test_decode_paged(d, page_size):
    c = Case(d=d, h=8, hk=2, sq=1, page_size=page_size, cap=700, seqlens=(650, 0, 17), seed=d)
    out, lse = c.run()
    c.check(out, lse, f"paged {page_size}")
