"""Context parallelism: ring attention over a sequence sharded across ranks (torch.distributed, NCCL).

* `ring_flash_attn_func(q, k, v, softmax_scale=None, causal=False, group=None, layout="zigzag", ...)`: exact
  attention of the whole sequence from this rank's shard ([batch, seqlen_local, heads, headdim]), forward and
  torch autograd backward, K/V passed around the ring while cuflash's kernels attend to the shard held.
* `shard(x, rank, world_size, layout, dim=1)` / `unshard(shards, layout, dim=1)`: the sharding of a global
  sequence (zigzag: rank r holds chunks r and 2N-1-r of 2N, every rank the same causal work).
* `simulated_ring_flash_attn_func(qs, ks, vs, ...)`: the same on N simulated ranks in one process (lists of
  shards; one GPU), differentiable; `simulate_forward` / `simulate_backward`: on NumPy float64 too (CPU).

The schedule, sharding and merge (`_schedule`) and the ring loops (`_ring`) import neither torch nor CuPy; the
torch parts (`_torch`) load on first use.
"""
from ._ring import (LoopbackRing, NumpyAttention, SimRing, check_shards, ring_backward, ring_forward,
                    run_lockstep, simulate_backward, simulate_forward)
from ._schedule import (DIAG, FULL, LAYOUTS, NONE, Block, chunk_len, chunks_of, classify, merge_partials,
                        num_chunks, plan_step, ring_source, shard, shard_indices, unshard, unshard_indices,
                        visible_pairs)

_TORCH_NAMES = ("ring_flash_attn_func", "simulated_ring_flash_attn_func", "RingFlashAttnFunction", "TorchRing",
                "CuflashAttention")

__all__ = ["ring_flash_attn_func", "simulated_ring_flash_attn_func", "shard", "unshard", "shard_indices",
           "unshard_indices", "chunks_of", "chunk_len", "num_chunks", "classify", "plan_step", "visible_pairs",
           "merge_partials", "ring_source", "ring_forward", "ring_backward", "run_lockstep", "simulate_forward",
           "simulate_backward", "SimRing", "LoopbackRing", "NumpyAttention", "TorchRing", "CuflashAttention",
           "RingFlashAttnFunction", "check_shards", "Block", "FULL", "NONE", "DIAG", "LAYOUTS"]


def __getattr__(name):
    if name in _TORCH_NAMES:
        from . import _torch

        return getattr(_torch, name)
    raise AttributeError(f"module 'cuflash.distributed' has no attribute {name!r}")
