"""Diagnostic (CPU): how much of the backward's time the grid's last wave costs, from a list-scheduling model.

    python -m bench.diag.bwd_grid_model

One block per (KV tile of 128 keys, KV head, batch), as the Hopper backward launches them; each block's length is
its number of Q tiles (every Q tile under no mask; under the bottom-right causal mask with seqlen_q = seqlen_k,
those from its diagonal on); 132 SMs take the blocks one at a time in dispatch order as they free up. Printed per
FA2-grid point (batch x seqlen = 16k tokens, hidden 2048): the model's makespan over the ideal (the total work / 132)
for three dispatch orders -- "head-major", the launch (KV tile, head, batch) with the KV tile fastest, as the kernels
run today; "tile-major", every head's KV tile 0 first, then every head's tile 1, ... (under the causal mask:
longest first); and "tile-major/G", the same within groups of G (batch, head) pairs taken one group after the
other, so that the blocks running at once share the Q / dO of about G heads in L2, as in the launch's order, rather
than of every head. Per-block set-up and the blocks' memory traffic are left out."""
from __future__ import annotations

import heapq
import sys

from cuflash._configs import SM90_BWD_TILES

SMS, TOKENS, HIDDEN = 132, 16384, 2048
BLOCK_N = SM90_BWD_TILES[128].block_n  # keys per block (fixed by the kernel)


def makespan(lengths, sms=SMS):
    """Greedy list scheduling in the given order: each block starts on the first SM to free up."""
    free = [0.0] * sms
    for length in lengths:
        heapq.heappush(free, heapq.heappop(free) + length)
    return max(free)


def block_lengths(seqlen, block_m, causal, block_n=BLOCK_N):
    """Q tiles per KV tile j of block_n keys (seqlen_q = seqlen_k)."""
    n, m = -(-seqlen // block_n), -(-seqlen // block_m)
    return [m - (j * block_n) // block_m if causal else m for j in range(n)]


def grouped_block(lin, n_tiles, kv_heads, batch, group):
    """The Hopper backward's block coordinates (KV tile, KV head, batch) of linear block index `lin` (the dispatch
    order) for GROUP = `group` > 0: cuda_src/flash_bwd_sm90.cu, sm90_bwd_block, in Python."""
    pairs = kv_heads * batch
    g = lin // (group * n_tiles)
    size = min(group, pairs - g * group)
    r = lin - g * group * n_tiles
    pair = g * group + r % size
    return r // size, pair % kv_heads, pair // kv_heads


def persistent_tiles(bid, grid, n_tiles, kv_heads, batch):
    """The persistent form's tiles (KV tile, KV head, batch) of block `bid` of `grid` in its order (cuda_src/
    flash_bwd_sm90.cu, Sm90BwdTiles, in Python): wave k's linear index k grid + bid, for odd k k grid + grid - 1 - bid,
    mapped as the launch's blocks (the KV tile fastest), until one is past the last."""
    count, out, k = n_tiles * kv_heads * batch, [], 0
    while True:
        lin = k * grid + (grid - 1 - bid if k & 1 else bid)
        if lin >= count:
            return out
        pair = lin // n_tiles
        out.append((lin - pair * n_tiles, pair % kv_heads, pair // kv_heads))
        k += 1


def persistent_overhead(seqlen, heads, batch, block_m, causal, sms=SMS, block_n=BLOCK_N):
    """Makespan / ideal of the persistent form: each block's tiles fixed by persistent_tiles (no dynamic balance)."""
    lengths = block_lengths(seqlen, block_m, causal, block_n)
    n = len(lengths)
    grid = min(sms, n * heads * batch)
    loads = [sum(lengths[j] for j, _, _ in persistent_tiles(bid, grid, n, heads, batch)) for bid in range(grid)]
    return max(loads) / (sum(loads) / sms)


# stream-K's cost per split part in the model, in Q-tile iterations: the tail's partial dK, dV stored (2 x 64 KB at
# head dim 128) or the head's wait and load of it, against an iteration's ~2.5 us at head dim 128 (FA2 grid, 2k)
SK_PART = 1.0


def stream_k_overhead(seqlen, heads, batch, block_m, sms=SMS, block_n=BLOCK_N, part=SK_PART):
    """Makespan / ideal of the persistent form walking its last waves by stream-K (no mask; cuflash._configs.
    stream_k_segments, the kernel's Sm90BwdStreamK): each block's iterations plus `part` per split part it runs."""
    from cuflash._configs import stream_k_segments

    n_it = block_lengths(seqlen, block_m, False, block_n)[0]
    count = -(-seqlen // block_n) * heads * batch
    grid = min(sms, count)
    if count % grid == 0:
        return persistent_overhead(seqlen, heads, batch, block_m, False, sms, block_n)
    loads = [sum(i1 - i0 + (part if i1 - i0 < n_it else 0) for _, i0, i1 in stream_k_segments(b, grid, count, n_it))
             for b in range(grid)]
    return max(loads) / (count * n_it / sms)


def overhead(seqlen, heads, batch, block_m, causal, order, block_n=BLOCK_N):
    """Makespan / ideal for one dispatch order ("head-major", "tile-major" or "tile-major/G")."""
    lengths = block_lengths(seqlen, block_m, causal, block_n)
    pairs = batch * heads
    if order == "head-major":
        seq = [x for _ in range(pairs) for x in lengths]
    elif order == "tile-major" or order.startswith("tile-major/"):
        g = int(order.split("/")[1]) if "/" in order else pairs
        if g < 1:
            raise ValueError(f"order: tile-major/G needs G >= 1; got {order!r}")
        n = len(lengths)  # the kernel's mapping, block by block in dispatch order
        seq = [lengths[grouped_block(lin, n, heads, batch, g)[0]] for lin in range(n * pairs)]
    else:
        raise ValueError(f"order: 'head-major', 'tile-major' or 'tile-major/G'; got {order!r}")
    return makespan(seq) / (sum(seq) / SMS)


ORDERS = ("head-major", "tile-major", "tile-major/8", "tile-major/16")


def table(seqlens=(2048, 4096, 8192, 16384)):
    rows = []
    for d in (64, 128):
        for s in seqlens:
            for causal in (False, True):
                b, h = TOKENS // s, HIDDEN // d
                rows.append((d, s, causal, {o: overhead(s, h, b, SM90_BWD_TILES[d].block_m, causal, o)
                                            for o in ORDERS}))
    return rows


def main(argv=None):
    print("makespan / ideal (1.000: no tail), FA2 grid, 132 SMs")
    print(f"{'hdim':>4} {'seqlen':>6} {'causal':>6} | " + " ".join(f"{o:>13}" for o in ORDERS))
    for d, s, causal, r in table():
        print(f"{d:>4} {s:>6} {str(causal):>6} | " + " ".join(f"{r[o]:>13.3f}" for o in ORDERS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
