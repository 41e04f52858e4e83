"""Diagnostic (CPU): how evenly the Hopper forward's persistent form spreads causal work over its blocks, from a list
model of its tile walks, next to a walk that hands out tiles as blocks free up.

    python -m bench.diag.fwd90_walk_model [--fixed C] [--no-causal]

The persistent form (cuflash._configs.SM90_FWD_PERSIST_VARIANTS; cuda_src/flash_fwd_sm90.cu, Sm90FwdTiles) runs one
block per SM, each walking Q tiles by a fixed rule: linear index t in waves of G blocks, block t mod G in even waves
and G - 1 - (t mod G) in odd ones, with t running over a (batch, head)'s Q tiles innermost ("qtile", heaviest tile
first) or over the (batch, head)s innermost ("bh"). A tile's work is the number of K / V tiles its rows see (causal,
bottom-right), plus C per tile (--fixed: the prologue and epilogue a tile costs, in K / V tiles; default 1). Printed
per causal FA2-grid point (batch x seqlen = 16k tokens, hidden 2048) where the persistent form is configured, with the
configured tile (cuflash._configs.sm90_fwd_tile): the largest block's work over the mean (1.000: even) for

- the two fixed walks, modelled as cuflash._configs.persist_walk_spread does (tests/test_fwd90_persist_cpu.py checks
  they agree; the fixed walk "auto" weighs is marked *);
- "qtile dyn", "bh dyn" and "group dyn": those orders and a third, each tile taken by the block that frees up first
  (greedy list scheduling: the dynamic walk, whose blocks' producers draw tiles from a counter as they free up;
  cuflash._configs.persist_walk_model). "group" walks the (batch, head)s in groups of --group (default 16), one group
  after the other, "bh"'s order inside a group: the blocks at work share the K / V of about that many heads in L2 (16
  heads of 2k keys at head dim 64: 8 MB), and every group's lightest tiles come last;
- "auto": the walk grid_order "auto" takes (the dynamic walk where cuflash._configs.sm90_persist_dynamic names a
  group, else the fixed walk marked *) and its spread.

The model leaves out memory traffic and the L2 reuse that favours "qtile" (a head's K / V read by blocks at once):
"bh" measured 0.88-0.99x "qtile" at 2k-4k although the model puts it nearer even. A spread is an upper bound on what
a better walk can gain, not a prediction of it.

--no-causal prints the points without a mask: every Q tile sees every K / V tile, times the share of its 64-row
warpgroups that hold a row (a ragged last Q tile's others take their turns empty), and the kernel walks each (batch,
head)'s tiles first to last, so that the light last tile comes last. Its last column models stream-K
(cuflash._configs.stream_k_spread: the whole waves but the last, then every block one contiguous share of the
remaining (tile, K / V tile) pairs, a tile split between two blocks merged by one of them), * where grid_order
"auto" takes it (cuflash._configs.sm90_stream_k)."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from cuflash._configs import SM90_FWD_TILES, persist_walk_model, sm90_fwd_tile

SMS, TOKENS, HIDDEN = 132, 16384, 2048
SEQLENS = (1024, 2048, 4096, 8192, 16384)


def tile_work(walk: str, batch_heads: int, seqlen: int, block_m: int, block_n: int, fixed: float = 0.0,
              group: int = 16) -> np.ndarray:
    """The work of the Q tiles in walk order (seqlen_q = seqlen_k, causal): K / V tiles seen plus `fixed`. Walks:
    "qtile", "bh", and "group": the (batch, head)s in groups of `group`, one group after the other, inside a group
    "bh"'s order (every head's heaviest tile, then the next heaviest, ...)."""
    x_tiles = -(-seqlen // block_m)
    t = np.arange(x_tiles * batch_heads, dtype=np.int64)
    if walk == "group":
        first = (t // (x_tiles * group)) * group  # the group's first (batch, head)
        size = np.minimum(group, batch_heads - first)
        x = x_tiles - 1 - (t - first * x_tiles) // size
    else:
        x = x_tiles - 1 - (t // batch_heads if walk == "bh" else t % x_tiles)
    last = np.minimum(seqlen, (x + 1) * block_m)
    return np.where(last > 0, -(-last // block_n), 0) + fixed


def _group(walk: str, batch_heads: int, group: int) -> int:
    return {"qtile": 1, "bh": batch_heads}.get(walk, group)


def fixed_spread(walk: str, batch_heads: int, seqlen: int, block_m: int, block_n: int, grid: int,
                 fixed: float = 0.0, group: int = 16, causal: bool = True) -> float:
    """The fixed walk's largest block over the mean (cuflash._configs.persist_walk_model, with `fixed` per tile)."""
    return persist_walk_model(_group(walk, batch_heads, group), False, batch_heads, seqlen, seqlen, block_m, block_n,
                              grid, fixed, causal)


