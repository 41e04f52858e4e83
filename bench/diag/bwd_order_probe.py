"""Diagnostic (GPU, compute capability 9.0): the Hopper backward's causal kernels in the launch's dispatch order
(each head's KV tiles in turn) against the grouped orders (cuda_src/flash_bwd_sm90.cu, GROUP: the longest KV tiles
first within groups of G (KV head, batch) pairs; cuflash._bwd_sm90.CAUSAL_GROUP), with SDPA's cuDNN backward, timed
in turn (medians of rounds), on the FA2 grid's causal points (batch 16k / seqlen, 2048 / d heads) and four GQA points
(bench/diag/ordered_probe.py's):

    python -m bench.diag.bwd_order_probe [--rounds N] [--groups 4,8,16] [--quick] [--headdims 64,128] [--json FILE]
                                         [--heads-inner] [--gqa-only] [--gqa-grid]
    python -m bench.diag.bwd_order_probe --model      (CPU: bench/diag/bwd_grid_model.py's prediction, no GPU)

--heads-inner adds the walk with the Q tiles outer, last first, and the KV head's query heads inner
(DQ_ORDER_HEADS_INNER; cuflash._bwd_sm90.HEADS_INNER) in the launch's order (hi0) and in each grouped order (hi<G>);
--gqa-only keeps the points with more than one query head per KV head; --gqa-grid times GQA_GRID's points instead
(query / KV heads 64 / 8, 32 / 8, 16 / 2 at 2k-8k, head dims 128 and 256: bench/results/h100/bwd-heads-inner.log).
Each cuflash variant is one plan (cuflash.backward._make_plan, dq_strategy "atomic") called directly, 5
back-to-back calls per timing (cuDNN through autograd the same way; bench/diag/ordered_probe.py: time_with_cudnn).
Before timing, each grouped variant's gradients must match the launch order's to fp32 rounding (the additions into
dQ come in another order); a failure prints FAIL and sets exit status 1. The table (last) gives ms and each variant's speed as a fraction of the launch order's
(launch ms / variant ms); the model's prediction for the same points is printed beside it."""
from __future__ import annotations

import sys

from .ordered_probe import points  # the FA2 grid's causal points and four GQA points

GROUPS = (4, 8, 16)
# (dtype, d, seqlen, batch, heads, kv heads): GQA points beside the FA2 grid's 16k tokens per batch
GQA_GRID = (("bfloat16", 128, 8192, 2, 64, 8), ("float16", 128, 4096, 4, 32, 8), ("float16", 128, 8192, 2, 32, 8),
            ("float16", 128, 2048, 8, 32, 8), ("float16", 128, 8192, 2, 16, 2), ("float16", 256, 8192, 2, 16, 8),
            ("float16", 256, 4096, 4, 16, 2), ("float16", 128, 4096, 4, 64, 8))


def predicted(d, s, b, h, hk, group):
    """The model's launch-order makespan over the grouped one's (> 1: the grouped order predicted faster). GQA: the
    model's blocks are (KV head, batch) pairs, each as long as its group of query heads (all alike)."""
    from cuflash._configs import SM90_BWD_TILES

    from .bwd_grid_model import overhead

    if SM90_BWD_TILES[d].split:  # (the model's blocks are 128-key tiles)
        return float("nan")
    bm = SM90_BWD_TILES[d].block_m
    return overhead(s, hk, b, bm, True, "head-major") / overhead(s, hk, b, bm, True, f"tile-major/{group}")


def _plan(views, group, heads_inner=False):
    from .ordered_probe import plan_call

    return plan_call(views, True, "atomic", CAUSAL_GROUP=group, HEADS_INNER=heads_inner)


def variants(groups, heads_inner):
    """(name, group, heads_inner) of every variant timed beside the launch order ("launch")."""
    out = [(f"g{g}", g, False) for g in groups]
    if heads_inner:
        out += [(f"hi{g}", g, True) for g in (0,) + tuple(groups)]
    return out


