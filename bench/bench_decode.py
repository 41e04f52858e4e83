"""Decoding benchmarks: q_len 1, 32 query heads, head dim 128, fp16, batch 1..64, cache 1k..128k, with
32, 8 and 1 KV heads. Time, K/V bytes read, the bandwidth floor (bytes / copy bandwidth measured in this
run), cuflash's dedicated decode kernel (heuristic splits and unsplit), the previous split-KV path (the
prefill kernel cut into splits, kernel="fwd_split", heuristic splits) and SDPA FLASH / CUDNN / EFFICIENT
(GQA expanded to full heads for them, outside the timing), then a small-step latency case.

Two times per case: `us` = median CUDA-event time of one call made from Python (includes the host time
when it exceeds the GPU time, as a caller sees it), and `graph_us` = GPU time per call of GRAPH_CALLS calls
captured in one CUDA graph (the GPU time, host overhead removed; every provider whose call can be captured). The
providers of a case are timed in turn, ROUNDS rounds of each kind of time, and the records carry the medians and
every round (`round_us`, `round_graph_us`).
Bandwidth: `bw_fraction` / `graph_bw_fraction` against the copy bandwidth (bytes read + written per second) and
`read_fraction` / `graph_read_fraction` against the read-only probe of the same run (harness.measure_ceilings):
the K/V bytes over the time, as a fraction of what a kernel that only reads streams."""
from __future__ import annotations

import gc

from .harness import (SDPA_PROVIDERS, host_us_per_call, measure_ceilings, read_bandwidth, record, sdpa, time_ms,
                      time_rounds)

MAX_KV_BYTES = 24 * 2 ** 30
GRAPH_CALLS = 20
MAX_SMEM = 227 * 1024  # opt-in dynamic shared memory per block on sm_90
ROUNDS = 3  # rounds timed in turn per decoding case (medians)


