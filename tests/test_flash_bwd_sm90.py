"""GPU: the Hopper backward (cuda_src/flash_bwd_sm90.cu, backend="sm90") against the float64 reference with the
error rule of conftest.py (gradients within 3x torch's own low-precision error): head dims 40-128 (padded ones
included) and 136-256 (the column-split kernel), fp16 / bf16, causal and not, ragged tails and seqlen_q != seqlen_k both ways (rows that see no key:
zero gradients, no NaN), GQA / MQA, the three dQ strategies (atomic bulk reductions; "ordered": the same in KV-tile
order, and seqpar bulk stores, both bitwise reproducible), the score modifiers, strided views, the automatic choice (autograd takes it on sm90), the memoized
maps under changing pointers, the caller's stream and CUDA-graph capture. The same cases on the mma.sync kernels
are test_flash_bwd.py's and test_score_mods.py's. Skipped off compute capability 9.0."""
import numpy as np
import pytest

import cuflash
from cuflash import _bwd_sm90, _configs, _fwd_sm90, backward as bwd_mod, reference
from cuflash._launch import get_launcher, sm_count
from cuflash.backward import check_backward_inputs
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if _fwd_sm90.device_cc(0) != 90:
        pytest.skip("the sm90 kernels need a compute capability 9.0 GPU")


def lowp_grads(q, k, v, dout, scale, causal, window=(-1, -1), cap=0.0, alibi=None):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_attention_lowp(qq, kk, vv, scale, causal, window, cap, alibi).backward(dout)
    return qq.grad, kk.grad, vv.grad


def check(b, sq, sk, h, hk, d, dtype, causal, dq_strategy=None, deterministic=False, window=(-1, -1), cap=0.0,
          alibi=None, q_scale=1.0, views=None):
    """flash_attn_backward(backend="sm90") of a fresh random problem (views: (q, k, v) to use instead)."""
    import torch

    if views is None:
        q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype, scale=q_scale)
    else:
        q, k, v = views
    scale = d ** -0.5
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap,
                                          alibi_slopes=alibi, return_attn_probs=True)
    dout = torch.randn_like(out)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, dq_strategy=dq_strategy,
                                        deterministic=deterministic, window_size=window, softcap=cap,
                                        alibi_slopes=alibi, backend="sm90")
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), scale, causal, window, cap,
                                       None if alibi is None else alibi.double().cpu().numpy())
    lowp = lowp_grads(q, k, v, dout, scale, causal, window, cap, alibi)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), grads, lowp, ref):
        assert ours.shape == lp.shape and ours.dtype == lp.dtype
        assert not torch.isnan(ours).any(), name
        assert_close_to_ref(f"{name} (sm90, {dq_strategy})", ours, lp, r, factor=3.0)
    return (q, k, v, out, lse, dout), grads


def assert_same_to_rounding(got, base):
    """(dq, dk, dv) of two forms of the backward that add the same products in another order or grouping: equal within
    fp32 rounding (2^-7 of the largest element, at least 2^-7 x 1e-3)."""
    for nm, a, o in zip(("dq", "dk", "dv"), got, base):
        err = (a.float() - o.float()).abs().max().item()
        assert err <= 2 ** -7 * max(o.float().abs().max().item(), 1e-3), (nm, err)


# Ragged tails (no multiple of 64 or 128), one row, seqlen_q > seqlen_k (causal: the first rows see no key) and
# seqlen_q < seqlen_k, a problem exactly one tile, several KV and Q tiles.
SHAPES = [(1, 1), (17, 300), (300, 17), (128, 128), (257, 257), (1000, 700), (640, 1300)]


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_matches_reference(dtype, d, causal, sq, sk):
    check(2, sq, sk, 2, 2, d, dtype, causal)


@pytest.mark.parametrize("d", [40, 48, 72, 80, 104, 120])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_head_dims(d, causal):
    """Head dims below the compiled one: TMA zero-fills the columns past d, the stores skip them."""
    check(2, 333, 517, 4, 2, d, "bfloat16" if d % 16 else "float16", causal)


