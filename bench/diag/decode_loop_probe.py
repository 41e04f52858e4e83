"""Diagnostic (GPU): the decode kernel's ring refilled before the wait for a warp's next tile (plan_for(...,
refill="early"), DecodeTile.early_refill) against the default order, on the bandwidth-bound caches.

    python -m bench.diag.decode_loop_probe [--time-limit SECONDS] [--json FILE]

(a) Correctness of refill="early" (plan_for / run_plan) against the float64 reference per batch element on its own
    keys (decode_probe._check's bounds: 4e-3 (bf16 1.6e-2) x max(1, max |ref|), LSE 2e-4 (bf16 1e-3), -inf exactly
    where the reference has it, no NaN): ragged cache_seqlens with 0 and lengths inside a warp tile, MQA / GQA / MHA,
    head dims 64 / 128 / 256, fp16 and bf16, auto and forced split counts (1, 7), a paged cache of 16-key pages, the
    rows past each element's keys NaN and the fp32 partials NaN-filled scratch. Every case also runs with the default
    order at the same split count: the arithmetic and its order are the same, so the outputs must be bitwise equal
    ("bitwise" on the line). The other tiles of part (c) (s3, w8, r4) against the reference, MHA and MQA. Exit status 1
    when a case misses.
(b) The read sweep's per-warp rings (bench/diag/hbm_read_sweep.py WARP_RINGS: the decode kernel's loop without its
    arithmetic, refill after / before the wait, with and without a busy wait standing in for the products) and its
    decode mimic, on one 2 GiB buffer read as the b8 h32 16k d128 caches, each checked (block sums = the buffer's
    words), TB/s; timed in turn, ROUNDS rounds.
(c) GPU time per call in CUDA-graph replay (bench.bench_decode.capture_graph), q_len 1, 32 query heads, head dim 128
    (fp16; one bf16 case), the large caches of 32 and 8 KV heads (512 MB - 4 GB) and a few small ones: old = the
    default plan, new = refill="early", s3 = 32-key tiles x 4 warps x 3 stages with the default order (two tiles
    issued per warp at a wait as with new, from 208 KB of shared memory: 1 block per SM), w8 = 8 warps x 16-key tiles
    x 2 stages with the early refill (the d128 tile's shared memory; the occupancy question), r4 = 16-key tiles x 4
    warps x 4 stages with the default order (a deeper ring at the same shared memory), cudnn = SDPA's CUDNN backend
    (enable_gqa=True), timed in turn (harness.time_rounds, ROUNDS rounds, medians).
The table is last: us per call, new / old (< 1: the early refill faster), s3 / old, w8 / old, r4 / old, cudnn / new
(>= 1: new at or below cuDNN's time) and each provider's K/V bytes over its time in TB/s, then the read patterns of (b).
Stops starting timing cases after --time-limit seconds (default 150), so the run stays under 3 minutes on an H200.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

from bench.bench_decode import capture_graph
from bench.diag.decode_probe import ROUNDS, _check, _sdpa_fn
from bench.harness import time_rounds

H, D = 32, 128
CALLS = 4  # graph calls: every large case reads >= 512 MB (GPU time >> launch gaps)
PROVIDERS = ("old", "new", "s3", "w8", "r4", "cudnn")
# (DecodeTile args, refill) of the extra plans
TILES = {"s3": ((32, 4, 3), "wait"), "w8": ((16, 8, 2), "early"), "r4": ((16, 4, 4), "wait")}
# (KV heads, batch, cache length, dtype) of part (c), in order: the large caches first (32 KV heads: 512 MB - 4 GB;
# 8 KV heads: 1 - 4 GB), then small ones (latency-bound: the variant must not cost there)
CASES = [(32, 8, 16384, "float16"), (32, 1, 131072, "float16"), (32, 8, 32768, "float16"),
         (32, 1, 32768, "float16"), (32, 64, 4096, "float16"), (8, 8, 32768, "float16"),
         (8, 8, 131072, "float16"), (8, 64, 16384, "float16"), (8, 1, 131072, "bfloat16"),
         (1, 8, 65536, "float16"), (32, 1, 4096, "float16"), (8, 1, 16384, "float16"), (1, 1, 16384, "float16")]
# (batch, cache capacity, KV heads, query heads, head dim, dtype, cache_seqlens, page size) of part (a)
CHECKS = [(3, 4100, 1, 32, 128, "float16", [4100, 0, 130], 0),  # MQA: 32 folded rows (two row fragments)
          (2, 3001, 8, 32, 128, "bfloat16", [3001, 17], 0),
          (2, 1500, 32, 32, 128, "float16", [1499, 1], 0),
          (2, 2050, 2, 8, 64, "float16", [2050, 333], 0),
          (3, 1000, 4, 16, 64, "bfloat16", [1000, 0, 31], 0),
          (2, 1000, 2, 8, 256, "bfloat16", [999, 77], 0),
          (2, 700, 1, 16, 256, "float16", [700, 45], 0),
          (2, 777, 8, 8, 128, "bfloat16", [700, 777], 0),
          (3, 2048, 8, 32, 128, "float16", [2048, 0, 1000], 16)]  # paged, pages of 16 keys
TOL = {"float16": (4e-3, 2e-4), "bfloat16": (1.6e-2, 1e-3)}


def release_memory():
    import torch

    gc.collect()
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- correctness
def correctness() -> bool:
    import torch

    from cuflash import _configs, _interop
    from cuflash.decode import plan_for, run_plan

    torch.manual_seed(0)
    _interop.POISON = True
    all_ok = True
    for b, s, hk, h, d, dt, lens, ps in CHECKS:
        dtype = getattr(torch, dt)
        kc = torch.randn(b, s, hk, d, device="cuda").to(dtype)
        vc = torch.randn_like(kc)
        for i, n in enumerate(lens):  # the rows past each element's keys: NaN (the kernel must never use them)
            kc[i, n:] = float("nan")
            vc[i, n:] = float("nan")
        q = torch.randn(b, 1, h, d, device="cuda").to(dtype)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        kx, vx, bt = kc, vc, None
        if ps:  # the same keys in pages of ps rows, in a random order
            perm = torch.randperm(b * s // ps, device="cuda")
            kx, vx = torch.empty_like(kc).view(-1, ps, hk, d), torch.empty_like(vc).view(-1, ps, hk, d)
            kx[perm], vx[perm] = kc.reshape(-1, ps, hk, d), vc.reshape(-1, ps, hk, d)
            bt = perm.reshape(b, s // ps).to(torch.int32)
        for ns in (0, 1, 7):
            outs = {}
            for refill in ("early", "wait"):
                plan = plan_for(q, kx, vx, cache_seqlens=seqlens, block_table=bt, refill=refill,
                                num_splits=ns if ns or refill == "early" else outs["early"][2])
                n = plan.num_splits
                rows, kh = (h // hk, hk) if hk < h else (1, h)
                scratch = None if n == 1 else (torch.full((n, b, kh, rows, d), float("nan"), device="cuda"),
                                               torch.full((n, b, kh, rows), float("nan"), device="cuda"))
                out, lse = run_plan(plan, q, kx, vx, cache_seqlens=seqlens, return_softmax_lse=True, scratch=scratch,
                                    block_table=bt)
                torch.cuda.synchronize()
                outs[refill] = (out, lse, n)
            out, lse, n = outs["early"]
            same = torch.equal(out, outs["wait"][0]) and torch.equal(lse, outs["wait"][1])
            tag = (f"early {dt} d{d} b={b} h={h} hk={hk} s={s} lens={lens}{f' paged {ps}' if ps else ''} "
                   f"splits={n}{'(auto)' if not ns else ''} {'bitwise' if same else 'NOT BITWISE'} = default order")
            ok = _check(tag, out, lse, q, torch.nan_to_num(kc), torch.nan_to_num(vc), lens, *TOL[dt])
            if not same:
                print(f"FAIL {tag}: the early and default refill orders differ at the same split count", flush=True)
            all_ok &= ok and same
        del kc, vc, kx, vx
        release_memory()
    # the timing part's other tiles (d128, fp16), against the reference: MHA and MQA (two row fragments), 0 / 7 splits
    for hk, lens in ((32, [2000, 1001]), (1, [2000, 0])):
        kc = torch.randn(2, 2000, hk, D, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(2, 1, H, D, device="cuda", dtype=torch.float16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        for k, (t, refill) in TILES.items():
            for ns in (0, 7):
                plan = plan_for(q, kc, vc, cache_seqlens=seqlens, tile=_configs.DecodeTile(*t), refill=refill,
                                num_splits=ns)
                out, lse = run_plan(plan, q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True)
                torch.cuda.synchronize()
                all_ok &= _check(f"{k} {t} refill={refill} hk={hk} lens={lens} splits={plan.num_splits}", out, lse, q,
                                 kc, vc, lens, *TOL["float16"])
    _interop.POISON = False
    return all_ok


# ------------------------------------------------------------------------------------------- read sweep part
def read_rings() -> tuple:
    """([records], all checks ok) of the sweep's per-warp rings and its decode mimic on the decode case."""
    import torch

    from bench import bench_read as br
    from bench.diag import hbm_read_sweep as sw
    from bench.harness import median, time_ms

    buf = torch.empty(sw.BUFFER_BYTES // 2, dtype=torch.float16, device="cuda").normal_()
    words = buf.view(torch.int32)
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    recs, fns, ok, want = [], {}, True, {}
    for p in (sw.MIMIC, *sw.WARP_RINGS):
        rec = dict(name=p.name)
        recs.append(rec)
        try:
            prep = br.prepare(p, buf.data_ptr(), sw.BUFFER_BYTES, out.data_ptr(), stream=stream)
            out.fill_(0)
            prep.launch()
            torch.cuda.synchronize()
            lo, hi = prep.check_range
            if (lo, hi) not in want:
                want[(lo, hi)] = br.words_sum(words, lo, hi)
            good = br.block_sums_total(out, prep.grid) == want[(lo, hi)]
            rec.update(check="ok" if good else "FAIL", in_flight_per_sm=prep.in_flight_per_sm, bytes=prep.bytes_read)
            ok &= good
            fns[p.name] = (prep.launch, prep.bytes_read)
        except Exception as e:  # noqa: BLE001 - one point must not lose the others
            rec.update(check="error", error=f"{type(e).__name__}: {e}"[:300])
            ok = False
            print(f"{p.name}: {rec['error']}", flush=True)
    times = {k: [] for k in fns}
    for _ in range(ROUNDS):
        for k, (fn, _) in fns.items():
            times[k].append(time_ms(fn, warmup=3, rep=10, min_warmup_ms=5.0))
    for rec in recs:
        if rec["name"] in fns:
            ms = median(times[rec["name"]])
            rec.update(us=ms * 1e3, tb_per_s=fns[rec["name"]][1] / (ms * 1e-3) / 1e12)
            print(f"{rec['check']:5} {rec['name']}: {rec['tb_per_s']:.3f} TB/s "
                  f"({rec['in_flight_per_sm'] // 1024} KB issued per SM at a wait)", flush=True)
    del buf, words, out
    release_memory()
    return recs, ok


# -------------------------------------------------------------------------------------------------- timing
def timing(limit_s: float) -> list:
    import torch

    from cuflash import _configs
    from cuflash.decode import plan_for, run_plan

    recs = []
    t0 = time.perf_counter()
    for hk, b, s, dt in CASES:
        kv_bytes = 2 * b * s * hk * D * 2
        if time.perf_counter() - t0 > limit_s:
            print(f"b={b} hk={hk} s={s} {dt}: skipped (past the {limit_s:.0f} s time limit)", flush=True)
            continue
        dtype = getattr(torch, dt)
        kc = torch.randn(b, s, hk, D, device="cuda", dtype=dtype)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, H, D, device="cuda", dtype=dtype)
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        plans = {"old": plan_for(q, kc, vc, cache_seqlens=seqlens),
                 "new": plan_for(q, kc, vc, cache_seqlens=seqlens, refill="early")}
        for k, (t, refill) in TILES.items():
            plans[k] = plan_for(q, kc, vc, cache_seqlens=seqlens, tile=_configs.DecodeTile(*t), refill=refill)
        graphs = {k: capture_graph(lambda plan=plan: run_plan(plan, q, kc, vc, cache_seqlens=seqlens), CALLS)
                  for k, plan in plans.items()}
        try:
            graphs["cudnn"] = capture_graph(_sdpa_fn("cudnn", q, kc, vc, H, hk), CALLS)
        except RuntimeError as e:
            print(f"sdpa cudnn b={b} hk={hk} s={s}: {str(e).splitlines()[0][:100]}", flush=True)
        res = time_rounds({k: g.replay for k, g in graphs.items()}, rounds=ROUNDS, warmup=2, rep=10,
                          min_warmup_ms=2.0)
        us = {k: (v[0] * 1e3 / CALLS if v[0] is not None else None) for k, v in res.items()}
        rec = dict(batch=b, heads=H, heads_k=hk, seqlen_k=s, dtype=dt, kv_bytes=kv_bytes, us=us,
                   splits={k: p.num_splits for k, p in plans.items()},
                   tb_per_s={k: kv_bytes / (v * 1e-6) / 1e12 for k, v in us.items() if v})
        recs.append(rec)
        print(f"b={b} hk={hk} s={s // 1024}k {dt}: " + " ".join(f"{k}={v:.1f}us" for k, v in us.items() if v),
              flush=True)
        del graphs, plans
        release_memory()
    return recs


