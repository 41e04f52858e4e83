"""Diagnostic (GPU, compute capability 9.0): where the Hopper forward's score-modifier cost comes from, in parts.

    python -m bench.diag.mod_tile_probe [--rounds N] [--seqlens 4096,8192,16384] [--headdims 64,128]

The plain causal forward runs a persistent form from 4k keys (cuflash._configs.SM90_FWD_LONG_TILES: 128-key stages at
4k, 160-key ones from 8k at head dim 128), the modifier kernels (MOD_SCORE) one block per Q tile on the base tile.
So a modifier's cost in suite `scores` mixes three things, which this probe times apart, all through
cuflash._fwd_sm90.forward, fp16, causal, batch x seqlen = 16k tokens, hidden 2048, timed in turn (bench.harness.
time_rounds, rotated), medians of `rounds` rounds:
  plain     the configured plain kernel (the persistent form at these lengths)
  plain1    the plain kernel on the base tile, one block per Q tile (SM90_FWD_TILES): the persistent form's share
  wcausal   the modifier kernel with a window that hides nothing the causal mask does not (left = seqlen_k, right = 0):
            the same tiles and products as plain1, no value modifier -- the modifier kernel's own overhead
  w4096     the window (4096, 0), Mistral's; its tiles counted (KV tiles visited over the causal ones)
  alibi     BLOOM's ALiBi slopes on the causal mask
  softcap   soft-cap 50 (Gemma 2's) on the causal mask
and each modifier variant again on the modifier kernels' persistent form ("_p": cuflash._configs.
sm90_fwd_mod_persist_tiles, the variant the plain kernel takes at that length: 160-key stages from 8k at head dim 128).
The tables: ms per variant, then plain1 / plain (structure), wcausal / plain1 (the modifier kernel at equal work),
w4096's time per tile over wcausal's, alibi / wcausal and softcap / wcausal (the value modifiers alone); and each
modifier's cost over the plain kernel, one block per tile and persistent, and the soft-cap's without a mask ("nc_":
the plain kernel without a mask, the soft-capped one block per tile and persistent).
"""
from __future__ import annotations

import argparse
import math
import sys

from .alibi_check import bloom_slopes

TOKENS, HIDDEN, WINDOW, CAP = 16384, 2048, 4096, 50.0


def _tiles(seqlen: int, block_m: int, block_n: int, left: int) -> int:
    """KV tiles the one-tile kernel visits over all Q tiles of one head (causal, window `left`; -1: none)."""
    total = 0
    for m in range(math.ceil(seqlen / block_m)):
        lo_row, hi_row = m * block_m, min(seqlen, (m + 1) * block_m) - 1
        end = hi_row // block_n + 1
        begin = 0 if left < 0 else max(0, lo_row - left) // block_n
        total += max(0, end - begin)
    return total


