"""Diagnostic (GPU, compute capability 9.0): the Hopper backward's 80-row Q tiles at head dim 128 without a mask
(cuda_src/flash_bwd_sm90.cu, BLOCK_M = 80: dQ computed transposed, staged in the T accumulator layout and converted
by flash_bwd_convert_dq_t_kernel; cuflash._configs.SM90_BWD_M80_SEQLEN_K), one block per tile ("m80") and in its
persistent form ("m80p": at most one block per SM walking the tiles), against the 64-row tile -- one block per tile
("tile") and as configured ("conf": the persistent form where cuflash._configs.sm90_bwd_persistent takes it) -- and
SDPA's cuDNN backward, timed in turn (medians of rounds), on the FA2 grid at head dim 128 (batch 16k / seqlen, 16
heads), fp16 and bf16, and GQA 64 / 8 heads at 8k:

    python -m bench.diag.bwd_m80_probe [--rounds N] [--seqlens 1024,2048] [--dtypes float16] [--json FILE]

Each cuflash variant is one plan (cuflash.backward._make_plan, dq_strategy "atomic") called directly; cuDNN through
autograd. Every timing is of 10 single calls, each queued behind a ~3 ms spin kernel with its start event after the
spin (bench.harness.time_queued_ms): the backwards' GPU time. Before timing, both 80-row forms' gradients must match
the 64-row tile's to fp32 rounding (2^-6 of the largest element: the additions into dQ come in another order and
the products in other groupings); a failure prints FAIL and sets exit status 1. The table gives ms, the 80-row tile's
speed over each 64-row variant's and its persistent form's over it (their ms / its ms), and each variant against
cuDNN (cuDNN ms / cuflash ms)."""
from __future__ import annotations

import sys

SEQLENS = (1024, 2048, 4096, 8192, 16384)


def points(seqlens=SEQLENS, dtypes=("float16", "bfloat16")):
    """(dtype, head dim, seqlen, batch, heads, kv heads, causal) of the FA2 grid at head dim 128 without a mask, and
    GQA 64 / 8 heads at 8k (fp16)."""
    pts = [(dt, 128, s, 16384 // s, 16, 16, False) for dt in dtypes for s in seqlens]
    return pts + [("float16", 128, 8192, 2, 64, 8, False)]


def run_point(dt, d, s, b, h, hk, causal, rounds):
    import torch

    from ..harness import time_queued_ms
    from .ordered_probe import causal_problem, plan_call, time_with_cudnn

    q, k, v, dout, views = causal_problem(dt, d, s, b, h, hk, causal)
    fns = {"conf": plan_call(views, causal, "atomic", M80=False),
           "tile": plan_call(views, causal, "atomic", M80=False, PERSIST=False),
           "m80": plan_call(views, causal, "atomic", M80=True, PERSIST=False),
           "m80p": plan_call(views, causal, "atomic", M80=True, PERSIST=True)}
    ref = [x.float() for x in fns["tile"]()]
    ok = True
    for name in ("m80", "m80p"):
        got = fns[name]()
        torch.cuda.synchronize()
        if not all((x.float() - r).abs().max().item() <= 2 ** -6 * r.abs().max().item() for x, r in zip(got, ref)):
            ok = False
            errs = [round((x.float() - r).abs().max().item() / r.abs().max().item(), 5) for x, r in zip(got, ref)]
            print(f"FAIL {dt} d{d} s{s} h{h}/{hk}: {name}'s gradients differ (dq, dk, dv: {errs})", flush=True)
        del got
    del ref
    return time_with_cudnn(fns, q, k, v, dout, rounds, f"{dt} d{d} s{s} h{h}/{hk}", causal,
                           timer=lambda fn: time_queued_ms(fn, rep=10)), ok


def table(rows):
    """Print the probe's table of rows ((dtype, d, seqlen, batch, heads, kv heads, causal), {name: ms}, ok)."""
    print("\nbackward (atomic), head dim 128 without a mask, GPU time per call (queued), ms: the 64-row tile as "
          "configured (conf) and one block per tile (tile), the 80-row tile one block per tile (m80) and persistent "
          "(m80p), cuDNN; the 80-row tile's speed over each 64-row variant and m80p's over m80 (their ms / its ms); "
          "each against cuDNN (cuDNN ms / cuflash ms)")
    print(f"{'dtype':>8} {'seqlen':>6} {'h/hk':>6} | {'conf':>7} {'tile':>7} {'m80':>7} {'m80p':>7} {'cudnn':>7} | "
          f"{'conf/m80':>8} {'tile/m80':>8} {'m80/m80p':>8} | {'cuDNN/c':>7} {'cuDNN/80':>8} {'cuDNN/80p':>9} | check")
    f = lambda x: f"{x:>7.3f}" if x else f"{'-':>7}"  # noqa: E731
    r = lambda a, b_, w=7: f"{a / b_:>{w}.3f}" if a and b_ else f"{'-':>{w}}"  # noqa: E731
    for (dt, d, s, b, h, hk, c), ms, ok in rows:
        cf, t, m, mp, cd = ms.get("conf"), ms.get("tile"), ms.get("m80"), ms.get("m80p"), ms.get("cudnn")
        print(f"{dt:>8} {s:>6} {f'{h}/{hk}':>6} | {f(cf)} {f(t)} {f(m)} {f(mp)} {f(cd)} | {r(cf, m, 8)} {r(t, m, 8)} "
              f"{r(m, mp, 8)} | {r(cd, cf)} {r(cd, m, 8)} {r(cd, mp, 9)} | {'ok' if ok else 'FAIL'}")


def main(argv):
    seqlens = (tuple(int(x) for x in argv[argv.index("--seqlens") + 1].split(",")) if "--seqlens" in argv
               else SEQLENS)
    dtypes = tuple(argv[argv.index("--dtypes") + 1].split(",")) if "--dtypes" in argv else ("float16", "bfloat16")
    from .ordered_probe import run_points

    rows, all_ok = run_points(argv, points(seqlens, dtypes), run_point, default_rounds=3)
    if rows is None:
        return 2
    table(rows)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
