"""The pure parts of ring attention: sequence sharding (index maps), the per-step mask classification of
(q chunk, kv chunk) pairs and the attention calls it plans, and the log-sum-exp merge of partial outputs.

No torch, no GPU: every function here works on NumPy arrays, and the ones that touch arrays (shard, unshard,
merge_partials) on torch tensors too, so the CPU tests and the GPU ring run the same code.

Chunks: a global sequence of length S on N ranks is cut into C equal chunks of S / C rows (C = 2N for "zigzag",
N for "contiguous"); rank r holds chunks LAYOUTS[layout](r, N) concatenated in that order along the sequence
dimension. Zigzag (rank r holds chunks r and 2N-1-r) gives every rank the same causal work: the early chunk sees
few keys, the late one many, and the pairs sum to the same count on every rank.
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

FULL, NONE, DIAG = "full", "none", "diag"  # every key of the kv chunk visible / none / causal within the pair


def _zigzag(rank, world_size):
    return (rank, 2 * world_size - 1 - rank)


def _contiguous(rank, world_size):
    return (rank,)


LAYOUTS = {"zigzag": _zigzag, "contiguous": _contiguous}


def check_layout(layout, world_size=None) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}; got {layout!r}")
    if world_size is not None and (not isinstance(world_size, (int, np.integer)) or world_size < 1):
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")


def chunks_of(rank, world_size, layout="zigzag") -> tuple:
    """The global chunk indices rank `rank` holds, in their local order."""
    check_layout(layout, world_size)
    return LAYOUTS[layout](rank, world_size)


def num_chunks(world_size, layout="zigzag") -> int:
    return len(chunks_of(0, world_size, layout)) * world_size


def chunk_len(seqlen, world_size, layout="zigzag") -> int:
    """Rows per chunk; ValueError naming `seqlen` unless it is a multiple of the chunk count (chunks are equal so
    that every K/V shard on the ring has one shape and every diagonal pair is a square causal call)."""
    c = num_chunks(world_size, layout)
    if not isinstance(seqlen, (int, np.integer)) or seqlen < c or seqlen % c:
        raise ValueError(f"seqlen must be a positive multiple of {c} ({layout} layout on {world_size} ranks: "
                         f"{c} equal chunks); got {seqlen!r}: pad the sequence (under causal attention padding at "
                         f"the end changes no earlier row)")
    return seqlen // c


def shard_indices(seqlen, rank, world_size, layout="zigzag") -> np.ndarray:
    """The global sequence positions rank `rank` holds, in local order (int64 [seqlen / N])."""
    c = chunk_len(seqlen, world_size, layout)
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in chunks_of(rank, world_size, layout)])


def unshard_indices(seqlen, world_size, layout="zigzag") -> np.ndarray:
    """perm such that global[:, g] = concat(shards)[:, perm[g]] (the inverse of the concatenated shard maps)."""
    order = np.concatenate([shard_indices(seqlen, r, world_size, layout) for r in range(world_size)])
    perm = np.empty_like(order)
    perm[order] = np.arange(seqlen)
    return perm


def _xp(x):
    """NumPy or torch, whichever `x` belongs to (torch only if already imported)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else np


def _cat(xs, dim):
    xp = _xp(xs[0])
    return xp.cat(xs, dim) if xp is not np else np.concatenate(xs, axis=dim)


def _take(x, start, stop, dim):
    return x[(slice(None),) * dim + (slice(start, stop),)]


def shard(x, rank, world_size, layout="zigzag", dim=1):
    """Rank `rank`'s shard of a global array (NumPy or torch) along `dim` (1: the sequence of [b, s, h, d]; 2:
    that of an LSE [b, h, s]): its chunks concatenated. A copy for zigzag, a view for contiguous."""
    c = chunk_len(x.shape[dim], world_size, layout)
    parts = [_take(x, i * c, (i + 1) * c, dim) for i in chunks_of(rank, world_size, layout)]
    return parts[0] if len(parts) == 1 else _cat(parts, dim)


