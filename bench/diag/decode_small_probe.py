"""Diagnostic (GPU): the decode grid's short steps -- the latency-bound small caches and the caches whose blocks each
read little -- against cuDNN: split counts, tiles, row fragments and the cache_seqlens read.

    python -m bench.diag.decode_small_probe [--time-limit SECONDS] [--json FILE] [--case HK,B,S[,PAGE] ...]
        [--no-check | --check-only]

(a) Correctness of the plans the timing part runs (the default plan, the tiles of TILES, one row fragment per block
    for 32 folded rows) against the float64 reference per batch element on its own keys (out within 4e-3
    x max(1, max |ref|), LSE within 2e-4, -inf exactly where the reference has it, no NaN; the cache rows past each
    element's keys NaN): MQA and GQA with ragged cache_seqlens (a 0 among them), a paged cache of 16-key pages,
    automatic and forced split counts. Exit status 1 when a case misses.
(b) GPU time per step in CUDA-graph replay (head dim 128, fp16, 32 query heads, q_len 1), every plan of a case and
    SDPA's CUDNN backend (enable_gqa=True) timed in turn (harness.time_rounds, medians of ROUNDS rounds):
      def      the default plan (decode_auto_mf's row fragments, decode_auto_tile's tile, decode_num_splits' "chain"
               split count)
      prev     the default before those three rules: the configured tile, two row fragments above 16 rows, the
               "waves" split count (wave efficiency, then no empty split)
      chain    prev's tile and row fragments at the "chain" split count, where that differs from prev's
      static   the default plan without cache_seqlens (the kernel's key count from the shape: no dependent load of
               the length before the first K/V address)
      kernel   the default plan's decode kernel alone, without the combine's launch (split plans only)
      block    the default plan with the block combine where its 9-16 splits take the rows combine's wide form
      nN       the default plan at N splits (half and twice the default's, where they exist)
      TILE     a tile of TILES at its own default count (its resident blocks per SM enter the count), the default
               row fragments
      mf1 ...  one row fragment per block where 32 query rows fold into one KV head (MQA): two m-blocks, each half
               the products per key (with the configured tile; with 16x4w3)
    Paged cases (--case HK,B,S,PAGE; PAGES by default) time the default plan on the contiguous cache ("contig"),
    then the paged one (def, nN, TILE).
The table: us per step per plan and, per plan, cuDNN's time over it (>= 1.00: at or below cuDNN's time).
"""
from __future__ import annotations

import argparse
import sys
import time

from bench.diag.decode_probe import _check, _sdpa_fn, paged_copy, run_probe
from bench.diag.decode_swizzle_probe import check_cases, release_memory

ROUNDS = 3
H, D = 32, 128
CALLS = 8  # graph calls per timing
# (KV heads, batch, cache length): every decode-grid case under 1.00x cuDNN or 95% of the read bandwidth in the last
# grid run, and neighbours that were above
CASES = [(1, 1, 1024), (1, 1, 4096), (1, 1, 16384), (1, 8, 1024), (1, 8, 131072), (1, 64, 1024), (1, 64, 16384),
         (8, 1, 1024), (8, 1, 4096), (8, 8, 1024), (8, 64, 1024), (32, 1, 1024), (32, 1, 16384), (32, 8, 1024),
         (32, 64, 1024)]
PAGES = [(8, 1, 8192, 16), (8, 1, 8192, 256)]  # (KV heads, batch, cache length, page size): the paged small step
# (batch, cache capacity, KV heads, query heads, head dim, dtype, cache_seqlens, page size, query rows, causal)
CHECKS = [(3, 4100, 1, 32, 128, "float16", [4100, 0, 130], 0, 1, False),
          (2, 3001, 8, 32, 128, "float16", [3001, 17], 0, 1, False),
          (3, 2048, 8, 32, 128, "float16", [2048, 0, 1000], 16, 1, False),
          (2, 2048, 1, 32, 128, "float16", [2048, 700], 16, 1, False)]