def run_point(dt, d, s, b, h, hk, rounds, groups, heads_inner=False):
    import torch

    from .ordered_probe import causal_problem, time_with_cudnn

    q, k, v, dout, views = causal_problem(dt, d, s, b, h, hk)
    fns = {"launch": _plan(views, 0)}
    fns.update({name: _plan(views, g, hi) for name, g, hi in variants(groups, heads_inner)})
    ok = True
    ref = [x.float() for x in fns["launch"]()]
    for name, _, _ in variants(groups, heads_inner):
        a = fns[name]()
        torch.cuda.synchronize()
        close = all((x.float() - r).abs().max().item() <= 2 ** -6 * r.abs().max().item() for x, r in zip(a, ref))
        if not close:
            ok = False
            print(f"FAIL {dt} d{d} s{s} h{h}/{hk} {name}: gradients differ from the launch order's", flush=True)
        del a
    del ref
    return time_with_cudnn(fns, q, k, v, dout, rounds, f"{dt} d{d} s{s} h{h}/{hk}"), ok


def _groups(argv):
    if "--groups" not in argv:
        return GROUPS
    gs = tuple(int(x) for x in argv[argv.index("--groups") + 1].split(",") if x)
    if not gs or min(gs) < 1:
        raise ValueError(f"--groups: a comma list of group sizes >= 1; got {gs!r}")
    return gs


def _headdims(argv):
    if "--headdims" not in argv:
        return (64, 128)
    return tuple(int(x) for x in argv[argv.index("--headdims") + 1].split(",") if x)


def main(argv):
    groups = _groups(argv)
    dims = _headdims(argv)
    if "--model" in argv:
        print("model: the launch order's makespan / the grouped order's (> 1: grouped predicted faster)")
        print(f"{'d':>4} {'seqlen':>6} {'b':>2} {'h/hk':>6} | " + " ".join(f"{f'g{g}':>6}" for g in groups))
        for dt, d, s, b, h, hk in points("--quick" in argv, dims):
            if dt == "float16":
                print(f"{d:>4} {s:>6} {b:>2} {f'{h}/{hk}':>6} | "
                      + " ".join(f"{predicted(d, s, b, h, hk, g):>6.3f}" for g in groups))
        return 0
    from .ordered_probe import run_points

    hi = "--heads-inner" in argv
    pts = list(GQA_GRID) if "--gqa-grid" in argv else [p for p in points("--quick" in argv, dims)
                                                        if "--gqa-only" not in argv or p[4] != p[5]]
    rows, all_ok = run_points(argv, pts, lambda *a: run_point(*a, groups, hi), default_rounds=3)
    if rows is None:
        return 2
    names = variants(groups, hi)
    print("\ncausal backward (atomic), ms per call (launch order, cuDNN) and each variant's speed as a fraction "
          "of the launch order's, measured (model: the grouped orders')")
    print(f"{'dtype':>8} {'d':>4} {'seqlen':>6} {'h/hk':>6} | {'launch':>7} {'cudnn':>7} | "
          + " ".join(f"{n:>14}" for n, _, _ in names) + " | check")
    for (dt, d, s, b, h, hk), ms, ok in rows:
        a = ms.get("launch")
        fr = " ".join((f"{a / ms[n]:>6.3f} ({predicted(d, s, b, h, hk, g):>5.3f})" if not inner else
                       f"{a / ms[n]:>14.3f}") if a and ms.get(n) else f"{'-':>14}" for n, g, inner in names)
        cd = f"{ms['cudnn']:>7.3f}" if ms.get("cudnn") else f"{'-':>7}"
        print(f"{dt:>8} {d:>4} {s:>6} {f'{h}/{hk}':>6} | {a:>7.3f} {cd} | {fr} | {'ok' if ok else 'FAIL'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
