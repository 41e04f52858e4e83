"""Diagnostic (GPU): the decode kernel's CLUSTER form (sm_90: the splits of one (batch, KV head, m-block) are one
thread block cluster and combine their partials through distributed shared memory; cuda_src/flash_decode.cu) against
the split kernel and combine kernel it replaces, and cuDNN.

    python -m bench.diag.decode_cluster_probe [--time-limit SECONDS] [--json FILE] [--no-check] [--case HK,B,S[,PAGE]]
    python -m bench.diag.decode_cluster_probe --quick     # (a) only, on a few of its cases (under compute-sanitizer)

(a) Correctness: decode_swizzle_probe's CHECKS (ragged cache_seqlens with 0 and lengths inside a warp tile, the rows
    past each element's keys NaN, MQA / GQA / MHA, head dims 32-256, fp16 and bf16, paged caches, causal with several
    query rows) at split counts 2, 3, 5 and 8: the CLUSTER form (plan_for(..., combine="cluster")) against the
    float64 reference (that probe's tolerances), and against the rows combine at the same split count (the largest
    |difference| on the line: the same weights summed in another order). Exit status 1 when a case misses.
(b) GPU time per call in CUDA-graph replay, q_len 1, 32 query heads, head dim 128, fp16: the decode grid's cases
    that split (2-16 splits at the heuristic's count) and the small steps, timed in turn (harness.time_rounds,
    medians of ROUNDS rounds):
      combine  the heuristic's split count, the split kernel then a combine kernel (rows up to 8 splits, block
               above): the default before the CLUSTER form;
      default  the default plan now (the CLUSTER form at 2-8 splits where its clusters take no more waves than
               the plain grid; else as combine);
      cluster  the CLUSTER form forced at the heuristic's split count (where the default does not take it);
      clN      the CLUSTER form at N splits (N = 2, 3, 4, 8; where the heuristic's count is not N);
      cudnn    SDPA's CUDNN backend (enable_gqa=True; the caches expanded where it refuses).
The table is last: us per call, default / combine (< 1: the CLUSTER form faster), cudnn / default and cudnn / best
(>= 1: at or below cuDNN's time; best = the fastest cuflash column), and the split counts.
"""
from __future__ import annotations

import argparse
import sys
import time

from bench.diag.decode_probe import _check, run_probe
from bench.diag.decode_swizzle_probe import CHECKS, TOL, check_inputs, paged_copy, release_memory

ROUNDS = 3
H, D = 32, 128
CALLS = 4  # graph calls per timing
# (KV heads, batch, cache length, page size): the decode grid's split cases and small steps, then paged small steps
CASES = [(32, 1, 1024, 0), (32, 1, 4096, 0), (32, 1, 16384, 0), (32, 1, 131072, 0),
         (8, 1, 1024, 0), (8, 1, 4096, 0), (8, 1, 16384, 0), (8, 8, 1024, 0), (8, 8, 4096, 0), (8, 8, 32768, 0),
         (1, 1, 1024, 0), (1, 1, 4096, 0), (1, 8, 1024, 0), (1, 8, 4096, 0), (1, 64, 1024, 0), (1, 64, 4096, 0),
         (1, 64, 16384, 0), (8, 1, 8192, 16), (8, 1, 8192, 256), (8, 1, 8192, 0)]
FORCED = (2, 3, 4, 8)


QUICK = (0, 3, 8, 9, 11)  # the CHECKS --quick runs: MQA, causal GQA, d256 MQA, paged, 20 causal rows


