"""Diagnostic (GPU, compute capability 9.0): the Hopper forward's tiles of two and three blocks per SM
(cuflash._configs.SM90_FWD_MINB_VARIANTS, Sm90FwdTile.min_blocks) against the configured tile and SDPA's cuDNN
backend at short sequences.

    python -m bench.diag.fwd90_minb_probe [--rounds N] [--time-limit S] [--json FILE]

(0) Residency: blocks per SM the driver can keep of each kernel (cuOccupancyMaxActiveBlocksPerMultiprocessor at its
    threads and dynamic shared memory): a variant's must equal its min_blocks, else it cannot hide anything.
(a) Correctness, one line per case and variant: the variant against the float64 reference (max abs error; bound
    2e-3 fp16, 1.6e-2 bf16, scaled by max(1, max |ref|)) and against the configured tile (max abs difference,
    reported: the KV tiles differ, so the sums round differently) -- ragged tails with seqlen_q != seqlen_k and GQA,
    causal (rows that see no key) and not, a head dim below the kernel's, packed sequences; the variant with the
    configured epilogue (o_tma inherited) and with the other one. Outputs poisoned (NaN) before each launch. Exit
    status 1 when a case misses.
(b) Timing, the FA2 grid's short sequences (batch x seqlen = 16k, hidden 2048: seqlen 512, 1k, 2k, 4k), fp16/bf16,
    head dims 64 and 128, causal and not: the configured tile and each variant through a memoized plan
    (cuflash._fwd_sm90.make_plan, the plan flash_attn_func keeps: no map encode once the pointers repeat) and SDPA
    cuDNN, timed in turn (harness.time_rounds: medians of `rounds` rounds of CUDA-event medians). The shortest
    points first; a point is not started past --time-limit seconds from the start (default 200), so the probe ends
    in time and the table holds the points done. The table comes last: TFLOP/s of the configured tile and cuDNN,
    then per variant its TFLOP/s over the configured tile's (> 1: the variant is faster) and over cuDNN's.
"""
from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import replace

import numpy as np

from .fwd90_ostore_probe import _err, add_records, np64, print_geomeans, probe_main, ref_bound, run_tile

TIME_LIMIT_S = 200.0
SEQLENS = (512, 1024, 2048, 4096)
DTYPES = ("float16", "bfloat16")


def headdims():
    from cuflash._configs import SM90_FWD_MINB_VARIANTS

    return tuple(sorted(SM90_FWD_MINB_VARIANTS))


def _tiles(d):
    """{"default": the configured tile, variant name: tile} at kernel head dim d."""
    from cuflash._configs import sm90_fwd_minb_tiles, sm90_fwd_tile

    return {"default": sm90_fwd_tile(d, False), **sm90_fwd_minb_tiles(d)}


def _flip(t):
    return replace(t, o_tma=not t.o_tma)


def specs():
    """The kernels both parts launch: the configured tile and every variant per dtype, head dim and mask; the
    variants with the other epilogue at the dtype of their correctness cases."""
    from cuflash._configs import sm90_fwd_spec

    out = []
    for d in headdims():
        for dt in DTYPES:
            for causal in (False, True):
                out += [sm90_fwd_spec(dt, d, causal, t) for t in _tiles(d).values()]
        for n, t in _tiles(d).items():
            if n != "default":
                out += [sm90_fwd_spec("bfloat16", d, c, _flip(t)) for c in (False, True)]
    return list(dict.fromkeys(out))


def residency():
    """(name, tile, blocks per SM the driver reports) of each kernel of the timing."""
    from cuflash._configs import sm90_fwd_spec
    from cuflash._launch import get_launcher

    cuda = ctypes.CDLL("libcuda.so.1")
    rows = []
    for d in headdims():
        for n, t in _tiles(d).items():
            lau = get_launcher(sm90_fwd_spec("float16", d, True, t), 0)
            nb = ctypes.c_int(0)
            rc = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(nb), ctypes.c_void_p(lau.ptr),
                                                                  lau.threads, ctypes.c_size_t(lau.smem))
            rows.append((d, n, t, nb.value if rc == 0 else None))
    return rows