@pytest.mark.parametrize("h,hk", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(h, hk, d, causal):
    """A block loops over the query heads of its KV head: dK, dV summed in registers, no atomics."""
    check(2, 300, 451, h, hk, d, "float16", causal)


@pytest.mark.parametrize("dq_strategy", ["atomic", "ordered", "seqpar"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_dq_strategies(dq_strategy, causal, d):
    check(2, 700, 1100, 4, 2, d, "bfloat16", causal, dq_strategy=dq_strategy,
          deterministic=dq_strategy != "atomic")


@pytest.mark.parametrize("dq_strategy", [None, "ordered", "seqpar"])  # None: deterministic's default, "ordered"
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_is_bitwise(dq_strategy, d, causal):
    """The deterministic strategies repeat bitwise: "ordered" adds each Q tile's dQ partials in KV-tile order,
    "seqpar" stores each once and sums them in a fixed order (many KV tiles per Q tile and heads per KV head, so
    that the order matters)."""
    import torch

    (q, k, v, out, lse, dout), first = check(2, 513, 2100, 8, 2, d, "float16", causal, dq_strategy=dq_strategy,
                                             deterministic=True)
    for _ in range(3):
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                            dq_strategy=dq_strategy, backend="sm90")
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def _forced_order(monkeypatch, knob, order):
    """cuflash._bwd_sm90's order knob `knob` set to `order` for one test, fresh plans before and after."""
    monkeypatch.setattr(_bwd_sm90, knob, order)
    bwd_mod._PLANS.clear()
    yield order
    bwd_mod._PLANS.clear()


@pytest.fixture(params=["rot", "plain"])
def plain_order(request, monkeypatch):
    """"ordered" without a mask forced into each of its orders (cuflash._bwd_sm90.PLAIN_ORDER): ROT (block x visits
    Q tile x - s mod M at step s; the configuration's where a head's blocks run together) and the ascending one."""
    yield from _forced_order(monkeypatch, "PLAIN_ORDER",
                             {"rot": _configs.DQ_ORDER_ROT, "plain": _configs.DQ_ORDER_PLAIN}[request.param])


# KV tiles (N, 128 keys) against Q tiles (M: 128 rows at head dim 64, 64 above): N < M, N = M, N > M (KV tiles of one
# residue at the same step), one of each, ragged tails, GQA / MQA
@pytest.mark.parametrize("b,sq,sk,h,hk,d", [(2, 1, 1, 2, 2, 64), (2, 17, 300, 2, 2, 128), (2, 300, 17, 2, 2, 64),
                                            (1, 700, 130, 4, 2, 128), (2, 1000, 700, 8, 2, 64),
                                            (2, 640, 1300, 6, 3, 96), (1, 2100, 2100, 8, 1, 128),
                                            (1, 1024, 1024, 4, 4, 64), (1, 300, 2600, 4, 1, 64),
                                            (1, 513, 2100, 8, 2, 128)])
def test_ordered_no_mask(plain_order, b, sq, sk, h, hk, d):
    """The "ordered" kernels without a mask: bitwise repeatable, within the reference's error, and the plan's kernel
    is the order's."""
    import torch

    (q, k, v, out, lse, dout), first = check(b, sq, sk, h, hk, d, "float16", False, dq_strategy="ordered",
                                             deterministic=True)
    spec = _configs.sm90_bwd_spec("float16", _configs.kernel_headdim(d), False, order=plain_order)
    assert [p.launches[1][0] for p in bwd_mod._PLANS.values()] == [get_launcher(spec, q.device.index).ptr]
    for _ in range(3):
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True, backend="sm90")
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.fixture(params=["kv_desc", "q_desc", "heads_inner"])
def causal_order(request, monkeypatch):
    """"ordered" under the causal mask in the package's orders (KV tiles last first; with GQA the heads-inner walk,
    KV tiles ascending at each Q tile) and the alternative (Q tiles last first), forced through
    cuflash._bwd_sm90.CAUSAL_ORDER, fresh plans for each."""
    yield from _forced_order(monkeypatch, "CAUSAL_ORDER",
                             {"kv_desc": _configs.DQ_ORDER_KV_DESC, "q_desc": _configs.DQ_ORDER_Q_DESC,
                              "heads_inner": _configs.DQ_ORDER_HEADS_INNER}[request.param])


@pytest.mark.parametrize("b,sq,sk,h,hk,d", [(2, 1, 1, 2, 2, 64), (2, 17, 300, 2, 2, 128), (2, 300, 17, 2, 2, 64),
                                            (1, 700, 130, 4, 2, 128), (2, 1000, 700, 8, 2, 64),
                                            (2, 640, 1300, 6, 3, 96), (1, 2100, 2100, 8, 1, 128),
                                            (1, 3000, 4100, 16, 2, 128), (3, 500, 8000, 8, 2, 128)])
def test_ordered_causal(causal_order, b, sq, sk, h, hk, d):
    """The causal "ordered" kernels: ragged tails, seqlen_q != seqlen_k both ways (rows that see no key: zero dQ;
    KV tiles whose range begins past the first Q tiles), GQA / MQA; bitwise repeatable, and the plan's kernel is the
    order's."""
    ordered_causal_checked(b, sq, sk, h, hk, d, causal_order)


def ordered_causal_checked(b, sq, sk, h, hk, d, causal_order):
    """check() of causal "ordered" in `causal_order`, then: the plan's kernel is that order's (in its dispatch group),
    dQ is zero on the rows that see no key, and three repeats are bitwise equal."""
    import torch

    (q, k, v, out, lse, dout), first = check(b, sq, sk, h, hk, d, "float16", True, dq_strategy="ordered",
                                             deterministic=True)
    kd = _configs.kernel_headdim(d)
    blocks = -(-sk // _configs.sm90_bwd_tile(kd).block_n) * hk * b
    group = _configs.sm90_bwd_ordered_group(causal_order, kd, sk, h // hk, blocks, sm_count(q.device.index))
    spec = _configs.sm90_bwd_spec("float16", kd, True, order=causal_order, group=group)
    assert [p.launches[1][0] for p in bwd_mod._PLANS.values()] == [get_launcher(spec, q.device.index).ptr]
    if sq > sk:
        assert torch.count_nonzero(first[0][:, : sq - sk]) == 0
    for _ in range(3):
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, deterministic=True, backend="sm90")
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.fixture(params=[3, 8])
def causal_group(request, monkeypatch):
    """The causal "atomic" / "seqpar" kernels in a grouped dispatch order (cuflash._bwd_sm90.CAUSAL_GROUP: the
    longest KV tiles first within groups of that many (KV head, batch) pairs) with the heads-outer walk, fresh plans for
    each."""
    monkeypatch.setattr(_bwd_sm90, "CAUSAL_GROUP", request.param)
    monkeypatch.setattr(_bwd_sm90, "HEADS_INNER", False)
    bwd_mod._PLANS.clear()
    yield request.param
    bwd_mod._PLANS.clear()


@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d", [(2, 17, 300, 2, 2, 128), (2, 300, 17, 2, 2, 64), (1, 700, 130, 4, 2, 96),
                                            (4, 1100, 1300, 8, 4, 64), (3, 2100, 2100, 8, 1, 128)])
def test_grouped_dispatch_causal(causal_group, dq_strategy, b, sq, sk, h, hk, d):
    """The grouped dispatch order (the kernel's GROUP): ragged tails, seqlen_q != seqlen_k both ways, GQA / MQA,
    a last group with fewer pairs, more blocks than SMs (4 x 4 pairs x 11 KV tiles); the plan's kernel is the
    group's."""
    (q, k, v, out, lse, dout), _ = check(b, sq, sk, h, hk, d, "float16", True, dq_strategy=dq_strategy)
    spec = _configs.sm90_bwd_spec("float16", _configs.kernel_headdim(d), True, group=causal_group)
    # ("seqpar" plans are not kept in _PLANS: the plan of the same call, made again)
    plans = (list(bwd_mod._PLANS.values()) if dq_strategy == "atomic" else
             [bwd_mod._make_plan(*check_backward_inputs(dout, q, k, v, out, lse), None, True, dq_strategy, False, None,
                                 "auto", None, backend="sm90")])
    assert [p.launches[1][0] for p in plans] == [get_launcher(spec, q.device.index).ptr]


