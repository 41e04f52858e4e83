"""GPU: the score modifiers -- sliding window (window_size), soft-cap (softcap), ALiBi (alibi_slopes) -- forward
and backward against the float64 reference with the error rule of conftest.py (outputs within 2x, gradients
within 3x of torch's own attention with the same modifiers in the same dtype), on both forward backends, every
head dim and dtype, GQA, ragged lengths, seqlen_q != seqlen_k both ways, every backward warp partition and dQ
strategy, the decode kernels; window edge cases ((0, 0), (left, 0), one side unbounded, windows wider than the
sequence, rows that see no key: zeros and LSE -inf, never NaN)."""
import numpy as np
import pytest

import cuflash
from cuflash import _configs
from cuflash import backward as bwd_mod
from cuflash import reference
from conftest import assert_close_to_ref, to_np, torch_attention_lowp, torch_inputs

pytestmark = pytest.mark.gpu

LSE_ATOL = 2e-4


def needs_backend(backend, d):
    from cuflash._configs import SM90_HEADDIMS

    if backend == "sm90":
        from cuflash._fwd_sm90 import device_cc

        if device_cc(0) != 90:
            pytest.skip("backend sm90 needs a compute capability 9.0 GPU")
        assert d in SM90_HEADDIMS


def slopes(b, h, per_batch=False):
    """ALiBi slopes (float32 CUDA tensor): BLOOM's geometric ones, per batch element varied a little."""
    import torch

    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
    if per_batch:
        return (base[None, :] * torch.linspace(0.5, 1.5, b, device="cuda")[:, None]).contiguous()
    return base


def torch_lowp(q, k, v, scale, causal, window_size=(-1, -1), softcap=0.0, alibi=None):
    """torch's own attention with the modifiers, in the inputs' dtype (conftest.torch_attention_lowp)."""
    return torch_attention_lowp(q, k, v, scale, causal, window_size, softcap, alibi)


def ref_np(alibi):
    return None if alibi is None else alibi.double().cpu().numpy()


def check_forward(q, k, v, out, lse, scale, causal, window_size, softcap, alibi, what=""):
    ref_o, ref_lse = reference.attention_forward(to_np(q), to_np(k), to_np(v), scale, causal, window_size, softcap,
                                                 ref_np(alibi))
    assert_close_to_ref(f"out {what}", out, torch_lowp(q, k, v, scale, causal, window_size, softcap, alibi), ref_o)
    got = to_np(lse)
    assert np.array_equal(np.isneginf(got), np.isneginf(ref_lse)), "rows with no key: LSE must be -inf"
    fin = np.isfinite(ref_lse)
    assert np.allclose(got[fin], ref_lse[fin], atol=LSE_ATOL, rtol=0), np.abs(got[fin] - ref_lse[fin]).max()
    empty = np.isneginf(ref_lse).transpose(0, 2, 1)  # [b, sq, h]
    assert (to_np(out)[empty] == 0).all(), "rows with no key must be zeros"


# (causal, window_size, softcap, ALiBi): each modifier alone, with causal, and all together.
OPTIONS = [
    (False, (16, 5), 0.0, None), (True, (16, -1), 0.0, None), (False, (0, 0), 0.0, None),
    (False, (-1, 7), 0.0, None), (False, (100, -1), 0.0, None), (False, (5000, 5000), 0.0, None),
    (False, (-1, -1), 20.0, None), (True, (-1, -1), 20.0, None),
    (False, (-1, -1), 0.0, "h"), (True, (-1, -1), 0.0, "bh"),
    (True, (33, -1), 15.0, "h"), (False, (40, 9), 15.0, "bh"),
]
OPT_IDS = [f"c{int(c)}-w{w[0]}_{w[1]}-cap{int(cap)}-{a or 'noalibi'}" for c, w, cap, a in OPTIONS]
# (dtype, option): every option in fp16; in bf16 one of each kind (window, causal window, soft-cap, ALiBi, all)
DTYPE_OPTS = [("float16", i) for i in range(len(OPTIONS))] + [("bfloat16", i) for i in (0, 1, 7, 9, 10)]


def dtype_opt_params():
    return [pytest.param(dt, OPTIONS[i], id=f"{dt}-{OPT_IDS[i]}") for dt, i in DTYPE_OPTS]
SHAPES = [(1, 1), (17, 300), (300, 17), (257, 257)]


def make_alibi(kind, b, h):
    return None if kind is None else slopes(b, h, per_batch=kind == "bh")


