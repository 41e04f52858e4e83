"""Diagnostic (GPU, compute capability 9.0): the Hopper backward (cuda_src/flash_bwd_sm90.cu) on small ragged shapes,
every head dim it compiles, both dtypes, causal and not, GQA, each dQ strategy and the score modifiers, checked
against the float64 reference -- fast enough to run under compute-sanitizer:

    compute-sanitizer --tool memcheck  python -m bench.diag.sm90_bwd_check
    compute-sanitizer --tool racecheck python -m bench.diag.sm90_bwd_check --quick
    compute-sanitizer --tool synccheck python -m bench.diag.sm90_bwd_check --quick
    ... [--dq atomic,ordered,seqpar] [--causal-only]    (a subset: those dQ strategies, the causal cases only)

Prints one line per case (the max abs error of dq, dk, dv against float64 and whether any is NaN); exit status 1
when a gradient misses 3x torch's own low-precision error (the GPU tests' rule, conftest.py) or is NaN.
"""
from __future__ import annotations

import sys

import numpy as np


# the absolute floor of the GPU tests' rule (tests/conftest.py: ERR_FLOOR): a gradient that is exactly 0 (one key:
# dS = P (dP - D) = 0) comes out at the fp32 rounding of dP - D, where torch's own error can be 0
ERR_FLOOR = 1e-5


def case_inputs(b, sq, sk, h, hk, d, dtype, causal, opts):
    """(dout, q, k, v, out, lse) of a fresh random problem (the forward by cuflash)."""
    import torch

    import cuflash

    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **opts)
    return torch.randn_like(out), q, k, v, out, lse


def reference_check(inputs, grads, causal, opts):
    """(ok, [max |err| of dq, dk, dv]): `grads` against the float64 reference, each within 3x torch's own error in
    the inputs' dtype (+ ERR_FLOOR) and finite."""
    import torch

    from cuflash import reference

    dout, q, k, v, _, _ = inputs
    sq, sk, h, hk, d = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    torch.cuda.synchronize()
    f = lambda x: x.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    ref = reference.attention_backward(f(dout), f(q), f(k), f(v), None, causal, opts.get("window_size", (-1, -1)),
                                       opts.get("softcap", 0.0))
    # torch's own error in the inputs' dtype: the yardstick
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    g = h // hk
    s = (qq.transpose(1, 2) @ kk.transpose(1, 2).repeat_interleave(g, 1).transpose(-1, -2)) * d ** -0.5
    if opts.get("softcap"):
        s = opts["softcap"] * torch.tanh(s / opts["softcap"])
    vis = torch.from_numpy(reference.visible_mask(sq, sk, causal, opts.get("window_size", (-1, -1)))).cuda()
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
    (p @ vv.transpose(1, 2).repeat_interleave(g, 1)).transpose(1, 2).backward(dout)
    errs, ok = [], True
    for ours, lp, r in zip(grads, (qq.grad, kk.grad, vv.grad), ref):
        e, el = np.abs(f(ours) - r).max(), np.abs(f(lp) - r).max()
        errs.append(e)
        ok &= bool(np.isfinite(f(ours)).all()) and e <= 3.0 * el + ERR_FLOOR
    return ok, errs


def _case(b, sq, sk, h, hk, d, dtype, causal, dq_strategy, opts):
    import cuflash

    inputs = case_inputs(b, sq, sk, h, hk, d, dtype, causal, opts)
    grads = cuflash.flash_attn_backward(*inputs, causal=causal, dq_strategy=dq_strategy,
                                        deterministic=dq_strategy != "atomic", backend="sm90", **opts)
    return reference_check(inputs, grads, causal, opts)


def main(argv):
    quick = "--quick" in argv
    dtypes = ("float16",) if quick else ("float16", "bfloat16")
    cases = [(1, 130, 77, 2, 1), (1, 77, 200, 2, 2)] if quick else [(1, 130, 77, 2, 1), (1, 77, 200, 2, 2),
                                                                     (2, 1, 1, 2, 2), (1, 300, 301, 4, 2)]
    strategies = argv[argv.index("--dq") + 1].split(",") if "--dq" in argv else ("atomic", "ordered", "seqpar")
    causals = (True,) if "--causal-only" in argv else (False, True)
    failed = 0
    for dtype in dtypes:
        for d in (64, 96, 128):
            for causal in causals:
                for dq in strategies:
                    for opts in ({}, dict(window_size=(40, 8), softcap=5.0)):
                        if (quick and opts and dq != "atomic") or (opts and (causal or dq == "ordered")):
                            continue
                        for b, sq, sk, h, hk in cases:
                            ok, errs = _case(b, sq, sk, h, hk, d, dtype, causal, dq, opts)
                            failed += not ok
                            print(f"{'ok  ' if ok else 'FAIL'} {dtype} d={d} causal={causal} dq={dq} opts={opts} "
                                  f"b={b} sq={sq} sk={sk} h={h}/{hk}: max|err| dq {errs[0]:.2e} dk {errs[1]:.2e} "
                                  f"dv {errs[2]:.2e}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
