"""Diagnostic (GPU, compute capability 9.0): the Hopper backward's fused dQ convert (cuda_src/flash_bwd_sm90.cu,
FUSE; cuflash._bwd_sm90.FUSED_CONVERT: the block that adds into a Q tile last converts it, no convert kernel) against
the default plan (preprocess, main, convert), checked and then timed next to SDPA's cuDNN backward:

    python -m bench.diag.bwd90_fconv_probe [--quick] [--rounds N] [--time-limit SECONDS] [--skip-check] [--json FILE]

1. Check (ragged shapes: seqlen_q != seqlen_k both ways with rows that see no key, GQA / MQA, a single key; fp16
   and bf16; head dims 64, 96, 128; causal and not; dQ strategies atomic and ordered), the outputs' memory poisoned
   (NaN) before each call. Per case the variant's gradients must be within 3x torch's own low-precision error of
   the float64 reference (the GPU tests' rule) with no NaN, rows that see no key exactly 0, within fp32-accumulation
   differences of the default plan's (2^-6 of the largest gradient), and for "ordered" bitwise equal to the default
   plan's and to a second fused call (the per-Q-tile counters start from zero every call). A failure prints FAIL
   and sets exit status 1; one "ok" line per group otherwise.
2. Timing: the FA2 grid (batch x seqlen = 16k tokens, 2048 / d heads) at head dims 64 and 128, 1k-16k, fp16 and
   bf16, causal and not; default and fused with "atomic" and with "ordered" (each one plan of
   cuflash.backward._make_plan, called directly), and cuDNN (SDPA, the backward through autograd), timed in turn in
   each round, CALLS back-to-back calls per timing, medians over the rounds (bench.harness.time_rounds). Points are
   not started past --time-limit seconds (default 170) after the check; d128 2k first. The table (last) gives ms,
   the fused variant's speed-up (default ms / fused ms, atomic and ordered) and cuDNN's time over each (> 1:
   faster than cuDNN).
"""
from __future__ import annotations

import json
import sys
import time

CALLS = 5
SHAPES = ((1, 130, 77, 2, 1), (1, 77, 200, 2, 2), (2, 1, 1, 2, 2), (1, 300, 301, 4, 2), (2, 700, 513, 8, 2),
          (1, 1000, 300, 4, 4), (1, 1100, 1100, 4, 2))
QUICK_SHAPES = ((1, 130, 77, 2, 1), (1, 1000, 300, 4, 4), (2, 700, 513, 8, 2))


def _set_fused(on):
    from cuflash import _bwd_sm90, backward as bwd_mod

    _bwd_sm90.FUSED_CONVERT = on
    bwd_mod._PLANS.clear()


def precompile():
    """The default and fused main kernels (plain, causal, ordered causal) and the convert kernels, in parallel."""
    from cuflash._configs import DTYPES, SM90_BWD_HEADDIMS, bwd_convert_spec, bwd_preprocess_spec, sm90_bwd_specs
    from cuflash.precompile import compile_specs

    specs = list(sm90_bwd_specs())
    specs += [bwd_convert_spec(dt, d, c, 128) for dt in DTYPES for d in SM90_BWD_HEADDIMS for c in (False, True)]
    specs += [bwd_preprocess_spec(dt, d) for dt in DTYPES for d in SM90_BWD_HEADDIMS]
    compile_specs(list(dict.fromkeys(specs)), progress=True)


def poison():
    import torch

    xs = [torch.full((n,), float("nan"), device="cuda", dtype=torch.float16) for n in
          (1 << 10, 1 << 14, 1 << 17, 1 << 19, 1 << 21, 1 << 23, 1 << 25) for _ in range(2)]
    torch.cuda.synchronize()
    del xs


def _lowp_grads(q, k, v, dout, scale, causal):
    """torch's own low-precision backward (the inputs' dtype; bottom-right causal; rows without a key: 0)."""
    import torch

    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    sq, sk, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    ke, ve = (x.repeat_interleave(g, dim=2) for x in (kk, vv))
    s = torch.einsum("bqhd,bkhd->bhqk", qq, ke) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype)
    torch.einsum("bhqk,bkhd->bqhd", p, ve).backward(dout)
    return qq.grad, kk.grad, vv.grad