def correctness(quick=False) -> bool:
    import torch

    from cuflash import _interop
    from cuflash.decode import plan_for, run_plan

    torch.manual_seed(0)
    _interop.POISON = True
    all_ok = True
    for b, s, hk, h, d, dt, lens, ps, sq, causal in [CHECKS[i] for i in QUICK] if quick else CHECKS:
        q, kc, vc, kx, vx, bt, seqlens = check_inputs(b, s, hk, h, d, dt, lens, ps, sq)
        for ns in (2, 5) if quick else (2, 3, 5, 8):
            outs = {}
            for combine in ("cluster", "rows"):
                try:
                    plan = plan_for(q, kx, vx, cache_seqlens=seqlens, block_table=bt, causal=causal, num_splits=ns,
                                    combine=combine)
                except ValueError as e:  # no CLUSTER form for this kernel (cuflash._configs.DECODE_NO_CLUSTER)
                    print(f"skip {dt} d{d} sq={sq} splits={ns} {combine}: {e}", flush=True)
                    break
                out, lse = run_plan(plan, q, kx, vx, cache_seqlens=seqlens, return_softmax_lse=True, block_table=bt)
                torch.cuda.synchronize()
                outs[combine] = (out, lse, len(plan.launches))
            if len(outs) < 2:
                continue
            out, lse, launches = outs["cluster"]
            diff = (out.float() - outs["rows"][0].float()).abs().max().item()
            tag = (f"cluster {dt} d{d} b={b} sq={sq} h={h} hk={hk} s={s} causal={int(causal)} lens={lens}"
                   f"{f' paged {ps}' if ps else ''} splits={ns} launches={launches} max|cluster - rows| {diff:.1e}")
            ok = _check(tag, out, lse, q, torch.nan_to_num(kc), torch.nan_to_num(vc), lens, causal, *TOL[dt])
            if launches != 1:
                print(f"FAIL {tag}: the CLUSTER form is one launch", flush=True)
            all_ok &= ok and launches == 1
        del kc, vc, kx, vx
        release_memory()
    return all_ok


def active_clusters() -> None:
    """Print cuOccupancyMaxActiveClusters of the CLUSTER form of the decode kernels (fp16, contiguous cache) for
    clusters of 2-8 blocks: how many SMs its clusters hold at once, against the plain grid's slots."""
    import torch

    from cuflash import _configs, _launch
    from cuflash.decode import _resident

    dev = torch.cuda.current_device()
    print(f"SMs {_launch.sm_count(dev)}; max active clusters (x cluster size = SMs held) of the CLUSTER form:")
    for d in sorted(_configs.DECODE_KERNEL_TILES):
        for mf in range(1, _configs.DECODE_MAX_MF[d] + 1):
            lau = _launch.get_launcher(_configs.decode_spec("float16", d, False, mf, cluster=True), dev)
            plain = _resident(_configs.decode_spec("float16", d, False, mf), dev)
            cells = []
            for n in range(2, 9):
                a = _launch.max_active_clusters(dev, lau, n)
                cells.append(f"{n}: {a} ({a * n})")
            print(f"  d{d} mf{mf} (smem {lau.smem} B, plain grid {plain} per SM = "
                  f"{plain * _launch.sm_count(dev)} slots): " + ", ".join(cells), flush=True)


def timing(limit_s: float, cases=CASES) -> list:
    import torch

    from bench.bench_decode import capture_graph
    from bench.diag.decode_probe import _sdpa_fn
    from bench.harness import time_rounds
    from cuflash.decode import COMBINE_ROWS_MAX_SPLITS, plan_for, run_plan

    recs = []
    t0 = time.perf_counter()
    active_clusters()
    for hk, b, s, page in cases:
        if time.perf_counter() - t0 > limit_s:
            print(f"b={b} hk={hk} s={s} page={page}: skipped (past the {limit_s:.0f} s time limit)", flush=True)
            continue
        kc = torch.randn(b, s, hk, D, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.float16)
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        kx, vx, bt = (kc, vc, None) if not page else paged_copy(kc, vc, page)
        default = plan_for(q, kx, vx, cache_seqlens=seqlens, block_table=bt)
        n = default.num_splits
        plans = {"combine": plan_for(q, kx, vx, cache_seqlens=seqlens, block_table=bt,
                                     combine="rows" if n <= COMBINE_ROWS_MAX_SPLITS else "block"),
                 "default": default}
        if 2 <= n <= 8 and len(default.launches) != 1:
            try:
                plans["cluster"] = plan_for(q, kx, vx, cache_seqlens=seqlens, block_table=bt, combine="cluster")
            except ValueError as e:
                print(f"cluster b={b} hk={hk} s={s}: {e}", flush=True)
        for f in FORCED:
            if f != n:
                try:
                    plans[f"cl{f}"] = plan_for(q, kx, vx, cache_seqlens=seqlens, block_table=bt, num_splits=f,
                                               combine="cluster")
                except ValueError as e:
                    print(f"cl{f} b={b} hk={hk} s={s}: {e}", flush=True)
        graphs = {k: capture_graph(lambda plan=plan: run_plan(plan, q, kx, vx, cache_seqlens=seqlens, block_table=bt),
                                   CALLS) for k, plan in plans.items()}
        try:
            graphs["cudnn"] = capture_graph(_sdpa_fn("cudnn", q, kc, vc, H, hk), CALLS)
        except RuntimeError as e:
            print(f"sdpa cudnn b={b} hk={hk} s={s}: {str(e).splitlines()[0][:100]}", flush=True)
        res = time_rounds({k: g.replay for k, g in graphs.items()}, rounds=ROUNDS, warmup=2, rep=10,
                          min_warmup_ms=2.0)
        us = {k: (v[0] * 1e3 / CALLS if v[0] is not None else None) for k, v in res.items()}
        rec = dict(batch=b, heads=H, heads_k=hk, seqlen_k=s, headdim=D, dtype="float16", page_size=page,
                   kv_bytes=2 * b * s * hk * D * 2, us=us, splits={k: p.num_splits for k, p in plans.items()},
                   launches={k: len(p.launches) for k, p in plans.items()})
        recs.append(rec)
        print(f"b={b} hk={hk} s={s // 1024}k page={page} splits={n}: " +
              " ".join(f"{k}={v:.1f}us" for k, v in us.items() if v), flush=True)
        del graphs, plans, default
        release_memory()
    return recs


