"""The torch side of ring attention: the torch.distributed communicator, cuflash's kernels as the attention, the
autograd Function and the public entry points (cuflash.distributed's docstring)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..backward import bwd_backend, flash_attn_backward
from ..flash import flash_attn_func
from .._validate import check_backward_headdim, check_qkv
from ._ring import SimRing, check_shards, ring_backward, ring_forward, run_lockstep


class TorchRing:
    """The ring over a torch.distributed process group: send_recv posts an isend of each tensor to rank + 1 and an
    irecv of the same shape from rank - 1 (dist.batch_isend_irecv on NCCL: one grouped launch on NCCL's own
    stream, which waits for the current stream's work on the sent tensors, so the kernels launched after it on the
    current stream run while it transfers); wait() makes the current stream wait for the receives.

    stage_on_cpu: copy through host memory (gloo's send/recv take host tensors only); None: where the group's
    backend is not NCCL. One rank: no communication (the tuple comes back)."""

    def __init__(self, group=None, stage_on_cpu=None):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.nccl = "nccl" in str(dist.get_backend(group)).lower()
        self.stage = (not self.nccl) if stage_on_cpu is None else bool(stage_on_cpu)
        n = self.world_size

        def peer(i):
            return i % n if group is None else dist.get_global_rank(group, i % n)

        self.next, self.prev = peer(self.rank + 1), peer(self.rank - 1)

    def send_recv(self, tensors):
        if self.world_size == 1:
            return tuple(tensors), None, None
        sends = [t.contiguous() for t in tensors]
        device = sends[0].device
        if self.stage:
            sends = [t.cpu() for t in sends]
        bufs = [torch.empty_like(t) for t in sends]
        if self.nccl and not self.stage:
            ops = ([dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
                   + [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs])
            reqs = dist.batch_isend_irecv(ops)
        else:  # per-tensor isend / irecv (gloo): both sides post in the same order, messages match in order
            reqs = ([dist.isend(t, self.next, group=self.group) for t in sends]
                    + [dist.irecv(b, self.prev, group=self.group) for b in bufs])
        return (bufs, reqs + [sends], device)  # the sent tensors stay referenced until wait()

    def wait(self, handle):
        bufs, reqs, device = handle
        if reqs is None:
            return bufs
        for r in reqs[:-1]:
            r.wait()
        return tuple(b.to(device) for b in bufs) if self.stage else tuple(bufs)


class CuflashAttention:
    """cuflash's kernels: flash_attn_func(..., return_attn_probs=True) for (out, lse [b, h, s] float32) and
    flash_attn_backward with the given (global) out and lse. backend: the forward's (flash_attn_func's keyword;
    the backward follows as under autograd)."""

    def __init__(self, backend="auto", deterministic=False):
        self.backend, self.deterministic = backend, deterministic

    def forward(self, q, k, v, causal, softmax_scale):
        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True,
                                      backend=self.backend)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, softmax_scale):
        # lse: a row slice of the merged [b, h, s] LSE; the kernels take it contiguous
        return flash_attn_backward(dout, q, k, v, out, lse.contiguous(), softmax_scale=softmax_scale, causal=causal,
                                   deterministic=self.deterministic, backend=bwd_backend(self.backend))


class RingFlashAttnFunction(torch.autograd.Function):
    """Ring attention of n ranks' shards under autograd: n = 1 on a real rank (TorchRing), n > 1 for the
    in-process simulation (SimRing). Inputs after the options: q_0..q_{n-1}, k_0.., v_0..; outputs: out_0..,
    lse_0.. (the LSEs not differentiable). Saves q, k, v, out and the merged LSE of each rank."""

    @staticmethod
    def forward(ctx, make_comms, attn, causal, softmax_scale, layout, *qkv):
        n = len(qkv) // 3
        qs, ks, vs = ([x.contiguous() for x in qkv[i * n:(i + 1) * n]] for i in range(3))
        res = run_lockstep(ring_forward(c, attn, q, k, v, causal, softmax_scale, layout)
                           for c, q, k, v in zip(make_comms(), qs, ks, vs))
        outs, lses = [o for o, _ in res], [l for _, l in res]
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
        ctx.cfg = (make_comms, attn, causal, softmax_scale, layout, n)
        ctx.mark_non_differentiable(*lses)
        return (*outs, *lses)

    @staticmethod
    def backward(ctx, *grads):
        make_comms, attn, causal, softmax_scale, layout, n = ctx.cfg
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[i * n:(i + 1) * n] for i in range(5))
        douts = [g.contiguous() for g in grads[:n]]  # (materialized: zeros for an unused out, every rank runs)
        res = run_lockstep(ring_backward(c, attn, do, q, k, v, o, l, causal, softmax_scale, layout)
                           for c, do, q, k, v, o, l in zip(make_comms(), douts, qs, ks, vs, outs, lses))
        return (None,) * 5 + tuple(r[0] for r in res) + tuple(r[1] for r in res) + tuple(r[2] for r in res)


def _checked(qs, ks, vs, world_size, layout, softmax_scale):
    """Validate every shard (shapes for the ring, then cuflash's dtype / device / layout rules) before anything is
    sent or launched; softmax_scale resolved."""
    scale = None
    for q, k, v in zip(qs, ks, vs):
        scale = check_shards(q, k, v, world_size, layout, softmax_scale)
        check_qkv(q, k, v)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            check_backward_headdim(q.shape[3], "the backward (autograd)")  # refused before the forward runs
    return scale


def ring_flash_attn_func(q, k, v, softmax_scale=None, causal=False, group=None, layout="zigzag",
                         return_lse=False, backend="auto", deterministic=False):
    """Exact attention of a sequence sharded over the ranks of `group`, from this rank's shard.

    Args:
        q: [batch, seqlen_local, nheads, headdim]; k, v: [batch, seqlen_local, nheads_k, headdim] (GQA: nheads a
            multiple of nheads_k): this rank's rows of the global sequence under `layout` (cuflash.distributed.
            shard), float16 / bfloat16 CUDA tensors as for flash_attn_func. Every rank passes the same shapes.
        softmax_scale, causal: as flash_attn_func's, of the global sequence (causal: global position order).
        group: the torch.distributed process group (None: the default group). NCCL (the ring's transfers overlap
            the kernels) or gloo (through host memory: for tests).
        layout: "zigzag" (the default: rank r holds chunks r and 2N-1-r of 2N, equal causal work on every rank)
            or "contiguous" (rank r holds chunk r of N: causal work grows with the rank).
        return_lse: also return this rank's LSE rows [batch, nheads, seqlen_local] float32 (not differentiable).
        backend, deterministic: cuflash's kernels (flash_attn_func's keywords).

    Returns: out like q (differentiable under autograd: the backward is a ring too), and the LSE if asked.
    Every rank of the group must call it (and its backward) with the same options.

    Raises (before anything is sent or launched; messages name the argument): ValueError for shapes that do not
    fit the layout (a local seqlen that is not a multiple of the rank's chunk count; k's seqlen other than q's),
    an unknown layout, anything flash_attn_func refuses (TypeError / ValueError / NotImplementedError)."""
    comm = TorchRing(group)
    scale = _checked([q], [k], [v], comm.world_size, layout, softmax_scale)
    out, lse = RingFlashAttnFunction.apply(lambda: [comm], CuflashAttention(backend, deterministic), bool(causal),
                                           scale, layout, q, k, v)
    return (out, lse) if return_lse else out


def simulated_ring_flash_attn_func(qs, ks, vs, softmax_scale=None, causal=False, layout="zigzag",
                                   return_lse=False, backend="auto", deterministic=False):
    """ring_flash_attn_func of len(qs) simulated ranks in this process (lists of per-rank shards on one GPU, rank
    order; the same ring loop, a SimRing for the transfers): the list of outs (and of LSEs), differentiable."""
    n = len(qs)
    if not (n > 0 and len(ks) == len(vs) == n):
        raise ValueError(f"qs, ks, vs must hold one shard per rank; got {len(qs)}, {len(ks)}, {len(vs)}")
    scale = _checked(qs, ks, vs, n, layout, softmax_scale)
    res = RingFlashAttnFunction.apply(lambda: SimRing.create(n), CuflashAttention(backend, deterministic),
                                      bool(causal), scale, layout, *qs, *ks, *vs)
    outs, lses = list(res[:n]), list(res[n:])
    return (outs, lses) if return_lse else outs
