"""Diagnostic (GPU, compute capability 9.0): the Hopper forward's TMA-store epilogue (Sm90FwdTile.o_tma, the
configured tiles' epilogue) against the 16-byte stores by every consumer thread (o_tma off; "default" below, the
epilogue before o_tma) and SDPA's cuDNN backend.

    python -m bench.diag.fwd90_ostore_probe [--rounds N] [--json FILE]

(a) Correctness, one line per case: the variant's output bitwise equal to the default kernel's, and both against
    the float64 reference (max abs error; bound 2e-3 fp16, 1.6e-2 bf16, scaled by max(1, max |ref|)) -- ragged
    tails with seqlen_q != seqlen_k and GQA, causal and not, head dims 64, 128 and 80 (below the kernel's 96: O's
    map clips the padding columns), packed sequences whose elements end inside, exactly at and past a 64-row box
    (the 16-byte stores take the boxes that cross an element's end), and a strided output. Outputs poisoned (NaN)
    before each launch. Exit status 1 when a case misses.
(b) Timing, the FA2 grid's short sequences (batch x seqlen = 16k, hidden 2048: seqlen 512, 1k, 2k), fp16/bf16, head
    dims 64 and 128, causal and not: the default and the variant each through a memoized plan
    (cuflash._fwd_sm90.make_plan, the plan flash_attn_func keeps; its call encodes no map once the pointers repeat)
    and SDPA cuDNN, timed in turn (harness.time_rounds: medians of `rounds` rounds of CUDA-event medians). The
    variant's plan counts its map encodings during the timing ("enc": 1 when the output's pointer repeats, as the
    caching allocator gives it back; more would mean a map encode on the call path). The table comes last:
    TFLOP/s, o_tma over default (> 1: the variant is faster), each over cuDNN.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np

ROUNDS = 3
SEQLENS = (512, 1024, 2048)
HEADDIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
BOUND = {"float16": 2e-3, "bfloat16": 1.6e-2}


def _tiles(d):
    from cuflash._configs import SM90_HEADDIMS, kernel_headdim, sm90_fwd_tile

    t = sm90_fwd_tile(kernel_headdim(d, SM90_HEADDIMS), False)
    return replace(t, o_tma=False), replace(t, o_tma=True)


def specs():
    """The kernels both parts launch: default and variant, per dtype, kernel head dim and mask."""
    from cuflash._configs import sm90_fwd_spec

    out = []
    for dt in DTYPES:
        for d in (*HEADDIMS, 96):
            for causal in (False, True):
                out += [sm90_fwd_spec(dt, d, causal, t) for t in _tiles(d)]
    return out


def _err(out, ref):
    o = out.float().cpu().numpy().astype(np.float64)
    return float(np.max(np.abs(o - ref))) if ref.size else 0.0, bool(np.isnan(o).any())


def np64(x):
    """A torch tensor as a float64 NumPy array (the reference's input)."""
    return x.float().cpu().numpy().astype(np.float64)


def ref_bound(dtype, ref):
    """The probes' error bound of an output against the float64 reference `ref`: BOUND scaled by max(1, max |ref|)."""
    return BOUND[dtype] * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)


def run_tile(qa, ka, va, causal, tile, out=None, packed=None):
    """The sm90 forward with an explicit tile into `out` (a fresh NaN-filled tensor when None; else poisoned first)."""
    import torch

    from cuflash import _fwd_sm90

    if out is None:
        b, sq, h, d = qa.shape
        out = torch.full((b, sq, h, d) if packed is None else (packed.total_q, h, d), float("nan"), device="cuda",
                         dtype=getattr(torch, qa.dtype))
    else:
        out.fill_(float("nan"))
    o, _ = _fwd_sm90.forward(qa, ka, va, None, causal, out=out, tile=tile, packed=packed)
    return o