@pytest.mark.parametrize("group", [0, 3])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,dtype", [(2, 17, 300, 2, 2, 128, "float16"), (2, 300, 17, 4, 2, 64, "bfloat16"),
                                                  (1, 700, 130, 6, 2, 96, "float16"),
                                                  (2, 1100, 1300, 8, 2, 128, "bfloat16"),
                                                  (2, 640, 1300, 8, 1, 48, "float16"),
                                                  (1, 2100, 2100, 16, 2, 128, "float16"),
                                                  (2, 300, 700, 4, 2, 256, "bfloat16"),
                                                  (1, 530, 530, 3, 1, 200, "float16")])
def test_heads_inner_walk(monkeypatch, group, b, sq, sk, h, hk, d, dtype):
    """The causal kernels' heads-inner walk (DQ_ORDER_HEADS_INNER: Q tiles last first, the KV head's query heads
    inner; cuflash._bwd_sm90.HEADS_INNER) in the launch's and a grouped dispatch order, at every kernel head dim (the
    column-split kernel's at 256; 48 and 200 padded): against the float64 reference with "atomic"; the plan's kernel
    is the walk's; with "seqpar" dQ bitwise that of the heads-outer walk (each KV tile's partial is the same products)
    and dK, dV equal to fp32 rounding (the same products summed in another order); rows that see no key: zero dQ."""
    import torch

    monkeypatch.setattr(_bwd_sm90, "HEADS_INNER", True)
    monkeypatch.setattr(_bwd_sm90, "CAUSAL_GROUP", group)
    bwd_mod._PLANS.clear()
    (q, k, v, out, lse, dout), got = check(b, sq, sk, h, hk, d, dtype, True, dq_strategy="atomic")
    kd = _configs.kernel_headdim(d)
    spec = _configs.sm90_bwd_spec(dtype, kd, True, order=_configs.DQ_ORDER_HEADS_INNER, group=group)
    assert [p.launches[1][0] for p in bwd_mod._PLANS.values()] == [get_launcher(spec, q.device.index).ptr]
    if sq > sk:
        assert torch.count_nonzero(got[0][:, : sq - sk]) == 0
    seqpar = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dq_strategy="seqpar", backend="sm90")
    monkeypatch.setattr(_bwd_sm90, "HEADS_INNER", False)
    bwd_mod._PLANS.clear()
    outer = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, dq_strategy="seqpar", backend="sm90")
    bwd_mod._PLANS.clear()
    assert torch.equal(seqpar[0], outer[0])
    assert_same_to_rounding(seqpar, outer)
    assert_same_to_rounding(got, outer)


@pytest.fixture(params=[None, 3], ids=["grid-sms", "grid-3"])
def persistent(request, monkeypatch):
    """The persistent form forced on (cuflash._bwd_sm90.PERSIST) with a grid of one block per SM, or of 3 blocks that
    walk every tile between them; fresh plans for each."""
    monkeypatch.setattr(_bwd_sm90, "PERSIST", True)
    monkeypatch.setattr(_bwd_sm90, "STREAM_K", False)  # (the fixed walk: test_stream_k_form takes the other)
    monkeypatch.setattr(_bwd_sm90, "HEADS_INNER", False)  # (one block per tile in the persistent form's walk)
    monkeypatch.setattr(_bwd_sm90, "PERSIST_MAX_GRID", request.param)
    bwd_mod._PLANS.clear()
    yield request.param
    bwd_mod._PLANS.clear()


def _main_launch(dout, q, k, v, out, lse, causal, dq_strategy):
    """The (kernel, grid) of the plan's main kernel for this call (made again: "seqpar" plans are not kept)."""
    plan = bwd_mod._make_plan(*check_backward_inputs(dout, q, k, v, out, lse), None, causal, dq_strategy, False, None,
                              "auto", None, backend="sm90")
    return plan.launches[1][0], tuple(plan.launches[1][1:4])


# ragged tails, seqlen_q != seqlen_k both ways (causal: rows that see no key), GQA / MQA, padded head dims (48, 120
# and 200 run the 64, 128 and 256 kernels), more tiles than the grid's blocks (3 x 17 KV tiles; 2 x 8 x 17; the
# column-split kernel's 64-key tiles: 2 x 2 x 33), a single tile
PERSIST_CASES = [(2, 17, 300, 2, 2, 128), (2, 300, 17, 2, 2, 64), (1, 700, 130, 4, 2, 120), (1, 1, 1, 1, 1, 64),
                 (3, 1100, 2100, 8, 1, 128), (2, 256, 2100, 8, 8, 48), (1, 129, 257, 6, 3, 128),
                 (2, 300, 2100, 4, 2, 256), (1, 77, 130, 3, 1, 200), (1, 1, 1, 1, 1, 256)]


