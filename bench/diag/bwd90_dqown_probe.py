"""Diagnostic (GPU, compute capability 9.0): the Hopper backward's DQ_OWN variant (cuda_src/flash_bwd_sm90.cu: each
consumer warpgroup computes and stages its own partial dQ over its 64 keys, so the two consumers no longer meet at a
named barrier every Q tile; cuflash._configs.sm90_bwd_dq_own_tile, head dims 96 and 128, no score modifiers) against
the default kernel, checked and then timed next to SDPA's cuDNN backward:

    python -m bench.diag.bwd90_dqown_probe [--quick] [--rounds N] [--time-limit SECONDS] [--skip-check] [--json FILE]

1. Check (small ragged shapes: seqlen_q != seqlen_k both ways, GQA / MQA, a single key; fp16 and bf16; head dims 96
   and 128; causal and not; dQ strategies atomic, ordered and seqpar). Per case the variant's gradients must be
   within 3x torch's own low-precision error of the float64 reference (bench.diag.sm90_bwd_check's rule, the GPU
   tests'), within fp32-accumulation differences of the default kernel's on the same inputs (2^-6 of the largest
   gradient: the partial sums are added in another order), and, for ordered and seqpar, bitwise equal to a second
   run. A failure prints FAIL and sets exit status 1; one "ok" line per group otherwise.
2. Timing: the FA2 grid at head dim 128 (batch x seqlen = 16k tokens, 16 heads), 2k-16k, fp16 and bf16, causal and
   not; default and variant with the "atomic" strategy and with "ordered" (each one plan of
   cuflash.backward._make_plan, called directly) and cuDNN (SDPA, the backward through autograd), timed in turn in
   each round, CALLS back-to-back calls per timing, medians over the rounds (bench.harness.time_rounds). Points are
   not started past --time-limit seconds (default 170) from the start. The table (last) gives ms, the variant's
   speed-up over the default (default ms / variant ms) and cuDNN's time over each (> 1: faster than cuDNN).
"""
from __future__ import annotations

import json
import sys
import time

CALLS = 5
SHAPES = ((1, 130, 77, 2, 1), (1, 77, 200, 2, 2), (2, 1, 1, 2, 2), (1, 300, 301, 4, 2), (2, 700, 513, 8, 2))
QUICK_SHAPES = ((1, 130, 77, 2, 1), (2, 700, 513, 8, 2))


def _set_own(on):
    from cuflash import _bwd_sm90, _configs, backward as bwd_mod

    _bwd_sm90.TILE_OVERRIDES.clear()
    if on:
        _bwd_sm90.TILE_OVERRIDES.update({d: _configs.sm90_bwd_dq_own_tile(d)
                                         for d in _configs.SM90_BWD_DQ_OWN_HEADDIMS})
    bwd_mod._PLANS.clear()


def precompile():
    """The default and DQ_OWN main kernels of head dims 96 and 128 (plain, causal, ordered causal), in parallel."""
    from cuflash._configs import SM90_BWD_DQ_OWN_HEADDIMS, sm90_bwd_specs
    from cuflash.precompile import compile_specs

    specs = [s for s in sm90_bwd_specs() if int(s.name.split(", ")[1]) in SM90_BWD_DQ_OWN_HEADDIMS]
    compile_specs(specs, progress=True)


def check_case(dtype, d, causal, dq, shape):
    """(ok, line) for one case: the variant against the float64 reference and against the default kernel."""
    import torch

    import cuflash

    from .sm90_bwd_check import case_inputs, reference_check

    inputs = case_inputs(*shape, d, dtype, causal, {})

    def grads():
        return cuflash.flash_attn_backward(*inputs, causal=causal, dq_strategy=dq, deterministic=dq != "atomic",
                                           backend="sm90")

    try:
        _set_own(False)
        ref = [x.float() for x in grads()]
        _set_own(True)
        a = grads()
        again = [x.float() for x in grads()]
    finally:
        _set_own(False)
    ok_ref, errs = reference_check(inputs, a, causal, {})
    a = [x.float() for x in a]
    diffs = [(x - r).abs().max().item() for x, r in zip(a, ref)]
    close = all(e <= 2 ** -6 * r.abs().max().item() + 1e-5 for e, r in zip(diffs, ref))
    repeat = all(torch.equal(x, y) for x, y in zip(a, again))
    same = all(torch.equal(x, r) for x, r in zip(a, ref))
    ok = ok_ref and close and (repeat or dq == "atomic")
    b, sq, sk, h, hk = shape
    line = (f"{'ok  ' if ok else 'FAIL'} {dtype:>8} d{d} causal={int(causal)} dq={dq:<7} b{b} sq{sq} sk{sk} "
            f"h{h}/{hk}: ref {int(ok_ref)} (max|err| dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}); "
            f"max|variant-default| dq {diffs[0]:.1e} dk {diffs[1]:.1e} dv {diffs[2]:.1e} repeat={int(repeat)} "
            f"=def={int(same)}")
    return ok, line


