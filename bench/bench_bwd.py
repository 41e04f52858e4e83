"""Backward benchmarks (suites bwd, bwd_rounds, bwd_loop, bwd_partition, bwd_tiles, dq_memory): the
FlashAttention-2 grid for each dQ strategy next to SDPA FLASH / CUDNN / EFFICIENT backward (the backward timed
alone, graph retained; FLOPs x2.5), the warp partitions of the main kernel, the candidate backward tiles,
and the extra memory of the dQ strategies."""
from __future__ import annotations

import gc

from .bench_fwd import HIDDEN, SEQLENS, TOKENS, _hopper_points, _line
from .harness import SDPA_PROVIDERS, queued_timer, record, sdpa, time_ms, time_rounds


def _inputs(b, s, h, d, dt, hk=None):
    """q, k, v (requiring grad; k and v with hk heads, default h) and dout in cuflash's [b, s, h, d] layout."""
    import torch

    q = torch.randn(b, s, h, d, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(b, s, hk or h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(b, s, h, d, device="cuda", dtype=dt)


def _sdpa_inputs(q, k, v, dout):
    """The same values in SDPA's [b, h, s, d] layout (contiguous copies; q, k, v requiring grad)."""
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    return qt, kt, vt, dout.transpose(1, 2).contiguous()


def _grid_cases(headdims, seqlens, dt, extra=False):
    """(d, h, hk, s, b, (q, k, v, dout), (the same in SDPA's layout)) per grid point (hk = h), freed after each;
    extra: then the Hopper forward grid's extra points (bench_fwd._hopper_points): batch 1 x 64k at the head dims
    up to 128, and GQA 64 query / 8 KV heads at 8k (batch 2, head dim 128)."""
    import torch

    pts = [(d, HIDDEN // d, HIDDEN // d, s, TOKENS // s) for d in headdims for s in seqlens]
    if extra:
        pts += [(d, h, hk, s, b) for _, b, s, h, hk, d in _hopper_points((None,), headdims, (), True) if d in headdims]
    for d, h, hk, s, b in pts:
        ours = _inputs(b, s, h, d, dt, hk)
        yield d, h, hk, s, b, ours, _sdpa_inputs(*ours)
        del ours
        gc.collect()
        torch.cuda.empty_cache()


def _grad_fn(out, inputs, dout):
    import torch

    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def _timing(calls, queued=False):
    """time_rounds' keywords for `calls` backward calls per event pair (bwd): rep=10 single calls, or max(3, 10 //
    calls) timings of `calls` back-to-back calls each, divided by `calls`; queued: 10 single calls each queued behind
    a spin kernel (harness.time_queued_ms: the GPU time, no host hand-off)."""
    if not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be an int >= 1; got {calls!r}")
    if queued:
        if calls != 1:
            raise ValueError(f"queued timing is of single calls; got calls={calls}")
        return queued_timer()
    if calls == 1:
        return dict(rep=10)
    return dict(timer=lambda fn: time_ms(lambda: [fn() for _ in range(calls)], rep=max(3, 10 // calls)) / calls)


def bwd(dtypes=("float16", "bfloat16"), headdims=(64, 128), seqlens=SEQLENS, strategies=("atomic", "seqpar", "loop"),
        rounds=1, providers=SDPA_PROVIDERS, backends=("sm80",), strategies_dtypes=("float16",), calls=1,
        queued=False, extra=False):
    """rounds > 1: the strategies and the SDPA `providers` timed in turn `rounds` times per point, the median per
    provider recorded (every round's ms in `round_ms`; bench_fwd.fa2_grid). backends: the cuflash kernel paths timed
    ("sm80": the mma.sync backward; "sm90": the Hopper backward, where it runs the head dim and strategy: each
    record's `backend`); the strategies other than "atomic" only in `strategies_dtypes` and on the first backend.
    calls: backward calls per event pair (1: single calls, each carrying autograd's hand-off before its first kernel;
    > 1: back to back, the hand-off under the previous call's kernels as in training, ms per call; records then
    carry `calls`), max(3, 10 // calls) timings per provider and round. queued: each single call queued behind a spin
    kernel, so that the host's hand-off is hidden and the GPU time is timed (records carry timing="queued").
    extra: also the Hopper forward grid's extra points (_grid_cases; records carry kv_heads), SDPA with enable_gqa
    where the KV heads are fewer."""
    import torch

    import cuflash
    from cuflash import _bwd_sm90
    from cuflash._configs import SM90_BWD_HEADDIMS, kernel_headdim, sm90_bwd_tile

    hopper = torch.cuda.get_device_capability() == (9, 0)
    recs = []
    for dtype in dtypes:
        for d, h, hk, s, b, (q, k, v, dout), (qt, kt, vt, doutt) in _grid_cases(headdims, seqlens,
                                                                                 getattr(torch, dtype), extra):
            gqa = dict(kv_heads=hk) if hk != h else {}
            for causal in (False, True):
                n0 = len(recs)
                fns = {}  # timed name -> backward call (the forward graph kept for the whole point)
                paths = {}  # timed name -> (dq strategy, backend)
                for strat in strategies:
                    if strat != "atomic" and dtype not in strategies_dtypes:
                        continue  # the strategies are compared in fp16; bf16 runs the default one
                    if strat == "loop" and s > 2048:
                        continue  # one block per (batch, head): seconds per call at long seqlen
                    for bk in backends:
                        if bk == "sm90" and not (hopper and kernel_headdim(d) in SM90_BWD_HEADDIMS
                                                 and strat != "loop"):
                            continue
                        if (bk == "sm90" and strat == "ordered" and sm90_bwd_tile(kernel_headdim(d)).split
                                and not _bwd_sm90.split_ordered()):
                            continue  # (the column-split kernel's "ordered" runs where turned on: SPLIT_ORDERED)
                        if bk != "sm90" and strat == "ordered":
                            continue  # (a Hopper backward strategy)
                        if strat != "atomic" and bk != backends[0]:
                            continue  # the other strategies on the first backend only
                        name = strat if len(backends) == 1 else f"{strat}-{bk}"
                        # the forward on the same path (its backward follows: cuflash.backward.bwd_backend;
                        # the sm90 backward's head dims all have an sm90 forward)
                        out = cuflash.flash_attn_func(q, k, v, causal=causal, dq_strategy=strat,
                                                      deterministic=strat in ("seqpar", "ordered"), backend=bk)
                        fns[name] = _grad_fn(out, (q, k, v), dout)
                        paths[name] = (strat, bk)
                for prov in providers:
                    try:
                        fns[prov] = _grad_fn(sdpa(prov)(qt, kt, vt, causal, enable_gqa=bool(gqa)), (qt, kt, vt),
                                             doutt)
                    except RuntimeError as e:
                        fns[prov] = None
                        print(f"sdpa {prov} bwd failed: {e}")
                timed = time_rounds({n: f for n, f in fns.items() if f is not None}, rounds,
                                    **_timing(calls, queued))
                for name in fns:
                    ms, per = timed.get(name, (None, []))
                    more = dict(rounds=rounds, round_ms=per, **gqa) if rounds > 1 else dict(gqa)
                    if calls > 1:
                        more["calls"] = calls
                    if queued:
                        more["timing"] = "queued"
                    if name in providers:
                        recs.append(record(name, "sdpa", "bwd", dtype, b, h, s, s, d, causal, ms, **more))
                    else:
                        strat, bk = paths[name]
                        recs.append(record("cuflash", f"v2-{name}", "bwd", dtype, b, h, s, s, d, causal, ms,
                                           backend=bk, dq_strategy=strat, **more))
                del fns, timed
                print(_line(recs[n0:]))  # this case's records (some strategies skip long seqlens)
            del q, k, v, qt, kt, vt, dout, doutt
    return recs


def bwd_loop(dtypes=("float16",), headdims=(64, 128), seqlens=(1024, 4096, 16384), calls=10):
    """Like `bwd` (autograd, default dQ strategy and partition, next to SDPA FLASH) but each timing spans `calls`
    back-to-back backward calls, so that the host-side latency of a call (torch's autograd engine handing the
    graph to its device thread, then cuflash's Python autograd.Function: ~0.37 ms)
    overlaps the previous call's kernels, as in a training step; `bwd` times one call per event pair.
    (host latency: bench/diag/bwd_timing_check.py)"""
    import torch

    import cuflash

    recs = []
    for dtype in dtypes:
        for d, h, _, s, b, (q, k, v, dout), (qt, kt, vt, doutt) in _grid_cases(headdims, seqlens,
                                                                                getattr(torch, dtype)):
            for causal in (False, True):
                n0 = len(recs)
                out = cuflash.flash_attn_func(q, k, v, causal=causal)
                fo = sdpa("flash")(qt, kt, vt, causal)
                for prov, fn in (("cuflash", _grad_fn(out, (q, k, v), dout)),
                                 ("flash", _grad_fn(fo, (qt, kt, vt), doutt))):
                    ms = time_ms(lambda: [fn() for _ in range(calls)], rep=5) / calls
                    recs.append(record(prov, "v2-auto" if prov == "cuflash" else "sdpa", "bwd", dtype, b, h, s, s, d,
                                       causal, ms, calls_per_timing=calls))
                del out, fo
                print(_line(recs[n0:]), flush=True)
            del q, k, v, qt, kt, vt, dout, doutt
    return recs


PARTITION_SEQLENS = (1024, 2048, 4096, 8192)


def bwd_partition(dtype="float16", headdims=(64, 128), seqlens=PARTITION_SEQLENS, partitions=("kv", "q", "2d")):
    """The warp partitions of the backward main kernel (cuda_src/flash_bwd.cu: "kv" warps split the KV rows;
    "q" warps split the Q rows; "2d" 32-row warp tiles in every product), each with its configured tile
    (cuflash/_configs.py: BWD_TILES, BWD_TILES_Q, BWD_TILES_2D) and atomic dQ, on the FlashAttention-2 grid subset (batch x seqlen = 16k, hidden 2048);
    timed and counted like `bwd` (backward alone, FLOPs x2.5, halved for causal). ~10-20 s on an H200."""
    import torch

    import cuflash
    from cuflash._configs import bwd_tiles
    from cuflash._loader import device_cc

    recs = []
    dt = getattr(torch, dtype)
    for d in headdims:
        h = HIDDEN // d
        for s in seqlens:
            b = TOKENS // s
            q, k, v, dout = _inputs(b, s, h, d, dt)
            for causal in (False, True):
                for part in partitions:
                    t = bwd_tiles(part, device_cc(0), dtype)[d]
                    out = cuflash.flash_attn_func(q, k, v, causal=causal, dq_strategy="atomic", warp_partition=part)
                    ms = time_ms(_grad_fn(out, (q, k, v), dout), rep=10)
                    recs.append(record("cuflash", f"v2-{part}", "bwd", dtype, b, h, s, s, d, causal, ms,
                                       dq_strategy="atomic", warp_partition=part,
                                       tile=_tile_desc(t)))
                    del out
                print(f"bwd_partition d={d} s={s} causal={causal}: " + "  ".join(
                    f"{r['warp_partition']} ({r['tile']}) {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s"
                    for r in recs[-len(partitions):]), flush=True)
            del q, k, v, dout
            gc.collect()
            torch.cuda.empty_cache()
    return recs


# Candidate tiles of the backward main kernel per head dim: (warp partition, BwdTile). The options (BwdTile,
# cuflash/_configs.py): kunroll = k16 steps unrolled per loop trip (0 = all); dq_bulk (sm_90, "2d" partition:
# dQ staged in shared memory and added by a bulk reduction deferred to the next step, two dO buffers); load_at =
# where the next Q tile is requested (1: after S = QK^T, 2: after P and dP); p_regs keeps P in registers for dS;
# exp_il interleaves P's exps with the k16 steps of dP (flash_bwd.cu: DQ_BULK, LOAD_AT, P_REGS, EXP_IL).
# Candidates measured and removed since, with their numbers: bench/NOTES.md, "Backward tiles" and "dQ".
def _bwd_sweep_tiles():
    """The sm_90 "2d" tiles as configured (fp16 and bf16 entries) and their nearest alternatives: at d64 the
    bulk tile with the k16 loops unrolled 4 per trip, the next Q tile after S and the exps as one block before
    dP, and the configured tile without exp_il; at d128 the bulk tile with the next Q tile after S, the exps as
    one block and P read back from shared memory for dS."""
    from dataclasses import replace

    from cuflash._configs import BWD_TILES_2D, BWD_TILES_2D_SM90, BWD_TILES_2D_SM90_DTYPE

    t64, t128 = BWD_TILES_2D_SM90[64], BWD_TILES_2D_SM90[128]
    u4_load1 = replace(BWD_TILES_2D[64], dq_bulk=True, p_regs=True, load_at=1)
    u0_load1 = replace(BWD_TILES_2D[128], kunroll=0, dq_bulk=True, load_at=1)
    bf16 = BWD_TILES_2D_SM90_DTYPE["bfloat16"]
    return {
        64: [("2d", t) for t in _unique((t64, bf16[64], u4_load1, replace(t64, exp_il=False)))],
        128: [("2d", t) for t in _unique((t128, bf16[128], u0_load1))],
    }


def _unique(ts):
    out = []
    for t in ts:
        if t not in out:
            out.append(t)
    return out


def _tile_desc(t):
    return (f"{t.block_m}x{t.block_n}x{t.nwarps}w-u{t.kunroll}" + ("-bulk" if t.dq_bulk else "")
            + ("-pregs" if t.p_regs else "") + (f"-load{t.load_at}" if t.load_at else "")
            + ("-expil" if getattr(t, "exp_il", False) else ""))


def _tile_label(part, t):
    return f"v2-{part}-{_tile_desc(t)}"


def _tile_fields(t):
    """The tile's options by name (robust to BwdTile gaining or losing fields)."""
    from dataclasses import asdict

    return {k: (int(v) if isinstance(v, bool) else v) for k, v in asdict(t).items()}


def sweep_specs():
    from cuflash._configs import bwd_spec

    return [bwd_spec(dt, d, c, t, part) for d, ts in _bwd_sweep_tiles().items()
            for part, t in ts for c in (False, True) for dt in ("float16", "bfloat16")]


def bwd_tile_sweep(seqlens=(1024, 4096, 16384), dtypes=("float16",), rounds=1, headdims=(64, 128), keep=None):
    """Every candidate backward tile (atomic dQ) on the FA2 grid subset, next to SDPA FLASH's backward measured
    in the same loop. The cuflash kernels are timed through cuflash.backward.backward (preprocess + main +
    convert, no autograd), FLASH through autograd like section `bwd`. rounds > 1: the candidates and FLASH timed
    in turn `rounds` times per point (harness.time_rounds), the median recorded, every round's ms in `round_ms`.
    keep: a predicate on the candidate tiles (None: all)."""
    recs = []
    for dtype in dtypes:
        recs += _bwd_tile_sweep(seqlens, dtype, rounds, headdims, keep)
    return recs


def _bwd_tile_sweep(seqlens, dtype, rounds, headdims, keep):
    import torch

    import cuflash
    from cuflash import backward as bwd_mod
    from cuflash._configs import bwd_tiles
    from cuflash._loader import device_cc

    recs = []
    sweep = {d: [(part, t) for part, t in ts if keep is None or keep(t)]
             for d, ts in _bwd_sweep_tiles().items() if d in headdims}
    for d, h, _, s, b, (q, k, v, dout), (qt, kt, vt, doutt) in _grid_cases(sweep, seqlens, getattr(torch, dtype)):
        for causal in (False, True):
            with torch.no_grad():
                out, lse, _ = cuflash.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            views = bwd_mod.check_backward_inputs(dout, q.detach(), k.detach(), v.detach(), out, lse)
            n0 = len(recs)
            fns, tiles = {}, {}
            for part, t in sweep[d]:
                name = _tile_label(part, t)
                tiles[name] = (part, t)
                fns[name] = (lambda t=t, part=part: bwd_mod.backward(*views, None, causal, "atomic", tile=t,
                                                                       warp_partition=part))
            fo = sdpa("flash")(qt, kt, vt, causal)
            fns["flash"] = _grad_fn(fo, (qt, kt, vt), doutt)
            timed = time_rounds(fns, rounds, rep=10)
            extra = lambda name: dict(rounds=rounds, round_ms=timed[name][1]) if rounds > 1 else {}  # noqa: E731
            for name, (part, t) in tiles.items():
                recs.append(record("cuflash", name, "bwd", dtype, b, h, s, s, d, causal, timed[name][0],
                                   warp_partition=part,
                                   tile=_tile_fields(t),
                                   configured=(t == bwd_tiles(part, device_cc(0), dtype)[d]), **extra(name)))
            recs.append(record("flash", "sdpa", "bwd", dtype, b, h, s, s, d, causal, timed["flash"][0],
                               **extra("flash")))
            del fo, out, lse, views, fns
            print(f"bwd_tiles {dtype} d={d} s={s} causal={causal}: " + " ".join(
                f"{r['algo']}={r['tflops']:.0f}" for r in recs[n0:]), flush=True)
        del q, k, v, dout, qt, kt, vt, doutt
    return recs


def dq_memory(seqlens=(2048, 16384), d=128):
    """Extra device memory of each dQ strategy: formula, and peak measured over one backward."""
    import torch

    import cuflash
    from cuflash.backward import seqpar_extra_bytes

    recs = []
    h = HIDDEN // d
    for s in seqlens:
        b = TOKENS // s
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for strat in ("atomic", "seqpar", "loop"):
            out = cuflash.flash_attn_func(q, k, v, dq_strategy=strat)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = torch.autograd.grad(out, (q, k, v), dout)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            grads_bytes = sum(g.numel() * g.element_size() for g in grads)
            del grads, out
            formula = seqpar_extra_bytes(b, h, s, s, d) if strat == "seqpar" else b * h * (-(-s // 128) * 128) * d * 4
            recs.append(record("cuflash", f"v2-{strat}", "memory", "float16", b, h, s, s, d, False, None,
                               dq_strategy=strat, extra_bytes=peak - grads_bytes, formula_bytes=formula))
        print("dq memory s=%d: " % s + " ".join(f"{r['dq_strategy']}={r['extra_bytes'] / 2**20:.0f}MiB" for r in recs[-3:]))
        del q, k, v, dout
    return recs
