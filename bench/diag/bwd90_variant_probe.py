"""Diagnostic (GPU, compute capability 9.0): the Hopper backward's EXP_IL variant (cuda_src/flash_bwd_sm90.cu: P^T's
exponentials interleaved with dV's k16 steps; cuflash._bwd_sm90.EXP_IL, head dims 96 and 128) against the default
kernel, checked and then timed next to SDPA's cuDNN backward:

    python -m bench.diag.bwd90_variant_probe [--rounds N] [--skip-check] [--json FILE]

1. Check (small ragged shapes: seqlen_q != seqlen_k, GQA, a single key; fp16 and bf16; head dims 96 and 128; causal
   and not; dQ strategies atomic, ordered and seqpar; the score modifiers: window with soft-cap, ALiBi). Per case the
   variant's gradients must be within fp32-accumulation differences of the default kernel's (2^-6 of the largest
   gradient: the atomic dQ adds in any order) and, for ordered and seqpar, bitwise equal to a second run; the
   column `=def` says whether they are also bitwise equal to the default's (expected: the same products in the same
   order). A failure prints FAIL and sets exit status 1.
2. Timing: the FA2 grid at head dim 128 (batch x seqlen = 16k tokens, 16 heads), 2k-16k, fp16 and bf16, causal and
   not; default, variant (each one plan of cuflash.backward._make_plan with the "atomic" strategy, called directly)
   and cuDNN (SDPA, the backward through autograd), timed in turn in each round, `CALLS` back-to-back calls per
   timing, medians over the rounds (bench.harness). The table (last) gives ms, the variant's speed-up over the
   default (default ms / variant ms) and cuDNN's time over each (> 1: faster than cuDNN).
"""
from __future__ import annotations

import json
import sys

CALLS = 5
SHAPES = ((1, 130, 77, 2, 1), (1, 77, 200, 2, 2), (2, 1, 1, 2, 2), (1, 300, 301, 4, 2), (2, 700, 513, 8, 2))


def _set_exp_il(on):
    from cuflash import _bwd_sm90, backward as bwd_mod

    _bwd_sm90.EXP_IL = bool(on)
    bwd_mod._PLANS.clear()


def precompile():
    """The default and EXP_IL main kernels of head dims 96 and 128 (every mask mode, ordered), in parallel."""
    from cuflash._configs import SM90_BWD_EXP_IL_HEADDIMS, sm90_bwd_specs
    from cuflash.precompile import compile_specs

    specs = [s for s in sm90_bwd_specs() if int(s.name.split(", ")[1]) in SM90_BWD_EXP_IL_HEADDIMS]
    compile_specs(specs, progress=True)


def check_case(dtype, d, causal, dq, opts, shape):
    """(ok, line) for one case: the variant against the default kernel."""
    import torch

    import cuflash

    b, sq, sk, h, hk = shape
    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
    if opts == "alibi":
        opts = dict(alibi_slopes=torch.rand(h, device="cuda", dtype=torch.float32) * 0.5)
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **opts)
    dout = torch.randn_like(out)

    def grads():
        return [x.float() for x in cuflash.flash_attn_backward(
            dout, q, k, v, out, lse, causal=causal, dq_strategy=dq, deterministic=dq != "atomic", backend="sm90",
            **opts)]

    try:
        _set_exp_il(False)
        ref = grads()
        _set_exp_il(True)
        a, again = grads(), grads()
    finally:
        _set_exp_il(False)
    torch.cuda.synchronize()
    errs = [(x - r).abs().max().item() for x, r in zip(a, ref)]
    close = all(e <= 2 ** -6 * r.abs().max().item() + 1e-5 for e, r in zip(errs, ref))
    finite = all(bool(torch.isfinite(x).all()) for x in a)
    repeat = all(torch.equal(x, y) for x, y in zip(a, again))
    same = all(torch.equal(x, r) for x, r in zip(a, ref))
    ok = close and finite and (repeat or dq == "atomic")
    name = "alibi" if "alibi_slopes" in opts else ("window+softcap" if opts else "-")
    line = (f"{'ok  ' if ok else 'FAIL'} {dtype:>8} d{d} causal={int(causal)} dq={dq:<7} {name:<14} "
            f"b{b} sq{sq} sk{sk} h{h}/{hk}: max|variant-default| dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}"
            f" repeat={int(repeat)} =def={int(same)}")
    return ok, line


