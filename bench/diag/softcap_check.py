"""Diagnostic (GPU, compute capability 9.0): the soft-cap's cost on the Hopper forward, and the capped-max form
(cuflash._configs.Sm90FwdTile.cap_max, the configured modifier kernels' at SM90_FWD_CAP_MAX_HEADDIMS: on tiles where
the soft-cap is the only change, the row max taken of the raw scores and capped once -- OnlineSoftmax::update_max_capped
-- so that its reduction does not wait for the per-score tanh) against the same tile without it, with a correctness
check of that form first.

    python -m bench.diag.softcap_check [--quick] [--rounds N]

1. Correctness: the capped-max form's out and LSE against the float64 reference (the tests' rule: out within 2x
   torch's own error in the inputs' dtype + 2^-10 of the reference's scale, LSE within 2e-4) and against the form
   without it on the same inputs (max |difference| of out and LSE printed), soft-cap 20 on large logits (inputs x3:
   the tests' case), causal and not, every head dim of SM90_FWD_CAP_MAX_HEADDIMS, fp16 and bf16, 1500 x 2100 (GQA 4/2).
2. Timing (fp16, batch x seqlen = 16k tokens, hidden 2048, seqlen 4k and 16k, causal and not; bench.harness.
   time_rounds, medians of `rounds` rounds, the three timed in turn, each round starting at the next of them): the
   plain kernel, the soft-capped tile without the capped-max form ("cap") and with it ("capmax", the configured
   kernel), each through _fwd_sm90.forward, soft-cap 50 (Gemma 2's). The table: ms and the soft-cap's cost over the
   plain kernel (the aim: <= +10%).
--quick: seqlen 4k only.

--sm80: the same check and table for the mma.sync forward (cuflash._fwd) and its capped-max form
(cuflash._configs.fwd_cap_max_tile: flash_fwd.cu CAP_MAX; configured at FWD_CAP_MAX_HEADDIMS), at head dims 64, 96,
128 and 256; "plain" is the configured kernel, "cap" the modifier kernel's tile without the form (at head dim 128 the
form runs 32-key tiles, "cap" 64).

--bwd: the Hopper backward instead, and its CAP_ONLY form (cuflash._configs.Sm90BwdTile.cap_only, configured at
SM90_BWD_CAP_ONLY_HEADDIMS; forced on and off here through cuflash._bwd_sm90.CAP_ONLY: on the tiles where the
soft-cap is the only change the scores capped in the P loop and the derivative 1 - tanh^2 alone, without the band
form's distances, tests and selects):
1. Correctness: dq, dk, dv of the form against the modifier kernel's band form on the same inputs and dout ("seqpar":
   every sum in a fixed order), which must be bitwise equal; soft-cap 20 on large logits, causal and not, a window,
   with ALiBi (no tile takes the form), head dims 64, 96 and 128, fp16 and bf16, 1500 x 2100 (GQA 4/2).
2. Timing (as above, "atomic", head dims 64, 96 and 128): the plain backward, the soft-capped one in the band form
   ("cap") and its CAP_ONLY form ("caponly"), each through flash_attn_backward from its own forward's out and LSE;
   the table: ms and the soft-cap's cost over the plain backward."""
from __future__ import annotations

import argparse
import sys

from .alibi_check import bloom_slopes

TOKENS, HIDDEN, CAP, CAP_TIMED = 16384, 2048, 20.0, 50.0


def _call(q, k, v, causal, cap, cap_max):
    """fn() running the Hopper forward of q, k, v (torch tensors) with soft-cap `cap` (0: the plain kernel), on the
    configured tile or its capped-max form."""
    from dataclasses import replace

    from cuflash import _configs, _fwd_sm90
    from cuflash._mods import mods_for
    from cuflash._validate import check_qkv

    qa, ka, va = check_qkv(q, k, v)
    mods = mods_for(qa, ka, causal, (-1, -1), cap, None, None)
    tile = None  # (the configured tile: the capped-max form at SM90_FWD_CAP_MAX_HEADDIMS)
    if cap and not cap_max:
        tile = replace(_configs.sm90_fwd_tile(q.shape[3], False, k.shape[1], _configs.MOD_SCORE), cap_max=False)
    return lambda: _fwd_sm90.forward(qa, ka, va, None, causal, tile=tile, mods=mods)


