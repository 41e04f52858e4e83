"""Diagnostic (GPU): the decode combine and split count on the latency-bound decoding cases.

    python -m bench.diag.decode_probe [--quick] [--time-limit SECONDS] [--json FILE]

(a) Correctness: flash_attn_with_kvcache's split path ("auto": flash_decode_combine_rows_kernel up to
    combine_rows_max_splits -- 16 at head dims up to 128, 8 at 256 --, flash_decode_combine_kernel above), the block
    combine forced ("block") and the previous one (flash_combine_kernel, "warp") against the float64 reference on a
    handful of shapes: MQA 32/1 and GQA 32/8 and 32/32, ragged cache_seqlens with a 0, a paged cache, num_splits forced
    to 1, 2, 7, 64 and 128, the fp32 partials poisoned with NaN before the launch. A row's error bound: 4e-3 x max(1,
    max |ref|) (fp16), LSE within 2e-4, -inf exactly where the reference has it (a cache of 0 keys), no NaN. Exit status
    1 when a case misses.
(b) GPU time per call in CUDA-graph replay (bench.bench_decode.capture_graph: GRAPH_CALLS calls per graph), head
    dim 128, fp16, 32 query heads, q_len 1, for batch 1 and 8 with 1, 8 and 32 KV heads, caches 1k-128k (cases of
    more than MAX_KV_BYTES of K/V, bandwidth-bound, left out):
      old      the wave-efficiency split count before `without_empty_splits` with the one-warp-per-row combine
      new      the default: the default split count, the default combine (one warp per row up to 16 splits at
               head dim 128, one block per row above)
      nS       S splits forced (a few counts around the default), the default combine
      cudnn / flash   SDPA's CUDNN and FLASH backends, enable_gqa=True on the unexpanded caches (cuDNN refusing
               that gets the caches expanded to 32 heads, outside the timing)
    every graph of a case replayed in turn (harness.time_rounds, ROUNDS rounds), medians. The last table: us per
    call and, per cuflash column, cuDNN's time over it ("x cudnn": >= 1.00 means at or below cuDNN's time).
With --json, the records go to that file as well. Stops timing new cases after --time-limit seconds
(default 140) so that the whole run stays under 3 minutes on an H200.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np

from bench.bench_decode import GRAPH_CALLS, _cache_case, capture_graph, grid_cases
from bench.harness import sdpa, time_rounds

MAX_KV_BYTES = 1 << 30  # the latency-bound part of the grid (bandwidth-bound caches are the decode suite's)
EXPAND_MAX_BYTES = 4 << 30  # K and V expanded to 32 heads for an SDPA backend that refuses GQA: at most this
ROUNDS = 3
BATCHES = (1, 8)
KV_HEADS = (1, 8, 32)
CACHES = (1024, 4096, 16384, 32768, 131072)
FORCED = (8, 16, 32, 64, 128)


# --------------------------------------------------------------------------------------------- correctness
def _f64(x):
    return x.detach().double().cpu().numpy()


def _check(tag, out, lse, q, kc, vc, seqlens, causal=False, tol_o=4e-3, tol_lse=2e-4):
    """out / lse against the float64 reference per batch element on its own valid keys (kc, vc contiguous): out within
    tol_o x max(1, max |ref|), the LSE within tol_lse, -inf exactly where the reference has it, no NaN."""
    from cuflash import reference

    qn, kn, vn = _f64(q), _f64(kc), _f64(vc)
    o, ls = _f64(out), _f64(lse)
    ok, err, lerr = True, 0.0, 0.0
    for i, n in enumerate(seqlens):
        ro, rl = reference.attention_forward(qn[i:i + 1], kn[i:i + 1, :n], vn[i:i + 1, :n], None, causal)
        e = float(np.abs(np.nan_to_num(o[i], nan=1e9) - ro[0]).max())
        err = max(err, e)
        ok &= e <= tol_o * max(1.0, float(np.abs(ro[0]).max()))
        ok &= bool(np.array_equal(np.isneginf(ls[i]), np.isneginf(rl[0])))
        fin = np.isfinite(rl[0])
        if fin.any():
            le = float(np.abs(ls[i][fin] - rl[0][fin]).max())
            lerr = max(lerr, le)
            ok &= le < tol_lse
    ok &= not np.isnan(o).any()
    print(f"{'ok  ' if ok else 'FAIL'} {tag}: max|err| {err:.2e} lse {lerr:.2e}", flush=True)
    return ok


def correctness(quick=False) -> bool:
    import torch

    from cuflash.decode import plan_for, run_plan

    torch.manual_seed(0)
    d, h = 128, 32
    all_ok = True
    shapes = [(3, 4100, 1, [4100, 0, 130]), (2, 3000, 8, [3000, 17]), (2, 1500, 32, [0, 1499])]
    splits = (0, 1, 7, 128) if quick else (0, 1, 2, 7, 64, 128)
    for b, s, hk, lens in shapes:
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        for ns in splits:
            for combine in ("auto", "block", "warp"):  # auto: the rows combine up to combine_rows_max_splits
                plan = plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=ns, combine=combine)
                n = plan.num_splits
                rows = h // hk if hk < h else 1
                kh = hk if hk < h else h
                scratch = None if n == 1 else (torch.full((n, b, kh, rows, d), float("nan"), device="cuda"),
                                               torch.full((n, b, kh, rows), float("nan"), device="cuda"))
                out, lse = run_plan(plan, q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True, scratch=scratch)
                torch.cuda.synchronize()
                all_ok &= _check(f"b={b} hk={hk} s={s} lens={lens} splits={n}{'(auto)' if not ns else ''} {combine}",
                                 out, lse, q, kc, vc, lens)
    # a paged cache: pages of 16 keys in a random order, GQA 32/8, 3 lengths with a 0
    b, s, hk, ps = 3, 2048, 8, 16
    kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    lens = [2048, 0, 333]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kp, vp, bt = paged_copy(kc, vc, ps)
    for ns in (0, 3, 128):
        plan = plan_for(q, kp, vp, cache_seqlens=seqlens, num_splits=ns, block_table=bt)
        out, lse = run_plan(plan, q, kp, vp, cache_seqlens=seqlens, return_softmax_lse=True, block_table=bt)
        torch.cuda.synchronize()
        all_ok &= _check(f"paged {ps} b={b} hk={hk} lens={lens} splits={plan.num_splits}", out, lse, q, kc, vc, lens)
    return all_ok


# -------------------------------------------------------------------------------------------------- timing
def paged_copy(kc, vc, page):
    """The cache's keys in pages of `page` rows, in a random order: (k pages, v pages, block table int32)."""
    import torch

    b, s, hk, d = kc.shape
    perm = torch.randperm(b * s // page, device=kc.device)
    kx, vx = torch.empty_like(kc).view(-1, page, hk, d), torch.empty_like(vc).view(-1, page, hk, d)
    kx[perm], vx[perm] = kc.reshape(-1, page, hk, d), vc.reshape(-1, page, hk, d)
    return kx, vx, perm.reshape(b, s // page).to(torch.int32)


def _sdpa_fn(prov, q, kc, vc, h, hk):
    """SDPA pinned to `prov` on [b, h, s, d] views: native GQA, else (cuDNN refusing it) the caches expanded."""
    fn = sdpa(prov)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    gqa = h > hk
    try:
        fn(qt, kt, vt, enable_gqa=gqa)
        return lambda: fn(qt, kt, vt, enable_gqa=gqa)
    except RuntimeError:
        if not gqa or kc.numel() * 2 * 2 * (h // hk) > EXPAND_MAX_BYTES:
            raise
        ke = kt.repeat_interleave(h // hk, 1).contiguous()
        ve = vt.repeat_interleave(h // hk, 1).contiguous()
        return lambda: fn(qt, ke, ve)


def timing(limit_s: float, h=32, d=128) -> list:
    import torch

    from cuflash.decode import plan_for, run_plan

    bw = 4.2e12  # only for the floor column; the ratios are between providers of one run
    recs = []
    for hk, b, s, kv_bytes, late in grid_cases(KV_HEADS, BATCHES, CACHES, d, MAX_KV_BYTES, limit_s):
        if late:
            print(f"b={b} hk={hk} s={s}: skipped (past the {limit_s:.0f} s time limit)", flush=True)
            continue
        q, kc, vc, seqlens, _, floor_us = _cache_case(b, s, hk, h, d, bw)
        new = plan_for(q, kc, vc, cache_seqlens=seqlens)
        old = plan_for(q, kc, vc, cache_seqlens=seqlens, combine="warp", split_rule="waves_untrimmed")
        plans = {f"old({old.num_splits})": old, f"new({new.num_splits})": new}
        for n in FORCED:
            if n != new.num_splits and n <= max(1, s // 128):
                plans[f"n{n}"] = plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=n)
        calls = GRAPH_CALLS if kv_bytes < (256 << 20) else 4
        graphs = {}
        for name, plan in plans.items():
            graphs[name] = capture_graph(lambda plan=plan: run_plan(plan, q, kc, vc, cache_seqlens=seqlens),
                                         calls)
        for prov in ("cudnn", "flash"):
            try:
                graphs[prov] = capture_graph(_sdpa_fn(prov, q, kc, vc, h, hk), calls)
            except RuntimeError as e:
                print(f"sdpa {prov} b={b} hk={hk} s={s}: {str(e).splitlines()[0][:100]}")
        res = time_rounds({k: g.replay for k, g in graphs.items()}, rounds=ROUNDS, warmup=2, rep=10,
                          min_warmup_ms=2.0)
        us = {k: (v[0] * 1e3 / calls if v[0] is not None else None) for k, v in res.items()}
        rec = dict(batch=b, heads=h, heads_k=hk, seqlen_k=s, kv_mb=kv_bytes / 2 ** 20, floor_us=floor_us,
                   us=us, splits_new=new.num_splits, splits_old=old.num_splits)
        recs.append(rec)
        print(f"b={b} hk={hk} s={s // 1024}k: " + " ".join(f"{k}={v:.1f}" for k, v in us.items() if v),
              flush=True)
        del graphs, plans, q, kc, vc, seqlens
        gc.collect()
        torch.cuda.empty_cache()
    return recs


def table(recs) -> str:
    lines = ["| b | hk | cache | KV MB | cudnn us | flash us | old us (n) | new us (n) | best forced us (n) | "
             "old x cudnn | new x cudnn | best x cudnn |", "|" + "---|" * 12]

    def ratio(c, x):
        return f"{c / x:.2f}" if c and x else "-"

    for r in recs:
        us = r["us"]
        old = next(v for k, v in us.items() if k.startswith("old("))
        new = next(v for k, v in us.items() if k.startswith("new("))
        forced = {k: v for k, v in us.items() if k.startswith("n") and not k.startswith("new") and v}
        bk = min(forced, key=forced.get) if forced else None
        best = forced[bk] if bk else None
        c, f = us.get("cudnn"), us.get("flash")
        lines.append(f"| {r['batch']} | {r['heads_k']} | {r['seqlen_k'] // 1024}k | {r['kv_mb']:.0f} | "
                     f"{c or 0:.1f} | {f or 0:.1f} | {old or 0:.1f} ({r['splits_old']}) | "
                     f"{new or 0:.1f} ({r['splits_new']}) | "
                     f"{f'{best:.1f} ({bk[1:]})' if bk else '-'} | {ratio(c, old)} | {ratio(c, new)} | "
                     f"{ratio(c, min(x for x in (new, best) if x) if new or best else None)} |")
    return "\n".join(lines)


def run_probe(name, legend, correctness_fn, timing_fn, table_fn, time_limit_s, json_path=None) -> int:
    """The decode probes' run: correctness_fn() (None: skipped), then, with output poisoning off again,
    timing_fn(the seconds left of time_limit_s, at least 10), the records (and whether every check passed) to json_path, then `name (seconds): legend` and
    table_fn(records); the exit status: 1 when a correctness case missed."""
    from cuflash import _interop

    t0 = time.perf_counter()
    ok = True if correctness_fn is None else correctness_fn()
    _interop.POISON = False  # the checks poison every output; timed calls must not fill theirs
    print(f"correctness: {'skipped' if correctness_fn is None else 'all ok' if ok else 'FAILURES'} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    recs = timing_fn(max(10.0, time_limit_s - (time.perf_counter() - t0)))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(dict(correct=ok, records=recs), fh, indent=1)
    print(f"\n{name} ({time.perf_counter() - t0:.0f} s): {legend}; correctness {'ok' if ok else 'FAILED'}")
    print(table_fn(recs))
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.decode_probe")
    ap.add_argument("--quick", action="store_true", help="fewer split counts in the correctness part")
    ap.add_argument("--time-limit", type=float, default=140.0,
                    help="seconds after which no new timing case starts")
    ap.add_argument("--json", default=None, help="also write the records to this file")
    args = ap.parse_args(argv)
    return run_probe("decode probe", f"GPU us per call in CUDA-graph replay, medians of {ROUNDS} rounds; x cudnn = "
                     f"cuDNN's time / ours (>= 1.00: at or below cuDNN)", lambda: correctness(args.quick), timing,
                     table, args.time_limit, args.json)


if __name__ == "__main__":
    sys.exit(main())