@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,h,hk,d", PERSIST_CASES)
def test_persistent_form(persistent, dq_strategy, causal, b, sq, sk, h, hk, d):
    """The persistent form (the kernel's PERSIST) against the float64 reference; its plan launches the persistent
    kernel on min(tiles, SMs, the cap) blocks; with "seqpar" its gradients are bitwise those of one block per tile
    (each KV tile stores its own dQ partial and the same products run in the same order, so a stage, buffer or
    hand-off taken out of turn from one tile to the next would show)."""
    import torch

    from cuflash._launch import sm_count

    (q, k, v, out, lse, dout), got = check(b, sq, sk, h, hk, d, "bfloat16" if d == 120 else "float16", causal,
                                           dq_strategy=dq_strategy)
    kd = _configs.kernel_headdim(d)
    name, grid = _main_launch(dout, q, k, v, out, lse, causal, dq_strategy)
    spec = _configs.sm90_bwd_spec(str(q.dtype).split(".")[1], kd, causal, _configs.sm90_bwd_persist_tile(kd))
    assert name == get_launcher(spec, q.device.index).ptr
    tiles = -(-sk // _configs.sm90_bwd_tile(kd).block_n) * hk * b
    cap = persistent or sm_count(q.device.index)
    assert grid == (min(tiles, sm_count(q.device.index), cap), 1, 1)
    if dq_strategy == "seqpar":
        _bwd_sm90.PERSIST = False
        bwd_mod._PLANS.clear()
        one = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, dq_strategy="seqpar", backend="sm90")
        assert _main_launch(dout, q, k, v, out, lse, causal, "seqpar")[1] == (tiles // hk // b, hk, b)
        assert all(torch.equal(a, o) for a, o in zip(got, one))


def test_persistent_form_is_not_taken_where_it_cannot_run(monkeypatch):
    """Forced on, the persistent form still leaves "ordered", the score modifiers at the head dims without a persistent
    modifier kernel (128, and the column-split kernel's 256) and head dim 96 to the kernels of one block per tile (the
    plan's grid: KV tiles, KV heads, batch)."""
    import torch

    monkeypatch.setattr(_bwd_sm90, "PERSIST", True)
    for d, kw in ((64, dict(dq_strategy="ordered", deterministic=True)), (128, dict(window_size=(100, 0))),
                  (96, {}), (256, dict(window_size=(100, 0)))):
        q, k, v = torch_inputs((1, 300, 4, d), (1, 300, 4, d), "float16")
        win = kw.get("window_size", (-1, -1))
        out, lse, _ = cuflash.flash_attn_func(q, k, v, window_size=win, return_attn_probs=True)
        bwd_mod._PLANS.clear()
        cuflash.flash_attn_backward(torch.randn_like(out), q, k, v, out, lse, backend="sm90", **kw)
        (plan,) = bwd_mod._PLANS.values()
        assert plan.launches[1][1:4] == (-(-300 // _configs.sm90_bwd_tile(d).block_n), 4, 1), (d, kw)
    bwd_mod._PLANS.clear()


@pytest.fixture
def m80(monkeypatch):
    """The 80-row Q tiles forced on (cuflash._bwd_sm90.M80) where they can run; fresh plans."""
    monkeypatch.setattr(_bwd_sm90, "M80", True)
    bwd_mod._PLANS.clear()
    yield
    bwd_mod._PLANS.clear()


# Head dim 128 without a mask: ragged tails (no multiple of 80 or 128: 1, 17, 79, 81, 161, 300, 1000, 1100), exactly one
# and two Q tiles (80, 160), seqlen_q != seqlen_k both ways, GQA / MQA, padded head dims 104 and 120 (the 128 kernel:
# padding columns), several batch elements and heads whose last Q tile is partial (its padding rows stay within the
# head's rows of the workspace), more blocks than SMs (3 x 8 x 17).
M80_CASES = [(2, 17, 300, 2, 2, 128), (2, 300, 17, 2, 2, 128), (1, 1, 1, 1, 1, 128), (1, 80, 160, 2, 1, 128),
             (2, 161, 700, 4, 2, 120), (1, 1000, 640, 8, 1, 104), (3, 1100, 2100, 8, 8, 128), (2, 79, 81, 6, 3, 128),
             (1, 160, 80, 3, 3, 128)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d", M80_CASES)
def test_m80_form(m80, dtype, dq_strategy, b, sq, sk, h, hk, d):
    """The 80-row Q tiles (the kernel's BLOCK_M = 80: dQ^T = K^T dS^T, the T accumulator layout and its convert kernel)
    against the float64 reference; its plan launches the 80-row kernel (one block per tile) and the T convert; its
    gradients equal the 64-row tile's within fp32 rounding and, with "seqpar", bitwise over repeats."""
    import torch

    (q, k, v, out, lse, dout), got = check(b, sq, sk, h, hk, d, dtype, False, dq_strategy=dq_strategy)
    plan = bwd_mod._make_plan(*check_backward_inputs(dout, q, k, v, out, lse), None, False, dq_strategy, False, None,
                              "auto", None, backend="sm90")
    dev = q.device.index
    assert plan.launches[1][0] == get_launcher(_configs.sm90_bwd_spec(dtype, 128, False, _configs.sm90_bwd_m80_tile(128)),
                                               dev).ptr
    assert tuple(plan.launches[1][1:4]) == (-(-sk // 128), hk, b)
    assert plan.launches[2][0] == get_launcher(_configs.bwd_convert_t_spec(dtype, 128, 80), dev).ptr
    again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, dq_strategy=dq_strategy, backend="sm90")
    _bwd_sm90.M80 = False
    bwd_mod._PLANS.clear()
    base = cuflash.flash_attn_backward(dout, q, k, v, out, lse, dq_strategy=dq_strategy, backend="sm90")
    torch.cuda.synchronize()
    if dq_strategy == "seqpar":
        assert all(torch.equal(a, o) for a, o in zip(got, again))
    assert_same_to_rounding(got, base)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d", M80_CASES)
def test_m80_persistent_form(m80, persistent, dtype, dq_strategy, b, sq, sk, h, hk, d):
    """The 80-row Q tiles' persistent form (M80 and PERSIST forced: the kernel's BLOCK_M = 80 with PERSIST, its loads
    walked by a whole warp) against the float64 reference; its plan launches that kernel on min(tiles, SMs, the cap)
    blocks and the T convert; its gradients equal one block per tile's of 80 rows bitwise with "seqpar" (each KV tile's
    products in the same order, its own dQ partial) and within fp32 rounding with "atomic"."""
    import torch

    from cuflash._launch import sm_count

    (q, k, v, out, lse, dout), got = check(b, sq, sk, h, hk, d, dtype, False, dq_strategy=dq_strategy)
    plan = bwd_mod._make_plan(*check_backward_inputs(dout, q, k, v, out, lse), None, False, dq_strategy, False, None,
                              "auto", None, backend="sm90")
    dev = q.device.index
    assert plan.launches[1][0] == get_launcher(
        _configs.sm90_bwd_spec(dtype, 128, False, _configs.sm90_bwd_m80_tile(128, True)), dev).ptr
    tiles = -(-sk // 128) * hk * b
    assert tuple(plan.launches[1][1:4]) == (min(tiles, sm_count(dev), persistent or sm_count(dev)), 1, 1)
    assert plan.launches[2][0] == get_launcher(_configs.bwd_convert_t_spec(dtype, 128, 80), dev).ptr
    _bwd_sm90.PERSIST = False
    bwd_mod._PLANS.clear()
    one = cuflash.flash_attn_backward(dout, q, k, v, out, lse, dq_strategy=dq_strategy, backend="sm90")
    assert _main_launch(dout, q, k, v, out, lse, False, dq_strategy) == (
        get_launcher(_configs.sm90_bwd_spec(dtype, 128, False, _configs.sm90_bwd_m80_tile(128)), dev).ptr,
        (tiles // hk // b, hk, b))
    torch.cuda.synchronize()
    if dq_strategy == "seqpar":
        assert all(torch.equal(a, o) for a, o in zip(got, one))
    assert_same_to_rounding(got, one)


def test_m80_form_is_not_taken_where_it_cannot_run(monkeypatch):
    """Forced on, the 80-row tiles still leave the causal mask, the score modifiers, "ordered" and the other head dims
    to the configured kernels (their Q-tile maps: 64 or 128 rows), and still give the reference's gradients there."""
    import torch

    monkeypatch.setattr(_bwd_sm90, "M80", True)
    for d, kw in ((128, dict(causal=True)), (128, dict(window_size=(100, 0))), (128, dict(softcap=5.0)),
                  (128, dict(dq_strategy="ordered", deterministic=True)), (64, {}), (96, {})):
        bwd_mod._PLANS.clear()
        causal, win, cap = kw.get("causal", False), kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0)
        check(1, 300, 300, 4, 4, d, "float16", causal, dq_strategy=kw.get("dq_strategy"),
              deterministic=kw.get("deterministic", False), window=win, cap=cap)
        (plan,) = bwd_mod._PLANS.values()
        assert plan.launches[1][0] != get_launcher(
            _configs.sm90_bwd_spec("float16", 128, False, _configs.sm90_bwd_m80_tile(128)), 0).ptr, (d, kw)
        assert plan.launches[2][0] != get_launcher(_configs.bwd_convert_t_spec("float16", 128, 80), 0).ptr, (d, kw)
    bwd_mod._PLANS.clear()
    torch.cuda.synchronize()


@pytest.fixture(params=[None, 5, 3], ids=["grid-sms", "grid-5", "grid-3"])
def stream_k(request, monkeypatch):
    """Stream-K forced on (cuflash._bwd_sm90.STREAM_K) with a grid of one block per SM, or of 5 or 3 blocks, so that
    small problems have more tiles than blocks, and the persistent form where it cannot run; fresh plans for each."""
    monkeypatch.setattr(_bwd_sm90, "STREAM_K", True)
    monkeypatch.setattr(_bwd_sm90, "PERSIST", True)
    monkeypatch.setattr(_bwd_sm90, "PERSIST_MAX_GRID", request.param)
    bwd_mod._PLANS.clear()
    yield request.param
    bwd_mod._PLANS.clear()


# Without a mask: ragged tails, seqlen_q > and < seqlen_k, one query row, GQA / MQA (8 query heads per KV head: a
# tile's iterations run over several heads, and a split can fall inside one), padded head dims 48, 120 and 200, one
# iteration per tile (the parts are whole tiles), more tiles than SMs (272, 2016 and, at head dim 200, 136 tiles on
# the full grid), tile counts that are a multiple of the grid (9 on 3 blocks: the fixed walk's kernel), and the
# column-split kernel (head dims 200 and 256: 64-key tiles, the rotated Q-tile walk).
SK_CASES = [(2, 300, 2100, 4, 2, 128), (3, 1100, 2100, 8, 1, 128), (2, 256, 2100, 8, 8, 48), (1, 700, 130, 4, 2, 120),
            (1, 129, 257, 6, 3, 128), (4, 64, 8000, 8, 8, 64), (1, 1, 1000, 2, 1, 64), (2, 1000, 300, 4, 4, 128),
            (1, 2000, 700, 8, 1, 64), (1, 700, 1000, 4, 2, 256), (2, 130, 4300, 2, 1, 200)]


@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar"])
@pytest.mark.parametrize("b,sq,sk,h,hk,d", SK_CASES)
def test_stream_k_form(stream_k, dq_strategy, b, sq, sk, h, hk, d):
    """The stream-K form (the kernel's SK) against the float64 reference wherever it can run (more tiles than blocks,
    a part-empty last wave), the fixed walk's persistent kernel elsewhere; with "seqpar" bitwise equal over repeats
    (a split tile's two parts are added in one order), and equal to the fixed walk within fp32 rounding."""
    import torch

    from cuflash._launch import sm_count

    dtype = "bfloat16" if d == 120 else "float16"
    (q, k, v, out, lse, dout), got = check(b, sq, sk, h, hk, d, dtype, False, dq_strategy=dq_strategy)
    kd = _configs.kernel_headdim(d)
    name, grid = _main_launch(dout, q, k, v, out, lse, False, dq_strategy)
    tiles = -(-sk // _configs.sm90_bwd_tile(kd).block_n) * hk * b
    g = min(tiles, sm_count(q.device.index), stream_k or tiles)
    assert grid == (g, 1, 1)
    sk_on = tiles > g and tiles % g != 0
    tile = _configs.sm90_bwd_stream_k_tile(kd) if sk_on else _configs.sm90_bwd_persist_tile(kd)
    assert name == get_launcher(_configs.sm90_bwd_spec(dtype, kd, False, tile), q.device.index).ptr
    again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, dq_strategy=dq_strategy, backend="sm90")
    _bwd_sm90.STREAM_K = False
    bwd_mod._PLANS.clear()
    fixed = cuflash.flash_attn_backward(dout, q, k, v, out, lse, dq_strategy=dq_strategy, backend="sm90")
    torch.cuda.synchronize()
    if dq_strategy == "seqpar":
        assert all(torch.equal(a, o) for a, o in zip(got, again))
        if not sk_on:
            assert all(torch.equal(a, o) for a, o in zip(got, fixed))
    assert_same_to_rounding(got, fixed)


def test_stream_k_graph_capture_walks_whole_tiles(monkeypatch):
    """Captured into a CUDA graph, a stream-K plan takes no workspace and its kernel walks whole tiles: the replay on
    new inputs matches the reference, with dK and dV bitwise those of the fixed walk's eager call (dQ's atomic
    additions come in any order); eager calls on the same stream before and after the capture take stream-K (dK, dV
    bitwise equal over repeats: the flags are left zero and a split tile's two parts are added in one order; not
    bitwise the fixed walk's)."""
    import torch

    monkeypatch.setattr(_bwd_sm90, "STREAM_K", True)
    monkeypatch.setattr(_bwd_sm90, "PERSIST", True)
    monkeypatch.setattr(_bwd_sm90, "PERSIST_MAX_GRID", 5)
    bwd_mod._PLANS.clear()
    shape_q, shape_k = (2, 1000, 4, 128), (2, 2100, 2, 128)  # 68 tiles on 5 blocks
    (q, k, v, out, lse, dout), _ = check(2, 1000, 2100, 4, 2, 128, "float16", False, dq_strategy="atomic")
    static = [dout, q, k, v, out, lse]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuflash.flash_attn_backward(*static, dq_strategy="atomic", backend="sm90")  # (warm: the plan and workspace)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = cuflash.flash_attn_backward(*static, dq_strategy="atomic", backend="sm90")
    q2, k2, v2 = torch_inputs(shape_q, shape_k, "float16")
    out2, lse2, _ = cuflash.flash_attn_func(q2, k2, v2, return_attn_probs=True)
    fresh = [torch.randn_like(out2), q2, k2, v2, out2, lse2]
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    scale = 128 ** -0.5
    ref = reference.attention_backward(*(to_np(x) for x in fresh[:4]), scale, False)
    lowp = lowp_grads(q2, k2, v2, fresh[0], scale, False)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), got, lowp, ref):
        assert_close_to_ref(name + " stream-K graph", ours, lp, r, factor=3.0)
    eager = cuflash.flash_attn_backward(*fresh, dq_strategy="atomic", backend="sm90")
    again = cuflash.flash_attn_backward(*fresh, dq_strategy="atomic", backend="sm90")
    _bwd_sm90.STREAM_K = False
    bwd_mod._PLANS.clear()
    fixed = cuflash.flash_attn_backward(*fresh, dq_strategy="atomic", backend="sm90")
    torch.cuda.synchronize()
    assert all(torch.equal(a, o) for a, o in zip(got[1:], fixed[1:]))
    assert all(torch.equal(a, o) for a, o in zip(eager[1:], again[1:]))
    assert not all(torch.equal(a, o) for a, o in zip(eager[1:], fixed[1:]))  # (the eager calls split tiles)
    bwd_mod._PLANS.clear()


def deterministic_matches_atomic(seqlen, d, causal):
    """One head of `seqlen` keys and queries, bf16: deterministic=True's gradients against "atomic"'s to fp32 rounding
    (2^-6 of the largest element), then bitwise over a repeat."""
    import torch

    q, k, v = torch_inputs((1, seqlen, 1, d), (1, seqlen, 1, d), "bfloat16")
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    ref = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, dq_strategy="atomic", backend="sm90")
    got = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, backend="sm90")
    torch.cuda.synchronize()
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        err = (a.float() - r.float()).abs().max().item()
        assert err <= 2 ** -6 * r.float().abs().max().item(), (name, err)
    again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, backend="sm90")
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_ordered_causal_more_kv_tiles_than_sms(causal_order):
    """133 KV tiles of one head (more blocks than the H200's 132 SMs hold at once): every block's wait is on one
    that started before it, so the grid finishes; the gradients match the atomic strategy's to fp32 rounding."""
    deterministic_matches_atomic(17000, 64, True)


def test_ordered_is_refused_where_it_cannot_run():
    import torch

    q, k, v = torch_inputs((1, 200, 2, 64), (1, 200, 2, 64), "float16")
    out, lse, _ = cuflash.flash_attn_func(q, k, v, window_size=(50, 0), return_attn_probs=True)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="ordered"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, window_size=(50, 0), dq_strategy="ordered")
    with pytest.raises(ValueError, match="ordered"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, dq_strategy="ordered", backend="sm80")
    # with the modifiers, deterministic=True takes seqpar (bitwise too)
    a = cuflash.flash_attn_backward(dout, q, k, v, out, lse, window_size=(50, 0), deterministic=True)
    b = cuflash.flash_attn_backward(dout, q, k, v, out, lse, window_size=(50, 0), deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---- head dim 256: the column-split kernel (64-key tiles; each consumer holds dK, dV of half the columns) ----------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_headdim_256(dtype, causal, sq, sk):
    check(2, sq, sk, 2, 2, 256, dtype, causal)


@pytest.mark.parametrize("d", [136, 160, 200, 248])
@pytest.mark.parametrize("causal", [False, True])
def test_headdim_256_padded(d, causal):
    """Head dims 136-248 on the 256 kernel: TMA zero-fills the columns past d; consumer 1's columns begin at 128, so
    its dK / dV stores keep d - 128 of them."""
    check(2, 333, 517, 4, 2, d, "bfloat16" if d % 16 else "float16", causal)


@pytest.mark.parametrize("h,hk", [(8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_headdim_256_gqa(h, hk, causal):
    check(2, 300, 451, h, hk, 256, "float16", causal)


@pytest.fixture
def split_ordered(monkeypatch):
    """The column-split kernel's "ordered" turned on (cuflash._bwd_sm90.SPLIT_ORDERED), fresh plans before and after."""
    yield from _forced_order(monkeypatch, "SPLIT_ORDERED", True)


@pytest.mark.parametrize("dq_strategy", ["atomic", "ordered", "seqpar"])
@pytest.mark.parametrize("causal", [False, True])
def test_headdim_256_dq_strategies(dq_strategy, causal, monkeypatch):
    """Non-causal blocks of "atomic" / "seqpar" start at Q tile n_block % num_m (wrapping), those of "ordered"
    (turned on) at Q tile 0: many KV tiles over few Q tiles and the other way."""
    if dq_strategy == "ordered":
        monkeypatch.setattr(_bwd_sm90, "SPLIT_ORDERED", True)
    bwd_mod._PLANS.clear()
    check(2, 700, 1100, 4, 2, 256, "bfloat16", causal, dq_strategy=dq_strategy, deterministic=dq_strategy != "atomic")
    check(1, 1500, 200, 2, 2, 256, "float16", causal, dq_strategy=dq_strategy, deterministic=dq_strategy != "atomic")


@pytest.mark.parametrize("split_on", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_headdim_256_deterministic_is_bitwise(split_on, causal, monkeypatch):
    """deterministic=True at head dim 256 takes seqpar, or "ordered" once turned on (the column-split kernel's
    consumer warps take each Q tile's turns): bitwise repeats (many KV tiles per Q tile and heads per KV head)."""
    import torch

    monkeypatch.setattr(_bwd_sm90, "SPLIT_ORDERED", split_on)
    bwd_mod._PLANS.clear()
    (q, k, v, out, lse, dout), first = check(2, 513, 1100, 8, 2, 256, "float16", causal, deterministic=True)
    plan = bwd_mod._make_plan(*check_backward_inputs(dout, q, k, v, out, lse), None, causal, None, True, None, "auto")
    assert (plan.backend, plan.strategy) == ("sm90", "ordered" if split_on else "seqpar")
    for _ in range(3):
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, backend="sm90")
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    bwd_mod._PLANS.clear()


@pytest.fixture(params=["kv_desc", "heads_inner"])
def causal_order_256(request, monkeypatch):
    """The column-split kernel's causal "ordered" orders (KV tiles last first; the heads-inner walk, KV tiles
    ascending at each Q tile), turned on and forced through cuflash._bwd_sm90.CAUSAL_ORDER, fresh plans for each."""
    monkeypatch.setattr(_bwd_sm90, "SPLIT_ORDERED", True)
    yield from _forced_order(monkeypatch, "CAUSAL_ORDER", {"kv_desc": _configs.DQ_ORDER_KV_DESC,
                                                           "heads_inner": _configs.DQ_ORDER_HEADS_INNER}[request.param])


# 64-key KV tiles (N) against 64-row Q tiles (M): N < M, N = M, N > M, ragged tails, sq != sk both ways (rows that see
# no key), GQA / MQA, a padded head dim
ORDERED_256 = [(2, 1, 1, 2, 2, 256), (2, 17, 300, 2, 2, 256), (2, 300, 17, 2, 2, 256), (1, 700, 130, 4, 2, 256),
               (2, 640, 1300, 6, 3, 256), (1, 1100, 1100, 4, 1, 256), (1, 333, 517, 4, 2, 200)]


@pytest.mark.parametrize("b,sq,sk,h,hk,d", ORDERED_256)
def test_ordered_headdim_256_causal(causal_order_256, b, sq, sk, h, hk, d):
    """The column-split kernel's causal "ordered": within the reference's error, zero dQ on rows that see no key,
    bitwise repeatable, and the plan's kernel is the order's."""
    ordered_causal_checked(b, sq, sk, h, hk, d, causal_order_256)


@pytest.mark.parametrize("b,sq,sk,h,hk,d", ORDERED_256)
def test_ordered_headdim_256_no_mask(split_ordered, plain_order, b, sq, sk, h, hk, d):
    """The column-split kernel's "ordered" without a mask in both orders (the plain kernel: every block from Q tile 0,
    KV tiles ascending; ROT: block x from Q tile x mod M down, turns in (step, KV tile) order; at most 21 KV tiles
    here, resident together): within the reference's error and bitwise repeatable."""
    import torch

    (q, k, v, out, lse, dout), first = check(b, sq, sk, h, hk, d, "bfloat16", False, dq_strategy="ordered",
                                             deterministic=True)
    spec = _configs.sm90_bwd_spec("bfloat16", 256, False, order=plain_order)
    assert [p.launches[1][0] for p in bwd_mod._PLANS.values()] == [get_launcher(spec, q.device.index).ptr]
    for _ in range(3):
        again = cuflash.flash_attn_backward(dout, q, k, v, out, lse, deterministic=True, backend="sm90")
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("causal", [False, True])
def test_ordered_headdim_256_more_kv_tiles_than_sms(split_ordered, causal):
    """150 KV tiles of 64 keys in one head (more blocks than the GPU holds at once): every warp's wait is on the same
    warp of a block that started before its own, so the grid finishes; the gradients match "atomic"'s to fp32
    rounding, and repeat bitwise."""
    deterministic_matches_atomic(9600, 256, causal)


def test_headdim_256_ordered_refused_and_modifiers_on_sm90():
    """"ordered" with a score modifier at head dim 256 (as at every head dim, "ordered" runs without modifiers):
    backend="sm90" names why; the score modifiers run on the column-split kernel (auto's plan is the sm90 one)."""
    import torch

    q, k, v = torch_inputs((1, 200, 2, 256), (1, 200, 2, 256), "float16")
    out, lse, _ = cuflash.flash_attn_func(q, k, v, softcap=5.0, return_attn_probs=True)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="ordered"):
        cuflash.flash_attn_backward(dout, q, k, v, out, lse, softcap=5.0, dq_strategy="ordered", backend="sm90")
    bwd_mod._PLANS.clear()
    got = cuflash.flash_attn_backward(dout, q, k, v, out, lse, softcap=5.0)
    assert [p.backend for p in bwd_mod._PLANS.values()] == ["sm90"]
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), 256 ** -0.5, False, (-1, -1), 5.0)
    lowp = lowp_grads(q, k, v, dout, 256 ** -0.5, False, cap=5.0)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), got, lowp, ref):
        assert_close_to_ref(name + " d256 softcap (sm90)", ours, lp, r, factor=3.0)