def correctness() -> bool:
    import torch

    from cuflash import reference
    from cuflash._validate import check_qkv

    ok_all = True

    def line(name, dtype, a, b, ref):
        nonlocal ok_all
        same = bool((a == b).all()) if a.shape == b.shape else False
        e, nan = _err(a, ref)
        bound = ref_bound(dtype, ref)
        ok = same and not nan and e <= bound
        ok_all &= ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:<44} bitwise={'yes' if same else 'NO'} err={e:.2e} "
              f"(bound {bound:.1e}){' NaN' if nan else ''}", flush=True)

    for dtype, d, (b, sq, sk, h, hk) in (("float16", 64, (2, 777, 901, 4, 2)), ("bfloat16", 128, (2, 777, 901, 4, 2)),
                                         ("float16", 128, (3, 65, 300, 2, 2)), ("bfloat16", 64, (1, 1000, 129, 4, 1)),
                                         ("float16", 80, (2, 333, 444, 4, 2))):
        dt = getattr(torch, dtype)
        q = torch.randn(b, sq, h, d, device="cuda").to(dt)
        k, v = (torch.randn(b, sk, hk, d, device="cuda").to(dt) for _ in range(2))
        qa, ka, va = check_qkv(q, k, v)
        base, var = _tiles(d)
        for causal in (False, True):
            ref, _ = reference.attention_forward(np64(q), np64(k), np64(v), None, causal)
            line(f"{dtype} d{d} b{b} sq{sq} sk{sk} h{h}/{hk} causal={int(causal)}", dtype,
                 run_tile(qa, ka, va, causal, var), run_tile(qa, ka, va, causal, base), ref)
        if d == 128:  # a strided output: the first d columns of a wider tensor
            wide = torch.full((b, sq, h, d + 64), float("nan"), device="cuda", dtype=dt)
            o = run_tile(qa, ka, va, False, var, out=wide[..., :d])
            ref, _ = reference.attention_forward(np64(q), np64(k), np64(v), None, False)
            line(f"{dtype} d{d} strided out", dtype, o, run_tile(qa, ka, va, False, base), ref)
            if not bool(torch.isnan(wide[..., d:]).all()):
                print("FAIL strided out: columns outside the view written", flush=True)
                ok_all = False

    # packed sequences
    from cuflash._varlen import check_varlen

    lens_q, lens_k = (128, 300, 64, 65, 1000, 63, 1), (128, 200, 900, 65, 1000, 70, 5)
    for dtype, d in (("bfloat16", 128), ("float16", 64)):
        dt = getattr(torch, dtype)
        q = torch.randn(sum(lens_q), 4, d, device="cuda").to(dt)
        k, v = (torch.randn(sum(lens_k), 2, d, device="cuda").to(dt) for _ in range(2))
        cq, ck = (torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32, device="cuda")
                  for x in (lens_q, lens_k))
        base, var = _tiles(d)
        q4, k4, v4, packed = check_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k))
        for causal in (False, True):
            ref = np.zeros((sum(lens_q), 4, d))
            oq = ok_ = 0
            for lq, lk in zip(lens_q, lens_k):
                r, _ = reference.attention_forward(np64(q[oq:oq + lq])[None], np64(k[ok_:ok_ + lk])[None],
                                                   np64(v[ok_:ok_ + lk])[None], None, causal)
                ref[oq:oq + lq] = r[0]
                oq, ok_ = oq + lq, ok_ + lk
            line(f"{dtype} d{d} packed {len(lens_q)} seqs causal={int(causal)}", dtype,
                 run_tile(q4, k4, v4, causal, var, packed=packed), run_tile(q4, k4, v4, causal, base, packed=packed),
                 ref)
    return ok_all


def add_records(res, row, recs, dtype, b, h, s, d, causal, rounds):
    """The records of one timed point (harness.time_rounds' {name: (ms, per-round ms)}: "cudnn" and "flash" are SDPA's
    backends, every other name a cuflash sm90 tile) appended to recs, and each one's TFLOP/s into row[name]."""
    from ..harness import record

    for name, (ms, per) in res.items():
        sdpa = name in ("cudnn", "flash")
        r = record(name if sdpa else "cuflash", "sdpa" if sdpa else name, "fwd", dtype, b, h, s, s, d, causal, ms,
                   backend=None if sdpa else "sm90", rounds=rounds, round_ms=per)
        recs.append(r)
        row[name] = r["tflops"]