def correctness() -> bool:
    import torch

    from cuflash import reference
    from cuflash._validate import check_qkv
    from cuflash._varlen import check_varlen

    ok_all = True

    def line(name, dtype, a, b, ref):
        nonlocal ok_all
        e, nan = _err(a, ref)
        diff = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
        bound = ref_bound(dtype, ref)
        ok = not nan and e <= bound
        ok_all &= ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:<60} err={e:.2e} (bound {bound:.1e}) vs default {diff:.1e}"
              f"{' NaN' if nan else ''}", flush=True)

    cases = [("float16", 64, (2, 777, 901, 4, 2)), ("bfloat16", 64, (1, 1000, 129, 4, 1)),
             ("float16", 56, (2, 333, 444, 4, 2)), ("bfloat16", 128, (2, 777, 901, 4, 2)),
             ("float16", 128, (3, 65, 300, 2, 2)), ("bfloat16", 120, (2, 333, 444, 4, 2))]
    for dtype, d, (b, sq, sk, h, hk) in cases:
        kd = 64 if d <= 64 else 128
        if kd not in headdims():
            continue
        dt = getattr(torch, dtype)
        q = torch.randn(b, sq, h, d, device="cuda").to(dt)
        k, v = (torch.randn(b, sk, hk, d, device="cuda").to(dt) for _ in range(2))
        qa, ka, va = check_qkv(q, k, v)
        tiles = _tiles(kd)
        for causal in (False, True):
            ref, _ = reference.attention_forward(np64(q), np64(k), np64(v), None, causal)
            base = run_tile(qa, ka, va, causal, tiles["default"])
            for n, t in tiles.items():
                if n == "default":
                    continue
                for tt in ((t, _flip(t)) if dtype == "bfloat16" else (t,)):
                    line(f"{n} o_tma={int(tt.o_tma)} {dtype} d{d} b{b} sq{sq} sk{sk} h{h}/{hk} causal={int(causal)}",
                         dtype, run_tile(qa, ka, va, causal, tt), base, ref)

    lens_q, lens_k = (128, 300, 64, 65, 1000, 63, 1), (128, 200, 900, 65, 1000, 70, 5)
    for d in headdims():
        dtype = "bfloat16"
        dt = getattr(torch, dtype)
        q = torch.randn(sum(lens_q), 4, d, device="cuda").to(dt)
        k, v = (torch.randn(sum(lens_k), 2, d, device="cuda").to(dt) for _ in range(2))
        cq_h, ck_h = (np.cumsum((0,) + x) for x in (lens_q, lens_k))
        q4, k4, v4, packed = check_varlen(q, k, v, *(torch.tensor(x, dtype=torch.int32, device="cuda")
                                                     for x in (cq_h, ck_h)), max(lens_q), max(lens_k))
        tiles = _tiles(d)
        for causal in (False, True):
            ref = np.concatenate([  # element by element: rows [q0, q1) against keys [k0, k1)
                reference.attention_forward(np64(q[q0:q1])[None], np64(k[k0:k1])[None], np64(v[k0:k1])[None], None,
                                            causal)[0][0]
                for q0, q1, k0, k1 in zip(cq_h, cq_h[1:], ck_h, ck_h[1:])])
            base = run_tile(q4, k4, v4, causal, tiles["default"], packed=packed)
            for n, t in tiles.items():
                if n != "default":
                    for tt in (t, _flip(t)):
                        line(f"{n} o_tma={int(tt.o_tma)} {dtype} d{d} packed {len(lens_q)} seqs causal={int(causal)}",
                             dtype, run_tile(q4, k4, v4, causal, tt, packed=packed), base, ref)
    return ok_all


def timing(rounds, deadline):
    import torch

    from cuflash import _fwd_sm90
    from cuflash._validate import check_qkv

    from ..harness import sdpa, time_rounds

    recs, rows = [], []
    cud = sdpa("cudnn")
    for s in SEQLENS:  # the shortest first: the points the variants are for
        for d in headdims():
            tiles = _tiles(d)
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
                    for n, t in tiles.items():
                        p = _fwd_sm90.make_plan(qa, ka, va, None, causal, "auto", tile=t)
                        fns[n] = lambda p=p: p.run(qa.ptr, ka.ptr, va.ptr)
                    fns["cudnn"] = lambda: cud(qt, kt, vt, causal)
                    res = time_rounds(fns, rounds)
                    row = dict(dtype=dtype, d=d, s=s, causal=causal)
                    add_records(res, row, recs, dtype, b, h, s, d, causal, rounds)
                    rows.append(row)
                    print(f"{dtype} d{d} s{s} causal={int(causal)}: " + " ".join(
                        f"{n}={row[n]:.0f}" if row.get(n) else f"{n}=n/a" for n in fns), flush=True)
    return recs, rows


def table(rows, occ):
    def f(x):
        return f"{x:6.0f}" if x else "   n/a"

    def ratio(a, b):
        return f"{a / b:5.2f}" if a and b else "  n/a"

    print("\nblocks per SM (driver) / asked (min_blocks), tiles:")
    for d, n, t, nb in occ:
        print(f"  d{d} {n:<11} {nb} / {t.min_blocks}  block_m {t.block_m} block_n {t.block_n} stages {t.stages} "
              f"regs {t.regs_mma}/{t.regs_load} pingpong {int(t.pingpong)} o_tma {int(t.o_tma)}")
    for d in sorted({r["d"] for r in rows}):
        names = [n for n in _tiles(d) if n != "default"]
        sel = [r for r in rows if r["d"] == d]
        print(f"\nd{d}: TFLOP/s (medians) of the configured tile (def) and cuDNN; per variant: over def | over cuDNN")
        print(f"{'dtype':<9}{'seqlen':>7}{'causal':>7} | {'def':>6} {'cudnn':>6} {'def/c':>5} | "
              + " | ".join(f"{n:>11}" for n in names))
        for r in sel:
            print(f"{r['dtype']:<9}{r['s']:>7}{int(r['causal']):>7} | {f(r.get('default'))} {f(r.get('cudnn'))} "
                  f"{ratio(r.get('default'), r.get('cudnn'))} | " + " | ".join(
                      f"{ratio(r.get(n), r.get('default'))} {ratio(r.get(n), r.get('cudnn'))}" for n in names))
        print_geomeans(d, sel, [(n, "default") for n in names])

def main(argv):
    return probe_main(argv, specs, correctness, timing, table, TIME_LIMIT_S, before=residency)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