def check():
    failed = 0
    for dtype in ("float16", "bfloat16"):
        for d in (96, 128):
            for causal in (False, True):
                for dq in ("atomic", "ordered", "seqpar"):
                    for opts in ({}, dict(window_size=(40, 8), softcap=5.0), "alibi"):
                        if opts and (causal or dq == "ordered"):  # the modifier kernels: non-causal, no "ordered"
                            continue
                        for shape in SHAPES:
                            ok, line = check_case(dtype, d, causal, dq, opts, shape)
                            failed += not ok
                            if not ok or shape == SHAPES[-1]:
                                print(line, flush=True)
    print(f"check: {failed} failed", flush=True)
    return failed


def _plan(views, causal, exp_il):
    from cuflash import backward as bwd_mod

    try:
        _set_exp_il(exp_il)
        plan = bwd_mod._make_plan(*views, None, causal, "atomic", False, None, "auto", None, backend="sm90")
    finally:
        _set_exp_il(False)
    ptrs = tuple(a.ptr for a in views)
    return lambda: plan.run(*ptrs)


def time_point(dt, causal, s, rounds, d=128):
    import torch

    import cuflash
    from cuflash.backward import check_backward_inputs

    from ..harness import sdpa, time_ms, time_rounds

    b, h = 16384 // s, 2048 // d
    tdt = getattr(torch, dt)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=tdt) for _ in range(3))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    views = check_backward_inputs(dout, q, k, v, out, lse)
    fns = {"default": _plan(views, causal, False), "exp_il": _plan(views, causal, True)}
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = dout.transpose(1, 2).contiguous()
    try:
        ot = sdpa("cudnn")(qt, kt, vt, causal)
        fns["cudnn"] = lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True)
    except RuntimeError as e:
        print(f"sdpa cudnn refused {dt} s{s}: {str(e)[:200]}", flush=True)
    timer = lambda fn: time_ms(lambda: [fn() for _ in range(CALLS)], rep=5) / CALLS  # noqa: E731
    timed = time_rounds(fns, rounds, timer=timer)
    del fns
    torch.cuda.empty_cache()
    return {name: ms for name, (ms, _) in timed.items()}


def main(argv):
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        print("needs a compute capability 9.0 GPU (the sm90 backward)")
        return 2
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    precompile()
    failed = 0 if "--skip-check" in argv else check()
    rows = []
    for dt in ("float16", "bfloat16"):
        for causal in (False, True):
            for s in (2048, 4096, 8192, 16384):
                ms = time_point(dt, causal, s, rounds)
                rows.append(((dt, causal, s), ms))
                print(dt, f"causal={int(causal)}", s, {k: round(x, 3) if x else x for k, x in ms.items()}, flush=True)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump([dict(dtype=dt, causal=c, seqlen=s, batch=16384 // s, heads=16, d=128, ms=ms)
                       for (dt, c, s), ms in rows], f, indent=1)
    print("\nsm90 backward, d128, FA2 grid (16k tokens, 16 heads), ms per call; speed-up = default / exp_il; "
          "x cuDNN = cuDNN ms / ours")
    print(f"{'dtype':>8} {'causal':>6} {'seqlen':>6} | {'default':>7} {'exp_il':>7} {'cudnn':>7} | {'speed-up':>8} | "
          f"{'def x cuDNN':>11} {'il x cuDNN':>10}")
    for (dt, c, s), ms in rows:
        de, il, cu = ms.get("default"), ms.get("exp_il"), ms.get("cudnn")
        f = lambda x: f"{x:>7.3f}" if x else f"{'-':>7}"  # noqa: E731
        r = lambda x, w: f"{cu / x:>{w}.3f}" if cu and x else f"{'-':>{w}}"  # noqa: E731
        su = f"{de / il:>8.3f}" if de and il else f"{'-':>8}"
        print(f"{dt:>8} {int(c):>6} {s:>6} | {f(de)} {f(il)} {f(cu)} | {su} | {r(de, 11)} {r(il, 10)}")
    print(f"check: {'skipped' if '--skip-check' in argv else ('ok' if not failed else f'{failed} FAILED')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
