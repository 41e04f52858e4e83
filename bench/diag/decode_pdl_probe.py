"""Diagnostic (GPU): Programmatic Dependent Launch on the decode step (the combine after the split kernel, the decode
kernel after flash_attn_with_kvcache's append).

    python -m bench.diag.decode_pdl_probe [--time-limit SECONDS] [--json FILE]

(a) Correctness, every plan made twice, PDL on (plan_for(..., pdl=True) / CUFLASH_PDL's switch on) and off:
    MQA 32/1, GQA 32/8, MHA 32/32 with ragged cache_seqlens including 0, num_splits forced to 1, 2, 7, 64, 128 and
    the default; outputs NaN-poisoned (cuflash._interop.POISON) and the fp32 partials given as NaN-filled scratch.
    On and off must be bitwise equal (out and LSE), and within the float64 reference's bounds (decode_probe._check:
    4e-3 x max(1, max |ref|), LSE 2e-4, -inf exactly for an empty cache, no NaN). Appends through
    flash_attn_with_kvcache (one token and three causal tokens; with and without rotary, interleaved and not; a
    paged cache of 16-key pages): out, LSE and the written caches bitwise equal on and off, and against the
    reference on the written cache where no rotary is applied. CUDA graphs: a split step and an appending step
    captured with PDL and replayed twice, bitwise equal to the eager step without PDL. Every line says whether the
    plan really launched with PDL (plan.pdl: the device, the driver and the switch allow it). Exit status 1 when a
    case misses.
(b) GPU time per call in CUDA-graph replay (bench.bench_decode.capture_graph), head dim 128, fp16, 32 query heads,
    q_len 1, batch 1 and 8, 32 / 8 / 1 KV heads, caches 1k / 4k / 16k (the latency-bound steps): the default split
    count with PDL off and on, SDPA cuDNN (enable_gqa, bench.diag.decode_probe._sdpa_fn), and the one-token append
    step (flash_attn_with_kvcache with k, v; cuflash only) off and on; every graph of a case replayed in turn
    (harness.time_rounds, ROUNDS rounds), medians. Also the host time of one eager call, off and on (the ctypes
    cuLaunchKernelEx against CuPy's cuLaunchKernel).
The table comes last: us per call, on / off (below 1.00: PDL is faster) and cuDNN's time over each (>= 1.00: at or
below cuDNN's). Stops timing new cases after --time-limit seconds (default 120): the run stays under 3 minutes on an
H200.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

from bench.bench_decode import GRAPH_CALLS, capture_graph
from bench.diag.decode_probe import _check, _sdpa_fn
from bench.harness import time_rounds

ROUNDS = 3
BATCHES = (1, 8)
KV_HEADS = (32, 8, 1)
CACHES = (1024, 4096, 16384)
H, D = 32, 128


def _plans(**kw):
    from cuflash.decode import plan_for

    return {m: plan_for(**kw, pdl=m == "on") for m in ("off", "on")}


def _same(a, b) -> bool:
    """Bitwise equality (NaN included)."""
    import torch

    return a.shape == b.shape and bool(torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                   b.contiguous().view(-1).view(torch.uint8)))


def _line(ok, tag, pdl):
    print(f"{'ok  ' if ok else 'FAIL'} {tag}: {'PDL' if pdl else 'plain launches (PDL not used)'}", flush=True)
    return ok


def correctness() -> tuple:
    """(all ok, whether PDL was used by the plans that asked for it)."""
    import torch

    from cuflash import _interop, _launch, decode
    from cuflash.decode import run_plan

    torch.manual_seed(0)
    _interop.POISON = True
    all_ok, used = True, True
    # (a1) split launches, no append: the combine as the split kernel's dependent
    for b, s, hk, lens in ((3, 4100, 1, [4100, 0, 130]), (2, 3000, 8, [3000, 17]), (2, 1500, 32, [0, 1499])):
        kc = torch.randn(b, s, hk, D, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.float16)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        for ns in (0, 1, 2, 7, 64, 128):
            plans = _plans(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens, num_splits=ns)
            n = plans["on"].num_splits
            rows, kh = (H // hk, hk) if hk < H else (1, H)
            res = {}
            for m, plan in plans.items():
                scratch = None if n == 1 else (torch.full((n, b, kh, rows, D), float("nan"), device="cuda"),
                                               torch.full((n, b, kh, rows), float("nan"), device="cuda"))
                res[m] = run_plan(plan, q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True, scratch=scratch)
            torch.cuda.synchronize()
            tag = f"b={b} hk={hk} s={s} lens={lens} splits={n}{'(auto)' if not ns else ''}"
            same = _same(res["on"][0], res["off"][0]) and _same(res["on"][1], res["off"][1])
            ok = _check(tag + " on", *res["on"], q, kc, vc, lens) and same
            used &= plans["on"].pdl or n == 1
            all_ok &= _line(ok, tag + f" on == off bitwise: {same}", plans["on"].pdl)
    # (a2) appends through flash_attn_with_kvcache: the decode kernel as the append kernel's dependent
    for b, s, hk, sq, new, causal, rot, inter, paged, ns in (
            (3, 2048, 8, 1, 1, False, 0, True, False, 0), (3, 2048, 1, 1, 1, False, 64, True, False, 0),
            (3, 2048, 8, 3, 3, True, 128, False, False, 5), (2, 1024, 32, 1, 1, False, 0, True, False, 1),
            (3, 2048, 8, 1, 1, False, 64, False, True, 0), (3, 2048, 1, 1, 1, False, 0, True, True, 64)):
        lens = [s - 2 * new, 0, 700][:b]
        kc0 = torch.randn(b, s, hk, D, device="cuda", dtype=torch.float16)
        vc0 = torch.randn_like(kc0)
        q = torch.randn(b, sq, H, D, device="cuda", dtype=torch.float16)
        kn = torch.randn(b, new, hk, D, device="cuda", dtype=torch.float16)
        vn = torch.randn_like(kn)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        kw = dict(cache_seqlens=seqlens, causal=causal, num_splits=ns, return_softmax_lse=True)
        if rot:
            ang = torch.rand(s, rot // 2, device="cuda", dtype=torch.float32) * 6.28
            kw.update(rotary_cos=ang.cos().half(), rotary_sin=ang.sin().half(), rotary_interleaved=inter)
        if paged:
            ps = 16
            perm = torch.randperm(b * s // ps, device="cuda")
            kw["block_table"] = perm.reshape(b, s // ps).to(torch.int32)
        res, caches, pdl = {}, {}, {}
        for m in ("off", "on"):
            kc, vc = kc0.clone(), vc0.clone()
            if paged:
                kp, vp = torch.empty_like(kc).view(-1, ps, hk, D), torch.empty_like(vc).view(-1, ps, hk, D)
                kp[perm], vp[perm] = kc.reshape(-1, ps, hk, D), vc.reshape(-1, ps, hk, D)
                kc, vc = kp, vp
            _launch.PDL = m == "on"
            decode._PLANS.clear()
            res[m] = decode.flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
            (plan,) = decode._PLANS.values()
            pdl[m] = plan.pdl
            caches[m] = (kc, vc) if not paged else (kc[perm].reshape(b, s, hk, D), vc[perm].reshape(b, s, hk, D))
        torch.cuda.synchronize()
        tag = (f"append b={b} hk={hk} s={s} q={sq} new={new} causal={causal} rotary={rot}"
               f"{'/interleaved' if rot and inter else '/half' if rot else ''} paged={paged} splits={ns or 'auto'}")
        same = all(_same(res["on"][i], res["off"][i]) for i in (0, 1)) and \
            all(_same(caches["on"][i], caches["off"][i]) for i in (0, 1))
        ok = same and not pdl["off"]
        if not rot:  # the reference on the cache the append wrote (rotary moves q: the bitwise check covers it)
            total = [min(n + new, s) for n in lens]
            ok &= _check(tag + " on", *res["on"], q, *caches["on"], total) if sq == 1 or not causal else True
        used &= pdl["on"]
        all_ok &= _line(ok, tag + f" on == off bitwise (out, lse, caches): {same}", pdl["on"])
    # (a3) CUDA graphs: captured with PDL, replayed twice, against the eager step without PDL
    for hk, append in ((1, False), (8, True)):
        b, s = 2, 4096
        kc = torch.randn(b, s, hk, D, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.float16)
        kn, vn = (torch.randn(b, 1, hk, D, device="cuda", dtype=torch.float16) for _ in range(2))
        seqlens = torch.tensor([s - 1, 1000], dtype=torch.int32, device="cuda")
        kw = dict(k=kn, v=vn) if append else {}
        plans = _plans(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens, **kw)
        ref = run_plan(plans["off"], q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True, **kw)
        box = []
        g = capture_graph(lambda: box.append(run_plan(plans["on"], q, kc, vc, cache_seqlens=seqlens,
                                                      return_softmax_lse=True, **kw)), 1)
        same = True
        for _ in range(2):
            for x in box[-1]:
                x.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            same &= _same(box[-1][0], ref[0]) and _same(box[-1][1], ref[1])
        tag = f"graph b={b} hk={hk} s={s} append={append} splits={plans['on'].num_splits}"
        used &= plans["on"].pdl
        all_ok &= _line(same, tag + f" replays == eager off bitwise: {same}", plans["on"].pdl)
    _interop.POISON = False
    _launch.PDL = True
    decode._PLANS.clear()
    return all_ok, used


# -------------------------------------------------------------------------------------------------- timing
def host_us(n=300) -> dict:
    """Wall us per eager flash_attn_with_kvcache call (MQA b1 4k: split + combine; with a one-token append), PDL off
    and on; the GPU's queue is drained every 50 calls."""
    import torch

    from cuflash import _launch, decode

    b, s, hk = 1, 4096, 1
    kc = torch.randn(b, s, hk, D, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.float16)
    kn, vn = (torch.randn(b, 1, hk, D, device="cuda", dtype=torch.float16) for _ in range(2))
    seqlens = torch.full((b,), s - 1, dtype=torch.int32, device="cuda")
    out = {}
    for app in (False, True):
        kw = dict(k=kn, v=vn) if app else {}
        for m in ("off", "on", "off", "on"):
            _launch.PDL = m == "on"
            decode._PLANS.clear()
            decode.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw)
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(n // 50):
                t = time.perf_counter()
                for _ in range(50):
                    decode.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw)
                best = min(best, (time.perf_counter() - t) / 50 * 1e6)
                torch.cuda.synchronize()
            key = f"{'append ' if app else ''}{m}"
            out[key] = min(out.get(key, best), best)
    _launch.PDL = True
    decode._PLANS.clear()
    return out