def run(rounds: int, seqlens, headdims) -> None:
    import torch

    from cuflash import _configs, _fwd_sm90
    from cuflash._mods import mods_for
    from cuflash._validate import check_qkv

    rows = []
    for d in headdims:
        h = HIDDEN // d
        slopes = bloom_slopes(h, "cuda")
        for s in seqlens:
            b = max(1, TOKENS // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(3))
            qa, ka, va = check_qkv(q, k, v)

            def call(window=(-1, -1), cap=0.0, alibi=None, tile=None, causal=True):
                mods = mods_for(qa, ka, causal, window, cap, alibi, None)
                return lambda: _fwd_sm90.forward(qa, ka, va, None, causal, tile=tile, mods=mods)

            base = _configs.SM90_FWD_TILES[d]
            pt = _configs.sm90_fwd_mod_persist_tiles(d)["persist n160" if d == 128 and s >= 8192 else "persist"]
            fns = {"plain": call(), "plain1": call(tile=base), "wcausal": call(window=(s, 0)),
                   "w4096": call(window=(WINDOW, 0)), "alibi": call(alibi=slopes), "softcap": call(cap=CAP),
                   "wcausal_p": call(window=(s, 0), tile=pt), "w4096_p": call(window=(WINDOW, 0), tile=pt),
                   "alibi_p": call(alibi=slopes, tile=pt), "softcap_p": call(cap=CAP, tile=pt),
                   "nc_plain": call(causal=False), "nc_softcap": call(cap=CAP, causal=False),
                   "nc_softcap_p": call(cap=CAP, tile=pt, causal=False)}
            time_point(fns, rounds, d, s, base, rows)
    report(rows)


def time_point(fns, rounds: int, d: int, s: int, tile, rows: list) -> None:
    """One (head dim, seqlen) point of this probe or bench/diag/bwd_mod_probe.py: fns timed in turn (rotated), the
    row (d, s, w4096's band on `tile`'s blocks, {variant: ms}) appended to rows and printed; fns emptied."""
    from ..harness import time_rounds

    res = {n: r[0] for n, r in time_rounds(fns, rounds, rotate=True).items()}
    band = _tiles(s, tile.block_m, tile.block_n, WINDOW) / _tiles(s, tile.block_m, tile.block_n, -1)
    rows.append((d, s, band, res))
    print(f"d={d} s={s}: " + " ".join(f"{n} {ms:.3f}" for n, ms in res.items() if ms), flush=True)
    fns.clear()


def parts_table(rows) -> None:
    """The first table of this probe and of bench/diag/bwd_mod_probe.py, from rows (head dim, seqlen, w4096's band,
    {variant: ms}): ms per variant and the ratios that take the cost apart."""
    names = ("plain", "plain1", "wcausal", "w4096", "alibi", "softcap")
    print("\n| hdim | seqlen | " + " | ".join(f"{n} ms" for n in names) + " | plain1 / plain | wcausal / plain1 | "
          "w4096 band | w4096 per tile / wcausal | alibi / wcausal | softcap / wcausal |")
    print("|---" * (2 + len(names) + 6) + "|")
    for d, s, band, r in rows:
        def ratio(a, b):
            return f"{r[a] / r[b]:.3f}" if r.get(a) and r.get(b) else "n/a"

        per_tile = f"{r['w4096'] / band / r['wcausal']:.3f}" if r.get("w4096") and r.get("wcausal") else "n/a"
        cells = [f"{r[n]:.3f}" if r.get(n) else "n/a" for n in names]
        print(f"| {d} | {s} | " + " | ".join(cells) + f" | {ratio('plain1', 'plain')} | {ratio('wcausal', 'plain1')} "
              f"| {band:.3f} | {per_tile} | {ratio('alibi', 'wcausal')} | {ratio('softcap', 'wcausal')} |")


def report(rows) -> None:
    """The tables of run()'s rows: (head dim, seqlen, w4096's band, {variant: ms})."""
    parts_table(rows)
    mods = ("wcausal", "w4096", "alibi", "softcap")
    print("\nCost over the plain kernel (time / plain's - 1; w4096: per tile of its band), one block per tile -> "
          "persistent:\n")
    print("| hdim | seqlen | " + " | ".join(mods) + " | softcap, no mask |")
    print("|---" * (3 + len(mods)) + "|")
    for d, s, band, r in rows:
        def cost(n):
            f = band if n == "w4096" else 1.0
            if not (r.get(n) and r.get(n + "_p") and r.get("plain")):
                return "n/a"
            return f"{100 * (r[n] / f / r['plain'] - 1):+.1f}% -> {100 * (r[n + '_p'] / f / r['plain'] - 1):+.1f}%"

        nc = "n/a"
        if r.get("nc_softcap") and r.get("nc_softcap_p") and r.get("nc_plain"):
            nc = (f"{100 * (r['nc_softcap'] / r['nc_plain'] - 1):+.1f}% -> "
                  f"{100 * (r['nc_softcap_p'] / r['nc_plain'] - 1):+.1f}%")
        print(f"| {d} | {s} | " + " | ".join(cost(n) for n in mods) + f" | {nc} |")


def probe_main(argv, doc: str, run_fn, what: str) -> int:
    """The command line of this probe and of bench/diag/bwd_mod_probe.py: --rounds, --seqlens, --headdims, then
    run_fn(rounds, seqlens, headdims) on a compute capability 9.0 GPU (`what` needs it), else 2."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--headdims", default="64,128")
    a = ap.parse_args(argv)
    from cuflash._loader import device_cc

    try:
        cc = device_cc(0)
    except Exception as e:  # noqa: BLE001 (no driver / GPU)
        print(f"no usable GPU: {e}")
        return 2
    if cc != 90:
        print(f"compute capability {cc}: {what} needs 9.0")
        return 2
    run_fn(a.rounds, [int(x) for x in a.seqlens.split(",")], [int(x) for x in a.headdims.split(",")])
    return 0


def main(argv=None) -> int:
    return probe_main(argv, __doc__, run, "the Hopper forward")


if __name__ == "__main__":
    sys.exit(main())
