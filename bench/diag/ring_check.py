"""Ring attention (cuflash.distributed) on several processes, one per GPU, launched by torchrun:

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=N bench/diag/ring_check.py check [--backend nccl|gloo]
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=N bench/diag/ring_check.py bench --json FILE [--seqlens ...]

check: causal and not, fp16 and bf16, GQA, both layouts: the ring's out, dq, dk, dv (autograd) on every rank's
shard against the same unsharded problem run by cuflash on one GPU, both measured against the float64 reference
(the ring within 2x / 3x the one-GPU error plus half an ulp). With --backend gloo (transfers through host memory)
several processes may share one GPU: the smoke test of a one-GPU machine. Exit status 1 on a miss.

bench: per (seqlen, causal) at head dim 128, bf16: the ring's time per step (forward; forward + backward), the same
loop with no communication (LoopbackRing: compute alone), and one GPU's flash_attn_func on the whole sequence
(points whose step would take more than --max-step-s are skipped, and so are such one-GPU baselines): scaling efficiency = one-GPU time / (N x ring time), overlap = compute-alone / ring time.
Every rank runs every timed call the same number of times (the ring is collective); the time is the slowest
rank's median. Records (JSON) from rank 0, for bench/bench_cp.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _setup(backend):
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    ngpu = torch.cuda.device_count()
    torch.cuda.set_device(local % ngpu)  # gloo smoke test: several ranks on one GPU
    dist.init_process_group(backend=backend, device_id=torch.device("cuda", local % ngpu) if backend == "nccl"
                            else None)
    return dist.get_rank(), dist.get_world_size()


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _f64(x):
    return x.detach().double().cpu().numpy()


def _half_ulp(dtype, ref):
    m = float(np.abs(ref).max()) if ref.size else 0.0
    bits = {"float16": 10, "bfloat16": 7}[dtype]
    return 0.0 if m == 0 else 0.5 * 2.0 ** (np.floor(np.log2(m)) - bits)


def check(args):
    import torch

    import cuflash
    from cuflash import distributed as cd
    from cuflash import reference

    rank, n = _setup(args.backend)
    rows, ok_all = [], True
    cases = [(dt, causal, layout, h, hk) for dt in ("float16", "bfloat16") for causal in (False, True)
             for layout in ("zigzag", "contiguous") for h, hk in ((4, 4), (8, 2))]
    for dt, causal, layout, h, hk in cases:
        per = 2 if layout == "zigzag" else 1
        seqlen = n * per * args.chunk
        g = torch.Generator().manual_seed(1234)  # the same global problem on every rank
        q, k, v, do = (torch.randn(1, seqlen, hh, 64, generator=g) for hh in (h, hk, hk, h))
        q, k, v, do = (x.to("cuda", getattr(torch, dt)) for x in (q, k, v, do))
        # one GPU, the whole sequence
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out1 = cuflash.flash_attn_func(qg, kg, vg, causal=causal)
        out1.backward(do)
        one = [out1, qg.grad, kg.grad, vg.grad]
        # the ring: this rank's shard
        ql, kl, vl = (cd.shard(x, rank, n, layout).contiguous().requires_grad_() for x in (q, k, v))
        outr = cd.ring_flash_attn_func(ql, kl, vl, causal=causal, layout=layout)
        outr.backward(cd.shard(do, rank, n, layout))
        ring = [outr, ql.grad, kl.grad, vl.grad]
        torch.cuda.synchronize()
        ref_o, _ = reference.attention_forward(_f64(q), _f64(k), _f64(v), None, causal)
        refs = [ref_o] + list(reference.attention_backward(_f64(do), _f64(q), _f64(k), _f64(v), None, causal))
        errs = []
        for name, factor, r1, rr, ref in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3), one, ring, refs):
            ref_l = cd.shard(ref, rank, n, layout)
            e_ring = float(np.abs(np.nan_to_num(_f64(rr), nan=1e9) - ref_l).max())
            e_one = float(np.abs(cd.shard(_f64(r1), rank, n, layout) - ref_l).max())
            ok = e_ring <= factor * e_one + max(1e-5, _half_ulp(dt, ref_l))
            errs.append((name, e_ring, e_one, ok))
        res = _gather(errs)
        if rank == 0:
            worst = [(name, max(r[i][1] for r in res), max(r[i][2] for r in res), all(r[i][3] for r in res))
                     for i, name in enumerate(("out", "dq", "dk", "dv"))]
            ok_case = all(w[3] for w in worst)
            ok_all &= ok_case
            rows.append(f"{'ok  ' if ok_case else 'FAIL'} N={n} {args.backend:4s} {dt:8s} causal={int(causal)} "
                        f"{layout:10s} h={h}/{hk} s={seqlen:5d}  " +
                        "  ".join(f"{nm} {er:.1e}/{e1:.1e}" for nm, er, e1, _ in worst))
    if rank == 0:
        print("ring vs float64 / one GPU vs float64 (max abs error over all ranks):")
        print("\n".join(rows))
        print("RING_CHECK", "PASS" if ok_all else "FAIL", flush=True)
    ok_all = _gather(ok_all)[0]
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0 if ok_all else 1


def _timer(fn, warmup, rep):
    """Median ms of fn over `rep` runs, each between barriers (every rank runs it the same number of times)."""
    import torch
    import torch.distributed as dist

    from bench.harness import event_median_ms

    for _ in range(warmup):
        fn()

    def sync():
        dist.barrier()
        torch.cuda.synchronize()

    return event_median_ms(fn, rep, before=sync)


def bench(args):
    import torch

    import cuflash
    from cuflash import distributed as cd
    from cuflash.distributed._torch import CuflashAttention, RingFlashAttnFunction

    rank, n = _setup("nccl")
    dt = torch.bfloat16
    h, d, recs = args.heads, 128, []
    from cuflash.reference import attention_flops

    def est_s(seqlen, causal, gpus):  # one forward + backward step per GPU at an assumed 400 TFLOP/s
        return attention_flops(1, h, seqlen, seqlen, d, causal, "fwd_bwd") / gpus / 4e14

    for seqlen in args.seqlens:
        for causal in (False, True):
            if est_s(seqlen, causal, n) > args.max_step_s:
                if rank == 0:
                    print(f"N={n} s={seqlen:8d} causal={int(causal)} skipped: about {est_s(seqlen, causal, n):.0f} s "
                          f"per step (--max-step-s {args.max_step_s})", flush=True)
                continue
            g = torch.Generator(device="cuda").manual_seed(0)
            ql, kl, vl = (torch.randn(1, seqlen // n, h, d, device="cuda", dtype=dt, generator=g)
                          .requires_grad_() for _ in range(3))
            dol = torch.randn(1, seqlen // n, h, d, device="cuda", dtype=dt, generator=g)
            attn = CuflashAttention()
            scale = d ** -0.5

            def ring(comms, grad):
                def fn():
                    with torch.set_grad_enabled(grad):
                        out, _ = RingFlashAttnFunction.apply(comms, attn, causal, scale, "zigzag", ql, kl, vl)
                        if grad:
                            out.backward(dol)
                return fn

            real = cd.TorchRing()
            loop = cd.LoopbackRing(rank, n)
            t = {}
            for mode, grad in (("fwd", False), ("fwd_bwd", True)):
                t[mode] = _timer(ring(lambda: [real], grad), args.warmup, args.rep)
                t[mode + "_compute"] = _timer(ring(lambda: [loop], grad), args.warmup, args.rep)
            if est_s(seqlen, causal, 1) <= args.max_step_s:  # one GPU, the whole sequence (every rank in parallel: its own GPU)
                qf, kf, vf = (torch.randn(1, seqlen, h, d, device="cuda", dtype=dt, generator=g).requires_grad_()
                              for _ in range(3))
                dof = torch.randn_like(qf)

                def one(grad):
                    def fn():
                        with torch.set_grad_enabled(grad):
                            out = cuflash.flash_attn_func(qf, kf, vf, causal=causal)
                            if grad:
                                out.backward(dof)
                    return fn
                t["fwd_one"], t["fwd_bwd_one"] = _timer(one(False), 1, args.rep), _timer(one(True), 1, args.rep)
                del qf, kf, vf, dof
            worst = {key: max(x[key] for x in _gather(t)) for key in t}
            for mode in ("fwd", "fwd_bwd"):
                one_ms = worst.get(mode + "_one")
                recs.append(dict(mode=mode, seqlen=seqlen, causal=causal, heads=h, headdim=d, dtype="bfloat16",
                                 world_size=n, ms=worst[mode], ms_compute_alone=worst[mode + "_compute"],
                                 ms_one_gpu=one_ms, overlap=worst[mode + "_compute"] / worst[mode],
                                 scaling_efficiency=None if one_ms is None else one_ms / (n * worst[mode])))
                if rank == 0:
                    r = recs[-1]
                    eff = "-" if one_ms is None else f"{r['scaling_efficiency']:.2f}"
                    print(f"N={n} s={seqlen:8d} causal={int(causal)} {mode:7s} ring {r['ms']:9.2f} ms  compute "
                          f"alone {r['ms_compute_alone']:9.2f} ms  one GPU {one_ms or float('nan'):9.2f} ms  "
                          f"overlap {r['overlap']:.2f}  efficiency {eff}", flush=True)
            del ql, kl, vl, dol
            torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    c.add_argument("--chunk", type=int, default=96, help="rows per chunk (seqlen = N x chunks per rank x this)")
    b = sub.add_parser("bench")
    b.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    b.add_argument("--heads", type=int, default=16)
    b.add_argument("--max-step-s", type=float, default=3.0,
                   help="skip points (and one-GPU baselines) whose step would take longer, at 400 TFLOP/s per GPU")
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--rep", type=int, default=3)
    b.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (launchers set it too)
    return check(args) if args.cmd == "check" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