def test_headdim_256_graph_capture_and_no_key_rows():
    """A captured head-dim-256 backward replayed on new inputs; causal rows that see no key: dQ exactly 0."""
    import torch

    (q, k, v, out, lse, dout), (dq, dk, dv) = check(1, 700, 130, 2, 2, 256, "bfloat16", True)
    assert torch.count_nonzero(dq[:, : 700 - 130]) == 0
    assert np.isfinite(to_np(dk)).all() and np.isfinite(to_np(dv)).all()
    static = [dout, q, k, v, out, lse]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = cuflash.flash_attn_backward(*static, causal=True, backend="sm90")
    q2, k2, v2 = torch_inputs((1, 700, 2, 256), (1, 130, 2, 256), "bfloat16")
    out2, lse2, _ = cuflash.flash_attn_func(q2, k2, v2, causal=True, return_attn_probs=True)
    fresh = [torch.randn_like(out2), q2, k2, v2, out2, lse2]
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    ref = reference.attention_backward(*(to_np(x) for x in fresh[:4]), 256 ** -0.5, True)
    lowp = lowp_grads(q2, k2, v2, fresh[0], 256 ** -0.5, True)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), got, lowp, ref):
        assert_close_to_ref(name + " d256 graph", ours, lp, r, factor=3.0)


