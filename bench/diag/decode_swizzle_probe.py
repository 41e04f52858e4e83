"""Diagnostic (GPU): the decode kernel's swizzled ring (DecodeTile.swizzle, the kernel's SWZ: K / V rows unpadded,
16-byte chunks XOR-swizzled; cuda_src/flash_decode.cu RingSwizzle; the configured tiles') against the padded rows
(the same tile with swizzle=False).

    python -m bench.diag.decode_swizzle_probe [--time-limit SECONDS] [--json FILE]
        [--case HK,B,S[,D] ...] [--unsplit] [--splits N,N,...] [--no-check]

(a) Correctness of the swizzled tile (plan_for(..., tile=replace(decode_tile(d), swizzle=True)) / run_plan) against
    the float64 reference per batch element on its own keys (out within 4e-3 (bf16 1.6e-2) x max(1, max |ref|), LSE
    within 2e-4 (bf16 1e-3), -inf exactly where the reference has it, no NaN): ragged cache_seqlens with 0 and
    lengths inside a warp tile, MQA (two row fragments) / GQA / MHA, head dims 32 / 64 / 96 / 128 / 256, fp16 and bf16,
    auto and forced split counts (1, 7), paged caches of 16-key pages, causal with several query rows, the rows past
    each element's keys NaN. Every case also runs with the default tile at the same split count: the products and
    their order are the same, so the outputs must be bitwise equal ("bitwise" on the line). Exit status 1 when a case
    misses.
(b) GPU time per call in CUDA-graph replay, q_len 1, 32 query heads, head dim 128 (fp16; one bf16 case), the
    decode grid's large caches of 32 and 8 KV heads (512 MB - 4 GB) and small ones (latency-bound: the variant must
    not cost there), then large and small caches at head dims 64, 32 and 256: old = the padded rows, swz = the swizzled ring, cudnn = SDPA's CUDNN backend (enable_gqa=True),
    timed in turn (harness.time_rounds, medians of ROUNDS rounds).
The table is last: us per call, swz / old (< 1: the swizzle faster), cudnn / swz (>= 1: at or below cuDNN's time),
and each provider's K/V bytes over its time in TB/s. Stops starting timing cases after --time-limit seconds
(default 120). --case times only the given cases (fp16), --unsplit adds both rings at one split (old1, swz1),
--splits adds the swizzled ring at each forced split count N (swzN) and, for N > 1, its decode kernel alone without the
combine (swzNk: the partials only), --no-check skips (a).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import replace

from bench.diag.decode_probe import _check, paged_copy, run_probe

ROUNDS = 3
H, D = 32, 128
CALLS = 4  # graph calls per timing
PROVIDERS = ("old", "swz", "cudnn")
# (KV heads, batch, cache length, dtype, head dim): the large caches first, then small ones, then the other head dims
# (d32's swizzled ring fits three blocks per SM where the padded one fits two, so its split counts differ)
CASES = [(32, 8, 16384, "float16", D), (32, 1, 131072, "float16", D), (32, 8, 32768, "float16", D),
         (32, 64, 4096, "float16", D), (8, 8, 32768, "float16", D), (8, 8, 131072, "float16", D),
         (8, 64, 16384, "float16", D), (8, 1, 131072, "bfloat16", D), (1, 8, 65536, "float16", D),
         (32, 1, 32768, "float16", D), (32, 1, 4096, "float16", D), (8, 1, 16384, "float16", D),
         (1, 1, 16384, "float16", D), (8, 8, 32768, "float16", 64), (8, 1, 16384, "float16", 64),
         (8, 8, 32768, "float16", 32), (8, 1, 16384, "float16", 32), (8, 64, 4096, "float16", 32),
         (8, 8, 16384, "float16", 256), (8, 1, 16384, "float16", 256)]
# (batch, cache capacity, KV heads, query heads, head dim, dtype, cache_seqlens, page size, query rows, causal)
CHECKS = [(3, 4100, 1, 32, 128, "float16", [4100, 0, 130], 0, 1, False),  # MQA: 32 folded rows (two fragments)
          (2, 3001, 8, 32, 128, "bfloat16", [3001, 17], 0, 1, False),
          (2, 1500, 32, 32, 128, "float16", [1499, 1], 0, 1, False),
          (2, 1500, 8, 32, 128, "float16", [1499, 40], 0, 3, True),  # 3 rows x 4 heads per KV head, causal
          (2, 2050, 2, 8, 64, "float16", [2050, 333], 0, 1, False),
          (3, 1000, 4, 16, 64, "bfloat16", [1000, 0, 31], 0, 1, False),
          (2, 1000, 2, 8, 96, "float16", [999, 77], 0, 1, False),
          (2, 1000, 2, 8, 256, "bfloat16", [999, 77], 0, 1, False),
          (2, 700, 1, 16, 256, "float16", [700, 45], 0, 1, False),
          (3, 2048, 8, 32, 128, "float16", [2048, 0, 1000], 16, 1, False),  # paged, pages of 16 keys
          (2, 1024, 4, 8, 64, "bfloat16", [1024, 500], 16, 2, True),  # paged, causal
          (2, 1200, 1, 4, 128, "float16", [1200, 333], 0, 20, True),  # 20 causal rows: two row fragments
          (2, 900, 2, 8, 32, "bfloat16", [900, 64], 0, 1, False)]
TOL = {"float16": (4e-3, 2e-4), "bfloat16": (1.6e-2, 1e-3)}


def release_memory():
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def check_inputs(b, s, hk, h, d, dt, lens, ps, sq):
    """A CHECKS case's arrays: (q, kc, vc, k as the kernel reads it, v likewise, block table or None, cache_seqlens);
    the cache rows past each element's keys NaN (the kernel must never use them), paged (ps > 0) in a random order."""
    import torch

    dtype = getattr(torch, dt)
    kc = torch.randn(b, s, hk, d, device="cuda").to(dtype)
    vc = torch.randn_like(kc)
    for i, n in enumerate(lens):
        kc[i, n:] = float("nan")
        vc[i, n:] = float("nan")
    q = torch.randn(b, sq, h, d, device="cuda").to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kx, vx, bt = (kc, vc, None) if not ps else paged_copy(kc, vc, ps)
    return q, kc, vc, kx, vx, bt, seqlens