def check_case(dtype, d, causal, dq, shape):
    """(ok, line) for one case."""
    import numpy as np
    import torch

    import cuflash
    from cuflash import reference

    b, sq, sk, h, hk = shape
    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)

    def grads():
        poison()
        g = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, dq_strategy=dq,
                                        deterministic=dq != "atomic", backend="sm90")
        torch.cuda.synchronize()
        return g

    try:
        _set_fused(False)
        base = grads()
        _set_fused(True)
        a = grads()
        again = grads()
    finally:
        _set_fused(False)
    f = lambda x: x.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    ref = reference.attention_backward(f(dout), f(q), f(k), f(v), d ** -0.5, causal)
    lowp = _lowp_grads(q, k, v, dout, d ** -0.5, causal)
    errs, ok_ref = [], True
    for x, lp, r in zip(a, lowp, ref):
        e, e_lp = np.abs(f(x) - r).max(), np.abs(f(lp) - r).max()
        errs.append(e)
        ok_ref &= bool(e <= 3 * e_lp + 1e-5) and not torch.isnan(x).any().item()
    nokey = not (causal and sq > sk) or torch.count_nonzero(a[0][:, : sq - sk]).item() == 0
    diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(a, base)]
    close = all(e <= 2 ** -6 * y.float().abs().max().item() + 1e-5 for e, y in zip(diffs, base))
    same = all(torch.equal(x, y) for x, y in zip(a, base))
    repeat = all(torch.equal(x, y) for x, y in zip(a, again))
    ok = ok_ref and nokey and close and (dq == "atomic" or (same and repeat))
    line = (f"{'ok  ' if ok else 'FAIL'} {dtype:>8} d{d} causal={int(causal)} dq={dq:<7} b{b} sq{sq} sk{sk} "
            f"h{h}/{hk}: ref {int(ok_ref)} (max|err| dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}) "
            f"nokey0={int(nokey)}; max|fused-default| dq {diffs[0]:.1e} dk {diffs[1]:.1e} dv {diffs[2]:.1e} "
            f"=def={int(same)} repeat={int(repeat)}")
    return ok, line


def check(quick):
    failed = 0
    shapes = QUICK_SHAPES if quick else SHAPES
    for dtype in ("float16", "bfloat16"):
        for d in (64, 96, 128):
            for causal in (False, True):
                for dq in ("atomic", "ordered"):
                    for shape in shapes:
                        ok, line = check_case(dtype, d, causal, dq, shape)
                        failed += not ok
                        if not ok or shape == shapes[-1]:
                            print(line, flush=True)
    print(f"check: {failed} failed", flush=True)
    return failed


def _plan(views, causal, fused, strategy):
    from cuflash import backward as bwd_mod

    try:
        _set_fused(fused)
        plan = bwd_mod._make_plan(*views, None, causal, strategy, strategy == "ordered", None, "auto", None,
                                  backend="sm90")
    finally:
        _set_fused(False)
    assert len(plan.launches) == (2 if fused else 3)
    ptrs = tuple(a.ptr for a in views)
    return lambda: plan.run(*ptrs)


def time_point(dt, causal, s, d, rounds):
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
    fns = {"default": _plan(views, causal, False, "atomic"), "fused": _plan(views, causal, True, "atomic"),
           "ord_default": _plan(views, causal, False, "ordered"), "ord_fused": _plan(views, causal, True, "ordered")}
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
    t1 = time.perf_counter()
    rows = []
    for d in (128, 64):
        for causal in (False, True):
            for s in (2048, 1024, 4096, 16384):
                for dt in ("float16", "bfloat16"):
                    if time.perf_counter() - t1 > limit:
                        print(f"time limit: d{d} {dt} causal={int(causal)} {s} not timed", flush=True)
                        continue
                    ms = time_point(dt, causal, s, d, rounds)
                    rows.append(((d, dt, causal, s), ms))
                    print(f"d{d}", dt, f"causal={int(causal)}", s, {k: round(x, 3) if x else x for k, x in ms.items()},
                          flush=True)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump([dict(d=d, dtype=dt, causal=c, seqlen=s, batch=16384 // s, heads=2048 // d, ms=ms)
                       for (d, dt, c, s), ms in rows], f, indent=1)
    print(f"\nsm90 backward, FA2 grid (16k tokens, 2048 / d heads), ms per call ({rounds} rounds, {CALLS} calls per "
          "timing); speed-up = default / fused (atomic; ordered: ord); x cuDNN = cuDNN ms / ours")
    print(f"{'d':>3} {'dtype':>8} {'causal':>6} {'seqlen':>6} | {'default':>7} {'fused':>7} {'ord_def':>7} "
          f"{'ord_fus':>7} {'cudnn':>7} | {'speed-up':>8} {'ord':>6} | {'def x cuDNN':>11} {'fus x cuDNN':>11}")
    for (d, dt, c, s), ms in rows:
        de, fu, cu = ms.get("default"), ms.get("fused"), ms.get("cudnn")
        od, of = ms.get("ord_default"), ms.get("ord_fused")
        f = lambda x: f"{x:>7.3f}" if x else f"{'-':>7}"  # noqa: E731
        r = lambda x, w: f"{cu / x:>{w}.3f}" if cu and x else f"{'-':>{w}}"  # noqa: E731
        su = f"{de / fu:>8.3f}" if de and fu else f"{'-':>8}"
        so = f"{od / of:>6.3f}" if od and of else f"{'-':>6}"
        print(f"{d:>3} {dt:>8} {int(c):>6} {s:>6} | {f(de)} {f(fu)} {f(od)} {f(of)} {f(cu)} | {su} {so} | "
              f"{r(de, 11)} {r(fu, 11)}")
    print(f"check: {'skipped' if '--skip-check' in argv else ('ok' if not failed else f'{failed} FAILED')}"
          f"; {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