def test_long_sequences_wrap_the_stage_ring():
    """Many Q tiles per block (the Q / dO stages and the two dS^T buffers reused many times) and many KV tiles."""
    check(1, 4096, 4096, 2, 1, 128, "bfloat16", True)
    check(1, 3000, 5000, 2, 2, 64, "float16", False)
    check(1, 3000, 2500, 2, 1, 256, "bfloat16", False)


OPTIONS = [((-1, -1), 0.0, None, False), ((100, 0), 0.0, None, False), ((64, 64), 0.0, None, False),
           ((-1, -1), 8.0, None, False), ((-1, -1), 0.0, "h", True), ((50, -1), 5.0, "bh", False)]


@pytest.mark.parametrize("window,cap,akind,causal", OPTIONS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(300, 517), (517, 300)])
def test_score_modifiers(window, cap, akind, causal, d, sq, sk):
    """The MOD_SCORE kernel: window bands (tiles outside skipped, edges masked), soft-cap (its derivative in dS; at
    head dim 256 handed from one consumer to the other through the dS^T buffer), ALiBi (per query head of a KV
    head)."""
    import torch

    b, h = 2, 4
    alibi = None
    if akind is not None:
        shape = (h,) if akind == "h" else (b, h)
        alibi = torch.rand(shape, device="cuda", dtype=torch.float32) * 0.5
    check(b, sq, sk, h, 2, d, "float16", causal, window=window, cap=cap, alibi=alibi, q_scale=3.0 if cap else 1.0)


