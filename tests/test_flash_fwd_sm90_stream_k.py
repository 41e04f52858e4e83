"""GPU: the Hopper forward's stream-K walk (cuda_src/flash_fwd_sm90.cu, Sm90FwdStreamK; cuflash._walk's workspace):
the whole waves but the last as the fixed walk's, the remaining (tile, K / V tile) pairs cut into one range per block,
a tile split between two blocks merged by the one that began it (grid_order "stream_k"). Against the float64
reference (outputs and LSE) on ragged tails, seqlen_q != seqlen_k, GQA, a single K / V tile and Q tiles whose last
warpgroups hold no row; bitwise the same over repeated launches and on concurrent streams (each its own workspace),
the flags left zero; the memoized plan at its key count and another; a launch captured into a CUDA graph walks in
fixed waves (bitwise the fixed walk's). Outputs poisoned (NaN) before each launch. Skipped off compute capability
9.0."""
import numpy as np
import pytest

from cuflash import _configs, _fwd_sm90, _walk, reference
from conftest import to_np, torch_inputs
from test_flash_fwd_sm90 import _check, _hopper  # noqa: F401 (_hopper: the autouse sm90 skip)
from test_flash_fwd_sm90_minb import _run
from test_flash_fwd_sm90_persist import on_streams

pytestmark = pytest.mark.gpu

VARIANTS = [(d, n) for d in sorted(_configs.SM90_FWD_PERSIST_VARIANTS) for n in _configs.SM90_FWD_PERSIST_VARIANTS[d]]
# (b, sq, sk, h, hk) at head dims with 128-row Q tiles (96, 128): 144, 288, 168 and 162 tiles on 132 blocks
CASES = [(2, 1000, 1500, 9, 3), (1, 3000, 2100, 12, 12), (3, 777, 901, 8, 2), (2, 1100, 100, 9, 9)]
CASES_64 = [(2, 1000, 1500, 16, 4), (1, 3000, 700, 12, 6)]  # 192-row tiles: 192 and 192 (last tiles of 40 / 120 rows)


def _sk(q, k, v, tile):
    """The forward with `tile` walking by stream-K (grid_order "stream_k": a ValueError where it cannot) into
    NaN-filled outputs; (out, lse)."""
    import torch

    from cuflash._validate import check_qkv

    qa, ka, va = check_qkv(q, k, v)
    out = torch.full_like(q, float("nan"))
    b, sq, h, _ = q.shape
    lse = torch.full((b, h, sq), float("nan"), device="cuda", dtype=torch.float32)
    o, l_ = _fwd_sm90.forward(qa, ka, va, None, False, "stream_k", out=out, lse=lse, tile=tile)
    assert o.data_ptr() == out.data_ptr() and l_.data_ptr() == lse.data_ptr()
    return out, lse


def _check_lse(lse, q, k, v):
    _, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, False)
    assert np.allclose(to_np(lse), ref_lse, atol=2e-4, rtol=0), float(np.abs(to_np(lse) - ref_lse).max())


def _flags_zero(stream) -> bool:
    """The first bytes of (device 0, stream)'s workspace -- the flags -- read back: all zero."""
    from cupy.cuda import runtime

    ptr = _walk._workspaces[_walk._stream_key(0, stream)][0]
    host = np.empty(_walk.SK_FLAG_BYTES // 4, np.int32)
    runtime.deviceSynchronize()
    runtime.memcpy(host.ctypes.data, ptr, host.nbytes, runtime.memcpyDeviceToHost)
    return not host.any()


@pytest.mark.parametrize("d,name", VARIANTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_against_reference(d, name, dtype):
    """Every persistent tile, stream-K, against the reference: outputs within the tests' bound of torch's error, the
    LSE within 2e-4; the flags of the stream's workspace zero after."""
    import torch

    t = _configs.sm90_fwd_persist_tiles(d)[name]
    for b, sq, sk, h, hk in (CASES_64 if d == 64 else CASES):
        q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype)
        out, lse = _sk(q, k, v, t)
        _check(out, q, k, v, False)
        _check_lse(lse, q, k, v)
    assert _flags_zero(torch.cuda.current_stream().cuda_stream)


@pytest.mark.parametrize("d,name", VARIANTS)
def test_repeats_bitwise(d, name):
    """Launches one after another give the same output and LSE bit for bit (each block's segments and merge order
    are fixed by its index). (Against the fixed walk the output is not bitwise: each part of a split tile rounds its
    probabilities to 16 bits against its own row max.)"""
    import torch

    t = _configs.sm90_fwd_persist_tiles(d)[name]
    b, sq, sk, h, hk = CASES_64[0] if d == 64 else CASES[0]
    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), "bfloat16")
    first, lse = _sk(q, k, v, t)
    for _ in range(3):
        again, lse2 = _sk(q, k, v, t)
        assert torch.equal(again, first) and torch.equal(lse2, lse)