@pytest.mark.parametrize("backend,d", [(be, d) for be in ("sm80", "sm90") for d in (32, 64, 96, 128, 256)
                                       if be == "sm80" or d != 32])
@pytest.mark.parametrize("dtype,opt", dtype_opt_params())
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_forward_modifiers(dtype, backend, d, opt, sq, sk):
    causal, window, cap, akind = opt
    needs_backend(backend, d)
    b, h, hk = 2, 4, 2
    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype, scale=3.0 if cap else 1.0)
    alibi = make_alibi(akind, b, h)
    scale = d ** -0.5
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=alibi,
                                          return_attn_probs=True, backend=backend)
    check_forward(q, k, v, out, lse, scale, causal, window, cap, alibi, f"{backend} {opt}")


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("opt", [OPTIONS[i] for i in (0, 1, 6, 9, 10, 11)], ids=[OPT_IDS[i] for i in (0, 1, 6, 9, 10, 11)])
@pytest.mark.parametrize("sq,sk", [(1000, 700), (2048, 4096)])
def test_forward_modifiers_long(dtype, backend, opt, sq, sk):
    """Longer sequences: many KV tiles inside and outside the band (the skipped tiles), d 128."""
    causal, window, cap, akind = opt
    needs_backend(backend, 128)
    q, k, v = torch_inputs((1, sq, 2, 128), (1, sk, 2, 128), dtype, scale=3.0 if cap else 1.0)
    alibi = make_alibi(akind, 1, 2)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=alibi,
                                          return_attn_probs=True, backend=backend)
    check_forward(q, k, v, out, lse, 128 ** -0.5, causal, window, cap, alibi, f"{backend} {opt}")


def sm90_modifier_inputs(d, dtype, heads, sq, sk, causal, window, cap, akind):
    """The Hopper forward's modifier tests' inputs (skipped without an sm90 GPU): q, k, v with large logits (inputs
    x3), heads = (batch, query heads, KV heads), the ALiBi slopes of `akind`, the validated views and the call's Mods."""
    from cuflash._mods import mods_for
    from cuflash._validate import check_qkv

    needs_backend("sm90", d)
    b, h, hk = heads
    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype, scale=3.0)
    alibi = make_alibi(akind, b, h)
    qa, ka, va = check_qkv(q, k, v)
    return q, k, v, alibi, (qa, ka, va), mods_for(qa, ka, causal, window, cap, alibi, None)


def assert_same_to_rounding(out, lse, out_c, lse_c, dtype):
    """Two forms of one forward agree to rounding: out within 2 units in the last place of its dtype at its scale,
    the same rows without keys (an infinite LSE), and the finite LSE within 1e-5 of its scale."""
    import torch

    ulp = 2.0 ** (-10 if dtype == "float16" else -7)
    assert (out.float() - out_c.float()).abs().max().item() <= 2 * ulp * max(1.0, out_c.float().abs().max().item())
    fin = lse_c.isfinite()
    assert torch.equal(fin, lse.isfinite()) and (lse - lse_c)[fin].abs().max().item() <= 1e-5 * max(
        1.0, lse_c[fin].abs().max().item())


# The capped-max forms' cases (Hopper and mma.sync forward): the soft-cap alone, causal, a window, with ALiBi (no
# tile takes the form), ALiBi alone.
CAPPED_MAX_CASES = [(False, (-1, -1), 20.0, None), (True, (-1, -1), 20.0, None), (False, (300, 0), 5.0, None),
                    (True, (-1, -1), 20.0, "head"), (False, (-1, -1), 0.0, "head")]
CAPPED_MAX_IDS = ["cap", "cap-causal", "cap-window", "cap-alibi-causal", "alibi"]


