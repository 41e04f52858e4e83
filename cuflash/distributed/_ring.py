"""The ring loops of ring attention, written once against two small interfaces, and the in-process drivers.

Communicator (one per rank): `rank`, `world_size`, `send_recv(tensors) -> handle` (start sending a tuple of
arrays to rank + 1 and receiving the same shapes from rank - 1; returns at once) and `wait(handle) -> tensors`
(the received tuple). Implementations: SimRing (N ranks in one process, this module), LoopbackRing (no
communication: the compute-alone timing), cuflash.distributed._torch.TorchRing (torch.distributed, NCCL or gloo).

Attention (one per run): `forward(q, k, v, causal, softmax_scale) -> (out, lse)` with out like q and lse
[b, h, sq] (natural log, float32 or wider); `backward(dout, q, k, v, out, lse, causal, softmax_scale) ->
(dq, dk, dv)` with P recomputed as exp(S - lse) and D = rowsum(dout * out) from the given (global) out and lse.
Implementations: NumpyAttention (float64, cuflash.reference), cuflash.distributed._torch.CuflashAttention.

The loops are generators: each `yield` is a point after which every rank's sends of this step have been started.
`run_lockstep` advances N of them round by round (the simulation); one real rank just runs its own to the end.
Every rank calls send_recv in the same order, so message i of rank r - 1 is message i that rank r receives.
"""
from __future__ import annotations

import numpy as np

from ._schedule import _xp, chunks_of, plan_step, ring_source, merge_partials


# ------------------------------------------------------------------------------------------ array helpers
def _zeros(shape, like):
    """An accumulator: float64 on NumPy, float32 on torch (on like's device)."""
    xp = _xp(like)
    return np.zeros(shape) if xp is np else xp.zeros(shape, dtype=xp.float32, device=like.device)


def _neg_inf(shape, like):
    xp = _xp(like)
    if xp is np:
        return np.full(shape, -np.inf)
    return xp.full(shape, float("-inf"), dtype=xp.float32, device=like.device)


def _cast(x, like):
    return x.astype(like.dtype, copy=False) if _xp(like) is np else x.to(like.dtype)


def _copy(x):
    return x.copy() if _xp(x) is np else x.clone()


# ------------------------------------------------------------------------------------------ validation
def check_shards(q, k, v, world_size, layout, softmax_scale=None):
    """Shapes of one rank's shards: q [b, s, h, d], k = v [b, s, hk, d] with h % hk == 0 and the same local s
    (self-attention over one sharded sequence), s a multiple of the rank's chunk count. Returns softmax_scale
    resolved (None: d ** -0.5)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be [batch, seqlen_local, nheads, headdim]; got shape {tuple(x.shape)}")
    b, s, h, d = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}; got {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must be [batch={b}, seqlen_local, nheads_k, headdim={d}]; got {tuple(k.shape)}")
    if h % k.shape[2]:
        raise ValueError(f"k's nheads_k ({k.shape[2]}) must divide q's nheads ({h})")
    if k.shape[1] != s:
        raise ValueError(f"k must have q's local seqlen {s} (ring attention is attention of one sequence sharded "
                         f"over the ranks: q, k and v share its sharding); got {k.shape[1]}")
    per = len(chunks_of(0, world_size, layout))
    if s == 0 or s % per:
        raise ValueError(f"q's local seqlen must be a positive multiple of {per} (the {layout} layout gives each "
                         f"rank {per} equal chunks); got {s}")
    if softmax_scale is None:
        return d ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, np.floating)):
        raise TypeError(f"softmax_scale must be a number or None; got {type(softmax_scale).__name__}")
    if not (np.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number; got {softmax_scale!r}")
    return float(softmax_scale)


# ------------------------------------------------------------------------------------------ the loops
def _steps(comm, layout, causal, c):
    """(step, row slices) of this rank: per ring step, [(q rows, kv rows, causal)] of its attention calls."""
    n, r = comm.world_size, comm.rank
    mine = chunks_of(r, n, layout)
    for step in range(n):
        theirs = chunks_of(ring_source(r, step, n), n, layout)
        yield step, [(slice(b.q0 * c, b.q1 * c), slice(b.k0 * c, b.k1 * c), b.causal)
                     for b in plan_step(mine, theirs, causal)]


def ring_forward(comm, attn, q, k, v, causal, softmax_scale, layout="zigzag"):
    """Generator: this rank's (out like q, lse [b, h, s] float32 / float64) of attention over the whole ring.

    Step s: start passing the K/V now held to rank + 1 (and receiving rank - 1's), attend to the held K/V while
    it travels, merge each call's (out, lse) into the running state (float32 / float64) by merge_partials."""
    n = comm.world_size
    b, s, h, _ = q.shape
    c = s // len(chunks_of(comm.rank, n, layout))
    out, lse = _zeros(q.shape, q), _neg_inf((b, h, s), q)  # every row starts with no key: O 0, LSE -inf
    for step, calls in _steps(comm, layout, causal, c):
        nxt = comm.send_recv((k, v)) if step + 1 < n else None  # in flight during this step's attention
        for qs, ks, cz in calls:
            o_b, l_b = attn.forward(q[:, qs], k[:, ks], v[:, ks], cz, softmax_scale)
            out[:, qs], lse[:, :, qs] = merge_partials(out[:, qs], lse[:, :, qs], o_b, l_b)
        if nxt is not None:
            yield
            k, v = comm.wait(nxt)
    return _cast(out, q), lse


def ring_backward(comm, attn, dout, q, k, v, out, lse, causal, softmax_scale, layout="zigzag"):
    """Generator: this rank's (dq, dk, dv) like (q, k, v), from the forward's final out and (global) lse.

    dQ stays here (accumulated over the steps). The K/V shards travel the ring again, each followed one step
    behind by its dK/dV accumulator (float32 / float64): at step s this rank adds its contribution to the
    accumulator of the shard it holds and passes it on; after N steps every accumulator has visited every rank
    and the last pass brings it home. The K/V pass of step s overlaps step s's kernels; the dK/dV pass of step s
    overlaps step s + 1's."""
    n = comm.world_size
    c = q.shape[1] // len(chunks_of(comm.rank, n, layout))
    dq = _zeros(q.shape, q)
    dkv = None
    for step, calls in _steps(comm, layout, causal, c):
        nxt = comm.send_recv((k, v)) if step + 1 < n else None
        dk, dv = _zeros(k.shape, k), _zeros(v.shape, v)
        for qs, ks, cz in calls:
            dq_b, dk_b, dv_b = attn.backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs],
                                             cz, softmax_scale)
            dq[:, qs] += dq_b
            dk[:, ks] += dk_b
            dv[:, ks] += dv_b
        if dkv is not None:  # the accumulator of the shard held now, from rank - 1's previous step
            dk_in, dv_in = comm.wait(dkv)
            dk += dk_in
            dv += dv_in
        dkv = comm.send_recv((dk, dv))  # to rank + 1; after the last step that is the shard's owner
        yield
        if nxt is not None:
            k, v = comm.wait(nxt)
    dk, dv = comm.wait(dkv)
    return _cast(dq, q), _cast(dk, k), _cast(dv, v)


