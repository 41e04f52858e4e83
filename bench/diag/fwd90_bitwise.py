"""Diagnostic (GPU, compute capability 9.0): the Hopper forward of this tree against another checkout's, bit for bit,
on the same inputs -- for a change that must leave every output as it was (a kernel skipping work whose result is
exactly zero, a reordering of loads):

    python -m bench.diag.fwd90_bitwise --base DIR_OF_OLD_CHECKOUT

The old tree is imported as in `python -m bench compare` (bench/compare.py: load_tree) and both are called through
`flash_attn_func(..., backend="sm90", return_attn_probs=True)`. The cases take the one-tile kernels causal (head dim 64
above 4096 keys, 128 at 4097-8191, 256 everywhere: cuflash/_configs.py) and banded (sliding windows, a soft-capped
causal band), with sq = sk, sq < sk and sq > sk (rows that see no key) and tails of no tile's multiple, and the
persistent form (head dims 64 and 128 at 2k-4k causal, 64 and 128 non-causal; with rows that see no key and several
tiles per block). Prints one line per case (out and LSE equal, or the number of
elements that differ and the largest difference) and exits 1 if any differs.
"""
from __future__ import annotations

import argparse
import sys

CASES = [
    # (head dim, batch, seqlen_q, seqlen_k, heads, KV heads, causal, modifier keywords)
    (64, 1, 4500, 4500, 2, 1, True, {}),
    (64, 1, 4200, 6000, 2, 1, True, {}),
    (64, 1, 6000, 4500, 2, 2, True, {}),
    (64, 2, 3000, 3000, 4, 2, True, {}),
    (128, 1, 4500, 5000, 2, 1, True, {}),
    (128, 1, 5000, 4500, 2, 1, True, {}),
    (128, 1, 3000, 3100, 4, 2, True, {}),
    (256, 1, 1000, 1000, 2, 1, True, {}),
    (256, 1, 700, 1300, 2, 1, True, {}),
    (256, 1, 1300, 700, 2, 2, True, {}),
    # the persistent form: non-causal (head dim 128: 160-key stages), rows that see no key (tiles without a KV tile
    # among tiles with one), several tiles per block
    (64, 1, 3000, 2000, 2, 1, True, {}),
    (128, 1, 2500, 1200, 2, 2, True, {}),
    (64, 4, 4000, 4000, 8, 2, True, {}),
    (64, 2, 2100, 1900, 8, 8, False, {}),
    (128, 4, 2048, 2048, 16, 16, False, {}),
    (128, 2, 1500, 3000, 4, 1, False, {}),
    # without a mask, a ragged last Q tile (its warpgroups past seqlen_q take their turns empty): the persistent form's
    # dynamic walk (head dim 64 at 2k and 4k), the one-tile kernels (head dims 96 and 256, a soft-cap)
    (64, 2, 2048, 2048, 32, 32, False, {}),
    (64, 1, 4096, 4096, 32, 8, False, {}),
    (96, 1, 1000, 1300, 4, 2, False, {}),
    (256, 1, 1000, 1300, 2, 1, False, {}),
    (128, 1, 1000, 1500, 4, 2, False, dict(softcap=20.0)),
    (64, 1, 1000, 700, 4, 4, False, dict(softcap=20.0)),
]
for _d in (64, 128, 256):
    for _mods in (dict(window_size=(100, 17)), dict(window_size=(0, 0)), dict(window_size=(300, -1)),
                  dict(window_size=(-1, 50)), dict(window_size=(-1, 0), softcap=20.0),
                  dict(window_size=(1000, 0))):
        CASES.append((_d, 1, 1500, 2000, 2, 1, False, _mods))
        CASES.append((_d, 1, 2000, 1500, 2, 1, False, _mods))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.diag.fwd90_bitwise")
    ap.add_argument("--base", required=True, help="root of the other checkout (holds cuflash/ and cuda_src/)")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    args = ap.parse_args(argv)
    import torch

    import cuflash
    from bench.compare import load_tree

    base = load_tree(args.base)
    print(f"this tree: {cuflash.__file__}\nbase tree: {base.__file__}", flush=True)
    bad = 0
    for dtype in args.dtypes.split(","):
        dt = getattr(torch, dtype)
        for d, b, sq, sk, h, hk, causal, mods in CASES:
            torch.manual_seed(sq * 7 + sk + d)
            q = torch.randn(b, sq, h, d, device="cuda", dtype=dt)
            k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt) for _ in range(2))
            outs = [m.flash_attn_func(q, k, v, causal=causal, backend="sm90", return_attn_probs=True, **mods)[:2]
                    for m in (cuflash, base)]
            torch.cuda.synchronize()
            (o1, l1), (o0, l0) = outs
            same_o = torch.equal(o1.view(torch.int16), o0.view(torch.int16))
            same_l = torch.equal(l1.view(torch.int32), l0.view(torch.int32))
            tag = f"{dtype} d={d} b={b} sq={sq} sk={sk} h={h}/{hk} causal={causal}" + \
                "".join(f" {k}={v}" for k, v in mods.items())
            if same_o and same_l:
                print(f"same {tag}", flush=True)
                continue
            bad += 1
            no = int((o1.view(torch.int16) != o0.view(torch.int16)).sum())
            nl = int((l1.view(torch.int32) != l0.view(torch.int32)).sum())
            do = float((o1.float() - o0.float()).abs().nan_to_num(nan=float("inf")).max())
            print(f"DIFF {tag}: out {no} elements (max |diff| {do:.3e}), lse {nl}", flush=True)
    print(f"{bad} differ of {len(CASES) * len(args.dtypes.split(','))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