def timing(limit_s: float) -> list:
    import torch

    from cuflash.decode import run_plan

    recs, t0 = [], time.perf_counter()
    for hk in KV_HEADS:
        for b in BATCHES:
            for s in CACHES:
                if time.perf_counter() - t0 > limit_s:
                    print(f"b={b} hk={hk} s={s}: skipped (past the {limit_s:.0f} s time limit)", flush=True)
                    continue
                kc = torch.randn(b, s, hk, D, device="cuda", dtype=torch.float16)
                vc = torch.randn_like(kc)
                q = torch.randn(b, 1, H, D, device="cuda", dtype=torch.float16)
                kn, vn = (torch.randn(b, 1, hk, D, device="cuda", dtype=torch.float16) for _ in range(2))
                full = torch.full((b,), s, dtype=torch.int32, device="cuda")
                short = torch.full((b,), s - 1, dtype=torch.int32, device="cuda")  # the append writes key s - 1
                plans = _plans(q=q, k_cache=kc, v_cache=vc, cache_seqlens=full)
                aplans = _plans(q=q, k_cache=kc, v_cache=vc, k=kn, v=vn, cache_seqlens=short)
                graphs = {}
                for m, p in plans.items():
                    graphs[m] = capture_graph(lambda p=p: run_plan(p, q, kc, vc, cache_seqlens=full), GRAPH_CALLS)
                for m, p in aplans.items():
                    graphs[f"append {m}"] = capture_graph(
                        lambda p=p: run_plan(p, q, kc, vc, kn, vn, cache_seqlens=short), GRAPH_CALLS)
                try:
                    graphs["cudnn"] = capture_graph(_sdpa_fn("cudnn", q, kc, vc, H, hk), GRAPH_CALLS)
                except RuntimeError as e:
                    print(f"sdpa cudnn b={b} hk={hk} s={s}: {str(e).splitlines()[0][:100]}")
                res = time_rounds({k: g.replay for k, g in graphs.items()}, rounds=ROUNDS, warmup=2, rep=10,
                                  min_warmup_ms=2.0)
                us = {k: (v[0] * 1e3 / GRAPH_CALLS if v[0] is not None else None) for k, v in res.items()}
                rec = dict(batch=b, heads=H, heads_k=hk, seqlen_k=s, splits=plans["on"].num_splits,
                           splits_append=aplans["on"].num_splits, pdl=plans["on"].pdl,
                           pdl_append=aplans["on"].pdl, us=us)
                recs.append(rec)
                print(f"b={b} hk={hk} s={s // 1024}k n={rec['splits']}: "
                      + " ".join(f"{k}={v:.2f}" for k, v in us.items() if v), flush=True)
                del graphs, plans, aplans
                gc.collect()
                torch.cuda.empty_cache()
    return recs