def timing(rounds):
    import torch

    from cuflash import _fwd_sm90
    from cuflash._validate import check_qkv

    from ..harness import sdpa, time_rounds

    count = [0]
    real = _fwd_sm90.encode_args

    def counting(maps, *ptrs):
        count[0] += 1
        return real(maps, *ptrs)

    _fwd_sm90.encode_args = counting
    recs, rows = [], []
    cud = sdpa("cudnn")
    try:
        for dtype in DTYPES:
            dt = getattr(torch, dtype)
            for d in HEADDIMS:
                base, var = _tiles(d)
                for s in SEQLENS:
                    b, h = 16384 // s, 2048 // d
                    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
                    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                    qa, ka, va = check_qkv(q, k, v)
                    for causal in (False, True):
                        plans = {n: _fwd_sm90.make_plan(qa, ka, va, None, causal, "auto", tile=t)
                                 for n, t in (("default", base), ("o_tma", var))}
                        assert plans["o_tma"].o_tma and not plans["default"].o_tma
                        fns = {n: (lambda p=p: p.run(qa.ptr, ka.ptr, va.ptr)) for n, p in plans.items()}
                        fns["cudnn"] = lambda: cud(qt, kt, vt, causal)
                        fns["o_tma"]()
                        c0 = count[0]
                        res = time_rounds(fns, rounds)
                        enc = count[0] - c0
                        row = dict(dtype=dtype, d=d, s=s, causal=causal, enc=enc)
                        add_records(res, row, recs, dtype, b, h, s, d, causal, rounds)
                        rows.append(row)
                        print(f"{dtype} d{d} s{s} causal={int(causal)}: " + " ".join(
                            f"{n}={row[n]:.0f}" if row.get(n) else f"{n}=n/a" for n in fns) + f" enc={enc}",
                            flush=True)
    finally:
        _fwd_sm90.encode_args = real
    return recs, rows


def table(rows):
    def f(x):
        return f"{x:7.0f}" if x else "    n/a"

    def ratio(a, b):
        return f"{a / b:6.3f}" if a and b else "   n/a"

    print("\nTFLOP/s (medians); o/def = o_tma over default (> 1: o_tma faster); x cudnn = over SDPA cuDNN")
    print(f"{'dtype':<9}{'d':>4}{'seqlen':>7}{'causal':>7} | {'default':>7} {'o_tma':>7} {'cudnn':>7} | "
          f"{'o/def':>6} {'def/cud':>7} {'o/cud':>6} | enc")
    for r in rows:
        print(f"{r['dtype']:<9}{r['d']:>4}{r['s']:>7}{int(r['causal']):>7} | {f(r.get('default'))} {f(r.get('o_tma'))} "
              f"{f(r.get('cudnn'))} | {ratio(r.get('o_tma'), r.get('default'))} "
              f"{ratio(r.get('default'), r.get('cudnn')):>7} {ratio(r.get('o_tma'), r.get('cudnn'))} | {r['enc']}")
    g = [r["o_tma"] / r["default"] for r in rows if r.get("o_tma") and r.get("default")]
    if g:
        print(f"geomean o_tma / default: {float(np.exp(np.mean(np.log(g)))):.3f} over {len(g)} points")


def print_geomeans(d, sel, pairs):
    """One line per (numerator, denominator) of `pairs` and range (512-1k, all) over the rows `sel` of head dim d: the
    geomean of the ratios of the two providers' TFLOP/s and its minimum."""
    for num, den in pairs:
        for label, keep in (("512-1k", lambda r: r["s"] <= 1024), ("all", lambda r: True)):
            g = [r[num] / r[den] for r in sel if keep(r) and r.get(num) and r.get(den)]
            if g:
                print(f"geomean d{d} {num} / {den} over {label}: {float(np.exp(np.mean(np.log(g)))):.3f} "
                      f"({len(g)} points, min {min(g):.3f})")


def probe_main(argv, specs_fn, correctness_fn, timing_fn, table_fn, time_limit_s=None, before=None):
    """The fwd90 probes' driver: sm90 check, --rounds (default ROUNDS) and, with time_limit_s, --time-limit (timing_fn
    then takes (rounds, deadline)), the specs compiled ahead, `before()` (its result goes to table_fn after the rows),
    correctness, timing, --json of the records, the table; exit status 1 when a correctness case missed."""
    import time

    from cuflash._fwd_sm90 import device_cc
    from cuflash.precompile import compile_specs

    t0 = time.perf_counter()
    if device_cc(0) != 90:
        print("needs a compute capability 9.0 GPU")
        return 2
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else ROUNDS
    compile_specs(specs_fn(), progress=True)
    extra = (before(),) if before else ()
    ok = correctness_fn()
    print(f"compiles and correctness: {time.perf_counter() - t0:.0f} s", flush=True)
    if time_limit_s is None:
        recs, rows = timing_fn(rounds)
    else:
        limit = float(argv[argv.index("--time-limit") + 1]) if "--time-limit" in argv else time_limit_s
        recs, rows = timing_fn(rounds, t0 + limit)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as fh:
            json.dump(recs, fh, indent=1)
    print(f"total {time.perf_counter() - t0:.0f} s")
    print(f"correctness: {'all ok' if ok else 'FAILURES (see the correctness lines)'}")
    table_fn(rows, *extra)
    return 0 if ok else 1


def main(argv):
    return probe_main(argv, specs, correctness, timing, table)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