def check(quick):
    failed = 0
    shapes = QUICK_SHAPES if quick else SHAPES
    for dtype in ("float16", "bfloat16"):
        for d in (96, 128):
            for causal in (False, True):
                for dq in ("atomic", "ordered", "seqpar"):
                    for shape in shapes:
                        ok, line = check_case(dtype, d, causal, dq, shape)
                        failed += not ok
                        if not ok or shape == shapes[-1]:
                            print(line, flush=True)
    print(f"check: {failed} failed", flush=True)
    return failed


def _plan(views, causal, own, strategy):
    from cuflash import backward as bwd_mod

    try:
        _set_own(own)
        plan = bwd_mod._make_plan(*views, None, causal, strategy, strategy == "ordered", None, "auto", None,
                                  backend="sm90")
    finally:
        _set_own(False)
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
    fns = {"default": _plan(views, causal, False, "atomic"), "dq_own": _plan(views, causal, True, "atomic"),
           "ord_default": _plan(views, causal, False, "ordered"), "ord_dq_own": _plan(views, causal, True, "ordered")}
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

    t0 = time.perf_counter()
    if torch.cuda.get_device_capability() != (9, 0):
        print("needs a compute capability 9.0 GPU (the sm90 backward)")
        return 2
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    limit = float(argv[argv.index("--time-limit") + 1]) if "--time-limit" in argv else 170.0
    precompile()
    failed = 0 if "--skip-check" in argv else check("--quick" in argv)
    rows = []
    for dt in ("float16", "bfloat16"):
        for causal in (False, True):
            for s in (2048, 4096, 8192, 16384):
                if time.perf_counter() - t0 > limit:
                    print(f"time limit: {dt} causal={int(causal)} {s} not timed", flush=True)
                    continue
                ms = time_point(dt, causal, s, rounds)
                rows.append(((dt, causal, s), ms))
                print(dt, f"causal={int(causal)}", s, {k: round(x, 3) if x else x for k, x in ms.items()}, flush=True)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump([dict(dtype=dt, causal=c, seqlen=s, batch=16384 // s, heads=16, d=128, ms=ms)
                       for (dt, c, s), ms in rows], f, indent=1)
    print(f"\nsm90 backward, d128, FA2 grid (16k tokens, 16 heads), ms per call ({rounds} rounds, {CALLS} calls per "
          "timing); speed-up = default / dq_own (atomic; ordered: ord); x cuDNN = cuDNN ms / ours")
    print(f"{'dtype':>8} {'causal':>6} {'seqlen':>6} | {'default':>7} {'dq_own':>7} {'cudnn':>7} | {'speed-up':>8} "
          f"{'ord':>6} | {'def x cuDNN':>11} {'own x cuDNN':>11}")
    for (dt, c, s), ms in rows:
        de, ow, cu = ms.get("default"), ms.get("dq_own"), ms.get("cudnn")
        od, oo = ms.get("ord_default"), ms.get("ord_dq_own")
        f = lambda x: f"{x:>7.3f}" if x else f"{'-':>7}"  # noqa: E731
        r = lambda x, w: f"{cu / x:>{w}.3f}" if cu and x else f"{'-':>{w}}"  # noqa: E731
        su = f"{de / ow:>8.3f}" if de and ow else f"{'-':>8}"
        so = f"{od / oo:>6.3f}" if od and oo else f"{'-':>6}"
        print(f"{dt:>8} {int(c):>6} {s:>6} | {f(de)} {f(ow)} {f(cu)} | {su} {so} | {r(de, 11)} {r(ow, 11)}")
    print(f"check: {'skipped' if '--skip-check' in argv else ('ok' if not failed else f'{failed} FAILED')}"
          f"; {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
