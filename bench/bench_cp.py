"""Context parallelism (cuflash.distributed): ring attention over the visible GPUs, one process per GPU.

With two or more GPUs: for each world size 2, 4, 8 that fits, bench/diag/ring_check.py's `bench` under torchrun
(NCCL, NVLink multicast off): per (seqlen, causal) at head dim 128, bf16, 16 heads, batch 1: the ring's time per
step (forward; forward + backward), the same loop without communication (compute alone), one GPU on the whole
sequence; records carry world_size, ms_compute_alone, overlap (compute alone / ring: 1.0 = transfers hidden),
ms_one_gpu and scaling_efficiency (one GPU / (N x ring)). With one GPU: the one-GPU baseline and the overhead of
the in-process simulation of 2 and 4 ranks (their work in turn, copies for transfers), records marked so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .harness import record, time_ms

ROOT = Path(__file__).resolve().parent.parent
SEQLENS = (131072, 262144, 524288, 1048576)


def _backend():
    import torch

    return "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80"


def _multi_gpu(world_sizes, seqlens, heads):
    recs = []
    for n in world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "cp.json")
            env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(ROOT))
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                   str(ROOT / "bench" / "diag" / "ring_check.py"), "bench", "--json", out, "--heads", str(heads),
                   "--seqlens", *map(str, seqlens)]
            r = subprocess.run(cmd, env=env, cwd=ROOT, text=True, capture_output=True)
            print(r.stdout[-6000:], flush=True)
            if r.returncode != 0 or not os.path.exists(out):
                print(f"cp: world size {n} failed (exit {r.returncode}):\n{r.stderr[-3000:]}", flush=True)
                continue
            rows = json.load(open(out))
        for x in rows:
            recs.append(record("cuflash", f"ring_zigzag_n{n}", x["mode"], x["dtype"], 1, x["heads"], x["seqlen"],
                               x["seqlen"], x["headdim"], x["causal"], x["ms"], backend=_backend(),
                               **{k: x[k] for k in ("world_size", "ms_compute_alone", "overlap", "ms_one_gpu",
                                                    "scaling_efficiency")}))
    return recs


def _one_gpu(seqlen, heads):
    """One GPU: flash_attn_func on the whole sequence and the simulated ring of 2 and 4 ranks (same GPU)."""
    import torch

    import cuflash
    from cuflash import distributed as cd

    recs, d = [], 128
    note = ("one GPU: the simulation runs the ranks' work in turn on one GPU with copies for the transfers; "
            "no communication, overlap or scaling is measured")
    for causal in (False, True):
        q, k, v = (torch.randn(1, seqlen, heads, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        do = torch.randn_like(q)

        def step(fn, grad):
            def run():
                with torch.set_grad_enabled(grad):
                    out = fn()
                    if grad:
                        torch.autograd.backward(out, do if not isinstance(out, list) else dos)
            return run

        for n in (1, 2, 4):
            qs, ks, vs = ([cd.shard(x.detach(), r, n).requires_grad_() for r in range(n)] for x in (q, k, v))
            dos = [cd.shard(do, r, n) for r in range(n)]
            for mode, grad in (("fwd", False), ("fwd_bwd", True)):
                if n == 1:
                    fn, algo = (lambda: cuflash.flash_attn_func(q, k, v, causal=causal)), "flash_attn_func"
                else:
                    fn, algo = (lambda: cd.simulated_ring_flash_attn_func(qs, ks, vs, causal=causal)), \
                        f"ring_zigzag_sim{n}"
                ms = time_ms(step(fn, grad), warmup=1, rep=3, min_warmup_ms=0)
                recs.append(record("cuflash", algo, mode, "bfloat16", 1, heads, seqlen, seqlen, d, causal, ms,
                                   backend=_backend(), world_size=1, simulated_ranks=n, note=note))
                print(f"{algo:20s} s={seqlen} causal={int(causal)} {mode:7s} {ms:9.2f} ms", flush=True)
            del qs, ks, vs, dos
    return recs


def cp(seqlens=SEQLENS, heads=16):
    import torch

    ngpu = torch.cuda.device_count()
    if ngpu >= 2:
        return _multi_gpu([n for n in (2, 4, 8) if n <= ngpu], seqlens, heads)
    return _one_gpu(min(seqlens), heads)
