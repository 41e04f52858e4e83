"""Diagnostic (GPU, compute capability 9.0): the Hopper backward (cuda_src/flash_bwd_sm90.cu) on small ragged shapes,
every head dim it compiles, both dtypes, causal and not, GQA, each dQ strategy and the score modifiers, checked
against the float64 reference -- fast enough to run under compute-sanitizer:

    compute-sanitizer --tool memcheck  python -m bench.diag.sm90_bwd_check
    compute-sanitizer --tool racecheck python -m bench.diag.sm90_bwd_check --quick
    compute-sanitizer --tool synccheck python -m bench.diag.sm90_bwd_check --quick
    ... [--dq atomic,ordered,seqpar] [--causal-only] [--headdims 256]   (a subset: those dQ strategies, the causal
                                                                          cases only, those head dims)
    ... --split-ordered     the column-split kernel's "ordered" turned on (cuflash._bwd_sm90.SPLIT_ORDERED; without
                            it head dim 256 runs "ordered" only where configured: SM90_BWD_SPLIT_ORDERED)
    ... --rot               "ordered" without a mask forced into DQ_ORDER_ROT (cuflash._bwd_sm90.PLAIN_ORDER; the
                            cases' KV tiles fit half the SMs, so it runs wherever "ordered" does)
    ... --persistent N      the persistent form forced on (cuflash._bwd_sm90.PERSIST) with a grid of at most N
                            blocks, so that each block walks several tiles (it runs at head dims 64 and 128, "atomic"
                            and "seqpar", no modifiers; the other cases take their usual kernels)
    ... --stream-k N        stream-K forced on (cuflash._bwd_sm90.STREAM_K) with a grid of at most N blocks, on cases
                            without a mask whose tile counts leave the last wave part-empty at N = 3 (two of the
                            three at each head dim: 4 and 10 tiles of 128 keys, 8 and 20 of 64 at head dim 256)
    ... --m80               the 80-row Q tiles forced on (cuflash._bwd_sm90.M80) at head dims 128 and 120 (the 128
                            kernel, padding columns), without a mask, "atomic" and "seqpar" (dQ^T staged in the T
                            layout and its convert), a partial last Q tile of 1-79 rows in every case

Prints one line per case (the max abs error of dq, dk, dv against float64 and whether any is NaN); exit status 1
when a gradient misses 3x torch's own low-precision error (the GPU tests' rule, conftest.py) or is NaN.
"""
from __future__ import annotations

import sys

import numpy as np


# the absolute floor of the GPU tests' rule (tests/conftest.py: ERR_FLOOR): a gradient that is exactly 0 (one key:
# dS = P (dP - D) = 0) comes out at the fp32 rounding of dP - D, where torch's own error can be 0
ERR_FLOOR = 1e-5


def _case(b, sq, sk, h, hk, d, dtype, causal, dq_strategy, opts):
    import torch

    import cuflash
    from cuflash import reference

    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **opts)
    dout = torch.randn_like(out)
    grads = cuflash.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, dq_strategy=dq_strategy,
                                        deterministic=dq_strategy != "atomic", backend="sm90", **opts)
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


def main(argv):
    quick = "--quick" in argv
    dtypes = ("float16",) if quick else ("float16", "bfloat16")
    cases = [(1, 130, 77, 2, 1), (1, 77, 200, 2, 2)] if quick else [(1, 130, 77, 2, 1), (1, 77, 200, 2, 2),
                                                                     (2, 1, 1, 2, 2), (1, 300, 301, 4, 2)]
    strategies = argv[argv.index("--dq") + 1].split(",") if "--dq" in argv else ("atomic", "ordered", "seqpar")
    causals = (True,) if "--causal-only" in argv else (False, True)
    dims = [int(x) for x in argv[argv.index("--headdims") + 1].split(",")] if "--headdims" in argv else (64, 96, 128,
                                                                                                          256)
    from cuflash import _bwd_sm90
    from cuflash._configs import DQ_ORDER_ROT, kernel_headdim, sm90_bwd_tile

    if "--stream-k" in argv:
        _bwd_sm90.STREAM_K, _bwd_sm90.PERSIST_MAX_GRID = True, int(argv[argv.index("--stream-k") + 1])
        cases, causals = [(1, 77, 200, 2, 2), (1, 300, 520, 4, 2), (2, 130, 640, 4, 1)], (False,)
    if "--m80" in argv:
        _bwd_sm90.M80 = True
        cases += [(1, 161, 700, 4, 4)]
        causals, dims = (False,), [int(x) for x in argv[argv.index("--headdims") + 1].split(",")] if (
            "--headdims" in argv) else (128, 120)
        strategies = [x for x in strategies if x != "ordered"]
    if "--split-ordered" in argv:
        _bwd_sm90.SPLIT_ORDERED = True
    if "--rot" in argv:
        _bwd_sm90.PLAIN_ORDER = DQ_ORDER_ROT
    if "--persistent" in argv:
        _bwd_sm90.PERSIST, _bwd_sm90.PERSIST_MAX_GRID = True, int(argv[argv.index("--persistent") + 1])

    failed = 0
    for dtype in dtypes:
        for d in dims:
            split = sm90_bwd_tile(kernel_headdim(d)).split  # the column-split kernel
            for causal in causals:
                for dq in strategies:
                    for opts in ({}, dict(window_size=(40, 8), softcap=5.0)):
                        if (quick and opts and dq != "atomic") or (opts and (causal or dq == "ordered")):
                            continue
                        if split and dq == "ordered" and not _bwd_sm90.split_ordered():
                            continue  # (its "ordered" turned off)
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