def check_cases(checks):
    """Each case of `checks` (CHECKS' layout) with its arrays (check_inputs), seeded, with cuflash's outputs poisoned
    (NaN before every launch) while the caller checks it, the arrays released after: yields (case, arrays)."""
    import torch

    from cuflash import _interop

    torch.manual_seed(0)
    _interop.POISON = True
    for case in checks:
        b, s, hk, h, d, dt, lens, ps, sq, _ = case
        yield case, check_inputs(b, s, hk, h, d, dt, lens, ps, sq)
        release_memory()


def correctness() -> bool:
    import torch

    from cuflash import _configs
    from cuflash.decode import plan_for, run_plan

    all_ok = True
    for (b, s, hk, h, d, dt, lens, ps, sq, causal), (q, kc, vc, kx, vx, bt, seqlens) in check_cases(CHECKS):
        swz = replace(_configs.decode_tile(d), swizzle=True)
        padded = replace(swz, swizzle=False)
        for ns in (0, 1, 7):
            outs = {}
            for name, tile in (("swz", swz), ("old", padded)):
                plan = plan_for(q, kx, vx, cache_seqlens=seqlens, block_table=bt, causal=causal, tile=tile,
                                num_splits=ns if ns or name == "swz" else outs["swz"][2])
                out, lse = run_plan(plan, q, kx, vx, cache_seqlens=seqlens, return_softmax_lse=True, block_table=bt)
                torch.cuda.synchronize()
                outs[name] = (out, lse, plan.num_splits)
            out, lse, n = outs["swz"]
            same = torch.equal(out, outs["old"][0]) and torch.equal(lse, outs["old"][1])
            tag = (f"swz {dt} d{d} b={b} sq={sq} h={h} hk={hk} s={s} causal={int(causal)} lens={lens}"
                   f"{f' paged {ps}' if ps else ''} splits={n}{'(auto)' if not ns else ''} "
                   f"{'bitwise' if same else 'NOT BITWISE'} = padded rows")
            ok = _check(tag, out, lse, q, torch.nan_to_num(kc), torch.nan_to_num(vc), lens, causal, *TOL[dt])
            if not same:
                print(f"FAIL {tag}: the swizzled and the padded rings differ at the same split count", flush=True)
            all_ok &= ok and same
    return all_ok