def _call_sm80(q, k, v, causal, cap, cap_max):
    """fn() running the mma.sync forward (cuflash._fwd) of q, k, v with soft-cap `cap` (0: the plain kernel), on the
    modifier kernel's tile without the form or the capped-max one (cuflash._configs.fwd_cap_max_tile), each given."""
    from cuflash import _configs, _fwd
    from cuflash._mods import mods_for
    from cuflash._validate import check_qkv

    qa, ka, va = check_qkv(q, k, v)
    mods = mods_for(qa, ka, causal, (-1, -1), cap, None, None) if cap else None
    d = q.shape[3]
    tile = None if not cap else _configs.fwd_cap_max_tile(d) if cap_max else _configs.fwd_tile(d, False,
                                                                                                _configs.MOD_SCORE)
    return lambda: _fwd.forward(qa, ka, va, None, causal, tile=tile, mods=mods)


def _forward(sm80: bool):
    """(the call maker, the head dims) of the forward checked and timed: the Hopper forward's capped-max form at
    SM90_FWD_CAP_MAX_HEADDIMS, or (sm80) the mma.sync forward's at head dims 64, 96, 128, 256."""
    from cuflash import _configs

    return (_call_sm80, (64, 96, 128, 256)) if sm80 else (_call, _configs.SM90_FWD_CAP_MAX_HEADDIMS)


def check(sm80: bool = False) -> int:
    """Prints one line per case; returns the number of failures."""
    import torch

    from cuflash import reference

    call, dims = _forward(sm80)
    fails = 0
    b, sq, sk, h, hk = 1, 1500, 2100, 4, 2
    for d in dims:
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                q = (3 * torch.randn(b, sq, h, d, device="cuda")).to(dtype)
                k = (3 * torch.randn(b, sk, hk, d, device="cuda")).to(dtype)
                v = torch.randn(b, sk, hk, d, device="cuda").to(dtype)
                out, lse = call(q, k, v, causal, CAP, True)()
                out_c, lse_c = call(q, k, v, causal, CAP, False)()
                d_o = (out.float() - out_c.float()).abs().max().item()
                d_l = (lse - lse_c).abs().max().item()
                scale = d ** -0.5
                to = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
                ref_o, ref_lse = reference.attention_forward(to(q), to(k), to(v), scale, causal, (-1, -1), CAP, None)
                kr, vr = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
                s = torch.einsum("bqhd,bkhd->bhqk", q, kr).float() * scale
                s = CAP * torch.tanh(s / CAP)
                if causal:
                    keep = torch.ones(sq, sk, device="cuda", dtype=torch.bool).tril(sk - sq)
                    s = s.masked_fill(~keep, float("-inf"))
                lowp = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).to(dtype), vr)
                ref_t = torch.from_numpy(ref_o).to("cuda")
                e_o = (out.double() - ref_t).abs().max().item()
                e_t = (lowp.double() - ref_t).abs().max().item()
                e_l = (lse.double() - torch.from_numpy(ref_lse).to("cuda")).abs().max().item()
                floor = 2.0 ** -10 * max(ref_t.abs().max().item(), 1e-3)
                ok = e_o <= 2 * e_t + floor and e_l <= 2e-4 and not torch.isnan(out).any().item()
                fails += not ok
                print(f"{'ok  ' if ok else 'FAIL'} capmax d={d} {str(dtype)[6:]} "
                      f"causal={causal} {b}x{sq}x{sk}: "
                      f"out {e_o:.2e} (torch {e_t:.2e}) lse {e_l:.1e}; against the form without it: out {d_o:.1e} "
                      f"lse {d_l:.1e}", flush=True)
    return fails