def test_strided_views():
    """q, k, v as column slices of wider tensors (row strides of whole 16-byte units): read in place by TMA."""
    import torch

    big = torch.randn(2, 300, 4, 3 * 96, device="cuda", dtype=torch.float16)
    q, k, v = big[..., :80], big[..., 96:176], big[..., 192:272]
    qa, ka, va = (cuflash._interop.wrap(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    assert _bwd_sm90.ineligible(qa, qa, ka, va) is None
    check(0, 0, 0, 0, 0, 80, "float16", True, views=(q, k, v))


def test_autograd_takes_sm90_and_matches_the_explicit_call():
    """Under autograd on sm90 the backward is the Hopper one: bitwise the explicit deterministic call."""
    import torch

    q, k, v = torch_inputs((2, 400, 8, 128), (2, 600, 2, 128), "bfloat16", requires_grad=True)
    bwd_mod._PLANS.clear()
    out = cuflash.flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _, lse, _ = cuflash.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True, return_attn_probs=True)
    dq, dk, dv = cuflash.flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                             causal=True, deterministic=True, backend="sm90")
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(v.grad, dv)
    # backend="sm80" keeps the mma.sync backward (its own rounding: close, not bitwise)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    cuflash.flash_attn_func(q2, k2, v2, causal=True, backend="sm80").backward(dout)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), 128 ** -0.5, True)
    lowp = lowp_grads(q, k, v, dout, 128 ** -0.5, True)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (q2.grad, k2.grad, v2.grad), lowp, ref):
        assert_close_to_ref(name + " sm80", ours, lp, r, factor=3.0)