def test_concurrent_streams():
    """One kernel launched stream-K on three streams at once (different tile counts, queued without waiting): each
    stream has its own workspace, so each output is bitwise that stream's launch alone, and every stream's flags are
    zero after."""
    t = _configs.sm90_fwd_persist_tiles(128)["persist n160"]
    cases = [torch_inputs((b, sq, h, 128), (b, sk, h, 128), "float16") for b, sq, sk, h in
             ((2, 1000, 1500, 9), (1, 3000, 2100, 12), (3, 1500, 1200, 7))]
    want = [_sk(q, k, v, t)[0] for q, k, v in cases]
    for s in on_streams(cases, want, lambda q, k, v: _sk(q, k, v, t)[0]):
        assert _flags_zero(s.cuda_stream)


def test_plan_on_a_stream_and_in_a_cuda_graph():
    """The memoized plan of stream-K (head dim 128, 1 x 17000 queries x 1200 keys x 8 heads: 1064 tiles, 8.1 waves)
    against the reference, the LSE too, at its own key count and at another (run_kv). Captured into a CUDA graph, the
    launch takes no workspace and walks in fixed waves: each replay on new inputs bitwise the fixed walk's output."""
    import torch

    from cuflash import _fwd
    from cuflash._validate import check_qkv

    shape_q, shape_kv = (1, 17000, 8, 128), (1, 1200, 8, 128)
    q, k, v = torch_inputs(shape_q, shape_kv, "float16")
    qa, ka, va = check_qkv(q, k, v)
    plan = _fwd_sm90.make_plan(qa, ka, va, None, False, "stream_k")
    assert plan.sk is not None
    out, lse = plan.run(qa.ptr, ka.ptr, va.ptr)
    _check(out, q, k, v, False)
    _check_lse(lse, q, k, v)
    plan.kv = _fwd.KvFields(plan, None, ka.shape, 1)
    k2, v2 = (torch.randn(1, 900, 8, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out2, lse2 = plan.run_kv(qa.ptr, k2.data_ptr(), v2.data_ptr(), tuple(k2.shape), k2.stride()[:3], v2.stride()[:3])
    _check(out2, q, k2, v2, False)
    _check_lse(lse2, q, k2, v2)
    t = _configs.sm90_fwd_tile(128, False, 1200)
    cap = torch.full_like(q, float("nan"))
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=side):
        _fwd_sm90.forward(qa, ka, va, None, False, "stream_k", out=cap, tile=t)
    for _ in range(2):
        fresh = torch_inputs(shape_q, shape_kv, "float16")
        for x, y in zip((q, k, v), fresh):
            x.copy_(y)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(cap, _run(q, k, v, False, t, grid_order="qtile"))


@pytest.mark.parametrize("d,sq,sk,h,hk", [(128, 1024, 1024, 20, 4), (128, 1152, 4096, 16, 2)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_configured_calls_take_stream_k(d, sq, sk, h, hk, dtype):
    """Where the configuration walks by stream-K (cuflash._configs.sm90_fwd_stream_k_auto: kernel head dim 128, at
    least SM90_FWD_SK_MIN_SEQLEN_K keys, whole Q tiles; 160 and 144 tiles on 132 blocks, GQA, seqlen_q !=
    seqlen_k): flash_attn_func's output against the reference, and bitwise the
    diagnostic grid_order "stream_k"'s on the same tile (so that the call did walk by stream-K); the stream's flags
    zero after; one row fewer (a ragged last Q tile) walks the fixed waves."""
    import torch

    import cuflash
    from cuflash._validate import check_qkv

    b = 1
    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype)
    qa, ka, va = check_qkv(q, k, v)
    _, _, fields, _ = _fwd_sm90.launch_setup(qa, ka, va, None, False, "auto", (sq * h * d, h * d, d))
    assert fields["walk_slot"] == _walk.STREAM_K
    out = cuflash.flash_attn_func(q, k, v)
    _check(out, q, k, v, False)
    t = _configs.sm90_fwd_tile(_configs.kernel_headdim(d, _configs.SM90_HEADDIMS), False, sk)
    assert torch.equal(out, _sk(q, k, v, t)[0])
    assert _flags_zero(torch.cuda.current_stream().cuda_stream)
    q1 = q[:, 1:].contiguous()
    qa1 = check_qkv(q1, k, v)[0]
    _, _, fields, _ = _fwd_sm90.launch_setup(qa1, ka, va, None, False, "auto", ((sq - 1) * h * d, h * d, d))
    assert fields["walk_slot"] != _walk.STREAM_K
    _check(cuflash.flash_attn_func(q1, k, v), q1, k, v, False)


def test_stream_k_where_it_cannot_run_is_a_value_error():
    """grid_order "stream_k" (diagnostics) on a launch it cannot take -- causal, or whole waves -- names why before any
    launch."""
    from cuflash._validate import check_qkv

    t = _configs.sm90_fwd_persist_tiles(128)["persist"]
    q, k, v = torch_inputs((1, 128 * 33, 4, 128), (1, 500, 4, 128), "float16")  # 132 tiles: one whole wave
    qa, ka, va = check_qkv(q, k, v)
    for causal in (False, True):
        with pytest.raises(ValueError, match="stream_k"):
            _fwd_sm90.forward(qa, ka, va, None, causal, "stream_k", tile=t)