def table(recs) -> str:
    provs = ["combine", "default", "cluster"] + [f"cl{f}" for f in FORCED] + ["cudnn"]
    cols = (["case", "KV MB", "splits"] + [f"{p} us" for p in provs] +
            ["default / combine", "cudnn / default", "cudnn / best"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def f(x, fmt):
        return format(x, fmt) if x else "-"

    for r in recs:
        us = r["us"]
        case = f"hk{r['heads_k']} b{r['batch']} {r['seqlen_k'] // 1024}k" + (f" page {r['page_size']}"
                                                                             if r["page_size"] else "")
        mode = "cluster" if r["launches"]["default"] == 1 and r["splits"]["default"] > 1 else "combine"
        cells = [case, f"{r['kv_bytes'] / 2 ** 20:.0f}", f"{r['splits']['default']} ({mode})"]
        cells += [f(us.get(p), ".1f") for p in provs]
        d, c, cud = us.get("default"), us.get("combine"), us.get("cudnn")
        best = min(v for k, v in us.items() if k != "cudnn" and v)
        cells += [f(d / c if d and c else None, ".3f"), f(cud / d if cud and d else None, ".3f"),
                  f(cud / best if cud else None, ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.decode_cluster_probe")
    ap.add_argument("--time-limit", type=float, default=150.0,
                    help="seconds (from the start) after which no new timing case starts")
    ap.add_argument("--json", default=None, help="also write the records to this file")
    ap.add_argument("--case", action="append", default=None, metavar="HK,B,S[,PAGE]",
                    help="time only this case (KV heads, batch, cache length, page size), repeatable")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    ap.add_argument("--quick", action="store_true", help="a few correctness cases, no timing")
    args = ap.parse_args(argv)
    if args.quick:
        ok = correctness(quick=True)
        print(f"decode cluster probe --quick: correctness {'ok' if ok else 'FAILED'}")
        return 0 if ok else 1
    cases = CASES
    if args.case:
        cases = [tuple(int(x) for x in c.split(",")) + (0,) * (4 - len(c.split(","))) for c in args.case]
    return run_probe("decode cluster probe",
                     f"GPU us per call in CUDA-graph replay, medians of {ROUNDS} rounds timed in turn; combine = the "
                     f"split kernel and a combine kernel at the heuristic's split count (the default before), default "
                     f"= the default plan now, clN = the CLUSTER form at N splits; default / combine < 1: the "
                     f"CLUSTER form faster; cudnn / x >= 1: at or below cuDNN", None if args.no_check else correctness,
                     lambda limit: timing(limit, cases), table, args.time_limit, args.json)


if __name__ == "__main__":
    sys.exit(main())