def test_auto_plan_is_sm90():
    import torch

    q, k, v = torch_inputs((1, 256, 4, 64), (1, 256, 4, 64), "float16")
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(out)
    bwd_mod._PLANS.clear()
    cuflash.flash_attn_backward(dout, q, k, v, out, lse)
    assert [p.backend for p in bwd_mod._PLANS.values()] == ["sm90"]
    cuflash.flash_attn_backward(dout, q, k, v, out, lse, backend="sm80")
    assert sorted(p.backend for p in bwd_mod._PLANS.values()) == ["sm80", "sm90"]


def test_changing_pointers_reencode_the_maps():
    """More distinct pointer sets than a plan keeps maps for, in one memoized shape, twice over."""
    import torch

    cases = []
    for _ in range(_bwd_sm90.MAX_MAP_SETS + 3):
        q, k, v = torch_inputs((1, 200, 2, 64), (1, 333, 2, 64), "float16")
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        cases.append((torch.randn_like(out), q, k, v, out, lse))
    for _ in range(2):
        for dout, q, k, v, out, lse in cases:
            got = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=True, backend="sm90")
            ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), 64 ** -0.5, True)
            lowp = lowp_grads(q, k, v, dout, 64 ** -0.5, True)
            for name, ours, lp, r in zip(("dq", "dk", "dv"), got, lowp, ref):
                assert_close_to_ref(name, ours, lp, r, factor=3.0)


def test_side_stream_and_graph_capture():
    """The caller's stream, and a captured backward replayed on new inputs copied into the static buffers."""
    import torch

    def problem():
        q, k, v = torch_inputs((2, 300, 4, 128), (2, 500, 2, 128), "float16")
        out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return [torch.randn_like(out), q, k, v, out, lse]

    def expect(dout, q, k, v, out, lse, got):
        ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), 128 ** -0.5, True)
        lowp = lowp_grads(q, k, v, dout, 128 ** -0.5, True)
        for name, ours, lp, r in zip(("dq", "dk", "dv"), got, lowp, ref):
            assert_close_to_ref(name, ours, lp, r, factor=3.0)

    static = problem()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = cuflash.flash_attn_backward(*static, causal=True, backend="sm90")
    torch.cuda.current_stream().wait_stream(s)
    expect(*static, got)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = cuflash.flash_attn_backward(*static, causal=True, backend="sm90")
    for _ in range(2):
        fresh = problem()
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        expect(*fresh, got)


def test_no_nan_when_no_row_sees_a_key():
    """Causal with seqlen_q > seqlen_k: the first 570 rows see no key; their dQ is exactly 0, nothing is NaN."""
    import torch

    (q, k, v, out, lse, dout), (dq, dk, dv) = check(1, 700, 130, 2, 2, 128, "float16", True)
    assert torch.count_nonzero(dq[:, : 700 - 130]) == 0
    assert np.isfinite(to_np(dk)).all() and np.isfinite(to_np(dv)).all()
