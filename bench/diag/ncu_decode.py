"""Diagnostic (GPU, under Nsight Compute): the large decode step (b8, 32 heads, 32 KV heads, 16k cache, d128, fp16:
2 GiB of K/V, one split) read by kernels over the same bytes -- cuflash's decode kernel (the default plan; "swz" and
"padded": its swizzled ring and its padded rows, DecodeTile.swizzle), SDPA's cuDNN backend and the read sweep's "decode mimic" (bench/diag/hbm_read_sweep.py: the decode kernel's grid and
loads without its arithmetic) -- each warmed up twice, then called once between torch.cuda.profiler.start() and
stop(), so that ncu profiles exactly those calls:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section SchedulerStats --section WarpStateStats --section Occupancy \\
        --metrics lts__t_sectors.sum,lts__t_requests.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex.sum \\
        python -m bench.diag.ncu_decode [--what cuflash,swz,padded,cudnn,mimic]
    bench/diag/ncu_source.sh /tmp/decode flash_decode_kernel 1 python3 -m bench.diag.ncu_decode --what cuflash

What to read: per kernel the L2 throughput and hit rate against the DRAM throughput, and L2 sectors per DRAM byte
(lts__t_sectors.sum x 32 / dram__bytes_read.sum): the decode kernel streams 4.1-4.2 TB/s with the L2 at 95% of its
throughput, while the mimic and cuDNN stream 4.4-4.5 -- whether they do it with less L2 work per byte says whether
the difference is in the requests the decode kernel makes (the Q load, the partial writes, the ring's requests) or
elsewhere; then the warps' stall reasons (WarpStateStats) and issue slots (SchedulerStats)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

WHAT = ("cuflash", "swz", "padded", "cudnn", "mimic")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", default=",".join(WHAT), help=f"comma list of {', '.join(WHAT)}")
    ap.add_argument("--case", default=None, metavar="B,HK,S",
                    help="another decode step instead (batch, KV heads, cache length; 32 heads, d128, fp16): fresh "
                         "random caches, no mimic")
    args = ap.parse_args(argv)
    what = [w for w in args.what.split(",") if w]
    bad = [w for w in what if w not in WHAT]
    if bad:
        raise ValueError(f"--what: unknown {bad}; choose from {WHAT}")
    if args.case and "mimic" in what:
        raise ValueError("--what: the mimic reads the default step's bytes only; leave it out with --case")

    import torch

    import cuflash
    from bench import bench_read as br
    from cuflash import _configs
    from cuflash.decode import plan_for, run_plan
    from bench.diag.decode_probe import _sdpa_fn
    from bench.diag.hbm_read_sweep import BUFFER_BYTES, DECODE, MIMIC

    b, h, hk, s, d = (DECODE[k] for k in ("batch", "heads", "kv_heads", "seqlen", "headdim"))
    torch.manual_seed(0)
    if args.case:
        b, hk, s = (int(x) for x in args.case.split(","))
        kc, vc = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.float16) for _ in range(2))
    else:
        buf = torch.empty(BUFFER_BYTES // 2, dtype=torch.float16, device="cuda").normal_()
        n = b * s * hk * d
        kc, vc = buf[:n].view(b, s, hk, d), buf[n: 2 * n].view(b, s, hk, d)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.float16)
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    fns = {"cuflash": lambda: cuflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)}
    for name, swizzle in (("swz", True), ("padded", False)):
        if name in what:
            plan = plan_for(q, kc, vc, cache_seqlens=seqlens,
                            tile=replace(_configs.decode_tile(d), swizzle=swizzle))
            fns[name] = lambda plan=plan: run_plan(plan, q, kc, vc, cache_seqlens=seqlens)
    if "cudnn" in what:
        fns["cudnn"] = _sdpa_fn("cudnn", q, kc, vc, h, hk)  # (its one trial call runs here, outside the range)
    if "mimic" in what:
        prep = br.prepare(MIMIC, buf.data_ptr(), BUFFER_BYTES, out.data_ptr(),
                          stream=torch.cuda.current_stream().cuda_stream)
        fns["mimic"] = prep.launch
    for name in what:
        fn = fns[name]
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{name}: decode b{b} h{h} hk{hk} s{s} d{d} profiled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