def unshard(shards, layout="zigzag", dim=1):
    """The global array from every rank's shard (a list in rank order): the inverse of `shard`."""
    n = len(shards)
    c = chunk_len(shards[0].shape[dim] * n, n, layout)
    per = len(chunks_of(0, n, layout))
    chunks = [None] * (n * per)
    for r, s in enumerate(shards):
        if s.shape[dim] != per * c:
            raise ValueError(f"shards[{r}] has {s.shape[dim]} rows along dim {dim}; expected {per * c}")
        for j, i in enumerate(chunks_of(r, n, layout)):
            chunks[i] = _take(s, j * c, (j + 1) * c, dim)
    return _cat(chunks, dim)


def classify(q_chunk, kv_chunk, causal) -> str:
    """How the rows of global chunk q_chunk see the keys of global chunk kv_chunk (equal chunks): FULL, NONE or
    DIAG (the same chunk: causal within it, top-left = bottom-right aligned since the pair is square)."""
    if not causal or kv_chunk < q_chunk:
        return FULL
    return DIAG if kv_chunk == q_chunk else NONE


class Block(NamedTuple):
    """One attention call of a ring step, in local chunk units: q rows [q0, q1) x kv rows [k0, k1), causal."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _runs(idx):
    """Sorted ints -> [(start, stop)] of consecutive runs."""
    out = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def plan_step(q_chunks, kv_chunks, causal) -> list:
    """The attention calls of one ring step: the rank's q chunks against the kv chunks it holds now (global chunk
    indices in local order). Pairs that see no key are skipped; pairs of the same kind and adjacent chunks become
    one call, so a zigzag step is a single call: its own shard one causal call over both chunks (increasing chunk
    indices make the local causal mask the global one), an earlier rank's shard all q x its first kv chunk, a later
    rank's shard the second q chunk x all kv."""
    q_chunks, kv_chunks = tuple(q_chunks), tuple(kv_chunks)
    nq, nk = len(q_chunks), len(kv_chunks)
    if causal and q_chunks == kv_chunks and all(a < b for a, b in zip(q_chunks, q_chunks[1:])):
        return [Block(0, nq, 0, nk, True)]
    blocks, by_kv_run = [], {}
    for a, qc in enumerate(q_chunks):
        kinds = [classify(qc, kc, causal) for kc in kv_chunks]
        blocks += [Block(a, a + 1, c, c + 1, True) for c, kind in enumerate(kinds) if kind == DIAG]
        for run in _runs([c for c, kind in enumerate(kinds) if kind == FULL]):
            by_kv_run.setdefault(run, []).append(a)
    for (k0, k1), rows in by_kv_run.items():
        blocks += [Block(a0, a1, k0, k1, False) for a0, a1 in _runs(rows)]
    return sorted(blocks)


def visible_pairs(q_chunks, kv_chunks, causal) -> float:
    """The work of a step in (chunk x chunk) units: a full pair 1, a diagonal one 1/2 (the load-balance measure)."""
    return sum({FULL: 1.0, DIAG: 0.5, NONE: 0.0}[classify(a, c, causal)] for a in q_chunks for c in kv_chunks)


def ring_source(rank, step, world_size) -> int:
    """The rank whose K/V shard rank `rank` holds at ring step `step` (shards travel to rank + 1)."""
    return (rank - step) % world_size


def merge_partials(o1, lse1, o2, lse2):
    """Merge two partial attentions over disjoint key sets: LSE = log(e^lse1 + e^lse2), O = the weights
    e^(lse_i - LSE) times O_i. O [b, s, h, d], LSE [b, h, s] (natural log); NumPy or torch (O in the wider of the
    two dtypes, float32 at least under torch). A row with LSE -inf on both sides (no key yet) stays O = 0,
    LSE = -inf: the max is replaced by 0 before subtracting, so no -inf - -inf and no 0 / 0."""
    xp = _xp(lse1)
    m = xp.maximum(lse1, lse2)
    m = xp.where(xp.isneginf(m), xp.zeros_like(m), m)
    w1, w2 = xp.exp(lse1 - m), xp.exp(lse2 - m)  # [b, h, s], in [0, 1], one of them 1 where either is finite
    total = w1 + w2
    seen = total > 0
    safe = xp.where(seen, total, xp.ones_like(total))
    lse = xp.where(seen, m + xp.log(safe), xp.full_like(m, -np.inf))
    a1 = (w1 / safe).swapaxes(1, 2)[..., None]  # [b, s, h, 1]
    a2 = (w2 / safe).swapaxes(1, 2)[..., None]
    return o1 * a1 + o2 * a2, lse