def timing(quick: bool, rounds: int, bwd: bool = False, sm80: bool = False) -> None:
    """The timing table: plain, cap and (bwd=False) capmax through the Hopper forward (sm80: the mma.sync forward),
    or (bwd=True) caponly through the Hopper backward, timed in turn; each row's cost over the plain kernel."""
    import torch

    from cuflash import _configs

    from ..harness import time_rounds

    form = "caponly" if bwd else "capmax"
    fwd_call, fwd_dims = _forward(sm80)
    rows = []
    for d in (_configs.SM90_BWD_CAP_ONLY_HEADDIMS if bwd else fwd_dims):
        h = HIDDEN // d
        for s in ((4096,) if quick else (4096, 16384)):
            b = max(1, TOKENS // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
            for causal in (True, False):
                call = _bwd_call if bwd else fwd_call
                fns = {"plain": call(q, k, v, causal, 0.0, None if bwd else False),
                       "cap": call(q, k, v, causal, CAP_TIMED, False), form: call(q, k, v, causal, CAP_TIMED, True)}
                res = {n: r[0] for n, r in time_rounds(fns, rounds, rotate=True).items()}
                rows.append((d, s, causal, res))
                print(f"d={d} s={s} causal={causal}: " + " ".join(f"{n} {ms:.3f} ms" for n, ms in res.items() if ms),
                      flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    if bwd:
        _reset_bwd()
    forms = ("cap", form)
    print("\n| hdim | seqlen | causal | plain ms | " + " | ".join(f"{n} ms" for n in forms) + " | " +
          " | ".join(f"{n} cost" for n in forms) + " |")
    print("|---" * (4 + 2 * len(forms)) + "|")
    for d, s, causal, r in rows:
        p = r.get("plain")
        cells = [f"{r[n]:.3f}" if r.get(n) else "n/a" for n in ("plain", *forms)]
        costs = [f"{100 * (r[n] / p - 1):+.1f}%" if p and r.get(n) else "n/a" for n in forms]
        print(f"| {d} | {s} | {causal} | " + " | ".join(cells + costs) + " |")


def _reset_bwd() -> None:
    """The CAP_ONLY switch back to the configuration's choice, and no plan made under another."""
    from cuflash import _bwd_sm90, backward as bwd

    _bwd_sm90.CAP_ONLY = None
    bwd._PLANS.clear()


def _bwd_call(q, k, v, causal, cap, cap_only, strategy="atomic", window=(-1, -1), alibi=None):
    """fn() running the Hopper backward (flash_attn_backward) of q, k, v from their own forward's out and LSE, with
    soft-cap `cap` (0: off) and the CAP_ONLY form forced on or off; fn returns (dq, dk, dv). The form is a module
    switch read when a plan is made: fn sets it and clears the plan memo on a call that finds it set otherwise (the
    timers' first, untimed call)."""
    import torch

    import cuflash
    from cuflash import _bwd_sm90, backward as bwd

    kw = dict(causal=causal, window_size=window, softcap=cap, alibi_slopes=alibi)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True, backend="sm90", **kw)
    dout = torch.randn_like(out)

    def fn():
        if _bwd_sm90.CAP_ONLY is not cap_only:
            _bwd_sm90.CAP_ONLY = cap_only
            bwd._PLANS.clear()
        return cuflash.flash_attn_backward(dout, q, k, v, out, lse, backend="sm90", dq_strategy=strategy, **kw)[:3]
    return fn


def check_bwd() -> int:
    """Prints one line per case; returns the number of failures (the form not bitwise the band form's)."""
    import torch

    fails = 0
    b, sq, sk, h, hk = 1, 1500, 2100, 4, 2
    slopes = bloom_slopes(h, "cuda")
    for d in (64, 96, 128):
        for dtype in (torch.float16, torch.bfloat16):
            for name, causal, window, alibi in (("cap", False, (-1, -1), None), ("cap causal", True, (-1, -1), None),
                                                ("cap window", False, (300, 40), None),
                                                ("cap alibi causal", True, (-1, -1), slopes)):
                q = (3 * torch.randn(b, sq, h, d, device="cuda")).to(dtype)
                k = (3 * torch.randn(b, sk, hk, d, device="cuda")).to(dtype)
                v = torch.randn(b, sk, hk, d, device="cuda").to(dtype)
                g = {}
                for on in (True, False):  # the same dout for both (_bwd_call draws it)
                    torch.manual_seed(1234)
                    g[on] = _bwd_call(q, k, v, causal, CAP, on, "seqpar", window, alibi)()
                same = all(torch.equal(x, y) for x, y in zip(g[True], g[False]))
                diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(g[True], g[False]))
                nan = any(torch.isnan(x).any().item() for x in g[True])
                ok = same and not nan
                fails += not ok
                print(f"{'ok  ' if ok else 'FAIL'} caponly d={d} {str(dtype)[6:]} {name} {b}x{sq}x{sk}: bitwise "
                      f"{'equal' if same else 'DIFFERENT'} to the band form (max |difference| {diff:.1e})",
                      flush=True)
    _reset_bwd()
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.softcap_check")
    ap.add_argument("--quick", action="store_true", help="seqlen 4k only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bwd", action="store_true", help="the backward and its CAP_ONLY form")
    ap.add_argument("--sm80", action="store_true", help="the mma.sync forward and its capped-max variant")
    a = ap.parse_args(argv)
    if a.bwd:
        fails = check_bwd()
        timing(a.quick, a.rounds, bwd=True)
        print(f"correctness: {'all ok' if not fails else f'{fails} FAILED'}")
        return 1 if fails else 0
    fails = check(a.sm80)
    timing(a.quick, a.rounds, sm80=a.sm80)
    print(f"correctness: {'all ok' if not fails else f'{fails} FAILED'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