@pytest.mark.parametrize("d", _configs.SM90_FWD_CAP_MAX_HEADDIMS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal,window,cap,akind", CAPPED_MAX_CASES, ids=CAPPED_MAX_IDS)
@pytest.mark.parametrize("sq,sk", [(1500, 2100), (2048, 1024)])
def test_forward_capped_max_form(d, dtype, causal, window, cap, akind, sq, sk):
    """The Hopper forward's capped-max form (Sm90FwdTile.cap_max: on tiles where the soft-cap is the only change,
    the row max of the raw scores capped once) against the float64 reference, with large logits (inputs x3): the
    soft-cap alone, causal (diagonal tiles take Mask::apply), a window, with ALiBi (no tile takes the form) and
    ALiBi alone, GQA 4/2, ragged tails and seqlen_q != seqlen_k both ways; that a call's configuration takes it at
    every head dim of SM90_FWD_CAP_MAX_HEADDIMS; and against the same tile without it on the same inputs, to rounding
    (the same capped scores and, where tanh.approx keeps two scores in order, the same row max: out within 2 units in
    the last place at its scale, the LSE within 1e-5)."""
    from dataclasses import replace

    from cuflash import _fwd_sm90

    q, k, v, alibi, (qa, ka, va), mods = sm90_modifier_inputs(d, dtype, (2, 4, 2), sq, sk, causal, window, cap, akind)
    tile = _configs.sm90_fwd_tile(d, False, sk, _configs.MOD_SCORE)
    assert tile.cap_max  # (the configured modifier kernel)
    out, lse = _fwd_sm90.forward(qa, ka, va, None, causal, mods=mods)
    check_forward(q, k, v, out, lse, d ** -0.5, causal, window, cap, alibi, f"capped max {dtype} d{d}")
    out_c, lse_c = _fwd_sm90.forward(qa, ka, va, None, causal, tile=replace(tile, cap_max=False), mods=mods)
    assert_same_to_rounding(out, lse, out_c, lse_c, dtype)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal,window,cap,akind", CAPPED_MAX_CASES, ids=CAPPED_MAX_IDS)
@pytest.mark.parametrize("sq,sk", [(1500, 2100), (2048, 1024)])
def test_forward_capped_max_form_sm80(d, dtype, causal, window, cap, akind, sq, sk):
    """The mma.sync forward's capped-max form (FwdTile.cap_max, flash_fwd.cu CAP_MAX, through an explicit tile:
    _configs.fwd_cap_max_tile) on the cases of the Hopper form's test: against the float64 reference with large
    logits, and against the modifier kernel without the form (its tile given) on the same inputs to rounding (out
    within 2 units in the last place at its scale, the LSE within 1e-5; at head dim 128 the form runs 32-key tiles,
    the modifier kernel 64, so the two also sum in another order)."""
    from cuflash import _fwd
    from cuflash._mods import mods_for
    from cuflash._validate import check_qkv

    b, h, hk = 2, 4, 2
    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype, scale=3.0)
    alibi = make_alibi(akind, b, h)
    qa, ka, va = check_qkv(q, k, v)
    mods = mods_for(qa, ka, causal, window, cap, alibi, None)
    tile = _configs.fwd_cap_max_tile(d)
    assert tile.cap_max and not _configs.fwd_tile(d, False, _configs.MOD_SCORE).cap_max
    out, lse = _fwd.forward(qa, ka, va, None, causal, tile=tile, mods=mods)
    check_forward(q, k, v, out, lse, d ** -0.5, causal, window, cap, alibi, f"sm80 capped max {dtype} d{d}")
    out_c, lse_c = _fwd.forward(qa, ka, va, None, causal, tile=_configs.fwd_tile(d, False, _configs.MOD_SCORE),
                                mods=mods)
    assert_same_to_rounding(out, lse, out_c, lse_c, dtype)


# The modifier kernels' persistent form (cuflash._configs.sm90_fwd_mod_persist_tiles, through an explicit tile: every
# variant, configured or not): (head dim, variant) pairs, and the cases: each modifier alone, causal with each, a
# window with rows that see no key, all three.
PERSIST_MOD_TILES = [(64, "persist"), (96, "persist"), (128, "persist"), (128, "persist n160")]
PERSIST_MOD_CASES = [(False, (-1, -1), 20.0, None), (True, (-1, -1), 20.0, None), (False, (300, 40), 0.0, None),
                     (True, (600, -1), 0.0, "h"), (False, (-1, -1), 0.0, "bh"), (True, (400, -1), 20.0, "h")]
PERSIST_MOD_IDS = ["cap", "cap-causal", "window", "window-causal-alibi", "alibi", "all"]


def persist_mod_params():
    """fp16: every case at three shapes, one per walk (the configured one, the dynamic, the fixed "qtile"); bf16: the
    causal soft-cap and all three modifiers at one."""
    out = []
    for i, (c, w, cap, a) in enumerate(PERSIST_MOD_CASES):
        for sq, sk, order in ((700, 1100, "auto"), (1000, 600, "dynamic"), (900, 900, "qtile")):
            out.append(pytest.param("float16", c, w, cap, a, sq, sk, order,
                                    id=f"fp16-{PERSIST_MOD_IDS[i]}-{sq}-{sk}-{order}"))
        if PERSIST_MOD_IDS[i] in ("cap-causal", "all"):
            out.append(pytest.param("bfloat16", c, w, cap, a, 700, 1100, "auto",
                                    id=f"bf16-{PERSIST_MOD_IDS[i]}-700-1100-auto"))
    return out


