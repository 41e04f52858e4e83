"""Diagnostic (GPU, compute capability 9.0): what a block of the Hopper backward costs beyond its Q-tile iterations,
at head dim 128 without a mask. The grid is held fixed (seqlen_k 2048: 16 KV tiles x 16 heads x batch 8, 2048 blocks,
15.5 per SM) while seqlen_q grows by whole Q tiles of both tiles (multiples of 320 = 4 x 80 = 5 x 64 rows), so every
block runs the same number of iterations; the GPU time of a call (queued behind a spin kernel: no host time) is then
a line in the iterations per block, and its intercept is what the call costs whatever the rows -- the blocks' own
set-up and end (barriers, the K / V loads before the first product, the dK / dV stores after the last), about 16 of
them one after another on each SM, plus the kernels' launches:

    python -m bench.diag.bwd_block_cost [--rounds N] [--json FILE]

Variants, each one plan (cuflash.backward._make_plan, "atomic") of the same inputs: m80 (the 80-row Q tiles, one
block per tile), m80p (the same in the persistent form: at most one block per SM walking the tiles, each tile's K / V
load under the previous tile's end), tile (64-row tiles, one block per tile), persist (64-row tiles, persistent),
each timed as the whole call ("<name>": preprocess, main kernel, dQ convert) and as its main kernel alone
("<name>.main": the plan's launches cut to the main kernel after a whole call set up the workspace); and SDPA's cuDNN
backward through autograd (its three kernels; cuDNN's main kernel is persistent). Every variant's gradients must
match the 64-row tile's to fp32 rounding before timing (a failure prints FAIL and sets exit status 1). Printed:
the ms per seqlen_q, then per variant the least-squares line ms = a + b x (Q-tile iterations of 80 rows per block),
its intercept a in us, and that intercept per block of an SM's sequence (a / 16)."""
from __future__ import annotations

import json
import sys

SEQLEN_K, BATCH, HEADS, HEADDIM = 2048, 8, 16, 128
SEQLENS_Q = (320, 640, 960, 1280, 1600, 1920, 2240)
VARIANTS = (("m80", dict(M80=True, PERSIST=False)), ("m80p", dict(M80=True, PERSIST=True)),
            ("tile", dict(M80=False, PERSIST=False)), ("persist", dict(M80=False, PERSIST=True, STREAM_K=False)))


def problem(dt, sq):
    """A fresh random problem of seqlen_q sq (q, k, v, dout, the backward's validated views)."""
    import torch

    import cuflash
    from cuflash.backward import check_backward_inputs

    tdt = getattr(torch, dt)
    q = torch.randn(BATCH, sq, HEADS, HEADDIM, device="cuda", dtype=tdt)
    k, v = (torch.randn(BATCH, SEQLEN_K, HEADS, HEADDIM, device="cuda", dtype=tdt) for _ in range(2))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(out)
    return q, k, v, dout, check_backward_inputs(dout, q, k, v, out, lse)


def main_only(fn):
    """The plan call `fn` (ordered_probe.plan_call) with its launches cut to the main kernel: run once whole first,
    so that the workspace holds lse_log2 and D (the dQ accumulator then only grows)."""
    plan = fn.plan
    fn()
    plan.launches = (plan.launches[1],)
    return fn


def run_point(dt, sq, rounds):
    import torch

    from ..harness import time_queued_ms
    from .ordered_probe import plan_call, time_with_cudnn

    q, k, v, dout, views = problem(dt, sq)
    fns = {name: plan_call(views, False, "atomic", **knobs) for name, knobs in VARIANTS}
    ref = [x.float() for x in fns["tile"]()]
    ok = True
    for name in ("m80", "m80p", "persist"):
        got = fns[name]()
        torch.cuda.synchronize()
        if not all((x.float() - r).abs().max().item() <= 2 ** -6 * r.abs().max().item() for x, r in zip(got, ref)):
            ok = False
            print(f"FAIL {dt} sq{sq}: {name}'s gradients differ from the 64-row tile's", flush=True)
        del got
    del ref
    for name, knobs in VARIANTS:
        fns[name + ".main"] = main_only(plan_call(views, False, "atomic", **knobs))
    ms = time_with_cudnn(fns, q, k, v, dout, rounds, f"{dt} sq{sq}", False,
                         timer=lambda fn: time_queued_ms(fn, rep=10))
    return ms, ok


def fit(xs, ys):
    """Least-squares line y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def report(dt, rows):
    """Print the ms table and each variant's line over rows [(seqlen_q, {name: ms})]."""
    names = [n for n in rows[0][1] if all(r[1].get(n) for r in rows)]
    print(f"\n{dt}, head dim 128, seqlen_k {SEQLEN_K}, batch {BATCH} x {HEADS} heads (2048 blocks of one tile each), "
          "GPU time per call (queued), ms")
    print(f"{'seqlen_q':>8} | " + " ".join(f"{n:>12}" for n in names))
    for sq, ms in rows:
        print(f"{sq:>8} | " + " ".join(f"{ms[n]:>12.4f}" for n in names))
    print("\nline ms = a + b x (x: Q-tile iterations of 80 rows per block = seqlen_q / 80); a in us, a / 16 (per "
          "block of an SM's sequence)")
    out = {}
    for n in names:
        a, b = fit([sq / 80 for sq, _ in rows], [ms[n] for _, ms in rows])
        out[n] = (a, b)
        print(f"{n:>12}: a = {1000 * a:8.1f} us, b = {1000 * b:7.2f} us per iteration, "
              f"a / 16 = {1000 * a / 16:6.2f} us")
    return out


def main(argv):
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        print("needs a compute capability 9.0 GPU (the sm90 backward)")
        return 2
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    dtypes = tuple(argv[argv.index("--dtypes") + 1].split(",")) if "--dtypes" in argv else ("float16",)
    all_ok, res = True, {}
    for dt in dtypes:
        rows = []
        for sq in SEQLENS_Q:
            ms, ok = run_point(dt, sq, rounds)
            all_ok &= ok
            rows.append((sq, ms))
            print(dt, sq, {k: round(v, 4) for k, v in ms.items()}, flush=True)
        res[dt] = dict(rows=rows, lines=report(dt, rows))
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