def dynamic_spread(walk: str, batch_heads: int, seqlen: int, block_m: int, block_n: int, grid: int,
                   fixed: float = 0.0, group: int = 16, causal: bool = True) -> float:
    """Tiles in walk order, each to the block that frees up first: the makespan over the mean work per block
    (cuflash._configs.persist_walk_model)."""
    return persist_walk_model(_group(walk, batch_heads, group), True, batch_heads, seqlen, seqlen, block_m, block_n,
                              grid, fixed, causal)


def points(causal: bool = True):
    """(head dim, seqlen, batch, heads, tile) of the FA2-grid points (causal or not) where the persistent form is
    configured."""
    for d in sorted(SM90_FWD_TILES):
        for s in SEQLENS:
            tile = sm90_fwd_tile(d, causal, s)
            if tile.persistent:
                yield d, s, TOKENS // s, HIDDEN // d, tile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.fwd90_walk_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixed", type=float, default=1.0, help="work per tile besides its K / V tiles (default 1)")
    ap.add_argument("--sms", type=int, default=SMS)
    ap.add_argument("--group", type=int, default=16, help="(batch, head)s per group of the 'group' walk (default 16)")
    ap.add_argument("--no-causal", dest="causal", action="store_false", help="the points without a mask")
    args = ap.parse_args(argv)
    c = args.causal
    from cuflash._configs import (sm90_persist_dynamic, sm90_persist_walk, sm90_stream_k, stream_k_eligible,
                                  stream_k_spread)

    print(f"largest block's work / mean, {'causal' if c else 'no mask'}, {args.sms} SMs, {args.fixed:g} K/V tiles of fixed work per Q tile "
          "(* the fixed walk grid_order 'auto' weighs; 'auto': the walk it takes)")
    print(f"{'hdim':>4} {'seqlen':>6} {'b x h':>8} {'tile':>9} {'tiles':>6} {'qtile':>7} {'bh':>7} {'qtile dyn':>9} "
          f"{'bh dyn':>7} {'group dyn':>9} {'auto':>16}" + ("" if c else f" {'stream-K':>9}"))
    for d, s, b, h, tile in points(c):
        tiles = -(-s // tile.block_m) * b * h
        grid = min(tiles, args.sms * tile.min_blocks)
        auto = sm90_persist_walk(c, b * h, s, s, tile, grid)
        group = sm90_persist_dynamic(b * h, 1, s, s, d, tile.block_m, tile.block_n, grid, auto, c)
        cells = []
        for walk in ("qtile", "bh"):
            v = fixed_spread(walk, b * h, s, tile.block_m, tile.block_n, grid, args.fixed, causal=c)
            cells.append(f"{v:.3f}" + ("*" if walk == auto else " "))
        for walk in ("qtile", "bh", "group"):
            v = dynamic_spread(walk, b * h, s, tile.block_m, tile.block_n, grid, args.fixed, args.group, c)
            cells.append(f"{v:.3f}")
        if group:
            v = dynamic_spread("group", b * h, s, tile.block_m, tile.block_n, grid, args.fixed, group, c)
            cells.append(f"dyn g{group} {v:.3f}")
        else:
            v = fixed_spread(auto, b * h, s, tile.block_m, tile.block_n, grid, args.fixed, causal=c)
            cells.append(f"{auto} {v:.3f}")
        if not c and stream_k_eligible(False, False, tiles, -(-s // tile.block_n), grid):
            sk = stream_k_spread(b * h, s, s, tile.block_m, tile.block_n, grid, args.fixed)
            taken = sm90_stream_k(b * h, s, s, tile.block_m, tile.block_n, grid, auto, group)
            cells.append(f"{sk:.3f}" + ("*" if taken else " "))
        elif not c:
            cells.append("-")
        print(f"{d:>4} {s:>6} {f'{b} x {h}':>8} {f'{tile.block_m}x{tile.block_n}':>9} {tiles:>6} {cells[0]:>7} "
              f"{cells[1]:>7} {cells[2]:>9} {cells[3]:>7} {cells[4]:>9} {cells[5]:>16}" +
              ("" if c else f" {cells[6]:>9}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