@pytest.mark.parametrize("d,name", PERSIST_MOD_TILES, ids=[f"{d}-{n.replace(' ', '_')}" for d, n in PERSIST_MOD_TILES])
@pytest.mark.parametrize("dtype,causal,window,cap,akind,sq,sk,grid_order", persist_mod_params())
def test_forward_persistent_modifier_form(d, name, dtype, causal, window, cap, akind, sq, sk, grid_order):
    """The modifier kernels' persistent form (the kernel's PERSIST with MOD_SCORE: a grid of at most a block per SM
    walking the Q tiles heaviest first, a window's hidden first and last KV tiles taken as empty turns) into
    NaN-filled outputs, against the float64 reference with large logits (inputs x3), GQA 24/8 with more Q tiles than
    blocks (each block walks several, under the fixed and the dynamic walk), ragged tails, seqlen_q != seqlen_k both
    ways, rows that see no key (causal with seqlen_q > seqlen_k: zeros, LSE -inf); and, on 128-key stages, bitwise
    against the one-block-per-tile modifier kernel (the same products in the same order)."""
    from dataclasses import replace

    import torch

    from cuflash import _configs, _fwd_sm90

    b, h = 2, 24
    q, k, v, alibi, (qa, ka, va), mods = sm90_modifier_inputs(d, dtype, (b, h, 8), sq, sk, causal, window, cap, akind)
    tile = _configs.sm90_fwd_mod_persist_tiles(d)[name]
    assert tile.persistent and b * h * -(-sq // tile.block_m) > _fwd_sm90.sm_count(0)  # several tiles per block

    def run(t, order):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"), device="cuda", dtype=torch.float32)
        _fwd_sm90.forward(qa, ka, va, None, causal, order, out=out, lse=lse, tile=t, mods=mods)
        return out, lse

    out, lse = run(tile, grid_order)
    check_forward(q, k, v, out, lse, d ** -0.5, causal, window, cap, alibi, f"persistent {name} {dtype} d{d}")
    one = _configs.sm90_fwd_tile(d, False, sk, _configs.MOD_SCORE)
    if one.block_n == tile.block_n:
        out1, lse1 = run(replace(one, o_tma=tile.o_tma), "auto")
        assert torch.equal(out, out1) and torch.equal(lse, lse1)


# Calls that SM90_FWD_MOD_PERSIST sends to the persistent modifier form on their own (no tile given): a causal band
# (right edge) and bands without one, at key counts inside its ranges (on 160-key stages at head dim 128 past 4k).
CONFIGURED_PERSIST_CASES = [(True, (-1, -1), 20.0, None, 2600, 3000), (False, (700, 0), 0.0, "h", 3000, 2600),
                            (False, (-1, -1), 20.0, "bh", 2100, 3500), (False, (-1, -1), 20.0, None, 1000, 4500)]
CONFIGURED_PERSIST_IDS = ["cap-causal", "window-alibi", "cap-alibi-nomask", "cap-nomask-4500"]


def configured_persist_params():
    """Every case at head dims 64 and 128; at 96 (configured without a right band edge up to 4k keys) that case."""
    out = []
    for d in (64, 96, 128):
        for dtype in ("float16", "bfloat16"):
            for case, cid in zip(CONFIGURED_PERSIST_CASES, CONFIGURED_PERSIST_IDS):
                if d != 96 or cid == "cap-alibi-nomask":
                    out.append(pytest.param(d, dtype, *case, id=f"{cid}-{dtype}-{d}"))
    return out


@pytest.mark.parametrize("d,dtype,causal,window,cap,akind,sq,sk", configured_persist_params())
def test_configured_persistent_modifier_calls(monkeypatch, d, dtype, causal, window, cap, akind, sq, sk):
    """flash_attn_func (backend "auto", no tile) with the score modifiers at lengths SM90_FWD_MOD_PERSIST configures:
    the call launches the persistent modifier kernel the configuration names (the kernels launched recorded at
    cuflash._fwd_sm90.get_launcher) and matches the float64 reference (large logits, GQA 4/2, ragged tails, seqlen_q
    != seqlen_k both ways, rows that see no key)."""
    from dataclasses import replace

    from cuflash import _configs, _fwd_sm90

    q, k, v, alibi, _, mods = sm90_modifier_inputs(d, dtype, (1, 4, 2), sq, sk, causal, window, cap, akind)
    tile = _configs.sm90_fwd_mod_tile(d, sk, _fwd_sm90.mod_band(mods, sq))
    assert tile is not None and tile.persistent
    want = {_configs.sm90_fwd_spec(dtype, d, False, u, _configs.MOD_SCORE).name
            for u in (tile, replace(tile, o_tma=False))}
    launched, real = [], _fwd_sm90.get_launcher
    monkeypatch.setattr(_fwd_sm90, "get_launcher",
                        lambda spec, device: launched.append(spec.name) or real(spec, device))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=alibi,
                                          return_attn_probs=True)
    assert launched and launched[-1] in want, launched
    check_forward(q, k, v, out, lse, d ** -0.5, causal, window, cap, alibi, f"configured persistent {dtype} d{d}")