def tiles():
    """name -> DecodeTile of the head-dim-128 tiles timed beside the configured one (32 keys x 4 warps x 2 stages,
    135 KB: one block per SM): 16 x 4 x 3 (two blocks per SM), 16 x 4 x 2 (two or three), 16 x 8 x 2 (one block of
    8 warps), 16 x 2 x 3 (54 KB, 196 registers at one row fragment: four blocks of 2 warps per SM, the bytes in
    flight of 16 x 4 x 3 in twice the slots -- 512 unsplit blocks, 8 KV heads at batch 64, in one wave of 528 instead
    of 1.94 of 264)."""
    from cuflash._configs import DecodeTile

    return {"16x4w3": DecodeTile(16, 4, 3, swizzle=True), "16x4w2": DecodeTile(16, 4, 2, swizzle=True),
            "16x8w2": DecodeTile(16, 8, 2, swizzle=True), "16x2w3": DecodeTile(16, 2, 3, swizzle=True)}


def correctness() -> bool:
    import torch

    from cuflash.decode import plan_for, run_plan

    all_ok = True
    for (b, s, hk, h, d, dt, lens, ps, _, _), (q, kc, vc, kx, vx, bt, seqlens) in check_cases(CHECKS):
        configs = [("auto", {})] + [(name, dict(tile=t)) for name, t in tiles().items()]
        if h // hk > 16:
            configs += [("mf1", dict(mf=1)), ("mf1 16x4w3", dict(mf=1, tile=tiles()["16x4w3"]))]
        for name, kw in configs:
            for ns in (0, 1, 5):
                plan = plan_for(q, kx, vx, cache_seqlens=seqlens, block_table=bt, num_splits=ns, **kw)
                out, lse = run_plan(plan, q, kx, vx, cache_seqlens=seqlens, return_softmax_lse=True, block_table=bt)
                torch.cuda.synchronize()
                tag = (f"{name} {dt} d{d} b={b} h={h} hk={hk} s={s} lens={lens}{f' paged {ps}' if ps else ''} "
                       f"splits={plan.num_splits}{'(auto)' if not ns else ''}")
                all_ok &= _check(tag, out, lse, q, torch.nan_to_num(kc), torch.nan_to_num(vc), lens, False)
    return all_ok


