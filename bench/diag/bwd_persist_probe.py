"""Diagnostic (GPU, compute capability 9.0): the Hopper backward's persistent form (cuda_src/flash_bwd_sm90.cu,
PERSIST: at most one block per SM walking the tiles, the next tile's loads under the last iteration and the dK / dV
stores of the one before) against one block per tile as configured (the grouped dispatch order where
cuflash._configs.sm90_bwd_causal_group takes it), with SDPA's cuDNN backward, timed in turn (medians of rounds), on
the FA2 grid (batch 16k / seqlen, 2048 / d heads; head dims 64 and 128, fp16 and bf16, causal and not) and two GQA
points:

    python -m bench.diag.bwd_persist_probe [--rounds N] [--quick] [--seqlens 2048,4096] [--headdims 64,128]
                                           [--dtypes float16] [--stream-k] [--json FILE]
    python -m bench.diag.bwd_persist_probe --model      (CPU: bench/diag/bwd_grid_model.py's tails, no GPU)

Each cuflash variant is one plan (cuflash.backward._make_plan, dq_strategy "atomic") called directly; cuDNN through
autograd. Every timing is of 10 single calls, each queued behind a ~3 ms spin kernel with its start event after the
spin (bench.harness.time_queued_ms): the backwards' GPU time, without the host hand-off of a lone call. Before timing,
the persistent form's gradients must match the one-tile kernel's to fp32 rounding (the additions into dQ come in
another order); a failure prints FAIL and sets exit status 1. The table gives ms and the persistent form's speed as a
fraction of the one-tile kernel's (one-tile ms / persistent ms), and each against cuDNN (cuDNN ms / cuflash ms), with
the model's makespan over the ideal for both (the persistent form's static walk against the hardware's dispatch as
blocks finish). --stream-k: the points without a mask only, and two more variants, checked and timed as the others:
"sk", the persistent form walking its last waves by stream-K (cuflash._bwd_sm90.STREAM_K; Sm90BwdStreamK), and "lean",
the same kernel given no workspace, so that it walks the fixed walk's whole waves as "persist" does, on the registers
of one block per tile (24 / 240) instead of the persistent form's 40 / 232 (columns: each one's speed over the
one-tile kernel's and over the fixed walk's, and against cuDNN); "persist" is then the fixed walk."""
from __future__ import annotations

import sys

SEQLENS = (2048, 4096, 8192, 16384)
STREAM_K = [False]  # --stream-k


def points(quick=False, seqlens=SEQLENS, headdims=(64, 128), dtypes=("float16", "bfloat16")):
    """(dtype, head dim, seqlen, batch, heads, kv heads, causal) of the FA2 grid at the head dims, and GQA 64 / 8
    heads at 8k with head dim 128 (--quick: fp16, 2k and 8k, no GQA)."""
    dts = ("float16",) if quick else dtypes
    ss = (2048, 8192) if quick else seqlens
    pts = [(dt, d, s, 16384 // s, 2048 // d, 2048 // d, c) for dt in dts for d in headdims for s in ss
           for c in (False, True)]
    if not quick and 128 in headdims:
        pts += [("float16", 128, 8192, 2, 64, 8, c) for c in (False, True)]
    return pts


def model(d, s, b, h, hk, causal):
    """(one-tile makespan / ideal in the configured dispatch order, the persistent form's): bench/diag/
    bwd_grid_model."""
    from cuflash._configs import SM90_BWD_TILES, sm90_bwd_causal_group

    from .bwd_grid_model import overhead, persistent_overhead

    bm, bn = SM90_BWD_TILES[d].block_m, SM90_BWD_TILES[d].block_n
    g = sm90_bwd_causal_group(d, s) if causal else 0
    one = overhead(s, hk, b, bm, causal, f"tile-major/{g}" if g else "head-major", block_n=bn)
    return one, persistent_overhead(s, hk, b, bm, causal, block_n=bn)


def sk_model(d, s, b, hk):
    """The stream-K walk's makespan / ideal (bench/diag/bwd_grid_model.stream_k_overhead)."""
    from cuflash._configs import SM90_BWD_TILES

    from .bwd_grid_model import stream_k_overhead

    return stream_k_overhead(s, hk, b, SM90_BWD_TILES[d].block_m, block_n=SM90_BWD_TILES[d].block_n)


def run_point(dt, d, s, b, h, hk, causal, rounds):
    import torch

    import cuflash
    from cuflash.backward import check_backward_inputs

    from ..harness import sdpa, time_queued_ms, time_rounds
    from .ordered_probe import plan_call

    tdt = getattr(torch, dt)
    q = torch.randn(b, s, h, d, device="cuda", dtype=tdt)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=tdt) for _ in range(2))
    out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    views = check_backward_inputs(dout, q, k, v, out, lse)
    fns = {"tile": plan_call(views, causal, "atomic", PERSIST=False),
           "persist": plan_call(views, causal, "atomic", PERSIST=True, STREAM_K=False)}
    if STREAM_K[0] and not causal:
        fns["sk"] = plan_call(views, causal, "atomic", PERSIST=True, STREAM_K=True)
        if fns["sk"].plan.sk:  # (a launch stream-K can take)
            fns["lean"] = plan_call(views, causal, "atomic", PERSIST=True, STREAM_K=True)
            fns["lean"].plan.sk = 0  # no workspace: the kernel's fixed walk
    ref = [x.float() for x in fns["tile"]()]
    ok = True
    for name in [n for n in fns if n != "tile"]:
        got = fns[name]()
        torch.cuda.synchronize()
        good = all((x.float() - r).abs().max().item() <= 2 ** -6 * r.abs().max().item() for x, r in zip(got, ref))
        if not good:
            print(f"FAIL {dt} d{d} s{s} h{h}/{hk} causal={causal}: the {name} form's gradients differ", flush=True)
        ok &= good
        del got
    del ref
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = dout.transpose(1, 2).contiguous()
    try:
        ot = sdpa("cudnn")(qt, kt, vt, causal, None, hk != h)
        fns["cudnn"] = lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True)
    except RuntimeError as e:
        print(f"sdpa cudnn refused d{d} s{s}: {str(e)[:200]}", flush=True)
    timed = time_rounds(fns, rounds, timer=lambda fn: time_queued_ms(fn, rep=10))
    fns.clear()
    torch.cuda.empty_cache()
    return {name: ms for name, (ms, _) in timed.items()}, ok