# The cases of the backward's CAP_ONLY form: the soft-cap alone, causal, a window, with ALiBi (no tile takes the
# CAP_ONLY form), ALiBi alone (the soft-cap off).
FORM_CASES = [(False, (-1, -1), 20.0, None), (True, (-1, -1), 20.0, None), (False, (300, 40), 20.0, None),
              (True, (-1, -1), 20.0, "h"), (False, (-1, -1), 0.0, "bh")]
FORM_IDS = ["cap", "cap-causal", "cap-window", "cap-alibi-causal", "alibi"]


def check_backward(b, sq, sk, h, hk, d, dtype, causal, window, cap, alibi_kind, warp_partition="auto",
                   dq_strategy=None, deterministic=False):
    import torch

    q, k, v = torch_inputs((b, sq, h, d), (b, sk, hk, d), dtype, requires_grad=True, scale=3.0 if cap else 1.0)
    alibi = make_alibi(alibi_kind, b, h)
    scale = d ** -0.5
    out = cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap, alibi_slopes=alibi,
                                  warp_partition=warp_partition, dq_strategy=dq_strategy,
                                  deterministic=deterministic)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), scale, causal, window, cap,
                                       ref_np(alibi))
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch_lowp(qq, kk, vv, scale, causal, window, cap, alibi).backward(dout)
    for name, ours, lp, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (qq.grad, kk.grad, vv.grad), ref):
        assert_close_to_ref(f"{name} ({warp_partition}, {dq_strategy})", ours, lp, r, factor=3.0)
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype,opt", dtype_opt_params())
@pytest.mark.parametrize("sq,sk", [(17, 300), (300, 17), (257, 257)])
def test_backward_modifiers(dtype, d, opt, sq, sk):
    causal, window, cap, akind = opt
    check_backward(2, sq, sk, 4, 2, d, dtype, causal, window, cap, akind)


def assert_same_both_ways(flag, seed, kernels, is_form, args):
    """check_backward(*args, dq_strategy="seqpar": dQ in a fixed order) with cuflash._bwd_sm90.<flag> forced True,
    then False, on the same inputs and dout (`seed`): each plan's main kernel (`kernels`, spy_main_kernels) is the
    form's exactly when forced on (`is_form` of its name), and the gradients of the two are bitwise equal."""
    import torch

    from cuflash import _bwd_sm90

    grads = {}
    try:
        for on in (True, False):
            setattr(_bwd_sm90, flag, on)
            bwd_mod._PLANS.clear()
            torch.manual_seed(seed)
            grads[on] = check_backward(*args, dq_strategy="seqpar")
            assert kernels and is_form(kernels[-1]) == on, kernels
    finally:
        setattr(_bwd_sm90, flag, None)
        bwd_mod._PLANS.clear()
    for name, a, b in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        assert torch.equal(a, b), f"{name}: max |difference| {(a.float() - b.float()).abs().max().item():.3e}"


