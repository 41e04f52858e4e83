"""Forward benchmarks (suites fwd, fwd_rounds, grid_order, layout, fwd_tiles, fwd_interleaved, memory, latency):
the FlashAttention-2 grid (cuflash V2 vs SDPA FLASH / CUDNN / EFFICIENT and the
naive baseline), the grid-order comparison, the forward tile sweep, peak memory vs seqlen, and per-call
latency on a small shape."""
from __future__ import annotations

import gc

from cuflash._configs import FwdTile, fwd_spec, fwd_tile

from .harness import SDPA_PROVIDERS, host_us_per_call, queued_timer, record, sdpa, time_ms, time_rounds

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS, HIDDEN = 16384, 2048

# Candidate tiles of the configured (plain) KV loop. Earlier candidates, and the KV-loop drivers measured
# and removed (software pipeline, FlashAttention-3 ping-pong; the code is in git history, commit 59a4131),
# with their numbers: bench/NOTES.md, "Forward tiles and loop".
# Head dim 128: 64-key tiles (FlashAttention-2's 128 x 64 x 4w) fit 255 registers without spills only with the
# Q K^T loop unrolled 4 or 2 k16 steps per trip (kunroll); 32-key tiles fit fully unrolled.
SWEEP_TILES = {  # FwdTile(block_m, block_n, nwarps, kunroll, load_at)
    64: [FwdTile(128, 64, 4), FwdTile(256, 64, 8), FwdTile(128, 64, 4, 0, 1)],
    128: [FwdTile(128, 32, 4), FwdTile(128, 32, 4, 4), FwdTile(128, 64, 4, 4), FwdTile(128, 64, 4, 2),
          FwdTile(256, 32, 8), FwdTile(128, 64, 4, 4, 1), FwdTile(128, 32, 4, 0, 1)],
}


def tile_label(t: FwdTile) -> str:
    return (f"v2-tile-{t.block_m}x{t.block_n}x{t.nwarps}w" + (f"-u{t.kunroll}" if t.kunroll else "")
            + (f"-load{t.load_at}" if t.load_at else ""))


def sweep_specs():
    return [fwd_spec(dt, d, c, False, t) for d, ts in SWEEP_TILES.items() for t in ts for c in (False, True)
            for dt in ("float16", "bfloat16")]  # bf16: tests/test_flash_fwd.py checks every swept tile


def _inputs(b, s, h, d, dtype):
    import torch

    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))  # cuflash layout
    return q, k, v


def fa2_grid(dtypes=("float16", "bfloat16"), headdims=(64, 128), seqlens=SEQLENS, naive=("float16",), rounds=1,
             providers=SDPA_PROVIDERS):
    """naive: the dtypes for which the naive baseline is timed too (it is slow at long seqlen). rounds > 1: cuflash
    and the SDPA `providers` timed in turn `rounds` times per point, the median per provider recorded (with every
    round's ms in `round_ms`): the grid's ratios then do not depend on which provider a clock change hit."""
    import cuflash

    recs = []
    for dtype in dtypes:
        for d in headdims:
            h = HIDDEN // d
            for s in seqlens:
                b = TOKENS // s
                q, k, v = _inputs(b, s, h, d, dtype)
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # SDPA's [b, h, s, d]
                for causal in (False, True):
                    fns = {"cuflash": lambda: cuflash.flash_attn_func(q, k, v, causal=causal, backend="sm80")}
                    fns.update({prov: (lambda fn=sdpa(prov): fn(qt, kt, vt, causal)) for prov in providers})
                    for name, (ms, per) in time_rounds(fns, rounds).items():
                        extra = dict(rounds=rounds, round_ms=per) if rounds > 1 else {}
                        recs.append(record(name, "v2" if name == "cuflash" else "sdpa", "fwd", dtype, b, h, s, s, d,
                                           causal, ms, **extra))
                    if naive and dtype in naive:
                        try:
                            ms = time_ms(lambda: cuflash.naive_attention(q, k, v, causal=causal), rep=5)
                        except Exception as e:  # noqa: BLE001 - out of memory at long seqlen
                            ms = None
                            print(f"naive failed at s={s}: {type(e).__name__}")
                        recs.append(record("naive", "naive", "fwd", dtype, b, h, s, s, d, causal, ms))
                    print(_line(recs[-(len(fns) + bool(naive and dtype in naive)):]))
                del q, k, v, qt, kt, vt
                gc.collect()
    return recs


