"""Diagnostic (GPU, compute capability 9.0): what the last, partly filled wave of Q tiles costs the Hopper forward
without a mask -- measured, where the list model (cuflash._configs.persist_walk_model) only bounds it.

    python -m bench.diag.fwd90_tail_probe [--headdims 128,256] [--seqlens 2048,4096,16384] [--rounds 5]
                                          [--dtype float16] [--stream-k]

Without a mask every Q tile of a call does the same work (all of its keys), so the time per Q tile should not depend
on how many tiles there are -- except through the last wave: the FA2 grid (batch x seqlen = 16k tokens, hidden 2048)
gives head dim 128 2048 Q tiles of 128 rows at every length, 15.5 waves of 132 blocks, so in the last wave half the
SMs idle (3.1% in the model). Per point (head dim, key count s), the configured forward (flash_attn_func) is timed at
three tile counts with the same keys per head: the grid's own (one batch of batch x heads heads, s rows: the same
tiles), and the whole-wave counts below and above it (132 heads of 132 k / 132 heads' worth of Q tiles: e.g. 1980 and
2112), rows always whole Q tiles. GPU time (bench.harness.time_queued_ms), the three timed in turn, medians of the
rounds. Printed per point: each count's waves and microseconds per Q tile, and the grid count's time per tile over
the mean of the two whole-wave counts' (> 1: what its last wave costs), beside the model's figure for the grid count
(its largest block over the mean). Head dims whose Q tiles do not divide the grid's lengths (64: 192 rows) take the
whole tiles below s for the grid count. --stream-k times the grid count a fourth time, walked by stream-K (grid_order
"stream_k": the last wave's tiles cut into equal ranges of (tile, K / V tile) pairs; cuflash._configs.SM90_SK_MAX_GRID),
and prints its time per tile over the whole-wave counts' too, and over the fixed walk's (< 1: stream-K faster).
"""
from __future__ import annotations

import argparse
import sys

from .fwd90_walk_model import HIDDEN, SMS, TOKENS


def counts(tiles: int, sms: int = SMS) -> tuple:
    """(the grid's count, the whole-wave count below it, the one above it) for `tiles` Q tiles on `sms` blocks (the H200's
    132 by default; the probe passes the device's SM count)."""
    below = max(1, tiles // sms) * sms
    above = -(-tiles // sms) * sms
    if above == below:
        above += sms
    return tiles, below, above


def shapes(headdim: int, seqlen: int, block_m: int, sms: int = SMS) -> list:
    """[(heads, rows)] of the three counts (batch 1): the grid's (batch x heads heads of the whole Q tiles of `seqlen`
    rows), then `sms` heads of the rows that make each whole-wave count."""
    heads = (TOKENS // seqlen) * (HIDDEN // headdim)
    per_head = seqlen // block_m
    grid, below, above = counts(heads * per_head, sms)
    return [(heads, per_head * block_m), (sms, below // sms * block_m), (sms, above // sms * block_m)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.fwd90_tail_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--headdims", default="128,256")
    ap.add_argument("--seqlens", default="2048,4096,16384")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--stream-k", dest="stream_k", action="store_true")
    args = ap.parse_args(argv)
    import torch

    import cuflash
    from cuflash import _fwd_sm90
    from cuflash._configs import persist_walk_model, sm90_fwd_tile
    from cuflash._validate import check_qkv
    from cuflash._launch import sm_count

    from .. import harness

    sms = sm_count(torch.cuda.current_device())  # (the whole waves of this device's SMs)

    dt = getattr(torch, args.dtype)
    print(f"{args.dtype}, non-causal, GPU time (queued), medians of {args.rounds} rounds; us per Q tile; "
          "grid / whole waves: the grid count's time per tile over the mean of the two whole-wave counts'")
    print(f"{'hdim':>4} {'keys':>6} {'tile':>8} {'counts (waves)':>30} {'us per tile':>24} {'grid / whole':>12} "
          f"{'model':>6}" + (f" {'SK us':>7} {'SK / whole':>10} {'SK / grid':>9}" if args.stream_k else ""))
    for d in (int(x) for x in args.headdims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            tile = sm90_fwd_tile(d, False, s)
            bm = tile.block_m
            cases = shapes(d, s, bm, sms)
            fns, tiles, plan = {}, {}, None
            for i, (h, rows) in enumerate(cases):
                q = torch.randn(1, rows, h, d, device="cuda", dtype=dt)
                kk, vv = (torch.randn(1, s, h, d, device="cuda", dtype=dt) for _ in range(2))
                fns[i] = (lambda q=q, kk=kk, vv=vv: cuflash.flash_attn_func(q, kk, vv))
                tiles[i] = h * (rows // bm)
                if i == 0 and args.stream_k:
                    qa, ka, va = check_qkv(q, kk, vv)
                    plan = _fwd_sm90.make_plan(qa, ka, va, None, False, "stream_k")
                    fns["sk"] = (lambda plan=plan, p=(qa.ptr, ka.ptr, va.ptr): plan.run(*p))
                    tiles["sk"] = tiles[0]
            res = harness.time_rounds(fns, args.rounds, timer=harness.time_queued_ms)
            per = {i: res[i][0] * 1e3 / tiles[i] for i in fns}
            ratio = per[0] / ((per[1] + per[2]) / 2)
            model = persist_walk_model(1, False, cases[0][0], cases[0][1], s, bm, tile.block_n, sms, fixed=1.0,
                                       causal=False)
            sk = (f" {per['sk']:>7.3f} {per['sk'] / ((per[1] + per[2]) / 2):>10.3f} {per['sk'] / per[0]:>9.3f}"
                  if "sk" in per else "")
            cnt = " ".join(f"{tiles[i]} ({tiles[i] / sms:.2f})" for i in (0, 1, 2))
            us = " ".join(f"{per[i]:.3f}" for i in (0, 1, 2))
            print(f"{d:>4} {s:>6} {f'{bm}x{tile.block_n}':>8} {cnt:>30} {us:>24} {ratio:>12.3f} {model:>6.3f}{sk}",
                  flush=True)
            del fns, plan
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
