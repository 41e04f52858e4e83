"""Diagnostic (GPU, compute capability 9.0): the sm90 forward's tile, turn-taking, persistent-form and grid-order
variants at a few FA2-grid points, next to SDPA's cuDNN backend, timed in turn (medians of rounds):

    python -m bench.diag.sm90_variants [--rounds N] [--points DTYPE:D:S[:B],...] [--causal-only] [--only LABEL,...]
        [--json FILE]

Each variant is a cuflash._configs.Sm90FwdTile (block_n, consumer warpgroups, stages, pingpong, persistent) and a
grid order (for the persistent form, the walk of its tiles: cuda_src/flash_fwd_sm90.cu, Sm90FwdTiles); every variant
keeps the configured tile's epilogue (o_tma). Each is timed through a memoized plan (cuflash._fwd_sm90.make_plan: its
tensor maps encoded once), as the public calls run, so the ratios to cuDNN are a suite's."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

from cuflash._configs import SM90_FWD_PERSIST_VARIANTS, SM90_FWD_TILES, Sm90FwdTile

POINTS = (("float16", 64, 8192), ("float16", 128, 8192), ("float16", 256, 4096), ("bfloat16", 128, 2048),
          ("float16", 64, 2048))


def variants(d, causal, only=None):
    """(label, tile, grid_order) of the variants timed at head dim d (only: the labels kept; None: all)."""
    base = SM90_FWD_TILES[d]
    out = [(base, "qtile"), (base, "bh")] if causal else [(base, "auto")]

    def tile(*args, **kw):  # a variant with the configured tile's epilogue (o_tma), so only the loop differs
        return Sm90FwdTile(*args, o_tma=base.o_tma, **kw)

    pers = [replace(base, **f) for f in SM90_FWD_PERSIST_VARIANTS.get(d, {}).values()]
    if d == 64:
        out += [(replace(base, stages=3), "auto")]
        # two consumer warpgroups (128-row Q tiles, 240 registers each) in the persistent form
        pers += [replace(pers[0], nwg=2, regs_mma=240, block_n=n) for n in (128, 176)]
    if d == 128:
        out += [(tile(176, 2), "auto"), (tile(160, 2), "auto"), (replace(base, stages=3), "auto")]
        pers += [replace(pers[0], block_n=n) for n in (144, 160)]
    # the configured persistent tiles without turn-taking: each consumer issues its products when ready, so a
    # warpgroup's epilogue no longer holds the next consumer's turn
    pers += [replace(t, pingpong=False) for t in pers[:len(SM90_FWD_PERSIST_VARIANTS.get(d, {}))]]
    for t in pers:
        out += [(t, "qtile"), (t, "bh")] if causal else [(t, "auto")]
    out = [(label(t, go), t, go) for t, go in out]
    return [v for v in out if only is None or v[0] in only]


def points(argv):
    """(dtype, head dim, seqlen, batch) of POINTS (FA2 grid: batch 16k / seqlen), or those named by --points
    (DTYPE:D:S or DTYPE:D:S:B, comma-separated)."""
    if "--points" not in argv:
        return tuple((dt, d, s, max(1, 16384 // s)) for dt, d, s in POINTS)
    out = []
    for item in argv[argv.index("--points") + 1].split(","):
        dt, d, s, *b = item.split(":")
        out.append((dt, int(d), int(s), int(b[0]) if b else max(1, 16384 // int(s))))
    return tuple(out)


def specs(pts=None, masks=(False, True), only=None):
    from cuflash._configs import sm90_fwd_spec

    pts = points([]) if pts is None else pts
    return list(dict.fromkeys(sm90_fwd_spec(dt, d, c, t) for dt, d, *_ in pts for c in masks
                              for _, t, _ in variants(d, c, only)))


def label(t, go="auto"):
    return (f"{'P' if t.persistent else ''}n{t.block_n}-wg{t.nwg}-st{t.stages}-p{int(t.pingpong)}"
            f"{'' if go == 'auto' else '-' + go}")


def main(argv):
    import torch

    from cuflash import _fwd_sm90
    from cuflash._validate import check_qkv

    from ..harness import record, sdpa, time_rounds

    from cuflash.precompile import compile_specs

    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 4
    only = set(argv[argv.index("--only") + 1].split(",")) if "--only" in argv else None
    pts = points(argv)
    masks = (True,) if "--causal-only" in argv else (False, True)
    compile_specs(specs(pts, masks, only))
    recs = []
    for dtype, d, s, b in pts:
        h = 2048 // d
        dt = getattr(torch, dtype)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        qa, ka, va = check_qkv(q, k, v)
        for causal in masks:
            fns = {}
            for lab, t, go in variants(d, causal, only):
                plan = _fwd_sm90.make_plan(qa, ka, va, None, causal, go, tile=t)
                fns[lab] = lambda plan=plan: plan.run(qa.ptr, ka.ptr, va.ptr)
            cud = sdpa("cudnn")
            fns["cudnn"] = lambda: cud(qt, kt, vt, causal)
            res = time_rounds(fns, rounds)
            line = []
            for name, (ms, per) in res.items():
                r = record("cuflash" if name != "cudnn" else "cudnn", name, "fwd", dtype, b, h, s, s, d, causal, ms,
                           backend="sm90" if name != "cudnn" else None, round_ms=per)
                recs.append(r)
                line.append(f"{name}={r['tflops']:.0f}" if r["tflops"] else f"{name}=n/a")
            print(f"{dtype} d={d} b={b} s={s} causal={causal}: " + " ".join(line), flush=True)
    if "--json" in argv:
        with open(argv[argv.index("--json") + 1], "w") as f:
            json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