WGMMA_ANCHOR_TFLOPS = 972.0  # shared/ANCHORS.md: a wgmma m64n128k16 loop (low-entropy operands), H200
HOPPER_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def _hopper_points(dtypes, headdims, seqlens, extra):
    """(dtype, batch, seqlen, heads, kv heads, head dim) of the Hopper grid: the FA2 grid, plus batch 1 x 64k,
    and GQA 64 query / 8 KV heads at 8k (head dim 128)."""
    pts = [(dt, TOKENS // s, s, HIDDEN // d, HIDDEN // d, d) for dt in dtypes for d in headdims for s in seqlens]
    if extra:
        pts += [(dt, 1, 65536, HIDDEN // d, HIDDEN // d, d) for dt in dtypes for d in headdims if d <= 128]
        pts += [(dt, 2, 8192, 64, 8, 128) for dt in dtypes]
    return pts


def hopper_grid(dtypes=("float16", "bfloat16"), headdims=(64, 128, 256), seqlens=HOPPER_SEQLENS, rounds=3,
                extra=True, providers=("flash", "cudnn"), ceiling_tflops=None, queued=False):
    """The Hopper forward next to the mma.sync forward and SDPA's FLASH and CUDNN backends, timed in turn
    (`rounds` rounds, medians): the FA2 grid (batch x seqlen = 16k, hidden 2048) from 512 to 16k at head dims
    64, 128, 256, plus 1 x 64k and GQA 64/8 heads at 8k. Every cuflash record names its backend and carries
    its fraction of the wgmma ceiling (`ceiling_tflops`; by default measured first, in this run, by micro90's
    wgmma throughput kernels on random operands; the anchor where that fails). Each timing is one call on an idle
    GPU (harness.time_ms: what the call's host path does before its kernel starts is in it), or, queued, one call
    queued behind a spin kernel (harness.time_queued_ms: the GPU time alone; records carry timing="queued")."""
    import torch

    import cuflash

    source = "given"
    if ceiling_tflops is None:
        try:
            from .bench_micro_sm90 import wgmma_ceiling

            ceiling_tflops, source = wgmma_ceiling(), "micro90, this run"
        except Exception as e:  # noqa: BLE001 - the anchor then
            print(f"wgmma ceiling not measured ({type(e).__name__}: {e}); using the anchor")
    if not ceiling_tflops:
        ceiling_tflops, source = WGMMA_ANCHOR_TFLOPS, "anchor (shared/ANCHORS.md)"
    ceiling = ceiling_tflops
    print(f"wgmma ceiling {ceiling:.0f} TFLOP/s ({source})", flush=True)
    recs = []
    for dtype, b, s, h, hk, d in _hopper_points(dtypes, headdims, seqlens, extra):
        dt = getattr(torch, dtype)
        q = torch.randn(b, s, h, d, device="cuda", dtype=dt)
        k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=dt) for _ in range(2))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        gqa = h != hk
        for causal in (False, True):
            fns = {f"cuflash-{be}": (lambda be=be: cuflash.flash_attn_func(q, k, v, causal=causal, backend=be))
                   for be in ("sm90", "sm80")}
            for prov in providers:
                fn = sdpa(prov)
                fns[prov] = lambda fn=fn: fn(qt, kt, vt, causal, enable_gqa=gqa)
            grid_point = b * s == TOKENS and not gqa
            log = None if grid_point else f"{dtype} d{d} {b} x {s} heads {h}/{hk} causal={causal}"
            timer = queued_timer() if queued else {}
            for name, (ms, per) in time_rounds(fns, rounds, log=log, **timer).items():
                if name.startswith("cuflash"):
                    be = name.split("-")[1]
                    r = record("cuflash", f"v2-{be}", "fwd", dtype, b, h, s, s, d, causal, ms, backend=be,
                               rounds=rounds, round_ms=per, kv_heads=hk, wgmma_ceiling_tflops=ceiling,
                               wgmma_ceiling_source=source)
                    r["wgmma_fraction"] = r["tflops"] / ceiling if r["tflops"] else None
                else:
                    r = record(name, "sdpa", "fwd", dtype, b, h, s, s, d, causal, ms, rounds=rounds, round_ms=per,
                               kv_heads=hk)
                if queued:
                    r["timing"] = "queued"
                recs.append(r)
            print(_line(recs[-len(fns):]) + (f" (GQA {h}/{hk})" if gqa else ""), flush=True)
        del q, k, v, qt, kt, vt
        gc.collect()
    return recs


def _line(rs):
    r0 = rs[0]
    parts = [f"{r['provider']}={r['tflops']:.0f}" if r["tflops"] else f"{r['provider']}=n/a" for r in rs]
    return f"{r0['mode']} {r0['dtype']} d={r0['headdim']} s={r0['seqlen_q']} causal={r0['causal']}: " + " ".join(parts)


def grid_order(seqlens=(2048, 8192, 16384)):
    import cuflash

    recs = []
    for d in (64, 128):
        h = HIDDEN // d
        for s in seqlens:
            b = TOKENS // s
            q, k, v = _inputs(b, s, h, d, "float16")
            for causal in (False, True):
                for order in ("qtile", "bh"):
                    ms = time_ms(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, grid_order=order))
                    recs.append(record("cuflash", f"v2-grid-{order}", "fwd", "float16", b, h, s, s, d, causal, ms,
                                       grid_order=order))
                print(_line(recs[-2:]))
    return recs


def layout(seqlens=(1024, 4096, 16384)):
    """Same memory for both: cuflash and SDPA FLASH on [b, s, h, d]-contiguous data (flash-attn's layout,
    what cuflash's grid uses) and on [b, h, s, d]-contiguous data (what the grid hands SDPA), each through a
    strided view. Says how much of a ratio is the layout rather than the kernel."""
    import cuflash

    recs = []
    fn = sdpa("flash")
    for d in (64, 128):
        h = HIDDEN // d
        for s in seqlens:
            b = TOKENS // s
            bshd = _inputs(b, s, h, d, "float16")
            bhsd = tuple(x.transpose(1, 2).contiguous() for x in bshd)
            for causal in (False, True):
                for mem, (q, k, v) in (("bshd", bshd), ("bhsd", tuple(x.transpose(1, 2) for x in bhsd))):
                    # q, k, v: [b, s, h, d] views of `mem`-contiguous data
                    ms = time_ms(lambda: cuflash.flash_attn_func(q, k, v, causal=causal))
                    recs.append(record("cuflash", f"v2-mem-{mem}", "fwd", "float16", b, h, s, s, d, causal, ms,
                                       memory_layout=mem))
                    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                    ms = time_ms(lambda: fn(qt, kt, vt, causal))
                    recs.append(record("flash", f"sdpa-mem-{mem}", "fwd", "float16", b, h, s, s, d, causal, ms,
                                       memory_layout=mem))
                print(_line(recs[-4:]))
    return recs


def tile_sweep(seqlens=(1024, 4096, 16384)):
    """Every candidate tile on the FA2 grid (fp16), next to SDPA FLASH measured in the same loop."""
    from cuflash import flash
    from cuflash._validate import check_qkv

    recs = []
    for d, tiles in SWEEP_TILES.items():
        h = HIDDEN // d
        for s in seqlens:
            b = TOKENS // s
            q, k, v = _inputs(b, s, h, d, "float16")
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            qa, ka, va = check_qkv(q, k, v)
            for causal in (False, True):
                for t in tiles:
                    ms = time_ms(lambda: flash.forward(qa, ka, va, None, causal, tile=t))
                    recs.append(record("cuflash", tile_label(t), "fwd", "float16",
                                       b, h, s, s, d, causal, ms, tile=[t.block_m, t.block_n, t.nwarps, t.kunroll],
                                       configured=(t == fwd_tile(d, causal))))
                fn = sdpa("flash")
                recs.append(record("flash", "sdpa", "fwd", "float16", b, h, s, s, d, causal,
                                   time_ms(lambda: fn(qt, kt, vt, causal))))
                print(_line(recs[-len(tiles) - 1:]))
    return recs


def interleaved(points=(("float16", 128, False, 1024), ("float16", 128, False, 4096), ("float16", 128, False, 8192),
                        ("bfloat16", 128, False, 8192), ("float16", 128, True, 2048), ("float16", 64, True, 1024),
                        ("bfloat16", 64, False, 1024)), rounds=8,
                extra_tiles=None, load_at=(0, 1)):
    """The grid points nearest 1.0x, timed A, B, A, B, ...: each round is one time_ms (median of 20 event
    timings) of cuflash's configured tile, of the extra candidate tiles (non-causal only), of the configured tile
    with each `load_at` (where the next K / V tile's cp.async is issued) and of SDPA FLASH, in turn, so that clock
    drift between loops lands on both sides. One record per round and provider; the ratio to FLASH is formed per
    round (field `round`). 128x32x4w, once an extra tile at d128, lost at every point (0.95-0.99)."""
    from dataclasses import replace

    from cuflash import flash
    from cuflash._validate import check_qkv

    recs = []
    for dtype, d, causal, s in points:
        h, b = HIDDEN // d, TOKENS // s
        q, k, v = _inputs(b, s, h, d, dtype)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        qa, ka, va = check_qkv(q, k, v)
        tiles = [fwd_tile(d, causal)] + [t for t in (extra_tiles or {}).get(d, ())
                                         if not causal and t != fwd_tile(d, causal)]
        tiles += [replace(fwd_tile(d, causal), load_at=la) for la in load_at if la != fwd_tile(d, causal).load_at]
        fa = sdpa("flash")
        fns = {"flash": lambda: fa(qt, kt, vt, causal)}  # FLASH first in every round, then the tiles
        fns.update({tile_label(t): (lambda t=t: flash.forward(qa, ka, va, None, causal, tile=t)) for t in tiles})
        per = {name: ms for name, (_, ms) in time_rounds(fns, rounds).items()}
        ratios = {tile_label(t): [] for t in tiles}
        for rnd in range(rounds):
            fl_ms = per["flash"][rnd]
            recs.append(record("flash", "sdpa", "fwd", dtype, b, h, s, s, d, causal, fl_ms, round=rnd))
            for t in tiles:
                ms = per[tile_label(t)][rnd]
                recs.append(record("cuflash", tile_label(t), "fwd", dtype, b, h, s, s, d, causal, ms, round=rnd,
                                   configured=(t == fwd_tile(d, causal))))
                ratios[tile_label(t)].append(fl_ms / ms)
        summary = "  ".join(f"{lab}: median {sorted(r)[len(r) // 2]:.3f} [{min(r):.3f}, {max(r):.3f}]"
                            for lab, r in ratios.items())
        print(f"interleaved {dtype} d={d} s={s} causal={causal}: {summary}", flush=True)
        del q, k, v, qt, kt, vt
        gc.collect()
    return recs


def peak_memory(seqlens=(1024, 2048, 4096, 8192, 16384, 32768, 65536), h=16, d=128):
    import torch

    import cuflash

    recs = []
    for s in seqlens:
        q, k, v = _inputs(1, s, h, d, "float16")
        for prov, fn in (("cuflash", lambda: cuflash.flash_attn_func(q, k, v)),
                         ("naive", lambda: cuflash.naive_attention(q, k, v)),
                         ("flash", lambda: sdpa("flash")(*(x.transpose(1, 2) for x in (q, k, v))))):
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            try:
                out = fn()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                del out
            except torch.OutOfMemoryError:
                peak = None
            recs.append(record(prov, "memory", "memory", "float16", 1, h, s, s, d, False, None, peak_bytes=peak))
        print(f"memory s={s}: " + " ".join(f"{r['provider']}={(r['peak_bytes'] or 0) / 2**20:.0f}MiB" for r in recs[-3:]))
        del q, k, v
    return recs


def small_latency():
    """Per-call time of a loop of calls from Python: batch 1, 8 heads, 128 tokens, head dim 64."""
    import cuflash

    q, k, v = _inputs(1, 128, 8, 64, "float16")
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    recs = []
    for causal in (False, True):
        for be in ("sm80", "sm90"):
            try:
                us = host_us_per_call(lambda: cuflash.flash_attn_func(q, k, v, causal=causal, backend=be))
            except ValueError:  # no sm_90 GPU
                continue
            recs.append(record("cuflash", f"v2-{be}", "latency", "float16", 1, 8, 128, 128, 64, causal, us / 1e3,
                               backend=be, us_per_call=us))
        for prov in SDPA_PROVIDERS:
            fn = sdpa(prov)
            us = host_us_per_call(lambda: fn(qt, kt, vt, causal))
            recs.append(record(prov, "sdpa", "latency", "float16", 1, 8, 128, 128, 64, causal, us / 1e3, us_per_call=us))
        print("latency causal=%s: " % causal + " ".join(f"{r['provider']}/{r.get('backend', 'sdpa')}="
                                                    f"{r['us_per_call']:.1f}us" for r in recs if r["causal"] == causal))
    return recs
