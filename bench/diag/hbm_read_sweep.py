"""Diagnostic (GPU, sm_90): which access pattern reads the H200's device memory fastest, and which property of the
decode kernel's pattern costs it against cuDNN.

    python -m bench.diag.hbm_read_sweep [--time-limit SECONDS] [--json FILE]

One 2 GiB buffer of random fp16, read by:
  * the sweep's kernels (cuda_src/micro/read_sweep.cu, points below: load kind ld.global.v4 / cp.async ring /
    cp.async.bulk ring, bytes in flight per block, threads and blocks per SM, layout of the work), each checked once
    (the per-block word sums must add up to the words of the bytes the layout covers: no tile read twice);
  * torch's x.sum(dtype=float32) and x.max() over the whole buffer (the harness' old read probe);
  * the decoders on one large decode step over the SAME bytes, K = the first GiB, V = the second, as
    [8, 16384, 32, 128] fp16 caches (b8, 32 heads, 32 KV heads, 16k keys, d128, one query token): SDPA's cuDNN
    backend and cuflash.flash_attn_with_kvcache, each in CUDA-graph replay (4 calls per graph);
all timed in turn, ROUNDS rounds (CUDA-event medians after warm-up; the decoders' graph time / 4 per call). Every
line is the bytes read over the median time, in TB/s. The heads points read the decode caches as the decoders do
(rows of 256 bytes, 8 KB apart in the [b, s, hk, d] cache; "bhsd" points read the same bytes as head-contiguous
rows); "decode mimic" is the sweep point with the decode kernel's pattern on this case (a block per (batch, head),
128 threads, K and V tiles interleaved, 64 KB in flight per block, 1 block per SM, 256 blocks in two waves), and the
points named "mimic + ..." change one property of it each.

Stops starting rounds after --time-limit seconds (default 120; the points measured keep what they have). The table
is last, sorted by TB/s, with the best pattern's parameters above it.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

from bench.bench_read import Heads, Point

BUFFER_BYTES = 2 << 30  # two 1 GiB caches (K, V) of the decode case, and the flat layouts' buffer
DECODE = dict(batch=8, heads=32, kv_heads=32, seqlen=16384, headdim=128)
ROUNDS = 3
REP = 10
GRAPH_CALLS = 4
BSHD = Heads(8, 32, 16384, "bshd")
BHSD = Heads(8, 32, 16384, "bhsd")

# The decode kernel's pattern on the decode case (cuda_src/flash_decode.cu, d128 tile 32 keys x 4 warps x 2 stages,
# 140 KB of shared memory): 256 blocks of 128 threads, 1 per SM; each warp has one (K 8 KB, V 8 KB) warp tile in
# flight, the block K and V rows [128 r, 128 r + 128): 64 KB per SM. Here: tiles of 128 threads x 8 chunks = 16 KB =
# 64 rows, K and V interleaved, a 4-stage ring -> K rows [64 j, 64 j + 128) and the same V rows in flight.
MIMIC = Point("decode mimic", "cp_async", 4, threads=128, blocks_per_sm=1, layout="heads_interleaved", hint="plain",
              heads=BSHD, note="the decode kernel's pattern")


def _mimic(name, **kw):
    d = dict(MIMIC.__dict__)
    d.update(name=name, note="", **kw)
    return Point(**d)


POINTS = (
    # --- flat grid-stride (the whole GPU sweeps the buffer front to back), one wave: load kind x bytes in flight
    Point("ldg U4 256t 6/SM", "ldg", 4, threads=256, blocks_per_sm=6),  # 36 registers: 6 blocks of 256 fit
    Point("ldg U8 256t 2/SM", "ldg", 8, threads=256, blocks_per_sm=2),
    Point("ldg U8 256t 4/SM", "ldg", 8, threads=256, blocks_per_sm=4),
    Point("ldg U16 256t 2/SM", "ldg", 16, threads=256, blocks_per_sm=2),
    Point("ldg U16 128t 5/SM", "ldg", 16, threads=128, blocks_per_sm=5),  # 83 registers: 5 blocks of 128 fit
    Point("ldg U8 128t 8/SM", "ldg", 8, threads=128, blocks_per_sm=8),
    Point("ldg U8 512t 2/SM", "ldg", 8, threads=512, blocks_per_sm=2),
    Point("ldg U8 256t 4/SM plain", "ldg", 8, threads=256, blocks_per_sm=4, hint="plain"),
    Point("ldg U8 256t 4/SM L2::128B", "ldg", 8, threads=256, blocks_per_sm=4, hint="l2_128"),
    Point("ldg U8 256t 4/SM L2::256B", "ldg", 8, threads=256, blocks_per_sm=4, hint="l2_256"),
    Point("cp.async 2st 256t 1/SM", "cp_async", 2, threads=256, blocks_per_sm=1),
    Point("cp.async 4st 256t 1/SM", "cp_async", 4, threads=256, blocks_per_sm=1),
    Point("cp.async 6st 256t 1/SM", "cp_async", 6, threads=256, blocks_per_sm=1),
    Point("cp.async 4st 128t 1/SM", "cp_async", 4, threads=128, blocks_per_sm=1),
    Point("cp.async 4st 128t 2/SM", "cp_async", 4, threads=128, blocks_per_sm=2),
    Point("cp.async 4st 256t 1/SM L2::256B", "cp_async", 4, threads=256, blocks_per_sm=1, hint="l2_256"),
    Point("bulk 16KB x4 1/SM", "bulk", 4, threads=128, bulk_kb=16),
    Point("bulk 32KB x4 1/SM", "bulk", 4, threads=128, bulk_kb=32),
    Point("bulk 32KB x6 1/SM", "bulk", 6, threads=128, bulk_kb=32),
    Point("bulk 64KB x3 1/SM", "bulk", 3, threads=128, bulk_kb=64),
    Point("bulk 8KB x8 2/SM", "bulk", 8, threads=128, blocks_per_sm=2, bulk_kb=8),
    Point("bulk 4KB x8 4/SM", "bulk", 8, threads=128, blocks_per_sm=4, bulk_kb=4),
    # --- flat, each block one contiguous chunk (132-528 streams far apart)
    Point("ldg U8 256t 4/SM chunk", "ldg", 8, threads=256, blocks_per_sm=4, layout="flat_chunk"),
    Point("cp.async 4st 256t 1/SM chunk", "cp_async", 4, threads=256, blocks_per_sm=1, layout="flat_chunk"),
    Point("bulk 32KB x4 1/SM chunk", "bulk", 4, threads=128, bulk_kb=32, layout="flat_chunk"),
    # --- the decode layout: the mimic, then one property changed at a time
    MIMIC,
    _mimic("mimic + ring 8 (128 KB/SM)", depth=8),
    _mimic("mimic + ring 12 (192 KB/SM)", depth=12),
    _mimic("mimic + 2/SM (one wave, 128 KB/SM)", blocks_per_sm=2),
    _mimic("mimic + 16 splits (31 waves)", splits=16),
    _mimic("mimic + 16 splits split-major", splits=16, order="split"),
    _mimic("mimic + K then V", layout="heads_seq"),
    _mimic("mimic + bhsd (head-contiguous)", heads=BHSD),
    _mimic("mimic + L2::256B", hint="l2_256"),
    _mimic("mimic + ring 8 + 16 splits", depth=8, splits=16),
    Point("heads ldg U8 256t 4/SM 16 splits", "ldg", 8, threads=256, blocks_per_sm=4, layout="heads_interleaved",
          splits=16, heads=BSHD),
    Point("heads cp.async 4st 256t 1/SM", "cp_async", 4, threads=256, blocks_per_sm=1, layout="heads_interleaved",
          hint="plain", heads=BSHD),
    Point("heads bhsd bulk 16KB x4 1/SM", "bulk", 4, threads=128, bulk_kb=16, layout="heads_interleaved",
          heads=BHSD),
)


def specs():
    """Every KernelSpec the sweep launches (one per kernel name: the paddings share the compiled function)."""
    return list({p.spec().name: p.spec() for p in POINTS}.values())


# ------------------------------------------------------------------------------------------------ GPU side
def _precompile(arch: int):
    """Compile every sweep kernel in parallel processes (CuPy's disk cache), as bench_micro does."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from cuflash.precompile import _compile

    todo = [s for s in specs() if s.min_arch <= arch]
    jobs = max(2, min(16, os.cpu_count() or 2))
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for name, regs, local, sec in pool.map(_compile, todo):
            print(f"  compiled {name}: {regs} registers, {local} B local, {sec:.1f} s", flush=True)


def _decoders(buf):
    """{name: (fn, bytes per call, extra)} of the decoders on the decode case over buf's bytes (graph replays)."""
    import torch

    import cuflash
    from bench.bench_decode import capture_graph
    from bench.diag.decode_probe import _sdpa_fn
    from cuflash.decode import plan_for

    b, h, hk, s, d = (DECODE[k] for k in ("batch", "heads", "kv_heads", "seqlen", "headdim"))
    half = buf.view(torch.float16)
    n = b * s * hk * d
    kc, vc = half[:n].view(b, s, hk, d), half[n: 2 * n].view(b, s, hk, d)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * n * 2
    out = {}
    try:
        plan = plan_for(q, kc, vc, cache_seqlens=seqlens)
        g = capture_graph(lambda: cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens), GRAPH_CALLS)
        out["cuflash decode"] = (g.replay, kv_bytes, dict(num_splits=plan.num_splits, graph=g))
    except Exception as e:  # noqa: BLE001 - recorded as missing
        print(f"cuflash decode: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    try:
        g = capture_graph(_sdpa_fn("cudnn", q, kc, vc, h, hk), GRAPH_CALLS)
        out["sdpa cudnn"] = (g.replay, kv_bytes, dict(graph=g))
    except Exception as e:  # noqa: BLE001
        print(f"sdpa cudnn: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    return out


def _fmt_row(r):
    p = r.get("point") or {}
    def kb(x):
        return "-" if x is None else f"{x / 1024:.0f}"
    return [r["name"], p.get("kind", r.get("provider", "")), p.get("hint", "-"), p.get("layout", "-"),
            str(p.get("threads", "-")), str(r.get("resident", "-")),
            "-" if r.get("waves") is None else f"{r['waves']:.2f}", kb(r.get("in_flight_per_sm")),
            "-" if r.get("us") is None else f"{r['us']:.0f}",
            "-" if r.get("tb_per_s") is None else f"{r['tb_per_s']:.3f}",
            "-" if r.get("x_decode") is None else f"{r['x_decode']:.3f}", r.get("check", "-")]


def table(recs) -> str:
    cols = ["pattern", "kind", "hint", "layout", "threads", "blk/SM", "waves", "KB in flight/SM", "us", "TB/s",
            "x cuflash decode", "check"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sorted(recs, key=lambda r: -(r.get("tb_per_s") or 0.0)):
        lines.append("| " + " | ".join(_fmt_row(r)) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=120.0, help="stop starting rounds after this many seconds")
    ap.add_argument("--json", default=None, help="write the records here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    import torch

    from bench import bench_read as br
    from bench.harness import header, median, time_ms

    cc = torch.cuda.get_device_capability()
    arch = cc[0] * 10 + cc[1]
    try:
        _precompile(arch)
    except Exception as e:  # noqa: BLE001 - each point then compiles (and reports) on its own
        print(f"precompile: {e}", flush=True)
    print(f"kernels ready in {time.perf_counter() - t0:.1f} s", flush=True)

    torch.manual_seed(0)
    buf = torch.empty(BUFFER_BYTES // 2, dtype=torch.float16, device="cuda").normal_()
    words = buf.view(torch.int32)
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    sums = {}
    recs, fns = {}, {}
    for p in POINTS:
        if p.kind == "bulk" and arch < 90:
            continue
        rec = dict(name=p.name, provider="sweep", point=dict(p.__dict__, heads=p.heads.__dict__), note=p.note)
        recs[p.name] = rec
        try:
            prep = br.prepare(p, buf.data_ptr(), BUFFER_BYTES, out.data_ptr(), stream=stream)
            out.fill_(0)
            prep.launch()
            torch.cuda.synchronize()
            lo, hi = prep.check_range
            want = sums.get((lo, hi))
            if want is None:
                want = sums[(lo, hi)] = br.words_sum(words, lo, hi)
            got = br.block_sums_total(out, prep.grid)
            rec.update(grid=prep.grid, resident=prep.resident, waves=prep.waves, bytes=prep.bytes_read,
                       in_flight_per_sm=prep.in_flight_per_sm, smem=p.spec().smem, kernel=p.spec().name,
                       check="ok" if got == want else "FAIL")
            if got != want:
                print(f"FAIL {p.name}: block sums {got:#x}, words {want:#x}", flush=True)
            fns[p.name] = (prep.launch, prep.bytes_read)
        except Exception as e:  # noqa: BLE001 - one point must not lose the others
            rec.update(error=f"{type(e).__name__}: {e}"[:400], check="error")
            print(f"{p.name}: {rec['error']}", flush=True)
    nbytes = buf.numel() * 2
    for name, fn in (("torch x.sum", lambda: buf.sum(dtype=torch.float32)), ("torch x.max", lambda: buf.max())):
        recs[name] = dict(name=name, provider="torch")
        fns[name] = (fn, nbytes)
    for name, (fn, kv_bytes, extra) in _decoders(buf).items():
        recs[name] = dict(name=name, provider="decoder", num_splits=extra.get("num_splits"), calls=GRAPH_CALLS)
        recs[name]["graph"] = extra["graph"]
        fns[name] = (fn, kv_bytes * GRAPH_CALLS)
    print(f"{len(fns)} patterns ready at {time.perf_counter() - t0:.1f} s", flush=True)

    times = {name: [] for name in fns}
    for rnd in range(ROUNDS):
        if rnd and time.perf_counter() - t0 > args.time_limit:
            print(f"stopped after {rnd} rounds (the {args.time_limit:.0f} s time limit)", flush=True)
            break
        for name, (fn, _) in fns.items():
            if time.perf_counter() - t0 > args.time_limit and times[name]:
                continue
            times[name].append(time_ms(fn, warmup=3, rep=REP, min_warmup_ms=5.0))
        print(f"round {rnd + 1} done at {time.perf_counter() - t0:.1f} s", flush=True)

    dec = None
    for name, (_, nb) in fns.items():
        r = recs[name]
        r.pop("graph", None)
        ms = median(times[name])
        calls = r.get("calls", 1)
        r.update(ms_rounds=times[name], us=ms * 1e3 / calls if ms else None,
                 tb_per_s=nb / (ms * 1e-3) / 1e12 if ms else None)
        if name == "cuflash decode":
            dec = r["tb_per_s"]
    for r in recs.values():
        r["x_decode"] = r["tb_per_s"] / dec if dec and r.get("tb_per_s") else None
    done = [r for r in recs.values() if r.get("tb_per_s")]
    if args.json:
        try:
            head = header()
        except Exception as e:  # noqa: BLE001
            head = dict(error=str(e))
        with open(args.json, "w") as f:
            json.dump({"header": head, "decode_case": DECODE, "records": list(recs.values())}, f, indent=1)
    del fns, buf, words
    gc.collect()
    best = max((r for r in done if r.get("provider") == "sweep" and r.get("check") == "ok"),
               key=lambda r: r["tb_per_s"], default=None)
    bad = [r["name"] for r in recs.values() if r.get("check") in ("FAIL", "error")]
    print(f"\nsweep of {len(POINTS)} points over {BUFFER_BYTES >> 20} MiB; decode case "
          f"b{DECODE['batch']} h{DECODE['heads']} hk{DECODE['kv_heads']} {DECODE['seqlen'] // 1024}k d{DECODE['headdim']}"
          f" fp16 (K/V {4 * DECODE['batch'] * DECODE['kv_heads'] * DECODE['seqlen'] * DECODE['headdim'] >> 20} MiB);"
          f" checks failed or errors: {bad or 'none'}; {time.perf_counter() - t0:.0f} s")
    if best:
        print(f"best pattern: {best['name']} = {best['tb_per_s']:.3f} TB/s; {best['point']} ({best['kernel']}, grid "
              f"{best['grid']}, {best['resident']} blocks/SM, {best['in_flight_per_sm'] // 1024} KB in flight per SM)")
    print(table(list(recs.values())))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