def table(rows):
    """Print the probe's table of rows ((dtype, d, seqlen, batch, heads, kv heads, causal), {name: ms}, ok)."""
    print("\nbackward (atomic), GPU time per call (queued), ms: one block per tile, persistent, cuDNN; the persistent "
          "form's speed over the one-tile kernel's (one-tile ms / persistent ms; model: one-tile makespan / "
          "persistent makespan); each against cuDNN (cuDNN ms / cuflash ms)")
    print(f"{'dtype':>8} {'d':>4} {'seqlen':>6} {'h/hk':>6} {'causal':>6} | {'tile':>7} {'persist':>7} {'cudnn':>7} | "
          f"{'t / p':>6} {'(model)':>7} | {'cuDNN/t':>7} {'cuDNN/p':>7} | check")
    f = lambda x: f"{x:>7.3f}" if x else f"{'-':>7}"  # noqa: E731
    r = lambda a, b_: f"{a / b_:>7.3f}" if a and b_ else f"{'-':>7}"  # noqa: E731
    for (dt, d, s, b, h, hk, c), ms, ok in rows:
        t, p, cd = ms.get("tile"), ms.get("persist"), ms.get("cudnn")
        one, per = model(d, s, b, h, hk, c)
        print(f"{dt:>8} {d:>4} {s:>6} {f'{h}/{hk}':>6} {str(c):>6} | {f(t)} {f(p)} {f(cd)} | {r(t, p)[1:]} "
              f"{one / per:>7.3f} | {r(cd, t)} {r(cd, p)} | {'ok' if ok else 'FAIL'}")
    if any("sk" in ms for _, ms, _ in rows):
        print("\nstream-K (the persistent form, its last waves by stream-K) and lean (its kernel with no workspace: the "
              "fixed walk on 24 / 240 registers), ms; stream-K's speed over the one-tile kernel's (one-tile ms / sk ms) "
              "and over the fixed walk's (persist ms / sk ms), lean's over the fixed walk's (persist ms / lean ms); "
              "against cuDNN (cuDNN ms / sk ms)")
        print(f"{'dtype':>8} {'d':>4} {'seqlen':>6} {'h/hk':>6} | {'sk':>7} {'lean':>7} | {'t / sk':>7} {'p / sk':>7} "
              f"{'(model)':>7} {'p / lean':>8} | {'cuDNN/sk':>8}")
        for (dt, d, s, b, h, hk, c), ms, ok in rows:
            if "sk" in ms:
                t, p, k, ln, cd = ms.get("tile"), ms.get("persist"), ms["sk"], ms.get("lean"), ms.get("cudnn")
                print(f"{dt:>8} {d:>4} {s:>6} {f'{h}/{hk}':>6} | {f(k)} {f(ln)} | {r(t, k)} {r(p, k)} "
                      f"{model(d, s, b, h, hk, False)[1] / sk_model(d, s, b, hk):>7.3f} {r(p, ln):>8} | {r(cd, k):>8}")


def main(argv):
    quick = "--quick" in argv
    seqlens = (tuple(int(x) for x in argv[argv.index("--seqlens") + 1].split(",")) if "--seqlens" in argv
               else SEQLENS)
    arg = lambda name, default: (tuple(argv[argv.index(name) + 1].split(",")) if name in argv  # noqa: E731
                                 else default)
    pts = points(quick, seqlens, tuple(int(x) for x in arg("--headdims", (64, 128))),
                 arg("--dtypes", ("float16", "bfloat16")))
    if "--model" in argv:
        print("model: makespan / ideal, one block per tile (configured order) and the persistent form")
        for dt, d, s, b, h, hk, c in pts:
            if dt == "float16":
                one, per = model(d, s, b, h, hk, c)
                print(f"d{d} s{s} h{h}/{hk} causal={c}: {one:.3f} {per:.3f}")
        return 0
    from .ordered_probe import run_points

    if "--stream-k" in argv:
        STREAM_K[0] = True
        pts = [pt for pt in pts if not pt[-1]]
    rows, all_ok = run_points(argv, pts, run_point, default_rounds=3)
    if rows is None:
        return 2
    table(rows)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