def timing(limit_s: float, cases=CASES, unsplit=False, splits=()) -> list:
    import torch

    from bench.bench_decode import capture_graph
    from bench.diag.decode_probe import _sdpa_fn
    from bench.harness import time_rounds
    from cuflash import _configs
    from cuflash.decode import plan_for, run_plan

    recs = []
    t0 = time.perf_counter()
    for hk, b, s, dt, d in cases:
        swz = replace(_configs.decode_tile(d), swizzle=True)
        padded = replace(swz, swizzle=False)
        kv_bytes = 2 * b * s * hk * d * 2
        if time.perf_counter() - t0 > limit_s:
            print(f"b={b} hk={hk} s={s} {dt}: skipped (past the {limit_s:.0f} s time limit)", flush=True)
            continue
        dtype = getattr(torch, dt)
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, H, d, device="cuda", dtype=dtype)
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        plans = {"old": plan_for(q, kc, vc, cache_seqlens=seqlens, tile=padded),
                 "swz": plan_for(q, kc, vc, cache_seqlens=seqlens, tile=swz)}
        if unsplit:  # both rings again at one split (the heuristic's split count against none)
            plans.update(old1=plan_for(q, kc, vc, cache_seqlens=seqlens, tile=padded, num_splits=1),
                         swz1=plan_for(q, kc, vc, cache_seqlens=seqlens, tile=swz, num_splits=1))
        for n in splits:  # forced split counts; and the split kernel alone (its plan without the combine's launch)
            plans[f"swz{n}"] = plan_for(q, kc, vc, cache_seqlens=seqlens, tile=swz, num_splits=n)
            if n > 1:
                alone = plan_for(q, kc, vc, cache_seqlens=seqlens, tile=swz, num_splits=n)
                alone.launches = alone.launches[:1]
                plans[f"swz{n}k"] = alone
        graphs = {k: capture_graph(lambda plan=plan: run_plan(plan, q, kc, vc, cache_seqlens=seqlens), CALLS)
                  for k, plan in plans.items()}
        try:
            graphs["cudnn"] = capture_graph(_sdpa_fn("cudnn", q, kc, vc, H, hk), CALLS)
        except RuntimeError as e:
            print(f"sdpa cudnn b={b} hk={hk} s={s}: {str(e).splitlines()[0][:100]}", flush=True)
        res = time_rounds({k: g.replay for k, g in graphs.items()}, rounds=ROUNDS, warmup=2, rep=10,
                          min_warmup_ms=2.0)
        us = {k: (v[0] * 1e3 / CALLS if v[0] is not None else None) for k, v in res.items()}
        rec = dict(batch=b, heads=H, heads_k=hk, seqlen_k=s, headdim=d, dtype=dt, kv_bytes=kv_bytes, us=us,
                   splits={k: p.num_splits for k, p in plans.items()},
                   tb_per_s={k: kv_bytes / (v * 1e-6) / 1e12 for k, v in us.items() if v})
        recs.append(rec)
        print(f"b={b} hk={hk} s={s // 1024}k d{d} {dt}: " + " ".join(f"{k}={v:.1f}us" for k, v in us.items() if v),
              flush=True)
        del graphs, plans
        release_memory()
    return recs


def table(recs) -> str:
    forced = sorted({p for r in recs for p in r["us"] if p[:3] == "swz" and p[3:4].isdigit() and p != "swz1"},
                    key=lambda p: (int(p[3:].rstrip("k")), p))
    provs = [p for p in ("old", "swz", "old1", "swz1", *forced, "cudnn") if any(p in r["us"] for r in recs)] \
        or PROVIDERS
    cols = ["case", "KV MB", "splits old / swz"] + [f"{p} us" for p in provs] + ["swz / old", "cudnn / swz"] + \
        [f"{p} TB/s" for p in provs]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def f(x, fmt):
        return format(x, fmt) if x else "-"

    for r in recs:
        us, tb, sp = r["us"], r["tb_per_s"], r["splits"]
        case = (f"hk{r['heads_k']} b{r['batch']} {r['seqlen_k'] // 1024}k d{r.get('headdim', D)}"
                f"{' bf16' if r['dtype'] == 'bfloat16' else ''}")
        cells = [case, f"{r['kv_bytes'] / 2 ** 20:.0f}", f"{sp['old']} / {sp['swz']}"]
        cells += [f(us.get(p), ".1f") for p in provs]
        old, new, cud = us.get("old"), us.get("swz"), us.get("cudnn")
        cells += [f(new / old if new and old else None, ".3f"), f(cud / new if cud and new else None, ".3f")]
        cells += [f(tb.get(p), ".2f") for p in provs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.decode_swizzle_probe")
    ap.add_argument("--time-limit", type=float, default=120.0,
                    help="seconds (from the start) after which no new timing case starts")
    ap.add_argument("--json", default=None, help="also write the records to this file")
    ap.add_argument("--case", action="append", default=None, metavar="HK,B,S[,D]",
                    help="time only this case (KV heads, batch, cache length, head dim; fp16), repeatable")
    ap.add_argument("--unsplit", action="store_true",
                    help="also time both rings at one split (old1, swz1)")
    ap.add_argument("--splits", default="", metavar="N,N,...",
                    help="also time the swizzled ring at these forced split counts (swzN; swzNk: its kernel alone)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    args = ap.parse_args(argv)
    cases = CASES
    splits = tuple(int(x) for x in args.splits.split(",") if x)
    if any(n < 1 for n in splits):
        raise ValueError(f"--splits: split counts are >= 1; got {args.splits!r}")
    if args.case:
        cases = []
        for c in args.case:
            v = [int(x) for x in c.split(",")]
            cases.append((v[0], v[1], v[2], "float16", v[3] if len(v) > 3 else D))
    return run_probe("decode swizzle probe",
                     f"GPU us per call in CUDA-graph replay, medians of {ROUNDS} rounds timed in turn; old = the padded "
                     f"rows, swz = the swizzled ring; swz / old < 1: the swizzle faster; cudnn / swz >= 1: at or below "
                     f"cuDNN; TB/s = K/V bytes / time", None if args.no_check else correctness,
                     lambda limit: timing(limit, cases, args.unsplit, splits), table, args.time_limit, args.json)


if __name__ == "__main__":
    sys.exit(main())
