"""Diagnostic (GPU, sm_90): the decode kernel's TMA loads (loads="tma") against its cp.async ring.

    python -m bench.diag.decode_tma_probe [--time-limit SECONDS] [--json FILE]

(a) Correctness of loads="tma" (plan_for / run_plan) against the float64 reference per batch element on its own
    keys: cache lengths that are not multiples of the warp tile (the last tile's V rows past cache_seqlens are the
    cache's, poisoned with NaN here, and must be zeroed by the kernel; rows past the cache's end arrive as TMA's
    zeros), batch > 1 with different cache_seqlens (0 included), MQA / GQA / MHA, head dims 64 / 128 / 256, fp16 and
    bf16, auto and forced split counts (1, 7), the fp32 partials poisoned with NaN before the launch. A row's bound:
    4e-3 (fp16) / 1.6e-2 (bf16) x max(1, max |ref|), LSE within 2e-4 (bf16: 1e-3), -inf exactly where the
    reference has it, no NaN. Every case is also run with loads="cp_async" at the same split count and the TMA
    kernel's warp tiles (block_n, nwarps; `tile=`): both kernels then deal the same warp tiles to the same warps and
    do the same arithmetic in the same order (only the loads, the ring depth and the shared-memory layout differ), so
    the outputs must be bitwise equal ("bitwise" on the line). Exit status 1 when a case misses.
(b) GPU time per call in CUDA-graph replay (bench.bench_decode.capture_graph), q_len 1, 32 query heads, head dim
    128, fp16 (and one bf16 case), on the bandwidth-bound caches: old = loads="cp_async" (the cp.async ring, its own
    tile), new = loads="tma" (DECODE_TMA_TILES), new32 = loads="tma" with 32-key warp tiles (32 x 4 warps x 3
    stages, 1 block per SM; cases of <= 16 rows per block only), cudnn = SDPA's CUDNN backend (enable_gqa=True;
    expanded caches when it refuses GQA and they fit), timed in turn (harness.time_rounds, ROUNDS rounds, medians).
    The read-only bandwidth probe of the harness (harness.measure_ceilings: a full reduction of 1 GiB) is measured
    first. The last table: us per call, new / old (< 1: TMA faster), new32 / old, cudnn / new (>= 1: TMA at or
    below cuDNN's time) and each provider's K/V bytes over its time in TB/s.
Stops starting timing cases after --time-limit seconds (default 150) so that the run stays under 3 minutes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from bench.bench_decode import capture_graph
from bench.diag.decode_probe import ROUNDS, _check, _sdpa_fn, graph_times, release_memory
from bench.harness import measure_ceilings, read_bandwidth
H, D = 32, 128
NEW32 = (32, 4, 3)  # (block_n, nwarps, stages) of the alternative head-dim-128 TMA tile timed as "new32"
PROVIDERS = ("old", "new", "new32", "cudnn")
# (KV heads, batch, cache length, dtype) of the timing part, in order (the bulk-copy probe's cases)
CASES = [(32, 1, 32768, "float16"), (32, 1, 131072, "float16"), (32, 8, 16384, "float16"),
         (32, 8, 32768, "float16"), (32, 64, 4096, "float16"),
         (8, 1, 131072, "float16"), (8, 8, 32768, "float16"), (8, 8, 131072, "float16"),
         (8, 64, 4096, "float16"), (8, 64, 16384, "float16"),
         (1, 8, 65536, "float16"), (8, 1, 131072, "bfloat16")]
# (batch, cache capacity, KV heads, query heads, head dim, dtype, cache_seqlens) of part (a)
CHECKS = [(3, 4100, 1, 32, 128, "float16", [4100, 0, 130]),  # MQA: 32 folded rows (two row fragments)
          (2, 3001, 8, 32, 128, "bfloat16", [3001, 17]),
          (2, 1500, 32, 32, 128, "float16", [1499, 1]),
          (2, 2050, 2, 8, 64, "float16", [2050, 333]),
          (3, 1000, 4, 16, 64, "bfloat16", [1000, 0, 31]),
          (2, 1000, 2, 8, 256, "bfloat16", [999, 77]),
          (2, 700, 1, 16, 256, "float16", [700, 45]),
          (2, 777, 8, 8, 128, "bfloat16", [700, 777])]  # MHA, ragged capacity (the last tile past the cache's end)
TOL = {"float16": (4e-3, 2e-4), "bfloat16": (1.6e-2, 1e-3)}


# --------------------------------------------------------------------------------------------- correctness
def correctness() -> bool:
    import torch

    from cuflash import _configs
    from cuflash.decode import plan_for, run_plan

    torch.manual_seed(0)
    all_ok = True
    for b, s, hk, h, d, dt, lens in CHECKS:
        dtype = getattr(torch, dt)
        kc = torch.randn(b, s, hk, d, device="cuda").to(dtype)
        vc = torch.randn_like(kc)
        for i, n in enumerate(lens):  # the rows past each element's keys: NaN (the kernel must never use them)
            kc[i, n:] = float("nan")
            vc[i, n:] = float("nan")
        q = torch.randn(b, 1, h, d, device="cuda").to(dtype)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        t = _configs.DECODE_TMA_TILES[d]
        same_tiles = _configs.DecodeTile(t.block_n, t.nwarps, _configs.decode_tile(d).stages)
        for ns in (0, 1, 7):
            outs = {}
            for loads in ("tma", "cp_async"):
                plan = plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=ns if ns or loads == "tma" else
                                outs["tma"][2], loads=loads, tile=same_tiles if loads == "cp_async" else None)
                assert plan.loads == loads, (plan.loads, plan.loads_reason)
                n = plan.num_splits
                rows, kh = (h // hk, hk) if hk < h else (1, h)
                scratch = None if n == 1 else (torch.full((n, b, kh, rows, d), float("nan"), device="cuda"),
                                               torch.full((n, b, kh, rows), float("nan"), device="cuda"))
                out, lse = run_plan(plan, q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True, scratch=scratch)
                torch.cuda.synchronize()
                outs[loads] = (out, lse, n)
            out, lse, n = outs["tma"]
            same = torch.equal(out, outs["cp_async"][0]) and torch.equal(lse, outs["cp_async"][1])
            tag = (f"tma {dt} d{d} b={b} h={h} hk={hk} s={s} lens={lens} splits={n}{'(auto)' if not ns else ''} "
                   f"{'bitwise' if same else 'NOT BITWISE'} = cp_async")
            tol, lse_tol = TOL[dt]
            kz = torch.nan_to_num(kc)  # the reference reads only the valid rows
            ok = _check(tag, out, lse, q, kz, torch.nan_to_num(vc), lens, tol=tol, lse_tol=lse_tol)
            if not same:
                print(f"FAIL {tag}: tma and cp_async outputs differ at the same split count and warp tiles", flush=True)
            all_ok &= ok and same
    return all_ok


# -------------------------------------------------------------------------------------------------- timing
def timing(limit_s: float, read_bw: float | None) -> list:
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
        plans = {"old": plan_for(q, kc, vc, cache_seqlens=seqlens, loads="cp_async"),
                 "new": plan_for(q, kc, vc, cache_seqlens=seqlens, loads="tma")}
        if H // hk <= 16:  # one row fragment: the 32-key tile compiles without spills there
            plans["new32"] = plan_for(q, kc, vc, cache_seqlens=seqlens, loads="tma", tile=_configs.DecodeTile(*NEW32))
        calls = 4  # graphs of a few calls: every case here reads >= 256 MB (GPU time >> launch gaps)
        graphs = {k: capture_graph(lambda plan=plan: run_plan(plan, q, kc, vc, cache_seqlens=seqlens), calls)
                  for k, plan in plans.items()}
        try:
            graphs["cudnn"] = capture_graph(_sdpa_fn("cudnn", q, kc, vc, H, hk), calls)
        except RuntimeError as e:
            print(f"sdpa cudnn b={b} hk={hk} s={s}: {str(e).splitlines()[0][:100]}", flush=True)
        us = graph_times(graphs, calls)
        rec = dict(batch=b, heads=H, heads_k=hk, seqlen_k=s, dtype=dt, kv_bytes=kv_bytes, us=us,
                   splits={k: p.num_splits for k, p in plans.items()},
                   tb_per_s={k: kv_bytes / (v * 1e-6) / 1e12 for k, v in us.items() if v},
                   read_probe_tb_per_s=read_bw / 1e12 if read_bw else None)
        recs.append(rec)
        print(f"b={b} hk={hk} s={s // 1024}k {dt}: " + " ".join(f"{k}={v:.1f}us" for k, v in us.items() if v),
              flush=True)
        del graphs, plans, q, kc, vc, seqlens
        release_memory()
    return recs


def table(recs, read_bw) -> str:
    cols = ["case", "KV MB", "splits old / new / new32"] + [f"{p} us" for p in PROVIDERS] + \
        ["new / old", "new32 / old", "cudnn / new"] + [f"{p} TB/s" for p in PROVIDERS]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def f(x, fmt):
        return format(x, fmt) if x else "-"

    def ratio(a, b):
        return f(a / b if a and b else None, ".3f")

    for r in recs:
        us, tb, sp = r["us"], r["tb_per_s"], r["splits"]
        case = f"hk{r['heads_k']} b{r['batch']} {r['seqlen_k'] // 1024}k{' bf16' if r['dtype'] == 'bfloat16' else ''}"
        cells = [case, f"{r['kv_bytes'] / 2 ** 20:.0f}", " / ".join(str(sp.get(k, "-")) for k in PROVIDERS[:3])]
        cells += [f(us.get(p), ".1f") for p in PROVIDERS]
        cells += [ratio(us.get("new"), us.get("old")), ratio(us.get("new32"), us.get("old")),
                  ratio(us.get("cudnn"), us.get("new"))]
        cells += [f(tb.get(p), ".2f") for p in PROVIDERS]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"read-only probe (1 GiB reduction): {f(read_bw / 1e12 if read_bw else None, '.2f')} TB/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.decode_tma_probe")
    ap.add_argument("--time-limit", type=float, default=150.0,
                    help="seconds (from the start) after which no new timing case starts")
    ap.add_argument("--json", default=None, help="also write the records to this file")
    args = ap.parse_args(argv)
    import torch

    t0 = time.perf_counter()
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        print(f"the TMA decode kernel runs on sm_90 only; this device is sm_{cc[0]}{cc[1]}")
        return 1
    ok = correctness()
    print(f"correctness: {'all ok' if ok else 'FAILURES'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    read_bw = read_bandwidth(measure_ceilings())
    recs = timing(max(10.0, args.time_limit - (time.perf_counter() - t0)), read_bw)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(correct=ok, read_probe_tb_per_s=read_bw / 1e12 if read_bw else None, records=recs), fh,
                      indent=1)
    print(f"\ndecode TMA probe ({time.perf_counter() - t0:.0f} s): GPU us per call in CUDA-graph replay, medians of "
          f"{ROUNDS} rounds timed in turn; old = cp.async ring, new = TMA loads (new32: 32-key TMA tiles, <= 16 rows); "
          f"new / old < 1: TMA faster; cudnn / new >= 1: TMA at or below cuDNN; TB/s = K/V bytes / time; correctness "
          f"{'ok' if ok else 'FAILED'}")
    print(table(recs, read_bw))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