# ------------------------------------------------------------------------------------------ drivers
def run_lockstep(gens):
    """Advance the generators of N ranks round by round (each to its next yield) until all return; their return
    values in rank order. One generator: a real rank's run."""
    gens = list(gens)
    results = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        done = []
        for i in live:
            try:
                next(gens[i])
            except StopIteration as e:
                results[i] = e.value
                done.append(i)
        if done and len(done) != len(live):
            raise RuntimeError(f"ranks {done} finished while ranks {sorted(set(live) - set(done))} did not")
        live = [i for i in live if i not in done]
    return results


class SimRing:
    """Rank `rank` of an in-process ring of `world_size` ranks sharing one mailbox; `SimRing.create(n)` makes the
    n of them. A send deposits copies (what a transfer delivers) under (receiver, message number)."""

    def __init__(self, rank, world_size, mailbox):
        self.rank, self.world_size, self._box, self._count = rank, world_size, mailbox, 0

    @classmethod
    def create(cls, world_size):
        box: dict = {}
        return [cls(r, world_size, box) for r in range(world_size)]

    def send_recv(self, tensors):
        self._count += 1
        self._box[((self.rank + 1) % self.world_size, self._count)] = tuple(_copy(t) for t in tensors)
        return self._count

    def wait(self, handle):
        try:
            return self._box.pop((self.rank, handle))
        except KeyError:
            raise RuntimeError(f"rank {self.rank}: message {handle} from rank {(self.rank - 1) % self.world_size} "
                               "has not been sent (the ranks are not in lock-step)") from None


class LoopbackRing:
    """No communication: every 'received' tuple is the one sent. With the plan of the real source rank, a rank's
    run does the same kernels on its own K/V: the compute-alone time (not the right answer for world_size > 1)."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def send_recv(self, tensors):
        return tuple(tensors)

    def wait(self, handle):
        return handle


class NumpyAttention:
    """float64 attention of cuflash.reference: the naive forward and FlashAttention-2's backward from a given
    LSE (reference.flash_backward), which is what a chunk pair needs (the global LSE and out)."""

    def forward(self, q, k, v, causal, softmax_scale):
        from .. import reference

        return reference.attention_forward(q, k, v, softmax_scale, causal)

    def backward(self, dout, q, k, v, out, lse, causal, softmax_scale):
        from .. import reference

        return reference.flash_backward(dout, q, k, v, out, lse, softmax_scale, causal)


# ------------------------------------------------------------------------------------------ simulation
def simulate_forward(attn, qs, ks, vs, causal=False, softmax_scale=None, layout="zigzag"):
    """Ring attention forward of len(qs) simulated ranks (lists of per-rank shards, rank order): (outs, lses)."""
    n = len(qs)
    if not (len(ks) == len(vs) == n and n > 0):
        raise ValueError(f"qs, ks, vs must hold one shard per rank; got {len(qs)}, {len(ks)}, {len(vs)}")
    scale = [check_shards(q, k, v, n, layout, softmax_scale) for q, k, v in zip(qs, ks, vs)][0]
    res = run_lockstep(ring_forward(c, attn, q, k, v, causal, scale, layout)
                       for c, q, k, v in zip(SimRing.create(n), qs, ks, vs))
    return [o for o, _ in res], [l for _, l in res]


def simulate_backward(attn, douts, qs, ks, vs, outs, lses, causal=False, softmax_scale=None, layout="zigzag"):
    """Ring attention backward of len(qs) simulated ranks: (dqs, dks, dvs) from the forward's outs and lses."""
    n = len(qs)
    scale = [check_shards(q, k, v, n, layout, softmax_scale) for q, k, v in zip(qs, ks, vs)][0]
    res = run_lockstep(ring_backward(c, attn, do, q, k, v, o, l, causal, scale, layout)
                       for c, do, q, k, v, o, l in zip(SimRing.create(n), douts, qs, ks, vs, outs, lses))
    return [r[0] for r in res], [r[1] for r in res], [r[2] for r in res]
