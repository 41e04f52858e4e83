"""Diagnostic (GPU, under Nsight Compute): the Hopper forward with explicit tiles at one FA2-grid point (batch x
seqlen = 16k tokens, hidden 2048), so that two forms of the kernel (e.g. the configured tile and its persistent form,
cuflash._configs.SM90_FWD_PERSIST_VARIANTS) can be profiled on the same inputs. Each tile runs twice to warm up
(compile, map encode), then once between torch.cuda.profiler.start() and stop():

    ncu --profile-from-start off --clock-control none --set full --import-source no -o /tmp/fwd90 \\
        python -m bench.diag.ncu_fwd90 --seqlen 4096 --headdim 128 --tiles def,persist

    bench/diag/ncu_source.sh /tmp/p flash_fwd_sm90 2 python3 -m bench.diag.ncu_fwd90 --tiles persist --no-range

Tile names: def (the configured tile at this key count), 1tile (the persistent variant's tile one per block), and
the names of SM90_FWD_MINB_VARIANTS / SM90_FWD_PERSIST_VARIANTS at this head dim; `cudnn` runs SDPA's cuDNN backend
on the same inputs (its own kernels, for the comparison). What to read: per kernel its
duration, the tensor pipe's share of its peak, the warps' stall reasons, and per SASS instruction where the stall
samples of one form exceed the other's."""
from __future__ import annotations

import argparse
from dataclasses import replace


def tiles_at(d: int, causal: bool, s: int) -> dict:
    """{name: Sm90FwdTile} reachable at head dim d, s keys."""
    from cuflash._configs import sm90_fwd_minb_tiles, sm90_fwd_persist_tiles, sm90_fwd_tile

    out = {"def": sm90_fwd_tile(d, causal, s)}
    out.update(sm90_fwd_minb_tiles(d))
    pt = sm90_fwd_persist_tiles(d)
    out.update(pt)
    if "persist" in pt:
        out["1tile"] = replace(pt["persist"], persistent=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tiles", default="def,persist", help="comma list of tile names (see the module's docstring)")
    ap.add_argument("--no-range", action="store_true",
                    help="no profiler start / stop (for ncu -k ... --launch-skip: every launch is visible)")
    args = ap.parse_args(argv)
    s, d = args.seqlen, args.headdim
    if s <= 0 or 16384 % s or d not in (64, 96, 128, 256):
        raise ValueError(f"--seqlen must divide 16384 and --headdim be 64, 96, 128 or 256; got {s}, {d}")
    avail = dict(tiles_at(d, args.causal, s), cudnn=None)
    names = [n for n in args.tiles.split(",") if n]
    bad = [n for n in names if n not in avail]
    if bad or not names:
        raise ValueError(f"--tiles: unknown {bad or names}; at head dim {d}: {sorted(avail)}")

    import torch

    from cuflash import _fwd_sm90
    from cuflash._validate import check_qkv

    from ..harness import sdpa

    h, b = 2048 // d, 16384 // s
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=getattr(torch, args.dtype)) for _ in range(3))
    qa, ka, va = check_qkv(q, k, v)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    cud = sdpa("cudnn") if "cudnn" in names else None
    calls = {}
    for n in names:
        if n == "cudnn":
            calls[n] = lambda: cud(qt, kt, vt, args.causal)
        else:
            plan = _fwd_sm90.make_plan(qa, ka, va, None, args.causal, "auto", tile=avail[n])
            calls[n] = lambda plan=plan: plan.run(qa.ptr, ka.ptr, va.ptr)
    for n, call in calls.items():
        for _ in range(2):
            call()
        print(f"{n}: {avail[n] or 'SDPA cuDNN'}", flush=True)
    torch.cuda.synchronize()
    if not args.no_range:
        torch.cuda.profiler.start()
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    if not args.no_range:
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