def spy_main_kernels(monkeypatch) -> list:
    """The names of the main kernels the Hopper backward's plans are made with from now on (this test), in order."""
    from cuflash import _bwd_sm90

    kernels, main_launch = [], _bwd_sm90.main_launch

    def spy(*args, **kw):
        r = main_launch(*args, **kw)
        kernels.append(r[0].name)
        return r

    monkeypatch.setattr(_bwd_sm90, "main_launch", spy)
    return kernels


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal,window,cap,akind", FORM_CASES, ids=FORM_IDS)
@pytest.mark.parametrize("sq,sk", [(1500, 2100), (2048, 1024)])
def test_backward_cap_only_form(d, dtype, causal, window, cap, akind, sq, sk, monkeypatch):
    """The Hopper backward's CAP_ONLY form (Sm90BwdTile.cap_only, forced by cuflash._bwd_sm90.CAP_ONLY: on tiles
    where the soft-cap is the only change the scores are capped in the P loop, the derivative 1 - tanh^2 alone)
    against the float64 reference with large logits (inputs x3), GQA 4/2, ragged tails, seqlen_q != seqlen_k both
    ways: the soft-cap alone, causal (the diagonal tiles keep the band form), a window (the edge tiles too), with
    ALiBi (no tile takes the form) and ALiBi alone (the soft-cap off); and bitwise against the configured modifier
    kernel on the same inputs and dout ("seqpar": dQ in a fixed order), since on its tiles the form computes the
    band form's values exactly. One block per tile (cuflash._bwd_sm90.PERSIST off: at head dim 64 these lengths are
    configured persistent, whose CAP_ONLY form test_backward_persistent_modifier_form checks)."""
    from cuflash import _bwd_sm90

    needs_backend("sm90", d)
    kernels = spy_main_kernels(monkeypatch)
    monkeypatch.setattr(_bwd_sm90, "PERSIST", False)
    assert_same_both_ways("CAP_ONLY", 1234, kernels, lambda k: k.endswith(", 1, 0, 0, false, false, true>"),
                          (2, sq, sk, 4, 2, d, dtype, causal, window, cap, akind))


# The persistent modifier form's cases: FORM_CASES, and a window whose band leaves KV tiles that no query sees (their
# dK, dV zero) with GQA 4/2, at head dim 64 and the padded 48; ragged tails, seqlen_q != seqlen_k both ways. Each in
# the band form (the CAP_ONLY form off), and the soft-capped ones again in the CAP_ONLY form ("cap_only-" ids: the
# soft-cap alone, causal, a window, and with ALiBi, where no tile takes the lean path).
PERSIST_MOD_CASES = FORM_CASES + [(False, (100, 0), 0.0, "h")]
PERSIST_MOD_IDS = FORM_IDS + ["window-alibi"]
PERSIST_FORM_CASES = ([(False, *c) for c in PERSIST_MOD_CASES] +
                      [(True, *c) for c in PERSIST_MOD_CASES if c[2]])
PERSIST_FORM_IDS = PERSIST_MOD_IDS + ["cap_only-" + i for c, i in zip(PERSIST_MOD_CASES, PERSIST_MOD_IDS) if c[2]]


@pytest.mark.parametrize("grid", [None, 3], ids=["grid-sms", "grid-3"])
@pytest.mark.parametrize("d", [64, 48])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cap_only,causal,window,cap,akind", PERSIST_FORM_CASES, ids=PERSIST_FORM_IDS)
@pytest.mark.parametrize("sq,sk", [(300, 2100), (2048, 1024)])
def test_backward_persistent_modifier_form(grid, d, dtype, cap_only, causal, window, cap, akind, sq, sk, monkeypatch):
    """The Hopper backward's persistent form with the score modifiers (cuflash._configs.SM90_BWD_PERSIST_MOD_HEADDIMS,
    forced by cuflash._bwd_sm90.PERSIST; a grid of one block per SM, or of 3 blocks that walk every tile between
    them: each tile's mask and ALiBi slope taken per tile) against the float64 reference with large logits where
    the soft-cap is on, GQA 4/2; its plan's main kernel is the persistent modifier kernel (in the CAP_ONLY form when
    forced on, cuflash._bwd_sm90.CAP_ONLY); and with "seqpar" (dQ in a fixed order) its gradients are bitwise those
    of the modifier kernel of one block per tile in the same form (the band form on every tile, or the CAP_ONLY
    form's lean tiles); with "atomic" against the reference too."""
    from dataclasses import replace

    from cuflash import _bwd_sm90, _configs

    needs_backend("sm90", _configs.kernel_headdim(d))
    kernels = spy_main_kernels(monkeypatch)
    monkeypatch.setattr(_bwd_sm90, "CAP_ONLY", cap_only)
    monkeypatch.setattr(_bwd_sm90, "PERSIST_MAX_GRID", grid)
    tile = replace(_configs.sm90_bwd_persist_tile(64), cap_only=cap_only)
    spec = _configs.sm90_bwd_spec(dtype, 64, False, tile, mod=_configs.MOD_SCORE)
    assert_same_both_ways("PERSIST", 4321, kernels, lambda k: k == spec.name,
                          (2, sq, sk, 4, 2, d, dtype, causal, window, cap, akind))
    monkeypatch.setattr(_bwd_sm90, "PERSIST", True)
    bwd_mod._PLANS.clear()
    try:
        check_backward(2, sq, sk, 4, 2, d, dtype, causal, window, cap, akind, dq_strategy="atomic")
        assert kernels[-1] == spec.name, kernels
    finally:
        bwd_mod._PLANS.clear()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal,window,cap,akind", [(True, (-1, -1), 0.0, "h"), (False, (300, 0), 0.0, None),
                                                     (True, (-1, -1), 20.0, None)], ids=["causal-alibi", "w300", "cap"])