def table(recs, rings) -> str:
    cols = ["case", "KV MB", "splits old / new / s3 / w8 / r4"] + [f"{p} us" for p in PROVIDERS] + \
        ["new / old", "s3 / old", "w8 / old", "r4 / old", "cudnn / new"] + [f"{p} TB/s" for p in PROVIDERS]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def f(x, fmt):
        return format(x, fmt) if x else "-"

    def ratio(a, b):
        return f(a / b if a and b else None, ".3f")

    for r in recs:
        us, tb, sp = r["us"], r["tb_per_s"], r["splits"]
        case = f"hk{r['heads_k']} b{r['batch']} {r['seqlen_k'] // 1024}k{' bf16' if r['dtype'] == 'bfloat16' else ''}"
        cells = [case, f"{r['kv_bytes'] / 2 ** 20:.0f}", " / ".join(str(sp.get(k, "-")) for k in PROVIDERS[:5])]
        cells += [f(us.get(p), ".1f") for p in PROVIDERS]
        cells += [ratio(us.get(k), us.get("old")) for k in ("new", "s3", "w8", "r4")]
        cells += [ratio(us.get("cudnn"), us.get("new"))]
        cells += [f(tb.get(p), ".2f") for p in PROVIDERS]
        lines.append("| " + " | ".join(cells) + " |")
    if rings:
        lines += ["", "| read pattern (b8 hk32 16k d128 caches, 2 GiB) | KB issued per SM at a wait | TB/s | check |",
                  "|---|---|---|---|"]
        for r in rings:
            lines.append(f"| {r['name']} | {r.get('in_flight_per_sm', 0) // 1024} | {f(r.get('tb_per_s'), '.3f')} | "
                         f"{r['check']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.decode_loop_probe")
    ap.add_argument("--time-limit", type=float, default=150.0,
                    help="seconds (from the start) after which no new timing case starts")
    ap.add_argument("--json", default=None, help="also write the records to this file")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ok = correctness()
    print(f"correctness: {'all ok' if ok else 'FAILURES'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rings, rings_ok = read_rings()
    print(f"read rings: {'all checks ok' if rings_ok else 'CHECK FAILURES'} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    recs = timing(max(10.0, args.time_limit - (time.perf_counter() - t0)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(correct=ok, rings_ok=rings_ok, rings=rings, records=recs), fh, indent=1)
    print(f"\ndecode loop probe ({time.perf_counter() - t0:.0f} s): GPU us per call in CUDA-graph replay, medians of "
          f"{ROUNDS} rounds timed in turn; old = default plan (refill after the wait), new = refill before the wait, "
          f"s3 = 32 keys x 4 warps x 3 stages, w8 = 8 warps x 16 keys x 2 stages (early refill), r4 = 16 keys x 4 "
          f"warps x 4 stages; "
          f"x / old < 1: faster than the default; cudnn / new >= 1: new at or below cuDNN; TB/s = K/V bytes / time; "
          f"correctness {'ok' if ok else 'FAILED'}, read checks {'ok' if rings_ok else 'FAILED'}")
    print(table(recs, rings))
    return 0 if ok and rings_ok else 1


if __name__ == "__main__":
    sys.exit(main())