def capture_graph(fn, calls=GRAPH_CALLS):
    """`calls` calls of fn captured in one CUDA graph (after one warm-up call outside the capture: compilation,
    plans); raises what the capture raises."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return g


def grid_cases(kv_heads, batches, cache_lens, d, max_kv_bytes, time_limit_s):
    """(hk, b, s, kv_bytes, late) of the decoding grid in order of KV heads, batch, cache length, leaving out the
    cases of more than max_kv_bytes of K/V; late: `time_limit_s` seconds have passed since the first case."""
    import time

    t_start = time.perf_counter()
    for hk in kv_heads:
        for b in batches:
            for s in cache_lens:
                kv_bytes = 2 * b * s * hk * d * 2
                if kv_bytes <= max_kv_bytes:
                    yield hk, b, s, kv_bytes, time.perf_counter() - t_start > time_limit_s


def graph_us(fn, calls=GRAPH_CALLS, event_ms=None):
    """GPU microseconds per call: `calls` calls of fn captured in one CUDA graph, median replay time / calls.
    None if the call cannot be captured. Calls taking over a millisecond (host overhead irrelevant) are
    captured 2 at a time to keep the section short."""
    if event_ms is not None and event_ms > 1.0:
        calls = 2
    try:
        g = capture_graph(fn, calls)
        ms = time_ms(g.replay, warmup=2, rep=10, min_warmup_ms=5.0)
        del g
        return ms * 1e3 / calls
    except Exception as e:  # noqa: BLE001 - recorded as missing
        print(f"graph capture failed: {e}")
        return None


def _old_splits(b, h, hk, s, d):
    """The split count the fwd_split path picks (its own heuristic)."""
    from cuflash._configs import DECODE_TILES, fwd_smem_bytes
    from cuflash.decode import decode_slots, num_splits_heuristic

    t = DECODE_TILES[d]
    rows = h // hk if h > hk else 1
    return num_splits_heuristic(b * (hk if h > hk else h) * -(-rows // t.block_m),
                                decode_slots(0, fwd_smem_bytes(d, t)), -(-s // t.block_n))


def _cache_case(b, s, hk, h, d, bw):
    """One decoding case's fp16 inputs on the GPU: (q [b, 1, h, d], k_cache, v_cache [b, s, hk, d],
    cache_seqlens = s, K/V bytes, floor us = bytes / bw)."""
    import torch

    kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * b * s * hk * d * 2
    return q, kc, vc, seqlens, kv_bytes, kv_bytes / bw * 1e6


def _sdpa_decode_call(prov, qt, kc, vc, kt, vt, h, hk):
    """(algo, fn) of one SDPA backend on a decoding case, after one trial call; fn None where it is not run.
    FLASH and cuDNN take GQA/MQA natively (enable_gqa=True: K/V read once per KV head), so they get the caches as
    they are (cuDNN falls back to the caches expanded to h heads, kt / vt, if it refuses); the other backends get
    the expanded caches, when they fit (kt is None otherwise). Raises what the backend raises."""
    import torch

    fn = sdpa(prov)
    native = prov in ("flash", "cudnn") and h > hk
    if not native and kt is None:
        return "sdpa", None
    args = (qt, kc.transpose(1, 2), vc.transpose(1, 2)) if native else (qt, kt, vt)
    try:
        fn(*args, enable_gqa=native)
        torch.cuda.synchronize()
    except RuntimeError:
        if not (native and prov == "cudnn" and kt is not None):
            raise
        native, args = False, (qt, kt, vt)
        fn(*args, enable_gqa=False)
        torch.cuda.synchronize()
    return ("sdpa-enable-gqa" if native else "sdpa"), (lambda: fn(*args, enable_gqa=native))


def _time_in_turn(fns: dict, rounds: int):
    """({name: (median us, [us per round])} of one call from Python by CUDA events, the same of the GPU time per
    call in CUDA-graph replay): each timed in turn with the others in every round (harness.time_rounds). A call
    over a millisecond is captured 2 to a graph (host overhead irrelevant there), else GRAPH_CALLS; a provider
    whose call cannot be captured has no graph time."""
    ev = time_rounds(fns, rounds, rep=10, min_warmup_ms=5.0)
    graphs, per_graph = {}, {}
    for name, fn in fns.items():
        ms = ev[name][0]
        if ms is None:
            continue
        n = 2 if ms > 1.0 else GRAPH_CALLS
        try:
            graphs[name] = capture_graph(fn, n)
            per_graph[name] = n
        except Exception as e:  # noqa: BLE001 - recorded as missing
            print(f"{name}: graph capture failed: {e}")
    gr = time_rounds({k: g.replay for k, g in graphs.items()}, rounds, warmup=2, rep=10, min_warmup_ms=5.0)
    del graphs
    ev_us = {k: (v[0] * 1e3 if v[0] is not None else None, [x * 1e3 for x in v[1]]) for k, v in ev.items()}
    gr_us = {k: (v[0] * 1e3 / per_graph[k] if v[0] is not None else None, [x * 1e3 / per_graph[k] for x in v[1]])
             for k, v in gr.items()}
    return ev_us, gr_us


def decode(batches=(1, 8, 64), cache_lens=(1024, 4096, 16384, 32768, 131072), kv_heads=(32, 8, 1), h=32, d=128,
           time_limit_s=360.0, rounds=ROUNDS):
    """Every case of the decoding grid, in order of kv_heads, batch, cache length; cases left when `time_limit_s`
    seconds have passed are recorded as skipped (the small-step latency case runs first). Per case, cuflash's
    three paths and the SDPA backends are timed in turn, `rounds` rounds (medians), by CUDA events and in
    CUDA-graph replay."""
    import torch

    import cuflash
    from cuflash.decode import plan_for

    ceilings = measure_ceilings()
    bw, read_bw = ceilings[0]["tb_per_s"] * 1e12, read_bandwidth(ceilings)
    recs = decode_latency(d=d)
    for hk, b, s, kv_bytes, late in grid_cases(kv_heads, batches, cache_lens, d, MAX_KV_BYTES, time_limit_s):
        if late:
            print(f"decode hk={hk} b={b} s={s}: skipped (the section's time limit of {time_limit_s:.0f} s reached)")
            recs.append(record("cuflash", "skipped", "decode", "float16", b, h, 1, s, d, False, None,
                               heads_k=hk, kv_bytes=kv_bytes, skipped=True))
            continue
        q, kc, vc, seqlens, kv_bytes, floor_us = _cache_case(b, s, hk, h, d, bw)
        read_us = kv_bytes / read_bw * 1e6 if read_bw else None
        common = dict(heads_k=hk, kv_bytes=kv_bytes, floor_us=floor_us, read_floor_us=read_us)

        def fractions(us, gus):
            return dict(read_fraction=read_us / us if read_us and us else None,
                        graph_read_fraction=read_us / gus if read_us and gus else None)

        auto_new = plan_for(q, kc, vc, cache_seqlens=seqlens)
        unsplit = plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=1)
        calls = {}  # name -> (provider, algo, fn or None, record fields)
        for name, kernel, ns, extra in (
                ("decode-split", "decode", 0, dict(num_splits=auto_new.num_splits, geometry=auto_new.geometry)),
                ("decode-unsplit", "decode", 1, dict(num_splits=1, geometry=unsplit.geometry)),
                ("fwd_split-split", "fwd_split", 0, dict(num_splits=_old_splits(b, h, hk, s, d)))):
            def fn(ns=ns, kernel=kernel):
                return cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=ns,
                                                       kernel=kernel)

            calls[name] = ("cuflash", name, fn, dict(kernel=kernel, **extra))
        qt = q.transpose(1, 2)
        expand = kv_bytes * (h // hk) <= MAX_KV_BYTES  # SDPA needs GQA expanded to full heads
        if expand:
            kt = kc.transpose(1, 2).repeat_interleave(h // hk, 1) if h > hk else kc.transpose(1, 2)
            vt = vc.transpose(1, 2).repeat_interleave(h // hk, 1) if h > hk else vc.transpose(1, 2)
            kt, vt = kt.contiguous(), vt.contiguous()
        else:
            kt = vt = None
        for prov in SDPA_PROVIDERS:
            try:
                algo, fn = _sdpa_decode_call(prov, qt, kc, vc, kt, vt, h, hk)
            except RuntimeError as e:
                print(f"sdpa {prov} decode failed: {e}")
                algo, fn = "sdpa", None
            calls[prov] = (prov, algo, fn, dict(num_splits=None))
        ev_us, gr_us = _time_in_turn({k: c[2] for k, c in calls.items() if c[2] is not None}, rounds)
        for name, (prov, algo, _, extra) in calls.items():
            us, round_us = ev_us.get(name, (None, []))
            gus, round_gus = gr_us.get(name, (None, []))
            recs.append(record(prov, algo, "decode", "float16", b, h, 1, s, d, False, us / 1e3 if us else None,
                               us=us, graph_us=gus, rounds=rounds, round_us=round_us, round_graph_us=round_gus,
                               bw_fraction=floor_us / us if us else None,
                               graph_bw_fraction=floor_us / gus if gus else None,
                               **fractions(us, gus), **extra, **common))
        r = recs[-6:]
        print(f"decode hk={hk} b={b} s={s} floor={floor_us:.0f}us (event / graph us): " + " ".join(
            f"{x['algo'] if x['provider'] == 'cuflash' else x['provider']}="
            f"{x['us'] or 0:.0f}/{x['graph_us'] or 0:.0f}" for x in r))
        del kc, vc, q, kt, vt, calls
        gc.collect()
        torch.cuda.empty_cache()
    return recs


def decode_big_gqa(cases=((64, 8, 32768), (64, 1, 32768), (64, 1, 131072)), h=32, d=128, rounds=ROUNDS):
    """The grid's GQA/MQA cases whose caches expanded to 32 heads do not fit (`decode` leaves SDPA out of
    them): SDPA FLASH with enable_gqa=True on the unexpanded caches, next to cuflash, timed in turn (`rounds`
    rounds, medians)."""
    import torch

    import cuflash

    bw = measure_ceilings()[0]["tb_per_s"] * 1e12
    recs = []
    fa = sdpa("flash")
    for b, hk, s in cases:
        q, kc, vc, seqlens, kv_bytes, floor_us = _cache_case(b, s, hk, h, d, bw)
        common = dict(heads_k=hk, kv_bytes=kv_bytes, floor_us=floor_us)

        def ours():
            return cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        def theirs():
            return fa(qt, kt, vt, enable_gqa=True)

        ev_us, gr_us = _time_in_turn({"cuflash": ours, "flash": theirs}, rounds)
        for prov, algo in (("cuflash", "decode-split"), ("flash", "sdpa-enable-gqa")):
            us, round_us = ev_us.get(prov, (None, []))
            gus, round_gus = gr_us.get(prov, (None, []))
            recs.append(record(prov, algo, "decode", "float16", b, h, 1, s, d, False, us / 1e3 if us else None,
                               us=us, graph_us=gus, rounds=rounds, round_us=round_us, round_graph_us=round_gus,
                               bw_fraction=floor_us / us if us else None,
                               graph_bw_fraction=floor_us / gus if gus else None, **common))
        print(f"decode (GQA native) hk={hk} b={b} s={s} floor={floor_us:.0f}us (event / graph us): " + " ".join(
            f"{x['provider']}={x['us'] or 0:.0f}/{x['graph_us'] or 0:.0f}" for x in recs[-2:]))
        del kc, vc, q, qt, kt, vt
        gc.collect()
        torch.cuda.empty_cache()
    return recs


PAGED_CASES = ((1, 131072, 8), (8, 32768, 8), (64, 8192, 8), (8, 65536, 1), (16, 16384, 32), (1, 8192, 8))
PAGE_SIZES = (16, 256)


def decode_paged(cases=PAGED_CASES, page_sizes=PAGE_SIZES, h=32, d=128, rounds=ROUNDS):
    """Paged caches (block_table; pages in a random order, as a serving engine's allocator leaves them) against
    the same shapes laid out contiguously, timed in turn (`rounds` rounds, medians): CUDA-graph GPU time, the K/V
    bytes over it as a fraction of the read-only probe, and paged / contiguous bandwidth. With the first case
    also the serving step (a one-token rotary append into the pages of the first page size, then attention)."""
    import torch

    import cuflash
    from cuflash.decode import plan_for

    read_bw = read_bandwidth(measure_ceilings())
    recs = []
    for b, s, hk in cases:
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
        seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * b * s * hk * d * 2
        read_us = kv_bytes / read_bw * 1e6 if read_bw else None
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        fns = {("decode-contiguous", 0): lambda: cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)}
        pages = {}
        for ps in page_sizes:
            n_pages = b * s // ps
            kp = torch.randn(n_pages, ps, hk, d, device="cuda", dtype=torch.float16)
            pages[ps] = (kp, torch.randn_like(kp), torch.randperm(n_pages, device="cuda").reshape(b, s // ps).to(
                torch.int32))
            fns[("decode-paged", ps)] = lambda ps=ps: cuflash.flash_attn_with_kvcache(
                q, pages[ps][0], pages[ps][1], cache_seqlens=seqlens, block_table=pages[ps][2])
        if (b, s, hk) == cases[0]:  # the serving step: rotary append into the pages, then attend
            ps = page_sizes[0]
            kn, vn = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
            cos, sin = torch.rand(s, d // 2, device="cuda").half(), torch.rand(s, d // 2, device="cuda").half()
            short = seqlens - 1
            fns[("decode-paged-rotary-append", ps)] = lambda ps=ps: cuflash.flash_attn_with_kvcache(
                q, pages[ps][0], pages[ps][1], kn, vn, cos, sin, short, block_table=pages[ps][2],
                rotary_interleaved=False)
        geometry = {("decode-contiguous", 0): plan_for(q, kc, vc, cache_seqlens=seqlens).geometry}
        geometry.update({("decode-paged", ps): plan_for(q, pages[ps][0], pages[ps][1], cache_seqlens=seqlens,
                                                        block_table=pages[ps][2]).geometry for ps in page_sizes})
        names = {f"{algo}[{ps}]": (algo, ps) for algo, ps in fns}
        ev_us, gr_us = _time_in_turn({n: fns[k] for n, k in names.items()}, rounds)
        base = gr_us.get("decode-contiguous[0]", (None, []))[0]
        for n, (algo, ps) in names.items():
            us, round_us = ev_us.get(n, (None, []))
            gus, round_gus = gr_us.get(n, (None, []))
            rec = record("cuflash", algo, "decode", "float16", b, h, 1, s, d, False, us / 1e3 if us else None,
                         us=us, graph_us=gus, rounds=rounds, round_us=round_us, round_graph_us=round_gus,
                         heads_k=hk, kv_bytes=kv_bytes, read_floor_us=read_us, page_size=ps,
                         graph_read_fraction=read_us / gus if read_us and gus else None,
                         geometry=geometry.get((algo, ps)))
            if algo == "decode-paged":
                rec["vs_contiguous_bw"] = base / gus if base and gus else None
            recs.append(rec)
        print(f"decode paged b={b} s={s} hk={hk} (GPU us, % of read bw): " + " ".join(
            f"{r['algo']}[{r['page_size']}]={r['graph_us'] or 0:.1f} ({(r['graph_read_fraction'] or 0):.0%})"
            for r in recs if (r["batch"], r["seqlen_k"], r["heads_k"]) == (b, s, hk)))
        del q, kc, vc, pages, fns
        gc.collect()
        torch.cuda.empty_cache()
    return recs


def decode_latency(b=1, h=8, hk=8, s=4096, d=128):
    """Host overhead of a small step: per-call time of a loop of calls from Python (batch 1, 8 heads,
    cache 4k, head dim 128), both cuflash kernels next to SDPA FLASH."""
    import torch

    import cuflash
    from cuflash.decode import plan_for

    kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    recs = []
    splits = plan_for(q, kc, vc, cache_seqlens=seqlens).num_splits
    for name, kernel in (("decode-split", "decode"), ("fwd_split-split", "fwd_split")):
        def fn(kernel=kernel):
            return cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, kernel=kernel)

        us = host_us_per_call(fn)
        recs.append(record("cuflash", name, "decode_latency", "float16", b, h, 1, s, d, False, us / 1e3, us=us,
                           graph_us=graph_us(fn), heads_k=hk, kernel=kernel,
                           num_splits=splits if kernel == "decode" else _old_splits(b, h, hk, s, d)))
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    fn = sdpa("flash")
    us = host_us_per_call(lambda: fn(qt, kt, vt))
    recs.append(record("flash", "sdpa", "decode_latency", "float16", b, h, 1, s, d, False, us / 1e3, us=us,
                       graph_us=graph_us(lambda: fn(qt, kt, vt)), heads_k=hk))
    print(f"decode per-call latency ({b}, {h} heads, {s // 1024}k): " + " ".join(
        f"{r['algo'] if r['provider'] == 'cuflash' else r['provider']}={r['us']:.1f}us (GPU {r['graph_us'] or 0:.1f})"
        for r in recs))
    return recs


# Decode-kernel tile variants swept at head dim 128 (block_n, nwarps, stages); the configured one first.
def _sweep_tiles():
    from cuflash._configs import DECODE_KERNEL_TILES, DecodeTile

    base = DECODE_KERNEL_TILES[128]
    cands = [base] + [DecodeTile(*t, swizzle=base.swizzle) for t in ((16, 4, 4), (16, 4, 2), (32, 4, 2), (32, 4, 3),
                                                                   (32, 2, 3), (16, 2, 4), (16, 8, 2), (16, 8, 3))]
    out = []
    for t in cands:
        if t not in out:
            out.append(t)
    return out


def sweep_specs():
    from cuflash._configs import decode_spec

    specs = [decode_spec("float16", 128, False, mf, t) for t in _sweep_tiles() for mf in (1, 2)]  # mf 2: MQA
    return [s for s in specs if s.smem <= MAX_SMEM]


def decode_sweep(cases=((1, 8, 131072), (1, 8, 32768), (1, 64, 16384), (8, 1, 131072), (32, 1, 131072),
                        (32, 1, 16384), (32, 8, 32768)),
                 h=32, d=128):
    """Decode-kernel tile and split-count sweep on representative decoding cases (head dim 128, fp16):
    each tile of `_sweep_tiles` at 1x, 2x and 4x its heuristic split count (graph time per call)."""
    import torch

    from cuflash._configs import decode_spec
    from cuflash.decode import plan_for, run_plan

    bw = measure_ceilings()[0]["tb_per_s"] * 1e12
    recs = []
    for hk, b, s in cases:
        q, kc, vc, seqlens, kv_bytes, floor_us = _cache_case(b, s, hk, h, d, bw)
        n0 = len(recs)
        for t in _sweep_tiles():
            if decode_spec("float16", d, False, 1, t).smem > MAX_SMEM:
                continue
            base = plan_for(q, kc, vc, cache_seqlens=seqlens, tile=t).num_splits
            for mult in (1, 2, 4):
                ns = min(128, base * mult)
                plan = plan_for(q, kc, vc, cache_seqlens=seqlens, num_splits=ns, tile=t)
                gus = graph_us(lambda: run_plan(plan, q, kc, vc, cache_seqlens=seqlens))
                recs.append(record("cuflash", f"decode-tile-{t.block_n}x{t.nwarps}w-{t.stages}st", "decode", "float16",
                                   b, h, 1, s, d, False, gus / 1e3 if gus else None, us=gus, graph_us=gus,
                                   num_splits=ns, heads_k=hk, kv_bytes=kv_bytes, floor_us=floor_us,
                                   bw_fraction=floor_us / gus if gus else None))
        print(f"decode sweep hk={hk} b={b} s={s} floor={floor_us:.0f}: " + " ".join(
            f"{r['algo'][12:]}/{r['num_splits']}={r['us'] or 0:.0f}" for r in recs[n0:]))
        del kc, vc, q
        torch.cuda.empty_cache()
    return recs