def table(recs, host) -> str:
    def r(a, b):
        return f"{a / b:.3f}" if a and b else "-"

    lines = ["| b | hk | cache | splits | cudnn us | off us | on us | on / off | off x cudnn | on x cudnn | "
             "append off us | append on us | append on / off |", "|" + "---|" * 13]
    for x in recs:
        u = x["us"]
        c, off, on, aoff, aon = (u.get(k) for k in ("cudnn", "off", "on", "append off", "append on"))
        lines.append(f"| {x['batch']} | {x['heads_k']} | {x['seqlen_k'] // 1024}k | {x['splits']} | {c or 0:.2f} | "
                     f"{off or 0:.2f} | {on or 0:.2f} | {r(on, off)} | {r(c, off)} | {r(c, on)} | {aoff or 0:.2f} | "
                     f"{aon or 0:.2f} | {r(aon, aoff)} |")
    if host:
        lines.append("")
        lines.append("host us per eager call (MQA b1 4k, split + combine): " + ", ".join(
            f"{k} {v:.1f}" for k, v in host.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.decode_pdl_probe")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds after which no new timing case starts")
    ap.add_argument("--json", default=None, help="also write the records to this file")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ok, used = correctness()
    print(f"correctness: {'all ok' if ok else 'FAILURES'}; PDL {'used' if used else 'NOT used'} where asked "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    host = host_us()
    recs = timing(max(10.0, args.time_limit - (time.perf_counter() - t0)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(correct=ok, pdl_used=used, host_us=host, records=recs), f, indent=1)
    print(f"\ndecode PDL probe ({time.perf_counter() - t0:.0f} s): GPU us per call in CUDA-graph replay, medians of "
          f"{ROUNDS} rounds; on / off < 1: PDL faster; x cudnn = cuDNN's time / ours (>= 1.00: at or below cuDNN); "
          f"correctness {'ok' if ok else 'FAILED'}, PDL {'used' if used else 'NOT used'}")
    print(table(recs, host))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