def test_configured_persistent_modifier_backward(dtype, causal, window, cap, akind, monkeypatch):
    """A backward through flash_attn_func with the score modifiers at a length the persistent modifier form is
    configured for at head dim 64 (SM90_BWD_PERSIST_MOD_MAX_SEQLEN_K without the soft-cap,
    SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K with it; the default dQ strategy): its plan's main kernel is the persistent
    modifier kernel, in the CAP_ONLY form with the soft-cap; gradients against the float64 reference."""
    from dataclasses import replace

    from cuflash import _configs

    needs_backend("sm90", 64)
    limits = _configs.SM90_BWD_PERSIST_CAP_MAX_SEQLEN_K if cap else _configs.SM90_BWD_PERSIST_MOD_MAX_SEQLEN_K
    sk = limits[64] - 100
    kernels = spy_main_kernels(monkeypatch)
    bwd_mod._PLANS.clear()
    check_backward(1, 700, sk, 4, 2, 64, dtype, causal, window, cap, akind)
    tile = _configs.sm90_bwd_persist_tile(64)
    persist = _configs.sm90_bwd_spec(dtype, 64, False, replace(tile, cap_only=bool(cap)), mod=_configs.MOD_SCORE)
    assert kernels and kernels[-1] == persist.name, kernels


# Every warp partition and dQ strategy with a window (the Q-tile ranges of a KV tile and, for "seqpar", the KV
# tiles each row sums) and with the soft-cap (its derivative in each partition's dS step).
PART_CASES = [(d, p) for d in (32, 64, 96, 128, 256) for p in ("kv", "q", "2d") if d in bwd_mod.bwd_tiles(p)]


@pytest.mark.parametrize("d,part", PART_CASES)
@pytest.mark.parametrize("dq_strategy", ["atomic", "seqpar", "loop"])
@pytest.mark.parametrize("opt", [(True, (70, -1), 0.0, None), (False, (48, 20), 10.0, "h"),
                                 (False, (-1, -1), 10.0, None)], ids=["causal-w70", "w48_20-cap-alibi", "cap"])
def test_backward_partitions_and_strategies(d, part, dq_strategy, opt):
    causal, window, cap, akind = opt
    if (part, d) in bwd_mod.BWD_SCORE_UNSUPPORTED:  # refused by name, before the forward launches
        q, k, v = torch_inputs((1, 64, 2, d), (1, 64, 2, d), "float16", requires_grad=True)
        with pytest.raises(NotImplementedError, match="warp_partition"):
            cuflash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap,
                                    alibi_slopes=make_alibi(akind, 1, 2), warp_partition=part)
        return
    check_backward(2, 333, 555, 4, 1, d, "float16", causal, window, cap, akind, part, dq_strategy)


def test_deterministic_with_modifiers():
    """deterministic=True with every modifier: two backward passes on the same inputs are bitwise equal, and
    correct."""
    import torch

    q, k, v = torch_inputs((1, 300, 2, 64), (1, 400, 2, 64), "bfloat16", requires_grad=True)
    dout = torch.randn_like(q)
    grads = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        cuflash.flash_attn_func(q, k, v, causal=True, window_size=(50, -1), softcap=12.0,
                                alibi_slopes=slopes(1, 2), deterministic=True).backward(dout)
        grads.append([x.grad.clone() for x in (q, k, v)])
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)
    check_backward(1, 300, 400, 2, 2, 64, "bfloat16", True, (50, -1), 12.0, "h", deterministic=True)


def test_window_rows_without_keys():
    """A band that misses the keys of some rows (sq > sk with window (0, 0); a right-only band (-1, -300) is not
    a flash-attn value, so the left edge does it): zeros and LSE -inf for those rows, in both backends."""
    import torch

    for backend in ("sm80", "sm90"):
        if backend == "sm90":
            from cuflash._fwd_sm90 import device_cc

            if device_cc(0) != 90:
                continue
        q, k, v = torch_inputs((2, 300, 2, 64), (2, 17, 2, 64), "float16")
        out, lse, _ = cuflash.flash_attn_func(q, k, v, window_size=(0, 0), return_attn_probs=True, backend=backend)
        assert torch.isneginf(lse[:, :, :283]).all() and torch.isfinite(lse[:, :, 283:]).all()
        assert (out[:, :283] == 0).all() and not torch.isnan(out).any()
        check_forward(q, k, v, out, lse, 64 ** -0.5, False, (0, 0), 0.0, None)


