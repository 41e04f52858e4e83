"""Diagnostic (GPU, compute capability 9.0): the Hopper forward's persistent form (Sm90FwdTile.persistent, the kernel's
PERSIST; cuflash._configs.SM90_FWD_PERSIST_VARIANTS) against the one-tile kernels and SDPA's cuDNN and FLASH backends
on the FA2 grid.

    python -m bench.diag.fwd90_persist_probe [--rounds N] [--time-limit S] [--json FILE]

(a) Correctness, one line per case: the persistent variant against the float64 reference (max abs error; bound 2e-3
    fp16, 1.6e-2 bf16, scaled by max(1, max |ref|)) and bitwise against the one-tile kernel of the same tile shape
    (the same products per tile: any difference is a fault) -- ragged tails with seqlen_q != seqlen_k and GQA, causal
    and not, rows that see no key (seqlen_q > seqlen_k causal), a head dim below the kernel's, more tiles than SMs,
    packed sequences; each variant with both epilogues where it compiles both (d96, d128). Outputs poisoned (NaN)
    before each launch. Exit status 1 when a case misses.
(b) Timing, the FA2 grid (batch x seqlen = 16k, hidden 2048: seqlen 512-16k), fp16/bf16, head dims 64 and 128,
    causal and not: the tile the configuration takes at that key count with the persistent form left out ("def": the
    configured tile, at d64 up to 1k the short-keys tile of several blocks per SM), the persistent variant
    ("persist"), its tile shape as one tile per block where that is not "def" ("1tile": the schedule's effect apart
    from the tile's) through memoized plans (cuflash._fwd_sm90.make_plan: no map encode once the pointers repeat), SDPA
    cuDNN and SDPA FLASH, timed in turn (harness.time_rounds: medians of `rounds` rounds of CUDA-event medians). The
    shortest points first; a point is not started past --time-limit seconds from the start (default 200, compiles
    included), so the probe ends in time and the table holds the points done. The table comes last: TFLOP/s of def and
    cuDNN, then persist over def, over cuDNN and over FLASH (and over 1tile), with geomeans over 512-1k and over all
    points per head dim.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace

import numpy as np

from .fwd90_ostore_probe import _err, add_records, np64, print_geomeans, probe_main, ref_bound, run_tile

TIME_LIMIT_S = 200.0
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = ("float16", "bfloat16")
HEADDIMS = (64, 128)


def _tiles(d, causal, s):
    """{"def": the tile the configuration takes at s keys with the persistent form left out (the configured tile, or
    the short-keys tile of several blocks per SM), "persist": the variant, "1tile": its shape one tile per block (only
    where that is not def)}."""
    from cuflash._configs import SM90_FWD_TILES, sm90_fwd_persist_tiles, sm90_fwd_tile

    pt = sm90_fwd_persist_tiles(d)["persist"]
    cfg = sm90_fwd_tile(d, causal, s)
    out = {"def": SM90_FWD_TILES[d] if cfg.persistent else cfg, "persist": pt}
    one = replace(pt, persistent=False)
    if one != out["def"]:
        out["1tile"] = one
    return out


def _epilogues(d):
    from cuflash._configs import sm90_fwd_persist_tiles

    pt = sm90_fwd_persist_tiles(d)["persist"]
    return (pt,) if d == 64 else (pt, replace(pt, o_tma=not pt.o_tma))


def specs():
    from cuflash._configs import sm90_fwd_spec

    out = []
    for d in HEADDIMS:
        for dt in DTYPES:
            for causal in (False, True):
                for s in SEQLENS:
                    out += [sm90_fwd_spec(dt, d, causal, t) for t in _tiles(d, causal, s).values()]
                for t in _epilogues(d):
                    out += [sm90_fwd_spec(dt, d, causal, t), sm90_fwd_spec(dt, d, causal, replace(t, persistent=False))]
    return list(dict.fromkeys(out))


def correctness() -> bool:
    import torch

    from cuflash import reference
    from cuflash._validate import check_qkv
    from cuflash._varlen import check_varlen

    ok_all = True

    def line(name, dtype, a, b, ref):
        nonlocal ok_all
        e, nan = _err(a, ref)
        same = bool(torch.equal(a, b))
        bound = ref_bound(dtype, ref)
        ok = not nan and e <= bound and same
        ok_all &= ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:<62} err={e:.2e} (bound {bound:.1e}) "
              f"{'bitwise = one-tile' if same else 'DIFFERS from one-tile'}{' NaN' if nan else ''}", flush=True)

    cases = [("float16", 64, (2, 777, 901, 4, 2)), ("bfloat16", 64, (1, 1000, 129, 4, 1)),
             ("float16", 56, (2, 333, 444, 4, 2)), ("bfloat16", 128, (2, 777, 901, 4, 2)),
             ("float16", 128, (3, 65, 300, 2, 2)), ("bfloat16", 120, (2, 333, 444, 4, 2)),
             ("float16", 128, (2, 700, 100, 4, 4)), ("bfloat16", 128, (4, 1024, 1024, 40, 8))]
    for dtype, d, (b, sq, sk, h, hk) in cases:
        kd = 64 if d <= 64 else 128
        dt = getattr(torch, dtype)
        q = torch.randn(b, sq, h, d, device="cuda").to(dt)
        k, v = (torch.randn(b, sk, hk, d, device="cuda").to(dt) for _ in range(2))
        qa, ka, va = check_qkv(q, k, v)
        for causal in (False, True):
            ref, _ = reference.attention_forward(np64(q), np64(k), np64(v), None, causal)
            for t in _epilogues(kd):
                line(f"o_tma={int(t.o_tma)} {dtype} d{d} b{b} sq{sq} sk{sk} h{h}/{hk} causal={int(causal)}", dtype,
                     run_tile(qa, ka, va, causal, t), run_tile(qa, ka, va, causal, replace(t, persistent=False)),
                     ref)

    lens_q, lens_k = (128, 300, 64, 65, 1000, 63, 1), (128, 200, 900, 65, 1000, 70, 5)
    for d in HEADDIMS:
        dtype = "bfloat16"
        dt = getattr(torch, dtype)
        q = torch.randn(sum(lens_q), 4, d, device="cuda").to(dt)
        k, v = (torch.randn(sum(lens_k), 2, d, device="cuda").to(dt) for _ in range(2))
        cq_h, ck_h = (np.cumsum((0,) + x) for x in (lens_q, lens_k))
        q4, k4, v4, packed = check_varlen(q, k, v, *(torch.tensor(x, dtype=torch.int32, device="cuda")
                                                     for x in (cq_h, ck_h)), max(lens_q), max(lens_k))
        for causal in (False, True):
            ref = np.concatenate([  # element by element: rows [q0, q1) against keys [k0, k1)
                reference.attention_forward(np64(q[q0:q1])[None], np64(k[k0:k1])[None], np64(v[k0:k1])[None], None,
                                            causal)[0][0]
                for q0, q1, k0, k1 in zip(cq_h, cq_h[1:], ck_h, ck_h[1:])])
            for t in _epilogues(d):
                line(f"o_tma={int(t.o_tma)} {dtype} d{d} packed {len(lens_q)} seqs causal={int(causal)}", dtype,
                     run_tile(q4, k4, v4, causal, t, packed=packed),
                     run_tile(q4, k4, v4, causal, replace(t, persistent=False), packed=packed), ref)
    return ok_all


def timing(rounds, deadline):
    import torch

    from cuflash import _fwd_sm90
    from cuflash._validate import check_qkv

    from ..harness import sdpa, time_rounds

    recs, rows = [], []
    cud, fla = sdpa("cudnn"), sdpa("flash")
    for s in SEQLENS:  # the shortest first: the points the variant is for
        for d in HEADDIMS:
            for dtype in DTYPES:
                dt = getattr(torch, dtype)
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                qa, ka, va = check_qkv(q, k, v)
                for causal in (False, True):
                    if time.perf_counter() > deadline:
                        print(f"time limit reached: {dtype} d{d} s{s} causal={int(causal)} and later points not timed",
                              flush=True)
                        return recs, rows
                    fns = {}
                    for n, t in _tiles(d, causal, s).items():
                        p = _fwd_sm90.make_plan(qa, ka, va, None, causal, "auto", tile=t)
                        fns[n] = lambda p=p: p.run(qa.ptr, ka.ptr, va.ptr)
                    fns["cudnn"] = lambda: cud(qt, kt, vt, causal)
                    fns["flash"] = lambda: fla(qt, kt, vt, causal)
                    res = time_rounds(fns, rounds)
                    row = dict(dtype=dtype, d=d, s=s, causal=causal)
                    add_records(res, row, recs, dtype, b, h, s, d, causal, rounds)
                    rows.append(row)
                    print(f"{dtype} d{d} s{s} causal={int(causal)}: " + " ".join(
                        f"{n}={row[n]:.0f}" if row.get(n) else f"{n}=n/a" for n in fns), flush=True)
    return recs, rows


def table(rows):
    def f(x):
        return f"{x:6.0f}" if x else "   n/a"

    def ratio(a, b):
        return f"{a / b:6.3f}" if a and b else "   n/a"

    for d in sorted({r["d"] for r in rows}):
        sel = [r for r in rows if r["d"] == d]
        print(f"\nd{d}: TFLOP/s (medians) of the one-tile kernel the configuration would take (def) and cuDNN; persist "
              f"over def, over cuDNN, over FLASH and over its own tile one per block (1tile, where that is not def)")
        print(f"{'dtype':<9}{'seqlen':>7}{'causal':>7} | {'def':>6} {'cudnn':>6} {'def/c':>6} | {'pers':>6} "
              f"{'p/def':>6} {'p/c':>6} {'p/f':>6} {'p/1t':>6}")
        for r in sel:
            print(f"{r['dtype']:<9}{r['s']:>7}{int(r['causal']):>7} | {f(r.get('def'))} {f(r.get('cudnn'))} "
                  f"{ratio(r.get('def'), r.get('cudnn'))} | {f(r.get('persist'))} {ratio(r.get('persist'), r.get('def'))} "
                  f"{ratio(r.get('persist'), r.get('cudnn'))} {ratio(r.get('persist'), r.get('flash'))} "
                  f"{ratio(r.get('persist'), r.get('1tile'))}")
        print_geomeans(d, sel, [("persist", "def"), ("persist", "cudnn")])

def main(argv):
    return probe_main(argv, specs, correctness, timing, table, TIME_LIMIT_S)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