def _plans(q, kc, vc, seqlens, rows, bt=None):
    """name -> (plan, cache_seqlens the step passes) of one case (the module docstring's list)."""
    from cuflash._configs import COMBINE_ROWS_MAX_SPLITS, combine_rows_max_splits, decode_tile
    from cuflash.decode import decode_rounds, plan_for

    def mk(**kw):
        return plan_for(q, kc, vc, cache_seqlens=seqlens, block_table=bt, **kw)

    rounds = decode_rounds(kc.shape[1] * (1 if bt is None else bt.shape[1]), D)
    d = mk()
    plans = {"def": (d, seqlens), "prev": (mk(tile=decode_tile(D), mf=2 if rows > 16 else 1, split_rule="waves"),
                                           seqlens)}
    c = mk(tile=decode_tile(D), mf=2 if rows > 16 else 1)
    if c.num_splits != plans["prev"][0].num_splits:
        plans["chain"] = (c, seqlens)
    if bt is None:
        plans["static"] = (d, None)
    if d.num_splits > 1:
        alone = mk()
        alone.launches = alone.launches[:1]
        plans["kernel"] = (alone, seqlens)
    if COMBINE_ROWS_MAX_SPLITS < d.num_splits <= combine_rows_max_splits(D):
        plans["block"] = (mk(combine="block"), seqlens)
    for n in (d.num_splits // 2, d.num_splits * 2):
        if 1 <= n <= min(128, rounds) and n != d.num_splits:
            plans[f"n{n}"] = (mk(num_splits=n), seqlens)
    for name, t in tiles().items():
        plans[name] = (mk(tile=t), seqlens)
    if rows > 16:
        plans["mf1"] = (mk(mf=1, tile=decode_tile(D)), seqlens)
        plans["mf1 16x4w3"] = (mk(mf=1, tile=tiles()["16x4w3"]), seqlens)
    return plans


def timing(limit_s: float, cases=CASES, pages=PAGES) -> list:
    import torch

    from bench.bench_decode import capture_graph
    from bench.harness import time_rounds
    from cuflash.decode import plan_for, run_plan

    recs = []
    t0 = time.perf_counter()
    for hk, b, s, ps in [(*c, 0) for c in cases] + list(pages):
        tag = f"b={b} hk={hk} s={s // 1024}k{f' page {ps}' if ps else ''}"
        if time.perf_counter() - t0 > limit_s:
            print(f"{tag}: skipped (past the {limit_s:.0f} s time limit)", flush=True)
            continue
        kc = torch.randn(b, s, hk, D, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.float16)
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        graphs, splits = {}, {}
        if ps:
            kx, vx, bt = paged_copy(kc, vc, ps)
            contig = plan_for(q, kc, vc, cache_seqlens=seqlens)
            graphs["contig"] = capture_graph(lambda: run_plan(contig, q, kc, vc, cache_seqlens=seqlens), CALLS)
            splits["contig"] = contig.num_splits
            plans = _plans(q, kx, vx, seqlens, H // hk, bt)
        else:
            kx, vx, bt = kc, vc, None
            plans = _plans(q, kc, vc, seqlens, H // hk)
        for name, (plan, sl) in plans.items():
            graphs[name] = capture_graph(
                lambda plan=plan, sl=sl: run_plan(plan, q, kx, vx, cache_seqlens=sl, block_table=bt), CALLS)
            splits[name] = plan.num_splits
        if not ps:
            try:
                graphs["cudnn"] = capture_graph(_sdpa_fn("cudnn", q, kc, vc, H, hk), CALLS)
            except RuntimeError as e:
                print(f"sdpa cudnn {tag}: {str(e).splitlines()[0][:100]}", flush=True)
        res = time_rounds({k: g.replay for k, g in graphs.items()}, rounds=ROUNDS, warmup=2, rep=10,
                          min_warmup_ms=2.0)
        us = {k: (v[0] * 1e3 / CALLS if v[0] is not None else None) for k, v in res.items()}
        recs.append(dict(batch=b, heads=H, heads_k=hk, seqlen_k=s, page=ps, headdim=D, dtype="float16",
                         kv_bytes=2 * b * s * hk * D * 2, us=us, splits=splits))
        print(f"{tag}: " + " ".join(f"{k}({splits.get(k, '-')})={v:.2f}" for k, v in us.items() if v), flush=True)
        graphs = plans = kc = vc = kx = vx = q = None
        release_memory()
    return recs


def table(recs) -> str:
    lines = []
    for r in recs:
        us, sp = r["us"], r["splits"]
        ref = us.get("cudnn") or us.get("contig")
        page = f" page {r['page']}" if r["page"] else ""
        case = f"hk{r['heads_k']} b{r['batch']} {r['seqlen_k'] // 1024}k{page} ({r['kv_bytes'] / 2 ** 20:.0f} MB)"
        cells = [f"{k}({sp[k]})={v:.2f} [{ref / v:.2f}]" if k in sp and ref else f"{k}={v:.2f}"
                 for k, v in us.items() if v]
        lines.append(f"{case}: " + "  ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.decode_small_probe")
    ap.add_argument("--time-limit", type=float, default=150.0,
                    help="seconds (from the start) after which no new timing case starts")
    ap.add_argument("--json", default=None, help="also write the records to this file")
    ap.add_argument("--case", action="append", default=None, metavar="HK,B,S[,PAGE]",
                    help="time only this case (KV heads, batch, cache length, page size), repeatable")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    ap.add_argument("--check-only", action="store_true",
                    help="run only the correctness cases (for compute-sanitizer); exit status 1 when one misses")
    args = ap.parse_args(argv)
    if args.check_only:
        ok = correctness()
        print(f"correctness: {'all ok' if ok else 'FAILURES'}")
        return 0 if ok else 1
    cases, pages = CASES, PAGES
    if args.case:
        v = [[int(x) for x in c.split(",")] for c in args.case]
        cases = [tuple(c[:3]) for c in v if len(c) == 3 or c[3] == 0]
        pages = [tuple(c) for c in v if len(c) == 4 and c[3]]
    return run_probe("decode small-step probe",
                     f"GPU us per step in CUDA-graph replay, medians of {ROUNDS} rounds timed in turn; plan(splits)="
                     f"us [cuDNN's time / it; paged cases: the contiguous cache's time / it]",
                     None if args.no_check else correctness, lambda limit: timing(limit, cases, pages), table,
                     args.time_limit, args.json)


if __name__ == "__main__":
    sys.exit(main())