def test_equivalences():
    """window (-1, 0) is causal (the causal kernels run); window (-1, -1) with causal is causal; a window wider
    than both sequences is no window; flash-attn's causal ALiBi (slope (j - sk + 1)) equals ours up to a per-row
    constant, so the outputs agree."""
    import torch

    q, k, v = torch_inputs((2, 200, 4, 64), (2, 300, 4, 64), "float16")
    c = cuflash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(c, cuflash.flash_attn_func(q, k, v, window_size=(-1, 0)))
    assert torch.equal(c, cuflash.flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)))
    wide = cuflash.flash_attn_func(q, k, v, window_size=(10000, 10000))
    plain = cuflash.flash_attn_func(q, k, v)
    assert (wide.float() - plain.float()).abs().max() < 2e-3


@pytest.mark.parametrize("kernel", ["decode", "fwd_split"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("opt", [(True, (100, -1), 0.0, None), (False, (-1, -1), 25.0, "h"),
                                 (True, (64, -1), 25.0, "bh")], ids=["causal-w100", "cap-alibi", "all"])
@pytest.mark.parametrize("sq,h,hk", [(1, 8, 2), (5, 4, 4)])
def test_decode_modifiers(kernel, d, opt, sq, h, hk):
    """flash_attn_with_kvcache with the modifiers: ragged cache_seqlens (0 included), GQA (not folded)."""
    import torch

    causal, window, cap, akind = opt
    b, s_cache = 3, 700
    kc = torch.randn(b, s_cache, hk, d, device="cuda").half()
    vc = torch.randn(b, s_cache, hk, d, device="cuda").half()
    seqlens = [700, 0, 333]
    cs = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    q = (torch.randn(b, sq, h, d, device="cuda") * (3.0 if cap else 1.0)).half()
    alibi = make_alibi(akind, b, h)
    out, lse = cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=causal, window_size=window,
                                               softcap=cap, alibi_slopes=alibi, return_softmax_lse=True,
                                               kernel=kernel)
    for i, n in enumerate(seqlens):
        al = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[i:i + 1])
        if n == 0:
            assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
            continue
        check_forward(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], out[i:i + 1], lse[i:i + 1], d ** -0.5, causal,
                      window, cap, al, f"decode {kernel}")


def test_cupy_and_explicit_backward():
    """CuPy arrays in and out, and flash_attn_backward with the forward's modifiers."""
    import cupy

    b, sq, sk, h, d = 2, 130, 190, 2, 64
    rs = cupy.random.RandomState(1)
    q, k, v = ((rs.standard_normal((b, s, h, d)) * 2).astype(cupy.float16) for s in (sq, sk, sk))
    al = cupy.asarray([0.25, 0.0625], dtype=cupy.float32)
    opts = dict(causal=True, window_size=(60, -1), softcap=8.0, alibi_slopes=al)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True, **opts)
    assert isinstance(out, cupy.ndarray)
    ref_o, _ = reference.attention_forward(to_np(q), to_np(k), to_np(v), None, True, (60, -1), 8.0, cupy.asnumpy(al))
    assert np.abs(to_np(out) - ref_o).max() < 1e-2
    dout = rs.standard_normal(out.shape).astype(cupy.float16)
    dq, dk, dv = cuflash.flash_attn_backward(dout, q, k, v, out, lse, **opts)
    rq, rk, rv = reference.attention_backward(to_np(dout), to_np(q), to_np(k), to_np(v), None, True, (60, -1), 8.0,
                                              cupy.asnumpy(al))
    for name, ours, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert np.abs(to_np(ours) - r).max() < 3e-2 * max(1.0, np.abs(r).max()), name


def test_bad_alibi_raises_before_launch():
    import torch

    q, k, v = torch_inputs((2, 16, 4, 64), (2, 16, 4, 64), "float16")
    for bad, exc in ((torch.ones(3, device="cuda"), ValueError), (torch.ones(4, device="cuda").half(), TypeError),
                     (torch.ones(4), TypeError), (torch.ones(3, 4, device="cuda"), ValueError)):
        with pytest.raises(exc, match="alibi_slopes"):
            cuflash.flash_attn_func(q, k, v, alibi_slopes=bad)
